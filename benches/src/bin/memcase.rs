//! Runs the long-context memory case once on all cores and prints, as JSON,
//! its peak resident memory (VmHWM) next to the bytes of its inputs and
//! outputs. A process of its own, so nothing else inflates the peak.

use attn::{Backend, Inputs};
use attn_benches::MEMORY_CASE;
use std::time::Instant;

fn status_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn main() {
    let case = &MEMORY_CASE;
    let base = status_kib("VmRSS:") * 1024;
    let p = case.problem();
    let [q, k, v] = case.data();
    let cpu = attn_cpu::Cpu::new();
    let mut out = cpu
        .zeros(p.dtype, p.out.extent().unwrap_or(0))
        .expect("alloc");
    let t = Instant::now();
    cpu.forward_into(&p, Inputs::new(&q, &k, &v), &mut out, None)
        .expect("forward");
    let secs = t.elapsed().as_secs_f64();
    let peak = status_kib("VmHWM:") * 1024;
    let io = case.io_bytes();
    println!(
        "{{\"case\":\"{}\",\"threads\":{},\"seconds\":{secs:.3},\"gflops\":{:.1},\"io_bytes\":{io},\"baseline_rss_bytes\":{base},\"peak_rss_bytes\":{peak},\"peak_over_io\":{:.4}}}",
        case.name,
        cpu.threads(),
        case.flops() / secs / 1e9,
        (peak.saturating_sub(base)) as f64 / io
    );
}
