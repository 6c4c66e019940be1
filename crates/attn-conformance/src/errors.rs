//! Bad input of every kind must come back as the typed error that names it,
//! on every backend, through the public entry points. Each check states the
//! input and the error variant (with the tensor or option) it must produce.

use attn_spec::{
    AttnError, AttnOptions, Backend, DType, HostData, Inputs, Linear, MhaConfig, MhaWeights,
    MultiHeadAttention, Problem, Shape, View,
};

type Expect = fn(&AttnError) -> bool;

fn zeros(dt: DType, n: usize) -> HostData {
    HostData::zeros(dt, n)
}

/// Host buffers exactly as long as the problem's views need.
fn buffers_for(p: &Problem) -> [HostData; 3] {
    let n = |v: &View| v.extent().unwrap_or(0);
    [
        zeros(p.dtype, n(&p.q)),
        zeros(p.dtype, n(&p.k)),
        zeros(p.dtype, n(&p.v)),
    ]
}

/// Runs `forward` with the given host buffers and checks the error.
fn expect_forward<B: Backend>(
    backend: &B,
    name: &str,
    p: &Problem,
    bufs: [HostData; 3],
    bias: Option<HostData>,
    mask: Option<HostData>,
    want: Expect,
) -> Result<(), String> {
    let up = |d: &HostData| {
        backend
            .upload(d)
            .map_err(|e| format!("{name}: upload: {e}"))
    };
    let (q, k, v) = (up(&bufs[0])?, up(&bufs[1])?, up(&bufs[2])?);
    let bias = bias.as_ref().map(up).transpose()?;
    let mask = mask.as_ref().map(up).transpose()?;
    let inputs = Inputs {
        q: &q,
        k: &k,
        v: &v,
        bias: bias.as_ref(),
        mask: mask.as_ref(),
    };
    match backend.forward(p, inputs) {
        Ok(_) => Err(format!("{name}: accepted bad input")),
        Err(e) if want(&e) => Ok(()),
        Err(e) => Err(format!("{name}: wrong error: {e:?}")),
    }
}

