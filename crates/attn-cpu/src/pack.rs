//! Moving data between the caller's strided tensors and the kernels'
//! packed f32 panels: the query panel `Q^T` (once per block of rows), key
//! rows (used in place when they are f32 with unit stride along the head
//! dimension, otherwise widened into a scratch block) and value rows
//! (always copied into a tile whose row stride avoids cache-set aliasing).

use crate::blocking::{LANES, PACKED_V_BYTES};
use crate::element::CpuElement;
use crate::simd::{load, store, Vector};
use crate::work::Item;
use attn_spec::View;

/// Packs the block's query rows into `qt` (`d x w`, row `r` of the block
/// in lane `r`), multiplied by `scale`; lanes past the block are zero.
/// Sixteen rows at a time become panel columns through 16 x 16 register
/// transposes, read straight from the caller's rows when they are f32 with
/// unit stride, else first widened into `rows` (scratch of at least `16 *
/// d` floats).
#[inline(always)]
pub fn pack_q<V: Vector, T: CpuElement>(
    q: &[T],
    view: &View,
    item: &Item,
    (d, w): (usize, usize),
    scale: f32,
    qt: &mut [f32],
    rows: &mut [f32],
) {
    let n = item.rows();
    assert!(qt.len() >= d * w && rows.len() >= LANES * d && w.is_multiple_of(LANES));
    let sv = V::splat(scale);
    let in_place = T::as_f32(q).filter(|_| view.strides[3] == 1 || d == 1);
    for r0 in (0..w).step_by(LANES) {
        let live = n.saturating_sub(r0).min(LANES);
        let at = |i: usize| {
            let (p, h) = item.row(r0 + i);
            [item.b, p, h, 0]
        };
        if in_place.is_none() {
            for i in 0..live {
                gather_row::<V, T>(q, view, at(i), d, &mut rows[i * d..(i + 1) * d]);
            }
        }
        // Row i's d floats (null past the block: zeros).
        let src: [*const f32; LANES] = std::array::from_fn(|i| match (i < live, in_place) {
            (false, _) => std::ptr::null(),
            (true, Some(f)) => f[view.index(at(i))..][..d].as_ptr(),
            (true, None) => rows[i * d..(i + 1) * d].as_ptr(),
        });
        let mut e0 = 0;
        if live == LANES {
            // Sixteen rows: no row to test for null (a third of the cost of
            // a block's query panel went to those tests).
            while e0 + LANES <= d {
                let mut blk = [V::ZERO; LANES];
                for (b, &p) in blk.iter_mut().zip(&src) {
                    // SAFETY: src[i] holds d floats (live == 16: none is
                    // null) and e0 + 16 <= d.
                    *b = unsafe { load(p.add(e0)) };
                }
                for (i, t) in V::transpose16(blk).into_iter().enumerate() {
                    // SAFETY: (e0 + i) * w + r0 + 16 <= d * w (asserted).
                    unsafe { store(qt.as_mut_ptr().add((e0 + i) * w + r0), t * sv) };
                }
                e0 += LANES;
            }
        }
        while e0 + LANES <= d {
            let mut blk = [V::ZERO; LANES];
            for (b, &p) in blk.iter_mut().zip(&src) {
                if !p.is_null() {
                    // SAFETY: src[i] holds d floats and e0 + 16 <= d.
                    *b = unsafe { load(p.add(e0)) };
                }
            }
            for (i, t) in V::transpose16(blk).into_iter().enumerate() {
                // SAFETY: (e0 + i) * w + r0 + 16 <= d * w (asserted).
                unsafe { store(qt.as_mut_ptr().add((e0 + i) * w + r0), t * sv) };
            }
            e0 += LANES;
        }
        for e in e0..d {
            for (i, &p) in src.iter().enumerate() {
                let x = if p.is_null() {
                    0.0
                } else {
                    // SAFETY: a non-null src[i] holds d floats and e < d.
                    unsafe { *p.add(e) }
                };
                qt[e * w + r0 + i] = x * scale;
            }
        }
    }
}

