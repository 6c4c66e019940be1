//! The backward pass on the CPU: FlashAttention-2's algorithm with the
//! microkernel discipline and run-time ISA dispatch of the forward.
//!
//! `D = rowsum(dO * O)` first; then each probability tile is recomputed
//! from the stored log-sum-exp, so nothing of size `S x S` is ever formed
//! (`task.rs`). Work is cut by the shape alone, never by the thread
//! count, so results are bitwise identical for any number of threads:
//!
//! - a unit is one (batch entry, K/V head), the query heads of its GQA
//!   group processed together (their dK/dV sum in one place, in head
//!   order);
//! - when there are fewer units than [`BWD_MIN_TASKS`], the key blocks of
//!   each unit are cut into that many chunks of about equal work (fixed
//!   by the shape and masks: a causal unit's first chunk has fewer
//!   blocks, as more rows see each of its keys): each
//!   chunk's dK and dV are complete by themselves, and its dQ is a partial
//!   sum that is added up afterwards in chunk order. So at batch 1 with
//!   few heads both cores still work (PyTorch's CPU backward gives each
//!   thread one batch x head and leaves them idle there), with no atomics
//!   and no second pass over the keys.
//!
//! Memory beyond inputs and gradients: the f32 partial dQ rows (chunks x
//! the unit's rows x head dim, a multiple of dQ's size only when chunks
//! are needed), a scratch for a broadcast bias's gradient (per unit, then
//! summed) and a few hundred KiB per task.

pub mod pairs;
mod rows;
pub mod task;

use crate::blocking::{BWD_KEYS, BWD_KEYS_BANDED, BWD_MIN_TASKS, BWD_ROWS, LANES};
use crate::element::CpuElement;
use crate::simd::{vectorize, Isa, Op, Vector};
use crate::{typed, Cpu};
use attn_spec::{
    check_backward_call, AttnError, Backward, DType, GradInputs, GradOutputs, HostData, Inputs,
    Problem, Result, View,
};
use rayon::prelude::*;
use std::ops::Range;
use task::round_up;

