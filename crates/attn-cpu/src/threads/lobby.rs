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
/// its spin has run out with none taken. A claim is a promise to join:
/// the caller spawns no job for it, and a helper whose spin ends takes a
/// claim still open before it leaves.
pub struct Lobby {
    /// How long a helper waits after its last call.
    spin: Duration,
    /// Bumped (under `state`) by every post and dismissal: what waiting
    /// helpers poll between looks at the state.
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
    /// Bumped by [`Lobby::dismiss`]: helpers waiting from before leave.
    dismissals: u64,
}

impl std::fmt::Debug for Lobby {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lobby").field("spin", &self.spin).finish()
    }
}

impl Lobby {
    /// A lobby whose helpers wait up to `spin` after each call.
    pub fn new(spin: Duration) -> Self {
        Lobby {
            spin,
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

    /// Sends every waiting helper back to the pool, for work that needs
    /// the pool's threads (`ThreadPool::install`): they would otherwise
    /// hold them until their spin runs out. Claims already made stand.
    pub fn dismiss(&self) {
        let mut st = self.lock();
        if st.idle > 0 {
            st.dismissals += 1;
            self.posts.fetch_add(1, Ordering::Release);
        }
    }

    /// Waits, spinning, for a claim on a posted call: the call as a job
    /// to run, or `None` when the spin ran out first (or the lobby was
    /// dismissed).
    pub(super) fn wait(&self) -> Option<Helper> {
        let deadline = Instant::now() + self.spin;
        let (mut seen, dismissals) = {
            let mut st = self.lock();
            st.idle += 1;
            (self.posts.load(Ordering::Relaxed), st.dismissals)
        };
        loop {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            let late = Instant::now() >= deadline;
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
            if late || st.dismissals != dismissals {
                st.idle -= 1;
                return None;
            }
            seen = self.posts.load(Ordering::Relaxed);
        }
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

    /// A helper that waits in the lobby joins the next call at once. The
    /// pool has one thread, which the waiting helper holds (it spins for
    /// a minute): a job spawned for the second call could not start
    /// before that call ends, so a second participant can only be the
    /// waiting helper.
    #[test]
    fn a_waiting_helper_joins_the_next_call() {
        let pool = new_pool(1);
        let lobby = Arc::new(Lobby::new(Duration::from_secs(60)));
        let threads = Threads::Pool(Some(&pool), 2, Some(&lobby));
        // 300 items of 300 us every 7th: long enough for the helper to
        // wake and join.
        assert_eq!(check(threads, 2100), 2, "the helper did not join");
        assert!(eventually(|| lobby.waiting() == 1), "no helper waits");
        for _ in 0..3 {
            assert_eq!(check(threads, 2100), 2, "the waiting helper did not join");
            assert!(eventually(|| lobby.waiting() == 1), "no helper waits");
        }
        lobby.dismiss();
        assert!(eventually(|| lobby.waiting() == 0), "still waiting");
    }

    /// A dismissed lobby hands its helpers back to the pool: `install`
    /// on a pool whose only thread waits in a lobby for a minute returns
    /// once the lobby is dismissed; and helpers leave on their own when
    /// their spin runs out.
    #[test]
    fn helpers_leave_when_dismissed_or_their_spin_runs_out() {
        let pool = new_pool(1);
        let lobby = Arc::new(Lobby::new(Duration::from_secs(60)));
        check(Threads::Pool(Some(&pool), 2, Some(&lobby)), 2100);
        assert!(eventually(|| lobby.waiting() == 1), "no helper waits");
        lobby.dismiss();
        let (done, finished) = std::sync::mpsc::channel();
        pool.spawn(move || done.send(()).unwrap());
        let got = finished.recv_timeout(Duration::from_secs(20));
        assert_eq!(got, Ok(()), "the pool's thread stayed in the lobby");
        assert_eq!(lobby.waiting(), 0);

        let short = Arc::new(Lobby::new(Duration::from_millis(5)));
        check(Threads::Pool(Some(&pool), 2, Some(&short)), 2100);
        assert!(
            eventually(|| short.waiting() == 0),
            "the spin never ran out"
        );
        check(Threads::Pool(Some(&pool), 2, Some(&short)), 50);
    }

    /// Several threads calling through one lobby at once: every call runs
    /// each of its items once (claims of one call may go to another),
    /// and none waits for a helper that never comes.
    #[test]
    fn concurrent_calls_share_a_lobby() {
        let pool = new_pool(3);
        let lobby = Arc::new(Lobby::new(Duration::from_micros(200)));
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
        lobby.dismiss();
    }
}
