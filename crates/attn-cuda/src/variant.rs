//! Kernel variants: what is fixed at compile time (`-D` defines), and
//! therefore what the module cache is keyed on. Only what changes the code
//! is here: element types, head dims and their padding, tile sizes, which
//! optional steps exist, and the target architecture; never a tensor value
//! or a sequence length.

use attn_spec::{DType, MaskKind, Problem};

const COMMON: &str = include_str!("kernels/common.cuh");
const MMA: &str = include_str!("kernels/mma.cu");
const SIMT: &str = include_str!("kernels/simt.cu");
const COMBINE: &str = include_str!("kernels/combine.cu");
const LINEAR: &str = include_str!("kernels/linear.cu");
const BWD: &str = include_str!("kernels/bwd.cu");
const MAPS: &str = include_str!("kernels/maps.cu");

/// Largest head dim (Q/K or V) any kernel is built for.
pub const MAX_HEAD_DIM: usize = 256;

/// Which kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kernel {
    /// Tensor-core forward (`mma.sync.m16n8k16`), f16 and bf16.
    Mma,
    /// [`Kernel::Mma`] compiled with `FAST`: probabilities packed by
    /// `cvt.rn.{bf16,f16}x2.f32`, Q's fragments kept in registers across
    /// key tiles (Q/K head dims up to 128), and the softmax in base 2 on
    /// `ex2.approx` with the scale and log2(e) folded into one multiply
    /// where [`Variant::base2`] allows it.
    /// Opt-in (`HalfKernel::TensorCoreFast`) until it has passed the
    /// conformance suite on a GPU.
    MmaFast,
    /// Plain-FMA forward, f32 arithmetic throughout (any element type).
    Simt,
    /// The split-KV combine pass.
    Combine,
    /// `y = x W^T + b` for the multi-head layer's projections.
    Linear,
    /// Backward: dQ, `D = dO . O` and the bias gradient (a warp per row).
    BwdDq,
    /// Backward: dK and dV (a warp per key).
    BwdDkdv,
    /// Backward: the sinks' gradient (a block per head).
    BwdSinks,
    /// Attention maps from the log-sum-exp (a warp per map row).
    Maps,
}

impl Kernel {
    /// The `extern "C"` function name in the source.
    pub fn function(self) -> &'static str {
        match self {
            Kernel::Mma | Kernel::MmaFast => "attn_mma",
            Kernel::Simt => "attn_simt",
            Kernel::Combine => "attn_combine",
            Kernel::Linear => "attn_linear",
            Kernel::BwdDq => "attn_bwd_dq",
            Kernel::BwdDkdv => "attn_bwd_dkdv",
            Kernel::BwdSinks => "attn_bwd_dsinks",
            Kernel::Maps => "attn_maps",
        }
    }

    /// Threads per block (the `*_WARPS` constants of the sources).
    pub fn threads(self) -> u32 {
        match self {
            Kernel::Mma | Kernel::MmaFast => 4 * 32,
            Kernel::Simt => 8 * 32,
            Kernel::Combine => 4 * 32,
            Kernel::Linear => 16 * 16,
            Kernel::BwdDq | Kernel::BwdDkdv => 8 * 32,
            Kernel::BwdSinks => 256,
            Kernel::Maps => 8 * 32,
        }
    }

    /// Query rows one block owns (forward kernels) or rows per block
    /// (combine: one warp per row).
    pub fn rows_per_block(self) -> usize {
        match self {
            Kernel::Mma | Kernel::MmaFast => 64,
            Kernel::Simt => 8,
            Kernel::Combine => 4,
            Kernel::Linear => 16,
            Kernel::BwdDq | Kernel::BwdDkdv | Kernel::Maps => 8,
            Kernel::BwdSinks => 1,
        }
    }

    /// Head-dim padding unit: the mma k-step and n-tile are 16 and 8 wide
    /// (16 covers both); the SIMT kernel gives each lane whole columns, 32.
    fn pad_unit(self) -> usize {
        match self {
            Kernel::Mma | Kernel::MmaFast => 16,
            _ => 32,
        }
    }
}

