//! Linear layers for multi-head attention's projections, a trait of their
//! own: a backend implements attention ([`Backend`]) alone, and
//! [`crate::MultiHeadAttention`] asks for [`Linear`] too.

use crate::backend::Backend;
use crate::error::{AttnError, Result};

/// A backend that also computes the linear layers of multi-head attention.
pub trait Linear: Backend {
    /// A linear layer `y = x W^T + b` for multi-head attention projections:
    /// `x` is `[rows, in_features]`, `w` is `[out_features, in_features]`
    /// (PyTorch's `nn.Linear` layout), `b` is `[out_features]`; `y` is
    /// `[rows, out_features]` in `x`'s element type, accumulated in f32 or
    /// wider. Implementations start with [`check_linear`].
    fn linear(
        &self,
        x: &Self::Buffer,
        rows: usize,
        w: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        in_features: usize,
        out_features: usize,
    ) -> Result<Self::Buffer>;
}

/// A reference to a backend with linear layers has them.
impl<B: Linear + ?Sized> Linear for &B {
    fn linear(
        &self,
        x: &Self::Buffer,
        rows: usize,
        w: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        in_features: usize,
        out_features: usize,
    ) -> Result<Self::Buffer> {
        (**self).linear(x, rows, w, bias, in_features, out_features)
    }
}

/// Validates the operands of [`Linear::linear`]: sizes, overflow, lengths
/// and element types (all of `x`'s type).
pub fn check_linear<B: Backend + ?Sized>(
    backend: &B,
    x: &B::Buffer,
    rows: usize,
    w: &B::Buffer,
    bias: Option<&B::Buffer>,
    in_features: usize,
    out_features: usize,
) -> Result<()> {
    for (what, v) in [("in_features", in_features), ("out_features", out_features)] {
        if v == 0 {
            return Err(AttnError::ZeroSize { what });
        }
    }
    let over = |what| AttnError::Overflow { what };
    let xi = backend.info(x);
    let want = [
        (
            "x",
            xi,
            rows.checked_mul(in_features)
                .ok_or(over("rows * in_features"))?,
        ),
        (
            "weight",
            backend.info(w),
            out_features
                .checked_mul(in_features)
                .ok_or(over("out_features * in_features"))?,
        ),
    ];
    let b = bias.map(|b| ("bias", backend.info(b), out_features));
    rows.checked_mul(out_features)
        .ok_or(over("rows * out_features"))?;
    for (tensor, info, len) in want.into_iter().chain(b) {
        if !xi.dtype.is_float() || info.dtype != xi.dtype {
            return Err(AttnError::DType {
                tensor,
                expected: format!("{} (x's float type)", xi.dtype),
                got: info.dtype,
            });
        }
        if info.len != len {
            return Err(AttnError::Shape {
                tensor,
                axis: "elements",
                expected: len,
                got: info.len,
            });
        }
    }
    Ok(())
}
