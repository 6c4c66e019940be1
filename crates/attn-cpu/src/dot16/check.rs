//! The vector checks of which bf16 values may enter `vdpbf16ps`
//! ([`fits`](super::fits), `fit.rs`): 32 elements at a time, on query,
//! key and value rows as the pass reads them.

use attn_spec::View;
use std::arch::x86_64::*;

/// Whether every element of one contiguous row [`fits`](super::fits):
/// 32 at a time (a test, a shift, a subtraction and a compare), any
/// rest one by one.
///
/// # Safety
/// The CPU runs AVX-512 BW.
#[inline(always)]
unsafe fn row_fits(row: &[u16]) -> bool {
    let mut bad: __mmask32 = 0;
    let mut c = 0;
    while c + 32 <= row.len() {
        // SAFETY: c + 32 <= row.len(); the CPU runs AVX-512 BW (this
        // function's contract).
        unsafe { bad |= misfits(_mm512_loadu_si512(row.as_ptr().add(c).cast())) };
        c += 32;
    }
    bad == 0 && row[c..].iter().all(|&x| super::fits(x))
}

/// Whether every element of rows `j0..j0+m` of `rows` (`rs` apart, `d`
/// elements each) [`fits`](super::fits), as [`rows_fit`] for rows
/// already found contiguous (`typed_rows`).
///
/// # Safety
/// The CPU runs AVX-512 BW.
#[inline(always)]
pub(super) unsafe fn slab_fits(rows: &[u16], rs: usize, (j0, m): (usize, usize), d: usize) -> bool {
    // (A loop, not a closure: a closure loses the level's features.)
    let mut fit = true;
    for j in j0..j0 + m {
        // SAFETY: the CPU runs AVX-512 BW (this function's contract).
        fit &= unsafe { row_fits(&rows[j * rs..j * rs + d]) };
    }
    fit
}

/// Whether every element of rows `j0..j0+n` (batch `b`, head `g`, `d`
/// elements each) of a bf16 tensor [`fits`](super::fits) ([`row_fits`]
/// on contiguous rows).
///
/// # Safety
/// The CPU runs AVX-512 BW.
#[inline(always)]
pub(super) unsafe fn rows_fit(
    src: &[u16],
    view: &View,
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    d: usize,
) -> bool {
    for j in j0..j0 + n {
        let at = view.index([b, j, g, 0]);
        let fit = if view.strides[3] != 1 && d != 1 {
            (0..d).all(|c| super::fits(src[at + c * view.strides[3]]))
        } else {
            // SAFETY: the CPU runs AVX-512 BW (this function's contract).
            unsafe { row_fits(&src[at..at + d]) }
        };
        if !fit {
            return false;
        }
    }
    true
}

/// The lanes of 32 bf16 that do not [`fit`](super::fits).
///
/// # Safety
/// The CPU runs AVX-512 BW.
#[inline(always)]
pub(super) unsafe fn misfits(x: __m512i) -> __mmask32 {
    // SAFETY: forwarded.
    unsafe { misfits_in(x, super::FORWARD) }
}

/// The lanes of 32 bf16 that are neither 0 nor of a magnitude in `w`.
///
/// # Safety
/// The CPU runs AVX-512 BW.
#[inline(always)]
pub(super) unsafe fn misfits_in(x: __m512i, w: super::Window) -> __mmask32 {
    // SAFETY: the CPU runs AVX-512 BW (this function's contract).
    unsafe {
        let nonzero = _mm512_test_epi16_mask(x, _mm512_set1_epi16(0x7fff));
        let e = _mm512_and_si512(_mm512_srli_epi16::<7>(x), _mm512_set1_epi16(0xff));
        let off = _mm512_sub_epi16(e, _mm512_set1_epi16(w.lo as i16));
        nonzero & !_mm512_cmple_epu16_mask(off, _mm512_set1_epi16((w.hi - w.lo) as i16))
    }
}
