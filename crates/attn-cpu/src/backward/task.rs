//! One task of the backward pass: one (batch entry, K/V head) over one
//! chunk of key blocks. For each key block (`task.keys` keys, at most
//! `BWD_KEYS`, the row stride of the block's buffers; packed once:
//! K rows, K^T, V^T), every query block (`BWD_ROWS` positions of one
//! query head of the group) that sees it recomputes its probabilities
//! from the stored log-sum-exp and runs FlashAttention-2's five products
//! through the one microkernel (`microkernel::gemm`):
//!
//! ```text
//! S  = Q K^T            P  = exp(x(S) - lse)     (x: scale, soft-cap, ALiBi, bias, masks)
//! dP = dO V^T           dS = P (dP - D),  dsc = dS * dx/d(q.k)
//! dV += P^T dO          dK += dsc^T Q            dQ_part += dsc K
//! ```
//!
//! dK and dV of the block are complete when its query blocks are done and
//! go straight to their rows; dQ accumulates in the task's f32 partial
//! rows (`Outs::parts`), summed over chunks afterwards in chunk order.
//! Every loop runs in an order fixed by the shape, so the result is the
//! same whichever thread runs the task.

use super::{pairs, Ctx, Outs, Task};
use crate::blocking::{BWD_KEYS, BWD_PANEL_BYTES, BWD_ROWS, LANES};
use crate::dot16::PairOut;
use crate::element::CpuElement;
use crate::microkernel::gemm::gemm;
use crate::pack::{prefetch_rows, Hint};
use crate::probs::{probabilities, score_probs, Scores, Tile};
use crate::simd::{load, store, Vector};
use attn_spec::{TileClass, View};

/// Buffers of one task (allocated per task: a few hundred KiB).
pub struct Scratch {
    pub(super) kr: Vec<f32>,
    /// A key block's V rows (f32, padded to 16), for V^T.
    pub(super) vr: Vec<f32>,
    pub(super) kt: Vec<f32>,
    pub(super) vt: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) d_o: Vec<f32>,
    pub(super) s: Vec<f32>,
    pub(super) dp: Vec<f32>,
    pub(super) slope: Vec<f32>,
    pub(super) dk: Vec<f32>,
    pub(super) dv: Vec<f32>,
    pub(super) add: Vec<f32>,
    /// `max(dqkp, dvp, BWD_KEYS)` zeros, never written: the partner of an
    /// odd last row or key when packing pairs.
    pub(super) zeros: Vec<f32>,
    /// The task's Q and dO rows, packed once (when they fit
    /// `BWD_PANEL_BYTES`).
    pub(super) qp: Vec<f32>,
    pub(super) dop: Vec<f32>,
    /// bf16 on AVX512_BF16 (`pairs.rs`): the panels as pairs along the
    /// head dimension (`q2`, `do2`) and as pairs of rows (`q2r`, `do2r`),
    /// K^T and V^T of a key block as pairs of their rows, K as pairs of
    /// keys.
    pub(super) q2: Vec<u32>,
    pub(super) do2: Vec<u32>,
    pub(super) q2r: Vec<u32>,
    pub(super) do2r: Vec<u32>,
    pub(super) kt2: Vec<u32>,
    pub(super) vt2: Vec<u32>,
    pub(super) k2r: Vec<u32>,
    /// A tile's P and dS as pairs of rows, and dS as pairs of keys.
    pub(super) p2: Vec<u32>,
    pub(super) ds2r: Vec<u32>,
    pub(super) ds2c: Vec<u32>,
    /// The padded head dims the tile buffers were sized for.
    pub(super) dims: (usize, usize),
}

/// Rows the packing loops prefetch ahead of the row they copy.
const PACK_AHEAD: usize = 8;

/// `x` rounded up to a multiple of `m`.
pub fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

