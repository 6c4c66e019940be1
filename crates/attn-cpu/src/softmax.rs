//! The online softmax state of one block of rows, in base-2 units: running
//! maximum `m` and running sum `l` per row (one lane each), updated one
//! score tile at a time, and the final normalisation with the sink.
//!
//! After a tile of scores `s_j` (already multiplied by log2(e)):
//! `m' = max(m, max_j s_j)`, `alpha = 2^(m - m')`, `p_j = 2^(s_j - m')`,
//! `l' = alpha l + sum_j p_j`, and the caller rescales its output by
//! `alpha` while adding `P V`. A row that has seen only masked scores keeps
//! `m = -inf`; it is shifted by 0 instead so that no `-inf - -inf` = NaN
//! appears, and its probabilities are exactly 0.

use crate::blocking::LANES;
use crate::exp::exp2;
use crate::simd::{load, store, Vector};

/// Running maximum and sum of a block of `NV * 16` rows.
#[derive(Clone, Debug)]
pub struct OnlineSoftmax<V, const NV: usize> {
    /// Running maximum per row (base-2 units), `-inf` before any key.
    pub m: [V; NV],
    /// Running sum of `2^(s - m)` per row.
    pub l: [V; NV],
}

impl<V: Vector, const NV: usize> OnlineSoftmax<V, NV> {
    /// The state before any key.
    #[inline(always)]
    pub fn new() -> Self {
        OnlineSoftmax {
            m: [V::splat(f32::NEG_INFINITY); NV],
            l: [V::ZERO; NV],
        }
    }

    /// Folds the score tile `st` (`n x NV*16`) into the state, replaces
    /// vector `v`'s scores of keys `keys[v]` (a range within `0..n`) by the
    /// probabilities `2^(s - m')`, and returns the rescale factors `alpha`
    /// for the running output. Vector `v`'s scores outside its keys are
    /// neither read nor replaced (every row of the vector must be masked
    /// there; the tile may hold anything), and a vector with no keys
    /// keeps its state (rescale factor 1). `top`, when given,
    /// holds each row's largest score in the tile (`NV*16` floats, as the
    /// score kernels folded them): the tile is not read for it again.
    /// With `unflushed`, for scores that are finite products or `-inf`
    /// (no bias or option moved them), the exponential skips its flush
    /// under 2^-126 (`Vector::exp2_unflushed`).
    #[allow(clippy::needless_range_loop)] // `v` indexes alpha and the tile
    #[inline(always)]
    pub fn update(
        &mut self,
        st: &mut [f32],
        n: usize,
        keys: &[(usize, usize); NV],
        top: Option<&[f32]>,
        unflushed: bool,
    ) -> [V; NV] {
        assert!(st.len() >= n * NV * LANES);
        let mut alpha = [V::ONE; NV];
        for v in 0..NV {
            let (a, b) = keys[v];
            assert!(a <= b && b <= n);
            if a == b {
                continue;
            }
            let shift;
            (shift, alpha[v]) = self.max_of(st, a..b, top, v);
            let sum = match unflushed {
                true => key_run::<V, NV, true>(st, v, a..b, shift),
                false => key_run::<V, NV, false>(st, v, a..b, shift),
            };
            self.l[v] = self.l[v].mul_add(alpha[v], sum);
        }
        alpha
    }

