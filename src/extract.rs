//! Pulling the routing inputs out of a request: the explicit rank and the routing key, from
//! headers (one pass over the header list) and from the JSON body (one pass of the scanner).
//!
//! Nothing here touches the host: headers arrive as `(name, value)` byte pairs, the body as bytes.

use std::borrow::Cow;

use crate::chain::Chain;
use crate::config::Config;
use crate::failure::{classify, grpc_as_http, Answer};
use crate::json_scan::{scan_top_level, ScanError, Value};
use crate::prompt::{scan_prompt, Api};

/// Where an explicit rank came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankError {
    /// The header or body field at fault.
    pub field: String,
    /// What was wrong, in words a client developer understands.
    pub problem: String,
    /// The value is a valid rank, but another copy of it disagrees: `problem` says with what.
    pub conflict: bool,
}

/// The request headers the filter cares about, collected in one pass.
#[derive(Debug, Default)]
pub struct HeaderFacts<'a> {
    /// First value of the explicit-rank header, and whether a later copy disagreed.
    pub explicit: Option<&'a [u8]>,
    pub explicit_conflict: bool,
    /// The routing key from the highest-priority key header present (non-empty): (priority, value).
    pub key: Option<(usize, &'a [u8])>,
    pub content_type: Option<&'a [u8]>,
    pub content_length: Option<&'a [u8]>,
    /// `:path` (for the prompt's API when prefix placement is on).
    pub path: Option<&'a [u8]>,
    /// A client sent the internal cluster header (always stripped).
    pub has_cluster_header: bool,
    /// The caller may use the explicit-rank override: no trust is configured, or every copy of
    /// the trust header carries the secret.
    pub trusted: bool,
    /// The trust header is present (stripped before the upstream: the engine never sees it).
    pub has_trust_header: bool,
    /// One engine behind (`target.mode: engine`): the index of the entry for this `:path` in its
    /// paths (`EngineTarget::index_for`); `None` when no entry covers it, or in other modes.
    pub engine_path: Option<usize>,
}

impl<'a> HeaderFacts<'a> {
    /// Collects the facts from the request headers. Header names from Envoy are lower-case already;
    /// comparing case-insensitively costs nothing and keeps other hosts honest.
    pub fn collect(cfg: &Config, headers: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Self {
        let mut f = HeaderFacts::default();
        let trust = cfg.explicit.trust.as_ref();
        let mut secret_ok = trust.is_none();
        for (name, value) in headers {
            if trust.is_some_and(|t| name.eq_ignore_ascii_case(t.header.as_bytes())) {
                let first = !f.has_trust_header;
                f.has_trust_header = true;
                let matches = trust.is_some_and(|t| constant_time_eq(value, &t.secret));
                secret_ok = matches && (first || secret_ok);
            } else if name.eq_ignore_ascii_case(cfg.explicit.header.as_bytes()) {
                match f.explicit {
                    None => f.explicit = Some(value),
                    Some(first) if first != value => f.explicit_conflict = true,
                    Some(_) => {}
                }
            } else if name.eq_ignore_ascii_case(cfg.cluster_header.as_bytes()) {
                f.has_cluster_header = true;
            } else if name.eq_ignore_ascii_case(b"content-type") {
                f.content_type = Some(value);
            } else if name.eq_ignore_ascii_case(b"content-length") {
                f.content_length = Some(value);
            } else if name == b":path" {
                f.path = Some(value);
            } else if let Some(prio) = cfg
                .key
                .headers
                .iter()
                .position(|h| name.eq_ignore_ascii_case(h.as_bytes()))
            {
                let better = f.key.is_none_or(|(p, _)| prio < p);
                if better && !trim_ows(value).is_empty() {
                    f.key = Some((prio, trim_ows(value)));
                }
            }
        }
        f.trusted = secret_ok;
        f.engine_path = cfg
            .target
            .engine()
            .zip(f.path)
            .and_then(|(engine, path)| engine.index_for(path));
        f
    }

    /// Whether the body is JSON by the configured content types.
    pub fn is_json(&self, cfg: &Config) -> bool {
        let Some(ct) = self.content_type else {
            return false;
        };
        let media = ct.split(|&c| c == b';').next().unwrap_or(ct);
        let media = trim_ows(media);
        cfg.body
            .content_types
            .iter()
            .any(|t| media.eq_ignore_ascii_case(t.as_bytes()))
    }

    /// The declared body length, when present and a plain number.
    pub fn declared_length(&self) -> Option<u64> {
        parse_u64(trim_ows(self.content_length?))
    }

    /// The API whose prompt prefix placement reads: `None` when `prefix.enabled` is off or the
    /// path is not an LLM endpoint the filter knows (`Api::from_path`).
    pub fn prefix_api(&self, cfg: &Config) -> Option<Api> {
        if !cfg.prefix.enabled {
            return None;
        }
        Api::from_path(self.path?)
    }
}

/// The response headers the filter cares about, collected in one pass.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ResponseFacts {
    /// `:status`, 0 when absent or unreadable; for a `2xx` carrying a `grpc-status` in its
    /// headers (a gRPC answer with no message: how gRPC errors, the rank's and Envoy's own, come
    /// back), the status that gRPC status stands for ([`grpc_as_http`]), so a failure is judged
    /// as one.
    pub status: u64,
    /// The rank the upstream reported in `learn.response_header` (valid and in range).
    pub reported_rank: Option<u32>,
    /// The upstream's rank header is also the echo header and holds exactly that one valid value:
    /// the echo is already in place and need not be written again.
    pub echo_in_place: bool,
}

