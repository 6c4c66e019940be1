//! Which bf16 values may enter `vdpbf16ps` (module docs of `dot16/`),
//! and the keys a thread has found to fit.

/// Magnitudes a bf16 element may have to enter `vdpbf16ps` in one use
/// (besides 0): biased exponents `lo..=hi` (bf16 shares f32's exponent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Smallest biased exponent.
    pub lo: u16,
    /// Largest biased exponent.
    pub hi: u16,
}

/// The forward pass's window: `[2^-64, 2^57)` (module docs).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub const FORWARD: Window = Window { lo: 63, hi: 183 };

/// The backward pass's window for Q, K, V and dO: `[2^-40, 2^40)`, where
/// no product of the backward's pair products flushes
/// (`backward/pairs.rs`).
pub const BACKWARD: Window = Window { lo: 87, hi: 166 };

/// Whether bf16 element `x` (its bits) is 0 or has a magnitude in `w`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub fn fits_in(x: u16, w: Window) -> bool {
    (x & 0x7fff) == 0 || ((x >> 7) & 0xff).wrapping_sub(w.lo) <= w.hi - w.lo
}

/// Whether bf16 element `x` (its bits) may enter `vdpbf16ps` in the
/// forward pass: zero, or a magnitude in `[2^-64, 2^57)` (biased exponent
/// 63 to 183).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub fn fits(x: u16) -> bool {
    fits_in(x, FORWARD)
}

/// The keys of one (batch, K/V head) whose K and V rows a thread has found
/// to [`fit`](fits), so later passes of the head skip the check (the
/// blocks of a head run one after another, the longest span first).
/// Forgotten at the start of every call (`Workspace::reset`).
#[derive(Debug, Default)]
pub struct Checked {
    head: Option<(usize, usize)>,
    keys: std::ops::Range<usize>,
}

impl Checked {
    /// Forgets every key.
    pub fn forget(&mut self) {
        self.head = None;
        self.keys = 0..0;
    }

    /// Whether keys `keys` of head `g` are known to fit.
    pub fn covers(&self, g: (usize, usize), keys: &std::ops::Range<usize>) -> bool {
        self.head == Some(g) && self.keys.start <= keys.start && keys.end <= self.keys.end
    }

    /// Records that keys `keys` of head `g` fit: extends the range held
    /// when they touch it, else replaces it.
    pub fn add(&mut self, g: (usize, usize), keys: std::ops::Range<usize>) {
        let k = &self.keys;
        self.keys = if self.head == Some(g) && keys.start <= k.end && k.start <= keys.end {
            k.start.min(keys.start)..k.end.max(keys.end)
        } else {
            keys
        };
        self.head = Some(g);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_spec::bf16;

    #[test]
    fn fits_takes_zero_and_magnitudes_from_2_pow_minus_64_below_2_pow_57() {
        let yes = [
            0.0f32,
            -0.0,
            1.0,
            -3.5,
            2f32.powi(-64),
            -(2f32.powi(56)),
            1.5 * 2f32.powi(56),
        ];
        let no = [
            2f32.powi(-65),
            -(2f32.powi(-100)),
            1e-39, // subnormal in bf16 too
            2f32.powi(57),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        for x in yes {
            assert!(fits(bf16::from_f32(x).to_bits()), "{x}");
        }
        for x in no {
            assert!(!fits(bf16::from_f32(x).to_bits()), "{x}");
        }
        // Every bit pattern agrees with the definition.
        for bits in 0..=u16::MAX {
            let x = bf16::from_bits(bits).to_f32();
            let want = x == 0.0 || (2f32.powi(-64) <= x.abs() && x.abs() < 2f32.powi(57));
            assert_eq!(fits(bits), want, "{bits:#06x}");
            let want = x == 0.0 || (2f32.powi(-40) <= x.abs() && x.abs() < 2f32.powi(40));
            assert_eq!(fits_in(bits, BACKWARD), want, "{bits:#06x}");
        }
    }

    #[test]
    fn checked_keeps_one_range_of_one_head() {
        let mut c = Checked::default();
        let (a, b) = ((0, 1), (0, 2));
        assert!(!c.covers(a, &(0..1)));
        c.add(a, 0..128);
        c.add(a, 128..200);
        assert!(c.covers(a, &(0..200)) && c.covers(a, &(50..60)));
        assert!(!c.covers(a, &(0..201)) && !c.covers(b, &(0..10)));
        c.add(a, 300..310);
        assert!(c.covers(a, &(300..310)) && !c.covers(a, &(0..10)));
        c.add(b, 0..10);
        assert!(c.covers(b, &(0..10)) && !c.covers(a, &(300..310)));
        c.forget();
        assert!(!c.covers(b, &(0..10)));
    }
}
