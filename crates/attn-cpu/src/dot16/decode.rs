//! The decode path's products for bf16 inputs on `vdpbf16ps`. The scores
//! ([`scores_quad_pairs`]) take the layout of
//! `microkernel::decode::scores_quad` (a block's 3 or 4 query rows in the
//! four quarters of a vector, one accumulator per key, `reduce_quads` at
//! the end), with pairs of bf16 where that kernel has single floats. Each
//! instruction multiplies 8 dims of a key (one 16-byte broadcast of its
//! row, read in place) into the 4 rows, where the f32 kernel widens 4 dims
//! and spends an FMA on them: a quarter of the instructions per dim.
//!
//! As in the prefill pass (module docs of `dot16/`), the products are
//! exact only for values that [`fits`](super::fits): the query rows are
//! checked once, when the block's pairs are made ([`quad_pairs`]), and
//! each tile's key rows right after the kernel read them
//! ([`scores_quad_pairs`] says whether they fit); a tile whose keys do not
//! is computed again on the f32 kernel, which the decode state (f32
//! throughout) lets any tile do.
//!
//! `O = alpha O + P V` on pairs too ([`accumulate_pairs`]), where the
//! value rows are bf16 read in place and `dv` is a multiple of 32: the
//! probabilities rounded to bf16 in pairs of keys (as the prefill pass
//! does, SEMANTICS section 7), two value rows interleaved word by word
//! within each 128-bit lane (`vpunpcklwd`, `vpunpckhwd`: one shuffle per
//! 16 columns and pair of keys, where the f32 kernel widens 32 bf16 and
//! spends two FMAs per row on them), the output columns permuted to
//! match in registers (one `vshuff32x4` per 16 columns as a tile starts,
//! two as it ends). The
//! value rows are checked as the kernel loads them, and the kernel
//! writes the new output beside the old one, so a tile whose values do
//! not fit is computed again on the f32 kernel from the old output.

use super::check::{slab_fits, Span};
use crate::blocking::LANES;
use crate::pack::RowStream;
use crate::simd::avx512::V16;
use crate::simd::{store, Vector};
use std::arch::x86_64::*;

/// Keys per group: 8 row pointers and 8 accumulator chains, as
/// `scores_quad`.
const GROUP: usize = 8;

/// The query rows (`rows`: 3 or 4 slices of `d` bf16 bits, `d` a multiple
/// of 8) as [`scores_quad_pairs`] reads them: vector `g` (of `d / 8`, 16
/// words each) holds in lane `4r + t` row `r`'s elements `8g + 2t` (low
/// half) and `8g + 2t + 1`; zero for a fourth row that is absent. `None`
/// when an element does not [`fits`](super::fits).
pub fn quad_pairs(rows: &[&[u16]], d: usize) -> Option<Vec<u32>> {
    assert!(
        (3..=4).contains(&rows.len()) && d.is_multiple_of(8) && rows.iter().all(|r| r.len() >= d)
    );
    if !rows.iter().all(|r| r[..d].iter().all(|&x| super::fits(x))) {
        return None;
    }
    let mut q2 = vec![0u32; 2 * d];
    for g in 0..d / 8 {
        for (r, row) in rows.iter().enumerate() {
            for t in 0..4 {
                let e = 8 * g + 2 * t;
                q2[g * LANES + 4 * r + t] = u32::from(row[e]) | (u32::from(row[e + 1]) << 16);
            }
        }
    }
    Some(q2)
}

