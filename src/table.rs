//! The affinity table: routing-key hash → rank, bounded, in a key-value store with
//! compare-and-swap (Envoy shared data in production, an in-memory map in tests).
//!
//! Layout: `buckets` store keys, each holding up to `ways` entries of 16 bytes:
//! `key_hash: u64 LE | last_used: u32 LE (unix seconds) | rank and tag: u16 LE | flags: u16 LE`,
//! the rank in the low 12 bits (`dp_size` is at most 4096) and a 4-bit tag above it, which the
//! prefix index uses to remember how a conversation was anchored (0 for the affinity table's
//! keys, and in entries written before tags existed).
//! The affinity table writes no flags; the prefix index marks positions other prompts branched
//! from ([`FLAG_BRANCHED`]), where prompts ended ([`FLAG_END`]), prompt ends one prompt went on
//! from ([`FLAG_CONTINUED`]) and the other ranks known to hold them ([`holder_flag`]). Entries
//! written before flags existed read as flag-free. A bit that an older build gave a holder rank
//! reads differently in a newer one (rank 14's is now continued, rank 13's a prompt's end): at
//! worst one more prompt is taken for that prompt's next turn.
//! Memory is therefore `buckets × ways × 16` bytes of values whatever clients send.
//! A bucket whose bytes do not decode (wrong length, garbage) reads as empty and is rewritten on the
//! next pin: corruption can cost pins, never a panic or a wrong rank out of range.

use crate::clock::plausible_stamp;
use crate::config_sections::TableConfig;

/// Result of a read from the store: value and its compare-and-swap token. `(None, None)`: the key
/// is missing; [`READ_FAILED`]: the store could not read it.
pub type Stored = (Option<Vec<u8>>, Option<u32>);

/// A compare-and-swap token no key holds (Envoy hands tokens out in turn, this one once every
/// 2^32 writes): a write with it fails on an existing key and creates a missing one, as a write
/// with any token does.
pub const NO_KEY_TOKEN: u32 = u32::MAX;

/// What a store's `get` returns when the host failed the read (not a missing key): no value, and
/// [`NO_KEY_TOKEN`], so that a write made with it fails as a lost race would instead of
/// overwriting the key unconditionally (every VM's column of the load board, the other pins of a
/// bucket).
pub const READ_FAILED: Stored = (None, Some(NO_KEY_TOKEN));

/// Why a store write failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// Someone else wrote the key since we read it.
    CasMismatch,
    /// Anything else the host reported.
    Other,
}

/// A key-value store with compare-and-swap, as Envoy shared data provides.
pub trait Store {
    fn get(&self, key: &str) -> Stored;
    /// Writes `value` if the key's CAS token still equals `cas` (`None` = unconditional).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

const ENTRY: usize = 16;

/// Entry flag: a prompt continued past this prefix-index position after a lookup stopped there,
/// so a request whose match stops here shares only this prefix with others (see `prefix_index`).
pub const FLAG_BRANCHED: u16 = 1;

/// Ranks below this have a holder flag.
pub const HOLDER_RANKS: u32 = 13;

/// Entry flag: a prompt ended at this prefix-index position (or one before its end), so the
/// first prompt to go on past it may be that prompt's next turn: it marks it
/// [`FLAG_CONTINUED`], not [`FLAG_BRANCHED`] (see `prefix_index`).
pub const FLAG_END: u16 = 1 << 14;

/// Entry flag: one prompt went on past this prefix-index position, where the prompt that
/// recorded it ended; the next to go on past it marks it [`FLAG_BRANCHED`] (see
/// `prefix_index`).
pub const FLAG_CONTINUED: u16 = 1 << 15;

/// Entry flag: rank `rank` (besides the entry's own) holds the prefix. Ranks from
/// [`HOLDER_RANKS`] on have none (0): between [`FLAG_BRANCHED`] and [`FLAG_END`] the flags
/// field has 13 bits to spare.
pub fn holder_flag(rank: u32) -> u16 {
    if rank < HOLDER_RANKS {
        1 << (rank + 1)
    } else {
        0
    }
}

/// The ranks whose holder flag is set in `flags`, ascending.
pub fn holders(flags: u16) -> impl Iterator<Item = u32> {
    (0..HOLDER_RANKS).filter(move |&r| flags & holder_flag(r) != 0)
}

/// The rank's bits in an entry's rank field; the bits above hold its tag.
const RANK_BITS: u32 = 12;
const RANK_MASK: u16 = (1 << RANK_BITS) - 1;
/// Ranks an entry can hold (`0..RANKS_HELD`): the configuration's `dp_size` limit must not
/// exceed it.
pub const RANKS_HELD: u32 = 1 << RANK_BITS;

/// The largest tag an entry holds (4 bits).
pub const MAX_TAG: u8 = 15;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    hash: u64,
    last_used: u32,
    /// At most [`RANK_MASK`].
    rank: u16,
    /// At most [`MAX_TAG`].
    tag: u8,
    flags: u16,
}

