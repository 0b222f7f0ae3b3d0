//! Plugin configuration: the JSON shape with its defaults, then a validation step that compiles it
//! into what the request path needs (lower-cased header names, a cluster name per rank, the hasher).
//!
//! Every knob has its default written once, here. Errors name the field and the allowed values, so
//! the single log line Envoy shows on a refused config says what to fix.

use std::collections::HashMap;
use std::fmt;
use std::mem;

use serde_json::Value;

use crate::assign::{Bound, Mode};
use crate::chain::PrefixHasher;
use crate::config_sections::{ConfigError, PrefixConfig, TableConfig};
use crate::hash::KeyedHasher;
use crate::json_scan::{ScanError, Scanner};
use crate::ranks::{StrikeRule, MAX_COOLDOWN_SECONDS};
use crate::table::MAX_WAYS;
use crate::target::{Engine, EngineTarget, PathTarget};

/// Upper bound on `dp_size`: far above any real DP deployment, low enough that a typo cannot make
/// the filter precompute millions of cluster names.
pub const MAX_DP_SIZE: u32 = 4096;
// Every rank allowed fits the rank field of an affinity table or prefix index entry.
const _: () = assert!(MAX_DP_SIZE <= crate::table::RANKS_HELD);

// ---------------------------------------------------------------------------------------------
// The JSON shape (what operators write), with every default.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct RawConfig {
    dp_size: Option<u32>,
    assign: RawAssign,
    explicit_rank: RawExplicitRank,
    routing_key: RawRoutingKey,
    body: RawBody,
    target: RawTarget,
    learn: RawLearn,
    echo_header: Option<String>,
    table: RawTable,
    prefix: RawPrefix,
}

#[derive(Debug)]
struct RawExplicitRank {
    enabled: bool,
    header: String,
    body_fields: Vec<String>,
    on_invalid: OnInvalid,
    trusted_header: String,
    trusted_secret: String,
}

impl Default for RawExplicitRank {
    fn default() -> Self {
        RawExplicitRank {
            enabled: true,
            header: "x-data-parallel-rank".into(),
            body_fields: vec!["routed_dp_rank".into(), "data_parallel_rank".into()],
            on_invalid: OnInvalid::Reject,
            trusted_header: String::new(),
            trusted_secret: String::new(),
        }
    }
}

/// What to do with an explicit rank that is present but not a valid rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnInvalid {
    /// Answer 400 with a JSON error naming the field and the allowed range.
    Reject,
    /// Behave as if the field were absent.
    Ignore,
}

#[derive(Debug)]
struct RawRoutingKey {
    headers: Vec<String>,
    body_fields: Vec<String>,
    max_bytes: usize,
    hash_seed: String,
}

impl Default for RawRoutingKey {
    fn default() -> Self {
        RawRoutingKey {
            headers: vec!["x-smg-routing-key".into(), "x-routing-key".into()],
            body_fields: vec![
                "routing_key".into(),
                "prompt_cache_key".into(),
                "user".into(),
            ],
            max_bytes: 512,
            hash_seed: String::new(),
        }
    }
}

#[derive(Debug)]
struct RawBody {
    max_bytes: usize,
    content_types: Vec<String>,
}

impl Default for RawBody {
    fn default() -> Self {
        RawBody {
            max_bytes: 8 * 1024 * 1024,
            content_types: vec!["application/json".into()],
        }
    }
}

#[derive(Debug)]
struct RawTarget {
    mode: String,
    cluster_header: String,
    cluster_template: String,
    /// `None`: not set (`engine_header` mode then uses [`DEFAULT_ENGINE_HEADER`]).
    engine_header: Option<String>,
    engine: String,
    paths: Option<Vec<RawPathTarget>>,
}

impl Default for RawTarget {
    fn default() -> Self {
        RawTarget {
            mode: "cluster".into(),
            cluster_header: "x-dp-affinity-cluster".into(),
            cluster_template: "dp-rank-{rank}".into(),
            engine_header: None,
            engine: String::new(),
            paths: None,
        }
    }
}

/// One entry of `target.paths`.
#[derive(Debug, Default)]
struct RawPathTarget {
    prefix: String,
    header: String,
    body_fields: Vec<String>,
}

#[derive(Debug)]
struct RawAssign {
    mode: String,
    seed: String,
    load_factor: f64,
    pinned_load_factor: f64,
    min_capacity: u32,
    cooldown_seconds: u32,
    failure_threshold: u32,
    failure_window_seconds: u32,
    room_field: String,
}

/// `assign.pinned_load_factor` when not set.
const DEFAULT_PINNED_LOAD_FACTOR: f64 = 2.0;

impl Default for RawAssign {
    fn default() -> Self {
        RawAssign {
            mode: "hash".into(),
            seed: String::new(),
            load_factor: 1.25,
            pinned_load_factor: DEFAULT_PINNED_LOAD_FACTOR,
            min_capacity: 8,
            cooldown_seconds: 10,
            failure_threshold: 3,
            failure_window_seconds: 10,
            room_field: "bootstrap_room".into(),
        }
    }
}

#[derive(Debug)]
struct RawLearn {
    response_header: String,
    upstream_addresses: HashMap<String, u32>,
}

impl Default for RawLearn {
    fn default() -> Self {
        RawLearn {
            response_header: "x-dp-rank".into(),
            upstream_addresses: HashMap::new(),
        }
    }
}

const DEFAULT_ECHO_HEADER: &str = "x-dp-rank";

#[derive(Debug)]
struct RawTable {
    buckets: u32,
    ways: u32,
    ttl_seconds: u32,
    refresh_seconds: u32,
    cas_retries: u32,
    namespace: String,
}

impl Default for RawTable {
    fn default() -> Self {
        // 65,536 buckets x 16 ways = 1,048,576 entries of 16 bytes: 16 MiB of values.
        RawTable {
            buckets: 65_536,
            ways: 16,
            ttl_seconds: 3600,
            refresh_seconds: 1,
            cas_retries: 8,
            namespace: "dp_affinity".into(),
        }
    }
}

/// `prefix`: the scalar knobs in a `PrefixConfig` (its `table` is ignored here), the index table
/// in `table`. Defaults come from `PrefixConfig::default()`, where they are written once.
#[derive(Debug)]
struct RawPrefix {
    knobs: PrefixConfig,
    table: RawTable,
}

impl Default for RawPrefix {
    fn default() -> Self {
        let knobs = PrefixConfig::default();
        let t = &knobs.table;
        let table = RawTable {
            buckets: t.buckets,
            ways: t.ways,
            ttl_seconds: t.ttl_seconds,
            refresh_seconds: t.refresh_seconds,
            cas_retries: t.cas_retries,
            namespace: t.namespace.clone(),
        };
        RawPrefix { knobs, table }
    }
}

// ---------------------------------------------------------------------------------------------
// Reading the JSON into the raw shape. Hand-written rather than serde-derived: every error names
// the full field path ("table.ways") and the expected type, and the .wasm stays ~50 KB smaller
// than with derived deserializers plus path tracking.
// ---------------------------------------------------------------------------------------------

fn read_raw(v: &Value) -> Result<RawConfig, ConfigError> {
    let mut raw = RawConfig::default();
    let r = &mut raw;
    fields(
        "",
        v,
        &mut [
            ("dp_size", Slot::SomeU32(&mut r.dp_size)),
            (
                "assign",
                Slot::With(&mut |path, v| read_assign(path, v, &mut r.assign)),
            ),
            (
                "explicit_rank",
                Slot::With(&mut |path, v| read_explicit(path, v, &mut r.explicit_rank)),
            ),
            (
                "routing_key",
                Slot::With(&mut |path, v| read_key(path, v, &mut r.routing_key)),
            ),
            (
                "body",
                Slot::With(&mut |path, v| read_body(path, v, &mut r.body)),
            ),
            (
                "target",
                Slot::With(&mut |path, v| read_target(path, v, &mut r.target)),
            ),
            (
                "learn",
                Slot::With(&mut |path, v| read_learn(path, v, &mut r.learn)),
            ),
            ("echo_header", Slot::SomeStr(&mut r.echo_header)),
            (
                "table",
                Slot::With(&mut |path, v| read_table(path, v, &mut r.table)),
            ),
            (
                "prefix",
                Slot::With(&mut |path, v| read_prefix(path, v, &mut r.prefix)),
            ),
        ],
    )?;
    Ok(raw)
}

fn read_explicit(path: &str, v: &Value, r: &mut RawExplicitRank) -> Result<(), ConfigError> {
    let on_invalid = &mut r.on_invalid;
    fields(
        path,
        v,
        &mut [
            ("enabled", Slot::Bool(&mut r.enabled)),
            ("header", Slot::Str(&mut r.header)),
            ("body_fields", Slot::List(&mut r.body_fields)),
            (
                "on_invalid",
                Slot::With(&mut |path, v| {
                    *on_invalid = match as_string(path, v)?.as_str() {
                        "reject" => OnInvalid::Reject,
                        "ignore" => OnInvalid::Ignore,
                        other => {
                            return Err(err(
                                path,
                                format!("must be \"reject\" or \"ignore\", got {other:?}"),
                            ))
                        }
                    };
                    Ok(())
                }),
            ),
            ("trusted_header", Slot::Str(&mut r.trusted_header)),
            ("trusted_secret", Slot::Str(&mut r.trusted_secret)),
        ],
    )
}

fn read_key(path: &str, v: &Value, r: &mut RawRoutingKey) -> Result<(), ConfigError> {
    fields(
        path,
        v,
        &mut [
            ("headers", Slot::List(&mut r.headers)),
            ("body_fields", Slot::List(&mut r.body_fields)),
            ("max_bytes", Slot::Usize(&mut r.max_bytes)),
            ("hash_seed", Slot::Str(&mut r.hash_seed)),
        ],
    )
}

fn read_body(path: &str, v: &Value, r: &mut RawBody) -> Result<(), ConfigError> {
    fields(
        path,
        v,
        &mut [
            ("max_bytes", Slot::Usize(&mut r.max_bytes)),
            ("content_types", Slot::List(&mut r.content_types)),
        ],
    )
}

fn read_target(path: &str, v: &Value, r: &mut RawTarget) -> Result<(), ConfigError> {
    let paths = &mut r.paths;
    fields(
        path,
        v,
        &mut [
            ("mode", Slot::Str(&mut r.mode)),
            ("cluster_header", Slot::Str(&mut r.cluster_header)),
            ("cluster_template", Slot::Str(&mut r.cluster_template)),
            ("engine_header", Slot::SomeStr(&mut r.engine_header)),
            ("engine", Slot::Str(&mut r.engine)),
            (
                "paths",
                Slot::With(&mut |path, v| {
                    *paths = Some(read_paths(path, v)?);
                    Ok(())
                }),
            ),
        ],
    )
}

/// The header `engine_header` mode sets when `target.engine_header` is not given.
const DEFAULT_ENGINE_HEADER: &str = "x-data-parallel-rank";

