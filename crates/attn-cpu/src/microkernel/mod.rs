//! Register math only: the two microkernels of attention with query rows
//! along the SIMD lanes. No loops over blocks, no masks, no softmax here
//! (see `tiling.rs`); each kernel keeps an `M x NV` tile of accumulators in
//! registers and streams one operand from memory.
//!
//! Contract (`scores`, `pv`): `M <= V::mr(NV)`, `NV <= V::KERNEL_VECS`;
//! every pointer is valid for the extents stated on the function; nothing
//! is aligned; results are written with plain stores. The kernels are
//! written once, generic over the vector type, and compiled per level out
//! of line (`kernel_entries!`, one `scores_part` / `pv_part` per level,
//! called through `simd::Kernels::scores_part` / `pv_part`): their
//! register allocation is then the kernel's own, whatever loop nest calls
//! them. [`scores_vecs`] and [`pv_vecs`] cut a block wider than a level's
//! kernel into calls it takes. `decode` holds the two kernels of the
//! few-rows path (head dimension along the lanes), which take slices and
//! assert their extents instead. All are tested against scalar loops
//! below, on every level the CPU runs.

pub mod decode;
pub mod gemm;
mod pv;
mod scores;

pub use pv::pv;
pub use scores::scores;

use crate::blocking::LANES;
use crate::simd::Vector;

/// Calls `$kernel::<V, m, NV>` for a runtime `m` in `1..=max` (the tail
/// of a loop over keys or value columns), `max` one of 2, 3, 6, 8, 12: only
/// the shapes a level uses are compiled (a shape past its `mr` would keep
/// more accumulators than there are registers).
macro_rules! dispatch_m {
    ($v:ty, $nv:tt, 2, $m:expr, $kernel:ident ( $($arg:expr),* )) => {
        match $m {
            1 => $kernel::<$v, 1, $nv>($($arg),*),
            _ => $kernel::<$v, 2, $nv>($($arg),*),
        }
    };
    ($v:ty, $nv:tt, 3, $m:expr, $kernel:ident ( $($arg:expr),* )) => {
        match $m {
            1 => $kernel::<$v, 1, $nv>($($arg),*),
            2 => $kernel::<$v, 2, $nv>($($arg),*),
            _ => $kernel::<$v, 3, $nv>($($arg),*),
        }
    };
    ($v:ty, $nv:tt, 6, $m:expr, $kernel:ident ( $($arg:expr),* )) => {
        match $m {
            1 => $kernel::<$v, 1, $nv>($($arg),*),
            2 => $kernel::<$v, 2, $nv>($($arg),*),
            3 => $kernel::<$v, 3, $nv>($($arg),*),
            4 => $kernel::<$v, 4, $nv>($($arg),*),
            5 => $kernel::<$v, 5, $nv>($($arg),*),
            _ => $kernel::<$v, 6, $nv>($($arg),*),
        }
    };
    ($v:ty, $nv:tt, 8, $m:expr, $kernel:ident ( $($arg:expr),* )) => {
        match $m {
            7 => $kernel::<$v, 7, $nv>($($arg),*),
            8 => $kernel::<$v, 8, $nv>($($arg),*),
            _ => dispatch_m!($v, $nv, 6, $m, $kernel($($arg),*)),
        }
    };
    ($v:ty, $nv:tt, 12, $m:expr, $kernel:ident ( $($arg:expr),* )) => {
        match $m {
            9 => $kernel::<$v, 9, $nv>($($arg),*),
            10 => $kernel::<$v, 10, $nv>($($arg),*),
            11 => $kernel::<$v, 11, $nv>($($arg),*),
            12 => $kernel::<$v, 12, $nv>($($arg),*),
            _ => dispatch_m!($v, $nv, 8, $m, $kernel($($arg),*)),
        }
    };
}
pub(crate) use dispatch_m;

