//! attn-cuda's kernels on the CPU, for testing without a GPU.
//!
//! [`Emulator`] is a [`Backend`] that runs the very CUDA C source NVRTC
//! compiles, built instead by the host's C++ compiler (`$CXX`, else
//! `c++`) with `kernels/emu.h` in front: each GPU thread a fiber, each
//! warp collective (`mma.sync`, `ldmatrix`, shuffles) and `cp.async`
//! emulated as the PTX ISA defines it, one block at a time (the header
//! says what it checks). The host side is the GPU backend's own: the
//! kernel choice, the support checks, the split plan, the parameter block
//! and the launch geometry come from [`crate::plan`], for an H100-like GPU
//! (sm_90, [`SMS`] multiprocessors, [`SMEM_OPTIN`] bytes of shared memory
//! per block). So the conformance suite checks the kernels' indexing,
//! fragment layouts, masking, pipeline waits and split-KV merge on any
//! x86-64 machine; what it cannot see is the hardware: timing, races the
//! fiber order happens not to expose, register spills, and the tensor
//! cores' own accumulation order.
//!
//! Every buffer a kernel sees is a copy with poisoned padding on both
//! sides (0xff bytes, NaN in every float type); a launch that wrote into
//! the padding is an error naming the buffer, and a read of it brings NaN
//! into the results. Slow (a few milliseconds per block): for small cases.
//! Each variant is compiled once per machine, cached under the system's
//! temporary directory (`attn-emu/`), where entries unused for a week are
//! removed whenever a variant is built.

mod calls;
mod device;

use crate::cache::Cache;
use crate::plan::{Geometry3, HalfKernel, Shapes};
use crate::variant::Variant;
use attn_spec::{AttnError, Backend, Result};
use device::{build, Dev, Launch, Run, Shared, LOCK, MAX_THREADS, STACK};
use std::sync::Arc;

/// The emulated GPU's architecture (Hopper).
pub const ARCH: (u32, u32) = (9, 0);
/// Its multiprocessors (an H100 SXM's).
pub const SMS: usize = 132;
/// Shared memory a block may opt into on sm_90, in bytes.
pub const SMEM_OPTIN: usize = 232_448;

/// attn-cuda's kernels run on the CPU (module docs).
pub struct Emulator {
    half_kernel: HalfKernel,
    /// Which block shapes the tensor-core kernels may take.
    shapes: Shapes,
}

/// The compiled variants, loaded once per process for every emulator.
fn libraries() -> &'static Cache<Variant, Arc<libloading::Library>> {
    static LIBS: std::sync::OnceLock<Cache<Variant, Arc<libloading::Library>>> =
        std::sync::OnceLock::new();
    LIBS.get_or_init(Cache::default)
}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Emulator")
            .field("half_kernel", &self.half_kernel)
            .field("shapes", &self.shapes)
            .field("arch", &ARCH)
            .finish()
    }
}

impl Default for Emulator {
    fn default() -> Self {
        Emulator::new()
    }
}

impl Emulator {
    /// The emulator with the tensor-core kernel for f16/bf16, as
    /// [`crate::Cuda`] chooses on sm_80 and later.
    pub fn new() -> Self {
        Emulator {
            half_kernel: HalfKernel::TensorCore,
            shapes: Shapes::default(),
        }
    }

    /// The emulator running `kernel` on f16/bf16 inputs.
    pub fn with_half_kernel(mut self, kernel: HalfKernel) -> Self {
        self.half_kernel = kernel;
        self
    }

    /// The emulator with the decode key split on (the default) or off, as
    /// [`crate::Cuda::with_decode_key_split`].
    pub fn with_decode_key_split(mut self, on: bool) -> Self {
        self.shapes.key_split = on;
        self
    }

    /// The emulator with the fast kernel's wide prefill blocks on (the
    /// default) or off, as [`crate::Cuda::with_wide_blocks`].
    pub fn with_wide_blocks(mut self, on: bool) -> Self {
        self.shapes.wide = on;
        self
    }

    fn err(&self, message: String) -> AttnError {
        AttnError::Backend {
            backend: self.name(),
            message,
        }
    }