    /// [`OnlineSoftmax::update`] that hands the probabilities out in pairs
    /// of keys: `emit(at, p_2i, p_2i+1)` for each pair `i` in `pairs[v]`
    /// (a range within `0..ceil(n/2)`) and vector `v` of rows (the partner
    /// of an odd last key is 0), where `at` is key `2i`'s 16 floats of
    /// vector `v` in the tile, read already and free for the pair (the
    /// bf16 pair layout of `dot16/`, stored in place: rows of pairs `2 NV *
    /// 16` floats apart, in the lines the tile's loads just brought into
    /// L1). Vector `v`'s scores outside its pairs are not read (every row
    /// of the vector must be masked there; the tile may hold anything),
    /// and a vector with no pairs keeps its state (rescale factor 1). The sum runs
    /// over the unrounded probabilities. They come from the coarse
    /// exponential (`Vector::exp2_coarse`): the caller rounds them to
    /// bf16. With `unflushed`, for scores that are finite products or
    /// `-inf` (no bias or option moved them), from the same without its
    /// flush under 2^-126 (`Vector::exp2_coarse_unflushed`). `top`, when given, holds each
    /// row's largest score in the tile (`NV * 16` floats, as the score
    /// kernel folded them): the tile is not read for it again.
    #[allow(clippy::needless_range_loop)] // `v` indexes alpha and the tile
    #[inline(always)]
    pub fn update_pairs(
        &mut self,
        st: &mut [f32],
        n: usize,
        pairs: &[(usize, usize); NV],
        top: Option<&[f32]>,
        unflushed: bool,
        mut emit: impl FnMut(*mut f32, V, V),
    ) -> [V; NV] {
        assert!(st.len() >= n * NV * LANES);
        let mut alpha = [V::ONE; NV];
        for v in 0..NV {
            let (i0, i1) = pairs[v];
            assert!(i0 <= i1 && i1 <= n.div_ceil(2));
            if i0 == i1 {
                continue;
            }
            let shift;
            (shift, alpha[v]) = self.max_of(st, 2 * i0..(2 * i1).min(n), top, v);
            let sum = match unflushed {
                true => pair_run::<V, NV, true>(st, n, v, (i0, i1), shift, &mut emit),
                false => pair_run::<V, NV, false>(st, n, v, (i0, i1), shift, &mut emit),
            };
            self.l[v] = self.l[v].mul_add(alpha[v], sum);
        }
        alpha
    }

    /// Folds the maximum of vector `v`'s scores of keys `keys` of the tile
    /// into the state; returns the shift for the probabilities (the new
    /// maximum, or 0 for rows that have seen only masked scores) and the
    /// rescale factor.
    #[inline(always)]
    fn new_max(&mut self, st: &[f32], keys: std::ops::Range<usize>, v: usize) -> (V, V) {
        let w = NV * LANES;
        assert!(st.len() >= keys.end * w && v < NV);
        let mut mx = self.m[v];
        for j in keys {
            // SAFETY: j < keys.end and v < NV (asserted): 16 floats in st.
            mx = mx.fast_max(unsafe { load::<V>(st.as_ptr().add(j * w + v * LANES)) });
        }
        self.shift_to(mx, v)
    }

    /// [`OnlineSoftmax::new_max`] from the tile's maxima `top` when given.
    #[inline(always)]
    fn max_of(
        &mut self,
        st: &[f32],
        keys: std::ops::Range<usize>,
        top: Option<&[f32]>,
        v: usize,
    ) -> (V, V) {
        match top {
            Some(t) => {
                assert!(t.len() >= NV * LANES && v < NV);
                // SAFETY: 16 floats at v * 16 (asserted).
                let t = unsafe { load::<V>(t.as_ptr().add(v * LANES)) };
                self.shift_to(self.m[v].fast_max(t), v)
            }
            None => self.new_max(st, keys, v),
        }
    }

    /// Makes `mx` vector `v`'s running maximum; returns the shift and
    /// rescale factor as [`OnlineSoftmax::new_max`].
    #[inline(always)]
    fn shift_to(&mut self, mx: V, v: usize) -> (V, V) {
        let shift = mx.replace_where_eq(mx, f32::NEG_INFINITY, 0.0);
        let alpha = exp2(self.m[v] - shift);
        self.m[v] = mx;
        (shift, alpha)
    }

    /// Row `r`'s final `(factor, lse)`: the output row is `factor * O^T[..][r]`
    /// and the natural log-sum-exp is `lse`. `sink` is the row's sink logit
    /// (natural units) if any. A row with no visible key and no sink gives
    /// factor 0 and lse `-inf`.
    #[inline(always)]
    pub fn finish(&self, r: usize, sink: Option<f32>) -> (f32, f32) {
        let (m, l) = self.row(r);
        finish_row(m, l, sink)
    }

