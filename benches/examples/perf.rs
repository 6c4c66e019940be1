//! Quick throughput probe for kernel work: `cargo run -p attn-benches
//! --release --example perf -- [threads] [case filter]`. The benchmark
//! report proper is `cargo xtask bench`. Environment: `REPS` (best of,
//! default 5), `KV` (another key count), `BHSD` (head-major layout),
//! `BIAS` (an f32 additive bias of shape (batch, heads, q_len, kv_len)),
//! `MASK` (a boolean mask of shape (batch, 1, q_len, kv_len), broadcast
//! over the heads),
//! `NO_PEAK`, `BW` (also measure the triad and read bandwidths), `BWD` (also time
//! the backward pass, counted as 2.5x the forward's FLOPs), `DTYPE`
//! (`f32`, `f16` or `bf16`: the same cases in another element type),
//! `MEDIAN` (also print the median, 90th percentile and mean of the calls:
//! far above the best, the machine was busy), `KV_ALIGN` (bytes: K and V
//! placed so their first element sits that far past a 64-byte line; a
//! Rust `Vec` from the allocator usually sits 16 bytes past one),
//! `GAP_US` (microseconds of other work on the calling thread before each
//! call, forward and backward, as an engine's projections would take: the
//! pool's threads go idle in between), `SPIN_US` (`Cpu::with_spin`: how
//! long helpers wait, spinning, for the next call).

