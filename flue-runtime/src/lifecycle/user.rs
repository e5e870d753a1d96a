//! User scope: the runtime's `UserState` (values in the store, shared by every thread of the
//! user; a live event channel) and the user-scope hooks (`user_value_changed`,
//! `user_client_attached`, `user_client_detached`).
//!
//! User-scope hooks need no selection: every one registered with the runtime
//! ([`RuntimeBuilder::user_hook`](crate::RuntimeBuilder::user_hook)) runs. They run in the
//! background, one at a time per user in the order their events happened (a per-user queue
//! with its own worker), and their errors are logged, never returned to the operation that
//! caused them. A value written from inside a `user_value_changed` hook does not fire the
//! hooks again. At most [`USER_HOOK_QUEUE`] events wait per user: when slow hooks fall that
//! far behind (a client connecting and disconnecting in a loop, say), a further event is
//! dropped with a warning rather than held in memory without bound. Attach and detach events
//! stay paired: a client's detach is dropped when its attach was, and a heard client's detach
//! waits past the bound (up to twice it).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use flue_core::BoxFuture;
use flue_core::lifecycle::{
    ClientInfo, HookKind, ThreadError, UserHook, UserHookHandler, UserState, UserStateApi, UserValuePage,
    UserValuesQuery, check_user_id, check_user_key,
};
use serde_json::Value;
use tokio::sync::mpsc;

use super::chain::log_failure;
use crate::runtime::RuntimeInner;

/// An event sent with `UserState::emit`, for the user's connected clients.
#[derive(Clone, Debug, PartialEq)]
pub struct UserEvent {
    /// The user.
    pub user_id: Arc<str>,
    /// The event's name.
    pub event: String,
    /// Its data.
    pub data: Value,
}

/// What starts the user-scope hooks.
#[derive(Clone, Debug)]
pub(crate) enum UserHookEvent {
    /// A value was set or deleted.
    ValueChanged(String),
    /// A client connected to the user's event stream.
    ClientAttached(ClientInfo),
    /// It disconnected.
    ClientDetached(ClientInfo),
}

impl UserHookEvent {
    fn kind(&self) -> HookKind {
        match self {
            Self::ValueChanged(_) => HookKind::UserValueChanged,
            Self::ClientAttached(_) => HookKind::UserClientAttached,
            Self::ClientDetached(_) => HookKind::UserClientDetached,
        }
    }
}

/// How many hook events may wait for one user's hooks (the one running is not counted). A
/// client's detach event may pass it, up to twice as many waiting, unless its client's attach
/// event was dropped (then it is dropped too).
pub const USER_HOOK_QUEUE: usize = 1024;

/// The per-user queues of hook events, each drained by one worker while it has work.
#[derive(Default)]
pub(crate) struct UserChains {
    queues: Mutex<HashMap<String, Queue>>,
}

/// One user's queue: kept while its worker runs, or while a client whose attach event was
/// dropped has not detached.
#[derive(Default)]
struct Queue {
    /// The running worker's channel; `None` once it drained and ended.
    sender: Option<mpsc::UnboundedSender<UserHookEvent>>,
    /// The events sent to the running worker that it has not taken yet.
    waiting: Arc<AtomicUsize>,
    /// How many events were dropped since the worker started (one warning at the first, a
    /// count when the queue drains: a flood of drops must not flood the log).
    dropped: usize,
    /// The clients whose attach event was dropped: their detach event is dropped too, so the
    /// hooks never see a client leave that they did not see arrive.
    unheard: HashSet<String>,
}

