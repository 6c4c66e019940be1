//! Where a call's work items run: in order on the calling thread, or on
//! the calling thread together with helpers from a rayon pool.
//!
//! The calling thread works from the start instead of handing the whole
//! call to the pool and sleeping until it is done (`ThreadPool::install`
//! and `par_iter`). A pool thread that sleeps takes tens to hundreds of
//! microseconds to wake on a virtual machine; with `install` the call
//! waits for that wake-up before any work starts, and the second pool
//! thread's before the second half starts, so a call of a few hundred
//! microseconds that follows other work (an engine's projections, say)
//! could run no faster on two threads than on one (measured on this
//! project's 2-core Zen 4 VM: 400 us of work split 16 ways after a 200 us
//! pause took 252 us in median through `install` and `par_iter`, 227 us
//! here; 100 us of work 146 against 68 us). Here the helpers join when
//! they wake and take what is left. The call ends once the caller's share
//! is done and no helper is inside it: a helper that wakes after that
//! finds the call closed and leaves, so a call shorter than a wake-up
//! does not wait for one (a caller whose last helper finishes after it
//! still waits to be woken).
//!
//! A call computes on its caller and up to `n - 1` pool threads, so `k`
//! threads calling at once compute on up to `k + n - 1`.
//!
//! With a [`Lobby`] (`Cpu::with_spin`), helpers do not go back to the pool
//! after a call: they wait in the lobby, spinning, for up to its `spin`,
//! and a call posted there meanwhile is joined at once by as many of them
//! as it has room for (it spawns jobs only for the rest). That is what
//! ONNX Runtime's spinning intra-op threads and OpenMP's active wait
//! policy do: a call that follows other work off the pool (on the caller,
//! say) starts on all its threads without waiting for a wake-up, at the
//! price of the helpers' cores, busy while they wait, and of the pool's
//! other jobs, which get no thread from a waiting helper (a hold on the
//! lobby sends them back).
//!
//! Each participant takes items from the front of a contiguous range of
//! its own (consecutive items of one head keep that head's K and V in
//! cache, and `schedule.rs` prefetches for the next item in order); one
//! that runs out takes the back half of the largest range left. Which
//! participant runs an item never changes its result. A panic in any
//! participant stops the others from starting further items and reaches
//! the caller.

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

mod lobby;
use lobby::Ticket;
pub use lobby::{Lobby, Owned};

/// How a call runs its items.
#[derive(Clone, Copy)]
pub enum Threads<'a> {
    /// In order on the calling thread.
    One,
    /// On the calling thread and up to `n - 1` helpers: those waiting in
    /// the lobby, where there is one, and jobs spawned into `pool`
    /// (rayon's current pool when `None`: the global one outside a pool)
    /// for the rest.
    Pool(Option<&'a rayon::ThreadPool>, usize, Option<&'a Arc<Lobby>>),
}

/// The ranges of items still to run, one per participant.
struct Ranges(Mutex<Vec<Range<usize>>>);

impl Ranges {
    /// `n` items cut into `parts` contiguous ranges of near-equal length.
    fn new(n: usize, parts: usize) -> Self {
        Ranges(Mutex::new(
            (0..parts)
                .map(|p| p * n / parts..(p + 1) * n / parts)
                .collect(),
        ))
    }

    /// The next item for participant `me`: the front of its range, or,
    /// when that is empty, the front of the back half it takes of the
    /// largest range left; `None` when every range is empty.
    fn next(&self, me: usize) -> Option<usize> {
        let mut ranges = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if ranges[me].is_empty() {
            let (most, len) = ranges
                .iter()
                .map(|r| r.len())
                .enumerate()
                .max_by_key(|&(i, len)| (len, std::cmp::Reverse(i)))?;
            if len == 0 {
                return None;
            }
            let cut = ranges[most].end - len.div_ceil(2);
            ranges[me] = cut..ranges[most].end;
            ranges[most].end = cut;
        }
        let i = ranges[me].start;
        ranges[me].start += 1;
        Some(i)
    }
}

