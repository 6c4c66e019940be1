//! The two microkernels of `microkernel/` on bf16 pairs: `vdpbf16ps`
//! multiplies 16 pairs of bf16 and adds both products of each pair to one
//! f32 lane, so one instruction does the work of two FMAs. Query rows stay
//! along the lanes; the pair runs along the sum of each product: the head
//! dimension for `Q K^T`, the keys for `P V`.
//!
//! Contract as `microkernel/` (`M <= mr(NV)`, `NV <= 4`, unaligned
//! pointers, plain stores), with "word" meaning a pair of bf16 (32 bits,
//! the first element in the low half): the query panel has `d / 2` rows of
//! `ld` words, the probability tile `ceil(n / 2)` rows of `ld` words, the
//! packed values `ceil(n / 2)` rows of `vs` words. Each kernel is compiled
//! out of line for the shapes the AVX-512 level uses, so its registers are
//! its own whatever loop nest calls it; tested against scalar sums below.

// Index loops on purpose: they unroll in place.
#![allow(clippy::needless_range_loop)]

use super::PairOut;
use crate::microkernel::dispatch_m;
use crate::simd::avx512::V16;
use std::arch::x86_64::*;

/// 16 words (32 bf16) at `p` as a dot-product operand.
///
/// # Safety
/// `p..p+16` readable; the CPU runs AVX-512 F.
#[inline(always)]
unsafe fn load_pairs(p: *const u32) -> __m512bh {
    // SAFETY: forwarded from the caller; __m512bh is 512 plain bits.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.cast())) }
}

/// 32 bf16 zeros.
#[inline(always)]
fn zero_pairs() -> __m512bh {
    // SAFETY: __m512bh is 512 plain bits; the CPU runs AVX-512 F wherever
    // these kernels run.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()) }
}

/// The word at `p` in all 16 lanes.
///
/// # Safety
/// `p..p+1` readable (any alignment); the CPU runs AVX-512 F.
#[inline(always)]
unsafe fn splat_pair(p: *const u32) -> __m512bh {
    // SAFETY: forwarded from the caller; __m512bh is 512 plain bits.
    unsafe {
        let w = p.read_unaligned();
        std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(w as i32))
    }
}

/// `S^T[j][r] = c * sum_e K[j][e] Q[r][e]` for `M` keys and `NV * 16` rows.
/// `k` points at key 0's bf16 (`d2` words, keys `k_stride` bf16 apart),
/// `qp` at the rows' columns of the pair panel (`d2` rows of words, `ld`
/// apart), `s` at `M` rows of `NV * 16` floats, `ld` apart. Each row's
/// largest score of the `M` is folded into `mx[r]` (`NV * 16` running
/// maxima), while the scores are in registers. (`_V` fills `dispatch_m!`'s
/// vector slot.)
///
/// # Safety
/// `k + j * k_stride + e` readable for `j < M`, `e < 2 * d2`;
/// `qp + e * ld + c` readable and `s + j * ld + c` writable for `e < d2`,
/// `j < M`, `c < NV * 16`; `mx + c` readable and writable for `c < NV *
/// 16`; the CPU runs AVX-512 F and BF16.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::extra_unused_type_parameters)]
unsafe fn scores<_V, const M: usize, const NV: usize>(
    k: *const u16,
    k_stride: usize,
    qp: *const u32,
    ld: usize,
    d2: usize,
    c: f32,
    s: *mut f32,
    mx: *mut f32,
) {
    // SAFETY: every access is within the extents of the contract above.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; M];
        for e in 0..d2 {
            let mut q = [zero_pairs(); NV];
            for v in 0..NV {
                q[v] = load_pairs(qp.add(e * ld + v * 16));
            }
            for m in 0..M {
                let kp = splat_pair(k.add(m * k_stride + 2 * e).cast());
                for v in 0..NV {
                    acc[m][v] = _mm512_dpbf16_ps(acc[m][v], kp, q[v]);
                }
            }
        }
        let cv = _mm512_set1_ps(c);
        let mut top = [_mm512_setzero_ps(); NV];
        for v in 0..NV {
            top[v] = _mm512_loadu_ps(mx.add(v * 16));
        }
        for m in 0..M {
            for v in 0..NV {
                let x = _mm512_mul_ps(acc[m][v], cv);
                top[v] = _mm512_max_ps(top[v], x);
                _mm512_storeu_ps(s.add(m * ld + v * 16), x);
            }
        }
        for v in 0..NV {
            _mm512_storeu_ps(mx.add(v * 16), top[v]);
        }
    }
}

