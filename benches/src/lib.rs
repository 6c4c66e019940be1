//! The standard benchmark suite of attn: one table of shapes that the
//! criterion benches, `cargo xtask bench` and the report share, and the
//! helpers that build each case's problem and data.

pub mod candle_backends;
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
    /// The smallest run of `cargo xtask bench` that times it.
    pub tier: Tier,
    /// Microseconds of busy work on the calling thread before each timed
    /// call (not counted in its time), as an engine's projections come
    /// between its decode steps: the pools' threads go idle meanwhile.
    /// 0: calls back to back.
    pub gap_us: u32,
}

/// Which runs of `cargo xtask bench` time a case: `--quick` the `Quick`
/// cases, the default run `Quick` and `Default` (a representative suite
/// in about five minutes on two cores), `--full` every case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// The CI smoke run.
    Quick,
    /// The default run.
    Default,
    /// Only `--full`.
    Full,
}

const fn case(
    name: &'static str,
    (batch, q_heads, kv_heads): (usize, usize, usize),
    (q_len, kv_len, head_dim): (usize, usize, usize),
    mask: MaskKind,
    dtype: DType,
    small: bool,
    tier: Tier,
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
        tier,
        gap_us: 0,
    }
}

/// `c` with `us` microseconds of other work before each call.
const fn after_work(c: BenchCase, us: u32) -> BenchCase {
    BenchCase { gap_us: us, ..c }
}

const NONE: MaskKind = MaskKind::None;
const CAUSAL: MaskKind = MaskKind::Causal;
const SLIDING: MaskKind = MaskKind::Window {
    left: Some(1023),
    right: Some(0),
};
const QUICK: Tier = Tier::Quick;
const STD: Tier = Tier::Default;
const FULL: Tier = Tier::Full;
const F32: DType = DType::F32;
const F16: DType = DType::F16;
const BF16: DType = DType::Bf16;

/// The standard suite, one row per case: name, (batch, q heads, kv heads),
/// (q_len, kv_len, head dim), mask, dtype, small (the f64 reference is timed
/// and used as the check only on small cases), tier (the smallest run that
/// times it: [`Tier`]).
pub const SUITE: &[BenchCase] = &[
    case(
        "tiny/s64-d32",
        (1, 2, 2),
        (64, 64, 32),
        NONE,
        F32,
        true,
        QUICK,
    ),
    case(
        "tiny/s128-d64-causal",
        (1, 2, 2),
        (128, 128, 64),
        CAUSAL,
        F32,
        true,
        QUICK,
    ),
    case(
        "prefill/s512-d64",
        (1, 8, 8),
        (512, 512, 64),
        NONE,
        F32,
        false,
        QUICK,
    ),
    case(
        "prefill/s512-d64-causal",
        (1, 8, 8),
        (512, 512, 64),
        CAUSAL,
        F32,
        false,
        STD,
    ),
    case(
        "prefill/s512-d64-bf16",
        (1, 8, 8),
        (512, 512, 64),
        NONE,
        BF16,
        false,
        STD,
    ),
    case(
        "prefill/s512-d64-causal-bf16",
        (1, 8, 8),
        (512, 512, 64),
        CAUSAL,
        BF16,
        false,
        STD,
    ),
    case(
        "prefill/s512-d128",
        (1, 8, 8),
        (512, 512, 128),
        NONE,
        F32,
        false,
        FULL,
    ),
    case(
        "prefill/s512-d128-causal",
        (1, 8, 8),
        (512, 512, 128),
        CAUSAL,
        F32,
        false,
        FULL,
    ),
    case(
        "prefill/s2048-d64-causal",
        (1, 8, 8),
        (2048, 2048, 64),
        CAUSAL,
        F32,
        false,
        FULL,
    ),
    case(
        "prefill/s2048-d128",
        (1, 8, 8),
        (2048, 2048, 128),
        NONE,
        F32,
        false,
        FULL,
    ),
    case(
        "prefill/s2048-d128-causal",
        (1, 8, 8),
        (2048, 2048, 128),
        CAUSAL,
        F32,
        false,
        QUICK,
    ),
    case(
        "prefill/s8192-d128-causal",
        (1, 8, 8),
        (8192, 8192, 128),
        CAUSAL,
        F32,
        false,
        FULL,
    ),
    case(
        "prefill/s2048-d128-causal-f16",
        (1, 8, 8),
        (2048, 2048, 128),
        CAUSAL,
        F16,
        false,
        FULL,
    ),
    case(
        "prefill/s2048-d128-causal-bf16",
        (1, 8, 8),
        (2048, 2048, 128),
        CAUSAL,
        BF16,
        false,
        STD,
    ),
    case(
        "sliding/s4096-w1024-d128",
        (1, 8, 8),
        (4096, 4096, 128),
        SLIDING,
        F32,
        false,
        STD,
    ),
    case(
        "cross/q256-kv1500-d64",
        (2, 8, 8),
        (256, 1500, 64),
        NONE,
        F32,
        false,
        FULL,
    ),
    case(
        "encoder/b8-h12-s256-d64",
        (8, 12, 12),
        (256, 256, 64),
        NONE,
        F32,
        false,
        STD,
    ),
    case(
        "encoder/b8-h12-s256-d64-bf16",
        (8, 12, 12),
        (256, 256, 64),
        NONE,
        BF16,
        false,
        STD,
    ),
    case(
        "decode/gqa32:8-kv4096-d128",
        (1, 32, 8),
        (1, 4096, 128),
        CAUSAL,
        F32,
        false,
        QUICK,
    ),
    case(
        "decode/gqa32:8-kv4096-d128-bf16",
        (1, 32, 8),
        (1, 4096, 128),
        CAUSAL,
        BF16,
        false,
        STD,
    ),
    after_work(
        case(
            "decode/gqa32:8-kv1024-d128-gap300us",
            (1, 32, 8),
            (1, 1024, 128),
            CAUSAL,
            F32,
            false,
            STD,
        ),
        300,
    ),
    case(
        "decode/gqa32:8-kv16384-d128",
        (1, 32, 8),
        (1, 16384, 128),
        CAUSAL,
        F32,
        false,
        STD,
    ),
    case(
        "decode/gqa32:8-kv32768-d128",
        (1, 32, 8),
        (1, 32768, 128),
        CAUSAL,
        F32,
        false,
        FULL,
    ),
    case(
        "decode/gqa32:8-kv32768-d128-bf16",
        (1, 32, 8),
        (1, 32768, 128),
        CAUSAL,
        BF16,
        false,
        FULL,
    ),
];

