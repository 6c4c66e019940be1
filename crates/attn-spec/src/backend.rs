//! The backend trait: what every attn backend (reference, CPU, CUDA, candle)
//! implements, and the one generic thing tests and users program against.
//!
//! A backend owns its buffers (`Self::Buffer`: a host `Vec` for the CPU, a
//! device allocation for CUDA, a candle tensor for candle). Data crosses the
//! host boundary only through [`Backend::upload`] and [`Backend::download`],
//! so a CUDA backend keeps Q, K, V and the output on the device across calls
//! and [`Backend::forward_into`] writes into a buffer the caller already
//! holds: no copy per call. Generic tests upload host data, call `forward`,
//! and download the result, whatever the backend.

use crate::dtype::DType;
use crate::error::Result;
use crate::problem::{BufferInfo, Buffers, Problem};
use crate::tensor::HostData;

/// The input buffers of one call. `bias` and `mask` must be present exactly
/// when the [`Problem`] describes them.
#[derive(Debug)]
pub struct Inputs<'a, B> {
    /// Queries.
    pub q: &'a B,
    /// Keys.
    pub k: &'a B,
    /// Values.
    pub v: &'a B,
    /// Additive bias.
    pub bias: Option<&'a B>,
    /// Boolean mask.
    pub mask: Option<&'a B>,
}

impl<B> Clone for Inputs<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Inputs<'_, B> {}

impl<'a, B> Inputs<'a, B> {
    /// Q, K and V without bias or mask.
    pub fn new(q: &'a B, k: &'a B, v: &'a B) -> Self {
        Inputs {
            q,
            k,
            v,
            bias: None,
            mask: None,
        }
    }
    /// Adds the bias buffer.
    pub fn with_bias(mut self, bias: &'a B) -> Self {
        self.bias = Some(bias);
        self
    }
    /// Adds the boolean mask buffer.
    pub fn with_mask(mut self, mask: &'a B) -> Self {
        self.mask = Some(mask);
        self
    }
}

/// The result of [`Backend::forward`].
#[derive(Debug)]
pub struct Output<B> {
    /// The attention output, laid out as `problem.out` describes.
    pub out: B,
    /// The log-sum-exp (`[batch, q_heads, q_len]`, f32) when
    /// `options.return_lse` is set.
    pub lse: Option<B>,
}

/// An attention backend.
pub trait Backend {
    /// Where this backend keeps tensor data.
    type Buffer;

    /// A short name for reports and errors (e.g. `"reference"`, `"cpu"`).
    fn name(&self) -> String;

    /// Copies host data into a new buffer of the same element type.
    fn upload(&self, data: &HostData) -> Result<Self::Buffer>;

    /// Copies a buffer back to the host.
    fn download(&self, buf: &Self::Buffer) -> Result<HostData>;

    /// A new buffer of `len` zeros.
    fn zeros(&self, dtype: DType, len: usize) -> Result<Self::Buffer>;

    /// Element type and length of a buffer.
    fn info(&self, buf: &Self::Buffer) -> BufferInfo;

    /// `Ok` when this backend computes `problem`, otherwise
    /// [`crate::AttnError::Unsupported`] saying what and why. Never a silent
    /// fallback: a backend that cannot do something refuses it.
    fn supports(&self, problem: &Problem) -> Result<()>;

    /// Computes attention into `out` (and `lse` when the options ask for
    /// it). Elements of `out` outside `problem.out`'s view are untouched.
    /// Implementations start with [`check_call`].
    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
        out: &mut Self::Buffer,
        lse: Option<&mut Self::Buffer>,
    ) -> Result<()>;

    /// Allocates the output (and log-sum-exp) and computes attention.
    fn forward(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
    ) -> Result<Output<Self::Buffer>> {
        problem.validate()?;
        let out_len = problem.out.extent().unwrap_or(0);
        let mut out = self.zeros(problem.dtype, out_len)?;
        let mut lse = if problem.options.return_lse {
            let len = problem.lse_view().extent().unwrap_or(0);
            Some(self.zeros(DType::F32, len)?)
        } else {
            None
        };
        self.forward_into(problem, inputs, &mut out, lse.as_mut())?;
        Ok(Output { out, lse })
    }
}

