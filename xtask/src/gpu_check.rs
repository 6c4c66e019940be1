//! `cargo xtask gpu-check`: builds attn-cuda's GPU test binaries and its
//! benchmark (portable x86-64 binaries: the workspace sets no target CPU,
//! and attn-cpu picks its SIMD level at run time) and writes one self-contained
//! folder for a machine that has an NVIDIA GPU, its driver and PyTorch but
//! no Rust toolchain. `bash run.sh` there runs the conformance suite on the
//! GPU (`ATTN_REQUIRE_GPU=1`: a missing GPU fails), then times attn-cuda
//! and PyTorch's `scaled_dot_product_attention` on the same shapes with
//! CUDA events, and prints TFLOP/s and percent of the measured bf16 matmul
//! peak, then profiles two launches with Nsight Compute where it can.
//! NVRTC comes from the machine's toolkit or PyTorch's own wheels there
//! (CUDA 12 or 13), or from `$ATTN_CUDA_LIB_DIR`.
//!
//! Knobs for a short device session (`run.sh`'s environment):
//! `ATTN_GPU_CASES` (generated conformance cases, default 128),
//! `TEST_TIMEOUT` (seconds per test, default 300), `QUICK=1` (5 timed
//! runs instead of 20), `NO_PROFILE=1` (no Nsight Compute),
//! `NO_SANITIZE=1` (no compute-sanitizer pass over the smoke case), `FORCE=1` (go
//! on past a failed smoke case), `ATTN_REQUIRE_GPU=0` (a dry run without
//! a GPU), `OUT` (where logs go, default `./out`).

use std::path::{Path, PathBuf};
use std::process::Command;

const RUN_SH: &str = r#"#!/usr/bin/env bash
# attn-cuda on a GPU: conformance, then attn-cuda vs PyTorch SDPA.
# Written by `cargo xtask gpu-check`; needs the NVIDIA driver, python3 with
# torch (CUDA build). Results go to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# NVRTC: attn-cuda's cudarc is built for CUDA 12 and loads libnvrtc.so.12 or
# libnvrtc.so by name. Find an NVRTC (here, the CUDA toolkit's or the one in
# PyTorch's wheels, CUDA 12 or 13: its C API is the same) and expose it as
# libnvrtc.so on the loader path, beside its builtins library.
nv=""
dirs="${ATTN_CUDA_LIB_DIR:-} /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib"
dirs="$dirs $(python3 -c 'import glob, site
print(" ".join(sorted({p.rsplit("/", 1)[0] for s in site.getsitepackages() for p in glob.glob(s + "/nvidia/**/libnvrtc.so*", recursive=True)})))' 2>/dev/null)"
for d in $dirs; do
  for f in "$d"/libnvrtc.so.12 "$d"/libnvrtc.so.13 "$d"/libnvrtc.so; do
    if [ -e "$f" ]; then nv="$f"; break 2; fi
  done
done
if [ -n "$nv" ]; then
  mkdir -p /tmp/attn-nvrtc && ln -sf "$(readlink -f "$nv")" /tmp/attn-nvrtc/libnvrtc.so
  export LD_LIBRARY_PATH="/tmp/attn-nvrtc:$(dirname "$nv"):${LD_LIBRARY_PATH:-}"
  ATTN_CUDA_LIB_DIR="/tmp/attn-nvrtc"
fi
echo "NVRTC: ${nv:-not found}"
# Generated conformance cases per kernel (each may compile a new variant).
ATTN_GPU_CASES=${ATTN_GPU_CASES:-128}
# ATTN_REQUIRE_GPU=0 lets a dry run on a machine without a GPU pass.
ATTN_REQUIRE_GPU=${ATTN_REQUIRE_GPU:-1}
export ATTN_CUDA_LIB_DIR ATTN_REQUIRE_GPU ATTN_GPU_CASES
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
status=0
sanitized=""
# Runs one test ($2) of harness $1 in its own process (a sticky CUDA error
# then poisons only that process), logging to $OUT/<harness>.<test>.log. The
# first failure is rerun under compute-sanitizer's memcheck (small case
# count), when the machine's runtime lets it see the GPU.
run_test() {
  local t=$1 name=$2 log
  log="$OUT/$(basename "$t").$name.log"
  if timeout "${TEST_TIMEOUT:-300}" "$t" --exact "$name" --test-threads=1 --nocapture >"$log" 2>&1; then
    echo "ok      $(basename "$t") $name"
    return 0
  fi
  echo "FAILED  $(basename "$t") $name (log: $log)"
  grep -E "panicked|assertion|Error|error" "$log" | head -5
  status=1
  if [ -z "$sanitized" ] && command -v compute-sanitizer >/dev/null; then
    sanitized=1
    echo "        rerunning under compute-sanitizer --tool memcheck ($log.memcheck)"
    ATTN_GPU_CASES=8 timeout 240 compute-sanitizer --tool memcheck --print-limit 20 \
      "$t" --exact "$name" --test-threads=1 --nocapture >"$log.memcheck" 2>&1
    grep -E "Invalid|ERROR SUMMARY|Address|at 0x" "$log.memcheck" | head -8
  fi
  return 1
}
# First the smoke case alone: if it fails, the rest would only repeat it.
conf=$(ls tests/conformance-* | head -1)
if ! run_test "$conf" smoke; then
  echo "smoke case failed: stopping before the suite (FORCE=1 runs it anyway)"
  [ -n "${FORCE:-}" ] || exit 1
