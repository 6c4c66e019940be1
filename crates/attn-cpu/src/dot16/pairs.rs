//! The bf16 pass's data in and out of pairs: the query rows transposed
//! into a panel of pairs, value rows packed in pairs of keys, the
//! probabilities stored in pairs as the softmax forms them, and the output
//! rows written from the running output.

use super::check::Span;
use crate::blocking::LANES;
use crate::simd::avx512::V16;
use crate::simd::Vector;
use crate::work::Item;
use attn_spec::View;
use std::arch::x86_64::*;

/// Writes 16 rows of a block's bf16 output from its running output
/// `O^T` (`ot` at the rows' first lane, column `c` at `ot + c * w`),
/// row `i` times `f[i]`, to `dst[i]`: for each 32 columns within `dv`,
/// the scaled columns are rounded to bf16 in pairs (`vcvtne2ps2bf16`,
/// lane `i` holding row `i`'s pair), and one 16 x 16 transpose of words
/// gives each row's 32 values. Half the shuffles of transposing floats
/// and rounding each row after. It stops before the first 32 columns
/// that hold a NaN or a subnormal, which that instruction rounds unlike
/// the integer rounding of the other levels (`bf16::from_f32`), so
/// results stay bitwise those of the f32 pass's write; returns the
/// columns written.
///
/// # Safety
/// `ot + c * w + i` readable for `c < dv`, `i < 16`; `dst[i] + c`
/// writable for `c < dv`; the CPU runs the `avx512bf16` level (AVX-512
/// F, BW, DQ and BF16).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
pub unsafe fn write_rows_bf16(
    ot: *const f32,
    w: usize,
    f: &[f32; LANES],
    dst: &[*mut u16; LANES],
    dv: usize,
) -> usize {
    // SAFETY: every access is within the extents above; the CPU runs
    // the features enabled.
    unsafe {
        let fv = _mm512_loadu_ps(f.as_ptr());
        let mut c0 = 0;
        while c0 + 2 * LANES <= dv {
            let mut blk = [V16::ZERO; LANES];
            let mut odd: __mmask16 = 0;
            for (i, b) in blk.iter_mut().enumerate() {
                let col = |c: usize| _mm512_mul_ps(_mm512_loadu_ps(ot.add(c * w)), fv);
                let (x, y) = (col(c0 + 2 * i), col(c0 + 2 * i + 1));
                // Quiet and signalling NaN, subnormal.
                odd |= _mm512_fpclass_ps_mask::<0xa1>(x) | _mm512_fpclass_ps_mask::<0xa1>(y);
                *b = V16(_mm512_castsi512_ps(super::kernels::interleave16(x, y)));
            }
            if odd != 0 {
                break;
            }
            for (i, t) in V16::transpose16(blk).into_iter().enumerate() {
                _mm512_storeu_ps(dst[i].add(c0).cast(), t.0);
            }
            c0 += 2 * LANES;
        }
        c0
    }
}

/// Rounds two vectors of probabilities (keys `2i` and `2i + 1`) to
/// bf16 and stores them as 16 words, lane `r` holding row `r`'s pair.
///
/// # Safety
/// `p..p+16` writable; the CPU runs AVX-512 BW and BF16.
#[inline(always)]
pub(super) unsafe fn store_pairs(p: *mut u32, e0: V16, e1: V16) {
    // SAFETY: forwarded from the caller. (A subnormal probability is
    // flushed to 0, within the bound's 2^-125 allowance.)
    unsafe { _mm512_storeu_si512(p.cast(), super::kernels::interleave16(e0.0, e1.0)) };
}

