#!/usr/bin/env python3
"""A small MCP server over stdio (newline-delimited JSON-RPC) for Ratchet's tests.

It is written from the specification, not with an SDK, so that Ratchet's client is checked
against a second implementation. Tools are listed on two pages (`nextCursor`).

Environment:
  MCP_TEST_LOG   file to which it appends what happened (`start`, `cancelled ID`, `meta ...`)
  MCP_TEST_MODE  `fail_start`: writes to stderr and exits before answering anything;
                 `die_after_first_start`: works the first time, then (a marker file next to
                 the log exists) exits at once, like a server that dies at every restart;
                 `tools_change`: also lists `evolve`, which replaces `add` with `shout` and
                 then sends `notifications/tools/list_changed`.
"""

import json
import os
import sys
import threading
import time

LOG = os.environ.get("MCP_TEST_LOG")
MODE = os.environ.get("MCP_TEST_MODE", "")
KNOWN_VERSIONS = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"]

write_lock = threading.Lock()
cancelled = set()
evolved = False


def log(line):
    if LOG:
        with open(LOG, "a") as f:
            f.write(line + "\n")


def send(message):
    with write_lock:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def result(id, value):
    send({"jsonrpc": "2.0", "id": id, "result": value})


def text(value, is_error=False):
    answer = {"content": [{"type": "text", "text": value}]}
    if is_error:
        answer["isError"] = True
    return answer


def obj(properties, required=()):
    return {"type": "object", "properties": properties, "required": list(required)}


PAGE_1 = [
    {"name": "echo", "description": "Echoes its text.",
     "inputSchema": obj({"text": {"type": "string"}}, ["text"])},
    {"name": "add", "description": "Adds two integers.",
     "inputSchema": obj({"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"])},
    {"name": "fail", "description": "Always fails.", "inputSchema": obj({})},
    {"name": "bad name!", "description": "A name no model may be given.", "inputSchema": obj({})},
]
PAGE_2 = [
    {"name": "slow", "title": "Sleeps, then answers",
     "inputSchema": obj({"ms": {"type": "integer"}}, ["ms"])},
    {"name": "crash", "description": "Exits the process mid-call.", "inputSchema": obj({})},
    {"name": "meta", "description": "Returns the request's _meta.", "inputSchema": obj({})},
    {"name": "env", "description": "Returns an environment variable.",
     "inputSchema": obj({"name": {"type": "string"}}, ["name"])},
    {"name": "mixed", "description": "Returns several kinds of content.",
     "inputSchema": obj({})},
    {"name": "refuse", "description": "Answers with a JSON-RPC error.", "inputSchema": obj({})},
]


EVOLVE = {"name": "evolve", "description": "Changes this server's tools.",
          "inputSchema": obj({})}
SHOUT = {"name": "shout", "description": "Echoes its text in capitals.",
         "inputSchema": obj({"text": {"type": "string"}}, ["text"])}


def tools_page(page):
    """A page of the tools as they are now."""
    if MODE != "tools_change":
        return page
    if page is PAGE_2:
        return PAGE_2 + [EVOLVE]
    if evolved:
        return [tool for tool in PAGE_1 if tool["name"] != "add"] + [SHOUT]
    return page


def call(id, params):
    global evolved
    name = params.get("name")
    args = params.get("arguments") or {}
    if name == "evolve":
        evolved = True
        log("evolved")
        result(id, text("evolved"))
        send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    elif name == "shout" and evolved:
        result(id, text(args["text"].upper()))
    elif name == "add" and evolved:
        send({"jsonrpc": "2.0", "id": id,
              "error": {"code": -32602, "message": "unknown tool add"}})
    elif name == "echo":
        result(id, text(args["text"]))
    elif name == "add":
        result(id, text(str(args["a"] + args["b"])))
    elif name == "fail":
        result(id, text("it failed on purpose", is_error=True))
    elif name == "refuse":
        send({"jsonrpc": "2.0", "id": id, "error": {"code": -32000, "message": "not today"}})
    elif name == "slow":
        log("slow started %s" % id)
        deadline = time.monotonic() + args["ms"] / 1000
        while time.monotonic() < deadline:
            if id in cancelled:
                # A cancelled request gets no answer (the specification says so).
                return
            time.sleep(0.01)
        result(id, text("slept %d ms" % args["ms"]))
    elif name == "crash":
        log("crash")
        sys.stderr.write("crashing on purpose\n")
        sys.stderr.flush()
        os._exit(3)
    elif name == "meta":
        log("meta " + json.dumps(params.get("_meta"), sort_keys=True))
        result(id, text(json.dumps(params.get("_meta"), sort_keys=True)))
    elif name == "env":
        result(id, text(os.environ.get(args["name"], "<unset>")))
    elif name == "mixed":
        result(id, {
            "content": [
                {"type": "text", "text": "a picture:"},
                {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"},
            ],
            "structuredContent": {"width": 1, "height": 1},
        })
    else:
        send({"jsonrpc": "2.0", "id": id,
              "error": {"code": -32602, "message": "unknown tool %s" % name}})


def handle(message):
    method = message.get("method")
    id = message.get("id")
    params = message.get("params") or {}
    if method == "initialize":
        asked = params.get("protocolVersion")
        result(id, {
            "protocolVersion": asked if asked in KNOWN_VERSIONS else KNOWN_VERSIONS[-1],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "ratchet-test-stdio", "version": "1"},
        })
    elif method == "notifications/initialized":
        pass
    elif method == "notifications/cancelled":
        cancelled.add(params.get("requestId"))
        log("cancelled %s" % params.get("requestId"))
    elif method == "ping":
        result(id, {})
    elif method == "tools/list":
        if params.get("cursor") == "page-2":
            result(id, {"tools": tools_page(PAGE_2)})
        else:
            result(id, {"tools": tools_page(PAGE_1), "nextCursor": "page-2"})
    elif method == "tools/call":
        threading.Thread(target=call, args=(id, params), daemon=True).start()
    elif id is not None:
        send({"jsonrpc": "2.0", "id": id,
              "error": {"code": -32601, "message": "method not found: %s" % method}})


def main():
    log("start")
    if MODE == "fail_start":
        sys.stderr.write("cannot open the database: permission denied\n")
        sys.exit(1)
    if MODE == "die_after_first_start" and LOG:
        marker = LOG + ".started"
        if os.path.exists(marker):
            sys.stderr.write("dying at once\n")
            sys.exit(1)
        open(marker, "w").close()
    for line in sys.stdin:
        line = line.strip()
        if line:
            handle(json.loads(line))


main()
