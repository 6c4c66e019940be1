//! The score microkernel: `S^T[j][r] = sum_e K[j][e] * Q^T[e][r]` for `M`
//! keys `j` and all `ROWS` query rows `r`.

use crate::blocking::{LANES, ROWS, ROW_VECS};
use crate::simd::{load, store, V};

/// Computes `M` rows of the transposed score tile.
///
/// `k` points at key 0 of the group, keys `k_stride` floats apart, each with
/// `d` contiguous floats; `qt` is the packed `d x ROWS` query panel; `s`
/// receives `M` rows of `ROWS` floats.
///
/// # Safety
/// `k + j*k_stride + e` is readable for `j < M`, `e < d`; `qt` holds
/// `d * ROWS` floats; `s` has room for `M * ROWS` floats.
#[inline(always)]
pub unsafe fn scores<const M: usize>(
    k: *const f32,
    k_stride: usize,
    qt: *const f32,
    d: usize,
    s: *mut f32,
) {
    let mut acc = [[V::ZERO; ROW_VECS]; M];
    for e in 0..d {
        // SAFETY: e < d, so row e of the panel (ROWS floats) is in qt.
        let q: [V; ROW_VECS] =
            std::array::from_fn(|v| unsafe { load(qt.add(e * ROWS + v * LANES)) });
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
            // SAFETY: m < M rows of ROWS floats fit in s.
            unsafe { store(s.add(m * ROWS + v * LANES), a) };
        }
    }
}
