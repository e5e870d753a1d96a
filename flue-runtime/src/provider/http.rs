//! HTTP plumbing shared by the built-in providers ([`super::openai`] and [`super::anthropic`]).
//!
//! - [`SharedClient`]: one lazily built `reqwest::Client` per provider value (connect timeout 10 s),
//!   shared by its clones.
//! - [`send_with_retries`]: POSTs a JSON body and retries failures that happen before the body starts
//!   streaming (429, 5xx, connect errors, first-byte timeouts) with exponential backoff and jitter,
//!   honouring `Retry-After` up to a minute (a longer wait asked fails the call at once).
//! - [`map_error`]: turns an HTTP status and an error body (OpenAI, OpenRouter or Anthropic shape) into
//!   a [`ProviderError`]. Messages never contain the API key: every provider text is redacted
//!   (the key as it is, and as it reads once JSON and percent escapes are decoded) and quoted at
//!   most 300 characters long; a connection error quotes the request's URL without its
//!   userinfo, query and fragment.
//! - [`sse_stream`]: turns a response into a [`ModelStream`] through a provider-specific [`SseDecoder`],
//!   with an idle timeout between body chunks, and a longer bound on a stretch of keep-alives
//!   without an event.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use super::body::Payload;
use super::sse::{Event, SseError, SseParser};
use super::types::ModelRequest;
use crate::error_chain;
use bytes::Bytes;
use flue_core::url::{url_without_secrets, without_url_secrets};
use futures_util::{Stream, StreamExt};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use serde_json::Value;
use tokio::time::Sleep;

use super::types::{ModelStream, ProviderError, ProviderErrorKind, StreamEvent};

/// Default time allowed for a response to start (status line and headers) once the request
/// was sent (see [`send_with_retries`]).
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Default time allowed between two chunks of a streaming body.
pub(crate) const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Time allowed to open the TCP/TLS connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a retry waits, whatever the provider asks for: the turn loop's own cap.
const MAX_RETRY_WAIT: Duration = crate::runtime::MAX_MODEL_RETRY_WAIT;
/// How much of a provider's error message, or of an error body without one, is quoted in an
/// error message.
const BODY_SNIPPET_CHARS: usize = 300;
/// How much of a malformed stream event is quoted in an error message.
const EVENT_SNIPPET_CHARS: usize = 120;

/// How a provider retries a call that failed before its response started streaming.
///
/// Rate limits (429), server errors (5xx), connection failures and first-byte timeouts are
/// retried at most `max_retries` times. The `n`-th retry (from 0) waits a random 75–100 % of
/// `base_delay · 2ⁿ` (at most 30 s; the jitter keeps callers that failed together from
/// retrying together), as the turn loop's own retries do, unless the provider sent `Retry-After`, which is
/// honoured instead, in full up to a minute (a per-minute rate limit's): a failure whose
/// `Retry-After` asks for longer is not retried (a retry would meet the same limit), and its
/// error says how long the provider asked to wait. Failures after the response began streaming
/// are never retried.
///
/// ```
/// use std::time::Duration;
/// use flue_runtime::provider::openai::{OpenAiProvider, RetryPolicy};
///
/// let provider = OpenAiProvider::openai().with_retry_policy(RetryPolicy::new(1, Duration::from_millis(200)));
/// assert_eq!(RetryPolicy::default(), RetryPolicy::new(3, Duration::from_secs(2)));
/// # drop(provider);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt (so at most `max_retries + 1` requests).
    pub max_retries: u32,
    /// The wait before the first retry; it doubles for each further retry.
    pub base_delay: Duration,
}

impl RetryPolicy {
    /// A policy of `max_retries` retries starting at `base_delay`.
    pub const fn new(max_retries: u32, base_delay: Duration) -> Self {
        Self {
            max_retries,
            base_delay,
        }
    }

    /// A policy that never retries.
    pub const fn none() -> Self {
        Self {
            max_retries: 0,
            base_delay: Duration::ZERO,
        }
    }

    /// The wait before retry number `retry` (counted from 0) when the provider gave no
    /// `Retry-After`.
    pub(crate) fn backoff(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry).unwrap_or(u32::MAX);
        let nominal = self.base_delay.saturating_mul(factor).min(MAX_RETRY_WAIT);
        nominal.mul_f64(0.75 + 0.25 * jitter_fraction())
    }
}

impl Default for RetryPolicy {
    /// 3 retries, starting at 2 s: the reference's backoff (about 10.5 to 14 s over the three
    /// retries), and the runtime's default
    /// [`model_retry_delay`](crate::RuntimeOptions::model_retry_delay). (A rate limit or an
    /// overloaded server retried within half a second is likely to refuse again.)
    fn default() -> Self {
        Self::new(3, Duration::from_secs(2))
    }
}

/// A random number in `[0, 1)`, from the standard library's per-instance random hash keys.
pub(crate) fn jitter_fraction() -> f64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let random = RandomState::new().hash_one(nanos);
    (random % 10_000) as f64 / 10_000.0
}

/// Timeouts and retries of one provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Transport {
    /// Time allowed for a response to start (per attempt).
    pub timeout: Duration,
    /// Time allowed between two body chunks.
    pub idle_timeout: Duration,
    /// Retries before the response starts.
    pub retry: RetryPolicy,
}

impl Transport {
    /// This transport for `request`: at most the retries the request leaves it
    /// ([`ModelRequest::max_retries`]).
    pub(crate) fn for_request(mut self, request: &ModelRequest) -> Self {
        if let Some(left) = request.max_retries {
            self.retry.max_retries = self.retry.max_retries.min(left);
        }
        self
    }
}

impl Default for Transport {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            retry: RetryPolicy::default(),
        }
    }
}

/// Redirects within the request's origin (scheme, host and port), at most 10; one to another
/// origin is not followed, and its 3xx answer fails the call. Keys travel in headers reqwest
/// keeps on every redirect but `Authorization` (Anthropic's `x-api-key`, a gateway's own
/// header): another origin must never see them.
fn same_origin_redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let same_origin = attempt
            .previous()
            .first()
            .is_some_and(|first| first.origin() == attempt.url().origin());
        if same_origin && attempt.previous().len() <= 10 {
            attempt.follow()
        } else {
            attempt.stop()
        }
    })
}

/// A `reqwest::Client` built on first use and shared by the clones of one provider.
///
/// Per provider rather than process-wide: a pooled connection belongs to the tokio runtime that
/// opened it, and separate runtimes (tests, embedded uses) must not share a pool.
#[derive(Clone, Default)]
pub(crate) struct SharedClient(Arc<OnceLock<Result<reqwest::Client, String>>>);

impl SharedClient {
    /// The client, building it on first use.
    pub fn get(&self) -> Result<reqwest::Client, ProviderError> {
        self.0
            .get_or_init(|| {
                reqwest::Client::builder()
                    .connect_timeout(CONNECT_TIMEOUT)
                    .redirect(same_origin_redirects())
                    .build()
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| {
                ProviderError::new(
                    ProviderErrorKind::Network,
                    format!("[flue] Could not build the HTTP client: {e}"),
                )
            })
    }
}

impl fmt::Debug for SharedClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedClient")
    }
}

/// An API key. Its `Debug` output is redacted.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct ApiKey(String);

impl ApiKey {
    /// The key text (only for building the request header).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Where a provider's API key comes from.
#[derive(Clone, Debug)]
pub(crate) struct KeySource {
    /// The environment variable read at call time.
    pub env: String,
    /// A key given in code, which takes precedence over the environment.
    pub explicit: Option<ApiKey>,
    /// Whether a call may go out without a key (local OpenAI-compatible servers).
    pub optional: bool,
}

impl KeySource {
    /// A key read from `env`, required.
    pub fn env(env: impl Into<String>) -> Self {
        Self {
            env: env.into(),
            explicit: None,
            optional: false,
        }
    }

    /// Sets an explicit key, trimmed as a key from the environment is (a key read from a file
    /// keeps no line end); an empty one clears it.
    pub fn set_explicit(&mut self, key: impl Into<String>) {
        let key = key.into();
        let key = key.trim();
        self.explicit = (!key.is_empty()).then(|| ApiKey(key.to_owned()));
    }

    /// The key for a call now: the explicit one, else the environment variable's (non-empty)
    /// value. `Ok(None)` when there is none and the key is optional.
    pub fn resolve(&self, provider_id: &str) -> Result<Option<ApiKey>, ProviderError> {
        if let Some(key) = &self.explicit {
            return Ok(Some(key.clone()));
        }
        match std::env::var(&self.env) {
            Ok(value) if !value.trim().is_empty() => Ok(Some(ApiKey(value.trim().to_owned()))),
            _ if self.optional => Ok(None),
            _ => Err(ProviderError::new(
                ProviderErrorKind::MissingKey,
                format!("[flue] Provider \"{provider_id}\" needs an API key: set {}.", self.env),
            )),
        }
    }
}

/// What error messages may say about one call (and the key they must never say). Cloned
/// into every stage of the call's stream, so it is shared.
#[derive(Clone, Debug)]
pub(crate) struct CallContext(Arc<CallInfo>);

/// The fields of a [`CallContext`].
#[derive(Debug)]
pub(crate) struct CallInfo {
    /// Provider id.
    pub provider: String,
    /// The environment variable that holds the key.
    pub key_env: String,
    /// The provider's model id.
    pub model: String,
    /// Whether the call sent a key (a provider whose key is optional sends none when its
    /// variable is unset).
    pub key_sent: bool,
    /// The key used and the forms it takes once escaped, only to redact them from provider
    /// texts. Longest first, so that no form is cut by a shorter one replaced before it. Made
    /// from `key` at the first redaction: most calls quote no provider text.
    secrets: OnceLock<Vec<ApiKey>>,
    /// The key as it is, also sought in provider texts with their escapes decoded (see
    /// [`redact_escaped`]); `None` when there are no forms to redact.
    key: Option<ApiKey>,
}

impl std::ops::Deref for CallContext {
    type Target = CallInfo;

    fn deref(&self) -> &CallInfo {
        &self.0
    }
}

impl CallContext {
    /// The context of a call of `model` on `provider` with `key`.
    pub fn new(provider: &str, key_env: &str, model: &str, key: Option<ApiKey>) -> Self {
        Self(Arc::new(CallInfo {
            provider: provider.to_owned(),
            key_env: key_env.to_owned(),
            model: model.to_owned(),
            key_sent: key.is_some(),
            secrets: OnceLock::new(),
            key: key.filter(|key| key.expose().len() >= MIN_REDACTED_KEY_BYTES),
        }))
    }

