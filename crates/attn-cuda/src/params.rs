//! Host logic of a launch, all of it testable without a GPU: the kernel
//! parameter block (mirrored by `struct Params` in kernels/common.cuh), the
//! split-KV plan, and the launch geometry.

use crate::variant::{Kernel, Variant};
use attn_spec::{AttnError, MaskKind, Problem, Result, View};

/// The kernels' parameter block, passed by value. Field order and types
/// match `struct Params` in `kernels/common.cuh` exactly (`repr(C)`,
/// pointers as 64-bit device addresses); `params_layout_matches_the_cuda_struct`
/// checks the offsets the C side assumes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Params {
    /// Q.
    pub q: u64,
    /// K.
    pub k: u64,
    /// V.
    pub v: u64,
    /// O.
    pub o: u64,
    /// Log-sum-exp, `[b, hq, sq]` f32, or 0.
    pub lse: u64,
    /// Bias, or 0.
    pub bias: u64,
    /// Boolean mask (u8), or 0.
    pub mask: u64,
    /// Per-sequence query lengths (i32), or 0.
    pub q_lens: u64,
    /// Per-sequence key lengths (i32), or 0.
    pub kv_lens: u64,
    /// ALiBi slopes (f32), or 0.
    pub alibi: u64,
    /// Sink logits (f32), or 0.
    pub sinks: u64,
    /// Split-KV partial outputs (f32), or 0.
    pub part_o: u64,
    /// Split-KV partial log-sum-exps (f32), or 0.
    pub part_lse: u64,
    /// Strides of Q (batch, seq, head, dim), in elements.
    pub q_st: [i64; 4],
    /// Strides of K.
    pub k_st: [i64; 4],
    /// Strides of V.
    pub v_st: [i64; 4],
    /// Strides of O.
    pub o_st: [i64; 4],
    /// Strides of the bias (batch, head, query, key); 0 on broadcast axes.
    pub bias_st: [i64; 4],
    /// Strides of the mask, as the bias.
    pub mask_st: [i64; 4],
    /// Offset of Q's view.
    pub q_off: i64,
    /// Offset of K's view.
    pub k_off: i64,
    /// Offset of V's view.
    pub v_off: i64,
    /// Offset of O's view.
    pub o_off: i64,
    /// Offset of the bias view.
    pub bias_off: i64,
    /// Offset of the mask view.
    pub mask_off: i64,
    /// Batch.
    pub batch: i32,
    /// Query heads.
    pub hq: i32,
    /// Key/value heads.
    pub hkv: i32,
    /// Query rows.
    pub sq: i32,
    /// Keys.
    pub sk: i32,
    /// Window: keys left of the diagonal (-1 unbounded).
    pub left: i32,
    /// Window: keys right of the diagonal (-1 unbounded).
    pub right: i32,
    /// 1 for top-left alignment.
    pub top_left: i32,
    /// Split-KV splits (1: no split).
    pub num_splits: i32,
    /// Keys per split.
    pub keys_per_split: i32,
    /// Score scale.
    pub scale: f32,
    /// Soft-cap (unused when the variant has none).
    pub softcap: f32,
    /// 1 when K and V may be read 16 bytes at a time: unit stride along the
    /// head dim, every other stride and the offsets multiples of 8
    /// elements (device allocations are 256-byte aligned).
    pub kv_vec: i32,
    /// 1, or the GQA group that each block's rows pack (`mma.cu`; see
    /// [`crate::plan::ForwardPlan`]): the grid's y axis is then over K/V
    /// heads.
    pub pack: i32,
}

// SAFETY: `Params` is `repr(C)` plain data (integers and floats, no
// references); the kernel reads it by value with the same layout.
unsafe impl cudarc::driver::DeviceRepr for Params {}

fn i32_of(what: &'static str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| AttnError::Unsupported {
        backend: "cuda".into(),
        feature: format!("{what} = {x}"),
        reason: "the kernels index sequences and heads with 32-bit integers".into(),
    })
}

fn strides(v: &View) -> [i64; 4] {
    // Broadcast axes (size 1) read element 0 whatever their stride.
    std::array::from_fn(|a| {
        if v.dims[a] == 1 {
            0
        } else {
            v.strides[a] as i64
        }
    })
}

/// Whether `v`'s rows are runs of 8-element (16-byte, for 16-bit types)
/// aligned chunks: unit stride along the head dim, every other stride and
/// the offset multiples of 8.
fn vec8(v: &View) -> bool {
    let s = strides(v);
    v.strides[3] == 1 && v.offset.is_multiple_of(8) && s[..3].iter().all(|x| x % 8 == 0)
}

