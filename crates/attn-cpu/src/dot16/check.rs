//! The vector checks of which bf16 values may enter `vdpbf16ps`
//! ([`fits`](super::fits), `fit.rs`): 32 elements at a time, on query,
//! key and value rows as the pass reads them.

use attn_spec::View;
use std::arch::x86_64::*;

/// Whether every element of one contiguous row [`fits`](super::fits):
/// 32 at a time into a [`Span`], any rest one by one.
///
/// # Safety
/// The CPU runs AVX-512 BW.
#[inline(always)]
unsafe fn row_fits(row: &[u16]) -> bool {
    // SAFETY: the CPU runs AVX-512 BW (this function's contract).
    let mut span = unsafe { Span::new() };
    let mut c = 0;
    while c + 32 <= row.len() {
        // SAFETY: c + 32 <= row.len(); the CPU runs AVX-512 BW (this
        // function's contract).
        unsafe { span.add(_mm512_loadu_si512(row.as_ptr().add(c).cast())) };
        c += 32;
    }
    // SAFETY: as above.
    let whole = unsafe { span.fits() };
    whole && row[c..].iter().all(|&x| super::fits(x))
}

/// The smallest nonzero and the largest magnitude of the bf16 words
/// seen so far, per 16-bit lane: a mask, a decrement, a minimum and a
/// maximum per 32 words (integer operations, no compare into a mask
/// register), compared with the window once at the end. A zero's
/// magnitude less one wraps to the largest word, so only nonzero words
/// reach the minimum.
#[derive(Clone, Copy)]
pub(super) struct Span {
    mn: __m512i,
    mx: __m512i,
}

impl Span {
    /// Nothing seen.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F.
    #[inline(always)]
    pub(super) unsafe fn new() -> Self {
        // SAFETY: the CPU runs AVX-512 F (this function's contract).
        unsafe {
            Span {
                mn: _mm512_set1_epi16(-1),
                mx: _mm512_setzero_si512(),
            }
        }
    }

    /// Takes in the 32 words of `x`.
    ///
    /// # Safety
    /// The CPU runs AVX-512 BW.
    #[inline(always)]
    pub(super) unsafe fn add(&mut self, x: __m512i) {
        // SAFETY: the CPU runs AVX-512 BW (this function's contract).
        unsafe {
            let a = _mm512_and_si512(x, _mm512_set1_epi16(0x7fff));
            self.mn = _mm512_min_epu16(self.mn, _mm512_sub_epi16(a, _mm512_set1_epi16(1)));
            self.mx = _mm512_max_epu16(self.mx, a);
        }
    }

    /// Whether every word seen [`fits`](super::fits).
    ///
    /// # Safety
    /// The CPU runs AVX-512 BW.
    #[inline(always)]
    pub(super) unsafe fn fits(&self) -> bool {
        let w = super::FORWARD;
        // SAFETY: the CPU runs AVX-512 BW (this function's contract).
        unsafe {
            // Nonzero magnitudes from exponent lo (fraction 0) to
            // exponent hi (fraction all ones).
            let lo = _mm512_set1_epi16(((w.lo << 7) - 1) as i16);
            let hi = _mm512_set1_epi16(((w.hi << 7) | 0x7f) as i16);
            _mm512_cmplt_epu16_mask(self.mn, lo) == 0 && _mm512_cmpgt_epu16_mask(self.mx, hi) == 0
        }
    }
}

/// Whether every element of rows `j0..j0+m` of `rows` (`rs` apart, `d`
/// elements each) [`fits`](super::fits), as [`rows_fit`] for rows
/// already found contiguous (`typed_rows`): the smallest and largest
/// magnitude over the slab, 32 elements at a time (a mask, a decrement, a
/// minimum and a maximum; the last elements of a row by a masked load,
/// whose zeros always fit), compared with the window once at the end. A
/// zero's magnitude less one wraps to the largest word, so only nonzero
/// elements reach the minimum.
///
/// # Safety
/// The CPU runs AVX-512 BW.
#[inline(always)]
pub(super) unsafe fn slab_fits(rows: &[u16], rs: usize, (j0, m): (usize, usize), d: usize) -> bool {
    assert!(m == 0 || rows.len() >= (j0 + m - 1) * rs + d);
    // SAFETY: the CPU runs AVX-512 BW (this function's contract); every
    // load reads inside row j (d elements at j * rs), the last one masked
    // to the row's remaining elements.
    unsafe {
        let mut span = Span::new();
        let tail: __mmask32 = (1u32 << (d % 32)).wrapping_sub(1);
        for j in j0..j0 + m {
            let row = rows.as_ptr().add(j * rs);
            let mut c = 0;
            while c < d {
                span.add(match c + 32 <= d {
                    true => _mm512_loadu_si512(row.add(c).cast()),
                    false => _mm512_maskz_loadu_epi16(tail, row.add(c).cast()),
                });
                c += 32;
            }
        }
        span.fits()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bf16 bit pattern, placed among values that fit at every
    /// position of a row (whole vectors and the masked rest) in a slab of
    /// rows: the slab fits exactly when [`fits`](super::super::fits) says
    /// the pattern does; and so does the pattern's row alone, read by
    /// `row_fits` (what `rows_fit` reads contiguous rows with).
    #[test]
    fn slab_fits_agrees_with_fits_on_every_pattern() {
        if !crate::Isa::Avx512.supported() {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let ok = attn_spec::bf16::from_f32(0.75).to_bits();
        for d in [1, 8, 31, 32, 33, 72, 128] {
            let (rs, m) = (d + 5, 3);
            let mut rows = vec![ok; 4 * rs];
            for bits in 0..=u16::MAX {
                // A row and a column that move with the pattern.
                let j = 1 + usize::from(bits) % m;
                let c = usize::from(bits) % d;
                rows[j * rs + c] = bits;
                // SAFETY: the CPU runs AVX-512 BW (checked above).
                let got = unsafe { slab_fits(&rows, rs, (1, m), d) };
                assert_eq!(
                    got,
                    super::super::fits(bits),
                    "d {d}: {bits:#06x} at ({j}, {c})"
                );
                // SAFETY: as above.
                let row = unsafe { row_fits(&rows[j * rs..j * rs + d]) };
                assert_eq!(row, got, "row_fits, d {d}: {bits:#06x} at {c}");
                rows[j * rs + c] = ok;
            }
            // Padding between rows is not read: a misfit there is ignored.
            rows[rs + d] = 0x7f80;
            // SAFETY: as above.
            assert!(unsafe { slab_fits(&rows, rs, (1, m), d) });
            rows[rs + d] = ok;
        }
    }
}
