//! The few-rows path (decoding): blocks of at most [`DECODE_ROWS`] query
//! rows (one position times a small GQA group) against key tiles of
//! [`KEYS`], with the head dimension along the SIMD lanes (the
//! microkernels are `microkernel::decode`).
//!
//! With rows on the lanes (`tiling.rs`), a block of 4 rows would fill 4 of
//! 16 lanes and waste three quarters of every FMA. Here each key and value
//! row is read as it lies in memory, without packing or transposing (rows
//! whose elements are not contiguous are first widened into the
//! workspace). The
//! online softmax, masks and finish follow the same contract as the main
//! path; the per-element terms (soft-cap, ALiBi, bias, boolean mask,
//! boundary masks) are applied row by row, which is cheap with so few rows.

use crate::bias::RowRun;
use crate::blocking::{DECODE_KEYS as KEYS, LANES};
use crate::element::CpuElement;
use crate::exp::exp2;
use crate::microkernel::decode as mk;
use crate::pack::{gather_row, kv_rows, typed_rows, RowStream};
use crate::simd::{load, store, Vector};
use crate::softmax::finish_row;
use crate::tiling::Ctx;
use crate::work::Item;
use crate::workspace::Workspace;
use attn_spec::TileClass;
use std::f32::consts::LOG2_E;

/// Largest block this path takes.
pub const DECODE_ROWS: usize = 4;

/// Key vectors per tile.
const KV: usize = KEYS / LANES;

/// The running state of one decode block: scaled query rows, running
/// maximum and sum per row, and the unnormalised output rows.
pub struct DecodeState {
    /// Query rows scaled into base-2 units (natural units under soft-cap),
    /// `DECODE_ROWS` rows of `qs` (`dk` rounded up to 16), zero past `dk`
    /// and past the block.
    qd: Vec<f32>,
    /// Stride of `qd`.
    qs: usize,
    /// The rows of `qd` laid out for `mk::scores_quad` when the block
    /// takes it (`mk::quad_ok`), else empty.
    q4: Vec<f32>,
    /// The query rows as bf16 pairs for `dot16::decode` where the level
    /// runs it ([`pair_queries`]), else empty.
    q2: Vec<u32>,
    /// What multiplies the pair scores: the scale of `qd`.
    c2: f32,
    /// Running maximum per row (base 2).
    m: [f32; DECODE_ROWS],
    /// Running sum per row.
    l: [f32; DECODE_ROWS],
    /// Unnormalised output rows, `DECODE_ROWS x dv`.
    pub o: Vec<f32>,
    /// Where `dot16::decode::accumulate_pairs` writes the next `o` (then
    /// swapped with it) when the level takes `P V` on `vdpbf16ps` (the
    /// prefill pass's `Ctx::dot16`) and `dv` is a multiple of 32, else
    /// empty.
    o2: Vec<f32>,
    /// `accumulate_pairs`'s scratch where `o2` exists, else empty.
    words: Vec<u32>,
}

impl DecodeState {
    /// The state of `item` before any key.
    #[inline(always)]
    pub fn new<V: Vector, T: CpuElement>(ctx: &Ctx<'_, T>, item: &Item) -> Self {
        let p = ctx.p;
        let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
        assert!(item.rows() <= DECODE_ROWS);
        let scale = ctx.q_scale();
        let qs = dk.div_ceil(LANES) * LANES;
        let mut qd = vec![0.0; DECODE_ROWS * qs];
        for r in 0..item.rows() {
            let (pos, h) = item.row(r);
            let dst = &mut qd[r * qs..r * qs + dk];
            gather_row::<V, T>(ctx.q, &p.q, [item.b, pos, h, 0], dk, dst);
            dst.iter_mut().for_each(|x| *x *= scale);
        }
        let q4 = if mk::quad_ok::<V>(item.rows(), dk) {
            mk::quad_queries(&qd, qs, item.rows(), dk)
        } else {
            Vec::new()
        };
        let pair_values = cfg!(target_arch = "x86_64") && ctx.dot16 && dv.is_multiple_of(32);
        DecodeState {
            qd,
            qs,
            q4,
            q2: pair_queries(ctx, item, dk).unwrap_or_default(),
            c2: scale,
            m: [f32::NEG_INFINITY; DECODE_ROWS],
            l: [0.0; DECODE_ROWS],
            o: vec![0.0; DECODE_ROWS * dv],
            o2: match pair_values {
                true => vec![0.0; DECODE_ROWS * dv],
                false => Vec::new(),
            },
            words: match pair_values {
                #[cfg(target_arch = "x86_64")]
                true => vec![0; crate::dot16::decode::PAIR_WORDS],
                _ => Vec::new(),
            },
        }
    }

