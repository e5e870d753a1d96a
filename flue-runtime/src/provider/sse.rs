//! Server-sent events as the HTML standard's event-stream interpretation reads them, over a
//! response body that arrives in chunks of any size.
//!
//! The parser keeps one growing buffer per stream and hands each event out borrowed from it:
//! a streamed response (hundreds of events) costs no allocation per event. Lines end with
//! CRLF, LF or CR (a CR at the end of a chunk waits for the next chunk's first byte); a line
//! starting with `:` is a comment; `data` lines join with LF; an event without `data` is not
//! dispatched; an unterminated event at the end of the stream is discarded; a leading byte
//! order mark is skipped. Events are bounded ([`MAX_EVENT_BYTES`] unless the parser is built
//! with [`SseParser::new`]): a peer that never ends a line or an event cannot grow the buffer
//! without limit.

use std::fmt;

/// The most bytes one event (its lines, including any not yet terminated) may take, unless
/// the parser is built with another bound.
pub(crate) const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// One dispatched event, borrowed from the parser.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Event<'a> {
    /// The event type (`message` when the stream named none).
    pub event: &'a str,
    /// The data lines, joined with LF.
    pub data: &'a str,
}

/// Why an event stream cannot be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SseError {
    /// An event grew past the parser's bound (`limit` bytes).
    TooLarge {
        /// The bound it grew past.
        limit: usize,
    },
}

impl fmt::Display for SseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLarge { limit } => write!(f, "an event is larger than {limit} bytes"),
        }
    }
}

/// Incremental event-stream parser: [`push`](Self::push) chunks, take events with
/// [`next_event`](Self::next_event) until it returns `None`, push the next chunk.
#[derive(Debug)]
pub(crate) struct SseParser {
    /// The most bytes one event may take.
    max_event_bytes: usize,
    /// Received bytes; `buffer[position..]` is not parsed yet.
    buffer: Vec<u8>,
    position: usize,
    /// The last line ended with CR at the end of a chunk: a LF starting the next one belongs
    /// to it.
    after_cr: bool,
    /// Whether the stream's first bytes were checked for a byte order mark.
    started: bool,
    /// Bytes from `position` on already searched for a line end (an unfinished line): a
    /// line arriving a byte at a time is searched once, not once per byte.
    scanned: usize,
    /// The event being built.
    event_type: String,
    data: String,
    has_data: bool,
    /// Bytes of the event being built (its complete lines).
    event_bytes: usize,
    /// The last call handed out an event borrowing `event_type` and `data`: clear them first.
    dispatched: bool,
}

impl Default for SseParser {
    /// A parser bounding events at [`MAX_EVENT_BYTES`].
    fn default() -> Self {
        Self::new(MAX_EVENT_BYTES)
    }
}

impl SseParser {
    /// A parser refusing ([`SseError::TooLarge`]) any event of more than `max_event_bytes`
    /// bytes (its lines with their line ends, including a line not yet terminated).
    pub(crate) fn new(max_event_bytes: usize) -> Self {
        Self {
            max_event_bytes,
            buffer: Vec::new(),
            position: 0,
            after_cr: false,
            started: false,
            scanned: 0,
            event_type: String::new(),
            data: String::new(),
            has_data: false,
            event_bytes: 0,
            dispatched: false,
        }
    }

    /// Appends a chunk of the body.
    pub(crate) fn push(&mut self, chunk: &[u8]) {
        if self.position > 0 {
            self.buffer.drain(..self.position);
            self.position = 0;
        }
        self.buffer.extend_from_slice(chunk);
    }

