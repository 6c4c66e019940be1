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
//! temporary directory.

use crate::cache::Cache;
use crate::params::{BwdParams, Params};
use crate::plan::{
    backward_launches, dbias_strides, forward_kernel, linear_launch, maps_launch, supported,
    supported_backward, ForwardPlan, Geometry3, HalfKernel,
};
use crate::variant::{Kernel, Variant};
use attn_spec::{
    check_backward_call, check_call, check_maps_call, AttentionMaps, AttnError, AttnOptions,
    Backend, Backward, GradInputs, GradOutputs, HostData, Inputs, MapLayout, Problem, Result,
};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The emulated GPU's architecture (Hopper).
pub const ARCH: (u32, u32) = (9, 0);
/// Its multiprocessors (an H100 SXM's).
pub const SMS: usize = 132;
/// Shared memory a block may opt into on sm_90, in bytes.
pub const SMEM_OPTIN: usize = 232_448;

const HEADER: &str = include_str!("kernels/emu.h");
/// Poison bytes on each side of a buffer (and the alignment of its data,
/// as device allocations have).
const PAD: usize = 256;

/// attn-cuda's kernels run on the CPU (module docs).
pub struct Emulator {
    half_kernel: HalfKernel,
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
            .field("arch", &ARCH)
            .finish()
    }
}

/// One emulated launch (`struct emu::Launch` in `kernels/emu.h`).
#[repr(C)]
struct Launch {
    grid: [u32; 3],
    block: [u32; 3],
    smem: u64,
    params: *const u8,
    err: *mut u8,
    err_len: u64,
    stacks: *mut u8,
    stack_size: u64,
    stack_count: u64,
    smem_arena: *mut u8,
}

/// What every compiled variant shares: the fibers' stacks, [`MAX_THREADS`]
/// of [`STACK`] bytes, each with a guard page at its low end (an overflow
/// faults instead of overwriting another fiber's frames), mapped once and
/// never unmapped (pages are committed only where touched); and the
/// shared-memory arena of [`SMEM_CAP`] bytes.
struct Shared(*mut u8, Vec<u128>);

// SAFETY: the mapping is only used under `LOCK`, one launch at a time.
unsafe impl Send for Shared {}

/// The shared-memory arena's bytes (`SMEM_CAP` in emu.h).
const SMEM_CAP: usize = SMEM_OPTIN;
/// Bytes of one fiber stack, its guard page included.
const STACK: usize = 256 * 1024;
/// Most threads of a block (CUDA's limit).
const MAX_THREADS: usize = 1024;
const GUARD: usize = 4096;

impl Shared {
    #[cfg(unix)]
    fn map() -> std::result::Result<Shared, String> {
        let len = STACK * MAX_THREADS;
        // SAFETY: a fresh private anonymous mapping, then guard pages
        // inside it; no existing memory is touched.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err("no address space for the emulator's fiber stacks".into());
            }
            let base = base.cast::<u8>();
            for i in 0..MAX_THREADS {
                if libc::mprotect(base.add(i * STACK).cast(), GUARD, libc::PROT_NONE) != 0 {
                    return Err("mprotect failed on a fiber stack's guard page".into());
                }
            }
            Ok(Shared(base, vec![0u128; SMEM_CAP / 16]))
        }
    }

    #[cfg(not(unix))]
    fn map() -> std::result::Result<Shared, String> {
        Err("the kernel emulator runs on x86-64 Linux".into())
    }
}

/// A one-dimensional block of `threads`.
fn flat((grid, threads): ((u32, u32, u32), u32)) -> Geometry3 {
    (grid, (threads, 1, 1))
}

/// The emulated launch entry point of one kernel.
type Run = unsafe extern "C" fn(*const Launch) -> i32;

