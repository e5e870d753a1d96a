//! Tool-call observation while a response streams: `tool_call_started` fires exactly once per
//! call, before the tool runs —
//!
//! - for a tool without a progress argument, when the call appears in the stream;
//! - for a tool with one, as soon as that argument's string value has streamed whole (the
//!   partial arguments are scanned while they are at most [`SCAN_LIMIT`] bytes), with that
//!   value as its progress;
//! - otherwise (the argument never completed mid-stream), once the response ended, with the
//!   argument's value from the complete arguments when it is a string there.

use std::collections::HashMap;

use flue_core::Tool;

use crate::provider::ModelResponse;

/// Partial arguments longer than this are not scanned for the progress argument.
pub(crate) const SCAN_LIMIT: usize = 8192;

/// A `tool_call_started` to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Started {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) progress: Option<String>,
    /// The argument text streamed so far (complete when published after the response).
    pub(crate) arguments: String,
}

struct Call {
    id: String,
    name: String,
    arguments: String,
    /// The tool's progress argument, when it has one.
    progress_argument: Option<String>,
    fired: bool,
}

/// The calls of one streamed response.
pub(crate) struct ToolCallObserver {
    /// Tool name → its progress argument.
    progress_arguments: HashMap<String, String>,
    /// In the order the stream showed them: a provider that numbers its calls sparsely (or
    /// absurdly) costs a call each, never a slot per number.
    calls: Vec<Call>,
    /// Where each stream index's call (a provider's own numbering: not necessarily dense) is
    /// in `calls`: a fragment of arguments finds its call at once, however many calls the
    /// response opened.
    positions: HashMap<usize, usize>,
}

impl ToolCallObserver {
    /// An observer for a response that may call `tools`.
    pub(crate) fn new(tools: &[Tool]) -> Self {
        Self {
            progress_arguments: tools
                .iter()
                .filter_map(|tool| {
                    let argument = tool.definition().progress_argument.as_deref()?;
                    Some((tool.name().to_owned(), argument.to_owned()))
                })
                .collect(),
            calls: Vec::new(),
            positions: HashMap::new(),
        }
    }

    fn call(&self, index: usize) -> Option<&Call> {
        self.positions.get(&index).map(|&at| &self.calls[at])
    }

    fn call_mut(&mut self, index: usize) -> Option<&mut Call> {
        self.positions.get(&index).map(|&at| &mut self.calls[at])
    }

    /// A call appeared at stream `index`.
    pub(crate) fn started(&mut self, index: usize, id: &str, name: &str) -> Option<Started> {
        let progress_argument = self.progress_arguments.get(name).cloned();
        if self.call(index).is_none() {
            self.positions.insert(index, self.calls.len());
            self.calls.push(Call {
                id: String::new(),
                name: String::new(),
                arguments: String::new(),
                progress_argument: None,
                fired: false,
            });
        }
        let call = self.call_mut(index)?;
        if call.fired || !call.id.is_empty() {
            return None;
        }
        call.id = id.to_owned();
        call.name = name.to_owned();
        call.progress_argument = progress_argument;
        if call.progress_argument.is_none() {
            call.fired = true;
            return Some(Started {
                id: call.id.clone(),
                name: call.name.clone(),
                progress: None,
                arguments: call.arguments.clone(),
            });
        }
        Self::check(call)
    }

    /// More argument text for the call at stream `index`.
    pub(crate) fn arguments(&mut self, index: usize, delta: &str) -> Option<Started> {
        let call = self.call_mut(index)?;
        // Kept only while something reads them: until the call is announced (its start carries
        // what came before it), and while they are scanned for its progress argument. The
        // provider keeps the whole arguments; a second copy of a large one would double it.
        let started = !call.id.is_empty();
        if call.fired || (started && call.arguments.len() > SCAN_LIMIT) {
            return None;
        }
        call.arguments.push_str(delta);
        // `None` for a call not announced yet that has no progress argument.
        Self::check(call)
    }

    /// The id of the call at stream `index`; empty while the stream has not named it.
    pub(crate) fn id_of(&self, index: usize) -> &str {
        self.call(index).map_or("", |call| call.id.as_str())
    }

