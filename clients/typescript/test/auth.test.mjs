// A server with `[[tokens]]`: the client's token is sent with every request and stream, and
// a missing or wrong one is refused with 401.

import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { Client, RatchetError } from "../dist/index.js";
import { Server, skipWithoutServer } from "../test-support/ratchet.mjs";

const TOKEN = "a-token-for-the-client-tests";

describe("a server with tokens", { skip: skipWithoutServer }, () => {
  let server;

  before(async () => {
    server = await Server.start({ token: TOKEN });
  });

  after(async () => {
    await server?.stop();
  });

  async function assertUnauthorized(request) {
    const error = await request.then(assert.fail, (error) => error);
    assert.ok(error instanceof RatchetError, String(error));
    assert.equal(error.status, 401);
    assert.equal(error.code, "unauthorized");
    assert.match(error.message, /\S/);
  }

  test("without a token, or with a wrong one, every request and stream is 401", async () => {
    for (const client of [new Client({ baseUrl: server.url }), new Client({ baseUrl: server.url, token: "not-the-right-token" })]) {
      await assertUnauthorized(client.listSessions());
      await assertUnauthorized(client.createSession({ agent: "chat" }));
      // Refused, not retried: the stream throws at once.
      await assertUnauthorized(client.events("ses_whatever").next());
    }
  });

  test("with the tenant's token, requests and streams go through", async () => {
    const client = new Client({ baseUrl: server.url, token: TOKEN });
    const session = await client.createSession({ agent: "chat" });
    const { run_id: runId } = await client.sendMessage(session.id, "Hello?");
    assert.equal((await client.waitRun(runId)).status, "completed");
    const kinds = [];
    for await (const event of client.events(session.id, { follow: false })) kinds.push(event.kind);
    assert.equal(kinds.at(-1), "run.finished");
    assert.deepEqual((await client.listSessions()).items.map((s) => s.id), [session.id]);
  });
});