/// Where the `P V` kernel starts from: the running output as it is, the
/// running output times each row's rescale factor, or zero (the item's
/// first product: the running output is not read).
#[derive(Clone, Copy, Debug)]
pub enum Start<'a> {
    /// `O^T` as it is.
    Load,
    /// `O^T` times `alpha[r]` for the rows of vector `r`.
    Scaled(&'a [V16]),
    /// Zero.
    Zero,
}

/// `O^T[c][r] = alpha[r] O^T[c][r] + sum_j V[j][c] P[r][j]` for `M` value
/// columns and `NV * 16` rows over `n2` pairs of keys. `vp` points at
/// column `c0` of the packed values (word `i * vs + c` holds `V[2i][c]`,
/// `V[2i+1][c]`), `pp` at the rows' columns of the probability pairs (`n2`
/// rows of words, `ps` apart), `ot` at `M` rows of `NV * 16` running
/// outputs, `ld` apart.
///
/// # Safety
/// `vp + i * vs + c` readable for `i < n2`, `c < M`; `pp + i * ps + r`
/// readable for `i < n2`, `r < NV * 16`; `ot + c * ld + r` readable and
/// writable for `c < M`, `r < NV * 16`; `Start::Scaled` holds `NV`
/// factors; the CPU runs AVX-512 F and BF16.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::extra_unused_type_parameters)]
unsafe fn pv<_V, const M: usize, const NV: usize>(
    vp: *const u32,
    vs: usize,
    (pp, ps): (*const u32, usize),
    ld: usize,
    n2: usize,
    ot: *mut f32,
    start: Start<'_>,
) {
    // SAFETY: every access is within the extents of the contract above.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; M];
        for c in 0..M {
            for r in 0..NV {
                acc[c][r] = match start {
                    Start::Zero => continue,
                    Start::Load => _mm512_loadu_ps(ot.add(c * ld + r * 16)),
                    Start::Scaled(a) => {
                        _mm512_mul_ps(_mm512_loadu_ps(ot.add(c * ld + r * 16)), a[r].0)
                    }
                };
            }
        }
        for i in 0..n2 {
            let mut p = [zero_pairs(); NV];
            for r in 0..NV {
                p[r] = load_pairs(pp.add(i * ps + r * 16));
            }
            for c in 0..M {
                let x = splat_pair(vp.add(i * vs + c));
                for r in 0..NV {
                    acc[c][r] = _mm512_dpbf16_ps(acc[c][r], x, p[r]);
                }
            }
        }
        for c in 0..M {
            for r in 0..NV {
                _mm512_storeu_ps(ot.add(c * ld + r * 16), acc[c][r]);
            }
        }
    }
}

/// [`scores`] on `nv` vectors and `m` keys chosen at run time.
///
/// # Safety
/// As [`scores`] with `NV = nv`, `M = m`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn scores_part(
    nv: usize,
    m: usize,
    k: *const u16,
    k_stride: usize,
    qp: *const u32,
    ld: usize,
    d2: usize,
    c: f32,
    s: *mut f32,
    mx: *mut f32,
) {
    assert!((1..=4).contains(&nv) && (1..=mr(nv)).contains(&m));
    // SAFETY: forwarded from the caller.
    unsafe {
        match nv {
            1 => dispatch_m!(V16, 1, 12, m, scores(k, k_stride, qp, ld, d2, c, s, mx)),
            2 => dispatch_m!(V16, 2, 12, m, scores(k, k_stride, qp, ld, d2, c, s, mx)),
            3 => dispatch_m!(V16, 3, 8, m, scores(k, k_stride, qp, ld, d2, c, s, mx)),
            _ => dispatch_m!(V16, 4, 6, m, scores(k, k_stride, qp, ld, d2, c, s, mx)),
        }
    }
}

