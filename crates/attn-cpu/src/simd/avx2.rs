//! The AVX2 level: a vector of 16 lanes is two 256-bit registers, with
//! FMA and F16C. Sixteen registers hold eight vectors, so the
//! microkernels work on one vector of rows per call
//! ([`Vector::KERNEL_VECS`]): 6 keys x 2 registers = 12 accumulators, 2
//! registers of the streamed operand and a broadcast, the shape of the
//! classic 6 x 16 AVX2 sgemm kernel (3 keys x 2 vectors needs 17 registers
//! and spilled three accumulators in its inner loop).

// Index loops on purpose: they unroll in place, where iterator adaptors
// and `std::array::from_fn` may stay out of line.
#![allow(clippy::needless_range_loop)]

use super::{Isa, Op, Vector};
use attn_spec::{bf16, f16};
use std::arch::x86_64::*;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Sub, SubAssign};

/// Sixteen lanes in two AVX registers (lanes 0-7, lanes 8-15).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct V16(__m256, __m256);

crate::microkernel::kernel_entries!(V16, [1 => 6], "avx2,fma,f16c");

/// Runs `op` compiled for this level.
///
/// # Safety
/// The CPU must run AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn enter<O: Op>(op: O) -> O::Output {
    op.run::<V16>()
}

/// Applies a 256-bit intrinsic to both halves.
macro_rules! both {
    ($f:expr; $($a:expr),*) => {
        // SAFETY: a V16 exists only on CPUs with AVX2, FMA and F16C (the
        // `Vector` contract).
        unsafe { V16($f($($a.0),*), $f($($a.1),*)) }
    };
}

macro_rules! binary {
    ($tr:ident, $m:ident, $f:ident, $atr:ident, $am:ident) => {
        impl $tr for V16 {
            type Output = V16;
            #[inline(always)]
            fn $m(self, o: V16) -> V16 {
                both!($f; self, o)
            }
        }
        impl $atr for V16 {
            #[inline(always)]
            fn $am(&mut self, o: V16) {
                *self = both!($f; *self, o);
            }
        }
    };
}
binary!(Add, add, _mm256_add_ps, AddAssign, add_assign);
binary!(Sub, sub, _mm256_sub_ps, SubAssign, sub_assign);
binary!(Mul, mul, _mm256_mul_ps, MulAssign, mul_assign);

impl Div for V16 {
    type Output = V16;
    #[inline(always)]
    fn div(self, o: V16) -> V16 {
        both!(_mm256_div_ps; self, o)
    }
}

impl From<[f32; 16]> for V16 {
    #[inline(always)]
    fn from(a: [f32; 16]) -> V16 {
        // SAFETY: 16 readable f32 in `a`.
        unsafe { V16::load(a.as_ptr()) }
    }
}

/// A 16 x 16 bit pattern as two 256-bit integer vectors.
#[inline(always)]
fn splat_i(x: i32) -> V16 {
    // SAFETY: as in `both!`.
    unsafe {
        let v = _mm256_castsi256_ps(_mm256_set1_epi32(x));
        V16(v, v)
    }
}

/// The 8 x 8 transpose of eight registers (row `i` in `r[i]`). Plain
/// loops, which unroll into the caller (`std::array::from_fn` may stay out
/// of line, and vector code out of line loses the level's features).
#[inline(always)]
fn transpose8(r: &[__m256; 8]) -> [__m256; 8] {
    // SAFETY: as in `both!`.
    unsafe {
        let mut t = *r;
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // u[4g + k], per 128-bit lane: column k (of that lane's four) of
        // rows 4g..4g+4.
        let mut u = t;
        for b in [0, 4] {
            u[b] = _mm256_shuffle_ps::<0x44>(t[b], t[b + 2]);
            u[b + 1] = _mm256_shuffle_ps::<0xEE>(t[b], t[b + 2]);
            u[b + 2] = _mm256_shuffle_ps::<0x44>(t[b + 1], t[b + 3]);
            u[b + 3] = _mm256_shuffle_ps::<0xEE>(t[b + 1], t[b + 3]);
        }
        let mut o = u;
        for j in 0..4 {
            o[j] = _mm256_permute2f128_ps::<0x20>(u[j], u[j + 4]);
            o[j + 4] = _mm256_permute2f128_ps::<0x31>(u[j], u[j + 4]);
        }
        o
    }
}

/// Lane `i` = the sum of the lanes of `s[i]` (8 registers).
#[inline(always)]
fn reduce8(s: &[__m256]) -> __m256 {
    // SAFETY: as in `both!`.
    unsafe {
        let h01 = _mm256_hadd_ps(s[0], s[1]);
        let h23 = _mm256_hadd_ps(s[2], s[3]);
        let h45 = _mm256_hadd_ps(s[4], s[5]);
        let h67 = _mm256_hadd_ps(s[6], s[7]);
        // Per 128-bit lane: the half-sums of vectors 0-3 (then 4-7).
        let a = _mm256_hadd_ps(h01, h23);
        let b = _mm256_hadd_ps(h45, h67);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    }
}

