//! The reference: the oracle every backend is checked against. Written for
//! clarity, not speed: one query row at a time, the formula of
//! `docs/SEMANTICS.md` step by step, in f64 whatever the input type.
//!
//! The same code also runs in f32 arithmetic, optionally rounding the
//! probabilities to the input type before they multiply V
//! ([`Precision::low`]): that is what a fast low-precision kernel does, and
//! the conformance suite bounds a backend's error by a multiple of this
//! low-precision reference's error.

use crate::backend::{check_call, Backend, Inputs};
use crate::dtype::{round_to, DType};
use crate::error::Result;
use crate::linear::{check_linear, Linear};
use crate::problem::Problem;
use crate::tensor::HostData;
use std::ops::{Add, Div, Mul, Neg, Sub};

pub mod backward;
pub mod maps;

/// Arithmetic the reference can run in (f64, or f32 for the low-precision
/// comparison).
pub trait Real:
    Copy
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
{
    /// Rounds an f64 into this type.
    fn of(x: f64) -> Self;
    /// Widens to f64.
    fn f64(self) -> f64;
    /// e^x.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Hyperbolic tangent.
    fn tanh(self) -> Self;
    /// Maximum, ignoring a NaN operand (IEEE maxNum).
    fn max(self, o: Self) -> Self;
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            fn of(x: f64) -> Self {
                x as $t
            }
            fn f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn max(self, o: Self) -> Self {
                <$t>::max(self, o)
            }
        }
    };
}
real!(f32);
real!(f64);

/// Which arithmetic the reference runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f64 throughout: the oracle.
    F64,
    /// f32 arithmetic; probabilities rounded to `round_p` (when given)
    /// before they multiply V.
    F32 {
        /// Element type the probabilities are rounded to, if any.
        round_p: Option<DType>,
    },
}

impl Precision {
    /// What a kernel that accumulates in f32 and feeds the probabilities to
    /// a matmul in the input type computes.
    pub fn low(dtype: DType) -> Self {
        let round_p = matches!(dtype, DType::F16 | DType::Bf16).then_some(dtype);
        Precision::F32 { round_p }
    }
}

/// The reference's full result, unrounded.
#[derive(Clone, Debug, PartialEq)]
pub struct RefResult {
    /// Output, contiguous `[batch, q_len, q_heads, head_dim_v]`.
    pub out: Vec<f64>,
    /// Log-sum-exp, contiguous `[batch, q_heads, q_len]`.
    pub lse: Vec<f64>,
    /// Attention probabilities `[batch, q_heads, q_len, kv_len]` when asked
    /// for (0 where masked; a row sums to 1 minus the sink's share).
    pub probs: Option<Vec<f64>>,
}

/// Computes attention on host buffers. The caller has validated the problem
/// against the buffers ([`Problem::validate_buffers`]).
pub fn attend(
    problem: &Problem,
    inputs: Inputs<'_, HostData>,
    precision: Precision,
    want_probs: bool,
) -> RefResult {
    match precision {
        Precision::F64 => attend_in::<f64>(problem, inputs, None, want_probs),
        Precision::F32 { round_p } => attend_in::<f32>(problem, inputs, round_p, want_probs),
    }
}