/// `f(state, item)` for every item, the results in item order. Each
/// participant makes its `state` once with `init` before its first item.
pub fn map<I: Sync, S, R: Send>(
    threads: Threads<'_>,
    items: &[I],
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, &I) -> R + Sync,
) -> Vec<R> {
    let n = match threads {
        Threads::Pool(_, n, _) => n.min(items.len()),
        Threads::One => 1,
    };
    if n <= 1 {
        let mut state = init();
        return items.iter().map(|it| f(&mut state, it)).collect();
    }
    let ranges = Ranges::new(items.len(), n);
    let done: Mutex<Vec<(usize, R)>> = Mutex::new(Vec::with_capacity(items.len()));
    // Set when a participant panics: the others start no further item,
    // so the panic reaches the caller after the items in flight, not
    // after the whole call's work.
    let stop = AtomicBool::new(false);
    let work = |me: usize| {
        let _stop = StopOnPanic(&stop);
        let mut mine = Vec::new();
        let mut state = None;
        while !stop.load(Ordering::Relaxed) {
            let Some(i) = ranges.next(me) else { break };
            let state = state.get_or_insert_with(&init);
            mine.push((i, f(state, &items[i])));
        }
        done.lock().unwrap_or_else(|e| e.into_inner()).extend(mine);
    };
    let (pool, lobby) = match threads {
        Threads::Pool(pool, _, lobby) => (pool, lobby),
        Threads::One => (None, None),
    };
    let call = Arc::new(Call::new(n - 1));
    {
        // Closes the call when the caller's share is done (or panicked):
        // waits for the helpers inside, turns away any that start later.
        let _close = Close(&call);
        let erased: *const (dyn Fn(usize) + Sync + '_) = &work;
        // SAFETY: only the lifetime is erased, and the pointer is never
        // dereferenced outside it: a helper dereferences it only after it
        // saw the call open and entered it (`inside += 1` under
        // `call.state`), and only until it leaves (`inside -= 1`, after
        // `work` returned or unwound into `catch_unwind`). `_close`,
        // declared in this block, drops before `work` and everything it
        // borrows, on return and on unwind alike; it closes the call and
        // waits for `inside == 0` under the same lock, so afterwards no
        // helper is in `work` and none can enter. Late jobs, and the
        // lobby's copy for claims not yet taken (kept until the next post
        // or the last claim), hold the raw pointer but never dereference
        // it: joining checks the call open first.
        let erased = Work(unsafe {
            std::mem::transmute::<
                *const (dyn Fn(usize) + Sync + '_),
                *const (dyn Fn(usize) + Sync + 'static),
            >(erased)
        });
        let waiting = lobby.map_or(0, |l| l.post(&call, erased, n - 1));
        for _ in waiting + 1..n {
            let job = Helper {
                call: Arc::clone(&call),
                work: erased,
            };
            let lobby = lobby.cloned();
            match pool {
                Some(pool) => pool.spawn(move || job.run_then_wait(lobby)),
                None => rayon::spawn(move || job.run_then_wait(lobby)),
            }
        }
        work(0);
    }
    if let Some(panic) = call.lock().panic.take() {
        std::panic::resume_unwind(panic);
    }
    let mut done = done.into_inner().unwrap_or_else(|e| e.into_inner());
    assert_eq!(done.len(), items.len(), "every item ran once");
    done.sort_unstable_by_key(|&(i, _)| i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// `f(item)` for every item, each taken by value (a disjoint `&mut`
/// piece of an output, say), on `threads` as [`map`] runs them.
pub fn each<I: Send>(
    threads: Threads<'_>,
    items: impl IntoIterator<Item = I>,
    f: impl Fn(I) + Sync,
) {
    if let Threads::One = threads {
        return items.into_iter().for_each(f);
    }
    let cells: Vec<Mutex<Option<I>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
    map(
        threads,
        &cells,
        || (),
        |_, cell| {
            let item = cell.lock().unwrap_or_else(|e| e.into_inner()).take();
            f(item.expect("map runs each item once"))
        },
    );
}

/// What a call's caller and helpers share: whether the call still takes
/// helpers, how many are inside it, and the first helper's panic.
struct Call {
    state: Mutex<CallState>,
    left: Condvar,
    /// The calling thread.
    caller: std::thread::ThreadId,
}

struct CallState {
    closed: bool,
    /// How many helpers may join in all (each has a range of items).
    room: usize,
    inside: usize,
    joined: usize,
    panic: Option<Box<dyn Any + Send>>,
}

impl Call {
    /// An open call from this thread with room for `room` helpers.
    fn new(room: usize) -> Self {
        Call {
            state: Mutex::new(CallState {
                closed: false,
                room,
                inside: 0,
                joined: 0,
                panic: None,
            }),
            left: Condvar::new(),
            caller: std::thread::current().id(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CallState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The call's shared work closure, its lifetime erased so that a pool job
/// (which must be `'static`) can hold it: a raw pointer, dereferenced only
/// while the call is open (see the `SAFETY` note in [`map`]).
#[derive(Clone, Copy)]
struct Work(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the closure behind the pointer is `Sync`, so calling it from
// another thread is sound; when it may be called is `map`'s invariant.
unsafe impl Send for Work {}

/// One helper's job on the pool.
struct Helper {
    call: Arc<Call>,
    work: Work,
}

impl Helper {
    /// Runs its share of the call, then, with a lobby, joins each call
    /// posted there until none comes within the lobby's spin. A job that
    /// did not join (it started late) goes back to the pool at once, and
    /// so does one that the caller's own thread ran (a caller on a pool
    /// thread whose work called into rayon): waiting there would stall
    /// the caller.
    fn run_then_wait(self, lobby: Option<Arc<Lobby>>) {
        let me = std::thread::current().id();
        let lobby = lobby.filter(|_| me != self.call.caller);
        let mut job = self;
        while let Some(ticket) = job.run(lobby.as_deref()) {
            match lobby.as_deref().and_then(|l| l.wait(ticket)) {
                Some(next) => job = next,
                None => return,
            }
        }
    }

    /// Joins the call if it is still open and has room (helpers number
    /// themselves 1, 2, ... in the order they join), runs its share, and
    /// leaves, having entered `lobby` if it joined and the lobby takes it
    /// (its ticket). A panic is kept for the caller, as the pool would
    /// abort on it.
    fn run(self, lobby: Option<&Lobby>) -> Option<Ticket> {
        let me = {
            let mut st = self.call.lock();
            if st.closed || st.joined == st.room {
                return None;
            }
            st.inside += 1;
            st.joined += 1;
            st.joined
        };
        let work = self.work.0;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: this helper entered the open call above and leaves it
            // only below, so `map`'s frame, which owns the closure, waits.
            unsafe { (*work)(me) }
        }));
        // Waiting before leaving: the caller's next call can claim it.
        let ticket = lobby.and_then(Lobby::enter);
        let mut st = self.call.lock();
        st.inside -= 1;
        if let Err(panic) = result {
            st.panic.get_or_insert(panic);
        }
        if st.inside == 0 {
            self.call.left.notify_all();
        }
        ticket
    }
}

/// Closes its call when dropped and waits until no helper is inside.
struct Close<'a>(&'a Call);

impl Drop for Close<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.closed = true;
        while st.inside > 0 {
            st = self.0.left.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Sets its flag when dropped by a panic.
struct StopOnPanic<'a>(&'a AtomicBool);

impl Drop for StopOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A pool of `threads` threads of its own.
    pub(super) fn new_pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    /// Runs `map` with items of uneven cost (every 7th sleeps, so the
    /// others take from its range) and checks that every item ran exactly
    /// once, the results are in item order, each participant made its
    /// state once and at least one did; returns how many participants
    /// made state.
    pub(super) fn check(threads: Threads<'_>, n: usize) -> usize {
        let items: Vec<usize> = (0..n).collect();
        let runs: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        let inits = AtomicUsize::new(0);
        let out = map(
            threads,
            &items,
            || inits.fetch_add(1, Ordering::Relaxed),
            |_, &i| {
                runs[i].fetch_add(1, Ordering::Relaxed);
                if i % 7 == 0 {
                    std::thread::sleep(std::time::Duration::from_micros(300));
                }
                i * 3
            },
        );
        assert_eq!(out, (0..n).map(|i| i * 3).collect::<Vec<_>>());
        assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
        let most = match threads {
            Threads::One => 1,
            Threads::Pool(_, t, _) => t.min(n).max(1),
        };
        let made = inits.load(Ordering::Relaxed);
        assert!(
            (1..=most).contains(&made),
            "{made} states for at most {most}"
        );
        made
    }

    /// Every item runs exactly once and the results come back in item
    /// order, on the calling thread alone, with its own pool, rayon's
    /// global pool, from a worker of another pool and from a worker of
    /// the same pool, each with and without a lobby; a call long enough
    /// for the helpers to wake has more than one participant.
    #[test]
    fn every_item_runs_once_in_order() {
        let pool = new_pool(3);
        let other = new_pool(2);
        let lobby = Arc::new(Lobby::new(std::time::Duration::from_micros(500), 3));
        for n in [0, 1, 2, 5, 97] {
            assert_eq!(check(Threads::One, n), 1);
            for l in [None, Some(&lobby)] {
                check(Threads::Pool(Some(&pool), 3, l), n);
                check(Threads::Pool(None, 4, l), n);
                other.install(|| check(Threads::Pool(Some(&pool), 3, l), n));
                pool.install(|| check(Threads::Pool(Some(&pool), 3, l), n));
                other.install(|| check(Threads::Pool(None, 2, l), n));
            }
        }
        // 2100 items, 300 of them 300 us: about 90 ms of work, which the
        // pool's threads wake for long before it ends.
        assert!(check(Threads::Pool(Some(&pool), 3, None), 2100) > 1);
    }

    /// A call does not wait for a helper that has not started: with the
    /// pool's only thread held by another job, the caller runs every item
    /// and returns; the late helper job then finds the call closed.
    #[test]
    fn a_call_does_not_wait_for_helpers_that_never_start() {
        let pool = new_pool(1);
        let (release, held) = std::sync::mpsc::channel::<()>();
        pool.spawn(move || held.recv().unwrap());
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    check(Threads::Pool(Some(&pool), 2, None), 50)
                }));
                done.send(made.map_err(|_| "check failed")).unwrap()
            });
            let got = finished.recv_timeout(std::time::Duration::from_secs(20));
            release.send(()).unwrap();
            assert_eq!(got, Ok(Ok(1)), "the caller waited for the held pool");
        });
        // The pool, released, still serves calls.
        check(Threads::Pool(Some(&pool), 2, None), 50);
    }

    /// A panic in any participant reaches the caller, and the pool works
    /// after it.
    #[test]
    fn a_panic_reaches_the_caller() {
        let pool = new_pool(2);
        let items: Vec<usize> = (0..64).collect();
        for bad in [0, 31, 63] {
            let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                map(
                    Threads::Pool(Some(&pool), 2, None),
                    &items,
                    || (),
                    |_, &i| {
                        assert_ne!(i, bad, "item {bad}");
                        i
                    },
                )
            }));
            assert!(got.is_err(), "the panic at item {bad} was lost");
        }
        check(Threads::Pool(Some(&pool), 2, None), 40);
    }

    /// After a panic the other participants start no further item. The
    /// first item panics; every other item waits until that panic has
    /// begun to unwind (past the panic hook, however long it takes), then
    /// 20 ms more, by when the runner's flag is set: the helper finishes
    /// the item it holds and stops. Without the flag all 64 run.
    #[test]
    fn a_panic_stops_the_others() {
        let pool = new_pool(2);
        let items: Vec<usize> = (0..64).collect();
        let ran = AtomicUsize::new(0);
        let unwinding = AtomicBool::new(false);
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            map(
                Threads::Pool(Some(&pool), 2, None),
                &items,
                || (),
                |_, &i| {
                    ran.fetch_add(1, Ordering::Relaxed);
                    if i == 0 {
                        let _unwinding = StopOnPanic(&unwinding);
                        panic!("the first item");
                    }
                    while !unwinding.load(Ordering::Relaxed) {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                },
            )
        }));
        assert!(got.is_err(), "the panic was lost");
        let ran = ran.load(Ordering::Relaxed);
        assert!(ran < 8, "{ran} of 64 items ran after the first panicked");
    }

    /// `each` hands every item to `f` once, by value: here disjoint
    /// pieces of one output, each written with its index.
    #[test]
    fn each_runs_every_item_once() {
        let pool = new_pool(3);
        for threads in [Threads::One, Threads::Pool(Some(&pool), 3, None)] {
            for n in [0, 1, 7, 301] {
                let mut out = vec![0usize; n];
                each(threads, out.chunks_mut(4).enumerate(), |(c, piece)| {
                    piece.iter_mut().for_each(|x| *x += c + 1);
                });
                let want: Vec<usize> = (0..n).map(|i| i / 4 + 1).collect();
                assert_eq!(out, want, "{n} items");
            }
        }
    }

    /// A participant that runs out takes the back half of the largest
    /// range left, and the front of its own range otherwise.
    #[test]
    fn ranges_are_taken_front_first_then_halved_from_the_back() {
        let r = Ranges::new(10, 2);
        assert_eq!(r.next(0), Some(0));
        assert_eq!(r.next(1), Some(5));
        for want in 1..5 {
            assert_eq!(r.next(0), Some(want));
        }
        // Participant 0's range is empty; 1 holds 6..10: 0 takes 8..10.
        assert_eq!(r.next(0), Some(8));
        assert_eq!(r.next(1), Some(6));
        assert_eq!(r.next(1), Some(7));
        assert_eq!(r.next(1), Some(9));
        assert_eq!(r.next(0), None);
        assert_eq!(r.next(1), None);
        // Of ranges of equal length (2..4 and 4..6), the first is halved.
        let r = Ranges::new(6, 3);
        assert_eq!(
            (r.next(0), r.next(0), r.next(0)),
            (Some(0), Some(1), Some(3))
        );
        assert_eq!((r.next(1), r.next(1)), (Some(2), Some(5)));
    }

    /// Any order of requests over 2 to 5 participants hands out every
    /// index exactly once and then only `None` (a fixed pseudo-random
    /// sequence of requesters per case).
    #[test]
    fn any_order_of_requests_hands_out_each_item_once() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for parts in 2..=5 {
            for n in [0, 1, parts - 1, parts, 13, 100] {
                let r = Ranges::new(n, parts);
                let mut seen = vec![0; n];
                let mut empty = vec![false; parts];
                while !empty.iter().all(|&e| e) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let me = (x % parts as u64) as usize;
                    match r.next(me) {
                        Some(i) => {
                            assert!(!empty[me], "{me} got {i} after None");
                            seen[i] += 1;
                        }
                        None => empty[me] = true,
                    }
                }
                assert!(
                    seen.iter().all(|&c| c == 1),
                    "{parts} parts, {n} items: {seen:?}"
                );
            }
        }
    }
}
