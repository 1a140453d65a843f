#!/usr/bin/env python3
"""The chaos program's MCP server (stdio, newline-delimited JSON-RPC): tools whose outcome
the runtime cannot know.

  hang   never answers, even when cancelled: the call ends unknown at the server's timeout.
  drop   exits the process in the middle of the call: the connection drops after sending.
  flaky  deduplicates by the call's idempotency key, as a `keyed` tool must; its first
         `stalls` attempts of a key never answer (the first one does the work), later ones
         answer what the first did.

Every call it executes is recorded in the directory CHAOS_MCP_LOG as a file of its own, one
JSON object (`exec`, or `replay` for a deduplicated one) with its idempotency key, made
durable before the call goes on: the processes that start this server are killed at random,
and the checks read the records after. A record is written to a temporary file and renamed
into place, so a kill leaves a whole record or none — an append to one shared file could be
cut short by a kill in the middle of the write and run into the next record. The directory
is shared by the servers of every `ratchet` process, so the deduplication survives restarts
and reaches across processes.
"""

import json
import os
import sys
import threading
import time
import urllib.parse

LOG = os.environ["CHAOS_MCP_LOG"]
os.makedirs(LOG, exist_ok=True)
KEY_META = "ratchet/idempotency_key"

write_lock = threading.Lock()
flaky_lock = threading.Lock()


def record(kind, tool, key, line):
    entry = json.dumps({"kind": kind, "tool": tool, "key": key, "line": line,
                        "pid": os.getpid()})
    # Named so that names sort in the order of the calls, and a key's records are found by name.
    name = "%020d-%d-%s" % (time.time_ns(), os.getpid(), urllib.parse.quote(key, safe=""))
    temporary = os.path.join(LOG, "." + name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, entry.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temporary, os.path.join(LOG, name + ".json"))
    directory = os.open(LOG, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def recorded(key):
    suffix = "-%s.json" % urllib.parse.quote(key, safe="")
    entries = []
    for name in sorted(os.listdir(LOG)):
        if name.endswith(suffix):
            with open(os.path.join(LOG, name)) as f:
                entries.append(json.load(f))
    return [e for e in entries if e["key"] == key]


def send(message):
    with write_lock:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def answer(id, text):
    send({"jsonrpc": "2.0", "id": id,
          "result": {"content": [{"type": "text", "text": text}]}})


def never_answer():
    threading.Event().wait()


def schema():
    return {"type": "object", "required": ["line"],
            "properties": {"line": {"type": "string"},
                           "stalls": {"type": "integer", "minimum": 0}}}


TOOLS = [
    {"name": "hang", "description": "Never answers.", "inputSchema": schema()},
    {"name": "drop", "description": "Exits mid-call.", "inputSchema": schema()},
    {"name": "flaky", "description": "Deduplicates by key; stalls at first.",
     "inputSchema": schema()},
]


def call(id, params):
    name = params.get("name")
    args = params.get("arguments") or {}
    key = (params.get("_meta") or {}).get(KEY_META, "")
    line = args.get("line", "")
    if name == "hang":
        record("exec", name, key, line)
        never_answer()
    elif name == "drop":
        record("exec", name, key, line)
        os._exit(1)
    elif name == "flaky":
        with flaky_lock:
            earlier = recorded(key)
            done = any(e["kind"] == "exec" for e in earlier)
            record("replay" if done else "exec", name, key, line)
        if len(earlier) < args.get("stalls", 0):
            never_answer()
        answer(id, "%s done once under %s" % (line, key))
    else:
        send({"jsonrpc": "2.0", "id": id,
              "error": {"code": -32602, "message": "unknown tool %s" % name}})


def handle(message):
    method = message.get("method")
    id = message.get("id")
    params = message.get("params") or {}
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": id, "result": {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "ratchet-chaos", "version": "1"},
        }})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": id, "result": {"tools": TOOLS}})
    elif method == "tools/call":
        threading.Thread(target=call, args=(id, params), daemon=True).start()
    elif method == "ping":
        send({"jsonrpc": "2.0", "id": id, "result": {}})
    elif id is not None:
        send({"jsonrpc": "2.0", "id": id,
              "error": {"code": -32601, "message": "method not found: %s" % method}})


for text in sys.stdin:
    if text.strip():
        handle(json.loads(text))
