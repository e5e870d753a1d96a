use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use schemars::JsonSchema;
use serde::Serialize;
use serde_json::Value;

use super::{hook, root_only, violation};
use crate::binding::{DataWriteError, RuntimeBinding};
use crate::data::{DataSchema, SchemaSource};
use crate::render::{DataWriterDeclaration, Frame, is_rendering};

/// Declares the client-facing data part `name` (`data-<name>` on the wire) and returns its
/// writer. Every write is checked against `T`'s JSON Schema, appended durably and streamed.
///
/// Data-writer names are the response's identity: declare them unconditionally, identically
/// on every render (a different set fails the next render). Panics on an empty or duplicate
/// name in one render and in subagent renders.
#[track_caller]
pub fn use_data_writer<T>(name: impl Into<Cow<'static, str>>) -> DataWriter<T>
where
    T: Serialize + JsonSchema + 'static,
{
    // Writes serialize `T`: they are checked against the schema of what serializing makes.
    declare(name.into(), SchemaSource::serialized::<T>())
}

/// [`use_data_writer`] for untyped JSON checked against an explicit schema.
#[track_caller]
pub fn use_data_writer_with_schema(name: impl Into<Cow<'static, str>>, schema: &DataSchema) -> DataWriter<Value> {
    declare(name.into(), SchemaSource::Given(schema.clone()))
}

#[track_caller]
fn declare<T>(name: Cow<'static, str>, schema: SchemaSource) -> DataWriter<T> {
    hook("use_data_writer", |frame: &Frame<'_>| {
        root_only(
            frame,
            "[flue] use_data_writer() is not available in a subagent render. Data parts stream to the agent's public conversation; delegates run detached tasks with no client-facing output. Return what the delegate produced as its task result instead.",
        )?;
        if name.is_empty() {
            return Err(
                "[flue] use_data_writer(name) takes the data part name as its first argument — a non-empty string."
                    .to_owned(),
            );
        }
        let mut rec = frame.rec.borrow_mut();
        if rec.data_writers.iter().any(|declared| declared.name == name) {
            return Err(format!(
                "[flue] Duplicate use_data_writer name \"{name}\" in one render. Data part names identify a part within the response and must be unique."
            ));
        }
        rec.data_writers.push(DataWriterDeclaration {
            name: name.clone(),
            schema: Some(schema.clone()),
        });
        Ok(DataWriter {
            name,
            schema,
            binding: frame.state.binding().cloned(),
            _data: PhantomData,
        })
    })
}

/// Writes one data part. `Clone + Send + 'static`; resolves the current attempt when called.
pub struct DataWriter<T> {
    name: Cow<'static, str>,
    schema: SchemaSource,
    binding: Option<Arc<dyn RuntimeBinding>>,
    _data: PhantomData<fn(&T)>,
}

impl<T> Clone for DataWriter<T> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            schema: self.schema.clone(),
            binding: self.binding.clone(),
            _data: PhantomData,
        }
    }
}

impl<T: Serialize> DataWriter<T> {
    /// The part name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Writes `data`: the first write places the part, later writes update it in place.
    ///
    /// Panics during a render. Fails on a bare render, when the instance is not responding,
    /// when `data` does not serialize, and when it does not match the schema.
    #[track_caller]
    pub fn write(&self, data: &T) -> Result<(), DataWriteError> {
        if is_rendering() {
            violation(format!(
                "[flue] Message data \"{}\" was written during render. Renders are pure reads — write from tool run functions and other callbacks that run while the agent is responding.",
                self.name
            ));
        }
        let name = || self.name.to_string();
        let binding = self
            .binding
            .as_ref()
            .ok_or_else(|| DataWriteError::NoRuntime { name: name() })?;
        let value = serde_json::to_value(data).map_err(|error| DataWriteError::NotJson {
            name: name(),
            reason: error.to_string(),
        })?;
        self.schema
            .get()
            .validate(&value)
            .map_err(|issues| DataWriteError::SchemaMismatch {
                name: name(),
                issues: issues.join("; "),
            })?;
        binding.write_data(&self.name, value)
    }
}

impl<T> fmt::Debug for DataWriter<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataWriter")
            .field("name", &self.name)
            .field("has_runtime", &self.binding.is_some())
            .finish()
    }
}
