//! The plain candle composition: what a candle user writes today and the
//! baseline the benchmark report compares against. Scores are a full `S x
//! S` matrix per head (`matmul`), masks and ALiBi an additive host-built
//! tensor, the sink one extra column, then softmax and a second `matmul`;
//! computed in f32 and rounded once to the input type. It follows attn's
//! contract exactly (fully masked rows give 0 and -inf, never NaN), and
//! refuses layouts it cannot express as reshapes of the flat buffers.

use attn_spec::{Inputs, Problem, View};
use candle_core::{DType as CDType, Device, Result, Tensor};

fn is_bshd(v: &View) -> bool {
    let d = v.dims;
    v.strides == View::bshd(d[0], d[1], d[2], d[3]).strides
}

fn is_bhsd(v: &View) -> bool {
    let d = v.dims;
    v.strides == View::bhsd(d[0], d[1], d[2], d[3]).strides
}

fn is_contiguous(v: &View) -> bool {
    v.strides == View::contiguous(v.dims).strides
        || v.dims
            .iter()
            .zip(v.strides)
            .zip(View::contiguous(v.dims).strides)
            .all(|((&d, s), c)| d == 1 || s == c)
}

/// `Ok` when the plain engine can express the problem's layouts.
pub fn supports(p: &Problem) -> std::result::Result<(), String> {
    for (name, v) in [("q", &p.q), ("k", &p.k), ("v", &p.v), ("out", &p.out)] {
        if !(is_bshd(v) || is_bhsd(v)) {
            return Err(format!("tensor `{name}` has strides {:?}: only [b, s, h, d] or [b, h, s, d] layouts reshape into candle tensors", v.strides));
        }
    }
    if p.out.offset != 0 {
        return Err("an output view with an offset".into());
    }
    for (name, v) in [("bias", p.bias.map(|b| b.view)), ("mask", p.mask)] {
        if let Some(v) = v {
            if !is_contiguous(&v) {
                return Err(format!("a non-contiguous `{name}` view"));
            }
        }
    }
    Ok(())
}

/// `[b, h, s, d]` f32 from a flat buffer and its view.
fn as4(t: &Tensor, v: &View) -> Result<Tensor> {
    let [b, s, h, d] = v.dims;
    let flat = t.narrow(0, v.offset, b * s * h * d)?;
    let t4 = if is_bshd(v) {
        flat.reshape((b, s, h, d))?.transpose(1, 2)?
    } else {
        flat.reshape((b, h, s, d))?
    };
    t4.to_dtype(CDType::F32)?.contiguous()
}

/// Repeats each key/value head `group` times (GQA).
fn repeat_heads(t: Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(t);
    }
    let (b, h, s, d) = t.dims4()?;
    t.unsqueeze(2)?
        .broadcast_as((b, h, group, s, d))?
        .contiguous()?
        .reshape((b, h * group, s, d))
}

/// Computes the problem; returns the flat output (the output view's layout,
/// the input type) and the flat log-sum-exp when asked for.
pub fn forward(
    p: &Problem,
    inp: Inputs<'_, Tensor>,
    dev: &Device,
) -> Result<(Tensor, Option<Tensor>)> {
    let s = p.shape;
    let (b, hq, sq, sk) = (s.batch, s.q_heads, s.q_len, s.kv_len);
    let group = s.group();
    let o = &p.options;
    if sq == 0 || sk == 0 {
        // No scores to reduce (candle refuses empty reductions): every row
        // is output 0, and its log-sum-exp is the sink or -inf.
        let n = b * sq * hq * s.head_dim_v;
        let out = Tensor::zeros(n, super::backend::candle_dtype(p.dtype), dev)?;
        let lse = if o.return_lse {
            let mut l = vec![f32::NEG_INFINITY; b * hq * sq];
            for bi in 0..b {
                for h in 0..hq {
                    for i in 0..p.seq_lens(bi).0 {
                        if let Some(sinks) = &o.sinks {
                            l[(bi * hq + h) * sq + i] = sinks[h];
                        }
                    }
                }
            }
            Some(Tensor::from_vec(l, b * hq * sq, dev)?)
        } else {
            None
        };
        return Ok((out, lse));
    }
    let v4 = repeat_heads(as4(inp.v, &p.v)?, group)?;
    let Probs { pr, m_safe, z, .. } = probs(p, inp, dev, false)?;
    let o4 = pr.matmul(&v4)?; // [b, hq, sq, dv]
    let o4 = if is_bshd(&p.out) {
        o4.transpose(1, 2)?.contiguous()?
    } else {
        o4
    };
    let out = o4
        .to_dtype(super::backend::candle_dtype(p.dtype))?
        .flatten_all()?;
    let lse = if o.return_lse {
        let l: Vec<f32> = m_safe
            .iter()
            .zip(&z)
            .map(|(&mx, &zz)| {
                if zz == 0.0 {
                    f32::NEG_INFINITY
                } else {
                    mx + zz.ln()
                }
            })
            .collect();
        Some(Tensor::from_vec(l, b * hq * sq, dev)?)
    } else {
        None
    };
    Ok((out, lse))
}

