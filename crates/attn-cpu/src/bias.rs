//! The additive bias and the boolean mask. On the main path (rows on the
//! lanes) 16 rows x 16 keys are read a row at a time and transposed onto
//! the score tile's key vectors (`add_bias_block`, `apply_mask_block`);
//! elsewhere, and for keys that are not contiguous, one query row's run of
//! keys at a time (`RowRun`): the element index is computed and the
//! bias's element type dispatched once per row and tile, not once per
//! score, and the run is walked by its key stride.
//!
//! Both passes leave each score exactly as the contract's per-element
//! order gives it (after soft-cap, ALiBi and the causal/window mask):
//! `s + bias * log2(e)` with the bias rounded to f32 first, then `-inf`
//! where the boolean mask is false.

use crate::blocking::LANES;
use crate::element::CpuElement;
use crate::simd::{load, store, Vector};
use attn_spec::{HostData, View};
use std::f32::consts::LOG2_E;

/// Adds the bias of up to 16 query rows (`rows[i]` = `(batch, head,
/// position)` of lane `i`) over keys `j0..j0+n` to a transposed score
/// tile whose lane 0 of key `j0 + j` is `st[j * w]`. Where each row's keys
/// are contiguous, 16 x 16 squares of the bias are loaded a row at a time
/// (widened from f16/bf16) and transposed onto the keys' vectors, instead
/// of reading and adding one score at a time down a column of the tile.
/// Measured (`BIAS=1 cargo run -p attn-benches --release --example perf`,
/// f32 bias of shape (1, heads, S, S), 1 thread, 2 processes each):
/// S = 512, d = 128: 15.3-18.5 ms with the former pass (an index and a
/// type dispatch per score), 13.0-13.1 ms with squares, 10.9-11.7 ms
/// without a bias; S = 512, d = 64 causal: 7.3-7.5, 4.1-4.3 and 3.3 ms.
/// Other runs (keys not contiguous), an f64 bias and the keys past the
/// last whole 16 go through [`RowRun`]; the result is the same to the bit.
#[inline(always)]
pub fn add_bias_block<V: Vector>(
    bias: (&HostData, View),
    rows: &[(usize, usize, usize)],
    (j0, n): (usize, usize),
    st: &mut [f32],
    w: usize,
) {
    #[inline(always)]
    fn go<V: Vector, E: CpuElement>(
        src: &[E],
        bias: (&HostData, View),
        rows: &Rows,
        st: &mut [f32],
    ) {
        let log2e = V::splat(LOG2_E);
        // SAFETY: `squares` asks only for 16 elements from an index whose
        // 16th is inside the buffer of `src.len()` elements.
        let load_row = |at: usize| unsafe { E::load16::<V>(src.as_ptr().add(at)) };
        let whole = squares(bias.1, rows, src.len(), st, (V::ZERO, load_row), |x, s| {
            s + x * log2e
        });
        rows.runs(whole, st, |run| run.add_bias(bias));
    }
    let rows = Rows::new(rows, (j0, n), w);
    match bias.0 {
        HostData::F32(v) => go::<V, _>(v, bias, &rows, st),
        HostData::F16(v) => go::<V, _>(v, bias, &rows, st),
        HostData::Bf16(v) => go::<V, _>(v, bias, &rows, st),
        _ => rows.runs(0, st, |run| run.add_bias(bias)),
    }
}

