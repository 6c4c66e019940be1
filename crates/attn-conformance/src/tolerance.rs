//! The error bound a backend's result must meet, derived, not tuned.
//!
//! For each output row (batch `b`, head `h`, query `i`) the check is
//!
//! ```text
//! err(backend) <= 2 * err(low-precision reference) + A
//! ```
//!
//! where `err(x) = max_d |x_d - ref64_d|` against the f64 reference on the
//! same (already rounded) inputs, the low-precision reference is the same
//! program run in f32 with the probabilities rounded to the input type
//! before they multiply V and the output rounded to it (what a fast kernel
//! does; the factor 2 allows a different but equally good order of
//! operations, as FlashAttention's own tests do), and `A` is an a-priori
//! floor from standard rounding-error analysis (Higham, *Accuracy and
//! Stability of Numerical Algorithms*, ch. 3), with `u = 2^-24` (f32) and
//! `gamma(n) = n u / (1 - n u)`:
//!
//! - each score `s_j` carries an error at most `Delta = gamma(d_qk + 6) *
//!   max_j (scale * sum_d |q_d k_jd| + |alibi_j| + |bias_j|)` (a dot product
//!   of length `d_qk`, then scale, softcap, ALiBi and bias add up to six
//!   more roundings; tanh is 1-Lipschitz, so soft-capping never amplifies);
//! - a score error moves each probability by a factor within `exp(+-2
//!   Delta)` (it enters the numerator and, through the maximum, the
//!   denominator), so the output moves by at most `(exp(2 Delta) - 1) *
//!   max|v|`;
//! - the exponential may be approximated with relative error `EXP_REL_ERR`
//!   (`EXP_REL_ERR_BF16` for bf16 inputs, whose probabilities a backend
//!   may round to bf16 anyway) (twice: numerator and denominator), the
//!   denominator and the `p v` sums
//!   of `n` terms add `gamma(n + 2)` each, probabilities rounded to the input
//!   type add `u_in`, and the output's final rounding adds `u_out`, all
//!   relative to `max|v|` (the output is a convex combination of values).
//!
//! So, with `E` the exponential's allowance (`EXP_REL_ERR`, or
//! `EXP_REL_ERR_BF16` on bf16), `A_out = max|v| * (exp(2 Delta) - 1 + 2 E +
//! 2 gamma(n+2) +
//! u_in + u_out + n eta_in) + (2n + 2) eta + eta_out`, where the `eta`
//! terms are underflow's absolute errors (half the smallest subnormal of
//! f32, of the probabilities' type and of the output type: they matter
//! only for subnormal data), and for the log-sum-exp (a smooth maximum, stored as f32)
//! `A_lse = Delta + 2 E + gamma(n + 2) + u_f32 * |lse|`. The test
//! `low_precision_reference_meets_the_a_priori_bound` checks that the f32
//! reference itself stays within `A`, over hundreds of generated cases: the
//! floor is a bound, not a guess.

use crate::case::Case;
use attn_spec::DType;

/// Largest relative error allowed of a backend's exponential (about 8
/// ulps of f32; attn-cpu's fast exp is tested against it): everywhere but
/// the forward pass on bf16 inputs ([`EXP_REL_ERR_BF16`]).
pub const EXP_REL_ERR: f64 = 1.0 / (1u64 << 20) as f64;

/// Largest relative error allowed of a backend's exponential on bf16
/// inputs: 2^-13. A backend may round the probabilities to bf16 before
/// they multiply V (SEMANTICS section 7), a relative error of up to 2^-9
/// each; an exponential within 2^-13 adds a sixteenth of that, and
/// attn-cpu's bf16 pass computes its probabilities with such a cheaper
/// one (a degree-3 polynomial, 8.6e-5 = 2^-13.5). It enters the output's
/// floor as `2 * 2^-13 = 2^-12` of `max|v|` (against `u_in + u_out =
/// 2^-8`) and the log-sum-exp's as `2^-12` absolute. The backward bound
/// and the attention maps' keep [`EXP_REL_ERR`].
pub const EXP_REL_ERR_BF16: f64 = 1.0 / (1u64 << 13) as f64;

const U32: f64 = f32::EPSILON as f64 / 2.0;

/// The a-priori floors of one row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowFloor {
    /// `A_out`, absolute, per output element.
    pub out: f64,
    /// `A_lse`, absolute.
    pub lse: f64,
}

/// The rounding model a floor is derived for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arith {
    /// Unit roundoff of the arithmetic.
    pub u: f64,
    /// Relative error of the exponential.
    pub exp_err: f64,
    /// Unit roundoff the probabilities are rounded to (0: not rounded).
    pub u_in: f64,
    /// Unit roundoff of the stored output (0: not rounded).
    pub u_out: f64,
    /// Unit roundoff of the stored log-sum-exp (0: not rounded).
    pub u_lse: f64,
    /// Absolute error of one underflowing product in the arithmetic: half
    /// its smallest subnormal (Higham's model `fl(x y) = x y (1 + d) + e`,
    /// `|e| <= eta`), which the relative terms above do not cover.
    pub eta: f64,
    /// The same for probabilities rounded to the input type (0: not
    /// rounded), relative to `max|v|`.
    pub eta_in: f64,
    /// Half the smallest subnormal of the stored output type (0: not
    /// rounded).
    pub eta_out: f64,
}

