//! `ThreadState`: the thread (agent instance) a lifecycle hook or a tool runs against — its
//! identity, the execution in progress, its message rows, a durable key-value store and the
//! live event channel. The runtime implements [`ThreadStateApi`]; this crate only defines the
//! surface (no I/O here).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::types::{HookError, Message, MessageRole, MessageUpdates, ToolResult};
use crate::BoxFuture;
use crate::abort::AbortSignal;

/// Identity of a thread (an agent instance).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThreadIdentity {
    /// Thread (instance) id.
    pub thread_id: String,
    /// The owning agent's name.
    pub agent_id: String,
    /// The owning user, if any.
    pub user_id: Option<String>,
    /// Creation time, microseconds since the Unix epoch.
    pub created_at: i64,
    /// Invocation or subagent-creation arguments (`{}` when none).
    pub arguments: Map<String, Value>,
}

/// Why a `ThreadState` operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ThreadError {
    /// A pre-write lifecycle hook (`before_create_message`, `before_update_message`) threw:
    /// the write did not happen. Carries the hook's error.
    #[error("{0}")]
    Hook(HookError),
    /// No message row has that id.
    #[error("[flue] No message with id \"{0}\" exists in this thread.")]
    MessageNotFound(String),
    /// The input is not valid (an empty key, an unknown update field, …).
    #[error("[flue] {0}")]
    Invalid(String),
    /// The operation needs a running execution, or a runtime behind the state.
    #[error("[flue] {0}")]
    Unavailable(String),
    /// The store failed.
    #[error("[flue] The thread's store failed: {0}")]
    Store(String),
}

impl From<HookError> for ThreadError {
    fn from(error: HookError) -> Self {
        Self::Hook(error)
    }
}

/// Which end `get_messages` starts from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageOrder {
    /// Oldest first (the default).
    #[default]
    Asc,
    /// Newest first.
    Desc,
}

/// What `get_messages` reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MessagesQuery {
    /// At most this many rows (all when `None`).
    pub limit: Option<usize>,
    /// Rows to skip, counted in `order`.
    pub offset: usize,
    /// Oldest or newest first.
    pub order: MessageOrder,
    /// Whether silent rows count.
    pub include_silent: bool,
}

/// A page of message rows.
#[derive(Clone, Debug, PartialEq)]
pub struct MessagePage {
    /// The rows, in the query's order.
    pub messages: Vec<Message>,
    /// Rows matching the query before paging.
    pub total: usize,
    /// Whether rows follow this page.
    pub has_more: bool,
}

impl MessagePage {
    /// Pages `rows` (oldest first) as `query` asks.
    pub fn of(rows: Vec<Message>, query: &MessagesQuery) -> Self {
        let mut rows: Vec<Message> = rows
            .into_iter()
            .filter(|row| query.include_silent || !row.silent)
            .collect();
        if query.order == MessageOrder::Desc {
            rows.reverse();
        }
        let total = rows.len();
        let end = query
            .limit
            .map_or(total, |limit| query.offset.saturating_add(limit).min(total));
        let messages = rows
            .into_iter()
            .skip(query.offset)
            .take(end.saturating_sub(query.offset))
            .collect();
        Self {
            messages,
            total,
            has_more: end < total,
        }
    }
}

/// A row `inject_message` writes: persisted without starting an execution.
#[derive(Clone, Debug, PartialEq)]
pub struct InjectMessage {
    /// Author.
    pub role: MessageRole,
    /// Text.
    pub content: String,
    /// Hidden from clients unless they ask for silent rows.
    pub silent: bool,
    /// Free-form metadata.
    pub metadata: Map<String, Value>,
}

impl InjectMessage {
    /// A visible row of `role` with `content`.
    pub fn new(role: MessageRole, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            silent: false,
            metadata: Map::new(),
        }
    }

    /// Marks the row silent.
    pub fn silent(mut self) -> Self {
        self.silent = true;
        self
    }

    /// Sets its metadata.
    pub fn metadata(mut self, metadata: Map<String, Value>) -> Self {
        self.metadata = metadata;
        self
    }
}

