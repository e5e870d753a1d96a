//! The hook chains: the hooks of one kind run in order, each transform receiving the previous
//! one's output, with the error rules of the reference (§1.4):
//!
//! - pre-write hooks (`before_create_message`, `before_update_message`): an error prevents the
//!   write, and the later hooks of that kind do not run for it ([`Prevented`] carries the error
//!   and the last good value, which the three writes that must happen anyway use);
//! - `prefilter_llm_history`: an error with `block` stops the step ([`Blocked`]);
//! - every other error (and a panic, which is an error here) is logged through `tracing` as
//!   `[Hooks] ✗ Error running <kind> hook: <message>` and the chain goes on with the last good
//!   value; event hooks' and post-write hooks' errors change nothing.

use flue_core::lifecycle::{
    HookError, HookFuture, HookKind, LlmMessage, Message, MessageUpdates, ThreadHookHandler, ThreadState, ToolCall,
    ToolResult, ToolStatus,
};
use futures_util::FutureExt;
use serde_json::Value;

use super::HookSet;

/// A pre-write hook's error: the write does not happen (unless it is one of the writes that
/// continue with `last_good`).
#[derive(Debug)]
pub(crate) struct Prevented<T> {
    pub(crate) error: HookError,
    pub(crate) last_good: T,
}

/// A blocking `prefilter_llm_history` error.
#[derive(Debug)]
pub(crate) struct Blocked(pub(crate) HookError);

/// Runs one hook call; a panic becomes its error. The hook's code runs as a tool's does
/// (`tools::quiet`): a panic is not printed raw by the process's panic hook, since its message
/// may quote what the hook called (a URL with its key).
pub(crate) async fn call<'a, T>(call: impl FnOnce() -> HookFuture<'a, T>) -> Result<T, HookError> {
    use crate::tools::quiet;
    quiet::install();
    let future = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| quiet::running_tool(call))) {
        Ok(future) => future,
        Err(payload) => return Err(panicked(payload.as_ref())),
    };
    let mut future = std::pin::pin!(std::panic::AssertUnwindSafe(future).catch_unwind());
    match std::future::poll_fn(|cx| quiet::running_tool(|| future.as_mut().poll(cx))).await {
        Ok(result) => result,
        Err(payload) => Err(panicked(payload.as_ref())),
    }
}

/// [`call`] of a hook that runs with `state`: its error is cleaned of what its thread's `env`
/// hands out (the render's declared secrets, as they are and trimmed) and of URL secrets, as
/// a tool's error is, before anything logs, stores or serves it (a `before_create_message`
/// refusal settles its submission with the message, which clients read).
pub(crate) async fn call_in<'a, T>(
    state: &ThreadState,
    call_hook: impl FnOnce() -> HookFuture<'a, T>,
) -> Result<T, HookError> {
    call(call_hook).await.map_err(|mut error| {
        error.message = cleaned(state, &error.message, true);
        error
    })
}

/// `text` without what `state`'s `env` hands out (the render's declared secrets, as they are
/// and trimmed), and, for an error's text (`urls`), without the userinfo, query and fragment
/// of the URLs it quotes, as a tool's error is.
fn cleaned(state: &ThreadState, text: &str, urls: bool) -> String {
    let mut secrets: Vec<flue_core::tool::Secret> = state
        .declared_secrets()
        .into_iter()
        .filter_map(|name| state.env(name).ok())
        .collect();
    // Longest first: a secret that begins another is replaced after it.
    secrets.sort_by_key(|secret| std::cmp::Reverse(secret.expose().len()));
    crate::tools::clean_text(text, &secrets, urls)
}

/// `changed`, a text a hook returned for `before`, cleaned as a tool's answer is when the
/// hook changed it (what it wrote, a failure it quoted with the key it called, is stored,
/// served and read by the model); as it is when the hook passed it on.
fn cleaned_if_changed(state: &ThreadState, before: Option<&str>, changed: &mut Option<String>, urls: bool) {
    if let Some(text) = changed
        && before != Some(text.as_str())
    {
        *text = cleaned(state, text, urls);
    }
}

/// A tool result a hook returned for `before`: what it changed cleaned as a tool's answer is
/// (a result of the secrets `env` hands out; an error of them and of URL secrets too).
fn cleaned_result(state: &ThreadState, before: &ToolResult, mut result: ToolResult) -> ToolResult {
    cleaned_if_changed(state, before.result.as_deref(), &mut result.result, false);
    cleaned_if_changed(state, before.error.as_deref(), &mut result.error, true);
    result
}

fn panicked(payload: &(dyn std::any::Any + Send)) -> HookError {
    // Where it was raised is for the server's log, not for the clients the error may reach.
    if let Some(at) = crate::tools::quiet::raised_at() {
        tracing::debug!(target: "flue::hooks", at, "a hook panicked");
    }
    HookError::new(format!("panicked: {}", flue_core::render::panic_message(payload)))
}

