//! Per-thread scratch: one tile of each kind (two query panels and two
//! running outputs, for a pass of two blocks) and a head's packed value
//! rows, leased from a per-thread pool so that calls do not allocate (and
//! fault in) fresh pages.
//!
//! rayon runs a parallel loop as jobs and calls a loop's `init` once per
//! job, so a fresh workspace per job cost every call a few hundred
//! kilobytes of new pages per job on every thread. A [`Lease`] takes a
//! workspace of the right head dims from the thread's pool (or makes one),
//! forgets what it cached for the previous call (`Workspace::reset`), and
//! gives it back on drop. The pool keeps at most [`POOL`] workspaces per
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

/// Per-thread scratch: one tile of each kind (the query panel and running
/// output twice), and a head's packed value
/// rows (at most `PACKED_V_BYTES`).
pub struct Workspace {
    /// The head dims `(dk, dv)` it was made for.
    dims: (usize, usize),
    /// `Q^T` of the (up to 2) blocks of a pass, each `d_qk x ROWS`.
    pub qt: Vec<f32>,
    /// Score / probability tile `S^T`, `KEYS x ROWS`.
    pub st: Vec<f32>,
    /// Running output `O^T` of the blocks of a pass, each `d_v x ROWS`.
    pub ot: Vec<f32>,
    /// Widened keys when K is not f32 with unit stride.
    pub kbuf: Vec<f32>,
    /// Packed value tile (rows `packed_stride(dv)` apart).
    pub vbuf: Vec<f32>,
    /// The probability tile as bf16 pairs of keys (`dot16/`): `KEYS / 2 x
    /// ROWS` words, each the probabilities of keys `2i` and `2i + 1`.
    pub pt2: Vec<u32>,
    /// The value tile transposed as words for the AMX path
    /// (`dot16/amx.rs`): `d_v x KEYS / 2` words, made on first use.
    pub vt: Vec<u32>,
    /// Keys whose K and V rows the bf16 pass may take (`dot16::Checked`).
    pub checked: crate::dot16::Checked,
    /// A head's packed value rows, kept across its blocks.
    pub packed_v: PackedV,
    /// A head's value rows packed in bf16 pairs of keys (`dot16/`), kept
    /// across its passes, indexed by pair (keys `2i`, `2i + 1`).
    pub packed_pairs: PackedV,
    /// The finished block in row-major order, `ROWS x dv`.
    pub orow: Vec<f32>,
    /// Sixteen widened query rows.
    pub qrow: Vec<f32>,
    /// Decode path: score / probability rows, `DECODE_ROWS x KEYS`.
    pub sd: Vec<f32>,
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
            qt: vec![0.0; 2 * dk * ROWS],
            st: vec![0.0; KEYS * ROWS],
            ot: vec![0.0; 2 * dv * ROWS],
            kbuf: vec![0.0; KEYS * dk],
            vbuf: vec![0.0; KEYS * packed_stride(dv)],
            pt2: vec![0; KEYS.div_ceil(2) * ROWS],
            vt: Vec::new(),
            checked: Default::default(),
            packed_v: PackedV::default(),
            packed_pairs: PackedV::default(),
            orow: vec![0.0; ROWS * dv],
            qrow: vec![0.0; LANES * dk],
            sd: vec![0.0; DECODE_ROWS * DECODE_KEYS],
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
    /// A reset workspace for head dims `dk`, `dv`.
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
