//! `cargo xtask cpu-check`: attn-cpu's kernels keep their accumulators in
//! registers on every SIMD level. Runs attn-cpu's passes once on small
//! problems, then disassembles its own executable (a release build that
//! links them, every level compiled in: dispatch is at run time) with
//! `objdump`, and counts, in each level's out-of-line functions
//! (`kernel_entries!`; `dot16::` for the avx512bf16 level), the
//! instructions that move a vector register to or from the stack: in the
//! microkernels (`scores_part`, `pv_part`, and the avx512bf16 level's
//! `scores_quad_pairs` and `accumulate_pairs`) every such move is a spill,
//! and the check fails on one; `run_items`, `decode_tile` and the rest
//! (the loop nests around them) are reported for information.

use std::collections::BTreeMap;
use std::process::Command;

/// The functions whose vector stack traffic fails the check.
const KERNELS: &[&str] = &["scores_part", "pv_part"];

/// The same for the avx512bf16 level's own kernels (`dot16::`).
const BF16_KERNELS: &[&str] = &["scores_quad_pairs", "accumulate_pairs"];

pub fn run() -> Result<(), String> {
    // This very program, built with the workspace's release profile, links
    // attn-cpu's passes through `exercise` (and, with the bench feature,
    // the bench): every level's kernels are in it, as in any release
    // build, since the level is chosen at run time.
    exercise()?;
    let exe = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    let out = Command::new("objdump")
        .args(["-d", "--no-show-raw-insn", "-C"])
        .arg(&exe)
        .output()
        .map_err(|e| format!("objdump (binutils) is needed: {e}"))?;
    if !out.status.success() {
        return Err(format!("objdump {} failed", exe.display()));
    }
    let asm = String::from_utf8_lossy(&out.stdout);
    let counts = stack_moves(&asm);
    if counts.is_empty() {
        return Err("no attn-cpu kernel found in the disassembly".into());
    }
    println!("| level | function | instructions | vector stack moves |\n|---|---|---|---|");
    let mut spills = Vec::new();
    for ((level, func), (n, moves)) in &counts {
        println!("| {level} | {func} | {n} | {moves} |");
        let kernel = KERNELS.contains(&func.as_str())
            || (level == "avx512bf16" && BF16_KERNELS.contains(&func.as_str()));
        if kernel && *moves > 0 {
            spills.push(format!("{level}::{func} ({moves})"));
        }
    }
    let levels = ["portable", "avx2", "avx512", "avx512bf16"];
    let every = levels
        .iter()
        .flat_map(|l| KERNELS.iter().map(move |f| (*l, *f)));
    for (level, func) in every.chain(BF16_KERNELS.iter().map(|f| ("avx512bf16", *f))) {
        if !counts.contains_key(&(level.to_string(), func.to_string())) {
            return Err(format!("{level}::{func} is missing from the disassembly"));
        }
    }
    if spills.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "microkernels spill vector registers: {}",
            spills.join(", ")
        ))
    }
}

