//! Tensor descriptions: a rank-4 strided view into a flat buffer, and the
//! host-side buffer type that moves data in and out of any backend.
//!
//! Every tensor attn reads or writes is a [`View`]: four logical dimensions,
//! four strides counted in elements, and an offset. The logical axes are
//! `(batch, seq, head, dim)` for Q, K, V and the output, and
//! `(batch, head, q, k)` for the bias and the boolean mask. Strides make both
//! the `[batch, seq, heads, dim]` layout a projection produces (the default)
//! and the `[batch, heads, seq, dim]` layout work without a copy, and an
//! offset lets Q, K and V be slices of one fused QKV projection. A dimension
//! of size 1 in a bias or mask view broadcasts.

use crate::dtype::{DType, Element};
use half::{bf16, f16};

/// A rank-4 strided view: `element(i0, i1, i2, i3)` lives at
/// `offset + i0*strides[0] + i1*strides[1] + i2*strides[2] + i3*strides[3]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// Logical sizes of the four axes.
    pub dims: [usize; 4],
    /// Distance in elements between neighbours along each axis.
    pub strides: [usize; 4],
    /// Index of element `(0, 0, 0, 0)`.
    pub offset: usize,
}

impl View {
    /// A contiguous row-major view of `dims` (last axis fastest). Stride
    /// arithmetic wraps rather than panics on absurd sizes; validation then
    /// reports the overflow (see [`View::numel`]).
    pub fn contiguous(dims: [usize; 4]) -> Self {
        let s2 = dims[3];
        let s1 = dims[2].wrapping_mul(s2);
        let s0 = dims[1].wrapping_mul(s1);
        let strides = [s0, s1, s2, 1];
        View {
            dims,
            strides,
            offset: 0,
        }
    }

    /// Logical `(batch, seq, head, dim)` stored as `[batch, seq, heads, dim]`
    /// (the default layout).
    pub fn bshd(batch: usize, seq: usize, heads: usize, dim: usize) -> Self {
        Self::contiguous([batch, seq, heads, dim])
    }

    /// Logical `(batch, seq, head, dim)` stored as `[batch, heads, seq, dim]`.
    pub fn bhsd(batch: usize, seq: usize, heads: usize, dim: usize) -> Self {
        View {
            dims: [batch, seq, heads, dim],
            strides: [
                heads.wrapping_mul(seq).wrapping_mul(dim),
                dim,
                seq.wrapping_mul(dim),
                1,
            ],
            offset: 0,
        }
    }

    /// The same view starting `offset` elements further into the buffer.
    pub fn with_offset(mut self, offset: usize) -> Self {
        self.offset = offset;
        self
    }

    /// Number of logical elements (product of the dims), `None` on overflow.
    pub fn numel(&self) -> Option<usize> {
        self.dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
    }

    /// One past the largest buffer index the view touches (0 for an empty
    /// view), `None` on overflow. A buffer must be at least this long.
    pub fn extent(&self) -> Option<usize> {
        if self.dims.contains(&0) {
            return Some(0);
        }
        let mut last = self.offset;
        for (d, s) in self.dims.iter().zip(self.strides) {
            last = last.checked_add((d - 1).checked_mul(s)?)?;
        }
        last.checked_add(1)
    }

    /// Buffer index of a logical element. A dimension of size 1 broadcasts:
    /// any index along it reads element 0. The caller keeps other indices in
    /// range (validation guarantees the result is then in the buffer).
    #[inline]
    pub fn index(&self, i: [usize; 4]) -> usize {
        let mut at = self.offset;
        for ((&ix, &d), &s) in i.iter().zip(&self.dims).zip(&self.strides) {
            if d != 1 {
                at += ix * s;
            }
        }
        at
    }

    /// Whether two distinct logical elements can share a buffer index.
    /// Sufficient test: sorted by stride, each axis must step over the whole
    /// extent of the axes with smaller strides.
    pub fn may_alias(&self) -> bool {
        if self.dims.contains(&0) {
            return false; // an empty view has no element to share
        }
        let mut axes: Vec<(usize, usize)> = self
            .strides
            .iter()
            .zip(self.dims)
            .filter(|(_, d)| *d > 1)
            .map(|(&s, d)| (s, d))
            .collect();
        axes.sort_unstable();
        let mut span = 1usize; // elements covered by the smaller axes
        for (s, d) in axes {
            if s < span {
                return true;
            }
            span = match s.checked_mul(d) {
                Some(x) => x,
                None => return true,
            };
        }
        false
    }
}

