//! Running the work items on the threads and writing results.
//!
//! Items are grouped by (batch, key/value head) and ordered by decreasing
//! cost (visible pairs) within each group: under a causal mask the heavy
//! last blocks start first and the light ones fill in at the end instead of
//! straggling, taking from each other's ranges balances the threads
//! (`threads/`), and consecutive
//! items of a thread read the same head's K and V, which then stay in L2/L3
//! (ordering by cost across heads measured 5-15% slower at S = 2048-8192 on
//! two threads: every item brought another head's K/V from DRAM). Each
//! item writes its own output rows (disjoint by construction), so no result
//! depends on which thread ran what. When keys are split (decoding), the
//! chunks of a block run in parallel into a buffer of partial states that
//! is merged in chunk order, again independent of the thread count.

use crate::blocking::LANES;
use crate::element::CpuElement;
use crate::pack::{Ahead, Hint};
use crate::simd::{load, store, vectorize, Isa, Op, Vector};
use crate::softmax::finish_row;
use crate::threads::Threads;
use crate::tiling::{run_item, Ctx};
use crate::work::{chunks, row_blocks, split_keys, Item};
use crate::workspace::{Lease, Workspace};
use attn_spec::{merge_states, View};
use std::f32::consts::LN_2;

/// Where results go: raw pointers into the output and log-sum-exp buffers,
/// shared by the threads. Every item writes a disjoint set of elements.
pub struct Sink<T> {
    out: *mut T,
    out_len: usize,
    lse: *mut f32,
    lse_len: usize,
}

// SAFETY: the pointers are only written through `write_row` and
// `write_block` (the latter also as whole vectors through `store16`), at elements
// that no other item writes (rows are partitioned among items, and the
// output view was validated not to alias), while the buffers are borrowed
// mutably for the whole parallel section.
unsafe impl<T: Send> Send for Sink<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Sink<T> {}

impl<T: CpuElement> Sink<T> {
    /// Wraps the output (and optional log-sum-exp) buffers.
    pub fn new(out: &mut [T], lse: Option<&mut [f32]>) -> Self {
        let (lse, lse_len) = match lse {
            Some(l) => (l.as_mut_ptr(), l.len()),
            None => (std::ptr::null_mut(), 0),
        };
        Sink {
            out: out.as_mut_ptr(),
            out_len: out.len(),
            lse,
            lse_len,
        }
    }

    /// Whether the caller asked for the log-sum-exp.
    pub fn keeps_lse(&self) -> bool {
        !self.lse.is_null()
    }

    /// Address of the output's first element, for prefetching only.
    pub fn addr(&self) -> usize {
        self.out as usize
    }

    /// Writes one output row `(b, pos, h)` as `row * f`, and its
    /// log-sum-exp.
    pub fn write_row(
        &self,
        ctx: &Ctx<'_, T>,
        (b, pos, h): (usize, usize, usize),
        row: &[f32],
        f: f32,
        lse: f32,
    ) {
        let p = ctx.p;
        let dv = p.shape.head_dim_v;
        let base = p.out.index([b, pos, h, 0]);
        let step = if dv > 1 { p.out.strides[3] } else { 1 };
        assert!(row.len() == dv && base + (dv - 1) * step < self.out_len);
        if step == 1 {
            // SAFETY: base..base+dv is in bounds (checked) and no other item
            // writes row (b, pos, h), so this is the only reference to it.
            let dst = unsafe { std::slice::from_raw_parts_mut(self.out.add(base), dv) };
            T::store_scaled(row, f, dst);
        } else {
            for (c, &x) in row.iter().enumerate() {
                // SAFETY: base + c*step <= base + (dv-1)*step is in bounds
                // (checked); no other item writes row (b, pos, h).
                unsafe { *self.out.add(base + c * step) = T::from_f32(x * f) };
            }
        }
        if !self.lse.is_null() {
            let at = (b * p.shape.q_heads + h) * p.shape.q_len + pos;
            assert!(at < self.lse_len);
            // SAFETY: as above.
            unsafe { *self.lse.add(at) = lse };
        }
    }

