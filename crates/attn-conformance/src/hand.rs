//! Hand-computed cases: closed-form answers that do not depend on the
//! reference at all, checked on any backend under the a-priori floor of
//! [`crate::tolerance`].

use crate::case::{Case, CaseParams};
use crate::check::{compare, gather};
use crate::tolerance::row_floors;
use attn_spec::reference::RefResult;
use attn_spec::{AttnOptions, Backend, HostData, Inputs, Shape, View};

/// Runs `case` on `backend` (f32 inputs) and returns its result in the
/// reference's layout.
fn run<B: Backend>(backend: &B, case: &Case) -> Result<RefResult, String> {
    let f = || -> attn_spec::Result<(HostData, Option<HostData>)> {
        let up = |d: &HostData| backend.upload(d);
        let (q, k, v) = (up(&case.q)?, up(&case.k)?, up(&case.v)?);
        let mask = case.mask.as_ref().map(up).transpose()?;
        let inputs = Inputs {
            q: &q,
            k: &k,
            v: &v,
            bias: None,
            mask: mask.as_ref(),
        };
        let o = backend.forward(&case.problem, inputs)?;
        let lse = o.lse.as_ref().map(|l| backend.download(l)).transpose()?;
        Ok((backend.download(&o.out)?, lse))
    };
    let (out, lse) = f().map_err(|e| format!("{}: {e}", backend.name()))?;
    Ok(gather(case, &out, lse.as_ref()))
}

fn f32s(v: &[f64]) -> HostData {
    HostData::F32(v.iter().map(|&x| x as f32).collect())
}

/// A case with explicit tensors (contiguous BSHD, f32, batch 1, 1 head).
fn explicit(q_len: usize, kv_len: usize, d: usize, q: &[f64], k: &[f64], v: &[f64]) -> Case {
    let mut c = Case::build(CaseParams::plain(Shape::new(1, 1, 1, q_len, kv_len, d)));
    c.q = f32s(q);
    c.k = f32s(k);
    c.v = f32s(v);
    c
}

fn expect(
    case: &Case,
    got: &RefResult,
    out: Vec<f64>,
    lse: Vec<f64>,
    name: &str,
) -> Result<(), String> {
    let want = RefResult {
        out,
        lse,
        probs: None,
    };
    let floors = row_floors(case, &want.lse);
    compare(case, got, &want, None, &floors).map_err(|e| format!("hand case `{name}`: {e}"))
}

/// Identical keys: every query attends uniformly, the output is the mean of
/// the values and the log-sum-exp is `s + ln(n)`.
pub fn uniform<B: Backend>(backend: &B) -> Result<(), String> {
    let (sq, sk, d) = (3, 5, 4);
    let q: Vec<f64> = (0..sq * d).map(|i| (i % 3) as f64 * 0.5).collect();
    let k = vec![0.25; sk * d];
    let v: Vec<f64> = (0..sk * d).map(|i| i as f64).collect();
    let mut c = explicit(sq, sk, d, &q, &k, &v);
    c.problem.options = AttnOptions::default().with_lse();
    let got = run(backend, &c)?;
    let mut out = vec![];
    let mut lse = vec![];
    for i in 0..sq {
        for e in 0..d {
            out.push((0..sk).map(|j| v[j * d + e]).sum::<f64>() / sk as f64);
        }
        let s: f64 = (0..d).map(|e| q[i * d + e] * 0.25).sum::<f64>() * 0.5;
        lse.push(s + (sk as f64).ln());
    }
    expect(&c, &got, out, lse, "uniform")
}

/// Orthogonal keys with a large scale: query `i` retrieves value `t(i)`
/// exactly (the other probabilities are below e^-100).
pub fn one_hot<B: Backend>(backend: &B) -> Result<(), String> {
    let (sq, sk, d) = (4, 6, 6);
    let targets = [2usize, 0, 5, 3];
    let mut q = vec![0.0; sq * d];
    for (i, &t) in targets.iter().enumerate() {
        q[i * d + t] = 1.0;
    }
    let mut k = vec![0.0; sk * d];
    for j in 0..sk {
        k[j * d + j] = 1.0;
    }
    let v: Vec<f64> = (0..sk * d).map(|i| (i as f64 - 10.0) * 0.125).collect();
    let mut c = explicit(sq, sk, d, &q, &k, &v);
    c.problem.options = AttnOptions::default().scale(200.0).with_lse();
    let got = run(backend, &c)?;
    let out: Vec<f64> = targets
        .iter()
        .flat_map(|&t| v[t * d..(t + 1) * d].to_vec())
        .collect();
    expect(&c, &got, out, vec![200.0; sq], "one_hot")
}

