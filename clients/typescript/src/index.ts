/**
 * `@ratchet/client`: a client for Ratchet's HTTP API, with event streams that resume by
 * themselves. It has no runtime dependencies and needs only `fetch` and web streams.
 */

export { Client, Webhooks, DEFAULT_RETRY, ENDED_STATUSES, WAITING_STATUSES } from "./client.js";
export type { ClientOptions, IdempotentOptions, RequestOptions, RetryOptions, SendMessageOptions, WaitRunOptions } from "./client.js";
export { RatchetError, NetworkError, WaitTimeoutError } from "./errors.js";
export { isStoredEvent } from "./events.js";
export type { EventStreamOptions, StreamedEvent } from "./events.js";
export { SseParser } from "./sse.js";
export type { ServerSentEvent } from "./sse.js";
export type * from "./types.js";
export type { components, paths } from "./schema.js";
