//! The bf16 pass over one or two row blocks of a (batch, K/V head): see
//! the module docs of `dot16/`.

use super::amx::Session;
use super::check::{rows_fit, slab_fits};
use super::kernels::{mr, pv_part, scores_part, Start};
use super::pairs::{pack_q_pairs, pack_v_pairs, store_pairs};
use super::tiles::{tile_pv, tile_scores, transpose_words};
use crate::blocking::{share, KEYS, LANES, PREFETCH_SPAN_BYTES};
use crate::element::CpuElement;
use crate::pack::{packed_stride, prefetch_rows, typed_rows, Hint, PackedV};
use crate::parts::Parts;
use crate::simd::avx512::V16;
use crate::simd::Vector;
use crate::softmax::OnlineSoftmax;
use crate::tiling::{meets, pass_spans, transform, Ctx, RowInfo};
use crate::work::Item;
use crate::workspace::Workspace;
use attn_spec::{DType, TileClass};

/// `tiling::run_items` for bf16 on `vdpbf16ps` (see the module docs):
/// one or two items of one (batch, K/V head) in one pass over their
/// keys; leaves item `i`'s unnormalised output in `ws.ot[i * dv *
/// NV*16..]` and returns the softmax states.
///
/// # Safety
/// The CPU runs AVX-512 F/BW, AVX512_BF16, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
#[inline(never)]
pub unsafe fn run_items<T: CpuElement, const NV: usize>(
    ctx: &Ctx<'_, T>,
    items: &[Item],
    ws: &mut Workspace,
) -> [OnlineSoftmax<V16, NV>; 2] {
    // SAFETY: forwarded from the caller.
    match unsafe { try_pass::<T, NV>(ctx, items, ws) } {
        Some(states) => states,
        // Values vdpbf16ps would not compute exactly enough (module
        // docs): the f32 pass, from the start.
        None => crate::tiling::run_items::<V16, T, NV>(ctx, items, ws),
    }
}

