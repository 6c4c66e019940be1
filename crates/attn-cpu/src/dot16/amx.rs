//! bf16 products on the AMX tile unit (Intel Xeon 4th generation and
//! later): `tdpbf16ps` multiplies a 16 x 32 bf16 tile by a 16 x 16 tile of
//! bf16 pairs into a 16 x 16 f32 tile, 16 384 flops per instruction (the
//! work of 256 `vdpbf16ps` on 512-bit registers).
//!
//! One product shape serves both products of the forward pass, on the
//! layouts the `vdpbf16ps` pass already keeps (query rows along the
//! columns, `kernels.rs`): `C (32 x 16 nt) (+)= A (32 x 32 s) B (16 s x 16
//! nt pairs)` ([`Session::mul`]), where
//! - `S^T = K Q^T`: A is 32 key rows of K read in place (the head dimension
//!   along the row), B the query panel of pairs (`d / 2` rows of words);
//! - `O^T += V^T P^T`: A is 32 value columns of `V^T` (keys along the row,
//!   the packed value pairs transposed as words), B the probability pairs
//!   (`n / 2` rows of words).
//!
//! The tile unit computes pairs as `vdpbf16ps` does (each product of two
//! bf16 exact in f32, sums rounded to nearest even, subnormal inputs and
//! results flushed), in another order of additions, so the window and the
//! bound of the `vdpbf16ps` pass (module docs of `dot16`), which hold for
//! any order, cover it unchanged.
//!
//! Rust has no stable AMX intrinsics; stable `asm!` takes the
//! instructions. Detection reads CPUID (AMX-TILE and AMX-BF16), checks
//! that the OS enabled the tile state (XCR0 bits 17 and 18), and asks Linux
//! for it once per process (`arch_prctl(ARCH_REQ_XCOMP_PERM)`; without the
//! permission the first tile instruction faults). Other systems: not
//! available.
//!
//! This path has not yet run on hardware with AMX (the machines it was
//! written on have none), so the level is opt-in (`Isa::Amx`,
//! `ATTN_CPU_ISA=amx`) and never chosen by detection alone. Everything
//! but the instructions is tested anywhere with AVX512_BF16 through
//! [`Unit::Model`], a scalar model of the tile unit that the pass calls
//! in their place (`Cpu::with_tile_model`); on hardware with AMX the tests
//! compare the instructions against the model.

// Only the x86-64 pass (`dot16::pass`) multiplies on the unit.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::marker::PhantomData;

/// What runs [`Session::mul`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// The AMX instructions.
    Tiles,
    /// A scalar model of them (tests on CPUs without AMX).
    Model,
}

/// Whether this CPU and OS run AMX-BF16 tiles (detected and, on Linux,
/// permitted once per process).
///
/// Linux refuses the permission (so this is false for the life of the
/// process) when a thread already has an alternate signal stack too small
/// for the tile state's signal frame (a C library's fixed 8 KiB
/// `sigaltstack`, say; Rust's own are sized from `AT_MINSIGSTKSZ`), and
/// once granted it refuses such stacks afterwards: see the kernel's
/// `Documentation/arch/x86/xstate.rst`.
pub fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    let (max, l1, l7) = (
        __cpuid_count(0, 0).eax,
        __cpuid_count(1, 0),
        __cpuid_count(7, 0),
    );
    // Leaf 7 EDX: bit 22 AMX-BF16, bit 24 AMX-TILE; leaf 1 ECX bit 27:
    // OSXSAVE (XGETBV usable).
    let cpu = max >= 7 && l7.edx & (1 << 22) != 0 && l7.edx & (1 << 24) != 0;
    if !cpu || l1.ecx & (1 << 27) == 0 {
        return false;
    }
    let xcr0: u64;
    // SAFETY: XGETBV with ECX = 0 reads XCR0; OSXSAVE is set (checked).
    unsafe {
        let (lo, hi): (u32, u32);
        std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi,
            options(nomem, nostack, preserves_flags));
        xcr0 = (hi as u64) << 32 | lo as u64;
    }
    // XTILECFG (17) and XTILEDATA (18) enabled by the OS.
    if xcr0 & (3 << 17) != 3 << 17 {
        return false;
    }
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: the arch_prctl system call with a request that only asks for
    // permission to use a state component; it reads and writes no memory
    // of ours. `syscall` clobbers RCX and R11.
    unsafe {
        std::arch::asm!("syscall",
            inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// The tile configuration every product uses: palette 1, tiles 0 to 7 of
/// 16 rows of 64 bytes. (C: tiles 0 to 3; A: 4 and 5; B: 6 and 7.)
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row, little-endian u16
        c[48 + t] = 16; // rows
        t += 1;
    }
    Config(c)
};

