//! The custom op on candle's CUDA device (feature `cuda`): attn-cuda's
//! kernels read Q, K and V in candle's device buffers where they are
//! (strides and offsets become attn views, as on the CPU) and write a new
//! candle buffer, all on the stream of the candle device, so the launches
//! are ordered with the candle work around them.
//!
//! One attn-cuda backend is kept per live candle device, so each kernel
//! variant is compiled by NVRTC once per device (a new candle device, even
//! on the same GPU, compiles its own). The small bias and
//! mask tensors the op holds on the host are uploaded per call; the
//! log-sum-exp, when asked for, is downloaded into the op (a candle op has
//! one result).

use crate::op::{to_candle, AttnOp};
use attn_cuda::Cuda;
use attn_spec::{AttnError, Backend, DType, Element, HostData};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice, DeviceId};
use candle_core::{CudaDevice, CudaStorage, Layout, Shape};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The attn-cuda backend of a candle device, created on first use. A
/// backend whose stream nobody else holds any more (its candle device is
/// gone) is dropped when another is created, so the cache stays as small
/// as the set of live devices.
fn backend(dev: &CudaDevice) -> candle_core::Result<Arc<Cuda>> {
    static BACKENDS: OnceLock<Mutex<HashMap<DeviceId, Arc<Cuda>>>> = OnceLock::new();
    let mut map = BACKENDS
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("attn: CUDA backend cache lock poisoned".into()))?;
    if let Some(b) = map.get(&dev.id()) {
        return Ok(b.clone());
    }
    map.retain(|_, b| Arc::strong_count(b.stream()) > 1);
    let b = Arc::new(Cuda::from_stream(dev.cuda_stream()).map_err(to_candle)?);
    map.insert(dev.id(), b.clone());
    Ok(b)
}

/// The op's forward on three CUDA storages of one element type.
pub(crate) fn forward(
    op: &AttnOp,
    s: [&CudaStorage; 3],
    l: [&Layout; 3],
) -> candle_core::Result<(CudaStorage, Shape)> {
    use CudaStorageSlice as S;
    let dev = &s[0].device;
    match (&s[0].slice, &s[1].slice, &s[2].slice) {
        (S::F32(q), S::F32(k), S::F32(v)) => run(op, dev, (q, k, v), l),
        (S::F16(q), S::F16(k), S::F16(v)) => run(op, dev, (q, k, v), l),
        (S::BF16(q), S::BF16(k), S::BF16(v)) => run(op, dev, (q, k, v), l),
        _ => {
            use candle_core::backend::BackendStorage;
            candle_core::bail!(
                "attn: q, k and v must share one of f32, f16, bf16; got {:?}, {:?}, {:?}",
                s[0].dtype(),
                s[1].dtype(),
                s[2].dtype()
            )
        }
    }
}

fn run<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
    op: &AttnOp,
    dev: &CudaDevice,
    qkv: (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    l: [&Layout; 3],
) -> candle_core::Result<(CudaStorage, Shape)> {
    let p = op.problem(T::DTYPE, l)?;
    let cuda = backend(dev)?;
    let n = p.out.extent().ok_or_else(|| {
        to_candle(AttnError::Overflow {
            what: "output extent",
        })
    })?;
    let mut out = dev.alloc_zeros::<T>(n.max(1))?;
    let upload = |h: &Option<HostData>| h.as_ref().map(|h| cuda.upload(h)).transpose();
    let bias = upload(&op.extras.0).map_err(to_candle)?;
    let mask = upload(&op.extras.1).map_err(to_candle)?;
    let mut lse = p
        .options
        .return_lse
        .then(|| cuda.zeros(DType::F32, p.lse_view().extent().unwrap_or(0)))
        .transpose()
        .map_err(to_candle)?;
    cuda.forward_slices(
        &p,
        qkv,
        (bias.as_ref(), mask.as_ref()),
        &mut out,
        lse.as_mut(),
    )
    .map_err(to_candle)?;
    if let Some(l) = lse {
        match cuda.download(&l).map_err(to_candle)? {
            HostData::F32(v) => op.set_lse(v)?,
            other => candle_core::bail!("attn: log-sum-exp came back as {}", other.dtype()),
        }
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        op.out_shape(&p, n),
    ))
}
