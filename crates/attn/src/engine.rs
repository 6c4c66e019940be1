//! Run-time choice among the backends compiled in: [`Engine`] is a backend
//! that dispatches to one of them, so code written against
//! [`attn_spec::Backend`] runs on the best one without generics.

use attn_spec::{
    Backend, Backward, BufferInfo, DType, GradInputs, GradOutputs, HostData, Inputs, Problem,
    Reference, Result,
};

/// Which backend an [`Engine`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// The f64 reference.
    Reference,
    /// attn-cpu (feature `cpu`).
    Cpu,
}

impl EngineKind {
    /// Every kind compiled into this build, fastest first.
    pub fn compiled() -> Vec<EngineKind> {
        let mut v = Vec::new();
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
}

/// Calls `$body` with `$b` bound to the engine's backend.
macro_rules! each {
    ($e:expr, $b:ident => $body:expr) => {
        match $e {
            Engine::Reference($b) => $body,
            #[cfg(feature = "cpu")]
            Engine::Cpu($b) => $body,
        }
    };
}

impl Engine {
    /// The fastest backend compiled in that works on this machine.
    pub fn best() -> Engine {
        EngineKind::compiled()
            .into_iter()
            .find_map(|k| Engine::of(k).ok())
            .unwrap_or(Engine::Reference(Reference))
    }

    /// A specific backend, or the reason it cannot run here.
    pub fn of(kind: EngineKind) -> Result<Engine> {
        match kind {
            EngineKind::Reference => Ok(Engine::Reference(Reference)),
            #[cfg(feature = "cpu")]
            EngineKind::Cpu => Ok(Engine::Cpu(attn_cpu::Cpu::new())),
            #[cfg(not(feature = "cpu"))]
            EngineKind::Cpu => Err(attn_spec::AttnError::Unsupported {
                backend: "cpu".into(),
                feature: "this build".into(),
                reason: "attn was built without the `cpu` feature".into(),
            }),
        }
    }

    /// Which backend this engine runs.
    pub fn kind(&self) -> EngineKind {
        match self {
            Engine::Reference(_) => EngineKind::Reference,
            #[cfg(feature = "cpu")]
            Engine::Cpu(_) => EngineKind::Cpu,
        }
    }
}

impl Backend for Engine {
    type Buffer = HostData;

    fn name(&self) -> String {
        each!(self, b => b.name())
    }
    fn upload(&self, data: &HostData) -> Result<HostData> {
        each!(self, b => b.upload(data))
    }
    fn download(&self, buf: &HostData) -> Result<HostData> {
        each!(self, b => b.download(buf))
    }
    fn zeros(&self, dtype: DType, len: usize) -> Result<HostData> {
        each!(self, b => b.zeros(dtype, len))
    }
    fn info(&self, buf: &HostData) -> BufferInfo {
        each!(self, b => b.info(buf))
    }
    fn supports(&self, problem: &Problem) -> Result<()> {
        each!(self, b => b.supports(problem))
    }
    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        out: &mut HostData,
        lse: Option<&mut HostData>,
    ) -> Result<()> {
        each!(self, b => b.forward_into(problem, inputs, out, lse))
    }
}

impl attn_spec::Linear for Engine {
    fn linear(
        &self,
        x: &HostData,
        rows: usize,
        w: &HostData,
        bias: Option<&HostData>,
        in_features: usize,
        out_features: usize,
    ) -> Result<HostData> {
        each!(self, b => b.linear(x, rows, w, bias, in_features, out_features))
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
        each!(self, b => b.backward_into(problem, inputs, forward, grads))
    }
}

impl attn_spec::AttentionMaps for Engine {
    fn maps_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, HostData>,
        lse: &HostData,
        layout: &attn_spec::MapLayout,
        maps: &mut HostData,
    ) -> Result<()> {
        each!(self, b => b.maps_into(problem, inputs, lse, layout, maps))
    }
}