impl Entry {
    fn decode(b: &[u8]) -> Option<Entry> {
        let hash = u64::from_le_bytes(b.get(0..8)?.try_into().ok()?);
        let last_used = u32::from_le_bytes(b.get(8..12)?.try_into().ok()?);
        let rank_and_tag = u16::from_le_bytes(b.get(12..14)?.try_into().ok()?);
        let flags = u16::from_le_bytes(b.get(14..16)?.try_into().ok()?);
        Some(Entry {
            hash,
            last_used,
            rank: rank_and_tag & RANK_MASK,
            tag: (rank_and_tag >> RANK_BITS) as u8,
            flags,
        })
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.hash.to_le_bytes());
        out.extend_from_slice(&self.last_used.to_le_bytes());
        let rank_and_tag =
            (self.rank & RANK_MASK) | (u16::from(self.tag.min(MAX_TAG)) << RANK_BITS);
        out.extend_from_slice(&rank_and_tag.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
    }
}

/// The most entries a bucket holds (`ways` is at most this).
pub const MAX_WAYS: u32 = 64;

/// Decodes a bucket; anything that is not a whole number of entries reads as empty. A bucket
/// written with more `ways` than this table has (before a reload that lowered them) keeps its
/// `ways` most recently used entries, in their order: entries are appended as they come, so the
/// first ones are the oldest.
fn decode_bucket(bytes: &[u8], ways: usize) -> Vec<Entry> {
    if !bytes.len().is_multiple_of(ENTRY) {
        return Vec::new();
    }
    let mut entries: Vec<Entry> = bytes
        .chunks_exact(ENTRY)
        .take(MAX_WAYS as usize)
        .filter_map(Entry::decode)
        .collect();
    while entries.len() > ways && remove_least_recently_used(&mut entries) {}
    entries
}

/// Removes the least recently used entry (the first of equal ones); false when there is none.
fn remove_least_recently_used(entries: &mut Vec<Entry>) -> bool {
    let lru = (0..entries.len()).min_by_key(|&i| entries[i].last_used);
    if let Some(i) = lru {
        entries.remove(i);
    }
    lru.is_some()
}

fn encode_bucket(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * ENTRY);
    for e in entries {
        e.encode_into(&mut out);
    }
    out
}

/// Appends `n` in decimal (what `format!` would do, without its machinery on the hot path).
fn push_decimal(out: &mut String, mut n: u32) {
    let mut digits = [0u8; 10];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &d in &digits[i..] {
        out.push(char::from(d));
    }
}

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// A live entry pins the key to `rank`.
    Hit { rank: u32 },
    /// No live entry (absent, expired, or on a rank outside `0..dp_size`).
    Miss,
    /// The bucket's bytes do not decode: read as empty (a miss), and counted.
    Undecodable,
}

/// Side effects worth counting, reported back to the caller (who owns the metrics).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TableEvents {
    /// Live entries pushed out to make room.
    pub evictions: u32,
    /// Compare-and-swap conflicts that caused a retry.
    pub cas_retries: u32,
    /// Writes abandoned after all retries lost.
    pub cas_exhausted: u32,
    /// Buckets whose bytes did not decode (read as empty, then rewritten).
    pub undecodable: u32,
}

impl TableEvents {
    pub fn add(&mut self, other: TableEvents) {
        self.evictions += other.evictions;
        self.cas_retries += other.cas_retries;
        self.cas_exhausted += other.cas_exhausted;
        self.undecodable += other.undecodable;
    }
}

/// The affinity table over a store. Cheap to build; holds no per-request state.
#[derive(Debug, Clone)]
pub struct AffinityTable {
    cfg: TableConfig,
    /// `"{namespace}/{buckets}/"`, computed once: a bucket key is this plus the index.
    key_prefix: String,
}

impl AffinityTable {
    pub fn new(cfg: TableConfig) -> Self {
        let key_prefix = format!("{}/{}/", cfg.namespace, cfg.buckets);
        AffinityTable { cfg, key_prefix }
    }

    /// Store key of bucket `idx`. The geometry is part of the name so a reload with another bucket
    /// count starts a fresh table instead of reading entries filed under the old modulus.
    pub fn bucket_key(&self, idx: u32) -> String {
        let mut key = String::with_capacity(self.key_prefix.len() + 10);
        key.push_str(&self.key_prefix);
        push_decimal(&mut key, idx);
        key
    }

    /// Bucket of a key hash: the high 32 bits, scaled to the bucket count (no modulo bias worth
    /// mentioning and no division).
    pub fn bucket_of(&self, hash: u64) -> u32 {
        (((hash >> 32) * u64::from(self.cfg.buckets)) >> 32) as u32
    }