/// The read-only side of a backward call.
pub struct Ctx<'a, T> {
    /// The problem.
    pub p: &'a Problem,
    /// Q, K, V, dO in their views.
    pub q: &'a [T],
    /// K.
    pub k: &'a [T],
    /// V.
    pub v: &'a [T],
    /// dO, laid out as the output.
    pub d_out: &'a [T],
    /// The forward's log-sum-exp `[batch, q_heads, q_len]`.
    pub lse: &'a [f32],
    /// `D = rowsum(dO * O)`, `[batch, q_heads, q_len]`.
    pub d: &'a [f32],
    /// The bias and its view.
    pub bias: Option<(&'a HostData, View)>,
    /// The boolean mask and its view.
    pub mask: Option<(&'a [bool], View)>,
    /// Whether `S = Q K^T` and `dP = dO V^T` run on `vdpbf16ps` (bf16
    /// inputs on the `avx512bf16` level: `task.rs`).
    pub dot16: bool,
}

/// One task: a unit (batch entry, K/V head) over a chunk of key blocks.
#[derive(Clone, Debug)]
pub struct Task {
    /// Batch entry.
    pub b: usize,
    /// K/V head.
    pub kvh: usize,
    /// The chunk's index.
    pub chunk: usize,
    /// Its key blocks (of `keys` keys).
    pub blocks: Range<usize>,
    /// Keys per block: [`BWD_KEYS`], or [`BWD_KEYS_BANDED`] for f32
    /// products under a causal or sliding window.
    pub keys: usize,
}

/// The cut of a problem into tasks: `chunks` per unit, the same key
/// blocks for every unit.
struct Plan {
    /// Keys per block (`Task::keys`).
    keys: usize,
    chunks: usize,
    /// Chunk `c` holds key blocks `cuts[c]..cuts[c + 1]`.
    cuts: Vec<usize>,
    /// Partial dQ rows per head (`q_len` rounded up to `BWD_ROWS`).
    rows: usize,
}

impl Plan {
    /// The plan of `p`; `dot16`: bf16 inputs on the `avx512bf16` level
    /// (`Ctx::dot16`), whose products run on pairs when a task's panels
    /// fit (`task::panel_fits`, from the shape; a task whose values fall
    /// outside the pairs' window runs f32 products in the blocks given).
    fn of(p: &Problem, dot16: bool) -> Plan {
        let s = p.shape;
        let units = s.batch * s.kv_heads;
        let pairs = dot16 && task::panel_fits(p, s.q_len);
        let banded = p.options.mask.window() != (None, None);
        let keys = match banded && !pairs {
            true => BWD_KEYS_BANDED,
            false => BWD_KEYS,
        };
        let blocks = s.kv_len.div_ceil(keys).max(1);
        let chunks = BWD_MIN_TASKS.div_ceil(units).clamp(1, blocks);
        Plan {
            keys,
            chunks,
            // One chunk needs no work profile.
            cuts: match chunks {
                1 => vec![0, blocks],
                _ => cuts(&block_work(p, (blocks, keys)), chunks),
            },
            rows: round_up(s.q_len, BWD_ROWS),
        }
    }

    fn tasks(&self, p: &Problem) -> Vec<Task> {
        let s = p.shape;
        let mut v = Vec::new();
        for b in 0..s.batch {
            for kvh in 0..s.kv_heads {
                for c in 0..self.chunks {
                    v.push(Task {
                        b,
                        kvh,
                        chunk: c,
                        blocks: self.cuts[c]..self.cuts[c + 1],
                        keys: self.keys,
                    });
                }
            }
        }
        v
    }
}

/// The work of each key block, summed over the batch: the (row, key)
/// pairs inside each row's key range (`kv_range`: causal and sliding
/// windows, lengths), plus a fixed share for packing the block. From the
/// shape and masks alone, in `O(batch (q_len + kv_len))`.
fn block_work(p: &Problem, (blocks, keys): (usize, usize)) -> Vec<u64> {
    let s = p.shape;
    let mut work = vec![(keys * 8) as u64; blocks];
    // Rows that see each key: +1 where a row's range starts, -1 past its
    // end, summed in key order.
    let mut edges = vec![0i64; s.kv_len + 1];
    for b in 0..s.batch {
        let m = p.seq_mask(b);
        edges.iter_mut().for_each(|e| *e = 0);
        for i in 0..m.q_len {
            let r = m.kv_range(i);
            if r.start < r.end {
                edges[r.start] += 1;
                edges[r.end] -= 1;
            }
        }
        let mut rows = 0i64;
        for (j, e) in edges[..s.kv_len].iter().enumerate() {
            rows += e;
            work[j / keys] += rows as u64;
        }
    }
    work
}

/// Boundaries of `chunks` runs of blocks (each at least one block) of
/// about equal total work: chunk `c` ends at the first block where the
/// running work reaches `(c + 1) / chunks` of the total.
fn cuts(work: &[u64], chunks: usize) -> Vec<usize> {
    let blocks = work.len();
    let total: u64 = work.iter().sum();
    let mut cuts = vec![0usize; chunks + 1];
    let (mut k, mut acc) = (0usize, 0u64);
    for c in 1..chunks {
        let goal = (total as u128 * c as u128 / chunks as u128) as u64;
        // At least one block per chunk, and one left for each later one.
        while k < blocks - (chunks - c) && (k < cuts[c - 1] + 1 || acc + work[k] / 2 < goal) {
            acc += work[k];
            k += 1;
        }
        cuts[c] = k;
    }
    cuts[chunks] = blocks;
    cuts
}

/// The partial dQ rows, kept between calls (up to [`PARTS_KEEP`] floats):
/// a fresh buffer each call cost a memset, page faults and, freed after
/// two threads touched it, TLB shootdowns, about a tenth of a 5 ms
/// backward pass on two threads. Each task zeroes its own rows
/// ([`Outs::clear_parts`]). A second call running meanwhile allocates
/// its own.
static PARTS: std::sync::Mutex<Vec<f32>> = std::sync::Mutex::new(Vec::new());

/// Most floats [`PARTS`] keeps (64 MiB).
const PARTS_KEEP: usize = 16 << 20;

/// A buffer of `n` floats for the partial dQ rows (contents unspecified).
fn parts_buffer(n: usize) -> Vec<f32> {
    let mut v = PARTS
        .try_lock()
        .map(|mut g| std::mem::take(&mut *g))
        .unwrap_or_default();
    v.resize(n, 0.0);
    v
}

/// Keeps `v` for the next call when it is small enough.
fn keep_parts(v: Vec<f32>) {
    if v.len() <= PARTS_KEEP {
        if let Ok(mut g) = PARTS.try_lock() {
            if g.len() < v.len() {
                *g = v;
            }
        }
    }
}

/// Where partial dQ row `i` of head `hh` of a unit's group, from the
/// unit's chunk `ch`, starts among the partial rows; `layout` = (chunks
/// per unit, rows per head, padded head dim, group).
fn part_at(
    (chunks, per_head, dqkp, group): (usize, usize, usize, usize),
    (unit, ch): (usize, usize),
    (hh, i): (usize, usize),
) -> usize {
    (((unit * chunks + ch) * group + hh) * per_head + i) * dqkp
}

/// Where tasks write: dK and dV (each key row by the one task of its
/// block), the partial dQ rows (each task its own), the bias gradient or
/// its per-unit scratch (each task its unit's rows of its keys).
pub struct Outs<T> {
    dk: *mut T,
    dk_len: usize,
    dv: *mut T,
    dv_len: usize,
    parts: *mut f32,
    parts_len: usize,
    dbias: *mut f32,
    dbias_len: usize,
    /// Head slices of the bias scratch: `q_heads`, or `kv_heads` when the
    /// bias is shared by the heads (a task sums its group's heads).
    dbias_heads: usize,
    /// Chunks per unit, partial rows per head, head dim padded, group.
    layout: (usize, usize, usize, usize),
    /// `[q_heads, q_len, kv_len]` of the problem, for the bias scratch.
    sizes: (usize, usize, usize, usize),
}

// SAFETY: the pointers are written only through `write_kv`, `part_rows`
// and `add_dbias`, at elements that exactly one task writes (key rows of
// its own blocks; its own partial rows; its unit's bias rows at its own
// keys), while the buffers are borrowed mutably for the whole parallel
// section; the gradient views were validated not to alias.
unsafe impl<T: Send> Send for Outs<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Outs<T> {}

impl<T: CpuElement> Outs<T> {
    /// Whether the bias gradient is computed.
    pub fn has_dbias(&self) -> bool {
        !self.dbias.is_null()
    }

    /// Adds `ds` (the keys `j..j + ds.len()` of row `(b, h, i)`) into the
    /// bias gradient's scratch.
    pub fn add_dbias(&self, (b, h, i): (usize, usize, usize), j: usize, ds: &[f32]) {
        let (hq, ql, kl, group) = self.sizes;
        let hs = if self.dbias_heads == hq { h } else { h / group };
        let at = ((b * self.dbias_heads + hs) * ql + i) * kl + j;
        assert!(at + ds.len() <= self.dbias_len);
        for (e, &x) in ds.iter().enumerate() {
            // SAFETY: in bounds (asserted); only this task writes its
            // unit's rows at its keys.
            unsafe { *self.dbias.add(at + e) += x };
        }
    }

    /// `task`'s unit: its (batch entry, K/V head), flat.
    fn unit(&self, task: &Task) -> usize {
        let (hq, _, _, group) = self.sizes;
        task.b * (hq / group) + task.kvh
    }

    /// Zeroes `task`'s partial dQ rows (every head of its group), which its
    /// products then add into.
    pub fn clear_parts(&self, task: &Task) {
        let (_, per_head, dqkp, group) = self.layout;
        let n = group * per_head * dqkp;
        let at = part_at(self.layout, (self.unit(task), task.chunk), (0, 0));
        assert!(at + n <= self.parts_len);
        // SAFETY: in bounds (asserted); only this task writes its partial
        // rows.
        unsafe { std::slice::from_raw_parts_mut(self.parts.add(at), n).fill(0.0) };
    }

    /// The partial dQ rows `i0..i0 + rows` of head `hh` of `task`'s group.
    pub fn part_rows(&self, task: &Task, hh: usize, i0: usize, rows: usize) -> *mut f32 {
        let (_, per_head, dqkp, _) = self.layout;
        let at = part_at(self.layout, (self.unit(task), task.chunk), (hh, i0));
        assert!(i0 + rows <= per_head && at + rows * dqkp <= self.parts_len);
        // SAFETY: in bounds (asserted).
        unsafe { self.parts.add(at) }
    }

    /// Writes dK and dV of keys `j0..j0 + all` of `(b, kvh)`: the first
    /// `n` from the f32 rows `dk` (stride `dqkp`) and `dv` (stride `dvp`),
    /// the others (past the sequence's keys) 0.
    #[inline(always)]
    pub fn write_kv<V: Vector>(
        &self,
        ctx: &Ctx<'_, T>,
        (b, kvh, j0): (usize, usize, usize),
        (n, all): (usize, usize),
        (dk, dqkp): (&[f32], usize),
        (dv, dvp): (&[f32], usize),
    ) {
        let p = ctx.p;
        let s = p.shape;
        let targets = [
            (self.dk, self.dk_len, &p.k, dk, dqkp, s.head_dim_qk),
            (self.dv, self.dv_len, &p.v, dv, dvp, s.head_dim_v),
        ];
        for (dst, len, view, src, stride, dim) in targets {
            let step = view.strides[3];
            for r in 0..all {
                let base = view.index([b, j0 + r, kvh, 0]);
                assert!(dim == 0 || base + (dim - 1) * step < len);
                let row = (r < n).then(|| &src[r * stride..][..dim]);
                // SAFETY: in bounds (asserted); key row j0 + r of head kvh
                // is written by this task only.
                unsafe { rows::store_row::<V, T>(row, dst, (base, step, dim)) };
            }
        }
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Option<task::Scratch>> = const { std::cell::RefCell::new(None) };
}

/// One task as a vectorised computation.
struct TaskOp<'a, T> {
    ctx: &'a Ctx<'a, T>,
    outs: &'a Outs<T>,
    task: &'a Task,
}

impl<T: CpuElement> Op for TaskOp<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vector>(self) {
        let s = self.ctx.p.shape;
        let (dqk, dv) = (s.head_dim_qk, s.head_dim_v);
        // A thread keeps its buffers across tasks and calls (fresh ones
        // cost page faults that measured 5% of a call).
        let mut ws = SCRATCH
            .with(|c| c.borrow_mut().take())
            .filter(|w| w.fits(dqk, dv))
            .unwrap_or_else(|| task::Scratch::new(dqk, dv));
        V::backward_task(self.ctx, self.outs, self.task, &mut ws);
        SCRATCH.with(|c| *c.borrow_mut() = Some(ws));
    }
}

