/**
 * The client: one method per operation of Ratchet's HTTP API, over `fetch`, so that it runs
 * in Node, Deno and browsers alike. Every refused request throws a `RatchetError` and every
 * request without an answer a `NetworkError`. Only two things are retried: event streams,
 * which resume by themselves (see `events.ts`), and `createSession` and `sendMessage`, which
 * carry an `Idempotency-Key` and are sent again with it when they may or may not have arrived.
 */

import { NetworkError, RatchetError, WaitTimeoutError, errorFromResponse } from "./errors.js";
import { resumingEvents, type EventStreamOptions, type StreamedEvent } from "./events.js";
import { sleep } from "./sleep.js";
import type {
  AgentPage,
  ApprovalAnswer,
  Approval,
  ApprovalPage,
  ApprovalsQuery,
  BudgetExtension,
  Cancelled,
  CreateSession,
  CreateWebhook,
  DeliveriesQuery,
  Delivery,
  DeliveryPage,
  MessageAccepted,
  MessagePage,
  MessagesQuery,
  Multitask,
  Paused,
  Reconcile,
  ReconcileResult,
  Reloaded,
  Requeued,
  Resumed,
  RotatedSecret,
  Run,
  RunPage,
  RunsQuery,
  RunStatus,
  Session,
  SessionPage,
  SessionsQuery,
  Webhook,
  WebhookPage,
} from "./types.js";

export interface ClientOptions {
  /** Where the server answers, for example `http://127.0.0.1:7700`; a path prefix is kept. */
  baseUrl: string;
  /** Sent as `Authorization: Bearer TOKEN` when the server has `[[tokens]]`. */
  token?: string;
  /** The `fetch` to use: the global one by default. */
  fetch?: typeof fetch;
  /** How `createSession` and `sendMessage` are sent again; see `RetryOptions`. */
  retry?: RetryOptions;
}

/**
 * `createSession` and `sendMessage` are sent again, with the same `Idempotency-Key`, when they
 * may or may not have arrived: no answer at all (a `NetworkError`: a refused or broken
 * connection) or `409 request_in_progress` (the first is still being carried out: after its
 * `Retry-After`). Any other answer is final. When the attempts or the time are spent, the last
 * failure is thrown.
 */
export interface RetryOptions {
  /** Sends in all, the first included (default 4); 1 sends once. */
  maxAttempts?: number;
  /** The wait before the second send, doubled before each next (default 250 ms). */
  backoffMs?: number;
  /** No send begins later than this after the first failure, `Retry-After` waits included (default 10 000 ms). */
  maxRetryMs?: number;
}

/** What `createSession` and `sendMessage` send besides their body. */
export interface IdempotentOptions {
  /**
   * Names the request (1 to 255 printable ASCII characters): the same key again gets the first
   * answer back and does nothing again; with another body it is refused (`422`). Without one, a
   * fresh random UUID is sent with each call.
   */
  idempotencyKey?: string;
}

export interface SendMessageOptions extends IdempotentOptions {
  /** What happens when the session already has an active run; `enqueue` by default. */
  multitask?: Multitask;
}

export interface WaitRunOptions {
  /** Give up with a `WaitTimeoutError` after this long (default 300 000 ms). */
  timeoutMs?: number;
  /** Time between two reads of the run (default 250 ms). */
  pollIntervalMs?: number;
  signal?: AbortSignal;
}

/** A run in one of these has ended. */
export const ENDED_STATUSES: readonly RunStatus[] = ["completed", "failed", "cancelled"];
/** A run in one of these goes on only when a person acts: an answer, a reconciliation, `resume`. */
export const WAITING_STATUSES: readonly RunStatus[] = ["waiting_human", "paused"];

type QueryValues = Record<string, string | number | boolean | undefined | null>;

/** What `request` sends besides its method and path. */
export interface RequestOptions {
  query?: object;
  body?: unknown;
  /** More request headers, for example `{"Idempotency-Key": key}` for a `POST` under `/v1`. */
  headers?: Record<string, string>;
  signal?: AbortSignal;
}

/** The default `RetryOptions`. */
export const DEFAULT_RETRY: Readonly<Required<RetryOptions>> = { maxAttempts: 4, backoffMs: 250, maxRetryMs: 10_000 };

export class Client {
  readonly baseUrl: string;
  readonly webhooks: Webhooks;
  private readonly token: string | undefined;
  private readonly fetch: typeof fetch;
  private readonly retryOptions: Required<RetryOptions>;

