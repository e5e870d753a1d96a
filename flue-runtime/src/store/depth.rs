//! How deep stored JSON may nest: the one bound every store keeps, on the way in and on the
//! way out.
//!
//! A store reads its JSON back without serde_json's nesting limit (128 levels; see
//! [`from_stored`]) but refuses text nested deeper than [`MAX_STORED_DEPTH`], whose parse
//! could exhaust the stack. Values that reach that depth can only be built in code (every
//! parse of outside input keeps serde_json's limit): a state value that nests one level
//! deeper each turn, say. So that such a value is refused when it is written, with an error
//! its writer sees, instead of making its stream or its queue unreadable for good, the
//! stores that write text check it ([`storable`]) and the memory store, which keeps values,
//! probes them ([`nests_too_deep`]).

use serde::Serialize;
use serde::ser::{
    self, SerializeMap, SerializeSeq, SerializeStruct, SerializeStructVariant, SerializeTuple, SerializeTupleStruct,
    SerializeTupleVariant,
};

use super::StoreError;

/// The deepest nesting a store writes and reads back.
pub(crate) const MAX_STORED_DEPTH: usize = 512;

/// Parses JSON a store wrote (a batch, a submission row, a user value) without serde_json's
/// nesting limit (128 levels): a value accepted nested deep when it was written (a tool's
/// argument, a state value, initial data), one or two levels deeper once wrapped in its
/// record and batch, would otherwise be unreadable for good, and with it its instance. A
/// parse recurses once per level, with more stack than the serializer that wrote it: text
/// nested deeper than [`MAX_STORED_DEPTH`] (which [`storable`] keeps out) is refused with an
/// error, not parsed until the stack overflows and the process aborts.
pub(crate) fn from_stored<T: serde::de::DeserializeOwned>(text: &str) -> serde_json::Result<T> {
    from_nested(text.as_bytes(), MAX_STORED_DEPTH)
}

/// Parses JSON nested at most `limit` levels (refused with an error past it, before any
/// recursion), without serde_json's own limit of 128: what [`from_stored`] does, for text
/// that wraps stored values in a few levels more (the protocol's frames, read by the client).
pub(crate) fn from_nested<T: serde::de::DeserializeOwned>(text: &[u8], limit: usize) -> serde_json::Result<T> {
    if deeper_than(text, limit) {
        return Err(serde::de::Error::custom(format_args!(
            "the JSON is nested deeper than {limit} levels"
        )));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(text);
    deserializer.disable_recursion_limit();
    let value = T::deserialize(&mut deserializer)?;
    deserializer.end()?;
    Ok(value)
}

/// Refuses JSON text (the `what` a store is about to write) that [`from_stored`] would not
/// read back.
pub(crate) fn storable(text: &[u8], what: &str) -> Result<(), StoreError> {
    if too_deep(text) {
        Err(too_deep_error(what))
    } else {
        Ok(())
    }
}

/// The error of a write refused for its depth.
pub(crate) fn too_deep_error(what: &str) -> StoreError {
    StoreError::Other(format!(
        "not stored: JSON in the {what} nested arrays and objects deeper than {MAX_STORED_DEPTH} levels, \
         deeper than a store reads back"
    ))
}

/// Whether `text` nests deeper than [`MAX_STORED_DEPTH`]. Each level opens a bracket, so text
/// with no more brackets than that (nearly all of it) is answered by a count the compiler
/// vectorizes, without following strings.
fn too_deep(text: &[u8]) -> bool {
    deeper_than(text, MAX_STORED_DEPTH)
}

/// Whether `text` nests deeper than `limit` (see [`too_deep`]).
fn deeper_than(text: &[u8], limit: usize) -> bool {
    text.iter().filter(|&&byte| byte == b'[' || byte == b'{').count() > limit && nesting(text) > limit
}

/// How deep the arrays and objects of the JSON `text` nest (brackets inside strings do not
/// count).
fn nesting(text: &[u8]) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &byte in text {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// Whether `value`, written as serde_json writes it, would nest deeper than
/// [`MAX_STORED_DEPTH`]: a walk that writes nothing and stops at the first level too deep.
/// A value serde cannot write at all is not too deep (its store reports that error itself).
pub(crate) fn nests_too_deep(value: &(impl Serialize + ?Sized)) -> bool {
    nests_deeper_than(value, 0)
}

/// Whether `value` would be written nested deeper than [`MAX_STORED_DEPTH`] once wrapped in
/// `envelope` levels more (a record's, a batch's).
pub(crate) fn nests_deeper_than(value: &(impl Serialize + ?Sized), envelope: usize) -> bool {
    matches!(value.serialize(&mut Probe { depth: envelope }), Err(Stop::TooDeep))
}

/// Walks a value as serde_json would write it, counting its open arrays and objects.
struct Probe {
    depth: usize,
}

/// Why a probe stopped.
#[derive(Debug)]
enum Stop {
    TooDeep,
    /// The value's own serialization failed (a map key serde_json refuses, say).
    Failed,
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::TooDeep => "nested too deep",
            Self::Failed => "not serializable",
        })
    }
}

