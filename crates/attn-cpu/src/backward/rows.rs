//! The backward's row passes around its tasks, on the level's vectors:
//! `D = rowsum(dO * O)` before them, dQ (the chunks' partial rows summed
//! in chunk order) after them, and the one row writer that dK, dV and dQ
//! go out through. Done one element at a time (bf16 and f16 converted
//! by scalar code compiled for the baseline), these took 13% of a bf16
//! backward (b8-h12-s256-d64, Zen 4, one thread).

use super::Plan;
use crate::blocking::LANES;
use crate::element::CpuElement;
use crate::simd::{load, Op, Vector};
use attn_spec::Problem;

/// How many of a row's `dim` elements, `step` apart, go as whole vectors
/// of 16: those before the last partial vector when they are contiguous,
/// else none.
#[inline(always)]
fn whole_vectors(dim: usize, step: usize) -> usize {
    match step {
        1 => dim - dim % LANES,
        _ => 0,
    }
}

/// Writes `dim` elements at `dst + base`, `step` apart: `row` (f32, at
/// least `dim` long) rounded once to `T`, or zeros. Whole vectors when
/// the elements are contiguous (`T::store16`, bit for bit the scalar
/// rounding), the rest one by one.
///
/// # Safety
/// `dst + base + e * step` is writable for `e < dim`, and no other thread
/// writes there meanwhile.
#[inline(always)]
pub unsafe fn store_row<V: Vector, T: CpuElement>(
    row: Option<&[f32]>,
    dst: *mut T,
    (base, step, dim): (usize, usize, usize),
) {
    assert!(row.is_none_or(|r| r.len() >= dim));
    let whole = whole_vectors(dim, step);
    for e in (0..whole).step_by(LANES) {
        let x = match row {
            // SAFETY: e + 16 <= whole <= dim <= r.len() (asserted).
            Some(r) => unsafe { load::<V>(r[e..e + LANES].as_ptr()) },
            None => V::ZERO,
        };
        // SAFETY: elements base + e .. base + e + 16 (step 1, e + 16 <=
        // dim) are writable (the caller's contract).
        unsafe { T::store16::<V>(dst.add(base + e), x) };
    }
    for e in whole..dim {
        let x = row.map_or(0.0, |r| r[e]);
        // SAFETY: e < dim (the caller's contract).
        unsafe { *dst.add(base + e * step) = T::from_f32(x) };
    }
}

/// `D` of one (batch entry, query head): `rows[i] = sum_c O[i][c] dO[i][c]`
/// in f32, sixteen running sums a row when the row is contiguous.
pub struct DRows<'a, T> {
    /// The problem (O and dO lie in its output view).
    pub p: &'a Problem,
    /// O.
    pub out: &'a [T],
    /// dO.
    pub d_out: &'a [T],
    /// The flat (batch entry, query head).
    pub bh: usize,
    /// D of its rows.
    pub rows: &'a mut [f32],
}

impl<T: CpuElement> Op for DRows<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vector>(self) {
        let s = self.p.shape;
        let (b, h) = (self.bh / s.q_heads, self.bh % s.q_heads);
        let (dim, step) = (s.head_dim_v, self.p.out.strides[3]);
        let whole = whole_vectors(dim, step);
        for (i, x) in self.rows.iter_mut().enumerate() {
            let base = self.p.out.index([b, i, h, 0]);
            assert!(dim == 0 || base + (dim - 1) * step < self.out.len().min(self.d_out.len()));
            let mut acc = V::ZERO;
            for e in (0..whole).step_by(LANES) {
                // SAFETY: base + e + 16 <= base + dim: inside both
                // tensors (asserted, step 1).
                let (o, g) = unsafe {
                    (
                        T::load16::<V>(self.out.as_ptr().add(base + e)),
                        T::load16::<V>(self.d_out.as_ptr().add(base + e)),
                    )
                };
                acc = o.mul_add(g, acc);
            }
            let mut sum = acc.reduce_add();
            for e in whole..dim {
                let at = base + e * step;
                sum += self.out[at].to_f32() * self.d_out[at].to_f32();
            }
            *x = sum;
        }
    }
}

/// A gradient buffer that several threads write, each its own rows (one
/// (batch entry, head) per [`DqRows`] call): borrowed mutably for its
/// lifetime, so the pointer stays valid for `len` elements.
pub struct SharedRows<'a, T> {
    ptr: *mut T,
    len: usize,
    _buf: std::marker::PhantomData<&'a mut [T]>,
}

impl<'a, T> SharedRows<'a, T> {
    /// Shares `buf` for row writes.
    pub fn new(buf: &'a mut [T]) -> Self {
        SharedRows {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _buf: std::marker::PhantomData,
        }
    }
}

