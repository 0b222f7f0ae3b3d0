//! Shared per-rank state: in-flight request counts and failure cool-downs, in one shared-data key
//! so that one read gives an assigner the whole picture.
//!
//! Value layout: `dp_size` records of 8 bytes, `inflight: u32 LE | down_until: u32 LE (unix s)`.
//! Anything that does not decode (wrong length after a `dp_size` change, garbage) reads as all
//! zeros: idle and usable. Counts saturate at zero: a release that finds nothing to release (after
//! a restart of the store, say) never drives a count negative.

use crate::table::{Store, StoreError};

/// One rank's shared state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankLoad {
    pub inflight: u32,
    pub down_until: u32,
}

/// All ranks' state, as read from the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankStates {
    pub ranks: Vec<RankLoad>,
}

impl RankStates {
    fn decode(bytes: &[u8], dp_size: usize) -> RankStates {
        let mut ranks = vec![RankLoad::default(); dp_size];
        if bytes.len() == dp_size * 8 {
            for (r, chunk) in ranks.iter_mut().zip(bytes.chunks_exact(8)) {
                let word = |i: usize| {
                    let mut b = [0u8; 4];
                    b.copy_from_slice(&chunk[i..i + 4]);
                    u32::from_le_bytes(b)
                };
                *r = RankLoad {
                    inflight: word(0),
                    down_until: word(4),
                };
            }
        }
        RankStates { ranks }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.ranks.len() * 8);
        for r in &self.ranks {
            out.extend_from_slice(&r.inflight.to_le_bytes());
            out.extend_from_slice(&r.down_until.to_le_bytes());
        }
        out
    }

    /// Whether `rank` may receive new work at `now`.
    pub fn usable(&self, rank: u32, now: u32) -> bool {
        self.ranks
            .get(rank as usize)
            .is_some_and(|r| r.down_until <= now)
    }

    /// Sum of in-flight requests over the usable ranks, and how many ranks are usable.
    pub fn usable_load(&self, now: u32) -> (u64, u32) {
        let mut total = 0u64;
        let mut usable = 0u32;
        for r in self.ranks.iter().filter(|r| r.down_until <= now) {
            total += u64::from(r.inflight);
            usable += 1;
        }
        (total, usable)
    }

    pub fn inflight(&self, rank: u32) -> u32 {
        self.ranks.get(rank as usize).map_or(0, |r| r.inflight)
    }
}

/// The shared rank-state key of one filter configuration.
#[derive(Debug, Clone)]
pub struct RankBoard {
    key: String,
    dp_size: usize,
    cas_retries: u32,
}

/// What a read-modify-write cost, for the counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BoardEvents {
    pub cas_retries: u32,
    pub cas_exhausted: u32,
}

impl RankBoard {
    pub fn new(namespace: &str, dp_size: u32, cas_retries: u32) -> RankBoard {
        RankBoard {
            key: format!("{namespace}/ranks/{dp_size}"),
            dp_size: dp_size as usize,
            cas_retries,
        }
    }

    /// Reads the current state (one store read).
    pub fn read(&self, store: &dyn Store) -> RankStates {
        let (value, _) = store.get(&self.key);
        RankStates::decode(value.as_deref().unwrap_or(&[]), self.dp_size)
    }

    /// Reads the state, lets `choose` pick a rank from it, and counts one more request in flight
    /// on that rank, atomically: a lost race re-reads and chooses again, so two workers never
    /// both take the last free slot of a rank. Returns the rank chosen (if any) and the events.
    pub fn acquire(
        &self,
        store: &dyn Store,
        mut choose: impl FnMut(&RankStates) -> Option<u32>,
    ) -> (Option<u32>, BoardEvents) {
        let mut chosen = None;
        let events = self.update(store, |states| {
            chosen = choose(states);
            match chosen.and_then(|r| states.ranks.get_mut(r as usize)) {
                Some(r) => {
                    r.inflight = r.inflight.saturating_add(1);
                    true
                }
                None => false,
            }
        });
        if events.cas_exhausted > 0 {
            // Not counted, so not routed as counted: the caller falls back without a slot.
            return (None, events);
        }
        (chosen, events)
    }

    /// Counts one request on `rank` as finished (never below zero).
    pub fn release(&self, store: &dyn Store, rank: u32) -> BoardEvents {
        self.update(store, |states| match states.ranks.get_mut(rank as usize) {
            Some(r) if r.inflight > 0 => {
                r.inflight -= 1;
                true
            }
            _ => false,
        })
    }

