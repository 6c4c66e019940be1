//! attn-cpu through the conformance suite: every option and dtype against
//! the f64 reference, the hand-computed cases, bad input, and bitwise
//! invariance under the thread count.

use attn_conformance::{case_params, check_case, errors, hand, Case, CaseParams, Outcome};
use attn_cpu::Cpu;
use attn_spec::{AttnOptions, Backend, DType, Inputs, Shape};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cpu_passes_the_suite(params in case_params()) {
        let case = Case::build(params);
        let r = check_case(&Cpu::new(), &case);
        prop_assert_eq!(r, Ok(Outcome::Passed));
    }
}

#[test]
fn hand_computed_cases() {
    hand::all(&Cpu::new()).unwrap();
}

#[test]
fn bad_input_gives_typed_errors() {
    errors::all(&Cpu::new()).unwrap();
}

/// Long key sequences take the split-KV paths (decode shapes: per head and
/// in lockstep); they must pass the same check, with sinks, windows and
/// per-sequence lengths.
#[test]
fn split_kv_decoding_passes() {
    hand::split_kv(&Cpu::new()).unwrap();
}

/// The output is bitwise identical for 1, 2 and 3 threads, on the prefill
/// path and both split-KV paths.
#[test]
fn results_do_not_depend_on_the_thread_count() {
    // Prefill; split-KV per head (one K/V head, or [b, h, s, d]); split-KV
    // in lockstep (K and V read in place, f32 and bf16).
    let shapes = [
        (Shape::new(2, 4, 2, 200, 333, 40), DType::F32, false),
        (Shape::new(1, 4, 1, 1, 5000, 64), DType::F32, false),
        (Shape::new(1, 8, 2, 1, 5000, 64), DType::F16, true),
        (Shape::new(1, 8, 2, 1, 5000, 64), DType::F32, false),
        (Shape::new(2, 8, 2, 1, 5000, 64), DType::Bf16, false),
    ];
    for (shape, dtype, bhsd) in shapes {
        let mut params = CaseParams::plain(shape);
        params.dtype = dtype;
        params.bhsd = bhsd;
        params.options = AttnOptions::default().causal().with_lse();
        params.seed = 5;
        let case = Case::build(params);
        let run = |threads: usize| {
            let cpu = Cpu::with_threads(threads).unwrap();
            let o = cpu
                .forward(&case.problem, Inputs::new(&case.q, &case.k, &case.v))
                .unwrap();
            (o.out, o.lse)
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
    }
}

/// Workspaces are pooled per thread and reused across calls, with the value
/// rows they packed for one head: calls with the same shapes and new data,
/// one after another on one thread, must each see their own data. (One K/V
/// head, so each call starts on the head the previous one ended on.)
#[test]
fn reused_workspaces_forget_the_previous_call() {
    let cpu = Cpu::with_threads(1).unwrap();
    for (seed, causal) in [(1, true), (2, true), (3, false), (4, false)] {
        let mut params = CaseParams::plain(Shape::new(1, 2, 1, 200, 200, 32));
        params.seed = seed;
        if causal {
            params.options = AttnOptions::default().causal();
        }
        let case = Case::build(params);
        assert_eq!(check_case(&cpu, &case), Ok(Outcome::Passed), "seed {seed}");
    }
}
