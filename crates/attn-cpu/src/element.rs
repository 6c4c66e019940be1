//! Input element types on the CPU: how a row of f32, f16 or bf16 becomes
//! the f32 the kernels compute in, and how results are rounded back.

use attn_spec::{bf16, f16, Element, HostData};
use half::slice::HalfFloatSliceExt;

/// An element type attn-cpu computes on: f32, f16 and bf16.
pub trait CpuElement: Element {
    /// The slice itself when it already is f32 (no conversion needed).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// Widens `src` into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
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
