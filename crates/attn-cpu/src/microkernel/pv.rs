//! The value microkernel: `O^T[c][r] = alpha[r] * O^T[c][r] + sum_j
//! V[j][c] * P^T[j][r]` for `M` value columns `c` and all `ROWS` rows `r`.
//! The online softmax's rescaling of the running output by `alpha` is
//! fused into the load of the accumulators, so it costs no extra pass.

use crate::blocking::{LANES, ROWS, ROW_VECS};
use crate::simd::{load, store, V};

/// Accumulates `M` rows of the transposed output tile over `n` keys.
///
/// `v` points at column `c0` of value row 0, rows `v_stride` floats apart;
/// `pt` is the `n x ROWS` probability tile; `ot` holds `M` rows of `ROWS`
/// running outputs, updated in place.
///
/// # Safety
/// `v + j*v_stride + c` is readable for `j < n`, `c < M`; `pt` holds
/// `n * ROWS` floats; `ot` holds `M * ROWS` floats.
#[inline(always)]
pub unsafe fn pv<const M: usize>(
    v: *const f32,
    v_stride: usize,
    pt: *const f32,
    n: usize,
    ot: *mut f32,
    alpha: &[V; ROW_VECS],
) {
    let mut acc: [[V; ROW_VECS]; M] = std::array::from_fn(|c| {
        // SAFETY: c < M rows of ROWS floats are in ot.
        std::array::from_fn(|r| unsafe { load(ot.add(c * ROWS + r * LANES)) } * alpha[r])
    });
    for j in 0..n {
        // SAFETY: j < n, so row j of the tile (ROWS floats) is in pt.
        let p: [V; ROW_VECS] =
            std::array::from_fn(|r| unsafe { load(pt.add(j * ROWS + r * LANES)) });
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
            // SAFETY: c < M rows of ROWS floats are in ot.
            unsafe { store(ot.add(c * ROWS + r * LANES), a) };
        }
    }
}
