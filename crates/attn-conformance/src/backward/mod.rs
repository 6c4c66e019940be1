//! The backward part of the suite: every backend's gradients against the
//! f64 reference's under the derived bound of [`bound`], on generated cases
//! (the forward suite's generator: every option, dtype and layout), hand
//! cases and bad input.
//!
//! A case's backward inputs are the f64 reference's forward output rounded
//! to the problem's type and its log-sum-exp rounded to f32 (what a backend
//! that computes the forward exactly would store), and a `dO` drawn from
//! the case's seed: the backward is checked on its own, not through the
//! backend's forward error.

pub mod bound;

use crate::case::{Case, CaseParams};
use crate::check::Outcome;
use crate::rng::Rng;
use attn_spec::reference::backward::{gradients, RefGrads};
use attn_spec::reference::{attend, store, Precision};
use attn_spec::{
    round_to, AttnError, AttnOptions, Backward, DType, GradInputs, GradOutputs, GradRequest, Grads,
    HostData, Inputs, MaskKind, Problem, Shape, View,
};

/// A conformance case with its backward inputs.
#[derive(Clone, Debug)]
pub struct BackCase {
    /// The forward case.
    pub case: Case,
    /// The forward output, laid out as `problem.out`, in the problem's type.
    pub out: HostData,
    /// The forward log-sum-exp, f32.
    pub lse: HostData,
    /// `dO`, laid out as `problem.out`.
    pub d_out: HostData,
}

impl BackCase {
    /// Builds the case, its forward results (the f64 reference's, rounded)
    /// and `dO`. Adversarial numbers ([`crate::case::Numbers`]) are the
    /// forward suite's: the backward bound assumes plain data (a score
    /// near f32 overflow has a gradient beyond f32, and §7b does not yet
    /// say where NaN goes), so they are replaced by plain data here.
    pub fn build(mut params: CaseParams) -> BackCase {
        params.numbers = crate::case::Numbers::Plain;
        Self::of(Case::build(params))
    }

    /// [`BackCase::build`] from a built case.
    pub fn of(case: Case) -> BackCase {
        let p = &case.problem;
        let n = p.out.extent().unwrap_or(0);
        let r = attend(p, case.inputs(), Precision::F64, false);
        let mut out = HostData::zeros(p.dtype, n);
        let mut lse = HostData::zeros(DType::F32, p.lse_view().extent().unwrap_or(0));
        store(p, &r, &mut out, Some(&mut lse));
        let mut rng = Rng::new(case.params.seed ^ 0x6a09_e667_f3bc_c908);
        let vals: Vec<f64> = (0..n)
            .map(|_| round_to(p.dtype, rng.uniform(-1.0, 1.0)))
            .collect();
        let d_out = HostData::from_f64(p.dtype, &vals);
        BackCase {
            case,
            out,
            lse,
            d_out,
        }
    }

    /// The forward results as [`GradInputs`].
    pub fn forward(&self) -> GradInputs<'_, HostData> {
        GradInputs {
            out: &self.out,
            lse: Some(&self.lse),
            d_out: &self.d_out,
        }
    }
}

/// The error the forward suite accepts of a backend's output and
/// log-sum-exp on each row of `case` (`[batch, q_heads, q_len]` order):
/// `2 err(low) + A`, as `crate::check::compare` allows. For checking a
/// backward pass that starts from a backend's own forward
/// ([`bound::bounds_given`]).
pub fn forward_errors(case: &Case) -> Vec<(f64, f64)> {
    let r = crate::check::reference64(case);
    let low = crate::check::reference_low(case);
    let floors = crate::tolerance::row_floors(case, &r.lse);
    let s = case.problem.shape;
    let dv = s.head_dim_v;
    let mut v = Vec::with_capacity(floors.len());
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            for i in 0..s.q_len {
                let row = (b * s.q_heads + h) * s.q_len + i;
                let o0 = ((b * s.q_len + i) * s.q_heads + h) * dv;
                let e_out = (0..dv)
                    .map(|d| (low.out[o0 + d] - r.out[o0 + d]).abs())
                    .fold(0.0, f64::max);
                let e_lse = if r.lse[row].is_finite() {
                    (low.lse[row] - r.lse[row]).abs()
                } else {
                    0.0
                };
                v.push((2.0 * e_out + floors[row].out, 2.0 * e_lse + floors[row].lse));
            }
        }
    }
    v
}

