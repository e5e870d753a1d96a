//! Delegation: the framework's `task` tool, the "Available Agents" roster in the system prompt,
//! and the child sessions tasks run in.
//!
//! - Every session has the `task` tool — one static spec (`agent`, `prompt`, optional
//!   `description` and `cwd`), always present, so the serialized tool block never changes with the
//!   roster — and an "Available Agents" section listing each offered delegate by name and
//!   description (or saying there is none: the tool is inert then).
//! - Hidden relationships are not offered (and cannot be called); optional ones only while
//!   their flag is on. A name outside the roster is answered with a factual miss, not an error.
//! - A task renders its delegate fresh, in a subagent frame, with the task prompt as its
//!   delivery, and runs it as a detached session: its own context (only the prompt), its own
//!   tools, the parent's model and thinking level unless the relationship overrides them, and
//!   the parent's sandbox (the call's `cwd` moves its working directory). Only the child's
//!   answer returns, as the tool result: its final text, or for a run that a tool batch ended
//!   (every tool of it asked to terminate) that step's text, else what the tools returned.
//!   A delegate runs no lifecycle hooks: `use_subagent` refuses an agent whose definition
//!   selects some, and its render cannot select any. Nor do its tools get a thread
//!   ([`ToolContext::thread`](flue_core::ToolContext::thread) is `None` in a task).
//! - Delegation is capped at four levels (`delegation_depth_exceeded`); `max_instances` caps
//!   the tasks of one relationship running at once; `after_subagent_created` runs on the
//!   parent before the child's first model call.
//! - Child sessions are durable (reference §3.2-3.3, §3.9 step 7 "tasks reattach"). A task's
//!   child conversation is a record stream of its own, keyed [`child_key`]: the parent's
//!   agent with a `:task` suffix (never a registered agent's name, so neither admission nor
//!   HTTP reaches it) and `<parent id>/<task id>`. Its birth batch — a `conversation_created`
//!   of kind `task` naming the parent, the task id and the delegate, then the prompt as a
//!   `user_message` — is created atomically with the parent's `child_session_retained` link
//!   ([`Store::create_child`](crate::store::Store::create_child)), so a link never names a
//!   missing child. The child's steps, tool calls, outcomes and batch commits follow as the
//!   parent's records would, every append fenced by the parent's attempt; the child's
//!   conversation is the usual fold of its stream.
//! - The `task` tool is durable: a parent batch interrupted before it committed runs its task
//!   calls again, and each reattaches to the child its call created (found through the link of
//!   the uncommitted batch, by tool call id) and goes on from the child's durable state — an
//!   interrupted child batch is repaired as the parent's would be (durable calls and nested
//!   tasks run again, the rest get the outcome-unknown result), and a child that already
//!   answered returns that answer without calling the model. A task whose child append fails
//!   fails the parent's attempt, which is re-attempted from what is durable.
//! - A child's conversation compacts as the root's does ([`crate::compaction`]), with the
//!   submission's compaction settings: before a call whose estimated input would not fit, and
//!   once on a call the provider refuses as a context overflow (an overflow that persists
//!   fails the task). The `compaction` record is a record of the child's stream, fenced like
//!   the others, so a reattached child goes on from the compacted history; its step count (for
//!   `max_steps`) counts the summarized steps too.
//! - A reattached task whose child answered returns that answer before anything else
//!   (whatever the current render offers); one whose child did not is rendered afresh (its
//!   system prompt and tools are the current render's), publishes `task_start` again under
//!   its task id, and runs
//!   `after_subagent_created` again only while its child has no model step. Its link stays in
//!   the parent's stream once the batch commits (never reattached again); child streams are
//!   never listed, projected or deleted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use base64::Engine as _;
use flue_core::abort::AbortSignal;
use flue_core::data::SchemaSource;
use flue_core::lifecycle::{
    ExecutionState, InjectMessage, Message, MessagePage, MessageUpdates, MessagesQuery, ThreadContext, ThreadError,
    ThreadIdentity, ThreadState, ThreadStateApi, ToolResult,
};
use flue_core::message::{Attachment, DeliveredMessage, UserMessage};
use flue_core::model::{Compaction, ThinkingLevel};
use flue_core::render::{RenderState, Rendered};
use flue_core::subagent::Subagent;
use flue_core::tool::{ToolContext, ToolDefinition, ToolHandler, ToolOutput};
use flue_core::{BoxFuture, Tool};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::compaction::{Budget, Compacting, Failed};
use crate::events::{Event, LazyId, OperationKind, TaskScope, TurnPurpose, TurnResponse};
use crate::lifecycle::thread::ThreadWriter;
use crate::lifecycle::{HookSet, chain};
use crate::provider::{ModelImage, ModelMessage, ModelRequest, ModelToolCall, StreamEvent, ToolSpec};
use crate::record::{AttachmentRef, Batch, ConversationKind, Record, RecordBody, SettlementError, new_id, now};
use crate::runtime::RuntimeInner;
use crate::sandbox::Environment;
use crate::session::{Attempt, CallIds, Conversation, RetainedChild};
use crate::store::{AttachmentPut, InstanceKey, StoreError};
use flue_core::usage::Usage;

/// How deep delegation may nest (a task's child delegating, and so on).
pub const MAX_DELEGATION_DEPTH: u32 = 4;

tokio::task_local! {
    /// The depth of the child session being run (the root's children are at 1): what a task
    /// started from within it, through whichever delegation, counts from.
    static TASK_DEPTH: u32;
}

const TASK_DESCRIPTION: &str = "Hand a focused piece of work to one of the agents listed under \"Available Agents\" in the system prompt or announced since. \
The agent starts with a fresh context: it sees only your prompt, so make the prompt a complete briefing. \
To show it images of this conversation, pass their attachment ids. \
Only its final answer comes back. Several tasks in one turn run in parallel.";

/// The roster section while no delegate is offered (the `task` tool is there all the same).
const NO_AGENTS: &str = "## Available Agents\n\nNone: no agent is available for delegation now, so do not call the `task` tool unless one is announced later.";

/// The roster section of a session at the delegation depth limit.
const AT_DEPTH_LIMIT: &str =
    "## Available Agents\n\nNone: this session is as deep as delegation goes, so do not call the `task` tool.";

/// The `task` tool's arguments.
#[derive(Deserialize, JsonSchema)]
struct TaskArgs {
    /// Which agent runs the task: a name from "Available Agents" in the system prompt.
    #[schemars(length(min = 1))]
    agent: String,
    /// The complete instructions for the agent (it sees nothing else of this conversation).
    #[schemars(length(min = 1))]
    prompt: String,
    /// A short label for the work, for people following along.
    #[serde(default)]
    description: Option<String>,
    /// The directory the agent works in, relative to yours (default: yours). Only with a
    /// sandbox.
    #[serde(default)]
    #[schemars(length(min = 1))]
    cwd: Option<String>,
    /// Images of this conversation for the agent to see with the prompt, by the ids listed
    /// under `<attachments>` in the messages that carry them.
    #[serde(default)]
    attachments: Option<Vec<TaskAttachment>>,
}

/// An image of the delegating conversation handed to a task.
#[derive(Deserialize, JsonSchema)]
struct TaskAttachment {
    /// The image's id, as listed under `<attachments>`.
    #[schemars(length(min = 1))]
    id: String,
}

/// The delegates a render offers: enabled relationships that are not hidden.
pub(crate) fn offered(rendered: &Rendered) -> Vec<Subagent> {
    rendered
        .subagents
        .iter()
        .filter(|subagent| !subagent.is_hidden() && subagent.is_enabled(|name| std::env::var(name).ok()))
        .cloned()
        .collect()
}

/// The "Available Agents" section of a session at the delegation depth limit.
pub(crate) fn roster_at_depth_limit() -> String {
    AT_DEPTH_LIMIT.to_owned()
}

/// The "Available Agents" section of the system prompt.
pub(crate) fn roster(offered: &[Subagent]) -> String {
    if offered.is_empty() {
        return NO_AGENTS.to_owned();
    }
    let mut section = String::from(
        "## Available Agents\n\nDelegate focused work to one of these agents with the `task` tool, naming the agent \
         (the list can change over the conversation: additions and removals are announced):\n",
    );
    for subagent in offered {
        section.push_str(&format!(
            "\n- **{}** — {}",
            crate::skills::one_line(subagent.name()),
            crate::skills::one_line(subagent.description())
        ));
    }
    section
}

