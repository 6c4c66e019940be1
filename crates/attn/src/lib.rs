//! # attn: exact, fast attention for Rust
//!
//! Scaled dot-product attention, `O = softmax(scale * Q K^T + bias, masked)
//! V`, and multi-head attention around it, on several backends that all
//! obey one contract (`docs/SEMANTICS.md`) and all pass one differential
//! test suite against an f64 oracle.
//!
//! ## Backends and features
//!
//! | feature | backend | what it needs |
//! |---|---|---|
//! | (always) | [`Reference`]: the f64 oracle, every option, slow | nothing |
//! | `cpu` (default) | `attn-cpu`: SIMD, tiled, multi-threaded | nothing |
//! | `cuda` | `attn::cuda` (crate `attn-cuda`): NVRTC-compiled GPU kernels, buffers on the device | at run time: the NVIDIA driver and NVRTC (errors, not panics, without them) |
//! | `candle` | `attn::candle` (crate `attn-candle`): attn on candle tensors, with autograd | nothing (candle's CUDA tensors: attn-candle's own `cuda` feature and the CUDA toolkit) |
//!
//! [`Engine::best`] picks the fastest backend compiled in that answers on
//! this machine (the GPU first with `cuda`, when a device answers), and
//! [`Engine::pick`] says which one and why the faster ones were passed
//! over. With
//! `--no-default-features` the reference alone is compiled, and everything
//! still computes.
//!
//! ## Example
//!
//! ```
//! use attn::{attend, AttnOptions, Shape};
//!
//! // batch 1, 4 query heads sharing 2 key/value heads (GQA), 3 queries, 5 keys, head dim 8,
//! // tensors laid out [batch, seq, heads, dim].
//! let shape = Shape::new(1, 4, 2, 3, 5, 8);
//! let q = vec![0.5f32; 1 * 3 * 4 * 8];
//! let k = vec![0.25f32; 1 * 5 * 2 * 8];
//! let v: Vec<f32> = (0..1 * 5 * 2 * 8).map(|i| i as f32).collect();
//! let out = attend(shape, &q, &k, &v, &AttnOptions::default().causal()).unwrap();
//! assert_eq!(out.len(), 1 * 3 * 4 * 8);
//! ```

pub use attn_spec::{
    alibi_slopes, bf16, check_backward_call, check_call, check_maps_call, f16, merge_states,
    Alignment, AttentionMaps, AttnError, AttnOptions, Backend, Backward, BufferInfo, DType,
    Element, GradInputs, GradOutputs, GradRequest, Grads, HostData, Inputs, MapLayout, MapRequest,
    Maps, MaskKind, MhaConfig, MhaWeights, MultiHeadAttention, Output, Problem, Reference, Result,
    SeqMask, Shape, TensorDesc, TileClass, View,
};

mod engine;

pub use engine::{Engine, EngineKind};

/// The CUDA backend: [`cuda::Cuda`] implements [`Backend`] with device
/// buffers, so tensors stay on the GPU across calls.
#[cfg(feature = "cuda")]
pub use attn_cuda as cuda;

/// attn on candle tensors (`attn::candle::attention`, the candle
/// `MultiHeadAttention`, `CandleBackend`).
#[cfg(feature = "candle")]
pub use attn_candle as candle;

/// The CPU backend's crate (`attn::cpu::Cpu`, its SIMD levels
/// `attn::cpu::Isa`).
#[cfg(feature = "cpu")]
pub use attn_cpu as cpu;

/// Attention on host slices in the default `[batch, seq, heads, dim]`
/// layout, on the best backend compiled in. Returns the output
/// `[batch, q_len, q_heads, head_dim_v]` in `T`. The backend is the
/// fastest compiled in that runs here and computes this problem (f64:
/// the reference). On the CPU backend Q, K and V are read where they are
/// (no copy); the reference and the GPU take a host copy of them (the GPU
/// then uploads it).
pub fn attend<T: Element + HostElement>(
    shape: Shape,
    q: &[T],
    k: &[T],
    v: &[T],
    options: &AttnOptions,
) -> Result<Vec<T>> {
    let problem = Problem::new(shape, T::DTYPE).with_options(options.clone());
    let engine = EngineKind::compiled()
        .into_iter()
        .filter_map(|k| Engine::of(k).ok())
        .find(|e| e.supports(&problem).is_ok())
        .unwrap_or(Engine::Reference(Reference));
    if let Some(r) = T::on_cpu(&engine, &problem, (q, k, v)) {
        return r;
    }
    let (q, k, v) = (T::wrap(q), T::wrap(k), T::wrap(v));
    let o = engine.forward(&problem, Inputs::new(&q, &k, &v))?;
    T::unwrap(o.out).ok_or_else(|| AttnError::Backend {
        backend: engine.name(),
        message: "output element type differs from the input's".into(),
    })
}

/// Element types that convert to and from [`HostData`].
pub trait HostElement: Sized {
    /// Copies a slice into host data.
    fn wrap(x: &[Self]) -> HostData;
    /// Takes the vector back out (`None` for another element type).
    fn unwrap(d: HostData) -> Option<Vec<Self>>;
    /// Runs `problem` on the caller's slices when `engine` is attn-cpu
    /// and it computes on this type (`None` otherwise).
    fn on_cpu(
        engine: &Engine,
        problem: &Problem,
        qkv: (&[Self], &[Self], &[Self]),
    ) -> Option<Result<Vec<Self>>>;
}

macro_rules! host_element {
    ($t:ty, $v:ident, $cpu:tt) => {
        impl HostElement for $t {
            fn wrap(x: &[Self]) -> HostData {
                HostData::$v(x.to_vec())
            }
            fn unwrap(d: HostData) -> Option<Vec<Self>> {
                match d {
                    HostData::$v(v) => Some(v),
                    _ => None,
                }
            }
            #[allow(unused_variables)] // without `cpu` (or for f64) nothing runs here
            fn on_cpu(
                engine: &Engine,
                problem: &Problem,
                qkv: (&[Self], &[Self], &[Self]),
            ) -> Option<Result<Vec<Self>>> {
                host_element!(@cpu $cpu, $t, engine, problem, qkv)
            }
        }
    };
    (@cpu yes, $t:ty, $engine:ident, $problem:ident, $qkv:ident) => {{
        #[cfg(feature = "cpu")]
        if let Engine::Cpu(c) = $engine {
            let run = || -> Result<Vec<$t>> {
                $problem.validate()?;
                let n = $problem.out.extent().unwrap_or(0);
                let zero = <$t as Element>::from_f32(0.0);
                let mut out = vec![zero; n];
                c.forward_slices($problem, $qkv, (None, None), &mut out, None)?;
                Ok(out)
            };
            return Some(run());
        }
        None
    }};
    (@cpu no, $t:ty, $engine:ident, $problem:ident, $qkv:ident) => {
        None
    };
}
host_element!(f32, F32, yes);
host_element!(f16, F16, yes);
host_element!(bf16, Bf16, yes);
host_element!(f64, F64, no);