    /// `text` with every occurrence of the API key replaced, as it is and as a provider may
    /// echo it escaped: in a JSON string or percent-encoded in a URL (see [`key_forms`]), also
    /// with escapes no list of forms foresees (see [`redact_escaped`]).
    pub fn redact(&self, text: &str) -> String {
        let Some(key) = &self.key else { return text.to_owned() };
        let forms = self.secrets.get_or_init(|| key_forms(key.expose()));
        redact_forms(text, forms, key.expose())
    }

    /// The text of a reqwest `error` (with its causes) as an error message may quote it: its
    /// URLs without userinfo, query and fragment (reqwest names the request's URL, and some
    /// OpenAI-compatible servers take the key in the query: `?api-key=…`), and redacted.
    pub fn quote_error(&self, error: &reqwest::Error) -> String {
        self.redact(&without_url_secrets(&error_chain(error)))
    }

    /// At most `max_chars` characters of `text`, redacted, with `…` when it was cut. The key is
    /// removed before the text is cut: cut first, a key straddling the cut would survive in
    /// part. So are the userinfo, query and fragment of the URLs in it (a gateway that echoes
    /// the request's URL would quote a key passed in its query).
    ///
    /// Only a prefix of a long text is redacted when that shows the same ([`redact_prefix`]):
    /// redaction decodes escapes into buffers many times the text's size, and a 16 MiB event
    /// is not decoded to quote 120 characters.
    pub fn quote(&self, text: &str, max_chars: usize) -> String {
        let text = without_url_secrets(text);
        let redacted = match &self.key {
            // The first `max_chars` characters are within the first `4 * max_chars` bytes.
            Some(key) => redact_prefix(&text, 4 * max_chars, key.expose().len(), |text| self.redact(text)).0,
            None => text,
        };
        match redacted.char_indices().nth(max_chars) {
            Some((end, _)) => format!("{}…", &redacted[..end]),
            None => redacted,
        }
    }
}

/// A key shorter than this is not redacted: it would redact ordinary words.
const MIN_REDACTED_KEY_BYTES: usize = 4;

/// The most bytes one byte of a key takes in a form of it a server may echo: a JSON `\uXXXX`
/// escape (six bytes for one ASCII byte; more bytes of the key share one for other characters).
const LONGEST_FORM_PER_KEY_BYTE: usize = 6;

/// What `redact` (a redaction of secrets of at most `secret_bytes` bytes) makes of `text`, as
/// far as its first `keep` bytes go, computed on a prefix of a long text: the result agrees
/// with `redact(text)` on its first `keep` bytes (it may be shorter than the whole's, or end
/// differently past them).
///
/// A form of a secret the prefix cuts in two starts no more than its longest form
/// ([`LONGEST_FORM_PER_KEY_BYTE`] bytes per byte) before the cut, and what the prefix makes of
/// the bytes from there is at most two and a half times as long (text as it is, or
/// `[redacted]` in place of at least 4 bytes). So once the redacted prefix is that much longer
/// than `keep`, its first `keep` bytes came from text before any such form, and are the
/// whole's. Redaction may make text much shorter (adjacent forms become one `[redacted]`):
/// the prefix then doubles until it is long enough, or is the whole text. Also says whether it
/// redacted the whole text (then the result is `redact(text)`).
pub(crate) fn redact_prefix(
    text: &str,
    keep: usize,
    secret_bytes: usize,
    redact: impl Fn(&str) -> String,
) -> (String, bool) {
    let margin = 3 * LONGEST_FORM_PER_KEY_BYTE * secret_bytes.max(MIN_REDACTED_KEY_BYTES);
    let mut end = keep.saturating_add(margin).saturating_mul(2);
    loop {
        if end >= text.len() {
            return (redact(text), true);
        }
        let redacted = redact(&text[..text.floor_char_boundary(end)]);
        if redacted.len() >= keep.saturating_add(margin) {
            return (redacted, false);
        }
        end = end.saturating_mul(2);
    }
}

/// `text` with `secret` replaced wherever it shows, as it is or escaped as a server may echo
/// it (see [`key_forms`] and [`redact_escaped`]): how a credential other than a provider's key
/// (an MCP server's token or header) is kept out of the texts that quote a server. Nothing is
/// replaced for a secret shorter than 4 bytes, which would redact ordinary words.
pub(crate) fn redact_secret(text: &str, secret: &str) -> String {
    if secret.len() < MIN_REDACTED_KEY_BYTES {
        return text.to_owned();
    }
    redact_forms(text, &key_forms(secret), secret)
}

/// `text` with each of `forms` (the forms of `key`, [`key_forms`]) replaced, then the escapes
/// no list of forms foresees ([`redact_escaped`]).
fn redact_forms(text: &str, forms: &[ApiKey], key: &str) -> String {
    let mut text = text.to_owned();
    for form in forms {
        if text.contains(form.expose()) {
            text = text.replace(form.expose(), "[redacted]");
        }
    }
    redact_escaped(&text, key)
}

/// The forms `key` may take in a provider's text, longest first: as it is; escaped in a JSON
/// string (`"` and `\` always, `/` by some servers, control characters); percent-encoded as in
/// a URL's path or query (either hex case) and as a form value. Nothing for a key shorter than
/// 4 bytes, which would redact ordinary words.
fn key_forms(key: &str) -> Vec<ApiKey> {
    if key.len() < MIN_REDACTED_KEY_BYTES {
        return Vec::new();
    }
    let quoted = serde_json::to_string(key).unwrap_or_default();
    let json = quoted
        .strip_prefix('"')
        .and_then(|inner| inner.strip_suffix('"'))
        .unwrap_or(key)
        .to_owned();
    let (mut upper, mut lower) = (String::new(), String::new());
    for byte in key.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            upper.push(char::from(byte));
            lower.push(char::from(byte));
        } else {
            upper.push_str(&format!("%{byte:02X}"));
            lower.push_str(&format!("%{byte:02x}"));
        }
    }
    let mut forms = vec![
        key.to_owned(),
        json.replace('/', "\\/"),
        json,
        upper,
        lower,
        form_urlencoded::byte_serialize(key.as_bytes()).collect(),
    ];
    forms.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    forms.dedup();
    forms.into_iter().map(ApiKey).collect()
}

/// `text` with every occurrence of `key` replaced that shows once the escapes a provider may
/// write the key's characters in are decoded: JSON's (`\"`, `\\`, `\/`, `\b`, `\f`, `\n`,
/// `\r`, `\t`, and `\uXXXX`, for any character and in either hex case) and percent-encoding's
/// (`%XX`, the hex case mixed). [`key_forms`] lists the usual forms, but not an encoder that
/// escapes more characters than it must, nor one mixing hex cases. What is replaced is the
/// escaped text the key was decoded from; text that does not decode to the key is kept as it
/// is, escapes included.
fn redact_escaped(text: &str, key: &str) -> String {
    if !text.contains(['\\', '%']) {
        return text.to_owned();
    }
    let (decoded, origins) = unescaped(text);
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for found in memchr::memmem::find_iter(&decoded, key.as_bytes()) {
        let (mut start, _) = origins[found];
        let (_, mut end) = origins[found + key.len() - 1];
        // Whole characters of `text` (a match may start or end inside a decoded one).
        while !text.is_char_boundary(start) {
            start -= 1;
        }
        while !text.is_char_boundary(end) {
            end += 1;
        }
        match spans.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => spans.push((start, end)),
        }
    }
    let mut out = String::with_capacity(text.len());
    let mut kept = 0;
    for (start, end) in spans {
        out.push_str(&text[kept..start]);
        out.push_str("[redacted]");
        kept = end;
    }
    out.push_str(&text[kept..]);
    out
}

/// The bytes of `text` with its JSON and percent escapes decoded (see [`redact_escaped`]),
/// read left to right (`\\u0041` is a backslash and `u0041`), each with the byte range of
/// `text` it was decoded from. An escape that does not decode is kept as it is.
fn unescaped(text: &str) -> (Vec<u8>, Vec<(usize, usize)>) {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut origins = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let (produced, length) = match bytes[at] {
            b'\\' => json_escape(&bytes[at..]),
            b'%' => match bytes.get(at + 1..at + 3).and_then(hex) {
                Some(value) => (u8::try_from(value).ok().map(|byte| vec![byte]), 3),
                None => (None, 1),
            },
            _ => (None, 1),
        };
        match produced {
            Some(produced) => {
                for byte in produced {
                    decoded.push(byte);
                    origins.push((at, at + length));
                }
                at += length;
            }
            None => {
                decoded.push(bytes[at]);
                origins.push((at, at + 1));
                at += 1;
            }
        }
    }
    (decoded, origins)
}

/// The JSON escape at the start of `escaped` (which starts with `\`): the bytes it stands for
/// and its length, or `None` (length 1) when it is none. `\\` is an escape of its own, so the
/// character after it starts no escape.
fn json_escape(escaped: &[u8]) -> (Option<Vec<u8>>, usize) {
    let simple = match escaped.get(1) {
        Some(b'"') => Some(b'"'),
        Some(b'\\') => Some(b'\\'),
        Some(b'/') => Some(b'/'),
        Some(b'b') => Some(0x08),
        Some(b'f') => Some(0x0c),
        Some(b'n') => Some(b'\n'),
        Some(b'r') => Some(b'\r'),
        Some(b't') => Some(b'\t'),
        _ => None,
    };
    if let Some(byte) = simple {
        return (Some(vec![byte]), 2);
    }
    let unit = |at: usize| match escaped.get(at..at + 2) {
        Some(b"\\u") => escaped.get(at + 2..at + 6).and_then(hex),
        _ => None,
    };
    let Some(first) = unit(0) else {
        return (None, 1);
    };
    // A high surrogate pairs with the low one escaped right after it.
    let (code, length) = match (first, unit(6)) {
        (0xD800..=0xDBFF, Some(second @ 0xDC00..=0xDFFF)) => {
            (0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00), 12)
        }
        _ => (first, 6),
    };
    match char::from_u32(code) {
        Some(c) => (Some(c.to_string().into_bytes()), length),
        None => (None, 1),
    }
}

/// The value of `digits` read as hexadecimal (either case), when they all are hex digits.
fn hex(digits: &[u8]) -> Option<u32> {
    digits.iter().try_fold(0u32, |value, digit| {
        char::from(*digit).to_digit(16).map(|digit| value * 16 + digit)
    })
}

/// A header value holding a secret (excluded from reqwest's debug output).
pub(crate) fn secret_header(value: &str, ctx_provider: &str, key_env: &str) -> Result<HeaderValue, ProviderError> {
    let mut header = HeaderValue::from_str(value).map_err(|_| {
        ProviderError::new(
            ProviderErrorKind::Unauthorized,
            format!(
                "[flue] The API key of provider \"{ctx_provider}\" ({key_env}) is not a valid HTTP header value: \
                 check it for stray characters."
            ),
        )
    })?;
    header.set_sensitive(true);
    Ok(header)
}

