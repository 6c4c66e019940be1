//! The value microkernel: `O^T[c][r] = alpha[r] * O^T[c][r] + sum_j
//! V[j][c] * P^T[j][r]` for `M` value columns `c` and the `NV * 16` rows
//! `r` of the block. The online softmax's rescaling of the running output
//! by `alpha` is fused into the load of the accumulators, so it costs no
//! extra pass.

use crate::blocking::LANES;
use crate::simd::{load, store, Vector};

/// Accumulates `M` rows of the transposed output tile over `n` keys.
///
/// `v` points at column `c0` of value row 0, rows `v_stride` floats apart;
/// `pt` points at `NV*16` columns of the `n`-row probability tile and `ot`
/// at `M` rows of `NV*16` running outputs (updated in place), both with
/// rows `ld` floats apart (`ld >= NV*16`: a kernel may work on some of the
/// block's vectors). `alpha`, when given, holds at least `NV` factors.
///
/// # Safety
/// `v + j*v_stride + c` is readable for `j < n`, `c < M`; `pt + j*ld + r`
/// is readable for `j < n`, `r < NV*16`; `ot + c*ld + r` is readable and
/// writable for `c < M`, `r < NV*16`.
#[inline(always)]
pub unsafe fn pv<V: Vector, const M: usize, const NV: usize>(
    v: *const f32,
    v_stride: usize,
    pt: *const f32,
    ld: usize,
    n: usize,
    ot: *mut f32,
    alpha: Option<&[V]>,
) {
    let mut acc = [[V::ZERO; NV]; M];
    for (c, row) in acc.iter_mut().enumerate() {
        for (r, a) in row.iter_mut().enumerate() {
            // SAFETY: c < M rows of NV*16 floats, ld apart, are in ot.
            let o = unsafe { load::<V>(ot.add(c * ld + r * LANES)) };
            *a = match alpha {
                Some(f) => o * f[r],
                None => o,
            };
        }
    }
    for j in 0..n {
        let mut p = [V::ZERO; NV];
        for (r, x) in p.iter_mut().enumerate() {
            // SAFETY: j < n, so row j of the tile (NV*16 floats) is in pt.
            *x = unsafe { load::<V>(pt.add(j * ld + r * LANES)) };
        }
        for (c, row) in acc.iter_mut().enumerate() {
            // SAFETY: j < n and c < M: within the caller's value rows.
            let x = V::splat(unsafe { *v.add(j * v_stride + c) });
            for (a, &pv) in row.iter_mut().zip(&p) {
                *a = x.mul_add(pv, *a);
            }
        }
    }
    for (c, row) in acc.iter().enumerate() {
        for (r, &a) in row.iter().enumerate() {
            // SAFETY: c < M rows of NV*16 floats, ld apart, are in ot.
            unsafe { store(ot.add(c * ld + r * LANES), a) };
        }
    }
}