/// Logs a hook error the chain continues past.
pub(crate) fn log_failure(kind: HookKind, id: &str, error: &HookError) {
    tracing::error!(target: "flue::hooks", hook_id = id, "[Hooks] ✗ Error running {kind} hook: {error}");
}

/// Runs `call` for every hook of one kind (the handlers match on their variant).
macro_rules! each {
    ($set:expr, $kind:expr, |$id:ident, $handler:ident| $body:block) => {
        for ($id, handler) in $set.handlers($kind) {
            #[allow(unused_variables)]
            let $handler = handler;
            $body
        }
    };
}

/// `after_thread_created` (event).
pub(crate) async fn after_thread_created(set: &HookSet, state: &ThreadState) {
    each!(set, HookKind::AfterThreadCreated, |id, handler| {
        if let ThreadHookHandler::AfterThreadCreated(run) = handler
            && let Err(error) = call_in(state, || run(state)).await
        {
            log_failure(HookKind::AfterThreadCreated, id, &error);
        }
    });
}

/// `after_subagent_created` (event, on the parent, with the child's state).
pub(crate) async fn after_subagent_created(set: &HookSet, parent: &ThreadState, child: &ThreadState) {
    each!(set, HookKind::AfterSubagentCreated, |id, handler| {
        if let ThreadHookHandler::AfterSubagentCreated(run) = handler
            && let Err(error) = call_in(parent, || run(parent, child)).await
        {
            log_failure(HookKind::AfterSubagentCreated, id, &error);
        }
    });
}

/// `after_system_message`: a returned string replaces the system message; `None` keeps it.
pub(crate) async fn after_system_message(set: &HookSet, state: &ThreadState, mut text: String) -> String {
    each!(set, HookKind::AfterSystemMessage, |id, handler| {
        if let ThreadHookHandler::AfterSystemMessage(run) = handler {
            match call_in(state, || run(state, text.clone())).await {
                Ok(Some(replacement)) => {
                    let mut replaced = Some(replacement);
                    cleaned_if_changed(state, Some(&text), &mut replaced, false);
                    text = replaced.unwrap_or_default();
                }
                Ok(None) => {}
                Err(error) => log_failure(HookKind::AfterSystemMessage, id, &error),
            }
        }
    });
    text
}

/// `filter_messages`: the rows the model request is built from.
pub(crate) async fn filter_messages(set: &HookSet, state: &ThreadState, mut rows: Vec<Message>) -> Vec<Message> {
    each!(set, HookKind::FilterMessages, |id, handler| {
        if let ThreadHookHandler::FilterMessages(run) = handler {
            match call_in(state, || run(state, rows.clone())).await {
                Ok(filtered) => rows = filtered,
                Err(error) => log_failure(HookKind::FilterMessages, id, &error),
            }
        }
    });
    rows
}

/// `prefilter_llm_history`: what is dispatched, or the blocking error.
pub(crate) async fn prefilter_llm_history(
    set: &HookSet,
    state: &ThreadState,
    mut messages: Vec<LlmMessage>,
) -> Result<Vec<LlmMessage>, Blocked> {
    for (id, handler) in set.handlers(HookKind::PrefilterLlmHistory) {
        if let ThreadHookHandler::PrefilterLlmHistory(run) = handler {
            match call_in(state, || run(state, messages.clone())).await {
                Ok(filtered) => messages = filtered,
                Err(error) if error.block => return Err(Blocked(error)),
                Err(error) => log_failure(HookKind::PrefilterLlmHistory, id, &error),
            }
        }
    }
    Ok(messages)
}

/// `before_create_message`: the row to insert (its id is kept), or the error that prevents it.
pub(crate) async fn before_create_message(
    set: &HookSet,
    state: &ThreadState,
    mut row: Message,
) -> Result<Message, Prevented<Message>> {
    for (id, handler) in set.handlers(HookKind::BeforeCreateMessage) {
        if let ThreadHookHandler::BeforeCreateMessage(run) = handler {
            match call_in(state, || run(state, row.clone())).await {
                Ok(mut changed) => {
                    changed.id = std::mem::take(&mut row.id);
                    cleaned_if_changed(state, row.content.as_deref(), &mut changed.content, false);
                    row = changed;
                }
                Err(error) => {
                    log_failure(HookKind::BeforeCreateMessage, id, &error);
                    return Err(Prevented { error, last_good: row });
                }
            }
        }
    }
    Ok(row)
}

/// `after_create_message` (event).
pub(crate) async fn after_create_message(set: &HookSet, state: &ThreadState, row: &Message) {
    each!(set, HookKind::AfterCreateMessage, |id, handler| {
        if let ThreadHookHandler::AfterCreateMessage(run) = handler
            && let Err(error) = call_in(state, || run(state, row)).await
        {
            log_failure(HookKind::AfterCreateMessage, id, &error);
        }
    });
}

