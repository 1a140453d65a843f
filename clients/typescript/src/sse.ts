/**
 * A parser for `text/event-stream` bodies, following the HTML standard's "Server-sent events"
 * interpretation rules: lines end with CRLF, LF or CR (also split across chunks), one leading
 * byte order mark is dropped, `:` lines are comments, `data` lines are joined with newlines,
 * an `id` holding NULL is ignored, `retry` takes only digits, and an event not closed by a
 * blank line when the stream ends is never dispatched.
 *
 * It parses text only: it knows nothing of connections, reconnection or the events' meaning.
 */

export interface ServerSentEvent {
  /** The `event` field, or `message` when none was given. */
  event: string;
  /** The `data` lines joined with `\n`. */
  data: string;
  /** The stream's last event id when this event was dispatched: ids persist across events. */
  lastEventId: string;
}

const BYTE_ORDER_MARK = "\uFEFF";

export class SseParser {
  /** The reconnection time the stream last asked for with `retry:`, in milliseconds. */
  retryMs: number | undefined;

  private buffer = "";
  private atStreamStart = true;
  /** A chunk ended with CR: an LF starting the next chunk belongs to the same line end. */
  private afterCarriageReturn = false;
  private eventType = "";
  private data = "";
  private lastEventId = "";

  /** Parses the next piece of the stream's text; returns the events it completed. */
  feed(text: string): ServerSentEvent[] {
    if (this.atStreamStart && text.length > 0) {
      this.atStreamStart = false;
      if (text.startsWith(BYTE_ORDER_MARK)) text = text.slice(1);
    }
    if (this.afterCarriageReturn && text.length > 0) {
      this.afterCarriageReturn = false;
      if (text.startsWith("\n")) text = text.slice(1);
    }
    // What the buffer held holds no line end: only the new text needs scanning.
    const scanned = this.buffer.length;
    this.buffer += text;

    const events: ServerSentEvent[] = [];
    let start = 0;
    for (let i = scanned; i < this.buffer.length; i++) {
      const char = this.buffer[i];
      if (char !== "\n" && char !== "\r") continue;
      const event = this.processLine(this.buffer.slice(start, i));
      if (event) events.push(event);
      if (char === "\r") {
        if (i + 1 === this.buffer.length) this.afterCarriageReturn = true;
        else if (this.buffer[i + 1] === "\n") i++;
      }
      start = i + 1;
    }
    this.buffer = this.buffer.slice(start);
    return events;
  }

  private processLine(line: string): ServerSentEvent | undefined {
    if (line === "") return this.dispatch();
    if (line.startsWith(":")) return undefined;
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    switch (field) {
      case "event":
        this.eventType = value;
        break;
      case "data":
        this.data += value + "\n";
        break;
      case "id":
        if (!value.includes("\0")) this.lastEventId = value;
        break;
      case "retry":
        if (/^[0-9]+$/.test(value)) this.retryMs = Number(value);
        break;
    }
    return undefined;
  }

  private dispatch(): ServerSentEvent | undefined {
    if (this.data === "") {
      this.eventType = "";
      return undefined;
    }
    const event: ServerSentEvent = {
      event: this.eventType || "message",
      data: this.data.slice(0, -1),
      lastEventId: this.lastEventId,
    };
    this.eventType = "";
    this.data = "";
    return event;
  }
}
