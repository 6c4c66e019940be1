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
//!   takes them unrounded), and V is packed in pairs of keys per column,
//!   once per tile for both blocks of a pass, and kept for the head's
//!   later passes on the thread (`Workspace::packed_pairs`) when the
//!   tile's pairs are whole. The conformance bound allows P rounded to the
//!   input type.
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
//! Everything else (masks, soft-capping, ALiBi, bias, the online softmax,
//! the output) is the f32 pass's code, inlined here with the bf16
//! features enabled. Only bf16 inputs whose Q and K rows are contiguous,
//! with an even head dimension, take this pass (`applies`).

pub mod amx;
#[cfg(target_arch = "x86_64")]
mod kernels;

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

    /// The bf16 output write rounds each scaled value as `bf16::from_f32`
    /// does (ties to even included), stops before 32 columns that hold a
    /// NaN or a subnormal, and writes nothing past the columns it reports.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn bf16_rows_round_as_from_f32_and_stop_before_nan_or_subnormal() {
        if !Isa::Avx512Bf16.supported() {
            eprintln!("skipped: this CPU has no AVX512_BF16");
            return;
        }
        let (dv, w) = (100, 32);
        // (column, row, value) put into O^T, and the columns written.
        let cases = [
            (None, 96),
            (Some((40, 3, f32::NAN)), 32),
            (Some((70, 15, 1e-39)), 64),
            (Some((5, 0, -f32::NAN)), 0),
            (Some((97, 2, f32::NAN)), 96),
        ];
        for (odd, want) in cases {
            // Values of every size and sign, some halfway between two bf16
            // (1 + 2^-8 times a power of two: a tie) and some just off it.
            let mut ot: Vec<f32> = (0..dv * w)
                .map(|i| {
                    let x = ((i * 2_654_435_761) % 1_000_003) as f32 / 1_000_003.0 - 0.5;
                    match i % 5 {
                        0 => (1.0 + 2f32.powi(-8)) * 2f32.powi((i % 40) as i32 - 20),
                        1 => (1.0 + 3.0 * 2f32.powi(-8)) * -2f32.powi((i % 7) as i32),
                        _ => x * 2f32.powi((i % 60) as i32 - 30),
                    }
                })
                .collect();
            if let Some((c, r, x)) = odd {
                ot[c * w + r] = x;
            }
            let f: [f32; 16] = std::array::from_fn(|i| [1.0, 0.5, 0.37, 2.0][i % 4]);
            let mut out = vec![0xdeadu16; 16 * dv];
            let dst: [*mut u16; 16] = std::array::from_fn(|i| out[i * dv..].as_mut_ptr());
            // SAFETY: O^T holds dv x w floats, the rows 16 x dv words; the
            // CPU runs the level (checked above).
            let got = unsafe { write_rows_bf16(ot.as_ptr(), w, &f, &dst, dv) };
            assert_eq!(got, want, "{odd:?}");
            for i in 0..16 {
                for c in 0..dv {
                    let at = out[i * dv + c];
                    match c < got {
                        true => assert_eq!(
                            at,
                            bf16::from_f32(ot[c * w + i] * f[i]).to_bits(),
                            "{odd:?}: row {i} column {c}"
                        ),
                        false => assert_eq!(at, 0xdead, "{odd:?}: row {i} column {c} written"),
                    }
                }
            }
        }
    }

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

#[cfg(target_arch = "x86_64")]
pub use pass::{run_items, write_rows_bf16};