/// What a `task` tool delegates with: the parent session's side of it. One per session; the
/// roster, the parent's state and its environment follow each render ([`Delegation::update`]).
pub(crate) struct Delegation {
    runtime: Weak<RuntimeInner>,
    /// Where events go (the root instance and submission).
    key: InstanceKey,
    submission_id: String,
    /// The parent session's model and thinking level.
    model: String,
    thinking: ThinkingLevel,
    /// The submission's compaction settings: every session of the submission compacts with
    /// them (a delegate's render cannot call `use_model`).
    compaction: Compaction,
    /// The parent session's depth (the root is 0).
    depth: u32,
    /// The task whose child session delegates (`None`: the root session): its tasks' events
    /// are that session's.
    scope: Option<Arc<TaskScope>>,
    signal: AbortSignal,
    /// Tasks running, by relationship (for `max_instances`).
    running: Mutex<HashMap<String, u32>>,
    live: Mutex<Live>,
    /// Where the session's tasks record their children (set before each tool batch).
    journal: Mutex<Option<Journal>>,
}

/// Where a session's tasks keep their child conversations: the stream the session records in,
/// the attempt that fences every append, and the children the uncommitted batch's `task`
/// calls created (by call id: a re-run of the call reattaches).
#[derive(Clone)]
pub(crate) struct Journal {
    attempt: Arc<Attempt>,
    stream: Stream,
    children: crate::fast_map::FastMap<String, RetainedChild>,
}

#[derive(Clone)]
enum Stream {
    /// The instance's own stream, through the attempt's writer.
    Root(Arc<ThreadWriter>),
    /// A child conversation's stream (a task's child delegating in turn).
    Child(InstanceKey),
}

impl Journal {
    /// The journal of a root session: its attempt's writer, and what its conversation says
    /// the uncommitted batch's tasks created.
    pub(crate) fn root(
        attempt: Arc<Attempt>,
        writer: Arc<ThreadWriter>,
        children: crate::fast_map::FastMap<String, RetainedChild>,
    ) -> Self {
        Self {
            attempt,
            stream: Stream::Root(writer),
            children,
        }
    }

    /// The stream the session records in.
    fn key(&self) -> InstanceKey {
        match &self.stream {
            Stream::Root(writer) => writer.key().clone(),
            Stream::Child(key) => key.clone(),
        }
    }

    /// A record of a child conversation's stream: written by the parent's attempt, belonging
    /// to no submission of its own.
    fn child_record(&self, body: RecordBody) -> Record {
        Record {
            id: new_id("record"),
            submission_id: None,
            attempt_id: Some(self.attempt.attempt.attempt_id.as_str().into()),
            timestamp: now(),
            body,
        }
    }

    /// A record of this journal's own stream.
    fn record(&self, body: RecordBody) -> Record {
        match &self.stream {
            Stream::Root(writer) => writer.record(body),
            Stream::Child(_) => self.child_record(body),
        }
    }

    /// A failed append of a child: the parent's attempt fails with it (its next batch is
    /// refused), so it is re-attempted from what is durable.
    fn failed(&self, error: StoreError) -> String {
        let error = error.to_string();
        self.attempt.fail_appends(error.clone());
        format!("The task's conversation could not be recorded: {error}")
    }

    /// Refuses to record more once one of the attempt's appends failed (a child's, say): the
    /// attempt is over, and an enclosing task must not commit a batch past the failure.
    fn check_live(&self) -> Result<(), String> {
        match self.attempt.failed_append() {
            Some(error) => Err(format!("The task's conversation could not be recorded: {error}")),
            None => Ok(()),
        }
    }

    /// Creates the child `child` with its `birth` batch and the link to it, atomically.
    async fn create_child(
        &self,
        runtime: &RuntimeInner,
        link: RecordBody,
        child: &InstanceKey,
        birth: Arc<[Record]>,
    ) -> Result<(), String> {
        self.check_live()?;
        let link: Arc<[Record]> = vec![self.record(link)].into();
        let created = match &self.stream {
            Stream::Root(writer) => writer.create_child(link, child, birth).await,
            Stream::Child(parent) => {
                runtime
                    .store
                    .create_child(parent, link, child, birth, Some(&self.attempt.attempt))
                    .await
            }
        };
        created.map(drop).map_err(|error| self.failed(error))
    }

    /// Appends one batch to the child `child`'s stream, fenced by the parent's attempt, and
    /// folds it into `conversation`.
    async fn append_child(
        &self,
        runtime: &RuntimeInner,
        child: &InstanceKey,
        records: Vec<Record>,
        conversation: &mut Conversation,
    ) -> Result<(), String> {
        let batch = self.append_to_child(runtime, child, records).await?;
        conversation.apply(&batch);
        Ok(())
    }

    /// Appends one batch to the child `child`'s stream, fenced by the parent's attempt; the
    /// caller folds it.
    async fn append_to_child(
        &self,
        runtime: &RuntimeInner,
        child: &InstanceKey,
        records: Vec<Record>,
    ) -> Result<Batch, String> {
        self.check_live()?;
        let records: Arc<[Record]> = records.into();
        let offset = runtime
            .store
            .append(child, records.clone(), Some(&self.attempt.attempt))
            .await
            .map_err(|error| self.failed(error))?;
        Ok(Batch { offset, records })
    }
}

/// What the parent's model reads of a child's answer: its text, or, when the child ended
/// without any (its step budget ran out after a tool step, its last step only reasoned), a
/// line saying so, never an empty tool result.
fn answer_text(answer: String) -> String {
    if answer.trim().is_empty() {
        "(task completed with no text)".to_owned()
    } else {
        answer
    }
}

/// The stream key of the child conversation `task_id` of the conversation `parent`: the
/// parent's agent with a `:task` suffix (once: a nested child keeps it) and the parent's id
/// with the task id. An agent name is `^[a-z][a-z0-9_]*$`, so no instance of a registered
/// agent can have this key, and no admission or HTTP read reaches it.
pub(crate) fn child_key(parent: &InstanceKey, task_id: &str) -> InstanceKey {
    let agent = if parent.agent.ends_with(CHILD_AGENT_SUFFIX) {
        parent.agent.clone()
    } else {
        format!("{}{CHILD_AGENT_SUFFIX}", parent.agent).into()
    };
    InstanceKey::new(agent, format!("{}/{task_id}", parent.id))
}

/// What a child conversation's stream key adds to its root agent's name.
const CHILD_AGENT_SUFFIX: &str = ":task";

/// What the latest render declares.
#[derive(Default)]
struct Live {
    offered: Vec<Subagent>,
    /// The parent thread and its hooks, for `after_subagent_created` (root sessions only).
    parent: Option<(ThreadState, HookSet)>,
    /// The parent's sandbox tools: children share the environment.
    environment: Environment,
    /// The images in front of the delegating session's model: those a task may hand on.
    attachments: Vec<AttachmentRef>,
}

impl Delegation {
    /// The delegation of a root session (depth 0).
    pub(crate) fn root(
        runtime: &Arc<RuntimeInner>,
        key: &InstanceKey,
        submission_id: &str,
        model: String,
        thinking: ThinkingLevel,
        compaction: Compaction,
        signal: AbortSignal,
    ) -> Self {
        Self {
            runtime: Arc::downgrade(runtime),
            key: key.clone(),
            submission_id: submission_id.to_owned(),
            model,
            thinking,
            compaction,
            depth: 0,
            scope: None,
            signal,
            running: Mutex::default(),
            live: Mutex::default(),
            journal: Mutex::default(),
        }
    }

    /// The delegation of the child session of the task `scope` this delegation runs: one level
    /// deeper, with the child's model.
    fn nested(&self, model: String, thinking: ThinkingLevel, scope: Arc<TaskScope>) -> Self {
        Self {
            runtime: self.runtime.clone(),
            key: self.key.clone(),
            submission_id: self.submission_id.clone(),
            model,
            thinking,
            compaction: self.compaction.clone(),
            depth: self.depth + 1,
            scope: Some(scope),
            signal: self.signal.clone(),
            running: Mutex::default(),
            live: Mutex::default(),
            journal: Mutex::default(),
        }
    }

    /// Where the next tool batch's tasks record their children.
    pub(crate) fn attach(&self, journal: Journal) {
        *self.journal.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(journal);
    }

