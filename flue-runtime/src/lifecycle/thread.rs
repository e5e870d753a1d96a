//! The runtime's `ThreadState`: one per attempt, in two views — the execution's (hooks and
//! tools of the running response: `execution` set, a shared per-execution context, the
//! render's hook set) and the at-rest one (the sent message's row and `after_thread_created`:
//! no execution, an empty context, the agent-level hooks).
//!
//! Writes (`inject_message`, `update_message`, `delete_message`, `set_value`) append to the
//! instance's stream at once, fenced by the attempt, through the same writer as the response's
//! own batches ([`ThreadWriter`]); the response folds them into its conversation before it next
//! reads it. Reads fold the durable stream, so they see exactly what is stored.

use std::sync::{Arc, Mutex, Weak};

use flue_core::BoxFuture;
use flue_core::Tool;
use flue_core::lifecycle::{
    ExecutionState, InjectMessage, Message, MessagePage, MessageRole, MessageStatus, MessageUpdates, MessagesQuery,
    ThreadContext, ThreadError, ThreadIdentity, ThreadState, ThreadStateApi, ToolResult,
};
use flue_core::message::DeliveredMessage;
use flue_core::tool::ToolContext;
use serde_json::{Value, json};

use super::{HookSet, chain};
use crate::events::Event;
use crate::record::{Batch, Record, RecordBody, new_id, now};
use crate::runtime::RuntimeInner;
use crate::session::{Conversation, InstanceBinding};
use crate::store::{AttemptRef, InstanceKey, Store, StoreError};

/// The longest key `set_value` accepts.
const MAX_KEY_LEN: usize = 512;

/// The instance's stream as its thread state's reads folded it, and the offset it reached
/// (see [`ThreadWriter`]'s `folded`). Boxed: every cached instance has the slot, few fold.
pub(crate) type ThreadFold = Arc<tokio::sync::Mutex<Option<Box<(Conversation, Option<u64>)>>>>;

/// The one writer of an attempt: every batch the attempt appends (the response's and the
/// thread operations') goes through it, in order, and waits here until the response folds it.
pub(crate) struct ThreadWriter {
    runtime: Weak<RuntimeInner>,
    store: Arc<dyn Store>,
    key: InstanceKey,
    binding: Arc<InstanceBinding>,
    attempt: AttemptRef,
    record_ids: (Arc<str>, Arc<str>),
    lock: tokio::sync::Mutex<()>,
    unfolded: Mutex<Vec<Batch>>,
    /// The stream as the thread state's reads last folded it, and the offset it reached:
    /// each read folds only what was appended since (made at the first read). The instance's
    /// (its slot keeps it between responses), so a response reads what is new, not the
    /// stream from its birth.
    folded: ThreadFold,
    /// The model step's assistant row while its step runs (`pending`, then `failed` for its
    /// failure's update hooks): a row of the thread for reads, though only a completed step
    /// is stored.
    pending_row: Mutex<Option<Message>>,
    /// What `update_message` set on the pending row: stored with its step, under the step's
    /// own updates (dropped with the row when the step fails).
    pending_updates: Mutex<MessageUpdates>,
    /// The response is over: what a hook or tool still running (one left past its bound, a
    /// task it spawned) asks of the thread state after it is refused, not written after the
    /// response's events or its settlement.
    closed: std::sync::atomic::AtomicBool,
    /// A write of the attempt failed: its commit may still have gone through (its answer
    /// lost), so the stream may hold a batch the response's fold does not.
    failed_write: std::sync::atomic::AtomicBool,
    /// Whether an append was given up while the store had it (its caller, a tool an abort
    /// stopped, dropped it): the store may have committed it, and then no fold saw it (see
    /// [`ThreadWriter::lost_track`]).
    abandoned_append: std::sync::atomic::AtomicBool,
}

/// Notes, when dropped before [`Appending::done`], that an append was given up while the
/// store had it.
struct Appending<'a>(&'a std::sync::atomic::AtomicBool, bool);

impl Appending<'_> {
    fn done(mut self) {
        self.1 = true;
    }
}

impl Drop for Appending<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.store(true, std::sync::atomic::Ordering::Release);
        }
    }
}

