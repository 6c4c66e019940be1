//! The few-rows path (decoding): blocks of at most [`DECODE_ROWS`] query
//! rows (one position times a small GQA group) with the *keys* along the
//! SIMD lanes instead of the rows.
//!
//! With rows on the lanes (`tiling.rs`), a block of 4 rows would fill 4 of
//! 16 lanes and waste three quarters of every FMA. Here each key tile is
//! transposed once (`K^T`, 16 x 16 register transposes), the scores of a
//! row are `sum_e q[e] * K^T[e][16 keys]` with `q[e]` broadcast, and the
//! output accumulates `p[j] * V[j][16 columns]` straight from the value
//! rows, which are read contiguously and need no packing. The online
//! softmax, masks and finish follow the same contract as the main path;
//! the per-element terms (soft-cap, ALiBi, bias, boolean mask, boundary
//! masks) are applied row by row, which is cheap with so few rows.

use crate::blocking::{DECODE_KEYS as KEYS, LANES};
use crate::element::CpuElement;
use crate::exp::exp2;
use crate::pack::{gather_row, kv_rows, prefetch_rows};
use crate::simd::{load, store, V};
use crate::softmax::finish_row;
use crate::tiling::{Ctx, Workspace};
use crate::work::Item;
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
    /// `DECODE_ROWS x dk`, zero past the block.
    qd: Vec<f32>,
    /// Running maximum per row (base 2).
    m: [f32; DECODE_ROWS],
    /// Running sum per row.
    l: [f32; DECODE_ROWS],
    /// Unnormalised output rows, `DECODE_ROWS x dv`.
    pub o: Vec<f32>,
}

impl DecodeState {
    /// The state of `item` before any key.
    pub fn new<T: CpuElement>(ctx: &Ctx<'_, T>, item: &Item) -> Self {
        let p = ctx.p;
        let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
        assert!(item.rows() <= DECODE_ROWS);
        let qs = if p.options.softcap.is_some() {
            p.scale()
        } else {
            p.scale() * LOG2_E
        };
        let mut qd = vec![0.0; DECODE_ROWS * dk];
        for r in 0..item.rows() {
            let (pos, h) = item.row(r);
            let dst = &mut qd[r * dk..(r + 1) * dk];
            gather_row(ctx.q, &p.q, [item.b, pos, h, 0], dk, dst);
            dst.iter_mut().for_each(|x| *x *= qs);
        }
        DecodeState {
            qd,
            m: [f32::NEG_INFINITY; DECODE_ROWS],
            l: [0.0; DECODE_ROWS],
            o: vec![0.0; DECODE_ROWS * dv],
        }
    }

    /// Each row's `(factor, lse)` (see `softmax::finish_row`).
    pub fn finish(&self, item: &Item, sinks: Option<&[f32]>) -> Vec<(f32, f32)> {
        (0..item.rows())
            .map(|r| finish_row(self.m[r], self.l[r], sinks.map(|s| s[item.row(r).1])))
            .collect()
    }
}

/// Runs one item of at most [`DECODE_ROWS`] rows over its keys, reading its
/// own head's K and V rows; leaves the unnormalised output rows in
/// `ws.orow` (row-major, `dv` apart) and returns each row's `(factor,
/// lse)`.
pub fn run_item<T: CpuElement>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    ws: &mut Workspace,
    sinks: Option<&[f32]>,
) -> Vec<(f32, f32)> {
    let p = ctx.p;
    let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
    let mut st = DecodeState::new(ctx, item);
    let mask = p.seq_mask(item.b);
    let span = mask.kv_span(item.positions());
    let (lo, hi) = (span.start.max(item.keys.start), span.end.min(item.keys.end));
    let g = (item.b, item.kvh);
    let mut j0 = lo;
    while j0 < hi {
        let n = KEYS.min(hi - j0);
        let class = mask.classify(item.positions(), j0..j0 + n);
        if class != TileClass::Skip {
            let next = KEYS.min(hi.saturating_sub(j0 + n));
            if next > 0 {
                prefetch_rows(ctx.k, &p.k, g, (j0 + n, next), dk);
                prefetch_rows(ctx.v, &p.v, g, (j0 + n, next), dv);
            }
            let (k, ks) = kv_rows(ctx.k, &p.k, g, (j0, n), dk, &mut ws.kbuf);
            let (v, vs) = kv_rows(ctx.v, &p.v, g, (j0, n), dv, &mut ws.vbuf);
            step(
                ctx,
                item,
                &mut st,
                (&mut ws.kt, &mut ws.sd),
                (j0, n, class),
                (k, ks),
                (v, vs),
            );
        }
        j0 += n;
    }
    ws.orow[..DECODE_ROWS * dv].copy_from_slice(&st.o);
    st.finish(item, sinks)
}

