//! Criterion benchmarks: every backend compiled into `attn` over the shape
//! table `attn_benches::SUITE` (the f64 reference on the small shapes only),
//! for each thread count. `cargo xtask bench` runs this binary, reads the
//! estimates criterion writes under `target/criterion/<id>/`, and turns them
//! into GFLOP/s against the measured peak; the selection comes from the
//! environment (`attn_benches::BenchEnv`).

// criterion_group!/criterion_main! generate undocumented items.
#![allow(missing_docs)]

use attn::{Backend, Engine, EngineKind, Inputs};
use attn_benches::candle_backends::CandleKind;
use attn_benches::{
    backward_inputs, bench_id, calls_after_work, has_backward, has_spin, BenchCase, BenchEnv,
    CPU_BACKWARD, CPU_SPIN, CPU_SPIN_FOR, SUITE,
};
use attn_spec::{Backward, GradInputs, GradOutputs};
use criterion::{criterion_group, criterion_main, Bencher, Criterion};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// The engines timed on `threads`: each compiled kind's, and attn-cpu
/// with spinning helpers as `cpu-spin` on more than one thread.
fn engines(threads: usize) -> Vec<(Engine, String)> {
    let mut all: Vec<(Engine, String)> = EngineKind::compiled()
        .into_iter()
        .filter_map(|k| engine(k, threads))
        .map(|e| {
            let name = e.name();
            (e, name)
        })
        .collect();
    // On one thread there are no helpers to wait: the `cpu` row's twin.
    if let Some(cpu) = attn_cpu::Cpu::with_threads(threads)
        .and_then(|c| c.with_spin(CPU_SPIN_FOR))
        .ok()
        .filter(|_| threads > 1)
    {
        all.push((Engine::Cpu(cpu), CPU_SPIN.into()));
    }
    all
}

/// Whether `backend` (an [`engines`] name) is timed on `case`.
fn times(backend: &str, case: &BenchCase) -> bool {
    match backend {
        "reference" => case.small,
        CPU_SPIN => has_spin(case),
        _ => true,
    }
}

fn engine(kind: EngineKind, threads: usize) -> Option<Engine> {
    match kind {
        EngineKind::Cpu => attn_cpu::Cpu::with_threads(threads).ok().map(Engine::Cpu),
        // The reference is single-threaded: time it once, as t1.
        EngineKind::Reference => (threads == 1).then(|| Engine::of(kind).ok()).flatten(),
        // The GPU is timed with its buffers on the device (attn-cuda's
        // gpu_bench), not through the host-data engine.
        EngineKind::Cuda => None,
    }
}

fn attention(c: &mut Criterion) {
    let env = BenchEnv::from_env();
    let total: usize = env
        .threads
        .iter()
        .flat_map(|&t| engines(t))
        .filter(|(_, name)| env.wants_backend(name))
        .map(|(_, name)| {
            SUITE
                .iter()
                .filter(|c| env.wants_case(c) && times(&name, c))
                .count()
        })
        .sum::<usize>()
        + CandleKind::ALL
            .iter()
            .filter(|k| env.wants_backend(k.name()))
            .map(|k| {
                env.threads.len()
                    * SUITE
                        .iter()
                        .filter(|c| env.wants_case(c) && k.applies(c))
                        .count()
            })
            .sum::<usize>()
        + if env.wants_backend(CPU_BACKWARD) {
            env.threads.len()
                * SUITE
                    .iter()
                    .filter(|c| env.wants_case(c) && has_backward(c))
                    .count()
        } else {
            0
        };
    let mut progress = Progress {
        start: Instant::now(),
        done: 0,
        total,
    };
    for &threads in &env.threads {
        for (engine, name) in engines(threads) {
            if !env.wants_backend(&name) {
                continue;
            }
            for case in SUITE
                .iter()
                .filter(|c| env.wants_case(c) && times(&name, c))
            {
                progress.next(format!("{name} {} on {threads} thread(s)", case.name));
                let problem = case.problem();
                let [q, k, v] = case.data();
                let up = |d| engine.upload(d).expect("upload");
                let (q, k, v) = (up(&q), up(&k), up(&v));
                let mut out = engine
                    .zeros(problem.dtype, problem.out.extent().expect("valid"))
                    .expect("alloc");
                c.bench_function(&bench_id(&name, case, threads), |b| {
                    time_calls(b, case, || {
                        engine
                            .forward_into(
                                black_box(&problem),
                                Inputs::new(&q, &k, &v),
                                &mut out,
                                None,
                            )
                            .expect("forward")
                    })
                });
            }
        }
    }
    backward(c, &env, &mut progress);
    candle(c, &env, &mut progress);
}

