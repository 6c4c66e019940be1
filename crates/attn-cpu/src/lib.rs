//! # attn-cpu: the fast CPU backend of attn
//!
//! FlashAttention's algorithm on a CPU: blocks of query rows stream tiles of
//! keys and values through an online softmax, so no `S x S` score matrix is
//! ever formed and the memory beyond inputs and outputs is one small
//! workspace per thread. Explicit SIMD chosen at run time ([`Isa`]: AVX-512,
//! AVX2 + FMA, or `wide`'s portable vectors; no `-C target-cpu` needed),
//! masks that cost nothing where they do not apply, GQA heads processed
//! together, all cores through rayon, and results bitwise identical for any
//! thread count (on one level).
//!
//! Layout of the crate (the microkernel apart from tiling and scheduling):
//! `simd/` (the vector type of each level, detection and dispatch),
//! `blocking.rs` (every tuning constant and why), `microkernel/` (register
//! math), `exp.rs` (fast `2^x`), `softmax.rs` (online softmax state),
//! `pack.rs` (panels in, rows out), `tiling.rs` (the loop nest of one block),
//! `work.rs` (cutting a problem into blocks), `schedule.rs` (ordering and
//! running them, writing results), `threads/` (the calling thread and
//! the pool's helpers),
//! `linear.rs` (projections through the `gemm` crate).

mod backward;
mod bias;
mod blocking;
mod decode;
mod dot16;
mod element;
mod exp;
mod linear;
mod maps;
mod microkernel;
mod pack;
mod parts;
mod probs;
mod schedule;
mod simd;
mod softmax;
mod threads;
mod tiling;
mod work;
mod workspace;

pub use element::CpuElement;
pub use simd::Isa;

use attn_spec::{
    check_call, AttnError, Backend, BufferInfo, DType, HostData, Inputs, Problem, Result,
};
use std::sync::Arc;
use tiling::Ctx;

/// The CPU backend. Buffers are host memory ([`HostData`]).
///
/// It runs the widest SIMD level this CPU supports ([`Isa::detected`]),
/// or a lower one: the environment variable `ATTN_CPU_ISA` (`portable`,
/// `avx2`, `avx512`, `avx512bf16`) caps the level of every new backend, and
/// [`Cpu::with_isa`] sets one backend's. [`Cpu::isa`] says which runs.
/// The opt-in `amx` level runs only when named (`ATTN_CPU_ISA=amx`, or
/// `Cpu::with_isa(Isa::Amx)`) on a CPU that has it.
#[derive(Clone, Debug)]
pub struct Cpu {
    /// Its own pool (`with_threads`), or rayon's global pool (`None`).
    pool: Option<Arc<rayon::ThreadPool>>,
    /// `with_threads(1)`: never leave the calling thread.
    single: bool,
    /// The level its kernels run on, or why `ATTN_CPU_ISA` named none.
    isa: std::result::Result<Isa, String>,
    /// The AMX path on the scalar model of the tile unit
    /// ([`Cpu::with_tile_model`]).
    tile_model: bool,
    /// Where helpers wait after a call ([`Cpu::with_spin`]), closed when
    /// the last clone of this backend drops.
    lobby: Option<Arc<threads::Owned>>,
}

impl Default for Cpu {
    fn default() -> Self {
        Cpu {
            pool: None,
            single: false,
            isa: Isa::selected(),
            tile_model: false,
            lobby: None,
        }
    }
}

impl Cpu {
    /// A backend on all cores (rayon's global pool).
    pub fn new() -> Self {
        Cpu::default()
    }

    /// This backend on SIMD level `isa` instead (for comparisons and
    /// tests; results differ between levels only by rounding). An error
    /// when this CPU does not run it.
    pub fn with_isa(self, isa: Isa) -> Result<Self> {
        if !isa.supported() {
            return Err(AttnError::Unsupported {
                backend: "cpu".into(),
                feature: format!("SIMD level {isa}"),
                reason: format!(
                    "this CPU does not run it (the widest it runs is {})",
                    Isa::detected()
                ),
            });
        }
        Ok(Cpu {
            isa: Ok(isa),
            ..self
        })
    }

    /// This backend on the `avx512bf16` level with the AMX level's path for
    /// bf16 inputs, its tile products computed by a scalar model of the
    /// tile unit (`tdpbf16ps` as Intel defines it) instead of the
    /// instructions: for testing that path on CPUs without AMX (slow; not
    /// for use). An error when this CPU does not run `avx512bf16`.
    #[doc(hidden)]
    pub fn with_tile_model(self) -> Result<Self> {
        Ok(Cpu {
            tile_model: true,
            ..self.with_isa(Isa::Avx512Bf16)?
        })
    }

