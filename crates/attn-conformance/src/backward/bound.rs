//! The error bound of the backward pass, derived, not tuned.
//!
//! A backend recomputes each probability from the stored log-sum-exp,
//! `P_ij = exp(x_ij - lse_i)`, then `dP_ij = dO_i . v_j`, `D_i = dO_i . O_i`
//! from the stored output, `dS_ij = P_ij (dP_ij - D_i)`, `dsc_ij = dS_ij
//! g_ij` (`g` = the derivative of the score with respect to `q . k`:
//! `scale`, times `1 - t^2` under soft-capping), and the sums
//! `dQ_i = sum_j dsc_ij k_j`, `dK_j = sum_i dsc_ij q_i`, `dV_j = sum_i P_ij
//! dO_i`, `dbias_ij = dS_ij` (summed over broadcast axes), `dsink_h =
//! -sum_i exp(sink_h - lse_i) D_i`. Each step's error is bounded from the
//! f64 reference's values with standard rounding-error analysis (Higham,
//! ch. 3; `u = 2^-24`, `gamma(n) = n u / (1 - n u)`), products bounded with
//! the computed operands' upper bounds (so nothing second order is
//! dropped):
//!
//! - score: `Dx = gamma(d_qk + 6) * mag` as in the forward bound
//!   ([`crate::tolerance`]);
//! - probability: the exponent `x - lse` is off by `Dx + u |lse|` (the
//!   stored f32 log-sum-exp) `+ gamma(3) (|x| + |lse|)` (its own
//!   roundings, scaled by `log2 e` or not), so `DP = P (expm1(that) +
//!   EXP_REL_ERR + u_in) + 2^-125` (`u_in`: a backend may round `P` to a
//!   16-bit input type before a matmul; the last term covers underflow);
//! - `DdP = gamma(d_v) sum |dO v|`, `DD = (gamma(d_v) + u_o) sum |dO O| +
//!   sub_o sum |dO|` (`u_o`, `sub_o`: the stored output's unit roundoff
//!   and half its smallest subnormal);
//! - `DdS = DP (|dP - D| + DdP + DD) + P (DdP + DD) + (gamma(2) + u_in)
//!   (P + DP) (|dP - D| + DdP + DD)`;
//! - soft-cap: `t = tanh(y / cap)` is off by `Dx / cap + 8 u |t|` (tanh
//!   within 4 ulp), so `Dg = |scale| (2 |t| Dt + Dt^2 + gamma(3))`;
//! - `Ddsc = DdS (|g| + Dg) + |dS| Dg + u (|dsc| + Ddsc')`;
//! - a sum of `n` products: the errors of its terms plus `gamma(n + 2)`
//!   times the sum of the terms' upper bounds, then the final rounding to
//!   the gradient's type: `u_o |value| + sub_o`;
//! - underflow (subnormal data): each f32 product may lose `eta = 2^-150`
//!   absolutely (Higham's model), which relative terms do not cover: `d_v
//!   eta` more in `DdP` and `DD`, `2 eta` in `DdS`, `eta` in `Ddsc`, and
//!   `4 eta` per term of a sum; a value rounded to a 16-bit input type
//!   (`P`, `dS`) loses up to half that type's smallest subnormal besides
//!   `u_in` relative.
//!
//! The bound is 0 exactly where the gradient is 0 by structure (a key no
//! row sees, a fully masked row), so there a backend must give exactly 0.

use crate::case::Case;
use crate::tolerance::{pair_magnitude, EXP_REL_ERR};
use attn_spec::reference::backward::RefGrads;
use attn_spec::{DType, HostData};

const U: f64 = f32::EPSILON as f64 / 2.0;

/// Absolute error of one underflowing f32 product (half the smallest
/// subnormal).
const ETA: f64 = 1.0 / (1u128 << 127) as f64 / (1u64 << 23) as f64;

fn gamma(n: usize) -> f64 {
    let nu = n as f64 * U;
    nu / (1.0 - nu)
}

/// Half the smallest subnormal of `dtype`: the absolute error of rounding
/// a tiny value into it (one definition, [`crate::tolerance`]'s).
pub use crate::tolerance::half_subnormal as sub_half;

/// Per-element bounds, in the layout of [`RefGrads`].
pub type Bounds = RefGrads;