/// Widens one row of `d` elements starting at logical index `at` (last
/// axis varying) into `dst`.
#[inline(always)]
pub fn gather_row<V: Vector, T: CpuElement>(
    src: &[T],
    view: &View,
    at: [usize; 4],
    d: usize,
    dst: &mut [f32],
) {
    let base = view.index(at);
    if view.strides[3] == 1 || d == 1 {
        T::widen::<V>(&src[base..base + d], &mut dst[..d]);
    } else {
        for (e, x) in dst[..d].iter_mut().enumerate() {
            *x = src[base + e * view.strides[3]].to_f32();
        }
    }
}

/// Row stride of a packed value tile: `d` rounded up to whole 64-byte lines,
/// plus one line when that count is even. The `P V` microkernel walks one
/// column group down all rows of the tile; with an even number of lines
/// per row those rows would crowd into a few L1 sets (4 KiB aliasing at
/// d = 128 in the BSHD layout, where rows are `heads * d` apart) and evict
/// each other between column groups; an odd count spreads them over all
/// sets.
pub fn packed_stride(d: usize) -> usize {
    let lines = d.div_ceil(16);
    16 * if lines.is_multiple_of(2) {
        lines + 1
    } else {
        lines
    }
}

/// Copies rows `j0..j0+n` (batch `b`, head `g`) into `dst` as f32 rows
/// [`packed_stride`] apart.
#[inline(always)]
pub fn pack_rows<V: Vector, T: CpuElement>(
    src: &[T],
    view: &View,
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    d: usize,
    dst: &mut [f32],
) -> usize {
    let s = packed_stride(d);
    if let (Some(f), true) = (T::as_f32(src), view.strides[3] == 1 || d == 1) {
        // f32 rows: an inline vector copy (a memcpy call per 256-512 byte
        // row costs more than the copy itself).
        for j in 0..n {
            let at = view.index([b, j0 + j, g, 0]);
            copy_row::<V>(&f[at..at + d], &mut dst[j * s..j * s + d]);
        }
    } else {
        for j in 0..n {
            gather_row::<V, T>(src, view, [b, j0 + j, g, 0], d, &mut dst[j * s..j * s + d]);
        }
    }
    s
}

/// Packed value rows kept across the blocks of one head, indexed by key:
/// the blocks of a head run one after another on one thread (each thread
/// takes a contiguous range of them, `threads/`), and each re-reads the
/// keys its predecessor read, so when the head's packed V fits in
/// [`PACKED_V_BYTES`] it is packed once per head and thread instead of
/// once per block. Only
/// keys `0..end` with `end * stride` floats within that budget are kept,
/// so the memory stays bounded whatever the sequence length. The copies
/// are exact, so reusing them changes no result.
#[derive(Debug, Default)]
pub struct PackedV {
    buf: crate::workspace::Aligned<f32>,
    /// (batch, K/V head) of the rows held.
    head: (usize, usize),
    /// Keys whose packed rows are in `buf`.
    valid: std::ops::Range<usize>,
}

impl PackedV {
    /// Whether keys `0..end`, packed `stride` floats apart, fit the budget.
    pub fn fits(end: usize, stride: usize) -> bool {
        end * stride * size_of::<f32>() <= PACKED_V_BYTES
    }

    /// Whether keys `keys` of head `g` are packed already.
    pub fn holds(&self, g: (usize, usize), keys: &std::ops::Range<usize>) -> bool {
        self.head == g && self.valid.start <= keys.start && keys.end <= self.valid.end
    }

    /// The slots of keys `j0..` of head `g` (`stride` floats per key), to
    /// pack into; forgets another head's rows. Call [`PackedV::mark`] once
    /// they are written.
    pub fn claim(
        &mut self,
        g: (usize, usize),
        (j0, n): (usize, usize),
        stride: usize,
    ) -> &mut [f32] {
        assert!(Self::fits(j0 + n, stride));
        if self.head != g {
            self.head = g;
            self.valid = 0..0;
        }
        self.buf.grow((j0 + n) * stride);
        &mut self.buf[j0 * stride..]
    }

