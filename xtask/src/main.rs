//! Repository tasks, run as `cargo xtask <task>` (an alias in
//! `.cargo/config.toml`). A thin dispatcher: one file per task.

// The tasks that run every backend (`bench`, `peak`, `verify`) link
// candle and the bench crate: the `bench` feature, on by default (so that
// `cargo test --workspace` builds and tests them). The `cargo xtask` alias
// builds without it, which keeps the build that CI's tasks wait for (test,
// fuzz, the CUDA and CPU checks) to attn-cpu and attn-cuda; those three
// tasks then run from a second build that has it ([`with_bench`]).
#[cfg(feature = "bench")]
mod bench;
mod candle_cuda;
#[cfg(feature = "bench")]
mod charts;
#[cfg(feature = "bench")]
mod check;
mod cpu_check;
mod cross;
mod cuda;
mod downstream;
mod fuzz;
mod gpu_check;
#[cfg(feature = "bench")]
mod machine;
mod memcheck;
#[cfg(feature = "bench")]
mod ort;
#[cfg(feature = "bench")]
mod report;
mod soak;
#[cfg(feature = "bench")]
mod torch;
#[cfg(feature = "bench")]
mod verify;

use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <task> [options]

tasks:
  bench    measure the machine, check and benchmark every backend compiled in,
           compare with baselines, write target/attn-bench/report.{json,md} and charts
           (default: a representative suite, about 5 minutes on 2 cores after the build,
           with a progress line and the time left per timed case)
           --full             every case of the suite and the long-context memory case
                              (over half an hour on 2 cores)
           --quick            a small subset with short measurements (about 2 minutes)
           --case NAME        only this case (repeatable; see benches/src/lib.rs)
           --backend NAME     only this backend (repeatable: cpu, cpu-bwd, cpu-spin, reference,
                              candle-attn, candle-plain, candle-nn-flash)
           --threads N        only this thread count (repeatable; default 1 and all cores)
           --out DIR          write the report to DIR instead of target/attn-bench
  test     the whole test suite: installs NVRTC and ptxas (PyPI wheels, into a virtualenv
           under ~/.cache/attn, once), runs `cargo test --workspace` with the NVRTC tests
           required, then attn-cpu's conformance suite again on every lower SIMD level this
           CPU runs (ATTN_CPU_ISA=portable, avx2), then `cpu-check` and `cuda-check`
  cpu-check   run attn-cpu's passes once on small problems, disassemble its kernels (in this
           release executable, with objdump) and fail when a level's microkernels move
           vector registers to the stack (spills)
  cuda-setup  only the virtualenv of NVRTC and ptxas
  cuda-check  compile every CUDA kernel variant for sm_80 and sm_90 through NVRTC, print
           ptxas's registers, shared memory and spills per variant, fail on a spill in a
           main kernel (--quiet: main kernels only)
  gpu-check   build attn-cuda's GPU tests and benchmark (portable x86-64) and write a folder
           (target/gpu-check, or --out DIR) whose run.sh, on a machine with an NVIDIA GPU,
           its driver and PyTorch, runs the conformance suite on the GPU and compares
           attn-cuda with PyTorch's SDPA
  candle-cuda-lint  clippy on attn-candle with its `cuda` feature (cuda_fwd), without the
           CUDA toolkit: a stand-in nvcc lets candle-kernels' build script pass
  downstream  build crates/attn/examples/downstream.rs in this workspace and as a fresh
           crate outside it (plain `cargo build --release`, as a user's build), time both on
           1 thread, fail when a case runs below --min (default 0.95) of the workspace's speed
           or the two run different SIMD levels (--rounds N, default 3)
  fuzz     the differential fuzz target (fuzz/): every CPU-side backend against the f64
           reference on decoded arbitrary bytes; libFuzzer with coverage and AddressSanitizer
           on the nightly toolchain, growing fuzz/corpus/differential; without nightly (or
           with --stable) the stable smoke driver (the corpus, then random inputs)
           --minutes N | --seconds N   how long (default 60 s)
  soak     the proptest conformance suites in rounds with fresh seeds and more cases
           (--scale N times the usual, default 8) until --minutes N (default 10) pass;
           a failing round prints the PROPTEST_RNG_SEED that reproduces it
  memcheck attn-cpu's and attn-candle's test binaries under valgrind memcheck
           (AVX2 and portable levels; proptest cases scaled by --scale, default 0.05;
           --all also runs the large-shape tests it skips by default)
  aarch64  attn-cpu's tests built for aarch64 Linux and run under QEMU user mode (the
           portable level on NEON); needs `rustup target add aarch64-unknown-linux-gnu` and
           Debian's gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user; about 10
           minutes; options go to `cargo test` (e.g. `--lib`)
  peak     measure and print the FMA peak and memory bandwidth only
  verify   run the conformance suite on every backend available on this machine
           --cases N          generated cases per backend (default 256)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or_default();
    let result = match args.first().map(String::as_str) {
        #[cfg(feature = "bench")]
        Some("bench") => bench::run(rest),
        #[cfg(feature = "bench")]
        Some("peak") => machine::run_peak(),
        #[cfg(feature = "bench")]
        Some("verify") => verify::run(rest),
        #[cfg(not(feature = "bench"))]
        Some("bench" | "peak" | "verify") => with_bench(&args),
        Some("cpu-check") => cpu_check::run(),
        Some("downstream") => downstream::run(rest),
        Some("fuzz") => fuzz::run(rest),
        Some("soak") => soak::run(rest),
        Some("memcheck") => memcheck::run(rest),
        Some("aarch64") => cross::run(rest),
        Some("test") => test(rest),
        Some("cuda-setup") => cuda::setup().map(|v| println!("cuda-setup: {}", v.display())),
        Some("cuda-check") => cuda::check(rest),
        Some("gpu-check") => gpu_check::run(rest),
        Some("candle-cuda-lint") => candle_cuda::lint(),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo xtask test`: the README's test command (and CI's).
fn test(args: &[String]) -> Result<(), String> {
    // attn-cuda's tests build its kernels for the CPU emulator with the
    // host's C++ compiler: say so before the long build, not after it.
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let has_cxx = std::process::Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_cxx {
        return Err(format!(
            "no C++ compiler `{cxx}` (g++ 12+ or clang 15+; set CXX, or on Debian `apt install g++`): \
             attn-cuda's tests run its kernels on the CPU emulator"
        ));
    }
    let venv = cuda::setup()?;
    let st = std::process::Command::new(cargo())
        .args(["test", "--workspace"])
        .args(args)
        .env("ATTN_CUDA_VENV", &venv)
        .env("ATTN_REQUIRE_NVRTC", "1")
        .current_dir(root())
        .status()
        .map_err(|e| format!("cargo test: {e}"))?;
    if !st.success() {
        return Err("cargo test --workspace failed".into());
    }
    // The workspace run tested attn-cpu on the widest level this CPU has
    // (its unit tests cover every level already); the conformance suite,
    // the thread-count test and the rest of tests/conformance.rs run
    // again on each lower level, forced through ATTN_CPU_ISA, and on the
    // opt-in `amx` level where the CPU runs it.
    let best = attn_cpu::Isa::detected();
    let others = |l: &attn_cpu::Isa| l < &best || (!l.chosen_by_default() && l.supported());
    for isa in attn_cpu::Isa::ALL.into_iter().filter(others) {
        println!("== attn-cpu conformance on SIMD level {isa} (ATTN_CPU_ISA={isa})");
        // `--workspace` keeps the features the run above resolved, so the
        // test binaries it built are reused (`-p attn-cpu` alone resolves
        // dependency features anew and rebuilds for minutes); attn-candle's
        // fused engine, which runs attn-cpu, meets the level too.
        let st = std::process::Command::new(cargo())
            .args(["test", "--workspace", "--test", "conformance"])
            .env("ATTN_CPU_ISA", isa.name())
            .current_dir(root())
            .status()
            .map_err(|e| format!("cargo test: {e}"))?;
        if !st.success() {
            return Err(format!(
                "attn-cpu's conformance suite failed on level {isa}"
            ));
        }
    }
    cpu_check::run()?;
    cuda::check(&["--quiet".to_string()])
}

/// Runs this task from a build of this program with the `bench` feature
/// (the second build the alias's lean one hands these tasks to).
#[cfg(not(feature = "bench"))]
fn with_bench(args: &[String]) -> Result<(), String> {
    eprintln!(
        "xtask: `{}` runs from a build with the bench feature (building it) ...",
        args[0]
    );
    let st = std::process::Command::new(cargo())
        .args([
            "run",
            "--package",
            "xtask",
            "--release",
            "--quiet",
            "--features",
            "bench",
            "--",
        ])
        .args(args)
        .current_dir(root())
        .status()
        .map_err(|e| format!("cargo run (xtask with the bench feature): {e}"))?;
    if st.success() {
        Ok(())
    } else {
        // That build (or cargo) has said what went wrong.
        std::process::exit(st.code().unwrap_or(1))
    }
}

/// The CPU's model name from `/proc/cpuinfo`, or `unknown`.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The workspace root (the parent of this crate's directory).
pub fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// The cargo that runs this task: `$CARGO` (set by cargo for the
/// programs it runs), else `cargo` on the path.
pub fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// The cargo target directory.
pub fn target_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), Into::into)
}