/// The execution a thread is in (`ThreadState::execution`, `None` at rest): the submission,
/// step counts, the abort signal and a stop request. Clones share the execution.
#[derive(Clone)]
pub struct ExecutionState {
    inner: Arc<ExecutionInner>,
}

struct ExecutionInner {
    submission_id: Arc<str>,
    steps: AtomicU32,
    stopped: AtomicBool,
    signal: AbortSignal,
}

impl ExecutionState {
    /// A fresh execution of `submission_id`, aborted through `signal`.
    pub fn new(submission_id: impl Into<Arc<str>>, signal: AbortSignal) -> Self {
        Self::resumed(submission_id, signal, 0)
    }

    /// An execution of `submission_id` that goes on after the `steps` model steps an earlier
    /// attempt made durable (a re-attempt after a crash): [`step_count`](Self::step_count)
    /// counts on from them. A [`stop`](Self::stop) request is not durable: it was the earlier
    /// attempt's.
    pub fn resumed(submission_id: impl Into<Arc<str>>, signal: AbortSignal, steps: u32) -> Self {
        Self {
            inner: Arc::new(ExecutionInner {
                submission_id: submission_id.into(),
                steps: AtomicU32::new(steps),
                stopped: AtomicBool::new(false),
                signal,
            }),
        }
    }

    /// The submission the execution processes.
    pub fn submission_id(&self) -> &str {
        &self.inner.submission_id
    }

    /// Model steps taken so far in this execution (the durable ones of earlier attempts of
    /// the submission included).
    pub fn step_count(&self) -> u32 {
        self.inner.steps.load(Ordering::Acquire)
    }

    /// Counts one more model step (the runtime calls it as each step starts).
    pub fn count_step(&self) -> u32 {
        self.inner.steps.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// The abort signal: fires when the submission is aborted.
    pub fn abort_signal(&self) -> &AbortSignal {
        &self.inner.signal
    }

    /// Asks the execution to end after the current step (no further model call). Not an
    /// abort: the response completes with what it has.
    pub fn stop(&self) {
        self.inner.stopped.store(true, Ordering::Release);
    }

    /// Whether `stop()` was called.
    pub fn stopped(&self) -> bool {
        self.inner.stopped.load(Ordering::Acquire)
    }
}

impl fmt::Debug for ExecutionState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecutionState")
            .field("submission_id", &self.inner.submission_id)
            .field("step_count", &self.step_count())
            .field("stopped", &self.stopped())
            .field("aborted", &self.inner.signal.is_aborted())
            .finish()
    }
}

/// Scratch space shared by the tools and hooks of one execution; not durable. At rest every
/// read of `ThreadState::context` is a fresh empty one, so writes there are not kept.
#[derive(Clone, Default)]
pub struct ThreadContext {
    values: Arc<Mutex<Map<String, Value>>>,
}

impl ThreadContext {
    /// An empty context.
    pub fn new() -> Self {
        Self::default()
    }

    fn values(&self) -> std::sync::MutexGuard<'_, Map<String, Value>> {
        self.values.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The value under `key`.
    pub fn get(&self, key: &str) -> Option<Value> {
        self.values().get(key).cloned()
    }

    /// Sets `key`; returns the previous value.
    pub fn set(&self, key: impl Into<String>, value: Value) -> Option<Value> {
        self.values().insert(key.into(), value)
    }

    /// Removes `key`; returns its value.
    pub fn remove(&self, key: &str) -> Option<Value> {
        self.values().remove(key)
    }

    /// A copy of every entry.
    pub fn snapshot(&self) -> Map<String, Value> {
        self.values().clone()
    }
}

impl fmt::Debug for ThreadContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ThreadContext").field(&*self.values()).finish()
    }
}