/// `s[r * ss + j] = c * sum_{e < d} q[r][e] * k[j * ks + e]` for the
/// `rows` (3 or 4) rows of `q2` ([`quad_pairs`]) and keys `j < n`, the
/// products on `vdpbf16ps`; scores past `n` (up to `n` rounded to 16) are
/// written with unspecified values, as `scores_quad`'s contract says, and
/// row `j` of `ahead` is prefetched alongside key `j`. Returns whether
/// every element of the `n` key rows [`fits`](super::fits): when not, the
/// scores are wrong and the caller computes them again on the f32 kernel.
///
/// # Safety
/// The CPU runs AVX-512 F, BW and DQ and AVX512_BF16.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
pub unsafe fn scores_quad_pairs(
    q2: &[u32],
    (k, ks): (&[u16], usize),
    n: usize,
    d: usize,
    rows: usize,
    c: f32,
    (s, ss): (&mut [f32], usize),
    ahead: RowStream,
) -> bool {
    let n16 = n.div_ceil(LANES) * LANES;
    assert!(
        (3..=4).contains(&rows)
            && d > 0
            && d.is_multiple_of(8)
            && q2.len() >= 2 * d
            && ss >= n16
            && ss.is_multiple_of(LANES)
            && s.len() >= (rows - 1) * ss + n16
            && (n == 0 || k.len() >= (n - 1) * ks + d)
    );
    let mut jb = 0;
    while jb < n {
        let mut acc = [_mm512_setzero_ps(); LANES];
        for (g, acc) in acc.chunks_exact_mut(GROUP).enumerate() {
            let g0 = jb + g * GROUP;
            // Keys past `n` repeat the last key: always readable, and
            // their scores are discarded by the caller.
            let keys: [*const u16; GROUP] =
                std::array::from_fn(|i| k[(g0 + i).min(n - 1) * ks..].as_ptr());
            let live = GROUP.min(n.saturating_sub(g0));
            let mut e = 0;
            while e < d {
                // One row of the next tile per step. Spread like
                // `scores_quad`'s (a row every `d / 32` steps), this
                // kernel ran 3% slower with the rows in L3 and no faster
                // from memory (Zen 4).
                if e / 8 < live {
                    ahead.row(g0 + e / 8);
                }
                // SAFETY: vector e / 8 of q2 is its 16 words from 2e <
                // 2d <= q2.len() (asserted); the CPU runs AVX-512 F.
                let qv: __m512bh = unsafe {
                    std::mem::transmute(_mm512_loadu_si512(q2.as_ptr().add(2 * e).cast()))
                };
                for (a, &key) in acc.iter_mut().zip(&keys) {
                    // SAFETY: every key row has d >= e + 8 elements
                    // (asserted): 16 bytes at e; the CPU runs the level.
                    unsafe {
                        let kb = _mm512_broadcast_i32x4(_mm_loadu_si128(key.add(e).cast()));
                        *a = _mm512_dpbf16_ps(*a, qv, std::mem::transmute::<__m512i, __m512bh>(kb));
                    }
                }
                e += 8;
            }
            for i in d / 8..live {
                ahead.row(g0 + i);
            }
        }
        let acc: [V16; LANES] = acc.map(V16);
        for (r, x) in V16::reduce_quads(&acc).iter().enumerate().take(rows) {
            // SAFETY: r * ss + jb + 16 <= (rows - 1) * ss + n16 <= s.len()
            // (asserted).
            unsafe { store(s.as_mut_ptr().add(r * ss + jb), *x * V16::splat(c)) };
        }
        jb += LANES;
    }
    // SAFETY: the CPU runs AVX-512 BW (this function's contract); rows
    // 0..n of k hold d elements, ks apart (asserted).
    let fit = n == 0 || unsafe { slab_fits(k, ks, (0, n), d) };
    #[cfg(test)]
    tests::TILES[d.min(tests::DIMS - 1)][usize::from(!fit)]
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    fit
}

/// Most keys [`accumulate_pairs`] takes per call (the decode path's
/// tile).
pub const PAIR_KEYS: usize = crate::blocking::DECODE_KEYS;

/// Words of [`accumulate_pairs`]'s scratch: [`PAIR_KEYS`] / 2 per row,
/// 4 rows.
pub const PAIR_WORDS: usize = 4 * PAIR_KEYS / 2;

// Whole vectors of probabilities per row (`accumulate_pairs` converts
// 16 at a time).
const _: () = assert!(PAIR_KEYS.is_multiple_of(LANES));

