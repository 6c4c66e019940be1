//! The backward pass on the GPU (`kernels/bwd.cu`): `attn_bwd_dq` (dQ, `D
//! = dO . O` and the bias gradient), then `attn_bwd_dkdv` (dK, dV), then
//! `attn_bwd_dsinks` when the sinks' gradient is asked for, on the
//! backend's stream. f32 arithmetic, no atomics: deterministic.
//!
//! Compiled for sm_80 and sm_90 by `cargo xtask cuda-check` (no spills);
//! the GPU conformance run (`cargo xtask gpu-check`) runs the backward
//! suite. The gradient of a bias broadcast over batch or heads is refused
//! (`Unsupported`): each element would need a reduction over the axis.

use super::{drv, Cuda};
use crate::params::{BwdParams, Params};
use crate::plan::{backward_launches, dbias_strides, supported_backward};
use crate::variant::{Kernel, Variant};
use attn_spec::{
    check_backward_call, Backend, Backward, DType, GradInputs, GradOutputs, Inputs, Problem, Result,
};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

impl Backward for Cuda {
    fn backward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
        forward: GradInputs<'_, Self::Buffer>,
        grads: GradOutputs<'_, Self::Buffer>,
    ) -> Result<()> {
        check_backward_call(self, problem, &inputs, &forward, &grads)?;
        let bias_grad = grads.dbias.is_some();
        supported_backward(&self.name(), problem, bias_grad, self.arch, self.smem_optin)?;
        let p = problem;
        let s = p.shape;
        let o = &p.options;
        let st = &self.stream;
        let mut params = Params::new(p, 1, s.kv_len.max(1))?;
        let (small, small_buf) = self.upload_small(o)?;
        let mut d_rows = self.alloc(DType::F32, s.batch * s.q_heads * s.q_len)?;

        let (qa, _g1) = inputs.q.data.device_ptr(st);
        let (ka, _g2) = inputs.k.data.device_ptr(st);
        let (va, _g3) = inputs.v.data.device_ptr(st);
        let (oa, _g4) = forward.out.data.device_ptr(st);
        let lse_buf = forward.lse.expect("checked by check_backward_call");
        let (la, _g5) = lse_buf.data.device_ptr(st);
        let (ga, _g6) = forward.d_out.data.device_ptr(st);
        let bias_g = inputs.bias.map(|b| b.data.device_ptr(st));
        let mask_g = inputs.mask.map(|m| m.data.device_ptr(st));
        let small_g = small_buf.as_ref().map(|b| b.device_ptr(st));
        let addr = |g: &Option<(u64, _)>| g.as_ref().map_or(0, |g| g.0);
        params.q = qa;
        params.set_kv(ka, va);
        params.o = oa;
        params.lse = la;
        params.bias = addr(&bias_g);
        params.mask = addr(&mask_g);
        small.set(&mut params, addr(&small_g));

        let mut dbias = grads.dbias;
        if let Some(db) = dbias.as_deref_mut() {
            st.memset_zeros(&mut db.data).map_err(drv)?;
        }
        let (dqa, _g7) = grads.dq.data.device_ptr_mut(st);
        let (dka, _g8) = grads.dk.data.device_ptr_mut(st);
        let (dva, _g9) = grads.dv.data.device_ptr_mut(st);
        let (dra, _g10) = d_rows.data.device_ptr_mut(st);
        let dbias_g = dbias.map(|b| b.data.device_ptr_mut(st));
        let dsinks_g = grads.dsinks.map(|b| b.data.device_ptr_mut(st));
        let bp = BwdParams {
            p: params,
            d_out: ga,
            dq: dqa,
            dk: dka,
            dv: dva,
            d_rows: dra,
            dbias: addr(&dbias_g),
            dsinks: addr(&dsinks_g),
            dbias_st: dbias_strides(p),
        };
        let launch = |kernel: Kernel, grid: (u32, u32, u32)| -> Result<()> {
            let v = Variant::for_problem(kernel, p, self.arch);
            let f = self.function(&v)?;
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: (kernel.threads(), 1, 1),
                shared_mem_bytes: v.smem_bytes() as u32,
            };
            // SAFETY: `bp` holds the addresses of live device buffers of
            // this context whose sizes `check_backward_call` validated
            // against the problem's views (the guards above keep them alive
            // and ordered on this stream), the D scratch sized [b, hq, sq]
            // and the contiguous bias gradient; the kernels read and write
            // only inside those views.
            unsafe { st.launch_builder(&f).arg(&bp).launch(cfg) }.map_err(drv)?;
            Ok(())
        };
        for (kernel, grid) in backward_launches(p, bp.dsinks != 0) {
            launch(kernel, grid)?;
        }
        Ok(())
    }
}
