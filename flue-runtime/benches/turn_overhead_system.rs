//! `turn_overhead` on the system allocator (glibc's `malloc` on Linux), next to
//! `turn_overhead` on mimalloc. The bench itself is `turn_overhead/exchange.rs`.

#[path = "turn_overhead/exchange.rs"]
mod exchange;

#[global_allocator]
static GLOBAL: exchange::CountingAllocator<std::alloc::System> = exchange::CountingAllocator(std::alloc::System);

fn main() {
    exchange::main("the system's (glibc's `malloc` on Linux)");
}