/// Queues `event` for `user_id`'s hooks (nothing when no hook of its kind is registered).
///
/// At most [`USER_HOOK_QUEUE`] events wait; a further one is dropped, except a client's detach
/// event: hooks that saw a client arrive must see it leave, so a detach waits even past the
/// bound (up to twice it, a hard limit), unless its client's attach was dropped, and then it
/// is dropped too (not counted again).
pub(crate) fn dispatch(runtime: &Arc<RuntimeInner>, user_id: &str, event: UserHookEvent) {
    let kind = event.kind();
    if !runtime.user_hooks.iter().any(|hook| hook.kind() == kind) {
        return;
    }
    let mut queues = runtime
        .user_chains
        .queues
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if !queues.contains_key(user_id) {
        queues.insert(user_id.to_owned(), Queue::default());
    }
    let Some(queue) = queues.get_mut(user_id) else { return };
    if let UserHookEvent::ClientDetached(client) = &event
        && queue.unheard.remove(&client.id)
    {
        if queue.sender.is_none() && queue.unheard.is_empty() {
            queues.remove(user_id);
        }
        return;
    }
    let mut event = event;
    if let Some(sender) = &queue.sender {
        let bound = match event {
            UserHookEvent::ClientDetached(_) => 2 * USER_HOOK_QUEUE,
            _ => USER_HOOK_QUEUE,
        };
        let waiting = queue.waiting.load(Ordering::SeqCst);
        if waiting >= bound {
            // Remembered only while a detach hook could hear the client leave (else nothing
            // would ever forget it).
            if let UserHookEvent::ClientAttached(client) = &event
                && runtime
                    .user_hooks
                    .iter()
                    .any(|hook| hook.kind() == HookKind::UserClientDetached)
            {
                queue.unheard.insert(client.id.clone());
            }
            queue.dropped += 1;
            let first = queue.dropped == 1;
            drop(queues);
            if first {
                tracing::warn!(
                    target: "flue::hooks",
                    user = user_id,
                    "[Hooks] ✗ A {kind} event was dropped: {waiting} events already wait for this user's hooks (further drops are counted when the queue drains)"
                );
            }
            return;
        }
        queue.waiting.fetch_add(1, Ordering::SeqCst);
        match sender.send(event) {
            Ok(()) => return,
            // Its worker ended without draining (the runtime is going away): a new worker.
            Err(mpsc::error::SendError(unsent)) => event = unsent,
        }
    }
    let (sender, events) = mpsc::unbounded_channel();
    let waiting = Arc::new(AtomicUsize::new(1));
    let _ = sender.send(event);
    queue.sender = Some(sender);
    queue.waiting = waiting.clone();
    queue.dropped = 0;
    drop(queues);
    tokio::spawn(drain(Arc::downgrade(runtime), user_id.to_owned(), events, waiting));
}

/// Runs a user's queued hook events in order; ends (and forgets the queue, unless it holds
/// unheard clients) once it is empty.
async fn drain(
    runtime: Weak<RuntimeInner>,
    user_id: String,
    mut events: mpsc::UnboundedReceiver<UserHookEvent>,
    waiting: Arc<AtomicUsize>,
) {
    loop {
        let event = match events.try_recv() {
            Ok(event) => event,
            Err(_) => {
                let Some(runtime) = runtime.upgrade() else { return };
                let mut queues = runtime
                    .user_chains
                    .queues
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                // Checked under the lock senders take: nothing can arrive after this.
                match events.try_recv() {
                    Ok(event) => event,
                    Err(_) => {
                        let mut dropped = 0;
                        if let Some(queue) = queues.get_mut(&user_id) {
                            dropped = std::mem::take(&mut queue.dropped);
                            queue.sender = None;
                            if queue.unheard.is_empty() {
                                queues.remove(&user_id);
                            }
                        }
                        drop(queues);
                        if dropped > 0 {
                            tracing::warn!(
                                target: "flue::hooks",
                                user = user_id,
                                "[Hooks] ✗ {dropped} user hook event(s) were dropped while this user's queue was full"
                            );
                        }
                        return;
                    }
                }
            }
        };
        waiting.fetch_sub(1, Ordering::SeqCst);
        let Some(runtime) = runtime.upgrade() else { return };
        run_hooks(&runtime, &user_id, &event).await;
    }
}

async fn run_hooks(runtime: &Arc<RuntimeInner>, user_id: &str, event: &UserHookEvent) {
    // The hooks' own writes do not dispatch again.
    let state = user_state(runtime, user_id, false);
    let kind = event.kind();
    for hook in runtime.user_hooks.iter().filter(|hook| hook.kind() == kind) {
        // A panic is the hook's error, whether it comes before the hook returns its future or
        // while the future runs: the other hooks and the user's later events still run.
        let result = match (hook.handler(), event) {
            (UserHookHandler::UserValueChanged(run), UserHookEvent::ValueChanged(key)) => {
                super::chain::call(|| run(&state, key)).await
            }
            (UserHookHandler::UserClientAttached(run), UserHookEvent::ClientAttached(client))
            | (UserHookHandler::UserClientDetached(run), UserHookEvent::ClientDetached(client)) => {
                super::chain::call(|| run(&state, client)).await
            }
            _ => continue,
        };
        if let Err(mut error) = result {
            // Cleaned of a URL's secrets as a thread hook's is (a webhook's error quotes the
            // URL it called); a user hook reads no declared secrets.
            error.message = flue_core::url::without_url_secrets(&error.message);
            log_failure(kind, hook.id(), &error);
        }
    }
}

