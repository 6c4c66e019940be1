//! What a forward call launches, decided from the problem and the GPU's
//! figures alone: the kernel, whether the problem is supported, the split
//! count, the parameter block and the launch geometry. Shared by the GPU
//! backend ([`crate::Cuda`]) and the CPU emulator ([`crate::emu`]), so the
//! emulator runs the host logic the GPU runs, not a copy of it.

use crate::bytes::i32_bytes;
use crate::params::{
    combine_geometry, forward_geometry, plan_splits, LinParams, MapsParams, Params,
};
use crate::variant::{Kernel, Variant, MAX_HEAD_DIM};
use attn_spec::{AttnError, AttnOptions, DType, MapLayout, Problem, Result};

/// Which forward kernel a backend runs on f16/bf16 inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfKernel {
    /// Tensor cores (`mma.sync`): the fast path.
    TensorCore,
    /// Tensor cores with the opt-in `FAST` softmax and fragment handling
    /// ([`Kernel::MmaFast`]), until it has passed the conformance suite on
    /// a GPU.
    TensorCoreFast,
    /// Plain FMA, f32 throughout (f32 inputs always take it).
    Simt,
}

/// Which block shapes of the tensor-core kernels a backend may launch
/// where a problem suits them (`Variant::for_problem`); both by default.
/// Results agree within the conformance bound either way; `gpu_bench`
/// times each shape against the plain 64-row blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shapes {
    /// The decode shape ([`Variant::key_split`]).
    pub key_split: bool,
    /// The fast kernel's 128-row prefill shape ([`Variant::wide`]).
    pub wide: bool,
}

impl Default for Shapes {
    fn default() -> Self {
        Shapes {
            key_split: true,
            wide: true,
        }
    }
}

/// The forward variant a backend running `half` launches for `p`: the
/// tensor-core kernel `half` names for f16/bf16 where its shared memory
/// fits the GPU's `smem_optin` bytes per block, else the FMA kernel; in
/// the decode key-split shape (`Variant::key_split`) and the wide prefill
/// shape (`Variant::wide`) only where `shapes` allows them.
pub fn forward_variant(
    half: HalfKernel,
    shapes: Shapes,
    p: &Problem,
    arch: (u32, u32),
    smem_optin: usize,
) -> Variant {
    let variant = |kernel| {
        let mut v = Variant::for_problem(kernel, p, arch);
        v.key_split &= shapes.key_split;
        v.wide &= shapes.wide;
        v
    };
    let tc = match half {
        HalfKernel::TensorCore => Kernel::Mma,
        HalfKernel::TensorCoreFast => Kernel::MmaFast,
        HalfKernel::Simt => Kernel::Simt,
    };
    match p.dtype {
        DType::F16 | DType::Bf16
            if tc != Kernel::Simt && variant(tc).smem_bytes() <= smem_optin =>
        {
            variant(tc)
        }
        _ => variant(Kernel::Simt),
    }
}

/// `Ok` when the kernels compute `p` with variant `v` (from
/// [`forward_variant`]) on a GPU giving a block `smem_optin` bytes of
/// shared memory, else `Unsupported` from `backend` saying what and why.
pub fn supported(backend: &str, p: &Problem, v: &Variant, smem_optin: usize) -> Result<()> {
    let unsupported = |feature: String, reason: &str| {
        Err(AttnError::Unsupported {
            backend: backend.into(),
            feature,
            reason: reason.into(),
        })
    };
    if !matches!(p.dtype, DType::F32 | DType::F16 | DType::Bf16) {
        return unsupported(
            format!("{} inputs", p.dtype),
            "the GPU kernels take f32, f16 and bf16",
        );
    }
    if let Some(b) = p.bias {
        if !matches!(b.dtype, DType::F32 | DType::F16 | DType::Bf16) {
            return unsupported(format!("a {} bias", b.dtype), "biases are f32, f16 or bf16");
        }
    }
    let s = p.shape;
    if s.head_dim_qk > MAX_HEAD_DIM || s.head_dim_v > MAX_HEAD_DIM {
        return unsupported(
            format!("head dims {}/{}", s.head_dim_qk, s.head_dim_v),
            "kernels are built for head dims up to 256",
        );
    }
    if v.smem_bytes() > smem_optin {
        return unsupported(
            format!("{} bytes of shared memory", v.smem_bytes()),
            "more than this GPU gives a block",
        );
    }
    if s.q_heads > 65535 || s.batch > 65535 {
        return unsupported(
            format!("batch {} x q_heads {}", s.batch, s.q_heads),
            "the grid's y (heads) and z (batch x splits) axes hold at most 65535 blocks",
        );
    }
    Params::new(p, 1, 1).map(|_| ())
}

