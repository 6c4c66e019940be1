//! Input element types on the CPU: how a row of f32, f16 or bf16 becomes
//! the f32 the kernels compute in, and how results are rounded back.

use crate::simd::V;
use attn_spec::{bf16, f16, Element, HostData};
use half::slice::HalfFloatSliceExt;

/// An element type attn-cpu computes on: f32, f16 and bf16.
pub trait CpuElement: Element {
    /// The slice itself when it already is f32 (no conversion needed).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// Widens `src` into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Loads 16 elements from `p` (unaligned), widened to f32: how the
    /// decode kernels read K and V rows in place, whatever their type.
    ///
    /// # Safety
    /// `p..p+16` must be readable elements.
    unsafe fn load16(p: *const Self) -> V;
    /// Loads 4 elements from `p` (unaligned), widened to f32 and repeated
    /// in each quarter of the vector: `[x0, x1, x2, x3, x0, .., x3]` (how
    /// the decode path's score kernel for 3-4 rows reads a key, see
    /// `microkernel::decode::scores_quad`). The default reads them one by
    /// one; the types override it with one broadcast load under AVX-512.
    ///
    /// # Safety
    /// `p..p+4` must be readable elements.
    #[inline(always)]
    unsafe fn load4x4(p: *const Self) -> V {
        // SAFETY: the caller guarantees 4 readable elements at `p`.
        let x: [f32; 4] = std::array::from_fn(|i| unsafe { *p.add(i) }.to_f32());
        V::from(std::array::from_fn::<f32, 16, _>(|l| x[l % 4]))
    }
    /// The pointer as f32 when this type is f32 (results then go out as
    /// whole vectors).
    fn f32_ptr(_p: *mut Self) -> Option<*mut f32> {
        None
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
    fn widen(src: &[f32], dst: &mut [f32]) {
        crate::pack::copy_row(src, dst);
    }
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> V {
        // SAFETY: the caller guarantees 16 readable f32 at `p`.
        unsafe { crate::simd::load(p) }
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    #[inline(always)]
    unsafe fn load4x4(p: *const f32) -> V {
        use std::arch::x86_64::*;
        // SAFETY: compiled only when the whole build enables avx512f; the
        // caller guarantees 4 readable f32 (16 bytes) at `p`.
        unsafe { V::from(_mm512_broadcast_f32x4(_mm_loadu_ps(p))) }
    }
    fn f32_ptr(p: *mut f32) -> Option<*mut f32> {
        Some(p)
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
    fn widen(src: &[f16], dst: &mut [f32]) {
        // Uses F16C when the CPU has it (detected at run time by `half`).
        src.convert_to_f32_slice(dst);
    }
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> V {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        let h = unsafe { (p as *const [u16; 16]).read_unaligned() };
        #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
        {
            use std::arch::x86_64::*;
            // SAFETY: compiled only when the whole build enables avx512f
            // (vcvtph2ps on zmm is AVX-512F); `h` is 32 readable bytes.
            unsafe {
                V::from(_mm512_cvtph_ps(_mm256_loadu_si256(
                    h.as_ptr() as *const __m256i
                )))
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
        {
            V::from(h.map(|x| f16::from_bits(x).to_f32()))
        }
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    #[inline(always)]
    unsafe fn load4x4(p: *const f16) -> V {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 4 readable elements (8 bytes) at
        // `p`; compiled only when the whole build enables avx512f. The 8
        // bytes are repeated into 32 and converted as 16 halves.
        unsafe {
            let x = (p as *const i64).read_unaligned();
            V::from(_mm512_cvtph_ps(_mm256_set1_epi64x(x)))
        }
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
    fn widen(src: &[bf16], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift the compiler vectorises.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> V {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        let h = unsafe { (p as *const [u16; 16]).read_unaligned() };
        #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
        {
            use std::arch::x86_64::*;
            // SAFETY: compiled only when the whole build enables avx512f;
            // `h` is 32 readable bytes. Zero-extend to 32 bits and shift:
            // bf16 is the top half of an f32.
            unsafe {
                let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(h.as_ptr() as *const __m256i));
                V::from(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(w)))
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
        {
            V::from(h.map(|x| f32::from_bits(u32::from(x) << 16)))
        }
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
    #[inline(always)]
    unsafe fn load4x4(p: *const bf16) -> V {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 4 readable elements (8 bytes) at
        // `p`; compiled only when the whole build enables avx512bw. The 8
        // bytes are repeated into every quarter, then interleaved below
        // zero words: each bf16 lands in the top half of a 32-bit lane,
        // which is its f32 (one broadcast load and one shuffle).
        unsafe {
            let x = _mm512_set1_epi64((p as *const i64).read_unaligned());
            V::from(_mm512_castsi512_ps(_mm512_unpacklo_epi16(
                _mm512_setzero_si512(),
                x,
            )))
        }
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

    fn load16_matches_to_f32<E: CpuElement>(from: fn(f32) -> E) {
        let xs: Vec<E> = (0..19)
            .map(|i| from((i as f32 - 9.0) * 0.37 + 1e-3 * i as f32))
            .collect();
        for start in 0..3 {
            // SAFETY: start + 16 <= 19 elements.
            let v = unsafe { E::load16(xs[start..].as_ptr()) }.to_array();
            for (i, &got) in v.iter().enumerate() {
                assert_eq!(got, xs[start + i].to_f32(), "element {}", start + i);
            }
        }
    }

    #[test]
    fn load16_widens_like_the_scalar_conversion() {
        load16_matches_to_f32::<f32>(|x| x);
        load16_matches_to_f32::<f16>(f16::from_f32);
        load16_matches_to_f32::<bf16>(bf16::from_f32);
    }

    fn load4x4_matches_to_f32<E: CpuElement>(from: fn(f32) -> E) {
        let xs: Vec<E> = (0..7).map(|i| from(i as f32 * 0.61 - 1.7)).collect();
        for start in 0..3 {
            // SAFETY: start + 4 <= 7 elements.
            let v = unsafe { E::load4x4(xs[start..].as_ptr()) }.to_array();
            for (l, &got) in v.iter().enumerate() {
                assert_eq!(got, xs[start + l % 4].to_f32(), "lane {l} from {start}");
            }
        }
    }

    #[test]
    fn load4x4_repeats_four_widened_elements() {
        load4x4_matches_to_f32::<f32>(|x| x);
        load4x4_matches_to_f32::<f16>(f16::from_f32);
        load4x4_matches_to_f32::<bf16>(bf16::from_f32);
    }
}
