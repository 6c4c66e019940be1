//! Triangular tiles: which vectors of a block's rows need which keys of a
//! tile.
//!
//! A block's rows sit in vectors of 16 lanes, and under a causal or
//! sliding-window mask each vector sees a different span of keys. On a tile
//! that crosses the diagonal, the first vector of a 64-row block sees the
//! fewest keys and the last one the most; computing every vector against
//! every key would spend about half of the diagonal square on pairs that
//! the mask then discards (12% of all the pairs a 512-token causal prefill
//! computes). [`Parts::cut`] cuts the tile at every vector's first and last
//! visible key, and each part runs the microkernels only on the vectors that
//! see some of its keys. The other vectors' scores are never computed; the
//! mask (which every such tile goes through) writes `-inf` over those
//! inside a vector's span ([`Parts::spans`]), and the softmax reads none
//! outside it.

use crate::blocking::ROW_VECS;
use std::ops::Range;

/// Most parts a tile can have: cut at two bounds per vector.
const MAX: usize = 2 * ROW_VECS + 1;

/// A key tile cut into parts: each a range of keys (from the tile's first
/// key) and the range of row vectors that see some of them (empty when no
/// row does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parts {
    parts: [(usize, usize, usize, usize); MAX],
    len: usize,
}

impl Parts {
    /// One part: all `n` keys, all `nv` vectors.
    pub fn whole(n: usize, nv: usize) -> Self {
        let mut parts = [(0, 0, 0, 0); MAX];
        parts[0] = (0, n, 0, nv);
        Parts { parts, len: 1 }
    }

    /// Cuts the tile of keys `j0..j0+n` for vectors whose rows see keys
    /// in `bounds[v] = (lo, hi)` only (`lo..hi`, absolute; `(0, 0)` for a
    /// vector that sees none). Vectors outside a part's range see none of
    /// its keys.
    pub fn cut(bounds: &[(usize, usize)], (j0, n): (usize, usize)) -> Self {
        assert!(bounds.len() <= ROW_VECS);
        let mut cuts = [n; 2 * ROW_VECS + 2];
        cuts[0] = 0;
        for (v, &(lo, hi)) in bounds.iter().enumerate() {
            cuts[2 + 2 * v] = lo.saturating_sub(j0).min(n);
            cuts[3 + 2 * v] = hi.saturating_sub(j0).min(n);
        }
        let cuts = &mut cuts[..2 + 2 * bounds.len()];
        cuts.sort_unstable();
        let mut out = Parts {
            parts: [(0, 0, 0, 0); MAX],
            len: 0,
        };
        for w in cuts.windows(2) {
            let (a, b) = (w[0], w[1]);
            if a == b {
                continue;
            }
            // Every bound is a cut, so which vectors see a key is the
            // same for all keys of a..b.
            let sees = |v: &usize| (bounds[*v].0..bounds[*v].1).contains(&(j0 + a));
            let (v0, v1) = match (0..bounds.len()).find(sees) {
                Some(v0) => (v0, (0..bounds.len()).rfind(sees).map_or(v0, |v| v + 1)),
                None => (0, 0),
            };
            match out.len.checked_sub(1).map(|i| &mut out.parts[i]) {
                Some(last) if (last.2, last.3) == (v0, v1) => last.1 = b,
                _ => {
                    out.parts[out.len] = (a, b, v0, v1);
                    out.len += 1;
                }
            }
        }
        out
    }