    /// Writes the rows of block `it` from its running output `O^T` (`dv x
    /// w`, row `r` in lane `r`), each row multiplied by its factor, with
    /// its log-sum-exp (`fin[r] = (factor, lse)`). One pass: 16 x 16
    /// register transposes, each result row scaled and stored straight
    /// into the output row (converted to `T`).
    #[inline(always)]
    pub fn write_block<V: Vector>(
        &self,
        ctx: &Ctx<'_, T>,
        it: &Item,
        (ot, w): (&[f32], usize),
        fin: &[(f32, f32)],
    ) {
        let p = ctx.p;
        let dv = p.shape.head_dim_v;
        let rows = it.rows();
        let step = if dv > 1 { p.out.strides[3] } else { 1 };
        assert!(
            fin.len() == rows
                && rows <= w
                && w.is_multiple_of(LANES)
                && ot.len() >= dv * w
                && dv > 0
        );
        for r0 in (0..rows).step_by(LANES) {
            let live = (rows - r0).min(LANES);
            let base: [usize; LANES] = std::array::from_fn(|i| {
                if i < live {
                    let (pos, h) = it.row(r0 + i);
                    p.out.index([it.b, pos, h, 0])
                } else {
                    0
                }
            });
            for &at in &base[..live] {
                assert!(at + (dv - 1) * step < self.out_len);
            }
            let mut c0 = 0;
            if live == LANES && step == 1 {
                // Sixteen rows with unit stride: whole vectors, rounded to
                // T in vectors (`CpuElement::store16`); no per-element work
                // (a third faster than the loop below for f32, timed with
                // the cycle counter on S = 512 causal; for bf16 the loop's
                // scalar rounding was 4% of an S = 512 causal call).
                #[cfg(target_arch = "x86_64")]
                if T::DTYPE == attn_spec::DType::Bf16 && ctx.dot16 {
                    let f: [f32; LANES] = std::array::from_fn(|i| fin[r0 + i].0);
                    // bf16 rows on a level with AVX512_BF16 (`ctx.dot16`):
                    // rounded and transposed in pairs of columns.
                    let dst = base.map(|at| self.out.wrapping_add(at).cast::<u16>());
                    // SAFETY: O^T holds dv x w floats and r0 + 16 <= w
                    // (asserted above); each row's dv elements are inside
                    // the output (asserted per row) and no other item
                    // writes them; T is bf16, two bytes of bits; the CPU
                    // runs AVX512_BF16 (`dot16::applies`).
                    c0 = unsafe {
                        crate::dot16::write_rows_bf16(ot[r0..].as_ptr(), w, &f, &dst, dv)
                    };
                }
                let mut f = [V::ZERO; LANES];
                for (x, fi) in f.iter_mut().zip(&fin[r0..r0 + LANES]) {
                    *x = V::splat(fi.0);
                }
                while c0 + LANES <= dv {
                    let mut blk = [V::ZERO; LANES];
                    for (c, b) in blk.iter_mut().enumerate() {
                        // SAFETY: c0 + c < dv and r0 + 16 <= w: inside ot
                        // (asserted above).
                        *b = unsafe { load::<V>(ot.as_ptr().add((c0 + c) * w + r0)) };
                    }
                    let t = V::transpose16(blk);
                    for i in 0..LANES {
                        // SAFETY: base[i] + c0 + 16 <= base[i] + dv is
                        // inside the output (asserted per row); no other
                        // item writes this row.
                        unsafe { T::store16(self.out.add(base[i] + c0), t[i] * f[i]) };
                    }
                    c0 += LANES;
                }
            }
            while c0 < dv {
                let wc = LANES.min(dv - c0);
                let mut blk = [V::ZERO; LANES];
                for (c, b) in blk.iter_mut().enumerate().take(wc) {
                    // SAFETY: c0 + c < dv and r0 + 16 <= w: inside ot
                    // (asserted above).
                    *b = unsafe { load::<V>(ot.as_ptr().add((c0 + c) * w + r0)) };
                }
                let t = V::transpose16(blk);
                for (i, &at) in base[..live].iter().enumerate() {
                    let row = t[i].to_array();
                    let vals = &row[..wc];
                    let f = fin[r0 + i].0;
                    if step == 1 {
                        // SAFETY: at + c0 + wc <= at + dv is inside the
                        // output (asserted per row) and no other item
                        // writes this row.
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(self.out.add(at + c0), wc) };
                        T::store_scaled(vals, f, dst);
                    } else {
                        for (c, &x) in vals.iter().enumerate() {
                            // SAFETY: at + (c0 + c) * step is inside the
                            // output (asserted per row); no other item
                            // writes this row.
                            unsafe { *self.out.add(at + (c0 + c) * step) = T::from_f32(x * f) };
                        }
                    }
                }
                c0 += wc;
            }
            if !self.lse.is_null() {
                for i in 0..live {
                    let (pos, h) = it.row(r0 + i);
                    let at = (it.b * p.shape.q_heads + h) * p.shape.q_len + pos;
                    assert!(at < self.lse_len);
                    // SAFETY: in bounds (asserted); no other item writes
                    // the log-sum-exp of this row.
                    unsafe { *self.lse.add(at) = fin[r0 + i].1 };
                }
            }
        }
    }
}

