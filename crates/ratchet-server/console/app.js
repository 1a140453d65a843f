// The Ratchet console: a client of the public API (`/v1`) and its event streams, nothing more.
// Every view is drawn from what the server says; the only state kept here is the access token
// (sessionStorage: this tab only) and what the current view has folded from its events.

const TOKEN_KEY = "ratchet.token";
const TERMINAL = new Set(["completed", "failed", "cancelled"]);

// ---------------------------------------------------------------------------------------------
// DOM helpers. Text always goes in as text nodes: nothing the server sends is parsed as HTML.

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "on") {
      for (const [event, handler] of Object.entries(value)) el.addEventListener(event, handler);
    } else if (key === "text") {
      el.textContent = value;
    } else if (key === "class") {
      el.className = value;
    } else if (key in el && !key.includes("-")) {
      el[key] = value;
    } else {
      el.setAttribute(key, value === true ? "" : value);
    }
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function chip(status) {
  return h("span", { class: "chip", "data-status": status, text: status.replaceAll("_", " ") });
}

// Times are shown in the person's chosen zone: local (the default) or UTC.
const SETTINGS_KEY = "ratchet.settings";
const settings = JSON.parse(localStorage.getItem(SETTINGS_KEY) ?? "{}");

function when(millis) {
  if (!millis) return "";
  const zone = settings.timeZone ? { timeZone: settings.timeZone, timeZoneName: "short" } : {};
  return new Date(millis).toLocaleString(undefined, zone);
}

function ago(millis) {
  const seconds = Math.max(0, Math.round((Date.now() - millis) / 1000));
  if (seconds < 60) return `${seconds}s ago`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ago`;
  return new Date(millis).toLocaleDateString();
}

// A message's time of day, in the chosen zone; the whole date on hover.
function stamp(millis) {
  const zone = settings.timeZone ? { timeZone: settings.timeZone } : {};
  return h("time", { class: "stamp", datetime: new Date(millis).toISOString(), title: when(millis), text: new Date(millis).toLocaleTimeString(undefined, zone) });
}

function timeAgo(millis) {
  return h("time", { datetime: new Date(millis).toISOString(), title: when(millis), text: ago(millis) });
}

function seconds(ms) {
  return ms < 10000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms / 1000)} s`;
}

function json(value) {
  return JSON.stringify(value, null, 2);
}

// A JSON value to read: objects and arrays fold (the first two levels open), and a string
// that holds JSON — a tool's result, say — is shown parsed, under a note that it is a string.
function jsonView(value) {
  return h("div", { class: "json" }, jsonNode(value, 0));
}

function jsonInString(text) {
  const trimmed = text.trim();
  if (!trimmed.startsWith("{") && !trimmed.startsWith("[")) return null;
  try {
    const parsed = JSON.parse(trimmed);
    return typeof parsed === "object" && parsed !== null ? parsed : null;
  } catch {
    return null;
  }
}

function jsonNode(value, depth) {
  if (value === null || value === undefined) return h("span", { class: "j-null", text: "null" });
  if (typeof value === "string") {
    const inner = jsonInString(value);
    if (inner) {
      return h("details", { class: "j-fold", open: depth < 2 }, h("summary", { class: "j-note", text: "a string holding JSON" }), jsonNode(inner, depth + 1));
    }
    return h("span", { class: "j-str", text: value });
  }
  if (typeof value !== "object") return h("span", { class: `j-${typeof value}`, text: String(value) });
  const list = Array.isArray(value);
  const entries = list ? value.map((v, i) => [i, v]) : Object.entries(value);
  if (entries.length === 0) return h("span", { class: "j-punct", text: list ? "[]" : "{}" });
  const count = list ? `[ ${entries.length} item${entries.length === 1 ? "" : "s"} ]` : `{ ${entries.length} key${entries.length === 1 ? "" : "s"} }`;
  return h(
    "details",
    { class: "j-fold", open: depth < 2 },
    h("summary", { class: "j-punct", text: count }),
    h("ul", { class: "j-entries" }, ...entries.map(([key, v]) => h("li", {}, h("span", { class: list ? "j-index" : "j-key", text: `${key}: ` }), jsonNode(v, depth + 1)))),
  );
}

// A tool's result: JSON when it holds JSON, else its text.
function resultView(content) {
  const text = String(content ?? "");
  return jsonInString(text) ? jsonView(text) : h("pre", { text });
}

function tokensAndCost(usage) {
  const tokens = (usage?.input_tokens ?? 0) + (usage?.output_tokens ?? 0);
  const parts = [`${tokens.toLocaleString()} tokens`];
  if (usage?.cost_usd) parts.push(`$${usage.cost_usd.toFixed(4)}`);
  return parts.join(" · ");
}

// What a run tree spent: the sum over its nodes (each node's usage is its own run's).
function treeUsage(nodes) {
  const total = { model_calls: 0, tool_calls: 0, input_tokens: 0, output_tokens: 0, reasoning_tokens: 0, cost_usd: 0 };
  for (const node of nodes) {
    for (const key of Object.keys(total)) total[key] += node.usage?.[key] ?? 0;
  }
  if (!nodes.some((n) => typeof n.usage?.cost_usd === "number")) total.cost_usd = null;
  return total;
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// ---------------------------------------------------------------------------------------------
// The access token and the API.

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

let tokenPrompt = null;

// Resolves once the person has entered a token; every caller waiting on a 401 shares one prompt.
function askForToken(refused) {
  const dialog = document.getElementById("token-dialog");
  if (tokenPrompt) {
    if (!dialog.open) dialog.showModal();
    return tokenPrompt;
  }
  const form = document.getElementById("token-form");
  const input = document.getElementById("token-input");
  const error = document.getElementById("token-error");
  error.hidden = !refused;
  error.textContent = refused ? "The server refused that token. Enter another." : "";
  input.value = "";
  tokenPrompt = new Promise((resolve) => {
    form.addEventListener(
      "submit",
      () => {
        sessionStorage.setItem(TOKEN_KEY, input.value.trim());
        updateSignOut();
        tokenPrompt = null;
        resolve();
      },
      { once: true },
    );
  });
  if (!dialog.open) dialog.showModal();
  input.focus();
  return tokenPrompt;
}

function authHeaders() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

function updateSignOut() {
  document.getElementById("sign-out").hidden = !sessionStorage.getItem(TOKEN_KEY);
}

async function api(path, { method = "GET", body } = {}) {
  for (;;) {
    const sent = sessionStorage.getItem(TOKEN_KEY);
    const headers = authHeaders();
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        cache: "no-store",
      });
    } catch {
      connection.set("reconnecting", "Reconnecting…");
      throw new ApiError(0, "unreachable", "The server cannot be reached. Is it running?");
    }
    if (response.status === 401) {
      // A refused request changed nothing, so sending it again is safe: at once if the token
      // changed while it was on its way, else once a person has given another.
      if (sessionStorage.getItem(TOKEN_KEY) === sent) await askForToken(Boolean(sent));
      continue;
    }
    if (response.status === 204) return null;
    const data = await response.json().catch(() => null);
    if (!response.ok) {
      throw new ApiError(
        response.status,
        data?.error?.code ?? "error",
        data?.error?.message ?? `The server answered ${response.status}.`,
      );
    }
    return data;
  }
}

async function allPages(path) {
  const items = [];
  let cursor = null;
  do {
    const sep = path.includes("?") ? "&" : "?";
    const page = await api(`${path}${sep}limit=200${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ""}`);
    items.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor);
  return items;
}

// ---------------------------------------------------------------------------------------------
// Event streams: Server-Sent Events read with fetch, so the token travels in a header rather
// than the URL. A dropped stream reconnects with backoff and `Last-Event-ID`, and the server
// replays exactly what was missed; a `seq` already seen is never applied twice.

// The header's connection state, on every page. While the server cannot be reached the page
// says it may be out of date, and what acts on a run waits (inert) until it is back.
const connection = {
  set(state, text) {
    const el = document.getElementById("connection");
    el.dataset.state = state;
    el.textContent = text;
    const down = state === "reconnecting";
    document.getElementById("stale").hidden = !down;
    for (const acting of document.querySelectorAll("main .controls, main .card, main .stop-banner")) acting.inert = down;
  },
};

class EventStream {
  // `onLive` receives the live activity of steps in flight: events without an id or a seq,
  // never stored, which must not move the cursor. A tree stream's ids are whole cursors
  // (`ses_a:12,ses_b:7`) the server resumes after; a session's or run's are its `seq`.
  constructor(path, onEvent, onLive = () => {}, { tree = false } = {}) {
    this.path = path;
    this.onEvent = onEvent;
    this.onLive = onLive;
    this.tree = tree;
    this.lastId = null;
    this.lastSeq = 0;
    this.stopped = false;
    this.controller = null;
  }

  start() {
    this.loop();
    return this;
  }

  stop() {
    this.stopped = true;
    this.controller?.abort();
  }

  async loop() {
    let backoff = 500;
    while (!this.stopped) {
      this.controller = new AbortController();
      const sent = sessionStorage.getItem(TOKEN_KEY);
      try {
        const headers = { Accept: "text/event-stream", ...authHeaders() };
        if (this.tree ? this.lastId : this.lastSeq > 0) headers["Last-Event-ID"] = this.tree ? this.lastId : String(this.lastSeq);
        const response = await fetch(this.path, { headers, signal: this.controller.signal, cache: "no-store" });
        if (response.status === 401) {
          if (sessionStorage.getItem(TOKEN_KEY) === sent) await askForToken(Boolean(sent));
          continue;
        }
        if (!response.ok) {
          const data = await response.json().catch(() => null);
          connection.set("error", data?.error?.message ?? `Events unavailable (${response.status})`);
          if (response.status >= 400 && response.status < 500) return;
        } else {
          connection.set("live", "Live");
          backoff = 500;
          await this.read(response.body);
        }
      } catch {
        // A dropped connection or an aborted one: the loop decides below.
      } finally {
        // Whatever ended the read, its connection is released before another is opened.
        this.controller.abort();
      }
      if (this.stopped) return;
      connection.set("reconnecting", "Reconnecting…");
      await sleep(backoff);
      backoff = Math.min(backoff * 2, 8000);
    }
  }

  async read(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let id = null;
    let data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (line === "") {
          if (data.length > 0) this.dispatch(id, data.join("\n"));
          id = null;
          data = [];
        } else if (!line.startsWith(":")) {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "id") id = text;
          else if (field === "data") data.push(text);
        }
      }
    }
  }

  dispatch(id, data) {
    const event = JSON.parse(data);
    if (event.live === true) {
      this.onLive(event);
      return;
    }
    if (this.tree) {
      this.lastId = id;
    } else {
      const seq = Number(id ?? event.seq);
      if (seq <= this.lastSeq) return;
      this.lastSeq = seq;
    }
    try {
      this.onEvent(event);
    } catch (error) {
      // One event the view cannot draw must not stop the stream for every later one.
      console.error(`cannot show event ${id} (${event.kind}):`, error);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Shared pieces of views.

// What the step in flight is doing ("calling model gpt-x…"), from live activity; cleared when
// that step is committed or its run ends.
function activityLine() {
  const el = h("p", { class: "activity muted", role: "status", "aria-live": "polite", hidden: true });
  // How long the step has been at it, counted on the page: kept out of what a screen reader
  // announces, which would otherwise change every second.
  const text = h("span");
  const elapsed = h("span", { "aria-hidden": "true" });
  el.append(text, elapsed);
  let step = null;
  let since = null;
  // Ticks while its view is shown; stops once the view has gone.
  let shown = false;
  const tick = setInterval(() => {
    if (el.isConnected) shown = true;
    else if (shown) return clearInterval(tick);
    elapsed.textContent = since === null ? "" : ` (${seconds(Math.max(0, Date.now() - since))})`;
  }, 1000);
  const describe = (p) => {
    switch (p.activity) {
      case "loading_context":
        return "loading context…";
      case "calling_model":
        return p.model ? `calling model ${p.model}…` : "calling the model…";
      case "executing_tools":
        return p.tools?.length ? `running tools: ${p.tools.join(", ")}…` : "running tools…";
      default:
        return null;
    }
  };
  const clear = () => {
    step = null;
    since = null;
    text.textContent = "";
    elapsed.textContent = "";
    el.hidden = true;
  };
  return {
    el,
    live(event) {
      const said = describe(event.payload ?? {});
      if (said === null) return;
      if (said !== text.textContent || step !== event.payload.step_index) since = event.created_at ?? Date.now();
      step = event.payload.step_index;
      text.textContent = said;
      el.hidden = false;
    },
    stored(event) {
      if (step === null) return;
      const ended = event.kind === "run.finished" || (event.kind === "step.committed" && event.payload?.step_index >= step);
      if (ended) clear();
    },
  };
}

function errorRegion() {
  return h("p", { class: "error", role: "alert", hidden: true });
}

function showError(region, error) {
  region.textContent = error instanceof ApiError || error instanceof Error ? error.message : String(error);
  region.hidden = false;
}

function clearError(region) {
  region.textContent = "";
  region.hidden = true;
}

// Runs `action` with the button disabled, reporting a failure in `region`.
async function act(button, region, action) {
  button.disabled = true;
  clearError(region);
  try {
    await action();
  } catch (error) {
    showError(region, error);
  } finally {
    button.disabled = false;
  }
}

// Replaces `container`'s children, keeping the keyboard focus on the same item (by its
// `data-key`) when it was inside: a refresh must not throw a keyboard user back to the top.
function replaceKeepingFocus(container, children) {
  const focused = document.activeElement;
  const key = container.contains(focused) ? focused.closest("[data-key]")?.dataset.key : undefined;
  const tag = focused?.tagName;
  container.replaceChildren(...children);
  if (key === undefined) return;
  const item = [...container.querySelectorAll("[data-key]")].find((el) => el.dataset.key === key);
  const target = item && (item.tagName === tag ? item : item.querySelector(tag.toLowerCase()));
  target?.focus();
}

// What a view shows in place of itself when what its address names does not exist (or is
// another tenant's): a page that never half-loads, with no control left to act on.
function showGone(view, error, stop) {
  stop();
  view.replaceChildren(
    h("h1", { text: "Not found" }),
    h("p", { role: "alert" }, `${error.message}. `, h("a", { href: "#/", text: "Go to the sessions." })),
  );
  connection.set("idle", "");
}

// A button that copies `text` (an id) to the clipboard, and says so.
function copyButton(text, what) {
  const button = h("button", { type: "button", class: "quiet", text: "Copy", "aria-label": `Copy ${what}` });
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(text);
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => (button.textContent = "Copy"), 1500);
  });
  return button;
}