/// Everything fixed when a kernel is compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    /// The kernel.
    pub kernel: Kernel,
    /// Element type of Q, K, V and O.
    pub elem: DType,
    /// Element type of the bias, if there is one.
    pub bias: Option<DType>,
    /// A boolean mask tensor.
    pub mask: bool,
    /// A causal or sliding window.
    pub window: bool,
    /// Soft-capping.
    pub softcap: bool,
    /// ALiBi slopes.
    pub alibi: bool,
    /// Attention sinks.
    pub sinks: bool,
    /// Head dim of Q and K.
    pub dqk: usize,
    /// Head dim of V.
    pub dv: usize,
    /// Compute capability, e.g. `(9, 0)`.
    pub arch: (u32, u32),
    /// The tensor-core kernel's decode shape (`KEY_SPLIT` in `mma.cu`):
    /// the block's warps share [`KEY_SPLIT_ROWS`] query rows and split each
    /// key tile between them, for problems whose blocks need no more rows
    /// (see [`Variant::for_problem`]).
    pub key_split: bool,
    /// The fast tensor-core kernel's prefill shape (`WIDE` in `mma.cu`):
    /// each warp owns two m-tiles (32 query rows, [`WIDE_ROWS`] a block),
    /// so each K and V fragment read from shared memory feeds two
    /// `mma.sync`, as in FlashAttention-2 (see [`Variant::wide_ok`]).
    pub wide: bool,
}

/// Rows of a block of the tensor-core kernel under `key_split`: one warp's
/// m-tile of 16.
pub const KEY_SPLIT_ROWS: usize = 16;

/// Rows of a block of the tensor-core kernel under `wide`: two m-tiles
/// per warp.
pub const WIDE_ROWS: usize = 128;

/// `x` rounded up to a multiple of `unit`.
pub fn pad(x: usize, unit: usize) -> usize {
    x.div_ceil(unit) * unit
}

fn elem_code(d: DType) -> u32 {
    match d {
        DType::F16 => 1,
        DType::Bf16 => 2,
        _ => 0,
    }
}

impl Variant {
    /// The variant of `kernel` that computes `problem` on `arch`.
    ///
    /// The tensor-core kernels split keys between a block's warps
    /// (`key_split`) when a block needs at most [`KEY_SPLIT_ROWS`] rows:
    /// `q_len` times the GQA group, which [`crate::plan::ForwardPlan`] packs
    /// into one block below 64 query rows (decoding: a 32:8 step has 4
    /// rows), and when each warp's quarter of a key tile is a whole k-step
    /// of 16 keys (`block_n` 64). The fast tensor-core kernel takes the
    /// wide shape (`wide`) for at least [`WIDE_ROWS`] query rows where
    /// [`Variant::wide_ok`] allows it.
    pub fn for_problem(kernel: Kernel, problem: &Problem, arch: (u32, u32)) -> Self {
        let o = &problem.options;
        let s = problem.shape;
        let mut v = Variant {
            kernel,
            elem: problem.dtype,
            bias: problem.bias.map(|b| b.dtype),
            mask: problem.mask.is_some(),
            window: o.mask != MaskKind::None,
            softcap: o.softcap.is_some(),
            alibi: o.alibi_slopes.is_some(),
            sinks: o.sinks.is_some(),
            dqk: s.head_dim_qk,
            dv: s.head_dim_v,
            arch,
            key_split: false,
            wide: false,
        };
        let group = s.q_heads / s.kv_heads.max(1);
        v.key_split = matches!(kernel, Kernel::Mma | Kernel::MmaFast)
            && s.q_len * group.max(1) <= KEY_SPLIT_ROWS
            && v.block_n() == 64;
        v.wide = s.q_len >= WIDE_ROWS && Variant { wide: true, ..v }.wide_ok();
        v
    }

    /// Whether this variant may take the wide shape: the fast kernel,
    /// not split, softmax in base 2 ([`Variant::base2`]: no soft-cap,
    /// ALiBi or bias), no mask tensor and no sinks, and both head dims
    /// padded to at most 128. Beyond that, the score and output registers
    /// of two m-tiles spill (ptxas, `cargo xtask cuda-check`), as they do
    /// at Q/K and V dims of 128 with 64-key tiles: the wide shape takes 32
    /// keys per tile above 64 dims ([`Variant::block_n`]).
    pub fn wide_ok(&self) -> bool {
        self.kernel == Kernel::MmaFast
            && !self.key_split
            && self.base2()
            && !self.mask
            && !self.sinks
            && self.dqk_pad() <= 128
            && self.dv_pad() <= 128
    }

