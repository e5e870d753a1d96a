use flue_runtime::prelude::*;

unsafe fn announce() {}

#[hook(after_thread_created)]
unsafe fn greet(_state: &ThreadState) {
    announce();
}

fn main() {}
