//! A conformance case: a problem plus its host tensors, built
//! deterministically from [`CaseParams`] (which proptest generates, see
//! [`crate::strategy`]).

use crate::rng::Rng;
use attn_spec::{
    alibi_slopes, round_to, AttnOptions, DType, HostData, Inputs, MaskKind, Problem, SeqMask,
    Shape, View,
};

/// Where a broadcastable tensor (bias, mask) varies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bcast {
    /// One slice per batch entry (else broadcast over batch).
    pub per_batch: bool,
    /// One slice per query head (else broadcast over heads).
    pub per_head: bool,
}

/// Adversarial numbers a case's data may carry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Numbers {
    /// Uniform data in `[-1, 1)`: the ordinary case.
    #[default]
    Plain,
    /// A scale that puts scores at up to `2^126` in magnitude, the edge of
    /// the range SEMANTICS §6 guarantees (twice that, times `log2 e`, is
    /// still a finite f32).
    NearOverflow,
    /// Q, K and V scaled into the subnormal range of the element type.
    Subnormal,
    /// A NaN in one element of Q: that row (if it sees any key) must be NaN.
    NanVisible,
    /// NaN in Q's padding rows and K's and V's padding keys (positions
    /// excluded for every row; needs per-sequence lengths): a row may come
    /// back NaN (SEMANTICS §6 leaves it open) but never otherwise wrong.
    NanExcluded,
}

/// Everything that defines a case; the tensors follow from `seed`.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseParams {
    /// The sizes.
    pub shape: Shape,
    /// Element type of Q, K, V and the output.
    pub dtype: DType,
    /// `[batch, heads, seq, dim]` storage instead of `[batch, seq, heads, dim]`.
    pub bhsd: bool,
    /// Extra elements before each of Q, K, V in its buffer (view offsets).
    pub offset: usize,
    /// The options, except per-sequence lengths, slopes and sinks, which
    /// are drawn from the seed when the flags below ask for them.
    pub options: AttnOptions,
    /// Draw per-sequence query lengths.
    pub q_lens: bool,
    /// Draw per-sequence key lengths.
    pub kv_lens: bool,
    /// Use the ALiBi slopes of the paper.
    pub alibi: bool,
    /// Draw a sink logit per head.
    pub sinks: bool,
    /// An additive bias (of the problem's dtype), some entries `-inf`.
    pub bias: Option<Bcast>,
    /// A boolean mask, with the given fraction of pairs kept.
    pub bool_mask: Option<(Bcast, f64)>,
    /// Scale so that logits reach about +-1e4.
    pub large_logits: bool,
    /// Adversarial numbers in the data.
    pub numbers: Numbers,
    /// Seed of the tensor data.
    pub seed: u64,
}

impl CaseParams {
    /// Plain parameters: no options, contiguous BSHD, f32, seed 0.
    pub fn plain(shape: Shape) -> Self {
        CaseParams {
            shape,
            dtype: DType::F32,
            bhsd: false,
            offset: 0,
            options: AttnOptions::default(),
            q_lens: false,
            kv_lens: false,
            alibi: false,
            sinks: false,
            bias: None,
            bool_mask: None,
            large_logits: false,
            numbers: Numbers::Plain,
            seed: 0,
        }
    }
}

/// A case ready to run: the problem and its host tensors.
#[derive(Clone, Debug)]
pub struct Case {
    /// The parameters it was built from (for failure messages).
    pub params: CaseParams,
    /// The problem.
    pub problem: Problem,
    /// Q.
    pub q: HostData,
    /// K.
    pub k: HostData,
    /// V.
    pub v: HostData,
    /// The bias, if any.
    pub bias: Option<HostData>,
    /// The boolean mask, if any.
    pub mask: Option<HostData>,
}