/// The long-context memory case: its peak resident memory is measured (in
/// a process of its own) against the bytes of its inputs and outputs.
pub const MEMORY_CASE: BenchCase = case(
    "memory/s32768-d128-causal",
    (1, 8, 8),
    (32768, 32768, 128),
    CAUSAL,
    F32,
    false,
    FULL,
);

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

    /// Deterministic Q, K, V data (uniform in [-1, 1]), generated straight
    /// into the case's element type (no wider temporary).
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
            let mut d = HostData::zeros(self.dtype, n);
            for i in 0..n {
                d.set(i, next());
            }
            d
        };
        let n = |v: &attn_spec::View| v.extent().unwrap_or(0);
        [t(n(&p.q)), t(n(&p.k)), t(n(&p.v))]
    }

    /// FLOPs of the visible pairs (see [`Problem::flops`]).
    pub fn flops(&self) -> f64 {
        self.problem().flops()
    }

    /// Bytes of K and V (what decoding must stream from memory).
    pub fn kv_bytes(&self) -> f64 {
        let p = self.problem();
        let n = p.k.numel().unwrap_or(0) + p.v.numel().unwrap_or(0);
        (n * self.dtype.size_bytes()) as f64
    }

    /// Bytes of Q, K, V and the output.
    pub fn io_bytes(&self) -> f64 {
        let p = self.problem();
        let n = p.q.numel().unwrap_or(0) + p.out.numel().unwrap_or(0);
        self.kv_bytes() + (n * self.dtype.size_bytes()) as f64
    }

    /// Whether this is a decoding case (reported in GB/s too).
    pub fn is_decode(&self) -> bool {
        self.q_len == 1
    }

    /// Spins for [`BenchCase::gap_us`] microseconds on the calling thread
    /// (nothing when 0): the other work before a timed call.
    pub fn other_work(&self) {
        busy_us(f64::from(self.gap_us));
    }

    /// A file- and id-safe form of the name.
    pub fn slug(&self) -> String {
        self.name.replace(['/', ':'], "_")
    }
}

/// Busy work on the calling thread for `us` microseconds (a spin, so the
/// thread stays on its core while other threads go idle).
pub fn busy_us(us: f64) {
    let t = std::time::Instant::now();
    while t.elapsed().as_secs_f64() * 1e6 < us {
        std::hint::spin_loop();
    }
}

/// The time of `iters` calls alone, each made after the case's other
/// work ([`BenchCase::gap_us`]).
pub fn calls_after_work<R>(
    iters: u64,
    case: &BenchCase,
    mut call: impl FnMut() -> R,
) -> std::time::Duration {
    let mut total = std::time::Duration::ZERO;
    for _ in 0..iters {
        case.other_work();
        let t = std::time::Instant::now();
        std::hint::black_box(call());
        total += t.elapsed();
    }
    total
}