    /// Forgets every row held (keeps the memory).
    pub fn forget(&mut self) {
        self.valid = 0..0;
    }

    /// Records that keys `keys` of the claimed head are packed.
    pub fn mark(&mut self, keys: std::ops::Range<usize>) {
        let v = &self.valid;
        self.valid = if v.is_empty() || keys.end < v.start || v.end < keys.start {
            keys
        } else {
            v.start.min(keys.start)..v.end.max(keys.end)
        };
    }

    /// The packed rows from key `j0` on.
    pub fn rows(&self, j0: usize, stride: usize) -> &[f32] {
        &self.buf[j0 * stride..]
    }
}

/// `dst.copy_from_slice(src)` with 16-lane loads and stores, inlined.
#[inline(always)]
pub fn copy_row<V: Vector>(src: &[f32], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    let n = src.len();
    let mut i = 0;
    while i + LANES <= n {
        // SAFETY: i + 16 <= n for both slices (equal lengths, asserted).
        unsafe { store(dst.as_mut_ptr().add(i), load::<V>(src.as_ptr().add(i))) };
        i += LANES;
    }
    for (d, s) in dst[i..].iter_mut().zip(&src[i..]) {
        *d = *s;
    }
}

/// Rows `j0..j0+n` (batch `b`, head `g`) of a K or V tensor in place, in
/// their own type, with their stride: `None` unless each row's `d`
/// elements are contiguous.
pub fn typed_rows<'a, T>(
    src: &'a [T],
    view: &View,
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    d: usize,
) -> Option<(&'a [T], usize)> {
    if n == 0 || (view.strides[3] != 1 && d != 1) {
        return None;
    }
    let start = view.index([b, j0, g, 0]);
    let stride = if n > 1 { view.strides[1] } else { d };
    // Keys j0..j0+n: the last one ends at start + (n-1)*stride + d.
    let end = start + (n - 1) * stride + d;
    Some((&src[start..end], stride))
}

/// Rows `j0..j0+n` of K or V for batch `b`, head `g`, as a pointer to f32
/// rows and their stride: into the caller's tensor when it is f32 with unit
/// stride along the head dimension, else widened into `scratch`.
#[inline(always)]
pub fn kv_rows<'a, V: Vector, T: CpuElement>(
    src: &'a [T],
    view: &View,
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    d: usize,
    scratch: &'a mut [f32],
) -> (&'a [f32], usize) {
    if let Some(rows) = f32_rows(src, view, (b, g), (j0, n), d) {
        return rows;
    }
    for j in 0..n {
        gather_row::<V, T>(
            src,
            view,
            [b, j0 + j, g, 0],
            d,
            &mut scratch[j * d..(j + 1) * d],
        );
    }
    (&scratch[..n * d], d)
}

/// The rows [`kv_rows`] returned for the same arguments, without widening
/// them again: `scratch` still holds them from that call (the second block
/// of a pass over the same tile, `tiling::run_items`).
pub fn kv_rows_again<'a, T: CpuElement>(
    src: &'a [T],
    view: &View,
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    d: usize,
    scratch: &'a [f32],
) -> (&'a [f32], usize) {
    f32_rows(src, view, (b, g), (j0, n), d).unwrap_or((&scratch[..n * d], d))
}

/// The rows in place when the tensor is f32 with contiguous rows.
fn f32_rows<'a, T: CpuElement>(
    src: &'a [T],
    view: &View,
    g: (usize, usize),
    keys: (usize, usize),
    d: usize,
) -> Option<(&'a [f32], usize)> {
    T::as_f32(src).and_then(|f| typed_rows(f, view, g, keys, d))
}

