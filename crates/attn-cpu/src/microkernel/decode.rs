//! The two microkernels of the decode path: `R <= 4` query rows (one
//! position times a GQA group) against a tile of keys, with the *head
//! dimension* along the SIMD lanes.
//!
//! Rows on the lanes would fill `R` of 16 lanes; keys on the lanes need
//! the key tile transposed first (16 x 16 register transposes, about as
//! many shuffles as the scores have FMAs at `R = 4`). Here a key row is
//! loaded as it lies in memory and multiplied into `R` accumulators of
//! partial sums; sixteen keys' accumulators then collapse into sixteen
//! scores with one transpose-and-add tree (`simd::reduce16`). Blocks of 3
//! or 4 rows (a GQA group of 4, the common case) at a head dim that is a
//! multiple of 4 use `scores_quad` instead: the rows share each vector, a quarter each, so a key needs one
//! accumulator instead of four and the reduction shrinks fourfold
//! (measured on this project's machine, GQA 32:8, d = 128, alternating
//! runs in one process, 1 thread: 1024 keys, in cache, +9% for f32 and +8%
//! for bf16; 32768 keys, from DRAM, +9% and +3%). The output
//! update `O = alpha O + P V` reads the value rows as they lie, too, with
//! each probability broadcast. No work is done for rows that do not exist.

use crate::blocking::LANES;
use crate::element::CpuElement;
use crate::pack::RowStream;
use crate::simd::{load, store, Vector};
use attn_spec::DType;
use std::mem::MaybeUninit;

/// `s[r * ss + j] = sum_{e < d} q[r * qs + e] * k[j * ks + e]` for `r < R`,
/// `j < n`. Query rows are zero-padded: `qs` is `d` rounded up to 16 and
/// the padding holds zeros. Scores for `n <= j < n` rounded up to 16 are
/// written with unspecified values (the caller masks them); `ss` must be a
/// multiple of 16 and `s` hold `R` rows of `ss >= n` rounded up to 16.
/// Row `j` of `ahead` is prefetched alongside key `j`.
#[inline(always)]
pub fn scores<V: Vector, E: CpuElement, const R: usize>(
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
    const { assert!(R >= 1 && R <= 4 && matches!(V::DECODE_GROUP[R - 1], 1 | 2 | 4 | 8 | 16)) };
    // A constant: only the chosen `G` is compiled.
    match const { V::DECODE_GROUP[R - 1] } {
        16 => tile::<V, E, R, 16>(q, qs, (k, ks), n, d, (s, ss), ahead),
        8 => tile::<V, E, R, 8>(q, qs, (k, ks), n, d, (s, ss), ahead),
        4 => tile::<V, E, R, 4>(q, qs, (k, ks), n, d, (s, ss), ahead),
        2 => tile::<V, E, R, 2>(q, qs, (k, ks), n, d, (s, ss), ahead),
        _ => tile::<V, E, R, 1>(q, qs, (k, ks), n, d, (s, ss), ahead),
    }
}

/// [`scores`] with `G` keys per group (`G` divides 16).
#[inline(always)]
fn tile<V: Vector, E: CpuElement, const R: usize, const G: usize>(
    q: &[f32],
    qs: usize,
    (k, ks): (&[E], usize),
    n: usize,
    d: usize,
    (s, ss): (&mut [f32], usize),
    ahead: RowStream,
) {
    let full = d / LANES * LANES;
    let every = (full / LANES / G).max(1);
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
            // The group's rows of the next tile, one every `every` steps.
            let live = G.min(n.saturating_sub(jb + g0));
            let (mut wait, mut i) = (1, 0);
            let mut acc = [[V::ZERO; G]; R];
            let mut e = 0;
            while e < full {
                wait -= 1;
                if wait == 0 {
                    wait = every;
                    if i < live {
                        ahead.row(jb + g0 + i);
                        i += 1;
                    }
                }
                let mut kv = [V::ZERO; G];
                for (x, &row) in kv.iter_mut().zip(&rows) {
                    // SAFETY: every key row has d >= e + 16 elements
                    // (asserted in `scores`).
                    *x = unsafe { E::load16::<V>(row.add(e)) };
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    // SAFETY: query rows have qs >= e + 16 (asserted).
                    let qv = unsafe { load::<V>(q.as_ptr().add(r * qs + e)) };
                    for (a, &x) in acc_r.iter_mut().zip(&kv) {
                        *a = qv.mul_add(x, *a);
                    }
                }
                e += LANES;
            }
            for i in i..live {
                ahead.row(jb + g0 + i);
            }
            if full < d {
                // The last d - full dims: key tails copied into zeroed
                // vectors (the query padding is zero too).
                let mut kv = [V::ZERO; G];
                for (i, kx) in kv.iter_mut().enumerate() {
                    let j = (jb + g0 + i).min(n - 1);
                    let mut t = [0.0f32; LANES];
                    for (x, &y) in t.iter_mut().zip(&k[j * ks + full..j * ks + d]) {
                        *x = y.to_f32();
                    }
                    *kx = V::from(t);
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    // SAFETY: qs >= full + 16 (asserted in `scores`).
                    let qv = unsafe { load::<V>(q.as_ptr().add(r * qs + full)) };
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
            let mut v = [V::ZERO; LANES];
            for (x, y) in v.iter_mut().zip(p) {
                // SAFETY: the groups g0 = 0, G, .. cover all 16 entries of
                // every row of `part`, each written above.
                *x = unsafe { y.assume_init() };
            }
            // SAFETY: r * ss + jb + 16 <= (R - 1) * ss + n16 <= s.len().
            unsafe { store(s.as_mut_ptr().add(r * ss + jb), V::reduce16(&v)) };
        }
        jb += LANES;
    }
}

