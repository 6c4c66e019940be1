//! bf16 inputs on AVX512_BF16: the pass of `tiling::run_items` with both
//! products on `vdpbf16ps` (`kernels.rs`), which multiplies pairs of bf16
//! and accumulates in f32, twice the work of an f32 FMA per instruction.
//!
//! What changes against the f32 pass, and why it stays within the
//! contract (SEMANTICS §7):
//! - `Q K^T`: Q and K are read as the bf16 they are, in pairs along the
//!   head dimension (K in place, Q transposed into a panel of pairs), and
//!   each product of two bf16 is exact in f32; the score is multiplied by
//!   the scale (and log2 e) once, after the sum, instead of scaling Q
//!   before it (which would round Q to f32 times the scale: no gain here).
//! - `P V`: the probabilities are rounded to bf16 (round to nearest even)
//!   in pairs of keys as the online softmax forms them (its running sum
//!   takes them unrounded) and stored in place, pair `i` over key `2i`'s
//!   scores, which the softmax has just read (a buffer of their own
//!   missed L1 on every store: +0.6-2.3% at d = 64, Zen 4), and V is
//!   packed in pairs of keys per column, once per tile for both blocks
//!   of a pass, and kept for the head's
//!   later passes on the thread (`Workspace::packed_pairs`) when the
//!   tile's pairs are whole. The conformance bound allows P rounded to the
//!   input type.
//! - The probabilities come from the coarse exponential
//!   (`Vector::exp2_coarse`, or `exp2_coarse_unflushed` where no bias or
//!   option moved the scores: `crate::exp`; relative error 8.6e-5 =
//!   2^-13.5, two FMAs fewer than the f32 pass's 2^-23), a sixteenth of
//!   the bf16 rounding they then take; the forward conformance bound
//!   allows 2^-13 on bf16 inputs (`EXP_REL_ERR_BF16`).
//! - Masked tiles run the score kernel on the parts of the tile each
//!   vector of rows sees (`parts.rs`), as the f32 pass, and `P V` on those
//!   parts re-cut at even keys (`Parts::paired`).
//!
//! - `vdpbf16ps` flushes subnormal inputs and results to zero (DAZ, FTZ),
//!   and unscaled sums can overflow where scaled ones would not. So a pass
//!   runs here only while every element of its query rows and of the K and
//!   V rows of its key tiles is 0 or of magnitude in `[2^-64, 2^57)`
//!   ([`fits`]); at the first that is not (subnormals, absurdly small or
//!   large values, infinities, NaN) the pass starts over on the f32
//!   kernels, which are exact about them. In range, a flushed product or
//!   partial sum is below `2^-126` in size: under `2^-126 (n + d)` in a
//!   score or an output against values of at least `2^-64`, far inside the
//!   bound's floor; and `d * 2^114` stays finite for `d < 2^14`. The check
//!   runs once per K and V tile per head and thread (`Checked`): on each
//!   value row as the packing copies it, on each key row right after the
//!   score kernel that read it (in L1; the few rows the kernels skip are
//!   read after the products, from cache), and on each query row while
//!   packing it. Measured (`perf` example, 1 thread, Zen 4, alternating
//!   runs): about 1% faster at d = 64 than reading the tile's rows again
//!   after its products.
//!
//! Everything else (masks, soft-capping, ALiBi, bias, the online
//! softmax's state, the output) is the f32 pass's code, inlined here with the bf16
//! features enabled. Only bf16 inputs whose Q and K rows are contiguous,
//! with an even head dimension, take this pass (`applies`).

//!
//! Files: `pass.rs` (the pass), `kernels.rs` (the two products and the
//! backward pass's pair products), `decode.rs` (the decode path's
//! scores and `P V`), `pairs.rs` (Q and V into pairs, P out of the softmax, the
//! output write), `fit.rs` and `check.rs` (which
//! values may enter the instruction, and the vector checks), `tiles.rs`
//! and `amx.rs` (the products on the AMX tile unit).

pub mod amx;
#[cfg(target_arch = "x86_64")]
mod check;
#[cfg(target_arch = "x86_64")]
pub mod decode;
mod fit;
#[cfg(target_arch = "x86_64")]
mod kernels;
#[cfg(target_arch = "x86_64")]
mod pairs;
#[cfg(target_arch = "x86_64")]
mod pass;
#[cfg(target_arch = "x86_64")]
mod tiles;