/// Runs a unit of one or two items (see [`units`]) and writes their rows
/// to `sink`. Blocks of the main path go from the running output `O^T` to
/// the output rows in one pass (`Sink::write_block`); decode-sized blocks
/// write their row-major rows.
#[inline(always)]
fn run_and_write<V: Vector, T: CpuElement>(
    ctx: &Ctx<'_, T>,
    unit: &[Item],
    ws: &mut Workspace,
    sinks: Option<&[f32]>,
    sink: &Sink<T>,
) {
    #[inline(always)]
    fn go<V: Vector, T: CpuElement, const NV: usize>(
        ctx: &Ctx<'_, T>,
        unit: &[Item],
        ws: &mut Workspace,
        sinks: Option<&[f32]>,
        sink: &Sink<T>,
    ) {
        let w = NV * LANES;
        let dv = ctx.p.shape.head_dim_v;
        let sms = V::run_items::<T, NV>(ctx, unit, ws);
        // Without a log-sum-exp to store, only the factors (the lse slot,
        // never read, is NaN).
        let keep_lse = sink.keeps_lse();
        let mut fin = [(0.0, f32::NAN); crate::blocking::ROWS];
        for (i, (it, sm)) in unit.iter().zip(&sms).enumerate() {
            let fin = &mut fin[..it.rows()];
            match (keep_lse, sinks) {
                // The common case, a vector at a time.
                (false, None) => sm.factors(fin),
                _ => {
                    for (r, f) in fin.iter_mut().enumerate() {
                        let s = sinks.map(|v| v[it.row(r).1]);
                        *f = match keep_lse {
                            true => sm.finish(r, s),
                            false => (sm.factor(r, s), f32::NAN),
                        };
                    }
                }
            }
            sink.write_block::<V>(ctx, it, (&ws.ot[i * dv * w..(i + 1) * dv * w], w), fin);
        }
    }
    let rows = unit.iter().map(Item::rows).max().unwrap_or(0);
    if rows <= crate::decode::DECODE_ROWS {
        let dv = ctx.p.shape.head_dim_v;
        for it in unit {
            let finish = crate::decode::run_item::<V, T>(ctx, it, ws, sinks);
            for (r, &(f, lse)) in finish.iter().enumerate() {
                let (pos, h) = it.row(r);
                sink.write_row(ctx, (it.b, pos, h), &ws.orow[r * dv..(r + 1) * dv], f, lse);
            }
        }
    } else if rows <= LANES {
        go::<V, T, 1>(ctx, unit, ws, sinks, sink);
    } else {
        go::<V, T, { crate::blocking::ROW_VECS }>(ctx, unit, ws, sinks, sink);
    }
}

/// The row blocks of `p` grouped by (batch, K/V head), heaviest first
/// within each group (see the module docs).
fn sorted_blocks(p: &attn_spec::Problem) -> Vec<Item> {
    let mut blocks = row_blocks(p);
    // The cost is the block's rows times its span of keys: the visible
    // pairs rounded up to whole rows of the span, in the same order as
    // the pairs wherever the span's length follows them (causal: later
    // blocks see more; windows: equal inside), from the two end rows
    // (`SeqMask::kv_span`) instead of a walk over every row (0.6% of a
    // 2 ms S = 512 causal call).
    let cost = |it: &Item| p.seq_mask(it.b).kv_span(it.positions()).len() * it.rows();
    blocks.sort_by_cached_key(|it| (it.b, it.kvh, std::cmp::Reverse(cost(it))));
    blocks
}

