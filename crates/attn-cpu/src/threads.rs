//! Where a call's work items run: in order on the calling thread, or on
//! the calling thread together with helpers from a rayon pool.
//!
//! The calling thread works from the start instead of handing the whole
//! call to the pool and sleeping until it is done (`ThreadPool::install`
//! and `par_iter`). A pool thread that sleeps takes tens to hundreds of
//! microseconds to wake on a virtual machine; with `install` the call
//! waits for that wake-up before any work starts, again for the second
//! pool thread, and once more for the caller's own at the end, so a call
//! of a few hundred microseconds that follows other work (an engine's
//! projections, say) could run no faster on two threads than on one
//! (measured on this project's 2-core Zen 4 VM: 400 us of work split 16
//! ways after a 200 us pause took 252 us in median through `install` and
//! `par_iter`, 227 us here; 100 us of work 146 against 68 us). Here the
//! helpers join when they wake, and a call they miss is done by the
//! caller alone.
//!
//! Each participant takes items from the front of a contiguous range of
//! its own (consecutive items of one head keep that head's K and V in
//! cache, and `schedule.rs` prefetches for the next item in order); one
//! that runs out takes the back half of the largest range left. Which
//! participant runs an item never changes its result.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// How a call runs its items.
#[derive(Clone, Copy)]
pub enum Threads<'a> {
    /// In order on the calling thread.
    One,
    /// On the calling thread and up to `n - 1` helpers from `pool`
    /// (rayon's current pool when `None`: the global one outside a pool).
    Pool(Option<&'a rayon::ThreadPool>, usize),
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
        Threads::Pool(_, n) => n.min(items.len()),
        Threads::One => 1,
    };
    if n <= 1 {
        let mut state = init();
        return items.iter().map(|it| f(&mut state, it)).collect();
    }
    let ranges = Ranges::new(items.len(), n);
    let done: Mutex<Vec<(usize, R)>> = Mutex::new(Vec::with_capacity(items.len()));
    // Helpers number themselves 1, 2, ... in the order they start.
    let joined = AtomicUsize::new(1);
    let work = |me: usize| {
        let mut mine = Vec::new();
        let mut state = None;
        while let Some(i) = ranges.next(me) {
            let state = state.get_or_insert_with(&init);
            mine.push((i, f(state, &items[i])));
        }
        done.lock().unwrap_or_else(|e| e.into_inner()).extend(mine);
    };
    let helper = |_: &rayon::Scope<'_>| work(joined.fetch_add(1, Ordering::Relaxed));
    match threads {
        Threads::Pool(Some(pool), _) => pool.in_place_scope(|s| {
            (1..n).for_each(|_| s.spawn(helper));
            work(0);
        }),
        _ => rayon::in_place_scope(|s| {
            (1..n).for_each(|_| s.spawn(helper));
            work(0);
        }),
    }
    let mut done = done.into_inner().unwrap_or_else(|e| e.into_inner());
    assert_eq!(done.len(), items.len(), "every item ran once");
    done.sort_unstable_by_key(|&(i, _)| i);
    done.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every item runs exactly once and the results come back in item
    /// order, whichever participant ran them and however the ranges were
    /// taken (items of very different cost make the fast participants
    /// take from the slow ones' ranges); each participant makes its state
    /// once.
    #[test]
    fn every_item_runs_once_in_order() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for (threads, n) in [
            (Threads::One, 0),
            (Threads::One, 5),
            (Threads::Pool(Some(&pool), 3), 0),
            (Threads::Pool(Some(&pool), 3), 1),
            (Threads::Pool(Some(&pool), 3), 2),
            (Threads::Pool(Some(&pool), 3), 97),
            (Threads::Pool(None, 4), 50),
        ] {
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
                        std::thread::sleep(std::time::Duration::from_micros(200));
                    }
                    i * 3
                },
            );
            assert_eq!(out, (0..n).map(|i| i * 3).collect::<Vec<_>>());
            assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
            let most = match threads {
                Threads::One => 1,
                Threads::Pool(_, t) => t,
            };
            assert!(inits.load(Ordering::Relaxed) <= most.max(1));
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
    }
}
