//! The decode path's scores for bf16 inputs on `vdpbf16ps`: the layout of
//! `microkernel::decode::scores_quad` (a block's 3 or 4 query rows in the
//! four quarters of a vector, one accumulator per key, `reduce_quads` at
//! the end), with pairs of bf16 where that kernel has single floats. Each
//! instruction multiplies 8 dims of a key (one 16-byte broadcast of its
//! row, read in place) into the 4 rows, where the f32 kernel widens 4 dims
//! and spends an FMA on them: a quarter of the instructions per dim.
//!
//! As in the prefill pass (module docs of `dot16/`), the products are
//! exact only for values that [`fits`](super::fits): the query rows are
//! checked once, when the block's pairs are made ([`quad_pairs`]), and
//! each tile's key rows right after the kernel read them
//! ([`scores_quad_pairs`] says whether they fit); a tile whose keys do not
//! is computed again on the f32 kernel, which the decode state (f32
//! throughout) lets any tile do. The values stay on the f32 kernel
//! (`microkernel::decode::accumulate`): pairing them would take shuffles of
//! every value row.

use super::check::slab_fits;
use crate::blocking::LANES;
use crate::pack::RowStream;
use crate::simd::avx512::V16;
use crate::simd::{store, Vector};
use std::arch::x86_64::*;

/// Keys per group: 8 row pointers and 8 accumulator chains, as
/// `scores_quad`.
const GROUP: usize = 8;

/// The query rows (`rows`: 3 or 4 slices of `d` bf16 bits, `d` a multiple
/// of 8) as [`scores_quad_pairs`] reads them: vector `g` (of `d / 8`, 16
/// words each) holds in lane `4r + t` row `r`'s elements `8g + 2t` (low
/// half) and `8g + 2t + 1`; zero for a fourth row that is absent. `None`
/// when an element does not [`fits`](super::fits).
pub fn quad_pairs(rows: &[&[u16]], d: usize) -> Option<Vec<u32>> {
    assert!(
        (3..=4).contains(&rows.len()) && d.is_multiple_of(8) && rows.iter().all(|r| r.len() >= d)
    );
    if !rows.iter().all(|r| r[..d].iter().all(|&x| super::fits(x))) {
        return None;
    }
    let mut q2 = vec![0u32; 2 * d];
    for g in 0..d / 8 {
        for (r, row) in rows.iter().enumerate() {
            for t in 0..4 {
                let e = 8 * g + 2 * t;
                q2[g * LANES + 4 * r + t] = u32::from(row[e]) | (u32::from(row[e + 1]) << 16);
            }
        }
    }
    Some(q2)
}