/// Minimum keys a split should own: below this the combine pass and the
/// per-split start-up cost more than the parallelism gained.
pub const MIN_KEYS_PER_SPLIT: usize = 256;
/// Most splits of one row.
pub const MAX_SPLITS: usize = 64;

/// A block's fixed cost in [`plan_splits`]'s model, in key tiles: loading
/// its query rows, finishing the softmax and writing its partial output
/// and log-sum-exp for the combine pass. An estimate (about what reading
/// two tiles of K and V costs) until a GPU profile measures it.
pub const SPLIT_OVERHEAD_TILES: usize = 2;

/// How many key splits a launch of `blocks` blocks (query blocks x heads x
/// batch) over `kv_len` keys should use on a GPU that runs `slots` of
/// these blocks at once (multiprocessors x the kernel's resident blocks
/// per multiprocessor, from the occupancy API), and the keys per split (a
/// multiple of `block_n`). Splitting pays only when the blocks alone
/// leave slots idle (decoding: few query rows, long keys); then the split
/// count is the one whose launch finishes first counting whole waves:
/// `waves(s) x (key tiles per split(s) + SPLIT_OVERHEAD_TILES)`, where
/// `waves(s) = ceil(blocks x s / slots)`: a count one past a full wave
/// would leave most of the GPU idle through a second wave, and many short
/// splits pay each block's fixed cost many times. Ties go to fewer splits
/// (less for the combine pass to merge). Each split owns at least
/// [`MIN_KEYS_PER_SPLIT`] keys, at most [`MAX_SPLITS`] splits. Pure: depends
/// on sizes only.
pub fn plan_splits(blocks: usize, kv_len: usize, slots: usize, block_n: usize) -> (usize, usize) {
    let (slots, block_n) = (slots.max(1), block_n.max(1));
    let most = (kv_len / MIN_KEYS_PER_SPLIT).min(MAX_SPLITS);
    if blocks >= slots || most < 2 {
        return (1, kv_len.max(1));
    }
    let per = |s: usize| kv_len.div_ceil(s).div_ceil(block_n) * block_n;
    let cost = |s: usize| (blocks * s).div_ceil(slots) * (per(s) / block_n + SPLIT_OVERHEAD_TILES);
    let best = (1..=most).min_by_key(|&s| (cost(s), s)).expect("most >= 2");
    let per = per(best);
    (kv_len.div_ceil(per), per)
}

/// The backward kernels' parameter block (`struct BwdParams` in
/// `kernels/bwd.cu`): the forward's [`Params`] (whose `o` is the forward
/// output the backward reads), then the backward's own tensors.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BwdParams {
    /// The forward's problem.
    pub p: Params,
    /// dO, laid out as O.
    pub d_out: u64,
    /// dQ, laid out as Q.
    pub dq: u64,
    /// dK, laid out as K.
    pub dk: u64,
    /// dV, laid out as V.
    pub dv: u64,
    /// `D = dO . O`, `[b, hq, sq]` f32 scratch.
    pub d_rows: u64,
    /// The bias gradient (f32), or 0.
    pub dbias: u64,
    /// The sinks' gradient (f32 `[hq]`), or 0.
    pub dsinks: u64,
    /// Strides of the bias gradient (batch, head, query, key).
    pub dbias_st: [i64; 4],
}

// SAFETY: as `Params`: `repr(C)` plain data read by value.
unsafe impl cudarc::driver::DeviceRepr for BwdParams {}

/// The maps kernel's parameter block (`struct MapsParams` in
/// `kernels/maps.cu`): the forward's [`Params`] (whose `lse` is read),
/// then the selection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MapsParams {
    /// The forward's problem.
    pub p: Params,
    /// The maps (f32 `[n_batches][n_heads or 1][n_rows][sk]`).
    pub maps: u64,
    /// The selected batch entries (i32 `[n_batches]`).
    pub batches: u64,
    /// The selected query heads (i32 `[n_heads]`).
    pub heads: u64,
    /// Selected batch entries.
    pub n_batches: i32,
    /// Selected heads.
    pub n_heads: i32,
    /// First query row.
    pub row0: i32,
    /// Query rows.
    pub n_rows: i32,
    /// 1: the heads are averaged.
    pub averaged: i32,
    /// Padding to 8 bytes.
    pub pad: i32,
}

