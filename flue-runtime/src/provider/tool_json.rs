//! Tool declarations encoded once: every model call carries every tool of the render, and a
//! tool's name, description and schema do not change between calls (a static tool's never
//! do). A provider keeps one [`ToolJson`] per wire format and splices the cached text into
//! each request body instead of escaping the descriptions and walking the schemas again.

use std::sync::{Arc, Mutex, Weak};

use serde_json::Value;
use serde_json::value::RawValue;

use super::ToolSpec;

/// How many declarations a cache keeps before it drops those whose schema is gone (tools
/// built per call, such as an MCP server's, come and go).
const PRUNE_AT: usize = 256;

/// Encoded tool declarations of one wire format, shared by a provider's clones.
#[derive(Clone, Default)]
pub(crate) struct ToolJson(Arc<Mutex<Vec<Entry>>>);

struct Entry {
    /// The schema the declaration was encoded from. Held weakly: while the entry lives, the
    /// schema's allocation cannot be reused for another value, so an equal address is the
    /// same schema.
    schema: Weak<Value>,
    name: String,
    description: String,
    json: Arc<RawValue>,
}

impl ToolJson {
    /// The declarations of `tools`, in order, each encoded with `encode` the first time it is
    /// seen (again when its name or description changed).
    pub(crate) fn declarations(
        &self,
        tools: &[ToolSpec],
        encode: impl Fn(&ToolSpec) -> serde_json::Result<Box<RawValue>>,
    ) -> serde_json::Result<Declarations> {
        let mut entries = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tools
            .iter()
            .map(|tool| {
                let known = entries.iter().find(|entry| {
                    std::ptr::eq(entry.schema.as_ptr(), Arc::as_ptr(&tool.parameters))
                        && entry.name == tool.name
                        && entry.description == tool.description
                });
                if let Some(entry) = known {
                    return Ok(entry.json.clone());
                }
                let json: Arc<RawValue> = encode(tool)?.into();
                if entries.len() >= PRUNE_AT {
                    entries.retain(|entry| entry.schema.strong_count() > 0);
                    if entries.len() >= PRUNE_AT {
                        entries.clear();
                    }
                }
                entries.push(Entry {
                    schema: Arc::downgrade(&tool.parameters),
                    name: tool.name.to_string(),
                    description: tool.description.to_string(),
                    json: json.clone(),
                });
                Ok(json)
            })
            .collect::<serde_json::Result<_>>()
            .map(Declarations)
    }
}

/// The encoded declarations of one request's tools: serialized as a JSON array of them.
pub(crate) struct Declarations(Vec<Arc<RawValue>>);

impl Declarations {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The declarations' encoded length in bytes, without the array's brackets and commas.
    pub(crate) fn encoded_len(&self) -> usize {
        self.0.iter().map(|json| json.get().len()).sum()
    }
}

impl serde::Serialize for Declarations {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|json| &**json))
    }
}

impl std::fmt::Debug for ToolJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ToolJson")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::json;

    use super::*;

    fn spec(name: &'static str, description: &str, parameters: &Arc<Value>) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: description.to_owned().into(),
            parameters: parameters.clone(),
        }
    }

    fn counting(encoded: &AtomicUsize) -> impl Fn(&ToolSpec) -> serde_json::Result<Box<RawValue>> + '_ {
        move |tool| {
            encoded.fetch_add(1, Ordering::SeqCst);
            serde_json::value::to_raw_value(&json!({"name": tool.name, "schema": *tool.parameters}))
        }
    }

    #[test]
    fn a_tool_is_encoded_once_and_its_text_reused() {
        let cache = ToolJson::default();
        let encoded = AtomicUsize::new(0);
        let schema = Arc::new(json!({"type": "object"}));
        let tools = [spec("add", "Adds.", &schema)];
        let first = cache.declarations(&tools, counting(&encoded)).unwrap();
        let second = cache.declarations(&tools, counting(&encoded)).unwrap();
        assert_eq!(encoded.load(Ordering::SeqCst), 1);
        assert_eq!(first.0[0].get(), r#"{"name":"add","schema":{"type":"object"}}"#);
        assert!(Arc::ptr_eq(&first.0[0], &second.0[0]));
        assert_eq!(
            serde_json::to_string(&second).unwrap(),
            r#"[{"name":"add","schema":{"type":"object"}}]"#
        );
    }

    #[test]
    fn a_changed_description_or_an_equal_but_different_schema_is_encoded_again() {
        let cache = ToolJson::default();
        let encoded = AtomicUsize::new(0);
        let schema = Arc::new(json!({"type": "object"}));
        cache
            .declarations(&[spec("add", "Adds.", &schema)], counting(&encoded))
            .unwrap();
        cache
            .declarations(&[spec("add", "Adds two numbers.", &schema)], counting(&encoded))
            .unwrap();
        let other = Arc::new(json!({"type": "object"}));
        cache
            .declarations(&[spec("add", "Adds.", &other)], counting(&encoded))
            .unwrap();
        assert_eq!(encoded.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn declarations_keep_the_order_of_the_tools() {
        let cache = ToolJson::default();
        let encoded = AtomicUsize::new(0);
        let (a, b) = (Arc::new(json!({"a": 1})), Arc::new(json!({"b": 2})));
        let tools = [spec("b", "", &b), spec("a", "", &a)];
        cache.declarations(&tools, counting(&encoded)).unwrap();
        let again = cache.declarations(&tools, counting(&encoded)).unwrap();
        let names: Vec<&str> = again.0.iter().map(|raw| raw.get()).collect();
        assert_eq!(
            names,
            [r#"{"name":"b","schema":{"b":2}}"#, r#"{"name":"a","schema":{"a":1}}"#]
        );
    }

    #[test]
    fn tools_that_come_and_go_do_not_grow_the_cache_without_bound() {
        let cache = ToolJson::default();
        let encoded = AtomicUsize::new(0);
        for i in 0..(PRUNE_AT * 3) {
            let schema = Arc::new(json!({"i": i}));
            cache
                .declarations(&[spec("t", "", &schema)], counting(&encoded))
                .unwrap();
        }
        assert!(cache.0.lock().unwrap().len() <= PRUNE_AT);
    }
}