    /// Creates every bucket that does not exist yet, as an empty value.
    ///
    /// Envoy's shared data ignores the CAS token when a key does not exist, so two workers creating
    /// the same bucket at once could overwrite each other's first entry. Creating all buckets up
    /// front (before traffic) means every later write is a real compare-and-swap.
    ///
    /// A marker key written last lets every later VM (each Envoy worker runs its own) skip the
    /// walk over all buckets: one read instead of a write per bucket at start-up.
    pub fn ensure_buckets(&self, store: &dyn Store) -> u32 {
        let marker = format!("{}/{}/ready", self.cfg.namespace, self.cfg.buckets);
        if store.get(&marker).0.is_some() {
            return 0;
        }
        let mut created = 0;
        for idx in 0..self.cfg.buckets {
            let key = self.bucket_key(idx);
            // Creates the key only if it is missing: no read (which may fail) decides it.
            if store.set(&key, &[], Some(NO_KEY_TOKEN)).is_ok() {
                created += 1;
            }
        }
        let _ = store.set(&marker, b"1", None);
        created
    }

    /// Used within the TTL, and not stamped ahead of the clock (a stray stamp would be neither
    /// expired nor ever the least recently used).
    fn is_live(&self, e: &Entry, now: u32) -> bool {
        now.saturating_sub(e.last_used) < self.cfg.ttl_seconds && plausible_stamp(e.last_used, now)
    }

    /// Looks `hash` up; a hit whose recency is older than `refresh_seconds` is refreshed
    /// (one best-effort compare-and-swap: a lost race means someone else just wrote the bucket).
    pub fn lookup(&self, store: &dyn Store, hash: u64, now: u32, dp_size: u32) -> Lookup {
        self.lookup_flagged(store, hash, now, dp_size).0
    }

    /// [`lookup`](Self::lookup), with the hit's entry flags and tag (0 when there is no hit).
    pub fn lookup_flagged(
        &self,
        store: &dyn Store,
        hash: u64,
        now: u32,
        dp_size: u32,
    ) -> (Lookup, u16, u8) {
        let key = self.bucket_key(self.bucket_of(hash));
        let (value, cas) = store.get(&key);
        let Some(mut bytes) = value else {
            return (Lookup::Miss, 0, 0);
        };
        // Read the entries where they lie (the hot path: no decoding into a new vector).
        if !bytes.len().is_multiple_of(ENTRY) {
            return (Lookup::Undecodable, 0, 0);
        }
        // Every entry the bucket holds, also past `ways` (written before a reload lowered them:
        // the next write keeps the most recently used, see `decode_bucket`).
        let found = bytes
            .chunks_exact(ENTRY)
            .take(MAX_WAYS as usize)
            .position(|chunk| chunk.get(0..8) == Some(&hash.to_le_bytes()[..]));
        let Some(pos) = found else {
            return (Lookup::Miss, 0, 0);
        };
        let at = pos * ENTRY;
        let Some(e) = bytes.get(at..at + ENTRY).and_then(Entry::decode) else {
            return (Lookup::Miss, 0, 0);
        };
        if !self.is_live(&e, now) || u32::from(e.rank) >= dp_size {
            return (Lookup::Miss, 0, 0);
        }
        if now.saturating_sub(e.last_used) >= self.cfg.refresh_seconds.max(1) && cas.is_some() {
            // Rewrite only the timestamp, in the copy we already own.
            bytes[at + 8..at + 12].copy_from_slice(&now.to_le_bytes());
            let _ = store.set(&key, &bytes, cas);
        }
        let hit = Lookup::Hit {
            rank: u32::from(e.rank),
        };
        (hit, e.flags, e.tag)
    }

    /// Pins `hash` to `rank`, evicting the least recently used entry if the bucket is full.
    pub fn pin(&self, store: &dyn Store, hash: u64, rank: u32, now: u32) -> TableEvents {
        self.pin_with(store, hash, rank, 0, (u16::MAX, 0), now)
    }

    /// [`pin`](Self::pin), with `tag` (at most [`MAX_TAG`]) stored beside the rank, and
    /// [`FLAG_END`] set when `end` (cleared otherwise: like the tag, it tells what the last
    /// request to write the entry was; the entry's other flags are kept). A rank beyond the 12
    /// bits an entry holds is stored as 4095 (`dp_size` is at most 4096).
    pub fn pin_tagged(
        &self,
        store: &dyn Store,
        hash: u64,
        rank: u32,
        tag: u8,
        end: bool,
        now: u32,
    ) -> TableEvents {
        let end_flag = if end { FLAG_END } else { 0 };
        self.pin_with(store, hash, rank, tag, (!FLAG_END, end_flag), now)
    }

