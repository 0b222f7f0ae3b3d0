//! Property tests of the routing core (no Envoy needed; part of `cargo test`).
//!
//! 1. The one-pass JSON scanner (`json_scan::scan_top_level`, `extract::scan_body`) agrees with a
//!    full `serde_json` parse on random valid objects: random nesting, strings with every escape
//!    form (short escapes, `\uXXXX`, surrogate pairs, escaped `/`), astral characters, random
//!    whitespace, wanted field names at the top level with random types, and decoys (the same names
//!    nested in objects and arrays, and spelled out inside string values). Arbitrary and mutated
//!    bytes never panic it, and whatever serde accepts as an object, it accepts too. The body
//!    rewrite (`body_rewrite::rewrite`) on the same objects changes serde's view exactly as its
//!    edit says and writes valid JSON.
//! 2. The affinity table, over an in-memory store with Envoy's CAS semantics where another worker
//!    ("rival") may pin between our read and our write, matches a reference model (per-bucket LRU
//!    with TTL) exactly, stays within `buckets × ways × 16` bytes, loses no pin except to LRU/TTL,
//!    and never returns a rank outside `0..dp_size`.
//! 3. The configuration parser never panics on random JSON with the real field names.
//!
//! Case counts are chosen so the whole file runs in a few seconds in a debug build on 2 cores;
//! `PROPTEST_CASES=10000 cargo test --release --test properties` runs a longer campaign.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::Value as J;

use dp_affinity::body_rewrite::{rewrite, RankEdit};
use dp_affinity::config::Config;
use dp_affinity::config_sections::TableConfig;
use dp_affinity::decide::decide_body_with_prefix;
use dp_affinity::extract::{scan_body, Room};
use dp_affinity::json_scan::{scan_top_level, Value};
use dp_affinity::prompt::Api;
use dp_affinity::table::{AffinityTable, Lookup, Store, StoreError, Stored, TableEvents};

/// Cases per property, unless `PROPTEST_CASES` says otherwise.
fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        failure_persistence: None, // no proptest-regressions/ files written into the tree
        ..ProptestConfig::with_cases(n)
    }
}

// =============================================================================================
// 1. The JSON scanner against serde_json
// =============================================================================================

const RANK_FIELDS: [&str; 2] = ["routed_dp_rank", "data_parallel_rank"];
const KEY_FIELDS: [&str; 3] = ["routing_key", "prompt_cache_key", "user"];
const ROOM_FIELD: &str = "bootstrap_room";

/// What `scan_top_level` is asked for: every field the filter reads, plus the empty name.
const WANTED: [&str; 7] = [
    "routing_key",
    "prompt_cache_key",
    "user",
    "routed_dp_rank",
    "data_parallel_rank",
    "bootstrap_room",
    "",
];

/// Names close to the wanted ones that must not match.
const NEAR_MISSES: [&str; 8] = [
    "routing_keys",
    "Routing_key",
    "routing_key ",
    " user",
    "user\u{0}",
    "routed_dp_rank\u{FFFF}",
    "prompt-cache-key",
    "routing_k\u{e9}y",
];

/// Text that looks like a member when read without tracking string boundaries.
const DECOY_SNIPPETS: [&str; 8] = [
    "\"routing_key\":\"evil\"",
    ",\"user\":\"evil\"}",
    "{\"routed_dp_rank\":3}",
    "\"data_parallel_rank\":1,",
    "routing_key",
    "\\u0041",
    "\\\"",
    "}]},\"prompt_cache_key\":\"x\"",
];

/// A JSON document as generated: objects keep their member order (serde's map does not).
#[derive(Debug, Clone)]
enum Node {
    Null,
    Bool(bool),
    /// Raw number text, always valid JSON grammar and within f64 range.
    Num(String),
    Str(String),
    Arr(Vec<Node>),
    Obj(Vec<(String, Node)>),
}

fn number_literal() -> impl Strategy<Value = String> {
    let grammar = (
        any::<bool>(),
        prop_oneof![Just("0".to_string()), "[1-9][0-9]{0,19}"],
        proptest::option::of("[0-9]{1,6}"),
        proptest::option::of(("[eE]", "[+-]?", "[0-9]{1,2}")),
    )
        .prop_map(|(neg, int, frac, exp)| {
            let mut s = String::new();
            if neg {
                s.push('-');
            }
            s.push_str(&int);
            if let Some(f) = frac {
                s.push('.');
                s.push_str(&f);
            }
            if let Some((e, sign, d)) = exp {
                s.push_str(&e);
                s.push_str(&sign);
                s.push_str(&d);
            }
            s
        });
    prop_oneof![
        3 => (0u64..10).prop_map(|n| n.to_string()),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| serde_json::to_string(&f).expect("finite float")),
        2 => grammar,
        1 => select(vec![
            "-0",
            "1.0",
            "1e0",
            "2E+0",
            "18446744073709551615",
            "18446744073709551616",
            "99999999999999999999999",
            "-1",
            "0.5",
        ])
        .prop_map(String::from),
    ]
}

fn string_piece() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[ -~]{0,6}",
        1 => proptest::char::range('\u{0}', '\u{1f}').prop_map(String::from),
        1 => select(vec!["\"", "\\", "/", "\u{7f}", "\u{2028}", "\u{FEFF}", "\u{FFFD}"])
            .prop_map(String::from),
        2 => any::<char>().prop_map(String::from),
        1 => proptest::char::range('\u{10000}', '\u{10FFFF}').prop_map(String::from),
        1 => select(DECOY_SNIPPETS.to_vec()).prop_map(String::from),
    ]
}

fn json_string() -> impl Strategy<Value = String> {
    vec(string_piece(), 0..6).prop_map(|p| p.concat())
}

fn member_name() -> impl Strategy<Value = String> {
    let wanted: Vec<&str> = WANTED.iter().copied().filter(|w| !w.is_empty()).collect();
    prop_oneof![
        3 => select(wanted).prop_map(String::from),
        1 => select(NEAR_MISSES.to_vec()).prop_map(String::from),
        3 => json_string(),
    ]
}

fn leaf() -> impl Strategy<Value = Node> {
    prop_oneof![
        Just(Node::Null),
        any::<bool>().prop_map(Node::Bool),
        number_literal().prop_map(Node::Num),
        json_string().prop_map(Node::Str),
    ]
}

/// Keeps the first member of each name (serde's map cannot show duplicates).
fn dedup(members: Vec<(String, Node)>) -> Vec<(String, Node)> {
    let mut seen = std::collections::HashSet::new();
    members
        .into_iter()
        .filter(|(k, _)| seen.insert(k.clone()))
        .collect()
}

fn any_node() -> BoxedStrategy<Node> {
    leaf()
        .prop_recursive(4, 40, 5, |inner| {
            prop_oneof![
                vec(inner.clone(), 0..5).prop_map(Node::Arr),
                vec((member_name(), inner), 0..5).prop_map(|m| Node::Obj(dedup(m))),
            ]
        })
        .boxed()
}

/// A top-level object: the wanted names with random types, decoys, and other members.
fn top_value() -> impl Strategy<Value = Node> {
    prop_oneof![
        2 => (0u64..10).prop_map(|n| Node::Num(n.to_string())),
        2 => json_string().prop_map(Node::Str),
        1 => Just(Node::Str(String::new())),
        3 => any_node(),
    ]
}

fn top_object() -> impl Strategy<Value = Vec<(String, Node)>> {
    let field = select(
        RANK_FIELDS
            .iter()
            .chain(&KEY_FIELDS)
            .chain(&[ROOM_FIELD])
            .copied()
            .collect::<Vec<_>>(),
    )
    .prop_map(String::from);
    let member = prop_oneof![
        2 => (field, top_value()),
        1 => (member_name(), any_node()),
    ];
    vec(member, 0..10).prop_map(dedup)
}

/// Serialises a `Node` with random formatting, driven by a seed.
struct Emitter {
    state: u64,
    whitespace: bool,
    /// Percent of non-ASCII / ordinary characters written as `\uXXXX`.
    escape_pct: u64,
}