/// Defines, in a level's module, `kernels::scores_part` and
/// `kernels::pv_part`: [`scores`] and [`pv`] on `nv` vectors and `m` keys
/// or columns chosen at run time, compiled out of line for the vector type
/// `$v` with the target features `$features` (none for the portable
/// level), for the shapes `[nv => mr(nv), ..]` the level uses (they must
/// match its `Vector::mr` and `KERNEL_VECS`); and `kernels::run_items` and
/// `kernels::decode_tile`, the level's out-of-line copies of
/// `tiling::run_items` and `decode::tile`; and the level's
/// `simd::Kernels`, which reaches them. `; dot16: f` names the level's
/// bf16 dot-product pass (`dot16::run_items`), where it has one.
macro_rules! kernel_entries {
    ($v:ty, [$($nv:tt => $mr:tt),+] $(, $features:literal)? $(; dot16: $dot:ident)?) => {
        mod kernels {
            use super::V16;
            use $crate::decode::DecodeState;
            use $crate::element::CpuElement;
            use $crate::microkernel::{dispatch_m, pv, scores};
            use $crate::simd::Vector;
            use $crate::softmax::OnlineSoftmax;
            use $crate::tiling::Ctx;
            use $crate::work::Item;
            use $crate::workspace::Workspace;
            use attn_spec::TileClass;

            /// `tiling::run_items` for this level.
            ///
            /// # Safety
            /// The CPU runs this level.
            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            pub unsafe fn run_items<T: CpuElement, const NV: usize>(
                ctx: &Ctx<'_, T>,
                items: &[Item],
                ws: &mut Workspace,
            ) -> [OnlineSoftmax<V16, NV>; 2] {
                $crate::tiling::run_items::<V16, T, NV>(ctx, items, ws)
            }

            /// `decode::tile` for this level.
            ///
            /// # Safety
            /// The CPU runs this level.
            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            pub unsafe fn decode_tile<T: CpuElement>(
                ctx: &Ctx<'_, T>,
                item: &Item,
                st: &mut DecodeState,
                ws: &mut Workspace,
                at: (usize, usize, TileClass),
                next: $crate::decode::Next,
            ) {
                $crate::decode::tile::<V16, T>(ctx, item, st, ws, at, next)
            }

            /// `backward::task::run` for this level.
            ///
            /// # Safety
            /// The CPU runs this level.
            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            pub unsafe fn backward_task<T: CpuElement>(
                ctx: &$crate::backward::Ctx<'_, T>,
                outs: &$crate::backward::Outs<T>,
                task: &$crate::backward::Task,
                ws: &mut $crate::backward::task::Scratch,
            ) {
                $crate::backward::task::run::<V16, T>(ctx, outs, task, ws)
            }

            /// `maps::run` for this level.
            ///
            /// # Safety
            /// The CPU runs this level.
            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            pub unsafe fn maps_unit<T: CpuElement>(
                ctx: &$crate::maps::Ctx<'_, T>,
                unit: &$crate::maps::Unit,
                out: &mut [f32],
                ws: &mut $crate::maps::Scratch,
            ) {
                $crate::maps::run::<V16, T>(ctx, unit, out, ws)
            }

            /// `scores` on `nv` vectors and `m` keys.
            ///
            /// # Safety
            /// As `microkernel::scores` with `M = m <= mr(nv)`, `NV = nv
            /// <= KERNEL_VECS`; the CPU runs this level.
            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            #[allow(clippy::too_many_arguments)]
            pub unsafe fn scores_part(
                nv: usize,
                m: usize,
                k: *const f32,
                k_stride: usize,
                qt: *const f32,
                ld: usize,
                d: usize,
                s: *mut f32,
                mx: *mut f32,
            ) {
                assert!((1..=<$v>::KERNEL_VECS).contains(&nv) && (1..=<$v>::mr(nv)).contains(&m));
                // SAFETY: forwarded from the caller.
                unsafe {
                    match nv {
                        $($nv => dispatch_m!($v, $nv, $mr, m, scores(k, k_stride, qt, ld, d, s, mx)),)+
                        _ => unreachable!("nv = {nv} is checked above"),
                    }
                }
            }

            /// `pv` on `nv` vectors and `m` value columns.
            ///
            /// # Safety
            /// As `microkernel::pv` with `M = m <= mr(nv)`, `NV = nv <=
            /// KERNEL_VECS`; the CPU runs this level.
            $(#[target_feature(enable = $features)])?
            #[inline(never)]
            #[allow(clippy::too_many_arguments)]
            pub unsafe fn pv_part(
                nv: usize,
                m: usize,
                v: *const f32,
                v_stride: usize,
                pt: *const f32,
                ld: usize,
                n: usize,
                ot: *mut f32,
                alpha: Option<&[V16]>,
            ) {
                assert!((1..=<$v>::KERNEL_VECS).contains(&nv) && (1..=<$v>::mr(nv)).contains(&m));
                assert!(alpha.is_none_or(|a| a.len() >= nv));
                // SAFETY: forwarded from the caller.
                unsafe {
                    match nv {
                        $($nv => dispatch_m!($v, $nv, $mr, m, pv(v, v_stride, pt, ld, n, ot, alpha)),)+
                        _ => unreachable!("nv = {nv} is checked above"),
                    }
                }
            }
        }
        impl $crate::simd::Kernels for $v {
            #[inline(always)]
            fn run_items<T: $crate::element::CpuElement, const NV: usize>(
                ctx: &$crate::tiling::Ctx<'_, T>,
                items: &[$crate::work::Item],
                ws: &mut $crate::workspace::Workspace,
            ) -> [$crate::softmax::OnlineSoftmax<Self, NV>; 2] {
                if ctx.dot16 {
                    return Self::run_items_dot16::<T, NV>(ctx, items, ws);
                }
                // SAFETY: a vector of this level exists only where the CPU
                // runs it (the `Vector` contract).
                unsafe { kernels::run_items::<T, NV>(ctx, items, ws) }
            }
            $(
            #[inline(always)]
            fn run_items_dot16<T: $crate::element::CpuElement, const NV: usize>(
                ctx: &$crate::tiling::Ctx<'_, T>,
                items: &[$crate::work::Item],
                ws: &mut $crate::workspace::Workspace,
            ) -> [$crate::softmax::OnlineSoftmax<Self, NV>; 2] {
                assert!($crate::Isa::Avx512Bf16.supported());
                // SAFETY: the CPU runs the bf16 level (asserted).
                unsafe { $dot::<T, NV>(ctx, items, ws) }
            }
            )?
            #[inline(always)]
            fn decode_tile<T: $crate::element::CpuElement>(
                ctx: &$crate::tiling::Ctx<'_, T>,
                item: &$crate::work::Item,
                st: &mut $crate::decode::DecodeState,
                ws: &mut $crate::workspace::Workspace,
                at: (usize, usize, attn_spec::TileClass),
                next: $crate::decode::Next,
            ) {
                // SAFETY: as above.
                unsafe { kernels::decode_tile::<T>(ctx, item, st, ws, at, next) }
            }
            #[inline(always)]
            fn backward_task<T: $crate::element::CpuElement>(
                ctx: &$crate::backward::Ctx<'_, T>,
                outs: &$crate::backward::Outs<T>,
                task: &$crate::backward::Task,
                ws: &mut $crate::backward::task::Scratch,
            ) {
                // SAFETY: as above.
                unsafe { kernels::backward_task::<T>(ctx, outs, task, ws) }
            }
            #[inline(always)]
            fn maps_unit<T: $crate::element::CpuElement>(
                ctx: &$crate::maps::Ctx<'_, T>,
                unit: &$crate::maps::Unit,
                out: &mut [f32],
                ws: &mut $crate::maps::Scratch,
            ) {
                // SAFETY: as above.
                unsafe { kernels::maps_unit::<T>(ctx, unit, out, ws) }
            }
            #[inline(always)]
            unsafe fn scores_part(
                nv: usize,
                m: usize,
                k: *const f32,
                k_stride: usize,
                qt: *const f32,
                ld: usize,
                d: usize,
                s: *mut f32,
                mx: *mut f32,
            ) {
                // SAFETY: forwarded from the caller; the CPU runs this level.
                unsafe { kernels::scores_part(nv, m, k, k_stride, qt, ld, d, s, mx) }
            }
            #[inline(always)]
            unsafe fn pv_part(
                nv: usize,
                m: usize,
                v: *const f32,
                v_stride: usize,
                pt: *const f32,
                ld: usize,
                n: usize,
                ot: *mut f32,
                alpha: Option<&[Self]>,
            ) {
                // SAFETY: forwarded from the caller; the CPU runs this level.
                unsafe { kernels::pv_part(nv, m, v, v_stride, pt, ld, n, ot, alpha) }
            }
        }
    };
}
pub(crate) use kernel_entries;

/// Keys (or value columns) per call of [`scores_vecs`] / [`pv_vecs`] on
/// `nv` vectors of rows: the level's `mr` for the widest call they make.
#[inline(always)]
pub fn keys_per_call<V: Vector>(nv: usize) -> usize {
    V::mr(nv.clamp(1, V::KERNEL_VECS))
}

/// [`scores`] on vectors `0..nv` of a panel (any `nv`), as calls of at most
/// `V::KERNEL_VECS` vectors, for `m <= keys_per_call(nv)` keys.
///
/// # Safety
/// As [`scores`] with `M = m`, `NV = nv`.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // the kernel's arguments and its two sizes
pub unsafe fn scores_vecs<V: Vector>(
    nv: usize,
    m: usize,
    k: *const f32,
    k_stride: usize,
    qt: *const f32,
    ld: usize,
    d: usize,
    s: *mut f32,
    mx: *mut f32,
) {
    let mut v0 = 0;
    while v0 < nv {
        let c = (nv - v0).min(V::KERNEL_VECS);
        // SAFETY: vectors v0..v0+c of the caller's nv; m <= mr(c), since
        // mr never shrinks as calls narrow.
        unsafe {
            V::scores_part(
                c,
                m,
                k,
                k_stride,
                qt.add(v0 * LANES),
                ld,
                d,
                s.add(v0 * LANES),
                mx.add(v0 * LANES),
            )
        };
        v0 += c;
    }
}

/// [`pv`] on vectors `0..nv` of a tile (any `nv`), as calls of at most
/// `V::KERNEL_VECS` vectors, for `m <= keys_per_call(nv)` value columns;
/// `alpha` holds `nv` rescale factors (`None`: 1).
///
/// # Safety
/// As [`pv`] with `M = m`, `NV = nv`.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // the kernel's arguments and its two sizes
pub unsafe fn pv_vecs<V: Vector>(
    nv: usize,
    m: usize,
    v: *const f32,
    v_stride: usize,
    pt: *const f32,
    ld: usize,
    n: usize,
    ot: *mut f32,
    alpha: Option<&[V]>,
) {
    let mut v0 = 0;
    while v0 < nv {
        let c = (nv - v0).min(V::KERNEL_VECS);
        let a = alpha.map(|a| &a[v0..v0 + c]);
        // SAFETY: vectors v0..v0+c of the caller's nv; m <= mr(c).
        unsafe {
            V::pv_part(
                c,
                m,
                v,
                v_stride,
                pt.add(v0 * LANES),
                ld,
                n,
                ot.add(v0 * LANES),
                a,
            )
        };
        v0 += c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocking::LANES;
    use crate::simd::{for_each_vector, Vector};

    fn fill(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Checks a score kernel on `nv` vectors of a panel one vector wider
    /// than them (rows `ld` apart, the kernel's columns starting at vector
    /// 1), against scalar dot products; the panel's other columns must be
    /// left alone.
    #[allow(clippy::type_complexity)]
    fn check_scores<V: Vector>(
        nv: usize,
        call: impl Fn(usize, &[f32], usize, *const f32, usize, usize, *mut f32, *mut f32),
    ) {
        let rows = nv * LANES;
        let ld = rows + LANES;
        for d in [1usize, 3, 16, 67] {
            let stride = d + 5;
            let k = fill(keys_per_call::<V>(nv) * stride, 1);
            let qt = fill(d * ld, 2);
            for m in 1..=keys_per_call::<V>(nv) {
                let mut s = vec![f32::NAN; m * ld];
                // Running maxima: -inf, or above every score in odd rows.
                let mut mx: Vec<f32> = (0..rows)
                    .map(|r| if r % 2 == 0 { f32::NEG_INFINITY } else { 1e9 })
                    .collect();
                call(
                    m,
                    &k,
                    stride,
                    qt[LANES..].as_ptr(),
                    ld,
                    d,
                    s[LANES..].as_mut_ptr(),
                    mx.as_mut_ptr(),
                );
                for (r, &got) in mx.iter().enumerate() {
                    let top = (0..m)
                        .map(|j| s[j * ld + LANES + r])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let want = if r % 2 == 0 { top } else { 1e9 };
                    assert_eq!(got, want, "max nv={nv} d={d} m={m} r={r}");
                }
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

    fn scores_every_width<V: Vector>() {
        for nv in 1..=4 {
            // SAFETY: check_scores passes keys_per_call(nv) keys of `ks >=
            // d` floats, a d x ld panel and m rows of ld floats, nv vectors
            // from qt/s.
            check_scores::<V>(nv, |m, k, ks, qt, ld, d, s, mx| unsafe {
                scores_vecs::<V>(nv, m, k.as_ptr(), ks, qt, ld, d, s, mx)
            });
        }
    }

    #[test]
    fn scores_match_scalar_dot_products() {
        for_each_vector!(scores_every_width);
    }

    /// Checks a value kernel on `nv` vectors of a tile one vector wider than
    /// them (as `check_scores`), with rescale factors `alpha` (`None`: 1).
    fn check_pv<V: Vector>(
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
            for m in 1..=keys_per_call::<V>(nv) {
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

    fn pv_every_width<V: Vector>() {
        let alpha: [V; 4] = std::array::from_fn(|i| {
            V::from(std::array::from_fn(|l| {
                0.5 + (i * LANES + l) as f32 / 128.0
            }))
        });
        for nv in 1..=4 {
            for a in [Some(&alpha[..nv]), None] {
                // SAFETY: check_pv passes n value rows of 13 >= m floats, an
                // n x ld tile and m rows of ld floats, nv vectors from pt/ot.
                check_pv::<V>(nv, a, |m, v, vs, pt, ld, n, ot| unsafe {
                    pv_vecs::<V>(nv, m, v.as_ptr(), vs, pt, ld, n, ot, a)
                });
            }
        }
    }

    #[test]
    fn pv_matches_scalar_accumulation() {
        for_each_vector!(pv_every_width);
    }

    /// Checks the decode score kernel (`quad`: `scores_quad`, on the
    /// dims it takes) against f64 dot products.
    fn decode_scores_r<V: Vector, E: crate::element::CpuElement, const R: usize>(
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
                    decode::scores_quad::<V, E, R>(&q4, (&k, ks), n, d, out, none);
                } else {
                    decode::scores::<V, E, R>(&q, qs, (&k, ks), n, d, out, none);
                }
                for r in 0..R {
                    for j in 0..n {
                        let want: f64 = (0..d)
                            .map(|e| f64::from(q[r * qs + e]) * f64::from(k[j * ks + e].to_f32()))
                            .sum();
                        let got = f64::from(s[r * ss + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * d as f64,
                            "{:?} R={R} d={d} n={n} r={r} j={j} quad={quad}: {got} vs {want}",
                            V::ISA
                        );
                    }
                }
            }
        }
    }

    fn decode_scores_all<V: Vector>() {
        use attn_spec::{bf16, f16};
        decode_scores_r::<V, f32, 1>(|x| x, false);
        decode_scores_r::<V, f32, 2>(|x| x, false);
        decode_scores_r::<V, f32, 3>(|x| x, false);
        decode_scores_r::<V, f32, 4>(|x| x, false);
        decode_scores_r::<V, bf16, 4>(bf16::from_f32, false);
        decode_scores_r::<V, f16, 3>(f16::from_f32, false);
        // The quad kernel is tested on every level, whether or not the
        // level takes it (`Vector::QUAD`).
        decode_scores_r::<V, f32, 3>(|x| x, true);
        decode_scores_r::<V, f32, 4>(|x| x, true);
        decode_scores_r::<V, bf16, 4>(bf16::from_f32, true);
        decode_scores_r::<V, f16, 3>(f16::from_f32, true);
        decode_scores_r::<V, f16, 4>(f16::from_f32, true);
    }

    #[test]
    fn decode_scores_match_scalar_dot_products() {
        for_each_vector!(decode_scores_all);
    }

    fn decode_accumulate_r<V: Vector, E: crate::element::CpuElement, const R: usize>(
        from: fn(f32) -> E,
    ) {
        let ps = 64;
        for dv in [1usize, 5, 16, 67, 128, 200] {
            let vs = dv + 2;
            for n in [0usize, 1, 9, 64] {
                let v: Vec<E> = fill(n.max(1) * vs, 8).into_iter().map(from).collect();
                let p = fill(R * ps, 9);
                let o0 = fill(R * dv, 10);
                let alpha: [f32; R] = std::array::from_fn(|r| 0.25 + r as f32 / 4.0);
                let mut o = o0.clone();
                decode::accumulate::<V, E, R>(
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

    fn decode_accumulate_all<V: Vector>() {
        decode_accumulate_r::<V, f32, 1>(|x| x);
        decode_accumulate_r::<V, f32, 2>(|x| x);
        decode_accumulate_r::<V, f32, 3>(|x| x);
        decode_accumulate_r::<V, f32, 4>(|x| x);
        decode_accumulate_r::<V, attn_spec::bf16, 2>(attn_spec::bf16::from_f32);
        decode_accumulate_r::<V, attn_spec::f16, 4>(attn_spec::f16::from_f32);
    }

    #[test]
    fn decode_accumulate_matches_scalar_accumulation() {
        for_each_vector!(decode_accumulate_all);
    }

    /// f32 value rows at each of the 16 offsets from a 64-byte line (rows
    /// a whole number of lines apart, so the kernel starts its vectors
    /// where the lines do, `decode::rotation`): the same bits at every
    /// offset, and the f64 sums within f32 rounding.
    fn decode_accumulate_rotated_r<V: Vector, const R: usize>() {
        let ps = 64;
        // Every pass width ends a row somewhere: 16 and 48 in a pass of one
        // vector, 32 and 96 of two, 128 of four or eight.
        let (dvs, ns) = ([16usize, 32, 48, 96, 128], [0usize, 1, 9, 64]);
        let mut rotated = 0;
        for dv in dvs {
            let vs = dv + 16;
            for n in ns {
                let len = n.saturating_sub(1) * vs + if n > 0 { dv } else { 0 };
                let rows = fill(len, 8);
                let p = fill(R * ps, 9);
                let o0 = fill(R * dv, 10);
                let alpha: [f32; R] = std::array::from_fn(|r| 0.25 + r as f32 / 4.0);
                let mut buf = vec![0.0f32; len + 16];
                let mut first: Option<Vec<f32>> = None;
                for e in 0..16 {
                    buf[e..e + len].copy_from_slice(&rows);
                    // The rows exactly: a read past them is out of bounds.
                    let v = &buf[e..e + len];
                    if decode::rotation(v, vs, dv) > 0 {
                        rotated += 1;
                    }
                    let mut o = o0.clone();
                    decode::accumulate::<V, f32, R>(
                        (&p, ps),
                        (v, vs),
                        n,
                        dv,
                        &alpha,
                        &mut o,
                        crate::pack::RowStream::NONE,
                    );
                    match &first {
                        None => {
                            for (i, &got) in o.iter().enumerate() {
                                let (r, c) = (i / dv, i % dv);
                                let want = f64::from(alpha[r]) * f64::from(o0[i])
                                    + (0..n)
                                        .map(|j| {
                                            f64::from(p[r * ps + j]) * f64::from(rows[j * vs + c])
                                        })
                                        .sum::<f64>();
                                assert!(
                                    (f64::from(got) - want).abs() <= 1e-5 * (n + 1) as f64,
                                    "{:?} R={R} dv={dv} n={n} r={r} c={c}",
                                    V::ISA
                                );
                            }
                            first = Some(o);
                        }
                        Some(f) => {
                            for (i, (&got, &want)) in o.iter().zip(f).enumerate() {
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{:?} R={R} dv={dv} n={n} offset {e}: o[{i}]",
                                    V::ISA
                                );
                            }
                        }
                    }
                }
            }
        }
        // Of the 16 offsets (in floats) of the rows from a line, 4, 8 and
        // 12 start the kernel's vectors elsewhere (0 needs no rotation, the
        // rest are not 16-byte aligned).
        assert_eq!(rotated, 3 * dvs.len() * ns.len());
    }

    fn decode_accumulate_rotated_all<V: Vector>() {
        decode_accumulate_rotated_r::<V, 1>();
        decode_accumulate_rotated_r::<V, 2>();
        decode_accumulate_rotated_r::<V, 3>();
        decode_accumulate_rotated_r::<V, 4>();
    }

    #[test]
    fn decode_accumulate_gives_the_same_bits_at_every_row_alignment() {
        for_each_vector!(decode_accumulate_rotated_all);
    }
}
