//! The SIMD vector type and the few raw loads and stores the kernels need.
//!
//! `wide` picks instructions when it is compiled: with AVX-512 enabled (the
//! workspace builds with `-C target-cpu=native`) `f32x16` is one zmm
//! register; otherwise it is emulated with two f32x8 (AVX2) or four SSE
//! vectors, correct but 2-3x slower. [`compiled_level`] reports which.

pub use wide::f32x16 as V;

/// Loads 16 f32 from `p` (unaligned).
///
/// # Safety
/// `p..p+16` must be readable f32s.
#[inline(always)]
pub unsafe fn load(p: *const f32) -> V {
    // SAFETY: the caller guarantees 16 readable f32 at `p`; read_unaligned
    // has no alignment requirement.
    V::from(unsafe { (p as *const [f32; 16]).read_unaligned() })
}

/// Stores 16 f32 to `p` (unaligned).
///
/// # Safety
/// `p..p+16` must be writable f32s.
#[inline(always)]
pub unsafe fn store(p: *mut f32, v: V) {
    // SAFETY: the caller guarantees 16 writable f32 at `p`.
    unsafe { (p as *mut [f32; 16]).write_unaligned(v.to_array()) }
}

/// The SIMD instruction set `wide` was compiled for.
pub fn compiled_level() -> &'static str {
    if cfg!(target_feature = "avx512f") {
        "avx512f"
    } else if cfg!(all(target_feature = "avx2", target_feature = "fma")) {
        "avx2+fma"
    } else if cfg!(target_feature = "avx") {
        "avx"
    } else if cfg!(target_feature = "sse4.1") {
        "sse4.1"
    } else if cfg!(target_arch = "aarch64") {
        "neon"
    } else {
        "sse2/scalar"
    }
}

/// The best SIMD level this CPU offers, detected at run time.
pub fn detected_level() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            return "avx512f";
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return "avx2+fma";
        }
        if is_x86_feature_detected!("avx") {
            return "avx";
        }
        "sse2"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        compiled_level()
    }
}

/// A warning when this CPU supports wider SIMD than the build uses (the
/// build lacks `-C target-cpu=native` or a matching target feature).
pub fn simd_warning() -> Option<String> {
    let (c, d) = (compiled_level(), detected_level());
    (c != d).then(|| {
        format!(
            "attn-cpu was compiled for {c} but this CPU supports {d}: build with RUSTFLAGS=\"-C target-cpu=native\" for full speed"
        )
    })
}

/// Transposes a 16 x 16 block held in 16 vectors (row `i` in `m[i]`).
/// With AVX-512: 64 in-register shuffles (unpack, then 32- and 128-bit
/// lane shuffles); `wide`'s own `transpose` moves the 256 elements one by
/// one.
#[inline(always)]
pub fn transpose16(m: [V; 16]) -> [V; 16] {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    {
        // SAFETY: this branch is compiled only when the whole build enables
        // avx512f (`cfg` above), so every CPU the binary may run on has it.
        unsafe { transpose16_avx512(m) }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
    {
        V::transpose(m)
    }
}

/// The AVX-512 body of [`transpose16`].
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16_avx512(m: [V; 16]) -> [V; 16] {
    use std::arch::x86_64::*;
    let r: [__m512; 16] = m.map(Into::into);
    let mut t = r;
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let mut u = r;
    for g in 0..4 {
        let b = 4 * g;
        u[b] = _mm512_shuffle_ps::<0x44>(t[b], t[b + 2]);
        u[b + 1] = _mm512_shuffle_ps::<0xEE>(t[b], t[b + 2]);
        u[b + 2] = _mm512_shuffle_ps::<0x44>(t[b + 1], t[b + 3]);
        u[b + 3] = _mm512_shuffle_ps::<0xEE>(t[b + 1], t[b + 3]);
    }
    let mut w = r;
    for i in 0..4 {
        w[i] = _mm512_shuffle_f32x4::<0x88>(u[i], u[i + 4]);
        w[i + 4] = _mm512_shuffle_f32x4::<0xDD>(u[i], u[i + 4]);
        w[i + 8] = _mm512_shuffle_f32x4::<0x88>(u[i + 8], u[i + 12]);
        w[i + 12] = _mm512_shuffle_f32x4::<0xDD>(u[i + 8], u[i + 12]);
    }
    let mut o = r;
    for i in 0..8 {
        o[i] = _mm512_shuffle_f32x4::<0x88>(w[i], w[i + 8]);
        o[i + 8] = _mm512_shuffle_f32x4::<0xDD>(w[i], w[i + 8]);
    }
    o.map(V::from)
}

/// The sixteen horizontal sums of 16 vectors, in order: lane `i` of the
/// result is the sum of the lanes of `m[i]`. With AVX-512 a transpose-and-
/// add tree: 45 shuffles and adds for all sixteen, against about 16 x 8
/// for sixteen separate reductions.
#[inline(always)]
pub fn reduce16(m: &[V; 16]) -> V {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    {
        // SAFETY: compiled only when the whole build enables avx512f.
        unsafe { reduce16_avx512(m) }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
    {
        V::from(std::array::from_fn::<f32, 16, _>(|i| m[i].reduce_add()))
    }
}

/// The first two levels of [`reduce16`] and [`reduce_quads`]: `u[i]`
/// holds, per 128-bit lane, the in-lane sums of vectors `4i..4i+4`
/// (`(x0 + x2) + (x1 + x3)` of each lane's 4 floats): a 32-bit interleave
/// then a 64-bit shuffle, each followed by an add.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[target_feature(enable = "avx512f")]
unsafe fn in_lane_sums(m: &[V; 16]) -> [std::arch::x86_64::__m512; 4] {
    use std::arch::x86_64::*;
    let r: [__m512; 16] = m.map(Into::into);
    // t[i]: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3] of vectors 2i, 2i+1.
    let t: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * i], r[2 * i + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
    });
    std::array::from_fn(|i| {
        let (a, b) = (t[2 * i], t[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        )
    })
}

/// The AVX-512 body of [`reduce16`]. Each level adds pairs of vectors after
/// interleaving them, halving the vectors and doubling the keys each one
/// carries: 32-bit interleave (2 keys per 128-bit lane), 64-bit shuffle (4
/// keys per lane, sums within a lane complete), then two 128-bit lane
/// shuffles that bring each key's four partial sums together.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[target_feature(enable = "avx512f")]
unsafe fn reduce16_avx512(m: &[V; 16]) -> V {
    use std::arch::x86_64::*;
    // SAFETY: this function's caller guarantees AVX-512F.
    let u = unsafe { in_lane_sums(m) };
    // w[i]: keys 8i..8i+4 in lanes 0 and 1 (two partial sums each), keys
    // 8i+4..8i+8 in lanes 2 and 3.
    let w: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (u[2 * i], u[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    });
    V::from(_mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(w[0], w[1]),
        _mm512_shuffle_f32x4::<0xDD>(w[0], w[1]),
    ))
}