fn read_paths(path: &str, v: &Value) -> Result<Vec<RawPathTarget>, ConfigError> {
    let Value::Array(items) = v else {
        return Err(err(
            path,
            format!("expected a list of objects, got {}", type_of(v)),
        ));
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let mut entry = RawPathTarget::default();
        fields(
            &format!("{path}[{i}]"),
            item,
            &mut [
                ("prefix", Slot::Str(&mut entry.prefix)),
                ("header", Slot::Str(&mut entry.header)),
                ("body_fields", Slot::List(&mut entry.body_fields)),
            ],
        )?;
        out.push(entry);
    }
    Ok(out)
}

fn read_assign(path: &str, v: &Value, r: &mut RawAssign) -> Result<(), ConfigError> {
    fields(
        path,
        v,
        &mut [
            ("mode", Slot::Str(&mut r.mode)),
            ("seed", Slot::Str(&mut r.seed)),
            ("load_factor", Slot::F64(&mut r.load_factor)),
            ("pinned_load_factor", Slot::F64(&mut r.pinned_load_factor)),
            ("min_capacity", Slot::U32(&mut r.min_capacity)),
            ("cooldown_seconds", Slot::U32(&mut r.cooldown_seconds)),
            ("failure_threshold", Slot::U32(&mut r.failure_threshold)),
            (
                "failure_window_seconds",
                Slot::U32(&mut r.failure_window_seconds),
            ),
            ("room_field", Slot::Str(&mut r.room_field)),
        ],
    )
}

fn read_learn(path: &str, v: &Value, r: &mut RawLearn) -> Result<(), ConfigError> {
    let addresses = &mut r.upstream_addresses;
    fields(
        path,
        v,
        &mut [
            ("response_header", Slot::Str(&mut r.response_header)),
            (
                "upstream_addresses",
                Slot::With(&mut |path, v| {
                    let mut map = HashMap::new();
                    let Value::Object(obj) = v else {
                        return Err(err(path, "expected an object of \"address:port\": rank"));
                    };
                    for (addr, rank) in obj {
                        map.insert(addr.clone(), as_u32(&format!("{path}[{addr:?}]"), rank)?);
                    }
                    *addresses = map;
                    Ok(())
                }),
            ),
        ],
    )
}

fn read_table(path: &str, v: &Value, r: &mut RawTable) -> Result<(), ConfigError> {
    fields(
        path,
        v,
        &mut [
            ("buckets", Slot::U32(&mut r.buckets)),
            ("ways", Slot::U32(&mut r.ways)),
            ("ttl_seconds", Slot::U32(&mut r.ttl_seconds)),
            ("refresh_seconds", Slot::U32(&mut r.refresh_seconds)),
            ("cas_retries", Slot::U32(&mut r.cas_retries)),
            ("namespace", Slot::Str(&mut r.namespace)),
        ],
    )
}

fn read_prefix(path: &str, v: &Value, r: &mut RawPrefix) -> Result<(), ConfigError> {
    let k = &mut r.knobs;
    let table = &mut r.table;
    fields(
        path,
        v,
        &mut [
            ("enabled", Slot::Bool(&mut k.enabled)),
            ("block_bytes", Slot::U32(&mut k.block_bytes)),
            ("block_tokens", Slot::U32(&mut k.block_tokens)),
            ("max_blocks", Slot::U32(&mut k.max_blocks)),
            ("min_match_blocks", Slot::U32(&mut k.min_match_blocks)),
            ("sticky_blocks", Slot::U32(&mut k.sticky_blocks)),
            ("shared_slack", Slot::U32(&mut k.shared_slack)),
            ("load_blocks", Slot::U32(&mut k.load_blocks)),
            ("home_blocks", Slot::U32(&mut k.home_blocks)),
            ("grid_bits", Slot::U32(&mut k.grid_bits)),
            (
                "table",
                Slot::With(&mut |path, v| read_table(path, v, table)),
            ),
        ],
    )
}

/// Where one member's value goes; the kind says how the value is read (and what a wrong one's
/// error says).
enum Slot<'a> {
    Bool(&'a mut bool),
    U32(&'a mut u32),
    SomeU32(&'a mut Option<u32>),
    Usize(&'a mut usize),
    F64(&'a mut f64),
    Str(&'a mut String),
    SomeStr(&'a mut Option<String>),
    List(&'a mut Vec<String>),
    /// Read by its own code (a section, a map, an enumeration).
    With(&'a mut dyn FnMut(&str, &Value) -> Result<(), ConfigError>),
}

/// Reads every member of the object at `path` into the slot named like it, after checking that
/// `v` is an object and every name is one of the slots'. Table-driven rather than one `match` per
/// section: the readers are cold code, and this one loop is all the .wasm carries of them.
#[inline(never)]
fn fields(path: &str, v: &Value, slots: &mut [(&str, Slot)]) -> Result<(), ConfigError> {
    let here = if path.is_empty() {
        "configuration"
    } else {
        path
    };
    let Value::Object(obj) = v else {
        return Err(err(here, format!("expected an object, got {}", type_of(v))));
    };
    for (name, value) in obj {
        // An empty member name still needs something to point at in the error.
        let shown = if name.is_empty() {
            "\"\""
        } else {
            name.as_str()
        };
        let full = if path.is_empty() {
            shown.to_string()
        } else {
            format!("{path}.{shown}")
        };
        let Some((_, slot)) = slots.iter_mut().find(|(n, _)| *n == name.as_str()) else {
            let allowed: Vec<&str> = slots.iter().map(|(n, _)| *n).collect();
            return Err(err(
                &full,
                format!("unknown field; expected one of: {}", allowed.join(", ")),
            ));
        };
        let (p, v) = (full.as_str(), value);
        match slot {
            Slot::Bool(x) => **x = as_bool(p, v)?,
            Slot::U32(x) => **x = as_u32(p, v)?,
            Slot::SomeU32(x) => **x = Some(as_u32(p, v)?),
            Slot::Usize(x) => **x = as_usize(p, v)?,
            Slot::F64(x) => **x = as_f64(p, v)?,
            Slot::Str(x) => **x = as_string(p, v)?,
            Slot::SomeStr(x) => **x = Some(as_string(p, v)?),
            Slot::List(x) => **x = as_string_list(p, v)?,
            Slot::With(read) => read(p, v)?,
        }
    }
    Ok(())
}

#[inline(never)]
fn type_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A short description of a bad value: integers as themselves, everything else by type (no float
/// formatting code is linked into the .wasm for an error message). A number that is no `i64` is
/// a fraction (`4.0` too) or an integer too large for one: described as either, which costs no
/// code, where telling them apart would cost a few hundred bytes of the module.
#[inline(never)]
fn show(v: &Value) -> String {
    match v.as_i64() {
        Some(n) => n.to_string(),
        None if v.is_number() => "a number with a fraction or too large".to_string(),
        None => type_of(v).to_string(),
    }
}

// The value readers below are called from every section's reader; left to the optimiser (the
// crate is built at opt-level 3 for the request path) each call site got its own inlined copy, and
// the configuration readers were the largest code in the .wasm. Cold code: one copy each.
#[inline(never)]
fn as_u32(path: &str, v: &Value) -> Result<u32, ConfigError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            err(
                path,
                format!("expected an integer in 0..=4294967295, got {}", show(v)),
            )
        })
}

#[inline(never)]
fn as_f64(path: &str, v: &Value) -> Result<f64, ConfigError> {
    v.as_f64()
        .filter(|x| x.is_finite())
        .ok_or_else(|| err(path, format!("expected a number, got {}", type_of(v))))
}

#[inline(never)]
fn as_usize(path: &str, v: &Value) -> Result<usize, ConfigError> {
    v.as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            err(
                path,
                format!("expected a non-negative integer, got {}", show(v)),
            )
        })
}

#[inline(never)]
fn as_bool(path: &str, v: &Value) -> Result<bool, ConfigError> {
    v.as_bool()
        .ok_or_else(|| err(path, format!("expected true or false, got {}", type_of(v))))
}

#[inline(never)]
fn as_string(path: &str, v: &Value) -> Result<String, ConfigError> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| err(path, format!("expected a string, got {}", type_of(v))))
}

#[inline(never)]
fn as_string_list(path: &str, v: &Value) -> Result<Vec<String>, ConfigError> {
    let Value::Array(items) = v else {
        return Err(err(
            path,
            format!("expected a list of strings, got {}", type_of(v)),
        ));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| as_string(&format!("{path}[{i}]"), item))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The compiled configuration (what the request path reads).
// ---------------------------------------------------------------------------------------------

/// A validated configuration, precomputed for the request path.
#[derive(Debug, Clone)]
pub struct Config {
    pub dp_size: u32,
    pub explicit: ExplicitRankConfig,
    pub key: RoutingKeyConfig,
    pub body: BodyConfig,
    pub assign: AssignConfig,
    /// How the chosen rank reaches the engine.
    pub target: TargetMode,
    /// Internal request header carrying the chosen cluster (lower-case). Stripped from client
    /// requests in every target mode.
    pub cluster_header: String,
    /// `cluster_names[rank]` is the header value for that rank.
    pub cluster_names: Vec<String>,
    pub learn: LearnConfig,
    /// Response header echoing the rank that served (lower-case); `None` = off.
    pub echo_header: Option<String>,
    pub table: TableConfig,
    /// Prefix placement (`prefix`), validated; `prefix.table` is the index's geometry.
    pub prefix: PrefixConfig,
    /// The prompt-chain hasher, keyed from `routing_key.hash_seed` (domain-separated from key
    /// hashes), built once here.
    pub prefix_hasher: PrefixHasher,
}

/// How the chosen rank reaches the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetMode {
    /// Set the internal cluster header; a `cluster_header` route picks the rank's cluster.
    Cluster,
    /// One engine with internal DP: the rank goes where that engine reads it on each path
    /// (`engine_header` mode is one header on every path).
    Engine(EngineTarget),
}

impl TargetMode {
    /// The engine's paths, in engine mode.
    pub fn engine(&self) -> Option<&EngineTarget> {
        match self {
            TargetMode::Cluster => None,
            TargetMode::Engine(t) => Some(t),
        }
    }
}

#[derive(Debug, Clone)]
pub struct AssignConfig {
    pub mode: Mode,
    /// Rendezvous seed (a hash of `assign.seed`): replicas with the same seed agree.
    pub seed: u64,
    /// The bound for new keys (`load_factor`, `min_capacity`).
    pub new_key_bound: Bound,
    /// The bound under which a pinned key stays (`pinned_load_factor`, and `min_capacity` ×
    /// `pinned_load_factor` / `load_factor` as its floor: see `pinned_floor`).
    pub pinned_bound: Bound,
    pub cooldown_seconds: u32,
    /// Upstream errors from this many requests the filter placed on a rank, within
    /// `failure_window_seconds`, cool it down (Envoy's own failure answers do at once).
    pub failure_threshold: u32,
    pub failure_window_seconds: u32,
    pub room_field: String,
}

impl AssignConfig {
    /// When repeated upstream errors cool a rank down.
    pub fn strike_rule(&self) -> StrikeRule {
        StrikeRule {
            threshold: self.failure_threshold,
            window_seconds: self.failure_window_seconds,
            cooldown_seconds: self.cooldown_seconds,
        }
    }

    /// Whether requests are counted in flight per rank (the assigners that read load need it).
    pub fn tracks_load(&self) -> bool {
        self.mode != Mode::Envoy
    }
}

#[derive(Debug, Clone)]
pub struct ExplicitRankConfig {
    pub enabled: bool,
    /// Lower-case header name.
    pub header: String,
    pub body_fields: Vec<String>,
    pub on_invalid: OnInvalid,
    /// When set, only requests whose header (lower-case name) carries this secret may choose a
    /// rank; everyone else's rank fields are ignored and the rank header stripped.
    pub trust: Option<Trust>,
}

/// The shared secret that marks a trusted caller of the explicit-rank override.
#[derive(Clone)]
pub struct Trust {
    pub header: String,
    pub secret: Vec<u8>,
}

impl fmt::Debug for Trust {
    // The secret never reaches a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Trust {{ header: {:?}, secret: <redacted> }}",
            self.header
        )
    }
}

