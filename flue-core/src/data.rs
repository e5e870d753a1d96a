//! JSON Schemas for typed values: tool arguments and data parts.
//!
//! Schemas come from schemars and are generated once per type and cached, so the render path
//! only ever copies a function pointer.

use std::any::TypeId;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, OnceLock, RwLock};

use schemars::JsonSchema;
use serde_json::Value;

/// A compiled JSON Schema: the document plus its validator. Cheap to clone (one reference
/// count).
#[derive(Clone)]
pub struct DataSchema(Arc<Compiled>);

struct Compiled {
    json: Arc<Value>,
    validator: jsonschema::Validator,
    /// Whether the root is `"type": "object"` (what a tool's arguments must be), decided once.
    object_root: bool,
}

impl DataSchema {
    /// Compiles `json` (draft 2020-12 unless it says otherwise).
    pub fn new(json: Value) -> Result<Self, SchemaError> {
        let validator = jsonschema::validator_for(&json).map_err(|error| SchemaError(error.to_string()))?;
        let object_root = json.get("type").and_then(Value::as_str) == Some("object");
        Ok(Self(Arc::new(Compiled {
            json: Arc::new(json),
            validator,
            object_root,
        })))
    }

    /// The schema document.
    pub fn json(&self) -> &Value {
        &self.0.json
    }

    /// The schema as JSON, shared (a reference count, not a copy).
    pub fn shared_json(&self) -> Arc<Value> {
        self.0.json.clone()
    }

    /// Whether the root is an object schema (`"type": "object"`).
    pub fn has_object_root(&self) -> bool {
        self.0.object_root
    }

    /// Validates `instance`; on failure returns every issue as `"<path>: <message>"` (`root`
    /// for the top level), in document order.
    pub fn validate(&self, instance: &Value) -> Result<(), Vec<String>> {
        let issues: Vec<String> = self
            .0
            .validator
            .iter_errors(instance)
            .map(|error| {
                let path = error.instance_path().to_string();
                let path = if path.is_empty() { "root".to_owned() } else { path };
                format!("{path}: {error}")
            })
            .collect();
        if issues.is_empty() { Ok(()) } else { Err(issues) }
    }
}

impl fmt::Debug for DataSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DataSchema").field(&self.0.json).finish()
    }
}

/// A schema document that does not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON Schema: {0}")]
pub struct SchemaError(String);

/// Where a declaration's schema comes from: a type (generated lazily, cached) or a document.
#[derive(Clone)]
pub enum SchemaSource {
    /// Generated from a Rust type on first use.
    Typed(fn() -> DataSchema),
    /// Given as a compiled document.
    Given(DataSchema),
}

impl SchemaSource {
    /// The schema of `T`.
    pub fn of<T: JsonSchema + 'static>() -> Self {
        Self::Typed(schema_of::<T>)
    }

    /// The schema of `T`'s values as they serialize (see [`serialized_schema_of`]).
    pub fn serialized<T: JsonSchema + 'static>() -> Self {
        Self::Typed(serialized_schema_of::<T>)
    }

    /// Resolves the schema (generating it on first use for typed sources).
    pub fn get(&self) -> DataSchema {
        match self {
            Self::Typed(generate) => generate(),
            Self::Given(schema) => schema.clone(),
        }
    }
}

impl fmt::Debug for SchemaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Typed(_) => f.write_str("SchemaSource::Typed"),
            Self::Given(schema) => f.debug_tuple("SchemaSource::Given").field(schema).finish(),
        }
    }
}

/// Keyed by type: the keys are no input an attacker chooses, and a `TypeId` is already a hash,
/// so mixing its bits is enough (the render path looks a tool's schema up on every render).
type Cache = RwLock<HashMap<(TypeId, Purpose), DataSchema, BuildHasherDefault<TypeKeyHasher>>>;

/// Mixes the words a `(TypeId, Purpose)` key writes (multiply-rotate, as FxHash does).
#[derive(Default)]
struct TypeKeyHasher(u64);

impl Hasher for TypeKeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Purpose {
    Data,
    Written,
    ToolInput,
}

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(Cache::default)
}

