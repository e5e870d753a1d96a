//! `UserState`: the user a user-scope lifecycle hook (`user_client_attached`,
//! `user_client_detached`, `user_value_changed`) runs against — durable values shared by every
//! thread of the user, and the user's live event channel. The runtime implements
//! [`UserStateApi`].

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::thread::ThreadError;
use crate::BoxFuture;

/// The longest user-value key (characters).
pub const MAX_USER_KEY_LEN: usize = 512;

/// One durable user value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UserValue {
    /// Its key.
    pub key: String,
    /// Its value.
    pub value: Value,
    /// When it was written, milliseconds since the Unix epoch.
    pub updated_at: i64,
}

/// What `list_values` reads: keys starting with `prefix`, in key order, paged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserValuesQuery {
    /// Only keys starting with this (all when empty).
    pub prefix: String,
    /// At most this many entries (all when `None`).
    pub limit: Option<usize>,
    /// Entries to skip.
    pub offset: usize,
}

/// A page of user values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UserValuePage {
    /// The entries, in key order.
    pub entries: Vec<UserValue>,
    /// Entries matching the prefix before paging.
    pub total: usize,
}

/// Checks a user-value key: 1 to [`MAX_USER_KEY_LEN`] characters, none of them a control
/// character (which some stores cannot hold: Postgres text refuses NUL).
pub fn check_user_key(key: &str) -> Result<(), ThreadError> {
    check_user_name(key, "A user value key")
}

/// Checks a user id: 1 to [`MAX_USER_KEY_LEN`] characters, none of them a control character.
pub fn check_user_id(id: &str) -> Result<(), ThreadError> {
    check_user_name(id, "A user id")
}

fn check_user_name(name: &str, what: &str) -> Result<(), ThreadError> {
    let length = name.chars().count();
    if length == 0 || length > MAX_USER_KEY_LEN {
        return Err(ThreadError::Invalid(format!(
            "{what} must be 1 to {MAX_USER_KEY_LEN} characters long."
        )));
    }
    if let Some(control) = name.chars().find(|character| character.is_control()) {
        return Err(ThreadError::Invalid(format!(
            "{what} cannot contain control characters; this one has U+{:04X}.",
            u32::from(control)
        )));
    }
    Ok(())
}

fn unavailable(what: &str) -> ThreadError {
    ThreadError::Unavailable(format!("{what} needs a runtime behind this UserState."))
}

/// What a runtime provides behind a [`UserState`]. Only `user_id` is required; the other
/// operations default to a [`ThreadError::Unavailable`] error.
pub trait UserStateApi: Send + Sync {
    /// The user's id.
    fn user_id(&self) -> &str;

    /// The durable value under `key`.
    fn get_value<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Value>, ThreadError>> {
        let _ = key;
        Box::pin(async { Err(unavailable("get_value")) })
    }

    /// Sets the value under `key`; `None` (or JSON null) deletes it. Fires
    /// `user_value_changed` (not for writes made by a `user_value_changed` hook).
    fn set_value<'a>(&'a self, key: &'a str, value: Option<Value>) -> BoxFuture<'a, Result<(), ThreadError>> {
        let _ = (key, value);
        Box::pin(async { Err(unavailable("set_value")) })
    }

    /// Values by key prefix, paged.
    fn list_values(&self, query: UserValuesQuery) -> BoxFuture<'_, Result<UserValuePage, ThreadError>> {
        let _ = query;
        Box::pin(async { Err(unavailable("list_values")) })
    }

    /// Sends `{event, data}` to the user's connected clients (live only, at most once).
    fn emit(&self, event: &str, data: Value) {
        let _ = (event, data);
    }
}

/// The user a user-scope hook runs against. Cheap to clone.
#[derive(Clone)]
pub struct UserState {
    api: Arc<dyn UserStateApi>,
}

impl UserState {
    /// Wraps a runtime's implementation.
    pub fn new(api: Arc<dyn UserStateApi>) -> Self {
        Self { api }
    }

    /// The user's id.
    pub fn user_id(&self) -> &str {
        self.api.user_id()
    }

    /// The durable value under `key`.
    pub async fn get_value(&self, key: &str) -> Result<Option<Value>, ThreadError> {
        self.api.get_value(key).await
    }

    /// Sets the value under `key`; `None` or JSON null deletes it.
    pub async fn set_value(&self, key: &str, value: Option<Value>) -> Result<(), ThreadError> {
        self.api.set_value(key, value).await
    }

    /// Values whose keys start with `query.prefix`, in key order, paged.
    pub async fn list_values(&self, query: UserValuesQuery) -> Result<UserValuePage, ThreadError> {
        self.api.list_values(query).await
    }

    /// Sends an event to the user's connected clients.
    pub fn emit(&self, event: &str, data: Value) {
        self.api.emit(event, data);
    }

    /// The runtime's implementation.
    pub fn api(&self) -> &Arc<dyn UserStateApi> {
        &self.api
    }
}

impl fmt::Debug for UserState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("UserState").field(&self.user_id()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_keys_are_one_to_512_characters() {
        assert!(check_user_key("").is_err());
        assert!(check_user_key("theme").is_ok());
        assert!(check_user_key(&"é".repeat(512)).is_ok());
        assert!(check_user_key(&"k".repeat(513)).is_err());
    }

    #[test]
    fn user_keys_and_ids_refuse_control_characters() {
        let refused = check_user_key("the\0me").expect_err("a NUL is refused").to_string();
        assert!(
            refused.contains("A user value key cannot contain control characters; this one has U+0000."),
            "{refused}"
        );
        assert!(check_user_id("ada\n").is_err());
        assert!(check_user_id("").is_err());
        assert!(check_user_id("ada@example.com").is_ok());
    }
}