    /// [`pin`](Self::pin), with `tag` stored beside the rank and the entry's flags set to
    /// `flags` (a routing key's pin keeps no prefix flags: its flags field holds what the caller
    /// puts there).
    pub fn pin_flagged(
        &self,
        store: &dyn Store,
        hash: u64,
        rank: u32,
        tag: u8,
        flags: u16,
        now: u32,
    ) -> TableEvents {
        self.pin_with(store, hash, rank, tag, (0, flags), now)
    }

    /// Pins `hash` to `rank` with `tag`; `(keep, set)`: its flags become those it has that
    /// `keep` names (a live entry's; a new or expired one has none) and `set`.
    fn pin_with(
        &self,
        store: &dyn Store,
        hash: u64,
        rank: u32,
        tag: u8,
        (keep, set): (u16, u16),
        now: u32,
    ) -> TableEvents {
        let rank = u16::try_from(rank).map_or(RANK_MASK, |r| r.min(RANK_MASK));
        let tag = tag.min(MAX_TAG);
        self.update(store, hash, |entries, ways, events| {
            // A live entry keeps its flags: they describe the prompt, not the rank. An expired
            // one's describe prompts and caches of long ago (a branch, ranks that held it):
            // they go with it.
            if let Some(e) = entries.iter_mut().find(|e| e.hash == hash) {
                let kept = if self.is_live(e, now) { e.flags } else { 0 };
                e.flags = kept & keep | set;
                e.rank = rank;
                e.tag = tag;
                e.last_used = now;
                return true;
            }
            // Expired entries are dropped first: they hold no pin anyone can use.
            entries.retain(|e| self.is_live(e, now));
            if entries.len() >= ways && remove_least_recently_used(entries) {
                events.evictions += 1;
            }
            entries.push(Entry {
                hash,
                last_used: now,
                rank,
                tag,
                flags: set,
            });
            true
        })
    }

    /// Sets the bits of `flags` on the live entry of `hash`, if it lacks any (no write otherwise).
    pub fn mark(&self, store: &dyn Store, hash: u64, flags: u16, now: u32) -> TableEvents {
        self.update(store, hash, |entries, _, _| {
            match entries
                .iter_mut()
                .find(|e| e.hash == hash && self.is_live(e, now))
            {
                Some(e) if e.flags & flags != flags => {
                    e.flags |= flags;
                    true
                }
                _ => false,
            }
        })
    }

    /// Removes the pin of `hash` if it still points at `rank` (a newer pin elsewhere is kept).
    /// Returns whether a pin was removed, and the events.
    pub fn unpin(&self, store: &dyn Store, hash: u64, rank: u32) -> (bool, TableEvents) {
        let mut removed = false;
        let events = self.update(store, hash, |entries, _, _| {
            let before = entries.len();
            entries.retain(|e| !(e.hash == hash && u32::from(e.rank) == rank));
            removed = entries.len() != before;
            removed
        });
        // A write abandoned after lost races removed nothing.
        (removed && events.cas_exhausted == 0, events)
    }

    /// Read-modify-write of the bucket of `hash` with bounded compare-and-swap retries.
    /// `change` returns false when there is nothing to write.
    fn update(
        &self,
        store: &dyn Store,
        hash: u64,
        mut change: impl FnMut(&mut Vec<Entry>, usize, &mut TableEvents) -> bool,
    ) -> TableEvents {
        let key = self.bucket_key(self.bucket_of(hash));
        let ways = self.cfg.ways as usize;
        let mut events = TableEvents::default();
        for attempt in 0..=self.cfg.cas_retries {
            let (value, cas) = store.get(&key);
            let bytes = value.as_deref().unwrap_or(&[]);
            let mut entries = decode_bucket(bytes, ways);
            let mut attempt_events = TableEvents::default();
            if !bytes.len().is_multiple_of(ENTRY) {
                attempt_events.undecodable += 1;
            }
            if !change(&mut entries, ways, &mut attempt_events) {
                return events;
            }
            match store.set(&key, &encode_bucket(&entries), cas) {
                Ok(()) => {
                    events.add(attempt_events);
                    return events;
                }
                Err(StoreError::CasMismatch) if attempt < self.cfg.cas_retries => {
                    events.cas_retries += 1;
                }
                Err(_) => break,
            }
        }
        events.cas_exhausted += 1;
        events
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    /// Simulates another writer's change, run when a race is lost.
    pub type Rival = Box<dyn Fn(&MemStore, &str)>;

    /// In-memory store with Envoy's CAS semantics; can be told to lose the next N races.
    #[derive(Default)]
    pub struct MemStore {
        map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        next_cas: Cell<u32>,
        pub lose_races: Cell<u32>,
        /// Called between a lost race and the error: simulates the other writer's change.
        pub rival: RefCell<Option<Rival>>,
    }

    impl MemStore {
        pub fn raw_set(&self, key: &str, value: Vec<u8>) {
            let cas = self.next_cas.get() + 1;
            self.next_cas.set(cas);
            self.map.borrow_mut().insert(key.to_string(), (value, cas));
        }

        pub fn total_bytes(&self) -> usize {
            self.map.borrow().values().map(|(v, _)| v.len()).sum()
        }
    }

    impl Store for MemStore {
        fn get(&self, key: &str) -> Stored {
            match self.map.borrow().get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            }
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if self.lose_races.get() > 0 {
                self.lose_races.set(self.lose_races.get() - 1);
                if let Some(rival) = self.rival.borrow().as_ref() {
                    rival(self, key);
                }
                return Err(StoreError::CasMismatch);
            }
            let current = self.map.borrow().get(key).map(|(_, c)| *c);
            if let (Some(want), Some(have)) = (cas, current) {
                if want != have {
                    return Err(StoreError::CasMismatch);
                }
            }
            self.raw_set(key, value.to_vec());
            Ok(())
        }
    }

