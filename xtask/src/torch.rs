//! The PyTorch baseline: `torch.nn.functional.scaled_dot_product_attention`
//! on the same shapes, dtypes and thread counts, timed in the same run.
//! The interpreter is `$ATTN_PYTHON` or `python3`; when it cannot import
//! torch the baseline is skipped with a note saying how to install it.

use attn_benches::BenchCase;
use attn_spec::DType;
use serde_json::{json, Value};
use std::process::Command;

/// How to get the baseline, for the report.
pub const INSTALL_HINT: &str =
    "python3 -m pip install torch (or point ATTN_PYTHON at an interpreter that has it)";

const SCRIPT: &str = r#"
import json, sys, time, statistics
import torch
import torch.nn.functional as F

def other_work(us):
    # Busy work before a timed call (BenchCase::gap_us), not timed.
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass

spec = json.load(open(sys.argv[1]))
dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
g0 = torch.Generator().manual_seed(1)
for c in spec["cases"]:
    g = torch.Generator().manual_seed(0)
    q = (torch.rand(c["b"], c["hq"], c["sq"], c["d"], generator=g) * 2 - 1).to(dt[c["dtype"]])
    k = (torch.rand(c["b"], c["hkv"], c["sk"], c["d"], generator=g) * 2 - 1).to(dt[c["dtype"]])
    v = (torch.rand(c["b"], c["hkv"], c["sk"], c["d"], generator=g) * 2 - 1).to(dt[c["dtype"]])
    kw = {"enable_gqa": c["hq"] != c["hkv"]}
    off = c["sk"] - c["sq"]
    if c["left"] is not None or c["right"] is not None:
        i = torch.arange(c["sq"]).unsqueeze(1) + off
        j = torch.arange(c["sk"]).unsqueeze(0)
        m = torch.ones(c["sq"], c["sk"], dtype=torch.bool)
        if c["left"] is not None:
            m &= j >= i - c["left"]
        if c["right"] is not None:
            m &= j <= i + c["right"]
        if c["sq"] == c["sk"] and c["left"] is None and c["right"] == 0:
            kw["is_causal"] = True
        else:
            kw["attn_mask"] = m
    for t in spec["threads"]:
        torch.set_num_threads(t)
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, **kw)
            times = []
            start = time.perf_counter()
            while len(times) < 10 and (len(times) < 3 or time.perf_counter() - start < spec["secs"]):
                other_work(c["gap_us"])
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, **kw)
                times.append(time.perf_counter() - t0)
        print(json.dumps({"case": c["name"], "threads": t, "median": statistics.median(times),
                          "min": min(times), "max": max(times)}), flush=True)
        if c["bwd"]:
            # The backward alone: gradients of Q, K, V with the forward's
            # graph kept (retain_graph), as attn's backward starts from the
            # forward's results. A failure here leaves the forward rows.
            try:
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                out = F.scaled_dot_product_attention(qg, kg, vg, **kw)
                grad_out = torch.rand(out.shape, generator=g0).to(out.dtype) - 0.5
                torch.autograd.grad(out, (qg, kg, vg), grad_out, retain_graph=True)
                times = []
                start = time.perf_counter()
                while len(times) < 10 and (len(times) < 3 or time.perf_counter() - start < spec["secs"]):
                    other_work(c["gap_us"])
                    t0 = time.perf_counter()
                    torch.autograd.grad(out, (qg, kg, vg), grad_out, retain_graph=True)
                    times.append(time.perf_counter() - t0)
                print(json.dumps({"case": c["name"], "threads": t, "median": statistics.median(times),
                                  "min": min(times), "max": max(times), "bwd": True}), flush=True)
            except Exception as e:
                print(f"backward of {c['name']} on {t} threads failed: {e}", file=sys.stderr)
"#;

fn python() -> String {
    std::env::var("ATTN_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The torch version, or why the baseline cannot run.
pub fn available() -> Result<String, String> {
    let out = Command::new(python())
        .args(["-c", "import torch; print(torch.__version__)"])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{} cannot import torch; to add the baseline: {INSTALL_HINT}",
            python()
        ))
    }
}

/// One timing of the baseline.
#[derive(Clone, Debug)]
pub struct TorchTime {
    /// Case name.
    pub case: String,
    /// Threads.
    pub threads: usize,
    /// Median seconds.
    pub median: f64,
    /// Fastest run.
    pub min: f64,
    /// Slowest run.
    pub max: f64,
    /// A backward timing (else the forward).
    pub backward: bool,
}

/// Times every case for every thread count.
pub fn run(
    cases: &[&BenchCase],
    threads: &[usize],
    secs: f64,
    dir: &std::path::Path,
) -> Result<Vec<TorchTime>, String> {
    let spec: Vec<Value> = cases
        .iter()
        .map(|c| {
            let (left, right) = c.mask.window();
            let dtype = match c.dtype {
                DType::F16 => "f16",
                DType::Bf16 => "bf16",
                _ => "f32",
            };
            json!({"name": c.name, "b": c.batch, "hq": c.q_heads, "hkv": c.kv_heads, "sq": c.q_len,
                   "sk": c.kv_len, "d": c.head_dim, "left": left, "right": right, "dtype": dtype, "gap_us": c.gap_us,
                   "bwd": attn_benches::has_backward(c)})
        })
        .collect();
    let spec_path = dir.join("torch_spec.json");
    let script_path = dir.join("torch_sdpa.py");
    std::fs::write(
        &spec_path,
        json!({"cases": spec, "threads": threads, "secs": secs}).to_string(),
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(&script_path, SCRIPT).map_err(|e| e.to_string())?;
    let out = Command::new(python())
        .arg(&script_path)
        .arg(&spec_path)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "PyTorch baseline failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).map_err(|e| format!("{e}: {l}"))?;
            Ok(TorchTime {
                case: v["case"].as_str().unwrap_or_default().to_string(),
                threads: v["threads"].as_u64().unwrap_or(0) as usize,
                median: v["median"].as_f64().unwrap_or(f64::NAN),
                min: v["min"].as_f64().unwrap_or(f64::NAN),
                max: v["max"].as_f64().unwrap_or(f64::NAN),
                backward: v["bwd"].as_bool().unwrap_or(false),
            })
        })
        .collect()
}
