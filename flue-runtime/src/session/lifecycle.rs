//! The lifecycle-hook points of one response (DESIGN §4, reference §1.3): the thread's
//! creation, the input row, the request (`after_system_message`, `filter_messages`,
//! `prefilter_llm_history`), the assistant row, and each tool call's chain. Every point costs
//! nothing when no hook of its kinds is selected.

use flue_core::lifecycle::{
    HookKind, Message, MessageRole, MessageStatus, MessageUpdates, ThreadState, ToolCall, ToolStatus,
};
use serde_json::{Map, Value, json};

use super::{Failure, Response};
use crate::lifecycle::chain::{self, Blocked};
use crate::lifecycle::thread::apply_updates;
use crate::lifecycle::{HookSet, llm, outcome_of, tool_result_of};
use crate::provider::{Messages, ModelMessage, StopReason};
use crate::record::{AttachmentRef, Record, RecordBody, now};
use crate::session::conversation::micros_of;
use crate::tools::Executed;

/// The longest a `tool_call_started` hook may hold up the model stream.
const STARTED_HOOK_BUDGET: std::time::Duration = std::time::Duration::from_secs(30);

/// The fields a hook changed on a row beyond its content and tool outcome (`silent`,
/// `metadata`, `name`, `status`), as the updates that record them.
fn changed_fields(original: &Message, changed: &Message, updates: &mut MessageUpdates) {
    if changed.silent != original.silent {
        updates.insert("silent".into(), json!(changed.silent));
    }
    if changed.metadata != original.metadata {
        updates.insert("metadata".into(), Value::Object(changed.metadata.clone()));
    }
    if changed.name != original.name {
        updates.insert("name".into(), json!(changed.name));
    }
    if changed.status != original.status && changed.status.is_some() {
        updates.insert("status".into(), json!(changed.status));
    }
}

fn row(id: String, role: MessageRole, content: String) -> Message {
    Message {
        id,
        role,
        content: Some(content),
        name: None,
        tool_calls: None,
        tool_call_id: None,
        tool_status: None,
        status: Some(MessageStatus::Completed),
        created_at: micros_of(&now()),
        silent: false,
        metadata: Map::new(),
        attachments: Vec::new(),
    }
}

fn creates_rows(hooks: &HookSet) -> bool {
    hooks.has(HookKind::BeforeCreateMessage) || hooks.has(HookKind::AfterCreateMessage)
}

/// A row the response stores of its own (an input, an appended signal), for its
/// `after_create_message`.
pub(super) struct CreatedRow(Option<Message>);

/// What an input row's create hooks decided.
pub(super) enum InputRow {
    /// Store these records (the input, then fields the hooks set beyond its content).
    Store(Vec<Record>, CreatedRow),
    /// A `before_create_message` hook prevented the row (`message_hook_error`).
    Prevented(Failure),
}

/// A tool call's stored outcome after its hook chain.
pub(super) struct StoredOutcome {
    pub(super) content: String,
    pub(super) is_error: bool,
    /// Fields the create hooks set beyond the content: a `MessageUpdated` beside the outcome,
    /// which the fold applies when the batch's marker creates the row.
    pub(super) updates: MessageUpdates,
}