// SAFETY: as `Params`: `repr(C)` plain data read by value.
unsafe impl cudarc::driver::DeviceRepr for MapsParams {}

/// The parameter block of `attn_linear` (`struct LinParams` in
/// kernels/linear.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinParams {
    /// x `[rows, in]`.
    pub x: u64,
    /// W `[out, in]`.
    pub w: u64,
    /// b `[out]`, or 0.
    pub b: u64,
    /// y `[rows, out]`.
    pub y: u64,
    /// Rows of x and y.
    pub rows: i32,
    /// Input features.
    pub in_f: i32,
    /// Output features.
    pub out_f: i32,
    /// Padding to 8 bytes.
    pub pad: i32,
}

// SAFETY: plain `repr(C)` data with the layout of `struct LinParams`.
unsafe impl cudarc::driver::DeviceRepr for LinParams {}

impl Params {
    /// The sizes, strides and options of `p` (device addresses left 0),
    /// for `splits` splits of `keys_per_split` keys.
    pub fn new(p: &Problem, splits: usize, keys_per_split: usize) -> Result<Params> {
        let s = p.shape;
        let o = &p.options;
        let (left, right) = match o.mask {
            MaskKind::None => (None, None),
            k => k.window(),
        };
        let win = |x: Option<usize>| -> Result<i32> {
            match x {
                None => Ok(-1),
                Some(n) => Ok(i32_of("window size", n.min(i32::MAX as usize - 1))?),
            }
        };
        let off = |v: &View| v.offset as i64;
        Ok(Params {
            q_st: strides(&p.q),
            k_st: strides(&p.k),
            v_st: strides(&p.v),
            o_st: p.out.strides.map(|x| x as i64),
            bias_st: p.bias.map_or([0; 4], |b| strides(&b.view)),
            mask_st: p.mask.map_or([0; 4], |m| strides(&m)),
            q_off: off(&p.q),
            k_off: off(&p.k),
            v_off: off(&p.v),
            o_off: off(&p.out),
            bias_off: p.bias.map_or(0, |b| off(&b.view)),
            mask_off: p.mask.map_or(0, |m| off(&m)),
            batch: i32_of("batch", s.batch)?,
            hq: i32_of("q_heads", s.q_heads)?,
            hkv: i32_of("kv_heads", s.kv_heads)?,
            sq: i32_of("q_len", s.q_len)?,
            sk: i32_of("kv_len", s.kv_len)?,
            left: win(left)?,
            right: win(right)?,
            top_left: i32::from(o.alignment == attn_spec::Alignment::TopLeft),
            num_splits: i32_of("splits", splits)?,
            keys_per_split: i32_of("keys per split", keys_per_split)?,
            scale: p.scale(),
            softcap: o.softcap.unwrap_or(0.0),
            kv_vec: i32::from(p.dtype.size_bytes() == 2 && vec8(&p.k) && vec8(&p.v)),
            pack: 1,
            ..Params::default()
        })
    }

    /// Sets K's and V's device addresses. The views' offsets and strides
    /// allow 16-byte copies only from 16-byte aligned buffers, which this
    /// backend's allocations are but a borrowed slice
    /// (`Cuda::forward_slices`) need not be: `kv_vec` is cleared unless
    /// both addresses are.
    pub fn set_kv(&mut self, k: u64, v: u64) {
        self.k = k;
        self.v = v;
        if !(k | v).is_multiple_of(16) {
            self.kv_vec = 0;
        }
    }
}

/// Grid and block of a forward kernel: x over query blocks, y over query
/// heads, z over batch x splits; with `pack` > 1 (the GQA group packed
/// into each block's rows, [`Params::pack`]), x over blocks of packed
/// (query, head) rows and y over K/V heads.
pub fn forward_geometry(
    v: &Variant,
    p: &Problem,
    splits: usize,
    pack: usize,
) -> ((u32, u32, u32), u32) {
    let s = p.shape;
    let rows = v.rows_per_block();
    let pack = pack.max(1);
    let grid = (
        (s.q_len * pack).div_ceil(rows).max(1) as u32,
        (s.q_heads / pack) as u32,
        (s.batch * splits) as u32,
    );
    (grid, v.kernel.threads())
}

