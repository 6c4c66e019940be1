//! A fast vectorised `2^x`, the exponential of the online softmax.
//!
//! The scores are kept in base-2 units (the scale is multiplied by log2(e)
//! once, when Q is packed), so the softmax needs `2^x` for `x <= 0`. Range
//! reduction: `x = n + r` with `n = round(x)`, `r` in `[-1/2, 1/2]` (exact in
//! f32); `2^r` is a degree-5 polynomial (near-minimax for the relative
//! error, fitted with its constant term fixed at exactly 1, so `2^0 = 1`
//! exactly and a row maximum that does not move rescales nothing: 9.2e-8
//! in exact arithmetic, 1.7e-7 = 1.4 ulp worst evaluated in f32 with
//! FMAs, a fifth of the conformance allowance; degree 6 cost one more FMA
//! per element for accuracy the f32 rounding then hid);
//! `2^n` is built in the exponent bits. AVX-512 reduces differently
//! (`Vector::exp2`): `x = floor(x) + r`, `r` in `[0, 1)`, by one
//! `vreduceps`, the polynomial [`C01`] fitted the same way on `[0, 1)`
//! (8.2e-8 exact, 1.4e-7 = 1.2 ulp in f32), and `2^floor(x)` applied by
//! `vscalefps`, which takes fewer instructions than building `2^n`
//! (measured in the softmax on Zen 4: within noise). Inputs of at
//! most -127 give 0 (results under 2^-126 may flush to zero; the softmax
//! loses nothing it could keep in f32 sums), `-inf` gives 0, NaN gives NaN. Tested against f64 below: the
//! relative error stays within `attn_conformance::tolerance::EXP_REL_ERR`
//! (2^-20) for every result of at least 2^-126. Inputs must be at most
//! 127. [`tanh`] (the soft-cap) is built on it. Both are generic over the
//! level's vectors and inlined into its kernels.
//!
//! **The coarse exponential** (`Vector::exp2_coarse`): where the
//! probabilities are rounded to bf16 before they multiply V (the bf16
//! pass on `vdpbf16ps` or the tile unit), each already carries a relative
//! error of up to 2^-9 from that rounding, and an exponential within
//! 2^-13 adds a sixteenth of it. AVX-512 then takes
//! the degree-3 polynomial [`C01_COARSE`] (fitted as [`C01`]: 8.6e-5 =
//! 2^-13.5 exact and evaluated in f32), two FMAs fewer per probability:
//! the exponential was about a tenth of that pass's time at d = 64
//! (Zen 4). The forward conformance bound allows an exponential within
//! 2^-13 for bf16 inputs (`attn_conformance::tolerance::EXP_REL_ERR_BF16`):
//! `2 * 2^-13` of `max|v|` in the output's floor and `2 * 2^-13` in the
//! log-sum-exp's; this one moves the log-sum-exp by at most 8.6e-5.
//! (Only the AVX-512 levels run that pass; the others' `exp2_coarse` is
//! [`exp2`].) Where no bias or option moved the scores (finite products,
//! or `-inf` where a causal mask or window hides a key), that pass takes
//! `Vector::exp2_coarse_unflushed` (and the f32 pass
//! `Vector::exp2_unflushed`), the same without the compare that
//! flushes results under 2^-126 to 0 (AVX-512's `vscalefps` gives them
//! subnormal; `-inf` still gives exactly 0, as `vreduceps` takes it to 0
//! and `1 * 2^-inf = 0`): such results need a spread of over 127 in a
//! row, and then the bf16 rounding of the probabilities flushes them (in
//! the f32 pass they enter `P V` as subnormals, of no weight beside the
//! row's maximum of 1). The softmax's pairs then ran 12% faster on Zen 4
//! (with the shift subtracted on the FMA pipes, the other half of it: a
//! profile of the encoder case; 6% on causal S = 512, whose diagonal
//! tiles form fewer pairs), the f32 pass's softmax 11% on the encoder.
//! A bias can hold large negative values, whose underflow Intel cores
//! may take microcode assists for: those keep the flush. (Subnormal
//! probabilities from a plain spread over 127 may cost such assists on
//! Intel too; not measured: only Zen 4 was at hand.)

use crate::simd::Vector;