/// Reads gradients laid out as the problem says into the reference's
/// contiguous layout.
pub fn gather(p: &Problem, g: &Grads<HostData>) -> RefGrads {
    let s = p.shape;
    let read = |buf: &HostData, view: &View, len: usize, heads: usize, dim: usize| {
        let mut v = Vec::with_capacity(s.batch * len * heads * dim);
        for b in 0..s.batch {
            for i in 0..len {
                for h in 0..heads {
                    for d in 0..dim {
                        v.push(buf.get(view.index([b, i, h, d])));
                    }
                }
            }
        }
        v
    };
    RefGrads {
        dq: read(&g.dq, &p.q, s.q_len, s.q_heads, s.head_dim_qk),
        dk: read(&g.dk, &p.k, s.kv_len, s.kv_heads, s.head_dim_qk),
        dv: read(&g.dv, &p.v, s.kv_len, s.kv_heads, s.head_dim_v),
        dbias: g.dbias.as_ref().map(HostData::to_f64_vec),
        dsinks: g.dsinks.as_ref().map(HostData::to_f64_vec),
    }
}

/// Compares `got` with the reference `want` element by element under
/// `bounds`: `|got - want| <= bound`, NaN never accepted.
pub fn compare(got: &RefGrads, want: &RefGrads, bounds: &RefGrads) -> Result<(), String> {
    let parts = [
        ("dq", Some(&got.dq), Some(&want.dq), Some(&bounds.dq)),
        ("dk", Some(&got.dk), Some(&want.dk), Some(&bounds.dk)),
        ("dv", Some(&got.dv), Some(&want.dv), Some(&bounds.dv)),
        (
            "dbias",
            got.dbias.as_ref(),
            want.dbias.as_ref(),
            bounds.dbias.as_ref(),
        ),
        (
            "dsinks",
            got.dsinks.as_ref(),
            want.dsinks.as_ref(),
            bounds.dsinks.as_ref(),
        ),
    ];
    for (name, g, w, b) in parts {
        let (g, w, b) = match (g, w, b) {
            (Some(g), Some(w), Some(b)) => (g, w, b),
            (None, None, _) => continue,
            _ => return Err(format!("{name}: returned iff asked for: violated")),
        };
        if g.len() != w.len() {
            return Err(format!(
                "{name}: {} elements, expected {}",
                g.len(),
                w.len()
            ));
        }
        for (e, ((&gv, &wv), &bv)) in g.iter().zip(w).zip(b).enumerate() {
            let err = (gv - wv).abs();
            if err.is_nan() || err > bv {
                return Err(format!(
                    "{name}[{e}] (contiguous index) = {gv:e}, reference {wv:e}: error {err:e} exceeds the bound {bv:e}"
                ));
            }
        }
    }
    Ok(())
}

/// Runs `case`'s backward pass on `backend` (every gradient the problem
/// has a tensor for) and checks it against the reference under the bound.
/// An `Unsupported` refusal is a skip.
pub fn check_backward<B: Backward>(backend: &B, bc: &BackCase) -> Result<Outcome, String> {
    let case = &bc.case;
    let p = &case.problem;
    let ctx = |e: String| format!("{}: {e}", case.describe());
    let up = |d: &HostData| backend.upload(d).map_err(|e| ctx(format!("upload: {e}")));
    let (q, k, v) = (up(&case.q)?, up(&case.k)?, up(&case.v)?);
    let bias = case.bias.as_ref().map(up).transpose()?;
    let mask = case.mask.as_ref().map(up).transpose()?;
    let (out, lse, d_out) = (up(&bc.out)?, up(&bc.lse)?, up(&bc.d_out)?);
    let inputs = Inputs {
        q: &q,
        k: &k,
        v: &v,
        bias: bias.as_ref(),
        mask: mask.as_ref(),
    };
    let forward = GradInputs {
        out: &out,
        lse: Some(&lse),
        d_out: &d_out,
    };
    let grads = match backend.backward(p, inputs, forward, GradRequest::all(p)) {
        Ok(g) => g,
        Err(AttnError::Unsupported { reason, .. }) => return Ok(Outcome::Skipped(reason)),
        Err(e) => return Err(ctx(format!("backward failed: {e}"))),
    };
    let down = |b: &B::Buffer| {
        backend
            .download(b)
            .map_err(|e| ctx(format!("download: {e}")))
    };
    let host = Grads {
        dq: down(&grads.dq)?,
        dk: down(&grads.dk)?,
        dv: down(&grads.dv)?,
        dbias: grads.dbias.as_ref().map(down).transpose()?,
        dsinks: grads.dsinks.as_ref().map(down).transpose()?,
    };
    for (name, buf, dt) in [
        ("dq", &host.dq, p.dtype),
        ("dk", &host.dk, p.dtype),
        ("dv", &host.dv, p.dtype),
    ] {
        if buf.dtype() != dt {
            return Err(ctx(format!("{name} is {}, expected {dt}", buf.dtype())));
        }
    }
    let got = gather(p, &host);
    let want = gradients(p, case.inputs(), &bc.d_out);
    let bounds = bound::bounds(case, &want, &bc.out, &bc.d_out);
    compare(&got, &want, &bounds).map_err(ctx)?;
    Ok(Outcome::Passed)
}