/// Cuts the sorted blocks into units of work: two consecutive blocks of
/// the same batch entry and key/value head run as one pass over their
/// keys (`tiling::run_items`) when both take the full-width path, their
/// key spans overlap, the head's value rows do not fit the kept packed
/// rows (`PackedV`) and the problem has at least `PAIR_MIN_BLOCKS` blocks
/// (so pairing leaves enough units for the cores): each shared key tile
/// is then read, and its values packed, once for 2 x 64 rows.
/// Shorter spans keep single blocks: their K and V stay in L2 and their
/// values stay packed across blocks anyway. The cut depends on the
/// problem only, never on the thread count. Measured (1 thread, d = 128,
/// the bench cases run alternately with and without pairs in one process,
/// medians of 6): S = 8192 causal +9%, S = 2048 +7.5%, S = 2048 causal +3%.
fn units(p: &attn_spec::Problem, blocks: &[Item]) -> Vec<std::ops::Range<usize>> {
    let vs = crate::pack::packed_stride(p.shape.head_dim_v);
    let span = |it: &Item| {
        let s = p.seq_mask(it.b).kv_span(it.positions());
        s.start.max(it.keys.start)..s.end.min(it.keys.end)
    };
    let pairs_well = |a: &Item, b: &Item| {
        let (sa, sb) = (span(a), span(b));
        (a.b, a.kvh) == (b.b, b.kvh)
            && a.keys == b.keys
            && a.rows().min(b.rows()) > LANES
            && sa.start.max(sb.start) < sa.end.min(sb.end)
            && !crate::pack::PackedV::fits(sa.end.max(sb.end), vs)
    };
    if blocks.len() < crate::blocking::PAIR_MIN_BLOCKS {
        return (0..blocks.len()).map(|i| i..i + 1).collect();
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < blocks.len() {
        let n = if i + 1 < blocks.len() && pairs_well(&blocks[i], &blocks[i + 1]) {
            2
        } else {
            1
        };
        out.push(i..i + n);
        i += n;
    }
    out
}

/// Transposes the running output `O^T` (`dv x rows`, `rows` a multiple of
/// 16) into row-major `rows x dv` with 16 x 16 register transposes, so
/// each output row is then contiguous.
#[inline(always)]
fn transpose_out<V: Vector>(ot: &[f32], dv: usize, rows: usize, orow: &mut [f32]) {
    assert!(ot.len() >= dv * rows && orow.len() >= rows * dv && rows.is_multiple_of(LANES));
    let mut c0 = 0;
    while c0 < dv {
        let w = LANES.min(dv - c0);
        for r0 in (0..rows).step_by(LANES) {
            let mut blk = [V::ZERO; LANES];
            for (c, b) in blk.iter_mut().enumerate().take(w) {
                // SAFETY: c0 + c < dv and r0 + 16 <= rows: inside ot
                // (asserted above).
                *b = unsafe { load::<V>(ot.as_ptr().add((c0 + c) * rows + r0)) };
            }
            let t = V::transpose16(blk);
            for (r, row) in t.iter().enumerate() {
                let at = (r0 + r) * dv + c0;
                if w == LANES {
                    // SAFETY: at + 16 <= (r0 + r + 1) * dv <= rows * dv,
                    // inside orow (asserted above).
                    unsafe { store(orow.as_mut_ptr().add(at), *row) };
                } else {
                    orow[at..at + w].copy_from_slice(&row.to_array()[..w]);
                }
            }
        }
        c0 += w;
    }
}

/// Runs one item with the narrowest block that holds its rows, leaves its
/// unnormalised rows in `ws.orow` (row-major) and returns each row's
/// `(factor, lse)` (see `OnlineSoftmax::finish`).
#[inline(always)]
fn run_block<V: Vector, T: CpuElement>(
    ctx: &Ctx<'_, T>,
    it: &Item,
    ws: &mut Workspace,
    sinks: Option<&[f32]>,
) -> Vec<(f32, f32)> {
    #[inline(always)]
    fn go<V: Vector, T: CpuElement, const NV: usize>(
        ctx: &Ctx<'_, T>,
        it: &Item,
        ws: &mut Workspace,
        sinks: Option<&[f32]>,
    ) -> Vec<(f32, f32)> {
        let sm = run_item::<V, T, NV>(ctx, it, ws);
        transpose_out::<V>(&ws.ot, ctx.p.shape.head_dim_v, NV * LANES, &mut ws.orow);
        (0..it.rows())
            .map(|r| sm.finish(r, sinks.map(|v| v[it.row(r).1])))
            .collect()
    }
    if it.rows() <= crate::decode::DECODE_ROWS {
        crate::decode::run_item::<V, T>(ctx, it, ws, sinks)
    } else if it.rows() <= LANES {
        go::<V, T, 1>(ctx, it, ws, sinks)
    } else {
        go::<V, T, { crate::blocking::ROW_VECS }>(ctx, it, ws, sinks)
    }
}

/// Maps `f` over `items` with a workspace for head dims `dims` leased
/// once by each thread that takes part (`Lease::new`), on the calling
/// thread and the helpers `threads` allows (`threads/`).
fn map_items<I: Sync, R: Send>(
    threads: Threads<'_>,
    items: &[I],
    (dk, dv): (usize, usize),
    f: impl Fn(&mut Workspace, &I) -> R + Sync + Send,
) -> Vec<R> {
    crate::threads::map(threads, items, || Lease::new(dk, dv), |ws, it| f(ws, it))
}

/// One unit of the main path ([`run_and_write`]) as an [`Op`], so that it
/// runs compiled for the call's level.
struct UnitOp<'a, 'c, T> {
    ctx: &'a Ctx<'c, T>,
    unit: &'a [Item],
    ws: &'a mut Workspace,
    sinks: Option<&'a [f32]>,
    sink: &'a Sink<T>,
}

impl<T: CpuElement> Op for UnitOp<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vector>(self) {
        run_and_write::<V, T>(self.ctx, self.unit, self.ws, self.sinks, self.sink);
    }
}