/// Checks every kind of bad input on `backend`.
pub fn all<B: Backend>(backend: &B) -> Result<(), String> {
    let base = Problem::new(Shape::new(2, 4, 2, 5, 7, 8), DType::F32);
    let ok = buffers_for(&base);
    let with = |f: &dyn Fn(&mut Problem)| {
        let mut p = base.clone();
        f(&mut p);
        p
    };
    let opts = |o: AttnOptions| with(&|p| p.options = o.clone());

    // Shapes and sizes (buffers sized for the valid base problem).
    let cases: Vec<(&str, Problem, Expect)> = vec![
        (
            "heads not divisible",
            Problem::new(Shape::new(2, 3, 2, 5, 7, 8), DType::F32),
            |e| {
                matches!(
                    e,
                    AttnError::HeadsNotDivisible {
                        q_heads: 3,
                        kv_heads: 2
                    }
                )
            },
        ),
        (
            "zero head dim",
            Problem::new(Shape::new(2, 4, 2, 5, 7, 0), DType::F32),
            |e| {
                matches!(
                    e,
                    AttnError::ZeroSize {
                        what: "head_dim_qk"
                    }
                )
            },
        ),
        (
            "zero batch",
            Problem::new(Shape::new(0, 4, 2, 5, 7, 8), DType::F32),
            |e| matches!(e, AttnError::ZeroSize { what: "batch" }),
        ),
        (
            "zero kv heads",
            Problem::new(Shape::new(1, 4, 0, 5, 7, 8), DType::F32),
            |e| matches!(e, AttnError::ZeroSize { what: "kv_heads" }),
        ),
        ("k head dim mismatch", with(&|p| p.k.dims[3] = 9), |e| {
            matches!(
                e,
                AttnError::Shape {
                    tensor: "k",
                    axis: "head_dim",
                    expected: 8,
                    got: 9
                }
            )
        }),
        ("v seq mismatch", with(&|p| p.v.dims[1] = 6), |e| {
            matches!(
                e,
                AttnError::Shape {
                    tensor: "v",
                    axis: "seq",
                    expected: 7,
                    got: 6
                }
            )
        }),
        ("q view beyond buffer", with(&|p| p.q.offset = 1), |e| {
            matches!(e, AttnError::BufferTooSmall { tensor: "q", .. })
        }),
        (
            "overflowing strides",
            with(&|p| p.k.strides[1] = usize::MAX / 4),
            |e| matches!(e, AttnError::Overflow { .. }),
        ),
        (
            "overflowing shape",
            Problem::new(Shape::new(1, 1, 1, usize::MAX / 4, 3, 8), DType::F32),
            |e| matches!(e, AttnError::Overflow { .. }),
        ),
        ("aliasing output", with(&|p| p.out.strides[2] = 0), |e| {
            matches!(e, AttnError::Aliasing { tensor: "out" })
        }),
        ("bool element type", with(&|p| p.dtype = DType::Bool), |e| {
            matches!(e, AttnError::DType { tensor: "q", .. })
        }),
        (
            "alibi slopes length",
            opts(AttnOptions::default().alibi(vec![0.5; 3])),
            |e| {
                matches!(
                    e,
                    AttnError::OptionLength {
                        option: "alibi_slopes",
                        expected: 4,
                        got: 3
                    }
                )
            },
        ),
        (
            "sinks length",
            opts(AttnOptions::default().sinks(vec![0.0; 5])),
            |e| {
                matches!(
                    e,
                    AttnError::OptionLength {
                        option: "sinks",
                        expected: 4,
                        got: 5
                    }
                )
            },
        ),
        (
            "q_lens length",
            opts(AttnOptions::default().q_lens(vec![1])),
            |e| {
                matches!(
                    e,
                    AttnError::OptionLength {
                        option: "q_lens",
                        expected: 2,
                        got: 1
                    }
                )
            },
        ),
        (
            "kv_lens beyond kv_len",
            opts(AttnOptions::default().kv_lens(vec![3, 8])),
            |e| {
                matches!(
                    e,
                    AttnError::SeqLen {
                        option: "kv_lens",
                        batch: 1,
                        len: 8,
                        max: 7
                    }
                )
            },
        ),
        (
            "negative softcap",
            opts(AttnOptions::default().softcap(-1.0)),
            |e| {
                matches!(
                    e,
                    AttnError::Parameter {
                        what: "softcap",
                        ..
                    }
                )
            },
        ),
        (
            "NaN scale",
            opts(AttnOptions::default().scale(f32::NAN)),
            |e| matches!(e, AttnError::Parameter { what: "scale", .. }),
        ),
        (
            "bias described, no buffer",
            with(&|p| {
                *p = p
                    .clone()
                    .with_bias(View::contiguous([1, 1, 5, 7]), DType::F32)
            }),
            |e| matches!(e, AttnError::Missing { tensor: "bias", .. }),
        ),
    ];
    for (name, p, want) in cases {
        expect_forward(backend, name, &p, ok.clone(), None, None, want)?;
    }

    // Buffers that do not match a valid problem.
    let [q, k, v] = ok.clone();
    expect_forward(
        backend,
        "v element type",
        &base,
        [q.clone(), k.clone(), zeros(DType::F16, v.len())],
        None,
        None,
        |e| {
            matches!(
                e,
                AttnError::DType {
                    tensor: "v",
                    got: DType::F16,
                    ..
                }
            )
        },
    )?;
    expect_forward(
        backend,
        "short k buffer",
        &base,
        [q.clone(), zeros(DType::F32, k.len() - 1), v.clone()],
        None,
        None,
        |e| matches!(e, AttnError::BufferTooSmall { tensor: "k", .. }),
    )?;
    let bias_p = |dims: [usize; 4]| base.clone().with_bias(View::contiguous(dims), DType::F32);
    expect_forward(
        backend,
        "bias kv_len",
        &bias_p([1, 1, 5, 8]),
        ok.clone(),
        Some(zeros(DType::F32, 40)),
        None,
        |e| {
            matches!(
                e,
                AttnError::Shape {
                    tensor: "bias",
                    axis: "kv_len",
                    expected: 7,
                    got: 8
                }
            )
        },
    )?;
    expect_forward(
        backend,
        "bias heads not broadcastable",
        &bias_p([1, 2, 5, 7]),
        ok.clone(),
        Some(zeros(DType::F32, 70)),
        None,
        |e| {
            matches!(
                e,
                AttnError::Shape {
                    tensor: "bias",
                    axis: "heads",
                    expected: 4,
                    got: 2
                }
            )
        },
    )?;
    expect_forward(
        backend,
        "bias buffer given, none described",
        &base,
        ok.clone(),
        Some(zeros(DType::F32, 35)),
        None,
        |e| matches!(e, AttnError::Missing { tensor: "bias", .. }),
    )?;
    let mask_p = base.clone().with_mask(View::contiguous([2, 1, 5, 7]));
    expect_forward(
        backend,
        "mask of floats",
        &mask_p,
        ok.clone(),
        None,
        Some(zeros(DType::F32, 70)),
        |e| {
            matches!(
                e,
                AttnError::DType {
                    tensor: "mask",
                    got: DType::F32,
                    ..
                }
            )
        },
    )?;
    expect_forward(
        backend,
        "short mask",
        &mask_p,
        ok.clone(),
        None,
        Some(zeros(DType::Bool, 69)),
        |e| {
            matches!(
                e,
                AttnError::BufferTooSmall {
                    tensor: "mask",
                    needed: 70,
                    len: 69
                }
            )
        },
    )?;

    // forward_into with a short output and a missing lse buffer.
    let up = |d: &HostData| backend.upload(d).map_err(|e| e.to_string());
    let (qb, kb, vb) = (up(&q)?, up(&k)?, up(&v)?);
    let mut short = backend
        .zeros(DType::F32, 2 * 5 * 4 * 8 - 1)
        .map_err(|e| e.to_string())?;
    match backend.forward_into(&base, Inputs::new(&qb, &kb, &vb), &mut short, None) {
        Err(AttnError::BufferTooSmall { tensor: "out", .. }) => {}
        r => return Err(format!("short output: {r:?}")),
    }
    let lse_p = opts(AttnOptions::default().with_lse());
    let mut out = backend
        .zeros(DType::F32, 2 * 5 * 4 * 8)
        .map_err(|e| e.to_string())?;
    match backend.forward_into(&lse_p, Inputs::new(&qb, &kb, &vb), &mut out, None) {
        Err(AttnError::Missing { tensor: "lse", .. }) => {}
        r => return Err(format!("missing lse buffer: {r:?}")),
    }

    Ok(())
}

