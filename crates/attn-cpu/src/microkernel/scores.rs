//! The score microkernel: `S^T[j][r] = sum_e K[j][e] * Q^T[e][r]` for `M`
//! keys `j` and the `NV * 16` query rows `r` of the block.

use crate::blocking::LANES;
use crate::simd::{load, store, V};

/// Computes `M` rows of the transposed score tile.
///
/// `k` points at key 0 of the group, keys `k_stride` floats apart, each with
/// `d` contiguous floats; `qt` is the packed `d x (NV*16)` query panel; `s`
/// receives `M` rows of `NV*16` floats.
///
/// # Safety
/// `k + j*k_stride + e` is readable for `j < M`, `e < d`; `qt` holds
/// `d * NV * 16` floats; `s` has room for `M * NV * 16` floats.
#[inline(always)]
pub unsafe fn scores<const M: usize, const NV: usize>(
    k: *const f32,
    k_stride: usize,
    qt: *const f32,
    d: usize,
    s: *mut f32,
) {
    let w = NV * LANES;
    let mut acc = [[V::ZERO; NV]; M];
    for e in 0..d {
        // SAFETY: e < d, so row e of the panel (w floats) is in qt.
        let q: [V; NV] = std::array::from_fn(|v| unsafe { load(qt.add(e * w + v * LANES)) });
        for (m, row) in acc.iter_mut().enumerate() {
            // SAFETY: m < M and e < d: within the caller's key rows.
            let kv = V::splat(unsafe { *k.add(m * k_stride + e) });
            for (a, &qv) in row.iter_mut().zip(&q) {
                *a = kv.mul_add(qv, *a);
            }
        }
    }
    for (m, row) in acc.iter().enumerate() {
        for (v, &a) in row.iter().enumerate() {
            // SAFETY: m < M rows of w floats fit in s.
            unsafe { store(s.add(m * w + v * LANES), a) };
        }
    }
}