    /// The tool the call at stream `index` calls; empty while the stream has not named it.
    pub(crate) fn name_of(&self, index: usize) -> &str {
        self.call(index).map_or("", |call| call.name.as_str())
    }

    fn check(call: &mut Call) -> Option<Started> {
        if call.arguments.len() > SCAN_LIMIT {
            return None;
        }
        let argument = call.progress_argument.as_deref()?;
        let progress = completed_string(&call.arguments, argument)?;
        call.fired = true;
        Some(Started {
            id: call.id.clone(),
            name: call.name.clone(),
            progress: Some(progress),
            arguments: call.arguments.clone(),
        })
    }

    /// The calls announced so far (id, tool name), in stream order: those a failed response
    /// leaves announced but never run.
    pub(crate) fn announced(&self) -> impl Iterator<Item = (&str, &str)> {
        self.calls
            .iter()
            .filter(|call| call.fired)
            .map(|call| (call.id.as_str(), call.name.as_str()))
    }

    /// The response ended: every call not announced yet, in call order (calls the stream
    /// never showed included), with progress from its complete arguments.
    pub(crate) fn finish(&mut self, response: &ModelResponse) -> Vec<Started> {
        let mut started = Vec::new();
        // The streamed calls by id (the first of an id), looked up once each.
        let by_id: HashMap<String, usize> = self
            .calls
            .iter()
            .enumerate()
            .rev()
            .map(|(at, call)| (call.id.clone(), at))
            .collect();
        for tool_call in &response.tool_calls {
            let streamed = by_id.get(&tool_call.id).map(|&at| &mut self.calls[at]);
            if streamed.as_ref().is_some_and(|call| call.fired) {
                continue;
            }
            if let Some(call) = streamed {
                call.fired = true;
            }
            let progress = self.progress_arguments.get(&tool_call.name).and_then(|argument| {
                let arguments: serde_json::Value = serde_json::from_str(&tool_call.arguments).ok()?;
                arguments.get(argument)?.as_str().map(str::to_owned)
            });
            started.push(Started {
                id: tool_call.id.clone(),
                name: tool_call.name.clone(),
                progress,
                arguments: tool_call.arguments.clone(),
            });
        }
        started
    }
}

/// The value of the top-level string member `key` of the partial JSON object `text`, once its
/// closing quote has streamed; `None` while it has not (or it is not a string).
fn completed_string(text: &str, key: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut at = skip_whitespace(bytes, 0);
    if bytes.get(at) != Some(&b'{') {
        return None;
    }
    at += 1;
    loop {
        at = skip_whitespace(bytes, at);
        match bytes.get(at)? {
            b',' => {
                at += 1;
                continue;
            }
            b'"' => {}
            _ => return None,
        }
        let key_end = string_end(bytes, at)?;
        let name: String = serde_json::from_str(&text[at..=key_end]).ok()?;
        at = skip_whitespace(bytes, key_end + 1);
        if bytes.get(at) != Some(&b':') {
            return None;
        }
        at = skip_whitespace(bytes, at + 1);
        if name == key {
            if bytes.get(at) != Some(&b'"') {
                // Not (yet) a string: not ready.
                return None;
            }
            let end = string_end(bytes, at)?;
            return serde_json::from_str(&text[at..=end]).ok();
        }
        at = value_end(bytes, at)?;
    }
}

fn skip_whitespace(bytes: &[u8], mut at: usize) -> usize {
    while bytes.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    at
}

/// The index of the closing quote of the string opening at `start`.
fn string_end(bytes: &[u8], start: usize) -> Option<usize> {
    let mut at = start + 1;
    loop {
        match bytes.get(at)? {
            b'\\' => at += 2,
            b'"' => return Some(at),
            _ => at += 1,
        }
    }
}

