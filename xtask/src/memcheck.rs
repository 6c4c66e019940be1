//! `cargo xtask memcheck`: attn-cpu's test binaries (the SIMD kernels, the
//! packing, the thread pool) and attn-candle's (candle's
//! op reading tensors in place) under valgrind's memcheck, on every SIMD
//! level valgrind runs (it executes no AVX-512 and hides it from CPUID, so
//! the AVX2 and portable kernels are what it sees), with proptest case
//! counts scaled down (`ATTN_CASES_SCALE`, default 0.05). Any invalid read
//! or write, use of uninitialised memory or definite leak fails.
//!
//! Tests that repeat the suite's code paths on large shapes (thousands of
//! keys, whole training runs: minutes natively become hours under
//! valgrind's ~50x) are skipped unless `--all` is given: [`SLOW`].

use crate::root;
use std::process::Command;

/// Tests skipped without `--all`: the thread-count invariance tests and the
/// paired-block test (long key spans), the split-KV decode cases (thousands
/// of keys), the 2^24-key hand case's home tests, and the training run.
const SLOW: [&str; 7] = [
    "paired_blocks_pass",
    "results_do_not_depend_on_the_thread_count",
    "gradients_do_not_depend_on_the_thread_count",
    "split_kv_decoding_passes",
    "split_kv_decode_cases_on_both_engines",
    "hand_computed_cases_on_both_engines",
    "a_few_steps_lower_the_loss",
];

/// Builds the test binaries and runs each under memcheck.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut scale = "0.05".to_string();
    let mut all = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--scale" => scale = it.next().ok_or("--scale needs a number")?.clone(),
            "--all" => all = true,
            other => return Err(format!("memcheck: unknown option {other}")),
        }
    }
    let ok = Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        return Err("memcheck needs valgrind (Debian: apt-get install valgrind)".into());
    }
    let cargo = crate::cargo();
    let out = Command::new(&cargo)
        .args([
            "test",
            "--profile",
            "test",
            "--no-run",
            "--message-format=json",
        ])
        .arg("--workspace")
        .current_dir(root())
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "building the test binaries failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        // Test harnesses only (examples are built too, and are programs).
        let harness = msg.pointer("/profile/test").and_then(|t| t.as_bool()) == Some(true);
        // attn-cpu's and attn-candle's (built with the workspace's feature
        // resolution, so `cargo xtask test`'s build is reused).
        let ours = msg
            .get("package_id")
            .and_then(|p| p.as_str())
            .is_some_and(|p| p.contains("/crates/attn-cpu#") || p.contains("/crates/attn-candle#"));
        if let Some(exe) = msg.get("executable").and_then(|e| e.as_str()) {
            if harness && ours {
                exes.push(exe.to_string());
            }
        }
    }
    if exes.is_empty() {
        return Err("no test executables found".into());
    }
    for isa in ["avx2", "portable"] {
        for exe in &exes {
            let name = std::path::Path::new(exe)
                .file_name()
                .map_or(exe.as_str(), |n| n.to_str().unwrap_or(exe));
            println!("== memcheck {name} (ATTN_CPU_ISA={isa}, ATTN_CASES_SCALE={scale})");
            let st = Command::new("valgrind")
                .args([
                    "--tool=memcheck",
                    "--error-exitcode=99",
                    "--leak-check=full",
                    "--errors-for-leak-kinds=definite",
                    "--show-leak-kinds=definite",
                    "-q",
                ])
                .arg(exe)
                .args(["--test-threads=2"])
                .args(
                    if all { &[][..] } else { &SLOW[..] }
                        .iter()
                        .flat_map(|t| ["--skip", t]),
                )
                .env("ATTN_CPU_ISA", isa)
                .env("ATTN_CASES_SCALE", &scale)
                .current_dir(root())
                .status()
                .map_err(|e| format!("valgrind: {e}"))?;
            if !st.success() {
                return Err(format!(
                    "memcheck failed on {name} (ATTN_CPU_ISA={isa}): exit status {st}"
                ));
            }
        }
    }
    println!(
        "memcheck: {} binaries clean on avx2 and portable",
        exes.len()
    );
    Ok(())
}
