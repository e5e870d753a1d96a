//! Dynamic-resource narration at each model call (see `crate::resources`): the declared sets
//! are compared with the last narrated snapshot, changes are committed as signals before the
//! call, and the system prompt's framework sections stay on the frozen baseline.

use std::collections::BTreeMap;

use flue_core::render::Rendered;

use super::{Failure, Response};
use crate::record::{RecordBody, new_id};
use crate::resources::{Declared, narrate};

impl Response<'_> {
    /// Narrates what changed since the last snapshot; returns the system prompt sections to
    /// use (the frozen baseline once there is one). The first snapshot waits in
    /// `first_snapshot` to be committed with the step.
    pub(super) async fn narrate_resources(&mut self, rendered: &Rendered) -> Result<Option<String>, Failure> {
        let declared = Declared::of(rendered);
        let current = declared.snapshot();
        let Some(previous) = self.conversation.resources.clone() else {
            self.first_snapshot = Some(self.record(RecordBody::ResourceSnapshot {
                snapshot: current,
                baseline: self.framework_sections.clone(),
            }));
            return Ok(self.framework_sections.clone());
        };
        if previous != current {
            let mut records: Vec<_> = narrate(&previous, &current, &declared)
                .into_iter()
                .map(|narration| {
                    let mut attributes = BTreeMap::new();
                    if let Some(resource) = narration.resource {
                        attributes.insert("resource".to_owned(), resource.to_owned());
                    }
                    self.record(RecordBody::Signal {
                        message_id: new_id("msg"),
                        signal_type: narration.signal_type.to_owned(),
                        body: narration.body,
                        attributes,
                        tag_name: None,
                    })
                })
                .collect();
            records.push(self.record(RecordBody::ResourceSnapshot {
                snapshot: current,
                baseline: None,
            }));
            self.commit(records, false).await?;
        }
        Ok(self.conversation.baseline_sections.clone())
    }
}