impl std::error::Error for Stop {}

impl ser::Error for Stop {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Self::Failed
    }
}

impl Probe {
    /// Opens `levels` arrays or objects (an enum variant's object and its content are two).
    fn open(&mut self, levels: usize) -> Result<Level<'_>, Stop> {
        self.depth += levels;
        if self.depth > MAX_STORED_DEPTH {
            return Err(Stop::TooDeep);
        }
        Ok(Level { probe: self, levels })
    }
}

/// The arrays or objects one compound opened, closed by its `end`.
struct Level<'a> {
    probe: &'a mut Probe,
    levels: usize,
}

impl Level<'_> {
    fn element(&mut self, value: &(impl Serialize + ?Sized)) -> Result<(), Stop> {
        value.serialize(&mut *self.probe)
    }

    fn close(self) -> Result<(), Stop> {
        self.probe.depth -= self.levels;
        Ok(())
    }
}

/// A scalar opens nothing.
macro_rules! scalars {
    ($($method:ident($scalar:ty)),* $(,)?) => {$(
        fn $method(self, _: $scalar) -> Result<(), Stop> {
            Ok(())
        }
    )*};
}

impl<'a> ser::Serializer for &'a mut Probe {
    type Ok = ();
    type Error = Stop;
    type SerializeSeq = Level<'a>;
    type SerializeTuple = Level<'a>;
    type SerializeTupleStruct = Level<'a>;
    type SerializeTupleVariant = Level<'a>;
    type SerializeMap = Level<'a>;
    type SerializeStruct = Level<'a>;
    type SerializeStructVariant = Level<'a>;

    scalars!(
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_i128(i128),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_u128(u128),
        serialize_f32(f32),
        serialize_f64(f64),
        serialize_char(char),
        serialize_str(&str),
    );
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Stop> {
        // serde_json writes bytes as an array of numbers.
        self.open(1)?.close()
    }
    fn serialize_none(self) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Stop> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> Result<(), Stop> {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> Result<(), Stop> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        value: &T,
    ) -> Result<(), Stop> {
        // `{"variant": value}`
        let mut level = self.open(1)?;
        level.element(value)?;
        level.close()
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Level<'a>, Stop> {
        self.open(1)
    }
    fn serialize_tuple(self, _: usize) -> Result<Level<'a>, Stop> {
        self.open(1)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Level<'a>, Stop> {
        self.open(1)
    }
    fn serialize_tuple_variant(self, _: &'static str, _: u32, _: &'static str, _: usize) -> Result<Level<'a>, Stop> {
        // `{"variant": [..]}`
        self.open(2)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Level<'a>, Stop> {
        self.open(1)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Level<'a>, Stop> {
        self.open(1)
    }
    fn serialize_struct_variant(self, _: &'static str, _: u32, _: &'static str, _: usize) -> Result<Level<'a>, Stop> {
        // `{"variant": {..}}`
        self.open(2)
    }
    fn collect_str<T: std::fmt::Display + ?Sized>(self, _: &T) -> Result<(), Stop> {
        Ok(())
    }
}

/// The compound serializers: each element, field or entry value is walked; `end` closes.
macro_rules! walked {
    ($($compound:ident :: $method:ident ($($name:ty)?)),* $(,)?) => {$(
        impl $compound for Level<'_> {
            type Ok = ();
            type Error = Stop;
            fn $method<T: Serialize + ?Sized>(&mut self, $(_: $name,)? value: &T) -> Result<(), Stop> {
                self.element(value)
            }
            fn end(self) -> Result<(), Stop> {
                self.close()
            }
        }
    )*};
}