    /// Query rows per block of this variant's kernel.
    pub fn rows_per_block(&self) -> usize {
        match (self.key_split, self.wide) {
            (true, _) => KEY_SPLIT_ROWS,
            (false, true) => WIDE_ROWS,
            (false, false) => self.kernel.rows_per_block(),
        }
    }

    /// The projection kernel for `elem` on `arch` (no attention options).
    pub fn linear(elem: DType, arch: (u32, u32)) -> Self {
        Variant {
            kernel: Kernel::Linear,
            elem,
            bias: None,
            mask: false,
            window: false,
            softcap: false,
            alibi: false,
            sinks: false,
            dqk: 1,
            dv: 1,
            arch,
            key_split: false,
            wide: false,
        }
    }

    /// Padded head dim of Q/K inside the kernel.
    pub fn dqk_pad(&self) -> usize {
        pad(self.dqk.max(1), self.kernel.pad_unit())
    }

    /// Padded head dim of V inside the kernel.
    pub fn dv_pad(&self) -> usize {
        pad(self.dv.max(1), self.kernel.pad_unit())
    }

    /// Keys per tile of the mma kernel: 64, or 32 when V's head dim is over
    /// 128 (the output accumulator then takes half the registers; fewer
    /// score registers keep the total under the 255 a thread may have), or
    /// in the wide shape when a head dim is over 64 (two m-tiles' outputs).
    pub fn block_n(&self) -> usize {
        let wide_big = self.wide && self.dqk_pad().max(self.dv_pad()) > 64;
        if self.dv_pad() > 128 || wide_big {
            32
        } else {
            64
        }
    }

    /// Whether the fast tensor-core kernel runs its softmax in base 2
    /// (`BASE2`): where no soft-cap, ALiBi or bias changes the scores, whose
    /// roundings the conformance bound already counts (`mma.cu`).
    pub fn base2(&self) -> bool {
        self.kernel == Kernel::MmaFast && !self.softcap && !self.alibi && self.bias.is_none()
    }

    /// Dynamic shared memory per block, bytes.
    pub fn smem_bytes(&self) -> usize {
        let (dq, dv) = (self.dqk_pad(), self.dv_pad());
        match self.kernel {
            Kernel::Mma | Kernel::MmaFast => {
                // Q, then two stages of K and V (which the key split's
                // merge reuses).
                let bn = self.block_n();
                2 * (self.rows_per_block() * (dq + 8) + 2 * (bn * (dq + 8) + bn * (dv + 8)))
            }
            Kernel::Simt => 4 * (32 * (dq + 1) + 32 * (dv + 1) + 8 * dq),
            Kernel::BwdDq => 4 * (32 * (dq + 1) + 32 * (dv + 1) + 8 * dq + 8 * dv),
            Kernel::BwdDkdv => 4 * (32 * (dq + 1) + 32 * (dv + 1) + 8 * dq + 8 * dv + 64),
            Kernel::Combine | Kernel::Linear | Kernel::BwdSinks | Kernel::Maps => 0,
        }
    }

    /// The `-D` lines this variant is compiled with.
    pub fn defines(&self) -> String {
        let b = |x: bool| u32::from(x);
        let bias = match self.bias {
            None => 0,
            Some(DType::F16) => 2,
            Some(DType::Bf16) => 3,
            Some(_) => 1,
        };
        let mut s = String::new();
        for (k, v) in [
            ("ELEM", elem_code(self.elem) as usize),
            ("BIAS_KIND", bias),
            ("HAS_MASK", b(self.mask) as usize),
            ("HAS_WINDOW", b(self.window) as usize),
            ("HAS_SOFTCAP", b(self.softcap) as usize),
            ("HAS_ALIBI", b(self.alibi) as usize),
            ("HAS_SINKS", b(self.sinks) as usize),
            ("DQK", self.dqk),
            ("DV", self.dv),
            ("DQK_PAD", self.dqk_pad()),
            ("DV_PAD", self.dv_pad()),
            ("BLOCK_N", self.block_n()),
            ("FAST", b(self.kernel == Kernel::MmaFast) as usize),
            ("BASE2", b(self.base2()) as usize),
            ("KEY_SPLIT", b(self.key_split) as usize),
            ("WIDE", b(self.wide) as usize),
        ] {
            s.push_str(&format!("#define {k} {v}\n"));
        }
        s
    }

