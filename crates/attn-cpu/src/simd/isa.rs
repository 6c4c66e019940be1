//! Instruction-set levels: which one this CPU has (detected once, at run
//! time), which one a caller asks for (`ATTN_CPU_ISA`, or
//! `Cpu::with_isa`), and how a computation enters the code compiled for
//! it ([`vectorize`]).
//!
//! attn-cpu is built for the baseline of its target (x86-64: SSE2) like
//! any dependency, since a dependency's `.cargo/config.toml` never
//! applies to its users' builds. The kernels are compiled once per level
//! with `#[target_feature]` and chosen here, per call, as matrixmultiply,
//! memchr and gemm/pulp do.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

/// A level of SIMD instructions attn-cpu has kernels for, from the
/// narrowest. Levels are ordered: a CPU that runs one runs every level
/// below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Any CPU of the target: `wide`'s vectors as the target's baseline
    /// compiles them (SSE2 on x86-64, NEON on aarch64), multiply and add
    /// unfused where the baseline has no FMA.
    Portable,
    /// x86-64 with AVX2, FMA and F16C (Intel Haswell, AMD Zen and later):
    /// a vector of 16 lanes is two 256-bit registers.
    Avx2,
    /// x86-64 with AVX-512 F, BW and DQ (Intel Skylake-SP, AMD Zen 4 and
    /// later): a vector of 16 lanes is one 512-bit register.
    Avx512,
    /// AVX-512 with AVX512_BF16 and DQ (AMD Zen 4 and later, Intel Cooper
    /// Lake and Sapphire Rapids and later): the AVX-512 kernels, and for
    /// bf16 inputs `Q K^T` and `P V` on `vdpbf16ps` (pairs of bf16 products
    /// accumulated in f32, P rounded to bf16: `dot16/`).
    Avx512Bf16,
    /// The `avx512bf16` level with the AMX tile unit (AMX-TILE and
    /// AMX-BF16: Intel Xeon 4th generation and later, on Linux): the bf16
    /// forward's tiles multiply on `tdpbf16ps` (`dot16/amx.rs`).
    /// Opt-in: chosen only when asked for (`ATTN_CPU_ISA=amx`,
    /// `Cpu::with_isa`), never by [`Isa::detected`], until it has been
    /// verified on such a CPU (it has not yet run on one).
    Amx,
}

impl Isa {
    /// Every level, narrowest first.
    pub const ALL: [Isa; 5] = [
        Isa::Portable,
        Isa::Avx2,
        Isa::Avx512,
        Isa::Avx512Bf16,
        Isa::Amx,
    ];

    /// The level's name as `ATTN_CPU_ISA` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Amx => "amx",
        }
    }

    /// Whether this CPU runs the level (detected at run time).
    pub fn supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512dq")
            }
            #[cfg(target_arch = "x86_64")]
            // Every CPU with AVX512_BF16 has AVX-512 DQ too (its output
            // write classifies values with `vfpclassps`).
            Isa::Avx512Bf16 => {
                Isa::Avx512.supported()
                    && is_x86_feature_detected!("avx512bf16")
                    && is_x86_feature_detected!("avx512dq")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Avx512Bf16.supported() && crate::dot16::amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Whether detection may choose the level: every level but the
    /// opt-in [`Isa::Amx`].
    pub fn chosen_by_default(self) -> bool {
        self != Isa::Amx
    }

    /// The widest level this CPU runs that detection chooses
    /// ([`Isa::chosen_by_default`]).
    pub fn detected() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            Isa::ALL
                .into_iter()
                .rev()
                .find(|l| l.chosen_by_default() && l.supported())
                .unwrap_or(Isa::Portable)
        })
    }

    /// The level a new backend uses: the detected one, or a lower one
    /// named by the environment variable `ATTN_CPU_ISA` (`portable`,
    /// `avx2`, `avx512`, `avx512bf16`; a level above what the CPU runs gives the CPU's
    /// best, as a cap), or the opt-in `amx` where the CPU runs it. An
    /// unknown name is an error, kept so that every call can report it.
    pub fn selected() -> Result<Isa, String> {
        static SELECTED: OnceLock<Result<Isa, String>> = OnceLock::new();
        SELECTED
            .get_or_init(|| match std::env::var("ATTN_CPU_ISA") {
                Ok(s) if !s.trim().is_empty() => s
                    .parse::<Isa>()
                    .map(|asked| match asked.supported() {
                        true => asked,
                        false => asked.min(Isa::detected()),
                    })
                    .map_err(|e| format!("ATTN_CPU_ISA: {e}")),
                _ => Ok(Isa::detected()),
            })
            .clone()
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Isa {
    type Err = String;
    fn from_str(s: &str) -> Result<Isa, String> {
        let s = s.trim().to_ascii_lowercase();
        Isa::ALL.into_iter().find(|l| l.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Isa::ALL.iter().map(|l| l.name()).collect();
            format!("'{s}' is not a level ({})", names.join(", "))
        })
    }
}

/// A computation written once for any vector type: [`vectorize`] runs it
/// compiled for one level. Implementations mark `run` `#[inline(always)]`
/// (and everything it calls that touches vectors), so that the whole body
/// is compiled inside the level's `#[target_feature]` entry; a function
/// left out of line is compiled for the target's baseline and calls the
/// level's instructions one function call at a time (still correct, much
/// slower).
pub trait Op {
    /// What the computation returns.
    type Output;
    /// The computation on vectors of type `V`.
    fn run<V: super::Vector>(self) -> Self::Output;
}

/// Runs `op` with the vectors of `isa`.
///
/// # Panics
/// When this CPU does not run `isa`: backends check the level when it is
/// chosen (`Cpu::with_isa`), so this is an internal invariant.
#[inline]
pub fn vectorize<O: Op>(isa: Isa, op: O) -> O::Output {
    assert!(
        isa.supported(),
        "attn-cpu: {isa} is not supported by this CPU"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU runs AVX-512 F/BW/DQ, AVX2, FMA and F16C (asserted;
        // the bf16 and AMX levels run the same vectors and reach their bf16
        // kernels through `Kernels::run_items` when `Ctx::dot16` says so).
        Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => unsafe { super::avx512::enter(op) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU runs AVX2, FMA and F16C (asserted).
        Isa::Avx2 => unsafe { super::avx2::enter(op) },
        _ => op.run::<super::portable::V16>(),
    }
}