  constructor(options: ClientOptions) {
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.token = options.token;
    this.fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.retryOptions = { ...DEFAULT_RETRY, ...definedOnly(options.retry ?? {}) };
    this.webhooks = new Webhooks(this);
  }

  /**
   * Creates a session, sent with `options.idempotencyKey` (a fresh UUID without one) and sent
   * again with it when it may not have arrived (see `RetryOptions`).
   */
  createSession(session: CreateSession = {}, options: IdempotentOptions = {}): Promise<Session> {
    return this.idempotent("POST", "/v1/sessions", session, options.idempotencyKey);
  }

  getSession(sessionId: string): Promise<Session> {
    return this.request("GET", `/v1/sessions/${segment(sessionId)}`);
  }

  listSessions(query: SessionsQuery = {}): Promise<SessionPage> {
    return this.request("GET", "/v1/sessions", { query });
  }

  /**
   * Sends a message; the answer names the run it started (or joined, for `steer`). It is sent
   * with `options.idempotencyKey` (a fresh UUID without one) and sent again with it when it may
   * not have arrived (see `RetryOptions`), so a message is taken once.
   */
  sendMessage(sessionId: string, content: string, options: SendMessageOptions = {}): Promise<MessageAccepted> {
    const body = { content, multitask: options.multitask ?? "enqueue" };
    return this.idempotent("POST", `/v1/sessions/${segment(sessionId)}/messages`, body, options.idempotencyKey);
  }

  listMessages(sessionId: string, query: MessagesQuery = {}): Promise<MessagePage> {
    return this.request("GET", `/v1/sessions/${segment(sessionId)}/messages`, { query });
  }

  getRun(runId: string): Promise<Run> {
    return this.request("GET", `/v1/runs/${segment(runId)}`);
  }

  listRuns(sessionId: string, query: RunsQuery = {}): Promise<RunPage> {
    return this.request("GET", `/v1/sessions/${segment(sessionId)}/runs`, { query });
  }

