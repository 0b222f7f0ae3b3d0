//! The decision order, as values: explicit rank, then the routing key's pin, then the prompt
//! prefix (when `prefix.enabled`), then the assigner or Envoy's balancing.
//!
//! The host layer feeds facts in and turns the returned `Decision` / [`Placement`] into header
//! changes and local replies; nothing here performs an action.

use crate::assign::{busier_than_least, keep_pin, room_rank, Mode};
use crate::chain::Chain;
use crate::config::{Config, OnInvalid};
use crate::extract::{rank_from_header, scan_body_and_prompt, HeaderFacts, RankError};
use crate::prefix_index::Match;
use crate::prompt::Api;
use crate::ranks::RankStates;
use crate::table::{self, AffinityTable, Lookup, Store};

/// Why a request was left to the fallback. Each maps to one counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// No routing key anywhere.
    NoKey,
    /// The body was larger than `body.max_bytes`, so body fields were not read.
    BodyTooLarge,
    /// The body claimed to be JSON and was not.
    BodyMalformed,
}

/// A 400 answer built by the filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u32,
    pub body: String,
}

/// What the request-side decision produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Send to this rank (explicit).
    Rank(u32),
    /// Send to this rank by SGLang's bootstrap-room rule (`bootstrap_room` mode).
    Room(u32),
    /// A routing key: look it up in the table (see [`resolve_key`]).
    Key { hash: u64, too_long: bool },
    /// Let Envoy balance; nothing to learn.
    Fallback(Reason),
    /// Answer the client directly.
    Reject(Rejection),
}

/// Decision after the headers, or a request to read the body first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderStep {
    Decided(Decision),
    ReadBody,
}

/// Decides from the headers alone when possible.
///
/// A routing-key header settles the request here, unless the body is needed anyway: in
/// `bootstrap_room` mode (the room outranks a key) and when prefix placement reads this request's
/// prompt (`HeaderFacts::prefix_api`: the prefix is recorded under the key's rank, and decides
/// when the key is not pinned). Otherwise requests carrying a key header are never buffered, so a
/// body rank field is not consulted for them (send the rank as a header in that case).
pub fn decide_headers(cfg: &Config, h: &HeaderFacts<'_>, end_of_stream: bool) -> HeaderStep {
    if cfg.explicit.enabled && h.trusted {
        if let Some(value) = h.explicit {
            let parsed = if h.explicit_conflict {
                Err(RankError {
                    field: cfg.explicit.header.clone(),
                    problem: "was sent several times with different values".into(),
                })
            } else {
                rank_from_header(cfg, value)
            };
            match parsed {
                Ok(rank) => return HeaderStep::Decided(Decision::Rank(rank)),
                Err(e) if cfg.explicit.on_invalid == OnInvalid::Reject => {
                    return HeaderStep::Decided(Decision::Reject(reject(cfg, &e)));
                }
                Err(_) => {} // ignored: as if absent
            }
        }
    }
    let room_mode = cfg.assign.mode == Mode::BootstrapRoom;
    let prefix = h.prefix_api(cfg).is_some();
    if let Some((_, key)) = h.key.filter(|_| !room_mode && !prefix) {
        return HeaderStep::Decided(key_decision(cfg, key));
    }
    let header_key = || match h.key {
        Some((_, key)) => key_decision(cfg, key),
        None => Decision::Fallback(Reason::NoKey),
    };
    let wants_body = prefix || !cfg.body.wanted_fields.is_empty();
    if end_of_stream || !wants_body || !h.is_json(cfg) {
        return HeaderStep::Decided(header_key());
    }
    if h.declared_length()
        .is_some_and(|n| n > cfg.body.max_bytes as u64)
    {
        return HeaderStep::Decided(match h.key {
            Some(_) => header_key(),
            None => Decision::Fallback(Reason::BodyTooLarge),
        });
    }
    HeaderStep::ReadBody
}

/// Decides from a complete JSON body (only called after `ReadBody`). `header_key` is a key that
/// came in a header (in `bootstrap_room` mode, or with prefix placement on, where the body is
/// read anyway): it beats any body key. `trusted`: the caller may choose a rank (see
/// `HeaderFacts::trusted`).
pub fn decide_body(
    cfg: &Config,
    body: &[u8],
    header_key: Option<&[u8]>,
    trusted: bool,
) -> Decision {
    decide_body_with_prefix(cfg, body, header_key, trusted, None).0
}

/// [`decide_body`] that also hashes the prompt of `api` (`HeaderFacts::prefix_api`) in the same
/// pass over the body. The chain comes back only with the decisions that use it (a key, or no
/// key); an explicit rank, a room, a rejection, or a body that could not be read (too large,
/// malformed) give an empty chain.
pub fn decide_body_with_prefix(
    cfg: &Config,
    body: &[u8],
    header_key: Option<&[u8]>,
    trusted: bool,
    api: Option<Api>,
) -> (Decision, Chain) {
    let without_body = |reason| (without_body(cfg, reason, header_key), Chain::default());
    if body.len() > cfg.body.max_bytes {
        return without_body(Reason::BodyTooLarge);
    }
    let api = api.filter(|_| cfg.prefix.enabled);
    let (facts, chain) = match scan_body_and_prompt(cfg, body, api) {
        Ok(f) => f,
        Err(_) => return without_body(Reason::BodyMalformed),
    };
    match facts.rank.filter(|_| trusted) {
        Some(Ok(rank)) => return (Decision::Rank(rank), Chain::default()),
        Some(Err(e)) if cfg.explicit.on_invalid == OnInvalid::Reject => {
            return (Decision::Reject(reject(cfg, &e)), Chain::default());
        }
        _ => {}
    }
    if let Some(room) = facts.room {
        return (
            Decision::Room(room_rank(room, cfg.dp_size)),
            Chain::default(),
        );
    }
    let decision = match header_key.or(facts.key.as_deref()) {
        Some(key) => key_decision(cfg, key),
        None => Decision::Fallback(Reason::NoKey),
    };
    (decision, chain)
}

/// The decision when the body cannot be used (`reason`): a header key if there was one.
pub fn without_body(cfg: &Config, reason: Reason, header_key: Option<&[u8]>) -> Decision {
    match header_key {
        Some(key) => key_decision(cfg, key),
        None => Decision::Fallback(reason),
    }
}

fn key_decision(cfg: &Config, key: &[u8]) -> Decision {
    Decision::Key {
        hash: cfg.key.hasher.hash(key),
        too_long: key.len() > cfg.key.max_bytes,
    }
}

