// The web console, driven in headless Chromium against a real `ratchet serve`.

import { after, afterEach, before, test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { ModelServer, Server, accessibilityViolations, launchBrowser, openPage, screenshot } from "./support.mjs";

let browser;
const servers = [];

before(async () => {
  browser = await launchBrowser();
});

// Each test's pages and server end with it, so that no stream or timer outlives its test.
afterEach(async () => {
  await Promise.all(browser.contexts().map((context) => context.close()));
  await Promise.all(servers.splice(0).map((s) => s.stop()));
});

after(async () => {
  await browser?.close();
});

async function serve(options) {
  const server = await Server.start(options);
  servers.push(server);
  return server;
}

// Creates a session of `agent` through the form and waits for its page.
async function newSession(page, agent) {
  try {
    await page.getByRole("heading", { name: "Sessions" }).waitFor({ timeout: 10000 });
  } catch (error) {
    const html = await page.evaluate(() => document.documentElement.outerHTML);
    throw new Error(`${error.message}\nurl ${page.url()}\nerrors ${page.errors}\n${html}`);
  }
  await page.getByLabel("Agent", { exact: true }).selectOption(agent);
  await page.getByRole("button", { name: "Create session" }).click();
  await page.waitForURL(/#\/sessions\/ses_/);
  await page.getByRole("log", { name: "Conversation" }).waitFor({ state: "attached" });
  return new URL(page.url()).hash.split("/")[2];
}

async function send(page, text) {
  await page.getByLabel("Message", { exact: true }).fill(text);
  await page.getByRole("button", { name: "Send" }).click();
  try {
    await page.locator(".item-user", { hasText: text }).waitFor({ timeout: 10000 });
  } catch (error) {
    const shown = await page.evaluate(() => document.querySelector("main").innerText);
    const value = await page.getByLabel("Message", { exact: true }).inputValue();
    throw new Error(`${error.message}\nconnection: ${await page.locator("#connection").textContent()}\nerrors: ${page.errors}\nmessage box: ${JSON.stringify(value)}\nrequests: ${page.requests.join(", ")}\n${shown}`);
  }
}

function latestRunStatus(page) {
  return page.getByRole("complementary", { name: "Session details" }).locator(".controls .chip");
}

// Every control of the current view has a name a screen reader can say.
async function assertLabelled(page) {
  const unnamed = await page.evaluate(() =>
    [...document.querySelectorAll("main input, main select, main textarea, main button")]
      .filter((el) => !el.hidden && el.closest("[hidden]") === null)
      .filter((el) => {
        if (el.tagName === "BUTTON") return !el.textContent.trim() && !el.getAttribute("aria-label");
        if (el.type === "radio") return el.closest("label") === null;
        return el.labels.length === 0 && !el.getAttribute("aria-label");
      })
      .map((el) => el.outerHTML),
  );
  assert.deepEqual(unnamed, [], "controls without a label");
}

test("create a session, send a message and watch the answer stream in", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  const sessionId = await newSession(page, "chat");
  await assertLabelled(page);
  await send(page, "Tell me about streaming");

  const full = "Streaming answers arrive word by word while the model is still writing them.";
  const answer = page.locator(".item-assistant").first();
  // Seen mid-stream: some words, not all, the bubble still marked streaming.
  const partial = await page.waitForFunction(
    (whole) => {
      const item = document.querySelector(".item-assistant");
      const text = item?.querySelector(".text").textContent ?? "";
      return item?.dataset.streaming === "true" && text.length > 0 && text !== whole ? text : null;
    },
    full,
    { polling: 20 },
  );
  const seen = await partial.jsonValue();
  assert.ok(full.startsWith(seen), `a prefix of the answer was shown while it streamed: ${seen}`);
  await screenshot(page, "conversation-streaming");

  await page.waitForFunction(() => document.querySelector(".item-assistant")?.dataset.streaming === "false");
  assert.equal(await answer.locator(".text").textContent(), full);
  await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();
  assert.equal(await page.locator(".item-assistant").count(), 1, "one answer, drawn once");
  // Messages carry their time, as a machine-readable datetime: the message's, its run's creation.
  const [created] = (await server.get(`/v1/sessions/${sessionId}/runs`)).items;
  assert.equal(await page.locator(".item-user .who time").getAttribute("datetime"), new Date(created.created_at).toISOString());
  assert.ok(await answer.locator(".who time").isVisible(), "the answer has its time");
  await screenshot(page, "conversation");

  // The run's events: the streamed fragments hidden until asked for, filtered by kind, and
  // downloaded whole.
  await page.getByRole("complementary", { name: "Session details" }).locator(".controls a").click();
  await page.getByRole("heading", { name: /^Run run_/ }).waitFor();
  await page.locator('tr[data-kind="run.finished"]').waitFor();
  // "#" counts the run's own events from 1, whatever the session's seq.
  const numbers = await page.locator("tr[data-kind] td:first-child").allTextContents();
  assert.deepEqual(numbers, numbers.map((_, i) => String(i + 1)));
  // The run's time counts from its first step; the queue before it is said apart.
  await page.locator("dl.facts dd", { hasText: /\(ran \d/ }).waitFor();
  const deltas = page.locator('tr[data-kind="assistant.delta"]');
  assert.ok((await deltas.count()) > 1, "the answer was streamed in fragments");
  assert.equal(await deltas.filter({ visible: true }).count(), 0, "fragments are hidden by default");
  await page.getByLabel("Show assistant.delta fragments").check();
  assert.equal(await deltas.filter({ visible: true }).count(), await deltas.count());
  await page.getByLabel("Kinds").selectOption("run.finished");
  assert.equal(await page.locator("tr[data-kind]").filter({ visible: true }).count(), 1);
  const [download] = await Promise.all([page.waitForEvent("download"), page.getByRole("button", { name: "Download events (JSON)" }).click()]);
  assert.match(download.suggestedFilename(), /^run_.*-events\.json$/);
  const saved = JSON.parse(readFileSync(await download.path(), "utf8"));
  assert.equal(saved.length, await page.locator("tr[data-kind]").count(), "every event received");
  await page.goBack();

  // The list shows each session with its title, agent, status and when it was last active,
  // the latest activity first: here beside one whose run sleeps and one waiting for an
  // approval.
  const busy = {};
  for (const agent of ["slow", "guarded"]) {
    busy[agent] = (await server.post("/v1/sessions", { agent })).id;
    await server.post(`/v1/sessions/${busy[agent]}/messages`, { content: "Go" });
  }
  await page.getByRole("link", { name: "Sessions" }).click();
  // A list page says whether it reaches the server too.
  await page.locator('#connection[data-state="live"]').waitFor();
  const row = page.locator(`tr[data-session="${sessionId}"]`);
  await row.waitFor();
  assert.equal(await row.locator("td").nth(1).textContent(), "chat");
  assert.equal(await row.getByRole("link").textContent(), "Tell me about streaming", "titled by its first message");
  await row.locator(".chip", { hasText: "idle" }).waitFor();
  assert.match(await row.locator("time").textContent(), /ago$/);
  await page.locator(`tr[data-session="${busy.slow}"] .chip`, { hasText: "running" }).waitFor();
  await page.locator(`tr[data-session="${busy.guarded}"] .chip`, { hasText: "waiting human" }).waitFor();
  const truth = (await server.get("/v1/sessions?order=activity")).items.map((s) => s.id);
  await page.waitForFunction(
    (ids) => JSON.stringify([...document.querySelectorAll("tr[data-session]")].map((r) => r.dataset.session)) === JSON.stringify(ids),
    truth,
  );
  await screenshot(page, "sessions");
  assert.deepEqual(page.errors, []);
});

test("approve a guarded batch: nothing runs until a person says yes", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  const sessionId = await newSession(page, "guarded");
  await send(page, "Write it down");

  const card = page.getByRole("region", { name: /^Approval apr_/ });
  await card.waitFor();
  await latestRunStatus(page).filter({ hasText: "waiting human" }).waitFor();
  assert.match(await card.textContent(), /append_line/);
  assert.match(await card.textContent(), /add.*runs with its batch/);
  await assertLabelled(page);
  // No call of the batch ran while it waits.
  assert.equal(await page.locator(".item-tool .result", { hasText: "Result" }).count(), 0);

  // The approvals page lists it too, with its arguments, its agent and its session, and the
  // navigation counts it.
  const approvals = await openPage(browser, `${server.url}/#/approvals`);
  const listed = approvals.getByRole("region", { name: /^Approval apr_/ });
  await listed.waitFor();
  assert.match(await listed.textContent(), /Agent guarded/);
  await listed.locator(".json li", { has: approvals.locator(".j-key", { hasText: "path" }) }).locator(".j-str", { hasText: "notes.txt" }).waitFor();
  await listed.getByRole("link", { name: "Write it down" }).waitFor();
  await approvals.locator('nav a[href="#/approvals"] .count', { hasText: "1" }).waitFor();
  await approvals.close();

  await screenshot(page, "approval");
  // Nothing is decided for the person: Submit sends nothing while a call is undecided.
  assert.equal(await card.locator("input[type=radio]:checked").count(), 0);
  await card.getByRole("button", { name: "Submit decisions" }).click();
  await page.waitForTimeout(300);
  assert.equal(await page.locator(".card[data-approval]").getAttribute("data-state"), "pending");
  assert.ok(!page.requests.some((r) => r.startsWith("POST") && r.includes("/v1/approvals/")), page.requests.join("\n"));
  await card.getByRole("button", { name: "Approve all" }).click();
  await page.locator(".item-assistant", { hasText: "The line is written and 2 + 3 = 5." }).waitFor();
  // The decided card keeps what was decided, by whom and when.
  await card.locator('li[data-call="call_0_0"][data-verdict="approved"]').waitFor();
  assert.match(await card.textContent(), /Decided by default on /);
  await page.locator('.card[data-state="decided"]').waitFor();
  await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();
  assert.equal(await page.locator('.item-tool[data-call="call_0_1"] pre').last().textContent(), "5");
  assert.equal(readFileSync(join(server.dir, "workspace", "notes.txt"), "utf8"), "approved line\n");
  const runs = await server.get(`/v1/sessions/${sessionId}/runs`);
  assert.equal(runs.items[0].status, "completed");
  assert.deepEqual(page.errors, []);
});

test("decide an approval on the approvals page, with the navigation's count", async () => {
  const server = await serve();
  const session = await server.post("/v1/sessions", { agent: "guarded" });
  const accepted = await server.post(`/v1/sessions/${session.id}/messages`, { content: "Write it down" });
  const page = await openPage(browser, `${server.url}/#/approvals`);
  const count = page.locator('nav a[href="#/approvals"] .count');
  await count.filter({ hasText: "1" }).waitFor();
  const card = page.getByRole("region", { name: /^Approval apr_/ });
  assert.equal(await card.locator("input[type=radio]:checked").count(), 0, "nothing decided for the person");
  await card.getByRole("button", { name: "Deny all" }).click();
  await card.locator('li[data-call="call_0_0"][data-verdict="denied"]').waitFor();
  await count.waitFor({ state: "hidden" });
  for (let i = 0; (await server.get(`/v1/runs/${accepted.run_id}`)).status !== "completed"; i += 1) {
    assert.ok(i < 100, "the run went on after the decision");
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  await assertLabelled(page);
  assert.deepEqual(page.errors, []);
});

test("deny a call: the model reads the denial and nothing is written", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  await newSession(page, "guarded");
  await send(page, "Write it down");
  const card = page.getByRole("region", { name: /^Approval apr_/ });
  await card.getByLabel("Deny").check();
  await card.getByLabel("Note (optional)").fill("not today");
  await card.getByRole("button", { name: "Submit decisions" }).click();
  await page.locator('.item-tool[data-call="call_0_0"][data-error="true"]', { hasText: "not today" }).waitFor();
  await card.locator('li[data-call="call_0_0"][data-verdict="denied"]', { hasText: "“not today”" }).waitFor();
  await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();
  assert.throws(() => readFileSync(join(server.dir, "workspace", "notes.txt")), /ENOENT/);
  assert.deepEqual(page.errors, []);
});

test("after queueing a message, Cancel stops the running run and its tool card closes", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  const sessionId = await newSession(page, "slow");
  await send(page, "Take a nap");
  await page.locator(".item-tool .result", { hasText: "Running…" }).waitFor();
  await send(page, "Queue it after the nap");
  // The queued message shows at once, under its own run.
  const groups = page.locator(".run-group");
  await groups.nth(1).locator(".item-user", { hasText: "Queue it after the nap" }).waitFor();
  assert.equal(await groups.nth(1).locator(".run-status .chip").textContent(), "queued");
  const panel = page.getByRole("complementary", { name: "Session details" });
  await panel.getByRole("heading", { name: "Active run" }).waitFor();
  const [first, second] = (await server.get(`/v1/sessions/${sessionId}/runs`)).items.map((r) => r.id);
  await panel.locator(".controls a", { hasText: first }).waitFor();

  await page.getByRole("button", { name: "Cancel run" }).click();
  const firstGroup = page.locator(`.run-group[data-run="${first}"]`);
  await firstGroup.locator(".item-notice", { hasText: "Run ended: cancelled" }).waitFor();
  // The cancel cut the call off and the run's end committed what the tool said of it.
  await firstGroup.locator('.item-tool[data-state="done"][data-error="true"]', { hasText: "cancelled" }).waitFor();
  assert.equal((await server.get(`/v1/runs/${first}`)).status, "cancelled");
  // The queued run went on: it is the active one now.
  await page.locator(`.run-group[data-run="${second}"] .item-tool .result`, { hasText: "Running…" }).waitFor();
  await panel.locator(".controls a", { hasText: second }).waitFor();
  assert.equal(await page.locator(`.run-group[data-run="${second}"] .item-notice`).count(), 0, "nothing of the first run lands under the second");
  // Tool names keep their case.
  assert.equal(await firstGroup.locator(".item-tool .who code").innerText(), "sleep_ms");
  assert.deepEqual(page.errors, []);
});

