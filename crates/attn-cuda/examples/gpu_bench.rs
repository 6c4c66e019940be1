//! Times attn-cuda's forward on the GPU benchmark shapes with CUDA events
//! and prints one JSON line per shape (read by the `torch_bench.py` that
//! `cargo xtask gpu-check` writes, which times PyTorch's SDPA on the same
//! shapes and prints the table). Run on a machine with a GPU:
//!
//! ```sh
//! gpu_bench                     # every shape
//! gpu_bench --quick             # fewer repetitions
//! gpu_bench --only bf16/s4096/causal --reps 1   # shapes whose label
//!                               # (name/dtype/s<q_len>/kv<kv_len>/causal|full/kernel) contains it
//!                               # (ending in '$': equals it)
//! ```
//!
//! `--only` with `--reps 1` is how `run.sh` puts one launch under Nsight
//! Compute.

use attn_cuda::{Cuda, HalfKernel};
use attn_spec::{AttnOptions, Backend, DType, HostData, Inputs, Problem, Shape};

/// (name, batch, q heads, kv heads, q_len, kv_len, head dim, causal, dtype)
type BenchShape = (
    &'static str,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    bool,
    DType,
);

/// FlashAttention's benchmark convention: batch x seq = 16k tokens, 16
/// heads of dim 128 (model width 2048); plus a GQA decode step.
fn shapes() -> Vec<BenchShape> {
    let mut v = Vec::new();
    for dtype in [DType::Bf16, DType::F16] {
        for causal in [false, true] {
            for s in [4096, 8192, 16384] {
                v.push(("prefill", 16384 / s, 16, 16, s, s, 128, causal, dtype));
            }
        }
    }
    v.push(("decode", 1, 32, 8, 1, 32768, 128, false, DType::Bf16));
    v.push(("decode", 8, 32, 8, 1, 8192, 128, false, DType::Bf16));
    v.push(("prefill-f32", 4, 16, 16, 4096, 4096, 128, true, DType::F32));
    v
}

/// Deterministic data in [-1, 1) (never zeros: they hide indexing bugs and
/// run faster than real data).
fn data(dtype: DType, n: usize, seed: u64) -> HostData {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let vals: Vec<f64> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect();
    HostData::from_f64(dtype, &vals)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let quick = args.iter().any(|a| a == "--quick");
    let reps: usize = match value("--reps") {
        Some(r) => r.parse()?,
        None if quick => 5,
        None => 20,
    };
    let only = value("--only").unwrap_or_default();
    let tc = Cuda::first()?;
    let simt = Cuda::first()?.with_half_kernel(HalfKernel::Simt)?;
    let fast = Cuda::first()?.with_half_kernel(HalfKernel::TensorCoreFast)?;
    // Decoding without the key split (64-row blocks), and the fast
    // kernel's prefill without its wide blocks (64 rows), to compare.
    let whole = Cuda::first()?.with_decode_key_split(false);
    let fast64 = Cuda::first()?
        .with_half_kernel(HalfKernel::TensorCoreFast)?
        .with_wide_blocks(false);
    eprintln!(
        "attn-cuda on {} (sm_{}{}, {} SMs)",
        tc.device_name(),
        tc.arch().0,
        tc.arch().1,
        tc.sm_count()
    );
    for (name, b, hq, hkv, sq, sk, d, causal, dtype) in shapes() {
        let mut opts = AttnOptions::default();
        if causal {
            opts = opts.causal();
        }
        let shape = Shape::new(b, hq, hkv, sq, sk, d);
        let p = Problem::new(shape, dtype).with_options(opts);
        let kernels: &[(&str, &Cuda)] = if dtype == DType::F32 {
            &[("simt", &simt)]
        } else if name == "decode" {
            &[
                ("mma", &tc),
                ("mma-fast", &fast),
                ("mma-64rows", &whole),
                ("simt", &simt),
            ]
        } else {
            &[
                ("mma", &tc),
                ("mma-fast", &fast),
                ("mma-fast-64rows", &fast64),
                ("simt", &simt),
            ]
        };
        for &(kname, be) in kernels {
            if kname == "simt" && dtype != DType::F32 && name == "prefill" && sq > 4096 {
                continue; // the FMA kernel on half inputs: one size is enough
            }
            let mask = if causal { "causal" } else { "full" };
            let label = format!("{name}/{dtype}/s{sq}/kv{sk}/{mask}/{kname}");
            // A filter ending in '$' names one label exactly.
            let picked = match only.strip_suffix('$') {
                Some(exact) => label == exact,
                None => label.contains(&only),
            };
            if !picked {
                continue;
            }
            let q = be.upload(&data(dtype, b * sq * hq * d, 1))?;
            let k = be.upload(&data(dtype, b * sk * hkv * d, 2))?;
            let v = be.upload(&data(dtype, b * sk * hkv * d, 3))?;
            let mut out = be.zeros(dtype, b * sq * hq * d)?;
            let mut run = || be.forward_into(&p, Inputs::new(&q, &k, &v), &mut out, None);
            for _ in 0..3.min(reps) {
                run()?;
            }
            let mut ms = be.time_ms(reps, &mut run)?;
            ms.sort_by(f32::total_cmp);
            let med = ms[ms.len() / 2] as f64;
            let flops = p.flops();
            let bytes = ((b * sq * hq * d * 2 + 2 * b * sk * hkv * d) * dtype.size_bytes()) as f64;
            println!(
                "{{\"name\":\"{name}\",\"kernel\":\"{kname}\",\"dtype\":\"{dtype}\",\"batch\":{b},\"q_heads\":{hq},\"kv_heads\":{hkv},\"q_len\":{sq},\"kv_len\":{sk},\"head_dim\":{d},\"causal\":{causal},\"ms\":{med:.5},\"tflops\":{:.2},\"gbs\":{:.1}}}",
                flops / med / 1e9,
                bytes / med / 1e6
            );
        }
    }
    Ok(())
}
