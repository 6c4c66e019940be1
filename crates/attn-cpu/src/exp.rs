//! A fast vectorised `2^x`, the exponential of the online softmax.
//!
//! The scores are kept in base-2 units (the scale is multiplied by log2(e)
//! once, when Q is packed), so the softmax needs `2^x` for `x <= 0`. Range
//! reduction: `x = n + r` with `n = round(x)`, `r` in `[-1/2, 1/2]` (exact in
//! f32); `2^r` is a degree-6 polynomial (Chebyshev interpolant, relative
//! error 2.6e-9 in exact arithmetic, so f32 rounding dominates: a few ulp;
//! its constant term is exactly 1, so `2^0 = 1` exactly and a row maximum
//! that does not move rescales nothing);
//! `2^n` is built in the exponent bits. Inputs below -127 give 0 (results
//! under 2^-126 flush to zero; the softmax loses nothing it could keep in
//! f32 sums), `-inf` gives 0, NaN gives NaN. Tested against f64 below: the
//! relative error stays within `attn_conformance::tolerance::EXP_REL_ERR`
//! (2^-20) for every result of at least 2^-126. Inputs must be at most
//! 127.

use crate::simd::V;
use wide::i32x16;

const C: [f32; 7] = [
    1.0,
    // The interpolant's linear coefficient rounds to the same f32 as ln 2.
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_503_27,
    0.009_618_057,
    0.001_340_043,
    0.000_154_614_45,
];

/// `2^x` lane by lane (see the module docs for range and accuracy).
#[inline(always)]
pub fn exp2(x: V) -> V {
    // max(-127, x) keeps a NaN in x (x86 max returns its second operand
    // when either is NaN).
    let x = V::splat(-127.0).fast_max(x);
    // Round to nearest (even) in the integer unit, back to float: exact.
    let ni = x.fast_round_int();
    let n = V::from_i32x16(ni);
    let r = x - n;
    let mut p = V::splat(C[6]);
    p = p.mul_add(r, V::splat(C[5]));
    p = p.mul_add(r, V::splat(C[4]));
    p = p.mul_add(r, V::splat(C[3]));
    p = p.mul_add(r, V::splat(C[2]));
    p = p.mul_add(r, V::splat(C[1]));
    p = p.mul_add(r, V::splat(C[0]));
    // 2^n from the exponent field; n = -127 gives the bit pattern of 0.0.
    let bits: i32x16 = (ni + i32x16::splat(127)) << 23;
    let scale: V = wide::bytemuck::cast(bits);
    p * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2^-20: the largest relative error the conformance suite's bound
    /// allows an exponential (attn_conformance::tolerance::EXP_REL_ERR).
    const EXP_REL_ERR: f64 = 1.0 / (1u64 << 20) as f64;

    fn check(xs: &[f32]) -> f64 {
        let mut worst = 0.0f64;
        for chunk in xs.chunks(16) {
            let mut a = [0.0f32; 16];
            a[..chunk.len()].copy_from_slice(chunk);
            let y = exp2(V::from(a)).to_array();
            for (i, &x) in chunk.iter().enumerate() {
                let want = f64::from(x).exp2();
                let got = f64::from(y[i]);
                if want >= 2f64.powi(-126) {
                    worst = worst.max((got - want).abs() / want);
                } else {
                    assert!(got <= 2f64.powi(-126), "x={x}: {got} for tiny {want}");
                }
            }
        }
        worst
    }

    #[test]
    fn relative_error_is_within_the_conformance_allowance() {
        // Dense sweep of the range the softmax uses, and beyond zero.
        let xs: Vec<f32> = (0..2_000_000)
            .map(|i| -130.0 + 140.0 * i as f32 / 2_000_000.0)
            .collect();
        let worst = check(&xs);
        assert!(worst <= EXP_REL_ERR, "worst relative error {worst:e}");
        // It is in fact within a few ulp.
        assert!(worst < 8.0 * f64::from(f32::EPSILON), "{worst:e}");
        // Half-integers (the edges of the reduction) and integers.
        let edges: Vec<f32> = (-254..=20).map(|i| i as f32 * 0.5).collect();
        assert!(check(&edges) <= EXP_REL_ERR);
    }

    #[test]
    fn special_values() {
        let y = exp2(V::from([
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
            -127.0,
            -200.0,
            1.0,
            -1.0,
            -126.0,
            0.5,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
        ]))
        .to_array();
        assert_eq!(y[0], 0.0);
        assert!(y[1].is_nan());
        assert_eq!(y[2], 1.0);
        assert_eq!(y[3], 0.0);
        assert_eq!(y[4], 0.0);
        assert_eq!(y[5], 2.0);
        assert_eq!(y[6], 0.5);
        assert_eq!(y[7], 2f32.powi(-126));
        assert!((y[8] - 2f32.sqrt()).abs() <= 2.0 * f32::EPSILON);
    }
}
