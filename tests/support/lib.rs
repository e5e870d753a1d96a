//! The root package's library target, empty: a package needs one (the examples share
//! `examples/common/`, and each workspace-level test its own modules).