fn passes<B: Backward>(backend: &B, name: &str, params: CaseParams) -> Result<(), String> {
    match check_backward(backend, &BackCase::build(params)) {
        Ok(Outcome::Passed) => Ok(()),
        Ok(Outcome::Skipped(why)) => Err(format!("{name}: refused: {why}")),
        Err(e) => Err(format!("{name}: {e}")),
    }
}

/// The hand cases: one key (the output is that key's value, so `dV = dO`
/// and no gradient reaches Q or K), uniform attention (`q = 0`: every
/// probability `1 / n`), fully masked rows (zero gradients, never NaN),
/// soft-cap saturation (logits far beyond the cap: `tanh' = 0`, so Q and
/// K get nothing), and a sink with learnable gradient.
pub fn hand<B: Backward>(backend: &B) -> Result<(), String> {
    let mut one_key = CaseParams::plain(Shape::new(1, 2, 1, 5, 1, 8));
    one_key.seed = 1;
    let bc = BackCase::build(one_key.clone());
    let g = gradients(&bc.case.problem, bc.case.inputs(), &bc.d_out);
    if g.dq.iter().chain(&g.dk).any(|&x| x != 0.0) || g.dv.iter().all(|&x| x == 0.0) {
        return Err("one key: the reference's dQ, dK must be 0 and dV nonzero".into());
    }
    passes(backend, "one key", one_key)?;

    let mut uniform = CaseParams::plain(Shape::new(1, 1, 1, 4, 6, 8));
    uniform.seed = 2;
    let mut bc = BackCase::build(uniform);
    bc.case.q = HostData::zeros(DType::F32, bc.case.q.len());
    let bc = BackCase::of(bc.case);
    let g = gradients(&bc.case.problem, bc.case.inputs(), &bc.d_out);
    // dV_j = sum_i dO_i / 6 for every key j.
    for j in 0..6 {
        for d in 0..8 {
            let want: f64 = (0..4).map(|i| bc.d_out.get(i * 8 + d)).sum::<f64>() / 6.0;
            if (g.dv[j * 8 + d] - want).abs() > 1e-12 {
                return Err(format!("uniform: reference dV[{j}][{d}] != sum dO / 6"));
            }
        }
    }
    expect_pass(backend, "uniform attention", &bc)?;

    let mut masked = CaseParams::plain(Shape::new(2, 2, 1, 6, 9, 16));
    masked.options = AttnOptions {
        mask: MaskKind::Causal,
        alignment: attn_spec::Alignment::TopLeft,
        q_lens: Some(vec![6, 2]),
        kv_lens: Some(vec![0, 4]),
        ..AttnOptions::default()
    };
    masked.seed = 3;
    passes(backend, "fully masked rows", masked)?;

    let mut sat = CaseParams::plain(Shape::new(1, 2, 2, 7, 11, 16));
    sat.options.softcap = Some(5.0);
    sat.large_logits = true;
    sat.seed = 4;
    passes(backend, "soft-cap saturation", sat)?;

    let mut sinks = CaseParams::plain(Shape::new(2, 4, 2, 9, 13, 8));
    sinks.sinks = true;
    sinks.kv_lens = true;
    sinks.seed = 5;
    passes(backend, "sinks", sinks)
}

fn expect_pass<B: Backward>(backend: &B, name: &str, bc: &BackCase) -> Result<(), String> {
    match check_backward(backend, bc) {
        Ok(Outcome::Passed) => Ok(()),
        Ok(Outcome::Skipped(why)) => Err(format!("{name}: refused: {why}")),
        Err(e) => Err(format!("{name}: {e}")),
    }
}

