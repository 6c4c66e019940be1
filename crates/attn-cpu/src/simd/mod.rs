//! The vector vocabulary of the kernels: [`Vector`], sixteen f32 lanes,
//! with one implementation per instruction-set level ([`Isa`]), chosen at
//! run time.
//!
//! The kernels are written once, generic over `V: Vector`, and compiled
//! per level inside that level's `#[target_feature]` entry
//! ([`isa::vectorize`]): `portable.rs` (`wide`'s `f32x16`, the target's
//! baseline: SSE2 on x86-64, NEON on aarch64), `avx2.rs` (two 256-bit
//! registers per vector, FMA, F16C) and `avx512.rs` (one 512-bit
//! register). Every level has sixteen lanes, so tiling, packing and the
//! masks are the same code on all of them; what differs is the register
//! budget, which sets the microkernels' shapes ([`Vector::mr`],
//! [`Vector::KERNEL_VECS`]) and the decode kernels' groups.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub mod isa;
pub(crate) mod portable;

pub use isa::{vectorize, Isa, Op};

use crate::decode::DecodeState;
use crate::element::CpuElement;
use crate::softmax::OnlineSoftmax;
use crate::tiling::Ctx;
use crate::work::Item;
use crate::workspace::Workspace;
use attn_spec::{bf16, f16, TileClass};
use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Sub, SubAssign};