    /// The next complete event in what was pushed, if there is one.
    pub(crate) fn next_event(&mut self) -> Result<Option<Event<'_>>, SseError> {
        if std::mem::take(&mut self.dispatched) {
            self.event_type.clear();
            self.data.clear();
        }
        if !self.started {
            if self.buffer.len() < 3 && b"\xEF\xBB\xBF".starts_with(&self.buffer) {
                // Too short to tell whether it is a byte order mark.
                return Ok(None);
            }
            self.started = true;
            if self.buffer.starts_with(b"\xEF\xBB\xBF") {
                self.position = 3;
            }
        }
        loop {
            if self.after_cr && self.position < self.buffer.len() {
                self.after_cr = false;
                if self.buffer[self.position] == b'\n' {
                    self.position += 1;
                }
            }
            let rest = &self.buffer[self.position..];
            let Some(found) = memchr::memchr2(b'\n', b'\r', &rest[self.scanned..]) else {
                if self.event_bytes + rest.len() > self.max_event_bytes {
                    return Err(self.too_large());
                }
                self.scanned = rest.len();
                return Ok(None);
            };
            let end = std::mem::take(&mut self.scanned) + found;
            let line_start = self.position;
            self.position += end + 1;
            if rest[end] == b'\r' {
                self.after_cr = true;
            }
            if end == 0 {
                if self.dispatch() {
                    if self.event_type.is_empty() {
                        self.event_type.push_str("message");
                    }
                    return Ok(Some(Event {
                        event: &self.event_type,
                        data: &self.data,
                    }));
                }
                continue;
            }
            self.event_bytes += end + 1;
            if self.event_bytes > self.max_event_bytes {
                return Err(self.too_large());
            }
            // Decoded as the SSE standard decodes a stream: a byte sequence that is not UTF-8
            // reads as U+FFFD (a server that split a character loses it, not the call).
            let line = String::from_utf8_lossy(&self.buffer[line_start..line_start + end]);
            let (field, value) = match line.split_once(':') {
                Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
                None => (&*line, ""),
            };
            match field {
                // A comment.
                "" => {}
                "event" => {
                    self.event_type.clear();
                    self.event_type.push_str(value);
                }
                "data" => {
                    if self.has_data {
                        self.data.push('\n');
                    }
                    self.data.push_str(value);
                    self.has_data = true;
                }
                // Not a standard field: llama.cpp's server reports an error in the stream as
                // an `error: {…}` line (then ends it with `data: [DONE]`). Read as an `error`
                // event carrying it, so the error is not lost.
                "error" => {
                    self.event_type.clear();
                    self.event_type.push_str("error");
                    if self.has_data {
                        self.data.push('\n');
                    }
                    self.data.push_str(value);
                    self.has_data = true;
                }
                // `id` and `retry` steer reconnection, which a model call does not do; other
                // fields are ignored by the standard.
                _ => {}
            }
        }
    }

    fn too_large(&self) -> SseError {
        SseError::TooLarge {
            limit: self.max_event_bytes,
        }
    }

    /// Ends the event being built at a blank line: whether there is one to dispatch. A
    /// dispatched event's strings stay readable until the next call.
    fn dispatch(&mut self) -> bool {
        self.event_bytes = 0;
        if std::mem::take(&mut self.has_data) {
            self.dispatched = true;
            true
        } else {
            self.event_type.clear();
            self.data.clear();
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every event of `stream` fed in chunks of `size` bytes, as (type, data).
    fn events_in_chunks(stream: &[u8], size: usize) -> Result<Vec<(String, String)>, SseError> {
        let mut parser = SseParser::default();
        let mut events = Vec::new();
        for chunk in stream.chunks(size.max(1)) {
            parser.push(chunk);
            while let Some(event) = parser.next_event()? {
                events.push((event.event.to_owned(), event.data.to_owned()));
            }
        }
        Ok(events)
    }

    fn owned(events: &[(&str, &str)]) -> Vec<(String, String)> {
        events.iter().map(|(t, d)| ((*t).to_owned(), (*d).to_owned())).collect()
    }

    #[test]
    fn events_are_the_same_whatever_the_chunk_boundaries() {
        let stream = b"\xEF\xBB\xBF: comment\r\nevent: delta\r\ndata: {\"a\":1}\r\n\r\ndata: one\rdata:two\r\rdata\n\nid: 7\nretry: 10\ndata: \xC3\xA9\n\nevent: lost\ndata: never ended";
        let expected = owned(&[
            ("delta", "{\"a\":1}"),
            ("message", "one\ntwo"),
            ("message", ""),
            ("message", "é"),
        ]);
        for size in 1..=stream.len() {
            assert_eq!(events_in_chunks(stream, size), Ok(expected.clone()), "chunks of {size}");
        }
    }

    #[test]
    fn an_event_without_data_is_not_dispatched_and_its_type_does_not_carry_over() {
        let stream = b"event: ping\n\ndata: x\n\n";
        assert_eq!(events_in_chunks(stream, 64), Ok(owned(&[("message", "x")])));
    }

    #[test]
    fn one_leading_space_of_a_value_is_dropped_and_no_more() {
        let stream = b"data:  two spaces\ndata:none\n\n";
        assert_eq!(
            events_in_chunks(stream, 64),
            Ok(owned(&[("message", " two spaces\nnone")]))
        );
    }

    /// A line arriving in many small chunks is searched for its end once overall, from where
    /// the last search stopped, not again from its start at each chunk (which made a long line
    /// sent a byte at a time cost its length squared).
    #[test]
    fn an_unfinished_line_is_searched_only_in_its_new_bytes() {
        let mut parser = SseParser::default();
        parser.push(b"data: ");
        assert_eq!(parser.next_event(), Ok(None));
        for pushed in 1..=1000 {
            parser.push(b"x");
            assert_eq!(parser.next_event(), Ok(None));
            assert_eq!(parser.scanned, "data: ".len() + pushed, "searched up to the end, once");
        }
        parser.push(b"\n\n");
        let event = parser.next_event().expect("parses").expect("the event");
        assert_eq!(event.data, "x".repeat(1000));
        assert_eq!(parser.scanned, 0);
    }

    /// Decoded as the standard decodes a stream: a byte sequence that is not UTF-8 reads as
    /// U+FFFD, and the event is kept.
    #[test]
    fn a_line_that_is_not_utf8_reads_with_replacement_characters() {
        assert_eq!(
            events_in_chunks(b"data: a\xFFb\xF0\x9F\n\n", 3),
            Ok(owned(&[("message", "a\u{fffd}b\u{fffd}")]))
        );
    }

    #[test]
    fn an_endless_line_or_event_is_refused_past_the_bound() {
        let line = vec![b'x'; MAX_EVENT_BYTES + 1];
        let too_large = Err(SseError::TooLarge { limit: MAX_EVENT_BYTES });
        assert_eq!(events_in_chunks(&line, 1 << 20), too_large);
        let mut event = Vec::new();
        while event.len() <= MAX_EVENT_BYTES {
            event.extend_from_slice(b"data: 0123456789abcdef0123456789abcdef\n");
        }
        assert_eq!(events_in_chunks(&event, 1 << 20), too_large);
    }

    #[test]
    fn a_parser_built_with_a_bound_refuses_events_past_it_and_only_those() {
        let mut parser = SseParser::new(16);
        // 15 bytes of lines: under the bound.
        parser.push(
            b"data: 12345678

",
        );
        assert_eq!(
            parser
                .next_event()
                .map(|event| event.map(|event| event.data.to_owned())),
            Ok(Some("12345678".to_owned()))
        );
        // 17 bytes, before the line even ends.
        parser.push(b"data: 1234567890");
        assert_eq!(parser.next_event(), Ok(None));
        parser.push(b"x");
        assert_eq!(parser.next_event(), Err(SseError::TooLarge { limit: 16 }));
    }
}