impl ResponseFacts {
    pub fn collect<'a>(
        cfg: &Config,
        headers: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
    ) -> Self {
        let mut f = ResponseFacts::default();
        let learn = cfg.learn.response_header.as_deref().map(str::as_bytes);
        let mut copies = 0;
        let mut grpc_status = None;
        for (name, value) in headers {
            // Envoy's header names are lower case.
            if name == b":status" {
                f.status = header_number(value).unwrap_or(0);
            } else if name == b"grpc-status" {
                grpc_status = Some(value);
            } else if learn.is_some_and(|h| name.eq_ignore_ascii_case(h)) {
                copies += 1;
                f.reported_rank = header_number(value)
                    .filter(|&n| n < u64::from(cfg.dp_size))
                    .map(|n| n as u32);
            }
        }
        if copies != 1 {
            f.reported_rank = None; // duplicated: ambiguous, so not trusted
        }
        if let (200..=299, Some(code)) = (f.status, grpc_status) {
            // Unreadable: gRPC's UNKNOWN.
            f.status = grpc_as_http(header_number(code).unwrap_or(2));
        }
        f.echo_in_place = f.reported_rank.is_some()
            && cfg.echo_header.as_deref() == cfg.learn.response_header.as_deref();
        f
    }

    /// A 2xx: the rank served the request (see `failure::classify`).
    pub fn served(&self) -> bool {
        classify(self.status, None) == Answer::Served
    }
}

/// Compares without an early exit, so response timing does not reveal how much of a guessed
/// secret was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Trims HTTP optional whitespace (space and tab) from both ends.
pub fn trim_ows(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|&c| c != b' ' && c != b'\t')
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|&c| c != b' ' && c != b'\t')
        .map_or(start, |e| e + 1);
    &v[start..end]
}

/// A header value's number (optional whitespace around ASCII digits). Not inlined: one copy
/// for the response headers' three numbers.
#[inline(never)]
fn header_number(value: &[u8]) -> Option<u64> {
    parse_u64(trim_ows(value))
}

/// Parses ASCII digits into a u64; `None` on anything else or on overflow.
pub fn parse_u64(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    let mut n: u64 = 0;
    for &c in digits {
        if !c.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
    }
    Some(n)
}

/// Parses an explicit rank from a header value.
pub fn rank_from_header(cfg: &Config, value: &[u8]) -> Result<u32, RankError> {
    let v = trim_ows(value);
    match parse_u64(v) {
        Some(n) if n < u64::from(cfg.dp_size) => Ok(n as u32),
        _ => Err(RankError {
            field: cfg.explicit.header.clone(),
            problem: format!("got {}", excerpt(v, true)),
            conflict: false,
        }),
    }
}

/// Parses an explicit rank from a JSON body value. `Ok(None)` means "absent" (JSON null).
pub fn rank_from_json(cfg: &Config, field: &str, v: &Value<'_>) -> Result<Option<u32>, RankError> {
    let bad = |problem: String| RankError {
        field: field.to_string(),
        problem,
        conflict: false,
    };
    match v {
        Value::Null => Ok(None),
        // `-0` is JSON's other spelling of 0 (Python reads the int 0, and the engine serves it).
        Value::Number(raw) => match parse_u64(if *raw == b"-0" { b"0" } else { raw }) {
            Some(n) if n < u64::from(cfg.dp_size) => Ok(Some(n as u32)),
            _ => Err(bad(format!("got {}", excerpt(raw, false)))),
        },
        Value::Str(s) => Err(bad(format!("got the string {}", excerpt(s, true)))),
        Value::Bool(b) => Err(bad(format!("got {b}"))),
        // Containers are named by type only: their text is not kept by the scanner, and a
        // nested value says nothing a client developer needs beyond "not an integer".
        Value::Object => Err(bad("got an object".into())),
        Value::Array => Err(bad("got an array".into())),
    }
}

