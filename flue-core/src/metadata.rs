//! Response metadata: the object `use_response_start` / `use_response_finish` callbacks
//! contribute to, and its deep merge.

use serde_json::{Map, Value};

/// Response metadata: a JSON object.
pub type Metadata = Map<String, Value>;

/// Keys that are dropped wherever they appear (prototype-polluting names in the reference).
const DROPPED_KEYS: [&str; 3] = ["__proto__", "constructor", "prototype"];

/// Deep-merges `patch` onto `base`, in the reference's rules:
///
/// - later keys win;
/// - absent values are skipped: a `null` (what `None` serializes to) never overwrites;
/// - when both sides hold an object, they merge recursively;
/// - `__proto__`, `constructor` and `prototype` keys are dropped at every depth.
pub fn merge_metadata(base: &mut Metadata, patch: Metadata) {
    for (key, value) in patch {
        if value.is_null() || DROPPED_KEYS.contains(&key.as_str()) {
            continue;
        }
        match (base.get_mut(&key), value) {
            (Some(Value::Object(existing)), Value::Object(incoming)) => merge_metadata(existing, incoming),
            (_, value) => {
                base.insert(key, sanitize(value));
            }
        }
    }
}

/// `patch` as [`merge_metadata`] would apply it: without its `null` members and polluting keys,
/// at every depth. A client that merges `null` as a value (the reference's SDK does) and is
/// sent this instead of `patch` holds what the merge made.
pub fn applied_part(patch: &Metadata) -> Metadata {
    let mut applied = Metadata::new();
    merge_metadata(&mut applied, patch.clone());
    applied
}

/// Drops the polluting keys and `null` members from objects nested in a value placed whole.
fn sanitize(value: Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .filter(|(key, value)| !value.is_null() && !DROPPED_KEYS.contains(&key.as_str()))
                .map(|(key, value)| (key, sanitize(value)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(sanitize).collect()),
        other => other,
    }
}