  /**
   * Reads the run until it has ended (`ENDED_STATUSES`) or waits for a person
   * (`WAITING_STATUSES`), and answers it as it then stands. A run waiting for its children,
   * queued or cancelling is still on its way.
   */
  async waitRun(runId: string, options: WaitRunOptions = {}): Promise<Run> {
    const { timeoutMs = 300_000, pollIntervalMs = 250, signal } = options;
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const run = await this.request<Run>("GET", `/v1/runs/${segment(runId)}`, { signal });
      if (ENDED_STATUSES.includes(run.status) || WAITING_STATUSES.includes(run.status)) return run;
      const remaining = deadline - Date.now();
      if (remaining <= 0) throw new WaitTimeoutError(`run ${runId} is still ${run.status} after ${timeoutMs} ms`, run);
      await sleep(Math.min(pollIntervalMs, remaining), signal);
    }
  }

  /** The session's events from the start (or after `after`), following live ones by default. */
  events(sessionId: string, options: EventStreamOptions = {}): AsyncGenerator<StreamedEvent, void, undefined> {
    return resumingEvents(this.connector(`/v1/sessions/${segment(sessionId)}/events`), options);
  }

  /** The run's events alone, each with its session's `seq`. */
  runEvents(runId: string, options: EventStreamOptions = {}): AsyncGenerator<StreamedEvent, void, undefined> {
    return resumingEvents(this.connector(`/v1/runs/${segment(runId)}/events`), options);
  }

  listApprovals(query: ApprovalsQuery = {}): Promise<ApprovalPage> {
    return this.request("GET", "/v1/approvals", { query });
  }

  getApproval(approvalId: string): Promise<Approval> {
    return this.request("GET", `/v1/approvals/${segment(approvalId)}`);
  }

  /** `{decisions: [{call_id, decision: "approve" | "deny", note?}]}`, or `{abort: true}`. */
  decideApproval(approvalId: string, answer: ApprovalAnswer): Promise<Approval> {
    return this.request("POST", `/v1/approvals/${segment(approvalId)}`, { body: answer });
  }

  /** Answers for a call whose outcome is unknown. */
  reconcile(runId: string, answer: Reconcile): Promise<ReconcileResult> {
    return this.request("POST", `/v1/runs/${segment(runId)}/reconcile`, { body: answer });
  }

  cancel(runId: string): Promise<Cancelled> {
    return this.request("POST", `/v1/runs/${segment(runId)}/cancel`);
  }

  pause(runId: string): Promise<Paused> {
    return this.request("POST", `/v1/runs/${segment(runId)}/pause`);
  }

  resume(runId: string): Promise<Resumed> {
    return this.request("POST", `/v1/runs/${segment(runId)}/resume`);
  }

  /** Goes on with a failed run from its last committed step, with `extra` budget. */
  continueRun(runId: string, extra: BudgetExtension = {}): Promise<Resumed> {
    return this.request("POST", `/v1/runs/${segment(runId)}/continue`, { body: extra });
  }

  /** Repeats the model call a run failed on (`llm_error`). */
  retry(runId: string): Promise<Resumed> {
    return this.request("POST", `/v1/runs/${segment(runId)}/retry`);
  }

  /** The server's catalog of agents, in id order, on one page. */
  listAgents(): Promise<AgentPage> {
    return this.request("GET", "/v1/agents");
  }

  /**
   * Makes the server read its configuration and agent catalog again (an administrator's
   * token, when it has tokens). A rejected reload throws a `RatchetError` whose `problems`
   * lists every problem found; the previous configuration then stays active.
   */
  reload(): Promise<Reloaded> {
    return this.request("POST", "/v1/admin/reload");
  }

  /**
   * One request, sent once and answered with its JSON body (`undefined` for `204`). A `POST`
   * under `/v1` takes an idempotency key in `options.headers` (`{"Idempotency-Key": key}`): sent
   * again with the same key, after a `NetworkError` say, it is carried out once.
   */
  async request<T>(method: string, path: string, options: RequestOptions = {}): Promise<T> {
    return this.answer<T>(await this.exchange(method, path, options), method, path, options.signal);
  }

  /**
   * A request that carries `Idempotency-Key: key` (a fresh UUID without one) and is sent again
   * with the same key while it may or may not have arrived, as `RetryOptions` says.
   */
  private async idempotent<T>(method: string, path: string, body: unknown, key: string | undefined): Promise<T> {
    const options: RequestOptions = { body, headers: { [IDEMPOTENCY_KEY]: key ?? globalThis.crypto.randomUUID() } };
    const retrying = new Retrying(this.retryOptions);
    for (;;) {
      let failure: NetworkError | RatchetError;
      let delayMs: number | undefined;
      try {
        const response = await this.exchange(method, path, options);
        if (response.status !== 409) return await this.answer<T>(response, method, path, undefined);
        const refusal = await errorFromResponse(response);
        if (refusal.code !== REQUEST_IN_PROGRESS) throw refusal;
        failure = refusal;
        delayMs = retrying.next(retryAfterMs(response.headers.get("Retry-After")));
      } catch (error) {
        if (!(error instanceof NetworkError)) throw error;
        failure = error;
        delayMs = retrying.next();
      }
      if (delayMs === undefined) throw failure;
      await sleep(delayMs, undefined);
    }
  }

  private exchange(method: string, path: string, options: RequestOptions): Promise<Response> {
    const headers: Record<string, string> = { Accept: "application/json", ...options.headers, ...this.authorization() };
    const init: RequestInit = { method, headers };
    if (options.body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(options.body);
    }
    if (options.signal) init.signal = options.signal;
    const url = this.baseUrl + path + queryString(options.query as QueryValues | undefined);
    return this.send(url, init, `${method} ${path}`);
  }

  private async answer<T>(response: Response, method: string, path: string, signal: AbortSignal | undefined): Promise<T> {
    if (!response.ok) throw await errorFromResponse(response);
    if (response.status === 204) return undefined as T;
    try {
      return (await response.json()) as T;
    } catch (error) {
      if (signal?.aborted) throw signal.reason;
      throw new NetworkError(`${method} ${path}: the answer could not be read`, { cause: error });
    }
  }

  private async send(url: string, init: RequestInit, what: string): Promise<Response> {
    try {
      return await this.fetch(url, init);
    } catch (error) {
      if (init.signal?.aborted) throw init.signal.reason;
      const reason = error instanceof Error ? (error.cause instanceof Error ? error.cause.message : error.message) : String(error);
      throw new NetworkError(`${what}: no answer from ${this.baseUrl} (${reason})`, { cause: error });
    }
  }

  private connector(path: string) {
    return (cursor: number | undefined, follow: boolean, signal: AbortSignal | undefined) => {
      const headers: Record<string, string> = { Accept: "text/event-stream", ...this.authorization() };
      if (cursor !== undefined) headers["Last-Event-ID"] = String(cursor);
      const init: RequestInit = { headers };
      if (signal) init.signal = signal;
      const url = this.baseUrl + path + queryString(follow ? undefined : { follow: false });
      return this.send(url, init, `GET ${path}`);
    };
  }

  private authorization(): Record<string, string> {
    return this.token === undefined ? {} : { Authorization: `Bearer ${this.token}` };
  }
}

