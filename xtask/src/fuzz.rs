//! `cargo xtask fuzz`: the differential fuzz target (`fuzz/`) under
//! libFuzzer, coverage-guided, with AddressSanitizer, on a nightly
//! toolchain (built the way cargo-fuzz builds it, without needing
//! cargo-fuzz installed); `--stable`, or any machine without nightly, runs
//! the same check from the stable `smoke` binary on random inputs (no
//! coverage guidance; `cargo test` replays the committed corpus).

use crate::root;
use std::path::Path;
use std::process::Command;

const TARGET: &str = "x86_64-unknown-linux-gnu";

/// Runs the fuzzer for the asked time.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut seconds = 60u64;
    let mut stable = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |what: &str| -> Result<u64, String> {
            it.next()
                .and_then(|n| n.parse().ok())
                .ok_or(format!("{what} needs a number"))
        };
        match a.as_str() {
            "--minutes" => seconds = num("--minutes")? * 60,
            "--seconds" => seconds = num("--seconds")?,
            "--stable" => stable = true,
            other => return Err(format!("fuzz: unknown option {other}")),
        }
    }
    let root = root();
    let corpus = root.join("fuzz/corpus/differential");
    let nightly = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if stable || !nightly || !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
        if !stable {
            println!("fuzz: no nightly toolchain (rustup run nightly): the stable smoke instead");
        }
        return smoke(&root, seconds);
    }
    libfuzzer(&root, &corpus, seconds)
}

/// The stable driver as `cargo test --workspace` builds it (for the fuzz
/// crate's integration test), so after `cargo xtask test` nothing is
/// rebuilt: a `cargo build` would resolve features without the
/// dev-dependencies and rebuild the dependency tree for minutes.
fn smoke(root: &Path, seconds: u64) -> Result<(), String> {
    let cargo = crate::cargo();
    let out = Command::new(cargo)
        .args(["test", "--profile", "test", "--workspace", "--no-run"])
        .arg("--message-format=json")
        .current_dir(root)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !out.status.success() {
        return Err("building the fuzz smoke driver failed".into());
    }
    // The `smoke` program itself (not its unit-test harness).
    let bin = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|m| {
            m.pointer("/target/name").and_then(|n| n.as_str()) == Some("smoke")
                && m.pointer("/profile/test").and_then(|t| t.as_bool()) == Some(false)
        })
        .and_then(|m| {
            m.get("executable")
                .and_then(|e| e.as_str())
                .map(String::from)
        })
        .ok_or("cargo test --no-run built no `smoke` program")?;
    // Random inputs only: `cargo test` replays the corpus
    // (`fuzz/tests/corpus.rs`).
    let st = Command::new(&bin)
        .args(["--seconds", &seconds.to_string()])
        .current_dir(root)
        .status()
        .map_err(|e| format!("{bin}: {e}"))?;
    st.success()
        .then_some(())
        .ok_or("fuzz smoke failed (the input is under fuzz/artifacts)".into())
}

/// The libFuzzer target, built with nightly and sanitizer-coverage flags
/// into its own target directory, run for `seconds` on the committed
/// corpus (new inputs that reach new coverage are added to it).
fn libfuzzer(root: &Path, corpus: &Path, seconds: u64) -> Result<(), String> {
    let target_dir = crate::target_dir().join("fuzz");
    let flags = [
        "-Cpasses=sancov-module",
        "-Cllvm-args=-sanitizer-coverage-level=4",
        "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
        "-Cllvm-args=-sanitizer-coverage-pc-table",
        "-Cllvm-args=-sanitizer-coverage-trace-compares",
        "--cfg=fuzzing",
        "-Cdebug-assertions",
        "-Coverflow-checks",
        "-Zsanitizer=address",
        "-Cforce-frame-pointers",
    ]
    .join(" ");
    println!("fuzz: building the libFuzzer target (nightly, ASan, coverage) ...");
    let st = Command::new("rustup")
        .args(["run", "nightly", "cargo", "build", "--release"])
        .args([
            "-p",
            "attn-fuzz",
            "--features",
            "libfuzzer",
            "--bin",
            "differential",
        ])
        .args(["--target", TARGET])
        .arg("--target-dir")
        .arg(&target_dir)
        .env("RUSTFLAGS", flags)
        .env_remove("CARGO")
        .env_remove("RUSTC")
        .env_remove("RUSTUP_TOOLCHAIN")
        .current_dir(root)
        .status()
        .map_err(|e| format!("rustup run nightly cargo build: {e}"))?;
    if !st.success() {
        return Err("building the fuzz target failed".into());
    }
    let bin = target_dir.join(TARGET).join("release/differential");
    let artifacts = root.join("fuzz/artifacts");
    std::fs::create_dir_all(&artifacts).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(corpus).map_err(|e| e.to_string())?;
    println!("fuzz: running for {seconds} s on {}", corpus.display());
    let st = Command::new(&bin)
        .arg(format!("-max_total_time={seconds}"))
        .arg("-max_len=2048")
        .arg("-rss_limit_mb=4096")
        .arg("-timeout=60")
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg(corpus)
        // One rayon pool for the whole process; ASan's leak check at exit
        // would report the thread pools' allocations, which live on purpose.
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .current_dir(root)
        .status()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    st.success()
        .then_some(())
        .ok_or("the fuzzer found a failing input (under fuzz/artifacts)".into())
}