/// A grid and a block size.
pub type Geometry = ((u32, u32, u32), u32);

/// A grid and a block, each three-dimensional.
pub type Geometry3 = ((u32, u32, u32), (u32, u32, u32));

/// One forward call's launches: the kernel variant on its grid, then, for
/// a split-KV plan, the combine pass.
#[derive(Clone, Debug)]
pub struct ForwardPlan {
    /// The forward kernel's variant.
    pub variant: Variant,
    /// Key splits (1: no split, no combine pass).
    pub splits: usize,
    /// The parameter block, device addresses left 0.
    pub params: Params,
    /// The GQA group each block's rows pack (1: none), as in `params`.
    pub pack: usize,
    /// The forward launch.
    pub geometry: Geometry,
    /// The combine pass's variant and launch, for `splits > 1`.
    pub combine: Option<(Variant, Geometry)>,
}

impl ForwardPlan {
    /// The launches of `problem` with variant `v` on a GPU that runs
    /// `slots` of its blocks at once (multiprocessors x blocks per
    /// multiprocessor): the tensor-core kernels pack a GQA group's query
    /// heads into each block's rows when there are fewer query rows than
    /// a block holds (decoding), so the heads sharing a K/V head read each
    /// K/V tile once and fewer of a block's rows are padding; splits from
    /// [`plan_splits`] for the blocks that leaves, one split when the
    /// grid's z axis (batch x splits) would pass 65535.
    pub fn new(problem: &Problem, v: Variant, slots: usize) -> Result<Self> {
        let s = problem.shape;
        let rows = v.rows_per_block();
        let group = s.q_heads / s.kv_heads.max(1);
        let tensor_cores = matches!(v.kernel, Kernel::Mma | Kernel::MmaFast);
        let pack = if tensor_cores && group > 1 && s.q_len < rows {
            group
        } else {
            1
        };
        let blocks = (s.q_len * pack).div_ceil(rows) * (s.q_heads / pack) * s.batch;
        let (mut splits, mut per) = plan_splits(blocks, s.kv_len, slots, v.block_n());
        if s.batch * splits > 65535 {
            (splits, per) = (1, s.kv_len.max(1));
        }
        let combine = (splits > 1).then(|| {
            let cv = Variant {
                kernel: Kernel::Combine,
                key_split: false,
                wide: false,
                ..v
            };
            (cv, combine_geometry(problem))
        });
        let mut params = Params::new(problem, splits, per)?;
        params.pack = pack as i32;
        Ok(ForwardPlan {
            variant: v,
            splits,
            params,
            pack,
            geometry: forward_geometry(&v, problem, splits, pack),
            combine,
        })
    }

    /// Elements of the split workspaces, partial outputs and partial
    /// log-sum-exps (f32), for `splits > 1`.
    pub fn partials(&self, problem: &Problem) -> Option<(usize, usize)> {
        let s = problem.shape;
        let rows = s.batch * s.q_heads * s.q_len;
        (self.splits > 1).then(|| (self.splits * rows * s.head_dim_v, self.splits * rows))
    }
}

