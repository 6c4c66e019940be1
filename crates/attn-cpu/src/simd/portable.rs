//! The portable level: `wide`'s `f32x16` as the target's baseline compiles
//! it (four SSE2 registers per vector on x86-64, four NEON registers on
//! aarch64). What every CPU of the target runs, and the reference the
//! wider levels are tested beside.

use super::{Isa, Vector};
use attn_spec::{bf16, f16};
use wide::{f32x16, i32x16};

/// Sixteen lanes as `wide` builds them for the baseline.
pub type V16 = f32x16;

crate::microkernel::kernel_entries!(V16, [1 => 2]);

// SAFETY: nothing here needs more than the target's baseline.
unsafe impl Vector for V16 {
    const ISA: Isa = Isa::Portable;
    const ZERO: Self = f32x16::ZERO;
    const ONE: Self = f32x16::ONE;
    const REGS_PER_VECTOR: usize = 4;
    const REGISTERS: usize = if cfg!(target_arch = "aarch64") {
        32
    } else {
        16
    };
    const KERNEL_VECS: usize = 1;
    const QUAD: bool = false;

    #[inline(always)]
    fn mr(_nv: usize) -> usize {
        // 4 registers per vector: 2 keys keep 8 of x86's 16 registers in
        // accumulators, beside 4 for the streamed operand, a broadcast and
        // the product SSE2 forms before its add (3 keys spilled, `cargo
        // xtask cpu-check`); aarch64 has 32 registers and could take more
        // (not measured).
        2
    }
    // About 16 registers of accumulators, 4 per vector.
    const DECODE_GROUP: [usize; crate::decode::DECODE_ROWS] = [4, 2, 1, 1];
    // As AVX2: one pass over each tile's value rows.
    const DECODE_COLUMN_VECS: [usize; crate::decode::DECODE_ROWS] = [8; 4];
    #[inline(always)]
    fn splat(x: f32) -> Self {
        f32x16::splat(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 16 readable f32 at `p`;
        // read_unaligned has no alignment requirement.
        f32x16::from(unsafe { (p as *const [f32; 16]).read_unaligned() })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 16 writable f32 at `p`.
        unsafe { (p as *mut [f32; 16]).write_unaligned(self.to_array()) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> Self {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        let h = unsafe { (p as *const [f16; 16]).read_unaligned() };
        f32x16::from(h.map(f16::to_f32))
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const bf16) -> Self {
        // SAFETY: the caller guarantees 16 readable elements at `p`.
        let h = unsafe { (p as *const [u16; 16]).read_unaligned() };
        // bf16 is the top half of an f32.
        f32x16::from(h.map(|x| f32::from_bits(u32::from(x) << 16)))
    }
    #[inline(always)]
    fn to_array(self) -> [f32; 16] {
        f32x16::to_array(self)
    }
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f32x16::mul_add(self, a, b)
    }
    #[inline(always)]
    fn fast_max(self, rhs: Self) -> Self {
        // x86's `maxps` is the contract itself (`rhs` where either lane is
        // NaN). NEON's `fmax`, which `wide` takes on aarch64, gives NaN
        // where either is NaN instead: a compare and a select there.
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        {
            f32x16::fast_max(self, rhs)
        }
        #[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
        {
            self.simd_gt(rhs).select(self, rhs)
        }
    }
    #[inline(always)]
    fn abs(self) -> Self {
        f32x16::abs(self)
    }
    #[inline(always)]
    fn copysign(self, sign: Self) -> Self {
        let s = f32x16::splat(-0.0);
        f32x16::abs(self) | (sign & s)
    }
    #[inline(always)]
    fn round_pow2(self) -> (Self, Self) {
        let ni = self.fast_round_int();
        let bits: i32x16 = (ni + i32x16::splat(127)) << 23;
        (f32x16::from_i32x16(ni), wide::bytemuck::cast(bits))
    }
    #[inline(always)]
    fn replace_where_eq(self, key: Self, eq: f32, with: f32) -> Self {
        key.simd_eq(f32x16::splat(eq))
            .select(f32x16::splat(with), self)
    }
    #[inline(always)]
    fn select_lt(self, bound: f32, then: Self, other: Self) -> Self {
        self.simd_lt(f32x16::splat(bound)).select(then, other)
    }
    #[inline(always)]
    fn fill_outside(self, j: i32, lo: &[i32; 16], hi: &[i32; 16], fill: f32) -> Self {
        let jv = i32x16::splat(j);
        let outside = jv.simd_lt(i32x16::from(*lo)) | jv.simd_ge(i32x16::from(*hi));
        let outside: f32x16 = wide::bytemuck::cast(outside);
        outside.select(f32x16::splat(fill), self)
    }
    #[inline(always)]
    fn any_nan(self) -> bool {
        self.is_nan().any()
    }
    #[inline(always)]
    fn reduce_add(self) -> f32 {
        f32x16::reduce_add(self)
    }
    #[inline(always)]
    fn transpose16(m: [Self; 16]) -> [Self; 16] {
        f32x16::transpose(m)
    }
    #[inline(always)]
    fn reduce16(m: &[Self; 16]) -> Self {
        f32x16::from(std::array::from_fn::<f32, 16, _>(|i| m[i].reduce_add()))
    }
}