/// How many bytes of a client's value an error message quotes (after escaping): enough to
/// recognise the value, never an echo of the megabytes a client may send (the answer, and every
/// copy made to build it, stays small whatever the request holds).
pub const QUOTE_MAX_BYTES: usize = 32;

/// The start of a client-supplied value for an error message, at most [`QUOTE_MAX_BYTES`] bytes
/// once escaped, whole characters only. Bytes that are not UTF-8 show as U+FFFD. `quoted`: in
/// double quotes with Rust's escapes (strings, header values), so control characters stay
/// visible; otherwise as is (the text of a JSON number, ASCII by grammar). A value not shown
/// whole is marked `... (truncated, N bytes)` with its full length.
fn excerpt(v: &[u8], quoted: bool) -> String {
    // Every shown input byte costs at least one output byte (U+FFFD is 3 bytes for 1-3 invalid
    // ones), so nothing past this window can be shown: the rest of the value is never touched.
    let window = &v[..v.len().min(QUOTE_MAX_BYTES + 4)];
    let mut shown = String::new();
    let mut used = 0;
    'chunks: for chunk in window.utf8_chunks() {
        for c in chunk.valid().chars() {
            if !push_bounded(&mut shown, c, quoted) {
                break 'chunks;
            }
            used += c.len_utf8();
        }
        if !chunk.invalid().is_empty() {
            if !push_bounded(&mut shown, char::REPLACEMENT_CHARACTER, quoted) {
                break;
            }
            used += chunk.invalid().len();
        }
    }
    let mut out = if quoted {
        format!("\"{shown}\"")
    } else {
        shown
    };
    if used < v.len() {
        out.push_str(&format!("... (truncated, {} bytes)", v.len()));
    }
    out
}

/// Appends `c` (escaped when `quoted`) unless that would pass [`QUOTE_MAX_BYTES`].
fn push_bounded(out: &mut String, c: char, quoted: bool) -> bool {
    let before = out.len();
    if quoted {
        out.extend(c.escape_debug());
    } else {
        out.push(c);
    }
    if out.len() > QUOTE_MAX_BYTES {
        out.truncate(before);
        return false;
    }
    true
}

/// What the body told us.
#[derive(Debug, Default, PartialEq)]
pub struct BodyFacts<'a> {
    /// The explicit rank from the body, if any valid one (or the error to report).
    pub rank: Option<Result<u32, RankError>>,
    /// The routing key from the highest-priority key field holding a non-empty string.
    pub key: Option<Cow<'a, [u8]>>,
    /// SGLang's `bootstrap_room` (only looked for in `bootstrap_room` mode; `null` is none).
    pub room: Option<Room>,
}

/// A `bootstrap_room` the body carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// One JSON integer >= 0: the request's rank is `room % dp_size`.
    One(u64),
    /// Anything else: a batch's list of rooms (one rank each, which one rank for the whole
    /// request would break), or a number or string the engine may coerce. Only the engine can
    /// place it as its decode side expects.
    Unusable,
}

/// Scans a JSON body for the configured explicit-rank and routing-key fields.
///
/// Within one field the last occurrence wins, for ranks, keys and the room alike: the engines
/// parse bodies into a Python `dict`, which keeps the last duplicate, so that is the value the
/// engine acts on (an earlier invalid rank overwritten by a valid one is no error, as the engine
/// never sees it). Rank fields: values that disagree between fields (`routed_dp_rank` against
/// `data_parallel_rank`) are an error, because guessing would route somewhere the client did not
/// ask for. Key fields: list order decides between fields.
pub fn scan_body<'a>(cfg: &Config, body: &'a [u8]) -> Result<BodyFacts<'a>, ScanError> {
    scan_body_and_prompt(cfg, body, None).map(|(facts, _)| facts)
}

