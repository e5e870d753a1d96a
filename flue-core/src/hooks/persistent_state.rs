use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{hook, root_only, violation};
use crate::binding::{RuntimeBinding, StateWriteError};
use crate::render::is_rendering;

/// What a persistent state value must be: JSON in and out (serde both ways), cloneable for
/// the default, and shareable with the tools and callbacks that hold its setter.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be persistent state",
    label = "state values are JSON: needs `#[derive(Serialize, Deserialize, Clone)]`",
    note = "persistent state is stored as JSON in the instance's record stream and read back on every render"
)]
pub trait StateValue: Serialize + DeserializeOwned + Clone + Send + Sync + 'static {}

impl<T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static> StateValue for T {}

thread_local! {
    static IN_UPDATER: Cell<bool> = const { Cell::new(false) };
}

/// Durable per-instance state, keyed by `name`: returns the value as of this render and a
/// setter.
///
/// The value is read from this attempt's own writes over the committed snapshot, falling back
/// to `default` (which is never persisted itself). Values are JSON: the setter normalizes
/// through `serde_json`; writing a value equal to the current one as JSON (`1` and `1.0`
/// alike, see [`crate::state::same_state`]) is a no-op. Writes made by
/// tools become durable atomically with the tool batch that made them.
///
/// Panics on an empty or duplicate name in one render, in subagent renders, and when the stored
/// value does not deserialize as `T`.
///
/// ```
/// use flue_core::prelude::*;
///
/// let agent = FnAgent::new(AgentDefinition::new("counter"), |_| {
///     use_model("openai/gpt-4o-mini");
///     let (count, _set_count) = use_persistent_state("count", 0u32);
///     format!("You have been called {count} times.")
/// });
/// let rendered = flue_core::render_bare(&agent).unwrap();
/// assert_eq!(rendered.instruction.as_deref(), Some("You have been called 0 times."));
/// ```
#[track_caller]
pub fn use_persistent_state<T>(name: impl Into<Cow<'static, str>>, default: T) -> (T, StateSetter<T>)
where
    T: StateValue,
{
    let name = name.into();
    hook("use_persistent_state", |frame| {
        root_only(
            frame,
            "[flue] use_persistent_state() is not available in a subagent render. Durable state is scoped to the agent instance; delegates run detached tasks with no state channel. Pass what the delegate needs through the task prompt instead.",
        )?;
        if name.is_empty() {
            return Err("[flue] use_persistent_state(name, default) takes the state name as its first argument — a non-empty string.".to_owned());
        }
        let mut rec = frame.rec.borrow_mut();
        if rec.state_names.contains(&name) {
            return Err(format!(
                "[flue] Duplicate use_persistent_state name \"{name}\" in one render. State names identify a value across renders and must be unique."
            ));
        }
        rec.state_names.push(name.clone());
        drop(rec);
        let mut stored: Option<Result<T, String>> = None;
        if let Some(view) = frame.state.state() {
            view.visit(&name, &mut |value| {
                stored = value.map(|value| T::deserialize(value).map_err(|error| error.to_string()));
            });
        }
        let value = match stored {
            Some(Ok(value)) => value,
            Some(Err(reason)) => {
                return Err(format!(
                    "[flue] State \"{name}\" holds a value that does not match the type use_persistent_state() declared: {reason}."
                ));
            }
            None => default.clone(),
        };
        let setter = StateSetter {
            name: name.clone(),
            default,
            binding: frame.state.binding().cloned(),
        };
        Ok((value, setter))
    })
}

/// [`use_persistent_state`] without a default: `None` until the first write.
#[track_caller]
pub fn use_persistent_state_opt<T>(name: impl Into<Cow<'static, str>>) -> (Option<T>, StateSetter<Option<T>>)
where
    T: StateValue,
{
    use_persistent_state(name, None)
}

/// Persists a new value of one state name. `Clone + Send + 'static`: capture it in tools and
/// callbacks. It resolves the instance's current attempt when called.
#[derive(Clone)]
pub struct StateSetter<T> {
    name: Cow<'static, str>,
    default: T,
    binding: Option<Arc<dyn RuntimeBinding>>,
}

impl<T> StateSetter<T>
where
    T: StateValue,
{
    /// The state name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Writes `value`. A value equal to the current one writes nothing.
    ///
    /// Panics during a render (renders are pure reads). Fails on a bare render, when the
    /// instance is not responding, and when `value` does not serialize to JSON or its JSON
    /// form does not read back as `T`. The stored value is that JSON form, serde_json's: a NaN
    /// or an infinity becomes `null`, so a plain `f64` NaN is refused while a NaN in an
    /// `Option<f64>` is stored as `null` and reads back as `None`.
    #[track_caller]
    pub fn set(&self, value: T) -> Result<(), StateWriteError> {
        let binding = self.guard()?;
        let mut next = Some(self.normalize(&value)?);
        binding.modify_state(&self.name, &mut |current| {
            let next = next
                .take()
                .filter(|next| !current.is_some_and(|current| crate::state::same_state(current, next)));
            Ok(next)
        })
    }

    /// Writes `update(previous)`, where `previous` resolves now through the attempt's write
    /// buffer (not the render snapshot): two callbacks composing with updaters never drop
    /// each other's writes.
    ///
    /// Panics during a render, and when the updater itself calls a setter.
    #[track_caller]
    pub fn update(&self, update: impl FnOnce(T) -> T) -> Result<(), StateWriteError> {
        let binding = self.guard()?;
        let mut update = Some(update);
        binding.modify_state(&self.name, &mut |current| {
            let previous = match current {
                Some(value) => T::deserialize(value).map_err(|error| StateWriteError::TypeMismatch {
                    name: self.name.to_string(),
                    reason: error.to_string(),
                })?,
                None => self.default.clone(),
            };
            let Some(update) = update.take() else {
                return Ok(None);
            };
            IN_UPDATER.with(|flag| flag.set(true));
            let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| update(previous)));
            IN_UPDATER.with(|flag| flag.set(false));
            let next = match next {
                Ok(next) => self.normalize(&next)?,
                Err(payload) => std::panic::resume_unwind(payload),
            };
            Ok((!current.is_some_and(|current| crate::state::same_state(current, &next))).then_some(next))
        })
    }

    #[track_caller]
    fn guard(&self) -> Result<&Arc<dyn RuntimeBinding>, StateWriteError> {
        if is_rendering() {
            violation(format!(
                "[flue] State \"{}\" was written during render. Renders are pure reads of the record stream — write from tool run functions or other runtime callbacks, and use the default value for the initial value.",
                self.name
            ));
        }
        if IN_UPDATER.with(Cell::get) {
            violation(format!(
                "[flue] State \"{}\" was written inside a state updater. An updater only computes the next value from the previous one; write other state after it returns.",
                self.name
            ));
        }
        self.binding.as_ref().ok_or_else(|| StateWriteError::NoRuntime {
            name: self.name.to_string(),
        })
    }

    /// The value as it is stored: its JSON form, which must read back as `T`. JSON has no NaN
    /// or infinity (serde_json writes them as `null`) and a type may write what it cannot read
    /// (a skipped field without a default); stored, such a value would fail every later render
    /// of the instance, so the write is refused instead. A `null` that reads back (a NaN in an
    /// `Option<f64>`, read back as `None`) is stored, as [`StateSetter::set`] says.
    fn normalize(&self, value: &T) -> Result<Value, StateWriteError> {
        let not_json = |reason: String| StateWriteError::NotJson {
            name: self.name.to_string(),
            reason,
        };
        let value = serde_json::to_value(value).map_err(|error| not_json(error.to_string()))?;
        T::deserialize(&value).map_err(|error| {
            not_json(format!(
                "it does not read back as its type after the JSON round trip ({error})"
            ))
        })?;
        Ok(value)
    }
}

impl<T> fmt::Debug for StateSetter<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StateSetter")
            .field("name", &self.name)
            .field("has_runtime", &self.binding.is_some())
            .finish()
    }
}
