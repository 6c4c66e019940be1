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

use crate::blocking::{mr, ROW_VECS};

/// Calls `$kernel::<m, NV>` for a runtime `m` in `1..=mr(NV)` (the tail
/// of a loop over keys or value columns).
macro_rules! dispatch_m {
    ($nv:tt, $m:expr, $kernel:ident ( $($arg:expr),* )) => {
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

/// [`scores`] on `nv` of a block's vectors (`nv` in `1..=ROW_VECS`, `m <=
/// mr(nv)`), both chosen at run time: the calls of a triangular tile, where
/// some vectors of rows see none of a group's keys. One copy for every
/// element type, not inlined.
///
/// # Safety
/// As [`scores`] with `M = m`, `NV = nv`.
#[inline(never)]
#[allow(clippy::too_many_arguments)] // the kernel's arguments and its two sizes
pub unsafe fn scores_part(
    nv: usize,
    m: usize,
    k: *const f32,
    k_stride: usize,
    qt: *const f32,
    ld: usize,
    d: usize,
    s: *mut f32,
) {
    assert!((1..=ROW_VECS).contains(&nv) && (1..=mr(nv)).contains(&m));
    // SAFETY: forwarded from the caller.
    unsafe {
        match nv {
            1 => dispatch_m!(1, m, scores(k, k_stride, qt, ld, d, s)),
            2 => dispatch_m!(2, m, scores(k, k_stride, qt, ld, d, s)),
            3 => dispatch_m!(3, m, scores(k, k_stride, qt, ld, d, s)),
            _ => dispatch_m!(4, m, scores(k, k_stride, qt, ld, d, s)),
        }
    }
}

/// [`pv`] on `nv` of a block's vectors with no rescaling (`alpha = 1`;
/// the caller rescales the running output once per tile), `nv` and `m <=
/// mr(nv)` chosen at run time: the calls of a triangular tile.
///
/// # Safety
/// As [`pv`] with `M = m`, `NV = nv`.
#[inline(never)]
#[allow(clippy::too_many_arguments)] // the kernel's arguments and its two sizes
pub unsafe fn pv_part(
    nv: usize,
    m: usize,
    v: *const f32,
    v_stride: usize,
    pt: *const f32,
    ld: usize,
    n: usize,
    ot: *mut f32,
) {
    assert!((1..=ROW_VECS).contains(&nv) && (1..=mr(nv)).contains(&m));
    let one = crate::simd::V::ONE;
    // SAFETY: forwarded from the caller.
    unsafe {
        match nv {
            1 => dispatch_m!(1, m, pv(v, v_stride, pt, ld, n, ot, &[one])),
            2 => dispatch_m!(2, m, pv(v, v_stride, pt, ld, n, ot, &[one; 2])),
            3 => dispatch_m!(3, m, pv(v, v_stride, pt, ld, n, ot, &[one; 3])),
            _ => dispatch_m!(4, m, pv(v, v_stride, pt, ld, n, ot, &[one; 4])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocking::LANES;
    use crate::simd::V;

    fn fill(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Checks a score kernel on `nv` vectors of a panel one vector wider
    /// than them (rows `ld` apart, the kernel's columns starting at vector
    /// 1), against scalar dot products; the panel's other columns must be
    /// left alone.
    fn check_scores(
        nv: usize,
        call: impl Fn(usize, &[f32], usize, *const f32, usize, usize, *mut f32),
    ) {
        let rows = nv * LANES;
        let ld = rows + LANES;
        for d in [1usize, 3, 16, 67] {
            let stride = d + 5;
            let k = fill(mr(nv) * stride, 1);
            let qt = fill(d * ld, 2);
            for m in 1..=mr(nv) {
                let mut s = vec![f32::NAN; m * ld];
                call(
                    m,
                    &k,
                    stride,
                    qt[LANES..].as_ptr(),
                    ld,
                    d,
                    s[LANES..].as_mut_ptr(),
                );
                for j in 0..m {
                    assert!(s[j * ld..j * ld + LANES].iter().all(|x| x.is_nan()));
                    for r in 0..rows {
                        let want: f64 = (0..d)
                            .map(|e| {
                                f64::from(k[j * stride + e]) * f64::from(qt[e * ld + LANES + r])
                            })
                            .sum();
                        let got = f64::from(s[j * ld + LANES + r]);
                        assert!(
                            (got - want).abs() <= 1e-5 * d as f64,
                            "nv={nv} d={d} m={m} {got} {want}"
                        );
                    }
                }
            }
        }
    }

    fn scores_nv<const NV: usize>() {
        check_scores(NV, |m, k, ks, qt, ld, d, s| {
            // SAFETY: check_scores passes mr(NV) keys of `ks >= d` floats,
            // a d x ld panel and m rows of ld floats, NV vectors from qt/s.
            unsafe { dispatch_m!(NV, m, scores(k.as_ptr(), ks, qt, ld, d, s)) }
        });
    }

    #[test]
    fn scores_match_scalar_dot_products() {
        scores_nv::<1>();
        scores_nv::<4>();
        for nv in 1..=4 {
            // SAFETY: as in scores_nv, for nv vectors.
            check_scores(nv, |m, k, ks, qt, ld, d, s| unsafe {
                scores_part(nv, m, k.as_ptr(), ks, qt, ld, d, s)
            });
        }
    }

    /// Checks a value kernel on `nv` vectors of a tile one vector wider than
    /// them (as `check_scores`), with rescale factors `alpha` (`None`: 1).
    fn check_pv(
        nv: usize,
        alpha: Option<&[V]>,
        call: impl Fn(usize, &[f32], usize, *const f32, usize, usize, *mut f32),
    ) {
        let rows = nv * LANES;
        let ld = rows + LANES;
        for n in [1usize, 2, 7, 128] {
            let stride = 13;
            let v = fill(n * stride, 3);
            let pt = fill(n * ld, 4);
            for m in 1..=mr(nv) {
                let ot0 = fill(m * ld, 5);
                let mut ot = ot0.clone();
                call(
                    m,
                    &v,
                    stride,
                    pt[LANES..].as_ptr(),
                    ld,
                    n,
                    ot[LANES..].as_mut_ptr(),
                );
                for c in 0..m {
                    assert_eq!(ot[c * ld..c * ld + LANES], ot0[c * ld..c * ld + LANES]);
                    for r in 0..rows {
                        let a =
                            alpha.map_or(1.0, |a| f64::from(a[r / LANES].to_array()[r % LANES]));
                        let at = c * ld + LANES + r;
                        let want = a * f64::from(ot0[at])
                            + (0..n)
                                .map(|j| {
                                    f64::from(v[j * stride + c]) * f64::from(pt[j * ld + LANES + r])
                                })
                                .sum::<f64>();
                        let got = f64::from(ot[at]);
                        assert!((got - want).abs() <= 1e-5 * n as f64, "nv={nv} n={n} m={m}");
                    }
                }
            }
        }
    }

    fn pv_nv<const NV: usize>() {
        let alpha: [V; NV] = std::array::from_fn(|i| {
            V::from(std::array::from_fn(|l| {
                0.5 + (i * LANES + l) as f32 / 128.0
            }))
        });
        check_pv(NV, Some(&alpha), |m, v, vs, pt, ld, n, ot| {
            // SAFETY: check_pv passes n value rows of 13 >= m floats, an n x
            // ld tile and m rows of ld floats, NV vectors from pt/ot.
            unsafe { dispatch_m!(NV, m, pv(v.as_ptr(), vs, pt, ld, n, ot, &alpha)) }
        });
    }

    #[test]
    fn pv_matches_scalar_accumulation() {
        pv_nv::<1>();
        pv_nv::<4>();
        for nv in 1..=4 {
            // SAFETY: as in pv_nv, for nv vectors.
            check_pv(nv, None, |m, v, vs, pt, ld, n, ot| unsafe {
                pv_part(nv, m, v.as_ptr(), vs, pt, ld, n, ot)
            });
        }
    }

    /// Checks the decode score kernel (`quad`: `scores_quad`, on the
    /// dims it takes) against f64 dot products.
    fn decode_scores_r<E: crate::element::CpuElement, const R: usize>(
        from: fn(f32) -> E,
        quad: bool,
    ) {
        let ss = 64;
        let dims: &[usize] = if quad {
            &[4, 16, 68, 128]
        } else {
            &[1, 3, 16, 67, 128]
        };
        for &d in dims {
            let qs = d.div_ceil(LANES) * LANES;
            let ks = d + 3;
            let mut q = fill(R * qs, 6);
            for r in 0..R {
                q[r * qs + d..(r + 1) * qs].fill(0.0);
            }
            for n in [1usize, 7, 16, 33, 64] {
                let k: Vec<E> = fill((n - 1) * ks + d, 7).into_iter().map(from).collect();
                let mut s = vec![f32::NAN; R * ss];
                let out = (&mut s[..], ss);
                let none = crate::pack::RowStream::NONE;
                if quad {
                    let q4 = decode::quad_queries(&q, qs, R, d);
                    decode::scores_quad::<E, R>(&q4, (&k, ks), n, d, out, none);
                } else {
                    decode::scores::<E, R>(&q, qs, (&k, ks), n, d, out, none);
                }
                for r in 0..R {
                    for j in 0..n {
                        let want: f64 = (0..d)
                            .map(|e| f64::from(q[r * qs + e]) * f64::from(k[j * ks + e].to_f32()))
                            .sum();
                        let got = f64::from(s[r * ss + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * d as f64,
                            "R={R} d={d} n={n} r={r} j={j} quad={quad}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn decode_scores_match_scalar_dot_products() {
        decode_scores_r::<f32, 1>(|x| x, false);
        decode_scores_r::<f32, 2>(|x| x, false);
        decode_scores_r::<f32, 3>(|x| x, false);
        decode_scores_r::<f32, 4>(|x| x, false);
        decode_scores_r::<attn_spec::bf16, 4>(attn_spec::bf16::from_f32, false);
        decode_scores_r::<attn_spec::f16, 3>(attn_spec::f16::from_f32, false);
    }

    #[test]
    fn decode_quad_scores_match_scalar_dot_products() {
        decode_scores_r::<f32, 3>(|x| x, true);
        decode_scores_r::<f32, 4>(|x| x, true);
        decode_scores_r::<attn_spec::bf16, 4>(attn_spec::bf16::from_f32, true);
        decode_scores_r::<attn_spec::f16, 3>(attn_spec::f16::from_f32, true);
        decode_scores_r::<attn_spec::f16, 4>(attn_spec::f16::from_f32, true);
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
