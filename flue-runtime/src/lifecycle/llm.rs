//! The provider-format request messages `prefilter_llm_history` sees and returns: the
//! OpenAI Chat Completions shape (the lingua franca of the reference), converted from the
//! runtime's model request and back. The system prompt is the first message (`role: system`),
//! so a hook can edit it too; whatever the chain returns is exactly what is dispatched.

use flue_core::lifecycle::LlmMessage;
use serde_json::{Value, json};

use crate::provider::{ModelImage, ModelMessage};

/// The request as provider-format messages.
pub(crate) fn to_llm(system: Option<&str>, messages: &[ModelMessage]) -> Vec<LlmMessage> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(system) = system {
        out.push(LlmMessage {
            role: "system".to_owned(),
            content: json!(system),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        });
    }
    for message in messages {
        out.push(match message {
            ModelMessage::User { content, images } if images.is_empty() => LlmMessage {
                role: "user".to_owned(),
                content: json!(content),
                tool_calls: None,
                tool_call_id: None,
                name: None,
            },
            ModelMessage::User { content, images } => {
                let mut parts = vec![json!({"type": "text", "text": content})];
                parts.extend(images.iter().map(|image| {
                    json!({
                        "type": "image_url",
                        "image_url": {"url": format!("data:{};base64,{}", image.media_type, image.data)},
                    })
                }));
                LlmMessage {
                    role: "user".to_owned(),
                    content: Value::Array(parts),
                    tool_calls: None,
                    tool_call_id: None,
                    name: None,
                }
            }
            ModelMessage::Assistant { text, tool_calls, .. } => LlmMessage {
                role: "assistant".to_owned(),
                content: if text.is_empty() && !tool_calls.is_empty() {
                    Value::Null
                } else {
                    json!(text)
                },
                tool_calls: (!tool_calls.is_empty()).then(|| {
                    tool_calls
                        .iter()
                        .map(|call| {
                            json!({
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments},
                            })
                        })
                        .collect()
                }),
                tool_call_id: None,
                name: None,
            },
            ModelMessage::Tool {
                tool_call_id,
                name,
                content,
                ..
            } => LlmMessage {
                role: "tool".to_owned(),
                content: json!(content),
                tool_calls: None,
                tool_call_id: Some(tool_call_id.clone()),
                name: Some(name.clone()),
            },
        });
    }
    out
}

/// The text of a message's content: a string, or its text parts joined by newlines.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// The images of a user message's content parts (`data:` URLs only).
fn images_of(content: &Value) -> Vec<ModelImage> {
    let Value::Array(parts) = content else {
        return Vec::new();
    };
    parts
        .iter()
        .filter_map(|part| part.pointer("/image_url/url").and_then(Value::as_str))
        .filter_map(|url| {
            let (media_type, data) = url.strip_prefix("data:")?.split_once(";base64,")?;
            Some(ModelImage {
                media_type: media_type.to_owned(),
                data: data.into(),
            })
        })
        .collect()
}

