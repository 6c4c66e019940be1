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

/// The maps suite as [`attn_conformance::run_maps_suite`] runs it (hand
/// cases, bad input, then `n` generated cases), where the only refusal
/// allowed is a head dim past [`MAX_HEAD_DIM`]; returns how many
/// generated cases passed.
pub fn maps_suite<B: attn_spec::AttentionMaps>(backend: &B, n: u32) -> Result<u32, String> {
    use attn_conformance::maps;
    maps::all(backend)?;
    let r = attn_conformance::run_generated(n, |params| {
        let case = Case::build(params);
        let r = maps::check_maps(backend, &case, &maps::request_for(&case));
        passed_or_too_wide(&case, r.clone())?;
        r
    })?;
    Ok(r.passed)
}
