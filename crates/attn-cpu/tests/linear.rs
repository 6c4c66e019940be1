//! The projection path of attn-cpu: `linear` against the f64 reference under
//! the standard dot-product error bound, and multi-head attention on the CPU
//! backend equal, bit for bit, to its own composition of `linear` and
//! `forward`.

use attn_conformance::rng::Rng;
use attn_cpu::Cpu;
use attn_spec::{
    AttentionMaps, AttnOptions, Backend, DType, HostData, Inputs, Linear, MapRequest, MhaConfig,
    MhaWeights, MultiHeadAttention, Problem, Reference, Shape,
};

fn rand(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

/// |y - y64| <= gamma(k + 2) * (sum_i |x_i w_i| + |b|) per element, with
/// gamma(n) = n u / (1 - n u), u = 2^-24 (f32 products summed in any order,
/// plus the bias add), plus the final rounding u * |y| for f16/bf16 output.
#[test]
fn linear_matches_the_reference_within_the_dot_product_bound() {
    let mut rng = Rng::new(1);
    for (rows, inf, outf, dt) in [
        (7, 33, 19, DType::F32),
        (64, 256, 96, DType::F32),
        (5, 40, 12, DType::Bf16),
        (9, 17, 8, DType::F16),
    ] {
        let x = HostData::from_f64(dt, &rand(&mut rng, rows * inf));
        let w = HostData::from_f64(dt, &rand(&mut rng, outf * inf));
        let b = HostData::from_f64(dt, &rand(&mut rng, outf));
        for threads in [1, 2] {
            let cpu = Cpu::with_threads(threads).unwrap();
            let got = cpu.linear(&x, rows, &w, Some(&b), inf, outf).unwrap();
            // The reference computes in f64 and rounds once to the output type.
            let want64: Vec<f64> = (0..rows * outf)
                .map(|i| {
                    let (r, o) = (i / outf, i % outf);
                    (0..inf)
                        .map(|k| x.get(r * inf + k) * w.get(o * inf + k))
                        .sum::<f64>()
                        + b.get(o)
                })
                .collect();
            let u = f64::from(f32::EPSILON) / 2.0;
            let gamma = (inf + 2) as f64 * u / (1.0 - (inf + 2) as f64 * u);
            for (i, &w64) in want64.iter().enumerate() {
                let (r, o) = (i / outf, i % outf);
                let mag: f64 = (0..inf)
                    .map(|k| (x.get(r * inf + k) * w.get(o * inf + k)).abs())
                    .sum::<f64>()
                    + b.get(o).abs();
                let bound = gamma * mag + dt.unit_roundoff() * w64.abs();
                let err = (got.get(i) - w64).abs();
                assert!(
                    err <= bound,
                    "{dt} rows={rows} elem {i}: err {err:e} > {bound:e}"
                );
            }
            assert_eq!(got.dtype(), dt);
        }
        // And the reference backend's own linear agrees with the f64 sum.
        let r = Reference.linear(&x, rows, &w, Some(&b), inf, outf).unwrap();
        assert_eq!(r.len(), rows * outf);
    }
}

#[test]
fn multi_head_attention_on_the_cpu_is_its_own_composition() {
    let mut rng = Rng::new(2);
    let cfg = MhaConfig::new(32, 4, 2);
    let hd = 8;
    let mk = |rng: &mut Rng, n: usize| HostData::from_f64(DType::F32, &rand(rng, n));
    let (wq, wk, wv, wo) = (
        mk(&mut rng, 32 * 32),
        mk(&mut rng, 16 * 32),
        mk(&mut rng, 16 * 32),
        mk(&mut rng, 32 * 32),
    );
    let biases = [
        mk(&mut rng, 32),
        mk(&mut rng, 16),
        mk(&mut rng, 16),
        mk(&mut rng, 32),
    ];
    let cpu = Cpu::with_threads(2).unwrap();
    let layer = MultiHeadAttention::new(
        &cpu,
        cfg,
        MhaWeights {
            wq: wq.clone(),
            wk: wk.clone(),
            wv: wv.clone(),
            wo: wo.clone(),
            biases: Some(biases.clone()),
        },
    )
    .unwrap();
    let (b, s) = (2, 37);
    let x = mk(&mut rng, b * s * 32);
    let opts = AttnOptions::default().causal();
    let got = layer.forward(&x, b, s, None, &opts).unwrap();
    let q = cpu
        .linear(&x, b * s, &wq, Some(&biases[0]), 32, 32)
        .unwrap();
    let k = cpu
        .linear(&x, b * s, &wk, Some(&biases[1]), 32, 16)
        .unwrap();
    let v = cpu
        .linear(&x, b * s, &wv, Some(&biases[2]), 32, 16)
        .unwrap();
    let p = Problem::new(Shape::new(b, 4, 2, s, s, hd), DType::F32).with_options(opts.clone());
    let o = cpu.forward(&p, Inputs::new(&q, &k, &v)).unwrap();
    let want = cpu
        .linear(&o.out, b * s, &wo, Some(&biases[3]), 32, 32)
        .unwrap();
    assert_eq!(got, want);

    // With maps: the same output, and the maps of the same call (the
    // backend's own, which its conformance suite checks).
    for request in [
        MapRequest::all(),
        MapRequest::all().heads([3, 1]).averaged(),
    ] {
        let (out, maps) = layer
            .forward_with_maps(&x, b, s, None, &opts, &request)
            .unwrap();
        assert_eq!(out, want);
        let mut pl = p.clone();
        pl.options.return_lse = true;
        let lse = cpu.forward(&pl, Inputs::new(&q, &k, &v)).unwrap().lse;
        let direct = cpu
            .maps(&p, Inputs::new(&q, &k, &v), lse.as_ref(), &request)
            .unwrap();
        assert_eq!(maps.layout, direct.layout);
        assert_eq!(maps.probs, direct.probs);
        // Causal rows sum to 1.
        let [_, _, nr, kl] = maps.layout.dims();
        let pr = maps.probs.to_f64_vec();
        for r in 0..maps.probs.len() / kl {
            let sum: f64 = pr[r * kl..(r + 1) * kl].iter().sum();
            assert!((sum - 1.0).abs() < 1e-5, "row {} sums to {sum}", r % nr);
        }
    }
    let too_big = MapRequest::all().with_budget(100);
    let e = layer
        .forward_with_maps(&x, b, s, None, &opts, &too_big)
        .unwrap_err();
    assert!(matches!(e, attn_spec::AttnError::OverBudget { .. }), "{e}");
}