fn typed_mut<'a, T: CpuElement>(d: &'a mut HostData, name: &'static str) -> Result<&'a mut [T]> {
    let got = d.dtype();
    T::host_mut(d).ok_or(AttnError::DType {
        tensor: name,
        expected: T::DTYPE.to_string(),
        got,
    })
}

fn f32_mut<'a>(d: &'a mut HostData, name: &'static str) -> Result<&'a mut [f32]> {
    typed_mut::<f32>(d, name)
}

fn backward_typed<T: CpuElement>(
    (par, isa): (bool, Isa),
    p: &Problem,
    inputs: Inputs<'_, HostData>,
    fwd: GradInputs<'_, HostData>,
    grads: GradOutputs<'_, HostData>,
) -> Result<()> {
    let s = p.shape;
    let out = typed::<T>(fwd.out, "out")?;
    let d_out = typed::<T>(fwd.d_out, "d_out")?;
    let lse = typed::<f32>(fwd.lse.expect("checked"), "lse")?;
    // D = rowsum(dO * O), f32.
    let mut d = vec![0.0f32; s.batch * s.q_heads * s.q_len];
    let d_rows = |(bh, rows): (usize, &mut [f32])| {
        vectorize(
            isa,
            rows::DRows {
                p,
                out,
                d_out,
                bh,
                rows,
            },
        )
    };
    if s.q_len > 0 {
        if par {
            d.par_chunks_mut(s.q_len).enumerate().for_each(d_rows);
        } else {
            d.chunks_mut(s.q_len).enumerate().for_each(d_rows);
        }
    }
    let mask = match (inputs.mask, &p.mask) {
        (Some(HostData::Bool(m)), Some(v)) => Some((m.as_slice(), *v)),
        _ => None,
    };
    let ctx = Ctx {
        p,
        q: typed::<T>(inputs.q, "q")?,
        k: typed::<T>(inputs.k, "k")?,
        v: typed::<T>(inputs.v, "v")?,
        d_out,
        lse,
        d: &d,
        bias: inputs.bias.zip(p.bias.map(|b| b.view)),
        mask,
        dot16: cfg!(target_arch = "x86_64") && isa >= Isa::Avx512Bf16 && T::DTYPE == DType::Bf16,
    };
    let plan = Plan::of(p, ctx.dot16);
    let tasks = plan.tasks(p);
    let group = s.group();
    let dqkp = round_up(s.head_dim_qk, LANES);
    let units = s.batch * s.kv_heads;
    let mut parts = parts_buffer(units * plan.chunks * group * plan.rows * dqkp);
    // The bias gradient: straight into dbias when it has a slice per batch
    // entry and head, else into a scratch per (batch, head or K/V head).
    let bias_dims = p.bias.map(|b| b.view.dims);
    let (dbias_out, dsinks_out) = (grads.dbias, grads.dsinks);
    let direct = bias_dims.is_some_and(|d| d[0] == s.batch && d[1] == s.q_heads);
    let dbias_heads = match bias_dims {
        Some(d) if d[1] == s.q_heads => s.q_heads,
        _ => s.kv_heads,
    };
    let mut scratch = Vec::new();
    let mut dbias_slice: Option<&mut [f32]> = match dbias_out {
        Some(buf) => Some(f32_mut(buf, "dbias")?),
        None => None,
    };
    let dbias_ptr = match dbias_slice.as_deref_mut() {
        Some(db) if direct => {
            db.iter_mut().for_each(|x| *x = 0.0);
            (db.as_mut_ptr(), db.len())
        }
        Some(_) => {
            scratch = vec![0.0f32; s.batch * dbias_heads * s.q_len * s.kv_len];
            (scratch.as_mut_ptr(), scratch.len())
        }
        None => (std::ptr::null_mut(), 0),
    };
    let dq = typed_mut::<T>(grads.dq, "dq")?;
    let dk = typed_mut::<T>(grads.dk, "dk")?;
    let dv = typed_mut::<T>(grads.dv, "dv")?;
    let outs = Outs {
        dk: dk.as_mut_ptr(),
        dk_len: dk.len(),
        dv: dv.as_mut_ptr(),
        dv_len: dv.len(),
        parts: parts.as_mut_ptr(),
        parts_len: parts.len(),
        dbias: dbias_ptr.0,
        dbias_len: dbias_ptr.1,
        dbias_heads,
        layout: (plan.chunks, plan.rows, dqkp, group),
        sizes: (s.q_heads, s.q_len, s.kv_len, group),
    };
    let run = |t: &Task| {
        vectorize(
            isa,
            TaskOp {
                ctx: &ctx,
                outs: &outs,
                task: t,
            },
        )
    };
    if par {
        tasks.par_iter().for_each(run);
    } else {
        tasks.iter().for_each(run);
    }
    // dQ: the chunks' partial rows, added in chunk order, one (batch,
    // head) per parallel step.
    let dq_out = rows::SharedRows::new(dq);
    let reduce = |bh: usize| {
        vectorize(
            isa,
            rows::DqRows {
                p,
                plan: &plan,
                parts: &parts,
                dq: &dq_out,
                bh,
            },
        )
    };
    if par {
        (0..s.batch * s.q_heads).into_par_iter().for_each(reduce);
    } else {
        (0..s.batch * s.q_heads).for_each(reduce);
    }
    keep_parts(parts);
    if let (Some(db), false) = (dbias_slice, direct) {
        reduce_dbias(p, &scratch, dbias_heads, db);
    }
    if let Some(buf) = dsinks_out {
        let ds = f32_mut(buf, "dsinks")?;
        sinks_grad(p, lse, &d, ds);
    }
    Ok(())
}

