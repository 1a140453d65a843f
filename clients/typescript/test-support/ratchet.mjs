// What the tests share: a real `ratchet serve` on a fresh SQLite file with a catalog of
// scripted agents, a local model server that fails on demand, and waiting with a deadline.

import { spawn } from "node:child_process";
import { createServer } from "node:http";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

/** Why the tests that need a server are skipped, or `false` when they run. */
export const skipWithoutServer = (() => {
  if (process.env.RATCHET_BIN) return false;
  if (process.env.CI === "true") {
    throw new Error("RATCHET_BIN must name the ratchet binary in CI (scripts/test sets it to target/debug/ratchet)");
  }
  return "set RATCHET_BIN to a ratchet binary (cargo build -p ratchet-cli) to run the tests against a real server";
})();

/** Generous for a loaded two-core machine: every wait polls and ends as soon as it can. */
export const DEADLINE_MS = 30_000;

// Each agent answers from a script: reply i answers the run's i-th model call.
const AGENTS = {
  chat: {
    description: "Answers at once",
    script: [{ text: "Hello from Ratchet." }],
  },
  guarded: {
    description: "Adds, which a person must approve",
    tools: ["add"],
    approval: "add: always",
    script: [{ tool_calls: [{ name: "add", arguments: { a: 2, b: 3 } }] }, { text: "The sum is 5." }],
  },
  napper: {
    description: "Naps briefly, then answers",
    tools: ["sleep_ms"],
    script: [{ tool_calls: [{ name: "sleep_ms", arguments: { ms: 3000 } }] }, { text: "Woke up." }],
  },
  sleeper: {
    description: "Sleeps for a minute",
    tools: ["sleep_ms"],
    script: [{ tool_calls: [{ name: "sleep_ms", arguments: { ms: 60000 } }] }, { text: "Slept." }],
  },
  looper: {
    description: "Needs more steps than its budget allows",
    tools: ["add"],
    limits: "{ max_steps: 3 }",
    script: [
      { tool_calls: [{ name: "add", arguments: { a: 1, b: 1 } }] },
      { tool_calls: [{ name: "add", arguments: { a: 2, b: 2 } }] },
      { tool_calls: [{ name: "add", arguments: { a: 3, b: 3 } }] },
      { text: "Finally done." },
    ],
  },
  stepper: {
    description: "Takes several short steps, streaming each answer",
    tools: ["sleep_ms"],
    script: [
      ...Array.from({ length: 6 }, () => ({ text: "One more nap.", chunk_delay_ms: 40, tool_calls: [{ name: "sleep_ms", arguments: { ms: 600 } }] })),
      { text: "All naps taken, one step at a time.", chunk_delay_ms: 40 },
    ],
  },
};

// `models` maps a `[models.NAME]` profile to an agent of the same name that uses it.
function writeCatalog(dir, models) {
  mkdirSync(dir, { recursive: true });
  for (const name of Object.keys(models)) {
    writeFileSync(join(dir, `${name}.md`), ["---", `id: ${name}`, `description: Answers through the ${name} model profile`, `model: ${name}`, "---", `You are ${name}.`, ""].join("\n"));
  }
  for (const [id, agent] of Object.entries(AGENTS)) {
    writeFileSync(join(dir, `${id}.json`), JSON.stringify({ replies: agent.script }));
    const lines = ["---", `id: ${id}`, `description: ${agent.description}`, `model: scripted:${id}.json`];
    if (agent.tools) lines.push(`tools: [${agent.tools.join(", ")}]`);
    if (agent.approval) lines.push("approval:", `  ${agent.approval}`);
    if (agent.limits) lines.push(`limits: ${agent.limits}`);
    lines.push("---", `You are ${id}.`, "");
    writeFileSync(join(dir, `${id}.md`), lines.join("\n"));
  }
}

// A `ratchet serve` of its own: a temporary directory with the database, the catalog and the
// workspace. `restart()` after `kill()` serves the same database on the same port.
export class Server {
  static async start({ token, models = {} } = {}) {
    const dir = mkdtempSync(join(tmpdir(), "ratchet-client-"));
    writeCatalog(join(dir, "agents"), models);
    mkdirSync(join(dir, "workspace"));
    const config = [`agents = "${join(dir, "agents")}"`];
    for (const [name, profile] of Object.entries(models)) config.push(`[models.${name}]`, profile);
    // Webhook receivers in the tests answer at once; a failed attempt is retried soon.
    config.push("[webhooks]", "poll_ms = 50", "retry_backoff_ms = 100");
    if (token) config.push("[[tokens]]", 'tenant = "acme"', 'env = "RATCHET_CLIENT_TEST_TOKEN"');
    writeFileSync(join(dir, "ratchet.toml"), config.join("\n") + "\n");
    const server = new Server(dir, token);
    await server.spawn("127.0.0.1:0");
    return server;
  }