/// Sets to `-inf` the scores of up to 16 query rows (`rows[i]` of lane
/// `i`) over keys `j0..j0+n` where the boolean mask is false, in a
/// transposed score tile as [`add_bias_block`] takes it: where each row's
/// keys are contiguous, 16 x 16 squares of the mask are read a row at a
/// time as 0.0/1.0 vectors, transposed onto the keys' vectors and applied
/// with one select per key; other runs and the keys past the last whole
/// 16 go through [`RowRun`]. The same result as row runs. Measured
/// (`MASK=1` in the `perf` example: a mask shared by the heads, 1 thread,
/// 2 processes each): S = 512, d = 64 causal 5.2-5.3 ms with row runs,
/// 4.1-4.3 ms with squares (3.3 ms without a mask); S = 512, d = 128
/// 12.9-14.9 and 12.3-12.7 ms (11.0 ms).
#[inline(always)]
pub fn apply_mask_block<V: Vector>(
    (mask, view): (&[bool], View),
    rows: &[(usize, usize, usize)],
    (j0, n): (usize, usize),
    st: &mut [f32],
    w: usize,
) {
    let rows = Rows::new(rows, (j0, n), w);
    let load_row = |at: usize| {
        let mut x = [0.0f32; LANES];
        for (y, &m) in x.iter_mut().zip(&mask[at..at + LANES]) {
            *y = f32::from(u8::from(m));
        }
        V::from(x)
    };
    // Lanes of no row read as "keep" and keep their scores.
    let whole = squares(
        view,
        &rows,
        mask.len(),
        st,
        (V::ONE, load_row),
        |keep: V, s: V| s.replace_where_eq(keep, 0.0, f32::NEG_INFINITY),
    );
    rows.runs(whole, st, |run| run.apply_mask((mask, view)));
}

/// Up to 16 query rows (`(batch, head, position)` of lanes 0, 1, ...) and
/// the keys `j0..j0+n` of a transposed score tile whose lane 0 of key
/// `j0 + j` is `st[j * w]`.
struct Rows<'r> {
    at: &'r [(usize, usize, usize)],
    keys: (usize, usize),
    w: usize,
}

impl<'r> Rows<'r> {
    fn new(at: &'r [(usize, usize, usize)], keys: (usize, usize), w: usize) -> Self {
        assert!(at.len() <= LANES);
        Rows { at, keys, w }
    }

    /// Calls `f` on each row's run of the keys from `j0 + from` on.
    fn runs(&self, from: usize, st: &mut [f32], mut f: impl FnMut(&mut RowRun<'_>)) {
        let (j0, n) = self.keys;
        if from == n {
            return;
        }
        for (i, &at) in self.at.iter().enumerate() {
            f(&mut RowRun {
                at,
                keys: (j0 + from, n - from),
                s: &mut st[from * self.w + i..],
                stride: self.w,
            });
        }
    }
}

/// Walks the whole 16 x 16 squares of a `(batch, head, q_len, kv_len)`
/// tensor (`view`, a buffer of `len` elements) over `rows`, when each row's
/// keys are contiguous: `load_row(at)` reads a row's 16 elements from
/// index `at` as a vector (lanes of no row get `fill`), the square is
/// transposed onto the keys' vectors and each key's scores become
/// `apply(value, score)`. Returns how many keys it covered (a multiple of
/// 16; 0 when the keys are not contiguous).
#[inline(always)]
fn squares<V: Vector>(
    view: View,
    rows: &Rows<'_>,
    len: usize,
    st: &mut [f32],
    (fill, load_row): (V, impl Fn(usize) -> V),
    apply: impl Fn(V, V) -> V,
) -> usize {
    let (j0, n) = rows.keys;
    let whole = if view.strides[3] == 1 {
        n / LANES * LANES
    } else {
        0
    };
    if whole == 0 {
        return 0;
    }
    let first: [usize; LANES] = std::array::from_fn(|i| {
        rows.at
            .get(i)
            .map_or(0, |&(b, h, pos)| view.index([b, h, pos, j0]))
    });
    for &f in &first[..rows.at.len()] {
        assert!(f + whole <= len);
    }
    assert!((whole - 1) * rows.w + LANES <= st.len());
    for c0 in (0..whole).step_by(LANES) {
        let mut blk = [fill; LANES];
        for (b, &f) in blk.iter_mut().zip(&first[..rows.at.len()]) {
            *b = load_row(f + c0);
        }
        for (k, &x) in V::transpose16(blk).iter().enumerate() {
            // SAFETY: (c0 + k) * w + 16 <= (whole - 1) * w + 16 <= st.len()
            // (asserted above).
            unsafe {
                let p = st.as_mut_ptr().add((c0 + k) * rows.w);
                store(p, apply(x, load::<V>(p)));
            }
        }
    }
    whole
}

/// The query row `(batch, head, position)` whose keys `j0..j0+n` a pass
/// reads, and where its scores lie: `s[j * stride]` for key `j0 + j`.
pub struct RowRun<'s> {
    /// Batch entry, query head and query position.
    pub at: (usize, usize, usize),
    /// First key and number of keys.
    pub keys: (usize, usize),
    /// The scores.
    pub s: &'s mut [f32],
    /// Distance between the scores of consecutive keys.
    pub stride: usize,
}