/// Asks the memory system for rows `j0..j0+n` (batch `b`, head `g`) of a K
/// or V tensor, one prefetch per 64-byte line, so the next key tile arrives
/// while the current one computes. Decoding streams K and V from DRAM in
/// short rows (`heads * d` apart) that the hardware prefetchers do not
/// follow; without this the kernel waits on memory latency.
pub fn prefetch_rows<T>(
    src: &[T],
    view: &View,
    (b, g): (usize, usize),
    (j0, n): (usize, usize),
    d: usize,
    hint: Hint,
) {
    let bytes = d * std::mem::size_of::<T>();
    for j in j0..j0 + n {
        let at = view.index([b, j, g, 0]);
        let row = src[at..].as_ptr() as *const u8;
        let mut off = 0;
        while off < bytes {
            prefetch(row.wrapping_add(off), hint);
            off += 64;
        }
    }
}

/// Rows that a kernel prefetches one at a time while it walks the rows
/// of its own tile, so the loads of the next tile overlap the arithmetic
/// of this one instead of following it. Row `j` starts at `base + j *
/// stride` bytes and spans at most `lines` cache lines (one more than its
/// length needs when rows are not 64-byte aligned). A prefetch never faults,
/// so the rows may lie anywhere, even past a buffer's end.
///
/// Measured on this project's 2-core machine (decode GQA 32:8, d = 128,
/// 32768 f32 keys, `cargo run -p attn-benches --release --example perf`):
/// the next tile prefetched in one burst at the start of a tile, 32 ms on
/// one thread and 25 ms on two (the burst fills the core's miss buffers
/// and the arithmetic waits behind it); row by row inside the kernels,
/// 20 and 11-13 ms. Prefetching whole rows of all heads in address order
/// instead (for the hardware prefetchers to extend) measured slower: 22
/// ms on one thread. Spread more evenly still (s24, Zen 4, 32768 keys, one
/// thread, alternating runs): the f32 score kernels issue their group's
/// rows one every few steps (`scores_quad`'s 8 rows one every `d / 32`
/// steps, where it had issued them in its first 8 steps; `scores`' one
/// every `d / 16 / G`, where it had issued all at the group's start), and
/// the value kernels share a row's lines out over their column passes
/// (`part`) instead of issuing all in the first pass: f32 16.5 -> 15.0-15.3
/// ms, bf16 (values only) 9.9 -> 9.3 ms, no slower with the rows in cache.
#[derive(Clone, Copy, Debug)]
pub struct RowStream {
    base: *const u8,
    stride: usize,
    lines: usize,
}

impl RowStream {
    /// No prefetching.
    pub const NONE: RowStream = RowStream {
        base: std::ptr::null(),
        stride: 0,
        lines: 0,
    };

    /// Rows `j, j+1, ...` (batch `b`, head `g`, `d` elements each) of a K
    /// or V tensor `src` laid out by `view`. `j` may lie past the sequence.
    pub fn of<T>(src: &[T], view: &View, (b, j, g): (usize, usize, usize), d: usize) -> Self {
        let size = std::mem::size_of::<T>();
        let base = src.as_ptr().wrapping_add(view.index([b, j, g, 0])) as *const u8;
        let stride = view.strides[1] * size;
        let unaligned = !(base as usize | stride).is_multiple_of(64);
        RowStream {
            base,
            stride,
            lines: (d * size).div_ceil(64) + usize::from(unaligned),
        }
    }

    /// Lines `[k L / parts, (k + 1) L / parts)` of every row (`L` lines a
    /// row; `k < parts`): the share of pass `k` of a kernel that walks its
    /// tile's rows in `parts` passes over column ranges, so every pass
    /// prefetches a share instead of the first pass all of it.
    pub fn part(self, k: usize, parts: usize) -> RowStream {
        debug_assert!(k < parts);
        let (a, b) = (k * self.lines / parts, (k + 1) * self.lines / parts);
        RowStream {
            base: self.base.wrapping_add(a * 64),
            stride: self.stride,
            lines: b - a,
        }
    }

    /// Prefetches row `j`.
    #[inline(always)]
    pub fn row(&self, j: usize) {
        let row = self.base.wrapping_add(j * self.stride);
        for l in 0..self.lines {
            prefetch(row.wrapping_add(l * 64), Hint::L2);
        }
    }
}