/// Running sums of one gradient element: the terms' errors, the sum of
/// their upper bounds and their count.
#[derive(Clone, Copy, Default)]
struct Acc {
    err: f64,
    mag: f64,
    n: usize,
}

impl Acc {
    fn add(&mut self, value: f64, err: f64) {
        self.err += err + 4.0 * ETA;
        self.mag += value.abs() + err;
        self.n += 1;
    }
    /// The bound of the sum stored with unit roundoff `u_o`.
    fn finish(&self, value: f64, u_o: f64, sub_o: f64) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        let e = self.err + gamma(self.n + 2) * self.mag;
        e + u_o * (value.abs() + e) + sub_o
    }
}

/// The bound of every gradient element of `case` given the f64
/// reference's gradients `g`, its stored output `out` (laid out as
/// `problem.out`, in the problem's type) and `d_out`.
pub fn bounds(case: &Case, g: &RefGrads, out: &HostData, d_out: &HostData) -> Bounds {
    bounds_given(case, g, out, d_out, None)
}

/// [`bounds`] when the output and log-sum-exp the backward reads come from
/// a backend's forward rather than the rounded reference: `fwd[r]` bounds
/// their error on row `r` (`[batch, q_heads, q_len]` order; see
/// [`super::forward_errors`]), which enters `D` (through `sum |dO|`) and the
/// probabilities' exponent.
pub fn bounds_given(
    case: &Case,
    g: &RefGrads,
    out: &HostData,
    d_out: &HostData,
    fwd: Option<&[(f64, f64)]>,
) -> Bounds {
    let p = &case.problem;
    let s = p.shape;
    let dt = p.dtype;
    let (u_o, sub_o) = (dt.unit_roundoff(), sub_half(dt));
    let u_in = match dt {
        DType::F16 | DType::Bf16 => dt.unit_roundoff(),
        _ => 0.0,
    };
    // Rounding to a 16-bit input type loses, besides u_in relative, up
    // to half its smallest subnormal absolutely.
    let eta_in = if u_in > 0.0 { sub_half(dt) } else { 0.0 };
    let (dqk, dvd) = (s.head_dim_qk, s.head_dim_v);
    let scale = p.scale_exact();
    let o = &p.options;
    let inputs = case.inputs();
    let mut dq = vec![Acc::default(); g.dq.len()];
    let mut dk = vec![Acc::default(); g.dk.len()];
    let mut dv = vec![Acc::default(); g.dv.len()];
    let mut dbias = g.dbias.as_ref().map(|v| vec![Acc::default(); v.len()]);
    let mut dsinks = g.dsinks.as_ref().map(|v| vec![Acc::default(); v.len()]);
    let dbias_view = p.dbias_view();
    let mut row: Vec<(usize, f64, f64, f64)> = Vec::new();
    for b in 0..s.batch {
        let m = p.seq_mask(b);
        for h in 0..s.q_heads {
            let kvh = s.kv_head(h);
            let sink = o.sinks.as_ref().map(|v| f64::from(v[h]));
            for i in 0..m.q_len {
                // (key, score, slope, magnitude) of the visible keys.
                row.clear();
                for j in m.kv_range(i) {
                    let Some((x, slope)) =
                        attn_spec::reference::score::<f64>(p, &inputs, (b, h, i, j), scale)
                    else {
                        continue;
                    };
                    row.push((j, x, slope, pair_magnitude(case, &m, (b, h, i, j))));
                }
                let mx = row
                    .iter()
                    .map(|r| r.1)
                    .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
                if mx == f64::NEG_INFINITY {
                    continue;
                }
                let z = sink.map_or(0.0, |sk| (sk - mx).exp())
                    + row.iter().map(|r| (r.1 - mx).exp()).sum::<f64>();
                let lse = mx + z.ln();
                let (o_err, lse_err) =
                    fwd.map_or((0.0, 0.0), |f| f[(b * s.q_heads + h) * s.q_len + i]);
                let d_o: Vec<f64> = (0..dvd)
                    .map(|d| d_out.get(p.out.index([b, i, h, d])))
                    .collect();
                let v = |j: usize, d: usize| inputs.v.get(p.v.index([b, j, kvh, d]));
                let (mut big_d, mut dod) = (0.0, 0.0);
                for (d, &gd) in d_o.iter().enumerate() {
                    let od = out.get(p.out.index([b, i, h, d]));
                    big_d += gd * od;
                    dod += (gd * od).abs() * (gamma(dvd) + u_o) + gd.abs() * (sub_o + o_err) + ETA;
                }
                let d_p_of = |x: f64| {
                    let a = (x - mx).exp() / z;
                    let err = move |dx: f64| {
                        let e = dx + U * lse.abs() + lse_err + gamma(3) * (x.abs() + lse.abs());
                        a * (e.exp_m1() + EXP_REL_ERR + u_in) + 2f64.powi(-125) + eta_in
                    };
                    (a, err)
                };
                for &(j, x, slope, mag) in &row {
                    let dx = gamma(dqk + 6) * mag;
                    let (pj, perr) = d_p_of(x);
                    let dp_err_p = perr(dx);
                    let (mut dpv, mut dpm) = (0.0, 0.0);
                    for (d, &gd) in d_o.iter().enumerate() {
                        dpv += gd * v(j, d);
                        dpm += (gd * v(j, d)).abs();
                    }
                    let ddp = gamma(dvd) * dpm + dvd as f64 * ETA;
                    let diff = (dpv - big_d).abs() + ddp + dod;
                    let ds = pj * (dpv - big_d);
                    let dds = dp_err_p * diff
                        + pj * (ddp + dod)
                        + (gamma(2) + u_in) * (pj + dp_err_p) * diff
                        + eta_in
                        + 2.0 * ETA;
                    let dg = match o.softcap {
                        Some(cap) => {
                            let cap = f64::from(cap);
                            let t = if scale == 0.0 {
                                0.0
                            } else {
                                (1.0 - slope / scale).abs().sqrt()
                            };
                            let dt = dx / cap + 8.0 * U * t;
                            scale.abs() * (2.0 * t * dt + dt * dt + gamma(3))
                        }
                        None => 0.0,
                    };
                    let dsc = ds * slope;
                    let ddsc0 = dds * (slope.abs() + dg) + ds.abs() * dg + ETA;
                    let ddsc = ddsc0 + U * (dsc.abs() + ddsc0);
                    for d in 0..dqk {
                        let qd = inputs.q.get(p.q.index([b, i, h, d]));
                        let kd = inputs.k.get(p.k.index([b, j, kvh, d]));
                        dq[((b * s.q_len + i) * s.q_heads + h) * dqk + d]
                            .add(dsc * kd, ddsc * kd.abs());
                        dk[((b * s.kv_len + j) * s.kv_heads + kvh) * dqk + d]
                            .add(dsc * qd, ddsc * qd.abs());
                    }
                    for (d, &gd) in d_o.iter().enumerate() {
                        dv[((b * s.kv_len + j) * s.kv_heads + kvh) * dvd + d]
                            .add(pj * gd, dp_err_p * gd.abs());
                    }
                    if let (Some(db), Some(view)) = (dbias.as_mut(), dbias_view) {
                        db[view.index([b, h, i, j])].add(ds, dds);
                    }
                }
                if let (Some(sk), Some(acc)) = (sink, dsinks.as_mut()) {
                    let (ps, perr) = d_p_of(sk);
                    let dps = perr(0.0);
                    let term = ps * big_d;
                    acc[h].add(term, dps * (big_d.abs() + dod) + ps * dod);
                }
            }
        }
    }
    let fin = |acc: &[Acc], vals: &[f64], u_o: f64, sub_o: f64| -> Vec<f64> {
        acc.iter()
            .zip(vals)
            .map(|(a, &x)| a.finish(x, u_o, sub_o))
            .collect()
    };
    let sub32 = sub_half(DType::F32);
    Bounds {
        dq: fin(&dq, &g.dq, u_o, sub_o),
        dk: fin(&dk, &g.dk, u_o, sub_o),
        dv: fin(&dv, &g.dv, u_o, sub_o),
        dbias: dbias
            .zip(g.dbias.as_ref())
            .map(|(a, v)| fin(&a, v, U, sub32)),
        dsinks: dsinks
            .zip(g.dsinks.as_ref())
            .map(|(a, v)| fin(&a, v, U, sub32)),
    }
}
