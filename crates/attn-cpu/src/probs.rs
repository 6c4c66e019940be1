//! Probabilities of a score tile from the stored log-sum-exp, shared by
//! the backward pass (which recomputes `P` tile by tile) and attention
//! maps: `P_ij = exp(x_ij - lse_i)`, with `x` the score of
//! `docs/SEMANTICS.md` steps 2-5 (scale, soft-cap, ALiBi, bias) and 0
//! wherever the window, the lengths, the boolean mask or a `-inf` bias
//! hides the pair (so a row that sees nothing is all 0).

use crate::blocking::LANES;
use crate::exp::{exp2, tanh};
use crate::microkernel::gemm::gemm;
use crate::simd::{load, store, Vector};
use attn_spec::{HostData, Problem, View};
use std::f32::consts::LOG2_E;

/// What turns raw dot products into probabilities.
#[derive(Clone, Copy)]
pub struct Scores<'a> {
    /// The problem.
    pub p: &'a Problem,
    /// The forward's log-sum-exp `[batch, q_heads, q_len]`.
    pub lse: &'a [f32],
    /// The bias and its view.
    pub bias: Option<(&'a HostData, View)>,
    /// The boolean mask and its view.
    pub mask: Option<(&'a [bool], View)>,
}

/// A tile of dot products: rows `i0..i0 + rows` of query head `h` of
/// batch entry `b`, keys `j0..j0 + n`; row `r` starts at `r * stride` and
/// holds `n.div_ceil(16) * 16` floats.
#[derive(Clone, Copy, Debug)]
pub struct Tile {
    /// Batch entry and query head.
    pub bh: (usize, usize),
    /// First row and rows.
    pub rows: (usize, usize),
    /// First key and keys.
    pub keys: (usize, usize),
    /// Floats between rows.
    pub stride: usize,
}

/// Sets `add[..n]` to the bias of row `(b, h, i)` over keys `j0..j0+n`,
/// `-inf` where the boolean mask is false (0 without either).
pub fn bias_and_mask(
    sc: &Scores<'_>,
    (b, h, i): (usize, usize, usize),
    j0: usize,
    add: &mut [f32],
) {
    add.iter_mut().for_each(|x| *x = 0.0);
    if let Some((bias, view)) = sc.bias {
        let at = |j: usize| view.index([b, h, i, j0 + j]);
        match bias {
            HostData::F32(v) => add.iter_mut().enumerate().for_each(|(j, x)| *x = v[at(j)]),
            HostData::F16(v) => add
                .iter_mut()
                .enumerate()
                .for_each(|(j, x)| *x = v[at(j)].to_f32()),
            HostData::Bf16(v) => add
                .iter_mut()
                .enumerate()
                .for_each(|(j, x)| *x = v[at(j)].to_f32()),
            other => add
                .iter_mut()
                .enumerate()
                .for_each(|(j, x)| *x = other.get(at(j)) as f32),
        }
    }
    if let Some((mask, view)) = sc.mask {
        for (j, x) in add.iter_mut().enumerate() {
            if !mask[view.index([b, h, i, j0 + j])] {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// Lane indices 0..16 as f32.
#[inline(always)]
pub fn iota<V: Vector>() -> V {
    let mut x = [0.0f32; LANES];
    for (l, y) in x.iter_mut().enumerate() {
        *y = l as f32;
    }
    V::from(x)
}

/// Turns the dot products of `t` in `s` into probabilities, in place
/// (every float of the rows' padded width: 0 past the keys). With a
/// soft-cap and `slope` given, also writes `dx/d(q.k) = scale (1 - t^2)`
/// into `slope` (same layout). `add` is scratch of at least `n` floats.
#[inline(always)]
pub fn probabilities<V: Vector>(
    sc: &Scores<'_>,
    t: Tile,
    s: &mut [f32],
    add: &mut [f32],
    mut slope: Option<&mut [f32]>,
) {
    let p = sc.p;
    let sh = p.shape;
    let o = &p.options;
    let (b, h) = t.bh;
    let (j0, n) = t.keys;
    let mask = p.seq_mask(b);
    let nvec = n.div_ceil(LANES);
    let ncols = nvec * LANES;
    let scale = p.scale();
    let cap = o.softcap;
    let slope_h = o.alibi_slopes.as_ref().map(|v| v[h]);
    let per_elem = sc.bias.is_some() || sc.mask.is_some();
    for r in 0..t.rows.1 {
        let i = t.rows.0 + r;
        let srow = &mut s[r * t.stride..r * t.stride + ncols];
        let lse = if i < sh.q_len {
            sc.lse[(b * sh.q_heads + h) * sh.q_len + i]
        } else {
            f32::NEG_INFINITY
        };
        let vis = if i < sh.q_len { mask.kv_range(i) } else { 0..0 };
        let lo = vis.start.max(j0).min(j0 + n) - j0;
        let hi = vis.end.min(j0 + n).max(j0) - j0;
        if lse == f32::NEG_INFINITY || lo >= hi {
            srow.iter_mut().for_each(|x| *x = 0.0);
            continue;
        }
        if per_elem {
            bias_and_mask(sc, (b, h, i), j0, &mut add[..n]);
        }
        let diag = mask.diagonal(i);
        let nl = V::splat(-lse * LOG2_E);
        for c in 0..nvec {
            // SAFETY: c * 16 + 16 <= ncols floats of the row.
            let sv = unsafe { load::<V>(srow.as_ptr().add(c * LANES)) };
            let y = sv * V::splat(scale);
            let mut x = match cap {
                Some(cap) => {
                    let th = tanh(y * V::splat(1.0 / cap));
                    if let Some(sl) = slope.as_deref_mut() {
                        let g = V::splat(scale) * (V::ONE - th * th);
                        let at = r * t.stride + c * LANES;
                        assert!(at + LANES <= sl.len());
                        // SAFETY: in bounds (asserted).
                        unsafe { store(sl.as_mut_ptr().add(at), g) };
                    }
                    th * V::splat(cap)
                }
                None => y,
            };
            if let Some(sl) = slope_h {
                let base = (j0 as i64 + (c * LANES) as i64 - diag) as f32;
                let dist = (iota::<V>() + V::splat(base)).abs();
                x -= V::splat(sl) * dist;
            }
            let (k0, k1) = (c * LANES, c * LANES + LANES);
            let mut a = [0.0f32; LANES];
            if per_elem {
                let m = (n - k0).min(LANES);
                a[..m].copy_from_slice(&add[k0..k0 + m]);
                x += V::from(a);
            }
            let mut pv = exp2(x.mul_add(V::splat(LOG2_E), nl));
            // Hidden pairs are 0 whatever their score (even NaN, or a NaN
            // log-sum-exp): selected after the exponential.
            if lo > k0 || hi < k1 {
                let idx = iota::<V>() + V::splat(k0 as f32);
                pv = idx.select_lt(lo as f32, V::ZERO, pv);
                pv = idx.select_lt(hi as f32, pv, V::ZERO);
            }
            if per_elem {
                pv = V::from(a).select_lt(f32::MIN, V::ZERO, pv);
            }
            // SAFETY: as above.
            unsafe { store(srow.as_mut_ptr().add(c * LANES), pv) };
        }
    }
}

/// The score tile `S = Q K^T` of `t` through the gemm microkernel, then its
/// probabilities in place ([`probabilities`], with `add` and `slope` as
/// there): what the backward pass and attention maps both compute. The
/// product runs on the tile's rows rounded up to a multiple of `V::mr(1)`
/// and its keys rounded up to whole vectors.
///
/// # Safety
/// `q` points at `t.rows.1.next_multiple_of(V::mr(1))` rows of `d` floats,
/// `q_stride` apart; `kt` at `d` rows of `t.stride` floats (K^T, zero past
/// the tile's keys).
#[inline(always)]
pub unsafe fn score_probs<V: Vector>(
    sc: &Scores<'_>,
    t: Tile,
    (q, q_stride, d): (*const f32, usize, usize),
    kt: *const f32,
    s: &mut [f32],
    (add, slope): (&mut [f32], Option<&mut [f32]>),
) {
    let rows = t.rows.1.next_multiple_of(V::mr(1));
    let cols = t.keys.1.next_multiple_of(LANES);
    assert!(cols <= t.stride && s.len() >= rows * t.stride);
    // SAFETY: q and kt as the caller guarantees; s holds `rows` rows of
    // t.stride >= cols floats (asserted); rows is a multiple of mr(1) and
    // cols of 16, as gemm takes them.
    unsafe {
        gemm::<V>(
            (rows, cols, d),
            q,
            (q_stride, 1),
            kt,
            t.stride,
            s.as_mut_ptr(),
            t.stride,
            false,
        )
    };
    probabilities::<V>(sc, t, s, add, slope);
}
