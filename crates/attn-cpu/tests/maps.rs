//! attn-cpu's attention maps through the conformance suite: generated
//! cases (every option, dtype, layout and adversarial data) against the
//! f64 reference's probabilities under the derived bound, the hand cases,
//! bad input, and bitwise invariance under the thread count and the
//! request (a map row is the same whether asked alone or with others).

use attn_conformance::maps::{self, check_maps, request_for, run_maps};
use attn_conformance::{case_params, Case, CaseParams, Outcome};
use attn_cpu::Cpu;
use attn_spec::{DType, MapRequest, MaskKind, Shape};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_conformance::cases(256), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cpu_maps_pass_the_suite(params in case_params()) {
        let case = Case::build(params);
        prop_assert_eq!(check_maps(&Cpu::new(), &case, &request_for(&case)), Ok(Outcome::Passed));
    }
}

#[test]
fn maps_hand_cases_and_bad_input() {
    maps::all(&Cpu::new()).unwrap();
}

/// Maps are bitwise identical for 1, 2 and 3 threads, and a head's rows
/// asked alone equal the same rows of the full map.
#[test]
fn maps_do_not_depend_on_threads_or_on_the_rest_of_the_request() {
    let mut params = CaseParams::plain(Shape::new(2, 4, 2, 230, 170, 40));
    params.dtype = DType::Bf16;
    params.options.mask = MaskKind::Causal;
    params.sinks = true;
    params.alibi = true;
    params.seed = 5;
    let case = Case::build(params);
    let all = MapRequest::all();
    let run = |threads: usize, req: &MapRequest| {
        run_maps(&Cpu::with_threads(threads).unwrap(), &case, req, false)
            .unwrap()
            .0
    };
    let one = run(1, &all);
    for threads in [2, 3] {
        assert!(run(threads, &all) == one, "{threads} threads");
    }
    let part = run(2, &MapRequest::all().batches([1]).heads([2]).rows(100..200));
    let (sq, sk) = (230, 170);
    let full = one.to_f64_vec();
    let part = part.to_f64_vec();
    for (r, i) in (100..200).enumerate() {
        let at = ((4 + 2) * sq + i) * sk;
        assert_eq!(&part[r * sk..(r + 1) * sk], &full[at..at + sk], "row {i}");
    }
}