#[derive(Debug, Clone)]
pub struct RoutingKeyConfig {
    /// Lower-case header names, in priority order.
    pub headers: Vec<String>,
    pub body_fields: Vec<String>,
    pub max_bytes: usize,
    pub hasher: KeyedHasher,
    /// `routing_key.hash_seed` was set. Empty, the hash is keyed with a constant anyone can read
    /// in this source (see [`Config::warnings`]).
    pub seeded: bool,
}

#[derive(Debug, Clone)]
pub struct BodyConfig {
    pub max_bytes: usize,
    /// Lower-case media types (`type/subtype`, no parameters).
    pub content_types: Vec<String>,
    /// Every body field the scanner looks for: explicit-rank fields first, then key fields.
    pub wanted_fields: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct LearnConfig {
    /// Lower-case response header reporting the serving rank; `None` = do not read it.
    pub response_header: Option<String>,
    pub upstream_addresses: HashMap<String, u32>,
}

/// The first member name that appears twice in one object of `json`, at any depth, as written
/// (two spellings of one name, one with escapes, are not caught): JSON parsers keep the last
/// copy without a word, so an overlay merged into a configuration that repeats `explicit_rank`
/// would drop the first copy's trust secret unnoticed. `json` has been parsed by serde_json
/// already: valid, and nested at most 128 deep, which bounds the recursion.
fn member_named_twice(json: &[u8]) -> Option<&[u8]> {
    twice_in(&mut Scanner { b: json, i: 0 }).ok().flatten()
}

fn twice_in<'a>(s: &mut Scanner<'a>) -> Result<Option<&'a [u8]>, ScanError> {
    s.skip_ws();
    let close = match s.peek() {
        Some(b'{') => b'}',
        Some(b'[') => b']',
        _ => return s.skip_value().map(|()| None),
    };
    s.i += 1;
    let mut names: Vec<&[u8]> = Vec::new();
    loop {
        s.skip_ws();
        if s.peek() == Some(close) {
            s.i += 1;
            return Ok(None);
        }
        if close == b'}' {
            let start = s.i;
            s.skip_string()?;
            let name = s.b.get(start..s.i).unwrap_or_default();
            if names.contains(&name) {
                return Ok(Some(name));
            }
            names.push(name);
            s.skip_ws();
            s.expect(b':')?;
        }
        if let Some(twice) = twice_in(s)? {
            return Ok(Some(twice));
        }
        s.skip_ws();
        if s.peek() == Some(b',') {
            s.i += 1;
        }
    }
}

#[inline(never)]
fn err(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        message: message.into(),
    }
}

impl Config {
    /// Parses and validates the plugin configuration bytes.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let v: Value = serde_json::from_slice(bytes)
            .map_err(|e| err("configuration", format!("not valid JSON: {e}")))?;
        if let Some(name) = member_named_twice(bytes) {
            return Err(err(
                "configuration",
                format!(
                    "member {} appears twice in one object (only one copy can count)",
                    String::from_utf8_lossy(name)
                ),
            ));
        }
        // Compiled from a borrow: the raw shape is dropped here once, not on each of the
        // validation's error returns.
        let mut raw = read_raw(&v)?;
        compile(&mut raw)
    }

    /// What is valid but probably not what the operator wants, one log line each (the host logs
    /// them at warning level when it accepts the configuration).
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.prefix.enabled && self.body.content_types.is_empty() {
            out.push(
                "plugin configuration: body.content_types is empty, so a body is read only \
                 where an engine target reads a rank from it (in cluster mode: never): \
                 prompt-prefix placement (prefix.enabled) and body fields miss every other \
                 request."
                    .to_string(),
            );
        }
        if !self.key.seeded {
            out.push(
                "plugin configuration: routing_key.hash_seed is empty, so routing keys and prompt \
                 prefixes are hashed with a publicly known key: anyone can compute which keys \
                 share an affinity-table bucket (and flood it to evict other clients' pins) and, \
                 with assign.mode \"hash\", which rank a key goes to. Set routing_key.hash_seed \
                 to a secret string, the same on every Envoy replica."
                    .to_string(),
            );
        }
        out
    }
}

fn compile(raw: &mut RawConfig) -> Result<Config, ConfigError> {
    let dp_size = raw
        .dp_size
        .ok_or_else(|| err("dp_size", "is required (number of data-parallel ranks)"))?;
    if dp_size == 0 || dp_size > MAX_DP_SIZE {
        return Err(err(
            "dp_size",
            format!("must be in 1..={MAX_DP_SIZE}, got {dp_size}"),
        ));
    }
    let explicit = compile_explicit(&mut raw.explicit_rank)?;
    // The prompt-chain keys derive from the routing-key seed: one secret to set, and changing it
    // forgets pins and indexed prefixes alike.
    let prefix_hasher = PrefixHasher::new(raw.routing_key.hash_seed.as_bytes());
    let key = compile_key(&mut raw.routing_key)?;
    let assign = compile_assign(&mut raw.assign)?;
    let body = compile_body(&raw.body, &explicit, &key, &assign)?;
    let (target, cluster_header, cluster_names) = compile_target(&mut raw.target, dp_size)?;
    check_request_header_roles(&explicit, &key, &cluster_header, &target)?;
    check_target_body_fields(&target, &key, &assign)?;
    let learn = compile_learn(&mut raw.learn, dp_size)?;
    // Envoy's balancer places every new key; the filter pins the rank it learns from the
    // answer. With nothing to learn it from, no key would ever be pinned.
    if assign.mode == Mode::Envoy
        && learn.response_header.is_none()
        && learn.upstream_addresses.is_empty()
    {
        return Err(err(
            "learn.response_header",
            "assign.mode \"envoy\" learns each key's rank from the answer: set \
             learn.response_header or learn.upstream_addresses",
        ));
    }
    let echo = raw.echo_header.as_deref().unwrap_or(DEFAULT_ECHO_HEADER);
    let echo_header = optional_header("echo_header", echo)?;
    let table = compile_table("table", &mut raw.table)?;
    let prefix = compile_prefix(&mut raw.prefix, &table)?;
    // Without the filter's own load view a popular prefix would send every request to the rank
    // that computed it first: prefix placement needs an assigner that counts load.
    if prefix.enabled && assign.mode == Mode::Envoy {
        return Err(err(
            "prefix.enabled",
            "prompt-prefix placement needs the filter's load view, which assign.mode \"envoy\" \
             does not keep: use assign.mode \"hash\" (the default) or \"least_inflight\", or set \
             prefix.enabled to false",
        ));
    }
    Ok(Config {
        dp_size,
        assign,
        target,
        explicit,
        key,
        body,
        cluster_header,
        cluster_names,
        learn,
        echo_header,
        table,
        prefix,
        prefix_hasher,
    })
}

/// The trust secret, which a caller must be able to send as a header value: printable ASCII,
/// spaces only inside. A header value arrives without surrounding white space and cannot hold
/// control bytes, so a secret read from a file with its newline would make every caller
/// untrusted, without a word; bytes beyond ASCII are sent differently by different clients.
fn trusted_secret(secret: String) -> Result<Vec<u8>, ConfigError> {
    let sendable = secret.bytes().all(|c| c == b' ' || c.is_ascii_graphic())
        && !secret.starts_with(' ')
        && !secret.ends_with(' ');
    if !sendable {
        return Err(err(
            "explicit_rank.trusted_secret",
            "must be printable ASCII with no space at either end (no line breaks or other bytes \
             a header value cannot carry): no caller could send it",
        ));
    }
    Ok(secret.into_bytes())
}

fn compile_explicit(raw: &mut RawExplicitRank) -> Result<ExplicitRankConfig, ConfigError> {
    let trust = match (raw.trusted_header.is_empty(), raw.trusted_secret.is_empty()) {
        (true, true) => None,
        (false, false) => Some(Trust {
            header: written_header("explicit_rank.trusted_header", &raw.trusted_header)?,
            secret: trusted_secret(mem::take(&mut raw.trusted_secret))?,
        }),
        (true, false) => {
            return Err(err(
                "explicit_rank.trusted_header",
                "must be set together with explicit_rank.trusted_secret",
            ))
        }
        (false, true) => {
            return Err(err(
                "explicit_rank.trusted_secret",
                "must be set together with explicit_rank.trusted_header",
            ))
        }
    };
    Ok(ExplicitRankConfig {
        enabled: raw.enabled,
        header: written_header("explicit_rank.header", &raw.header)?,
        body_fields: field_names("explicit_rank.body_fields", mem::take(&mut raw.body_fields))?,
        on_invalid: raw.on_invalid,
        trust,
    })
}

fn compile_key(raw: &mut RawRoutingKey) -> Result<RoutingKeyConfig, ConfigError> {
    let headers = raw
        .headers
        .iter()
        .map(|h| header_name("routing_key.headers", h))
        .collect::<Result<Vec<_>, _>>()?;
    if raw.max_bytes == 0 {
        return Err(err("routing_key.max_bytes", "must be at least 1"));
    }
    Ok(RoutingKeyConfig {
        headers,
        body_fields: field_names("routing_key.body_fields", mem::take(&mut raw.body_fields))?,
        max_bytes: raw.max_bytes,
        hasher: KeyedHasher::from_seed(raw.hash_seed.as_bytes()),
        seeded: !raw.hash_seed.is_empty(),
    })
}

/// The pinned bound's floor: `min_capacity` scaled like the factor (× pinned / new-key factor),
/// so that at low load, where both bounds sit on their floors, the work new conversations may
/// bring a rank (up to `min_capacity` in flight) never fills it for the conversations it already
/// holds: with one floor for both, a rank given new homes up to the floor dropped its histories
/// at the same count.
fn pinned_floor(min_capacity: u32, load_factor: f64, pinned_load_factor: f64) -> u32 {
    let floor = (f64::from(min_capacity) * pinned_load_factor / load_factor).ceil();
    if floor.is_finite() && floor >= f64::from(min_capacity) {
        floor.min(f64::from(u32::MAX)) as u32
    } else {
        min_capacity
    }
}

