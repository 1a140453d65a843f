// The event-stream parser against the HTML standard's rules, fed whole and in every split.

import { test } from "node:test";
import assert from "node:assert/strict";
import { SseParser } from "../dist/index.js";

function parse(...chunks) {
  const parser = new SseParser();
  const events = chunks.flatMap((chunk) => parser.feed(chunk));
  return { events, retryMs: parser.retryMs };
}

// The same text cut at every position must give the same events: a line end, a BOM or a
// field may arrive split across chunks.
function assertSameAtEverySplit(text) {
  const whole = parse(text);
  for (let cut = 0; cut <= text.length; cut++) {
    assert.deepEqual(parse(text.slice(0, cut), text.slice(cut)), whole, `cut at ${cut}`);
  }
  assert.deepEqual(parse(...text), whole, "one character at a time");
  return whole;
}

test("an event's id, kind and data", () => {
  const { events } = assertSameAtEverySplit('id: 7\nevent: tool.result\ndata: {"seq":7}\n\n');
  assert.deepEqual(events, [{ event: "tool.result", data: '{"seq":7}', lastEventId: "7" }]);
});

test("data lines are joined with newlines, and an event without a kind is a message", () => {
  const { events } = assertSameAtEverySplit("data: first\ndata:second\ndata\ndata:  indented\n\n");
  assert.deepEqual(events, [{ event: "message", data: "first\nsecond\n\n indented", lastEventId: "" }]);
});

test("lines may end with CRLF, CR or LF, mixed in one stream", () => {
  const { events } = assertSameAtEverySplit("data: a\r\n\r\ndata: b\r\rdata: c\n\ndata: d\r\n\n");
  assert.deepEqual(
    events.map((e) => e.data),
    ["a", "b", "c", "d"],
  );
});

test("a CR at the end of one chunk and an LF at the start of the next are one line end", () => {
  const { events } = parse("data: a\r", "\ndata: b\r", "\n\r", "\n");
  assert.deepEqual(events, [{ event: "message", data: "a\nb", lastEventId: "" }]);
});

test("one leading byte order mark is dropped, a second one is part of the field name", () => {
  const { events } = assertSameAtEverySplit("\uFEFFdata: x\n\n\uFEFFdata: y\n\n");
  assert.deepEqual(events, [{ event: "message", data: "x", lastEventId: "" }]);
});

test("comments are ignored, also between the lines of one event", () => {
  const { events } = assertSameAtEverySplit(": keep-alive\n\ndata: a\n: in the middle\ndata: b\n\n:\n\n");
  assert.deepEqual(events, [{ event: "message", data: "a\nb", lastEventId: "" }]);
});

test("the last id persists to later events until another is set; an id with NULL is ignored", () => {
  const { events } = assertSameAtEverySplit("id: 1\ndata: a\n\ndata: b\n\nid: 2\0\ndata: c\n\nid\ndata: d\n\n");
  assert.deepEqual(
    events.map((e) => [e.data, e.lastEventId]),
    [
      ["a", "1"],
      ["b", "1"],
      ["c", "1"],
      ["d", ""],
    ],
  );
});

test("an event with no data is not dispatched, and its kind does not leak into the next", () => {
  const { events } = assertSameAtEverySplit("event: ping\n\ndata: a\n\nevent: ping\nid: 3\n\ndata: b\n\n");
  assert.deepEqual(events, [
    { event: "message", data: "a", lastEventId: "" },
    { event: "message", data: "b", lastEventId: "3" },
  ]);
});

test("retry takes only digits; unknown fields are ignored", () => {
  assert.equal(assertSameAtEverySplit("retry: 2000\n\n").retryMs, 2000);
  assert.equal(parse("retry: 2000\nretry: 2s\nretry: -1\n\n").retryMs, 2000);
  const { events } = parse("bogus: field\nEvent: Upper\ndata: a\n\n");
  assert.deepEqual(events, [{ event: "message", data: "a", lastEventId: "" }]);
});

test("an event the stream does not close with a blank line is never dispatched", () => {
  assert.deepEqual(parse("data: a\n\ndata: unfinished\n").events.map((e) => e.data), ["a"]);
  assert.deepEqual(parse("data: unfinished").events, []);
});

test("a colon in the value is kept, only the first separates the field", () => {
  const { events } = assertSameAtEverySplit('data: {"a": "b:c"}\n\n');
  assert.equal(events[0].data, '{"a": "b:c"}');
});
