//! Moving data between the caller's strided tensors and the kernels'
//! packed f32 panels: the query panel `Q^T` (once per block of rows), key
//! and value rows (used in place when they are f32 with unit stride along
//! the head dimension, otherwise widened into a scratch block), and the
//! final write of output rows in the caller's type and layout.

use crate::blocking::ROWS;
use crate::element::CpuElement;
use crate::work::Item;
use attn_spec::View;

/// Packs the block's query rows into `qt` (`d x ROWS`, row `r` of the block
/// in lane `r`), multiplied by `scale`; rows past the block are zero.
pub fn pack_q<T: CpuElement>(
    q: &[T],
    view: &View,
    item: &Item,
    d: usize,
    scale: f32,
    qt: &mut [f32],
) {
    let rows = item.rows();
    let mut row = vec![0.0f32; d];
    for r in 0..ROWS {
        if r < rows {
            let (p, h) = item.row(r);
            gather_row(q, view, [item.b, p, h, 0], d, &mut row);
            for (e, &x) in row.iter().enumerate() {
                qt[e * ROWS + r] = x * scale;
            }
        } else {
            for e in 0..d {
                qt[e * ROWS + r] = 0.0;
            }
        }
    }
}

/// Widens one row of `d` elements starting at logical index `at` (last
/// axis varying) into `dst`.
pub fn gather_row<T: CpuElement>(
    src: &[T],
    view: &View,
    at: [usize; 4],
    d: usize,
    dst: &mut [f32],
) {
    let base = view.index(at);
    if view.strides[3] == 1 || d == 1 {
        T::widen(&src[base..base + d], &mut dst[..d]);
    } else {
        for (e, x) in dst[..d].iter_mut().enumerate() {
            *x = src[base + e * view.strides[3]].to_f32();
        }
    }
}

/// Row stride of a packed value tile: `d` rounded up to whole 64-byte lines,
/// plus one line when that count is even. The `P V` microkernel walks one
/// column group down all rows of the tile; with an even number of lines
/// per row those rows would crowd into a few L1 sets (4 KiB aliasing at
/// d = 128 in the BSHD layout, where rows are `heads * d` apart) and evict
/// each other between column groups; an odd count spreads them over all
/// sets.
pub fn packed_stride(d: usize) -> usize {
    let lines = d.div_ceil(16);
    16 * if lines % 2 == 0 { lines + 1 } else { lines }
}

/// Copies rows `j0..j0+n` (batch `b`, head `g`) into `dst` as f32 rows
/// [`packed_stride`] apart.
pub fn pack_rows<T: CpuElement>(
    src: &[T],
    view: &View,
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    d: usize,
    dst: &mut [f32],
) -> usize {
    let s = packed_stride(d);
    for j in 0..n {
        gather_row(src, view, [b, j0 + j, g, 0], d, &mut dst[j * s..j * s + d]);
    }
    s
}

/// Rows `j0..j0+n` of K or V for batch `b`, head `g`, as a pointer to f32
/// rows and their stride: into the caller's tensor when it is f32 with unit
/// stride along the head dimension, else widened into `scratch`.
pub fn kv_rows<'a, T: CpuElement>(
    src: &'a [T],
    view: &View,
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    d: usize,
    scratch: &'a mut [f32],
) -> (&'a [f32], usize) {
    if let Some(f) = T::as_f32(src) {
        if view.strides[3] == 1 || d == 1 {
            let start = view.index([b, j0, g, 0]);
            let stride = if n > 1 { view.strides[1] } else { d };
            // Keys j0..j0+n: the last one ends at start + (n-1)*stride + d.
            let end = start + (n - 1) * stride + d;
            return (&f[start..end], stride);
        }
    }
    for j in 0..n {
        gather_row(
            src,
            view,
            [b, j0 + j, g, 0],
            d,
            &mut scratch[j * d..(j + 1) * d],
        );
    }
    (&scratch[..n * d], d)
}
