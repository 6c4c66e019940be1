//! The two microkernels of the decode path: `R <= 4` query rows (one
//! position times a GQA group) against a tile of keys, with the *head
//! dimension* along the SIMD lanes.
//!
//! Rows on the lanes would fill `R` of 16 lanes; keys on the lanes need
//! the key tile transposed first (16 x 16 register transposes, about as
//! many shuffles as the scores have FMAs at `R = 4`). Here a key row is
//! loaded as it lies in memory and multiplied into `R` accumulators of
//! partial sums; sixteen keys' accumulators then collapse into sixteen
//! scores with one transpose-and-add tree (`simd::reduce16`). The output
//! update `O = alpha O + P V` reads the value rows as they lie, too, with
//! each probability broadcast. No work is done for rows that do not exist.

use crate::blocking::LANES;
use crate::element::CpuElement;
use crate::pack::RowStream;
use crate::simd::{load, reduce16, store, V};
use std::mem::MaybeUninit;

/// Keys whose dot products run together: `R x G` accumulators (16 at
/// most of AVX-512's 32 vector registers, at least 8 independent FMA
/// chains to cover a 4-cycle latency on two pipes). Without AVX-512 a
/// vector is two or four registers and the accumulators spill: correct,
/// slower, like the rest of a build without `-C target-cpu=native`.
const fn group(r: usize) -> usize {
    match r {
        1 => 16,
        2 => 8,
        _ => 4,
    }
}

/// `s[r * ss + j] = sum_{e < d} q[r * qs + e] * k[j * ks + e]` for `r < R`,
/// `j < n`. Query rows are zero-padded: `qs` is `d` rounded up to 16 and
/// the padding holds zeros. Scores for `n <= j < n` rounded up to 16 are
/// written with unspecified values (the caller masks them); `ss` must be a
/// multiple of 16 and `s` hold `R` rows of `ss >= n` rounded up to 16.
/// Row `j` of `ahead` is prefetched alongside key `j`.
pub fn scores<E: CpuElement, const R: usize>(
    q: &[f32],
    qs: usize,
    (k, ks): (&[E], usize),
    n: usize,
    d: usize,
    (s, ss): (&mut [f32], usize),
    ahead: RowStream,
) {
    let n16 = n.div_ceil(LANES) * LANES;
    assert!(
        (1..=4).contains(&R)
            && qs >= d.div_ceil(LANES) * LANES
            && q.len() >= R * qs
            && ss >= n16
            && ss % LANES == 0
            && s.len() >= (R - 1) * ss + n16
            && (n == 0 || k.len() >= (n - 1) * ks + d)
    );
    match group(R) {
        16 => tile::<E, R, 16>(q, qs, (k, ks), n, d, (s, ss), ahead),
        8 => tile::<E, R, 8>(q, qs, (k, ks), n, d, (s, ss), ahead),
        _ => tile::<E, R, 4>(q, qs, (k, ks), n, d, (s, ss), ahead),
    }
}

/// [`scores`] with `G` keys per group (`G` divides 16).
#[inline(always)]
fn tile<E: CpuElement, const R: usize, const G: usize>(
    q: &[f32],
    qs: usize,
    (k, ks): (&[E], usize),
    n: usize,
    d: usize,
    (s, ss): (&mut [f32], usize),
    ahead: RowStream,
) {
    let full = d / LANES * LANES;
    let mut jb = 0;
    while jb < n {
        // Every entry is written below before `reduce16` reads it; left
        // uninitialised because zeroing 4 KiB per 16 keys showed up as 5%
        // of the decode profile.
        let mut part = [[MaybeUninit::<V>::uninit(); LANES]; R];
        for g0 in (0..LANES).step_by(G) {
            // Keys past `n` repeat the last key: always readable, and
            // their scores are discarded by the caller.
            let rows: [*const E; G] =
                std::array::from_fn(|i| k[(jb + g0 + i).min(n - 1) * ks..].as_ptr());
            for i in 0..G.min(n.saturating_sub(jb + g0)) {
                ahead.row(jb + g0 + i);
            }
            let mut acc = [[V::ZERO; G]; R];
            let mut e = 0;
            while e < full {
                // SAFETY: every key row has d >= e + 16 elements (asserted
                // in `scores`); query rows have qs >= e + 16.
                let kv: [V; G] = std::array::from_fn(|i| unsafe { E::load16(rows[i].add(e)) });
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    // SAFETY: as above.
                    let qv = unsafe { load(q.as_ptr().add(r * qs + e)) };
                    for (a, &x) in acc_r.iter_mut().zip(&kv) {
                        *a = qv.mul_add(x, *a);
                    }
                }
                e += LANES;
            }
            if full < d {
                // The last d - full dims: key tails copied into zeroed
                // vectors (the query padding is zero too).
                let kv: [V; G] = std::array::from_fn(|i| {
                    let j = (jb + g0 + i).min(n - 1);
                    let mut t = [0.0f32; LANES];
                    for (x, &y) in t.iter_mut().zip(&k[j * ks + full..j * ks + d]) {
                        *x = y.to_f32();
                    }
                    V::from(t)
                });
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    // SAFETY: qs >= full + 16 (asserted in `scores`).
                    let qv = unsafe { load(q.as_ptr().add(r * qs + full)) };
                    for (a, &x) in acc_r.iter_mut().zip(&kv) {
                        *a = qv.mul_add(x, *a);
                    }
                }
            }
            for (p, a) in part.iter_mut().zip(&acc) {
                for (x, &y) in p[g0..g0 + G].iter_mut().zip(a) {
                    x.write(y);
                }
            }
        }
        for (r, p) in part.iter().enumerate() {
            // SAFETY: the groups g0 = 0, G, .. cover all 16 entries of every
            // row of `part`, each written above.
            let p: [V; LANES] = std::array::from_fn(|i| unsafe { p[i].assume_init() });
            // SAFETY: r * ss + jb + 16 <= (R - 1) * ss + n16 <= s.len().
            unsafe { store(s.as_mut_ptr().add(r * ss + jb), reduce16(&p)) };
        }
        jb += LANES;
    }
}

