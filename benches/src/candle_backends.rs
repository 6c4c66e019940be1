//! The candle backends and baselines of the report: attn's fused custom op
//! on candle tensors, the plain candle composition (matmul, scale, mask,
//! softmax, matmul), and candle-nn's own fused CPU attention
//! (`candle_nn::attention::flash_attn`), the path candle users have today.
//! Each is prepared once per case as a closure that computes the case's
//! output; asked for it, the closure also returns that output as
//! `[batch, q_len, q_heads, dim]` host data for the correctness check.

use crate::BenchCase;
use attn_candle::{attention, CandleBackend};
use attn_spec::{Backend, DType, HostData, Inputs, MaskKind};
use candle_core::{Device, Tensor};
use candle_nn::attention::{flash_attn, AttnMask};

/// One candle-based backend of the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CandleKind {
    /// `attn_candle::attention` on `[b, s, h, d]` candle tensors.
    Fused,
    /// attn-candle's plain-composition engine.
    Plain,
    /// `candle_nn::attention::flash_attn`.
    CandleNnFlash,
}

/// A prepared computation: `run(true)` also returns the output.
pub type Runner = Box<dyn FnMut(bool) -> Result<Option<HostData>, String> + Send>;

impl CandleKind {
    /// All of them.
    pub const ALL: [CandleKind; 3] = [
        CandleKind::Fused,
        CandleKind::Plain,
        CandleKind::CandleNnFlash,
    ];

    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            CandleKind::Fused => "candle-attn",
            CandleKind::Plain => "candle-plain",
            CandleKind::CandleNnFlash => "candle-nn-flash",
        }
    }

    /// Why this baseline is not timed on `case` although it could run it:
    /// it would take minutes (`None`: no cap). candle-nn's CPU flash
    /// kernel on the 8192-token prefill took about a quarter of a whole
    /// 37-minute run on two cores.
    pub fn capped(self, c: &BenchCase) -> Option<&'static str> {
        match self {
            CandleKind::CandleNnFlash if !c.is_decode() && c.q_len.max(c.kv_len) > 4096 => {
                Some("candle-nn's CPU flash kernel takes minutes per case at this length")
            }
            CandleKind::CandleNnFlash
                if matches!(c.mask, MaskKind::Window { .. }) && c.q_len * c.kv_len > 2048 * 2048 =>
            {
                Some("candle-nn's CPU flash kernel takes a window as an additive mask over the whole score matrix: 40 s on one thread and 19 s on two at 4096 tokens")
            }
            CandleKind::CandleNnFlash if !c.is_decode() && c.dtype == DType::Bf16 => Some(
                "candle-nn's CPU flash kernel took 12 s per call on bf16 at 2048 tokens (2.5 minutes a thread count)",
            ),
            _ => None,
        }
    }

    /// Whether this backend runs `case` (the plain composition materialises
    /// the score matrix: at most 256 MiB of it; candle-nn's kernel takes
    /// only some masks and types per batch size; not where [`Self::capped`]).
    pub fn applies(self, c: &BenchCase) -> bool {
        if self.capped(c).is_some() {
            return false;
        }
        match self {
            CandleKind::Fused => true,
            CandleKind::Plain => c.batch * c.q_heads * c.q_len * c.kv_len * 4 <= 256 << 20,
            CandleKind::CandleNnFlash => match c.mask {
                MaskKind::None | MaskKind::Causal => c.batch == 1 || c.dtype != DType::Bf16,
                MaskKind::Window { .. } => c.batch == 1 && c.q_len * c.kv_len * 4 <= 256 << 20,
            },
        }
    }

    /// Prepares `case` (data uploaded once).
    pub fn prepare(self, case: &BenchCase) -> Result<Runner, String> {
        let e = |e: candle_core::Error| e.to_string();
        let [q, k, v] = case.data();
        let dev = Device::Cpu;
        let be = CandleBackend::plain_cpu();
        let up = |d: &HostData| be.upload(d).map_err(|e| e.to_string());
        let (qf, kf, vf) = (up(&q)?, up(&k)?, up(&v)?);
        let shape4 = |s: usize, h: usize| (case.batch, s, h, case.head_dim);
        let q4 = qf.reshape(shape4(case.q_len, case.q_heads)).map_err(e)?;
        let k4 = kf.reshape(shape4(case.kv_len, case.kv_heads)).map_err(e)?;
        let v4 = vf.reshape(shape4(case.kv_len, case.kv_heads)).map_err(e)?;
        let problem = case.problem();
        let c = case.clone();
        match self {
            CandleKind::Fused => {
                let opts = problem.options.clone();
                Ok(Box::new(move |want| {
                    let o = attention(&q4, &k4, &v4, &opts).map_err(e)?;
                    want.then(|| be.download(&o).map_err(|e| e.to_string()))
                        .transpose()
                }))
            }
            CandleKind::Plain => {
                let mut out = be
                    .zeros(c.dtype, problem.out.extent().unwrap_or(0))
                    .map_err(|e| e.to_string())?;
                Ok(Box::new(move |want| {
                    be.forward_into(&problem, Inputs::new(&qf, &kf, &vf), &mut out, None)
                        .map_err(|e| e.to_string())?;
                    want.then(|| be.download(&out).map_err(|e| e.to_string()))
                        .transpose()
                }))
            }
            CandleKind::CandleNnFlash => {
                let scale = problem.scale();
                let offset = c.kv_len - c.q_len;
                let mask = match c.mask {
                    MaskKind::None => AttnMask::None,
                    MaskKind::Causal => AttnMask::causal_with_offset(offset),
                    MaskKind::Window { .. } => {
                        // An additive (q_len, kv_len) mask from attn's model.
                        let m = problem.seq_mask(0);
                        let add: Vec<f32> = (0..c.q_len)
                            .flat_map(|i| (0..c.kv_len).map(move |j| (i, j)))
                            .map(|(i, j)| {
                                if m.visible(i, j) {
                                    0.0
                                } else {
                                    f32::NEG_INFINITY
                                }
                            })
                            .collect();
                        AttnMask::Mask(Tensor::from_vec(add, (c.q_len, c.kv_len), &dev).map_err(e)?)
                    }
                };
                Ok(Box::new(move |want| {
                    let o = match c.dtype {
                        DType::F16 => {
                            flash_attn::<half::f16>(&q4, &k4, &v4, scale, mask.clone(), None, None)
                        }
                        DType::Bf16 => {
                            flash_attn::<half::bf16>(&q4, &k4, &v4, scale, mask.clone(), None, None)
                        }
                        _ => flash_attn::<f32>(&q4, &k4, &v4, scale, mask.clone(), None, None),
                    }
                    .map_err(e)?;
                    // (B, H, S, D) -> (B, S, H, D) for the check.
                    want.then(|| {
                        let t = o.transpose(1, 2).and_then(|t| t.contiguous()).map_err(e)?;
                        be.download(&t).map_err(|e| e.to_string())
                    })
                    .transpose()
                }))
            }
        }
    }
}