test("a steering message shows at once, waiting, and joins its run when taken", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  await newSession(page, "napper");
  await send(page, "Nap a little");
  await page.locator(".item-tool .result", { hasText: "Running…" }).waitFor();
  await page.getByLabel("While a run is active").selectOption("steer");
  await page.getByLabel("Message", { exact: true }).fill("Also say hello");
  await page.getByRole("button", { name: "Send" }).click();
  const steer = page.locator('.item-user[data-pending="true"]', { hasText: "Also say hello" });
  await steer.waitFor();
  assert.match(await steer.textContent(), /waits for the run's next model call/);
  // The run takes it at its next model call: the same item, no longer waiting, never twice.
  await page.locator('.item-user[data-pending="false"]', { hasText: "Also say hello" }).waitFor();
  assert.equal(await page.locator(".item-user", { hasText: "Also say hello" }).count(), 1);
  assert.deepEqual(page.errors, []);
});

test("an address that names nothing says so, with nothing to act on", async () => {
  const server = await serve();
  const page = await openPage(browser, `${server.url}/#/sessions/ses_nope`);
  await page.getByRole("heading", { name: "Not found" }).waitFor();
  await page.getByText("no session ses_nope").waitFor();
  assert.equal(await page.locator("main textarea, main button").count(), 0);
  await page.goto(`${server.url}/#/runs/run_doesnotexist`);
  await page.getByText("no run run_doesnotexist").waitFor();
  assert.equal(await page.locator("main button").count(), 0);
  const icon = await fetch(`${server.url}/favicon.ico`);
  assert.equal(icon.status, 200);
  assert.equal(icon.headers.get("content-type"), "image/svg+xml");
  assert.deepEqual(page.errors, []);
});

