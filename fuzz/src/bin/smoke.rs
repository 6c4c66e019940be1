//! The fuzz check on stable, without coverage guidance: every file of the
//! corpus, then random inputs (lengths 0..512, bytes from a seeded
//! generator) until the time is up. A failing input is written to
//! `fuzz/artifacts/` and the run exits 1.
//!
//! `smoke [--seconds N] [--seed S] [CORPUS_DIR...]`; `smoke --explain FILE`
//! prints what an input decodes to and the check's verdict.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    let mut seconds = 60u64;
    let mut seed = 0x5eed_u64;
    let mut dirs = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let num = |v: Option<String>| v.and_then(|v| v.parse().ok());
        match a.as_str() {
            "--seconds" => seconds = num(args.next()).unwrap_or(seconds),
            "--seed" => seed = num(args.next()).unwrap_or(seed),
            "--explain" => return explain(args.next()),
            _ => dirs.push(PathBuf::from(a)),
        }
    }
    let mut runs = 0u64;
    for dir in &dirs {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        files.sort();
        for f in files {
            let Ok(data) = std::fs::read(&f) else {
                continue;
            };
            runs += 1;
            if let Err(e) = attn_fuzz::run_one(&data) {
                return fail(&data, &format!("corpus file {}: {e}", f.display()));
            }
        }
    }
    println!("fuzz smoke: {runs} corpus inputs passed");
    let start = Instant::now();
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut random = 0u64;
    // [invalid problem, valid with non-finite or out-of-range data, clean, plain]
    let mut kinds = [0u64; 4];
    while start.elapsed() < Duration::from_secs(seconds) {
        let len = (next() % 512) as usize;
        let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        random += 1;
        let d = attn_conformance::fuzz::decode(&data);
        kinds[if d.plain {
            3
        } else if d.clean {
            2
        } else if d.case.problem.validate().is_ok() {
            1
        } else {
            0
        }] += 1;
        if let Err(e) = attn_fuzz::run_one(&data) {
            return fail(&data, &e);
        }
    }
    println!(
        "fuzz smoke: {random} random inputs passed in {:.0} s (seed {seed}): {} invalid problems, {} valid with non-finite or out-of-range data, {} clean, {} plain (backward checked too)",
        start.elapsed().as_secs_f64(),
        kinds[0],
        kinds[1],
        kinds[2],
        kinds[3]
    );
    ExitCode::SUCCESS
}

fn fail(data: &[u8], e: &str) -> ExitCode {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("artifacts");
    let _ = std::fs::create_dir_all(&dir);
    let hash = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let path = dir.join(format!("smoke-{hash:016x}"));
    let _ = std::fs::write(&path, data);
    eprintln!(
        "fuzz smoke: FAILED on {} ({} bytes)\n{e}",
        path.display(),
        data.len()
    );
    ExitCode::FAILURE
}

fn explain(file: Option<String>) -> ExitCode {
    let Some(data) = file.and_then(|f| std::fs::read(f).ok()) else {
        eprintln!("--explain FILE: cannot read the file");
        return ExitCode::FAILURE;
    };
    let d = attn_conformance::fuzz::decode(&data);
    let c = &d.case;
    let range = |x: &attn_spec::HostData| {
        let v = x.to_f64_vec();
        let fin: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        let lo = fin.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = fin.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let odd = v.len() - fin.len();
        format!("{} values in [{lo:e}, {hi:e}], {odd} non-finite", v.len())
    };
    println!("{}", c.describe());
    println!("options: {:?}", c.problem.options);
    println!(
        "views: q {:?}\n k {:?}\n v {:?}\n out {:?}",
        c.problem.q, c.problem.k, c.problem.v, c.problem.out
    );
    println!("q: {}\nk: {}\nv: {}", range(&c.q), range(&c.k), range(&c.v));
    if let Some(b) = &c.bias {
        println!("bias {:?}: {}", c.problem.bias, range(b));
    }
    println!(
        "validate: {:?}; clean {}, plain {}",
        c.problem.validate(),
        d.clean,
        d.plain
    );
    match attn_fuzz::run_one(&data) {
        Ok(()) => println!("passes"),
        Err(e) => println!("fails: {e}"),
    }
    ExitCode::SUCCESS
}