function runLink(runId) {
  return h("a", { href: `#/runs/${runId}`, class: "mono", text: runId });
}

// Why a run stopped, in words, where the person looks — the reason, the model's last error,
// each budget that ran out and by how much — with what fits inline: Retry for a failed model
// call, Continue with more of each budget for any failed run. `run` is a `RunView`.
const STOPPED = {
  llm_error: "The model call failed, and its attempts ran out.",
  budget_exhausted: "The run spent its budget.",
  timed_out: "The run ran out of time.",
  parse_failures: "The model's tool calls could not be read, again and again.",
  cancelled: "The run was cancelled.",
  human_aborted: "A person aborted the run.",
};
const BUDGETS = {
  steps: ["steps", "extra_steps", 1],
  model_calls: ["model calls", "extra_model_calls", 1],
  tool_calls: ["tool calls", "extra_tool_calls", 1],
  tokens: ["tokens", "extra_tokens", 1],
  prompt_tokens: ["prompt tokens", null, 1],
  duration_ms: ["seconds", "extra_duration_ms", 1000],
};

function stopBanner(run, lastError, onChange) {
  const region = errorRegion();
  const reason = STOPPED[run.stop_reason] ?? `The run ended ${run.status} (${(run.stop_reason ?? "").replaceAll("_", " ")}).`;
  const spent = (run.budgets ?? []).filter((b) => b.spent);
  const items = [h("p", {}, h("strong", { text: reason }))];
  if (lastError) items.push(h("p", {}, "The last error: ", h("code", { text: lastError })));
  if (spent.length) {
    items.push(
      h(
        "ul",
        { class: "spent" },
        ...spent.map((b) => {
          const [name, , scale] = BUDGETS[b.kind] ?? [b.kind, null, 1];
          const used = Math.round(b.used / scale).toLocaleString();
          const limit = Math.round(b.limit / scale).toLocaleString();
          return h("li", { "data-budget": b.kind }, `${used} of ${limit} ${name} used`);
        }),
      ),
    );
  }
  if (run.status === "failed") {
    const actions = h("div", { class: "actions" });
    if (run.stop_reason === "llm_error") {
      const retry = h("button", { type: "button", text: "Retry" });
      retry.addEventListener("click", () => act(retry, region, async () => onChange(await api(`/v1/runs/${run.id}/retry`, { method: "POST" }))));
      actions.append(retry);
      items.push(h("p", { class: "muted", text: "Retry calls the model again where it failed, with the budget the run has. Continue gives it more budget as well." }));
    }
    // One field per budget the API can extend; the ones that ran out first, filled in.
    const fields = Object.entries(BUDGETS)
      .filter(([, [, key]]) => key)
      .map(([kind, [name, key, scale]]) => {
        const input = h("input", { type: "number", min: "1", class: "narrow", id: `more-${kind}-${run.id}` });
        const budget = (run.budgets ?? []).find((b) => b.kind === kind);
        if (budget?.spent) input.value = String(Math.max(1, Math.ceil(budget.limit / scale / 2)));
        return { input, key, scale, el: h("div", { class: "field" }, h("label", { for: input.id, text: `More ${name}` }), input) };
      });
    const cont = h("button", { type: "submit", class: "primary", text: "Continue" });
    const form = h("form", { class: "inline", "aria-label": "Continue with more budget" }, ...fields.map((f) => f.el), cont);
    form.addEventListener("submit", (submitted) => {
      submitted.preventDefault();
      act(cont, region, async () => {
        const body = {};
        for (const f of fields) {
          const value = Number(f.input.value);
          if (f.input.value && Number.isFinite(value) && value > 0) body[f.key] = Math.round(value * f.scale);
        }
        onChange(await api(`/v1/runs/${run.id}/continue`, { method: "POST", body }));
      });
    });
    if (run.stop_reason !== "llm_error") items.push(h("p", { class: "muted", text: "Continue goes on from where the run stopped, with more of each budget you fill in." }));
    items.push(form, actions);
  }
  return h("section", { class: "stop-banner", "data-run": run.id, "aria-label": "Why the run stopped" }, ...items, region);
}

// Nothing is decided for the person: each call that needs approval starts undecided, and
// "Approve all" / "Deny all" are explicit. Once decided, the card keeps what was decided,
// with the notes, by whom and when.
function approvalCard(event) {
  const { approval_id: approvalId, calls } = event.payload;
  const cardRegion = errorRegion();
  const decide = h("button", { type: "submit", class: "primary", text: "Submit decisions" });
  const approveAll = h("button", { type: "button", text: "Approve all" });
  const denyAll = h("button", { type: "button", text: "Deny all" });
  const abort = h("button", { type: "button", class: "danger", text: "Abort run" });
  const state = h("p", { class: "muted", tabindex: "-1", text: "Waiting for your decision: no call of this batch runs until then." });
  const groups = calls.map((call, index) => {
    const name = `decision-${approvalId}-${index}`;
    const note = h("input", { type: "text", id: `${name}-note`, name: `${name}-note` });
    if (!call.needs_approval) {
      return {
        call,
        el: h("p", {}, h("code", { text: call.tool }), " ", h("span", { class: "mono", text: call.call_id }), " runs with its batch once it is approved."),
      };
    }
    const radio = (value, label) => h("label", {}, h("input", { type: "radio", name, value, required: true }), ` ${label}`);
    return {
      call,
      note,
      name,
      el: h(
        "fieldset",
        {},
        h("legend", {}, h("code", { text: call.tool }), " ", h("span", { class: "mono", text: call.call_id })),
        jsonView(call.arguments),
        h("div", { class: "actions" }, radio("approve", "Approve"), radio("deny", "Deny")),
        h("div", { class: "field" }, h("label", { for: note.id, text: "Note (optional)" }), note),
      ),
    };
  });
  const gated = groups.filter((g) => g.name);
  const form = h(
    "form",
    {},
    ...groups.map((g) => g.el),
    h("div", { class: "actions" }, decide, approveAll, denyAll, abort),
  );
  const card = h(
    "li",
    { class: "item card", "data-approval": approvalId, "data-state": "pending" },
    h("section", { "aria-label": `Approval ${approvalId}` }, h("div", { class: "who", text: "Approval needed" }), state, form, cardRegion),
  );
  const send = (button, verdictOf) =>
    act(button, cardRegion, async () => {
      const decisions = gated.map((g) => {
        const decision = verdictOf(g);
        const note = g.note.value.trim();
        return note ? { call_id: g.call.call_id, decision, note } : { call_id: g.call.call_id, decision };
      });
      await api(`/v1/approvals/${approvalId}`, { method: "POST", body: { decisions } });
    });
  // The browser refuses to submit while a call is undecided (each radio is required).
  form.addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    send(decide, (g) => form.querySelector(`input[name="${g.name}"]:checked`).value);
  });
  approveAll.addEventListener("click", () => send(approveAll, () => "approve"));
  denyAll.addEventListener("click", () => send(denyAll, () => "deny"));
  abort.addEventListener("click", () =>
    act(abort, cardRegion, () => api(`/v1/approvals/${approvalId}`, { method: "POST", body: { abort: true } })),
  );
  card.decided = (answer, by, at) => {
    card.dataset.state = "decided";
    form.hidden = true;
    const who = `${by ? ` by ${by}` : ""}${at ? ` on ${when(at)}` : ""}`;
    if (answer === "abort" || answer?.abort) {
      state.textContent = `Aborted${who}: the run was cancelled.`;
    } else {
      state.textContent = `Decided${who}:`;
      const byCall = new Map((answer?.decisions ?? []).map((d) => [d.call_id, d]));
      state.after(
        h(
          "ul",
          { class: "decisions" },
          ...gated.map((g) => {
            const decision = byCall.get(g.call.call_id);
            const verdict = decision?.decision === "approve" ? "approved" : decision?.decision === "deny" ? "denied" : "undecided";
            return h(
              "li",
              { "data-call": g.call.call_id, "data-verdict": verdict },
              h("code", { text: g.call.tool }),
              " ",
              h("span", { class: "mono", text: g.call.call_id }),
              `: ${verdict}`,
              decision?.note ? ` — “${decision.note}”` : "",
            );
          }),
        ),
      );
    }
    if (card.contains(document.activeElement)) state.focus();
  };
  card.closed = () => {
    if (card.dataset.state !== "pending") return;
    card.dataset.state = "decided";
    form.hidden = true;
    state.textContent = "The run ended before anyone decided.";
  };
  return card;
}

// Cancel, retry and continue for one run, enabled by what its status allows.
// `own`: drawn on the run's own page, where a link to the run would lead nowhere new.
function runControls(onChange, { own = false } = {}) {
  const region = errorRegion();
  // The run and its status on lines of their own: a new status never moves the buttons.
  const which = h("p", { class: "muted" });
  const status = h("p", { class: "run-line" });
  const cancel = h("button", { type: "button", class: "danger", text: "Cancel run" });
  const pause = h("button", { type: "button", text: "Pause" });
  const resume = h("button", { type: "button", text: "Resume" });
  const retry = h("button", { type: "button", text: "Retry" });
  const extra = h("input", { type: "number", min: "1", value: "10", id: `extra-${Math.random().toString(36).slice(2)}`, class: "narrow" });
  const cont = h("button", { type: "button", text: "Continue" });
  let run = null;
  const el = h(
    "div",
    { class: "controls" },
    which,
    status,
    h("div", { class: "actions" }, pause, resume, cancel, retry),
    h(
      "div",
      { class: "inline" },
      h("div", { class: "field" }, h("label", { for: extra.id, text: "Extra steps" }), extra),
      cont,
    ),
    region,
  );
  // After an action the run's new status decides which buttons are enabled, not the action.
  cancel.addEventListener("click", () =>
    act(cancel, region, async () => onChange(await api(`/v1/runs/${run.id}/cancel`, { method: "POST" }))).then(
      () => update(run),
    ),
  );
  for (const [button, action] of [
    [pause, "pause"],
    [resume, "resume"],
    [retry, "retry"],
  ]) {
    button.addEventListener("click", () =>
      act(button, region, async () => onChange(await api(`/v1/runs/${run.id}/${action}`, { method: "POST" }))).then(
        () => update(run),
      ),
    );
  }
  cont.addEventListener("click", () =>
    act(cont, region, async () => {
      const steps = Number(extra.value);
      const body = Number.isInteger(steps) && steps > 0 ? { extra_steps: steps } : {};
      return onChange(await api(`/v1/runs/${run.id}/continue`, { method: "POST", body }));
    }).then(() => update(run)),
  );
  function update(next) {
    run = next;
    el.hidden = !run;
    if (!run) return;
    which.replaceChildren(...(own ? [] : ["Run ", runLink(run.id)]));
    status.replaceChildren(
      chip(run.status),
      run.stop_reason && run.stop_reason !== run.status ? ` (${run.stop_reason.replaceAll("_", " ")})` : "",
      run.pause_requested ? " (pausing when its step ends)" : "",
      run.wait ? ` (${run.wait.woken_by_input ? "woken by input" : `until ${new Date(run.wait.due_at).toLocaleString()}`})` : "",
    );
    pause.disabled = !(run.status === "running" || run.status === "waiting_timer") || run.pause_requested;
    resume.disabled = !(run.status === "paused" || run.pause_requested);
    cancel.disabled = TERMINAL.has(run.status) || run.status === "cancelling";
    retry.disabled = !(run.status === "failed" && run.stop_reason === "llm_error");
    cont.disabled = run.status !== "failed";
  }
  update(null);
  return { el, update };
}

// ---------------------------------------------------------------------------------------------
// Sessions.

