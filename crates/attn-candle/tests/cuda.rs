//! The fused custom op on candle's CUDA device (feature `cuda`) through
//! the conformance suite: every option and dtype against the f64
//! reference, the hand-computed cases and bad input. Without a GPU each
//! test prints "skipping" and passes, unless `ATTN_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

use attn_candle::{CandleBackend, CandleEngine};
use attn_conformance::{case_params, check_case, errors, hand, Case, Outcome};
use attn_spec::AttnError;
use proptest::prelude::*;

fn gpu() -> Option<CandleBackend> {
    match CandleBackend::cuda(CandleEngine::Fused, 0) {
        Ok(b) => Some(b),
        Err(e @ AttnError::NoDevice { .. }) => {
            if std::env::var("ATTN_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("ATTN_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("skipping: no GPU ({e})");
            None
        }
        Err(e) => panic!("candle's CUDA device failed to start: {e}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fused_engine_on_cuda_passes_the_suite(params in case_params()) {
        let Some(b) = gpu() else { return Ok(()) };
        let case = Case::build(params);
        prop_assert_eq!(check_case(&b, &case), Ok(Outcome::Passed));
    }
}

#[test]
fn hand_computed_cases_and_bad_input_on_cuda() {
    let Some(b) = gpu() else { return };
    hand::all(&b).unwrap();
    hand::split_kv(&b).unwrap();
    errors::all(&b).unwrap();
}
