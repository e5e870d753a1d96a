//! The agent as the expansion sees it.

use proc_macro2::Span;
use syn::{Ident, ItemFn, LitStr};

use super::parse::{Options, ParentHook};
use crate::errors::Errors;

pub(crate) struct AgentModel {
    pub(crate) function: ItemFn,
    pub(crate) ident: Ident,
    /// The durable identity and the tokens to blame for it.
    pub(crate) name: (String, Span),
    pub(crate) options: Options,
    pub(crate) krate: syn::Path,
    /// Parsed `durability(timeout = "…")`, in milliseconds.
    pub(crate) timeout_ms: Option<u64>,
}

impl AgentModel {
    pub(crate) fn build(function: ItemFn, mut options: Options, errors: &Errors) -> Self {
        let ident = function.sig.ident.clone();
        let name = match &options.name {
            Some(name) => (name.value(), name.span()),
            None => (syn::ext::IdentExt::unraw(&ident).to_string(), ident.span()),
        };
        let krate = crate::krate::runtime_path(options.krate.take());
        let timeout_ms = options
            .timeout
            .as_ref()
            .and_then(|timeout| match parse_duration(&timeout.value()) {
                Some(ms) => Some(ms),
                None => {
                    errors.spanned(
                        timeout,
                        "timeout must be a positive duration like \"500ms\", \"90s\", \"5m\" or \"1h\"",
                    );
                    None
                }
            });
        Self {
            function,
            ident,
            name,
            options,
            krate,
            timeout_ms,
        }
    }

    pub(crate) fn parent_hooks(&self) -> &[ParentHook] {
        self.options.parent_hooks.as_deref().unwrap_or_default()
    }

    pub(crate) fn description(&self) -> Option<&LitStr> {
        self.options.description.as_ref()
    }
}

/// `"500ms"`, `"90s"`, `"5m"`, `"1h"` → milliseconds (positive).
fn parse_duration(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().ok()?;
    let factor = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return None,
    };
    number.checked_mul(factor).filter(|ms| *ms > 0)
}