    /// Each row's `(factor, lse)` (see `softmax::finish_row`).
    pub fn finish(&self, item: &Item, sinks: Option<&[f32]>) -> Vec<(f32, f32)> {
        (0..item.rows())
            .map(|r| finish_row(self.m[r], self.l[r], sinks.map(|s| s[item.row(r).1])))
            .collect()
    }
}

/// The block's query rows as bf16 pairs for `dot16::decode`
/// (`quad_pairs`): bf16 inputs on a level that runs AVX512_BF16 (the
/// prefill pass's `Ctx::dot16`, which also means Q's rows are contiguous),
/// 3 or 4 rows, a head dim that is a multiple of 8, and every element of
/// the rows fitting the instruction; else `None` (the f32 kernels).
fn pair_queries<T: CpuElement>(ctx: &Ctx<'_, T>, item: &Item, dk: usize) -> Option<Vec<u32>> {
    #[cfg(target_arch = "x86_64")]
    if let Some(q) = crate::dot16::bf16_bits(ctx.q)
        .filter(|_| ctx.dot16 && (3..=4).contains(&item.rows()) && dk.is_multiple_of(8))
    {
        let p = ctx.p;
        let rows: Vec<&[u16]> = (0..item.rows())
            .map(|r| {
                let (pos, h) = item.row(r);
                let at = p.q.index([item.b, pos, h, 0]);
                &q[at..at + dk]
            })
            .collect();
        return crate::dot16::decode::quad_pairs(&rows, dk);
    }
    let _ = (ctx, item, dk);
    None
}

/// The tile's scores on `vdpbf16ps` (`dot16::decode::scores_quad_pairs`)
/// where the block has query pairs and the key rows are bf16 read in
/// place; whether it computed them (not when a key row does not fit: the
/// caller then takes the f32 kernels).
#[inline(always)]
fn pair_scores<E: CpuElement>(
    st: &DecodeState,
    (k, ks): (&[E], usize),
    (n, dk, rows): (usize, usize, usize),
    sd: &mut [f32],
    ahead: RowStream,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if let Some(kb) = crate::dot16::bf16_bits(k).filter(|_| !st.q2.is_empty()) {
        // SAFETY: q2 exists only where `Ctx::dot16` held, which the level
        // running these kernels sets only where the CPU runs AVX512_BF16
        // (`dot16::applies`; that level has AVX-512 F, BW and DQ).
        return unsafe {
            crate::dot16::decode::scores_quad_pairs(
                &st.q2,
                (kb, ks),
                n,
                dk,
                rows,
                st.c2,
                (sd, KEYS),
                ahead,
            )
        };
    }
    let _ = (st, k, ks, n, dk, rows, sd, ahead);
    false
}

/// `O = alpha O + P V` on `vdpbf16ps` (`dot16::decode::accumulate_pairs`)
/// where the block has a second output buffer (`DecodeState::o2`) and the
/// value rows are bf16 read in place: `Some(true)` when it did,
/// `Some(false)` when a value row did not fit (the output is then as it
/// was, and the caller takes the f32 kernel), `None` where it does not
/// apply.
#[inline(always)]
fn pair_values<E: CpuElement, const R: usize>(
    st: &mut DecodeState,
    (v, vs): (&[E], usize),
    (n, dv): (usize, usize),
    sd: &[f32],
    alpha: &[f32; R],
    ahead: RowStream,
) -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    if let Some(vb) = crate::dot16::bf16_bits(v).filter(|_| !st.o2.is_empty()) {
        // SAFETY: o2 exists only where `Ctx::dot16` held, which the level
        // running these kernels sets only where the CPU runs AVX512_BF16
        // (`dot16::applies`; that level has AVX-512 F, BW and DQ).
        let fit = unsafe {
            crate::dot16::decode::accumulate_pairs(
                R,
                (sd, KEYS),
                (vb, vs),
                n,
                dv,
                alpha,
                (&st.o, &mut st.o2),
                &mut st.words,
                ahead,
            )
        };
        if fit {
            std::mem::swap(&mut st.o, &mut st.o2);
        }
        return Some(fit);
    }
    let _ = (st, v, vs, n, dv, sd, alpha, ahead);
    None
}