/// `o[r * dv + c] = alpha[r] * o[r * dv + c] + sum_{j < n} p[r * ps + j] *
/// v[j * vs + c]` for `r < R`, `c < dv`. Row `j` of `ahead` is
/// prefetched alongside value row `j`.
pub fn accumulate<E: CpuElement, const R: usize>(
    (p, ps): (&[f32], usize),
    (v, vs): (&[E], usize),
    n: usize,
    dv: usize,
    alpha: &[f32; R],
    o: &mut [f32],
    mut ahead: RowStream,
) {
    assert!(
        (1..=4).contains(&R)
            && o.len() >= R * dv
            && p.len() >= (R - 1) * ps + n
            && (n == 0 || v.len() >= (n - 1) * vs + dv)
    );
    let mut c0 = 0;
    if R <= 2 {
        while c0 + 8 * LANES <= dv {
            columns::<E, R, 8>((p, ps), (v, vs), n, dv, alpha, o, c0, ahead);
            ahead = RowStream::NONE;
            c0 += 8 * LANES;
        }
    }
    while c0 + 4 * LANES <= dv {
        columns::<E, R, 4>((p, ps), (v, vs), n, dv, alpha, o, c0, ahead);
        ahead = RowStream::NONE;
        c0 += 4 * LANES;
    }
    while c0 + LANES <= dv {
        columns::<E, R, 1>((p, ps), (v, vs), n, dv, alpha, o, c0, ahead);
        ahead = RowStream::NONE;
        c0 += LANES;
    }
    for j in 0..n {
        ahead.row(j);
    }
    for (r, &a) in alpha.iter().enumerate() {
        for c in c0..dv {
            let mut x = o[r * dv + c] * a;
            for j in 0..n {
                x = p[r * ps + j].mul_add(v[j * vs + c].to_f32(), x);
            }
            o[r * dv + c] = x;
        }
    }
}

/// [`accumulate`] for the `CV` vectors of columns from `c0`: `R x CV`
/// accumulators over all `n` keys, prefetching row `j` of `ahead` with
/// value row `j`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn columns<E: CpuElement, const R: usize, const CV: usize>(
    (p, ps): (&[f32], usize),
    (v, vs): (&[E], usize),
    n: usize,
    dv: usize,
    alpha: &[f32; R],
    o: &mut [f32],
    c0: usize,
    ahead: RowStream,
) {
    let mut acc: [[V; CV]; R] = std::array::from_fn(|r| {
        std::array::from_fn(|c| {
            // SAFETY: c0 + CV * 16 <= dv: inside row r of o (asserted by
            // `accumulate`).
            let x = unsafe { load(o.as_ptr().add(r * dv + c0 + c * LANES)) };
            x * V::splat(alpha[r])
        })
    });
    for j in 0..n {
        ahead.row(j);
        // SAFETY: value row j has dv >= c0 + CV * 16 elements.
        let x: [V; CV] =
            std::array::from_fn(|c| unsafe { E::load16(v.as_ptr().add(j * vs + c0 + c * LANES)) });
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: r < R, j < n: inside p (asserted by `accumulate`).
            let pj = V::splat(unsafe { *p.get_unchecked(r * ps + j) });
            for (a, &xv) in row.iter_mut().zip(&x) {
                *a = pj.mul_add(xv, *a);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (c, &a) in row.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { store(o.as_mut_ptr().add(r * dv + c0 + c * LANES), a) };
        }
    }
}