impl Emitter {
    fn new(seed: u64) -> Self {
        let mut e = Emitter {
            state: seed,
            whitespace: false,
            escape_pct: 0,
        };
        e.whitespace = e.below(2) == 1;
        e.escape_pct = [0, 5, 30, 100][e.below(4) as usize];
        e
    }

    /// splitmix64
    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn ws(&mut self, out: &mut Vec<u8>) {
        if self.whitespace {
            for _ in 0..self.below(3) {
                out.push(b" \t\n\r"[self.below(4) as usize]);
            }
        }
    }

    fn unit(&mut self, cu: u16, out: &mut Vec<u8>) {
        let s = if self.below(2) == 0 {
            format!("\\u{cu:04x}")
        } else {
            format!("\\u{cu:04X}")
        };
        out.extend_from_slice(s.as_bytes());
    }

    fn u_escape(&mut self, c: char, out: &mut Vec<u8>) {
        let mut units = [0u16; 2];
        for &cu in c.encode_utf16(&mut units).iter() {
            self.unit(cu, out);
        }
    }

    fn string(&mut self, s: &str, out: &mut Vec<u8>) {
        out.push(b'"');
        for c in s.chars() {
            let short: Option<&[u8]> = match c {
                '"' => Some(b"\\\""),
                '\\' => Some(b"\\\\"),
                '/' => Some(b"\\/"),
                '\u{8}' => Some(b"\\b"),
                '\u{c}' => Some(b"\\f"),
                '\n' => Some(b"\\n"),
                '\r' => Some(b"\\r"),
                '\t' => Some(b"\\t"),
                _ => None,
            };
            let must_escape = c == '"' || c == '\\' || (c as u32) < 0x20;
            if self.below(100) < self.escape_pct {
                self.u_escape(c, out);
            } else if let Some(esc) = short.filter(|_| must_escape || self.below(2) == 0) {
                out.extend_from_slice(esc);
            } else if must_escape {
                self.u_escape(c, out);
            } else {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
        out.push(b'"');
    }

    fn node(&mut self, n: &Node, out: &mut Vec<u8>) {
        match n {
            Node::Null => out.extend_from_slice(b"null"),
            Node::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            Node::Num(raw) => out.extend_from_slice(raw.as_bytes()),
            Node::Str(s) => self.string(s, out),
            Node::Arr(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    self.ws(out);
                    self.node(item, out);
                    self.ws(out);
                }
                if items.is_empty() {
                    self.ws(out);
                }
                out.push(b']');
            }
            Node::Obj(members) => {
                out.push(b'{');
                for (i, (k, v)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    self.ws(out);
                    self.string(k, out);
                    self.ws(out);
                    out.push(b':');
                    self.ws(out);
                    self.node(v, out);
                    self.ws(out);
                }
                if members.is_empty() {
                    self.ws(out);
                }
                out.push(b'}');
            }
        }
    }

    fn document(&mut self, n: &Node) -> Vec<u8> {
        let mut out = Vec::new();
        self.ws(&mut out);
        self.node(n, &mut out);
        self.ws(&mut out);
        out
    }
}

/// Whether a scanned value is what serde parsed.
fn same_value(scanned: &Value<'_>, serde: &J) -> bool {
    match (scanned, serde) {
        (Value::Str(b), J::String(s)) => &**b == s.as_bytes(),
        (Value::Number(raw), J::Number(_)) => {
            serde_json::from_slice::<J>(raw).ok().as_ref() == Some(serde)
        }
        (Value::Bool(a), J::Bool(b)) => a == b,
        (Value::Null, J::Null) | (Value::Object, J::Object(_)) | (Value::Array, J::Array(_)) => {
            true
        }
        _ => false,
    }
}

/// Scans `body` for `WANTED` and checks every report against serde's object: each wanted name
/// present in serde's map was reported, the last report per name equals serde's value (serde's
/// map keeps the last duplicate), and no absent name was reported. With `unique`, each present
/// name was reported exactly once.
fn check_scan_against_serde(body: &[u8], obj: &serde_json::Map<String, J>, unique: bool) {
    let mut seen: Vec<Vec<Value<'_>>> = vec![Vec::new(); WANTED.len()];
    let result = scan_top_level(body, &WANTED, |i, v| seen[i].push(v));
    assert_eq!(
        result,
        Ok(()),
        "serde accepts this object, the scanner must too: {:?}",
        String::from_utf8_lossy(body)
    );
    for (i, name) in WANTED.iter().enumerate() {
        match obj.get(*name) {
            None => assert!(
                seen[i].is_empty(),
                "{name:?} is not a top-level member but was reported: {:?}",
                seen[i]
            ),
            Some(expected) => {
                let last = seen[i].last();
                assert!(
                    last.is_some_and(|v| same_value(v, expected)),
                    "{name:?}: serde says {expected:?}, scanner reported {:?}",
                    seen[i]
                );
                if unique {
                    assert_eq!(seen[i].len(), 1, "{name:?} reported {:?}", seen[i]);
                }
            }
        }
    }
}

/// The body-scan configuration under test.
#[derive(Debug, Clone)]
struct BodyCfg {
    dp_size: u32,
    explicit: bool,
    key_fields: Vec<&'static str>,
    room_mode: bool,
}

impl BodyCfg {
    fn config(&self) -> Config {
        let json = serde_json::json!({
            "dp_size": self.dp_size,
            "explicit_rank": {"enabled": self.explicit},
            "routing_key": {"body_fields": self.key_fields},
            "assign": {"mode": if self.room_mode { "bootstrap_room" } else { "envoy" }},
            "prefix": {"enabled": false},
        });
        Config::from_json(json.to_string().as_bytes()).expect("valid test config")
    }
}

fn body_cfg() -> impl Strategy<Value = BodyCfg> {
    (
        1u32..=8,
        any::<bool>(),
        Just(KEY_FIELDS.to_vec()).prop_shuffle(),
        0usize..=3,
        any::<bool>(),
    )
        .prop_map(|(dp_size, explicit, keys, n_keys, room_mode)| BodyCfg {
            dp_size,
            explicit,
            key_fields: keys[..n_keys].to_vec(),
            room_mode,
        })
}

/// Expected `scan_body` result from serde's view of the members, in document order:
/// (rank: valid rank or the field reported, key bytes, room).
type Expected = (Option<Result<u32, String>>, Option<Vec<u8>>, Option<Room>);

fn expected_body_facts(cfg: &BodyCfg, members: &[(String, &J)]) -> Expected {
    // A JSON integer literal (serde parses those, and only those, as u64) below dp_size.
    let valid_rank = |v: &J| v.as_u64().filter(|&n| n < u64::from(cfg.dp_size));
    // The engine's Python dict keeps each member's last occurrence.
    let lookup = |field: &str| {
        members
            .iter()
            .rev()
            .find(|(n, _)| n == field)
            .map(|(_, v)| *v)
    };
    let mut rank: Option<Result<u32, String>> = None;
    if cfg.explicit {
        // Each field's last value, the fields in list order.
        for field in RANK_FIELDS {
            let Some(v) = lookup(field).filter(|v| !v.is_null()) else {
                continue;
            };
            rank = match (rank, valid_rank(v)) {
                (Some(Err(first)), _) => Some(Err(first)),
                (_, None) => Some(Err(field.to_string())),
                (None, Some(n)) => Some(Ok(n as u32)),
                (Some(Ok(prev)), Some(n)) if u64::from(prev) != n => Some(Err(field.to_string())),
                (same, _) => same,
            };
        }
    }
    let key = cfg.key_fields.iter().find_map(|f| match lookup(f) {
        Some(J::String(s)) if !s.is_empty() => Some(s.as_bytes().to_vec()),
        _ => None,
    });
    let room = if cfg.room_mode {
        // null is none; anything but an integer >= 0 names no one rank.
        lookup(ROOM_FIELD)
            .filter(|v| !v.is_null())
            .map(|v| v.as_u64().map_or(Room::Unusable, Room::One))
    } else {
        None
    };
    (rank, key, room)
}

/// `minus_zero`: the members written as the integer `-0`, which Python (the engine) reads as
/// the int 0 and serde as the float -0.0 (which it writes back as `-0.0`, a float to both).
fn check_body_against_serde(
    cfg: &BodyCfg,
    config: &Config,
    body: &[u8],
    order: &[String],
    minus_zero: &[String],
) {
    let obj: serde_json::Map<String, J> = serde_json::from_slice(body).expect("valid JSON object");
    let zero = J::from(0u64);
    let members: Vec<(String, &J)> = order
        .iter()
        .map(|n| {
            let v = obj.get(n).expect("member named in the order");
            (n.clone(), if minus_zero.contains(n) { &zero } else { v })
        })
        .collect();
    let expected = expected_body_facts(cfg, &members);
    let facts = scan_body(config, body).expect("scan_body accepts a valid object");
    let got: Expected = (
        facts.rank.map(|r| r.map_err(|e| e.field)),
        facts.key.as_deref().map(<[u8]>::to_vec),
        facts.room,
    );
    assert_eq!(
        got,
        expected,
        "config {cfg:?}\nbody {}",
        String::from_utf8_lossy(body)
    );
}

/// Random edits of a document (so most of the input stays JSON-shaped).
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Delete(usize, usize),
    Truncate(usize),
    Duplicate(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting = select(b"{}[]\",:\\u0123456789-+.eEtfnl \n".to_vec());
    let byte = prop_oneof![3 => interesting, 1 => any::<u8>()];
    prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), byte).prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1usize..8).prop_map(|(i, n)| Mutation::Delete(i, n)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), 1usize..40).prop_map(|(i, n)| Mutation::Duplicate(i, n)),
    ]
}

