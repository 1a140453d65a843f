// A run's event stream survives its server: killed with SIGKILL mid-run and started again on
// the same port and database, the stream reconnects by itself and yields every seq once.

import { after, test } from "node:test";
import assert from "node:assert/strict";
import { Client, isStoredEvent } from "../dist/index.js";
import { Server, collectUntil, skipWithoutServer } from "../test-support/ratchet.mjs";

let server;

after(async () => {
  await server?.stop();
});

test("a run's events come once each, with no gap, across a server killed and restarted mid-run", { skip: skipWithoutServer }, async () => {
  server = await Server.start();
  const client = new Client({ baseUrl: server.url });
  const session = await client.createSession({ agent: "stepper" });
  const { run_id: runId } = await client.sendMessage(session.id, "Take your naps");

  let restarted;
  let diedAt;
  const events = await collectUntil(client.runEvents(runId, { maxReconnectMs: 60_000 }), (event) => {
    // Once the run has committed a step, its next step is in flight: the server dies there.
    if (restarted === undefined && event.kind === "step.committed") {
      restarted = server.kill().then(() => {
        diedAt = Date.now();
        return server.restart();
      });
    }
    return event.kind === "run.finished";
  });
  await restarted;

  const stored = events.filter(isStoredEvent);
  const seqs = stored.map((event) => event.seq);
  assert.ok(
    stored.some((event) => event.created_at > diedAt),
    "events the restarted server wrote came through the stream, which must have reconnected",
  );
  assert.deepEqual(
    seqs,
    seqs.map((_, i) => i + 1),
    "every seq from 1 to the last exactly once, in order",
  );
  assert.ok(stored.every((event) => event.run_id === runId));
  const finished = stored.at(-1);
  assert.equal(finished.kind, "run.finished");
  assert.equal(finished.payload.status, "completed");

  // What was yielded is what the restarted server has stored.
  const replayed = await collectUntil(client.runEvents(runId, { follow: false }), () => false);
  assert.deepEqual(stored, replayed);
  assert.equal((await client.getRun(runId)).final_answer, "All naps taken, one step at a time.");
});