    fn journal(&self) -> Option<Journal> {
        self.journal
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Lets go of what the latest render and tool batch gave the delegation (the parent's
    /// state, the environment, the journal): see [`Delegating`].
    fn detach(&self) {
        *self.live() = Live::default();
        *self.journal.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }

    /// Whether the tasks of this session would nest past [`MAX_DELEGATION_DEPTH`] (each is
    /// refused).
    pub(crate) fn at_depth_limit(&self) -> bool {
        self.depth >= MAX_DELEGATION_DEPTH
    }

    /// What the latest render offers, the parent's state, and the environment children share.
    pub(crate) fn update(
        &self,
        offered: Vec<Subagent>,
        parent: Option<(ThreadState, HookSet)>,
        environment: Environment,
    ) {
        *self.live() = Live {
            offered,
            parent,
            environment,
            attachments: Vec::new(),
        };
    }

    /// The images in front of the delegating session's model after its latest render (call
    /// after [`Delegation::update`]).
    pub(crate) fn show_attachments(&self, attachments: Vec<AttachmentRef>) {
        self.live().attachments = attachments;
    }

    /// Reads the images `wanted` (attachment ids, repeats ignored) from the delegating
    /// conversation's stream `from`, before the task creates anything: an id not in front of
    /// the delegating model, or not in the store, refuses the task.
    async fn images_for_task(
        &self,
        runtime: &RuntimeInner,
        journal: &Journal,
        wanted: &[TaskAttachment],
    ) -> Result<Vec<TaskImage>, String> {
        let from = &journal.key();
        let mut ids: Vec<&str> = Vec::with_capacity(wanted.len());
        for attachment in wanted {
            if !ids.contains(&attachment.id.as_str()) {
                ids.push(&attachment.id);
            }
        }
        let shown: Vec<AttachmentRef> = {
            let live = self.live();
            ids.iter()
                .map(|id| {
                    live.attachments
                        .iter()
                        .find(|shown| shown.id == *id)
                        .cloned()
                        .ok_or_else(|| attachment_not_available(id))
                })
                .collect::<Result<_, _>>()?
        };
        let mut images = Vec::with_capacity(shown.len());
        for attachment in shown {
            let stored = runtime
                .store
                .attachment(from, &attachment.id)
                .await
                .map_err(|error| read_failure(journal, &attachment.id, error))?
                .ok_or_else(|| attachment_not_available(&attachment.id))?;
            images.push(TaskImage {
                media_type: stored.media_type,
                filename: attachment.filename,
                bytes: stored.bytes,
            });
        }
        Ok(images)
    }
}

/// An image a task hands to its child: stored again under the child's stream (an attachment
/// belongs to one conversation).
struct TaskImage {
    media_type: String,
    filename: Option<String>,
    bytes: Vec<u8>,
}

/// A failed read of the attachment `id`: damaged bytes stay damaged (the task fails); any
/// other store failure fails the attempt, which is tried again from what is durable.
fn read_failure(journal: &Journal, id: &str, error: StoreError) -> String {
    match error {
        StoreError::AttachmentIntegrity { detail, .. } => {
            format!("The attachment \"{id}\" is damaged in the store: {detail}")
        }
        error => journal.failed(error),
    }
}

/// Reference §6.2 `attachment_not_available`.
fn attachment_not_available(id: &str) -> String {
    format!("Attachment \"{id}\" is not available in this session.")
}

/// A root session's delegation and its `task` tool, for as long as its response runs.
///
/// The response's thread view offers the tool, and the delegation keeps that view (the parent
/// its children's hooks see) and the attempt (its journal): a cycle. Dropping this detaches the
/// delegation ([`Delegation::detach`]), so the response's attempt, writer, views and tools are
/// freed with it.
pub(crate) struct Delegating {
    pub(crate) delegation: Arc<Delegation>,
    pub(crate) tool: Tool,
}

impl Drop for Delegating {
    fn drop(&mut self) {
        self.delegation.detach();
    }
}

/// The `task` tool delegating with `delegation`.
pub(crate) fn task_tool(delegation: Arc<Delegation>) -> Tool {
    let mut definition = ToolDefinition::from_checked(
        "task",
        TASK_DESCRIPTION,
        SchemaSource::Typed(flue_core::data::tool_input_schema_of::<TaskArgs>),
        None,
        &[],
        false,
    );
    // An interrupted task call runs again and reattaches to its child.
    definition.durable = true;
    Tool::from_handler(TaskTool { definition, delegation })
}

struct TaskTool {
    definition: ToolDefinition,
    delegation: Arc<Delegation>,
}

impl ToolHandler for TaskTool {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    fn call(&self, ctx: ToolContext, args: Value) -> BoxFuture<'_, ToolOutput> {
        let delegation = self.delegation.clone();
        Box::pin(async move {
            let args: TaskArgs = match flue_core::tool::parse_arguments(args) {
                Ok(args) => args,
                Err(invalid) => return invalid,
            };
            run_task(&delegation, args, ctx.tool_call_id()).await
        })
    }
}

/// Counts a running task of one relationship; uncounts it when dropped.
struct Running<'a> {
    delegation: &'a Delegation,
    name: String,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut running = self
            .delegation
            .running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(count) = running.get_mut(&self.name) {
            *count = count.saturating_sub(1);
        }
    }
}

async fn run_task(delegation: &Delegation, args: TaskArgs, tool_call_id: &str) -> ToolOutput {
    if args.prompt.trim().is_empty() {
        return ToolOutput::error(
            "The task's prompt is empty: give the agent a complete briefing (it sees nothing else of this conversation).",
        );
    }
    let Some(runtime) = delegation.runtime.upgrade() else {
        return ToolOutput::error("The runtime was dropped.");
    };
    let Some(journal) = delegation.journal() else {
        return ToolOutput::error("The task has no conversation to record its child in.");
    };
    // The delegating session's events: the root's, or the enclosing task's child session's.
    let emit = |event: Event| match &delegation.scope {
        Some(scope) => runtime.emit_in_task(&delegation.key, &delegation.submission_id, scope, || event),
        None => runtime.emit(&delegation.key, Some(&delegation.submission_id), event),
    };
    let task_start = |task_id: &str| Event::TaskStart {
        task_id: task_id.to_owned(),
        tool_call_id: tool_call_id.to_owned(),
        agent: args.agent.clone(),
        description: args.description.clone(),
        prompt: args.prompt.clone(),
        cwd: args.cwd.clone(),
    };
    // A re-run of an interrupted call reattaches to the child it created. A child that
    // answered is done, whatever the current render offers or allows (completed work is never
    // redone, nor lost).
    let retained = journal.children.get(tool_call_id).cloned();
    let reopened = match &retained {
        Some(child) => match reopen_child(&runtime, &journal, child).await {
            Ok(reopened) => Some(reopened),
            Err(error) => return ToolOutput::error(error),
        },
        None => None,
    };
    if let (Some(child), Some((_, conversation))) = (&retained, &reopened)
        && let Some(answer) = answer_of(conversation).map(answer_text)
    {
        emit(task_start(&child.task_id));
        emit(Event::Task {
            task_id: child.task_id.clone(),
            agent: args.agent.clone(),
            is_error: false,
            result: Some(answer.clone()),
            duration_ms: 0,
        });
        return ToolOutput::text(answer);
    }
    let (found, names, parent, environment) = {
        let live = delegation.live();
        (
            live.offered
                .iter()
                .find(|subagent| subagent.name() == args.agent)
                .cloned(),
            live.offered
                .iter()
                .map(|subagent| subagent.name().to_owned())
                .collect::<Vec<_>>(),
            live.parent.clone(),
            live.environment.clone(),
        )
    };
    let Some(subagent) = found else {
        // A call that created its child, which has not answered, cannot go on with it: its
        // outcome is unknown, and the result names the child (where its work so far is), as
        // an interrupted call's does (reference §3.9), rather than calling an agent it already
        // ran undeclared.
        if let Some(child) = &retained {
            return ToolOutput::error(crate::session::interrupted_task(&child.key));
        }
        return ToolOutput::text(format!(
            "Subagent \"{}\" is not declared. Available subagents: {}.",
            args.agent,
            if names.is_empty() {
                "(none)".to_owned()
            } else {
                names.join(", ")
            }
        ));
    };
    // The depth of the session this task starts from: its delegation's, or deeper when the
    // call comes from within a child session through another delegation (a hook of the child's
    // creation invoking the parent's `task` tool), which would otherwise nest without bound.
    let depth = TASK_DEPTH.try_with(|depth| *depth).unwrap_or(0).max(delegation.depth);
    // A child an earlier run created that cannot go on (a gate below refuses the call now) is
    // not run again: the call's outcome is unknown, and its result names the child, as when
    // its delegate is no longer offered (above).
    let refused = |error: String| match &retained {
        Some(child) => ToolOutput::error(not_reopened(&child.key, &error)),
        None => ToolOutput::error(error),
    };
    if depth >= MAX_DELEGATION_DEPTH {
        return refused(format!("Maximum delegation depth ({MAX_DELEGATION_DEPTH}) exceeded."));
    }
    let _running = {
        let mut running = delegation
            .running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let count = running.entry(subagent.name().to_owned()).or_default();
        if let Some(limit) = subagent.max_instances_limit()
            && *count >= limit
        {
            return refused(format!(
                "Subagent instance limit reached: at most {limit} \"{}\" task(s) may run at once.",
                subagent.name()
            ));
        }
        *count += 1;
        Running {
            delegation,
            name: subagent.name().to_owned(),
        }
    };
    let environment = match &args.cwd {
        Some(cwd) => match environment.scoped(cwd) {
            Ok(scoped) => scoped,
            Err(error) => return refused(error),
        },
        None => environment,
    };
    // Read once the task may run (a child an earlier run created has its images already).
    let images = match &args.attachments {
        Some(wanted) if retained.is_none() && !wanted.is_empty() => {
            match delegation.images_for_task(&runtime, &journal, wanted).await {
                Ok(images) => images,
                Err(error) => return ToolOutput::error(error),
            }
        }
        _ => Vec::new(),
    };
    let task_id = retained
        .as_ref()
        .map_or_else(|| new_id("task"), |child| child.task_id.clone());
    emit(task_start(&task_id));
    let started = Instant::now();
    let mut cancelled = TaskEndOnDrop {
        emit: &emit,
        task_id: task_id.clone(),
        agent: subagent.name().to_owned(),
        started,
        armed: true,
    };
    let task = Task {
        id: &task_id,
        args: &args,
        tool_call_id,
        reopened,
        images,
    };
    let result = TASK_DEPTH
        .scope(
            depth + 1,
            child_session(&runtime, delegation, &subagent, parent, environment, &journal, task),
        )
        .await
        .map(answer_text);
    cancelled.armed = false;
    emit(Event::Task {
        task_id,
        agent: subagent.name().to_owned(),
        is_error: result.is_err(),
        result: Some(match &result {
            Ok(text) | Err(text) => text.clone(),
        }),
        duration_ms: started.elapsed().as_millis() as u64,
    });
    match result {
        Ok(text) => ToolOutput::text(text),
        Err(error) => ToolOutput::error(error),
    }
}

