//! Tool names and call ids as a provider accepts them in a request's history.
//!
//! A conversation's history can hold names and ids that a provider refuses:
//! - a call to a tool the model made up, whose name no tool has (GPT-4o now and then calls
//!   `multi_tool_use.parallel`, which OpenAI's own check of names refuses);
//! - ids another provider made, in a conversation continued elsewhere (Kimi writes
//!   `functions.add:0`, which Anthropic refuses; vLLM's ids run to 46 characters, past the
//!   40 OpenAI takes).
//!
//! Sent back as they are, each would fail every later call of the conversation with a 400,
//! which is not retried: the conversation could not go on. Every tool offered has a name that
//! conforms already (`check_tool_name_format`), so a name that does not is a made-up call's,
//! which only ever has an error result: sending it mapped changes nothing the model could act
//! on.

use std::borrow::Cow;
use std::fmt::Write as _;

/// The most bytes of a tool name both providers accept (`^[a-zA-Z0-9_-]{1,64}$`).
pub(crate) const MAX_TOOL_NAME: usize = 64;

/// `'_'` and 16 hex digits.
const HASH_SUFFIX: usize = 17;

/// `value` as a provider accepts it: at most `max` bytes and, when `word`, only
/// `[A-Za-z0-9_-]` (and not empty). A value that is so is sent as it is; another has each
/// character outside the set replaced with `_`, is cut short to leave room, and has a hash of
/// the whole value appended, so distinct values stay distinct and a call and its result
/// (mapped alike) still match. The same on every node and every run. `max` is at least
/// [`HASH_SUFFIX`] bytes more than nothing: a smaller one still gets the hash.
pub(crate) fn conforming(value: &str, word: bool, max: usize) -> Cow<'_, str> {
    let allowed = |c: char| !word || c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if !value.is_empty() && value.len() <= max && value.chars().all(allowed) {
        return Cow::Borrowed(value);
    }
    // FNV-1a.
    let hash = value.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let room = max.saturating_sub(HASH_SUFFIX);
    let mut mapped = String::with_capacity(value.len().min(room) + HASH_SUFFIX);
    for c in value.chars().map(|c| if allowed(c) { c } else { '_' }) {
        if mapped.len() + c.len_utf8() > room {
            break;
        }
        mapped.push(c);
    }
    let _ = write!(mapped, "_{hash:016x}");
    Cow::Owned(mapped)
}

/// A tool call's name as OpenAI's and Anthropic's APIs accept it in the history.
pub(crate) fn tool_name(name: &str) -> Cow<'_, str> {
    conforming(name, true, MAX_TOOL_NAME)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conforming_value_is_sent_as_it_is() {
        assert!(matches!(tool_name("get_weather-2"), Cow::Borrowed("get_weather-2")));
        let longest = "a".repeat(MAX_TOOL_NAME);
        assert!(matches!(tool_name(&longest), Cow::Borrowed(_)));
        assert!(matches!(conforming("functions.add:0", false, 40), Cow::Borrowed(_)));
    }

    #[test]
    fn a_made_up_tool_name_is_mapped_to_one_the_providers_accept_and_stays_distinct() {
        let pattern = |name: &str| {
            (1..=MAX_TOOL_NAME).contains(&name.len())
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        let made_up = [
            "multi_tool_use.parallel",
            "multi_tool_use:parallel",
            "",
            "outil à café",
            &"x".repeat(65),
            &"é".repeat(100),
        ];
        let mapped: Vec<String> = made_up.iter().map(|name| tool_name(name).into_owned()).collect();
        for (name, sent) in made_up.iter().zip(&mapped) {
            assert!(pattern(sent), "{name:?} was sent as {sent:?}");
            assert_eq!(tool_name(name), *sent, "the same every time");
        }
        assert_eq!(mapped[0].len(), "multi_tool_use_parallel".len() + HASH_SUFFIX);
        assert!(mapped[0].starts_with("multi_tool_use_parallel_"));
        // The two names that map to the same characters stay apart by their hashes.
        let mut distinct = mapped.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), mapped.len(), "{mapped:?}");
    }

    #[test]
    fn a_long_id_is_cut_to_the_bound_with_its_hash() {
        let vllm = "chatcmpl-tool-0123456789abcdef0123456789abcdef";
        let sent = conforming(vllm, false, 40);
        assert_eq!(sent.len(), 40);
        assert!(sent.starts_with("chatcmpl-tool-012345"), "{sent}");
        assert_ne!(conforming(&format!("{vllm}x"), false, 40), sent);
        // Characters are kept whole: a cut never splits one.
        let wide = "é".repeat(30);
        let sent = conforming(&wide, false, 40);
        assert!(sent.len() <= 40, "{sent}");
        assert!(sent.starts_with("éé"));
    }
}
