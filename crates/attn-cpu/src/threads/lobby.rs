//! Where helpers wait for the next call (`Cpu::with_spin`): see the
//! parent module's doc.

use super::{Call, Helper, Work};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Where helpers wait, spinning, for the next call after theirs: see the
/// module's doc. A call posts itself here with how many helpers it has
/// room for and claims that many of those waiting (`idle`); a waiting
/// helper that sees a post takes a claim if one is left, and leaves once
/// its spin has run out with none taken. A claim is a promise to join the
/// latest call: the caller spawns no job for it, and a helper whose spin
/// ends takes a claim still open before it leaves. (When several threads
/// call one backend at once, a later call's post takes back the claims an
/// earlier call's helpers have not yet taken: that call then runs with
/// fewer helpers, as it would on a busy pool.)
pub struct Lobby {
    /// How long a helper waits after its last call.
    spin: Duration,
    /// At most this many helpers wait here (a backend's threads but one).
    room: usize,
    /// Bumped (under `state`) by every post that claims helpers, every
    /// hold and the close: what waiting helpers poll between looks at the
    /// state.
    posts: AtomicU64,
    state: Mutex<LobbyState>,
}

#[derive(Default)]
struct LobbyState {
    /// Waiting helpers no call has claimed.
    idle: usize,
    /// Claimed helpers that have not yet taken `call`.
    claimed: usize,
    /// The latest call with claims, and its work.
    call: Option<(Arc<Call>, Work)>,
    /// Bumped by each hold and the close: helpers waiting from before
    /// leave.
    holds: u64,
    /// Holds in force ([`Lobby::hold`], and one for good once the lobby
    /// is closed): no helper starts to wait while there is one.
    held: usize,
}

impl std::fmt::Debug for Lobby {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lobby")
            .field("spin", &self.spin)
            .field("room", &self.room)
            .finish()
    }
}

impl Lobby {
    /// A lobby where up to `room` helpers wait up to `spin` after each
    /// call (`Duration::MAX`: for as long as the lobby is open).
    pub fn new(spin: Duration, room: usize) -> Self {
        Lobby {
            spin,
            room,
            posts: AtomicU64::new(0),
            state: Mutex::new(LobbyState::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LobbyState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Posts `call` for up to `room` waiting helpers; returns how many it
    /// claimed. Claims an earlier call left untaken go back to waiting
    /// first (they were that call's; this one may have them).
    pub(super) fn post(&self, call: &Arc<Call>, work: Work, room: usize) -> usize {
        let mut st = self.lock();
        st.idle += st.claimed;
        let claimed = st.idle.min(room);
        st.idle -= claimed;
        st.claimed = claimed;
        st.call = (claimed > 0).then(|| (Arc::clone(call), work));
        if claimed > 0 {
            self.posts.fetch_add(1, Ordering::Release);
        }
        claimed
    }

    /// Sends every waiting helper back to the pool, and keeps helpers
    /// that finish a call from waiting, until the guard drops: for work
    /// that needs the pool's threads (`ThreadPool::install`), which
    /// waiting helpers would hold until their spin runs out. Claims
    /// already made stand.
    pub fn hold(&self) -> Hold<'_> {
        self.block();
        Hold(self)
    }

    /// Sends every waiting helper back to the pool, for good.
    pub fn close(&self) {
        self.block();
    }

    fn block(&self) {
        let mut st = self.lock();
        st.held += 1;
        st.holds += 1;
        self.posts.fetch_add(1, Ordering::Release);
    }

    /// Enters the lobby as a waiting helper (one that may be claimed from
    /// now on); `None` when the lobby is held or `room` helpers wait
    /// already. A helper enters before it leaves its call, so that the
    /// caller's next call, posted as soon as this one closes, finds it.
    pub(super) fn enter(&self) -> Option<Ticket> {
        let mut st = self.lock();
        if st.held > 0 || st.idle + st.claimed >= self.room {
            return None;
        }
        st.idle += 1;
        Some(Ticket {
            seen: self.posts.load(Ordering::Relaxed),
            holds: st.holds,
            // `None`: the spin outlasts any clock (`Duration::MAX`).
            deadline: Instant::now().checked_add(self.spin),
        })
    }

    /// Waits, spinning, for a claim on a posted call: the call as a job
    /// to run, or `None` when the spin ran out first or a hold came.
    pub(super) fn wait(&self, ticket: Ticket) -> Option<Helper> {
        let Ticket {
            mut seen,
            holds,
            deadline,
        } = ticket;
        loop {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            let late = deadline.is_some_and(|d| Instant::now() >= d);
            if !late && self.posts.load(Ordering::Acquire) == seen {
                continue;
            }
            let mut st = self.lock();
            if st.claimed > 0 {
                st.claimed -= 1;
                let (call, work) = st.call.clone().expect("a claim has its call");
                if st.claimed == 0 {
                    st.call = None;
                }
                return Some(Helper { call, work });
            }
            if late || st.holds != holds {
                st.idle -= 1;
                return None;
            }
            seen = self.posts.load(Ordering::Relaxed);
        }
    }
}

/// A helper's place in the lobby ([`Lobby::enter`]): counted as waiting
/// until [`Lobby::wait`] returns.
pub(super) struct Ticket {
    seen: u64,
    holds: u64,
    deadline: Option<Instant>,
}

/// A hold on a lobby ([`Lobby::hold`]), released when dropped.
pub struct Hold<'a>(&'a Lobby);

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.0.lock().held -= 1;
    }
}

