//! `cargo xtask downstream`: what a crate that depends on attn gets. The
//! example `crates/attn/examples/downstream.rs` is built twice: inside this
//! workspace (its release profile), and as the `main.rs` of a fresh crate
//! in a temporary folder outside it, with a path dependency on `attn` and a
//! plain `cargo build --release` (no RUSTFLAGS, no `.cargo/config.toml`, no
//! workspace profile: what a user's build does). Both run alternately on
//! one thread; the table gives each case's best time on both sides and the
//! downstream speed as a fraction of the workspace's, and the task fails
//! when a case falls below `--min` (default 0.95). Both sides must also run
//! the same SIMD level: attn-cpu detects the CPU at run time, so no build
//! flag may change it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Environment variables that would let this run's settings leak into the
/// downstream build.
const LEAKS: &[&str] = &[
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_BUILD_RUSTFLAGS",
    "CARGO_TARGET_DIR",
    "ATTN_CPU_ISA",
];

pub fn run(args: &[String]) -> Result<(), String> {
    let mut min = 0.95;
    let mut rounds = 3;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |what: &str| -> Result<f64, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{a} takes {what}"))
        };
        match a.as_str() {
            "--min" => min = value("a fraction")?,
            "--rounds" => rounds = value("a count")? as usize,
            other => return Err(format!("downstream: unknown option {other}")),
        }
    }
    let root = crate::root();
    let cargo = crate::cargo();
    let inside = build_inside(&cargo, &root)?;
    let outside = build_outside(&cargo, &root)?;
    let mut best: BTreeMap<String, [f64; 2]> = BTreeMap::new();
    let mut isas = [String::new(), String::new()];
    for round in 0..rounds {
        eprintln!("round {} of {rounds} ...", round + 1);
        for (side, exe) in [&inside, &outside].into_iter().enumerate() {
            let (isa, cases) = time(exe)?;
            isas[side] = isa;
            for (name, ms) in cases {
                let e = best.entry(name).or_insert([f64::INFINITY; 2]);
                e[side] = e[side].min(ms);
            }
        }
    }
    println!(
        "SIMD level: workspace {}, downstream {} (CPU: {})",
        isas[0],
        isas[1],
        crate::cpu_model()
    );
    println!(
        "| case (1 thread) | workspace ms | downstream ms | downstream speed |\n|---|---|---|---|"
    );
    let mut worst = f64::INFINITY;
    for (name, [w, d]) in &best {
        let ratio = w / d;
        worst = worst.min(ratio);
        println!("| {name} | {w:.3} | {d:.3} | {ratio:.3}x |");
    }
    if isas[0] != isas[1] {
        return Err(format!(
            "the two builds run different SIMD levels ({} and {})",
            isas[0], isas[1]
        ));
    }
    if worst < min {
        return Err(format!(
            "a downstream case ran at {worst:.3}x the workspace's speed (minimum {min})"
        ));
    }
    Ok(())
}

/// Builds the example in the workspace; returns its path.
fn build_inside(cargo: &str, root: &Path) -> Result<PathBuf, String> {
    let st = Command::new(cargo)
        .args([
            "build",
            "--release",
            "-p",
            "attn",
            "--example",
            "downstream",
        ])
        .current_dir(root)
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !st.success() {
        return Err("building the example in the workspace failed".into());
    }
    Ok(crate::target_dir().join("release/examples/downstream"))
}

/// Writes the downstream crate into a temporary folder and builds it as a
/// user would; returns the binary's path.
fn build_outside(cargo: &str, root: &Path) -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join("attn-downstream-check");
    let src = dir.join("src");
    std::fs::create_dir_all(&src).map_err(|e| format!("{}: {e}", src.display()))?;
    let manifest = format!(
        "[package]\nname = \"attn-downstream-check\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n[dependencies]\nattn = {{ path = {:?} }}\n\n# Not part of any workspace above it.\n[workspace]\n",
        root.join("crates/attn").display().to_string()
    );
    let write =
        |p: PathBuf, s: &[u8]| std::fs::write(&p, s).map_err(|e| format!("{}: {e}", p.display()));
    write(dir.join("Cargo.toml"), manifest.as_bytes())?;
    let example = root.join("crates/attn/examples/downstream.rs");
    let code = std::fs::read(&example).map_err(|e| format!("{}: {e}", example.display()))?;
    write(src.join("main.rs"), &code)?;
    // The workspace's lock file: the same dependency versions, no
    // resolution against the registry.
    let lock = std::fs::read(root.join("Cargo.lock")).map_err(|e| format!("Cargo.lock: {e}"))?;
    write(dir.join("Cargo.lock"), &lock)?;
    let target = crate::target_dir().join("downstream");
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--release"]).current_dir(&dir);
    for v in LEAKS {
        cmd.env_remove(v);
    }
    let st = cmd
        .env("CARGO_TARGET_DIR", &target)
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !st.success() {
        return Err(format!(
            "building the downstream crate in {} failed",
            dir.display()
        ));
    }
    Ok(target.join("release/attn-downstream-check"))
}

/// Runs one binary on one thread; returns its SIMD level and its cases.
fn time(exe: &Path) -> Result<(String, Vec<(String, f64)>), String> {
    let mut cmd = Command::new(exe);
    for v in LEAKS {
        cmd.env_remove(v);
    }
    let out = cmd
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            exe.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut isa = String::new();
    let mut cases = Vec::new();
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["isa", l] => isa = l.to_string(),
            ["case", name, ms] => {
                let ms: f64 = ms.parse().map_err(|_| format!("bad line: {line}"))?;
                cases.push((name.to_string(), ms));
            }
            _ => {}
        }
    }
    Ok((isa, cases))
}
