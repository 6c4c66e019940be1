//! `cargo xtask peak`, and the machine section of every report: FMA peak per
//! core and for all cores, memory bandwidth, CPU model, SIMD compiled in
//! versus available, versions, commit and date.

use attn_benches::machine::{fma_peak, fma_peak_per_core, read_bandwidth, triad_bandwidth};
use serde_json::{json, Value};
use std::process::Command;

/// The measured roofline and facts of this machine.
#[derive(Clone, Debug)]
pub struct Machine {
    /// Logical cores.
    pub cores: usize,
    /// f32 FMA peak of one core, GFLOP/s.
    pub peak_1: f64,
    /// f32 FMA peak of all cores, GFLOP/s.
    pub peak_all: f64,
    /// Triad bandwidth with one thread, GB/s.
    pub bw_1: f64,
    /// Triad bandwidth with all cores, GB/s.
    pub bw_all: f64,
    /// Read bandwidth with one thread and with all cores, GB/s.
    pub read: (f64, f64),
    /// Everything else, for the report.
    pub facts: Value,
}

impl Machine {
    /// FMA peak for `threads` threads (the per-core peak times the threads,
    /// capped by the all-core measurement).
    pub fn peak(&self, threads: usize) -> f64 {
        if threads >= self.cores {
            self.peak_all
        } else {
            (self.peak_1 * threads as f64).min(self.peak_all.max(self.peak_1))
        }
    }

    /// A warning when the all-core FMA peak came out below 75% of `cores`
    /// times one core's: something else ran on the machine while it was
    /// measured, and the all-core figures of the run (and their percent of
    /// peak) cannot be trusted.
    pub fn contention(&self) -> Option<String> {
        let ratio = self.peak_all / self.peak_1;
        (self.cores > 1 && ratio < 0.75 * self.cores as f64).then(|| {
            format!(
                "the all-core FMA peak measured only {ratio:.2}x one core's on {} cores: \
                 other load shared the machine, so this run's all-core figures are unreliable",
                self.cores
            )
        })
    }

    /// Triad bandwidth for `threads` threads.
    pub fn bandwidth(&self, threads: usize) -> f64 {
        if threads > 1 {
            self.bw_all
        } else {
            self.bw_1
        }
    }

    /// Read bandwidth for `threads` threads.
    pub fn read_bandwidth(&self, threads: usize) -> f64 {
        if threads > 1 {
            self.read.1
        } else {
            self.read.0
        }
    }
}

fn cmd(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// The SIMD level attn-cpu dispatches to in this process (`ATTN_CPU_ISA`
/// may cap it), or the error that variable gives.
pub fn simd_level() -> String {
    match attn_cpu::Cpu::new().isa() {
        Ok(isa) => isa.name().to_string(),
        Err(e) => e.to_string(),
    }
}

/// Measures the machine (about 10 seconds).
pub fn measure() -> Machine {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!("measuring the machine: FMA peak and memory bandwidth ...");
    let peak_1 = fma_peak_per_core();
    let peak_all = fma_peak(cores);
    let bw_1 = triad_bandwidth(1);
    let bw_all = triad_bandwidth(cores);
    let read = (read_bandwidth(1), read_bandwidth(cores));
    let facts = json!({
        "cpu_model": crate::cpu_model(),
        "cores": cores,
        "simd_dispatched": simd_level(),
        "simd_available": attn_cpu::Isa::detected().name(),
        "fma_peak_gflops_per_core": peak_1,
        "fma_peak_gflops_all_cores": peak_all,
        "triad_bandwidth_gbs_1_thread": bw_1,
        "triad_bandwidth_gbs_all_cores": bw_all,
        "read_bandwidth_gbs_1_thread": read.0,
        "read_bandwidth_gbs_all_cores": read.1,
        "rustc": cmd("rustc", &["-V"]),
        "git_commit": cmd("git", &["rev-parse", "--short", "HEAD"]),
        "git_dirty": !cmd("git", &["status", "--porcelain", "--untracked-files=no"]).is_empty(),
        "date": cmd("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        "attn_version": env!("CARGO_PKG_VERSION"),
    });
    Machine {
        cores,
        peak_1,
        peak_all,
        bw_1,
        bw_all,
        read,
        facts,
    }
}

/// `cargo xtask peak`.
pub fn run_peak() -> Result<(), String> {
    let m = measure();
    println!(
        "CPU:        {}",
        m.facts["cpu_model"].as_str().unwrap_or("?")
    );
    println!(
        "SIMD:       attn-cpu runs {} (this CPU's widest: {}; detected at run time)",
        simd_level(),
        attn_cpu::Isa::detected()
    );
    println!(
        "FMA peak:   {:.1} GFLOP/s per core, {:.1} GFLOP/s on {} cores",
        m.peak_1, m.peak_all, m.cores
    );
    println!(
        "bandwidth:  {:.1} GB/s one thread, {:.1} GB/s all cores (triad)",
        m.bw_1, m.bw_all
    );
    println!(
        "            {:.1} GB/s one thread, {:.1} GB/s all cores (read)",
        m.read.0, m.read.1
    );
    if let Some(w) = m.contention() {
        println!("warning:    {w}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(cores: usize, peak_1: f64, peak_all: f64) -> Machine {
        Machine {
            cores,
            peak_1,
            peak_all,
            bw_1: 1.0,
            bw_all: 1.0,
            read: (1.0, 1.0),
            facts: Value::Null,
        }
    }

    #[test]
    fn a_contended_all_core_peak_is_flagged() {
        assert!(machine(2, 115.0, 118.8).contention().is_some());
        assert!(machine(2, 102.0, 204.0).contention().is_none());
        assert!(machine(8, 100.0, 650.0).contention().is_none());
        assert!(machine(8, 100.0, 500.0).contention().is_some());
        assert!(machine(1, 100.0, 100.0).contention().is_none());
    }
}