function showSessions(view) {
  const region = errorRegion();
  const agents = h("select", { id: "new-agent", name: "agent" }, h("option", { value: "default", text: "default — the server's own model" }));
  const create = h("button", { type: "submit", class: "primary", text: "Create session" });
  const body = h("tbody");
  const more = h("button", { type: "button", text: "Load more", hidden: true });
  const summary = h("p", { class: "muted", role: "status" });

  // What the list shows: every filter is a query of `GET /v1/sessions`.
  const search = h("input", { type: "search", id: "find-text", placeholder: "Title, message or id (press /)", "aria-keyshortcuts": "/" });
  const status = h(
    "select",
    { id: "find-status" },
    ...[
      ["", "Any status"],
      ["waiting_human", "Waiting for a person"],
      ["failed", "Failed"],
      ["active", "Active"],
      ["idle", "Idle"],
      ["archived", "Archived"],
    ].map(([value, text]) => h("option", { value, text })),
  );
  const agentFilter = h("select", { id: "find-agent" }, h("option", { value: "", text: "Any agent" }), h("option", { value: "default", text: "default" }));
  const from = h("input", { type: "date", id: "find-from" });
  const until = h("input", { type: "date", id: "find-until" });
  const order = h(
    "select",
    { id: "find-order" },
    h("option", { value: "activity", text: "Latest activity first" }),
    h("option", { value: "newest", text: "Newest first" }),
    h("option", { value: "oldest", text: "Oldest first" }),
  );
  const field = (control, label) => h("div", { class: "field" }, h("label", { for: control.id, text: label }), control);
  const filters = h(
    "form",
    { class: "inline filters", role: "search", "aria-label": "Find sessions" },
    field(search, "Search"),
    field(status, "Status"),
    field(agentFilter, "Of agent"),
    field(from, "Created from"),
    field(until, "Created until"),
    field(order, "Order"),
  );

  const form = h(
    "form",
    { "aria-label": "New session", class: "inline" },
    field(agents, "Agent"),
    create,
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    act(create, region, async () => {
      const session = await api("/v1/sessions", { method: "POST", body: { agent: agents.value } });
      location.hash = `#/sessions/${session.id}`;
    });
  });

  view.append(
    h("h1", { text: "Sessions" }),
    h("p", { class: "muted", text: "A session is one conversation with an agent: each message you send starts a run, one at a time. Agents come from the server's catalog." }),
    form,
    filters,
    region,
    summary,
    h(
      "div",
      { class: "scroll" },
      h(
        "table",
        {},
        h("caption", { text: "Sessions matching the filters; refreshed every few seconds." }),
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            h("th", { scope: "col", text: "Session" }),
            h("th", { scope: "col", text: "Agent" }),
            h("th", { scope: "col", text: "Status" }),
            h("th", { scope: "col", text: "Last activity" }),
            h("th", { scope: "col", class: "hide-narrow", text: "Created" }),
          ),
        ),
        body,
      ),
    ),
    h("div", { class: "actions" }, more),
  );

  function row(session) {
    // An idle session whose last run failed says so: that is what a person must look at.
    const shown = session.status === "idle" && session.last_run_status === "failed" ? "failed" : session.status;
    return h(
      "tr",
      { "data-session": session.id, "data-key": session.id },
      h(
        "td",
        {},
        h("a", { href: `#/sessions/${session.id}`, text: session.title || "Untitled" }),
        h("div", { class: "mono small", text: session.id }),
      ),
      h("td", { text: session.agent ?? "default" }),
      h("td", {}, chip(shown)),
      h("td", {}, timeAgo(session.last_activity_at)),
      h("td", { class: "hide-narrow", text: when(session.created_at) }),
    );
  }

  function query() {
    const params = new URLSearchParams({ order: order.value });
    if (search.value.trim()) params.set("q", search.value.trim());
    if (status.value) params.set("status", status.value);
    if (agentFilter.value) params.set("agent", agentFilter.value);
    if (from.value) params.set("created_from", String(new Date(`${from.value}T00:00:00`).getTime()));
    if (until.value) params.set("created_before", String(new Date(`${until.value}T00:00:00`).getTime() + 86400000));
    return params;
  }

  // How many sessions the person has asked to see; every refresh reads that many again,
  // page after page, so the list never stops at a cap.
  let wanted = 50;
  let reads = 0;
  let drawn = null;
  async function refresh() {
    const read = ++reads;
    try {
      const items = [];
      let cursor = null;
      let exhausted = false;
      while (items.length < wanted) {
        const params = query();
        params.set("limit", String(Math.min(200, wanted - items.length)));
        if (cursor) params.set("cursor", cursor);
        const page = await api(`/v1/sessions?${params}`);
        items.push(...page.items);
        cursor = page.next_cursor;
        if (!cursor) {
          exhausted = true;
          break;
        }
      }
      if (read !== reads) return;
      const data = JSON.stringify(items);
      if (data === drawn) {
        for (const time of body.querySelectorAll("time")) time.textContent = ago(Date.parse(time.dateTime));
      } else {
        drawn = data;
        replaceKeepingFocus(body, items.map(row));
      }
      if (items.length === 0) {
        const filtered = [...query().keys()].some((key) => key !== "order");
        body.replaceChildren(h("tr", {}, h("td", { colspan: "5", class: "muted", text: filtered ? "No session matches." : "No sessions yet: create one above." })));
      }
      summary.textContent = `${items.length}${exhausted ? "" : "+"} session${items.length === 1 ? "" : "s"} shown.`;
      more.hidden = exhausted;
      clearError(region);
      connection.set("live", "Live");
    } catch (error) {
      if (read === reads) showError(region, error);
    }
  }

  more.addEventListener("click", () => {
    wanted += 50;
    refresh();
  });
  let typing = null;
  const restart = () => {
    wanted = 50;
    drawn = null;
    refresh();
  };
  search.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(restart, 250);
  });
  filters.addEventListener("submit", (event) => event.preventDefault());
  for (const control of [status, agentFilter, from, until, order]) control.addEventListener("change", restart);

  api("/v1/agents")
    .then((page) => {
      for (const agent of page.items) {
        agents.append(h("option", { value: agent.id, text: agent.description ? `${agent.id} — ${agent.description}` : agent.id }));
        agentFilter.append(h("option", { value: agent.id, text: agent.id }));
      }
    })
    .catch((error) => showError(region, error));
  refresh();
  const timer = setInterval(refresh, 3000);
  connection.set("idle", "");
  return () => {
    clearInterval(timer);
    clearTimeout(typing);
  };
}

// ---------------------------------------------------------------------------------------------
// A session: its conversation, folded from the session's events, live.