/// Times `call` for criterion: back to back, or with the case's other
/// work ([`BenchCase::gap_us`]) before each call, its time left out.
fn time_calls<R>(b: &mut Bencher<'_>, case: &BenchCase, mut call: impl FnMut() -> R) {
    if case.gap_us == 0 {
        return b.iter(call);
    }
    b.iter_custom(|iters| calls_after_work(iters, case, &mut call));
}

/// The progress line before each timed case: its number, the time so far
/// and an estimate of the time left (the mean time per case so far, times
/// the cases left).
struct Progress {
    start: Instant,
    done: usize,
    total: usize,
}

impl Progress {
    fn next(&mut self, what: String) {
        let elapsed = self.start.elapsed().as_secs_f64();
        let mmss = |s: f64| format!("{}:{:02}", (s / 60.0) as u64, (s % 60.0) as u64);
        let left = if self.done == 0 {
            "estimating the time left".to_string()
        } else {
            let per = elapsed / self.done as f64;
            format!("about {} left", mmss(per * (self.total - self.done) as f64))
        };
        self.done += 1;
        eprintln!(
            "[bench {}/{}, {} elapsed, {left}] {what}",
            self.done,
            self.total,
            mmss(elapsed)
        );
    }
}

/// attn-cpu's backward pass on the prefill cases (gradients of Q, K, V
/// into buffers allocated once), from attn-cpu's own forward results.
fn backward(c: &mut Criterion, env: &BenchEnv, progress: &mut Progress) {
    if !env.wants_backend(CPU_BACKWARD) {
        return;
    }
    for &threads in &env.threads {
        let Ok(cpu) = attn_cpu::Cpu::with_threads(threads) else {
            continue;
        };
        for case in SUITE
            .iter()
            .filter(|c| env.wants_case(c) && has_backward(c))
        {
            progress.next(format!(
                "{CPU_BACKWARD} {} on {threads} thread(s)",
                case.name
            ));
            let data = case.data();
            let (p, [out, lse, d_out]) = backward_inputs(case, &data);
            let z = |v: &attn::View| {
                cpu.zeros(p.dtype, v.extent().expect("valid"))
                    .expect("alloc")
            };
            let (mut dq, mut dk, mut dv) = (z(&p.q), z(&p.k), z(&p.v));
            let [q, k, v] = &data;
            c.bench_function(&bench_id(CPU_BACKWARD, case, threads), |b| {
                time_calls(b, case, || {
                    cpu.backward_into(
                        black_box(&p),
                        Inputs::new(q, k, v),
                        GradInputs {
                            out: &out,
                            lse: Some(&lse),
                            d_out: &d_out,
                        },
                        GradOutputs {
                            dq: &mut dq,
                            dk: &mut dk,
                            dv: &mut dv,
                            dbias: None,
                            dsinks: None,
                        },
                    )
                    .expect("backward")
                })
            });
        }
    }
}

/// The candle backends and baselines, each inside a pool of the thread
/// count (candle's CPU kernels and attn's run on the current rayon pool),
/// the calls made from one of the pool's threads as a caller in such a
/// pool makes them.
fn candle(c: &mut Criterion, env: &BenchEnv, progress: &mut Progress) {
    for kind in CandleKind::ALL {
        if !env.wants_backend(kind.name()) {
            continue;
        }
        for &threads in &env.threads {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("thread pool");
            for case in SUITE
                .iter()
                .filter(|c| env.wants_case(c) && kind.applies(c))
            {
                progress.next(format!(
                    "{} {} on {threads} thread(s)",
                    kind.name(),
                    case.name
                ));
                let Ok(mut run) = kind.prepare(case) else {
                    continue;
                };
                // The timed loop runs inside the pool, one hand-off per
                // batch of calls: a hand-off into a rayon pool took 10-17
                // us here (Zen 4), as long as a whole tiny case. (The cpu
                // engine's rows call from the bench's own thread, outside
                // the backend's pool, as a caller of `Cpu` does.)
                c.bench_function(&bench_id(kind.name(), case, threads), |b| {
                    b.iter_custom(|iters| {
                        pool.install(|| {
                            if case.gap_us == 0 {
                                let t = Instant::now();
                                for _ in 0..iters {
                                    run(false).expect("run");
                                }
                                return t.elapsed();
                            }
                            calls_after_work(iters, case, || run(false).expect("run"))
                        })
                    })
                });
            }
        }
    }
}

fn config() -> Criterion {
    let secs = BenchEnv::from_env().measure_secs;
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs_f64((secs / 4.0).max(0.1)))
        .measurement_time(Duration::from_secs_f64(secs))
}

criterion_group! {
    name = benches;
    config = config();
    targets = attention
}
criterion_main!(benches);
