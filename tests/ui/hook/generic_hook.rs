use flue_runtime::prelude::*;

#[hook(after_thread_created)]
fn greet<T: Default>(_state: &ThreadState) -> Result<(), HookError> {
    let _ = T::default();
    Ok(())
}

fn main() {}