/// Sixteen f32 lanes and the operations the kernels need on them.
///
/// # Safety
/// An implementation executes its level's instructions: a value of the
/// type may only be made on a CPU that runs that level. attn-cpu makes
/// vectors only inside [`vectorize`] (which checks the level) and in tests
/// that check it first; the trait is private to the crate.
///
/// Lane semantics every implementation keeps (the kernels rely on them):
/// `fast_max(a, b)` returns `b` where either lane is NaN (the x86 `max`),
/// `mul_add` may round once (FMA) or twice (the portable level on a
/// target without FMA), [`Vector::round_pow2`] rounds to nearest, ties to
/// even.
pub unsafe trait Vector:
    Copy
    + Send
    + Sync
    + Debug
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + From<[f32; 16]>
    + Kernels
{
    /// The level this type belongs to.
    const ISA: Isa;
    /// All lanes 0.
    const ZERO: Self;
    /// All lanes 1.
    const ONE: Self;
    /// Machine registers one vector occupies.
    const REGS_PER_VECTOR: usize;
    /// Vector registers of the level.
    const REGISTERS: usize;
    /// Most vectors of rows one score or value microkernel call covers
    /// (`microkernel::scores_vecs` splits wider blocks into such calls).
    const KERNEL_VECS: usize;
    /// Whether the decode path's 4-rows-per-vector score kernel
    /// (`microkernel::decode::scores_quad`) pays on this level: it needs a
    /// cheap broadcast of 4 elements and a cheap [`Vector::reduce_quads`].
    const QUAD: bool;

    /// Keys whose dot products the decode score kernel
    /// (`microkernel::decode::scores`) runs together for `r` query rows,
    /// at index `r - 1`: `r x G` accumulators, `G` in 1, 2, 4, 8, 16. A
    /// constant, read in `const` blocks, so that only the chosen `G` is
    /// compiled (a run-time choice compiled all five for every level,
    /// element and `r`: a sixth of attn-cpu's build).
    const DECODE_GROUP: [usize; crate::decode::DECODE_ROWS];
    /// Vectors of value columns the decode path's `P V`
    /// (`microkernel::decode::accumulate`) keeps per row for `r` rows, at
    /// index `r - 1`: 1, 2, 4 or 8 (each pass over a tile's value rows
    /// reads this many vectors of each row). A constant, as above.
    const DECODE_COLUMN_VECS: [usize; crate::decode::DECODE_ROWS];
    /// Keys (scores) or value columns (`P V`) per microkernel call on
    /// `nv <= KERNEL_VECS` vectors of rows: `mr(nv) x nv` accumulators fit
    /// the level's registers beside the operands.
    fn mr(nv: usize) -> usize;
    /// All lanes `x`.
    fn splat(x: f32) -> Self;
    /// Loads 16 f32 from `p` (unaligned).
    ///
    /// # Safety
    /// `p..p+16` must be readable f32s.
    unsafe fn load(p: *const f32) -> Self;
    /// Stores the lanes to `p` (unaligned).
    ///
    /// # Safety
    /// `p..p+16` must be writable f32s.
    unsafe fn store(self, p: *mut f32);
    /// Loads lanes `4g..4g + 4` from `at[g]` (unaligned): a vector of a
    /// row's columns built from pieces, such as the one that wraps round
    /// past the row's end, so that no load crosses a cache line of a
    /// 16-byte aligned row. Piece by piece by default.
    ///
    /// # Safety
    /// `at[g]..at[g] + 4` must be readable f32s for each `g`.
    #[inline(always)]
    unsafe fn load_quarters(at: [*const f32; 4]) -> Self {
        let mut x = [0.0; 16];
        for (g, &p) in at.iter().enumerate() {
            // SAFETY: four readable floats at p (the caller's guarantee).
            x[4 * g..4 * g + 4]
                .copy_from_slice(&unsafe { (p as *const [f32; 4]).read_unaligned() });
        }
        Self::from(x)
    }
    /// Stores lanes `4g..4g + 4` at `at[g]` (unaligned), as
    /// [`Vector::load_quarters`] reads them. Piece by piece by default.
    ///
    /// # Safety
    /// `at[g]..at[g] + 4` must be writable f32s for each `g`.
    #[inline(always)]
    unsafe fn store_quarters(self, at: [*mut f32; 4]) {
        let x = self.to_array();
        for (g, &p) in at.iter().enumerate() {
            let q: [f32; 4] = std::array::from_fn(|i| x[4 * g + i]);
            // SAFETY: four writable floats at p (the caller's guarantee).
            unsafe { (p as *mut [f32; 4]).write_unaligned(q) };
        }
    }
    /// Loads 16 f16 from `p` (unaligned), widened exactly.
    ///
    /// # Safety
    /// `p..p+16` must be readable.
    unsafe fn load_f16(p: *const f16) -> Self;
    /// Loads 16 bf16 from `p` (unaligned), widened exactly.
    ///
    /// # Safety
    /// `p..p+16` must be readable.
    unsafe fn load_bf16(p: *const bf16) -> Self;
    /// Rounds each lane to bf16 exactly as `bf16::from_f32` does (to
    /// nearest, ties to even; overflow to infinity; NaN kept, quieted) and
    /// stores the 16 results at `p` (unaligned). One by one by default.
    ///
    /// # Safety
    /// `p..p+16` must be writable.
    #[inline(always)]
    unsafe fn store_bf16(self, p: *mut bf16) {
        for (i, x) in self.to_array().into_iter().enumerate() {
            // SAFETY: i < 16 and the caller's guarantee.
            unsafe { p.add(i).write_unaligned(bf16::from_f32(x)) };
        }
    }
    /// Loads 4 elements at `p`, widened and repeated in each quarter of
    /// the vector (`[x0, x1, x2, x3, x0, ..]`). One by one by default.
    ///
    /// # Safety
    /// `p..p+4` must be readable.
    #[inline(always)]
    unsafe fn load4x4<E: attn_spec::Element>(p: *const E) -> Self {
        // SAFETY: the caller guarantees 4 readable elements at `p`.
        let x: [f32; 4] = std::array::from_fn(|i| unsafe { *p.add(i) }.to_f32());
        Self::from(std::array::from_fn(|l| x[l % 4]))
    }
    /// The lanes as an array.
    fn to_array(self) -> [f32; 16];
    /// `self * a + b`.
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// Lane-wise maximum; `rhs` where either lane is NaN.
    fn fast_max(self, rhs: Self) -> Self;
    /// Lane-wise `|x|`.
    fn abs(self) -> Self;
    /// `|self|` with the sign of `sign`.
    fn copysign(self, sign: Self) -> Self;
    /// `(n, 2^n)` for `n` = each lane rounded to the nearest integer (ties
    /// to even); lanes must lie in `[-127, 127]` or be NaN (then `n` is
    /// unspecified and the caller's result NaN through the fraction).
    fn round_pow2(self) -> (Self, Self);
    /// `2^self` lane by lane, as [`crate::exp::exp2`] documents it; a
    /// level may compute it with instructions of its own (AVX-512's
    /// `vscalefps`) as long as it keeps that contract.
    #[inline(always)]
    fn exp2(self) -> Self {
        crate::exp::exp2_by_bits(self)
    }
    /// `2^self` lane by lane within 2^-13 (`crate::exp`'s coarse exponential)
    /// instead of [`Vector::exp2`]'s 2^-20, for probabilities rounded to
    /// bf16 before they multiply V (`crate::exp` says why that is enough);
    /// the same special values. A level without a cheaper one computes
    /// [`Vector::exp2`].
    #[inline(always)]
    fn exp2_coarse(self) -> Self {
        self.exp2()
    }
    /// [`Vector::exp2`] but that results under 2^-126 may come out
    /// subnormal instead of 0 (a level may skip the flush: AVX-512 spares
    /// a compare); the other special values as there. Valid for any
    /// input; the passes take it where no bias or option moved the scores
    /// (`crate::exp`). A level without a cheaper one computes
    /// [`Vector::exp2`].
    #[inline(always)]
    fn exp2_unflushed(self) -> Self {
        self.exp2()
    }
    /// [`Vector::exp2_coarse`] without the flush, as
    /// [`Vector::exp2_unflushed`] is [`Vector::exp2`] without it. A level
    /// without a cheaper one computes [`Vector::exp2_coarse`].
    #[inline(always)]
    fn exp2_coarse_unflushed(self) -> Self {
        self.exp2_coarse()
    }
    /// Lanes where `key == eq` become `with`; the others keep `self`.
    fn replace_where_eq(self, key: Self, eq: f32, with: f32) -> Self;
    /// Lanes where `self < bound` take `then`, the others `other`.
    fn select_lt(self, bound: f32, then: Self, other: Self) -> Self;
    /// Lanes `l` with `j < lo[l]` or `j >= hi[l]` become `fill`; the others
    /// keep `self` (the causal and window mask of one key across a
    /// vector of rows).
    fn fill_outside(self, j: i32, lo: &[i32; 16], hi: &[i32; 16], fill: f32) -> Self;
    /// Whether any lane is NaN.
    fn any_nan(self) -> bool;
    /// The sum of the lanes (in an order fixed per level).
    fn reduce_add(self) -> f32;
    /// Transposes a 16 x 16 block held in 16 vectors (row `i` in `m[i]`).
    fn transpose16(m: [Self; 16]) -> [Self; 16];
    /// The sixteen horizontal sums of 16 vectors, in order: lane `i` is
    /// the sum of the lanes of `m[i]`.
    fn reduce16(m: &[Self; 16]) -> Self;
    /// The row sums of 16 vectors that each hold 4 rows of 4 partial
    /// sums: lane `i` of result `r` is `(m[i][4r] + m[i][4r + 2]) +
    /// (m[i][4r + 1] + m[i][4r + 3])`. Lane by lane by default.
    #[inline(always)]
    fn reduce_quads(m: &[Self; 16]) -> [Self; 4] {
        std::array::from_fn(|r| {
            Self::from(std::array::from_fn::<f32, 16, _>(|i| {
                let x = m[i].to_array();
                (x[4 * r] + x[4 * r + 2]) + (x[4 * r + 1] + x[4 * r + 3])
            }))
        })
    }
}

