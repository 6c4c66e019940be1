//! Attention maps against the reference: every backend's maps of a case
//! are compared, entry by entry, with the f64 reference's probabilities
//! (`Reference::forward_with_probs`) under a derived bound; hidden pairs
//! must be exactly 0, and every row must sum to 1 minus the sink's share
//! (the reference's own rows are checked for that too).
//!
//! ## The bound of one entry
//!
//! A backend computes `p = exp(x - lse)` from its scores and the
//! log-sum-exp of its forward call, or `exp(x - max) / sum` as the plain
//! composition does. With `Delta` the row's score error of
//! [`crate::tolerance`] (`gamma(d_qk + 6)` times the row's largest pair
//! magnitude) and `dl = |lse_backend - lse_64|`, the measured error of the
//! log-sum-exp the maps were computed from:
//!
//! - the exponent is off by at most `E = 2 Delta + dl + 3u (|x| + |lse| +
//!   Delta + dl)`: the score's error (twice: a normalising sum or maximum
//!   carries it too), the log-sum-exp's, and the roundings of forming
//!   `x log2(e) - lse log2(e)` (the constant, the product and the fused
//!   add, each `u` relative to a term no larger than `|x|` or `|lse|`);
//! - the exponential adds [`EXP_REL_ERR`] (twice for the plain
//!   composition's numerator and sum), a normalising sum of `n` terms
//!   `gamma(n + 2)`, the division or final rounding `u`;
//!
//! so `|p_backend - p_64| <= p_64 rel + (n + 2) eta + 2^-126`, with `rel =
//! expm1(E) + 2 EXP_REL_ERR + gamma(n + 2) + u`, `eta` half f32's
//! smallest subnormal (an underflowing product) and `2^-126` (f32's
//! smallest normal) for a fast exponential that flushes results under
//! it to zero (attn-cpu's `exp2` does, and documents it: the relative
//! bound holds only for results of at least `2^-126`). Averaged heads: the mean of the
//! heads' bounds, plus `gamma(heads + 1)` relative for the f32 sum and the
//! division by the head count.

use crate::case::{Case, Numbers};
use crate::check::Outcome;
use crate::rng::Rng;
use crate::tolerance::{half_subnormal, pair_magnitude, EXP_REL_ERR};
use crate::CaseParams;
use attn_spec::reference::score;
use attn_spec::{
    AttentionMaps, AttnError, AttnOptions, DType, HostData, Inputs, MapRequest, Reference, Shape,
};

const U: f64 = f32::EPSILON as f64 / 2.0;

/// f32's smallest normal number: a fast exponential may flush results
/// below it to zero.
const FLUSH: f64 = f32::MIN_POSITIVE as f64;

fn gamma(n: usize) -> f64 {
    let nu = n as f64 * U;
    nu / (1.0 - nu)
}

/// A map request drawn from the case's seed: all of it, a few heads of
/// the last batch entry over some rows, or the heads (all or some)
/// averaged.
pub fn request_for(case: &Case) -> MapRequest {
    let s = case.problem.shape;
    let mut rng = Rng::new(case.params.seed ^ 0x6d61_7073);
    let mut rows = || {
        let a = rng.upto(s.q_len);
        let b = rng.upto(s.q_len);
        a.min(b)..a.max(b)
    };
    let r = rows();
    let mut rng = Rng::new(case.params.seed ^ 0x6865_6164);
    let mut some_heads = || -> Vec<usize> {
        (0..1 + rng.upto(2))
            .map(|_| rng.upto(s.q_heads - 1))
            .collect()
    };
    match case.params.seed % 4 {
        0 => MapRequest::all(),
        1 => MapRequest::all()
            .batches([s.batch - 1])
            .heads(some_heads())
            .rows(r),
        2 => MapRequest::all().averaged().rows(r),
        _ => MapRequest::all().heads(some_heads()).averaged(),
    }
}

/// Uploads the case, runs the forward (with the log-sum-exp) and the maps
/// of `request` from it; returns the maps and the forward's log-sum-exp,
/// downloaded. `own_lse`: let `maps` run its own forward instead.
pub fn run_maps<B: AttentionMaps>(
    backend: &B,
    case: &Case,
    request: &MapRequest,
    own_lse: bool,
) -> Result<(HostData, HostData), AttnError> {
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
    let mut p = case.problem.clone();
    p.options.return_lse = true;
    let fwd = backend.forward(&p, inputs)?;
    let lse = fwd.lse.ok_or(AttnError::Missing {
        tensor: "lse",
        what: "the forward returned no log-sum-exp",
    })?;
    let given = (!own_lse).then_some(&lse);
    let maps = backend.maps(&case.problem, inputs, given, request)?;
    Ok((backend.download(&maps.probs)?, backend.download(&lse)?))
}

