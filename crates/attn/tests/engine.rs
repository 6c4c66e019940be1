//! The facade's run-time engine passes the conformance suite whichever
//! backend it picked, and says which one it is.

use attn::{
    attend, AttnError, AttnOptions, Backend, DType, Engine, EngineKind, HostData, Inputs, Problem,
    Reference, Shape,
};

#[test]
fn best_engine_passes_the_suite() {
    let engine = Engine::best();
    // The fastest compiled kind that starts here: the GPU only when one
    // answers.
    let first = EngineKind::compiled()
        .into_iter()
        .find(|&k| Engine::of(k).is_ok())
        .expect("the reference always starts");
    assert_eq!(
        engine.kind(),
        first,
        "best() is the fastest kind that starts"
    );
    if cfg!(feature = "cpu") && engine.kind() != EngineKind::Cuda {
        assert_eq!(engine.kind(), EngineKind::Cpu);
    }
    let report = attn_conformance::run_suite(&engine, 128).unwrap();
    attn_conformance::errors::layer(&engine).unwrap();
    assert_eq!(report.passed + report.skipped, 128);
    assert_eq!(report.skipped, 0);
}

#[test]
fn best_engine_passes_the_backward_suite() {
    let report = attn_conformance::run_backward_suite(&Engine::best(), 64).unwrap();
    assert_eq!((report.passed, report.skipped), (64, 0));
}

#[test]
fn best_engine_passes_the_maps_suite() {
    let report = attn_conformance::run_maps_suite(&Engine::best(), 64).unwrap();
    assert_eq!((report.passed, report.skipped), (64, 0));
}

/// Every kind compiled in can be chosen, except a GPU the machine does
/// not have, which is an error value naming why.
#[test]
fn every_compiled_engine_can_be_chosen() {
    for kind in EngineKind::compiled() {
        match Engine::of(kind) {
            Ok(e) => assert_eq!(e.kind(), kind),
            Err(e @ (AttnError::NoDevice { .. } | AttnError::DriverMissing { .. }))
                if kind == EngineKind::Cuda =>
            {
                eprintln!("no GPU here: {e}")
            }
            Err(e) => panic!("{kind:?}: {e}"),
        }
    }
    assert_eq!(
        EngineKind::compiled().contains(&EngineKind::Cuda),
        cfg!(feature = "cuda")
    );
}

/// `pick` names the backend it chose, and why it passed over a GPU it
/// could not use.
#[test]
fn pick_says_which_backend_and_why() {
    let (e, why) = Engine::pick();
    assert_eq!(e.kind(), Engine::best().kind());
    assert!(why.starts_with(&e.describe()), "{why}");
    if cfg!(feature = "cuda") && e.kind() != EngineKind::Cuda {
        assert!(why.contains("passed over cuda"), "{why}");
    }
    if e.kind() == EngineKind::Cpu {
        assert!(why.starts_with("cpu ("), "{why}");
    }
}

/// `attend` computes what the engine computes, bit for bit, reading the
/// caller's slices; f64 runs on the reference.
#[test]
fn attend_matches_the_engine() {
    let shape = Shape::new(2, 4, 2, 9, 13, 16);
    let n = |s: usize, h: usize| 2 * s * h * 16;
    let data = |len: usize, seed: u32| -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 500.0
                    - 1.0
            })
            .collect()
    };
    let (q, k, v) = (data(n(9, 4), 1), data(n(13, 2), 2), data(n(13, 2), 3));
    let opts = AttnOptions::default().causal();
    let got = attend(shape, &q, &k, &v, &opts).unwrap();
    let p = Problem::new(shape, DType::F32).with_options(opts.clone());
    let (hq, hk, hv) = (
        HostData::F32(q.clone()),
        HostData::F32(k.clone()),
        HostData::F32(v.clone()),
    );
    let want = Engine::best()
        .forward(&p, Inputs::new(&hq, &hk, &hv))
        .unwrap();
    assert_eq!(HostData::F32(got), want.out);
    let q64: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
    let k64: Vec<f64> = k.iter().map(|&x| f64::from(x)).collect();
    let v64: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
    let got64 = attend(shape, &q64, &k64, &v64, &opts).unwrap();
    let p64 = Problem::new(shape, DType::F64).with_options(opts);
    let want64 = Reference
        .forward(
            &p64,
            Inputs::new(
                &HostData::F64(q64.clone()),
                &HostData::F64(k64.clone()),
                &HostData::F64(v64.clone()),
            ),
        )
        .unwrap();
    assert_eq!(HostData::F64(got64), want64.out);
}