fn compile_assign(raw: &mut RawAssign) -> Result<AssignConfig, ConfigError> {
    let mode = match raw.mode.as_str() {
        "envoy" => Mode::Envoy,
        "hash" => Mode::Hash,
        "least_inflight" => Mode::LeastInflight,
        "round_robin" => Mode::RoundRobin,
        "bootstrap_room" => Mode::BootstrapRoom,
        other => {
            return Err(err(
                "assign.mode",
                format!(
                    "must be one of envoy, hash, least_inflight, round_robin, bootstrap_room; got {other:?}"
                ),
            ))
        }
    };
    if !(1.0..=100.0).contains(&raw.load_factor) {
        return Err(err("assign.load_factor", "must be in 1.0..=100.0"));
    }
    if !(raw.load_factor..=100.0).contains(&raw.pinned_load_factor) {
        // Often left at its default (2.0) while load_factor is raised past it: say so. (No
        // number is formatted: float formatting alone would add ~22 KB to the module.)
        return Err(err(
            "assign.pinned_load_factor",
            "must be in assign.load_factor..=100.0 (its default, 2.0, is below a load_factor raised past it: set both)",
        ));
    }
    if raw.room_field.is_empty() {
        return Err(err("assign.room_field", "must be non-empty"));
    }
    if !(1..=1000).contains(&raw.failure_threshold) {
        return Err(err("assign.failure_threshold", "must be in 1..=1000"));
    }
    if !(1..=3600).contains(&raw.failure_window_seconds) {
        return Err(err("assign.failure_window_seconds", "must be in 1..=3600"));
    }
    // A cool-down only ever lengthens (`RankStates::mark_down`) and outlives a reload: an hour
    // at most, so a typo cannot take a rank out until Envoy restarts.
    if raw.cooldown_seconds > MAX_COOLDOWN_SECONDS {
        return Err(err("assign.cooldown_seconds", "must be in 0..=3600"));
    }
    Ok(AssignConfig {
        mode,
        seed: KeyedHasher::from_seed(b"").hash(raw.seed.as_bytes()),
        new_key_bound: Bound {
            factor: raw.load_factor,
            floor: raw.min_capacity,
        },
        pinned_bound: Bound {
            factor: raw.pinned_load_factor,
            floor: pinned_floor(raw.min_capacity, raw.load_factor, raw.pinned_load_factor),
        },
        cooldown_seconds: raw.cooldown_seconds,
        failure_threshold: raw.failure_threshold,
        failure_window_seconds: raw.failure_window_seconds,
        room_field: mem::take(&mut raw.room_field),
    })
}

fn compile_body(
    raw: &RawBody,
    explicit: &ExplicitRankConfig,
    key: &RoutingKeyConfig,
    assign: &AssignConfig,
) -> Result<BodyConfig, ConfigError> {
    if raw.max_bytes == 0 {
        return Err(err("body.max_bytes", "must be at least 1"));
    }
    let mut content_types = Vec::new();
    for ct in &raw.content_types {
        let t = ct.trim().to_ascii_lowercase();
        if t.is_empty() || !t.contains('/') || t.contains(';') || t.contains('*') {
            return Err(err(
                "body.content_types",
                format!(
                    "{ct:?} is not a media type like \"application/json\" (each is matched \
                     whole: no wildcards)"
                ),
            ));
        }
        content_types.push(t);
    }
    if let Some(dup) = explicit
        .body_fields
        .iter()
        .find(|f| key.body_fields.contains(f))
    {
        return Err(err(
            "routing_key.body_fields",
            format!("{dup:?} is also an explicit_rank body field"),
        ));
    }
    let mut wanted_fields = Vec::new();
    if explicit.enabled {
        wanted_fields.extend(explicit.body_fields.iter().cloned());
    }
    wanted_fields.extend(key.body_fields.iter().cloned());
    if assign.mode == Mode::BootstrapRoom {
        if wanted_fields.contains(&assign.room_field) {
            return Err(err(
                "assign.room_field",
                format!("{:?} is also a rank or key body field", assign.room_field),
            ));
        }
        wanted_fields.push(assign.room_field.clone());
    }
    Ok(BodyConfig {
        max_bytes: raw.max_bytes,
        content_types,
        wanted_fields,
    })
}

fn compile_target(
    raw: &mut RawTarget,
    dp_size: u32,
) -> Result<(TargetMode, String, Vec<String>), ConfigError> {
    if raw.mode != "engine" && (!raw.engine.is_empty() || raw.paths.is_some()) {
        return Err(err(
            "target.mode",
            "target.engine and target.paths need target.mode \"engine\"",
        ));
    }
    // Checked in every mode (an operator may set it before switching the mode), refused where
    // each path names its own header.
    let engine_header = written_header(
        "target.engine_header",
        raw.engine_header
            .as_deref()
            .unwrap_or(DEFAULT_ENGINE_HEADER),
    )?;
    if raw.mode == "engine" && raw.engine_header.is_some() {
        return Err(err(
            "target.engine_header",
            "is used by target.mode \"engine_header\" only: in \"engine\" mode the preset or \
             each of target.paths names the header",
        ));
    }
    let mode = match raw.mode.as_str() {
        "cluster" => TargetMode::Cluster,
        "engine_header" => TargetMode::Engine(EngineTarget::one_header(&engine_header)),
        "engine" => TargetMode::Engine(compile_engine_paths(&raw.engine, raw.paths.as_mut())?),
        other => {
            return Err(err(
                "target.mode",
                format!("must be \"cluster\", \"engine\" or \"engine_header\", got {other:?}"),
            ))
        }
    };
    let header = written_header("target.cluster_header", &raw.cluster_header)?;
    if rank_placeholder(&raw.cluster_template).is_none() {
        return Err(err(
            "target.cluster_template",
            format!("must contain \"{{rank}}\", got {:?}", raw.cluster_template),
        ));
    }
    let names: Vec<String> = (0..dp_size)
        .map(|r| with_rank(&raw.cluster_template, r))
        .collect();
    if let Some(bad) = names.iter().find(|n| !is_header_value_safe(n)) {
        return Err(err(
            "target.cluster_template",
            format!("gives {bad:?}, which is not a valid header value"),
        ));
    }
    Ok((mode, header, names))
}

/// Where `{rank}` first appears in `template`. (A byte search: `str::contains` of a `&str`
/// would be the module's only use of the standard substring search, 2.6 KB of code.)
fn rank_placeholder(template: &str) -> Option<usize> {
    template.as_bytes().windows(6).position(|w| w == b"{rank}")
}

/// `template` with every `{rank}` replaced by `rank`.
fn with_rank(template: &str, rank: u32) -> String {
    let mut name = String::new();
    let mut rest = template;
    while let Some(at) = rank_placeholder(rest) {
        name.push_str(rest.get(..at).unwrap_or_default());
        name.push_str(&rank.to_string());
        rest = rest.get(at + 6..).unwrap_or_default();
    }
    name.push_str(rest);
    name
}

/// `target.mode: engine`: a preset (`target.engine`) or an explicit list (`target.paths`).
fn compile_engine_paths(
    engine: &str,
    paths: Option<&mut Vec<RawPathTarget>>,
) -> Result<EngineTarget, ConfigError> {
    match (engine.is_empty(), paths) {
        (false, None) => Engine::from_name(engine)
            .map(EngineTarget::preset)
            .ok_or_else(|| {
                err(
                    "target.engine",
                    format!("must be {}, got {engine:?}", Engine::NAMES),
                )
            }),
        (true, Some(paths)) => {
            let compiled = paths
                .iter_mut()
                .enumerate()
                .map(|(i, p)| compile_path_target(i, p))
                .collect::<Result<Vec<_>, _>>()?;
            if compiled.is_empty() {
                return Err(err("target.paths", "must list at least one path"));
            }
            check_unshadowed(&compiled)?;
            Ok(EngineTarget::new(compiled))
        }
        (false, Some(_)) => Err(err(
            "target.paths",
            "set target.engine (a preset) or target.paths, not both",
        )),
        (true, None) => Err(err(
            "target.engine",
            format!(
                "target.mode \"engine\" needs target.engine ({}) or target.paths",
                Engine::NAMES
            ),
        )),
    }
}

/// Paths are matched in order, so an entry whose every path an earlier prefix already matches
/// (`/v1/` before `/v1/chat/completions`) would never be used: refused rather than ignored.
/// Matching the later prefix itself is enough: what is under it is under the earlier one too.
fn check_unshadowed(paths: &[PathTarget]) -> Result<(), ConfigError> {
    for (j, later) in paths.iter().enumerate() {
        if let Some(i) = paths[..j].iter().position(|p| p.matches(&later.prefix)) {
            return Err(err(
                &format!("target.paths[{j}].prefix"),
                format!(
                    "{:?} is never used: target.paths[{i}] ({:?}) comes first and matches \
                     every path under it (list the longer prefix first)",
                    later.prefix, paths[i].prefix
                ),
            ));
        }
    }
    Ok(())
}

fn compile_path_target(i: usize, raw: &mut RawPathTarget) -> Result<PathTarget, ConfigError> {
    let field = |name: &str| format!("target.paths[{i}].{name}");
    if !raw.prefix.starts_with('/') {
        return Err(err(
            &field("prefix"),
            format!("must start with \"/\", got {:?}", raw.prefix),
        ));
    }
    let header = optional_header(&field("header"), &raw.header)?;
    let body_fields = field_names(&field("body_fields"), mem::take(&mut raw.body_fields))?;
    if header.is_none() && body_fields.is_empty() {
        return Err(err(
            &field("header"),
            "each path needs a header or body_fields (where the engine reads the rank)",
        ));
    }
    Ok(PathTarget {
        prefix: mem::take(&mut raw.prefix),
        header,
        body_fields,
    })
}

/// A body field the filter sets or strips for the engine must not be one it reads for another
/// role: it would overwrite a routing key or a bootstrap room.
fn check_target_body_fields(
    target: &TargetMode,
    key: &RoutingKeyConfig,
    assign: &AssignConfig,
) -> Result<(), ConfigError> {
    let Some(engine) = target.engine() else {
        return Ok(());
    };
    for (i, p) in engine.paths.iter().enumerate() {
        for f in &p.body_fields {
            let other = if key.body_fields.contains(f) {
                Some("a routing_key.body_fields entry")
            } else if *f == assign.room_field {
                Some("assign.room_field")
            } else {
                None
            };
            if let Some(other) = other {
                return Err(err(
                    &format!("target.paths[{i}].body_fields"),
                    format!("{f:?} is also {other}: the filter would overwrite it"),
                ));
            }
        }
    }
    Ok(())
}

fn compile_learn(raw: &mut RawLearn, dp_size: u32) -> Result<LearnConfig, ConfigError> {
    for (addr, &rank) in &raw.upstream_addresses {
        if !is_ip_and_port(addr) {
            return Err(err(
                "learn.upstream_addresses",
                format!(
                    "{addr:?} is not an address as Envoy reports it (\"10.0.0.5:8000\", \"[fd00::5]:8000\"): it would never match"
                ),
            ));
        }
        if rank >= dp_size {
            return Err(err(
                "learn.upstream_addresses",
                format!("{addr:?} maps to rank {rank}, allowed 0..{dp_size}"),
            ));
        }
    }
    Ok(LearnConfig {
        response_header: match raw.response_header.as_str() {
            "" => None,
            name => Some(header_name("learn.response_header", name)?),
        },
        upstream_addresses: mem::take(&mut raw.upstream_addresses),
    })
}