impl Response<'_> {
    /// `after_thread_created`, once per thread before its first turn: with the first render's
    /// hook set (its `use_hooks`, else the agent's) and the at-rest state (no execution). A
    /// marker records that it ran, so a re-attempt does not run it again.
    pub(super) async fn thread_created(&mut self) -> Result<(), Failure> {
        if !self.conversation.is_new()
            || self.conversation.thread_created_hooks_ran
            || !self.hooks.has(HookKind::AfterThreadCreated)
        {
            return Ok(());
        }
        let state = self.at_rest_view().state();
        chain::after_thread_created(&self.hooks, &state).await;
        let marker = self.record(RecordBody::ThreadCreatedHooksRan);
        self.commit(vec![marker], false).await
    }

    /// The input row's create hooks (at rest: the agent-level hooks). The content a hook
    /// returns is what is stored; a `before_create_message` error prevents the row.
    pub(super) async fn input_row(&mut self, input: Record) -> InputRow {
        let hooks = self.at_rest_hooks.clone();
        if !creates_rows(&hooks) {
            return InputRow::Store(input_batch(input), CreatedRow(None));
        }
        let state = self.at_rest_view().state();
        self.created_row(&hooks, &state, input).await
    }

    /// The create hooks of signals the response stores of its own: what `use_agent_start` and
    /// `use_agent_finish` callbacks appended, the framework's narration (with the render's
    /// hooks), as an input signal's. The content a hook returns is what is stored; a
    /// `before_create_message` error leaves that signal out (not stored, so nothing answers
    /// it; what it came with happens all the same). Returns the records to store (each kept
    /// signal's, then the fields its hooks set beyond its content; any other record as it is),
    /// which of the signals were kept (in order), and the rows for `after_create_message`.
    pub(super) async fn created_signals(&mut self, records: Vec<Record>) -> (Vec<Record>, Vec<bool>, Vec<CreatedRow>) {
        let signals = records
            .iter()
            .filter(|record| matches!(record.body, RecordBody::Signal { .. }))
            .count();
        // Every start seam and narration comes here: without create hooks, nothing is copied.
        if signals == 0 || !creates_rows(&self.hooks) {
            return (records, vec![true; signals], Vec::new());
        }
        let hooks = self.hooks.clone();
        let state = self.thread_view().state();
        let (mut stored, mut kept, mut created) = (Vec::with_capacity(records.len()), Vec::new(), Vec::new());
        for record in records {
            if !matches!(record.body, RecordBody::Signal { .. }) {
                stored.push(record);
                continue;
            }
            match self.created_row(&hooks, &state, record).await {
                InputRow::Store(records, row) => {
                    stored.extend(records);
                    kept.push(true);
                    created.push(row);
                }
                InputRow::Prevented(failure) => {
                    tracing::warn!(instance = %self.key, submission = %self.submission.id, error = %failure.error.message, "a before_create_message hook refused a signal the response appended; it is not stored");
                    kept.push(false);
                }
            }
        }
        (stored, kept, created)
    }

    /// `after_create_message` for stored signals ([`Self::created_signals`]), with the
    /// render's hooks.
    pub(super) async fn signals_created(&mut self, created: Vec<CreatedRow>) {
        let hooks = self.hooks.clone();
        if created.is_empty() || !hooks.has(HookKind::AfterCreateMessage) {
            return;
        }
        let state = self.thread_view().state();
        for row in created {
            let Some(row) = row.0 else { continue };
            let stored = self.conversation.find_row(&row.id).unwrap_or(row);
            chain::after_create_message(&hooks, &state, &stored).await;
        }
    }

    /// `input`'s create hooks from `hooks` (a user message or a signal).
    async fn created_row(&mut self, hooks: &HookSet, state: &ThreadState, mut input: Record) -> InputRow {
        let original = match &input.body {
            RecordBody::UserMessage {
                message_id,
                body,
                attachments,
            } => {
                let mut row = row(message_id.clone(), MessageRole::User, body.clone());
                row.attachments = attachments.iter().map(AttachmentRef::to_message_attachment).collect();
                row
            }
            RecordBody::Signal {
                message_id,
                signal_type,
                body,
                ..
            } => {
                let mut row = row(message_id.clone(), MessageRole::User, body.clone());
                row.metadata.insert("signal_type".into(), json!(signal_type));
                row
            }
            _ => return InputRow::Store(input_batch(input), CreatedRow(None)),
        };
        let created = match chain::before_create_message(hooks, state, original.clone()).await {
            Ok(created) => created,
            Err(prevented) => {
                return InputRow::Prevented(Failure::failed("message_hook_error", prevented.error.message));
            }
        };
        let content = created.content.clone().unwrap_or_default();
        match &mut input.body {
            RecordBody::UserMessage { body, attachments, .. } => {
                *body = content;
                // The images the hook left out are not stored (nor sent, nor served); it
                // cannot add any.
                attachments.retain(|attachment| created.attachments.iter().any(|kept| kept.id == attachment.id));
            }
            RecordBody::Signal { body, .. } => *body = content,
            _ => {}
        }
        let mut updates = MessageUpdates::new();
        let mut compared = created.clone();
        // The signal type is the row's own metadata: a hook that dropped it changed nothing.
        if original.metadata.contains_key("signal_type") {
            compared
                .metadata
                .entry("signal_type")
                .or_insert_with(|| original.metadata["signal_type"].clone());
        }
        changed_fields(&original, &compared, &mut updates);
        let mut records = input_batch(input);
        if !updates.is_empty() {
            records.push(self.record(RecordBody::MessageUpdated {
                message_id: created.id.clone(),
                updates,
            }));
        }
        InputRow::Store(records, CreatedRow(Some(created)))
    }

    /// `after_create_message` for a stored input row.
    pub(super) async fn input_row_created(&mut self, created: CreatedRow) {
        let Some(created) = created.0 else { return };
        let hooks = self.at_rest_hooks.clone();
        if hooks.has(HookKind::AfterCreateMessage) {
            let stored = self.conversation.find_row(&created.id).unwrap_or(created);
            chain::after_create_message(&hooks, &self.at_rest_view().state(), &stored).await;
        }
    }

    /// The request of a model step: the system message after `after_system_message`, the
    /// history after `filter_messages` (pending rows excluded, stored rows untouched, orphan
    /// calls and results dropped), then `prefilter_llm_history` on the provider format.
    pub(super) async fn request(&mut self, system: Option<String>) -> Result<(Option<String>, Messages), Blocked> {
        self.fold_thread_writes();
        if let Some((spec, _)) = &self.model_spec {
            self.conversation.fit_reasoning_to(spec);
        }
        if self.hooks.is_empty() {
            return Ok((system, self.conversation.model_messages()));
        }
        let hooks = self.hooks.clone();
        let state = self.thread_view().state();
        let mut system = system;
        if hooks.has(HookKind::AfterSystemMessage) {
            if let Some(hooked) = &self.hooked_system {
                // The step's call made again (after an overflow's compaction): the hook ran.
                system.clone_from(hooked);
            } else {
                let text = chain::after_system_message(&hooks, &state, system.clone().unwrap_or_default()).await;
                system = (!text.is_empty()).then_some(text);
                self.hooked_system = Some(system.clone());
                // Rows the hook injected are part of this step's snapshot.
                self.fold_thread_writes();
            }
        }
        let mut messages = if hooks.has(HookKind::FilterMessages) {
            let rows: Vec<Message> = self
                .conversation
                .rows()
                .into_iter()
                .filter(|row| row.status != Some(MessageStatus::Pending))
                .collect();
            let rows = chain::filter_messages(&hooks, &state, rows).await;
            self.conversation.model_messages_of(&rows).into()
        } else {
            self.conversation.model_messages()
        };
        if hooks.has(HookKind::PrefilterLlmHistory) {
            let provider_format = llm::to_llm(system.as_deref(), &messages);
            let dispatched = chain::prefilter_llm_history(&hooks, &state, provider_format).await?;
            let (prefiltered, history) = llm::from_llm(dispatched, &messages);
            (system, messages) = (prefiltered, history.into());
        }
        Ok((system, messages))
    }

    /// The messages of the rows `from..cut` as the message hooks let the model read them: what
    /// a compaction may summarize. `filter_messages` runs on the history as
    /// [`request`](Self::request) runs it (pending rows excluded), and of the rows it returns
    /// those among `from..cut` are kept (rows it adds are context, not history); then
    /// `prefilter_llm_history` runs on them in the provider format, the summary instructions
    /// as its system message. The thread's writes are not folded here (the compaction's cut
    /// was taken before them). `Err` when `prefilter_llm_history` blocked them.
    pub(super) async fn older_history(&mut self, from: usize, cut: usize) -> Result<Vec<ModelMessage>, String> {
        if self.hooks.is_empty() {
            return Ok(self.conversation.older_messages(from, cut));
        }
        let hooks = self.hooks.clone();
        let state = self.thread_view().state();
        let messages = if hooks.has(HookKind::FilterMessages) {
            let rows = self.conversation.rows();
            let older = rows.get(from..cut.min(rows.len())).unwrap_or_default();
            let ids: std::collections::HashSet<&str> = older.iter().map(|row| row.id.as_str()).collect();
            let visible: Vec<Message> = rows
                .iter()
                .filter(|row| row.status != Some(MessageStatus::Pending))
                .cloned()
                .collect();
            let kept: Vec<Message> = chain::filter_messages(&hooks, &state, visible)
                .await
                .into_iter()
                .filter(|row| ids.contains(row.id.as_str()))
                .collect();
            self.conversation.model_messages_of(&kept)
        } else {
            self.conversation.older_messages(from, cut)
        };
        if !hooks.has(HookKind::PrefilterLlmHistory) {
            return Ok(messages);
        }
        let provider_format = llm::to_llm(Some(crate::compaction::SUMMARY_INSTRUCTIONS), &messages);
        let dispatched = chain::prefilter_llm_history(&hooks, &state, provider_format)
            .await
            .map_err(|_| "prefilter_llm_history blocked the history the summary was to read".to_owned())?;
        Ok(llm::from_llm(dispatched, &messages).1)
    }

    /// The pending assistant row's create hooks, before the model is called: returns the
    /// fields they set (recorded with the step). Their errors continue with the last good row.
    pub(super) async fn assistant_row_created(&mut self, message_id: &str) -> MessageUpdates {
        let mut updates = MessageUpdates::new();
        let updates_rows =
            self.hooks.has(HookKind::BeforeUpdateMessage) || self.hooks.has(HookKind::AfterUpdateMessage);
        if !creates_rows(&self.hooks) && !updates_rows {
            return updates;
        }
        let mut pending = row(message_id.to_owned(), MessageRole::Assistant, String::new());
        pending.status = Some(MessageStatus::Pending);
        if !creates_rows(&self.hooks) {
            // No create hook: the row is still the thread's while the step runs, for the update
            // hooks of its completion or its failure.
            self.writer.set_pending_row(Some(pending));
            return updates;
        }
        let state = self.thread_view().state();
        let created = match chain::before_create_message(&self.hooks, &state, pending.clone()).await {
            Ok(created) => created,
            Err(prevented) => prevented.last_good,
        };
        let mut compared = created.clone();
        compared.status = pending.status;
        changed_fields(&pending, &compared, &mut updates);
        // The row is the thread's from here (its hooks read it back); a completed step stores
        // it, a failed one marks it failed.
        let mut shown = created.clone();
        shown.status = Some(MessageStatus::Pending);
        self.writer.set_pending_row(Some(shown));
        chain::after_create_message(&self.hooks, &state, &created).await;
        updates
    }

    /// A step whose model call failed after its row was created: the row's `failed` status
    /// through `before_update_message` (its errors continue with the last good updates) and
    /// `after_update_message`, which read the failed row in the thread. Only completed steps
    /// are stored, so the row then leaves the thread with its attempt.
    pub(super) async fn assistant_row_failed(&mut self, message_id: &str) {
        let Some(mut failed) = self.writer.take_pending_row() else {
            return;
        };
        let hooks = self.hooks.clone();
        if !hooks.has(HookKind::BeforeUpdateMessage) && !hooks.has(HookKind::AfterUpdateMessage) {
            return;
        }
        let state = self.thread_view().state();
        let mut proposed = MessageUpdates::new();
        proposed.insert("status".into(), json!(MessageStatus::Failed));
        if hooks.has(HookKind::BeforeUpdateMessage) {
            let applied = match chain::before_update_message(&hooks, &state, message_id, proposed).await {
                Ok(applied) => applied,
                Err(prevented) => prevented.last_good,
            };
            // The status stays failed whatever the hooks said: the step did fail.
            match crate::lifecycle::thread::check_updates(&applied) {
                Ok(()) => apply_updates(&mut failed, applied),
                Err(error) => chain::log_failure(
                    HookKind::BeforeUpdateMessage,
                    "(chain)",
                    &flue_core::lifecycle::HookError::new(error.to_string()),
                ),
            }
        }
        failed.status = Some(MessageStatus::Failed);
        self.writer.set_pending_row(Some(failed.clone()));
        chain::after_update_message(&hooks, &state, &failed).await;
        self.writer.set_pending_row(None);
    }

    /// The step's final content and status through `before_update_message` (its errors
    /// continue with the last good updates): returns the text to store, and adds the other
    /// fields to `updates`.
    pub(super) async fn assistant_row_updating(
        &mut self,
        message_id: &str,
        text: String,
        updates: &mut MessageUpdates,
    ) -> String {
        if !self.hooks.has(HookKind::BeforeUpdateMessage) {
            return text;
        }
        let mut proposed = MessageUpdates::new();
        proposed.insert("content".into(), json!(text));
        proposed.insert("status".into(), json!(MessageStatus::Completed));
        let state = self.thread_view().state();
        let applied = match chain::before_update_message(&self.hooks, &state, message_id, proposed).await {
            Ok(applied) => applied,
            Err(prevented) => prevented.last_good,
        };
        if let Err(error) = crate::lifecycle::thread::check_updates(&applied) {
            chain::log_failure(
                HookKind::BeforeUpdateMessage,
                "(chain)",
                &flue_core::lifecycle::HookError::new(error.to_string()),
            );
            return text;
        }
        let mut text = text;
        for (field, value) in applied {
            match (field.as_str(), value) {
                ("content", Value::String(content)) => text = content,
                ("status", Value::String(status)) if status == "completed" => {}
                (_, value) => {
                    updates.insert(field, value);
                }
            }
        }
        text
    }

    /// `after_update_message` with the stored step row.
    pub(super) async fn assistant_row_updated(&mut self, message_id: &str) {
        if !self.hooks.has(HookKind::AfterUpdateMessage) {
            return;
        }
        if let Some(stored) = self.conversation.find_row(message_id) {
            let state = self.thread_view().state();
            chain::after_update_message(&self.hooks, &state, &stored).await;
        }
    }

    /// The step's answer when `prefilter_llm_history` blocked the request: the hook's error
    /// text, stored as the step's assistant message (no model call was made). A request made
    /// again after an overflow's compaction has its row already: what its create hooks set
    /// (`created`) and `update_message` set since are stored with the step, as after a model
    /// call, and the row leaves the thread for the stream's.
    pub(super) async fn blocked_step(
        &mut self,
        spec: &str,
        message_id: String,
        blocked: Blocked,
        live: Option<super::LiveText>,
        created: Option<MessageUpdates>,
    ) -> Result<crate::provider::ModelResponse, Failure> {
        let text = blocked.0.message;
        // A call made again after an overflow's compaction has its start already (and what
        // the first step carries with it).
        let live = live.unwrap_or_else(|| self.live_text(&message_id, spec, None));
        if let Some(started) = live.appended_start() {
            self.reply.add(started);
        }
        let mut records = live.into_unappended();
        let stored_id = message_id.clone();
        records.extend([self.record(RecordBody::AssistantMessageCompleted {
            message_id,
            text: text.clone(),
            reasoning: String::new(),
            reasoning_blocks: Vec::new(),
            stop_reason: StopReason::HookBlocked,
            usage: Default::default(),
        })]);
        if let Some(mut updates) = created {
            updates.extend(self.writer.take_pending_updates());
            if !updates.is_empty() {
                records.push(self.record(RecordBody::MessageUpdated {
                    message_id: stored_id.clone(),
                    updates,
                }));
            }
        }
        self.commit(records, false).await?;
        // Observers see the step's message as they see any other (and `agent_end` carries it).
        self.stored_message_events(Some(&stored_id));
        // The response has its message: a late update of its row, then the data written before
        // it (by a start callback, say), as after a model step.
        self.after_step_stored(&stored_id).await?;
        Ok(crate::provider::ModelResponse {
            text,
            reasoning: String::new(),
            reasoning_blocks: Vec::new(),
            tool_calls: Vec::new(),
            stop_reason: StopReason::HookBlocked,
            usage: Default::default(),
        })
    }

    /// Whether any hook of a tool call's chain is selected.
    pub(super) fn has_tool_hooks(&self) -> bool {
        [
            HookKind::ToolCallDone,
            HookKind::AfterToolCallSuccess,
            HookKind::AfterToolCallFailure,
            HookKind::BeforeStoreToolResult,
            HookKind::BeforeCreateMessage,
            HookKind::AfterCreateMessage,
        ]
        .into_iter()
        .any(|kind| self.hooks.has(kind))
    }

    /// `after_create_message` for the tool rows a batch stored.
    pub(super) async fn tool_rows_created(&mut self, row_ids: &[String]) {
        if !self.hooks.has(HookKind::AfterCreateMessage) {
            return;
        }
        let state = self.thread_view().state();
        for id in row_ids {
            if let Some(stored) = self.conversation.find_row(id) {
                chain::after_create_message(&self.hooks, &state, &stored).await;
            }
        }
    }

    /// `tool_call_started` hooks for a call that appeared in the stream, waited for at most
    /// 30 s, and not past an abort (or the deadline's): hooks still running then are left
    /// running (on a task of their own, in order) and the stream goes on (standard-agents
    /// §1.3), or ends as aborted.
    pub(super) async fn tool_call_started_hooks(&self, id: &str, name: &str, arguments: &str, progress: Option<&str>) {
        if !self.hooks.has(HookKind::ToolCallStarted) {
            return;
        }
        // The view exists: a render with hooks made it.
        let Some(view) = &self.thread else { return };
        let (hooks, state) = (self.hooks.clone(), view.state());
        let (call, progress) = (ToolCall::new(id, name, arguments), progress.map(str::to_owned));
        let mut run = Box::pin(async move {
            chain::tool_call_started(&hooks, &state, &call, progress.as_deref()).await;
        });
        if self.attempt.signal.is_aborted() {
            tokio::spawn(run);
            return;
        }
        tokio::select! {
            biased;
            () = &mut run => {}
            () = self.attempt.signal.aborted() => {
                tracing::debug!(target: "flue::hooks", tool_call_id = id, "[Hooks] the response was aborted while tool_call_started hooks ran; they go on running");
                tokio::spawn(run);
            }
            () = tokio::time::sleep(STARTED_HOOK_BUDGET) => {
                tracing::warn!(target: "flue::hooks", tool_call_id = id, "[Hooks] tool_call_started hooks ran past 30 s; the stream went on, and they go on running");
                tokio::spawn(run);
            }
        }
    }
}