impl ThreadWriter {
    /// Where the log lines of what runs for the attempt go (none once the runtime is gone).
    pub(crate) fn log_base(&self) -> Option<crate::session::EventLogBase> {
        let runtime = self.runtime.upgrade()?;
        Some(crate::session::EventLogBase::new(
            &runtime,
            &self.key,
            &self.attempt.submission_id,
            None,
        ))
    }

    pub(crate) fn new(
        runtime: &Arc<RuntimeInner>,
        key: &InstanceKey,
        binding: &Arc<InstanceBinding>,
        attempt: &AttemptRef,
        record_ids: (Arc<str>, Arc<str>),
        folded: ThreadFold,
    ) -> Self {
        Self {
            runtime: Arc::downgrade(runtime),
            store: runtime.store.clone(),
            key: key.clone(),
            binding: binding.clone(),
            attempt: attempt.clone(),
            record_ids,
            lock: tokio::sync::Mutex::new(()),
            unfolded: Mutex::new(Vec::new()),
            folded,
            pending_row: Mutex::new(None),
            pending_updates: Mutex::default(),
            closed: std::sync::atomic::AtomicBool::new(false),
            failed_write: std::sync::atomic::AtomicBool::new(false),
            abandoned_append: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether the stream may hold a batch of the attempt no fold saw: an append given up while
    /// the store had it (a store whose commit is not done within the call, Postgres's, may
    /// commit it all the same). A fold of the instance is then read again from the start.
    pub(crate) fn lost_track(&self) -> bool {
        self.abandoned_append.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether a write of the attempt failed (see `failed_write`).
    pub(crate) fn had_failed_write(&self) -> bool {
        self.failed_write.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Notes a write's failure, passing it on.
    fn noting_failure<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if result.is_err() {
            self.failed_write.store(true, std::sync::atomic::Ordering::Release);
        }
        result
    }

    /// Ends the response's use of the thread state (see `closed`), once the write going on
    /// through it (if any) is done: that one is in the stream before the response's fold reads
    /// it, and none starts after. A write the store holds up longer than [`CLOSE_WAIT`] is not
    /// waited for (it may then land after the response, as a write of no attempt's fold).
    pub(crate) async fn close(&self) {
        // Uncontended (no write going on), as at the end of most responses: no timer.
        let _order = match self.lock.try_lock() {
            Ok(order) => Some(order),
            Err(_) => tokio::time::timeout(CLOSE_WAIT, self.lock.lock()).await.ok(),
        };
        self.closed.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Refuses a write through the thread state once the response is over.
    fn check_open(&self, what: &str) -> Result<(), ThreadError> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(ThreadError::Unavailable(format!(
                "{what}: the response this thread state belongs to has ended."
            )));
        }
        Ok(())
    }

    /// Shows `row` as the thread's last row (the running step's), or no such row.
    pub(crate) fn set_pending_row(&self, row: Option<Message>) {
        let mut pending = self.pending_row.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if row.as_ref().map(|row| &row.id) != pending.as_ref().map(|row| &row.id) {
            self.pending_updates().clear();
        }
        *pending = row;
    }

    /// Takes the running step's row out of the thread.
    pub(crate) fn take_pending_row(&self) -> Option<Message> {
        self.pending_updates().clear();
        self.pending_row
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }

    fn pending_updates(&self) -> std::sync::MutexGuard<'_, MessageUpdates> {
        self.pending_updates
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Applies `updates` to the running step's row when its id is `id`: returns the row as
    /// updated (`None` when no such row runs).
    fn update_pending_row(&self, id: &str, updates: MessageUpdates) -> Option<Message> {
        let mut pending = self.pending_row.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let row = pending.as_mut().filter(|row| row.id == id)?;
        apply_updates(row, updates.clone());
        self.pending_updates().extend(updates);
        Some(row.clone())
    }

    /// What `update_message` set on the running step's row, for its step's commit: all but
    /// its content and status, which the step's completion sets after them.
    pub(crate) fn take_pending_updates(&self) -> MessageUpdates {
        step_owned_removed(std::mem::take(&mut *self.pending_updates()))
    }

    /// Takes the step's row out of the thread once its step committed (the stream holds it):
    /// returns what `update_message` set on it since [`Self::take_pending_updates`] (all but
    /// its content and status, the step's as well), to store after the step.
    pub(crate) fn finish_pending_row(&self) -> MessageUpdates {
        let mut pending = self.pending_row.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        *pending = None;
        step_owned_removed(std::mem::take(&mut *self.pending_updates()))
    }

    /// The running step's row, if its id is `id`.
    fn pending_row_with_id(&self, id: &str) -> Option<Message> {
        self.pending_row
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .as_ref()
            .filter(|pending| pending.id == id)
            .cloned()
    }

    /// The running step's row, unless the stream holds it already.
    fn pending_row_beside(&self, rows: &[Message]) -> Option<Message> {
        self.pending_row
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .as_ref()
            .filter(|pending| !rows.iter().any(|row| row.id == pending.id))
            .cloned()
    }

    /// A record of this attempt.
    pub(crate) fn record(&self, body: RecordBody) -> Record {
        Record {
            id: new_id("record"),
            submission_id: Some(self.record_ids.0.clone()),
            attempt_id: Some(self.record_ids.1.clone()),
            timestamp: now(),
            body,
        }
    }

    /// Appends one batch atomically (fenced by the attempt); returns its offset. The batch
    /// waits in [`ThreadWriter::take_unfolded`] for the response's fold.
    pub(crate) async fn append(&self, records: Arc<[Record]>) -> Result<u64, StoreError> {
        let _order = self.lock.lock().await;
        self.append_in_order(records).await
    }

    /// [`ThreadWriter::append`] for a write through the thread state: refused (as `what`) once
    /// the response is over, checked in the appends' order, so a write is either in the
    /// response's fold or refused; `then` (its event) is published once it is stored, before
    /// the response can end.
    pub(crate) async fn append_open(
        &self,
        records: Arc<[Record]>,
        what: &str,
        then: Option<Event>,
    ) -> Result<u64, ThreadError> {
        let _order = self.lock.lock().await;
        self.check_open(what)?;
        let offset = self.append_in_order(records).await.map_err(store_error)?;
        if let Some(event) = then {
            self.emit_thread_event(|| event);
        }
        Ok(offset)
    }

    /// Appends `records`, the appends' lock held.
    async fn append_in_order(&self, records: Arc<[Record]>) -> Result<u64, StoreError> {
        let appending = Appending(&self.abandoned_append, false);
        let appended = self.store.append(&self.key, records.clone(), Some(&self.attempt)).await;
        appending.done();
        let offset = self.noting_failure(appended)?;
        self.binding.note_append();
        self.unfolded
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(Batch { offset, records });
        Ok(offset)
    }

    /// Creates a task's child conversation `child` with its `birth` batch and appends `link`
    /// (its [`RecordBody::ChildSessionRetained`]) to this stream, atomically and fenced by
    /// the attempt ([`Store::create_child`]); the link waits for the response's fold like
    /// any batch of the attempt.
    pub(crate) async fn create_child(
        &self,
        link: Arc<[Record]>,
        child: &InstanceKey,
        birth: Arc<[Record]>,
    ) -> Result<u64, StoreError> {
        let _order = self.lock.lock().await;
        let appending = Appending(&self.abandoned_append, false);
        let appended = self
            .store
            .create_child(&self.key, link.clone(), child, birth, Some(&self.attempt))
            .await;
        appending.done();
        let offset = self.noting_failure(appended)?;
        self.binding.note_append();
        self.unfolded
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(Batch { offset, records: link });
        Ok(offset)
    }

    /// The stream the writer appends to.
    pub(crate) fn key(&self) -> &InstanceKey {
        &self.key
    }

    /// Publishes a live event of this attempt's submission (built only when someone observes).
    pub(crate) fn emit_with(&self, event: impl FnOnce() -> Event) {
        if let Some(runtime) = self.runtime.upgrade() {
            runtime.emit_with(&self.key, Some(&self.attempt.submission_id), event);
        }
    }

    /// [`Self::emit_with`] for a thread event (its HTTP readers get it too).
    pub(crate) fn emit_thread_event(&self, event: impl FnOnce() -> Event) {
        if let Some(runtime) = self.runtime.upgrade() {
            runtime.emit_thread_event(&self.key, Some(&self.attempt.submission_id), event);
        }
    }

    /// Moves the batches appended since the last call into `into`, in stream order.
    pub(crate) fn take_unfolded(&self, into: &mut Vec<Batch>) {
        into.extend(
            self.unfolded
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .drain(..),
        );
    }

    /// `read` of the durable conversation, folded from the whole stream. The fold is kept
    /// between reads (and responses) and brought up to date with what was appended since, so
    /// a hook reading the thread at every turn does not re-read and re-fold the conversation
    /// each time.
    async fn with_fold<T>(&self, read: impl FnOnce(&Conversation) -> T) -> Result<T, ThreadError> {
        let mut folded = self.folded.lock().await;
        let (conversation, reached) = &mut **folded.get_or_insert_with(|| Box::new((Conversation::default(), None)));
        let batches = self.store.read(&self.key, *reached).await.map_err(store_error)?;
        for batch in &batches {
            conversation.apply(batch);
            *reached = Some(batch.offset);
        }
        Ok(read(conversation))
    }
}

fn store_error(error: StoreError) -> ThreadError {
    ThreadError::Store(error.to_string())
}

/// How long the end of a response waits for a write through its thread state to be stored.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// One view of the thread (see the module documentation).
pub(crate) struct RuntimeThread {
    me: Weak<RuntimeThread>,
    identity: Arc<ThreadIdentity>,
    writer: Arc<ThreadWriter>,
    execution: Option<ExecutionState>,
    context: ThreadContext,
    hooks: Mutex<HookSet>,
    tools: Mutex<Vec<Tool>>,
    /// Calls `queue_tool` asked for, waiting for the response to run them.
    queued_tools: Mutex<Vec<(Tool, Value)>>,
}

impl RuntimeThread {
    /// A view of the thread `identity`, writing through `writer`.
    pub(crate) fn new(
        identity: Arc<ThreadIdentity>,
        writer: Arc<ThreadWriter>,
        execution: Option<ExecutionState>,
        hooks: HookSet,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            identity,
            writer,
            execution,
            context: ThreadContext::new(),
            hooks: Mutex::new(hooks),
            tools: Mutex::new(Vec::new()),
            queued_tools: Mutex::new(Vec::new()),
        })
    }