/// One chunk of keys of one block ([`run_block`]) as an [`Op`].
struct BlockOp<'a, 'c, T> {
    ctx: &'a Ctx<'c, T>,
    it: &'a Item,
    ws: &'a mut Workspace,
}

impl<T: CpuElement> Op for BlockOp<'_, '_, T> {
    type Output = Vec<(f32, f32)>;
    #[inline(always)]
    fn run<V: Vector>(self) -> Vec<(f32, f32)> {
        run_block::<V, T>(self.ctx, self.it, self.ws, None)
    }
}

/// The blocks of one batch entry over one chunk of keys in lockstep
/// (`decode::run_lockstep`) as an [`Op`].
struct LockstepOp<'a, 'c, T> {
    ctx: &'a Ctx<'c, T>,
    blocks: &'a [&'a Item],
    keys: std::ops::Range<usize>,
    ws: &'a mut Workspace,
}

impl<T: CpuElement> Op for LockstepOp<'_, '_, T> {
    type Output = Vec<crate::decode::DecodeState>;
    #[inline(always)]
    fn run<V: Vector>(self) -> Self::Output {
        crate::decode::run_lockstep::<V, T>(self.ctx, self.blocks, self.keys, self.ws)
    }
}

/// Computes the whole problem into `sink` with the kernels of `isa`, on
/// the calling thread and the helpers `threads` allows (see
/// `Cpu::parallel`).
pub fn run_all<T: CpuElement>(ctx: &Ctx<'_, T>, sink: &Sink<T>, threads: Threads<'_>, isa: Isa) {
    let p = ctx.p;
    let s = p.shape;
    let (dk, dv) = (s.head_dim_qk, s.head_dim_v);
    // Padding rows (beyond q_lens) are 0 with lse -inf.
    let padded: Vec<(usize, usize, usize)> = (0..s.batch)
        .flat_map(|b| {
            let ql = p.seq_lens(b).0;
            (ql..s.q_len).flat_map(move |pos| (0..s.q_heads).map(move |h| (b, pos, h)))
        })
        .collect();
    let zeros = vec![0.0f32; dv];
    for &at in &padded {
        sink.write_row(ctx, at, &zeros, 1.0, f32::NEG_INFINITY);
    }
    let blocks = sorted_blocks(p);
    let sinks = p.options.sinks.as_deref();
    if !split_keys(p, blocks.len()) {
        let units = units(p, &blocks);
        map_items(threads, &units, (dk, dv), |ws, at| {
            let unit = &blocks[at.clone()];
            // This unit's output rows, and the query rows of the unit that
            // most likely runs next on this thread (each thread takes
            // its units from a contiguous range, `threads/`).
            ws.ahead.clear();
            let out = (sink.addr(), size_of::<T>());
            let q = (ctx.q.as_ptr() as usize, size_of::<T>());
            for it in unit {
                for h in it.h0..it.h0 + it.nh {
                    let rows = ((it.b, it.p0, h), (it.np, dv));
                    push_run(&mut ws.ahead, out, &p.out, rows, Hint::Write);
                }
            }
            let k = units.partition_point(|u| u.start < at.end);
            let next = units.get(k).map_or(&[][..], |u| &blocks[u.clone()]);
            for it in next {
                for h in it.h0..it.h0 + it.nh {
                    let rows = ((it.b, it.p0, h), (it.np, dk));
                    push_run(&mut ws.ahead, q, &p.q, rows, Hint::L2);
                }
            }
            // A unit of another head starts on K and V rows no pass of this
            // thread has read: its first tile is asked for too.
            if let Some(n) = next
                .first()
                .filter(|n| (n.b, n.kvh) != (unit[0].b, unit[0].kvh))
            {
                let span = p.seq_mask(n.b).kv_span(n.positions());
                let j0 = span.start.max(n.keys.start);
                let j1 = span.end.min(n.keys.end).min(j0 + crate::blocking::KEYS);
                for (src, view, d) in [
                    (ctx.k.as_ptr() as usize, &p.k, dk),
                    (ctx.v.as_ptr() as usize, &p.v, dv),
                ] {
                    let rows = ((n.b, j0, n.kvh), (j1.saturating_sub(j0), d));
                    push_run(&mut ws.ahead, (src, size_of::<T>()), view, rows, Hint::L2);
                }
            }
            let op = UnitOp {
                ctx,
                unit,
                ws,
                sinks,
                sink,
            };
            vectorize(isa, op);
        });
        return;
    }
    // Split keys: partial states over fixed key chunks, merged per block in
    // chunk order. Decode-shaped problems in the [batch, seq, heads, dim]
    // layout run all heads of a batch entry in lockstep over each chunk
    // (contiguous K/V rows); otherwise every (block, chunk) pair is an item.
    let entries: Vec<(usize, Vec<f32>, Vec<f32>)> = if crate::decode::lockstep_ok(ctx, &blocks) {
        let mut batches: Vec<usize> = blocks.iter().map(|it| it.b).collect();
        batches.dedup();
        let parts: Vec<(usize, std::ops::Range<usize>)> = batches
            .iter()
            .flat_map(|&b| {
                let it = blocks.iter().find(|it| it.b == b).expect("a block of b");
                let span = p.seq_mask(b).kv_span(it.positions());
                chunks(span).into_iter().map(move |keys| (b, keys))
            })
            .collect();
        let per_part = map_items(threads, &parts, (dk, dv), |ws, (b, keys)| {
            let mine: Vec<(usize, &Item)> = blocks
                .iter()
                .enumerate()
                .filter(|(_, it)| it.b == *b)
                .collect();
            let its: Vec<&Item> = mine.iter().map(|(_, it)| *it).collect();
            let op = LockstepOp {
                ctx,
                blocks: &its,
                keys: keys.clone(),
                ws,
            };
            let states = vectorize(isa, op);
            mine.iter()
                .zip(states)
                .map(|(&(bi, it), st)| {
                    let fin = st.finish(it, None);
                    let mut o = st.o[..it.rows() * dv].to_vec();
                    let l: Vec<f32> = fin.iter().map(|f| f.1).collect();
                    for (r, &(f, _)) in fin.iter().enumerate() {
                        o[r * dv..(r + 1) * dv].iter_mut().for_each(|x| *x *= f);
                    }
                    (bi, o, l)
                })
                .collect::<Vec<_>>()
        });
        per_part.into_iter().flatten().collect()
    } else {
        let parts: Vec<(usize, Item)> = blocks
            .iter()
            .enumerate()
            .flat_map(|(bi, it)| {
                let span = p.seq_mask(it.b).kv_span(it.positions());
                chunks(span)
                    .into_iter()
                    .map(move |keys| (bi, Item { keys, ..it.clone() }))
            })
            .collect();
        map_items(threads, &parts, (dk, dv), |ws, (bi, it)| {
            let finish = vectorize(isa, BlockOp { ctx, it, ws });
            let mut o = ws.orow[..it.rows() * dv].to_vec();
            let mut l = vec![0.0f32; it.rows()];
            for (r, &(f, lse)) in finish.iter().enumerate() {
                l[r] = lse;
                o[r * dv..(r + 1) * dv].iter_mut().for_each(|x| *x *= f);
            }
            (*bi, o, l)
        })
    };
    blocks.iter().enumerate().for_each(|(bi, it)| {
        let rows = it.rows();
        let mut o = vec![0.0f32; rows * dv];
        let mut l = vec![f32::NEG_INFINITY; rows];
        for (_, po, pl) in entries.iter().filter(|(b, _, _)| *b == bi) {
            merge_states(&mut o, &mut l, po, pl).expect("partial states have matching sizes");
        }
        for r in 0..rows {
            let (pos, h) = it.row(r);
            // The sink joins as one more part, with output 0: finishing a
            // normalised row (l = 1) at its lse with the sink does that.
            let (f, lse) = match sinks {
                Some(sk) => finish_row(l[r] / LN_2, 1.0, Some(sk[h])),
                None => (1.0, l[r]),
            };
            let row = &o[r * dv..(r + 1) * dv];
            sink.write_row(ctx, (it.b, pos, h), row, f, lse);
        }
    });
}

