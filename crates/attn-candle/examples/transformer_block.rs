//! A small pre-norm transformer block (RMSNorm, grouped-query attention,
//! SiLU MLP, residuals) on candle tensors, with attn's fused attention and
//! key/value cache: a prompt is run at once, then tokens are decoded one at
//! a time through the cache, and the last position is checked against
//! running the whole sequence again without a cache.
//!
//! ```sh
//! cargo run --release -p attn-candle --example transformer_block
//! ```

use attn_candle::{AttnOptions, KvCache, MhaConfig, MhaWeights, MultiHeadAttention};
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Linear, RmsNorm};

/// Model width, heads, key/value heads, MLP width.
const MODEL: usize = 256;
const HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HIDDEN: usize = 688;

struct Block {
    norm1: RmsNorm,
    attn: MultiHeadAttention,
    norm2: RmsNorm,
    up: Linear,
    gate: Linear,
    down: Linear,
}

/// Weights drawn uniformly, scaled by 1/sqrt(fan_in) as a trained layer's
/// would roughly be.
fn weight(out: usize, inp: usize, dev: &Device) -> Result<Tensor> {
    let s = 1.0 / (inp as f64).sqrt();
    Tensor::rand(-s, s, (out, inp), dev)?.to_dtype(DType::F32)
}

impl Block {
    fn new(dev: &Device) -> Result<Self> {
        let c = MhaConfig::new(MODEL, HEADS, KV_HEADS);
        let kv = KV_HEADS * c.head_dim_qk;
        let attn = MultiHeadAttention::new(
            c,
            MhaWeights {
                wq: weight(MODEL, MODEL, dev)?,
                wk: weight(kv, MODEL, dev)?,
                wv: weight(kv, MODEL, dev)?,
                wo: weight(MODEL, MODEL, dev)?,
                biases: None,
            },
        )?;
        let ones = Tensor::ones(MODEL, DType::F32, dev)?;
        Ok(Block {
            norm1: RmsNorm::new(ones.clone(), 1e-6),
            attn,
            norm2: RmsNorm::new(ones, 1e-6),
            up: Linear::new(weight(HIDDEN, MODEL, dev)?, None),
            gate: Linear::new(weight(HIDDEN, MODEL, dev)?, None),
            down: Linear::new(weight(MODEL, HIDDEN, dev)?, None),
        })
    }

    fn mlp(&self, x: &Tensor) -> Result<Tensor> {
        let g = candle_nn::ops::silu(&self.gate.forward(x)?)?;
        self.down.forward(&(g * self.up.forward(x)?)?)
    }

    /// `x` is `[batch, n, MODEL]`: the next `n` positions. With a cache,
    /// they attend to everything cached so far plus themselves.
    fn forward(&self, x: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let opts = AttnOptions::default().causal();
        let h = self.norm1.forward(x)?;
        let a = match cache {
            Some(c) => self.attn.forward_cached(&h, c, &opts)?,
            None => self.attn.forward(&h, None, &opts)?,
        };
        let x = (x + a)?;
        let m = self.mlp(&self.norm2.forward(&x)?)?;
        x + m
    }
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let block = Block::new(&dev)?;
    let (batch, prompt, steps) = (2, 48, 16);
    let mut cache = block
        .attn
        .new_cache(batch, prompt + steps, DType::F32, &dev)?;

    // The prompt at once, then one position at a time: each new input is
    // the previous output's last position (a stand-in for embedding the
    // sampled token).
    let mut seq = Tensor::randn(0f32, 1.0, (batch, prompt, MODEL), &dev)?;
    let t = std::time::Instant::now();
    let mut y = block.forward(&seq, Some(&mut cache))?;
    println!(
        "prefill: {prompt} positions x {batch} sequences -> {:?} in {:.1} ms",
        y.dims(),
        t.elapsed().as_secs_f64() * 1e3
    );
    let t = std::time::Instant::now();
    for _ in 0..steps {
        let next = y.narrow(1, y.dim(1)? - 1, 1)?;
        seq = Tensor::cat(&[&seq, &next], 1)?;
        y = block.forward(&next, Some(&mut cache))?;
    }
    println!(
        "decode: {steps} steps, {:.2} ms per step, cache holds {} of {}",
        t.elapsed().as_secs_f64() * 1e3 / steps as f64,
        cache.len(),
        cache.capacity()
    );

    // The whole sequence again, no cache: the last position must agree.
    let full = block.forward(&seq, None)?;
    let last_full = full.narrow(1, full.dim(1)? - 1, 1)?;
    let diff = (last_full - &y)?.abs()?.max_keepdim(D::Minus1)?.max_all()?;
    let scale = y.abs()?.max_all()?;
    let (diff, scale) = (diff.to_scalar::<f32>()?, scale.to_scalar::<f32>()?);
    println!(
        "cached vs full recompute, last position: max |diff| = {diff:.3e} (max |y| = {scale:.3})"
    );
    // Both runs round differently only in f32 sums of at most HIDDEN terms
    // (the attention sums 64 keys), each off by at most HIDDEN * eps
    // relative (the worst-case bound of a length-HIDDEN dot product); the
    // block chains four such stages, so 4 * HIDDEN * eps bounds the gap.
    let bound = 4.0 * HIDDEN as f32 * f32::EPSILON * scale.max(1.0);
    if diff.partial_cmp(&bound) != Some(std::cmp::Ordering::Less) {
        candle_core::bail!("cached decoding disagrees with the full recompute");
    }
    println!("ok");
    Ok(())
}