fn attend_in<T: Real>(
    p: &Problem,
    inp: Inputs<'_, HostData>,
    round_p: Option<DType>,
    want_probs: bool,
) -> RefResult {
    let s = p.shape;
    let dv = s.head_dim_v;
    let mut out = vec![0.0; s.batch * s.q_len * s.q_heads * dv];
    let mut lse = vec![f64::NEG_INFINITY; s.batch * s.q_heads * s.q_len];
    let mut probs = want_probs.then(|| vec![0.0; s.batch * s.q_heads * s.q_len * s.kv_len]);
    let scale = T::of(p.scale_exact());
    let o = &p.options;
    let mut scores: Vec<(usize, T)> = Vec::with_capacity(s.kv_len);
    for b in 0..s.batch {
        let m = p.seq_mask(b);
        for h in 0..s.q_heads {
            let kvh = s.kv_head(h);
            let sink = o.sinks.as_ref().map(|v| T::of(v[h].into()));
            for i in 0..m.q_len {
                // Steps 1-5: the score of every visible key.
                scores.clear();
                for j in m.kv_range(i) {
                    if let Some((x, _)) = score(p, &inp, (b, h, i, j), scale) {
                        scores.push((j, x));
                    }
                }
                // Steps 6-7: softmax with the sink in the denominator.
                // NaN-propagating maximum: a NaN score or sink makes the row NaN.
                let mut mx = sink.unwrap_or(T::of(f64::NEG_INFINITY));
                for &(_, x) in &scores {
                    mx = if x.f64().is_nan() || mx.f64().is_nan() {
                        T::of(f64::NAN)
                    } else {
                        mx.max(x)
                    };
                }
                if mx.f64() == f64::NEG_INFINITY {
                    continue; // nothing visible, no sink: output 0, lse -inf
                }
                let mut z = sink.map_or(T::of(0.0), |sk| (sk - mx).exp());
                for &(_, x) in &scores {
                    z = z + (x - mx).exp();
                }
                let mut acc = vec![T::of(0.0); dv];
                for &(j, x) in &scores {
                    let mut pj = (x - mx).exp() / z;
                    if let Some(dt) = round_p {
                        pj = T::of(round_to(dt, pj.f64()));
                    }
                    if let Some(pr) = probs.as_mut() {
                        pr[((b * s.q_heads + h) * s.q_len + i) * s.kv_len + j] = pj.f64();
                    }
                    for (d, a) in acc.iter_mut().enumerate() {
                        *a = *a + pj * T::of(inp.v.get(p.v.index([b, j, kvh, d])));
                    }
                }
                let row = ((b * s.q_len + i) * s.q_heads + h) * dv;
                for (d, a) in acc.iter().enumerate() {
                    out[row + d] = a.f64();
                }
                lse[(b * s.q_heads + h) * s.q_len + i] = (mx + z.ln()).f64();
            }
        }
    }
    RefResult { out, lse, probs }
}

/// Steps 1-5 of the contract for one pair: the score `x` and its
/// derivative with respect to the dot product `q . k` (`scale`, times
/// `1 - tanh^2` under soft-capping), or `None` when the pair is excluded
/// by the boolean mask or a `-inf` score. The caller keeps `j` inside the
/// row's window ([`crate::SeqMask::kv_range`]).
pub fn score<T: Real>(
    p: &Problem,
    inp: &Inputs<'_, HostData>,
    (b, h, i, j): (usize, usize, usize, usize),
    scale: T,
) -> Option<(T, T)> {
    let s = p.shape;
    let o = &p.options;
    let kvh = s.kv_head(h);
    if let (Some(mv), Some(mb)) = (&p.mask, inp.mask) {
        if mb.get(mv.index([b, h, i, j])) == 0.0 {
            return None;
        }
    }
    let mut dot = T::of(0.0);
    for d in 0..s.head_dim_qk {
        let q = T::of(inp.q.get(p.q.index([b, i, h, d])));
        let k = T::of(inp.k.get(p.k.index([b, j, kvh, d])));
        dot = dot + q * k;
    }
    let mut x = scale * dot;
    let mut slope = scale;
    if let Some(cap) = o.softcap {
        let cap = T::of(cap.into());
        let t = (x / cap).tanh();
        x = cap * t;
        slope = scale * (T::of(1.0) - t * t);
    }
    if let Some(sl) = &o.alibi_slopes {
        let dist = (j as i64 - p.seq_mask(b).diagonal(i)).unsigned_abs() as f64;
        x = x - T::of(sl[h].into()) * T::of(dist);
    }
    if let (Some(bd), Some(bb)) = (&p.bias, inp.bias) {
        x = x + T::of(bb.get(bd.view.index([b, h, i, j])));
    }
    if x.f64() == f64::NEG_INFINITY {
        return None; // a -inf bias masks the pair
    }
    Some((x, slope))
}