/// The tile unit configured for [`Session::mul`] on this thread, until
/// dropped (which releases it). Not `Send`: tile state is per thread.
pub struct Session {
    unit: Unit,
    _thread: PhantomData<*const ()>,
}

impl Session {
    /// Configures the unit (for [`Unit::Tiles`]: loads the tile
    /// configuration).
    ///
    /// # Panics
    /// [`Unit::Tiles`] on a CPU without AMX (backends choose it only where
    /// [`available`]).
    pub fn new(unit: Unit) -> Session {
        if unit == Unit::Tiles {
            assert!(available(), "attn-cpu: the AMX tile unit is not available");
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AMX-TILE runs and the OS permits it (asserted); the
            // configuration is 64 readable, aligned bytes.
            unsafe {
                std::arch::asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const Config,
                    options(nostack, readonly, preserves_flags));
            }
        }
        Session {
            unit,
            _thread: PhantomData,
        }
    }

    /// `C (+)= A B` for 32 rows of `C` and `cols` columns (a multiple of
    /// 16, taken 32 then 16 at a time) over `32 s` bf16 of A's rows
    /// (`s >= 1` steps):
    /// - `a`: row `m` of A at `a + m * a_stride` bytes, `64 s` bytes of
    ///   bf16 each;
    /// - `b`: word `c` of B's row `k` (bf16 pair `k` of column `c`) at
    ///   `b + k * b_stride + 4 c` bytes, `16 s` rows of `cols` words;
    /// - `c`: f32 row `m` at `c + m * c_stride` bytes, `cols` floats;
    ///   read first when `add`, else overwritten.
    ///
    /// `C[m][j] (+)= sum_k A[m][2k] B[k][2j] + A[m][2k+1] B[k][2j+1]`.
    ///
    /// # Safety
    /// Every byte named above readable (`c`'s writable); the session's
    /// thread calls it (guaranteed by `!Send`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn mul(
        &self,
        (a, a_stride): (*const u8, usize),
        (b, b_stride): (*const u8, usize),
        s: usize,
        (c, c_stride): (*mut f32, usize),
        cols: usize,
        add: bool,
    ) {
        assert!(s >= 1 && cols.is_multiple_of(16));
        let mut col = 0;
        while col < cols {
            let nt = if cols - col >= 32 { 2 } else { 1 };
            // SAFETY: columns col..col + 16 nt <= cols of B and C, within the
            // caller's extents.
            let (b, c) = unsafe { (b.add(4 * col), c.add(col)) };
            match self.unit {
                // SAFETY: forwarded from the caller; the session configured
                // the unit on this thread.
                #[cfg(target_arch = "x86_64")]
                Unit::Tiles => unsafe {
                    tiles((a, a_stride), (b, b_stride), s, (c, c_stride), nt, add)
                },
                // SAFETY: forwarded from the caller.
                _ => unsafe { model((a, a_stride), (b, b_stride), s, (c, c_stride), nt, add) },
            }
            col += 16 * nt;
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if self.unit == Unit::Tiles {
            // SAFETY: AMX-TILE runs (the session was made); TILERELEASE
            // returns the tile state to its initial state.
            unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
        }
    }
}