/// The probabilities of the plain composition and what the forward needs
/// of its softmax.
pub struct Probs {
    /// `[b, hq, sq, sk]` f32: 0 where hidden, rows summing to 1 minus the
    /// sink's share.
    pub pr: Tensor,
    /// Each row's maximum, 0 for rows that see nothing.
    pub m_safe: Vec<f32>,
    /// Each row's sum of exponentials.
    pub z: Vec<f32>,
    /// `[b, hq, sq, sk]` u8, 1 where the pair is visible (when asked for).
    pub visible: Option<Tensor>,
}

/// Scores, masks and softmax of the plain composition (`sq`, `sk` > 0).
pub fn probs(
    p: &Problem,
    inp: Inputs<'_, Tensor>,
    dev: &Device,
    want_visible: bool,
) -> Result<Probs> {
    let s = p.shape;
    let (b, hq, sq, sk) = (s.batch, s.q_heads, s.q_len, s.kv_len);
    let group = s.group();
    let o = &p.options;
    let q4 = as4(inp.q, &p.q)?;
    let k4 = repeat_heads(as4(inp.k, &p.k)?, group)?;
    let mut sc = (q4.matmul(&k4.transpose(2, 3)?.contiguous()?)? * f64::from(p.scale()))?;
    if let Some(cap) = o.softcap {
        sc = ((sc / f64::from(cap))?.tanh()? * f64::from(cap))?;
    }
    // ALiBi, per-sequence lengths, window and boolean mask: one additive
    // host-built tensor (0 or the ALiBi term where visible, -inf elsewhere).
    let mask_host = match (inp.mask, &p.mask) {
        (Some(m), Some(v)) => Some((m.flatten_all()?.to_vec1::<u8>()?, *v)),
        _ => None,
    };
    let mut add = vec![0f32; b * hq * sq * sk];
    for bi in 0..b {
        let m = p.seq_mask(bi);
        for h in 0..hq {
            for i in 0..sq {
                for j in 0..sk {
                    // The distance in integers, rounded once: exact below
                    // 2^24 (the difference of two rounded f32 keys is not).
                    let dist = (j as i64).abs_diff(m.diagonal(i)) as f32;
                    let mut x = o.alibi_slopes.as_ref().map_or(0.0, |sl| -sl[h] * dist);
                    let keep = mask_host
                        .as_ref()
                        .is_none_or(|(mv, v)| mv[v.index([bi, h, i, j])] != 0);
                    if !m.visible(i, j) || !keep {
                        x = f32::NEG_INFINITY;
                    }
                    add[((bi * hq + h) * sq + i) * sk + j] = x;
                }
            }
        }
    }
    let add_t = Tensor::from_vec(add, (b, hq, sq, sk), dev)?;
    sc = (sc + &add_t)?;
    let mut bias4 = None;
    if let (Some(bt), Some(bd)) = (inp.bias, &p.bias) {
        let [db, dh, _, _] = bd.view.dims;
        let b4 = bt
            .narrow(0, bd.view.offset, db * dh * sq * sk)?
            .reshape((db, dh, sq, sk))?
            .to_dtype(CDType::F32)?;
        sc = sc.broadcast_add(&b4)?;
        bias4 = Some(b4);
    }
    // The sink: one more column, -inf on padding rows.
    let ext = match &o.sinks {
        Some(sinks) => {
            let mut col = vec![f32::NEG_INFINITY; b * hq * sq];
            for bi in 0..b {
                let ql = p.seq_lens(bi).0;
                for h in 0..hq {
                    for i in 0..ql {
                        col[(bi * hq + h) * sq + i] = sinks[h];
                    }
                }
            }
            Tensor::cat(&[&sc, &Tensor::from_vec(col, (b, hq, sq, 1), dev)?], 3)?
        }
        None => sc,
    };
    // Softmax with the row maximum made safe for rows that see nothing
    // (a -inf maximum becomes f32::MIN, so exp gives 0, and a zero sum
    // becomes 1, so those rows are 0). All tensor ops:
    // candle autograd differentiates it (the maximum is a constant shift).
    let mx = ext.max_keepdim(3)?;
    let m: Vec<f32> = mx.flatten_all()?.to_vec1()?;
    let e = ext.broadcast_sub(&mx.maximum(f32::MIN)?.detach())?.exp()?;
    let zt = e.sum_keepdim(3)?;
    let z: Vec<f32> = zt.flatten_all()?.to_vec1()?;
    let ones_where_empty: Vec<f32> = z.iter().map(|&x| f32::from(u8::from(x == 0.0))).collect();
    let zt = (zt + Tensor::from_vec(ones_where_empty, (b, hq, sq, 1), dev)?)?;
    let pr = e.broadcast_div(&zt)?;
    let m_safe: Vec<f32> = m
        .iter()
        .map(|&x| if x == f32::NEG_INFINITY { 0.0 } else { x })
        .collect();
    let pr = pr.narrow(3, 0, sk)?.contiguous()?;
    let visible = if want_visible {
        let mut vis = add_t.ne(f32::NEG_INFINITY)?;
        if let Some(b4) = &bias4 {
            vis = vis.broadcast_mul(&b4.ne(f32::NEG_INFINITY)?)?;
        }
        Some(vis)
    } else {
        None
    };
    Ok(Probs {
        pr,
        m_safe,
        z,
        visible,
    })
}
