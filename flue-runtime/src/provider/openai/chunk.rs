//! A typed view of one `chat.completion.chunk`.
//!
//! Streams carry hundreds of chunks per response, so the common shape is deserialized straight
//! into these structs, borrowing every string that needs no unescaping, instead of through a
//! `serde_json::Value` tree. A chunk the typed view cannot take (a field of an unexpected
//! type, or an `error`) is read as a `Value` and mapped leniently by [`ChunkView::from_value`]:
//! both routes give the decoder the same view.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;

pub(super) use crate::provider::text::Text;
use crate::provider::text::borrowed;

/// One chunk.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ChunkView<'a> {
    /// Of `choices`, the answer's: the first with index 0 (or none), the only one the decoder
    /// reads. The others are read too (a malformed one sends the chunk down the `Value` route)
    /// and dropped, so a chunk allocates no list of them.
    #[serde(default, borrow, rename = "choices")]
    pub(super) choice: AnswerChoice<'a>,
    #[serde(default)]
    pub(super) usage: Option<UsageView>,
    /// Present (not null) on an error chunk, which the `Value` route maps.
    #[serde(default)]
    error: Option<IgnoredAny>,
}

/// The answer's choice of a chunk's `choices` (see [`ChunkView::choice`]); `None` when the
/// chunk has no such choice, no `choices`, or `"choices": null`.
#[derive(Debug, Default, PartialEq)]
pub(super) struct AnswerChoice<'a>(pub(super) Option<ChoiceView<'a>>);

impl<'a> AnswerChoice<'a> {
    /// The answer's choice among `choices`, in order.
    fn of(choices: impl IntoIterator<Item = ChoiceView<'a>>) -> Self {
        Self(choices.into_iter().find(ChoiceView::is_answer))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for AnswerChoice<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Choices<'a>(std::marker::PhantomData<ChoiceView<'a>>);

        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Choices<'a> {
            type Value = AnswerChoice<'a>;

            fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                formatter.write_str("a list of choices or null")
            }

            fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(AnswerChoice(None))
            }

            fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(AnswerChoice(None))
            }

            fn visit_some<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
                deserializer.deserialize_seq(self)
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut answer = None;
                while let Some(choice) = seq.next_element::<ChoiceView<'a>>()? {
                    if answer.is_none() && choice.is_answer() {
                        answer = Some(choice);
                    }
                }
                Ok(AnswerChoice(answer))
            }
        }

        deserializer.deserialize_option(Choices(std::marker::PhantomData))
    }
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(super) struct ChoiceView<'a> {
    #[serde(default)]
    pub(super) index: Option<u64>,
    #[serde(default, borrow)]
    pub(super) delta: Option<DeltaView<'a>>,
    #[serde(default, borrow)]
    pub(super) finish_reason: Option<Text<'a>>,
}

impl ChoiceView<'_> {
    /// Whether it is the answer's choice: numbered 0, or not numbered.
    fn is_answer(&self) -> bool {
        self.index.unwrap_or(0) == 0
    }
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(super) struct DeltaView<'a> {
    #[serde(default, borrow)]
    pub(super) content: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub(super) reasoning: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub(super) reasoning_content: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub(super) tool_calls: Option<Vec<CallView<'a>>>,
    /// OpenRouter's reasoning details (rare: read as objects, not borrowed).
    #[serde(default)]
    pub(super) reasoning_details: Option<Vec<serde_json::Map<String, Value>>>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(super) struct CallView<'a> {
    #[serde(default)]
    pub(super) index: Option<u64>,
    #[serde(default, borrow)]
    pub(super) id: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub(super) function: Option<FunctionView<'a>>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(super) struct FunctionView<'a> {
    #[serde(default, borrow)]
    pub(super) name: Option<Text<'a>>,
    /// The arguments fragment (a server that sends a JSON value instead of its text is read
    /// through the `Value` route, which serializes it).
    #[serde(default, borrow)]
    pub(super) arguments: Option<Text<'a>>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(super) struct UsageView {
    #[serde(default)]
    pub(super) prompt_tokens: Option<u64>,
    #[serde(default)]
    pub(super) completion_tokens: Option<u64>,
    #[serde(default)]
    pub(super) prompt_tokens_details: Option<PromptDetails>,
    #[serde(default)]
    pub(super) completion_tokens_details: Option<CompletionDetails>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(super) struct PromptDetails {
    #[serde(default)]
    pub(super) cached_tokens: Option<u64>,
    #[serde(default)]
    pub(super) cache_write_tokens: Option<u64>,
}

#[derive(Debug, Default, PartialEq, Deserialize)]
pub(super) struct CompletionDetails {
    #[serde(default)]
    pub(super) reasoning_tokens: Option<u64>,
}

/// A delta's `content`: a string, or an array of parts (as some OpenAI-compatible servers
/// send), whose text parts join; no text at all is `None`.
fn content_text(content: Option<&Value>) -> Option<Text<'_>> {
    match content? {
        Value::String(text) => Some(borrowed(text)),
        Value::Array(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter(|part| part.get("type").is_none_or(|kind| kind == "text"))
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect();
            match texts.as_slice() {
                [] => None,
                [one] => Some(borrowed(one)),
                many => Some(Text(std::borrow::Cow::Owned(many.concat()))),
            }
        }
        _ => None,
    }
}