/// `s[r * ss + j] = c * sum_{e < d} q[r][e] * k[j * ks + e]` for the
/// `rows` (3 or 4) rows of `q2` ([`quad_pairs`]) and keys `j < n`, the
/// products on `vdpbf16ps`; scores past `n` (up to `n` rounded to 16) are
/// written with unspecified values, as `scores_quad`'s contract says, and
/// row `j` of `ahead` is prefetched alongside key `j`. Returns whether
/// every element of the `n` key rows [`fits`](super::fits): when not, the
/// scores are wrong and the caller computes them again on the f32 kernel.
///
/// # Safety
/// The CPU runs AVX-512 F, BW and DQ and AVX512_BF16.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
pub unsafe fn scores_quad_pairs(
    q2: &[u32],
    (k, ks): (&[u16], usize),
    n: usize,
    d: usize,
    rows: usize,
    c: f32,
    (s, ss): (&mut [f32], usize),
    ahead: RowStream,
) -> bool {
    let n16 = n.div_ceil(LANES) * LANES;
    assert!(
        (3..=4).contains(&rows)
            && d > 0
            && d.is_multiple_of(8)
            && q2.len() >= 2 * d
            && ss >= n16
            && ss.is_multiple_of(LANES)
            && s.len() >= (rows - 1) * ss + n16
            && (n == 0 || k.len() >= (n - 1) * ks + d)
    );
    let mut jb = 0;
    while jb < n {
        let mut acc = [_mm512_setzero_ps(); LANES];
        for (g, acc) in acc.chunks_exact_mut(GROUP).enumerate() {
            let g0 = jb + g * GROUP;
            // Keys past `n` repeat the last key: always readable, and
            // their scores are discarded by the caller.
            let keys: [*const u16; GROUP] =
                std::array::from_fn(|i| k[(g0 + i).min(n - 1) * ks..].as_ptr());
            let live = GROUP.min(n.saturating_sub(g0));
            let mut e = 0;
            while e < d {
                // One row of the next tile per step, as `scores_quad`.
                if e / 8 < live {
                    ahead.row(g0 + e / 8);
                }
                // SAFETY: vector e / 8 of q2 is its 16 words from 2e <
                // 2d <= q2.len() (asserted); the CPU runs AVX-512 F.
                let qv: __m512bh = unsafe {
                    std::mem::transmute(_mm512_loadu_si512(q2.as_ptr().add(2 * e).cast()))
                };
                for (a, &key) in acc.iter_mut().zip(&keys) {
                    // SAFETY: every key row has d >= e + 8 elements
                    // (asserted): 16 bytes at e; the CPU runs the level.
                    unsafe {
                        let kb = _mm512_broadcast_i32x4(_mm_loadu_si128(key.add(e).cast()));
                        *a = _mm512_dpbf16_ps(*a, qv, std::mem::transmute::<__m512i, __m512bh>(kb));
                    }
                }
                e += 8;
            }
            for i in d / 8..live {
                ahead.row(g0 + i);
            }
        }
        let acc: [V16; LANES] = acc.map(V16);
        for (r, x) in V16::reduce_quads(&acc).iter().enumerate().take(rows) {
            // SAFETY: r * ss + jb + 16 <= (rows - 1) * ss + n16 <= s.len()
            // (asserted).
            unsafe { store(s.as_mut_ptr().add(r * ss + jb), *x * V16::splat(c)) };
        }
        jb += LANES;
    }
    // SAFETY: the CPU runs AVX-512 BW (this function's contract); rows
    // 0..n of k hold d elements, ks apart (asserted).
    let fit = n == 0 || unsafe { slab_fits(k, ks, (0, n), d) };
    #[cfg(test)]
    tests::TILES[d.min(tests::DIMS - 1)][usize::from(!fit)]
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    fit
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_spec::bf16;
    use std::sync::atomic::AtomicUsize;

    /// Head dims the tile counts tell apart.
    pub(super) const DIMS: usize = 257;

    /// Tiles [`scores_quad_pairs`] found fitting (0) and not (1), per head
    /// dim: tests running at once count apart where their dims differ.
    pub(super) static TILES: [[AtomicUsize; 2]; DIMS] =
        [const { [AtomicUsize::new(0), AtomicUsize::new(0)] }; DIMS];

    /// Scores of generated bf16 rows against their f64 dot products (each
    /// product exact, so within f32's summation error), every key count
    /// to 40 around the 16- and 8-key boundaries, head dims 8 to 136, 3
    /// and 4 rows; a key row with a value that does not fit is reported.
    #[test]
    fn pair_scores_match_f64_and_report_misfits() {
        if !crate::Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0)
        };
        for d in [8, 16, 64, 72, 128, 136] {
            for rows in [3, 4] {
                let q: Vec<Vec<bf16>> = (0..rows)
                    .map(|_| (0..d).map(|_| next()).collect())
                    .collect();
                let qb: Vec<Vec<u16>> = q
                    .iter()
                    .map(|r| r.iter().map(|v| v.to_bits()).collect())
                    .collect();
                let qr: Vec<&[u16]> = qb.iter().map(|r| &r[..]).collect();
                let q2 = quad_pairs(&qr, d).expect("ordinary values fit");
                for n in [1, 7, 8, 9, 16, 17, 33, 40] {
                    let ks = d + 3;
                    let k: Vec<bf16> = (0..n * ks).map(|_| next()).collect();
                    let kb: Vec<u16> = k.iter().map(|v| v.to_bits()).collect();
                    let ss = n.div_ceil(16) * 16;
                    let c = 0.7;
                    let run = |k: &[u16]| {
                        let mut s = vec![f32::NAN; rows * ss];
                        // SAFETY: the CPU runs the level (checked above).
                        let fit = unsafe {
                            scores_quad_pairs(
                                &q2,
                                (k, ks),
                                n,
                                d,
                                rows,
                                c,
                                (&mut s, ss),
                                RowStream::NONE,
                            )
                        };
                        (fit, s)
                    };
                    let (fit, s) = run(&kb);
                    assert!(fit);
                    for r in 0..rows {
                        for j in 0..n {
                            let (mut dot, mut mag) = (0.0f64, 0.0f64);
                            for e in 0..d {
                                let p =
                                    f64::from(q[r][e].to_f32()) * f64::from(k[j * ks + e].to_f32());
                                dot += p;
                                mag += p.abs();
                            }
                            let want = f64::from(c) * dot;
                            // d additions and the scale: (d + 1) f32 roundings.
                            let tol =
                                (d as f64 + 1.0) * f64::from(f32::EPSILON) * f64::from(c) * mag;
                            let got = f64::from(s[r * ss + j]);
                            assert!(
                                (got - want).abs() <= tol,
                                "d {d} rows {rows} n {n} ({r}, {j}): {got} vs {want}"
                            );
                        }
                    }
                    // A subnormal in the last key's last element, or in
                    // the middle key's first: reported; an infinity in the
                    // padding between rows: not read.
                    for (at, x, fits) in [
                        ((n - 1) * ks + d - 1, 1e-39, false),
                        ((n / 2) * ks, -1e-39, false),
                        ((n / 2) * ks + d, f32::INFINITY, true),
                    ] {
                        let mut bad = kb.clone();
                        bad[at] = bf16::from_f32(x).to_bits();
                        assert_eq!(run(&bad).0, fits, "d {d} n {n}: {x} at {at}");
                    }
                }
                let mut big = qb.clone();
                big[rows - 1][d / 2] = bf16::from_f32(1e20).to_bits();
                let br: Vec<&[u16]> = big.iter().map(|r| &r[..]).collect();
                assert!(quad_pairs(&br, d).is_none());
            }
        }
    }

    /// Decoding through the backend: GQA blocks of 3 and 4 rows take the
    /// pair scores and pass the conformance check (for 1 and 3 threads,
    /// bitwise alike); a key tile holding a subnormal is computed on the
    /// f32 kernel and the result still passes; a query row holding one
    /// keeps its block on the f32 kernels. The head dims (120, 56, 88) are
    /// this test's alone, so the tile counts are its own.
    #[test]
    fn decoding_on_pairs_passes_the_check_and_falls_back_per_tile() {
        use attn_conformance::{check_case, Case, CaseParams, Outcome};
        use attn_spec::{AttnOptions, Backend, DType, Shape};
        use std::sync::atomic::Ordering::Relaxed;
        if !crate::Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let (one, three) = (
            crate::Cpu::with_threads(1).unwrap(),
            crate::Cpu::with_threads(3).unwrap(),
        );
        let tiles = |d: usize| (TILES[d][0].load(Relaxed), TILES[d][1].load(Relaxed));
        for (i, (shape, options)) in [
            (Shape::new(2, 8, 2, 1, 300, 120), AttnOptions::default()),
            (
                Shape::new(1, 6, 2, 1, 200, 56),
                AttnOptions::default().with_lse(),
            ),
            (
                Shape::new(1, 2, 1, 2, 260, 88),
                AttnOptions::default().causal(),
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let d = shape.head_dim_qk;
            let mut params = CaseParams::plain(shape);
            params.dtype = DType::Bf16;
            params.options = options;
            params.seed = i as u64;
            let mut case = Case::build(params);
            let before = tiles(d);
            assert_eq!(check_case(&one, &case), Ok(Outcome::Passed), "case {i}");
            let after = tiles(d);
            assert!(
                after.0 > before.0 && after.1 == before.1,
                "case {i}: {before:?} {after:?}"
            );
            let a = one.forward(&case.problem, case.inputs()).unwrap().out;
            let b = three.forward(&case.problem, case.inputs()).unwrap().out;
            assert!(a == b, "case {i}: 1 and 3 threads differ");
            // A subnormal in key 100's row (its K/V head 0, dim 5).
            let at = case.problem.k.index([0, 100, 0, 5]);
            case.k.set(at, 1e-39);
            let before = tiles(d);
            assert_eq!(
                check_case(&one, &case),
                Ok(Outcome::Passed),
                "case {i}, subnormal key"
            );
            let after = tiles(d);
            assert!(
                after.1 > before.1 && after.0 > before.0,
                "case {i}: {before:?} {after:?}"
            );
            // A score the f32 kernel keeps finite (2^56.9 * 2^71.5 * d^-1/2
            // = 2^125) whose unscaled sum the pairs would overflow (2^128.4;
            // the suite's f32 reference overflows there too, so the output
            // is checked for that row's answer instead): the key does not
            // fit, so its tile is not taken on pairs, and row 0 of head 0,
            // whose softmax that key takes whole, comes out as its value row.
            let mut huge = case.clone();
            huge.q
                .set(huge.problem.q.index([0, 0, 0, 7]), 2f64.powf(56.9));
            huge.k
                .set(huge.problem.k.index([0, 150, 0, 7]), 2f64.powf(71.5));
            let out = one.forward(&huge.problem, huge.inputs()).unwrap().out;
            for c in 0..shape.head_dim_v {
                let got = out.get(huge.problem.out.index([0, 0, 0, c]));
                let want = huge.v.get(huge.problem.v.index([0, 150, 0, c]));
                assert_eq!(got, want, "case {i}, huge score, column {c}");
            }
            // A subnormal in a query row: with one block (the last case's
            // two queries times a group of 2 on one K/V head), no pair
            // tile at all.
            if shape.batch * shape.kv_heads == 1 {
                case.q.set(case.problem.q.index([0, 0, 0, 3]), -1e-39);
                let before = tiles(d);
                assert_eq!(
                    check_case(&one, &case),
                    Ok(Outcome::Passed),
                    "case {i}, subnormal query"
                );
                assert_eq!(
                    tiles(d),
                    before,
                    "case {i}: pair tiles with a subnormal query"
                );
            }
        }
    }
}