// The linear coefficient is the fit's, one ulp below ln 2 in f32: with
// ln 2 itself the worst error grows from 1.4 to 2.5 ulp.
#[allow(clippy::approx_constant)]
pub(crate) const C: [f32; 6] = [
    1.0,
    0.693_147,
    0.240_222_42,
    0.055_507_336,
    0.009_671_482,
    0.001_326_463_7,
];

/// The polynomial for `r` in `[0, 1)` (AVX-512's reduction by `vreduceps`,
/// `Vector::exp2`): the same kind of fit (relative error, constant term
/// fixed at exactly 1, so `2^0 = 1` exactly), on `[0, 1)`.
pub(crate) const C01: [f32; 6] = [
    1.0,
    0.693_151_3,
    0.240_164_46,
    0.055_799_89,
    0.009_017_062,
    0.001_867_114_7,
];

/// The degree-3 polynomial for `r` in `[0, 1)` of the coarse
/// exponential (module docs), fitted as [`C01`] (relative error, constant
/// term exactly 1).
pub(crate) const C01_COARSE: [f32; 4] = [1.0, 0.695_114_9, 0.227_653_56, 0.077_059_18];

/// `2^x` lane by lane (see the module docs for range and accuracy):
/// the level's [`Vector::exp2`].
#[inline(always)]
pub fn exp2<V: Vector>(x: V) -> V {
    x.exp2()
}

/// [`exp2`] with `2^n` built in the exponent bits (every level's default).
#[inline(always)]
pub fn exp2_by_bits<V: Vector>(x: V) -> V {
    // max(-127, x) keeps a NaN in x (`fast_max` returns its second operand
    // when either is NaN).
    let x = V::splat(-127.0).fast_max(x);
    // Round to nearest (even) in the integer unit, back to float: exact;
    // 2^n from the exponent field (n = -127 gives the bit pattern of 0.0).
    let (n, scale) = x.round_pow2();
    let r = x - n;
    let mut p = V::splat(C[5]);
    p = p.mul_add(r, V::splat(C[4]));
    p = p.mul_add(r, V::splat(C[3]));
    p = p.mul_add(r, V::splat(C[2]));
    p = p.mul_add(r, V::splat(C[1]));
    p = p.mul_add(r, V::splat(C[0]));
    p * scale
}

/// Below this `|x|`, [`tanh`] takes its odd Taylor polynomial (whose
/// first omitted term, `21844 x^13 / 6081075`, is under 2^-30 of `x`
/// there); at and above it, `(1 - e) / (1 + e)` with `e = exp(-2|x|)
/// <= 0.61`, where the subtraction loses under one bit.
const TANH_SERIES: f32 = 0.25;

