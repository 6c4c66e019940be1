//! bf16 inputs on AVX512_BF16: the backward's five products on
//! `vdpbf16ps` (`dot16::gemm_pairs`), which multiplies pairs of bf16 and
//! adds both products to an f32 lane, flushing subnormal inputs and
//! results to zero (DAZ, FTZ).
//!
//! | product       | A (broadcast)                   | B (streamed)                 |
//! |---------------|---------------------------------|------------------------------|
//! | `S = Q K^T`   | Q, pairs of head dims (task)    | K^T, pairs of rows (block)   |
//! | `dP = dO V^T` | dO, pairs of head dims (task)   | V^T, pairs of rows (block)   |
//! | `dV = P^T dO` | `P * 2^56`, pairs of rows (tile) | dO, pairs of rows (task)    |
//! | `dK = dS^T Q` | `dS * 2^t`, pairs of rows (tile) | Q, pairs of rows (task)     |
//! | `dQ = dS K`   | `dS * 2^t`, pairs of keys (tile) | K, pairs of keys (block)    |
//!
//! (`dS` here is `dsc = dS g`, the gradient of `q . k`.) The last three
//! run into tile buffers, added to dV, dK and dQ times the inverse power
//! of two: exact unless the sum is subnormal, where it loses at most half
//! the smallest subnormal, as an f32 product may.
//!
//! **Why nothing flushes.** A nonzero bf16 `a = m 2^(e - 7)` with integer
//! `m` in `[128, 256)`, so the product of `a` and `b` is a multiple of
//! `2^(e_a + e_b - 14)`. If every product of a call has `e_a + e_b >=
//! -112` (or a zero factor), every product and every running sum from 0
//! is a multiple of `2^-126`: each rounding of such a sum is again one (a
//! sum of magnitude at least `2^-126` rounds to a multiple of its ulp,
//! which is at least `2^-149`, or is exact), so a nonzero one is never
//! subnormal and `vdpbf16ps` rounds exactly as f32 arithmetic would. The
//! operands are kept there:
//! - Q, K, V and dO: 0 or in `[2^-40, 2^40)` (`dot16::BACKWARD`), checked
//!   for the task's rows while packing them and for each key block; else
//!   the task or block runs its products in f32. `S`, `dP`: `e_a + e_b >=
//!   -80`.
//! - `P`: below `2^-126` it is set to 0 (with its `dS`), within the
//!   bound's `2^-125` allowance for an underflowing probability
//!   (`attn-conformance/src/backward/bound.rs`); times `2^56` it is then 0
//!   or in `[2^-70, 2^56]`: with dO, `e_a + e_b >= -110`.
//! - `dS`: a power of two `2^t` per tile takes its largest magnitude into
//!   `[2^55, 2^56)`; the tile runs dK and dQ on pairs only if every
//!   nonzero `dS 2^t` is then at least `2^-72` (with Q or K, `>= -112`),
//!   else in f32. A tile whose `dS` is all 0 adds nothing.
//!
//! Nor does anything overflow: a product is below `2^57 2^40`, a tile
//! sums at most `BWD_ROWS` or `BWD_KEYS` of them, `S` and `dP` `d <
//! 2^14`. Rounding `P` and `dS` to bf16 is what the contract allows a
//! 16-bit kernel (SEMANTICS §7b) and the bound's `u_in` terms cover.

/// `P` is scaled by `2^P_EXP` before it is rounded to bf16.
pub const P_EXP: i32 = 56;

/// `2^e` as an f32 (`e` in `-126..=127`).
pub fn pow2(e: i32) -> f32 {
    assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The exponent `t` for a tile's `dS` of largest magnitude `max` and
/// smallest nonzero magnitude `min` (both finite), when its pair
/// products may run: `max 2^t` below `2^56` and `min 2^t` at least
/// `2^-72`, `2^t` and `2^-t` normal. `None` when they may not, and for an
/// all-zero tile (`max == 0`), which adds nothing.
pub fn ds_exp(max: f32, min: f32) -> Option<i32> {
    if max == 0.0 || !max.is_finite() || min < f32::MIN_POSITIVE || min > max {
        return None;
    }
    let exp = |x: f32| ((x.to_bits() >> 23) & 0xff) as i32 - 127;
    let t = (55 - exp(max)).min(126);
    (exp(min) + t >= -72).then_some(t)
}

/// `dst[i] += src[i] * f` for the first `n` elements (`f` a power of two:
/// the product is exact unless subnormal).
#[inline(always)]
pub fn add_scaled(dst: &mut [f32], src: &[f32], f: f32, n: usize) {
    for (d, &s) in dst[..n].iter_mut().zip(&src[..n]) {
        *d += s * f;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pow2_is_exact() {
        for e in -126..=127 {
            assert_eq!(pow2(e) as f64, 2f64.powi(e), "{e}");
        }
    }

    #[test]
    fn ds_exp_takes_the_largest_below_2_pow_56_and_the_smallest_above_2_pow_minus_72() {
        for (max, min) in [
            (1.0f32, 1e-20f32),
            (3.0e5, 2.0e-30),
            (1e-30, 2e-38),
            (7.5, 7.5),
        ] {
            let t = ds_exp(max, min).expect("fits");
            let (hi, lo) = (max as f64 * 2f64.powi(t), min as f64 * 2f64.powi(t));
            assert!(
                hi < 2f64.powi(56) && lo >= 2f64.powi(-72),
                "{max} {min}: t={t}"
            );
            assert!(
                t <= 126 && (hi >= 2f64.powi(55) || t == 126),
                "{max} {min}: t={t}"
            );
        }
        // A span over 127 binades, subnormal, zero, non-finite: no.
        for (max, min) in [
            (1.0f32, 2f32.powi(-127)),
            (2f32.powi(100), 2f32.powi(-30)),
            (1.0, 1e-40),
            (0.0, 0.0),
            (f32::INFINITY, 1.0),
            (f32::NAN, 1.0),
        ] {
            assert_eq!(ds_exp(max, min), None, "{max} {min}");
        }
        // Exactly 128 binades apart, with the largest at 2^55: no; 127: yes.
        assert_eq!(ds_exp(2f32.powi(55), 2f32.powi(-73)), None);
        assert_eq!(ds_exp(2f32.powi(55), 2f32.powi(-72)), Some(0));
    }
}