// SAFETY: every method executes AVX, AVX2, FMA or F16C instructions only,
// which the CPU runs wherever a V16 exists (isa::vectorize checks).
unsafe impl Vector for V16 {
    const ISA: Isa = Isa::Avx2;
    // SAFETY: __m256 is 8 plain f32s; any bit pattern is valid.
    const ZERO: Self = unsafe { std::mem::transmute::<[f32; 16], V16>([0.0; 16]) };
    // SAFETY: as above.
    const ONE: Self = unsafe { std::mem::transmute::<[f32; 16], V16>([1.0; 16]) };
    const REGS_PER_VECTOR: usize = 2;
    const REGISTERS: usize = 16;
    const KERNEL_VECS: usize = 1;
    const QUAD: bool = false;

    #[inline(always)]
    fn mr(_nv: usize) -> usize {
        // 12 of 16 registers in accumulators: 6 keys x 1 vector.
        6
    }
    // Up to 16 registers of accumulators (2 per vector). Measured (Zen
    // 3, GQA 32:8 d = 128, 32768 keys, 1 thread, `perf` example): 2 keys
    // for 4 rows ran at 14.5-17.5 GFLOP/s, 1 key (8 registers, no spill)
    // at 8.9-13.7; more keys no faster.
    const DECODE_GROUP: [usize; crate::decode::DECODE_ROWS] = [8, 4, 2, 2];
    // Whole 128-column rows in one pass, though 4 rows x 8 vectors of
    // accumulators spill: the pass over the tile's value rows, read from
    // L2, costs more than the spills (measured as above: 8 vectors
    // 16.9-17.5 GFLOP/s, 4 vectors 13.7-15.5, 1 vector 8.9-12.0).
    const DECODE_COLUMN_VECS: [usize; crate::decode::DECODE_ROWS] = [8; 4];
    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: as in `both!`.
        unsafe {
            let v = _mm256_set1_ps(x);
            V16(v, v)
        }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 16 readable f32 at `p`; the CPU
        // runs AVX (the `Vector` contract).
        unsafe { V16(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 16 writable f32 at `p`.
        unsafe {
            _mm256_storeu_ps(p, self.0);
            _mm256_storeu_ps(p.add(8), self.1);
        }
    }
    #[inline(always)]
    unsafe fn load_quarters(at: [*const f32; 4]) -> Self {
        // SAFETY: four readable floats at each at[g] (the caller's
        // guarantee); the CPU runs AVX.
        unsafe {
            let half = |a: *const f32, b: *const f32| {
                _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(_mm_loadu_ps(a)), _mm_loadu_ps(b))
            };
            V16(half(at[0], at[1]), half(at[2], at[3]))
        }
    }
    #[inline(always)]
    unsafe fn store_quarters(self, at: [*mut f32; 4]) {
        // SAFETY: four writable floats at each at[g] (the caller's
        // guarantee); the CPU runs AVX.
        unsafe {
            _mm_storeu_ps(at[0], _mm256_castps256_ps128(self.0));
            _mm_storeu_ps(at[1], _mm256_extractf128_ps::<1>(self.0));
            _mm_storeu_ps(at[2], _mm256_castps256_ps128(self.1));
            _mm_storeu_ps(at[3], _mm256_extractf128_ps::<1>(self.1));
        }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> Self {
        // SAFETY: the caller guarantees 16 readable halves (32 bytes) at
        // `p`; the CPU runs F16C.
        unsafe {
            let p = p as *const __m128i;
            V16(
                _mm256_cvtph_ps(_mm_loadu_si128(p)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            )
        }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> Self {
        // SAFETY: the caller guarantees 16 readable elements (32 bytes) at
        // `p`; the CPU runs AVX2. Zero-extended to 32 bits and shifted:
        // bf16 is the top half of an f32.
        unsafe {
            let p = p as *const __m128i;
            let w =
                |x: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(x)));
            V16(w(_mm_loadu_si128(p)), w(_mm_loadu_si128(p.add(1))))
        }
    }
    #[inline(always)]
    unsafe fn store_bf16(self, p: *mut bf16) {
        // SAFETY: the caller guarantees 16 writable elements (32 bytes) at
        // `p`; the CPU runs AVX2. Each half rounded (`round_bf16`), then packed to 16 bits (the values fit: no
        // saturation) and the 64-bit quarters put back in order.
        unsafe {
            let packed = _mm256_packus_epi32(round_bf16(self.0), round_bf16(self.1));
            let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
            _mm256_storeu_si256(p.cast(), ordered);
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
        both!(_mm256_fmadd_ps; self, a, b)
    }
    #[inline(always)]
    fn fast_max(self, rhs: Self) -> Self {
        both!(_mm256_max_ps; self, rhs)
    }
    #[inline(always)]
    fn abs(self) -> Self {
        let m = splat_i(0x7fff_ffff);
        both!(_mm256_and_ps; self, m)
    }
    #[inline(always)]
    fn copysign(self, sign: Self) -> Self {
        let s = splat_i(i32::MIN);
        let mag = both!(_mm256_andnot_ps; s, self);
        let sg = both!(_mm256_and_ps; sign, s);
        both!(_mm256_or_ps; mag, sg)
    }
    #[inline(always)]
    fn round_pow2(self) -> (Self, Self) {
        // SAFETY: as in `both!`. cvtps_epi32 rounds by MXCSR: to nearest,
        // ties to even, unless a caller changed it (Rust code never does).
        unsafe {
            let half = |x: __m256| {
                let n = _mm256_cvtps_epi32(x);
                let p = _mm256_slli_epi32::<23>(_mm256_add_epi32(n, _mm256_set1_epi32(127)));
                (_mm256_cvtepi32_ps(n), _mm256_castsi256_ps(p))
            };
            let (a, b) = (half(self.0), half(self.1));
            (V16(a.0, b.0), V16(a.1, b.1))
        }
    }
    #[inline(always)]
    fn replace_where_eq(self, key: Self, eq: f32, with: f32) -> Self {
        let (e, w) = (Self::splat(eq), Self::splat(with));
        let m = both!(_mm256_cmp_ps::<_CMP_EQ_OQ>; key, e);
        both!(_mm256_blendv_ps; self, w, m)
    }
    #[inline(always)]
    fn select_lt(self, bound: f32, then: Self, other: Self) -> Self {
        let b = Self::splat(bound);
        let m = both!(_mm256_cmp_ps::<_CMP_LT_OQ>; self, b);
        both!(_mm256_blendv_ps; other, then, m)
    }
    #[inline(always)]
    fn fill_outside(self, j: i32, lo: &[i32; 16], hi: &[i32; 16], fill: f32) -> Self {
        // SAFETY: as in `both!`; lo and hi hold 16 i32 each.
        unsafe {
            let jv = _mm256_set1_epi32(j);
            let f = _mm256_set1_ps(fill);
            let half = |x: __m256, at: usize| {
                let l = _mm256_loadu_si256(lo.as_ptr().add(at) as *const __m256i);
                let h = _mm256_loadu_si256(hi.as_ptr().add(at) as *const __m256i);
                // Inside: not lo > j, and hi > j.
                let inside =
                    _mm256_andnot_si256(_mm256_cmpgt_epi32(l, jv), _mm256_cmpgt_epi32(h, jv));
                _mm256_blendv_ps(f, x, _mm256_castsi256_ps(inside))
            };
            V16(half(self.0, 0), half(self.1, 8))
        }
    }
    #[inline(always)]
    fn any_nan(self) -> bool {
        let m = both!(_mm256_cmp_ps::<_CMP_UNORD_Q>; self, self);
        // SAFETY: as in `both!`.
        unsafe { _mm256_movemask_ps(_mm256_or_ps(m.0, m.1)) != 0 }
    }
    #[inline(always)]
    fn reduce_add(self) -> f32 {
        // SAFETY: as in `both!`.
        unsafe {
            let s = _mm256_add_ps(self.0, self.1);
            let q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
            let h = _mm_add_ps(q, _mm_movehl_ps(q, q));
            _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h)))
        }
    }
    #[inline(always)]
    fn transpose16(m: [Self; 16]) -> [Self; 16] {
        // Four 8 x 8 blocks: out row j < 8 is (block 00 col j, block 10
        // col j); out row 8 + j is (block 01 col j, block 11 col j).
        let mut q = [[m[0].0; 8]; 4];
        for i in 0..8 {
            q[0][i] = m[i].0;
            q[1][i] = m[i].1;
            q[2][i] = m[8 + i].0;
            q[3][i] = m[8 + i].1;
        }
        let [a, b, c, d] = [
            transpose8(&q[0]),
            transpose8(&q[1]),
            transpose8(&q[2]),
            transpose8(&q[3]),
        ];
        let mut o = m;
        for j in 0..8 {
            o[j] = V16(a[j], c[j]);
            o[8 + j] = V16(b[j], d[j]);
        }
        o
    }
    #[inline(always)]
    fn reduce16(m: &[Self; 16]) -> Self {
        let mut s = [m[0].0; 16];
        for i in 0..16 {
            // SAFETY: as in `both!`.
            s[i] = unsafe { _mm256_add_ps(m[i].0, m[i].1) };
        }
        V16(reduce8(&s[..8]), reduce8(&s[8..]))
    }
}

/// Eight f32 rounded to bf16 as `bf16::from_f32` does, each in the low 16
/// bits of its lane: adding 0x7fff plus the bit that is kept last rounds to
/// nearest even at bit 16 (carrying into the exponent, and to infinity);
/// NaN lanes keep their top half with the quiet bit set.
#[inline(always)]
fn round_bf16(v: __m256) -> __m256i {
    // SAFETY: a V16 of this level exists only on CPUs with AVX2 (the
    // `Vector` contract), whose code this inlines into.
    unsafe {
        let x = _mm256_castps_si256(v);
        let top = _mm256_srli_epi32::<16>(x);
        let lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
        let up = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
        let nan = _mm256_cmpgt_epi32(
            _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff)),
            _mm256_set1_epi32(0x7f80_0000),
        );
        let quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
        _mm256_blendv_epi8(_mm256_srli_epi32::<16>(up), quiet, nan)
    }
}
