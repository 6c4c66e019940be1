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
//! - [`attention_maps`]: the attention probabilities of chosen heads and
//!   rows ([`MapRequest`]), recomputed from the log-sum-exp; the layer's
//!   [`MultiHeadAttention::forward_with_maps`] returns them with its output.
//! - [`attention_ext`]: the same with a bias and a boolean mask tensor
//!   ([`Extras`]).
//! - [`MultiHeadAttention`]: a layer with candle-tensor weights
//!   (projections by candle's matmul) and a [`KvCache`] for incremental
//!   decoding (append, then attend with `q_len < kv_len`, causal aligned
//!   bottom-right). `examples/transformer_block.rs` runs a small
//!   transformer block through it.
//!
//! CUDA tensors (feature `cuda`, which needs the CUDA toolkit, as
//! candle-core's own `cuda` feature does): the custom op's `cuda_fwd` runs
//! attn-cuda's kernels on the tensors' device buffers in place, on the
//! candle device's stream. Without the feature, the op on a CUDA tensor
//! returns candle's "no cuda implementation" error.
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
mod bridge;
#[cfg(feature = "cuda")]
mod cuda;
mod grad;
pub mod maps;
mod mha;
pub mod op;
mod plain;

pub use attn_spec::AttnOptions;
pub use attn_spec::MapRequest;
pub use attn_spec::{MhaConfig, MhaWeights};
pub use backend::{CandleBackend, CandleEngine};
pub use maps::attention_maps;
pub use mha::{KvCache, MultiHeadAttention};

use candle_core::{Result, Tensor};
use op::{AttnOp, OpProblem};
use std::sync::Mutex;

/// The op shared between candle's graph (which calls its `bwd`) and the
/// caller (who reads the log-sum-exp it leaves).
struct Shared(std::sync::Arc<AttnOp>);

impl candle_core::CustomOp3 for Shared {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
        s3: &candle_core::CpuStorage,
        l3: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.0.cpu_fwd(s1, l1, s2, l2, s3, l3)
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CudaStorage,
        l2: &candle_core::Layout,
        s3: &candle_core::CudaStorage,
        l3: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        self.0.cuda_fwd(s1, l1, s2, l2, s3, l3)
    }
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        d_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.0.bwd(q, k, v, out, d_out)
    }
}

/// Optional inputs of [`attention_ext`]: a bias and a mask, each `[batch
/// or 1, q_heads or 1, q_len, kv_len]` (a size-1 axis broadcasts), and
/// sink logits. They are copied to the host once per call (they are small
/// next to K and V, which never are). A bias or sinks tensor that tracks
/// gradients gets them from candle autograd (`backward` on CPU tensors).
#[derive(Clone, Copy, Debug, Default)]
pub struct Extras<'a> {
    /// Additive bias added to the scaled scores, any float dtype.
    pub bias: Option<&'a Tensor>,
    /// Boolean mask, u8 (nonzero = the pair takes part).
    pub mask: Option<&'a Tensor>,
    /// Sink logits, `[q_heads]`, any float dtype (instead of
    /// `AttnOptions::sinks`, for sinks that are learned).
    pub sinks: Option<&'a Tensor>,
}

/// Scaled dot-product attention on `[batch, seq, heads, dim]` tensors
/// (query heads a multiple of key/value heads). Returns `[batch, q_len,
/// q_heads, head_dim_v]` in the inputs' type.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, options: &AttnOptions) -> Result<Tensor> {
    let mut o = options.clone();
    o.return_lse = false;
    Ok(attention_ext(q, k, v, Extras::default(), &o)?.0)
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
    let (out, lse) = attention_ext(q, k, v, Extras::default(), &o)?;
    let lse = lse.ok_or_else(|| candle_core::Error::Msg("attn: no log-sum-exp".into()))?;
    Ok((out, lse))
}

fn dims4(what: &str, t: &Tensor) -> Result<[usize; 4]> {
    match *t.dims() {
        [a, b, c, d] => Ok([a, b, c, d]),
        ref other => candle_core::bail!(
            "attn: {what} must be rank 4 [batch or 1, q_heads or 1, q_len, kv_len], got shape {other:?}"
        ),
    }
}

/// The general call: [`attention`] with an optional bias and boolean mask;
/// returns the log-sum-exp (`[batch, q_heads, q_len]` f32) too when
/// `options.return_lse` is set.
pub fn attention_ext(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    extras: Extras<'_>,
    options: &AttnOptions,
) -> Result<(Tensor, Option<Tensor>)> {
    let bias_dims = extras.bias.map(|b| dims4("bias", b)).transpose()?;
    let mask_dims = extras.mask.map(|m| dims4("mask", m)).transpose()?;
    if let Some(m) = extras.mask {
        if m.dtype() != candle_core::DType::U8 {
            candle_core::bail!(
                "attn: mask must be u8 (nonzero = take part), got {:?}",
                m.dtype()
            );
        }
    }
    let mut options = options.clone();
    if let Some(t) = extras.sinks {
        if options.sinks.is_some() {
            candle_core::bail!("attn: sinks given twice, in the options and as a tensor");
        }
        if t.rank() != 1 {
            candle_core::bail!(
                "attn: sinks must be rank 1 [q_heads], got shape {:?}",
                t.dims()
            );
        }
        options.sinks = Some(t.to_dtype(candle_core::DType::F32)?.to_vec1()?);
    }
    let tracks = |t: Option<&Tensor>| t.is_some_and(Tensor::track_op);
    let want = attn_spec::GradRequest {
        bias: tracks(extras.bias),
        sinks: tracks(extras.sinks),
    };
    let op = AttnOp {
        problem: OpProblem::FromLayouts {
            options: Box::new(options.clone()),
            bias_dims,
            mask_dims,
        },
        extras: (
            extras.bias.map(op::host_data).transpose()?,
            extras.mask.map(op::host_data).transpose()?,
        ),
        lse: Mutex::new(None),
        keep_for_bwd: q.track_op() || k.track_op() || v.track_op() || want.bias || want.sinks,
        saved_lse: Mutex::new(None),
        stash: Mutex::default(),
    };
    let op = std::sync::Arc::new(op);
    let mut out = q.apply_op3_arc(k, v, std::sync::Arc::new(Box::new(Shared(op.clone()))))?;
    // Parameters that learn: one gradient op each (`bridge.rs`).
    for (t, param) in [
        (extras.bias.filter(|_| want.bias), bridge::Param::Bias),
        (extras.sinks.filter(|_| want.sinks), bridge::Param::Sinks),
    ] {
        if let Some(t) = t {
            let g = bridge::ParamGrad {
                op: op.clone(),
                qkv: [q.clone(), k.clone(), v.clone()],
                param,
                want,
            };
            out = out.apply_op2(t, g)?;
        }
    }
    if !options.return_lse {
        return Ok((out, None));
    }
    let lse = op
        .lse
        .lock()
        .map_err(|_| candle_core::Error::Msg("attn: lse lock poisoned".into()))?
        .take()
        .ok_or_else(|| candle_core::Error::Msg("attn: the op produced no log-sum-exp".into()))?;
    let (b, hq, sq) = (q.dim(0)?, q.dim(2)?, q.dim(1)?);
    let lse = Tensor::from_vec(lse, (b, hq, sq), q.device())?;
    Ok((out, Some(lse)))
}
