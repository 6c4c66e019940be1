//! candle as an attn backend: buffers are flat candle tensors on one
//! device, and two engines compute: the fused custom op and the plain
//! composition of candle operations.

use crate::op::{host_data, AttnOp, OpProblem};
use crate::plain;
use attn_spec::{
    check_call, check_linear, AttnError, Backend, BufferInfo, DType, HostData, Inputs, Problem,
    Result, View,
};
use candle_core::{DType as CDType, Device, Tensor};
use std::sync::Mutex;

/// Which computation a [`CandleBackend`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CandleEngine {
    /// attn's fused kernel as a candle custom op.
    Fused,
    /// The plain composition: matmul, scale, mask, softmax, matmul.
    Plain,
}

/// An attn backend over candle tensors on `device`.
#[derive(Clone, Debug)]
pub struct CandleBackend {
    /// The engine.
    pub engine: CandleEngine,
    /// The device tensors live on.
    pub device: Device,
}

impl CandleBackend {
    /// The fused engine on candle's CPU device.
    pub fn fused_cpu() -> Self {
        CandleBackend {
            engine: CandleEngine::Fused,
            device: Device::Cpu,
        }
    }

    /// The plain-composition engine on candle's CPU device.
    pub fn plain_cpu() -> Self {
        CandleBackend {
            engine: CandleEngine::Plain,
            device: Device::Cpu,
        }
    }

    /// An engine on candle's CUDA device `ordinal` (feature `cuda`); a
    /// missing GPU or driver is `NoDevice`.
    #[cfg(feature = "cuda")]
    pub fn cuda(engine: CandleEngine, ordinal: usize) -> Result<Self> {
        let device = Device::new_cuda(ordinal).map_err(|e| AttnError::NoDevice {
            backend: "candle-cuda".into(),
            reason: e.to_string(),
        })?;
        Ok(CandleBackend { engine, device })
    }

    pub(crate) fn err(&self, e: candle_core::Error) -> AttnError {
        AttnError::Backend {
            backend: self.name(),
            message: e.to_string(),
        }
    }
}

/// attn's element type of a candle dtype (u8 tensors hold boolean masks).
pub fn attn_dtype(d: CDType) -> Option<DType> {
    Some(match d {
        CDType::F32 => DType::F32,
        CDType::F16 => DType::F16,
        CDType::BF16 => DType::Bf16,
        CDType::F64 => DType::F64,
        CDType::U8 => DType::Bool,
        _ => return None,
    })
}

/// candle's dtype for an attn element type.
pub fn candle_dtype(d: DType) -> CDType {
    match d {
        DType::F32 => CDType::F32,
        DType::F16 => CDType::F16,
        DType::Bf16 => CDType::BF16,
        DType::F64 => CDType::F64,
        DType::Bool => CDType::U8,
    }
}

impl Backend for CandleBackend {
    type Buffer = Tensor;

    fn name(&self) -> String {
        match self.engine {
            CandleEngine::Fused => "candle-fused".into(),
            CandleEngine::Plain => "candle-plain".into(),
        }
    }

    fn upload(&self, data: &HostData) -> Result<Tensor> {
        let d = &self.device;
        let t = match data {
            HostData::F32(v) => Tensor::from_vec(v.clone(), v.len(), d),
            HostData::F16(v) => Tensor::from_vec(v.clone(), v.len(), d),
            HostData::Bf16(v) => Tensor::from_vec(v.clone(), v.len(), d),
            HostData::F64(v) => Tensor::from_vec(v.clone(), v.len(), d),
            HostData::Bool(v) => Tensor::from_vec(
                v.iter().map(|&b| u8::from(b)).collect::<Vec<u8>>(),
                v.len(),
                d,
            ),
        };
        t.map_err(|e| self.err(e))
    }

    fn download(&self, t: &Tensor) -> Result<HostData> {
        host_data(t).map_err(|e| match attn_dtype(t.dtype()) {
            None => AttnError::Unsupported {
                backend: self.name(),
                feature: format!("{:?} tensors", t.dtype()),
                reason: "attn computes on f32, f16, bf16 (f64 for the oracle) and bool masks"
                    .into(),
            },
            Some(_) => self.err(e),
        })
    }

    fn zeros(&self, dtype: DType, len: usize) -> Result<Tensor> {
        Tensor::zeros(len, candle_dtype(dtype), &self.device).map_err(|e| self.err(e))
    }

    fn info(&self, t: &Tensor) -> BufferInfo {
        BufferInfo {
            // Unknown candle dtypes report as bool so validation names them.
            dtype: attn_dtype(t.dtype()).unwrap_or(DType::Bool),
            len: t.elem_count(),
        }
    }

