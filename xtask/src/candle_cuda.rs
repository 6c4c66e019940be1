//! `cargo xtask candle-cuda-lint`: type-checks and lints attn-candle with
//! its `cuda` feature (the custom op's `cuda_fwd`, attn-cuda linked the way
//! candle links cudarc) on a machine without the CUDA toolkit, so that code
//! cannot rot unseen.
//!
//! candle-core's `cuda` feature builds candle-kernels, whose build script
//! runs nvcc to make PTX and a static library. `cargo clippy` runs build
//! scripts but links nothing and runs nothing, so a stand-in `nvcc` that
//! writes empty PTX files and an empty library is enough for it. Nothing
//! built this way can run: the real build needs the toolkit.
//!
//! It shares the workspace's target directory: the crates whose features
//! or build environment differ here (candle-core and candle-kernels with
//! `cuda`, cudarc linked dynamically, attn-cuda, attn-candle) get
//! artifacts of their own, and everything else is the main clippy run's,
//! so this takes seconds after it instead of checking the whole tree again
//! (2m17s on CI's two cores), and invalidates nothing of the main build.

use std::path::Path;
use std::process::Command;

/// The stand-in: answers `--version`, writes an empty `.ptx` per `.cu`
/// for `--ptx`, an empty object for `-c`, an archive for `--lib`.
const STAND_IN: &str = r#"#!/bin/sh
# nvcc stand-in for `cargo xtask candle-cuda-lint` only: writes empty
# outputs so candle-kernels' build script succeeds under `cargo clippy`.
out=""; outdir="."; mode=""; prev=""; files=""; objs=""
for a in "$@"; do
  case "$prev" in
    -o) out="$a";;
    --output-directory) outdir="$a";;
  esac
  case "$a" in
    --version)
      echo "nvcc: stand-in for cargo xtask candle-cuda-lint"
      echo "(no NVIDIA compiler here)"
      echo "(cudarc reads the fourth line)"
      echo "Cuda compilation tools, release 12.8, V12.8.0"
      echo "Build stand-in"
      exit 0;;
    --list-gpu-arch) echo compute_80; echo compute_90; exit 0;;
    --ptx) mode=ptx;;
    -c) mode=obj;;
    --lib) mode=lib;;
    *.cu) files="$files $a";;
    *.o) objs="$objs $a";;
  esac
  prev="$a"
done
case "$mode" in
  ptx) for f in $files; do : > "$outdir/$(basename "$f" .cu).ptx"; done;;  # one .cu per call
  obj) echo 'void attn_nvcc_stand_in(void) {}' | cc -x c -c -o "$out" -;;
  lib) rm -f "$out"; ar rcs "$out" $objs;;
esac
"#;

/// Writes the stand-in and runs clippy on attn-candle with `cuda`.
pub fn lint() -> Result<(), String> {
    let dir = crate::target_dir().join("candle-cuda-lint").join("bin");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let nvcc = dir.join("nvcc");
    std::fs::write(&nvcc, STAND_IN).map_err(|e| format!("{}: {e}", nvcc.display()))?;
    make_executable(&nvcc)?;
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![dir.clone()];
    paths.extend(std::env::split_paths(&path));
    let path = std::env::join_paths(paths).map_err(|e| format!("PATH: {e}"))?;
    let cargo = crate::cargo();
    // A target directory of its own: the empty PTX files must never be
    // found by a real build (candle-kernels' cache does not look at nvcc).
    let st = Command::new(cargo)
        .args([
            "clippy",
            "-p",
            "attn-candle",
            "--features",
            "cuda",
            "--all-targets",
        ])
        .args(["--", "-D", "warnings"])
        .env("PATH", path)
        .env("NVCC", &nvcc)
        .env("CUDA_COMPUTE_CAP", "90")
        .current_dir(crate::root())
        .status()
        .map_err(|e| format!("cargo clippy: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err("clippy of attn-candle with the cuda feature failed".into())
    }
}

#[cfg(unix)]
fn make_executable(p: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("{}: {e}", p.display()))
}

#[cfg(not(unix))]
fn make_executable(_: &Path) -> Result<(), String> {
    Err("candle-cuda-lint's nvcc stand-in is a shell script: unix only".into())
}