/// Grid of the combine kernel: one warp per row.
pub fn combine_geometry(p: &Problem) -> ((u32, u32, u32), u32) {
    let s = p.shape;
    let k = Kernel::Combine;
    (
        (
            s.q_len.div_ceil(k.rows_per_block()).max(1) as u32,
            s.q_heads as u32,
            s.batch as u32,
        ),
        k.threads(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_spec::{AttnOptions, DType, Shape};
    use std::mem::{offset_of, size_of};

    /// The offsets `struct Params` has under the C rules (8-byte pointers
    /// and i64s first, then 4-byte ints and floats).
    #[test]
    fn params_layout_matches_the_cuda_struct() {
        assert_eq!(offset_of!(Params, part_lse), 12 * 8);
        assert_eq!(offset_of!(Params, q_st), 13 * 8);
        assert_eq!(offset_of!(Params, mask_st), 13 * 8 + 5 * 32);
        assert_eq!(offset_of!(Params, q_off), 13 * 8 + 6 * 32);
        assert_eq!(offset_of!(Params, batch), 13 * 8 + 6 * 32 + 6 * 8);
        assert_eq!(offset_of!(Params, scale), 13 * 8 + 6 * 32 + 6 * 8 + 10 * 4);
        assert_eq!(size_of::<Params>(), 400);
        // The C side declares the same fields in the same order.
        let c = include_str!("kernels/common.cuh");
        let start = c.find("struct Params {").unwrap();
        let body = &c[start..start + c[start..].find("};").unwrap()];
        let mut c_names = Vec::new();
        for line in body.lines().skip(1) {
            let code = line.split("//").next().unwrap_or("");
            for decl in code.split(';').filter(|d| !d.trim().is_empty()) {
                for (n, declarator) in decl.split(',').enumerate() {
                    let name = if n == 0 {
                        declarator.split_whitespace().last().unwrap_or("")
                    } else {
                        declarator.trim()
                    };
                    let name = name.trim_start_matches('*');
                    c_names.push(name.split('[').next().unwrap_or("").to_string());
                }
            }
        }
        let rust = [
            "q",
            "k",
            "v",
            "o",
            "lse",
            "bias",
            "mask",
            "q_lens",
            "kv_lens",
            "alibi",
            "sinks",
            "part_o",
            "part_lse",
            "q_st",
            "k_st",
            "v_st",
            "o_st",
            "bias_st",
            "mask_st",
            "q_off",
            "k_off",
            "v_off",
            "o_off",
            "bias_off",
            "mask_off",
            "batch",
            "hq",
            "hkv",
            "sq",
            "sk",
            "left",
            "right",
            "top_left",
            "num_splits",
            "keys_per_split",
            "scale",
            "softcap",
            "kv_vec",
            "pack",
        ];
        assert_eq!(c_names, rust);
    }

    /// `struct BwdParams` in bwd.cu: `Params` (400 bytes, 8-aligned), seven
    /// pointers, four i64 strides, in this order.
    #[test]
    fn bwd_params_layout_matches_the_cuda_struct() {
        assert_eq!(offset_of!(BwdParams, d_out), 400);
        assert_eq!(offset_of!(BwdParams, dsinks), 400 + 6 * 8);
        assert_eq!(offset_of!(BwdParams, dbias_st), 400 + 7 * 8);
        assert_eq!(size_of::<BwdParams>(), 400 + 7 * 8 + 32);
        let c = include_str!("kernels/bwd.cu");
        let start = c.find("struct BwdParams {").unwrap();
        let body = &c[start..start + c[start..].find("};").unwrap()];
        let names: Vec<&str> = body
            .lines()
            .skip(1)
            .filter_map(|l| l.split("//").next())
            .filter_map(|l| l.trim().strip_suffix(';'))
            .map(|d| {
                let n = d.split_whitespace().last().unwrap_or("");
                let n = n.trim_start_matches('*');
                n.split('[').next().unwrap_or("")
            })
            .collect();
        assert_eq!(
            names,
            ["p", "d_out", "dq", "dk", "dv", "d_rows", "dbias", "dsinks", "dbias_st"]
        );
    }

    #[test]
    fn splits_only_when_the_blocks_cannot_fill_the_gpu() {
        // 132 SMs with two resident blocks each: 264 slots.
        let slots = 2 * 132;
        // Prefill: 64 query blocks x 32 heads fill the GPU: no split.
        assert_eq!(plan_splits(64 * 32, 4096, slots, 64), (1, 4096));
        // Decode, 32 heads x batch 1, 32k keys: 8 splits of 4096 keys,
        // 256 blocks in one wave (9 splits, 288 blocks, would run a second
        // wave of 24 blocks on a nearly idle GPU).
        let (n, per) = plan_splits(32, 32768, slots, 64);
        assert_eq!((n, per), (8, 4096));
        assert!(n * per >= 32768 && (n - 1) * per < 32768 && per % 64 == 0);
        // One resident block per SM: half the splits.
        assert_eq!(plan_splits(32, 32768, 132, 64), (4, 8192));
        // Keys that do not divide evenly: splits cover them, block-aligned.
        let (n, per) = plan_splits(40, 10_000, slots, 64);
        assert!(n * per >= 10_000 && (n - 1) * per < 10_000 && per % 64 == 0);
        assert!(
            40 * n <= slots,
            "{n} splits of 40 blocks: more than one wave"
        );
        // Short keys never split below the minimum.
        assert_eq!(plan_splits(1, 300, slots, 64), (1, 300));
        let (n, per) = plan_splits(1, 1024, slots, 64);
        assert_eq!((n, per), (4, 256));
        // Never more than MAX_SPLITS.
        assert!(plan_splits(1, 1 << 24, slots, 64).0 <= MAX_SPLITS);
        // Zero keys: one split.
        assert_eq!(plan_splits(1, 0, slots, 64), (1, 1));
    }

    #[test]
    fn params_carry_windows_alignment_and_broadcast() {
        let shape = Shape::new(2, 4, 2, 5, 9, 8);
        let p = Problem::new(shape, DType::F16)
            .with_options(AttnOptions::default().causal().top_left())
            .with_bias(View::contiguous([1, 4, 5, 9]), DType::F32);
        let k = Params::new(&p, 3, 64).unwrap();
        assert_eq!((k.left, k.right, k.top_left), (-1, 0, 1));
        assert_eq!(k.bias_st, [0, 45, 9, 1]);
        assert_eq!((k.num_splits, k.keys_per_split), (3, 64));
        assert_eq!(k.q_st, [5 * 4 * 8, 4 * 8, 8, 1]);
        assert_eq!(k.scale, 1.0 / 8f32.sqrt());
        assert_eq!(k.kv_vec, 1, "contiguous f16 rows of 8 elements");
        let mut at = k;
        at.set_kv(256, 512);
        assert_eq!((at.k, at.v, at.kv_vec), (256, 512, 1));
        at.set_kv(256, 520);
        assert_eq!(
            (at.k, at.v, at.kv_vec),
            (256, 520, 0),
            "V at 8 bytes past 16"
        );
        let mut odd = p.clone();
        odd.k.offset = 3;
        assert_eq!(Params::new(&odd, 1, 9).unwrap().kv_vec, 0, "offset 3");
        let f32p = Problem::new(shape, DType::F32);
        assert_eq!(
            Params::new(&f32p, 1, 9).unwrap().kv_vec,
            0,
            "4-byte elements"
        );
        let bhsd = Problem::new(shape, DType::Bf16).bhsd();
        assert_eq!(Params::new(&bhsd, 1, 9).unwrap().kv_vec, 1);
        let d12 = Problem::new(Shape::new(1, 2, 2, 3, 4, 12), DType::Bf16);
        assert_eq!(Params::new(&d12, 1, 9).unwrap().kv_vec, 0, "rows of 12");
        let w = Problem::new(shape, DType::F16)
            .with_options(AttnOptions::default().window(Some(3), None));
        let k = Params::new(&w, 1, 9).unwrap();
        assert_eq!((k.left, k.right, k.top_left), (3, -1, 0));
        let none = Params::new(&Problem::new(shape, DType::F16), 1, 9).unwrap();
        assert_eq!((none.left, none.right), (-1, -1));
    }

    #[test]
    fn geometry() {
        let p = Problem::new(Shape::new(3, 8, 2, 130, 1000, 64), DType::Bf16);
        let v = Variant::for_problem(Kernel::Mma, &p, (9, 0));
        assert_eq!(forward_geometry(&v, &p, 5, 1), ((3, 8, 15), 128));
        // Packed: 130 queries x 4 heads = 520 rows in 9 blocks of 64, per
        // K/V head.
        assert_eq!(forward_geometry(&v, &p, 5, 4), ((9, 2, 15), 128));
        let s = Variant::for_problem(Kernel::Simt, &p, (9, 0));
        assert_eq!(forward_geometry(&s, &p, 1, 1), ((17, 8, 3), 256));
        assert_eq!(combine_geometry(&p), ((33, 8, 3), 128));
    }
}