impl Scratch {
    /// Buffers for head dims `dqk`, `dv` (padded to 16).
    pub fn new(dqk: usize, dv: usize) -> Self {
        let (dqkp, dvp) = (round_up(dqk, LANES), round_up(dv, LANES));
        let z = |n: usize| vec![0.0f32; n];
        Scratch {
            kr: z(BWD_KEYS * dqkp),
            vr: z(BWD_KEYS * dvp),
            kt: z(dqkp * BWD_KEYS),
            vt: z(dvp * BWD_KEYS),
            q: z(BWD_ROWS * dqkp),
            d_o: z(BWD_ROWS * dvp),
            s: z(BWD_ROWS * BWD_KEYS),
            dp: z(BWD_ROWS * BWD_KEYS),
            slope: z(BWD_ROWS * BWD_KEYS),
            dk: z(BWD_KEYS * dqkp),
            dv: z(BWD_KEYS * dvp),
            add: z(BWD_KEYS),
            zeros: z(dqkp.max(dvp).max(BWD_KEYS)),
            qp: Vec::new(),
            dop: Vec::new(),
            q2: Vec::new(),
            do2: Vec::new(),
            q2r: Vec::new(),
            do2r: Vec::new(),
            kt2: Vec::new(),
            vt2: Vec::new(),
            k2r: Vec::new(),
            p2: Vec::new(),
            ds2r: Vec::new(),
            ds2c: Vec::new(),
            dims: (dqkp, dvp),
        }
    }

    /// Whether these buffers serve head dims `dqk`, `dv`.
    pub fn fits(&self, dqk: usize, dv: usize) -> bool {
        self.dims.0 >= round_up(dqk, LANES) && self.dims.1 >= round_up(dv, LANES)
    }
}

/// Reads `len` elements of `src` from `view` at `[i0, i1, i2, 0..len]` into
/// `dst` as f32.
#[inline(always)]
pub fn read_row<V: Vector, T: CpuElement>(src: &[T], view: &View, at: [usize; 3], dst: &mut [f32]) {
    let len = dst.len();
    let base = view.index([at[0], at[1], at[2], 0]);
    if len <= 1 || view.strides[3] == 1 {
        T::widen::<V>(&src[base..base + len], dst);
    } else {
        for (d, x) in dst.iter_mut().enumerate() {
            *x = src[base + d * view.strides[3]].to_f32();
        }
    }
}

/// Whether a task's Q and dO rows (`ql` per head of the group, and a
/// block of spare rows the products' padding may read) fit f32 panels of
/// at most `BWD_PANEL_BYTES`, packed once for all its key blocks.
pub fn panel_fits(p: &attn_spec::Problem, ql: usize) -> bool {
    let s = p.shape;
    let (dqkp, dvp) = (
        round_up(s.head_dim_qk, LANES),
        round_up(s.head_dim_v, LANES),
    );
    (s.group() * ql + BWD_ROWS) * (dqkp + dvp) * 4 <= BWD_PANEL_BYTES
}

