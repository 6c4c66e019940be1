//! Attention maps on the GPU (`kernels/maps.cu`): a warp per map row,
//! `exp(s - lse)` from the forward's log-sum-exp, f32, deterministic.
//! Compiled for sm_80 and sm_90 by `cargo xtask cuda-check`; the GPU
//! conformance run (`cargo xtask gpu-check`) runs the maps suite.

use super::{drv, Cuda};
use crate::plan::maps_launch;
use crate::variant::{Kernel, Variant};
use attn_spec::{check_maps_call, AttentionMaps, Backend, Inputs, MapLayout, Problem, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

impl AttentionMaps for Cuda {
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
        lse: &Self::Buffer,
        layout: &MapLayout,
        maps: &mut Self::Buffer,
    ) -> Result<()> {
        check_maps_call(self, problem, &inputs, lse, layout, maps)?;
        if layout.is_empty() {
            return Ok(());
        }
        let p = problem;
        let o = &p.options;
        let (mut mp, (grid, block)) = maps_launch(&self.name(), p, layout)?;
        let st = &self.stream;
        let params = &mut mp.p;
        let (small, small_buf) = self.upload_small(o)?;
        let batches = self.upload_i32(&layout.batches)?;
        let heads = self.upload_i32(&layout.heads)?;
        let (qa, _g1) = inputs.q.data.device_ptr(st);
        let (ka, _g2) = inputs.k.data.device_ptr(st);
        let (la, _g3) = lse.data.device_ptr(st);
        let bias_g = inputs.bias.map(|b| b.data.device_ptr(st));
        let mask_g = inputs.mask.map(|m| m.data.device_ptr(st));
        let small_g = small_buf.as_ref().map(|b| b.device_ptr(st));
        let (ba, _g4) = batches.device_ptr(st);
        let (ha, _g5) = heads.device_ptr(st);
        let addr = |g: &Option<(u64, _)>| g.as_ref().map_or(0, |g| g.0);
        params.q = qa;
        params.k = ka;
        params.lse = la;
        params.bias = addr(&bias_g);
        params.mask = addr(&mask_g);
        small.set(params, addr(&small_g));
        let (ma, _g6) = maps.data.device_ptr_mut(st);
        mp.maps = ma;
        mp.batches = ba;
        mp.heads = ha;
        let v = Variant::for_problem(Kernel::Maps, p, self.arch);
        let f = self.function(&v)?;
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `mp` holds the addresses of live device buffers of this
        // context (the guards keep them alive and ordered on this stream):
        // Q, K, the bias and mask, validated against the problem's views by
        // `check_maps_call`, the log-sum-exp ([b, hq, sq] f32), the lengths
        // and slopes uploaded above, the selection lists (n_batches and
        // n_heads i32, every index in range: `check_maps_call` re-resolved
        // the layout) and the map buffer of exactly `layout.len()` f32.
        unsafe { st.launch_builder(&f).arg(&mp).launch(cfg) }.map_err(drv)?;
        Ok(())
    }
}
