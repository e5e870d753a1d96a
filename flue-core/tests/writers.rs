//! Writers: state setters, data writers and the dispatcher — during render, on bare renders,
//! through a runtime binding.
#![allow(clippy::unwrap_used)] // tests assert by unwrapping

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::{agent, panic_message_of};
use flue_core::binding::{DataWriteError, DispatchError, StateWriteError};
use flue_core::message::MessageError;
use flue_core::prelude::*;
use flue_core::state::{StateSnapshot, StateWrite};
use flue_core::testing::{TestBinding, poll_ready};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Renders `agent` against `binding` and returns what the render produced.
fn render_with<A: Agent>(agent: &A, binding: &Arc<TestBinding>) -> Rendered {
    let runtime = binding.as_binding();
    flue_core::render(
        agent,
        &RenderState::root("inst-1")
            .with_state(&**binding)
            .with_binding(&runtime),
    )
    .unwrap()
}

/// An agent that exposes its state setter through `slot` and returns the value it read.
fn counter_agent(slot: Arc<Mutex<Option<StateSetter<u32>>>>) -> impl Agent {
    agent(move |_| {
        use_model("openai/gpt-4o");
        let (count, set_count) = use_persistent_state("count", 0u32);
        *slot.lock().unwrap() = Some(set_count);
        format!("count={count}")
    })
}

// ---- state ------------------------------------------------------------------------------

#[test]
fn a_state_setter_called_during_render_panics() {
    let agent = agent(|_| {
        use_model("openai/gpt-4o");
        let (_, set) = use_persistent_state("phase", "gathering".to_owned());
        let _ = set.set("drafting".to_owned());
    });
    let binding = TestBinding::new();
    let runtime = binding.as_binding();
    let error = flue_core::try_render(&agent, &RenderState::root("i").with_binding(&runtime)).unwrap_err();
    assert_eq!(
        error.to_string(),
        "[flue] State \"phase\" was written during render. Renders are pure reads of the record stream — write from tool run functions or other runtime callbacks, and use the default value for the initial value."
    );
}

#[test]
fn a_state_setter_from_a_bare_render_has_no_durable_runtime() {
    let slot = Arc::default();
    flue_core::render_bare(&counter_agent(Arc::clone(&slot))).unwrap();
    let setter = slot.lock().unwrap().take().unwrap();
    let error = setter.set(3).unwrap_err();
    assert_eq!(error, StateWriteError::NoRuntime { name: "count".into() });
    assert_eq!(
        error.to_string(),
        "[flue] State \"count\" has no durable runtime behind this render, so writes are unavailable."
    );
    assert!(setter.update(|n| n + 1).is_err());
}

#[test]
fn the_value_form_writes_and_the_next_render_reads_the_uncommitted_write() {
    let slot = Arc::default();
    let agent = counter_agent(Arc::clone(&slot));
    let binding = TestBinding::new();
    assert_eq!(render_with(&agent, &binding).instruction.as_deref(), Some("count=0"));
    slot.lock().unwrap().as_ref().unwrap().set(5).unwrap();
    assert_eq!(
        binding.state().pending(),
        [StateWrite {
            name: "count".into(),
            value: json!(5)
        }]
    );
    assert_eq!(render_with(&agent, &binding).instruction.as_deref(), Some("count=5"));
}

#[test]
fn the_updater_form_resolves_previous_at_call_time_not_from_the_render_snapshot() {
    let slot = Arc::default();
    let agent = counter_agent(Arc::clone(&slot));
    let binding = TestBinding::with_snapshot(StateSnapshot::from_iter([("count".to_owned(), json!(10))]));
    assert_eq!(render_with(&agent, &binding).instruction.as_deref(), Some("count=10"));
    let first = slot.lock().unwrap().clone().unwrap();
    let second = first.clone();
    // Two callbacks composing with updaters, both born from the same render snapshot (10).
    first.update(|n| n + 1).unwrap();
    second.update(|n| n + 1).unwrap();
    assert_eq!(binding.state().current("count"), Some(&json!(12)));
    assert_eq!(binding.state().pending().len(), 2);
}

