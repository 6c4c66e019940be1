//! Units of work and how a problem is cut into them.
//!
//! An [`Item`] is one block of at most `ROWS` query rows that share a
//! key/value head: `np` consecutive positions times `nh` query heads of one
//! GQA group (rows ordered position-major, so the block's positions are
//! contiguous and the masking model classifies its tiles directly), over a
//! range of keys. Processing the heads of a group together loads each K/V
//! tile once for all of them.
//!
//! Decoding has too few row blocks to occupy the cores, so when a problem
//! has fewer than `MIN_WORK_ITEMS` row blocks the keys of each block are
//! split into chunks of `SPLIT_KEYS` at fixed boundaries (multiples of
//! `SPLIT_KEYS`), computed independently and merged in chunk order. Both
//! decisions depend on the problem's shape only, never on the thread count,
//! which is what makes results bitwise identical for any number of threads.

use crate::blocking::{MIN_WORK_ITEMS, ROWS, SPLIT_KEYS};
use attn_spec::Problem;
use std::ops::Range;

/// One block of rows over one range of keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    /// Batch entry.
    pub b: usize,
    /// Key/value head.
    pub kvh: usize,
    /// First query head of the block.
    pub h0: usize,
    /// Query heads in the block.
    pub nh: usize,
    /// First position.
    pub p0: usize,
    /// Positions in the block.
    pub np: usize,
    /// Keys this item covers (a chunk when split).
    pub keys: Range<usize>,
}

impl Item {
    /// Rows in the block (`np * nh <= ROWS`).
    pub fn rows(&self) -> usize {
        self.np * self.nh
    }

    /// Position and query head of row `r`.
    #[inline]
    pub fn row(&self, r: usize) -> (usize, usize) {
        // A block holds one head (nh = 1) or, with GQA, mostly a
        // power-of-two group: shifts there, not a division (this runs for
        // every row of every block's setup and output: the divisions were
        // ~1% of a 2 ms S = 512 causal call).
        if self.nh.is_power_of_two() {
            let s = self.nh.trailing_zeros();
            (self.p0 + (r >> s), self.h0 + (r & (self.nh - 1)))
        } else {
            (self.p0 + r / self.nh, self.h0 + r % self.nh)
        }
    }

    /// The block's positions.
    pub fn positions(&self) -> Range<usize> {
        self.p0..self.p0 + self.np
    }
}

/// The row blocks of a problem, each over all its keys.
pub fn row_blocks(p: &Problem) -> Vec<Item> {
    let s = p.shape;
    let group = s.group();
    let nh = group.min(ROWS);
    let np = (ROWS / nh).max(1);
    let mut items = Vec::new();
    for b in 0..s.batch {
        let (ql, kl) = p.seq_lens(b);
        for kvh in 0..s.kv_heads {
            for h0 in (kvh * group..(kvh + 1) * group).step_by(nh) {
                let nh = nh.min((kvh + 1) * group - h0);
                for p0 in (0..ql).step_by(np) {
                    items.push(Item {
                        b,
                        kvh,
                        h0,
                        nh,
                        p0,
                        np: np.min(ql - p0),
                        keys: 0..kl,
                    });
                }
            }
        }
    }
    items
}

/// Whether the keys of each row block are split into chunks (a function of
/// the shape only).
pub fn split_keys(p: &Problem, blocks: usize) -> bool {
    blocks < MIN_WORK_ITEMS && p.shape.kv_len > 2 * SPLIT_KEYS
}

/// The key chunks of one item: fixed `SPLIT_KEYS` boundaries within its
/// visible span.
pub fn chunks(span: Range<usize>) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut j = span.start;
    while j < span.end {
        let end = ((j / SPLIT_KEYS + 1) * SPLIT_KEYS).min(span.end);
        out.push(j..end);
        j = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_spec::{DType, Shape};

    #[test]
    fn blocks_cover_every_row_once() {
        for (hq, hkv) in [(8, 8), (8, 2), (32, 8), (128, 1), (3, 1), (12, 2)] {
            let p = Problem::new(Shape::new(2, hq, hkv, 77, 5, 8), DType::F32);
            let mut seen = vec![0u8; 2 * hq * 77];
            for it in row_blocks(&p) {
                assert!(it.rows() <= ROWS && it.rows() > 0);
                for r in 0..it.rows() {
                    let (pos, h) = it.row(r);
                    // Row r is position r / nh, head r % nh of the block
                    // (shifts for power-of-two groups).
                    assert_eq!((pos, h), (it.p0 + r / it.nh, it.h0 + r % it.nh));
                    assert_eq!(h / (hq / hkv), it.kvh);
                    seen[(it.b * hq + h) * 77 + pos] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "hq={hq} hkv={hkv}");
        }
    }

    #[test]
    fn chunks_have_fixed_boundaries() {
        assert_eq!(chunks(0..2500), vec![0..1024, 1024..2048, 2048..2500]);
        assert_eq!(chunks(1000..1030), vec![1000..1024, 1024..1030]);
        assert!(chunks(5..5).is_empty());
    }
}