/// `C = A B` on bf16 pairs (`kernels::gemm_pairs`, which states the
/// layout): the backward pass's products for bf16 inputs on the
/// `avx512bf16` level.
///
/// # Safety
/// As `kernels::gemm_pairs`, whose CPU requirement is checked here.
pub unsafe fn gemm_pairs(
    mnk: (usize, usize, usize),
    a: (*const u32, usize, usize),
    b: (*const u32, usize),
    c: (*mut f32, usize),
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

#[cfg(target_arch = "x86_64")]
mod pass {
    use super::amx::Session;
    use super::kernels::{mr, pv_part, scores_part};
    use crate::blocking::{share, KEYS, LANES, PREFETCH_SPAN_BYTES};
    use crate::element::CpuElement;
    use crate::pack::{packed_stride, prefetch_rows, typed_rows, Hint, PackedV};
    use crate::parts::Parts;
    use crate::simd::avx512::V16;
    use crate::simd::Vector;
    use crate::softmax::OnlineSoftmax;
    use crate::tiling::{meets, pass_spans, transform, Ctx, RowInfo};
    use crate::work::Item;
    use crate::workspace::Workspace;
    use attn_spec::{DType, TileClass, View};
    use std::arch::x86_64::*;

    /// `tiling::run_items` for bf16 on `vdpbf16ps` (see the module docs):
    /// one or two items of one (batch, K/V head) in one pass over their
    /// keys; leaves item `i`'s unnormalised output in `ws.ot[i * dv *
    /// NV*16..]` and returns the softmax states.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F/BW, AVX512_BF16, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
    #[inline(never)]
    pub unsafe fn run_items<T: CpuElement, const NV: usize>(
        ctx: &Ctx<'_, T>,
        items: &[Item],
        ws: &mut Workspace,
    ) -> [OnlineSoftmax<V16, NV>; 2] {
        // SAFETY: forwarded from the caller.
        match unsafe { try_pass::<T, NV>(ctx, items, ws) } {
            Some(states) => states,
            // Values vdpbf16ps would not compute exactly enough (module
            // docs): the f32 pass, from the start.
            None => crate::tiling::run_items::<V16, T, NV>(ctx, items, ws),
        }
    }

    /// [`run_items`], or `None` as soon as a query row or a key tile holds
    /// an element that does not [`fit`](super::fits).
    ///
    /// # Safety
    /// As [`run_items`].
    ///
    /// (With the target features of its own: the closures in it take them
    /// from here, and the intrinsics they call inline only where they are.)
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
    unsafe fn try_pass<T: CpuElement, const NV: usize>(
        ctx: &Ctx<'_, T>,
        items: &[Item],
        ws: &mut Workspace,
    ) -> Option<[OnlineSoftmax<V16, NV>; 2]> {
        assert!(ctx.dot16 && T::DTYPE == DType::Bf16 && size_of::<T>() == 2);
        // SAFETY: T is bf16 (asserted): two bytes of plain bits each.
        let bits =
            |s: &[T]| unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u16>(), s.len()) };
        let (q, k, v) = (bits(ctx.q), bits(ctx.k), bits(ctx.v));
        let p = ctx.p;
        let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
        let (d2, w) = (dk / 2, NV * LANES);
        let head = (items[0].b, items[0].kvh);
        assert!(
            dk.is_multiple_of(2)
                && (1..=2).contains(&items.len())
                && items.iter().all(|it| {
                    it.rows() <= w && (it.b, it.kvh) == head && it.keys == items[0].keys
                })
        );
        let mask = p.seq_mask(head.0);
        let (spans, (lo, hi)) = pass_spans(&mask, items);
        let Workspace {
            qt,
            st,
            ot,
            vbuf,
            packed_pairs,
            packed_vt,
            pt2,
            vt,
            ahead,
            head: ws_head,
            checked,
            ..
        } = ws;
        // Query panels: d/2 rows of w words each, in qt's f32 slots.
        assert!(qt.len() >= items.len() * dk * w);
        for (i, it) in items.iter().enumerate() {
            let panel = qt[i * dk * w..].as_mut_ptr().cast::<u32>();
            // SAFETY: qt holds dk * w floats per item (asserted), room for
            // d2 * w words; Q rows are contiguous (`applies`); the CPU runs
            // AVX-512 (this function's contract).
            if !unsafe { pack_q_pairs(q, &p.q, it, (d2, w), panel) } {
                return None;
            }
        }
        ot[..items.len() * dv * w].fill(0.0);
        let mut sms = [
            OnlineSoftmax::<V16, NV>::new(),
            OnlineSoftmax::<V16, NV>::new(),
        ];
        // Each item's row facts, made at its first masked tile.
        let mut rows: Vec<Option<RowInfo<V16, NV>>> = items.iter().map(|_| None).collect();
        let per_element = ctx.per_element();
        ahead.pace(items.len() * (hi - lo).div_ceil(KEYS) * KEYS.div_ceil(mr(NV)));
        let span_bytes = (hi - lo) * (dk + dv) * 2;
        let prefetch = span_bytes > PREFETCH_SPAN_BYTES || *ws_head != Some(head);
        if lo < hi {
            *ws_head = Some(head);
        }
        let c = ctx.q_scale();
        // The tile unit, configured for the pass (`amx.rs`): tiles of a
        // multiple of 32 keys multiply on it, scores when dk is a multiple
        // of 32 (K's rows read in place, 32 bf16 per step), the output when
        // dv is. It computes masked tiles whole: the mask then applies to
        // the scores as on the f32 pass, and masked probabilities are 0.
        let amx = ctx.tiles.map(Session::new);
        let amx_keys = |n: usize| amx.as_ref().filter(|_| n.is_multiple_of(32));
        if amx.is_some() && vt.len() < KEYS / 2 * dv {
            *vt = crate::workspace::Aligned::zeroed(KEYS / 2 * dv);
        }
        let vs = packed_stride(dv);
        let mut j0 = lo;
        while j0 < hi {
            let n = KEYS.min(hi - j0);
            let mut next_n = if prefetch { n.min(hi - j0 - n) } else { 0 };
            let classes: Vec<TileClass> = items
                .iter()
                .enumerate()
                .map(|(i, it)| {
                    if meets(spans[i], (j0, n)) {
                        mask.classify(it.positions(), j0..j0 + n)
                    } else {
                        TileClass::Skip
                    }
                })
                .collect();
            if classes.iter().all(|&c| c == TileClass::Skip) {
                j0 += n;
                continue;
            }
            let n2 = n.div_ceil(2);
            assert!(vbuf.len() >= n2 * vs && vs >= dv);
            // A tile of whole pairs at an even key is packed into the
            // head's pair rows kept across passes (pair `i` of the head is
            // keys 2i, 2i + 1 whatever the tile), and packed only if no
            // earlier pass of the head on this thread did; any other tile
            // into `vbuf`.
            let pairs0 = j0 / 2;
            let keep =
                j0.is_multiple_of(2) && n.is_multiple_of(2) && PackedV::fits(pairs0 + n2, vs);
            let held = keep && packed_pairs.holds(head, &(pairs0..pairs0 + n2));
            let vp: *mut u32 = match keep {
                true => packed_pairs
                    .claim(head, (pairs0, n2), vs)
                    .as_mut_ptr()
                    .cast(),
                false => vbuf.as_mut_ptr().cast(),
            };
            // The tile's values are packed pair by pair between the first
            // block's score kernels, each group one kernel call after its
            // prefetch into L1, so the copy overlaps the arithmetic.
            let mut packed = if held { n2 } else { 0 };
            // Whether the tile's K and V rows are still to be checked
            // (once per head and thread), and what the products found of
            // them on the way: the packing checks each value it copies, and
            // the score kernels' key rows are checked after each kernel (in
            // L1 then) while they follow on from the tile's first key: keys
            // `0..k_upto` of the tile so far.
            let check = !checked.covers(head, &(j0..j0 + n));
            let (mut v_fit, mut k_fit, mut k_upto) = (true, true, 0);
            let mut pack = |pairs: std::ops::Range<usize>| {
                assert!(pairs.end <= n2);
                // SAFETY: vp holds n2 rows of vs words (vbuf: asserted; the
                // kept rows: claimed); the CPU runs AVX-512 (this function's
                // contract).
                v_fit &= unsafe { pack_v_pairs(v, &p.v, head, (j0, n), pairs, dv, (vp, vs)) };
            };
            let (krows, ks) = typed_rows(k, &p.k, head, (j0, n), dk)
                .expect("K rows are contiguous (dot16::applies)");
            assert!(krows.len() >= (n - 1) * ks + dk && st.len() >= n * w);
            let mut vt_made = false;
            let mut vt_kept = None;
            for (i, it) in items.iter().enumerate() {
                if classes[i] == TileClass::Skip {
                    continue;
                }
                let masked = classes[i] == TileClass::Partial || per_element;
                // (No closure: it would lose the level's target features.)
                if masked && rows[i].is_none() {
                    rows[i] = Some(RowInfo::new(ctx, it, &mask));
                }
                let info = rows[i].as_ref().filter(|_| masked);
                let parts = match info {
                    Some(rows) => Parts::cut(&rows.bounds, (j0, n)),
                    None => Parts::whole(n, NV),
                };
                if cfg!(debug_assertions) {
                    st[..n * w].fill(f32::NAN);
                }
                let qp = qt[i * dk * w..].as_ptr().cast::<u32>();
                // Each row's largest score in the tile, folded in by the
                // score kernels (used when no mask or option changes the
                // scores after them).
                let mut top = [f32::NEG_INFINITY; 4 * LANES];
                let on_tiles = amx_keys(n).filter(|_| dk.is_multiple_of(32));
                if let Some(unit) = on_tiles {
                    if next_n > 0 {
                        prefetch_rows(k, &p.k, head, (j0 + n, next_n), dk, Hint::L2);
                        prefetch_rows(v, &p.v, head, (j0 + n, next_n), dv, Hint::L2);
                    }
                    // SAFETY: krows holds n rows of dk bf16, ks apart, and n
                    // and dk are multiples of 32; the panel is d2 x w words;
                    // st holds n x w floats (asserted above); top holds
                    // 4 * 16 >= w floats; the CPU runs the bf16 level (this
                    // function's contract).
                    unsafe {
                        tile_scores(
                            unit,
                            (krows.as_ptr(), ks),
                            (qp, w, d2),
                            n,
                            c,
                            st.as_mut_ptr(),
                            &mut top,
                            // The pace counts one step per score kernel
                            // call of mr(NV) keys: as many per 32 keys.
                            || (0..32usize.div_ceil(mr(NV))).for_each(|_| ahead.issue()),
                        )
                    };
                }
                // What is left for `vdpbf16ps`: nothing after the tile unit.
                let parts_left = match on_tiles {
                    Some(_) => Parts::whole(0, 0),
                    None => parts,
                };
                for (keys, vecs) in parts_left.iter().filter(|(_, vecs)| !vecs.is_empty()) {
                    assert!(keys.end <= n && vecs.end <= NV);
                    let nv = vecs.len();
                    let mut j = keys.start;
                    while j < keys.end {
                        let m = share(keys.end - j, mr(nv));
                        if j < next_n {
                            let next = (j0 + n + j, m.min(next_n - j));
                            prefetch_rows(k, &p.k, head, next, dk, Hint::L2);
                            prefetch_rows(v, &p.v, head, next, dv, Hint::L2);
                        }
                        if packed < n2 {
                            prefetch_rows(v, &p.v, head, (j0 + j, m), dv, Hint::L1);
                            let upto = (j / 2).max(packed);
                            pack(packed..upto);
                            packed = upto;
                        }
                        ahead.issue();
                        let at = vecs.start * LANES;
                        // SAFETY: krows holds n rows of dk bf16, ks apart;
                        // the panel is d2 x w words; st holds n x w floats
                        // (asserted above); j + m <= keys.end <= n and
                        // vecs.end <= NV (asserted per part), m <= mr(nv);
                        // top holds 4 * 16 >= NV * 16 floats; the CPU runs
                        // the bf16 level (this function's contract).
                        unsafe {
                            scores_part(
                                nv,
                                m,
                                krows[j * ks..].as_ptr(),
                                ks,
                                qp.add(at),
                                w,
                                d2,
                                c,
                                st[j * w + at..].as_mut_ptr(),
                                top[at..].as_mut_ptr(),
                            )
                        };
                        if check && j == k_upto {
                            // SAFETY: the CPU runs this level (this
                            // function's contract).
                            k_fit &= unsafe { slab_fits(krows, ks, (j, m), dk) };
                            k_upto += m;
                        }
                        j += m;
                    }
                }
                // The next tile is asked for once, and the values packed,
                // by the first block.
                next_n = 0;
                pack(packed..n2);
                packed = n2;
                if let Some(rows) = info {
                    transform(ctx, it, st, (j0, n), rows);
                }
                assert!(pt2.len() >= n2 * w);
                let pp = pt2.as_mut_ptr();
                let top = (!masked).then_some(&top[..]);
                let alpha = sms[i].update_pairs(st, n, top, |jp, r, e0, e1| {
                    assert!(jp < n2 && r < NV);
                    // SAFETY: jp < n2 and r < NV (asserted): 16 words at
                    // row jp, vector r of the pair tile (n2 x w words).
                    unsafe { store_pairs(pp.add(jp * w + r * LANES), e0, e1) };
                });
                let out = ot[i * dv * w..(i + 1) * dv * w].as_mut_ptr();
                let pv_parts = parts.paired();
                let on_tiles = amx_keys(n).filter(|_| dv.is_multiple_of(32));
                if let Some(unit) = on_tiles {
                    // The transposed values: a whole tile at a multiple of
                    // KEYS is kept for the head's later passes.
                    let t = j0 / KEYS;
                    let vt_stride = dv * KEYS / 2;
                    let keep =
                        j0.is_multiple_of(KEYS) && n == KEYS && PackedV::fits(t + 1, vt_stride);
                    let (vtp, fresh): (*mut u32, bool) = match keep {
                        true => (
                            packed_vt.claim(head, (t, 1), vt_stride).as_mut_ptr().cast(),
                            !packed_vt.holds(head, &(t..t + 1)) && vt_kept.is_none(),
                        ),
                        false => (vt.as_mut_ptr(), !vt_made),
                    };
                    // SAFETY: the packed values hold n2 rows of dv words, vs
                    // apart, all packed by now; vtp holds dv x n2 words (vt:
                    // KEYS / 2 x dv, resized above; a claimed tile: dv x
                    // KEYS / 2); pt2 holds n2 x w words, zero where masked;
                    // this item's output is dv x w floats; n and dv are
                    // multiples of 32; the CPU runs the bf16 level.
                    unsafe {
                        if fresh {
                            transpose_words((vp, vs), (n2, dv), vtp);
                        }
                        tile_pv(unit, (vtp, n2, dv), (pp, w), out, &alpha);
                    }
                    match keep {
                        true => vt_kept = Some(t),
                        false => vt_made = true,
                    }
                    continue;
                }
                if pv_parts.is_whole(n, NV) {
                    let mut col = 0;
                    while col < dv {
                        let m = mr(NV).min(dv - col);
                        // SAFETY: the packed values hold n2 rows of dv
                        // words, vs apart (col + m <= dv); pt2 holds n2 x w
                        // words (asserted); this item's output is dv x w
                        // floats; alpha holds NV factors.
                        unsafe {
                            pv_part(
                                NV,
                                m,
                                vp.add(col),
                                vs,
                                pp,
                                w,
                                n2,
                                out.add(col * w),
                                Some(&alpha),
                            )
                        };
                        col += m;
                    }
                    continue;
                }
                // Parts: rescale the running output once, then add each
                // part's pairs of keys on its vectors only.
                // SAFETY: this item's output is dv x w floats, w = NV * 16.
                unsafe { rescale(out, dv, &alpha) };
                for (keys, vecs) in pv_parts.iter().filter(|(_, vecs)| !vecs.is_empty()) {
                    assert!(keys.end <= n && vecs.end <= NV && keys.start.is_multiple_of(2));
                    let (i0, i1, nv) = (keys.start / 2, keys.end.div_ceil(2), vecs.len());
                    let at = vecs.start * LANES;
                    let mut col = 0;
                    while col < dv {
                        let m = share(dv - col, mr(nv));
                        // SAFETY: pairs i0..i1 <= n2 of the packed values
                        // (rows of dv words, vs apart, col + m <= dv) and
                        // of pt2 (n2 x w words); vectors vecs.end <= NV of
                        // this item's dv x w output.
                        unsafe {
                            pv_part(
                                nv,
                                m,
                                vp.add(i0 * vs + col),
                                vs,
                                pp.add(i0 * w + at),
                                w,
                                i1 - i0,
                                out.add(col * w + at),
                                None,
                            )
                        };
                        col += m;
                    }
                }
            }
            // Each tile's K and V rows are checked once per head and thread,
            // with or after its products: from cache, where a check ahead
            // of them read them first, from memory, with nothing to overlap
            // (11% of a b8-h12-s256 encoder call). The rows the products
            // did not check are read here: K after a gap in a masked tile's
            // parts, all of K on the tile unit, V kept packed from an
            // earlier pass. Values that do not fit give a wrong tile but no
            // fault, and the pass is then dropped whole; the packed values
            // are kept for later passes only once checked.
            if check {
                // SAFETY: the CPU runs this level (this function's contract).
                let fit = unsafe {
                    (k_fit && rows_fit(k, &p.k, head, (j0 + k_upto, n - k_upto), dk))
                        && (if held {
                            rows_fit(v, &p.v, head, (j0, n), dv)
                        } else {
                            v_fit
                        })
                };
                if !fit {
                    return None;
                }
                checked.add(head, j0..j0 + n);
            }
            if keep && !held {
                packed_pairs.mark(pairs0..pairs0 + n2);
            }
            if let Some(t) = vt_kept {
                packed_vt.mark(t..t + 1);
            }
            j0 += n;
        }
        Some(sms)
    }

    /// `S^T` of one whole tile (masked or not) on the tile unit: for each
    /// 32 keys, the products over the query panel's columns, then (while
    /// in L1) each score times `c`, each row's largest folded into `top`,
    /// and the prefetch pace's steps for those keys (`issue`).
    ///
    /// # Safety
    /// `k + j * ks + e` readable for `j < n`, `e < 2 * d2`; the panel `d2 x
    /// w` words; `st` `n x w` floats writable; `n` and `2 * d2` multiples
    /// of 32, `w` of 16 and at most `top.len()`; the CPU runs AVX-512 F.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_scores(
        unit: &Session,
        (k, ks): (*const u16, usize),
        (qp, w, d2): (*const u32, usize, usize),
        n: usize,
        c: f32,
        st: *mut f32,
        top: &mut [f32],
        mut issue: impl FnMut(),
    ) {
        assert!(n.is_multiple_of(32) && d2.is_multiple_of(16));
        assert!(w.is_multiple_of(LANES) && w <= top.len());
        // SAFETY: every access is within the extents above.
        unsafe {
            let cv = _mm512_set1_ps(c);
            for j in (0..n).step_by(32) {
                unit.mul(
                    (k.add(j * ks).cast(), 2 * ks),
                    (qp.cast(), 4 * w),
                    d2 / 16,
                    (st.add(j * w), 4 * w),
                    w,
                    false,
                );
                for r in (0..w).step_by(LANES) {
                    let mut mx = _mm512_loadu_ps(top.as_ptr().add(r));
                    for jj in j..j + 32 {
                        let at = st.add(jj * w + r);
                        let x = _mm512_mul_ps(_mm512_loadu_ps(at), cv);
                        mx = _mm512_max_ps(mx, x);
                        _mm512_storeu_ps(at, x);
                    }
                    _mm512_storeu_ps(top.as_mut_ptr().add(r), mx);
                }
                issue();
            }
        }
    }

    /// `O^T = alpha O^T + V^T P^T` for one item on the tile unit: the
    /// running output rescaled (unless every factor is 1), then the
    /// products, 32 value columns by up to 32 rows at a time.
    ///
    /// # Safety
    /// `vt` holds `dv` rows of `n2` words (the transposed value pairs), `pp`
    /// `n2` rows of `w` words, `out` `dv x w` floats; `n2` a multiple of
    /// 16, `dv` of 32, `w` of 16 with `w / 16 <= alpha.len()`; the CPU
    /// runs AVX-512 F.
    #[inline(always)]
    unsafe fn tile_pv(
        unit: &Session,
        (vt, n2, dv): (*const u32, usize, usize),
        (pp, w): (*const u32, usize),
        out: *mut f32,
        alpha: &[V16],
    ) {
        assert!(n2.is_multiple_of(16) && dv.is_multiple_of(32));
        assert!(w.is_multiple_of(LANES) && w / LANES <= alpha.len());
        // SAFETY: every access is within the extents above.
        unsafe {
            let one = _mm512_set1_ps(1.0);
            let alpha = &alpha[..w / LANES];
            let ones = alpha
                .iter()
                .all(|a| _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(a.0, one) == 0xffff);
            if !ones {
                rescale(out, dv, alpha);
            }
            for c0 in (0..dv).step_by(32) {
                unit.mul(
                    (vt.add(c0 * n2).cast(), 4 * n2),
                    (pp.cast(), 4 * w),
                    n2 / 16,
                    (out.add(c0 * w), 4 * w),
                    w,
                    true,
                );
            }
        }
    }

    /// Multiplies the running output (`dv` rows of `alpha.len() * 16`
    /// floats) by each row's rescale factor.
    ///
    /// # Safety
    /// `out..out + dv * alpha.len() * 16` readable and writable; the CPU
    /// runs AVX-512 F.
    #[inline(always)]
    unsafe fn rescale(out: *mut f32, dv: usize, alpha: &[V16]) {
        let w = alpha.len() * LANES;
        for col in 0..dv {
            for (r, a) in alpha.iter().enumerate() {
                // SAFETY: col < dv and r < alpha.len(): 16 floats within the
                // caller's extent.
                unsafe {
                    let o = out.add(col * w + r * LANES);
                    (V16::load(o) * *a).store(o);
                }
            }
        }
    }

    /// The packed value pairs (`n2` rows of `dv` words, `vs` apart)
    /// transposed as words into `vt` (`dv` rows of `n2` words): row `c`
    /// holds column `c`'s bf16 along the keys, A's layout for the tile
    /// unit. Bit moves only.
    ///
    /// # Safety
    /// The extents above, `n2` and `dv` multiples of 16; the CPU runs
    /// AVX-512 F.
    #[inline(always)]
    unsafe fn transpose_words(
        (vp, vs): (*const u32, usize),
        (n2, dv): (usize, usize),
        vt: *mut u32,
    ) {
        assert!(n2.is_multiple_of(LANES) && dv.is_multiple_of(LANES));
        // SAFETY: every access is within the extents above.
        unsafe {
            for i0 in (0..n2).step_by(LANES) {
                for c0 in (0..dv).step_by(LANES) {
                    let blk: [V16; LANES] =
                        std::array::from_fn(|r| V16::load(vp.add((i0 + r) * vs + c0).cast()));
                    for (r, t) in V16::transpose16(blk).into_iter().enumerate() {
                        t.store(vt.add((c0 + r) * n2 + i0).cast());
                    }
                }
            }
        }
    }

    /// Whether every element of one contiguous row [`fits`](super::fits):
    /// 32 at a time (a test, a shift, a subtraction and a compare), any
    /// rest one by one.
    ///
    /// # Safety
    /// The CPU runs AVX-512 BW.
    #[inline(always)]
    unsafe fn row_fits(row: &[u16]) -> bool {
        let mut bad: __mmask32 = 0;
        let mut c = 0;
        while c + 32 <= row.len() {
            // SAFETY: c + 32 <= row.len(); the CPU runs AVX-512 BW (this
            // function's contract).
            unsafe { bad |= misfits(_mm512_loadu_si512(row.as_ptr().add(c).cast())) };
            c += 32;
        }
        bad == 0 && row[c..].iter().all(|&x| super::fits(x))
    }

    /// Whether every element of rows `j0..j0+m` of `rows` (`rs` apart, `d`
    /// elements each) [`fits`](super::fits), as [`rows_fit`] for rows
    /// already found contiguous (`typed_rows`).
    ///
    /// # Safety
    /// The CPU runs AVX-512 BW.
    #[inline(always)]
    unsafe fn slab_fits(rows: &[u16], rs: usize, (j0, m): (usize, usize), d: usize) -> bool {
        // (A loop, not a closure: a closure loses the level's features.)
        let mut fit = true;
        for j in j0..j0 + m {
            // SAFETY: the CPU runs AVX-512 BW (this function's contract).
            fit &= unsafe { row_fits(&rows[j * rs..j * rs + d]) };
        }
        fit
    }

    /// Whether every element of rows `j0..j0+n` (batch `b`, head `g`, `d`
    /// elements each) of a bf16 tensor [`fits`](super::fits) ([`row_fits`]
    /// on contiguous rows).
    ///
    /// # Safety
    /// The CPU runs AVX-512 BW.
    #[inline(always)]
    unsafe fn rows_fit(
        src: &[u16],
        view: &View,
        (b, g): (usize, usize),
        (j0, n): (usize, usize),
        d: usize,
    ) -> bool {
        for j in j0..j0 + n {
            let at = view.index([b, j, g, 0]);
            let fit = if view.strides[3] != 1 && d != 1 {
                (0..d).all(|c| super::fits(src[at + c * view.strides[3]]))
            } else {
                // SAFETY: the CPU runs AVX-512 BW (this function's contract).
                unsafe { row_fits(&src[at..at + d]) }
            };
            if !fit {
                return false;
            }
        }
        true
    }

    /// The lanes of 32 bf16 that do not [`fit`](super::fits).
    ///
    /// # Safety
    /// The CPU runs AVX-512 BW.
    #[inline(always)]
    pub(super) unsafe fn misfits(x: __m512i) -> __mmask32 {
        // SAFETY: forwarded.
        unsafe { misfits_in(x, super::FORWARD) }
    }

    /// The lanes of 32 bf16 that are neither 0 nor of a magnitude in `w`.
    ///
    /// # Safety
    /// The CPU runs AVX-512 BW.
    #[inline(always)]
    pub(super) unsafe fn misfits_in(x: __m512i, w: super::Window) -> __mmask32 {
        // SAFETY: the CPU runs AVX-512 BW (this function's contract).
        unsafe {
            let nonzero = _mm512_test_epi16_mask(x, _mm512_set1_epi16(0x7fff));
            let e = _mm512_and_si512(_mm512_srli_epi16::<7>(x), _mm512_set1_epi16(0xff));
            let off = _mm512_sub_epi16(e, _mm512_set1_epi16(w.lo as i16));
            nonzero & !_mm512_cmple_epu16_mask(off, _mm512_set1_epi16((w.hi - w.lo) as i16))
        }
    }

    /// Writes 16 rows of a block's bf16 output from its running output
    /// `O^T` (`ot` at the rows' first lane, column `c` at `ot + c * w`),
    /// row `i` times `f[i]`, to `dst[i]`: for each 32 columns within `dv`,
    /// the scaled columns are rounded to bf16 in pairs (`vcvtne2ps2bf16`,
    /// lane `i` holding row `i`'s pair), and one 16 x 16 transpose of words
    /// gives each row's 32 values. Half the shuffles of transposing floats
    /// and rounding each row after. It stops before the first 32 columns
    /// that hold a NaN or a subnormal, which that instruction rounds unlike
    /// the integer rounding of the other levels (`bf16::from_f32`), so
    /// results stay bitwise those of the f32 pass's write; returns the
    /// columns written.
    ///
    /// # Safety
    /// `ot + c * w + i` readable for `c < dv`, `i < 16`; `dst[i] + c`
    /// writable for `c < dv`; the CPU runs the `avx512bf16` level (AVX-512
    /// F, BW, DQ and BF16).
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
    pub unsafe fn write_rows_bf16(
        ot: *const f32,
        w: usize,
        f: &[f32; LANES],
        dst: &[*mut u16; LANES],
        dv: usize,
    ) -> usize {
        // SAFETY: every access is within the extents above; the CPU runs
        // the features enabled.
        unsafe {
            let fv = _mm512_loadu_ps(f.as_ptr());
            let mut c0 = 0;
            while c0 + 2 * LANES <= dv {
                let mut blk = [V16::ZERO; LANES];
                let mut odd: __mmask16 = 0;
                for (i, b) in blk.iter_mut().enumerate() {
                    let col = |c: usize| _mm512_mul_ps(_mm512_loadu_ps(ot.add(c * w)), fv);
                    let (x, y) = (col(c0 + 2 * i), col(c0 + 2 * i + 1));
                    // Quiet and signalling NaN, subnormal.
                    odd |= _mm512_fpclass_ps_mask::<0xa1>(x) | _mm512_fpclass_ps_mask::<0xa1>(y);
                    *b = V16(_mm512_castsi512_ps(super::kernels::interleave16(x, y)));
                }
                if odd != 0 {
                    break;
                }
                for (i, t) in V16::transpose16(blk).into_iter().enumerate() {
                    _mm512_storeu_ps(dst[i].add(c0).cast(), t.0);
                }
                c0 += 2 * LANES;
            }
            c0
        }
    }

    /// Rounds two vectors of probabilities (keys `2i` and `2i + 1`) to
    /// bf16 and stores them as 16 words, lane `r` holding row `r`'s pair.
    ///
    /// # Safety
    /// `p..p+16` writable; the CPU runs AVX-512 BW and BF16.
    #[inline(always)]
    unsafe fn store_pairs(p: *mut u32, e0: V16, e1: V16) {
        // SAFETY: forwarded from the caller. (A subnormal probability is
        // flushed to 0, within the bound's 2^-125 allowance.)
        unsafe { _mm512_storeu_si512(p.cast(), super::kernels::interleave16(e0.0, e1.0)) };
    }

    /// Packs the block's query rows into the pair panel at `qp` (`d2` rows
    /// of `w` words: word `e * w + r` holds row `r`'s elements `2e` and
    /// `2e + 1`); lanes past the block are zero. Sixteen rows at a time through
    /// 16 x 16 transposes of words (shuffles only: bit-exact). Returns
    /// whether every element [`fits`](super::fits).
    ///
    /// # Safety
    /// `qp..qp + d2 * w` writable; rows of Q contiguous; the CPU runs
    /// AVX-512 F.
    #[inline(always)]
    unsafe fn pack_q_pairs(
        q: &[u16],
        view: &View,
        item: &Item,
        (d2, w): (usize, usize),
        qp: *mut u32,
    ) -> bool {
        let n = item.rows();
        assert!(view.strides[3] == 1 && w.is_multiple_of(LANES));
        let mut bad: __mmask32 = 0;
        for r0 in (0..w).step_by(LANES) {
            let live = n.saturating_sub(r0).min(LANES);
            // Row i's d2 words (null past the block).
            let src: [*const u32; LANES] = std::array::from_fn(|i| {
                if i < live {
                    let (pos, h) = item.row(r0 + i);
                    let at = view.index([item.b, pos, h, 0]);
                    q[at..at + 2 * d2].as_ptr().cast::<u32>()
                } else {
                    std::ptr::null()
                }
            });
            let mut e0 = 0;
            while e0 + LANES <= d2 {
                let mut blk = [V16::ZERO; LANES];
                for (b, &s) in blk.iter_mut().zip(&src) {
                    if !s.is_null() {
                        // SAFETY: src[i] holds d2 words (unaligned loads)
                        // and e0 + 16 <= d2; the CPU runs AVX-512 BW.
                        unsafe {
                            *b = V16::load(s.add(e0).cast::<f32>());
                            bad |= misfits(_mm512_castps_si512(b.0));
                        }
                    }
                }
                for (i, t) in V16::transpose16(blk).into_iter().enumerate() {
                    // SAFETY: (e0 + i) * w + r0 + 16 <= d2 * w (the
                    // caller's extent).
                    unsafe { t.store(qp.add((e0 + i) * w + r0).cast::<f32>()) };
                }
                e0 += LANES;
            }
            for e in e0..d2 {
                for (i, &s) in src.iter().enumerate() {
                    // SAFETY: a non-null src[i] holds d2 words; e < d2; the
                    // panel holds d2 x w words.
                    unsafe {
                        let x = if s.is_null() {
                            0
                        } else {
                            s.add(e).read_unaligned()
                        };
                        if !(super::fits(x as u16) && super::fits((x >> 16) as u16)) {
                            bad = 1;
                        }
                        *qp.add(e * w + r0 + i) = x;
                    }
                }
            }
        }
        bad == 0
    }

    /// Packs pairs `pairs` of value rows `j0..j0+n` (batch `b`, head `g`):
    /// word `i * vs + c` holds `V[j0 + 2i][c]` (low half) and
    /// `V[j0 + 2i + 1][c]` (high half; 0 past the tile). Returns whether
    /// every value it packed [`fits`](super::fits).
    ///
    /// # Safety
    /// `vp..vp + ceil(n/2) * vs` writable, `vs >= d`; the CPU runs AVX-512
    /// F and BW.
    #[inline(always)]
    unsafe fn pack_v_pairs(
        v: &[u16],
        view: &View,
        (b, g): (usize, usize),
        (j0, n): (usize, usize),
        pairs: std::ops::Range<usize>,
        d: usize,
        (vp, vs): (*mut u32, usize),
    ) -> bool {
        let contiguous = view.strides[3] == 1 || d == 1;
        let elem = |j: usize, c: usize| v[view.index([b, j, g, 0]) + c * view.strides[3]];
        assert!(pairs.end <= n.div_ceil(2));
        let (mut bad, mut fit): (__mmask32, bool) = (0, true);
        for i in pairs {
            let (ja, jb) = (j0 + 2 * i, j0 + 2 * i + 1);
            let has_b = 2 * i + 1 < n;
            // SAFETY: row i of the packed tile (d <= vs words) is within the
            // caller's extent; the row loads read d elements of rows ja and
            // jb, which the views place inside `v`.
            unsafe {
                let dst = vp.add(i * vs);
                let mut c = 0;
                if contiguous {
                    let ra = v[view.index([b, ja, g, 0])..][..d].as_ptr();
                    let rb = if has_b {
                        v[view.index([b, jb, g, 0])..][..d].as_ptr()
                    } else {
                        std::ptr::null()
                    };
                    // Word 2l of `lo` takes a's element l, word 2l + 1 b's
                    // (index 32 + l picks the second operand); `hi` the
                    // same for elements 16..32.
                    let lo = _mm512_set_epi16(
                        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0,
                    );
                    let hi = _mm512_set_epi16(
                        63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                        22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16,
                    );
                    while c + 32 <= d {
                        let a = _mm512_loadu_si512(ra.add(c).cast());
                        let bb = if has_b {
                            _mm512_loadu_si512(rb.add(c).cast())
                        } else {
                            _mm512_setzero_si512()
                        };
                        bad |= misfits(a) | misfits(bb);
                        _mm512_storeu_si512(
                            dst.add(c).cast(),
                            _mm512_permutex2var_epi16(a, lo, bb),
                        );
                        _mm512_storeu_si512(
                            dst.add(c + 16).cast(),
                            _mm512_permutex2var_epi16(a, hi, bb),
                        );
                        c += 32;
                    }
                }
                for c in c..d {
                    let (ha, hb) = (elem(ja, c), if has_b { elem(jb, c) } else { 0 });
                    fit &= super::fits(ha) && super::fits(hb);
                    *dst.add(c) = ha as u32 | (hb as u32) << 16;
                }
            }
        }
        fit && bad == 0
    }
}
