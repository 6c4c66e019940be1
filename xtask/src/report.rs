//! The report: one record per backend x case x threads, written as
//! `report.json` (machine section first) and `report.md` (tables), plus a
//! summary on the terminal.

use crate::machine::Machine;
use attn_benches::BenchCase;
use serde_json::{json, Value};
use std::fmt::Write as _;

/// One measured (backend, case, threads).
#[derive(Clone, Debug)]
pub struct Record {
    /// Backend name (`cpu`, `reference`, `torch-sdpa`).
    pub backend: String,
    /// The case.
    pub case: BenchCase,
    /// Threads.
    pub threads: usize,
    /// Median seconds per call.
    pub median: f64,
    /// Low and high end of the spread (criterion's confidence interval of
    /// the median, or the fastest and slowest run for baselines).
    pub spread: (f64, f64),
    /// Whether the output was checked against the reference and passed.
    pub checked: bool,
    /// What the check did or why it failed.
    pub check_note: String,
}

impl Record {
    /// GFLOP/s of the visible pairs (a backward row counts 2.5 times the
    /// forward's FLOPs, `attn_benches::flops_factor`).
    pub fn gflops(&self) -> f64 {
        attn_benches::flops_factor(&self.backend) * self.case.flops() / self.median / 1e9
    }

    /// GB/s of K and V (decode cases).
    pub fn gbs(&self) -> Option<f64> {
        self.case
            .is_decode()
            .then(|| self.case.kv_bytes() / self.median / 1e9)
    }

    fn json(&self, m: &Machine) -> Value {
        let c = &self.case;
        let peak = m.peak(self.threads);
        json!({
            "backend": self.backend,
            "case": c.name,
            "batch": c.batch, "q_heads": c.q_heads, "kv_heads": c.kv_heads,
            "q_len": c.q_len, "kv_len": c.kv_len, "head_dim": c.head_dim,
            "mask": format!("{:?}", c.mask),
            "dtype": c.dtype.to_string(),
            "threads": self.threads,
            "median_s": self.median,
            "spread_s": [self.spread.0, self.spread.1],
            "flops": attn_benches::flops_factor(&self.backend) * c.flops(),
            "gflops": self.gflops(),
            "percent_of_peak": 100.0 * self.gflops() / peak,
            "gbs": self.gbs(),
            "percent_of_bandwidth": self.gbs().map(|g| 100.0 * g / m.bandwidth(self.threads)),
            "percent_of_read_bandwidth": self.gbs().map(|g| 100.0 * g / m.read_bandwidth(self.threads)),
            "checked": self.checked,
            "check": self.check_note,
        })
    }
}

/// Rows whose thread scaling suggests the machine was shared while they
/// ran (the all-core peak check, `Machine::contention`, sees only the
/// moment it measures): for each backend and case, the 1-thread rate more
/// than 10% below the per-thread rate of the most threads (a contended
/// 1-thread run, unless the case really scales past linear, e.g. through
/// the second core's cache), or, for cases of at least a GFLOP, more
/// threads slower than one (a contended many-thread run).
pub fn scaling_warnings(records: &[Record]) -> Vec<String> {
    let mut out = Vec::new();
    for one in records.iter().filter(|r| r.threads == 1) {
        let Some(many) = records
            .iter()
            .filter(|r| r.backend == one.backend && r.case.name == one.case.name && r.threads > 1)
            .max_by_key(|r| r.threads)
        else {
            continue;
        };
        let (g1, gn, n) = (one.gflops(), many.gflops(), many.threads);
        let what = format!("{} on {}", one.case.name, one.backend);
        if gn / n as f64 > 1.1 * g1 {
            out.push(format!(
                "{what}: 1 thread ran at {g1:.1} GFLOP/s, below the {:.1} per thread of {n} threads (contended 1-thread run?)",
                gn / n as f64
            ));
        } else if one.case.flops() >= 1e9 && gn < g1 {
            out.push(format!(
                "{what}: {n} threads ran at {gn:.1} GFLOP/s, slower than 1 thread's {g1:.1} (contended {n}-thread run?)"
            ));
        }
    }
    out
}