    fn supports(&self, p: &Problem) -> Result<()> {
        if !matches!(p.dtype, DType::F32 | DType::F16 | DType::Bf16) {
            return Err(AttnError::Unsupported {
                backend: self.name(),
                feature: format!("{} inputs", p.dtype),
                reason: "candle engines compute on f32, f16 and bf16".into(),
            });
        }
        if !(self.device.is_cpu() || self.device.is_cuda()) {
            return Err(AttnError::Unsupported {
                backend: self.name(),
                feature: "candle devices other than CPU and CUDA".into(),
                reason: "the op runs attn-cpu on CPU storage and attn-cuda on CUDA storage".into(),
            });
        }
        match self.engine {
            CandleEngine::Fused => Ok(()),
            CandleEngine::Plain => plain::supports(p).map_err(|reason| AttnError::Unsupported {
                backend: self.name(),
                feature: "this problem".into(),
                reason,
            }),
        }
    }

    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Tensor>,
        out: &mut Tensor,
        lse: Option<&mut Tensor>,
    ) -> Result<()> {
        check_call(self, problem, &inputs, out, lse.as_deref())?;
        let (o, l) = match self.engine {
            CandleEngine::Fused => {
                let extras = (
                    inputs.bias.map(|b| self.download(b)).transpose()?,
                    inputs.mask.map(|m| self.download(m)).transpose()?,
                );
                let op = AttnOp {
                    problem: OpProblem::Given(Box::new(problem.clone())),
                    extras,
                    lse: Mutex::new(None),
                    keep_for_bwd: false,
                    saved_lse: Mutex::new(None),
                    stash: Mutex::default(),
                };
                let o = inputs
                    .q
                    .apply_op3_no_bwd(inputs.k, inputs.v, &op)
                    .map_err(|e| self.err(e))?;
                let l = op.lse.lock().ok().and_then(|mut g| g.take());
                let l = l
                    .map(|l| Tensor::from_vec(l.clone(), l.len(), &self.device))
                    .transpose()
                    .map_err(|e| self.err(e))?;
                (o, l)
            }
            CandleEngine::Plain => {
                plain::forward(problem, inputs, &self.device).map_err(|e| self.err(e))?
            }
        };
        *out = place_view(out, o, &problem.out).map_err(|e| self.err(e))?;
        if let (Some(dst), Some(l)) = (lse, l) {
            *dst = place(dst, l).map_err(|e| self.err(e))?;
        }
        Ok(())
    }
}

impl attn_spec::Linear for CandleBackend {
    fn linear(
        &self,
        x: &Tensor,
        rows: usize,
        w: &Tensor,
        bias: Option<&Tensor>,
        in_features: usize,
        out_features: usize,
    ) -> Result<Tensor> {
        check_linear(self, x, rows, w, bias, in_features, out_features)?;
        let run = || -> candle_core::Result<Tensor> {
            let x2 = x.reshape((rows, in_features))?;
            let w2 = w.reshape((out_features, in_features))?;
            let mut y = x2.matmul(&w2.t()?)?;
            if let Some(b) = bias {
                y = y.broadcast_add(&b.reshape((1, out_features))?)?;
            }
            y.flatten_all()
        };
        run().map_err(|e| self.err(e))
    }
}

/// `src`, the engines' output laid out by `view` over the view's extent,
/// written into `dst` at the view's elements only: the gaps of a strided
/// view keep `dst`'s values, as the `Backend` contract promises.
fn place_view(dst: &Tensor, src: Tensor, view: &View) -> candle_core::Result<Tensor> {
    let n = src.elem_count();
    let mut covered = vec![0u8; n];
    let [d0, d1, d2, d3] = view.dims;
    for a in 0..d0 {
        for b in 0..d1 {
            for c in 0..d2 {
                for d in 0..d3 {
                    covered[view.index([a, b, c, d])] = 1;
                }
            }
        }
    }
    if covered.iter().all(|&c| c == 1) {
        return place(dst, src);
    }
    let keep = Tensor::from_vec(covered, n, dst.device())?;
    let merged = keep.where_cond(&src, &dst.narrow(0, 0, n)?)?;
    place(dst, merged)
}

/// `src` written over the first elements of `dst` (the rest of `dst`
/// unchanged), as a new flat tensor.
fn place(dst: &Tensor, src: Tensor) -> candle_core::Result<Tensor> {
    let n = src.elem_count();
    if n == dst.elem_count() {
        Ok(src)
    } else {
        #[allow(clippy::single_range_in_vec_init)] // one range per axis; the buffer is 1-D
        let ranges = [0..n];
        dst.slice_assign(&ranges, &src)
    }
}
