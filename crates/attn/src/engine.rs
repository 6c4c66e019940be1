//! Run-time choice among the backends compiled in: [`Engine`] is a backend
//! on host data that dispatches to one of them, so code written against
//! [`attn_spec::Backend`] runs on the best one without generics. With the
//! `cuda` feature and a GPU that answers, that is attn-cuda: host data is
//! uploaded per call and the results downloaded (keep tensors on the
//! device across calls with `attn::cuda::Cuda` itself).

use attn_spec::{
    AttentionMaps, Backend, Backward, GradInputs, GradOutputs, HostData, Inputs, Linear, MapLayout,
    Problem, Reference, Result,
};

/// Which backend an [`Engine`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// The f64 reference.
    Reference,
    /// attn-cpu (feature `cpu`).
    Cpu,
    /// attn-cuda on the first GPU (feature `cuda`).
    Cuda,
}

impl EngineKind {
    /// Every kind compiled into this build, fastest first.
    pub fn compiled() -> Vec<EngineKind> {
        let mut v = Vec::new();
        if cfg!(feature = "cuda") {
            v.push(EngineKind::Cuda);
        }
        if cfg!(feature = "cpu") {
            v.push(EngineKind::Cpu);
        }
        v.push(EngineKind::Reference);
        v
    }
}

/// One of the compiled-in backends, chosen at run time.
#[derive(Clone, Debug)]
pub enum Engine {
    /// The f64 reference.
    Reference(Reference),
    /// attn-cpu.
    #[cfg(feature = "cpu")]
    Cpu(attn_cpu::Cpu),
    /// attn-cuda (shared: a GPU context is not cloned).
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<attn_cuda::Cuda>),
}

/// Calls `$body` with `$b` bound to the engine's host backend, or runs
/// `$gpu` with the GPU backend.
macro_rules! each {
    ($e:expr, $b:ident => $body:expr, $c:ident => $gpu:expr) => {
        match $e {
            Engine::Reference($b) => $body,
            #[cfg(feature = "cpu")]
            Engine::Cpu($b) => $body,
            #[cfg(feature = "cuda")]
            Engine::Cuda($c) => $gpu,
        }
    };
}

impl Engine {
    /// The fastest backend compiled in that works on this machine.
    pub fn best() -> Engine {
        Engine::pick().0
    }

    /// [`Engine::best`] and why: which backend it picked and why each
    /// faster one compiled in was passed over (e.g. `"cpu (avx2, 2
    /// threads); passed over cuda: no device: ..."`).
    pub fn pick() -> (Engine, String) {
        let mut passed = Vec::new();
        for kind in EngineKind::compiled() {
            match Engine::of(kind) {
                Ok(e) => {
                    let mut why = e.describe();
                    if !passed.is_empty() {
                        why = format!("{why}; passed over {}", passed.join("; "));
                    }
                    return (e, why);
                }
                Err(err) => passed.push(format!("{kind:?}: {err}").to_lowercase()),
            }
        }
        let e = Engine::Reference(Reference);
        let why = format!("{}; passed over {}", e.describe(), passed.join("; "));
        (e, why)
    }

    /// A specific backend, or the reason it cannot run here.
    pub fn of(kind: EngineKind) -> Result<Engine> {
        #[allow(unused_variables)] // with every feature on, nothing is missing
        let missing = |name: &str, feature: &str| attn_spec::AttnError::Unsupported {
            backend: name.into(),
            feature: "this build".into(),
            reason: format!("attn was built without the `{feature}` feature"),
        };
        match kind {
            EngineKind::Reference => Ok(Engine::Reference(Reference)),
            #[cfg(feature = "cpu")]
            EngineKind::Cpu => Ok(Engine::Cpu(attn_cpu::Cpu::new())),
            #[cfg(not(feature = "cpu"))]
            EngineKind::Cpu => Err(missing("cpu", "cpu")),
            #[cfg(feature = "cuda")]
            EngineKind::Cuda => Ok(Engine::Cuda(std::sync::Arc::new(attn_cuda::Cuda::first()?))),
            #[cfg(not(feature = "cuda"))]
            EngineKind::Cuda => Err(missing("cuda", "cuda")),
        }
    }

    /// Which backend this engine runs.
    pub fn kind(&self) -> EngineKind {
        match self {
            Engine::Reference(_) => EngineKind::Reference,
            #[cfg(feature = "cpu")]
            Engine::Cpu(_) => EngineKind::Cpu,
            #[cfg(feature = "cuda")]
            Engine::Cuda(_) => EngineKind::Cuda,
        }
    }

