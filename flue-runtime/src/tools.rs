//! Running a response's tool calls: arguments validated against the schema before the tool
//! runs, errors and panics turned into error results, concurrency bounded, abort honoured.
//!
//! A tool's panic is its error result, cleaned of its secrets as its output is. So that the
//! panic is not also printed raw (to stderr, by the process's panic hook: an HTTP library's
//! error quotes the URL it called, key and all), the first call chains a hook in front of the
//! process's (see [`quiet`]): it stays quiet for a panic raised while a thread runs a tool's
//! code, which is logged cleaned instead, and hands every other panic on.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Instant;

use flue_core::Tool;
use flue_core::abort::AbortSignal;
use flue_core::tool::{ToolContent, ToolContext, ToolOutput};
use futures_util::FutureExt;
use futures_util::stream::{self, StreamExt};
use serde_json::Value;

use crate::provider::ModelToolCall;

/// One executed call.
pub(crate) struct Executed<'c> {
    pub(crate) call: &'c ModelToolCall,
    pub(crate) output: ToolOutput,
    pub(crate) duration_ms: u64,
    /// The call ended after the attempt's abort (stopped by it, never started, or ended as it
    /// was told to stop): its output is no outcome, the tool's outcome is unknown.
    pub(crate) interrupted: bool,
}

impl Executed<'_> {
    /// The JSON value the call answered, for clients (the protocol's structured `output`):
    /// none for a text result or an error. (What the model reads is the value as text.)
    pub(crate) fn structured_output(&self) -> Option<Value> {
        match &self.output.content {
            // Kept only where a store keeps it, in its record and batch (with room to spare):
            // a value deeper still is served as its text, which stores whatever its nesting.
            ToolContent::Json(value) if !self.output.is_error && !crate::store::depth::nests_deeper_than(value, 8) => {
                Some(value.clone())
            }
            _ => None,
        }
    }
}

/// Runs `calls` against `tools`, at most `concurrency` at a time. `started` is told about each
/// call as it starts, `done` as it ends; then `settle` takes the call over while the others run
/// on (it makes the outcome durable, say), told whether the call is the batch's last to end.
/// Returns what `settle` made of each call, in call order.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_batch<'c, T, Settled: Future<Output = T>>(
    tools: &[Tool],
    calls: &'c [ModelToolCall],
    concurrency: usize,
    signal: &AbortSignal,
    context: impl Fn(&Tool, &ModelToolCall) -> ToolContext,
    started: impl Fn(&ModelToolCall),
    done: impl Fn(&Executed<'c>) + Sync,
    settle: impl Fn(Executed<'c>, bool) -> Settled,
) -> Vec<T> {
    let (done, settle) = (&done, &settle);
    let running = &AtomicUsize::new(calls.len());
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
                interrupted: signal.is_aborted(),
            };
            done(&executed);
            let last = running.fetch_sub(1, Ordering::AcqRel) == 1;
            (index, settle(executed, last).await)
        }
    });
    // Unordered: a call that was settled frees its place at once (`buffered` would keep it
    // until every earlier call finished). Started in call order all the same; results in call
    // order.
    let mut settled: Vec<(usize, T)> = stream::iter(runs).buffer_unordered(concurrency.max(1)).collect().await;
    settled.sort_unstable_by_key(|(index, _)| *index);
    settled.into_iter().map(|(_, settled)| settled).collect()
}