/// [`Session::mul`] on the tile unit: C in tiles 0 to 3 (rows 0-15 then
/// 16-31, columns 0-15 then 16-31), A's two row halves in 4 and 5, B's
/// column halves in 6 and 7.
///
/// # Safety
/// As [`Session::mul`], with the unit configured as [`CONFIG`].
#[cfg(target_arch = "x86_64")]
unsafe fn tiles(
    (a, a_stride): (*const u8, usize),
    (b, b_stride): (*const u8, usize),
    s: usize,
    (c, c_stride): (*mut f32, usize),
    nt: usize,
    add: bool,
) {
    use std::arch::asm;
    let a1 = a.wrapping_add(16 * a_stride);
    let c1 = c.cast::<u8>().wrapping_add(16 * c_stride);
    let b_step = 16 * b_stride;
    // One asm block per variant, so no tile is live between blocks. The
    // loop: two A tiles, one or two B tiles, two or four products, per 32
    // bf16 of the sum.
    macro_rules! product {
        ($($init:literal),* ; $($body:literal),* ; $($store:literal),*) => {
            // SAFETY: the caller's extents: each TILELOADD reads 16 rows of
            // 64 bytes at the row strides given, each TILESTORED writes
            // 16 rows of 64 bytes of C.
            unsafe {
                asm!(
                    $($init,)*
                    "2:",
                    "tileloadd tmm4, [{a0} + {as_}*1]",
                    "tileloadd tmm5, [{a1} + {as_}*1]",
                    $($body,)*
                    "add {a0}, 64",
                    "add {a1}, 64",
                    "add {b}, {bstep}",
                    "dec {s}",
                    "jnz 2b",
                    $($store,)*
                    a0 = inout(reg) a => _,
                    a1 = inout(reg) a1 => _,
                    b = inout(reg) b => _,
                    s = inout(reg) s => _,
                    as_ = in(reg) a_stride,
                    bs = in(reg) b_stride,
                    bstep = in(reg) b_step,
                    c0 = in(reg) c,
                    c1 = in(reg) c1,
                    cs = in(reg) c_stride,
                    out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                    out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                    options(nostack),
                )
            }
        };
    }
    match (nt, add) {
        (2, true) => product!(
            "tileloadd tmm0, [{c0} + {cs}*1]", "tileloadd tmm1, [{c0} + {cs}*1 + 64]",
            "tileloadd tmm2, [{c1} + {cs}*1]", "tileloadd tmm3, [{c1} + {cs}*1 + 64]";
            "tileloadd tmm6, [{b} + {bs}*1]", "tileloadd tmm7, [{b} + {bs}*1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6", "tdpbf16ps tmm3, tmm5, tmm7";
            "tilestored [{c0} + {cs}*1], tmm0", "tilestored [{c0} + {cs}*1 + 64], tmm1",
            "tilestored [{c1} + {cs}*1], tmm2", "tilestored [{c1} + {cs}*1 + 64], tmm3"
        ),
        (2, false) => product!(
            "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3";
            "tileloadd tmm6, [{b} + {bs}*1]", "tileloadd tmm7, [{b} + {bs}*1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6", "tdpbf16ps tmm3, tmm5, tmm7";
            "tilestored [{c0} + {cs}*1], tmm0", "tilestored [{c0} + {cs}*1 + 64], tmm1",
            "tilestored [{c1} + {cs}*1], tmm2", "tilestored [{c1} + {cs}*1 + 64], tmm3"
        ),
        (_, true) => product!(
            "tileloadd tmm0, [{c0} + {cs}*1]", "tileloadd tmm2, [{c1} + {cs}*1]";
            "tileloadd tmm6, [{b} + {bs}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm2, tmm5, tmm6";
            "tilestored [{c0} + {cs}*1], tmm0", "tilestored [{c1} + {cs}*1], tmm2"
        ),
        (_, false) => product!(
            "tilezero tmm0", "tilezero tmm2";
            "tileloadd tmm6, [{b} + {bs}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm2, tmm5, tmm6";
            "tilestored [{c0} + {cs}*1], tmm0", "tilestored [{c1} + {cs}*1], tmm2"
        ),
    }
}

/// [`Session::mul`] in scalar code, in the order of the pseudocode of
/// Intel's manual: per instruction (32 bf16 of the sum) and output, the
/// even and the odd products of the 16 pairs each summed by FMAs from 0,
/// then their sum added to C, every step rounded to nearest even, bf16
/// inputs and f32 results that are subnormal taken as zero. (Hardware may
/// round differently within that; the tests compare the two on sums that
/// are exact.)
///
/// # Safety
/// As [`Session::mul`].
unsafe fn model(
    (a, a_stride): (*const u8, usize),
    (b, b_stride): (*const u8, usize),
    s: usize,
    (c, c_stride): (*mut f32, usize),
    nt: usize,
    add: bool,
) {
    let half = |x: u16| {
        let f = f32::from_bits((x as u32) << 16);
        if f.is_subnormal() {
            0.0
        } else {
            f
        }
    };
    let flush = |f: f32| if f.is_subnormal() { 0.0 } else { f };
    #[cfg(test)]
    MODEL_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    for m in 0..32 {
        for j in 0..16 * nt {
            // SAFETY: every access is within the extents of `mul`'s contract
            // (row m < 32 of A and C, rows k < 16 s of B, column j < 16 nt).
            unsafe {
                let out = c.cast::<u8>().add(m * c_stride).cast::<f32>().add(j);
                let mut acc = if add {
                    flush(out.read_unaligned())
                } else {
                    0.0
                };
                for t in 0..s {
                    let (mut even, mut odd) = (0.0f32, 0.0f32);
                    for k in 16 * t..16 * (t + 1) {
                        let x = a.add(m * a_stride + 4 * k).cast::<u32>().read_unaligned();
                        let y = b.add(k * b_stride + 4 * j).cast::<u32>().read_unaligned();
                        even = flush(half(x as u16).mul_add(half(y as u16), even));
                        odd = flush(half((x >> 16) as u16).mul_add(half((y >> 16) as u16), odd));
                    }
                    acc = flush(acc + flush(even + odd));
                }
                out.write_unaligned(acc);
            }
        }
    }
}

