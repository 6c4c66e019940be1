//! The fused attention as a candle custom op (`CustomOp3` over Q, K, V).
//!
//! `cpu_fwd` receives candle's storage and layouts; the layouts' strides
//! and offsets become attn views, so attn-cpu reads Q, K and V where they
//! are, contiguous or not: no input is ever copied. The output is written
//! once, in the layout the problem describes. The log-sum-exp, when asked
//! for, is a second result that a candle op cannot return; it is handed
//! back through the op value.
//!
//! Backward (candle autograd): when an input tracks gradients, the forward
//! also computes the log-sum-exp and keeps it in the op (`saved_lse`),
//! which candle's graph holds until the backward pass. candle's `bwd`
//! receives Q, K, V, the output and its gradient but no log-sum-exp; the
//! kept one saves recomputing the forward. `bwd` runs attn-cpu's backward
//! pass (CPU tensors). A bias or sinks tensor that tracks gradients gets
//! them through one more op after this one (`bridge.rs`); the boolean
//! mask has none.

use attn_cpu::{Cpu, CpuElement};
use attn_spec::{AttnError, HostData, Problem, View};
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, WithDType};
use std::cell::Cell;
use std::sync::Mutex;

/// How the op finds its problem.
#[derive(Debug)]
pub enum OpProblem {
    /// Q, K, V are `[batch, seq, heads, dim]` tensors: shapes and strides
    /// come from their layouts; the output is contiguous `[batch, q_len,
    /// q_heads, head_dim_v]`.
    FromLayouts {
        /// The options.
        options: Box<attn_spec::AttnOptions>,
        /// Dims of the bias in [`AttnOp::extras`], contiguous `[batch or 1,
        /// q_heads or 1, q_len, kv_len]`.
        bias_dims: Option<[usize; 4]>,
        /// Dims of the boolean mask in [`AttnOp::extras`], as the bias.
        mask_dims: Option<[usize; 4]>,
    },
    /// Q, K, V are flat buffers and the problem's views index into them
    /// (the attn `Backend` path); the output is a flat buffer of the
    /// output view's extent.
    Given(Box<Problem>),
}

/// The attention custom op.
#[derive(Debug)]
pub struct AttnOp {
    /// The problem source.
    pub problem: OpProblem,
    /// Host copies of the bias and boolean mask, if the problem has them
    /// (these small tensors are copied once; Q, K and V never are).
    pub extras: (Option<HostData>, Option<HostData>),
    /// The log-sum-exp of the last run, when the options ask for it.
    pub lse: Mutex<Option<Vec<f32>>>,
    /// Whether the forward keeps its log-sum-exp for `bwd`.
    pub keep_for_bwd: bool,
    /// The log-sum-exp kept for `bwd`.
    pub saved_lse: Mutex<Option<Vec<f32>>>,
    /// Gradients computed by a parameter's gradient op and not yet taken
    /// (`bridge.rs`).
    pub stash: Mutex<crate::bridge::Stash>,
}

thread_local! {
    static LAST_Q_PTR: Cell<usize> = const { Cell::new(0) };
}

/// Address of the Q data the last `cpu_fwd` on this thread computed from:
/// lets tests prove that a contiguous tensor is read in place.
pub fn last_q_ptr() -> usize {
    LAST_Q_PTR.with(Cell::get)
}

fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("attn: lse lock poisoned".into())
}

/// attn's error as a candle error, message kept.
pub fn to_candle(e: AttnError) -> candle_core::Error {
    candle_core::Error::Msg(format!("attn: {e}"))
}

/// A candle tensor's elements as attn host data, read in logical
/// (row-major) order: how the small bias and mask tensors reach the op.
/// u8 tensors are boolean masks (nonzero = take part).
pub fn host_data(t: &candle_core::Tensor) -> candle_core::Result<HostData> {
    use candle_core::DType as D;
    let flat = t.flatten_all()?;
    Ok(match flat.dtype() {
        D::F32 => HostData::F32(flat.to_vec1()?),
        D::F16 => HostData::F16(flat.to_vec1()?),
        D::BF16 => HostData::Bf16(flat.to_vec1()?),
        D::F64 => HostData::F64(flat.to_vec1()?),
        D::U8 => HostData::Bool(flat.to_vec1::<u8>()?.into_iter().map(|x| x != 0).collect()),
        other => candle_core::bail!(
            "attn: tensors must be f32, f16, bf16, f64 or u8 (masks); got {other:?}"
        ),
    })
}

fn view_of(l: &Layout) -> candle_core::Result<attn_spec::View> {
    let dims = l.dims();
    if dims.len() != 4 {
        candle_core::bail!(
            "attn: expected a rank-4 [batch, seq, heads, dim] tensor, got shape {:?}",
            dims
        );
    }
    let st = l.stride();
    Ok(attn_spec::View {
        dims: [dims[0], dims[1], dims[2], dims[3]],
        strides: [st[0], st[1], st[2], st[3]],
        offset: l.start_offset(),
    })
}

