//! The reference backend through the conformance suite, and the evidence
//! that the oracle and the suite are right: agreement with an independent
//! formulation, hand-computed cases, the a-priori bound holding for the
//! low-precision reference, merge_states reproducing a full run, and
//! deliberately broken backends that the suite must reject.

use attn_conformance::check::{compare, reference64, reference_low};
use attn_conformance::tolerance::{row_floors, row_floors_in, Arith};
use attn_conformance::{case_params, check_case, errors, hand, run_suite, Case, Outcome};
use attn_spec::dense::attend_dense;
use attn_spec::reference::RefResult;
use attn_spec::{
    merge_states, AttnOptions, Backend, BufferInfo, DType, HostData, Inputs, MapRequest, MhaConfig,
    MhaWeights, MultiHeadAttention, Problem, Reference, Shape, View,
};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_conformance::cases(256), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn reference_passes_the_suite(params in case_params()) {
        let case = Case::build(params);
        prop_assert_eq!(check_case(&Reference, &case), Ok(Outcome::Passed));
    }

    #[test]
    fn reference_agrees_with_the_dense_formulation(params in case_params()) {
        let case = Case::build(params);
        let r = reference64(&case);
        let d = attend_dense(&case.problem, case.inputs());
        let floors = row_floors_in(&case, &r.lse, Arith::f64());
        // Both directions: each is checked against the other under f64 floors.
        if let Err(e) = compare(&case, &d, &r, None, &floors) {
            return Err(TestCaseError::fail(format!("{}: {e}", case.describe())));
        }
    }

    #[test]
    fn low_precision_reference_meets_the_a_priori_bound(params in case_params()) {
        let case = Case::build(params);
        let r = reference64(&case);
        let low = reference_low(&case);
        let floors = row_floors(&case, &r.lse);
        if let Err(e) = compare(&case, &low, &r, None, &floors) {
            return Err(TestCaseError::fail(format!("{}: {e}", case.describe())));
        }
    }

    #[test]
    fn probabilities_vanish_outside_the_mask_and_sum_to_one(params in case_params()) {
        let case = Case::build(params);
        let p = &case.problem;
        let r = Reference.forward_with_probs(p, case.inputs()).unwrap();
        let probs = r.probs.unwrap();
        let s = p.shape;
        for b in 0..s.batch {
            let m = p.seq_mask(b);
            for h in 0..s.q_heads {
                for i in 0..s.q_len {
                    let row = &probs[((b * s.q_heads + h) * s.q_len + i) * s.kv_len..][..s.kv_len];
                    for (j, &x) in row.iter().enumerate() {
                        prop_assert!(m.visible(i, j) || x == 0.0, "p={x} at invisible ({i},{j})");
                    }
                    let lse = r.lse[(b * s.q_heads + h) * s.q_len + i];
                    if lse.is_finite() {
                        let sink = p.options.sinks.as_ref().map_or(0.0, |v| (f64::from(v[h]) - lse).exp());
                        let total: f64 = row.iter().sum::<f64>() + sink;
                        prop_assert!((total - 1.0).abs() <= 4.0 * (s.kv_len + 2) as f64 * f64::EPSILON, "sum {total}");
                    }
                }
            }
        }
    }
}

#[test]
fn hand_computed_cases_pass_on_the_reference() {
    hand::all(&Reference).unwrap();
}

#[test]
fn bad_input_gives_typed_errors_on_the_reference() {
    errors::all(&Reference).unwrap();
    errors::layer(&Reference).unwrap();
}

/// A backend that computes with the wrong alignment, or drops the sink: the
/// suite must catch each (a check that cannot fail proves nothing).
struct Broken {
    flip_alignment: bool,
}

impl Backend for Broken {
    type Buffer = HostData;
    fn name(&self) -> String {
        "broken".into()
    }
    fn upload(&self, d: &HostData) -> attn_spec::Result<HostData> {
        Ok(d.clone())
    }
    fn download(&self, d: &HostData) -> attn_spec::Result<HostData> {
        Ok(d.clone())
    }
    fn zeros(&self, dt: DType, n: usize) -> attn_spec::Result<HostData> {
        Ok(HostData::zeros(dt, n))
    }
    fn info(&self, d: &HostData) -> BufferInfo {
        Reference.info(d)
    }
    fn supports(&self, _: &Problem) -> attn_spec::Result<()> {
        Ok(())
    }
    fn forward_into(
        &self,
        p: &Problem,
        inputs: Inputs<'_, HostData>,
        out: &mut HostData,
        lse: Option<&mut HostData>,
    ) -> attn_spec::Result<()> {
        let mut p = p.clone();
        if self.flip_alignment {
            p.options.alignment = match p.options.alignment {
                attn_spec::Alignment::BottomRight => attn_spec::Alignment::TopLeft,
                attn_spec::Alignment::TopLeft => attn_spec::Alignment::BottomRight,
            };
        } else {
            p.options.sinks = None;
        }
        Reference.forward_into(&p, inputs, out, lse)
    }
}

