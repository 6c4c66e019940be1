//! Gradients of the bias and sinks tensors through candle autograd.
//!
//! A candle custom op takes at most three tensors, and the attention op's
//! are Q, K and V. So a bias or sinks tensor that tracks gradients is
//! joined to the graph by one more op after the attention's, `ParamGrad`
//! (a `CustomOp2` over the attention output and the parameter), whose
//! forward passes the output through (a copy) and whose backward gives the
//! parameter its gradient. Backward runs from the loss, so the outermost
//! of these ops runs first: it computes every gradient of the call in one
//! backward pass of attn-cpu and leaves the others in the attention op's
//! [`Stash`], where the inner `ParamGrad` and the attention op's own `bwd`
//! take them, so nothing is computed twice. (If one is missing, as when a
//! graph is walked a second time, it is computed again.)

use crate::grad::{gradients, OpGrads};
use crate::op::AttnOp;
use attn_spec::GradRequest;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use std::sync::{Arc, MutexGuard};

/// Gradients computed by one op of a call and not yet taken by the others.
#[derive(Debug, Default)]
pub struct Stash {
    /// dQ, dK, dV, for the attention op's `bwd`.
    pub qkv: Option<(Tensor, Tensor, Tensor)>,
    /// The bias gradient (f32, the bias's dims).
    pub dbias: Option<Vec<f32>>,
    /// The sinks' gradient (f32, `[q_heads]`).
    pub dsinks: Option<Vec<f32>>,
}

/// Which parameter a [`ParamGrad`] carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// The additive bias, `[batch or 1, q_heads or 1, q_len, kv_len]`.
    Bias,
    /// The sink logits, `[q_heads]`.
    Sinks,
}

/// The op that gives a bias or sinks tensor its gradient (module docs).
pub struct ParamGrad {
    /// The attention op of the call.
    pub op: Arc<AttnOp>,
    /// Its Q, K and V.
    pub qkv: [Tensor; 3],
    /// The parameter this op carries.
    pub param: Param,
    /// Every parameter gradient the call needs.
    pub want: GradRequest,
}

fn stash(op: &AttnOp) -> Result<MutexGuard<'_, Stash>> {
    op.stash
        .lock()
        .map_err(|_| candle_core::Error::Msg("attn: stash lock poisoned".into()))
}

impl CustomOp2 for ParamGrad {
    fn name(&self) -> &'static str {
        "attn-param-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let Some((a, b)) = l1.contiguous_offsets() else {
            candle_core::bail!(
                "attn: the attention output passed to {} is not contiguous",
                self.name()
            );
        };
        let out = match s1 {
            CpuStorage::F32(v) => CpuStorage::F32(v[a..b].to_vec()),
            CpuStorage::F16(v) => CpuStorage::F16(v[a..b].to_vec()),
            CpuStorage::BF16(v) => CpuStorage::BF16(v[a..b].to_vec()),
            _ => candle_core::bail!("attn: the attention output is not f32, f16 or bf16"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        out: &Tensor,
        param: &Tensor,
        _res: &Tensor,
        d_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let take = |s: &mut Stash| match self.param {
            Param::Bias => s.dbias.take(),
            Param::Sinks => s.dsinks.take(),
        };
        let kept = take(&mut *stash(&self.op)?);
        let grad = match kept {
            Some(g) => g,
            None => {
                let [q, k, v] = &self.qkv;
                let OpGrads { qkv, dbias, dsinks } =
                    gradients(&self.op, [q, k, v], out, d_out, self.want)?;
                let mut s = stash(&self.op)?;
                *s = Stash {
                    qkv: Some(qkv),
                    dbias,
                    dsinks,
                };
                take(&mut s).ok_or_else(|| {
                    candle_core::Error::Msg(
                        "attn: the backward pass gave no parameter gradient".into(),
                    )
                })?
            }
        };
        let g = Tensor::from_vec(grad, param.dims(), param.device())?.to_dtype(param.dtype())?;
        Ok((Some(d_out.clone()), Some(g)))
    }
}