/// The report's name of attn-cpu's backward pass.
pub const CPU_BACKWARD: &str = "cpu-bwd";

/// The report's name of attn-cpu with helpers that wait, spinning, for
/// [`CPU_SPIN_FOR`] after each call (`Cpu::with_spin`), timed on the cases
/// with other work between calls ([`has_spin`]): what a user who opts in
/// gets, beside the default `cpu` rows.
pub const CPU_SPIN: &str = "cpu-spin";

/// How long `cpu-spin`'s helpers wait after a call: longer than any
/// case's gap, as a user would set it to span the work between calls.
pub const CPU_SPIN_FOR: std::time::Duration = std::time::Duration::from_millis(1);

/// Whether a case gets `cpu-spin` rows: those with other work before each
/// call (back to back, the pool's threads never go idle).
pub fn has_spin(case: &BenchCase) -> bool {
    case.gap_us > 0
}

/// Whether a case gets backward rows: prefill shapes (training runs no
/// decode steps).
pub fn has_backward(case: &BenchCase) -> bool {
    !case.is_decode()
}

/// The FLOPs a row of `backend` is credited with, as a multiple of the
/// forward's visible-pair FLOPs: 2.5 for a backward pass
/// (FlashAttention's convention: five products where the forward has
/// two), else 1.
pub fn flops_factor(backend: &str) -> f64 {
    if backend.ends_with("-bwd") {
        2.5
    } else {
        1.0
    }
}

/// The backward pass's forward results for `case` (computed by attn-cpu):
/// the problem (asking for the log-sum-exp), the output, the log-sum-exp
/// and a `dO` of values in [-0.45, 0.45].
pub fn backward_inputs(
    case: &BenchCase,
    [q, k, v]: &[attn_spec::HostData; 3],
) -> (attn_spec::Problem, [attn_spec::HostData; 3]) {
    use attn_spec::Backend;
    let mut p = case.problem();
    p.options.return_lse = true;
    let fwd = attn_cpu::Cpu::new()
        .forward(&p, attn_spec::Inputs::new(q, k, v))
        .expect("forward");
    let n = p.out.extent().expect("valid");
    let vals: Vec<f64> = (0..n)
        .map(|i| ((i * 7) % 19) as f64 * 0.05 - 0.45)
        .collect();
    let d_out = attn_spec::HostData::from_f64(p.dtype, &vals);
    (p, [fwd.out, fwd.lse.expect("asked for"), d_out])
}

/// The criterion benchmark id of a backend, case and thread count (also the
/// directory under `target/criterion` that holds its estimates).
pub fn bench_id(backend: &str, case: &BenchCase, threads: usize) -> String {
    format!("{backend}.{}.t{threads}", case.slug())
}

/// Settings passed from `cargo xtask bench` to the criterion binary.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchEnv {
    /// Thread counts to run.
    pub threads: Vec<usize>,
    /// Case names to run (empty: all).
    pub cases: Vec<String>,
    /// Backend names to run (empty: all compiled in).
    pub backends: Vec<String>,
    /// Seconds of measurement per benchmark.
    pub measure_secs: f64,
}

impl BenchEnv {
    /// Reads `ATTN_BENCH_THREADS`, `ATTN_BENCH_CASES`, `ATTN_BENCH_BACKENDS`
    /// (comma-separated) and `ATTN_BENCH_SECS`.
    pub fn from_env() -> Self {
        let list = |k: &str| -> Vec<String> {
            std::env::var(k)
                .unwrap_or_default()
                .split(',')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        };
        let all = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut threads: Vec<usize> = list("ATTN_BENCH_THREADS")
            .iter()
            .filter_map(|t| t.parse().ok())
            .collect();
        if threads.is_empty() {
            threads = if all > 1 { vec![1, all] } else { vec![1] };
        }
        BenchEnv {
            threads,
            cases: list("ATTN_BENCH_CASES"),
            backends: list("ATTN_BENCH_BACKENDS"),
            measure_secs: std::env::var("ATTN_BENCH_SECS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(3.0),
        }
    }

    /// Whether `case` is selected.
    pub fn wants_case(&self, case: &BenchCase) -> bool {
        self.cases.is_empty() || self.cases.iter().any(|c| c == case.name)
    }

    /// Whether `backend` is selected.
    pub fn wants_backend(&self, backend: &str) -> bool {
        self.backends.is_empty() || self.backends.iter().any(|b| b == backend)
    }
}