/// Writes `report.json` and `report.md` into `dir`; returns the markdown.
pub fn write(
    dir: &std::path::Path,
    m: &Machine,
    records: &[Record],
    notes: &[String],
    memory: Option<&Value>,
) -> Result<String, String> {
    let doc = json!({
        "machine": m.facts,
        "contention_warning": m.contention(),
        "scaling_warnings": scaling_warnings(records),
        "notes": notes,
        "memory_case": memory,
        "records": records.iter().map(|r| r.json(m)).collect::<Vec<_>>(),
    });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("report.json"), text).map_err(|e| e.to_string())?;
    let md = markdown(m, records, notes, memory);
    std::fs::write(dir.join("report.md"), &md).map_err(|e| e.to_string())?;
    Ok(md)
}

fn markdown(m: &Machine, records: &[Record], notes: &[String], memory: Option<&Value>) -> String {
    let f = &m.facts;
    let text = |k: &str| match &f[k] {
        Value::String(v) => v.clone(),
        other => other.to_string(),
    };
    let mut s = String::new();
    let _ = writeln!(s, "# attn benchmark report\n");
    let _ = writeln!(s, "| machine | |\n|---|---|");
    for (k, v) in [
        ("CPU", text("cpu_model")),
        ("cores", m.cores.to_string()),
        (
            "SIMD level run / CPU's widest (run-time dispatch)",
            format!("{} / {}", text("simd_dispatched"), text("simd_available")),
        ),
        (
            "FMA peak (f32)",
            format!(
                "{:.1} GFLOP/s per core, {:.1} on {} cores",
                m.peak_1, m.peak_all, m.cores
            ),
        ),
        (
            "memory bandwidth (triad)",
            format!("{:.1} GB/s one thread, {:.1} all cores", m.bw_1, m.bw_all),
        ),
        (
            "memory bandwidth (read)",
            format!("{:.1} GB/s one thread, {:.1} all cores", m.read.0, m.read.1),
        ),
        ("rustc", text("rustc")),
        (
            "commit",
            format!(
                "{} (uncommitted changes: {})",
                text("git_commit"),
                text("git_dirty")
            ),
        ),
        ("date", text("date")),
    ] {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    let _ = writeln!(
        s,
        "\nThroughput counts only visible (query, key) pairs, 4 x head_dim flops each; percent of peak is against the FMA peak measured above for the same thread count; decode cases also show GB/s of K and V against the measured triad and read bandwidths (decoding only reads). `checked` = the output matched the f64 reference under the conformance bound just before timing.\n"
    );
    if let Some(w) = m.contention() {
        let _ = writeln!(s, "- **Warning:** {w}.");
    }
    for w in scaling_warnings(records) {
        let _ = writeln!(s, "- **Check:** {w}.");
    }
    for n in notes {
        let _ = writeln!(s, "- {n}");
    }
    let mut cases: Vec<&str> = records.iter().map(|r| r.case.name).collect();
    cases.dedup();
    let mut seen = std::collections::HashSet::new();
    cases.retain(|c| seen.insert(*c));
    let _ = writeln!(
        s,
        "\n| case | backend | threads | median | GFLOP/s | % of peak | GB/s (% of triad, read bw) | checked |\n|---|---|---|---|---|---|---|---|"
    );
    for c in &cases {
        for r in records.iter().filter(|r| r.case.name == *c) {
            let gbs = r.gbs().map_or(String::new(), |g| {
                format!(
                    "{g:.1} ({:.0}%, {:.0}%)",
                    100.0 * g / m.bandwidth(r.threads),
                    100.0 * g / m.read_bandwidth(r.threads)
                )
            });
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.1} | {:.1}% | {} | {} |",
                c,
                r.backend,
                r.threads,
                fmt_time(r.median),
                r.gflops(),
                100.0 * r.gflops() / m.peak(r.threads),
                gbs,
                if r.checked {
                    "yes"
                } else if r.check_note.starts_with("baseline") {
                    "- (baseline)"
                } else if r.check_note.starts_with("not checked") {
                    "- (small cases only)"
                } else {
                    "**NO**"
                }
            );
        }
    }
    let _ = writeln!(
        s,
        "\n## attn-cpu against the baselines (same run, same threads)\n"
    );
    let _ = writeln!(
        s,
        "PyTorch's SDPA (`torch-sdpa`; backward rows `cpu-bwd` against `torch-sdpa-bwd`, `torch.autograd.grad` of Q, K, V through SDPA, count 2.5x the forward's FLOPs; `forward, spinning` rows `cpu-spin`, attn-cpu with its helpers spinning after each call) and ONNX Runtime's CPU attention operators (`ort-attention`, `ort-mha`, `ort-gqa`). Speed-up: the baseline's time over attn-cpu's.\n"
    );
    let _ = writeln!(
        s,
        "| case | pass | threads | attn-cpu | baseline | its time | speed-up |\n|---|---|---|---|---|---|---|"
    );
    let mut any = false;
    for (pass, ours, theirs) in [
        ("forward", "cpu", "torch-sdpa"),
        ("forward", "cpu", "ort-attention"),
        ("forward", "cpu", "ort-mha"),
        ("forward", "cpu", "ort-gqa"),
        ("forward, spinning", "cpu-spin", "torch-sdpa"),
        ("forward, spinning", "cpu-spin", "ort-attention"),
        ("forward, spinning", "cpu-spin", "ort-mha"),
        ("forward, spinning", "cpu-spin", "ort-gqa"),
        ("backward", "cpu-bwd", "torch-sdpa-bwd"),
    ] {
        for c in &cases {
            for r in records
                .iter()
                .filter(|r| r.case.name == *c && r.backend == ours)
            {
                if let Some(t) = records
                    .iter()
                    .find(|t| t.backend == theirs && t.case.name == *c && t.threads == r.threads)
                {
                    any = true;
                    let _ = writeln!(
                        s,
                        "| {c} | {pass} | {} | {} | {theirs} | {} | {:.2}x |",
                        r.threads,
                        fmt_time(r.median),
                        fmt_time(t.median),
                        t.median / r.median
                    );
                }
            }
        }
    }
    if !any {
        let _ = writeln!(s, "(no baseline timings in this run)");
    }
    let twins = narrow_twins(records);
    if !twins.is_empty() {
        let _ = writeln!(
            s,
            "\n## bf16 and f16 against attn-cpu's own f32 (same shape, same run, same threads)\n"
        );
        let _ = writeln!(
            s,
            "| case | threads | GFLOP/s | f32 case | its GFLOP/s | ratio |\n|---|---|---|---|---|---|"
        );
        for (r, f) in twins {
            let _ = writeln!(
                s,
                "| {} | {} | {:.1} | {} | {:.1} | {:.2}x |",
                r.case.name,
                r.threads,
                r.gflops(),
                f.case.name,
                f.gflops(),
                f.median / r.median
            );
        }
    }
    if let Some(mem) = memory {
        let _ = writeln!(
            s,
            "\n## Memory\n\n```\n{}\n```",
            serde_json::to_string_pretty(mem).unwrap_or_default()
        );
    }
    s
}