/// `{base_url}/{path}` with exactly one `/` between them (before any query or fragment of the
/// base URL).
pub(crate) fn endpoint(base_url: &str, path: &str) -> String {
    // The path joins the base URL's path: a query or fragment the base URL carries (an API
    // version some OpenAI-compatible servers take there) stays after it.
    let (base, rest) = match base_url.find(['?', '#']) {
        Some(at) => base_url.split_at(at),
        None => (base_url, ""),
    };
    format!("{}/{}{rest}", base.trim_end_matches('/'), path.trim_start_matches('/'))
}

/// A provider's endpoint, parsed once (not on every call). Reset it when the base URL changes.
#[derive(Clone, Default)]
pub(crate) struct Endpoint(OnceLock<Result<reqwest::Url, String>>);

/// The URL without its userinfo, query and fragment: a provider's Debug ends up in logs.
impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let url = self.0.get().map(|url| match url {
            Ok(url) => url_without_secrets(url.as_str()),
            Err(text) => url_without_secrets(text),
        });
        f.debug_tuple("Endpoint").field(&url).finish()
    }
}

impl Endpoint {
    /// The URL of `path` under `base_url`: parsed, or the text that does not parse (reqwest
    /// then reports it as it would have).
    pub(crate) fn url(&self, base_url: &str, path: &str) -> Result<reqwest::Url, String> {
        self.parsed(base_url, path).clone()
    }

    /// The parse [`url`](Self::url) hands out, borrowed.
    pub(crate) fn parsed(&self, base_url: &str, path: &str) -> &Result<reqwest::Url, String> {
        self.0.get_or_init(|| {
            let text = endpoint(base_url, path);
            reqwest::Url::parse(&text).map_err(|_| text)
        })
    }
}

/// A URL given to [`send_with_retries`].
pub(crate) type Target = Result<reqwest::Url, String>;

/// A stream that fails once with `error`.
pub(crate) fn error_stream(error: ProviderError) -> ModelStream {
    Box::pin(futures_util::stream::once(async move { Err(error) }))
}