/// Whether [`scores_quad`] takes a block of `r` rows at head dimension
/// `d`: 3 or 4 rows (fewer would leave half of every vector idle) and `d` a
/// multiple of 4, on a level where it pays (`Vector::QUAD`).
pub fn quad_ok<V: Vector>(r: usize, d: usize) -> bool {
    V::QUAD && (3..=4).contains(&r) && d > 0 && d.is_multiple_of(4)
}

/// The query rows `q` (`rows` rows of `d` floats, `qs` apart) laid out for
/// [`scores_quad`]: vector `e / 4` holds dims `e..e+4` of every row, row `r`
/// in lanes `4r..4r+4`, zeros for rows past `rows`.
pub fn quad_queries(q: &[f32], qs: usize, rows: usize, d: usize) -> Vec<f32> {
    assert!(
        (3..=4).contains(&rows) && d > 0 && d.is_multiple_of(4) && q.len() >= (rows - 1) * qs + d
    );
    let mut q4 = vec![0.0; d * 4];
    for e in (0..d).step_by(4) {
        for r in 0..rows {
            q4[e * 4 + r * 4..e * 4 + r * 4 + 4].copy_from_slice(&q[r * qs + e..r * qs + e + 4]);
        }
    }
    q4
}

/// [`scores`] for blocks of `R` = 3 or 4 rows, with the rows in the four
/// quarters of the vector and 4 dims per lane group: for each 4 dims, one
/// FMA per key multiplies the queries' vector (`q4`, from
/// [`quad_queries`]) by the key's 4 elements repeated 4 times
/// (`CpuElement::load4x4`). Sixteen keys keep 16 accumulators, and [`reduce_quads`] turns them into the 4 rows'
/// scores with 44 operations where [`scores`] spends 4 x 45 on `reduce16`:
/// the same FMAs, a quarter of the reduction. Same contract as [`scores`]
/// (`ss` a multiple of 16, scores past `n` unspecified), with `d` a
/// multiple of 4.
#[inline(always)]
pub fn scores_quad<V: Vector, E: CpuElement, const R: usize>(
    q4: &[f32],
    (k, ks): (&[E], usize),
    n: usize,
    d: usize,
    (s, ss): (&mut [f32], usize),
    ahead: RowStream,
) {
    let n16 = n.div_ceil(LANES) * LANES;
    assert!(
        (3..=4).contains(&R)
            && d > 0
            && d.is_multiple_of(4)
            && q4.len() >= 4 * d
            && ss >= n16
            && ss % LANES == 0
            && s.len() >= (R - 1) * ss + n16
            && (n == 0 || k.len() >= (n - 1) * ks + d)
    );
    let every = (d / 4 / QUAD_GROUP).max(1);
    let mut jb = 0;
    while jb < n {
        let mut acc = [V::ZERO; LANES];
        // Two groups of 8 keys: 8 row pointers stay in general registers
        // (16 spilled to the stack measured twice as slow), and 8 chains
        // cover the FMA latency.
        for (g, acc) in acc.chunks_exact_mut(QUAD_GROUP).enumerate() {
            let g0 = jb + g * QUAD_GROUP;
            // Keys past `n` repeat the last key: always readable, and
            // their scores are discarded by the caller.
            let rows: [*const E; QUAD_GROUP] =
                std::array::from_fn(|i| k[(g0 + i).min(n - 1) * ks..].as_ptr());
            let live = QUAD_GROUP.min(n.saturating_sub(g0));
            // The group's rows of the next tile, one every `every` steps,
            // spread over the keys' FMAs rather than at the group's start.
            let (mut wait, mut i) = (1, 0);
            let mut e = 0;
            while e < d {
                wait -= 1;
                if wait == 0 {
                    wait = every;
                    if i < live {
                        ahead.row(g0 + i);
                        i += 1;
                    }
                }
                // SAFETY: e + 4 <= d: 16 floats of q4 at 4e (asserted
                // q4.len() >= 4d).
                let qv = unsafe { load::<V>(q4.as_ptr().add(4 * e)) };
                for (a, &row) in acc.iter_mut().zip(&rows) {
                    // SAFETY: every key row has d >= e + 4 elements
                    // (asserted).
                    *a = qv.mul_add(unsafe { V::load4x4(row.add(e)) }, *a);
                }
                e += 4;
            }
            for i in i..live {
                ahead.row(g0 + i);
            }
        }
        let acc: &[V; LANES] = (&acc[..]).try_into().expect("16 accumulators");
        for (r, x) in V::reduce_quads(acc).iter().enumerate().take(R) {
            // SAFETY: r * ss + jb + 16 <= (R - 1) * ss + n16 <= s.len().
            unsafe { store(s.as_mut_ptr().add(r * ss + jb), *x) };
        }
        jb += LANES;
    }
}

