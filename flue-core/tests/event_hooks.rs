//! The four event hooks: declarations, the append window, metadata returns and deep merge.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod common;

use std::sync::{Arc, Mutex};

use common::agent;
use flue_core::abort::AbortSignal;
use flue_core::event_hooks::{AppendError, AppendWindow, MetadataError, ResponseSummary, SeamChannel};
use flue_core::log::Logger;
use flue_core::metadata::merge_metadata;
use flue_core::prelude::*;
use flue_core::testing::poll_ready;
use serde_json::json;

#[derive(Default)]
struct Channel(Mutex<Vec<Signal>>);

impl SeamChannel for Channel {
    fn append(&self, signal: Signal) {
        self.0.lock().unwrap().push(signal);
    }
}

#[test]
fn event_hook_callbacks_are_recorded_in_declaration_order_through_custom_hooks() {
    fn use_audit(log: Arc<Mutex<Vec<&'static str>>>) {
        let log2 = Arc::clone(&log);
        use_agent_start(move |_| {
            let log = Arc::clone(&log);
            async move { log.lock().unwrap().push("audit start") }
        });
        use_agent_finish(move |_| {
            let log = Arc::clone(&log2);
            async move { log.lock().unwrap().push("audit finish") }
        });
    }
    let log: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let agent = agent({
        let log = Arc::clone(&log);
        move |_| {
            use_model("openai/gpt-4o");
            let first = Arc::clone(&log);
            use_agent_start(move |_| {
                let log = Arc::clone(&first);
                async move { log.lock().unwrap().push("body start") }
            });
            use_audit(Arc::clone(&log));
            use_response_start(|_| json!({"a": 1}));
            use_response_finish(|_| ());
        }
    });
    let rendered = flue_core::render_bare(&agent).unwrap();
    assert_eq!((rendered.agent_starts.len(), rendered.agent_finishes.len()), (2, 1));
    assert_eq!(
        (rendered.response_starts.len(), rendered.response_finishes.len()),
        (1, 1)
    );
    let channel: Arc<dyn SeamChannel> = Arc::new(Channel::default());
    let delivery = Arc::new(DeliveredMessage::user("hi"));
    for start in &rendered.agent_starts {
        let ctx = AgentStartContext::new(
            channel.clone(),
            AppendWindow::open(),
            AbortSignal::new(),
            Logger::discard(),
            delivery.clone(),
        );
        poll_ready(start.call(ctx)).unwrap();
    }
    assert_eq!(*log.lock().unwrap(), ["body start", "audit start"]);
}

#[test]
fn append_works_inside_the_window_and_fails_after_the_callback_settled() {
    let channel = Arc::new(Channel::default());
    let window = AppendWindow::open();
    let ctx = AgentStartContext::new(
        channel.clone(),
        window.clone(),
        AbortSignal::new(),
        Logger::discard(),
        Arc::new(DeliveredMessage::user("hi")),
    );
    ctx.append(Signal::new("inbox", "3 new messages").attribute("count", "3"))
        .unwrap();
    window.close();
    assert_eq!(
        ctx.append(Signal::new("inbox", "late")).unwrap_err().to_string(),
        "[flue] append() was called after its use_agent_start callback settled. The append window is the callback itself — to send input at any other time, use the dispatcher from use_dispatch_message()."
    );
    assert_eq!(channel.0.lock().unwrap().len(), 1);

    let finish_window = AppendWindow::open();
    let finish = AgentFinishContext::new(
        channel.clone(),
        finish_window.clone(),
        AbortSignal::new(),
        Logger::discard(),
        Arc::new(ResponseSummary::default()),
    );
    finish_window.close();
    assert_eq!(
        finish
            .append(Signal::new("todo", "keep going"))
            .unwrap_err()
            .to_string(),
        "[flue] append() was called after its use_agent_finish callback settled. The continuation window is the callback itself — to send input at any other time, use the dispatcher from use_dispatch_message()."
    );
}

#[test]
fn append_rejects_reserved_signal_types_and_invalid_signals() {
    let channel = Arc::new(Channel::default());
    let ctx = AgentStartContext::new(
        channel.clone(),
        AppendWindow::open(),
        AbortSignal::new(),
        Logger::discard(),
        Arc::new(DeliveredMessage::user("hi")),
    );
    assert_eq!(
        ctx.append(Signal::new("compaction", "x")).unwrap_err().to_string(),
        "[flue] append() signal type \"compaction\" is framework-reserved vocabulary (the runtime's own narration and recovery signals) — use an application-specific type."
    );
    assert_eq!(
        ctx.append(Signal::new("", "x")).unwrap_err().to_string(),
        "[flue] append() message is invalid: Signal message \"type\" must not be empty."
    );
    assert!(matches!(
        ctx.append(Signal::new("ok", "x").tag_name("bad tag")),
        Err(AppendError::Invalid(_))
    ));
    assert!(channel.0.lock().unwrap().is_empty());
}

#[test]
fn a_failing_async_callback_reports_its_error() {
    let hook =
        flue_core::event_hooks::AgentFinishHook::new(|_ctx| async { Err::<(), _>(std::io::Error::other("not done")) });
    let ctx = AgentFinishContext::new(
        Arc::new(Channel::default()),
        AppendWindow::open(),
        AbortSignal::new(),
        Logger::discard(),
        Arc::new(ResponseSummary::default()),
    );
    assert_eq!(poll_ready(hook.call(ctx)).unwrap_err().to_string(), "not done");
}