    /// The factor of [`OnlineSoftmax::finish`] alone, for callers that
    /// store no log-sum-exp (it spares a logarithm per row).
    #[inline(always)]
    pub fn factor(&self, r: usize, sink: Option<f32>) -> f32 {
        let (m, l) = self.row(r);
        let (scale_o, _, l) = with_sink(m, l, sink);
        if l <= 0.0 {
            0.0
        } else {
            scale_o / l
        }
    }

    /// [`OnlineSoftmax::factor`] of rows `0..out.len()` without sinks, a
    /// vector at a time, into `out[r].0` (`1 / l`, or 0 for a row with no
    /// visible key; bit for bit the per-row factor).
    #[inline(always)]
    pub fn factors(&self, out: &mut [(f32, f32)]) {
        assert!(out.len() <= NV * LANES);
        for (v, rows) in out.chunks_mut(LANES).enumerate() {
            let l = self.l[v];
            let f = (V::ONE / l).replace_where_eq(l, 0.0, 0.0).to_array();
            for (o, &x) in rows.iter_mut().zip(&f) {
                o.0 = x;
            }
        }
    }

    /// Row `r`'s running maximum and sum.
    #[inline(always)]
    fn row(&self, r: usize) -> (f32, f32) {
        let (v, lane) = (r / LANES, r % LANES);
        (self.m[v].to_array()[lane], self.l[v].to_array()[lane])
    }
}

impl<V: Vector, const NV: usize> Default for OnlineSoftmax<V, NV> {
    fn default() -> Self {
        Self::new()
    }
}

/// [`OnlineSoftmax::finish`] for one row's `m` (base 2) and `l`.
pub fn finish_row(m: f32, l: f32, sink: Option<f32>) -> (f32, f32) {
    let (scale_o, m, l) = with_sink(m, l, sink);
    if l <= 0.0 {
        // No visible key and no sink (a NaN l falls through and propagates).
        return (0.0, f32::NEG_INFINITY);
    }
    let factor = scale_o / l;
    let lse = (m + l.log2()) * std::f32::consts::LN_2;
    (factor, lse)
}

/// A row's `m` and `l` with the sink logit (natural units) folded in, and
/// the factor the running output takes for it: `(scale_o, m, l)`.
#[inline(always)]
fn with_sink(m: f32, l: f32, sink: Option<f32>) -> (f32, f32, f32) {
    let (mut m, mut l) = (m, l);
    let mut scale_o = 1.0f32;
    if let Some(s) = sink {
        let s2 = s * std::f32::consts::LOG2_E;
        let mf = if m == f32::NEG_INFINITY {
            s2
        } else {
            m.max(s2)
        };
        let a = if m == f32::NEG_INFINITY {
            0.0
        } else {
            (m - mf).exp2()
        };
        l = l * a + (s2 - mf).exp2();
        scale_o = a;
        m = mf;
    }
    (scale_o, m, l)
}

/// The probabilities `2^(s - shift)` of vector `v`'s keys `keys` of the
/// tile `st` (keys of `NV * 16` floats), in place, for
/// [`OnlineSoftmax::update`] (by the exponential without its flush where
/// `UNFLUSHED`); returns their sum.
#[inline(always)]
fn key_run<V: Vector, const NV: usize, const UNFLUSHED: bool>(
    st: &mut [f32],
    v: usize,
    keys: std::ops::Range<usize>,
    shift: V,
) -> V {
    let w = NV * LANES;
    assert!(v < NV && st.len() >= keys.end * w);
    // As in `pair_run`: `s * 1 - shift` on the FMA pipes.
    let neg = V::ZERO - shift;
    let mut sum = V::ZERO;
    let p = st.as_mut_ptr();
    for j in keys {
        let at = j * w + v * LANES;
        // SAFETY: j < keys.end and v < NV (asserted): 16 floats at `at`.
        let x = unsafe { load::<V>(p.add(at)) }.mul_add(V::ONE, neg);
        let e = match UNFLUSHED {
            true => x.exp2_unflushed(),
            false => exp2(x),
        };
        // SAFETY: as above.
        unsafe { store(p.add(at), e) };
        sum += e;
    }
    sum
}

