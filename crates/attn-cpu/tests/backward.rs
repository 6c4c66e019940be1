//! attn-cpu's backward pass through the conformance suite's backward part:
//! every option, dtype and layout against the f64 reference under the
//! derived bound, the hand cases, bad input, and bitwise invariance under
//! the thread count.

use attn_conformance::backward::{self, check_backward, BackCase};
use attn_conformance::{case_params, CaseParams, Outcome};
use attn_cpu::Cpu;
use attn_spec::{Backward, DType, GradRequest, Shape};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_conformance::cases(256), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cpu_backward_passes_the_suite(params in case_params()) {
        let bc = BackCase::build(params);
        prop_assert_eq!(check_backward(&Cpu::new(), &bc), Ok(Outcome::Passed));
    }
}

#[test]
fn backward_hand_cases_and_bad_input() {
    backward::all(&Cpu::new()).unwrap();
}

/// Gradients are bitwise identical for 1, 2 and 3 threads: with one unit
/// (keys cut into chunks), with many units, with a bias shared by the
/// heads (its gradient summed over units) and with sinks.
#[test]
fn gradients_do_not_depend_on_the_thread_count() {
    let shapes = [
        (Shape::new(1, 2, 1, 300, 700, 64), DType::F32),
        (Shape::new(2, 8, 8, 150, 140, 40), DType::Bf16),
        (
            Shape::new(1, 4, 2, 200, 260, 24).with_head_dim_v(40),
            DType::F16,
        ),
    ];
    for (i, (shape, dtype)) in shapes.into_iter().enumerate() {
        let mut params = CaseParams::plain(shape);
        params.dtype = dtype;
        params.seed = i as u64;
        params.sinks = i == 2;
        params.bias = (i == 2).then_some(attn_conformance::case::Bcast {
            per_batch: true,
            per_head: false,
        });
        params.options.mask = attn_spec::MaskKind::Causal;
        let bc = BackCase::build(params);
        let p = &bc.case.problem;
        let run = |threads: usize| {
            let cpu = Cpu::with_threads(threads).unwrap();
            let g = cpu
                .backward(p, bc.case.inputs(), bc.forward(), GradRequest::all(p))
                .unwrap();
            (g.dq, g.dk, g.dv, g.dbias, g.dsinks)
        };
        let one = run(1);
        for threads in [2, 3] {
            assert!(
                run(threads) == one,
                "shape {i}: {threads} threads differ from 1"
            );
        }
    }
}