/// Runs `request` of `case` on `backend` and checks the maps against the
/// reference.
pub fn check_maps<B: AttentionMaps>(
    backend: &B,
    case: &Case,
    request: &MapRequest,
) -> Result<Outcome, String> {
    let ctx = |e: String| {
        format!(
            "{} maps {request:?} on case [{}]: {e}",
            backend.name(),
            case.describe()
        )
    };
    match backend.supports(&case.problem) {
        Ok(()) => {}
        Err(AttnError::Unsupported {
            feature, reason, ..
        }) => return Ok(Outcome::Skipped(format!("{feature}: {reason}"))),
        Err(e) => return Err(ctx(format!("supports() failed: {e}"))),
    }
    let (maps, lse) =
        run_maps(backend, case, request, false).map_err(|e| ctx(format!("failed: {e}")))?;
    check_against_reference(case, request, &maps, &lse).map_err(ctx)?;
    Ok(Outcome::Passed)
}

/// Checks maps `got` of `request` (computed from the log-sum-exp `lse`)
/// against the f64 reference.
pub fn check_against_reference(
    case: &Case,
    request: &MapRequest,
    got: &HostData,
    lse: &HostData,
) -> Result<(), String> {
    let p = &case.problem;
    let s = p.shape;
    let layout = request.resolve(p).map_err(|e| e.to_string())?;
    let HostData::F32(got) = got else {
        return Err(format!("maps are {}, expected f32", got.dtype()));
    };
    if got.len() != layout.len() {
        return Err(format!(
            "maps have {} elements, expected {} ({:?})",
            got.len(),
            layout.len(),
            layout.dims()
        ));
    }
    let mut pl = p.clone();
    pl.options.return_lse = true;
    let r = Reference
        .forward_with_probs(&pl, case.inputs())
        .map_err(|e| format!("the reference failed: {e}"))?;
    let probs = r.probs.expect("asked for");
    let scale = p.scale_exact();
    let eta = half_subnormal(DType::F32);
    let nan_open = case.params.numbers == Numbers::NanExcluded;
    let kl = s.kv_len;
    let planes: Vec<Vec<usize>> = if layout.averaged {
        vec![layout.heads.clone()]
    } else {
        layout.heads.iter().map(|&h| vec![h]).collect()
    };
    for (bi, &b) in layout.batches.iter().enumerate() {
        let m = p.seq_mask(b);
        for (pi, hs) in planes.iter().enumerate() {
            for (ri, i) in layout.rows.clone().enumerate() {
                let at = layout.row_start(bi, pi, ri);
                let g = &got[at..at + kl];
                let mut want = vec![0.0f64; kl];
                let mut bound = vec![0.0f64; kl];
                let mut shown = vec![false; kl];
                let mut sum_want = 0.0;
                for &h in hs {
                    let row = (b * s.q_heads + h) * s.q_len + i;
                    let (l, lb) = (r.lse[row], lse.get(row));
                    let vis: Vec<usize> = m
                        .kv_range(i)
                        .filter(|&j| score(p, &case.inputs(), (b, h, i, j), scale).is_some())
                        .collect();
                    let n = m.kv_range(i).len() + 1;
                    let mag = m
                        .kv_range(i)
                        .map(|j| pair_magnitude(case, &m, (b, h, i, j)))
                        .fold(0.0, f64::max);
                    let delta = gamma(s.head_dim_qk + 6) * mag;
                    let dl = if l.is_finite() { (lb - l).abs() } else { 0.0 };
                    // The reference's row sums to 1 minus the sink's share.
                    let share = match (&p.options.sinks, l.is_finite()) {
                        (Some(sk), true) => (f64::from(sk[h]) - l).exp(),
                        _ => 0.0,
                    };
                    let base = ((b * s.q_heads + h) * s.q_len + i) * kl;
                    let pr = &probs[base..base + kl];
                    let rsum: f64 = pr.iter().sum();
                    let target = if l == f64::NEG_INFINITY {
                        0.0
                    } else {
                        1.0 - share
                    };
                    if l.is_finite() && (rsum - target).abs() > (n + 4) as f64 * f64::EPSILON {
                        return Err(format!(
                            "the reference's row (batch {b} head {h} row {i}) sums to {rsum}, \
                             not 1 - sink share = {target}"
                        ));
                    }
                    sum_want += target;
                    for &j in &vis {
                        let pj = pr[j];
                        let x = l + pj.ln();
                        let e = 2.0 * delta + dl + 3.0 * U * (x.abs() + l.abs() + delta + dl);
                        let rel = e.exp_m1() + 2.0 * EXP_REL_ERR + gamma(n + 2) + U;
                        want[j] += pj;
                        bound[j] +=
                            if pj == 0.0 { 0.0 } else { pj * rel } + (n + 2) as f64 * eta + FLUSH;
                        shown[j] = true;
                    }
                }
                let nh = hs.len() as f64;
                let where_ = |j: usize| {
                    format!(
                        "batch {b} heads {hs:?} row {i} key {j} (map index {})",
                        at + j
                    )
                };
                let row_nan_ok = nan_open && g.iter().zip(&shown).any(|(x, &sh)| sh && x.is_nan());
                let mut got_sum = 0.0f64;
                let mut bound_sum = 0.0f64;
                for j in 0..kl {
                    let gj = f64::from(g[j]);
                    if !shown[j] {
                        if gj != 0.0 {
                            return Err(format!(
                                "{}: a hidden pair must be exactly 0, got {gj}",
                                where_(j)
                            ));
                        }
                        continue;
                    }
                    let w = want[j] / nh;
                    let mut bd = bound[j] / nh;
                    if layout.averaged {
                        bd += gamma(hs.len() + 1) * w;
                    }
                    if w.is_nan() {
                        if !gj.is_nan() {
                            return Err(format!("{}: NaN must propagate, got {gj}", where_(j)));
                        }
                        continue;
                    }
                    if row_nan_ok {
                        continue;
                    }
                    let err = (gj - w).abs();
                    if err.partial_cmp(&bd).is_none_or(|o| o.is_gt()) {
                        return Err(format!(
                            "{}: got {gj:e}, reference {w:e}: error {err:e} exceeds the bound {bd:e}",
                            where_(j)
                        ));
                    }
                    got_sum += gj;
                    bound_sum += bd;
                }
                let target = sum_want / nh;
                let any_nan = want.iter().any(|x| x.is_nan());
                if !any_nan && !row_nan_ok {
                    let slack = bound_sum + (kl + 4) as f64 * f64::EPSILON * (1.0 + target);
                    if (got_sum - target).abs() > slack {
                        return Err(format!(
                            "batch {b} heads {hs:?} row {i}: the row sums to {got_sum}, not 1 - \
                             sink share = {target} (within {slack:e})"
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

fn f32s(v: &[f32]) -> HostData {
    HostData::F32(v.to_vec())
}

/// Hand cases with closed-form maps, the `lse`-free path and bad input:
///
/// - zero queries under a bottom-right causal mask with more queries
///   than keys: every score is 0, so row `i` is uniform over its visible
///   keys (`1 / count`, within the exponential's error and a few
///   roundings of `ln(count)` stored in f32), the rows that see nothing
///   are 0, hidden pairs exactly 0;
/// - one key and a sink of the same score: the key gets 1/2 (within the
///   same error);
/// - maps computed with the backend's own forward equal, bit for bit,
///   the maps from the log-sum-exp the caller passes;
/// - a request over budget, an out-of-range head, a log-sum-exp of the
///   wrong type and a map buffer of the wrong length are typed errors.
pub fn hand<B: AttentionMaps>(backend: &B) -> Result<(), String> {
    let name = backend.name();
    let fail = |what: &str, e: String| format!("{name}: maps hand case `{what}`: {e}");
    // 5 queries, 3 keys, causal bottom-right: row i sees keys 0..=i-2.
    let (sq, sk, d) = (5, 3, 4);
    let mut c = Case::build(CaseParams::plain(Shape::new(1, 2, 1, sq, sk, d)));
    c.q = f32s(&vec![0.0; sq * 2 * d]);
    c.problem.options = AttnOptions::default().causal();
    let req = MapRequest::all();
    let (maps, _) =
        run_maps(backend, &c, &req, false).map_err(|e| fail("uniform", e.to_string()))?;
    for h in 0..2 {
        for i in 0..sq {
            for j in 0..sk {
                let seen = (i + 1).saturating_sub(sq - sk);
                let want = if j < seen { 1.0 / seen as f64 } else { 0.0 };
                let got = maps.get((h * sq + i) * sk + j);
                let tol = want * (EXP_REL_ERR + 8.0 * U);
                if (got - want).abs() > tol {
                    return Err(fail(
                        "uniform",
                        format!("head {h} row {i} key {j}: got {got}, expected {want}"),
                    ));
                }
            }
        }
    }
    // The lse-free path gives the same bits.
    let (own, _) = run_maps(backend, &c, &req, true).map_err(|e| fail("own lse", e.to_string()))?;
    if own != maps {
        return Err(fail(
            "own lse",
            "maps from the backend's own forward differ from maps from the given lse".into(),
        ));
    }
    // A sink equal to the only key's score: exactly half each.
    let mut c = Case::build(CaseParams::plain(Shape::new(1, 1, 1, 1, 1, 1)));
    c.q = f32s(&[1.0]);
    c.k = f32s(&[0.0]);
    c.problem.options = AttnOptions::default().sinks(vec![0.0]);
    let (maps, _) = run_maps(backend, &c, &req, false).map_err(|e| fail("sink", e.to_string()))?;
    if (maps.get(0) - 0.5).abs() > 0.5 * (EXP_REL_ERR + 8.0 * U) {
        return Err(fail("sink", format!("got {}, expected 0.5", maps.get(0))));
    }
    errors(backend).map_err(|e| fail("errors", e))
}

/// Bad map requests and buffers are typed errors naming what was wrong.
pub fn errors<B: AttentionMaps>(backend: &B) -> Result<(), String> {
    let c = Case::build(CaseParams::plain(Shape::new(1, 2, 1, 4, 6, 8)));
    let up = |d: &HostData| backend.upload(d).map_err(|e| e.to_string());
    let (q, k, v) = (up(&c.q)?, up(&c.k)?, up(&c.v)?);
    let inputs = Inputs::new(&q, &k, &v);
    let p = &c.problem;
    let expect = |what: &str, r: attn_spec::Result<()>, ok: &dyn Fn(&AttnError) -> bool| match r {
        Err(e) if ok(&e) => Ok(()),
        other => Err(format!("{what}: expected a typed error, got {other:?}")),
    };
    let r = backend
        .maps(
            p,
            inputs,
            None,
            &MapRequest::all().with_budget(4 * 2 * 4 * 6 - 1),
        )
        .map(|_| ());
    expect("over budget", r, &|e| {
        matches!(e, AttnError::OverBudget { needed: 192, .. })
    })?;
    let r = backend
        .maps(p, inputs, None, &MapRequest::all().heads([2]))
        .map(|_| ());
    expect("head 2 of 2", r, &|e| {
        matches!(
            e,
            AttnError::OutOfRange {
                index: 2,
                len: 2,
                ..
            }
        )
    })?;
    let layout = MapRequest::all().resolve(p).map_err(|e| e.to_string())?;
    let bad_lse = up(&HostData::Bf16(vec![attn_spec::bf16::ZERO; 8]))?;
    let mut m = backend
        .zeros(DType::F32, layout.len())
        .map_err(|e| e.to_string())?;
    let r = backend.maps_into(p, inputs, &bad_lse, &layout, &mut m);
    expect("bf16 lse", r, &|e| {
        matches!(e, AttnError::DType { tensor: "lse", .. })
    })?;
    let lse = up(&HostData::F32(vec![0.0; 8]))?;
    let mut short = backend
        .zeros(DType::F32, layout.len() - 1)
        .map_err(|e| e.to_string())?;
    let r = backend.maps_into(p, inputs, &lse, &layout, &mut short);
    expect("short map buffer", r, &|e| {
        matches!(e, AttnError::Shape { tensor: "maps", .. })
    })?;
    Ok(())
}

/// The hand cases and bad input, then the maps of the hand-made shapes
/// that generated cases rarely reach (decode with many keys, GQA).
pub fn all<B: AttentionMaps>(backend: &B) -> Result<(), String> {
    hand(backend)?;
    for case in crate::hand::split_kv_cases().into_iter().step_by(3) {
        for request in [
            MapRequest::all(),
            MapRequest::all().averaged(),
            MapRequest::all()
                .batches([case.problem.shape.batch - 1])
                .heads([7, 2]),
        ] {
            if let Outcome::Skipped(why) = check_maps(backend, &case, &request)? {
                return Err(format!(
                    "{}: skipped {}: {why}",
                    backend.name(),
                    case.describe()
                ));
            }
        }
    }
    Ok(())
}
