//! The differential check: run a case on a backend and compare every row
//! with the f64 reference under the bound of [`crate::tolerance`].

use crate::case::{Case, Numbers};
use crate::tolerance::{row_floors, RowFloor};
use attn_spec::reference::{attend, Precision, RefResult};
use attn_spec::{round_to, AttnError, Backend, HostData, Inputs};

/// How a case ended when it did not fail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The backend's result is within the bound on every row.
    Passed,
    /// The backend refused the case with `Unsupported` (the reason).
    Skipped(String),
}

/// Reads a backend's output and log-sum-exp back into the reference's
/// contiguous layout.
pub fn gather(case: &Case, out: &HostData, lse: Option<&HostData>) -> RefResult {
    let p = &case.problem;
    let s = p.shape;
    let mut o = Vec::with_capacity(s.batch * s.q_len * s.q_heads * s.head_dim_v);
    for b in 0..s.batch {
        for i in 0..s.q_len {
            for h in 0..s.q_heads {
                for d in 0..s.head_dim_v {
                    o.push(out.get(p.out.index([b, i, h, d])));
                }
            }
        }
    }
    let l = lse.map_or_else(Vec::new, |l| l.to_f64_vec());
    RefResult {
        out: o,
        lse: l,
        probs: None,
    }
}

/// The f64 reference of a case.
pub fn reference64(case: &Case) -> RefResult {
    attend(&case.problem, case.inputs(), Precision::F64, false)
}

/// The low-precision reference of a case, its output rounded to the
/// problem's element type and its log-sum-exp to f32, as a backend stores
/// them.
pub fn reference_low(case: &Case) -> RefResult {
    let dt = case.problem.dtype;
    let mut r = attend(&case.problem, case.inputs(), Precision::low(dt), false);
    r.out.iter_mut().for_each(|x| *x = round_to(dt, *x));
    r.lse.iter_mut().for_each(|x| *x = f64::from(*x as f32));
    r
}

