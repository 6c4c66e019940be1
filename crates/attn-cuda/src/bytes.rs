//! Host data as the bytes a device buffer holds, and back, for the GPU
//! backend and the emulator.

use attn_spec::{DType, HostData};

/// The little-endian bytes of `data`'s elements (bool as 0 or 1).
pub fn bytes_of(data: &HostData) -> Vec<u8> {
    match data {
        HostData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostData::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        HostData::Bf16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        HostData::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        HostData::Bool(v) => v.iter().map(|&b| u8::from(b)).collect(),
    }
}

/// `dtype` elements from their little-endian bytes (the inverse of
/// [`bytes_of`]).
pub fn host_of(dtype: DType, b: &[u8]) -> HostData {
    let u16s = || b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
    match dtype {
        DType::F32 => HostData::F32(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        DType::F16 => HostData::F16(u16s().map(half::f16::from_bits).collect()),
        DType::Bf16 => HostData::Bf16(u16s().map(half::bf16::from_bits).collect()),
        DType::F64 => HostData::F64(
            b.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
        ),
        DType::Bool => HostData::Bool(b.iter().map(|&x| x != 0).collect()),
    }
}

/// Lengths (or indices) as the kernels read them: i32, little-endian,
/// saturated at `i32::MAX`.
pub fn i32_bytes(v: &[usize]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| (x.min(i32::MAX as usize) as i32).to_le_bytes())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn host_bytes_round_trip() {
        for d in [
            HostData::F32(vec![1.5, -0.0, f32::INFINITY]),
            HostData::F16(vec![f16::from_f32(0.1), f16::NEG_INFINITY]),
            HostData::Bf16(vec![bf16::from_f32(-3.25)]),
            HostData::F64(vec![std::f64::consts::PI]),
            HostData::Bool(vec![true, false, true]),
        ] {
            assert_eq!(host_of(d.dtype(), &bytes_of(&d)), d);
        }
    }
}