/// Rows a block asks for a few at a time while it computes: the next
/// block's query rows (read, into L2), the first K and V tile of the next
/// block when it starts another head, and this block's output rows
/// (written, asked for in a writable state). They would otherwise be
/// fetched on demand, row after row, by `pack_q`, the first tile and the
/// final write: a fixed cost of every block (or head) that a causal block,
/// with half the keys, pays twice over relative to its arithmetic.
///
/// Rows are held as runs of equally spaced rows (a block's rows of one
/// head are one run in any layout), so a block's setup adds a few runs
/// instead of computing each row's address: per row that was ~2% of a
/// b8-h12-s256 encoder call (`perf` example, bf16, Zen 4).
#[derive(Debug, Default)]
pub struct Ahead {
    /// The runs of rows.
    runs: Vec<Run>,
    /// Where the next row to issue is: (run, row within the run).
    at: (usize, usize),
    /// Rows in all runs.
    rows: usize,
    /// Rows to issue per call of [`Ahead::issue`].
    per: usize,
}

/// `count` rows of `bytes` bytes, the first at address `addr`, each
/// `stride` bytes after the one before.
#[derive(Clone, Copy, Debug)]
struct Run {
    addr: usize,
    stride: usize,
    count: usize,
    bytes: usize,
    hint: Hint,
}

impl Ahead {
    /// Forgets every row.
    pub fn clear(&mut self) {
        self.runs.clear();
        self.at = (0, 0);
        self.rows = 0;
    }

    /// Adds `count` rows of `bytes` bytes, the first at address `addr`,
    /// each `stride` bytes after the one before.
    pub fn push_rows(
        &mut self,
        addr: usize,
        stride: usize,
        count: usize,
        bytes: usize,
        hint: Hint,
    ) {
        if count > 0 {
            self.runs.push(Run {
                addr,
                stride,
                count,
                bytes,
                hint,
            });
            self.rows += count;
        }
    }

    /// Spreads the rows evenly over `calls` calls of [`Ahead::issue`].
    pub fn pace(&mut self, calls: usize) {
        self.per = self.rows.div_ceil(calls.max(1));
    }

    /// Prefetches the next rows of the pace.
    #[inline]
    pub fn issue(&mut self) {
        self.walk(prefetch);
    }

    /// Hands each 64-byte line of the next rows of the pace to `f`.
    #[inline(always)]
    fn walk(&mut self, mut f: impl FnMut(*const u8, Hint)) {
        let mut left = self.per;
        let (mut k, mut r) = self.at;
        while left > 0 && k < self.runs.len() {
            let run = self.runs[k];
            let end = run.count.min(r + left);
            left -= end - r;
            while r < end {
                let addr = run.addr.wrapping_add(r * run.stride);
                // One line more when the row does not start on a line.
                let lines = (addr % 64 + run.bytes).div_ceil(64);
                let base = (addr & !63) as *const u8;
                for l in 0..lines {
                    f(base.wrapping_add(l * 64), run.hint);
                }
                r += 1;
            }
            if r == run.count {
                (k, r) = (k + 1, 0);
            }
        }
        self.at = (k, r);
    }
}

/// Where a prefetch brings a line, and in which state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hint {
    /// Into L2, for data needed a tile from now.
    L2,
    /// Into L1, for data needed within a few hundred cycles.
    L1,
    /// Into L1 for lines about to be written. This is `prefetchw` (the
    /// line asked for in a writable state) only where the code is built
    /// with PRFCHW enabled, which attn-cpu's run-time dispatch does not
    /// do; elsewhere `prefetcht0`. A line that no other core holds arrives
    /// exclusive either way, so the store then needs no further request:
    /// only lines shared with another core would gain.
    Write,
}

