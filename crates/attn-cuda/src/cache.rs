//! The loaded-kernel cache: one slot per kernel variant, so a compile
//! (NVRTC plus module load, tens to hundreds of milliseconds) holds only
//! its own variant's slot. Launches of variants already loaded, and
//! compiles of other variants, go on meanwhile; a second caller of the
//! same variant waits for the first compile instead of repeating it.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// A map from key to a value built once, with per-key build locks.
pub struct Cache<K, V> {
    slots: Mutex<HashMap<K, Arc<Mutex<Option<V>>>>>,
}

impl<K, V> Default for Cache<K, V> {
    fn default() -> Self {
        Cache {
            slots: Mutex::new(HashMap::new()),
        }
    }
}

/// A poisoned lock: a build panicked in another thread.
#[derive(Debug, PartialEq, Eq)]
pub struct Poisoned;

impl<K: Hash + Eq + Clone, V: Clone> Cache<K, V> {
    /// The value of `key`, built by `build` on first use. The map's lock is
    /// held only to find the key's slot; `build` runs under the slot's
    /// lock alone (it may itself use the cache for other keys). A failed
    /// build leaves the slot empty, so the next caller tries again.
    pub fn get_or_build<E>(
        &self,
        key: &K,
        build: impl FnOnce() -> Result<V, E>,
        poisoned: impl FnOnce(Poisoned) -> E,
    ) -> Result<V, E> {
        let slot = {
            let Ok(mut map) = self.slots.lock() else {
                return Err(poisoned(Poisoned));
            };
            map.entry(key.clone()).or_default().clone()
        };
        let Ok(mut value) = slot.lock() else {
            return Err(poisoned(Poisoned));
        };
        if let Some(v) = value.as_ref() {
            return Ok(v.clone());
        }
        let v = build()?;
        *value = Some(v.clone());
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;

    /// While one key's build is stalled, another key builds and a third
    /// caller of the stalled key waits for it rather than building again.
    /// With one lock held across builds (the old cache), the second build
    /// would block until the first ends and this test would time out.
    #[test]
    fn a_slow_build_blocks_only_its_own_key() {
        let cache: Arc<Cache<u32, u32>> = Arc::default();
        let builds = Arc::new(AtomicUsize::new(0));
        let (started_tx, started_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let slow = {
            let (cache, builds) = (cache.clone(), builds.clone());
            std::thread::spawn(move || {
                cache.get_or_build(
                    &1,
                    || {
                        builds.fetch_add(1, Ordering::SeqCst);
                        started_tx.send(()).unwrap();
                        release_rx.recv().unwrap();
                        Ok::<_, ()>(10)
                    },
                    |_| (),
                )
            })
        };
        started_rx.recv().unwrap();
        let (done_tx, done_rx) = mpsc::channel();
        {
            let cache = cache.clone();
            std::thread::spawn(move || {
                done_tx
                    .send(cache.get_or_build(&2, || Ok::<_, ()>(20), |_| ()))
                    .unwrap();
            });
        }
        let other = done_rx.recv_timeout(Duration::from_secs(20));
        assert_eq!(other, Ok(Ok(20)), "key 2 waited for key 1's build");
        let waiter = {
            let (cache, builds) = (cache.clone(), builds.clone());
            std::thread::spawn(move || {
                cache.get_or_build(
                    &1,
                    || {
                        builds.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, ()>(11)
                    },
                    |_| (),
                )
            })
        };
        release_tx.send(()).unwrap();
        assert_eq!(slow.join().unwrap(), Ok(10));
        assert_eq!(waiter.join().unwrap(), Ok(10));
        assert_eq!(builds.load(Ordering::SeqCst), 1);
    }

    /// A build may use the cache for another key (no self-deadlock), and
    /// a failed build is retried by the next caller.
    #[test]
    fn builds_nest_and_failures_retry() {
        let cache: Cache<u32, u32> = Cache::default();
        let nested = cache.get_or_build(
            &1,
            || cache.get_or_build(&2, || Ok::<_, String>(2), |_| "poisoned".into()),
            |_| "poisoned".into(),
        );
        assert_eq!(nested, Ok(2));
        let failed = cache.get_or_build(&3, || Err("nvrtc".to_string()), |_| "poisoned".into());
        assert_eq!(failed, Err("nvrtc".into()));
        assert_eq!(
            cache.get_or_build(&3, || Ok::<_, String>(3), |_| "poisoned".into()),
            Ok(3)
        );
    }
}