    /// A store whose reads all fail ([`READ_FAILED`]), over `MemStore`'s writes.
    pub struct FailingReads<'a>(pub &'a MemStore);

    impl Store for FailingReads<'_> {
        fn get(&self, _key: &str) -> Stored {
            READ_FAILED
        }

        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            self.0.set(key, value, cas)
        }
    }

    /// Every key's value (tokens aside).
    pub fn values(s: &MemStore) -> Vec<(String, Vec<u8>)> {
        let mut out: Vec<_> = s
            .map
            .borrow()
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect();
        out.sort();
        out
    }

    fn table(buckets: u32, ways: u32) -> AffinityTable {
        AffinityTable::new(TableConfig {
            buckets,
            ways,
            ttl_seconds: 100,
            refresh_seconds: 1,
            cas_retries: 3,
            namespace: "t".into(),
        })
    }

    #[test]
    fn pin_then_hit_then_unpin() {
        let (s, t) = (MemStore::default(), table(16, 4));
        assert_eq!(t.lookup(&s, 42, 1000, 4), Lookup::Miss);
        t.pin(&s, 42, 3, 1000);
        assert_eq!(t.lookup(&s, 42, 1001, 4), Lookup::Hit { rank: 3 });
        // Unpin for another rank keeps the pin; for its own rank removes it.
        assert!(!t.unpin(&s, 42, 1).0);
        assert_eq!(t.lookup(&s, 42, 1001, 4), Lookup::Hit { rank: 3 });
        assert!(t.unpin(&s, 42, 3).0);
        assert_eq!(t.lookup(&s, 42, 1001, 4), Lookup::Miss);
    }

    #[test]
    fn rank_outside_dp_size_is_a_miss() {
        let (s, t) = (MemStore::default(), table(1, 4));
        t.pin(&s, 7, 5, 10);
        assert_eq!(t.lookup(&s, 7, 10, 4), Lookup::Miss);
        assert_eq!(t.lookup(&s, 7, 10, 8), Lookup::Hit { rank: 5 });
    }

    #[test]
    fn ttl_expires_idle_entries_and_refresh_keeps_busy_ones() {
        let (s, t) = (MemStore::default(), table(1, 4));
        t.pin(&s, 1, 0, 1000);
        t.pin(&s, 2, 1, 1000);
        // Key 1 is used every 50 s, key 2 never again.
        for now in [1050, 1099, 1148] {
            assert_eq!(t.lookup(&s, 1, now, 4), Lookup::Hit { rank: 0 });
        }
        assert_eq!(t.lookup(&s, 2, 1148, 4), Lookup::Miss);
    }

    #[test]
    fn a_repin_keeps_a_live_entrys_flags_but_not_an_expired_ones() {
        let (s, t) = (MemStore::default(), table(1, 4));
        t.pin(&s, 42, 1, 1000);
        t.mark(&s, 42, FLAG_BRANCHED | holder_flag(2), 1000);
        t.pin(&s, 42, 3, 1050);
        let flags = |now| t.lookup_flagged(&s, 42, now, 4).1;
        assert_eq!(flags(1050), FLAG_BRANCHED | holder_flag(2));
        // Unused for the whole ttl (100 s): pinned again, it starts without flags.
        t.pin(&s, 42, 0, 1200);
        assert_eq!(
            t.lookup_flagged(&s, 42, 1200, 4),
            (Lookup::Hit { rank: 0 }, 0, 0)
        );
    }

    #[test]
    fn a_reload_with_fewer_ways_keeps_the_most_recently_used_entries() {
        let (s, wide) = (MemStore::default(), table(1, 4));
        for (i, h) in [1u64, 2, 3, 4].into_iter().enumerate() {
            wide.pin(&s, h, i as u32, 1000 + i as u32);
        }
        // Key 1, the oldest pin, was used last.
        assert_eq!(wide.lookup(&s, 1, 1050, 4), Lookup::Hit { rank: 0 });
        let narrow = table(1, 2);
        // The entries the bucket holds are still found until the next write (at 1050: no
        // refresh, which would make key 1 no more recent than the others).
        assert_eq!(narrow.lookup(&s, 1, 1050, 4), Lookup::Hit { rank: 0 });
        // The next write keeps the two most recently used (1 and 4, then 5 evicts the older).
        narrow.pin(&s, 5, 2, 1052);
        assert_eq!(narrow.lookup(&s, 5, 1052, 4), Lookup::Hit { rank: 2 });
        assert_eq!(narrow.lookup(&s, 1, 1052, 4), Lookup::Hit { rank: 0 });
        for h in [2, 3, 4] {
            assert_eq!(narrow.lookup(&s, h, 1052, 4), Lookup::Miss, "{h}");
        }
    }

    #[test]
    fn full_bucket_evicts_least_recently_used() {
        let (s, t) = (MemStore::default(), table(1, 2));
        t.pin(&s, 1, 0, 10);
        t.pin(&s, 2, 1, 11);
        assert_eq!(t.lookup(&s, 1, 12, 4), Lookup::Hit { rank: 0 }); // refreshes 1
        let ev = t.pin(&s, 3, 2, 13);
        assert_eq!(ev.evictions, 1);
        assert_eq!(t.lookup(&s, 2, 13, 4), Lookup::Miss);
        assert_eq!(t.lookup(&s, 1, 13, 4), Lookup::Hit { rank: 0 });
        assert_eq!(t.lookup(&s, 3, 13, 4), Lookup::Hit { rank: 2 });
    }

    #[test]
    fn expired_entries_make_room_without_counting_evictions() {
        let (s, t) = (MemStore::default(), table(1, 2));
        t.pin(&s, 1, 0, 10);
        t.pin(&s, 2, 1, 10);
        let ev = t.pin(&s, 3, 2, 500);
        assert_eq!(ev.evictions, 0);
        assert_eq!(t.lookup(&s, 3, 500, 4), Lookup::Hit { rank: 2 });
    }

    #[test]
    fn bound_holds_over_many_keys_and_most_recent_survive() {
        let (s, t) = (MemStore::default(), table(4, 2));
        t.ensure_buckets(&s);
        let hasher = crate::hash::KeyedHasher::from_seed(b"");
        let mut evictions = 0;
        for i in 0..1000u32 {
            let h = hasher.hash(format!("key-{i}").as_bytes());
            evictions += t.pin(&s, h, i % 4, 1000 + i).evictions;
        }
        assert!(
            s.total_bytes() <= 4 * 2 * ENTRY + 1,
            "8 entries plus the 1-byte ready marker"
        );
        assert_eq!(evictions, 1000 - 8);
        let last = hasher.hash(b"key-999");
        assert_eq!(t.lookup(&s, last, 2000, 4), Lookup::Hit { rank: 3 });
        let first = hasher.hash(b"key-0");
        assert_eq!(t.lookup(&s, first, 2000, 4), Lookup::Miss);
    }

    #[test]
    fn failed_reads_overwrite_nothing() {
        let (s, t) = (MemStore::default(), table(2, 4));
        t.ensure_buckets(&s);
        for hash in 1..=3u64 {
            t.pin(&s, hash << 33, hash as u32, 10);
        }
        let before = values(&s);
        let failing = FailingReads(&s);
        // The marker cannot be read: the walk over the buckets runs again, creating none.
        t.ensure_buckets(&failing);
        assert_eq!(t.lookup(&failing, 1 << 33, 11, 4), Lookup::Miss);
        let pinned = t.pin(&failing, 7 << 33, 3, 11);
        assert_eq!(pinned.cas_exhausted, 1, "{pinned:?}");
        assert!(!t.unpin(&failing, 1 << 33, 1).0);
        assert_eq!(values(&s), before, "a failed read let a write through");
        assert_eq!(t.lookup(&s, 1 << 33, 11, 4), Lookup::Hit { rank: 1 });
    }

    #[test]
    fn lost_races_retry_and_keep_the_rivals_write() {
        let (s, t) = (MemStore::default(), table(1, 4));
        t.ensure_buckets(&s);
        // The rival pins key 99 in the same bucket while we are between read and write.
        let rival_table = t.clone();
        *s.rival.borrow_mut() = Some(Box::new(move |store: &MemStore, _key: &str| {
            let key = rival_table.bucket_key(0);
            let mut v = store.get(&key).0.unwrap_or_default();
            Entry {
                hash: 99,
                last_used: 5,
                rank: 1,
                tag: 0,
                flags: 0,
            }
            .encode_into(&mut v);
            store.raw_set(&key, v);
        }));
        s.lose_races.set(1);
        let ev = t.pin(&s, 42, 2, 5);
        assert_eq!((ev.cas_retries, ev.cas_exhausted), (1, 0));
        assert_eq!(t.lookup(&s, 42, 5, 4), Lookup::Hit { rank: 2 });
        assert_eq!(t.lookup(&s, 99, 5, 4), Lookup::Hit { rank: 1 });
    }

    #[test]
    fn retries_are_bounded() {
        let (s, t) = (MemStore::default(), table(1, 4));
        s.lose_races.set(100);
        let ev = t.pin(&s, 42, 2, 5);
        assert_eq!((ev.cas_retries, ev.cas_exhausted), (3, 1));
    }

    #[test]
    fn garbage_buckets_read_as_empty_and_are_repaired() {
        let (s, t) = (MemStore::default(), table(1, 4));
        let key = t.bucket_key(0);
        for garbage in [vec![1u8; 15], vec![0xff; 17], vec![7u8; 3]] {
            s.raw_set(&key, garbage);
            assert_eq!(t.lookup(&s, 42, 5, 4), Lookup::Undecodable);
            assert_eq!(t.pin(&s, 42, 1, 5).undecodable, 1);
            assert_eq!(t.lookup(&s, 42, 5, 4), Lookup::Hit { rank: 1 });
        }
        // More entries than ways (e.g. after a reload with fewer ways): all are found until the
        // next write, which keeps `ways` of them.
        let mut big = Vec::new();
        for i in 0..10u64 {
            Entry {
                hash: i,
                last_used: 5,
                rank: 0,
                tag: 0,
                flags: 0,
            }
            .encode_into(&mut big);
        }
        s.raw_set(&key, big);
        assert_eq!(t.lookup(&s, 3, 5, 4), Lookup::Hit { rank: 0 });
        assert_eq!(t.lookup(&s, 8, 5, 4), Lookup::Hit { rank: 0 });
        t.pin(&s, 42, 1, 6);
        let kept = s.get(&key).0.map_or(0, |b| b.len() / ENTRY);
        assert_eq!(kept, t.cfg.ways as usize);
    }

    /// Entries stamped ahead of the clock (a stray value) neither expired nor were ever the
    /// least recently used: three of them left a four-way bucket one pin.
    #[test]
    fn entries_stamped_ahead_of_the_clock_are_expired() {
        let (s, t) = (MemStore::default(), table(1, 4));
        let mut stray = Vec::new();
        for hash in 1000..1003u64 {
            Entry {
                hash,
                last_used: u32::MAX,
                rank: 0,
                tag: 0,
                flags: 0,
            }
            .encode_into(&mut stray);
        }
        s.raw_set(&t.bucket_key(0), stray);
        assert_eq!(t.lookup(&s, 1000, 10, 4), Lookup::Miss);
        t.pin(&s, 1, 1, 10);
        t.pin(&s, 2, 2, 11);
        assert_eq!(t.lookup(&s, 1, 20, 4), Lookup::Hit { rank: 1 });
        assert_eq!(t.lookup(&s, 2, 20, 4), Lookup::Hit { rank: 2 });
        // A stamp a worker's tick ahead is the clock's own.
        t.pin(&s, 3, 3, 30);
        assert_eq!(t.lookup(&s, 3, 29, 4), Lookup::Hit { rank: 3 });
    }

    #[test]
    fn a_tag_is_kept_beside_the_rank_and_replaced_by_a_repin() {
        let (s, t) = (MemStore::default(), table(1, 4));
        t.pin_tagged(&s, 42, 4095, 9, false, 5);
        t.mark(&s, 42, FLAG_BRANCHED, 5);
        assert_eq!(
            t.lookup_flagged(&s, 42, 5, 4096),
            (Lookup::Hit { rank: 4095 }, FLAG_BRANCHED, 9)
        );
        // The tag does not count as rank bits: out of range stays out of range, unpin matches.
        assert_eq!(t.lookup(&s, 42, 5, 4095), Lookup::Miss);
        // A repin replaces the tag (and keeps the flags); an untagged pin writes 0; a tag or rank
        // beyond the field's bits is clamped, never spills into the other.
        t.pin_tagged(&s, 42, 2, 99, true, 6);
        assert_eq!(
            t.lookup_flagged(&s, 42, 6, 4),
            (Lookup::Hit { rank: 2 }, FLAG_BRANCHED | FLAG_END, MAX_TAG)
        );
        // The end flag, like the tag, tells what the last write was: a repin that is not at a
        // prompt's end clears it (and keeps the other flags), as a plain pin keeps it.
        t.pin(&s, 42, 2, 6);
        assert_eq!(t.lookup_flagged(&s, 42, 6, 4).1, FLAG_BRANCHED | FLAG_END);
        t.pin_tagged(&s, 42, 2, 1, false, 6);
        assert_eq!(t.lookup_flagged(&s, 42, 6, 4).1, FLAG_BRANCHED);
        t.pin(&s, 42, 1, 7);
        assert_eq!(t.lookup_flagged(&s, 42, 7, 4).2, 0);
        t.pin_tagged(&s, 43, 70_000, 3, false, 7);
        assert_eq!(
            t.lookup_flagged(&s, 43, 7, 4096),
            (Lookup::Hit { rank: 4095 }, 0, 3)
        );
        assert!(t.unpin(&s, 43, 4095).0);
        // Entries written before tags existed (rank field < 4096) read with tag 0.
        assert_eq!(
            t.lookup_flagged(&s, 42, 7, 4),
            (Lookup::Hit { rank: 1 }, FLAG_BRANCHED, 0)
        );
    }

    #[test]
    fn flags_are_set_once_and_survive_repins() {
        let (s, t) = (MemStore::default(), table(1, 4));
        // Nothing to mark: no entry, so no write.
        assert_eq!(t.mark(&s, 42, FLAG_BRANCHED, 5), TableEvents::default());
        assert!(s.get(&t.bucket_key(0)).0.is_none());
        t.pin(&s, 42, 1, 5);
        t.pin(&s, 43, 2, 5);
        assert_eq!(
            t.lookup_flagged(&s, 42, 5, 4),
            (Lookup::Hit { rank: 1 }, 0, 0)
        );
        t.mark(&s, 42, FLAG_BRANCHED, 5);
        assert_eq!(
            t.lookup_flagged(&s, 42, 5, 4),
            (Lookup::Hit { rank: 1 }, FLAG_BRANCHED, 0)
        );
        assert_eq!(
            t.lookup_flagged(&s, 43, 5, 4),
            (Lookup::Hit { rank: 2 }, 0, 0)
        );
        // Already set: no write (the CAS token does not move).
        let cas = s.get(&t.bucket_key(0)).1;
        t.mark(&s, 42, FLAG_BRANCHED, 5);
        assert_eq!(s.get(&t.bucket_key(0)).1, cas);
        // A re-pin (even to another rank) keeps the flag; a miss reports none.
        t.pin(&s, 42, 3, 6);
        assert_eq!(
            t.lookup_flagged(&s, 42, 6, 4),
            (Lookup::Hit { rank: 3 }, FLAG_BRANCHED, 0)
        );
        assert_eq!(t.lookup_flagged(&s, 42, 6, 3), (Lookup::Miss, 0, 0));
        // An expired entry is not marked.
        t.pin(&s, 44, 0, 0);
        t.mark(&s, 44, FLAG_BRANCHED, 10_000);
        assert_eq!(
            t.lookup_flagged(&s, 44, 1, 4),
            (Lookup::Hit { rank: 0 }, 0, 0)
        );
    }

    #[test]
    fn holder_flags_name_ranks_below_thirteen() {
        assert_eq!(holder_flag(0), 2);
        assert_eq!(holder_flag(12), 1 << 13);
        assert_eq!(holder_flag(13), 0);
        assert_eq!(holder_flag(u32::MAX), 0);
        let flags = FLAG_BRANCHED | FLAG_END | FLAG_CONTINUED | holder_flag(3) | holder_flag(12);
        assert_eq!(holders(flags).collect::<Vec<_>>(), vec![3, 12]);
        assert_eq!(
            holders(FLAG_BRANCHED | FLAG_END | FLAG_CONTINUED).count(),
            0
        );
        // Several bits at once, and a second mark with one new bit writes again.
        let (s, t) = (MemStore::default(), table(1, 4));
        t.pin(&s, 42, 1, 5);
        t.mark(&s, 42, FLAG_BRANCHED | holder_flag(2), 5);
        let cas = s.get(&t.bucket_key(0)).1;
        t.mark(&s, 42, holder_flag(2), 5);
        assert_eq!(s.get(&t.bucket_key(0)).1, cas, "nothing new: no write");
        t.mark(&s, 42, holder_flag(2) | holder_flag(0), 5);
        assert_eq!(
            t.lookup_flagged(&s, 42, 5, 4).1,
            FLAG_BRANCHED | holder_flag(0) | holder_flag(2)
        );
    }

    #[test]
    fn buckets_are_created_once() {
        let (s, t) = (MemStore::default(), table(8, 2));
        assert_eq!(t.ensure_buckets(&s), 8);
        assert_eq!(t.ensure_buckets(&s), 0);
        for idx in 0..8 {
            assert_eq!(s.get(&t.bucket_key(idx)).0.as_deref(), Some(&[][..]));
        }
    }

    #[test]
    fn bucket_keys_name_namespace_geometry_and_index() {
        let t = table(16, 4);
        assert_eq!(t.bucket_key(0), "t/16/0");
        assert_eq!(t.bucket_key(u32::MAX), "t/16/4294967295");
        assert_eq!(t.bucket_key(1234), "t/16/1234");
    }

    #[test]
    fn bucket_index_is_in_range() {
        let t = table(7, 1);
        for h in [0, u64::MAX, 1 << 63, 0xdead_beef_dead_beef] {
            assert!(t.bucket_of(h) < 7);
        }
    }
}
