// What the console tests share: a real `ratchet serve` on a fresh SQLite file with a catalog
// of scripted agents, and a headless Chromium to drive it.

import { spawn } from "node:child_process";
import { createServer } from "node:http";
import { mkdtempSync, mkdirSync, readFileSync, writeFileSync, rmSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

export const BIN = process.env.RATCHET_BIN;
const CHROMIUM = process.env.RATCHET_CHROMIUM ?? "/usr/bin/chromium";
const SCREENSHOTS = process.env.RATCHET_CONSOLE_SCREENSHOTS;

if (!BIN) throw new Error("RATCHET_BIN must name the ratchet binary (crates/ratchet-cli/tests/binary/console.rs sets it)");

// Each agent answers from a script: reply i answers the run's i-th model call.
const AGENTS = {
  chat: {
    description: "Answers slowly enough to watch it stream",
    script: [{ text: "Streaming answers arrive word by word while the model is still writing them.", chunk_delay_ms: 120 }],
  },
  guarded: {
    description: "Writes a line, which a person must approve",
    tools: ["append_line", "add"],
    approval: "append_line: always",
    script: [
      {
        tool_calls: [
          { name: "append_line", arguments: { path: "notes.txt", line: "approved line" } },
          { name: "add", arguments: { a: 2, b: 3 } },
        ],
      },
      { text: "The line is written and 2 + 3 = 5." },
    ],
  },
  slow: {
    description: "Sleeps for a minute",
    tools: ["sleep_ms"],
    script: [{ tool_calls: [{ name: "sleep_ms", arguments: { ms: 60000 } }] }, { text: "I woke up." }],
  },
  planner: {
    description: "Plans a trip end to end, researching destinations, comparing the fares of every carrier, booking the rooms and writing the day-by-day schedule",
    script: [{ text: "Planned." }],
  },
  napper: {
    description: "Naps briefly, then answers",
    tools: ["sleep_ms"],
    script: [{ tool_calls: [{ name: "sleep_ms", arguments: { ms: 1500 } }] }, { text: "Woke up after the pause." }],
  },
  lead: {
    description: "Hands two tasks to workers",
    delegates: ["worker"],
    script: [
      {
        tool_calls: [
          {
            name: "delegate",
            arguments: {
              mode: "foreground",
              tasks: [
                { agent: "worker", task: "Count the apples" },
                { agent: "worker", task: "Count the pears" },
              ],
            },
          },
        ],
      },
      { text: "Both workers reported back." },
    ],
  },
  overseer: {
    description: "Has a checker add two numbers",
    delegates: ["checker"],
    script: [
      { tool_calls: [{ name: "delegate", arguments: { mode: "foreground", tasks: [{ agent: "checker", task: "Add 2 and 3" }] } }] },
      { text: "The checker added them." },
    ],
  },
  checker: {
    description: "Adds, which a person must approve",
    tools: ["add"],
    approval: "add: always",
    script: [{ tool_calls: [{ name: "add", arguments: { a: 2, b: 3 } }] }, { text: "It is 5." }],
  },
  worker: {
    description: "Does one task",
    script: [{ text: "Counted: 7." }],
  },
  dispatcher: {
    description: "Starts work in the background and answers at once",
    delegates: ["sleeper"],
    script: [
      {
        tool_calls: [
          { name: "delegate", arguments: { mode: "background", tasks: [{ agent: "sleeper", task: "Take your time" }] } },
        ],
      },
      { text: "Started in the background." },
    ],
  },
  sleeper: {
    description: "Sleeps for a minute, then answers",
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
  ledger: {
    description: "Charges a card, a ten-minute call that may never run twice",
    tools: ["sleep_ms"],
    script: [{ tool_calls: [{ name: "sleep_ms", arguments: { ms: 600000 } }] }, { text: "Recorded." }],
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
    if (agent.delegates) lines.push(`delegates: [${agent.delegates.join(", ")}]`);
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
    const dir = mkdtempSync(join(tmpdir(), "ratchet-console-"));
    writeCatalog(join(dir, "agents"), models);
    mkdirSync(join(dir, "workspace"));
    // The ledger's call stands for a payment: running it again after a crash is not safe.
    const config = [`agents = "${join(dir, "agents")}"`, "[tools.sleep_ms]", 'replay = "never"'];
    for (const [name, profile] of Object.entries(models)) config.push(`[models.${name}]`, profile);
    if (token) config.push("[[tokens]]", 'tenant = "acme"', 'env = "RATCHET_CONSOLE_TOKEN"');
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
      BIN,
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
      { env: { ...process.env, RATCHET_CONSOLE_TOKEN: this.token ?? "", RATCHET_LOG: "warn" }, stdio: ["ignore", "ignore", "pipe"] },
    );
    this.child = child;
    this.url = await new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`ratchet serve did not start:\n${this.log}`)), 30000);
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

  // The server is thrown away with its directory, so it is not given a graceful shutdown (which
  // would wait for a sleeping tool call's grace period).
  async stop() {
    if (this.child && this.child.exitCode === null && this.child.signalCode === null) await this.kill();
    rmSync(this.dir, { recursive: true, force: true });
  }

  // The API as a test uses it: to check what the console shows against the server's truth,
  // and to make work the console should then show.
  async get(path) {
    return this.request("GET", path);
  }

  async post(path, body) {
    return this.request("POST", path, body);
  }

  async request(method, path, body) {
    const headers = this.token ? { Authorization: `Bearer ${this.token}` } : {};
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(this.url + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    if (!response.ok) throw new Error(`${method} ${path}: ${response.status} ${await response.text()}`);
    return response.json();
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
    if (request.method !== "POST" || request.url !== "/v1/chat/completions") {
      response.writeHead(404, { "Content-Type": "application/json" }).end('{"error": {"message": "not found"}}');
      return;
    }
    if (this.failures > 0) {
      this.failures -= 1;
      response
        .writeHead(503, { "Content-Type": "application/json" })
        .end('{"error": {"message": "The model is overloaded", "type": "server_error"}}');
      return;
    }
    response.writeHead(200, { "Content-Type": "text/event-stream" });
    const chunk = (body) => response.write(`data: ${JSON.stringify({ id: "chatcmpl-1", object: "chat.completion.chunk", model: "m", ...body })}\n\n`);
    chunk({ choices: [{ index: 0, delta: { role: "assistant", content: "" }, finish_reason: null }] });
    for (const word of answer.split(/(?<= )/)) chunk({ choices: [{ index: 0, delta: { content: word }, finish_reason: null }] });
    chunk({ choices: [{ index: 0, delta: {}, finish_reason: "stop" }] });
    chunk({ choices: [], usage: { prompt_tokens: 1200, completion_tokens: 300, total_tokens: 1500 } });
    response.end("data: [DONE]\n\n");
  }

  async stop() {
    this.http.closeAllConnections();
    await new Promise((resolve) => this.http.close(resolve));
  }
}