/// `tanh(x)` lane by lane, within a few ulp of f32 (tested against f64
/// below): the odd Taylor series to `x^11` for `|x| < 0.25`, else `(1 -
/// e) / (1 + e)` with `e = 2^(-2|x| log2(e))` from [`exp2`], which
/// underflows to 0 (so `tanh = 1`) for `|x|` beyond 44. NaN gives NaN, and
/// `+-inf` gives `+-1`.
#[inline(always)]
pub fn tanh<V: Vector>(x: V) -> V {
    let a = x.abs();
    let a2 = a * a;
    // tanh a = a + a^3 (-1/3 + a^2 (2/15 + a^2 (-17/315 + a^2 (62/2835 +
    // a^2 (-1382/155925))))).
    let mut p = V::splat(-1382.0 / 155_925.0);
    p = p.mul_add(a2, V::splat(62.0 / 2835.0));
    p = p.mul_add(a2, V::splat(-17.0 / 315.0));
    p = p.mul_add(a2, V::splat(2.0 / 15.0));
    p = p.mul_add(a2, V::splat(-1.0 / 3.0));
    let series = (p * a2).mul_add(a, a);
    let e = exp2(a * V::splat(-2.0 * std::f32::consts::LOG2_E));
    let far = (V::ONE - e) / (V::ONE + e);
    a.select_lt(TANH_SERIES, series, far).copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::for_each_vector;

    /// 2^-20: the largest relative error the conformance suite's bound
    /// allows an exponential (attn_conformance::tolerance::EXP_REL_ERR).
    const EXP_REL_ERR: f64 = 1.0 / (1u64 << 20) as f64;

    /// 2^-13: the same for bf16 inputs, the bound of the coarse
    /// exponential (attn_conformance::tolerance::EXP_REL_ERR_BF16).
    const COARSE_REL_ERR: f64 = 1.0 / (1u64 << 13) as f64;

    fn check<V: Vector>(xs: &[f32]) -> f64 {
        check_with(xs, exp2::<V>)
    }

    /// The worst relative error of `f` over `xs` (results of at least
    /// 2^-126; smaller ones must stay below it).
    fn check_with<V: Vector>(xs: &[f32], f: impl Fn(V) -> V) -> f64 {
        let mut worst = 0.0f64;
        for chunk in xs.chunks(16) {
            let mut a = [0.0f32; 16];
            a[..chunk.len()].copy_from_slice(chunk);
            let y = f(V::from(a)).to_array();
            for (i, &x) in chunk.iter().enumerate() {
                let want = f64::from(x).exp2();
                let got = f64::from(y[i]);
                if want >= 2f64.powi(-126) {
                    worst = worst.max((got - want).abs() / want);
                } else {
                    let tiny = (0.0..=2f64.powi(-126)).contains(&got);
                    assert!(tiny, "x={x}: {got} for tiny {want}");
                }
            }
        }
        worst
    }

    #[test]
    fn relative_error_is_within_the_conformance_allowance() {
        for_each_vector!(exp2_error);
    }

    fn exp2_error<V: Vector>() {
        // Dense sweep of the range the softmax uses, and beyond zero.
        let xs: Vec<f32> = (0..2_000_000)
            .map(|i| -130.0 + 140.0 * i as f32 / 2_000_000.0)
            .collect();
        let worst = check::<V>(&xs);
        assert!(worst <= EXP_REL_ERR, "worst relative error {worst:e}");
        // It is in fact within a few ulp.
        assert!(worst < 8.0 * f64::from(f32::EPSILON), "{worst:e}");
        // Half-integers (the edges of the reduction) and integers.
        let edges: Vec<f32> = (-254..=20).map(|i| i as f32 * 0.5).collect();
        assert!(check::<V>(&edges) <= EXP_REL_ERR);
        // Without the flush: as accurate from 2^-126 up (results below it
        // stay below it), the same special values but for -127.
        let unflushed = xs.iter().chain(&edges).copied().collect::<Vec<_>>();
        let worst = check_with::<V>(&unflushed, V::exp2_unflushed);
        assert!(
            worst < 8.0 * f64::from(f32::EPSILON),
            "unflushed: {worst:e}"
        );
        specials_of_unflushed(V::exp2_unflushed, 2.0 * f64::from(f32::EPSILON));
    }

    /// The worst relative error of the polynomial `c` on `[0, 1)`,
    /// evaluated as AVX-512 does (Horner with FMAs, in f32).
    fn poly_error(c: &[f32]) -> f64 {
        let mut worst = 0.0f64;
        for i in 0..=1_000_000u32 {
            let r = (f64::from(i) / 1_000_000.0).min(1.0 - f64::from(f32::EPSILON) / 2.0) as f32;
            let mut p = c[c.len() - 1];
            for &ci in c[..c.len() - 1].iter().rev() {
                p = p.mul_add(r, ci);
            }
            let want = f64::from(r).exp2();
            worst = worst.max((f64::from(p) - want).abs() / want);
        }
        worst
    }

    /// [`C01`] on its own interval, on any CPU: within 1.5e-7 (about 1.2
    /// ulp) of `2^r`; [`C01_COARSE`] within 8.7e-5 (under
    /// [`COARSE_REL_ERR`], 1.2e-4). Both give `2^0 = 1` exactly.
    #[test]
    fn the_floor_reduction_polynomials_are_accurate_on_their_interval() {
        let worst = poly_error(&C01);
        assert!(worst < 1.5e-7, "worst relative error {worst:e}");
        let coarse = poly_error(&C01_COARSE);
        assert!(coarse < 8.7e-5, "coarse: {coarse:e}");
        assert_eq!((C01[0], C01_COARSE[0]), (1.0, 1.0));
    }

    /// The coarse exponential on every level (the accurate one where a
    /// level has no coarse one): within [`COARSE_REL_ERR`] over the
    /// softmax's range and at the reduction's edges, with the special
    /// values of [`exp2`].
    #[test]
    fn coarse_exponential_is_within_its_allowance() {
        for_each_vector!(coarse_error);
    }

    fn coarse_error<V: Vector>() {
        let xs: Vec<f32> = (0..2_000_000)
            .map(|i| -130.0 + 140.0 * i as f32 / 2_000_000.0)
            .chain((-254..=20).map(|i| i as f32 * 0.5))
            .collect();
        let worst = check_with::<V>(&xs, V::exp2_coarse);
        assert!(worst <= COARSE_REL_ERR, "{:?}: {worst:e}", V::ISA);
        specials_of(V::exp2_coarse, COARSE_REL_ERR * 2f64.sqrt());
        // Without the flush: the same values from 2^-126 up (results
        // below it stay below it: `check_with`), the same special values
        // but for the flush of -127.
        let worst = check_with::<V>(&xs, V::exp2_coarse_unflushed);
        assert!(worst <= COARSE_REL_ERR, "{:?} unflushed: {worst:e}", V::ISA);
        specials_of_unflushed(V::exp2_coarse_unflushed, COARSE_REL_ERR * 2f64.sqrt());
    }

    #[test]
    fn special_values() {
        for_each_vector!(special);
        for_each_vector!(tanh_error);
    }

    /// tanh against f64 over the range a soft-cap sees, and its special
    /// values.
    fn tanh_error<V: Vector>() {
        let mut worst = 0.0f64;
        let xs: Vec<f32> = (0..400_000)
            .map(|i| -20.0 + 40.0 * i as f32 / 400_000.0)
            .chain([
                0.25,
                -0.25,
                0.249_999_99,
                1e-30,
                -1e-30,
                0.0,
                -0.0,
                60.0,
                -60.0,
            ])
            .collect();
        for chunk in xs.chunks(16) {
            let mut a = [0.0f32; 16];
            a[..chunk.len()].copy_from_slice(chunk);
            let y = tanh(V::from(a)).to_array();
            for (i, &x) in chunk.iter().enumerate() {
                let want = f64::from(x).tanh();
                let err = (f64::from(y[i]) - want).abs();
                // In ulps of the result (at least the ulp of 2^-126).
                let ulp = f64::from(f32::EPSILON) * want.abs().max(1e-38);
                worst = worst.max(err / ulp);
                assert_eq!(y[i].is_sign_negative(), x.is_sign_negative(), "tanh({x})");
            }
        }
        assert!(worst <= 4.0, "{:?}: tanh worst error {worst} ulp", V::ISA);
        let s = tanh(V::from([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            100.0,
            -100.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
        ]))
        .to_array();
        assert!(s[0].is_nan());
        assert_eq!(s[1..7], [1.0, -1.0, 0.0, -0.0, 1.0, -1.0]);
        assert!(s[4].is_sign_negative());
    }

    fn special<V: Vector>() {
        specials_of(exp2::<V>, 2.0 * f64::from(f32::EPSILON));
    }

    /// `f`'s special values: -inf, -127 and below give 0, NaN stays NaN,
    /// integers are exact, and `2^0.5` is within `tol`.
    fn specials_of<V: Vector>(f: impl Fn(V) -> V, tol: f64) {
        specials_of_unflushed(&f, tol);
        let y = f(V::from([-127.0; 16])).to_array();
        assert_eq!(y[0], 0.0);
    }

    /// [`specials_of`] but for -127, which may give 2^-127 (subnormal)
    /// or 0.
    fn specials_of_unflushed<V: Vector>(f: impl Fn(V) -> V, tol: f64) {
        let y = f(V::from([
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
        assert!(y[3] == 0.0 || y[3] == 2f32.powi(-127), "2^-127: {}", y[3]);
        assert_eq!(y[4], 0.0);
        assert_eq!(y[5], 2.0);
        assert_eq!(y[6], 0.5);
        assert_eq!(y[7], 2f32.powi(-126));
        assert!(
            (f64::from(y[8]) - 2f64.sqrt()).abs() <= tol,
            "2^0.5: {}",
            y[8]
        );
    }
}
