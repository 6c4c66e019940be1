//! What the GPU and emulator suites share.

use attn_conformance::{Case, Outcome};
use attn_cuda::variant::MAX_HEAD_DIM;

/// A generated case's acceptable outcomes: passed, or skipped because a
/// head dim is past the kernels' [`MAX_HEAD_DIM`] (the generator reaches
/// 257; the backend refuses it as `Unsupported`).
pub fn passed_or_too_wide(case: &Case, r: Result<Outcome, String>) -> Result<(), String> {
    let s = case.problem.shape;
    match r {
        Ok(Outcome::Passed) => Ok(()),
        Ok(Outcome::Skipped(_)) if s.head_dim_qk.max(s.head_dim_v) > MAX_HEAD_DIM => Ok(()),
        other => Err(format!("{other:?}")),
    }
}
