//! The CUDA backend: a context and stream on one GPU, a cache of loaded
//! kernels keyed on [`Variant`], device buffers, and the launches
//! (the backward pass's in `backward.rs`).

mod backward;
mod maps;

use crate::bytes::{bytes_of, host_of, i32_bytes};
use crate::cache::Cache;
use crate::compile::{self, Target};
use crate::libs;
use crate::plan::{
    forward_variant, linear_launch, supported, ForwardPlan, HalfKernel, Shapes, SmallTensors,
};
use crate::variant::Variant;
use attn_spec::{
    check_buffers, check_call, check_linear, AttnError, Backend, BufferInfo, Buffers, DType,
    Element, HostData, Inputs, Problem, Result,
};
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags, CUfunction_attribute, CUresult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError,
    LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// A buffer on the GPU: raw bytes plus the element type they hold.
#[derive(Debug)]
pub struct CudaBuffer {
    data: CudaSlice<u8>,
    dtype: DType,
    len: usize,
}

impl CudaBuffer {
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Device addresses of one call's tensors (0 where absent).
#[derive(Clone, Copy, Debug)]
struct Addrs {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    bias: u64,
    mask: u64,
}

/// attn on one NVIDIA GPU.
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: (u32, u32),
    sms: usize,
    smem_optin: usize,
    device_name: String,
    half_kernel: HalfKernel,
    /// Which block shapes the tensor-core kernels may take.
    shapes: Shapes,
    /// What NVRTC builds for this GPU.
    target: Target,
    /// NVRTC's version and the driver's CUDA version (`1000 * major + 10 *
    /// minor`), for the message when the driver refuses a module.
    versions: ((u32, u32), i32),
    functions: Cache<Variant, Loaded>,
}

/// A loaded kernel and how many of its blocks one multiprocessor holds at
/// once (the occupancy API, for its threads and shared memory), found
/// once when it is loaded.
#[derive(Clone)]
struct Loaded {
    f: CudaFunction,
    per_sm: usize,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda")
            .field("device", &self.device_name)
            .field("arch", &self.arch)
            .field("sms", &self.sms)
            .field("target", &self.target)
            .field("nvrtc", &self.versions.0)
            .field("driver_cuda", &self.versions.1)
            .finish()
    }
}

fn drv(e: DriverError) -> AttnError {
    AttnError::Backend {
        backend: "cuda".into(),
        message: format!("CUDA driver: {e:?}"),
    }
}

/// The error for a module the driver would not load: why, in terms a user
/// can act on, where the driver's code says it refused the code itself
/// (`None` for other failures, which [`drv`] reports as they are).
fn refused(
    code: CUresult,
    target: Target,
    (nvrtc, driver): ((u32, u32), i32),
) -> Option<AttnError> {
    let why = match code {
        CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => "its PTX is newer than this driver reads",
        CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU | CUresult::CUDA_ERROR_INVALID_IMAGE => {
            "it holds no code this GPU runs"
        }
        CUresult::CUDA_ERROR_INVALID_PTX | CUresult::CUDA_ERROR_JIT_COMPILER_NOT_FOUND => {
            "its PTX could not be compiled by the driver"
        }
        _ => return None,
    };
    Some(AttnError::Unsupported {
        backend: "cuda".into(),
        feature: format!(
            "loading a kernel ({target}, from NVRTC {}.{})",
            nvrtc.0, nvrtc.1
        ),
        reason: format!(
            "the driver (CUDA {}.{}) refused it: {why} ({code:?}); use an NVRTC no newer \
             than the driver's CUDA version (e.g. ATTN_CUDA_LIB_DIR pointing at an older \
             nvidia-cuda-nvrtc wheel) or update the driver",
            driver / 1000,
            driver % 1000 / 10
        ),
    })
}