/// The probabilities of vector `v`'s pairs `i0..i1` of the tile `st` (`n`
/// keys of `NV * 16` floats) for [`OnlineSoftmax::update_pairs`]:
/// `emit(at, p_2i, p_2i+1)` for each, `p = 2^(s - shift)` by the coarse
/// exponential (unflushed where `UNFLUSHED`); returns their sum.
#[inline(always)]
fn pair_run<V: Vector, const NV: usize, const UNFLUSHED: bool>(
    st: &mut [f32],
    n: usize,
    v: usize,
    (i0, i1): (usize, usize),
    shift: V,
    emit: &mut impl FnMut(*mut f32, V, V),
) -> V {
    let w = NV * LANES;
    assert!(v < NV && i0 <= i1 && i1 <= n.div_ceil(2) && st.len() >= n * w);
    let col = |j: usize| j * w + v * LANES;
    // `s * 1 + (0 - shift)` rounds once, as `s - shift` does: the same
    // value but for the sign of a zero (-0 + +0 against -0 - +0), which
    // the exponential maps to 1 either way; on the FMA pipes (Zen 4's add
    // pipes are the loop's busier ones: 5% faster).
    let neg = V::ZERO - shift;
    let exp = |s: V| {
        let x = s.mul_add(V::ONE, neg);
        match UNFLUSHED {
            true => x.exp2_coarse_unflushed(),
            false => x.exp2_coarse(),
        }
    };
    let mut sum = V::ZERO;
    let p = st.as_mut_ptr();
    for i in i0..i1.min(n / 2) {
        // SAFETY: 2i + 1 < n and the assert above: 16 floats at each.
        let (s0, s1) = unsafe {
            (
                load::<V>(p.add(col(2 * i))),
                load::<V>(p.add(col(2 * i + 1))),
            )
        };
        let (e0, e1) = (exp(s0), exp(s1));
        // SAFETY: as above (key 2i's floats, read).
        emit(unsafe { p.add(col(2 * i)) }, e0, e1);
        sum += e0 + e1;
    }
    if i1 > n / 2 {
        // (n is odd and the last pair is key n - 1 alone.)
        // SAFETY: n - 1 < n: 16 floats at col(n - 1).
        let e = exp(unsafe { load::<V>(p.add(col(n - 1))) });
        // SAFETY: as above.
        emit(unsafe { p.add(col(n - 1)) }, e, V::ZERO);
        sum += e;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROWS: usize = 64;

    use crate::simd::for_each_vector;

    #[test]
    fn two_tiles_equal_one_softmax() {
        for_each_vector!(two_tiles);
    }

    fn two_tiles<V: Vector>() {
        let mut st = vec![0.0f32; 3 * ROWS];
        for j in 0..3 {
            for r in 0..ROWS {
                st[j * ROWS + r] = (j as f32 - 1.0) * (r as f32 / 32.0);
            }
        }
        let mut a = OnlineSoftmax::<V, 4>::new();
        let mut t1 = st[..ROWS].to_vec();
        let mut t2 = st[ROWS..].to_vec();
        a.update(&mut t1, 1, &[(0, 1); 4], None, false);
        a.update(&mut t2, 2, &[(0, 2); 4], None, false);
        // The same tiles with their maxima given (as the score kernels
        // fold them) give the same state and probabilities, bit for bit.
        let mut b = OnlineSoftmax::<V, 4>::new();
        let (mut u1, mut u2) = (st[..ROWS].to_vec(), st[ROWS..].to_vec());
        let top = |t: &[f32], n: usize| -> Vec<f32> {
            (0..ROWS)
                .map(|r| {
                    (0..n)
                        .map(|j| t[j * ROWS + r])
                        .fold(f32::NEG_INFINITY, f32::max)
                })
                .collect()
        };
        let (m1, m2) = (top(&u1, 1), top(&u2, 2));
        b.update(&mut u1, 1, &[(0, 1); 4], Some(&m1), true);
        b.update(&mut u2, 2, &[(0, 2); 4], Some(&m2), true);
        assert!(t1 == u1 && t2 == u2);
        for r in 0..ROWS {
            assert_eq!(a.finish(r, None), b.finish(r, None));
            for sink in [None, Some(0.75)] {
                assert_eq!(a.factor(r, sink), a.finish(r, sink).0);
            }
        }
        let mut fin = vec![(0.0, 0.0); ROWS - 3];
        a.factors(&mut fin);
        for (r, &(f, _)) in fin.iter().enumerate() {
            assert_eq!(f.to_bits(), a.factor(r, None).to_bits());
        }
        for r in 0..ROWS {
            let (_, lse) = a.finish(r, None);
            let want: f64 = (0..3)
                .map(|j| f64::from(st[j * ROWS + r]).exp2())
                .sum::<f64>()
                .log2()
                * std::f64::consts::LN_2;
            assert!((f64::from(lse) - want).abs() < 1e-6, "{lse} {want}");
        }
    }

    /// Each vector only over its keys (the parts' spans of a masked tile):
    /// the same probabilities and state, bit for bit, as over the whole
    /// tile when every score outside the spans is `-inf`; an empty span
    /// leaves the state as it was; in pairs, the lone last key of an odd
    /// tile as a span of its own.
    #[test]
    fn spans_give_the_whole_tiles_results() {
        for_each_vector!(spans_match);
    }

    fn spans_match<V: Vector>() {
        let n = 5;
        let spans = [(0, 5), (1, 4), (2, 2), (4, 5)];
        let mut st = vec![f32::NEG_INFINITY; n * ROWS];
        for (v, &(a, b)) in spans.iter().enumerate() {
            for j in a..b {
                for l in 0..LANES {
                    st[j * ROWS + v * LANES + l] = ((j * 7 + l * 3 + v) % 11) as f32 * 0.37 - 2.0;
                }
            }
        }
        let (mut whole, mut part) = (st.clone(), st.clone());
        let mut a = OnlineSoftmax::<V, 4>::new();
        let mut b = OnlineSoftmax::<V, 4>::new();
        a.update(&mut whole, n, &[(0, n); 4], None, false);
        let alpha = b.update(&mut part, n, &spans, None, true);
        assert_eq!(alpha[2].to_array(), [1.0; 16]);
        for (v, &(lo, hi)) in spans.iter().enumerate() {
            for j in 0..n {
                for l in 0..LANES {
                    let at = j * ROWS + v * LANES + l;
                    match (lo..hi).contains(&j) {
                        true => assert_eq!(part[at].to_bits(), whole[at].to_bits()),
                        // Not replaced.
                        false => assert_eq!(part[at], f32::NEG_INFINITY),
                    }
                }
            }
        }
        let pairs = [(0, 3), (0, 2), (0, 0), (2, 3)];
        let mut c = OnlineSoftmax::<V, 4>::new();
        let mut d = OnlineSoftmax::<V, 4>::new();
        // (pair, vector) from where a pair is stored: key 2i's floats of
        // the vector in the tile.
        let at = |base: usize, x: *mut f32| {
            let o = (x as usize - base) / 4;
            assert_eq!(o % LANES, 0);
            (o / ROWS / 2, o % ROWS / LANES)
        };
        let (mut t, mut u) = (st.clone(), st.clone());
        let (tb, ub) = (t.as_ptr() as usize, u.as_ptr() as usize);
        let mut all = vec![];
        // Each pair's floats get NaN as it is stored: a score read after
        // its slot was handed out would show as NaN below.
        let spoil = |x: *mut f32| {
            // SAFETY: update_pairs hands out 16 floats of the tile.
            unsafe { std::ptr::write_bytes(x, 0xff, LANES) }
        };
        c.update_pairs(&mut t, n, &[(0, 3); 4], None, false, |x, e0, e1| {
            all.push((at(tb, x).0, at(tb, x).1, e0, e1));
            spoil(x);
        });
        let mut some = vec![];
        d.update_pairs(&mut u, n, &pairs, None, false, |x, e0, e1| {
            some.push((at(ub, x).0, at(ub, x).1, e0, e1));
            spoil(x);
        });
        let key = |&(i, v, _, _): &(usize, usize, V, V)| (i, v);
        let want: Vec<_> = all
            .iter()
            .filter(|&&(i, v, _, _)| (pairs[v].0..pairs[v].1).contains(&i))
            .collect();
        assert_eq!(some.len(), want.len());
        for (x, y) in some.iter().zip(want) {
            assert_eq!(key(x), key(y));
            assert_eq!(
                (x.2.to_array(), x.3.to_array()),
                (y.2.to_array(), y.3.to_array())
            );
        }
        for r in 0..ROWS {
            assert_eq!(a.finish(r, None), b.finish(r, None), "row {r}");
            assert_eq!(c.finish(r, None), d.finish(r, None), "row {r}");
        }
        // Vector 2 saw nothing: 0 and -inf, as a fully masked row.
        assert_eq!(b.finish(2 * LANES, None), (0.0, f32::NEG_INFINITY));
        // Without the flush (the scores are finite or -inf, their spread
        // far under 127): the same pairs and state, bit for bit, over the
        // whole tile with its -inf, and 0 for a -inf score.
        let mut e = OnlineSoftmax::<V, 4>::new();
        let mut x = st.clone();
        let mut none = vec![];
        e.update_pairs(&mut x, n, &[(0, 3); 4], None, true, |p, e0, e1| {
            none.push((e0.to_array(), e1.to_array()));
            spoil(p);
        });
        let flushed: Vec<_> = all
            .iter()
            .map(|y| (y.2.to_array(), y.3.to_array()))
            .collect();
        assert_eq!(none, flushed);
        assert!(none.iter().any(|(p, _)| p.contains(&0.0)));
        for r in 0..ROWS {
            assert_eq!(c.finish(r, None), e.finish(r, None), "row {r}");
        }
    }

    /// `unflushed` reaches the exponential: a score 135 below its row's
    /// maximum gives exactly 0 flushed, and 2^-135 (subnormal) unflushed
    /// where the level has such an exponential (AVX-512; elsewhere 0),
    /// in `update` and in `update_pairs` alike.
    #[test]
    fn unflushed_keeps_probabilities_under_the_flush() {
        for_each_vector!(unflushed_keeps);
    }

    fn unflushed_keeps<V: Vector>() {
        let tiny = match V::ISA {
            crate::simd::Isa::Portable | crate::simd::Isa::Avx2 => 0.0,
            _ => 2f32.powi(-135),
        };
        // Key 0 at 0 (the maximum), key 1 at -135, for every row.
        let mut st = vec![0.0f32; 2 * ROWS];
        st[ROWS..].fill(-135.0);
        for unflushed in [false, true] {
            let want = if unflushed { tiny } else { 0.0 };
            let mut t = st.clone();
            OnlineSoftmax::<V, 4>::new().update(&mut t, 2, &[(0, 2); 4], None, unflushed);
            assert!(t[..ROWS].iter().all(|&p| p == 1.0));
            assert!(
                t[ROWS..].iter().all(|&p| p == want),
                "{:?} {unflushed}",
                V::ISA
            );
            let mut u = st.clone();
            let mut seen = 0;
            let mut s = OnlineSoftmax::<V, 4>::new();
            s.update_pairs(&mut u, 2, &[(0, 1); 4], None, unflushed, |_, e0, e1| {
                assert_eq!(e0.to_array(), [1.0; 16]);
                assert_eq!(e1.to_array(), [want; 16], "{:?} {unflushed}", V::ISA);
                seen += 1;
            });
            assert_eq!(seen, 4);
        }
    }

    #[test]
    fn masked_rows_finish_to_zero_and_minus_infinity() {
        for_each_vector!(masked_rows);
    }

    fn masked_rows<V: Vector>() {
        let mut s = OnlineSoftmax::<V, 4>::new();
        let mut st = vec![f32::NEG_INFINITY; 2 * ROWS];
        let alpha = s.update(&mut st, 2, &[(0, 2); 4], None, true);
        assert!(st.iter().all(|&p| p == 0.0));
        assert!(alpha.iter().all(|a| a.to_array().iter().all(|&x| x == 0.0)));
        let mut fin = [(1.0, 0.0); 20];
        s.factors(&mut fin);
        assert!(fin.iter().all(|&(f, _)| f == 0.0));
        assert_eq!(s.finish(0, None), (0.0, f32::NEG_INFINITY));
        let (f, lse) = s.finish(0, Some(1.5));
        assert_eq!(f, 0.0);
        assert!((lse - 1.5).abs() < 1e-6);
    }
}
