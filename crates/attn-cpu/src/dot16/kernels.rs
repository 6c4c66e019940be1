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
/// apart), `s` at `M` rows of `NV * 16` floats, `ld` apart. (`_V` fills
/// `dispatch_m!`'s vector slot.)
///
/// # Safety
/// `k + j * k_stride + e` readable for `j < M`, `e < 2 * d2`;
/// `qp + e * ld + c` readable and `s + j * ld + c` writable for `e < d2`,
/// `j < M`, `c < NV * 16`; the CPU runs AVX-512 F and BF16.
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
        for m in 0..M {
            for v in 0..NV {
                _mm512_storeu_ps(s.add(m * ld + v * 16), _mm512_mul_ps(acc[m][v], cv));
            }
        }
    }
}

/// `O^T[c][r] = alpha[r] O^T[c][r] + sum_j V[j][c] P[r][j]` for `M` value
/// columns and `NV * 16` rows over `n2` pairs of keys. `vp` points at
/// column `c0` of the packed values (word `i * vs + c` holds `V[2i][c]`,
/// `V[2i+1][c]`), `pp` at the rows' columns of the probability pairs (`n2`
/// rows of words, `ld` apart), `ot` at `M` rows of `NV * 16` running
/// outputs, `ld` apart.
///
/// # Safety
/// `vp + i * vs + c` readable for `i < n2`, `c < M`; `pp + i * ld + r`
/// readable for `i < n2`, `r < NV * 16`; `ot + c * ld + r` readable and
/// writable for `c < M`, `r < NV * 16`; `alpha` holds `NV` factors when
/// given; the CPU runs AVX-512 F and BF16.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::extra_unused_type_parameters)]
unsafe fn pv<_V, const M: usize, const NV: usize>(
    vp: *const u32,
    vs: usize,
    pp: *const u32,
    ld: usize,
    n2: usize,
    ot: *mut f32,
    alpha: Option<&[V16]>,
) {
    // SAFETY: every access is within the extents of the contract above.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; M];
        for c in 0..M {
            for r in 0..NV {
                let o = _mm512_loadu_ps(ot.add(c * ld + r * 16));
                acc[c][r] = match alpha {
                    Some(a) => _mm512_mul_ps(o, a[r].0),
                    None => o,
                };
            }
        }
        for i in 0..n2 {
            let mut p = [zero_pairs(); NV];
            for r in 0..NV {
                p[r] = load_pairs(pp.add(i * ld + r * 16));
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
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
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
) {
    assert!((1..=4).contains(&nv) && (1..=mr(nv)).contains(&m));
    // SAFETY: forwarded from the caller.
    unsafe {
        match nv {
            1 => dispatch_m!(V16, 1, 12, m, scores(k, k_stride, qp, ld, d2, c, s)),
            2 => dispatch_m!(V16, 2, 12, m, scores(k, k_stride, qp, ld, d2, c, s)),
            3 => dispatch_m!(V16, 3, 8, m, scores(k, k_stride, qp, ld, d2, c, s)),
            _ => dispatch_m!(V16, 4, 6, m, scores(k, k_stride, qp, ld, d2, c, s)),
        }
    }
}

/// [`pv`] on `nv` vectors and `m` value columns chosen at run time.
///
/// # Safety
/// As [`pv`] with `NV = nv`, `M = m`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn pv_part(
    nv: usize,
    m: usize,
    vp: *const u32,
    vs: usize,
    pp: *const u32,
    ld: usize,
    n2: usize,
    ot: *mut f32,
    alpha: Option<&[V16]>,
) {
    assert!((1..=4).contains(&nv) && (1..=mr(nv)).contains(&m));
    assert!(alpha.is_none_or(|a| a.len() >= nv));
    // SAFETY: forwarded from the caller.
    unsafe {
        match nv {
            1 => dispatch_m!(V16, 1, 12, m, pv(vp, vs, pp, ld, n2, ot, alpha)),
            2 => dispatch_m!(V16, 2, 12, m, pv(vp, vs, pp, ld, n2, ot, alpha)),
            3 => dispatch_m!(V16, 3, 8, m, pv(vp, vs, pp, ld, n2, ot, alpha)),
            _ => dispatch_m!(V16, 4, 6, m, pv(vp, vs, pp, ld, n2, ot, alpha)),
        }
    }
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
                    )
                };
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
                // P V: n2 pairs of keys, alpha on every other call.
                let (n2, vs) = (4usize, m + 3);
                let vp: Vec<u32> = (0..n2 * vs)
                    .map(|i| word(b(val(5 * i)), b(val(5 * i + 3))))
                    .collect();
                let pp: Vec<u32> = (0..n2 * ld)
                    .map(|i| word(b(val(i).abs() / 4.0), b(val(i + 7).abs() / 4.0)))
                    .collect();
                let o0: Vec<f32> = (0..m * ld).map(|i| val(i + 2)).collect();
                let alpha: Vec<V16> = (0..nv)
                    // SAFETY: the CPU runs AVX-512 (checked above).
                    .map(|v| V16(unsafe { _mm512_set1_ps(0.5 + v as f32) }))
                    .collect();
                for with_alpha in [false, true] {
                    let mut ot = o0.clone();
                    let a = with_alpha.then_some(&alpha[..]);
                    // SAFETY: as above.
                    unsafe {
                        pv_part(
                            nv,
                            m,
                            vp.as_ptr(),
                            vs,
                            pp.as_ptr(),
                            ld,
                            n2,
                            ot.as_mut_ptr(),
                            a,
                        )
                    };
                    for col in 0..m {
                        for r in 0..nv * 16 {
                            let scale = if with_alpha {
                                0.5 + (r / 16) as f64
                            } else {
                                1.0
                            };
                            let start = o0[col * ld + r] as f64 * scale;
                            let (mut want, mut mag) = (start, start.abs());
                            for i in 0..n2 {
                                let (v, p) = (vp[i * vs + col], pp[i * ld + r]);
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
