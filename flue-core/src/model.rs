//! Model options: thinking level and compaction (what `use_model` accepts beside the specifier).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Reasoning effort. The runtime maps it per provider; unset means `Medium`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThinkingLevel {
    /// No reasoning.
    Off,
    /// Minimal reasoning.
    Minimal,
    /// Low effort.
    Low,
    /// Medium effort (the default).
    Medium,
    /// High effort.
    High,
    /// Extra-high effort.
    Xhigh,
    /// The provider's maximum.
    Max,
}

impl ThinkingLevel {
    /// Every level, in increasing effort.
    pub const ALL: [ThinkingLevel; 7] = [
        ThinkingLevel::Off,
        ThinkingLevel::Minimal,
        ThinkingLevel::Low,
        ThinkingLevel::Medium,
        ThinkingLevel::High,
        ThinkingLevel::Xhigh,
        ThinkingLevel::Max,
    ];

    /// The level's name (`off`, `minimal`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Minimal => "minimal",
            Self::Low => "low",
            Self::Medium => "medium",
            Self::High => "high",
            Self::Xhigh => "xhigh",
            Self::Max => "max",
        }
    }
}

impl fmt::Display for ThinkingLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ThinkingLevel {
    type Err = ModelOptionsError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|level| level.as_str() == text)
            .ok_or(ModelOptionsError::ThinkingLevel)
    }
}

/// Threshold-compaction configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CompactionConfig {
    /// Token headroom kept free in the context window; compaction triggers when used tokens
    /// exceed `context_window - reserve_tokens`. Default: model-aware, capped at 20,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve_tokens: Option<u32>,
    /// Recent tokens kept verbatim after compaction. Default 8,000; at most half of the
    /// context window less the reserve (the runtime's cap, so a small window is compacted too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_recent_tokens: Option<u32>,
    /// Model specifier for summarisation calls. Default: the session's model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl CompactionConfig {
    /// The default for [`CompactionConfig::keep_recent_tokens`].
    pub const DEFAULT_KEEP_RECENT_TOKENS: u32 = 8_000;
    /// The cap of the default reserve.
    pub const MAX_DEFAULT_RESERVE_TOKENS: u32 = 20_000;
}

/// Whether and how threshold compaction runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Compaction {
    /// The runtime's defaults.
    #[default]
    Default,
    /// Threshold compaction off. Overflow recovery still compacts when a call overflows.
    Disabled,
    /// Threshold compaction with these settings.
    Threshold(CompactionConfig),
}

/// What `use_model_with` accepts beside the specifier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelOptions {
    /// Agent-wide default reasoning effort (`None`: the harness uses `Medium`).
    pub thinking_level: Option<ThinkingLevel>,
    /// Threshold compaction.
    pub compaction: Compaction,
}

impl ModelOptions {
    /// Options with `thinking_level`.
    pub fn thinking(thinking_level: ThinkingLevel) -> Self {
        Self {
            thinking_level: Some(thinking_level),
            ..Self::default()
        }
    }

    /// Sets the compaction mode.
    pub fn with_compaction(mut self, compaction: Compaction) -> Self {
        self.compaction = compaction;
        self
    }

    /// Parses options from configuration JSON in the reference's shape
    /// (`{"thinkingLevel": "high", "compaction": false | {…}}`), with its messages.
    pub fn from_json(value: &Value) -> Result<Self, ModelOptionsError> {
        let Value::Object(map) = value else {
            return Err(ModelOptionsError::NotAnObject);
        };
        // The reference's order: every key first, then the thinking level, then compaction.
        // (Keys are visited in `serde_json::Map` order, alphabetical in this build, where the
        // reference visits them in insertion order: of two unknown keys, the first in that
        // order is named.)
        if let Some(unknown) = map
            .keys()
            .find(|key| !matches!(key.as_str(), "thinkingLevel" | "compaction"))
        {
            return Err(ModelOptionsError::UnknownField(unknown.clone()));
        }
        let mut options = ModelOptions::default();
        if let Some(field) = map.get("thinkingLevel") {
            let text = field.as_str().ok_or(ModelOptionsError::ThinkingLevel)?;
            options.thinking_level = Some(text.parse()?);
        }
        if let Some(field) = map.get("compaction") {
            options.compaction = parse_compaction(field)?;
        }
        options.validate()?;
        Ok(options)
    }

