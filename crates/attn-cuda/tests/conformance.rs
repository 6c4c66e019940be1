//! attn-cuda through the conformance suite on a GPU: every option and
//! dtype against the f64 reference (both the tensor-core and the FMA
//! kernel for f16/bf16), the hand-computed cases, bad input, the
//! split-KV decoding path, and the backward pass's suite. Without a GPU each test prints "skipping: no
//! GPU" and passes, unless `ATTN_REQUIRE_GPU=1`, which makes it fail.

use attn_conformance::backward::{self, check_backward, BackCase};
use attn_conformance::{case_params, check_case, errors, hand, Case, Outcome};
use attn_cuda::{Cuda, HalfKernel};
use attn_spec::{AttnError, DType};
use proptest::prelude::*;
use std::sync::OnceLock;

mod common;

/// The GPU backends (tensor-core, FMA), or `None` after printing why.
fn gpu() -> Option<&'static (Cuda, Cuda)> {
    static G: OnceLock<Option<(Cuda, Cuda)>> = OnceLock::new();
    G.get_or_init(|| {
        let both = Cuda::first().and_then(|tc| {
            let simt = Cuda::first()?.with_half_kernel(HalfKernel::Simt)?;
            Ok((tc, simt))
        });
        match both {
            Ok(b) => Some(b),
            Err(e @ (AttnError::NoDevice { .. } | AttnError::DriverMissing { .. })) => {
                if std::env::var("ATTN_REQUIRE_GPU").as_deref() == Ok("1") {
                    panic!("ATTN_REQUIRE_GPU=1 but no GPU: {e}");
                }
                eprintln!("skipping: no GPU ({e})");
                None
            }
            Err(e) => panic!("a GPU is present but attn-cuda failed to start: {e}"),
        }
    })
    .as_ref()
}

/// The tensor-core backend with the opt-in `FAST` kernel
/// (`HalfKernel::TensorCoreFast`), or `None` where [`gpu`] is.
fn fast() -> Option<&'static Cuda> {
    static F: OnceLock<Option<Cuda>> = OnceLock::new();
    F.get_or_init(|| {
        gpu()?;
        let fast = Cuda::first().and_then(|c| c.with_half_kernel(HalfKernel::TensorCoreFast));
        Some(fast.unwrap_or_else(|e| panic!("the fast tensor-core backend failed to start: {e}")))
    })
    .as_ref()
}

/// Generated cases: `$ATTN_GPU_CASES`, default 256. Most cases need a
/// kernel variant of their own (NVRTC, about half a second each), so the
/// GPU bundle's script lowers it to fit a short device session.
fn gpu_cases() -> u32 {
    std::env::var("ATTN_GPU_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpu_cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cuda_passes_the_suite(params in case_params()) {
        if let Some((tc, simt)) = gpu() {
            let case = Case::build(params);
            let r = common::passed_or_too_wide(&case, check_case(tc, &case));
            prop_assert!(r.is_ok(), "tensor-core: {:?}", r);
            if case.problem.dtype != DType::F32 {
                let r = common::passed_or_too_wide(&case, check_case(simt, &case));
                prop_assert!(r.is_ok(), "FMA: {:?}", r);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpu_cases() / 2, failure_persistence: None, ..ProptestConfig::default() })]

    /// The backward kernels on generated cases; the gradient of a bias
    /// broadcast over batch or heads is refused (`Unsupported`), so those
    /// cases must come back skipped.
    #[test]
    fn cuda_backward_passes_the_suite(params in case_params()) {
        if let Some((tc, _)) = gpu() {
            let bc = BackCase::build(params);
            let s = bc.case.problem.shape;
            let broadcast = bc.case.problem.bias.is_some_and(|b| b.view.dims[0] != s.batch || b.view.dims[1] != s.q_heads);
            let r = check_backward(tc, &bc);
            if broadcast {
                prop_assert!(matches!(r, Ok(Outcome::Skipped(_))), "{:?}", r);
            } else {
                let r = common::passed_or_too_wide(&bc.case, r);
                prop_assert!(r.is_ok(), "{:?}", r);
            }
        }
    }
}

