//! Every tuning constant of attn-cpu, with its hardware reason.
//!
//! The kernel computes the transposed score tile `S^T = K Q^T` of one block
//! of query rows against [`KEYS`] keys at a time, with the query rows along
//! the SIMD lanes (see `tiling.rs` for why). Sizes for a core with 32
//! vector registers of 16 f32 (AVX-512), a 32-48 KiB L1 data cache and a 1-2
//! MiB L2 (AMD Zen 4/5, Intel server cores):
//!
//! - A block is [`ROWS`] = 64 query rows (4 vectors) when the problem has
//!   that many rows per key/value head, so each key and value element is
//!   loaded once per 64 rows: 16 flops per byte at head dim 128, well under
//!   cache bandwidth. Blocks of at most 16 rows (decoding: one position
//!   times the GQA group) use 1 vector instead, so no lanes are wasted on
//!   rows that do not exist.
//! - [`KEYS`] = 128 keys per step: the softmax bookkeeping per tile (row
//!   maxima, rescale factors, the accumulator reload in the `P V` kernel)
//!   is amortised over twice the keys of a 64-key tile, which measured
//!   about 10% faster at head dim 64 and 128 on this project's Zen 4
//!   machine (`cargo run -p attn-benches --release --example perf`), even
//!   though the probability tile (`128 x 64` f32 = 32 KiB) then lives in L2.
//! - [`DECODE_KEYS`] = 64 keys per step of the decode path: one tile of K
//!   and V for all heads of a GQA 32:8, d = 128 model is 512 KiB in f32,
//!   half of a 1 MiB L2, which holds it while the next tile is prefetched
//!   (half a tile ahead: `decode.rs`). Measured (`cargo run -p
//!   attn-benches --release --example perf`, decode 32768 keys): 128 keys
//!   doubled the time (the tiles no longer fit and the lockstep traversal
//!   is not taken); 32 was no faster than 64 at first, and in s24 (Zen 4,
//!   before the prefetch went half a tile ahead) 8% faster from memory
//!   but 7-14% slower with the rows in L3.
//! - The microkernels' shapes (keys or value columns per call, `mr`, and
//!   vectors of rows per call) belong to each SIMD level's register file
//!   and live with it (`Vector::mr`, `Vector::KERNEL_VECS` in `simd/`):
//!   AVX-512 keeps 24 of its 32 registers in accumulators (6 keys x 4
//!   vectors, 12 x 1-2, 8 x 3), AVX2 12 of its 16 (6 keys x 1 vector of
//!   two registers; 3 keys x 2 vectors needed 17 and spilled), the
//!   portable level 8 of 16 on x86-64 (2 keys x 1 vector of four SSE
//!   registers).
//! - [`PREFETCH_SPAN_BYTES`] = 512 KiB: a prefill block prefetches the
//!   next key tile's K and V rows into L2 while it computes a tile, unless
//!   the K and V rows of its whole key span fit in half of a 1 MiB L2 and
//!   the previous block on its thread was of the same head: blocks of one
//!   head run one after another, so such a span is still in L2 from the
//!   previous block, and the prefetches only occupy the miss buffers.
//!   (Under a sliding window a block's newly visible keys are not in L2
//!   yet; the kernel then waits on them.) Measured (1 thread, alternating
//!   runs in one process): without the prefetch S = 512, d = 128 (512 KiB of K and V) ran about
//!   3% faster; with it S = 8192 causal ran 15% faster.
//! - [`PACKED_V_BYTES`] = 512 KiB: value rows are packed (`pack.rs`) before
//!   the `P V` kernel reads them; a thread keeps a head's packed rows across
//!   its blocks when they fit in this many bytes (S <= 910 at d = 128,
//!   1638 at d = 64), half of a 1 MiB L2 beside that head's K. Beyond
//!   that, two blocks of a head run as one pass over the keys
//!   (`schedule::units`), so each tile's values are packed, and its K and
//!   V rows brought in, once per 128 rows instead of per 64. Only problems
//!   of at least [`PAIR_MIN_BLOCKS`] = 32 blocks pair them, so that the
//!   units of work stay at least [`MIN_WORK_ITEMS`].
//! - [`SPLIT_KEYS`] = 1024: decoding (few query rows, long K/V) splits the
//!   keys into chunks of this many, computed in parallel and merged with
//!   `merge_states`. It is a constant, never derived from the thread count,
//!   so results are bitwise identical for any number of threads.
//! - [`MIN_WORK_ITEMS`] = 16: keys are split only when a problem has fewer
//!   row blocks than this (see `work::split_keys`): enough blocks to keep
//!   any core count of a workstation busy otherwise.

