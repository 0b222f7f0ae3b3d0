//! The decision order, as values: explicit rank, then the routing key's pin, then the prompt
//! prefix (when `prefix.enabled`), then the assigner or Envoy's balancing.
//!
//! The host layer feeds facts in and turns the returned `Decision` / [`Placement`](crate::placement::Placement) into header
//! changes and local replies; nothing here performs an action.

use crate::assign::{room_rank, Mode};
use crate::chain::Chain;
use crate::config::{Config, OnInvalid};
use crate::extract::{rank_from_header, scan_body_and_prompt, HeaderFacts, RankError, Room};
use crate::prompt::Api;
use crate::table::{AffinityTable, Lookup, Store};
use crate::target::engine_parses_as_json;

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
    /// A routing key: look it up in the table (see [`resolve_key`]). `unread_body`: the body
    /// was wanted and could not be used (too large, malformed), counted as for a keyless
    /// request while the key routes it.
    Key {
        hash: u64,
        too_long: bool,
        unread_body: Option<Reason>,
    },
    /// Let Envoy balance; nothing to learn.
    Fallback(Reason),
    /// A `bootstrap_room` that names no one rank (a batch's list of rooms, a string): set no
    /// rank, so the engine places each item by its own room (Envoy balances in `cluster` mode).
    Unplaced,
    /// Answer the client directly.
    Reject(Rejection),
}

/// Decision after the headers, or a request to read the body first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderStep {
    Decided(Decision),
    ReadBody,
}

/// Whether the caller's explicit-rank header is invalid and `on_invalid: "ignore"` treats it as
/// absent: the host then removes it, so nothing behind the filter (an engine that honours the
/// same header) acts on a rank the filter ignored.
pub fn explicit_header_ignored(cfg: &Config, h: &HeaderFacts<'_>) -> bool {
    cfg.explicit.enabled
        && h.trusted
        && cfg.explicit.on_invalid == OnInvalid::Ignore
        && h.explicit
            .is_some_and(|value| h.explicit_conflict || rank_from_header(cfg, value).is_err())
}