test("cancel a slow run from its conversation", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  const sessionId = await newSession(page, "slow");
  await send(page, "Take a nap");
  await page.locator(".item-tool .result", { hasText: "Running…" }).waitFor();
  await latestRunStatus(page).filter({ hasText: "running" }).waitFor();
  // A running tool says how long it has run, and so does the step in flight.
  await page.locator(".item-tool .result", { hasText: /^Running… \(\d+\.\d s\)$/ }).waitFor();
  await page.locator("p.activity", { hasText: /^running tools: sleep_ms… \(\d+\.\d s\)$/ }).waitFor();

  await page.getByRole("button", { name: "Cancel run" }).click();
  await page.locator(".item-notice", { hasText: "Run ended: cancelled" }).waitFor();
  await latestRunStatus(page).filter({ hasText: "cancelled" }).waitFor();
  assert.ok(await page.getByRole("button", { name: "Cancel run" }).isDisabled());
  const runs = await server.get(`/v1/sessions/${sessionId}/runs`);
  assert.equal(runs.items[0].status, "cancelled");
  assert.deepEqual(page.errors, []);
});

test("pause a run at its step boundary, then resume it", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  const sessionId = await newSession(page, "napper");
  await send(page, "Nap, then answer");
  await page.locator(".item-tool .result", { hasText: "Running…" }).waitFor();
  const pause = page.getByRole("button", { name: "Pause" });
  const resume = page.getByRole("button", { name: "Resume" });
  await page.waitForFunction(() => [...document.querySelectorAll("button")].find((b) => b.textContent === "Pause")?.disabled === false);
  assert.ok(await resume.isDisabled(), "nothing to resume yet");
  await pause.click();
  // The nap in flight finishes first; the run stops at the end of its step.
  await page.locator(".item-notice", { hasText: "Run paused" }).waitFor();
  await latestRunStatus(page).filter({ hasText: "paused" }).waitFor();
  await page.locator(".item-tool .result", { hasText: "slept" }).waitFor();
  assert.ok(await pause.isDisabled());
  const paused = await server.get(`/v1/sessions/${sessionId}/runs`);
  assert.equal(paused.items[0].status, "paused");
  assert.equal(await page.locator(".item-assistant", { hasText: "Woke up" }).count(), 0, "no model call while paused");
  await screenshot(page, "paused-run");

  await resume.click();
  await page.locator(".item-notice", { hasText: "Run resumed." }).waitFor();
  await page.locator(".item-assistant", { hasText: "Woke up after the pause." }).waitFor();
  await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();
  const runs = await server.get(`/v1/sessions/${sessionId}/runs`);
  assert.equal(runs.items.length, 1, "the same run went on");
  assert.deepEqual(page.errors, []);
});

test("fork a run from one of its steps: the fork's page opens and it completes on its own", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  const sessionId = await newSession(page, "napper");
  await send(page, "Nap, then answer");
  await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();
  const source = (await server.get(`/v1/sessions/${sessionId}/runs`)).items[0].id;
  await page.goto(`${server.url}/#/runs/${source}`);
  const fork = page.locator(`li[data-run="${source}"][data-step="1"]`).getByRole("button", { name: "Fork from here" });
  await fork.click();
  await page.waitForURL((url) => url.hash.startsWith("#/runs/run_") && !url.hash.includes(source));
  const forkId = new URL(page.url()).hash.split("/")[2];
  await page.locator("#view .facts", { hasText: "Forked from" }).waitFor();
  for (let i = 0; (await server.get(`/v1/runs/${forkId}`)).status !== "completed"; i += 1) {
    assert.ok(i < 200, "the fork completes");
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  const forked = await server.get(`/v1/runs/${forkId}`);
  assert.deepEqual(forked.forked_from, { run_id: source, step: 1 });
  assert.notEqual(forked.session_id, sessionId, "a session of its own");
  assert.equal((await server.get(`/v1/runs/${source}`)).status, "completed", "the source is left as it was");
  assert.deepEqual(page.errors, []);
});