use attn::{Backend, Inputs};
use attn_benches::machine::fma_peak_per_core;
use attn_benches::SUITE;
use attn_spec::{Backward, GradInputs, GradRequest};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    let filter = std::env::args().nth(2).unwrap_or_default();
    let peak = if std::env::var_os("NO_PEAK").is_some() {
        f64::NAN
    } else {
        fma_peak_per_core() * threads as f64
    };
    println!("FMA peak for {threads} thread(s): {peak:.0} GFLOP/s");
    if std::env::var_os("BW").is_some() {
        println!(
            "triad bandwidth: {:.1} GB/s, read bandwidth: {:.1} GB/s",
            attn_benches::machine::triad_bandwidth(threads),
            attn_benches::machine::read_bandwidth(threads)
        );
    }
    let spin_us: u64 = std::env::var("SPIN_US")
        .ok()
        .map_or(0, |s| s.parse().expect("SPIN_US: microseconds"));
    let cpu = attn_cpu::Cpu::with_threads(threads)
        .unwrap()
        .with_spin(std::time::Duration::from_micros(spin_us))
        .unwrap();
    println!(
        "attn-cpu SIMD level: {} (this CPU: {}; ATTN_CPU_ISA caps it)",
        cpu.isa().unwrap(),
        attn_cpu::Isa::detected()
    );
    let kv: Option<usize> = std::env::var("KV").ok().and_then(|k| k.parse().ok());
    // A filter ending in '$' names one case exactly.
    let matches = |name: &str| match filter.strip_suffix('$') {
        Some(exact) => name == exact,
        None => name.contains(&filter),
    };
    for case in SUITE.iter().filter(|c| matches(c.name)) {
        // KV=n: the same case with n keys (e.g. a decode case that fits
        // in cache, to see the kernel's compute cost alone).
        let mut case = case.clone();
        if let Some(n) = kv {
            case.kv_len = n;
        }
        match std::env::var("DTYPE").as_deref() {
            Ok("f32") => case.dtype = attn::DType::F32,
            Ok("f16") => case.dtype = attn::DType::F16,
            Ok("bf16") => case.dtype = attn::DType::Bf16,
            Ok(other) => panic!("DTYPE={other}: f32, f16 or bf16"),
            Err(_) => {}
        }
        let p = if std::env::var_os("BHSD").is_some() {
            case.problem().bhsd()
        } else {
            case.problem()
        };
        let [q, k, v] = case.data();
        let mut p = p;
        let align = std::env::var("KV_ALIGN").ok().map(|a| {
            a.parse::<usize>()
                .unwrap_or_else(|_| panic!("KV_ALIGN={a}: a byte offset"))
        });
        let (k, v) = match align {
            Some(at) => {
                let (k, ko) = place(&k, at);
                let (v, vo) = place(&v, at);
                p.k.offset += ko;
                p.v.offset += vo;
                (k, v)
            }
            None => (k, v),
        };
        // BIAS: a full additive bias (small values), to time the per-element path.
        let bias = std::env::var_os("BIAS").map(|_| {
            let dims = [case.batch, case.q_heads, case.q_len, case.kv_len];
            let n = dims.iter().product::<usize>();
            let vals = (0..n).map(|i| (i % 13) as f32 * 0.01).collect();
            (attn::View::contiguous(dims), attn::HostData::F32(vals))
        });
        let p = match &bias {
            Some((view, _)) => p.with_bias(*view, attn::DType::F32),
            None => p,
        };
        // MASK: a boolean mask shared by the heads, every seventh key left out.
        let mask = std::env::var_os("MASK").map(|_| {
            let dims = [case.batch, 1, case.q_len, case.kv_len];
            let n = dims.iter().product::<usize>();
            let mut view = attn::View::contiguous(dims);
            view.dims[1] = case.q_heads;
            view.strides[1] = 0;
            (
                view,
                attn::HostData::Bool((0..n).map(|i| i % 7 != 3).collect()),
            )
        });
        let p = match &mask {
            Some((view, _)) => p.with_mask(*view),
            None => p,
        };
        let inputs = Inputs {
            bias: bias.as_ref().map(|b| &b.1),
            mask: mask.as_ref().map(|m| &m.1),
            ..Inputs::new(&q, &k, &v)
        };
        let mut out = cpu.zeros(p.dtype, p.out.extent().unwrap()).unwrap();
        let gap: Option<f64> = std::env::var("GAP_US").ok().map(|g| {
            g.parse()
                .unwrap_or_else(|_| panic!("GAP_US={g}: microseconds"))
        });
        // Other work on this thread between calls, as in an engine: the
        // pool's threads go idle meanwhile.
        let other_work = || attn_benches::busy_us(gap.unwrap_or(0.0));
        // `REPS` calls, each after the other work; their times sorted, the
        // median printed when asked.
        let time_calls = |name: &str, call: &mut dyn FnMut()| {
            let reps = std::env::var("REPS")
                .ok()
                .and_then(|r| r.parse().ok())
                .unwrap_or(5);
            let mut times: Vec<f64> = (0..reps)
                .map(|_| {
                    other_work();
                    let t = Instant::now();
                    call();
                    t.elapsed().as_secs_f64()
                })
                .collect();
            times.sort_by(f64::total_cmp);
            if std::env::var_os("MEDIAN").is_some() {
                println!(
                    "{name:32} median {:.3} ms, 90th percentile {:.3} ms, mean {:.3} ms",
                    times[times.len() / 2] * 1e3,
                    times[times.len() * 9 / 10] * 1e3,
                    times.iter().sum::<f64>() / times.len() as f64 * 1e3
                );
            }
            times
        };
        let best = time_calls(case.name, &mut || {
            cpu.forward_into(&p, inputs, &mut out, None).unwrap()
        })[0];
        if std::env::var_os("BWD").is_some() {
            let mut p = p.clone();
            p.options.return_lse = true;
            let fwd = cpu.forward(&p, inputs).unwrap();
            let n = p.out.extent().unwrap();
            let d_out = attn::HostData::from_f64(
                p.dtype,
                &(0..n)
                    .map(|i| ((i * 7) % 19) as f64 * 0.05 - 0.45)
                    .collect::<Vec<_>>(),
            );
            let g_in = GradInputs {
                out: &fwd.out,
                lse: fwd.lse.as_ref(),
                d_out: &d_out,
            };
            let bbest = time_calls(&format!("{} bwd", case.name), &mut || {
                cpu.backward(&p, inputs, g_in, GradRequest::default())
                    .unwrap();
            })[0];
            let gf = 2.5 * case.flops() / bbest / 1e9;
            println!(
                "{:32} {:9.3} ms {:7.1} GFLOP/s {:5.1}% of peak (backward; {:.2}x the forward's GFLOP/s)",
                format!("{} bwd", case.name),
                bbest * 1e3,
                gf,
                100.0 * gf / peak,
                gf / (case.flops() / best / 1e9)
            );
        }
        let gf = case.flops() / best / 1e9;
        println!(
            "{:32} {:9.3} ms {:7.1} GFLOP/s {:5.1}% of peak {:6.1} GB/s of K+V {:6.1} ns/key/kv-head",
            case.name,
            best * 1e3,
            gf,
            100.0 * gf / peak,
            case.kv_bytes() / best / 1e9,
            best * 1e9 / (case.batch * case.kv_heads * case.kv_len) as f64
        );
    }
}

/// `d` copied into a new buffer at the first element that sits `at` bytes
/// past a 64-byte line, and that element's index.
fn place(d: &attn::HostData, at: usize) -> (attn::HostData, usize) {
    let size = d.dtype().size_bytes();
    let mut out = attn::HostData::zeros(d.dtype(), d.len() + 64 / size);
    let addr = match &out {
        attn::HostData::F32(x) => x.as_ptr() as usize,
        attn::HostData::F16(x) => x.as_ptr() as usize,
        attn::HostData::Bf16(x) => x.as_ptr() as usize,
        _ => panic!("KV_ALIGN: f32, f16 or bf16 data"),
    };
    let skip = (at % 64 + 64 - addr % 64) % 64;
    assert_eq!(skip % size, 0, "KV_ALIGN={at}: not a multiple of {size}");
    let first = skip / size;
    for i in 0..d.len() {
        out.set(first + i, d.get(i));
    }
    (out, first)
}
