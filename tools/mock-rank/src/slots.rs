//! `--max-concurrency`: a rank serves at most N requests at once, the others
//! wait their turn in arrival order, so an overloaded rank builds a queue and
//! its latency grows the way a saturated engine's does.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// A FIFO counting semaphore. Waiters take numbered tickets; ticket `t` may
/// run once fewer than `limit` earlier tickets are unfinished, so nobody is
/// overtaken.
#[derive(Debug)]
pub struct Slots {
    /// 0 = unlimited: no bookkeeping at all.
    limit: u64,
    tickets: Mutex<Tickets>,
    released: Condvar,
}

#[derive(Debug, Default)]
struct Tickets {
    issued: u64,
    finished: u64,
}

impl Slots {
    pub fn new(limit: usize) -> Self {
        Slots {
            limit: limit as u64,
            tickets: Mutex::new(Tickets::default()),
            released: Condvar::new(),
        }
    }

    /// Waits for a free slot. The slot is held until the returned guard is
    /// dropped, on every path out of the handler (including write errors).
    pub fn acquire(&self) -> Slot<'_> {
        let arrived = Instant::now();
        if self.limit == 0 {
            return Slot {
                slots: None,
                waited: Duration::ZERO,
            };
        }
        let mut tickets = self.lock();
        let ticket = tickets.issued;
        tickets.issued += 1;
        let mut queued = false;
        while ticket >= tickets.finished + self.limit {
            queued = true;
            tickets = self
                .released
                .wait(tickets)
                .unwrap_or_else(PoisonError::into_inner);
        }
        // Only a request that found every slot taken waited: the lock alone is not a queue (and
        // a descheduled thread would otherwise report a few microseconds of one).
        let waited = if queued {
            arrived.elapsed()
        } else {
            Duration::ZERO
        };
        Slot {
            slots: Some(self),
            waited,
        }
    }

    /// Requests waiting for a slot right now.
    #[cfg(test)]
    fn waiting(&self) -> u64 {
        let tickets = self.lock();
        let running = tickets.issued - tickets.finished;
        running.saturating_sub(self.limit)
    }

    /// A panic elsewhere cannot leave the counters half-updated (every
    /// critical section is a single increment), so a poisoned lock is usable.
    fn lock(&self) -> MutexGuard<'_, Tickets> {
        self.tickets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn release(&self) {
        self.lock().finished += 1;
        // Every waiter checks its own ticket; only the next ones proceed.
        self.released.notify_all();
    }
}

/// One request's slot on a rank.
#[derive(Debug)]
pub struct Slot<'a> {
    slots: Option<&'a Slots>,
    /// Time spent queued before the slot was granted.
    pub waited: Duration,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Some(slots) = self.slots {
            slots.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{mpsc, Arc};
    use std::thread;

    /// Polls `cond` for up to 5 s.
    fn eventually(cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(Instant::now() < deadline, "condition not reached");
            thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn unlimited_never_waits() {
        let slots = Slots::new(0);
        let held: Vec<_> = (0..100).map(|_| slots.acquire()).collect();
        assert!(held.iter().all(|s| s.waited == Duration::ZERO));
        assert_eq!(slots.waiting(), 0);
    }

    #[test]
    fn waiters_are_served_in_arrival_order() {
        const WAITERS: u64 = 4;
        let slots = Arc::new(Slots::new(1));
        let first = slots.acquire();
        let (order_tx, order_rx) = mpsc::channel();
        let mut handles = Vec::new();
        for i in 0..WAITERS {
            let (shared, order_tx) = (Arc::clone(&slots), order_tx.clone());
            handles.push(thread::spawn(move || {
                let slot = shared.acquire();
                order_tx.send(i).expect("send");
                slot.waited
            }));
            // The next thread starts only once this one holds its ticket.
            eventually(|| slots.waiting() == i + 1);
        }
        drop(first);
        let waited: Vec<Duration> = handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect();
        let order: Vec<u64> = order_rx.try_iter().collect();
        assert_eq!(order, (0..WAITERS).collect::<Vec<_>>());
        assert!(waited.iter().all(|w| *w > Duration::ZERO));
        assert_eq!(slots.waiting(), 0);
    }

    #[test]
    fn limit_bounds_concurrency() {
        const LIMIT: usize = 3;
        const THREADS: usize = 12;
        let slots = Arc::new(Slots::new(LIMIT));
        let running = Arc::new(AtomicU64::new(0));
        let peak = Arc::new(AtomicU64::new(0));
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let (slots, running, peak) =
                    (Arc::clone(&slots), Arc::clone(&running), Arc::clone(&peak));
                thread::spawn(move || {
                    let _slot = slots.acquire();
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    thread::sleep(Duration::from_millis(5));
                    running.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        for handle in handles {
            handle.join().expect("thread");
        }
        assert!(peak.load(Ordering::SeqCst) <= LIMIT as u64);
        // Every slot came back: LIMIT can be taken again at once.
        let again: Vec<_> = (0..LIMIT).map(|_| slots.acquire()).collect();
        assert!(again.iter().all(|s| s.waited < Duration::from_secs(1)));
        assert_eq!(slots.waiting(), 0);
    }

    #[test]
    fn slot_released_on_error_paths() {
        fn failing(slots: &Slots) -> Result<(), String> {
            let _slot = slots.acquire();
            Err("write failed".to_string())
        }
        let slots = Slots::new(1);
        assert!(failing(&slots).is_err());
        assert!(failing(&slots).is_err());
        // Both slots came back: a third request does not wait.
        assert!(slots.acquire().waited < Duration::from_secs(1));
    }
}