#[cfg_attr(not(target_arch = "x86_64"), allow(unused_imports))]
pub use fit::{fits, fits_in, Checked, Window, BACKWARD, FORWARD};

use crate::tiling::Ctx;
use crate::Isa;
use attn_spec::{DType, Element};

/// Whether `ctx`'s prefill blocks run this pass on level `isa`: bf16
/// inputs on the `avx512bf16` level or above, an even head dimension of Q and K
/// below `2^14` (module docs), and Q and K rows contiguous (read as pairs
/// in place).
pub fn applies<T: Element>(ctx: &Ctx<'_, T>, isa: Isa) -> bool {
    let p = ctx.p;
    cfg!(target_arch = "x86_64")
        && isa >= Isa::Avx512Bf16
        && T::DTYPE == DType::Bf16
        && p.shape.head_dim_qk.is_multiple_of(2)
        && p.shape.head_dim_qk < 1 << 14
        && p.q.strides[3] == 1
        && p.k.strides[3] == 1
}

#[cfg(target_arch = "x86_64")]
pub use pairs::write_rows_bf16;

/// The elements of `s` as their bits when `T` is bf16 (the pair kernels'
/// input), else `None`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub fn bf16_bits<T: Element>(s: &[T]) -> Option<&[u16]> {
    (T::DTYPE == DType::Bf16 && std::mem::size_of::<T>() == 2).then(|| {
        // SAFETY: T is bf16 (checked): two bytes of plain bits each, as
        // many as `s` holds.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u16>(), s.len()) }
    })
}
#[cfg(target_arch = "x86_64")]
pub use pass::run_items;

