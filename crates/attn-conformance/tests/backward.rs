//! The backward oracle and the backward suite: the reference's gradients
//! against central finite differences of its own f64 forward, on small
//! random problems with every option; the reference through the backward
//! suite; and a deliberately wrong backward that the suite must reject.

use attn_conformance::backward::{self, check_backward, BackCase};
use attn_conformance::{case_params, Case, CaseParams, Outcome};
use attn_spec::reference::backward::gradients;
use attn_spec::reference::{attend, Precision};
use attn_spec::{
    Backend, Backward, BufferInfo, DType, GradInputs, GradOutputs, HostData, Inputs, Problem,
    Reference, Shape,
};
use proptest::prelude::*;

/// `sum(dO * O)` by the f64 reference: the loss whose gradients
/// `gradients(.., d_out)` returns.
fn loss(case: &Case, d_out: &HostData) -> f64 {
    let p = &case.problem;
    let s = p.shape;
    let r = attend(p, case.inputs(), Precision::F64, false);
    let mut l = 0.0;
    for b in 0..s.batch {
        for i in 0..s.q_len {
            for h in 0..s.q_heads {
                for d in 0..s.head_dim_v {
                    let o = r.out[((b * s.q_len + i) * s.q_heads + h) * s.head_dim_v + d];
                    l += o * d_out.get(p.out.index([b, i, h, d]));
                }
            }
        }
    }
    l
}

/// Small f64 problems with every option the generator draws.
fn small_f64() -> impl Strategy<Value = CaseParams> {
    let shape = (
        1..=2usize,
        1..=2usize,
        1..=2usize,
        0..=6usize,
        0..=7usize,
        1..=5usize,
        1..=4usize,
    )
        .prop_map(|(b, kvh, g, sq, sk, dqk, dv)| {
            Shape::new(b, kvh * g, kvh, sq, sk, dqk).with_head_dim_v(dv)
        });
    (case_params(), shape).prop_map(|(mut p, shape)| {
        p.shape = shape;
        p.dtype = DType::F64;
        p.large_logits = false;
        p.numbers = attn_conformance::case::Numbers::Plain;
        p
    })
}

/// Central differences with step `H`: the truncation error is `H^2 / 6`
/// times the third derivative (scores here are O(1), so third derivatives
/// stay below ~100: < 2e-9) and the rounding error about `eps |L| / H`
/// (|L| < 100: < 3e-9). `FD_TOL` leaves a margin of 100 over both; a wrong
/// gradient formula is off by O(|g|).
const H: f64 = 1e-5;
const FD_TOL: f64 = 1e-6;

fn central(case: &mut Case, d_out: &HostData, get: impl Fn(&mut Case) -> &mut f64) -> f64 {
    let x0 = *get(case);
    *get(case) = x0 + H;
    let up = loss(case, d_out);
    *get(case) = x0 - H;
    let down = loss(case, d_out);
    *get(case) = x0;
    (up - down) / (2.0 * H)
}