/// A level's kernels compiled out of line (`microkernel::kernel_entries!`
/// writes the implementation, one per level, beside its
/// `#[target_feature]` functions).
pub trait Kernels: Sized {
    /// `tiling::run_items` compiled for this level, out of line: one copy
    /// per element type and block width, whatever calls it.
    fn run_items<T: CpuElement, const NV: usize>(
        ctx: &Ctx<'_, T>,
        items: &[Item],
        ws: &mut Workspace,
    ) -> [OnlineSoftmax<Self, NV>; 2];
    /// The bf16 dot-product pass (`dot16::run_items`) in place of
    /// `run_items`, on the level that has one: `run_items` calls it when
    /// `Ctx::dot16` is set, which only the `avx512bf16` level sets.
    fn run_items_dot16<T: CpuElement, const NV: usize>(
        _ctx: &Ctx<'_, T>,
        _items: &[Item],
        _ws: &mut Workspace,
    ) -> [OnlineSoftmax<Self, NV>; 2] {
        unreachable!("attn-cpu: the bf16 dot-product pass runs only on the avx512bf16 level")
    }
    /// `decode::tile` compiled for this level, out of line: one copy per
    /// element type, shared by the decode paths.
    fn decode_tile<T: CpuElement>(
        ctx: &Ctx<'_, T>,
        item: &Item,
        st: &mut DecodeState,
        ws: &mut Workspace,
        at: (usize, usize, TileClass),
        next: crate::decode::Next,
    );