/// The result of a call whose child (`child`, created by an earlier run, not answered) cannot
/// be reopened now, for the reason `error` (logged): the call's outcome is unknown, and the
/// result names the child, where its work so far is (reference §3.9), rather than telling the
/// model the delegate never started (it would call it again, repeating what the child did).
fn not_reopened(child: &InstanceKey, error: &str) -> String {
    tracing::warn!(child = %child, %error, "a task's child cannot be reopened: the call's outcome is unknown");
    crate::session::interrupted_task(child)
}

/// One task to run: its id, arguments and call, and the child an earlier run created (its key
/// and conversation, reopened).
struct Task<'a> {
    id: &'a str,
    args: &'a TaskArgs,
    tool_call_id: &'a str,
    reopened: Option<(InstanceKey, Conversation)>,
    /// The images the call hands on (none for a reopened child: it has them).
    images: Vec<TaskImage>,
}

/// A parent's thread state whose tool calls count at a child session's `depth`, wherever they
/// are made: a `task` call from a hook of the child's creation is held to the delegation
/// depth even from a task the hook spawned.
struct AtDepth {
    inner: Arc<dyn ThreadStateApi>,
    depth: u32,
}

impl ThreadStateApi for AtDepth {
    fn identity(&self) -> &ThreadIdentity {
        self.inner.identity()
    }
    fn execution(&self) -> Option<ExecutionState> {
        self.inner.execution()
    }
    fn context(&self) -> ThreadContext {
        self.inner.context()
    }
    fn get_messages(&self, query: MessagesQuery) -> BoxFuture<'_, Result<MessagePage, ThreadError>> {
        self.inner.get_messages(query)
    }
    fn get_message<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Message>, ThreadError>> {
        self.inner.get_message(id)
    }
    fn inject_message(&self, input: InjectMessage) -> BoxFuture<'_, Result<Message, ThreadError>> {
        self.inner.inject_message(input)
    }
    fn update_message<'a>(
        &'a self,
        id: &'a str,
        updates: MessageUpdates,
    ) -> BoxFuture<'a, Result<Message, ThreadError>> {
        self.inner.update_message(id, updates)
    }
    fn delete_message<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, ThreadError>> {
        self.inner.delete_message(id)
    }
    fn queue_message(&self, content: String) -> BoxFuture<'_, Result<(), ThreadError>> {
        self.inner.queue_message(content)
    }
    fn invoke_tool<'a>(&'a self, name: &'a str, args: Value) -> BoxFuture<'a, Result<ToolResult, ThreadError>> {
        Box::pin(TASK_DEPTH.scope(self.depth, self.inner.invoke_tool(name, args)))
    }
    fn queue_tool(&self, tool: flue_core::Tool, args: Value) -> Result<(), ThreadError> {
        self.inner.queue_tool(tool, args)
    }
    fn env(&self, name: &str) -> Result<flue_core::tool::Secret, ThreadError> {
        self.inner.env(name)
    }
    fn declared_secrets(&self) -> Vec<&'static str> {
        self.inner.declared_secrets()
    }
    fn emit(&self, event: &str, data: Value) {
        self.inner.emit(event, data);
    }
    fn get_value<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Value>, ThreadError>> {
        self.inner.get_value(key)
    }
    fn set_value<'a>(&'a self, key: &'a str, value: Option<Value>) -> BoxFuture<'a, Result<(), ThreadError>> {
        self.inner.set_value(key, value)
    }
}

/// The `ThreadState` of a child session (its identity: hooks see the task, not its stream).
struct ChildThread(ThreadIdentity);

impl ThreadStateApi for ChildThread {
    fn identity(&self) -> &ThreadIdentity {
        &self.0
    }
}

/// Reopens the child conversation an earlier run of the call created (folded from its
/// stream).
async fn reopen_child(
    runtime: &RuntimeInner,
    journal: &Journal,
    retained: &RetainedChild,
) -> Result<(InstanceKey, Conversation), String> {
    let mut conversation = Conversation::default();
    let batches = runtime
        .store
        .read(&retained.key, None)
        .await
        .map_err(|error| journal.failed(error))?;
    for batch in &batches {
        conversation.apply(batch);
    }
    if conversation.model_messages().is_empty() {
        return Err(format!("The task's conversation {} was not found.", retained.key));
    }
    Ok((retained.key.clone(), conversation))
}

/// What a child conversation answered, once its run is over: its final answer, or the answer
/// of a tool batch that ended the run. `None` while the run goes on.
fn answer_of(conversation: &Conversation) -> Option<String> {
    conversation
        .final_answer()
        .map(str::to_owned)
        .or_else(|| conversation.terminated_answer())
}

/// Creates the task's child conversation with its link (its first message is the prompt).
async fn create_child(
    runtime: &RuntimeInner,
    journal: &Journal,
    subagent: &Subagent,
    task: &Task<'_>,
) -> Result<(InstanceKey, Conversation), String> {
    let mut conversation = Conversation::default();
    let parent = journal.key();
    let key = child_key(&parent, task.id);
    // The images first: the prompt's record names them. Their ids derive from the task, so a
    // put that is tried again is an exact retry.
    let mut attachments = Vec::with_capacity(task.images.len());
    for (index, image) in task.images.iter().enumerate() {
        let put = AttachmentPut::new(
            format!("att_{}_{index}", task.id),
            image.media_type.clone(),
            image.bytes.clone(),
        );
        let reference = AttachmentRef {
            id: put.id.clone(),
            media_type: put.media_type.clone(),
            size: put.size,
            filename: image.filename.clone(),
        };
        runtime
            .store
            .put_attachment(&key, put)
            .await
            .map_err(|error| journal.failed(error))?;
        conversation.keep_image(
            reference.id.clone(),
            ModelImage::from_bytes(&image.media_type, &image.bytes),
        );
        attachments.push(reference);
    }
    let birth: Arc<[Record]> = vec![
        journal.child_record(RecordBody::ConversationCreated {
            uid: new_id("inst"),
            initial_data: None,
            kind: Some(ConversationKind::Task),
            parent: Some(parent),
            task_id: Some(task.id.to_owned()),
            agent: Some(subagent.name().to_owned()),
        }),
        journal.child_record(RecordBody::UserMessage {
            message_id: new_id("msg"),
            body: task.args.prompt.clone(),
            attachments,
        }),
    ]
    .into();
    let link = RecordBody::ChildSessionRetained {
        task_id: task.id.to_owned(),
        kind: ConversationKind::Task,
        child: key.clone(),
        parent_tool_call_id: task.tool_call_id.to_owned(),
    };
    journal.create_child(runtime, link, &key, birth.clone()).await?;
    conversation.apply(&Batch {
        offset: 0,
        records: birth,
    });
    Ok((key, conversation))
}