pub(crate) async fn run_one(tool: &Tool, ctx: ToolContext, arguments: &str, signal: &AbortSignal) -> ToolOutput {
    let args: Value = match serde_json::from_str(if arguments.trim().is_empty() { "{}" } else { arguments }) {
        Ok(args) => args,
        Err(error) => {
            return ToolOutput::invalid_arguments(format_args!("[root] invalid JSON: {error}"));
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
        return ToolOutput::invalid_arguments(issues.join("; "));
    }
    if signal.is_aborted() {
        return ToolOutput::error("Tool execution was aborted before it started.");
    }
    // The values of the tool's declared secrets, kept out of what it answers (see `redacted`),
    // and of every secret its thread's `env` may hand it (another tool's of the render).
    let mut secrets: Vec<flue_core::tool::Secret> = tool
        .definition()
        .secrets
        .iter()
        .filter_map(|name| ctx.secret(name).ok())
        .collect();
    if let Some(thread) = ctx.thread() {
        let own = &tool.definition().secrets;
        secrets.extend(
            thread
                .declared_secrets()
                .into_iter()
                .filter(|name| !own.contains(name))
                .filter_map(|name| thread.env(name).ok()),
        );
    }
    // Longest first: a secret that begins another is replaced after it.
    secrets.sort_by_key(|secret| std::cmp::Reverse(secret.expose().len()));
    let secrets: Arc<[flue_core::tool::Secret]> = secrets.into();
    // Its log lines are cleaned as its output is: a library's error it logs may quote a key.
    let log = ctx.log().clone();
    let ctx = ctx.with_logger(flue_core::log::Logger::new(Arc::new(CleanLog {
        log,
        secrets: secrets.clone(),
    })));
    redacted(run_call(tool, ctx, args, signal, &secrets).await, &secrets)
}

/// A tool call's log lines, without the values of its secrets nor a URL's secrets.
struct CleanLog {
    log: flue_core::log::Logger,
    secrets: Arc<[flue_core::tool::Secret]>,
}

impl flue_core::log::LogSink for CleanLog {
    fn log(&self, level: flue_core::log::LogLevel, message: &str) {
        self.log.log(level, clean_text(message, &self.secrets, true));
    }
}

/// `text` without the values of `secrets` (longest first; as they are, JSON-escaped or
/// percent-encoded), and, when `urls`, without a URL's secrets.
pub(crate) fn clean_text(text: &str, secrets: &[flue_core::tool::Secret], urls: bool) -> String {
    // URLs first: a secret in a URL's query goes with it, rather than leaving the `]` of its
    // `[redacted]` behind the cut (`…/v1])`).
    let text = if urls {
        flue_core::url::without_url_secrets(text)
    } else {
        text.to_owned()
    };
    secrets.iter().fold(text, |text, secret| {
        // Also as code that trimmed it would use it: a value mounted from a file (a
        // Kubernetes secret) often ends with a line break no URL or header can hold.
        let (whole, trimmed) = (secret.expose(), secret.expose().trim());
        let text = crate::provider::redact_secret(&text, whole);
        if trimmed.len() < whole.len() {
            crate::provider::redact_secret(&text, trimmed)
        } else {
            text
        }
    })
}

/// `output` as the model, the records and the observers get it: without the values of the
/// tool's declared `secrets` (as they are, JSON-escaped or percent-encoded, wherever they show),
/// and, for an error, without a URL's secrets (an HTTP client's error quotes the URL it
/// called, query keys included).
fn redacted(mut output: ToolOutput, secrets: &[flue_core::tool::Secret]) -> ToolOutput {
    if secrets.is_empty() && !output.is_error {
        return output;
    }
    let is_error = output.is_error;
    let clean = |text: &str| clean_text(text, secrets, is_error);
    match &mut output.content {
        ToolContent::Text(text) => {
            let cleaned = clean(text);
            *text = cleaned;
        }
        ToolContent::Json(value) => {
            let cleaned = redact_strings(std::mem::take(value), &clean);
            *value = cleaned;
        }
    }
    output
}

/// `value` with `clean` applied to each of its strings (keys included).
fn redact_strings(value: Value, clean: &impl Fn(&str) -> String) -> Value {
    match value {
        Value::String(text) => Value::String(clean(&text)),
        Value::Array(items) => Value::Array(items.into_iter().map(|item| redact_strings(item, clean)).collect()),
        Value::Object(fields) => Value::Object(
            fields
                .into_iter()
                .map(|(key, field)| (clean(&key), redact_strings(field, clean)))
                .collect(),
        ),
        other => other,
    }
}

/// Runs the call whose arguments passed: its output, a panic's or an abort's.
async fn run_call(
    tool: &Tool,
    ctx: ToolContext,
    args: Value,
    signal: &AbortSignal,
    secrets: &[flue_core::tool::Secret],
) -> ToolOutput {
    quiet::install();
    // A closure tool runs the user's code before its future exists: a panic there is the
    // tool's too.
    let run = match std::panic::catch_unwind(AssertUnwindSafe(|| quiet::running_tool(|| tool.call(ctx, args)))) {
        Ok(future) => AssertUnwindSafe(future).catch_unwind(),
        Err(payload) => return panicked(tool, payload.as_ref(), secrets),
    };
    // The tool first: one that finishes at its first poll never registers with the signal.
    // (Not `tokio::select!`: it answers `Pending` without polling anything when the task's
    // cooperative budget is spent, so the calls of a batch would start in an order that
    // depends on how much the task did before; here each call starts when the batch first
    // polls it, in call order.)
    let mut run = std::pin::pin!(Some(run));
    let mut aborted = std::pin::pin!(signal.aborted());
    let output = std::future::poll_fn(|cx| {
        if let Some(running) = run.as_mut().as_pin_mut()
            && let Poll::Ready(result) = quiet::running_tool(|| running.poll(cx))
        {
            return Poll::Ready(match result {
                Ok(output) => output,
                Err(payload) => panicked(tool, payload.as_ref(), secrets),
            });
        }
        aborted
            .as_mut()
            .poll(cx)
            .map(|()| ToolOutput::error("Tool execution was aborted."))
    })
    .await;
    // A tool stopped by the abort is dropped mid-way, here: what it held is dropped with it,
    // and a panic of a drop (a runtime of its own dropped in async code, say) is the tool's,
    // not the response's.
    if let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(|| quiet::running_tool(|| run.as_mut().set(None))))
    {
        tracing::warn!(
            tool = tool.name(),
            at = quiet::raised_at().unwrap_or_default(),
            panic = clean_text(&flue_core::render::panic_message(payload.as_ref()), secrets, true),
            "a tool stopped by an abort panicked while it was dropped"
        );
    }
    output
}

