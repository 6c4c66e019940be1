//! `Cuda::forward_slices` (typed device slices owned by someone else, as
//! attn-candle hands over candle's buffers) runs the same launches as
//! `forward_into`: generated cases give bit-identical outputs and
//! log-sum-exps on both paths, and short or mistyped slices give typed
//! errors. Without a GPU the tests print "skipping" and pass, unless
//! `ATTN_REQUIRE_GPU=1`.

use attn_conformance::{case_params, Case};
use attn_cuda::Cuda;
use attn_spec::{AttnError, Backend, DType, HostData, Inputs, Problem};
use cudarc::driver::CudaSlice;
use proptest::prelude::*;
use std::sync::OnceLock;

fn gpu() -> Option<&'static Cuda> {
    static G: OnceLock<Option<Cuda>> = OnceLock::new();
    G.get_or_init(|| match Cuda::first() {
        Ok(c) => Some(c),
        Err(e @ (AttnError::NoDevice { .. } | AttnError::DriverMissing { .. })) => {
            if std::env::var("ATTN_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("ATTN_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("skipping: no GPU ({e})");
            None
        }
        Err(e) => panic!("a GPU is present but attn-cuda failed to start: {e}"),
    })
    .as_ref()
}

/// Both paths on one case (f32 data only: the generated case is converted
/// to f32 so `CudaSlice<f32>` holds it), outputs and log-sum-exps as f32.
fn both(cuda: &Cuda, case: &Case) -> Result<(Vec<f32>, Vec<f32>), TestCaseError> {
    let mut p: Problem = case.problem.clone();
    p.dtype = DType::F32;
    p.options.return_lse = true;
    let f32s = |h: &HostData| {
        h.to_f64_vec()
            .into_iter()
            .map(|x| x as f32)
            .collect::<Vec<_>>()
    };
    let (q, k, v) = (f32s(&case.q), f32s(&case.k), f32s(&case.v));
    // One element at least: a zero-byte device allocation is an error on
    // some drivers (attn-cuda's own `upload` pads the same way).
    let dev = |x: &[f32]| {
        let mut x = x.to_vec();
        if x.is_empty() {
            x.push(0.0);
        }
        cuda.stream().clone_htod(&x).unwrap()
    };
    let (qs, ks, vs): (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<f32>) =
        (dev(&q), dev(&k), dev(&v));
    let bias = case.bias.as_ref().map(|b| cuda.upload(b).unwrap());
    let mask = case.mask.as_ref().map(|m| cuda.upload(m).unwrap());
    let n_out = p.out.extent().unwrap();
    let n_lse = p.lse_view().extent().unwrap();

    let mut out_s = cuda.stream().alloc_zeros::<f32>(n_out.max(1)).unwrap();
    let mut lse_s = cuda.zeros(DType::F32, n_lse).unwrap();
    let r = cuda.forward_slices(
        &p,
        (&qs, &ks, &vs),
        (bias.as_ref(), mask.as_ref()),
        &mut out_s,
        Some(&mut lse_s),
    );
    if let Err(AttnError::Unsupported { .. }) = r {
        return Err(TestCaseError::reject("unsupported on this GPU"));
    }
    r.unwrap();
    let out_slices = cuda.stream().clone_dtoh(&out_s).unwrap()[..n_out].to_vec();

    let bufs = (
        cuda.upload(&HostData::F32(q)).unwrap(),
        cuda.upload(&HostData::F32(k)).unwrap(),
        cuda.upload(&HostData::F32(v)).unwrap(),
    );
    let mut out_b = cuda.zeros(DType::F32, n_out).unwrap();
    let mut lse_b = cuda.zeros(DType::F32, n_lse).unwrap();
    let inputs = Inputs {
        q: &bufs.0,
        k: &bufs.1,
        v: &bufs.2,
        bias: bias.as_ref(),
        mask: mask.as_ref(),
    };
    cuda.forward_into(&p, inputs, &mut out_b, Some(&mut lse_b))
        .unwrap();
    let out_buffers = match cuda.download(&out_b).unwrap() {
        HostData::F32(v) => v,
        _ => unreachable!("an f32 buffer"),
    };
    prop_assert_eq!(
        out_slices.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        out_buffers.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    let l = |b: &attn_cuda::CudaBuffer| match cuda.download(b).unwrap() {
        HostData::F32(v) => v,
        _ => unreachable!("an f32 buffer"),
    };
    Ok((l(&lse_s), l(&lse_b)))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn slices_and_buffers_agree_bitwise(params in case_params()) {
        let Some(cuda) = gpu() else { return Ok(()) };
        let case = Case::build(params);
        let (a, b) = both(cuda, &case)?;
        prop_assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn short_or_mistyped_slices_are_typed_errors() {
    let Some(cuda) = gpu() else { return };
    let p = Problem::new(attn_spec::Shape::new(1, 2, 2, 3, 5, 8), DType::F32);
    let n = |v: &attn_spec::View| v.extent().unwrap();
    let z = |len: usize| cuda.stream().alloc_zeros::<f32>(len).unwrap();
    let (q, k, v) = (z(n(&p.q)), z(n(&p.k)), z(n(&p.v)));
    let short = z(n(&p.k) - 1);
    let mut out = z(n(&p.out));
    let e = cuda
        .forward_slices(&p, (&q, &short, &v), (None, None), &mut out, None)
        .unwrap_err();
    assert!(
        matches!(e, AttnError::BufferTooSmall { tensor: "k", .. }),
        "{e}"
    );
    let p16 = Problem {
        dtype: DType::F16,
        ..p.clone()
    };
    let e = cuda
        .forward_slices(&p16, (&q, &k, &v), (None, None), &mut out, None)
        .unwrap_err();
    assert!(matches!(e, AttnError::DType { tensor: "q", .. }), "{e}");
    let mut lse_p = p.clone();
    lse_p.options.return_lse = true;
    let e = cuda
        .forward_slices(&lse_p, (&q, &k, &v), (None, None), &mut out, None)
        .unwrap_err();
    assert!(matches!(e, AttnError::Missing { tensor: "lse", .. }), "{e}");
}
