//! Per-rank request counters: how many LLM requests a rank served and how
//! many it is serving right now, so tests can observe load balancing and
//! concurrency from outside (`mock.inflight` in answers, GET /mock/stats),
//! plus the prompt tokens it saw, how many the prefix cache held, and the
//! longest queueing behind `--max-concurrency`.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one (possibly internal) rank.
#[derive(Debug, Default)]
pub struct RankStats {
    /// LLM requests started since start / the last reset.
    requests: AtomicU64,
    /// LLM requests being handled right now.
    inflight: AtomicU64,
    /// Highest `inflight` seen since start / the last reset.
    max_inflight: AtomicU64,
    /// Prompt tokens of the requests served.
    prompt_tokens: AtomicU64,
    /// Of those, tokens found in the rank's prefix cache.
    cached_tokens: AtomicU64,
    /// Longest wait for a `--max-concurrency` slot, microseconds.
    max_queue_us: AtomicU64,
}

/// A point-in-time copy of `RankStats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub requests: u64,
    pub inflight: u64,
    pub max_inflight: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub max_queue_us: u64,
}

impl RankStats {
    /// Registers a request starting on this rank. It stays in flight until
    /// the returned guard is dropped, which happens on every path out of the
    /// handler (success, I/O error, early return), so the gauge cannot leak.
    pub fn enter(&self) -> InflightGuard<'_> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let inflight = self.inflight.fetch_add(1, Ordering::SeqCst) + 1;
        let max_inflight = self
            .max_inflight
            .fetch_max(inflight, Ordering::SeqCst)
            .max(inflight);
        InflightGuard {
            stats: self,
            inflight,
            max_inflight,
        }
    }

    /// Records how a request was served: its prompt, the cached part of it,
    /// and how long it queued for a slot.
    pub fn record_service(&self, prompt_tokens: u64, cached_tokens: u64, queue_us: u64) {
        self.prompt_tokens
            .fetch_add(prompt_tokens, Ordering::SeqCst);
        self.cached_tokens
            .fetch_add(cached_tokens, Ordering::SeqCst);
        self.max_queue_us.fetch_max(queue_us, Ordering::SeqCst);
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            requests: self.requests.load(Ordering::SeqCst),
            inflight: self.inflight.load(Ordering::SeqCst),
            max_inflight: self.max_inflight.load(Ordering::SeqCst),
            prompt_tokens: self.prompt_tokens.load(Ordering::SeqCst),
            cached_tokens: self.cached_tokens.load(Ordering::SeqCst),
            max_queue_us: self.max_queue_us.load(Ordering::SeqCst),
        }
    }

    /// Zeroes the request count and restarts the maximum. `inflight` is a
    /// live gauge owned by the guards, so it is left alone (zeroing it would
    /// underflow when the running requests finish); the maximum restarts from
    /// it, i.e. from 0 when the rank is idle.
    pub fn reset(&self) {
        self.requests.store(0, Ordering::SeqCst);
        self.prompt_tokens.store(0, Ordering::SeqCst);
        self.cached_tokens.store(0, Ordering::SeqCst);
        self.max_queue_us.store(0, Ordering::SeqCst);
        let now = self.inflight.load(Ordering::SeqCst);
        self.max_inflight.store(now, Ordering::SeqCst);
    }
}

/// Keeps one request counted in `RankStats::inflight` while alive.
#[derive(Debug)]
pub struct InflightGuard<'a> {
    stats: &'a RankStats,
    /// In-flight requests on the rank when this one arrived, itself included.
    pub inflight: u64,
    /// The rank's maximum in-flight count right after this one arrived.
    pub max_inflight: u64,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.stats.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};
    use std::thread;

    fn snap(requests: u64, inflight: u64, max_inflight: u64) -> Snapshot {
        Snapshot {
            requests,
            inflight,
            max_inflight,
            ..Snapshot::default()
        }
    }

    #[test]
    fn guard_counts_itself_and_releases_on_drop() {
        let stats = RankStats::default();
        let first = stats.enter();
        assert_eq!((first.inflight, first.max_inflight), (1, 1));
        let second = stats.enter();
        assert_eq!((second.inflight, second.max_inflight), (2, 2));
        assert_eq!(stats.snapshot(), snap(2, 2, 2));
        drop(first);
        assert_eq!(stats.snapshot(), snap(2, 1, 2));
        let third = stats.enter();
        assert_eq!((third.inflight, third.max_inflight), (2, 2));
        drop(second);
        drop(third);
        assert_eq!(stats.snapshot(), snap(3, 0, 2));
    }

    #[test]
    fn guard_released_on_error_paths() {
        fn failing(stats: &RankStats) -> Result<(), String> {
            let _guard = stats.enter();
            let written: Result<(), String> = Err("write failed".into());
            written?;
            unreachable!("the write above fails");
        }
        let stats = RankStats::default();
        assert!(failing(&stats).is_err());
        assert!(failing(&stats).is_err());
        assert_eq!(stats.snapshot(), snap(2, 0, 1));
    }

    #[test]
    fn reset_keeps_running_requests() {
        let stats = RankStats::default();
        let running = stats.enter();
        drop(stats.enter());
        assert_eq!(stats.snapshot(), snap(2, 1, 2));
        stats.reset();
        assert_eq!(stats.snapshot(), snap(0, 1, 1));
        drop(running);
        assert_eq!(stats.snapshot(), snap(0, 0, 1));
        stats.reset();
        assert_eq!(stats.snapshot(), snap(0, 0, 0));
    }

    #[test]
    fn service_totals_and_reset() {
        let stats = RankStats::default();
        stats.record_service(100, 64, 30);
        stats.record_service(50, 0, 10);
        let s = stats.snapshot();
        assert_eq!(
            (s.prompt_tokens, s.cached_tokens, s.max_queue_us),
            (150, 64, 30)
        );
        stats.reset();
        assert_eq!(stats.snapshot(), snap(0, 0, 0));
    }

    #[test]
    fn concurrent_entries_reach_the_maximum() {
        const THREADS: usize = 8;
        let stats = Arc::new(RankStats::default());
        let all_in = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let stats = Arc::clone(&stats);
                let all_in = Arc::clone(&all_in);
                thread::spawn(move || {
                    let guard = stats.enter();
                    all_in.wait();
                    // Everyone has entered and nobody leaves before all looked.
                    assert_eq!(stats.snapshot().inflight, THREADS as u64);
                    all_in.wait();
                    guard.inflight
                })
            })
            .collect();
        let mut seen: Vec<u64> = handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (1..=THREADS as u64).collect::<Vec<_>>());
        assert_eq!(stats.snapshot(), snap(THREADS as u64, 0, THREADS as u64));
    }
}