/// Runs one item of at most [`DECODE_ROWS`] rows over its keys, reading its
/// own head's K and V rows; leaves the unnormalised output rows in
/// `ws.orow` (row-major, `dv` apart) and returns each row's `(factor,
/// lse)`.
#[inline(always)]
pub fn run_item<V: Vector, T: CpuElement>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    ws: &mut Workspace,
    sinks: Option<&[f32]>,
) -> Vec<(f32, f32)> {
    let p = ctx.p;
    let dv = p.shape.head_dim_v;
    let mut st = DecodeState::new::<V, T>(ctx, item);
    let mask = p.seq_mask(item.b);
    let span = mask.kv_span(item.positions());
    let (lo, hi) = (span.start.max(item.keys.start), span.end.min(item.keys.end));
    let mut j0 = lo;
    while j0 < hi {
        let n = KEYS.min(hi - j0);
        let class = mask.classify(item.positions(), j0..j0 + n);
        if class != TileClass::Skip {
            // Prefetching runs on past the chunk's end (`span.end`): see
            // `run_lockstep`.
            let next = Next {
                kvh: item.kvh,
                j: j0 + n,
                end: span.end,
            };
            V::decode_tile::<T>(ctx, item, &mut st, ws, (j0, n, class), next);
        }
        j0 += n;
    }
    ws.orow[..DECODE_ROWS * dv].copy_from_slice(&st.o);
    st.finish(item, sinks)
}

/// Whether a problem's blocks run in lockstep over shared key tiles: every
/// block is decode-sized, the blocks of a batch entry share their
/// positions, and each key's rows of all key/value heads are one contiguous
/// run (the `[batch, seq, heads, dim]` layout), and one tile of them fits
/// in half an L2.
///
/// Measured on this project's 2-core machine (GQA 32:8, d = 128, 32768
/// keys, `cargo run -p attn-benches --release --example perf`, with the
/// row-by-row prefetching of `pack::RowStream`): head by head, each item
/// reads 512-byte slices of rows 4 KiB apart for 1024 keys (f32: 41-51 ms
/// on one thread, 25-30 ms on two; bf16: 43-60 and 22-28 ms); tile by tile
/// over all heads, each tile's rows are consumed whole while they are open
/// (f32: 19-22 and 12-13 ms; bf16, then widened into a staging area once
/// per tile: 16-20 and 10-12 ms; bf16 read in place: 11-13 and 8-8.5 ms).
pub fn lockstep_ok<T: CpuElement>(ctx: &Ctx<'_, T>, blocks: &[Item]) -> bool {
    let p = ctx.p;
    let s = p.shape;
    let contiguous = |v: &attn_spec::View, d: usize| {
        (v.strides[3] == 1 || d == 1) && (v.strides[2] == d || s.kv_heads == 1)
    };
    let tile = KEYS * s.kv_heads * (s.head_dim_qk + s.head_dim_v) * std::mem::size_of::<T>();
    s.kv_heads > 1
        && tile <= TILE_BYTES
        && contiguous(&p.k, s.head_dim_qk)
        && contiguous(&p.v, s.head_dim_v)
        && blocks.iter().all(|it| {
            it.rows() <= DECODE_ROWS
                && blocks
                    .iter()
                    .filter(|o| o.b == it.b)
                    .all(|o| o.positions() == it.positions())
        })
}

/// The rows a decode tile prefetches for work that follows on its thread
/// (the next tile of its head, or in lockstep another head's rows of this
/// tile or the next): K/V head `kvh`'s rows from key `j` on, as many as
/// the tile has keys; nothing when `j >= end`.
#[derive(Clone, Copy, Debug)]
pub struct Next {
    /// The K/V head.
    pub kvh: usize,
    /// The first key.
    pub j: usize,
    /// The end of the keys to prefetch.
    pub end: usize,
}