/// Whether `addr` is written as Envoy writes `upstream.address`, which is looked up as a string:
/// an IPv4 address (four numbers up to 255) or a bracketed IPv6 address in lower case, `:`, a
/// port, no number with a leading zero. Catches a host name, a missing port, a URL, `08000`
/// or upper-case hex, which would never match. (Not every IPv6 spelling Envoy would shorten:
/// `[fd00:0:0::5]` passes, and never matches either.)
fn is_ip_and_port(addr: &str) -> bool {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return false;
    };
    let port_ok = plain_number(port.as_bytes(), false).is_some_and(|p| (1..=65535).contains(&p));
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => {
            v6.contains(':')
                && v6.as_bytes().split(|&c| c == b':').all(|group| {
                    group.is_empty()
                        || (group.len() <= 4 && plain_number(group, true).is_some())
                        || is_ipv4(group)
                })
        }
        None => is_ipv4(host.as_bytes()),
    };
    port_ok && host_ok
}

/// Four decimal numbers up to 255, dot-separated, as Envoy writes them.
fn is_ipv4(host: &[u8]) -> bool {
    let mut parts = 0;
    let numbers_ok = host.split(|&c| c == b'.').all(|n| {
        parts += 1;
        plain_number(n, false).is_some_and(|v| v <= 255)
    });
    numbers_ok && parts == 4
}

/// The value of `n`, decimal or lower-case hex digits, at least one and at most five, no
/// leading zero.
fn plain_number(n: &[u8], hex: bool) -> Option<u32> {
    if n.is_empty() || n.len() > 5 || (n.len() > 1 && n.first() == Some(&b'0')) {
        return None;
    }
    n.iter().try_fold(0u32, |v, &c| {
        let digit = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' if hex => c - b'a' + 10,
            _ => return None,
        };
        Some(v * if hex { 16 } else { 10 } + u32::from(digit))
    })
}

/// Entries one table may hold (`buckets × ways`; the error message spells it out).
const MAX_TABLE_ENTRIES: u64 = 1 << 24;

/// Buckets one table may have (the error message spells it out).
pub const MAX_BUCKETS: u32 = 1 << 20;

fn compile_table(path: &str, raw: &mut RawTable) -> Result<TableConfig, ConfigError> {
    let field = |name: &str| format!("{path}.{name}");
    // Every bucket is a shared-data key, made at start-up and never freed while Envoy runs:
    // 16M of them took ~2 min and ~2.4 GB before one entry was stored.
    if raw.buckets == 0 || raw.buckets > MAX_BUCKETS {
        return Err(err(
            &field("buckets"),
            "must be in 1..=1048576 (a shared-data key each, all made at start-up)",
        ));
    }
    if raw.ways == 0 || raw.ways > MAX_WAYS {
        return Err(err(&field("ways"), format!("must be in 1..={MAX_WAYS}")));
    }
    // 16 bytes an entry: at most 256 MiB of shared data per table.
    if u64::from(raw.buckets) * u64::from(raw.ways) > MAX_TABLE_ENTRIES {
        return Err(err(
            &field("buckets"),
            "buckets x ways must be at most 16777216 entries (256 MiB)",
        ));
    }
    // A hit rewrites its entry's last use at most once a second (`refresh_seconds`, 0 counting
    // as 1), and an entry is dead once unused for `ttl_seconds`: a refresh not due before that
    // would let entries in constant use expire.
    if raw.ttl_seconds < 2 {
        return Err(err(
            &field("ttl_seconds"),
            "must be at least 2 (an entry in use is refreshed at most once a second)",
        ));
    }
    if raw.refresh_seconds.max(1) >= raw.ttl_seconds {
        return Err(err(
            &field("refresh_seconds"),
            format!(
                "must be below ttl_seconds ({}): entries in use would expire before their refresh",
                raw.ttl_seconds
            ),
        ));
    }
    if raw.cas_retries > 100 {
        return Err(err(&field("cas_retries"), "must be in 0..=100"));
    }
    if raw.namespace.is_empty() || !raw.namespace.bytes().all(|c| c.is_ascii_graphic()) {
        return Err(err(
            &field("namespace"),
            "must be non-empty printable ASCII without spaces",
        ));
    }
    Ok(TableConfig {
        buckets: raw.buckets,
        ways: raw.ways,
        ttl_seconds: raw.ttl_seconds,
        refresh_seconds: raw.refresh_seconds,
        cas_retries: raw.cas_retries,
        namespace: mem::take(&mut raw.namespace),
    })
}

/// Checks `prefix` (whether or not it is enabled: a typo is caught before someone turns it on).
fn compile_prefix(
    raw: &mut RawPrefix,
    affinity: &TableConfig,
) -> Result<PrefixConfig, ConfigError> {
    raw.knobs.validate()?;
    let table = compile_table("prefix.table", &mut raw.table)?;
    if table.namespace == affinity.namespace {
        // Same namespace and bucket count would file both tables under the same keys.
        return Err(err(
            "prefix.table.namespace",
            format!(
                "must differ from table.namespace ({:?})",
                affinity.namespace
            ),
        ));
    }
    Ok(PrefixConfig { table, ..raw.knobs })
}

