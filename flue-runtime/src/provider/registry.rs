//! (being written)

/// Resolves `provider/model` specifiers to providers.
#[derive(Default)]
pub struct ProviderRegistry {}