/// One launch at a time (each compiled variant keeps its GPU state in
/// globals), and the fiber stacks they share.
static LOCK: Mutex<Option<Shared>> = Mutex::new(None);

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
        }
    }

    /// The emulator running `kernel` on f16/bf16 inputs.
    pub fn with_half_kernel(mut self, kernel: HalfKernel) -> Self {
        self.half_kernel = kernel;
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
                let path = build(v).map_err(|e| self.err(e))?;
                // SAFETY: the library is our own compiled kernel source,
                // whose initialisers only zero its globals.
                let lib = unsafe { libloading::Library::new(&path) }
                    .map_err(|e| self.err(format!("loading {}: {e}", path.display())))?;
                Ok(Arc::new(lib))
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

/// Compiles `v` for the emulator (or finds it compiled); returns the
/// shared library's path.
fn build(v: &Variant) -> std::result::Result<PathBuf, String> {
    let params = match v.kernel {
        Kernel::BwdDq | Kernel::BwdDkdv | Kernel::BwdSinks => "BwdParams",
        Kernel::Maps => "MapsParams",
        Kernel::Linear => "LinParams",
        _ => "Params",
    };
    let source = format!(
        "#define ATTN_EMU 1\n{HEADER}\n{}\nEMU_KERNEL({}, {params})\n",
        v.source(),
        v.kernel.function()
    );
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let flags = [
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        // The kernels read 16-bit arrays 32 bits at a time, as CUDA allows.
        "-fno-strict-aliasing",
        // An index past a fixed-size array (the registers' `o[][]`, a
        // static `__shared__` array) or a signed overflow stops the
        // process with the source line.
        "-fsanitize=bounds,signed-integer-overflow",
        "-fno-sanitize-recover=all",
        "-Wno-unknown-pragmas",
    ];
    let dir = std::env::temp_dir().join("attn-emu");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let key = fnv1a(format!("{cxx} {flags:?}\n{source}").as_bytes());
    let path = dir.join(format!("{key:016x}.so"));
    if path.exists() {
        return Ok(path);
    }
    // The source stays beside the library: a sanitizer's report names
    // its lines.
    let src = dir.join(format!("{key:016x}.cc"));
    static BUILDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let pid = std::process::id();
    let (src_tmp, tmp) = (
        dir.join(format!("{key:016x}.{pid}.{n}.cc.tmp")),
        dir.join(format!("{key:016x}.{pid}.{n}.so")),
    );
    std::fs::write(&src_tmp, &source).map_err(|e| format!("{}: {e}", src_tmp.display()))?;
    std::fs::rename(&src_tmp, &src).map_err(|e| format!("{}: {e}", src.display()))?;
    let out = std::process::Command::new(&cxx)
        .args(flags)
        .arg(&src)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("running the C++ compiler `{cxx}` (set CXX): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cxx} failed on {}:\n{}",
            v.describe(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    // Another process may have won the race: either copy will do.
    std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// FNV-1a, 64 bits: a stable name for a compiled source.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A kernel's view of a buffer: its bytes between two runs of poison.
struct Dev {
    name: &'static str,
    mem: Vec<u8>,
    start: usize,
    len: usize,
}

impl Dev {
    /// `bytes` copied in, 256-byte aligned, poison around them (at least
    /// one byte of data, as device allocations).
    fn new(name: &'static str, bytes: &[u8]) -> Dev {
        let len = bytes.len().max(1);
        let mut mem = vec![0xffu8; len + 3 * PAD];
        let start = PAD + (PAD - mem.as_ptr() as usize % PAD) % PAD;
        mem[start..start + bytes.len()].copy_from_slice(bytes);
        Dev {
            name,
            mem,
            start,
            len,
        }
    }

    /// `len` bytes of poison: what a kernel must write before it reads.
    fn unset(name: &'static str, len: usize) -> Dev {
        let mut d = Dev::new(name, &[]);
        d.mem = vec![0xffu8; len.max(1) + 3 * PAD];
        d.start = PAD + (PAD - d.mem.as_ptr() as usize % PAD) % PAD;
        d.len = len.max(1);
        d
    }

    fn addr(&mut self) -> u64 {
        self.mem[self.start..].as_mut_ptr() as u64
    }

    fn bytes(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.len]
    }

    /// The name of the buffer if a kernel wrote into its padding.
    fn overrun(&self) -> Option<&'static str> {
        let (lo, hi) = (&self.mem[..self.start], &self.mem[self.start + self.len..]);
        (lo.iter().chain(hi).any(|&b| b != 0xff)).then_some(self.name)
    }
}

fn bytes_of(data: &HostData) -> Vec<u8> {
    match data {
        HostData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostData::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        HostData::Bf16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        HostData::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostData::Bool(v) => v.iter().map(|&b| u8::from(b)).collect(),
    }
}

/// `out`'s elements from `b` (the bytes of `out`'s type).
fn store(out: &mut HostData, b: &[u8]) {
    match out {
        HostData::F32(v) => {
            for (x, c) in v.iter_mut().zip(b.chunks_exact(4)) {
                *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        HostData::F16(v) => {
            for (x, c) in v.iter_mut().zip(b.chunks_exact(2)) {
                *x = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        HostData::Bf16(v) => {
            for (x, c) in v.iter_mut().zip(b.chunks_exact(2)) {
                *x = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        HostData::F64(v) => {
            for (x, c) in v.iter_mut().zip(b.chunks_exact(8)) {
                *x = f64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        }
        HostData::Bool(v) => {
            for (x, &c) in v.iter_mut().zip(b) {
                *x = c != 0;
            }
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i32_bytes(v: &[usize]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| (x.min(i32::MAX as usize) as i32).to_le_bytes())
        .collect()
}

impl Backend for Emulator {
    attn_spec::host_buffers!();

    fn name(&self) -> String {
        "attn-cuda-emu".into()
    }

    fn supports(&self, p: &Problem) -> Result<()> {
        let kernel = forward_kernel(self.half_kernel, p, ARCH, SMEM_OPTIN);
        supported(&self.name(), p, kernel, ARCH, SMEM_OPTIN)
    }

    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        out: &mut HostData,
        lse: Option<&mut HostData>,
    ) -> Result<()> {
        check_call(self, problem, &inputs, out, lse.as_deref())?;
        let s = problem.shape;
        if s.batch * s.q_heads * s.q_len == 0 {
            return Ok(());
        }
        let o = &problem.options;
        let kernel = forward_kernel(self.half_kernel, problem, ARCH, SMEM_OPTIN);
        let v = Variant::for_problem(kernel, problem, ARCH);
        let plan = ForwardPlan::new(problem, v, SMS * blocks_per_sm(&v))?;
        let opt = |name, data: Option<Vec<u8>>| data.map(|b| Dev::new(name, &b));
        let mut q = Dev::new("q", &bytes_of(inputs.q));
        let mut k = Dev::new("k", &bytes_of(inputs.k));
        let mut vv = Dev::new("v", &bytes_of(inputs.v));
        let mut o_dev = Dev::new("out", &bytes_of(out));
        let mut lse_dev = opt("lse", lse.as_deref().map(bytes_of));
        let mut bias = opt("bias", inputs.bias.map(bytes_of));
        let mut mask = opt("mask", inputs.mask.map(bytes_of));
        let mut small = Small::new(o);
        let mut part = plan
            .partials(problem)
            .map(|(po, pl)| (Dev::unset("part_o", 4 * po), Dev::unset("part_lse", 4 * pl)));
        let addr = |d: &mut Option<Dev>| d.as_mut().map_or(0, Dev::addr);
        let mut params: Params = plan.params;
        params.q = q.addr();
        params.set_kv(k.addr(), vv.addr());
        params.o = o_dev.addr();
        params.lse = addr(&mut lse_dev);
        params.bias = addr(&mut bias);
        params.mask = addr(&mut mask);
        small.set(&mut params);
        if let Some((po, pl)) = part.as_mut() {
            params.part_o = po.addr();
            params.part_lse = pl.addr();
        }
        self.launch(&v, flat(plan.geometry), &params)?;
        if let Some((cv, geometry)) = plan.combine {
            self.launch(&cv, flat(geometry), &params)?;
        }
        let all = [Some(&q), Some(&k), Some(&vv), Some(&o_dev)]
            .into_iter()
            .chain([&lse_dev, &bias, &mask].map(Option::as_ref))
            .chain(part.iter().flat_map(|(a, b)| [Some(a), Some(b)]))
            .flatten()
            .chain(small.all());
        self.no_overrun(&v, all)?;
        store(out, o_dev.bytes());
        if let (Some(l), Some(d)) = (lse, lse_dev.as_ref()) {
            store(l, d.bytes());
        }
        Ok(())
    }
}

impl Backward for Emulator {
    fn backward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        forward: GradInputs<'_, HostData>,
        grads: GradOutputs<'_, HostData>,
    ) -> Result<()> {
        check_backward_call(self, problem, &inputs, &forward, &grads)?;
        let bias_grad = grads.dbias.is_some();
        supported_backward(&self.name(), problem, bias_grad, ARCH, SMEM_OPTIN)?;
        let p = problem;
        let s = p.shape;
        let mut params = Params::new(p, 1, s.kv_len.max(1))?;
        let mut small = Small::new(&p.options);
        let lse = forward.lse.expect("checked by check_backward_call");
        let opt = |name, data: Option<&HostData>| data.map(|b| Dev::new(name, &bytes_of(b)));
        let mut q = Dev::new("q", &bytes_of(inputs.q));
        let mut k = Dev::new("k", &bytes_of(inputs.k));
        let mut vv = Dev::new("v", &bytes_of(inputs.v));
        let mut o = Dev::new("out", &bytes_of(forward.out));
        let mut lse = Dev::new("lse", &bytes_of(lse));
        let mut d_out = Dev::new("d_out", &bytes_of(forward.d_out));
        let mut bias = opt("bias", inputs.bias);
        let mut mask = opt("mask", inputs.mask);
        let mut d_rows = Dev::new("d_rows", &vec![0u8; 4 * s.batch * s.q_heads * s.q_len]);
        let mut dq = Dev::new("dq", &bytes_of(grads.dq));
        let mut dk = Dev::new("dk", &bytes_of(grads.dk));
        let mut dv = Dev::new("dv", &bytes_of(grads.dv));
        // The GPU backend zeroes the bias gradient before the launches.
        let mut dbias = grads
            .dbias
            .as_deref()
            .map(|b| Dev::new("dbias", &vec![0u8; bytes_of(b).len()]));
        let mut dsinks = opt("dsinks", grads.dsinks.as_deref());
        let addr = |d: &mut Option<Dev>| d.as_mut().map_or(0, Dev::addr);
        params.q = q.addr();
        params.set_kv(k.addr(), vv.addr());
        params.o = o.addr();
        params.lse = lse.addr();
        params.bias = addr(&mut bias);
        params.mask = addr(&mut mask);
        small.set(&mut params);
        let bp = BwdParams {
            p: params,
            d_out: d_out.addr(),
            dq: dq.addr(),
            dk: dk.addr(),
            dv: dv.addr(),
            d_rows: d_rows.addr(),
            dbias: addr(&mut dbias),
            dsinks: addr(&mut dsinks),
            dbias_st: dbias_strides(p),
        };
        let mut last = None;
        for (kernel, grid) in backward_launches(p, bp.dsinks != 0) {
            let v = Variant::for_problem(kernel, p, ARCH);
            self.launch(&v, flat((grid, kernel.threads())), &bp)?;
            last = Some(v);
        }
        let all = [&q, &k, &vv, &o, &lse, &d_out, &d_rows, &dq, &dk, &dv]
            .into_iter()
            .chain([&bias, &mask, &dbias, &dsinks].into_iter().flatten())
            .chain(small.all());
        if let Some(v) = last {
            self.no_overrun(&v, all)?;
        }
        store(grads.dq, dq.bytes());
        store(grads.dk, dk.bytes());
        store(grads.dv, dv.bytes());
        if let (Some(b), Some(d)) = (grads.dbias, dbias.as_ref()) {
            store(b, d.bytes());
        }
        if let (Some(b), Some(d)) = (grads.dsinks, dsinks.as_ref()) {
            store(b, d.bytes());
        }
        Ok(())
    }
}

impl AttentionMaps for Emulator {
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        lse: &HostData,
        layout: &MapLayout,
        maps: &mut HostData,
    ) -> Result<()> {
        check_maps_call(self, problem, &inputs, lse, layout, maps)?;
        if layout.is_empty() {
            return Ok(());
        }
        let p = problem;
        let (mut mp, geometry) = maps_launch(&self.name(), p, layout)?;
        let mut small = Small::new(&p.options);
        let opt = |name, data: Option<&HostData>| data.map(|b| Dev::new(name, &bytes_of(b)));
        let mut q = Dev::new("q", &bytes_of(inputs.q));
        let mut k = Dev::new("k", &bytes_of(inputs.k));
        let mut lse = Dev::new("lse", &bytes_of(lse));
        let mut bias = opt("bias", inputs.bias);
        let mut mask = opt("mask", inputs.mask);
        let mut batches = Dev::new("batches", &i32_bytes(&layout.batches));
        let mut heads = Dev::new("heads", &i32_bytes(&layout.heads));
        let mut out = Dev::new("maps", &bytes_of(maps));
        let addr = |d: &mut Option<Dev>| d.as_mut().map_or(0, Dev::addr);
        mp.p.q = q.addr();
        mp.p.k = k.addr();
        mp.p.lse = lse.addr();
        mp.p.bias = addr(&mut bias);
        mp.p.mask = addr(&mut mask);
        small.set(&mut mp.p);
        // (The GPU backend passes no sinks: the log-sum-exp holds them.)
        mp.p.sinks = 0;
        mp.maps = out.addr();
        mp.batches = batches.addr();
        mp.heads = heads.addr();
        let v = Variant::for_problem(Kernel::Maps, p, ARCH);
        self.launch(&v, flat(geometry), &mp)?;
        let all = [&q, &k, &lse, &batches, &heads, &out]
            .into_iter()
            .chain([&bias, &mask].into_iter().flatten())
            .chain(small.all());
        self.no_overrun(&v, all)?;
        store(maps, out.bytes());
        Ok(())
    }
}

impl attn_spec::Linear for Emulator {
    fn linear(
        &self,
        x: &HostData,
        rows: usize,
        w: &HostData,
        bias: Option<&HostData>,
        in_features: usize,
        out_features: usize,
    ) -> Result<HostData> {
        attn_spec::check_linear(self, x, rows, w, bias, in_features, out_features)?;
        let dtype = x.dtype();
        let (mut params, geometry) =
            linear_launch(&self.name(), dtype, rows, in_features, out_features)?;
        let mut y_host = HostData::zeros(dtype, rows * out_features);
        let mut xd = Dev::new("x", &bytes_of(x));
        let mut wd = Dev::new("w", &bytes_of(w));
        let mut bd = bias.map(|b| Dev::new("b", &bytes_of(b)));
        let mut yd = Dev::unset("y", y_host.len() * dtype.size_bytes());
        params.x = xd.addr();
        params.w = wd.addr();
        params.b = bd.as_mut().map_or(0, Dev::addr);
        params.y = yd.addr();
        let v = Variant::linear(dtype, ARCH);
        self.launch(&v, geometry, &params)?;
        self.no_overrun(&v, [&xd, &wd, &yd].into_iter().chain(bd.as_ref()))?;
        store(&mut y_host, yd.bytes());
        Ok(y_host)
    }
}

/// The per-call small tensors: lengths, ALiBi slopes, sinks.
struct Small {
    q_lens: Option<Dev>,
    kv_lens: Option<Dev>,
    alibi: Option<Dev>,
    sinks: Option<Dev>,
}

impl Small {
    fn new(o: &AttnOptions) -> Small {
        let dev = |name, b: Option<Vec<u8>>| b.map(|b| Dev::new(name, &b));
        Small {
            q_lens: dev("q_lens", o.q_lens.as_deref().map(i32_bytes)),
            kv_lens: dev("kv_lens", o.kv_lens.as_deref().map(i32_bytes)),
            alibi: dev("alibi", o.alibi_slopes.as_deref().map(f32_bytes)),
            sinks: dev("sinks", o.sinks.as_deref().map(f32_bytes)),
        }
    }

    /// Their addresses into `params` (0 where absent).
    fn set(&mut self, params: &mut Params) {
        let addr = |d: &mut Option<Dev>| d.as_mut().map_or(0, Dev::addr);
        params.q_lens = addr(&mut self.q_lens);
        params.kv_lens = addr(&mut self.kv_lens);
        params.alibi = addr(&mut self.alibi);
        params.sinks = addr(&mut self.sinks);
    }

    fn all(&self) -> impl Iterator<Item = &Dev> {
        [&self.q_lens, &self.kv_lens, &self.alibi, &self.sinks]
            .into_iter()
            .flatten()
    }
}

/// Blocks of `v` one sm_90 multiprocessor holds, by threads (2048) and
/// shared memory (228 KiB, 1 KiB reserved per block) alone: what the
/// occupancy API answers when registers do not bind.
fn blocks_per_sm(v: &Variant) -> usize {
    let by_threads = 2048 / v.kernel.threads() as usize;
    let by_smem = (228 * 1024) / (v.smem_bytes() + 1024);
    by_threads.min(by_smem).clamp(1, 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_padding_catches_writes() {
        let mut d = Dev::new("x", &[1, 2, 3]);
        assert_eq!(d.addr() % PAD as u64, 0);
        assert_eq!(d.bytes(), &[1, 2, 3]);
        assert_eq!(d.overrun(), None);
        let end = d.start + d.len;
        d.mem[end] = 0;
        assert_eq!(d.overrun(), Some("x"));
        let mut u = Dev::unset("y", 10);
        assert_eq!(u.addr() % PAD as u64, 0);
        assert!(u.bytes().iter().all(|&b| b == 0xff));
        u.mem[u.start - 1] = 1;
        assert_eq!(u.overrun(), Some("y"));
    }
}
