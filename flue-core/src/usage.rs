//! Token usage of model calls.

use serde::{Deserialize, Serialize};

/// Token usage of one model call, or an aggregate of several.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
    /// Prompt tokens served from the provider's cache.
    pub cache_read_tokens: u64,
    /// Prompt tokens written to the provider's cache.
    pub cache_write_tokens: u64,
    /// Reasoning tokens (included in `output_tokens` where the provider counts them there).
    pub reasoning_tokens: u64,
}

impl Usage {
    /// Input plus output tokens.
    pub fn total_tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }
}

/// Sums saturate: the counts are what a provider sent, never trusted not to overflow.
impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, other: Self) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cache_read_tokens = self.cache_read_tokens.saturating_add(other.cache_read_tokens);
        self.cache_write_tokens = self.cache_write_tokens.saturating_add(other.cache_write_tokens);
        self.reasoning_tokens = self.reasoning_tokens.saturating_add(other.reasoning_tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_sums_saturate_at_counts_a_provider_sent_too_large() {
        let huge = Usage {
            input_tokens: u64::MAX,
            output_tokens: u64::MAX,
            ..Usage::default()
        };
        let mut sum = huge;
        sum += huge;
        assert_eq!((sum.input_tokens, sum.output_tokens), (u64::MAX, u64::MAX));
        assert_eq!(huge.total_tokens(), u64::MAX);
    }
}
