//! candle autograd through attn: the custom op's gradients against the f64
//! reference's (under the backward bound, allowing for the forward error
//! of the output and log-sum-exp the op kept), and against candle's plain
//! composition (matmul, softmax, matmul) differentiated by candle itself.

use attn_candle::{attention_ext, CandleBackend, Extras};
use attn_conformance::backward::{bound, compare, forward_errors, BackCase};
use attn_conformance::case::Bcast;
use attn_conformance::CaseParams;
use attn_spec::reference::backward::{gradients, RefGrads};
use attn_spec::{Backend, DType, HostData, Inputs, MaskKind, Shape};
use candle_core::{DType as CDType, Device, Tensor, Var};

fn tensor(h: &HostData, dims: &[usize]) -> Tensor {
    let v: Vec<f32> = h.to_f64_vec().iter().map(|&x| x as f32).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

fn to_dtype(t: Tensor, dt: DType) -> Tensor {
    t.to_dtype(match dt {
        DType::Bf16 => CDType::BF16,
        DType::F16 => CDType::F16,
        _ => CDType::F32,
    })
    .unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.to_dtype(CDType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The gradients of `sum(out * dO)` by candle autograd, through the attn
/// op (`fused`) or the plain composition: of Q, K, V, the bias (a
/// variable when the case has one), and through the op the sinks (passed
/// as a variable tensor instead of in the options).
fn grads(bc: &BackCase, fused: bool) -> RefGrads {
    let p = &bc.case.problem;
    let s = p.shape;
    let dt = p.dtype;
    let q_dims = [s.batch, s.q_len, s.q_heads, s.head_dim_qk];
    let k_dims = [s.batch, s.kv_len, s.kv_heads, s.head_dim_qk];
    let v_dims = [s.batch, s.kv_len, s.kv_heads, s.head_dim_v];
    let var = |h: &HostData, d: &[usize]| Var::from_tensor(&to_dtype(tensor(h, d), dt)).unwrap();
    let (q, k, v) = (
        var(&bc.case.q, &q_dims),
        var(&bc.case.k, &k_dims),
        var(&bc.case.v, &v_dims),
    );
    let d_out = tensor(&bc.d_out, &[bc.d_out.len()]);
    let bias = bc.case.bias.as_ref().map(|b| {
        Var::from_tensor(&to_dtype(
            tensor(b, &p.bias.unwrap().view.dims),
            p.bias.unwrap().dtype,
        ))
        .unwrap()
    });
    let sinks = p.options.sinks.as_ref().map(|v| {
        Var::from_tensor(&Tensor::from_vec(v.clone(), v.len(), &Device::Cpu).unwrap()).unwrap()
    });
    let mask = bc.case.mask.as_ref().map(|m| {
        tensor(m, &p.mask.unwrap().dims)
            .to_dtype(CDType::U8)
            .unwrap()
    });
    let out = if fused {
        let extras = Extras {
            bias: bias.as_deref(),
            mask: mask.as_ref(),
            sinks: sinks.as_deref(),
        };
        let mut options = p.options.clone();
        options.sinks = None;
        attention_ext(&q, &k, &v, extras, &options).unwrap().0
    } else {
        let (qf, kf, vf) = (
            q.flatten_all().unwrap(),
            k.flatten_all().unwrap(),
            v.flatten_all().unwrap(),
        );
        let (bf, mf) = (
            bias.as_deref().map(|b| b.flatten_all().unwrap()),
            mask.as_ref().map(|m| m.flatten_all().unwrap()),
        );
        let inputs = Inputs {
            q: &qf,
            k: &kf,
            v: &vf,
            bias: bf.as_ref(),
            mask: mf.as_ref(),
        };
        CandleBackend::plain_cpu().forward(p, inputs).unwrap().out
    };
    let loss = (out.flatten_all().unwrap().to_dtype(CDType::F32).unwrap() * d_out)
        .unwrap()
        .sum_all()
        .unwrap();
    let g = loss.backward().unwrap();
    let get = |x: &Var| flat(g.get(x.as_tensor()).expect("a gradient"));
    RefGrads {
        dq: get(&q),
        dk: get(&k),
        dv: get(&v),
        dbias: bias.as_ref().map(get),
        dsinks: sinks.as_ref().filter(|_| fused).map(get),
    }
}

fn cases() -> Vec<CaseParams> {
    let mut a = CaseParams::plain(Shape::new(2, 4, 2, 7, 9, 8));
    a.options.mask = MaskKind::Causal;
    a.kv_lens = true;
    a.seed = 11;
    let mut b = CaseParams::plain(Shape::new(1, 3, 1, 12, 12, 16).with_head_dim_v(8));
    b.options.softcap = Some(5.0);
    b.options.mask = MaskKind::Window {
        left: Some(4),
        right: Some(1),
    };
    b.alibi = true;
    b.sinks = true;
    b.bias = Some(Bcast {
        per_batch: false,
        per_head: true,
    });
    b.bool_mask = Some((
        Bcast {
            per_batch: true,
            per_head: false,
        },
        0.8,
    ));
    b.seed = 12;
    let mut c = CaseParams::plain(Shape::new(1, 2, 2, 33, 40, 32));
    c.dtype = DType::Bf16;
    c.options.mask = MaskKind::Causal;
    c.seed = 13;
    vec![a, b, c]
}

#[test]
fn autograd_through_attn_meets_the_backward_bound() {
    for params in cases() {
        let bc = BackCase::build(params);
        let want = gradients(&bc.case.problem, bc.case.inputs(), &bc.d_out);
        let fwd = forward_errors(&bc.case);
        let b = bound::bounds_given(&bc.case, &want, &bc.out, &bc.d_out, Some(&fwd));
        let got = grads(&bc, true);
        assert_eq!(got.dbias.is_some(), want.dbias.is_some());
        assert_eq!(got.dsinks.is_some(), want.dsinks.is_some());
        compare(&got, &want, &b).unwrap_or_else(|e| panic!("{}: {e}", bc.case.describe()));
    }
}

/// The plain composition is another f32 computation of the same
/// gradients: each within the bound of the f64 gradient, so they differ by
/// at most twice the bound.
#[test]
fn autograd_agrees_with_candles_plain_composition() {
    for params in cases() {
        let bc = BackCase::build(params);
        let want = gradients(&bc.case.problem, bc.case.inputs(), &bc.d_out);
        let fwd = forward_errors(&bc.case);
        let b = bound::bounds_given(&bc.case, &want, &bc.out, &bc.d_out, Some(&fwd));
        let twice = |x: &[f64]| x.iter().map(|e| 2.0 * e).collect::<Vec<_>>();
        let b2 = RefGrads {
            dq: twice(&b.dq),
            dk: twice(&b.dk),
            dv: twice(&b.dv),
            dbias: b.dbias.as_deref().map(twice),
            dsinks: None,
        };
        // (The plain composition takes the sinks as constants.)
        let fused = RefGrads {
            dsinks: None,
            ..grads(&bc, true)
        };
        compare(&fused, &grads(&bc, false), &b2)
            .unwrap_or_else(|e| panic!("{}: {e}", bc.case.describe()));
    }
}

/// A bias that learns while Q, K and V are constants still gets its
/// gradient (the forward keeps its log-sum-exp for it), the same as when
/// everything learns; sinks given both ways are refused.
#[test]
fn a_learned_bias_alone_gets_its_gradient() {
    let bc = BackCase::build(cases().swap_remove(1));
    let p = &bc.case.problem;
    let s = p.shape;
    let c = |h: &HostData, d: &[usize]| tensor(h, d);
    let q = c(&bc.case.q, &[s.batch, s.q_len, s.q_heads, s.head_dim_qk]);
    let k = c(&bc.case.k, &[s.batch, s.kv_len, s.kv_heads, s.head_dim_qk]);
    let v = c(&bc.case.v, &[s.batch, s.kv_len, s.kv_heads, s.head_dim_v]);
    let bias = Var::from_tensor(&c(
        bc.case.bias.as_ref().unwrap(),
        &p.bias.unwrap().view.dims,
    ))
    .unwrap();
    let mask = bc
        .case
        .mask
        .as_ref()
        .map(|m| c(m, &p.mask.unwrap().dims).to_dtype(CDType::U8).unwrap());
    let extras = Extras {
        bias: Some(&bias),
        mask: mask.as_ref(),
        sinks: None,
    };
    let out = attention_ext(&q, &k, &v, extras, &p.options).unwrap().0;
    let d_out = tensor(&bc.d_out, &[bc.d_out.len()]);
    let loss = (out.flatten_all().unwrap() * d_out)
        .unwrap()
        .sum_all()
        .unwrap();
    let g = loss.backward().unwrap();
    let alone = flat(g.get(bias.as_tensor()).expect("a bias gradient"));
    let mut all = grads(&bc, true);
    // grads() passes the sinks as a tensor; here they are options: the
    // bias gradient is the same computation either way.
    assert_eq!(Some(alone), all.dbias.take());
    let sinks = Tensor::zeros(s.q_heads, CDType::F32, &Device::Cpu).unwrap();
    let extras = Extras {
        sinks: Some(&sinks),
        ..extras
    };
    let e = attention_ext(&q, &k, &v, extras, &p.options)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sinks given twice"), "{e}");
}