/// Resolves a routing key against the affinity table: the pinned rank, if any, and whether the
/// bucket failed to decode (read as empty; worth a counter).
pub fn resolve_key(
    cfg: &Config,
    table: &AffinityTable,
    store: &dyn Store,
    hash: u64,
    now: u32,
) -> (Option<u32>, bool) {
    match table.lookup(store, hash, now, cfg.dp_size) {
        Lookup::Hit { rank } => (Some(rank), false),
        Lookup::Miss => (None, false),
        Lookup::Undecodable => (None, true),
    }
}

/// What the prefix stage made of a request the explicit rank and the key's pin left open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixChoice {
    /// Route to the rank holding the longest indexed prefix (`blocks` blocks of it).
    Hit { rank: u32, blocks: usize },
    /// No indexed prefix of at least `prefix.min_match_blocks` blocks: the next choice decides.
    Miss,
    /// A prefix of `blocks` blocks is on `rank`, but the rank is full under the load bound
    /// (`assign.load_factor`, `assign.min_capacity`) or cooling down: the next choice decides.
    SkippedFull { rank: u32, blocks: usize },
    /// The match stops at a branched position (a prefix other prompts share, see `prefix`) and
    /// `rank` has more than `prefix.shared_slack` requests in flight beyond the least loaded
    /// usable rank: the next choice places the request by load.
    Spread { rank: u32, blocks: usize },
}

/// The prefix stage on a lookup's result. `states`: the shared rank state when the filter counts
/// requests in flight (every `assign.mode` but `envoy`); `None` in `envoy` mode, where there are
/// no in-flight counts, so a match is never full (Envoy's balancer only sees the requests that
/// reach it without a cluster header).
///
/// Which bound makes a rank full depends on the match's depth: from `prefix.sticky_blocks` on it
/// is the looser bound of a pinned key (`assign.pinned_load_factor`), below it the one new keys
/// get (`assign.load_factor`). The default `sticky_blocks` 1 gives every match the pinned bound:
/// what tells a shared prefix from a conversation's own history is the branched flag below, and
/// a deployment whose short prefixes are all shared can still raise it.
///
/// A match on a branched position is a prefix other prompts share, not this prompt's own
/// history: any rank can compute it once and serve it from then on, so it keeps its rank (the
/// least loaded of the ranks known to hold it) only while that rank is about as idle as the
/// least loaded one (`prefix.shared_slack`). Without this, every prompt opening with a popular
/// system prompt would go to the rank that saw it first, until that rank is full.
pub fn prefix_choice(
    cfg: &Config,
    m: &Match,
    states: Option<&RankStates>,
    now: u32,
) -> PrefixChoice {
    prefix_choice_at(cfg, m, states, now, None)
}

/// [`prefix_choice`] weighed against the request's *home*: the rank the assigner gives it
/// without the prefix (in `hash` mode the rendezvous rank of its key or anchor, the same on
/// every replica). The match keeps its rank only when the prompt blocks it saves there,
/// beyond what the home holds, outweigh the work already queued there beyond the home's:
///
/// `saved > prefix.load_blocks × max(0, in flight there − in flight at home) + prefix.home_blocks`
///
/// So a long conversation history (80 blocks) stays over a difference of a request or two, a
/// short shared system prompt (4 blocks) never outweighs the home's bonus, and on a quiet
/// cluster new conversations spread by their home instead of piling onto the first rank that
/// computed a popular prefix.
pub fn prefix_choice_at(
    cfg: &Config,
    m: &Match,
    states: Option<&RankStates>,
    now: u32,
    home: Option<u32>,
) -> PrefixChoice {
    let min = cfg.prefix.min_match_blocks.max(1) as usize;
    let rank = match m.rank {
        Some(rank) if m.blocks >= min && rank < cfg.dp_size => rank,
        _ => return PrefixChoice::Miss,
    };
    let blocks = m.blocks;
    // A shared prefix may be held by other ranks too: the least loaded of them stands for it.
    let rank = match states {
        Some(st) if m.branched => least_loaded_holder(st, now, rank, m.holders, cfg.dp_size),
        _ => rank,
    };
    // At least `sticky_blocks` deep (every match, by default): it stays like a pin. Shallower: it
    // yields like a new key.
    let bound = if blocks >= cfg.prefix.sticky_blocks as usize {
        cfg.assign.pinned_bound
    } else {
        cfg.assign.new_key_bound
    };
    match (states, home) {
        (Some(st), _) if !keep_pin(st, now, rank, bound) => {
            PrefixChoice::SkippedFull { rank, blocks }
        }
        (Some(st), Some(home)) if home != rank && !outweighs_home(cfg, m, st, rank, home) => {
            PrefixChoice::Spread { rank, blocks }
        }
        (Some(st), None)
            if m.branched && busier_than_least(st, now, rank, cfg.prefix.shared_slack) =>
        {
            PrefixChoice::Spread { rank, blocks }
        }
        _ => PrefixChoice::Hit { rank, blocks },
    }
}

/// Whether the match on `rank` saves more prompt blocks than the extra work queued there costs,
/// compared with going `home` (see [`prefix_choice_at`]).
fn outweighs_home(cfg: &Config, m: &Match, st: &RankStates, rank: u32, home: u32) -> bool {
    let blocks = m.blocks as u64;
    // A shared prefix held at home too saves nothing by going elsewhere.
    let home_holds =
        m.branched && (m.rank == Some(home) || m.holders & table::holder_flag(home) != 0);
    let saved = if home_holds { 0 } else { blocks };
    // Only extra work counts against the match: a holder idler than the home gains nothing from
    // it, or a replica that sees other loads would send the conversation elsewhere.
    let queued = st.inflight(rank).saturating_sub(st.inflight(home));
    // The bonus is for a home every replica computes alike and every turn returns to: the
    // rendezvous rank (`hash`). Another assigner's choice (the least loaded rank) changes from
    // one request to the next, so it earns none.
    let bonus = match cfg.assign.mode {
        Mode::Hash => cfg.prefix.home_blocks,
        _ => 0,
    };
    let cost = u64::from(cfg.prefix.load_blocks) * u64::from(queued) + u64::from(bonus);
    saved > cost
}

/// Where a request goes once no explicit rank or room decided it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// The key's pin holds (usable and under `assign.pinned_load_factor` when load is counted).
    Pin(u32),
    /// The rank of the longest indexed prompt prefix.
    Prefix { rank: u32, blocks: usize },
    /// The assigner's choice; `None`: Envoy balances (`envoy` mode, or no usable rank).
    Assigned(Option<u32>),
}