impl<'a> ChunkView<'a> {
    /// The typed view of `data`, or `None` when the chunk needs the `Value` route (an error
    /// chunk, an unexpected field type, or text that is not JSON at all).
    pub(super) fn parse(data: &'a str) -> Option<Self> {
        serde_json::from_str::<Self>(data)
            .ok()
            .filter(|chunk| chunk.error.is_none())
    }

    /// The view of a chunk read as a `Value`: fields of an unexpected type are absent (usage
    /// counts of another type count as zero), and arguments sent as a JSON value count as that
    /// value's text.
    pub(super) fn from_value(chunk: &'a Value) -> Self {
        let text = |value: Option<&'a Value>| value.and_then(Value::as_str).map(borrowed);
        let choices = chunk.get("choices").and_then(Value::as_array).map(|choices| {
            choices.iter().map(|choice| ChoiceView {
                index: choice.get("index").and_then(Value::as_u64),
                delta: choice.get("delta").filter(|d| d.is_object()).map(|delta| DeltaView {
                    content: content_text(delta.get("content")),
                    reasoning: text(delta.get("reasoning")),
                    reasoning_content: text(delta.get("reasoning_content")),
                    reasoning_details: delta.get("reasoning_details").and_then(Value::as_array).map(|details| {
                        details
                            .iter()
                            .filter_map(|detail| detail.as_object().cloned())
                            .collect()
                    }),
                    tool_calls: delta.get("tool_calls").and_then(Value::as_array).map(|calls| {
                        calls
                            .iter()
                            .map(|call| CallView {
                                index: call.get("index").and_then(Value::as_u64),
                                id: text(call.get("id")),
                                function: call.get("function").map(|function| FunctionView {
                                    name: text(function.get("name")),
                                    arguments: match function.get("arguments") {
                                        Some(Value::String(arguments)) => Some(borrowed(arguments)),
                                        Some(Value::Null) | None => None,
                                        Some(other) => Some(Text(Cow::Owned(other.to_string()))),
                                    },
                                }),
                            })
                            .collect()
                    }),
                }),
                finish_reason: text(choice.get("finish_reason")),
            })
        });
        let usage = chunk.get("usage").filter(|u| u.is_object()).map(|usage| {
            let number = |path: &[&str]| {
                path.iter()
                    .try_fold(usage, |value, key| value.get(*key))
                    .and_then(Value::as_u64)
            };
            UsageView {
                prompt_tokens: number(&["prompt_tokens"]),
                completion_tokens: number(&["completion_tokens"]),
                prompt_tokens_details: Some(PromptDetails {
                    cached_tokens: number(&["prompt_tokens_details", "cached_tokens"]),
                    cache_write_tokens: number(&["prompt_tokens_details", "cache_write_tokens"]),
                }),
                completion_tokens_details: Some(CompletionDetails {
                    reasoning_tokens: number(&["completion_tokens_details", "reasoning_tokens"]),
                }),
            }
        });
        Self {
            choice: AnswerChoice::of(choices.into_iter().flatten()),
            usage,
            error: None,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests assert by unwrapping

    use super::*;

    #[test]
    fn unescaped_strings_are_borrowed_and_escaped_ones_decoded() {
        let data = r#"{"choices":[{"index":0,"delta":{"content":"plain"}}]}"#;
        let chunk = ChunkView::parse(data).unwrap();
        let content = &chunk.choice.0.unwrap().delta.unwrap().content;
        assert!(matches!(content, Some(Text(Cow::Borrowed("plain")))));
        let data = r#"{"choices":[{"index":0,"delta":{"content":"a\nb \"q\" \u00e9"}}]}"#;
        let chunk = ChunkView::parse(data).unwrap();
        let content = &chunk.choice.0.unwrap().delta.unwrap().content;
        assert_eq!(content.as_ref().map(Text::as_str), Some("a\nb \"q\" é"));
    }

    #[test]
    fn odd_shapes_and_errors_take_the_value_route() {
        for data in [
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":{"a":1}}}]}}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":"12"}}"#,
            r#"{"choices":"none"}"#,
            r#"{"error":{"message":"overloaded"}}"#,
            "not json",
        ] {
            assert!(ChunkView::parse(data).is_none(), "{data}");
        }
        assert!(ChunkView::parse(r#"{"choices":[],"error":null}"#).is_some());
    }

    #[test]
    fn the_value_route_gives_the_typed_view_of_the_same_chunk() {
        let data = r#"{"choices":[{"index":0,"delta":{"content":"hi","reasoning_content":"r","tool_calls":[{"index":1,"id":"call_1","function":{"name":"add","arguments":"{\"a\":"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":1},"completion_tokens_details":{"reasoning_tokens":2}}}"#;
        let typed = ChunkView::parse(data).unwrap();
        let value: Value = serde_json::from_str(data).unwrap();
        let lenient = ChunkView::from_value(&value);
        assert_eq!(typed.choice, lenient.choice);
        assert_eq!(typed.usage, lenient.usage);
    }

    #[test]
    fn the_answer_is_the_first_choice_numbered_zero_and_both_routes_agree() {
        let finish = |chunk: &ChunkView<'_>| {
            chunk
                .choice
                .0
                .as_ref()
                .map(|choice| choice.finish_reason.as_ref().map(|reason| reason.as_str().to_owned()))
        };
        for (data, expected) in [
            (
                r#"{"choices":[{"index":1,"finish_reason":"a"},{"index":0,"finish_reason":"b"}]}"#,
                Some("b"),
            ),
            (
                r#"{"choices":[{"finish_reason":"a"},{"index":0,"finish_reason":"b"}]}"#,
                Some("a"),
            ),
            (r#"{"choices":[{"index":2,"finish_reason":"a"}]}"#, None),
            (r#"{"choices":[]}"#, None),
            (r#"{"choices":null}"#, None),
            (r#"{}"#, None),
        ] {
            let typed = ChunkView::parse(data).unwrap();
            let value: Value = serde_json::from_str(data).unwrap();
            let lenient = ChunkView::from_value(&value);
            assert_eq!(finish(&typed), expected.map(|reason| Some(reason.to_owned())), "{data}");
            assert_eq!(typed.choice, lenient.choice, "{data}");
        }
        // A malformed choice other than the answer still sends the chunk down the `Value`
        // route, which reads the answer all the same.
        let data = r#"{"choices":[{"index":0,"finish_reason":"stop"},{"index":"one"}]}"#;
        assert!(ChunkView::parse(data).is_none());
        let value: Value = serde_json::from_str(data).unwrap();
        let lenient = ChunkView::from_value(&value);
        assert_eq!(finish(&lenient), Some(Some("stop".to_owned())));
    }

    #[test]
    fn arguments_sent_as_a_json_value_count_as_its_text() {
        let value: Value =
            serde_json::from_str(r#"{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":{"a":1}}}]}}]}"#)
                .unwrap();
        let chunk = ChunkView::from_value(&value);
        let delta = chunk.choice.0.unwrap().delta.unwrap();
        let call = &delta.tool_calls.as_ref().unwrap()[0];
        let arguments = call.function.as_ref().unwrap().arguments.as_ref().unwrap();
        assert_eq!(arguments.as_str(), r#"{"a":1}"#);
    }
}