/// `out[r * dv + c] = alpha[r] * o[r * dv + c] + sum_{j < n} P[r][j] *
/// V[j][c]` for `r < rows` (1 to 4) and `c < dv` (a multiple of 32), on
/// `vdpbf16ps`: `P[r][j] = p[r * ps + j]` rounded to bf16 (nearest even;
/// `n` at most [`PAIR_KEYS`]), `V[j][c] = v[j * vs + c]` (bf16 bits).
/// Row `j` of `ahead` is prefetched alongside value row `j`. Returns
/// whether every element of the `n` value rows [`fits`](super::fits):
/// when not, `out` is wrong and the caller computes the tile again from
/// `o` on the f32 kernel.
///
/// Each row of `p` must hold `n` rounded up to 16 readable floats (those
/// past `n` are read and ignored). `words` (at least [`PAIR_WORDS`])
/// is scratch for the probability pairs: a buffer of the caller's, so
/// the kernel's stack traffic is only ever spills (`cargo xtask
/// cpu-check`).
///
/// # Safety
/// The CPU runs AVX-512 F, BW and DQ and AVX512_BF16.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
pub unsafe fn accumulate_pairs(
    rows: usize,
    (p, ps): (&[f32], usize),
    (v, vs): (&[u16], usize),
    n: usize,
    dv: usize,
    alpha: &[f32],
    (o, out): (&[f32], &mut [f32]),
    words: &mut [u32],
    ahead: RowStream,
) -> bool {
    let n16 = n.div_ceil(LANES) * LANES;
    assert!(
        (1..=4).contains(&rows)
            && n <= PAIR_KEYS
            && dv.is_multiple_of(32)
            && alpha.len() >= rows
            && o.len() >= rows * dv
            && out.len() >= rows * dv
            && words.len() >= PAIR_WORDS
            && ps >= n16
            && (n == 0 || p.len() >= (rows - 1) * ps + n16)
            && (n == 0 || v.len() >= (n - 1) * vs + dv)
    );
    // The probabilities in pairs of keys (`round_rows`): word `i` of row
    // `r` holds keys 2i (low half) and 2i + 1; for an odd `n` the last
    // word's high half (key `n`, past the tile) is cleared, so it
    // multiplies the zero row that stands for the missing value row
    // whatever it held.
    let pw = &mut words[..PAIR_WORDS];
    // SAFETY: rows 0..rows of p hold n16 floats, ps apart (asserted);
    // row r of pw takes n16 / 2 <= PAIR_KEYS / 2 words from word r *
    // PAIR_KEYS / 2 < PAIR_WORDS; n16 is a multiple of 16; the CPU runs
    // AVX-512 BW and BF16. (The decode softmax's probabilities are normal
    // or 0, as `round_rows` wants, or NaN in a NaN row, which rounds to
    // NaN.)
    unsafe {
        super::kernels::round_rows(
            (p.as_ptr(), ps),
            (rows, n16),
            1.0,
            (pw.as_mut_ptr(), PAIR_KEYS / 2),
        )
    };
    if n % 2 == 1 {
        for row in pw.chunks_exact_mut(PAIR_KEYS / 2).take(rows) {
            row[n / 2] &= 0xffff;
        }
    }
    // SAFETY: the CPU runs AVX-512 BW (this function's contract).
    let mut span = unsafe { Span::new() };
    // Each pass over 64 (or the last 32) columns prefetches its share of
    // the next tile's lines (`RowStream::part`).
    let (passes, mut k) = (dv.div_ceil(64), 0);
    let mut c0 = 0;
    while c0 < dv {
        let blocks = if dv - c0 >= 64 { 2 } else { 1 };
        let ahead = ahead.part(k, passes);
        k += 1;
        // SAFETY: columns c0..c0 + 32 * blocks <= dv of the rows asserted
        // above; the words cover the n keys; the CPU runs the level.
        unsafe {
            match (rows, blocks) {
                (1, 2) => {
                    pair_columns::<1, 2>(pw, (v, vs), n, dv, alpha, (o, out), c0, ahead, &mut span)
                }
                (2, 2) => {
                    pair_columns::<2, 2>(pw, (v, vs), n, dv, alpha, (o, out), c0, ahead, &mut span)
                }
                (3, 2) => {
                    pair_columns::<3, 2>(pw, (v, vs), n, dv, alpha, (o, out), c0, ahead, &mut span)
                }
                (_, 2) => {
                    pair_columns::<4, 2>(pw, (v, vs), n, dv, alpha, (o, out), c0, ahead, &mut span)
                }
                (1, _) => {
                    pair_columns::<1, 1>(pw, (v, vs), n, dv, alpha, (o, out), c0, ahead, &mut span)
                }
                (2, _) => {
                    pair_columns::<2, 1>(pw, (v, vs), n, dv, alpha, (o, out), c0, ahead, &mut span)
                }
                (3, _) => {
                    pair_columns::<3, 1>(pw, (v, vs), n, dv, alpha, (o, out), c0, ahead, &mut span)
                }
                (_, _) => {
                    pair_columns::<4, 1>(pw, (v, vs), n, dv, alpha, (o, out), c0, ahead, &mut span)
                }
            }
        }
        c0 += 32 * blocks;
    }
    // SAFETY: the CPU runs AVX-512 BW (this function's contract).
    let fit = unsafe { span.fits() };
    #[cfg(test)]
    tests::VALUE_TILES[dv.min(tests::DIMS - 1)][usize::from(!fit)]
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    fit
}

