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

/// Runs one item of at most [`DECODE_ROWS`] rows: leaves the unnormalised
/// output rows in `ws.orow` (row-major, `dv` apart) and returns each row's
/// `(factor, lse)`.
pub fn run_item<T: CpuElement>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    ws: &mut Workspace,
    sinks: Option<&[f32]>,
) -> Vec<(f32, f32)> {
    let p = ctx.p;
    let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
    let rows = item.rows();
    assert!(rows <= DECODE_ROWS);
    // Query rows, scaled into base-2 units (natural units under soft-cap).
    let qs = if p.options.softcap.is_some() {
        p.scale()
    } else {
        p.scale() * LOG2_E
    };
    for r in 0..DECODE_ROWS {
        let dst = &mut ws.qd[r * dk..(r + 1) * dk];
        if r < rows {
            let (pos, h) = item.row(r);
            gather_row(ctx.q, &p.q, [item.b, pos, h, 0], dk, dst);
            dst.iter_mut().for_each(|x| *x *= qs);
        } else {
            dst.fill(0.0);
        }
    }
    ws.orow[..DECODE_ROWS * dv].fill(0.0);
    let mut m = [f32::NEG_INFINITY; DECODE_ROWS];
    let mut l = [0.0f32; DECODE_ROWS];
    let mask = p.seq_mask(item.b);
    let span = mask.kv_span(item.positions());
    let (lo, hi) = (span.start.max(item.keys.start), span.end.min(item.keys.end));
    let per_element = ctx.per_element();
    let g = (item.b, item.kvh);
    let mut j0 = lo;
    while j0 < hi {
        let n = KEYS.min(hi - j0);
        let class = mask.classify(item.positions(), j0..j0 + n);
        if class == TileClass::Skip {
            j0 += n;
            continue;
        }
        let next = KEYS.min(hi.saturating_sub(j0 + n));
        if next > 0 {
            prefetch_rows(ctx.k, &p.k, g, (j0 + n, next), dk);
            prefetch_rows(ctx.v, &p.v, g, (j0 + n, next), dv);
        }
        // K^T of the tile, keys past n zero.
        let (k, ks) = kv_rows(ctx.k, &p.k, g, (j0, n), dk, &mut ws.kbuf);
        transpose_keys(k, ks, n, dk, &mut ws.kt);
        // Scores: DECODE_ROWS x KEYS.
        scores(&ws.qd, &ws.kt, dk, &mut ws.sd);
        // Masks and per-element terms; keys past n are excluded.
        for r in 0..DECODE_ROWS {
            let srow = &mut ws.sd[r * KEYS..(r + 1) * KEYS];
            if r >= rows {
                srow.fill(f32::NEG_INFINITY);
                continue;
            }
            srow[n..].fill(f32::NEG_INFINITY);
            if class == TileClass::Partial || per_element {
                transform_row(ctx, item, r, j0, &mut srow[..n]);
            }
        }
        // Online softmax per row.
        let mut alpha = [1.0f32; DECODE_ROWS];
        for r in 0..rows {
            let srow = &mut ws.sd[r * KEYS..(r + 1) * KEYS];
            let mx = srow[..n].iter().fold(m[r], |a, &x| {
                if a.is_nan() || x.is_nan() {
                    f32::NAN
                } else {
                    a.max(x)
                }
            });
            let shift = if mx == f32::NEG_INFINITY { 0.0 } else { mx };
            alpha[r] = (m[r] - shift).exp2();
            let mut sum = V::ZERO;
            for v in 0..KV {
                // SAFETY: v * 16 + 16 <= KEYS = srow.len().
                let e = exp2(unsafe { load(srow.as_ptr().add(v * LANES)) } - V::splat(shift));
                // SAFETY: as above.
                unsafe { store(srow.as_mut_ptr().add(v * LANES), e) };
                sum += e;
            }
            l[r] = l[r] * alpha[r] + sum.reduce_add();
            m[r] = mx;
        }
        // O = alpha O + P V, values straight from their rows.
        let (v, vs) = kv_rows(ctx.v, &p.v, g, (j0, n), dv, &mut ws.vbuf);
        accumulate(&ws.sd, v, vs, n, dv, &alpha, &mut ws.orow);
        j0 += n;
    }
    (0..rows)
        .map(|r| finish_row(m[r], l[r], sinks.map(|s| s[item.row(r).1])))
        .collect()
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
