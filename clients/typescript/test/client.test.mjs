// The client against a real `ratchet serve`: sessions, messages, runs, events, errors,
// approvals, run control and webhooks.

import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import { createServer as createHttpServer } from "node:http";
import { createServer as createTcpServer } from "node:net";
import { rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Client, NetworkError, RatchetError, WaitTimeoutError, isStoredEvent } from "../dist/index.js";
import { DEADLINE_MS, ModelServer, Server, collectUntil, eventually, skipWithoutServer } from "../test-support/ratchet.mjs";

describe("against a real server", { skip: skipWithoutServer }, () => {
  let server;
  let model;
  let client;

  before(async () => {
    // The `flaky` agent's model refuses its first call, so that its run fails and can be retried.
    model = await ModelServer.start({ failures: 1, answer: "Recovered after a retry." });
    const flaky = ['provider = "openai"', 'model = "m"', `base_url = "${model.url}"`, "max_retries = 0"].join("\n");
    server = await Server.start({ models: { flaky } });
    client = new Client({ baseUrl: server.url });
  });

  after(async () => {
    await server?.stop();
    await model?.stop();
  });

  async function converse(agent, content) {
    const session = await client.createSession({ agent });
    const accepted = await client.sendMessage(session.id, content);
    return { session, runId: accepted.run_id };
  }

  async function statusOf(runId, wanted) {
    return eventually(`run ${runId} ${wanted}`, async () => {
      const run = await client.getRun(runId);
      return run.status === wanted && run;
    });
  }

  test("a session, a message and its run waited for until it completes", async () => {
    const session = await client.createSession({ agent: "chat", metadata: { purpose: "the client's tests" } });
    assert.match(session.id, /^ses_/);
    assert.equal(session.agent, "chat");
    assert.deepEqual(session.metadata, { purpose: "the client's tests" });
    assert.equal(session.status, "idle");
    assert.equal((await client.getSession(session.id)).id, session.id);

    const accepted = await client.sendMessage(session.id, "Hello?");
    assert.match(accepted.run_id, /^run_/);
    assert.equal(accepted.steered, false);
    const run = await client.waitRun(accepted.run_id, { timeoutMs: DEADLINE_MS });
    assert.equal(run.id, accepted.run_id);
    assert.equal(run.status, "completed");
    assert.equal(run.stop_reason, "completed");
    assert.equal(run.final_answer, "Hello from Ratchet.");

    assert.deepEqual((await client.listRuns(session.id)).items.map((r) => r.id), [run.id]);
    const messages = (await client.listMessages(session.id)).items;
    assert.deepEqual(
      messages.map((m) => [m.role, m.content]),
      [
        ["user", "Hello?"],
        ["assistant", "Hello from Ratchet."],
      ],
    );
    const listed = await client.listSessions({ agent: "chat", limit: 200 });
    assert.ok(listed.items.some((s) => s.id === session.id), "the session is listed with its agent's");
    assert.equal((await client.getSession(session.id)).last_run_status, "completed");
    // Endpoints without a method of their own go through `request`.
    const steps = await client.request("GET", `/v1/runs/${run.id}/steps`, { query: { limit: 10 } });
    assert.deepEqual(steps.items.map((step) => step.index), [1]);
    assert.equal(steps.items[0].instruction, "call_llm");
  });

  test("waitRun gives up after its timeout with the run as it stood", async () => {
    const { runId } = await converse("sleeper", "Sleep");
    const error = await client.waitRun(runId, { timeoutMs: 300, pollIntervalMs: 50 }).then(
      () => assert.fail("waitRun answered a sleeping run"),
      (error) => error,
    );
    assert.ok(error instanceof WaitTimeoutError, String(error));
    assert.equal(error.run.id, runId);
    assert.ok(["queued", "running"].includes(error.run.status), error.run.status);
    await client.cancel(runId);
  });

  test("a followed stream yields the stored events exactly as a replay reads them, and live activity beside", async () => {
    const session = await client.createSession({ agent: "napper" });
    const stream = client.events(session.id);
    const accepted = await client.sendMessage(session.id, "Take a nap");
    const followed = await collectUntil(stream, (event) => event.kind === "run.finished");
    await stream.return();

    const stored = followed.filter(isStoredEvent);
    const live = followed.filter((event) => !isStoredEvent(event));
    assert.ok(live.length > 0, "the nap's step was announced while it ran");
    for (const activity of live) {
      assert.equal(activity.kind, "activity");
      assert.equal(activity.live, true);
      assert.equal(activity.run_id, accepted.run_id);
    }
    assert.deepEqual(
      stored.map((event) => event.seq),
      stored.map((_, i) => i + 1),
      "every seq from 1, once, in order",
    );
    assert.equal(stored.at(-1).kind, "run.finished");
    assert.equal(stored.at(-1).payload.status, "completed");

    const replayed = await collectUntil(client.events(session.id, { follow: false }), () => false);
    assert.deepEqual(replayed, stored, "the replay is the followed stream without its live activity");
    const ofRun = await collectUntil(client.runEvents(accepted.run_id, { follow: false }), () => false);
    assert.deepEqual(ofRun, stored.filter((event) => event.run_id === accepted.run_id));
    const later = await collectUntil(client.events(session.id, { after: 3, follow: false }), () => false);
    assert.deepEqual(later, stored.slice(3), "after: 3 starts at seq 4");
  });

  test("a stream ends when its signal aborts, with the signal's reason", async () => {
    const session = await client.createSession({ agent: "chat" });
    const controller = new AbortController();
    const stream = client.events(session.id, { signal: controller.signal });
    const next = stream.next();
    controller.abort(new Error("enough"));
    await assert.rejects(next, /enough/);
  });

  test("refusals are RatchetErrors with the API's status, code and message", async () => {
    const expectRefusal = async (request, status, code, message) => {
      const error = await request.then(
        (answer) => assert.fail(`expected ${status}, got ${JSON.stringify(answer)}`),
        (error) => error,
      );
      assert.ok(error instanceof RatchetError, String(error));
      assert.equal(error.name, "RatchetError");
      assert.equal(error.status, status);
      assert.equal(error.code, code);
      assert.match(error.message, message);
      assert.deepEqual(error.body.error.code, code, "the body is the API's JSON error");
      assert.equal(error.body.error.message, error.message);
    };
    await expectRefusal(client.getSession("ses_nothere"), 404, "not_found", /ses_nothere/);
    await expectRefusal(client.getRun("run_nothere"), 404, "not_found", /run_nothere/);
    await expectRefusal(client.getSession("not-an-id"), 400, "bad_request", /\S/);
    await expectRefusal(client.listSessions({ limit: 0 }), 400, "bad_request", /limit/);
    await expectRefusal(client.createSession({ agent: "nobody" }), 422, "invalid_request", /chat/);
    const session = await client.createSession({ agent: "chat" });
    await expectRefusal(client.sendMessage(session.id, "   "), 422, "invalid_request", /content/);
    // A stream that the server refuses is not retried: the iteration throws at once.
    await expectRefusal(client.events("ses_nothere").next(), 404, "not_found", /ses_nothere/);
  });

  test("a server that cannot be reached is a NetworkError", async () => {
    const port = await new Promise((resolve) => {
      const probe = createTcpServer().listen(0, "127.0.0.1", () => {
        const { port } = probe.address();
        probe.close(() => resolve(port));
      });
    });
    const unreachable = new Client({ baseUrl: `http://127.0.0.1:${port}` });
    const error = await unreachable.listSessions().then(assert.fail, (error) => error);
    assert.ok(error instanceof NetworkError, String(error));
    assert.ok(!(error instanceof RatchetError));
    assert.match(error.message, /GET \/v1\/sessions: no answer from/);
    assert.ok(error.cause, "the fetch failure is kept as the cause");
    // A stream gives up once its reconnection time is spent, with the last failure.
    const stream = unreachable.events("ses_whatever", { maxReconnectMs: 300 });
    await assert.rejects(stream.next(), NetworkError);
  });

  test("an approval: nothing runs until a person decides, then the run completes", async () => {
    const { session, runId } = await converse("guarded", "Add 2 and 3");
    const waiting = await client.waitRun(runId);
    assert.equal(waiting.status, "waiting_human");
    assert.equal(waiting.usage.tool_calls, 0, "the gated call did not run");

    const pending = (await client.listApprovals({ status: "pending", limit: 200 })).items.filter((a) => a.run_id === runId);
    assert.equal(pending.length, 1);
    const [approval] = pending;
    assert.equal(approval.session_id, session.id);
    assert.deepEqual(
      approval.calls.map((c) => [c.name, c.arguments, c.needs_approval]),
      [["add", { a: 2, b: 3 }, true]],
    );
    const callId = approval.calls[0].call_id;

    const decided = await client.decideApproval(approval.id, { decisions: [{ call_id: callId, decision: "approve", note: "fine" }] });
    assert.equal(decided.status, "decided");
    assert.equal(decided.calls[0].decision, "approve");
    assert.equal(decided.calls[0].note, "fine");
    const done = await client.waitRun(runId);
    assert.equal(done.status, "completed");
    assert.equal(done.final_answer, "The sum is 5.");
    assert.equal(done.usage.tool_calls, 1);
    assert.equal((await client.getApproval(approval.id)).status, "decided");

    const conflict = await client.decideApproval(approval.id, { decisions: [{ call_id: callId, decision: "deny" }] }).then(assert.fail, (e) => e);
    assert.ok(conflict instanceof RatchetError);
    assert.equal(conflict.status, 409);
    assert.equal(conflict.code, "conflict");
  });

  test("cancel ends a running run", async () => {
    const { runId } = await converse("sleeper", "Sleep");
    await statusOf(runId, "running");
    const cancelled = await client.cancel(runId);
    assert.equal(cancelled.run_id, runId);
    assert.ok(["cancelled", "cancelling"].includes(cancelled.status), cancelled.status);
    const run = await client.waitRun(runId);
    assert.equal(run.status, "cancelled");
    assert.equal(run.stop_reason, "cancelled");
  });

  test("pause stops a run at its next step boundary and resume takes it up again", async () => {
    const { runId } = await converse("napper", "Nap");
    await statusOf(runId, "running");
    const pausing = await client.pause(runId);
    assert.equal(pausing.run_id, runId);
    assert.ok(["paused", "pausing"].includes(pausing.status), pausing.status);
    const paused = await client.waitRun(runId);
    assert.equal(paused.status, "paused");

    const resumed = await client.resume(runId);
    assert.deepEqual(resumed, { run_id: runId, status: "running" });
    const done = await client.waitRun(runId);
    assert.equal(done.status, "completed");
    assert.equal(done.final_answer, "Woke up.");

    const refused = await client.resume(runId).then(assert.fail, (e) => e);
    assert.equal(refused.status, 409);
  });

  test("continue gives a run that spent its budget more steps", async () => {
    const { runId } = await converse("looper", "Add until done");
    const spent = await client.waitRun(runId);
    assert.equal(spent.status, "failed");
    assert.equal(spent.stop_reason, "budget_exhausted");
    assert.deepEqual(
      spent.budgets.filter((b) => b.kind === "steps").map((b) => [b.used, b.limit, b.spent]),
      [[3, 3, true]],
    );
    const retried = await client.retry(runId).then(assert.fail, (e) => e);
    assert.equal(retried.status, 422, "retry is for a failed model call");

    assert.deepEqual(await client.continueRun(runId, { extra_steps: 10 }), { run_id: runId, status: "running" });
    const done = await client.waitRun(runId);
    assert.equal(done.status, "completed");
    assert.equal(done.final_answer, "Finally done.");

    const again = await client.continueRun(runId).then(assert.fail, (e) => e);
    assert.equal(again.status, 409, "a completed run cannot be continued");
  });

  test("retry repeats the model call a run failed on", async () => {
    const { runId } = await converse("flaky", "Are you there?");
    const failed = await client.waitRun(runId);
    assert.equal(failed.status, "failed");
    assert.equal(failed.stop_reason, "llm_error");

    assert.deepEqual(await client.retry(runId), { run_id: runId, status: "running" });
    const done = await client.waitRun(runId);
    assert.equal(done.status, "completed");
    assert.equal(done.final_answer, "Recovered after a retry.");
    assert.equal(model.requests, 2, "one failed call, one retried");
  });

  test("webhooks: create, list, get, rotate the secret, follow deliveries, requeue a dead one, delete", async () => {
    // The receiver refuses the first delivery, which is then dead (one attempt), and takes
    // the requeued one.
    const received = [];
    const receiver = createHttpServer((request, response) => {
      let body = "";
      request.on("data", (chunk) => (body += chunk));
      request.on("end", () => {
        received.push({ headers: request.headers, body: JSON.parse(body) });
        response.writeHead(received.length === 1 ? 500 : 204).end();
      });
    });
    await new Promise((resolve) => receiver.listen(0, "127.0.0.1", resolve));
    try {
      const url = `http://127.0.0.1:${receiver.address().port}/hook`;
      const created = await client.webhooks.create({ url, events: ["run.finished"], secret: "a-secret-of-sixteen-plus", max_attempts: 1 });
      assert.match(created.id, /^whk_/);
      assert.equal(created.url, url);
      assert.deepEqual(created.events, ["run.finished"]);
      assert.equal(created.max_attempts, 1);
      assert.equal(created.secret, "a-secret-of-sixteen-plus", "the secret is shown once, at creation");

      const { secret: _shownOnce, ...withoutSecret } = created;
      assert.deepEqual(await client.webhooks.get(created.id), withoutSecret, "the secret is never shown again");
      assert.ok((await client.webhooks.list()).items.some((w) => w.id === created.id));

      const rotated = await client.webhooks.rotateSecret(created.id);
      assert.equal(rotated.id, created.id);
      assert.match(rotated.secret, /^whsec_/);
      assert.equal((await client.webhooks.rotateSecret(created.id, "my-own-secret-long-enough")).secret, "my-own-secret-long-enough");

      const { runId } = await converse("chat", "Hello?");
      await client.waitRun(runId);
      const dead = await eventually("the refused delivery is dead", async () => {
        const [delivery] = (await client.webhooks.deliveries(created.id)).items;
        return delivery?.status === "dead_letter" && delivery;
      });
      assert.equal(dead.event_kind, "run.finished");
      assert.equal(dead.last_status, 500);
      assert.equal((await client.webhooks.deliveries(created.id, { status: "dead_letter" })).items.length, 1);

      const requeued = await client.webhooks.requeue(created.id, dead.id);
      assert.equal(requeued.id, dead.id);
      assert.ok(["pending", "delivering", "delivered"].includes(requeued.status), requeued.status);
      const delivered = await eventually("the requeued delivery is delivered", async () => {
        const [delivery] = (await client.webhooks.deliveries(created.id)).items;
        return delivery?.status === "delivered" && delivery;
      });
      assert.equal(delivered.last_status, 204);
      assert.equal(received.length, 2);
      assert.equal(received[1].body.event.run_id, runId);
      assert.equal(received[1].headers["ratchet-delivery"], String(dead.id));
      assert.deepEqual(await client.webhooks.requeueDead(created.id), { requeued: 0 });

      assert.equal(await client.webhooks.delete(created.id), undefined);
      const gone = await client.webhooks.get(created.id).then(assert.fail, (e) => e);
      assert.equal(gone.status, 404);
      assert.equal(gone.code, "not_found");
    } finally {
      receiver.closeAllConnections();
      await new Promise((resolve) => receiver.close(resolve));
    }
  });

  test("the catalog is listed and reloaded; a rejected reload lists every problem", async () => {
    const agents = (await client.listAgents()).items.map((agent) => agent.id);
    assert.ok(["chat", "guarded", "flaky"].every((id) => agents.includes(id)), agents.join(", "));
    assert.deepEqual((await client.reload()).agents.map((agent) => agent.id), agents);

    const broken = join(server.dir, "agents", "broken.md");
    writeFileSync(broken, "---\nid: broken\ndescription: Calls a tool nobody has\nmodel: scripted:chat.json\ntools: [rm_rf]\n---\nYou break.\n");
    try {
      const rejected = await client.reload().then(assert.fail, (e) => e);
      assert.ok(rejected instanceof RatchetError);
      assert.equal(rejected.status, 422);
      assert.equal(rejected.code, "invalid_request");
      assert.equal(rejected.problems.length, 1, rejected.problems.join("\n"));
      assert.match(rejected.problems[0], /broken\.md:\d+: .*rm_rf/);
    } finally {
      rmSync(broken);
    }
    assert.deepEqual((await client.listAgents()).items.map((agent) => agent.id), agents, "the previous catalog stayed active");
  });
});
