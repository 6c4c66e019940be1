//! attn-cpu through the conformance suite: every option and dtype against
//! the f64 reference, the hand-computed cases, bad input, and bitwise
//! invariance under the thread count.

use attn_conformance::{case_params, check_case, errors, hand, Case, CaseParams, Outcome};
use attn_cpu::{Cpu, Isa};
use attn_spec::{AttnOptions, Backend, DType, Inputs, Shape};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_conformance::cases(512), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cpu_passes_the_suite(params in case_params()) {
        let case = Case::build(params);
        let r = check_case(&Cpu::new(), &case);
        prop_assert_eq!(r, Ok(Outcome::Passed));
    }
}

/// The level this run tests is the one asked for: `ATTN_CPU_ISA` when set
/// to a level this CPU runs (`cargo xtask test` runs this file once per
/// level), else the widest the CPU has; a name that is no level is an
/// error on every call, not a silent fallback.
#[test]
fn runs_the_requested_simd_level() {
    let cpu = Cpu::new();
    let asked = std::env::var("ATTN_CPU_ISA").ok();
    match asked.as_deref().map(str::parse::<Isa>) {
        Some(Ok(want)) => {
            // A level the CPU runs (the opt-in `amx` too), else the cap.
            let got = match want.supported() {
                true => want,
                false => want.min(Isa::detected()),
            };
            assert_eq!(cpu.isa().unwrap(), got)
        }
        Some(Err(_)) => {
            let shape = Shape::new(1, 1, 1, 2, 2, 4);
            let case = Case::build(CaseParams::plain(shape));
            let err = check_case(&cpu, &case).unwrap_err();
            assert!(err.contains("ATTN_CPU_ISA"), "{err}");
            return;
        }
        None => assert_eq!(cpu.isa().unwrap(), Isa::detected()),
    }
    eprintln!("attn-cpu conformance on SIMD level {}", cpu.isa().unwrap());
    // Every level the CPU runs can be chosen per backend; none above it.
    for isa in Isa::ALL {
        assert_eq!(Cpu::new().with_isa(isa).is_ok(), isa.supported(), "{isa}");
    }
}

#[test]
fn hand_computed_cases() {
    hand::all(&Cpu::new()).unwrap();
}

#[test]
fn bad_input_gives_typed_errors() {
    errors::all(&Cpu::new()).unwrap();
    errors::layer(&Cpu::new()).unwrap();
}

/// Long key sequences take the split-KV paths (decode shapes: per head and
/// in lockstep); they must pass the same check, with sinks, windows and
/// per-sequence lengths.
#[test]
fn split_kv_decoding_passes() {
    hand::split_kv(&Cpu::new()).unwrap();
}

/// The output is bitwise identical for 1, 2 and 3 threads, on the prefill
/// path and both split-KV paths, with and without spinning helpers.
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
            let o = cpu.forward(&case.problem, case.inputs()).unwrap();
            (o.out, o.lse)
        };
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(3));
        // Helpers that wait for the next call (`with_spin`) join the
        // second and third calls as they come.
        let spinning = Cpu::with_threads(3)
            .unwrap()
            .with_spin(std::time::Duration::from_secs(1))
            .unwrap();
        for _ in 0..3 {
            let o = spinning.forward(&case.problem, case.inputs()).unwrap();
            assert_eq!(one, (o.out, o.lse));
        }
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

/// An output view with gaps (last-axis stride 2, rows further apart)
/// receives exactly the values of a contiguous output, in f32 and bf16,
/// on the prefill path (16- and 64-row blocks) and the decode path; the
/// gaps stay untouched.
#[test]
fn strided_outputs_get_the_contiguous_values() {
    use attn_spec::View;
    let cpu = Cpu::with_threads(1).unwrap();
    for (shape, dtype) in [
        (Shape::new(1, 4, 2, 70, 90, 24), DType::F32),
        (Shape::new(1, 4, 2, 70, 90, 32), DType::F32),
        (Shape::new(1, 4, 2, 9, 90, 24), DType::Bf16),
        (Shape::new(1, 4, 2, 1, 90, 24), DType::F32),
    ] {
        let mut params = CaseParams::plain(shape);
        params.dtype = dtype;
        params.options = AttnOptions::default().causal().with_lse();
        params.seed = 9;
        let case = Case::build(params);
        let inputs = Inputs::new(&case.q, &case.k, &case.v);
        let dense = cpu.forward(&case.problem, inputs).unwrap();
        let s = shape;
        let mut p = case.problem.clone();
        let d = s.head_dim_v;
        p.out = View {
            dims: [s.batch, s.q_len, s.q_heads, d],
            strides: [
                s.q_len * s.q_heads * 2 * d + 3,
                s.q_heads * 2 * d + 1,
                2 * d,
                2,
            ],
            offset: 1,
        };
        let len = p.out.extent().unwrap() + 1;
        let mut out = cpu.zeros(dtype, len).unwrap();
        let mut lse = cpu
            .zeros(DType::F32, s.batch * s.q_heads * s.q_len)
            .unwrap();
        cpu.forward_into(&p, inputs, &mut out, Some(&mut lse))
            .unwrap();
        let (got, want) = (out.to_f64_vec(), dense.out.to_f64_vec());
        let mut written = vec![false; len];
        for b in 0..s.batch {
            for pos in 0..s.q_len {
                for h in 0..s.q_heads {
                    for c in 0..d {
                        let at = p.out.index([b, pos, h, c]);
                        written[at] = true;
                        let dense_at = case.problem.out.index([b, pos, h, c]);
                        assert_eq!(got[at], want[dense_at], "{dtype:?} ({b}, {pos}, {h}, {c})");
                    }
                }
            }
        }
        assert!(
            got.iter().zip(&written).all(|(&x, &w)| w || x == 0.0),
            "{dtype:?}: a gap was written"
        );
        assert_eq!(Some(lse), dense.lse);
    }
}

