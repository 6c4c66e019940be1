//! # attn-fuzz: every CPU-side backend against the reference, on any bytes
//!
//! [`run_one`] decodes an input with [`attn_conformance::fuzz::decode`] and
//! holds attn-cpu (one thread and two), candle's fused op and candle's plain
//! composition to the contract ([`attn_conformance::fuzz::check`]), and
//! attn-cpu's backward pass on plain data. The libFuzzer target
//! (`fuzz_targets/differential.rs`) panics on an `Err`; the `smoke` binary
//! and `tests/corpus.rs` call it directly on stable.

use attn_candle::CandleBackend;
use attn_conformance::fuzz::{check, check_backward, decode};
use attn_cpu::Cpu;
use std::sync::OnceLock;

/// The backends, built once per process.
struct Backends {
    one: Cpu,
    two: Cpu,
    fused: CandleBackend,
    plain: CandleBackend,
}

fn backends() -> &'static Backends {
    static B: OnceLock<Backends> = OnceLock::new();
    B.get_or_init(|| Backends {
        one: Cpu::with_threads(1).expect("a one-thread pool"),
        two: Cpu::with_threads(2).expect("a two-thread pool"),
        fused: CandleBackend::fused_cpu(),
        plain: CandleBackend::plain_cpu(),
    })
}

/// Checks one input on every backend; `Err` names the backend and what
/// broke.
pub fn run_one(data: &[u8]) -> Result<(), String> {
    let d = decode(data);
    let b = backends();
    check(&b.one, &d)?;
    check(&b.two, &d)?;
    check(&b.fused, &d)?;
    check(&b.plain, &d)?;
    check_backward(&b.one, &d)
}
