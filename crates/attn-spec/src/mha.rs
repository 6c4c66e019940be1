//! Multi-head attention around any backend: project, split into heads,
//! attend, merge, project. Grouped-query attention when `kv_heads <
//! q_heads`; cross-attention when a separate key/value input is given.
//!
//! The projections produce `[batch, seq, heads * head_dim]` row-major, which
//! is exactly the default `[batch, seq, heads, head_dim]` view of the
//! problem, and the attention output in that layout is the input of the
//! output projection: splitting and merging heads costs no copy.

use crate::backend::{Backend, Inputs};
use crate::error::{AttnError, Result};
use crate::linear::Linear;
use crate::maps::{AttentionMaps, MapRequest, Maps};
use crate::options::AttnOptions;
use crate::problem::{Problem, Shape};

/// Sizes of a multi-head attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MhaConfig {
    /// Features of the query input.
    pub model_dim: usize,
    /// Features of the key/value input (equal to `model_dim` for
    /// self-attention).
    pub kv_model_dim: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads (divides `q_heads`).
    pub kv_heads: usize,
    /// Head dimension of queries and keys.
    pub head_dim_qk: usize,
    /// Head dimension of values.
    pub head_dim_v: usize,
    /// Features of the output.
    pub out_dim: usize,
}

impl MhaConfig {
    /// The usual layer: `model_dim = heads * head_dim`, output `model_dim`,
    /// `kv_heads` key/value heads.
    pub fn new(model_dim: usize, q_heads: usize, kv_heads: usize) -> Self {
        let hd = model_dim / q_heads.max(1);
        MhaConfig {
            model_dim,
            kv_model_dim: model_dim,
            q_heads,
            kv_heads,
            head_dim_qk: hd,
            head_dim_v: hd,
            out_dim: model_dim,
        }
    }
}

/// The weights of a layer, each `[out_features, in_features]` as PyTorch's
/// `nn.Linear`, biases `[out_features]`.
#[derive(Debug)]
pub struct MhaWeights<T> {
    /// `[q_heads * head_dim_qk, model_dim]`.
    pub wq: T,
    /// `[kv_heads * head_dim_qk, kv_model_dim]`.
    pub wk: T,
    /// `[kv_heads * head_dim_v, kv_model_dim]`.
    pub wv: T,
    /// `[out_dim, q_heads * head_dim_v]`.
    pub wo: T,
    /// Optional biases of the four projections, in the same order.
    pub biases: Option<[T; 4]>,
}

/// A multi-head attention layer on backend `B`.
#[derive(Debug)]
pub struct MultiHeadAttention<B: Backend> {
    backend: B,
    config: MhaConfig,
    weights: MhaWeights<B::Buffer>,
}

impl<B: Backend> MultiHeadAttention<B> {
    /// A layer with weights already on the backend. Checks the
    /// configuration and every weight's size and element type.
    pub fn new(backend: B, config: MhaConfig, weights: MhaWeights<B::Buffer>) -> Result<Self> {
        let c = config;
        for (what, v) in [
            ("model_dim", c.model_dim),
            ("kv_model_dim", c.kv_model_dim),
            ("out_dim", c.out_dim),
        ] {
            if v == 0 {
                return Err(AttnError::ZeroSize { what });
            }
        }
        Problem::new(
            Shape::new(1, c.q_heads, c.kv_heads, 1, 1, c.head_dim_qk),
            crate::DType::F32,
        )
        .validate()?;
        let dt = backend.info(&weights.wq).dtype;
        let over = AttnError::Overflow {
            what: "weight sizes",
        };
        let hq = c.q_heads.checked_mul(c.head_dim_qk).ok_or(over.clone())?;
        let hk = c.kv_heads.checked_mul(c.head_dim_qk).ok_or(over.clone())?;
        let hv = c.kv_heads.checked_mul(c.head_dim_v).ok_or(over.clone())?;
        let ho = c.q_heads.checked_mul(c.head_dim_v).ok_or(over.clone())?;
        let sizes = [
            ("wq", &weights.wq, hq, c.model_dim),
            ("wk", &weights.wk, hk, c.kv_model_dim),
            ("wv", &weights.wv, hv, c.kv_model_dim),
            ("wo", &weights.wo, c.out_dim, ho),
        ];
        for (tensor, w, rows, cols) in sizes {
            let info = backend.info(w);
            let want = rows.checked_mul(cols).ok_or(over.clone())?;
            if info.len != want {
                return Err(AttnError::Shape {
                    tensor,
                    axis: "out_features * in_features",
                    expected: want,
                    got: info.len,
                });
            }
            if info.dtype != dt {
                return Err(AttnError::DType {
                    tensor,
                    expected: format!("{dt} (wq's type)"),
                    got: info.dtype,
                });
            }
        }
        if let Some(bs) = &weights.biases {
            let names = ["bq", "bk", "bv", "bo"];
            for ((tensor, bias), want) in names.into_iter().zip(bs).zip([hq, hk, hv, c.out_dim]) {
                let info = backend.info(bias);
                if info.len != want {
                    return Err(AttnError::Shape {
                        tensor,
                        axis: "out_features",
                        expected: want,
                        got: info.len,
                    });
                }
            }
        }
        Ok(MultiHeadAttention {
            backend,
            config,
            weights,
        })
    }

