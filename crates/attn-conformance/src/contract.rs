//! Promises of the `Backend` trait beyond the numbers, checked on any
//! backend: `forward_into` writes only the elements its views reach, and
//! the contract holds at sequence lengths where narrow index arithmetic
//! breaks.

use crate::case::{Case, CaseParams};
use crate::check::{check_output, run_forward};
use attn_spec::{AttnOptions, Backend, DType, HostData, Inputs, Shape, View};

/// A value no output of these cases can take (outputs are convex
/// combinations of values in [-1, 1]), exact in every element type.
const SENTINEL: f64 = 7.75;

/// An output view of `s` with gaps: every other element of the last axis,
/// rows and batch entries further apart, and one element before it.
fn gapped_out(s: Shape) -> View {
    let d = s.head_dim_v;
    View {
        dims: [s.batch, s.q_len, s.q_heads, d],
        strides: [
            s.q_len * (s.q_heads * 2 * d + 1) + 3,
            s.q_heads * 2 * d + 1,
            2 * d,
            2,
        ],
        offset: 1,
    }
}

/// `forward_into` on an output buffer and an LSE buffer filled with a
/// sentinel, through an output view with gaps and with room past both
/// views: the values inside the views must pass the suite's check and every
/// other element must still hold the sentinel, bit for bit. Prefill- and
/// decode-shaped problems, f32, f16 and bf16, with and without a mask.
pub fn untouched_outside_views<B: Backend>(backend: &B) -> Result<(), String> {
    let cases = [
        (Shape::new(1, 4, 2, 70, 90, 24), DType::F32, true),
        (Shape::new(2, 2, 2, 33, 40, 8), DType::Bf16, false),
        (Shape::new(1, 4, 2, 1, 90, 16), DType::F16, true),
        (Shape::new(2, 4, 1, 3, 17, 5), DType::F32, false),
    ];
    for (shape, dtype, causal) in cases {
        let mut params = CaseParams::plain(shape);
        params.dtype = dtype;
        params.options = AttnOptions::default().with_lse();
        if causal {
            params.options = params.options.causal();
        }
        params.seed = 17;
        let mut case = Case::build(params);
        case.problem.out = gapped_out(shape);
        if backend.supports(&case.problem).is_err() {
            continue;
        }
        let name = format!("untouched outside views ({dtype}, {})", case.describe());
        let fail = |e: String| format!("{}: {name}: {e}", backend.name());
        let out_len = case.problem.out.extent().expect("small") + 5;
        let lse_len = case.problem.lse_view().extent().expect("small") + 5;
        let fill = |dt: DType, n: usize| HostData::from_f64(dt, &vec![SENTINEL; n]);
        let run = || -> attn_spec::Result<(HostData, HostData)> {
            let up = |d: &HostData| backend.upload(d);
            let (q, k, v) = (up(&case.q)?, up(&case.k)?, up(&case.v)?);
            let mut out = up(&fill(dtype, out_len))?;
            let mut lse = up(&fill(DType::F32, lse_len))?;
            let inputs = Inputs::new(&q, &k, &v);
            backend.forward_into(&case.problem, inputs, &mut out, Some(&mut lse))?;
            Ok((backend.download(&out)?, backend.download(&lse)?))
        };
        let (out, lse) = run().map_err(|e| fail(e.to_string()))?;
        if out.len() != out_len || lse.len() != lse_len {
            return Err(fail(format!(
                "buffers came back with {} and {} elements, not {out_len} and {lse_len}",
                out.len(),
                lse.len()
            )));
        }
        let p = &case.problem;
        let mut inside = vec![false; out_len];
        for b in 0..shape.batch {
            for i in 0..shape.q_len {
                for h in 0..shape.q_heads {
                    for d in 0..shape.head_dim_v {
                        inside[p.out.index([b, i, h, d])] = true;
                    }
                }
            }
        }
        if let Some(at) = (0..out_len).find(|&e| !inside[e] && out.get(e) != SENTINEL) {
            return Err(fail(format!(
                "output element {at}, outside the view, was overwritten with {}",
                out.get(at)
            )));
        }
        let n = p.lse_view().extent().expect("small");
        if let Some(at) = (n..lse_len).find(|&e| lse.get(e) != SENTINEL) {
            return Err(fail(format!(
                "lse element {at}, past the view, was overwritten with {}",
                lse.get(at)
            )));
        }
        let lse_view = HostData::from_f64(DType::F32, &lse.to_f64_vec()[..n]);
        check_output(&case, &out, Some(&lse_view)).map_err(fail)?;
    }
    Ok(())
}

/// Keys past 2^24, where an index or a distance held in f32 is no longer
/// exact (odd integers round to even): a sliding window with ALiBi at the
/// end of 2^24 + 37 keys, decode-shaped (1 query row) and prefill-shaped
/// (3 rows of 2 heads), head dim 1. The visible keys' distances from the
/// diagonal are 0..=5, so a rounded distance moves a score by a whole
/// slope.
pub fn long_sequences<B: Backend>(backend: &B) -> Result<(), String> {
    let kv_len = (1 << 24) + 37;
    for q_len in [1, 3] {
        let mut params = CaseParams::plain(Shape::new(1, 2, 1, q_len, kv_len, 1));
        params.options = AttnOptions::default().window(Some(5), Some(0)).with_lse();
        params.seed = 5;
        let mut case = Case::build(params);
        case.problem.options.alibi_slopes = Some(vec![0.75, 1.5]);
        if backend.supports(&case.problem).is_err() {
            continue;
        }
        let fail = |e: String| format!("{}: long sequence, {q_len} rows: {e}", backend.name());
        let (out, lse) = run_forward(backend, &case).map_err(|e| fail(e.to_string()))?;
        check_output(&case, &out, lse.as_ref()).map_err(fail)?;
    }
    Ok(())
}

/// Every check of this module.
pub fn all<B: Backend>(backend: &B) -> Result<(), String> {
    untouched_outside_views(backend)?;
    long_sequences(backend)
}