/// A host buffer of any element type: how data enters and leaves a backend
/// ([`crate::Backend::upload`] / [`crate::Backend::download`]).
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    Bf16(Vec<bf16>),
    /// f64 elements.
    F64(Vec<f64>),
    /// Boolean elements (masks).
    Bool(Vec<bool>),
}

impl HostData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::F16(_) => DType::F16,
            HostData::Bf16(_) => DType::Bf16,
            HostData::F64(_) => DType::F64,
            HostData::Bool(_) => DType::Bool,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::F16(v) => v.len(),
            HostData::Bf16(v) => v.len(),
            HostData::F64(v) => v.len(),
            HostData::Bool(v) => v.len(),
        }
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A buffer of `len` zeros (`false` for `Bool`).
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => HostData::F32(vec![0.0; len]),
            DType::F16 => HostData::F16(vec![f16::ZERO; len]),
            DType::Bf16 => HostData::Bf16(vec![bf16::ZERO; len]),
            DType::F64 => HostData::F64(vec![0.0; len]),
            DType::Bool => HostData::Bool(vec![false; len]),
        }
    }

    /// Rounds each f64 to `dtype` (non-zero is `true` for `Bool`).
    pub fn from_f64(dtype: DType, values: &[f64]) -> Self {
        fn conv<T: Element>(v: &[f64]) -> Vec<T> {
            v.iter().map(|&x| T::from_f64(x)).collect()
        }
        match dtype {
            DType::F32 => HostData::F32(conv(values)),
            DType::F16 => HostData::F16(conv(values)),
            DType::Bf16 => HostData::Bf16(conv(values)),
            DType::F64 => HostData::F64(values.to_vec()),
            DType::Bool => HostData::Bool(values.iter().map(|&x| x != 0.0).collect()),
        }
    }

    /// Element `i` widened to f64 (`Bool` reads as 0 or 1). Panics when `i`
    /// is out of range, like slice indexing.
    #[inline]
    pub fn get(&self, i: usize) -> f64 {
        match self {
            HostData::F32(v) => f64::from(v[i]),
            HostData::F16(v) => v[i].to_f64(),
            HostData::Bf16(v) => v[i].to_f64(),
            HostData::F64(v) => v[i],
            HostData::Bool(v) => f64::from(u8::from(v[i])),
        }
    }

    /// Stores `x` at `i`, rounded to the buffer's type.
    #[inline]
    pub fn set(&mut self, i: usize, x: f64) {
        match self {
            HostData::F32(v) => v[i] = x as f32,
            HostData::F16(v) => v[i] = f16::from_f64(x),
            HostData::Bf16(v) => v[i] = bf16::from_f64(x),
            HostData::F64(v) => v[i] = x,
            HostData::Bool(v) => v[i] = x != 0.0,
        }
    }

    /// All elements widened to f64.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bhsd_and_bshd_address_the_same_logical_element_differently() {
        let a = View::bshd(2, 3, 4, 5);
        let b = View::bhsd(2, 3, 4, 5);
        assert_eq!(a.index([1, 2, 3, 4]), ((3 + 2) * 4 + 3) * 5 + 4);
        assert_eq!(b.index([1, 2, 3, 4]), ((4 + 3) * 3 + 2) * 5 + 4);
        assert_eq!(a.extent(), Some(120));
        assert_eq!(b.extent(), Some(120));
    }

    #[test]
    fn broadcast_dims_read_element_zero() {
        let v = View::contiguous([1, 1, 3, 4]);
        assert_eq!(v.index([5, 7, 2, 3]), 11);
    }

    #[test]
    fn extent_detects_overflow_and_empty_views() {
        let mut v = View::contiguous([2, 2, 2, 2]);
        v.strides[0] = usize::MAX;
        assert_eq!(v.extent(), None);
        assert_eq!(View::contiguous([2, 0, 2, 2]).extent(), Some(0));
    }

    #[test]
    fn aliasing_is_detected() {
        assert!(!View::bshd(2, 3, 4, 5).may_alias());
        assert!(!View::bhsd(2, 3, 4, 5).may_alias());
        let mut v = View::bshd(2, 3, 4, 5);
        v.strides[2] = 0;
        assert!(v.may_alias());
        v.strides[2] = 3; // heads overlap the 5-wide dim axis
        assert!(v.may_alias());
    }
}