test("continue a run that spent its budget, with more steps", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  const sessionId = await newSession(page, "looper");
  await send(page, "Add until done");
  await page.locator(".item-notice", { hasText: "Run ended: failed (budget exhausted)" }).waitFor();
  // Why it stopped, where the person looks: which budget ran out and by how much, with
  // Continue right there (Retry is for a failed model call).
  const banner = page.getByRole("region", { name: "Why the run stopped" });
  await banner.getByText("The run spent its budget.").waitFor();
  await banner.locator('li[data-budget="steps"]', { hasText: "3 of 3 steps used" }).waitFor();
  assert.equal(await banner.getByRole("button", { name: "Retry" }).count(), 0);
  const panel = page.getByRole("complementary", { name: "Session details" });
  assert.ok(await panel.getByRole("button", { name: "Retry" }).isDisabled(), "retry is for a failed model call");
  assert.equal(await banner.getByLabel("More steps").inputValue(), "2", "half the spent budget again, to start from");
  await screenshot(page, "why-it-stopped");
  await banner.getByLabel("More steps").fill("10");
  await banner.getByRole("button", { name: "Continue" }).click();
  await page.locator(".item-assistant", { hasText: "Finally done." }).waitFor();
  await banner.waitFor({ state: "detached" });
  await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();
  await page.locator(".item-notice", { hasText: "Run resumed (continue)." }).waitFor();
  const runs = await server.get(`/v1/sessions/${sessionId}/runs`);
  assert.equal(runs.items.length, 1, "the same run went on");
  assert.equal(runs.items[0].status, "completed");
  assert.deepEqual(page.errors, []);
});

test("retry a run whose model kept failing, and read its cost", async () => {
  const model = await ModelServer.start({ failures: 1, answer: "Recovered after a retry." });
  try {
    const server = await serve({
      models: {
        flaky: [
          'provider = "openai"',
          'model = "m"',
          `base_url = "${model.url}"`,
          "max_retries = 0",
          "prices = { input_per_mtok = 2.5, output_per_mtok = 10.0 }",
        ].join("\n"),
      },
    });
    const page = await openPage(browser, server.url);
    await newSession(page, "flaky");
    await send(page, "Are you there?");
    await page.locator(".item-notice", { hasText: "The model call failed" }).waitFor();
    await page.locator(".item-notice", { hasText: "Run ended: failed (llm error)" }).waitFor();
    const banner = page.getByRole("region", { name: "Why the run stopped" });
    await banner.getByText("The model call failed, and its attempts ran out.").waitFor();
    await banner.locator("code", { hasText: "503" }).waitFor();

    await banner.getByRole("button", { name: "Retry" }).click();
    await page.locator(".item-assistant", { hasText: "Recovered after a retry." }).waitFor();
    await page.locator(".item-notice", { hasText: "Run resumed (retry)." }).waitFor();
    await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();
    assert.equal(model.requests, 2, "one failed call, one retried");

    // 1,200 input tokens at $2.50 and 300 output tokens at $10.00 per million.
    await page.getByRole("complementary", { name: "Session details" }).locator(".controls a").click();
    await page.locator("#view table tr", { hasText: "Cost" }).locator("td", { hasText: "$0.006000" }).waitFor();
    await page.locator("#view table tr", { hasText: "Input tokens" }).locator("td", { hasText: "1200" }).waitFor();
    await screenshot(page, "run-usage");
    assert.deepEqual(page.errors, []);
  } finally {
    await model.stop();
  }
});