/// Largest K and V tile of all heads in lockstep: half of a 1 MiB L2, which
/// holds it while the next one is prefetched (half a tile ahead: see
/// `run_lockstep`).
const TILE_BYTES: usize = 512 * 1024;

/// Runs every block of one batch entry (`blocks`, all sharing positions)
/// over the keys `keys`, tile by tile in lockstep: each tile's K and V rows
/// of all heads are one contiguous run in memory, read in place by one
/// head after the other. Consuming whole rows is what
/// brings decoding towards memory bandwidth: a throwaway probe here read
/// per-head 512-byte slices of rows 4 KiB apart at 6.7 GB/s per thread and
/// contiguous rows at 18 GB/s. Returns each block's state.
#[inline(always)]
pub fn run_lockstep<V: Vector, T: CpuElement>(
    ctx: &Ctx<'_, T>,
    blocks: &[&Item],
    keys: std::ops::Range<usize>,
    ws: &mut Workspace,
) -> Vec<DecodeState> {
    let p = ctx.p;
    let b = blocks[0].b;
    let mut states: Vec<DecodeState> = blocks
        .iter()
        .map(|it| DecodeState::new::<V, T>(ctx, it))
        .collect();
    let mask = p.seq_mask(b);
    let positions = blocks[0].positions();
    let span = mask.kv_span(positions.clone());
    let (lo, hi) = (span.start.max(keys.start), span.end.min(keys.end));
    // How many blocks ahead each block prefetches (below).
    let nb = blocks.len();
    let lead = (nb / 2).max(1);
    let mut j0 = lo;
    while j0 < hi {
        let n = KEYS.min(hi - j0);
        let class = mask.classify(positions.clone(), j0..j0 + n);
        if class != TileClass::Skip {
            // Head after head over the same tile rows, so each tile's rows
            // are consumed whole while they are open. The last tile of a
            // chunk of split keys prefetches the next chunk's first
            // (prefetching stops at the visible keys' end, not the
            // chunk's), which the same thread most likely runs next: a
            // thread takes consecutive chunks. Stopping at the chunk's
            // end left one tile in 16 to demand misses (Zen 4, GQA 32:8,
            // d = 128, 32768 keys, alternating runs: f32 14.4 -> 13.3 ms
            // on one thread, 10.0 -> 7.6 ms on two; bf16 9.2 -> 8.7 and
            // 6.7 -> 5.7 ms).
            //
            // Each head prefetches the rows of the head half the heads
            // after it, in this tile or the next: half a tile ahead, so
            // the tile being read and the lines asked for fit the L2 with
            // room to spare. A whole tile ahead (each head its own next
            // rows), the tile being read and the next one (512 KiB each
            // in f32 at GQA 32:8, d = 128) filled Zen 4's 1 MiB L2, and
            // lines were evicted before use. Half a tile ahead measured
            // up to 6% faster (alternating runs, medians of 6, one
            // thread: f32 13.9 -> 13.4-13.8 ms at 32768 keys, 1.42 ->
            // 1.36 ms at 4096; bf16 9.0 -> 8.5 ms and 0.81 -> 0.79 ms; no
            // slower on two threads or in L3); a quarter tile ahead was no
            // better.
            // (Blocks, not K/V heads: with more than 4 query heads to a
            // K/V head, two blocks share one and prefetch its rows twice.)
            for (i, (it, st)) in blocks.iter().zip(states.iter_mut()).enumerate() {
                let (o, j) = match blocks.get(i + lead) {
                    Some(o) => (o, j0),
                    None => (&blocks[i + lead - nb], j0 + n),
                };
                let next = Next {
                    kvh: o.kvh,
                    j,
                    end: span.end,
                };
                V::decode_tile::<T>(ctx, it, st, ws, (j0, n, class), next);
            }
        }
        j0 += n;
    }
    states
}