    /// Takes `rank` out of every assigner's choice until `until` (unix seconds).
    pub fn mark_down(&self, store: &dyn Store, rank: u32, until: u32) -> BoardEvents {
        self.update(store, |states| match states.ranks.get_mut(rank as usize) {
            Some(r) if r.down_until < until => {
                r.down_until = until;
                true
            }
            _ => false,
        })
    }

    fn update(
        &self,
        store: &dyn Store,
        mut change: impl FnMut(&mut RankStates) -> bool,
    ) -> BoardEvents {
        let mut events = BoardEvents::default();
        for attempt in 0..=self.cas_retries {
            let (value, cas) = store.get(&self.key);
            let mut states = RankStates::decode(value.as_deref().unwrap_or(&[]), self.dp_size);
            if !change(&mut states) {
                return events;
            }
            match store.set(&self.key, &states.encode(), cas) {
                Ok(()) => return events,
                Err(StoreError::CasMismatch) if attempt < self.cas_retries => {
                    events.cas_retries += 1
                }
                Err(_) => break,
            }
        }
        events.cas_exhausted += 1;
        events
    }

    /// Creates the key if missing, so later writes are real compare-and-swaps.
    pub fn ensure(&self, store: &dyn Store) {
        if store.get(&self.key).0.is_none() {
            let zero = RankStates {
                ranks: vec![RankLoad::default(); self.dp_size],
            };
            let _ = store.set(&self.key, &zero.encode(), None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::tests::MemStore;

    #[test]
    fn acquire_release_never_negative() {
        let s = MemStore::default();
        let b = RankBoard::new("t", 4, 3);
        b.ensure(&s);
        let (r, _) = b.acquire(&s, |_| Some(2));
        assert_eq!(r, Some(2));
        assert_eq!(b.read(&s).inflight(2), 1);
        b.release(&s, 2);
        b.release(&s, 2);
        b.release(&s, 9);
        assert_eq!(b.read(&s).inflight(2), 0);
        let (none, _) = b.acquire(&s, |_| None);
        assert_eq!(none, None);
        assert_eq!(b.read(&s).usable_load(0), (0, 4));
    }

    #[test]
    fn cooldown_makes_a_rank_unusable_until_it_ends() {
        let s = MemStore::default();
        let b = RankBoard::new("t", 4, 3);
        b.mark_down(&s, 1, 110);
        let st = b.read(&s);
        assert!(!st.usable(1, 100));
        assert!(st.usable(1, 110));
        assert!(st.usable(0, 100));
        assert!(!st.usable(7, 100), "out of range is never usable");
        assert_eq!(st.usable_load(100), (0, 3));
        // An earlier deadline does not shorten a later one.
        b.mark_down(&s, 1, 105);
        assert!(!b.read(&s).usable(1, 108));
    }

    #[test]
    fn garbage_reads_as_idle() {
        let s = MemStore::default();
        let b = RankBoard::new("t", 4, 3);
        s.raw_set("t/ranks/4", vec![0xff; 13]);
        assert_eq!(b.read(&s).usable_load(0), (0, 4));
        let (r, _) = b.acquire(&s, |_| Some(0));
        assert_eq!(r, Some(0));
        assert_eq!(b.read(&s).inflight(0), 1);
    }

    #[test]
    fn lost_race_rechooses_on_fresh_state() {
        let s = MemStore::default();
        let b = RankBoard::new("t", 2, 3);
        b.ensure(&s);
        let rival = b.clone();
        *s.rival.borrow_mut() = Some(Box::new(move |store: &MemStore, _k: &str| {
            // Another worker takes rank 0 meanwhile.
            let mut st = rival.read(store);
            st.ranks[0].inflight += 5;
            store.raw_set("t/ranks/2", st.encode());
        }));
        s.lose_races.set(1);
        let mut seen = Vec::new();
        let (r, ev) = b.acquire(&s, |st| {
            seen.push(st.inflight(0));
            // Least loaded of the two.
            Some(if st.inflight(0) <= st.inflight(1) {
                0
            } else {
                1
            })
        });
        assert_eq!(ev.cas_retries, 1);
        assert_eq!(seen, vec![0, 5]);
        assert_eq!(r, Some(1));
        let st = b.read(&s);
        assert_eq!((st.inflight(0), st.inflight(1)), (5, 1));
    }

    #[test]
    fn exhausted_retries_take_no_slot() {
        let s = MemStore::default();
        let b = RankBoard::new("t", 2, 2);
        s.lose_races.set(100);
        let (r, ev) = b.acquire(&s, |_| Some(0));
        assert_eq!((r, ev.cas_exhausted), (None, 1));
    }
}
