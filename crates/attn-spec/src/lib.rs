//! # attn-spec: the attention contract
//!
//! Everything every attn backend shares, and nothing backend-specific:
//!
//! - the problem ([`Shape`], [`View`], [`DType`], [`AttnOptions`],
//!   [`Problem`]) and its one validation ([`Problem::validate_buffers`]);
//! - the masking model, defined once ([`SeqMask`]: visible key range of a
//!   row, tile classifier);
//! - typed errors ([`AttnError`]);
//! - the backend trait ([`Backend`]) and [`merge_states`];
//! - the backward pass ([`Backward`]: dQ, dK, dV, and the gradients of
//!   the bias and the sinks);
//! - the oracle: the f64 [`Reference`] backend, and an independent dense
//!   formulation ([`dense::attend_dense`]) that checks it;
//! - attention maps ([`AttentionMaps`], [`MapRequest`]): the
//!   probabilities of chosen heads and rows, recomputed from the
//!   log-sum-exp;
//! - [`MultiHeadAttention`] over any backend.
//!
//! The semantics are specified in `docs/SEMANTICS.md`:
//! `O = softmax(scale * Q K^T + bias, masked) V` with softcap, ALiBi,
//! sinks, per-sequence lengths and bottom-right-aligned windows.
//!
//! ```
//! use attn_spec::{AttnOptions, Backend, DType, HostData, Inputs, Problem, Reference, Shape};
//!
//! // One batch entry, 2 query heads sharing 1 key/value head, 3 queries, 4 keys, dim 8.
//! let shape = Shape::new(1, 2, 1, 3, 4, 8);
//! let problem = Problem::new(shape, DType::F32).with_options(AttnOptions::default().causal());
//! let q = HostData::F32(vec![0.1; 1 * 3 * 2 * 8]);
//! let k = HostData::F32(vec![0.2; 1 * 4 * 1 * 8]);
//! let v = HostData::F32((0..32).map(|i| i as f32).collect());
//! let out = Reference.forward(&problem, Inputs::new(&q, &k, &v)).unwrap();
//! assert_eq!(out.out.len(), 1 * 3 * 2 * 8);
//! ```

mod backend;
pub mod dense;
mod dtype;
mod error;
mod grad;
mod linear;
pub mod maps;
mod mask;
mod merge;
mod mha;
mod options;
mod problem;
pub mod reference;
mod tensor;

pub use backend::{check_buffers, check_call, Backend, Inputs, Output};
pub use dtype::{round_to, DType, Element};
pub use error::{human_bytes, AttnError, Result};
pub use grad::{
    check_backward_call, Backward, GradBuffers, GradInputs, GradOutputs, GradRequest, Grads,
};
pub use linear::{check_linear, Linear};
pub use maps::{check_maps_call, AttentionMaps, MapLayout, MapRequest, Maps};
pub use mask::{SeqMask, TileClass};
pub use merge::merge_states;
pub use mha::{MhaConfig, MhaWeights, MultiHeadAttention};
pub use options::{alibi_slopes, Alignment, AttnOptions, MaskKind};
pub use problem::{BufferInfo, Buffers, Problem, Shape, TensorDesc};
pub use reference::Reference;
pub use tensor::{HostData, View};

/// Re-export of the `half` crate's 16-bit float types.
pub use half::{bf16, f16};
