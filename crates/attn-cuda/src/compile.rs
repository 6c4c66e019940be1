//! Run-time compilation: a variant's source through NVRTC, to machine code
//! (a CUBIN) for the device's own architecture where this NVRTC knows it,
//! else to PTX for the newest architecture it knows below the device's,
//! which the driver compiles when it loads the module. Works without a GPU
//! (only NVRTC is needed), which is how CI compiles every variant.
//!
//! Why machine code: PTX carries the PTX ISA version of the NVRTC that
//! wrote it, and a driver older than that NVRTC refuses it (NVRTC 12.8
//! writes PTX ISA 8.7, which drivers before R570 reject), while a CUBIN
//! runs on every driver of the same CUDA major version (CUDA's minor
//! version compatibility). The driver also has nothing left to compile at
//! load.

use crate::libs;
use crate::variant::Variant;
use attn_spec::{AttnError, Result};
use cudarc::nvrtc::{result, sys, Ptx};
use std::ffi::{c_int, CString};
use std::fmt;

/// What NVRTC builds for a device; architectures as `10 * major + minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// Machine code for this architecture (`sm_XY`), loaded as it is.
    Cubin(u32),
    /// PTX for this architecture (`compute_XY`), compiled by the driver at
    /// load: for a device newer than every architecture NVRTC knows.
    Ptx(u32),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Cubin(a) => write!(f, "CUBIN for sm_{a}"),
            Target::Ptx(a) => write!(f, "PTX for compute_{a}"),
        }
    }
}

impl Target {
    /// The target of a device of compute capability `cc` for an NVRTC that
    /// knows the architectures `known`: its own architecture's machine code
    /// when NVRTC knows it, else PTX for the newest known architecture
    /// below it (PTX runs on any newer device); `None` when NVRTC knows
    /// none at or below it.
    pub fn for_device(cc: (u32, u32), known: &[u32]) -> Option<Target> {
        let own = 10 * cc.0 + cc.1;
        if known.contains(&own) {
            return Some(Target::Cubin(own));
        }
        known
            .iter()
            .copied()
            .filter(|&a| a < own)
            .max()
            .map(Target::Ptx)
    }

    /// NVRTC's `--gpu-architecture` value: `sm_XY` makes machine code,
    /// `compute_XY` PTX.
    fn flag(self) -> String {
        match self {
            Target::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
            Target::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
        }
    }
}

