// `createSession` and `sendMessage` send an `Idempotency-Key`: a message sent again with its key
// is taken once, and a request that may or may not have arrived is sent again with the same key,
// so that it is carried out once.

import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { connect, createServer as createTcpServer } from "node:net";
import { Client, NetworkError, RatchetError } from "../dist/index.js";
import { DEADLINE_MS, Server, skipWithoutServer } from "../test-support/ratchet.mjs";

const UUID_V4 = /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;

// A TCP proxy in front of the server. The first request of each of the first `drops`
// connections reaches the server, which carries it out and answers, but the connection is then
// reset without passing the answer on: the client cannot know whether its request arrived.
// Every other connection is passed through. `keys` holds the `Idempotency-Key` of each
// connection's first request.
class DroppingProxy {
  static async start(upstreamUrl, { drops = 1 } = {}) {
    const proxy = new DroppingProxy(new URL(upstreamUrl), drops);
    await new Promise((resolve) => proxy.tcp.listen(0, "127.0.0.1", resolve));
    proxy.url = `http://127.0.0.1:${proxy.tcp.address().port}`;
    return proxy;
  }

  constructor(upstream, drops) {
    this.upstream = upstream;
    this.drops = drops;
    this.keys = [];
    this.sockets = new Set();
    this.tcp = createTcpServer((downstream) => this.serve(downstream));
  }

  serve(downstream) {
    this.sockets.add(downstream);
    downstream.on("error", () => {});
    let buffered = Buffer.alloc(0);
    const onData = (chunk) => {
      buffered = Buffer.concat([buffered, chunk]);
      const end = buffered.indexOf("\r\n\r\n");
      if (end < 0) return;
      const head = buffered.subarray(0, end).toString("latin1");
      if (buffered.length < end + 4 + Number(headerOf(head, "content-length") ?? 0)) return;
      downstream.off("data", onData);
      downstream.pause();
      this.keys.push(headerOf(head, "idempotency-key"));
      this.forward(downstream, buffered);
    };
    downstream.on("data", onData);
  }

  forward(downstream, request) {
    const upstream = connect(Number(this.upstream.port), this.upstream.hostname);
    this.sockets.add(upstream);
    upstream.on("error", () => downstream.destroy());
    upstream.write(request);
    if (this.drops > 0) {
      this.drops -= 1;
      // The answer's first bytes: the server has carried the request out and kept its answer.
      upstream.once("data", () => {
        upstream.destroy();
        downstream.resetAndDestroy();
      });
      return;
    }
    downstream.pipe(upstream);
    upstream.pipe(downstream);
  }

  async stop() {
    for (const socket of this.sockets) socket.destroy();
    await new Promise((resolve) => this.tcp.close(resolve));
  }
}

function headerOf(head, name) {
  for (const line of head.split("\r\n").slice(1)) {
    const colon = line.indexOf(":");
    if (line.slice(0, colon).trim().toLowerCase() === name) return line.slice(colon + 1).trim();
  }
  return undefined;
}

// A `fetch` that records the `Idempotency-Key` of every request it sends.
function recordingFetch(keys) {
  return (url, init) => {
    keys.push(init.headers?.["Idempotency-Key"]);
    return fetch(url, init);
  };
}