impl Case {
    /// Builds the case: draws lengths, slopes, sinks and tensors from the seed.
    pub fn build(params: CaseParams) -> Case {
        let s = params.shape;
        let mut rng = Rng::new(params.seed);
        let mut opts = params.options.clone();
        if params.q_lens {
            opts.q_lens = Some((0..s.batch).map(|_| rng.upto(s.q_len)).collect());
        }
        // NaN in padding needs padding: draw key lengths if nothing else pads.
        let nan_pad = params.numbers == Numbers::NanExcluded && !params.q_lens;
        if params.kv_lens || nan_pad {
            opts.kv_lens = Some((0..s.batch).map(|_| rng.upto(s.kv_len)).collect());
        }
        if params.alibi {
            opts.alibi_slopes = Some(alibi_slopes(s.q_heads));
        }
        if params.sinks {
            opts.sinks = Some(
                (0..s.q_heads)
                    .map(|_| rng.uniform(-2.0, 2.0) as f32)
                    .collect(),
            );
        }
        if params.large_logits {
            // q . k of uniform(-1, 1) vectors has standard deviation
            // sqrt(d) / 3: this scale puts logits around +-1e4.
            opts.scale = Some((3.0e4 / (s.head_dim_qk as f64).sqrt()) as f32);
        }
        let mut problem = Problem::new(s, params.dtype);
        if params.bhsd {
            problem = problem.bhsd();
        }
        let off = params.offset;
        problem.q = problem.q.with_offset(off);
        problem.k = problem.k.with_offset(off);
        problem.v = problem.v.with_offset(off);
        if params.numbers == Numbers::NearOverflow {
            // |q . k| <= d_qk (entries in [-1, 1]), so |score| <= 2^126.
            opts.scale = Some((2f64.powi(126) / s.head_dim_qk as f64) as f32);
        }
        let dt = params.dtype;
        let mut draw = |view: &View| -> Vec<f64> {
            let n = view.extent().expect("generated sizes are small");
            (0..n)
                .map(|_| round_to(dt, rng.uniform(-1.0, 1.0)))
                .collect()
        };
        let (mut q, mut k, mut v) = (draw(&problem.q), draw(&problem.k), draw(&problem.v));
        match params.numbers {
            Numbers::Subnormal => {
                // Below the smallest normal of the type by 2^3..2^13: the
                // data keeps a few significant bits, scores underflow.
                let tiny = match dt {
                    DType::F16 => 2f64.powi(-17),
                    DType::F64 => 2f64.powi(-1025),
                    _ => 2f64.powi(-129),
                };
                for x in q.iter_mut().chain(&mut k).chain(&mut v) {
                    *x = round_to(dt, *x * tiny);
                }
            }
            // Only where the row sees a key through the window and lengths
            // alone (no bias or boolean mask to exclude it): that row's
            // output must then be NaN. A NaN in the query of a row that
            // sees nothing is NaN at an excluded position.
            Numbers::NanVisible if !q.is_empty() && params.bias.is_none() => {
                let (b, i) = (rng.upto(s.batch - 1), rng.upto(s.q_len - 1));
                let (h, d) = (rng.upto(s.q_heads - 1), rng.upto(s.head_dim_qk - 1));
                let ql = opts.q_lens.as_ref().map_or(s.q_len, |l| l[b]);
                let kl = opts.kv_lens.as_ref().map_or(s.kv_len, |l| l[b]);
                let m = SeqMask::new(opts.mask, opts.alignment, ql, kl);
                if params.bool_mask.is_none() && !m.kv_range(i).is_empty() {
                    q[problem.q.index([b, i, h, d])] = f64::NAN;
                }
            }
            Numbers::NanExcluded => {
                for b in 0..s.batch {
                    let ql = opts.q_lens.as_ref().map_or(s.q_len, |l| l[b]);
                    let kl = opts.kv_lens.as_ref().map_or(s.kv_len, |l| l[b]);
                    for i in ql..s.q_len {
                        for h in 0..s.q_heads {
                            q[problem.q.index([b, i, h, 0])] = f64::NAN;
                        }
                    }
                    for j in kl..s.kv_len {
                        for g in 0..s.kv_heads {
                            k[problem.k.index([b, j, g, 0])] = f64::NAN;
                            v[problem.v.index([b, j, g, 0])] = f64::NAN;
                        }
                    }
                }
            }
            _ => {}
        }
        let (q, k, v) = (
            HostData::from_f64(dt, &q),
            HostData::from_f64(dt, &k),
            HostData::from_f64(dt, &v),
        );
        let bcast_view = |bc: Bcast| {
            View::contiguous([
                if bc.per_batch { s.batch } else { 1 },
                if bc.per_head { s.q_heads } else { 1 },
                s.q_len,
                s.kv_len,
            ])
        };
        let bias = params.bias.map(|bc| {
            let view = bcast_view(bc);
            let n = view.extent().expect("small");
            let mut vals: Vec<f64> = (0..n)
                .map(|_| {
                    if rng.chance(0.05) {
                        f64::NEG_INFINITY
                    } else {
                        round_to(dt, rng.uniform(-2.0, 2.0))
                    }
                })
                .collect();
            // Some whole rows of -inf: rows that see keys by the window but
            // none through the bias (fully masked, output 0, LSE -inf).
            for row in vals.chunks_mut(s.kv_len.max(1)) {
                if rng.chance(0.1) {
                    row.fill(f64::NEG_INFINITY);
                }
            }
            problem.bias = Some(attn_spec::TensorDesc { view, dtype: dt });
            HostData::from_f64(dt, &vals)
        });
        let mask = params.bool_mask.map(|(bc, keep)| {
            let view = bcast_view(bc);
            let n = view.extent().expect("small");
            problem.mask = Some(view);
            HostData::Bool((0..n).map(|_| rng.chance(keep)).collect())
        });
        problem.options = opts;
        Case {
            params,
            problem,
            q,
            k,
            v,
            bias,
            mask,
        }
    }