fn cached<T: JsonSchema + 'static>(purpose: Purpose, build: impl FnOnce() -> Value) -> DataSchema {
    let key = (TypeId::of::<T>(), purpose);
    if let Some(schema) = cache().read().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return schema.clone();
    }
    let json = build();
    let schema = match DataSchema::new(json) {
        Ok(schema) => schema,
        // schemars output always compiles; keep the document so the failure is visible.
        Err(error) => panic!(
            "[flue] schemars produced a schema that does not compile for {}: {error}",
            T::schema_name()
        ),
    };
    cache()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_insert(schema)
        .clone()
}

/// The JSON Schema of `T` as schemars generates it (draft 2020-12), compiled and cached.
pub fn schema_of<T: JsonSchema + 'static>() -> DataSchema {
    cached::<T>(Purpose::Data, || schemars::schema_for!(T).to_value())
}

/// The JSON Schema of `T` as its values serialize (draft 2020-12), compiled and cached: what a
/// value written as JSON is checked against. It differs from [`schema_of`] (how JSON reads
/// back into `T`) where serde's attributes do: a field skipped when empty
/// (`skip_serializing_if`) is optional here, a `skip_serializing` one absent, a field renamed
/// for serializing named so.
pub fn serialized_schema_of<T: JsonSchema + 'static>() -> DataSchema {
    cached::<T>(Purpose::Written, || {
        schemars::generate::SchemaSettings::draft2020_12()
            .for_serialize()
            .into_generator()
            .into_root_schema_for::<T>()
            .to_value()
    })
}

/// The JSON Schema of a tool's argument type `T`, in the shape providers expect: draft
/// 2020-12, no top-level `title` (nor `$schema`), no combinator at the root
/// ([`declarable_tool_schema`]: an argument type that flattens an enum, or is one), compiled
/// and cached. What the combinators said beyond their properties, serde checks as it reads the
/// arguments (a mismatch is the call's error result, and the tool does not run).
///
/// Whether the root is an object is checked where tools are defined
/// ([`crate::tool::ToolDefinition::validate_input_schema`]).
pub fn tool_input_schema_of<T: JsonSchema + 'static>() -> DataSchema {
    cached::<T>(Purpose::ToolInput, || {
        let mut json = schemars::schema_for!(T).to_value();
        inline_root_ref(&mut json);
        if let Value::Object(map) = &mut json {
            // After the inlining: a wrapped type's definition may have a title of its own.
            map.remove("title");
            map.remove("$schema");
            // A Rust type's schema takes a few hundred steps; one past the budget (none
            // compiles in practice) is declared with its root's properties alone, and serde
            // still checks what its variants say.
            let _ = declarable_tool_schema(map);
        }
        json
    })
}

/// What providers refuse at the root of a tool's input schema: Anthropic and OpenAI answer 400
/// to every request declaring one.
pub const ROOT_KEYWORDS_REFUSED: [&str; 5] = ["anyOf", "oneOf", "allOf", "not", "enum"];

/// How much of a schema [`declarable_tool_schema`] reads at most: the schemas (branches,
/// referenced definitions) it visits and the property descriptions it takes in, together. The
/// work of following every branch and reference grows with the product of their counts at each
/// level, so a small schema (a few kilobytes of choices among references to more choices)
/// could otherwise take hours; a schema generated from a Rust type needs a few hundred.
pub const DECLARABLE_SCHEMA_BUDGET: usize = 20_000;

/// How many distinct descriptions of one property [`declarable_tool_schema`] collects from the
/// branches; a property described in more ways is declared as any value (what the branches
/// said is checked when the arguments are read).
const MAX_DESCRIPTIONS: usize = 16;

/// A schema [`declarable_tool_schema`] would read past [`DECLARABLE_SCHEMA_BUDGET`] for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("its choices and references would take more than {DECLARABLE_SCHEMA_BUDGET} steps to read")]
pub struct TooIntricate;

