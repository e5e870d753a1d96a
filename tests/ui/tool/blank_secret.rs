use flue_runtime::prelude::*;

/// Look an order up.
#[tool(secrets = ["SHOP_TOKEN", " "])]
async fn lookup(order: String) -> String {
    order
}

fn main() {}
