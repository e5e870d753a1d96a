use flue_runtime::prelude::*;

/// Look something up.
#[tool(name = "look_up_the_order_in_the_warehouse_management_system_of_the_shop_1")]
async fn lookup(query: String) -> String {
    query
}

fn main() {}