fi
grep -E "^GPU:" "$OUT/$(basename "$conf").smoke.log"
# The smoke cases again under compute-sanitizer (out-of-bounds and
# misaligned accesses; shared-memory races of the cp.async pipeline), where
# the runtime lets it see the GPU (Firecracker does, gVisor does not);
# NO_SANITIZE=1 skips.
if [ -z "${NO_SANITIZE:-}" ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    log="$OUT/smoke.$tool.log"
    timeout 300 compute-sanitizer --tool "$tool" --print-limit 20 \
      "$conf" --exact smoke --test-threads=1 --nocapture >"$log" 2>&1
    echo "compute-sanitizer $tool: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|not supported|rror" "$log" | tail -2 | tr '\n' ' ')"
  done
fi
for t in tests/*; do
  for name in $("$t" --list 2>/dev/null | sed -n 's/: test$//p'); do
    [ "$t" = "$conf" ] && [ "$name" = smoke ] && continue
    run_test "$t" "$name"
  done
done
if ! python3 torch_bench.py --attn ./gpu_bench --out "$OUT" ${QUICK:+--quick}; then
  status=1
fi
# Profiles of the tensor-core kernel on a causal prefill and of a GQA decode
# step (with its combine pass), by Nsight Compute where the runtime lets it
# read the counters (Firecracker does, gVisor does not); NO_PROFILE=1 skips.
if [ -z "${NO_PROFILE:-}" ] && command -v ncu >/dev/null; then
  for only in prefill/bf16/s4096/kv4096/causal/mma prefill/bf16/s4096/kv4096/causal/mma-fast \
    decode/bf16/s1/kv32768/full/mma; do
    f="$OUT/ncu-$(echo "$only" | tr / -).txt"
    echo "== ncu $only (report: $f)"
    if ! timeout 300 ncu --clock-control none --launch-count 2 --set detailed \
      ./gpu_bench --only "$only\$" --reps 1 >"$f" 2>&1; then
      echo "ncu failed: $(tail -2 "$f")"
    fi
    grep -E "attn_|Duration|Compute \(SM\) Throughput|DRAM Throughput|Registers Per Thread|Achieved Occupancy" "$f" | head -14
  done
fi
exit $status
"#;

const TORCH_BENCH: &str = r#"#!/usr/bin/env python3
"""attn-cuda vs PyTorch SDPA on the same shapes, both timed with CUDA events
(median), as TFLOP/s and percent of this GPU's measured bf16 matmul peak.
Written by `cargo xtask gpu-check`."""
import argparse, json, subprocess, sys
import torch
import torch.nn.functional as F

def median_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]

def matmul_peak(reps):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, reps)
    return 2 * n**3 / ms / 1e9

def pairs(r):
    sq, sk = r["q_len"], r["kv_len"]
    if not r["causal"]:
        return sq * sk
    # bottom-right causal: row i sees keys 0..=i + sk - sq
    return sum(max(0, min(sk, i + sk - sq + 1)) for i in range(sq))

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attn", required=True)
    ap.add_argument("--out", default="out")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps = 5 if args.quick else 20
    peak = matmul_peak(reps)
    cmd = [args.attn] + (["--quick"] if args.quick else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(p.stderr)
    rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
    timed = {}  # PyTorch once per shape, whichever attn kernels ran on it
    for r in rows:
        b, hq, hkv, sq, sk, d = r["batch"], r["q_heads"], r["kv_heads"], r["q_len"], r["kv_len"], r["head_dim"]
        t = dt[r["dtype"]]
        q = torch.rand(b, hq, sq, d, device="cuda", dtype=t) * 2 - 1
        k = torch.rand(b, hkv, sk, d, device="cuda", dtype=t) * 2 - 1
        v = torch.rand(b, hkv, sk, d, device="cuda", dtype=t) * 2 - 1
        causal = r["causal"]
        # torch's is_causal is top-left; attn's causal is bottom-right: they
        # agree when sq == sk (every causal shape here).
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        key = (b, hq, hkv, sq, sk, d, causal, r["dtype"])
        if key not in timed:
            timed[key] = median_ms(fn, reps)
        ms = timed[key]
        r["torch_ms"] = ms
        r["torch_tflops"] = 4 * b * hq * d * pairs(r) / ms / 1e9
        r["attn_tflops"] = 4 * b * hq * d * pairs(r) / r["ms"] / 1e9
    with open(f"{args.out}/gpu_bench.json", "w") as f:
        json.dump({"bf16_matmul_peak_tflops": peak, "rows": rows}, f, indent=1)
    print(f"bf16 matmul peak (8192^3, median of {reps}): {peak:.1f} TFLOP/s")
    print(f"{'shape':<34} {'kernel':<16} {'attn ms':>9} {'TFLOP/s':>8} {'%peak':>6} {'torch ms':>9} {'TFLOP/s':>8} {'attn/torch':>10}")
    for r in rows:
        name = f"{r['name']} {r['dtype']} b{r['batch']} h{r['q_heads']}/{r['kv_heads']} {r['q_len']}x{r['kv_len']}" + (" causal" if r["causal"] else "")
        print(f"{name:<34} {r['kernel']:<16} {r['ms']:>9.3f} {r['attn_tflops']:>8.1f} {100*r['attn_tflops']/peak:>5.1f}% {r['torch_ms']:>9.3f} {r['torch_tflops']:>8.1f} {r['torch_ms']/r['ms']:>9.2f}x")
    return 0 if rows else 1

if __name__ == "__main__":
    sys.exit(main())
"#;

/// Runs cargo with `args` (release); returns the executables
/// it built (test harnesses only when `tests_only`).
fn cargo_json(args: &[&str], target_dir: &Path, tests_only: bool) -> Result<Vec<PathBuf>, String> {
    let cargo = crate::cargo();
    let out = Command::new(cargo)
        .args(args)
        .args(["--message-format=json", "--release"])
        .env("CARGO_TARGET_DIR", target_dir)
        .current_dir(crate::root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo {} failed", args.join(" ")));
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let is_test = v.pointer("/profile/test").and_then(|t| t.as_bool()) == Some(true);
        if tests_only && !is_test {
            continue;
        }
        if let Some(e) = v.get("executable").and_then(|e| e.as_str()) {
            exes.push(PathBuf::from(e));
        }
    }
    Ok(exes)
}

pub fn run(args: &[String]) -> Result<(), String> {
    let mut out = crate::target_dir().join("gpu-check");
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = PathBuf::from(it.next().ok_or("--out needs a directory")?),
            other => return Err(format!("gpu-check: unknown option {other}")),
        }
    }
    let build = crate::target_dir().join("gpu-check-build");
    // The emulator's tests (`emulated`) run the kernels on the CPU: CI
    // runs them, and on the GPU machine they would only spend its time.
    let tests: Vec<PathBuf> = cargo_json(&["test", "-p", "attn-cuda", "--no-run"], &build, true)?
        .into_iter()
        .filter(|t| {
            t.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with("emulated-"))
        })
        .collect();
    let bench = cargo_json(
        &["build", "-p", "attn-cuda", "--example", "gpu_bench"],
        &build,
        false,
    )?;
    let bench = bench
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == "gpu_bench"))
        .ok_or("no gpu_bench binary was built")?;
    let _ = std::fs::remove_dir_all(&out);
    let tdir = out.join("tests");
    std::fs::create_dir_all(&tdir).map_err(|e| e.to_string())?;
    for t in &tests {
        let name = t.file_name().ok_or("test binary without a name")?;
        std::fs::copy(t, tdir.join(name)).map_err(|e| format!("{}: {e}", t.display()))?;
    }
    std::fs::copy(&bench, out.join("gpu_bench")).map_err(|e| e.to_string())?;
    std::fs::write(out.join("run.sh"), RUN_SH).map_err(|e| e.to_string())?;
    std::fs::write(out.join("torch_bench.py"), TORCH_BENCH).map_err(|e| e.to_string())?;
    println!(
        "gpu-check: wrote {} ({} test binaries, gpu_bench, run.sh, torch_bench.py).\n\
         On a machine with an NVIDIA GPU, its driver and PyTorch: `bash {}/run.sh` \
         (QUICK=1 for short timings; results in $OUT, default ./out).",
        out.display(),
        tests.len(),
        out.display()
    );
    Ok(())
}