/// Fails closed when the delegate's render offers a delegate of its own (enabled) whose agent
/// requires hooks of its parent: the delegate's session runs no lifecycle hooks, and a parent
/// never runs with part of its required set (reference §4.3), so the task is refused rather
/// than run without them.
fn refuse_required_hooks(subagent: &Subagent, rendered: &Rendered) -> Result<(), String> {
    let requiring = rendered.subagents.iter().find(|nested| {
        nested.is_enabled(|name| std::env::var(name).ok()) && !nested.agent().get().definition().parent_hooks.is_empty()
    });
    let Some(nested) = requiring else { return Ok(()) };
    let hooks: Vec<&str> = nested
        .agent()
        .get()
        .definition()
        .parent_hooks
        .iter()
        .map(|requirement| requirement.hook.id())
        .collect();
    Err(format!(
        "The \"{}\" agent cannot run as a task: it delegates to \"{}\", whose agent requires hooks of its parent ({}), and a task's session runs no lifecycle hooks.",
        subagent.name(),
        nested.name(),
        hooks.join(", ")
    ))
}

/// Loads the images of a reopened child's conversation from its stream's attachments.
async fn load_images(
    runtime: &RuntimeInner,
    journal: &Journal,
    child: &InstanceKey,
    conversation: &mut Conversation,
) -> Result<(), String> {
    // The prompt's too, which a compaction may have summarized away with its message: the
    // delegate is delivered them all the same.
    let mut missing = conversation.missing_images();
    for attachment in conversation.missing_prompt_images() {
        if !missing.iter().any(|listed| listed.id == attachment.id) {
            missing.push(attachment);
        }
    }
    for attachment in missing {
        let stored = runtime
            .store
            .attachment(child, &attachment.id)
            .await
            .map_err(|error| read_failure(journal, &attachment.id, error))?
            .ok_or_else(|| format!("The task's image \"{}\" is not in the store.", attachment.id))?;
        conversation.keep_image(attachment.id, ModelImage::from_bytes(&stored.media_type, &stored.bytes));
    }
    Ok(())
}

