//! Support code shared by the workspace-level tests and the examples.