  constructor(dir, token) {
    this.dir = dir;
    this.token = token;
    this.child = null;
    this.url = null;
    this.log = "";
  }

  async spawn(listen) {
    const child = spawn(
      process.env.RATCHET_BIN,
      [
        "serve",
        "--config", join(this.dir, "ratchet.toml"),
        "--db", `sqlite://${join(this.dir, "ratchet.db")}`,
        "--workspace", join(this.dir, "workspace"),
        "--listen", listen,
        "--workers", "4",
        // A restarted server takes over the killed one's steps after this.
        "--lease-ms", "1500",
        "--poll-ms", "100",
      ],
      { env: { ...process.env, RATCHET_CLIENT_TEST_TOKEN: this.token ?? "", RATCHET_LOG: "warn" }, stdio: ["ignore", "ignore", "pipe"] },
    );
    this.child = child;
    this.url = await new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`ratchet serve did not start:\n${this.log}`)), DEADLINE_MS);
      child.stderr.on("data", (chunk) => {
        this.log += chunk;
        // Only a whole line: the address may arrive split across chunks.
        const found = this.log.match(/listening on (http:\/\/[0-9.:]+) /);
        if (found) {
          clearTimeout(timer);
          resolve(found[1]);
        }
      });
      child.on("exit", (code) => {
        clearTimeout(timer);
        reject(new Error(`ratchet serve exited with ${code}:\n${this.log}`));
      });
    });
  }

  // SIGKILL: no shutdown of any kind.
  async kill() {
    const exited = new Promise((resolve) => this.child.once("exit", resolve));
    this.child.kill("SIGKILL");
    await exited;
  }

  async restart() {
    this.log = "";
    await this.spawn(new URL(this.url).host);
  }

  // The server is thrown away with its directory, so it gets no graceful shutdown (which
  // would wait for a sleeping tool call's grace period).
  async stop() {
    if (this.child && this.child.exitCode === null && this.child.signalCode === null) await this.kill();
    rmSync(this.dir, { recursive: true, force: true });
  }
}

// A local OpenAI-compatible chat completions server: it refuses the first `failures` requests
// with a 503, then streams `answer` the way OpenAI does (chunks, usage, `[DONE]`).
export class ModelServer {
  static async start({ failures, answer }) {
    const model = new ModelServer(failures, answer);
    await new Promise((resolve) => model.http.listen(0, "127.0.0.1", resolve));
    model.url = `http://127.0.0.1:${model.http.address().port}/v1`;
    return model;
  }

  constructor(failures, answer) {
    this.failures = failures;
    this.requests = 0;
    this.http = createServer((request, response) => {
      request.resume();
      request.on("end", () => this.answer(request, response, answer));
    });
  }

  answer(request, response, answer) {
    this.requests += 1;
    if (this.failures > 0) {
      this.failures -= 1;
      response.writeHead(503, { "Content-Type": "application/json" }).end('{"error": {"message": "The model is overloaded", "type": "server_error"}}');
      return;
    }
    response.writeHead(200, { "Content-Type": "text/event-stream" });
    const chunk = (body) => response.write(`data: ${JSON.stringify({ id: "chatcmpl-1", object: "chat.completion.chunk", model: "m", ...body })}\n\n`);
    chunk({ choices: [{ index: 0, delta: { role: "assistant", content: answer }, finish_reason: null }] });
    chunk({ choices: [{ index: 0, delta: {}, finish_reason: "stop" }] });
    chunk({ choices: [], usage: { prompt_tokens: 10, completion_tokens: 5, total_tokens: 15 } });
    response.end("data: [DONE]\n\n");
  }

  async stop() {
    this.http.closeAllConnections();
    await new Promise((resolve) => this.http.close(resolve));
  }
}

/** Polls `probe` until it answers something truthy, and answers that; fails after the deadline. */
export async function eventually(what, probe, { timeoutMs = DEADLINE_MS, intervalMs = 50 } = {}) {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    last = await probe();
    if (last) return last;
    if (Date.now() > deadline) throw new Error(`${what}: not within ${timeoutMs} ms (last: ${JSON.stringify(last)})`);
    await new Promise((resolve) => setTimeout(resolve, intervalMs));
  }
}

/** Every event of `iterable` up to and including the first that `last` accepts. */
export async function collectUntil(iterable, last) {
  const events = [];
  for await (const event of iterable) {
    events.push(event);
    if (last(event)) break;
  }
  return events;
}
