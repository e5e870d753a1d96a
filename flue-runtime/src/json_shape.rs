//! JSON from outside (a request body, a provider's stream event, a model's tool-call
//! arguments), sized before it is parsed.
//!
//! Parsed, JSON costs far more memory than its text: 16 MiB of small objects (`[{"k":0},…]`)
//! take about 1.4 GiB as a `serde_json::Value`, so a few such texts at once could exhaust a
//! server's memory. [`JsonShape::of`] counts a text's brackets and commas outside its strings
//! (fast: it skips from one quote or bracket to the next), and a text past
//! [`MAX_JSON_CONTAINERS`] or [`MAX_JSON_VALUES`] is refused before any parse.

/// The most objects and arrays one JSON text from outside may hold: an HTTP request body
/// (past it, 413 `request_too_large`), one event a provider streams, or the tool-call
/// arguments of one model response, all its calls together (past it, the model call fails as
/// an invalid response, not retried). Stricter than the reference, which sets no limit.
/// At these limits a text parses to at most about 90 MiB (objects of a dozen members are the
/// costliest shape), plus its strings; a message, its attachments and an `initialData` of ten
/// thousand records of a few dozen fields stay below them.
pub const MAX_JSON_CONTAINERS: usize = 100_000;

/// The most values (objects, arrays, strings, numbers, booleans and nulls) one JSON text from
/// outside may hold; see [`MAX_JSON_CONTAINERS`].
pub const MAX_JSON_VALUES: usize = 500_000;

/// How much a JSON text holds, counted without parsing it: what its parse would allocate.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct JsonShape {
    /// Objects and arrays.
    pub(crate) containers: usize,
    /// No fewer than the values it holds (each value but the first in a container follows a
    /// comma): commas and containers, plus one.
    pub(crate) values: usize,
}

impl JsonShape {
    /// Counts the brackets and commas outside strings. Not a validation: text that is not JSON
    /// is counted too, and its parse then fails.
    pub(crate) fn of(text: &[u8]) -> Self {
        let (mut containers, mut commas, mut at) = (0usize, 0usize, 0);
        while let Some(found) = memchr::memchr3(b'"', b'{', b'[', &text[at..]) {
            // The commas before it, outside strings (`at` is outside one).
            commas += memchr::memchr_iter(b',', &text[at..at + found]).count();
            at += found + 1;
            if text[at - 1] != b'"' {
                containers += 1;
                continue;
            }
            // Inside a string: to its closing quote, past escapes (a `\"` does not close it).
            loop {
                match memchr::memchr2(b'"', b'\\', &text[at..]) {
                    Some(next) if text[at + next] == b'\\' => at += next + 2,
                    Some(next) => {
                        at += next + 1;
                        break;
                    }
                    None => {
                        at = text.len();
                        break;
                    }
                }
                at = at.min(text.len());
            }
        }
        commas += memchr::memchr_iter(b',', &text[at.min(text.len())..]).count();
        Self {
            containers,
            values: commas + containers + 1,
        }
    }

    /// The shapes of `texts` added up: what parsing all of them would hold at once.
    pub(crate) fn of_all<'a>(texts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        texts.into_iter().map(Self::of).fold(
            Self {
                containers: 0,
                values: 0,
            },
            |all, shape| Self {
                containers: all.containers + shape.containers,
                values: all.values + shape.values,
            },
        )
    }

    /// Whether it holds at most [`MAX_JSON_CONTAINERS`] objects and arrays and at most
    /// [`MAX_JSON_VALUES`] values.
    pub(crate) fn is_within_limits(&self) -> bool {
        self.containers <= MAX_JSON_CONTAINERS && self.values <= MAX_JSON_VALUES
    }

    /// Whether `texts` together are within the limits ([`Self::is_within_limits`]), counted
    /// only when they are long enough to be past them: each bracket and comma is a byte, and
    /// each text counts one value more, so texts whose bytes and number together are at most
    /// [`MAX_JSON_CONTAINERS`] hold at most that many containers and values (the hot path: a
    /// provider's stream events are small).
    pub(crate) fn fits<'a>(texts: impl IntoIterator<Item = &'a [u8]> + Clone) -> bool {
        const { assert!(MAX_JSON_CONTAINERS < MAX_JSON_VALUES) };
        let (count, bytes) = texts
            .clone()
            .into_iter()
            .fold((0usize, 0usize), |(count, bytes), text| (count + 1, bytes + text.len()));
        count + bytes <= MAX_JSON_CONTAINERS || Self::of_all(texts).is_within_limits()
    }
}

