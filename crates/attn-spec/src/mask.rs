//! The masking model, defined once. Every backend asks these pure functions
//! which keys a query row sees and how a (query block, key block) tile is to
//! be treated; nothing else in attn decides visibility.
//!
//! A causal mask is the window `(left = inf, right = 0)`; no mask is the
//! window `(inf, inf)`. Each row `i` has a diagonal key `c = i + off`, with
//! `off = kv_len - q_len` (bottom-right, default) or `0` (top-left), using
//! the sequence's own lengths when per-sequence lengths are given. Row `i`
//! sees key `j` iff `i < q_len`, `j < kv_len` and `c - left <= j <= c +
//! right`. So the visible keys of a row are one contiguous range whose ends
//! never decrease as the row grows: that is what makes block skipping and
//! the tile classifier exact.
//!
//! The boolean mask and the bias are per-element data, not part of this
//! model: a backend applies them in every tile that is not skipped.

use crate::options::{Alignment, MaskKind};
use std::ops::Range;

/// How a backend must treat one (query block, key block) tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileClass {
    /// No pair in the tile is visible: never visit it.
    Skip,
    /// Every pair is visible: run without any mask check.
    Full,
    /// Some pairs are visible: apply the mask element by element.
    Partial,
}

/// The mask of one sequence: its lengths, diagonal offset and window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqMask {
    /// Valid query rows.
    pub q_len: usize,
    /// Valid keys.
    pub kv_len: usize,
    /// Diagonal offset: row `i`'s diagonal key is `i + offset`.
    pub offset: i64,
    /// Keys visible left of the diagonal (`None`: unbounded). [`SeqMask::new`]
    /// saturates it at `q_len + kv_len`, past which a side hides nothing.
    pub left: Option<usize>,
    /// Keys visible right of the diagonal (`None`: unbounded), saturated
    /// as `left`.
    pub right: Option<usize>,
}

