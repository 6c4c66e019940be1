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

/// The GPU bundle's smoke cases (`common::smoke_cases`) on every kernel.
#[test]
fn smoke() {
    let (cases, backward) = common::smoke_cases();
    // The tensor-core kernels without the decode key split too (the
    // smoke's decode row takes 64-row blocks then).
    let whole = [
        (
            "tensor-core, 64 rows",
            Emulator::new().with_decode_key_split(false),
        ),
        (
            "fast, 64 rows",
            Emulator::new()
                .with_half_kernel(HalfKernel::TensorCoreFast)
                .with_decode_key_split(false),
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