/// Whether a problem's blocks run in lockstep over shared key tiles: every
/// block is decode-sized, the blocks of a batch entry share their
/// positions, and each key's rows of all key/value heads are one contiguous
/// run (the `[batch, seq, heads, dim]` layout), small enough to stage.
///
/// Measured on this project's 2-core machine (GQA 32:8, d = 128, 32768
/// keys, `cargo run -p attn-benches --release --example perf`): head by
/// head, each item reads 512-byte slices of rows 4 KiB apart for 1024 keys
/// (f32: 47 ms on one thread, 25 ms on two; bf16: 52 and 33 ms); tile by
/// tile over all heads, each tile's rows are consumed whole while they are
/// open (f32 in place: 35-40 and 20-22 ms; bf16 staged: 24-27 and 15-18 ms).
pub fn lockstep_ok<T: CpuElement>(ctx: &Ctx<'_, T>, blocks: &[Item]) -> bool {
    let p = ctx.p;
    let s = p.shape;
    let contiguous = |v: &attn_spec::View, d: usize| {
        (v.strides[3] == 1 || d == 1) && (v.strides[2] == d || s.kv_heads == 1)
    };
    let stage = KEYS * s.kv_heads * (s.head_dim_qk + s.head_dim_v) * 4;
    s.kv_heads > 1
        && stage <= STAGE_BYTES
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

/// Largest staging area (K and V tiles of all heads) per thread: half of a
/// 1 MiB L2, so the staged tiles and the per-head panels stay in it.
const STAGE_BYTES: usize = 512 * 1024;

/// Runs every block of one batch entry (`blocks`, all sharing positions)
/// over the keys `keys`, tile by tile in lockstep: each tile's K and V rows
/// of all heads are one contiguous run in memory; f32 rows are read in
/// place by one head after the other, 16-bit rows are first widened, in
/// one sequential pass, into a staging area. Consuming whole rows is what
/// brings decoding towards memory bandwidth: a throwaway probe here read
/// per-head 512-byte slices of rows 4 KiB apart at 6.7 GB/s per thread and
/// contiguous rows at 18 GB/s. Returns each block's state.
pub fn run_lockstep<T: CpuElement>(
    ctx: &Ctx<'_, T>,
    blocks: &[&Item],
    keys: std::ops::Range<usize>,
    ws: &mut Workspace,
) -> Vec<DecodeState> {
    let p = ctx.p;
    let s = p.shape;
    let (dk, dv) = (s.head_dim_qk, s.head_dim_v);
    let b = blocks[0].b;
    let mut states: Vec<DecodeState> = blocks.iter().map(|it| DecodeState::new(ctx, it)).collect();
    let mask = p.seq_mask(b);
    let positions = blocks[0].positions();
    let span = mask.kv_span(positions.clone());
    let (lo, hi) = (span.start.max(keys.start), span.end.min(keys.end));
    let (wk, wv) = (s.kv_heads * dk, s.kv_heads * dv);
    ws.stage.resize(KEYS * (wk + wv), 0.0);
    let mut j0 = lo;
    while j0 < hi {
        let n = KEYS.min(hi - j0);
        let class = mask.classify(positions.clone(), j0..j0 + n);
        if class != TileClass::Skip && T::as_f32(ctx.k).is_some() {
            // f32 rows are read in place, head after head over the same
            // tile rows, so each tile's rows are consumed whole while
            // they are open.
            for (it, st) in blocks.iter().zip(states.iter_mut()) {
                let g = (b, it.kvh);
                let (k, ks) = kv_rows(ctx.k, &p.k, g, (j0, n), dk, &mut ws.kbuf);
                let (v, vs) = kv_rows(ctx.v, &p.v, g, (j0, n), dv, &mut ws.vbuf);
                step(
                    ctx,
                    it,
                    st,
                    (&mut ws.kt, &mut ws.sd),
                    (j0, n, class),
                    (k, ks),
                    (v, vs),
                );
            }
        } else if class != TileClass::Skip {
            let (sk, sv) = ws.stage.split_at_mut(KEYS * wk);
            for j in 0..n {
                let at = p.k.index([b, j0 + j, 0, 0]);
                T::widen(&ctx.k[at..at + wk], &mut sk[j * wk..(j + 1) * wk]);
                let at = p.v.index([b, j0 + j, 0, 0]);
                T::widen(&ctx.v[at..at + wv], &mut sv[j * wv..(j + 1) * wv]);
            }
            for (it, st) in blocks.iter().zip(states.iter_mut()) {
                let (g0, v0) = (it.kvh * dk, it.kvh * dv);
                let k = &sk[g0..(n - 1) * wk + g0 + dk];
                let v = &sv[v0..(n - 1) * wv + v0 + dv];
                step(
                    ctx,
                    it,
                    st,
                    (&mut ws.kt, &mut ws.sd),
                    (j0, n, class),
                    (k, wk),
                    (v, wv),
                );
            }
        }
        j0 += n;
    }
    states
}

/// One key tile `j0..j0+n` for one block: `K^T`, scores, masks and
/// per-element terms, online softmax, `O = alpha O + P V`. `k` and `v`
/// hold the tile's rows (`ks`, `vs` apart).
fn step<T: CpuElement>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    st: &mut DecodeState,
    (kt, sd): (&mut [f32], &mut [f32]),
    (j0, n, class): (usize, usize, TileClass),
    (k, ks): (&[f32], usize),
    (v, vs): (&[f32], usize),
) {
    let p = ctx.p;
    let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
    let rows = item.rows();
    let per_element = ctx.per_element();
    transpose_keys(k, ks, n, dk, kt);
    scores(&st.qd, kt, dk, sd);
    for r in 0..DECODE_ROWS {
        let srow = &mut sd[r * KEYS..(r + 1) * KEYS];
        if r >= rows {
            srow.fill(f32::NEG_INFINITY);
            continue;
        }
        srow[n..].fill(f32::NEG_INFINITY);
        if class == TileClass::Partial || per_element {
            transform_row(ctx, item, r, j0, &mut srow[..n]);
        }
    }
    let mut alpha = [1.0f32; DECODE_ROWS];
    for r in 0..rows {
        let srow = &mut sd[r * KEYS..(r + 1) * KEYS];
        let mx = srow[..n].iter().fold(st.m[r], |a, &x| {
            if a.is_nan() || x.is_nan() {
                f32::NAN
            } else {
                a.max(x)
            }
        });
        let shift = if mx == f32::NEG_INFINITY { 0.0 } else { mx };
        alpha[r] = (st.m[r] - shift).exp2();
        let mut sum = V::ZERO;
        for c in 0..KV {
            // SAFETY: c * 16 + 16 <= KEYS = srow.len().
            let e = exp2(unsafe { load(srow.as_ptr().add(c * LANES)) } - V::splat(shift));
            // SAFETY: as above.
            unsafe { store(srow.as_mut_ptr().add(c * LANES), e) };
            sum += e;
        }
        st.l[r] = st.l[r] * alpha[r] + sum.reduce_add();
        st.m[r] = mx;
    }
    accumulate(sd, v, vs, n, dv, &alpha, &mut st.o);
}