/// The row sums of 16 vectors that each hold 4 rows of 4 partial sums:
/// lane `i` of result `r` is `(m[i][4r] + m[i][4r + 2]) + (m[i][4r + 1] +
/// m[i][4r + 3])`. This is the reduction of `microkernel::decode::
/// scores_quad`, where vector `m[i]` carries key `i`'s dot products with
/// 4 query rows, one row per 128-bit quarter. With AVX-512 it takes 16
/// interleaves, 8 in-lane shuffles, 8 lane shuffles and 12 adds (44
/// operations) for all 64 sums (`reduce16` takes 45 for 16).
#[inline(always)]
pub fn reduce_quads(m: &[V; 16]) -> [V; 4] {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    {
        // SAFETY: compiled only when the whole build enables avx512f.
        unsafe { reduce_quads_avx512(m) }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
    {
        std::array::from_fn(|r| {
            V::from(std::array::from_fn::<f32, 16, _>(|i| {
                let x = m[i].as_array();
                (x[4 * r] + x[4 * r + 2]) + (x[4 * r + 1] + x[4 * r + 3])
            }))
        })
    }
}

/// The AVX-512 body of [`reduce_quads`]: the first two levels of
/// `reduce16` (each 128-bit lane then holds one row's sums of 4 keys),
/// then a 4 x 4 transpose of 128-bit lanes that gathers each row's 16 keys.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[target_feature(enable = "avx512f")]
unsafe fn reduce_quads_avx512(m: &[V; 16]) -> [V; 4] {
    use std::arch::x86_64::*;
    // u[i], lane r: row r's sums of keys 4i..4i+4.
    // SAFETY: this function's caller guarantees AVX-512F.
    let u = unsafe { in_lane_sums(m) };
    // x: lanes 0-1 of u0 and u1 (then 2-3); y: the same of u2 and u3.
    let x0 = _mm512_shuffle_f32x4::<0x44>(u[0], u[1]);
    let x1 = _mm512_shuffle_f32x4::<0xEE>(u[0], u[1]);
    let y0 = _mm512_shuffle_f32x4::<0x44>(u[2], u[3]);
    let y1 = _mm512_shuffle_f32x4::<0xEE>(u[2], u[3]);
    [
        _mm512_shuffle_f32x4::<0x88>(x0, y0),
        _mm512_shuffle_f32x4::<0xDD>(x0, y0),
        _mm512_shuffle_f32x4::<0x88>(x1, y1),
        _mm512_shuffle_f32x4::<0xDD>(x1, y1),
    ]
    .map(V::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_quads_sums_each_row_of_each_vector() {
        let m: [V; 16] = std::array::from_fn(|i| {
            V::from(std::array::from_fn(|j| {
                ((i * 29 + j * 11) % 17) as f32 - 8.0 + 0.25 * j as f32
            }))
        });
        let got = reduce_quads(&m);
        for (r, g) in got.iter().enumerate() {
            for (i, v) in m.iter().enumerate() {
                let x = v.as_array();
                let want = (x[4 * r] + x[4 * r + 2]) + (x[4 * r + 1] + x[4 * r + 3]);
                assert_eq!(g.as_array()[i], want, "row {r}, vector {i}");
            }
        }
    }

    #[test]
    fn reduce16_sums_each_vector_in_order() {
        let m: [V; 16] = std::array::from_fn(|i| {
            V::from(std::array::from_fn(|j| {
                ((i * 31 + j * 7) % 13) as f32 - 6.0
            }))
        });
        let got = reduce16(&m).to_array();
        for (i, row) in m.iter().enumerate() {
            assert_eq!(got[i], row.as_array().iter().sum::<f32>(), "vector {i}");
        }
    }

    #[test]
    fn transpose16_matches_the_definition() {
        let m: [V; 16] =
            std::array::from_fn(|i| V::from(std::array::from_fn(|j| (i * 16 + j) as f32)));
        let t = transpose16(m);
        for (j, row) in t.iter().enumerate() {
            for (i, &x) in row.as_array().iter().enumerate() {
                assert_eq!(x, (i * 16 + j) as f32, "t[{j}][{i}]");
            }
        }
    }
}