/// Sums the bias scratch (`[batch, heads, q_len, kv_len]`, `heads` query or
/// K/V heads) over the axes the bias broadcasts, in index order.
fn reduce_dbias(p: &Problem, scratch: &[f32], heads: usize, db: &mut [f32]) {
    let s = p.shape;
    let dims = p.bias.expect("a bias").view.dims;
    let plane = s.q_len * s.kv_len;
    db.iter_mut().for_each(|x| *x = 0.0);
    for bb in 0..dims[0] {
        for bh in 0..dims[1] {
            let dst = &mut db[(bb * dims[1] + bh) * plane..][..plane];
            let batches = if dims[0] == 1 { 0..s.batch } else { bb..bb + 1 };
            for b in batches {
                let hs = if dims[1] == 1 { 0..heads } else { bh..bh + 1 };
                for h in hs {
                    let src = &scratch[(b * heads + h) * plane..][..plane];
                    dst.iter_mut().zip(src).for_each(|(x, &y)| *x += y);
                }
            }
        }
    }
}

/// `dsink_h = -sum_{b, i} exp(sink_h - lse_i) D_i`, accumulated in f64.
fn sinks_grad(p: &Problem, lse: &[f32], d: &[f32], out: &mut [f32]) {
    let s = p.shape;
    let sinks = p.options.sinks.as_ref().expect("validated");
    for (h, o) in out.iter_mut().enumerate().take(s.q_heads) {
        let mut acc = 0.0f64;
        for b in 0..s.batch {
            for i in 0..p.seq_lens(b).0 {
                let at = (b * s.q_heads + h) * s.q_len + i;
                let l = f64::from(lse[at]);
                if l != f64::NEG_INFINITY {
                    acc -= (f64::from(sinks[h]) - l).exp() * f64::from(d[at]);
                }
            }
        }
        *o = acc as f32;
    }
}