    /// The compiled variant, built on first use.
    fn library(&self, v: &Variant) -> Result<Arc<libloading::Library>> {
        libraries().get_or_build(
            v,
            || {
                // A library that another process's pruning removed
                // between the lookup and the load is built again, once.
                let mut tries = 0;
                loop {
                    let path = build(v).map_err(|e| self.err(e))?;
                    // SAFETY: the library is our own compiled kernel
                    // source, whose initialisers only zero its globals.
                    match unsafe { libloading::Library::new(&path) } {
                        Ok(lib) => return Ok(Arc::new(lib)),
                        Err(_) if tries == 0 && !path.exists() => tries += 1,
                        Err(e) => return Err(self.err(format!("loading {}: {e}", path.display()))),
                    }
                }
            },
            |_| self.err("the kernel cache's lock is poisoned".into()),
        )
    }

    /// Runs `v`'s kernel on `geometry` with the parameter block `params`.
    fn launch<P>(&self, v: &Variant, geometry: Geometry3, params: &P) -> Result<()> {
        let lib = self.library(v)?;
        let name = format!("emu_run_{}", v.kernel.function());
        // SAFETY: every emulated library exports `emu_run_<kernel>` with
        // this signature (`EMU_KERNEL` in emu.h, appended by `build`).
        let run = unsafe { lib.get::<Run>(name.as_bytes()) }
            .map_err(|e| self.err(format!("{name}: {e}")))?;
        let mut msg = vec![0u8; 1024];
        let ((gx, gy, gz), (bx, by, bz)) = geometry;
        let mut one = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        if one.is_none() {
            *one = Some(Shared::map().map_err(|e| self.err(e))?);
        }
        let (stacks, smem_arena) = match one.as_mut() {
            Some(s) => (s.0, s.1.as_mut_ptr().cast::<u8>()),
            None => (std::ptr::null_mut(), std::ptr::null_mut()),
        };
        let l = Launch {
            grid: [gx, gy, gz],
            block: [bx, by, bz],
            smem: v.smem_bytes() as u64,
            params: (params as *const P).cast(),
            err: msg.as_mut_ptr(),
            err_len: msg.len() as u64,
            stacks,
            stack_size: STACK as u64,
            stack_count: MAX_THREADS as u64,
            smem_arena,
        };
        // SAFETY: `params` is the kernel's parameter block (`P` is the
        // `repr(C)` mirror of its C struct) holding addresses of live host
        // buffers at least as large as the views the kernel indexes
        // (validated by the caller); `msg` is writable for err_len bytes;
        // the stacks are mapped and ours while `one` holds the lock.
        let rc = unsafe { run(&l) };
        if rc == 0 {
            return Ok(());
        }
        let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
        Err(self.err(format!(
            "{}: {}",
            v.describe(),
            String::from_utf8_lossy(&msg[..end])
        )))
    }
}

impl Emulator {
    /// An error naming the first of `devs` whose padding a launch of
    /// `v` (or one before it in the same call) wrote.
    fn no_overrun<'a>(&self, v: &Variant, devs: impl Iterator<Item = &'a Dev>) -> Result<()> {
        for d in devs {
            if let Some(name) = d.overrun() {
                return Err(self.err(format!(
                    "{}: the kernels wrote outside `{name}`",
                    v.describe()
                )));
            }
        }
        Ok(())
    }
}

/// Blocks of `v` one sm_90 multiprocessor holds, by threads (2048),
/// shared memory (228 KiB, 1 KiB reserved per block) and, for the wide
/// shape only, registers: what the occupancy API answers (elsewhere the
/// registers do not bind).
fn blocks_per_sm(v: &Variant) -> usize {
    let by_threads = 2048 / v.kernel.threads() as usize;
    let by_smem = (228 * 1024) / (v.smem_bytes() + 1024);
    // The wide shape takes up to 255 registers a thread (ptxas, `cargo
    // xtask cuda-check`): two blocks of 128 threads fill an SM's 64k.
    let by_regs = if v.wide { 2 } else { 32 };
    by_threads.min(by_smem).min(by_regs).clamp(1, 32)
}
