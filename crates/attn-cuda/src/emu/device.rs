//! The emulator's host side of a launch: the compiled variants (`build`),
//! the memory every variant shares (fiber stacks, the shared-memory
//! arena), and the poisoned copies of the buffers a kernel sees.

use super::SMEM_OPTIN;
use crate::bytes::host_of;
use crate::variant::{Kernel, Variant};
use attn_spec::{HostData, View};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const HEADER: &str = include_str!("../kernels/emu.h");
/// Poison bytes on each side of a buffer (and the alignment of its data,
/// as device allocations have).
const PAD: usize = 256;

/// One emulated launch (`struct emu::Launch` in `kernels/emu.h`).
#[repr(C)]
pub(super) struct Launch {
    pub(super) grid: [u32; 3],
    pub(super) block: [u32; 3],
    pub(super) smem: u64,
    pub(super) params: *const u8,
    pub(super) err: *mut u8,
    pub(super) err_len: u64,
    pub(super) stacks: *mut u8,
    pub(super) stack_size: u64,
    pub(super) stack_count: u64,
    pub(super) smem_arena: *mut u8,
}

/// What every compiled variant shares: the fibers' stacks, [`MAX_THREADS`]
/// of [`STACK`] bytes, each with a guard page at its low end (an overflow
/// faults instead of overwriting another fiber's frames), mapped once and
/// never unmapped (pages are committed only where touched); and the
/// shared-memory arena of [`SMEM_CAP`] bytes.
pub(super) struct Shared(pub(super) *mut u8, pub(super) Vec<u128>);

// SAFETY: the mapping is only used under `LOCK`, one launch at a time.
unsafe impl Send for Shared {}

/// The shared-memory arena's bytes (`SMEM_CAP` in emu.h).
const SMEM_CAP: usize = SMEM_OPTIN;
/// Bytes of one fiber stack, its guard page included.
pub(super) const STACK: usize = 256 * 1024;
/// Most threads of a block (CUDA's limit).
pub(super) const MAX_THREADS: usize = 1024;
const GUARD: usize = 4096;

impl Shared {
    #[cfg(unix)]
    pub(super) fn map() -> std::result::Result<Shared, String> {
        let len = STACK * MAX_THREADS;
        // SAFETY: a fresh private anonymous mapping, then guard pages
        // inside it; no existing memory is touched.
        unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err("no address space for the emulator's fiber stacks".into());
            }
            let base = base.cast::<u8>();
            for i in 0..MAX_THREADS {
                if libc::mprotect(base.add(i * STACK).cast(), GUARD, libc::PROT_NONE) != 0 {
                    return Err("mprotect failed on a fiber stack's guard page".into());
                }
            }
            Ok(Shared(base, vec![0u128; SMEM_CAP / 16]))
        }
    }

    #[cfg(not(unix))]
    pub(super) fn map() -> std::result::Result<Shared, String> {
        Err("the kernel emulator runs on x86-64 Linux".into())
    }
}

/// The emulated launch entry point of one kernel.
pub(super) type Run = unsafe extern "C" fn(*const Launch) -> i32;

/// One launch at a time (each compiled variant keeps its GPU state in
/// globals), and the fiber stacks they share.
pub(super) static LOCK: Mutex<Option<Shared>> = Mutex::new(None);

