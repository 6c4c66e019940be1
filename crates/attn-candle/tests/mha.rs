//! The candle `MultiHeadAttention`: the same layer as attn-spec's over the
//! candle backend, incremental decoding through the key/value cache checked
//! step by step against the f64 reference, and bad weights or a full cache
//! refused with a message.

use attn_candle::{CandleBackend, KvCache, MhaConfig, MhaWeights, MultiHeadAttention};
use attn_conformance::{check_output, rng::Rng, Case, CaseParams};
use attn_spec::{AttnOptions, DType, MapRequest, Problem, Shape};
use candle_core::{DType as CDType, Device, Tensor};

fn rand(rng: &mut Rng, dims: &[usize]) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.uniform(-0.5, 0.5) as f32).collect();
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// Model dim 48, 6 query heads over 2 key/value heads of dim 8.
fn layer(rng: &mut Rng, dtype: CDType) -> (MhaConfig, MhaWeights<Tensor>) {
    let c = MhaConfig::new(48, 6, 2);
    let mut r = |d: &[usize]| rand(rng, d).to_dtype(dtype).unwrap();
    let w = MhaWeights {
        wq: r(&[48, 48]),
        wk: r(&[16, 48]),
        wv: r(&[16, 48]),
        wo: r(&[48, 48]),
        biases: Some([r(&[48]), r(&[16]), r(&[16]), r(&[48])]),
    };
    (c, w)
}

fn clone_weights(w: &MhaWeights<Tensor>) -> MhaWeights<Tensor> {
    MhaWeights {
        wq: w.wq.clone(),
        wk: w.wk.clone(),
        wv: w.wv.clone(),
        wo: w.wo.clone(),
        biases: w.biases.clone(),
    }
}

/// attn-spec's layer, wired independently, over the candle backend's
/// flat tensors computes the same bits as the candle layer (both project
/// with candle's matmul and attend with the fused op).
#[test]
fn the_candle_layer_is_attn_specs_layer() {
    let mut rng = Rng::new(11);
    let (c, w) = layer(&mut rng, CDType::F32);
    let (b, s) = (2, 19);
    let x = rand(&mut rng, &[b, s, 48]);
    let opts = AttnOptions::default().causal();
    let ours = MultiHeadAttention::new(c, clone_weights(&w)).unwrap();
    let got = ours.forward(&x, None, &opts).unwrap();
    assert_eq!(got.dims(), &[b, s, 48]);
    let flat = |t: &Tensor| t.flatten_all().unwrap();
    let spec_w = MhaWeights {
        wq: flat(&w.wq),
        wk: flat(&w.wk),
        wv: flat(&w.wv),
        wo: flat(&w.wo),
        biases: w.biases.as_ref().map(|bs| bs.clone().map(|t| flat(&t))),
    };
    let spec = attn_spec::MultiHeadAttention::new(CandleBackend::fused_cpu(), c, spec_w).unwrap();
    let want = spec.forward(&flat(&x), b, s, None, &opts).unwrap();
    assert_eq!(
        got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want.to_vec1::<f32>().unwrap()
    );
    // Cross-attention to a longer memory.
    let mem = rand(&mut rng, &[b, 23, 48]);
    let got = ours
        .forward(&x, Some(&mem), &AttnOptions::default())
        .unwrap();
    let want = spec
        .forward(
            &flat(&x),
            b,
            s,
            Some((&flat(&mem), 23)),
            &AttnOptions::default(),
        )
        .unwrap();
    assert_eq!(
        got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want.to_vec1::<f32>().unwrap()
    );
}

/// `forward_with_maps`: the same output as `forward`, and the same maps as
/// attn-spec's layer over the candle backend (both from the call's own
/// log-sum-exp), shaped `[batches, heads, rows, keys]`, and checked
/// against the f64 reference on the layer's own projections.
#[test]
fn the_candle_layer_returns_the_maps_of_its_call() {
    let mut rng = Rng::new(13);
    let (c, w) = layer(&mut rng, CDType::F32);
    let (b, s) = (2, 21);
    let x = rand(&mut rng, &[b, s, 48]);
    let opts = AttnOptions::default().causal();
    let ours = MultiHeadAttention::new(c, clone_weights(&w)).unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap();
    let spec_w = MhaWeights {
        wq: flat(&w.wq),
        wk: flat(&w.wk),
        wv: flat(&w.wv),
        wo: flat(&w.wo),
        biases: w.biases.as_ref().map(|bs| bs.clone().map(|t| flat(&t))),
    };
    let spec = attn_spec::MultiHeadAttention::new(CandleBackend::fused_cpu(), c, spec_w).unwrap();
    for request in [
        MapRequest::all(),
        MapRequest::all().batches([1]).heads([5, 0]).rows(3..17),
        MapRequest::all().averaged(),
    ] {
        let (out, maps) = ours.forward_with_maps(&x, None, &opts, &request).unwrap();
        let plain = ours.forward(&x, None, &opts).unwrap();
        assert_eq!(
            flat(&out).to_vec1::<f32>().unwrap(),
            flat(&plain).to_vec1::<f32>().unwrap()
        );
        let (_, want) = spec
            .forward_with_maps(&flat(&x), b, s, None, &opts, &request)
            .unwrap();
        assert_eq!(maps.dims(), &want.layout.dims());
        let got = flat(&maps).to_vec1::<f32>().unwrap();
        assert_eq!(got, want.probs.to_vec1::<f32>().unwrap());
        // Against the reference, on the layer's projections.
        let (k, v) = ours.project_kv(&x).unwrap();
        let q = ours.project_q(&x).unwrap();
        let mut case = Case::build(CaseParams::plain(Shape::new(b, 6, 2, s, s, 8)));
        case.problem.options = opts.clone();
        (case.q, case.k, case.v) = (host(&q), host(&k), host(&v));
        let (_, lse) = attn_candle::attention_with_lse(&q, &k, &v, &opts).unwrap();
        let r = attn_conformance::maps::check_against_reference(
            &case,
            &request,
            &attn_spec::HostData::F32(got),
            &host(&lse),
        );
        assert_eq!(r, Ok(()), "{request:?}");
    }
    // An over-budget request is refused before the layer attends.
    let e = ours
        .forward_with_maps(&x, None, &opts, &MapRequest::all().with_budget(1000))
        .unwrap_err();
    assert!(e.to_string().contains("over the budget"), "{e}");
}

