//! The speed a crate that depends on attn gets: a few cases timed through
//! the public API only. `cargo xtask downstream` runs this file twice, as
//! an example inside this workspace and as the `main.rs` of a fresh crate
//! outside it built with a plain `cargo build --release` (no RUSTFLAGS, no
//! workspace profile, no `.cargo/config.toml`), and compares the two.
//!
//! Prints the SIMD level attn-cpu runs (`isa <level>`) and one line per
//! case, `case <name> <best milliseconds>`. `REPS` sets the best-of count
//! (default 5); rayon's `RAYON_NUM_THREADS` the threads.

use attn::{AttnOptions, Backend, DType, Engine, HostData, Inputs, Problem, Shape};
use std::time::Instant;

/// name, (batch, q heads, kv heads, q_len, kv_len, head dim), causal, dtype.
type Case = (&'static str, [usize; 6], bool, DType);

const CASES: &[Case] = &[
    ("s512-d64", [1, 8, 8, 512, 512, 64], false, DType::F32),
    (
        "s2048-d64-causal",
        [1, 8, 8, 2048, 2048, 64],
        true,
        DType::F32,
    ),
    (
        "s1024-d128-causal",
        [1, 16, 16, 1024, 1024, 128],
        true,
        DType::F32,
    ),
    (
        "s1024-d128-causal-bf16",
        [1, 16, 16, 1024, 1024, 128],
        true,
        DType::Bf16,
    ),
    (
        "decode-gqa32:8-kv4096-d128",
        [1, 32, 8, 1, 4096, 128],
        false,
        DType::F32,
    ),
];

/// Deterministic values in [-1, 1) of the given type.
fn data(n: usize, seed: u64, dtype: DType) -> HostData {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let vals: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    match dtype {
        DType::Bf16 => HostData::Bf16(vals.into_iter().map(attn::bf16::from_f32).collect()),
        _ => HostData::F32(vals),
    }
}

fn main() {
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5);
    let isa = attn::cpu::Cpu::new().isa().expect("a SIMD level");
    println!("isa {isa}");
    let engine = Engine::best();
    for &(name, [b, h, kvh, sq, skv, d], causal, dtype) in CASES {
        let shape = Shape::new(b, h, kvh, sq, skv, d);
        let mut options = AttnOptions::default();
        if causal {
            options = options.causal();
        }
        let problem = Problem::new(shape, dtype).with_options(options);
        let q = data(b * sq * h * d, 1, dtype);
        let k = data(b * skv * kvh * d, 2, dtype);
        let v = data(b * skv * kvh * d, 3, dtype);
        let mut out = engine.zeros(dtype, b * sq * h * d).expect("output");
        let mut best = f64::INFINITY;
        for _ in 0..=reps {
            let t = Instant::now();
            engine
                .forward_into(&problem, Inputs::new(&q, &k, &v), &mut out, None)
                .expect("attention");
            best = best.min(t.elapsed().as_secs_f64() * 1e3);
        }
        println!("case {name} {best:.3}");
    }
}