/// One executed call's chain: `tool_call_done` (the raw result), `after_tool_call_success` or
/// `_failure`, `before_store_tool_result`, then the tool row's `before_create_message` (whose
/// errors continue with the last good row: a tool result is always stored). Runs as the call
/// finishes, while the batch's other calls run on.
pub(super) async fn tool_outcome(
    hooks: &HookSet,
    state: &ThreadState,
    run: &Executed<'_>,
    row_id: &str,
) -> StoredOutcome {
    let call = ToolCall::new(run.call.id.clone(), run.call.name.clone(), run.call.arguments.clone());
    let raw = tool_result_of(&run.output.to_text(), run.output.is_error);
    chain::tool_call_done(hooks, state, &call, &raw).await;
    let result = chain::after_tool_call(hooks, state, &call, raw).await;
    let result = chain::before_store_tool_result(hooks, state, &call, result).await;
    let (mut content, mut is_error) = outcome_of(&result);
    let mut updates = MessageUpdates::new();
    if hooks.has(HookKind::BeforeCreateMessage) {
        let mut original = row(row_id.to_owned(), MessageRole::Tool, content.clone());
        original.name = Some(call.function.name.clone());
        original.tool_call_id = Some(call.id.clone());
        original.tool_status = Some(if is_error {
            ToolStatus::Error
        } else {
            ToolStatus::Success
        });
        let created = match chain::before_create_message(hooks, state, original.clone()).await {
            Ok(created) => created,
            Err(prevented) => prevented.last_good,
        };
        content = created.content.clone().unwrap_or_default();
        if let Some(status) = created.tool_status {
            is_error = status == ToolStatus::Error;
        }
        let mut compared = created;
        compared.name = original.name.clone().or(compared.name);
        changed_fields(&original, &compared, &mut updates);
    }
    StoredOutcome {
        content,
        is_error,
        updates,
    }
}

/// A batch of the input's record, with room for the one that may follow it in its commit (its
/// `MessageUpdated`, or the start seam's marker).
fn input_batch(input: Record) -> Vec<Record> {
    let mut records = Vec::with_capacity(2);
    records.push(input);
    records
}
