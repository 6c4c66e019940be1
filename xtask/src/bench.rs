//! `cargo xtask bench`: measure the machine, check every backend's output on
//! every case, time them with the criterion benches of `benches/`, time the
//! PyTorch baseline in the same run when it is installed, measure the
//! long-context memory case, and write `report.json`, `report.md` and SVG
//! charts (default `target/attn-bench/`).

use crate::machine::{measure, Machine};
use crate::report::{fmt_time, Record};
use crate::{charts, check, ort, report, root, target_dir, torch};
use attn::{Engine, EngineKind};
use attn_benches::candle_backends::CandleKind;
use attn_benches::{
    bench_id, has_backward, has_spin, BenchCase, Tier, CPU_BACKWARD, CPU_SPIN, CPU_SPIN_FOR,
    MEMORY_CASE, SUITE,
};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

struct Opts {
    tier: Tier,
    cases: Vec<String>,
    backends: Vec<String>,
    threads: Vec<usize>,
    out: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        tier: Tier::Default,
        cases: vec![],
        backends: vec![],
        threads: vec![],
        out: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--quick" => o.tier = Tier::Quick,
            "--full" => o.tier = Tier::Full,
            "--case" => o.cases.push(val()?),
            "--backend" => o.backends.push(val()?),
            "--threads" => o
                .threads
                .push(val()?.parse().map_err(|_| "--threads needs a number")?),
            "--out" => o.out = Some(PathBuf::from(val()?)),
            other => {
                return Err(format!(
                    "bench: unknown option {other} (see cargo xtask --help)"
                ))
            }
        }
    }
    Ok(o)
}

fn engine(kind: EngineKind, threads: usize) -> Option<Engine> {
    match kind {
        EngineKind::Cpu => attn_cpu::Cpu::with_threads(threads).ok().map(Engine::Cpu),
        EngineKind::Reference => Engine::of(kind).ok(),
        // The GPU is timed with its buffers on the device (`gpu-check`),
        // not through the host-data engine.
        EngineKind::Cuda => None,
    }
}