/// The `UserState` of `user_id`; `dispatch_hooks` is off for the state user hooks receive.
pub(crate) fn user_state(runtime: &Arc<RuntimeInner>, user_id: &str, dispatch_hooks: bool) -> UserState {
    UserState::new(Arc::new(RuntimeUser {
        user_id: user_id.to_owned(),
        runtime: Arc::downgrade(runtime),
        dispatch_hooks,
    }))
}

struct RuntimeUser {
    user_id: String,
    runtime: Weak<RuntimeInner>,
    dispatch_hooks: bool,
}

impl RuntimeUser {
    /// The runtime, for a store operation on this user (whose id is checked first: every
    /// store must be able to hold it).
    fn runtime(&self) -> Result<Arc<RuntimeInner>, ThreadError> {
        check_user_id(&self.user_id)?;
        self.runtime
            .upgrade()
            .ok_or_else(|| ThreadError::Unavailable("the runtime was dropped.".into()))
    }
}

fn store_error(error: crate::store::StoreError) -> ThreadError {
    ThreadError::Store(error.to_string())
}

impl UserStateApi for RuntimeUser {
    fn user_id(&self) -> &str {
        &self.user_id
    }

    fn get_value<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Value>, ThreadError>> {
        Box::pin(async move {
            check_user_key(key)?;
            let runtime = self.runtime()?;
            let stored = runtime
                .store
                .user_value(&self.user_id, key)
                .await
                .map_err(store_error)?;
            Ok(stored.map(|stored| stored.value))
        })
    }

    fn set_value<'a>(&'a self, key: &'a str, value: Option<Value>) -> BoxFuture<'a, Result<(), ThreadError>> {
        Box::pin(async move {
            check_user_key(key)?;
            let runtime = self.runtime()?;
            let value = value.filter(|value| !value.is_null());
            let now = i64::try_from(crate::store::now_ms()).unwrap_or(i64::MAX);
            runtime
                .store
                .set_user_value(&self.user_id, key, value, now)
                .await
                .map_err(store_error)?;
            if self.dispatch_hooks {
                dispatch(&runtime, &self.user_id, UserHookEvent::ValueChanged(key.to_owned()));
            }
            Ok(())
        })
    }

    fn list_values(&self, query: UserValuesQuery) -> BoxFuture<'_, Result<UserValuePage, ThreadError>> {
        Box::pin(async move {
            if query.prefix.chars().any(char::is_control) {
                return Err(ThreadError::Invalid(
                    "A user value key prefix cannot contain control characters.".into(),
                ));
            }
            let runtime = self.runtime()?;
            runtime
                .store
                .list_user_values(&self.user_id, &query)
                .await
                .map_err(store_error)
        })
    }

    fn emit(&self, event: &str, data: Value) {
        if let Some(runtime) = self.runtime.upgrade() {
            // Live only: nobody listening is not an error.
            let _ = runtime.user_events.send(UserEvent {
                user_id: self.user_id.as_str().into(),
                event: event.to_owned(),
                data,
            });
        }
    }
}

/// The registered user-scope hooks without repeats; two different hooks sharing an id are
/// refused (thread hook ids are checked against these by the builder).
pub(crate) fn unique_user_hooks(hooks: Vec<UserHook>) -> Result<Vec<UserHook>, String> {
    let mut unique: Vec<UserHook> = Vec::with_capacity(hooks.len());
    for hook in hooks {
        flue_core::lifecycle::check_hook_id(hook.id())?;
        match unique.iter().find(|other| other.id() == hook.id()) {
            Some(other) if *other == hook => {}
            Some(other) => {
                return Err(flue_core::lifecycle::shared_id_message(
                    hook.id(),
                    other.kind(),
                    hook.kind(),
                ));
            }
            None => unique.push(hook),
        }
    }
    Ok(unique)
}