/** A tenant's webhooks and their delivery logs: `client.webhooks`. */
export class Webhooks {
  constructor(private readonly client: Client) {}

  /** The answer carries the signing secret, this once. */
  create(webhook: CreateWebhook): Promise<Webhook> {
    return this.client.request("POST", "/v1/webhooks", { body: webhook });
  }

  /** Every webhook of the tenant, in creation order, on one page. */
  list(): Promise<WebhookPage> {
    return this.client.request("GET", "/v1/webhooks");
  }

  get(webhookId: string): Promise<Webhook> {
    return this.client.request("GET", `/v1/webhooks/${segment(webhookId)}`);
  }

  /** Removes the webhook with its delivery log. */
  delete(webhookId: string): Promise<void> {
    return this.client.request("DELETE", `/v1/webhooks/${segment(webhookId)}`);
  }

  /** Replaces the signing secret with `secret`, or with one the server makes. */
  rotateSecret(webhookId: string, secret?: string): Promise<RotatedSecret> {
    return this.client.request("POST", `/v1/webhooks/${segment(webhookId)}/rotate-secret`, { body: secret === undefined ? {} : { secret } });
  }

  deliveries(webhookId: string, query: DeliveriesQuery = {}): Promise<DeliveryPage> {
    return this.client.request("GET", `/v1/webhooks/${segment(webhookId)}/deliveries`, { query });
  }

  /** Puts one dead delivery back to `pending`. */
  requeue(webhookId: string, deliveryId: number): Promise<Delivery> {
    return this.client.request("POST", `/v1/webhooks/${segment(webhookId)}/deliveries/${deliveryId}/requeue`);
  }

  /** Puts every dead delivery of the webhook back to `pending`. */
  requeueDead(webhookId: string): Promise<Requeued> {
    return this.client.request("POST", `/v1/webhooks/${segment(webhookId)}/deliveries/requeue`);
  }
}

/** The request header that names a request, so that sending it again does it once. */
const IDEMPOTENCY_KEY = "Idempotency-Key";
/** The error code of a keyed request sent again while the first is still carried out. */
const REQUEST_IN_PROGRESS = "request_in_progress";

/** The attempts of one keyed request, within its `RetryOptions`. */
class Retrying {
  private firstFailure: number | undefined;
  private attempts = 1;
  private backoffMs: number;

  constructor(private readonly options: Required<RetryOptions>) {
    this.backoffMs = options.backoffMs;
  }

  /** The wait before the next attempt (`delayMs`, or the backoff), or `undefined` to give up. */
  next(delayMs: number = this.backoffMs): number | undefined {
    const now = Date.now();
    this.firstFailure ??= now;
    const remaining = this.options.maxRetryMs - (now - this.firstFailure);
    if (this.attempts >= this.options.maxAttempts || remaining <= 0) return undefined;
    this.attempts += 1;
    this.backoffMs *= 2;
    return Math.min(delayMs, remaining);
  }
}

/** A `Retry-After` in milliseconds (the server sends whole seconds), or `undefined`. */
function retryAfterMs(value: string | null): number | undefined {
  const seconds = value === null || value.trim() === "" ? NaN : Number(value);
  return Number.isFinite(seconds) && seconds >= 0 ? seconds * 1000 : undefined;
}

/** The options that were given: an `undefined` one leaves its default. */
function definedOnly<T extends object>(options: T): Partial<T> {
  return Object.fromEntries(Object.entries(options).filter(([, value]) => value !== undefined)) as Partial<T>;
}

/** An id as one path segment: a slash or `?` in it cannot reach another route. */
function segment(id: string): string {
  return encodeURIComponent(id);
}

function queryString(query: QueryValues | undefined): string {
  if (query === undefined) return "";
  const params = new URLSearchParams();
  for (const [name, value] of Object.entries(query)) {
    if (value !== undefined && value !== null) params.set(name, String(value));
  }
  const text = params.toString();
  return text ? `?${text}` : "";
}
