// How a stream resumes, against a local HTTP server that misbehaves on purpose in ways a real
// deployment can (a connection cut mid-event, a proxy's 503, a replay that overlaps what was
// already sent): the cursor sent back, duplicates skipped, live activity passed through.

import { test } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { Client, RatchetError, isStoredEvent } from "../dist/index.js";

const SESSION = "ses_stream";

function stored(seq, kind = "step.committed") {
  const event = { seq, session_id: SESSION, run_id: "run_r", kind, payload: {}, created_at: 1 };
  return `id: ${seq}\nevent: ${kind}\ndata: ${JSON.stringify(event)}\n\n`;
}

function activity() {
  const event = { session_id: SESSION, run_id: "run_r", kind: "activity", live: true, payload: { activity: "calling_model" }, created_at: 1 };
  return `event: activity\ndata: ${JSON.stringify(event)}\n\n`;
}

// A server that answers its n-th connection with `script[n]`, recording each request's
// `Last-Event-ID`.
async function scriptedServer(script) {
  const cursors = [];
  const http = createServer((request, response) => {
    const answer = script[Math.min(cursors.length, script.length - 1)];
    cursors.push(request.headers["last-event-id"]);
    answer(response);
  });
  await new Promise((resolve) => http.listen(0, "127.0.0.1", resolve));
  return {
    url: `http://127.0.0.1:${http.address().port}`,
    cursors,
    async stop() {
      http.closeAllConnections();
      await new Promise((resolve) => http.close(resolve));
    },
  };
}

const overloaded = (response) =>
  response.writeHead(503, { "Content-Type": "application/json" }).end('{"error": {"code": "unavailable", "message": "try again"}}');

test("a cut connection and a 503 are retried from the last seq, and a replay's overlap is skipped", async () => {
  const server = await scriptedServer([
    (response) => {
      response.writeHead(200, { "Content-Type": "text/event-stream" });
      // Cut in the middle of the third event: it was never whole, so it is not yielded.
      response.write("retry: 10\n\n" + stored(1) + activity() + stored(2) + stored(3).slice(0, 20));
      setTimeout(() => response.socket.destroy(), 50);
    },
    overloaded,
    (response) => {
      response.writeHead(200, { "Content-Type": "text/event-stream" });
      response.end(stored(1) + stored(2) + stored(3) + activity() + stored(4, "run.finished"));
    },
  ]);
  try {
    const client = new Client({ baseUrl: server.url });
    const seen = [];
    for await (const event of client.events(SESSION, { maxReconnectMs: 10_000 })) {
      seen.push(isStoredEvent(event) ? event.seq : event.kind);
      if (event.kind === "run.finished") break;
    }
    assert.deepEqual(seen, [1, "activity", 2, 3, "activity", 4]);
    assert.deepEqual(server.cursors, [undefined, "2", "2"], "each reconnection resumed after seq 2");
  } finally {
    await server.stop();
  }
});

test("after starts the stream at that seq, and follow: false ends it when the server does", async () => {
  const server = await scriptedServer([
    (response) => {
      response.writeHead(200, { "Content-Type": "text/event-stream" });
      response.end(stored(5) + stored(6) + stored(7));
    },
  ]);
  try {
    const client = new Client({ baseUrl: server.url });
    const seqs = [];
    for await (const event of client.runEvents("run_r", { after: 5, follow: false })) seqs.push(event.seq);
    assert.deepEqual(seqs, [6, 7], "seq 5 was already seen");
    assert.deepEqual(server.cursors, ["5"]);
  } finally {
    await server.stop();
  }
});

test("a stream gives up with the last failure once its reconnection time is spent", async () => {
  const server = await scriptedServer([overloaded]);
  try {
    const client = new Client({ baseUrl: server.url });
    const started = Date.now();
    const error = await client.events(SESSION, { maxReconnectMs: 500 }).next().then(assert.fail, (e) => e);
    assert.ok(error instanceof RatchetError, String(error));
    assert.equal(error.status, 503);
    assert.equal(error.code, "unavailable");
    assert.ok(server.cursors.length >= 2, "it tried again before giving up");
    assert.ok(Date.now() - started < 5_000, "within about its reconnection time");
  } finally {
    await server.stop();
  }
});
