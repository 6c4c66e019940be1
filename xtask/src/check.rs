//! The correctness check run on every (backend, case) before it is timed:
//! against the f64 reference on small cases (every row), and on large ones
//! on sampled rows, each recomputed by the reference as a one-row problem
//! over the same buffers (a view with an offset) whose keys end at the
//! row's diagonal, so the bottom-right alignment puts the diagonal where
//! the full problem has it. Both use the conformance suite's error bound.

use attn::{Backend, Engine, Inputs};
use attn_benches::BenchCase;
use attn_conformance::check::{compare, gather, reference64, reference_low};
use attn_conformance::tolerance::row_floors;
use attn_conformance::{Case, CaseParams};
use attn_spec::reference::RefResult;
use attn_spec::{HostData, MaskKind, Problem, Shape, View};

/// Runs `case` once on `engine` and checks the output. `Ok(note)` says what
/// was checked.
pub fn check(engine: &Engine, case: &BenchCase) -> Result<String, String> {
    let problem = case.problem();
    let [q, k, v] = case.data();
    let up = |d: &HostData| engine.upload(d).map_err(|e| e.to_string());
    let (qb, kb, vb) = (up(&q)?, up(&k)?, up(&v)?);
    let o = engine
        .forward(&problem, Inputs::new(&qb, &kb, &vb))
        .map_err(|e| e.to_string())?;
    let out = engine.download(&o.out).map_err(|e| e.to_string())?;
    check_output(case, &out)
}

/// Runs attn-cpu's backward pass on `case` (on `threads` threads) and
/// checks every gradient against the f64 reference under the conformance
/// suite's backward bound.
pub fn check_backward(case: &BenchCase, threads: usize) -> Result<String, String> {
    let problem = case.problem();
    let [q, k, v] = case.data();
    let full = Case {
        params: CaseParams {
            dtype: case.dtype,
            ..CaseParams::plain(problem.shape)
        },
        problem,
        q,
        k,
        v,
        bias: None,
        mask: None,
    };
    let bc = attn_conformance::backward::BackCase::of(full);
    let cpu = attn_cpu::Cpu::with_threads(threads).map_err(|e| e.to_string())?;
    attn_conformance::backward::check_backward(&cpu, &bc)?;
    Ok("every gradient vs f64 reference".into())
}

/// Checks an output of `case` (`[batch, q_len, q_heads, dim]`, any float
/// type) against the f64 reference.
pub fn check_output(case: &BenchCase, out: &HostData) -> Result<String, String> {
    let problem = case.problem();
    let [q, k, v] = case.data();
    let out = out.clone();
    let full = Case {
        params: CaseParams {
            dtype: case.dtype,
            ..CaseParams::plain(problem.shape)
        },
        problem: problem.clone(),
        q,
        k,
        v,
        bias: None,
        mask: None,
    };
    if case.small {
        let got = gather(&full, &out, None);
        let r64 = reference64(&full);
        let low = reference_low(&full);
        compare(&full, &got, &r64, Some(&low), &row_floors(&full, &r64.lse))?;
        return Ok("all rows vs f64 reference".into());
    }
    let s = problem.shape;
    let mut rows = vec![0, s.q_len / 2, s.q_len - 1];
    rows.dedup();
    let mut batches = vec![0, s.batch - 1];
    batches.dedup();
    let mut n = 0;
    for b in batches {
        for &i in &rows {
            check_row(&full, &out, b, i)?;
            n += 1;
        }
    }
    Ok(format!("{n} sampled rows (all heads) vs f64 reference"))
}

/// Checks row `i` of batch entry `b` (all heads).
fn check_row(full: &Case, out: &HostData, b: usize, i: usize) -> Result<(), String> {
    let p = &full.problem;
    let s = p.shape;
    let m = p.seq_mask(b);
    let kl = match p.options.mask.window() {
        (_, None) if p.options.mask == MaskKind::None => s.kv_len,
        (_, Some(0)) => usize::try_from(m.diagonal(i) + 1)
            .unwrap_or(0)
            .min(s.kv_len),
        _ => return Err("sampled check supports no mask or windows with right = 0".into()),
    };
    if kl == 0 {
        return Ok(()); // the row sees nothing; the full check covers it
    }
    let shape =
        Shape::new(1, s.q_heads, s.kv_heads, 1, kl, s.head_dim_qk).with_head_dim_v(s.head_dim_v);
    let sub_view = |v: &View, seq: usize, at: [usize; 4]| View {
        dims: [1, seq, v.dims[2], v.dims[3]],
        strides: v.strides,
        offset: v.index(at),
    };
    let mut sub = Problem::new(shape, p.dtype).with_options(p.options.clone());
    sub.q = sub_view(&p.q, 1, [b, i, 0, 0]);
    sub.k = sub_view(&p.k, kl, [b, 0, 0, 0]);
    sub.v = sub_view(&p.v, kl, [b, 0, 0, 0]);
    let case = Case {
        problem: sub,
        ..full.clone()
    };
    let mut got = Vec::with_capacity(s.q_heads * s.head_dim_v);
    for h in 0..s.q_heads {
        for d in 0..s.head_dim_v {
            got.push(out.get(p.out.index([b, i, h, d])));
        }
    }
    let got = RefResult {
        out: got,
        lse: Vec::new(),
        probs: None,
    };
    let r64 = reference64(&case);
    let low = reference_low(&case);
    compare(&case, &got, &r64, Some(&low), &row_floors(&case, &r64.lse))
        .map_err(|e| format!("batch {b} row {i}: {e}"))
}
