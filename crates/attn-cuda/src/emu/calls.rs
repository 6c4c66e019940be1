//! The emulator's calls: forward, backward, maps and projections, each
//! the GPU backend's plan (`crate::plan`) launched on poisoned copies of
//! the buffers, the copies checked and the results copied back.

use super::device::{store, Dev};
use super::{blocks_per_sm, Emulator, ARCH, SMEM_OPTIN, SMS};
use crate::bytes::{bytes_of, i32_bytes};
use crate::params::{BwdParams, Params};
use crate::plan::{
    backward_launches, dbias_strides, forward_variant, linear_launch, maps_launch, supported,
    supported_backward, ForwardPlan, Geometry3, SmallTensors,
};
use crate::variant::{Kernel, Variant};
use attn_spec::{
    check_backward_call, check_call, check_maps_call, AttentionMaps, Backend, Backward, GradInputs,
    GradOutputs, HostData, Inputs, MapLayout, Problem, Result,
};

/// A one-dimensional block of `threads`.
pub(super) fn flat((grid, threads): ((u32, u32, u32), u32)) -> Geometry3 {
    (grid, (threads, 1, 1))
}

impl Backend for Emulator {
    attn_spec::host_buffers!();

    fn name(&self) -> String {
        "attn-cuda-emu".into()
    }

    fn supports(&self, p: &Problem) -> Result<()> {
        let v = forward_variant(self.half_kernel, self.shapes, p, ARCH, SMEM_OPTIN);
        supported(&self.name(), p, &v, SMEM_OPTIN)
    }

    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        out: &mut HostData,
        lse: Option<&mut HostData>,
    ) -> Result<()> {
        check_call(self, problem, &inputs, out, lse.as_deref())?;
        let s = problem.shape;
        if s.batch * s.q_heads * s.q_len == 0 {
            return Ok(());
        }
        let o = &problem.options;
        let v = forward_variant(self.half_kernel, self.shapes, problem, ARCH, SMEM_OPTIN);
        let plan = ForwardPlan::new(problem, v, SMS * blocks_per_sm(&v))?;
        let opt = |name, data: Option<Vec<u8>>| data.map(|b| Dev::new(name, &b));
        let mut q = Dev::new("q", &bytes_of(inputs.q));
        let mut k = Dev::new("k", &bytes_of(inputs.k));
        let mut vv = Dev::new("v", &bytes_of(inputs.v));
        // What the kernels write starts as poison (outside the views, the
        // caller's data).
        let rows = s.batch * s.q_heads * s.q_len;
        let mut o_dev =
            Dev::new("out", &bytes_of(out)).poison(&problem.out, problem.dtype.size_bytes());
        let mut lse_dev =
            opt("lse", lse.as_deref().map(bytes_of)).map(|d| d.poison_first(4 * rows));
        let mut bias = opt("bias", inputs.bias.map(bytes_of));
        let mut mask = opt("mask", inputs.mask.map(bytes_of));
        let (small, mut small_dev) = small_tensors(o);
        let mut part = plan
            .partials(problem)
            .map(|(po, pl)| (Dev::unset("part_o", 4 * po), Dev::unset("part_lse", 4 * pl)));
        let addr = |d: &mut Option<Dev>| d.as_mut().map_or(0, Dev::addr);
        let mut params: Params = plan.params;
        params.q = q.addr();
        params.set_kv(k.addr(), vv.addr());
        params.o = o_dev.addr();
        params.lse = addr(&mut lse_dev);
        params.bias = addr(&mut bias);
        params.mask = addr(&mut mask);
        small.set(&mut params, small_dev.as_mut().map_or(0, Dev::addr));
        if let Some((po, pl)) = part.as_mut() {
            params.part_o = po.addr();
            params.part_lse = pl.addr();
        }
        self.launch(&v, flat(plan.geometry), &params)?;
        if let Some((cv, geometry)) = plan.combine {
            self.launch(&cv, flat(geometry), &params)?;
        }
        let all = [Some(&q), Some(&k), Some(&vv), Some(&o_dev)]
            .into_iter()
            .chain([&lse_dev, &bias, &mask].map(Option::as_ref))
            .chain(part.iter().flat_map(|(a, b)| [Some(a), Some(b)]))
            .flatten()
            .chain(small_dev.as_ref());
        self.no_overrun(&v, all)?;
        store(out, o_dev.bytes());
        if let (Some(l), Some(d)) = (lse, lse_dev.as_ref()) {
            store(l, d.bytes());
        }
        Ok(())
    }
}