/// `Ok` when the backward kernels compute `p`'s gradients on a GPU of
/// `arch` giving a block `smem_optin` bytes (`bias_grad`: the bias
/// gradient is asked for), else `Unsupported` from `backend`.
pub fn supported_backward(
    backend: &str,
    p: &Problem,
    bias_grad: bool,
    arch: (u32, u32),
    smem_optin: usize,
) -> Result<()> {
    let s = p.shape;
    let unsupported = |feature: String, reason: &str| AttnError::Unsupported {
        backend: backend.into(),
        feature,
        reason: reason.into(),
    };
    if bias_grad {
        let d = p.bias.map(|b| b.view.dims).unwrap_or_default();
        if d[0] != s.batch || d[1] != s.q_heads {
            return Err(unsupported(
                format!("the gradient of a bias of dims {d:?}"),
                "attn-cuda writes each bias-gradient element once; an axis the bias broadcasts over would need a reduction (attn-cpu computes it)",
            ));
        }
    }
    for k in [Kernel::BwdDq, Kernel::BwdDkdv] {
        let v = Variant::for_problem(k, p, arch);
        if v.smem_bytes() > smem_optin {
            return Err(unsupported(
                format!("{} bytes of shared memory", v.smem_bytes()),
                "more than this GPU gives a block",
            ));
        }
    }
    if s.kv_heads > 65535 {
        return Err(unsupported(
            format!("kv_heads {}", s.kv_heads),
            "the grid's y axis holds at most 65535 blocks",
        ));
    }
    Ok(())
}

/// The backward pass's launches, in order: dQ (with `D = dO . O` and the
/// bias gradient) over query rows, dK and dV over keys, then the sinks'
/// gradient when asked for (`sinks_grad`). Each block has the kernel's
/// [`Kernel::threads`].
pub fn backward_launches(p: &Problem, sinks_grad: bool) -> Vec<(Kernel, (u32, u32, u32))> {
    let s = p.shape;
    let mut l = Vec::new();
    if s.q_len > 0 {
        let x = s.q_len.div_ceil(Kernel::BwdDq.rows_per_block()) as u32;
        l.push((Kernel::BwdDq, (x, s.q_heads as u32, s.batch as u32)));
    }
    if s.kv_len > 0 {
        let x = s.kv_len.div_ceil(Kernel::BwdDkdv.rows_per_block()) as u32;
        l.push((Kernel::BwdDkdv, (x, s.kv_heads as u32, s.batch as u32)));
    }
    if sinks_grad {
        l.push((Kernel::BwdSinks, (s.q_heads as u32, 1, 1)));
    }
    l
}

/// Strides of the bias gradient, contiguous `[batch, q_heads, q_len,
/// kv_len]` (the only bias gradient the kernels write).
pub fn dbias_strides(p: &Problem) -> [i64; 4] {
    let s = p.shape;
    let plane = (s.q_len * s.kv_len) as i64;
    [s.q_heads as i64 * plane, plane, s.kv_len as i64, 1]
}

/// The maps kernel's parameter block (device addresses left 0) and grid
/// for the non-empty selection `layout` of `p`, or `Unsupported` from
/// `backend` when the grid cannot hold it.
pub fn maps_launch(
    backend: &str,
    p: &Problem,
    layout: &MapLayout,
) -> Result<(MapsParams, Geometry)> {
    let [nb, planes, nr, _] = layout.dims();
    if planes > 65535 || nb > 65535 || nr.div_ceil(8) > i32::MAX as usize {
        return Err(AttnError::Unsupported {
            backend: backend.into(),
            feature: format!("maps of dims {:?}", layout.dims()),
            reason: "the grid holds at most 65535 heads and batch entries".into(),
        });
    }
    let i32_of = |x: usize| {
        i32::try_from(x).map_err(|_| AttnError::Overflow {
            what: "maps selection",
        })
    };
    let mp = MapsParams {
        p: Params::new(p, 1, p.shape.kv_len.max(1))?,
        n_batches: i32_of(nb)?,
        n_heads: i32_of(layout.heads.len())?,
        row0: i32_of(layout.rows.start)?,
        n_rows: i32_of(nr)?,
        averaged: i32::from(layout.averaged),
        ..MapsParams::default()
    };
    let rows = Kernel::Maps.rows_per_block();
    let grid = (nr.div_ceil(rows) as u32, planes as u32, nb as u32);
    Ok((mp, (grid, Kernel::Maps.threads())))
}

