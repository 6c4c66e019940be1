//! # attn-conformance: one differential suite for every backend
//!
//! Generic over [`attn_spec::Backend`]: a backend's test file is a few
//! lines that call [`check_case`] from a proptest over [`case_params`], plus
//! [`hand::all`] and [`errors::all`]. Every backend therefore meets the same
//! cases, the same oracle (the f64 reference) and the same derived error
//! bound ([`tolerance`]).
//!
//! Backends with attention maps add [`maps::check_maps`] over the same
//! cases and [`maps::all`].
//!
//! [`run_suite`] runs the whole suite without the test harness, for
//! `cargo xtask verify` on a user's machine.

pub mod backward;
pub mod case;
pub mod check;
pub mod contract;
pub mod errors;
pub mod fuzz;
pub mod hand;
pub mod maps;
pub mod rng;
pub mod strategy;
pub mod tolerance;

pub use case::{Case, CaseParams};
pub use check::{check_case, check_output, Outcome};
pub use strategy::case_params;

use attn_spec::Backend;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::cell::Cell;

/// `n` generated cases scaled by `$ATTN_CASES_SCALE` (a positive number,
/// default 1), at least 1: `cargo xtask soak` raises it for long runs,
/// `cargo xtask memcheck` lowers it under valgrind. The test files' proptest
/// configurations take their case counts through it.
pub fn cases(n: u32) -> u32 {
    let scale = std::env::var("ATTN_CASES_SCALE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(1.0);
    ((f64::from(n) * scale).round() as u32).max(1)
}

/// What [`run_suite`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuiteReport {
    /// Generated cases that passed.
    pub passed: u32,
    /// Generated cases the backend refused as unsupported.
    pub skipped: u32,
}

/// Runs `check` on `cases` generated cases, counting what passed and what
/// the backend refused as unsupported; the first failure (minimised by
/// proptest) comes back as an error message. The one runner of
/// [`run_suite`], [`run_backward_suite`] and [`run_maps_suite`].
pub fn run_generated(
    cases: u32,
    check: impl Fn(CaseParams) -> Result<Outcome, String>,
) -> Result<SuiteReport, String> {
    let passed = Cell::new(0);
    let skipped = Cell::new(0);
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    runner
        .run(&case_params(), |params| {
            match check(params) {
                Ok(Outcome::Passed) => passed.set(passed.get() + 1),
                Ok(Outcome::Skipped(_)) => skipped.set(skipped.get() + 1),
                Err(e) => return Err(TestCaseError::fail(e)),
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    Ok(SuiteReport {
        passed: passed.get(),
        skipped: skipped.get(),
    })
}

/// Runs the hand-computed cases, the bad-input checks and `cases`
/// generated cases on `backend`. Returns the first failure (minimised by
/// proptest) as an error message.
pub fn run_suite<B: Backend>(backend: &B, cases: u32) -> Result<SuiteReport, String> {
    hand::all(backend)?;
    errors::all(backend)?;
    run_generated(cases, |params| check_case(backend, &Case::build(params)))
}

/// [`run_suite`]'s backward counterpart: the backward hand cases, its
/// bad-input checks and `cases` generated cases through
/// [`backward::check_backward`].
pub fn run_backward_suite<B: attn_spec::Backward>(
    backend: &B,
    cases: u32,
) -> Result<SuiteReport, String> {
    backward::all(backend)?;
    run_generated(cases, |params| {
        backward::check_backward(backend, &backward::BackCase::build(params))
    })
}

/// [`run_suite`]'s maps counterpart: the maps hand cases and bad input,
/// then `cases` generated cases through [`maps::check_maps`] with
/// [`maps::request_for`].
pub fn run_maps_suite<B: attn_spec::AttentionMaps>(
    backend: &B,
    cases: u32,
) -> Result<SuiteReport, String> {
    maps::all(backend)?;
    run_generated(cases, |params| {
        let case = Case::build(params);
        maps::check_maps(backend, &case, &maps::request_for(&case))
    })
}