/// `before_update_message`: the updates to apply, or the error that prevents them.
pub(crate) async fn before_update_message(
    set: &HookSet,
    state: &ThreadState,
    message_id: &str,
    mut updates: MessageUpdates,
) -> Result<MessageUpdates, Prevented<MessageUpdates>> {
    for (id, handler) in set.handlers(HookKind::BeforeUpdateMessage) {
        if let ThreadHookHandler::BeforeUpdateMessage(run) = handler {
            // A set the port refuses (a field it does not know, a value of the wrong type)
            // is this hook's failure: the chain stops at the last good set, which keeps what
            // the hooks before it changed (a redaction, say).
            let changed = call_in(state, || run(state, message_id, updates.clone()))
                .await
                .and_then(|changed| match crate::lifecycle::thread::check_updates(&changed) {
                    Ok(()) => Ok(changed),
                    Err(refused) => Err(HookError::new(refused.to_string())),
                });
            match changed {
                Ok(mut changed) => {
                    let before = updates.get("content").and_then(Value::as_str);
                    if let Some(Value::String(content)) = changed.get_mut("content")
                        && before != Some(content.as_str())
                    {
                        *content = cleaned(state, content, false);
                    }
                    updates = changed;
                }
                Err(error) => {
                    log_failure(HookKind::BeforeUpdateMessage, id, &error);
                    return Err(Prevented {
                        error,
                        last_good: updates,
                    });
                }
            }
        }
    }
    Ok(updates)
}

/// `after_update_message` (event, with the full updated row).
pub(crate) async fn after_update_message(set: &HookSet, state: &ThreadState, row: &Message) {
    each!(set, HookKind::AfterUpdateMessage, |id, handler| {
        if let ThreadHookHandler::AfterUpdateMessage(run) = handler
            && let Err(error) = call_in(state, || run(state, row)).await
        {
            log_failure(HookKind::AfterUpdateMessage, id, &error);
        }
    });
}

/// `tool_call_started` (event).
pub(crate) async fn tool_call_started(
    set: &HookSet,
    state: &ThreadState,
    tool_call: &ToolCall,
    progress: Option<&str>,
) {
    each!(set, HookKind::ToolCallStarted, |id, handler| {
        if let ThreadHookHandler::ToolCallStarted(run) = handler
            && let Err(error) = call_in(state, || run(state, tool_call, progress)).await
        {
            log_failure(HookKind::ToolCallStarted, id, &error);
        }
    });
}

/// `tool_call_done` (event, with the raw result).
pub(crate) async fn tool_call_done(set: &HookSet, state: &ThreadState, tool_call: &ToolCall, result: &ToolResult) {
    each!(set, HookKind::ToolCallDone, |id, handler| {
        if let ThreadHookHandler::ToolCallDone(run) = handler
            && let Err(error) = call_in(state, || run(state, tool_call, result)).await
        {
            log_failure(HookKind::ToolCallDone, id, &error);
        }
    });
}

/// `after_tool_call_success` for a success, `after_tool_call_failure` for an error: a returned
/// result replaces the current one; `None` keeps it.
pub(crate) async fn after_tool_call(
    set: &HookSet,
    state: &ThreadState,
    tool_call: &ToolCall,
    mut result: ToolResult,
) -> ToolResult {
    let kind = match result.status {
        ToolStatus::Success => HookKind::AfterToolCallSuccess,
        ToolStatus::Error => HookKind::AfterToolCallFailure,
    };
    for (id, handler) in set.handlers(kind) {
        let run = match handler {
            ThreadHookHandler::AfterToolCallSuccess(run) | ThreadHookHandler::AfterToolCallFailure(run) => run,
            _ => continue,
        };
        match call_in(state, || run(state, tool_call, result.clone())).await {
            Ok(Some(replacement)) => result = cleaned_result(state, &result, replacement),
            Ok(None) => {}
            Err(error) => log_failure(kind, id, &error),
        }
    }
    result
}

/// `before_store_tool_result`: the result that is stored and the model reads.
pub(crate) async fn before_store_tool_result(
    set: &HookSet,
    state: &ThreadState,
    tool_call: &ToolCall,
    mut result: ToolResult,
) -> ToolResult {
    each!(set, HookKind::BeforeStoreToolResult, |id, handler| {
        if let ThreadHookHandler::BeforeStoreToolResult(run) = handler {
            match call_in(state, || run(state, tool_call, result.clone())).await {
                Ok(stored) => result = cleaned_result(state, &result, stored),
                Err(error) => log_failure(HookKind::BeforeStoreToolResult, id, &error),
            }
        }
    });
    result
}