/// `kt[e][j] = k[j][e]` for `j < n` (zero for `n <= j < KEYS`), `e < d`.
fn transpose_keys(k: &[f32], ks: usize, n: usize, d: usize, kt: &mut [f32]) {
    assert!(kt.len() >= d * KEYS && (n == 0 || k.len() >= (n - 1) * ks + d));
    let zero = [0.0f32; LANES];
    for jb in (0..KEYS).step_by(LANES) {
        let mut e0 = 0;
        while e0 + LANES <= d {
            let blk: [V; LANES] = std::array::from_fn(|i| {
                let j = jb + i;
                if j < n {
                    // SAFETY: key j < n starts at j*ks and has d >= e0+16
                    // floats (asserted above).
                    unsafe { load(k.as_ptr().add(j * ks + e0)) }
                } else {
                    V::from(zero)
                }
            });
            for (i, t) in crate::simd::transpose16(blk).into_iter().enumerate() {
                // SAFETY: (e0 + i) * KEYS + jb + 16 <= d * KEYS (asserted).
                unsafe { store(kt.as_mut_ptr().add((e0 + i) * KEYS + jb), t) };
            }
            e0 += LANES;
        }
        for e in e0..d {
            for i in 0..LANES {
                let j = jb + i;
                kt[e * KEYS + j] = if j < n { k[j * ks + e] } else { 0.0 };
            }
        }
    }
}

