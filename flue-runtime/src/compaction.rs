//! Compaction: when the history nears the model's context window, the older part is
//! summarized by a model call and the model reads the summary in its place from then on (the
//! stored records stay; a `compaction` record says where the cut is).
//!
//! - **Threshold compaction** (per `use_model` options): before a model call whose estimated
//!   input exceeds the window minus `reserve_tokens` (default: a quarter of the window, at most
//!   20,000), keeping about `keep_recent_tokens` (default 8,000) of the newest history verbatim,
//!   summarized with `CompactionConfig::model` or the session's model. It needs the model's
//!   context window (`ModelProvider::context_window`); `Compaction::Disabled` turns it off.
//! - **Overflow recovery**: a call the provider refuses as a context overflow compacts and is
//!   retried once — also with threshold compaction off.
//! - After a compaction the system prompt's catalogs take a new baseline (the then-current
//!   skills and delegates), and the stream shows a `conversation-reset`.
//!
//! Estimates are characters / 4 (and a flat 1,000 tokens per image): coarse, but they only
//! decide when to compact; the provider's own count decides overflow.

use crate::provider::ModelMessage;

/// The summarization instructions.
pub(crate) const SUMMARY_INSTRUCTIONS: &str = "You compress a conversation between a user, an AI agent and its tools so the agent can continue it without the original messages. \
Write a concise summary that keeps: the user's goals and constraints, decisions made, facts learned (names, numbers, identifiers, file paths), \
the results of tool calls that still matter, and what remains to do. Leave out pleasantries and anything superseded. \
Write it as notes, in the language of the conversation.";

/// The estimated tokens of one image.
pub(crate) const IMAGE_TOKENS: u64 = 1_000;

/// The estimated tokens of one message.
pub(crate) fn estimate_message(message: &ModelMessage) -> u64 {
    let chars = match message {
        ModelMessage::User { content, images } => content.len() + images.len() * (IMAGE_TOKENS as usize * 4),
        ModelMessage::Assistant { text, tool_calls, .. } => {
            text.len()
                + tool_calls
                    .iter()
                    .map(|call| call.name.len() + call.arguments.len())
                    .sum::<usize>()
        }
        ModelMessage::Tool { content, name, .. } => content.len() + name.len(),
    };
    (chars as u64).div_ceil(4) + 4
}

/// The messages to summarize as one transcript.
pub(crate) fn transcript(messages: &[ModelMessage]) -> String {
    let mut out = String::new();
    for message in messages {
        match message {
            ModelMessage::User { content, images } => {
                out.push_str("User: ");
                out.push_str(content);
                if !images.is_empty() {
                    out.push_str(&format!(" [{} image(s)]", images.len()));
                }
            }
            ModelMessage::Assistant { text, tool_calls, .. } => {
                out.push_str("Agent: ");
                out.push_str(text);
                for call in tool_calls {
                    out.push_str(&format!("\n[called {} with {}]", call.name, call.arguments));
                }
            }
            ModelMessage::Tool {
                name,
                content,
                is_error,
                ..
            } => {
                out.push_str(&format!("Tool {name}{}: ", if *is_error { " (error)" } else { "" }));
                out.push_str(content);
            }
        }
        out.push_str("\n\n");
    }
    out
}
