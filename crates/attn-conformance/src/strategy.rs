//! proptest strategies for conformance cases.
//!
//! Shapes are drawn off any tile size: sequence lengths 0..=300 (with the
//! tile boundaries 63, 64, 65, 127, 128, 129, 255, 256, 257 drawn often),
//! head dimensions 1..=256 including odd ones and Q/K dims that differ from
//! V's, q_len != kv_len, GQA ratios 1..=4, every mask kind with windows of 0
//! and 1, both alignments, per-sequence lengths that empty whole rows,
//! bias, boolean masks, ALiBi, softcap, sinks, large logits, offsets and
//! both layouts, in f32, f16 and bf16. Adversarial data comes in about one
//! case in four ([`Numbers`]): scores near f32 overflow, subnormal inputs,
//! NaN in visible and in excluded positions; bias tensors carry whole rows
//! of `-inf`, windows reach `usize::MAX`, per-sequence lengths reach 0
//! and head dimensions reach 320. The reference costs
//! `O(q_len * kv_len * dim)` per head, so long sequences come with small
//! head dims and large head dims with short sequences: every combination
//! is still reached.

use crate::case::{mask_kinds, Bcast, CaseParams, Numbers};
use attn_spec::{Alignment, AttnOptions, DType, Shape};
use proptest::prelude::*;

fn seq_len(max: usize) -> BoxedStrategy<usize> {
    let edges: Vec<usize> = [1, 63, 64, 65, 127, 128, 129, 255, 256, 257]
        .into_iter()
        .filter(|&e| e <= max)
        .collect();
    prop_oneof![
        3 => 0..=max,
        1 => proptest::sample::select(edges),
    ]
    .boxed()
}

fn head_dim(max: usize) -> BoxedStrategy<usize> {
    let common: Vec<usize> = [1, 2, 3, 8, 16, 31, 32, 33, 64, 72, 80, 96, 112, 128, 256]
        .into_iter()
        .filter(|&e| e <= max)
        .collect();
    prop_oneof![
        2 => 1..=max,
        1 => proptest::sample::select(common),
    ]
    .boxed()
}

fn sizes() -> impl Strategy<Value = (usize, usize, usize, usize)> {
    // (q_len, kv_len, head_dim_qk, head_dim_v)
    prop_oneof![
        (seq_len(48), seq_len(48), head_dim(256), head_dim(256)),
        (seq_len(16), seq_len(16), 250..=320usize, 250..=320usize),
        (seq_len(300), seq_len(300), head_dim(24), head_dim(24)),
        (seq_len(300), seq_len(300), head_dim(24), head_dim(24))
            .prop_map(|(q, k, d, _)| (q, k, d, d)),
        (1..=4usize, seq_len(300), head_dim(128), head_dim(128)),
    ]
}

fn bcast() -> impl Strategy<Value = Bcast> {
    (any::<bool>(), any::<bool>()).prop_map(|(per_batch, per_head)| Bcast {
        per_batch,
        per_head,
    })
}

/// Which adversarial numbers a case carries: plain data in 3 cases of 4.
pub fn numbers() -> impl Strategy<Value = Numbers> {
    prop_oneof![
        12 => Just(Numbers::Plain),
        1 => Just(Numbers::NearOverflow),
        1 => Just(Numbers::Subnormal),
        1 => Just(Numbers::NanVisible),
        1 => Just(Numbers::NanExcluded),
    ]
}

/// The dtypes every backend is checked in.
pub fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::Bf16)]
}

/// Any conformance case, every option and combination.
pub fn case_params() -> impl Strategy<Value = CaseParams> {
    let shape = (1..=2usize, 1..=2usize, 1..=4usize, sizes()).prop_map(
        |(batch, kv_heads, group, (q_len, kv_len, dqk, dv))| {
            Shape::new(batch, kv_heads * group, kv_heads, q_len, kv_len, dqk).with_head_dim_v(dv)
        },
    );
    let options = (
        proptest::sample::select(mask_kinds()),
        any::<bool>(),
        proptest::option::weighted(0.2, prop_oneof![Just(5.0f32), Just(30.0f32)]),
        proptest::option::weighted(0.15, 0.05f32..2.0),
        any::<bool>(),
    )
        .prop_map(|(mask, top_left, softcap, scale, lse)| AttnOptions {
            mask,
            alignment: if top_left {
                Alignment::TopLeft
            } else {
                Alignment::BottomRight
            },
            softcap,
            scale,
            return_lse: lse,
            ..AttnOptions::default()
        });
    let flags = (
        proptest::bool::weighted(0.25),
        proptest::bool::weighted(0.25),
        proptest::bool::weighted(0.2),
        proptest::bool::weighted(0.2),
        proptest::option::weighted(0.2, bcast()),
        proptest::option::weighted(0.2, (bcast(), 0.0f64..=1.0)),
        proptest::bool::weighted(0.15),
        numbers(),
    );
    (
        shape,
        dtype(),
        any::<bool>(),
        0..=3usize,
        options,
        flags,
        any::<u64>(),
    )
        .prop_map(
            |(shape, dtype, bhsd, offset, options, fl, seed)| CaseParams {
                shape,
                dtype,
                bhsd,
                offset,
                options,
                q_lens: fl.0,
                kv_lens: fl.1,
                alibi: fl.2,
                sinks: fl.3,
                bias: fl.4,
                bool_mask: fl.5,
                large_logits: fl.6,
                numbers: fl.7,
                seed,
            },
        )
}