fn mutate(mut b: Vec<u8>, edits: &[Mutation]) -> Vec<u8> {
    for m in edits {
        let len = b.len();
        let at = |i: usize| if len == 0 { 0 } else { i % (len + 1) };
        match *m {
            Mutation::Flip(i, c) if len > 0 => b[i % len] = c,
            Mutation::Flip(..) => {}
            Mutation::Insert(i, c) => b.insert(at(i), c),
            Mutation::Delete(i, n) => {
                let s = at(i);
                b.drain(s..(s + n).min(len));
            }
            Mutation::Truncate(i) => b.truncate(at(i)),
            Mutation::Duplicate(i, n) => {
                let s = at(i);
                let piece = b[s..(s + n).min(len)].to_vec();
                let d = (s + n).min(len);
                b.splice(d..d, piece);
            }
        }
    }
    b
}

/// No panic on any input; agreement with serde whenever serde sees an object.
fn scan_anything(body: &[u8]) {
    let _ = scan_top_level(body, &WANTED, |_, _| {});
    let config = Config::from_json(br#"{"dp_size":4,"assign":{"mode":"bootstrap_room"}}"#)
        .expect("valid test config");
    let scanned = scan_body(&config, body);
    if let Ok(J::Object(obj)) = serde_json::from_slice::<J>(body) {
        check_scan_against_serde(body, &obj, false);
        assert!(scanned.is_ok(), "scan_body refused a valid object");
    }
}

proptest! {
    #![proptest_config(cases(256))]

    /// Random valid objects, written three ways (randomly formatted and escaped by hand, compact
    /// and pretty by serde): the scanner reports exactly serde's top-level members, and
    /// `scan_body` picks the rank, key and room the documented rules derive from serde's view.
    #[test]
    fn scanner_agrees_with_serde_on_valid_objects(
        members in top_object(),
        seed in any::<u64>(),
        cfg in body_cfg(),
    ) {
        let order: Vec<String> = members.iter().map(|(k, _)| k.clone()).collect();
        let doc = Node::Obj(members);
        let body = Emitter::new(seed).document(&doc);
        let parsed: J = serde_json::from_slice(&body).unwrap_or_else(|e| {
            panic!("generator wrote invalid JSON ({e}): {}", String::from_utf8_lossy(&body))
        });
        let obj = parsed.as_object().expect("an object");
        prop_assert_eq!(obj.len(), order.len(), "generated names are distinct");
        let config = cfg.config();

        check_scan_against_serde(&body, obj, true);
        let minus_zero: Vec<String> = doc_members(&doc)
            .filter(|(_, v)| matches!(v, Node::Num(raw) if raw == "-0"))
            .map(|(k, _)| k.clone())
            .collect();
        check_body_against_serde(&cfg, &config, &body, &order, &minus_zero);

        // serde's own serialisations: member order is the map's (sorted) order.
        let map_order: Vec<String> = obj.keys().cloned().collect();
        for again in [
            serde_json::to_vec(&parsed).expect("serialise"),
            serde_json::to_vec_pretty(&parsed).expect("serialise"),
        ] {
            // Re-parsed: serde_json's default float parsing is not correctly rounded, so a float
            // printed and read back can differ in the last bit from the first parse.
            let reparsed: serde_json::Map<String, J> =
                serde_json::from_slice(&again).expect("serde reads its own output");
            check_scan_against_serde(&again, &reparsed, true);
            check_body_against_serde(&cfg, &config, &again, &map_order, &[]);
        }
    }

    /// Arbitrary bytes never panic the scanner.
    #[test]
    fn scanner_never_panics_on_arbitrary_bytes(body in vec(any::<u8>(), 0..512)) {
        scan_anything(&body);
    }

    /// Edited valid documents (truncated, bytes flipped, pieces duplicated — which may create
    /// duplicate members): never a panic, and when serde still sees an object the scanner accepts
    /// it and its last report per name is serde's value (both keep the last duplicate).
    #[test]
    fn scanner_agrees_with_serde_on_mutated_documents(
        members in top_object(),
        seed in any::<u64>(),
        edits in vec(mutation(), 1..4),
    ) {
        let body = Emitter::new(seed).document(&Node::Obj(members));
        scan_anything(&mutate(body, &edits));
    }
}

/// `members` followed by one more occurrence of a member's name per `dups` entry, with its value
/// (none for an empty object).
fn with_duplicates(
    mut members: Vec<(String, Node)>,
    dups: Vec<(proptest::sample::Index, Node)>,
) -> Vec<(String, Node)> {
    for (at, value) in dups {
        if members.is_empty() {
            break;
        }
        let name = members[at.index(members.len())].0.clone();
        members.push((name, value));
    }
    members
}

/// The serde value of one generated node (each occurrence of a duplicated member has its own).
fn node_to_serde(n: &Node) -> J {
    serde_json::from_slice(&Emitter::new(0).document(n)).expect("generated JSON is valid")
}

/// The case proptest found (2026-12-08): a rank written `-0` is rank 0 to Python and to the
/// filter; the oracle read serde's float -0.0 as no rank. `-0.0` stays a float to all.
#[test]
fn a_rank_written_minus_zero_is_rank_zero() {
    let cfg = BodyCfg {
        dp_size: 1,
        explicit: true,
        key_fields: Vec::new(),
        room_mode: false,
    };
    let order = vec![RANK_FIELDS[0].to_string()];
    let body = format!(r#"{{"{}":-0}}"#, RANK_FIELDS[0]);
    check_body_against_serde(&cfg, &cfg.config(), body.as_bytes(), &order, &order);
    let facts = scan_body(&cfg.config(), body.as_bytes()).expect("valid object");
    assert_eq!(facts.rank.map(|r| r.map_err(|e| e.field)), Some(Ok(0)));
    let float = format!(r#"{{"{}":-0.0}}"#, RANK_FIELDS[0]);
    check_body_against_serde(&cfg, &cfg.config(), float.as_bytes(), &order, &[]);
}

/// A member's value as the engine's Python reads it: serde's, but the integer `-0` is 0
/// (serde reads the float -0.0).
fn python_value(n: &Node) -> J {
    match n {
        Node::Num(raw) if raw == "-0" => J::from(0u64),
        _ => node_to_serde(n),
    }
}

/// The members of an object node (none for any other node).
fn doc_members(doc: &Node) -> impl Iterator<Item = &(String, Node)> {
    match doc {
        Node::Obj(members) => members.as_slice(),
        _ => &[],
    }
    .iter()
}

proptest! {
    #![proptest_config(cases(256))]

    /// Objects with duplicated members: the scanner reports every occurrence and its last one per
    /// name is serde's value (serde keeps the last duplicate); `scan_body`'s explicit rank follows
    /// the documented rule over each field's last occurrence, as the engine's Python dict keeps
    /// it (null = absent, the first invalid field in list order, or one disagreeing with an
    /// earlier field, is the error).
    #[test]
    fn scanner_agrees_with_serde_on_duplicate_members(
        members in top_object(),
        dups in vec((any::<proptest::sample::Index>(), top_value()), 1..4),
        seed in any::<u64>(),
        cfg in body_cfg(),
    ) {
        let mut members = members;
        if members.is_empty() {
            members.push((RANK_FIELDS[0].to_string(), Node::Num("1".into())));
        }
        let members = with_duplicates(members, dups);
        let in_order: Vec<(String, J)> =
            members.iter().map(|(k, v)| (k.clone(), python_value(v))).collect();
        let body = Emitter::new(seed).document(&Node::Obj(members));
        let obj: serde_json::Map<String, J> = serde_json::from_slice(&body).unwrap_or_else(|e| {
            panic!("generator wrote invalid JSON ({e}): {}", String::from_utf8_lossy(&body))
        });
        check_scan_against_serde(&body, &obj, false);

        let refs: Vec<(String, &J)> = in_order.iter().map(|(k, v)| (k.clone(), v)).collect();
        let (want_rank, _, _) = expected_body_facts(&cfg, &refs);
        let facts = scan_body(&cfg.config(), &body).expect("valid object");
        prop_assert_eq!(
            facts.rank.map(|r| r.map_err(|e| e.field)),
            want_rank,
            "config {:?}\nbody {}",
            cfg,
            String::from_utf8_lossy(&body)
        );
    }
}

/// Hand-picked decoys and escapes the generator hits only by chance.
#[test]
fn scanner_handles_escaped_names_and_astral_escapes() {
    let body = br#"{"routing\u005Fkey":"\ud83d\ude00\u00e9\/","x":{"user":"nested"},"us\u0065r":"\"user\":\"no\"","a":["routed_dp_rank",{"routed_dp_rank":3}]}"#;
    let obj: serde_json::Map<String, J> = serde_json::from_slice(body).expect("valid");
    check_scan_against_serde(body, &obj, true);
    let config = Config::from_json(br#"{"dp_size":4}"#).expect("valid");
    let facts = scan_body(&config, body).expect("valid");
    assert_eq!(facts.rank, None, "nested and quoted rank fields are decoys");
    assert_eq!(facts.key.as_deref(), Some("😀é/".as_bytes()));
}

/// README: "within one field, the last duplicate wins as in Python's and serde's parsers".
/// `scan_body` keeps the last *non-empty string* occurrence instead, so an earlier value survives
/// a later empty string or non-string, where serde (and Python) see no usable key in that field.
#[test]
fn duplicate_key_field_last_occurrence_wins_like_serde() {
    let config = Config::from_json(br#"{"dp_size":4}"#).expect("valid");
    for body in [
        &br#"{"routing_key":"a","routing_key":""}"#[..],
        &br#"{"routing_key":"a","routing_key":5}"#[..],
        &br#"{"routing_key":"a","routing_key":null}"#[..],
    ] {
        let serde: J = serde_json::from_slice(body).expect("valid");
        assert!(!serde["routing_key"].is_string() || serde["routing_key"] == "");
        let facts = scan_body(&config, body).expect("valid");
        assert_eq!(
            facts.key,
            None,
            "{}: serde sees no usable routing_key",
            String::from_utf8_lossy(body)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The body rewrite (`body_rewrite::rewrite`) against serde_json
// ---------------------------------------------------------------------------------------------

/// An edit under test: the member to give a rank, and the members to remove.
#[derive(Debug, Clone)]
struct EditCase {
    set: Option<(&'static str, u32)>,
    remove: Vec<String>,
}

fn edit_case() -> impl Strategy<Value = EditCase> {
    let rank = prop_oneof![3 => 0u32..16, 1 => any::<u32>()];
    let set = proptest::option::of((select(RANK_FIELDS.to_vec()), rank));
    let removable = RANK_FIELDS
        .iter()
        .chain(&KEY_FIELDS)
        .chain(&[ROOM_FIELD])
        .map(|s| s.to_string())
        .collect::<Vec<_>>();
    (set, proptest::sample::subsequence(removable, 0..=3))
        .prop_map(|(set, remove)| EditCase { set, remove })
}

/// What `rewrite` must make of a body serde reads as `before` (each member's last occurrence),
/// whose members occur under the names in `names` (duplicates included): the rank member set to
/// the rank (inserted when absent), every removed member gone, every other member unchanged; and
/// the rewritten text itself an object serde reads as that.
fn check_rewrite_against_serde(body: &[u8], names: &[String], edit: &EditCase) {
    let before: serde_json::Map<String, J> = serde_json::from_slice(body).expect("an object");
    let set_name = edit.set.map(|(n, _)| n);
    let removed_here = |k: &str| set_name != Some(k) && edit.remove.iter().any(|r| r == k);
    let mut want = before.clone();
    want.retain(|k, _| !removed_here(k));
    if let Some((name, rank)) = edit.set {
        want.insert(name.to_string(), J::from(rank));
    }
    let result = rewrite(
        body,
        RankEdit {
            set: edit.set,
            remove: &edit.remove,
        },
    );
    let shown = String::from_utf8_lossy(body);
    let rewritten = match result {
        Ok(Some(r)) => r,
        Ok(None) => {
            assert_eq!(
                want, before,
                "nothing changed, but the edit changes {shown}"
            );
            return;
        }
        Err(e) => panic!("serde reads an object, the rewrite refused it ({e:?}): {shown}"),
    };
    let after: serde_json::Map<String, J> =
        serde_json::from_slice(&rewritten.body).unwrap_or_else(|e| {
            panic!(
                "the rewrite wrote no JSON object ({e}): {shown}\n -> {}",
                String::from_utf8_lossy(&rewritten.body)
            )
        });
    assert_eq!(
        after,
        want,
        "{edit:?} on {shown}\n -> {}",
        String::from_utf8_lossy(&rewritten.body)
    );
    let occurrences = names.iter().filter(|n| removed_here(n)).count();
    assert_eq!(rewritten.removed, occurrences, "{edit:?} on {shown}");
    if !rewritten.rank_set {
        let (name, rank) = edit.set.map_or(("", 0), |s| s);
        assert!(
            edit.set.is_none() || before.get(name) == Some(&J::from(rank)),
            "rank_set false, yet {name} did not hold {rank}: {shown}"
        );
    }
}

proptest! {
    #![proptest_config(cases(256))]

    /// Random valid objects, duplicated members included, randomly formatted and escaped: the
    /// rewrite does to serde's view exactly what the edit says, and writes valid JSON.
    #[test]
    fn rewrite_agrees_with_serde(
        members in top_object(),
        dups in vec((any::<proptest::sample::Index>(), top_value()), 0..3),
        seed in any::<u64>(),
        edit in edit_case(),
    ) {
        let members = with_duplicates(members, dups);
        let names: Vec<String> = members.iter().map(|(k, _)| k.clone()).collect();
        let body = Emitter::new(seed).document(&Node::Obj(members));
        check_rewrite_against_serde(&body, &names, &edit);
    }

    /// Edited documents: never a panic, and whenever serde still reads an object, the rewrite
    /// accepts it and agrees with serde as above.
    #[test]
    fn rewrite_agrees_with_serde_on_mutated_documents(
        members in top_object(),
        seed in any::<u64>(),
        edits in vec(mutation(), 1..4),
        edit in edit_case(),
    ) {
        let body = mutate(Emitter::new(seed).document(&Node::Obj(members)), &edits);
        let result = rewrite(&body, RankEdit { set: edit.set, remove: &edit.remove });
        if let Ok(J::Object(_)) = serde_json::from_slice::<J>(&body) {
            // The names as the scanner unescapes them, in order, duplicates included.
            let mut names = Vec::new();
            let all: Vec<&str> = RANK_FIELDS.iter().chain(&KEY_FIELDS).chain(&[ROOM_FIELD]).copied().collect();
            scan_top_level(&body, &all, |i, _| names.push(all[i].to_string()))
                .expect("the scanner reads what serde reads");
            check_rewrite_against_serde(&body, &names, &edit);
        } else {
            drop(result);
        }
    }
}

// =============================================================================================
// 2. The affinity table under compare-and-swap races, against a reference model
// =============================================================================================

/// In-memory store with Envoy's shared-data CAS semantics: a write with a token succeeds only if
/// the key's token is unchanged (a missing key ignores the token); `None` writes unconditionally.
/// Queued rival pins run inside `set`, before the CAS check: another worker that pinned between
/// our read and our write (its write bumps the token, so ours fails if it touched our bucket).
struct RaceStore {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_token: Cell<u32>,
    rival_table: AffinityTable,
    rivals: RefCell<VecDeque<(u64, u32)>>,
    rivals_run: Cell<u32>,
    in_rival: Cell<bool>,
    now: Cell<u32>,
}

impl RaceStore {
    fn new(table: &AffinityTable) -> Self {
        RaceStore {
            map: RefCell::default(),
            next_token: Cell::new(0),
            rival_table: table.clone(),
            rivals: RefCell::default(),
            rivals_run: Cell::new(0),
            in_rival: Cell::new(false),
            now: Cell::new(0),
        }
    }

    fn total_bytes(&self) -> usize {
        self.map.borrow().values().map(|(v, _)| v.len()).sum()
    }
}

impl Store for RaceStore {
    fn get(&self, key: &str) -> Stored {
        match self.map.borrow().get(key) {
            Some((v, token)) => (Some(v.clone()), Some(*token)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        if !self.in_rival.get() {
            let rival = self.rivals.borrow_mut().pop_front();
            if let Some((hash, rank)) = rival {
                self.in_rival.set(true);
                let ev = self.rival_table.pin(self, hash, rank, self.now.get());
                self.in_rival.set(false);
                assert_eq!(ev.cas_exhausted, 0, "a rival pin never races itself");
                self.rivals_run.set(self.rivals_run.get() + 1);
            }
        }
        let current = self.map.borrow().get(key).map(|(_, t)| *t);
        if let (Some(want), Some(have)) = (cas, current) {
            if want != have {
                return Err(StoreError::CasMismatch);
            }
        }
        let token = self.next_token.get() + 1;
        self.next_token.set(token);
        self.map
            .borrow_mut()
            .insert(key.to_string(), (value.to_vec(), token));
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    hash: u64,
    last_used: u32,
    rank: u16,
}

/// How the table stores a rank: in the 12 low bits of its rank field (`dp_size` is at most
/// 4096), larger ones as 4095; the affinity table's pins leave the 4 tag bits above at 0.
fn stored_rank(rank: u32) -> u16 {
    u16::try_from(rank).map_or(4095, |r| r.min(4095))
}

/// Decodes a bucket as the documented layout (`hash u64 | last_used u32 | rank u16 | 0u16`, LE;
/// the affinity table writes no tag and no flags).
fn decode(bytes: &[u8]) -> Vec<Entry> {
    assert_eq!(bytes.len() % 16, 0, "a bucket is whole entries");
    bytes
        .chunks_exact(16)
        .map(|c| {
            assert_eq!(&c[14..16], &[0, 0], "reserved bytes are zero");
            Entry {
                hash: u64::from_le_bytes(c[0..8].try_into().expect("8 bytes")),
                last_used: u32::from_le_bytes(c[8..12].try_into().expect("4 bytes")),
                rank: u16::from_le_bytes(c[12..14].try_into().expect("2 bytes")),
            }
        })
        .collect()
}

/// Reference model: per-bucket LRU with TTL, in plain vectors, with the same race outcomes
/// (a queued rival pin runs at each write; our write fails if the rival wrote our bucket).
/// Also keeps the history the LRU invariant is stated over.
struct Model<'t> {
    table: &'t AffinityTable,
    cfg: TableConfig,
    buckets: Vec<Vec<Entry>>,
    /// Latest successful write touching each key (pin or refresh), by anyone; kept after unpin.
    last_touch: HashMap<u64, u32>,
    /// Keys pinned and not unpinned since: (time of the last touch, rank of the last pin).
    pins: HashMap<u64, (u32, u16)>,
    rivals_run: u32,
}

impl<'t> Model<'t> {
    fn new(table: &'t AffinityTable, cfg: TableConfig) -> Self {
        Model {
            table,
            buckets: vec![Vec::new(); cfg.buckets as usize],
            cfg,
            last_touch: HashMap::new(),
            pins: HashMap::new(),
            rivals_run: 0,
        }
    }

    fn bucket(&self, hash: u64) -> usize {
        self.table.bucket_of(hash) as usize
    }

    fn live(&self, e: &Entry, now: u32) -> bool {
        now.saturating_sub(e.last_used) < self.cfg.ttl_seconds
    }

    fn touch(&mut self, hash: u64, now: u32, pinned: Option<u16>) {
        self.last_touch.insert(hash, now);
        match pinned {
            Some(rank) => {
                self.pins.insert(hash, (now, rank));
            }
            None => {
                if let Some(p) = self.pins.get_mut(&hash) {
                    p.0 = now;
                }
            }
        }
    }

    /// LRU insert: update in place; else drop expired, evict the least recently used (first of
    /// equals) when full, append. Returns the evictions.
    fn pin_into(&self, entries: &mut Vec<Entry>, hash: u64, rank: u16, now: u32) -> u32 {
        if let Some(e) = entries.iter_mut().find(|e| e.hash == hash) {
            e.rank = rank;
            e.last_used = now;
            return 0;
        }
        entries.retain(|e| self.live(e, now));
        let mut evictions = 0;
        if entries.len() >= self.cfg.ways as usize {
            let oldest = entries.iter().map(|e| e.last_used).min().expect("full");
            let at = entries
                .iter()
                .position(|e| e.last_used == oldest)
                .expect("present");
            entries.remove(at);
            evictions = 1;
        }
        entries.push(Entry {
            hash,
            last_used: now,
            rank,
        });
        evictions
    }

    fn rival_pin(&mut self, hash: u64, rank: u32, now: u32) {
        let rank = stored_rank(rank);
        let b = self.bucket(hash);
        let mut entries = self.buckets[b].clone();
        self.pin_into(&mut entries, hash, rank, now);
        self.buckets[b] = entries;
        self.touch(hash, now, Some(rank));
        self.rivals_run += 1;
    }

    /// One write of `entries` to bucket `b`: whether it landed.
    fn write(
        &mut self,
        b: usize,
        entries: Vec<Entry>,
        rivals: &mut VecDeque<(u64, u32)>,
        now: u32,
    ) -> bool {
        if let Some((hash, rank)) = rivals.pop_front() {
            self.rival_pin(hash, rank, now);
            if self.bucket(hash) == b {
                return false;
            }
        }
        self.buckets[b] = entries;
        true
    }

    fn pin(
        &mut self,
        hash: u64,
        rank: u32,
        now: u32,
        rivals: &mut VecDeque<(u64, u32)>,
    ) -> TableEvents {
        let rank = stored_rank(rank);
        let b = self.bucket(hash);
        let mut ev = TableEvents::default();
        for attempt in 0..=self.cfg.cas_retries {
            let mut entries = self.buckets[b].clone();
            let evictions = self.pin_into(&mut entries, hash, rank, now);
            if self.write(b, entries, rivals, now) {
                ev.evictions += evictions;
                self.touch(hash, now, Some(rank));
                return ev;
            }
            if attempt < self.cfg.cas_retries {
                ev.cas_retries += 1;
            }
        }
        ev.cas_exhausted += 1;
        ev
    }

    /// (whether our write removed the pin, events)
    fn unpin(
        &mut self,
        hash: u64,
        rank: u32,
        now: u32,
        rivals: &mut VecDeque<(u64, u32)>,
    ) -> (bool, TableEvents) {
        let b = self.bucket(hash);
        let mut ev = TableEvents::default();
        for attempt in 0..=self.cfg.cas_retries {
            let mut entries = self.buckets[b].clone();
            let before = entries.len();
            entries.retain(|e| !(e.hash == hash && u32::from(e.rank) == rank));
            if entries.len() == before {
                return (false, ev);
            }
            if self.write(b, entries, rivals, now) {
                self.pins.remove(&hash);
                return (true, ev);
            }
            if attempt < self.cfg.cas_retries {
                ev.cas_retries += 1;
            }
        }
        ev.cas_exhausted += 1;
        (false, ev)
    }

    fn lookup(
        &mut self,
        hash: u64,
        now: u32,
        dp_size: u32,
        rivals: &mut VecDeque<(u64, u32)>,
    ) -> Lookup {
        let b = self.bucket(hash);
        let Some(pos) = self.buckets[b].iter().position(|e| e.hash == hash) else {
            return Lookup::Miss;
        };
        let e = self.buckets[b][pos];
        if !self.live(&e, now) || u32::from(e.rank) >= dp_size {
            return Lookup::Miss;
        }
        if now.saturating_sub(e.last_used) >= self.cfg.refresh_seconds.max(1) {
            let mut entries = self.buckets[b].clone();
            entries[pos].last_used = now;
            if self.write(b, entries, rivals, now) {
                self.touch(hash, now, None);
            }
        }
        Lookup::Hit {
            rank: u32::from(e.rank),
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Pin {
        key: usize,
        rank: u32,
    },
    Lookup {
        key: usize,
    },
    /// `rank: None` unpins the key's current rank (as the filter does after a failure).
    Unpin {
        key: usize,
        rank: Option<u32>,
    },
    Advance(u32),
}

#[derive(Debug, Clone)]
struct Step {
    op: Op,
    /// Rival pins, one per write this step makes (pin retries consume several).
    rivals: Vec<(usize, u32)>,
}

#[derive(Debug, Clone)]
struct TableCase {
    cfg: TableConfig,
    dp_size: u32,
    keys: Vec<u64>,
    steps: Vec<Step>,
}

fn table_case() -> impl Strategy<Value = TableCase> {
    (1u32..=4, 1u32..=4, 1u32..=30, 0u32..=3, 0u32..=3, 1u32..=4)
        .prop_flat_map(|(buckets, ways, ttl, refresh, retries, dp_size)| {
            let cfg = TableConfig {
                buckets,
                ways,
                ttl_seconds: ttl,
                refresh_seconds: refresh,
                cas_retries: retries,
                namespace: "prop".into(),
            };
            let n_keys = 2usize..=10;
            (Just(cfg), Just(dp_size), vec(any::<u64>(), n_keys)).prop_flat_map(
                move |(cfg, dp_size, keys)| {
                    let k = keys.len();
                    let rank = prop_oneof![
                        10 => 0..dp_size,
                        2 => dp_size..dp_size + 2, // pinned but out of range: a miss
                        1 => Just(70_000u32), // beyond 12 bits: stored as 4095, never a hit
                    ];
                    let op = prop_oneof![
                        4 => (0..k, rank.clone()).prop_map(|(key, rank)| Op::Pin { key, rank }),
                        4 => (0..k).prop_map(|key| Op::Lookup { key }),
                        1 => (0..k, proptest::option::of(rank.clone()))
                            .prop_map(|(key, rank)| Op::Unpin { key, rank }),
                        2 => prop_oneof![3 => 0u32..3, 1 => 0u32..40].prop_map(Op::Advance),
                    ];
                    let rivals = prop_oneof![
                        3 => Just(Vec::new()),
                        1 => vec((0..k, rank), 1..=(cfg.cas_retries as usize + 2)),
                    ];
                    let steps = vec(
                        (op, rivals).prop_map(|(op, rivals)| Step { op, rivals }),
                        1..80,
                    );
                    (Just(cfg), Just(dp_size), Just(keys), steps)
                },
            )
        })
        .prop_map(|(cfg, dp_size, keys, steps)| TableCase {
            cfg,
            dp_size,
            keys,
            steps,
        })
}

fn run_table_case(case: &TableCase) -> Result<(), TestCaseError> {
    let cfg = &case.cfg;
    let table = AffinityTable::new(cfg.clone());
    let store = RaceStore::new(&table);
    prop_assert_eq!(table.ensure_buckets(&store), cfg.buckets);
    let mut model = Model::new(&table, cfg.clone());
    let bound = (cfg.buckets * cfg.ways) as usize * 16 + 1; // + the 1-byte ready marker
    let mut now: u32 = 1_000;

    for (i, step) in case.steps.iter().enumerate() {
        let rivals: VecDeque<(u64, u32)> = step
            .rivals
            .iter()
            .map(|&(k, r)| (case.keys[k], r))
            .collect();
        *store.rivals.borrow_mut() = rivals.clone();
        store.now.set(now);
        let mut model_rivals = rivals;
        let ctx = format!("step {i}: {step:?} at t={now}");
        match step.op {
            Op::Advance(dt) => now += dt,
            Op::Pin { key, rank } => {
                let hash = case.keys[key];
                let got = table.pin(&store, hash, rank, now);
                let want = model.pin(hash, rank, now, &mut model_rivals);
                prop_assert_eq!(got, want, "{}", ctx);
            }
            Op::Lookup { key } => {
                let hash = case.keys[key];
                let got = table.lookup(&store, hash, now, case.dp_size);
                let want = model.lookup(hash, now, case.dp_size, &mut model_rivals);
                prop_assert_eq!(got, want, "{}", ctx);
                if let Lookup::Hit { rank } = got {
                    prop_assert!(rank < case.dp_size, "{}: rank {} out of range", ctx, rank);
                }
            }
            Op::Unpin { key, rank } => {
                let hash = case.keys[key];
                let rank =
                    rank.unwrap_or_else(|| model.pins.get(&hash).map_or(0, |&(_, r)| u32::from(r)));
                let (removed, got) = table.unpin(&store, hash, rank);
                let (want_removed, want) = model.unpin(hash, rank, now, &mut model_rivals);
                prop_assert_eq!(got, want, "{}", ctx);
                if got.cas_exhausted == 0 {
                    // When every retry was lost, `unpin` reports `true` although nothing was
                    // removed (see `unpin_reports_removed_only_when_written`).
                    prop_assert_eq!(removed, want_removed, "{}", ctx);
                }
            }
        }
        store.rivals.borrow_mut().clear();
        prop_assert_eq!(
            store.rivals_run.get(),
            model.rivals_run,
            "{}: rivals run",
            ctx
        );

        // The bound holds by construction.
        prop_assert!(
            store.total_bytes() <= bound,
            "{}: {} bytes > {}",
            ctx,
            store.total_bytes(),
            bound
        );
        // The store holds exactly the model's buckets (no update lost, no entry invented).
        for b in 0..cfg.buckets {
            let bytes = store.get(&table.bucket_key(b)).0.unwrap_or_default();
            prop_assert!(
                bytes.len() <= cfg.ways as usize * 16,
                "{}: bucket {} too big",
                ctx,
                b
            );
            let entries = decode(&bytes);
            prop_assert_eq!(
                &entries,
                &model.buckets[b as usize],
                "{}: bucket {}",
                ctx,
                b
            );
        }
        // LRU keeps every recent pin: a pinned key (not unpinned since) still within its TTL, with
        // fewer than `ways` other keys of its bucket written at or after its own last write, is
        // present with the rank of its last pin. (With a strictly advancing clock: the last `ways`
        // distinct keys written to a bucket within TTL are all present.)
        for (&hash, &(t, rank)) in &model.pins {
            if now.saturating_sub(t) >= cfg.ttl_seconds {
                continue;
            }
            let b = model.bucket(hash);
            let newer = model
                .last_touch
                .iter()
                .filter(|&(&k, &tk)| k != hash && model.bucket(k) == b && tk >= t)
                .count();
            if newer < cfg.ways as usize {
                let bytes = store.get(&table.bucket_key(b as u32)).0.unwrap_or_default();
                let entries = decode(&bytes);
                prop_assert!(
                    entries
                        .iter()
                        .any(|e| e.hash == hash && e.rank == rank && e.last_used == t),
                    "{}: pin {:#x} -> {} (t={}) lost; bucket {:?}",
                    ctx,
                    hash,
                    rank,
                    t,
                    entries
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(256))]

    /// Random pins, lookups, unpins and clock steps, with rival pins interleaved between our reads
    /// and writes: the table matches the model exactly and keeps its bound and LRU guarantees.
    #[test]
    fn table_matches_model_under_cas_races(case in table_case()) {
        run_table_case(&case)?;
    }
}

/// `unpin` documents "Returns whether a pin was removed". When every compare-and-swap attempt
/// loses (`cas_exhausted`), nothing was written, yet it returns `true` (the filter would count an
/// `unpinned` that did not happen).
#[test]
fn unpin_reports_removed_only_when_written() {
    let cfg = TableConfig {
        buckets: 1,
        ways: 4,
        ttl_seconds: 100,
        refresh_seconds: 1,
        cas_retries: 0,
        namespace: "t".into(),
    };
    let table = AffinityTable::new(cfg);
    let store = RaceStore::new(&table);
    table.ensure_buckets(&store);
    store.now.set(10);
    table.pin(&store, 42, 1, 10);
    // Another worker pins key 7 (same bucket) between our read and our write.
    store.rivals.borrow_mut().push_back((7, 2));
    let (removed, ev) = table.unpin(&store, 42, 1);
    assert_eq!(ev.cas_exhausted, 1);
    assert_eq!(
        table.lookup(&store, 42, 10, 4),
        Lookup::Hit { rank: 1 },
        "pin still there"
    );
    assert!(!removed, "unpin said it removed a pin it did not remove");
}

// =============================================================================================
// 3. The configuration parser on random input
// =============================================================================================

const TOP_FIELDS: [&str; 10] = [
    "dp_size",
    "assign",
    "explicit_rank",
    "routing_key",
    "body",
    "target",
    "learn",
    "echo_header",
    "table",
    "prefix",
];

fn section_fields(name: &str) -> &'static [&'static str] {
    match name {
        "assign" => &[
            "mode",
            "seed",
            "load_factor",
            "pinned_load_factor",
            "min_capacity",
            "cooldown_seconds",
            "failure_threshold",
            "failure_window_seconds",
            "room_field",
        ],
        "explicit_rank" => &[
            "enabled",
            "header",
            "body_fields",
            "on_invalid",
            "trusted_header",
            "trusted_secret",
        ],
        "routing_key" => &["headers", "body_fields", "max_bytes", "hash_seed"],
        "body" => &["max_bytes", "content_types"],
        "target" => &[
            "mode",
            "cluster_header",
            "cluster_template",
            "engine_header",
        ],
        "learn" => &["response_header", "upstream_addresses"],
        "table" => &[
            "buckets",
            "ways",
            "ttl_seconds",
            "refresh_seconds",
            "cas_retries",
            "namespace",
        ],
        "prefix" => &[
            "enabled",
            "block_bytes",
            "block_tokens",
            "max_blocks",
            "min_match_blocks",
            "sticky_blocks",
            "shared_slack",
            "load_blocks",
            "home_blocks",
            "grid_bits",
            "table",
        ],
        _ => &[],
    }
}

fn config_string() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => select(vec![
            "", " ", "x-routing-key", "X-Session-ID", "bad header", "x:y", "dp-rank-{rank}",
            "{rank}", "rank", "{rank}{rank}", "a b{rank}", "\u{e9}{rank}", "\u{0}{rank}",
            "envoy", "hash", "least_inflight", "round_robin", "bootstrap_room", "random",
            "cluster", "engine_header", "reject", "ignore", "application/json", "json",
            "a/b;c", " Application/JSON ", "user", "routing_key", "routed_dp_rank",
            "data_parallel_rank", "ns", "a b", "1.2.3.4:80", "x-dp-rank", "X-Router-Token", "hunter2",
            "x-data-parallel-rank", "X-DP-Affinity-Cluster", "x-smg-routing-key", "Content-Type",
        ])
        .prop_map(String::from),
        1 => json_string(),
    ]
}

fn config_number() -> impl Strategy<Value = J> {
    prop_oneof![
        4 => (0u64..70).prop_map(J::from),
        1 => (-5i64..0).prop_map(J::from),
        1 => select(vec![
            4096u64, 4097, 65_536, 1 << 20, (1 << 20) + 1, 1 << 24, (1 << 24) + 1, u64::from(u32::MAX),
            u64::from(u32::MAX) + 1, u64::MAX,
        ])
        .prop_map(J::from),
        1 => any::<i64>().prop_map(J::from),
        2 => select(vec![
            0.0f64, -0.0, 0.5, 0.99, 1.0, 1.25, 2.0, 99.9, 100.0, 100.5, 1e308, -1e308, 1e-300,
            4.0,
        ])
        .prop_map(J::from),
        1 => any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(J::from),
    ]
}

fn config_leaf() -> impl Strategy<Value = J> {
    prop_oneof![
        1 => Just(J::Null),
        1 => any::<bool>().prop_map(J::Bool),
        3 => config_number(),
        3 => config_string().prop_map(J::String),
    ]
}

fn config_any() -> BoxedStrategy<J> {
    config_leaf()
        .prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                vec(inner.clone(), 0..4).prop_map(J::Array),
                vec((config_string(), inner), 0..4)
                    .prop_map(|kv| J::Object(kv.into_iter().collect())),
            ]
        })
        .boxed()
}

/// A value for a known field: mostly plausible shapes, sometimes anything.
fn field_value() -> BoxedStrategy<J> {
    prop_oneof![
        4 => config_leaf(),
        2 => vec(config_string().prop_map(J::String), 0..4).prop_map(J::Array),
        1 => vec(config_leaf(), 0..3).prop_map(J::Array),
        1 => vec((config_string(), config_number()), 0..4)
            .prop_map(|kv| J::Object(kv.into_iter().collect())),
        1 => config_any(),
    ]
    .boxed()
}

fn section(name: &'static str) -> BoxedStrategy<J> {
    let names = section_fields(name);
    let known = vec(
        (select(names.to_vec()).prop_map(String::from), field_value()),
        0..=names.len(),
    );
    let stray = vec((config_string(), config_any()), 0..2);
    prop_oneof![
        8 => known.clone().prop_map(|kv| J::Object(kv.into_iter().collect())),
        1 => (known, stray).prop_map(|(mut kv, extra)| {
            kv.extend(extra);
            J::Object(kv.into_iter().collect())
        }),
        1 => config_any(),
    ]
    .boxed()
}

fn config_document() -> impl Strategy<Value = J> {
    let dp_size = prop_oneof![
        6 => (1u64..=8).prop_map(J::from),
        1 => (0u64..5000).prop_map(J::from),
        1 => field_value(),
    ];
    let opt = |s: BoxedStrategy<J>| proptest::option::weighted(0.4, s);
    (
        proptest::option::weighted(0.9, dp_size),
        opt(section("assign")),
        opt(section("explicit_rank")),
        opt(section("routing_key")),
        opt(section("body")),
        opt(section("target")),
        opt(section("learn")),
        opt(field_value().boxed()),
        opt(section("table")),
        opt(section("prefix")),
        proptest::option::weighted(0.05, (config_string(), config_any())),
    )
        .prop_map(|(dp, a, e, k, b, t, l, echo, tbl, px, stray)| {
            let mut obj = serde_json::Map::new();
            for (name, v) in TOP_FIELDS.iter().zip([dp, a, e, k, b, t, l, echo, tbl, px]) {
                if let Some(v) = v {
                    obj.insert((*name).to_string(), v);
                }
            }
            if let Some((k, v)) = stray {
                obj.insert(k, v);
            }
            J::Object(obj)
        })
}

/// What a configuration that was accepted must satisfy.
fn check_config_result(bytes: &[u8]) {
    match Config::from_json(bytes) {
        Ok(c) => {
            assert!((1..=dp_affinity::config::MAX_DP_SIZE).contains(&c.dp_size));
            assert_eq!(c.cluster_names.len(), c.dp_size as usize);
            assert!(c
                .cluster_names
                .iter()
                .all(|n| !n.is_empty() && n.bytes().all(|b| (0x21..0x7f).contains(&b))));
            assert!((1..=dp_affinity::config::MAX_BUCKETS).contains(&c.table.buckets));
            assert!((1..=dp_affinity::config::MAX_BUCKETS).contains(&c.prefix.table.buckets));
            assert!((1..=64).contains(&c.table.ways));
            assert!(c.table.ttl_seconds >= 2 && c.table.cas_retries <= 100);
            // An entry in use is refreshed before it expires.
            for t in [&c.table, &c.prefix.table] {
                assert!(t.refresh_seconds.max(1) < t.ttl_seconds, "{t:?}");
            }
            assert!(c.key.max_bytes >= 1 && c.body.max_bytes >= 1);
            assert!(c.learn.upstream_addresses.values().all(|&r| r < c.dp_size));
            assert!(c.body.wanted_fields.iter().all(|f| !f.is_empty()));
            let p = &c.prefix;
            assert!((16..=65536).contains(&p.block_bytes) && (1..=16384).contains(&p.block_tokens));
            assert!((1..=p.max_blocks).contains(&p.min_match_blocks) && p.max_blocks <= 4096);
            assert!((1..=4096).contains(&p.sticky_blocks) && p.shared_slack <= 65536);
            assert!((1..=8).contains(&p.grid_bits) && (1..=64).contains(&p.table.ways));
            assert_ne!(p.table.namespace, c.table.namespace);
            assert_request_header_roles_distinct(&c);
            // A config that parses also drives the request path without panicking.
            let _ = scan_body(
                &c,
                br#"{"routed_dp_rank":0,"routing_key":"k","bootstrap_room":1}"#,
            );
            let chat = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;
            let _ = decide_body_with_prefix(&c, chat, None, true, Some(Api::Chat));
        }
        Err(e) => {
            // The field path is empty for an unknown member named "" (see
            // `unknown_empty_member_name_is_named`), so only the message is required here.
            assert!(
                !e.message.is_empty(),
                "{e:?} for {}",
                String::from_utf8_lossy(bytes)
            );
            assert!(e.to_string().starts_with("invalid plugin configuration: "));
        }
    }
}

/// An accepted configuration gives every request header one role: the key headers (one role,
/// duplicates allowed), the explicit-rank, trust and cluster headers, the engine header (which
/// may equal the explicit-rank header, SGLang's default), and the content-type and
/// content-length headers the filter reads itself.
fn assert_request_header_roles_distinct(c: &Config) {
    let mut names: Vec<&str> = c.key.headers.iter().map(String::as_str).collect();
    names.sort_unstable();
    names.dedup();
    names.extend(["content-type", "content-length"]);
    names.push(&c.explicit.header);
    names.extend(c.explicit.trust.as_ref().map(|t| t.header.as_str()));
    names.push(&c.cluster_header);
    if let Some(engine) = c.target.engine() {
        names.extend(
            engine
                .headers
                .iter()
                .filter(|h| **h != c.explicit.header)
                .map(String::as_str),
        );
    }
    let mut sorted = names.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(
        sorted.len(),
        names.len(),
        "two roles share a header: {names:?}"
    );
}

proptest! {
    #![proptest_config(cases(512))]

    /// Random objects with the real field names and random value types never panic the parser;
    /// accepted ones satisfy the documented bounds.
    #[test]
    fn config_parser_never_panics(doc in config_document()) {
        check_config_result(&serde_json::to_vec(&doc).expect("serialise"));
    }

    /// Arbitrary bytes, and edited config texts, never panic the parser.
    #[test]
    fn config_parser_never_panics_on_bytes(
        doc in config_document(),
        edits in vec(mutation(), 0..3),
        junk in vec(any::<u8>(), 0..64),
    ) {
        check_config_result(&junk);
        check_config_result(&mutate(serde_json::to_vec(&doc).expect("serialise"), &edits));
    }
}

/// A header name for one role: few names, in mixed case, so roles often collide.
fn role_header() -> impl Strategy<Value = &'static str> {
    select(vec![
        "x-a",
        "X-A",
        "x-b",
        "x-data-parallel-rank",
        "x-dp-affinity-cluster",
        "content-type",
    ])
}

proptest! {
    #![proptest_config(cases(256))]

    /// A configuration is refused exactly when two request-header roles share a name (compared
    /// case-insensitively; the key headers are one role; the engine header may be the
    /// explicit-rank header), and the error names both fields — or, for a header the filter
    /// sets or strips that is `content-type`, that one field.
    #[test]
    fn shared_header_names_are_refused(
        explicit in role_header(),
        keys in vec(role_header(), 0..3),
        cluster in role_header(),
        trust in proptest::option::of(role_header()),
        engine in proptest::option::of(role_header()),
    ) {
        let mut doc = serde_json::json!({
            "dp_size": 4,
            "explicit_rank": {"header": explicit},
            "routing_key": {"headers": keys},
            "target": {"cluster_header": cluster},
        });
        let mut roles = vec![
            ("content", "content-type"),
            ("explicit", explicit),
            ("cluster", cluster),
        ];
        roles.extend(keys.iter().map(|k| ("key", *k)));
        if let Some(t) = trust {
            doc["explicit_rank"]["trusted_header"] = J::from(t);
            doc["explicit_rank"]["trusted_secret"] = J::from("s");
            roles.push(("trust", t));
        }
        if let Some(e) = engine {
            doc["target"]["mode"] = J::from("engine_header");
            doc["target"]["engine_header"] = J::from(e);
            roles.push(("engine", e));
        }
        let shared = roles.iter().enumerate().any(|(i, (role, name))| {
            roles[..i].iter().any(|(other, other_name)| {
                let exempt = (*role == "key" && *other == "key")
                    || matches!((*role, *other), ("engine", "explicit") | ("explicit", "engine"));
                name.eq_ignore_ascii_case(other_name) && !exempt
            })
        });
        match Config::from_json(doc.to_string().as_bytes()) {
            Ok(_) => prop_assert!(!shared, "accepted {doc}"),
            Err(e) => {
                prop_assert!(shared, "{doc}: {e}");
                let fields = [
                    "the content-type header",
                    "explicit_rank.header",
                    "explicit_rank.trusted_header",
                    "routing_key.headers[",
                    "target.cluster_header",
                    "target.engine_header",
                ];
                let named = fields.iter().filter(|f| e.to_string().contains(*f)).count();
                // A header the filter sets or strips named `content-type` is refused for that
                // alone (it frames the message), naming the one field.
                let framing = e.to_string().contains("frames or routes the message itself");
                prop_assert!(named == if framing { 1 } else { 2 }, "{doc}: {e}");
            }
        }
    }
}

/// An unknown member with an empty name is refused, but the error names no field: the log line
/// reads `invalid plugin configuration: : unknown field; ...`.
#[test]
fn unknown_empty_member_name_is_named() {
    let e = Config::from_json(br#"{"dp_size":4,"":1}"#).expect_err("unknown field");
    assert!(!e.field.is_empty(), "{e}");
}
