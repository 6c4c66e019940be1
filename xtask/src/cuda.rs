//! `cargo xtask cuda-setup` and `cargo xtask cuda-check`: the CUDA
//! compiler pieces a machine without CUDA needs (NVRTC and ptxas, from
//! PyPI wheels, in a virtualenv outside the clone), and a compile of every
//! kernel variant for sm_80 and sm_90 with ptxas's resource report.

use attn_cuda::variant::{check_variants, Kernel, Variant};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The wheels, pinned to the CUDA version cudarc is built for (12.8).
/// The kernels include no CUDA header, so the runtime-headers wheel is not
/// needed.
const WHEELS: [&str; 2] = [
    "nvidia-cuda-nvrtc-cu12==12.8.93",
    "nvidia-cuda-nvcc-cu12==12.8.93",
];

fn venv() -> Result<PathBuf, String> {
    attn_cuda::libs::default_venv().ok_or_else(|| "neither $HOME nor $ATTN_CUDA_VENV is set".into())
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let st = cmd.status().map_err(|e| format!("{cmd:?}: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed: {st}"))
    }
}

/// Creates the virtualenv and installs the wheels, unless a previous run
/// did (a marker file names the pinned set). Returns the venv.
pub fn setup() -> Result<PathBuf, String> {
    let v = venv()?;
    let marker = v.join("attn-wheels.txt");
    let want = WHEELS.join("\n");
    if std::fs::read_to_string(&marker).ok().as_deref() == Some(want.as_str()) {
        return Ok(v);
    }
    let python = std::env::var("ATTN_SETUP_PYTHON").unwrap_or_else(|_| "python3".into());
    eprintln!(
        "cuda-setup: creating {} with {}",
        v.display(),
        WHEELS.join(", ")
    );
    if let Some(parent) = v.parent() {
        std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
    }
    run(Command::new(&python).args(["-m", "venv"]).arg(&v))?;
    run(Command::new(v.join("bin").join("python"))
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(WHEELS))?;
    std::fs::write(&marker, want).map_err(|e| e.to_string())?;
    Ok(v)
}

/// `ptxas` inside the venv.
fn ptxas(venv: &Path) -> Result<PathBuf, String> {
    let lib = venv.join("lib");
    for e in std::fs::read_dir(&lib).map_err(|e| format!("{}: {e}", lib.display()))? {
        let p = e
            .map_err(|e| e.to_string())?
            .path()
            .join("site-packages/nvidia/cuda_nvcc/bin/ptxas");
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(format!("no ptxas under {}", lib.display()))
}

/// What ptxas reported for one variant.
#[derive(Debug, Default)]
struct Usage {
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    stack: u32,
}

fn parse_ptxas(log: &str) -> Usage {
    let num_before = |s: &str, key: &str| -> u32 {
        s.find(key)
            .and_then(|i| s[..i].split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let mut u = Usage::default();
    for line in log.lines() {
        if line.contains("Used") && line.contains("registers") {
            u.registers = num_before(line, "registers");
        }
        if line.contains("spill stores") {
            u.stack = num_before(line, "bytes stack frame");
            u.spill_stores = num_before(line, "bytes spill stores");
            u.spill_loads = num_before(line, "bytes spill loads");
        }
    }
    u
}

/// The main kernels, which must not spill.
fn is_main(v: &Variant) -> bool {
    matches!(
        v.kernel,
        Kernel::Mma | Kernel::MmaFast | Kernel::Simt | Kernel::BwdDq | Kernel::BwdDkdv
    )
}

/// Compiles `v` with NVRTC, writes its PTX, and runs ptxas on it.
fn assemble(
    ptxas: &Path,
    out_dir: &Path,
    arch: &str,
    n: usize,
    v: &Variant,
) -> Result<(Variant, Usage), String> {
    let ptx = attn_cuda::compile::ptx(v).map_err(|e| e.to_string())?;
    let file = out_dir.join(format!("{arch}-{n:03}-{}.ptx", v.kernel.function()));
    std::fs::write(&file, ptx.to_src()).map_err(|e| e.to_string())?;
    let o = Command::new(ptxas)
        .args(["-v", "-arch", arch, "-o", "/dev/null"])
        .arg(&file)
        .output()
        .map_err(|e| format!("{}: {e}", ptxas.display()))?;
    let log = String::from_utf8_lossy(&o.stderr).to_string() + &String::from_utf8_lossy(&o.stdout);
    if !o.status.success() {
        return Err(format!("ptxas failed on {}:\n{log}", v.describe()));
    }
    Ok((*v, parse_ptxas(&log)))
}

pub fn check(args: &[String]) -> Result<(), String> {
    let quiet = args.iter().any(|a| a == "--quiet");
    let venv = setup()?;
    let ptxas = ptxas(&venv)?;
    let out_dir = crate::target_dir().join("attn-cuda-check");
    std::fs::create_dir_all(&out_dir).map_err(|e| e.to_string())?;
    let jobs: Vec<(&str, usize, Variant)> = [((8, 0), "sm_80"), ((9, 0), "sm_90")]
        .into_iter()
        .flat_map(|(arch, name)| {
            check_variants(arch)
                .into_iter()
                .enumerate()
                .map(move |(n, v)| (name, n, v))
        })
        .collect();
    // NVRTC and ptxas are single-threaded: one worker per core.
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = jobs.len().div_ceil(workers);
    let results: Vec<Result<(Variant, Usage), String>> = std::thread::scope(|sc| {
        let handles: Vec<_> = jobs
            .chunks(chunk)
            .map(|part| {
                let (ptxas, out_dir) = (&ptxas, &out_dir);
                sc.spawn(move || {
                    part.iter()
                        .map(|(name, n, v)| assemble(ptxas, out_dir, name, *n, v))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec![Err("worker panicked".into())])
            })
            .collect()
    });
    let mut failures = Vec::new();
    let mut rows = Vec::new();
    for r in results {
        let (v, u) = r?;
        if is_main(&v) && (u.spill_stores > 0 || u.spill_loads > 0) {
            failures.push(format!(
                "{}: {} bytes spill stores, {} bytes spill loads",
                v.describe(),
                u.spill_stores,
                u.spill_loads
            ));
        }
        rows.push((v, u));
    }
    println!(
        "{:<58} {:>5} {:>9} {:>7} {:>7} {:>7}",
        "variant", "regs", "smem(dyn)", "stack", "spill-s", "spill-l"
    );
    for (v, u) in &rows {
        if quiet && !is_main(v) {
            continue;
        }
        println!(
            "{:<58} {:>5} {:>9} {:>7} {:>7} {:>7}",
            v.describe(),
            u.registers,
            v.smem_bytes(),
            u.stack,
            u.spill_stores,
            u.spill_loads
        );
    }
    println!(
        "cuda-check: {} variants compiled by NVRTC and assembled by ptxas (sm_80, sm_90); PTX in {}",
        rows.len(),
        out_dir.display()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("spills in main kernels:\n{}", failures.join("\n")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ptxas_reports() {
        let log = "ptxas info    : Compiling entry function 'attn_mma' for 'sm_90'\n\
                   ptxas info    : Function properties for attn_mma\n\
                   \x20   16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 168 registers, used 1 barriers, 400 bytes cmem[0]\n";
        let u = parse_ptxas(log);
        assert_eq!(
            (u.registers, u.stack, u.spill_stores, u.spill_loads),
            (168, 16, 8, 12)
        );
    }
}
