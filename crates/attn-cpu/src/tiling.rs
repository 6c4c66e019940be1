//! The loop nest of one work item: for a block of query rows, stream the
//! key tiles it can see, compute `S^T = K Q^T`, apply the per-element
//! transforms and masks where they are needed, fold the tile into the online
//! softmax and accumulate `O^T += V^T P^T`. A pass of two blocks of one head
//! (`run_items`) streams the union of their spans, and each block skips
//! the tiles it cannot see. No `S x S` matrix exists: the workspace is one
//! tile of each kind (two query panels and running outputs) plus at most
//! `PACKED_V_BYTES` of packed value rows, whatever the sequence length.
//!
//! Why query rows along the lanes (the transposed formulation): keys and
//! values are then read as broadcast scalars from their rows (no
//! transposition; f32 keys straight from the caller's tensor, values copied
//! to a stride that avoids L1 set aliasing, once per head and thread
//! when they fit `PACKED_V_BYTES`), the query panel `Q^T` is built once per
//! block and reused for every key tile, and the softmax's row maximum and
//! sum are plain lane-wise vector operations with no horizontal reduction.
//!
//! Masking follows the tile classifier of `attn_spec::SeqMask`: `Skip`
//! tiles are never visited (the loop runs over the block's visible key span
//! only), `Full` tiles run without any mask check, and only `Partial`
//! tiles, or problems with per-element terms (softcap, ALiBi, bias, boolean
//! mask), go through [`transform`]. On those tiles the kernels run only on
//! the vectors of rows that see each part of the tile (`parts.rs`).

use crate::bias::{add_bias_block, apply_mask_block};
use crate::blocking::{share, KEYS, LANES, PREFETCH_SPAN_BYTES, ROWS};
use crate::element::CpuElement;
use crate::exp::tanh;
use crate::microkernel::{keys_per_call, pv_vecs, scores_vecs};
use crate::pack::{
    kv_rows, kv_rows_again, pack_q, pack_rows, packed_stride, prefetch_rows, Hint, PackedV,
};
use crate::parts::Parts;
use crate::simd::{load, store, Vector};
use crate::softmax::OnlineSoftmax;
use crate::work::Item;
use crate::workspace::Workspace;
use attn_spec::{HostData, Problem, SeqMask, TileClass, View};
use std::f32::consts::LOG2_E;
use std::ops::Range;