/// [`scan_body`], plus the prompt's chain of block hashes when `api` is given (see
/// [`HeaderFacts::prefix_api`]): both come out of ONE pass over the body
/// ([`scan_prompt`] reports the wanted fields exactly as the top-level scanner does). Without
/// `api` the chain is empty and the plain top-level scanner runs.
pub fn scan_body_and_prompt<'a>(
    cfg: &Config,
    body: &'a [u8],
    api: Option<Api>,
) -> Result<(BodyFacts<'a>, Chain), ScanError> {
    let wanted: Vec<&str> = cfg.body.wanted_fields.iter().map(String::as_str).collect();
    let n_rank = if cfg.explicit.enabled {
        cfg.explicit.body_fields.len()
    } else {
        0
    };
    let n_key = cfg.key.body_fields.len();
    // Per rank and key field, its last occurrence (one allocation for both; `None`: absent).
    let mut last: Vec<Option<Value<'a>>> = vec![None; n_rank + n_key];
    let mut room = None;
    let mut found = |idx: usize, value: Value<'a>| {
        if let Some(slot) = last.get_mut(idx) {
            *slot = Some(value);
        } else {
            room = match value {
                Value::Null => None,
                Value::Number(raw) => Some(parse_u64(raw).map_or(Room::Unusable, Room::One)),
                _ => Some(Room::Unusable),
            };
        }
    };
    let chain = match api {
        Some(api) => scan_prompt(
            body,
            api,
            &cfg.prefix,
            &cfg.prefix_hasher,
            &wanted,
            &mut found,
        )?,
        None => {
            scan_top_level(body, &wanted, &mut found)?;
            Chain::default()
        }
    };
    let (rank_slots, key_slots) = last.split_at_mut(n_rank);
    let ranks = rank_slots
        .iter()
        .enumerate()
        .map(|(idx, value)| match value {
            Some(v) => rank_from_json(cfg, wanted.get(idx).copied().unwrap_or_default(), v),
            None => Ok(None),
        });
    let facts = BodyFacts {
        rank: merge_ranks(&wanted, ranks),
        // Only a non-empty string is a key; the first field in list order holding one wins.
        key: key_slots.iter_mut().find_map(|value| match value.take() {
            Some(Value::Str(s)) if !s.is_empty() => Some(s),
            _ => None,
        }),
        room,
    };
    Ok((facts, chain))
}