/// [`run_items`], or `None` as soon as a query row or a key tile holds
/// an element that does not [`fit`](super::fits).
///
/// # Safety
/// As [`run_items`].
///
/// (With the target features of its own: the closures in it take them
/// from here, and the intrinsics they call inline only where they are.)
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn try_pass<T: CpuElement, const NV: usize>(
    ctx: &Ctx<'_, T>,
    items: &[Item],
    ws: &mut Workspace,
) -> Option<[OnlineSoftmax<V16, NV>; 2]> {
    assert!(ctx.dot16 && T::DTYPE == DType::Bf16 && size_of::<T>() == 2);
    let bits = |s| super::bf16_bits(s).expect("bf16 (asserted)");
    let (q, k, v) = (bits(ctx.q), bits(ctx.k), bits(ctx.v));
    let p = ctx.p;
    let (dk, dv) = (p.shape.head_dim_qk, p.shape.head_dim_v);
    let (d2, w) = (dk / 2, NV * LANES);
    let head = (items[0].b, items[0].kvh);
    assert!(
        dk.is_multiple_of(2)
            && (1..=2).contains(&items.len())
            && items
                .iter()
                .all(|it| { it.rows() <= w && (it.b, it.kvh) == head && it.keys == items[0].keys })
    );
    let mask = p.seq_mask(head.0);
    let (spans, (lo, hi)) = pass_spans(&mask, items);
    let Workspace {
        qt,
        st,
        ot,
        vbuf,
        packed_pairs,
        packed_vt,
        vt,
        ahead,
        head: ws_head,
        checked,
        ..
    } = ws;
    // Query panels: d/2 rows of w words each, in qt's f32 slots.
    assert!(qt.len() >= items.len() * dk * w);
    for (i, it) in items.iter().enumerate() {
        let panel = qt[i * dk * w..].as_mut_ptr().cast::<u32>();
        // SAFETY: qt holds dk * w floats per item (asserted), room for
        // d2 * w words; Q rows are contiguous (`applies`); the CPU runs
        // AVX-512 (this function's contract).
        if !unsafe { pack_q_pairs(q, &p.q, it, (d2, w), panel) } {
            return None;
        }
    }
    // Each item's running output O^T is written by its first product
    // (`Start::Zero`), or zeroed before it where that product adds into
    // it, or after the pass where the item saw no key: never read before.
    let mut unwritten = [true; 2];
    if cfg!(debug_assertions) {
        ot[..items.len() * dv * w].fill(f32::NAN);
    }
    let mut sms = [
        OnlineSoftmax::<V16, NV>::new(),
        OnlineSoftmax::<V16, NV>::new(),
    ];
    // Each item's row facts, made at its first masked tile.
    let mut rows: [Option<RowInfo<V16, NV>>; 2] = [None, None];
    let per_element = ctx.per_element();
    ahead.pace(items.len() * (hi - lo).div_ceil(KEYS) * KEYS.div_ceil(mr(NV)));
    let span_bytes = (hi - lo) * (dk + dv) * 2;
    let prefetch = span_bytes > PREFETCH_SPAN_BYTES || *ws_head != Some(head);
    if lo < hi {
        *ws_head = Some(head);
    }
    let c = ctx.q_scale();
    // The tile unit, configured for the pass (`amx.rs`): tiles of a
    // multiple of 32 keys multiply on it, scores when dk is a multiple
    // of 32 (K's rows read in place, 32 bf16 per step), the output when
    // dv is. It computes masked tiles whole: the mask then applies to
    // the scores as on the f32 pass, and masked probabilities are 0.
    let amx = ctx.tiles.map(Session::new);
    let amx_keys = |n: usize| amx.as_ref().filter(|_| n.is_multiple_of(32));
    if amx.is_some() && vt.len() < KEYS / 2 * dv {
        *vt = crate::workspace::Aligned::zeroed(KEYS / 2 * dv);
    }
    let vs = packed_stride(dv);
    let mut j0 = lo;
    while j0 < hi {
        let n = KEYS.min(hi - j0);
        let mut next_n = if prefetch { n.min(hi - j0 - n) } else { 0 };
        // (An array, not a Vec: no allocation per tile.)
        let mut classes = [TileClass::Skip; 2];
        for (i, it) in items.iter().enumerate() {
            if meets(spans[i], (j0, n)) {
                classes[i] = mask.classify(it.positions(), j0..j0 + n);
            }
        }
        if classes.iter().all(|&c| c == TileClass::Skip) {
            j0 += n;
            continue;
        }
        let n2 = n.div_ceil(2);
        assert!(vbuf.len() >= n2 * vs && vs >= dv);
        // A tile of whole pairs at an even key is packed into the
        // head's pair rows kept across passes (pair `i` of the head is
        // keys 2i, 2i + 1 whatever the tile), and packed only if no
        // earlier pass of the head on this thread did; any other tile
        // into `vbuf`.
        let pairs0 = j0 / 2;
        let keep = j0.is_multiple_of(2) && n.is_multiple_of(2) && PackedV::fits(pairs0 + n2, vs);
        let held = keep && packed_pairs.holds(head, &(pairs0..pairs0 + n2));
        let vp: *mut u32 = match keep {
            true => packed_pairs
                .claim(head, (pairs0, n2), vs)
                .as_mut_ptr()
                .cast(),
            false => vbuf.as_mut_ptr().cast(),
        };
        // The tile's values are packed pair by pair between the first
        // block's score kernels, each group one kernel call after its
        // prefetch into L1, so the copy overlaps the arithmetic.
        let mut packed = if held { n2 } else { 0 };
        // Whether the tile's K and V rows are still to be checked
        // (once per head and thread), and what the products found of
        // them on the way: the packing checks each value it copies, and
        // the score kernels' key rows are checked after each kernel (in
        // L1 then) while they follow on from the tile's first key: keys
        // `0..k_upto` of the tile so far.
        let check = !checked.covers(head, &(j0..j0 + n));
        let (mut v_fit, mut k_fit, mut k_upto) = (true, true, 0);
        let mut pack = |pairs: std::ops::Range<usize>| {
            assert!(pairs.end <= n2);
            // SAFETY: vp holds n2 rows of vs words (vbuf: asserted; the
            // kept rows: claimed); the CPU runs AVX-512 (this function's
            // contract).
            v_fit &= unsafe { pack_v_pairs(v, &p.v, head, (j0, n), pairs, dv, (vp, vs)) };
        };
        let (krows, ks) =
            typed_rows(k, &p.k, head, (j0, n), dk).expect("K rows are contiguous (dot16::applies)");
        assert!(krows.len() >= (n - 1) * ks + dk && st.len() >= n * w);
        let mut vt_made = false;
        let mut vt_kept = None;
        for (i, it) in items.iter().enumerate() {
            if classes[i] == TileClass::Skip {
                continue;
            }
            let masked = classes[i] == TileClass::Partial || per_element;
            // (No closure: it would lose the level's target features.)
            if masked && rows[i].is_none() {
                rows[i] = Some(RowInfo::new(ctx, it, &mask));
            }
            let info = rows[i].as_ref().filter(|_| masked);
            let parts = match info {
                Some(rows) => Parts::cut(&rows.bounds, (j0, n)),
                None => Parts::whole(n, NV),
            };
            if cfg!(debug_assertions) {
                st[..n * w].fill(f32::NAN);
            }
            let qp = qt[i * dk * w..].as_ptr().cast::<u32>();
            // Each row's largest score in the tile, folded in by the
            // score kernels (used when no mask or option changes the
            // scores after them).
            let mut top = [f32::NEG_INFINITY; 4 * LANES];
            let on_tiles = amx_keys(n).filter(|_| dk.is_multiple_of(32));
            if let Some(unit) = on_tiles {
                if next_n > 0 {
                    prefetch_rows(k, &p.k, head, (j0 + n, next_n), dk, Hint::L2);
                    prefetch_rows(v, &p.v, head, (j0 + n, next_n), dv, Hint::L2);
                }
                // SAFETY: krows holds n rows of dk bf16, ks apart, and n
                // and dk are multiples of 32; the panel is d2 x w words;
                // st holds n x w floats (asserted above); top holds
                // 4 * 16 >= w floats; the CPU runs the bf16 level (this
                // function's contract).
                unsafe {
                    tile_scores(
                        unit,
                        (krows.as_ptr(), ks),
                        (qp, w, d2),
                        n,
                        c,
                        st.as_mut_ptr(),
                        &mut top,
                        // The pace counts one step per score kernel
                        // call of mr(NV) keys: as many per 32 keys.
                        || (0..32usize.div_ceil(mr(NV))).for_each(|_| ahead.issue()),
                    )
                };
            }
            // What is left for `vdpbf16ps`: nothing after the tile unit.
            let parts_left = match on_tiles {
                Some(_) => Parts::whole(0, 0),
                None => parts,
            };
            for (keys, vecs) in parts_left.live() {
                assert!(keys.end <= n && vecs.end <= NV);
                let nv = vecs.len();
                let mut j = keys.start;
                while j < keys.end {
                    let m = share(keys.end - j, mr(nv));
                    if j < next_n {
                        let next = (j0 + n + j, m.min(next_n - j));
                        prefetch_rows(k, &p.k, head, next, dk, Hint::L2);
                        prefetch_rows(v, &p.v, head, next, dv, Hint::L2);
                    }
                    if packed < n2 {
                        prefetch_rows(v, &p.v, head, (j0 + j, m), dv, Hint::L1);
                        let upto = (j / 2).max(packed);
                        pack(packed..upto);
                        packed = upto;
                    }
                    ahead.issue();
                    let at = vecs.start * LANES;
                    // SAFETY: krows holds n rows of dk bf16, ks apart;
                    // the panel is d2 x w words; st holds n x w floats
                    // (asserted above); j + m <= keys.end <= n and
                    // vecs.end <= NV (asserted per part), m <= mr(nv);
                    // top holds 4 * 16 >= NV * 16 floats; the CPU runs
                    // the bf16 level (this function's contract).
                    unsafe {
                        scores_part(
                            nv,
                            m,
                            krows[j * ks..].as_ptr(),
                            ks,
                            qp.add(at),
                            w,
                            d2,
                            c,
                            st[j * w + at..].as_mut_ptr(),
                            top[at..].as_mut_ptr(),
                        )
                    };
                    if check && j == k_upto {
                        // SAFETY: the CPU runs this level (this
                        // function's contract).
                        k_fit &= unsafe { slab_fits(krows, ks, (j, m), dk) };
                        k_upto += m;
                    }
                    j += m;
                }
            }
            // The next tile is asked for once, and the values packed,
            // by the first block.
            next_n = 0;
            pack(packed..n2);
            packed = n2;
            let pv_parts = parts.paired();
            let on_tiles = amx_keys(n).filter(|_| dv.is_multiple_of(32));
            // The keys `P V` reads of each vector: all of them on the tile
            // unit, else the hull of the parts that hold the vector (keys
            // outside it are masked for all its rows: on a tile across
            // the diagonal, a vector's probabilities stop at its last
            // row's diagonal). Paired parts end at even keys, but for the
            // tile's last: whole pairs.
            let reads = match on_tiles {
                Some(_) => [(0, n); NV],
                None => pv_parts.spans::<NV>(),
            };
            if let Some(rows) = info {
                transform(ctx, it, st, (j0, n), rows, &reads);
            }
            let top = (!masked).then_some(&top[..]);
            let pairs = reads.map(|(a, b)| (a / 2, b.div_ceil(2)));
            // The probabilities in pairs, in place: pair `i` of a vector
            // in key 2i's floats of the tile, which the softmax has read
            // (rows of pairs `ps = 2w` words apart). In a buffer of their
            // own they would take the tile's loads out of L1 and miss
            // on every store.
            // Scores that are finite products or `-inf` (a mask's) take
            // the exponential without the flush (`exp.rs`).
            let unflushed = !per_element;
            let alpha =
                sms[i].update_pairs(&mut st[..], n, &pairs, top, unflushed, |at, e0, e1| {
                    // SAFETY: `at` is 16 floats of the tile (update_pairs).
                    unsafe { store_pairs(at.cast(), e0, e1) };
                });
            let (pp, ps) = (st.as_ptr().cast::<u32>(), 2 * w);
            let whole = on_tiles.is_none() && pv_parts.is_whole(n, NV);
            // The item's first product writes its running output: from
            // zero inside the kernel on the whole path; the tile unit and
            // the parts add into it, so it is zeroed for them here.
            let first = std::mem::replace(&mut unwritten[i], false);
            if first && !whole {
                ot[i * dv * w..(i + 1) * dv * w].fill(0.0);
            }
            let out = ot[i * dv * w..(i + 1) * dv * w].as_mut_ptr();
            if let Some(unit) = on_tiles {
                // The transposed values: a whole tile at a multiple of
                // KEYS is kept for the head's later passes.
                let t = j0 / KEYS;
                let vt_stride = dv * KEYS / 2;
                let keep = j0.is_multiple_of(KEYS) && n == KEYS && PackedV::fits(t + 1, vt_stride);
                let (vtp, fresh): (*mut u32, bool) = match keep {
                    true => (
                        packed_vt.claim(head, (t, 1), vt_stride).as_mut_ptr().cast(),
                        !packed_vt.holds(head, &(t..t + 1)) && vt_kept.is_none(),
                    ),
                    false => (vt.as_mut_ptr(), !vt_made),
                };
                // SAFETY: the packed values hold n2 rows of dv words, vs
                // apart, all packed by now; vtp holds dv x n2 words (vt:
                // KEYS / 2 x dv, resized above; a claimed tile: dv x
                // KEYS / 2); the tile holds n2 rows of pairs, ps words
                // apart, zero where masked;
                // this item's output is dv x w floats; n and dv are
                // multiples of 32; the CPU runs the bf16 level.
                unsafe {
                    if fresh {
                        transpose_words((vp, vs), (n2, dv), vtp);
                    }
                    tile_pv(unit, (vtp, n2, dv), (pp, ps, w), out, &alpha);
                }
                match keep {
                    true => vt_kept = Some(t),
                    false => vt_made = true,
                }
                continue;
            }
            if whole {
                let start = match first {
                    true => Start::Zero,
                    false => Start::Scaled(&alpha),
                };
                let mut col = 0;
                while col < dv {
                    let m = mr(NV).min(dv - col);
                    let pair_rows = (pp, ps);
                    // SAFETY: the packed values hold n2 rows of dv
                    // words, vs apart (col + m <= dv); the tile holds
                    // n2 rows of pairs, ps apart (asserted at the
                    // softmax); this item's output is dv x w floats;
                    // alpha holds NV factors.
                    unsafe {
                        pv_part(
                            NV,
                            m,
                            vp.add(col),
                            vs,
                            pair_rows,
                            w,
                            n2,
                            out.add(col * w),
                            start,
                        )
                    };
                    col += m;
                }
                continue;
            }
            // Parts: rescale the running output once (unless it was just
            // zeroed), then add each part's pairs of keys on its vectors
            // only. A first part on every vector (a causal tile's usual
            // first part) rescales it in its kernel; otherwise a pass of
            // its own does.
            let fold = !first && pv_parts.leads_with_all(NV);
            if !first && !fold {
                // SAFETY: this item's output is dv x w floats, w = NV * 16.
                unsafe { rescale(out, dv, &alpha) };
            }
            for (part, (keys, vecs)) in pv_parts.live().enumerate() {
                let start = match fold && part == 0 {
                    true => Start::Scaled(&alpha),
                    false => Start::Load,
                };
                assert!(keys.end <= n && vecs.end <= NV && keys.start.is_multiple_of(2));
                let (i0, i1, nv) = (keys.start / 2, keys.end.div_ceil(2), vecs.len());
                let at = vecs.start * LANES;
                let mut col = 0;
                while col < dv {
                    let m = share(dv - col, mr(nv));
                    // SAFETY: pairs i0..i1 <= n2 of the packed values
                    // (rows of dv words, vs apart, col + m <= dv) and
                    // of the tile's pairs (ps apart); vectors vecs.end <= NV of
                    // this item's dv x w output.
                    unsafe {
                        pv_part(
                            nv,
                            m,
                            vp.add(i0 * vs + col),
                            vs,
                            (pp.add(i0 * ps + at), ps),
                            w,
                            i1 - i0,
                            out.add(col * w + at),
                            start,
                        )
                    };
                    col += m;
                }
            }
        }
        // Each tile's K and V rows are checked once per head and thread,
        // with or after its products: from cache, where a check ahead
        // of them read them first, from memory, with nothing to overlap
        // (11% of a b8-h12-s256 encoder call). The rows the products
        // did not check are read here: K after a gap in a masked tile's
        // parts, all of K on the tile unit, V kept packed from an
        // earlier pass. Values that do not fit give a wrong tile but no
        // fault, and the pass is then dropped whole; the packed values
        // are kept for later passes only once checked.
        if check {
            // SAFETY: the CPU runs this level (this function's contract).
            let fit = unsafe {
                (k_fit && rows_fit(k, &p.k, head, (j0 + k_upto, n - k_upto), dk))
                    && (if held {
                        rows_fit(v, &p.v, head, (j0, n), dv)
                    } else {
                        v_fit
                    })
            };
            if !fit {
                return None;
            }
            checked.add(head, j0..j0 + n);
        }
        if keep && !held {
            packed_pairs.mark(pairs0..pairs0 + n2);
        }
        if let Some(t) = vt_kept {
            packed_vt.mark(t..t + 1);
        }
        j0 += n;
    }
    for (i, &u) in unwritten.iter().enumerate().take(items.len()) {
        if u {
            ot[i * dv * w..(i + 1) * dv * w].fill(0.0);
        }
    }
    Some(sms)
}

/// Multiplies the running output (`dv` rows of `alpha.len() * 16`
/// floats) by each row's rescale factor.
///
/// # Safety
/// `out..out + dv * alpha.len() * 16` readable and writable; the CPU
/// runs AVX-512 F.
#[inline(always)]
pub(super) unsafe fn rescale(out: *mut f32, dv: usize, alpha: &[V16]) {
    let w = alpha.len() * LANES;
    for col in 0..dv {
        for (r, a) in alpha.iter().enumerate() {
            // SAFETY: col < dv and r < alpha.len(): 16 floats within the
            // caller's extent.
            unsafe {
                let o = out.add(col * w + r * LANES);
                (V16::load(o) * *a).store(o);
            }
        }
    }
}
