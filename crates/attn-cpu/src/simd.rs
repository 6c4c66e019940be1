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
