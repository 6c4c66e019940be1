//! `cargo xtask verify`: the conformance suite (hand-computed cases, bad
//! input, and generated cases against the f64 reference) on every backend
//! compiled in that runs on this machine.

use attn::{Engine, EngineKind};

/// Runs the suite; fails on the first backend that fails.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut cases = 256u32;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--cases" => {
                cases = it
                    .next()
                    .and_then(|n| n.parse().ok())
                    .ok_or("--cases needs a number")?
            }
            other => return Err(format!("verify: unknown option {other}")),
        }
    }
    // The GPU runs below on its own buffers, not through the host engine.
    for kind in EngineKind::compiled()
        .into_iter()
        .filter(|&k| k != EngineKind::Cuda)
    {
        match Engine::of(kind) {
            Ok(engine) => {
                println!(
                    "verify {:?}: {cases} generated cases + hand-computed + bad input ...",
                    kind
                );
                let r = attn_conformance::run_suite(&engine, cases)?;
                println!(
                    "  passed {} (skipped as unsupported: {})",
                    r.passed, r.skipped
                );
            }
            Err(e) => println!("verify {kind:?}: skipping: {e}"),
        }
    }
    match attn_cuda::Cuda::first() {
        Ok(gpu) => {
            println!(
                "verify attn-cuda on {}: {cases} generated cases + hand-computed + bad input ...",
                gpu.device_name()
            );
            let r = attn_conformance::run_suite(&gpu, cases)?;
            println!(
                "  passed {} (skipped as unsupported: {})",
                r.passed, r.skipped
            );
        }
        Err(e) => println!("verify attn-cuda: skipping: {e}"),
    }
    println!("all backends available on this machine pass");
    Ok(())
}
