//! The filter's counters as Envoy's admin `/stats` shows them.
//!
//! Every VM of the filter (one per Envoy worker plus one on the main thread) adds up its counts in
//! memory and hands them to Envoy once a second. Two rules follow for the tests:
//! - A value may be polled until it reaches what a test expects ([`assert_counter_of`]), but a 0,
//!   or a value that must not have moved, proves nothing until every VM has flushed after the
//!   requests: it is read from [`Envoy::settled_counters`], which waits for that with the filter's
//!   own `stats_flushes` counter.
//! - The filter defines every counter when its VM starts, so a name Envoy does not show is a
//!   mistake in the test: every lookup fails on it, naming the closest names Envoy does show.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::envoy::{Envoy, FILTER_VMS};

/// Envoy 1.40 prints the filter's metrics (`dp_affinity.<name>`) under its own `wasmcustom.`.
pub const PREFIX: &str = "wasmcustom.dp_affinity.";
/// The admin `/stats?filter=` regex for exactly the filter's metrics.
const STATS_FILTER: &str = "^wasmcustom\\.dp_affinity\\.";
/// Each VM adds 1 to it per flush.
const FLUSHES: &str = "stats_flushes";
/// How many flushes per VM a settled read waits for. Two: the first may be one that was already
/// under way when the wait began.
const FLUSH_ROUNDS: u64 = 2;
/// Flushes come once a second; this leaves room for a loaded machine, and a VM that stopped
/// flushing (a failed VM) shows up as a timeout instead of a silently unsettled read.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(10);
/// Counters may be bumped in a callback that runs after the client already has the response
/// (e.g. on stream completion), and reach Envoy at the next flush: poll this long before failing.
const POLL_TIMEOUT: Duration = Duration::from_secs(3);

/// The filter's counters at one moment, by short name (`affinity_hit`, not the full Envoy name).
#[derive(Clone, Debug)]
pub struct Counters {
    values: BTreeMap<String, u64>,
}

impl Counters {
    fn read(envoy: &Envoy) -> Counters {
        let values: BTreeMap<String, u64> = envoy
            .stats(STATS_FILTER)
            .into_iter()
            .filter_map(|(full, value)| Some((full.strip_prefix(PREFIX)?.to_string(), value)))
            .collect();
        assert!(
            values.contains_key(FLUSHES),
            "Envoy shows no {PREFIX}{FLUSHES}: is the filter loaded? ({values:?})"
        );
        Counters { values }
    }

    /// The value of counter `name`; panics if Envoy does not show it.
    pub fn get(&self, name: &str) -> u64 {
        self.try_get(name)
            .unwrap_or_else(|report| panic!("{report}"))
    }

    /// The value of counter `name`, or the report for a name Envoy does not show (naming the
    /// closest names it does show).
    pub fn try_get(&self, name: &str) -> Result<u64, String> {
        self.values
            .get(name)
            .copied()
            .ok_or_else(|| unknown_counter(name, self.values.keys()))
    }

    /// Asserts counter `name` is exactly `expected`.
    pub fn assert_eq(&self, name: &str, expected: u64) {
        let value = self.get(name);
        assert_eq!(
            value,
            expected,
            "counter {PREFIX}{name}; non-zero filter counters: {}",
            self.nonzero()
        );
    }

    /// Asserts every counter in `names` is 0.
    pub fn assert_zero(&self, names: &[&str]) {
        let moved: Vec<String> = names
            .iter()
            .filter(|name| self.get(name) != 0)
            .map(|name| format!("{name}={}", self.get(name)))
            .collect();
        assert!(
            moved.is_empty(),
            "counters expected to be 0: {}; non-zero filter counters: {}",
            moved.join(" "),
            self.nonzero()
        );
    }

