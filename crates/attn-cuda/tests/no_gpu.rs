//! Nothing in attn-cuda panics on a machine without CUDA: starting the
//! backend gives an error value that names what is missing, and kernels
//! compile (or say why they cannot) without a GPU.

use attn_cuda::{compile, variant::check_variants, Cuda};
use attn_spec::AttnError;

/// Whether NVRTC can be loaded. Without it a test prints why and passes,
/// unless `ATTN_REQUIRE_NVRTC=1` (set by `cargo xtask test`, which installs
/// it): then it fails. Its absence must be the typed error, never a panic.
fn nvrtc_present() -> bool {
    match attn_cuda::libs::nvrtc() {
        Ok(()) => true,
        Err(e) => {
            assert!(matches!(e, AttnError::DriverMissing { .. }), "{e}");
            if std::env::var("ATTN_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("ATTN_REQUIRE_NVRTC=1 but NVRTC is missing: {e}");
            }
            eprintln!("skipping: no NVRTC ({e})");
            false
        }
    }
}

#[test]
fn starting_without_a_gpu_is_an_error_value() {
    match Cuda::first() {
        Ok(c) => eprintln!("a GPU is present: {} {:?}", c.device_name(), c.arch()),
        Err(AttnError::DriverMissing { library }) => {
            assert!(
                library.contains("libcuda") || library.contains("nvrtc"),
                "{library}"
            );
        }
        Err(AttnError::NoDevice { reason, .. }) => assert!(!reason.is_empty()),
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

/// A representative kernel of each kind compiles through NVRTC for sm_80
/// and sm_90 (`cargo xtask cuda-check` compiles every variant and runs
/// ptxas on them). Without NVRTC this prints why and passes, unless
/// `ATTN_REQUIRE_NVRTC=1` (set by `.ci/run`, which installs it).
#[test]
fn kernels_compile_through_nvrtc_without_a_gpu() {
    if !nvrtc_present() {
        return;
    }
    for arch in [(8, 0), (9, 0)] {
        let all = check_variants(arch);
        // The first and last variant of each kernel: no options at the
        // smallest head dim, every option at the largest.
        let mut picked = Vec::new();
        for k in [
            attn_cuda::Kernel::Mma,
            attn_cuda::Kernel::Simt,
            attn_cuda::Kernel::Combine,
            attn_cuda::Kernel::Linear,
            attn_cuda::Kernel::BwdDq,
            attn_cuda::Kernel::BwdDkdv,
            attn_cuda::Kernel::BwdSinks,
        ] {
            let of: Vec<_> = all.iter().filter(|v| v.kernel == k).collect();
            picked.push(*of[0]);
            picked.push(**of.last().unwrap());
        }
        for v in picked {
            let ptx = compile::ptx(&v).unwrap_or_else(|e| panic!("{}: {e}", v.describe()));
            let src = ptx.to_src();
            assert!(src.contains(v.kernel.function()), "{}", v.describe());
            if v.kernel == attn_cuda::Kernel::Mma {
                assert!(
                    src.contains("mma.sync.aligned.m16n8k16"),
                    "{}",
                    v.describe()
                );
            }
        }
    }
}

/// A compile error comes back as `AttnError::Nvrtc` with the compiler's
/// log, not a panic.
#[test]
fn a_broken_kernel_is_an_nvrtc_error_with_its_log() {
    if !nvrtc_present() {
        return;
    }
    let e = compile::compile_source(
        "broken",
        "extern \"C\" __global__ void f() { oops; }",
        compile::Target::Ptx(80),
    )
    .unwrap_err();
    match e {
        AttnError::Nvrtc { variant, log } => {
            assert_eq!(variant, "broken");
            assert!(log.contains("oops"), "{log}");
        }
        other => panic!("expected an NVRTC error, got {other}"),
    }
}

/// Each kernel compiles to machine code (a CUBIN, what the backend loads
/// on a GPU this NVRTC knows) for sm_80 and sm_90 without a GPU: a CUDA
/// ELF object whose header names the architecture it was built for.
#[test]
fn kernels_compile_to_machine_code_for_the_device_architecture() {
    if !nvrtc_present() {
        return;
    }
    let known = compile::known_archs().unwrap();
    let version = compile::nvrtc_version().unwrap();
    eprintln!("NVRTC {version:?} knows {known:?}");
    for (cc, arch) in [((8, 0), 80u32), ((9, 0), 90)] {
        assert_eq!(
            compile::Target::for_device(cc, &known),
            Some(compile::Target::Cubin(arch)),
            "NVRTC {version:?} knows {known:?}"
        );
        let all = check_variants(cc);
        let mut seen = std::collections::HashSet::new();
        for v in all.iter().filter(|v| seen.insert(v.kernel)) {
            let image =
                compile::compile_source(&v.describe(), &v.source(), compile::Target::Cubin(arch))
                    .unwrap_or_else(|e| panic!("{}: {e}", v.describe()));
            assert_eq!(&image[..4], b"\x7fELF", "{}", v.describe());
            // ELF64: e_machine at byte 18 (190 = EM_CUDA), e_flags at 48,
            // whose low byte is the SM version (EF_CUDA_SM).
            let machine = u16::from_le_bytes([image[18], image[19]]);
            let flags = u32::from_le_bytes(image[48..52].try_into().unwrap());
            assert_eq!((image[4], machine), (2, 190), "{}", v.describe());
            // The SM version's place in e_flags: the low byte up to CUDA 12
            // (ELF ABI version 7), the second byte from CUDA 13 (version 8).
            let sm = if image[8] <= 7 {
                flags & 0xff
            } else {
                (flags >> 8) & 0xff
            };
            assert_eq!(sm, arch, "{}: e_flags {flags:#x}", v.describe());
            let name = v.kernel.function().as_bytes();
            assert!(
                image.windows(name.len()).any(|w| w == name),
                "{}: no symbol {}",
                v.describe(),
                v.kernel.function()
            );
        }
    }
}

/// The opt-in fast tensor-core kernel is the same source compiled with
/// `FAST`: its PTX packs probabilities with `cvt.rn.{bf16,f16}x2.f32`,
/// takes `ex2.approx.ftz` and loads K by `ldmatrix.x4`, where the default
/// kernel packs by hand and loads K 32 bits at a time.
#[test]
fn the_fast_kernel_compiles_its_own_instructions() {
    if !nvrtc_present() {
        return;
    }
    for (elem, cvt) in [
        (attn_spec::DType::Bf16, "cvt.rn.bf16x2.f32"),
        (attn_spec::DType::F16, "cvt.rn.f16x2.f32"),
    ] {
        let pick = |k| {
            *check_variants((9, 0))
                .iter()
                .find(|v| v.kernel == k && v.elem == elem && v.dqk == 128 && !v.sinks)
                .expect("in the check set")
        };
        let text = |v: &attn_cuda::Variant| compile::ptx(v).unwrap().to_src();
        let (base, fast) = (
            text(&pick(attn_cuda::Kernel::Mma)),
            text(&pick(attn_cuda::Kernel::MmaFast)),
        );
        assert!(
            fast.contains(cvt) && fast.contains("ex2.approx.ftz.f32"),
            "{elem}"
        );
        assert!(
            !base.contains(cvt),
            "{elem}: the default kernel packs by hand"
        );
        let x4 = "ldmatrix.sync.aligned.m8n8.x4.shared.b16";
        assert!(
            fast.contains(x4) && !base.contains(x4),
            "{elem}: K by ldmatrix.x4"
        );
    }
}
