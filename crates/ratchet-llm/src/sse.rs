//! A Server-Sent Events parser following the WHATWG rules, shared by every streaming client:
//! model providers' streams here and, in the CLI, Ratchet's own event streams.

use std::time::Duration;

/// One dispatched server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The event type (`message` when the stream gave none).
    pub event: String,
    pub data: String,
    /// The last event ID at dispatch (it persists across events until changed).
    pub id: String,
}

/// An incremental parser of `text/event-stream`, following the WHATWG rules: lines end with
/// CR, LF or CRLF (also split across chunks); a leading BOM is dropped; lines starting with
/// `:` are comments; `id` persists across events and an empty `id` resets it; an `id`
/// containing NUL is ignored; an event without `data` is not dispatched; a final event not
/// closed by an empty line is discarded.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    /// The previous chunk ended with CR: a LF starting this one ends no new line.
    after_cr: bool,
    /// The stream's first line has been seen (only it can start with a BOM).
    started: bool,
    event: String,
    data: String,
    last_event_id: String,
    retry: Option<Duration>,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

impl SseParser {
    /// Feeds the next bytes of the stream; returns the events they complete.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        while !bytes.is_empty() {
            if self.after_cr {
                self.after_cr = false;
                if bytes[0] == b'\n' {
                    bytes = &bytes[1..];
                    continue;
                }
            }
            match bytes.iter().position(|b| matches!(b, b'\r' | b'\n')) {
                None => {
                    self.line.extend_from_slice(bytes);
                    break;
                }
                Some(end) => {
                    self.line.extend_from_slice(&bytes[..end]);
                    self.after_cr = bytes[end] == b'\r';
                    bytes = &bytes[end + 1..];
                    let mut line = std::mem::take(&mut self.line);
                    self.process_line(&line, &mut events);
                    line.clear();
                    self.line = line;
                }
            }
        }
        events
    }

    /// A new connection: what was pending is dropped; the last event ID and the reconnection
    /// time are kept.
    pub fn restart(&mut self) {
        self.line.clear();
        self.after_cr = false;
        self.started = false;
        self.event.clear();
        self.data.clear();
    }

    /// What to send as `Last-Event-ID` when reconnecting (empty: send none).
    pub fn last_event_id(&self) -> &str {
        &self.last_event_id
    }

    /// The reconnection time the server asked for with `retry:`.
    pub fn retry(&self) -> Option<Duration> {
        self.retry
    }

    fn process_line(&mut self, line: &[u8], events: &mut Vec<SseEvent>) {
        let line = if self.started {
            line
        } else {
            self.started = true;
            line.strip_prefix(BOM).unwrap_or(line)
        };
        if line.is_empty() {
            self.dispatch(events);
            return;
        }
        if line[0] == b':' {
            return;
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "event" => value.clone_into(&mut self.event),
            "data" => {
                self.data.push_str(value);
                self.data.push('\n');
            }
            "id" if !value.contains('\0') => value.clone_into(&mut self.last_event_id),
            "retry" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => {
                if let Ok(ms) = value.parse() {
                    self.retry = Some(Duration::from_millis(ms));
                }
            }
            _ => {}
        }
    }

    fn dispatch(&mut self, events: &mut Vec<SseEvent>) {
        let event = std::mem::take(&mut self.event);
        if self.data.is_empty() {
            return;
        }
        let mut data = std::mem::take(&mut self.data);
        if data.ends_with('\n') {
            data.pop();
        }
        events.push(SseEvent {
            event: if event.is_empty() {
                "message".to_owned()
            } else {
                event
            },
            data,
            id: self.last_event_id.clone(),
        });
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn event(event: &str, data: &str, id: &str) -> SseEvent {
        SseEvent {
            event: event.into(),
            data: data.into(),
            id: id.into(),
        }
    }

    fn parse(text: &[u8]) -> Vec<SseEvent> {
        SseParser::default().feed(text)
    }

    /// The same bytes fed whole, one byte at a time, and split at every position give the
    /// same events.
    fn parse_every_way(text: &[u8]) -> Vec<SseEvent> {
        let whole = parse(text);
        let mut parser = SseParser::default();
        let bytewise: Vec<SseEvent> = text.iter().flat_map(|b| parser.feed(&[*b])).collect();
        assert_eq!(bytewise, whole, "fed byte by byte");
        for split in 0..=text.len() {
            let mut parser = SseParser::default();
            let mut events = parser.feed(&text[..split]);
            events.extend(parser.feed(&text[split..]));
            assert_eq!(events, whole, "split at {split}");
        }
        whole
    }

    #[test]
    fn lf_cr_and_crlf_all_end_lines() {
        let expected = vec![event("a", "1", "7"), event("message", "2", "7")];
        for eol in ["\n", "\r", "\r\n"] {
            let text = format!("event: a{eol}id: 7{eol}data: 1{eol}{eol}data: 2{eol}{eol}");
            assert_eq!(parse_every_way(text.as_bytes()), expected, "{eol:?}");
        }
        // Mixed in one stream, and a CR followed by LF in the next chunk is one line end.
        assert_eq!(
            parse_every_way(b"data: x\r\n\rdata: y\n\r\n"),
            vec![event("message", "x", ""), event("message", "y", "")]
        );
    }

    #[test]
    fn a_leading_bom_is_dropped_once() {
        assert_eq!(
            parse_every_way(b"\xEF\xBB\xBFdata: x\n\n"),
            vec![event("message", "x", "")]
        );
        // A BOM anywhere else makes an unknown field name, which is ignored.
        assert_eq!(
            parse_every_way(b"data: x\n\n\xEF\xBB\xBFdata: y\n\ndata: z\n\n"),
            vec![event("message", "x", ""), event("message", "z", "")]
        );
        // Only one BOM is stripped.
        assert_eq!(
            parse(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: x\n\n"),
            Vec::<SseEvent>::new()
        );
    }

    #[test]
    fn the_id_persists_until_changed_and_an_empty_id_resets_it() {
        let mut parser = SseParser::default();
        let events = parser.feed(b"id: 1\ndata: a\n\ndata: b\n\nid\ndata: c\n\nid: 4\ndata: d\n\n");
        assert_eq!(
            events,
            vec![
                event("message", "a", "1"),
                event("message", "b", "1"),
                event("message", "c", ""),
                event("message", "d", "4"),
            ]
        );
        assert_eq!(parser.last_event_id(), "4");
        // `id:` with an empty value resets too; an id containing NUL is ignored.
        assert_eq!(parser.feed(b"id:\n\n"), vec![]);
        assert_eq!(parser.last_event_id(), "");
        parser.feed(b"id: 9\nid: 1\x002\ndata: e\n\n");
        assert_eq!(parser.last_event_id(), "9");
    }

    #[test]
    fn an_event_without_data_is_not_dispatched_but_its_id_counts() {
        let mut parser = SseParser::default();
        assert_eq!(parser.feed(b"event: ping\nid: 5\n\n"), vec![]);
        assert_eq!(parser.last_event_id(), "5");
        // The type of the undispatched event does not leak into the next one.
        assert_eq!(
            parser.feed(b"data: x\n\n"),
            vec![event("message", "x", "5")]
        );
    }

    #[test]
    fn comments_fields_and_values() {
        let text =
            b": keep-alive\n:\ndata:no space\ndata:  two spaces\ndata\nunknown: x\nevent:e\n\n";
        assert_eq!(
            parse_every_way(text),
            vec![event("e", "no space\n two spaces\n", "")]
        );
        // `data:` alone is an empty data line: the event is dispatched with empty data.
        assert_eq!(parse(b"data:\n\n"), vec![event("message", "", "")]);
        // A value may contain colons.
        assert_eq!(
            parse(b"data: {\"a\":1}\n\n"),
            vec![event("message", "{\"a\":1}", "")]
        );
    }

    #[test]
    fn an_unfinished_event_is_held_back_and_dropped_on_restart() {
        let mut parser = SseParser::default();
        assert_eq!(
            parser.feed(b"id: 3\ndata: a\n\ndata: partial\n"),
            vec![event("message", "a", "3")]
        );
        parser.restart();
        assert_eq!(parser.last_event_id(), "3");
        assert_eq!(
            parser.feed(b"data: b\n\n"),
            vec![event("message", "b", "3")]
        );
    }

    #[test]
    fn retry_takes_only_digits() {
        let mut parser = SseParser::default();
        parser.feed(b"retry: 1500\n\n");
        assert_eq!(parser.retry(), Some(Duration::from_millis(1500)));
        parser.feed(b"retry: 1.5\nretry: x\nretry:\n\n");
        assert_eq!(parser.retry(), Some(Duration::from_millis(1500)));
    }

    /// A server whose stream breaks twice: after two events and half of a third, then
    /// after the third. The follower reconnects with the last id each time and sees every
    /// event once; a 4xx is returned as the API's error, with its message.
    #[test]
    fn multibyte_text_split_across_chunks_survives() {
        let text = "data: 2 + 3 = 5 ✓ — fin\n\n".as_bytes();
        assert_eq!(
            parse_every_way(text),
            vec![event("message", "2 + 3 = 5 ✓ — fin", "")]
        );
    }

    /// Field values as a server writes them: no line ends, and (for `event` and `id`) no NUL.
    fn value(nul: bool) -> impl Strategy<Value = String> {
        any::<String>().prop_map(move |text| {
            text.chars()
                .filter(|c| !matches!(c, '\r' | '\n') && (nul || *c != '\0'))
                .collect()
        })
    }

    fn sent_event() -> impl Strategy<Value = (Option<String>, Vec<String>, Option<String>)> {
        (
            proptest::option::of(value(false).prop_filter("named", |e| !e.is_empty())),
            proptest::collection::vec(value(true), 1..4),
            proptest::option::of(value(false)),
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Whatever the bytes, and wherever the network splits them, the parser dispatches
        /// the same events and never panics.
        #[test]
        fn any_bytes_give_the_same_events_however_they_are_split(
            bytes in proptest::collection::vec(
                prop_oneof![
                    1 => any::<u8>().prop_map(|b| vec![b]),
                    3 => proptest::sample::select(vec![
                        "data: x", "data:", "event: e", "id: 7", "id", "retry: 9", ": c", "\r",
                        "\n", "\r\n", "\u{feff}", "\u{fffd}", "é",
                    ])
                    .prop_map(|token| token.as_bytes().to_vec()),
                ],
                0..60,
            )
            .prop_map(|tokens| tokens.concat()),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..6),
        ) {
            let whole = parse(&bytes);
            let mut cuts: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut parser = SseParser::default();
            let mut events = Vec::new();
            let mut start = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                events.extend(parser.feed(&bytes[start..cut]));
                start = cut;
            }
            prop_assert_eq!(events, whole);
        }

        /// Events written as a server writes them come back as they were sent, with any line
        /// ending, in any chunks.
        #[test]
        fn written_events_are_read_back(
            sent in proptest::collection::vec(sent_event(), 0..5),
            eol in prop_oneof![Just("\n"), Just("\r"), Just("\r\n")],
            cut in any::<proptest::sample::Index>(),
        ) {
            let mut text = String::new();
            let mut expected = Vec::new();
            let mut id = String::new();
            for (kind, data, new_id) in &sent {
                if let Some(kind) = kind {
                    text.push_str(&format!("event: {kind}{eol}"));
                }
                if let Some(new_id) = new_id {
                    text.push_str(&format!("id: {new_id}{eol}"));
                    id.clone_from(new_id);
                }
                for line in data {
                    text.push_str(&format!("data: {line}{eol}"));
                }
                text.push_str(eol);
                expected.push(event(
                    kind.as_deref().unwrap_or("message"),
                    &data.join("\n"),
                    &id,
                ));
            }
            let bytes = text.as_bytes();
            let cut = cut.index(bytes.len() + 1);
            let mut parser = SseParser::default();
            let mut events = parser.feed(&bytes[..cut]);
            events.extend(parser.feed(&bytes[cut..]));
            prop_assert_eq!(events, expected);
            prop_assert_eq!(parser.last_event_id(), id.as_str());
        }
    }
}