    /// The backend in words: `"cpu (avx2, 2 threads)"`, `"cuda (NVIDIA
    /// H200, sm_90)"`, `"reference (f64)"`.
    pub fn describe(&self) -> String {
        match self {
            Engine::Reference(_) => "reference (f64)".into(),
            #[cfg(feature = "cpu")]
            Engine::Cpu(c) => match c.isa() {
                Ok(isa) => format!("cpu ({isa}, {} threads)", c.threads()),
                Err(e) => format!("cpu ({e})"),
            },
            #[cfg(feature = "cuda")]
            Engine::Cuda(c) => {
                let (ma, mi) = c.arch();
                format!("cuda ({}, sm_{ma}{mi})", c.device_name())
            }
        }
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    //! Host data through attn-cuda: upload, run, download.
    use attn_cuda::{Cuda, CudaBuffer};
    use attn_spec::{Backend, HostData, Inputs, Result};

    /// The inputs on the device.
    pub struct Up {
        pub q: CudaBuffer,
        pub k: CudaBuffer,
        pub v: CudaBuffer,
        pub bias: Option<CudaBuffer>,
        pub mask: Option<CudaBuffer>,
    }

    impl Up {
        pub fn new(c: &Cuda, i: Inputs<'_, HostData>) -> Result<Up> {
            Ok(Up {
                q: c.upload(i.q)?,
                k: c.upload(i.k)?,
                v: c.upload(i.v)?,
                bias: i.bias.map(|b| c.upload(b)).transpose()?,
                mask: i.mask.map(|m| c.upload(m)).transpose()?,
            })
        }

        pub fn inputs(&self) -> Inputs<'_, CudaBuffer> {
            Inputs {
                q: &self.q,
                k: &self.k,
                v: &self.v,
                bias: self.bias.as_ref(),
                mask: self.mask.as_ref(),
            }
        }
    }

    /// Uploads an optional buffer.
    pub fn up_opt(c: &Cuda, d: Option<&HostData>) -> Result<Option<CudaBuffer>> {
        d.map(|d| c.upload(d)).transpose()
    }

    /// Downloads `src` into `dst` when both are there.
    pub fn down(c: &Cuda, src: Option<&CudaBuffer>, dst: Option<&mut HostData>) -> Result<()> {
        if let (Some(s), Some(d)) = (src, dst) {
            *d = c.download(s)?;
        }
        Ok(())
    }
}

impl Backend for Engine {
    attn_spec::host_buffers!();

    fn name(&self) -> String {
        each!(self, b => b.name(), c => c.name())
    }
    fn supports(&self, problem: &Problem) -> Result<()> {
        each!(self, b => b.supports(problem), c => c.supports(problem))
    }
    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        out: &mut HostData,
        lse: Option<&mut HostData>,
    ) -> Result<()> {
        each!(self, b => b.forward_into(problem, inputs, out, lse), c => {
            attn_spec::check_call(self, problem, &inputs, out, lse.as_deref())?;
            let up = gpu::Up::new(c, inputs)?;
            let mut o = c.upload(out)?;
            let mut l = gpu::up_opt(c, lse.as_deref())?;
            c.forward_into(problem, up.inputs(), &mut o, l.as_mut())?;
            *out = c.download(&o)?;
            gpu::down(c, l.as_ref(), lse)
        })
    }
}

impl Linear for Engine {
    fn linear(
        &self,
        x: &HostData,
        rows: usize,
        w: &HostData,
        bias: Option<&HostData>,
        in_features: usize,
        out_features: usize,
    ) -> Result<HostData> {
        each!(self, b => b.linear(x, rows, w, bias, in_features, out_features), c => {
            attn_spec::check_linear(self, x, rows, w, bias, in_features, out_features)?;
            let (xd, wd, bd) = (c.upload(x)?, c.upload(w)?, gpu::up_opt(c, bias)?);
            let y = c.linear(&xd, rows, &wd, bd.as_ref(), in_features, out_features)?;
            c.download(&y)
        })
    }
}

impl Backward for Engine {
    fn backward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        forward: GradInputs<'_, HostData>,
        grads: GradOutputs<'_, HostData>,
    ) -> Result<()> {
        each!(self, b => b.backward_into(problem, inputs, forward, grads), c => {
            attn_spec::check_backward_call(self, problem, &inputs, &forward, &grads)?;
            let up = gpu::Up::new(c, inputs)?;
            let (o, l, d) = (
                c.upload(forward.out)?,
                gpu::up_opt(c, forward.lse)?,
                c.upload(forward.d_out)?,
            );
            let (mut dq, mut dk, mut dv) =
                (c.upload(grads.dq)?, c.upload(grads.dk)?, c.upload(grads.dv)?);
            let mut db = gpu::up_opt(c, grads.dbias.as_deref())?;
            let mut ds = gpu::up_opt(c, grads.dsinks.as_deref())?;
            c.backward_into(
                problem,
                up.inputs(),
                GradInputs {
                    out: &o,
                    lse: l.as_ref(),
                    d_out: &d,
                },
                GradOutputs {
                    dq: &mut dq,
                    dk: &mut dk,
                    dv: &mut dv,
                    dbias: db.as_mut(),
                    dsinks: ds.as_mut(),
                },
            )?;
            *grads.dq = c.download(&dq)?;
            *grads.dk = c.download(&dk)?;
            *grads.dv = c.download(&dv)?;
            gpu::down(c, db.as_ref(), grads.dbias)?;
            gpu::down(c, ds.as_ref(), grads.dsinks)
        })
    }
}

impl AttentionMaps for Engine {
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        lse: &HostData,
        layout: &MapLayout,
        maps: &mut HostData,
    ) -> Result<()> {
        each!(self, b => b.maps_into(problem, inputs, lse, layout, maps), c => {
            attn_spec::check_maps_call(self, problem, &inputs, lse, layout, maps)?;
            let up = gpu::Up::new(c, inputs)?;
            let l = c.upload(lse)?;
            let mut m = c.upload(maps)?;
            c.maps_into(problem, up.inputs(), &l, layout, &mut m)?;
            *maps = c.download(&m)?;
            Ok(())
        })
    }
}
