//! Delegation: the framework's `task` tool, the "Available Agents" roster in the system prompt,
//! and the child sessions tasks run in.
//!
//! - Every session has the `task` tool — one static spec (`agent`, `prompt`, optional
//!   `description`), always present, so the serialized tool block never changes with the
//!   roster — and an "Available Agents" section listing each offered delegate by name and
//!   description (or saying there is none: the tool is inert then).
//! - Hidden relationships are not offered (and cannot be called); optional ones only while
//!   their flag is on. A name outside the roster is answered with a factual miss, not an error.
//! - A task renders its delegate fresh, in a subagent frame, with the task prompt as its
//!   delivery, and runs it as a detached session: its own context (only the prompt), its own
//!   tools, the parent's model and thinking level unless the relationship overrides them.
//!   Only the child's final text returns, as the tool result.
//! - Delegation is capped at four levels (`delegation_depth_exceeded`); `max_instances` caps
//!   the tasks of one relationship running at once; `after_subagent_created` runs on the
//!   parent before the child's first model call.
//! - Child sessions are not durable: a task is part of its parent's tool batch, so a crash
//!   before the batch commits runs it again (at least once, like every tool).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use flue_core::abort::AbortSignal;
use flue_core::data::SchemaSource;
use flue_core::lifecycle::{ThreadIdentity, ThreadState, ThreadStateApi};
use flue_core::message::DeliveredMessage;
use flue_core::model::ThinkingLevel;
use flue_core::render::{RenderState, Rendered};
use flue_core::subagent::Subagent;
use flue_core::tool::{ToolContext, ToolDefinition, ToolHandler, ToolOutput};
use flue_core::{BoxFuture, Tool};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::events::Event;
use crate::lifecycle::{HookSet, chain};
use crate::provider::{Messages, ModelMessage, ModelRequest, ToolSpec};
use crate::record::new_id;
use crate::runtime::RuntimeInner;
use crate::store::InstanceKey;

/// How deep delegation may nest (a task's child delegating, and so on).
pub const MAX_DELEGATION_DEPTH: u32 = 4;

const TASK_DESCRIPTION: &str = "Hand a focused piece of work to one of the agents listed under \"Available Agents\" in the system prompt. \
The agent starts with a fresh context: it sees only your prompt, so make the prompt a complete briefing. \
Only its final answer comes back. Several tasks in one turn run in parallel.";

/// The roster section while no delegate is offered (the `task` tool is there all the same).
const NO_AGENTS: &str = "## Available Agents\n\nNone: no agent is available for delegation now, so do not call the `task` tool unless one is announced later.";