/// Bytes of a device buffer of `len` elements of `dtype` (at least one:
/// the driver refuses empty allocations).
fn byte_len(dtype: DType, len: usize) -> Result<usize> {
    len.checked_mul(dtype.size_bytes())
        .map(|b| b.max(1))
        .ok_or(AttnError::Overflow {
            what: "buffer size",
        })
}

impl Cuda {
    /// The backend on GPU `ordinal`. Errors, never panics: `DriverMissing`
    /// without the driver or NVRTC, `NoDevice` without a GPU.
    pub fn new(ordinal: usize) -> Result<Self> {
        libs::driver()?;
        libs::nvrtc()?;
        let count = CudaContext::device_count().map_err(|e| AttnError::NoDevice {
            backend: "cuda".into(),
            reason: format!("the driver found no usable GPU ({e:?})"),
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(AttnError::NoDevice {
                backend: "cuda".into(),
                reason: format!("GPU {ordinal} asked for, {count} present"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        Cuda::from_stream(ctx.default_stream())
    }

    /// The backend launching on an existing stream (and its context), so
    /// its kernels are ordered with the other work queued there: how
    /// attn-candle runs on the stream of a candle CUDA device.
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Self> {
        libs::nvrtc()?;
        let ctx = stream.context().clone();
        let (major, minor) = ctx.compute_capability().map_err(drv)?;
        let attr = |a| ctx.attribute(a).map_err(drv);
        let sms = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let smem_optin =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
                as usize;
        let device_name = ctx.name().map_err(drv)?;
        let known = compile::known_archs()?;
        let nvrtc = compile::nvrtc_version()?;
        let target = Target::for_device((major as u32, minor as u32), &known).ok_or_else(|| {
            AttnError::Unsupported {
                backend: "cuda".into(),
                feature: format!("{device_name} (compute capability {major}.{minor})"),
                reason: format!(
                    "NVRTC {}.{} compiles for {known:?} only, all newer than this GPU",
                    nvrtc.0, nvrtc.1
                ),
            }
        })?;
        let mut driver = 0;
        // SAFETY: the driver is loaded (a context exists); writes one int.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
            .result()
            .map_err(drv)?;
        Ok(Cuda {
            ctx,
            stream,
            arch: (major as u32, minor as u32),
            sms,
            smem_optin,
            device_name,
            half_kernel: if major >= 8 {
                HalfKernel::TensorCore
            } else {
                HalfKernel::Simt
            },
            shapes: Shapes::default(),
            target,
            versions: (nvrtc, driver),
            functions: Cache::default(),
        })
    }

    /// The stream every launch goes on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The first GPU.
    pub fn first() -> Result<Self> {
        Cuda::new(0)
    }

    /// The same backend running `kernel` for f16/bf16 inputs (tensor cores
    /// need compute capability 8.0 or newer).
    pub fn with_half_kernel(mut self, kernel: HalfKernel) -> Result<Self> {
        if kernel != HalfKernel::Simt && self.arch.0 < 8 {
            return Err(AttnError::Unsupported {
                backend: self.name(),
                feature: "tensor-core kernel".into(),
                reason: format!("needs sm_80 or newer, this GPU is {:?}", self.arch),
            });
        }
        self.half_kernel = kernel;
        Ok(self)
    }

    /// The same backend with the tensor-core kernels' decode shape on (the
    /// default) or off: with it, a block that needs at most 16 query rows
    /// (query rows times the GQA group) splits each key tile between its
    /// warps (`Variant::key_split`); without it, it computes 64 rows as in
    /// prefill. Results agree within the conformance bound either way;
    /// `gpu_bench` times both.
    pub fn with_decode_key_split(mut self, on: bool) -> Self {
        self.shapes.key_split = on;
        self
    }

    /// The same backend with the fast tensor-core kernel's prefill shape on
    /// (the default) or off: with it, prefill of at least 128 query rows
    /// (without a mask tensor, sinks, soft-cap, ALiBi or bias; head dims up
    /// to 128) runs 128-row blocks whose warps each own two m-tiles
    /// (`Variant::wide`); without it, 64-row blocks. The default
    /// tensor-core kernel always takes 64 rows. Results agree within the
    /// conformance bound either way; `gpu_bench` times both.
    pub fn with_wide_blocks(mut self, on: bool) -> Self {
        self.shapes.wide = on;
        self
    }

    /// Compute capability, e.g. `(9, 0)`.
    pub fn arch(&self) -> (u32, u32) {
        self.arch
    }

    /// What NVRTC builds for this GPU: its own machine code, or PTX for
    /// an older architecture where NVRTC does not know this one.
    pub fn target(&self) -> Target {
        self.target
    }

    /// Multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.sms
    }

    /// The GPU's name.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Times `reps` runs of `f` on the GPU with CUDA events recorded on
    /// the backend's stream around each run; milliseconds per run.
    pub fn time_ms(&self, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(reps);
        for _ in 0..reps {
            // Timing events (`None` would create them with timing disabled).
            let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
            let start = self.stream.record_event(timed).map_err(drv)?;
            f()?;
            let end = self.stream.record_event(timed).map_err(drv)?;
            end.synchronize().map_err(drv)?;
            out.push(start.elapsed_ms(&end).map_err(drv)?);
        }
        Ok(out)
    }

    /// Blocks until every launch so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv)
    }

    /// The loaded kernel of `v`: compiled and loaded once, then cached.
    /// Only `v`'s own slot is locked while NVRTC compiles (see
    /// [`crate::cache`]).
    fn function(&self, v: &Variant) -> Result<CudaFunction> {
        self.loaded(v).map(|l| l.f)
    }

    /// [`Cuda::function`] with its blocks per multiprocessor.
    fn loaded(&self, v: &Variant) -> Result<Loaded> {
        let poisoned = |_| AttnError::Backend {
            backend: self.name(),
            message: "kernel cache lock poisoned (a compile panicked)".into(),
        };
        self.functions.get_or_build(v, || self.load(v), poisoned)
    }

    /// Compiles and loads `v`, raising its shared-memory limit if needed,
    /// and asks how many of its blocks a multiprocessor holds.
    fn load(&self, v: &Variant) -> Result<Loaded> {
        let image = compile::build(v, self.target)?;
        let module = self
            .ctx
            .load_module(image)
            .map_err(|e| refused(e.0, self.target, self.versions).unwrap_or_else(|| drv(e)))?;
        let f = module.load_function(v.kernel.function()).map_err(drv)?;
        let smem = v.smem_bytes();
        if smem > 48 * 1024 {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(drv)?;
        }
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(v.kernel.threads(), smem, None)
            .map_err(drv)?;
        Ok(Loaded {
            f,
            per_sm: (per_sm as usize).max(1),
        })
    }

    /// The tensor-core kernel for f16/bf16 when chosen and its shared
    /// memory fits this GPU (head dim 256 needs about 100 KB), else FMA
    /// (`plan::forward_variant`).
    fn forward_variant(&self, p: &Problem) -> Variant {
        forward_variant(self.half_kernel, self.shapes, p, self.arch, self.smem_optin)
    }

    fn alloc(&self, dtype: DType, len: usize) -> Result<CudaBuffer> {
        let bytes = byte_len(dtype, len)?;
        let data = self.stream.alloc_zeros::<u8>(bytes).map_err(drv)?;
        Ok(CudaBuffer { data, dtype, len })
    }

    /// [`Cuda::alloc`] without the zero fill (one memset launch fewer).
    ///
    /// # Safety
    /// The buffer's contents are whatever the allocator leaves: the caller
    /// must have every element it reads written first, on this stream.
    unsafe fn alloc_unset(&self, dtype: DType, len: usize) -> Result<CudaBuffer> {
        let bytes = byte_len(dtype, len)?;
        // SAFETY: the caller writes before reading (this function's
        // contract); u8 has no invalid bit patterns.
        let data = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(drv)?;
        Ok(CudaBuffer { data, dtype, len })
    }

    /// The call's small tensors in one buffer ([`SmallTensors`]), uploaded
    /// in one copy (none when there are none).
    fn upload_small(
        &self,
        o: &attn_spec::AttnOptions,
    ) -> Result<(SmallTensors, Option<CudaSlice<u8>>)> {
        let small = SmallTensors::of(o);
        let buf = match small.bytes.is_empty() {
            true => None,
            false => Some(self.stream.clone_htod(&small.bytes).map_err(drv)?),
        };
        Ok((small, buf))
    }

    fn upload_i32(&self, v: &[usize]) -> Result<CudaSlice<u8>> {
        self.stream.clone_htod(&i32_bytes(v)).map_err(drv)
    }

    /// The forward pass on typed device slices that belong to someone
    /// else (a candle tensor's storage, say), read and written in place:
    /// Q, K, V and the output hold `T` and are indexed by the problem's
    /// views; the optional bias, mask and log-sum-exp are this backend's
    /// buffers. The slices must live in this backend's context; the
    /// launches go on [`Cuda::stream`], ordered after the work the slices
    /// are waiting for. Lengths and element types are checked against the
    /// problem as [`Backend::forward_into`] checks its buffers.
    pub fn forward_slices<T: Element>(
        &self,
        problem: &Problem,
        (q, k, v): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
        (bias, mask): (Option<&CudaBuffer>, Option<&CudaBuffer>),
        out: &mut CudaSlice<T>,
        mut lse: Option<&mut CudaBuffer>,
    ) -> Result<()> {
        let typed = |len: usize| BufferInfo {
            dtype: T::DTYPE,
            len,
        };
        check_buffers(
            problem,
            &Buffers {
                q: typed(q.len()),
                k: typed(k.len()),
                v: typed(v.len()),
                bias: bias.map(|b| self.info(b)),
                mask: mask.map(|b| self.info(b)),
                out: Some(typed(out.len())),
                lse: lse.as_deref().map(|b| self.info(b)),
            },
        )?;
        let contexts = [("q", q.context()), ("k", k.context()), ("v", v.context())];
        for (name, c) in contexts.into_iter().chain([("out", out.context())]) {
            if **c != *self.ctx {
                return Err(AttnError::Backend {
                    backend: self.name(),
                    message: format!("{name} lives in another CUDA context than this backend's"),
                });
            }
        }
        let st = &self.stream;
        let (qa, _g1) = q.device_ptr(st);
        let (ka, _g2) = k.device_ptr(st);
        let (va, _g3) = v.device_ptr(st);
        let (oa, _g4) = out.device_ptr_mut(st);
        let lse_g = lse.as_mut().map(|l| l.data.device_ptr_mut(st));
        let bias_g = bias.map(|b| b.data.device_ptr(st));
        let mask_g = mask.map(|m| m.data.device_ptr(st));
        let addr = Addrs {
            q: qa,
            k: ka,
            v: va,
            o: oa,
            lse: lse_g.as_ref().map_or(0, |g| g.0),
            bias: bias_g.as_ref().map_or(0, |g| g.0),
            mask: mask_g.as_ref().map_or(0, |g| g.0),
        };
        // SAFETY: the slices' lengths and types were validated against the
        // problem's views above, they belong to this backend's context
        // (checked), and the guards keep them alive and ordered on this
        // stream until the launches are queued.
        unsafe { self.launch(problem, addr) }
    }

    /// Queues the forward kernels of `problem` on the stream.
    ///
    /// # Safety
    /// Every nonzero address in `addr` is that of a live device buffer of
    /// this backend's context, at least as large as the problem's view of
    /// it (validated by `Problem::validate_buffers`), that stays alive and
    /// untouched by other streams until the launches have run.
    unsafe fn launch(&self, problem: &Problem, addr: Addrs) -> Result<()> {
        self.supports(problem)?;
        let s = problem.shape;
        if s.batch * s.q_heads * s.q_len == 0 {
            return Ok(());
        }
        let o = &problem.options;
        let v = self.forward_variant(problem);
        let Loaded { f, per_sm } = self.loaded(&v)?;
        let plan = ForwardPlan::new(problem, v, self.sms * per_sm)?;
        let mut params = plan.params;

        // Small per-call tensors (lengths, slopes, sinks): one copy.
        let (small, small_buf) = self.upload_small(o)?;
        // The split workspaces are not zeroed: the forward launch writes
        // every split's partial output and log-sum-exp for every row below
        // q_len (its blocks have no early exit but rows past q_len), and
        // the combine launch after it on this stream reads only those.
        let mut part = match plan.partials(problem) {
            // SAFETY: written before read, as said above.
            Some((o_len, lse_len)) => unsafe {
                Some((
                    self.alloc_unset(DType::F32, o_len)?,
                    self.alloc_unset(DType::F32, lse_len)?,
                ))
            },
            None => None,
        };

        let st = &self.stream;
        params.q = addr.q;
        params.set_kv(addr.k, addr.v);
        params.o = addr.o;
        params.lse = addr.lse;
        params.bias = addr.bias;
        params.mask = addr.mask;
        let small_g = small_buf.as_ref().map(|b| b.device_ptr(st));
        small.set(&mut params, small_g.as_ref().map_or(0, |g| g.0));
        let part_g = part
            .as_mut()
            .map(|(po, pl)| (po.data.device_ptr_mut(st), pl.data.device_ptr_mut(st)));
        if let Some(((po, _), (pl, _))) = &part_g {
            params.part_o = *po;
            params.part_lse = *pl;
        }

        let ((grid, block), smem) = (plan.geometry, v.smem_bytes());
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: `params` holds the addresses of live device buffers whose
        // sizes the caller validated against the problem's views (this
        // function's contract); the kernel reads and writes only inside
        // those views (and the split workspaces, sized splits x rows above,
        // whose guards live to the end of this function).
        unsafe { st.launch_builder(&f).arg(&params).launch(cfg) }.map_err(drv)?;
        if let Some((cv, (grid, block))) = plan.combine {
            let f = self.function(&cv)?;
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: (block, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as above; the combine pass reads the partials the
            // forward launch wrote (same stream, so ordered after it).
            unsafe { st.launch_builder(&f).arg(&params).launch(cfg) }.map_err(drv)?;
        }
        Ok(())
    }
}

impl Backend for Cuda {
    type Buffer = CudaBuffer;

    fn name(&self) -> String {
        "attn-cuda".into()
    }

    fn upload(&self, data: &HostData) -> Result<CudaBuffer> {
        let mut b = bytes_of(data);
        let len = data.len();
        if b.is_empty() {
            b.push(0);
        }
        let slice = self.stream.clone_htod(&b).map_err(drv)?;
        Ok(CudaBuffer {
            data: slice,
            dtype: data.dtype(),
            len,
        })
    }

    fn download(&self, buf: &CudaBuffer) -> Result<HostData> {
        let b = self.stream.clone_dtoh(&buf.data).map_err(drv)?;
        let n = buf.len * buf.dtype.size_bytes();
        Ok(host_of(buf.dtype, &b[..n.min(b.len())]))
    }

    fn zeros(&self, dtype: DType, len: usize) -> Result<CudaBuffer> {
        self.alloc(dtype, len)
    }

    fn info(&self, buf: &CudaBuffer) -> BufferInfo {
        BufferInfo {
            dtype: buf.dtype,
            len: buf.len,
        }
    }

    fn supports(&self, p: &Problem) -> Result<()> {
        supported(&self.name(), p, &self.forward_variant(p), self.smem_optin)
    }

    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, CudaBuffer>,
        out: &mut CudaBuffer,
        mut lse: Option<&mut CudaBuffer>,
    ) -> Result<()> {
        check_call(self, problem, &inputs, out, lse.as_deref())?;
        let st = &self.stream;
        let (q, _g1) = inputs.q.data.device_ptr(st);
        let (k, _g2) = inputs.k.data.device_ptr(st);
        let (v, _g3) = inputs.v.data.device_ptr(st);
        let (o, _g4) = out.data.device_ptr_mut(st);
        let lse_g = lse.as_mut().map(|l| l.data.device_ptr_mut(st));
        let bias_g = inputs.bias.map(|b| b.data.device_ptr(st));
        let mask_g = inputs.mask.map(|m| m.data.device_ptr(st));
        let addrs = Addrs {
            q,
            k,
            v,
            o,
            lse: lse_g.as_ref().map_or(0, |g| g.0),
            bias: bias_g.as_ref().map_or(0, |g| g.0),
            mask: mask_g.as_ref().map_or(0, |g| g.0),
        };
        // SAFETY: every address belongs to a buffer of this backend's
        // context that `check_call` validated against the problem's views,
        // and the guards above keep them alive and ordered on this stream
        // until the launches are queued.
        unsafe { self.launch(problem, addrs) }?;
        // The context's pending asynchronous error, if any (not in
        // `forward_slices`: there the context is shared with its owner,
        // whose errors are not ours to report or clear).
        self.ctx.check_err().map_err(drv)
    }
}

impl attn_spec::Linear for Cuda {
    fn linear(
        &self,
        x: &CudaBuffer,
        rows: usize,
        w: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        in_features: usize,
        out_features: usize,
    ) -> Result<CudaBuffer> {
        check_linear(self, x, rows, w, bias, in_features, out_features)?;
        let dtype = x.dtype;
        let (mut params, (grid, block)) =
            linear_launch(&self.name(), dtype, rows, in_features, out_features)?;
        let mut y = self.alloc(dtype, rows * out_features)?;
        let v = Variant::linear(dtype, self.arch);
        let f = self.function(&v)?;
        let st = &self.stream;
        let (xp, _g1) = x.data.device_ptr(st);
        let (wp, _g2) = w.data.device_ptr(st);
        let bg = bias.map(|b| b.data.device_ptr(st));
        let (yp, _g4) = y.data.device_ptr_mut(st);
        params.x = xp;
        params.w = wp;
        params.b = bg.as_ref().map_or(0, |g| g.0);
        params.y = yp;
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: block,
            shared_mem_bytes: 0,
        };
        // SAFETY: x, w, b and y are live device buffers whose sizes
        // `check_linear` validated (rows x in, out x in, out) and `y` was
        // just allocated rows x out; the kernel stays inside them.
        unsafe { st.launch_builder(&f).arg(&params).launch(cfg) }.map_err(drv)?;
        drop((_g1, _g2, bg, _g4));
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A module the driver refuses for its code gives `Unsupported` naming
    /// the target, NVRTC's and the driver's versions; other failures are
    /// left to the generic driver error.
    #[test]
    fn a_refused_module_names_the_versions() {
        let e = refused(
            CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
            Target::Ptx(90),
            ((12, 8), 12040),
        )
        .expect("a refusal");
        let text = e.to_string();
        for part in [
            "PTX for compute_90",
            "NVRTC 12.8",
            "CUDA 12.4",
            "newer than this driver",
        ] {
            assert!(text.contains(part), "{part:?} missing from {text}");
        }
        assert!(matches!(e, AttnError::Unsupported { .. }));
        let e = refused(
            CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU,
            Target::Cubin(90),
            ((13, 0), 12080),
        )
        .expect("a refusal");
        assert!(e.to_string().contains("CUBIN for sm_90"), "{e}");
        assert!(e.to_string().contains("CUDA 12.8"), "{e}");
        let other = ((12, 8), 12080);
        assert!(refused(CUresult::CUDA_ERROR_OUT_OF_MEMORY, Target::Cubin(90), other).is_none());
    }
}