/// Brings a tool's input schema to the shape providers take, in place: an object (the reference
/// reads a schema without `type` as one) with `properties`, and without
/// [`ROOT_KEYWORDS_REFUSED`] at its root. The properties of the combinators' branches become the
/// root's, read through the branches' references to `$defs` and their own combinators (an enum
/// whose variants wrap structs, a struct flattening two enums); a property the root does not
/// describe, and the branches describe differently, is any of their descriptions (any value
/// past a few). Required are the properties every `allOf` branch requires, and those all the
/// branches of an `anyOf` or `oneOf` require. What else the combinators said is checked when
/// the arguments are read (a local tool's by serde, an MCP tool's by its server).
///
/// A schema that would take more than [`DECLARABLE_SCHEMA_BUDGET`] steps to read is
/// [`TooIntricate`]: its root's combinators are removed all the same, and what their branches
/// said of its properties is left out.
pub fn declarable_tool_schema(schema: &mut serde_json::Map<String, Value>) -> Result<(), TooIntricate> {
    let combined: serde_json::Map<String, Value> = ROOT_KEYWORDS_REFUSED
        .iter()
        .filter_map(|keyword| Some(((*keyword).to_owned(), schema.remove(*keyword)?)))
        .collect();
    let kind = schema.entry("type").or_insert_with(|| Value::from("object"));
    if kind != "object" {
        return Ok(());
    }
    let mut budget = DECLARABLE_SCHEMA_BUDGET;
    let shape = {
        let defs = schema.get("$defs").unwrap_or(&Value::Null);
        Shape::of(&Value::Object(combined), defs, 0, &mut budget).ok_or(TooIntricate)?
    };
    let Value::Object(root) = schema
        .entry("properties")
        .or_insert_with(|| Value::Object(serde_json::Map::new()))
    else {
        return Ok(());
    };
    for (name, described) in shape.properties {
        if root.contains_key(&name) {
            continue;
        }
        let property = match described {
            Described::Any => Value::Object(serde_json::Map::new()),
            Described::As(mut schemas) if schemas.len() == 1 => schemas.remove(0),
            Described::As(schemas) => serde_json::json!({ "anyOf": schemas }),
        };
        root.insert(name, property);
    }
    if !shape.required.is_empty() {
        let root = schema.entry("required").or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(root) = root {
            for name in shape.required {
                let name = Value::String(name);
                if !root.contains(&name) {
                    root.push(name);
                }
            }
        }
    }
    Ok(())
}

/// How the branches describe a property.
enum Described {
    /// In these ways (distinct).
    As(Vec<Value>),
    /// In more ways than [`MAX_DESCRIPTIONS`]: any value.
    Any,
}

/// What a schema (a combinator's branch) says of an object's properties: each property with
/// its descriptions, and the properties it requires (each in the order first met).
#[derive(Default)]
struct Shape {
    properties: Vec<(String, Described)>,
    /// Where each property is in `properties`.
    positions: std::collections::HashMap<String, usize>,
    required: Vec<String>,
    required_names: std::collections::HashSet<String>,
}