/// Maps 2^-16 too large at their largest entry (flip_alignment), or a
/// tiny weight at every hidden pair (otherwise).
impl attn_spec::AttentionMaps for Broken {
    fn maps_into(
        &self,
        p: &Problem,
        inputs: Inputs<'_, HostData>,
        lse: &HostData,
        layout: &attn_spec::MapLayout,
        maps: &mut HostData,
    ) -> attn_spec::Result<()> {
        Reference.maps_into(p, inputs, lse, layout, maps)?;
        let HostData::F32(m) = maps else {
            unreachable!()
        };
        if self.flip_alignment {
            if let Some(x) = m.iter_mut().max_by(|a, b| a.total_cmp(b)) {
                *x *= 1.0 + 2f32.powi(-16);
            }
        } else {
            m.iter_mut().filter(|x| **x == 0.0).for_each(|x| *x = 1e-30);
        }
        Ok(())
    }
}

/// Both broken maps fail the maps suite, and the generated-case check
/// alone (without the hand cases) catches them on a causal case.
#[test]
fn the_maps_check_rejects_broken_maps() {
    let mut params = attn_conformance::CaseParams::plain(Shape::new(2, 4, 2, 40, 50, 32));
    params.options = AttnOptions::default().causal();
    params.seed = 4;
    let case = Case::build(params);
    for flip_alignment in [true, false] {
        let b = Broken { flip_alignment };
        let r = attn_conformance::run_maps_suite(&b, 16);
        assert!(
            r.is_err(),
            "broken maps (flip={flip_alignment}) passed: {r:?}"
        );
        for req in [MapRequest::all(), MapRequest::all().averaged()] {
            let r = attn_conformance::maps::check_maps(&b, &case, &req);
            assert!(
                r.is_err(),
                "broken maps (flip={flip_alignment}) passed {req:?}"
            );
        }
    }
    let r = attn_conformance::maps::check_maps(&Reference, &case, &MapRequest::all());
    assert_eq!(r, Ok(Outcome::Passed));
}

#[test]
fn the_suite_rejects_broken_backends() {
    for flip_alignment in [true, false] {
        let r = run_suite(&Broken { flip_alignment }, 256);
        assert!(
            r.is_err(),
            "broken backend (flip={flip_alignment}) passed: {r:?}"
        );
    }
}

#[test]
fn a_perturbation_just_above_the_bound_is_caught() {
    let mut params = attn_conformance::CaseParams::plain(Shape::new(1, 2, 1, 9, 13, 16));
    params.seed = 7;
    let case = Case::build(params);
    let r = reference64(&case);
    let floors = row_floors(&case, &r.lse);
    let mut bad = r.clone();
    bad.out[5] += 1.01 * floors[0].out.max(floors[1].out);
    assert!(compare(&case, &bad, &r, None, &floors).is_err());
    let mut ok = r.clone();
    ok.out[5] += 0.5 * floors[0].out.min(floors[1].out);
    assert!(compare(&case, &ok, &r, None, &floors).is_ok());
}

