//! The bf16 pass's products on the AMX tile unit (`amx.rs`): a whole
//! score tile per 32 keys, and `P V` on transposed value pairs.

use super::amx::Session;
use super::pass::rescale;
use crate::blocking::LANES;
use crate::simd::avx512::V16;
use crate::simd::Vector;
use std::arch::x86_64::*;

/// `S^T` of one whole tile (masked or not) on the tile unit: for each
/// 32 keys, the products over the query panel's columns, then (while
/// in L1) each score times `c`, each row's largest folded into `top`,
/// and the prefetch pace's steps for those keys (`issue`).
///
/// # Safety
/// `k + j * ks + e` readable for `j < n`, `e < 2 * d2`; the panel `d2 x
/// w` words; `st` `n x w` floats writable; `n` and `2 * d2` multiples
/// of 32, `w` of 16 and at most `top.len()`; the CPU runs AVX-512 F.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_scores(
    unit: &Session,
    (k, ks): (*const u16, usize),
    (qp, w, d2): (*const u32, usize, usize),
    n: usize,
    c: f32,
    st: *mut f32,
    top: &mut [f32],
    mut issue: impl FnMut(),
) {
    assert!(n.is_multiple_of(32) && d2.is_multiple_of(16));
    assert!(w.is_multiple_of(LANES) && w <= top.len());
    // SAFETY: every access is within the extents above.
    unsafe {
        let cv = _mm512_set1_ps(c);
        for j in (0..n).step_by(32) {
            unit.mul(
                (k.add(j * ks).cast(), 2 * ks),
                (qp.cast(), 4 * w),
                d2 / 16,
                (st.add(j * w), 4 * w),
                w,
                false,
            );
            for r in (0..w).step_by(LANES) {
                let mut mx = _mm512_loadu_ps(top.as_ptr().add(r));
                for jj in j..j + 32 {
                    let at = st.add(jj * w + r);
                    let x = _mm512_mul_ps(_mm512_loadu_ps(at), cv);
                    mx = _mm512_max_ps(mx, x);
                    _mm512_storeu_ps(at, x);
                }
                _mm512_storeu_ps(top.as_mut_ptr().add(r), mx);
            }
            issue();
        }
    }
}

/// `O^T = alpha O^T + V^T P^T` for one item on the tile unit: the
/// running output rescaled (unless every factor is 1), then the
/// products, 32 value columns by up to 32 rows at a time.
///
/// # Safety
/// `vt` holds `dv` rows of `n2` words (the transposed value pairs), `pp`
/// `n2` rows of `w` words, `ps >= w` apart, `out` `dv x w` floats; `n2` a multiple of
/// 16, `dv` of 32, `w` of 16 with `w / 16 <= alpha.len()`; the CPU
/// runs AVX-512 F.
#[inline(always)]
pub(super) unsafe fn tile_pv(
    unit: &Session,
    (vt, n2, dv): (*const u32, usize, usize),
    (pp, ps, w): (*const u32, usize, usize),
    out: *mut f32,
    alpha: &[V16],
) {
    assert!(n2.is_multiple_of(16) && dv.is_multiple_of(32));
    assert!(w.is_multiple_of(LANES) && w / LANES <= alpha.len());
    // SAFETY: every access is within the extents above.
    unsafe {
        let one = _mm512_set1_ps(1.0);
        let alpha = &alpha[..w / LANES];
        let ones = alpha
            .iter()
            .all(|a| _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a.0, one) == 0xffff);
        if !ones {
            rescale(out, dv, alpha);
        }
        for c0 in (0..dv).step_by(32) {
            unit.mul(
                (vt.add(c0 * n2).cast(), 4 * n2),
                (pp.cast(), 4 * ps),
                n2 / 16,
                (out.add(c0 * w), 4 * w),
                w,
                true,
            );
        }
    }
}

/// The packed value pairs (`n2` rows of `dv` words, `vs` apart)
/// transposed as words into `vt` (`dv` rows of `n2` words): row `c`
/// holds column `c`'s bf16 along the keys, A's layout for the tile
/// unit. Bit moves only.
///
/// # Safety
/// The extents above, `n2` and `dv` multiples of 16; the CPU runs
/// AVX-512 F.
#[inline(always)]
pub(super) unsafe fn transpose_words(
    (vp, vs): (*const u32, usize),
    (n2, dv): (usize, usize),
    vt: *mut u32,
) {
    assert!(n2.is_multiple_of(LANES) && dv.is_multiple_of(LANES));
    // SAFETY: every access is within the extents above.
    unsafe {
        for i0 in (0..n2).step_by(LANES) {
            for c0 in (0..dv).step_by(LANES) {
                let blk: [V16; LANES] =
                    std::array::from_fn(|r| V16::load(vp.add((i0 + r) * vs + c0).cast()));
                for (r, t) in V16::transpose16(blk).into_iter().enumerate() {
                    t.store(vt.add((c0 + r) * n2 + i0).cast());
                }
            }
        }
    }
}
