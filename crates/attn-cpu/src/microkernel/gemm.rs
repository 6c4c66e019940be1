//! The backward pass's microkernel: `C[MR x 16] (+)= A[MR x k] B[k x 16]`
//! with `A` read as broadcast scalars through any two strides (so `A` or
//! its transpose, as the backward's five products need) and `B` and `C`
//! rows of 16 contiguous f32. `MR` is the level's `mr(1)` (AVX-512 12,
//! AVX2 6, portable 2): `MR` vectors of accumulators, one streamed vector
//! of `B` and one broadcast, inside every level's register file.

use crate::blocking::LANES;
use crate::simd::{load, store, Vector};

/// One `MR x 16` tile of `C`: `C = [C +] sum_{kk < k} A(r, kk) B[kk]`,
/// `A(r, kk) = a[r * a_rs + kk * a_cs]`, `B[kk] = b[kk * b_rs..][..16]`,
/// row `r` of `C` at `c + r * c_rs`.
///
/// # Safety
/// Every `A(r, kk)` for `r < MR`, `kk < k` and every `B` row is readable;
/// `c + r * c_rs .. + 16` is readable and writable for `r < MR`.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // the product's operands and strides
pub unsafe fn tile<V: Vector, const MR: usize>(
    k: usize,
    a: *const f32,
    (a_rs, a_cs): (usize, usize),
    b: *const f32,
    b_rs: usize,
    c: *mut f32,
    c_rs: usize,
    accumulate: bool,
) {
    let mut acc = [V::ZERO; MR];
    if accumulate {
        for (r, x) in acc.iter_mut().enumerate() {
            // SAFETY: row r < MR of C is readable (caller).
            *x = unsafe { load::<V>(c.add(r * c_rs)) };
        }
    }
    for kk in 0..k {
        // SAFETY: row kk < k of B is readable (caller).
        let bv = unsafe { load::<V>(b.add(kk * b_rs)) };
        // SAFETY: A(0, kk) is inside A's buffer (caller).
        let a_k = unsafe { a.add(kk * a_cs) };
        for (r, x) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            let av = V::splat(unsafe { *a_k.add(r * a_rs) });
            *x = av.mul_add(bv, *x);
        }
    }
    for (r, &x) in acc.iter().enumerate() {
        // SAFETY: row r < MR of C is writable (caller).
        unsafe { store(c.add(r * c_rs), x) };
    }
}

/// `C[m x n] (+)= A[m x k] B[k x n]` in `MR x 16` tiles, `MR = V::mr(1)`.
///
/// # Safety
/// `m` is a multiple of `V::mr(1)` and `n` of 16; `A(r, kk)` for `r < m`,
/// `kk < k`, rows `kk < k` of `B` (`n` floats) and rows `r < m` of `C`
/// (`n` floats, readable and writable) are in their buffers.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // the product's operands and strides
pub unsafe fn gemm<V: Vector>(
    (m, n, k): (usize, usize, usize),
    a: *const f32,
    a_strides: (usize, usize),
    b: *const f32,
    b_rs: usize,
    c: *mut f32,
    c_rs: usize,
    accumulate: bool,
) {
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn go<V: Vector, const MR: usize>(
        (m, n, k): (usize, usize, usize),
        a: *const f32,
        (a_rs, a_cs): (usize, usize),
        b: *const f32,
        b_rs: usize,
        c: *mut f32,
        c_rs: usize,
        accumulate: bool,
    ) {
        debug_assert!(m % MR == 0 && n % LANES == 0);
        for col in (0..n).step_by(LANES) {
            for r0 in (0..m).step_by(MR) {
                // SAFETY: the tile's rows r0..r0+MR < m and columns
                // col..col+16 <= n are inside the caller's extents.
                unsafe {
                    tile::<V, MR>(
                        k,
                        a.add(r0 * a_rs),
                        (a_rs, a_cs),
                        b.add(col),
                        b_rs,
                        c.add(r0 * c_rs + col),
                        c_rs,
                        accumulate,
                    )
                }
            }
        }
    }
    // SAFETY: forwarded; `V::mr(1)` is a constant of the level, so only its
    // arm survives.
    unsafe {
        match V::mr(1) {
            12 => go::<V, 12>((m, n, k), a, a_strides, b, b_rs, c, c_rs, accumulate),
            6 => go::<V, 6>((m, n, k), a, a_strides, b, b_rs, c, c_rs, accumulate),
            _ => go::<V, 2>((m, n, k), a, a_strides, b, b_rs, c, c_rs, accumulate),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::for_each_vector;

    fn matches_scalar<V: Vector>() {
        let mr = V::mr(1);
        let (m, n, k) = (2 * mr, 32, 7);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 13) as f32 - 6.0).collect();
        for (transposed, accumulate) in [(false, false), (true, true)] {
            // A(r, kk) at r * k + kk, or (transposed) at kk * m + r.
            let strides = if transposed { (1, m) } else { (k, 1) };
            let a_at = |r: usize, kk: usize| a[r * strides.0 + kk * strides.1];
            let mut c: Vec<f32> = (0..m * n).map(|i| (i % 3) as f32).collect();
            let c0 = c.clone();
            // SAFETY: every extent is the buffers' own.
            unsafe {
                gemm::<V>(
                    (m, n, k),
                    a.as_ptr(),
                    strides,
                    b.as_ptr(),
                    n,
                    c.as_mut_ptr(),
                    n,
                    accumulate,
                )
            };
            for r in 0..m {
                for j in 0..n {
                    let dot: f32 = (0..k).map(|kk| a_at(r, kk) * b[kk * n + j]).sum();
                    let want = if accumulate { c0[r * n + j] + dot } else { dot };
                    // Small integers: every sum is exact in f32.
                    assert_eq!(c[r * n + j], want, "{} r={r} j={j}", V::ISA);
                }
            }
        }
    }

    #[test]
    fn gemm_matches_scalar_loops() {
        for_each_vector!(matches_scalar);
    }
}
