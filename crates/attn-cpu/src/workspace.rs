//! Per-thread scratch: one tile of each kind (two query panels and two
//! running outputs, for a pass of two blocks) and a head's packed value
//! rows, leased from a per-thread pool so that calls do not allocate (and
//! fault in) fresh pages.
//!
//! Each thread that takes part in a call leases one workspace for its
//! share (`threads/`; when the forward pass ran as rayon jobs, each job
//! leased anew), so a fresh workspace per call would cost a few hundred
//! kilobytes of new pages per thread and call. A [`Lease`] takes a
//! workspace of the right head dims from the thread's pool (or makes one),
//! forgets what the last lease cached (`Workspace::reset`; within its
//! share a thread keeps its packed values and checked keys across blocks:
//! when rayon jobs each leased anew, keeping them across a loop's jobs
//! measured +3% on S = 512, d = 64 bf16 and +2% causal, two threads, Zen
//! 4), and gives it back on drop. The pool keeps at most [`POOL`] workspaces per
//! thread (the most recent), for the life of the thread: at head dim 128
//! each holds about 340 KiB of tiles plus up to `PACKED_V_BYTES` (512 KiB)
//! of packed value rows for the f32 kernels and as much in bf16 pairs for
//! the `vdpbf16ps` pass (both only where a call ran both), so a thread that
//! ran attention keeps at most about 2.7 MiB.

use crate::blocking::{DECODE_KEYS, KEYS, LANES, ROWS};
use crate::decode::DECODE_ROWS;
use crate::pack::{packed_stride, Ahead, PackedV};
use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

/// Workspaces a thread keeps between leases (more are dropped).
const POOL: usize = 2;

/// A zeroed buffer whose first element is on a 64-byte boundary, so that
/// the kernels' 64-byte rows (and the AMX tile rows) of a tile whose row
/// length is a whole number of lines never straddle two cache lines (the
/// allocator aligns to 16 bytes only). Fixed length; a slice through
/// `Deref`.
pub struct Aligned<T> {
    buf: Vec<T>,
    at: usize,
    len: usize,
}

impl<T: Copy + Default> Aligned<T> {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        let buf = vec![T::default(); len + 64 / size_of::<T>()];
        // Elements from the start to the next 64-byte boundary.
        let at = (buf.as_ptr() as usize).wrapping_neg() % 64 / size_of::<T>();
        Aligned { buf, at, len }
    }
}

impl<T: Copy + Default> Aligned<T> {
    /// Makes it at least `len` long, keeping its elements (new ones zero).
    pub fn grow(&mut self, len: usize) {
        if len > self.len {
            let mut new = Aligned::zeroed(len);
            new[..self.len].copy_from_slice(self);
            *self = new;
        }
    }
}

impl<T: Copy + Default> Default for Aligned<T> {
    fn default() -> Self {
        Aligned::zeroed(0)
    }
}

impl<T> std::fmt::Debug for Aligned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Aligned({} elements)", self.len)
    }
}

impl<T> Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.at..self.at + self.len]
    }
}

impl<T> DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.at..self.at + self.len]
    }
}

/// Per-thread scratch: one tile of each kind (the query panel and running
/// output twice), and a head's packed value
/// rows (at most `PACKED_V_BYTES`).
pub struct Workspace {
    /// The head dims `(dk, dv)` it was made for.
    dims: (usize, usize),
    /// `Q^T` of the (up to 2) blocks of a pass, each `d_qk x ROWS`.
    pub qt: Aligned<f32>,
    /// Score / probability tile `S^T`, `KEYS x ROWS` (the bf16 pass keeps
    /// its probabilities there as bf16 pairs of keys, pair `i` in key
    /// `2i`'s row).
    pub st: Aligned<f32>,
    /// Running output `O^T` of the blocks of a pass, each `d_v x ROWS`.
    pub ot: Aligned<f32>,
    /// Widened keys when K is not f32 with unit stride.
    pub kbuf: Aligned<f32>,
    /// Packed value tile (rows `packed_stride(dv)` apart).
    pub vbuf: Aligned<f32>,
    /// The value tile transposed as words for the AMX path
    /// (`dot16/amx.rs`): `d_v x KEYS / 2` words, made on first use.
    pub vt: Aligned<u32>,
    /// Keys whose K and V rows the bf16 pass may take (`dot16::Checked`).
    pub checked: crate::dot16::Checked,
    /// A head's packed value rows, kept across its blocks.
    pub packed_v: PackedV,
    /// A head's value rows packed in bf16 pairs of keys (`dot16/`), kept
    /// across its passes, indexed by pair (keys `2i`, `2i + 1`).
    pub packed_pairs: PackedV,
    /// A head's value tiles transposed for the AMX path (`dot16/amx.rs`),
    /// kept across its passes, indexed by tile (keys `KEYS t..KEYS (t+1)`).
    pub packed_vt: PackedV,
    /// The finished block in row-major order, `ROWS x dv`.
    pub orow: Aligned<f32>,
    /// Sixteen widened query rows.
    pub qrow: Aligned<f32>,
    /// Decode path: score / probability rows, `DECODE_ROWS x KEYS`.
    pub sd: Aligned<f32>,
    /// Rows to prefetch while the block computes (set by the scheduler).
    pub ahead: Ahead,
    /// (batch, K/V head) of the last block run on this workspace.
    pub head: Option<(usize, usize)>,
    /// The key tile `((batch, K/V head), j0, n)` whose rows the first block
    /// of a pass left in `kbuf` and `vbuf` (`tiling::run_items`).
    pub scratch_tile: Option<((usize, usize), usize, usize)>,
}

