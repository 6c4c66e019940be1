//! Criterion benchmarks: every backend compiled into `attn` over the shape
//! table of `attn_benches::SUITE` (the reference on the small shapes only).
//! Throughput is reported by `cargo xtask bench` from these timings and the
//! exact FLOP count of each case's visible pairs.

// criterion_group!/criterion_main! generate undocumented items.
#![allow(missing_docs)]

use attn::{Backend, Engine, EngineKind, Inputs};
use attn_benches::SUITE;
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

fn attention(c: &mut Criterion) {
    for kind in EngineKind::compiled() {
        let Ok(engine) = Engine::of(kind) else {
            continue;
        };
        for case in SUITE {
            if kind == EngineKind::Reference && !case.small {
                continue;
            }
            let problem = case.problem();
            let [q, k, v] = case.data();
            let (q, k, v) = (
                engine.upload(&q).unwrap(),
                engine.upload(&k).unwrap(),
                engine.upload(&v).unwrap(),
            );
            let mut out = engine
                .zeros(problem.dtype, problem.out.extent().unwrap())
                .unwrap();
            let id = format!("{}/{}", engine.name(), case.name);
            c.bench_function(&id, |b| {
                b.iter(|| {
                    engine
                        .forward_into(black_box(&problem), Inputs::new(&q, &k, &v), &mut out, None)
                        .unwrap()
                })
            });
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(500));
    targets = attention
}
criterion_main!(benches);
