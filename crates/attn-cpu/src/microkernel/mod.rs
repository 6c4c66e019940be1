//! Register math only: the two microkernels of attention with query rows
//! along the SIMD lanes. No loops over blocks, no masks, no softmax here
//! (see `tiling.rs`); each kernel keeps an `M x ROW_VECS` tile of
//! accumulators in registers and streams one operand from memory.
//!
//! Contract (`scores`, `pv`): `M <= mr(NV)`; every pointer is valid for the
//! extents stated on the function; nothing is aligned; results are written
//! with plain stores. `decode` holds the two kernels of the few-rows path
//! (head dimension along the lanes), which take slices and assert their
//! extents instead. All are tested against scalar loops below.

pub mod decode;
mod pv;
mod scores;

pub use pv::pv;
pub use scores::scores;

/// Calls `$kernel::<m, NV>` for a runtime `m` in `1..=mr(NV)` (the tail
/// of a loop over keys or value columns).
macro_rules! dispatch_m {
    ($nv:ident, $m:expr, $kernel:ident ( $($arg:expr),* )) => {
        match $m {
            1 => $kernel::<1, $nv>($($arg),*),
            2 => $kernel::<2, $nv>($($arg),*),
            3 => $kernel::<3, $nv>($($arg),*),
            4 => $kernel::<4, $nv>($($arg),*),
            5 => $kernel::<5, $nv>($($arg),*),
            6 => $kernel::<6, $nv>($($arg),*),
            7 => $kernel::<7, $nv>($($arg),*),
            8 => $kernel::<8, $nv>($($arg),*),
            9 => $kernel::<9, $nv>($($arg),*),
            10 => $kernel::<10, $nv>($($arg),*),
            11 => $kernel::<11, $nv>($($arg),*),
            _ => $kernel::<12, $nv>($($arg),*),
        }
    };
}
pub(crate) use dispatch_m;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocking::{mr, LANES};
    use crate::simd::V;

    fn fill(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    fn scores_nv<const NV: usize>() {
        let rows = NV * LANES;
        for d in [1usize, 3, 16, 67] {
            let stride = d + 5;
            let k = fill(mr(NV) * stride, 1);
            let qt = fill(d * rows, 2);
            for m in 1..=mr(NV) {
                let mut s = vec![f32::NAN; m * rows];
                // SAFETY: k holds mr(NV) rows of `stride >= d` floats, qt
                // holds d x rows floats, s holds m x rows floats.
                unsafe {
                    dispatch_m!(
                        NV,
                        m,
                        scores(k.as_ptr(), stride, qt.as_ptr(), d, s.as_mut_ptr())
                    )
                };
                for j in 0..m {
                    for r in 0..rows {
                        let want: f64 = (0..d)
                            .map(|e| f64::from(k[j * stride + e]) * f64::from(qt[e * rows + r]))
                            .sum();
                        let got = f64::from(s[j * rows + r]);
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
    fn scores_match_scalar_dot_products() {
        scores_nv::<1>();
        scores_nv::<4>();
    }

    fn pv_nv<const NV: usize>() {
        let rows = NV * LANES;
        for n in [1usize, 2, 7, 128] {
            let stride = 13;
            let v = fill(n * stride, 3);
            let pt = fill(n * rows, 4);
            let alpha: [V; NV] = std::array::from_fn(|i| {
                V::from(std::array::from_fn(|l| {
                    0.5 + (i * LANES + l) as f32 / 128.0
                }))
            });
            for m in 1..=mr(NV) {
                let ot0 = fill(m * rows, 5);
                let mut ot = ot0.clone();
                // SAFETY: v holds n rows of 13 >= m floats, pt n x rows,
                // ot m x rows.
                unsafe {
                    dispatch_m!(
                        NV,
                        m,
                        pv(v.as_ptr(), stride, pt.as_ptr(), n, ot.as_mut_ptr(), &alpha)
                    )
                };
                for c in 0..m {
                    for r in 0..rows {
                        let a = f64::from(alpha[r / LANES].to_array()[r % LANES]);
                        let want = a * f64::from(ot0[c * rows + r])
                            + (0..n)
                                .map(|j| f64::from(v[j * stride + c]) * f64::from(pt[j * rows + r]))
                                .sum::<f64>();
                        let got = f64::from(ot[c * rows + r]);
                        assert!((got - want).abs() <= 1e-5 * n as f64, "n={n} m={m}");
                    }
                }
            }
        }
    }

    #[test]
    fn pv_matches_scalar_accumulation() {
        pv_nv::<1>();
        pv_nv::<4>();
    }

    fn decode_scores_r<E: crate::element::CpuElement, const R: usize>(from: fn(f32) -> E) {
        let ss = 64;
        for d in [1usize, 3, 16, 67, 128] {
            let qs = d.div_ceil(LANES) * LANES;
            let ks = d + 3;
            let mut q = fill(R * qs, 6);
            for r in 0..R {
                q[r * qs + d..(r + 1) * qs].fill(0.0);
            }
            for n in [1usize, 7, 16, 33, 64] {
                let k: Vec<E> = fill((n - 1) * ks + d, 7).into_iter().map(from).collect();
                let mut s = vec![f32::NAN; R * ss];
                decode::scores::<E, R>(
                    &q,
                    qs,
                    (&k, ks),
                    n,
                    d,
                    (&mut s, ss),
                    crate::pack::RowStream::NONE,
                );
                for r in 0..R {
                    for j in 0..n {
                        let want: f64 = (0..d)
                            .map(|e| f64::from(q[r * qs + e]) * f64::from(k[j * ks + e].to_f32()))
                            .sum();
                        let got = f64::from(s[r * ss + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * d as f64,
                            "R={R} d={d} n={n} r={r} j={j}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn decode_scores_match_scalar_dot_products() {
        decode_scores_r::<f32, 1>(|x| x);
        decode_scores_r::<f32, 2>(|x| x);
        decode_scores_r::<f32, 3>(|x| x);
        decode_scores_r::<f32, 4>(|x| x);
        decode_scores_r::<attn_spec::bf16, 4>(attn_spec::bf16::from_f32);
        decode_scores_r::<attn_spec::f16, 3>(attn_spec::f16::from_f32);
    }

    fn decode_accumulate_r<E: crate::element::CpuElement, const R: usize>(from: fn(f32) -> E) {
        let ps = 64;
        for dv in [1usize, 5, 16, 67, 128, 200] {
            let vs = dv + 2;
            for n in [0usize, 1, 9, 64] {
                let v: Vec<E> = fill(n.max(1) * vs, 8).into_iter().map(from).collect();
                let p = fill(R * ps, 9);
                let o0 = fill(R * dv, 10);
                let alpha: [f32; R] = std::array::from_fn(|r| 0.25 + r as f32 / 4.0);
                let mut o = o0.clone();
                decode::accumulate::<E, R>(
                    (&p, ps),
                    (&v, vs),
                    n,
                    dv,
                    &alpha,
                    &mut o,
                    crate::pack::RowStream::NONE,
                );
                for r in 0..R {
                    for c in 0..dv {
                        let want = f64::from(alpha[r]) * f64::from(o0[r * dv + c])
                            + (0..n)
                                .map(|j| {
                                    f64::from(p[r * ps + j]) * f64::from(v[j * vs + c].to_f32())
                                })
                                .sum::<f64>();
                        let got = f64::from(o[r * dv + c]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (n + 1) as f64,
                            "R={R} dv={dv} n={n} r={r} c={c}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn decode_accumulate_matches_scalar_accumulation() {
        decode_accumulate_r::<f32, 1>(|x| x);
        decode_accumulate_r::<f32, 2>(|x| x);
        decode_accumulate_r::<f32, 3>(|x| x);
        decode_accumulate_r::<f32, 4>(|x| x);
        decode_accumulate_r::<attn_spec::bf16, 2>(attn_spec::bf16::from_f32);
        decode_accumulate_r::<attn_spec::f16, 4>(attn_spec::f16::from_f32);
    }
}