    /// `name=value` for every counter above 0 (the flush count left out), for reports.
    pub fn nonzero(&self) -> String {
        self.values
            .iter()
            .filter(|(name, value)| **value > 0 && name.as_str() != FLUSHES)
            .map(|(name, value)| format!("{name}={value}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

impl Envoy {
    /// The filter's counters as flushed so far (values may lag the requests by a flush).
    pub fn counters(&self) -> Counters {
        Counters::read(self)
    }

    /// The filter's counters once every VM has flushed after this call: a 0 read here is a 0.
    pub fn settled_counters(&self) -> Counters {
        settled(&[self]).remove(0)
    }
}

/// [`Envoy::settled_counters`] of several Envoys at once (replicas): one wait, not one per Envoy.
pub fn settled(envoys: &[&Envoy]) -> Vec<Counters> {
    let started = Instant::now();
    let baselines: Vec<u64> = envoys.iter().map(|e| e.counters().get(FLUSHES)).collect();
    let wanted = FLUSH_ROUNDS * FILTER_VMS;
    let mut settled: Vec<Option<Counters>> = vec![None; envoys.len()];
    loop {
        for ((envoy, baseline), slot) in envoys.iter().zip(&baselines).zip(&mut settled) {
            if slot.is_none() {
                let now = envoy.counters();
                if now.get(FLUSHES) >= baseline + wanted {
                    *slot = Some(now);
                }
            }
        }
        if settled.iter().all(Option::is_some) {
            return settled.into_iter().flatten().collect();
        }
        if started.elapsed() >= FLUSH_TIMEOUT {
            let seen: Vec<String> = envoys
                .iter()
                .zip(&baselines)
                .map(|(envoy, baseline)| format!("{baseline} -> {}", envoy.counters().get(FLUSHES)))
                .collect();
            panic!(
                "{PREFIX}{FLUSHES} did not grow by {wanted} ({FLUSH_ROUNDS} flushes from each of \
                 {FILTER_VMS} VMs) within {FLUSH_TIMEOUT:?}: {seen:?}. A VM stopped flushing \
                 (failed?), so its counts never reached Envoy."
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `envoy`'s counter `name` as flushed so far (see [`Envoy::counters`]).
pub fn counter_of(envoy: &Envoy, name: &str) -> u64 {
    envoy.counters().get(name)
}

/// Asserts `envoy`'s counter `name` is exactly `expected`: polls until it reaches it, then reads
/// it again once every VM has flushed (a sum flushed by some VMs only may equal `expected` while
/// the whole is more). Not for 0: a poll for 0 succeeds before any flush, so zeros are read
/// from [`Envoy::settled_counters`].
pub fn assert_counter_of(envoy: &Envoy, name: &str, expected: u64) {
    assert!(
        expected > 0,
        "counter {name}: polling for 0 passes before any flush; assert it on settled_counters()"
    );
    wait_counter(envoy, name, &format!(">= {expected}"), |v| v >= expected);
    envoy.settled_counters().assert_eq(name, expected);
}

/// Polls until `envoy`'s counter `name` is at least `minimum` (> 0, as for [`assert_counter_of`]).
pub fn assert_counter_at_least_of(envoy: &Envoy, name: &str, minimum: u64) {
    assert!(
        minimum > 0,
        "counter {name}: at least 0 holds for any value; assert something that can fail"
    );
    wait_counter(envoy, name, &format!(">= {minimum}"), |v| v >= minimum);
}

fn wait_counter(envoy: &Envoy, name: &str, wanted: &str, ok: impl Fn(u64) -> bool) {
    let deadline = Instant::now() + POLL_TIMEOUT;
    loop {
        let counters = envoy.counters();
        let value = counters.get(name);
        if ok(value) {
            return;
        }
        if Instant::now() >= deadline {
            panic!(
                "counter {PREFIX}{name}: wanted {wanted}, got {value} after {POLL_TIMEOUT:?}; \
                 non-zero filter counters: {}",
                counters.nonzero()
            );
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The report for a name Envoy does not show, with the closest names it does.
fn unknown_counter<'a>(name: &str, known: impl Iterator<Item = &'a String>) -> String {
    let mut by_distance: Vec<(usize, &String)> =
        known.map(|k| (edit_distance(name, k), k)).collect();
    by_distance.sort();
    let closest: Vec<&str> = by_distance
        .iter()
        .take(5)
        .map(|(_, k)| k.as_str())
        .collect();
    format!(
        "Envoy shows no counter {PREFIX}{name} (the filter defines all its counters at VM start, \
         so the name is wrong); closest: {}",
        closest.join(", ")
    )
}

/// Levenshtein distance over bytes (counter names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != cb);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
}
