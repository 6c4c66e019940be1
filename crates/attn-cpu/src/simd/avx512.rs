//! The AVX-512 level: a vector of 16 lanes is one 512-bit register (F, BW
//! and DQ, which every CPU with BW has; FMA, F16C and AVX2 come with them). Thirty-two registers: the
//! microkernels keep up to 24 accumulators on four vectors of rows.

// Index loops on purpose: they unroll in place, where iterator adaptors
// and `std::array::from_fn` may stay out of line.
#![allow(clippy::needless_range_loop)]

use super::{Isa, Op, Vector};
use attn_spec::{bf16, f16};
use std::arch::x86_64::*;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Sub, SubAssign};

/// Sixteen lanes in one AVX-512 register.
#[derive(Clone, Copy, Debug)]
#[repr(transparent)]
pub struct V16(pub(crate) __m512);

crate::microkernel::kernel_entries!(
    V16,
    [1 => 12, 2 => 12, 3 => 8, 4 => 6],
    "avx512f,avx512bw,avx512dq,avx2,fma,f16c";
    dot16: dot16_run_items
);
use crate::dot16::run_items as dot16_run_items;

/// Runs `op` compiled for this level.
///
/// # Safety
/// The CPU must run AVX-512 F, BW and DQ, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,fma,f16c")]
pub unsafe fn enter<O: Op>(op: O) -> O::Output {
    op.run::<V16>()
}

/// Applies a 512-bit intrinsic to the registers.
macro_rules! zmm {
    ($f:expr; $($a:expr),*) => {
        // SAFETY: a V16 exists only on CPUs with AVX-512 F, BW and DQ (the
        // `Vector` contract).
        unsafe { V16($f($($a.0),*)) }
    };
}

macro_rules! binary {
    ($tr:ident, $m:ident, $f:ident, $atr:ident, $am:ident) => {
        impl $tr for V16 {
            type Output = V16;
            #[inline(always)]
            fn $m(self, o: V16) -> V16 {
                zmm!($f; self, o)
            }
        }
        impl $atr for V16 {
            #[inline(always)]
            fn $am(&mut self, o: V16) {
                *self = zmm!($f; *self, o);
            }
        }
    };
}
binary!(Add, add, _mm512_add_ps, AddAssign, add_assign);
binary!(Sub, sub, _mm512_sub_ps, SubAssign, sub_assign);
binary!(Mul, mul, _mm512_mul_ps, MulAssign, mul_assign);

impl Div for V16 {
    type Output = V16;
    #[inline(always)]
    fn div(self, o: V16) -> V16 {
        zmm!(_mm512_div_ps; self, o)
    }
}

impl From<[f32; 16]> for V16 {
    #[inline(always)]
    fn from(a: [f32; 16]) -> V16 {
        // SAFETY: 16 readable f32 in `a`.
        unsafe { V16::load(a.as_ptr()) }
    }
}

/// The first two levels of [`Vector::reduce16`] and
/// [`Vector::reduce_quads`]: `u[i]` holds, per 128-bit lane, the in-lane
/// sums of vectors `4i..4i+4` (`(x0 + x2) + (x1 + x3)` of each lane's 4
/// floats): a 32-bit interleave then a 64-bit shuffle, each followed by an
/// add.
#[inline(always)]
fn in_lane_sums(m: &[V16; 16]) -> [__m512; 4] {
    // SAFETY: as in `zmm!`.
    unsafe {
        // t[i]: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3] of vectors
        // 2i, 2i+1.
        let mut t = [m[0].0; 8];
        for i in 0..8 {
            let (a, b) = (m[2 * i].0, m[2 * i + 1].0);
            t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        let mut u = [m[0].0; 4];
        for i in 0..4 {
            let (a, b) = (t[2 * i], t[2 * i + 1]);
            u[i] = _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(a, b),
                _mm512_shuffle_ps::<0xEE>(a, b),
            );
        }
        u
    }
}