/// One key tile `j0..j0+n` for one block, prefetching the rows `next`
/// names: K and V rows read in place in their own type when each row is
/// contiguous (the kernels widen 16 elements at a time), else widened into
/// the workspace first.
///
/// Compiled out of line once per level and element type
/// (`Kernels::decode_tile`), not inlined into each path that calls it.
#[inline(always)]
pub fn tile<V: Vector, T: CpuElement>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    st: &mut DecodeState,
    ws: &mut Workspace,
    (j0, n, class): (usize, usize, TileClass),
    next: Next,
) {
    let p = ctx.p;
    let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
    let g = (item.b, item.kvh);
    let streams = ahead(ctx, item.b, next);
    let at = (j0, n, class);
    match (
        typed_rows(ctx.k, &p.k, g, (j0, n), dk),
        typed_rows(ctx.v, &p.v, g, (j0, n), dv),
    ) {
        (Some(k), Some(v)) => step::<V, T, T>(ctx, item, st, &mut ws.sd, at, k, v, streams),
        _ => {
            let k = kv_rows::<V, T>(ctx.k, &p.k, g, (j0, n), dk, &mut ws.kbuf);
            let v = kv_rows::<V, T>(ctx.v, &p.v, g, (j0, n), dv, &mut ws.vbuf);
            step::<V, T, f32>(ctx, item, st, &mut ws.sd, at, k, v, streams)
        }
    }
}

/// The K and V rows `next` names (batch `b`), to be prefetched row by row
/// while a tile computes; none when `next.j >= next.end`. They are the
/// tensor's own rows in its own type.
fn ahead<T: CpuElement>(ctx: &Ctx<'_, T>, b: usize, next: Next) -> (RowStream, RowStream) {
    let Next { kvh, j, end } = next;
    if j >= end {
        return (RowStream::NONE, RowStream::NONE);
    }
    let s = ctx.p.shape;
    (
        RowStream::of(ctx.k, &ctx.p.k, (b, j, kvh), s.head_dim_qk),
        RowStream::of(ctx.v, &ctx.p.v, (b, j, kvh), s.head_dim_v),
    )
}

/// One key tile `j0..j0+n` for one block: scores, masks and per-element
/// terms, online softmax, `O = alpha O + P V`. `k` and `v` hold the tile's
/// rows (`ks`, `vs` apart); the rows of `ahead` are prefetched alongside.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn step<V: Vector, T: CpuElement, E: CpuElement>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    st: &mut DecodeState,
    sd: &mut [f32],
    (j0, n, class): (usize, usize, TileClass),
    (k, ks): (&[E], usize),
    (v, vs): (&[E], usize),
    ahead: (RowStream, RowStream),
) {
    match item.rows() {
        1 => step_rows::<V, T, E, 1>(ctx, item, st, sd, (j0, n, class), (k, ks), (v, vs), ahead),
        2 => step_rows::<V, T, E, 2>(ctx, item, st, sd, (j0, n, class), (k, ks), (v, vs), ahead),
        3 => step_rows::<V, T, E, 3>(ctx, item, st, sd, (j0, n, class), (k, ks), (v, vs), ahead),
        _ => step_rows::<V, T, E, 4>(ctx, item, st, sd, (j0, n, class), (k, ks), (v, vs), ahead),
    }
}