// SAFETY: written only by `DqRows`, each call its own (batch, head) rows
// (the view was validated not to alias) while the buffer is borrowed.
unsafe impl<T: Send> Send for SharedRows<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedRows<'_, T> {}

/// dQ of one (batch entry, query head): each row the sum, in chunk order,
/// of its partial rows, rounded once to `T`; 0 for rows past the batch
/// entry's queries.
pub struct DqRows<'a, T> {
    /// The problem (dQ lies in its query view).
    pub p: &'a Problem,
    /// The plan the tasks ran.
    pub plan: &'a Plan,
    /// The partial rows (`Outs::part_rows`' layout).
    pub parts: &'a [f32],
    /// dQ.
    pub dq: &'a SharedRows<'a, T>,
    /// The flat (batch entry, query head).
    pub bh: usize,
}

impl<T: CpuElement> Op for DqRows<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vector>(self) {
        let (p, plan) = (self.p, self.plan);
        let s = p.shape;
        let (b, h) = (self.bh / s.q_heads, self.bh % s.q_heads);
        let group = s.group();
        let (kvh, hh) = (h / group, h % group);
        let unit = b * s.kv_heads + kvh;
        let (dqk, step) = (s.head_dim_qk, p.q.strides[3]);
        let layout = (plan.chunks, plan.rows, dqk.div_ceil(LANES) * LANES, group);
        let row_at = |ch: usize, i: usize| super::part_at(layout, (unit, ch), (hh, i));
        let mut acc = vec![0.0f32; dqk];
        for i in 0..s.q_len {
            let row = match (i < p.seq_lens(b).0, plan.chunks) {
                (false, _) => None,
                (true, 1) => Some(&self.parts[row_at(0, i)..][..dqk]),
                (true, chunks) => {
                    acc.copy_from_slice(&self.parts[row_at(0, i)..][..dqk]);
                    for ch in 1..chunks {
                        let part = &self.parts[row_at(ch, i)..][..dqk];
                        acc.iter_mut().zip(part).for_each(|(a, &x)| *a += x);
                    }
                    Some(&acc[..])
                }
            };
            let base = p.q.index([b, i, h, 0]);
            assert!(dqk == 0 || base + (dqk - 1) * step < self.dq.len);
            // SAFETY: in bounds of the borrowed buffer (asserted); the
            // view was validated not to alias, and each (batch entry,
            // head) is written by one call (`SharedRows`).
            unsafe { store_row::<V, T>(row, self.dq.ptr, (base, step, dqk)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::for_each_vector;
    use attn_spec::{bf16, f16};

    /// Values that round to nearest even, overflow, underflow to
    /// subnormals and zero, and keep NaN and the sign of zero.
    fn values(n: usize) -> Vec<f32> {
        let special = [
            f32::NAN,
            f32::INFINITY,
            -0.0,
            1e-40,
            -3e-39,
            f32::MAX,
            65520.0,
            1.0 + f32::EPSILON,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
        ];
        (0..n)
            .map(|i| match i % 3 {
                0 => special[(i / 3) % special.len()],
                _ => (i as f32 * 0.731).sin() * 1000.0,
            })
            .collect()
    }

    /// `store_row` writes each element as the scalar rounding does, bit
    /// for bit, contiguous (whole vectors and a tail) or strided, and
    /// zeros without a row; nothing between the strided elements.
    fn store_row_matches_scalar<V: Vector, T: CpuElement + PartialEq + std::fmt::Debug>(
        bits: fn(T) -> u32,
    ) {
        for dim in [0, 5, 16, 37, 48] {
            for step in [1, 3] {
                let row = values(dim);
                let fill = T::from_f32(7.0);
                for given in [true, false] {
                    let mut dst = vec![fill; 2 + dim * step];
                    let r = given.then_some(&row[..]);
                    // SAFETY: elements 2 + e * step < dst.len() for e < dim.
                    unsafe { store_row::<V, T>(r, dst.as_mut_ptr(), (2, step, dim)) };
                    for (at, &got) in dst.iter().enumerate() {
                        let e = (at.wrapping_sub(2)) / step;
                        let want = match at >= 2 && (at - 2) % step == 0 && e < dim {
                            true => T::from_f32(if given { row[e] } else { 0.0 }),
                            false => fill,
                        };
                        assert_eq!(
                            bits(got),
                            bits(want),
                            "{} dim {dim} step {step} row {given} at {at}",
                            V::ISA
                        );
                    }
                }
            }
        }
    }

    fn every_type<V: Vector>() {
        store_row_matches_scalar::<V, f32>(f32::to_bits);
        store_row_matches_scalar::<V, f16>(|x| u32::from(x.to_bits()));
        store_row_matches_scalar::<V, bf16>(|x| u32::from(x.to_bits()));
    }

    #[test]
    fn store_row_rounds_as_the_scalar_conversion() {
        for_each_vector!(every_type);
    }
}
