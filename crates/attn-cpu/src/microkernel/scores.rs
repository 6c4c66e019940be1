//! The score microkernel: `S^T[j][r] = sum_e K[j][e] * Q^T[e][r]` for `M`
//! keys `j` and the `NV * 16` query rows `r` of the block.

use crate::blocking::LANES;
use crate::simd::{load, store, Vector};

/// Computes `M` rows of the transposed score tile.
///
/// `k` points at key 0 of the group, keys `k_stride` floats apart, each with
/// `d` contiguous floats; `qt` points at `NV*16` columns of the packed
/// query panel, whose rows are `ld` floats apart (`ld >= NV*16`: a kernel
/// may work on some of the panel's vectors); `s` receives `M` rows of
/// `NV*16` floats, `ld` apart. Each row's largest score of the `M` is
/// folded into `mx[r]` (`NV*16` running maxima) while the scores are in
/// registers, so the softmax need not read the tile again for it.
///
/// # Safety
/// `k + j*k_stride + e` is readable for `j < M`, `e < d`; `qt + e*ld + c`
/// is readable and `s + j*ld + c` writable for `e < d`, `j < M`,
/// `c < NV*16`; `mx + c` readable and writable for `c < NV*16`.
#[inline(always)]
pub unsafe fn scores<V: Vector, const M: usize, const NV: usize>(
    k: *const f32,
    k_stride: usize,
    qt: *const f32,
    ld: usize,
    d: usize,
    s: *mut f32,
    mx: *mut f32,
) {
    let mut acc = [[V::ZERO; NV]; M];
    for e in 0..d {
        let mut q = [V::ZERO; NV];
        for (v, x) in q.iter_mut().enumerate() {
            // SAFETY: e < d, so row e of the panel (NV*16 floats) is in qt.
            *x = unsafe { load::<V>(qt.add(e * ld + v * LANES)) };
        }
        for (m, row) in acc.iter_mut().enumerate() {
            // SAFETY: m < M and e < d: within the caller's key rows.
            let kv = V::splat(unsafe { *k.add(m * k_stride + e) });
            for (a, &qv) in row.iter_mut().zip(&q) {
                *a = kv.mul_add(qv, *a);
            }
        }
    }
    let mut top = [V::ZERO; NV];
    for (v, t) in top.iter_mut().enumerate() {
        // SAFETY: NV*16 floats at mx.
        *t = unsafe { load::<V>(mx.add(v * LANES)) };
    }
    for (m, row) in acc.iter().enumerate() {
        for (v, &a) in row.iter().enumerate() {
            top[v] = top[v].fast_max(a);
            // SAFETY: m < M rows of NV*16 floats, ld apart, fit in s.
            unsafe { store(s.add(m * ld + v * LANES), a) };
        }
    }
    for (v, &t) in top.iter().enumerate() {
        // SAFETY: as above.
        unsafe { store(mx.add(v * LANES), t) };
    }
}
