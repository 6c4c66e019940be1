//! Run-time compilation: a variant's source through NVRTC to PTX for its
//! architecture. Works without a GPU (only NVRTC is needed), which is how
//! CI compiles every variant.

use crate::libs;
use crate::variant::Variant;
use attn_spec::{AttnError, Result};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

/// The NVRTC options of every variant: the target, and IEEE arithmetic
/// (no fast-math: `expf`, `logf` and `tanhf` keep their documented
/// accuracy, which the conformance bound assumes).
pub fn options(v: &Variant) -> CompileOptions {
    CompileOptions {
        arch: Some(v.arch_name()),
        fmad: Some(true),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        name: Some(format!("{}.cu", v.kernel.function())),
        ..Default::default()
    }
}

/// Compiles `v` to PTX.
pub fn ptx(v: &Variant) -> Result<Ptx> {
    compile_source(&v.describe(), &v.source(), options(v))
}

/// Compiles a translation unit; `what` names it in errors. A compiler
/// error comes back as [`AttnError::Nvrtc`] with NVRTC's log.
pub fn compile_source(what: &str, source: &str, opts: CompileOptions) -> Result<Ptx> {
    libs::nvrtc()?;
    compile_ptx_with_opts(source, opts).map_err(|e| match e {
        CompileError::CompileError { log, .. } => AttnError::Nvrtc {
            variant: what.into(),
            log: log.to_string_lossy().into_owned(),
        },
        other => AttnError::Nvrtc {
            variant: what.into(),
            log: format!("{other:?}"),
        },
    })
}
