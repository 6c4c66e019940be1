//! The standard benchmark suite of attn: one table of shapes that the
//! criterion benches, `cargo xtask bench` and the report share, and the
//! helpers that build each case's problem and data.

pub mod machine;

use attn_spec::{AttnOptions, DType, HostData, MaskKind, Problem, Shape};

/// One benchmark shape.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchCase {
    /// Stable name used in reports (`family/details`).
    pub name: &'static str,
    /// Batch entries.
    pub batch: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Query rows.
    pub q_len: usize,
    /// Keys.
    pub kv_len: usize,
    /// Head dimension (Q, K and V).
    pub head_dim: usize,
    /// Mask kind.
    pub mask: MaskKind,
    /// Element type.
    pub dtype: DType,
    /// Small enough for the f64 reference to be timed.
    pub small: bool,
}

const fn case(
    name: &'static str,
    (batch, q_heads, kv_heads): (usize, usize, usize),
    (q_len, kv_len, head_dim): (usize, usize, usize),
    mask: MaskKind,
    dtype: DType,
    small: bool,
) -> BenchCase {
    BenchCase {
        name,
        batch,
        q_heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
        mask,
        dtype,
        small,
    }
}

const NONE: MaskKind = MaskKind::None;
const CAUSAL: MaskKind = MaskKind::Causal;
const F32: DType = DType::F32;

/// The suite: (batch, q heads, kv heads), (q_len, kv_len, head dim), mask,
/// dtype, small.
pub const SUITE: &[BenchCase] = &[
    case("tiny/s64-d32", (1, 2, 2), (64, 64, 32), NONE, F32, true),
    case(
        "tiny/s128-d64-causal",
        (1, 2, 2),
        (128, 128, 64),
        CAUSAL,
        F32,
        true,
    ),
    case(
        "prefill/s512-d64",
        (1, 8, 8),
        (512, 512, 64),
        NONE,
        F32,
        false,
    ),
    case(
        "prefill/s512-d64-causal",
        (1, 8, 8),
        (512, 512, 64),
        CAUSAL,
        F32,
        false,
    ),
    case(
        "prefill/s512-d128",
        (1, 8, 8),
        (512, 512, 128),
        NONE,
        F32,
        false,
    ),
    case(
        "prefill/s2048-d128-causal",
        (1, 8, 8),
        (2048, 2048, 128),
        CAUSAL,
        F32,
        false,
    ),
    case(
        "decode/gqa32:8-kv4096-d128",
        (1, 32, 8),
        (1, 4096, 128),
        NONE,
        F32,
        false,
    ),
    case(
        "encoder/b8-h12-s256-d64",
        (8, 12, 12),
        (256, 256, 64),
        NONE,
        F32,
        false,
    ),
];

impl BenchCase {
    /// The problem of this case (contiguous BSHD, default scale).
    pub fn problem(&self) -> Problem {
        let shape = Shape::new(
            self.batch,
            self.q_heads,
            self.kv_heads,
            self.q_len,
            self.kv_len,
            self.head_dim,
        );
        Problem::new(shape, self.dtype).with_options(AttnOptions::default().mask(self.mask))
    }

    /// Deterministic Q, K, V data (uniform in [-1, 1]).
    pub fn data(&self) -> [HostData; 3] {
        let p = self.problem();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        };
        let mut t = |n: usize| {
            let v: Vec<f64> = (0..n).map(|_| next()).collect();
            HostData::from_f64(self.dtype, &v)
        };
        let n = |v: &attn_spec::View| v.extent().unwrap_or(0);
        [t(n(&p.q)), t(n(&p.k)), t(n(&p.v))]
    }

    /// FLOPs of the visible pairs (see [`Problem::flops`]).
    pub fn flops(&self) -> f64 {
        self.problem().flops()
    }
}