/// [`accumulate_pairs`] for columns `c0..c0 + 32 * B` of `R` rows: `R x B
/// x 2` accumulators over the `n` keys, lane `4L + t` of block `b`'s low
/// accumulator holding column `c0 + 32b + 8L + t` and of its high one
/// column `c0 + 32b + 8L + 4 + t` (`L, t < 4`), the order in which
/// `vpunpck{l,h}wd` interleave two value rows.
///
/// # Safety
/// As [`accumulate_pairs`], for `c0 + 32 * B <= dv`.
// Index loops on purpose: they unroll in place (as `kernels.rs`).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn pair_columns<const R: usize, const B: usize>(
    pw: &[u32],
    (v, vs): (&[u16], usize),
    n: usize,
    dv: usize,
    alpha: &[f32],
    (o, out): (&[f32], &mut [f32]),
    c0: usize,
    ahead: RowStream,
    span: &mut Span,
) {
    // SAFETY: every access is within the extents of `accumulate_pairs`'s
    // contract (asserted there): output columns c0..c0 + 32B <= dv of R
    // rows, value columns the same of rows j < n, words i < n.div_ceil(2)
    // <= PAIR_KEYS / 2.
    unsafe {
        let mut acc = [[[_mm512_setzero_ps(); 2]; B]; R];
        for r in 0..R {
            let a = _mm512_set1_ps(alpha[r]);
            for b in 0..B {
                let at = o.as_ptr().add(r * dv + c0 + 32 * b);
                let (x0, x1) = (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16)));
                // Chunks (of 4 columns) 0, 2 of each half, and 1, 3.
                acc[r][b][0] = _mm512_mul_ps(_mm512_shuffle_f32x4::<0x88>(x0, x1), a);
                acc[r][b][1] = _mm512_mul_ps(_mm512_shuffle_f32x4::<0xdd>(x0, x1), a);
            }
        }
        for i in 0..n / 2 {
            ahead.row(2 * i);
            ahead.row(2 * i + 1);
            let x = v.as_ptr().add(2 * i * vs + c0);
            pair_step(&mut acc, (x, Some(x.add(vs))), pw, i, span);
        }
        if n % 2 == 1 {
            ahead.row(n - 1);
            let x = v.as_ptr().add((n - 1) * vs + c0);
            pair_step(&mut acc, (x, None), pw, n / 2, span);
        }
        for r in 0..R {
            for b in 0..B {
                let (lo, hi) = (acc[r][b][0], acc[r][b][1]);
                // Back to column order: [lo 0, hi 0, lo 1, hi 1] and
                // [lo 2, hi 2, lo 3, hi 3].
                let t = _mm512_shuffle_f32x4::<0x44>(lo, hi);
                let u = _mm512_shuffle_f32x4::<0xee>(lo, hi);
                let at = out.as_mut_ptr().add(r * dv + c0 + 32 * b);
                _mm512_storeu_ps(at, _mm512_shuffle_f32x4::<0xd8>(t, t));
                _mm512_storeu_ps(at.add(16), _mm512_shuffle_f32x4::<0xd8>(u, u));
            }
        }
    }
}