impl Backward for Emulator {
    fn backward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        forward: GradInputs<'_, HostData>,
        grads: GradOutputs<'_, HostData>,
    ) -> Result<()> {
        check_backward_call(self, problem, &inputs, &forward, &grads)?;
        let bias_grad = grads.dbias.is_some();
        supported_backward(&self.name(), problem, bias_grad, ARCH, SMEM_OPTIN)?;
        let p = problem;
        let s = p.shape;
        let mut params = Params::new(p, 1, s.kv_len.max(1))?;
        let (small, mut small_dev) = small_tensors(&p.options);
        let lse = forward.lse.expect("checked by check_backward_call");
        let opt = |name, data: Option<&HostData>| data.map(|b| Dev::new(name, &bytes_of(b)));
        let mut q = Dev::new("q", &bytes_of(inputs.q));
        let mut k = Dev::new("k", &bytes_of(inputs.k));
        let mut vv = Dev::new("v", &bytes_of(inputs.v));
        let mut o = Dev::new("out", &bytes_of(forward.out));
        let mut lse = Dev::new("lse", &bytes_of(lse));
        let mut d_out = Dev::new("d_out", &bytes_of(forward.d_out));
        let mut bias = opt("bias", inputs.bias);
        let mut mask = opt("mask", inputs.mask);
        let mut d_rows = Dev::new("d_rows", &vec![0u8; 4 * s.batch * s.q_heads * s.q_len]);
        // The gradients start as poison inside their views: every element
        // there must be written (the contract).
        let size = p.dtype.size_bytes();
        let mut dq = Dev::new("dq", &bytes_of(grads.dq)).poison(&p.q, size);
        let mut dk = Dev::new("dk", &bytes_of(grads.dk)).poison(&p.k, size);
        let mut dv = Dev::new("dv", &bytes_of(grads.dv)).poison(&p.v, size);
        // The GPU backend zeroes the bias gradient before the launches.
        let mut dbias = grads
            .dbias
            .as_deref()
            .map(|b| Dev::new("dbias", &vec![0u8; b.len() * b.dtype().size_bytes()]));
        let mut dsinks =
            opt("dsinks", grads.dsinks.as_deref()).map(|d| d.poison_first(4 * s.q_heads));
        let addr = |d: &mut Option<Dev>| d.as_mut().map_or(0, Dev::addr);
        params.q = q.addr();
        params.set_kv(k.addr(), vv.addr());
        params.o = o.addr();
        params.lse = lse.addr();
        params.bias = addr(&mut bias);
        params.mask = addr(&mut mask);
        small.set(&mut params, small_dev.as_mut().map_or(0, Dev::addr));
        let bp = BwdParams {
            p: params,
            d_out: d_out.addr(),
            dq: dq.addr(),
            dk: dk.addr(),
            dv: dv.addr(),
            d_rows: d_rows.addr(),
            dbias: addr(&mut dbias),
            dsinks: addr(&mut dsinks),
            dbias_st: dbias_strides(p),
        };
        let mut last = None;
        for (kernel, grid) in backward_launches(p, bp.dsinks != 0) {
            let v = Variant::for_problem(kernel, p, ARCH);
            self.launch(&v, flat((grid, kernel.threads())), &bp)?;
            last = Some(v);
        }
        let all = [&q, &k, &vv, &o, &lse, &d_out, &d_rows, &dq, &dk, &dv]
            .into_iter()
            .chain([&bias, &mask, &dbias, &dsinks].into_iter().flatten())
            .chain(small_dev.as_ref());
        if let Some(v) = last {
            self.no_overrun(&v, all)?;
        }
        store(grads.dq, dq.bytes());
        store(grads.dk, dk.bytes());
        store(grads.dv, dv.bytes());
        if let (Some(b), Some(d)) = (grads.dbias, dbias.as_ref()) {
            store(b, d.bytes());
        }
        if let (Some(b), Some(d)) = (grads.dsinks, dsinks.as_ref()) {
            store(b, d.bytes());
        }
        Ok(())
    }
}