/// The error result of a tool that panicked, logged (cleaned as the result will be).
fn panicked(tool: &Tool, payload: &(dyn std::any::Any + Send), secrets: &[flue_core::tool::Secret]) -> ToolOutput {
    let message = flue_core::render::panic_message(payload);
    tracing::warn!(
        tool = tool.name(),
        at = quiet::raised_at().unwrap_or_default(),
        panic = clean_text(&message, secrets, true),
        "a tool panicked: its error result tells the model"
    );
    ToolOutput::error(format!("Tool \"{}\" panicked: {message}", tool.name()))
}

/// The panic hook that keeps tools' (and hooks') panics from being printed raw (see the
/// module's doc).
pub(crate) mod quiet {
    use std::cell::{Cell, RefCell};

    thread_local! {
        /// Whether this thread is running a tool's code.
        static RUNNING_TOOL: Cell<bool> = const { Cell::new(false) };
        /// Where this thread's latest quiet panic was raised (`file:line:column`).
        static RAISED_AT: RefCell<Option<String>> = const { RefCell::new(None) };
    }

    /// Chains the hook in front of the process's (once per process; a hook set later
    /// replaces it, as hooks do).
    pub(crate) fn install() {
        static INSTALLED: std::sync::Once = std::sync::Once::new();
        INSTALLED.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                // Quiet only where the panic is caught (as the tool's result): a build that
                // aborts on panic prints it as always.
                if !cfg!(panic = "abort") && RUNNING_TOOL.with(Cell::get) {
                    let at = info
                        .location()
                        .map(|at| format!("{}:{}:{}", at.file(), at.line(), at.column()));
                    RAISED_AT.with(|raised| raised.replace(at));
                } else {
                    previous(info);
                }
            }));
        });
    }

    /// Runs `code` as a tool's (or a hook's): a panic it raises is not printed.
    pub(crate) fn running_tool<R>(code: impl FnOnce() -> R) -> R {
        /// Puts the flag back, however `code` ends.
        struct Restore(bool);
        impl Drop for Restore {
            fn drop(&mut self) {
                RUNNING_TOOL.with(|running| running.set(self.0));
            }
        }
        let _restore = Restore(RUNNING_TOOL.with(|running| running.replace(true)));
        code()
    }

    /// Where this thread's latest quiet panic was raised, once.
    pub(crate) fn raised_at() -> Option<String> {
        RAISED_AT.with(RefCell::take)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A tool that notes its name in `started` when its future first runs (and finishes
    /// then: it never waits).
    fn noting(name: &str, started: &Arc<Mutex<Vec<String>>>) -> Tool {
        let started = started.clone();
        let name = name.to_owned();
        Tool::new(name.clone())
            .description("Notes that it ran.")
            .run(move |_ctx, _: serde_json::Map<String, Value>| {
                let (started, name) = (started.clone(), name.clone());
                async move {
                    started.lock().unwrap().push(name);
                    Ok::<_, flue_core::tool::ToolError>("ran")
                }
            })
    }

    /// The one secret the redaction tests declare.
    struct OneSecret;

    impl flue_core::tool::SecretSource for OneSecret {
        fn get(&self, name: &str) -> Option<String> {
            (name == "MAPS_KEY").then(|| "AIza-secret/value 42".to_owned())
        }
    }

    /// What a tool answers reaches the model without its declared secrets' values (as they
    /// are, JSON-escaped or percent-encoded), and an error without a URL's secrets: an HTTP
    /// client's error quotes the URL it called. (Regression: tool output was the one text
    /// from outside no redaction ran on.)
    /// A secret whose value ends with a line break (mounted from a file) is also kept out
    /// as code that trimmed it used it.
    #[test]
    fn a_secret_is_cleaned_as_it_is_and_trimmed() {
        let secrets = [flue_core::tool::Secret::new("tok-123456\n")];
        assert_eq!(
            clean_text("GET /bot/tok-123456/send and tok-123456\n", &secrets, false),
            "GET /bot/[redacted]/send and [redacted]"
        );
    }

    #[tokio::test]
    async fn a_tools_output_reaches_the_model_without_its_secrets() {
        let echoes = |fails: bool| {
            Tool::new("maps")
                .description("Looks a place up.")
                .secret("MAPS_KEY")
                .run(move |ctx: ToolContext, _: serde_json::Map<String, Value>| async move {
                    let key = ctx.secret("MAPS_KEY").unwrap();
                    let encoded = key.expose().replace('/', "%2F").replace(' ', "%20");
                    let said = format!(
                        "GET https://maps.example/find?key={encoded}&q=x failed; raw {}, as JSON {}",
                        key.expose(),
                        serde_json::to_string(key.expose()).unwrap()
                    );
                    if fails {
                        Err(flue_core::tool::ToolError::new(said))
                    } else {
                        Ok(serde_json::json!({"found": said}))
                    }
                })
        };
        for fails in [false, true] {
            let tool = echoes(fails);
            let ctx = ToolContext::new(&tool, "call_1").with_secrets(Arc::new(OneSecret));
            let output = run_one(&tool, ctx, "{}", &AbortSignal::new()).await;
            assert_eq!(output.is_error, fails);
            let shown = match &output.content {
                ToolContent::Text(text) => text.clone(),
                ToolContent::Json(value) => value.to_string(),
            };
            assert!(!shown.contains("AIza"), "{shown}");
            assert!(shown.contains("[redacted]"), "{shown}");
        }
    }

    /// Where a test's log lines go.
    #[derive(Default)]
    struct Lines(Mutex<Vec<String>>);

    impl flue_core::log::LogSink for Lines {
        fn log(&self, _level: flue_core::log::LogLevel, message: &str) {
            self.0.lock().unwrap().push(message.to_owned());
        }
    }

    /// A tool's log lines reach the observers cleaned as its output is: a library's error it
    /// logs may quote its key, or the URL it called.
    #[tokio::test]
    async fn a_tools_log_lines_reach_the_observers_without_its_secrets() {
        let tool = Tool::new("maps")
            .description("Looks a place up.")
            .secret("MAPS_KEY")
            .run(|ctx: ToolContext, _: serde_json::Map<String, Value>| async move {
                let key = ctx.secret("MAPS_KEY").unwrap();
                ctx.log().error(format!("the maps API refused {}", key.expose()));
                ctx.log()
                    .warn("GET https://maps.example/find?token=abc123&q=x timed out");
                "found"
            });
        let lines = Arc::new(Lines::default());
        let ctx = ToolContext::new(&tool, "call_1")
            .with_secrets(Arc::new(OneSecret))
            .with_logger(flue_core::log::Logger::new(lines.clone()));
        run_one(&tool, ctx, "{}", &AbortSignal::new()).await;
        let lines = lines.0.lock().unwrap().clone();
        assert_eq!(lines.len(), 2);
        assert!(
            lines
                .iter()
                .all(|line| !line.contains("AIza") && !line.contains("abc123")),
            "{lines:?}"
        );
        assert!(lines[0].contains("[redacted]"), "{lines:?}");
    }

    /// Panics when dropped.
    struct PanicsOnDrop;

    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("dropped in the wrong place");
        }
    }

    #[tokio::test]
    async fn a_tool_stopped_by_an_abort_whose_drop_panics_still_ends_as_aborted() {
        let tool = Tool::new("holds").description("Holds what panics when dropped.").run(
            |_ctx, _: serde_json::Map<String, Value>| async move {
                let held = PanicsOnDrop;
                std::future::pending::<()>().await;
                drop(held);
                Ok::<_, flue_core::tool::ToolError>("never")
            },
        );
        let signal = AbortSignal::new();
        let ctx = ToolContext::new(&tool, "call_1".to_owned());
        let stopping = signal.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            stopping.abort("stop");
        });
        let output = run_one(&tool, ctx, "{}", &signal).await;
        assert!(output.is_error);
        assert!(
            matches!(&output.content, flue_core::tool::ToolContent::Text(text) if text == "Tool execution was aborted."),
            "{:?}",
            output.content
        );
    }

    #[tokio::test]
    async fn the_calls_of_a_batch_start_in_call_order_even_when_the_task_spent_its_budget() {
        let started = Arc::new(Mutex::new(Vec::new()));
        let names = ["first", "second", "third"];
        let tools: Vec<Tool> = names.iter().map(|name| noting(name, &started)).collect();
        let calls: Vec<ModelToolCall> = names
            .iter()
            .enumerate()
            .map(|(index, name)| ModelToolCall {
                id: format!("call_{index}"),
                name: (*name).to_owned(),
                arguments: "{}".to_owned(),
            })
            .collect();
        let signal = AbortSignal::new();
        let batch = run_batch(
            &tools,
            &calls,
            8,
            &signal,
            |tool, call| ToolContext::new(tool, call.id.clone()),
            |_| {},
            |_| {},
            |executed, _| std::future::ready(executed.output),
        );
        let mut batch = std::pin::pin!(batch);
        // The batch is first polled by a task that has spent its cooperative budget (as a
        // response's task may have, by the time its tool calls start).
        let first = std::future::poll_fn(|cx| {
            loop {
                let mut unit = std::pin::pin!(tokio::task::consume_budget());
                if unit.as_mut().poll(cx).is_pending() {
                    break;
                }
            }
            Poll::Ready(batch.as_mut().poll(cx).is_ready())
        })
        .await;
        if !first {
            batch.await;
        }
        assert_eq!(*started.lock().unwrap(), names);
    }
}