/// Compiles `v` for the emulator (or finds it compiled); returns the
/// shared library's path.
pub(super) fn build(v: &Variant) -> std::result::Result<PathBuf, String> {
    let params = match v.kernel {
        Kernel::BwdDq | Kernel::BwdDkdv | Kernel::BwdSinks => "BwdParams",
        Kernel::Maps => "MapsParams",
        Kernel::Linear => "LinParams",
        _ => "Params",
    };
    let source = format!(
        "#define ATTN_EMU 1\n{HEADER}\n{}\nEMU_KERNEL({}, {params})\n",
        v.source(),
        v.kernel.function()
    );
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let flags = [
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        // The kernels read 16-bit arrays 32 bits at a time, as CUDA allows.
        "-fno-strict-aliasing",
        // An index past a fixed-size array (the registers' `o[][]`, a
        // static `__shared__` array) or a signed overflow stops the
        // process with the source line.
        "-fsanitize=bounds,signed-integer-overflow",
        "-fno-sanitize-recover=all",
        "-Wno-unknown-pragmas",
        // The fibers switch stacks by hand: no shadow stack.
        "-fcf-protection=none",
    ];
    let dir = std::env::temp_dir().join("attn-emu");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let key = fnv1a(format!("{cxx} {flags:?}\n{source}").as_bytes());
    let path = dir.join(format!("{key:016x}.so"));
    // The source stays beside the library: a sanitizer's report names
    // its lines.
    let src = dir.join(format!("{key:016x}.cc"));
    if path.exists() {
        touch(&[&path, &src]);
        return Ok(path);
    }
    static BUILDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let pid = std::process::id();
    let (src_tmp, tmp) = (
        dir.join(format!("{key:016x}.{pid}.{n}.cc.tmp")),
        dir.join(format!("{key:016x}.{pid}.{n}.so")),
    );
    std::fs::write(&src_tmp, &source).map_err(|e| format!("{}: {e}", src_tmp.display()))?;
    std::fs::rename(&src_tmp, &src).map_err(|e| format!("{}: {e}", src.display()))?;
    let out = std::process::Command::new(&cxx)
        .args(flags)
        .arg(&src)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|e| format!("running the C++ compiler `{cxx}` (set CXX): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cxx} failed on {}:\n{}",
            v.describe(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    // Another process may have won the race: either copy will do.
    std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))?;
    // Every change to a kernel's source makes new entries (about 150 for
    // the test suite), so each build clears out those unused for a week.
    prune(&dir, KEEP, std::time::SystemTime::now());
    Ok(path)
}

/// How long a cached library and its source stay after their last use.
const KEEP: std::time::Duration = std::time::Duration::from_secs(7 * 24 * 3600);

/// Marks cache entries as used now (their modification time), so that
/// [`prune`] keeps them. Best effort.
fn touch(paths: &[&Path]) {
    let now = std::time::SystemTime::now();
    for p in paths {
        if let Ok(f) = std::fs::File::open(p) {
            let _ = f.set_modified(now);
        }
    }
}

/// Removes the files of the cache directory `dir` unused for longer than
/// `keep` at `now`: libraries, sources, and temporaries a failed build
/// left. Best effort: an entry that another process removes first, or
/// that cannot be removed, is skipped. A process that found an entry just
/// before it went loads it again after a rebuild (`Emulator::library`).
/// Returns how many it removed.
fn prune(dir: &Path, keep: std::time::Duration, now: std::time::SystemTime) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let stale = e
            .metadata()
            .ok()
            .filter(|m| m.is_file())
            .and_then(|m| m.modified().ok())
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|age| age > keep);
        if stale && std::fs::remove_file(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// FNV-1a, 64 bits: a stable name for a compiled source.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A kernel's view of a buffer: its bytes between two runs of poison.
pub(super) struct Dev {
    name: &'static str,
    mem: Vec<u8>,
    start: usize,
    len: usize,
}

impl Dev {
    /// `bytes` copied in, 256-byte aligned, poison around them (at least
    /// one byte of data, as device allocations).
    pub(super) fn new(name: &'static str, bytes: &[u8]) -> Dev {
        let len = bytes.len().max(1);
        let mut mem = vec![0xffu8; len + 3 * PAD];
        let start = PAD + (PAD - mem.as_ptr() as usize % PAD) % PAD;
        mem[start..start + bytes.len()].copy_from_slice(bytes);
        Dev {
            name,
            mem,
            start,
            len,
        }
    }

    /// `len` bytes of poison: what a kernel must write before it reads.
    pub(super) fn unset(name: &'static str, len: usize) -> Dev {
        let mut d = Dev::new(name, &[]);
        d.mem = vec![0xffu8; len.max(1) + 3 * PAD];
        d.start = PAD + (PAD - d.mem.as_ptr() as usize % PAD) % PAD;
        d.len = len.max(1);
        d
    }

    /// Poisons the elements (`size` bytes each) of `view`: what a kernel
    /// must write, so one it forgets reads back NaN. Bytes outside the
    /// view keep the caller's data, which the contract leaves untouched.
    pub(super) fn poison(mut self, view: &View, size: usize) -> Dev {
        let d = view.dims;
        for a in 0..d[0] {
            for b in 0..d[1] {
                for c in 0..d[2] {
                    for e in 0..d[3] {
                        let at = self.start + view.index([a, b, c, e]) * size;
                        self.mem[at..at + size].fill(0xff);
                    }
                }
            }
        }
        self
    }

    /// Poisons the first `bytes` of the buffer (see [`Dev::poison`]).
    pub(super) fn poison_first(mut self, bytes: usize) -> Dev {
        let start = self.start;
        self.mem[start..start + bytes.min(self.len)].fill(0xff);
        self
    }

    pub(super) fn addr(&mut self) -> u64 {
        self.mem[self.start..].as_mut_ptr() as u64
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.len]
    }

    /// The name of the buffer if a kernel wrote into its padding.
    pub(super) fn overrun(&self) -> Option<&'static str> {
        let (lo, hi) = (&self.mem[..self.start], &self.mem[self.start + self.len..]);
        (lo.iter().chain(hi).any(|&b| b != 0xff)).then_some(self.name)
    }
}

