//! `turn_overhead` on mimalloc: the allocator a deployed server should use (the README's
//! Benchmarks section). The bench itself is `turn_overhead/exchange.rs`; `turn_overhead_system`
//! runs it on the system allocator.

#[path = "turn_overhead/exchange.rs"]
mod exchange;

#[global_allocator]
static GLOBAL: exchange::CountingAllocator<mimalloc::MiMalloc> = exchange::CountingAllocator(mimalloc::MiMalloc);

fn main() {
    exchange::main("mimalloc");
}