function showSession(view, sessionId) {
  const region = errorRegion();
  const titleText = h("span", { text: "Session" });
  const title = h("h1", {}, titleText);
  // A session is named by its first message until someone renames it here.
  const rename = h("button", { type: "button", class: "quiet", text: "Rename" });
  const newTitle = h("input", { type: "text", id: "session-title", maxlength: "200", required: true });
  const saveTitle = h("button", { type: "submit", class: "primary", text: "Save title" });
  const cancelRename = h("button", { type: "button", text: "Keep it" });
  const renameForm = h(
    "form",
    { class: "inline", hidden: true, "aria-label": "Rename the session" },
    h("div", { class: "field" }, h("label", { for: newTitle.id, text: "Title" }), newTitle),
    saveTitle,
    cancelRename,
  );
  const identity = h("p", { class: "muted mono small" }, sessionId, " ", copyButton(sessionId, "the session id"), " ", rename);
  rename.addEventListener("click", () => {
    renameForm.hidden = false;
    newTitle.value = titleText.textContent === "Untitled session" ? "" : titleText.textContent;
    newTitle.focus();
  });
  cancelRename.addEventListener("click", () => {
    renameForm.hidden = true;
    rename.focus();
  });
  renameForm.addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    act(saveTitle, region, async () => {
      const session = await api(`/v1/sessions/${sessionId}`, { method: "PATCH", body: { title: newTitle.value } });
      titleText.textContent = session.title;
      renameForm.hidden = true;
      rename.focus();
    });
  });
  // Holds its line from the start, so that nothing below it moves when the facts arrive.
  const facts = h("p", { class: "muted run-line", text: "Loading…" });
  // The live region wraps the list, so its items stay list items.
  const log = h("ol", { class: "log" });
  const conversation = h("div", { role: "log", "aria-label": "Conversation", "aria-live": "polite" }, log);
  const activity = activityLine();
  const controls = runControls((changed) => refreshRun(changed.run_id ?? changed.id));
  const runsList = h("ul", { class: "runs" });
  const content = h("textarea", { id: "message", name: "content", rows: 3, required: true });
  const multitask = h(
    "select",
    { id: "multitask", name: "multitask" },
    h("option", { value: "enqueue", text: "Queue it after the active run" }),
    h("option", { value: "steer", text: "Steer the active run" }),
    h("option", { value: "interrupt", text: "Interrupt the active run" }),
    h("option", { value: "reject", text: "Refuse if a run is active" }),
  );
  const send = h("button", { type: "submit", class: "primary", text: "Send" });
  const composer = h(
    "form",
    { class: "composer", "aria-label": "Send a message" },
    h("div", { class: "field" }, h("label", { for: "message", text: "Message" }), content),
    h(
      "div",
      { class: "inline" },
      h("div", { class: "field" }, h("label", { for: "multitask", text: "While a run is active" }), multitask),
      send,
    ),
    h("p", { class: "notice", text: "Ctrl+Enter sends." }),
  );
  const archive = h("button", { type: "button", class: "danger", text: "Archive session" });
  const panelTitle = h("h2", { id: "latest-run", text: "Latest run" });
  const readOnly = h("p", { class: "notice read-only", role: "status", hidden: true, text: "This session is archived: it is read-only and takes no more messages." });
  // A delegated run's session is its parent's business: shown, never written to.
  const taskOf = h("p", { class: "notice read-only task-of", hidden: true });
  const runSection = h("section", { "aria-labelledby": "latest-run", class: "run-section" }, panelTitle, controls.el);

  view.append(
    title,
    identity,
    renameForm,
    facts,
    taskOf,
    region,
    h(
      "div",
      { class: "session" },
      h("div", { class: "session-main" }, conversation, activity.el, readOnly, composer),
      h(
        "aside",
        { class: "side", "aria-label": "Session details" },
        runSection,
        h(
          "section",
          { "aria-labelledby": "more-title" },
          h("h2", { id: "more-title", text: "More" }),
          h("p", {}, h("a", { href: `#/sessions/${sessionId}/inbox`, text: "Inbox and dead letters" })),
          h("div", { class: "actions" }, archive),
        ),
        // Last, because it grows.
        h("section", { "aria-labelledby": "runs-title" }, h("h2", { id: "runs-title", text: "Runs" }), runsList),
      ),
    ),
  );

  // run id -> { status, stopReason, assistant (the streaming item), tools: Map, cards: [] }
  const runs = new Map();
  let latestRunId = null;
  let archived = false;
  let delegated = false;

  // An archived session takes no more messages, nor does a delegated run's: their controls
  // stay disabled whatever ran last.
  function closeIfArchived() {
    send.disabled = archived || delegated;
    content.disabled = archived || delegated;
    multitask.disabled = archived || delegated;
    archive.disabled = archived || delegated;
    readOnly.hidden = !archived;
    composer.hidden = delegated;
  }

  // On a phone the run's controls sit above the conversation, not a screen's scroll below it.
  const phone = matchMedia("(max-width: 50rem)");
  const side = view.querySelector("aside.side");
  const main = view.querySelector(".session-main");
  function placeControls() {
    if (phone.matches) main.prepend(runSection);
    else side.prepend(runSection);
  }
  phone.addEventListener("change", placeControls);
  placeControls();

  // What the session's runs spent, with everything they delegated: each run's tree is read
  // until the whole tree has ended, then kept.
  const spentByRun = new Map();
  async function sessionSpend(runIds) {
    await Promise.all(
      runIds
        .filter((id) => !spentByRun.get(id)?.ended)
        .map(async (id) => {
          const tree = await api(`/v1/runs/${id}/tree`);
          spentByRun.set(id, { usage: treeUsage(tree.nodes), ended: tree.nodes.every((n) => TERMINAL.has(n.status)), delegated: tree.nodes.length > 1 });
        }),
    );
    const total = treeUsage(runIds.map((id) => ({ usage: spentByRun.get(id)?.usage })));
    return { total, delegated: runIds.some((id) => spentByRun.get(id)?.delegated) };
  }

  function runOf(runId) {
    if (!runs.has(runId)) runs.set(runId, { status: "queued", assistant: null, tools: new Map(), cards: [], group: null });
    return runs.get(runId);
  }

  // Each run of the session is a group of its own — its messages, answers, tools, cards and
  // notices, under a line with its status, times, tokens and cost — so that nothing of one run
  // lands under another, whatever order the events interleave in.
  function groupOf(runId) {
    const run = runOf(runId);
    if (!run.group) {
      const chipAt = h("span", { class: "run-status" }, chip(run.status));
      const facts = h("span", { class: "run-facts" });
      const head = h("div", { class: "item-run" }, "Run ", runLink(runId), " ", chipAt, " ", facts);
      const items = h("ol", { class: "log run-items" });
      const el = h("li", { class: "run-group", "data-run": runId }, head, items);
      run.group = { el, items, chipAt, facts };
      follow(() => log.append(el), el);
    }
    return run.group;
  }

  function drawRunHead(runId, finished) {
    const run = runOf(runId);
    const group = groupOf(runId);
    group.chipAt.replaceChildren(chip(run.status));
    if (!finished) return;
    const counters = finished.payload?.counters ?? {};
    const tokens = (counters.input_tokens ?? 0) + (counters.output_tokens ?? 0);
    const parts = [];
    if (run.createdAt) parts.push(`${when(run.createdAt)} – ${new Date(finished.created_at).toLocaleTimeString()}, ${seconds(finished.created_at - run.createdAt)}`);
    if (tokens) parts.push(`${tokens.toLocaleString()} tokens`);
    if (counters.cost_microusd) parts.push(`$${(counters.cost_microusd / 1e6).toFixed(4)}`);
    group.facts.textContent = parts.length ? `· ${parts.join(" · ")}` : "";
  }

  // Follows the conversation only while the reader is at its end, never pulling them away
  // from what they scrolled back to.
  function follow(add, item) {
    const atEnd = window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 80;
    add();
    if (atEnd) item.scrollIntoView({ block: "nearest" });
    return item;
  }

  // An item of run `runId`, or of the session when it names none.
  function append(item, runId) {
    return follow(() => (runId ? groupOf(runId).items : log).append(item), item);
  }

  function notice(runId, text, ...extra) {
    return append(h("li", { class: "item item-notice" }, text, ...extra), runId);
  }

  function assistantItem(runId, at) {
    const run = runOf(runId);
    if (!run.assistant) {
      run.assistant = append(
        h(
          "li",
          { class: "item item-assistant", "data-run": runId, "data-streaming": "true" },
          h("div", { class: "who" }, "Assistant", stamp(at)),
          h("div", { class: "text" }),
        ),
        runId,
      );
    }
    return run.assistant;
  }

  function toolItem(runId, callId, name, args) {
    const run = runOf(runId);
    let item = run.tools.get(callId);
    if (!item) {
      item = append(
        h(
          "li",
          { class: "item item-tool", "data-call": callId, "data-state": "waiting" },
          h("div", { class: "who" }, "Tool ", h("code", { text: name })),
          h("details", {}, h("summary", { text: "Arguments" }), jsonView(args)),
          h("div", { class: "result muted", text: "Waiting to run…" }),
        ),
        runId,
      );
      run.tools.set(callId, item);
    }
    return item;
  }

  // `ended`: the calls an ended run left in doubt; what happened can be recorded, nothing
  // runs again.
  function reconciliationCard(runId, calls, ended = false) {
    const cards = new Map();
    const intro = ended
      ? "The run ended while these calls ran, so whether they took effect is unknown. Record what happened to each; the run stays ended."
      : "Whether these calls took effect is unknown (the process stopped, a call timed out or lost its connection), or their tool changed since the model saw it. Say what happened to each; nothing runs again until you do.";
    const card = h(
      "li",
      { class: "item card", "data-reconciliation": runId, "data-state": "pending" },
      h("div", { class: "who", text: ended ? "Calls in doubt" : "Reconciliation needed" }),
      h("p", {}, intro),
    );
    calls.forEach((call, index) => {
      const cardRegion = errorRegion();
      const id = `reconcile-${runId}-${index}`;
      const outcome = h(
        "select",
        { id: `${id}-outcome`, required: true },
        h("option", { value: "", text: "Choose what happened…", disabled: true, selected: true }),
        h("option", { value: "succeeded", text: "It succeeded" }),
        h("option", { value: "failed", text: "It failed" }),
        ...(ended ? [] : [h("option", { value: "retry", text: "Run it again" })]),
        h("option", { value: "skip", text: "Skip it" }),
      );
      const result = h("input", { type: "text", id: `${id}-result` });
      const record = h("button", { type: "submit", class: "primary", text: "Record outcome" });
      const form = h(
        "form",
        {},
        h("div", { class: "inline" }, h("div", { class: "field" }, h("label", { for: outcome.id, text: "Outcome" }), outcome),
          h("div", { class: "field" }, h("label", { for: result.id, text: "Result the model reads (optional)" }), result), record),
      );
      const section = h(
        "section",
        { "aria-label": `Reconcile ${call.call_id}` },
        h("p", {}, h("code", { text: call.tool }), " ", h("span", { class: "mono", text: call.call_id }), ` · key ${call.idempotency_key}`),
        ...(call.drift ? [h("p", { text: call.drift })] : []),
        jsonView(call.arguments),
        form,
        cardRegion,
      );
      form.addEventListener("submit", (submitted) => {
        submitted.preventDefault();
        act(record, cardRegion, async () => {
          const body = { call_id: call.call_id, outcome: outcome.value };
          if (result.value.trim()) body.result = result.value.trim();
          await api(`/v1/runs/${runId}/reconcile`, { method: "POST", body });
        });
      });
      cards.set(call.call_id, { section, form });
      card.append(section);
    });
    card.decided = (callId, answer) => {
      const entry = cards.get(callId);
      if (!entry) return;
      const hadFocus = entry.section.contains(document.activeElement);
      entry.form.hidden = true;
      const recorded = h("p", { class: "muted", tabindex: "-1", text: `Recorded: ${typeof answer === "string" ? answer : (answer?.outcome ?? json(answer))}.` });
      entry.section.append(recorded);
      if (hadFocus) recorded.focus();
      if ([...cards.values()].every((c) => c.form.hidden)) card.dataset.state = "decided";
    };
    card.closed = () => {
      if (card.dataset.state !== "pending") return;
      card.dataset.state = "decided";
      for (const entry of cards.values()) entry.form.hidden = true;
      card.append(h("p", { class: "muted", text: "The run ended before anyone answered." }));
    };
    return card;
  }

  const approvals = new Map();
  const reconciliations = new Map();
  const ticking = setInterval(() => {
    for (const result of log.querySelectorAll('.item-tool[data-state="running"] .result[data-since]')) {
      result.textContent = `Running… (${seconds(Date.now() - Number(result.dataset.since))})`;
    }
  }, 1000);
  // message id -> the item of a steering message the run has not taken yet
  const pendingSteers = new Map();

  // The runs below this session's runs live in sessions of their own: each root run that
  // starts one is followed through its tree stream, and what its children do that a person
  // must see (their approvals above all) is shown under their `subagent.started` notice.
  // child run id -> the notice's list of what that run does
  const below = new Map();
  // root run id -> its tree stream, until every run of the tree has finished
  const trees = new Map();

  // A child started by a `delegate` call: its task, and — once it has ended — its answer,
  // status and spend, with its whole transcript a click away.
  function childNotice(p, parentList) {
    if (below.has(p.child_run_id)) return;
    const outcome = h("div", { class: "child-outcome", "aria-live": "polite" });
    const transcript = h("details", { class: "transcript" }, h("summary", { text: "Transcript" }));
    transcript.addEventListener("toggle", () => {
      if (transcript.open) readTranscript(transcript, p.child_session_id);
    });
    const item = h(
      "li",
      { class: "item item-notice", "data-child-run": p.child_run_id },
      `Started ${p.agent} `,
      runLink(p.child_run_id),
      `${p.background ? " in the background" : ""} for: ${p.task}`,
      outcome,
      p.child_session_id ? transcript : null,
    );
    below.set(p.child_run_id, { item, list: null, agent: p.agent, outcome });
    follow(() => parentList.append(item), item);
  }

  // Where a child's notice goes: under the `delegate` call that started it, else in its
  // parent's group.
  function childrenOf(runId, callId) {
    const call = callId && runOf(runId).tools.get(callId);
    if (!call) return groupOf(runId).items;
    let list = call.querySelector(":scope > ul.children");
    if (!list) {
      list = h("ul", { class: "below children", "aria-label": "Runs this call started" });
      call.append(list);
    }
    return list;
  }

  async function childEnded(childRunId) {
    const child = below.get(childRunId);
    if (!child) return;
    try {
      const run = await api(`/v1/runs/${childRunId}`);
      const took = run.finished_at ? `, ${seconds(run.finished_at - run.created_at)}` : "";
      child.outcome.replaceChildren(
        h("div", { class: "muted small" }, chip(run.status), ` ${tokensAndCost(run.usage)}${took}`),
        run.final_answer ? h("div", { class: "text child-answer" }, h("span", { class: "muted", text: "Answer: " }), run.final_answer) : null,
      );
    } catch (error) {
      showError(region, error);
    }
  }

  async function readTranscript(transcript, childSessionId) {
    if (transcript.dataset.read) return;
    transcript.dataset.read = "true";
    try {
      const messages = await allPages(`/v1/sessions/${childSessionId}/messages`);
      transcript.append(
        h(
          "ol",
          { class: "log transcript-items" },
          ...messages.map((m) =>
            h(
              "li",
              { class: `item item-${m.role}` },
              h("div", { class: "who" }, m.role === "tool" ? ["Result of ", h("code", { text: m.tool_call_id ?? "" })] : m.role),
              m.role === "tool" ? resultView(m.content) : h("div", { class: "text", text: m.content }),
              m.tool_calls.length ? jsonView(m.tool_calls) : null,
            ),
          ),
        ),
        h("p", {}, h("a", { href: `#/sessions/${childSessionId}`, text: "Open the task's session" })),
      );
    } catch (error) {
      delete transcript.dataset.read;
      showError(region, error);
    }
  }

  // The list under a child's notice, made when it first holds something.
  function workOf(runId) {
    const child = below.get(runId);
    if (!child) return null;
    if (!child.list) {
      child.list = h("ul", { class: "below", "aria-label": `What ${child.agent} ${runId} does` });
      child.item.append(child.list);
    }
    return child.list;
  }

  function followTree(rootId) {
    if (trees.has(rootId)) return;
    const open = new Set([rootId]);
    const tools = new Map();
    const stream = new EventStream(
      `/v1/runs/${rootId}/tree/events`,
      (event) => {
        const p = event.payload ?? {};
        const runId = event.run_id;
        if (event.kind === "subagent.started") open.add(p.child_run_id);
        if (event.kind === "run.finished") open.delete(runId);
        // The root's own events come from the session's stream.
        if (event.depth > 0) applyBelow(event, p, runId, tools);
        if (open.size === 0) stream.stop();
      },
      () => {},
      { tree: true },
    );
    trees.set(rootId, stream);
    stream.start();
  }

  function applyBelow(event, p, runId, tools) {
    const list = workOf(runId) ?? log;
    switch (event.kind) {
      case "subagent.started":
        childNotice(p, list);
        break;
      case "subagent.finished":
        childEnded(p.child_run_id);
        break;
      case "tool.call": {
        const result = h("span", { class: "muted", text: "running…" });
        tools.set(`${runId}/${p.call_id}`, result);
        list.append(h("li", { class: "item-below", "data-call": p.call_id }, h("code", { text: p.tool }), " ", result));
        break;
      }
      case "tool.result": {
        const result = tools.get(`${runId}/${p.call_id}`);
        if (result) result.textContent = p.is_error ? "failed" : "done";
        break;
      }
      case "approval.required": {
        const card = approvalCard(event);
        approvals.set(p.approval_id, card);
        runOf(runId).cards.push(card);
        list.append(card);
        card.scrollIntoView({ block: "nearest" });
        break;
      }
      case "approval.decided":
        approvals.get(p.approval_id)?.decided(p.answer, p.by, event.created_at);
        break;
      case "run.finished":
        for (const card of runOf(runId).cards) card.closed();
        break;
      default:
        break;
    }
  }

  // While events pour in (a replay, a streaming answer) the log is busy, so a screen reader
  // reads what settled rather than every fragment.
  let settle = null;
  function busy() {
    conversation.setAttribute("aria-busy", "true");
    clearTimeout(settle);
    settle = setTimeout(() => conversation.setAttribute("aria-busy", "false"), 400);
  }

  function apply(event) {
    busy();
    const p = event.payload ?? {};
    const runId = event.run_id ?? p.run_id;
    switch (event.kind) {
      case "run.created": {
        latestRunId = runId;
        const run = runOf(runId);
        run.status = "queued";
        run.createdAt = event.created_at;
        drawRunHead(runId);
        if (p.origin === "continuation") notice(runId, "A continuation turn: background work reports back.");
        // A steer sent while the run ended became this run: its waiting item goes.
        pendingSteers.get(p.message_id)?.remove();
        pendingSteers.delete(p.message_id);
        if (p.content !== undefined) {
          append(h("li", { class: "item item-user", "data-message": p.message_id }, h("div", { class: "who" }, "You", stamp(event.created_at)), h("div", { class: "text", text: p.content })), runId);
        }
        break;
      }
      case "message.steered": {
        const waiting = pendingSteers.get(p.message_id);
        pendingSteers.delete(p.message_id);
        if (waiting) {
          waiting.dataset.pending = "false";
          waiting.querySelector(".who").replaceChildren("You (steering)", stamp(event.created_at));
          groupOf(runId).items.append(waiting);
        } else {
          append(h("li", { class: "item item-user", "data-message": p.message_id }, h("div", { class: "who" }, "You (steering)", stamp(event.created_at)), h("div", { class: "text", text: p.content })), runId);
        }
        break;
      }
      case "run.status": {
        const run = runOf(runId);
        if (p.status === "paused") notice(runId, "Run paused: it goes on when resumed.");
        else if (run.status === "paused" && p.status === "running") notice(runId, "Run resumed.");
        run.status = p.status;
        drawRunHead(runId);
        break;
      }
      case "run.resumed":
        runOf(runId).banner?.remove();
        // `how` is `retry`, or `{"continue": {extension}}`.
        notice(runId, `Run resumed (${typeof p.how === "string" ? p.how : Object.keys(p.how ?? { continue: 0 })[0]}).`);
        break;
      case "assistant.delta": {
        const item = assistantItem(runId, event.created_at);
        item.querySelector(".text").append(p.text);
        break;
      }
      case "assistant.message": {
        const run = runOf(runId);
        const content = p.content ?? "";
        if (content || run.assistant) {
          const item = assistantItem(runId, event.created_at);
          item.querySelector(".text").textContent = content;
          item.dataset.streaming = "false";
          if (!content) item.remove();
        }
        run.assistant = null;
        for (const call of p.tool_calls ?? []) toolItem(runId, call.id, call.name, call.arguments);
        break;
      }
      case "assistant.reasoning": {
        // What the model thought on its way to its answer: there when wanted, folded away
        // so the conversation reads as what was said. It comes with the step's commit, so
        // it goes above the answer already streaming.
        const item = h("li", { class: "item item-reasoning", "data-run": runId }, h("details", {}, h("summary", { text: "Reasoning" }), h("div", { class: "text", text: p.text ?? "" })));
        const streaming = runOf(runId).assistant;
        if (streaming) streaming.before(item);
        else append(item, runId);
        break;
      }
      case "model.error": {
        const run = runOf(runId);
        run.assistant?.remove();
        run.assistant = null;
        run.lastError = p.message ?? p.error ?? "unknown error";
        notice(runId, `The model call failed (attempt ${p.attempt ?? "?"}): ${run.lastError}`);
        break;
      }
      case "tool.call": {
        const item = toolItem(runId, p.call_id, p.tool, p.arguments);
        const result = item.querySelector(".result");
        result.textContent = "Running…";
        // How long it has run, counted on the page from when its attempt started.
        if (p.started_at) result.dataset.since = String(p.started_at);
        item.dataset.state = "running";
        break;
      }
      case "tool.result": {
        const item = toolItem(runId, p.call_id, p.tool, {});
        const result = item.querySelector(".result");
        result.className = "result";
        result.replaceChildren(h("span", { class: "muted", text: p.is_error ? "Error: " : "Result: " }), resultView(p.content));
        item.dataset.error = String(Boolean(p.is_error));
        item.dataset.state = "done";
        break;
      }
      case "approval.required": {
        for (const call of p.calls ?? []) {
          const result = toolItem(runId, call.call_id, call.tool, call.arguments).querySelector(".result");
          result.textContent = call.needs_approval ? "Waiting for approval…" : "Held with its batch…";
        }
        const card = approvalCard(event);
        approvals.set(p.approval_id, card);
        runOf(runId).cards.push(card);
        append(card, runId);
        break;
      }
      case "approval.decided":
        approvals.get(p.approval_id)?.decided(p.answer, p.by, event.created_at);
        break;
      case "tool.outcome_unknown": {
        const result = toolItem(runId, p.call_id, p.tool, undefined).querySelector(".result");
        result.textContent = `Outcome unknown (attempt ${p.attempt}): ${p.reason}`;
        break;
      }
      case "reconciliation.required": {
        for (const call of p.request?.calls ?? []) {
          const result = toolItem(runId, call.call_id, call.tool, call.arguments).querySelector(".result");
          result.textContent = call.drift ? `Not run: ${call.drift}.` : "Outcome unknown: nobody knows whether this call took effect.";
        }
        const card = reconciliationCard(runId, p.request?.calls ?? []);
        reconciliations.set(runId, card);
        runOf(runId).cards.push(card);
        append(card, runId);
        break;
      }
      case "reconciliation.decided":
        reconciliations.get(runId)?.decided(p.call_id, p.answer);
        break;
      case "subagent.started":
        childNotice(p, childrenOf(runId, p.call_id));
        followTree(runId);
        break;
      case "subagent.finished":
        childEnded(p.child_run_id);
        break;
      case "context.compacted":
        notice(runId, "Older turns were summarised to fit the model's context.");
        break;
      case "inbox.dead_lettered":
        notice(null, "A background report went to the dead letter: ", h("a", { href: `#/sessions/${sessionId}/inbox`, text: "see the inbox" }), ".");
        break;
      case "session.closed":
        notice(null, `This session was ${p.how}.`);
        break;
      case "run.finished": {
        const run = runOf(runId);
        run.status = p.status;
        run.stopReason = p.stop_reason;
        if (run.assistant) run.assistant.dataset.streaming = "false";
        run.assistant = null;
        for (const card of run.cards) card.closed();
        // A tool still waiting or running when its run ended never will.
        for (const item of run.tools.values()) {
          if (item.dataset.state === "done") continue;
          item.dataset.state = "ended";
          item.querySelector(".result").textContent = `Not finished: the run ended ${p.status}.`;
        }
        drawRunHead(runId, event);
        if (p.in_doubt?.length) {
          const card = reconciliationCard(runId, p.in_doubt, true);
          reconciliations.set(runId, card);
          append(card, runId);
        }
        if (p.status !== "completed") {
          notice(runId, `Run ended: ${p.status}${p.stop_reason && p.stop_reason !== p.status ? ` (${p.stop_reason.replaceAll("_", " ")})` : ""}.`);
          if (p.status === "failed") explainStop(runId);
        }
        break;
      }
      default:
        break;
    }
    if (["run.created", "run.status", "run.finished", "run.resumed", "session.closed"].includes(event.kind)) scheduleRefresh();
  }

  // A failed run says why under its group, read once from the API (its budgets).
  async function explainStop(runId) {
    const run = runOf(runId);
    try {
      const view = await api(`/v1/runs/${runId}`);
      if (view.status !== "failed") return;
      run.banner?.remove();
      run.banner = h("li", { class: "item" }, stopBanner(view, run.lastError, () => refreshSide()));
      append(run.banner, runId);
    } catch (error) {
      showError(region, error);
    }
  }

  // The side panel re-reads runs from the API when the events say they moved; bursts of
  // events cause one read.
  let refreshTimer = null;
  function scheduleRefresh() {
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(refreshSide, 150);
  }

  async function refreshRun(runId) {
    if (runId) latestRunId = runId;
    await refreshSide();
  }

  let sideReads = 0;
  async function refreshSide() {
    // Reads can overlap; only the latest one may draw, so an older status never wins.
    const read = ++sideReads;
    try {
      const [session, runPage] = await Promise.all([
        api(`/v1/sessions/${sessionId}`),
        api(`/v1/sessions/${sessionId}/runs?limit=200`),
      ]);
      // The controls act on the run that holds the session — not on one queued behind it;
      // only when none does, on the newest.
      const active = session.active_run_id;
      const target = active ?? latestRunId ?? runPage.items.at(-1)?.id;
      const run = target ? await api(`/v1/runs/${target}`) : null;
      const spent = await sessionSpend(runPage.items.map((r) => r.id));
      if (read !== sideReads) return;
      panelTitle.textContent = active ? "Active run" : "Latest run";
      clearError(region);
      if (renameForm.hidden) titleText.textContent = session.title || "Untitled session";
      facts.replaceChildren(
        `Agent ${session.agent ?? "default"} · `,
        chip(session.status),
        ` · created ${when(session.created_at)}`,
        h("span", { class: "session-spend", text: runPage.items.length ? ` · spent ${tokensAndCost(spent.total)}${spent.delegated ? ", delegated runs included" : ""}` : "" }),
      );
      archived = Boolean(session.archived_at);
      delegated = Boolean(session.parent_session_id);
      if (delegated) {
        const parentRun = run?.parent_run_id;
        taskOf.replaceChildren(
          h("strong", { text: "A task from its parent. " }),
          "This session holds a run delegated by ",
          parentRun ? runLink(parentRun) : "another run",
          " of ",
          h("a", { href: `#/sessions/${session.parent_session_id}`, text: "the parent's session" }),
          ". It is read-only: the parent's conversation is where it is talked to.",
        );
      }
      taskOf.hidden = !delegated;
      closeIfArchived();
      replaceKeepingFocus(
        runsList,
        runPage.items
          .slice()
          .reverse()
          .map((listed) => h("li", { "data-key": listed.id }, runLink(listed.id), " ", chip(listed.status))),
      );
      // The events saw every run of the session; the list is its first 200.
      controls.update(run);
    } catch (error) {
      if (error.status === 404) return showGone(view, error, leave);
      showError(region, error);
    }
  }

  composer.addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    const text = content.value;
    if (send.disabled || !text.trim()) return;
    act(send, region, async () => {
      const accepted = await api(`/v1/sessions/${sessionId}/messages`, { method: "POST", body: { content: text, multitask: multitask.value } });
      content.value = "";
      content.focus();
      // A steering message is an event only once the run takes it: until then it is shown
      // as waiting, under the run it will join.
      if (accepted.steered && !document.querySelector(`[data-message="${accepted.message_id}"]`)) {
        const item = h(
          "li",
          { class: "item item-user", "data-message": accepted.message_id, "data-pending": "true" },
          h("div", { class: "who", text: "You (steering: waits for the run's next model call)" }),
          h("div", { class: "text", text }),
        );
        pendingSteers.set(accepted.message_id, item);
        append(item, accepted.run_id);
      }
    }).then(closeIfArchived);
  });
  content.addEventListener("keydown", (key) => {
    if (key.key === "Enter" && (key.ctrlKey || key.metaKey)) composer.requestSubmit();
  });
  archive.addEventListener("click", () => {
    if (!confirm("Archive this session? Its unfinished runs are cancelled and it takes no more messages.")) return;
    act(archive, region, async () => {
      await api(`/v1/sessions/${sessionId}/archive`, { method: "POST" });
      await refreshSide();
    }).then(closeIfArchived);
  });

  const stream = new EventStream(
    `/v1/sessions/${sessionId}/events`,
    (event) => {
      activity.stored(event);
      apply(event);
    },
    activity.live,
  ).start();
  refreshSide();
  function leave() {
    clearInterval(ticking);
    phone.removeEventListener("change", placeControls);
    stream.stop();
    for (const tree of trees.values()) tree.stop();
    clearTimeout(refreshTimer);
    clearTimeout(settle);
  }
  return leave;
}