/// Compares `got` with `ref64` row by row: fully masked rows must be exactly
/// 0 with log-sum-exp -inf; other rows must satisfy `err(got) <= 2 *
/// err(low) + A` (`low` absent: `err(got) <= A`). Log-sum-exp is compared
/// only when `got.lse` is non-empty. `floors` are the a-priori floors of
/// [`crate::tolerance`], one per row.
pub fn compare(
    case: &Case,
    got: &RefResult,
    ref64: &RefResult,
    low: Option<&RefResult>,
    floors: &[RowFloor],
) -> Result<(), String> {
    let s = case.problem.shape;
    let dv = s.head_dim_v;
    if got.out.len() != ref64.out.len() {
        return Err(format!(
            "output has {} elements, expected {}",
            got.out.len(),
            ref64.out.len()
        ));
    }
    // NaN stored only at excluded positions may or may not reach a row
    // (SEMANTICS §6): such a row is accepted as NaN, never as wrong numbers.
    let nan_open = case.params.numbers == Numbers::NanExcluded;
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            for i in 0..s.q_len {
                let r = (b * s.q_heads + h) * s.q_len + i;
                let o0 = ((b * s.q_len + i) * s.q_heads + h) * dv;
                let row = |x: &RefResult| x.out[o0..o0 + dv].to_vec();
                let (g, want) = (row(got), row(ref64));
                let where_ = || format!("batch {b} head {h} row {i}");
                let got_lse_nan = !got.lse.is_empty() && got.lse[r].is_nan();
                if nan_open && (g.iter().any(|x| x.is_nan()) || got_lse_nan) {
                    continue;
                }
                if want.iter().all(|x| x.is_finite())
                    && ref64.lse[r] != f64::INFINITY
                    && !ref64.lse[r].is_nan()
                {
                    let lse_bad =
                        !got.lse.is_empty() && (got.lse[r].is_nan() || got.lse[r] == f64::INFINITY);
                    if g.iter().any(|x| !x.is_finite()) || lse_bad {
                        return Err(format!(
                            "{}: the reference is finite but the result is not: {:?}, lse {:?}",
                            where_(),
                            &g[..g.len().min(4)],
                            got.lse.get(r)
                        ));
                    }
                }
                if ref64.lse[r] == f64::NEG_INFINITY {
                    if g.iter().any(|&x| x != 0.0) {
                        return Err(format!(
                            "{}: fully masked row must be exactly 0, got {:?}",
                            where_(),
                            &g[..g.len().min(4)]
                        ));
                    }
                    if !got.lse.is_empty() && got.lse[r] != f64::NEG_INFINITY {
                        return Err(format!(
                            "{}: fully masked row must have lse -inf, got {}",
                            where_(),
                            got.lse[r]
                        ));
                    }
                    continue;
                }
                if want.iter().any(|x| x.is_nan()) {
                    // NaN in the inputs this row touches: NaN must propagate.
                    let same = g.iter().zip(&want).all(|(a, w)| a.is_nan() == w.is_nan());
                    let lse_ok = got.lse.is_empty() || got.lse[r].is_nan() == ref64.lse[r].is_nan();
                    if !(same && lse_ok) {
                        return Err(format!(
                            "{}: NaN must propagate: got {:?}",
                            where_(),
                            &g[..g.len().min(4)]
                        ));
                    }
                    continue;
                }
                let err = |x: &[f64]| {
                    x.iter()
                        .zip(&want)
                        .map(|(a, w)| (a - w).abs())
                        .fold(0.0f64, |m, e| if e.is_nan() { f64::NAN } else { m.max(e) })
                };
                let e_got = err(&g);
                let e_low = low.map_or(0.0, |l| err(&row(l)));
                let bound = 2.0 * e_low + floors[r].out;
                if !within(e_got, bound) {
                    return Err(format!(
                        "{}: max |out - ref64| = {e_got:e} exceeds 2 * {e_low:e} (low-precision reference) + {:e} (a-priori floor)",
                        where_(),
                        floors[r].out
                    ));
                }
                if !got.lse.is_empty() {
                    let e = (got.lse[r] - ref64.lse[r]).abs();
                    let e_low = low.map_or(0.0, |l| (l.lse[r] - ref64.lse[r]).abs());
                    let bound = 2.0 * e_low + floors[r].lse;
                    if !within(e, bound) {
                        return Err(format!(
                            "{}: lse {} vs reference {}: error {e:e} exceeds {bound:e}",
                            where_(),
                            got.lse[r],
                            ref64.lse[r]
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// `err <= bound`, false when `err` is NaN (a NaN result never passes).
fn within(err: f64, bound: f64) -> bool {
    err.partial_cmp(&bound).is_some_and(|o| o.is_le())
}

/// Uploads `case`'s tensors to `backend`, runs `forward` and downloads the
/// output and the log-sum-exp (when returned).
pub fn run_forward<B: Backend>(
    backend: &B,
    case: &Case,
) -> Result<(HostData, Option<HostData>), AttnError> {
    let up = |d: &HostData| backend.upload(d);
    let (q, k, v) = (up(&case.q)?, up(&case.k)?, up(&case.v)?);
    let bias = case.bias.as_ref().map(up).transpose()?;
    let mask = case.mask.as_ref().map(up).transpose()?;
    let inputs = Inputs {
        q: &q,
        k: &k,
        v: &v,
        bias: bias.as_ref(),
        mask: mask.as_ref(),
    };
    let o = backend.forward(&case.problem, inputs)?;
    let lse = o.lse.as_ref().map(|l| backend.download(l)).transpose()?;
    Ok((backend.download(&o.out)?, lse))
}

/// Runs one case on `backend` and checks it against the reference.
pub fn check_case<B: Backend>(backend: &B, case: &Case) -> Result<Outcome, String> {
    let ctx = |e: String| format!("{} on case [{}]: {e}", backend.name(), case.describe());
    match backend.supports(&case.problem) {
        Ok(()) => {}
        Err(AttnError::Unsupported {
            feature, reason, ..
        }) => return Ok(Outcome::Skipped(format!("{feature}: {reason}"))),
        Err(e) => return Err(ctx(format!("supports() failed: {e}"))),
    }
    let (out, lse) = run_forward(backend, case).map_err(|e| ctx(format!("forward failed: {e}")))?;
    if out.dtype() != case.problem.dtype {
        return Err(ctx(format!(
            "output dtype {} but inputs are {}",
            out.dtype(),
            case.problem.dtype
        )));
    }
    if case.problem.options.return_lse != lse.is_some() {
        return Err(ctx("log-sum-exp returned iff asked for: violated".into()));
    }
    check_output(case, &out, lse.as_ref()).map_err(ctx)?;
    Ok(Outcome::Passed)
}

/// Checks an output (and log-sum-exp, when given) that some code other
/// than a [`Backend`] computed for `case`'s problem, e.g. a layer built on
/// a backend, under the same bound as [`check_case`].
pub fn check_output(case: &Case, out: &HostData, lse: Option<&HostData>) -> Result<(), String> {
    let got = gather(case, out, lse);
    let ref64 = reference64(case);
    let low = reference_low(case);
    let floors = row_floors(case, &ref64.lse);
    compare(case, &got, &ref64, Some(&low), &floors)
}