/// The projection kernel's parameter block (device addresses left 0),
/// grid and block for `rows` x `out_f` outputs of `dtype` from `in_f`
/// inputs, or `Unsupported` from `backend` (a dtype other than f32, f16
/// and bf16; more output features than grid y holds).
pub fn linear_launch(
    backend: &str,
    dtype: DType,
    rows: usize,
    in_f: usize,
    out_f: usize,
) -> Result<(LinParams, Geometry3)> {
    let unsupported = |feature: String, reason: &str| AttnError::Unsupported {
        backend: backend.into(),
        feature,
        reason: reason.into(),
    };
    if !matches!(dtype, DType::F32 | DType::F16 | DType::Bf16) {
        return Err(unsupported(
            format!("{dtype} projections"),
            "the GPU kernels take f32, f16 and bf16",
        ));
    }
    if out_f.div_ceil(16) > 65535 {
        return Err(unsupported(
            format!("{out_f} output features"),
            "the projection kernel puts 16 features per block on grid y (at most 65535)",
        ));
    }
    let i = |what, n: usize| i32::try_from(n).map_err(|_| AttnError::Overflow { what });
    let params = LinParams {
        rows: i("rows", rows)?,
        in_f: i("in_features", in_f)?,
        out_f: i("out_features", out_f)?,
        ..LinParams::default()
    };
    let grid = (
        rows.div_ceil(16).max(1) as u32,
        out_f.div_ceil(16).max(1) as u32,
        1,
    );
    Ok((params, (grid, (16, 16, 1))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_spec::Shape;

    fn plan(kernel: Kernel, shape: Shape) -> ForwardPlan {
        let p = Problem::new(shape, DType::Bf16);
        let v = Variant::for_problem(kernel, &p, (9, 0));
        ForwardPlan::new(&p, v, 132 * 2).unwrap()
    }

    /// The tensor-core kernels pack a GQA group's heads into a block's
    /// rows below 64 query rows; the FMA kernel, MHA and prefill do not.
    #[test]
    fn decoding_packs_the_group_into_a_block() {
        // A decode step, 32 query heads on 8 K/V heads, 32k keys: 8 blocks
        // of 4 packed rows each, in the 16-row key-split shape, then split
        // over the keys.
        let d = plan(Kernel::Mma, Shape::new(1, 32, 8, 1, 32768, 128));
        assert_eq!((d.pack, d.params.pack), (4, 4));
        assert!(d.variant.key_split && d.variant.rows_per_block() == 16);
        // A backend that turns the key split off gets 64-row blocks.
        let p = Problem::new(Shape::new(1, 32, 8, 1, 32768, 128), DType::Bf16);
        let arch = (9, 0);
        for (on, rows) in [(true, 16), (false, 64)] {
            let shapes = Shapes {
                key_split: on,
                ..Shapes::default()
            };
            let v = forward_variant(HalfKernel::TensorCore, shapes, &p, arch, 232_448);
            assert_eq!(
                (v.kernel, v.key_split, v.rows_per_block()),
                (Kernel::Mma, on, rows)
            );
        }
        let ((x, y, z), _) = d.geometry;
        assert_eq!((x, y, z), (1, 8, d.splits as u32));
        assert!(d.splits > 1 && d.combine.is_some());
        // 40 queries x 4 heads: 160 packed rows, 3 blocks per K/V head.
        let f = plan(Kernel::MmaFast, Shape::new(2, 8, 2, 40, 100, 64));
        assert_eq!((f.pack, f.geometry.0), (4, (3, 2, 2)));
        assert!(!f.variant.key_split);
        // 3 queries x 4 heads: 12 rows, one 16-row block per K/V head.
        let g = plan(Kernel::MmaFast, Shape::new(1, 8, 2, 3, 100, 64));
        assert_eq!(
            (g.pack, g.geometry.0, g.variant.key_split),
            (4, (1, 2, 1), true)
        );
        for (k, shape) in [
            (Kernel::Mma, Shape::new(1, 32, 8, 64, 512, 128)),
            (Kernel::Mma, Shape::new(1, 8, 8, 1, 4096, 64)),
            (Kernel::Simt, Shape::new(1, 32, 8, 1, 4096, 64)),
        ] {
            let p = plan(k, shape);
            assert_eq!((p.pack, p.params.pack), (1, 1), "{k:?} {shape:?}");
            assert_eq!(p.geometry.0 .1, shape.q_heads as u32);
        }
    }

    /// The fast kernel's prefill takes 128-row blocks where the backend
    /// allows them: half the blocks along x, no packing, 32-key tiles above
    /// head dim 64; the default kernel, decoding and a backend that turns
    /// the shape off keep 64 rows.
    #[test]
    fn fast_prefill_takes_wide_blocks() {
        let arch = (9, 0);
        let fast = |shape: Shape, shapes: Shapes| {
            let p = Problem::new(shape, DType::Bf16).with_options(AttnOptions::default().causal());
            let v = forward_variant(HalfKernel::TensorCoreFast, shapes, &p, arch, 232_448);
            ForwardPlan::new(&p, v, 132 * 2).unwrap()
        };
        let on = Shapes::default();
        let w = fast(Shape::new(2, 16, 4, 1000, 1000, 128), on);
        assert!(w.variant.wide && w.variant.rows_per_block() == 128);
        assert_eq!(
            (w.pack, w.geometry.0, w.variant.block_n()),
            (1, (8, 16, 2), 32)
        );
        assert!(w.variant.defines().contains("#define WIDE 1\n"));
        let w64 = fast(Shape::new(1, 8, 8, 128, 300, 64), on);
        assert_eq!((w64.geometry.0 .0, w64.variant.block_n()), (1, 64));
        let off = Shapes { wide: false, ..on };
        let n = fast(Shape::new(2, 16, 4, 1000, 1000, 128), off);
        assert!(!n.variant.wide);
        assert_eq!((n.geometry.0, n.variant.block_n()), ((16, 16, 2), 64));
        // Fewer than 128 query rows, or the default tensor-core kernel.
        assert!(!fast(Shape::new(1, 8, 8, 127, 300, 64), on).variant.wide);
        let p = Problem::new(Shape::new(1, 8, 8, 1000, 1000, 64), DType::F16);
        let v = forward_variant(HalfKernel::TensorCore, on, &p, arch, 232_448);
        assert!(!v.wide && v.rows_per_block() == 64);
    }

    /// One buffer, each tensor 16-byte aligned, its bytes as uploaded one
    /// by one before.
    #[test]
    fn small_tensors_share_one_buffer() {
        assert_eq!(
            SmallTensors::of(&AttnOptions::default()),
            SmallTensors::default()
        );
        let o = AttnOptions {
            kv_lens: Some(vec![3, 5, 7]),
            sinks: Some(vec![0.5, -1.0]),
            ..AttnOptions::default()
        };
        let s = SmallTensors::of(&o);
        assert_eq!(s.at, [None, Some(0), None, Some(16)]);
        assert_eq!(&s.bytes[..12], &[3, 0, 0, 0, 5, 0, 0, 0, 7, 0, 0, 0]);
        assert_eq!(
            &s.bytes[16..],
            &[0.5f32.to_le_bytes(), (-1.0f32).to_le_bytes()].concat()[..]
        );
        let mut p = Params::default();
        s.set(&mut p, 4096);
        assert_eq!((p.q_lens, p.kv_lens, p.alibi, p.sinks), (0, 4096, 0, 4112));
    }
}

/// A call's small tensors (per-sequence lengths as i32, ALiBi slopes and
/// sink logits as f32) in one buffer, each at a 16-byte aligned offset,
/// so a call uploads them in one copy instead of up to four.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SmallTensors {
    /// The bytes to upload (empty when the call has none).
    pub bytes: Vec<u8>,
    /// Byte offsets of the query lengths, key lengths, slopes and sinks.
    pub at: [Option<usize>; 4],
}

impl SmallTensors {
    /// The small tensors of options `o`.
    pub fn of(o: &AttnOptions) -> Self {
        let f32s = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let parts = [
            o.q_lens.as_deref().map(i32_bytes),
            o.kv_lens.as_deref().map(i32_bytes),
            o.alibi_slopes.as_deref().map(f32s),
            o.sinks.as_deref().map(f32s),
        ];
        let mut s = SmallTensors::default();
        for (at, part) in s.at.iter_mut().zip(parts) {
            if let Some(b) = part {
                s.bytes.resize(s.bytes.len().next_multiple_of(16), 0);
                *at = Some(s.bytes.len());
                s.bytes.extend_from_slice(&b);
            }
        }
        s
    }

    /// Sets `params`' addresses of the four tensors from the uploaded
    /// buffer's device address `base` (0 for those absent).
    pub fn set(&self, params: &mut Params, base: u64) {
        let [q, k, a, s] = self.at.map(|at| at.map_or(0, |o| base + o as u64));
        (params.q_lens, params.kv_lens, params.alibi, params.sinks) = (q, k, a, s);
    }
}
