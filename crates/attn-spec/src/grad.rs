//! The backward pass: what a backend is given (the forward's inputs, its
//! output `O`, its log-sum-exp and the gradient `dO` of the loss with
//! respect to `O`), what it computes (`dQ`, `dK`, `dV`, and on request the
//! gradients of the additive bias and of the sinks), and the one
//! validation every backend runs first ([`check_backward_call`]).
//!
//! The formulas and what a backend may round are specified in
//! `docs/SEMANTICS.md`, section 7b. The gradients are written in the views
//! of the tensors they belong to: `dQ` through `problem.q`, `dK` through
//! `problem.k`, `dV` through `problem.v`, in the problem's element type;
//! elements of those buffers outside the views are left untouched. The
//! bias gradient is f32, contiguous, with the dims of the bias view (a
//! broadcast axis of the bias is summed over); the sinks' gradient is f32
//! `[q_heads]`.

use crate::backend::{Backend, Inputs};
use crate::dtype::DType;
use crate::error::{AttnError, Result};
use crate::problem::{BufferInfo, Buffers, Problem};
use crate::tensor::View;

/// The forward results the backward pass reads.
#[derive(Debug)]
pub struct GradInputs<'a, B> {
    /// The forward output `O`, laid out as `problem.out`.
    pub out: &'a B,
    /// The forward log-sum-exp, f32 `[batch, q_heads, q_len]`
    /// ([`Problem::lse_view`]). Required: `None` is an error
    /// ([`AttnError::Missing`]), since the gradients are computed from the
    /// probabilities it recovers.
    pub lse: Option<&'a B>,
    /// `dO`, the gradient of the loss with respect to `O`, laid out as
    /// `problem.out`.
    pub d_out: &'a B,
}

impl<B> Clone for GradInputs<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for GradInputs<'_, B> {}

/// The buffers a backward call writes.
#[derive(Debug)]
pub struct GradOutputs<'a, B> {
    /// `dQ`, written through `problem.q` (problem's element type).
    pub dq: &'a mut B,
    /// `dK`, written through `problem.k`. Under GQA the gradient of a K/V
    /// head sums over the query heads that share it.
    pub dk: &'a mut B,
    /// `dV`, written through `problem.v`.
    pub dv: &'a mut B,
    /// The gradient of the additive bias when wanted: f32, contiguous,
    /// with the dims of the bias view ([`Problem::dbias_view`]).
    pub dbias: Option<&'a mut B>,
    /// The gradient of the sink logits when wanted: f32 `[q_heads]`.
    pub dsinks: Option<&'a mut B>,
}

/// Which optional gradients [`Backward::backward`] computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GradRequest {
    /// The gradient of the additive bias (the problem must have one).
    pub bias: bool,
    /// The gradient of the sink logits (the options must have sinks).
    pub sinks: bool,
}

impl GradRequest {
    /// Every gradient the problem has a tensor for.
    pub fn all(problem: &Problem) -> Self {
        GradRequest {
            bias: problem.bias.is_some(),
            sinks: problem.options.sinks.is_some(),
        }
    }
}

/// The gradients [`Backward::backward`] allocates and returns.
#[derive(Debug)]
pub struct Grads<B> {
    /// `dQ`, laid out as `problem.q`.
    pub dq: B,
    /// `dK`, laid out as `problem.k`.
    pub dk: B,
    /// `dV`, laid out as `problem.v`.
    pub dv: B,
    /// The bias gradient, when requested.
    pub dbias: Option<B>,
    /// The sinks' gradient, when requested.
    pub dsinks: Option<B>,
}

/// A backend that also computes the backward pass.
pub trait Backward: Backend {
    /// Computes the gradients into `grads`. Implementations start with
    /// [`check_backward_call`]. Every element inside the views of `dq`,
    /// `dk`, `dv` is written (zero where no visible pair reaches it);
    /// elements outside them are untouched.
    fn backward_into(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
        forward: GradInputs<'_, Self::Buffer>,
        grads: GradOutputs<'_, Self::Buffer>,
    ) -> Result<()>;

    /// Allocates the gradients `want` asks for (plus dQ, dK, dV) and
    /// computes them.
    fn backward(
        &self,
        problem: &Problem,
        inputs: Inputs<'_, Self::Buffer>,
        forward: GradInputs<'_, Self::Buffer>,
        want: GradRequest,
    ) -> Result<Grads<Self::Buffer>> {
        problem.validate()?;
        let len = |v: &View| v.extent().unwrap_or(0);
        let mut dq = self.zeros(problem.dtype, len(&problem.q))?;
        let mut dk = self.zeros(problem.dtype, len(&problem.k))?;
        let mut dv = self.zeros(problem.dtype, len(&problem.v))?;
        let mut dbias = match (want.bias, problem.dbias_view()) {
            (true, Some(v)) => Some(self.zeros(DType::F32, len(&v))?),
            _ => None,
        };
        let mut dsinks = match (want.sinks, &problem.options.sinks) {
            (true, Some(s)) => Some(self.zeros(DType::F32, s.len())?),
            _ => None,
        };
        if want.bias && dbias.is_none() {
            return Err(no_tensor("dbias"));
        }
        if want.sinks && dsinks.is_none() {
            return Err(no_tensor("dsinks"));
        }
        self.backward_into(
            problem,
            inputs,
            forward,
            GradOutputs {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
                dbias: dbias.as_mut(),
                dsinks: dsinks.as_mut(),
            },
        )?;
        Ok(Grads {
            dq,
            dk,
            dv,
            dbias,
            dsinks,
        })
    }
}