/// A placement, and what the prefix stage said if it was consulted (`None`: a pin decided first,
/// or the request has no prompt chain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub placed: Placed,
    pub prefix: Option<PrefixChoice>,
}

/// The decision order below the explicit rank: the key's pin (`pinned`, from the affinity
/// table), then the prefix match (`prefix`: the index lookup of this request's chain, `None`
/// when it has none), then `assign` (the configured assigner; it returns `None` in `envoy` mode).
/// `states` as in [`prefix_choice`]; with states, a pin is kept only while its rank is usable and
/// under the pinned bound, else the key moves to the next choice.
///
/// Pure: the host calls it inside the rank board's atomic update (so the choice and the
/// in-flight count agree), or directly in `envoy` mode.
pub fn place(
    cfg: &Config,
    now: u32,
    pinned: Option<u32>,
    prefix: Option<&Match>,
    states: Option<&RankStates>,
    assign: impl FnOnce() -> Option<u32>,
) -> Placement {
    if let Some(rank) = pinned {
        let kept = match states {
            Some(st) => keep_pin(st, now, rank, cfg.assign.pinned_bound),
            None => true,
        };
        if kept {
            return Placement {
                placed: Placed::Pin(rank),
                prefix: None,
            };
        }
    }
    let Some(m) = prefix else {
        return Placement {
            placed: Placed::Assigned(assign()),
            prefix: None,
        };
    };
    // With load counted, the assigner's choice is the request's home, weighed against the
    // match; without (`envoy` mode) the assigner only stands in when the prefix does not decide.
    let (choice, placed) = match states {
        Some(_) => {
            let home = assign();
            let choice = prefix_choice_at(cfg, m, states, now, home);
            (choice, hit_or(choice, || home))
        }
        None => {
            let choice = prefix_choice(cfg, m, None, now);
            (choice, hit_or(choice, assign))
        }
    };
    let choice = Some(choice);
    Placement {
        placed,
        prefix: choice,
    }
}

/// The prefix's rank on a hit, else what `otherwise` assigns.
fn hit_or(choice: PrefixChoice, otherwise: impl FnOnce() -> Option<u32>) -> Placed {
    match choice {
        PrefixChoice::Hit { rank, blocks } => Placed::Prefix { rank, blocks },
        _ => Placed::Assigned(otherwise()),
    }
}

/// Among `rank` and the ranks flagged in `holders` (below `dp_size`), the usable one with the
/// fewest requests in flight; `rank` wins ties, and stands if none is usable.
fn least_loaded_holder(st: &RankStates, now: u32, rank: u32, holders: u16, dp_size: u32) -> u32 {
    std::iter::once(rank)
        .chain(table::holders(holders).filter(|&r| r < dp_size && r != rank))
        .filter(|&r| st.usable(r, now))
        .min_by_key(|&r| st.inflight(r))
        .unwrap_or(rank)
}

