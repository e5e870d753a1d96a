//! Access control: an authorization callback that sees every request with the agent and
//! instance it addresses, and a ready bearer-token implementation of it.
//!
//! The protocol itself has no authentication; a router built with
//! [`HttpOptions::authorization`](super::HttpOptions::authorization) asks the callback before
//! any handler runs, and answers 401 `unauthorized` (with `WWW-Authenticate: Bearer`) or 403
//! `forbidden` when it refuses.

use std::collections::{HashMap, HashSet};
use std::fmt;

use axum::http::{HeaderMap, Method, header};
use flue_core::BoxFuture;
use sha2::{Digest, Sha256};

/// What a request asks for, as the authorization callback sees it. Its `Debug` shows the
/// values of credential headers as `[redacted]` (`Authorization`, `Cookie`,
/// `Proxy-Authorization`, any header named like a credential — `X-Api-Key`, `X-Auth-Token`,
/// a session's — and any value holding an opaque token), so logging a request logs no
/// secret.
#[derive(Clone, Copy)]
pub struct AccessRequest<'a> {
    /// The method.
    pub method: &'a Method,
    /// The path (without the query) as the client wrote it: still percent-encoded, so
    /// `/agents/a/%61dmin` addresses the instance `admin`. Decide on [`AccessRequest::agent`],
    /// [`AccessRequest::instance_id`] and [`AccessRequest::user_id`] (decoded, what the
    /// handlers serve), not by matching this text.
    pub path: &'a str,
    /// The headers (the credentials are here).
    pub headers: &'a HeaderMap,
    /// The agent addressed; `None` for the catalog and for a path no route serves (the
    /// policy is asked before such a request is answered 404, so that an unauthorized client
    /// cannot tell agents' names from others).
    pub agent: Option<&'a str>,
    /// The instance addressed; `None` for the catalog, user routes, a path no route serves,
    /// and an agent's path without an instance id (`/agents/<name>/`).
    pub instance_id: Option<&'a str>,
    /// The user addressed (`/users/:userId/events`); `None` elsewhere.
    pub user_id: Option<&'a str>,
}

/// Headers whose values are credentials.
const CREDENTIAL_HEADERS: [header::HeaderName; 3] =
    [header::AUTHORIZATION, header::COOKIE, header::PROXY_AUTHORIZATION];

impl fmt::Debug for AccessRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headers: Vec<(&str, &dyn fmt::Debug)> = self
            .headers
            .iter()
            .map(|(name, value)| {
                let credential = CREDENTIAL_HEADERS.contains(name)
                    || crate::mcp::carries_credential(name.as_str(), value.to_str().unwrap_or_default());
                let shown: &dyn fmt::Debug = if credential { &"[redacted]" } else { value };
                (name.as_str(), shown)
            })
            .collect();
        f.debug_struct("AccessRequest")
            .field("method", self.method)
            .field("path", &self.path)
            .field("headers", &headers)
            .field("agent", &self.agent)
            .field("instance_id", &self.instance_id)
            .field("user_id", &self.user_id)
            .finish()
    }
}

/// Why a request is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Denied {
    /// No acceptable credentials: 401.
    Unauthenticated(String),
    /// Credentials that do not reach this agent or instance: 403.
    Forbidden(String),
}

/// Decides whether a request may proceed. Implemented for closures
/// `Fn(&AccessRequest) -> Result<(), Denied>`; implement it directly for a check that awaits
/// (a token service, a database).
pub trait Authorize: Send + Sync + 'static {
    /// `Ok` lets the request through.
    fn authorize<'a>(&'a self, request: AccessRequest<'a>) -> BoxFuture<'a, Result<(), Denied>>;
}

impl<F> Authorize for F
where
    F: Fn(&AccessRequest<'_>) -> Result<(), Denied> + Send + Sync + 'static,
{
    fn authorize<'a>(&'a self, request: AccessRequest<'a>) -> BoxFuture<'a, Result<(), Denied>> {
        let result = self(&request);
        Box::pin(async move { result })
    }
}

/// What a bearer token may reach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// Every agent and instance, and the catalog.
    All,
    /// These instances (agent name, instance id) and the catalog.
    Instances(HashSet<(String, String)>),
    /// Instances of any agent whose id starts with this prefix (a user's namespace, e.g.
    /// `user-42:`), and the catalog.
    IdPrefix(String),
    /// The user's event stream (`/users/<id>/events`) and instances whose id starts with
    /// `<id>:`, and the catalog. A user id that itself contains `:` reaches no instance: its
    /// namespace would lie inside another user's (`u:admin:notes` is user `u`'s instance). Nor
    /// does one containing `/task_`, which no instance id may hold.
    User(String),
}