    /// The `ThreadState` hooks and tools receive.
    pub(crate) fn state(&self) -> ThreadState {
        let me: Arc<dyn ThreadStateApi> = self.me.upgrade().expect("a live thread view");
        ThreadState::new(me)
    }

    /// The hooks its own writes run (the render's set, as the execution goes on).
    pub(crate) fn set_hooks(&self, hooks: HookSet) {
        *self.hooks.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = hooks;
    }

    pub(crate) fn hooks(&self) -> HookSet {
        self.hooks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// The tools `invoke_tool` can run (the current render's).
    pub(crate) fn set_tools(&self, tools: &[Tool]) {
        let mut current = self.tools.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        current.clear();
        current.extend_from_slice(tools);
    }

    /// The calls queued with `queue_tool` since the last call, in order.
    pub(crate) fn take_queued_tools(&self) -> Vec<(Tool, Value)> {
        std::mem::take(
            &mut *self
                .queued_tools
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    async fn append(&self, records: Vec<Record>) -> Result<(), ThreadError> {
        self.writer
            .append_open(records.into(), "A write to the thread", None)
            .await
            .map(drop)
    }

    fn emit_event(&self, event_type: &str, data: Value) {
        if self.writer.check_open("emit").is_err() {
            tracing::warn!(
                event_type,
                "a thread event emitted after its response ended was dropped"
            );
            return;
        }
        self.writer.emit_thread_event(|| Event::ThreadEvent {
            event_type: event_type.to_owned(),
            data,
        });
    }
}

/// `updates` made to a running step's row without the fields the step's completion sets
/// (its content and status): whenever they were made, the step's own values win.
fn step_owned_removed(mut updates: MessageUpdates) -> MessageUpdates {
    updates.remove("content");
    updates.remove("status");
    updates
}

/// `updates` (checked) applied to `row`, as the stream applies a stored row's update.
pub(crate) fn apply_updates(row: &mut Message, updates: MessageUpdates) {
    for (field, value) in updates {
        match (field.as_str(), value) {
            ("content", Value::String(content)) => row.content = Some(content),
            ("silent", Value::Bool(silent)) => row.silent = silent,
            ("metadata", Value::Object(metadata)) => row.metadata = metadata,
            ("metadata", Value::Null) => row.metadata.clear(),
            ("name", Value::String(name)) => row.name = Some(name),
            ("name", Value::Null) => row.name = None,
            ("status", status) => {
                if let Ok(status) = serde_json::from_value(status) {
                    row.status = Some(status);
                }
            }
            _ => {}
        }
    }
}

/// Checks the fields of a row update: `content` (string), `silent` (bool), `metadata`
/// (object or null), `name` (string or null), `status` (`pending`, `completed`, `failed`).
pub(crate) fn check_updates(updates: &MessageUpdates) -> Result<(), ThreadError> {
    for (field, value) in updates {
        let valid = match field.as_str() {
            "content" => value.is_string(),
            "silent" => value.is_boolean(),
            "metadata" => value.is_object() || value.is_null(),
            "name" => value.is_string() || value.is_null(),
            "status" => serde_json::from_value::<MessageStatus>(value.clone()).is_ok(),
            _ => {
                return Err(ThreadError::Invalid(format!(
                    "A message update cannot set \"{field}\": the fields are content, silent, metadata, name and status."
                )));
            }
        };
        if !valid {
            return Err(ThreadError::Invalid(format!(
                "A message update's \"{field}\" has the wrong type: {value}."
            )));
        }
    }
    Ok(())
}

impl ThreadStateApi for RuntimeThread {
    fn identity(&self) -> &ThreadIdentity {
        &self.identity
    }

    fn execution(&self) -> Option<ExecutionState> {
        self.execution.clone()
    }

    fn context(&self) -> ThreadContext {
        match self.execution {
            Some(_) => self.context.clone(),
            None => ThreadContext::new(),
        }
    }

    fn get_messages(&self, query: MessagesQuery) -> BoxFuture<'_, Result<MessagePage, ThreadError>> {
        Box::pin(async move {
            let mut rows = self.writer.with_fold(Conversation::rows).await?;
            rows.extend(self.writer.pending_row_beside(&rows));
            Ok(MessagePage::of(rows, &query))
        })
    }

    fn get_message<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Message>, ThreadError>> {
        Box::pin(async move {
            let stored = self.writer.with_fold(|conversation| conversation.find_row(id)).await?;
            Ok(stored.or_else(|| self.writer.pending_row_with_id(id)))
        })
    }

    fn inject_message(&self, input: InjectMessage) -> BoxFuture<'_, Result<Message, ThreadError>> {
        Box::pin(async move {
            // Refused before the row's hooks run: they would run for a write that is refused.
            self.writer.check_open("inject_message")?;
            if input.role == MessageRole::Tool {
                return Err(ThreadError::Invalid(
                    "inject_message cannot write a tool row: a tool row answers a tool call of the model.".into(),
                ));
            }
            let row = Message {
                id: new_id("msg"),
                role: input.role,
                content: Some(input.content),
                name: None,
                tool_calls: None,
                tool_call_id: None,
                tool_status: None,
                status: Some(MessageStatus::Completed),
                created_at: crate::session::micros_of(&now()),
                silent: input.silent,
                metadata: input.metadata,
                attachments: Vec::new(),
            };
            let hooks = self.hooks();
            let state = self.state();
            let row = chain::before_create_message(&hooks, &state, row)
                .await
                .map_err(|prevented| ThreadError::Hook(prevented.error))?;
            let role = match row.role {
                MessageRole::Tool => MessageRole::User,
                role => role,
            };
            let mut records = vec![self.writer.record(RecordBody::MessageInjected {
                message_id: row.id.clone(),
                role,
                content: row.content.clone().unwrap_or_default(),
                silent: row.silent,
                metadata: row.metadata.clone(),
            })];
            if let Some(name) = &row.name {
                let mut updates = MessageUpdates::new();
                updates.insert("name".into(), json!(name));
                records.push(self.writer.record(RecordBody::MessageUpdated {
                    message_id: row.id.clone(),
                    updates,
                }));
            }
            self.append(records).await?;
            // The row as stored (what a hook changed that an injected row cannot be, a tool
            // role, its status, is not), for the hooks after it and the caller. The row is
            // stored: a failed read back of it is no failure of the call (one the caller tried
            // again would store it twice), and the row as written stands in.
            let row = match self
                .writer
                .with_fold(|conversation| conversation.find_row(&row.id))
                .await
            {
                Ok(Some(stored)) => stored,
                // As stored: a tool row is injected as a user's.
                _ => Message { role, ..row },
            };
            chain::after_create_message(&hooks, &state, &row).await;
            Ok(row)
        })
    }

    fn update_message<'a>(
        &'a self,
        id: &'a str,
        updates: MessageUpdates,
    ) -> BoxFuture<'a, Result<Message, ThreadError>> {
        Box::pin(async move {
            self.writer.check_open("update_message")?;
            check_updates(&updates)?;
            let before = self.writer.with_fold(|conversation| conversation.find_row(id)).await?;
            let stored = before.is_some();
            // The running step's row (shown by the reads) takes updates too: they are stored
            // with its step.
            if !stored && self.writer.pending_row_with_id(id).is_none() {
                return Err(ThreadError::MessageNotFound(id.to_owned()));
            }
            let hooks = self.hooks();
            let state = self.state();
            let updates = chain::before_update_message(&hooks, &state, id, updates)
                .await
                .map_err(|prevented| ThreadError::Hook(prevented.error))?;
            check_updates(&updates)?;
            if !stored && let Some(row) = self.writer.update_pending_row(id, updates.clone()) {
                chain::after_update_message(&hooks, &state, &row).await;
                return Ok(row);
            }
            self.append(vec![self.writer.record(RecordBody::MessageUpdated {
                message_id: id.to_owned(),
                updates: updates.clone(),
            })])
            .await?;
            // As stored; the update is stored, so a failed read back of it stands in the row as
            // read before with the updates applied (as `inject_message`).
            let row = match self.writer.with_fold(|conversation| conversation.find_row(id)).await {
                Ok(Some(row)) => row,
                Ok(None) => return Err(ThreadError::MessageNotFound(id.to_owned())),
                Err(_) => {
                    let mut row = before.ok_or_else(|| ThreadError::MessageNotFound(id.to_owned()))?;
                    apply_updates(&mut row, updates);
                    row
                }
            };
            chain::after_update_message(&hooks, &state, &row).await;
            Ok(row)
        })
    }

    fn delete_message<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, ThreadError>> {
        Box::pin(async move {
            self.writer.check_open("delete_message")?;
            if !self
                .writer
                .with_fold(|conversation| conversation.find_row(id).is_some())
                .await?
            {
                // The running step's row, which the reads show: not stored yet, so not
                // deleted either, and said so (it exists).
                if self.writer.pending_row_with_id(id).is_some() {
                    return Err(ThreadError::Unavailable(format!(
                        "The running step's row \"{id}\" can be deleted once its step is stored (from after_create_message, or a later turn)."
                    )));
                }
                return Ok(false);
            }
            self.append(vec![self.writer.record(RecordBody::MessageDeleted {
                message_id: id.to_owned(),
            })])
            .await?;
            Ok(true)
        })
    }

    fn queue_message(&self, content: String) -> BoxFuture<'_, Result<(), ThreadError>> {
        Box::pin(async move {
            self.writer
                .binding
                .dispatch(DeliveredMessage::user(content))
                .await
                .map(drop)
                .map_err(|error| ThreadError::Invalid(error.to_string()))
        })
    }

    fn invoke_tool<'a>(&'a self, name: &'a str, args: Value) -> BoxFuture<'a, Result<ToolResult, ThreadError>> {
        Box::pin(async move {
            self.writer.check_open("invoke_tool")?;
            let tool = self
                .tools
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .iter()
                .find(|tool| tool.name() == name)
                .cloned()
                .ok_or_else(|| ThreadError::Invalid(format!("No tool named \"{name}\" is mounted in this render.")))?;
            let signal = self
                .execution
                .as_ref()
                .map(|execution| execution.abort_signal().clone())
                .unwrap_or_default();
            let call_id = new_id("invoke");
            let mut ctx = ToolContext::new(&tool, call_id.clone())
                .with_instance_id(self.identity.thread_id.clone())
                .with_signal(signal.clone())
                .with_thread(self.state());
            // Its lines are published as a model's call's are.
            if let Some(log) = self.writer.log_base() {
                ctx = ctx.with_logger(crate::session::tool_call_logger(&log, tool.name(), &call_id));
            }
            let output = crate::tools::run_one(&tool, ctx, &args.to_string(), &signal).await;
            Ok(super::tool_result_of(&output.to_text(), output.is_error))
        })
    }

    fn queue_tool(&self, tool: Tool, args: Value) -> Result<(), ThreadError> {
        self.writer.check_open("queue_tool")?;
        if self.execution.is_none() {
            return Err(ThreadError::Unavailable(
                "queue_tool needs a running execution; this ThreadState is at rest.".into(),
            ));
        }
        // A queued tool is never rendered, so the render's check of reserved names does not
        // see it: one named like a framework tool would be stored as that tool's call (and a
        // re-attempt would run the framework's tool on it).
        if flue_core::tool::RESERVED_TOOL_NAMES.contains(&tool.name()) {
            return Err(ThreadError::Invalid(
                flue_core::ToolNameConflictError::reserved(tool.name()).to_string(),
            ));
        }
        // Calls are stored, and found again by a re-attempt, by name: another tool of the
        // same name (mounted in this render, or queued already) would be run in its place.
        let clashes = |other: &Tool| other.name() == tool.name() && other.identity() != tool.identity();
        let mounted_clash = self
            .tools
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .any(clashes);
        let mut queued = self
            .queued_tools
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if mounted_clash || queued.iter().any(|(other, _)| clashes(other)) {
            return Err(ThreadError::Invalid(format!(
                "{} queue_tool needs the tool mounted under that name, or a name of its own.",
                flue_core::ToolNameConflictError::duplicate(tool.name())
            )));
        }
        queued.push((tool, args));
        Ok(())
    }

    fn declared_secrets(&self) -> Vec<&'static str> {
        let mut names: Vec<&'static str> = Vec::new();
        for tool in self
            .tools
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
        {
            for name in tool.definition().secrets.iter() {
                if !names.contains(name) {
                    names.push(name);
                }
            }
        }
        names
    }

    fn env(&self, name: &str) -> Result<flue_core::tool::Secret, ThreadError> {
        let declared = self
            .tools
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .any(|tool| tool.definition().secrets.contains(&name));
        if !declared {
            return Err(ThreadError::Invalid(format!(
                "The variable \"{name}\" is not declared by any tool of this render; declare it with `secrets = [\"{name}\"]` on the tool that needs it."
            )));
        }
        std::env::var(name)
            .ok()
            .filter(|value| !value.is_empty())
            .map(flue_core::tool::Secret::new)
            .ok_or_else(|| ThreadError::Invalid(format!("The variable \"{name}\" is declared but not set.")))
    }

    fn emit(&self, event: &str, data: Value) {
        self.emit_event(event, data);
    }

    fn get_value<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Value>, ThreadError>> {
        Box::pin(async move {
            self.writer
                .with_fold(|conversation| conversation.values.get(key).cloned())
                .await
        })
    }

    fn set_value<'a>(&'a self, key: &'a str, value: Option<Value>) -> BoxFuture<'a, Result<(), ThreadError>> {
        Box::pin(async move {
            if key.is_empty() || key.chars().count() > MAX_KEY_LEN {
                return Err(ThreadError::Invalid(format!(
                    "A thread value key must be 1 to {MAX_KEY_LEN} characters long."
                )));
            }
            let value = value.unwrap_or(Value::Null);
            let deleted = value.is_null();
            let record = self.writer.record(RecordBody::ThreadValueSet {
                key: key.to_owned(),
                value,
            });
            let updated_at = record.timestamp.clone();
            // Its event goes with the write: a write that is stored is announced.
            let changed = Event::ThreadEvent {
                event_type: "kv_changed".to_owned(),
                data: json!({"key": key, "deleted": deleted, "updated_at": &*updated_at}),
            };
            self.writer
                .append_open(vec![record].into(), "A write to the thread", Some(changed))
                .await
                .map(drop)
        })
    }
}
