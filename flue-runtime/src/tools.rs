//! Running a response's tool calls: arguments validated against the schema before the tool
//! runs, errors and panics turned into error results, concurrency bounded, abort honoured.

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use flue_core::Tool;
use flue_core::abort::AbortSignal;
use flue_core::tool::{ToolContext, ToolOutput};
use futures_util::FutureExt;
use futures_util::stream::{self, StreamExt};
use serde_json::Value;

use crate::provider::ModelToolCall;

/// One executed call.
pub(crate) struct Executed<'c> {
    pub(crate) call: &'c ModelToolCall,
    pub(crate) output: ToolOutput,
    pub(crate) duration_ms: u64,
}

/// Runs `calls` against `tools`, at most `concurrency` at a time, returning outcomes in call
/// order. `started` is told about each call as it starts, `done` as it ends.
pub(crate) async fn run_batch<'c>(
    tools: &[Tool],
    calls: &'c [ModelToolCall],
    concurrency: usize,
    signal: &AbortSignal,
    context: impl Fn(&Tool, &ModelToolCall) -> ToolContext,
    started: impl Fn(&ModelToolCall),
    done: impl Fn(&Executed<'c>) + Sync,
) -> Vec<Executed<'c>> {
    let done = &done;
    // By index: a closure taking the call by reference makes the batch's future fail the
    // higher-ranked `Send` check of the tasks that await it.
    let runs = (0..calls.len()).map(|index| {
        let call = &calls[index];
        let tool = tools.iter().find(|tool| tool.name() == call.name).cloned();
        let ctx = tool.as_ref().map(|tool| context(tool, call));
        started(call);
        async move {
            let begun = Instant::now();
            let output = match (tool, ctx) {
                (Some(tool), Some(ctx)) => {
                    let mut output = run_one(&tool, ctx, &call.arguments, signal).await;
                    // A `terminate` tool's successful results ask to end the turn.
                    output.terminate |= tool.definition().terminate && !output.is_error;
                    output
                }
                _ => ToolOutput::error(format!("Tool \"{}\" is not available.", call.name)),
            };
            let executed = Executed {
                call,
                output,
                duration_ms: begun.elapsed().as_millis() as u64,
            };
            done(&executed);
            executed
        }
    });
    stream::iter(runs).buffered(concurrency.max(1)).collect().await
}

pub(crate) async fn run_one(tool: &Tool, ctx: ToolContext, arguments: &str, signal: &AbortSignal) -> ToolOutput {
    let args: Value = match serde_json::from_str(if arguments.trim().is_empty() { "{}" } else { arguments }) {
        Ok(args) => args,
        Err(error) => {
            return ToolOutput::error(format!("Tool argument validation failed: [root] invalid JSON: {error}"));
        }
    };
    if let Err(issues) = tool.input_schema().validate(&args) {
        let issues: Vec<String> = issues
            .iter()
            .map(|issue| match issue.split_once(": ") {
                Some((path, message)) => format!("[{path}] {message}"),
                None => issue.clone(),
            })
            .collect();
        return ToolOutput::error(format!("Tool argument validation failed: {}", issues.join("; ")));
    }
    if signal.is_aborted() {
        return ToolOutput::error("Tool execution was aborted before it started.");
    }
    // A closure tool runs the user's code before its future exists: a panic there is the
    // tool's too.
    let run = match std::panic::catch_unwind(AssertUnwindSafe(|| tool.call(ctx, args))) {
        Ok(future) => AssertUnwindSafe(future).catch_unwind(),
        Err(payload) => return panicked(tool, payload.as_ref()),
    };
    // The tool first: one that finishes at its first poll never registers with the signal.
    tokio::select! {
        biased;
        result = run => match result {
            Ok(output) => output,
            Err(payload) => panicked(tool, payload.as_ref()),
        },
        () = signal.aborted() => ToolOutput::error("Tool execution was aborted."),
    }
}

/// The error result of a tool that panicked.
fn panicked(tool: &Tool, payload: &(dyn std::any::Any + Send)) -> ToolOutput {
    ToolOutput::error(format!(
        "Tool \"{}\" panicked: {}",
        tool.name(),
        flue_core::render::panic_message(payload)
    ))
}