/// Runs attn-cpu once on each path whose kernels the check reads, on
/// small problems, f32 and bf16: prefill (causal), decode (GQA 4:1 on two
/// K/V heads, one query row), the backward pass and the attention maps.
/// It fails on an error or a non-finite output; what matters most is
/// that this program then links them (run on the level this CPU runs;
/// the others' are linked all the same).
fn exercise() -> Result<(), String> {
    use attn_spec::{
        AttentionMaps, AttnOptions, Backend, Backward, DType, GradInputs, GradRequest, HostData,
        Inputs, MapRequest, Problem, Shape,
    };
    let e = |e: attn_spec::AttnError| format!("cpu-check's exercise of attn-cpu: {e}");
    let data = |n: usize, seed: u32, dtype: DType| {
        let vals = (0..n)
            .map(|i| ((i as u32).wrapping_mul(2654435761) ^ seed) as f32 / u32::MAX as f32 - 0.5);
        match dtype {
            DType::Bf16 => HostData::Bf16(vals.map(attn_spec::bf16::from_f32).collect()),
            _ => HostData::F32(vals.collect()),
        }
    };
    let finite = |d: &HostData| match d {
        HostData::F32(v) => v.iter().all(|x| x.is_finite()),
        HostData::Bf16(v) => v.iter().all(|x| x.to_f32().is_finite()),
        _ => true,
    };
    let cpu = attn_cpu::Cpu::new();
    for dtype in [DType::F32, DType::Bf16] {
        // (b, h, kv heads, q_len, kv_len, d), causal
        for ([b, h, kvh, sq, skv, d], causal) in [
            ([1, 2, 2, 64, 64, 64], true),
            ([1, 8, 2, 1, 96, 128], false),
        ] {
            let mut options = AttnOptions::default();
            if causal {
                options = options.causal();
            }
            options.return_lse = true;
            let problem =
                Problem::new(Shape::new(b, h, kvh, sq, skv, d), dtype).with_options(options);
            let (q, k, v) = (
                data(b * sq * h * d, 1, dtype),
                data(b * skv * kvh * d, 2, dtype),
                data(b * skv * kvh * d, 3, dtype),
            );
            let inputs = Inputs::new(&q, &k, &v);
            let fwd = cpu.forward(&problem, inputs).map_err(e)?;
            let lse = fwd
                .lse
                .as_ref()
                .ok_or("cpu-check: the forward returned no log-sum-exp")?;
            let grads = cpu
                .backward(
                    &problem,
                    inputs,
                    GradInputs {
                        out: &fwd.out,
                        lse: Some(lse),
                        d_out: &fwd.out,
                    },
                    GradRequest::all(&problem),
                )
                .map_err(e)?;
            let maps = cpu
                .maps(&problem, inputs, Some(lse), &MapRequest::all())
                .map_err(e)?;
            for (what, buf) in [
                ("output", &fwd.out),
                ("dQ", &grads.dq),
                ("dK", &grads.dk),
                ("dV", &grads.dv),
                ("maps", &maps.probs),
            ] {
                if !finite(buf) {
                    return Err(format!(
                        "cpu-check: attn-cpu's {what} is not finite \
                         ({dtype:?}, {b}x{h}x{kvh}x{sq}x{skv}x{d})"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Per `(level, function)` of `attn_cpu::simd::<level>::kernels::`, its
/// instruction count and how many of its instructions move an xmm, ymm or
/// zmm register to or from a stack slot.
fn stack_moves(asm: &str) -> BTreeMap<(String, String), (usize, usize)> {
    let mut counts = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in asm.lines() {
        if let Some(name) = line.strip_suffix(">:").and_then(|l| l.split_once(" <")) {
            current = kernel_name(name.1);
            continue;
        }
        let Some(key) = &current else { continue };
        let Some((_, insn)) = line.split_once(":\t") else {
            continue;
        };
        let e = counts.entry(key.clone()).or_insert((0, 0));
        e.0 += 1;
        let vector = ["%xmm", "%ymm", "%zmm"].iter().any(|r| insn.contains(r));
        if vector && insn.contains("(%rsp)") {
            e.1 += 1;
        }
    }
    counts
}

/// `(level, function)` of a demangled symbol in a level's `kernels` module
/// (the bf16 dot-product pass and its kernels, `attn_cpu::dot16::`, are the
/// `avx512bf16` level's).
fn kernel_name(symbol: &str) -> Option<(String, String)> {
    let dot16 = [
        "attn_cpu::dot16::kernels::",
        "attn_cpu::dot16::pass::",
        "attn_cpu::dot16::decode::",
    ]
    .iter()
    .find_map(|p| symbol.strip_prefix(p));
    let (level, rest) = match dot16 {
        Some(rest) => ("avx512bf16", rest),
        None => symbol
            .strip_prefix("attn_cpu::simd::")?
            .split_once("::kernels::")?,
    };
    let func: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    Some((level.to_string(), func))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_vector_stack_moves_per_kernel() {
        let asm = "\
0000000000001000 <attn_cpu::simd::avx2::kernels::scores_part>:
    1000:\tvmovups (%rsi),%ymm0
    1004:\tvmovups %ymm3,0x20(%rsp)
    1008:\tmov    0x8(%rsp),%rax
0000000000002000 <attn_cpu::simd::avx2::kernels::run_items<f32, 4>>:
    2000:\tvfmadd231ps 0x40(%rsp),%ymm1,%ymm2
0000000000003000 <other::function>:
    3000:\tvmovups %ymm3,0x20(%rsp)
0000000000004000 <attn_cpu::dot16::kernels::pv_part>:
    4000:\tvdpbf16ps %zmm1,%zmm2,%zmm3
0000000000005000 <attn_cpu::dot16::pass::try_pass<half::bfloat::bf16, 4>>:
    5000:\tvmovups %zmm3,0x40(%rsp)
";
        let c = stack_moves(asm);
        assert_eq!(c[&("avx2".into(), "scores_part".into())], (3, 1));
        assert_eq!(c[&("avx2".into(), "run_items".into())], (1, 1));
        assert_eq!(c[&("avx512bf16".into(), "pv_part".into())], (1, 0));
        assert_eq!(c[&("avx512bf16".into(), "try_pass".into())], (1, 1));
        assert_eq!(c.len(), 4);
    }
}