/// Products the model has computed (tests check that a path ran on it).
#[cfg(test)]
pub static MODEL_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[cfg(test)]
mod tests {
    use super::*;
    use attn_spec::bf16;

    /// Words of bf16 pairs from a pattern of small values (some negative,
    /// some zero), exact in every sum below.
    fn words(n: usize, seed: usize) -> Vec<u32> {
        let h = |i: usize| {
            let x = ((i * 37 + seed * 11) % 23) as f32 - 11.0;
            bf16::from_f32(x / 8.0).to_bits() as u32
        };
        (0..n).map(|i| h(2 * i) | h(2 * i + 1) << 16).collect()
    }

    /// `C` after [`Session::mul`] on `unit`: A is 32 rows of `16 s` words
    /// (`a_ld` apart), B `16 s` rows of `16 nt` words (`b_ld` apart), C
    /// starts as `c0` (32 rows, `c_ld` apart).
    #[allow(clippy::too_many_arguments)]
    fn product(
        unit: Unit,
        (a, a_ld): (&[u32], usize),
        (b, b_ld): (&[u32], usize),
        s: usize,
        (c0, c_ld): (&[f32], usize),
        nt: usize,
        add: bool,
    ) -> Vec<f32> {
        assert!(a.len() >= 32 * a_ld && b.len() >= 16 * s * b_ld && c0.len() >= 32 * c_ld);
        assert!(a_ld >= 16 * s && b_ld >= 16 * nt && c_ld >= 16 * nt);
        let mut c = c0.to_vec();
        // SAFETY: the extents of `mul` within the three buffers (asserted).
        unsafe {
            Session::new(unit).mul(
                (a.as_ptr().cast(), 4 * a_ld),
                (b.as_ptr().cast(), 4 * b_ld),
                s,
                (c.as_mut_ptr(), 4 * c_ld),
                16 * nt,
                add,
            )
        };
        c
    }

    /// The model against the sum written out, for both widths, with and
    /// without the accumulator, on strided rows; small integers over 8 make
    /// every sum exact, so equality is the test.
    #[test]
    fn model_computes_the_pair_product() {
        for (s, nt, add) in [
            (1, 1, false),
            (2, 2, true),
            (3, 2, false),
            (1, 2, true),
            (2, 3, true),
        ] {
            let (a_ld, b_ld, c_ld) = (16 * s + 3, 16 * nt + 5, 16 * nt + 2);
            let a = words(32 * a_ld, 1);
            let b = words(16 * s * b_ld, 2);
            let c0: Vec<f32> = (0..32 * c_ld).map(|i| (i % 7) as f32).collect();
            let c = product(Unit::Model, (&a, a_ld), (&b, b_ld), s, (&c0, c_ld), nt, add);
            let f = |w: u32, hi: bool| bf16::from_bits((w >> (16 * hi as u32)) as u16).to_f32();
            for m in 0..32 {
                for j in 0..c_ld {
                    let got = c[m * c_ld + j];
                    if j >= 16 * nt {
                        assert_eq!(got, c0[m * c_ld + j], "column {j} is not C's");
                        continue;
                    }
                    let mut want = if add { c0[m * c_ld + j] } else { 0.0 };
                    for k in 0..16 * s {
                        let (x, y) = (a[m * a_ld + k], b[k * b_ld + j]);
                        want += f(x, false) * f(y, false) + f(x, true) * f(y, true);
                    }
                    assert_eq!(got, want, "s {s} nt {nt} add {add}: C[{m}][{j}]");
                }
            }
        }
    }