fn no_tensor(tensor: &'static str) -> AttnError {
    AttnError::Missing {
        tensor,
        what: if tensor == "dbias" {
            "a bias gradient was asked for but the problem has no bias"
        } else {
            "a sinks gradient was asked for but the options have no sinks"
        },
    }
}

/// The buffers of one backward call, as element types and lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GradBuffers {
    /// The forward output.
    pub out: BufferInfo,
    /// The forward log-sum-exp, when given.
    pub lse: Option<BufferInfo>,
    /// `dO`.
    pub d_out: BufferInfo,
    /// `dQ`.
    pub dq: BufferInfo,
    /// `dK`.
    pub dk: BufferInfo,
    /// `dV`.
    pub dv: BufferInfo,
    /// The bias gradient, when wanted.
    pub dbias: Option<BufferInfo>,
    /// The sinks' gradient, when wanted.
    pub dsinks: Option<BufferInfo>,
}

impl Problem {
    /// The view of the bias gradient: f32, contiguous, the dims of the
    /// bias view (`None` without a bias).
    pub fn dbias_view(&self) -> Option<View> {
        self.bias.map(|d| View::contiguous(d.view.dims))
    }

    /// Checks a backward call: the problem and the forward inputs
    /// ([`Problem::validate_buffers`]), then the forward's output and
    /// log-sum-exp, `dO` and every gradient buffer against its view, and
    /// that no gradient view maps two elements to one place.
    pub fn validate_backward(&self, inputs: &Buffers, g: &GradBuffers) -> Result<()> {
        let forward = Buffers {
            out: None,
            lse: None,
            ..*inputs
        };
        self.validate_buffers(&forward)?;
        let lse = g.lse.ok_or(AttnError::Missing {
            tensor: "lse",
            what: "the backward pass needs the forward's log-sum-exp",
        })?;
        for (tensor, view) in [("dq", &self.q), ("dk", &self.k), ("dv", &self.v)] {
            if view.may_alias() {
                return Err(AttnError::Aliasing { tensor });
            }
        }
        let same = format!("{} (the problem's dtype)", self.dtype);
        let mut list = vec![
            ("out", g.out, self.out, self.dtype, same.clone()),
            ("lse", lse, self.lse_view(), DType::F32, "f32".into()),
            ("d_out", g.d_out, self.out, self.dtype, same.clone()),
            ("dq", g.dq, self.q, self.dtype, same.clone()),
            ("dk", g.dk, self.k, self.dtype, same.clone()),
            ("dv", g.dv, self.v, self.dtype, same),
        ];
        match (g.dbias, self.dbias_view()) {
            (Some(info), Some(view)) => list.push(("dbias", info, view, DType::F32, "f32".into())),
            (Some(_), None) => return Err(no_tensor("dbias")),
            _ => {}
        }
        match (g.dsinks, &self.options.sinks) {
            (Some(info), Some(s)) => {
                let view = View::contiguous([1, 1, 1, s.len()]);
                list.push(("dsinks", info, view, DType::F32, "f32".into()));
            }
            (Some(_), None) => return Err(no_tensor("dsinks")),
            _ => {}
        }
        for (tensor, info, view, dtype, name) in list {
            if info.dtype != dtype {
                return Err(AttnError::DType {
                    tensor,
                    expected: name,
                    got: info.dtype,
                });
            }
            let needed = view.extent().ok_or(AttnError::Overflow {
                what: "a view's extent",
            })?;
            if info.len < needed {
                return Err(AttnError::BufferTooSmall {
                    tensor,
                    needed,
                    len: info.len,
                });
            }
        }
        Ok(())
    }
}

/// The check every `backward_into` runs first: validates the problem, the
/// inputs, the forward results and every gradient buffer, then asks the
/// backend whether it supports the problem.
pub fn check_backward_call<B: Backward + ?Sized>(
    backend: &B,
    problem: &Problem,
    inputs: &Inputs<'_, B::Buffer>,
    forward: &GradInputs<'_, B::Buffer>,
    grads: &GradOutputs<'_, B::Buffer>,
) -> Result<()> {
    let info = |b: &B::Buffer| backend.info(b);
    problem.validate_backward(
        &Buffers {
            q: info(inputs.q),
            k: info(inputs.k),
            v: info(inputs.v),
            bias: inputs.bias.map(info),
            mask: inputs.mask.map(info),
            out: None,
            lse: None,
        },
        &GradBuffers {
            out: info(forward.out),
            lse: forward.lse.map(info),
            d_out: info(forward.d_out),
            dq: info(grads.dq),
            dk: info(grads.dk),
            dv: info(grads.dv),
            dbias: grads.dbias.as_deref().map(info),
            dsinks: grads.dsinks.as_deref().map(info),
        },
    )?;
    backend.supports(problem)
}
