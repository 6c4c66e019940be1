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

/// `linear` (y = x W^T + b, the multi-head layer's projections) against
/// f64 on a few shapes, with and without a bias, in f32, f16 and bf16.
/// Bound per output: the f32 accumulation of `in_f` products, `(in_f + 2)
/// 2^-24 sum |x w| + |b| 2^-24`, plus the output's rounding to its type
/// (half an ulp of the f32 sum: 2^-8 relative for bf16, 2^-11 for f16).
pub fn linear_matches_f64<B: attn_spec::Linear>(backend: &B) -> Result<(), String> {
    use attn_spec::{DType, HostData};
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        for (rows, in_f, out_f, with_bias) in
            [(37, 19, 21, true), (16, 64, 16, false), (1, 3, 40, true)]
        {
            // Values exactly representable in every type: k / 64, |k| < 128.
            let val = |i: usize, salt: usize| (((i * 37 + salt * 11) % 255) as f64 - 127.0) / 64.0;
            let x: Vec<f64> = (0..rows * in_f).map(|i| val(i, 1)).collect();
            let w: Vec<f64> = (0..out_f * in_f).map(|i| val(i, 2)).collect();
            let b: Vec<f64> = (0..out_f).map(|i| val(i, 3)).collect();
            let host = |v: &[f64]| HostData::from_f64(dtype, v);
            let up = |d: &HostData| backend.upload(d).map_err(|e| e.to_string());
            let (xb, wb, bb) = (up(&host(&x))?, up(&host(&w))?, up(&host(&b))?);
            let y = backend
                .linear(&xb, rows, &wb, with_bias.then_some(&bb), in_f, out_f)
                .map_err(|e| format!("{dtype} linear {rows}x{in_f}->{out_f}: {e}"))?;
            let y = backend
                .download(&y)
                .map_err(|e| e.to_string())?
                .to_f64_vec();
            let out_rel = match dtype {
                DType::Bf16 => 2f64.powi(-8),
                DType::F16 => 2f64.powi(-11),
                _ => 0.0,
            };
            for r in 0..rows {
                for o in 0..out_f {
                    let terms = (0..in_f).map(|k| x[r * in_f + k] * w[o * in_f + k]);
                    let bias = if with_bias { b[o] } else { 0.0 };
                    let want: f64 = terms.clone().sum::<f64>() + bias;
                    let mag: f64 = terms.map(f64::abs).sum::<f64>();
                    let u = 2f64.powi(-24);
                    let acc = (in_f as f64 + 2.0) * u * mag + u * bias.abs();
                    let bound = acc + out_rel * (want.abs() + acc);
                    let got = y[r * out_f + o];
                    if (got - want).abs() > bound {
                        return Err(format!(
                            "{dtype} linear {rows}x{in_f}->{out_f} bias={with_bias}: y[{r}][{o}] = {got}, f64 {want}, bound {bound:e}"
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The smoke cases the GPU bundle runs first (`smoke` in conformance.rs)
/// and the emulator runs too: one small causal GQA case per dtype, head
/// dim 256 (over 48 KB of shared memory: the opt-in), a decode row on
/// the split-KV path (1024 keys for one query row: enough for
/// `plan_splits` to split) and 130 query rows at head dim 128 (the fast
/// kernel's wide blocks); then the backward case.
pub fn smoke_cases() -> (
    Vec<attn_conformance::CaseParams>,
    attn_conformance::CaseParams,
) {
    use attn_spec::{DType, Shape};
    let params = |dtype, q_len, kv_len, d| {
        let mut params = attn_conformance::CaseParams::plain(Shape::new(1, 4, 2, q_len, kv_len, d));
        params.dtype = dtype;
        params.options = params.options.causal();
        params
    };
    let forward = [
        (DType::F32, 64, 128, 64),
        (DType::Bf16, 64, 128, 64),
        (DType::F16, 64, 128, 64),
        (DType::Bf16, 64, 96, 256),
        (DType::Bf16, 1, 1024, 64),
        // The fast kernel's wide prefill blocks, the second nearly empty.
        (DType::Bf16, 130, 200, 128),
    ];
    let cases = forward
        .iter()
        .map(|&(t, q, k, d)| params(t, q, k, d))
        .collect();
    (cases, params(DType::Bf16, 64, 128, 64))
}