walked!(
    SerializeSeq::serialize_element(),
    SerializeTuple::serialize_element(),
    SerializeTupleStruct::serialize_field(),
    SerializeTupleVariant::serialize_field(),
    SerializeStruct::serialize_field(&'static str),
    SerializeStructVariant::serialize_field(&'static str),
);

impl SerializeMap for Level<'_> {
    type Ok = ();
    type Error = Stop;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, _: &T) -> Result<(), Stop> {
        // serde_json writes every key as a string.
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Stop> {
        self.element(value)
    }
    fn end(self) -> Result<(), Stop> {
        self.close()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests assert by unwrapping
mod tests {
    use serde_json::{Value, json};

    use super::{MAX_STORED_DEPTH, from_stored, nesting, nests_too_deep, storable};

    fn nested(depth: usize) -> String {
        format!("{}\"core\"{}", "[".repeat(depth), "]".repeat(depth))
    }

    /// Past serde_json's 128 levels, up to the store's own limit, a stored value reads back;
    /// deeper, it is refused with an error (its parse would exhaust the stack).
    #[test]
    fn stored_json_reads_back_up_to_its_depth_limit_and_is_refused_past_it() {
        let deep: Value = from_stored(&nested(MAX_STORED_DEPTH)).unwrap();
        assert_eq!(deep.to_string(), nested(MAX_STORED_DEPTH));
        let refused = from_stored::<Value>(&nested(MAX_STORED_DEPTH + 1)).unwrap_err();
        assert!(refused.to_string().contains("nested deeper than 512"), "{refused}");
        assert_eq!(
            nesting(br#"{"a":"[[[{{{\"]]]","b":[1,[2]]}"#),
            3,
            "brackets in strings do not count"
        );
    }

    /// What a store writes it reads back: text or values past the bound are refused before
    /// they are written, and the probe counts levels as the text does.
    #[test]
    fn a_write_is_refused_exactly_where_its_read_would_be() {
        assert!(storable(nested(MAX_STORED_DEPTH).as_bytes(), "value").is_ok());
        let refused = storable(nested(MAX_STORED_DEPTH + 1).as_bytes(), "state value").unwrap_err();
        assert!(
            refused.to_string().contains("JSON in the state value nested"),
            "{refused}"
        );
        // Many brackets inside strings, few levels: stored.
        let bracketed = json!({ "text": "[".repeat(4 * MAX_STORED_DEPTH) }).to_string();
        assert!(storable(bracketed.as_bytes(), "value").is_ok());
        for depth in [MAX_STORED_DEPTH - 1, MAX_STORED_DEPTH, MAX_STORED_DEPTH + 1] {
            let value: Value = from_stored(&nested(depth.min(MAX_STORED_DEPTH))).unwrap();
            let value = if depth > MAX_STORED_DEPTH {
                json!([value])
            } else {
                value
            };
            let text = value.to_string();
            assert_eq!(
                nests_too_deep(&value),
                nesting(text.as_bytes()) > MAX_STORED_DEPTH,
                "{depth}"
            );
        }
        // Enum variants and structs count as serde_json writes them.
        #[derive(serde::Serialize)]
        enum Shape {
            Struct { inner: Value },
            Tuple(Value, Value),
            Newtype(Value),
        }
        let inner: Value = from_stored(&nested(MAX_STORED_DEPTH - 2)).unwrap();
        for shape in [
            Shape::Struct { inner: inner.clone() },
            Shape::Tuple(inner.clone(), Value::Null),
        ] {
            let text = serde_json::to_string(&shape).unwrap();
            assert_eq!(nesting(text.as_bytes()), MAX_STORED_DEPTH);
            assert!(!nests_too_deep(&shape));
            assert!(nests_too_deep(&[shape]));
        }
        let newtype = Shape::Newtype(json!([inner]));
        assert_eq!(
            nesting(serde_json::to_string(&newtype).unwrap().as_bytes()),
            MAX_STORED_DEPTH
        );
        assert!(!nests_too_deep(&newtype));
        assert!(nests_too_deep(&Some(vec![newtype])));
    }
}