test("open a run tree: its waterfall, its children, their steps and what a step sent to the model", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  await newSession(page, "lead");
  await send(page, "Count the fruit");
  await page.locator(".item-assistant", { hasText: "Both workers reported back." }).waitFor();
  // Each child sits under the `delegate` call that started it: its task, then its answer.
  const delegateCall = page.locator(".item-tool", { has: page.locator("code", { hasText: "delegate" }) });
  const children = delegateCall.getByRole("list", { name: "Runs this call started" }).locator(".item-notice");
  assert.equal(await children.count(), 2);
  await children.filter({ hasText: "for: Count the apples" }).locator(".child-answer", { hasText: "Counted: 7." }).waitFor();
  await children.first().locator(".child-outcome .chip", { hasText: "completed" }).waitFor();
  // The call's result is a string holding JSON: shown parsed.
  await delegateCall.locator(".result .j-note", { hasText: "a string holding JSON" }).waitFor();
  await delegateCall.locator(".result .j-key", { hasText: "results" }).waitFor();
  // The child's whole transcript is a click away.
  const apples = children.filter({ hasText: "for: Count the apples" });
  await apples.getByText("Transcript").click();
  await apples.locator(".transcript-items .item-user", { hasText: "Count the apples" }).waitFor();
  await apples.locator(".transcript-items .item-assistant", { hasText: "Counted: 7." }).waitFor();
  // The session's spend includes what its runs delegated.
  const spent = (await server.get(`/v1/runs/${(await server.get(`/v1/sessions/${new URL(page.url()).hash.split("/")[2]}/runs`)).items[0].id}/tree`)).nodes.reduce((sum, n) => sum + n.usage.input_tokens + n.usage.output_tokens, 0);
  await page.locator(".session-spend", { hasText: `spent ${spent} tokens, delegated runs included` }).waitFor();
  await screenshot(page, "delegation-inline");

  // A child's session is labelled as a task from its parent, and takes no messages.
  await apples.getByRole("link", { name: "Open the task's session" }).click();
  await page.locator(".task-of", { hasText: "A task from its parent." }).waitFor();
  assert.equal(await page.getByLabel("Message", { exact: true }).isVisible(), false, "a task's session has no composer");
  await page.locator(".task-of a", { hasText: "the parent's session" }).click();
  await page.locator(".item-assistant", { hasText: "Both workers reported back." }).waitFor();

  await page.getByRole("complementary", { name: "Session details" }).locator(".controls a").click();
  await page.waitForURL(/#\/runs\/run_/);
  const rootId = new URL(page.url()).hash.split("/")[2];
  const tree = page.getByRole("list", { name: "Run tree" });
  await tree.locator("li li").nth(1).waitFor();
  assert.equal(await page.locator("#view .controls a").count(), 0, "a run's own controls do not link to its own page");
  const nodes = await tree.locator("li").evaluateAll((items) => items.map((li) => li.dataset.run));
  const truth = await server.get(`/v1/runs/${rootId}/tree`);
  assert.deepEqual(nodes, truth.nodes.map((n) => n.run_id), "every node, parents before children");
  assert.equal(await tree.locator("li li", { hasText: "worker" }).count(), 2);
  await page.locator("#view table tr", { hasText: "Model calls" }).locator("td").first().filter({ hasText: "2" }).waitFor();
  // The tree's usage is rolled up: the root's two calls and one for each worker.
  await page.locator("#view table tr", { hasText: "Model calls" }).locator("td").nth(1).filter({ hasText: "4" }).waitFor();
  await page.locator('tr[data-seq] td:text-is("run.finished")').waitFor();

  // One waterfall for the tree: a row for each run, then a row for each of its steps.
  const waterfall = page.getByRole("list", { name: "Waterfall" });
  await waterfall.locator("li.wf-run").nth(2).waitFor();
  const runRows = await waterfall.locator("li.wf-run").evaluateAll((rows) => rows.map((r) => r.dataset.run));
  assert.deepEqual(runRows.toSorted(), truth.nodes.map((n) => n.run_id).toSorted(), "a row for every run of the tree");
  assert.equal(runRows[0], rootId, "the root first");
  for (const node of truth.nodes) {
    const steps = (await server.get(`/v1/runs/${node.run_id}/steps`)).items;
    const rows = await waterfall.locator(`li[data-run="${node.run_id}"][data-step]`).count();
    assert.equal(rows, steps.length, `every step of ${node.run_id}`);
    const tokens = node.usage.input_tokens + node.usage.output_tokens;
    await waterfall.locator(`li.wf-run[data-run="${node.run_id}"]`, { hasText: `${tokens.toLocaleString("en-US")} tokens` }).waitFor();
  }
  // Each bar sits on the tree's time axis: the children start after the root does.
  const left = (selector) => waterfall.locator(selector).first().evaluate((bar) => bar.getBoundingClientRect().left);
  const rootBar = await left(`li.wf-run[data-run="${rootId}"] .wf-span`);
  const childBar = await left(`li.wf-run[data-run="${truth.nodes[1].run_id}"] .wf-span`);
  assert.ok(childBar > rootBar, `a child's bar (${childBar}px) starts right of its root's (${rootBar}px)`);
  // A step says what it did: the batch that started the children, the call that asked for it.
  await waterfall.getByText("started 2 child runs, then waited for them").waitFor();
  await waterfall.getByText("asking for 1 tool call").first().waitFor();
  await assertLabelled(page);
  await screenshot(page, "run-tree");

  // A step opened up: what its model call was sent, and the reply.
  await waterfall.locator(`li[data-run="${rootId}"][data-step="1"] button:not([data-fork])`).click();
  const inspector = page.getByRole("region", { name: /^Step 1 of lead/ });
  await inspector.waitFor();
  const sent = inspector.getByRole("list", { name: "Messages sent to the model" });
  assert.deepEqual(await sent.locator("li .text").allTextContents(), ["Count the fruit"]);
  await inspector.getByText("Tools offered (").click();
  await inspector.locator('li[data-tool="delegate"]').waitFor();
  const reply = inspector.getByRole("list", { name: "The model's reply" });
  // The reply's calls fold below their second level: the task is there, clicks down.
  for (let closed = reply.locator("details:not([open]) > summary").first(); await closed.count(); ) await closed.click();
  await reply.locator(".j-str", { hasText: "Count the apples" }).waitFor();
  await screenshot(page, "step-inspected");
  // A child's step shows the task it was given.
  await waterfall.locator(`li[data-run="${truth.nodes[1].run_id}"][data-step="1"] button:not([data-fork])`).click();
  await page.getByRole("region", { name: /^Step 1 of worker/ }).getByRole("list", { name: "Messages sent to the model" }).getByText(/^Count the (apples|pears)$/).waitFor();

  // A child's page links back to its parent.
  await tree.locator("li li a").first().click();
  await page.getByRole("heading", { name: /^Run run_/ }).waitFor();
  await page.locator("dl.facts a", { hasText: rootId }).waitFor();
  assert.deepEqual(page.errors, []);
});

test("answer a child's approval from the root conversation", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  await newSession(page, "overseer");
  await send(page, "Have it written down");

  const child = page.locator(".item-notice[data-child-run]", { hasText: /^Started checker/ });
  const card = child.getByRole("region", { name: /^Approval apr_/ });
  await card.waitFor();
  await latestRunStatus(page).filter({ hasText: "waiting children" }).waitFor();
  assert.match(await card.textContent(), /add/);
  await assertLabelled(page);
  await screenshot(page, "child-approval");

  await card.getByLabel("Approve").check();
  await card.getByRole("button", { name: "Submit decisions" }).click();
  await page.locator(".item-assistant", { hasText: "The checker added them." }).waitFor();
  await child.locator('.card[data-state="decided"]').waitFor();
  await child.locator('.item-below[data-call="call_0_0"]', { hasText: "done" }).waitFor();
  await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();
  // The parent read the child's answer as its tool result.
  await page.locator(".item-tool .result", { hasText: "It is 5." }).waitFor();

  // The waterfall names the waits: the checker's for a person, the overseer's for its child.
  await page.getByRole("complementary", { name: "Session details" }).locator(".controls a").click();
  const waterfall = page.getByRole("list", { name: "Waterfall" });
  await waterfall.locator("li.wf-step", { hasText: "waiting for a person's approval" }).waitFor();
  await waterfall.locator("li.wf-step", { hasText: "waiting for its children" }).waitFor();
  await waterfall.locator('.wf-wait[data-kind="person"]').first().waitFor();
  await screenshot(page, "waterfall-waits");
  assert.deepEqual(page.errors, []);
});