#[test]
fn the_updater_starts_from_the_default_before_the_first_write() {
    let slot: Arc<Mutex<Option<StateSetter<u32>>>> = Arc::default();
    let agent = agent({
        let slot = Arc::clone(&slot);
        move |_| {
            let (_, set) = use_persistent_state("visits", 100u32);
            *slot.lock().unwrap() = Some(set);
        }
    });
    let binding = TestBinding::new();
    render_with(&agent, &binding);
    let setter: StateSetter<u32> = slot.lock().unwrap().take().unwrap();
    setter.update(|n| n + 1).unwrap();
    assert_eq!(binding.state().current("visits"), Some(&json!(101)));
}

#[test]
fn writing_a_value_equal_to_the_current_one_is_a_no_op() {
    let slot = Arc::default();
    let agent = counter_agent(Arc::clone(&slot));
    let binding = TestBinding::with_snapshot(StateSnapshot::from_iter([("count".to_owned(), json!(7))]));
    render_with(&agent, &binding);
    let setter = slot.lock().unwrap().take().unwrap();
    setter.set(7).unwrap();
    setter.update(|n| n).unwrap();
    assert!(binding.state().pending().is_empty(), "no record for an unchanged value");
    setter.set(8).unwrap();
    setter.set(8).unwrap();
    assert_eq!(binding.state().pending().len(), 1);
}

#[test]
fn the_default_value_is_never_persisted_by_reading_but_is_written_when_set_explicitly() {
    let slot = Arc::default();
    let agent = counter_agent(Arc::clone(&slot));
    let binding = TestBinding::new();
    render_with(&agent, &binding);
    assert!(binding.state().pending().is_empty());
    slot.lock().unwrap().as_ref().unwrap().set(0).unwrap();
    assert_eq!(
        binding.state().pending().len(),
        1,
        "a name, once written, always has a value"
    );
}

#[test]
fn values_are_normalized_through_json_and_non_json_values_are_refused() {
    #[derive(Clone, Serialize, Deserialize)]
    struct Weird(BTreeMap<(u8, u8), u8>);
    let slot: Arc<Mutex<Option<StateSetter<Weird>>>> = Arc::default();
    let agent = agent({
        let slot = Arc::clone(&slot);
        move |_| {
            let (_, set) = use_persistent_state("weird", Weird(BTreeMap::new()));
            *slot.lock().unwrap() = Some(set);
        }
    });
    let binding = TestBinding::new();
    render_with(&agent, &binding);
    let error = slot
        .lock()
        .unwrap()
        .take()
        .unwrap()
        .set(Weird(BTreeMap::from([((1, 2), 3)])))
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "[flue] State \"weird\" value is not JSON-serializable: key must be a string."
    );
}

#[test]
fn a_value_that_would_not_read_back_is_refused_and_the_next_render_still_works() {
    // JSON has no NaN or infinity: serde_json writes them as null, which an f64 cannot read.
    // Stored, such a value would fail every later render of the instance.
    let slot: Arc<Mutex<Option<StateSetter<f64>>>> = Arc::default();
    let agent = agent({
        let slot = Arc::clone(&slot);
        move |_| {
            let (average, set) = use_persistent_state("average", 0.5f64);
            *slot.lock().unwrap() = Some(set);
            format!("{average}")
        }
    });
    let binding = TestBinding::new();
    render_with(&agent, &binding);
    let set = slot.lock().unwrap().take().unwrap();
    for value in [f64::NAN, f64::INFINITY] {
        let error = set.set(value).unwrap_err();
        assert_eq!(
            error.to_string(),
            "[flue] State \"average\" value is not JSON-serializable: it does not read back as its type \
             after the JSON round trip (invalid type: null, expected f64)."
        );
        let error = set.update(move |_| value).unwrap_err();
        assert!(error.to_string().contains("does not read back"), "{error}");
    }
    assert!(binding.state().pending().is_empty(), "a refused write records nothing");
    set.set(2.5).unwrap();
    assert_eq!(render_with(&agent, &binding).instruction.as_deref(), Some("2.5"));
}

#[test]
fn a_stored_value_of_another_type_fails_the_render_with_a_clear_message() {
    let agent = agent(|_| {
        let (count, _) = use_persistent_state("count", 0u32);
        format!("{count}")
    });
    let binding = TestBinding::with_snapshot(StateSnapshot::from_iter([("count".to_owned(), json!("many"))]));
    let runtime = binding.as_binding();
    let error = flue_core::try_render(
        &agent,
        &RenderState::root("i").with_state(&*binding).with_binding(&runtime),
    )
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "[flue] State \"count\" holds a value that does not match the type use_persistent_state() declared: invalid type: string \"many\", expected u32."
    );
}