/// Runs `task`.
#[inline(always)]
pub fn run<V: Vector, T: CpuElement>(
    ctx: &Ctx<'_, T>,
    outs: &Outs<T>,
    task: &Task,
    ws: &mut Scratch,
) {
    // Keys per block, and the row stride of the block's tiles (K^T, V^T,
    // S and dP): the buffers are sized for BWD_KEYS.
    let ks = task.keys;
    assert!(ks <= BWD_KEYS && ks.is_multiple_of(LANES));
    outs.clear_parts(task);
    let p = ctx.p;
    let s = p.shape;
    let o = &p.options;
    let (b, kvh) = (task.b, task.kvh);
    let mask = p.seq_mask(b);
    let (ql, kl) = (mask.q_len, mask.kv_len);
    let group = s.group();
    let (dqk, dv) = (s.head_dim_qk, s.head_dim_v);
    let (dqkp, dvp) = (round_up(dqk, LANES), round_up(dv, LANES));
    let mr = V::mr(1);
    let cap = o.softcap;
    let scores = Scores {
        p,
        lse: ctx.lse,
        bias: ctx.bias,
        mask: ctx.mask,
    };
    // The task's Q and dO rows as f32 panels, packed once for all its key
    // blocks when they fit (rows of a head `ql` apart).
    let panel = panel_fits(p, ql) && !tests::no_panel();
    if panel && !task.blocks.is_empty() {
        let rows = group * ql + BWD_ROWS;
        for (buf, w) in [(&mut ws.qp, dqkp), (&mut ws.dop, dvp)] {
            if buf.len() < rows * w {
                buf.resize(rows * w, 0.0);
            }
        }
        for hh in 0..group {
            let h = kvh * group + hh;
            for i in 0..ql {
                // Rows of a head are `heads * d` apart in the BSHD layout:
                // misses the hardware prefetchers do not follow, so ask
                // for the rows a few ahead while this one is copied.
                if i + PACK_AHEAD < ql {
                    prefetch_rows(ctx.q, &p.q, (b, h), (i + PACK_AHEAD, 1), dqk, Hint::L1);
                    prefetch_rows(ctx.d_out, &p.out, (b, h), (i + PACK_AHEAD, 1), dv, Hint::L1);
                }
                let at = hh * ql + i;
                read_row::<V, T>(
                    ctx.q,
                    &p.q,
                    [b, i, h],
                    &mut ws.qp[at * dqkp..at * dqkp + dqk],
                );
                read_row::<V, T>(
                    ctx.d_out,
                    &p.out,
                    [b, i, h],
                    &mut ws.dop[at * dvp..at * dvp + dv],
                );
            }
        }
    }
    // bf16 on AVX512_BF16: the panels as pairs too, for the products on
    // `vdpbf16ps`, when every element of the task's rows is in the
    // backward's window (`pairs.rs`; else the f32 products, as for other
    // types). Rows of a head start at an even pair row: head hh's pairs of
    // rows at hh * hp.
    let hp = ql.div_ceil(2);
    // (The pair buffers and products take rows of BWD_KEYS: the plan
    // gives whole blocks where the panels fit.)
    let pairs = ctx.dot16
        && panel
        && ks == BWD_KEYS
        && !task.blocks.is_empty()
        && group * ql < 1 << 30
        && pairs::pack_task(ws, (group, ql), (dqk, dv));
    let blocks = task.blocks.clone();
    for blk in blocks {
        let j0 = blk * ks;
        let all = ks.min(s.kv_len - j0);
        let n = all.min(kl.saturating_sub(j0));
        if n == 0 || ql == 0 {
            outs.write_kv::<V>(ctx, (b, kvh, j0), (0, all), (&ws.dk, dqkp), (&ws.dv, dvp));
            continue;
        }
        let nvec = n.div_ceil(LANES);
        let ncols = nvec * LANES;
        // On pairs, K^T, V^T and K's pairs of keys straight from the bf16
        // rows when they lie so (`pairs::block_from_inputs`); else, or
        // when the block's values do not fit, K^T and V^T in f32 (packed
        // as pairs by `pairs::pack_block` in the first case). K's f32
        // rows always: a tile whose dS fits no scale runs dQ in f32.
        let direct = pairs && pairs::from_inputs(p);
        let mut block_pairs = direct && pairs::block_from_inputs(ctx, ws, (b, kvh), (j0, n));
        let transposed = !block_pairs;
        for r in 0..n {
            if r + PACK_AHEAD < n {
                let next = (j0 + r + PACK_AHEAD, 1);
                prefetch_rows(ctx.k, &p.k, (b, kvh), next, dqk, Hint::L1);
                if transposed {
                    prefetch_rows(ctx.v, &p.v, (b, kvh), next, dv, Hint::L1);
                }
            }
            let dst = &mut ws.kr[r * dqkp..r * dqkp + dqk];
            read_row::<V, T>(ctx.k, &p.k, [b, j0 + r, kvh], dst);
            if transposed {
                let dst = &mut ws.vr[r * dvp..r * dvp + dv];
                read_row::<V, T>(ctx.v, &p.v, [b, j0 + r, kvh], dst);
            }
        }
        if transposed {
            transpose_rows::<V>(&ws.kr, dqkp, n, &mut ws.kt, ks);
            transpose_rows::<V>(&ws.vr, dvp, n, &mut ws.vt, ks);
        }
        if !direct {
            // K^T, V^T and K as pairs, when the block's keys and values
            // fit too.
            block_pairs = pairs && pairs::pack_block(ws, n, (dqk, dv));
        }
        let nk = round_up(n, mr);
        ws.dk[..nk * dqkp].iter_mut().for_each(|x| *x = 0.0);
        ws.dv[..nk * dvp].iter_mut().for_each(|x| *x = 0.0);
        for hh in 0..group {
            let h = kvh * group + hh;
            for ib in (0..ql).step_by(BWD_ROWS) {
                let mb = BWD_ROWS.min(ql - ib);
                if mask.classify(ib..ib + mb, j0..j0 + n) == TileClass::Skip {
                    continue;
                }
                // Only the rows that see a key of the block (a causal or
                // window diagonal leaves the others out), from a multiple
                // of mr so the products' rows stay inside the block.
                let (mut r_lo, mut r_hi) = (mb, 0);
                for r in 0..mb {
                    let v = mask.kv_range(ib + r);
                    if v.start < (j0 + n).min(v.end) && v.end > j0 {
                        r_lo = r_lo.min(r);
                        r_hi = r + 1;
                    }
                }
                let r_lo = r_lo - r_lo % mr;
                let (i0, mq) = (ib + r_lo, r_hi - r_lo);
                let mqp = round_up(mq, mr);
                // Q and dO rows i0..i0+mqp of head h: in the panels, or
                // packed for this tile.
                let (qa, da) = if panel {
                    let at = hh * ql + i0;
                    (ws.qp[at * dqkp..].as_ptr(), ws.dop[at * dvp..].as_ptr())
                } else {
                    for r in 0..mq {
                        let dst = &mut ws.q[r * dqkp..r * dqkp + dqk];
                        read_row::<V, T>(ctx.q, &p.q, [b, i0 + r, h], dst);
                        let dst = &mut ws.d_o[r * dvp..r * dvp + dv];
                        read_row::<V, T>(ctx.d_out, &p.out, [b, i0 + r, h], dst);
                    }
                    (ws.q.as_ptr(), ws.d_o.as_ptr())
                };
                // S = Q K^T, then P = exp(x - lse) in place.
                let tile = Tile {
                    bh: (b, h),
                    rows: (i0, mq),
                    keys: (j0, n),
                    stride: ks,
                };
                let slope = cap.is_some().then_some(&mut ws.slope[..]);
                if block_pairs {
                    // S = Q K^T and dP = dO V^T on bf16 pairs, then P.
                    let at = hh * ql + i0;
                    // Row strides of the pair panels, and pairs per product.
                    let (wq, wv) = (dqkp / 2, dvp / 2);
                    let (kq, kv) = (dqk.div_ceil(2), dv.div_ceil(2));
                    assert!(
                        mqp.is_multiple_of(12)
                            && ws.q2.len() >= (at + mqp) * wq
                            && ws.do2.len() >= (at + mqp) * wv
                            && ws.s.len() >= mqp * BWD_KEYS
                            && ws.dp.len() >= mqp * BWD_KEYS
                    );
                    // SAFETY: the panels hold rows at..at+mqp of wq / wv
                    // words (asserted), kt2 and vt2 wq / wv rows of
                    // BWD_KEYS >= ncols words, s and dp mqp rows of
                    // BWD_KEYS floats (asserted); mqp is a multiple of 12
                    // and ncols of 16; the level is avx512bf16 (dot16).
                    unsafe {
                        crate::dot16::gemm_pairs(
                            (mqp, ncols, kq),
                            (ws.q2[at * wq..].as_ptr(), wq, 1),
                            (ws.kt2.as_ptr(), BWD_KEYS),
                            (ws.s.as_mut_ptr(), BWD_KEYS, PairOut::Set),
                        );
                        crate::dot16::gemm_pairs(
                            (mqp, ncols, kv),
                            (ws.do2[at * wv..].as_ptr(), wv, 1),
                            (ws.vt2.as_ptr(), BWD_KEYS),
                            (ws.dp.as_mut_ptr(), BWD_KEYS, PairOut::Set),
                        );
                    }
                    probabilities::<V>(&scores, tile, &mut ws.s, &mut ws.add, slope);
                } else {
                    // SAFETY: qa has mqp rows of dqkp floats (the tile
                    // buffer holds BWD_ROWS >= mqp rows; a panel, BWD_ROWS
                    // spare rows past its last head's), kt dqk rows of
                    // ks, 0 past the block's keys; mqp is mq rounded
                    // up to mr.
                    unsafe {
                        score_probs::<V>(
                            &scores,
                            tile,
                            (qa, dqkp, dqk),
                            ws.kt.as_ptr(),
                            &mut ws.s,
                            (&mut ws.add, slope),
                        )
                    };
                    // dP = dO V^T.
                    // SAFETY: as for S, with d_o (dvp) and vt (dv rows).
                    unsafe {
                        gemm::<V>(
                            (mqp, ncols, dv),
                            da,
                            (dvp, 1),
                            ws.vt.as_ptr(),
                            ks,
                            ws.dp.as_mut_ptr(),
                            ks,
                            false,
                        )
                    };
                }
                // dS = P (dP - D); the bias gradient; dsc = dS dx/d(q.k).
                let tile = ((b, h), (i0, mq), (j0, n));
                let (max, min, finite) = match block_pairs {
                    true => ds_tile::<V, T, true>(ctx, outs, tile, ks, ws),
                    false => ds_tile::<V, T, false>(ctx, outs, tile, ks, ws),
                };
                // Rows mq..mqp of the dQ product hold no row of this tile
                // (they may be the next rows of the block): they add 0.
                ws.dp[mq * ks..mqp * ks].iter_mut().for_each(|x| *x = 0.0);
                // The three products: on pairs (`pairs.rs`), dV always and
                // dK, dQ when the tile's dS fits a scale; else in f32.
                let mut ds_done = false;
                if block_pairs {
                    let g = pairs::Tile {
                        at: (hh * hp + i0 / 2, i0),
                        rows: (mq, mqp),
                        keys: (n, ncols, nk),
                        dims: (dqkp, dvp),
                    };
                    ds_done = pairs::products(ws, (outs, task, hh), g, (max, min, finite));
                } else {
                    // s holds mq rows of ks floats (A read
                    // transposed: key r, row kk at kk * ks + r, r <
                    // nk <= ks), d_o mq rows of dvp, dv nk rows.
                    // SAFETY: every extent above is inside its buffer.
                    unsafe {
                        gemm::<V>(
                            (nk, dvp, mq),
                            ws.s.as_ptr(),
                            (1, ks),
                            da,
                            dvp,
                            ws.dv.as_mut_ptr(),
                            dvp,
                            true,
                        );
                    }
                }
                if !ds_done {
                    // As dV, with dp (dsc) and q (dqkp), dk; the partial
                    // rows of this block are rows i0..i0+mqp of head hh
                    // (the task's rows are padded to a multiple of
                    // BWD_ROWS, itself a multiple of mr).
                    // SAFETY: every extent is inside its buffer.
                    unsafe {
                        gemm::<V>(
                            (nk, dqkp, mq),
                            ws.dp.as_ptr(),
                            (1, ks),
                            qa,
                            dqkp,
                            ws.dk.as_mut_ptr(),
                            dqkp,
                            true,
                        );
                        let part = outs.part_rows(task, hh, i0, mqp);
                        gemm::<V>(
                            (mqp, dqkp, n),
                            ws.dp.as_ptr(),
                            (ks, 1),
                            ws.kr.as_ptr(),
                            dqkp,
                            part,
                            dqkp,
                            true,
                        );
                    }
                }
            }
        }
        outs.write_kv::<V>(ctx, (b, kvh, j0), (n, all), (&ws.dk, dqkp), (&ws.dv, dvp));
    }
}