fn unavailable(what: &str) -> ThreadError {
    ThreadError::Unavailable(format!("{what} needs a runtime behind this ThreadState."))
}

/// What a runtime provides behind a [`ThreadState`]. Only `identity` is required; the other
/// operations default to a [`ThreadError::Unavailable`] error (a state built for a unit test).
pub trait ThreadStateApi: Send + Sync {
    /// The thread's identity.
    fn identity(&self) -> &ThreadIdentity;

    /// The execution in progress (`None` at rest).
    fn execution(&self) -> Option<ExecutionState> {
        None
    }

    /// The execution's scratch context (a fresh empty one at rest).
    fn context(&self) -> ThreadContext {
        ThreadContext::new()
    }

    /// Message rows, paged.
    fn get_messages(&self, query: MessagesQuery) -> BoxFuture<'_, Result<MessagePage, ThreadError>> {
        let _ = query;
        Box::pin(async { Err(unavailable("get_messages")) })
    }

    /// One message row.
    fn get_message<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Message>, ThreadError>> {
        let _ = id;
        Box::pin(async { Err(unavailable("get_message")) })
    }

    /// Persists a row (running the create hooks) without starting an execution.
    fn inject_message(&self, input: InjectMessage) -> BoxFuture<'_, Result<Message, ThreadError>> {
        let _ = input;
        Box::pin(async { Err(unavailable("inject_message")) })
    }

    /// Updates a row (running the update hooks).
    fn update_message<'a>(
        &'a self,
        id: &'a str,
        updates: MessageUpdates,
    ) -> BoxFuture<'a, Result<Message, ThreadError>> {
        let _ = (id, updates);
        Box::pin(async { Err(unavailable("update_message")) })
    }

    /// Deletes a row; `false` when none had that id.
    fn delete_message<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, ThreadError>> {
        let _ = id;
        Box::pin(async { Err(unavailable("delete_message")) })
    }

    /// Queues a user message: durable and ordered; it joins the running execution at its
    /// next turn boundary, or starts one on an idle thread.
    fn queue_message(&self, content: String) -> BoxFuture<'_, Result<(), ThreadError>> {
        let _ = content;
        Box::pin(async { Err(unavailable("queue_message")) })
    }

    /// Runs a tool of the current render and returns its result without storing a row.
    fn invoke_tool<'a>(&'a self, name: &'a str, args: Value) -> BoxFuture<'a, Result<ToolResult, ThreadError>> {
        let _ = (name, args);
        Box::pin(async { Err(unavailable("invoke_tool")) })
    }

    /// Queues a call of `tool` with `args`: it runs later in the same execution (after the
    /// current tool batch, or before the response would stop), mounted or not.
    fn queue_tool(&self, tool: crate::Tool, args: Value) -> Result<(), ThreadError> {
        let _ = (tool, args);
        Err(unavailable("queue_tool"))
    }

    /// The value of a declared variable: `name` must be a secret some tool of the current
    /// render declares, and set.
    fn env(&self, name: &str) -> Result<crate::tool::Secret, ThreadError> {
        let _ = name;
        Err(unavailable("env"))
    }

    /// The variables [`env`](Self::env) hands out: the secrets the current render's tools
    /// declare (none where `env` hands out none).
    fn declared_secrets(&self) -> Vec<&'static str> {
        Vec::new()
    }

    /// Sends `{type:"event", eventType, data, timestamp}` to the thread's connected clients
    /// (live only).
    fn emit(&self, event: &str, data: Value) {
        let _ = (event, data);
    }

    /// The durable value under `key`.
    fn get_value<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Value>, ThreadError>> {
        let _ = key;
        Box::pin(async { Err(unavailable("get_value")) })
    }

    /// Sets the durable value under `key`; `None` (or JSON null) deletes it.
    fn set_value<'a>(&'a self, key: &'a str, value: Option<Value>) -> BoxFuture<'a, Result<(), ThreadError>> {
        let _ = (key, value);
        Box::pin(async { Err(unavailable("set_value")) })
    }
}

