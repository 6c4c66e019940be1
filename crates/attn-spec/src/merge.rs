//! Merging partial attention states: the building block of split-KV
//! decoding, chunked prefill and ring attention.
//!
//! Two results computed over disjoint key sets, each an output row `o` and
//! its log-sum-exp `l`, combine exactly: with `m = max(l_a, l_b)`, weights
//! `w = exp(l - m)`, the merged row is `(w_a o_a + w_b o_b) / (w_a + w_b)`
//! and its log-sum-exp `m + ln(w_a + w_b)`. A part with `l = -inf` saw no
//! key and contributes nothing; two such parts give output 0 and `-inf`,
//! never NaN, while a NaN log-sum-exp in either part makes the row NaN. A
//! sink must be counted in exactly one part.

use crate::error::{AttnError, Result};

/// Merges state `b` into state `a` in place: `o_a`/`o_b` hold `rows` rows of
/// `dim` values, `lse_a`/`lse_b` one log-sum-exp per row.
pub fn merge_states(o_a: &mut [f32], lse_a: &mut [f32], o_b: &[f32], lse_b: &[f32]) -> Result<()> {
    let rows = lse_a.len();
    if lse_b.len() != rows {
        return Err(AttnError::Shape {
            tensor: "lse_b",
            axis: "rows",
            expected: rows,
            got: lse_b.len(),
        });
    }
    if rows == 0 {
        return Ok(());
    }
    let dim = o_a.len() / rows;
    for (tensor, len) in [("o_a", o_a.len()), ("o_b", o_b.len())] {
        if len != rows * dim || dim == 0 {
            return Err(AttnError::Shape {
                tensor,
                axis: "rows * dim",
                expected: rows * dim.max(1),
                got: len,
            });
        }
    }
    for r in 0..rows {
        let (la, lb) = (lse_a[r], lse_b[r]);
        // `f32::max` returns the other operand for a NaN one, which would
        // turn a NaN part merged with an empty one into (0, -inf): NaN must
        // propagate (docs/SEMANTICS.md section 6).
        let m = if la.is_nan() || lb.is_nan() {
            f32::NAN
        } else {
            la.max(lb)
        };
        let oa = &mut o_a[r * dim..(r + 1) * dim];
        let ob = &o_b[r * dim..(r + 1) * dim];
        if m == f32::NEG_INFINITY {
            oa.fill(0.0);
            lse_a[r] = f32::NEG_INFINITY;
            continue;
        }
        let wa = (la - m).exp();
        let wb = (lb - m).exp();
        let z = wa + wb;
        let (ca, cb) = (wa / z, wb / z);
        for (x, &y) in oa.iter_mut().zip(ob) {
            // A part with weight 0 must not leak its (possibly
            // uninitialised or infinite) values into the result.
            let a = if ca == 0.0 { 0.0 } else { ca * *x };
            let b = if cb == 0.0 { 0.0 } else { cb * y };
            *x = a + b;
        }
        lse_a[r] = m + z.ln();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_with_an_empty_part_is_the_identity() {
        let mut o = vec![1.0, 2.0];
        let mut l = vec![0.5];
        merge_states(&mut o, &mut l, &[9.0, 9.0], &[f32::NEG_INFINITY]).unwrap();
        assert_eq!((o, l), (vec![1.0, 2.0], vec![0.5]));
    }

    #[test]
    fn two_empty_parts_give_zero_and_minus_infinity() {
        let mut o = vec![f32::NAN];
        let mut l = vec![f32::NEG_INFINITY];
        merge_states(&mut o, &mut l, &[f32::NAN], &[f32::NEG_INFINITY]).unwrap();
        assert_eq!(o, vec![0.0]);
        assert_eq!(l, vec![f32::NEG_INFINITY]);
    }

    #[test]
    fn a_nan_part_makes_the_row_nan_even_against_an_empty_one() {
        for (la, lb) in [
            (f32::NAN, f32::NEG_INFINITY),
            (f32::NEG_INFINITY, f32::NAN),
            (0.0, f32::NAN),
        ] {
            let mut o = vec![1.0, 2.0];
            let mut l = vec![la];
            merge_states(&mut o, &mut l, &[3.0, 4.0], &[lb]).unwrap();
            assert!(
                o.iter().all(|x| x.is_nan()) && l[0].is_nan(),
                "{la} {lb}: {o:?} {l:?}"
            );
        }
    }

    #[test]
    fn equal_weights_average() {
        let mut o = vec![1.0, 3.0];
        let mut l = vec![2.0];
        merge_states(&mut o, &mut l, &[3.0, 5.0], &[2.0]).unwrap();
        assert_eq!(o, vec![2.0, 4.0]);
        assert!((l[0] - (2.0 + 2f32.ln())).abs() < 1e-6);
    }

    #[test]
    fn mismatched_lengths_are_typed_errors() {
        let mut o = vec![0.0; 4];
        let mut l = vec![0.0; 2];
        let e = merge_states(&mut o, &mut l, &[0.0; 3], &[0.0; 2]).unwrap_err();
        assert!(matches!(e, AttnError::Shape { tensor: "o_b", .. }), "{e}");
        let e = merge_states(&mut o, &mut l, &[0.0; 4], &[0.0; 1]).unwrap_err();
        assert!(
            matches!(
                e,
                AttnError::Shape {
                    tensor: "lse_b",
                    ..
                }
            ),
            "{e}"
        );
    }
}