/// Rows `0..n` of `src` (`w` floats each, `w` a multiple of 16) transposed
/// into `dst` (`w` rows of `ld` floats), columns `n..round_up(n, 16)` 0:
/// 16 x 16 blocks on the level's vectors (`Vector::transpose16`).
#[inline(always)]
pub fn transpose_rows<V: Vector>(src: &[f32], w: usize, n: usize, dst: &mut [f32], ld: usize) {
    let ncols = n.div_ceil(LANES) * LANES;
    assert!(
        w.is_multiple_of(LANES)
            && ncols <= ld
            && n * w <= src.len()
            && (w == 0 || (w - 1) * ld + ncols <= dst.len())
    );
    for r0 in (0..n).step_by(LANES) {
        for c0 in (0..w).step_by(LANES) {
            let mut blk = [V::ZERO; LANES];
            for (r, x) in blk.iter_mut().enumerate().take(n - r0) {
                // SAFETY: (r0 + r) * w + c0 + 16 <= n * w <= src.len().
                *x = unsafe { load::<V>(src.as_ptr().add((r0 + r) * w + c0)) };
            }
            for (c, t) in V::transpose16(blk).into_iter().enumerate() {
                // SAFETY: (c0 + c) * ld + r0 + 16 <= (w - 1) * ld + ncols.
                unsafe { store(dst.as_mut_ptr().add((c0 + c) * ld + r0), t) };
            }
        }
    }
}