type Expect = fn(&AttnError) -> bool;

/// One bad-input check: its name, problem, forward inputs, request and
/// the error it must give.
type Check<'a, B> = (
    &'static str,
    Problem,
    GradInputs<'a, B>,
    GradRequest,
    Expect,
);

/// Bad input to the backward pass: each gives the typed error that names
/// the tensor.
pub fn errors<B: Backward>(backend: &B) -> Result<(), String> {
    let mut params = CaseParams::plain(Shape::new(2, 4, 2, 5, 7, 8));
    params.sinks = true;
    params.bias = Some(crate::case::Bcast {
        per_batch: false,
        per_head: true,
    });
    let bc = BackCase::build(params);
    let p = &bc.case.problem;
    let up = |d: &HostData| backend.upload(d).map_err(|e| format!("upload: {e}"));
    let (q, k, v) = (up(&bc.case.q)?, up(&bc.case.k)?, up(&bc.case.v)?);
    let bias = up(bc.case.bias.as_ref().expect("a bias"))?;
    let (out, lse, d_out) = (up(&bc.out)?, up(&bc.lse)?, up(&bc.d_out)?);
    let short = up(&HostData::zeros(p.dtype, 3))?;
    let half = up(&HostData::zeros(DType::F16, bc.d_out.len()))?;
    let inputs = Inputs::new(&q, &k, &v).with_bias(&bias);
    let good = GradInputs {
        out: &out,
        lse: Some(&lse),
        d_out: &d_out,
    };
    let all = GradRequest::all(p);
    let mut no_sinks = p.clone();
    no_sinks.options.sinks = None;
    let mut aliasing = p.clone();
    aliasing.q.strides[1] = 0;
    let checks: Vec<Check<'_, B::Buffer>> = vec![
        (
            "no lse",
            p.clone(),
            GradInputs { lse: None, ..good },
            all,
            |e| matches!(e, AttnError::Missing { tensor: "lse", .. }),
        ),
        (
            "d_out too short",
            p.clone(),
            GradInputs {
                d_out: &short,
                ..good
            },
            all,
            |e| {
                matches!(
                    e,
                    AttnError::BufferTooSmall {
                        tensor: "d_out",
                        ..
                    }
                )
            },
        ),
        (
            "d_out of another type",
            p.clone(),
            GradInputs {
                d_out: &half,
                ..good
            },
            all,
            |e| {
                matches!(
                    e,
                    AttnError::DType {
                        tensor: "d_out",
                        ..
                    }
                )
            },
        ),
        (
            "out too short",
            p.clone(),
            GradInputs {
                out: &short,
                ..good
            },
            all,
            |e| matches!(e, AttnError::BufferTooSmall { tensor: "out", .. }),
        ),
        (
            "lse of another type",
            p.clone(),
            GradInputs {
                lse: Some(&half),
                ..good
            },
            all,
            |e| matches!(e, AttnError::DType { tensor: "lse", .. }),
        ),
        ("sinks gradient without sinks", no_sinks, good, all, |e| {
            matches!(
                e,
                AttnError::Missing {
                    tensor: "dsinks",
                    ..
                }
            )
        }),
        ("a dq view that aliases", aliasing, good, all, |e| {
            matches!(e, AttnError::Aliasing { tensor: "dq" })
        }),
    ];
    for (name, problem, fwd, want, expect) in checks {
        match backend.backward(&problem, inputs, fwd, want) {
            Ok(_) => return Err(format!("backward, {name}: accepted bad input")),
            Err(e) if expect(&e) => {}
            Err(e) => return Err(format!("backward, {name}: wrong error: {e:?}")),
        }
    }
    // A gradient buffer of the wrong size, through backward_into.
    let mut dq = up(&HostData::zeros(p.dtype, 3))?;
    let (mut dk, mut dv) = (up(&bc.case.k)?, up(&bc.case.v)?);
    let r = backend.backward_into(
        p,
        inputs,
        good,
        GradOutputs {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
            dbias: None,
            dsinks: None,
        },
    );
    match r {
        Err(AttnError::BufferTooSmall { tensor: "dq", .. }) => Ok(()),
        other => Err(format!("backward, dq too short: wrong result: {other:?}")),
    }
}

/// [`hand`] and [`errors`].
pub fn all<B: Backward>(backend: &B) -> Result<(), String> {
    hand(backend)?;
    errors(backend)
}