fn host(t: &Tensor) -> attn_spec::HostData {
    attn_candle::op::host_data(t).unwrap()
}

/// Decoding a sequence in chunks (a prompt, then single tokens, then a
/// chunk) through the cache: at every step the attention over the cache
/// must be the causal, bottom-right aligned attention of the new queries
/// over every position so far, within the conformance bound of the f64
/// reference; and the layer's output is that attention projected.
#[test]
fn cached_decoding_attends_to_every_position_so_far() {
    for (dtype, adt) in [
        (CDType::F32, DType::F32),
        (CDType::BF16, DType::Bf16),
        (CDType::F16, DType::F16),
    ] {
        let mut rng = Rng::new(12);
        let (c, w) = layer(&mut rng, dtype);
        let mha = MultiHeadAttention::new(c, w).unwrap();
        let b = 2;
        let chunks = [13, 1, 1, 7, 1, 6];
        let total: usize = chunks.iter().sum();
        let x = rand(&mut rng, &[b, total, 48]).to_dtype(dtype).unwrap();
        let mut cache = mha.new_cache(b, 32, dtype, &Device::Cpu).unwrap();
        let opts = AttnOptions::default().causal();
        let mut start = 0;
        for n in chunks {
            let xs = x.narrow(1, start, n).unwrap();
            let o = mha.attend_cached(&xs, &mut cache, &opts).unwrap();
            let len = start + n;
            assert_eq!(cache.len(), len);
            // The reference problem: the chunk's queries against the
            // projected keys and values of every position so far.
            let q = mha.project_q(&xs).unwrap();
            let (k, v) = mha.project_kv(&x.narrow(1, 0, len).unwrap()).unwrap();
            let shape = Shape::new(b, 6, 2, n, len, 8);
            let problem = Problem::new(shape, adt).with_options(opts.clone());
            let case = Case {
                params: CaseParams::plain(shape),
                problem,
                q: host(&q),
                k: host(&k),
                v: host(&v),
                bias: None,
                mask: None,
            };
            assert_eq!(o.dtype(), dtype);
            check_output(&case, &host(&o), None)
                .unwrap_or_else(|e| panic!("{dtype:?} step ending at {len}: {e}"));
            start = len;
        }
        // forward_cached is attend_cached then the output projection.
        cache.reset();
        let mut cache2 = mha.new_cache(b, 32, dtype, &Device::Cpu).unwrap();
        let xs = x.narrow(1, 0, 5).unwrap();
        let got = mha.forward_cached(&xs, &mut cache, &opts).unwrap();
        let o = mha.attend_cached(&xs, &mut cache2, &opts).unwrap();
        let want = mha.project_out(&o).unwrap();
        assert_eq!(host(&got), host(&want));
    }
}

#[test]
fn bad_weights_and_a_full_cache_are_refused() {
    let mut rng = Rng::new(13);
    let (c, mut w) = layer(&mut rng, CDType::F32);
    w.wk = rand(&mut rng, &[48, 48]);
    let e = MultiHeadAttention::new(c, w).unwrap_err().to_string();
    assert!(e.contains("wk must have shape [16, 48]"), "{e}");
    let (_, mut w) = layer(&mut rng, CDType::F32);
    w.wo = w.wo.to_dtype(CDType::F16).unwrap();
    let e = MultiHeadAttention::new(c, w).unwrap_err().to_string();
    assert!(e.contains("wo is F16 but wq is F32"), "{e}");

    let mut cache = KvCache::new(1, 4, 2, (8, 8), CDType::F32, &Device::Cpu).unwrap();
    let k = rand(&mut rng, &[1, 3, 2, 8]);
    cache.append(&k, &k).unwrap();
    let e = cache.append(&k, &k).unwrap_err().to_string();
    assert!(e.contains("holds 3 of 4 positions"), "{e}");
    assert_eq!(cache.len(), 3, "a refused append changes nothing");
    let (kk, _) = cache
        .append(&k.narrow(1, 0, 1).unwrap(), &k.narrow(1, 0, 1).unwrap())
        .unwrap();
    assert_eq!(kk.dims(), &[1, 4, 2, 8]);
}
