//! The reference backward pass: the gradients of attention computed in f64
//! from the dense probabilities of each row, the formulas of
//! `docs/SEMANTICS.md` section 7b step by step. It recomputes its own
//! forward in f64 (the `O` and log-sum-exp a caller passes are validated,
//! not used), so it is the oracle for backends that start from rounded
//! forward results. Checked against central finite differences of the f64
//! forward (`attn-conformance/tests/reference.rs`).

use super::{score, Reference};
use crate::backend::Inputs;
use crate::error::Result;
use crate::grad::{check_backward_call, Backward, GradInputs, GradOutputs};
use crate::problem::Problem;
use crate::tensor::HostData;

/// The reference's gradients, unrounded.
#[derive(Clone, Debug, PartialEq)]
pub struct RefGrads {
    /// `dQ`, contiguous `[batch, q_len, q_heads, head_dim_qk]`.
    pub dq: Vec<f64>,
    /// `dK`, contiguous `[batch, kv_len, kv_heads, head_dim_qk]`.
    pub dk: Vec<f64>,
    /// `dV`, contiguous `[batch, kv_len, kv_heads, head_dim_v]`.
    pub dv: Vec<f64>,
    /// The bias gradient (laid out as [`Problem::dbias_view`]) when the
    /// problem has a bias.
    pub dbias: Option<Vec<f64>>,
    /// The sinks' gradient `[q_heads]` when the options have sinks.
    pub dsinks: Option<Vec<f64>>,
}

/// Computes every gradient of `problem` for the loss whose gradient with
/// respect to the output is `d_out` (laid out as `problem.out`). The caller
/// has validated the problem and the buffers.
pub fn gradients(problem: &Problem, inputs: Inputs<'_, HostData>, d_out: &HostData) -> RefGrads {
    let p = problem;
    let s = p.shape;
    let (dqk, dvd) = (s.head_dim_qk, s.head_dim_v);
    let mut g = RefGrads {
        dq: vec![0.0; s.batch * s.q_len * s.q_heads * dqk],
        dk: vec![0.0; s.batch * s.kv_len * s.kv_heads * dqk],
        dv: vec![0.0; s.batch * s.kv_len * s.kv_heads * dvd],
        dbias: p
            .dbias_view()
            .map(|v| vec![0.0; v.numel().expect("validated")]),
        dsinks: p.options.sinks.as_ref().map(|v| vec![0.0; v.len()]),
    };
    let scale = p.scale_exact();
    // (key, score, d score / d (q . k)) of the row's visible keys.
    let mut row: Vec<(usize, f64, f64)> = Vec::with_capacity(s.kv_len);
    for b in 0..s.batch {
        let m = p.seq_mask(b);
        for h in 0..s.q_heads {
            let kvh = s.kv_head(h);
            let sink = p.options.sinks.as_ref().map(|v| f64::from(v[h]));
            for i in 0..m.q_len {
                row.clear();
                for j in m.kv_range(i) {
                    if let Some((x, slope)) = score::<f64>(p, &inputs, (b, h, i, j), scale) {
                        row.push((j, x, slope));
                    }
                }
                let mx = row
                    .iter()
                    .map(|r| r.1)
                    .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
                if mx == f64::NEG_INFINITY {
                    continue; // fully masked: no gradient flows through the row
                }
                let z = sink.map_or(0.0, |sk| (sk - mx).exp())
                    + row.iter().map(|r| (r.1 - mx).exp()).sum::<f64>();
                let prob = |x: f64| (x - mx).exp() / z;
                let d_o: Vec<f64> = (0..dvd)
                    .map(|d| d_out.get(p.out.index([b, i, h, d])))
                    .collect();
                let v = |j: usize, d: usize| inputs.v.get(p.v.index([b, j, kvh, d]));
                // D = dO . O, with O the row's exact output.
                let mut o = vec![0.0; dvd];
                for &(j, x, _) in &row {
                    for (d, od) in o.iter_mut().enumerate() {
                        *od += prob(x) * v(j, d);
                    }
                }
                let big_d: f64 = o.iter().zip(&d_o).map(|(a, b)| a * b).sum();
                for &(j, x, slope) in &row {
                    let pj = prob(x);
                    let dp: f64 = (0..dvd).map(|d| d_o[d] * v(j, d)).sum();
                    let ds = pj * (dp - big_d);
                    let dsc = ds * slope;
                    for d in 0..dqk {
                        let qd = inputs.q.get(p.q.index([b, i, h, d]));
                        let kd = inputs.k.get(p.k.index([b, j, kvh, d]));
                        g.dq[((b * s.q_len + i) * s.q_heads + h) * dqk + d] += dsc * kd;
                        g.dk[((b * s.kv_len + j) * s.kv_heads + kvh) * dqk + d] += dsc * qd;
                    }
                    for (d, &gd) in d_o.iter().enumerate() {
                        g.dv[((b * s.kv_len + j) * s.kv_heads + kvh) * dvd + d] += pj * gd;
                    }
                    if let (Some(db), Some(view)) = (g.dbias.as_mut(), p.dbias_view()) {
                        db[view.index([b, h, i, j])] += ds;
                    }
                }
                if let (Some(sk), Some(dsk)) = (sink, g.dsinks.as_mut()) {
                    dsk[h] -= prob(sk) * big_d;
                }
            }
        }
    }
    g
}

/// Writes the reference's gradients into buffers laid out as the problem
/// says, rounding once.
pub fn store_grads(problem: &Problem, g: &RefGrads, out: GradOutputs<'_, HostData>) {
    let p = problem;
    let s = p.shape;
    let parts = [
        (out.dq, &g.dq, p.q, s.q_len, s.q_heads, s.head_dim_qk),
        (out.dk, &g.dk, p.k, s.kv_len, s.kv_heads, s.head_dim_qk),
        (out.dv, &g.dv, p.v, s.kv_len, s.kv_heads, s.head_dim_v),
    ];
    for (buf, vals, view, len, heads, dim) in parts {
        for b in 0..s.batch {
            for i in 0..len {
                for h in 0..heads {
                    for d in 0..dim {
                        let x = vals[((b * len + i) * heads + h) * dim + d];
                        buf.set(view.index([b, i, h, d]), x);
                    }
                }
            }
        }
    }
    for (buf, vals) in [(out.dbias, &g.dbias), (out.dsinks, &g.dsinks)] {
        if let (Some(buf), Some(vals)) = (buf, vals) {
            for (i, &x) in vals.iter().enumerate() {
                buf.set(i, x);
            }
        }
    }
}

impl Backward for Reference {
    fn backward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        forward: GradInputs<'_, HostData>,
        grads: GradOutputs<'_, HostData>,
    ) -> Result<()> {
        check_backward_call(self, problem, &inputs, &forward, &grads)?;
        let g = gradients(problem, inputs, forward.d_out);
        store_grads(problem, &g, grads);
        Ok(())
    }
}