fn f64_slot(d: &mut HostData, i: usize) -> &mut f64 {
    match d {
        HostData::F64(v) => &mut v[i],
        _ => unreachable!("the finite-difference problems are f64"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_conformance::cases(96), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn reference_gradients_match_finite_differences(params in small_f64()) {
        let bc = BackCase::build(params);
        let mut case = bc.case.clone();
        let p = case.problem.clone();
        let s = p.shape;
        let g = gradients(&p, case.inputs(), &bc.d_out);
        let check = |what: String, fd: f64, an: f64| -> Result<(), TestCaseError> {
            prop_assert!((fd - an).abs() <= FD_TOL * (1.0 + an.abs()),
                "{what}: finite difference {fd:e}, reference gradient {an:e} ({})", bc.case.describe());
            Ok(())
        };
        let tensors = [
            (0, p.q, s.q_len, s.q_heads, s.head_dim_qk, &g.dq),
            (1, p.k, s.kv_len, s.kv_heads, s.head_dim_qk, &g.dk),
            (2, p.v, s.kv_len, s.kv_heads, s.head_dim_v, &g.dv),
        ];
        for (t, view, len, heads, dim, grad) in tensors {
            for b in 0..s.batch {
                for i in 0..len {
                    for h in 0..heads {
                        for d in 0..dim {
                            let at = view.index([b, i, h, d]);
                            let fd = central(&mut case, &bc.d_out, |c| match t {
                                0 => f64_slot(&mut c.q, at),
                                1 => f64_slot(&mut c.k, at),
                                _ => f64_slot(&mut c.v, at),
                            });
                            let an = grad[((b * len + i) * heads + h) * dim + d];
                            check(format!("tensor {t} [{b},{i},{h},{d}]"), fd, an)?;
                        }
                    }
                }
            }
        }
        if let Some(db) = &g.dbias {
            for (e, &an) in db.iter().enumerate() {
                if case.bias.as_ref().unwrap().get(e).is_finite() {
                    let fd = central(&mut case, &bc.d_out, |c| f64_slot(c.bias.as_mut().unwrap(), e));
                    check(format!("bias[{e}]"), fd, an)?;
                } else {
                    prop_assert_eq!(an, 0.0, "a -inf bias entry gets no gradient");
                }
            }
        }
        if let Some(ds) = &g.dsinks {
            for (h, &an) in ds.iter().enumerate() {
                let x0 = case.problem.options.sinks.as_ref().unwrap()[h];
                // Sinks are f32: step by a representable amount and divide by it.
                let step = 2f32.powi(-12);
                let at = |x: f32, c: &mut Case| {
                    c.problem.options.sinks.as_mut().unwrap()[h] = x;
                    loss(c, &bc.d_out)
                };
                let fd = (at(x0 + step, &mut case) - at(x0 - step, &mut case)) / f64::from(2.0 * step);
                at(x0, &mut case);
                // Step 2^-12: truncation ~ 2^-24 / 6 * |L'''| < 1e-6 (|L'''| < 16).
                prop_assert!((fd - an).abs() <= 2e-6 * (1.0 + an.abs()),
                    "sink {h}: finite difference {fd:e}, reference {an:e}");
            }
        }
    }

    #[test]
    fn reference_passes_the_backward_suite(params in case_params()) {
        let bc = BackCase::build(params);
        prop_assert_eq!(check_backward(&Reference, &bc), Ok(Outcome::Passed));
    }
}

#[test]
fn backward_hand_cases_and_bad_input_on_the_reference() {
    backward::all(&Reference).unwrap();
}

/// A backward that is wrong by one part in 10^4 in dK: the suite rejects it.
struct SlightlyWrong;

impl Backend for SlightlyWrong {
    type Buffer = HostData;
    fn name(&self) -> String {
        "slightly-wrong".into()
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
        Reference.forward_into(p, inputs, out, lse)
    }
}

impl Backward for SlightlyWrong {
    fn backward_into(
        &self,
        p: &Problem,
        inputs: Inputs<'_, HostData>,
        forward: GradInputs<'_, HostData>,
        grads: GradOutputs<'_, HostData>,
    ) -> attn_spec::Result<()> {
        let dk: *mut HostData = grads.dk;
        Reference.backward_into(p, inputs, forward, grads)?;
        // SAFETY: `grads.dk` was a unique borrow that `backward_into` no
        // longer holds.
        let dk = unsafe { &mut *dk };
        for i in 0..dk.len() {
            dk.set(i, dk.get(i) * (1.0 + 1e-4));
        }
        Ok(())
    }
}

#[test]
fn a_slightly_wrong_backward_is_rejected() {
    let bc = BackCase::build(CaseParams::plain(Shape::new(1, 2, 1, 9, 12, 16)));
    let r = check_backward(&SlightlyWrong, &bc);
    assert!(r.as_ref().is_err_and(|e| e.contains("dk")), "{r:?}");
}