impl RowRun<'_> {
    /// The run's elements of a `(batch, head, q_len, kv_len)` view: start
    /// index and key stride, after checking that the last one lies in a
    /// buffer of `len` elements (`validate_buffers` guarantees it; the
    /// check turns a broken guarantee into a panic, not a wrong read).
    fn elements(&self, view: &View, len: usize) -> (usize, usize) {
        let (b, h, pos) = self.at;
        let (j0, n) = self.keys;
        let first = view.index([b, h, pos, j0]);
        let step = view.strides[3];
        assert!(n == 0 || first + (n - 1) * step < len);
        assert!(n == 0 || (n - 1) * self.stride < self.s.len());
        (first, step)
    }

    /// Adds the bias to the run's scores (in base-2 units).
    pub fn add_bias(&mut self, (bias, view): (&HostData, View)) {
        fn go<E: Copy>(run: &mut RowRun<'_>, src: &[E], view: &View, f: impl Fn(E) -> f32) {
            let (first, step) = run.elements(view, src.len());
            let n = run.keys.1;
            for j in 0..n {
                run.s[j * run.stride] += f(src[first + j * step]) * LOG2_E;
            }
        }
        match bias {
            HostData::F32(v) => go(self, v, &view, |x| x),
            HostData::F16(v) => go(self, v, &view, |x| x.to_f32()),
            HostData::Bf16(v) => go(self, v, &view, |x| x.to_f32()),
            HostData::F64(v) => go(self, v, &view, |x| x as f32),
            // `validate` refuses a bias that is not a float type.
            HostData::Bool(_) => unreachable!("a boolean bias is refused by validation"),
        }
    }

    /// Sets the run's scores to `-inf` where the mask is false.
    pub fn apply_mask(&mut self, (mask, view): (&[bool], View)) {
        let (first, step) = self.elements(&view, mask.len());
        for j in 0..self.keys.1 {
            if !mask[first + j * step] {
                self.s[j * self.stride] = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::for_each_vector;
    use attn_spec::{bf16, f16};

    /// A `(2, 3, 4, 5)` view of a contiguous buffer, and one whose heads
    /// and keys are broadcast (stride 0).
    fn views() -> [View; 2] {
        let full = View::contiguous([2, 3, 4, 5]);
        let mut bcast = View::contiguous([2, 1, 4, 1]);
        bcast.dims = [2, 3, 4, 5];
        bcast.strides[1] = 0;
        bcast.strides[3] = 0;
        [full, bcast]
    }

    #[test]
    fn runs_match_the_per_element_definition() {
        let vals: Vec<f64> = (0..120).map(|i| (i as f64 - 60.0) / 7.0).collect();
        let datas = [
            HostData::F32(vals.iter().map(|&x| x as f32).collect()),
            HostData::F16(vals.iter().map(|&x| f16::from_f64(x)).collect()),
            HostData::Bf16(vals.iter().map(|&x| bf16::from_f64(x)).collect()),
            HostData::F64(vals.clone()),
        ];
        let mask: Vec<bool> = (0..120).map(|i| i % 3 != 1).collect();
        for view in views() {
            for data in &datas {
                for (at, keys, stride) in [((1, 2, 3), (1, 4), 3), ((0, 0, 0), (0, 5), 1)] {
                    let s0: Vec<f32> = (0..16).map(|i| i as f32 * 0.25).collect();
                    let mut s = s0.clone();
                    let mut run = RowRun {
                        at,
                        keys,
                        s: &mut s,
                        stride,
                    };
                    run.add_bias((data, view));
                    run.apply_mask((&mask, view));
                    let mut want = s0.clone();
                    for j in 0..keys.1 {
                        let i = view.index([at.0, at.1, at.2, keys.0 + j]);
                        let x = &mut want[j * stride];
                        *x += (data.get(i) as f32) * LOG2_E;
                        if !mask[i] {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&s), bits(&want), "{view:?} {at:?} {keys:?}");
                }
            }
        }
    }

    #[test]
    fn blocks_match_row_runs_to_the_bit() {
        for_each_vector!(bias_blocks);
    }

    fn bias_blocks<V: Vector>() {
        let vals: Vec<f64> = (0..2 * 3 * 20 * 40)
            .map(|i| ((i * 37) % 101) as f64 / 9.0 - 5.0)
            .collect();
        let datas = [
            HostData::F32(vals.iter().map(|&x| x as f32).collect()),
            HostData::F16(vals.iter().map(|&x| f16::from_f64(x)).collect()),
            HostData::Bf16(vals.iter().map(|&x| bf16::from_f64(x)).collect()),
            HostData::F64(vals.clone()),
        ];
        let full = View::contiguous([2, 3, 20, 40]);
        // Keys 2 apart: not contiguous, so the block takes row runs.
        let mut strided = View::contiguous([2, 3, 20, 20]);
        strided.strides = [2400, 800, 40, 2];
        let w = 48;
        for view in [full, strided] {
            for data in &datas {
                for (nrows, j0, n) in [
                    (16, 0, 32),
                    (5, 3, 37),
                    (16, 8, 15),
                    (1, 0, 1),
                    (11, 20, 20),
                ] {
                    let n = n.min(view.dims[3] - j0);
                    let rows: Vec<(usize, usize, usize)> =
                        (0..nrows).map(|i| (i % 2, i % 3, (i * 7) % 20)).collect();
                    let st0: Vec<f32> = (0..n * w).map(|i| (i % 29) as f32 * 0.5 - 3.0).collect();
                    let mut got = st0.clone();
                    add_bias_block::<V>((data, view), &rows, (j0, n), &mut got, w);
                    if n == 0 {
                        continue;
                    }
                    let mut want = st0.clone();
                    for (i, &at) in rows.iter().enumerate() {
                        RowRun {
                            at,
                            keys: (j0, n),
                            s: &mut want[i..],
                            stride: w,
                        }
                        .add_bias((data, view));
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{nrows} rows, keys {j0}+{n}");
                    // Lanes of no row are left as they were.
                    for j in 0..n {
                        assert_eq!(
                            got[j * w + nrows..j * w + 16],
                            st0[j * w + nrows..j * w + 16]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn mask_blocks_match_row_runs() {
        for_each_vector!(mask_blocks);
    }

    fn mask_blocks<V: Vector>() {
        let mask: Vec<bool> = (0..2 * 3 * 20 * 40).map(|i| (i * 7) % 11 > 3).collect();
        let full = View::contiguous([2, 3, 20, 40]);
        let mut strided = View::contiguous([2, 3, 20, 20]);
        strided.strides = [2400, 800, 40, 2];
        let w = 48;
        for view in [full, strided] {
            for (nrows, j0, n) in [(16, 0, 32), (5, 3, 37), (16, 8, 15), (1, 0, 1)] {
                let n = n.min(view.dims[3] - j0);
                let rows: Vec<(usize, usize, usize)> =
                    (0..nrows).map(|i| (i % 2, i % 3, (i * 7) % 20)).collect();
                let st0: Vec<f32> = (0..n * w).map(|i| (i % 29) as f32 * 0.5 - 3.0).collect();
                let mut got = st0.clone();
                apply_mask_block::<V>((&mask, view), &rows, (j0, n), &mut got, w);
                let mut want = st0.clone();
                for (i, &at) in rows.iter().enumerate() {
                    RowRun {
                        at,
                        keys: (j0, n),
                        s: &mut want[i..],
                        stride: w,
                    }
                    .apply_mask((&mask, view));
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{nrows} rows, keys {j0}+{n}");
                assert!(got.contains(&f32::NEG_INFINITY));
            }
        }
    }

    #[test]
    #[should_panic]
    fn a_run_past_its_buffer_panics_instead_of_reading_on() {
        let view = View::contiguous([1, 1, 2, 4]);
        let mut s = [0.0f32; 4];
        let mut run = RowRun {
            at: (0, 0, 1),
            keys: (2, 4),
            s: &mut s,
            stride: 1,
        };
        run.add_bias((&HostData::F32(vec![0.0; 8]), view));
    }
}