/// [`pv`] on `nv` vectors and `m` value columns chosen at run time.
///
/// # Safety
/// As [`pv`] with `NV = nv`, `M = m`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn pv_part(
    nv: usize,
    m: usize,
    vp: *const u32,
    vs: usize,
    pp: (*const u32, usize),
    ld: usize,
    n2: usize,
    ot: *mut f32,
    start: Start<'_>,
) {
    assert!((1..=4).contains(&nv) && (1..=mr(nv)).contains(&m));
    assert!(!matches!(start, Start::Scaled(a) if a.len() < nv));
    // SAFETY: forwarded from the caller.
    unsafe {
        match nv {
            1 => dispatch_m!(V16, 1, 12, m, pv(vp, vs, pp, ld, n2, ot, start)),
            2 => dispatch_m!(V16, 2, 12, m, pv(vp, vs, pp, ld, n2, ot, start)),
            3 => dispatch_m!(V16, 3, 8, m, pv(vp, vs, pp, ld, n2, ot, start)),
            _ => dispatch_m!(V16, 4, 6, m, pv(vp, vs, pp, ld, n2, ot, start)),
        }
    }
}

/// One `12 x (NV * 16)` tile of [`gemm_pairs`] over `k2` pairs.
///
/// # Safety
/// As [`gemm_pairs`], for rows `0..12` and columns `0..NV * 16` at the
/// pointers given.
#[inline(always)]
unsafe fn pair_tile<const NV: usize>(
    k2: usize,
    (a, a_rs, a_cs): (*const u32, usize, usize),
    (b, b_rs): (*const u32, usize),
    (c, c_rs, out): (*mut f32, usize, PairOut),
) {
    const MR: usize = 12;
    // SAFETY: every access is within the extents of the contract above.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        for kk in 0..k2 {
            let mut bv = [zero_pairs(); NV];
            for v in 0..NV {
                bv[v] = load_pairs(b.add(kk * b_rs + 16 * v));
            }
            for r in 0..MR {
                let av = splat_pair(a.add(r * a_rs + kk * a_cs));
                for v in 0..NV {
                    acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
                }
            }
        }
        for r in 0..MR {
            for v in 0..NV {
                let at = c.add(r * c_rs + 16 * v);
                let x = match out {
                    PairOut::Set => acc[r][v],
                    PairOut::Add(f) => {
                        _mm512_fmadd_ps(acc[r][v], _mm512_set1_ps(f), _mm512_loadu_ps(at))
                    }
                };
                _mm512_storeu_ps(at, x);
            }
        }
    }
}

/// `C[m x n] = A[m x k] B[k x n]` on pairs (the backward pass's five
/// products): word `(r, kk)` of `A` at `a + r * a_rs + kk * a_cs` holds
/// the pair of row `r`'s elements `2kk`, `2kk + 1`; `B` row `kk` is `n`
/// words at `b + kk * b_rs` (column `c`'s elements `2kk`, `2kk + 1`); `C`
/// rows of `n` floats, `c_rs` apart, overwritten or added into as `out`
/// says. Tiles of 12 rows x 32
/// columns (24 accumulators, two streamed vectors, one broadcast), and 12
/// x 16 for a last 16 columns.
///
/// # Safety
/// `m` a multiple of 12 and `n` of 16; every word named above readable
/// and every float of `C` writable (and readable with `PairOut::Add`);
/// the CPU runs AVX-512 F and BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
pub unsafe fn gemm_pairs(
    (m, n, k2): (usize, usize, usize),
    (a, a_rs, a_cs): (*const u32, usize, usize),
    (b, b_rs): (*const u32, usize),
    (c, c_rs, out): (*mut f32, usize, PairOut),
) {
    assert!(m.is_multiple_of(12) && n.is_multiple_of(16));
    // SAFETY: every tile is within the extents of the contract above.
    unsafe {
        for r0 in (0..m).step_by(12) {
            let at = (a.add(r0 * a_rs), a_rs, a_cs);
            let mut c0 = 0;
            while c0 + 32 <= n {
                pair_tile::<2>(
                    k2,
                    at,
                    (b.add(c0), b_rs),
                    (c.add(r0 * c_rs + c0), c_rs, out),
                );
                c0 += 32;
            }
            if c0 < n {
                pair_tile::<1>(
                    k2,
                    at,
                    (b.add(c0), b_rs),
                    (c.add(r0 * c_rs + c0), c_rs, out),
                );
            }
        }
    }
}