/// The first thing the GPU bundle runs, alone in its process (`run.sh`:
/// `smoke --exact`, then again under compute-sanitizer's memcheck and
/// racecheck): one small causal GQA case per forward kernel (f32 on the
/// FMA kernel, bf16 and f16 on the tensor cores and the FMA kernel), head
/// dim 256 (over 48 KB of shared memory: the opt-in), a decode row on the
/// split-KV path, a prefill in the fast kernel's wide blocks, and one
/// backward case, so that a fault that poisons the
/// context (an out-of-bounds read, a misaligned copy) shows here, named,
/// before the suite's shared context hides its first cause.
#[test]
fn smoke() {
    if let Some((tc, simt)) = gpu() {
        eprintln!("GPU: {tc:?}");
        let (cases, backward) = common::smoke_cases();
        for params in cases {
            let case = Case::build(params);
            eprintln!("smoke: {}", case.describe());
            assert_eq!(
                check_case(tc, &case),
                Ok(Outcome::Passed),
                "tensor-core backend"
            );
            if case.problem.dtype != DType::F32 {
                assert_eq!(check_case(simt, &case), Ok(Outcome::Passed), "FMA backend");
                let fast = fast().expect("a GPU");
                assert_eq!(check_case(fast, &case), Ok(Outcome::Passed), "fast kernel");
            }
        }
        let bc = BackCase::build(backward);
        eprintln!("smoke: backward {}", bc.case.describe());
        assert_eq!(check_backward(tc, &bc), Ok(Outcome::Passed), "backward");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpu_cases() / 2, failure_persistence: None, ..ProptestConfig::default() })]

    /// The opt-in fast tensor-core kernel on generated f16/bf16 cases (f32
    /// cases run the FMA kernel whatever the choice, so they are skipped).
    #[test]
    fn cuda_fast_kernel_passes_the_suite(params in case_params()) {
        if let Some(fast) = fast() {
            let case = Case::build(params);
            if case.problem.dtype != DType::F32 {
                let r = common::passed_or_too_wide(&case, check_case(fast, &case));
                prop_assert!(r.is_ok(), "fast: {:?}", r);
            }
        }
    }
}

/// The fast kernel on the hand-computed and split-KV decoding cases.
#[test]
fn fast_kernel_hand_and_split_kv_cases() {
    if let Some(fast) = fast() {
        hand::all(fast).unwrap();
        hand::split_kv(fast).unwrap();
    }
}

#[test]
fn backward_hand_cases_and_bad_input() {
    if let Some((tc, _)) = gpu() {
        backward::all(tc).unwrap();
    }
}

#[test]
fn hand_computed_cases() {
    if let Some((tc, simt)) = gpu() {
        hand::all(tc).unwrap();
        hand::all(simt).unwrap();
    }
}

/// The multi-head layer's projection kernel against f64.
#[test]
fn projections_match_f64() {
    if let Some((tc, _)) = gpu() {
        common::linear_matches_f64(tc).unwrap();
    }
}

#[test]
fn bad_input_gives_typed_errors() {
    if let Some((tc, _)) = gpu() {
        errors::all(tc).unwrap();
        errors::layer(tc).unwrap();
    }
}

/// Decode shapes (one query row, long keys) take the split-KV path and its
/// combine kernel; they must pass the same check, with sinks, windows and
/// per-sequence lengths (one sequence with no key at all).
#[test]
fn split_kv_decoding_passes() {
    if let Some((tc, simt)) = gpu() {
        hand::split_kv(tc).unwrap();
        hand::split_kv(simt).unwrap();
    }
}

/// Attention maps: the maps hand cases and bad input, then generated
/// cases (a quarter of `$ATTN_GPU_CASES`) against the f64 reference's
/// probabilities.
#[test]
fn cuda_maps_pass_the_suite() {
    if let Some((tc, _)) = gpu() {
        common::maps_suite(tc, gpu_cases() / 4 + 1).unwrap();
    }
}
