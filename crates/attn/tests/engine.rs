//! The facade's run-time engine passes the conformance suite whichever
//! backend it picked, and says which one it is.

use attn::{Engine, EngineKind};

#[test]
fn best_engine_passes_the_suite() {
    let engine = Engine::best();
    let kinds = EngineKind::compiled();
    assert_eq!(
        engine.kind(),
        kinds[0],
        "best() is the fastest compiled kind"
    );
    if cfg!(feature = "cpu") {
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

#[test]
fn every_compiled_engine_can_be_chosen() {
    for kind in EngineKind::compiled() {
        assert_eq!(Engine::of(kind).unwrap().kind(), kind);
    }
}