/// Writes a contiguous `[batch, q_len, q_heads, head_dim_v]` result and its
/// log-sum-exp into buffers laid out as the problem says, rounding once.
pub fn store(problem: &Problem, r: &RefResult, out: &mut HostData, lse: Option<&mut HostData>) {
    let s = problem.shape;
    for b in 0..s.batch {
        for i in 0..s.q_len {
            for h in 0..s.q_heads {
                for d in 0..s.head_dim_v {
                    let x = r.out[((b * s.q_len + i) * s.q_heads + h) * s.head_dim_v + d];
                    out.set(problem.out.index([b, i, h, d]), x);
                }
            }
        }
    }
    if let Some(l) = lse {
        for (i, &x) in r.lse.iter().enumerate() {
            l.set(i, x);
        }
    }
}

/// The reference backend: host buffers, f64 arithmetic, every option.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reference;

impl Reference {
    /// Computes attention and also returns the probabilities
    /// `[batch, q_heads, q_len, kv_len]`, for tests and visualisation.
    pub fn forward_with_probs(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
    ) -> Result<RefResult> {
        let out = HostData::zeros(problem.dtype, problem.out.extent().unwrap_or(0));
        let lse = HostData::zeros(DType::F32, problem.lse_view().extent().unwrap_or(0));
        let lse = problem.options.return_lse.then_some(&lse);
        check_call(self, problem, &inputs, &out, lse)?;
        Ok(attend(problem, inputs, Precision::F64, true))
    }
}

impl Backend for Reference {
    crate::host_buffers!();

    fn name(&self) -> String {
        "reference".into()
    }
    fn supports(&self, _problem: &Problem) -> Result<()> {
        Ok(())
    }
    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        out: &mut HostData,
        lse: Option<&mut HostData>,
    ) -> Result<()> {
        check_call(self, problem, &inputs, out, lse.as_deref())?;
        let r = attend(problem, inputs, Precision::F64, false);
        store(problem, &r, out, lse);
        Ok(())
    }
}

impl Linear for Reference {
    fn linear(
        &self,
        x: &HostData,
        rows: usize,
        w: &HostData,
        bias: Option<&HostData>,
        in_features: usize,
        out_features: usize,
    ) -> Result<HostData> {
        check_linear(self, x, rows, w, bias, in_features, out_features)?;
        let mut y = HostData::zeros(x.dtype(), rows * out_features);
        for r in 0..rows {
            for o in 0..out_features {
                let mut acc = bias.map_or(0.0, |b| b.get(o));
                for i in 0..in_features {
                    acc += x.get(r * in_features + i) * w.get(o * in_features + i);
                }
                y.set(r * out_features + o, acc);
            }
        }
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AttnOptions, Shape};

    /// The oracle's default scale is 1/sqrt(d) in f64, not its f32
    /// rounding: with d = 72 (1/sqrt(72) is 3e-9 relative away from its
    /// nearest f32), one key of score x = 72/sqrt(72) = sqrt(72) gives
    /// lse = x exactly to within f64 rounding. Through an f32 scale the
    /// error was ~2.6e-8.
    #[test]
    fn the_default_scale_is_exact() {
        for d in [32usize, 72, 80] {
            let mut p = Problem::new(Shape::new(1, 1, 1, 1, 1, d), DType::F64);
            p.options = AttnOptions::default().with_lse();
            let ones = HostData::F64(vec![1.0; d]);
            let r = attend(&p, Inputs::new(&ones, &ones, &ones), Precision::F64, false);
            let want = (d as f64).sqrt();
            assert!(
                (r.lse[0] - want).abs() <= 4.0 * f64::EPSILON * want,
                "d = {d}: lse {} vs {want}",
                r.lse[0]
            );
        }
    }
}
