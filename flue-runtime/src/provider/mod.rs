//! Model providers: the provider-neutral call ([`ModelRequest`] → [`ModelStream`]), the
//! built-in providers over reqwest (`openai`, `anthropic`, `openrouter`, and any
//! OpenAI-compatible server), and the registry that resolves `provider/model` specifiers.

mod types;

pub mod anthropic;
pub(crate) mod body;
mod complete;
mod http;
pub mod openai;
pub mod registry;
pub(crate) mod sse;
mod text;
mod tool_json;
mod wire_names;

pub(crate) use complete::{CallError, call_observed, complete};
pub use http::RetryPolicy;
pub(crate) use http::{jitter_fraction, parse_retry_after, redact_prefix, redact_secret};
pub use registry::ProviderRegistry;
pub use types::*;

/// The most tool calls, and the most reasoning parts (details, thinking blocks), one streamed
/// answer may bring: far beyond any real answer, a bound on what a server streaming them
/// without end makes the call keep (each its own allocations, where the response's byte budget
/// counts bytes). Past it the call fails as an invalid response.
pub(crate) const MAX_STREAMED_PARTS: usize = 4096;