impl Access {
    /// The instances `ids` of `agent`.
    pub fn instances<I: Into<String>>(agent: &str, ids: impl IntoIterator<Item = I>) -> Self {
        Self::Instances(ids.into_iter().map(|id| (agent.to_owned(), id.into())).collect())
    }

    fn reaches(&self, request: &AccessRequest<'_>) -> bool {
        if let Some(user_id) = request.user_id {
            return match self {
                Self::All => true,
                Self::User(user) => user == user_id,
                Self::Instances(_) | Self::IdPrefix(_) => false,
            };
        }
        let (Some(agent), Some(id)) = (request.agent, request.instance_id) else {
            // The catalog: any valid token.
            return true;
        };
        match self {
            Self::All => true,
            Self::Instances(instances) => instances.contains(&(agent.to_owned(), id.to_owned())),
            Self::IdPrefix(prefix) => id.starts_with(prefix.as_str()),
            Self::User(user) => {
                !user.contains(':') && id.strip_prefix(user.as_str()).is_some_and(|rest| rest.starts_with(':'))
            }
        }
    }
}

/// Bearer tokens, each with what it may reach. Tokens are kept only as SHA-256 digests, and
/// a presented token is looked up by its digest (no comparison that leaks a prefix's
/// correctness through timing).
#[derive(Clone, Default)]
pub struct BearerTokens {
    tokens: HashMap<[u8; 32], Access>,
}

impl fmt::Debug for BearerTokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BearerTokens")
            .field("tokens", &self.tokens.len())
            .finish()
    }
}

impl BearerTokens {
    /// No token is accepted yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Accepts `token` with `access`.
    pub fn allow(mut self, token: impl AsRef<str>, access: Access) -> Self {
        self.tokens.insert(digest(token.as_ref()), access);
        self
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Authorize for BearerTokens {
    fn authorize<'a>(&'a self, request: AccessRequest<'a>) -> BoxFuture<'a, Result<(), Denied>> {
        let result = (|| {
            let token = request
                .headers
                .get(header::AUTHORIZATION)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| {
                    let (scheme, token) = value.split_once(' ')?;
                    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
                })
                .filter(|token| !token.is_empty())
                .ok_or_else(|| Denied::Unauthenticated("Send a bearer token in the Authorization header.".into()))?;
            let access = self
                .tokens
                .get(&digest(token))
                .ok_or_else(|| Denied::Unauthenticated("The bearer token is not valid.".into()))?;
            if access.reaches(&request) {
                Ok(())
            } else {
                Err(Denied::Forbidden(match request.user_id {
                    Some(_) => "This token does not give access to this user.".into(),
                    None => "This token does not give access to this agent instance.".into(),
                }))
            }
        })();
        Box::pin(async move { result })
    }
}

#[cfg(test)]
mod tests {
    use axum::http::{HeaderMap, HeaderValue, Method, header};

    use super::AccessRequest;

    #[test]
    fn an_access_requests_debug_redacts_its_credentials_and_keeps_other_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer tok-s3cr3t"));
        headers.insert(header::COOKIE, HeaderValue::from_static("session=c00kie"));
        headers.insert(header::PROXY_AUTHORIZATION, HeaderValue::from_static("Basic pr0xy"));
        headers.insert(header::USER_AGENT, HeaderValue::from_static("probe/1"));
        // Named like a credential, or holding an opaque token, whatever its name.
        headers.insert("x-api-key", HeaderValue::from_static("k3y"));
        headers.insert("x-tenant", HeaderValue::from_static("tn_8f3kQ9xLm2Vz7RtY"));
        let request = AccessRequest {
            method: &Method::POST,
            path: "/agents/a/i",
            headers: &headers,
            agent: Some("a"),
            instance_id: Some("i"),
            user_id: None,
        };
        let shown = format!("{request:?}");
        for secret in ["tok-s3cr3t", "c00kie", "pr0xy", "k3y", "tn_8f3kQ9xLm2Vz7RtY"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("[redacted]") && shown.contains("probe/1"), "{shown}");
    }
}
