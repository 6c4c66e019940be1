//! The reference's attention maps: each selected row's probabilities
//! `exp(x_ij - lse_i)` from the given log-sum-exp, in f64, rounded once to
//! f32 (heads averaged in f64 before the rounding).

use super::{score, Reference};
use crate::backend::Inputs;
use crate::error::Result;
use crate::maps::{check_maps_call, AttentionMaps, MapLayout};
use crate::problem::Problem;
use crate::tensor::HostData;

/// Fills `out` (f32, `layout.len()`) with the maps `layout` selects,
/// recomputed in f64 from `lse` (`[batch, q_heads, q_len]`). The caller
/// has checked the call ([`check_maps_call`]).
pub fn maps_host(
    problem: &Problem,
    inputs: Inputs<'_, HostData>,
    lse: &HostData,
    layout: &MapLayout,
    out: &mut [f32],
) {
    let s = problem.shape;
    let scale = problem.scale_exact();
    let kl = s.kv_len;
    let mut row = vec![0.0f64; kl];
    let mut acc = vec![0.0f64; kl];
    let nh = layout.heads.len() as f64;
    for (bi, &b) in layout.batches.iter().enumerate() {
        let m = problem.seq_mask(b);
        for (r, i) in layout.rows.clone().enumerate() {
            acc.iter_mut().for_each(|x| *x = 0.0);
            for (hi, &h) in layout.heads.iter().enumerate() {
                row.iter_mut().for_each(|x| *x = 0.0);
                let l = lse.get((b * s.q_heads + h) * s.q_len + i);
                if l != f64::NEG_INFINITY {
                    for j in m.kv_range(i) {
                        if let Some((x, _)) = score(problem, &inputs, (b, h, i, j), scale) {
                            row[j] = (x - l).exp();
                        }
                    }
                }
                if layout.averaged {
                    acc.iter_mut().zip(&row).for_each(|(a, &x)| *a += x);
                } else {
                    let at = layout.row_start(bi, hi, r);
                    for (o, &x) in out[at..at + kl].iter_mut().zip(&row) {
                        *o = x as f32;
                    }
                }
            }
            if layout.averaged {
                let at = layout.row_start(bi, 0, r);
                for (o, &x) in out[at..at + kl].iter_mut().zip(&acc) {
                    *o = (x / nh) as f32;
                }
            }
        }
    }
}

impl AttentionMaps for Reference {
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        lse: &HostData,
        layout: &MapLayout,
        maps: &mut HostData,
    ) -> Result<()> {
        check_maps_call(self, problem, &inputs, lse, layout, maps)?;
        let HostData::F32(out) = maps else {
            unreachable!("check_maps_call checked the type")
        };
        maps_host(problem, inputs, lse, layout, out);
        Ok(())
    }
}