impl Backward for Cpu {
    fn backward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        forward: GradInputs<'_, HostData>,
        grads: GradOutputs<'_, HostData>,
    ) -> Result<()> {
        check_backward_call(self, problem, &inputs, &forward, &grads)?;
        let par = self.parallel(2.5 * problem.flops());
        let run = (par, self.isa()?);
        self.install(par, || match problem.dtype {
            attn_spec::DType::F32 => backward_typed::<f32>(run, problem, inputs, forward, grads),
            attn_spec::DType::F16 => {
                backward_typed::<attn_spec::f16>(run, problem, inputs, forward, grads)
            }
            attn_spec::DType::Bf16 => {
                backward_typed::<attn_spec::bf16>(run, problem, inputs, forward, grads)
            }
            _ => unreachable!("refused by supports()"),
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::Cpu;

    /// Key blocks of 96 keys, but 48 where f32 products meet a causal or
    /// sliding window's diagonal; bf16 on pairs keeps 96 unless its
    /// panels do not fit (its products then run in f32).
    #[test]
    fn plans_choose_the_key_block() {
        use attn_spec::{AttnOptions, Problem};
        let keys = |shape: Shape, mask: MaskKind, dot16: bool| {
            let options = AttnOptions {
                mask,
                ..AttnOptions::default()
            };
            let p = Problem::new(shape, DType::Bf16).with_options(options);
            super::Plan::of(&p, dot16).keys
        };
        let (small, huge) = (
            Shape::new(1, 2, 1, 300, 300, 64),
            Shape::new(1, 8, 1, 20000, 300, 128),
        );
        let window = MaskKind::Window {
            left: Some(10),
            right: Some(0),
        };
        for (shape, mask, dot16, want) in [
            (small, MaskKind::None, false, 96),
            (small, MaskKind::None, true, 96),
            (small, MaskKind::Causal, true, 96),
            (small, MaskKind::Causal, false, 48),
            (small, window, false, 48),
            (huge, MaskKind::Causal, true, 48),
            (huge, MaskKind::None, true, 96),
        ] {
            assert_eq!(keys(shape, mask, dot16), want, "{shape:?} {mask:?} {dot16}");
        }
    }
    use attn_conformance::backward::BackCase;
    use attn_conformance::case::Bcast;
    use attn_conformance::CaseParams;
    use attn_spec::{Backward, DType, GradRequest, MaskKind, Shape};
    use std::sync::atomic::Ordering;

    /// Packing Q and dO per tile (problems too large for the panels) gives
    /// the same gradients, bit for bit, as the panels: the same f32 rows
    /// enter the same products. (On levels up to avx512: avx512bf16 runs
    /// the products of bf16 panels on bf16 pairs, which per-tile packing
    /// does not, so there the two differ by roundings.)
    #[test]
    fn tile_packing_equals_the_panels() {
        let isa = crate::Isa::detected().min(crate::Isa::Avx512);
        let shapes = [
            (
                Shape::new(1, 4, 2, 200, 150, 40).with_head_dim_v(24),
                DType::F32,
            ),
            (Shape::new(2, 2, 1, 97, 130, 64), DType::Bf16),
        ];
        for (n, (shape, dtype)) in shapes.into_iter().enumerate() {
            let mut params = CaseParams::plain(shape);
            params.dtype = dtype;
            params.bhsd = n == 1;
            params.options.mask = MaskKind::Causal;
            params.sinks = true;
            params.bias = Some(Bcast {
                per_batch: true,
                per_head: false,
            });
            params.seed = 40 + n as u64;
            let bc = BackCase::build(params);
            let p = &bc.case.problem;
            let run = |no_panel: bool| {
                super::task::tests::NO_PANEL.store(no_panel, Ordering::Relaxed);
                let g = Cpu::with_threads(1)
                    .unwrap()
                    .with_isa(isa)
                    .unwrap()
                    .backward(p, bc.case.inputs(), bc.forward(), GradRequest::all(p))
                    .unwrap();
                super::task::tests::NO_PANEL.store(false, Ordering::Relaxed);
                (g.dq, g.dk, g.dv, g.dbias, g.dsinks)
            };
            assert!(run(true) == run(false), "case {n}");
            let r = attn_conformance::backward::check_backward(&Cpu::new(), &bc);
            assert_eq!(r, Ok(attn_conformance::Outcome::Passed));
        }
    }

    /// Chunks are contiguous, cover every block once, hold at least one
    /// block each, and split causal work (rows seeing key j: S - j) about
    /// evenly: the first chunk gets fewer blocks.
    #[test]
    fn cuts_balance_the_work() {
        let causal: Vec<u64> = (0..43u64).map(|k| 2048 - 48 * k).collect();
        for chunks in [1usize, 2, 3, 16, 43] {
            let c = super::cuts(&causal, chunks);
            assert_eq!((c[0], c[chunks], c.len()), (0, 43, chunks + 1));
            assert!(c.windows(2).all(|w| w[0] < w[1]), "{chunks}: {c:?}");
            let total: u64 = causal.iter().sum();
            if chunks <= 3 {
                for w in c.windows(2) {
                    let part: u64 = causal[w[0]..w[1]].iter().sum();
                    let share = part as f64 / total as f64 * chunks as f64;
                    assert!((share - 1.0).abs() < 0.1, "{chunks}: {c:?} {share}");
                }
            }
        }
        assert!(super::cuts(&causal, 2)[1] < 43 / 2);
        // No work at all: still one block or more per chunk.
        let c = super::cuts(&[0; 5], 5);
        assert_eq!(c, vec![0, 1, 2, 3, 4, 5]);
    }
}