#[test]
fn state_writes_fail_while_the_instance_is_not_responding() {
    let slot = Arc::default();
    let agent = counter_agent(Arc::clone(&slot));
    let binding = TestBinding::new();
    render_with(&agent, &binding);
    binding.set_responding(false);
    assert_eq!(
        slot.lock().unwrap().as_ref().unwrap().set(1).unwrap_err().to_string(),
        "[flue] State \"count\" can only be written while the agent is responding — write from tool run functions (and other callbacks that run during a submission)."
    );
}

#[test]
fn an_updater_that_calls_a_setter_panics_instead_of_deadlocking() {
    let slot = Arc::default();
    let agent = counter_agent(Arc::clone(&slot));
    let binding = TestBinding::new();
    render_with(&agent, &binding);
    let setter = slot.lock().unwrap().take().unwrap();
    let inner = setter.clone();
    let message = panic_message_of(|| {
        setter.update(|n| {
            let _ = inner.set(n);
            n + 1
        })
    });
    assert_eq!(
        message,
        "[flue] State \"count\" was written inside a state updater. An updater only computes the next value from the previous one; write other state after it returns."
    );
}

#[test]
fn state_names_are_recorded_and_may_be_conditional_across_renders() {
    let toggle = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let agent = agent({
        let toggle = Arc::clone(&toggle);
        move |_| {
            if toggle.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = use_persistent_state("draft", String::new());
            }
            let _ = use_persistent_state("phase", 0u8);
        }
    });
    assert_eq!(flue_core::render_bare(&agent).unwrap().state_names, ["draft", "phase"]);
    toggle.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(flue_core::render_bare(&agent).unwrap().state_names, ["phase"]);
}

// ---- data writers -----------------------------------------------------------------------

#[derive(Serialize, JsonSchema)]
struct Progress {
    #[schemars(range(max = 100))]
    percent: u32,
    step: String,
}

fn progress_agent(slot: Arc<Mutex<Option<DataWriter<Progress>>>>) -> impl Agent {
    agent(move |_| {
        use_model("openai/gpt-4o");
        *slot.lock().unwrap() = Some(use_data_writer::<Progress>("progress"));
    })
}

#[test]
fn a_data_writer_called_during_render_panics() {
    let agent = agent(|_| {
        let writer = use_data_writer::<u32>("progress");
        let _ = writer.write(&1);
    });
    assert_eq!(
        flue_core::try_render(&agent, &RenderState::bare())
            .unwrap_err()
            .to_string(),
        "[flue] Message data \"progress\" was written during render. Renders are pure reads — write from tool run functions and other callbacks that run while the agent is responding."
    );
}

#[test]
fn a_data_writer_from_a_bare_render_has_no_durable_runtime() {
    let slot = Arc::default();
    flue_core::render_bare(&progress_agent(Arc::clone(&slot))).unwrap();
    let error = slot
        .lock()
        .unwrap()
        .take()
        .unwrap()
        .write(&Progress {
            percent: 1,
            step: "a".into(),
        })
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "[flue] Message data \"progress\" has no durable runtime behind this render, so writes are unavailable."
    );
}

#[test]
fn data_writes_are_checked_against_the_schema_of_their_type() {
    let slot = Arc::default();
    let agent = progress_agent(Arc::clone(&slot));
    let binding = TestBinding::new();
    let rendered = render_with(&agent, &binding);
    assert_eq!(rendered.data_writers[0].name, "progress");
    let writer = slot.lock().unwrap().take().unwrap();
    writer
        .write(&Progress {
            percent: 40,
            step: "fetch".into(),
        })
        .unwrap();
    let error = writer
        .write(&Progress {
            percent: 140,
            step: "fetch".into(),
        })
        .unwrap_err();
    assert!(matches!(error, DataWriteError::SchemaMismatch { .. }));
    assert_eq!(
        error.to_string(),
        "[flue] Message data \"progress\" write does not match its schema: /percent: 140 is greater than the maximum of 100."
    );
    assert_eq!(
        binding.data_writes(),
        [("progress".to_owned(), json!({"percent": 40, "step": "fetch"}))]
    );
}

