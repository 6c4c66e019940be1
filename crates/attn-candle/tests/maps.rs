//! Attention maps of both candle engines through the conformance suite:
//! generated cases against the f64 reference's probabilities under the
//! derived bound, the hand cases and bad input.

use attn_candle::CandleBackend;
use attn_conformance::maps::{self, check_maps, request_for};
use attn_conformance::{case_params, Case, Outcome};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_conformance::cases(96), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fused_engine_maps_pass_the_suite(params in case_params()) {
        let case = Case::build(params);
        prop_assert_eq!(check_maps(&CandleBackend::fused_cpu(), &case, &request_for(&case)), Ok(Outcome::Passed));
    }

    #[test]
    fn plain_engine_maps_pass_the_suite(params in case_params()) {
        let case = Case::build(params);
        prop_assert_eq!(check_maps(&CandleBackend::plain_cpu(), &case, &request_for(&case)), Ok(Outcome::Passed));
    }
}

#[test]
fn maps_hand_cases_on_both_engines() {
    maps::all(&CandleBackend::fused_cpu()).unwrap();
    maps::all(&CandleBackend::plain_cpu()).unwrap();
}