/// The index just past the complete value starting at `start`; `None` when it has not fully
/// streamed.
fn value_end(bytes: &[u8], start: usize) -> Option<usize> {
    match bytes.get(start)? {
        b'"' => string_end(bytes, start).map(|end| end + 1),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut at = start;
            loop {
                match bytes.get(at)? {
                    b'"' => at = string_end(bytes, at)?,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(at + 1);
                        }
                    }
                    _ => {}
                }
                at += 1;
            }
        }
        _ => {
            // A number or literal ends at a delimiter that has streamed.
            let mut at = start;
            while let Some(byte) = bytes.get(at) {
                if matches!(byte, b',' | b'}' | b']') || byte.is_ascii_whitespace() {
                    return Some(at);
                }
                at += 1;
            }
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::{ModelToolCall, StopReason};

    #[derive(serde::Deserialize, schemars::JsonSchema)]
    struct LookupArgs {
        #[allow(dead_code)]
        order: String,
    }

    fn tools() -> Vec<Tool> {
        vec![
            Tool::new("lookup")
                .description("Look up.")
                .progress_argument("order")
                .run(|_ctx, _: LookupArgs| async { Ok::<_, flue_core::ToolError>("ok") }),
            Tool::new("plain")
                .description("Plain.")
                .run(|_ctx, _: serde_json::Map<String, serde_json::Value>| async {
                    Ok::<_, flue_core::ToolError>("ok")
                }),
        ]
    }

    fn response(calls: &[(&str, &str, &str)]) -> ModelResponse {
        ModelResponse {
            text: String::new(),
            reasoning: String::new(),
            tool_calls: calls
                .iter()
                .map(|(id, name, arguments)| ModelToolCall {
                    id: (*id).to_owned(),
                    name: (*name).to_owned(),
                    arguments: (*arguments).to_owned(),
                })
                .collect(),
            stop_reason: StopReason::ToolUse,
            usage: Default::default(),
            reasoning_blocks: Vec::new(),
        }
    }

    #[test]
    fn a_tool_without_a_progress_argument_starts_when_its_call_appears() {
        let mut observer = ToolCallObserver::new(&tools());
        let started = observer.started(0, "c1", "plain");
        assert_eq!(
            started,
            Some(Started {
                id: "c1".into(),
                name: "plain".into(),
                progress: None,
                arguments: String::new(),
            })
        );
        assert_eq!(observer.arguments(0, "{\"x\":1}"), None);
        assert!(
            observer.finish(&response(&[("c1", "plain", "{\"x\":1}")])).is_empty(),
            "once"
        );
    }

    /// The observer keeps a call's arguments only while it reads them: not once the call is
    /// announced, nor past the scan's limit. (Before, it kept a second copy of every call's
    /// arguments for the whole stream, beside the provider's.)
    #[test]
    fn arguments_are_kept_only_while_the_observer_reads_them() {
        let mut observer = ToolCallObserver::new(&tools());
        assert!(observer.started(0, "c1", "plain").is_some());
        let chunk = "y".repeat(1024);
        for _ in 0..64 {
            assert_eq!(observer.arguments(0, &chunk), None);
        }
        assert_eq!(observer.calls[0].arguments, "", "not kept once announced");
        // A call scanned for its progress argument stops being kept past the scan's limit.
        assert_eq!(observer.started(1, "c2", "lookup"), None);
        assert_eq!(observer.arguments(1, "{\"note\": \""), None);
        for _ in 0..64 {
            assert_eq!(observer.arguments(1, &chunk), None);
        }
        assert!(observer.calls[1].arguments.len() <= SCAN_LIMIT + chunk.len());
    }

    /// A provider of the registry (a user's) may number its calls as it likes: a huge or
    /// sparse index is one call, found again by its number, never a slot per number (which
    /// allocated without bound, or wrapped at `usize::MAX` and panicked).
    #[test]
    fn a_sparse_or_huge_stream_index_is_one_call_found_by_its_number() {
        let mut observer = ToolCallObserver::new(&tools());
        assert!(observer.started(usize::MAX, "c1", "plain").is_some());
        assert_eq!(
            observer.started(1 << 40, "c2", "lookup"),
            None,
            "waits for its progress"
        );
        assert_eq!(
            (observer.id_of(usize::MAX), observer.name_of(1 << 40)),
            ("c1", "lookup")
        );
        let started = observer.arguments(1 << 40, r#"{"order": "A-1"}"#).expect("started");
        assert_eq!((started.id.as_str(), started.progress.as_deref()), ("c2", Some("A-1")));
        assert_eq!(observer.arguments(7, "{}"), None, "no call at 7");
        assert_eq!(observer.id_of(7), "");
        let announced: Vec<_> = observer.announced().collect();
        assert_eq!(announced, [("c1", "plain"), ("c2", "lookup")]);
    }

    #[test]
    fn a_progress_argument_starts_the_call_once_its_string_has_streamed_whole_at_any_split() {
        let arguments = r#"{"note": {"a": [1, "}"]}, "count": 12, "order": "A-10\"01", "rest": "…"}"#;
        // The index just past the value's closing quote.
        let value_end = arguments.find(r#"01""#).map(|at| at + 3).unwrap_or_default();
        for split in (1..=arguments.len()).filter(|split| arguments.is_char_boundary(*split)) {
            let mut observer = ToolCallObserver::new(&tools());
            assert_eq!(observer.started(0, "c1", "lookup"), None, "not before the value");
            let first = observer.arguments(0, &arguments[..split]);
            let second = observer.arguments(0, &arguments[split..]);
            let expected = Some("A-10\"01".to_owned());
            if split >= value_end {
                assert_eq!(
                    first.map(|started| started.progress),
                    Some(expected),
                    "split at {split}"
                );
                assert_eq!(second, None, "once, split at {split}");
            } else {
                assert_eq!(first, None, "not before the closing quote, split at {split}");
                assert_eq!(
                    second.map(|started| started.progress),
                    Some(expected),
                    "split at {split}"
                );
            }
            assert!(observer.finish(&response(&[("c1", "lookup", arguments)])).is_empty());
        }
        // One character at a time: it starts with the closing quote's, and only then.
        let mut observer = ToolCallObserver::new(&tools());
        assert_eq!(observer.started(0, "c1", "lookup"), None);
        let mut fired_at = Vec::new();
        for (at, character) in arguments.char_indices() {
            if let Some(started) = observer.arguments(0, character.encode_utf8(&mut [0; 4])) {
                assert_eq!(started.progress.as_deref(), Some("A-10\"01"));
                fired_at.push(at + character.len_utf8());
            }
        }
        assert_eq!(fired_at, [value_end]);
    }

    #[test]
    fn a_missing_or_non_string_progress_argument_starts_after_the_response() {
        let mut observer = ToolCallObserver::new(&tools());
        observer.started(0, "c1", "lookup");
        observer.started(1, "c2", "lookup");
        assert_eq!(observer.arguments(0, r#"{"other": "x"}"#), None);
        assert_eq!(observer.arguments(1, r#"{"order": 7}"#), None);
        let started = observer.finish(&response(&[
            ("c1", "lookup", r#"{"other": "x"}"#),
            ("c2", "lookup", r#"{"order": 7}"#),
        ]));
        assert_eq!(started.len(), 2);
        assert!(started.iter().all(|started| started.progress.is_none()));
    }

    #[test]
    fn arguments_past_the_scan_limit_start_after_the_response_with_the_value() {
        let mut observer = ToolCallObserver::new(&tools());
        observer.started(0, "c1", "lookup");
        let padding = "x".repeat(SCAN_LIMIT);
        let arguments = format!(r#"{{"pad": "{padding}", "order": "A-1"}}"#);
        assert_eq!(observer.arguments(0, &arguments), None);
        let started = observer.finish(&response(&[("c1", "lookup", &arguments)]));
        assert_eq!(started[0].progress.as_deref(), Some("A-1"));
    }

    #[test]
    fn calls_the_stream_never_showed_start_at_the_end_in_call_order() {
        let mut observer = ToolCallObserver::new(&tools());
        let started = observer.finish(&response(&[
            ("c1", "plain", "{}"),
            ("c2", "lookup", r#"{"order":"B"}"#),
        ]));
        let ids: Vec<(&str, Option<&str>)> = started
            .iter()
            .map(|started| (started.id.as_str(), started.progress.as_deref()))
            .collect();
        assert_eq!(ids, [("c1", None), ("c2", Some("B"))]);
    }
}