impl Workspace {
    /// Scratch for head dims `dk`, `dv`.
    pub fn new(dk: usize, dv: usize) -> Self {
        Workspace {
            dims: (dk, dv),
            qt: Aligned::zeroed(2 * dk * ROWS),
            st: Aligned::zeroed(KEYS * ROWS),
            ot: Aligned::zeroed(2 * dv * ROWS),
            kbuf: Aligned::zeroed(KEYS * dk),
            vbuf: Aligned::zeroed(KEYS * packed_stride(dv)),
            vt: Aligned::zeroed(0),
            checked: Default::default(),
            packed_v: PackedV::default(),
            packed_pairs: PackedV::default(),
            packed_vt: PackedV::default(),
            orow: Aligned::zeroed(ROWS * dv),
            qrow: Aligned::zeroed(LANES * dk),
            sd: Aligned::zeroed(DECODE_ROWS * DECODE_KEYS),
            ahead: Ahead::default(),
            head: None,
            scratch_tile: None,
        }
    }

    /// Forgets everything kept from earlier blocks (the packed value rows
    /// and the last head), so nothing outlives the call that computed it.
    fn reset(&mut self) {
        self.packed_v.forget();
        self.packed_pairs.forget();
        self.packed_vt.forget();
        self.checked.forget();
        self.head = None;
        self.scratch_tile = None;
        self.ahead.clear();
    }
}

thread_local! {
    static FREE: RefCell<Vec<Workspace>> = const { RefCell::new(Vec::new()) };
}

/// A workspace borrowed from the calling thread's pool; returned on drop.
pub struct Lease(Option<Workspace>);

impl Lease {
    /// A workspace for head dims `dk`, `dv`, its buffers reused from the
    /// thread's pool where one of those dims is there, with nothing kept
    /// of what an earlier lease cached (packed values and checked keys
    /// are one call's data). `threads::map` leases once per thread and
    /// call.
    pub fn new(dk: usize, dv: usize) -> Self {
        let found = FREE.with(|f| {
            let mut f = f.borrow_mut();
            let at = f.iter().position(|w| w.dims == (dk, dv))?;
            Some(f.swap_remove(at))
        });
        let mut ws = found.unwrap_or_else(|| Workspace::new(dk, dv));
        ws.reset();
        Lease(Some(ws))
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(ws) = self.0.take() {
            // The newest workspace replaces the oldest; during the thread's
            // teardown the pool is gone and the workspace is dropped.
            let _ = FREE.try_with(|f| {
                let mut f = f.borrow_mut();
                if f.len() >= POOL {
                    f.remove(0);
                }
                f.push(ws);
            });
        }
    }
}

impl Deref for Lease {
    type Target = Workspace;
    fn deref(&self) -> &Workspace {
        self.0
            .as_ref()
            .expect("a lease holds its workspace until dropped")
    }
}

impl DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut Workspace {
        self.0
            .as_mut()
            .expect("a lease holds its workspace until dropped")
    }
}

#[cfg(test)]
mod tests {
    use super::{Aligned, Lease};

    /// A lease reuses the buffers the thread's last lease of the same
    /// dims gave back, but finds what that lease cached forgotten.
    #[test]
    fn leases_reuse_buffers_but_not_caches() {
        let (g, keys) = ((0, 1), 0..128);
        let first = {
            let mut ws = Lease::new(24, 40);
            assert!(!ws.checked.covers(g, &keys));
            ws.checked.add(g, keys.clone());
            ws.head = Some(g);
            ws.qt.as_ptr()
        };
        let ws = Lease::new(24, 40);
        assert_eq!(ws.qt.as_ptr(), first, "the pooled workspace");
        assert!(!ws.checked.covers(g, &keys) && ws.head.is_none());
    }

    #[test]
    fn aligned_buffers_start_on_a_line_and_hold_zeros() {
        for len in [0, 1, 15, 16, 1000, 8192] {
            let mut a = Aligned::<f32>::zeroed(len);
            let b = Aligned::<u32>::zeroed(len);
            assert_eq!((a.len(), b.len()), (len, len));
            assert!((a.as_ptr() as usize).is_multiple_of(64), "{len}");
            assert!((b.as_ptr() as usize).is_multiple_of(64), "{len}");
            assert!(a.iter().all(|&x| x == 0.0) && b.iter().all(|&x| x == 0));
            a.fill(1.0);
            assert_eq!(a.iter().sum::<f32>(), len as f32);
        }
    }
}