/// Bad operands of [`Linear::linear`] and bad multi-head attention
/// weights are typed errors naming the tensor.
pub fn layer<B: Linear>(backend: &B) -> Result<(), String> {
    let up = |d: &HostData| backend.upload(d).map_err(|e| e.to_string());
    let zeros = HostData::zeros;
    let w = up(&zeros(DType::F32, 6 * 4))?;
    let x = up(&zeros(DType::F32, 3 * 4))?;
    match backend.linear(&x, 3, &w, None, 4, 5) {
        Err(AttnError::Shape {
            tensor: "weight",
            expected: 20,
            got: 24,
            ..
        }) => {}
        r => return Err(format!("linear weight size: {:?}", r.err())),
    }
    let c = MhaConfig::new(8, 4, 2);
    let wt = |n: usize| up(&zeros(DType::F32, n));
    let weights = MhaWeights {
        wq: wt(64)?,
        wk: wt(31)?,
        wv: wt(32)?,
        wo: wt(64)?,
        biases: None,
    };
    match MultiHeadAttention::new(backend, c, weights) {
        Err(AttnError::Shape {
            tensor: "wk",
            expected: 32,
            got: 31,
            ..
        }) => Ok(()),
        r => Err(format!("mha weight size: {:?}", r.err())),
    }
}