/// The thread a lifecycle hook runs against. Cheap to clone.
#[derive(Clone)]
pub struct ThreadState {
    api: Arc<dyn ThreadStateApi>,
}

impl ThreadState {
    /// Wraps a runtime's implementation.
    pub fn new(api: Arc<dyn ThreadStateApi>) -> Self {
        Self { api }
    }

    /// The thread id.
    pub fn thread_id(&self) -> &str {
        &self.api.identity().thread_id
    }

    /// The owning agent's name.
    pub fn agent_id(&self) -> &str {
        &self.api.identity().agent_id
    }

    /// The owning user.
    pub fn user_id(&self) -> Option<&str> {
        self.api.identity().user_id.as_deref()
    }

    /// Creation time, microseconds since the Unix epoch.
    pub fn created_at(&self) -> i64 {
        self.api.identity().created_at
    }

    /// Invocation or subagent-creation arguments.
    pub fn arguments(&self) -> &Map<String, Value> {
        &self.api.identity().arguments
    }

    /// The execution in progress; `None` at rest.
    pub fn execution(&self) -> Option<ExecutionState> {
        self.api.execution()
    }

    /// Scratch space shared by the tools and hooks of this execution; empty in the next one.
    pub fn context(&self) -> ThreadContext {
        self.api.context()
    }

    /// Message rows (oldest first unless `query.order` is `Desc`), with the total and whether
    /// more follow.
    pub async fn get_messages(&self, query: MessagesQuery) -> Result<MessagePage, ThreadError> {
        self.api.get_messages(query).await
    }

    /// The row with `id`.
    pub async fn get_message(&self, id: &str) -> Result<Option<Message>, ThreadError> {
        self.api.get_message(id).await
    }

    /// Persists a row without starting an execution. The create hooks run; a
    /// `before_create_message` error rejects with that error and nothing is stored.
    pub async fn inject_message(&self, input: InjectMessage) -> Result<Message, ThreadError> {
        self.api.inject_message(input).await
    }

    /// Updates the row `id` with `updates` (`content`, `silent`, `metadata`, `name`, `status`).
    /// The update hooks run; a `before_update_message` error rejects and the row is unchanged.
    pub async fn update_message(&self, id: &str, updates: MessageUpdates) -> Result<Message, ThreadError> {
        self.api.update_message(id, updates).await
    }

    /// Deletes the row `id` from the history; `false` when there is none. The running step's
    /// row (which the reads show while the model answers) is refused
    /// ([`ThreadError::Unavailable`]) until its step is stored.
    pub async fn delete_message(&self, id: &str) -> Result<bool, ThreadError> {
        self.api.delete_message(id).await
    }

    /// Queues a user message (durable, ordered).
    pub async fn queue_message(&self, content: impl Into<String>) -> Result<(), ThreadError> {
        self.api.queue_message(content.into()).await
    }

    /// Runs a tool of the current render with `args` and returns its result; no row is stored.
    pub async fn invoke_tool(&self, name: &str, args: Value) -> Result<ToolResult, ThreadError> {
        self.api.invoke_tool(name, args).await
    }

    /// Queues a call of `tool` with `args` for later in this execution — after the current
    /// tool batch, or before the response would stop — whether or not the render mounts the
    /// tool. Its call and result are stored like the model's. Fails at rest (no execution).
    ///
    /// A queued call may queue calls in turn: they run next, before any model step, and are
    /// not counted against `max_steps`; more than `MAX_QUEUED_TOOL_STEPS` (64, in
    /// `flue_runtime`) such steps in a row fail the response (`queued_tool_ceiling`).
    pub fn queue_tool(&self, tool: impl crate::tool::IntoTool, args: Value) -> Result<(), ThreadError> {
        self.api.queue_tool(tool.into_tool(), args)
    }