impl Shape {
    /// The shape of `schema`: its own properties, those of the `$defs` entry it references
    /// (`defs`), and those of its combinators' branches (`allOf`'s all required, `anyOf`'s and
    /// `oneOf`'s required by every branch); `depth` bounds a chain of references. `None` once
    /// `budget` (each schema visited, each property description taken in) runs out.
    fn of(schema: &Value, defs: &Value, depth: usize, budget: &mut usize) -> Option<Self> {
        // Every schema visited spends, what it says nothing of (`true`, past the depth) too:
        // a choice of thousands of such branches, referred to again and again, is work.
        spend(budget, 1)?;
        let mut shape = Self::default();
        let Value::Object(schema) = schema else {
            return Some(shape);
        };
        if depth > 8 {
            return Some(shape);
        }
        for (name, property) in schema
            .get("properties")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            spend(budget, 1)?;
            shape.describe(name, property);
        }
        let required = schema.get("required").and_then(Value::as_array);
        spend(budget, required.map_or(0, Vec::len))?;
        shape.require(
            required
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(str::to_owned),
        );
        if let Some(name) = schema.get("$ref").and_then(Value::as_str).and_then(definition_name)
            && let Some(definition) = defs.get(&name)
        {
            let referenced = Self::of(definition, defs, depth + 1, budget)?;
            shape.merge(referenced, true, budget)?;
        }
        for keyword in ["allOf", "anyOf", "oneOf"] {
            let mut branches = Vec::new();
            for branch in schema.get(keyword).and_then(Value::as_array).into_iter().flatten() {
                branches.push(Self::of(branch, defs, depth + 1, budget)?);
            }
            if keyword == "allOf" {
                for branch in branches {
                    shape.merge(branch, true, budget)?;
                }
                continue;
            }
            let required: Vec<String> = match branches.split_first() {
                Some((first, rest)) => first
                    .required
                    .iter()
                    .filter(|name| rest.iter().all(|branch| branch.required_names.contains(*name)))
                    .cloned()
                    .collect(),
                None => Vec::new(),
            };
            for branch in branches {
                shape.merge(branch, false, budget)?;
            }
            shape.require(required);
        }
        Some(shape)
    }

    fn describe(&mut self, name: &str, property: &Value) {
        let Some(&position) = self.positions.get(name) else {
            self.positions.insert(name.to_owned(), self.properties.len());
            self.properties
                .push((name.to_owned(), Described::As(vec![property.clone()])));
            return;
        };
        let described = &mut self.properties[position].1;
        if let Described::As(schemas) = described
            && !schemas.contains(property)
        {
            if schemas.len() == MAX_DESCRIPTIONS {
                *described = Described::Any;
            } else {
                schemas.push(property.clone());
            }
        }
    }

    fn describe_any(&mut self, name: &str) {
        match self.positions.get(name) {
            Some(&position) => self.properties[position].1 = Described::Any,
            None => {
                self.positions.insert(name.to_owned(), self.properties.len());
                self.properties.push((name.to_owned(), Described::Any));
            }
        }
    }

    fn require(&mut self, names: impl IntoIterator<Item = String>) {
        for name in names {
            if self.required_names.insert(name.clone()) {
                self.required.push(name);
            }
        }
    }

    /// Takes in `other`'s properties, and its required ones too when `required`; `None` once
    /// `budget` runs out (each description taken in spends one).
    fn merge(&mut self, other: Self, required: bool, budget: &mut usize) -> Option<()> {
        for (name, described) in other.properties {
            match described {
                Described::As(schemas) => {
                    spend(budget, schemas.len())?;
                    for property in &schemas {
                        self.describe(&name, property);
                    }
                }
                Described::Any => {
                    spend(budget, 1)?;
                    self.describe_any(&name);
                }
            }
        }
        if required {
            spend(budget, other.required.len())?;
            self.require(other.required);
        }
        Some(())
    }
}

/// Takes `steps` from `budget`; `None` when it has fewer.
fn spend(budget: &mut usize, steps: usize) -> Option<()> {
    *budget = budget.checked_sub(steps)?;
    Some(())
}

/// The `$defs` entry a local reference (`#/$defs/<name>`) names: schemars writes it as a URI
/// fragment (percent-encoded past URL-safe characters: a renamed or non-ASCII type's name) of
/// a JSON pointer (`~1` for `/`, `~0` for `~`).
pub(crate) fn definition_name(reference: &str) -> Option<String> {
    let name = fragment_decoded(reference.strip_prefix("#/$defs/")?)?;
    Some(name.replace("~1", "/").replace("~0", "~"))
}

/// A URI fragment's text, its `%XX` escapes decoded (`None` when they are not UTF-8).
pub(crate) fn fragment_decoded(fragment: &str) -> Option<String> {
    if !fragment.contains('%') {
        return Some(fragment.to_owned());
    }
    let bytes = fragment.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let escaped = (bytes[at] == b'%')
            .then(|| fragment.get(at + 1..at + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                decoded.push(byte);
                at += 3;
            }
            None => {
                decoded.push(bytes[at]);
                at += 1;
            }
        }
    }
    String::from_utf8(decoded).ok()
}

