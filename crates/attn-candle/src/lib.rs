//! # attn-candle: attn for candle users
//!
//! - [`attention`] / [`attention_with_lse`]: one call on candle `Tensor`s
//!   (`[batch, seq, heads, dim]`, f32/f16/bf16) with attn's
//!   [`AttnOptions`]; a candle custom op ([`op::AttnOp`]) whose CPU forward
//!   runs attn-cpu's kernel on the tensors' storage in place, whatever
//!   their strides (no copy, contiguous or not). Errors are candle errors
//!   carrying attn's message.
//! - [`CandleBackend`]: candle as an attn backend, with two engines: the
//!   fused custom op, and the plain composition a candle user writes today
//!   (matmul, scale, mask, softmax, matmul), which the benchmark report
//!   compares against. Both pass attn's conformance suite on candle's CPU
//!   device.
//!
//! Not yet here (see the project's issue): CUDA tensors (the custom op's
//! `cuda_fwd`, which will run attn-cuda), a candle `MultiHeadAttention` with
//! a key/value cache, the example, and the candle baselines in the bench
//! report.
//!
//! ```
//! use attn_candle::attention;
//! use attn_spec::AttnOptions;
//! use candle_core::{Device, Tensor, DType};
//!
//! let q = Tensor::ones((1, 3, 4, 8), DType::F32, &Device::Cpu).unwrap();
//! let k = Tensor::ones((1, 5, 2, 8), DType::F32, &Device::Cpu).unwrap();
//! let v = Tensor::ones((1, 5, 2, 8), DType::F32, &Device::Cpu).unwrap();
//! let o = attention(&q, &k, &v, &AttnOptions::default().causal()).unwrap();
//! assert_eq!(o.dims(), &[1, 3, 4, 8]);
//! ```

mod backend;
pub mod op;
mod plain;

pub use attn_spec::AttnOptions;
pub use backend::{CandleBackend, CandleEngine};

use candle_core::{Result, Tensor};
use op::{AttnOp, OpProblem};
use std::sync::Mutex;

/// Scaled dot-product attention on `[batch, seq, heads, dim]` tensors
/// (query heads a multiple of key/value heads). Returns `[batch, q_len,
/// q_heads, head_dim_v]` in the inputs' type.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, options: &AttnOptions) -> Result<Tensor> {
    let mut o = options.clone();
    o.return_lse = false;
    let op = AttnOp {
        problem: OpProblem::FromLayouts(o),
        extras: (None, None),
        lse: Mutex::new(None),
    };
    q.apply_op3_no_bwd(k, v, &op)
}

/// [`attention`] that also returns the log-sum-exp of each row, `[batch,
/// q_heads, q_len]` f32.
pub fn attention_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &AttnOptions,
) -> Result<(Tensor, Tensor)> {
    let mut o = options.clone();
    o.return_lse = true;
    let op = AttnOp {
        problem: OpProblem::FromLayouts(o),
        extras: (None, None),
        lse: Mutex::new(None),
    };
    let out = q.apply_op3_no_bwd(k, v, &op)?;
    let lse = op
        .lse
        .lock()
        .map_err(|_| candle_core::Error::Msg("attn: lse lock poisoned".into()))?
        .take()
        .ok_or_else(|| candle_core::Error::Msg("attn: the op produced no log-sum-exp".into()))?;
    let (b, hq, sq) = (q.dim(0)?, q.dim(2)?, q.dim(1)?);
    let lse = Tensor::from_vec(lse, (b, hq, sq), q.device())?;
    Ok((out, lse))
}
