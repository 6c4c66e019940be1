//! Both candle engines through the conformance suite (every option, f32,
//! f16, bf16), the hand-computed cases and bad input; the one-call API on
//! strided candle tensors against the reference; and proof that the custom
//! op reads a contiguous tensor in place.

use attn_candle::{attention, attention_with_lse, op::last_q_ptr, CandleBackend};
use attn_conformance::{case_params, check_case, errors, hand, Case, CaseParams, Outcome};
use attn_spec::{AttnOptions, Shape};
use candle_core::{Device, Tensor};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fused_engine_passes_the_suite(params in case_params()) {
        let case = Case::build(params);
        prop_assert_eq!(check_case(&CandleBackend::fused_cpu(), &case), Ok(Outcome::Passed));
    }

    #[test]
    fn plain_engine_passes_the_suite(params in case_params()) {
        let case = Case::build(params);
        // The plain engine refuses view offsets it cannot reshape away only
        // for the output; every generated layout is BSHD or BHSD.
        let r = check_case(&CandleBackend::plain_cpu(), &case);
        prop_assert_eq!(r, Ok(Outcome::Passed));
    }
}

#[test]
fn hand_computed_cases_on_both_engines() {
    hand::all(&CandleBackend::fused_cpu()).unwrap();
    hand::all(&CandleBackend::plain_cpu()).unwrap();
}

#[test]
fn bad_input_gives_typed_errors_on_both_engines() {
    errors::all(&CandleBackend::fused_cpu()).unwrap();
    errors::all(&CandleBackend::plain_cpu()).unwrap();
}

fn tensor(case_data: &attn_spec::HostData, dims: (usize, usize, usize, usize)) -> Tensor {
    let v = match case_data {
        attn_spec::HostData::F32(v) => v.clone(),
        _ => unreachable!("f32 cases"),
    };
    Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
}

/// The one-call API on `[b, s, h, d]` tensors, contiguous and transposed
/// (a strided view candle passes to the op without copying), agrees with
/// attn-cpu on the same data bit for bit, and returns the log-sum-exp.
#[test]
fn one_call_api_matches_attn_cpu_on_strided_tensors() {
    use attn_spec::Backend;
    let shape = Shape::new(2, 4, 2, 37, 53, 16);
    let mut params = CaseParams::plain(shape);
    params.options = AttnOptions::default().causal().with_lse();
    params.seed = 4;
    let case = Case::build(params);
    let q = tensor(&case.q, (2, 37, 4, 16));
    let k = tensor(&case.k, (2, 53, 2, 16));
    let v = tensor(&case.v, (2, 53, 2, 16));
    let cpu = attn_cpu::Cpu::new();
    let want = cpu.forward(&case.problem, case.inputs()).unwrap();
    let want_out = match want.out {
        attn_spec::HostData::F32(v) => v,
        _ => unreachable!(),
    };
    let (o, lse) = attention_with_lse(&q, &k, &v, &case.problem.options).unwrap();
    assert_eq!(o.dims(), &[2, 37, 4, 16]);
    assert_eq!(o.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want_out);
    let want_lse = match want.lse.unwrap() {
        attn_spec::HostData::F32(v) => v,
        _ => unreachable!(),
    };
    assert_eq!(
        lse.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want_lse
    );
    // Q stored [b, h, s, d] and viewed as [b, s, h, d]: strided input.
    let qt = q
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .transpose(1, 2)
        .unwrap();
    assert!(!qt.is_contiguous());
    let o2 = attention(&qt, &k, &v, &case.problem.options).unwrap();
    assert_eq!(
        o2.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want_out
    );
}

#[test]
fn the_custom_op_reads_a_contiguous_tensor_in_place() {
    let q = Tensor::ones((1, 8, 2, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
    let k = Tensor::ones((1, 8, 2, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
    let v = Tensor::ones((1, 8, 2, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
    attention(&q, &k, &v, &AttnOptions::default()).unwrap();
    let (storage, layout) = q.storage_and_layout();
    let ptr = match &*storage {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)) => {
            data[layout.start_offset()..].as_ptr() as usize
        }
        _ => unreachable!("a CPU f32 tensor"),
    };
    assert_eq!(last_q_ptr(), ptr, "the kernel read a copy of q");
}

#[test]
fn wrong_inputs_are_candle_errors_with_attn_messages() {
    let q = Tensor::ones((1, 8, 3, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
    let k = Tensor::ones((1, 8, 2, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
    let e = attention(&q, &k, &k, &AttnOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of key/value heads"), "{e}");
    let kh = k.to_dtype(candle_core::DType::F16).unwrap();
    let q2 = Tensor::ones((1, 8, 2, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
    let e = attention(&q2, &kh, &kh, &AttnOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("must share one of f32, f16, bf16"), "{e}");
}