    /// The SIMD level this backend's kernels run on; an error when
    /// `ATTN_CPU_ISA` names no level.
    pub fn isa(&self) -> Result<Isa> {
        self.isa.clone().map_err(|message| AttnError::Backend {
            backend: "cpu".into(),
            message,
        })
    }

    /// A backend on `threads` threads: a forward call (and a maps call)
    /// runs on the calling thread and up to `threads - 1` threads of its
    /// own pool (the backward pass on the pool's `threads`). Results are
    /// bitwise identical for every thread count.
    pub fn with_threads(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(AttnError::ZeroSize { what: "threads" });
        }
        if threads == 1 {
            return Ok(Cpu {
                single: true,
                ..Cpu::default()
            });
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| AttnError::Backend {
                backend: "cpu".into(),
                message: format!("cannot start {threads} threads: {e}"),
            })?;
        Ok(Cpu {
            pool: Some(Arc::new(pool)),
            ..Cpu::default()
        })
    }

    /// This backend with helpers that stay awake for up to `spin` after
    /// each call, spinning, and join the next call at once if it comes
    /// within that time (as ONNX Runtime's intra-op threads do by default,
    /// and OpenMP's with `OMP_WAIT_POLICY=active`). Without it, helpers
    /// go back to the pool, whose threads fall asleep within tens of
    /// microseconds, and a call that follows other work off the pool (on
    /// the calling thread: a sampler, a tokenizer; or on another pool)
    /// waits for them to wake. The backend gets a pool of its own, of
    /// [`Cpu::threads`] threads (a shared pool's other jobs could find
    /// its threads waiting here, or run a helper that then waits on top
    /// of them); clones share it. This backend's `linear` and backward
    /// pass run on that pool and send waiting helpers back to it first,
    /// so an engine whose projections go through this backend gains
    /// little. The price: each waiting helper keeps a core busy for as
    /// long as calls keep coming within `spin` of each other and up to
    /// `spin` after the last. `Duration::ZERO` turns it off (the pool
    /// stays), `Duration::MAX` spins until the backend's last clone
    /// drops. No effect on results, nor on a one-thread backend. An error
    /// when the pool's threads cannot start.
    pub fn with_spin(self, spin: std::time::Duration) -> Result<Self> {
        let threads = self.threads();
        if spin.is_zero() || self.single || threads < 2 {
            return Ok(Cpu {
                lobby: None,
                ..self
            });
        }
        // A pool no other backend shares (this one's, unshared and without
        // a lobby) serves as it is; otherwise a new one.
        let pool = match self.pool {
            Some(ref p) if Arc::strong_count(p) == 1 && self.lobby.is_none() => self.pool.clone(),
            _ => Cpu::with_threads(threads)?.pool,
        };
        let lobby = threads::Lobby::new(spin, threads - 1);
        Ok(Cpu {
            pool,
            lobby: Some(Arc::new(threads::Owned(Arc::new(lobby)))),
            ..self
        })
    }

    /// Threads this backend runs on.
    pub fn threads(&self) -> usize {
        if self.single {
            return 1;
        }
        self.pool
            .as_ref()
            .map_or_else(rayon::current_num_threads, |p| p.current_num_threads())
    }

    /// Whether a problem of `flops` runs on the pool. Handing work to pool
    /// threads costs a wake-up and a context switch (10-20 us measured on
    /// this project's 2-core machine), more than a problem under
    /// [`blocking::PARALLEL_MIN_FLOPS`] takes on one core; such problems,
    /// and every problem of a one-thread backend, run on the calling
    /// thread. The result is the same either way, bit for bit.
    fn parallel(&self, flops: f64) -> bool {
        !self.single && self.threads() > 1 && flops >= blocking::PARALLEL_MIN_FLOPS
    }

    /// Where a call's work items run: on the calling thread alone, or
    /// with helpers from this backend's pool (`threads/`).
    fn runner(&self, par: bool) -> threads::Threads<'_> {
        match par {
            true => threads::Threads::Pool(
                self.pool.as_deref(),
                self.threads(),
                self.lobby.as_ref().map(|o| &o.0),
            ),
            false => threads::Threads::One,
        }
    }

    /// Runs `f` inside this backend's pool when `par`: for `linear`,
    /// whose GEMM crate runs its threads on rayon's current pool.
    /// Helpers waiting in this backend's lobby go back to the pool first,
    /// and none waits there until `f` returns.
    fn install<R: Send>(&self, par: bool, f: impl FnOnce() -> R + Send) -> R {
        let _hold = self.lobby.as_ref().filter(|_| par).map(|o| o.0.hold());
        match (&self.pool, par) {
            (Some(p), true) => p.install(f),
            _ => f(),
        }
    }
}