/// Splitting the keys in two (by boolean masks), running each part with its
/// log-sum-exp and merging gives the full result: merge_states is exact.
#[test]
fn merge_states_reproduces_the_full_result() {
    let (sq, sk, d) = (5, 11, 8);
    let mut params = attn_conformance::CaseParams::plain(Shape::new(1, 2, 1, sq, sk, d));
    params.seed = 3;
    params.options = AttnOptions::default().causal().with_lse();
    params.sinks = true;
    let full = Case::build(params);
    let run = |keep: &dyn Fn(usize) -> bool, sinks: bool| -> (Vec<f32>, Vec<f32>) {
        let mut p = full.problem.clone();
        if !sinks {
            p.options.sinks = None;
        }
        p.mask = Some(View::contiguous([1, 1, sq, sk]));
        let m = HostData::Bool((0..sq * sk).map(|x| keep(x % sk)).collect());
        let inputs = Inputs::new(&full.q, &full.k, &full.v).with_mask(&m);
        let o = Reference.forward(&p, inputs).unwrap();
        let f = |h: HostData| match h {
            HostData::F32(v) => v,
            _ => unreachable!(),
        };
        (f(o.out), f(o.lse.unwrap()))
    };
    // out is [1, sq, 2, d] and lse [1, 2, sq]: merge row by row.
    let (mut oa, mut la) = run(&|j| j < 4, true);
    let (ob, lb) = run(&|j| j >= 4, false);
    let (of, lf) = run(&|_| true, true);
    for h in 0..2 {
        for i in 0..sq {
            let at = (i * 2 + h) * d;
            let mut o = oa[at..at + d].to_vec();
            let mut l = [la[h * sq + i]];
            merge_states(&mut o, &mut l, &ob[at..at + d], &[lb[h * sq + i]]).unwrap();
            oa[at..at + d].copy_from_slice(&o);
            la[h * sq + i] = l[0];
        }
    }
    let got = RefResult {
        out: oa.iter().map(|&x| f64::from(x)).collect(),
        lse: la.iter().map(|&x| f64::from(x)).collect(),
        probs: None,
    };
    let want = reference64(&full);
    let floors = row_floors(&full, &want.lse);
    compare(&full, &got, &want, None, &floors).unwrap();
    // The full run itself agrees too (sanity of the harness).
    assert_eq!(of.len(), oa.len());
    assert_eq!(lf.len(), la.len());
}

fn identity(n: usize) -> HostData {
    HostData::F32(
        (0..n * n)
            .map(|i| if i % (n + 1) == 0 { 1.0 } else { 0.0 })
            .collect(),
    )
}

/// With identity projections, multi-head attention is attention on the
/// input itself (exactly: identity products are exact), for self- and
/// cross-attention with grouped query heads.
#[test]
fn multi_head_attention_with_identity_weights_is_plain_attention() {
    let (b, sq, sk, hq, hkv, hd) = (2, 3, 5, 4, 2, 4);
    let model = hq * hd;
    let kv_model = hkv * hd;
    let cfg = MhaConfig {
        kv_model_dim: kv_model,
        ..MhaConfig::new(model, hq, hkv)
    };
    let mut wk = vec![0.0f32; kv_model * kv_model];
    for i in 0..kv_model {
        wk[i * kv_model + i] = 1.0;
    }
    let weights = MhaWeights {
        wq: identity(model),
        wk: HostData::F32(wk.clone()),
        wv: HostData::F32(wk),
        wo: identity(model),
        biases: None,
    };
    let layer = MultiHeadAttention::new(Reference, cfg, weights).unwrap();
    let mut rng = attn_conformance::rng::Rng::new(11);
    let mut rand =
        |n: usize| HostData::F32((0..n).map(|_| rng.uniform(-1.0, 1.0) as f32).collect());
    let x = rand(b * sq * model);
    let xkv = rand(b * sk * kv_model);
    let opts = AttnOptions::default().causal();
    let got = layer.forward(&x, b, sq, Some((&xkv, sk)), &opts).unwrap();
    let p = Problem::new(Shape::new(b, hq, hkv, sq, sk, hd), DType::F32).with_options(opts);
    let want = Reference.forward(&p, Inputs::new(&x, &xkv, &xkv)).unwrap();
    assert_eq!(got, want.out);

    // Self-attention needs kv_model_dim == model_dim.
    let cfg = MhaConfig::new(model, hq, hq);
    let layer = MultiHeadAttention::new(
        Reference,
        cfg,
        MhaWeights {
            wq: identity(model),
            wk: identity(model),
            wv: identity(model),
            wo: identity(model),
            biases: None,
        },
    )
    .unwrap();
    let got = layer
        .forward(&x, b, sq, None, &AttnOptions::default())
        .unwrap();
    let p = Problem::new(Shape::new(b, hq, hq, sq, sq, hd), DType::F32);
    let want = Reference.forward(&p, Inputs::new(&x, &x, &x)).unwrap();
    assert_eq!(got, want.out);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_conformance::cases(64), failure_persistence: None, ..ProptestConfig::default() })]

    /// The reference's maps (recomputed from its stored f32 log-sum-exp)
    /// meet the maps check against its own f64 probabilities.
    #[test]
    fn reference_maps_pass_the_maps_check(params in attn_conformance::case_params()) {
        let case = attn_conformance::Case::build(params);
        let req = attn_conformance::maps::request_for(&case);
        let got = attn_conformance::maps::check_maps(&attn_spec::Reference, &case, &req);
        prop_assert_eq!(got, Ok(attn_conformance::Outcome::Passed));
    }
}

#[test]
fn reference_maps_hand_cases() {
    attn_conformance::maps::all(&attn_spec::Reference).unwrap();
}
