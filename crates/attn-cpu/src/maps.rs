//! Attention maps on the CPU: the probabilities of the selected rows,
//! recomputed from the forward's log-sum-exp tile by tile with the
//! backward pass's microkernel and probability code (`probs.rs`), so a
//! map costs one `Q K^T` product over what was asked and no memory beyond
//! the map and a few KiB per thread.
//!
//! A unit of work is a block of [`MAP_ROWS`] rows of one map plane (one
//! selected batch entry and head, or every selected head when they are
//! averaged: then the heads are summed in selection order into the plane
//! and divided by their count once). Units write disjoint parts of the
//! map, and each element's arithmetic is fixed by the shape, so the maps
//! are bitwise identical for any number of threads.

use crate::backward::task::{read_row, round_up, transpose_rows};
use crate::blocking::{BWD_KEYS_BANDED, BWD_ROWS, LANES};
use crate::element::CpuElement;
use crate::probs::{score_probs, Scores, Tile};
use crate::simd::{vectorize, Isa, Op, Vector};
use crate::threads::{self, Threads};
use crate::{typed, Cpu};
use attn_spec::{
    check_maps_call, AttentionMaps, DType, HostData, Inputs, MapLayout, Problem, Result, TileClass,
};
use std::ops::Range;

/// Rows of a unit (a multiple of every level's `mr(1)`: 12, 6, 2).
pub const MAP_ROWS: usize = BWD_ROWS;

/// Keys per block of a unit, and the row stride of its K^T and score
/// tiles: 48, three vectors of 16 (the size the maps were written and
/// tested with; not retuned when the backward's unmasked blocks grew to
/// 96).
const MAP_KEYS: usize = BWD_KEYS_BANDED;

/// The read-only side of a maps call.
pub struct Ctx<'a, T> {
    /// Scores to probabilities.
    pub sc: Scores<'a>,
    /// Q in its view.
    pub q: &'a [T],
    /// K in its view.
    pub k: &'a [T],
    /// What the map holds.
    pub layout: &'a MapLayout,
}

/// A block of rows of one map plane.
#[derive(Clone, Debug)]
pub struct Unit {
    /// The selected batch entry (index into `layout.batches`).
    pub bi: usize,
    /// The selected heads it sums (indices into `layout.heads`): one, or
    /// all of them when averaged.
    pub heads: Range<usize>,
    /// Its first row, counted from `layout.rows.start`, and its rows.
    pub rows: (usize, usize),
}

/// Buffers of one thread.
pub struct Scratch {
    /// A key block's K rows (padded to 16 with zeros), then K^T.
    kr: Vec<f32>,
    kt: Vec<f32>,
    q: Vec<f32>,
    s: Vec<f32>,
    add: Vec<f32>,
    dqkp: usize,
}

impl Scratch {
    fn new(dqk: usize) -> Self {
        let dqkp = round_up(dqk, LANES);
        Scratch {
            kr: vec![0.0; MAP_KEYS * dqkp],
            kt: vec![0.0; dqkp * MAP_KEYS],
            q: vec![0.0; MAP_ROWS * dqkp],
            s: vec![0.0; MAP_ROWS * MAP_KEYS],
            add: vec![0.0; MAP_KEYS],
            dqkp,
        }
    }
}

