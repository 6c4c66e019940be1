//! Attention maps on candle tensors ([`attn_spec::AttentionMaps`] for
//! [`CandleBackend`]): the fused engine recomputes them from the
//! log-sum-exp with attn-cpu's maps kernel (on candle's CPU device; the
//! selected probabilities only), the plain engine takes them from its own
//! softmax (the full `[b, h, sq, sk]` matrix it forms anyway, then the
//! selection). The result is a flat f32 tensor on the backend's device,
//! laid out as the [`attn_spec::MapLayout`] says.

use crate::backend::{attn_dtype, CandleBackend, CandleEngine};
use crate::op::to_candle;
use crate::plain;
use attn_spec::{
    check_maps_call, AttentionMaps, AttnError, AttnOptions, Backend, DType, HostData, Inputs,
    MapLayout, MapRequest, Problem, Result, Shape,
};
use candle_core::{Device, Result as CResult, Tensor};

impl AttentionMaps for CandleBackend {
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Tensor>,
        lse: &Tensor,
        layout: &MapLayout,
        maps: &mut Tensor,
    ) -> Result<()> {
        check_maps_call(self, problem, &inputs, lse, layout, maps)?;
        if layout.is_empty() {
            return Ok(());
        }
        *maps = match self.engine {
            CandleEngine::Fused => {
                if !self.device.is_cpu() {
                    return Err(AttnError::Unsupported {
                        backend: self.name(),
                        feature: "attention maps of CUDA tensors".into(),
                        reason: "the fused engine's maps run attn-cpu's kernel on CPU storage"
                            .into(),
                    });
                }
                let host = |t: &Tensor| self.download(t);
                let (q, k, v) = (host(inputs.q)?, host(inputs.k)?, host(inputs.v)?);
                let bias = inputs.bias.map(host).transpose()?;
                let mask = inputs.mask.map(host).transpose()?;
                let hi = Inputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    bias: bias.as_ref(),
                    mask: mask.as_ref(),
                };
                let mut out = HostData::zeros(DType::F32, layout.len());
                attn_cpu::Cpu::new().maps_into(problem, hi, &host(lse)?, layout, &mut out)?;
                self.upload(&out)?
            }
            CandleEngine::Plain => {
                plain_maps(problem, inputs, layout, &self.device).map_err(|e| self.err(e))?
            }
        };
        Ok(())
    }
}

/// The plain engine's maps: its softmax, hidden pairs set to exactly 0
/// (a NaN score at a hidden pair must not show), then the selection.
fn plain_maps(
    p: &Problem,
    inputs: Inputs<'_, Tensor>,
    layout: &MapLayout,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    let pr = plain::probs(p, inputs, dev, true)?;
    let vis = pr.visible.expect("asked for");
    let all = vis.where_cond(&pr.pr, &pr.pr.zeros_like()?)?;
    let idx = |v: &[usize]| {
        let v: Vec<u32> = v.iter().map(|&x| x as u32).collect();
        Tensor::from_vec(v.clone(), v.len(), dev)
    };
    let sel = all
        .index_select(&idx(&layout.batches)?, 0)?
        .index_select(&idx(&layout.heads)?, 1)?
        .narrow(2, layout.rows.start, layout.rows.len())?;
    let sel = if layout.averaged {
        sel.mean_keepdim(1)?
    } else {
        sel
    };
    sel.contiguous()?.flatten_all()
}

/// The problem of `attention(q, k, v, options)` on `[batch, seq, heads,
/// dim]` tensors.
fn problem_of(q: &Tensor, k: &Tensor, v: &Tensor, options: &AttnOptions) -> CResult<Problem> {
    let (b, sq, hq, d) = q.dims4()?;
    let (_, sk, hkv, _) = k.dims4()?;
    let dv = v.dim(3)?;
    let dtype = attn_dtype(q.dtype())
        .ok_or_else(|| candle_core::Error::Msg(format!("attn: {:?} tensors", q.dtype())))?;
    let shape = Shape::new(b, hq, hkv, sq, sk, d).with_head_dim_v(dv);
    let mut opts = options.clone();
    opts.return_lse = false;
    Ok(Problem::new(shape, dtype).with_options(opts))
}

/// The attention maps of `attention(q, k, v, options)` (`[batch, seq,
/// heads, dim]` tensors, any strides) that `request` selects, as a `[batches,
/// heads (1 when averaged), rows, kv_len]` f32 tensor on the inputs'
/// device: recomputed from `lse` (`[batch, q_heads, q_len]`, as
/// [`crate::attention_with_lse`] returns it), or from a forward call made
/// here when `lse` is `None`. Checked against the request's budget before
/// anything is allocated.
pub fn attention_maps(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: Option<&Tensor>,
    options: &AttnOptions,
    request: &MapRequest,
) -> CResult<Tensor> {
    let problem = problem_of(q, k, v, options)?;
    let be = CandleBackend {
        engine: CandleEngine::Fused,
        device: q.device().clone(),
    };
    let flat = |t: &Tensor| t.contiguous()?.flatten_all();
    let (qf, kf, vf) = (flat(q)?, flat(k)?, flat(v)?);
    let lse = lse.map(flat).transpose()?;
    let m = be
        .maps(&problem, Inputs::new(&qf, &kf, &vf), lse.as_ref(), request)
        .map_err(to_candle)?;
    m.probs.reshape(m.layout.dims().to_vec())
}

/// Refuses `request` (out of range, over budget) before a layer attends.
pub(crate) fn check_request(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &AttnOptions,
    request: &MapRequest,
) -> CResult<()> {
    request
        .resolve(&problem_of(q, k, v, options)?)
        .map(|_| ())
        .map_err(to_candle)
}