describe("idempotency keys against a real server", { skip: skipWithoutServer }, () => {
  let server;
  let client;

  before(async () => {
    server = await Server.start();
    client = new Client({ baseUrl: server.url });
  });

  after(async () => {
    await server?.stop();
  });

  async function runsOf(sessionId) {
    return (await client.listRuns(sessionId, { limit: 50 })).items.map((run) => run.id);
  }

  test("a message sent again with its key is taken once and answered as the first time", async () => {
    const session = await client.createSession({ agent: "chat" });
    const idempotencyKey = `message-${crypto.randomUUID()}`;
    const first = await client.sendMessage(session.id, "Hello?", { idempotencyKey });
    const again = await client.sendMessage(session.id, "Hello?", { idempotencyKey });
    assert.deepEqual(again, first);
    assert.deepEqual(await runsOf(session.id), [first.run_id]);
    const run = await client.waitRun(first.run_id, { timeoutMs: DEADLINE_MS });
    assert.equal(run.final_answer, "Hello from Ratchet.");
  });

  test("a session created again with its key is the same session", async () => {
    const idempotencyKey = `session-${crypto.randomUUID()}`;
    const first = await client.createSession({ agent: "chat" }, { idempotencyKey });
    const again = await client.createSession({ agent: "chat" }, { idempotencyKey });
    assert.equal(again.id, first.id);
  });

  test("a key sent again with another message is refused", async () => {
    const session = await client.createSession({ agent: "chat" });
    const idempotencyKey = `message-${crypto.randomUUID()}`;
    const accepted = await client.sendMessage(session.id, "Hello?", { idempotencyKey });
    const refused = await client.sendMessage(session.id, "Goodbye?", { idempotencyKey }).then(assert.fail, (error) => error);
    assert.ok(refused instanceof RatchetError, String(refused));
    assert.equal(refused.status, 422);
    assert.equal(refused.code, "invalid_request");
    assert.deepEqual(await runsOf(session.id), [accepted.run_id]);
  });

  test("every call without a key sends a fresh one", async () => {
    const keys = [];
    const recording = new Client({ baseUrl: server.url, fetch: recordingFetch(keys) });
    const session = await recording.createSession({ agent: "chat" });
    const first = await recording.sendMessage(session.id, "Hello?");
    const second = await recording.sendMessage(session.id, "Hello?");
    await recording.getSession(session.id);

    assert.equal(keys.length, 4);
    assert.equal(new Set(keys.slice(0, 3)).size, 3);
    for (const key of keys.slice(0, 3)) assert.match(key, UUID_V4);
    assert.equal(keys[3], undefined, "reads are not keyed");
    assert.notEqual(first.run_id, second.run_id);
    assert.deepEqual((await runsOf(session.id)).sort(), [first.run_id, second.run_id].sort());
  });

  test("a message whose answer was lost is sent again with its key and taken once", async () => {
    const session = await client.createSession({ agent: "chat" });
    const proxy = await DroppingProxy.start(server.url);
    try {
      const accepted = await new Client({ baseUrl: proxy.url }).sendMessage(session.id, "Hello?");
      assert.equal(proxy.drops, 0);
      assert.equal(proxy.keys.length, 2);
      assert.match(proxy.keys[0], UUID_V4);
      assert.equal(proxy.keys[1], proxy.keys[0]);
      assert.deepEqual(await runsOf(session.id), [accepted.run_id]);
      const run = await client.waitRun(accepted.run_id, { timeoutMs: DEADLINE_MS });
      assert.equal(run.final_answer, "Hello from Ratchet.");
    } finally {
      await proxy.stop();
    }
  });

  test("a session whose answer was lost is created once", async () => {
    const marker = `created-once-${crypto.randomUUID()}`;
    const since = Date.now() - 1;
    const proxy = await DroppingProxy.start(server.url);
    try {
      const session = await new Client({ baseUrl: proxy.url }).createSession({ agent: "chat", metadata: { marker } });
      assert.equal(proxy.keys.length, 2);
      assert.equal(proxy.keys[1], proxy.keys[0]);
      const listed = (await client.listSessions({ created_from: since, limit: 200 })).items;
      assert.deepEqual(listed.filter((s) => s.metadata?.marker === marker).map((s) => s.id), [session.id]);
    } finally {
      await proxy.stop();
    }
  });

  test("without retries a lost answer is a NetworkError; the key sent again answers what was done", async () => {
    const session = await client.createSession({ agent: "chat" });
    const idempotencyKey = `lost-once-${crypto.randomUUID()}`;
    const proxy = await DroppingProxy.start(server.url);
    try {
      const once = new Client({ baseUrl: proxy.url, retry: { maxAttempts: 1 } });
      await assert.rejects(once.sendMessage(session.id, "Hello?", { idempotencyKey }), NetworkError);
    } finally {
      await proxy.stop();
    }
    const [runId, ...more] = await runsOf(session.id);
    assert.deepEqual(more, []);
    assert.equal((await client.sendMessage(session.id, "Hello?", { idempotencyKey })).run_id, runId);
    assert.deepEqual(await runsOf(session.id), [runId]);
  });

  test("request takes an Idempotency-Key among its headers", async () => {
    const headers = { "Idempotency-Key": `raw-${crypto.randomUUID()}` };
    const first = await client.request("POST", "/v1/sessions", { body: { agent: "chat" }, headers });
    const again = await client.request("POST", "/v1/sessions", { body: { agent: "chat" }, headers });
    assert.equal(again.id, first.id);
  });
});

