//! Where generated code finds `flue_runtime`.

use proc_macro_crate::{FoundCrate, crate_name};

/// The path to `flue_runtime` in the calling crate: `crate = "…"` when given, else the name
/// the caller's Cargo.toml gives the `flue-runtime` dependency, else `::flue_runtime`.
pub(crate) fn runtime_path(explicit: Option<syn::Path>) -> syn::Path {
    if let Some(path) = explicit {
        return path;
    }
    match crate_name("flue-runtime") {
        Ok(FoundCrate::Name(name)) => {
            let ident = syn::Ident::new(&name, proc_macro2::Span::call_site());
            syn::parse_quote!(::#ident)
        }
        // Inside flue-runtime itself, or when the manifest cannot be read: the default name.
        Ok(FoundCrate::Itself) | Err(_) => syn::parse_quote!(::flue_runtime),
    }
}