    /// The whole translation unit NVRTC compiles.
    pub fn source(&self) -> String {
        let body = match self.kernel {
            Kernel::Mma | Kernel::MmaFast => MMA,
            Kernel::Simt => SIMT,
            Kernel::Combine => COMBINE,
            Kernel::Linear => LINEAR,
            Kernel::BwdDq | Kernel::BwdDkdv | Kernel::BwdSinks => BWD,
            Kernel::Maps => MAPS,
        };
        format!("{}{COMMON}\n{body}\n", self.defines())
    }

    /// `sm_XY` of the target.
    pub fn arch_name(&self) -> &'static str {
        arch_name(self.arch)
    }

    /// A short name for reports.
    pub fn describe(&self) -> String {
        let mut f = Vec::new();
        if self.kernel == Kernel::MmaFast {
            f.push("fast".to_string());
        }
        if self.key_split {
            f.push("key-split".to_string());
        }
        if self.wide {
            f.push("wide".to_string());
        }
        if let Some(b) = self.bias {
            f.push(format!("bias:{b}"));
        }
        for (on, name) in [
            (self.mask, "mask"),
            (self.window, "window"),
            (self.softcap, "softcap"),
            (self.alibi, "alibi"),
            (self.sinks, "sinks"),
        ] {
            if on {
                f.push(name.into());
            }
        }
        format!(
            "{} {} d{}/{} {} [{}]",
            self.kernel.function(),
            self.elem,
            self.dqk,
            self.dv,
            self.arch_name(),
            f.join(",")
        )
    }
}

/// `sm_XY` for a compute capability NVRTC knows (newer ones compile for
/// the newest known, which the driver runs through PTX).
pub fn arch_name(arch: (u32, u32)) -> &'static str {
    match arch {
        (5, 0) => "sm_50",
        (5, 2) => "sm_52",
        (5, 3) => "sm_53",
        (6, 0) => "sm_60",
        (6, 1) => "sm_61",
        (6, 2) => "sm_62",
        (7, 0) => "sm_70",
        (7, 2) => "sm_72",
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, _) => "sm_90",
        (m, _) if m >= 10 => "sm_90",
        (8, _) => "sm_80",
        _ => "sm_50",
    }
}