/// Decides from the headers alone when possible.
///
/// A routing-key header settles the request here, unless the body is needed anyway: in
/// `bootstrap_room` mode (the room outranks a key) and when prefix placement reads this request's
/// prompt (`HeaderFacts::prefix_api`: the prefix is recorded under the key's rank, and decides
/// when the key is not pinned), and where one engine behind reads a body rank the filter would
/// otherwise replace unread ([`engine_reads_body_rank`]). Otherwise requests carrying a key header
/// are never buffered, so a body rank field is not consulted for them (send the rank as a header
/// in that case).
pub fn decide_headers(cfg: &Config, h: &HeaderFacts<'_>, end_of_stream: bool) -> HeaderStep {
    if cfg.explicit.enabled && h.trusted {
        if let Some(value) = h.explicit {
            let parsed = if h.explicit_conflict {
                Err(RankError {
                    field: cfg.explicit.header.clone(),
                    problem: "was sent several times with different values".into(),
                    conflict: true,
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
    let body_rank = engine_reads_body_rank(cfg, h);
    if let Some((_, key)) = h.key.filter(|_| !room_mode && !prefix && !body_rank) {
        return HeaderStep::Decided(key_decision(cfg, key, None));
    }
    let header_key = || match h.key {
        Some((_, key)) => key_decision(cfg, key, None),
        None => Decision::Fallback(Reason::NoKey),
    };
    let wants_body = prefix || !cfg.body.wanted_fields.is_empty();
    if end_of_stream || !wants_body || !(h.is_json(cfg) || body_rank) {
        return HeaderStep::Decided(header_key());
    }
    if h.declared_length()
        .is_some_and(|n| n > cfg.body.max_bytes as u64)
    {
        let key = h.key.map(|(_, key)| key);
        return HeaderStep::Decided(without_body(cfg, Reason::BodyTooLarge, key));
    }
    HeaderStep::ReadBody
}

/// Whether the engine behind (`target.mode: engine`) would act on a rank field in this request's
/// body that the filter, left to its own reading, would not look at: the filter is about to set
/// the rank for the engine (a header it prefers, or the body field itself), so a rank the caller
/// may choose must be read first or the filter would silently replace it. That is the case when
/// the engine reads body ranks on this path and parses the body as JSON where `body.content_types`
/// does not name it (no content type, `application/*+json`), and when a key header would
/// otherwise settle the request before the body.
fn engine_reads_body_rank(cfg: &Config, h: &HeaderFacts<'_>) -> bool {
    let Some(engine) = cfg.target.engine() else {
        return false; // the usual case, decided without looking further
    };
    cfg.explicit.enabled
        && h.trusted
        && !cfg.explicit.body_fields.is_empty()
        && h.engine_path
            .and_then(|index| engine.paths.get(index))
            .is_some_and(|target| !target.body_fields.is_empty())
        && engine_parses_as_json(h.content_type)
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
    match facts.room {
        Some(Room::One(room)) => {
            return (
                Decision::Room(room_rank(room, cfg.dp_size)),
                Chain::default(),
            )
        }
        Some(Room::Unusable) => return (Decision::Unplaced, Chain::default()),
        None => {}
    }
    let decision = match header_key.or(facts.key.as_deref()) {
        Some(key) => key_decision(cfg, key, None),
        None => Decision::Fallback(Reason::NoKey),
    };
    (decision, chain)
}

/// The decision when the body cannot be used (`reason`): a header key if there was one (still
/// noting why the body was not read, unless there was none to read: [`Reason::NoKey`]).
pub fn without_body(cfg: &Config, reason: Reason, header_key: Option<&[u8]>) -> Decision {
    match header_key {
        Some(key) => key_decision(cfg, key, Some(reason).filter(|&r| r != Reason::NoKey)),
        None => Decision::Fallback(reason),
    }
}

fn key_decision(cfg: &Config, key: &[u8], unread_body: Option<Reason>) -> Decision {
    Decision::Key {
        hash: cfg.key.hasher.hash(key),
        too_long: key.len() > cfg.key.max_bytes,
        unread_body,
    }
}

/// A routing key resolved against the affinity table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    /// The rank the key is pinned to, if any.
    pub pinned: Option<u32>,
    /// The conversation tag stored with the pin (0: none; see `placement::conversation_tag`).
    pub tag: u8,
    /// The prefix depth that tag was taken at (the pin entry's flags field).
    pub depth: u16,
    /// The bucket failed to decode (read as empty; worth a counter).
    pub undecodable: bool,
}

/// Resolves a routing key against the affinity table.
pub fn resolve_key(
    cfg: &Config,
    table: &AffinityTable,
    store: &dyn Store,
    hash: u64,
    now: u32,
) -> Resolved {
    let (lookup, depth, tag) = table.lookup_flagged(store, hash, now, cfg.dp_size);
    let (pinned, undecodable) = match lookup {
        Lookup::Hit { rank } => (Some(rank), false),
        Lookup::Miss => (None, false),
        Lookup::Undecodable => (None, true),
    };
    Resolved {
        pinned,
        tag,
        depth,
        undecodable,
    }
}

/// Builds the 400 answer for an invalid explicit rank, in OpenAI's error shape. Its size does not
/// depend on the request: a `RankError` quotes at most `extract::QUOTE_MAX_BYTES` of the value
/// (a few hundred bytes in all), so a megabyte rank field cannot be echoed or copied here.
pub fn reject(cfg: &Config, e: &RankError) -> Rejection {
    // Copies that disagree may each be valid: say so, not what a valid rank is.
    let message = if e.conflict {
        format!(
            "{} {}: send one rank, an integer in 0..={} (dp_size {})",
            e.field,
            e.problem,
            cfg.dp_size - 1,
            cfg.dp_size
        )
    } else {
        format!(
            "{} must be an integer in 0..={} (dp_size {}); {}",
            e.field,
            cfg.dp_size - 1,
            cfg.dp_size,
            e.problem
        )
    };
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
        // Ignored, so removed before the request goes on; a valid one, or any in reject mode,
        // is not (it is used, or the request is answered 400).
        assert!(explicit_header_ignored(&c, &h));
        assert!(explicit_header_ignored(
            &c,
            &headers(
                &c,
                &[("x-data-parallel-rank", "1"), ("x-data-parallel-rank", "2")]
            )
        ));
        assert!(!explicit_header_ignored(
            &c,
            &headers(&c, &[("x-data-parallel-rank", "2")])
        ));
        assert!(!explicit_header_ignored(&c, &headers(&c, &[JSON])));
        assert!(!explicit_header_ignored(
            &cfg(""),
            &headers(&cfg(""), &[("x-data-parallel-rank", "7")])
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
        let HeaderStep::Decided(Decision::Reject(r)) = decide_headers(&c, &h, true) else {
            panic!("two different rank headers were not rejected");
        };
        assert!(
            r.body.contains(
                r#""message":"x-data-parallel-rank was sent several times with different values: send one rank, an integer in 0..=3 (dp_size 4)""#
            ),
            "{}",
            r.body
        );
        // Two body fields that disagree: each is a valid rank, and the message says what clashes.
        let decision = decide_body(
            &c,
            br#"{"routed_dp_rank":2,"data_parallel_rank":1}"#,
            None,
            true,
        );
        let Decision::Reject(r) = decision else {
            panic!("disagreeing body fields were not rejected: {decision:?}");
        };
        assert!(
            r.body.contains(
                r#""message":"data_parallel_rank (1) disagrees with routed_dp_rank (2): send one rank"#
            ),
            "{}",
            r.body
        );
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
        // A key header routes it, noting the body it could not read (room mode reads the
        // body even with a key).
        let room = cfg(r#","assign":{"mode":"bootstrap_room"}"#);
        let big_keyed = headers(
            &room,
            &[JSON, ("content-length", "8388609"), ("x-routing-key", "k")],
        );
        assert!(matches!(
            decide_headers(&room, &big_keyed, false),
            HeaderStep::Decided(Decision::Key {
                unread_body: Some(Reason::BodyTooLarge),
                ..
            })
        ));
        let no_fields =
            cfg(r#","explicit_rank":{"body_fields":[]},"routing_key":{"body_fields":[]}"#);
        let json = headers(&no_fields, &[JSON]);
        assert_eq!(
            decide_headers(&no_fields, &json, false),
            HeaderStep::Decided(Decision::Fallback(Reason::NoKey))
        );
    }

    #[test]
    fn an_engine_that_reads_body_ranks_gets_the_body_read_first() {
        // One SGLang process behind: the filter writes the rank into `/generate`'s body (and
        // sets the header, which wins, on chat). A body the engine parses as JSON must be read
        // first, or a rank the caller may choose would be replaced unread.
        let sglang =
            cfg(r#","prefix":{"enabled":false},"target":{"mode":"engine","engine":"sglang"}"#);
        let vllm = cfg(r#","prefix":{"enabled":false},"target":{"mode":"engine","engine":"vllm"}"#);
        let cluster = cfg(r#","prefix":{"enabled":false}"#);
        let trusted_only = cfg(
            r#","prefix":{"enabled":false},"target":{"mode":"engine","engine":"sglang"},
               "explicit_rank":{"trusted_header":"x-t","trusted_secret":"s"}"#,
        );
        let generate = (":path", "/generate");
        let chat = (":path", "/v1/chat/completions");
        let key = ("x-routing-key", "k");
        let plus_json = ("content-type", "application/vnd.api+json");
        type Headers<'a> = Vec<(&'a str, &'a str)>;
        // (config, headers, the body is read)
        let cases: [(&Config, Headers, bool); 10] = [
            (&sglang, vec![generate], true),
            (&sglang, vec![chat], true),
            (&sglang, vec![generate, plus_json], true),
            (&sglang, vec![generate, JSON, key], true),
            (
                &sglang,
                vec![generate, ("content-type", "text/plain")],
                false,
            ),
            (&sglang, vec![(":path", "/health")], false),
            (&vllm, vec![generate], false),
            (&vllm, vec![chat, key, JSON], false),
            (&cluster, vec![generate], false),
            (&trusted_only, vec![generate], false),
        ];
        for (i, (c, h, read)) in cases.into_iter().enumerate() {
            let step = decide_headers(c, &headers(c, &h), false);
            assert_eq!(
                step == HeaderStep::ReadBody,
                read,
                "case {i}: {h:?} gave {step:?}"
            );
        }
        let with_secret = [generate, ("x-t", "s")];
        let trusted = headers(&trusted_only, &with_secret);
        assert_eq!(
            decide_headers(&trusted_only, &trusted, false),
            HeaderStep::ReadBody
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
                too_long: false,
                unread_body: None
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
        // With a key header the key routes a body that cannot be read, which is still noted
        // (and counted like a keyless one's).
        let keyed = |body: &[u8]| match decide_body(&small, body, Some(b"k"), true) {
            Decision::Key { unread_body, .. } => unread_body,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            keyed(br#"{"routing_key":"abc"}"#),
            Some(Reason::BodyTooLarge)
        );
        assert_eq!(keyed(br#"{"#), Some(Reason::BodyMalformed));
        assert_eq!(keyed(br#"{}"#), None);
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
        // A batch's rooms name a rank each: one rank for all would send some items' KV cache
        // where their decode side does not look. The engine places them.
        for unplaced in [
            &br#"{"text":["a","b"],"bootstrap_room":[5,6]}"#[..],
            br#"{"bootstrap_room":"5"}"#,
        ] {
            assert_eq!(
                decide_body(&c, unplaced, Some(b"k"), true),
                Decision::Unplaced
            );
        }
        assert_eq!(
            decide_body(
                &c,
                br#"{"bootstrap_room":[5,6],"routed_dp_rank":1}"#,
                None,
                true
            ),
            Decision::Rank(1),
            "an explicit rank still decides"
        );
        let by_header = decide_body(&c, br#"{"routing_key":"body"}"#, Some(b"k"), true);
        assert_eq!(
            by_header,
            Decision::Key {
                hash: c.key.hasher.hash(b"k"),
                too_long: false,
                unread_body: None
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
        let resolved = |pinned, tag, depth, undecodable| Resolved {
            pinned,
            tag,
            depth,
            undecodable,
        };
        assert_eq!(resolve_key(&c, &t, &s, h, 100), resolved(None, 0, 0, false));
        t.pin(&s, h, 2, 100);
        assert_eq!(
            resolve_key(&c, &t, &s, h, 101),
            resolved(Some(2), 0, 0, false)
        );
        t.pin_flagged(&s, h, 3, 7, 300, 102);
        assert_eq!(
            resolve_key(&c, &t, &s, h, 103),
            resolved(Some(3), 7, 300, false)
        );
        t.pin_flagged(&s, h, 1, 0, 0, 104);
        assert_eq!(
            resolve_key(&c, &t, &s, h, 105),
            resolved(Some(1), 0, 0, false)
        );
        s.raw_set(&t.bucket_key(t.bucket_of(h)), vec![1, 2, 3]);
        assert_eq!(resolve_key(&c, &t, &s, h, 105), resolved(None, 0, 0, true));
    }

    // ---------------------------------------------------------------- prefix placement

    use crate::prompt::prompt_chain;

    const PREFIX_ON: &str = r#","prefix":{"enabled":true,"block_bytes":64}"#;

    const CHAT_PATH: (&str, &str) = (":path", "/v1/chat/completions");

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
        let off = cfg(r#","prefix":{"enabled":false}"#);
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
        let off = cfg(r#","prefix":{"enabled":false}"#);
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
}