/// Computes `unit` into `out` (its rows of the plane, `kv_len` floats
/// each).
#[inline(always)]
pub fn run<V: Vector, T: CpuElement>(
    ctx: &Ctx<'_, T>,
    unit: &Unit,
    out: &mut [f32],
    ws: &mut Scratch,
) {
    let l = ctx.layout;
    let p = ctx.sc.p;
    let s = p.shape;
    let b = l.batches[unit.bi];
    let mask = p.seq_mask(b);
    let (kl, dqk, dqkp) = (s.kv_len, s.head_dim_qk, ws.dqkp);
    let (i0, mb) = (l.rows.start + unit.rows.0, unit.rows.1);
    let mbp = round_up(mb, V::mr(1));
    assert!(out.len() == mb * kl && mbp <= MAP_ROWS);
    out.iter_mut().for_each(|x| *x = 0.0);
    // Rows past the unit's enter the product and are dropped: keep them 0.
    ws.q[mb * dqkp..mbp * dqkp]
        .iter_mut()
        .for_each(|x| *x = 0.0);
    for j0 in (0..mask.kv_len).step_by(MAP_KEYS) {
        let n = MAP_KEYS.min(mask.kv_len - j0);
        if mask.classify(i0..i0 + mb, j0..j0 + n) == TileClass::Skip {
            continue;
        }
        let mut packed = None;
        for hi in unit.heads.clone() {
            let h = l.heads[hi];
            let kvh = s.kv_head(h);
            if packed != Some(kvh) {
                // K^T of the block (dqkp rows of MAP_KEYS), 0 past the keys.
                for r in 0..n {
                    let row = &mut ws.kr[r * dqkp..r * dqkp + dqk];
                    read_row::<V, T>(ctx.k, &p.k, [b, j0 + r, kvh], row);
                }
                transpose_rows::<V>(&ws.kr, dqkp, n, &mut ws.kt, MAP_KEYS);
                packed = Some(kvh);
            }
            for r in 0..mb {
                let dst = &mut ws.q[r * dqkp..r * dqkp + dqk];
                read_row::<V, T>(ctx.q, &p.q, [b, i0 + r, h], dst);
            }
            let tile = Tile {
                bh: (b, h),
                rows: (i0, mb),
                keys: (j0, n),
                stride: MAP_KEYS,
            };
            // SAFETY: q holds mbp rows of dqkp floats (mbp <= MAP_ROWS is
            // mb rounded up to mr), kt dqk rows of MAP_KEYS, 0 past the
            // block's keys.
            unsafe {
                score_probs::<V>(
                    &ctx.sc,
                    tile,
                    (ws.q.as_ptr(), dqkp, dqk),
                    ws.kt.as_ptr(),
                    &mut ws.s,
                    (&mut ws.add, None),
                )
            };
            for r in 0..mb {
                let src = &ws.s[r * MAP_KEYS..r * MAP_KEYS + n];
                let dst = &mut out[r * kl + j0..r * kl + j0 + n];
                if l.averaged {
                    dst.iter_mut().zip(src).for_each(|(d, &x)| *d += x);
                } else {
                    dst.copy_from_slice(src);
                }
            }
        }
    }
    if l.averaged && unit.heads.len() > 1 {
        let nh = unit.heads.len() as f32;
        out.iter_mut().for_each(|x| *x /= nh);
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Option<Scratch>> = const { std::cell::RefCell::new(None) };
}

/// One unit as a vectorised computation.
struct UnitOp<'a, 'b, T> {
    ctx: &'a Ctx<'a, T>,
    unit: Unit,
    out: &'b mut [f32],
}

impl<T: CpuElement> Op for UnitOp<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vector>(self) {
        let dqk = self.ctx.sc.p.shape.head_dim_qk;
        let mut ws = SCRATCH
            .with(|c| c.borrow_mut().take())
            .filter(|w| w.dqkp == round_up(dqk, LANES))
            .unwrap_or_else(|| Scratch::new(dqk));
        V::maps_unit(self.ctx, &self.unit, self.out, &mut ws);
        SCRATCH.with(|c| *c.borrow_mut() = Some(ws));
    }
}

fn maps_typed<T: CpuElement>(
    (threads, isa): (Threads<'_>, Isa),
    p: &Problem,
    inputs: Inputs<'_, HostData>,
    lse: &[f32],
    layout: &MapLayout,
    out: &mut [f32],
) -> Result<()> {
    if layout.is_empty() {
        return Ok(());
    }
    let mask = match (inputs.mask, &p.mask) {
        (Some(HostData::Bool(m)), Some(v)) => Some((m.as_slice(), *v)),
        _ => None,
    };
    let ctx = Ctx {
        sc: Scores {
            p,
            lse,
            bias: inputs.bias.zip(p.bias.map(|b| b.view)),
            mask,
        },
        q: typed::<T>(inputs.q, "q")?,
        k: typed::<T>(inputs.k, "k")?,
        layout,
    };
    let [_, nh, nr, kl] = layout.dims();
    let unit = |pl: usize, blk: usize, rows: usize| Unit {
        bi: pl / nh,
        heads: if layout.averaged {
            0..layout.heads.len()
        } else {
            pl % nh..pl % nh + 1
        },
        rows: (blk * MAP_ROWS, rows),
    };
    let run = |pl: usize, (blk, o): (usize, &mut [f32])| {
        let u = unit(pl, blk, o.len() / kl);
        vectorize(
            isa,
            UnitOp {
                ctx: &ctx,
                unit: u,
                out: o,
            },
        )
    };
    // One item per block of rows of one plane.
    let items = out.chunks_mut(nr * kl).enumerate().flat_map(|(pl, plane)| {
        plane
            .chunks_mut(MAP_ROWS * kl)
            .enumerate()
            .map(move |x| (pl, x))
    });
    threads::each(threads, items, |(pl, x)| run(pl, x));
    Ok(())
}

impl AttentionMaps for Cpu {
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        lse: &HostData,
        layout: &MapLayout,
        maps: &mut HostData,
    ) -> Result<()> {
        check_maps_call(self, problem, &inputs, lse, layout, maps)?;
        let s = problem.shape;
        let [nb, _, nr, kl] = layout.dims();
        let flops = 2.0 * (nb * layout.heads.len() * nr * kl * s.head_dim_qk) as f64;
        let run = (self.runner(self.parallel(flops)), self.isa()?);
        let lse = typed::<f32>(lse, "lse")?;
        let HostData::F32(out) = maps else {
            unreachable!("check_maps_call checked the type")
        };
        match problem.dtype {
            DType::F32 => maps_typed::<f32>(run, problem, inputs, lse, layout, out),
            DType::F16 => maps_typed::<attn_spec::f16>(run, problem, inputs, lse, layout, out),
            DType::Bf16 => maps_typed::<attn_spec::bf16>(run, problem, inputs, lse, layout, out),
            _ => unreachable!("refused by supports()"),
        }
    }
}