/// The request back from provider-format messages: `system` messages make the system prompt
/// (joined in order); a tool message keeps the error flag of the stored result it answers.
pub(crate) fn from_llm(messages: Vec<LlmMessage>, original: &[ModelMessage]) -> (Option<String>, Vec<ModelMessage>) {
    let mut system: Option<String> = None;
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        match message.role.as_str() {
            "system" | "developer" => {
                let text = text_of(&message.content);
                match &mut system {
                    Some(system) => {
                        system.push_str("\n\n");
                        system.push_str(&text);
                    }
                    None => system = Some(text),
                }
            }
            "assistant" => {
                let tool_calls = message
                    .tool_calls
                    .as_ref()
                    .map(crate::session::tool_calls_from)
                    .unwrap_or_default();
                let text = text_of(&message.content);
                // A step the hook kept as it was keeps its signed reasoning (it authenticates
                // that step only, so a changed step goes without).
                let reasoning = original
                    .iter()
                    .find_map(|stored| match stored {
                        ModelMessage::Assistant {
                            text: stored_text,
                            tool_calls: stored_calls,
                            reasoning,
                        } if !reasoning.is_empty() && *stored_text == text && *stored_calls == tool_calls => {
                            Some(reasoning.clone())
                        }
                        _ => None,
                    })
                    .unwrap_or_default();
                out.push(ModelMessage::Assistant {
                    text,
                    tool_calls,
                    reasoning,
                });
            }
            "tool" => {
                let tool_call_id = message.tool_call_id.unwrap_or_default();
                let is_error = original.iter().any(|stored| {
                    matches!(stored, ModelMessage::Tool { tool_call_id: id, is_error: true, .. } if *id == tool_call_id)
                });
                out.push(ModelMessage::Tool {
                    name: message.name.unwrap_or_default(),
                    content: text_of(&message.content),
                    tool_call_id,
                    is_error,
                });
            }
            _ => out.push(ModelMessage::User {
                content: text_of(&message.content),
                images: images_of(&message.content),
            }),
        }
    }
    (system, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::ModelToolCall;

    #[test]
    fn a_request_round_trips_through_the_provider_format() {
        let messages = vec![
            ModelMessage::User {
                content: "look".into(),
                images: vec![ModelImage {
                    media_type: "image/png".into(),
                    data: "AAAA".into(),
                }],
            },
            ModelMessage::Assistant {
                text: String::new(),
                tool_calls: vec![ModelToolCall {
                    id: "call_1".into(),
                    name: "lookup".into(),
                    arguments: "{\"q\":1}".into(),
                }],
                reasoning: vec![crate::provider::ReasoningBlock::Thinking {
                    thinking: "look it up".into(),
                    signature: "sig".into(),
                    at: None,
                }],
            },
            ModelMessage::Tool {
                tool_call_id: "call_1".into(),
                name: "lookup".into(),
                content: "no".into(),
                is_error: true,
            },
            ModelMessage::Assistant {
                text: "done".into(),
                tool_calls: Vec::new(),
                reasoning: Vec::new(),
            },
        ];
        let llm = to_llm(Some("be brief"), &messages);
        assert_eq!(llm[0].role, "system");
        assert_eq!(llm[2].content, Value::Null, "a call-only step has null content");
        let (system, back) = from_llm(llm, &messages);
        assert_eq!(system.as_deref(), Some("be brief"));
        assert_eq!(back, messages, "an unchanged step keeps its signed reasoning");
    }

    #[test]
    fn a_step_the_hook_changed_loses_its_signed_reasoning() {
        let step = |text: &str| ModelMessage::Assistant {
            text: text.into(),
            tool_calls: Vec::new(),
            reasoning: vec![crate::provider::ReasoningBlock::Redacted {
                data: "opaque".into(),
                at: None,
            }],
        };
        let mut llm = to_llm(None, &[step("original")]);
        llm[0].content = json!("rewritten");
        let (_, back) = from_llm(llm, &[step("original")]);
        assert_eq!(
            back,
            [ModelMessage::Assistant {
                text: "rewritten".into(),
                tool_calls: Vec::new(),
                reasoning: Vec::new(),
            }]
        );
    }

    #[test]
    fn system_messages_anywhere_join_the_system_prompt() {
        let llm = vec![
            LlmMessage {
                role: "system".into(),
                content: json!("one"),
                tool_calls: None,
                tool_call_id: None,
                name: None,
            },
            LlmMessage {
                role: "user".into(),
                content: json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
                tool_calls: None,
                tool_call_id: None,
                name: None,
            },
            LlmMessage {
                role: "system".into(),
                content: json!("two"),
                tool_calls: None,
                tool_call_id: None,
                name: None,
            },
        ];
        let (system, messages) = from_llm(llm, &[]);
        assert_eq!(system.as_deref(), Some("one\n\ntwo"));
        assert_eq!(messages, vec![ModelMessage::user("a\nb")]);
    }
}
