//! A bucket holding arbitrary bytes (shared data is shared: anything may be there): lookup, pin
//! and unpin never panic, never return a rank outside `0..dp_size`, and a pin repairs the bucket
//! (whole entries, at most `ways`, holding the new pin).
//!
//! Input: 12 bytes of parameters (ways, dp_size, ttl, refresh, buckets, key hash), then the
//! bucket's bytes.

#![no_main]

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use dp_affinity::config_sections::TableConfig;
use dp_affinity::table::{AffinityTable, Lookup, Store, StoreError, Stored};
use libfuzzer_sys::fuzz_target;

/// Envoy shared-data semantics: CAS token per key, a missing key ignores the token.
#[derive(Default)]
struct MemStore {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    token: Cell<u32>,
}

impl Store for MemStore {
    fn get(&self, key: &str) -> Stored {
        match self.map.borrow().get(key) {
            Some((v, t)) => (Some(v.clone()), Some(*t)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let current = self.map.borrow().get(key).map(|(_, t)| *t);
        if let (Some(want), Some(have)) = (cas, current) {
            if want != have {
                return Err(StoreError::CasMismatch);
            }
        }
        self.token.set(self.token.get() + 1);
        self.map
            .borrow_mut()
            .insert(key.to_string(), (value.to_vec(), self.token.get()));
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 12 {
        return;
    }
    let ways = u32::from(data[0] % 8) + 1;
    let dp_size = u32::from(data[1] % 8) + 1;
    let rank = u32::from(data[1] >> 4) % dp_size;
    let ttl = u32::from(data[2] % 50) + 1;
    let refresh = u32::from(data[3] % 4);
    let hash = u64::from_le_bytes(data[4..12].try_into().expect("8 bytes"));
    let buckets = u32::from(data[3] >> 4) % 4 + 1;
    let garbage = &data[12..];
    let now = 1_000 + u32::from(data[2]);

    let table = AffinityTable::new(TableConfig {
        buckets,
        ways,
        ttl_seconds: ttl,
        refresh_seconds: refresh,
        cas_retries: 2,
        namespace: "fuzz".into(),
    });
    let store = MemStore::default();
    table.ensure_buckets(&store);
    let key = table.bucket_key(table.bucket_of(hash));
    store.set(&key, garbage, None).expect("unconditional write");

    // Whatever the bytes, a lookup is a miss (or `Undecodable`) or a hit in range, for our key
    // and for every hash the garbage names.
    let mut probes = vec![hash];
    probes.extend(
        garbage
            .chunks_exact(16)
            .map(|c| u64::from_le_bytes(c[0..8].try_into().expect("8 bytes"))),
    );
    for &h in &probes {
        if let Lookup::Hit { rank } = table.lookup(&store, h, now, dp_size) {
            assert!(rank < dp_size);
        }
    }

    // A pin repairs the bucket and is then found.
    let ev = table.pin(&store, hash, rank, now);
    assert_eq!(ev.cas_exhausted, 0, "no rival: the first write lands");
    let bytes = store.get(&key).0.expect("bucket exists");
    assert_eq!(bytes.len() % 16, 0, "repaired bucket is whole entries");
    assert!(
        bytes.len() <= ways as usize * 16,
        "repaired bucket within ways"
    );
    assert_eq!(
        table.lookup(&store, hash, now, dp_size),
        Lookup::Hit { rank }
    );

    // Unpin removes it (another entry with the same hash and another rank may remain).
    let (removed, ev) = table.unpin(&store, hash, rank);
    assert!(removed && ev.cas_exhausted == 0);
    match table.lookup(&store, hash, now, dp_size) {
        Lookup::Hit { rank: r } => assert!(r != rank && r < dp_size),
        other => assert_eq!(other, Lookup::Miss, "the bucket was repaired"),
    }
    for &h in &probes {
        if let Lookup::Hit { rank } = table.lookup(&store, h, now + ttl, dp_size) {
            assert!(rank < dp_size);
        }
    }
});
