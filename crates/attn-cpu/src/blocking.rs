//! Every tuning constant of attn-cpu, with its hardware reason.
//!
//! The kernel computes the transposed score tile `S^T = K Q^T` of one block
//! of [`ROWS`] query rows against [`KEYS`] keys at a time, with the query
//! rows along the SIMD lanes (see `tiling.rs` for why). Sizes for a core
//! with 32 vector registers of 16 f32 (AVX-512), a 48 KiB L1 data cache and
//! a 1 MiB L2 (AMD Zen 5; Intel server cores have the same register file and
//! 48 KiB / 2 MiB):
//!
//! - [`ROWS`] = 64 query rows = 4 vectors. Each key and each value element
//!   is loaded once per block of 64 rows, so K and V stream from L2/L3 at
//!   16 flops per byte at head dim 128, well under cache bandwidth.
//! - [`KEYS`] = 128 keys per step. The score tile `S^T` is `KEYS x ROWS`
//!   f32 = 32 KiB and the Q^T panel `d x ROWS` is 32 KiB at d = 128: the
//!   `P V` microkernel re-reads `S^T` once per group of [`MR`] value
//!   columns, so it must stay in L1/L2; the running output `O^T` (`d_v x
//!   ROWS`, 32 KiB) lives in L2. A larger tile would amortise the softmax
//!   bookkeeping over more keys but push `S^T` out of L1.
//! - [`MR`] = 6: a microkernel keeps `MR x 4` = 24 accumulators (of 32
//!   registers), which covers the 4-cycle FMA latency on 2 FMA pipes (8
//!   independent chains needed) three times over, and issues 6 broadcasts +
//!   4 loads per 24 FMAs, within 2 loads per cycle.
//! - [`SPLIT_KEYS`] = 1024: decoding (few query rows, long K/V) splits the
//!   keys into chunks of this many, computed in parallel and merged with
//!   `merge_states`. It is a constant, never derived from the thread count,
//!   so results are bitwise identical for any number of threads.

/// Width of the SIMD vector in f32 lanes.
pub const LANES: usize = 16;

/// Vectors of query rows in a block.
pub const ROW_VECS: usize = 4;

/// Query rows in a block (lanes of [`ROW_VECS`] vectors).
pub const ROWS: usize = ROW_VECS * LANES;

/// Keys per step of the inner loop.
pub const KEYS: usize = 64;

/// Keys (for scores) or value columns (for `P V`) per microkernel call.
pub const MR: usize = 6;

/// Keys per chunk when the keys of one block of rows are split across
/// threads (decoding).
pub const SPLIT_KEYS: usize = 1024;

/// Split the keys only when the problem has fewer row blocks than this per
/// (batch, key/value head) in total... see `schedule.rs`: a pure function
/// of the shape.
pub const MIN_WORK_ITEMS: usize = 16;
