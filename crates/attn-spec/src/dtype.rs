//! Element types: what a tensor holds, and how each converts to the f64 the
//! oracle computes in.
//!
//! Inputs come in f32, f16 and bf16 (the `half` crate's types); f64 exists for
//! the reference; `Bool` is the element type of boolean attention masks. The
//! [`Element`] trait is the one place conversions are defined, so every
//! backend and test rounds the same way (round to nearest even).

use half::{bf16, f16};
use std::fmt;

/// The element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    Bf16,
    /// IEEE binary64 (the oracle's type; backends may refuse it).
    F64,
    /// Boolean, for attention masks (`true` = the pair takes part).
    Bool,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::F64 => 8,
            DType::Bool => 1,
        }
    }

    /// Unit roundoff `u` of the type: the largest relative error of rounding
    /// a real number to it (half an ulp at 1.0). Zero for `Bool`.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => f64::from(f32::EPSILON) / 2.0,
            DType::F16 => 2f64.powi(-11),
            DType::Bf16 => 2f64.powi(-8),
            DType::F64 => f64::EPSILON / 2.0,
            DType::Bool => 0.0,
        }
    }

    /// Whether the type is a floating-point type.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::Bool)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F64 => "f64",
            DType::Bool => "bool",
        })
    }
}

/// A floating-point element type attn computes on.
pub trait Element: Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Exact widening conversion to f64.
    fn to_f64(self) -> f64;
    /// Rounding (to nearest even) conversion from f64.
    fn from_f64(x: f64) -> Self;
    /// Conversion to f32 (exact for f32, f16 and bf16).
    fn to_f32(self) -> f32;
    /// Rounding conversion from f32.
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for f64 {
    const DTYPE: DType = DType::F64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(x: f32) -> Self {
        f64::from(x)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Rounds `x` to the nearest value representable in `dtype` (identity for
/// `F64`; `Bool` maps non-zero to 1).
pub fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => f64::from(x as f32),
        DType::F16 => f16::from_f64(x).to_f64(),
        DType::Bf16 => bf16::from_f64(x).to_f64(),
        DType::F64 => x,
        DType::Bool => f64::from(u8::from(x != 0.0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_roundoff_is_half_an_ulp_at_one() {
        for dt in [DType::F32, DType::F16, DType::Bf16, DType::F64] {
            let u = dt.unit_roundoff();
            // 1 + 2u is the next representable number after 1; 1 + u/2 rounds back to 1.
            assert_eq!(round_to(dt, 1.0 + 2.0 * u), 1.0 + 2.0 * u, "{dt}");
            assert_eq!(round_to(dt, 1.0 + 0.5 * u), 1.0, "{dt}");
        }
    }

    #[test]
    fn element_round_trips_are_exact_for_representable_values() {
        assert_eq!(f16::from_f64(0.5).to_f64(), 0.5);
        assert_eq!(<bf16 as Element>::from_f64(-3.0).to_f64(), -3.0);
        assert_eq!(<f32 as Element>::from_f32(1.25).to_f64(), 1.25);
    }
}