/// The buffer half of [`Backend`] for a backend whose buffers are host
/// memory: `type Buffer = HostData`, `upload` and `download` as copies,
/// `zeros` a fresh zeroed buffer, `info` the data's own type and length.
/// Written once here for every host backend (the reference, attn-cpu, the
/// facade's engine); invoked inside the `impl Backend` block:
///
/// ```
/// use attn_spec::{AttnError, Backend, HostData, Inputs, Problem, Result};
///
/// struct Refuses;
///
/// impl Backend for Refuses {
///     attn_spec::host_buffers!();
///     fn name(&self) -> String {
///         "refuses".into()
///     }
///     fn supports(&self, _: &Problem) -> Result<()> {
///         Err(AttnError::Unsupported {
///             backend: self.name(),
///             feature: "anything".into(),
///             reason: "an example".into(),
///         })
///     }
///     fn forward_into(
///         &self,
///         problem: &Problem,
///         _: Inputs<'_, HostData>,
///         _: &mut HostData,
///         _: Option<&mut HostData>,
///     ) -> Result<()> {
///         self.supports(problem)
///     }
/// }
///
/// let b = Refuses.upload(&HostData::F32(vec![1.0, 2.0])).unwrap();
/// assert_eq!(Refuses.info(&b).len, 2);
/// ```
#[macro_export]
macro_rules! host_buffers {
    () => {
        type Buffer = $crate::HostData;
        fn upload(&self, data: &$crate::HostData) -> $crate::Result<$crate::HostData> {
            Ok(data.clone())
        }
        fn download(&self, buf: &$crate::HostData) -> $crate::Result<$crate::HostData> {
            Ok(buf.clone())
        }
        fn zeros(&self, dtype: $crate::DType, len: usize) -> $crate::Result<$crate::HostData> {
            Ok($crate::HostData::zeros(dtype, len))
        }
        fn info(&self, buf: &$crate::HostData) -> $crate::BufferInfo {
            $crate::BufferInfo {
                dtype: buf.dtype(),
                len: buf.len(),
            }
        }
    };
}

/// A reference to a backend is a backend (so a layer can borrow one).
impl<B: Backend + ?Sized> Backend for &B {
    type Buffer = B::Buffer;
    fn name(&self) -> String {
        (**self).name()
    }
    fn upload(&self, data: &HostData) -> Result<Self::Buffer> {
        (**self).upload(data)
    }
    fn download(&self, buf: &Self::Buffer) -> Result<HostData> {
        (**self).download(buf)
    }
    fn zeros(&self, dtype: DType, len: usize) -> Result<Self::Buffer> {
        (**self).zeros(dtype, len)
    }
    fn info(&self, buf: &Self::Buffer) -> BufferInfo {
        (**self).info(buf)
    }
    fn supports(&self, problem: &Problem) -> Result<()> {
        (**self).supports(problem)
    }
    fn forward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
        out: &mut Self::Buffer,
        lse: Option<&mut Self::Buffer>,
    ) -> Result<()> {
        (**self).forward_into(problem, inputs, out, lse)
    }
}

/// The check every `forward_into` runs first: validates the problem and every
/// buffer against its view, then asks the backend whether it supports the
/// problem.
pub fn check_call<B: Backend + ?Sized>(
    backend: &B,
    problem: &Problem,
    inputs: &Inputs<'_, B::Buffer>,
    out: &B::Buffer,
    lse: Option<&B::Buffer>,
) -> Result<()> {
    check_buffers(
        problem,
        &Buffers {
            q: backend.info(inputs.q),
            k: backend.info(inputs.k),
            v: backend.info(inputs.v),
            bias: inputs.bias.map(|b| backend.info(b)),
            mask: inputs.mask.map(|b| backend.info(b)),
            out: Some(backend.info(out)),
            lse: lse.map(|b| backend.info(b)),
        },
    )?;
    backend.supports(problem)
}

/// The buffer half of [`check_call`], for entry points whose buffers are
/// not a backend's own (described by their [`Buffers`] instead): a
/// log-sum-exp buffer when the options ask for one, then every buffer
/// against its view.
pub fn check_buffers(problem: &Problem, buffers: &Buffers) -> Result<()> {
    if problem.options.return_lse && buffers.lse.is_none() {
        return Err(crate::AttnError::Missing {
            tensor: "lse",
            what: "options.return_lse is set but no buffer was given",
        });
    }
    problem.validate_buffers(buffers)
}