    /// The layer's sizes.
    pub fn config(&self) -> MhaConfig {
        self.config
    }

    /// The backend the layer runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }
}

impl<B: Linear> MultiHeadAttention<B> {
    /// Runs the layer. `x` is `[batch, q_len, model_dim]`; `kv` is `None`
    /// for self-attention or `Some((x_kv, kv_len))` with `x_kv` `[batch,
    /// kv_len, kv_model_dim]` for cross-attention. Returns `[batch, q_len,
    /// out_dim]`. Bias and boolean-mask tensors are not taken here (the
    /// options' masks, lengths, ALiBi, softcap and sinks are); call the
    /// backend's `forward` for those.
    pub fn forward(
        &self,
        x: &B::Buffer,
        batch: usize,
        q_len: usize,
        kv: Option<(&B::Buffer, usize)>,
        options: &AttnOptions,
    ) -> Result<B::Buffer> {
        let (q, k, v, rows_q, problem) = self.project(x, batch, q_len, kv, options, false)?;
        let o = self.backend.forward(&problem, Inputs::new(&q, &k, &v))?;
        self.project_out(&o.out, rows_q)
    }

    /// [`forward`](Self::forward) that also returns the attention maps
    /// of the call that `request` selects (`[batches, heads, q_len rows,
    /// kv_len]` f32, see [`crate::maps`]), recomputed from the call's
    /// log-sum-exp: PyTorch's `need_weights=True` (with
    /// `average_attn_weights` as [`MapRequest::averaged`]).
    #[allow(clippy::type_complexity)] // the output and the maps
    pub fn forward_with_maps(
        &self,
        x: &B::Buffer,
        batch: usize,
        q_len: usize,
        kv: Option<(&B::Buffer, usize)>,
        options: &AttnOptions,
        request: &MapRequest,
    ) -> Result<(B::Buffer, Maps<B::Buffer>)>
    where
        B: AttentionMaps,
    {
        let (q, k, v, rows_q, problem) = self.project(x, batch, q_len, kv, options, true)?;
        // Refuse an over-budget request before attending.
        request.resolve(&problem)?;
        let inputs = Inputs::new(&q, &k, &v);
        let o = self.backend.forward(&problem, inputs)?;
        let maps = self
            .backend
            .maps(&problem, inputs, o.lse.as_ref(), request)?;
        Ok((self.project_out(&o.out, rows_q)?, maps))
    }

    /// Q, K and V of a call, its query rows and its problem (with the
    /// log-sum-exp when `lse`).
    #[allow(clippy::type_complexity)] // the three projections and the problem
    fn project(
        &self,
        x: &B::Buffer,
        batch: usize,
        q_len: usize,
        kv: Option<(&B::Buffer, usize)>,
        options: &AttnOptions,
        lse: bool,
    ) -> Result<(B::Buffer, B::Buffer, B::Buffer, usize, Problem)> {
        let c = self.config;
        let (x_kv, kv_len) = kv.unwrap_or((x, q_len));
        if kv.is_none() && c.kv_model_dim != c.model_dim {
            return Err(AttnError::Shape {
                tensor: "x_kv",
                axis: "features",
                expected: c.kv_model_dim,
                got: c.model_dim,
            });
        }
        let over = AttnError::Overflow {
            what: "batch * seq",
        };
        let rows_q = batch.checked_mul(q_len).ok_or(over.clone())?;
        let rows_kv = batch.checked_mul(kv_len).ok_or(over)?;
        let w = &self.weights;
        let b = |i: usize| w.biases.as_ref().map(|bs| &bs[i]);
        let be = &self.backend;
        let q = be.linear(
            x,
            rows_q,
            &w.wq,
            b(0),
            c.model_dim,
            c.q_heads * c.head_dim_qk,
        )?;
        let k = be.linear(
            x_kv,
            rows_kv,
            &w.wk,
            b(1),
            c.kv_model_dim,
            c.kv_heads * c.head_dim_qk,
        )?;
        let v = be.linear(
            x_kv,
            rows_kv,
            &w.wv,
            b(2),
            c.kv_model_dim,
            c.kv_heads * c.head_dim_v,
        )?;
        let shape = Shape::new(batch, c.q_heads, c.kv_heads, q_len, kv_len, c.head_dim_qk)
            .with_head_dim_v(c.head_dim_v);
        let mut opts = options.clone();
        opts.return_lse = lse;
        let problem = Problem::new(shape, be.info(x).dtype).with_options(opts);
        Ok((q, k, v, rows_q, problem))
    }

    /// The output projection of the attention result (`rows` rows).
    fn project_out(&self, o: &B::Buffer, rows: usize) -> Result<B::Buffer> {
        let c = self.config;
        let b3 = self.weights.biases.as_ref().map(|bs| &bs[3]);
        self.backend.linear(
            o,
            rows,
            &self.weights.wo,
            b3,
            c.q_heads * c.head_dim_v,
            c.out_dim,
        )
    }
}