/// Adds to `ahead` the rows of tensor `view` (elements of `size` bytes
/// from address `base`) of batch `b`, head `h`, positions `pos..pos +
/// count`, `d` elements each: one run, its rows one position's stride
/// apart (0 where the sequence axis is broadcast).
fn push_run(
    ahead: &mut Ahead,
    (base, size): (usize, usize),
    view: &View,
    ((b, pos, h), (count, d)): ((usize, usize, usize), (usize, usize)),
    hint: Hint,
) {
    let first = base.wrapping_add(view.index([b, pos, h, 0]) * size);
    let step = if view.dims[1] == 1 {
        0
    } else {
        view.strides[1]
    };
    ahead.push_rows(first, step * size, count, d * size, hint);
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_spec::{AttnOptions, DType, Problem, Shape};

    fn pairs(p: &Problem) -> usize {
        units(p, &sorted_blocks(p))
            .iter()
            .filter(|u| u.len() == 2)
            .count()
    }

    /// The shapes of `paired_blocks_pass` (tests/conformance.rs) do pair
    /// blocks, so that test exercises the paired pass; short spans, few
    /// blocks and decode-sized blocks never pair.
    #[test]
    fn units_pair_long_spans_only() {
        let causal = AttnOptions::default().causal();
        let window = AttnOptions::default()
            .window(Some(700), Some(0))
            .q_lens(vec![256, 200])
            .kv_lens(vec![1900, 1750]);
        let long = [
            (Shape::new(1, 4, 4, 512, 2000, 64), causal.clone()),
            (Shape::new(1, 8, 2, 256, 2000, 64), AttnOptions::default()),
            (Shape::new(2, 4, 4, 256, 1900, 64), window),
            (Shape::new(1, 4, 4, 512, 1800, 64), causal.clone()),
        ];
        for (shape, options) in long {
            let p = Problem::new(shape, DType::F32).with_options(options);
            assert!(pairs(&p) > 0, "{shape:?} made no pair");
        }
        let never = [
            // Spans that fit the kept value rows.
            Problem::new(Shape::new(1, 8, 8, 512, 512, 128), DType::F32),
            // Fewer than PAIR_MIN_BLOCKS blocks.
            Problem::new(Shape::new(1, 2, 2, 512, 4000, 64), DType::F32),
            // Decode-sized blocks.
            Problem::new(Shape::new(64, 32, 8, 1, 4000, 128), DType::F32),
        ];
        for p in never {
            assert_eq!(pairs(&p), 0, "{:?}", p.shape);
        }
    }
}