/// Builds the 400 answer for an invalid explicit rank, in OpenAI's error shape. Its size does not
/// depend on the request: a `RankError` quotes at most `extract::QUOTE_MAX_BYTES` of the value
/// (a few hundred bytes in all), so a megabyte rank field cannot be echoed or copied here.
pub fn reject(cfg: &Config, e: &RankError) -> Rejection {
    let message = format!(
        "{} must be an integer in 0..={} (dp_size {}); {}",
        e.field,
        cfg.dp_size - 1,
        cfg.dp_size,
        e.problem
    );
    // Written by hand (with serde_json escaping the strings): the error path stays small.
    let body = format!(
        r#"{{"error":{{"message":{},"type":"invalid_request_error","param":{},"code":"invalid_data_parallel_rank"}}}}"#,
        json_string(&message),
        json_string(&e.field),
    );
    Rejection { status: 400, body }
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::tests::MemStore;

    fn cfg(extra: &str) -> Config {
        Config::from_json(format!(r#"{{"dp_size":4{extra}}}"#).as_bytes()).unwrap()
    }

    fn headers<'a>(c: &Config, h: &'a [(&'a str, &'a str)]) -> HeaderFacts<'a> {
        HeaderFacts::collect(c, h.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
    }

    const JSON: (&str, &str) = ("content-type", "application/json");

    #[test]
    fn explicit_header_wins_over_key() {
        let c = cfg("");
        let h = headers(
            &c,
            &[("x-data-parallel-rank", "2"), ("x-smg-routing-key", "k")],
        );
        assert_eq!(
            decide_headers(&c, &h, false),
            HeaderStep::Decided(Decision::Rank(2))
        );
    }

    #[test]
    fn invalid_explicit_header_rejects_or_is_ignored() {
        let c = cfg("");
        let h = headers(
            &c,
            &[("x-data-parallel-rank", "7"), ("x-smg-routing-key", "k")],
        );
        let HeaderStep::Decided(Decision::Reject(r)) = decide_headers(&c, &h, true) else {
            panic!("expected a rejection");
        };
        assert_eq!(r.status, 400);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"]["param"], "x-data-parallel-rank");
        assert!(v["error"]["message"].as_str().unwrap().contains("0..=3"));
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "invalid_data_parallel_rank");

        let c = cfg(r#","explicit_rank":{"on_invalid":"ignore"}"#);
        let h = headers(
            &c,
            &[("x-data-parallel-rank", "7"), ("x-smg-routing-key", "k")],
        );
        assert!(matches!(
            decide_headers(&c, &h, true),
            HeaderStep::Decided(Decision::Key { .. })
        ));
    }

    #[test]
    fn hostile_rank_values_still_give_valid_json() {
        let c = cfg("");
        let h = headers(&c, &[("x-data-parallel-rank", "\"}\\\n\u{1}é")]);
        let HeaderStep::Decided(Decision::Reject(r)) = decide_headers(&c, &h, true) else {
            panic!("expected a rejection");
        };
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"]["param"], "x-data-parallel-rank");
    }

    /// The 400's JSON, checked for what every rejection must be: valid JSON, small whatever the
    /// client sent, naming `param`. Returns the message.
    fn bounded_rejection(r: &Rejection, param: &str, label: &str) -> String {
        assert_eq!(r.status, 400, "{label}");
        assert!(
            r.body.len() <= MAX_REJECTION_BYTES,
            "{label}: {} bytes: {}",
            r.body.len(),
            r.body
        );
        let v: serde_json::Value = serde_json::from_str(&r.body)
            .unwrap_or_else(|e| panic!("{label}: not JSON ({e}): {}", r.body));
        assert_eq!(v["error"]["param"], param, "{label}");
        assert_eq!(v["error"]["code"], "invalid_data_parallel_rank", "{label}");
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Whatever a client sends (the README's promise): 32 bytes of quote, escaped again as JSON,
    /// the field name twice and the fixed text.
    const MAX_REJECTION_BYTES: usize = 300;

    #[test]
    fn rejection_quotes_a_bounded_excerpt_of_any_body_value() {
        let c = cfg("");
        let big = 4_000_000;
        let digits = "7".repeat(big);
        let a = "A".repeat(big);
        // (value, what the message says)
        let cases: Vec<(String, String)> = vec![
            (
                digits.clone(),
                format!("got {}... (truncated, {big} bytes)", &digits[..32]),
            ),
            (
                format!("-{digits}.5e-{digits}"),
                format!("(truncated, {} bytes)", 2 * big + 5),
            ),
            (
                format!("\"{a}\""),
                format!(
                    r#"got the string "{}"... (truncated, {big} bytes)"#,
                    &a[..32]
                ),
            ),
            // Escapes: the message shows the unescaped value, re-escaped.
            (
                format!("\"{}\"", r"\n\u0000".repeat(big / 12)),
                format!(r#"got the string "{}"... (truncated"#, r"\n\0".repeat(8)),
            ),
            (
                format!("\"{}\"", "é".repeat(big / 2)),
                format!("\"{}\"... (truncated, {big} bytes)", "é".repeat(16)),
            ),
            ("\"2\"".into(), r#"got the string "2""#.into()),
            ("7".into(), "got 7".into()),
            ("true".into(), "got true".into()),
            (
                format!("[{}1]", "1,".repeat(big / 2)),
                "got an array".into(),
            ),
            (format!(r#"{{"rank":"{a}"}}"#), "got an object".into()),
            (
                format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)),
                "got an array".into(),
            ),
        ];
        for field in ["routed_dp_rank", "data_parallel_rank"] {
            for (value, says) in &cases {
                let label = format!("{field}: {}", value.chars().take(24).collect::<String>());
                let body = format!(r#"{{"model":"m","{field}":{value}}}"#);
                let Decision::Reject(r) = decide_body(&c, body.as_bytes(), None, true) else {
                    panic!("{label}: expected a rejection");
                };
                let message = bounded_rejection(&r, field, &label);
                assert!(message.contains(says), "{label}: {message}");
                assert!(!message.contains(&"7".repeat(33)), "{label}: {message}");
                assert!(!message.contains(&"A".repeat(33)), "{label}: {message}");
            }
        }
    }

    #[test]
    fn rejection_quotes_a_bounded_excerpt_of_a_header() {
        let c = cfg("");
        let high: Vec<u8> = (0x80..=0xff).cycle().take(50_000).collect();
        let cases: [(Vec<u8>, &str); 5] = [
            (vec![b'9'; 50_000], "(truncated, 50000 bytes)"),
            (vec![b'x'; 50_000], r#"got "xxxxxxxx"#),
            (high, "\u{fffd}"),
            (vec![0x7f; 50_000], r"\u{7f}"),
            (b"two".to_vec(), r#"got "two""#),
        ];
        for (value, says) in cases {
            let label = format!("{:?}", &value[..value.len().min(12)]);
            let h = HeaderFacts::collect(&c, [(&b"x-data-parallel-rank"[..], &value[..])]);
            let HeaderStep::Decided(Decision::Reject(r)) = decide_headers(&c, &h, true) else {
                panic!("{label}: expected a rejection");
            };
            let message = bounded_rejection(&r, "x-data-parallel-rank", &label);
            assert!(message.contains(says), "{label}: {message}");
        }
    }

    #[test]
    fn conflicting_explicit_headers_reject() {
        let c = cfg("");
        let h = headers(
            &c,
            &[("x-data-parallel-rank", "1"), ("x-data-parallel-rank", "2")],
        );
        assert!(matches!(
            decide_headers(&c, &h, true),
            HeaderStep::Decided(Decision::Reject(_))
        ));
        let same = headers(
            &c,
            &[("x-data-parallel-rank", "1"), ("x-data-parallel-rank", "1")],
        );
        assert_eq!(
            decide_headers(&c, &same, true),
            HeaderStep::Decided(Decision::Rank(1))
        );
    }

    #[test]
    fn disabled_explicit_rank_is_ignored() {
        let c = cfg(r#","explicit_rank":{"enabled":false}"#);
        let h = headers(&c, &[("x-data-parallel-rank", "2")]);
        assert_eq!(
            decide_headers(&c, &h, true),
            HeaderStep::Decided(Decision::Fallback(Reason::NoKey))
        );
    }

    #[test]
    fn body_is_read_only_when_needed() {
        let c = cfg("");
        let key_hdr = headers(&c, &[JSON, ("x-routing-key", "k")]);
        assert!(matches!(
            decide_headers(&c, &key_hdr, false),
            HeaderStep::Decided(Decision::Key { .. })
        ));
        let json = headers(&c, &[JSON]);
        assert_eq!(decide_headers(&c, &json, false), HeaderStep::ReadBody);
        assert_eq!(
            decide_headers(&c, &json, true),
            HeaderStep::Decided(Decision::Fallback(Reason::NoKey)),
            "no body to read"
        );
        let text = headers(&c, &[("content-type", "text/plain")]);
        assert_eq!(
            decide_headers(&c, &text, false),
            HeaderStep::Decided(Decision::Fallback(Reason::NoKey))
        );
        let big = headers(&c, &[JSON, ("content-length", "8388609")]);
        assert_eq!(
            decide_headers(&c, &big, false),
            HeaderStep::Decided(Decision::Fallback(Reason::BodyTooLarge))
        );
        let no_fields =
            cfg(r#","explicit_rank":{"body_fields":[]},"routing_key":{"body_fields":[]}"#);
        let json = headers(&no_fields, &[JSON]);
        assert_eq!(
            decide_headers(&no_fields, &json, false),
            HeaderStep::Decided(Decision::Fallback(Reason::NoKey))
        );
    }

    #[test]
    fn body_decisions() {
        let c = cfg("");
        assert_eq!(
            decide_body(&c, br#"{"routed_dp_rank":3,"routing_key":"k"}"#, None, true),
            Decision::Rank(3)
        );
        assert!(matches!(
            decide_body(&c, br#"{"routed_dp_rank":4}"#, None, true),
            Decision::Reject(_)
        ));
        assert_eq!(
            decide_body(&c, br#"{"model":"m"}"#, None, true),
            Decision::Fallback(Reason::NoKey)
        );
        assert_eq!(
            decide_body(&c, br#"{"model":"#, None, true),
            Decision::Fallback(Reason::BodyMalformed)
        );
        let header_key = decide_body(&c, br#"{"routing_key":"abc"}"#, None, true);
        assert_eq!(
            header_key,
            Decision::Key {
                hash: c.key.hasher.hash(b"abc"),
                too_long: false
            },
            "body and header keys hash alike"
        );
        let long = format!(r#"{{"user":"{}"}}"#, "x".repeat(600));
        assert!(matches!(
            decide_body(&c, long.as_bytes(), None, true),
            Decision::Key { too_long: true, .. }
        ));
        let small = cfg(r#","body":{"max_bytes":10}"#);
        assert_eq!(
            decide_body(&small, br#"{"routing_key":"abc"}"#, None, true),
            Decision::Fallback(Reason::BodyTooLarge)
        );
        let ignore = cfg(r#","explicit_rank":{"on_invalid":"ignore"}"#);
        assert!(matches!(
            decide_body(
                &ignore,
                br#"{"routed_dp_rank":"x","routing_key":"k"}"#,
                None,
                true
            ),
            Decision::Key { .. }
        ));
    }

    #[test]
    fn room_mode_reads_the_body_even_with_a_key_header() {
        let c = cfg(r#","assign":{"mode":"bootstrap_room"}"#);
        let h = headers(&c, &[JSON, ("x-routing-key", "k")]);
        assert_eq!(decide_headers(&c, &h, false), HeaderStep::ReadBody);
        assert_eq!(
            decide_body(&c, br#"{"bootstrap_room":6}"#, Some(b"k"), true),
            Decision::Room(2)
        );
        let by_header = decide_body(&c, br#"{"routing_key":"body"}"#, Some(b"k"), true);
        assert_eq!(
            by_header,
            Decision::Key {
                hash: c.key.hasher.hash(b"k"),
                too_long: false
            },
            "no room: the header key still beats the body key"
        );
        assert!(matches!(
            decide_body(&c, b"{", Some(b"k"), true),
            Decision::Key { .. }
        ));
        let explicit = headers(&c, &[JSON, ("x-data-parallel-rank", "1")]);
        assert_eq!(
            decide_headers(&c, &explicit, false),
            HeaderStep::Decided(Decision::Rank(1))
        );
    }

    #[test]
    fn untrusted_callers_cannot_choose_a_rank() {
        let c = cfg(r#","explicit_rank":{"trusted_header":"x-router-token","trusted_secret":"s"}"#);
        let untrusted = headers(&c, &[("x-data-parallel-rank", "2"), ("x-routing-key", "k")]);
        assert!(matches!(
            decide_headers(&c, &untrusted, true),
            HeaderStep::Decided(Decision::Key { .. })
        ));
        let bad = headers(&c, &[("x-data-parallel-rank", "9")]);
        assert_eq!(
            decide_headers(&c, &bad, true),
            HeaderStep::Decided(Decision::Fallback(Reason::NoKey)),
            "an untrusted invalid rank is ignored, not rejected"
        );
        let trusted = headers(
            &c,
            &[("x-data-parallel-rank", "2"), ("x-router-token", "s")],
        );
        assert_eq!(
            decide_headers(&c, &trusted, true),
            HeaderStep::Decided(Decision::Rank(2))
        );
        let body = br#"{"routed_dp_rank":1,"routing_key":"k"}"#;
        assert!(matches!(
            decide_body(&c, body, None, false),
            Decision::Key { .. }
        ));
        assert_eq!(decide_body(&c, body, None, true), Decision::Rank(1));
    }

    #[test]
    fn resolve_key_uses_the_table() {
        let c = cfg(r#","table":{"buckets":8,"ways":2}"#);
        let t = AffinityTable::new(c.table.clone());
        let s = MemStore::default();
        let h = c.key.hasher.hash(b"conv-1");
        assert_eq!(resolve_key(&c, &t, &s, h, 100), (None, false));
        t.pin(&s, h, 2, 100);
        assert_eq!(resolve_key(&c, &t, &s, h, 101), (Some(2), false));
        s.raw_set(&t.bucket_key(t.bucket_of(h)), vec![1, 2, 3]);
        assert_eq!(resolve_key(&c, &t, &s, h, 101), (None, true));
    }

    // ---------------------------------------------------------------- prefix placement

    use crate::prefix_index::PrefixIndex;
    use crate::prompt::prompt_chain;
    use crate::ranks::RankLoad;

    const PREFIX_ON: &str = r#","prefix":{"enabled":true,"block_bytes":64}"#;

    const CHAT_PATH: (&str, &str) = (":path", "/v1/chat/completions");

    fn states(loads: &[(u32, u32)]) -> RankStates {
        RankStates {
            ranks: loads
                .iter()
                .map(|&(inflight, down_until)| RankLoad {
                    inflight,
                    down_until,
                    recent: 0,
                })
                .collect(),
        }
    }

    fn matched(blocks: usize, rank: u32) -> Match {
        Match {
            blocks,
            rank: Some(rank),
            ..Match::default()
        }
    }

    fn system_chat(system: &str, user: &str) -> String {
        serde_json::json!({"model":"m","messages":[
            {"role":"system","content":system},{"role":"user","content":user}]})
        .to_string()
    }

    #[test]
    fn prefix_reads_the_body_of_llm_requests_even_with_a_key_header() {
        let on = cfg(PREFIX_ON);
        let keyed = headers(&on, &[JSON, CHAT_PATH, ("x-routing-key", "k")]);
        assert_eq!(decide_headers(&on, &keyed, false), HeaderStep::ReadBody);
        // Not an LLM path, prefix off, no JSON, or no body: the key header decides as before.
        let models = headers(
            &on,
            &[JSON, (":path", "/v1/models"), ("x-routing-key", "k")],
        );
        assert!(matches!(
            decide_headers(&on, &models, false),
            HeaderStep::Decided(Decision::Key { .. })
        ));
        let off = cfg("");
        let keyed_off = headers(&off, &[JSON, CHAT_PATH, ("x-routing-key", "k")]);
        assert!(matches!(
            decide_headers(&off, &keyed_off, false),
            HeaderStep::Decided(Decision::Key { .. })
        ));
        let text = headers(&on, &[("content-type", "text/plain"), CHAT_PATH]);
        assert_eq!(
            decide_headers(&on, &text, false),
            HeaderStep::Decided(Decision::Fallback(Reason::NoKey))
        );
        assert!(matches!(
            decide_headers(&on, &keyed, true),
            HeaderStep::Decided(Decision::Key { .. })
        ));
        // Without any body field configured, the prompt alone is reason to read the body.
        let no_fields = cfg(&format!(
            r#","explicit_rank":{{"body_fields":[]}},"routing_key":{{"body_fields":[]}}{PREFIX_ON}"#
        ));
        let h = headers(&no_fields, &[JSON, (":path", "/generate")]);
        assert_eq!(decide_headers(&no_fields, &h, false), HeaderStep::ReadBody);
        // A declared length over the limit is not read, as before.
        let big = headers(&on, &[JSON, CHAT_PATH, ("content-length", "8388609")]);
        assert_eq!(
            decide_headers(&on, &big, false),
            HeaderStep::Decided(Decision::Fallback(Reason::BodyTooLarge))
        );
        // An explicit rank header still decides at once.
        let explicit = headers(&on, &[JSON, CHAT_PATH, ("x-data-parallel-rank", "3")]);
        assert_eq!(
            decide_headers(&on, &explicit, false),
            HeaderStep::Decided(Decision::Rank(3))
        );
    }

    #[test]
    fn body_decision_and_chain_in_one_pass() {
        let c = cfg(PREFIX_ON);
        let body = system_chat(&"You are a careful assistant. ".repeat(20), "hi");
        let want = prompt_chain(body.as_bytes(), Api::Chat, &c.prefix, &c.prefix_hasher).unwrap();
        assert!(want.len() >= 9, "{}", want.len());
        let (d, chain) = decide_body_with_prefix(&c, body.as_bytes(), None, true, Some(Api::Chat));
        assert_eq!(d, Decision::Fallback(Reason::NoKey));
        assert_eq!(chain, want);
        // A header key: the key decides, the chain rides along for recording.
        let (d, chain) =
            decide_body_with_prefix(&c, body.as_bytes(), Some(b"k"), true, Some(Api::Chat));
        assert!(matches!(d, Decision::Key { .. }));
        assert_eq!(chain, want);
        // No API (not an LLM path) or prefix off: no chain, same decision.
        let (d, chain) = decide_body_with_prefix(&c, body.as_bytes(), None, true, None);
        assert_eq!((d, chain.len()), (Decision::Fallback(Reason::NoKey), 0));
        let off = cfg("");
        let (_, chain) =
            decide_body_with_prefix(&off, body.as_bytes(), None, true, Some(Api::Chat));
        assert!(chain.is_empty());
        // Explicit rank (even with a header key, once the body is read), room, rejection,
        // malformed and oversized bodies: no chain.
        let ranked = body.replacen('{', r#"{"routed_dp_rank":1,"#, 1);
        assert_eq!(
            decide_body_with_prefix(&c, ranked.as_bytes(), Some(b"k"), true, Some(Api::Chat)),
            (Decision::Rank(1), Chain::default())
        );
        let bad = body.replacen('{', r#"{"routed_dp_rank":9,"#, 1);
        let (d, chain) = decide_body_with_prefix(&c, bad.as_bytes(), None, true, Some(Api::Chat));
        assert!(matches!(d, Decision::Reject(_)) && chain.is_empty());
        let cut = &body.as_bytes()[..body.len() - 1];
        assert_eq!(
            decide_body_with_prefix(&c, cut, None, true, Some(Api::Chat)),
            (Decision::Fallback(Reason::BodyMalformed), Chain::default())
        );
        let small = cfg(&format!(r#","body":{{"max_bytes":100}}{PREFIX_ON}"#));
        assert_eq!(
            decide_body_with_prefix(&small, body.as_bytes(), None, true, Some(Api::Chat)),
            (Decision::Fallback(Reason::BodyTooLarge), Chain::default())
        );
        // decide_body is the same decision.
        assert_eq!(
            decide_body(&c, body.as_bytes(), None, true),
            Decision::Fallback(Reason::NoKey)
        );
    }

    #[test]
    fn prefix_choice_rules() {
        let c = cfg(
            r#","assign":{"mode":"hash","min_capacity":1},"prefix":{"min_match_blocks":2,"sticky_blocks":16}"#,
        );
        let idle = states(&[(0, 0); 4]);
        assert_eq!(
            prefix_choice(&c, &Match::default(), Some(&idle), 0),
            PrefixChoice::Miss
        );
        assert_eq!(
            prefix_choice(&c, &matched(1, 2), Some(&idle), 0),
            PrefixChoice::Miss,
            "shorter than min_match_blocks"
        );
        assert_eq!(
            prefix_choice(&c, &matched(2, 7), Some(&idle), 0),
            PrefixChoice::Miss,
            "rank out of range"
        );
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&idle), 0),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
        // Rank 2 holds 3 of 4 in flight: capacity ceil(1.25 × 5 / 4) = 2 → full.
        let busy = states(&[(1, 0), (0, 0), (3, 0), (0, 0)]);
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&busy), 0),
            PrefixChoice::SkippedFull { rank: 2, blocks: 8 }
        );
        // Cooling down counts as full; envoy mode (no states) never is.
        let down = states(&[(0, 0), (0, 0), (0, 50), (0, 0)]);
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&down), 10),
            PrefixChoice::SkippedFull { rank: 2, blocks: 8 }
        );
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&down), 50),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), None, 0),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
        // A match of sticky_blocks (16 here) or more yields only at the pinned bound. With
        // 4 in flight, 2 of them on rank 2: the new-key capacity is ceil(1.25 × 5 / 4) = 2 (full),
        // the pinned one ceil(2.0 × 5 / 4) = 3 (not full).
        let two = states(&[(2, 0), (0, 0), (2, 0), (0, 0)]);
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&two), 0),
            PrefixChoice::SkippedFull { rank: 2, blocks: 8 },
            "a shallow match yields at the new-key bound"
        );
        assert_eq!(
            prefix_choice(&c, &matched(16, 2), Some(&two), 0),
            PrefixChoice::Hit {
                rank: 2,
                blocks: 16
            },
            "a deep match stays until the pinned bound"
        );
        // The default floor (min_capacity 8) keeps a quiet rank usable.
        let floored = cfg(r#","assign":{"mode":"hash"}"#);
        assert_eq!(
            prefix_choice(&floored, &matched(8, 2), Some(&busy), 0),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
    }

    #[test]
    fn a_shared_prefix_yields_to_a_less_loaded_rank() {
        // Floor 8: no rank is full below; only the shared-prefix rule can move the request.
        let c = cfg(r#","assign":{"mode":"hash"},"prefix":{"shared_slack":1}"#);
        let shared = |blocks, rank| Match {
            branched: true,
            ..matched(blocks, rank)
        };
        // Rank 2 has 2 in flight, the least loaded usable rank 0 (rank 3 is down, not counted).
        let st = states(&[(0, 0), (1, 0), (2, 0), (0, 50)]);
        assert_eq!(
            prefix_choice(&c, &shared(8, 2), Some(&st), 10),
            PrefixChoice::Spread { rank: 2, blocks: 8 },
            "2 more in flight than the least loaded rank: over a slack of 1"
        );
        assert_eq!(
            prefix_choice(&c, &shared(40, 1), Some(&st), 10),
            PrefixChoice::Hit {
                rank: 1,
                blocks: 40
            },
            "within the slack, at any depth"
        );
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&st), 10),
            PrefixChoice::Hit { rank: 2, blocks: 8 },
            "a conversation's own history (not branched) is not spread"
        );
        // The default slack 0: only a rank tied with the least loaded keeps a shared prefix.
        let strict = cfg(r#","assign":{"mode":"hash"}"#);
        assert_eq!(
            prefix_choice(&strict, &shared(8, 1), Some(&st), 10),
            PrefixChoice::Spread { rank: 1, blocks: 8 }
        );
        assert_eq!(
            prefix_choice(&strict, &shared(8, 0), Some(&st), 10),
            PrefixChoice::Hit { rank: 0, blocks: 8 }
        );
        // The default sticky_blocks 1: an unbranched match of any depth stays until the pinned
        // bound. Rank 2 with 1 of 2 in flight, floor 1: the new-key capacity ceil(1.25 × 3 / 4)
        // = 1 is reached, the pinned one ceil(2.0 × 3 / 4) = 2 is not.
        let own = cfg(r#","assign":{"mode":"hash","min_capacity":1}"#);
        let one = states(&[(1, 0), (0, 0), (1, 0), (0, 0)]);
        assert_eq!(
            prefix_choice(&own, &matched(2, 2), Some(&one), 0),
            PrefixChoice::Hit { rank: 2, blocks: 2 },
        );
        let shallow =
            cfg(r#","assign":{"mode":"hash","min_capacity":1},"prefix":{"sticky_blocks":16}"#);
        assert_eq!(
            prefix_choice(&shallow, &matched(2, 2), Some(&one), 0),
            PrefixChoice::SkippedFull { rank: 2, blocks: 2 },
        );
        // Ranks known to hold the prefix stand for it: the least loaded of them is taken (rank 0,
        // idle, over the entry's rank 2); an unusable holder (3, down) or one out of range is not.
        let held = Match {
            holders: table::holder_flag(0) | table::holder_flag(3) | table::holder_flag(9),
            ..shared(8, 2)
        };
        assert_eq!(
            prefix_choice(&c, &held, Some(&st), 10),
            PrefixChoice::Hit { rank: 0, blocks: 8 }
        );
        let busy_holder = Match {
            holders: table::holder_flag(1),
            ..shared(8, 2)
        };
        assert_eq!(
            prefix_choice(&c, &busy_holder, Some(&st), 10),
            PrefixChoice::Hit { rank: 1, blocks: 8 },
            "holder 1 (1 in flight) is within the slack of the least loaded rank"
        );
        assert_eq!(
            prefix_choice(&strict, &busy_holder, Some(&st), 10),
            PrefixChoice::Spread { rank: 1, blocks: 8 },
            "with slack 0 even the best holder yields to the idle rank 0"
        );
        // Not branched: holders are not consulted (a conversation's own rank).
        let own_held = Match {
            holders: table::holder_flag(0),
            ..matched(8, 2)
        };
        assert_eq!(
            prefix_choice(&c, &own_held, Some(&st), 10),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
        // Once rank 3 is back and idle it is the least loaded; in envoy mode nothing is counted.
        assert_eq!(
            prefix_choice(&c, &shared(8, 1), Some(&st), 50),
            PrefixChoice::Hit { rank: 1, blocks: 8 }
        );
        assert_eq!(
            prefix_choice(&c, &shared(8, 2), None, 10),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
    }

    #[test]
    fn a_match_is_weighed_against_the_home() {
        // load_blocks 32, home_blocks 8; a generous load bound so that only the weighing decides.
        let c = cfg(
            r#","assign":{"mode":"hash","min_capacity":64},"prefix":{"load_blocks":32,"home_blocks":8}"#,
        );
        let at = |m: &Match, loads: &[u32], home| {
            let st = states(&loads.iter().map(|&n| (n, 0)).collect::<Vec<_>>());
            prefix_choice_at(&c, m, Some(&st), 10, Some(home))
        };
        let shared = |blocks, rank, holders| Match {
            blocks,
            rank: Some(rank),
            branched: true,
            holders,
            ..Match::default()
        };
        let hit = |rank, blocks| PrefixChoice::Hit { rank, blocks };
        let spread = |rank, blocks| PrefixChoice::Spread { rank, blocks };
        // A conversation's own 80-block history (40 KiB) stays over one or two more requests
        // in flight (80 > 32 + 8, 80 > 64 + 8), not over three (80 < 96 + 8).
        assert_eq!(at(&matched(80, 1), &[0, 1, 0, 0], 2), hit(1, 80));
        assert_eq!(at(&matched(80, 1), &[0, 2, 0, 0], 2), hit(1, 80));
        assert_eq!(at(&matched(80, 1), &[0, 3, 0, 0], 2), spread(1, 80));
        // A 4-block (2 KiB) shared system prompt never outweighs going home on an idle
        // cluster: new conversations spread by their home instead of piling onto its holder.
        assert_eq!(at(&shared(4, 1, 0), &[0, 0, 0, 0], 2), spread(1, 4));
        // Not even when the holder is idler than the home: a replica with another view of the
        // loads would send the conversation elsewhere.
        assert_eq!(at(&shared(4, 1, 0), &[0, 0, 3, 0], 2), spread(1, 4));
        // A 160-block shared document stays with its holder over 4 more requests, not 5.
        assert_eq!(at(&shared(160, 1, 0), &[0, 4, 0, 0], 2), hit(1, 160));
        assert_eq!(at(&shared(160, 1, 0), &[0, 5, 0, 0], 2), spread(1, 160));
        // The home holds the shared prefix too: nothing is saved elsewhere.
        let home_holds = shared(160, 1, table::holder_flag(2));
        assert_eq!(at(&home_holds, &[0, 0, 0, 0], 2), spread(1, 160));
        // The match is at home: a hit whatever the load.
        assert_eq!(at(&matched(4, 2), &[0, 0, 9, 0], 2), hit(2, 4));
        // Only a rendezvous home (hash mode) earns the bonus: with least_inflight, the least
        // loaded rank of the moment, a 4-block match on an idle cluster stays.
        let li = cfg(r#","assign":{"mode":"least_inflight","min_capacity":64}"#);
        assert_eq!(
            prefix_choice_at(
                &li,
                &shared(4, 1, 0),
                Some(&states(&[(0, 0); 4])),
                10,
                Some(2)
            ),
            hit(1, 4)
        );
        // The weights are knobs: home_blocks 0 and a 4-block prefix on an idle cluster stays.
        let c0 = cfg(r#","assign":{"mode":"hash","min_capacity":64},"prefix":{"home_blocks":0}"#);
        // The defaults (8, 8): an 80-block history stays over 8 more requests in flight.
        let d = cfg(r#","assign":{"mode":"hash","min_capacity":64}"#);
        let eight_more = states(&[(0, 0), (8, 0), (0, 0), (0, 0)]);
        assert_eq!(
            prefix_choice_at(&d, &matched(80, 1), Some(&eight_more), 10, Some(2)),
            hit(1, 80)
        );
        let idle = states(&[(0, 0); 4]);
        assert_eq!(
            prefix_choice_at(&c0, &shared(4, 1, 0), Some(&idle), 10, Some(2)),
            hit(1, 4)
        );
    }

    #[test]
    fn placement_order_pin_then_prefix_then_assigner() {
        let c = cfg(r#","assign":{"mode":"hash","min_capacity":1}"#);
        let idle = states(&[(0, 0); 4]);
        let m = matched(16, 3);
        let never = || -> Option<u32> { panic!("the assigner must not run") };
        // A kept pin wins; the prefix is not even consulted.
        assert_eq!(
            place(&c, 0, Some(1), Some(&m), Some(&idle), never),
            Placement {
                placed: Placed::Pin(1),
                prefix: None
            }
        );
        // No pin: the prefix (16 blocks outweigh the home's bonus on an idle cluster).
        assert_eq!(
            place(&c, 0, None, Some(&m), Some(&idle), || Some(0)),
            Placement {
                placed: Placed::Prefix {
                    rank: 3,
                    blocks: 16
                },
                prefix: Some(PrefixChoice::Hit {
                    rank: 3,
                    blocks: 16
                })
            }
        );
        // A pin over the pinned bound (rank 1: 9 of 9 in flight) moves to the prefix's rank.
        let pin_busy = states(&[(0, 0), (9, 0), (0, 0), (0, 0)]);
        assert_eq!(
            place(&c, 0, Some(1), Some(&m), Some(&pin_busy), || Some(0)).placed,
            Placed::Prefix {
                rank: 3,
                blocks: 16
            }
        );
        // The prefix's rank full: the assigner decides, and the skip is reported.
        let prefix_busy = states(&[(0, 0), (0, 0), (0, 0), (5, 0)]);
        assert_eq!(
            place(&c, 0, None, Some(&m), Some(&prefix_busy), || Some(0)),
            Placement {
                placed: Placed::Assigned(Some(0)),
                prefix: Some(PrefixChoice::SkippedFull {
                    rank: 3,
                    blocks: 16
                })
            }
        );
        // No match, or no chain at all (not consulted).
        assert_eq!(
            place(&c, 0, None, Some(&Match::default()), Some(&idle), || Some(
                2
            )),
            Placement {
                placed: Placed::Assigned(Some(2)),
                prefix: Some(PrefixChoice::Miss)
            }
        );
        assert_eq!(
            place(&c, 0, None, None, Some(&idle), || None),
            Placement {
                placed: Placed::Assigned(None),
                prefix: None
            }
        );
        // Envoy mode: no states, a pin always holds, a match always routes.
        let envoy = cfg("");
        assert_eq!(
            place(&envoy, 0, Some(0), Some(&m), None, never).placed,
            Placed::Pin(0)
        );
        assert_eq!(
            place(&envoy, 0, None, Some(&m), None, never).placed,
            Placed::Prefix {
                rank: 3,
                blocks: 16
            }
        );
    }

    #[test]
    fn keyless_requests_sharing_a_system_prompt_follow_the_first() {
        let c = cfg(PREFIX_ON);
        let (s, idx) = (MemStore::default(), PrefixIndex::new(&c.prefix));
        idx.table().ensure_buckets(&s);
        let system = "You are the support bot of a large company. Be brief. ".repeat(100);
        let chain_of = |user: &str| {
            let body = system_chat(&system, user);
            let (d, chain) =
                decide_body_with_prefix(&c, body.as_bytes(), None, true, Some(Api::Chat));
            assert_eq!(d, Decision::Fallback(Reason::NoKey));
            chain
        };
        // First request: nothing indexed; Envoy (or the assigner) places it on rank 2, then it
        // is recorded under rank 2.
        let first = chain_of("How do I reset my password?");
        let m = idx.longest_match(&s, first.hashes(), 100, c.dp_size);
        let p = place(&c, 100, None, Some(&m), None, || None);
        assert_eq!(p.prefix, Some(PrefixChoice::Miss));
        idx.record(&s, first.hashes(), 2, 100, &m);
        // Another user message after the same system prompt: the prefix sends it to rank 2.
        let second = chain_of("Where is my invoice?");
        let m = idx.longest_match(&s, second.hashes(), 101, c.dp_size);
        assert!(m.blocks * 64 >= system.len() * 2 / 3, "{} blocks", m.blocks);
        let p = place(&c, 101, None, Some(&m), None, || None);
        assert!(matches!(p.placed, Placed::Prefix { rank: 2, .. }), "{p:?}");
        // An unrelated prompt shares nothing.
        let body = system_chat(&"Translate to French. ".repeat(200), "Hello");
        let (_, other) = decide_body_with_prefix(&c, body.as_bytes(), None, true, Some(Api::Chat));
        let m = idx.longest_match(&s, other.hashes(), 101, c.dp_size);
        assert_eq!(m.rank, None);
    }
}
