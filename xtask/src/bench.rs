//! `cargo xtask bench`: runs the criterion benches of the `benches/` member
//! (every backend compiled into `attn`, over the shape table in
//! `benches/src/lib.rs`).

use std::process::Command;

/// Runs the benches; `--quick` shortens measurement for a smoke run.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut extra: Vec<String> = Vec::new();
    for a in args {
        match a.as_str() {
            "--quick" => extra
                .extend(["--warm-up-time", "0.2", "--measurement-time", "0.5"].map(String::from)),
            other => extra.push(other.to_string()),
        }
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["bench", "-p", "attn-benches", "--bench", "attention", "--"])
        .args(&extra)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("cargo bench failed: {status}"))
    }
}