// ---------------------------------------------------------------------------------------------
// A session's inbox, dead letters included.

function showInbox(view, sessionId) {
  const region = errorRegion();
  // What a requeue or discard was refused for: a later read of the list does not clear it.
  const actionRegion = errorRegion();
  const filter = h(
    "select",
    { id: "inbox-status" },
    ...["all", "reserved", "pending", "leased", "consumed", "dead_letter", "superseded", "discarded"].map((s) =>
      h("option", { value: s, text: s.replaceAll("_", " ") }),
    ),
  );
  const body = h("tbody");
  view.append(
    h("h1", {}, "Inbox of ", h("a", { href: `#/sessions/${sessionId}`, class: "mono", text: sessionId })),
    h("p", {
      class: "muted",
      text: "Reports from background work, in order. Dead letters are reports no continuation could deliver: requeue one to have it told again, or discard it.",
    }),
    h("div", { class: "inline" }, h("div", { class: "field" }, h("label", { for: "inbox-status", text: "Status" }), filter)),
    region,
    actionRegion,
    h(
      "div",
      { class: "scroll" },
      h(
        "table",
        {},
        h("caption", { text: "Inbox events" }),
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            ...["#", "Kind", "Status", "Attempts", "From", "Told by", "When", "Report", "Actions"].map((t) => h("th", { scope: "col", text: t })),
          ),
        ),
        body,
      ),
    ),
  );

  let reads = 0;
  async function refresh() {
    const read = ++reads;
    try {
      const query = filter.value === "all" ? "" : `?status=${filter.value}`;
      const items = await allPages(`/v1/sessions/${sessionId}/inbox${query}`);
      // A read overtaken by a later one (another filter, newer events) draws nothing.
      if (read !== reads) return;
      body.replaceChildren(
        ...items.map((item) =>
          h(
            "tr",
            { "data-inbox": item.id },
            // Its place in this session's inbox; the event's own id (which the API takes) beside.
            h("td", {}, String(items.indexOf(item) + 1), h("div", { class: "muted mono small", text: `id ${item.id}` })),
            h("td", { text: item.kind.replaceAll("_", " ") }),
            h("td", {}, chip(item.status), item.reason ? h("div", { class: "muted", text: item.reason }) : null),
            h("td", { text: `${item.attempts} of ${item.max_attempts}` }),
            // The run that reported (a group's report has none of its own), then the one that
            // delegated the work.
            h(
              "td",
              {},
              item.source_run_id ? runLink(item.source_run_id) : h("span", { class: "muted", text: item.group ? "its group" : "—" }),
              h("div", { class: "muted small" }, "delegated by ", runLink(item.parent_run_id)),
            ),
            h("td", {}, item.lease_run_id ? runLink(item.lease_run_id) : h("span", { class: "muted", text: "—" })),
            h(
              "td",
              { class: "small" },
              h("div", {}, "written ", timeAgo(item.created_at)),
              h("div", {}, "changed ", timeAgo(item.updated_at)),
              item.expires_at && item.status === "pending" ? h("div", {}, "expires ", when(item.expires_at)) : null,
            ),
            h(
              "td",
              {},
              item.payload === null
                ? h("span", { class: "muted", text: "No report: the work never reported." })
                : h("details", {}, h("summary", { text: "Report" }), jsonView(item.payload)),
            ),
            h("td", {}, item.status === "dead_letter" ? deadLetterActions(item) : null),
          ),
        ),
      );
      if (items.length === 0) body.append(h("tr", {}, h("td", { colspan: "9", class: "muted", text: "Nothing here." })));
      clearError(region);
      connection.set("live", "Live");
    } catch (error) {
      showError(region, error);
    }
  }
  // A dead letter's buttons: requeue (told again by a continuation turn) or discard for good.
  function deadLetterActions(item) {
    const requeue = h("button", { type: "button", text: "Requeue", "aria-label": `Requeue event ${item.id}` });
    const discard = h("button", { type: "button", class: "danger", text: "Discard", "aria-label": `Discard event ${item.id}` });
    const path = (action) => `/v1/sessions/${sessionId}/inbox/${item.id}/${action}`;
    // The list is read again only after a success: a refusal stays on screen.
    const operate = (button, action) =>
      act(button, actionRegion, async () => {
        await api(path(action), { method: "POST", body: { by: "the console" } });
        await refresh();
      });
    requeue.addEventListener("click", () => operate(requeue, "requeue"));
    discard.addEventListener("click", () => {
      if (!confirm(`Discard event ${item.id}? Its report is dropped for good.`)) return;
      operate(discard, "discard");
    });
    return h("div", { class: "actions" }, requeue, discard);
  }
  filter.addEventListener("change", refresh);
  let later = null;
  const stream = new EventStream(`/v1/sessions/${sessionId}/events`, (event) => {
    if (!event.kind.startsWith("inbox.")) return;
    clearTimeout(later);
    later = setTimeout(refresh, 150);
  }).start();
  refresh();
  return () => {
    stream.stop();
    clearTimeout(later);
  };
}

// ---------------------------------------------------------------------------------------------
// A run: its facts, usage, steps, tree and raw events, live.

