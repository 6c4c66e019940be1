//! Register math only: the two microkernels of attention with query rows
//! along the SIMD lanes. No loops over blocks, no masks, no softmax here
//! (see `tiling.rs`); each kernel keeps an `M x ROW_VECS` tile of
//! accumulators in registers and streams one operand from memory.
//!
//! Contract (both kernels): `M <= MR`; every pointer is valid for the
//! extents stated on the function; nothing is aligned; results are written
//! with plain stores. Tested against scalar loops below.

mod pv;
mod scores;

pub use pv::pv;
pub use scores::scores;

/// Calls `$kernel::<m>` for a runtime `m` in `1..=MR` (the tail of a loop
/// over keys or value columns).
macro_rules! dispatch_m {
    ($m:expr, $kernel:ident ( $($arg:expr),* )) => {
        match $m {
            1 => $kernel::<1>($($arg),*),
            2 => $kernel::<2>($($arg),*),
            3 => $kernel::<3>($($arg),*),
            4 => $kernel::<4>($($arg),*),
            5 => $kernel::<5>($($arg),*),
            _ => $kernel::<6>($($arg),*),
        }
    };
}
pub(crate) use dispatch_m;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocking::{LANES, ROWS, ROW_VECS};
    use crate::simd::V;

    fn fill(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn scores_match_scalar_dot_products() {
        for d in [1usize, 3, 16, 67] {
            let stride = d + 5;
            let k = fill(6 * stride, 1);
            let qt = fill(d * ROWS, 2);
            for m in 1..=6 {
                let mut s = vec![f32::NAN; m * ROWS];
                // SAFETY: k holds 6 rows of `stride >= d` floats, qt holds
                // d x ROWS floats, s holds m x ROWS floats.
                unsafe {
                    dispatch_m!(
                        m,
                        scores(k.as_ptr(), stride, qt.as_ptr(), d, s.as_mut_ptr())
                    )
                };
                for j in 0..m {
                    for r in 0..ROWS {
                        let want: f64 = (0..d)
                            .map(|e| f64::from(k[j * stride + e]) * f64::from(qt[e * ROWS + r]))
                            .sum();
                        let got = f64::from(s[j * ROWS + r]);
                        assert!(
                            (got - want).abs() <= 1e-5 * d as f64,
                            "d={d} m={m} {got} {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn pv_matches_scalar_accumulation() {
        for n in [1usize, 2, 7, 128] {
            let stride = 9;
            let v = fill(n * stride, 3);
            let pt = fill(n * ROWS, 4);
            let alpha: [V; ROW_VECS] = std::array::from_fn(|i| {
                V::from(std::array::from_fn(|l| {
                    0.5 + (i * LANES + l) as f32 / 128.0
                }))
            });
            for m in 1..=6 {
                let ot0 = fill(m * ROWS, 5);
                let mut ot = ot0.clone();
                // SAFETY: v holds n rows of 9 >= m floats, pt n x ROWS,
                // ot m x ROWS.
                unsafe {
                    dispatch_m!(
                        m,
                        pv(v.as_ptr(), stride, pt.as_ptr(), n, ot.as_mut_ptr(), &alpha)
                    )
                };
                for c in 0..m {
                    for r in 0..ROWS {
                        let a = f64::from(alpha[r / LANES].to_array()[r % LANES]);
                        let want = a * f64::from(ot0[c * ROWS + r])
                            + (0..n)
                                .map(|j| f64::from(v[j * stride + c]) * f64::from(pt[j * ROWS + r]))
                                .sum::<f64>();
                        let got = f64::from(ot[c * ROWS + r]);
                        assert!((got - want).abs() <= 1e-5 * n as f64, "n={n} m={m}");
                    }
                }
            }
        }
    }
}
