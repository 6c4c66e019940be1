//! Repository tasks, run as `cargo xtask <task>` (an alias in
//! `.cargo/config.toml`). A thin dispatcher: one file per task.

mod bench;

use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <task>

tasks:
  bench [--quick] [criterion args...]   benchmark every backend compiled into attn";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("bench") => bench::run(&args[1..]),
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