/// Query rows per block of the backward pass: a multiple of every level's
/// `mr(1)` (2, 6, 12) so the products' row loops need no remainder, and
/// large enough that a key block's packed K, K^T and V^T (144 KiB at d =
/// 128 and 96 keys, f32) are reused by 96 rows. One query block's Q and
/// dO rows, its three 96 x 96 tiles, a key block's packed rows and its dK
/// and dV accumulators take about 500 KiB at d = 128: L2-resident on the
/// target cores (1-2 MiB of L2 each).
pub const BWD_ROWS: usize = 96;

/// Most keys per block of the backward pass, and the row stride of its
/// key-block buffers and tiles: six vectors of 16, a multiple of every
/// level's `mr(1)` (the dK and dV products run over keys). A block of 96
/// keys halves the per-block work (packing K, K^T and V^T, each tile's
/// set-up) against 48 and lengthens the dQ product's sum: measured
/// (`BWD=1` in the `perf` example, Zen 4, one thread, alternating runs)
/// +1-3% on f32 problems without a causal or sliding window, +3-6% on
/// bf16 on `vdpbf16ps` (S = 512 and 2048, causal or not, the encoder).
pub const BWD_KEYS: usize = 96;

/// Keys per block of the backward pass for f32 products under a causal or
/// sliding window: a diagonal block computes its masked triangle whole,
/// and a 96-key block's triangle cost 1-6% there (S = 128 to 2048, Zen 4),
/// more than the halved block work won. The bf16 products on `vdpbf16ps`
/// run twice as fast, so their per-block work weighs more: they keep 96.
pub const BWD_KEYS_BANDED: usize = 48;

// Both block sizes: multiples of 16 (whole vectors of keys) and of every
// level's mr(1) (12, 6, 2), the larger the buffers' stride.
const _: () = assert!(
    BWD_KEYS.is_multiple_of(48)
        && BWD_KEYS_BANDED.is_multiple_of(48)
        && BWD_KEYS_BANDED <= BWD_KEYS
);

/// A backward task packs its Q and dO rows (all heads of its GQA group)
/// into f32 panels once, for all its key blocks, when they take at most
/// this many bytes (per thread: the memory bound of this choice);
/// otherwise each tile packs its own rows. Measured (`BWD=1` in the
/// `perf` example, Zen 3): packing per tile spent 18% of the task in
/// cache-missing loads on encoder b8 h12 s256 d64 (rows of a `[b, s, h,
/// d]` tensor are `h * d` apart), 47 -> 61 GFLOP/s with panels; S = 8192,
/// d = 128 causal (8 MiB of panels) ran at 65.6 / 114.6 GFLOP/s on 1 / 2
/// threads with a 4 MiB limit and 70.9 / 125.8 with this one.
pub const BWD_PANEL_BYTES: usize = 16 << 20;

/// The backward pass cuts each (batch, K/V head) unit's key blocks into
/// chunks until there are at least this many tasks (see `backward/`), a
/// function of the shape only: results never depend on the thread count.
pub const BWD_MIN_TASKS: usize = 16;

/// Width of the SIMD vector in f32 lanes.
pub const LANES: usize = 16;

/// Vectors of query rows in a full block.
pub const ROW_VECS: usize = 4;

/// Query rows in a full block.
pub const ROWS: usize = ROW_VECS * LANES;

/// Keys per step of the inner loop.
pub const KEYS: usize = 128;

/// Keys per step of the decode path.
pub const DECODE_KEYS: usize = 64;

/// A block whose K and V rows span at most this many bytes does not
/// prefetch them (they are in L2 already).
pub const PREFETCH_SPAN_BYTES: usize = 512 << 10;

/// Most bytes of packed value rows a thread keeps across blocks.
pub const PACKED_V_BYTES: usize = 512 << 10;

/// Keys (or value columns) for the next microkernel call when `left` remain
/// and a call takes at most `most`: the remainder spread as evenly as
/// `most` allows, so a loop never ends on a call of one or two keys, which
/// keeps too few accumulators to hide the FMA latency.
pub const fn share(left: usize, most: usize) -> usize {
    left.div_ceil(left.div_ceil(most))
}

/// Keys per chunk when the keys of one block of rows are split across
/// threads (decoding).
pub const SPLIT_KEYS: usize = 1024;

/// Keys are split only when a problem has fewer row blocks than this.
pub const MIN_WORK_ITEMS: usize = 16;

/// Blocks are run in pairs only when a problem has at least this many.
pub const PAIR_MIN_BLOCKS: usize = 2 * MIN_WORK_ITEMS;

/// Problems with fewer FLOPs than this run on the calling thread: waking
/// the pool costs 10-20 us here, about what 8 MFLOP take on one core.
/// (Even with the caller working from the start, a call that wakes the
/// pool pays for it, likely in the wake-up's system call on the calling
/// thread: 2e6 measured 15-25 us slower per call than 8e6 on
/// decodes of 2-4 MFLOP after other work, though 0-40 us faster back to
/// back; Zen 4 VM, 2 threads, s28.)
pub const PARALLEL_MIN_FLOPS: f64 = 8e6;