function showRun(view, runId) {
  const region = errorRegion();
  const facts = h("dl", { class: "facts" });
  const usage = h("tbody");
  const usageHead = h("tr", {}, h("td", {}), h("th", { scope: "col", text: "This run" }));
  const waterfall = h("ol", { class: "waterfall", "aria-label": "Waterfall" });
  const axis = h("div", { class: "wf-axis", "aria-hidden": "true" });
  const inspector = h("section", { class: "panel inspector", "aria-labelledby": "inspect-title", hidden: true });
  const tree = h("ul", { class: "tree", "aria-label": "Run tree" });
  const events = h("tbody");
  const controls = runControls(() => refresh(), { own: true });
  const activity = activityLine();
  const panel = (title, ...content) => {
    const id = `panel-${title.toLowerCase().replaceAll(" ", "-")}`;
    return h("section", { class: "panel", "aria-labelledby": id }, h("h2", { id, text: title }), ...content);
  };
  const why = h("div", {});
  let lastError = null;
  // What the events table shows: every kind but the streamed fragments by default, or one
  // kind; and the events as received, to download.
  const received = [];
  const kinds = h("select", { id: "event-kind" }, h("option", { value: "", text: "Every kind" }));
  const deltas = h("input", { type: "checkbox", id: "show-deltas" });
  const showDeltas = h("label", { class: "check" }, deltas, " Show assistant.delta fragments");
  const download = h("button", { type: "button", text: "Download events (JSON)" });
  function filterEvents() {
    for (const row of events.querySelectorAll("tr[data-kind]")) {
      const kind = row.dataset.kind;
      row.hidden = (kinds.value && kind !== kinds.value) || (kind === "assistant.delta" && !deltas.checked && kinds.value !== kind);
    }
  }
  kinds.addEventListener("change", filterEvents);
  deltas.addEventListener("change", filterEvents);
  download.addEventListener("click", () => {
    const file = new Blob([JSON.stringify(received, null, 2)], { type: "application/json" });
    const link = h("a", { href: URL.createObjectURL(file), download: `${runId}-events.json` });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 1000);
  });
  view.append(
    h("h1", {}, "Run ", h("span", { class: "mono", text: runId }), " ", copyButton(runId, "the run id")),
    activity.el,
    region,
    why,
    panel(
      "Waterfall",
      h("p", { class: "muted small", text: "Every run of the tree on one time axis: each step a solid bar, each wait before it hatched and named. Open a step to see what it sent to the model." }),
      h("div", { class: "wf" }, axis, waterfall),
    ),
    inspector,
    h(
      "div",
      { class: "run-grid" },
      h(
        "div",
        {},
        panel("Summary", facts),
        panel("Usage and cost", h("table", {}, h("caption", { text: "What this run spent, and with the runs below it" }), h("thead", {}, usageHead), usage)),
        panel("Control", controls.el),
      ),
      h("div", {}, panel("Run tree", tree)),
    ),
    h("h2", { text: "Events" }),
    h("div", { class: "inline" }, h("div", { class: "field" }, h("label", { for: "event-kind", text: "Kinds" }), kinds), showDeltas, download),
    h(
      "div",
      { class: "scroll" },
      h(
        "table",
        { class: "events" },
        h("caption", { text: "Every event of this run, as stored: # counts this run's events, seq the session's" }),
        h("thead", {}, h("tr", {}, ...["#", "seq", "Kind", "Time", "Payload"].map((t) => h("th", { scope: "col", text: t })))),
        events,
      ),
    ),
  );

  function fact(term, ...value) {
    return [h("dt", { text: term }), h("dd", {}, ...value)];
  }

  let reads = 0;
  let drawn = null;
  // While any run of the tree has not ended, its waits grow: the waterfall is drawn again
  // every two seconds.
  let shownTree = null;
  const growing = setInterval(() => {
    if (shownTree && shownTree[0].some((n) => !TERMINAL.has(n.status))) drawWaterfall(...shownTree);
  }, 2000);
  async function refresh() {
    const read = ++reads;
    try {
      const [run, treeView] = await Promise.all([api(`/v1/runs/${runId}`), api(`/v1/runs/${runId}/tree`)]);
      const steps = await stepsOfTree(treeView.nodes);
      // Only the latest read draws, and only what changed: focus stays where it was.
      const data = JSON.stringify([run, [...steps], treeView, lastError]);
      if (read !== reads || data === drawn) return;
      drawn = data;
      why.replaceChildren(...(run.status === "failed" ? [stopBanner(run, lastError, () => refresh())] : []));
      facts.replaceChildren(
        ...fact("Status", chip(run.status), run.stop_reason ? ` stop reason: ${run.stop_reason.replaceAll("_", " ")}` : ""),
        ...fact("Session", h("a", { href: `#/sessions/${run.session_id}`, class: "mono", text: run.session_id })),
        ...fact("Agent", run.agent ? `${run.agent.id} (${run.agent.hash.slice(0, 12)})` : "default"),
        ...(run.parent_run_id ? fact("Parent", runLink(run.parent_run_id)) : []),
        ...(run.forked_from ? fact("Forked from", runLink(run.forked_from.run_id), ` at step ${run.forked_from.step}`) : []),
        ...fact("Created", when(run.created_at)),
        ...(run.finished_at ? fact("Finished", `${when(run.finished_at)} (${finishedIn(run, steps.get(runId) ?? [])})`) : []),
        ...(run.pending_human ? fact("Waiting for", run.pending_human.kind, " — answer it in the ", h("a", { href: `#/sessions/${run.session_id}`, text: "conversation" })) : []),
        ...(run.final_answer ? fact("Answer", h("div", { class: "text", text: run.final_answer })) : []),
      );
      controls.update(run);
      // This run's own usage, and the whole tree's beside it when it has runs below it.
      const below = treeView.nodes.filter((n) => n.run_id !== runId);
      // The tree read from a run holds it and the runs below it, nothing above.
      const whole = treeUsage(treeView.nodes);
      const columns = below.length ? [run.usage, whole] : [run.usage];
      usageHead.replaceChildren(h("td", {}), h("th", { scope: "col", text: "This run" }), ...(below.length ? [h("th", { scope: "col", text: "With the runs below it" })] : []));
      const cost = (u) => (u.cost_usd === null || u.cost_usd === undefined ? "no prices configured" : `$${u.cost_usd.toFixed(6)}`);
      usage.replaceChildren(
        ...[
          ["Model calls", (u) => u.model_calls],
          ["Tool calls", (u) => u.tool_calls],
          ["Input tokens", (u) => u.input_tokens],
          ["Output tokens", (u) => u.output_tokens],
          ["Reasoning tokens", (u) => u.reasoning_tokens],
          ["Cost", cost],
        ].map(([k, read]) => h("tr", {}, h("th", { scope: "row", text: k }), ...columns.map((u, i) => h("td", { text: String(read(u, i)) })))),
      );
      drawTree(treeView.nodes);
      shownTree = [treeView.nodes, steps];
      drawWaterfall(...shownTree);
      clearError(region);
    } catch (error) {
      if (error.status === 404) return showGone(view, error, leave);
      showError(region, error);
    }
  }

  // How long a run took: from its first step, and how long it queued before that.
  function finishedIn(run, steps) {
    const first = steps[0]?.started_at;
    if (!first) return `${seconds(run.finished_at - run.created_at)} after it was created`;
    const queued = first - run.created_at;
    return `ran ${seconds(run.finished_at - first)}${queued >= 100 ? `, after ${seconds(queued)} in the queue` : ""}`;
  }

  // What a step did, from its instruction and summary: the tools of a batch, the children it
  // started, the wait it began, why a finish ended the run.
  function stepLabel(step) {
    const s = step.summary ?? {};
    const name = step.instruction.replaceAll("_", " ");
    if (s.children?.length) return `${name}: started ${s.children.length} child run${s.children.length === 1 ? "" : "s"}, then waited for them`;
    if (s.reconciliation) return `${name}: waited for a person to reconcile`;
    if (step.instruction === "finish" && s.stop_reason) return `finish: ${String(s.stop_reason).replaceAll("_", " ")}`;
    if (s.calls?.length) return `${name}: ${s.calls.join(", ")}`;
    if (s.tool_calls) return `${name}, asking for ${s.tool_calls} tool call${s.tool_calls === 1 ? "" : "s"}`;
    return name;
  }

  // The steps of each run of the tree. A run that has ended changes no more: its steps are
  // read once. Trees past 50 runs show their first 50.
  const endedSteps = new Map();
  async function stepsOfTree(nodes) {
    const shown = nodes.slice(0, 50);
    const read = await Promise.all(
      shown.map(async (node) => {
        if (endedSteps.has(node.run_id)) return endedSteps.get(node.run_id);
        const steps = await allPages(`/v1/runs/${node.run_id}/steps`);
        if (TERMINAL.has(node.status)) endedSteps.set(node.run_id, steps);
        return steps;
      }),
    );
    return new Map(shown.map((node, i) => [node.run_id, read[i]]));
  }

  // What a run waited for before `step`, from the step before it.
  function waitBefore(previous) {
    if (!previous) return ["queue", "in the queue"];
    const s = previous.summary ?? {};
    if (s.children?.length) return ["children", "waiting for its children"];
    if (s.wait) return ["timer", "waiting on a timer"];
    if (s.asked_approval) return ["person", "waiting for a person's approval"];
    if (s.reconciliation) return ["person", "waiting for a person to reconcile"];
    return ["other", "waiting (a retry's backoff, a pause or a free worker)"];
  }
  const WAITING_NOW = {
    queued: ["queue", "in the queue"],
    waiting_human: ["person", "waiting for a person"],
    waiting_children: ["children", "waiting for its children"],
    waiting_timer: ["timer", "waiting on a timer"],
    paused: ["other", "paused"],
    running: ["other", "a step in flight"],
    cancelling: ["other", "winding down"],
  };

  // One time axis for the whole tree, from its first run's creation to its last end (now,
  // while any runs). Bars are placed through the CSSOM: the page's policy forbids style
  // attributes.
  function drawWaterfall(nodes, stepsByRun) {
    const now = Date.now();
    const shown = nodes.filter((n) => stepsByRun.has(n.run_id));
    const start = Math.min(...shown.map((n) => n.created_at));
    const end = Math.max(start + 1, ...shown.map((n) => n.finished_at ?? now), ...[...stepsByRun.values()].flat().map((s) => s.finished_at));
    const span = end - start;
    const place = (el, from, to) => {
      el.style.left = `${(100 * (from - start)) / span}%`;
      el.style.width = `${Math.max(0.4, (100 * (to - from)) / span)}%`;
      return el;
    };
    axis.replaceChildren(
      ...[0, 0.25, 0.5, 0.75, 1].map((f) => {
        const tick = h("span", { text: span < 2000 ? `${Math.round(f * span)} ms` : seconds(f * span) });
        tick.style.left = `${f * 100}%`;
        return tick;
      }),
    );
    const children = new Map();
    for (const node of shown) {
      const key = node.parent_run_id ?? "";
      if (!children.has(key)) children.set(key, []);
      children.get(key).push(node);
    }
    const rows = [];
    const visit = (node) => {
      const steps = stepsByRun.get(node.run_id) ?? [];
      const track = h("div", { class: "wf-track" }, place(h("div", { class: "wf-span" }), node.created_at, node.finished_at ?? now));
      const last = steps.at(-1);
      const waiting = !TERMINAL.has(node.status) && WAITING_NOW[node.status];
      let now_ = "";
      if (waiting) {
        const since = last?.finished_at ?? node.created_at;
        track.append(place(h("div", { class: "wf-wait", "data-kind": waiting[0] }), since, now));
        now_ = ` · now ${waiting[1]} for ${seconds(now - since)}`;
      }
      const took = node.finished_at ? ` · ${seconds(node.finished_at - node.created_at)}` : "";
      rows.push(
        h(
          "li",
          { class: "wf-row wf-run", "data-run": node.run_id, "data-depth": node.depth },
          h(
            "div",
            { class: "wf-label" },
            node.run_id === runId ? h("strong", { text: node.agent ?? "default" }) : h("a", { href: `#/runs/${node.run_id}`, text: node.agent ?? "default" }),
            " ",
            chip(node.status),
            h("span", { class: "muted small", text: `${took} · ${tokensAndCost(node.usage)}${now_}` }),
          ),
          track,
        ),
      );
      steps.forEach((step, i) => {
        const previous = steps[i - 1];
        const from = previous?.finished_at ?? node.created_at;
        const [kind, words] = waitBefore(previous);
        const waited = step.started_at - from;
        const s = step.summary ?? {};
        const tokens = s.input_tokens !== undefined ? ` · ${s.input_tokens} in, ${s.output_tokens} out` : "";
        const open = h("button", { type: "button", class: "linkish", text: `#${step.index} ${stepLabel(step)}` });
        open.addEventListener("click", () => inspect(node.run_id, step.index, node.agent));
        // A fork of the run at this step: a new session with its history as the step left it,
        // and a run that continues from there, which the page then shows.
        const fork = h("button", { type: "button", class: "quiet small", "data-fork": step.index, text: "Fork from here" });
        fork.addEventListener("click", () =>
          act(fork, region, async () => {
            const forked = await api(`/v1/runs/${node.run_id}/fork`, { method: "POST", body: { at_step: step.index } });
            location.hash = `#/runs/${forked.run_id}`;
          }),
        );
        const stepTrack = h("div", { class: "wf-track" });
        if (waited > 0) stepTrack.append(place(h("div", { class: "wf-wait", "data-kind": kind }), from, step.started_at));
        stepTrack.append(place(h("div", { class: "wf-bar", "data-instruction": step.instruction }), step.started_at, step.finished_at));
        rows.push(
          h(
            "li",
            { class: "wf-row wf-step", "data-run": node.run_id, "data-step": step.index, "data-depth": node.depth },
            h("div", { class: "wf-label" }, open, h("span", { class: "muted small", text: ` ${step.duration_ms} ms${tokens}${waited >= 50 ? ` · after ${seconds(waited)} ${words}` : ""}` }), " ", fork),
            stepTrack,
          ),
        );
      });
      for (const child of children.get(node.run_id) ?? []) visit(child);
    };
    const ids = new Set(shown.map((n) => n.run_id));
    for (const root of shown.filter((n) => !n.parent_run_id || !ids.has(n.parent_run_id))) visit(root);
    for (const row of rows) row.querySelector(".wf-label").style.paddingLeft = `${Number(row.dataset.depth) * 1.25}rem`;
    replaceKeepingFocus(waterfall, rows.map((row) => {
      row.dataset.key = `${row.dataset.run}/${row.dataset.step ?? ""}`;
      return row;
    }));
  }

  // A step opened up: what its model call was sent (system prompt, tools offered, messages)
  // and what came back, and what the step wrote.
  async function inspect(stepRunId, index, agent) {
    try {
      const step = await api(`/v1/runs/${stepRunId}/steps/${index}`);
      const heading = h("h2", { id: "inspect-title", tabindex: "-1", text: `Step ${index} of ${agent ?? "default"} ${stepRunId}: ${step.instruction.replaceAll("_", " ")}` });
      const close = h("button", { type: "button", class: "quiet", text: "Close the step" });
      close.addEventListener("click", () => {
        inspector.hidden = true;
        waterfall.querySelector(`li[data-run="${stepRunId}"][data-step="${index}"] button`)?.focus();
      });
      const parts = [
        h("div", { class: "inline" }, heading, close),
        h("p", { class: "muted" }, `Started ${when(step.started_at)}, took ${step.duration_ms} ms.`),
        h("details", {}, h("summary", { text: "Summary" }), jsonView(step.summary)),
      ];
      const call = step.model_call;
      if (call) {
        parts.push(
          h("h3", { text: "Sent to the model" }),
          h("p", {}, "Model ", h("code", { text: call.model })),
          h("details", { class: "system-prompt" }, h("summary", { text: "System prompt" }), call.system_prompt ? h("pre", { text: call.system_prompt }) : h("p", { class: "muted", text: "None." })),
          h(
            "details",
            { class: "offered" },
            h("summary", { text: `Tools offered (${call.tools.length})` }),
            call.tools.length
              ? h("ul", {}, ...call.tools.map((tool) => h("li", { "data-tool": tool.name }, h("code", { text: tool.name }), ` — ${tool.description}`, h("details", {}, h("summary", { text: "Parameters" }), jsonView(tool.parameters)))))
              : h("p", { class: "muted", text: "None: the step asked for a final answer." }),
          ),
          h("h4", { text: `Messages, as sent (${call.messages.length})` }),
          h("ol", { class: "log prompt", "aria-label": "Messages sent to the model" }, ...call.messages.map(promptItem)),
          h("h3", { text: "The reply" }),
          call.reply ? h("ol", { class: "log prompt", "aria-label": "The model's reply" }, promptItem(call.reply)) : h("p", { class: "muted", text: "None: the call failed." }),
        );
      }
      // A model call's reply was shown above; what else its commit wrote (reports handed on)
      // is listed here.
      const written = call?.reply ? step.written.filter((m) => !(m.role === "assistant" && m.content === call.reply.content)) : step.written;
      if (!call || written.length) {
        parts.push(
          h("h3", { text: call ? "Also written by this step" : "Written by this step" }),
          written.length ? h("ol", { class: "log prompt", "aria-label": "Written by this step" }, ...written.map(promptItem)) : h("p", { class: "muted", text: "Nothing." }),
        );
      }
      inspector.replaceChildren(...parts);
      inspector.hidden = false;
      heading.focus();
    } catch (error) {
      showError(region, error);
    }
  }

  function promptItem(message) {
    const who = [message.role];
    if (!["user", "agent"].includes(message.origin)) who.push(message.origin);
    if (message.visibility === "hidden") who.push("hidden");
    if (message.is_error) who.push("error");
    return h(
      "li",
      { class: `item item-prompt item-${message.role}`, "data-role": message.role },
      h("div", { class: "who", text: who.join(" · ") }),
      message.tool_call_id ? h("div", { class: "muted small" }, "result of ", h("span", { class: "mono", text: message.tool_call_id })) : null,
      message.role === "tool" ? resultView(message.content) : h("div", { class: "text", text: message.content }),
      message.tool_calls.length ? jsonView(message.tool_calls) : null,
    );
  }

  function drawTree(nodes) {
    const children = new Map();
    for (const node of nodes) {
      const key = node.parent_run_id ?? "";
      if (!children.has(key)) children.set(key, []);
      children.get(key).push(node);
    }
    const ids = new Set(nodes.map((n) => n.run_id));
    const branch = (node) =>
      h(
        "li",
        { "data-run": node.run_id, "data-key": node.run_id },
        node.run_id === runId ? h("strong", { class: "mono", text: node.run_id }) : runLink(node.run_id),
        ` ${node.agent ?? "default"} `,
        chip(node.status),
        node.background ? " background" : "",
        ` · ${node.steps} step${node.steps === 1 ? "" : "s"} · ${tokensAndCost(node.usage)}`,
        (children.get(node.run_id) ?? []).length ? h("ul", {}, ...children.get(node.run_id).map(branch)) : null,
      );
    const roots = nodes.filter((n) => !n.parent_run_id || !ids.has(n.parent_run_id));
    replaceKeepingFocus(tree, roots.map(branch));
  }

  let refreshTimer = null;
  const stream = new EventStream(`/v1/runs/${runId}/events`, (event) => {
    activity.stored(event);
    if (event.kind === "model.error") lastError = event.payload?.message ?? event.payload?.error ?? null;
    received.push(event);
    if (![...kinds.options].some((o) => o.value === event.kind)) kinds.append(h("option", { value: event.kind, text: event.kind }));
    events.append(
      h(
        "tr",
        { "data-seq": event.seq, "data-kind": event.kind, hidden: event.kind === "assistant.delta" && !deltas.checked },
        h("td", { class: "mono", text: received.length }),
        h("td", { class: "mono", text: event.seq }),
        h("td", { class: "mono", text: event.kind }),
        h("td", { class: "time", text: new Date(event.created_at).toLocaleTimeString() }),
        h("td", {}, h("details", {}, h("summary", { text: "Payload" }), copyButton(json(event.payload), `the payload of event ${event.seq}`), jsonView(event.payload))),
      ),
    );
    if (event.kind !== "assistant.delta") {
      clearTimeout(refreshTimer);
      refreshTimer = setTimeout(refresh, 150);
    }
  }, activity.live).start();
  refresh();
  function leave() {
    stream.stop();
    clearTimeout(refreshTimer);
    clearInterval(growing);
  }
  return leave;
}

