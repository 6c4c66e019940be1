//! Multi-head attention for candle users: weights as candle tensors,
//! projections by candle's matmul (`candle_nn::Linear`), attention by
//! attn's fused op, and a key/value cache for incremental decoding.
//!
//! The projections give `[batch, seq, heads * head_dim]`, which reshapes
//! without a copy to the `[batch, seq, heads, head_dim]` the op reads; the
//! cache keeps keys and values in one preallocated `[batch, capacity,
//! kv_heads, head_dim]` tensor each and hands the op a narrowed view of the
//! filled part (strided when `batch > 1`, read in place all the same).

use crate::{attention, AttnOptions};
use attn_spec::{MapRequest, MhaConfig, MhaWeights};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::Linear;

/// A multi-head (grouped-query when `kv_heads < q_heads`) attention layer
/// on candle tensors.
#[derive(Clone, Debug)]
pub struct MultiHeadAttention {
    config: MhaConfig,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
}

fn check_dims(what: &str, t: &Tensor, want: &[usize]) -> Result<()> {
    if t.dims() != want {
        candle_core::bail!(
            "attn: {what} must have shape {want:?} ([out_features, in_features] as nn.Linear), got {:?}",
            t.dims()
        );
    }
    Ok(())
}

impl MultiHeadAttention {
    /// A layer from its sizes and weights (each `[out_features,
    /// in_features]`, biases `[out_features]`, as `nn.Linear`). Checks every
    /// weight's shape and that all share one dtype.
    pub fn new(config: MhaConfig, weights: MhaWeights<Tensor>) -> Result<Self> {
        let c = config;
        if c.q_heads == 0 || c.kv_heads == 0 || !c.q_heads.is_multiple_of(c.kv_heads) {
            candle_core::bail!(
                "attn: q_heads ({}) must be a positive multiple of kv_heads ({})",
                c.q_heads,
                c.kv_heads
            );
        }
        let (hq, hk, hv, ho) = (
            c.q_heads * c.head_dim_qk,
            c.kv_heads * c.head_dim_qk,
            c.kv_heads * c.head_dim_v,
            c.q_heads * c.head_dim_v,
        );
        let w = &weights;
        check_dims("wq", &w.wq, &[hq, c.model_dim])?;
        check_dims("wk", &w.wk, &[hk, c.kv_model_dim])?;
        check_dims("wv", &w.wv, &[hv, c.kv_model_dim])?;
        check_dims("wo", &w.wo, &[c.out_dim, ho])?;
        for (name, t) in [("wk", &w.wk), ("wv", &w.wv), ("wo", &w.wo)] {
            if t.dtype() != w.wq.dtype() {
                candle_core::bail!(
                    "attn: {name} is {:?} but wq is {:?}: the weights must share one dtype",
                    t.dtype(),
                    w.wq.dtype()
                );
            }
        }
        let [bq, bk, bv, bo] = match weights.biases {
            Some([a, b, c2, d]) => {
                for (name, t, n) in [
                    ("bq", &a, hq),
                    ("bk", &b, hk),
                    ("bv", &c2, hv),
                    ("bo", &d, c.out_dim),
                ] {
                    check_dims(name, t, &[n])?;
                }
                [Some(a), Some(b), Some(c2), Some(d)]
            }
            None => [None, None, None, None],
        };
        Ok(MultiHeadAttention {
            config,
            wq: Linear::new(weights.wq, bq),
            wk: Linear::new(weights.wk, bk),
            wv: Linear::new(weights.wv, bv),
            wo: Linear::new(weights.wo, bo),
        })
    }

    /// The layer's sizes.
    pub fn config(&self) -> MhaConfig {
        self.config
    }

    /// Queries of `x` (`[batch, seq, model_dim]`) as `[batch, seq, q_heads,
    /// head_dim_qk]`.
    pub fn project_q(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.config;
        let (b, s, _) = x.dims3()?;
        self.wq
            .forward(x)?
            .reshape((b, s, c.q_heads, c.head_dim_qk))
    }

    /// Keys and values of `x_kv` (`[batch, seq, kv_model_dim]`) as
    /// `[batch, seq, kv_heads, head_dim_qk]` and `[.., head_dim_v]`.
    pub fn project_kv(&self, x_kv: &Tensor) -> Result<(Tensor, Tensor)> {
        let c = self.config;
        let (b, s, _) = x_kv.dims3()?;
        let k = self.wk.forward(x_kv)?;
        let v = self.wv.forward(x_kv)?;
        Ok((
            k.reshape((b, s, c.kv_heads, c.head_dim_qk))?,
            v.reshape((b, s, c.kv_heads, c.head_dim_v))?,
        ))
    }

    /// The output projection of an attention result `[batch, seq, q_heads,
    /// head_dim_v]`: heads merged (a reshape), then `wo`.
    pub fn project_out(&self, o: &Tensor) -> Result<Tensor> {
        let (b, s, h, d) = o.dims4()?;
        self.wo.forward(&o.reshape((b, s, h * d))?)
    }

