//! Dynamic-resource narration at each model call (see `crate::resources`): the declared sets
//! are compared with the last narrated snapshot, changes are committed as signals before the
//! call, and the system prompt's framework sections stay on the frozen baseline.

use std::collections::BTreeMap;

use flue_core::render::Rendered;

use super::{Failure, Response};
use crate::record::{RecordBody, new_id};
use crate::resources::{Declared, narrate};

impl Response<'_> {
    /// Narrates what changed since the last snapshot. A conversation's first snapshot waits in
    /// `first_snapshot` to be committed with the step.
    pub(super) async fn narrate_resources(&mut self, rendered: &Rendered) -> Result<(), Failure> {
        // A render declaring what the previous one did has its snapshot already.
        let environment = match (&self.sandbox, self.sandbox_present) {
            (Some(environment), true) => environment.session.as_ref().map(|session| session.cwd.clone()),
            _ => None,
        };
        let environment = environment.as_deref();
        let fingerprint = crate::resources::fingerprint(rendered, self.own_tools, environment);
        let current = match self.declared.take() {
            Some((seen, snapshot)) if seen == fingerprint => snapshot,
            _ => std::sync::Arc::new(Declared::of(rendered, self.own_tools, environment).snapshot()),
        };
        match &self.conversation.resources {
            None => {
                self.first_snapshot = Some(self.record(RecordBody::ResourceSnapshot {
                    snapshot: current.clone(),
                    baseline: self.framework_sections.text().map(str::to_owned),
                }));
            }
            Some(previous) if *previous == current => {}
            Some(previous) => {
                let narrations = narrate(previous, &current, &Declared::of(rendered, self.own_tools, environment));
                let mut records: Vec<_> = narrations
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
                    snapshot: current.clone(),
                    baseline: None,
                }));
                self.commit_signals(records, false).await?;
            }
        }
        self.declared = Some((fingerprint, current));
        Ok(())
    }
}