// ---------------------------------------------------------------------------------------------
// Pending approvals across the tenant's sessions.

// The approvals a person owes, decided right here: each batch's calls with their arguments,
// the agent and the session they come from.
function showApprovals(view) {
  const region = errorRegion();
  const list = h("ol", { class: "log approvals" });
  const empty = h("p", { class: "muted", text: "Nothing waits for a decision.", hidden: true });
  view.append(
    h("h1", { text: "Pending approvals" }),
    h("p", { class: "muted", text: "Batches of tool calls waiting for a person, oldest first: no call of a batch runs until it is decided." }),
    region,
    empty,
    list,
  );
  // approval id -> its card; a card stays (decided) after its decision, until the page is left
  const cards = new Map();
  const sessions = new Map();
  async function sessionOf(id) {
    if (!sessions.has(id)) sessions.set(id, api(`/v1/sessions/${id}`).catch(() => null));
    return sessions.get(id);
  }
  async function refresh() {
    try {
      const items = await allPages("/v1/approvals?status=pending");
      for (const approval of items) {
        if (cards.has(approval.id)) continue;
        const session = await sessionOf(approval.session_id);
        const event = {
          payload: {
            approval_id: approval.id,
            calls: approval.calls.map((c) => ({ call_id: c.call_id, tool: c.name, arguments: c.arguments, needs_approval: c.needs_approval })),
          },
        };
        const card = approvalCard(event);
        card.dataset.key = approval.id;
        card.querySelector(".who").after(
          h(
            "p",
            { class: "muted" },
            `Agent ${session?.agent ?? "default"} · `,
            h("a", { href: `#/sessions/${approval.session_id}`, text: session?.title || approval.session_id }),
            " · run ",
            runLink(approval.run_id),
            " · asked ",
            timeAgo(approval.created_at),
          ),
        );
        cards.set(approval.id, { card, pending: true });
        list.append(card);
      }
      // One decided elsewhere (or whose run ended) shows how it stands now.
      const pending = new Set(items.map((a) => a.id));
      for (const [id, entry] of cards) {
        if (!entry.pending || pending.has(id)) continue;
        entry.pending = false;
        const now = await api(`/v1/approvals/${id}`).catch(() => null);
        if (now?.status === "decided") {
          const decisions = now.calls.filter((c) => c.decision).map((c) => ({ call_id: c.call_id, decision: c.decision, note: c.note ?? undefined }));
          entry.card.decided({ decisions }, null, now.decided_at);
        } else if (now?.status === "aborted") {
          entry.card.decided("abort", null, now.decided_at);
        } else {
          entry.card.closed();
        }
      }
      empty.hidden = cards.size > 0;
      clearError(region);
      connection.set("live", "Live");
    } catch (error) {
      showError(region, error);
    }
  }
  refresh();
  const timer = setInterval(refresh, 3000);
  connection.set("idle", "");
  return () => clearInterval(timer);
}

// How many approvals wait, beside "Approvals" on every page.
const pendingCount = {
  el: null,
  timer: null,
  start() {
    const link = document.querySelector('nav a[href="#/approvals"]');
    if (!link || this.el) return;
    this.el = h("span", { class: "count", hidden: true });
    link.append(" ", this.el);
    const read = async () => {
      try {
        const page = await api("/v1/approvals?status=pending&limit=200");
        const n = page.items.length;
        this.el.hidden = n === 0;
        this.el.textContent = page.next_cursor ? "200+" : String(n);
        this.el.setAttribute("aria-label", `${this.el.textContent} waiting`);
      } catch {
        // The page in view says what is wrong; the count waits for the next read.
      }
    };
    read();
    this.timer = setInterval(read, 5000);
  },
};

// ---------------------------------------------------------------------------------------------
// Webhooks and their delivery logs, dead letters included.

// ---------------------------------------------------------------------------------------------
// The catalog: a graph of who delegates to whom, then each agent's tools, approvals and limits.

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, value);
  el.append(...children);
  return el;
}

// Agents in layers: those nobody delegates to first, then each agent one layer below the
// lowest agent that delegates to it (an agent only reached through a cycle starts a layer 0).
function layers(agents) {
  const byId = new Map(agents.map((a) => [a.id, a]));
  const delegated = new Set(agents.flatMap((a) => a.delegates));
  const level = new Map();
  const queue = agents.filter((a) => !delegated.has(a.id)).map((a) => [a.id, 0]);
  for (const agent of agents) if (queue.length === 0 && !level.has(agent.id)) queue.push([agent.id, 0]);
  while (queue.length) {
    const [id, depth] = queue.shift();
    if (level.has(id) && level.get(id) >= depth) continue;
    if (depth > agents.length) continue;
    level.set(id, depth);
    for (const next of byId.get(id)?.delegates ?? []) if (byId.has(next)) queue.push([next, depth + 1]);
  }
  for (const agent of agents) if (!level.has(agent.id)) level.set(agent.id, 0);
  const rows = [];
  for (const agent of agents) (rows[level.get(agent.id)] ??= []).push(agent);
  return rows.filter(Boolean);
}

function delegationGraph(agents) {
  const rows = layers(agents);
  // Each layer in the order of the agents that delegate to it, so that edges rarely cross.
  const order = new Map(rows[0].map((a, i) => [a.id, i]));
  for (const row of rows.slice(1)) {
    const mean = (agent) => {
      const from = agents.filter((a) => a.delegates.includes(agent.id) && order.has(a.id)).map((a) => order.get(a.id));
      return from.length ? from.reduce((x, y) => x + y, 0) / from.length : Infinity;
    };
    row.sort((a, b) => mean(a) - mean(b));
    row.forEach((agent, i) => order.set(agent.id, i));
  }
  const [boxW, boxH, gapX, gapY] = [170, 48, 30, 56];
  const width = Math.max(...rows.map((r) => r.length)) * (boxW + gapX) + gapX;
  const height = rows.length * (boxH + gapY);
  const at = new Map();
  rows.forEach((row, depth) => {
    const offset = (width - row.length * (boxW + gapX) + gapX) / 2;
    row.forEach((agent, i) => at.set(agent.id, { x: offset + i * (boxW + gapX), y: gapY / 2 + depth * (boxH + gapY) }));
  });
  const edges = agents.flatMap((a) => a.delegates.filter((d) => at.has(d)).map((d) => [a.id, d]));
  const described = edges.length ? edges.map(([from, to]) => `${from} delegates to ${to}`).join("; ") : "no agent delegates";
  const picture = svg(
    "svg",
    { viewBox: `0 0 ${width} ${height}`, class: "graph", role: "img", "aria-label": `Delegation graph: ${described}.` },
    svg("defs", {}, svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "10", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" }, svg("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "arrow" }))),
  );
  for (const [from, to] of edges) {
    const a = at.get(from);
    const b = at.get(to);
    const down = b.y > a.y;
    const [x1, y1] = [a.x + boxW / 2, down ? a.y + boxH : a.y + boxH / 2];
    const [x2, y2] = [b.x + boxW / 2, down ? b.y : b.y + boxH / 2];
    const bend = down ? "" : ` Q ${Math.max(x1, x2) + boxW * 0.75} ${(y1 + y2) / 2}`;
    picture.append(svg("path", { d: `M ${x1} ${y1}${bend} ${x2} ${y2}`, class: "edge", "marker-end": "url(#arrow)", "data-edge": `${from}>${to}` }));
  }
  for (const agent of agents) {
    const { x, y } = at.get(agent.id);
    const gated = agent.approvals.length ? ` · ${agent.approvals.length} gated` : "";
    picture.append(
      svg(
        "g",
        { "data-agent": agent.id },
        svg("rect", { x, y, width: boxW, height: boxH, rx: 8, class: "node" }),
        svg("text", { x: x + boxW / 2, y: y + 20, "text-anchor": "middle", class: "node-name" }, agent.id),
        svg("text", { x: x + boxW / 2, y: y + 38, "text-anchor": "middle", class: "node-facts" }, `${agent.tools.length} tool${agent.tools.length === 1 ? "" : "s"}${gated}`),
      ),
    );
  }
  return picture;
}

function policyText(policy) {
  if (policy === "always") return "always asks a person";
  const rules = Object.entries(policy?.when_arguments ?? {}).map(([argument, glob]) => `${argument} matches ${glob}`);
  return `asks a person when ${rules.join(" or ")}`;
}

function agentCard(agent, delegatedBy) {
  const gated = new Map(agent.approvals.map((a) => [a.tool, a.policy]));
  const limits = Object.entries(agent.limits ?? {}).filter(([, v]) => v !== null && v !== undefined);
  const id = `agent-${agent.id}`;
  return h(
    "section",
    { class: "panel agent", "data-agent": agent.id, "aria-labelledby": id },
    h("h2", { id, class: "mono", text: agent.id }),
    h("p", { text: agent.description }),
    h(
      "dl",
      { class: "facts" },
      h("dt", { text: "Model" }),
      h("dd", {}, h("code", { text: agent.model })),
      h("dt", { text: "Definition" }),
      h("dd", { class: "mono small", text: agent.hash ?? "not from a catalog file" }),
      h("dt", { text: "Delegates to" }),
      h("dd", { text: agent.delegates.join(", ") || "nobody" }),
      h("dt", { text: "Delegated by" }),
      h("dd", { text: delegatedBy.join(", ") || "nobody: a person starts it" }),
      h("dt", { text: "Tools" }),
      h("dd", {}, h("ul", { class: "tools" }, ...agent.tools.map((tool) => h("li", { "data-tool": tool }, h("code", { text: tool }), gated.has(tool) ? h("span", { class: "gated", text: ` — ${policyText(gated.get(tool))}` }) : null)))),
      h("dt", { text: "Limits" }),
      h("dd", { text: limits.map(([k, v]) => `${k.replaceAll("_", " ")} ${Number(v).toLocaleString()}`).join(" · ") }),
    ),
  );
}

function showAgents(view) {
  const region = errorRegion();
  const graph = h("div", { class: "graph-box" });
  const cards = h("div", { class: "agents" });
  view.append(
    h("h1", { text: "Agents" }),
    h("p", { class: "muted", text: "The server's catalog: who delegates to whom, the tools each agent is offered, which calls wait for a person, and the limits its runs are frozen with." }),
    region,
    h("section", { class: "panel", "aria-labelledby": "graph-title" }, h("h2", { id: "graph-title", text: "Delegation" }), graph),
    cards,
  );
  (async () => {
    try {
      const agents = await allPages("/v1/agents");
      if (agents.length === 0) {
        graph.replaceChildren(h("p", { class: "muted", text: "No catalog: every session runs the server's own configuration." }));
        return;
      }
      // The graph holds the agents that delegate or are delegated to; the rest are named below it.
      const linked = new Set(agents.flatMap((a) => (a.delegates.length ? [a.id, ...a.delegates] : [])));
      const alone = agents.filter((a) => !linked.has(a.id)).map((a) => a.id);
      graph.replaceChildren(
        linked.size ? delegationGraph(agents.filter((a) => linked.has(a.id))) : h("p", { class: "muted", text: "No agent delegates to another." }),
        alone.length ? h("p", { class: "muted alone", text: `On their own (they delegate to nobody, and nobody to them): ${alone.join(", ")}.` }) : null,
      );
      cards.replaceChildren(...agents.map((agent) => agentCard(agent, agents.filter((a) => a.delegates.includes(agent.id)).map((a) => a.id))));
    } catch (error) {
      showError(region, error);
    }
  })();
  connection.set("idle", "");
  return null;
}