#[test]
fn response_metadata_callbacks_return_objects_or_nothing_and_reject_other_values() {
    let ctx = ResponseStartContext {
        metadata: Metadata::new(),
        log: Logger::discard(),
    };
    let object = flue_core::event_hooks::ResponseStartHook::new(|_| json!({"model": "x"}));
    assert_eq!(
        object.call(&ctx).unwrap(),
        Some(json!({"model": "x"}).as_object().unwrap().clone())
    );
    let nothing = flue_core::event_hooks::ResponseStartHook::new(|_| ());
    assert_eq!(nothing.call(&ctx).unwrap(), None);
    let array = flue_core::event_hooks::ResponseStartHook::new(|_| json!([1]));
    assert_eq!(array.call(&ctx).unwrap_err(), MetadataError::NotAnObject("an array"));
    assert_eq!(
        array.call(&ctx).unwrap_err().to_string(),
        "[flue] A response metadata callback must return a plain object of metadata (or nothing) — got an array."
    );
    let string = flue_core::event_hooks::ResponseFinishHook::new(|_| json!("x"));
    let finish = ResponseFinishContext {
        metadata: Metadata::new(),
        response: ResponseSummary::default(),
        log: Logger::discard(),
    };
    assert_eq!(
        string.call(&finish).unwrap_err().to_string(),
        "[flue] A response metadata callback must return a plain object of metadata (or nothing) — got string."
    );
}

#[test]
fn metadata_deep_merge_later_keys_win_and_objects_merge_recursively() {
    let mut base = json!({"a": 1, "nested": {"x": 1, "y": 1}}).as_object().unwrap().clone();
    merge_metadata(
        &mut base,
        json!({"a": 2, "nested": {"y": 2, "z": 3}, "b": [1]})
            .as_object()
            .unwrap()
            .clone(),
    );
    assert_eq!(
        serde_json::Value::Object(base),
        json!({"a": 2, "nested": {"x": 1, "y": 2, "z": 3}, "b": [1]})
    );
}

#[test]
fn metadata_deep_merge_skips_absent_values() {
    let mut base = json!({"keep": "me", "nested": {"keep": true}})
        .as_object()
        .unwrap()
        .clone();
    let patch: Metadata = serde_json::from_value(json!({"keep": null, "nested": {"keep": null, "new": null}})).unwrap();
    merge_metadata(&mut base, patch);
    assert_eq!(
        serde_json::Value::Object(base),
        json!({"keep": "me", "nested": {"keep": true}})
    );
}

#[test]
fn metadata_deep_merge_drops_prototype_polluting_keys_at_every_depth() {
    let mut base = Metadata::new();
    let patch = json!({
        "__proto__": {"polluted": true},
        "constructor": 1,
        "prototype": 2,
        "ok": {"prototype": 3, "inner": {"__proto__": 4, "fine": 5}}
    });
    merge_metadata(&mut base, patch.as_object().unwrap().clone());
    assert_eq!(serde_json::Value::Object(base), json!({"ok": {"inner": {"fine": 5}}}));
}

#[test]
fn metadata_deep_merge_replaces_a_non_object_with_an_object_and_vice_versa() {
    let mut base = json!({"a": 1, "b": {"c": 1}}).as_object().unwrap().clone();
    merge_metadata(&mut base, json!({"a": {"x": 1}, "b": 2}).as_object().unwrap().clone());
    assert_eq!(serde_json::Value::Object(base), json!({"a": {"x": 1}, "b": 2}));
}

#[test]
fn the_abort_signal_fires_once_and_wakes_waiters() {
    let signal = AbortSignal::new();
    let clone = signal.clone();
    let mut waiting = std::pin::pin!(clone.aborted());
    let waker = std::task::Waker::noop();
    assert!(
        waiting
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker))
            .is_pending()
    );
    signal.abort("Submission was aborted.");
    signal.abort("second reason is ignored");
    assert!(
        waiting
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker))
            .is_ready()
    );
    assert_eq!(clone.reason(), Some("Submission was aborted."));
}

/// A channel whose push says it began and then waits to be let go.
struct Held {
    pushed: Mutex<Vec<Signal>>,
    began: Mutex<std::sync::mpsc::Sender<()>>,
    go: Mutex<std::sync::mpsc::Receiver<()>>,
}

impl SeamChannel for Held {
    fn append(&self, signal: Signal) {
        self.began.lock().unwrap().send(()).unwrap();
        self.go.lock().unwrap().recv().unwrap();
        self.pushed.lock().unwrap().push(signal);
    }
}

/// An append on another thread (a task the callback spawned) that passed the window's check as
/// the callback ended has pushed its signal when `close` returns: the runtime, which takes the
/// signals right after closing, never leaves one behind.
#[test]
fn an_append_racing_the_close_of_its_window_lands_before_the_close_returns() {
    let (began_tx, began) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel();
    let channel = Arc::new(Held {
        pushed: Mutex::new(Vec::new()),
        began: Mutex::new(began_tx),
        go: Mutex::new(go_rx),
    });
    let window = AppendWindow::open();
    let ctx = AgentFinishContext::new(
        channel.clone(),
        window.clone(),
        AbortSignal::new(),
        Logger::discard(),
        Arc::new(ResponseSummary::default()),
    );
    let appender = std::thread::spawn(move || ctx.append(Signal::new("note", "late")));
    began.recv().unwrap();
    // The close waits for the push under way (given a moment to start first).
    let closing = {
        let channel = channel.clone();
        std::thread::spawn(move || {
            window.close();
            channel.pushed.lock().unwrap().len()
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(50));
    go.send(()).unwrap();
    assert_eq!(
        closing.join().unwrap(),
        1,
        "the signal was pushed when the close returned"
    );
    assert_eq!(appender.join().unwrap(), Ok(()));
}
