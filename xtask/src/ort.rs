//! The ONNX Runtime baseline: ORT's CPU attention operators on the same
//! shapes, dtypes and thread counts, timed in the same run when the
//! interpreter (`$ATTN_PYTHON` or `python3`) can import `onnxruntime` and
//! `onnx` (which builds the one-node models). Two operators:
//!
//! - `ort-attention`: the standard `Attention` of opset 23, `[batch, heads,
//!   seq, dim]` inputs, GQA by head counts, `is_causal` where the causal
//!   mask is square (ONNX aligns it top-left, which equals attn's
//!   bottom-right only there), a boolean `attn_mask` for windows and
//!   non-square causal masks;
//! - `ort-mha`: `com.microsoft` `MultiHeadAttention` (`[batch, seq,
//!   heads * dim]` inputs), where query and key/value heads are equal,
//!   `unidirectional` for square causal masks, an additive
//!   `attention_bias` for the others;
//! - `ort-gqa`: `com.microsoft` `GroupQueryAttention`, on the causal and
//!   left-window cases only (it is causal by construction): the keys
//!   before the last `q_len` are its past key/value cache, the last
//!   `q_len` the new ones, a window is `local_window_size = left + 1`. It
//!   also writes the grown cache (a copy of K and V), as it does when
//!   decoding.
//!
//! Each operator's output was checked against an f64 numpy attention on
//! small shapes of every mask kind it takes (square and non-square causal,
//! windows, decode with GQA) when this baseline was written. A case an
//! operator refuses (numpy has no bf16) is left out with the reason in
//! the report's notes.

use attn_benches::BenchCase;
use attn_spec::DType;
use serde_json::{json, Value};
use std::process::Command;

/// How to get the baseline, for the report.
pub const INSTALL_HINT: &str =
    "python3 -m pip install onnxruntime onnx (or point ATTN_PYTHON at an interpreter that has them)";

const SCRIPT: &str = r#"
import json, sys, time, statistics
import numpy as np
import onnxruntime as ort
from onnx import helper, TensorProto

def other_work(us):
    # Busy work before a timed call (BenchCase::gap_us), not timed.
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass

spec = json.load(open(sys.argv[1]))
ONNX = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
NP = {"f32": np.float32, "f16": np.float16}

def window_mask(c):
    # True where a pair takes part: attn's bottom-right aligned window.
    off = c["sk"] - c["sq"]
    i = np.arange(c["sq"])[:, None] + off
    j = np.arange(c["sk"])[None, :]
    m = np.ones((c["sq"], c["sk"]), dtype=bool)
    if c["left"] is not None:
        m &= j >= i - c["left"]
    if c["right"] is not None:
        m &= j <= i + c["right"]
    return m

def masking(c):
    # (square causal, mask or None)
    if c["left"] is None and c["right"] is None:
        return False, None
    if c["left"] is None and c["right"] == 0 and c["sq"] == c["sk"]:
        return True, None
    return False, window_mask(c)

def standard(c, rng):
    t, nt = ONNX[c["dtype"]], NP[c["dtype"]]
    b, hq, hk, sq, sk, d = c["b"], c["hq"], c["hkv"], c["sq"], c["sk"], c["d"]
    causal, mask = masking(c)
    feeds = {"Q": (rng.random((b, hq, sq, d)) * 2 - 1).astype(nt),
             "K": (rng.random((b, hk, sk, d)) * 2 - 1).astype(nt),
             "V": (rng.random((b, hk, sk, d)) * 2 - 1).astype(nt)}
    ins = [helper.make_tensor_value_info(n, t, list(feeds[n].shape)) for n in ("Q", "K", "V")]
    names = ["Q", "K", "V"]
    if mask is not None:
        feeds["M"] = mask
        ins.append(helper.make_tensor_value_info("M", TensorProto.BOOL, list(mask.shape)))
        names.append("M")
    attrs = {"is_causal": 1} if causal else {}
    node = helper.make_node("Attention", names, ["O"], **attrs)
    out = helper.make_tensor_value_info("O", t, None)
    g = helper.make_graph([node], "attention", ins, [out])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    return m.SerializeToString(), feeds

def contrib_mha(c, rng):
    if c["hq"] != c["hkv"]:
        return None
    t, nt = ONNX[c["dtype"]], NP[c["dtype"]]
    b, h, sq, sk, d = c["b"], c["hq"], c["sq"], c["sk"], c["d"]
    causal, mask = masking(c)
    feeds = {"q": (rng.random((b, sq, h * d)) * 2 - 1).astype(nt),
             "k": (rng.random((b, sk, h * d)) * 2 - 1).astype(nt),
             "v": (rng.random((b, sk, h * d)) * 2 - 1).astype(nt)}
    ins = [helper.make_tensor_value_info(n, t, list(feeds[n].shape)) for n in ("q", "k", "v")]
    names = ["q", "k", "v"]
    if mask is not None:
        feeds["bias"] = np.where(mask, 0.0, -np.inf).astype(nt)[None, None]
        ins.append(helper.make_tensor_value_info("bias", t, list(feeds["bias"].shape)))
        names += ["", "", "bias"]
    attrs = {"num_heads": h}
    if causal:
        attrs["unidirectional"] = 1
    node = helper.make_node("MultiHeadAttention", names, ["o"], domain="com.microsoft", **attrs)
    out = helper.make_tensor_value_info("o", t, None)
    g = helper.make_graph([node], "mha", ins, [out])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString(), feeds