/// `2^x` lane by lane with `2^r`, `r` in `[0, 1)`, the polynomial of
/// coefficients `c` (constant term first): `x = floor(x) + r` in one
/// `vreduceps` (exact), Horner's rule on FMAs, and `2^floor(x)` applied
/// by `vscalefps`, which floors x itself. Lanes at most -127 are zeroed by
/// the mask (as on every level); -inf (which reduces to 0) and NaN compare
/// as such; NaN stays NaN.
#[inline(always)]
fn exp2_on<const N: usize>(x: V16, c: &[f32; N]) -> V16 {
    // SAFETY: as in `zmm!`.
    unsafe {
        let keep = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(x.0, _mm512_set1_ps(-127.0));
        V16(_mm512_maskz_scalef_ps(keep, frac_pow2(x, c), x.0))
    }
}

/// [`exp2_on`] without the flush: results under 2^-126 come out subnormal
/// (or 0 below 2^-149) by `vscalefps`; `-inf` still gives 0 (`vreduceps`
/// takes it to 0, and `1 * 2^-inf = 0`) and NaN NaN.
#[inline(always)]
fn exp2_unflushed<const N: usize>(x: V16, c: &[f32; N]) -> V16 {
    // SAFETY: as in `zmm!`.
    unsafe { V16(_mm512_scalef_ps(frac_pow2(x, c), x.0)) }
}

/// `2^(x - floor(x))` by the polynomial `c` (constant term first).
#[inline(always)]
fn frac_pow2<const N: usize>(x: V16, c: &[f32; N]) -> __m512 {
    // SAFETY: as in `zmm!` (the level has AVX-512 DQ).
    unsafe {
        // Round down (01), exceptions suppressed (1000).
        let r = _mm512_reduce_ps::<0x09>(x.0);
        let mut p = _mm512_set1_ps(c[N - 1]);
        for &ci in c[..N - 1].iter().rev() {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ci));
        }
        p
    }
}

// SAFETY: every method executes AVX-512 F/BW/DQ, AVX2, FMA or F16C
// instructions only, which the CPU runs wherever a V16 exists
// (isa::vectorize checks).
unsafe impl Vector for V16 {
    const ISA: Isa = Isa::Avx512;
    // SAFETY: __m512 is 16 plain f32s; any bit pattern is valid.
    const ZERO: Self = unsafe { std::mem::transmute::<[f32; 16], V16>([0.0; 16]) };
    // SAFETY: as above.
    const ONE: Self = unsafe { std::mem::transmute::<[f32; 16], V16>([1.0; 16]) };
    const REGS_PER_VECTOR: usize = 1;
    const REGISTERS: usize = 32;
    const KERNEL_VECS: usize = 4;
    const QUAD: bool = true;