/// Criterion's median and its confidence interval for `id`, in seconds,
/// from estimates written since `since` (older ones are an earlier run's,
/// of a row this run did not time).
fn estimates(id: &str, since: std::time::SystemTime) -> Result<(f64, (f64, f64)), String> {
    let path = target_dir()
        .join("criterion")
        .join(id)
        .join("new")
        .join("estimates.json");
    let written = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if written < since {
        return Err(format!("{}: from an earlier run", path.display()));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let m = &v["median"];
    let ns = |x: &Value| x.as_f64().unwrap_or(f64::NAN) * 1e-9;
    Ok((
        ns(&m["point_estimate"]),
        (
            ns(&m["confidence_interval"]["lower_bound"]),
            ns(&m["confidence_interval"]["upper_bound"]),
        ),
    ))
}

/// Runs the whole benchmark.
pub fn run(args: &[String]) -> Result<(), String> {
    let o = parse(args)?;
    let out = o
        .out
        .clone()
        .unwrap_or_else(|| target_dir().join("attn-bench"));
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let m = measure();
    println!(
        "machine: {} cores, FMA peak {:.1} GFLOP/s/core ({:.1} all), bandwidth {:.1} / {:.1} GB/s triad, {:.1} / {:.1} read, SIMD {} (CPU's widest {})",
        m.cores, m.peak_1, m.peak_all, m.bw_1, m.bw_all, m.read.0, m.read.1, crate::machine::simd_level(), attn_cpu::Isa::detected()
    );
    // Named cases run whatever their tier; otherwise the run's tier.
    let cases: Vec<&BenchCase> = SUITE
        .iter()
        .filter(|c| {
            if o.cases.is_empty() {
                c.tier <= o.tier
            } else {
                o.cases.iter().any(|n| n == c.name)
            }
        })
        .collect();
    let left_out: Vec<&str> = SUITE
        .iter()
        .filter(|c| !cases.iter().any(|k| k.name == c.name))
        .map(|c| c.name)
        .collect();
    let mut threads = if o.threads.is_empty() {
        vec![1, m.cores]
    } else {
        o.threads.clone()
    };
    threads.dedup();
    let kinds: Vec<EngineKind> = EngineKind::compiled()
        .into_iter()
        .filter(|k| engine(*k, 1).is_some())
        .filter(|k| {
            let name = engine(*k, 1)
                .map(|e| attn::Backend::name(&e))
                .unwrap_or_default();
            o.backends.is_empty() || o.backends.contains(&name)
        })
        .collect();
    let mut notes = Vec::new();
    let backward = EngineKind::compiled().contains(&EngineKind::Cpu)
        && (o.backends.is_empty() || o.backends.iter().any(|b| b == CPU_BACKWARD));
    let spin = EngineKind::compiled().contains(&EngineKind::Cpu)
        && (o.backends.is_empty() || o.backends.iter().any(|b| b == CPU_SPIN));

    // 1. Correctness of every (backend, case) before timing.
    let mut checks: HashMap<(String, &str), Result<String, String>> = HashMap::new();
    let jobs: Vec<(EngineKind, &BenchCase)> = kinds
        .iter()
        .flat_map(|&k| {
            cases
                .iter()
                .filter(move |c| k != EngineKind::Reference || c.small)
                .map(move |&c| (k, c))
        })
        .collect();
    for (n, (kind, case)) in jobs.iter().enumerate() {
        let Some(e) = engine(*kind, m.cores) else {
            continue;
        };
        let name = attn::Backend::name(&e);
        print!("[check {}/{}] {name} {} ... ", n + 1, jobs.len(), case.name);
        let r = check::check(&e, case);
        match &r {
            Ok(note) => println!("ok ({note})"),
            Err(err) => println!("MISMATCH: {err}"),
        }
        checks.insert((name, case.name), r);
    }

    // 1a. attn-cpu with spinning helpers, on the cases it is timed on.
    if spin {
        let e = attn_cpu::Cpu::with_threads(m.cores)
            .and_then(|c| c.with_spin(CPU_SPIN_FOR))
            .map(Engine::Cpu)
            .map_err(|e| e.to_string())?;
        for case in cases.iter().filter(|c| has_spin(c)) {
            print!("[check] {CPU_SPIN} {} ... ", case.name);
            let r = check::check(&e, case);
            match &r {
                Ok(note) => println!("ok ({note})"),
                Err(err) => println!("MISMATCH: {err}"),
            }
            checks.insert((CPU_SPIN.to_string(), case.name), r);
        }
    }

    // 1b. The candle backends and baselines.
    let candle_kinds: Vec<CandleKind> = CandleKind::ALL
        .into_iter()
        .filter(|k| o.backends.is_empty() || o.backends.iter().any(|b| b == k.name()))
        .collect();
    for k in &candle_kinds {
        for c in &cases {
            if let Some(why) = k.capped(c) {
                notes.push(format!("{} not timed on {}: {why}", k.name(), c.name));
            }
        }
    }
    let cjobs: Vec<(CandleKind, &BenchCase)> = candle_kinds
        .iter()
        .flat_map(|&k| {
            cases
                .iter()
                .filter(move |c| k.applies(c))
                .map(move |&c| (k, c))
        })
        .collect();
    for (n, (kind, case)) in cjobs.iter().enumerate() {
        print!(
            "[check {}/{}] {} {} ... ",
            n + 1,
            cjobs.len(),
            kind.name(),
            case.name
        );
        let r = kind
            .prepare(case)
            .and_then(|mut run| run(true))
            .and_then(|out| check::check_output(case, &out.ok_or("no output")?));
        match &r {
            Ok(note) => println!("ok ({note})"),
            Err(err) => println!("MISMATCH: {err}"),
        }
        checks.insert((kind.name().to_string(), case.name), r);
    }

    // 1c. attn-cpu's backward pass: every gradient against the f64
    // reference's under the conformance bound, on the small cases (the
    // reference backward costs O(S^2 d) in f64 per head).
    if backward {
        for case in cases.iter().filter(|c| has_backward(c)) {
            let r = if case.small {
                print!("[check] {CPU_BACKWARD} {} ... ", case.name);
                let r = check::check_backward(case, m.cores);
                match &r {
                    Ok(note) => println!("ok ({note})"),
                    Err(err) => println!("MISMATCH: {err}"),
                }
                r
            } else {
                Err("not checked: the f64 reference backward is checked on the small cases".into())
            };
            checks.insert((CPU_BACKWARD.to_string(), case.name), r);
        }
    }

    // 2. Timing with criterion.
    let secs = match o.tier {
        Tier::Quick => 0.5,
        Tier::Default => 0.5,
        Tier::Full => 2.0,
    };
    let names: Vec<&str> = cases.iter().map(|c| c.name).collect();
    let mut backend_names: Vec<String> = kinds
        .iter()
        .filter_map(|k| engine(*k, 1))
        .map(|e| attn::Backend::name(&e))
        .collect();
    if backward {
        backend_names.push(CPU_BACKWARD.into());
    }
    if spin {
        backend_names.push(CPU_SPIN.into());
    }
    backend_names.extend(candle_kinds.iter().map(|k| k.name().to_string()));
    if backend_names.is_empty() {
        // The bench would read an empty list as every backend.
        return Err(format!("no backend to time among {:?}", o.backends));
    }
    println!(
        "timing {} case(s) x {} backend(s) x threads {:?} with criterion ...",
        cases.len(),
        kinds.len(),
        threads
    );
    let timed_from = std::time::SystemTime::now();
    let status = Command::new(crate::cargo())
        .current_dir(root())
        .args(["bench", "-p", "attn-benches", "--bench", "attention"])
        .env(
            "ATTN_BENCH_THREADS",
            threads
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(","),
        )
        .env("ATTN_BENCH_CASES", names.join(","))
        .env("ATTN_BENCH_BACKENDS", backend_names.join(","))
        .env("ATTN_BENCH_SECS", secs.to_string())
        .status()
        .map_err(|e| format!("cannot run cargo bench: {e}"))?;
    if !status.success() {
        return Err(format!("cargo bench failed: {status}"));
    }
    let mut records = Vec::new();
    for b in &backend_names {
        for case in &cases {
            for &t in &threads {
                if b == "reference" && (!case.small || t != 1) {
                    continue;
                }
                if (b == CPU_BACKWARD && !has_backward(case))
                    || (b == CPU_SPIN && (!has_spin(case) || t == 1))
                {
                    continue;
                }
                if CandleKind::ALL
                    .iter()
                    .any(|k| k.name() == b && !k.applies(case))
                {
                    continue;
                }
                let Ok((median, spread)) = estimates(&bench_id(b, case, t), timed_from) else {
                    continue;
                };
                let chk = checks.get(&(b.clone(), case.name));
                records.push(Record {
                    backend: b.clone(),
                    case: (*case).clone(),
                    threads: t,
                    median,
                    spread,
                    checked: matches!(chk, Some(Ok(_))),
                    check_note: match chk {
                        Some(Ok(n)) => n.clone(),
                        Some(Err(e)) if e.starts_with("not checked") => e.clone(),
                        Some(Err(e)) => format!("MISMATCH: {e}"),
                        None => "not checked".into(),
                    },
                });
            }
        }
    }

    // 3. PyTorch baseline, same shapes and threads.
    match torch::available() {
        Ok(version) => {
            println!("timing PyTorch {version} scaled_dot_product_attention ...");
            notes.push(format!("baseline: PyTorch {version} torch.nn.functional.scaled_dot_product_attention (CPU), median of up to 10 runs, [batch, heads, seq, dim] inputs; windows passed as boolean masks"));
            let scratch = target_dir().join("attn-bench-torch");
            let _ = std::fs::create_dir_all(&scratch);
            match torch::run(&cases, &threads, secs, &scratch) {
                Ok(times) => {
                    for t in times {
                        let Some(case) = cases.iter().find(|c| c.name == t.case) else {
                            continue;
                        };
                        records.push(Record {
                            backend: if t.backward {
                                "torch-sdpa-bwd".into()
                            } else {
                                "torch-sdpa".into()
                            },
                            case: (*case).clone(),
                            threads: t.threads,
                            median: t.median,
                            spread: (t.min, t.max),
                            checked: false,
                            check_note: "baseline: not checked".into(),
                        });
                    }
                }
                Err(e) => notes.push(format!("PyTorch baseline failed: {e}")),
            }
        }
        Err(why) => {
            println!("skipping the PyTorch baseline: {why}");
            notes.push(format!("PyTorch baseline skipped: {why}"));
        }
    }
    // 3b. ONNX Runtime's CPU attention operators, same shapes and threads.
    match ort::available() {
        Ok(version) => {
            println!("timing ONNX Runtime {version} attention operators ...");
            notes.push(format!("baseline: ONNX Runtime {version} on its CPU execution provider, one-node models: `ort-attention` the standard Attention op of opset 23 ([batch, heads, seq, dim], GQA by head counts), `ort-mha` com.microsoft MultiHeadAttention (equal query and key/value heads), `ort-gqa` com.microsoft GroupQueryAttention (causal and left-window cases only; the keys before the last q_len as its past cache, which it also copies into its grown cache); square causal masks as the ops' own flags, other windows as a boolean mask, an additive bias or GQA's local window; median of up to 10 runs"));
            let scratch = target_dir().join("attn-bench-ort");
            let _ = std::fs::create_dir_all(&scratch);
            match ort::run(&cases, &threads, secs, &scratch) {
                Ok((times, refused)) => {
                    for t in times {
                        let Some(case) = cases.iter().find(|c| c.name == t.case) else {
                            continue;
                        };
                        records.push(Record {
                            backend: t.op,
                            case: (*case).clone(),
                            threads: t.threads,
                            median: t.median,
                            spread: (t.min, t.max),
                            checked: false,
                            check_note: "baseline: not checked".into(),
                        });
                    }
                    for r in refused {
                        notes.push(format!("ONNX Runtime left out: {r}"));
                    }
                }
                Err(e) => notes.push(format!("ONNX Runtime baseline failed: {e}")),
            }
        }
        Err(why) => {
            println!("skipping the ONNX Runtime baseline: {why}");
            notes.push(format!("ONNX Runtime baseline skipped: {why}"));
        }
    }
    for c in cases.iter().filter(|c| c.gap_us > 0) {
        notes.push(format!(
            "{}: {} us of busy work on the calling thread before each timed call, left out of its time (every backend, baselines included), as an engine's projections come between decode steps: the thread pools' threads go idle between calls (ONNX Runtime's spin by default; `{CPU_SPIN}` is attn-cpu with `Cpu::with_spin({} ms)`, its helpers spinning that long after each call, `cpu` its default, where they go back to rayon's pool and sleep)",
            c.name, c.gap_us, CPU_SPIN_FOR.as_millis()
        ));
    }
    notes.push("candle: `candle-attn` is attn's fused kernel on candle tensors (attn-candle), `candle-plain` the plain candle composition (matmul, scale, mask, softmax, matmul; only where the score matrix fits in 256 MiB), `candle-nn-flash` candle-nn 0.11's fused CPU attention (`candle_nn::attention::flash_attn`; windows as an additive mask, batch 1 only)".into());

    // 4. The long-context memory case (full runs only).
    let memory = if (o.tier == Tier::Full && o.cases.is_empty())
        || o.cases.iter().any(|c| c == MEMORY_CASE.name)
    {
        memory_case(&m)
    } else {
        None
    };
    if !left_out.is_empty() {
        let run = match o.tier {
            Tier::Quick => "this --quick run",
            Tier::Default => {
                "this default run (a representative suite of about five minutes on two cores)"
            }
            Tier::Full => "this run",
        };
        notes.push(format!(
            "{run} left out {} of the suite's {} cases: {}; `cargo xtask bench --full` times them all (over half an hour on two cores) and the long-context memory case, `--case NAME` any one of them",
            left_out.len(),
            SUITE.len(),
            left_out.join(", ")
        ));
    }

    // 5. Report and charts.
    let md = report::write(&out, &m, &records, &notes, memory.as_ref())?;
    let svgs = charts::write(&out, &m, &records)?;
    summary(&m, &records);
    let _ = md;
    println!(
        "wrote {}/report.json, report.md, {}",
        out.display(),
        svgs.join(", ")
    );
    if records.iter().any(|r| r.check_note.starts_with("MISMATCH")) {
        return Err("some backend's output did not match the reference (see the report)".into());
    }
    Ok(())
}

fn memory_case(m: &Machine) -> Option<Value> {
    println!(
        "memory case {} on {} threads ...",
        MEMORY_CASE.name, m.cores
    );
    let out = Command::new(crate::cargo())
        .current_dir(root())
        .args([
            "run",
            "--release",
            "--quiet",
            "-p",
            "attn-benches",
            "--bin",
            "memcase",
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    println!("  {}", v);
    Some(v)
}

fn summary(m: &Machine, records: &[Record]) {
    println!(
        "\n{:34} {:10} {:>3} {:>11} {:>9} {:>7} {:>7}",
        "case", "backend", "thr", "median", "GFLOP/s", "%peak", "checked"
    );
    for r in records {
        println!(
            "{:34} {:10} {:>3} {:>11} {:>9.1} {:>6.1}% {:>7}",
            r.case.name,
            r.backend,
            r.threads,
            fmt_time(r.median),
            r.gflops(),
            100.0 * r.gflops() / m.peak(r.threads),
            if r.checked {
                "yes"
            } else if r.check_note.starts_with("baseline")
                || r.check_note.starts_with("not checked")
            {
                "-"
            } else {
                "NO"
            }
        );
    }
}