    /// The instructions against the model, where the CPU has them.
    #[test]
    fn tiles_match_the_model() {
        if !available() {
            eprintln!("skipped: this CPU or OS runs no AMX tiles");
            return;
        }
        for (s, nt, add) in [
            (1, 1, false),
            (2, 2, true),
            (4, 2, false),
            (3, 1, true),
            (2, 3, false),
        ] {
            let (a_ld, b_ld, c_ld) = (16 * s + 3, 16 * nt + 5, 16 * nt + 2);
            let a = words(32 * a_ld, 3);
            let b = words(16 * s * b_ld, 4);
            let c0: Vec<f32> = (0..32 * c_ld).map(|i| (i % 5) as f32 - 2.0).collect();
            let run = |unit| product(unit, (&a, a_ld), (&b, b_ld), s, (&c0, c_ld), nt, add);
            assert_eq!(
                run(Unit::Tiles),
                run(Unit::Model),
                "s {s} nt {nt} add {add}"
            );
        }
    }

    /// The instructions on sums that round, against the f64 sum, where the
    /// CPU has them, and the model everywhere (one order the bound must
    /// admit too): the manual leaves the order of the roundings of a
    /// `tdpbf16ps` open, so the bound is the worst case of any order. Each
    /// product of two bf16 is exact in f32; every output is `C` plus `32 s`
    /// of them, summed with at most `32 s + 1` roundings of relative size
    /// `u = 2^-24` on partial sums no larger than `|C| + sum |x y|`, so the
    /// error is at most `gamma(32 s + 1) (|C| + sum |x y|)` (Higham,
    /// *Accuracy and Stability of Numerical Algorithms*, 3.1). Values of
    /// magnitude 2^-8 to 4 keep every input, product and sum normal.
    #[test]
    fn tiles_round_within_the_sum_bound() {
        let units = if available() {
            vec![Unit::Model, Unit::Tiles]
        } else {
            eprintln!("tiles skipped: this CPU or OS runs no AMX tiles; the model only");
            vec![Unit::Model]
        };
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mag = 2f32.powf((x >> 40) as f32 / (1u64 << 24) as f32 * 10.0 - 8.0);
            let v = if x & 1 == 1 { -mag } else { mag };
            bf16::from_f32(v).to_bits() as u32
        };
        for (unit, (s, nt, add)) in units
            .into_iter()
            .flat_map(|u| [(u, (1, 1, false)), (u, (4, 2, true)), (u, (3, 3, true))])
        {
            let (a_ld, b_ld, c_ld) = (16 * s, 16 * nt, 16 * nt);
            let a: Vec<u32> = (0..32 * a_ld).map(|_| next() | next() << 16).collect();
            let b: Vec<u32> = (0..16 * s * b_ld).map(|_| next() | next() << 16).collect();
            let c0: Vec<f32> = (0..32 * c_ld)
                .map(|_| bf16::from_bits(next() as u16).to_f32())
                .collect();
            let c = product(unit, (&a, a_ld), (&b, b_ld), s, (&c0, c_ld), nt, add);
            let f = |w: u32, hi: bool| {
                f64::from(bf16::from_bits((w >> (16 * hi as u32)) as u16).to_f32())
            };
            let n = (32 * s + 1) as f64;
            let u = f64::from(f32::EPSILON) / 2.0;
            let gamma = n * u / (1.0 - n * u);
            for m in 0..32 {
                for j in 0..16 * nt {
                    let c_in = if add {
                        f64::from(c0[m * c_ld + j])
                    } else {
                        0.0
                    };
                    let (mut want, mut size) = (c_in, c_in.abs());
                    for k in 0..16 * s {
                        let (x, y) = (a[m * a_ld + k], b[k * b_ld + j]);
                        for hi in [false, true] {
                            want += f(x, hi) * f(y, hi);
                            size += (f(x, hi) * f(y, hi)).abs();
                        }
                    }
                    let err = (f64::from(c[m * c_ld + j]) - want).abs();
                    assert!(
                        err <= gamma * size,
                        "{unit:?} s {s} nt {nt} add {add}: C[{m}][{j}] off by {err:e}, bound {:e}",
                        gamma * size
                    );
                }
            }
        }
    }
}