/// Word `i` = bf16 of `lo[i]` (low half) and `hi[i]` (high half), rounded
/// to nearest even: `vcvtne2ps2bf16` then a word interleave. A subnormal
/// lane comes out as 0 (the conversion flushes it).
///
/// # Safety
/// The CPU runs AVX-512 BW and BF16.
#[inline(always)]
pub(super) unsafe fn interleave16(lo: __m512, hi: __m512) -> __m512i {
    // SAFETY: forwarded from the caller.
    unsafe {
        // bf16 0..16: lo's lanes; 16..32: hi's.
        let both = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
        let idx = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        _mm512_permutexvar_epi16(idx, both)
    }
}

/// Rounds `x[r][c] * f` to bf16 (nearest even) as words of row pairs:
/// word `rp * ld_d + c` of `dst` holds rows `2rp` and `2rp + 1` of column
/// `c`, for `rp < ceil(rows / 2)` (a row past `rows` reads as 0), `c <
/// cols`. `x` rows are `ld` floats apart.
///
/// # Safety
/// `src + r * ld + c` readable for `r < rows`, `c < cols`; `dst + rp *
/// ld_d + c` writable as above; `cols` a multiple of 16; every `x * f` a
/// normal f32 or 0 (a subnormal would be flushed); the CPU runs AVX-512
/// BW and BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
pub unsafe fn round_row_pairs(
    (src, ld): (*const f32, usize),
    (rows, cols): (usize, usize),
    f: f32,
    (dst, ld_d): (*mut u32, usize),
) {
    assert!(cols.is_multiple_of(16));
    // SAFETY: every access is within the extents of the contract above.
    unsafe {
        let fv = _mm512_set1_ps(f);
        for rp in 0..rows.div_ceil(2) {
            let e = src.add(2 * rp * ld);
            let odd = 2 * rp + 1 < rows;
            for c in (0..cols).step_by(16) {
                let lo = _mm512_mul_ps(_mm512_loadu_ps(e.add(c)), fv);
                let hi = match odd {
                    true => _mm512_mul_ps(_mm512_loadu_ps(e.add(ld + c)), fv),
                    false => _mm512_setzero_ps(),
                };
                _mm512_storeu_si512(dst.add(rp * ld_d + c).cast(), interleave16(lo, hi));
            }
        }
    }
}

/// Rounds `x[r][c] * f` to bf16 (nearest even) in order: word `r * ld_d +
/// kp` of `dst` holds columns `2kp` and `2kp + 1` of row `r`, for `r <
/// rows`, `kp < cols / 2`. `x` rows are `ld` floats apart.
///
/// # Safety
/// As [`round_row_pairs`], with `dst + r * ld_d + kp` writable for `r <
/// rows`, `kp < cols / 2`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
pub unsafe fn round_rows(
    (src, ld): (*const f32, usize),
    (rows, cols): (usize, usize),
    f: f32,
    (dst, ld_d): (*mut u32, usize),
) {
    assert!(cols.is_multiple_of(16));
    // SAFETY: every access is within the extents of the contract above.
    unsafe {
        let fv = _mm512_set1_ps(f);
        for r in 0..rows {
            let (x, out) = (src.add(r * ld), dst.add(r * ld_d));
            let mut c = 0;
            while c + 32 <= cols {
                let lo = _mm512_mul_ps(_mm512_loadu_ps(x.add(c)), fv);
                let hi = _mm512_mul_ps(_mm512_loadu_ps(x.add(c + 16)), fv);
                // bf16 0..16: lo's lanes, 16..32: hi's: columns c..c+32 in
                // order.
                let w = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(out.add(c / 2).cast(), w);
                c += 32;
            }
            if c < cols {
                let lo = _mm512_mul_ps(_mm512_loadu_ps(x.add(c)), fv);
                let w = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(lo));
                _mm256_storeu_si256(out.add(c / 2).cast(), w);
            }
        }
    }
}