export async function launchBrowser() {
  return chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    // Without these Chromium reaches for the network at start, which this machine refuses.
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
}

// A page that fails its test on any script error or console error the console itself makes.
export async function openPage(browser, url, viewport = { width: 1280, height: 860 }) {
  // A context of its own: its own storage, like a separate browser profile.
  const context = await browser.newContext({ viewport });
  const page = await context.newPage();
  page.errors = [];
  page.requests = [];
  page.on("request", (request) => page.requests.push(`${request.method()} ${new URL(request.url()).pathname}`));
  page.on("framenavigated", (frame) => page.requests.push(`navigated ${frame.url()}`));
  page.on("pageerror", (error) => page.errors.push(`page error: ${error.message}`));
  page.on("console", (message) => {
    // A refused or failed request is the console's to report in the page, not a script error.
    if (message.type() === "error" && !message.text().startsWith("Failed to load resource")) {
      page.errors.push(`console: ${message.text()}`);
    }
  });
  await page.goto(url);
  return page;
}

const AXE = readFileSync(createRequire(import.meta.url).resolve("axe-core/axe.min.js"), "utf8");

// axe-core's WCAG 2.1 A and AA rules over the page as it is now: every violation, with the
// elements it found. (Evaluated through the driver, which the page's policy does not govern.)
export async function accessibilityViolations(page) {
  await page.evaluate(AXE);
  return page.evaluate(async () => {
    const results = await globalThis.axe.run(document, {
      runOnly: { type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"] },
    });
    return results.violations.map((v) => `${v.id} (${v.impact}): ${v.help} — ${v.nodes.map((n) => n.target.join(" ")).join(", ")}`);
  });
}

export async function screenshot(page, name) {
  if (!SCREENSHOTS) return;
  mkdirSync(SCREENSHOTS, { recursive: true });
  await page.screenshot({ path: join(SCREENSHOTS, `${name}.png`), fullPage: false });
}
