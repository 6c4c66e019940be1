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
    #![proptest_config(ProptestConfig { cases: attn_conformance::cases(256), failure_persistence: None, ..ProptestConfig::default() })]

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
fn split_kv_decode_cases_on_both_engines() {
    hand::split_kv(&CandleBackend::fused_cpu()).unwrap();
    hand::split_kv(&CandleBackend::plain_cpu()).unwrap();
}

#[test]
fn bad_input_gives_typed_errors_on_both_engines() {
    errors::all(&CandleBackend::fused_cpu()).unwrap();
    errors::all(&CandleBackend::plain_cpu()).unwrap();
    errors::layer(&CandleBackend::fused_cpu()).unwrap();
    errors::layer(&CandleBackend::plain_cpu()).unwrap();
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

fn candle_tensor(d: &attn_spec::HostData, dims: [usize; 4]) -> Tensor {
    use attn_spec::HostData as H;
    let dev = &Device::Cpu;
    match d {
        H::F32(v) => Tensor::from_vec(v.clone(), &dims, dev),
        H::F16(v) => Tensor::from_vec(v.clone(), &dims, dev),
        H::Bf16(v) => Tensor::from_vec(v.clone(), &dims, dev),
        H::F64(v) => Tensor::from_vec(v.clone(), &dims, dev),
        H::Bool(v) => Tensor::from_vec(v.iter().map(|&b| u8::from(b)).collect(), &dims, dev),
    }
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_conformance::cases(64), failure_persistence: None, ..ProptestConfig::default() })]

    /// The one-call API with bias and boolean mask tensors (broadcast or
    /// not, every option the suite draws) against the f64 reference, on
    /// contiguous BSHD cases (the layout the one-call API takes).
    #[test]
    fn one_call_api_with_bias_and_mask_passes_the_suite(params in case_params()) {
        let mut params = params;
        params.bhsd = false;
        params.offset = 0;
        let case = Case::build(params);
        let s = case.problem.shape;
        let q = candle_tensor(&case.q, [s.batch, s.q_len, s.q_heads, s.head_dim_qk]);
        let k = candle_tensor(&case.k, [s.batch, s.kv_len, s.kv_heads, s.head_dim_qk]);
        let v = candle_tensor(&case.v, [s.batch, s.kv_len, s.kv_heads, s.head_dim_v]);
        let bias = case.bias.as_ref().map(|b| {
            let view = case.problem.bias.as_ref().unwrap().view;
            prop_assert_eq!(view, attn_spec::View::contiguous(view.dims));
            Ok(candle_tensor(b, view.dims))
        }).transpose()?;
        let mask = case.mask.as_ref().map(|m| {
            let view = case.problem.mask.unwrap();
            prop_assert_eq!(view, attn_spec::View::contiguous(view.dims));
            Ok(candle_tensor(m, view.dims))
        }).transpose()?;
        let extras = attn_candle::Extras { bias: bias.as_ref(), mask: mask.as_ref(), sinks: None };
        let (o, lse) = attn_candle::attention_ext(&q, &k, &v, extras, &case.problem.options).unwrap();
        prop_assert_eq!(o.dims(), &[s.batch, s.q_len, s.q_heads, s.head_dim_v]);
        prop_assert_eq!(lse.is_some(), case.problem.options.return_lse);
        let out = attn_candle::op::host_data(&o).unwrap();
        let lse = lse.map(|l| attn_candle::op::host_data(&l).unwrap());
        let r = attn_conformance::check_output(&case, &out, lse.as_ref());
        prop_assert_eq!(r, Ok(()));
    }
}

#[test]
fn a_mask_that_is_not_u8_is_refused_by_name() {
    let q = Tensor::ones((1, 4, 2, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
    let m = Tensor::ones((1, 1, 4, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    let extras = attn_candle::Extras {
        bias: None,
        mask: Some(&m),
        sinks: None,
    };
    let e = attn_candle::attention_ext(&q, &q, &q, extras, &AttnOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("mask must be u8"), "{e}");
    let b = Tensor::ones((4, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    let extras = attn_candle::Extras {
        bias: Some(&b),
        mask: None,
        sinks: None,
    };
    let e = attn_candle::attention_ext(&q, &q, &q, extras, &AttnOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("bias must be rank 4"), "{e}");
    // A bias of the wrong size is named by attn's validation.
    let b = Tensor::ones((1, 1, 4, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
    let extras = attn_candle::Extras {
        bias: Some(&b),
        mask: None,
        sinks: None,
    };
    let e = attn_candle::attention_ext(&q, &q, &q, extras, &AttnOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("attn:") && e.contains("bias"), "{e}");
}