/// Puts the definition a root `$ref` names at the root: schemars describes a newtype (or a
/// transparent wrapper) as a reference to the type it wraps, and providers read the root's
/// `type` (an object, for a tool's arguments). The root's own keywords (its description) stay;
/// the definition stays in `$defs` (other references may name it). A chain of wrappers is
/// followed, a few links at most.
fn inline_root_ref(json: &mut Value) {
    for _ in 0..8 {
        let Value::Object(root) = json else { return };
        if root.contains_key("type") {
            return;
        }
        let Some(name) = root.get("$ref").and_then(Value::as_str).and_then(definition_name) else {
            return;
        };
        let Some(Value::Object(definition)) = root.get("$defs").and_then(|defs| defs.get(&name)).cloned() else {
            return;
        };
        root.remove("$ref");
        for (keyword, value) in definition {
            if keyword != "$defs" {
                root.entry(keyword).or_insert(value);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tool_input_tests {
    use serde_json::json;

    use super::*;

    /// What a newtype's arguments are.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[allow(dead_code)] // read through the schema only
    struct Inner {
        /// The city.
        city: String,
    }

    /// The arguments, wrapped.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[allow(dead_code)]
    struct Wrapped(Inner);

    /// Arguments whose schema name schemars percent-encodes in references.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[serde(rename = "Öffnen args")]
    #[allow(dead_code)]
    struct Renamed {
        /// The door.
        door: String,
    }

    /// The renamed arguments, wrapped.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[allow(dead_code)]
    struct WrappedRenamed(Renamed);

    /// A choice whose variants are the renamed arguments.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[serde(untagged)]
    #[allow(dead_code)]
    enum Choice {
        Renamed(Renamed),
        Other { other: u32 },
    }

    /// A reference to a definition whose name needs escaping in a URI is followed: the
    /// wrapper's root is the definition's object, and a variant's fields are declared.
    #[test]
    fn a_percent_encoded_reference_is_followed() {
        assert_eq!(
            definition_name("#/$defs/%C3%96ffnen%20args"),
            Some("Öffnen args".to_owned())
        );
        assert_eq!(definition_name("#/$defs/a~1b~0c"), Some("a/b~c".to_owned()));
        let wrapped = tool_input_schema_of::<WrappedRenamed>();
        assert!(wrapped.has_object_root(), "{}", wrapped.json());
        assert!(wrapped.json()["properties"]["door"].is_object(), "{}", wrapped.json());
        let choice = tool_input_schema_of::<Choice>();
        assert!(choice.json()["properties"]["door"].is_object(), "{}", choice.json());
        assert!(choice.json()["properties"]["other"].is_object(), "{}", choice.json());
    }

    /// The arguments, transparent.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[serde(transparent)]
    #[allow(dead_code)]
    struct Transparent {
        inner: Wrapped,
    }

    /// The arguments of a tool whose arguments flatten an enum (a choice of a few shapes).
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[allow(dead_code)]
    struct Search {
        /// How many results.
        limit: u32,
        #[serde(flatten)]
        by: By,
    }

    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[serde(tag = "kind", rename_all = "snake_case")]
    #[allow(dead_code)]
    enum By {
        Name { name: String },
        Id { id: u64 },
    }

    /// Arguments that are an enum themselves.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[serde(tag = "action", rename_all = "snake_case")]
    #[allow(dead_code)]
    enum Action {
        Open { path: String },
        Close { path: String, force: bool },
    }

    /// Arguments whose variants wrap structs of their own.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[serde(tag = "action", rename_all = "snake_case")]
    #[allow(dead_code)]
    enum Wrapping {
        Open(OpenArgs),
        Close(CloseArgs),
    }

    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[allow(dead_code)]
    struct OpenArgs {
        path: String,
    }

    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[allow(dead_code)]
    struct CloseArgs {
        path: String,
        force: bool,
    }

    /// Arguments flattening two enums.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[allow(dead_code)]
    struct TwoChoices {
        #[serde(flatten)]
        by: By,
        #[serde(flatten)]
        order: Order,
    }

    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[serde(tag = "order", rename_all = "snake_case")]
    #[allow(dead_code)]
    enum Order {
        Newest,
        Ranked { min_score: f64 },
    }

    /// # Issue reference
    ///
    /// A titled definition.
    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[allow(dead_code)]
    struct Titled {
        number: u32,
    }

    #[derive(schemars::JsonSchema, serde::Deserialize)]
    #[allow(dead_code)]
    struct WrapsTitled(Titled);

    /// An argument type that flattens an enum, or is one, has its variants' fields as the
    /// root's properties (a field the variants describe differently, any of them), requires
    /// what every variant requires, and has no combinator at its root, which providers refuse.
    #[test]
    fn a_tools_arguments_with_a_choice_of_shapes_have_no_combinator_at_the_root() {
        let search = tool_input_schema_of::<Search>();
        let json = search.json();
        for keyword in ROOT_KEYWORDS_REFUSED {
            assert_eq!(json.get(keyword), None, "{json}");
        }
        assert!(search.has_object_root(), "{json}");
        assert_eq!(json["properties"]["limit"]["type"], "integer", "{json}");
        assert_eq!(json["properties"]["name"]["type"], "string", "{json}");
        assert_eq!(json["properties"]["id"]["type"], "integer", "{json}");
        // The tag: each variant's own value, any of them.
        let kinds = json["properties"]["kind"]["anyOf"].as_array().expect("any of the tags");
        assert_eq!(kinds.len(), 2, "{json}");
        let required = json["required"].as_array().unwrap();
        assert!(
            required.contains(&json!("limit")) && required.contains(&json!("kind")),
            "{json}"
        );
        assert!(!required.contains(&json!("name")), "{json}");
        assert!(search.validate(&json!({"limit": 3, "kind": "id", "id": 7})).is_ok());
        assert!(
            search
                .validate(&json!({"limit": 3, "kind": "name", "name": "x"}))
                .is_ok()
        );
        let action = tool_input_schema_of::<Action>();
        let json = action.json();
        assert!(action.has_object_root(), "{json}");
        assert_eq!(json.get("oneOf"), None, "{json}");
        let required = json["required"].as_array().unwrap();
        assert!(
            required.contains(&json!("action")) && required.contains(&json!("path")),
            "{json}"
        );
        assert!(!required.contains(&json!("force")), "{json}");
    }

    /// Variants that wrap structs, and two flattened enums: their fields, read through the
    /// references and nested branches, are the root's properties.
    #[test]
    fn fields_behind_references_and_nested_choices_are_declared_too() {
        let wrapping = tool_input_schema_of::<Wrapping>();
        let json = wrapping.json();
        assert!(wrapping.has_object_root(), "{json}");
        assert_eq!(json["properties"]["path"]["type"], "string", "{json}");
        assert_eq!(json["properties"]["force"]["type"], "boolean", "{json}");
        let required = json["required"].as_array().unwrap();
        assert!(
            required.contains(&json!("action")) && required.contains(&json!("path")),
            "{json}"
        );
        assert!(!required.contains(&json!("force")), "{json}");
        let two = tool_input_schema_of::<TwoChoices>();
        let json = two.json();
        for keyword in ROOT_KEYWORDS_REFUSED {
            assert_eq!(json.get(keyword), None, "{json}");
        }
        for field in ["kind", "name", "id", "order", "min_score"] {
            assert!(json["properties"].get(field).is_some(), "{field}: {json}");
        }
        let required = json["required"].as_array().unwrap();
        assert!(
            required.contains(&json!("kind")) && required.contains(&json!("order")),
            "{json}"
        );
        assert!(
            two.validate(&json!({"kind": "id", "id": 1, "order": "ranked", "min_score": 0.5}))
                .is_ok()
        );
    }

    /// No top-level title, even where a wrapped type's definition has one.
    #[test]
    fn a_wrapped_types_title_does_not_come_back_at_the_root() {
        let json = tool_input_schema_of::<WrapsTitled>().json().clone();
        assert_eq!(json.get("title"), None, "{json}");
        assert_eq!(json["properties"]["number"]["type"], "integer", "{json}");
    }

    /// A newtype (or a transparent wrapper) around an object reads an object: its schema is
    /// the object's, at the root, as providers require (`type: object`), not a `$ref` to it.
    #[test]
    fn a_wrapper_around_an_object_has_the_objects_schema_at_its_root() {
        for schema in [tool_input_schema_of::<Wrapped>(), tool_input_schema_of::<Transparent>()] {
            let json = schema.json();
            assert!(schema.has_object_root(), "{json}");
            assert_eq!(json["properties"]["city"]["type"], "string", "{json}");
            assert_eq!(json.get("$ref"), None, "{json}");
            assert!(schema.validate(&json!({"city": "Paris"})).is_ok());
            assert!(schema.validate(&json!({"city": 3})).is_err());
        }
    }
}