test("find sessions: page past the 230th, search, filter by status and rename", async () => {
  const server = await serve();
  for (let i = 0; i < 230; i += 1) await server.post("/v1/sessions", {});
  const page = await openPage(browser, server.url);
  await page.getByText("50+ sessions shown.").waitFor();
  const more = page.getByRole("button", { name: "Load more" });
  while (await more.isVisible()) {
    const before = await page.locator("tr[data-session]").count();
    await more.click();
    await page.waitForFunction((n) => document.querySelectorAll("tr[data-session]").length > n, before);
  }
  assert.equal(await page.locator("tr[data-session]").count(), 230, "every session, none capped");
  await page.getByText("230 sessions shown.").waitFor();
  // "/" moves to the search box.
  await page.locator("main").click({ position: { x: 5, y: 5 } });
  await page.keyboard.press("/");
  assert.equal(await page.evaluate(() => document.activeElement.id), "find-text");

  const sessionId = await newSession(page, "chat");
  await send(page, "Plan my trip to Rome");
  await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();
  await page.getByRole("heading", { name: "Plan my trip to Rome" }).waitFor();
  await page.getByRole("button", { name: "Rename" }).click();
  await page.getByLabel("Title").fill("Rome, in spring");
  await page.getByRole("button", { name: "Save title" }).click();
  await page.getByRole("heading", { name: "Rome, in spring" }).waitFor();
  assert.equal((await server.get(`/v1/sessions/${sessionId}`)).title, "Rome, in spring");

  await page.getByRole("link", { name: "Sessions" }).click();
  await page.getByLabel("Search").fill("ROME");
  await page.waitForFunction(() => document.querySelectorAll("tr[data-session]").length === 1);
  await page.locator(`tr[data-session="${sessionId}"]`, { hasText: "Rome, in spring" }).waitFor();
  await page.getByLabel("Search").fill("");
  await page.getByLabel("Status").selectOption("failed");
  await page.getByText("No session matches.").waitFor();
  await page.getByLabel("Status").selectOption("");
  await page.getByLabel("Of agent").selectOption("chat");
  await page.waitForFunction(() => document.querySelectorAll("tr[data-session]").length === 1);
  await assertLabelled(page);
  assert.deepEqual(page.errors, []);
});

test("the theme and the time zone are chosen in the header and kept", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  const sessionId = await newSession(page, "chat");
  await page.getByLabel("Theme").selectOption("dark");
  assert.equal(await page.evaluate(() => document.documentElement.dataset.theme), "dark");
  const background = () => page.evaluate(() => getComputedStyle(document.documentElement).backgroundColor);
  assert.equal(await background(), "rgb(20, 22, 26)", "the dark scheme's background");
  await page.getByLabel("Times shown in").selectOption("UTC");
  await page.locator("p.run-line", { hasText: /created .*UTC/ }).waitFor();
  await page.reload();
  await page.getByRole("log", { name: "Conversation" }).waitFor({ state: "attached" });
  assert.equal(await page.evaluate(() => document.documentElement.dataset.theme), "dark", "kept across a reload");
  assert.equal(await page.getByLabel("Times shown in").inputValue(), "UTC");
  await page.getByLabel("Theme").selectOption("light");
  assert.equal(await background(), "rgb(255, 255, 255)", "the light scheme's background");
  assert.ok(sessionId.startsWith("ses_"));
  assert.deepEqual(page.errors, []);
});

test("a token is asked for once and kept for the tab", async () => {
  const server = await serve({ token: "s3cret-console-token" });
  const page = await openPage(browser, server.url);
  const dialog = page.getByRole("dialog", { name: "Sign in" });
  await dialog.waitFor();
  await dialog.getByLabel("Access token").fill("wrong");
  await dialog.getByRole("button", { name: "Sign in" }).click();
  await dialog.getByText("The server refused that token").waitFor();
  await dialog.getByLabel("Access token").fill("s3cret-console-token");
  await dialog.getByRole("button", { name: "Sign in" }).click();
  await newSession(page, "chat");
  await send(page, "Hello behind a token");
  await page.locator('.item-assistant[data-streaming="false"]').waitFor();

  // A reload keeps it; another tab asks again.
  await page.reload();
  await page.getByRole("log", { name: "Conversation" }).waitFor({ state: "attached" });
  await page.locator('.item-assistant[data-streaming="false"]').waitFor();
  assert.equal(await dialog.isVisible(), false);
  const other = await page.context().newPage();
  await other.goto(server.url);
  await other.getByRole("dialog", { name: "Sign in" }).waitFor();
  assert.deepEqual(page.errors, []);
});

test("a server killed mid-call comes back: the stream resumes and the console asks to reconcile", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  await newSession(page, "ledger");
  await send(page, "Charge the card");
  // The call has begun and does not finish while the test runs: its outcome is unknown.
  await page.locator(".item-tool .result", { hasText: "Running…" }).waitFor();

  await server.kill();
  await page.locator('#connection[data-state="reconnecting"]').waitFor();
  // While the server is away the page says it may be stale, and nothing acts on the run.
  await page.getByText("The server cannot be reached: this page may be out of date").waitFor();
  assert.equal(await page.evaluate(() => document.querySelector("main .controls").inert), true);
  await server.restart();
  await page.locator('#connection[data-state="live"]').waitFor();
  assert.equal(await page.evaluate(() => document.querySelector("main .controls").inert), false);
  assert.ok(await page.getByText("The server cannot be reached: this page may be out of date").isHidden());

  const card = page.getByRole("region", { name: "Reconcile call_0_0" });
  await card.waitFor({ timeout: 20000 });
  await screenshot(page, "reconciliation");
  await assertLabelled(page);
  await card.getByLabel("Outcome").selectOption("succeeded");
  await card.getByLabel("Result the model reads (optional)").fill("charged once");
  await card.getByRole("button", { name: "Record outcome" }).click();
  await page.locator(".item-assistant", { hasText: "Recorded." }).waitFor();
  await latestRunStatus(page).filter({ hasText: "completed" }).waitFor();

  // The reconnect replayed only what was missed: everything appears once.
  assert.equal(await page.locator(".item-user").count(), 1);
  assert.equal(await page.locator(".item-run").count(), 1);
  assert.equal(await page.locator(".item-tool").count(), 1);
  assert.equal(await page.locator(".card[data-reconciliation]").count(), 1);
  assert.deepEqual(page.errors, []);
});