/// Packs f32 that are bf16 values into bf16 words: with `odd`, word `i`
/// holds `even[i]` and `odd[i]` (two rows interleaved), else `even[2i]`
/// and `even[2i + 1]` (one row in order; an odd length ends in 0).
/// Returns whether every element is 0 or in window `win`; it is exact either
/// way (bit moves only: the conversion instruction would flush subnormals).
///
/// # Safety
/// The CPU runs AVX-512 F, BW and BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
pub unsafe fn pack_words(
    even: &[f32],
    odd: Option<&[f32]>,
    dst: &mut [u32],
    win: super::Window,
) -> bool {
    let word = |lo: f32, hi: f32| {
        let (l, h) = ((lo.to_bits() >> 16) as u16, (hi.to_bits() >> 16) as u16);
        (
            l as u32 | (h as u32) << 16,
            super::fits_in(l, win) && super::fits_in(h, win),
        )
    };
    let mut bad: __mmask32 = 0;
    let mut ok = true;
    let n = dst.len();
    match odd {
        Some(odd) => {
            assert!(even.len() >= n && odd.len() >= n);
            // The top halves (the bf16 values, exactly: `vcvtne2ps2bf16`
            // would flush subnormals): the even row's into the low half
            // of each word, the odd row's into the high half.
            let mut i = 0;
            while i + 16 <= n {
                // SAFETY: 16 floats at i of both rows and 16 words of dst
                // (asserted lengths); the CPU runs the level.
                unsafe {
                    let e = _mm512_castps_si512(_mm512_loadu_ps(even.as_ptr().add(i)));
                    let o = _mm512_castps_si512(_mm512_loadu_ps(odd.as_ptr().add(i)));
                    let hi = _mm512_and_si512(o, _mm512_set1_epi32(0xffff_0000u32 as i32));
                    let w = _mm512_or_si512(_mm512_srli_epi32::<16>(e), hi);
                    bad |= super::check::misfits_in(w, win);
                    _mm512_storeu_si512(dst.as_mut_ptr().add(i).cast(), w);
                }
                i += 16;
            }
            for i in i..n {
                let (w, fit) = word(even[i], odd[i]);
                dst[i] = w;
                ok &= fit;
            }
        }
        None => {
            assert!(even.len() <= 2 * n && 2 * n <= even.len() + 1);
            // 16-bit element 2j + 1 of the 32 floats (the top half of
            // float j) becomes element j: one permute, exact.
            let mut idx = [0i16; 32];
            for (j, x) in idx.iter_mut().enumerate() {
                *x = 2 * j as i16 + 1;
            }
            // SAFETY: 32 i16 in idx.
            let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
            let mut i = 0;
            while 2 * i + 32 <= even.len() {
                // SAFETY: 32 floats at 2i and 16 words at i (asserted
                // lengths); the CPU runs the level.
                unsafe {
                    let a = _mm512_castps_si512(_mm512_loadu_ps(even.as_ptr().add(2 * i)));
                    let b = _mm512_castps_si512(_mm512_loadu_ps(even.as_ptr().add(2 * i + 16)));
                    let w = _mm512_permutex2var_epi16(a, idx, b);
                    bad |= super::check::misfits_in(w, win);
                    _mm512_storeu_si512(dst.as_mut_ptr().add(i).cast(), w);
                }
                i += 16;
            }
            for i in i..n {
                let hi = even.get(2 * i + 1).copied().unwrap_or(0.0);
                let (w, fit) = word(even[2 * i], hi);
                dst[i] = w;
                ok &= fit;
            }
        }
    }
    ok && bad == 0
}