/// A backend's lobby, closed when the last of the backend's clones drops,
/// so that its helpers do not spin on after it.
#[derive(Debug)]
pub struct Owned(pub Arc<Lobby>);

impl Drop for Owned {
    fn drop(&mut self) {
        self.0.close();
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{check, new_pool};
    use super::super::Threads;
    use super::*;

    /// Polls `cond` every millisecond for up to 20 s; whether it held.
    fn eventually(cond: impl Fn() -> bool) -> bool {
        let end = Instant::now() + Duration::from_secs(20);
        while !cond() {
            if Instant::now() > end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    impl Lobby {
        /// Helpers waiting here, claimed or not.
        fn waiting(&self) -> usize {
            let st = self.lock();
            st.idle + st.claimed
        }
    }

    /// A pool of one thread, a lobby for one helper that waits `spin`,
    /// and a call through both long enough for the pool's thread to wake
    /// and join (300 items of 300 us every 7th); after it, the helper
    /// waits in the lobby.
    fn one_helper_waiting(spin: Duration) -> (rayon::ThreadPool, Arc<Lobby>) {
        let pool = new_pool(1);
        let lobby = Arc::new(Lobby::new(spin, 1));
        let made = check(Threads::Pool(Some(&pool), 2, Some(&lobby)), 2100);
        assert_eq!(made, 2, "the helper did not join");
        assert!(eventually(|| lobby.waiting() == 1), "no helper waits");
        (pool, lobby)
    }

    /// Whether a job spawned on `pool` now runs within 20 s: whether the
    /// pool's only thread is free.
    fn free(pool: &rayon::ThreadPool) -> bool {
        let (done, finished) = std::sync::mpsc::channel();
        pool.spawn(move || done.send(()).unwrap());
        finished.recv_timeout(Duration::from_secs(20)).is_ok()
    }

    /// A helper that waits in the lobby joins the next call at once. The
    /// pool has one thread, which the waiting helper holds (it spins for
    /// a minute): a job spawned for the second call could not start
    /// before that call ends, so a second participant can only be the
    /// waiting helper.
    #[test]
    fn a_waiting_helper_joins_the_next_call() {
        let (pool, lobby) = one_helper_waiting(Duration::from_secs(60));
        for _ in 0..3 {
            let made = check(Threads::Pool(Some(&pool), 2, Some(&lobby)), 2100);
            assert_eq!(made, 2, "the waiting helper did not join");
            assert!(eventually(|| lobby.waiting() == 1), "no helper waits");
        }
        lobby.close();
        assert!(eventually(|| lobby.waiting() == 0), "still waiting");
    }

    /// A hold sends the waiting helper back to the pool (a job spawned on
    /// the pool's only thread runs, where it would wait a minute), and a
    /// helper that finishes a call while the hold lasts does not wait;
    /// after the hold, helpers wait again.
    #[test]
    fn a_hold_sends_helpers_back_to_the_pool() {
        let (pool, lobby) = one_helper_waiting(Duration::from_secs(60));
        let hold = lobby.hold();
        assert!(free(&pool), "the pool's thread stayed in the lobby");
        assert_eq!(lobby.waiting(), 0);
        assert_eq!(check(Threads::Pool(Some(&pool), 2, Some(&lobby)), 2100), 2);
        assert!(free(&pool), "a helper waited during the hold");
        assert_eq!(lobby.waiting(), 0);
        drop(hold);
        check(Threads::Pool(Some(&pool), 2, Some(&lobby)), 2100);
        assert!(eventually(|| lobby.waiting() == 1), "no helper waits");
        lobby.close();
        assert!(free(&pool), "the pool's thread stayed in the lobby");
    }

    /// Helpers leave when their spin runs out, and when the lobby's owner
    /// (a backend) drops, even with an endless spin.
    #[test]
    fn helpers_leave_when_their_spin_runs_out_or_the_backend_drops() {
        // Long enough to see the helper wait first on a loaded machine.
        // Under Miri, whose clock runs far ahead of its work, the spin ran
        // out before the first poll (300 ms, 2 s and 10 s tried): this
        // half runs natively only.
        if !cfg!(miri) {
            let (pool, lobby) = one_helper_waiting(Duration::from_secs(2));
            assert!(
                eventually(|| lobby.waiting() == 0),
                "the spin never ran out"
            );
            assert!(free(&pool));
        }

        let (pool, lobby) = one_helper_waiting(Duration::MAX);
        drop(Owned(Arc::clone(&lobby)));
        assert!(free(&pool), "the pool's thread stayed in the lobby");
        assert_eq!(lobby.waiting(), 0);
    }

    /// A helper job that starts after its call closed goes back to the
    /// pool without waiting in the lobby: the pool's only thread is held
    /// while the call runs on the caller alone; released, the late job
    /// finds the call closed and must leave the thread free.
    #[test]
    fn a_helper_that_never_joined_does_not_wait() {
        let pool = new_pool(1);
        let lobby = Arc::new(Lobby::new(Duration::from_secs(60), 1));
        let (release, held) = std::sync::mpsc::channel::<()>();
        pool.spawn(move || held.recv().unwrap());
        let made = check(Threads::Pool(Some(&pool), 2, Some(&lobby)), 50);
        assert_eq!(made, 1);
        release.send(()).unwrap();
        assert!(free(&pool), "the late helper waited in the lobby");
        assert_eq!(lobby.waiting(), 0);
    }

    /// No more helpers wait than the lobby has room for: a pool of two
    /// threads, a call with room for both, a lobby with room for one; the
    /// other helper goes back to the pool, whose thread is then free for
    /// a job though the waiting one spins for a minute.
    #[test]
    fn no_more_helpers_wait_than_the_room() {
        let pool = new_pool(2);
        let lobby = Arc::new(Lobby::new(Duration::from_secs(60), 1));
        let made = check(Threads::Pool(Some(&pool), 3, Some(&lobby)), 2100);
        assert_eq!(made, 3, "not both helpers joined");
        assert!(eventually(|| lobby.waiting() == 1), "no helper waits");
        assert!(free(&pool), "both pool threads wait in the lobby");
        assert_eq!(lobby.waiting(), 1);
        lobby.close();
    }

    /// Several threads calling through one lobby at once: every call runs
    /// each of its items once (claims of one call may go to another), and
    /// none waits for a helper that never comes.
    #[test]
    fn concurrent_calls_share_a_lobby() {
        let pool = new_pool(3);
        let lobby = Arc::new(Lobby::new(Duration::from_micros(200), 2));
        std::thread::scope(|s| {
            for t in 0..3 {
                let (pool, lobby) = (&pool, &lobby);
                s.spawn(move || {
                    for r in 0..40 {
                        check(
                            Threads::Pool(Some(pool), 2 + (t + r) % 3, Some(lobby)),
                            30 + r,
                        );
                    }
                });
            }
        });
        lobby.close();
    }
}