/// Keys per group of [`scores_quad`].
const QUAD_GROUP: usize = 8;

/// `o[r * dv + c] = alpha[r] * o[r * dv + c] + sum_{j < n} p[r * ps + j] *
/// v[j * vs + c]` for `r < R`, `c < dv`. Row `j` of `ahead` is
/// prefetched alongside value row `j`.
///
/// f32 value rows that all sit `e` elements past a 64-byte line (`vs` and
/// `dv` multiples of 16, `e` of 4) are read from column `h = 16 - e` on:
/// every vector but the last then lies on one line, and the last takes
/// the row's last `16 - h` and first `h` columns in four 16-byte pieces
/// ([`rotation`]). A Rust `Vec` of f32 from the allocator is only
/// 16-byte aligned, and usually sits 16, 32 or 48 bytes past a line,
/// where every 64-byte load would cross one.
#[inline(always)]
pub fn accumulate<V: Vector, E: CpuElement, const R: usize>(
    (p, ps): (&[f32], usize),
    (v, vs): (&[E], usize),
    n: usize,
    dv: usize,
    alpha: &[f32; R],
    o: &mut [f32],
    ahead: RowStream,
) {
    assert!(
        (1..=4).contains(&R)
            && o.len() >= R * dv
            && p.len() >= (R - 1) * ps + n
            && (n == 0 || v.len() >= (n - 1) * vs + dv)
    );
    const { assert!(R >= 1 && R <= 4 && matches!(V::DECODE_COLUMN_VECS[R - 1], 1 | 2 | 4 | 8)) };
    let most = const { V::DECODE_COLUMN_VECS[R - 1] };
    // f32 only (`rotation` is 0 for the others): the `const` test keeps
    // the wrapped pass out of their builds, and `h` and `W` agree.
    let h = if const { matches!(E::DTYPE, DType::F32) } {
        rotation(v, vs, dv)
    } else {
        0
    };
    // Each pass over a range of columns prefetches its share of the next
    // tile's lines (`RowStream::part`).
    let (mut passes, mut rest) = (0, dv);
    for w in [8, 4, 2, 1] {
        if w == 1 || most >= w {
            passes += rest / (w * LANES);
            rest %= w * LANES;
        }
    }
    let (mut c0, mut k) = (0, 0);
    // Passes of `w` vectors while they fit; with `h > 0` the one that ends
    // at `dv` holds the wrapped vector (`W`).
    macro_rules! passes_of {
        ($w:literal) => {
            while c0 + $w * LANES <= dv {
                let (next, at) = (ahead.part(k, passes), (c0, h));
                if const { matches!(E::DTYPE, DType::F32) } && h > 0 && c0 + $w * LANES == dv {
                    columns::<V, E, R, $w, true>((p, ps), (v, vs), n, dv, alpha, o, at, next);
                } else {
                    columns::<V, E, R, $w, false>((p, ps), (v, vs), n, dv, alpha, o, at, next);
                }
                (c0, k) = (c0 + $w * LANES, k + 1);
            }
        };
    }
    // `const` conditions: passes wider than `most` are not compiled.
    if const { V::DECODE_COLUMN_VECS[R - 1] >= 8 } {
        passes_of!(8);
    }
    if const { V::DECODE_COLUMN_VECS[R - 1] >= 4 } {
        passes_of!(4);
    }
    if const { V::DECODE_COLUMN_VECS[R - 1] >= 2 } {
        passes_of!(2);
    }
    passes_of!(1);
    debug_assert_eq!(k, passes);
    debug_assert!(h == 0 || c0 == dv);
    if passes == 0 {
        for j in 0..n {
            ahead.row(j);
        }
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

/// The column [`accumulate`]'s vectors start from: `16 - e` for f32 value
/// rows that all sit `e > 0` elements past a 64-byte line, `e` a multiple
/// of 4 (rows 16-byte aligned, as Rust's allocator gives them), and span
/// whole vectors; else 0.
pub(super) fn rotation<E: CpuElement>(v: &[E], vs: usize, dv: usize) -> usize {
    match E::as_f32(v) {
        Some(f) if dv.is_multiple_of(LANES) && vs.is_multiple_of(LANES) => {
            let e = (f.as_ptr() as usize / 4) % LANES;
            if e.is_multiple_of(4) {
                (LANES - e) % LANES
            } else {
                0
            }
        }
        _ => 0,
    }
}

/// Where the quarters of the vector at column `dv - 16 + h` of a row of
/// `dv` (`0 < h < 16`, a multiple of 4) lie, from that column: the first
/// `16 - h` lanes end the row, the rest begin it.
#[inline(always)]
fn wrapped_quarters(h: usize, dv: usize) -> [isize; 4] {
    debug_assert!(0 < h && h < LANES && h.is_multiple_of(4) && dv >= LANES);
    std::array::from_fn(|g| {
        let l = 4 * g;
        if l < LANES - h {
            l as isize
        } else {
            l as isize - dv as isize
        }
    })
}

/// [`accumulate`] for `CV` vectors of columns: `R x CV` accumulators over
/// all `n` keys, prefetching row `j` of `ahead` with value row `j`. The
/// vectors start at column `h + c0` (`at = (c0, h)`, [`rotation`]); with
/// `W` (`h > 0` and the pass ends at `dv`) the last vector takes columns
/// `dv - 16 + h..dv` and `0..h` in its lanes, read in quarters, none of
/// which crosses a line of `v`. (The rows of `o` shift by `h` too and may
/// cross lines; they are read and written once per call.) `W` is a
/// parameter, not worked out inside, so the other passes' loops stay as
/// they were.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn columns<V: Vector, E: CpuElement, const R: usize, const CV: usize, const W: bool>(
    (p, ps): (&[f32], usize),
    (v, vs): (&[E], usize),
    n: usize,
    dv: usize,
    alpha: &[f32; R],
    o: &mut [f32],
    (c0, h): (usize, usize),
    ahead: RowStream,
) {
    let t0 = h + c0;
    let q = if W { wrapped_quarters(h, dv) } else { [0; 4] };
    let mut acc = [[V::ZERO; CV]; R];
    for (r, row) in acc.iter_mut().enumerate() {
        for (c, a) in row.iter_mut().enumerate() {
            // SAFETY: the passes of `accumulate` cover columns h..h + dv
            // (h > 0 only where dv is a multiple of 16): t0 + c * 16 < dv,
            // inside row r of o (R rows asserted there), with 16 columns
            // from there, or, for the wrapped vector, 16 - h of them and
            // the row's first h.
            let x = unsafe {
                let at = o.as_ptr().add(r * dv + t0 + c * LANES);
                if W && c == CV - 1 {
                    V::load_quarters(q.map(|d| at.wrapping_offset(d)))
                } else {
                    load::<V>(at)
                }
            };
            *a = x * V::splat(alpha[r]);
        }
    }
    for j in 0..n {
        ahead.row(j);
        let mut x = [V::ZERO; CV];
        for (c, xc) in x.iter_mut().enumerate() {
            // SAFETY: value row j has dv columns: as for o's rows above.
            *xc = unsafe {
                let at = v.as_ptr().add(j * vs + t0 + c * LANES);
                if W && c == CV - 1 {
                    E::load16_quarters::<V>(q.map(|d| at.wrapping_offset(d)))
                } else {
                    E::load16::<V>(at)
                }
            };
        }
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
            unsafe {
                let at = o.as_mut_ptr().add(r * dv + t0 + c * LANES);
                if W && c == CV - 1 {
                    a.store_quarters(q.map(|d| at.wrapping_offset(d)))
                } else {
                    store(at, a)
                }
            }
        }
    }
}
