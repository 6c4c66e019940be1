//! # attn-cuda: attn on NVIDIA GPUs
//!
//! A backend of attn-spec's [`Backend`](attn_spec::Backend) trait whose
//! buffers live on the GPU ([`CudaBuffer`], cudarc device memory). The
//! kernels are CUDA C embedded in this crate (`src/kernels/`), compiled at
//! run time by NVRTC to machine code for the GPU found ([`compile`]), once
//! per [`Variant`] (what changes the code: element types, head dims, tile
//! sizes, optional steps, arch), and cached. Building needs no CUDA toolkit and no GPU; on a machine
//! without the driver or NVRTC every entry point returns
//! [`AttnError::DriverMissing`](attn_spec::AttnError::DriverMissing) or
//! `NoDevice`, never panics.
//!
//! Kernels:
//! - `attn_mma` (f16/bf16): FlashAttention-2's forward on tensor cores,
//!   `mma.sync.m16n8k16` with f32 accumulation, online softmax in
//!   registers, probabilities fed from the score accumulators straight into
//!   the P V product. Compiled with `FAST` ([`Kernel::MmaFast`], opt-in by
//!   [`HalfKernel::TensorCoreFast`] until it has passed the suite on a GPU):
//!   probabilities packed by `cvt.rn`, Q's fragments in registers and,
//!   without soft-cap, ALiBi or bias, the softmax in base 2 on `ex2.approx`.
//! - `attn_simt` (f32, and f16/bf16 on request): plain FMA in f32, the
//!   precision of attn-cpu (no tf32 rounding).
//! - `attn_combine`: split-KV (flash-decoding) merge; [`plan_splits`] is
//!   the pure heuristic that picks the splits.
//! - `attn_linear`: the multi-head layer's projections.
//!
//! All kernels implement the whole contract of docs/SEMANTICS.md: windows
//! with both alignments and block skipping, per-sequence lengths, bias and
//! boolean masks, GQA/MQA, ALiBi, softcap, sinks, log-sum-exp, different
//! Q/K and V head dims, any head dim up to 256 (padded inside the kernel).

mod backend;
mod bytes;
pub mod cache;
pub mod compile;
pub mod emu;
pub mod libs;
pub mod params;
pub mod plan;
pub mod variant;

pub use backend::{Cuda, CudaBuffer};
pub use emu::Emulator;
pub use params::plan_splits;
pub use plan::HalfKernel;
pub use variant::{check_variants, Kernel, Variant};
