/**
 * The errors the client throws — the server's answer to a request it refused, a request that
 * got no answer at all, a wait that ran out of time — and how a refusal is read from its
 * answer. An aborted request throws its signal's reason instead, as `fetch` does.
 */

import type { components } from "./schema.js";

/** The server answered with an error status; `code` and `message` come from its JSON body. */
export class RatchetError extends Error {
  override readonly name = "RatchetError";
  /** The HTTP status, for example 404. */
  readonly status: number;
  /**
   * The API's stable code (`not_found`, `invalid_request`, `conflict`, …), or `unexpected_response`
   * when the body was not the API's JSON error (a proxy's page, say).
   */
  readonly code: string;
  /** The parsed JSON body, or the body's text when it was not JSON. */
  readonly body: unknown;

  constructor(status: number, code: string, message: string, body: unknown) {
    super(message);
    this.status = status;
    this.code = code;
    this.body = body;
  }

  /** Every problem the server listed, for a request with more than one (a rejected reload). */
  get problems(): string[] {
    const detail = (this.body as Partial<components["schemas"]["ErrorBody"]> | undefined)?.error;
    return detail?.problems ?? [];
  }
}

/** The request got no HTTP answer: the server could not be reached, or the connection broke. */
export class NetworkError extends Error {
  override readonly name = "NetworkError";

  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
  }
}

/** `waitRun` gave up before the run ended or stopped to wait; `run` is how it last stood. */
export class WaitTimeoutError extends Error {
  override readonly name = "WaitTimeoutError";
  readonly run: components["schemas"]["RunView"];

  constructor(message: string, run: components["schemas"]["RunView"]) {
    super(message);
    this.run = run;
  }
}

/** The error a refused request stands for, from the API's JSON error body when it has one. */
export async function errorFromResponse(response: Response): Promise<RatchetError> {
  const text = await response.text().catch(() => "");
  let body: unknown = text;
  try {
    body = JSON.parse(text);
  } catch {
    // Not the API's JSON: kept as text, and described below.
  }
  const detail = (body as { error?: { code?: unknown; message?: unknown } } | null)?.error;
  if (typeof detail?.code === "string" && typeof detail.message === "string") {
    return new RatchetError(response.status, detail.code, detail.message, body);
  }
  const excerpt = text.trim().slice(0, 200);
  return new RatchetError(response.status, "unexpected_response", `HTTP ${response.status}${excerpt ? `: ${excerpt}` : ""}`, body);
}