def contrib_gqa(c, rng):
    # Causal by construction: only causal masks and left windows.
    if c["right"] != 0:
        return None
    t, nt = ONNX[c["dtype"]], NP[c["dtype"]]
    b, hq, hk, sq, sk, d = c["b"], c["hq"], c["hkv"], c["sq"], c["sk"], c["d"]
    past = sk - sq
    feeds = {"q": (rng.random((b, sq, hq * d)) * 2 - 1).astype(nt),
             "k": (rng.random((b, sq, hk * d)) * 2 - 1).astype(nt),
             "v": (rng.random((b, sq, hk * d)) * 2 - 1).astype(nt),
             "pk": (rng.random((b, hk, past, d)) * 2 - 1).astype(nt),
             "pv": (rng.random((b, hk, past, d)) * 2 - 1).astype(nt),
             "seqlens_k": np.full((b,), sk - 1, dtype=np.int32),
             "total": np.array(sk, dtype=np.int32)}
    ins = [helper.make_tensor_value_info(n, t, list(feeds[n].shape)) for n in ("q", "k", "v", "pk", "pv")]
    ins += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
            helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    attrs = {"num_heads": hq, "kv_num_heads": hk}
    if c["left"] is not None:
        attrs["local_window_size"] = c["left"] + 1
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total"],
                            ["o", "pko", "pvo"], domain="com.microsoft", **attrs)
    outs = [helper.make_tensor_value_info(n, t, None) for n in ("o", "pko", "pvo")]
    g = helper.make_graph([node], "gqa", ins, outs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString(), feeds

for c in spec["cases"]:
    for op, build in (("ort-attention", standard), ("ort-mha", contrib_mha), ("ort-gqa", contrib_gqa)):
        if c["dtype"] not in NP:
            print(f"{op} {c['name']}: numpy has no {c['dtype']}; left out", file=sys.stderr)
            continue
        built = build(c, np.random.default_rng(0))
        if built is None:
            continue
        model, feeds = built
        for t in spec["threads"]:
            try:
                so = ort.SessionOptions()
                so.intra_op_num_threads = t
                so.inter_op_num_threads = 1
                sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
                sess.run(None, feeds)
                times = []
                start = time.perf_counter()
                while len(times) < 10 and (len(times) < 3 or time.perf_counter() - start < spec["secs"]):
                    other_work(c["gap_us"])
                    t0 = time.perf_counter()
                    sess.run(None, feeds)
                    times.append(time.perf_counter() - t0)
            except Exception as e:
                msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                print(f"{op} {c['name']} on {t} threads: {msg}", file=sys.stderr)
                break
            print(json.dumps({"case": c["name"], "threads": t, "op": op, "median": statistics.median(times),
                              "min": min(times), "max": max(times)}), flush=True)
"#;

fn python() -> String {
    std::env::var("ATTN_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The onnxruntime version, or why the baseline cannot run.
pub fn available() -> Result<String, String> {
    let out = Command::new(python())
        .args([
            "-c",
            "import onnx, onnxruntime; print(onnxruntime.__version__)",
        ])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{} cannot import onnxruntime and onnx; to add the baseline: {INSTALL_HINT}",
            python()
        ))
    }
}

/// One timing of the baseline.
#[derive(Clone, Debug)]
pub struct OrtTime {
    /// Case name.
    pub case: String,
    /// Threads.
    pub threads: usize,
    /// The operator's row name (`ort-attention`, `ort-mha`, `ort-gqa`).
    pub op: String,
    /// Median seconds.
    pub median: f64,
    /// Fastest run.
    pub min: f64,
    /// Slowest run.
    pub max: f64,
}

/// Times every case for every thread count; also returns what the
/// operators refused (one line each).
pub fn run(
    cases: &[&BenchCase],
    threads: &[usize],
    secs: f64,
    dir: &std::path::Path,
) -> Result<(Vec<OrtTime>, Vec<String>), String> {
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
                   "sk": c.kv_len, "d": c.head_dim, "left": left, "right": right, "dtype": dtype, "gap_us": c.gap_us})
        })
        .collect();
    let spec_path = dir.join("ort_spec.json");
    let script_path = dir.join("ort_attention.py");
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
            "ONNX Runtime baseline failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let refused = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    let times = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).map_err(|e| format!("{e}: {l}"))?;
            Ok(OrtTime {
                case: v["case"].as_str().unwrap_or_default().to_string(),
                threads: v["threads"].as_u64().unwrap_or(0) as usize,
                op: v["op"].as_str().unwrap_or_default().to_string(),
                median: v["median"].as_f64().unwrap_or(f64::NAN),
                min: v["min"].as_f64().unwrap_or(f64::NAN),
                max: v["max"].as_f64().unwrap_or(f64::NAN),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok((times, refused))
}