    /// The value of the variable `name`, which a tool of the current render must declare
    /// (`#[tool(secrets = [..])]`) and the environment must set. Fails for anything else (the
    /// reference's `env` throws for an undeclared or unset name). The value prints as
    /// `[redacted]`; read it with `Secret::expose` where it is sent.
    pub fn env(&self, name: &str) -> Result<crate::tool::Secret, ThreadError> {
        self.api.env(name)
    }

    /// The variables [`env`](Self::env) may hand out: the secrets the current render's tools
    /// declare. What a tool returns is cleared of all of their values (it may have read any).
    pub fn declared_secrets(&self) -> Vec<&'static str> {
        self.api.declared_secrets()
    }

    /// Sends an event to the thread's connected clients.
    pub fn emit(&self, event: &str, data: Value) {
        self.api.emit(event, data);
    }

    /// The durable value under `key`.
    pub async fn get_value(&self, key: &str) -> Result<Option<Value>, ThreadError> {
        self.api.get_value(key).await
    }

    /// Sets the durable value under `key`; `None` or JSON null deletes it.
    pub async fn set_value(&self, key: &str, value: Option<Value>) -> Result<(), ThreadError> {
        self.api.set_value(key, value).await
    }

    /// The runtime's implementation.
    pub fn api(&self) -> &Arc<dyn ThreadStateApi> {
        &self.api
    }
}

impl fmt::Debug for ThreadState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ThreadState").field(self.api.identity()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: usize, silent: bool) -> Message {
        Message {
            id: format!("m{id}"),
            role: MessageRole::User,
            content: None,
            name: None,
            tool_calls: None,
            tool_call_id: None,
            tool_status: None,
            status: None,
            created_at: id as i64,
            silent,
            metadata: Map::new(),
            attachments: Vec::new(),
        }
    }

    fn ids(page: &MessagePage) -> Vec<&str> {
        page.messages.iter().map(|row| row.id.as_str()).collect()
    }

    #[test]
    fn a_descending_page_is_newest_first_with_total_and_has_more() {
        let rows: Vec<Message> = (0..5).map(|id| row(id, false)).collect();
        let query = MessagesQuery {
            limit: Some(2),
            order: MessageOrder::Desc,
            ..MessagesQuery::default()
        };
        let page = MessagePage::of(rows.clone(), &query);
        assert_eq!(ids(&page), ["m4", "m3"]);
        assert_eq!((page.total, page.has_more), (5, true));
        let last = MessagePage::of(rows, &MessagesQuery { offset: 4, ..query });
        assert_eq!(ids(&last), ["m0"]);
        assert!(!last.has_more);
    }

    #[test]
    fn silent_rows_count_only_when_asked_for() {
        let rows = vec![row(0, false), row(1, true), row(2, false)];
        let visible = MessagePage::of(rows.clone(), &MessagesQuery::default());
        assert_eq!((ids(&visible), visible.total), (vec!["m0", "m2"], 2));
        let all = MessagePage::of(
            rows,
            &MessagesQuery {
                include_silent: true,
                ..MessagesQuery::default()
            },
        );
        assert_eq!(all.total, 3);
    }

    #[test]
    fn an_offset_past_the_end_is_an_empty_last_page() {
        let page = MessagePage::of(
            vec![row(0, false)],
            &MessagesQuery {
                offset: 3,
                limit: Some(2),
                ..MessagesQuery::default()
            },
        );
        assert!(page.messages.is_empty());
        assert_eq!((page.total, page.has_more), (1, false));
    }

    #[test]
    fn an_execution_counts_steps_and_records_a_stop() {
        let execution = ExecutionState::new("sub_1", AbortSignal::new());
        assert_eq!(execution.count_step(), 1);
        let shared = execution.clone();
        shared.stop();
        assert!(execution.stopped());
        assert_eq!(execution.step_count(), 1);
    }
}