fn typed<'a, T: CpuElement>(d: &'a HostData, name: &'static str) -> Result<&'a [T]> {
    T::host(d).ok_or_else(|| AttnError::DType {
        tensor: name,
        expected: T::DTYPE.to_string(),
        got: d.dtype(),
    })
}

fn forward_typed<T: CpuElement>(
    (threads, isa, model): (threads::Threads<'_>, Isa, bool),
    p: &Problem,
    inputs: Inputs<'_, HostData>,
    out: &mut HostData,
    lse: Option<&mut HostData>,
) -> Result<()> {
    let mask = match (inputs.mask, &p.mask) {
        (Some(HostData::Bool(m)), Some(v)) => Some((m.as_slice(), *v)),
        _ => None,
    };
    let qkv = (
        typed::<T>(inputs.q, "q")?,
        typed::<T>(inputs.k, "k")?,
        typed::<T>(inputs.v, "v")?,
    );
    let ctx = Ctx::new(p, qkv, inputs.bias.zip(p.bias.map(|d| d.view)), mask)
        .on(isa)
        .tile_model(model);
    let got = out.dtype();
    let out = T::host_mut(out).ok_or(AttnError::DType {
        tensor: "out",
        expected: T::DTYPE.to_string(),
        got,
    })?;
    let lse = match lse {
        Some(HostData::F32(l)) => Some(l.as_mut_slice()),
        _ => None,
    };
    let sink = schedule::Sink::new(out, lse);
    schedule::run_all(&ctx, &sink, threads, isa);
    Ok(())
}

impl Cpu {
    /// Attention on borrowed, typed host slices: Q, K and V are not copied.
    /// The entry point for frameworks that own their storage (attn-candle);
    /// `problem`'s views index into these slices exactly as they would into
    /// host buffers. `bias` and `mask` are host buffers as in
    /// [`Backend::forward_into`].
    pub fn forward_slices<T: CpuElement>(
        &self,
        problem: &Problem,
        (q, k, v): (&[T], &[T], &[T]),
        (bias, mask): (Option<&HostData>, Option<&HostData>),
        out: &mut [T],
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        let info = |len: usize| BufferInfo {
            dtype: T::DTYPE,
            len,
        };
        if problem.options.return_lse && lse.is_none() {
            return Err(AttnError::Missing {
                tensor: "lse",
                what: "options.return_lse is set but no buffer was given",
            });
        }
        let buffers = attn_spec::Buffers {
            q: info(q.len()),
            k: info(k.len()),
            v: info(v.len()),
            bias: bias.map(|b| self.info(b)),
            mask: mask.map(|m| self.info(m)),
            out: Some(info(out.len())),
            lse: lse.as_ref().map(|l| BufferInfo {
                dtype: DType::F32,
                len: l.len(),
            }),
        };
        problem.validate_buffers(&buffers)?;
        self.supports(problem)?;
        let isa = self.isa()?;
        let par = self.parallel(problem.flops());
        let mask = match (mask, &problem.mask) {
            (Some(HostData::Bool(m)), Some(view)) => Some((m.as_slice(), *view)),
            _ => None,
        };
        let bias = bias.zip(problem.bias.map(|d| d.view));
        let ctx = Ctx::new(problem, (q, k, v), bias, mask)
            .on(isa)
            .tile_model(self.tile_model);
        schedule::run_all(&ctx, &schedule::Sink::new(out, lse), self.runner(par), isa);
        Ok(())
    }
}

impl Backend for Cpu {
    attn_spec::host_buffers!();

    fn name(&self) -> String {
        "cpu".into()
    }
    fn supports(&self, problem: &Problem) -> Result<()> {
        match problem.dtype {
            DType::F32 | DType::F16 | DType::Bf16 => Ok(()),
            other => Err(AttnError::Unsupported {
                backend: self.name(),
                feature: format!("{other} inputs"),
                reason: "attn-cpu computes in f32 from f32, f16 or bf16 inputs; the reference computes in f64".into(),
            }),
        }
    }
    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        out: &mut HostData,
        lse: Option<&mut HostData>,
    ) -> Result<()> {
        check_call(self, problem, &inputs, out, lse.as_deref())?;
        let run = (
            self.runner(self.parallel(problem.flops())),
            self.isa()?,
            self.tile_model,
        );
        match problem.dtype {
            DType::F32 => forward_typed::<f32>(run, problem, inputs, out, lse),
            DType::F16 => forward_typed::<attn_spec::f16>(run, problem, inputs, out, lse),
            DType::Bf16 => forward_typed::<attn_spec::bf16>(run, problem, inputs, out, lse),
            _ => unreachable!("refused by supports()"),
        }
    }
}

impl attn_spec::Linear for Cpu {
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
        let threads = if self.single { 1 } else { self.threads() };
        Ok(self.install(true, || {
            linear::linear(x, rows, w, bias, in_features, out_features, threads)
        }))
    }
}