/// Half the smallest positive subnormal of `dtype` (f16: 2^-24 / 2;
/// bf16, with f32's exponent range and 7 fraction bits: 2^-133 / 2; f32:
/// 2^-149 / 2).
pub fn half_subnormal(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2f64.powi(-25),
        DType::Bf16 => 2f64.powi(-134),
        // 2^-1075 is not an f64; the smallest subnormal bounds it.
        DType::F64 => 2f64.powi(-1074),
        _ => 2f64.powi(-150),
    }
}

impl Arith {
    /// A backend on `dtype` inputs: f32 arithmetic, an exponential within
    /// [`EXP_REL_ERR`] ([`EXP_REL_ERR_BF16`] on bf16), probabilities
    /// possibly rounded to the input type, output in the input type,
    /// log-sum-exp in f32.
    pub fn backend(dtype: DType) -> Self {
        Arith {
            u: U32,
            exp_err: match dtype {
                DType::Bf16 => EXP_REL_ERR_BF16,
                _ => EXP_REL_ERR,
            },
            u_in: match dtype {
                DType::F16 | DType::Bf16 => dtype.unit_roundoff(),
                _ => 0.0,
            },
            u_out: dtype.unit_roundoff(),
            u_lse: U32,
            eta: half_subnormal(DType::F32),
            eta_in: match dtype {
                DType::F16 | DType::Bf16 => half_subnormal(dtype),
                _ => 0.0,
            },
            eta_out: half_subnormal(dtype),
        }
    }

    /// Two f64 computations with nothing stored in lower precision (the
    /// reference against the dense formulation): `u = 2^-53`, and an
    /// exponential correct to within one ulp.
    pub fn f64() -> Self {
        let u = f64::EPSILON / 2.0;
        Arith {
            u,
            exp_err: 2.0 * u,
            u_in: 0.0,
            u_out: 0.0,
            u_lse: 0.0,
            eta: half_subnormal(DType::F64),
            eta_in: 0.0,
            eta_out: 0.0,
        }
    }

    fn gamma(&self, n: usize) -> f64 {
        let nu = n as f64 * self.u;
        nu / (1.0 - nu)
    }
}

/// The magnitude a score's rounding error is relative to: `|scale| *
/// sum_d |q_d k_jd| + |alibi term| + |bias|` (a `-inf` bias, which
/// excludes the pair, counts 0). `m` is batch entry `b`'s mask.
pub fn pair_magnitude(
    case: &Case,
    m: &attn_spec::SeqMask,
    (b, h, i, j): (usize, usize, usize, usize),
) -> f64 {
    let p = &case.problem;
    let g = p.shape.kv_head(h);
    let mut dot = 0.0;
    for d in 0..p.shape.head_dim_qk {
        let q = case.q.get(p.q.index([b, i, h, d]));
        let k = case.k.get(p.k.index([b, j, g, d]));
        dot += (q * k).abs();
    }
    let mut t = p.scale_exact().abs() * dot;
    if let Some(sl) = &p.options.alibi_slopes {
        t += (f64::from(sl[h]) * (j as f64 - m.diagonal(i) as f64)).abs();
    }
    if let (Some(bd), Some(bb)) = (&p.bias, &case.bias) {
        let x = bb.get(bd.view.index([b, h, i, j]));
        if x.is_finite() {
            t += x.abs();
        }
    }
    t
}

/// Computes `A_out` and `A_lse` of a backend (f32 arithmetic) for every
/// row, indexed like the log-sum-exp (`[batch, q_heads, q_len]`); `lse64`
/// is the f64 reference's.
pub fn row_floors(case: &Case, lse64: &[f64]) -> Vec<RowFloor> {
    row_floors_in(case, lse64, Arith::backend(case.problem.dtype))
}

/// [`row_floors`] for any rounding model.
pub fn row_floors_in(case: &Case, lse64: &[f64], a: Arith) -> Vec<RowFloor> {
    let p = &case.problem;
    let s = p.shape;
    let mut floors = Vec::with_capacity(lse64.len());
    for b in 0..s.batch {
        let m = p.seq_mask(b);
        for h in 0..s.q_heads {
            let g = s.kv_head(h);
            for i in 0..s.q_len {
                let range = m.kv_range(i);
                let n = range.len() + 1;
                let (mut mag, mut vmax) = (0.0f64, 0.0f64);
                for j in range {
                    mag = mag.max(pair_magnitude(case, &m, (b, h, i, j)));
                    for d in 0..s.head_dim_v {
                        vmax = vmax.max(case.v.get(p.v.index([b, j, g, d])).abs());
                    }
                }
                let delta = a.gamma(s.head_dim_qk + 6) * mag;
                // Underflow: each of the n products p v, each of up to n
                // rescalings of the accumulator and the final division
                // may lose eta; so may each probability rounded to the
                // input type (times |v|), and the stored output.
                // (All-zero values: the output is exactly 0 whatever the
                // scores, and 0 * inf must not make the floor NaN.)
                let rel = (2.0 * delta).exp_m1()
                    + 2.0 * a.exp_err
                    + 2.0 * a.gamma(n + 2)
                    + a.u_in
                    + a.u_out
                    + n as f64 * a.eta_in;
                let out = if vmax == 0.0 { 0.0 } else { vmax * rel }
                    + (2 * n + 2) as f64 * a.eta
                    + a.eta_out;
                let l = lse64[(b * s.q_heads + h) * s.q_len + i];
                let lse = delta
                    + 2.0 * a.exp_err
                    + a.gamma(n + 2)
                    + if l.is_finite() {
                        a.u_lse * l.abs()
                    } else {
                        0.0
                    };
                floors.push(RowFloor { out, lse });
            }
        }
    }
    floors
}