/// attn-cpu's forward rows on 16-bit inputs, each with the f32 row of the
/// same shape, mask and thread count in the same run (the issue's measure
/// of what the 16-bit kernels gain over f32).
pub fn narrow_twins(records: &[Record]) -> Vec<(&Record, &Record)> {
    let shape = |c: &BenchCase| {
        (
            (c.batch, c.q_heads, c.kv_heads),
            (c.q_len, c.kv_len, c.head_dim),
            format!("{:?}", c.mask),
        )
    };
    records
        .iter()
        .filter(|r| r.backend == "cpu" && r.case.dtype != attn_spec::DType::F32)
        .filter_map(|r| {
            let twin = records.iter().find(|f| {
                f.backend == "cpu"
                    && f.threads == r.threads
                    && f.case.dtype == attn_spec::DType::F32
                    && shape(&f.case) == shape(&r.case)
            })?;
            Some((r, twin))
        })
        .collect()
}

/// A duration in the most readable unit.
pub fn fmt_time(secs: f64) -> String {
    if secs >= 1.0 {
        format!("{secs:.3} s")
    } else if secs >= 1e-3 {
        format!("{:.3} ms", secs * 1e3)
    } else {
        format!("{:.1} us", secs * 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use attn_benches::SUITE;

    fn record(case: &str, backend: &str, threads: usize, median: f64) -> Record {
        Record {
            backend: backend.into(),
            case: SUITE
                .iter()
                .find(|c| c.name == case)
                .expect("a suite case")
                .clone(),
            threads,
            median,
            spread: (median, median),
            checked: true,
            check_note: String::new(),
        }
    }

    fn markdown_for_test(rows: &[Record]) -> String {
        let m = Machine {
            cores: 2,
            peak_1: 100.0,
            peak_all: 200.0,
            bw_1: 10.0,
            bw_all: 20.0,
            read: (10.0, 20.0),
            facts: json!({}),
        };
        markdown(&m, rows, &[], None)
    }

    #[test]
    fn sixteen_bit_rows_meet_their_f32_twins() {
        let rows = [
            record("prefill/s512-d64", "cpu", 1, 2.0),
            record("prefill/s512-d64", "cpu", 2, 1.0),
            record("prefill/s512-d64-bf16", "cpu", 1, 1.0),
            record("prefill/s512-d64-bf16", "cpu", 2, 0.6),
            record("prefill/s512-d64-bf16", "torch-sdpa", 1, 3.0),
            // Same dtype, other mask: not a twin of the unmasked rows.
            record("prefill/s512-d64-causal-bf16", "cpu", 1, 0.5),
        ];
        let twins = narrow_twins(&rows);
        let got: Vec<_> = twins
            .iter()
            .map(|(r, f)| (r.case.name, r.threads, f.case.name, f.threads))
            .collect();
        assert_eq!(
            got,
            [
                ("prefill/s512-d64-bf16", 1, "prefill/s512-d64", 1),
                ("prefill/s512-d64-bf16", 2, "prefill/s512-d64", 2)
            ]
        );
        let md = markdown_for_test(&rows);
        assert!(md.contains("| prefill/s512-d64-bf16 | 1 |") && md.contains("| 2.00x |"));
    }

    #[test]
    fn implausible_scaling_is_flagged() {
        let case = "prefill/s2048-d128";
        // 2 threads at 1.9x: plausible, no warning.
        let fine = [
            record(case, "cpu", 1, 1.0),
            record(case, "cpu", 2, 1.0 / 1.9),
        ];
        assert!(scaling_warnings(&fine).is_empty());
        // 2 threads at 2.5x one: the 1-thread run was slow.
        let slow_one = [record(case, "cpu", 1, 1.0), record(case, "cpu", 2, 0.4)];
        assert_eq!(scaling_warnings(&slow_one).len(), 1);
        // 2 threads slower than one on a large case.
        let slow_two = [record(case, "cpu", 1, 1.0), record(case, "cpu", 2, 1.1)];
        assert_eq!(scaling_warnings(&slow_two).len(), 1);
        // A tiny case may not scale at all: no warning.
        let tiny = "tiny/s64-d32";
        let small = [record(tiny, "cpu", 1, 1e-5), record(tiny, "cpu", 2, 1.1e-5)];
        assert!(scaling_warnings(&small).is_empty());
    }
}