/// `C = A B` or `C += f A B` ([`PairOut`]) on bf16 pairs
/// (`kernels::gemm_pairs`, which states the layout): the backward pass's
/// products for bf16 inputs on the `avx512bf16` level.
///
/// # Safety
/// As `kernels::gemm_pairs`, whose CPU requirement is checked here.
pub unsafe fn gemm_pairs(
    mnk: (usize, usize, usize),
    a: (*const u32, usize, usize),
    b: (*const u32, usize),
    c: (*mut f32, usize, PairOut),
) {
    assert!(
        Isa::Avx512Bf16.supported(),
        "the bf16 pair product needs AVX512_BF16"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded from the caller; the CPU runs the level (asserted).
    unsafe {
        kernels::gemm_pairs(mnk, a, b, c)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (mnk, a, b, c);
}

/// A key block of the backward as pairs straight from the bf16 inputs
/// (`pairs::key_block_pairs`, which states the layouts): `K^T` and `V^T`
/// in pairs of their rows, K in pairs of keys. Returns whether every
/// element is 0 or in `win`.
///
/// # Safety
/// As `pairs::key_block_pairs`, whose CPU requirement is checked here.
#[allow(clippy::too_many_arguments)]
pub unsafe fn key_block_pairs(
    k: (&[u16], &attn_spec::View),
    v: (&[u16], &attn_spec::View),
    head: (usize, usize),
    keys: (usize, usize),
    dims: (usize, usize),
    t: (*mut u32, *mut u32, usize),
    k2r: (*mut u32, usize),
    win: Window,
) -> bool {
    assert!(
        Isa::Avx512Bf16.supported(),
        "the bf16 pair packing needs AVX512_BF16"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded from the caller; the CPU runs the level (asserted).
    return unsafe { pairs::key_block_pairs(k, v, head, keys, dims, t, k2r, win) };
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (k, v, head, keys, dims, t, k2r, win);
        false
    }
}

/// How [`gemm_pairs`] leaves its product in `C`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PairOut {
    /// `C = A B`.
    Set,
    /// `C += f (A B)`, in one rounding per element (a fused multiply-add:
    /// with `f` a power of two, as the separate product and sum round
    /// unless `f (A B)` is subnormal, where it rounds once, not twice).
    Add(f32),
}

/// Packs f32 that are bf16 values into bf16 words, as
/// `kernels::pack_words` (two rows interleaved, or one row in order);
/// returns whether every element is 0 or in window `w`.
pub fn pack_words(even: &[f32], odd: Option<&[f32]>, dst: &mut [u32], w: Window) -> bool {
    assert!(
        Isa::Avx512Bf16.supported(),
        "bf16 words are packed for AVX512_BF16"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU runs the level (asserted).
    return unsafe { kernels::pack_words(even, odd, dst, w) };
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (even, odd, dst, w);
        unreachable!()
    }
}

/// Rounds a scaled f32 tile to bf16 words of row pairs, or of column
/// pairs in order (`along`): `kernels::round_row_pairs` and
/// `kernels::round_rows`, which state the layouts.
///
/// # Safety
/// As those kernels, whose CPU requirement is checked here.
pub unsafe fn round_tile(
    src: (*const f32, usize),
    size: (usize, usize),
    f: f32,
    dst: (*mut u32, usize),
    along: bool,
) {
    assert!(
        Isa::Avx512Bf16.supported(),
        "bf16 words are rounded for AVX512_BF16"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded from the caller; the CPU runs the level (asserted).
    unsafe {
        match along {
            true => kernels::round_rows(src, size, f, dst),
            false => kernels::round_row_pairs(src, size, f, dst),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, size, f, dst, along);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AMX path, on the model of the tile unit, through the suite's
    /// check: head dims that take the tiles for both products, one of them,
    /// or neither; key counts with and without a multiple-of-32 tile;
    /// masks (whose partial tiles the unit computes whole), GQA,
    /// per-element options, sinks, per-sequence lengths; heads long enough
    /// that later passes reuse the kept transposed values. The model must run where a
    /// whole tile exists, and the result must not depend on the thread
    /// count.
    #[test]
    fn amx_path_on_the_tile_model_passes_the_check() {
        use attn_conformance::case::Numbers;
        use attn_conformance::{check_case, Case, CaseParams, Outcome};
        use attn_spec::{AttnOptions, Backend, DType, Shape};
        use std::sync::atomic::Ordering::Relaxed;
        if !Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let one = crate::Cpu::with_threads(1)
            .unwrap()
            .with_tile_model()
            .unwrap();
        let three = crate::Cpu::with_threads(3)
            .unwrap()
            .with_tile_model()
            .unwrap();
        let cases: [(Shape, AttnOptions, u8); 8] = [
            (Shape::new(1, 2, 2, 70, 256, 64), AttnOptions::default(), 0),
            (
                Shape::new(2, 4, 2, 130, 300, 128),
                AttnOptions::default().causal(),
                0,
            ),
            (
                Shape::new(1, 2, 1, 200, 200, 32),
                AttnOptions::default().causal().with_lse(),
                1,
            ),
            (
                Shape::new(1, 2, 2, 90, 384, 64),
                AttnOptions::default().window(Some(300), Some(0)),
                0,
            ),
            (
                Shape::new(1, 2, 2, 64, 160, 64),
                AttnOptions::default().with_lse(),
                2,
            ),
            (Shape::new(1, 1, 1, 40, 128, 64), AttnOptions::default(), 3),
            (
                Shape::new(1, 2, 2, 48, 192, 96),
                AttnOptions::default().causal(),
                0,
            ),
            (
                Shape::new(1, 3, 1, 200, 160, 64),
                AttnOptions::default().top_left().causal(),
                1,
            ),
        ];
        for (i, (mut shape, options, extra)) in cases.into_iter().enumerate() {
            if i == 6 {
                shape.head_dim_v = 64; // dk 96: scores on vdpbf16ps, P V on tiles
            }
            let mut params = CaseParams::plain(shape);
            params.dtype = DType::Bf16;
            params.options = options;
            params.seed = i as u64;
            match extra {
                1 => params.sinks = true,
                2 => {
                    params.numbers = Numbers::NearOverflow;
                    params.kv_lens = true;
                }
                3 => {
                    params.bias = Some(attn_conformance::case::Bcast {
                        per_batch: false,
                        per_head: true,
                    })
                }
                _ => {}
            }
            let case = Case::build(params);
            let before = amx::MODEL_CALLS.load(Relaxed);
            assert_eq!(check_case(&one, &case), Ok(Outcome::Passed), "case {i}");
            // (Huge values and per-sequence lengths may leave no tile of a
            // multiple of 32 keys.)
            if extra != 2 {
                assert!(
                    amx::MODEL_CALLS.load(Relaxed) > before,
                    "case {i}: no tile product ran"
                );
            }
            let a = one.forward(&case.problem, case.inputs()).unwrap().out;
            let b = three.forward(&case.problem, case.inputs()).unwrap().out;
            assert!(a == b, "case {i}: 1 and 3 threads differ");
        }
    }
}