    /// The same parts cut only at even keys, for kernels that take keys in
    /// pairs (`dot16/`): a part that starts at an odd key gives that key to
    /// the part before, which then spans the hull of both parts' vectors.
    /// Every key still meets every vector that sees it; a vector it meets
    /// without seeing it multiplies probabilities of 0 (masked scores).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub fn paired(&self) -> Self {
        let mut out = Parts {
            parts: [(0, 0, 0, 0); MAX],
            len: 0,
        };
        let hull = |(a0, a1): (usize, usize), (b0, b1): (usize, usize)| match (a0 < a1, b0 < b1) {
            (true, true) => (a0.min(b0), a1.max(b1)),
            (true, false) => (a0, a1),
            _ => (b0, b1),
        };
        for &(mut a, b, v0, v1) in &self.parts[..self.len] {
            if a % 2 == 1 {
                let last = &mut out.parts[out.len - 1];
                (last.2, last.3) = hull((last.2, last.3), (v0, v1));
                a += 1;
                last.1 = a.min(b);
                if a >= b {
                    continue;
                }
            }
            out.parts[out.len] = (a, b, v0, v1);
            out.len += 1;
        }
        out
    }

    /// Whether this is one part of all `n` keys and all `nv` vectors.
    pub fn is_whole(&self, n: usize, nv: usize) -> bool {
        self.len == 1 && self.parts[0] == (0, n, 0, nv)
    }

    /// The parts in key order: (keys from the tile's first, vectors).
    pub fn iter(&self) -> impl Iterator<Item = (Range<usize>, Range<usize>)> + '_ {
        self.parts[..self.len]
            .iter()
            .map(|&(a, b, v0, v1)| (a..b, v0..v1))
    }

    /// The parts that hold some vector, in key order.
    pub fn live(&self) -> impl Iterator<Item = (Range<usize>, Range<usize>)> + '_ {
        self.iter().filter(|(_, vecs)| !vecs.is_empty())
    }

    /// Whether the first part that holds a vector holds all `nv` (a causal
    /// tile's usual first part): `P V` can then rescale the running output
    /// in that part's kernel instead of a pass of its own.
    pub fn leads_with_all(&self, nv: usize) -> bool {
        self.live().next().is_some_and(|(_, vecs)| vecs == (0..nv))
    }

    /// For each of `NV` vectors, the keys `(a, b)` that the parts holding
    /// it span (their hull; `(0, 0)` for a vector in none): the only
    /// probabilities of the vector that `P V` reads. Outside them every
    /// row of the vector is masked, so the softmax skips them (on a tile
    /// across the diagonal, each vector stops at its last row's diagonal).
    pub fn spans<const NV: usize>(&self) -> [(usize, usize); NV] {
        let mut spans = [(usize::MAX, 0); NV];
        for (keys, vecs) in self.iter() {
            for s in &mut spans[vecs] {
                *s = (s.0.min(keys.start), s.1.max(keys.end));
            }
        }
        spans.map(|(a, b)| if a < b { (a, b) } else { (0, 0) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys each vector's `P V` reads: on a causal tile each vector
    /// stops at its last row's diagonal; a part that starts at an odd key
    /// gives it to the part before, whose vectors then all read that
    /// part's keys; a vector in no part reads none.
    #[test]
    fn spans_hold_the_parts_of_each_vector() {
        let causal = Parts::cut(&[(0, 16), (0, 32), (0, 48), (0, 64)], (0, 64));
        let want = [(0, 16), (0, 32), (0, 48), (0, 64)];
        assert_eq!(causal.spans::<4>(), want);
        assert_eq!(causal.paired().spans::<4>(), want);
        // Vector 0 sees keys 0..17 and vector 1 keys 17..40 of the tile
        // at key 100; paired, key 17 joins the first part, so vector 1
        // reads its keys from 0.
        let odd = Parts::cut(&[(100, 117), (117, 140), (0, 0), (0, 0)], (100, 64));
        assert_eq!(odd.spans::<4>(), [(0, 17), (17, 40), (0, 0), (0, 0)]);
        assert_eq!(
            odd.paired().spans::<4>(),
            [(0, 18), (0, 40), (0, 0), (0, 0)]
        );
        assert_eq!(Parts::whole(37, 2).spans::<2>(), [(0, 37); 2]);
        assert!(causal.leads_with_all(4) && Parts::whole(37, 2).leads_with_all(2));
        assert!(!odd.leads_with_all(4) && !odd.paired().leads_with_all(4));
    }

    fn parts(bounds: &[(usize, usize)], tile: (usize, usize)) -> Vec<(Range<usize>, Range<usize>)> {
        Parts::cut(bounds, tile).iter().collect()
    }

    #[test]
    fn a_causal_diagonal_is_cut_into_a_staircase() {
        // Block of rows 64..128 (vectors of 16), causal top-left: row r
        // sees keys 0..=r. The tile of keys 0..128.
        let b = [(0, 80), (0, 96), (0, 112), (0, 128)];
        assert_eq!(
            parts(&b, (0, 128)),
            vec![
                (0..80, 0..4),
                (80..96, 1..4),
                (96..112, 2..4),
                (112..128, 3..4)
            ]
        );
        // A tile wholly before the diagonal is whole.
        assert!(Parts::cut(&b, (0, 64)).is_whole(64, 4));
        assert!(!Parts::cut(&b, (0, 128)).is_whole(128, 4));
    }

    #[test]
    fn windows_and_empty_vectors_give_ranges_and_gaps() {
        // Sliding window: each vector sees a band; vector 2 has no rows.
        let b = [(0, 20), (10, 36), (0, 0), (40, 60)];
        assert_eq!(
            parts(&b, (0, 64)),
            vec![
                (0..10, 0..1),
                (10..20, 0..2),
                (20..36, 1..2),
                (36..40, 0..0),
                (40..60, 3..4),
                (60..64, 0..0),
            ]
        );
        // A tile starting at 16 sees the same bounds shifted.
        assert_eq!(parts(&b, (16, 8)), vec![(0..4, 0..2), (4..8, 1..2)]);
    }

    #[test]
    fn every_key_of_every_vector_is_covered() {
        // Exhaustive over small bounds: a vector that sees key j lies in
        // the range of the part that holds j, and parts tile 0..n; also
        // when re-cut at even keys.
        let vals = [0usize, 3, 8, 13];
        for lo0 in vals {
            for len0 in vals {
                for lo1 in vals {
                    for len1 in vals {
                        let b = [(lo0, lo0 + len0), (lo1, lo1 + len1)];
                        for ((j0, n), paired) in [(0, 16), (2, 9), (5, 1)]
                            .into_iter()
                            .flat_map(|t| [(t, false), (t, true)])
                        {
                            let cut = Parts::cut(&b, (j0, n));
                            let ps: Vec<_> = if paired {
                                let ps: Vec<_> = cut.paired().iter().collect();
                                for (keys, _) in &ps {
                                    assert!(keys.start % 2 == 0, "{b:?} {j0} {n}: {ps:?}");
                                    assert!(keys.end % 2 == 0 || keys.end == n);
                                }
                                ps
                            } else {
                                cut.iter().collect()
                            };
                            assert_eq!(ps.first().unwrap().0.start, 0);
                            assert_eq!(ps.last().unwrap().0.end, n);
                            for w in ps.windows(2) {
                                assert_eq!(w[0].0.end, w[1].0.start);
                            }
                            for (keys, vecs) in &ps {
                                for j in keys.clone() {
                                    for (v, &(lo, hi)) in b.iter().enumerate() {
                                        if (lo..hi).contains(&(j0 + j)) {
                                            assert!(vecs.contains(&v), "{b:?} {j0} {n}: {j} {v}");
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
