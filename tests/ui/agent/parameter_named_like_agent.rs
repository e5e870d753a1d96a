use flue_runtime::prelude::*;

#[agent]
fn mail(mail: AgentProps) -> String {
    format!("You read the mailbox of {}.", mail.id())
}

fn main() {}
