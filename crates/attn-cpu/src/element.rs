//! Input element types on the CPU: how a row of f32, f16 or bf16 becomes
//! the f32 the kernels compute in, and how results are rounded back.

use crate::simd::Vector;
use attn_spec::{bf16, f16, Element, HostData};
use half::slice::HalfFloatSliceExt;

/// An element type attn-cpu computes on: f32, f16 and bf16.
pub trait CpuElement: Element {
    /// The slice itself when it already is f32 (no conversion needed).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// Widens `src` into `dst` (same length), with vectors `V`.
    fn widen<V: Vector>(src: &[Self], dst: &mut [f32]);
    /// Loads 16 elements from `p` (unaligned), widened to f32: how the
    /// decode kernels read K and V rows in place, whatever their type.
    ///
    /// # Safety
    /// `p..p+16` must be readable elements.
    unsafe fn load16<V: Vector>(p: *const Self) -> V;
    /// Loads 16 elements widened to f32, lanes `4g..4g + 4` from `at[g]`
    /// ([`Vector::load_quarters`]). Element by element by default (which
    /// f16 and bf16 keep: the decode kernel reads only f32 rows this way,
    /// `microkernel::decode::rotation`).
    ///
    /// # Safety
    /// `at[g]..at[g] + 4` must be readable elements for each `g`.
    #[inline(always)]
    unsafe fn load16_quarters<V: Vector>(at: [*const Self; 4]) -> V {
        V::from(std::array::from_fn(|l| {
            // SAFETY: lane 4g + i reads at[g] + i, i < 4 (the caller's).
            unsafe { *at[l / 4].add(l % 4) }.to_f32()
        }))
    }
    /// Stores the 16 lanes of `v` at `p` (unaligned), each rounded once to
    /// this type, bit for bit as [`CpuElement::store_scaled`] with factor
    /// 1: how whole output vectors go out. One by one by default.
    ///
    /// # Safety
    /// `p..p+16` must be writable elements.
    #[inline(always)]
    unsafe fn store16<V: Vector>(p: *mut Self, v: V) {
        // SAFETY: the caller guarantees 16 writable elements at `p`.
        let dst = unsafe { std::slice::from_raw_parts_mut(p, 16) };
        Self::store_scaled(&v.to_array(), 1.0, dst);
    }
    /// Stores `src * f` into `dst` (same length), rounding once.
    fn store_scaled(src: &[f32], f: f32, dst: &mut [Self]);
    /// The typed slice inside host data of this type.
    fn host(d: &HostData) -> Option<&[Self]>;
    /// The typed mutable slice inside host data of this type.
    fn host_mut(d: &mut HostData) -> Option<&mut [Self]>;
}

impl CpuElement for f32 {
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
    #[inline(always)]
    fn widen<V: Vector>(src: &[f32], dst: &mut [f32]) {
        crate::pack::copy_row::<V>(src, dst);
    }
    #[inline(always)]
    unsafe fn load16<V: Vector>(p: *const f32) -> V {
        // SAFETY: the caller guarantees 16 readable f32 at `p`.
        unsafe { V::load(p) }
    }
    #[inline(always)]
    unsafe fn load16_quarters<V: Vector>(at: [*const f32; 4]) -> V {
        // SAFETY: forwarded from the caller.
        unsafe { V::load_quarters(at) }
    }
    #[inline(always)]
    unsafe fn store16<V: Vector>(p: *mut f32, v: V) {
        // SAFETY: the caller guarantees 16 writable f32 at `p`.
        unsafe { v.store(p) }
    }
    fn store_scaled(src: &[f32], f: f32, dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s * f;
        }
    }
    fn host(d: &HostData) -> Option<&[f32]> {
        match d {
            HostData::F32(v) => Some(v),
            _ => None,
        }
    }
    fn host_mut(d: &mut HostData) -> Option<&mut [f32]> {
        match d {
            HostData::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl CpuElement for f16 {
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn widen<V: Vector>(src: &[f16], dst: &mut [f32]) {
        // Uses F16C when the CPU has it (detected at run time by `half`).
        src.convert_to_f32_slice(dst);
    }
    #[inline(always)]
    unsafe fn load16<V: Vector>(p: *const f16) -> V {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe { V::load_f16(p) }
    }
    fn store_scaled(src: &[f32], f: f32, dst: &mut [f16]) {
        let mut buf = [0.0f32; 64];
        for (s, d) in src.chunks(64).zip(dst.chunks_mut(64)) {
            for (b, &x) in buf.iter_mut().zip(s) {
                *b = x * f;
            }
            d.convert_from_f32_slice(&buf[..s.len()]);
        }
    }
    fn host(d: &HostData) -> Option<&[f16]> {
        match d {
            HostData::F16(v) => Some(v),
            _ => None,
        }
    }
    fn host_mut(d: &mut HostData) -> Option<&mut [f16]> {
        match d {
            HostData::F16(v) => Some(v),
            _ => None,
        }
    }
}

impl CpuElement for bf16 {
    fn as_f32(_: &[bf16]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn widen<V: Vector>(src: &[bf16], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift the compiler vectorises
        // (for the level it is inlined into).
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    #[inline(always)]
    unsafe fn load16<V: Vector>(p: *const bf16) -> V {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        unsafe { V::load_bf16(p) }
    }
    #[inline(always)]
    unsafe fn store16<V: Vector>(p: *mut bf16, v: V) {
        // SAFETY: the caller guarantees 16 writable elements at `p`.
        unsafe { v.store_bf16(p) }
    }
    fn store_scaled(src: &[f32], f: f32, dst: &mut [bf16]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16::from_f32(s * f);
        }
    }
    fn host(d: &HostData) -> Option<&[bf16]> {
        match d {
            HostData::Bf16(v) => Some(v),
            _ => None,
        }
    }
    fn host_mut(d: &mut HostData) -> Option<&mut [bf16]> {
        match d {
            HostData::Bf16(v) => Some(v),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::for_each_vector;

    fn load16_matches_to_f32<V: Vector, E: CpuElement>(from: fn(f32) -> E) {
        let xs: Vec<E> = (0..19)
            .map(|i| from((i as f32 - 9.0) * 0.37 + 1e-3 * i as f32))
            .collect();
        for start in 0..3 {
            // SAFETY: start + 16 <= 19 elements.
            let v = unsafe { E::load16::<V>(xs[start..].as_ptr()) }.to_array();
            for (i, &got) in v.iter().enumerate() {
                assert_eq!(
                    got,
                    xs[start + i].to_f32(),
                    "{:?} element {}",
                    V::ISA,
                    start + i
                );
            }
            let mut w = vec![0.0f32; 16];
            E::widen::<V>(&xs[start..start + 16], &mut w);
            assert_eq!(w, v);
        }
    }

    fn load16_all<V: Vector>() {
        load16_matches_to_f32::<V, f32>(|x| x);
        load16_matches_to_f32::<V, f16>(f16::from_f32);
        load16_matches_to_f32::<V, bf16>(bf16::from_f32);
    }

    #[test]
    fn load16_widens_like_the_scalar_conversion() {
        for_each_vector!(load16_all);
    }
}