impl AttentionMaps for Emulator {
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        lse: &HostData,
        layout: &MapLayout,
        maps: &mut HostData,
    ) -> Result<()> {
        check_maps_call(self, problem, &inputs, lse, layout, maps)?;
        if layout.is_empty() {
            return Ok(());
        }
        let p = problem;
        let (mut mp, geometry) = maps_launch(&self.name(), p, layout)?;
        let (small, mut small_dev) = small_tensors(&p.options);
        let opt = |name, data: Option<&HostData>| data.map(|b| Dev::new(name, &bytes_of(b)));
        let mut q = Dev::new("q", &bytes_of(inputs.q));
        let mut k = Dev::new("k", &bytes_of(inputs.k));
        let mut lse = Dev::new("lse", &bytes_of(lse));
        let mut bias = opt("bias", inputs.bias);
        let mut mask = opt("mask", inputs.mask);
        let mut batches = Dev::new("batches", &i32_bytes(&layout.batches));
        let mut heads = Dev::new("heads", &i32_bytes(&layout.heads));
        let mut out = Dev::new("maps", &bytes_of(maps)).poison_first(4 * layout.len());
        let addr = |d: &mut Option<Dev>| d.as_mut().map_or(0, Dev::addr);
        mp.p.q = q.addr();
        mp.p.k = k.addr();
        mp.p.lse = lse.addr();
        mp.p.bias = addr(&mut bias);
        mp.p.mask = addr(&mut mask);
        small.set(&mut mp.p, small_dev.as_mut().map_or(0, Dev::addr));
        mp.maps = out.addr();
        mp.batches = batches.addr();
        mp.heads = heads.addr();
        let v = Variant::for_problem(Kernel::Maps, p, ARCH);
        self.launch(&v, flat(geometry), &mp)?;
        let all = [&q, &k, &lse, &batches, &heads, &out]
            .into_iter()
            .chain([&bias, &mask].into_iter().flatten())
            .chain(small_dev.as_ref());
        self.no_overrun(&v, all)?;
        store(maps, out.bytes());
        Ok(())
    }
}

impl attn_spec::Linear for Emulator {
    fn linear(
        &self,
        x: &HostData,
        rows: usize,
        w: &HostData,
        bias: Option<&HostData>,
        in_features: usize,
        out_features: usize,
    ) -> Result<HostData> {
        attn_spec::check_linear(self, x, rows, w, bias, in_features, out_features)?;
        let dtype = x.dtype();
        let (mut params, geometry) =
            linear_launch(&self.name(), dtype, rows, in_features, out_features)?;
        let mut y_host = HostData::zeros(dtype, rows * out_features);
        let mut xd = Dev::new("x", &bytes_of(x));
        let mut wd = Dev::new("w", &bytes_of(w));
        let mut bd = bias.map(|b| Dev::new("b", &bytes_of(b)));
        let mut yd = Dev::unset("y", y_host.len() * dtype.size_bytes());
        params.x = xd.addr();
        params.w = wd.addr();
        params.b = bd.as_mut().map_or(0, Dev::addr);
        params.y = yd.addr();
        let v = Variant::linear(dtype, ARCH);
        self.launch(&v, geometry, &params)?;
        self.no_overrun(&v, [&xd, &wd, &yd].into_iter().chain(bd.as_ref()))?;
        store(&mut y_host, yd.bytes());
        Ok(y_host)
    }
}

/// The call's small tensors in one buffer, as the GPU backend uploads
/// them (none when there are none).
fn small_tensors(o: &attn_spec::AttnOptions) -> (SmallTensors, Option<Dev>) {
    let small = SmallTensors::of(o);
    let dev = (!small.bytes.is_empty()).then(|| Dev::new("small tensors", &small.bytes));
    (small, dev)
}