test("archiving a session with background work sends its report to the dead letter, which can be discarded", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  const sessionId = await newSession(page, "dispatcher");
  await send(page, "Start something long");
  await page.locator(".item-assistant", { hasText: "Started in the background." }).waitFor();

  page.once("dialog", (dialog) => dialog.accept());
  await page.getByRole("button", { name: "Archive session" }).click();
  await page.locator(".item-notice", { hasText: "This session was archived." }).waitFor();
  await page.waitForFunction(() => document.querySelector(".composer button[type=submit]").disabled);
  await page.getByText("This session is archived: it is read-only").waitFor();
  assert.ok(await page.getByLabel("While a run is active").isDisabled());

  await page.getByRole("link", { name: "Inbox and dead letters" }).click();
  await page.getByRole("heading", { name: /^Inbox of/ }).waitFor();
  const row = page.locator("tr[data-inbox]");
  await row.first().locator(".chip", { hasText: "dead letter" }).waitFor();
  const truth = await server.get(`/v1/sessions/${sessionId}/inbox?status=dead_letter`);
  assert.equal(await row.count(), truth.items.length);
  assert.equal(await row.locator("td").nth(2).locator(".muted").textContent(), truth.items[0].reason);
  // Its place in this inbox, the run that delegated the work, and when.
  assert.equal(await row.first().locator("td").first().textContent(), `1id ${truth.items[0].id}`);
  await row.first().getByText(/^written /).waitFor();
  await page.getByLabel("Status").selectOption("pending");
  await page.getByText("Nothing here.").waitFor();
  await page.getByLabel("Status").selectOption("dead_letter");
  await row.first().waitFor();
  await screenshot(page, "inbox");

  // A closed session's dead letter is not requeued (nothing would tell it): the refusal shows.
  const dead = truth.items.length;
  await row.first().getByRole("button", { name: /^Requeue event/ }).click();
  await page.getByText(/is closed: it starts no continuation/).waitFor();
  // It can be discarded, saying who did.
  page.once("dialog", (dialog) => dialog.accept());
  await row.first().getByRole("button", { name: /^Discard event/ }).click();
  await page.waitForFunction((left) => document.querySelectorAll("tr[data-inbox]").length === left, dead - 1);
  const discarded = await server.get(`/v1/sessions/${sessionId}/inbox?status=discarded`);
  assert.equal(discarded.items.length, 1);
  assert.match(discarded.items[0].reason, /^discarded by the console/);
  await page.getByLabel("Status").selectOption("discarded");
  await row.first().locator(".chip", { hasText: "discarded" }).waitFor();
  assert.deepEqual(page.errors, []);
});

// Polls `check` until it holds; fails after 30 s.
async function until(what, check) {
  const deadline = Date.now() + 30000;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting until ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

test("a webhook's dead deliveries are requeued from its delivery log", async () => {
  const server = await serve();
  // A receiver whose name never resolves: the one attempt allowed fails and the delivery dies.
  const webhook = await server.post("/v1/webhooks", { url: "http://receiver.invalid/hook", max_attempts: 1, events: ["run.created"] });
  const session = await server.post("/v1/sessions", { agent: "chat" });
  await server.post(`/v1/sessions/${session.id}/messages`, { content: "Hello" });
  const log = `/v1/webhooks/${webhook.id}/deliveries`;
  const dead = async () => (await server.get(`${log}?status=dead_letter`)).items;
  await until("the delivery is dead", async () => (await dead()).length === 1);

  const page = await openPage(browser, server.url);
  await page.getByRole("link", { name: "Webhooks" }).click();
  await page.getByRole("link", { name: webhook.id }).click();
  await page.getByRole("heading", { name: /^Deliveries of/ }).waitFor();
  const row = page.locator("tr[data-delivery]");
  await row.first().locator(".chip", { hasText: "dead letter" }).waitFor();
  await row.first().getByRole("button", { name: /^Requeue delivery/ }).click();
  await until("the delivery was requeued", async () => (await server.get(log)).items[0].requeued_at !== null);
  // The receiver is still away: tried once more, it dies again, and the log shows it.
  await until("the requeued delivery is dead again", async () => (await dead()).length === 1);
  const first = (await dead())[0].requeued_at;
  await row.first().locator(".chip", { hasText: "dead letter" }).waitFor();
  await page.getByRole("button", { name: "Requeue every dead letter" }).click();
  await until("every dead letter was requeued", async () => (await server.get(log)).items[0].requeued_at > first);
  assert.deepEqual(await accessibilityViolations(page), []);
  assert.deepEqual(page.errors, []);
});

test("a schedule is created, triggered, paused and deleted from the Schedules page", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  page.on("dialog", (dialog) => dialog.accept());
  await page.getByRole("link", { name: "Schedules" }).click();
  await page.getByRole("heading", { name: "Schedules" }).waitFor();
  await page.getByText("No schedules yet").waitFor();
  await assertLabelled(page);

  // A cron expression of four fields is refused, and the form says what it expects.
  await page.getByLabel("Message", { exact: true }).fill("Ping");
  await page.getByLabel("Cadence", { exact: true }).selectOption("cron");
  await page.getByLabel("Interval (ms) or cron expression").fill("* * * *");
  await page.getByRole("button", { name: "Create schedule" }).click();
  await page.getByText(/cron must have 5 fields/).waitFor();

  await page.getByLabel("Cadence", { exact: true }).selectOption("every_ms");
  await page.getByLabel("Interval (ms) or cron expression").fill("3600000");
  await page.getByLabel("Overlap", { exact: true }).selectOption("enqueue");
  await page.getByRole("button", { name: "Create schedule" }).click();
  const row = page.locator("tr[data-schedule]");
  await row.first().waitFor();
  const id = await row.first().getAttribute("data-schedule");
  await row.first().getByText("every 1 h").waitFor();
  const created = await server.get(`/v1/schedules/${id}`);
  assert.equal(created.message, "Ping");
  assert.equal(created.overlap, "enqueue");

  await page.getByRole("button", { name: `Trigger ${id}` }).click();
  await until("the trigger fired a run", async () => (await server.get(`/v1/schedules/${id}/runs`)).items.length === 1);
  const [slot] = (await server.get(`/v1/schedules/${id}/runs`)).items;
  assert.equal(slot.manual, true);
  await row.first().getByRole("link", { name: slot.run_id }).waitFor();

  await page.getByRole("button", { name: `Pause ${id}` }).click();
  await page.getByRole("button", { name: `Resume ${id}` }).waitFor();
  assert.equal((await server.get(`/v1/schedules/${id}`)).paused, true);
  await row.first().locator(".chip", { hasText: "paused" }).waitFor();
  assert.deepEqual(await accessibilityViolations(page), []);

  await page.getByRole("button", { name: `Delete ${id}` }).click();
  await page.getByText("No schedules yet").waitFor();
  assert.deepEqual((await server.get("/v1/schedules")).items, []);
  assert.deepEqual(page.errors, []);
});