#[test]
fn an_untyped_data_writer_checks_writes_against_an_explicit_schema() {
    let schema =
        DataSchema::new(json!({"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}}))
            .unwrap();
    let slot: Arc<Mutex<Option<DataWriter<serde_json::Value>>>> = Arc::default();
    let agent = agent({
        let slot = Arc::clone(&slot);
        move |_| *slot.lock().unwrap() = Some(use_data_writer_with_schema("link", &schema))
    });
    let binding = TestBinding::new();
    render_with(&agent, &binding);
    let writer = slot.lock().unwrap().take().unwrap();
    writer.write(&json!({"url": "https://example.com"})).unwrap();
    let error = writer.write(&json!({"href": "x"})).unwrap_err();
    assert_eq!(
        error.to_string(),
        "[flue] Message data \"link\" write does not match its schema: root: \"url\" is a required property."
    );
    assert_eq!(binding.data_writes().len(), 1);
}

#[test]
fn data_writes_fail_while_the_instance_is_not_responding() {
    let slot = Arc::default();
    let agent = progress_agent(Arc::clone(&slot));
    let binding = TestBinding::new();
    render_with(&agent, &binding);
    binding.set_responding(false);
    assert_eq!(
        slot.lock()
            .unwrap()
            .take()
            .unwrap()
            .write(&Progress {
                percent: 1,
                step: "x".into()
            })
            .unwrap_err()
            .to_string(),
        "[flue] Message data \"progress\" can only be written while the agent is responding — write from tool run functions (and other callbacks that run during a submission)."
    );
}

// ---- dispatcher -------------------------------------------------------------------------

#[test]
fn the_dispatcher_panics_during_render() {
    let agent = agent(|_| {
        let dispatch = use_dispatch_message();
        drop(dispatch.dispatch("again"));
    });
    assert_eq!(
        flue_core::try_render(&agent, &RenderState::bare())
            .unwrap_err()
            .to_string(),
        "[flue] The use_dispatch_message() dispatcher was called during render. Renders are pure reads — dispatch from tool run functions, effects, and other callbacks."
    );
}

#[test]
fn the_dispatcher_from_a_bare_render_has_no_durable_runtime() {
    let slot = Arc::new(Mutex::new(None));
    let agent = agent({
        let slot = Arc::clone(&slot);
        move |_| *slot.lock().unwrap() = Some(use_dispatch_message())
    });
    flue_core::render_bare(&agent).unwrap();
    let dispatcher: Dispatcher = slot.lock().unwrap().take().unwrap();
    let error = poll_ready(dispatcher.dispatch("hello")).unwrap_err();
    assert_eq!(error, DispatchError::NoRuntime);
    assert_eq!(
        error.to_string(),
        "[flue] The use_dispatch_message() dispatcher has no durable runtime behind this render, so self-dispatch is unavailable."
    );
}

#[test]
fn the_dispatcher_admits_valid_messages_and_refuses_reserved_signals() {
    let slot = Arc::new(Mutex::new(None));
    let agent = agent({
        let slot = Arc::clone(&slot);
        move |_| *slot.lock().unwrap() = Some(use_dispatch_message())
    });
    let binding = TestBinding::new();
    render_with(&agent, &binding);
    let dispatcher: Dispatcher = slot.lock().unwrap().take().unwrap();
    let receipt = poll_ready(dispatcher.dispatch("follow up")).unwrap();
    assert_eq!(receipt.submission_id, "sub_test_1");
    let error = poll_ready(dispatcher.dispatch(Signal::new("resources", "x"))).unwrap_err();
    assert_eq!(
        error,
        DispatchError::InvalidMessage(MessageError::ReservedSignalType("resources".into()))
    );
    let error = poll_ready(dispatcher.dispatch(Signal::new("ci", "x").tag_name("1bad"))).unwrap_err();
    assert_eq!(
        error,
        DispatchError::InvalidMessage(MessageError::InvalidTagName("1bad".into()))
    );
    assert_eq!(binding.dispatched(), [DeliveredMessage::user("follow up")]);
}

#[test]
fn writers_are_clone_send_and_static() {
    fn assert_handle<T: Clone + Send + Sync + 'static>() {}
    assert_handle::<StateSetter<u32>>();
    assert_handle::<DataWriter<Progress>>();
    assert_handle::<Dispatcher>();
}
