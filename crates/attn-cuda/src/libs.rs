//! Finding the CUDA libraries without ever panicking.
//!
//! cudarc loads `libcuda` and `libnvrtc` on first use and panics when they
//! are absent, so every entry point of this crate asks here first and turns
//! absence into [`AttnError::DriverMissing`]. NVRTC need not be installed
//! system-wide: directories in `$ATTN_CUDA_LIB_DIR` (colon-separated) and
//! the NVRTC of the virtualenv `cargo xtask` keeps
//! (`~/.cache/attn/cuda-venv`, PyPI's `nvidia-cuda-nvrtc-cu12`) are tried
//! first, by absolute path; once a library is loaded under its soname,
//! cudarc's own lookup by name finds it.

#[cfg(not(feature = "dynamic-linking"))]
use attn_spec::AttnError;
use attn_spec::Result;
use std::path::{Path, PathBuf};
#[cfg(not(feature = "dynamic-linking"))]
use std::sync::OnceLock;

/// The NVRTC sonames this build accepts (cudarc is built for CUDA 12).
#[cfg(not(feature = "dynamic-linking"))]
const NVRTC_NAMES: [&str; 2] = ["libnvrtc.so.12", "libnvrtc.so"];

/// Directories searched for NVRTC before the system's loader path.
pub fn nvrtc_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("ATTN_CUDA_LIB_DIR")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    if let Some(venv) = default_venv() {
        dirs.extend(venv_nvrtc_dirs(&venv));
    }
    dirs
}

/// The virtualenv that holds the CUDA wheels: `$ATTN_CUDA_VENV`, else
/// `$XDG_CACHE_HOME/attn/cuda-venv`, else `~/.cache/attn/cuda-venv`.
pub fn default_venv() -> Option<PathBuf> {
    if let Some(v) = std::env::var_os("ATTN_CUDA_VENV") {
        return Some(PathBuf::from(v));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
    Some(cache.join("attn").join("cuda-venv"))
}

/// `site-packages/nvidia/cuda_nvrtc/lib` of every Python in `venv`.
pub fn venv_nvrtc_dirs(venv: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(venv.join("lib")) {
        for e in rd.flatten() {
            let d = e
                .path()
                .join("site-packages")
                .join("nvidia")
                .join("cuda_nvrtc")
                .join("lib");
            if d.is_dir() {
                out.push(d);
            }
        }
    }
    out
}

#[cfg(not(feature = "dynamic-linking"))]
fn preload_nvrtc() -> bool {
    for dir in nvrtc_dirs() {
        for name in NVRTC_NAMES {
            let path = dir.join(name);
            if !path.exists() {
                continue;
            }
            // SAFETY: loading NVRTC runs its initialisers only, which have no
            // preconditions; the handle is leaked on purpose so the library
            // stays resident for cudarc's later lookup by soname.
            if let Ok(lib) = unsafe { libloading::Library::new(&path) } {
                std::mem::forget(lib);
                return true;
            }
        }
    }
    false
}

/// Whether NVRTC can be used; loads it from the known directories first.
/// With the `dynamic-linking` feature the libraries were linked at build
/// time (the process could not have started without them): always `Ok`.
#[cfg(feature = "dynamic-linking")]
pub fn nvrtc() -> Result<()> {
    Ok(())
}

/// Whether the CUDA driver library can be loaded (linked at build time
/// with the `dynamic-linking` feature: always `Ok`).
#[cfg(feature = "dynamic-linking")]
pub fn driver() -> Result<()> {
    Ok(())
}

/// Whether NVRTC can be used; loads it from the known directories first.
#[cfg(not(feature = "dynamic-linking"))]
pub fn nvrtc() -> Result<()> {
    static OK: OnceLock<bool> = OnceLock::new();
    let ok = *OK.get_or_init(|| {
        preload_nvrtc();
        // SAFETY: only tries to dlopen the candidate names; no NVRTC call.
        unsafe { cudarc::nvrtc::sys::is_culib_present() }
    });
    if ok {
        Ok(())
    } else {
        Err(AttnError::DriverMissing {
            library: "libnvrtc.so.12 (CUDA 12 NVRTC: install the PyPI wheel \
                      nvidia-cuda-nvrtc-cu12, e.g. by `cargo xtask cuda-setup`, or set \
                      ATTN_CUDA_LIB_DIR to its lib directory)"
                .into(),
        })
    }
}

/// Whether the CUDA driver library can be loaded.
#[cfg(not(feature = "dynamic-linking"))]
pub fn driver() -> Result<()> {
    static OK: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the candidate names; no driver call.
    let ok = *OK.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() });
    if ok {
        Ok(())
    } else {
        Err(AttnError::DriverMissing {
            library: "libcuda.so (the NVIDIA driver)".into(),
        })
    }
}