/// A window side as the signed distance the range arithmetic uses: any
/// `usize` (up to `usize::MAX`, which a caller may pass for "unbounded")
/// saturates at `i64::MAX` instead of wrapping.
#[inline]
fn side(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl SeqMask {
    /// The mask of a sequence with `q_len` rows and `kv_len` keys.
    pub fn new(kind: MaskKind, alignment: Alignment, q_len: usize, kv_len: usize) -> Self {
        let (left, right) = kind.window();
        // A side of `q_len + kv_len` or more already reaches past every key
        // of every row (|c| < q_len + kv_len): saturating there changes no
        // visibility and keeps every later sum far from overflow.
        let reach = q_len.saturating_add(kv_len);
        let (left, right) = (left.map(|l| l.min(reach)), right.map(|r| r.min(reach)));
        let offset = match alignment {
            Alignment::BottomRight => side(kv_len) - side(q_len),
            Alignment::TopLeft => 0,
        };
        SeqMask {
            q_len,
            kv_len,
            offset,
            left,
            right,
        }
    }

    /// The diagonal key of row `row` (may lie outside `0..kv_len`).
    #[inline]
    pub fn diagonal(&self, row: usize) -> i64 {
        side(row).saturating_add(self.offset)
    }

    /// The visible keys of `row`, as a half-open range (empty when none).
    #[inline]
    pub fn kv_range(&self, row: usize) -> Range<usize> {
        if row >= self.q_len {
            return 0..0;
        }
        let c = self.diagonal(row);
        let kv = side(self.kv_len);
        let lo = match self.left {
            Some(l) => c.saturating_sub(side(l)).clamp(0, kv),
            None => 0,
        };
        let hi = match self.right {
            Some(r) => c.saturating_add(side(r)).saturating_add(1).clamp(0, kv),
            None => kv,
        };
        if lo >= hi {
            0..0
        } else {
            lo as usize..hi as usize
        }
    }

    /// [`SeqMask::kv_range`] of each of the `N` rows `first..first + N`,
    /// from two of them where it can: each end of a row's range is its
    /// diagonal (one more per row, saturating) plus a constant (or a fixed
    /// end for an unbounded side), clamped to the keys, so from row to row
    /// it moves by one key or by none. When both end
    /// rows see keys and each end moved by `N - 1` or by 0 between them,
    /// it moved the same at every row between (and every row between
    /// sees keys); otherwise each row is asked. (A kernel asks this for
    /// each vector of rows of each masked block: row by row it was 1.5%
    /// of a 512-token causal call.)
    #[inline]
    pub fn kv_ranges<const N: usize>(&self, first: usize) -> [Range<usize>; N] {
        let (a, b) = match N {
            0 => return std::array::from_fn(|_| 0..0),
            n => (
                self.kv_range(first),
                self.kv_range(first.saturating_add(n - 1)),
            ),
        };
        let step = |x: usize, y: usize| match y.checked_sub(x) {
            Some(0) => Some(0),
            Some(d) if d == N - 1 => Some(1),
            _ => None,
        };
        match (
            a.is_empty() || b.is_empty(),
            step(a.start, b.start),
            step(a.end, b.end),
        ) {
            (false, Some(s), Some(e)) => std::array::from_fn(|i| a.start + s * i..a.end + e * i),
            _ => std::array::from_fn(|i| self.kv_range(first.saturating_add(i))),
        }
    }

    /// The definition, element by element: does `row` see `key`? The range
    /// functions above must agree with it (unit-tested).
    pub fn visible(&self, row: usize, key: usize) -> bool {
        if row >= self.q_len || key >= self.kv_len {
            return false;
        }
        let c = self.diagonal(row);
        let j = side(key);
        let left_ok = self.left.is_none_or(|l| j >= c.saturating_sub(side(l)));
        let right_ok = self.right.is_none_or(|r| j <= c.saturating_add(side(r)));
        left_ok && right_ok
    }

    /// Classifies the tile `rows x keys`: `Skip` if no pair is visible,
    /// `Full` if every pair is, `Partial` otherwise. Costs one range per row,
    /// nothing next to the tile's arithmetic.
    pub fn classify(&self, rows: Range<usize>, keys: Range<usize>) -> TileClass {
        if rows.is_empty() || keys.is_empty() {
            return TileClass::Skip;
        }
        // From the ends of the run of rows, not a walk over all of them
        // (this runs for every tile of every block): some row sees a key of
        // the tile iff the span (the union of the rows' ranges, contiguous)
        // meets it; every row sees all of them iff no row's range is empty
        // (empty ones lie at the ends of the run) and the last row's start
        // and the first row's end (the largest start, the smallest end)
        // enclose the tile.
        let span = self.kv_span(rows.clone());
        if span.start.max(keys.start) >= span.end.min(keys.end) {
            return TileClass::Skip;
        }
        let (first, last) = (self.kv_range(rows.start), self.kv_range(rows.end - 1));
        let all = !first.is_empty()
            && !last.is_empty()
            && last.start <= keys.start
            && first.end >= keys.end;
        match all {
            true => TileClass::Full,
            false => TileClass::Partial,
        }
    }

    /// The keys that rows `rows` can see at all: the union of their ranges
    /// (contiguous, since both ends are monotone). Loops over key blocks need
    /// visit only these.
    pub fn kv_span(&self, rows: Range<usize>) -> Range<usize> {
        // The ends of a row's range never decrease as the row grows (module
        // docs), and rows with no key lie at either end of any run of
        // rows: the span runs from the first non-empty row's start to the
        // last one's end, found from each side (two rows of a causal
        // block, where a walk over all rows cost ~1% of a small call).
        let nonempty = |r: usize| Some(self.kv_range(r)).filter(|v| !v.is_empty());
        let Some(first) = rows.clone().find_map(nonempty) else {
            return 0..0;
        };
        let last = rows.rev().find_map(nonempty).unwrap_or(first.clone());
        first.start..last.end
    }

    /// Number of visible (row, key) pairs: what FLOP counts are based on.
    pub fn visible_pairs(&self) -> u64 {
        (0..self.q_len).map(|r| self.kv_range(r).len() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds() -> Vec<MaskKind> {
        let mut k = vec![MaskKind::None, MaskKind::Causal];
        for l in [None, Some(0), Some(1), Some(3)] {
            for r in [None, Some(0), Some(1), Some(2)] {
                k.push(MaskKind::Window { left: l, right: r });
            }
        }
        k
    }

    #[test]
    fn ranges_and_tiles_agree_with_the_brute_force_mask() {
        for kind in kinds() {
            for al in [Alignment::BottomRight, Alignment::TopLeft] {
                for ql in 0..9 {
                    for kl in 0..9 {
                        let m = SeqMask::new(kind, al, ql, kl);
                        for i in 0..ql + 2 {
                            let r = m.kv_range(i);
                            for j in 0..kl + 2 {
                                assert_eq!(r.contains(&j), m.visible(i, j), "{m:?} {i} {j}");
                            }
                        }
                        let runs =
                            |n: usize| (0..n).flat_map(move |a| (a + 1..=n).map(move |b| (a, b)));
                        for (r0, r1) in runs(ql + 2) {
                            for (k0, k1) in runs(kl + 2) {
                                let vis: Vec<bool> = (r0..r1)
                                    .flat_map(|i| (k0..k1).map(move |j| (i, j)))
                                    .map(|(i, j)| m.visible(i, j))
                                    .collect();
                                let want = if !vis.iter().any(|&v| v) {
                                    TileClass::Skip
                                } else if vis.iter().all(|&v| v) {
                                    TileClass::Full
                                } else {
                                    TileClass::Partial
                                };
                                assert_eq!(m.classify(r0..r1, k0..k1), want, "{m:?}");
                                // The span is exactly the hull of the
                                // visible keys of the rows (empty: 0..0).
                                let seen: Vec<usize> = (r0..r1)
                                    .flat_map(|i| (0..kl + 2).filter(move |&j| m.visible(i, j)))
                                    .collect();
                                let hull = match (seen.iter().min(), seen.iter().max()) {
                                    (Some(&a), Some(&b)) => a..b + 1,
                                    _ => 0..0,
                                };
                                assert_eq!(m.kv_span(r0..r1), hull, "{m:?} rows {r0}..{r1}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The ranges of a run of rows from its ends are those of each row:
    /// every mask, alignment and pair of lengths up to 40, runs of 16, 5, 2
    /// and 1 rows from every start (across the last row too), and runs
    /// near 2^33 and at the end of `usize`.
    #[test]
    fn ranges_of_a_run_are_those_of_each_row() {
        fn check<const N: usize>(m: &SeqMask, first: usize) {
            let want: [Range<usize>; N] =
                std::array::from_fn(|i| m.kv_range(first.saturating_add(i)));
            assert_eq!(m.kv_ranges::<N>(first), want, "{m:?} rows from {first}");
        }
        let big = (1usize << 33) + 7;
        for kind in kinds() {
            for al in [Alignment::BottomRight, Alignment::TopLeft] {
                for ql in 0..40 {
                    for kl in 0..40 {
                        let m = SeqMask::new(kind, al, ql, kl);
                        for first in 0..ql + 2 {
                            check::<16>(&m, first);
                            check::<5>(&m, first);
                            check::<2>(&m, first);
                            check::<1>(&m, first);
                        }
                    }
                }
                for (ql, kl) in [(big, big), (big, 40), (40, big), (big + 3, big - 20)] {
                    let m = SeqMask::new(kind, al, ql, kl);
                    for first in [0, 30, big - 40, big - 10, big, usize::MAX - 3] {
                        check::<16>(&m, first);
                    }
                }
            }
        }
        // A window given as the largest usize (`SeqMask` built directly).
        let m = SeqMask {
            q_len: 100,
            kv_len: 50,
            offset: -50,
            left: Some(usize::MAX),
            right: Some(3),
        };
        for first in 0..100 {
            check::<16>(&m, first);
        }
    }

    #[test]
    fn bottom_right_causal_with_more_rows_than_keys_masks_the_first_rows() {
        let m = SeqMask::new(MaskKind::Causal, Alignment::BottomRight, 5, 3);
        assert_eq!(m.kv_range(0), 0..0);
        assert_eq!(m.kv_range(1), 0..0);
        assert_eq!(m.kv_range(2), 0..1);
        assert_eq!(m.kv_range(4), 0..3);
        let t = SeqMask::new(MaskKind::Causal, Alignment::TopLeft, 3, 5);
        assert_eq!(t.kv_range(0), 0..1);
        assert_eq!(t.visible_pairs(), 1 + 2 + 3);
    }

    #[test]
    fn window_zero_sees_only_the_diagonal() {
        let m = SeqMask::new(
            MaskKind::Window {
                left: Some(0),
                right: Some(0),
            },
            Alignment::BottomRight,
            4,
            6,
        );
        for i in 0..4 {
            assert_eq!(m.kv_range(i), i + 2..i + 3);
        }
    }

    /// A side of `usize::MAX` (or anything past `i64::MAX`) means "no
    /// bound" and must behave exactly as `None`, whether it went through
    /// `new` (saturated there) or was set on the struct directly (saturated
    /// in the arithmetic); before, `usize::MAX as i64` wrapped to -1 and hid
    /// every key.
    #[test]
    fn huge_window_sides_are_unbounded() {
        let huge = [
            usize::MAX,
            usize::MAX - 1,
            i64::MAX as usize,
            i64::MAX as usize + 1,
            u32::MAX as usize,
            1 << 40,
            20,
        ];
        for al in [Alignment::BottomRight, Alignment::TopLeft] {
            for (ql, kl) in [(0, 0), (1, 9), (9, 1), (7, 7), (3, 12)] {
                for &h in &huge {
                    for (kind, want) in [
                        (
                            MaskKind::Window {
                                left: Some(h),
                                right: Some(h),
                            },
                            MaskKind::None,
                        ),
                        (
                            MaskKind::Window {
                                left: Some(h),
                                right: Some(0),
                            },
                            MaskKind::Causal,
                        ),
                        (
                            MaskKind::Window {
                                left: Some(1),
                                right: Some(h),
                            },
                            MaskKind::Window {
                                left: Some(1),
                                right: None,
                            },
                        ),
                    ] {
                        let m = SeqMask::new(kind, al, ql, kl);
                        let (l, r) = kind.window();
                        let raw = SeqMask {
                            left: l,
                            right: r,
                            ..m
                        };
                        let w = SeqMask::new(want, al, ql, kl);
                        for i in 0..ql + 1 {
                            assert_eq!(
                                m.kv_range(i),
                                w.kv_range(i),
                                "{kind:?} {al:?} {ql}x{kl} row {i}"
                            );
                            assert_eq!(raw.kv_range(i), w.kv_range(i), "raw {kind:?} row {i}");
                            for j in 0..kl + 1 {
                                assert_eq!(m.visible(i, j), w.visible(i, j));
                                assert_eq!(raw.visible(i, j), w.visible(i, j));
                            }
                        }
                    }
                }
            }
        }
    }
}