/// dS = P (dP - D) of one tile (`s` holds P, `dp` dP, rows `ks` apart), the bias
/// gradient, and dsc = dS dx/d(q.k) into `dp`. With `PAIRS` (`pairs.rs`),
/// P below 2^-126 is set to 0 first (in `s` too), and the largest and
/// smallest nonzero |dsc| are returned with whether every row's D is
/// finite.
#[inline(always)]
fn ds_tile<V: Vector, T: CpuElement, const PAIRS: bool>(
    ctx: &Ctx<'_, T>,
    outs: &Outs<T>,
    ((b, h), (i0, mq), (j0, n)): ((usize, usize), (usize, usize), (usize, usize)),
    ks: usize,
    ws: &mut Scratch,
) -> (f32, f32, bool) {
    let p = ctx.p;
    let s = p.shape;
    let cap = p.options.softcap;
    let scale = p.scale();
    let nvec = n.div_ceil(LANES);
    let (mut big, mut neg_small) = (V::ZERO, V::splat(f32::NEG_INFINITY));
    let mut finite = true;
    for r in 0..mq {
        let i = i0 + r;
        let dr = ctx.d[(b * s.q_heads + h) * s.q_len + i];
        finite &= dr.is_finite();
        for c in 0..nvec {
            let at = r * ks + c * LANES;
            // SAFETY: at + 16 <= (r + 1) * ks in both tiles.
            let (mut pv, dpv) = unsafe {
                (
                    load::<V>(ws.s.as_ptr().add(at)),
                    load::<V>(ws.dp.as_ptr().add(at)),
                )
            };
            if PAIRS {
                pv = pv.select_lt(f32::MIN_POSITIVE, V::ZERO, pv);
                // SAFETY: as above.
                unsafe { store(ws.s.as_mut_ptr().add(at), pv) };
            }
            let ds = pv * (dpv - V::splat(dr));
            if outs.has_dbias() {
                let m = (n - c * LANES).min(LANES);
                outs.add_dbias((b, h, i), j0 + c * LANES, &ds.to_array()[..m]);
            }
            let g = match cap {
                // SAFETY: as above, in the slope tile.
                Some(_) => unsafe { load::<V>(ws.slope.as_ptr().add(at)) },
                None => V::splat(scale),
            };
            let dsc = ds * g;
            if PAIRS {
                let a = dsc.abs();
                big = big.fast_max(a);
                let a = a.replace_where_eq(a, 0.0, f32::INFINITY);
                neg_small = neg_small.fast_max(V::ZERO - a);
            }
            // SAFETY: as above.
            unsafe { store(ws.dp.as_mut_ptr().add(at), dsc) };
        }
    }
    let max = big.to_array().into_iter().fold(0.0f32, f32::max);
    let min = -neg_small
        .to_array()
        .into_iter()
        .fold(f32::NEG_INFINITY, f32::max);
    (max, min, finite)
}

