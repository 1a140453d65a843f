/**
 * Event streams that outlive their connections: a dropped connection or a restarted server
 * is reconnected with `Last-Event-ID` and a growing delay, and every stored event is yielded
 * exactly once, in `seq` order. Live `activity` events are yielded as they come but never
 * move the cursor: they are not stored, so no replay holds them.
 *
 * This module decides when to reconnect and what to skip; opening a connection is the
 * client's (it knows the server, the token and `fetch`).
 */

import { NetworkError, RatchetError, errorFromResponse } from "./errors.js";
import { sleep } from "./sleep.js";
import { SseParser, type ServerSentEvent } from "./sse.js";
import type { LiveActivity, StoredEvent } from "./types.js";

/** An event of a stream: a stored one (with its `seq`) or a live `activity` (with `live: true`). */
export type StreamedEvent = StoredEvent | LiveActivity;

export interface EventStreamOptions {
  /** Start after this `seq`: only later events are yielded. */
  after?: number;
  /** Keep following live events (the default), or end after the stored backlog. */
  follow?: boolean;
  /** Ends the stream; the iteration then throws the signal's reason. */
  signal?: AbortSignal;
  /**
   * How long to keep trying to reconnect once a connection is lost before giving up with
   * the last failure, in milliseconds (default 60 000).
   */
  maxReconnectMs?: number;
}

/** Opens one connection, resuming after `cursor` when there is one. */
export type Connect = (cursor: number | undefined, follow: boolean, signal: AbortSignal | undefined) => Promise<Response>;

const DEFAULT_MAX_RECONNECT_MS = 60_000;
/** The first reconnection delay until the server sends its own (`retry:`). */
const DEFAULT_RETRY_MS = 1_000;
/** Consecutive failures double the delay up to this. */
const MAX_RETRY_DELAY_MS = 30_000;

/** A stored event carries its `seq`; a live one does not. */
export function isStoredEvent(event: StreamedEvent): event is StoredEvent {
  return typeof (event as StoredEvent).seq === "number";
}

export async function* resumingEvents(connect: Connect, options: EventStreamOptions = {}): AsyncGenerator<StreamedEvent, void, undefined> {
  const { follow = true, signal, maxReconnectMs = DEFAULT_MAX_RECONNECT_MS } = options;
  let cursor = options.after;
  let retryMs = DEFAULT_RETRY_MS;
  let failures = 0;
  let lostAt: number | undefined;

  for (;;) {
    let failure: Error;
    try {
      const response = await connect(cursor, follow, signal);
      if (!response.ok) throw await errorFromResponse(response);
      lostAt = undefined;
      failures = 0;
      const parser = new SseParser();
      const broken = yield* streamedEvents(response, parser, signal, (event) => {
        if (!isStoredEvent(event)) return true;
        if (cursor !== undefined && event.seq <= cursor) return false;
        cursor = event.seq;
        return true;
      });
      retryMs = parser.retryMs ?? retryMs;
      if (broken === undefined && !follow) return;
      failure = broken ?? new NetworkError("the server closed the event stream");
    } catch (error) {
      if (signal?.aborted) throw signal.reason;
      if (!isWorthRetrying(error)) throw error;
      failure = error as Error;
      failures++;
    }
    lostAt ??= Date.now();
    const remaining = lostAt + maxReconnectMs - Date.now();
    if (remaining <= 0) throw failure;
    const delay = Math.min(retryMs * 2 ** Math.max(failures - 1, 0), MAX_RETRY_DELAY_MS);
    await sleep(Math.min(jittered(delay), remaining), signal);
  }
}

/**
 * Yields the events of one connection that `accept` lets through; returns the failure when
 * the connection broke, nothing when the server ended the stream.
 */
async function* streamedEvents(
  response: Response,
  parser: SseParser,
  signal: AbortSignal | undefined,
  accept: (event: StreamedEvent) => boolean,
): AsyncGenerator<StreamedEvent, NetworkError | undefined, undefined> {
  if (response.body === null) return new NetworkError("the event stream has no body");
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  try {
    for (;;) {
      let chunk: ReadableStreamReadResult<string>;
      try {
        chunk = await reader.read();
      } catch (error) {
        if (signal?.aborted) throw signal.reason;
        return new NetworkError("the event stream broke off", { cause: error });
      }
      if (chunk.done) return undefined;
      for (const message of parser.feed(chunk.value)) {
        const event = parseEvent(message);
        if (accept(event)) yield event;
      }
    }
  } finally {
    // Closes the connection when the caller stops early; harmless once the body has ended.
    reader.cancel().catch(() => {});
  }
}

function parseEvent(message: ServerSentEvent): StreamedEvent {
  try {
    return JSON.parse(message.data) as StreamedEvent;
  } catch (error) {
    throw new Error(`the event stream sent an event whose data is not JSON: ${message.data.slice(0, 200)}`, { cause: error });
  }
}

/** A network failure, a server error or too many streams may pass; other refusals will not. */
function isWorthRetrying(error: unknown): boolean {
  if (error instanceof NetworkError) return true;
  return error instanceof RatchetError && (error.status === 429 || error.status >= 500);
}

/** Spreads reconnections of many clients after a restart over ±20 % of the delay. */
function jittered(delay: number): number {
  return delay * (0.8 + Math.random() * 0.4);
}