/// Packs the block's query rows into the pair panel at `qp` (`d2` rows
/// of `w` words: word `e * w + r` holds row `r`'s elements `2e` and
/// `2e + 1`); lanes past the block are zero. Sixteen rows at a time through
/// 16 x 16 transposes of words (shuffles only: bit-exact). Returns
/// whether every element [`fits`](super::fits).
///
/// # Safety
/// `qp..qp + d2 * w` writable; rows of Q contiguous; the CPU runs
/// AVX-512 F and BW.
#[inline(always)]
pub(super) unsafe fn pack_q_pairs(
    q: &[u16],
    view: &View,
    item: &Item,
    (d2, w): (usize, usize),
    qp: *mut u32,
) -> bool {
    let n = item.rows();
    assert!(view.strides[3] == 1 && w.is_multiple_of(LANES));
    let mut bad = false;
    // SAFETY: the CPU runs AVX-512 BW (this function's contract).
    let mut span = unsafe { Span::new() };
    for r0 in (0..w).step_by(LANES) {
        let live = n.saturating_sub(r0).min(LANES);
        // Row i's d2 words (null past the block).
        let src: [*const u32; LANES] = std::array::from_fn(|i| {
            if i < live {
                let (pos, h) = item.row(r0 + i);
                let at = view.index([item.b, pos, h, 0]);
                q[at..at + 2 * d2].as_ptr().cast::<u32>()
            } else {
                std::ptr::null()
            }
        });
        let mut e0 = 0;
        while e0 + LANES <= d2 {
            let mut blk = [V16::ZERO; LANES];
            for (b, &s) in blk.iter_mut().zip(&src) {
                if !s.is_null() {
                    // SAFETY: src[i] holds d2 words (unaligned loads)
                    // and e0 + 16 <= d2; the CPU runs AVX-512 BW.
                    unsafe {
                        *b = V16::load(s.add(e0).cast::<f32>());
                        span.add(_mm512_castps_si512(b.0));
                    }
                }
            }
            for (i, t) in V16::transpose16(blk).into_iter().enumerate() {
                // SAFETY: (e0 + i) * w + r0 + 16 <= d2 * w (the
                // caller's extent).
                unsafe { t.store(qp.add((e0 + i) * w + r0).cast::<f32>()) };
            }
            e0 += LANES;
        }
        for e in e0..d2 {
            for (i, &s) in src.iter().enumerate() {
                // SAFETY: a non-null src[i] holds d2 words; e < d2; the
                // panel holds d2 x w words.
                unsafe {
                    let x = if s.is_null() {
                        0
                    } else {
                        s.add(e).read_unaligned()
                    };
                    if !(super::fits(x as u16) && super::fits((x >> 16) as u16)) {
                        bad = true;
                    }
                    *qp.add(e * w + r0 + i) = x;
                }
            }
        }
    }
    // SAFETY: the CPU runs AVX-512 BW (this function's contract).
    !bad && unsafe { span.fits() }
}

/// Packs pairs `pairs` of value rows `j0..j0+n` (batch `b`, head `g`):
/// word `i * vs + c` holds `V[j0 + 2i][c]` (low half) and
/// `V[j0 + 2i + 1][c]` (high half; 0 past the tile). Returns whether
/// every value it packed [`fits`](super::fits).
///
/// # Safety
/// `vp..vp + ceil(n/2) * vs` writable, `vs >= d`; the CPU runs AVX-512
/// F and BW.
#[inline(always)]
pub(super) unsafe fn pack_v_pairs(
    v: &[u16],
    view: &View,
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    pairs: std::ops::Range<usize>,
    d: usize,
    (vp, vs): (*mut u32, usize),
) -> bool {
    let contiguous = view.strides[3] == 1 || d == 1;
    let elem = |j: usize, c: usize| v[view.index([b, j, g, 0]) + c * view.strides[3]];
    assert!(pairs.end <= n.div_ceil(2));
    let mut fit = true;
    // SAFETY: the CPU runs AVX-512 BW (this function's contract).
    let mut span = unsafe { Span::new() };
    for i in pairs {
        let (ja, jb) = (j0 + 2 * i, j0 + 2 * i + 1);
        let has_b = 2 * i + 1 < n;
        // SAFETY: row i of the packed tile (d <= vs words) is within the
        // caller's extent; the row loads read d elements of rows ja and
        // jb, which the views place inside `v`; the CPU runs AVX-512 F
        // and BW (this function's contract).
        unsafe {
            let dst = vp.add(i * vs);
            let mut c = 0;
            if contiguous {
                let ra = v[view.index([b, ja, g, 0])..][..d].as_ptr();
                let rb = if has_b {
                    v[view.index([b, jb, g, 0])..][..d].as_ptr()
                } else {
                    std::ptr::null()
                };
                // Word 2l of `lo` takes a's element l, word 2l + 1 b's
                // (index 32 + l picks the second operand); `hi` the
                // same for elements 16..32.
                let lo = _mm512_set_epi16(
                    47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                    5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0,
                );
                let hi = _mm512_set_epi16(
                    63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22,
                    53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16,
                );
                while c + 32 <= d {
                    let a = _mm512_loadu_si512(ra.add(c).cast());
                    let bb = if has_b {
                        _mm512_loadu_si512(rb.add(c).cast())
                    } else {
                        _mm512_setzero_si512()
                    };
                    span.add(a);
                    span.add(bb);
                    _mm512_storeu_si512(dst.add(c).cast(), _mm512_permutex2var_epi16(a, lo, bb));
                    _mm512_storeu_si512(
                        dst.add(c + 16).cast(),
                        _mm512_permutex2var_epi16(a, hi, bb),
                    );
                    c += 32;
                }
            }
            for c in c..d {
                let (ha, hb) = (elem(ja, c), if has_b { elem(jb, c) } else { 0 });
                fit &= super::fits(ha) && super::fits(hb);
                *dst.add(c) = ha as u32 | (hb as u32) << 16;
            }
        }
    }
    // SAFETY: the CPU runs AVX-512 BW (this function's contract).
    fit && unsafe { span.fits() }
}