#[cfg(test)]
pub mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Tests force the per-tile packing of Q and dO (the path of problems
    /// too large for the panels).
    pub static NO_PANEL: AtomicBool = AtomicBool::new(false);

    pub fn no_panel() -> bool {
        NO_PANEL.load(Ordering::Relaxed)
    }

    fn transposes<V: crate::simd::Vector>() {
        for (n, w) in [(1usize, 16usize), (16, 48), (37, 16), (96, 64)] {
            let ld = 100;
            let src: Vec<f32> = (0..n * w).map(|i| i as f32 + 0.5).collect();
            let mut dst = vec![f32::NAN; w * ld];
            super::transpose_rows::<V>(&src, w, n, &mut dst, ld);
            for c in 0..w {
                for r in 0..ld {
                    let got = dst[c * ld + r];
                    match r {
                        _ if r < n => assert_eq!(got, src[r * w + c], "({n}, {w}) {c} {r}"),
                        _ if r < n.div_ceil(16) * 16 => assert_eq!(got, 0.0),
                        _ => assert!(got.is_nan(), "({n}, {w}) wrote {c} {r}"),
                    }
                }
            }
        }
    }

    /// A key block's rows transposed with 16 x 16 blocks: every element
    /// in place, keys to the next 16 zero, nothing past them.
    #[test]
    fn transpose_rows_moves_every_element() {
        crate::simd::for_each_vector!(transposes);
    }
}

#[cfg(not(test))]
mod tests {
    #[inline(always)]
    pub fn no_panel() -> bool {
        false
    }
}
