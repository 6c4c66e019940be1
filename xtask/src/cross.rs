//! `cargo xtask aarch64`: attn-cpu's tests built for 64-bit ARM Linux and
//! run under QEMU's user-mode emulator. On aarch64 attn-cpu runs its
//! portable level (`wide` on NEON), whose lane operations differ from
//! x86's in corners the kernels rely on (NEON's `fmax` returns NaN where
//! x86's `maxps` returns its second operand); these tests are where such a
//! difference shows. Needs the Rust target (`rustup target add
//! aarch64-unknown-linux-gnu`), a cross linker and QEMU (Debian: `apt-get
//! install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user`). The
//! emulator runs the kernels some 10-50x slower than the host, so the whole
//! of attn-cpu's tests take about 10 minutes on 2 cores: not part of CI,
//! which has none of these tools.

use crate::root;
use std::process::Command;

const TARGET: &str = "aarch64-unknown-linux-gnu";
const LINKER: &str = "aarch64-linux-gnu-gcc";
const QEMU: &str = "qemu-aarch64";
/// Where Debian's cross packages put the aarch64 C library, for QEMU.
const SYSROOT: &str = "/usr/aarch64-linux-gnu";

/// Checks the tools, then runs `cargo test -p attn-cpu` for aarch64 under
/// QEMU, with `args` passed on to `cargo test` (for example `--lib`, or a
/// test name filter after `--`).
pub fn run(args: &[String]) -> Result<(), String> {
    let has = |cmd: &str, arg: &str| {
        Command::new(cmd)
            .arg(arg)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l == TARGET)
        });
    let mut missing = Vec::new();
    if !installed {
        missing.push(format!("the Rust target (rustup target add {TARGET})"));
    }
    if !has(LINKER, "--version") {
        missing.push(format!(
            "the cross linker {LINKER} (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross)"
        ));
    }
    if !has(QEMU, "--version") {
        missing.push(format!("{QEMU} (apt-get install qemu-user)"));
    }
    if !missing.is_empty() {
        return Err(format!("aarch64 needs {}", missing.join(", ")));
    }
    let cargo = crate::cargo();
    let st = Command::new(cargo)
        .args(["test", "-p", "attn-cpu", "--target", TARGET])
        .args(args)
        .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", LINKER)
        .env(
            "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
            format!("{QEMU} -L {SYSROOT}"),
        )
        .current_dir(root())
        .status()
        .map_err(|e| format!("cargo test: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!(
            "attn-cpu's tests failed on {TARGET} (under {QEMU})"
        ))
    }
}