#[inline(always)]
fn prefetch(p: *const u8, hint: Hint) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults and has no effect on
    // program state, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0, _MM_HINT_T1};
        let p = p as *const i8;
        match hint {
            Hint::L2 => _mm_prefetch::<_MM_HINT_T1>(p),
            Hint::L1 => _mm_prefetch::<_MM_HINT_T0>(p),
            Hint::Write => _mm_prefetch::<_MM_HINT_ET0>(p),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, hint);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The passes' parts of a row stream cover each row's lines once, in
    /// order, whatever the number of passes (more passes than lines
    /// included), and keep the stride.
    #[test]
    fn row_stream_parts_cover_each_line_once() {
        let row = [0u8; 4096];
        for d in [1, 40, 64, 100, 128, 256, 520] {
            let view = View::contiguous([1, 2, 1, d]);
            let s = RowStream::of(&row, &view, (0, 0, 0), d);
            for parts in 1..=12 {
                let mut next = s.base;
                for k in 0..parts {
                    let p = s.part(k, parts);
                    assert_eq!(
                        (p.base, p.stride),
                        (next, s.stride),
                        "d {d}, part {k} of {parts}"
                    );
                    next = next.wrapping_add(p.lines * 64);
                }
                assert_eq!(
                    next,
                    s.base.wrapping_add(s.lines * 64),
                    "d {d}, {parts} parts"
                );
            }
        }
    }

    /// The pace hands out every line of every run once, in order, `per`
    /// rows per call, across the ends of runs; empty runs add nothing.
    #[test]
    fn ahead_issues_each_line_of_each_run_once_at_the_pace() {
        let mut a = Ahead::default();
        // Three rows of 100 bytes from 0x1030 (each on 3 lines), 256 apart;
        // none; five rows of 64 bytes from 0x8000 (1 line each), 0 apart
        // (a broadcast axis).
        a.push_rows(0x1030, 256, 3, 100, Hint::Write);
        a.push_rows(0x5000, 64, 0, 64, Hint::L1);
        a.push_rows(0x8000, 0, 5, 64, Hint::L2);
        a.pace(3);
        let mut seen = Vec::new();
        let mut calls = Vec::new();
        for _ in 0..4 {
            let before = seen.len();
            a.walk(|p, h| seen.push((p as usize, h)));
            calls.push(seen.len() - before);
        }
        // 8 rows over 3 calls: 3, 3, 2 rows; then nothing.
        assert_eq!(calls, [9, 3, 2, 0]);
        let mut want = Vec::new();
        for r in 0..3 {
            let base = (0x1030 + 256 * r) & !63;
            want.extend((0..3).map(|l| (base + 64 * l, Hint::Write)));
        }
        want.extend([(0x8000, Hint::L2); 5]);
        assert_eq!(seen, want);
        a.clear();
        a.pace(1);
        a.walk(|_, _| panic!("a cleared list issued a line"));
    }

    #[test]
    fn packed_v_keeps_one_contiguous_range_of_one_head() {
        let mut c = PackedV::default();
        let (a, b) = ((0, 1), (0, 2));
        assert!(!c.holds(a, &(0..4)));
        c.claim(a, (0, 4), 16)[..64].fill(1.0);
        c.mark(0..4);
        assert!(c.holds(a, &(0..4)) && c.holds(a, &(1..3)));
        assert!(!c.holds(b, &(0..4)) && !c.holds(a, &(0..5)));
        // Adjacent and overlapping tiles extend the range...
        c.claim(a, (4, 4), 16);
        c.mark(4..8);
        assert!(c.holds(a, &(0..8)));
        // ...a disjoint one replaces it...
        c.claim(a, (10, 2), 16);
        c.mark(10..12);
        assert!(c.holds(a, &(10..12)) && !c.holds(a, &(0..4)));
        // ...and another head forgets it.
        c.claim(b, (0, 2), 16);
        assert!(!c.holds(a, &(10..12)));
        c.mark(0..2);
        assert!(c.holds(b, &(0..2)) && !c.holds(a, &(0..2)));
        assert_eq!(c.rows(1, 16).len(), c.buf.len() - 16);
    }

    #[test]
    fn packed_v_budget_is_in_bytes_of_f32() {
        let keys = PACKED_V_BYTES / (4 * 144);
        assert!(PackedV::fits(keys, 144) && !PackedV::fits(keys + 1, 144));
    }
}