    /// The host tensors as [`Inputs`].
    pub fn inputs(&self) -> Inputs<'_, HostData> {
        Inputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            bias: self.bias.as_ref(),
            mask: self.mask.as_ref(),
        }
    }

    /// A one-line description for failure messages.
    pub fn describe(&self) -> String {
        let s = self.problem.shape;
        let o = &self.problem.options;
        format!(
            "b={} hq={} hkv={} sq={} sk={} dqk={} dv={} {} {}{} mask={:?} {:?} softcap={:?} alibi={} sinks={} q_lens={:?} kv_lens={:?} bias={:?} bool_mask={:?} large={} numbers={:?} seed={}",
            s.batch, s.q_heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim_qk, s.head_dim_v,
            self.params.dtype,
            if self.params.bhsd { "bhsd" } else { "bshd" },
            if self.params.offset > 0 { format!(" offset={}", self.params.offset) } else { String::new() },
            o.mask, o.alignment, o.softcap, self.params.alibi, self.params.sinks, o.q_lens, o.kv_lens,
            self.params.bias, self.params.bool_mask, self.params.large_logits, self.params.numbers, self.params.seed
        )
    }
}

/// All mask kinds worth distinguishing: none, causal, and windows with
/// each side unbounded, 0, 1, wider, about a sequence long, or far beyond
/// any sequence up to `usize::MAX` (which must act as unbounded).
pub fn mask_kinds() -> Vec<MaskKind> {
    let sides = [
        None,
        Some(0),
        Some(1),
        Some(7),
        Some(300),
        Some(u32::MAX as usize),
        Some(i64::MAX as usize + 1),
        Some(usize::MAX),
    ];
    let mut v = vec![MaskKind::None, MaskKind::Causal];
    for l in sides {
        for r in sides {
            v.push(MaskKind::Window { left: l, right: r });
        }
    }
    v
}