/// Runs one task to its final answer, recording the child's conversation as it goes (or
/// going on from what an earlier run recorded).
async fn child_session(
    runtime: &Arc<RuntimeInner>,
    delegation: &Delegation,
    subagent: &Subagent,
    parent: Option<(ThreadState, HookSet)>,
    environment: Environment,
    journal: &Journal,
    mut task: Task<'_>,
) -> Result<String, String> {
    let args = task.args;
    let mut reopened = task.reopened.take();
    // A child an earlier run created whose delegate does not start now (its render fails, its
    // model does not resolve, a tool clashes) is not run: the call's outcome is unknown, and
    // its result names the child.
    let retained = reopened.as_ref().map(|(child, _)| child.clone());
    let not_started = |error: String| match &retained {
        Some(child) => not_reopened(child, &error),
        None => error,
    };
    // A reattached child's images are loaded before its render, which sees them as its first
    // run's did. One missing or damaged in the store leaves the child where it was: the
    // call's outcome is unknown, as when its delegate does not start.
    if let Some((child, conversation)) = &mut reopened {
        load_images(runtime, journal, child, conversation)
            .await
            .map_err(|error| match journal.check_live().is_err() {
                // The store failed: the attempt is made again, and nothing is settled.
                true => error,
                false => not_reopened(child, &error),
            })?;
    }
    // The delegate's render sees the prompt as its delivered message, with the images.
    let attachments = match &reopened {
        Some((_, conversation)) => conversation.prompt_attachments(),
        None => task
            .images
            .iter()
            .map(|image| Attachment::Image {
                data: base64::engine::general_purpose::STANDARD.encode(&image.bytes),
                mime_type: image.media_type.clone(),
                filename: image.filename.clone(),
            })
            .collect(),
    };
    let delivery = Arc::new(DeliveredMessage::User(UserMessage {
        body: args.prompt.clone(),
        attachments,
    }));
    // A delegate's session runs no lifecycle hooks: its render cannot select any, and
    // `use_subagent` refuses an agent whose definition does.
    let agent = subagent.agent().get();
    let mut rendered = Rendered::default();
    let state = RenderState::subagent(&delivery);
    if let Err(error) = flue_core::try_render_into(agent, &state, &mut rendered) {
        if let flue_core::RenderError::Panicked {
            location: Some(location),
            ..
        } = &error
        {
            tracing::warn!(delegate = subagent.name(), %location, "a delegate's render broke a rule of hooks: {error}");
        }
        return Err(not_started(format!(
            "The \"{}\" agent could not render: {error}",
            subagent.name()
        )));
    }
    let model = subagent.model_override().unwrap_or(&delegation.model).to_owned();
    let thinking = subagent.thinking_level_override().unwrap_or(delegation.thinking);
    let (provider, model_id) = runtime
        .providers
        .resolve(&model)
        .map_err(|error| not_started(format!("The \"{}\" agent's model: {error}", subagent.name())))?;

    // Refused before the child exists (no child is left behind).
    refuse_required_hooks(subagent, &rendered).map_err(&not_started)?;
    if let Some(taken) = rendered
        .tools
        .iter()
        .find(|own| environment.tools.iter().any(|tool| tool.name() == own.name()))
    {
        return Err(not_started(format!(
            "The \"{}\" agent's tool \"{}\" clashes with a sandbox tool.",
            subagent.name(),
            taken.name()
        )));
    }
    // The workspace skills of the delegate's own working directory (a task's `cwd` moves it),
    // found when its session starts, after its declared ones.
    let workspace = match &environment.session {
        Some(session) => {
            let workspace = Arc::new(crate::skills::Workspace::discover(session).await);
            workspace.mount(&mut rendered).map_err(|message| {
                not_started(format!("The \"{}\" agent could not start: {message}", subagent.name()))
            })?;
            Some(workspace)
        }
        None => None,
    };
    let created = reopened.is_none();
    let (child, mut conversation) = match reopened {
        Some(reopened) => reopened,
        None => create_child(runtime, journal, subagent, &task).await?,
    };
    // Stored and kept by the conversation now: the call's own copies go.
    drop(std::mem::take(&mut task.images));

    // Before the child's first model call, once per child: a marker in the child's stream
    // records that it ran, so a re-run that reattaches does not run it again (a crash between
    // the hook and its marker runs it again: callbacks are at least once).
    if conversation.model_steps() == 0
        && !conversation.thread_created_hooks_ran
        && let Some((parent, hooks)) = &parent
        && hooks.has(flue_core::lifecycle::HookKind::AfterSubagentCreated)
    {
        let mut arguments = Map::new();
        arguments.insert("prompt".into(), json!(args.prompt));
        if let Some(description) = &args.description {
            arguments.insert("description".into(), json!(description));
        }
        let child_state = ThreadState::new(Arc::new(ChildThread(ThreadIdentity {
            thread_id: task.id.to_owned(),
            agent_id: subagent.name().to_owned(),
            user_id: parent.user_id().map(str::to_owned),
            created_at: conversation.identity(&child).created_at,
            arguments,
        })));
        // The parent as the hook sees it: its tool calls count at this session's depth
        // wherever the hook makes them (from a task it spawned too, which the depth's
        // task-local does not reach).
        let parent = ThreadState::new(Arc::new(AtDepth {
            inner: parent.api().clone(),
            depth: TASK_DEPTH.try_with(|depth| *depth).unwrap_or(0),
        }));
        chain::after_subagent_created(hooks, &parent, &child_state).await;
        let marker = journal.child_record(RecordBody::ThreadCreatedHooksRan);
        journal
            .append_child(runtime, &child, vec![marker], &mut conversation)
            .await?;
    }

    // The parent's environment, then the child's own skills and delegates (one level deeper).
    rendered.tools.extend(environment.tools.iter().cloned());
    let scope = Arc::new(TaskScope::new(task.id));
    let nested = Arc::new(delegation.nested(model.clone(), thinking, scope.clone()));
    let nested_tool = task_tool(nested.clone());
    let mut sections = crate::framework::Sections::default();
    crate::framework::mount(
        &mut rendered,
        Some((&nested, &nested_tool)),
        None,
        environment,
        workspace.as_ref(),
        &mut sections,
    );
    // The child's images (its prompt's) are the ones its own tasks may hand on.
    nested.show_attachments(conversation.visible_attachments());
    let system = crate::framework::system(rendered.instruction.as_deref(), sections.text());
    let system_len = system.as_deref().map_or(0, str::len);
    let mut budget = Budget::new(delegation.compaction.clone());
    let tools = std::mem::take(&mut rendered.tools);
    let specs: Vec<ToolSpec> = tools.iter().map(ToolSpec::from).collect();
    let max_steps = agent.definition().max_steps.unwrap_or(u32::MAX);
    let events = ChildEvents {
        runtime,
        root: &delegation.key,
        submission_id: &delegation.submission_id,
        scope,
        ended: Mutex::default(),
    };
    // The child's session begins as the root's does: its own operation (its prompt, as the
    // reference's child `prompt()` is one), `agent_start`, then its input (the prompt) the
    // first time it runs. Its `agent_end`, `operation` and `idle` come however it ends, also
    // when an abort drops this future mid-way (the guard, dropped last).
    events.emit(|| Event::OperationStart {
        operation_id: events.scope.operation_id().to_owned(),
        operation_kind: OperationKind::Prompt,
    });
    events.emit(|| Event::AgentStart);
    let mut operation = OperationEndOnDrop {
        events: &events,
        started: Instant::now(),
        ended: None,
    };
    if created && runtime.observed() {
        let prompt = ModelMessage::user(args.prompt.clone());
        events.emit(|| Event::MessageStart {
            message: prompt.clone(),
        });
        events.message_end(prompt);
    }
    let session = ChildSession {
        runtime,
        journal,
        key: &child,
        root: &delegation.key,
        signal: &delegation.signal,
        tools: &tools,
        nested: &nested,
        events: &events,
    };
    let mut usage = Usage::default();
    let result = async {
        loop {
            // An attempt one of whose appends failed (another task's child's, say) is lost: its
            // children make no more model calls or tool calls, whose results nothing records.
            journal.check_live()?;
            // A batch an earlier run left uncommitted: its calls without a recorded outcome run
            // again when durable (nested tasks included), the others get the outcome-unknown
            // result.
            if let Some((step, _)) = conversation.open_calls() {
                let (step, calls) = (step.to_owned(), conversation.unresolved_calls());
                let (rerun, unknown): (Vec<ModelToolCall>, Vec<ModelToolCall>) = calls.into_iter().partition(|call| {
                    tools
                        .iter()
                        .any(|tool| tool.name() == call.name && tool.definition().durable)
                });
                session.batch(&mut conversation, &rerun, step, &unknown, None).await?;
                continue;
            }
            // Completed work is never redone: a child that answered is done, and so is one whose
            // last tool batch ended its run (every tool of it asked to terminate).
            if let Some(answer) = answer_of(&conversation) {
                return Ok(answer);
            }
            if conversation.model_steps() >= max_steps {
                // The step budget ran out: what the child last said is its answer.
                return Ok(conversation.last_model_text().to_owned());
            }
            // The child's turn, reported as the turn loop reports the root's (its events carry
            // the task's id and this turn's), after a compaction if the call would not fit.
            let step = conversation.model_steps() + 1;
            crate::compaction::compact_if_needed(
                &mut session.compacting(&mut conversation, &mut budget),
                &*provider,
                &model_id,
                thinking,
                system_len,
                step,
            )
            .await
            .map_err(|error| error.message)?;
            let mut compacted_for_overflow = false;
            // Transient failures retried so far, sharing one budget with the provider's own.
            let mut retries = 0;
            let (response, turn_id) = loop {
                // A reopened child's steps may be another model's (a deploy changed the
                // delegate's): their signed reasoning goes to the model that made it only.
                conversation.fit_reasoning_to(&model);
                let request = ModelRequest {
                    model: model_id.clone(),
                    system: system.clone(),
                    messages: conversation.model_messages(),
                    tools: specs.clone(),
                    thinking_level: thinking,
                    max_output_tokens: None,
                    max_retries: Some(runtime.options.model_retries.saturating_sub(retries)),
                };
                // One id per model call (a retry after a transient failure, or after an
                // overflow recovery, is a call and a turn of its own, as at the root).
                let turn_id = LazyId::new("turn");
                events.scope.set_turn(Some(&turn_id));
                events.emit(|| Event::TurnStart {
                    turn_id: turn_id.get(),
                    purpose: TurnPurpose::Agent,
                    step,
                });
                events.emit(|| Event::TurnRequest {
                    turn_id: turn_id.get(),
                    purpose: TurnPurpose::Agent,
                    request: crate::session::turn_request(&*provider, &model_id, thinking),
                });
                events.emit(|| Event::MessageStart {
                    message: ModelMessage::empty_assistant(),
                });
                let started = Instant::now();
                let mut call_ids = CallIds::default();
                let mut deltas = ChildDeltas::new(&events, &conversation, &mut call_ids);
                let called = crate::provider::call_observed(&*provider, &request, &delegation.signal, |streamed| {
                    deltas.on(streamed)
                })
                .await;
                deltas.end();
                let turn = |finish_reason: String, response: TurnResponse, is_error: bool| Event::Turn {
                    turn_id: turn_id.get(),
                    purpose: TurnPurpose::Agent,
                    step,
                    duration_ms: started.elapsed().as_millis() as u64,
                    request: crate::session::turn_request(&*provider, &model_id, thinking),
                    response: TurnResponse {
                        finish_reason,
                        ..response
                    },
                    is_error,
                };
                let error = match called {
                    Ok(mut response) => {
                        call_ids.rename(&conversation, &mut response.tool_calls, &mut response.reasoning_blocks);
                        events.emit(|| {
                            turn(
                                response.stop_reason.to_string(),
                                TurnResponse {
                                    text: response.text.clone(),
                                    tool_calls: response.tool_calls.clone(),
                                    usage: Some(response.usage),
                                    ..TurnResponse::default()
                                },
                                false,
                            )
                        });
                        break (response, turn_id);
                    }
                    Err(error) => error,
                };
                // A failed call still ends its turn and its assistant message, before any
                // recovery.
                let aborted = delegation.signal.is_aborted();
                // As the root's turn reports it: the provider's error kind.
                let described = match &error {
                    crate::provider::CallError::Failed(failed) if !aborted => {
                        SettlementError::new(failed.error_type(), failed.message.clone())
                    }
                    _ => SettlementError::new("aborted", "The call was aborted."),
                };
                events.emit(|| {
                    turn(
                        (if aborted { "aborted" } else { "error" }).to_owned(),
                        TurnResponse {
                            error: Some(described),
                            ..TurnResponse::default()
                        },
                        true,
                    )
                });
                events.emit(|| Event::MessageEnd {
                    message: ModelMessage::empty_assistant(),
                });
                events.scope.set_turn(None);
                if let crate::provider::CallError::Failed(failed) = &error
                    && !aborted
                    && failed.may_retry(retries, runtime.options.model_retries)
                {
                    // A transient failure: the call is made again after its backoff.
                    let delay;
                    (retries, delay) = runtime.options.model_retry(retries, failed);
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {
                            // Nor does a retry when the attempt was lost meanwhile.
                            journal.check_live()?;
                            continue;
                        }
                        () = delegation.signal.aborted() => {
                            return Err(crate::provider::CallError::Aborted.to_string());
                        }
                    }
                }
                // Overflow recovery, as at the root: compact and make the call again once, also
                // with threshold compaction off; an overflow that persists fails the task.
                if error.is_context_overflow()
                    && !compacted_for_overflow
                    && crate::compaction::compact(
                        &mut session.compacting(&mut conversation, &mut budget),
                        crate::compaction::Reason::Overflow,
                        &*provider,
                        &model_id,
                        thinking,
                        step,
                    )
                    .await
                    .map_err(|error| error.message)?
                {
                    compacted_for_overflow = true;
                    continue;
                }
                return Err(error.to_string());
            };
            budget.called(&response.usage, conversation.messages.len());
            usage += response.usage;
            let message_id = new_id("msg");
            let records: Vec<Record> = crate::record::model_step_bodies(&message_id, &model, None, &response)
                .map(|body| journal.child_record(body))
                .collect();
            if let Err(error) = journal.append_child(runtime, &child, records, &mut conversation).await {
                // The step's message ends with it (observers saw it start).
                events.emit(|| Event::MessageEnd {
                    message: ModelMessage::empty_assistant(),
                });
                return Err(error);
            }
            if runtime.observed() {
                events.message_end(ModelMessage::Assistant {
                    text: response.text.clone(),
                    tool_calls: response.tool_calls.clone(),
                    reasoning: Vec::new(),
                });
            }
            if response.tool_calls.is_empty() {
                events.emit(|| Event::agent_turn_messages(&turn_id, response.text.clone(), Vec::new(), Vec::new()));
            } else {
                session
                    .batch(
                        &mut conversation,
                        &response.tool_calls,
                        message_id,
                        &[],
                        Some((&turn_id, &response.text)),
                    )
                    .await?;
            }
            events.scope.set_turn(None);
        }
    }
    .await;
    events.scope.set_turn(None);
    operation.ended = Some(match &result {
        Ok(answer) => Ok((json!({"text": answer, "usage": usage, "model": model}), usage)),
        Err(message) if delegation.signal.is_aborted() => Err(SettlementError::new("aborted", message.clone())),
        Err(message) => Err(SettlementError::new("task_failed", message.clone())),
    });
    result
}