    #[inline(always)]
    fn mr(nv: usize) -> usize {
        // With 4 vectors of rows, 6 keys (24 accumulators of 32 registers)
        // cover the FMA latency (4 cycles x 2 pipes = 8 chains) three times
        // over and issue 6 broadcasts + 4 loads per 24 FMAs; with 1 or 2
        // vectors 12 keys, with 3 vectors 8 (24 accumulators each).
        match nv {
            1 | 2 => 12,
            3 => 8,
            _ => 6,
        }
    }
    // 16 accumulators of 32 registers, at least 8 independent FMA chains
    // to cover a 4-cycle latency on two pipes.
    const DECODE_GROUP: [usize; crate::decode::DECODE_ROWS] = [16, 8, 4, 4];
    // 8 or 16 accumulators: whole 128-column rows for 1-2 query rows, two
    // passes for 3-4.
    const DECODE_COLUMN_VECS: [usize; crate::decode::DECODE_ROWS] = [8, 8, 4, 4];
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: as in `zmm!`.
        unsafe { V16(_mm512_set1_ps(x)) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 16 readable f32 at `p`; the CPU
        // runs AVX-512F (the `Vector` contract).
        unsafe { V16(_mm512_loadu_ps(p)) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 16 writable f32 at `p`.
        unsafe { _mm512_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    unsafe fn load_quarters(at: [*const f32; 4]) -> Self {
        // SAFETY: four readable floats at each at[g] (the caller's
        // guarantee); the CPU runs AVX-512F.
        unsafe {
            let x = _mm512_castps128_ps512(_mm_loadu_ps(at[0]));
            let x = _mm512_insertf32x4::<1>(x, _mm_loadu_ps(at[1]));
            let x = _mm512_insertf32x4::<2>(x, _mm_loadu_ps(at[2]));
            V16(_mm512_insertf32x4::<3>(x, _mm_loadu_ps(at[3])))
        }
    }
    #[inline(always)]
    unsafe fn store_quarters(self, at: [*mut f32; 4]) {
        // SAFETY: four writable floats at each at[g] (the caller's
        // guarantee); the CPU runs AVX-512F.
        unsafe {
            _mm_storeu_ps(at[0], _mm512_castps512_ps128(self.0));
            _mm_storeu_ps(at[1], _mm512_extractf32x4_ps::<1>(self.0));
            _mm_storeu_ps(at[2], _mm512_extractf32x4_ps::<2>(self.0));
            _mm_storeu_ps(at[3], _mm512_extractf32x4_ps::<3>(self.0));
        }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> Self {
        // SAFETY: the caller guarantees 16 readable halves (32 bytes) at
        // `p`; vcvtph2ps on zmm is AVX-512F.
        unsafe { V16(_mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> Self {
        // SAFETY: the caller guarantees 16 readable elements (32 bytes) at
        // `p`. Zero-extended to 32 bits and shifted: bf16 is the top half
        // of an f32.
        unsafe {
            let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            V16(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(w)))
        }
    }
    #[inline(always)]
    unsafe fn store_bf16(self, p: *mut bf16) {
        // SAFETY: the caller guarantees 16 writable elements (32 bytes) at
        // `p`. Rounded in the integer unit: adding 0x7fff plus the bit
        // that is kept last rounds to nearest even at bit 16 (carrying into
        // the exponent, and to infinity); NaN lanes keep their top half with
        // the quiet bit set.
        unsafe {
            let x = _mm512_castps_si512(self.0);
            let top = _mm512_srli_epi32::<16>(x);
            let lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
            let up = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb);
            let nan = _mm512_cmpgt_epi32_mask(
                _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff)),
                _mm512_set1_epi32(0x7f80_0000),
            );
            let quiet = _mm512_or_si512(top, _mm512_set1_epi32(0x40));
            let r = _mm512_mask_mov_epi32(_mm512_srli_epi32::<16>(up), nan, quiet);
            _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(r));
        }
    }
    #[inline(always)]
    unsafe fn load4x4<E: attn_spec::Element>(p: *const E) -> Self {
        // SAFETY: the caller guarantees 4 readable elements at `p` (16
        // bytes of f32, 8 of f16 or bf16); the CPU runs AVX-512 F and BW.
        unsafe {
            match E::DTYPE {
                attn_spec::DType::F32 => V16(_mm512_broadcast_f32x4(_mm_loadu_ps(p as *const f32))),
                attn_spec::DType::F16 => {
                    // The 8 bytes repeated into 32, converted as 16 halves.
                    let x = (p as *const i64).read_unaligned();
                    V16(_mm512_cvtph_ps(_mm256_set1_epi64x(x)))
                }
                attn_spec::DType::Bf16 => {
                    // The 8 bytes repeated into every quarter, interleaved
                    // below zero words: each bf16 lands in the top half of
                    // a 32-bit lane, which is its f32.
                    let x = _mm512_set1_epi64((p as *const i64).read_unaligned());
                    V16(_mm512_castsi512_ps(_mm512_unpacklo_epi16(
                        _mm512_setzero_si512(),
                        x,
                    )))
                }
                _ => {
                    let mut x = [0.0f32; 16];
                    for (l, y) in x.iter_mut().enumerate() {
                        *y = (*p.add(l % 4)).to_f32();
                    }
                    V16::from(x)
                }
            }
        }
    }
    #[inline(always)]
    fn to_array(self) -> [f32; 16] {
        let mut a = [0.0f32; 16];
        // SAFETY: 16 writable f32 in `a`.
        unsafe { self.store(a.as_mut_ptr()) };
        a
    }
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        zmm!(_mm512_fmadd_ps; self, a, b)
    }
    #[inline(always)]
    fn fast_max(self, rhs: Self) -> Self {
        zmm!(_mm512_max_ps; self, rhs)
    }
    #[inline(always)]
    fn abs(self) -> Self {
        zmm!(_mm512_abs_ps; self)
    }
    #[inline(always)]
    fn copysign(self, sign: Self) -> Self {
        // SAFETY: as in `zmm!`.
        unsafe {
            let s = _mm512_set1_epi32(i32::MIN);
            let mag = _mm512_andnot_si512(s, _mm512_castps_si512(self.0));
            let sg = _mm512_and_si512(s, _mm512_castps_si512(sign.0));
            V16(_mm512_castsi512_ps(_mm512_or_si512(mag, sg)))
        }
    }
    #[inline(always)]
    fn round_pow2(self) -> (Self, Self) {
        // SAFETY: as in `zmm!`. cvtps_epi32 rounds by MXCSR: to nearest,
        // ties to even, unless a caller changed it (Rust code never does).
        unsafe {
            let n = _mm512_cvtps_epi32(self.0);
            let p = _mm512_slli_epi32::<23>(_mm512_add_epi32(n, _mm512_set1_epi32(127)));
            (V16(_mm512_cvtepi32_ps(n)), V16(_mm512_castsi512_ps(p)))
        }
    }
    #[inline(always)]
    fn exp2(self) -> Self {
        // x = floor(x) + r with r in [0, 1) in one `vreduceps` (exact),
        // `2^r` by the polynomial fitted on [0, 1) (`exp::C01`), and
        // `2^floor(x)` applied by `vscalefps`, which floors x itself: a
        // compare, a reduction, five FMAs and a scale (a round to nearest
        // and a subtraction would take the reduction's place with the
        // polynomial of `exp::exp2_by_bits`).
        exp2_on(self, &crate::exp::C01)
    }
    #[inline(always)]
    fn exp2_coarse(self) -> Self {
        // As `exp2`, with the degree-3 polynomial (`exp::C01_COARSE`):
        // two FMAs fewer.
        exp2_on(self, &crate::exp::C01_COARSE)
    }
    #[inline(always)]
    fn exp2_unflushed(self) -> Self {
        exp2_unflushed(self, &crate::exp::C01)
    }
    #[inline(always)]
    fn exp2_coarse_unflushed(self) -> Self {
        // Without the compare of the flush: on Zen 4 the softmax's pairs
        // of the bf16 pass ran 7% faster (a throwaway loop, with the
        // shift subtracted by FMA).
        exp2_unflushed(self, &crate::exp::C01_COARSE)
    }
    #[inline(always)]
    fn replace_where_eq(self, key: Self, eq: f32, with: f32) -> Self {
        // SAFETY: as in `zmm!`.
        unsafe {
            let k = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(key.0, _mm512_set1_ps(eq));
            V16(_mm512_mask_blend_ps(k, self.0, _mm512_set1_ps(with)))
        }
    }
    #[inline(always)]
    fn select_lt(self, bound: f32, then: Self, other: Self) -> Self {
        // SAFETY: as in `zmm!`.
        unsafe {
            let k = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, _mm512_set1_ps(bound));
            V16(_mm512_mask_blend_ps(k, other.0, then.0))
        }
    }
    #[inline(always)]
    fn fill_outside(self, j: i32, lo: &[i32; 16], hi: &[i32; 16], fill: f32) -> Self {
        // SAFETY: as in `zmm!`; lo and hi hold 16 i32 each.
        unsafe {
            let jv = _mm512_set1_epi32(j);
            let l = _mm512_loadu_si512(lo.as_ptr() as *const __m512i);
            let h = _mm512_loadu_si512(hi.as_ptr() as *const __m512i);
            // Inside: hi > j and not lo > j.
            let inside = _mm512_cmpgt_epi32_mask(h, jv) & !_mm512_cmpgt_epi32_mask(l, jv);
            V16(_mm512_mask_blend_ps(inside, _mm512_set1_ps(fill), self.0))
        }
    }
    #[inline(always)]
    fn any_nan(self) -> bool {
        // SAFETY: as in `zmm!`.
        unsafe { _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(self.0, self.0) != 0 }
    }
    #[inline(always)]
    fn reduce_add(self) -> f32 {
        // SAFETY: as in `zmm!`.
        unsafe { _mm512_reduce_add_ps(self.0) }
    }
    #[inline(always)]
    fn transpose16(m: [Self; 16]) -> [Self; 16] {
        // 64 in-register shuffles: unpack, then 32-bit, 128-bit lane
        // shuffles twice.
        // SAFETY: as in `zmm!`.
        unsafe {
            let mut r = [m[0].0; 16];
            for i in 0..16 {
                r[i] = m[i].0;
            }
            let mut t = r;
            for i in 0..8 {
                t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            let mut u = r;
            for g in 0..4 {
                let b = 4 * g;
                u[b] = _mm512_shuffle_ps::<0x44>(t[b], t[b + 2]);
                u[b + 1] = _mm512_shuffle_ps::<0xEE>(t[b], t[b + 2]);
                u[b + 2] = _mm512_shuffle_ps::<0x44>(t[b + 1], t[b + 3]);
                u[b + 3] = _mm512_shuffle_ps::<0xEE>(t[b + 1], t[b + 3]);
            }
            let mut w = r;
            for i in 0..4 {
                w[i] = _mm512_shuffle_f32x4::<0x88>(u[i], u[i + 4]);
                w[i + 4] = _mm512_shuffle_f32x4::<0xDD>(u[i], u[i + 4]);
                w[i + 8] = _mm512_shuffle_f32x4::<0x88>(u[i + 8], u[i + 12]);
                w[i + 12] = _mm512_shuffle_f32x4::<0xDD>(u[i + 8], u[i + 12]);
            }
            let mut o = m;
            for i in 0..8 {
                o[i] = V16(_mm512_shuffle_f32x4::<0x88>(w[i], w[i + 8]));
                o[i + 8] = V16(_mm512_shuffle_f32x4::<0xDD>(w[i], w[i + 8]));
            }
            o
        }
    }
    #[inline(always)]
    fn reduce16(m: &[Self; 16]) -> Self {
        // A transpose-and-add tree: 45 shuffles and adds for all sixteen.
        let u = in_lane_sums(m);
        // SAFETY: as in `zmm!`.
        unsafe {
            // w[i]: keys 8i..8i+4 in lanes 0 and 1 (two partial sums each),
            // keys 8i+4..8i+8 in lanes 2 and 3.
            let mut w = [u[0]; 2];
            for i in 0..2 {
                let (a, b) = (u[2 * i], u[2 * i + 1]);
                w[i] = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x88>(a, b),
                    _mm512_shuffle_f32x4::<0xDD>(a, b),
                );
            }
            V16(_mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(w[0], w[1]),
                _mm512_shuffle_f32x4::<0xDD>(w[0], w[1]),
            ))
        }
    }
    #[inline(always)]
    fn reduce_quads(m: &[Self; 16]) -> [Self; 4] {
        // u[i], lane r: row r's sums of keys 4i..4i+4; then a 4 x 4
        // transpose of 128-bit lanes gathers each row's 16 keys.
        let u = in_lane_sums(m);
        // SAFETY: as in `zmm!`.
        unsafe {
            let x0 = _mm512_shuffle_f32x4::<0x44>(u[0], u[1]);
            let x1 = _mm512_shuffle_f32x4::<0xEE>(u[0], u[1]);
            let y0 = _mm512_shuffle_f32x4::<0x44>(u[2], u[3]);
            let y1 = _mm512_shuffle_f32x4::<0xEE>(u[2], u[3]);
            [
                V16(_mm512_shuffle_f32x4::<0x88>(x0, y0)),
                V16(_mm512_shuffle_f32x4::<0xDD>(x0, y0)),
                V16(_mm512_shuffle_f32x4::<0x88>(x1, y1)),
                V16(_mm512_shuffle_f32x4::<0xDD>(x1, y1)),
            ]
        }
    }
}