describe("retries of a keyed request", () => {
  const inProgress = () =>
    new Response(JSON.stringify({ error: { code: "request_in_progress", message: "still carried out" } }), {
      status: 409,
      headers: { "Content-Type": "application/json", "Retry-After": "1" },
    });
  const accepted = { message_id: "msg_1", run_id: "run_1", run_status: "queued", steered: false };

  test("a request in progress is sent again with its key after its Retry-After", async () => {
    const sent = [];
    const fetch = async (url, init) => {
      sent.push({ at: Date.now(), key: init.headers["Idempotency-Key"] });
      if (sent.length === 1) return inProgress();
      return new Response(JSON.stringify(accepted), { status: 201, headers: { "Content-Type": "application/json", "Idempotent-Replayed": "true" } });
    };
    const client = new Client({ baseUrl: "http://127.0.0.1:9", fetch });
    assert.deepEqual(await client.sendMessage("ses_a", "Hello?", { idempotencyKey: "in-progress" }), accepted);
    assert.deepEqual(sent.map((s) => s.key), ["in-progress", "in-progress"]);
    assert.ok(sent[1].at - sent[0].at >= 950, `sent again after ${sent[1].at - sent[0].at} ms`);
  });

  test("a request still in progress when the time is spent throws its refusal", async () => {
    let sends = 0;
    const fetch = async () => {
      sends += 1;
      return inProgress();
    };
    const client = new Client({ baseUrl: "http://127.0.0.1:9", fetch, retry: { maxRetryMs: 0 } });
    const error = await client.sendMessage("ses_a", "Hello?").then(assert.fail, (e) => e);
    assert.ok(error instanceof RatchetError, String(error));
    assert.equal(error.status, 409);
    assert.equal(error.code, "request_in_progress");
    assert.equal(sends, 1);
  });

  test("other refusals are thrown at once", async () => {
    let sends = 0;
    const fetch = async () => {
      sends += 1;
      return new Response(JSON.stringify({ error: { code: "conflict", message: "busy" } }), { status: 409, headers: { "Content-Type": "application/json" } });
    };
    const error = await new Client({ baseUrl: "http://127.0.0.1:9", fetch }).sendMessage("ses_a", "Hello?").then(assert.fail, (e) => e);
    assert.equal(error.code, "conflict");
    assert.equal(sends, 1);
  });

  test("a server without an answer is tried a bounded number of times with one key", async () => {
    const keys = [];
    const fetch = async (url, init) => {
      keys.push(init.headers["Idempotency-Key"]);
      throw new TypeError("fetch failed", { cause: new Error("connect ECONNREFUSED") });
    };
    const client = new Client({ baseUrl: "http://127.0.0.1:9", fetch, retry: { backoffMs: 10 } });
    const started = Date.now();
    await assert.rejects(client.createSession(), NetworkError);
    assert.equal(keys.length, 4);
    assert.equal(new Set(keys).size, 1);
    assert.match(keys[0], UUID_V4);
    assert.ok(Date.now() - started < 5000);
  });
});
