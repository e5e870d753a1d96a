use flue_runtime::prelude::*;
use std::borrow::Cow;

/// Look something up.
#[tool]
async fn lookup(query: Cow<str>) -> String {
    query.into_owned()
}

fn main() {}