    /// Checks the rules the type system does not: a compaction model must not be blank
    /// (stricter than the reference, which takes any string and fails only when a compaction
    /// resolves it).
    pub fn validate(&self) -> Result<(), ModelOptionsError> {
        if let Compaction::Threshold(CompactionConfig { model: Some(model), .. }) = &self.compaction
            && model.trim().is_empty()
        {
            return Err(ModelOptionsError::BlankCompactionModel);
        }
        Ok(())
    }
}

/// Parses a compaction setting in the reference's order: the shape, every key, the two token
/// counts, then the model.
fn parse_compaction(value: &Value) -> Result<Compaction, ModelOptionsError> {
    let map = match value {
        Value::Bool(false) => return Ok(Compaction::Disabled),
        Value::Object(map) => map,
        _ => return Err(ModelOptionsError::Compaction),
    };
    if let Some(unknown) = map
        .keys()
        .find(|key| !matches!(key.as_str(), "reserveTokens" | "keepRecentTokens" | "model"))
    {
        return Err(ModelOptionsError::CompactionUnknownField(unknown.clone()));
    }
    let tokens = |name: &'static str| {
        map.get(name)
            .map(|field| token_count(field).ok_or(ModelOptionsError::CompactionTokens(name)))
            .transpose()
    };
    let reserve_tokens = tokens("reserveTokens")?;
    let keep_recent_tokens = tokens("keepRecentTokens")?;
    let model = map
        .get("model")
        .map(|field| {
            field
                .as_str()
                .map(str::to_owned)
                .ok_or(ModelOptionsError::CompactionModel)
        })
        .transpose()?;
    Ok(Compaction::Threshold(CompactionConfig {
        reserve_tokens,
        keep_recent_tokens,
        model,
    }))
}

/// A token count: any non-negative integer, as the reference takes it (a whole number written
/// with a fraction, `16000.0`, included). One past `u32::MAX` tokens is past every context
/// window, so larger counts are held as `u32::MAX`, which means the same.
fn token_count(value: &Value) -> Option<u32> {
    if let Some(count) = value.as_u64() {
        return Some(u32::try_from(count).unwrap_or(u32::MAX));
    }
    let count = value.as_f64()?;
    // `-0.0` is an integer and not negative, as in the reference.
    // `as` saturates: a whole number past `u32::MAX` becomes `u32::MAX`.
    (count.is_finite() && count.fract() == 0.0 && count >= 0.0).then_some(count as u32)
}

/// Model options that break a rule (the reference's `use_model()` messages).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelOptionsError {
    /// Options that are not an object.
    #[error("[flue] use_model() options must be an object.")]
    NotAnObject,
    /// An unknown option.
    #[error("[flue] use_model() options received unknown field \"{0}\".")]
    UnknownField(String),
    /// A thinking level that is not one of the seven.
    #[error("[flue] use_model() options thinkingLevel must be one of: off, minimal, low, medium, high, xhigh, max.")]
    ThinkingLevel,
    /// Compaction that is neither a configuration nor `false`.
    #[error("[flue] use_model() options compaction must be a configuration object or `false`.")]
    Compaction,
    /// An unknown compaction field.
    #[error("[flue] use_model() options compaction received unknown field \"{0}\".")]
    CompactionUnknownField(String),
    /// A token count that is not a non-negative integer.
    #[error("[flue] use_model() options compaction.{0} must be a non-negative integer.")]
    CompactionTokens(&'static str),
    /// A compaction model that is not a string.
    #[error("[flue] use_model() options compaction.model must be a string.")]
    CompactionModel,
    /// A compaction model that is blank.
    #[error(
        "[flue] use_model() options compaction.model must name a model, like 'anthropic/claude-haiku-4-5'; it is blank."
    )]
    BlankCompactionModel,
}