/// `out`'s elements from `b`, a buffer's bytes (of `out`'s type; an
/// empty buffer's one byte ignored).
pub(super) fn store(out: &mut HostData, b: &[u8]) {
    *out = host_of(out.dtype(), &b[..out.len() * out.dtype().size_bytes()]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_padding_catches_writes() {
        let mut d = Dev::new("x", &[1, 2, 3]);
        assert_eq!(d.addr() % PAD as u64, 0);
        assert_eq!(d.bytes(), &[1, 2, 3]);
        assert_eq!(d.overrun(), None);
        let end = d.start + d.len;
        d.mem[end] = 0;
        assert_eq!(d.overrun(), Some("x"));
        let mut u = Dev::unset("y", 10);
        assert_eq!(u.addr() % PAD as u64, 0);
        assert!(u.bytes().iter().all(|&b| b == 0xff));
        u.mem[u.start - 1] = 1;
        assert_eq!(u.overrun(), Some("y"));
    }

    /// Pruning removes the files unused for longer than the limit and
    /// keeps the rest; a lookup marks an entry as used.
    #[test]
    fn the_cache_keeps_what_was_used_this_week() {
        let dir = std::env::temp_dir().join(format!("attn-emu-prune-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let now = std::time::SystemTime::now();
        let day = std::time::Duration::from_secs(24 * 3600);
        let file = |name: &str, age_days: u32| {
            let p = dir.join(name);
            std::fs::write(&p, b"x").unwrap();
            let f = std::fs::File::open(&p).unwrap();
            f.set_modified(now - day * age_days).unwrap();
            p
        };
        let old = file("a.so", 8);
        let fresh = file("b.so", 6);
        let used = file("c.cc", 30);
        touch(&[&used]);
        assert_eq!(prune(&dir, KEEP, now + day / 24), 1);
        assert!(!old.exists() && fresh.exists() && used.exists() && dir.join("sub").is_dir());
        assert_eq!(prune(&dir, KEEP, now + day * 7), 1);
        assert!(!fresh.exists() && used.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Poison covers a view's elements and nothing else.
    #[test]
    fn poison_covers_the_view_only() {
        // 2 x 3 elements of 2 bytes, every other element along the last
        // axis, from element 1: elements 1, 3, 5, 7, 9, 11 of 13.
        let view = View {
            dims: [1, 1, 2, 3],
            strides: [0, 0, 6, 2],
            offset: 1,
        };
        let d = Dev::new("x", &[0u8; 26]).poison(&view, 2);
        let hit: Vec<usize> = (0..13).filter(|e| d.bytes()[2 * e] == 0xff).collect();
        assert_eq!(hit, [1, 3, 5, 7, 9, 11]);
        assert!(d.bytes().chunks(2).all(|c| c[0] == c[1]));
        let f = Dev::new("y", &[0u8; 8]).poison_first(6);
        assert_eq!(f.bytes(), &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0]);
    }
}