function showWebhooks(view) {
  const region = errorRegion();
  const list = h("ul", {});
  view.append(
    h("h1", { text: "Webhooks" }),
    h("p", { class: "muted", text: "Where this tenant's events are sent. Open one for its delivery log." }),
    region,
    list,
  );
  (async () => {
    try {
      const { items } = await api("/v1/webhooks");
      list.replaceChildren(
        ...items.map((webhook) =>
          h(
            "li",
            {},
            h("a", { href: `#/webhooks/${webhook.id}`, class: "mono", text: webhook.id }),
            " ",
            h("span", { text: webhook.url }),
            h("div", { class: "muted", text: webhook.events ? `sends ${webhook.events.join(", ")}` : "sends every event" }),
          ),
        ),
      );
      if (items.length === 0) list.append(h("li", { class: "muted", text: "No webhooks." }));
    } catch (error) {
      showError(region, error);
    }
  })();
  connection.set("idle", "");
  return null;
}

function showWebhook(view, webhookId) {
  const region = errorRegion();
  // What a requeue was refused for: a later read of the log does not clear it.
  const actionRegion = errorRegion();
  const filter = h(
    "select",
    { id: "delivery-status" },
    ...["all", "pending", "delivering", "delivered", "dead_letter"].map((s) => h("option", { value: s, text: s.replaceAll("_", " ") })),
  );
  const requeueAll = h("button", { type: "button", text: "Requeue every dead letter" });
  const body = h("tbody");
  view.append(
    h("h1", {}, "Deliveries of ", h("span", { class: "mono", text: webhookId })),
    h("p", { class: "muted", text: "Each event's trip to the receiver, in the order they were queued. Requeue a dead letter to send it again." }),
    h("div", { class: "inline" }, h("div", { class: "field" }, h("label", { for: "delivery-status", text: "Status" }), filter), requeueAll),
    region,
    actionRegion,
    h(
      "div",
      { class: "scroll" },
      h(
        "table",
        {},
        h("caption", { text: "Deliveries" }),
        h(
          "thead",
          {},
          h("tr", {}, ...["#", "Event", "Status", "Attempts", "Last answer", "Actions"].map((t) => h("th", { scope: "col", text: t }))),
        ),
        body,
      ),
    ),
  );
  const operate = (button, path) =>
    act(button, actionRegion, async () => {
      await api(path, { method: "POST" });
      await refresh();
    });
  requeueAll.addEventListener("click", () => operate(requeueAll, `/v1/webhooks/${webhookId}/deliveries/requeue`));

  let reads = 0;
  async function refresh() {
    const read = ++reads;
    try {
      const query = filter.value === "all" ? "" : `?status=${filter.value}`;
      const items = await allPages(`/v1/webhooks/${webhookId}/deliveries${query}`);
      if (read !== reads) return;
      body.replaceChildren(
        ...items.map((delivery) => {
          const requeue = h("button", { type: "button", text: "Requeue", "aria-label": `Requeue delivery ${delivery.id}` });
          requeue.addEventListener("click", () =>
            operate(requeue, `/v1/webhooks/${webhookId}/deliveries/${delivery.id}/requeue`),
          );
          return h(
            "tr",
            { "data-delivery": delivery.id },
            h("td", { text: delivery.id }),
            h("td", {}, h("a", { href: `#/sessions/${delivery.session_id}`, class: "mono", text: `${delivery.session_id} #${delivery.seq}` }), ` ${delivery.event_kind}`),
            h("td", {}, chip(delivery.status)),
            h("td", { text: `${delivery.attempts} of ${delivery.max_attempts}` }),
            h("td", { text: delivery.last_error ?? (delivery.last_status ? `HTTP ${delivery.last_status}` : "") }),
            h("td", {}, delivery.status === "dead_letter" ? requeue : null),
          );
        }),
      );
      if (items.length === 0) body.append(h("tr", {}, h("td", { colspan: "6", class: "muted", text: "Nothing here." })));
      clearError(region);
      connection.set("live", "Live");
    } catch (error) {
      showError(region, error);
    }
  }
  filter.addEventListener("change", refresh);
  refresh();
  const timer = setInterval(refresh, 3000);
  connection.set("idle", "");
  return () => clearInterval(timer);
}

// A schedule's cadence in words: its cron expression (and zone), or its interval.
function cadenceText(schedule) {
  if (schedule.cron) return `cron ${schedule.cron}${schedule.timezone ? ` (${schedule.timezone})` : " (UTC)"}`;
  const ms = schedule.every_ms;
  if (ms % 3_600_000 === 0) return `every ${ms / 3_600_000} h`;
  if (ms % 60_000 === 0) return `every ${ms / 60_000} min`;
  return ms % 1000 === 0 ? `every ${ms / 1000} s` : `every ${ms} ms`;
}

function showSchedules(view) {
  const region = errorRegion();
  // What an action or the form was refused for: a later refresh does not clear it.
  const actionRegion = errorRegion();
  const field = (id, label, control) => h("div", { class: "field" }, h("label", { for: id, text: label }), control);
  const select = (id, values) => h("select", { id }, ...values.map((v) => h("option", { value: v, text: v.replaceAll("_", " ") })));
  const message = h("textarea", { id: "schedule-message", rows: 2, required: true });
  const kind = select("schedule-kind", ["every_ms", "cron"]);
  const cadence = h("input", { id: "schedule-cadence", required: true, value: "60000", autocomplete: "off" });
  const timezone = h("input", { id: "schedule-timezone", placeholder: "UTC", autocomplete: "off" });
  const session = h("input", { id: "schedule-session", value: "new", required: true, autocomplete: "off" });
  const overlap = select("schedule-overlap", ["skip", "enqueue", "cancel_previous"]);
  const catchUp = select("schedule-catch-up", ["one", "skip", "all"]);
  const create = h("button", { type: "submit", text: "Create schedule" });
  const form = h(
    "form",
    { class: "panel", "aria-labelledby": "new-schedule" },
    h("h2", { id: "new-schedule", text: "New schedule" }),
    field("schedule-message", "Message", message),
    h(
      "div",
      { class: "inline" },
      field("schedule-kind", "Cadence", kind),
      field("schedule-cadence", "Interval (ms) or cron expression", cadence),
      field("schedule-timezone", "Time zone (cron)", timezone),
    ),
    h(
      "div",
      { class: "inline" },
      field("schedule-session", "Session (new or ses_…)", session),
      field("schedule-overlap", "Overlap", overlap),
      field("schedule-catch-up", "Catch up", catchUp),
    ),
    create,
  );
  kind.addEventListener("change", () => {
    cadence.value = kind.value === "cron" ? "0 9 * * *" : "60000";
  });
  const body = h("tbody");
  view.append(
    h("h1", { text: "Schedules" }),
    h("p", { class: "muted", text: "Messages sent on a cadence. Each slot fires once, whichever server or worker reaches it; its runs are listed with what each slot became." }),
    region,
    actionRegion,
    h(
      "div",
      { class: "scroll" },
      h(
        "table",
        {},
        h("caption", { text: "Schedules" }),
        h("thead", {}, h("tr", {}, ...["Schedule", "Cadence", "Next fire", "Last runs", "Actions"].map((t) => h("th", { scope: "col", text: t })))),
        body,
      ),
    ),
    form,
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    act(create, actionRegion, async () => {
      const definition = {
        message: message.value,
        session: session.value.trim(),
        overlap: overlap.value,
        catch_up: catchUp.value,
      };
      if (kind.value === "cron") {
        definition.cron = cadence.value;
        if (timezone.value.trim()) definition.timezone = timezone.value.trim();
      } else {
        const ms = Number(cadence.value);
        if (!Number.isInteger(ms)) throw new Error(`The interval must be a whole number of milliseconds; found ${JSON.stringify(cadence.value)}.`);
        definition.every_ms = ms;
      }
      await api("/v1/schedules", { method: "POST", body: definition });
      message.value = "";
      await refresh();
    });
  });
  const operate = (button, action) =>
    act(button, actionRegion, async () => {
      await action();
      await refresh();
    });

  let reads = 0;
  async function refresh() {
    const read = ++reads;
    try {
      const schedules = await allPages("/v1/schedules");
      const recent = await Promise.all(schedules.map((s) => api(`/v1/schedules/${s.id}/runs?limit=3`).then((page) => page.items)));
      if (read !== reads) return;
      replaceKeepingFocus(
        body,
        schedules.map((schedule, i) => {
          const name = schedule.message.length > 60 ? `${schedule.message.slice(0, 60)}…` : schedule.message;
          const toggle = h("button", { type: "button", text: schedule.paused ? "Resume" : "Pause", "aria-label": `${schedule.paused ? "Resume" : "Pause"} ${schedule.id}` });
          toggle.addEventListener("click", () => operate(toggle, () => api(`/v1/schedules/${schedule.id}/${schedule.paused ? "resume" : "pause"}`, { method: "POST" })));
          const trigger = h("button", { type: "button", text: "Trigger", "aria-label": `Trigger ${schedule.id}` });
          trigger.addEventListener("click", () => operate(trigger, () => api(`/v1/schedules/${schedule.id}/trigger`, { method: "POST" })));
          const remove = h("button", { type: "button", class: "danger", text: "Delete", "aria-label": `Delete ${schedule.id}` });
          remove.addEventListener("click", () => {
            if (!confirm(`Delete schedule ${schedule.id}? The runs it fired stay.`)) return;
            operate(remove, () => api(`/v1/schedules/${schedule.id}`, { method: "DELETE" }));
          });
          return h(
            "tr",
            { "data-schedule": schedule.id, "data-key": schedule.id },
            h("td", {}, h("div", { text: name }), h("div", { class: "mono small muted", text: schedule.id })),
            h("td", {}, h("div", { text: cadenceText(schedule) }), h("div", { class: "muted small", text: `session ${schedule.session} · overlap ${schedule.overlap.replaceAll("_", " ")} · catch up ${schedule.catch_up}` })),
            h("td", {}, schedule.paused ? chip("paused") : schedule.next_fire_at ? stamp(schedule.next_fire_at) : h("span", { class: "muted", text: "never" })),
            h(
              "td",
              {},
              recent[i].length === 0
                ? h("span", { class: "muted", text: "none yet" })
                : h(
                    "ul",
                    { class: "slots" },
                    ...recent[i].map((slot) =>
                      h(
                        "li",
                        { "data-outcome": slot.outcome },
                        stamp(slot.slot),
                        slot.manual ? " manual " : " ",
                        slot.run_id ? runLink(slot.run_id) : null,
                        " ",
                        chip(slot.status ?? slot.outcome),
                      ),
                    ),
                  ),
            ),
            h("td", {}, h("div", { class: "actions" }, toggle, trigger, remove)),
          );
        }),
      );
      if (schedules.length === 0) body.append(h("tr", {}, h("td", { colspan: "5", class: "muted", text: "No schedules yet: create one below." })));
      clearError(region);
      connection.set("live", "Live");
    } catch (error) {
      showError(region, error);
    }
  }
  refresh();
  const timer = setInterval(refresh, 3000);
  connection.set("idle", "");
  return () => clearInterval(timer);
}

// ---------------------------------------------------------------------------------------------
// Routing by the URL's fragment, so that every view has an address and the server serves one page.

const ROUTES = [
  [/^#\/?$/, showSessions],
  [/^#\/sessions\/([A-Za-z0-9_-]+)$/, showSession],
  [/^#\/sessions\/([A-Za-z0-9_-]+)\/inbox$/, showInbox],
  [/^#\/runs\/([A-Za-z0-9_-]+)$/, showRun],
  [/^#\/approvals$/, showApprovals],
  [/^#\/agents$/, showAgents],
  [/^#\/webhooks$/, showWebhooks],
  [/^#\/webhooks\/([A-Za-z0-9_-]+)$/, showWebhook],
  [/^#\/schedules$/, showSchedules],
];

let teardown = null;

function route() {
  teardown?.();
  teardown = null;
  const view = document.getElementById("view");
  view.replaceChildren();
  const hash = location.hash || "#/";
  for (const [pattern, show] of ROUTES) {
    const match = hash.match(pattern);
    if (match) {
      teardown = show(view, ...match.slice(1));
      const heading = view.querySelector("h1");
      document.title = heading ? `${heading.textContent} · Ratchet` : "Ratchet console";
      view.focus({ preventScroll: true });
      return;
    }
  }
  view.append(h("h1", { text: "Not found" }), h("p", {}, "Nothing lives at this address. ", h("a", { href: "#/", text: "Go to the sessions." })));
  document.title = "Not found · Ratchet";
  connection.set("idle", "");
  view.focus({ preventScroll: true });
}

// Everything behind the token waits for it: the sign-in dialog stays until a token is given
// (Escape is refused, and a dialog closed anyway opens again).
const tokenDialog = document.getElementById("token-dialog");
tokenDialog.addEventListener("cancel", (event) => event.preventDefault());
tokenDialog.addEventListener("close", () => {
  if (tokenPrompt) tokenDialog.showModal();
});
document.querySelector(".skip").addEventListener("click", (event) => {
  event.preventDefault();
  document.getElementById("view").focus();
});
document.getElementById("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  updateSignOut();
  route();
});
window.addEventListener("hashchange", route);
// "/" finds: it moves to the sessions' search box, unless a field is being typed in.
document.addEventListener("keydown", (key) => {
  const typing = key.target.closest?.("input, textarea, select, [contenteditable]");
  const search = document.getElementById("find-text");
  if (key.key !== "/" || typing || !search || key.ctrlKey || key.metaKey || key.altKey) return;
  key.preventDefault();
  search.focus();
});
updateSignOut();
route();
pendingCount.start();

// The header's settings, kept for this browser: the colour scheme and the time zone.
const theme = document.getElementById("theme");
const zone = document.getElementById("time-zone");
theme.value = settings.theme ?? "";
zone.value = settings.timeZone ?? "";
function applySettings() {
  if (settings.theme) document.documentElement.dataset.theme = settings.theme;
  else delete document.documentElement.dataset.theme;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}
theme.addEventListener("change", () => {
  settings.theme = theme.value || undefined;
  applySettings();
});
zone.addEventListener("change", () => {
  settings.timeZone = zone.value || undefined;
  applySettings();
  route();
});
applySettings();

