//! Native micro-benchmarks of the filter's request-path core: `cargo bench --bench core`.
//!
//! No harness crate: `std::time::Instant`, a warm-up, then several timed repetitions of a
//! calibrated batch; the median repetition is reported (the min/max show the spread). The
//! output is a Markdown table on stdout, pasted into BENCHMARKS.md by `scripts/bench.sh`.
//!
//! Pass `--quick` (after `--`) or set `DP_BENCH_QUICK=1` for a shorter, noisier run.
//!
//! What these numbers are not: the filter runs as wasm inside Envoy's V8, and its affinity table
//! lives in Envoy shared data (a host call that copies the bucket into the VM). Here the same code
//! runs natively over an in-memory `HashMap` store with the same compare-and-swap semantics, so
//! the table figures are the cost of the table logic plus one map look-up and one copy (and a
//! write-back on refresh), not of Envoy's shared-data lock or of crossing into the VM. The end-to-end cost through Envoy is the wrk section of
//! `scripts/bench.sh`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use dp_affinity::chain::PrefixHasher;
use dp_affinity::config::Config;
use dp_affinity::config_sections::{PrefixConfig, TableConfig};
use dp_affinity::extract::scan_body;
use dp_affinity::hash::KeyedHasher;
use dp_affinity::json_scan::scan_top_level;
use dp_affinity::prefix_index::{Match, PrefixIndex};
use dp_affinity::prompt::{prompt_chain, scan_prompt, Api};
use dp_affinity::ranks::{LocalLoad, RankBoard};
use dp_affinity::table::{AffinityTable, Lookup, Store, StoreError, Stored};

// ---------------------------------------------------------------------------------------------
// Timing
// ---------------------------------------------------------------------------------------------

/// How long to measure. Quick mode trades precision for a run of a few seconds.
#[derive(Clone, Copy)]
struct Budget {
    /// Target wall time of one timed repetition.
    rep: Duration,
    reps: usize,
}

impl Budget {
    fn from_env() -> Budget {
        let quick = std::env::args().any(|a| a == "--quick")
            || std::env::var("DP_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        if quick {
            Budget {
                rep: Duration::from_millis(40),
                reps: 5,
            }
        } else {
            Budget {
                rep: Duration::from_millis(150),
                reps: 9,
            }
        }
    }
}

/// Per-operation times of each repetition, in nanoseconds, sorted.
struct Sample(Vec<f64>);

impl Sample {
    fn median(&self) -> f64 {
        self.0[self.0.len() / 2]
    }
    fn min(&self) -> f64 {
        self.0[0]
    }
    fn max(&self) -> f64 {
        self.0[self.0.len() - 1]
    }
}

/// Times `op(i)` for a counter `i` that keeps increasing across calls (so the operation can walk
/// a key list or advance a clock). The batch size is calibrated during the warm-up so that one
/// repetition lasts about `budget.rep`; a short batch would measure `Instant` more than `op`.
fn measure(budget: Budget, mut op: impl FnMut(u64)) -> Sample {
    let mut i = 0u64;
    let mut batch = 1u64;
    // Warm-up doubles as calibration: grow the batch until it takes a tenth of a repetition.
    loop {
        let t = Instant::now();
        for _ in 0..batch {
            op(i);
            i += 1;
        }
        let spent = t.elapsed();
        if spent >= budget.rep / 10 {
            let scale = budget.rep.as_secs_f64() / spent.as_secs_f64();
            batch = ((batch as f64 * scale) as u64).max(1);
            break;
        }
        batch *= 2;
    }
    let mut per_op = Vec::with_capacity(budget.reps);
    for _ in 0..budget.reps {
        let t = Instant::now();
        for _ in 0..batch {
            op(i);
            i += 1;
        }
        per_op.push(t.elapsed().as_nanos() as f64 / batch as f64);
    }
    per_op.sort_by(f64::total_cmp);
    Sample(per_op)
}

// ---------------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------------

/// How a figure is shown and judged.
enum Goal {
    /// Time per op, lower is better: at most this many ns.
    MaxNs(f64),
    /// Throughput over `bytes` per op, higher is better: at least this many MB/s (10^6 B/s).
    MinMbps { bytes: usize, mbps: f64 },
    /// Time per op, for information (no goal).
    Ns,
    /// Throughput over `bytes` per op, for information.
    Mbps(usize),
}