/// Keys or value columns per call on `nv` vectors of rows: the AVX-512
/// level's shapes (24 accumulators, as `Vector::mr`).
pub fn mr(nv: usize) -> usize {
    match nv {
        1 | 2 => 12,
        3 => 8,
        _ => 6,
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BACKWARD, FORWARD};
    use super::*;
    use attn_spec::bf16;

    fn b(x: f32) -> u16 {
        bf16::from_f32(x).to_bits()
    }
    fn f(x: u16) -> f64 {
        bf16::from_bits(x).to_f32() as f64
    }
    fn word(lo: u16, hi: u16) -> u32 {
        lo as u32 | (hi as u32) << 16
    }

    /// Both packings against the scalar definition, with the range check.
    #[test]
    fn pack_words_interleaves_and_checks_the_range() {
        if !crate::Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let v = |i: usize| attn_spec::bf16::from_f32(i as f32 * 0.37 - 9.0).to_f32();
        for n in [1usize, 15, 16, 17, 40] {
            let e: Vec<f32> = (0..n).map(v).collect();
            let o: Vec<f32> = (0..n).map(|i| v(i + 100)).collect();
            let mut dst = vec![0u32; n];
            // SAFETY: the CPU runs the level (checked).
            assert!(unsafe { pack_words(&e, Some(&o), &mut dst, FORWARD) });
            for i in 0..n {
                assert_eq!(dst[i], word(b(e[i]), b(o[i])), "n={n} i={i}");
            }
            let mut dst = vec![0u32; n.div_ceil(2)];
            // SAFETY: as above.
            assert!(unsafe { pack_words(&e, None, &mut dst, FORWARD) });
            for i in 0..n.div_ceil(2) {
                let hi = e.get(2 * i + 1).map_or(0, |&x| b(x));
                assert_eq!(dst[i], word(b(e[2 * i]), hi), "n={n} i={i}");
            }
            // One subnormal anywhere is reported, by both.
            for at in [0, n - 1] {
                let mut e2 = e.clone();
                e2[at] = 1e-39;
                let mut dst = vec![0u32; n];
                // SAFETY: as above.
                let fit = unsafe { pack_words(&e2, Some(&o), &mut dst, FORWARD) };
                assert!(!fit, "n={n} at={at}");
                let mut dst = vec![0u32; n.div_ceil(2)];
                // SAFETY: as above.
                let fit = unsafe { pack_words(&e2, None, &mut dst, FORWARD) };
                assert!(!fit, "n={n} at={at}");
                // 2^-41 is in the forward's window, not the backward's.
                e2[at] = 2f32.powi(-41);
                let mut dst = vec![0u32; n];
                // SAFETY: as above.
                assert!(unsafe { pack_words(&e2, Some(&o), &mut dst, FORWARD) });
                // SAFETY: as above.
                let fit = unsafe { pack_words(&e2, Some(&o), &mut dst, BACKWARD) };
                assert!(!fit, "n={n} at={at}");
                let mut dst = vec![0u32; n.div_ceil(2)];
                // SAFETY: as above.
                let fit = unsafe { pack_words(&e2, None, &mut dst, BACKWARD) };
                assert!(!fit, "n={n} at={at}");
            }
        }
    }

    /// The pair product against f64 sums of the same bf16 values, within
    /// the f32 accumulation bound `gamma(2 k2) * sum |a b|`, with A's
    /// pairs along its rows and across them, on 32- and 16-column tiles.
    #[test]
    fn gemm_pairs_matches_scalar_sums() {
        if !crate::Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let val = |i: usize| ((i * 29 + 5) % 31) as f32 * 0.137 - 2.1;
        let (m, n, k2, b_rs, c_rs) = (24usize, 48usize, 7usize, 50usize, 51usize);
        let bm: Vec<u32> = (0..k2 * b_rs)
            .map(|i| word(b(val(3 * i)), b(val(3 * i + 2))))
            .collect();
        // (row stride, pair stride) of A: rows of pairs, or pairs of rows.
        for (a_rs, a_cs) in [(9usize, 1usize), (1, 27)] {
            let a: Vec<u32> = (0..m * a_rs + k2 * a_cs)
                .map(|i| word(b(val(2 * i)), b(val(2 * i + 1))))
                .collect();
            let mut c = vec![f32::NAN; m * c_rs];
            // Added into: C0 + 2^-3 (A B), one rounding each.
            let c0: Vec<f32> = (0..m * c_rs).map(|i| val(5 * i + 1)).collect();
            let mut added = c0.clone();
            // SAFETY: extents as the contract states, allocated above; the
            // CPU runs the level (checked).
            unsafe {
                gemm_pairs(
                    (m, n, k2),
                    (a.as_ptr(), a_rs, a_cs),
                    (bm.as_ptr(), b_rs),
                    (c.as_mut_ptr(), c_rs, PairOut::Set),
                );
                gemm_pairs(
                    (m, n, k2),
                    (a.as_ptr(), a_rs, a_cs),
                    (bm.as_ptr(), b_rs),
                    (added.as_mut_ptr(), c_rs, PairOut::Add(0.125)),
                );
            };
            for (i, (&x, &y)) in c.iter().zip(&c0).enumerate() {
                let want = if i % c_rs < n { y + x * 0.125 } else { y };
                assert_eq!(added[i].to_bits(), want.to_bits(), "added {i}");
            }
            for r in 0..m {
                for col in 0..n {
                    let (mut want, mut mag) = (0.0, 0.0);
                    for kk in 0..k2 {
                        let (x, y) = (a[r * a_rs + kk * a_cs], bm[kk * b_rs + col]);
                        for h in [0, 16] {
                            let t = f((x >> h) as u16) * f((y >> h) as u16);
                            want += t;
                            mag += t.abs();
                        }
                    }
                    let nu = 2.0 * k2 as f64 * 2f64.powi(-24);
                    let got = c[r * c_rs + col] as f64;
                    assert!(
                        (got - want).abs() <= nu / (1.0 - nu) * mag,
                        "A ({a_rs}, {a_cs}) r={r} c={col}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// Both roundings of a scaled tile against `bf16::from_f32` (nearest
    /// even), with an odd row count (the last pair's high half 0) and a
    /// last 16 columns.
    #[test]
    fn round_pairs_and_rows_match_scalar_rounding() {
        if !crate::Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let (rows, cols, ld) = (5usize, 48usize, 50usize);
        // Values between bf16 neighbours, ties included (x.5 ulp).
        let x: Vec<f32> = (0..rows * ld)
            .map(|i| (1.0 + (i % 97) as f32 / 256.0) * if i % 3 == 0 { -1.0 } else { 0.25 })
            .collect();
        let f = 2f32.powi(40);
        let want = |r: usize, c: usize| match r < rows {
            true => b(x[r * ld + c] * f),
            false => 0,
        };
        let mut pairs = vec![u32::MAX; rows.div_ceil(2) * 52];
        let mut along = vec![u32::MAX; rows * 30];
        // SAFETY: extents as the contracts state; every x * f is normal;
        // the CPU runs the level (checked).
        unsafe {
            round_row_pairs((x.as_ptr(), ld), (rows, cols), f, (pairs.as_mut_ptr(), 52));
            round_rows((x.as_ptr(), ld), (rows, cols), f, (along.as_mut_ptr(), 30));
        }
        for rp in 0..rows.div_ceil(2) {
            for c in 0..cols {
                let w = word(want(2 * rp, c), want(2 * rp + 1, c));
                assert_eq!(pairs[rp * 52 + c], w, "pairs rp={rp} c={c}");
            }
        }
        for r in 0..rows {
            for kp in 0..cols / 2 {
                let w = word(want(r, 2 * kp), want(r, 2 * kp + 1));
                assert_eq!(along[r * 30 + kp], w, "rows r={r} kp={kp}");
            }
            assert_eq!(along[r * 30 + cols / 2], u32::MAX, "wrote past the row");
        }
    }

    /// Both kernels on every shape against f64 sums of the same bf16
    /// values: products of bf16 are exact in f32, so the only error is the
    /// f32 accumulation of `d` (or `n`) terms, bounded by `gamma(d)` times
    /// the sum of magnitudes (`2^-24 * d / (1 - 2^-24 * d)`).
    #[test]
    fn kernels_match_scalar_sums() {
        if !crate::Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let val = |i: usize| ((i * 37 + 11) % 23) as f32 * 0.173 - 1.9;
        let gamma = |n: usize| {
            let nu = n as f64 * 2f64.powi(-24);
            nu / (1.0 - nu)
        };
        for nv in 1..=4 {
            for m in 1..=mr(nv) {
                let (d2, ld, ks, c) = (5usize, nv * 16 + 16, 13usize, 0.7f32);
                let k: Vec<u16> = (0..m * ks).map(|i| b(val(i))).collect();
                let qp: Vec<u32> = (0..d2 * ld)
                    .map(|i| word(b(val(3 * i + 1)), b(val(3 * i + 2))))
                    .collect();
                let mut s = vec![f32::NAN; m * ld];
                // Running maxima: -inf, or above every score in odd rows.
                let mut mx: Vec<f32> = (0..nv * 16)
                    .map(|r| if r % 2 == 0 { f32::NEG_INFINITY } else { 1e3 })
                    .collect();
                // SAFETY: extents as the contract states, allocated above;
                // the CPU runs the level (checked).
                unsafe {
                    scores_part(
                        nv,
                        m,
                        k.as_ptr(),
                        ks,
                        qp.as_ptr(),
                        ld,
                        d2,
                        c,
                        s.as_mut_ptr(),
                        mx.as_mut_ptr(),
                    )
                };
                for r in 0..nv * 16 {
                    let top = (0..m)
                        .map(|j| s[j * ld + r])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let want = if r % 2 == 0 { top } else { 1e3 };
                    assert_eq!(mx[r], want, "max nv={nv} m={m} r={r}");
                }
                for j in 0..m {
                    for r in 0..nv * 16 {
                        let (mut want, mut mag) = (0.0, 0.0);
                        for e in 0..2 * d2 {
                            let q = qp[(e / 2) * ld + r];
                            let qe = if e % 2 == 0 {
                                q as u16
                            } else {
                                (q >> 16) as u16
                            };
                            let t = f(k[j * ks + e]) * f(qe);
                            want += t;
                            mag += t.abs();
                        }
                        let got = s[j * ld + r] as f64;
                        let tol = (gamma(2 * d2 + 1) * mag + 1e-30) * c as f64;
                        assert!(
                            (got - c as f64 * want).abs() <= tol,
                            "scores nv={nv} m={m} j={j} r={r}: {got} vs {}",
                            c as f64 * want
                        );
                    }
                }
                // P V: n2 pairs of keys (rows of pairs twice the output's
                // stride apart, as the pass stores them), alpha on every
                // other call.
                let (n2, vs, ps) = (4usize, m + 3, 2 * ld);
                let vp: Vec<u32> = (0..n2 * vs)
                    .map(|i| word(b(val(5 * i)), b(val(5 * i + 3))))
                    .collect();
                let pp: Vec<u32> = (0..n2 * ps)
                    .map(|i| word(b(val(i).abs() / 4.0), b(val(i + 7).abs() / 4.0)))
                    .collect();
                let o0: Vec<f32> = (0..m * ld).map(|i| val(i + 2)).collect();
                let alpha: Vec<V16> = (0..nv)
                    // SAFETY: the CPU runs AVX-512 (checked above).
                    .map(|v| V16(unsafe { _mm512_set1_ps(0.5 + v as f32) }))
                    .collect();
                // Each start: as it is, scaled, and from zero (the
                // output then holds NaN, which must not be read).
                for how in 0..3 {
                    let with_alpha = how == 1;
                    let (mut ot, start) = match how {
                        0 => (o0.clone(), Start::Load),
                        1 => (o0.clone(), Start::Scaled(&alpha[..])),
                        _ => (vec![f32::NAN; o0.len()], Start::Zero),
                    };
                    // SAFETY: as above.
                    unsafe {
                        pv_part(
                            nv,
                            m,
                            vp.as_ptr(),
                            vs,
                            (pp.as_ptr(), ps),
                            ld,
                            n2,
                            ot.as_mut_ptr(),
                            start,
                        )
                    };
                    for col in 0..m {
                        for r in 0..nv * 16 {
                            let scale = if with_alpha {
                                0.5 + (r / 16) as f64
                            } else {
                                1.0
                            };
                            let start = match how {
                                2 => 0.0,
                                _ => o0[col * ld + r] as f64 * scale,
                            };
                            let (mut want, mut mag) = (start, start.abs());
                            for i in 0..n2 {
                                let (v, p) = (vp[i * vs + col], pp[i * ps + r]);
                                for h in [0, 16] {
                                    let t = f((v >> h) as u16) * f((p >> h) as u16);
                                    want += t;
                                    mag += t.abs();
                                }
                            }
                            let got = ot[col * ld + r] as f64;
                            assert!(
                                (got - want).abs() <= gamma(2 * n2 + 2) * mag + 1e-30,
                                "pv nv={nv} m={m} c={col} r={r} alpha={with_alpha}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
