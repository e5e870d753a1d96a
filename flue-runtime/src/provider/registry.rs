//! The provider registry: resolves `provider-id/model-id` specifiers to a [`ModelProvider`] and
//! the provider's own model id.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use super::anthropic::AnthropicProvider;
use super::openai::OpenAiProvider;
use super::types::ModelProvider;

/// Resolves `provider/model` specifiers to providers.
///
/// A specifier is split at its **first** `/`: `"openrouter/anthropic/claude-sonnet-4.5"` names
/// the provider `openrouter` and its model `anthropic/claude-sonnet-4.5`.
///
/// ```
/// use flue_runtime::provider::ProviderRegistry;
///
/// let registry = ProviderRegistry::with_defaults();
/// assert_eq!(registry.ids(), ["anthropic", "openai", "openrouter"]);
/// let (provider, model) = registry.resolve("openrouter/anthropic/claude-sonnet-4.5").unwrap();
/// assert_eq!((provider.id(), model.as_str()), ("openrouter", "anthropic/claude-sonnet-4.5"));
/// assert!(registry.resolve("gpt-4o").is_err());
/// ```
#[derive(Clone, Default)]
pub struct ProviderRegistry {
    providers: BTreeMap<String, Arc<dyn ModelProvider>>,
}

/// Why a model specifier could not be resolved.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The specifier is not of the form `provider-id/model-id` (no `/`, or an empty part).
    #[error("[flue] The agent model \"{spec}\" could not be resolved: use \"provider-id/model-id\".")]
    Malformed {
        /// The specifier as given.
        spec: String,
    },
    /// No provider is registered under the specifier's provider id.
    #[error(
        "[flue] The agent model \"{spec}\" could not be resolved: no provider \"{provider}\" is registered \
         (registered: {list}).",
        list = if registered.is_empty() { "none".to_owned() } else { registered.join(", ") }
    )]
    UnknownProvider {
        /// The specifier as given.
        spec: String,
        /// Its provider id.
        provider: String,
        /// The ids that are registered, sorted.
        registered: Vec<String>,
    },
}

impl ProviderRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry of the built-in providers: `openai`, `anthropic` and `openrouter` (keys read
    /// from `OPENAI_API_KEY`, `ANTHROPIC_API_KEY` and `OPENROUTER_API_KEY` at call time).
    pub fn with_defaults() -> Self {
        let mut registry = Self::new();
        registry.register(OpenAiProvider::openai());
        registry.register(AnthropicProvider::anthropic());
        registry.register(OpenAiProvider::openrouter());
        registry
    }

    /// Registers `provider` under its id, replacing any provider with the same id.
    pub fn register(&mut self, provider: impl ModelProvider) -> &mut Self {
        self.register_arc(Arc::new(provider))
    }

    /// Registers a shared provider under its id, replacing any provider with the same id.
    pub fn register_arc(&mut self, provider: Arc<dyn ModelProvider>) -> &mut Self {
        self.providers.insert(provider.id().to_owned(), provider);
        self
    }

    /// The provider registered under `id`.
    pub fn get(&self, id: &str) -> Option<Arc<dyn ModelProvider>> {
        self.providers.get(id).cloned()
    }

    /// The registered provider ids, sorted.
    pub fn ids(&self) -> Vec<String> {
        self.providers.keys().cloned().collect()
    }

    /// Resolves `spec` (`provider-id/model-id`, split at the first `/`) to its provider and the
    /// provider's model id.
    pub fn resolve(&self, spec: &str) -> Result<(Arc<dyn ModelProvider>, String), ResolveError> {
        let malformed = || ResolveError::Malformed { spec: spec.to_owned() };
        let (provider_id, model) = spec.split_once('/').ok_or_else(malformed)?;
        if provider_id.trim().is_empty() || model.trim().is_empty() {
            return Err(malformed());
        }
        let provider = self.get(provider_id).ok_or_else(|| ResolveError::UnknownProvider {
            spec: spec.to_owned(),
            provider: provider_id.to_owned(),
            registered: self.ids(),
        })?;
        Ok((provider, model.to_owned()))
    }
}

impl fmt::Debug for ProviderRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderRegistry").field("ids", &self.ids()).finish()
    }
}
