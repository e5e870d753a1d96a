use flue_runtime::prelude::*;

struct Point {
    x: f64,
    y: f64,
}

/// Measure the distance between two points.
#[tool]
async fn distance(from: Point, to: Point) -> String {
    ((to.x - from.x).hypot(to.y - from.y)).to_string()
}

fn main() {}