/// Key spans too long for a thread's kept value rows make the scheduler
/// run two blocks of a head per pass over the keys (these shapes do: see
/// `schedule::tests::units_pair_long_spans_only`); those passes must pass
/// the same check under causal and sliding-window masks with per-sequence
/// lengths (where the two blocks' spans differ, and the second block is
/// the first to visit some tiles), GQA, ALiBi, bias, soft-cap and sinks,
/// in f32, bf16 and f16, and give the same bits (output and log-sum-exp)
/// for 1 and 2 threads.
#[test]
fn paired_blocks_pass() {
    let cases = [
        (
            Shape::new(1, 4, 4, 512, 2000, 64),
            DType::F32,
            AttnOptions::default().causal(),
        ),
        (
            Shape::new(1, 8, 2, 256, 2000, 64),
            DType::F32,
            AttnOptions::default(),
        ),
        (
            Shape::new(2, 4, 4, 256, 1900, 64),
            DType::Bf16,
            AttnOptions::default()
                .window(Some(700), Some(0))
                .q_lens(vec![256, 200])
                .kv_lens(vec![1900, 1750]),
        ),
        (
            Shape::new(1, 4, 4, 512, 1800, 64),
            DType::F16,
            AttnOptions::default().causal().softcap(30.0),
        ),
    ];
    for (i, (shape, dtype, options)) in cases.into_iter().enumerate() {
        let mut params = CaseParams::plain(shape);
        params.dtype = dtype;
        params.options = options.with_lse();
        params.seed = 11 + i as u64;
        if i == 3 {
            params.alibi = true;
            params.sinks = true;
            params.bias = Some(attn_conformance::case::Bcast {
                per_batch: false,
                per_head: true,
            });
        }
        let case = Case::build(params);
        assert_eq!(
            check_case(&Cpu::with_threads(1).unwrap(), &case),
            Ok(Outcome::Passed),
            "case {i}"
        );
        let run = |threads: usize| {
            let o = Cpu::with_threads(threads)
                .unwrap()
                .forward(&case.problem, case.inputs())
                .unwrap();
            (o.out, o.lse)
        };
        assert_eq!(run(1), run(2), "case {i}: thread counts differ");
    }
}

/// bf16 inputs that `vdpbf16ps` would not compute exactly enough (a
/// subnormal value, a huge key, a tiny query element; attn-cpu's
/// `dot16::fits`) send the passes that meet them back to the f32 kernels,
/// even after some of their key tiles ran on the bf16 path: the results
/// pass the suite's check, and the rows whose passes met the value are
/// bitwise those of the f32 pass (the `avx512` level), while a head
/// without such a value runs on the bf16 path.
#[test]
fn bf16_values_out_of_the_dot_product_range_fall_back() {
    if !Isa::Avx512Bf16.supported() {
        eprintln!("skipped: this CPU has no AVX512_BF16");
        return;
    }
    let dot = Cpu::with_threads(1)
        .unwrap()
        .with_isa(Isa::Avx512Bf16)
        .unwrap();
    let f32_pass = Cpu::with_threads(1).unwrap().with_isa(Isa::Avx512).unwrap();
    let shape = Shape::new(1, 2, 2, 300, 700, 64);
    // (tensor, position, value, rows whose pass meets it): row i sees keys
    // up to 400 + i (causal, bottom-right), so rows 200.. meet key 600 (the
    // first of a pair of value rows; 601 the second), every row key 300 (in
    // a key tile no row's mask cuts: checked beside the score kernels) and
    // rows 250.. key 650 (in the diagonal tile, cut into parts); a query
    // row's pass is its block's.
    let cases = [
        ("v", 600, 1e-39f32, 200..300),
        ("v", 601, 1e-39, 201..300),
        ("k", 300, 2f32.powi(60), 200..300),
        ("k", 650, 2f32.powi(60), 250..300),
        ("q", 290, 1e-30, 256..300),
    ];
    for (tensor, pos, x, met) in cases {
        let mut params = CaseParams::plain(shape);
        params.dtype = DType::Bf16;
        params.options = AttnOptions::default().causal().with_lse();
        params.seed = 5;
        let mut case = Case::build(params);
        let (view, data) = match tensor {
            "q" => (case.problem.q, &mut case.q),
            "k" => (case.problem.k, &mut case.k),
            _ => (case.problem.v, &mut case.v),
        };
        let attn_spec::HostData::Bf16(d) = data else {
            panic!("bf16 case")
        };
        d[view.index([0, pos, 0, 3])] = attn_spec::bf16::from_f32(x);
        assert_eq!(check_case(&dot, &case), Ok(Outcome::Passed), "{tensor}");
        let a = dot.forward(&case.problem, case.inputs()).unwrap().out;
        let b = f32_pass.forward(&case.problem, case.inputs()).unwrap().out;
        let (attn_spec::HostData::Bf16(a), attn_spec::HostData::Bf16(b)) = (a, b) else {
            panic!("bf16 outputs")
        };
        let row = |o: &[attn_spec::bf16], i: usize, h: usize| {
            let at = case.problem.out.index([0, i, h, 0]);
            o[at..at + 64].to_vec()
        };
        for i in met {
            assert_eq!(row(&a, i, 0), row(&b, i, 0), "{tensor}: head 0 row {i}");
        }
        assert!(
            (0..300).any(|i| row(&a, i, 1) != row(&b, i, 1)),
            "{tensor}: head 1 should run on the bf16 path"
        );
    }
}