    /// Runs the layer on `x` (`[batch, q_len, model_dim]`), attending to
    /// `kv` (`[batch, kv_len, kv_model_dim]`, cross-attention) or to `x`
    /// itself when `kv` is `None`. Returns `[batch, q_len, out_dim]`.
    pub fn forward(
        &self,
        x: &Tensor,
        kv: Option<&Tensor>,
        options: &AttnOptions,
    ) -> Result<Tensor> {
        let q = self.project_q(x)?;
        let (k, v) = self.project_kv(kv.unwrap_or(x))?;
        self.project_out(&attention(&q, &k, &v, options)?)
    }

    /// [`forward`](Self::forward) that also returns the attention maps of
    /// the call that `request` selects (`[batches, heads, q_len rows,
    /// kv_len]` f32, see [`crate::attention_maps`]): PyTorch's
    /// `need_weights=True`, with `average_attn_weights` as
    /// [`MapRequest::averaged`].
    pub fn forward_with_maps(
        &self,
        x: &Tensor,
        kv: Option<&Tensor>,
        options: &AttnOptions,
        request: &MapRequest,
    ) -> Result<(Tensor, Tensor)> {
        let q = self.project_q(x)?;
        let (k, v) = self.project_kv(kv.unwrap_or(x))?;
        crate::maps::check_request(&q, &k, &v, options, request)?;
        let (o, lse) = crate::attention_with_lse(&q, &k, &v, options)?;
        let maps = crate::attention_maps(&q, &k, &v, Some(&lse), options, request)?;
        Ok((self.project_out(&o)?, maps))
    }

    /// A cache for this layer's keys and values: `capacity` positions for
    /// `batch` sequences, in `dtype` on `device`.
    pub fn new_cache(
        &self,
        batch: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<KvCache> {
        let c = self.config;
        KvCache::new(
            batch,
            capacity,
            c.kv_heads,
            (c.head_dim_qk, c.head_dim_v),
            dtype,
            device,
        )
    }

    /// Incremental self-attention: projects `x` (`[batch, n, model_dim]`,
    /// the next `n` positions), appends its keys and values to `cache`, and
    /// attends from the `n` new queries to every cached position. With a
    /// causal option the mask is aligned bottom-right (attn's default), so
    /// new position `i` sees the cache up to and including itself: the same
    /// result as running the whole sequence at once.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        options: &AttnOptions,
    ) -> Result<Tensor> {
        let o = self.attend_cached(x, cache, options)?;
        self.project_out(&o)
    }

    /// [`forward_cached`](Self::forward_cached) without the output
    /// projection: the attention result `[batch, n, q_heads, head_dim_v]`.
    pub fn attend_cached(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        options: &AttnOptions,
    ) -> Result<Tensor> {
        let q = self.project_q(x)?;
        let (k_new, v_new) = self.project_kv(x)?;
        let (k, v) = cache.append(&k_new, &v_new)?;
        attention(&q, &k, &v, options)
    }
}

/// Keys and values of the positions seen so far, for incremental decoding:
/// one preallocated `[batch, capacity, kv_heads, head_dim]` tensor each,
/// filled from the front.
#[derive(Clone, Debug)]
pub struct KvCache {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl KvCache {
    /// An empty cache of `capacity` positions; `head_dims` is `(head_dim_qk,
    /// head_dim_v)`.
    pub fn new(
        batch: usize,
        capacity: usize,
        kv_heads: usize,
        head_dims: (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(KvCache {
            k: Tensor::zeros((batch, capacity, kv_heads, head_dims.0), dtype, device)?,
            v: Tensor::zeros((batch, capacity, kv_heads, head_dims.1), dtype, device)?,
            len: 0,
        })
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.k.dims()[1]
    }

    /// Forgets every position (the storage is kept).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Appends `k` and `v` (`[batch, n, kv_heads, head_dim]`) and returns
    /// views of every filled position, `[batch, len, kv_heads, head_dim]`
    /// (no copy of the cache). Fails, changing nothing, when the cache is
    /// full or the shapes disagree.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = k.dim(1)?;
        if v.dim(1)? != n {
            candle_core::bail!("attn: k has {n} new positions but v has {}", v.dim(1)?);
        }
        let end = self.len + n;
        if end > self.capacity() {
            candle_core::bail!(
                "attn: the cache holds {} of {} positions; {n} more do not fit",
                self.len,
                self.capacity()
            );
        }
        self.k.slice_set(&k.contiguous()?, 1, self.len)?;
        self.v.slice_set(&v.contiguous()?, 1, self.len)?;
        self.len = end;
        Ok((self.k.narrow(1, 0, end)?, self.v.narrow(1, 0, end)?))
    }
}