/// What a node of a parsed JSON value, or a kept item, costs beyond its text (an entry of a
/// map, a slot of a vector), roughly.
pub(crate) const NODE_WEIGHT: usize = 48;

/// Roughly the bytes `value` holds once parsed.
pub(crate) fn parsed_weight(value: &serde_json::Value) -> usize {
    use serde_json::Value;
    NODE_WEIGHT
        + match value {
            Value::String(text) => text.len(),
            Value::Array(items) => items.iter().map(parsed_weight).sum(),
            Value::Object(fields) => fields
                .iter()
                .map(|(key, value)| NODE_WEIGHT + key.len() + parsed_weight(value))
                .sum(),
            Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        }
}

/// The bytes of `value` as JSON, counted without keeping them.
pub(crate) fn json_bytes(value: &impl serde::Serialize) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Written to a counter: a map of values (a schema, initial data) always serializes.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// `text` with each escape of a lone surrogate replaced by `\ufffd`; `None` when it has none.
pub(crate) fn without_lone_surrogates(text: &str) -> Option<String> {
    let escaped = |at: usize| -> Option<u16> {
        let hex = text.get(at..at + 6)?.strip_prefix("\\u")?;
        u16::from_str_radix(hex, 16).ok()
    };
    let (mut out, mut copied, mut at, mut replaced) = (String::new(), 0, 0, false);
    let bytes = text.as_bytes();
    while at < bytes.len() {
        if bytes[at] != b'\\' {
            at += 1;
            continue;
        }
        match escaped(at) {
            // A pair: one character.
            Some(0xD800..=0xDBFF) if matches!(escaped(at + 6), Some(0xDC00..=0xDFFF)) => at += 12,
            Some(0xD800..=0xDFFF) => {
                out.push_str(&text[copied..at]);
                out.push_str("\\ufffd");
                at += 6;
                copied = at;
                replaced = true;
            }
            // Any other escape: its backslash and the character it escapes.
            _ => at += 2,
        }
    }
    replaced.then(|| {
        out.push_str(&text[copied..]);
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted<'a>(texts: impl IntoIterator<Item = &'a [u8]>) -> bool {
        JsonShape::of_all(texts).is_within_limits()
    }

    /// `fits` answers as counting would, on both sides of the length under which it does not
    /// count: the densest texts (every byte a bracket, or a value and a comma) included, and
    /// texts whose lengths only add up past it.
    #[test]
    fn fits_answers_as_counting_would_whatever_the_length() {
        let brackets = |count: usize| vec![b'['; count];
        let values = |count: usize| {
            let mut text = b"[".to_vec();
            text.extend(std::iter::repeat_n(b"0,".as_slice(), count - 1).flatten());
            text.extend_from_slice(b"0]");
            text
        };
        let cases = [
            brackets(MAX_JSON_CONTAINERS),
            brackets(MAX_JSON_CONTAINERS + 1),
            values(MAX_JSON_VALUES - 1),
            values(MAX_JSON_VALUES),
            values(10),
            br#"{"a":"[[[[,,,,"}"#.to_vec(),
        ];
        for text in &cases {
            assert_eq!(
                JsonShape::fits([text.as_slice()]),
                counted([text.as_slice()]),
                "{} bytes",
                text.len()
            );
        }
        assert!(JsonShape::fits([brackets(MAX_JSON_CONTAINERS).as_slice()]));
        assert!(!JsonShape::fits([brackets(MAX_JSON_CONTAINERS + 1).as_slice()]));
        assert!(!JsonShape::fits([values(MAX_JSON_VALUES).as_slice()]));
        let half = brackets(MAX_JSON_CONTAINERS / 2 + 1);
        assert!(!JsonShape::fits([half.as_slice(), half.as_slice()]), "added up");
        assert!(JsonShape::fits([half.as_slice()]));
        assert!(JsonShape::fits(std::iter::empty::<&[u8]>()));
        // Many empty texts are a value each: counted, not waved through by their bytes.
        let empties = vec![b"".as_slice(); MAX_JSON_VALUES + 1];
        assert_eq!(
            JsonShape::fits(empties.iter().copied()),
            counted(empties.iter().copied())
        );
        assert!(!JsonShape::fits(empties.iter().copied()));
    }
}
