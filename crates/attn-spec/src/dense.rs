//! A second, independent formulation of the contract, used only to check the
//! reference: it materialises the whole score matrix of a head, decides
//! visibility with the element-wise definition [`crate::SeqMask::visible`]
//! (not the range functions), and treats the sink as one more key whose
//! value vector is zero. Agreement of two differently written programs is
//! the evidence that the oracle computes what `docs/SEMANTICS.md` says.

use crate::backend::Inputs;
use crate::problem::Problem;
use crate::reference::RefResult;
use crate::tensor::HostData;

/// Computes attention in f64 by the dense formulation. The caller has
/// validated the problem against the buffers.
pub fn attend_dense(p: &Problem, inp: Inputs<'_, HostData>) -> RefResult {
    let s = p.shape;
    let (sq, sk, dv) = (s.q_len, s.kv_len, s.head_dim_v);
    let mut out = vec![0.0; s.batch * sq * s.q_heads * dv];
    let mut lse = vec![f64::NEG_INFINITY; s.batch * s.q_heads * sq];
    let mut probs = vec![0.0; s.batch * s.q_heads * sq * sk];
    let o = &p.options;
    let scale = p.scale_exact();
    let ninf = f64::NEG_INFINITY;
    for b in 0..s.batch {
        let m = p.seq_mask(b);
        for h in 0..s.q_heads {
            let g = s.kv_head(h);
            // The extended score matrix: column `sk` is the sink.
            let mut sc = vec![ninf; sq * (sk + 1)];
            for i in 0..sq {
                let q: Vec<f64> = (0..s.head_dim_qk)
                    .map(|d| inp.q.get(p.q.index([b, i, h, d])))
                    .collect();
                for j in 0..sk {
                    let k: Vec<f64> = (0..s.head_dim_qk)
                        .map(|d| inp.k.get(p.k.index([b, j, g, d])))
                        .collect();
                    let raw: f64 = q.iter().zip(&k).map(|(a, c)| a * c).sum::<f64>() * scale;
                    let capped = o
                        .softcap
                        .map_or(raw, |c| f64::from(c) * (raw / f64::from(c)).tanh());
                    let alibi = o.alibi_slopes.as_ref().map_or(0.0, |sl| {
                        -f64::from(sl[h]) * (j as f64 - (i as f64 + m.offset as f64)).abs()
                    });
                    let bias = match (&p.bias, inp.bias) {
                        (Some(d), Some(buf)) => buf.get(d.view.index([b, h, i, j])),
                        _ => 0.0,
                    };
                    let keep = match (&p.mask, inp.mask) {
                        (Some(v), Some(buf)) => buf.get(v.index([b, h, i, j])) != 0.0,
                        _ => true,
                    };
                    if m.visible(i, j) && keep {
                        sc[i * (sk + 1) + j] = capped + alibi + bias;
                    }
                }
                if i < m.q_len {
                    if let Some(sinks) = &o.sinks {
                        sc[i * (sk + 1) + sk] = f64::from(sinks[h]);
                    }
                }
            }
            for i in 0..sq {
                let row = &sc[i * (sk + 1)..(i + 1) * (sk + 1)];
                let mx = row.iter().copied().fold(ninf, |m, x| {
                    if m.is_nan() || x.is_nan() {
                        f64::NAN
                    } else {
                        m.max(x)
                    }
                });
                if mx == ninf {
                    continue;
                }
                let e: Vec<f64> = row.iter().map(|&x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                lse[(b * s.q_heads + h) * sq + i] = mx + z.ln();
                for j in 0..sk {
                    let pj = e[j] / z;
                    probs[((b * s.q_heads + h) * sq + i) * sk + j] = pj;
                    if pj != 0.0 || pj.is_nan() {
                        for d in 0..dv {
                            out[((b * sq + i) * s.q_heads + h) * dv + d] +=
                                pj * inp.v.get(p.v.index([b, j, g, d]));
                        }
                    }
                }
            }
        }
    }
    RefResult {
        out,
        lse,
        probs: Some(probs),
    }
}