/// An encoded request body read back as a value (`null` when it did not encode): what the
/// providers' tests assert on.
#[cfg(test)]
pub(crate) fn decoded_body(encoded: Result<Payload, serde_json::Error>) -> serde_json::Value {
    encoded
        .ok()
        .and_then(|body| serde_json::from_slice(&body.to_vec()).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// Encodes a request body, mapping a failure to the error the stream reports.
pub(crate) fn encode_body(encoded: Result<Payload, serde_json::Error>) -> Result<Payload, ProviderError> {
    encoded.map_err(|error| {
        ProviderError::new(
            ProviderErrorKind::BadRequest,
            format!("[flue] Could not encode the request: {error}"),
        )
    })
}

/// A call's headers besides the body's content type, put straight onto each request (a map of
/// them would be built and then copied into the request's own at every call).
pub(crate) struct CallHeaders {
    /// The provider's fixed headers: names and values (lowercase names, visible ASCII values).
    pub(crate) fixed: &'static [(&'static str, &'static str)],
    /// The API key's header, when there is a key.
    pub(crate) key: Option<(HeaderName, HeaderValue)>,
}

/// Sends `request` with `payload`, waiting at most `timeout` for its answer to start, counted
/// from when the connection last took a frame of a long body (see [`Payload::to_body`]) or,
/// for a short one, from the call. `Err` when that time passed.
async fn started(
    request: reqwest::RequestBuilder,
    payload: &Payload,
    timeout: Duration,
) -> Result<reqwest::Result<reqwest::Response>, tokio::time::error::Elapsed> {
    if !payload.watched() {
        return tokio::time::timeout(timeout, request.body(payload.to_body(None)).send()).await;
    }
    let progress = super::body::Progress::new();
    let attempt = request.body(payload.to_body(Some(&progress))).send();
    tokio::pin!(attempt);
    let deadline = || progress.last().checked_add(timeout);
    loop {
        let Some(at) = deadline() else { return Ok(attempt.await) };
        match tokio::time::timeout_at(at, &mut attempt).await {
            // The body moved on meanwhile: the wait counts from there.
            Err(_) if deadline().is_some_and(|at| at > tokio::time::Instant::now()) => {}
            answer => return answer,
        }
    }
}

/// POSTs the JSON `payload` to `url` and returns the response once it started successfully
/// (2xx), with how many times the call was retried first.
///
/// Failures before the body streams are retried per `transport.retry`: 429 and 5xx answers,
/// connection failures and first-byte timeouts. Everything else fails at once.
pub(crate) async fn send_with_retries(
    client: &reqwest::Client,
    url: &Target,
    headers: &CallHeaders,
    mut payload: Payload,
    transport: &Transport,
    ctx: &CallContext,
) -> Result<(reqwest::Response, u32), ProviderError> {
    let mut retry = 0u32;
    loop {
        let request = match url {
            Ok(url) => client.post(url.clone()),
            Err(text) => client.post(text.as_str()),
        };
        let mut request = request.header(CONTENT_TYPE, "application/json");
        for (name, value) in headers.fixed {
            request = request.header(HeaderName::from_static(name), HeaderValue::from_static(value));
        }
        if let Some((name, value)) = &headers.key {
            request = request.header(name.clone(), value.clone());
        }
        let error = match started(request, &payload, transport.timeout).await {
            Ok(Ok(response)) if response.status().is_success() => return Ok((response, retry)),
            // A 307 or 308 sends the body again: reqwest follows it (same origin only, see
            // `same_origin_redirects`) for a body it can copy, not for one in parts. The
            // call is made again, at once, with the body in one part.
            Ok(Ok(response)) if matches!(response.status().as_u16(), 307 | 308) && payload.in_parts() => {
                payload = payload.joined();
                continue;
            }
            Ok(Ok(response)) => error_from_response(response, transport.timeout, ctx).await,
            Ok(Err(error)) => transport_error(&error, ctx),
            Err(_) => ProviderError::new(
                ProviderErrorKind::Timeout,
                format!(
                    "[flue] Provider \"{}\" did not start answering within {}.",
                    ctx.provider,
                    humantime::format_duration(transport.timeout)
                ),
            ),
        };
        if !error.is_retryable() || retry >= transport.retry.max_retries {
            return Err(ProviderError {
                retried: retry,
                ..error
            });
        }
        let wait = match error.retry_after {
            // At most a minute here: a longer wait asked made the error not retryable.
            Some(asked) => asked.min(crate::runtime::MAX_RETRY_AFTER_WAIT),
            None => transport.retry.backoff(retry),
        };
        tracing::debug!(
            provider = %ctx.provider,
            model = %ctx.model,
            retry = retry + 1,
            wait_ms = wait.as_millis() as u64,
            kind = ?error.kind,
            status = ?error.status,
            "retrying model call"
        );
        tokio::time::sleep(wait).await;
        retry += 1;
    }
}

/// A reqwest failure before any response: connection problems (retryable) or a request that
/// could not be built (not retryable).
fn transport_error(error: &reqwest::Error, ctx: &CallContext) -> ProviderError {
    let detail = ctx.quote_error(error);
    if error.is_builder() {
        return ProviderError::new(
            ProviderErrorKind::BadRequest,
            format!(
                "[flue] Could not build the request to provider \"{}\": {detail}",
                ctx.provider
            ),
        );
    }
    let kind = if error.is_timeout() {
        ProviderErrorKind::Timeout
    } else {
        ProviderErrorKind::Network
    };
    ProviderError::new(
        kind,
        format!("[flue] Could not reach provider \"{}\": {detail}", ctx.provider),
    )
}

/// The error of a non-2xx response (its body is read, within `timeout`).
async fn error_from_response(response: reqwest::Response, timeout: Duration, ctx: &CallContext) -> ProviderError {
    let status = response.status().as_u16();
    let retry_after = retry_after(response.headers());
    let body = error_body(response, timeout).await;
    let details = ErrorDetails::from_body(&body);
    map_error(ctx, Some(status), retry_after, &details, &body)
}

/// The most bytes of an error's body read (an error quotes a few hundred characters of it; a
/// gateway's page may be any size, and a retried call reads one every time).
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// The first [`MAX_ERROR_BODY_BYTES`] of `response`'s body as text (lossily), as much as
/// arrives within `timeout`; the rest is not read (its connection is not reused).
async fn error_body(mut response: reqwest::Response, timeout: Duration) -> String {
    let mut body = Vec::new();
    let read = async {
        while body.len() < MAX_ERROR_BODY_BYTES {
            match response.chunk().await {
                Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(timeout, read).await;
    body.truncate(MAX_ERROR_BODY_BYTES);
    String::from_utf8_lossy(&body).into_owned()
}

/// The wait a response asks for: `retry-after-ms` (OpenAI), else `Retry-After` as integer
/// seconds or an HTTP date.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    let millis = text(&HeaderName::from_static("retry-after-ms")).and_then(|v| v.parse::<f64>().ok());
    if let Some(ms) = millis.filter(|ms| !ms.is_nan() && *ms >= 0.0) {
        return Some(seconds(ms / 1000.0));
    }
    text(&RETRY_AFTER).and_then(parse_retry_after)
}

/// Parses a `Retry-After` value: integer (or decimal) seconds, or an HTTP date. Kept whole
/// (a wait longer than a retry waits makes the call fail instead of retrying too early).
pub(crate) fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(whole) = value.parse::<u64>() {
        return Some(Duration::from_secs(whole));
    }
    if let Ok(decimal) = value.parse::<f64>() {
        return (!decimal.is_nan() && decimal >= 0.0).then(|| seconds(decimal));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(SystemTime::now()).unwrap_or(Duration::ZERO))
}

/// `value` seconds (not negative), [`Duration::MAX`] past what a duration holds.
fn seconds(value: f64) -> Duration {
    Duration::try_from_secs_f64(value).unwrap_or(Duration::MAX)
}

/// What an error body says, whatever the provider's shape:
/// OpenAI `{"error":{"message","type","code"}}`, OpenRouter `{"error":{"message","code":429}}`,
/// Anthropic `{"type":"error","error":{"type","message"}}`, or a bare `{"message"}` / string.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ErrorDetails {
    /// The human message.
    pub message: Option<String>,
    /// A string error code (`context_length_exceeded`, `model_not_found`, …).
    pub code: Option<String>,
    /// The error type (`invalid_request_error`, `overloaded_error`, …).
    pub kind: Option<String>,
    /// A numeric code (OpenRouter puts the HTTP status there).
    pub status: Option<u16>,
}

impl ErrorDetails {
    /// Details from a response body (empty when it is not JSON). A body that is an array of
    /// errors (Gemini's OpenAI-compatible endpoint answers `[{"error":{…}}]`) gives its first.
    pub fn from_body(body: &str) -> Self {
        match serde_json::from_str::<Value>(body) {
            Ok(Value::Array(errors)) => errors.first().map_or_else(Self::default, |first| {
                Self::from_value(first.get("error").unwrap_or(first))
            }),
            Ok(value) => Self::from_value(value.get("error").unwrap_or(&value)),
            Err(_) => Self::default(),
        }
    }

    /// Details from an error object (the value of an `error` field) or an error string.
    ///
    /// OpenRouter wraps an upstream provider's failure in its own error, whose message says
    /// only "Provider returned error": the upstream's own error is in `metadata.raw` (its JSON
    /// body, or text). Its message is added to OpenRouter's, and its code and type stand in
    /// for missing ones, so an upstream's context overflow is recognised as one.
    pub fn from_value(error: &Value) -> Self {
        let mut details = Self::fields(error);
        let raw = error
            .get("metadata")
            .and_then(|metadata| metadata.get("raw"))
            .and_then(Value::as_str)
            .filter(|raw| !raw.trim().is_empty());
        if let Some(raw) = raw {
            // A string inside the error, so the shape of the event it came in did not count it:
            // read as text when it would parse past the limits.
            let parsed = crate::json_shape::JsonShape::fits([raw.as_bytes()])
                .then(|| serde_json::from_str::<Value>(raw).ok())
                .flatten();
            let upstream = match parsed {
                Some(value) => Self::fields(value.get("error").unwrap_or(&value)),
                None => Self {
                    message: Some(raw.trim().to_owned()),
                    ..Self::default()
                },
            };
            details.message = match (details.message.take(), upstream.message) {
                (Some(outer), Some(inner)) => Some(format!("{outer}: {inner}")),
                (outer, inner) => inner.or(outer),
            };
            details.code = details.code.or(upstream.code);
            details.kind = details.kind.or(upstream.kind);
        }
        details
    }

    /// The fields of one error object (or string), without looking into a wrapped one.
    fn fields(error: &Value) -> Self {
        if let Some(text) = error.as_str() {
            return Self {
                message: Some(text.to_owned()),
                ..Self::default()
            };
        }
        let string = |key: &str| error.get(key).and_then(Value::as_str).map(str::to_owned);
        let code = error.get("code");
        Self {
            message: string("message").or_else(|| string("detail")),
            code: code.and_then(Value::as_str).map(str::to_owned),
            kind: string("type"),
            status: code.and_then(Value::as_u64).and_then(|c| u16::try_from(c).ok()),
        }
    }

    fn is(&self, words: &[&str]) -> bool {
        let matches = |field: &Option<String>| field.as_deref().is_some_and(|v| words.iter().any(|w| v.contains(w)));
        matches(&self.code) || matches(&self.kind)
    }

    fn message_lower(&self) -> String {
        self.message.as_deref().unwrap_or_default().to_lowercase()
    }

    /// Whether the error says the request does not fit the model's context window. The phrases
    /// are the providers' own, kept narrow so that unrelated 400s stay `BadRequest`:
    /// - OpenAI: code `context_length_exceeded`, "maximum context length is …";
    /// - Anthropic: "prompt is too long: …", and "input length and `max_tokens` exceed context
    ///   limit: …" (the prompt fits but prompt + `max_tokens` does not);
    /// - llama.cpp's server: type `exceed_context_size_error`, "… exceeds the available context
    ///   size …";
    /// - Gemini (its OpenAI-compatible endpoint): "The input token count (…) exceeds the
    ///   maximum number of tokens allowed (…)";
    /// - xAI: "This model's maximum prompt length is … but the request contains … tokens";
    /// - Ollama: "prompt too long; exceeded max context length by … tokens";
    /// - LM Studio: "… is greater than the context length …";
    /// - Moonshot (Kimi): "… exceeded model token limit: …";
    /// - Together: "… is longer than the model's context length …";
    /// - OpenRouter, for an upstream's refusal: "… maximum allowed input length …";
    /// - DashScope (Qwen): "Range of input length should be [1, …]";
    /// - GitHub Copilot: "prompt token count of … exceeds the limit of …";
    /// - Hugging Face text-generation-inference (a 422): "Input validation error: `inputs`
    ///   tokens + `max_new_tokens` must be <= …", or "… `inputs` must have less than … tokens".
    fn is_context_overflow(&self) -> bool {
        let message = self.message_lower();
        self.is(&[
            "context_length_exceeded",
            "context_window_exceeded",
            "exceed_context_size_error",
        ]) || [
            "maximum context length",
            "context_length_exceeded",
            "prompt is too long",
            "context window",
            "exceed context limit",
            "exceeds the available context size",
            "input token count",
            "maximum prompt length",
            "prompt too long",
            "max context length",
            "greater than the context length",
            "exceeded model token limit",
            "longer than the model's context length",
            "maximum allowed input length",
            "range of input length should be",
            "prompt token count of",
            "tokens + `max_new_tokens` must be",
            "`inputs` must have less than",
        ]
        .iter()
        .any(|needle| message.contains(needle))
    }

    fn is_unknown_model(&self) -> bool {
        let message = self.message_lower();
        self.is(&["model_not_found", "not_found_error"])
            || (message.contains("model")
                && [
                    "does not exist",
                    "not found",
                    "unknown model",
                    "no such model",
                    "nonexistent",
                    "invalid model",
                    "not a valid model",
                ]
                .iter()
                .any(|needle| message.contains(needle)))
    }
}

/// Maps a failed call to a [`ProviderError`]. `status` is `None` for errors reported inside an
/// event stream; the error's type or code decides then.
pub(crate) fn map_error(
    ctx: &CallContext,
    status: Option<u16>,
    retry_after: Option<Duration>,
    details: &ErrorDetails,
    raw_body: &str,
) -> ProviderError {
    use ProviderErrorKind as K;
    let said = match &details.message {
        // Capped as a body is: a provider's message can be as long as it likes.
        Some(message) if !message.trim().is_empty() => ctx.quote(message.trim(), BODY_SNIPPET_CHARS),
        _ => {
            let snippet = ctx.quote(raw_body.trim(), BODY_SNIPPET_CHARS);
            if snippet.is_empty() {
                "no details given".to_owned()
            } else {
                snippet
            }
        }
    };
    let provider = &ctx.provider;
    let http = status.map(|s| format!(" (HTTP {s})")).unwrap_or_default();
    let effective = status.or(details.status);
    let kind = match effective {
        Some(401 | 403) => K::Unauthorized,
        Some(413) => K::ContextOverflow,
        _ if details.is_context_overflow() => K::ContextOverflow,
        Some(404) => K::UnknownModel,
        Some(400 | 422) if details.is_unknown_model() => K::UnknownModel,
        // Out of credit: waiting does not help, so it is not retried.
        Some(429) if details.is(&["insufficient_quota"]) => K::BadRequest,
        Some(429) => K::RateLimited,
        Some(500..=599) => K::Server,
        // The server (or a proxy) gave up waiting for the request: it may go through again.
        Some(408) => K::Timeout,
        Some(400..=499) => K::BadRequest,
        Some(_) => K::InvalidResponse,
        None if details.is(&["authentication", "permission", "invalid_api_key", "unauthorized"]) => K::Unauthorized,
        None if details.is_unknown_model() => K::UnknownModel,
        None if details.is(&["rate_limit"]) => K::RateLimited,
        None if details.is(&["invalid_request"]) => K::BadRequest,
        None => K::Server,
    };
    let message = match kind {
        // A provider whose key is optional sent none: the server wants one.
        K::Unauthorized if !ctx.key_sent => format!(
            "[flue] Provider \"{provider}\" requires an API key{http}, and none was sent: {} is not set. The provider said: {said}",
            ctx.key_env
        ),
        // A 403 is not always the key's fault: providers answer it for a model or region the
        // key may not use, and OpenRouter for input its moderation refused.
        K::Unauthorized if effective == Some(403) => format!(
            "[flue] Provider \"{provider}\" refused the request{http}: the key in {} may not use this model or region, or the input was refused. The provider said: {said}",
            ctx.key_env
        ),
        K::Unauthorized => format!(
            "[flue] Provider \"{provider}\" refused the API key{http}: check {}. The provider said: {said}",
            ctx.key_env
        ),
        K::ContextOverflow => format!(
            "[flue] The request does not fit the context window of \"{provider}/{}\"{http}: {said}",
            ctx.model
        ),
        // OpenRouter's 404 when none of the model's providers can serve the request (tools,
        // images, a data policy): the model and the base URL are fine.
        K::UnknownModel if effective == Some(404) && details.message_lower().contains("no endpoints found") => format!(
            "[flue] Provider \"{provider}\" has no endpoint for \"{}\" that serves this request{http}: none of the model's providers supports what it asks (tools or images, say), or the account's data policy rules them out. The provider said: {said}",
            ctx.model
        ),
        // A 404 that names no model may be a wrong base URL (a missing `/v1`) as well.
        K::UnknownModel if effective == Some(404) && !details.message_lower().contains("model") => format!(
            "[flue] Provider \"{provider}\" found no model \"{}\" at its endpoint{http}: the model is unknown or the base URL is wrong. The provider said: {said}",
            ctx.model
        ),
        K::UnknownModel => {
            format!(
                "[flue] Provider \"{provider}\" does not know the model \"{}\"{http}: {said}",
                ctx.model
            )
        }
        K::RateLimited => format!("[flue] Provider \"{provider}\" rate-limited the request{http}: {said}"),
        K::Server => format!("[flue] Provider \"{provider}\" failed with a server error{http}: {said}"),
        K::BadRequest => format!("[flue] Provider \"{provider}\" rejected the request{http}: {said}"),
        K::Timeout => format!("[flue] Provider \"{provider}\" timed out waiting for the request{http}: {said}"),
        _ => format!("[flue] Provider \"{provider}\" answered with an unexpected status{http}: {said}"),
    };
    let retryable_kind = matches!(kind, K::RateLimited | K::Server | K::Timeout);
    let mut error = ProviderError {
        kind,
        message,
        status,
        retry_after,
        retried: 0,
    };
    if let Some(asked) = retry_after.filter(|_| retryable_kind && error.waits_too_long()) {
        // Retryable but for the wait: said, so the reader knows when to try again.
        let asked = if asked > Duration::from_secs(365 * 24 * 3600) {
            "over a year".to_owned()
        } else {
            // Whole seconds (an HTTP date's wait would say its nanoseconds).
            let whole = asked.as_secs() + u64::from(asked.subsec_nanos() > 0);
            humantime::format_duration(Duration::from_secs(whole)).to_string()
        };
        error.message.push_str(&format!(
            " The provider asks to wait {asked} before another request, longer than a retry waits ({}): not retried.",
            humantime::format_duration(crate::runtime::MAX_RETRY_AFTER_WAIT)
        ));
    }
    error
}

/// Refuses a stream event whose JSON would parse past [`crate::MAX_JSON_CONTAINERS`] or
/// [`crate::MAX_JSON_VALUES`]: the call fails as an invalid response. Every parse of an event's
/// data, typed or not, comes after it: an event may be 16 MiB, and 16 MiB of small objects
/// parse to more than a gigabyte.
pub(crate) fn check_event_shape(ctx: &CallContext, data: &str) -> Result<(), ProviderError> {
    if crate::json_shape::JsonShape::fits([data.as_bytes()]) {
        return Ok(());
    }
    Err(ProviderError::new(
        ProviderErrorKind::InvalidResponse,
        format!(
            "[flue] Provider \"{}\" sent a stream event holding more than {} JSON objects and arrays, or {} JSON values.",
            ctx.provider,
            crate::MAX_JSON_CONTAINERS,
            crate::MAX_JSON_VALUES
        ),
    ))
}

/// The error an SSE `error` event reports (its payload's shape checked first): llama.cpp's
/// `error:` line (see the SSE decoder) or an `error` event, whose data is the error object,
/// an envelope holding it under `error`, or text that says what went wrong. A `data: [DONE]`
/// the server sent without a blank line before it ends up in the same event.
pub(crate) fn error_event(ctx: &CallContext, data: &str) -> ProviderError {
    if let Err(error) = check_event_shape(ctx, data) {
        return error;
    }
    let said = data.strip_suffix("\n[DONE]").unwrap_or(data);
    let details = match serde_json::from_str::<Value>(said) {
        Ok(error) => ErrorDetails::from_value(error.get("error").unwrap_or(&error)),
        Err(_) => ErrorDetails::from_value(&Value::String(said.to_owned())),
    };
    map_error(ctx, None, None, &details, said)
}

/// Parses one event's JSON payload; a malformed payload is an `InvalidResponse`, and so is
/// one holding more JSON than [`MAX_JSON_CONTAINERS`](crate::MAX_JSON_CONTAINERS) and
/// [`MAX_JSON_VALUES`](crate::MAX_JSON_VALUES) allow (an event may be 16 MiB long, and parsed
/// small objects take far more memory than their text), refused before it is parsed. A `\u`
/// escape of a lone UTF-16 surrogate, which JavaScript writes for half an emoji (a relay that
/// cut a delta inside one), reads as U+FFFD, as the HTTP side reads it: the answer loses a
/// character, not the call.
pub(crate) fn parse_event_json(ctx: &CallContext, data: &str) -> Result<Value, ProviderError> {
    check_event_shape(ctx, data)?;
    serde_json::from_str(data)
        .or_else(|error| {
            crate::json_shape::without_lone_surrogates(data)
                .and_then(|repaired| serde_json::from_str(&repaired).ok())
                .ok_or(error)
        })
        .map_err(|error| {
            ProviderError::new(
                ProviderErrorKind::InvalidResponse,
                format!(
                    "[flue] Provider \"{}\" sent a malformed stream event ({error}): {}",
                    ctx.provider,
                    ctx.quote(data, EVENT_SNIPPET_CHARS)
                ),
            )
        })
}

/// The error of a stream that ended before the response completed.
pub(crate) fn ended_early(ctx: &CallContext) -> ProviderError {
    ProviderError::new(
        ProviderErrorKind::Network,
        format!(
            "[flue] Provider \"{}\": the stream ended before the response completed.",
            ctx.provider
        ),
    )
}

/// What a decoder wants after one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    /// Read on.
    Continue,
    /// Read on: the event was a keep-alive (Anthropic's `ping`, an event with no data, a chunk
    /// that carries nothing of the answer), which moves the response no more than an SSE
    /// comment does (see [`Driver::quiet`]).
    KeepAlive,
    /// The response is complete (the decoder pushed `Completed`); stop reading.
    Done,
}

/// Turns a provider's server-sent events into [`StreamEvent`]s.
pub(crate) trait SseDecoder: Send + 'static {
    /// Handles one event, pushing what it yields onto `out`.
    fn event(&mut self, event: &Event<'_>, out: &mut VecDeque<StreamEvent>) -> Result<Flow, ProviderError>;

    /// The body ended without a terminal event: push `Completed` if the response is complete
    /// anyway, else fail.
    fn end(&mut self, out: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError>;
}

/// A failure reading the response body.
#[derive(Debug)]
enum BodyError {
    /// The connection failed.
    Transport(reqwest::Error),
    /// Nothing arrived for the idle timeout.
    Idle(Duration),
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Transport(error) => write!(f, "{}", without_url_secrets(&error_chain(error))),
            Self::Idle(idle) => write!(f, "no data for {}", humantime::format_duration(*idle)),
        }
    }
}

