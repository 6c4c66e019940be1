//! attn-cuda's kernels through the conformance suite on the CPU
//! ([`attn_cuda::Emulator`]): the same cases the GPU bundle runs first,
//! the hand-computed and split-KV cases, bad input and generated cases,
//! for the tensor-core kernel, its opt-in fast build and the FMA kernel,
//! the backward kernels' suite and the attention maps' suite.
//! Generated cases: `$ATTN_EMU_CASES` (default 24; each new kernel
//! variant costs a C++ compile of a second or two).
//!
//! The emulator's fibers switch stacks in x86-64 assembly: elsewhere this
//! file compiles to nothing.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use attn_conformance::backward::{self, check_backward, BackCase};
use attn_conformance::{case_params, check_case, errors, hand, Case, Outcome};
use attn_cuda::{Emulator, HalfKernel};
use attn_spec::DType;
use proptest::prelude::*;

mod common;

fn backends() -> [(&'static str, Emulator); 3] {
    [
        ("tensor-core", Emulator::new()),
        (
            "fast",
            Emulator::new().with_half_kernel(HalfKernel::TensorCoreFast),
        ),
        ("FMA", Emulator::new().with_half_kernel(HalfKernel::Simt)),
    ]
}

fn emu_cases() -> u32 {
    std::env::var("ATTN_EMU_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24)
}

/// The variant the fast kernel's emulator runs `case` with (the plan the
/// emulator follows, `plan::forward_variant`).
fn fast_variant(case: &Case) -> attn_cuda::Variant {
    attn_cuda::plan::forward_variant(
        HalfKernel::TensorCoreFast,
        attn_cuda::plan::Shapes::default(),
        &case.problem,
        attn_cuda::emu::ARCH,
        attn_cuda::emu::SMEM_OPTIN,
    )
}

/// The GPU bundle's smoke cases (`common::smoke_cases`) on every kernel.
#[test]
fn smoke() {
    let (cases, backward) = common::smoke_cases();
    // The tensor-core kernels without the decode key split and the wide
    // prefill blocks too (the smoke's decode and 130-row cases take 64-row
    // blocks then).
    let whole = [
        (
            "tensor-core, 64 rows",
            Emulator::new().with_decode_key_split(false),
        ),
        (
            "fast, 64 rows",
            Emulator::new()
                .with_half_kernel(HalfKernel::TensorCoreFast)
                .with_decode_key_split(false)
                .with_wide_blocks(false),
        ),
    ];
    for (name, b) in backends().into_iter().chain(whole) {
        for params in &cases {
            let case = Case::build(params.clone());
            assert_eq!(
                check_case(&b, &case),
                Ok(Outcome::Passed),
                "{name}: {}",
                case.describe()
            );
        }
    }
    let bc = BackCase::build(backward);
    assert_eq!(
        check_backward(&Emulator::new(), &bc),
        Ok(Outcome::Passed),
        "backward"
    );
}

/// The fast kernel's wide prefill blocks (`Variant::wide`: 128 rows, two
/// m-tiles per warp) on what they take: 128 query rows and more, a last
/// block nearly empty, head dims from 16 to 128 (uneven ones, Q/K unlike
/// V, 64-key and 32-key tiles, Q in registers or not), causal and sliding
/// windows in both alignments, per-sequence lengths, GQA, the BHSD layout,
/// the log-sum-exp and split-KV partials.
#[test]
fn wide_prefill_blocks_pass_the_suite() {
    use attn_conformance::CaseParams;
    use attn_spec::{AttnOptions, Shape};
    let fast = Emulator::new().with_half_kernel(HalfKernel::TensorCoreFast);
    let cases = [
        (
            Shape::new(1, 2, 1, 128, 128, 64),
            DType::Bf16,
            AttnOptions::default(),
        ),
        (
            Shape::new(2, 4, 2, 130, 200, 128),
            DType::F16,
            AttnOptions::default().causal().with_lse(),
        ),
        (
            Shape::new(1, 3, 3, 257, 190, 72).with_head_dim_v(40),
            DType::Bf16,
            AttnOptions::default().top_left().causal(),
        ),
        (
            Shape::new(1, 2, 1, 200, 300, 16),
            DType::F16,
            AttnOptions::default().window(Some(70), Some(5)),
        ),
        (
            Shape::new(2, 2, 2, 160, 96, 96).with_head_dim_v(128),
            DType::Bf16,
            AttnOptions::default().window(Some(40), None),
        ),
        // Q/K dims under 64 with V's 128 (Q read from shared memory, 32-key
        // tiles); then few blocks and many keys: split-KV partials.
        (
            Shape::new(1, 2, 2, 140, 150, 48).with_head_dim_v(128),
            DType::F16,
            AttnOptions::default().causal(),
        ),
        (
            Shape::new(1, 2, 1, 128, 1500, 64),
            DType::Bf16,
            AttnOptions::default().with_lse(),
        ),
    ];
    for (i, (shape, dtype, options)) in cases.into_iter().enumerate() {
        let mut params = CaseParams::plain(shape);
        params.dtype = dtype;
        params.options = options;
        params.kv_lens = i == 1;
        params.q_lens = i == 4;
        params.bhsd = i == 3;
        params.seed = i as u64;
        let case = Case::build(params);
        let v = fast_variant(&case);
        assert!(v.wide, "case {i}: {}", case.describe());
        // (The emulator plans for more resident blocks than one per SM:
        // at least as many splits as this.)
        let splits = attn_cuda::plan::ForwardPlan::new(&case.problem, v, attn_cuda::emu::SMS)
            .unwrap()
            .splits;
        assert_eq!(splits > 1, i == 6, "case {i}: {splits} splits");
        assert_eq!(
            check_case(&fast, &case),
            Ok(Outcome::Passed),
            "case {i}: {}",
            case.describe()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: emu_cases() / 4, failure_persistence: None, ..ProptestConfig::default() })]

    /// The fast kernel's wide prefill blocks on generated shapes: 128 to
    /// 300 query rows, up to 600 keys (split-KV where the blocks are few),
    /// head dims 1 to 128 with Q/K unlike V, every mask kind in both
    /// alignments, GQA, per-sequence lengths, both layouts, the log-sum-exp
    /// and the adversarial numbers that keep the wide shape (near-overflow
    /// scores, subnormals, NaN); each case checks that it runs wide.
    /// `$ATTN_EMU_CASES / 4` cases (default 6).
    #[test]
    fn emulated_wide_blocks_pass_the_suite(
        (batch, kv_heads, group) in (1..=2usize, 1..=2usize, 1..=2usize),
        (q_len, kv_len, dqk, dv) in (128..=300usize, 1..=600usize, 1..=128usize, 1..=128usize),
        kind in proptest::sample::select(attn_conformance::case::mask_kinds()),
        (top_left, f16, lse, q_lens, kv_lens, bhsd) in any::<(bool, bool, bool, bool, bool, bool)>(),
        numbers in 0..8usize,
        seed in any::<u64>(),
    ) {
        use attn_conformance::case::Numbers;
        use attn_conformance::CaseParams;
        use attn_spec::Shape;
        let shape = Shape::new(batch, kv_heads * group, kv_heads, q_len, kv_len, dqk).with_head_dim_v(dv);
        let mut params = CaseParams::plain(shape);
        params.dtype = if f16 { DType::F16 } else { DType::Bf16 };
        params.options.mask = kind;
        if top_left {
            params.options = params.options.top_left();
        }
        params.options.return_lse = lse;
        params.q_lens = q_lens;
        params.kv_lens = kv_lens;
        params.bhsd = bhsd;
        params.numbers = match numbers {
            0 => Numbers::NearOverflow,
            1 => Numbers::Subnormal,
            2 => Numbers::NanVisible,
            3 if q_lens || kv_lens => Numbers::NanExcluded,
            _ => Numbers::Plain,
        };
        params.seed = seed;
        let case = Case::build(params);
        let v = fast_variant(&case);
        prop_assert!(v.wide, "{}", case.describe());
        let fast = Emulator::new().with_half_kernel(HalfKernel::TensorCoreFast);
        prop_assert_eq!(check_case(&fast, &case), Ok(Outcome::Passed), "{}", case.describe());
    }
}

/// The maps hand cases and bad input, then generated cases, as the GPU
/// suite runs them.
#[test]
fn attention_maps_pass_the_suite() {
    common::maps_suite(&Emulator::new(), emu_cases() / 2 + 1).unwrap();
}

#[test]
fn backward_hand_cases_and_bad_input() {
    backward::all(&Emulator::new()).unwrap();
}

#[test]
fn hand_computed_and_split_kv_cases() {
    for (name, b) in backends() {
        hand::all(&b).unwrap_or_else(|e| panic!("{name}: {e}"));
        hand::split_kv(&b).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn bad_input_gives_typed_errors() {
    errors::all(&Emulator::new()).unwrap();
    errors::layer(&Emulator::new()).unwrap();
}

#[test]
fn projections_match_f64() {
    common::linear_matches_f64(&Emulator::new()).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: emu_cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// The backward kernels on generated cases; the gradient of a bias
    /// broadcast over batch or heads is refused (`Unsupported`).
    #[test]
    fn emulated_backward_passes_the_suite(params in case_params()) {
        let bc = BackCase::build(params);
        let s = bc.case.problem.shape;
        let broadcast = bc.case.problem.bias.is_some_and(|b| b.view.dims[0] != s.batch || b.view.dims[1] != s.q_heads);
        let r = check_backward(&Emulator::new(), &bc);
        if broadcast {
            prop_assert!(matches!(r, Ok(Outcome::Skipped(_))), "{:?}", r);
        } else {
            let r = common::passed_or_too_wide(&bc.case, r);
            prop_assert!(r.is_ok(), "{:?}", r);
        }
    }

    #[test]
    fn emulated_kernels_pass_the_suite(params in case_params()) {
        let case = Case::build(params);
        for (name, b) in backends() {
            if name != "tensor-core" && case.problem.dtype == DType::F32 {
                continue;
            }
            let r = common::passed_or_too_wide(&case, check_case(&b, &case));
            prop_assert!(r.is_ok(), "{}: {:?}", name, r);
        }
    }
}