/// Folds the rank fields' values (each its field's last occurrence, in `explicit.body_fields`
/// order) into one rank: absent fields are skipped, the first invalid one is the error, and a
/// field disagreeing with an earlier one is an error naming both.
fn merge_ranks(
    wanted: &[&str],
    ranks: impl Iterator<Item = Result<Option<u32>, RankError>>,
) -> Option<Result<u32, RankError>> {
    let mut seen: Option<(u32, usize)> = None;
    for (idx, rank) in ranks.enumerate() {
        let this = match rank {
            Ok(None) => continue,
            Ok(Some(n)) => n,
            Err(e) => return Some(Err(e)),
        };
        match seen {
            None => seen = Some((this, idx)),
            Some((prev, prev_idx)) if prev != this => {
                let name = |i: usize| wanted.get(i).copied().unwrap_or_default();
                return Some(Err(RankError {
                    field: name(idx).to_string(),
                    problem: format!("({this}) disagrees with {} ({prev})", name(prev_idx)),
                    conflict: true,
                }));
            }
            Some(_) => {}
        }
    }
    seen.map(|(n, _)| Ok(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::from_json(br#"{"dp_size":4}"#).unwrap()
    }

    fn facts<'a>(cfg: &Config, h: &'a [(&'a str, &'a str)]) -> HeaderFacts<'a> {
        HeaderFacts::collect(cfg, h.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
    }

    #[test]
    fn header_facts_pick_priority_key_and_flag_conflicts() {
        let c = cfg();
        let f = facts(
            &c,
            &[
                ("x-routing-key", "low"),
                ("X-SMG-Routing-Key", " high "),
                ("x-data-parallel-rank", "1"),
                ("x-data-parallel-rank", "2"),
                ("x-dp-affinity-cluster", "dp-rank-3"),
                ("content-type", "Application/JSON; charset=utf-8"),
                ("content-length", "12"),
            ],
        );
        assert_eq!(f.key, Some((0, &b"high"[..])));
        assert_eq!(f.explicit, Some(&b"1"[..]));
        assert!(f.explicit_conflict);
        assert!(f.has_cluster_header);
        assert!(f.is_json(&c));
        assert_eq!(f.declared_length(), Some(12));
    }

    #[test]
    fn trust_header_must_carry_the_secret() {
        let c = Config::from_json(
            br#"{"dp_size":4,"explicit_rank":{"trusted_header":"x-router-token","trusted_secret":"s3cret"}}"#,
        )
        .unwrap();
        let cases: [(&[(&str, &str)], bool); 5] = [
            (&[("x-router-token", "s3cret")], true),
            (&[("X-Router-Token", "s3cret")], true),
            (&[("x-router-token", "s3cre")], false),
            (
                &[("x-router-token", "s3cret"), ("x-router-token", "nope")],
                false,
            ),
            (&[], false),
        ];
        for (h, trusted) in cases {
            let f = facts(&c, h);
            assert_eq!(f.trusted, trusted, "{h:?}");
            assert_eq!(f.has_trust_header, !h.is_empty());
        }
        assert!(
            facts(&cfg(), &[]).trusted,
            "no trust configured: everyone may"
        );
    }

    #[test]
    fn empty_key_header_is_absent_and_next_one_counts() {
        let c = cfg();
        let f = facts(&c, &[("x-smg-routing-key", "  "), ("x-routing-key", "k")]);
        assert_eq!(f.key, Some((1, &b"k"[..])));
        assert!(!f.is_json(&c));
        let f = facts(&c, &[("content-type", "text/plain")]);
        assert!(!f.is_json(&c));
    }

    #[test]
    fn response_facts() {
        let c = cfg();
        let collect = |h: &[(&str, &str)]| {
            ResponseFacts::collect(&c, h.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
        };
        let ok = collect(&[(":status", "200"), ("x-dp-rank", "2")]);
        assert_eq!(
            (ok.status, ok.reported_rank, ok.echo_in_place),
            (200, Some(2), true)
        );
        assert!(ok.served());
        let failed = collect(&[(":status", "503")]);
        assert!(!failed.served());
        assert_eq!(failed.reported_rank, None);
        let out_of_range = collect(&[(":status", "200"), ("x-dp-rank", "9")]);
        assert_eq!(
            (out_of_range.reported_rank, out_of_range.echo_in_place),
            (None, false)
        );
        let twice = collect(&[(":status", "200"), ("x-dp-rank", "1"), ("x-dp-rank", "1")]);
        assert_eq!((twice.reported_rank, twice.echo_in_place), (None, false));
        assert!(!collect(&[]).served());

        // A gRPC answer's status is its grpc-status: Envoy's own "unavailable" for a rank it
        // could not reach is a 200 carrying grpc-status 14.
        let grpc = |code: &str| collect(&[(":status", "200"), ("grpc-status", code)]).status;
        assert_eq!(grpc("0"), 200);
        assert_eq!(grpc("14"), 503);
        assert_eq!(grpc("4"), 504);
        assert_eq!(grpc("3"), 400);
        assert_eq!(grpc("13"), 500);
        assert_eq!(grpc("x"), 500);
        assert!(!collect(&[(":status", "200"), ("grpc-status", "14")]).served());
        let failed_http = collect(&[(":status", "502"), ("grpc-status", "0")]);
        assert_eq!(failed_http.status, 502, "only a 2xx reads its grpc-status");

        let renamed = Config::from_json(br#"{"dp_size":4,"echo_header":"x-served"}"#).unwrap();
        let f = ResponseFacts::collect(&renamed, [(&b"x-dp-rank"[..], &b"1"[..])]);
        assert_eq!((f.reported_rank, f.echo_in_place), (Some(1), false));
    }

    #[test]
    fn header_rank_parsing() {
        let c = cfg();
        assert_eq!(rank_from_header(&c, b"0"), Ok(0));
        assert_eq!(rank_from_header(&c, b" 3 "), Ok(3));
        for bad in [
            "4",
            "-1",
            "abc",
            "1.5",
            "",
            "+1",
            "0x1",
            "99999999999999999999999",
        ] {
            let e = rank_from_header(&c, bad.as_bytes()).unwrap_err();
            assert_eq!(e.field, "x-data-parallel-rank", "{bad}");
        }
        let long = vec![b'9'; 1000];
        let e = rank_from_header(&c, &long).unwrap_err();
        assert!(e.problem.len() < 100, "message stays short: {}", e.problem);
    }

    #[test]
    fn excerpts_are_bounded_and_marked() {
        let a32 = "a".repeat(32);
        let cases: [(Vec<u8>, bool, String); 9] = [
            (b"7".to_vec(), false, "7".into()),
            (b"two".to_vec(), true, r#""two""#.into()),
            (a32.clone().into_bytes(), true, format!("{a32:?}")),
            (
                "a".repeat(33).into_bytes(),
                true,
                format!("{a32:?}... (truncated, 33 bytes)"),
            ),
            (
                vec![b'9'; 4_000_000],
                false,
                format!("{}... (truncated, 4000000 bytes)", "9".repeat(32)),
            ),
            // A 2-byte character across the cut is left out whole, not split into U+FFFD.
            (
                format!("{}é", "a".repeat(31)).into_bytes(),
                true,
                format!("{:?}... (truncated, 33 bytes)", "a".repeat(31)),
            ),
            // Bytes that are not UTF-8 (a raw header value) show as U+FFFD.
            (vec![0xff, b'1'], true, "\"\u{fffd}1\"".into()),
            (b"a\"b\n".to_vec(), true, r#""a\"b\n""#.into()),
            (Vec::new(), true, r#""""#.into()),
        ];
        for (value, quoted, want) in cases {
            assert_eq!(
                excerpt(&value, quoted),
                want,
                "{:?}",
                &value[..value.len().min(40)]
            );
        }
        // Escapes and replacement characters count towards the bound, not the input bytes.
        let worst = excerpt(&[0x7f; 1000], true);
        assert_eq!(
            worst,
            format!("\"{}\"... (truncated, 1000 bytes)", r"\u{7f}".repeat(5))
        );
        let high = excerpt(&[0x80; 1000], true);
        assert_eq!(
            high,
            format!("\"{}\"... (truncated, 1000 bytes)", "\u{fffd}".repeat(10))
        );
        for value in [&b"\x01\x02"[..], "\u{200b}".as_bytes(), &[0xe9, 0x80]] {
            let all = excerpt(&value.repeat(100), true);
            let quote = all.split("... (truncated").next().unwrap_or_default();
            assert!(quote.len() <= QUOTE_MAX_BYTES + 2, "{all}");
        }
    }

    fn body(c: &Config, json: &'static str) -> BodyFacts<'static> {
        scan_body(c, json.as_bytes()).unwrap()
    }

    #[test]
    fn body_rank_and_key() {
        let c = cfg();
        let b = body(
            &c,
            r#"{"routed_dp_rank":2,"user":"u","prompt_cache_key":"p"}"#,
        );
        assert_eq!(b.rank, Some(Ok(2)));
        assert_eq!(
            b.key.as_deref(),
            Some(&b"p"[..]),
            "list order, not document order"
        );
        let b = body(
            &c,
            r#"{"data_parallel_rank":null,"routing_key":"","user":"u"}"#,
        );
        assert_eq!(b.rank, None);
        assert_eq!(b.key.as_deref(), Some(&b"u"[..]));
        let b = body(&c, r#"{"routing_key":"a","routing_key":"b"}"#);
        assert_eq!(b.key.as_deref(), Some(&b"b"[..]), "last duplicate wins");
        let b = body(&c, r#"{"routing_key":"a","routing_key":""}"#);
        assert_eq!(b.key, None, "even when the last one is no key");
        let b = body(&c, r#"{"routing_key":5,"user":{"id":"x"}}"#);
        assert_eq!(b.key, None, "non-string keys are ignored");
    }

    #[test]
    fn body_rank_errors() {
        let c = cfg();
        let cases = [
            (r#"{"routed_dp_rank":4}"#, "routed_dp_rank"),
            (r#"{"routed_dp_rank":-1}"#, "routed_dp_rank"),
            (r#"{"routed_dp_rank":1.5}"#, "routed_dp_rank"),
            (r#"{"routed_dp_rank":1.0}"#, "routed_dp_rank"),
            (r#"{"routed_dp_rank":1e400}"#, "routed_dp_rank"),
            (r#"{"routed_dp_rank":"2"}"#, "routed_dp_rank"),
            (r#"{"routed_dp_rank":true}"#, "routed_dp_rank"),
            (r#"{"routed_dp_rank":[1]}"#, "routed_dp_rank"),
            (
                r#"{"data_parallel_rank":99999999999999999999999}"#,
                "data_parallel_rank",
            ),
            (
                r#"{"routed_dp_rank":1,"data_parallel_rank":2}"#,
                "data_parallel_rank",
            ),
            (
                r#"{"routed_dp_rank":2,"routed_dp_rank":"x"}"#,
                "routed_dp_rank",
            ),
            // Fields are merged in list order, whatever the document order.
            (
                r#"{"data_parallel_rank":"x","routed_dp_rank":9}"#,
                "routed_dp_rank",
            ),
        ];
        for (json, field) in cases {
            match body(&c, json).rank {
                Some(Err(e)) => assert_eq!(e.field, field, "{json}"),
                other => panic!("{json}: {other:?}"),
            }
        }
        let agree = body(&c, r#"{"routed_dp_rank":1,"data_parallel_rank":1}"#);
        assert_eq!(agree.rank, Some(Ok(1)));
        assert_eq!(body(&c, r#"{"routed_dp_rank":-0}"#).rank, Some(Ok(0)));
    }

    /// A duplicated member: the engine's Python `dict` keeps the last occurrence, so the filter
    /// routes on that one (rank, key and room alike), never on one the engine does not see.
    #[test]
    fn duplicated_members_take_the_last_occurrence_like_python() {
        let c = Config::from_json(br#"{"dp_size":4,"assign":{"mode":"bootstrap_room"}}"#).unwrap();
        let cases: [(&str, Option<Result<u32, &str>>); 7] = [
            (r#"{"routed_dp_rank":1,"routed_dp_rank":2}"#, Some(Ok(2))),
            (r#"{"routed_dp_rank":"x","routed_dp_rank":2}"#, Some(Ok(2))),
            (r#"{"routed_dp_rank":9,"routed_dp_rank":null}"#, None),
            (
                r#"{"routed_dp_rank":1,"routed_dp_rank":null,"data_parallel_rank":3}"#,
                Some(Ok(3)),
            ),
            (
                r#"{"routed_dp_rank":1,"data_parallel_rank":1,"data_parallel_rank":2}"#,
                Some(Err("data_parallel_rank")),
            ),
            (
                r#"{"data_parallel_rank":2,"routed_dp_rank":1,"data_parallel_rank":1}"#,
                Some(Ok(1)),
            ),
            (
                r#"{"routed_dp_rank":0,"routed_dp_rank":NaN}"#,
                Some(Err("routed_dp_rank")),
            ),
        ];
        for (json, want) in cases {
            let got = body(&c, json).rank.map(|r| r.map_err(|e| e.field));
            assert_eq!(got, want.map(|r| r.map_err(String::from)), "{json}");
        }
        let b = body(
            &c,
            r#"{"user":"a","bootstrap_room":1,"user":"b","bootstrap_room":6}"#,
        );
        assert_eq!(
            (b.key.as_deref(), b.room),
            (Some(&b"b"[..]), Some(Room::One(6)))
        );
    }

    /// Bodies the engines' parser (Python's `json.loads` of the bytes) accepts are read, with the
    /// prompt walker too: a byte order mark, NaN and the infinities, lone surrogates in a key.
    #[test]
    fn reads_bodies_python_accepts_with_and_without_the_prompt() {
        let c = Config::from_json(br#"{"dp_size":4,"prefix":{"enabled":true,"block_bytes":16}}"#)
            .unwrap();
        let prompt =
            r#""messages":[{"role":"user","content":"a long enough question to fill blocks"}]"#;
        let cases: [(Vec<u8>, &[u8]); 5] = [
            (
                [
                    b"\xEF\xBB\xBF",
                    format!(r#"{{"user":"u",{prompt}}}"#).as_bytes(),
                ]
                .concat(),
                b"u",
            ),
            (
                format!(r#"{{"temperature":NaN,"user":"u",{prompt}}}"#).into_bytes(),
                b"u",
            ),
            (
                format!(
                    r#"{{"logit_bias":{{"1":-Infinity}},"top_p":Infinity,"user":"u",{prompt}}}"#
                )
                .into_bytes(),
                b"u",
            ),
            (
                format!(r#"{{"prompt_cache_key":"p\ud800","user":"u",{prompt}}}"#).into_bytes(),
                b"p\xed\xa0\x80",
            ),
            (
                br#"{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,NaN],"user":"u"}"#
                    .to_vec(),
                b"u",
            ),
        ];
        for (json, key) in &cases {
            let shown = String::from_utf8_lossy(json);
            let facts = scan_body(&c, json).unwrap_or_else(|e| panic!("{shown}: {e:?}"));
            assert_eq!(facts.key.as_deref(), Some(*key), "{shown}");
            let api = if json.windows(8).any(|w| w == b"messages") {
                Api::Chat
            } else {
                Api::Completions
            };
            let (with_prompt, chain) = scan_body_and_prompt(&c, json, Some(api))
                .unwrap_or_else(|e| panic!("{shown}: {e:?}"));
            assert_eq!(with_prompt, facts, "{shown}");
            if api == Api::Chat {
                assert!(!chain.is_empty(), "the prompt is read too: {shown}");
            }
        }
        let bom_chain = scan_body_and_prompt(&c, &cases[0].0, Some(Api::Chat))
            .unwrap()
            .1;
        let plain = format!(r#"{{"user":"u",{prompt}}}"#);
        let plain_chain = scan_body_and_prompt(&c, plain.as_bytes(), Some(Api::Chat))
            .unwrap()
            .1;
        assert_eq!(bom_chain, plain_chain, "the mark is not part of the prompt");
        // One mark only, as Python: a second one is not JSON, with or without the prompt walker.
        let twice = [b"\xEF\xBB\xBF".as_slice(), &cases[0].0].concat();
        assert_eq!(scan_body(&c, &twice), Err(ScanError::NotAnObject));
        assert_eq!(
            scan_body_and_prompt(&c, &twice, Some(Api::Chat)).map(|_| ()),
            Err(ScanError::NotAnObject)
        );
    }

    #[test]
    fn disabled_explicit_rank_ignores_body_fields() {
        let c = Config::from_json(br#"{"dp_size":4,"explicit_rank":{"enabled":false}}"#).unwrap();
        let b = body(&c, r#"{"routed_dp_rank":9,"routing_key":"k"}"#);
        assert_eq!(b.rank, None);
        assert_eq!(b.key.as_deref(), Some(&b"k"[..]));
    }

    #[test]
    fn bootstrap_room_only_in_room_mode() {
        let c = Config::from_json(br#"{"dp_size":4,"assign":{"mode":"bootstrap_room"}}"#).unwrap();
        let b = scan_body(&c, br#"{"bootstrap_room":10,"routing_key":"k"}"#).unwrap();
        assert_eq!(
            (b.room, b.key.as_deref()),
            (Some(Room::One(10)), Some(&b"k"[..]))
        );
        for unusable in [
            r#"{"bootstrap_room":-1}"#,
            r#"{"bootstrap_room":"1"}"#,
            r#"{"bootstrap_room":1.5}"#,
            r#"{"bootstrap_room":[5,6]}"#,
            r#"{"bootstrap_room":5,"bootstrap_room":{}}"#,
        ] {
            let room = scan_body(&c, unusable.as_bytes()).unwrap().room;
            assert_eq!(room, Some(Room::Unusable), "{unusable}");
        }
        for none in [
            r#"{"bootstrap_room":null}"#,
            r#"{"bootstrap_room":[1],"bootstrap_room":null}"#,
        ] {
            assert_eq!(scan_body(&c, none.as_bytes()).unwrap().room, None, "{none}");
        }
        let plain = body(&cfg(), r#"{"bootstrap_room":10}"#);
        assert_eq!(plain.room, None);
    }

    #[test]
    fn malformed_body_is_an_error() {
        let c = cfg();
        assert!(scan_body(&c, br#"{"routing_key":"k""#).is_err());
        assert!(scan_body(&c, b"[1]").is_err());
    }

    #[test]
    fn prompt_api_from_the_path_only_when_enabled() {
        let on = Config::from_json(br#"{"dp_size":4,"prefix":{"enabled":true}}"#).unwrap();
        let h = [
            (":path", "/v1/chat/completions?x=1"),
            ("content-type", "application/json"),
        ];
        assert_eq!(facts(&on, &h).path, Some(&b"/v1/chat/completions?x=1"[..]));
        assert_eq!(facts(&on, &h).prefix_api(&on), Some(Api::Chat));
        let off = Config::from_json(br#"{"dp_size":4,"prefix":{"enabled":false}}"#).unwrap();
        assert_eq!(facts(&off, &h).prefix_api(&off), None, "prefix off");
        let models = [(":path", "/v1/models")];
        assert_eq!(facts(&on, &models).prefix_api(&on), None);
        assert_eq!(facts(&on, &[]).prefix_api(&on), None, "no :path");
    }

    #[test]
    fn one_pass_gives_the_fields_and_the_chain() {
        use crate::prompt::prompt_chain;
        let c = Config::from_json(
            br#"{"dp_size":4,"prefix":{"enabled":true,"block_bytes":16},
                 "assign":{"mode":"bootstrap_room"}}"#,
        )
        .unwrap();
        let bodies = [
            r#"{"model":"m","routing_key":"k","messages":[{"role":"user","content":"a long enough question to fill blocks"}],"routed_dp_rank":2}"#,
            r#"{"messages":[{"role":"user","content":"another prompt here, long enough"}],"user":"u","routing_key":"","bootstrap_room":7}"#,
            r#"{"prompt":"a completions prompt of some length","prompt_cache_key":"p"}"#,
            r#"{"user":"x","messages":"not a list"}"#,
        ];
        for body in bodies {
            for api in [Api::Chat, Api::Completions, Api::Generate] {
                let (facts, chain) = scan_body_and_prompt(&c, body.as_bytes(), Some(api)).unwrap();
                assert_eq!(facts, scan_body(&c, body.as_bytes()).unwrap(), "{body}");
                let want = prompt_chain(body.as_bytes(), api, &c.prefix, &c.prefix_hasher).unwrap();
                assert_eq!(chain, want, "{body}");
            }
            let (_, none) = scan_body_and_prompt(&c, body.as_bytes(), None).unwrap();
            assert!(none.is_empty());
        }
        assert!(
            scan_body_and_prompt(&c, br#"{"messages":[{"role":"user""#, Some(Api::Chat)).is_err()
        );
        assert!(scan_body_and_prompt(&c, b"[]", Some(Api::Chat)).is_err());
    }
}