/// Everything about a call that the loop nest reads.
pub struct Ctx<'a, T> {
    /// The problem.
    pub p: &'a Problem,
    /// Queries.
    pub q: &'a [T],
    /// Keys.
    pub k: &'a [T],
    /// Values.
    pub v: &'a [T],
    /// Additive bias and its view.
    pub bias: Option<(&'a HostData, View)>,
    /// Boolean mask and its view.
    pub mask: Option<(&'a [bool], View)>,
    /// `Some(c)` when Q times its pack multiplier `c` would overflow f32
    /// (a query element beyond `f32::MAX / |c|`, possible only when `|c| >
    /// 1`): Q is then packed unscaled and every score multiplied by `c`
    /// instead, so a finite score never passes through an infinite query.
    pub post_scale: Option<f32>,
    /// Whether prefill blocks run the bf16 dot-product path (`dot16/`):
    /// bf16 inputs on the `avx512bf16` level or above (set by [`Ctx::on`]).
    pub dot16: bool,
    /// What multiplies the bf16 pass's tiles of a multiple of 32 keys
    /// instead of `vdpbf16ps`, if anything (`dot16/amx.rs`): the AMX tiles
    /// on the `amx` level (set by [`Ctx::on`]), or their model in tests.
    pub tiles: Option<crate::dot16::amx::Unit>,
}

impl<'a, T: attn_spec::Element> Ctx<'a, T> {
    /// The context of a call; decides [`Ctx::post_scale`] (a scan of Q only
    /// when the multiplier exceeds 1).
    pub fn new(
        p: &'a Problem,
        (q, k, v): (&'a [T], &'a [T], &'a [T]),
        bias: Option<(&'a HostData, View)>,
        mask: Option<(&'a [bool], View)>,
    ) -> Self {
        let c = multiplier(p);
        let limit = f32::MAX / c.abs();
        let post_scale = (c.abs() > 1.0 && q.iter().any(|x| x.to_f32().abs() > limit)).then_some(c);
        Ctx {
            p,
            q,
            k,
            v,
            bias,
            mask,
            post_scale,
            dot16: false,
            tiles: None,
        }
    }

    /// The context for the kernels of `isa`: decides [`Ctx::dot16`].
    pub fn on(mut self, isa: crate::Isa) -> Self {
        self.dot16 = crate::dot16::applies(&self, isa);
        let amx = self.dot16 && isa == crate::Isa::Amx;
        self.tiles = amx.then_some(crate::dot16::amx::Unit::Tiles);
        self
    }

    /// With `model`, the bf16 pass runs its AMX path on the scalar model
    /// of the tile unit (`Cpu::with_tile_model`).
    pub fn tile_model(mut self, model: bool) -> Self {
        if model && self.dot16 {
            self.tiles = Some(crate::dot16::amx::Unit::Model);
        }
        self
    }
}

/// What Q is multiplied by so that `q . k` comes out in the units the
/// softmax runs in: the scale, and log2(e) too unless a soft-cap must first
/// see natural units.
pub fn multiplier(p: &Problem) -> f32 {
    let s = p.scale();
    if p.options.softcap.is_some() {
        s
    } else {
        s * LOG2_E
    }
}

impl<T> Ctx<'_, T> {
    /// Whether scores need per-element work beyond the causal/window mask.
    pub fn per_element(&self) -> bool {
        let o = &self.p.options;
        self.post_scale.is_some()
            || o.softcap.is_some()
            || o.alibi_slopes.is_some()
            || self.bias.is_some()
            || self.mask.is_some()
    }

    /// Multiplier of Q when packed: [`multiplier`], or 1 when that would
    /// overflow (see [`Ctx::post_scale`]).
    pub fn q_scale(&self) -> f32 {
        if self.post_scale.is_some() {
            1.0
        } else {
            multiplier(self.p)
        }
    }
}

/// Runs one item on blocks of `NV * 16` lanes (`item.rows() <= NV * 16`):
/// leaves the unnormalised output in `ws.ot` (`dv x NV*16`) and returns the
/// softmax state.
#[inline(always)]
pub fn run_item<V: Vector, T: CpuElement, const NV: usize>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    ws: &mut Workspace,
) -> OnlineSoftmax<V, NV> {
    let [sm, _] = V::run_items::<T, NV>(ctx, std::slice::from_ref(item), ws);
    sm
}

/// Runs one or two items of the same batch entry and key/value head (each
/// of at most `NV * 16` rows) in one pass over their keys: every key tile
/// is read, and its values packed, once for both (see `schedule::units`
/// for when the scheduler pairs blocks). Leaves item `i`'s unnormalised
/// output in `ws.ot[i * dv * NV*16..]` (`dv x NV*16`) and returns the
/// softmax states (the second is unused for one item).
///
/// Compiled out of line once per level, element type and width
/// (`Kernels::run_items`), not inlined into each path that calls it.
#[inline(always)]
pub fn run_items<V: Vector, T: CpuElement, const NV: usize>(
    ctx: &Ctx<'_, T>,
    items: &[Item],
    ws: &mut Workspace,
) -> [OnlineSoftmax<V, NV>; 2] {
    let p = ctx.p;
    let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
    let w = NV * LANES;
    let head = (items[0].b, items[0].kvh);
    assert!(
        (1..=2).contains(&items.len())
            && items
                .iter()
                .all(|it| it.rows() <= w && (it.b, it.kvh) == head && it.keys == items[0].keys)
    );
    for (i, it) in items.iter().enumerate() {
        pack_q::<V, T>(
            ctx.q,
            &p.q,
            it,
            (dk, w),
            ctx.q_scale(),
            &mut ws.qt[i * dk * w..(i + 1) * dk * w],
            &mut ws.qrow,
        );
    }
    ws.ot[..items.len() * dv * w].fill(0.0);
    let mut sms = [OnlineSoftmax::<V, NV>::new(), OnlineSoftmax::<V, NV>::new()];
    let mask = p.seq_mask(head.0);
    let (spans, (lo, hi)) = pass_spans(&mask, items);
    // Each item's row facts, made at its first masked tile (a pass whose
    // tiles are all full never needs them).
    let mut rows: [Option<RowInfo<V, NV>>; 2] = [None, None];
    let per_element = ctx.per_element();
    // The scheduler's rows to prefetch, spread over every score-kernel
    // call of the pass.
    ws.ahead
        .pace(items.len() * (hi - lo).div_ceil(KEYS) * KEYS.div_ceil(keys_per_call::<V>(NV)));
    // K and V rows of the next tile are prefetched into L2 during each
    // tile, unless the pass's whole span is small enough to have stayed in
    // L2 since the previous block of the same head read it (see
    // `PREFETCH_SPAN_BYTES`).
    let span_bytes = (hi - lo) * (dk + dv) * size_of::<T>();
    let prefetch = span_bytes > PREFETCH_SPAN_BYTES || ws.head != Some(head);
    if lo < hi {
        ws.head = Some(head);
    }
    let mut j0 = lo;
    while j0 < hi {
        let n = KEYS.min(hi - j0);
        let next_n = if prefetch { n.min(hi - j0 - n) } else { 0 };
        // The first block to visit the tile prefetches the next one and
        // packs the tile's values; the second finds them ready.
        let mut first = true;
        for (i, it) in items.iter().enumerate() {
            if !meets(spans[i], (j0, n)) {
                continue;
            }
            let class = mask.classify(it.positions(), j0..j0 + n);
            if class == TileClass::Skip {
                continue;
            }
            let masked = class == TileClass::Partial || per_element;
            // (No closure: it would lose the level's target features.)
            if masked && rows[i].is_none() {
                rows[i] = Some(RowInfo::new(ctx, it, &mask));
            }
            step(
                ctx,
                it,
                (ws, i, first),
                &mut sms[i],
                (j0, n, if first { next_n } else { 0 }),
                rows[i].as_ref().filter(|_| masked),
            );
            first = false;
        }
        j0 += n;
    }
    sms
}

/// The keys each item of a pass sees within its own key range, and the
/// hull `lo..hi` of those spans (`hi..hi` when no item sees a key).
pub fn pass_spans(mask: &SeqMask, items: &[Item]) -> (Vec<(usize, usize)>, (usize, usize)) {
    let spans: Vec<(usize, usize)> = items
        .iter()
        .map(|it| {
            let span = mask.kv_span(it.positions());
            (span.start.max(it.keys.start), span.end.min(it.keys.end))
        })
        .collect();
    let (lo, hi) = spans
        .iter()
        .filter(|(lo, hi)| lo < hi)
        .fold((usize::MAX, 0), |(a, b), &(lo, hi)| (a.min(lo), b.max(hi)));
    (spans, (lo.min(hi), hi))
}

/// Whether the span `lo..hi` (of [`pass_spans`]) meets keys `j0..j0+n`.
pub fn meets((lo, hi): (usize, usize), (j0, n): (usize, usize)) -> bool {
    lo < hi && j0 < hi && lo < j0 + n
}

/// One key tile `j0..j0+n`: scores, transforms, softmax, `P V`; prefetches
/// the first `next_n` keys after it. `masked` holds the item's row facts
/// when the tile is masked (a partial tile, or per-element terms).
#[inline(always)]
fn step<V: Vector, T: CpuElement, const NV: usize>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    (ws, slot, first): (&mut Workspace, usize, bool),
    sm: &mut OnlineSoftmax<V, NV>,
    (j0, n, next_n): (usize, usize, usize),
    masked: Option<&RowInfo<V, NV>>,
) {
    let p = ctx.p;
    let w = NV * LANES;
    let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
    let g = (item.b, item.kvh);
    // `next_n` keys of the next tile are prefetched below, group by group,
    // so the requests spread over the tile's compute instead of stalling on
    // full miss buffers at its start.
    let Workspace {
        qt,
        st,
        ot,
        kbuf,
        vbuf,
        packed_v,
        ahead,
        scratch_tile,
        ..
    } = ws;
    let qt = &qt[slot * dk * w..(slot + 1) * dk * w];
    let ot = &mut ot[slot * dv * w..(slot + 1) * dv * w];
    // The second block of a pass finds the tile's keys widened and its
    // values packed already, in `kbuf` and `vbuf` when they went there:
    // the first block recorded the tile (checked here, so a change to the
    // pass's loop cannot silently feed it another tile's rows).
    let tile = (g, j0, n);
    if first {
        *scratch_tile = Some(tile);
    } else {
        assert_eq!(
            *scratch_tile,
            Some(tile),
            "the pass's first block filled the scratch"
        );
    }
    let (k, ks) = if first {
        kv_rows::<V, T>(ctx.k, &p.k, g, (j0, n), dk, kbuf)
    } else {
        kv_rows_again(ctx.k, &p.k, g, (j0, n), dk, &kbuf[..])
    };
    assert!(k.len() >= (n - 1) * ks + dk && qt.len() >= dk * w && st.len() >= n * w);
    // This tile's values are packed group by group between the score
    // kernels, each group one kernel call after its prefetch into L1: the
    // rows are copied while they are certainly in cache, and the copy
    // overlaps the arithmetic instead of running as a pass of its own.
    // They go to the head's kept rows when those fit (`PackedV`), where a
    // later block of the head finds them packed already.
    let vs = packed_stride(dv);
    let keep = PackedV::fits(j0 + n, vs);
    let ready = if keep {
        packed_v.holds(g, &(j0..j0 + n))
    } else {
        !first
    };
    let next_ready = packed_v.holds(g, &(j0 + n..j0 + n + next_n));
    let vdst: &mut [f32] = if keep {
        packed_v.claim(g, (j0, n), vs)
    } else {
        vbuf
    };
    // A masked tile runs only the vectors of rows that see each part of
    // it (`parts.rs`); the mask then writes -inf over the scores left out
    // inside each vector's span, the only keys the softmax reads.
    let parts = match masked {
        Some(rows) => Parts::cut(&rows.bounds, (j0, n)),
        None => Parts::whole(n, NV),
    };
    if cfg!(debug_assertions) {
        // Scores a part leaves out must never reach the softmax: in test
        // builds they start as NaN, which would show in every output.
        st[..n * w].fill(f32::NAN);
    }
    let mut packed = if ready { n } else { 0 };
    // Each row's largest score in the tile, folded in by the score
    // kernels (used when no mask or option changes the scores after them).
    let mut top = [f32::NEG_INFINITY; ROWS];
    for (keys, vecs) in parts.iter() {
        assert!(keys.end <= n && vecs.end <= NV);
        let nv = vecs.len();
        let mut j = keys.start;
        while j < keys.end {
            let m = share(keys.end - j, keys_per_call::<V>(nv));
            if j < next_n {
                let next = (j0 + n + j, m.min(next_n - j));
                prefetch_rows(ctx.k, &p.k, g, next, dk, Hint::L2);
                if !next_ready {
                    prefetch_rows(ctx.v, &p.v, g, next, dv, Hint::L2);
                }
            }
            if !ready {
                prefetch_rows(ctx.v, &p.v, g, (j0 + j, m), dv, Hint::L1);
            }
            ahead.issue();
            if packed < j {
                let span = (j0 + packed, j - packed);
                pack_rows::<V, T>(ctx.v, &p.v, g, span, dv, &mut vdst[packed * vs..]);
                packed = j;
            }
            let at = vecs.start * LANES;
            let (kp, qp) = (k[j * ks..].as_ptr(), qt[at..].as_ptr());
            let sp = st[j * w + at..].as_mut_ptr();
            let tp = top[at..].as_mut_ptr();
            // SAFETY: `k` holds n rows of dk floats, ks apart; qt is dk x w;
            // st has n x w floats (asserted above), j + m <= keys.end <= n
            // (asserted per part), used on vectors `vecs` of the panel and
            // tile (vecs.end <= NV, asserted), m <= keys_per_call(nv); top
            // holds ROWS >= NV * 16 floats.
            unsafe { scores_vecs::<V>(nv, m, kp, ks, qp, w, dk, sp, tp) };
            j += m;
        }
    }
    if packed < n {
        let span = (j0 + packed, n - packed);
        pack_rows::<V, T>(ctx.v, &p.v, g, span, dv, &mut vdst[packed * vs..]);
    }
    let v: &[f32] = if keep {
        packed_v.mark(j0..j0 + n);
        packed_v.rows(j0, vs)
    } else {
        vbuf
    };
    let spans = parts.spans();
    if let Some(rows) = masked {
        transform(ctx, item, st, (j0, n), rows, &spans);
    }
    // Scores that are finite products or `-inf` (a mask's) take the
    // exponential without the flush (`exp.rs`).
    let unflushed = !ctx.per_element();
    let alpha = sm.update(
        st,
        n,
        &spans,
        masked.is_none().then_some(&top[..]),
        unflushed,
    );
    assert!(v.len() >= (n - 1) * vs + dv && ot.len() >= dv * w);
    if parts.is_whole(n, NV) {
        let mut c = 0;
        while c < dv {
            let m = keys_per_call::<V>(NV).min(dv - c);
            let (vp, op) = (v[c..].as_ptr(), ot[c * w..].as_mut_ptr());
            let pp = st.as_ptr();
            // SAFETY: v holds n rows of dv floats, vs apart, and c + m <= dv;
            // st holds n x w probabilities; ot is dv x w (asserted above);
            // alpha holds NV factors.
            unsafe { pv_vecs::<V>(NV, m, vp, vs, pp, w, n, op, Some(&alpha)) };
            c += m;
        }
        return;
    }
    // Parts: rescale the running output once, then add each part's keys
    // on its vectors only. A first part on every vector (a causal tile's
    // usual first part) rescales it in its kernel; otherwise a pass of its
    // own does.
    let fold = parts.leads_with_all(NV);
    if !fold {
        for c in 0..dv {
            for (r, &a) in alpha.iter().enumerate() {
                let at = c * w + r * LANES;
                // SAFETY: c < dv and r < NV: 16 floats at `at` in ot (dv x w).
                unsafe { store(ot.as_mut_ptr().add(at), load::<V>(ot.as_ptr().add(at)) * a) };
            }
        }
    }
    for (part, (keys, vecs)) in parts.live().enumerate() {
        let scale = (fold && part == 0).then_some(&alpha[..]);
        assert!(keys.end <= n && vecs.end <= NV);
        let nv = vecs.len();
        let at = vecs.start * LANES;
        let pp = st[keys.start * w + at..].as_ptr();
        let mut c = 0;
        while c < dv {
            let m = share(dv - c, keys_per_call::<V>(nv));
            let (vp, op) = (
                v[keys.start * vs + c..].as_ptr(),
                ot[c * w + at..].as_mut_ptr(),
            );
            // SAFETY: v holds n rows of dv floats, vs apart, the part's keys
            // lie in 0..n and c + m <= dv; st holds n x w probabilities and
            // ot is dv x w (asserted above), used on vectors `vecs`, whose
            // end is <= NV (asserted per part).
            unsafe { pv_vecs::<V>(nv, m, vp, vs, pp, w, keys.len(), op, scale) };
            c += m;
        }
    }
}

/// Per-row facts of a block, as vectors over the lanes.
pub struct RowInfo<V, const NV: usize> {
    /// First visible key of each row (`0` for rows past the block).
    lo: [[usize; LANES]; NV],
    /// One past the last visible key (`0` for rows past the block).
    hi: [[usize; LANES]; NV],
    /// The diagonal key of each row (for ALiBi; 0 without it).
    diag: [[i64; LANES]; NV],
    /// ALiBi slope of each row's head times log2(e).
    slope: [V; NV],
    /// Keys each vector's rows see at most: the hull of its rows' ranges
    /// (`(0, 0)` when none sees any).
    pub bounds: [(usize, usize); NV],
}

impl<V: Vector, const NV: usize> RowInfo<V, NV> {
    /// The facts of `item`'s rows under `mask`.
    #[inline(always)]
    pub fn new<T>(ctx: &Ctx<'_, T>, item: &Item, mask: &SeqMask) -> Self {
        let mut lo = [[0usize; LANES]; NV];
        let mut hi = [[0usize; LANES]; NV];
        let mut diag = [[0i64; LANES]; NV];
        let mut slope = [[0f32; LANES]; NV];
        let mut bounds = [(usize::MAX, 0); NV];
        let rows = item.rows();
        for v in 0..NV.min(rows.div_ceil(LANES)) {
            let r0 = v * LANES;
            // Sixteen rows at consecutive positions (one head per block):
            // their ranges from the mask's run of rows; else row by row.
            let ranges: [Range<usize>; LANES] = match item.nh == 1 && r0 + LANES <= rows {
                true => mask.kv_ranges(item.p0 + r0),
                false => std::array::from_fn(|l| match r0 + l < rows {
                    true => mask.kv_range(item.row(r0 + l).0),
                    false => 0..0,
                }),
            };
            for (l, range) in ranges.iter().enumerate() {
                lo[v][l] = range.start;
                hi[v][l] = range.end;
                if !range.is_empty() {
                    let b = &mut bounds[v];
                    *b = (b.0.min(range.start), b.1.max(range.end));
                }
            }
        }
        // The ALiBi facts only where it applies (a fifth of this
        // function's time otherwise).
        if let Some(s) = &ctx.p.options.alibi_slopes {
            for r in 0..item.rows() {
                let (pos, h) = item.row(r);
                let (v, l) = (r / LANES, r % LANES);
                diag[v][l] = mask.diagonal(pos);
                slope[v][l] = s[h] * LOG2_E;
            }
        }
        RowInfo {
            lo,
            hi,
            diag,
            slope: vectors(&slope),
            bounds: bounds.map(|b| if b.0 < b.1 { b } else { (0, 0) }),
        }
    }

    /// Vector `v`'s visible ranges relative to the tile `j0..j0+n`, clamped
    /// to `0..=n`: small i32s whatever the sequence length, so the mask
    /// compare is exact at any size `validate` accepts.
    #[inline(always)]
    fn ranges_in_tile(&self, v: usize, j0: usize, n: usize) -> ([i32; LANES], [i32; LANES]) {
        let rel = |x: usize| x.saturating_sub(j0).min(n) as i32;
        (self.lo[v].map(rel), self.hi[v].map(rel))
    }

    /// Vector `v`'s signed distances `j0 - diagonal` from the tile's first
    /// key, formed exactly in integers: `j - c` for key `j0 + j` is then
    /// `j + this`, exact in f32 while below 2^24 in magnitude and within
    /// one rounding (2^-24 relative) beyond, however long the sequence.
    #[inline(always)]
    fn alibi_base(&self, v: usize, j0: usize) -> V {
        let j0 = i64::try_from(j0).unwrap_or(i64::MAX);
        V::from(self.diag[v].map(|c| j0.saturating_sub(c) as f32))
    }
}

/// The rows of `a` as vectors (a loop: `array::map` may stay out of line,
/// where vector code loses the level's target features).
#[inline(always)]
fn vectors<V: Vector, const NV: usize>(a: &[[f32; LANES]; NV]) -> [V; NV] {
    let mut v = [V::ZERO; NV];
    for (x, r) in v.iter_mut().zip(a) {
        *x = V::from(*r);
    }
    v
}

/// Applies, in the contract's order, soft-capping, ALiBi, bias and masks to
/// the score tile (`n x NV*16`, keys `j0..j0+n`), leaving base-2 scores
/// with `-inf` where a pair is excluded. Soft-capping, ALiBi and the
/// window apply only on the keys `reads[v]` (from the tile's first) of
/// each vector `v`: the only ones the softmax reads (the hull of the
/// vector's parts, or the whole tile on the tile unit); the bias and the
/// boolean mask, rare, still go over the whole tile. With nothing but the
/// window to apply, the keys that every row of a vector sees are left as
/// they are (a vector with a row that sees none of the tile skips none):
/// on a causal tile only the diagonal square of each vector is masked
/// (the whole tile was 1.3% of a bf16 S = 512 causal call on Zen 4).
#[inline(always)]
pub fn transform<V: Vector, T, const NV: usize>(
    ctx: &Ctx<'_, T>,
    item: &Item,
    st: &mut [f32],
    (j0, n): (usize, usize),
    rows: &RowInfo<V, NV>,
    reads: &[(usize, usize); NV],
) {
    let o = &ctx.p.options;
    let w = NV * LANES;
    let cap = o.softcap;
    let alibi = o.alibi_slopes.is_some();
    let mask_only = ctx.post_scale.is_none() && cap.is_none() && !alibi;
    assert!(st.len() >= n * w);
    for (v, &(a, b)) in reads.iter().enumerate() {
        assert!(a <= b && b <= n);
        let (lo, hi) = rows.ranges_in_tile(v, j0, n);
        let base = match alibi {
            true => rows.alibi_base(v, j0),
            false => V::ZERO,
        };
        // The keys every lane sees (in 0..=n, empty when a lane sees none).
        let seen = match mask_only {
            true => {
                let (l, h) = (lo.iter().max(), hi.iter().min());
                let (l, h) = (*l.unwrap_or(&0) as usize, *h.unwrap_or(&0) as usize);
                l.max(a)..h.min(b)
            }
            false => a..a,
        };
        let (first, second) = match seen.is_empty() {
            true => (a..b, b..b),
            false => (a..seen.start, seen.end..b),
        };
        for j in first.chain(second) {
            let at = j * w + v * LANES;
            // SAFETY: j < n and the assert above: 16 floats at `at`.
            let mut t = unsafe { load::<V>(st.as_ptr().add(at)) };
            if let Some(c) = ctx.post_scale {
                t *= V::splat(c);
            }
            if let Some(c) = cap {
                let c = V::splat(c);
                t = c * tanh(t / c) * V::splat(LOG2_E);
            }
            if alibi {
                t -= rows.slope[v] * (V::splat(j as f32) + base).abs();
            }
            t = t.fill_outside(j as i32, &lo, &hi, f32::NEG_INFINITY);
            // SAFETY: as above.
            unsafe { store(st.as_mut_ptr().add(at), t) };
        }
    }
    if ctx.bias.is_none() && ctx.mask.is_none() {
        return;
    }
    let at = |r: usize| {
        let (pos, h) = item.row(r);
        (item.b, h, pos)
    };
    if let Some(bias) = ctx.bias {
        for r0 in (0..item.rows()).step_by(LANES) {
            let rows: Vec<_> = (r0..item.rows().min(r0 + LANES)).map(at).collect();
            add_bias_block::<V>(bias, &rows, (j0, n), &mut st[r0..], w);
        }
    }
    if let Some(mask) = ctx.mask {
        for r0 in (0..item.rows()).step_by(LANES) {
            let rows: Vec<_> = (r0..item.rows().min(r0 + LANES)).map(at).collect();
            apply_mask_block::<V>(mask, &rows, (j0, n), &mut st[r0..], w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::portable::V16;

    /// The mask and options applied only on each vector's read span give,
    /// on every key of it, what the whole tile gets, and there a lane is
    /// `-inf` exactly where the masking model hides the pair: causal
    /// (both alignments, more rows than keys and fewer), windows, no mask,
    /// with soft-capping and ALiBi, on blocks of one head and of a GQA
    /// group (rows not at consecutive positions), blocks whose last vector
    /// is partial, tiles cut at odd keys; spans of the parts as the f32
    /// pass reads them and paired as the bf16 pass does.
    #[test]
    fn transform_on_the_read_spans_matches_the_whole_tile() {
        use crate::parts::Parts;
        use crate::work::row_blocks;
        use attn_spec::{AttnOptions, DType, Shape};
        const NV: usize = 4;
        let w = NV * LANES;
        let masks = [
            AttnOptions::default().causal(),
            AttnOptions::default().causal().top_left(),
            AttnOptions::default().window(Some(37), Some(5)),
            AttnOptions::default().window(Some(3), None),
            AttnOptions::default(),
        ];
        let shapes = [
            Shape::new(1, 1, 1, 150, 150, 8),
            Shape::new(1, 1, 1, 100, 170, 8),
            Shape::new(1, 1, 1, 170, 90, 8),
            Shape::new(1, 4, 2, 60, 130, 8),
        ];
        let mut checked = 0;
        for shape in shapes {
            for base in masks.iter() {
                let heads = shape.q_heads;
                for options in [
                    base.clone(),
                    base.clone().softcap(20.0),
                    base.clone().alibi(attn_spec::alibi_slopes(heads)),
                ] {
                    let p = Problem::new(shape, DType::F32).with_options(options);
                    let none: &[f32] = &[];
                    let ctx = Ctx::new(&p, (none, none, none), None, None);
                    let mask = p.seq_mask(0);
                    for item in row_blocks(&p) {
                        let rows = RowInfo::<V16, NV>::new(&ctx, &item, &mask);
                        for (j0, n) in [(0, 64), (64, 64), (128, 64), (37, 51), (101, 27)] {
                            let n = n.min(shape.kv_len.saturating_sub(j0));
                            if n == 0 {
                                continue;
                            }
                            let parts = Parts::cut(&rows.bounds, (j0, n));
                            let scores: Vec<f32> = (0..n * w)
                                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.1)
                                .collect();
                            let mut whole = scores.clone();
                            transform(&ctx, &item, &mut whole, (j0, n), &rows, &[(0, n); NV]);
                            for spans in [parts.spans::<NV>(), parts.paired().spans::<NV>()] {
                                let mut st = scores.clone();
                                transform(&ctx, &item, &mut st, (j0, n), &rows, &spans);
                                for (v, &(a, b)) in spans.iter().enumerate() {
                                    for j in a..b {
                                        for l in 0..LANES {
                                            let at = j * w + v * LANES + l;
                                            let r = v * LANES + l;
                                            let seen = r < item.rows() && {
                                                let (pos, _) = item.row(r);
                                                mask.visible(pos, j0 + j)
                                            };
                                            assert_eq!(st[at].to_bits(), whole[at].to_bits());
                                            assert_eq!(
                                                st[at] != f32::NEG_INFINITY,
                                                seen,
                                                "{:?} row {r} key {}",
                                                p.options,
                                                j0 + j
                                            );
                                            checked += 1;
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 100_000, "{checked}");
    }

    /// Ranges and ALiBi distances far past 2^31 and 2^24 keys (which no
    /// test can allocate): the tile-relative ranges mask exactly the keys
    /// outside each row's range, and the distances are exact integers.
    /// Before, `range.start as i32` wrapped past 2^31 and `jg as f32`
    /// rounded odd keys past 2^24 to even.
    #[test]
    fn tile_ranges_and_distances_are_exact_at_any_length() {
        let big = (1usize << 33) + 7;
        let mut rows = RowInfo::<V16, 1> {
            lo: [[0; LANES]; 1],
            hi: [[0; LANES]; 1],
            diag: [[0; LANES]; 1],
            slope: [V16::ZERO; 1],
            bounds: [(0, 0); 1],
        };
        for l in 0..LANES {
            rows.lo[0][l] = big + l;
            rows.hi[0][l] = big + 2 * l + 1;
            rows.diag[0][l] = (big + l) as i64;
        }
        for j0 in [big - 40, big - 1, big, big + 5, big + 20] {
            let n = 16;
            let (lo, hi) = rows.ranges_in_tile(0, j0, n);
            let base = rows.alibi_base(0, j0).to_array();
            for l in 0..LANES {
                for j in 0..n {
                    let key = j0 + j;
                    let visible = rows.lo[0][l] <= key && key < rows.hi[0][l];
                    let rel = j as i32;
                    assert_eq!(visible, lo[l] <= rel && rel < hi[l], "lane {l} key {key}");
                    let dist = (key as i64 - rows.diag[0][l]).abs() as f32;
                    assert_eq!((j as f32 + base[l]).abs(), dist, "lane {l} key {key}");
                }
            }
        }
    }
}