/// Ends a child session's operation when dropped: its `agent_end` (with the messages it
/// ended), its `operation` (with what it returned, or why it failed: an abort when dropped
/// before it ended) and its `idle`.
struct OperationEndOnDrop<'e, 'a> {
    events: &'e ChildEvents<'a>,
    started: Instant,
    /// What the operation returned and the usage of its model calls, or why it failed.
    ended: Option<Result<(Value, Usage), SettlementError>>,
}

impl Drop for OperationEndOnDrop<'_, '_> {
    fn drop(&mut self) {
        let events = self.events;
        // Dropped mid-turn (an abort): the session's end belongs to no turn.
        events.scope.set_turn(None);
        let messages = std::mem::take(&mut *events.ended.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        events.emit(|| Event::AgentEnd { messages });
        let ended = self
            .ended
            .take()
            .unwrap_or_else(|| Err(SettlementError::new("aborted", "The task was aborted.")));
        events.emit(|| {
            let (result, usage, error) = match ended {
                Ok((result, usage)) => (Some(result), Some(usage), None),
                Err(error) => (None, None, Some(error)),
            };
            Event::Operation {
                operation_id: events.scope.operation_id().to_owned(),
                operation_kind: OperationKind::Prompt,
                duration_ms: self.started.elapsed().as_millis() as u64,
                is_error: error.is_some(),
                error,
                usage,
                result,
            }
        });
        events.emit(|| Event::Idle);
    }
}

/// Emits a task's `task` event as failed when dropped armed: the call's future was dropped
/// (an abort cancels the running tools) before the task ended, and observers still see the
/// `task_start` closed, as the reference's `catch` closes it.
struct TaskEndOnDrop<F: Fn(Event)> {
    emit: F,
    task_id: String,
    agent: String,
    started: Instant,
    armed: bool,
}

impl<F: Fn(Event)> Drop for TaskEndOnDrop<F> {
    fn drop(&mut self) {
        if self.armed {
            (self.emit)(Event::Task {
                task_id: std::mem::take(&mut self.task_id),
                agent: std::mem::take(&mut self.agent),
                is_error: true,
                result: Some("The task was cancelled before it finished.".to_owned()),
                duration_ms: self.started.elapsed().as_millis() as u64,
            });
        }
    }
}

/// Publishes a child session's events: each stamped with the task's id, the child's own
/// operation and its turn in progress.
struct ChildEvents<'a> {
    runtime: &'a Arc<RuntimeInner>,
    /// The root instance the task runs for.
    root: &'a InstanceKey,
    submission_id: &'a str,
    scope: Arc<TaskScope>,
    /// The messages of the `message_end` events someone observed (the child's `agent_end`
    /// carries them), tool results as stored.
    ended: Mutex<Vec<ModelMessage>>,
}

impl ChildEvents<'_> {
    fn emit(&self, event: impl FnOnce() -> Event) {
        self.runtime
            .emit_in_task(self.root, self.submission_id, &self.scope, event);
    }

    /// A `message_end`, whose message the child's `agent_end` carries too.
    fn message_end(&self, message: ModelMessage) {
        self.ended
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(message.clone());
        self.emit(|| Event::MessageEnd { message });
    }

    /// Messages that ended outside a `message_end` of their own (a batch's stored results).
    fn ended(&self, messages: &[ModelMessage]) {
        self.ended
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend(messages.iter().cloned());
    }
}

/// The outcome record of a child's executed call of the step `assistant_message_id`.
fn outcome_of(assistant_message_id: &str, run: &crate::tools::Executed) -> RecordBody {
    RecordBody::ToolOutcome {
        output: run.structured_output(),
        assistant_message_id: assistant_message_id.to_owned(),
        tool_call_id: run.call.id.clone(),
        tool_name: run.call.name.clone(),
        is_error: run.output.is_error,
        content: run.output.to_text(),
        terminate: run.output.terminate,
        duration_ms: run.duration_ms,
    }
}

/// What a child's model call streams, as the turn loop publishes the root's: text and
/// thinking deltas (a `thinking_start` before the first reasoning, a `thinking_end` when
/// anything else follows) and tool-call argument fragments. A retry is a call (and a turn) of
/// its own, with its own deltas.
struct ChildDeltas<'e, 'a> {
    events: &'e ChildEvents<'a>,
    thinking: bool,
    /// The reasoning since the open `thinking_start`.
    thought: String,
    /// The calls' ids and tool names by index, as their starts named them (a provider that
    /// numbers its calls sparsely, or absurdly, costs an entry per call, never one per number).
    ids: std::collections::HashMap<usize, (String, String)>,
    /// The child's conversation, and the ids its calls go by (see [`CallIds`]).
    conversation: &'e Conversation,
    call_ids: &'e mut CallIds,
}

impl<'e, 'a> ChildDeltas<'e, 'a> {
    fn new(events: &'e ChildEvents<'a>, conversation: &'e Conversation, call_ids: &'e mut CallIds) -> Self {
        Self {
            events,
            thinking: false,
            thought: String::new(),
            ids: std::collections::HashMap::new(),
            conversation,
            call_ids,
        }
    }

    fn on(&mut self, streamed: StreamEvent) {
        if self.thinking && !matches!(streamed, StreamEvent::ReasoningDelta(_)) {
            self.end();
        }
        match streamed {
            StreamEvent::TextDelta(delta) => {
                self.events.emit(|| Event::TextDelta { text: delta });
            }
            StreamEvent::ReasoningDelta(delta) => {
                if !self.thinking {
                    self.thinking = true;
                    self.events.emit(|| Event::ThinkingStart);
                }
                self.thought.push_str(&delta);
                self.events.emit(|| Event::ThinkingDelta { delta });
            }
            StreamEvent::ToolCallStarted { index, id, name } => {
                let id = self.call_ids.own(self.conversation, index, id);
                self.ids.insert(index, (id, name));
            }
            StreamEvent::ToolCallArguments { index, delta } => {
                let (tool_call_id, tool_name) = self.ids.get(&index).cloned().unwrap_or_default();
                self.events.emit(|| Event::ToolcallDelta {
                    index,
                    tool_call_id,
                    tool_name,
                    argument_text_delta: delta,
                });
            }
            StreamEvent::Completed(_) => {}
        }
    }

    /// Ends an open `thinking_start` (the call ended, however it ended).
    fn end(&mut self) {
        if std::mem::take(&mut self.thinking) {
            let content = std::mem::take(&mut self.thought);
            self.events.emit(|| Event::ThinkingEnd { content });
        }
    }
}

/// What a child's tool batches run with.
struct ChildSession<'a> {
    runtime: &'a Arc<RuntimeInner>,
    journal: &'a Journal,
    /// The child's stream.
    key: &'a InstanceKey,
    /// The root instance (what the child's tools see as their instance).
    root: &'a InstanceKey,
    signal: &'a AbortSignal,
    tools: &'a [Tool],
    /// The child's own delegation (its `task` tool).
    nested: &'a Arc<Delegation>,
    events: &'a ChildEvents<'a>,
}