/// One pair of keys `2i`, `2i + 1` of [`pair_columns`]: value rows `x`
/// and `y` (a zero row where `None`) from the block's first column,
/// interleaved and multiplied into the accumulators by the rows'
/// probability pairs (word `i` of row `r`: `pw[r * PAIR_KEYS / 2 + i]`),
/// and taken into `span`.
///
/// # Safety
/// `32 * B` bf16 readable at `x` and `y`; the CPU runs AVX-512 F and BW
/// and AVX512_BF16 (inlined into [`accumulate_pairs`], which enables
/// them).
#[allow(clippy::needless_range_loop)] // as `pair_columns`
#[inline(always)]
unsafe fn pair_step<const R: usize, const B: usize>(
    acc: &mut [[[__m512; 2]; B]; R],
    (x, y): (*const u16, Option<*const u16>),
    pw: &[u32],
    i: usize,
    span: &mut Span,
) {
    // SAFETY: forwarded from the caller; __m512bh is 512 plain bits.
    unsafe {
        for b in 0..B {
            let xa = _mm512_loadu_si512(x.add(32 * b).cast());
            let xb = match y {
                Some(y) => _mm512_loadu_si512(y.add(32 * b).cast()),
                None => _mm512_setzero_si512(),
            };
            span.add(xa);
            span.add(xb);
            let lo: __m512bh = std::mem::transmute(_mm512_unpacklo_epi16(xa, xb));
            let hi: __m512bh = std::mem::transmute(_mm512_unpackhi_epi16(xa, xb));
            for r in 0..R {
                let pr: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(pw[r * (PAIR_KEYS / 2) + i] as i32));
                acc[r][b][0] = _mm512_dpbf16_ps(acc[r][b][0], pr, lo);
                acc[r][b][1] = _mm512_dpbf16_ps(acc[r][b][1], pr, hi);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_spec::bf16;
    use std::sync::atomic::AtomicUsize;

    /// Head dims the tile counts tell apart.
    pub(super) const DIMS: usize = 257;

    /// Tiles [`scores_quad_pairs`] found fitting (0) and not (1), per head
    /// dim: tests running at once count apart where their dims differ.
    pub(super) static TILES: [[AtomicUsize; 2]; DIMS] =
        [const { [AtomicUsize::new(0), AtomicUsize::new(0)] }; DIMS];

    /// The same for [`accumulate_pairs`], per value head dim.
    pub(super) static VALUE_TILES: [[AtomicUsize; 2]; DIMS] =
        [const { [AtomicUsize::new(0), AtomicUsize::new(0)] }; DIMS];

    /// Scores of generated bf16 rows against their f64 dot products (each
    /// product exact, so within f32's summation error), every key count
    /// to 40 around the 16- and 8-key boundaries, head dims 8 to 136, 3
    /// and 4 rows; a key row with a value that does not fit is reported.
    #[test]
    fn pair_scores_match_f64_and_report_misfits() {
        if !crate::Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0)
        };
        for d in [8, 16, 64, 72, 128, 136] {
            for rows in [3, 4] {
                let q: Vec<Vec<bf16>> = (0..rows)
                    .map(|_| (0..d).map(|_| next()).collect())
                    .collect();
                let qb: Vec<Vec<u16>> = q
                    .iter()
                    .map(|r| r.iter().map(|v| v.to_bits()).collect())
                    .collect();
                let qr: Vec<&[u16]> = qb.iter().map(|r| &r[..]).collect();
                let q2 = quad_pairs(&qr, d).expect("ordinary values fit");
                for n in [1, 7, 8, 9, 16, 17, 33, 40] {
                    let ks = d + 3;
                    let k: Vec<bf16> = (0..n * ks).map(|_| next()).collect();
                    let kb: Vec<u16> = k.iter().map(|v| v.to_bits()).collect();
                    let ss = n.div_ceil(16) * 16;
                    let c = 0.7;
                    let run = |k: &[u16]| {
                        let mut s = vec![f32::NAN; rows * ss];
                        // SAFETY: the CPU runs the level (checked above).
                        let fit = unsafe {
                            scores_quad_pairs(
                                &q2,
                                (k, ks),
                                n,
                                d,
                                rows,
                                c,
                                (&mut s, ss),
                                RowStream::NONE,
                            )
                        };
                        (fit, s)
                    };
                    let (fit, s) = run(&kb);
                    assert!(fit);
                    for r in 0..rows {
                        for j in 0..n {
                            let (mut dot, mut mag) = (0.0f64, 0.0f64);
                            for e in 0..d {
                                let p =
                                    f64::from(q[r][e].to_f32()) * f64::from(k[j * ks + e].to_f32());
                                dot += p;
                                mag += p.abs();
                            }
                            let want = f64::from(c) * dot;
                            // d additions and the scale: (d + 1) f32 roundings.
                            let tol =
                                (d as f64 + 1.0) * f64::from(f32::EPSILON) * f64::from(c) * mag;
                            let got = f64::from(s[r * ss + j]);
                            assert!(
                                (got - want).abs() <= tol,
                                "d {d} rows {rows} n {n} ({r}, {j}): {got} vs {want}"
                            );
                        }
                    }
                    // A subnormal in the last key's last element, or in
                    // the middle key's first: reported; an infinity in the
                    // padding between rows: not read.
                    for (at, x, fits) in [
                        ((n - 1) * ks + d - 1, 1e-39, false),
                        ((n / 2) * ks, -1e-39, false),
                        ((n / 2) * ks + d, f32::INFINITY, true),
                    ] {
                        let mut bad = kb.clone();
                        bad[at] = bf16::from_f32(x).to_bits();
                        assert_eq!(run(&bad).0, fits, "d {d} n {n}: {x} at {at}");
                    }
                }
                let mut big = qb.clone();
                big[rows - 1][d / 2] = bf16::from_f32(1e20).to_bits();
                let br: Vec<&[u16]> = big.iter().map(|r| &r[..]).collect();
                assert!(quad_pairs(&br, d).is_none());
            }
        }
    }

    /// `P V` on pairs against f64 sums of the same bf16-rounded
    /// probabilities (each product exact, so within f32's summation
    /// error): 1 to 4 rows, key counts odd and even to a whole tile,
    /// value dims of 1, 2, 3 and 6 blocks of 32; probabilities past `n`
    /// (NaN here) are not used; a value row with an element that does not
    /// fit is reported, one in the padding between rows is not read.
    #[test]
    fn pair_values_match_f64_and_report_misfits() {
        if !crate::Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32
        };
        for dv in [32, 64, 96, 192] {
            for rows in 1..=4 {
                for n in [1, 2, 15, 16, 17, 33, 64] {
                    let (vs, ps) = (dv + 5, PAIR_KEYS);
                    let v: Vec<u16> = (0..n * vs)
                        .map(|i| match i % vs < dv {
                            true => bf16::from_f32((next() - 0.5) * 6.0).to_bits(),
                            false => bf16::from_f32(f32::INFINITY).to_bits(),
                        })
                        .collect();
                    let mut p = vec![f32::NAN; rows * ps];
                    for r in 0..rows {
                        for j in 0..n {
                            p[r * ps + j] = next();
                        }
                    }
                    let alpha: Vec<f32> = (0..rows).map(|_| next()).collect();
                    let o: Vec<f32> = (0..rows * dv).map(|_| next() * 4.0 - 2.0).collect();
                    let run = |v: &[u16]| {
                        let mut out = vec![f32::NAN; rows * dv];
                        let mut words = vec![0u32; PAIR_WORDS];
                        // SAFETY: the CPU runs the level (checked above).
                        let fit = unsafe {
                            accumulate_pairs(
                                rows,
                                (&p, ps),
                                (v, vs),
                                n,
                                dv,
                                &alpha,
                                (&o, &mut out),
                                &mut words,
                                RowStream::NONE,
                            )
                        };
                        (fit, out)
                    };
                    let (fit, out) = run(&v);
                    assert!(fit, "dv {dv} rows {rows} n {n}");
                    for r in 0..rows {
                        for c in 0..dv {
                            let start = f64::from(alpha[r] * o[r * dv + c]);
                            let (mut sum, mut mag) = (start, start.abs());
                            for j in 0..n {
                                let pj = f64::from(bf16::from_f32(p[r * ps + j]).to_f32());
                                let t = pj * f64::from(bf16::from_bits(v[j * vs + c]).to_f32());
                                sum += t;
                                mag += t.abs();
                            }
                            // `start` rounds as the kernel's rescale
                            // does; then n additions: n f32 roundings
                            // roundings at most.
                            let tol = n as f64 * f64::from(f32::EPSILON) * mag;
                            let got = f64::from(out[r * dv + c]);
                            assert!(
                                (got - sum).abs() <= tol,
                                "dv {dv} rows {rows} n {n} ({r}, {c}): {got} vs {sum}"
                            );
                        }
                    }
                    for (at, x, fits) in [
                        ((n - 1) * vs + dv - 1, 1e-39, false),
                        ((n / 2) * vs, -1e-39, false),
                        ((n / 2) * vs + 7, 1e30, false),
                    ] {
                        let mut bad = v.clone();
                        bad[at] = bf16::from_f32(x).to_bits();
                        assert_eq!(run(&bad).0, fits, "dv {dv} n {n}: {x} at {at}");
                    }
                }
            }
        }
    }

    /// Backends on 1 and 3 threads, or `None` (the test skipped) where the
    /// CPU has no AVX512_BF16.
    fn engines() -> Option<(crate::Cpu, crate::Cpu)> {
        if !crate::Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return None;
        }
        Some((
            crate::Cpu::with_threads(1).unwrap(),
            crate::Cpu::with_threads(3).unwrap(),
        ))
    }

    /// A bf16 case of `shape` built from `seed` passes the conformance
    /// check on `one` with the tile counts `tiles` gives (fitting,
    /// not) going up and staying put, and `one` and `three` give it bit
    /// for bit alike; returns the case (`i` names it in messages).
    fn passes_on_pairs(
        (one, three): (&crate::Cpu, &crate::Cpu),
        (shape, options, seed): (attn_spec::Shape, attn_spec::AttnOptions, u64),
        tiles: impl Fn() -> (usize, usize),
        i: usize,
    ) -> attn_conformance::Case {
        use attn_conformance::{check_case, Case, CaseParams, Outcome};
        use attn_spec::{Backend, DType};
        let mut params = CaseParams::plain(shape);
        params.dtype = DType::Bf16;
        params.options = options;
        params.seed = seed;
        let case = Case::build(params);
        let before = tiles();
        assert_eq!(check_case(one, &case), Ok(Outcome::Passed), "case {i}");
        let after = tiles();
        assert!(
            after.0 > before.0 && after.1 == before.1,
            "case {i}: {before:?} {after:?}"
        );
        let a = one.forward(&case.problem, case.inputs()).unwrap().out;
        let b = three.forward(&case.problem, case.inputs()).unwrap().out;
        assert!(a == b, "case {i}: 1 and 3 threads differ");
        case
    }

    /// Decoding through the backend: GQA blocks of 3 and 4 rows take the
    /// pair scores and pass the conformance check (for 1 and 3 threads,
    /// bitwise alike); a key tile holding a subnormal is computed on the
    /// f32 kernel and the result still passes; a query row holding one
    /// keeps its block on the f32 kernels. The head dims (120, 56, 88) are
    /// this test's alone, so the tile counts are its own.
    #[test]
    fn decoding_on_pairs_passes_the_check_and_falls_back_per_tile() {
        use attn_conformance::{check_case, Outcome};
        use attn_spec::{AttnOptions, Backend, Shape};
        use std::sync::atomic::Ordering::Relaxed;
        let Some((one, three)) = engines() else {
            return;
        };
        let tiles = |d: usize| (TILES[d][0].load(Relaxed), TILES[d][1].load(Relaxed));
        for (i, (shape, options)) in [
            (Shape::new(2, 8, 2, 1, 300, 120), AttnOptions::default()),
            (
                Shape::new(1, 6, 2, 1, 200, 56),
                AttnOptions::default().with_lse(),
            ),
            (
                Shape::new(1, 2, 1, 2, 260, 88),
                AttnOptions::default().causal(),
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let d = shape.head_dim_qk;
            let seeded = (shape, options, i as u64);
            let mut case = passes_on_pairs((&one, &three), seeded, || tiles(d), i);
            // A subnormal in key 100's row (its K/V head 0, dim 5).
            let at = case.problem.k.index([0, 100, 0, 5]);
            case.k.set(at, 1e-39);
            let before = tiles(d);
            assert_eq!(
                check_case(&one, &case),
                Ok(Outcome::Passed),
                "case {i}, subnormal key"
            );
            let after = tiles(d);
            assert!(
                after.1 > before.1 && after.0 > before.0,
                "case {i}: {before:?} {after:?}"
            );
            // A score the f32 kernel keeps finite (2^56.9 * 2^71.5 * d^-1/2
            // = 2^125) whose unscaled sum the pairs would overflow (2^128.4;
            // the suite's f32 reference overflows there too, so the output
            // is checked for that row's answer instead): the key does not
            // fit, so its tile is not taken on pairs, and row 0 of head 0,
            // whose softmax that key takes whole, comes out as its value row.
            let mut huge = case.clone();
            huge.q
                .set(huge.problem.q.index([0, 0, 0, 7]), 2f64.powf(56.9));
            huge.k
                .set(huge.problem.k.index([0, 150, 0, 7]), 2f64.powf(71.5));
            let out = one.forward(&huge.problem, huge.inputs()).unwrap().out;
            for c in 0..shape.head_dim_v {
                let got = out.get(huge.problem.out.index([0, 0, 0, c]));
                let want = huge.v.get(huge.problem.v.index([0, 150, 0, c]));
                assert_eq!(got, want, "case {i}, huge score, column {c}");
            }
            // A subnormal in a query row: with one block (the last case's
            // two queries times a group of 2 on one K/V head), no pair
            // tile at all.
            if shape.batch * shape.kv_heads == 1 {
                case.q.set(case.problem.q.index([0, 0, 0, 3]), -1e-39);
                let before = tiles(d);
                assert_eq!(
                    check_case(&one, &case),
                    Ok(Outcome::Passed),
                    "case {i}, subnormal query"
                );
                assert_eq!(
                    tiles(d),
                    before,
                    "case {i}: pair tiles with a subnormal query"
                );
            }
        }
    }
    /// Decoding through the backend with value head dims that are
    /// multiples of 32: `P V` takes the pairs on blocks of 1 to 4 rows
    /// (tiles of an odd and an even number of keys), the result passes
    /// the conformance check and is bitwise alike for 1 and 3 threads; a
    /// subnormal in a value row sends its tile to the f32 kernel (counted
    /// there), and the result still passes. The dims (160, 224) are this
    /// test's alone, so the tile counts are its own.
    #[test]
    fn decoding_values_on_pairs_pass_the_check_and_fall_back_per_tile() {
        use attn_conformance::{check_case, Outcome};
        use attn_spec::{AttnOptions, Shape};
        use std::sync::atomic::Ordering::Relaxed;
        let Some((one, three)) = engines() else {
            return;
        };
        let tiles = |d: usize| {
            (
                VALUE_TILES[d][0].load(Relaxed),
                VALUE_TILES[d][1].load(Relaxed),
            )
        };
        for (i, (shape, options)) in [
            // Groups of 4 and 1 rows; 300 keys: a last tile of 44.
            (Shape::new(2, 8, 2, 1, 300, 160), AttnOptions::default()),
            (
                Shape::new(1, 2, 2, 1, 300, 160),
                AttnOptions::default().with_lse(),
            ),
            // Two positions times a group of 2 (causal), and a group of
            // 3; 97 keys: a last tile of 33.
            (
                Shape::new(1, 4, 2, 2, 97, 224),
                AttnOptions::default().causal(),
            ),
            (Shape::new(1, 6, 2, 1, 97, 224), AttnOptions::default()),
            // A group of 2, one position.
            (Shape::new(1, 4, 2, 1, 97, 224), AttnOptions::default()),
        ]
        .into_iter()
        .enumerate()
        {
            let d = shape.head_dim_v;
            let seeded = (shape, options, 40 + i as u64);
            let mut case = passes_on_pairs((&one, &three), seeded, || tiles(d), i);
            // A subnormal in key 70's value row (its K/V head 0, dim 5).
            let at = case.problem.v.index([0, 70, 0, 5]);
            case.v.set(at, 1e-39);
            let before = tiles(d);
            let redone = crate::decode::VALUE_REDONE[d].load(Relaxed);
            assert_eq!(
                check_case(&one, &case),
                Ok(Outcome::Passed),
                "case {i}, subnormal value"
            );
            let after = tiles(d);
            assert!(
                after.1 > before.1 && after.0 > before.0,
                "case {i}: {before:?} {after:?}"
            );
            // Each tile that did not fit was computed again on the f32
            // kernel (the bound's floor cannot tell a flushed subnormal,
            // and the bf16 output would flush it anyway).
            assert_eq!(
                crate::decode::VALUE_REDONE[d].load(Relaxed) - redone,
                after.1 - before.1,
                "case {i}: tiles redone"
            );
        }
    }
}