/// The NVRTC options of every variant besides its target: IEEE arithmetic
/// (no fast-math: `expf`, `logf` and `tanhf` keep their documented
/// accuracy, which the conformance bound assumes), contraction to FMA.
const FLAGS: [&str; 4] = [
    "--fmad=true",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

/// NVRTC's options for `target`: the target, then IEEE arithmetic with
/// contraction to FMA (the private `FLAGS`).
pub fn options(target: Target) -> Vec<String> {
    let mut o = vec![target.flag()];
    o.extend(FLAGS.iter().map(|s| s.to_string()));
    o
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(u32, u32)> {
    libs::nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: NVRTC is loaded (checked above); the call writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| nvrtc_error("nvrtcVersion", format!("{e:?}")))?;
    Ok((major as u32, minor as u32))
}

/// The architectures this NVRTC compiles for, as `10 * major + minor`.
pub fn known_archs() -> Result<Vec<u32>> {
    libs::nvrtc()?;
    let mut n: c_int = 0;
    // SAFETY: NVRTC is loaded (checked above); the call writes one int.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| nvrtc_error("nvrtcGetNumSupportedArchs", format!("{e:?}")))?;
    let mut archs: Vec<c_int> = vec![0; n.max(0) as usize];
    // SAFETY: `archs` holds the `n` ints NVRTC said it would write.
    unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(|e| nvrtc_error("nvrtcGetSupportedArchs", format!("{e:?}")))?;
    Ok(archs.into_iter().map(|a| a as u32).collect())
}

fn nvrtc_error(what: &str, log: String) -> AttnError {
    AttnError::Nvrtc {
        variant: what.into(),
        log,
    }
}

/// Compiles `v` to PTX for its architecture (`v.arch`, as
/// [`Variant::arch_name`] names it), as `cargo xtask cuda-check` and the
/// tests read it.
pub fn ptx(v: &Variant) -> Result<Ptx> {
    let arch = v.arch_name().trim_start_matches("sm_");
    build(
        v,
        Target::Ptx(arch.parse().expect("arch_name is sm_ and digits")),
    )
}

/// Compiles `v` for `target`: the module the driver loads (a CUBIN's
/// bytes, or PTX).
pub fn build(v: &Variant, target: Target) -> Result<Ptx> {
    let out = compile_source(&v.describe(), &v.source(), target)?;
    Ok(match target {
        Target::Cubin(_) => Ptx::from_binary(out),
        Target::Ptx(_) => Ptx::from_src(
            String::from_utf8_lossy(out.strip_suffix(&[0]).unwrap_or(&out)).into_owned(),
        ),
    })
}

/// Frees an NVRTC program when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is
        // destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compiles a translation unit for `target` with [`options`]; `what` names
/// it in errors. Returns the CUBIN's bytes, or the PTX (NUL-terminated, as
/// NVRTC gives it). A compiler error comes back as [`AttnError::Nvrtc`]
/// with NVRTC's log.
pub fn compile_source(what: &str, source: &str, target: Target) -> Result<Vec<u8>> {
    libs::nvrtc()?;
    let err = |log: String| nvrtc_error(what, log);
    let src = CString::new(source).map_err(|_| err("source holds a NUL byte".into()))?;
    let name = c"attn.cu";
    let prog =
        Program(result::create_program(&src, Some(name)).map_err(|e| err(format!("{e:?}")))?);
    // SAFETY: `prog` is a live program; the options are plain strings.
    if let Err(e) = unsafe { result::compile_program(prog.0, &options(target)) } {
        // SAFETY: as above; the log is NVRTC's own NUL-terminated text.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
                String::from_utf8_lossy(&bytes[..end]).into_owned()
            })
            .unwrap_or_else(|_| format!("{e:?} (no log)"));
        return Err(err(log));
    }
    let cubin = matches!(target, Target::Cubin(_));
    let mut size = 0usize;
    // SAFETY: `prog` compiled; the calls write one size.
    let sized = unsafe {
        if cubin {
            sys::nvrtcGetCUBINSize(prog.0, &mut size)
        } else {
            sys::nvrtcGetPTXSize(prog.0, &mut size)
        }
    };
    sized.result().map_err(|e| err(format!("{e:?}")))?;
    let mut out = vec![0u8; size];
    // SAFETY: `out` holds the `size` bytes NVRTC said it would write.
    let got = unsafe {
        if cubin {
            sys::nvrtcGetCUBIN(prog.0, out.as_mut_ptr().cast())
        } else {
            sys::nvrtcGetPTX(prog.0, out.as_mut_ptr().cast())
        }
    };
    got.result().map_err(|e| err(format!("{e:?}")))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device NVRTC knows gets its own machine code; a newer one PTX for
    /// the newest known architecture below it; an older one nothing.
    #[test]
    fn each_device_gets_its_own_code_or_the_newest_ptx_below_it() {
        let known = [75, 80, 86, 89, 90];
        assert_eq!(Target::for_device((9, 0), &known), Some(Target::Cubin(90)));
        assert_eq!(Target::for_device((8, 6), &known), Some(Target::Cubin(86)));
        assert_eq!(Target::for_device((8, 7), &known), Some(Target::Ptx(86)));
        assert_eq!(Target::for_device((12, 0), &known), Some(Target::Ptx(90)));
        assert_eq!(Target::for_device((10, 0), &known), Some(Target::Ptx(90)));
        assert_eq!(Target::for_device((7, 0), &known), None);
        assert_eq!(
            options(Target::Cubin(90))[0],
            "--gpu-architecture=sm_90".to_string()
        );
        assert_eq!(
            options(Target::Ptx(90))[0],
            "--gpu-architecture=compute_90".to_string()
        );
    }
}