    /// `backward::task::run` compiled for this level, out of line: one
    /// copy per element type.
    fn backward_task<T: CpuElement>(
        ctx: &crate::backward::Ctx<'_, T>,
        outs: &crate::backward::Outs<T>,
        task: &crate::backward::Task,
        ws: &mut crate::backward::task::Scratch,
    );

    /// `maps::run` compiled for this level, out of line: one copy per
    /// element type.
    fn maps_unit<T: CpuElement>(
        ctx: &crate::maps::Ctx<'_, T>,
        unit: &crate::maps::Unit,
        out: &mut [f32],
        ws: &mut crate::maps::Scratch,
    );

    /// The level's compiled score microkernel (`microkernel::scores`) on
    /// `nv <= KERNEL_VECS` vectors and `m <= mr(nv)` keys, folding each
    /// row's largest score into `mx`.
    ///
    /// # Safety
    /// As `microkernel::scores` with `M = m`, `NV = nv`.
    #[allow(clippy::too_many_arguments)] // the kernel's arguments and its two sizes
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
    );
    /// The level's compiled value microkernel (`microkernel::pv`) on `nv <=
    /// KERNEL_VECS` vectors and `m <= mr(nv)` value columns; `alpha` holds
    /// `nv` rescale factors (`None`: 1).
    ///
    /// # Safety
    /// As `microkernel::pv` with `M = m`, `NV = nv`.
    #[allow(clippy::too_many_arguments)] // the kernel's arguments and its two sizes
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
    );
}

/// Loads 16 f32 from `p` (unaligned).
///
/// # Safety
/// `p..p+16` must be readable f32s.
#[inline(always)]
pub unsafe fn load<V: Vector>(p: *const f32) -> V {
    // SAFETY: forwarded from the caller.
    unsafe { V::load(p) }
}

/// Stores 16 f32 to `p` (unaligned).
///
/// # Safety
/// `p..p+16` must be writable f32s.
#[inline(always)]
pub unsafe fn store<V: Vector>(p: *mut f32, v: V) {
    // SAFETY: forwarded from the caller.
    unsafe { v.store(p) }
}

/// Runs `f` on every level this CPU supports (tests).
#[cfg(test)]
pub(crate) fn each_level(f: impl Fn(Isa)) {
    for isa in Isa::ALL.into_iter().filter(|l| l.supported()) {
        f(isa);
    }
}

