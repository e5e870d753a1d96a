//! Remote MCP servers declared with `use_mcp_connection`.

use std::time::Duration;

use crate::tool::Secret;
use crate::url::url_without_path;

/// How the runtime talks to an MCP server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum McpTransport {
    /// Streamable HTTP (the default).
    #[default]
    StreamableHttp,
    /// Server-sent events.
    Sse,
}

/// A remote MCP server whose tools the agent mounts as `mcp__<server>__<tool>`.
#[derive(Clone, PartialEq)]
pub struct McpConnection {
    /// Server name (the middle segment of its tool names).
    pub name: String,
    /// Absolute endpoint URL.
    pub url: String,
    /// Transport.
    pub transport: McpTransport,
    /// Bearer token sent with every request.
    pub auth: Option<Secret>,
    /// Static request headers. The values of those that carry a credential (a name that says
    /// so: `…Key`, `…Token`, `…Auth…`, `Cookie`, a secret, a session, a pass or password, a
    /// bearer, an access or private value, a signature, with a value of 8 bytes or more, as
    /// `Authorization` and `Cookie` whatever their length; or a value holding an opaque token
    /// of 16 bytes or more mixing letters and digits) never show in what the server sends back
    /// to the model, its errors included. (`X-Bypass-Cache: true` is data: `true` is not cut
    /// out of results.)
    pub headers: Vec<(String, String)>,
    /// How long connecting, listing the tools and each call may take (60 s when `None`, the
    /// MCP SDK's default). A call past it is the tool's error result; the server may still
    /// be running it.
    pub timeout: Option<Duration>,
    /// Only these of the server's tools (its own names); all when `None`.
    pub tools: Option<Vec<String>>,
    /// Degrade to no tools (plus a narration signal) when the server is unreachable.
    pub optional: bool,
}

/// The URL without its userinfo, query and fragment, the headers without their values (a static
/// header is where an API key goes); the token is redacted by [`Secret`]'s Debug. A connection's
/// Debug ends up in logs.
impl std::fmt::Debug for McpConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(name, _)| (name.as_str(), "[redacted]"))
            .collect();
        f.debug_struct("McpConnection")
            .field("name", &self.name)
            .field("url", &url_without_path(&self.url))
            .field("transport", &self.transport)
            .field("auth", &self.auth)
            .field("headers", &headers)
            .field("timeout", &self.timeout)
            .field("tools", &self.tools)
            .field("optional", &self.optional)
            .finish()
    }
}

impl McpConnection {
    /// A connection to `url` named `name` (at most [`MAX_SERVER_NAME_CHARS`] characters: its
    /// tools are mounted as `mcp__<name>__<tool>`).
    pub fn new(name: impl Into<String>, url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            url: url.into(),
            transport: McpTransport::default(),
            auth: None,
            headers: Vec::new(),
            timeout: None,
            tools: None,
            optional: false,
        }
    }

    /// Sets the transport.
    pub fn transport(mut self, transport: McpTransport) -> Self {
        self.transport = transport;
        self
    }

    /// Sets the bearer token.
    pub fn auth(mut self, token: Secret) -> Self {
        self.auth = Some(token);
        self
    }

    /// Adds a static header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets how long connecting, listing and each call may take (default: 60 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Mounts only these tools.
    pub fn tools<I, S>(mut self, tools: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.tools = Some(tools.into_iter().map(Into::into).collect());
        self
    }

    /// Marks the server optional.
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }

    /// Checks the definition rules; `source` labels the message.
    pub(crate) fn check(&self, source: &str) -> Result<(), String> {
        let name = &self.name;
        if name.trim().is_empty() {
            return Err(format!("[flue] {source} name must be a non-empty string."));
        }
        let length = name.chars().count();
        if length > MAX_SERVER_NAME_CHARS {
            // Quoted cut: the name reaches the submission's failure and the records.
            let cut: String = name.chars().take(MAX_SERVER_NAME_CHARS).collect();
            return Err(format!(
                "[flue] {source} \"{cut}…\" name is {length} characters; at most {MAX_SERVER_NAME_CHARS} leave room \
                 for its tools' names (mounted as mcp__<server>__<tool>, at most 64 characters)."
            ));
        }
        if !is_absolute_url(&self.url) {
            // Quoted by its scheme and host only: the message reaches the submission's failure
            // and the records, and a token may sit in the userinfo, the query or the path.
            return Err(format!(
                "[flue] {source} \"{name}\" url {:?} is not a valid absolute URL.",
                url_without_path(&self.url)
            ));
        }
        if self.timeout.is_some_and(|timeout| timeout.is_zero()) {
            return Err(format!("[flue] {source} \"{name}\" timeout must be positive."));
        }
        if let Some(tools) = &self.tools
            && tools.iter().any(String::is_empty)
        {
            return Err(format!(
                "[flue] {source} \"{name}\" tools must be a list of tool names (the server's own names)."
            ));
        }
        if self.auth.as_ref().is_some_and(|token| token.expose().is_empty()) {
            return Err(format!("[flue] {source} \"{name}\" auth must be a bearer token."));
        }
        Ok(())
    }
}

/// The longest server name: its tools are mounted as `mcp__<server>__<tool>`, a name the
/// providers take up to 64 characters of, so a longer one would leave no room for the tool
/// part (every tool would be mounted under one name). A name near the bound leaves little:
/// tools whose names then collide refuse the server, naming them.
pub const MAX_SERVER_NAME_CHARS: usize = 56;

/// `scheme://host…` with an RFC 3986 scheme and a non-empty authority.
fn is_absolute_url(url: &str) -> bool {
    let Some((scheme, rest)) = url.split_once("://") else {
        return false;
    };
    let mut chars = scheme.chars();
    let scheme_ok = matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    scheme_ok && !authority.is_empty() && !url.chars().any(char::is_whitespace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_of_a_connection_shows_neither_its_token_nor_header_values_nor_url_secrets() {
        let connection = McpConnection::new("docs", "https://user:hunter2@mcp.example/mcp?key=hunter2#hunter2")
            .auth(Secret::new("token-hunter2"))
            .header("X-Api-Key", "hunter2");
        let debug = format!("{connection:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(
            debug.contains("https://mcp.example/…"),
            "the path may hold a key too: {debug}"
        );
        assert!(debug.contains("X-Api-Key"), "the header names stay: {debug}");
    }
}
