//! Persistent state values: the committed snapshot and an attempt's write buffer.
//!
//! The runtime folds the snapshot from `state_write` records (the last write of a name wins)
//! and gives every attempt a [`StateBuffer`] over it. Setters write into the buffer; the buffer
//! drops no-op writes, overlays its writes for later reads (re-renders see the attempt's own
//! uncommitted writes) and is drained into the same append batch as the tool batch or seam
//! that made the writes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::render::StateView;

/// FNV-1a: state names are short, author-chosen keys read on every render, where SipHash's
/// DoS resistance buys nothing and costs most of the lookup.
#[derive(Default, Clone, Copy)]
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut hash = if self.0 == 0 { 0xcbf2_9ce4_8422_2325 } else { self.0 };
        for byte in bytes {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = hash;
    }
}

type NameMap<V> = HashMap<String, V, BuildHasherDefault<Fnv>>;

/// Committed persistent state of one instance: name → last written value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateSnapshot {
    values: NameMap<Value>,
}

impl StateSnapshot {
    /// An empty snapshot.
    pub fn new() -> Self {
        Self::default()
    }

    /// The value of `name`, if it was ever written.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.values.get(name)
    }

    /// Records a committed write (folding: the last write wins).
    pub fn apply(&mut self, name: impl Into<String>, value: Value) {
        self.values.insert(name.into(), value);
    }

    /// Number of names with a value.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether no name has a value.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The names and their values, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.values.iter().map(|(name, value)| (name.as_str(), value))
    }
}

impl FromIterator<(String, Value)> for StateSnapshot {
    fn from_iter<I: IntoIterator<Item = (String, Value)>>(iter: I) -> Self {
        Self {
            values: iter.into_iter().collect(),
        }
    }
}

impl StateView for StateSnapshot {
    fn visit(&self, name: &str, visit: &mut dyn FnMut(Option<&Value>)) {
        visit(self.values.get(name));
    }
}

/// One state write, as drained for appending.
#[derive(Clone, Debug, PartialEq)]
pub struct StateWrite {
    /// The state name.
    pub name: String,
    /// The normalized JSON value.
    pub value: Value,
}

/// One attempt's state writes over the committed snapshot.
#[derive(Clone, Debug, Default)]
pub struct StateBuffer {
    snapshot: Arc<StateSnapshot>,
    /// Values drained (handed to an append batch) during this attempt.
    drained: NameMap<Value>,
    /// Values written since the last drain.
    overlay: NameMap<Value>,
    pending: Vec<StateWrite>,
}

impl StateBuffer {
    /// A buffer over `snapshot` with no writes.
    pub fn new(snapshot: Arc<StateSnapshot>) -> Self {
        Self {
            snapshot,
            drained: NameMap::default(),
            overlay: NameMap::default(),
            pending: Vec::new(),
        }
    }

    /// The current value of `name`: this attempt's latest write, else the snapshot's value.
    pub fn current(&self, name: &str) -> Option<&Value> {
        self.overlay
            .get(name)
            .or_else(|| self.drained.get(name))
            .or_else(|| self.snapshot.get(name))
    }

    /// Buffers a write. Returns `false` (and records nothing) when `value` equals the current
    /// value: one actual change, one record.
    pub fn write(&mut self, name: &str, value: Value) -> bool {
        if self.current(name).is_some_and(|current| same_state(current, &value)) {
            return false;
        }
        self.overlay.insert(name.to_owned(), value.clone());
        self.pending.push(StateWrite {
            name: name.to_owned(),
            value,
        });
        true
    }

    /// Writes not yet drained, in call order.
    pub fn pending(&self) -> &[StateWrite] {
        &self.pending
    }

    /// Takes the writes made since the last drain, in call order, for one append batch.
    ///
    /// The overlay is kept: later reads in the same attempt still see the drained values.
    pub fn drain(&mut self) -> Vec<StateWrite> {
        self.drained.extend(self.overlay.drain());
        std::mem::take(&mut self.pending)
    }

    /// Forgets every undrained write (a tool batch that did not commit), restoring reads to
    /// what was drained before.
    pub fn discard_pending(&mut self) {
        self.overlay.clear();
        self.pending.clear();
    }
}

impl StateView for StateBuffer {
    fn visit(&self, name: &str, visit: &mut dyn FnMut(Option<&Value>)) {
        visit(self.current(name));
    }
}

impl StateView for Mutex<StateBuffer> {
    fn visit(&self, name: &str, visit: &mut dyn FnMut(Option<&Value>)) {
        let buffer = self.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        visit(buffer.current(name));
    }
}

/// Whether a state write of `next` over `current` changes nothing. The reference compares
/// JSON texts (§2.6), where JavaScript's one number type makes `1` and `1.0` the same: here
/// an integer and a float compare as floats too, while two integers compare exactly (a `u64`
/// beyond 2^53 is not rounded into another). Objects compare member by member whatever their
/// order, where the reference's text compare would see reordered members as a change: maps
/// here keep no order to compare (`serde_json` sorts them).
pub fn same_state(current: &Value, next: &Value) -> bool {
    match (current, next) {
        (Value::Number(a), Value::Number(b)) => match (a.as_i64(), b.as_i64(), a.as_u64(), b.as_u64()) {
            (Some(a), Some(b), ..) => a == b,
            (.., Some(a), Some(b)) => a == b,
            _ if (a.is_f64() || b.is_f64()) => a.as_f64() == b.as_f64(),
            _ => false,
        },
        (Value::Array(a), Value::Array(b)) => a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same_state(a, b)),
        (Value::Object(a), Value::Object(b)) => {
            a.len() == b.len() && a.iter().all(|(key, a)| b.get(key).is_some_and(|b| same_state(a, b)))
        }
        _ => current == next,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_write_is_a_no_op_when_its_json_text_would_be_the_same_number_or_member() {
        for (current, next) in [
            (json!(1), json!(1.0)),
            (json!(-2.0), json!(-2)),
            (json!({"a": 1, "b": [2.0, "x"]}), json!({"b": [2, "x"], "a": 1.0})),
            (json!(null), json!(null)),
        ] {
            assert!(same_state(&current, &next), "{current} {next}");
        }
        for (current, next) in [
            (json!(1), json!(1.5)),
            (json!(u64::MAX), json!(u64::MAX - 1)),
            (json!(-1), json!(u64::MAX)),
            (json!({"a": 1}), json!({"a": 1, "b": null})),
            (json!([1]), json!([1, 1])),
            (json!("1"), json!(1)),
        ] {
            assert!(!same_state(&current, &next), "{current} {next}");
        }
    }

    #[test]
    fn a_buffered_write_of_an_equal_number_records_nothing() {
        let mut buffer = StateBuffer::default();
        assert!(buffer.write("count", json!(1)));
        assert!(!buffer.write("count", json!(1.0)));
        assert_eq!(buffer.pending().len(), 1);
    }
}