/// Rows that see no key give exactly 0 and log-sum-exp -inf: bottom-right
/// causal with more queries than keys masks the first rows, a boolean mask
/// masks a chosen row, and `kv_lens = 0` masks a whole batch entry.
pub fn fully_masked<B: Backend>(backend: &B) -> Result<(), String> {
    // 4 queries, 2 keys, causal bottom-right: rows 0 and 1 see nothing;
    // row 2 sees key 0 only; row 3 sees both (equal keys: the mean).
    let (sq, sk, d) = (4, 2, 2);
    let q = vec![1.0; sq * d];
    let k = vec![0.5; sk * d];
    let v = vec![1.0, 2.0, 3.0, 4.0];
    let mut c = explicit(sq, sk, d, &q, &k, &v);
    c.problem.options = AttnOptions::default().causal().with_lse();
    let got = run(backend, &c)?;
    let s = 0.5_f64 * 2.0 / 2f64.sqrt();
    let out = vec![0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 2.0, 3.0];
    let lse = vec![f64::NEG_INFINITY, f64::NEG_INFINITY, s, s + 2f64.ln()];
    expect(&c, &got, out, lse, "causal_more_queries_than_keys")?;

    // A boolean mask that removes every key of row 1 only.
    let mut c = explicit(2, 2, 2, &[1.0; 4], &[0.5; 4], &[1.0, 2.0, 3.0, 4.0]);
    c.problem.mask = Some(View::contiguous([1, 1, 2, 2]));
    c.mask = Some(HostData::Bool(vec![true, true, false, false]));
    c.problem.options = AttnOptions::default().with_lse();
    let got = run(backend, &c)?;
    let lse = vec![s + 2f64.ln(), f64::NEG_INFINITY];
    expect(&c, &got, vec![2.0, 3.0, 0.0, 0.0], lse, "bool_mask_row")?;

    // kv_lens = [0]: nothing is visible anywhere.
    let mut c = explicit(2, 2, 2, &[1.0; 4], &[0.5; 4], &[1.0, 2.0, 3.0, 4.0]);
    c.problem.options = AttnOptions::default().kv_lens(vec![0]).with_lse();
    let got = run(backend, &c)?;
    let ninf = f64::NEG_INFINITY;
    expect(&c, &got, vec![0.0; 4], vec![ninf; 2], "kv_len_zero")
}

/// A sink with no visible key: output 0 and log-sum-exp equal to the sink;
/// with one visible key of score `s`, weight `e^s / (e^s + e^sink)`.
pub fn sink<B: Backend>(backend: &B) -> Result<(), String> {
    let mut c = explicit(2, 1, 1, &[1.0, 1.0], &[0.0], &[3.0]);
    // Row 0 sees nothing (bottom-right causal with 2 rows, 1 key).
    c.problem.options = AttnOptions::default().causal().sinks(vec![0.0]).with_lse();
    let got = run(backend, &c)?;
    // Row 1: score 0, sink 0: weight 1/2; lse = ln 2.
    expect(
        &c,
        &got,
        vec![0.0, 1.5],
        vec![0.0, 2f64.ln()],
        "sink_only_and_half",
    )
}

/// NaN propagates to the rows it touches: a NaN query makes its row (and
/// log-sum-exp) NaN and leaves the other rows alone. Whether a NaN stored
/// only at excluded positions reaches a row is not part of the contract
/// (docs/SEMANTICS.md section 6), so it is not tested.
pub fn nan_propagates<B: Backend>(backend: &B) -> Result<(), String> {
    // Causal top-left, 2 queries, 3 keys: row 0 sees key 0, row 1 keys 0-1.
    let nan = f64::NAN;
    let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let mut c = explicit(2, 3, 2, &[1.0, 1.0, nan, 1.0], &[0.5; 6], &v);
    c.problem.options = AttnOptions::default().causal().top_left().with_lse();
    let got = run(backend, &c)?;
    let s = 0.5_f64 * 2.0 / 2f64.sqrt();
    expect(
        &c,
        &got,
        vec![1.0, 2.0, nan, nan],
        vec![s, nan],
        "nan_query",
    )
}

/// Decode shapes that take split-KV paths (one query row, 3500 keys, GQA
/// 8:2), with sinks, windows and per-sequence lengths (one sequence with no
/// key at all), in both layouts: generated cases rarely reach them.
pub fn split_kv_cases() -> Vec<Case> {
    use attn_spec::DType;
    let cases = [
        (AttnOptions::default(), DType::F32),
        (AttnOptions::default().causal().with_lse(), DType::Bf16),
        (
            AttnOptions::default()
                .window(Some(1500), Some(0))
                .sinks(vec![0.5; 8])
                .with_lse(),
            DType::F16,
        ),
        (
            AttnOptions::default().kv_lens(vec![3000, 0]).with_lse(),
            DType::F32,
        ),
        (
            AttnOptions::default().kv_lens(vec![3000, 0]).with_lse(),
            DType::Bf16,
        ),
    ];
    let mut out = Vec::new();
    for bhsd in [false, true] {
        for (opts, dtype) in cases.clone() {
            let mut params = CaseParams::plain(Shape::new(2, 8, 2, 1, 3500, 64));
            params.options = opts;
            params.dtype = dtype;
            params.bhsd = bhsd;
            params.seed = 9;
            out.push(Case::build(params));
        }
    }
    // A NaN query element on one head: its row (and only its row) must
    // come out NaN through the partial-state merge, also where some key
    // chunks of the window see no key.
    let mut params = CaseParams::plain(Shape::new(1, 8, 2, 1, 3500, 64));
    params.options = AttnOptions::default()
        .window(Some(1500), Some(0))
        .with_lse();
    params.seed = 11;
    let mut nan = Case::build(params);
    if let HostData::F32(q) = &mut nan.q {
        q[3 * 64 + 5] = f32::NAN;
    }
    out.push(nan);
    out
}

/// Every [`split_kv_cases`] case on `backend`, checked as [`crate::check_case`] does.
pub fn split_kv<B: Backend>(backend: &B) -> Result<(), String> {
    for case in split_kv_cases() {
        match crate::check_case(backend, &case)? {
            crate::Outcome::Passed => {}
            crate::Outcome::Skipped(why) => {
                return Err(format!(
                    "{}: skipped a split-KV case: {why}",
                    case.describe()
                ))
            }
        }
    }
    Ok(())
}

/// All hand-computed cases, and the trait promises of
/// [`crate::contract`].
pub fn all<B: Backend>(backend: &B) -> Result<(), String> {
    crate::contract::all(backend)?;
    uniform(backend)?;
    one_hot(backend)?;
    fully_masked(backend)?;
    sink(backend)?;
    nan_propagates(backend)
}