/// `sd[r][j] = sum_e qd[r][e] * kt[e][j]` for all `DECODE_ROWS` rows and
/// `KEYS` keys: `DECODE_ROWS x KV` = 16 accumulators.
fn scores(qd: &[f32], kt: &[f32], d: usize, sd: &mut [f32]) {
    assert!(qd.len() >= DECODE_ROWS * d && kt.len() >= d * KEYS && sd.len() >= DECODE_ROWS * KEYS);
    let mut acc = [[V::ZERO; KV]; DECODE_ROWS];
    for e in 0..d {
        // SAFETY: row e of kt has KEYS floats (asserted).
        let kv: [V; KV] =
            std::array::from_fn(|v| unsafe { load(kt.as_ptr().add(e * KEYS + v * LANES)) });
        for (r, row) in acc.iter_mut().enumerate() {
            let q = V::splat(qd[r * d + e]);
            for (a, &x) in row.iter_mut().zip(&kv) {
                *a = q.mul_add(x, *a);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (v, &a) in row.iter().enumerate() {
            // SAFETY: r < DECODE_ROWS, v < KV: inside sd (asserted).
            unsafe { store(sd.as_mut_ptr().add(r * KEYS + v * LANES), a) };
        }
    }
}

/// `o[r][c] = alpha[r] o[r][c] + sum_j p[r][j] v[j][c]` over `n` keys, 64
/// columns (4 vectors x 4 rows = 16 accumulators) at a time.
fn accumulate(
    sd: &[f32],
    v: &[f32],
    vs: usize,
    n: usize,
    dv: usize,
    alpha: &[f32; DECODE_ROWS],
    o: &mut [f32],
) {
    assert!(
        o.len() >= DECODE_ROWS * dv
            && sd.len() >= DECODE_ROWS * KEYS
            && (n == 0 || v.len() >= (n - 1) * vs + dv)
    );
    const CV: usize = 4;
    let mut c0 = 0;
    while c0 + CV * LANES <= dv {
        let mut acc: [[V; CV]; DECODE_ROWS] = std::array::from_fn(|r| {
            // SAFETY: c0 + 64 <= dv: inside row r of o (asserted).
            std::array::from_fn(
                |c| unsafe { load(o.as_ptr().add(r * dv + c0 + c * LANES)) } * V::splat(alpha[r]),
            )
        });
        for j in 0..n {
            // SAFETY: value row j has dv >= c0 + 64 floats (asserted).
            let x: [V; CV] =
                std::array::from_fn(|c| unsafe { load(v.as_ptr().add(j * vs + c0 + c * LANES)) });
            for (r, row) in acc.iter_mut().enumerate() {
                let pj = V::splat(sd[r * KEYS + j]);
                for (a, &xv) in row.iter_mut().zip(&x) {
                    *a = pj.mul_add(xv, *a);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, &a) in row.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe { store(o.as_mut_ptr().add(r * dv + c0 + c * LANES), a) };
            }
        }
        c0 += CV * LANES;
    }
    // Remaining columns (dv not a multiple of 64): scalar.
    for r in 0..DECODE_ROWS {
        for c in c0..dv {
            let mut a = o[r * dv + c] * alpha[r];
            for j in 0..n {
                a = sd[r * KEYS + j].mul_add(v[j * vs + c], a);
            }
            o[r * dv + c] = a;
        }
    }
}

/// The contract's per-element steps for row `r` over keys `j0..j0+n`:
/// soft-cap, ALiBi, bias, then the masks, leaving base-2 scores.
fn transform_row<T>(ctx: &Ctx<'_, T>, item: &Item, r: usize, j0: usize, s: &mut [f32]) {
    let p = ctx.p;
    let o = &p.options;
    let (pos, h) = item.row(r);
    let mask = p.seq_mask(item.b);
    let range = mask.kv_range(pos);
    let diag = mask.diagonal(pos) as f32;
    for (j, x) in s.iter_mut().enumerate() {
        let jg = j0 + j;
        let mut t = *x;
        if let Some(cap) = o.softcap {
            t = cap * (t / cap).tanh() * LOG2_E;
        }
        if let Some(sl) = &o.alibi_slopes {
            t -= sl[h] * LOG2_E * (jg as f32 - diag).abs();
        }
        if !range.contains(&jg) {
            t = f32::NEG_INFINITY;
        }
        if let Some((b, view)) = &ctx.bias {
            t += (b.get(view.index([item.b, h, pos, jg])) as f32) * LOG2_E;
        }
        if let Some((m, view)) = &ctx.mask {
            if !m[view.index([item.b, h, pos, jg])] {
                t = f32::NEG_INFINITY;
            }
        }
        *x = t;
    }
}