/// The `task` tool's arguments.
#[derive(Deserialize, JsonSchema)]
struct TaskArgs {
    /// Which agent runs the task: a name from "Available Agents" in the system prompt.
    #[schemars(length(min = 1))]
    agent: String,
    /// The complete instructions for the agent (it sees nothing else of this conversation).
    prompt: String,
    /// A short label for the work, for people following along.
    #[serde(default)]
    description: Option<String>,
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

/// The "Available Agents" section of the system prompt.
pub(crate) fn roster(offered: &[Subagent]) -> String {
    if offered.is_empty() {
        return NO_AGENTS.to_owned();
    }
    let mut section = String::from(
        "## Available Agents\n\nDelegate focused work to one of these agents with the `task` tool, naming the agent:\n",
    );
    for subagent in offered {
        section.push_str(&format!("\n- **{}** — {}", subagent.name(), subagent.description()));
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
    /// The parent session's depth (the root is 0).
    depth: u32,
    signal: AbortSignal,
    /// Tasks running, by relationship (for `max_instances`).
    running: Mutex<HashMap<String, u32>>,
    live: Mutex<Live>,
}

/// What the latest render declares.
#[derive(Default)]
struct Live {
    offered: Vec<Subagent>,
    /// The parent thread and its hooks, for `after_subagent_created` (root sessions only).
    parent: Option<(ThreadState, HookSet)>,
    /// The parent's sandbox tools: children share the environment.
    environment: Vec<Tool>,
}

impl Delegation {
    pub(crate) fn new(
        runtime: &Arc<RuntimeInner>,
        key: &InstanceKey,
        submission_id: &str,
        model: String,
        thinking: ThinkingLevel,
        depth: u32,
        signal: AbortSignal,
    ) -> Self {
        Self {
            runtime: Arc::downgrade(runtime),
            key: key.clone(),
            submission_id: submission_id.to_owned(),
            model,
            thinking,
            depth,
            signal,
            running: Mutex::default(),
            live: Mutex::default(),
        }
    }

    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// What the latest render offers, the parent's state, and the environment children share.
    pub(crate) fn update(
        &self,
        offered: Vec<Subagent>,
        parent: Option<(ThreadState, HookSet)>,
        environment: Vec<Tool>,
    ) {
        *self.live() = Live {
            offered,
            parent,
            environment,
        };
    }
}

/// The `task` tool delegating with `delegation`.
pub(crate) fn task_tool(delegation: Arc<Delegation>) -> Tool {
    Tool::from_handler(TaskTool {
        definition: ToolDefinition::from_checked(
            "task",
            TASK_DESCRIPTION,
            SchemaSource::Typed(flue_core::data::tool_input_schema_of::<TaskArgs>),
            None,
            &[],
            false,
        ),
        delegation,
    })
}

struct TaskTool {
    definition: ToolDefinition,
    delegation: Arc<Delegation>,
}

impl ToolHandler for TaskTool {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    fn call(&self, _ctx: ToolContext, args: Value) -> BoxFuture<'_, ToolOutput> {
        let delegation = self.delegation.clone();
        Box::pin(async move {
            let args: TaskArgs = match serde_json::from_value(args) {
                Ok(args) => args,
                Err(error) => return ToolOutput::error(format!("Tool argument validation failed: [root] {error}")),
            };
            run_task(&delegation, args).await
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

async fn run_task(delegation: &Delegation, args: TaskArgs) -> ToolOutput {
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
        return ToolOutput::text(format!(
            "No agent named \"{}\" is available for delegation. Available agents: {}.",
            args.agent,
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        ));
    };
    if delegation.depth >= MAX_DELEGATION_DEPTH {
        return ToolOutput::error(format!(
            "delegation_depth_exceeded: delegation is limited to {MAX_DELEGATION_DEPTH} nested levels."
        ));
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
            return ToolOutput::error(format!(
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
    let Some(runtime) = delegation.runtime.upgrade() else {
        return ToolOutput::error("The runtime was dropped.");
    };
    let task_id = new_id("task");
    let emit = |event: Event| runtime.emit(&delegation.key, Some(&delegation.submission_id), event);
    emit(Event::TaskStart {
        task_id: task_id.clone(),
        agent: subagent.name().to_owned(),
        description: args.description.clone(),
        prompt: args.prompt.clone(),
    });
    let started = Instant::now();
    let result = child_session(&runtime, delegation, &subagent, parent, environment, &task_id, &args).await;
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

/// The `ThreadState` of a child session (identity only: it has no stream of its own).
struct ChildThread(ThreadIdentity);

impl ThreadStateApi for ChildThread {
    fn identity(&self) -> &ThreadIdentity {
        &self.0
    }
}

/// Runs one task to its final answer.
async fn child_session(
    runtime: &Arc<RuntimeInner>,
    delegation: &Delegation,
    subagent: &Subagent,
    parent: Option<(ThreadState, HookSet)>,
    environment: Vec<Tool>,
    task_id: &str,
    args: &TaskArgs,
) -> Result<String, String> {
    let delivery = Arc::new(DeliveredMessage::user(args.prompt.clone()));
    let agent = subagent.agent().get();
    let mut rendered = Rendered::default();
    let state = RenderState::subagent(&delivery);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        flue_core::render_into(agent, &state, &mut rendered)
    })) {
        Ok(Ok(())) => {}
        Ok(Err(error)) => return Err(format!("The \"{}\" agent could not render: {error}", subagent.name())),
        Err(payload) => {
            return Err(format!(
                "The \"{}\" agent could not render: {}",
                subagent.name(),
                flue_core::render::panic_message(payload.as_ref())
            ));
        }
    }
    let model = subagent.model_override().unwrap_or(&delegation.model).to_owned();
    let thinking = subagent.thinking_level_override().unwrap_or(delegation.thinking);
    let (provider, model_id) = runtime
        .providers
        .resolve(&model)
        .map_err(|error| format!("The \"{}\" agent's model: {error}", subagent.name()))?;

    if let Some((parent, hooks)) = &parent
        && hooks.has(flue_core::lifecycle::HookKind::AfterSubagentCreated)
    {
        let mut arguments = Map::new();
        arguments.insert("prompt".into(), json!(args.prompt));
        if let Some(description) = &args.description {
            arguments.insert("description".into(), json!(description));
        }
        let child = ThreadState::new(Arc::new(ChildThread(ThreadIdentity {
            thread_id: task_id.to_owned(),
            agent_id: subagent.name().to_owned(),
            user_id: parent.user_id().map(str::to_owned),
            created_at: crate::session::micros_of(&crate::record::now()),
            arguments,
        })));
        chain::after_subagent_created(hooks, parent, &child).await;
    }

    // The parent's environment, then the child's own skills and delegates (one level deeper).
    if let Some(taken) = rendered
        .tools
        .iter()
        .find(|own| environment.iter().any(|tool| tool.name() == own.name()))
    {
        return Err(format!(
            "The \"{}\" agent's tool \"{}\" clashes with a sandbox tool.",
            subagent.name(),
            taken.name()
        ));
    }
    rendered.tools.extend(environment.iter().cloned());
    let nested = Arc::new(Delegation::new(
        runtime,
        &delegation.key,
        &delegation.submission_id,
        model.clone(),
        thinking,
        delegation.depth + 1,
        delegation.signal.clone(),
    ));
    let nested_tool = task_tool(nested.clone());
    let mut sections = crate::framework::Sections::default();
    crate::framework::mount(
        &mut rendered,
        Some((&nested, &nested_tool)),
        None,
        environment,
        &mut sections,
    );
    let system = crate::framework::system(rendered.instruction.as_deref(), sections.text());
    let tools = std::mem::take(&mut rendered.tools);
    let specs: Vec<ToolSpec> = tools.iter().map(ToolSpec::from).collect();
    let max_steps = agent.definition().max_steps.unwrap_or(u32::MAX);
    // Shared with each request (a call does not copy the history); the request is gone by the
    // time the loop adds to it.
    let mut messages = Messages::from([ModelMessage::user(args.prompt.clone())]);
    let mut last_text = String::new();
    for _ in 0..max_steps {
        let request = ModelRequest {
            model: model_id.clone(),
            system: system.clone(),
            messages: messages.clone(),
            tools: specs.clone(),
            thinking_level: thinking,
            max_output_tokens: None,
        };
        let response = crate::provider::complete(&runtime.options, &*provider, &request, &delegation.signal).await?;
        last_text.clone_from(&response.text);
        messages.push(ModelMessage::Assistant {
            text: response.text.clone(),
            tool_calls: response.tool_calls.clone(),
        });
        if response.tool_calls.is_empty() {
            return Ok(response.text);
        }
        let executed = crate::tools::run_batch(
            &tools,
            &response.tool_calls,
            runtime.options.tool_concurrency,
            &delegation.signal,
            |tool, call| {
                ToolContext::new(tool, call.id.clone())
                    .with_instance_id(delegation.key.id.to_string())
                    .with_signal(delegation.signal.clone())
            },
            |_| {},
            |_| {},
        )
        .await;
        if delegation.signal.is_aborted() {
            return Err("The task was aborted.".into());
        }
        for run in executed {
            messages.push(ModelMessage::Tool {
                tool_call_id: run.call.id.clone(),
                name: run.call.name.clone(),
                content: run.output.to_text(),
                is_error: run.output.is_error,
            });
        }
    }
    // The step budget ran out: what the child last said is its answer.
    Ok(last_text)
}