impl AttnOp {
    /// The problem of one call: the op's own, or one built from the
    /// inputs' layouts.
    pub(crate) fn problem(
        &self,
        dtype: attn_spec::DType,
        l: [&Layout; 3],
    ) -> candle_core::Result<Problem> {
        match &self.problem {
            OpProblem::Given(p) => {
                let mut p = (**p).clone();
                p.q.offset += l[0].start_offset();
                p.k.offset += l[1].start_offset();
                p.v.offset += l[2].start_offset();
                Ok(p)
            }
            OpProblem::FromLayouts {
                options,
                bias_dims,
                mask_dims,
            } => {
                let (q, k, v) = (view_of(l[0])?, view_of(l[1])?, view_of(l[2])?);
                let shape = attn_spec::Shape::new(
                    q.dims[0], q.dims[2], k.dims[2], q.dims[1], k.dims[1], q.dims[3],
                )
                .with_head_dim_v(v.dims[3]);
                let mut p = Problem::new(shape, dtype).with_options((**options).clone());
                (p.q, p.k, p.v) = (q, k, v);
                if let (Some(d), Some(b)) = (bias_dims, &self.extras.0) {
                    p = p.with_bias(View::contiguous(*d), b.dtype());
                }
                if let Some(d) = mask_dims {
                    p = p.with_mask(View::contiguous(*d));
                }
                Ok(p)
            }
        }
    }

    fn run<T: CpuElement + WithDType>(
        &self,
        (q, k, v): (&[T], &[T], &[T]),
        l: [&Layout; 3],
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let mut p = self.problem(<T as attn_spec::Element>::DTYPE, l)?;
        let wanted = p.options.return_lse;
        p.options.return_lse |= self.keep_for_bwd;
        LAST_Q_PTR.with(|c| c.set(q.as_ptr() as usize));
        let n = p.out.extent().ok_or_else(|| {
            to_candle(AttnError::Overflow {
                what: "output extent",
            })
        })?;
        let mut out = vec![<T as attn_spec::Element>::from_f64(0.0); n];
        let mut lse = p
            .options
            .return_lse
            .then(|| vec![0.0f32; p.lse_view().extent().unwrap_or(0)]);
        Cpu::new()
            .forward_slices(
                &p,
                (q, k, v),
                (self.extras.0.as_ref(), self.extras.1.as_ref()),
                &mut out,
                lse.as_deref_mut(),
            )
            .map_err(to_candle)?;
        if let Some(l) = lse {
            if self.keep_for_bwd {
                *self.saved_lse.lock().map_err(|_| poisoned())? = Some(l.clone());
            }
            if wanted {
                self.set_lse(l)?;
            }
        }
        Ok((T::to_cpu_storage_owned(out), self.out_shape(&p, n)))
    }

    /// The shape of the output tensor: `[batch, q_len, q_heads,
    /// head_dim_v]`, or flat (`n` elements) for a given problem.
    pub(crate) fn out_shape(&self, p: &Problem, n: usize) -> Shape {
        match &self.problem {
            OpProblem::FromLayouts { .. } => Shape::from(p.out.dims.to_vec()),
            OpProblem::Given(_) => Shape::from(n),
        }
    }

    /// Keeps the log-sum-exp of this run for the caller.
    pub(crate) fn set_lse(&self, lse: Vec<f32>) -> candle_core::Result<()> {
        *self
            .lse
            .lock()
            .map_err(|_| candle_core::Error::Msg("attn: lse lock poisoned".into()))? = Some(lse);
        Ok(())
    }
}

impl CustomOp3 for AttnOp {
    fn name(&self) -> &'static str {
        "attn-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        use CpuStorage as S;
        let l = [l1, l2, l3];
        match (s1, s2, s3) {
            (S::F32(q), S::F32(k), S::F32(v)) => self.run((q, k, v), l),
            (S::F16(q), S::F16(k), S::F16(v)) => self.run((q, k, v), l),
            (S::BF16(q), S::BF16(k), S::BF16(v)) => self.run((q, k, v), l),
            _ => {
                use candle_core::backend::BackendStorage;
                candle_core::bail!(
                    "attn: q, k and v must share one of f32, f16, bf16; got {:?}, {:?}, {:?}",
                    s1.dtype(),
                    s2.dtype(),
                    s3.dtype()
                )
            }
        }
    }

    fn bwd(
        &self,
        q: &candle_core::Tensor,
        k: &candle_core::Tensor,
        v: &candle_core::Tensor,
        out: &candle_core::Tensor,
        d_out: &candle_core::Tensor,
    ) -> candle_core::Result<(
        Option<candle_core::Tensor>,
        Option<candle_core::Tensor>,
        Option<candle_core::Tensor>,
    )> {
        crate::grad::backward(self, [q, k, v], out, d_out)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::forward(self, [s1, s2, s3], [l1, l2, l3])
    }
}