impl ChildSession<'_> {
    /// Runs `calls` of the step `assistant_message_id` and commits the batch (with the
    /// outcome-unknown result for each of `unknown`) to the child's stream.
    async fn batch(
        &self,
        conversation: &mut Conversation,
        calls: &[ModelToolCall],
        assistant_message_id: String,
        unknown: &[ModelToolCall],
        turn: Option<(&LazyId, &str)>,
    ) -> Result<(), String> {
        // The child's own tasks record their children in the child's stream.
        self.nested.attach(Journal {
            attempt: self.journal.attempt.clone(),
            stream: Stream::Child(self.key.clone()),
            children: conversation.retained_children(),
        });
        let log = crate::session::EventLogBase::new(
            self.runtime,
            self.root,
            self.events.submission_id,
            Some(self.events.scope.clone()),
        );
        let executed = {
            let (conversation, step) = (&*conversation, assistant_message_id.as_str());
            crate::tools::run_batch(
                self.tools,
                calls,
                self.runtime.options.tool_concurrency,
                self.signal,
                |tool, call| {
                    let ctx = ToolContext::new(tool, call.id.clone())
                        .with_instance_id(self.root.id.to_string())
                        .with_signal(self.signal.clone())
                        .with_logger(crate::session::tool_call_logger(&log, &call.name, &call.id));
                    if !tool.definition().durable {
                        return ctx;
                    }
                    ctx.with_steps(Arc::new(ChildSteps {
                        runtime: self.runtime.clone(),
                        journal: self.journal.clone(),
                        key: self.key.clone(),
                        tool_call_id: call.id.clone(),
                        tool_name: call.name.clone(),
                        recorded: conversation.tool_steps(&call.id),
                    }))
                },
                |call| {
                    self.events.emit(|| Event::ToolStart {
                        tool_name: call.name.clone(),
                        tool_call_id: call.id.clone(),
                    });
                },
                |run: &crate::tools::Executed| {
                    // The tool-result message, when the tool is done (as the root's; none for a
                    // call the abort ended, whose result is never stored).
                    if !run.interrupted && self.runtime.observed() {
                        let message = ModelMessage::Tool {
                            tool_call_id: run.call.id.clone(),
                            name: run.call.name.clone(),
                            content: run.output.to_text(),
                            is_error: run.output.is_error,
                        };
                        self.events.emit(|| Event::MessageStart {
                            message: message.clone(),
                        });
                        self.events.emit(|| Event::MessageEnd { message });
                    }
                },
                |run: crate::tools::Executed, last| async move {
                    // The outcome is durable as the tool ends, as the root's (the batch's last
                    // goes with the commit; a call the abort stopped has none).
                    if last || run.interrupted {
                        return (run, None);
                    }
                    let outcome = self.journal.child_record(outcome_of(step, &run));
                    let appended = self
                        .journal
                        .append_to_child(self.runtime, self.key, vec![outcome])
                        .await;
                    (run, Some(appended))
                },
            )
            .await
        };
        // The outcomes appended as their tools ended, folded in the stream's order.
        let mut appended = Vec::new();
        let executed: Vec<crate::tools::Executed> = executed
            .into_iter()
            .map(|(run, batch)| {
                appended.extend(batch);
                run
            })
            .collect();
        let mut batches = appended.into_iter().collect::<Result<Vec<Batch>, String>>()?;
        batches.sort_unstable_by_key(|batch| batch.offset);
        let recorded: Vec<String> = batches
            .iter()
            .flat_map(|batch| batch.records.iter())
            .filter_map(|record| match &record.body {
                RecordBody::ToolOutcome { tool_call_id, .. } => Some(tool_call_id.clone()),
                _ => None,
            })
            .collect();
        for batch in &batches {
            conversation.apply(batch);
        }
        if self.signal.is_aborted() {
            // The calls that ended before the abort keep their outcomes (the batch's last
            // one's was to go with the commit).
            let ended: Vec<Record> = executed
                .iter()
                .filter(|run| !run.interrupted && !recorded.contains(&run.call.id))
                .map(|run| self.journal.child_record(outcome_of(&assistant_message_id, run)))
                .collect();
            if !ended.is_empty() {
                self.journal
                    .append_child(self.runtime, self.key, ended, conversation)
                    .await?;
            }
            return Err("The task was aborted.".into());
        }
        // Published once the batch committed, as the root's are.
        let mut finished: Vec<(Event, ModelMessage)> = Vec::new();
        let observed = self.runtime.observed();
        let mut records = Vec::with_capacity(executed.len() + unknown.len() + 1);
        for run in executed {
            if observed {
                finished.push((
                    Event::Tool {
                        tool_name: run.call.name.clone(),
                        tool_call_id: run.call.id.clone(),
                        is_error: run.output.is_error,
                        result: Some(run.output.to_text()),
                        duration_ms: run.duration_ms,
                    },
                    ModelMessage::Tool {
                        tool_call_id: run.call.id.clone(),
                        name: run.call.name.clone(),
                        content: run.output.to_text(),
                        is_error: run.output.is_error,
                    },
                ));
            }
            if !recorded.contains(&run.call.id) {
                records.push(self.journal.child_record(outcome_of(&assistant_message_id, &run)));
            }
        }
        for call in unknown {
            records.push(self.journal.child_record(RecordBody::ToolOutcome {
                output: None,
                assistant_message_id: assistant_message_id.clone(),
                tool_call_id: call.id.clone(),
                tool_name: call.name.clone(),
                is_error: true,
                content: conversation.interrupted(&call.id),
                terminate: false,
                duration_ms: 0,
            }));
        }
        records.push(
            self.journal
                .child_record(RecordBody::ToolResultsCommitted { assistant_message_id }),
        );
        self.journal
            .append_child(self.runtime, self.key, records, conversation)
            .await?;
        let mut results = Vec::with_capacity(finished.len());
        for (event, result) in finished {
            self.events.emit(|| event);
            results.push(result);
        }
        self.events.ended(&results);
        if let Some((turn_id, text)) = turn {
            self.events
                .emit(|| Event::agent_turn_messages(turn_id, text.to_owned(), calls.to_vec(), results));
        }
        Ok(())
    }
}

impl<'a> ChildSession<'a> {
    /// The child's side of a compaction of `conversation`, going by `budget`.
    fn compacting<'s>(&'s self, conversation: &'s mut Conversation, budget: &'s mut Budget) -> ChildCompacting<'s, 'a> {
        ChildCompacting {
            session: self,
            conversation,
            budget,
        }
    }
}

/// A child session compacting (see `crate::compaction`): it publishes under the task's id,
/// records the compaction in the child's stream through the parent's attempt, and fails the
/// task with the error.
struct ChildCompacting<'s, 'a> {
    session: &'s ChildSession<'a>,
    conversation: &'s mut Conversation,
    budget: &'s mut Budget,
}

impl Compacting for ChildCompacting<'_, '_> {
    type Failure = SettlementError;

    fn runtime(&self) -> &RuntimeInner {
        self.session.runtime
    }

    fn signal(&self) -> &AbortSignal {
        self.session.signal
    }

    fn budget(&mut self) -> &mut Budget {
        self.budget
    }

    fn conversation(&self) -> &Conversation {
        self.conversation
    }

    fn publish(&self, event: impl FnOnce() -> Event) {
        self.session.events.emit(event);
    }

    fn turn(&self, turn: Option<&LazyId>) {
        self.session.events.scope.set_turn(turn);
    }

    async fn record_compaction(&mut self, compaction: RecordBody) -> Result<(), SettlementError> {
        let journal = self.session.journal;
        journal
            .append_child(
                self.session.runtime,
                self.session.key,
                vec![journal.child_record(compaction)],
                self.conversation,
            )
            .await
            .map_err(|error| SettlementError::new("store_failure", error))
    }

    fn failure(&self, failed: Failed) -> SettlementError {
        match failed {
            Failed::Aborted => crate::session::submission_aborted(),
            Failed::Summary(message) => SettlementError::new("compaction_failed", message),
        }
    }

    fn describe(failure: &SettlementError) -> SettlementError {
        failure.clone()
    }
}

/// The journal of a durable tool call's steps in a child conversation: like the parent's,
/// but settled steps are appended to the child's stream.
struct ChildSteps {
    runtime: Arc<RuntimeInner>,
    journal: Journal,
    key: InstanceKey,
    tool_call_id: String,
    tool_name: String,
    recorded: HashMap<String, Value>,
}

impl flue_core::tool::ToolSteps for ChildSteps {
    fn recorded(&self, step_name: &str) -> Option<Value> {
        self.recorded.get(step_name).cloned()
    }

    fn record(&self, step_name: &str, value: Value) -> BoxFuture<'_, Result<(), String>> {
        let record = self.journal.child_record(RecordBody::ToolStepSettled {
            tool_call_id: self.tool_call_id.clone(),
            tool_name: self.tool_name.clone(),
            step_name: step_name.to_owned(),
            value,
        });
        Box::pin(async move {
            self.journal.check_live()?;
            self.runtime
                .store
                .append(&self.key, vec![record].into(), Some(&self.journal.attempt.attempt))
                .await
                .map(drop)
                .map_err(|error| self.journal.failed(error))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_key_is_under_a_reserved_agent_name_and_the_parents_id_at_every_depth() {
        let root = InstanceKey::new("support", "case-1");
        let child = child_key(&root, "task_A");
        assert_eq!(child, InstanceKey::new("support:task", "case-1/task_A"));
        assert!(
            !flue_core::agent::is_identity(&child.agent),
            "no registered agent can have the name {}",
            child.agent
        );
        let grandchild = child_key(&child, "task_B");
        assert_eq!(grandchild, InstanceKey::new("support:task", "case-1/task_A/task_B"));
    }
}
