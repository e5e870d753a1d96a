//! An in-memory runtime binding for testing agents, tools and callbacks without a runtime.
//!
//! [`TestBinding`] keeps an attempt's [`StateBuffer`], records data writes and dispatches, and
//! can be switched to "not responding" to exercise those errors.
//!
//! ```
//! use std::sync::Arc;
//! use flue_core::prelude::*;
//! use flue_core::testing::TestBinding;
//!
//! let agent = FnAgent::new(AgentDefinition::new("counter"), |_| {
//!     use_model("openai/gpt-4o-mini");
//!     let (count, set_count) = use_persistent_state("count", 0u32);
//!     use_tool(Tool::new("bump").description("Bump the counter.").run(move |_ctx, _: serde_json::Map<String, serde_json::Value>| {
//!         let set_count = set_count.clone();
//!         async move { set_count.update(|n| n + 1).map_err(ToolError::from) }
//!     }));
//!     format!("count={count}")
//! });
//! let binding = TestBinding::new();
//! let runtime = binding.as_binding();
//! let state = RenderState::root("i-1").with_state(&*binding).with_binding(&runtime);
//! let rendered = flue_core::render(&agent, &state).unwrap();
//! assert_eq!(rendered.instruction.as_deref(), Some("count=0"));
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;

use crate::BoxFuture;
use crate::binding::{DataWriteError, DispatchError, RuntimeBinding, StateModify, StateWriteError};
use crate::message::{DeliveredMessage, DispatchReceipt};
use crate::render::StateView;
use crate::state::{StateBuffer, StateSnapshot};

/// Drives a future that completes without waiting (a tool over in-memory state, a dispatch
/// through [`TestBinding`]) to its output, without an async runtime.
///
/// Panics if the future is not ready on its first poll: anything that really waits needs an
/// executor.
pub fn poll_ready<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    match future
        .as_mut()
        .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    {
        std::task::Poll::Ready(output) => output,
        std::task::Poll::Pending => {
            panic!("poll_ready: the future is waiting on something; drive it with an async runtime")
        }
    }
}

/// An in-memory [`RuntimeBinding`].
#[derive(Debug)]
pub struct TestBinding {
    state: Mutex<StateBuffer>,
    data: Mutex<Vec<(String, Value)>>,
    dispatched: Mutex<Vec<DeliveredMessage>>,
    responding: AtomicBool,
    next_submission: AtomicU64,
}

impl TestBinding {
    /// A binding with empty state that is responding.
    pub fn new() -> Arc<Self> {
        Self::with_snapshot(StateSnapshot::new())
    }

    /// A binding whose committed state is `snapshot`.
    pub fn with_snapshot(snapshot: StateSnapshot) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(StateBuffer::new(Arc::new(snapshot))),
            data: Mutex::default(),
            dispatched: Mutex::default(),
            responding: AtomicBool::new(true),
            next_submission: AtomicU64::new(1),
        })
    }

    /// This binding as the trait object a [`crate::RenderState`] takes.
    pub fn as_binding(self: &Arc<Self>) -> Arc<dyn RuntimeBinding> {
        self.clone()
    }

    /// Switches between responding and idle (writes then fail with `NotResponding`).
    pub fn set_responding(&self, responding: bool) {
        self.responding.store(responding, Ordering::Release);
    }

    /// The attempt's write buffer.
    pub fn state(&self) -> MutexGuard<'_, StateBuffer> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Every data write so far, in order.
    pub fn data_writes(&self) -> Vec<(String, Value)> {
        self.data
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Every dispatched message so far, in order.
    pub fn dispatched(&self) -> Vec<DeliveredMessage> {
        self.dispatched
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    fn responding(&self) -> bool {
        self.responding.load(Ordering::Acquire)
    }
}

impl RuntimeBinding for TestBinding {
    fn modify_state(&self, name: &str, modify: &mut StateModify<'_>) -> Result<(), StateWriteError> {
        if !self.responding() {
            return Err(StateWriteError::NotResponding { name: name.to_owned() });
        }
        let mut buffer = self.state();
        if let Some(next) = modify(buffer.current(name))? {
            buffer.write(name, next);
        }
        Ok(())
    }

    fn write_data(&self, name: &str, data: Value) -> Result<(), DataWriteError> {
        if !self.responding() {
            return Err(DataWriteError::NotResponding { name: name.to_owned() });
        }
        self.data
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push((name.to_owned(), data));
        Ok(())
    }

    fn dispatch(&self, message: DeliveredMessage) -> BoxFuture<'static, Result<DispatchReceipt, DispatchError>> {
        let number = self.next_submission.fetch_add(1, Ordering::Relaxed);
        self.dispatched
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(message);
        let receipt = DispatchReceipt {
            submission_id: format!("sub_test_{number}"),
            accepted_at: "1970-01-01T00:00:00.000Z".to_owned(),
            uid: "inst_test".to_owned(),
            deduplicated: false,
        };
        Box::pin(std::future::ready(Ok(receipt)))
    }
}

impl StateView for TestBinding {
    fn visit(&self, name: &str, visit: &mut dyn FnMut(Option<&Value>)) {
        visit(self.state().current(name));
    }
}