/// The backward's key block `j0..j0 + n` of (batch `b`, K/V head `g`)
/// as pairs, straight from the bf16 inputs: `K^T` and `V^T` as pairs of
/// their rows (`kt2`, `vt2`: `dk / 2` and `dv / 2` rows of `ld` words, 0
/// past `n`; [`transpose_pairs`]) and K as pairs of keys (`k2r`:
/// `ceil(n / 2)` rows of `ks` words, an odd last key paired with 0, words
/// `dk..ks` 0; [`pack_v_pairs`]). Returns whether every element of the
/// block's K and V
/// rows is 0 or in `win`.
///
/// # Safety
/// K's and V's rows are contiguous (`strides[3] == 1`) and `dk`, `dv`
/// even; `kt2`, `vt2` hold `dk / 2`, `dv / 2` rows of `ld >=
/// round_up(n, 16)` words and `k2r` `ceil(n / 2)` rows of `ks >= dk`
/// words; the CPU runs AVX-512 F, BW and BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn key_block_pairs(
    (k, kv): (&[u16], &View),
    (v, vv): (&[u16], &View),
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    (dk, dv): (usize, usize),
    (kt2, vt2, ld): (*mut u32, *mut u32, usize),
    (k2r, ks): (*mut u32, usize),
    win: super::Window,
) -> bool {
    assert!(kv.strides[3] == 1 && vv.strides[3] == 1 && dk % 2 == 0 && dv % 2 == 0 && ks >= dk);
    if n == 0 {
        return true;
    }
    let mut fit = true;
    for (x, view, d, dst) in [(k, kv, dk, kt2), (v, vv, dv, vt2)] {
        let (base, rs) = (view.index([b, j0, g, 0]), view.strides[1]);
        assert!(base + (n - 1) * rs + d <= x.len());
        // SAFETY: rows j0..j0 + n of d elements lie inside x (asserted);
        // the destinations are the caller's.
        fit &= unsafe { transpose_pairs((x[base..].as_ptr(), rs), (n, d / 2), (dst, ld), win) };
    }
    // K's elements were checked in K^T.
    // SAFETY: k2r holds ceil(n / 2) rows of ks >= dk words; the rows lie
    // inside k (the view's).
    let _ = unsafe { pack_v_pairs(k, kv, (b, g), (j0, n), 0..n.div_ceil(2), dk, (k2r, ks)) };
    for i in 0..n.div_ceil(2) {
        // SAFETY: words dk..ks of row i are inside k2r (the caller's).
        unsafe { std::ptr::write_bytes(k2r.add(i * ks + dk), 0, ks - dk) };
    }
    fit
}