type BodyStream = Pin<Box<dyn Stream<Item = Result<Bytes, reqwest::Error>> + Send>>;
/// The call's response once it started, and how many times it was retried first.
type Connect = Pin<Box<dyn Future<Output = Result<(reqwest::Response, u32), ProviderError>> + Send>>;

/// A body stream that fails when no chunk arrives for `idle` while it is waited on: the
/// silence is the server's from when the reader asks for the next chunk, not the time the
/// reader spent elsewhere in between (hooks awaited between two events, a store commit).
struct IdleTimeout {
    inner: BodyStream,
    sleep: Pin<Box<Sleep>>,
    idle: Duration,
    finished: bool,
    /// A chunk was handed out: the next poll starts a new wait.
    delivered: bool,
}

/// When a body silent for `idle` from now is taken for dead: `Duration::MAX` (no limit) is a
/// century, not an overflow.
fn idle_deadline(idle: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(idle)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

impl Stream for IdleTimeout {
    type Item = Result<Bytes, BodyError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(None);
        }
        match this.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                this.delivered = true;
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(error))) => {
                this.finished = true;
                Poll::Ready(Some(Err(BodyError::Transport(error))))
            }
            Poll::Ready(None) => {
                this.finished = true;
                Poll::Ready(None)
            }
            Poll::Pending => {
                if std::mem::take(&mut this.delivered) {
                    this.sleep.as_mut().reset(idle_deadline(this.idle));
                }
                match this.sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        this.finished = true;
                        Poll::Ready(Some(Err(BodyError::Idle(this.idle))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

enum Phase {
    Connecting(Connect),
    /// The body, parsed by the driver's `parser`.
    Reading(Pin<Box<IdleTimeout>>),
    Finished,
}

/// The state of one streamed call.
struct Driver<D> {
    phase: Phase,
    decoder: D,
    out: VecDeque<StreamEvent>,
    failure: Option<ProviderError>,
    idle: Duration,
    ctx: CallContext,
    parser: SseParser,
    /// The bytes the body may still bring (see [`MAX_RESPONSE_BYTES`]).
    budget: usize,
    /// How many times the call was retried before its response started: an error of the
    /// stream carries them too, so the turn loop's retries and these never pass its budget.
    retried: u32,
    /// How long the body was waited on since its last event that was not a keep-alive: SSE
    /// comments (the keep-alives a gateway sends while its upstream is queued or stuck) and
    /// keep-alive events ([`Flow::KeepAlive`]: Anthropic's `ping`) reset the idle timeout of
    /// the bytes, not this; past [`keep_alive_limit`] of `idle` the call fails.
    quiet: Duration,
}

/// The most bytes one streamed response may bring. Far beyond any real answer (a model's
/// longest output, at a couple of hundred bytes of event per token, is tens of MiB), it ends a
/// server that streams forever (a local model without a token limit, a broken proxy) before
/// what the call keeps of it exhausts memory.
const MAX_RESPONSE_BYTES: usize = 256 * 1024 * 1024;

impl<D: SseDecoder> Driver<D> {
    async fn next(&mut self) -> Option<Result<StreamEvent, ProviderError>> {
        loop {
            if let Some(event) = self.out.pop_front() {
                return Some(Ok(event));
            }
            if let Some(error) = self.failure.take() {
                return Some(Err(ProviderError {
                    retried: error.retried.max(self.retried),
                    ..error
                }));
            }
            match &mut self.phase {
                Phase::Finished => return None,
                Phase::Connecting(connect) => match connect.await {
                    Ok((response, retried)) => {
                        self.retried = retried;
                        self.phase = self.start_reading(response).await;
                    }
                    Err(error) => self.fail(error),
                },
                Phase::Reading(body) => match self.parser.next_event() {
                    Ok(Some(event)) => match self.decoder.event(&event, &mut self.out) {
                        Ok(Flow::Continue) => self.quiet = Duration::ZERO,
                        Ok(Flow::KeepAlive) => {}
                        Ok(Flow::Done) => self.phase = Phase::Finished,
                        Err(error) => self.fail(error),
                    },
                    Ok(None) if self.quiet > keep_alive_limit(self.idle) => {
                        let error = self.only_keep_alives();
                        self.fail(error);
                    }
                    Ok(None) => match waited(&mut self.quiet, body.next()).await {
                        Some(Ok(chunk)) if chunk.len() > self.budget => {
                            let error = self.too_long();
                            self.fail(error);
                        }
                        Some(Ok(chunk)) => {
                            self.budget -= chunk.len();
                            self.parser.push(&chunk);
                        }
                        Some(Err(error)) => {
                            let error = self.body_error(&error);
                            self.fail(error);
                        }
                        // An unterminated last event is discarded, as the standard says.
                        None => {
                            if let Err(error) = self.decoder.end(&mut self.out) {
                                self.failure = Some(error);
                            }
                            self.phase = Phase::Finished;
                        }
                    },
                    Err(error) => {
                        let error = self.stream_error(&error);
                        self.fail(error);
                    }
                },
            }
        }
    }

    fn fail(&mut self, error: ProviderError) {
        self.failure = Some(error);
        self.phase = Phase::Finished;
    }

    fn only_keep_alives(&self) -> ProviderError {
        ProviderError::new(
            ProviderErrorKind::Timeout,
            format!(
                "[flue] Provider \"{}\" sent only keep-alives for {} while streaming the response.",
                self.ctx.provider,
                humantime::format_duration(keep_alive_limit(self.idle))
            ),
        )
    }

    fn too_long(&self) -> ProviderError {
        ProviderError::new(
            ProviderErrorKind::InvalidResponse,
            format!(
                "[flue] Provider \"{}\" streamed more than {} MiB without ending its response.",
                self.ctx.provider,
                MAX_RESPONSE_BYTES / (1024 * 1024)
            ),
        )
    }

    /// Starts reading an event stream, or fails when the server answered with JSON (an error
    /// reported with a 2xx status, or a server that ignored `stream: true`) or with another
    /// type of document (a login page, a wrong base URL): an invalid response, not retried.
    /// A response without a content type is read as a stream.
    async fn start_reading(&mut self, response: reqwest::Response) -> Phase {
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_ascii_lowercase();
        if !content_type.is_empty()
            && !content_type.starts_with("text/event-stream")
            && !content_type.starts_with("application/json")
        {
            let status = response.status().as_u16();
            let body = error_body(response, self.idle).await;
            self.failure = Some(ProviderError {
                status: Some(status),
                ..ProviderError::new(
                    ProviderErrorKind::InvalidResponse,
                    format!(
                        "[flue] Provider \"{}\" answered with {} instead of an event stream: {}",
                        self.ctx.provider,
                        self.ctx.quote(&content_type, 100),
                        self.ctx.quote(&body, BODY_SNIPPET_CHARS)
                    ),
                )
            });
            return Phase::Finished;
        }
        if content_type.starts_with("application/json") {
            let status = response.status().as_u16();
            let body = error_body(response, self.idle).await;
            let error = match serde_json::from_str::<Value>(&body) {
                Ok(value) if value.get("error").is_some_and(|e| !e.is_null()) => {
                    map_error(&self.ctx, None, None, &ErrorDetails::from_body(&body), &body)
                }
                _ => ProviderError {
                    status: Some(status),
                    ..ProviderError::new(
                        ProviderErrorKind::InvalidResponse,
                        format!(
                            "[flue] Provider \"{}\" answered with JSON instead of an event stream.",
                            self.ctx.provider
                        ),
                    )
                },
            };
            self.failure = Some(error);
            return Phase::Finished;
        }
        let body: BodyStream = Box::pin(response.bytes_stream());
        let guarded = IdleTimeout {
            inner: body,
            sleep: Box::pin(tokio::time::sleep(self.idle)),
            idle: self.idle,
            delivered: false,
            finished: false,
        };
        Phase::Reading(Box::pin(guarded))
    }

    fn stream_error(&self, error: &SseError) -> ProviderError {
        let provider = &self.ctx.provider;
        match error {
            SseError::TooLarge { .. } => ProviderError::new(
                ProviderErrorKind::InvalidResponse,
                format!("[flue] Provider \"{provider}\" sent a malformed event stream: {error}."),
            ),
        }
    }

    fn body_error(&self, error: &BodyError) -> ProviderError {
        let provider = &self.ctx.provider;
        match error {
            BodyError::Idle(idle) => ProviderError::new(
                ProviderErrorKind::Timeout,
                format!(
                    "[flue] Provider \"{provider}\" sent nothing for {} while streaming the response.",
                    humantime::format_duration(*idle)
                ),
            ),
            BodyError::Transport(error) => ProviderError::new(
                ProviderErrorKind::Network,
                format!(
                    "[flue] The connection to provider \"{provider}\" failed while streaming the response: {}",
                    self.ctx.quote_error(error)
                ),
            ),
        }
    }
}

/// The [`ModelStream`] of one call: awaits `connect` (the retried request), then decodes the
/// event stream with `decoder`. Nothing happens until the stream is first polled.
pub(crate) fn sse_stream<D, F>(connect: F, decoder: D, idle: Duration, ctx: CallContext) -> ModelStream
where
    D: SseDecoder,
    F: Future<Output = Result<(reqwest::Response, u32), ProviderError>> + Send + 'static,
{
    driven(driver(Box::pin(connect), decoder, idle, ctx))
}

fn driver<D: SseDecoder>(connect: Connect, decoder: D, idle: Duration, ctx: CallContext) -> Driver<D> {
    Driver {
        phase: Phase::Connecting(connect),
        decoder,
        out: VecDeque::new(),
        failure: None,
        idle,
        ctx,
        parser: SseParser::default(),
        budget: MAX_RESPONSE_BYTES,
        retried: 0,
        quiet: Duration::ZERO,
    }
}

/// How long a streamed response may send only keep-alives (SSE comments, keep-alive events):
/// five times the idle timeout, at most ten minutes more than it (10 minutes for the default
/// 120 s). Longer than a silent server gets, since a gateway's upstream may be queued; bounded,
/// since a stuck one would otherwise hold the turn until the submission's own timeout (an hour
/// by default).
fn keep_alive_limit(idle: Duration) -> Duration {
    idle.saturating_mul(5)
        .min(idle.saturating_add(Duration::from_secs(600)))
}

/// `next` awaited, its wait added to `quiet` (see [`Driver::quiet`]).
async fn waited<T>(quiet: &mut Duration, next: impl Future<Output = T>) -> T {
    let started = tokio::time::Instant::now();
    let next = next.await;
    *quiet = quiet.saturating_add(started.elapsed());
    next
}

/// The driver is boxed: `unfold` moves its state in and out of each step's future, once per
/// event, and the driver (decoder, parser, buffers) is hundreds of bytes.
fn driven<D: SseDecoder>(driver: Driver<D>) -> ModelStream {
    Box::pin(futures_util::stream::unfold(
        Box::new(driver),
        |mut driver| async move {
            let item = driver.next().await?;
            Some((item, driver))
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The idle timeout measures the server's silence while the body is waited on: a reader
    /// busy elsewhere between two chunks (awaiting hooks, a commit) for longer than the
    /// timeout does not make the next chunk, arriving soon after it asks, a timeout. A server
    /// silent for the whole timeout while waited on still is.
    #[tokio::test(start_paused = true)]
    async fn the_idle_timeout_counts_only_the_silence_the_reader_waits_through() {
        use futures_util::StreamExt;
        let idle = Duration::from_secs(10);
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
        let chunks = futures_util::stream::unfold(receiver, |mut receiver| async move {
            receiver
                .recv()
                .await
                .map(|chunk| (Ok::<_, reqwest::Error>(chunk), receiver))
        });
        let mut body = IdleTimeout {
            inner: Box::pin(chunks),
            sleep: Box::pin(tokio::time::sleep(idle)),
            idle,
            finished: false,
            delivered: false,
        };
        sender.send(Bytes::from_static(b"first")).expect("the body is read");
        assert!(matches!(body.next().await, Some(Ok(chunk)) if chunk == "first"));
        // The reader is away for longer than the timeout.
        tokio::time::sleep(Duration::from_secs(30)).await;
        let late = sender.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            late.send(Bytes::from_static(b"second")).expect("the body is read");
        });
        assert!(matches!(body.next().await, Some(Ok(chunk)) if chunk == "second"));
        // Now the server is silent for the whole timeout.
        assert!(matches!(body.next().await, Some(Err(BodyError::Idle(_)))));
        drop(sender);
    }

    fn ctx() -> CallContext {
        CallContext::new(
            "openai",
            "OPENAI_API_KEY",
            "gpt-x",
            Some(ApiKey("sk-very-secret".to_owned())),
        )
    }

    fn map(status: Option<u16>, body: &str) -> ProviderError {
        map_error(&ctx(), status, None, &ErrorDetails::from_body(body), body)
    }

    /// OpenRouter's `metadata.raw` is a string inside the error, which the event's own shape
    /// did not count: past the limits it is read as text, not parsed.
    #[test]
    fn a_wrapped_upstream_error_past_the_json_limits_is_read_as_text() {
        let wrapped = |raw: String| {
            ErrorDetails::from_value(
                &serde_json::json!({"message": "Provider returned error", "metadata": {"raw": raw}}),
            )
        };
        let within = wrapped(r#"{"error":{"message":"context too long","code":"context_length_exceeded"}}"#.to_owned());
        assert_eq!(within.code.as_deref(), Some("context_length_exceeded"));
        let past = format!(
            r#"{{"error":{{"code":"context_length_exceeded","pad":[{}]}}}}"#,
            vec!["{}"; crate::MAX_JSON_CONTAINERS].join(",")
        );
        let details = wrapped(past.clone());
        assert_eq!(details.code, None, "not parsed");
        assert_eq!(details.message, Some(format!("Provider returned error: {past}")));
    }

    #[test]
    fn retry_after_accepts_seconds_and_http_dates_and_keeps_a_long_wait_whole() {
        assert_eq!(parse_retry_after("0"), Some(Duration::ZERO));
        assert_eq!(parse_retry_after(" 2 "), Some(Duration::from_secs(2)));
        assert_eq!(parse_retry_after("1.5"), Some(Duration::from_millis(1500)));
        // Longer than any retry waits: kept as asked (the call is then not retried).
        assert_eq!(parse_retry_after("3600"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_retry_after("1e300"), Some(Duration::MAX), "no overflow");
        assert_eq!(parse_retry_after("18446744073709551616"), Some(Duration::MAX));
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT"), Some(Duration::ZERO));
        let soon = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(10));
        let wait = parse_retry_after(&soon).unwrap_or_default();
        assert!(
            wait > Duration::from_secs(8) && wait <= Duration::from_secs(10),
            "{wait:?}"
        );
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(600));
        let wait = parse_retry_after(&later).unwrap_or_default();
        assert!(
            wait > Duration::from_secs(598) && wait <= Duration::from_secs(600),
            "{wait:?}"
        );
        assert_eq!(parse_retry_after("soon"), None);
        assert_eq!(parse_retry_after("-1"), None);
    }

    #[test]
    fn backoff_doubles_from_the_base_with_bounded_jitter_and_a_cap() {
        let policy = RetryPolicy::default();
        for retry in 0..3 {
            let nominal = Duration::from_secs(2) * 2u32.pow(retry);
            let wait = policy.backoff(retry);
            assert!(wait >= nominal * 3 / 4 && wait <= nominal, "retry {retry}: {wait:?}");
        }
        let capped = policy.backoff(40);
        assert!(
            capped >= MAX_RETRY_WAIT * 3 / 4 && capped <= MAX_RETRY_WAIT,
            "{capped:?}"
        );
        assert_eq!(RetryPolicy::none().backoff(2), Duration::ZERO);
    }

    #[test]
    fn statuses_and_bodies_map_to_kinds() {
        use ProviderErrorKind as K;
        assert_eq!(map(Some(401), "{}").kind, K::Unauthorized);
        assert_eq!(map(Some(403), "").kind, K::Unauthorized);
        assert_eq!(map(Some(404), "{}").kind, K::UnknownModel);
        // A 401 is the key; a 403 may be the model, the region or the input too; a 404 that
        // names no model may be the base URL.
        assert!(map(Some(401), "{}").message.contains("refused the API key"));
        let no_endpoint = map(
            Some(404),
            r#"{"error":{"message":"No endpoints found that support tool use.","code":404}}"#,
        );
        assert_eq!(no_endpoint.kind, K::UnknownModel);
        assert!(
            no_endpoint.message.contains("has no endpoint for"),
            "{}",
            no_endpoint.message
        );
        assert!(!no_endpoint.message.contains("base URL"), "{}", no_endpoint.message);
        let forbidden = map(Some(403), r#"{"error":{"message":"flagged for moderation"}}"#);
        assert!(
            forbidden
                .message
                .contains("may not use this model or region, or the input was refused"),
            "{}",
            forbidden.message
        );
        assert!(
            forbidden.message.contains("flagged for moderation"),
            "{}",
            forbidden.message
        );
        let not_found = map(Some(404), "Not Found").message;
        assert!(
            not_found.contains("the model is unknown or the base URL is wrong"),
            "{not_found}"
        );
        let no_model = map(Some(404), r#"{"error":{"message":"The model `gpt-x` does not exist"}}"#).message;
        assert!(no_model.contains("does not know the model"), "{no_model}");
        let unknown = r#"{"error":{"message":"The model `gpt-x` does not exist","code":"model_not_found"}}"#;
        assert_eq!(map(Some(400), unknown).kind, K::UnknownModel);
        assert_eq!(map(Some(429), "").kind, K::RateLimited);
        assert_eq!(map(Some(500), "").kind, K::Server);
        assert_eq!(
            map(Some(529), r#"{"type":"error","error":{"type":"overloaded_error"}}"#).kind,
            K::Server
        );
        assert_eq!(map(Some(413), "").kind, K::ContextOverflow);
        let openai = r#"{"error":{"message":"too long","code":"context_length_exceeded"}}"#;
        assert_eq!(map(Some(400), openai).kind, K::ContextOverflow);
        let openai_text = r#"{"error":{"message":"This model's maximum context length is 8192 tokens"}}"#;
        assert_eq!(map(Some(400), openai_text).kind, K::ContextOverflow);
        let anthropic = r#"{"type":"error","error":{"type":"invalid_request_error",
            "message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#;
        assert_eq!(map(Some(400), anthropic).kind, K::ContextOverflow);
        let anthropic_max_tokens = r#"{"type":"error","error":{"type":"invalid_request_error",
            "message":"input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000, decrease input length or `max_tokens` and try again"}}"#;
        assert_eq!(map(Some(400), anthropic_max_tokens).kind, K::ContextOverflow);
        let llama_cpp = r#"{"error":{"code":400,"message":"request (9412 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9412,"n_ctx":8192}}"#;
        assert_eq!(map(Some(400), llama_cpp).kind, K::ContextOverflow);
        // Either sign alone is enough (the type without the message, the message without it).
        let llama_type = r#"{"error":{"message":"too many tokens","type":"exceed_context_size_error"}}"#;
        assert_eq!(map(Some(400), llama_type).kind, K::ContextOverflow);
        let llama_text = r#"{"error":{"message":"request exceeds the available context size"}}"#;
        assert_eq!(map(Some(400), llama_text).kind, K::ContextOverflow);
        let gemini = r#"{"error":{"code":400,"message":"The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}"#;
        assert_eq!(map(Some(400), gemini).kind, K::ContextOverflow);
        // Gemini answers with an array of errors; the first one says what happened.
        let gemini_array = r#"[{"error":{"code":400,"message":"The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}]"#;
        let overflow = map(Some(400), gemini_array);
        assert_eq!(overflow.kind, K::ContextOverflow);
        assert!(
            overflow.message.contains("The input token count (1200000)"),
            "{}",
            overflow.message
        );
        let xai = r#"{"code":"Client specified an invalid argument","error":"This model's maximum prompt length is 131072 but the request contains 140000 tokens."}"#;
        assert_eq!(map(Some(400), xai).kind, K::ContextOverflow);
        // The servers an OpenAI-compatible provider reaches, each in its own words.
        for said in [
            "prompt too long; exceeded max context length by 5000 tokens",
            "The number of tokens to keep from the initial prompt is greater than the context length. Try to load the model with a larger context length",
            "Invalid request: Your request exceeded model token limit: 131072",
            "Input is longer than the model's context length (32768 tokens)",
            "This endpoint's maximum allowed input length is 65536 tokens",
            "Range of input length should be [1, 30720]",
            "prompt token count of 130000 exceeds the limit of 128000",
        ] {
            let body = serde_json::json!({ "error": { "message": said } }).to_string();
            assert_eq!(map(Some(400), &body).kind, K::ContextOverflow, "{said}");
        }
        // text-generation-inference refuses with a 422 and a bare string.
        for said in [
            "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4090 `inputs` tokens and 100 `max_new_tokens`",
            "Input validation error: `inputs` must have less than 1024 tokens. Given: 1872",
        ] {
            let body = serde_json::json!({ "error": said, "error_type": "validation" }).to_string();
            assert_eq!(map(Some(422), &body).kind, K::ContextOverflow, "{said}");
        }
        // Ollama's error is a bare string.
        let ollama = r#"{"error":"prompt too long; exceeded max context length by 5000 tokens"}"#;
        assert_eq!(map(Some(400), ollama).kind, K::ContextOverflow);
        // A rate limit on tokens per minute is not the context window.
        let tpm = r#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 45000.","type":"tokens","code":"rate_limit_exceeded"}}"#;
        assert_eq!(map(Some(429), tpm).kind, K::RateLimited);
        let openrouter = r#"{"error":{"message":"gpt-x is not a valid model ID","code":400}}"#;
        assert_eq!(map(Some(400), openrouter).kind, K::UnknownModel);
        // Limits that are not the context window stay bad requests.
        let output_cap = r#"{"type":"error","error":{"type":"invalid_request_error",
            "message":"max_tokens: 128000 > 64000, which is the maximum allowed number of output tokens for claude-sonnet-4-5"}}"#;
        assert_eq!(map(Some(400), output_cap).kind, K::BadRequest);
        let size = r#"{"error":{"message":"image exceeds 5 MB maximum: 7340032 bytes > 5242880 bytes"}}"#;
        assert_eq!(map(Some(400), size).kind, K::BadRequest);
        let bad = map(Some(400), r#"{"error":{"message":"tools[0].name is invalid"}}"#);
        assert_eq!((bad.kind.clone(), bad.status), (K::BadRequest, Some(400)));
        assert!(bad.message.contains("tools[0].name is invalid"), "{}", bad.message);
        assert_eq!(
            map(None, r#"{"error":{"type":"overloaded_error","message":"Overloaded"}}"#).kind,
            K::Server
        );
        assert_eq!(
            map(None, r#"{"error":{"message":"slow down","code":429}}"#).kind,
            K::RateLimited
        );
        assert_eq!(
            map(None, r#"{"error":{"type":"rate_limit_error","message":"x"}}"#).kind,
            K::RateLimited
        );
        assert_eq!(
            map(None, r#"{"error":{"type":"authentication_error","message":"x"}}"#).kind,
            K::Unauthorized
        );
    }

    #[test]
    fn a_401_without_a_key_sent_says_the_variable_is_unset_not_that_the_key_was_refused() {
        let ctx = CallContext::new("vllm", "VLLM_API_KEY", "m", None);
        let body = r#"{"error":{"message":"Unauthorized"}}"#;
        let error = map_error(&ctx, Some(401), None, &ErrorDetails::from_body(body), body);
        assert_eq!(error.kind, ProviderErrorKind::Unauthorized);
        assert!(
            error
                .message
                .contains("requires an API key (HTTP 401), and none was sent: VLLM_API_KEY is not set"),
            "{}",
            error.message
        );
        assert!(map(Some(401), body).message.contains("refused the API key"));
        // A 403 (a server that answers a missing header so) says the same.
        let forbidden = map_error(&ctx, Some(403), None, &ErrorDetails::from_body(body), body);
        assert!(forbidden.message.contains("none was sent"), "{}", forbidden.message);
    }

    #[test]
    fn error_messages_never_contain_the_key() {
        let body = r#"{"error":{"message":"Incorrect API key provided: sk-very-secret."}}"#;
        let error = map(Some(401), body);
        assert!(error.message.contains("OPENAI_API_KEY"), "{}", error.message);
        assert!(!error.message.contains("sk-very-secret"), "{}", error.message);
        let raw = map(Some(500), "upstream failed for key sk-very-secret");
        assert!(!raw.message.contains("sk-very-secret"), "{}", raw.message);
        assert_eq!(
            format!("{:?}", ApiKey("sk-very-secret".to_owned())),
            "ApiKey(<redacted>)"
        );
    }

    /// Quoting redacts a prefix of a long text only: what it shows is what redacting the whole
    /// text would show, wherever a form of the key sits (cut by the prefix or not).
    #[test]
    fn a_quote_of_a_long_text_shows_what_redacting_all_of_it_would() {
        let ctx = ctx();
        let whole = |text: &str, max_chars: usize| {
            let redacted = ctx.redact(&without_url_secrets(text));
            match redacted.char_indices().nth(max_chars) {
                Some((end, _)) => format!("{}…", &redacted[..end]),
                None => redacted,
            }
        };
        let key = "sk-very-secret";
        let escaped: String = key.bytes().map(|byte| format!("\\u{byte:04x}")).collect();
        let percent: String = key.bytes().map(|byte| format!("%{byte:02X}")).collect();
        let mut quoted = 0;
        for form in [key, escaped.as_str(), percent.as_str()] {
            for lead in (0..700).step_by(7) {
                // Runs of the key, which redaction shortens to one `[redacted]`, too.
                for filler in ["x", "é", "%", form] {
                    let text = format!("{}{form}{}", filler.repeat(lead), "%".repeat(4000));
                    for max_chars in [8, 120] {
                        let shown = ctx.quote(&text, max_chars);
                        assert_eq!(shown, whole(&text, max_chars), "{form} after {lead} {filler}");
                        assert!(!shown.contains("sk-v") && !shown.contains("\\u0073\\u006b"), "{shown}");
                        quoted += 1;
                    }
                }
            }
        }
        assert_eq!(quoted, 3 * 100 * 4 * 2);
    }

    #[test]
    fn a_key_straddling_the_quoted_length_is_removed_before_the_cut() {
        let key = "sk-very-secret";
        // Multi-byte text before the key, so the cut also has to fall on a character boundary.
        for lead in [290, 292, 296] {
            let body = format!("{}{key} trailing", "é".repeat(lead));
            let error = map(Some(500), &body);
            assert!(!error.message.contains("sk-v"), "{lead}: {}", error.message);
        }
        for lead in [105, 110, 115] {
            let data = format!("{{{}{key}", "ü".repeat(lead));
            let error = parse_event_json(&ctx(), &data)
                .err()
                .map(|e| e.message)
                .unwrap_or_default();
            assert!(error.contains("malformed stream event"), "{error}");
            assert!(!error.contains("sk-v"), "{lead}: {error}");
        }
        assert_eq!(ctx().quote("ab sk-very-secret cd", 8), "ab [reda…");
        // An event that would parse past the JSON limits is refused before it is parsed.
        let at_limit = format!("[{}]", vec!["{}"; crate::MAX_JSON_CONTAINERS - 1].join(","));
        assert!(parse_event_json(&ctx(), &at_limit).is_ok());
        let past = format!("[{}]", vec!["{}"; crate::MAX_JSON_CONTAINERS].join(","));
        let error = parse_event_json(&ctx(), &past).expect_err("past the limit");
        assert_eq!(error.kind, ProviderErrorKind::InvalidResponse);
        assert!(error.message.contains("100000 JSON objects"), "{}", error.message);
        assert_eq!(ctx().quote("ééé", 2), "éé…");
        assert_eq!(ctx().quote("ééé", 3), "ééé");
        assert_eq!(ctx().quote("short", 300), "short");
    }

    /// A call context whose key holds the characters JSON and URLs escape.
    fn ctx_with_key(key: &str) -> CallContext {
        CallContext::new("openai", "OPENAI_API_KEY", "gpt-x", Some(ApiKey(key.to_owned())))
    }

    #[test]
    fn escaped_and_percent_encoded_keys_are_redacted() {
        let ctx = ctx_with_key(r#"sk/ab+c"d\e=f~g"#);
        let forms = [
            r#"sk/ab+c"d\e=f~g"#,
            // JSON, as serde_json writes it and with `/` escaped too (PHP and others do).
            r#"sk/ab+c\"d\\e=f~g"#,
            r#"sk\/ab+c\"d\\e=f~g"#,
            // Percent-encoded, in either hex case, and as a form value.
            "sk%2Fab%2Bc%22d%5Ce%3Df~g",
            "sk%2fab%2bc%22d%5ce%3df~g",
            "sk%2Fab%2Bc%22d%5Ce%3Df%7Eg",
        ];
        for form in forms {
            let said = ctx.redact(&format!("before {form} after"));
            assert_eq!(said, "before [redacted] after", "{form}");
        }
        // Through the paths that quote provider text: a body that is not JSON, a malformed event.
        let body = r#"{"error": "bad key sk\/ab+c\"d\\e=f~g" (truncated"#;
        let error = map_error(&ctx, Some(401), None, &ErrorDetails::from_body(body), body);
        assert!(error.message.contains("[redacted]"), "{}", error.message);
        assert!(!error.message.contains("ab+c"), "{}", error.message);
        let url = "GET /v1/models?key=sk%2Fab%2Bc%22d%5Ce%3Df~g failed";
        let error = map_error(&ctx, Some(502), None, &ErrorDetails::from_body(url), url);
        assert!(!error.message.contains("ab%2B"), "{}", error.message);
        let event = parse_event_json(&ctx, r#"{"key":"sk\/ab+c\"d\\e=f~g""#)
            .err()
            .map(|e| e.message)
            .unwrap_or_default();
        assert!(event.contains("[redacted]") && !event.contains("ab+c"), "{event}");
    }

    /// Takes every event, ends nowhere.
    struct Endless;

    impl SseDecoder for Endless {
        fn event(&mut self, _: &Event<'_>, out: &mut VecDeque<StreamEvent>) -> Result<Flow, ProviderError> {
            out.push_back(StreamEvent::TextDelta("x".into()));
            Ok(Flow::Continue)
        }

        fn end(&mut self, _: &mut VecDeque<StreamEvent>) -> Result<(), ProviderError> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_response_streaming_beyond_its_byte_budget_fails_as_invalid() {
        let chunks =
            futures_util::stream::iter(std::iter::repeat_n("data: {}\n\n", 100).map(Ok::<_, std::convert::Infallible>));
        let response = axum::http::Response::builder()
            .header(CONTENT_TYPE, "text/event-stream")
            .body(reqwest::Body::wrap_stream(chunks))
            .expect("a response");
        let connect: Connect = Box::pin(async move { Ok((reqwest::Response::from(response), 0)) });
        let mut driver = driver(connect, Endless, Duration::from_secs(5), ctx());
        // Ten events' worth.
        driver.budget = 10 * "data: {}\n\n".len();
        let mut stream = driven(driver);
        let mut deltas = 0;
        let error = loop {
            match stream.next().await {
                Some(Ok(_)) => deltas += 1,
                Some(Err(error)) => break error,
                None => panic!("the stream ended without failing"),
            }
        };
        assert_eq!(deltas, 10);
        assert_eq!(error.kind, ProviderErrorKind::InvalidResponse, "{}", error.message);
        assert!(error.message.contains("streamed more than"), "{}", error.message);
        assert!(stream.next().await.is_none());
    }

    #[tokio::test]
    async fn a_connection_error_quotes_the_url_without_its_query() {
        // Some OpenAI-compatible servers take the key in the query (`?api-key=…`); reqwest's
        // error names the whole URL. Nothing listens on port 1.
        let url = "http://u:userinfo-secret@127.0.0.1:1/v1/chat/completions?api-key=query-secret#fragment-secret";
        let Err(error) = reqwest::Client::new().post(url).send().await else {
            panic!("something answered on port 1")
        };
        assert!(error.to_string().contains("query-secret"), "{error}");
        let error = transport_error(&error, &ctx());
        assert_eq!(error.kind, ProviderErrorKind::Network, "{}", error.message);
        assert!(
            error.message.contains("http://127.0.0.1:1/v1/chat/completions"),
            "{}",
            error.message
        );
        assert!(!error.message.contains("secret"), "{}", error.message);
    }

    #[test]
    fn keys_escaped_as_json_unicode_or_in_mixed_case_percent_encoding_are_redacted() {
        let ctx = ctx_with_key(r#"sk/ab+c"d\e=f~g"#);
        let forms = [
            // `\u` escapes (either hex case) for the characters JSON must or may escape, and
            // for any other: some encoders escape every non-alphanumeric character, or all.
            r#"sk\u002fab+c\u0022d\u005ce=f~g"#,
            r#"sk\u002Fab\u002Bc\"d\\e\u003Df\u007eg"#,
            r#"\u0073\u006B\u002F\u0061\u0062\u002B\u0063\u0022\u0064\u005C\u0065\u003D\u0066\u007E\u0067"#,
            // Percent-encoding with the hex case mixed, and escapes of unreserved characters.
            "sk%2fab%2Bc%22d%5Ce%3df~g",
            "%73k%2Fab%2bc%22d%5ce%3D%66%7eg",
        ];
        for form in forms {
            let said = ctx.redact(&format!("before {form} after"));
            assert_eq!(said, "before [redacted] after", "{form}");
            // Twice, and with a non-ASCII neighbour.
            let said = ctx.redact(&format!("{form}é{form}"));
            assert_eq!(said, "[redacted]é[redacted]", "{form}");
        }
        let body = r#"{"error": "bad key sk\u002Fab+c\u0022d\u005Ce=f~g"}"#;
        let error = map_error(&ctx, Some(401), None, &ErrorDetails::from_body(body), body);
        assert!(!error.message.contains("ab+c"), "{}", error.message);
        // Unrelated escapes stay as they are; an escaped backslash ends its escape (`\\u0073`
        // is a backslash and `u0073`, not `s`).
        for unrelated in [
            r#"path %2F, \u0041\u00e9 and sk/ab+c"d\e=f~ (cut)"#,
            r#"\\u0073k/ab+c"d\e=f~g"#,
            "100% sure, %zz, \\u12, \\uD83D\\uDE00 and \\uD83D alone",
        ] {
            assert_eq!(ctx.redact(unrelated), unrelated);
        }
    }

    #[test]
    fn a_provider_message_is_capped_after_redaction() {
        let long = format!(r#"{{"error":{{"message":"{}"}}}}"#, "é".repeat(20_000));
        let error = map(Some(400), &long);
        let said = error.message.rsplit(": ").next().unwrap_or_default();
        assert_eq!(said.chars().count(), BODY_SNIPPET_CHARS + 1, "{}", error.message);
        assert!(said.ends_with('…'), "{}", error.message);
        // The key is removed before the cut, wherever the cut falls.
        for lead in [290, 292, 296] {
            let body = format!(r#"{{"error":{{"message":"{}sk-very-secret tail"}}}}"#, "é".repeat(lead));
            let error = map(Some(400), &body);
            assert!(!error.message.contains("sk-v"), "{lead}: {}", error.message);
        }
        // A message within the limit is quoted whole, without the marker.
        let short = map(Some(400), r#"{"error":{"message":"tools[0].name is invalid"}}"#);
        assert!(
            short.message.ends_with(": tools[0].name is invalid"),
            "{}",
            short.message
        );
        // Errors reported inside an event stream take the same path.
        let streamed = map_error(
            &ctx(),
            None,
            None,
            &ErrorDetails::from_value(&serde_json::json!({ "message": "x".repeat(5_000) })),
            "",
        );
        assert!(streamed.message.len() < 600, "{}", streamed.message.len());
    }

    #[test]
    fn missing_key_names_the_environment_variable() {
        let source = KeySource::env("FLUE_HTTP_UNIT_TEST_SURELY_UNSET_KEY");
        let error = source.resolve("openai").err().map(|e| (e.kind, e.message));
        assert_eq!(
            error,
            Some((
                ProviderErrorKind::MissingKey,
                "[flue] Provider \"openai\" needs an API key: set FLUE_HTTP_UNIT_TEST_SURELY_UNSET_KEY.".to_owned()
            ))
        );
        let optional = KeySource {
            optional: true,
            ..source
        };
        assert_eq!(optional.resolve("local").ok(), Some(None));
    }

    #[test]
    fn an_endpoint_is_parsed_once_and_an_unparsable_one_kept_as_text() {
        let endpoint = Endpoint::default();
        let url = endpoint.url("http://127.0.0.1:9/v1/", "/chat/completions");
        assert_eq!(
            url.as_ref().map(reqwest::Url::as_str),
            Ok("http://127.0.0.1:9/v1/chat/completions")
        );
        // Parsed once: a later base URL does not change it (providers reset it on change).
        assert_eq!(endpoint.url("http://elsewhere", "x"), url);
        assert_eq!(
            Endpoint::default().url("not a url", "messages"),
            Err("not a url/messages".to_owned())
        );
    }

    #[test]
    fn endpoints_join_with_one_slash() {
        assert_eq!(endpoint("http://h/v1/", "/messages"), "http://h/v1/messages");
        assert_eq!(
            endpoint("http://h/v1", "chat/completions"),
            "http://h/v1/chat/completions"
        );
    }

    #[test]
    fn a_base_urls_query_and_fragment_stay_after_the_joined_path() {
        // Some OpenAI-compatible servers take their API version in the query.
        assert_eq!(
            endpoint(
                "https://h/openai/deployments/d?api-version=2024-10-21",
                "chat/completions"
            ),
            "https://h/openai/deployments/d/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(
            endpoint("https://h/v1/?a=1&b=2#f", "/messages"),
            "https://h/v1/messages?a=1&b=2#f"
        );
        assert_eq!(endpoint("https://h/v1#top", "x"), "https://h/v1/x#top");
    }
}