test("the Agents page draws the catalog: delegation, tools, approvals and limits", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  await page.getByRole("link", { name: "Agents" }).click();
  await page.getByRole("heading", { name: "Agents", level: 1 }).waitFor();
  const graph = page.getByRole("img", { name: /^Delegation graph/ });
  await graph.waitFor();
  const edges = await graph.locator("path.edge").evaluateAll((paths) => paths.map((p) => p.dataset.edge).sort());
  const agents = (await server.get("/v1/agents")).items;
  const truth = agents.flatMap((a) => a.delegates.map((d) => `${a.id}>${d}`)).sort();
  assert.deepEqual(edges, truth, "an edge for each agent an agent may delegate to");
  // An agent with no edge is named beside the graph, not drawn in it.
  assert.equal(await graph.locator('g[data-agent="chat"]').count(), 0);
  await page.locator(".alone", { hasText: "chat" }).waitFor();
  assert.ok(truth.includes("lead>worker") && truth.includes("overseer>checker"), `${truth}`);
  // A delegate sits below the agent that delegates to it.
  const top = (id) => graph.locator(`g[data-agent="${id}"] rect`).evaluate((r) => Number(r.getAttribute("y")));
  assert.ok((await top("worker")) > (await top("lead")), "worker is drawn below lead");
  const guarded = page.getByRole("region", { name: "guarded" });
  await guarded.locator('li[data-tool="append_line"]', { hasText: "always asks a person" }).waitFor();
  assert.equal(await guarded.locator('li[data-tool="add"] .gated').count(), 0, "an ungated tool says nothing of approval");
  await page.getByRole("region", { name: "looper" }).getByText(/max steps 3\b/).waitFor();
  await page.getByRole("region", { name: "worker" }).getByText("lead").waitFor();
  await assertLabelled(page);
  await screenshot(page, "agents");
  assert.deepEqual(page.errors, []);
});

test("on a phone the conversation fits the screen", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url, { width: 390, height: 844 });
  // The agent list holds a long description: the page still does not scroll sideways.
  await page.getByLabel("Agent", { exact: true }).waitFor();
  await page.waitForFunction(() => document.querySelectorAll("#new-agent option").length > 3);
  const listOverflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  assert.ok(listOverflow <= 0, `the sessions page scrolls sideways by ${listOverflow}px`);
  await newSession(page, "chat");
  await send(page, "Hello from a phone");
  await page.locator('.item-assistant[data-streaming="false"]').waitFor();
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  assert.ok(overflow <= 0, `no sideways scrolling: ${overflow}px too wide`);
  await page.getByLabel("Message", { exact: true }).scrollIntoViewIfNeeded();
  assert.ok(await page.getByLabel("Message", { exact: true }).isVisible());
  // The run's controls sit above the conversation, within the first screen.
  await page.evaluate(() => window.scrollTo(0, 0));
  const cancel = await page.getByRole("button", { name: "Cancel run" }).boundingBox();
  const conversation = await page.getByRole("log", { name: "Conversation" }).boundingBox();
  assert.ok(cancel.y < conversation.y, `Cancel (${cancel.y}px) above the conversation (${conversation.y}px)`);
  assert.ok(cancel.y + cancel.height < 844, `Cancel within the first screen: ${cancel.y}px`);
  await screenshot(page, "phone");
  assert.deepEqual(page.errors, []);
});

test("the keyboard alone creates a session and sends a message", async () => {
  const server = await serve();
  const page = await openPage(browser, server.url);
  await page.getByRole("heading", { name: "Sessions" }).waitFor();
  await page.getByLabel("Agent", { exact: true }).focus();
  await page.keyboard.press("Tab");
  assert.equal(await page.evaluate(() => document.activeElement.textContent), "Create session");
  await page.keyboard.press("Enter");
  await page.waitForURL(/#\/sessions\/ses_/);
  await page.getByLabel("Message", { exact: true }).focus();
  await page.keyboard.type("What is 2 + 3?");
  await page.keyboard.press("Control+Enter");
  await page.locator(".item-assistant", { hasText: "2 + 3 = 5" }).waitFor();
  assert.deepEqual(page.errors, []);
});

test("every view passes an automated WCAG 2.1 AA audit, in both colour schemes", async () => {
  const server = await serve();
  for (const colorScheme of ["light", "dark"]) {
    const page = await openPage(browser, server.url);
    await page.emulateMedia({ colorScheme });
    const audited = {};
    await page.getByRole("heading", { name: "Sessions" }).waitFor();
    audited.sessions = await accessibilityViolations(page);

    await newSession(page, "guarded");
    await send(page, "Write it down");
    await page.getByRole("region", { name: /^Approval apr_/ }).waitFor();
    audited.conversation = await accessibilityViolations(page);

    await page.goto(`${server.url}/#/approvals`);
    await page.locator("li[data-approval]").first().waitFor();
    audited.approvals = await accessibilityViolations(page);

    const sessionId = (await server.post("/v1/sessions", { agent: "lead" })).id;
    const { run_id: runId } = await server.post(`/v1/sessions/${sessionId}/messages`, { content: "Count" });
    await page.goto(`${server.url}/#/runs/${runId}`);
    await page.getByRole("list", { name: "Run tree" }).locator("li li").first().waitFor();
    audited.run = await accessibilityViolations(page);

    await page.goto(`${server.url}/#/sessions/${sessionId}/inbox`);
    await page.getByText("Nothing here.").waitFor();
    audited.inbox = await accessibilityViolations(page);

    await page.goto(`${server.url}/#/agents`);
    await page.getByRole("img", { name: /^Delegation graph/ }).waitFor();
    audited.agents = await accessibilityViolations(page);

    await server.post("/v1/schedules", { message: "Ping", every_ms: 3600000, session: "new", overlap: "skip", catch_up: "one" });
    await page.goto(`${server.url}/#/schedules`);
    await page.locator("tr[data-schedule]").first().waitFor();
    audited.schedules = await accessibilityViolations(page);

    await page.goto(`${server.url}/#/runs/${runId}`);
    await page.getByRole("list", { name: "Waterfall" }).locator("li[data-step] button").first().click();
    await page.getByRole("region", { name: /^Step 1 of/ }).waitFor();
    audited.step = await accessibilityViolations(page);

    for (const [view, violations] of Object.entries(audited)) {
      assert.deepEqual(violations, [], `${colorScheme} ${view}`);
    }
    assert.deepEqual(page.errors, []);
    await page.context().close();
  }
});