/// Rows `0..n` of a bf16 matrix (row `r`: `2 * w` elements at `src + r
/// * rs`) transposed as words into `dst` (`w` rows of `ld` words): word
/// `(c, r)` holds row `r`'s elements `2c` (low half) and `2c + 1`, and
/// words `(c, n..round_up(n, 16))` are 0. A K or V block of the backward
/// as `K^T` and `V^T` in pairs of their rows, straight from the input
/// rows: 16 x 16 transposes of words, bit moves only. Returns whether
/// every element is 0 or in `win`.
///
/// # Safety
/// Elements `0..2 w` of each row `r < n` readable; `dst + c * ld + r`
/// writable for `c < w`, `r < round_up(n, 16) <= ld`; the CPU runs
/// AVX-512 F and BW.
#[inline(always)]
pub(super) unsafe fn transpose_pairs(
    (src, rs): (*const u16, usize),
    (n, w): (usize, usize),
    (dst, ld): (*mut u32, usize),
    win: super::Window,
) -> bool {
    assert!(n.div_ceil(LANES) * LANES <= ld);
    let mut bad: __mmask32 = 0;
    // SAFETY: every access is within the extents above; the CPU runs the
    // features the caller guarantees.
    unsafe {
        for r0 in (0..n).step_by(LANES) {
            let rows = (n - r0).min(LANES);
            for c0 in (0..w).step_by(LANES) {
                let cols = (w - c0).min(LANES);
                let keep: __mmask16 = if cols == LANES { !0 } else { (1 << cols) - 1 };
                // (A loop, not a closure: it would lose the target features.)
                let mut blk = [V16::ZERO; LANES];
                for (r, b) in blk.iter_mut().enumerate().take(rows) {
                    let row = src.add((r0 + r) * rs + 2 * c0).cast::<i32>();
                    let x = _mm512_maskz_loadu_epi32(keep, row);
                    bad |= super::check::misfits_in(x, win);
                    *b = V16(_mm512_castsi512_ps(x));
                }
                for (c, t) in V16::transpose16(blk).into_iter().take(cols).enumerate() {
                    t.store(dst.add((c0 + c) * ld + r0).cast());
                }
            }
        }
    }
    bad == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Isa;
    use attn_spec::bf16;

    /// The bf16 output write rounds each scaled value as `bf16::from_f32`
    /// does (ties to even included), stops before 32 columns that hold a
    /// NaN or a subnormal, and writes nothing past the columns it reports.
    #[test]
    fn bf16_rows_round_as_from_f32_and_stop_before_nan_or_subnormal() {
        if !Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let (dv, w) = (100, 32);
        // (column, row, value) put into O^T, and the columns written.
        let cases = [
            (None, 96),
            (Some((40, 3, f32::NAN)), 32),
            (Some((70, 15, 1e-39)), 64),
            (Some((5, 0, -f32::NAN)), 0),
            (Some((97, 2, f32::NAN)), 96),
        ];
        for (odd, want) in cases {
            // Values of every size and sign, some halfway between two bf16
            // (1 + 2^-8 times a power of two: a tie) and some just off it.
            let mut ot: Vec<f32> = (0..dv * w)
                .map(|i| {
                    let x = ((i * 2_654_435_761) % 1_000_003) as f32 / 1_000_003.0 - 0.5;
                    match i % 5 {
                        0 => (1.0 + 2f32.powi(-8)) * 2f32.powi((i % 40) as i32 - 20),
                        1 => (1.0 + 3.0 * 2f32.powi(-8)) * -2f32.powi((i % 7) as i32),
                        _ => x * 2f32.powi((i % 60) as i32 - 30),
                    }
                })
                .collect();
            if let Some((c, r, x)) = odd {
                ot[c * w + r] = x;
            }
            let f: [f32; 16] = std::array::from_fn(|i| [1.0, 0.5, 0.37, 2.0][i % 4]);
            let mut out = vec![0xdeadu16; 16 * dv];
            let dst: [*mut u16; 16] = std::array::from_fn(|i| out[i * dv..].as_mut_ptr());
            // SAFETY: O^T holds dv x w floats, the rows 16 x dv words; the
            // CPU runs the level (checked above).
            let got = unsafe { write_rows_bf16(ot.as_ptr(), w, &f, &dst, dv) };
            assert_eq!(got, want, "{odd:?}");
            for i in 0..16 {
                for c in 0..dv {
                    let at = out[i * dv + c];
                    match c < got {
                        true => assert_eq!(
                            at,
                            bf16::from_f32(ot[c * w + i] * f[i]).to_bits(),
                            "{odd:?}: row {i} column {c}"
                        ),
                        false => assert_eq!(at, 0xdead, "{odd:?}: row {i} column {c} written"),
                    }
                }
            }
        }
    }

    /// The backward's key block in pairs straight from bf16 rows: K^T and
    /// V^T word by word as the scalar pairing, 0 past the keys, K in pairs
    /// of keys (an odd last key with 0), for blocks of 1 to 96 keys, head
    /// dims that leave a partial 16 words, and a view with batch and head
    /// strides; a value outside the window is reported.
    #[test]
    fn key_block_pairs_match_scalar_pairing() {
        if !Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let (batch, seq, heads) = (2usize, 130usize, 3usize);
        for (dk, dv) in [(64usize, 40usize), (2, 128)] {
            let (kv, vv) = (
                View::bshd(batch, seq, heads, dk),
                View::bshd(batch, seq, heads, dv),
            );
            let val =
                |i: usize| bf16::from_f32(((i * 37 + 11) % 101) as f32 * 0.031 - 1.5).to_bits();
            let k: Vec<u16> = (0..batch * seq * heads * dk).map(val).collect();
            let mut v: Vec<u16> = (0..batch * seq * heads * dv).map(|i| val(i + 7)).collect();
            let word = |lo: u16, hi: u16| lo as u32 | (hi as u32) << 16;
            for (j0, n) in [(0usize, 96usize), (96, 34), (5, 1), (33, 17)] {
                let (b, g, ld, ks) = (1usize, 2usize, 96usize, dk + 16);
                let mut kt2 = vec![u32::MAX; dk / 2 * ld];
                let mut vt2 = vec![u32::MAX; dv / 2 * ld];
                let mut k2r = vec![u32::MAX; n.div_ceil(2) * ks];
                // SAFETY: the extents as the contract states; the CPU runs
                // the level (checked).
                let fit = unsafe {
                    key_block_pairs(
                        (&k, &kv),
                        (&v, &vv),
                        (b, g),
                        (j0, n),
                        (dk, dv),
                        (kt2.as_mut_ptr(), vt2.as_mut_ptr(), ld),
                        (k2r.as_mut_ptr(), ks),
                        super::super::BACKWARD,
                    )
                };
                assert!(fit);
                let at =
                    |x: &[u16], view: &View, j: usize, c: usize| x[view.index([b, j0 + j, g, c])];
                for (t, x, view, d) in [(&kt2, &k, &kv, dk), (&vt2, &v, &vv, dv)] {
                    for c in 0..d / 2 {
                        for r in 0..n.div_ceil(16) * 16 {
                            let want = match r < n {
                                true => word(at(x, view, r, 2 * c), at(x, view, r, 2 * c + 1)),
                                false => 0,
                            };
                            assert_eq!(
                                t[c * ld + r],
                                want,
                                "d {d} block ({j0}, {n}) word ({c}, {r})"
                            );
                        }
                    }
                }
                for kp in 0..n.div_ceil(2) {
                    for c in 0..ks {
                        let want = match c < dk {
                            true => {
                                let odd = 2 * kp + 1 < n;
                                let hi = if odd { at(&k, &kv, 2 * kp + 1, c) } else { 0 };
                                word(at(&k, &kv, 2 * kp, c), hi)
                            }
                            false => 0,
                        };
                        assert_eq!(k2r[kp * ks + c], want, "k2r ({kp}, {c})");
                    }
                }
            }
            // A subnormal value inside a block is reported, outside not.
            v[vv.index([1, 40, 2, dv - 1])] = bf16::from_f32(1e-39).to_bits();
            for (j0, n, want) in [(0usize, 48usize, false), (48, 8, true)] {
                let mut t = vec![0u32; 128 / 2 * 96];
                let mut k2r = vec![0u32; 48 * (dk + 16)];
                // SAFETY: as above.
                let fit = unsafe {
                    key_block_pairs(
                        (&k, &kv),
                        (&v, &vv),
                        (1, 2),
                        (j0, n),
                        (dk, dv),
                        (t.as_mut_ptr(), t.as_mut_ptr(), 96),
                        (k2r.as_mut_ptr(), dk + 16),
                        super::super::BACKWARD,
                    )
                };
                assert_eq!(fit, want, "block ({j0}, {n})");
            }
        }
    }
}
