//! The custom op's backward pass: candle autograd through attn-cpu's
//! `Backward`. candle hands `bwd` the op's inputs, its output and the
//! output's gradient; the log-sum-exp comes from the op, which kept it in
//! the forward (`AttnOp::saved_lse`), so nothing is recomputed. Tensors are
//! read to the host contiguous (`[batch, seq, heads, dim]`), and the
//! gradients come back in the inputs' shapes and type.

use crate::op::{host_data, to_candle, AttnOp, OpProblem};
use attn_cpu::Cpu;
use attn_spec::{
    Backward, GradInputs, GradRequest, HostData, Inputs, Problem, Shape as AShape, View,
};
use candle_core::{Result, Tensor};

fn tensor_of(h: HostData, like: &Tensor) -> Result<Tensor> {
    let dev = like.device();
    let dims = like.dims();
    match h {
        HostData::F32(v) => Tensor::from_vec(v, dims, dev),
        HostData::F16(v) => Tensor::from_vec(v, dims, dev),
        HostData::Bf16(v) => Tensor::from_vec(v, dims, dev),
        other => candle_core::bail!("attn: unexpected gradient type {:?}", other.dtype()),
    }
}

/// The op's gradients: dQ, dK, dV as tensors like Q, K, V, and the bias
/// and sinks gradients (f32, the bias's dims and `[q_heads]`) when `req`
/// asks for them.
pub struct OpGrads {
    /// dQ, dK, dV.
    pub qkv: (Tensor, Tensor, Tensor),
    /// The bias gradient.
    pub dbias: Option<Vec<f32>>,
    /// The sinks' gradient.
    pub dsinks: Option<Vec<f32>>,
}

/// dQ, dK, dV of the op's call on `q, k, v` with output `out` and output
/// gradient `d_out` (candle's `bwd` of the op): the ones a parameter's
/// gradient op computed first in this backward pass
/// ([`crate::bridge`]), or computed here.
pub fn backward(
    op: &AttnOp,
    qkv: [&Tensor; 3],
    out: &Tensor,
    d_out: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let kept = op
        .stash
        .lock()
        .map_err(|_| candle_core::Error::Msg("attn: stash lock poisoned".into()))?
        .qkv
        .take();
    let (dq, dk, dv) = match kept {
        Some(g) => g,
        None => gradients(op, qkv, out, d_out, GradRequest::default())?.qkv,
    };
    Ok((Some(dq), Some(dk), Some(dv)))
}

/// Every gradient of the op's call that `req` asks for (see [`backward`]).
pub fn gradients(
    op: &AttnOp,
    [q, k, v]: [&Tensor; 3],
    out: &Tensor,
    d_out: &Tensor,
    req: GradRequest,
) -> Result<OpGrads> {
    if !q.device().is_cpu() {
        candle_core::bail!(
            "attn: the backward pass runs on candle's CPU device (attn-candle's CUDA path has no backward yet)"
        );
    }
    let OpProblem::FromLayouts {
        options,
        bias_dims,
        mask_dims,
    } = &op.problem
    else {
        candle_core::bail!("attn: the backend-path op has no backward pass");
    };
    let lse = op
        .saved_lse
        .lock()
        .map_err(|_| candle_core::Error::Msg("attn: lse lock poisoned".into()))?
        .clone()
        .ok_or_else(|| {
            candle_core::Error::Msg(
                "attn: no log-sum-exp was kept by the forward (no input tracked gradients)".into(),
            )
        })?;
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    let shape = AShape::new(qd[0], qd[2], kd[2], qd[1], kd[1], qd[3]).with_head_dim_v(vd[3]);
    let [qh, kh, vh, oh, dh] = [q, k, v, out, d_out].map(host_data);
    let (qh, kh, vh, oh, dh) = (qh?, kh?, vh?, oh?, dh?);
    let mut p = Problem::new(shape, qh.dtype()).with_options((**options).clone());
    if let (Some(d), Some(b)) = (bias_dims, &op.extras.0) {
        p = p.with_bias(View::contiguous(*d), b.dtype());
    }
    if let Some(d) = mask_dims {
        p = p.with_mask(View::contiguous(*d));
    }
    let inputs = Inputs {
        q: &qh,
        k: &kh,
        v: &vh,
        bias: op.extras.0.as_ref(),
        mask: op.extras.1.as_ref(),
    };
    let lse = HostData::F32(lse);
    let fwd = GradInputs {
        out: &oh,
        lse: Some(&lse),
        d_out: &dh,
    };
    let g = Cpu::new()
        .backward(&p, inputs, fwd, req)
        .map_err(to_candle)?;
    let f32s = |h: Option<HostData>| match h {
        Some(HostData::F32(v)) => Ok(Some(v)),
        None => Ok(None),
        Some(other) => Err(candle_core::Error::Msg(format!(
            "attn: unexpected parameter gradient type {:?}",
            other.dtype()
        ))),
    };
    Ok(OpGrads {
        qkv: (
            tensor_of(g.dq, q)?,
            tensor_of(g.dk, k)?,
            tensor_of(g.dv, v)?,
        ),
        dbias: f32s(g.dbias)?,
        dsinks: f32s(g.dsinks)?,
    })
}