struct Row {
    name: String,
    sample: Sample,
    goal: Goal,
    note: String,
}

fn mbps(bytes: usize, ns: f64) -> f64 {
    bytes as f64 / ns * 1e3 // bytes per ns × 1e9 / 1e6
}

fn fmt_ns(ns: f64) -> String {
    if ns >= 10_000.0 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

impl Row {
    /// Median, spread (min..max over the repetitions), goal, verdict.
    fn cells(&self) -> [String; 4] {
        let s = &self.sample;
        match self.goal {
            Goal::MaxNs(_) | Goal::Ns => {
                let (goal, ok) = match self.goal {
                    Goal::MaxNs(g) => (format!("≤ {}", fmt_ns(g)), Some(s.median() <= g)),
                    _ => ("—".to_string(), None),
                };
                [
                    format!("{} /op", fmt_ns(s.median())),
                    format!("{} – {}", fmt_ns(s.min()), fmt_ns(s.max())),
                    goal,
                    verdict(ok),
                ]
            }
            Goal::MinMbps { bytes, .. } | Goal::Mbps(bytes) => {
                // The fastest repetition is the highest throughput.
                let (goal, ok) = match self.goal {
                    Goal::MinMbps { mbps: g, .. } => {
                        (format!("≥ {g:.0} MB/s"), Some(mbps(bytes, s.median()) >= g))
                    }
                    _ => ("—".to_string(), None),
                };
                [
                    format!("{:.0} MB/s", mbps(bytes, s.median())),
                    format!(
                        "{:.0} – {:.0} MB/s",
                        mbps(bytes, s.max()),
                        mbps(bytes, s.min())
                    ),
                    goal,
                    verdict(ok),
                ]
            }
        }
    }
}

fn verdict(ok: Option<bool>) -> String {
    match ok {
        Some(true) => "met".into(),
        Some(false) => "**missed**".into(),
        None => "".into(),
    }
}

fn print_table(rows: &[Row]) {
    println!("| benchmark | median | spread (min – max) | goal | | notes |");
    println!("|---|---:|---:|---|---|---|");
    for r in rows {
        let [median, spread, goal, verdict] = r.cells();
        println!(
            "| {} | {median} | {spread} | {goal} | {verdict} | {} |",
            r.name, r.note
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The store: a stand-in for Envoy shared data
// ---------------------------------------------------------------------------------------------

/// In-memory key-value store with Envoy shared data's compare-and-swap rules: a write with a
/// token succeeds only if the key's current token equals it; a write without one (or to a key
/// that does not exist) is unconditional. `get` copies the value out, as the host call does.
#[derive(Default)]
struct BenchStore {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    /// Successful writes, to report what fraction of lookups refreshed an entry.
    writes: Cell<u64>,
}

impl Store for BenchStore {
    fn get(&self, key: &str) -> Stored {
        match self.map.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut map = self.map.borrow_mut();
        if let (Some(want), Some((_, have))) = (cas, map.get(key)) {
            if want != *have {
                return Err(StoreError::CasMismatch);
            }
        }
        let token = self.next_cas.get().wrapping_add(1);
        self.next_cas.set(token);
        // Update in place, as Envoy does: only a new key costs a key allocation.
        match map.get_mut(key) {
            Some(slot) => {
                slot.0.clear();
                slot.0.extend_from_slice(value);
                slot.1 = token;
            }
            None => {
                map.insert(key.to_string(), (value.to_vec(), token));
            }
        }
        self.writes.set(self.writes.get() + 1);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Affinity table
// ---------------------------------------------------------------------------------------------

const RESIDENT_KEYS: usize = 100_000;
const DP_SIZE: u32 = 8;
const T0: u32 = 1_700_000_000;
/// Routing keys are conversation ids of this many bytes (`conv-<16 hex>-<8 hex>`).
const KEY_LEN: usize = 30;

/// Deterministic pseudo-random numbers (SplitMix64): reproducible runs without a crate.
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A routing key shaped like the ones clients send (a conversation id).
fn routing_key(n: u64) -> [u8; KEY_LEN] {
    let text = format!("conv-{:016x}-{:08x}", splitmix(n), n as u32);
    text.as_bytes().try_into().expect("fixed-width key")
}

/// Table, store and the resident keys, all pinned at `T0`.
///
/// The keys (text and hash) are stored in a random order and walked sequentially: every op
/// touches a random bucket of the table, as real traffic does, while the benchmark's own arrays
/// stream through the cache. A random index into a 3 MB key array would add a cache miss per op
/// (hundreds of ns on these VMs) that the filter never pays: its key has just arrived in a header.
struct TableFixture {
    table: AffinityTable,
    store: BenchStore,
    hasher: KeyedHasher,
    keys: Vec<[u8; KEY_LEN]>,
    hashes: Vec<u64>,
    /// The simulated clock (unix seconds). It only moves forward, continuously across
    /// benchmarks: a jump past `ttl_seconds` would expire every entry and turn hits into misses.
    now: Cell<u32>,
}

fn table_fixture(resident: usize) -> TableFixture {
    let table = AffinityTable::new(TableConfig {
        buckets: 65536,
        ways: 16,
        ttl_seconds: 3600,
        refresh_seconds: 1,
        cas_retries: 8,
        namespace: "bench".into(),
    });
    let store = BenchStore::default();
    // As the filter does on configure: every later write is a real compare-and-swap.
    table.ensure_buckets(&store);
    let hasher = KeyedHasher::from_seed(b"");
    let keys = shuffled((0..resident as u64).map(routing_key).collect());
    let hashes: Vec<u64> = keys.iter().map(|k| hasher.hash(k)).collect();
    for (i, &h) in hashes.iter().enumerate() {
        table.pin(&store, h, i as u32 % DP_SIZE, T0);
    }
    TableFixture {
        table,
        store,
        hasher,
        keys,
        hashes,
        now: Cell::new(T0),
    }
}

/// Fisher-Yates with SplitMix64.
fn shuffled<T>(mut v: Vec<T>) -> Vec<T> {
    for i in (1..v.len()).rev() {
        v.swap(i, (splitmix(i as u64) % (i as u64 + 1)) as usize);
    }
    v
}

impl TableFixture {
    /// Runs `op(i, now)` under `measure`, the clock advancing one second every `ops_per_second`
    /// ops (`None`: standing still). Returns the timing and the fraction of ops that wrote to the
    /// store (refreshes, for lookups).
    fn timed(
        &self,
        b: Budget,
        ops_per_second: Option<u64>,
        mut op: impl FnMut(u64, u32),
    ) -> (Sample, f64) {
        let start = self.now.get();
        let writes0 = self.store.writes.get();
        let mut ops = 0u64;
        let sample = measure(b, |i| {
            let now = start + ops_per_second.map_or(0, |n| (i / n) as u32);
            self.now.set(now);
            op(i, now);
            ops += 1;
        });
        let wrote = (self.store.writes.get() - writes0) as f64 / ops as f64;
        (sample, wrote)
    }
}

impl TableFixture {
    /// The resident key of op `i`: all keys in turn, in the fixture's random order.
    fn pick(&self, i: u64) -> usize {
        (i % self.keys.len() as u64) as usize
    }
}

/// Must be a hit: a miss would mean the fixture is wrong and the figure meaningless.
fn expect_hit(l: Lookup) {
    assert!(matches!(l, Lookup::Hit { .. }), "resident key missed");
}

/// Lookups of resident keys at the given request rate (see `TableFixture::timed`).
fn bench_lookup(b: Budget, f: &TableFixture, ops_per_second: Option<u64>) -> (Sample, f64) {
    f.timed(b, ops_per_second, |i, now| {
        let h = f.hashes[f.pick(i)];
        expect_hit(black_box(f.table.lookup(&f.store, h, now, DP_SIZE)));
    })
}

/// Lookups of keys that were never pinned (their bucket exists and is read, nothing matches):
/// what the filter does for every request whose key it has not learned.
fn bench_lookup_miss(b: Budget, f: &TableFixture) -> Sample {
    // The clock stands still: a miss refreshes nothing, and a clock run on by millions of misses
    // (a fast machine) would expire the resident keys the next row must hit.
    let (sample, _) = f.timed(b, None, |i, now| {
        let h = splitmix(i ^ 0x0bad_0000_0000_0000);
        let l = f.table.lookup(&f.store, h, now, DP_SIZE);
        assert_eq!(black_box(l), Lookup::Miss, "unknown key hit");
    });
    sample
}

/// Hashing the key text plus the lookup: the whole per-request table work of the header path.
fn bench_hash_lookup(b: Budget, f: &TableFixture) -> (Sample, f64) {
    f.timed(b, Some(1000), |i, now| {
        let h = f.hasher.hash(black_box(&f.keys[f.pick(i)]));
        expect_hit(black_box(f.table.lookup(&f.store, h, now, DP_SIZE)));
    })
}

/// Hashing alone, for the split.
fn bench_hash(b: Budget, f: &TableFixture) -> Sample {
    measure(b, |i| {
        black_box(f.hasher.hash(black_box(&f.keys[f.pick(i)])));
    })
}

/// Pinning keys never seen before (what the filter does on learning a rank). The table grows
/// from 100k entries towards its 1M-entry capacity, evicting once buckets fill. Runs last: its
/// evictions could turn later lookups of resident keys into misses.
fn bench_pin_new(b: Budget, f: &TableFixture) -> (Sample, u64) {
    let mut evictions = 0u64;
    let (sample, _) = f.timed(b, Some(1000), |i, now| {
        let h = splitmix(i ^ 0x5eed_0000_0000_0000);
        evictions += u64::from(f.table.pin(&f.store, h, (i % 8) as u32, now).evictions);
    });
    (sample, evictions)
}

fn table_rows(b: Budget) -> Vec<Row> {
    let f = table_fixture(RESIDENT_KEYS);
    let mut rows = Vec::new();
    // First, while the clock still reads the pin time: no entry is old enough to refresh.
    let (s, _) = bench_lookup(b, &f, None);
    rows.push(Row {
        name: "table lookup, hit, no refresh".into(),
        sample: s,
        goal: Goal::Ns,
        note: "clock fixed: read path only".into(),
    });
    // 1000 lookups per second over 100k resident keys: each key recurs every 100 s, so every
    // hit is older than refresh_seconds (1 s) and writes its bucket back. That is the steady
    // state of a proxy serving many conversations, hence the goal applies here.
    let (s, frac) = bench_lookup(b, &f, Some(1000));
    rows.push(Row {
        name: "table lookup+refresh, hit".into(),
        sample: s,
        goal: Goal::MaxNs(1000.0),
        note: format!(
            "clock +1 s per 1000 ops; {:.0}% of lookups refreshed",
            frac * 100.0
        ),
    });
    // 200k lookups per second: each key recurs twice a second, so about half refresh (more in
    // a --quick run, too short for most keys to come round twice).
    let (s, frac) = bench_lookup(b, &f, Some(200_000));
    rows.push(Row {
        name: "table lookup+refresh, hit, hot keys".into(),
        sample: s,
        goal: Goal::Ns,
        note: format!("clock +1 s per 200k ops; {:.0}% refreshed", frac * 100.0),
    });
    rows.push(Row {
        name: "table lookup, miss".into(),
        sample: bench_lookup_miss(b, &f),
        goal: Goal::Ns,
        note: "key never pinned; its bucket holds 1–2 others".into(),
    });
    rows.push(Row {
        name: format!("routing-key hash (SipHash-1-3, {KEY_LEN} B key)"),
        sample: bench_hash(b, &f),
        goal: Goal::Ns,
        note: String::new(),
    });
    let (s, frac) = bench_hash_lookup(b, &f);
    rows.push(Row {
        name: "hash + table lookup+refresh, hit".into(),
        sample: s,
        goal: Goal::MaxNs(1000.0),
        note: format!(
            "the header path's table work per request; {:.0}% refreshed",
            frac * 100.0
        ),
    });
    // Contrast: the same work over 1000 keys (as in the wrk runs), whose buckets stay in the CPU
    // cache. The gap to the row above is memory latency, not code.
    let small = table_fixture(1000);
    let (s, frac) = bench_hash_lookup(b, &small);
    rows.push(Row {
        name: "hash + table lookup+refresh, hit, 1000 keys".into(),
        sample: s,
        goal: Goal::Ns,
        note: format!(
            "cache-resident buckets (contrast); {:.0}% refreshed",
            frac * 100.0
        ),
    });
    let (s, evictions) = bench_pin_new(b, &f);
    rows.push(Row {
        name: "table pin (insert new key)".into(),
        sample: s,
        goal: Goal::Ns,
        note: format!("from 100k of 1M entries up; {evictions} evictions"),
    });
    rows
}

// ---------------------------------------------------------------------------------------------
// Body field extraction
// ---------------------------------------------------------------------------------------------

/// One paragraph of prompt text with what real prompts contain: JSON escapes (quotes,
/// newlines, tabs, backslashes, \u escapes) and raw multi-byte UTF-8.
const PARAGRAPH: &str = concat!(
    r#"The user asked: \"Summarise the attached report in three bullet points.\"\n"#,
    r#"Path: C:\\reports\\2024\\q3.txt\tstatus: ok\n"#,
    r#"Résumé naïve café — 日本語のテキスト, emoji 🚀🔥, \u00e9\u4e2d\u6587 \ud83d\ude00. "#,
    r#"Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "#,
    r#"incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "#,
    r#"exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat.\n\n"#,
);

/// A chat-completions body of about `size` bytes: model, several long messages, sampling
/// parameters, and `routing_key` as the LAST member so the scanner must walk the whole body.
/// The chat body of `size` as an Anthropic Messages body: its system message as `system`,
/// after the messages and before them.
fn messages_bodies(size: usize) -> [(&'static str, Vec<u8>); 2] {
    let chat: serde_json::Value = serde_json::from_slice(&chat_body(size)).expect("chat body");
    let mut messages = chat["messages"].as_array().cloned().unwrap_or_default();
    let system = messages.remove(0)["content"].clone();
    let messages = serde_json::Value::Array(messages);
    let model = &chat["model"];
    [
        (
            "last",
            format!(
                r#"{{"model":{model},"max_tokens":512,"messages":{messages},"system":{system}}}"#
            ),
        ),
        (
            "first",
            format!(
                r#"{{"model":{model},"system":{system},"max_tokens":512,"messages":{messages}}}"#
            ),
        ),
    ]
    .map(|(order, body)| (order, body.into_bytes()))
}

fn chat_body(size: usize) -> Vec<u8> {
    let tail = r#"],"temperature":0.7,"max_tokens":512,"stream":false,"routing_key":"conv-0123456789abcdef"}"#;
    let mut body = String::from(r#"{"model":"meta-llama/Llama-3.1-70B-Instruct","messages":["#);
    let roles = ["system", "user", "assistant", "user"];
    // Several messages, each a handful of paragraphs; the last one is cut to hit the size.
    let per_message = (size / 6).max(PARAGRAPH.len());
    let mut n = 0;
    while body.len() + tail.len() + 64 < size {
        if n > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            r#"{{"role":"{}","content":""#,
            roles[n % roles.len()]
        ));
        let room = size - body.len() - tail.len() - 4;
        let mut content = 0;
        while content + PARAGRAPH.len() <= per_message.min(room) {
            body.push_str(PARAGRAPH);
            content += PARAGRAPH.len();
        }
        // Pad with plain text (never cutting an escape or a UTF-8 sequence in half).
        let pad = per_message.min(room).saturating_sub(content);
        body.extend(std::iter::repeat_n('x', pad));
        body.push_str(r#""}"#);
        n += 1;
    }
    body.push_str(tail);
    body.into_bytes()
}

/// Checks the body once (valid JSON, key found) so a broken generator cannot produce a fast,
/// meaningless figure.
fn check_body(cfg: &Config, body: &[u8]) {
    let facts = scan_body(cfg, body).expect("scan_body accepts the bench body");
    assert_eq!(
        facts.key.as_deref(),
        Some(&b"conv-0123456789abcdef"[..]),
        "routing_key found"
    );
    let v: serde_json::Value = serde_json::from_slice(body).expect("bench body is valid JSON");
    assert!(v["messages"].as_array().is_some_and(|m| m.len() >= 2));
}

fn size_name(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

fn extraction_rows(b: Budget) -> Vec<Row> {
    let cfg = Config::from_json(br#"{"dp_size":8}"#).expect("bench config");
    let wanted: Vec<&str> = cfg.body.wanted_fields.iter().map(String::as_str).collect();
    let mut rows = Vec::new();
    for size in [1 << 10, 64 << 10, 1 << 20] {
        let body = chat_body(size);
        check_body(&cfg, &body);
        let len = body.len();
        let name = size_name(size);
        let goal = if size == 64 << 10 {
            Goal::MinMbps {
                bytes: len,
                mbps: 500.0,
            }
        } else {
            Goal::Mbps(len)
        };
        rows.push(Row {
            name: format!("scan_body, {name} chat body"),
            sample: measure(b, |_| {
                black_box(scan_body(&cfg, black_box(&body)).is_ok());
            }),
            goal,
            note: format!("{len} B, routing_key last; what the filter runs"),
        });
        rows.push(Row {
            name: format!("json_scan::scan_top_level, {name}"),
            sample: measure(b, |_| {
                let mut hits = 0;
                let r = scan_top_level(black_box(&body), &wanted, |_, _| hits += 1);
                black_box((r.is_ok(), hits));
            }),
            goal: Goal::Mbps(len),
            note: "the scanner alone".into(),
        });
        rows.push(Row {
            name: format!("serde_json::Value (contrast), {name}"),
            sample: measure(b, |_| {
                let v: serde_json::Value = serde_json::from_slice(black_box(&body)).unwrap();
                black_box(v);
            }),
            goal: Goal::Mbps(len),
            note: "full DOM parse, not used by the filter".into(),
        });
    }
    rows
}

// ---------------------------------------------------------------------------------------------
// Prompt prefixes: chain hashing and the prefix index
// ---------------------------------------------------------------------------------------------

/// A `/generate` body of about `size` bytes of `input_ids` (ids below 128k, as a real vocabulary).
fn ids_body(size: usize) -> Vec<u8> {
    let mut body = String::from(r#"{"input_ids":["#);
    let mut n = 0u64;
    while body.len() + 64 < size {
        if n > 0 {
            body.push(',');
        }
        body.push_str(&(splitmix(n) % 128_000).to_string());
        n += 1;
    }
    body.push_str(r#"],"sampling_params":{"max_new_tokens":16}}"#);
    body.into_bytes()
}

fn prefix_hashing_rows(b: Budget) -> Vec<Row> {
    let pcfg = PrefixConfig::default();
    let hasher = PrefixHasher::new(b"");
    let cfg = Config::from_json(br#"{"dp_size":8}"#).expect("bench config");
    let wanted: Vec<&str> = cfg.body.wanted_fields.iter().map(String::as_str).collect();
    let mut rows = Vec::new();
    for size in [1 << 10, 64 << 10, 1 << 20] {
        let body = chat_body(size);
        let len = body.len();
        let chain = prompt_chain(&body, Api::Chat, &pcfg, &hasher).expect("bench body walks");
        assert!(
            chain.len() >= (len / 512).min(128) * 9 / 10,
            "blocks hashed"
        );
        let goal = if size == 64 << 10 {
            Goal::MinMbps {
                bytes: len,
                mbps: 1000.0,
            }
        } else {
            Goal::Mbps(len)
        };
        rows.push(Row {
            name: format!("prefix::prompt_chain, {} chat body", size_name(size)),
            sample: measure(b, |_| {
                let c = prompt_chain(black_box(&body), Api::Chat, &pcfg, &hasher);
                black_box(c.map(|c| c.len()).ok());
            }),
            goal,
            note: format!(
                "{len} B; blocks of 512 B hashed: {}{}",
                chain.len(),
                if chain.capped() {
                    ", capped: the rest only walked"
                } else {
                    ""
                }
            ),
        });
        if size == 64 << 10 {
            // The one pass the filter can make: body fields and the chain together.
            rows.push(Row {
                name: "prefix::scan_prompt + body fields, 64 KiB".into(),
                sample: measure(b, |_| {
                    let mut hits = 0;
                    let c = scan_prompt(
                        black_box(&body),
                        Api::Chat,
                        &pcfg,
                        &hasher,
                        &wanted,
                        |_, _| hits += 1,
                    );
                    black_box((c.map(|c| c.len()).ok(), hits));
                }),
                goal: Goal::Mbps(len),
                note:
                    "chain plus scan_body's fields in one pass (compare scan_body + prompt_chain)"
                        .into(),
            });
        }
    }
    // The Messages API with its system text last (as alphabetical serialisers write it: the walk
    // is recorded and replayed after it) and first (walked as it stands).
    for (order, body) in messages_bodies(64 << 10) {
        let len = body.len();
        let chain = prompt_chain(&body, Api::Messages, &pcfg, &hasher).expect("walks");
        rows.push(Row {
            name: format!("prefix::prompt_chain, 64 KiB Messages body, system {order}"),
            sample: measure(b, |_| {
                let c = prompt_chain(black_box(&body), Api::Messages, &pcfg, &hasher);
                black_box(c.map(|c| c.len()).ok());
            }),
            goal: Goal::Mbps(len),
            note: format!("{len} B; blocks of 512 B hashed: {}", chain.len()),
        });
    }
    let body = ids_body(64 << 10);
    let len = body.len();
    let chain = prompt_chain(&body, Api::Generate, &pcfg, &hasher).expect("ids body walks");
    rows.push(Row {
        name: "prefix::prompt_chain, 64 KiB input_ids body".into(),
        sample: measure(b, |_| {
            let c = prompt_chain(black_box(&body), Api::Generate, &pcfg, &hasher);
            black_box(c.map(|c| c.len()).ok());
        }),
        goal: Goal::Mbps(len),
        note: format!("{len} B; blocks of 64 ids hashed: {}", chain.len()),
    });
    rows
}

/// Resident prompts (random 128-block chains) recorded in a prefix index over the bench store.
struct PrefixFixture {
    index: PrefixIndex,
    store: BenchStore,
    chains: Vec<Vec<u64>>,
}

const RESIDENT_PROMPTS: usize = 20_000;

fn random_chain(tag: u64, len: usize) -> Vec<u64> {
    (0..len as u64)
        .map(|i| splitmix(tag.wrapping_mul(0x1_0000_0001) ^ i))
        .collect()
}

fn prefix_fixture() -> PrefixFixture {
    let mut cfg = PrefixConfig::default();
    cfg.table.namespace = "bench_prefix".into();
    let index = PrefixIndex::new(&cfg);
    let store = BenchStore::default();
    index.table().ensure_buckets(&store);
    let chains: Vec<Vec<u64>> = (0..RESIDENT_PROMPTS as u64)
        .map(|n| random_chain(n, 128))
        .collect();
    for (n, c) in chains.iter().enumerate() {
        index.record(&store, c, n as u32 % DP_SIZE, T0, &Match::default());
    }
    PrefixFixture {
        index,
        store,
        chains,
    }
}

fn prefix_index_rows(b: Budget) -> Vec<Row> {
    let f = prefix_fixture();
    let mut rows = Vec::new();
    // Queries built from resident chain `i`: the first `shared` blocks, then fresh ones.
    let query = |i: u64, shared: usize| -> Vec<u64> {
        let base = &f.chains[(i % RESIDENT_PROMPTS as u64) as usize];
        let mut q = random_chain(i ^ 0x00c0_ffee_0000_0000, 128);
        q[..shared].copy_from_slice(&base[..shared]);
        q
    };
    let cases = [
        (
            128,
            128,
            "resident prompt (a conversation turn that crossed no grid position)",
        ),
        (96, 96, "shares 96 of 128 blocks (a turn that crossed one)"),
        (0, 0, "shares nothing"),
        (8, 8, "shares 8 blocks (a common system prompt)"),
    ];
    for (shared, want, what) in cases {
        // Queries are built outside the timed op: only the index work is measured.
        let queries: Vec<Vec<u64>> = (0..4096u64).map(|i| query(i * 5 + 1, shared)).collect();
        let mut reads = 0u32;
        let sample = measure(b, |i| {
            let q = &queries[(i % queries.len() as u64) as usize];
            let m = f.index.longest_match(&f.store, q, T0, DP_SIZE);
            assert_eq!(m.blocks, want, "fixture broken");
            reads = m.reads;
            black_box(m);
        });
        rows.push(Row {
            name: format!("prefix longest_match, {what}"),
            sample,
            goal: Goal::Ns,
            note: format!("{reads} store reads; clock fixed (no refresh)"),
        });
    }
    // Recording a prompt the index has never seen: every grid position is written.
    let fresh_matched = Match::default();
    let writes = f.index.writes_needed(128, &fresh_matched);
    let mut n = 0u64;
    let sample = measure(b, |_| {
        n += 1;
        let c = random_chain(n ^ 0x7e57_0000_0000_0000, 128);
        black_box(
            f.index
                .record(&f.store, &c, (n % 8) as u32, T0, &fresh_matched),
        );
    });
    rows.push(Row {
        name: "prefix record, new 128-block prompt".into(),
        sample,
        goal: Goal::Ns,
        note: format!("{writes} entries (CAS read + write each); chain generation included"),
    });
    // The whole request-path work at 64 KiB: hash the body's prompt, search the index.
    let pcfg = PrefixConfig::default();
    let hasher = PrefixHasher::new(b"");
    let body = chat_body(64 << 10);
    let chain = prompt_chain(&body, Api::Chat, &pcfg, &hasher).expect("bench body walks");
    f.index
        .record(&f.store, chain.hashes(), 3, T0, &Match::default());
    rows.push(Row {
        name: "prefix prompt_chain + longest_match, 64 KiB chat body".into(),
        sample: measure(b, |_| {
            let c = prompt_chain(black_box(&body), Api::Chat, &pcfg, &hasher);
            let m = c.map(|c| f.index.longest_match(&f.store, c.hashes(), T0, DP_SIZE));
            assert!(m.is_ok_and(|m| m.rank == Some(3)), "resident body");
        }),
        goal: Goal::Ns,
        note: "request-path prefix work, resident prompt (1 read)".into(),
    });
    rows
}

// ---------------------------------------------------------------------------------------------
// Rank board
// ---------------------------------------------------------------------------------------------

/// The rank board's per-request work: `acquire` (read, choose, count, write) when a request is
/// placed and `release` when it ends, for one VM whose board also carries another VM's column
/// (two Envoy workers). The chooser takes the least loaded rank: the board work, not placement's.
fn board_rows(b: Budget) -> Vec<Row> {
    const RANKS: u32 = 4;
    let store = BenchStore::default();
    let board = RankBoard::new("bench", RANKS, 8);
    board.ensure(&store, T0);
    let mut other = LocalLoad::new(RANKS);
    board.acquire(&store, &mut other, T0, 1, |_| Some(1));
    let mut vm = LocalLoad::new(RANKS);
    let least_loaded = |st: &dp_affinity::ranks::RankStates| {
        (0..RANKS).min_by_key(|&r| (st.inflight(r), st.recent(r)))
    };
    let sample = measure(b, |_| {
        let (rank, _) = board.acquire(&store, &mut vm, T0, 16, least_loaded);
        let rank = rank.expect("a rank is always usable");
        black_box(board.release(&store, &mut vm, T0, rank, true));
    });
    let mut rows = vec![Row {
        name: "rank board acquire + release".into(),
        sample,
        goal: Goal::Ns,
        note: format!(
            "dp_size {RANKS}, two VMs' columns; 2 store reads + 2 writes (what every placed request pays)"
        ),
    }];
    rows.push(Row {
        name: "rank board read (view)".into(),
        sample: measure(b, |_| {
            black_box(board.read(&store, &vm, T0));
        }),
        goal: Goal::Ns,
        note: "1 store read: the tick's gauges".into(),
    });
    rows
}

fn main() {
    let budget = Budget::from_env();
    let started = Instant::now();
    let mut rows = table_rows(budget);
    rows.extend(extraction_rows(budget));
    rows.extend(prefix_hashing_rows(budget));
    rows.extend(prefix_index_rows(budget));
    rows.extend(board_rows(budget));
    print_table(&rows);
    println!();
    println!(
        "Native ({}), median of {} repetitions of ~{} ms after a warm-up; {:.0} s in all. \
         The table runs over an in-memory HashMap store standing in for Envoy shared data.",
        std::env::consts::ARCH,
        budget.reps,
        budget.rep.as_millis(),
        started.elapsed().as_secs_f64()
    );
}