/// Refuses a request header name given to two roles. The filter gives each request header one
/// role (the first that matches in `HeaderFacts::collect`), so a shared name silently drops the
/// other: an explicit-rank header that is also the cluster header leaves a client's copy in place
/// when its value is ignored as a rank (the client would pick the cluster); a key header that is
/// also the explicit-rank, trust or cluster header is never read as a key; the trust header
/// carries a secret and is stripped, so sharing it feeds the secret to another role or strips
/// what that role needs; the engine header would overwrite a client's key with the rank. The
/// `content-type` and `content-length` headers the filter reads to decide on the body are roles
/// too: taken by another role, the body would never be read (or, stripped or overwritten, the
/// upstream would get a wrong one).
///
/// Allowed: several entries of `routing_key.headers` naming the same header (one role), and
/// `target.engine_header` equal to `explicit_rank.header` (the default: the engine honours the
/// same header a client may send, and the filter replaces the client's copy with the rank it
/// chose or strips it). Response headers (`learn.response_header`, `echo_header`) live in the
/// response's header map and cannot collide with these.
fn check_request_header_roles(
    explicit: &ExplicitRankConfig,
    key: &RoutingKeyConfig,
    cluster_header: &str,
    target: &TargetMode,
) -> Result<(), ConfigError> {
    const EXPLICIT: &str = "explicit_rank.header";
    const ENGINE: &str = "target.engine_header";
    // The filter reads these two itself (is the body JSON, is it over body.max_bytes).
    let mut roles: Vec<(String, &str)> = vec![
        (
            "the content-type header (body.content_types)".into(),
            "content-type",
        ),
        (
            "the content-length header (body.max_bytes)".into(),
            "content-length",
        ),
        (EXPLICIT.into(), explicit.header.as_str()),
    ];
    if let Some(trust) = &explicit.trust {
        roles.push(("explicit_rank.trusted_header".into(), trust.header.as_str()));
    }
    roles.extend(
        key.headers
            .iter()
            .enumerate()
            .map(|(i, h)| (format!("routing_key.headers[{i}]"), h.as_str())),
    );
    roles.push(("target.cluster_header".into(), cluster_header));
    if let Some(engine) = target.engine() {
        // Named as the operator wrote it: the one engine_header, a preset, or a path's header.
        let one_header = engine.paths.len() == 1 && engine.paths[0].prefix == "/";
        for (i, p) in engine.paths.iter().enumerate() {
            if let Some(h) = &p.header {
                let role = if one_header {
                    ENGINE.to_string()
                } else {
                    format!("target.paths[{i}].header")
                };
                roles.push((role, h.as_str()));
            }
        }
    }
    let is_engine = |f: &str| f == ENGINE || f.starts_with("target.paths[");
    for (j, (later, name)) in roles.iter().enumerate() {
        for (earlier, other) in &roles[..j] {
            let same_role = |f: &str| f.starts_with("routing_key.headers[");
            let allowed = (same_role(earlier) && same_role(later))
                || (is_engine(earlier) && is_engine(later))
                || (earlier == EXPLICIT && is_engine(later));
            // Names are lower-cased by `header_name`, so equality is case-insensitive.
            if name == other && !allowed {
                return Err(err(
                    later,
                    format!(
                        "{name:?} is also {earlier}; every request header the filter reads, \
                         strips or sets needs its own name"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Headers that frame or route the message itself (HTTP/1.1 connection options, the body's
/// length and encoding, the authority): a header the filter sets or removes must not be one of
/// them, or requests or answers would break for every client.
const FRAMING_HEADERS: [&str; 11] = [
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

/// Lower-cases and checks a required header name (RFC 9110 token characters).
fn header_name(field: &str, name: &str) -> Result<String, ConfigError> {
    let lower = name.trim().to_ascii_lowercase();
    let is_tchar = |c: u8| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c);
    if lower.is_empty() || !lower.bytes().all(is_tchar) {
        return Err(err(
            field,
            format!("{name:?} is not a valid HTTP header name"),
        ));
    }
    Ok(lower)
}

/// A header the filter sets or removes: a valid name, and not one of [`FRAMING_HEADERS`].
fn written_header(field: &str, name: &str) -> Result<String, ConfigError> {
    let lower = header_name(field, name)?;
    if FRAMING_HEADERS.contains(&lower.as_str()) {
        return Err(err(
            field,
            format!("{name:?} frames or routes the message itself: the filter sets or removes this header, so choose another name"),
        ));
    }
    Ok(lower)
}

/// Like `written_header`, but an empty string switches the feature off.
fn optional_header(field: &str, name: &str) -> Result<Option<String>, ConfigError> {
    if name.is_empty() {
        Ok(None)
    } else {
        written_header(field, name).map(Some)
    }
}

fn field_names(field: &str, names: Vec<String>) -> Result<Vec<String>, ConfigError> {
    if names.iter().any(|n| n.is_empty()) {
        return Err(err(field, "field names must be non-empty"));
    }
    Ok(names)
}

fn is_header_value_safe(v: &str) -> bool {
    !v.is_empty() && v.bytes().all(|c| (0x21..0x7f).contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Config, ConfigError> {
        Config::from_json(json.as_bytes())
    }

    #[test]
    fn defaults_from_minimal_config() {
        let c = parse(r#"{"dp_size": 4}"#).unwrap();
        assert_eq!(c.dp_size, 4);
        assert!(c.explicit.enabled);
        assert_eq!(c.explicit.header, "x-data-parallel-rank");
        assert_eq!(c.explicit.on_invalid, OnInvalid::Reject);
        assert_eq!(c.key.headers, ["x-smg-routing-key", "x-routing-key"]);
        assert_eq!(c.key.max_bytes, 512);
        assert_eq!(c.body.max_bytes, 8 << 20);
        assert_eq!(
            c.body.wanted_fields,
            [
                "routed_dp_rank",
                "data_parallel_rank",
                "routing_key",
                "prompt_cache_key",
                "user"
            ]
        );
        assert_eq!(c.cluster_header, "x-dp-affinity-cluster");
        assert_eq!(
            c.cluster_names,
            ["dp-rank-0", "dp-rank-1", "dp-rank-2", "dp-rank-3"]
        );
        // Every `{rank}` of the template is filled in, wherever it is.
        let twice = parse(r#"{"dp_size":11,"target":{"cluster_template":"{rank}-x-{rank}{rank"}}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(twice.cluster_names[10], "10-x-10{rank");
        assert_eq!(twice.cluster_names[0], "0-x-0{rank");
        assert_eq!(c.learn.response_header.as_deref(), Some("x-dp-rank"));
        assert_eq!(c.echo_header.as_deref(), Some("x-dp-rank"));
        assert_eq!((c.table.buckets, c.table.ways), (65_536, 16));
        assert_eq!(c.table.ttl_seconds, 3600);
        // The recommended placement: rendezvous homes with load counted, prompt prefix on.
        assert_eq!(c.assign.mode, Mode::Hash);
        assert!(c.assign.tracks_load());
        assert!(c.prefix.enabled);
        // Envoy's balancer keeps no load view: prefix placement without one is refused.
        let e = parse(r#"{"dp_size": 4, "assign": {"mode": "envoy"}}"#).unwrap_err();
        assert_eq!(e.field, "prefix.enabled");
        assert!(e.message.contains("load view"), "{}", e.message);
        let learn =
            parse(r#"{"dp_size": 4, "assign": {"mode": "envoy"}, "prefix": {"enabled": false}}"#)
                .unwrap();
        assert!(!learn.assign.tracks_load());
        assert_eq!(
            (c.assign.new_key_bound.factor, c.assign.pinned_bound.factor),
            (1.25, 2.0)
        );
        assert_eq!(c.assign.new_key_bound.floor, 8);
        // The pinned floor scales like the factor: ceil(8 × 2.0 / 1.25) = 13.
        assert_eq!(c.assign.pinned_bound.floor, 13);
        assert_eq!(c.assign.cooldown_seconds, 10);
        assert_eq!(c.target, TargetMode::Cluster);
    }

    #[test]
    fn pinned_floor_scales_like_the_factor() {
        assert_eq!(pinned_floor(8, 1.25, 2.0), 13);
        assert_eq!(pinned_floor(1, 1.25, 2.0), 2);
        assert_eq!(pinned_floor(8, 1.5, 1.5), 8, "equal factors, equal floors");
        assert_eq!(pinned_floor(0, 1.25, 2.0), 0);
        assert_eq!(pinned_floor(u32::MAX, 1.0, 100.0), u32::MAX, "saturates");
        let c =
            parse(r#"{"dp_size": 4, "assign": {"min_capacity": 4, "pinned_load_factor": 3.0}}"#)
                .unwrap();
        assert_eq!(
            (c.assign.new_key_bound.floor, c.assign.pinned_bound.floor),
            (4, 10)
        );
    }

    #[test]
    fn prefix_defaults_and_values() {
        let c = parse(r#"{"dp_size": 4}"#).unwrap();
        let p = &c.prefix;
        assert!(p.enabled);
        assert_eq!(
            (
                p.block_bytes,
                p.block_tokens,
                p.max_blocks,
                p.min_match_blocks,
                p.grid_bits
            ),
            (512, 64, 512, 1, 2)
        );
        assert_eq!((p.table.buckets, p.table.ways), (65_536, 16));
        assert_eq!(
            (
                p.table.ttl_seconds,
                p.table.refresh_seconds,
                p.table.cas_retries
            ),
            (3600, 1, 8)
        );
        assert_eq!(p.table.namespace, "dp_affinity_prefix");

        let c = parse(
            r#"{"dp_size":4,"prefix":{"enabled":true,"block_bytes":256,"block_tokens":32,
                "max_blocks":64,"min_match_blocks":2,"sticky_blocks":4,"grid_bits":3,
                "shared_slack":0,
                "table":{"buckets":1024,"ways":8,"ttl_seconds":600,"refresh_seconds":5,
                         "cas_retries":3,"namespace":"px"}}}"#,
        )
        .unwrap();
        let p = &c.prefix;
        assert!(p.enabled);
        assert_eq!(
            (
                p.block_bytes,
                p.block_tokens,
                p.max_blocks,
                p.min_match_blocks,
                p.sticky_blocks,
                p.grid_bits,
                p.shared_slack
            ),
            (256, 32, 64, 2, 4, 3, 0)
        );
        assert_eq!(
            (
                p.table.buckets,
                p.table.ways,
                p.table.ttl_seconds,
                p.table.refresh_seconds,
                p.table.cas_retries,
                p.table.namespace.as_str()
            ),
            (1024, 8, 600, 5, 3, "px")
        );
        // Only the prefix section changed: the affinity table keeps its defaults.
        assert_eq!(
            (c.table.buckets, c.table.namespace.as_str()),
            (65_536, "dp_affinity")
        );
    }

    #[test]
    fn prefix_hasher_follows_the_routing_key_seed() {
        use crate::prompt::{prompt_chain, Api};
        let body = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(1024));
        let chain = |json: &str| {
            let c = parse(json).unwrap();
            prompt_chain(
                body.as_bytes(),
                Api::Completions,
                &c.prefix,
                &c.prefix_hasher,
            )
            .unwrap()
        };
        let a = chain(r#"{"dp_size":4}"#);
        assert_eq!(a.len(), 2);
        assert_eq!(a, chain(r#"{"dp_size":4,"table":{"buckets":8}}"#));
        assert_ne!(a, chain(r#"{"dp_size":4,"routing_key":{"hash_seed":"s"}}"#));
    }

    #[test]
    fn bad_prefix_values_name_their_field() {
        let cases = [
            (r#"{"prefix":1}"#, "prefix: expected an object"),
            (r#"{"prefix":{"enabled":"yes"}}"#, "prefix.enabled"),
            (r#"{"prefix":{"bogus":1}}"#, "prefix.bogus: unknown field"),
            (r#"{"prefix":{"block_bytes":8}}"#, "prefix.block_bytes"),
            (r#"{"prefix":{"block_bytes":65537}}"#, "prefix.block_bytes"),
            (r#"{"prefix":{"block_bytes":-1}}"#, "prefix.block_bytes"),
            (r#"{"prefix":{"block_tokens":0}}"#, "prefix.block_tokens"),
            (
                r#"{"prefix":{"block_tokens":16385}}"#,
                "prefix.block_tokens",
            ),
            (r#"{"prefix":{"max_blocks":0}}"#, "prefix.max_blocks"),
            (r#"{"prefix":{"max_blocks":4097}}"#, "prefix.max_blocks"),
            (
                r#"{"prefix":{"min_match_blocks":0}}"#,
                "prefix.min_match_blocks",
            ),
            (
                r#"{"prefix":{"max_blocks":8,"min_match_blocks":9}}"#,
                "prefix.min_match_blocks",
            ),
            (r#"{"prefix":{"sticky_blocks":0}}"#, "prefix.sticky_blocks"),
            (
                r#"{"prefix":{"shared_slack":65537}}"#,
                "prefix.shared_slack",
            ),
            (r#"{"prefix":{"shared_slack":-1}}"#, "prefix.shared_slack"),
            (r#"{"prefix":{"load_blocks":4097}}"#, "prefix.load_blocks"),
            (r#"{"prefix":{"home_blocks":4097}}"#, "prefix.home_blocks"),
            (r#"{"prefix":{"grid_bits":0}}"#, "prefix.grid_bits"),
            (r#"{"prefix":{"grid_bits":9}}"#, "prefix.grid_bits"),
            (r#"{"prefix":{"grid_bits":1.5}}"#, "prefix.grid_bits"),
            (
                r#"{"prefix":{"table":[]}}"#,
                "prefix.table: expected an object",
            ),
            (
                r#"{"prefix":{"table":{"buckets":0}}}"#,
                "prefix.table.buckets",
            ),
            (r#"{"prefix":{"table":{"ways":65}}}"#, "prefix.table.ways"),
            (
                r#"{"prefix":{"table":{"ttl_seconds":0}}}"#,
                "prefix.table.ttl_seconds",
            ),
            (
                r#"{"prefix":{"table":{"ttl_seconds":1}}}"#,
                "prefix.table.ttl_seconds",
            ),
            (
                r#"{"prefix":{"table":{"ttl_seconds":60,"refresh_seconds":60}}}"#,
                "prefix.table.refresh_seconds",
            ),
            (
                r#"{"prefix":{"table":{"cas_retries":101}}}"#,
                "prefix.table.cas_retries",
            ),
            (
                r#"{"prefix":{"table":{"namespace":""}}}"#,
                "prefix.table.namespace",
            ),
            (
                r#"{"prefix":{"table":{"namespace":"dp_affinity"}}}"#,
                "prefix.table.namespace: must differ from table.namespace",
            ),
            (
                r#"{"table":{"namespace":"t"},"prefix":{"table":{"namespace":"t"}}}"#,
                "prefix.table.namespace",
            ),
            (r#"{"prefix":{"table":{"size":1}}}"#, "prefix.table.size"),
        ];
        for (section, needle) in cases {
            // Checked whether or not the feature is on.
            let json = format!(r#"{{"dp_size":4,{}"#, &section[1..]);
            let e = parse(&json).expect_err(&json);
            let text = e.to_string();
            assert!(text.contains(needle), "{json}: {text}");
        }
    }

    #[test]
    fn trust_secret_is_never_printed() {
        let c = parse(
            r#"{"dp_size":4,"explicit_rank":{"trusted_header":"X-Router-Token","trusted_secret":"hunter2"}}"#,
        )
        .unwrap();
        let t = c.explicit.trust.as_ref().unwrap();
        assert_eq!(t.header, "x-router-token");
        assert!(!format!("{c:?}").contains("hunter2"));
    }

    #[test]
    fn assign_and_target_modes() {
        let c = parse(
            r#"{"dp_size":8,"assign":{"mode":"bootstrap_room","seed":"s","load_factor":1.5},
                "target":{"mode":"engine_header"}}"#,
        )
        .unwrap();
        assert_eq!(c.assign.mode, Mode::BootstrapRoom);
        assert!(c.assign.tracks_load());
        assert_eq!(
            c.target,
            TargetMode::Engine(EngineTarget::one_header("x-data-parallel-rank"))
        );
        assert_eq!(
            c.body.wanted_fields.last().map(String::as_str),
            Some("bootstrap_room")
        );
        let other_seed = parse(r#"{"dp_size":8,"assign":{"mode":"hash","seed":"t"}}"#).unwrap();
        assert_ne!(c.assign.seed, other_seed.assign.seed);
    }

    #[test]
    fn engine_targets_from_presets_and_paths() {
        use crate::target::RANK_HEADER;
        let sglang = parse(r#"{"dp_size":4,"target":{"mode":"engine","engine":"sglang"}}"#)
            .unwrap()
            .target;
        assert_eq!(
            sglang,
            TargetMode::Engine(EngineTarget::preset(Engine::Sglang))
        );
        let vllm = parse(r#"{"dp_size":4,"target":{"mode":"engine","engine":"vllm"}}"#).unwrap();
        assert_eq!(
            vllm.target.engine().map(|t| t.paths.len()),
            Some(4),
            "chat, completions, responses and messages"
        );
        let listed = parse(
            r#"{"dp_size":4,"target":{"mode":"engine","paths":[
                {"prefix":"/generate","body_fields":["routed_dp_rank"]},
                {"prefix":"/v1/","header":"X-Data-Parallel-Rank"}]}}"#,
        )
        .unwrap();
        let t = listed.target.engine().unwrap();
        assert_eq!(
            t.for_path(b"/generate").unwrap().rank_field(),
            Some("routed_dp_rank")
        );
        assert_eq!(
            t.for_path(b"/v1/embeddings").unwrap().header.as_deref(),
            Some(RANK_HEADER),
            "lower-cased"
        );
        assert_eq!(t.for_path(b"/health"), None);
        // A longer prefix before a shorter one it lies under, and a name that only starts
        // like another (`/generated`), are each reached.
        let ordered = parse(
            r#"{"dp_size":4,"target":{"mode":"engine","paths":[
                {"prefix":"/v1/chat/completions","header":"a"},
                {"prefix":"/generated","header":"b"},
                {"prefix":"/generate","header":"c"},
                {"prefix":"/v1/","header":"d"}]}}"#,
        )
        .unwrap();
        let t = ordered.target.engine().unwrap();
        let header_of = |path: &[u8]| t.for_path(path).and_then(|p| p.header.as_deref());
        assert_eq!(header_of(b"/v1/chat/completions"), Some("a"));
        assert_eq!(header_of(b"/generated"), Some("b"));
        assert_eq!(header_of(b"/generate"), Some("c"));
        assert_eq!(header_of(b"/v1/models"), Some("d"));
        for engine in [Engine::Sglang, Engine::Vllm] {
            assert_eq!(
                check_unshadowed(&EngineTarget::preset(engine).paths),
                Ok(())
            );
        }
    }

    #[test]
    fn bad_engine_targets_name_their_field() {
        let cases = [
            (
                r#"{"mode":"engine"}"#,
                "target.engine: target.mode \"engine\" needs",
            ),
            (
                r#"{"mode":"engine","engine":"tgi"}"#,
                "target.engine: must be",
            ),
            (
                r#"{"engine":"sglang"}"#,
                "target.mode: target.engine and target.paths need",
            ),
            (r#"{"mode":"engine_header","paths":[]}"#, "target.mode"),
            (
                r#"{"mode":"engine","engine":"vllm","paths":[]}"#,
                "target.paths: set target.engine",
            ),
            (r#"{"mode":"engine","paths":[]}"#, "target.paths: must list"),
            (
                r#"{"mode":"engine","paths":{}}"#,
                "target.paths: expected a list",
            ),
            (
                r#"{"mode":"engine","paths":[1]}"#,
                "target.paths[0]: expected an object",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"v1","header":"x"}]}"#,
                "target.paths[0].prefix",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/"}]}"#,
                "target.paths[0].header: each path needs",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/","header":"a b"}]}"#,
                "target.paths[0].header",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/","body_fields":[""]}]}"#,
                "target.paths[0].body_fields",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/","bogus":1}]}"#,
                "target.paths[0].bogus: unknown field",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/v1/","header":"x"},{"prefix":"/v1/chat","header":"y"}]}"#,
                "target.paths[1].prefix: \"/v1/chat\" is never used: target.paths[0] (\"/v1/\")",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/generate","header":"x"},{"prefix":"/generate/x","header":"y"}]}"#,
                "target.paths[1].prefix",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/a","header":"x"},{"prefix":"/b","header":"y"},{"prefix":"/a","header":"y"}]}"#,
                "target.paths[2].prefix: \"/a\" is never used: target.paths[0]",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/","header":"x"},{"prefix":"/generate","body_fields":["f"]}]}"#,
                "target.paths[1].prefix",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/","body_fields":["user"]}]}"#,
                "target.paths[0].body_fields: \"user\" is also a routing_key",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/","body_fields":["bootstrap_room"]}]}"#,
                "assign.room_field",
            ),
            (
                r#"{"mode":"engine","paths":[{"prefix":"/v1/","header":"x-routing-key"}]}"#,
                "target.paths[0].header: \"x-routing-key\" is also routing_key.headers[1]",
            ),
        ];
        for (target, needle) in cases {
            let json = format!(r#"{{"dp_size":4,"target":{target}}}"#);
            let text = parse(&json).expect_err(&json).to_string();
            assert!(text.contains(needle), "{json}: {text}");
        }
    }

    #[test]
    fn header_names_are_lower_cased_and_off_switches_work() {
        let c = parse(
            r#"{"dp_size":2,"routing_key":{"headers":["X-Session-ID"]},"echo_header":"",
                "learn":{"response_header":""},"explicit_rank":{"enabled":false}}"#,
        )
        .unwrap();
        assert_eq!(c.key.headers, ["x-session-id"]);
        assert_eq!(c.echo_header, None);
        assert_eq!(c.learn.response_header, None);
        assert_eq!(
            c.body.wanted_fields,
            ["routing_key", "prompt_cache_key", "user"]
        );
        // Headers the filter only reads may be any header, framing ones included.
        let read_only = parse(
            r#"{"dp_size":2,"routing_key":{"headers":["Host","user-agent"]},
                "learn":{"response_header":"Content-Type"}}"#,
        )
        .unwrap();
        assert_eq!(read_only.key.headers, ["host", "user-agent"]);
        assert_eq!(
            read_only.learn.response_header.as_deref(),
            Some("content-type")
        );
    }

    #[test]
    fn request_header_roles_must_not_share_a_name() {
        // (config after dp_size, the error: the later field, the value and the earlier field)
        let trust = r#""trusted_secret":"s","trusted_header""#;
        let cases = [
            (
                r#""explicit_rank":{"header":"x-foo"},"target":{"cluster_header":"X-Foo"}"#,
                r#"target.cluster_header: "x-foo" is also explicit_rank.header"#,
            ),
            (
                r#""target":{"cluster_header":"x-data-parallel-rank"}"#,
                r#"target.cluster_header: "x-data-parallel-rank" is also explicit_rank.header"#,
            ),
            (
                r#""routing_key":{"headers":["x-data-parallel-rank"]}"#,
                "routing_key.headers[0]: \"x-data-parallel-rank\" is also explicit_rank.header",
            ),
            (
                r#""routing_key":{"headers":["x-a","x-dp-affinity-cluster"]}"#,
                "target.cluster_header: \"x-dp-affinity-cluster\" is also routing_key.headers[1]",
            ),
            (
                &format!(r#""explicit_rank":{{{trust}:"x-data-parallel-rank"}}"#),
                "explicit_rank.trusted_header: \"x-data-parallel-rank\" is also explicit_rank.header",
            ),
            (
                &format!(r#""explicit_rank":{{{trust}:" X-Routing-Key "}}"#),
                "routing_key.headers[1]: \"x-routing-key\" is also explicit_rank.trusted_header",
            ),
            (
                &format!(r#""explicit_rank":{{{trust}:"x-dp-affinity-cluster"}}"#),
                "target.cluster_header: \"x-dp-affinity-cluster\" is also explicit_rank.trusted_header",
            ),
            (
                r#""target":{"mode":"engine_header","engine_header":"x-smg-routing-key"}"#,
                "target.engine_header: \"x-smg-routing-key\" is also routing_key.headers[0]",
            ),
            (
                r#""target":{"mode":"engine_header","engine_header":"x-dp-affinity-cluster"}"#,
                "target.engine_header: \"x-dp-affinity-cluster\" is also target.cluster_header",
            ),
            (
                &format!(
                    r#""explicit_rank":{{{trust}:"x-t"}},"target":{{"mode":"engine_header","engine_header":"x-t"}}"#
                ),
                "target.engine_header: \"x-t\" is also explicit_rank.trusted_header",
            ),
            (
                r#""routing_key":{"headers":["Content-Type"]}"#,
                "routing_key.headers[0]: \"content-type\" is also the content-type header (body.content_types)",
            ),
            (
                r#""explicit_rank":{"header":"content-length"}"#,
                "explicit_rank.header: \"content-length\" frames or routes the message itself",
            ),
            (
                r#""target":{"mode":"engine_header","engine_header":"content-length"}"#,
                "target.engine_header: \"content-length\" frames",
            ),
            // Checked whether or not the override is on: a disabled explicit-rank header is
            // still stripped, so it still hides the other role.
            (
                r#""explicit_rank":{"enabled":false},"routing_key":{"headers":["x-data-parallel-rank"]}"#,
                "routing_key.headers[0]",
            ),
        ];
        for (section, needle) in cases {
            let json = format!(r#"{{"dp_size":4,{section}}}"#);
            let text = parse(&json).expect_err(&json).to_string();
            assert!(
                text.starts_with("invalid plugin configuration: ") && text.contains(needle),
                "{json}: {text}"
            );
        }

        let allowed = [
            // The default engine mode: the engine honours the header clients send.
            r#""target":{"mode":"engine_header"}"#,
            r#""explicit_rank":{"header":"x-r"},"target":{"mode":"engine_header","engine_header":"X-R"}"#,
            // The engine header is not used in cluster mode.
            r#""target":{"engine_header":"x-smg-routing-key"}"#,
            // One role, listed twice.
            r#""routing_key":{"headers":["x-k","X-K"]}"#,
            // Response headers do not share the request's header map.
            r#""echo_header":"x-data-parallel-rank","learn":{"response_header":"x-routing-key"}"#,
            r#""echo_header":"x-dp-affinity-cluster""#,
        ];
        for section in allowed {
            let json = format!(r#"{{"dp_size":4,{section}}}"#);
            if let Err(e) = parse(&json) {
                panic!("{json}: {e}");
            }
        }
    }

    #[test]
    fn upstream_addresses_take_envoys_address_shapes() {
        let json = r#"{"dp_size":4,"learn":{"upstream_addresses":{"127.0.0.1:18000":0,"[::1]:8000":1,"[fd00::5]:30001":2}}}"#;
        let c = parse(json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.learn.upstream_addresses.len(), 3);
        // Written otherwise than Envoy writes `upstream.address` (a string lookup): never a
        // match, so refused.
        let with_address = |addr: &str| {
            parse(&format!(
                r#"{{"dp_size":4,"learn":{{"upstream_addresses":{{"{addr}":1}}}}}}"#
            ))
        };
        for addr in [
            "10.0.0.5",
            "[FD00::5]:8000",
            "[fd00::05]:8000",
            "10.0.0.5:08000",
            "010.0.0.5:8000",
            "1.2.3:80",
            "1.2.3.4.5:80",
            "999.0.0.1:80",
            "10.0.0.5:0",
            "10.0.0.5:",
            "[fd00::5:8000",
        ] {
            let e = with_address(addr).expect_err(addr);
            assert!(e.to_string().contains("would never match"), "{e}");
        }
        for addr in [
            "0.0.0.0:1",
            "255.255.255.255:65535",
            "[::]:80",
            "[::ffff:10.0.0.5]:80",
        ] {
            assert!(with_address(addr).is_ok(), "{addr}");
        }
        let e = parse(r#"{"dp_size":4,"assign":{"load_factor":3.0}}"#)
            .expect_err("a load factor over the pinned one is refused");
        assert!(e.to_string().contains("its default, 2.0, is below"), "{e}");
    }

    #[test]
    fn limits_and_off_switches_at_their_edges() {
        let c = parse(
            r#"{"dp_size":4,"assign":{"cooldown_seconds":3600},"table":{"buckets":262144,"ways":64},
                "explicit_rank":{"trusted_header":"x-t","trusted_secret":"correct horse ~!-:;"}}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.assign.cooldown_seconds, 3600);
        assert_eq!(c.table.buckets * c.table.ways, 1 << 24);
        // Envoy mode learns from the answer's header (the default) or from addresses alone.
        let addresses_only = r#"{"dp_size":4,"assign":{"mode":"envoy"},"prefix":{"enabled":false},
            "learn":{"response_header":"","upstream_addresses":{"10.0.0.5:8000":1}}}"#;
        assert!(parse(addresses_only).is_ok());
        // `target.engine_header` may wait in cluster mode for a switch to engine_header mode.
        let waiting = parse(r#"{"dp_size":4,"target":{"engine_header":"X-Rank"}}"#).unwrap();
        assert_eq!(waiting.target, TargetMode::Cluster);
        // No body read at all is allowed, and warned about when prefix placement is on.
        let no_body = parse(r#"{"dp_size":4,"body":{"content_types":[]}}"#).unwrap();
        let warned = no_body.warnings();
        assert!(
            warned
                .iter()
                .any(|w| w.contains("body.content_types is empty")),
            "{warned:?}"
        );
        let header_only = parse(
            r#"{"dp_size":4,"body":{"content_types":[]},"prefix":{"enabled":false},
                "routing_key":{"hash_seed":"s"}}"#,
        )
        .unwrap();
        assert_eq!(header_only.warnings(), Vec::<String>::new());
    }

    #[test]
    fn an_empty_hash_seed_is_warned_about() {
        let warned = parse(r#"{"dp_size":4}"#).unwrap().warnings();
        assert_eq!(warned.len(), 1, "{warned:?}");
        let w = &warned[0];
        for needle in [
            "routing_key.hash_seed is empty",
            "publicly known key",
            "which rank a key goes to",
            "Set routing_key.hash_seed to a secret",
        ] {
            assert!(w.contains(needle), "{needle:?} not in {w}");
        }
        let seeded = parse(r#"{"dp_size":4,"routing_key":{"hash_seed":"s3cret"}}"#).unwrap();
        assert_eq!(seeded.warnings(), Vec::<String>::new());
        assert!(!format!("{:?}", seeded.warnings()).contains("s3cret"));
    }

    #[test]
    fn bad_configs_name_their_field() {
        let cases = [
            (r#"{}"#, "dp_size"),
            (r#"{"dp_size":0}"#, "dp_size"),
            (r#"{"dp_size":5000}"#, "dp_size"),
            (r#"{"dp_size":-1}"#, "dp_size"),
            (r#"{"dp_size":18446744073709551615}"#, "or too large"),
            (r#"{"dp_size":1e20}"#, "or too large"),
            (r#"{"dp_size":2.5}"#, "with a fraction"),
            (r#"{"dp_size":4,"bogus":1}"#, "bogus"),
            (r#"{"dp_size":4,"table":{"buckets":0}}"#, "table.buckets"),
            (r#"{"dp_size":4,"table":{"ways":65}}"#, "table.ways"),
            (
                r#"{"dp_size":4,"table":{"ttl_seconds":0}}"#,
                "table.ttl_seconds",
            ),
            (
                r#"{"dp_size":4,"table":{"ttl_seconds":10,"refresh_seconds":15}}"#,
                "table.refresh_seconds",
            ),
            (
                r#"{"dp_size":4,"table":{"namespace":"a b"}}"#,
                "table.namespace",
            ),
            (r#"{"dp_size":4,"table":{"wayz":2}}"#, "table.wayz"),
            (
                r#"{"dp_size":4,"target":{"cluster_template":"rank"}}"#,
                "cluster_template",
            ),
            (
                r#"{"dp_size":4,"target":{"cluster_header":"bad header"}}"#,
                "cluster_header",
            ),
            // Headers the filter sets or removes must not frame or route the message.
            (
                r#"{"dp_size":4,"echo_header":"Content-Length"}"#,
                "echo_header: \"Content-Length\" frames or routes the message itself",
            ),
            (
                r#"{"dp_size":4,"target":{"cluster_header":"host"}}"#,
                "target.cluster_header: \"host\" frames",
            ),
            (
                r#"{"dp_size":4,"explicit_rank":{"header":"transfer-encoding"}}"#,
                "explicit_rank.header",
            ),
            (
                r#"{"dp_size":4,"explicit_rank":{"trusted_header":"connection","trusted_secret":"s"}}"#,
                "explicit_rank.trusted_header",
            ),
            (
                r#"{"dp_size":4,"target":{"mode":"engine_header","engine_header":"content-type"}}"#,
                "target.engine_header",
            ),
            (
                r#"{"dp_size":4,"target":{"mode":"engine","paths":[{"prefix":"/","header":"TE"}]}}"#,
                "target.paths[0].header: \"TE\" frames",
            ),
            (
                r#"{"dp_size":4,"explicit_rank":{"on_invalid":"drop"}}"#,
                "drop",
            ),
            (
                r#"{"dp_size":4,"routing_key":{"max_bytes":0}}"#,
                "routing_key.max_bytes",
            ),
            (
                r#"{"dp_size":4,"routing_key":{"body_fields":["routed_dp_rank"]}}"#,
                "routing_key.body_fields",
            ),
            (
                r#"{"dp_size":4,"body":{"content_types":["json"]}}"#,
                "body.content_types",
            ),
            (
                r#"{"dp_size":4,"learn":{"upstream_addresses":{"1.2.3.4:80":4}}}"#,
                "learn.upstream_addresses",
            ),
            (
                r#"{"dp_size":4,"learn":{"upstream_addresses":{"notanaddr":1}}}"#,
                "learn.upstream_addresses",
            ),
            (
                r#"{"dp_size":4,"learn":{"upstream_addresses":{"10.0.0.5":1}}}"#,
                "learn.upstream_addresses",
            ),
            (
                r#"{"dp_size":4,"learn":{"upstream_addresses":{"rank-1.llm.svc:8000":1}}}"#,
                "learn.upstream_addresses",
            ),
            (
                r#"{"dp_size":4,"learn":{"upstream_addresses":{"::1:8000":1}}}"#,
                "learn.upstream_addresses",
            ),
            (
                r#"{"dp_size":4,"assign":{"load_factor":3.0}}"#,
                "assign.pinned_load_factor",
            ),
            (r#"not json"#, "configuration"),
            // A member named twice is refused, at every depth (serde_json would keep the last).
            (
                r#"{"dp_size":4,"explicit_rank":{"trusted_header":"x-t","trusted_secret":"s"},"explicit_rank":{"on_invalid":"ignore"}}"#,
                "configuration: member \"explicit_rank\" appears twice",
            ),
            (
                r#"{"dp_size":8,"dp_size":4}"#,
                "member \"dp_size\" appears twice",
            ),
            (
                r#"{"dp_size":4,"target":{"paths":[{"prefix":"/","prefix":"/v1"}]}}"#,
                "member \"prefix\" appears twice",
            ),
            (
                r#"{"dp_size":4,"assign":{"cooldown_seconds":4294967295}}"#,
                "assign.cooldown_seconds: must be in 0..=3600",
            ),
            (
                r#"{"dp_size":4,"assign":{"mode":"envoy"},"prefix":{"enabled":false},"learn":{"response_header":""}}"#,
                "learn.response_header: assign.mode \"envoy\" learns",
            ),
            (
                r#"{"dp_size":4,"explicit_rank":{"trusted_header":"x-t","trusted_secret":"s3cret\n"}}"#,
                "explicit_rank.trusted_secret: must be printable ASCII",
            ),
            (
                r#"{"dp_size":4,"explicit_rank":{"trusted_header":"x-t","trusted_secret":" s3cret"}}"#,
                "explicit_rank.trusted_secret",
            ),
            (
                r#"{"dp_size":4,"explicit_rank":{"trusted_header":"x-t","trusted_secret":"s3cret "}}"#,
                "explicit_rank.trusted_secret",
            ),
            (
                r#"{"dp_size":4,"explicit_rank":{"trusted_header":"x-t","trusted_secret":"sécret"}}"#,
                "explicit_rank.trusted_secret",
            ),
            (
                r#"{"dp_size":4,"table":{"buckets":1048576,"ways":64}}"#,
                "table.buckets: buckets x ways must be at most 16777216 entries",
            ),
            (
                r#"{"dp_size":4,"table":{"buckets":1048577,"ways":1}}"#,
                "table.buckets: must be in 1..=1048576",
            ),
            (
                r#"{"dp_size":4,"prefix":{"table":{"buckets":1048576,"ways":17}}}"#,
                "prefix.table.buckets: buckets x ways",
            ),
            (
                r#"{"dp_size":4,"body":{"content_types":["application/*"]}}"#,
                "body.content_types: \"application/*\" is not a media type",
            ),
            (
                r#"{"dp_size":4,"target":{"mode":"engine","engine":"sglang","engine_header":"x-rank"}}"#,
                "target.engine_header: is used by target.mode \"engine_header\" only",
            ),
            (
                r#"{"dp_size":4,"target":{"engine_header":"bad header"}}"#,
                "target.engine_header",
            ),
            (
                r#"{"dp_size":4,"learn":{"upstream_addresses":{"10.0.0.5:8000":"1"}}}"#,
                "learn.upstream_addresses[\"10.0.0.5:8000\"]",
            ),
            (r#"{"dp_size":4,"assign":{"mode":"random"}}"#, "assign.mode"),
            (
                r#"{"dp_size":4,"assign":{"load_factor":0.9}}"#,
                "assign.load_factor",
            ),
            (
                r#"{"dp_size":4,"assign":{"load_factor":"x"}}"#,
                "assign.load_factor",
            ),
            (
                r#"{"dp_size":4,"assign":{"load_factor":1.5,"pinned_load_factor":1.2}}"#,
                "assign.pinned_load_factor",
            ),
            (
                r#"{"dp_size":4,"assign":{"mode":"bootstrap_room","room_field":"user"}}"#,
                "assign.room_field",
            ),
            (r#"{"dp_size":4,"target":{"mode":"dns"}}"#, "target.mode"),
            (
                r#"{"dp_size":4,"explicit_rank":{"trusted_header":"x-t"}}"#,
                "explicit_rank.trusted_header",
            ),
            (
                r#"{"dp_size":4,"explicit_rank":{"trusted_secret":"s"}}"#,
                "explicit_rank.trusted_secret",
            ),
            (
                r#"{"dp_size":4,"explicit_rank":{"trusted_header":"a b","trusted_secret":"s"}}"#,
                "explicit_rank.trusted_header",
            ),
            (
                r#"{"dp_size":4,"target":{"mode":"engine_header","engine_header":""}}"#,
                "target.engine_header",
            ),
        ];
        for (json, needle) in cases {
            let e = parse(json).expect_err(json);
            let text = e.to_string();
            assert!(text.contains(needle), "{json}: {text}");
        }
    }
}