/// A test body generic over the vector type, run on every level this CPU
/// supports: `for_each_vector!(body)` calls `body::<V>()` for each.
#[cfg(test)]
macro_rules! for_each_vector {
    ($f:ident $(::<$($g:ty),*>)?) => {{
        $f::<$crate::simd::PortableV $(, $($g),*)?>();
        #[cfg(target_arch = "x86_64")]
        {
            if $crate::simd::Isa::Avx2.supported() {
                $f::<$crate::simd::Avx2V $(, $($g),*)?>();
            }
            if $crate::simd::Isa::Avx512.supported() {
                $f::<$crate::simd::Avx512V $(, $($g),*)?>();
            }
        }
    }};
}
#[cfg(test)]
pub(crate) use for_each_vector;
#[cfg(test)]
pub(crate) type PortableV = portable::V16;
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) type Avx2V = avx2::V16;
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) type Avx512V = avx512::V16;

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce_quads_sums_each_row<V: Vector>() {
        let m: [V; 16] = std::array::from_fn(|i| {
            V::from(std::array::from_fn(|j| {
                ((i * 29 + j * 11) % 17) as f32 - 8.0 + 0.25 * j as f32
            }))
        });
        let got = V::reduce_quads(&m);
        for (r, g) in got.iter().enumerate() {
            for (i, v) in m.iter().enumerate() {
                let x = v.to_array();
                let want = (x[4 * r] + x[4 * r + 2]) + (x[4 * r + 1] + x[4 * r + 3]);
                assert_eq!(g.to_array()[i], want, "{:?}: row {r}, vector {i}", V::ISA);
            }
        }
    }

    #[test]
    fn reduce_quads_sums_each_row_of_each_vector() {
        for_each_vector!(reduce_quads_sums_each_row);
    }

    fn reduce16_sums<V: Vector>() {
        let m: [V; 16] = std::array::from_fn(|i| {
            V::from(std::array::from_fn(|j| {
                ((i * 31 + j * 7) % 13) as f32 - 6.0
            }))
        });
        let got = V::reduce16(&m).to_array();
        for (i, row) in m.iter().enumerate() {
            // Small integers: every order of summation is exact.
            assert_eq!(
                got[i],
                row.to_array().iter().sum::<f32>(),
                "{:?}: {i}",
                V::ISA
            );
            assert_eq!(row.reduce_add(), got[i]);
        }
    }

    #[test]
    fn reduce16_sums_each_vector_in_order() {
        for_each_vector!(reduce16_sums);
    }

    fn transpose16_is_the_transpose<V: Vector>() {
        let m: [V; 16] =
            std::array::from_fn(|i| V::from(std::array::from_fn(|j| (i * 16 + j) as f32)));
        let t = V::transpose16(m);
        for (j, row) in t.iter().enumerate() {
            for (i, &x) in row.to_array().iter().enumerate() {
                assert_eq!(x, (i * 16 + j) as f32, "{:?}: t[{j}][{i}]", V::ISA);
            }
        }
    }

    #[test]
    fn transpose16_matches_the_definition() {
        for_each_vector!(transpose16_is_the_transpose);
    }

    fn quarters_move_each_piece<V: Vector>() {
        let src: Vec<f32> = (0..64).map(|i| i as f32).collect();
        // Pieces out of order and overlapping, at any 4-byte offset.
        let from = [37usize, 3, 50, 3];
        // SAFETY: every piece lies inside src (at most 50 + 4 <= 64); the
        // level runs on this CPU (for_each_vector).
        let x = unsafe { V::load_quarters(from.map(|i| src.as_ptr().wrapping_add(i))) };
        for (l, &got) in x.to_array().iter().enumerate() {
            assert_eq!(got, (from[l / 4] + l % 4) as f32, "{:?}: lane {l}", V::ISA);
        }
        let mut dst = vec![-1.0f32; 64];
        let to = [9usize, 30, 1, 59];
        let p = dst.as_mut_ptr();
        // SAFETY: every piece lies inside dst (at most 59 + 4 <= 64).
        unsafe { x.store_quarters(to.map(|i| p.wrapping_add(i))) };
        for (i, &got) in dst.iter().enumerate() {
            let want = match to.iter().position(|&t| (t..t + 4).contains(&i)) {
                Some(g) => (from[g] + i - to[g]) as f32,
                None => -1.0,
            };
            assert_eq!(got, want, "{:?}: dst[{i}]", V::ISA);
        }
    }

    #[test]
    fn load_and_store_quarters_move_each_piece_only() {
        for_each_vector!(quarters_move_each_piece);
    }

    fn lane_ops<V: Vector>() {
        let xs: [f32; 16] = [
            0.0,
            -0.0,
            1.5,
            -2.5,
            2.5,
            -126.6,
            126.5,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            3.0,
            -7.25,
            1e-30,
            -1e30,
            0.5,
            -0.5,
        ];
        let x = V::from(xs);
        let y = V::from(std::array::from_fn(|i| i as f32 - 8.0));
        let isa = V::ISA;
        // Bits, with every NaN alike (its sign and payload are not part
        // of the contract).
        let canon = |x: f32| if x.is_nan() { u32::MAX } else { x.to_bits() };
        let bits = |v: V| v.to_array().map(canon);
        let arr = |f: fn(f32, f32) -> f32| -> [u32; 16] {
            std::array::from_fn(|i| canon(f(xs[i], i as f32 - 8.0)))
        };
        assert_eq!(bits(x + y), arr(|a, b| a + b), "{isa:?} add");
        assert_eq!(bits(x - y), arr(|a, b| a - b), "{isa:?} sub");
        assert_eq!(bits(x * y), arr(|a, b| a * b), "{isa:?} mul");
        assert_eq!(bits(x / y), arr(|a, b| a / b), "{isa:?} div");
        assert_eq!(bits(x.abs()), xs.map(|a| canon(a.abs())), "{isa:?} abs");
        assert_eq!(
            bits(y.copysign(x)),
            arr(|a, b| b.abs().copysign(a)),
            "{isa:?}"
        );
        // fast_max: the second operand where either is NaN.
        let mx = x.fast_max(y).to_array();
        let my = y.fast_max(x).to_array();
        for i in 0..16 {
            let b = i as f32 - 8.0;
            if xs[i].is_nan() {
                assert_eq!(mx[i], b);
                assert!(my[i].is_nan());
            } else {
                assert_eq!(mx[i], xs[i].max(b), "{isa:?} max {i}");
            }
        }
        let r = V::from(std::array::from_fn(|i| i as f32 * 0.5 - 4.0));
        let (n, p) = r.round_pow2();
        for (i, (&n, &p)) in n.to_array().iter().zip(&p.to_array()).enumerate() {
            let want = (i as f32 * 0.5 - 4.0).round_ties_even();
            assert_eq!((n, p), (want, want.exp2()), "{isa:?} round {i}");
        }
        let (n, p) = V::from([
            -127.0, 127.0, -126.5, 126.4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
            0.0,
        ])
        .round_pow2();
        assert_eq!(n.to_array()[..4], [-127.0, 127.0, -126.0, 126.0]);
        assert_eq!(
            p.to_array()[..4],
            [0.0, 2f32.powi(127), 2f32.powi(-126), 2f32.powi(126)]
        );
        let z = x.replace_where_eq(x, f32::NEG_INFINITY, 0.0).to_array();
        assert_eq!(z[9], 0.0);
        assert_eq!(z[8], f32::INFINITY);
        let s = y.select_lt(-2.0, V::ONE, V::ZERO).to_array();
        for (i, &v) in s.iter().enumerate() {
            assert_eq!(
                v,
                f32::from(u8::from((i as f32 - 8.0) < -2.0)),
                "{isa:?} lt"
            );
        }
        let lo: [i32; 16] = std::array::from_fn(|i| i as i32);
        let hi: [i32; 16] = std::array::from_fn(|i| 2 * i as i32);
        let f = V::ONE.fill_outside(5, &lo, &hi, -1.0).to_array();
        for (i, &v) in f.iter().enumerate() {
            let inside = (lo[i]..hi[i]).contains(&5);
            assert_eq!(v, if inside { 1.0 } else { -1.0 }, "{isa:?} outside {i}");
        }
        assert!(x.any_nan() && !y.any_nan());
        let fm = V::splat(3.0).mul_add(y, V::ONE).to_array();
        assert_eq!(fm, std::array::from_fn(|i| 3.0 * (i as f32 - 8.0) + 1.0));
        let mut buf = [0.0f32; 17];
        // SAFETY: 16 floats from index 1 of 17.
        unsafe { store(buf.as_mut_ptr().add(1), y) };
        // SAFETY: as above.
        let back = unsafe { load::<V>(buf.as_ptr().add(1)) };
        assert_eq!(back.to_array(), y.to_array());
        let h: Vec<f16> = (0..17)
            .map(|i| f16::from_f32(i as f32 * 0.37 - 3.0))
            .collect();
        let b: Vec<bf16> = (0..17)
            .map(|i| bf16::from_f32(i as f32 * 0.37 - 3.0))
            .collect();
        // SAFETY: 16 elements from index 1 of 17.
        let (hv, bv) = unsafe {
            (
                V::load_f16(h.as_ptr().add(1)),
                V::load_bf16(b.as_ptr().add(1)),
            )
        };
        for i in 0..16 {
            assert_eq!(hv.to_array()[i], h[i + 1].to_f32(), "{isa:?} f16 {i}");
            assert_eq!(bv.to_array()[i], b[i + 1].to_f32(), "{isa:?} bf16 {i}");
        }
        // Rounding to bf16: bit for bit `bf16::from_f32` on ties (to even,
        // both ways), sticky bits, carries into the exponent and to
        // infinity, subnormals, infinities, NaN payloads and signs, and a
        // sweep of bit patterns.
        let special = [
            f32::from_bits(0x3f80_8000), // tie, even below: down
            f32::from_bits(0x3f81_8000), // tie, odd below: up
            f32::from_bits(0x3f80_8001), // above the tie: up
            f32::from_bits(0x3f80_7fff), // below the tie: down
            f32::from_bits(0x3fff_ffff), // carries into the exponent
            f32::MAX,                    // rounds to infinity
            f32::from_bits(0x0000_8001), // subnormal, rounds up
            f32::from_bits(0x807f_ffff), // -subnormal, carries to the normal
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN: quieted
            f32::from_bits(0xffa1_2345), // negative NaN with a payload
            -0.0,
            0.0,
            -1.000_000_1,
        ];
        let sweep = (0..4096u32).map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9)));
        let xs: Vec<f32> = special.into_iter().chain(sweep).collect();
        for chunk in xs.chunks(16) {
            let mut a = [0.0f32; 16];
            a[..chunk.len()].copy_from_slice(chunk);
            let mut out = [bf16::ZERO; 17];
            // SAFETY: 16 elements from index 1 of 17.
            unsafe { V::from(a).store_bf16(out.as_mut_ptr().add(1)) };
            for i in 0..16 {
                let want = bf16::from_f32(a[i]).to_bits();
                assert_eq!(
                    out[i + 1].to_bits(),
                    want,
                    "{isa:?} {:#010x}",
                    a[i].to_bits()
                );
            }
        }
        // SAFETY: 4 elements from index 2 of 17.
        let (q32, q16, qb) = unsafe {
            (
                V::load4x4(buf.as_ptr().add(2)),
                V::load4x4(h.as_ptr().add(2)),
                V::load4x4(b.as_ptr().add(2)),
            )
        };
        for l in 0..16 {
            assert_eq!(q32.to_array()[l], buf[2 + l % 4], "{isa:?}");
            assert_eq!(q16.to_array()[l], h[2 + l % 4].to_f32(), "{isa:?}");
            assert_eq!(qb.to_array()[l], b[2 + l % 4].to_f32(), "{isa:?}");
        }
    }

    #[test]
    fn lane_operations_match_scalar_arithmetic() {
        for_each_vector!(lane_ops);
    }

    #[test]
    fn levels_parse_and_order() {
        assert_eq!("AVX2".parse::<Isa>(), Ok(Isa::Avx2));
        assert!("sse9"
            .parse::<Isa>()
            .unwrap_err()
            .contains("portable, avx2, avx512"));
        assert!(Isa::Portable < Isa::Avx2 && Isa::Avx2 < Isa::Avx512);
        assert!(Isa::Portable.supported() && Isa::detected().supported());
        each_level(|l| assert!(l <= Isa::detected()));
    }
}
