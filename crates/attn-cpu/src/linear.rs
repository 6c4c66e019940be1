//! Projections for multi-head attention, `y = x W^T + b`, through the
//! `gemm` crate (the GEMM candle uses: packed, cache-blocked, SIMD, rayon)
//! rather than a hand-written one. f16/bf16 operands are widened to f32,
//! multiplied with f32 accumulation, and rounded back once.

use attn_spec::HostData;

/// `x`: `[rows, in_f]`, `w`: `[out_f, in_f]`, `bias`: `[out_f]`; returns
/// `[rows, out_f]` in `x`'s type. Operands are validated by the caller.
pub fn linear(
    x: &HostData,
    rows: usize,
    w: &HostData,
    bias: Option<&HostData>,
    in_f: usize,
    out_f: usize,
    threads: usize,
) -> HostData {
    let widen = |d: &HostData| -> Vec<f32> {
        match d {
            HostData::F32(v) => v.clone(),
            other => other.to_f64_vec().into_iter().map(|x| x as f32).collect(),
        }
    };
    let (xf, wf) = (widen(x), widen(w));
    let mut y = vec![0.0f32; rows * out_f];
    if let Some(b) = bias {
        let bf = widen(b);
        for row in y.chunks_mut(out_f) {
            row.copy_from_slice(&bf);
        }
    }
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // y[rows x out_f] = alpha*y + beta * x[rows x in_f] * W^T[in_f x out_f].
    // Strides are (column stride, row stride) in elements: x is row-major
    // (cs 1, rs in_f); W^T is W read with cs in_f, rs 1.
    // SAFETY: every matrix pointer with its dims and strides stays inside
    // its Vec: x is rows*in_f, w is out_f*in_f, y is rows*out_f, all
    // validated lengths; y does not alias x or w.
    unsafe {
        gemm::gemm(
            rows,
            out_f,
            in_f,
            y.as_mut_ptr(),
            1,
            out_f as isize,
            bias.is_some(),
            xf.as_ptr(),
            1,
            in_f as isize,
            wf.as_ptr(),
            in_f as isize,
            1,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        )
    };
    let y64: Vec<f64> = y.iter().map(|&v| f64::from(v)).collect();
    match x {
        HostData::F32(_) => HostData::F32(y),
        other => HostData::from_f64(other.dtype(), &y64),
    }
}