/// The variants `cargo xtask cuda-check` compiles for `arch`: every kernel
/// and element type it runs on, at every head-dim padding class (16 to
/// 256, including dims that are not a multiple of 16 or 32, and Q/K dims
/// that differ from V's), each with no optional step and with all of them.
pub fn check_variants(arch: (u32, u32)) -> Vec<Variant> {
    let dims: [(usize, usize); 9] = [
        (16, 16),
        (32, 32),
        (64, 64),
        (72, 72),
        (80, 96),
        (128, 128),
        (192, 128),
        (256, 256),
        (100, 40),
    ];
    let mut out = Vec::new();
    for (kernel, elems) in [
        (Kernel::Mma, &[DType::F16, DType::Bf16][..]),
        (Kernel::MmaFast, &[DType::F16, DType::Bf16][..]),
        (Kernel::Simt, &[DType::F32, DType::F16, DType::Bf16][..]),
        (Kernel::Combine, &[DType::F32, DType::F16, DType::Bf16][..]),
        (Kernel::BwdDq, &[DType::F32, DType::F16, DType::Bf16][..]),
        (Kernel::BwdDkdv, &[DType::F32, DType::F16, DType::Bf16][..]),
        (Kernel::Maps, &[DType::F32, DType::F16, DType::Bf16][..]),
    ] {
        for &elem in elems {
            // The backward kernels' registers follow the padded dims (a
            // multiple of 32): one pair per padding class and the uneven one.
            let bwd = matches!(kernel, Kernel::BwdDq | Kernel::BwdDkdv | Kernel::Maps);
            let pairs = dims.iter().filter(|d| {
                !bwd || matches!(
                    d,
                    (32, 32) | (128, 128) | (192, 128) | (256, 256) | (100, 40)
                )
            });
            for &(dqk, dv) in pairs {
                for all in [false, true] {
                    let v = Variant {
                        kernel,
                        elem,
                        bias: all.then_some(DType::F32),
                        mask: all,
                        window: all,
                        softcap: all,
                        alibi: all,
                        sinks: all,
                        dqk,
                        dv,
                        arch,
                        key_split: false,
                        wide: false,
                    };
                    out.push(v);
                    // The decode shape, where the tiles allow it.
                    if matches!(kernel, Kernel::Mma | Kernel::MmaFast) && v.block_n() == 64 {
                        out.push(Variant {
                            key_split: true,
                            ..v
                        });
                    }
                    // The prefill shape of the fast kernel, where allowed.
                    let wide = Variant { wide: true, ..v };
                    if wide.wide_ok() {
                        out.push(wide);
                    }
                }
            }
        }
    }
    // The fast kernel's base-2 softmax with the options it keeps (masks,
    // windows, sinks) and without those that send it back to natural units;
    // its wide shape with a window (causal prefill).
    for elem in [DType::F16, DType::Bf16] {
        for (dqk, dv) in [(64, 64), (128, 128)] {
            out.push(Variant {
                kernel: Kernel::MmaFast,
                elem,
                bias: None,
                mask: true,
                window: true,
                softcap: false,
                alibi: false,
                sinks: true,
                dqk,
                dv,
                arch,
                key_split: false,
                wide: false,
            });
            let all = out[out.len() - 1];
            out.push(Variant {
                key_split: true,
                ..all
            });
            let windowed = Variant {
                mask: false,
                sinks: false,
                wide: true,
                ..all
            };
            assert!(windowed.wide_ok());
            out.push(windowed);
        }
        // The wide shape's largest registers: V's head dim 128 with Q/K's
        // small (Q then stays in shared memory) or not, with and without a
        // window.
        for (dqk, dv) in [(16, 128), (64, 128), (96, 128)] {
            for window in [false, true] {
                let v = Variant {
                    kernel: Kernel::MmaFast,
                    elem,
                    bias: None,
                    mask: false,
                    window,
                    softcap: false,
                    alibi: false,
                    sinks: false,
                    dqk,
                    dv,
                    arch,
                    key_split: false,
                    wide: true,
                };
                assert!(v.wide_ok());
                out.push(v);
            }
        }
    }
    for elem in [DType::F32, DType::F16, DType::Bf16] {
        out.push(Variant::linear(elem, arch));
    }
    // The sinks' gradient reads only the log-sum-exp and D.
    for sinks in [false, true] {
        out.push(Variant {
            kernel: Kernel::BwdSinks,
            sinks,
            ..Variant::linear(DType::F32, arch)
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_spec::{AttnOptions, Shape};

    #[test]
    fn padding_and_tiles() {
        assert_eq!(pad(72, 16), 80);
        assert_eq!(pad(72, 32), 96);
        assert_eq!(pad(128, 16), 128);
        let p = Problem::new(
            Shape::new(1, 2, 1, 3, 4, 72).with_head_dim_v(200),
            DType::F16,
        );
        let v = Variant::for_problem(Kernel::Mma, &p, (9, 0));
        assert_eq!((v.dqk_pad(), v.dv_pad(), v.block_n()), (80, 208, 32));
        // Q [64][88], two stages of K [32][88] and V [32][216], 2 bytes each.
        assert_eq!(v.smem_bytes(), 2 * (64 * 88 + 2 * (32 * 88 + 32 * 216)));
        let s = Variant::for_problem(Kernel::Simt, &p, (9, 0));
        assert_eq!((s.dqk_pad(), s.dv_pad()), (96, 224));
    }

    #[test]
    fn the_key_holds_what_changes_the_code_and_nothing_else() {
        let shape = Shape::new(2, 4, 2, 100, 300, 64);
        let a = Problem::new(shape, DType::Bf16).with_options(AttnOptions::default().causal());
        // Other lengths, batch, heads, scale and window sizes: same code.
        let b = Problem::new(Shape::new(3, 8, 8, 70, 5000, 64), DType::Bf16).with_options(
            AttnOptions::default()
                .window(Some(3), Some(9))
                .scale(0.5)
                .with_lse(),
        );
        let (va, vb) = (
            Variant::for_problem(Kernel::Mma, &a, (9, 0)),
            Variant::for_problem(Kernel::Mma, &b, (9, 0)),
        );
        assert_eq!(va, vb);
        assert_eq!(va.source(), vb.source());
        // Blocks of at most 16 rows (query rows x GQA group): the decode
        // shape, whose warps split the keys; not where a tile's quarter is
        // under 16 keys (V's head dim over 128) or the rows are more.
        let decode = |q_heads, q_len, dv| {
            let s = Shape::new(1, q_heads, 2, q_len, 5000, 64).with_head_dim_v(dv);
            Variant::for_problem(Kernel::Mma, &Problem::new(s, DType::Bf16), (9, 0))
        };
        let vs = decode(8, 1, 64);
        assert!(vs.key_split && vs.defines().contains("#define KEY_SPLIT 1\n"));
        assert_eq!((vs.rows_per_block(), va.rows_per_block()), (16, 64));
        assert!(va.defines().contains("#define KEY_SPLIT 0\n"));
        assert!(decode(2, 16, 64).key_split && decode(8, 4, 128).key_split);
        assert!(!decode(8, 5, 64).key_split && !decode(2, 17, 64).key_split);
        assert!(!decode(8, 1, 200).key_split && !decode(64, 1, 64).key_split);
        assert!(
            !Variant::for_problem(
                Kernel::Simt,
                &Problem::new(Shape::new(1, 8, 2, 1, 50, 64), DType::Bf16),
                (9, 0)
            )
            .key_split
        );
        // A different dtype, head dim, option or arch: a different module.
        let c = Problem::new(shape, DType::F16).with_options(AttnOptions::default().causal());
        assert_ne!(va, Variant::for_problem(Kernel::Mma, &c, (9, 0)));
        assert_ne!(va, Variant::for_problem(Kernel::Mma, &a, (8, 0)));
        let d = a
            .clone()
            .with_options(AttnOptions::default().causal().softcap(30.0));
        let vd = Variant::for_problem(Kernel::Mma, &d, (9, 0));
        assert_ne!(va, vd);
        assert!(vd.defines().contains("#define HAS_SOFTCAP 1\n"));
        assert!(va.defines().contains("#define HAS_SOFTCAP 0\n"));
        // The fast tensor-core kernel: the same source, another module.
        let vf = Variant::for_problem(Kernel::MmaFast, &a, (9, 0));
        assert_ne!(va, vf);
        assert!(vf.defines().contains("#define FAST 1\n"));
        assert!(va.defines().contains("#define FAST 0\n"));
        // Its softmax in base 2 unless soft-cap, ALiBi or a bias change
        // the scores (masks, windows and sinks keep it).
        assert!(vf.defines().contains("#define BASE2 1\n"));
        assert!(va.defines().contains("#define BASE2 0\n"));
        let kept = a
            .clone()
            .with_options(AttnOptions::default().causal().sinks(vec![0.5; 4]));
        assert!(Variant::for_problem(Kernel::MmaFast, &kept, (9, 0)).base2());
        for natural in [
            d.clone(),
            a.clone()
                .with_options(AttnOptions::default().alibi(vec![0.1; 4])),
            a.clone()
                .with_bias(attn_spec::View::contiguous([2, 4, 100, 300]), DType::F32),
        ] {
            assert!(!Variant::for_problem(Kernel::MmaFast, &natural, (9, 0)).base2());
        }
        assert_eq!(
            (vf.smem_bytes(), vf.block_n()),
            (va.smem_bytes(), va.block_n())
        );
        // The wide prefill shape: the fast kernel from 128 query rows, with
        // a window but without sinks, a mask tensor or what leaves base 2,
        // at head dims up to 128 (32-key tiles above 64).
        let prefill = |dqk: usize, dv: usize, o: AttnOptions| {
            let s = Shape::new(1, 8, 2, 128, 300, dqk).with_head_dim_v(dv);
            Variant::for_problem(
                Kernel::MmaFast,
                &Problem::new(s, DType::F16).with_options(o),
                (9, 0),
            )
        };
        let w = prefill(64, 64, AttnOptions::default().causal());
        assert!(
            w.wide && w.defines().contains("#define WIDE 1\n") && w.describe().contains("wide")
        );
        assert_eq!((w.rows_per_block(), w.block_n()), (WIDE_ROWS, 64));
        assert_eq!(w.smem_bytes(), 2 * (128 * 72 + 2 * (64 * 72 + 64 * 72)));
        assert_eq!(prefill(128, 128, AttnOptions::default()).block_n(), 32);
        assert_eq!(prefill(80, 32, AttnOptions::default()).block_n(), 32);
        assert!(!vf.wide && vf.defines().contains("#define WIDE 0\n"));
        for narrow in [
            prefill(144, 64, AttnOptions::default()),
            prefill(64, 136, AttnOptions::default()),
            prefill(64, 64, AttnOptions::default().sinks(vec![0.0; 8])),
            prefill(64, 64, AttnOptions::default().softcap(5.0)),
            prefill(64, 64, AttnOptions::default().alibi(vec![0.1; 8])),
        ] {
            assert!(!narrow.wide && narrow.rows_per_block() == 64, "{narrow:?}");
        }
        let masked = Problem::new(Shape::new(1, 8, 2, 128, 300, 64), DType::F16)
            .with_mask(attn_spec::View::contiguous([1, 1, 128, 300]));
        assert!(!Variant::for_problem(Kernel::MmaFast, &masked, (9, 0)).wide);
        let plain = Problem::new(Shape::new(1, 8, 2, 128, 300, 64), DType::F16);
        assert!(!Variant::for_problem(Kernel::Mma, &plain, (9, 0)).wide);
    }

    /// The `__launch_bounds__` of kernel `function` in `src` (written out,
    /// or through a macro such as `MMA_BOUNDS`: every definition of it):
    /// the thread counts, with the source's `#define`s substituted
    /// (products of names and integers).
    fn launch_bounds(src: &str, function: &str) -> Vec<usize> {
        fn eval(expr: &str, src: &str) -> usize {
            expr.split('*')
                .map(|f| {
                    let f = f.trim();
                    f.parse().unwrap_or_else(|_| {
                        let def = format!("#define {f} ");
                        let at = src.find(&def).unwrap_or_else(|| panic!("no {def}"));
                        eval(src[at + def.len()..].lines().next().unwrap(), src)
                    })
                })
                .product()
        }
        // The first argument of the `__launch_bounds__(` that `s` starts with.
        let first_arg = |s: &str| {
            let inner = &s["__launch_bounds__(".len()..];
            inner[..inner.find([',', ')']).unwrap()].to_string()
        };
        let ident = |s: &str| -> String {
            s.trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        };
        for (at, _) in src.match_indices("__global__ void") {
            let rest = src[at + "__global__ void".len()..].trim_start();
            let (exprs, after) = match rest.strip_prefix("__launch_bounds__(") {
                Some(r) => (vec![first_arg(rest)], &r[r.find(')').unwrap() + 1..]),
                None => {
                    // A macro name, then the kernel's.
                    let m = ident(rest);
                    assert!(m != function, "{function}: no __launch_bounds__");
                    let def = format!("#define {m} __launch_bounds__(");
                    let exprs = src
                        .match_indices(&def)
                        .map(|(d, _)| first_arg(&src[d + def.len() - 18..]))
                        .collect();
                    (exprs, &rest[m.len()..])
                }
            };
            if ident(after) == function {
                assert!(!exprs.is_empty(), "{function}: no __launch_bounds__");
                return exprs.iter().map(|e| eval(e, src)).collect();
            }
        }
        panic!("no kernel {function}")
    }

    /// A kernel launched with more threads than its `__launch_bounds__`
    /// fails on a GPU, which the emulator (where the bound is an empty
    /// macro) would not show: every kernel's bound in its source, under
    /// each variant's defines, is the block size the host launches.
    #[test]
    fn launches_match_the_kernels_launch_bounds() {
        for v in check_variants((9, 0)) {
            let src = v.source();
            for bound in launch_bounds(&src, v.kernel.function()) {
                assert_eq!(bound, v.kernel.threads() as usize, "{}", v.describe());
            }
        }
    }

    #[test]
    fn every_compute_capability_gets_a_target_nvrtc_knows() {
        assert_eq!(arch_name((7, 0)), "sm_70");
        assert_eq!(arch_name((8, 6)), "sm_86");
        assert_eq!(arch_name((8, 8)), "sm_80");
        assert_eq!(arch_name((9, 0)), "sm_90");
        assert_eq!(arch_name((12, 0)), "sm_90");
        assert_eq!(arch_name((6, 1)), "sm_61");
    }

    #[test]
    fn the_check_set_covers_every_kernel_and_type() {
        let v = check_variants((8, 0));
        for k in [
            Kernel::Mma,
            Kernel::MmaFast,
            Kernel::Simt,
            Kernel::Combine,
            Kernel::Linear,
            Kernel::BwdDq,
            Kernel::BwdDkdv,
            Kernel::BwdSinks,
            Kernel::Maps,
        ] {
            assert!(v.iter().any(|x| x.kernel == k));
        }
        assert!(v
            .iter()
            .any(|x| x.kernel == Kernel::Mma && x.elem == DType::Bf16 && x.dv == 256 && x.sinks));
        assert!(v
            .iter()
            .all(|x| x.kernel != Kernel::Mma || x.elem != DType::F32));
    }
}