/// [`step`] for a block of `R` rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn step_rows<V: Vector, T: CpuElement, E: CpuElement, const R: usize>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    st: &mut DecodeState,
    sd: &mut [f32],
    (j0, n, class): (usize, usize, TileClass),
    (k, ks): (&[E], usize),
    (v, vs): (&[E], usize),
    ahead: (RowStream, RowStream),
) {
    let p = ctx.p;
    let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
    debug_assert_eq!(item.rows(), R);
    let per_element = ctx.per_element();
    if pair_scores(st, (k, ks), (n, dk, R), sd, ahead.0) {
        // bf16 pairs on `vdpbf16ps`.
    } else if const { R >= 3 && V::QUAD } && !st.q4.is_empty() {
        // (`q4` is filled only where `quad_ok`: the `const` test keeps
        // the quad kernel out of the blocks it never runs on.)
        mk::scores_quad::<V, E, R>(&st.q4, (k, ks), n, dk, (sd, KEYS), ahead.0);
    } else {
        debug_assert!(st.q4.is_empty());
        mk::scores::<V, E, R>(&st.qd, st.qs, (k, ks), n, dk, (sd, KEYS), ahead.0);
    }
    // Each row's old maximum less its shift, and its tile's sum: the
    // rows' rescale factors come from one vector exponential after the
    // loop (four scalar `exp2f` calls were 2% of a bf16 decode in L3).
    let (mut moved, mut sums) = ([f32::NEG_INFINITY; LANES], [0.0f32; R]);
    for r in 0..R {
        let srow = &mut sd[r * KEYS..(r + 1) * KEYS];
        srow[n..].fill(f32::NEG_INFINITY);
        if class == TileClass::Partial || per_element {
            transform_row(ctx, item, r, j0, &mut srow[..n]);
        }
        // The vector maximum may drop a NaN, so NaN is tracked apart: a
        // NaN score (or running maximum) makes the maximum NaN and with
        // it the whole row, as in the contract.
        let (mut mv, mut nan) = (V::splat(st.m[r]), false);
        for c in 0..KV {
            // SAFETY: c * 16 + 16 <= KEYS = srow.len().
            let x = unsafe { load::<V>(srow.as_ptr().add(c * LANES)) };
            mv = mv.fast_max(x);
            nan |= x.any_nan();
        }
        let mx = if nan || st.m[r].is_nan() {
            f32::NAN
        } else {
            mv.to_array().into_iter().fold(f32::NEG_INFINITY, f32::max)
        };
        let shift = if mx == f32::NEG_INFINITY { 0.0 } else { mx };
        moved[r] = st.m[r] - shift;
        let mut sum = V::ZERO;
        for c in 0..KV {
            // SAFETY: c * 16 + 16 <= KEYS = srow.len().
            let e = exp2(unsafe { load::<V>(srow.as_ptr().add(c * LANES)) } - V::splat(shift));
            // SAFETY: as above.
            unsafe { store(srow.as_mut_ptr().add(c * LANES), e) };
            sum += e;
        }
        sums[r] = sum.reduce_add();
        st.m[r] = mx;
    }
    let factors = exp2(V::from(moved)).to_array();
    let alpha: [f32; R] = std::array::from_fn(|r| factors[r]);
    for (l, (&a, &s)) in st.l.iter_mut().zip(alpha.iter().zip(&sums)) {
        *l = *l * a + s;
    }
    let on_pairs = pair_values(st, (v, vs), (n, dv), sd, &alpha, ahead.1);
    #[cfg(test)]
    if on_pairs == Some(false) {
        VALUE_REDONE[dv.min(VALUE_REDONE.len() - 1)]
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    if on_pairs != Some(true) {
        mk::accumulate::<V, E, R>((sd, KEYS), (v, vs), n, dv, &alpha, &mut st.o, ahead.1);
    }
}

/// Tiles whose `P V` on pairs found a value that does not fit and were
/// computed again on the f32 kernel, per value head dim (tests count
/// apart where their dims differ).
#[cfg(test)]
pub(crate) static VALUE_REDONE: [std::sync::atomic::AtomicUsize; 257] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 257];

/// The contract's per-element steps for row `r` over keys `j0..j0+n`:
/// soft-cap, ALiBi, bias, then the masks, leaving base-2 scores.
fn transform_row<T>(ctx: &Ctx<'_, T>, item: &Item, r: usize, j0: usize, s: &mut [f32]) {
    let p = ctx.p;
    let o = &p.options;
    let (pos, h) = item.row(r);
    let mask = p.seq_mask(item.b);
    let range = mask.kv_range(pos);
    let diag = mask.diagonal(pos);
    for (j, x) in s.iter_mut().enumerate() {
        let jg = j0 + j;
        let mut t = *x;
        if let Some(c) = ctx.post_scale {
            t *= c;
        }
        if let Some(cap) = o.softcap {
            t = cap * (t / cap).tanh() * LOG2_E;
        }
        if let Some(sl) = &o.alibi_slopes {
            // The distance in integers, then one rounding: exact below 2^24.
            let dist = i64::try_from(jg).map_or(u64::MAX, |j| j.abs_diff(diag));
            t -= sl[h] * LOG2_E * dist as f32;
        }
        if !range.contains(&jg) {
            t = f32::NEG_INFINITY;
        }
        *x = t;
    }
    let n = s.len();
    let mut run = RowRun {
        at: (item.b, h, pos),
        keys: (j0, n),
        s,
        stride: 1,
    };
    if let Some(bias) = ctx.bias {
        run.add_bias(bias);
    }
    if let Some(mask) = ctx.mask {
        run.apply_mask(mask);
    }
}
