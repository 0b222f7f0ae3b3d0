//! Engine mode: one process standing for one engine with internal data
//! parallelism (SGLang `--dp-size N`). A request names its internal rank with
//! the `x-data-parallel-rank` header, or the engine picks one round robin.
//!
//! `--engine-kind sglang|vllm` makes the mock honour a rank exactly where that
//! engine does (checked in their sources), so a proxy that tells the rank the
//! wrong way is seen to miss:
//! - SGLang: on `/v1/chat/completions` and `/v1/completions` the header (a
//!   non-integer is a 400), which wins over the body field `routed_dp_rank`
//!   (`data_parallel_rank` is its deprecated alias, outranked by it); on
//!   `/generate` the header is IGNORED and only the body fields count. Without a
//!   rank, a request carrying `bootstrap_room` goes to `bootstrap_room %
//!   dp_size` (the PD prefill default), others round robin.
//! - vLLM: the header on the two OpenAI paths (a non-integer is ignored), no
//!   body field, no `/generate` (404).
//!
//! Out of range is a 400 in both.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

/// The header SGLang reads the requested data-parallel rank from.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// Longest header value quoted back in an error message.
const MAX_QUOTED_CHARS: usize = 32;

/// Parses one header value: plain ASCII digits (leading zeros allowed, no
/// sign, no spaces inside) naming a rank below `dp_size`. The HTTP parser has
/// already trimmed surrounding whitespace.
pub fn parse_rank(value: &str, dp_size: u32) -> Result<u32, String> {
    let rank = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // All digits: parsing fails only on overflow, which is out of range too.
        value.parse::<u32>().ok().filter(|&r| r < dp_size)
    } else {
        None
    };
    rank.ok_or_else(|| {
        format!(
            "invalid {DP_RANK_HEADER} {}: expected an integer in 0..{dp_size}",
            quote(value)
        )
    })
}

/// The internal rank requested by `headers` (lower-cased names): `Ok(None)`
/// when the header is absent; a repeated header is invalid, since it cannot
/// name one rank.
pub fn requested_rank(headers: &[(String, String)], dp_size: u32) -> Result<Option<u32>, String> {
    let mut values = headers
        .iter()
        .filter(|(name, _)| name == DP_RANK_HEADER)
        .map(|(_, value)| value.as_str());
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(format!(
            "invalid {DP_RANK_HEADER}: header repeated, expected one integer in 0..{dp_size}"
        ));
    }
    parse_rank(first, dp_size).map(Some)
}

/// Which engine the mock stands for in engine mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The header on every LLM path (the mock's original behaviour).
    Generic,
    Sglang,
    Vllm,
}

impl Kind {
    pub fn from_name(name: &str) -> Option<Kind> {
        match name {
            "generic" => Some(Kind::Generic),
            "sglang" => Some(Kind::Sglang),
            "vllm" => Some(Kind::Vllm),
            _ => None,
        }
    }
}

/// The LLM path a request came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    OpenAi,
    Generate,
}

/// Why an engine refused a request before serving it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub message: String,
}

impl Refusal {
    fn bad(message: String) -> Refusal {
        Refusal {
            status: 400,
            message,
        }
    }
}

/// The SGLang body fields, in the order SGLang resolves them.
const BODY_FIELDS: [&str; 2] = ["routed_dp_rank", "data_parallel_rank"];

/// The rank `kind` serves this request on: `Ok(None)` when the request names
/// none the engine honours (it then balances).
pub fn honoured_rank(
    kind: Kind,
    path: Path,
    headers: &[(String, String)],
    body: &Value,
    dp_size: u32,
) -> Result<Option<u32>, Refusal> {
    match (kind, path) {
        (Kind::Generic, _) => requested_rank(headers, dp_size).map_err(Refusal::bad),
        (Kind::Vllm, Path::Generate) => Err(Refusal {
            status: 404,
            message: "Not Found".into(),
        }),
        (Kind::Vllm, Path::OpenAi) => vllm_header(headers, dp_size),
        (Kind::Sglang, Path::OpenAi) => match sglang_header(headers, dp_size)? {
            Some(rank) => Ok(Some(rank)),
            None => sglang_body_rank(body, dp_size),
        },
        (Kind::Sglang, Path::Generate) => match sglang_body_rank(body, dp_size)? {
            Some(rank) => Ok(Some(rank)),
            None => Ok(room(body).map(|room| (room % u64::from(dp_size.max(1))) as u32)),
        },
    }
}

fn header_value(headers: &[(String, String)]) -> Option<&str> {
    headers
        .iter()
        .find(|(name, _)| name == DP_RANK_HEADER)
        .map(|(_, value)| value.trim())
}

fn out_of_range(rank: i64, dp_size: u32) -> Refusal {
    Refusal::bad(format!("routed_dp_rank={rank} out of range [0, {dp_size})"))
}

fn in_range(rank: i64, dp_size: u32) -> Result<u32, Refusal> {
    u32::try_from(rank)
        .ok()
        .filter(|&r| r < dp_size)
        .ok_or_else(|| out_of_range(rank, dp_size))
}

/// SGLang: `int(header)`, a 400 when it is not an integer.
fn sglang_header(headers: &[(String, String)], dp_size: u32) -> Result<Option<u32>, Refusal> {
    let Some(value) = header_value(headers) else {
        return Ok(None);
    };
    let rank: i64 = value.parse().map_err(|_| {
        Refusal::bad(format!(
            "Invalid X-Data-Parallel-Rank header: must be an integer, got {}",
            quote(value)
        ))
    })?;
    in_range(rank, dp_size).map(Some)
}

/// vLLM: `int(header)`, ignored when it is not an integer.
fn vllm_header(headers: &[(String, String)], dp_size: u32) -> Result<Option<u32>, Refusal> {
    match header_value(headers).and_then(|v| v.parse::<i64>().ok()) {
        Some(rank) => u32::try_from(rank)
            .ok()
            .filter(|&r| r < dp_size)
            .map(Some)
            .ok_or_else(|| {
                Refusal::bad(format!(
                    "data_parallel_rank {rank} is out of range [0, {dp_size})."
                ))
            }),
        None => Ok(None),
    }
}

/// SGLang's body rank: `routed_dp_rank`, else the deprecated `data_parallel_rank`
/// (null counts as absent); an integer in range.
fn sglang_body_rank(body: &Value, dp_size: u32) -> Result<Option<u32>, Refusal> {
    let Some(value) = BODY_FIELDS
        .iter()
        .filter_map(|f| body.get(f))
        .find(|v| !v.is_null())
    else {
        return Ok(None);
    };
    let rank = value
        .as_i64()
        .ok_or_else(|| Refusal::bad(format!("routed_dp_rank must be an integer, got {value}")))?;
    in_range(rank, dp_size).map(Some)
}

fn room(body: &Value) -> Option<u64> {
    body.get("bootstrap_room").and_then(Value::as_u64)
}

/// For an SGLang request carrying `bootstrap_room` (a PD leg): the prefill
/// rank a decode engine would fetch the KV cache from, `disagg_prefill_dp_rank`
/// if given, else `bootstrap_room % prefill_dp_size` (SGLang's default).
pub fn pd_info(kind: Kind, body: &Value, prefill_dp_size: u32) -> Option<Value> {
    if kind != Kind::Sglang {
        return None;
    }
    let room = room(body)?;
    let prefill = body
        .get("disagg_prefill_dp_rank")
        .and_then(Value::as_u64)
        .unwrap_or(room % u64::from(prefill_dp_size.max(1)));
    Some(serde_json::json!({
        "bootstrap_room": room,
        "prefill_dp_rank": prefill,
    }))
}

/// Short, escaped rendering of a client-supplied value for messages.
fn quote(value: &str) -> String {
    let mut short: String = value.chars().take(MAX_QUOTED_CHARS).collect();
    if short.len() < value.len() {
        short.push_str("...");
    }
    format!("{short:?}")
}

/// Round-robin choice of an internal rank for requests that name none.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicU64,
}

impl RoundRobin {
    pub fn pick(&self, dp_size: u32) -> u32 {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // The remainder is below dp_size, a u32.
        (n % u64::from(dp_size.max(1))) as u32
    }

    /// Next pick is rank 0 again.
    pub fn reset(&self) {
        self.next.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> Vec<(String, String)> {
        let mut h = vec![("host".to_string(), "x".to_string())];
        h.extend(
            values
                .iter()
                .map(|v| (DP_RANK_HEADER.to_string(), v.to_string())),
        );
        h
    }

    #[test]
    fn valid_ranks() {
        assert_eq!(parse_rank("0", 4), Ok(0));
        assert_eq!(parse_rank("3", 4), Ok(3));
        assert_eq!(parse_rank("003", 4), Ok(3));
        assert_eq!(parse_rank("4095", 4096), Ok(4095));
    }

    #[test]
    fn invalid_ranks() {
        for bad in [
            "4",
            "-1",
            "+1",
            "abc",
            "1.5",
            "",
            "0x1",
            "1 2",
            "1,1",
            "٣",
            "99999999999999999999999",
        ] {
            let err = parse_rank(bad, 4).expect_err(bad);
            assert!(
                err.starts_with("invalid x-data-parallel-rank "),
                "{bad:?}: {err}"
            );
        }
        let long = "9".repeat(1000);
        let err = parse_rank(&long, 4).expect_err("long");
        assert!(err.len() < 120, "message stays short: {err}");
        let err = parse_rank("\"\n\u{1}", 4).expect_err("control");
        assert!(!err.contains('\n'), "value is escaped: {err}");
    }

    #[test]
    fn header_lookup() {
        assert_eq!(requested_rank(&headers(&[]), 4), Ok(None));
        assert_eq!(requested_rank(&headers(&["2"]), 4), Ok(Some(2)));
        assert!(requested_rank(&headers(&["7"]), 4).is_err());
        assert!(requested_rank(&headers(&[""]), 4).is_err());
        let err = requested_rank(&headers(&["1", "1"]), 4).expect_err("repeated");
        assert!(err.starts_with("invalid x-data-parallel-rank"), "{err}");
    }

    fn with_header(value: &str) -> Vec<(String, String)> {
        vec![(DP_RANK_HEADER.to_string(), value.to_string())]
    }

    #[test]
    fn each_kind_honours_what_its_engine_honours() {
        use serde_json::json;
        let none: Vec<(String, String)> = Vec::new();
        let h2 = with_header("2");
        let body1 = json!({"routed_dp_rank": 1});
        let alias3 = json!({"data_parallel_rank": 3});
        let both = json!({"data_parallel_rank": 3, "routed_dp_rank": 0});
        let room = json!({"bootstrap_room": 4242});
        let empty = json!({});
        let ok = |k, p, h: &[(String, String)], b: &Value| honoured_rank(k, p, h, b, 4).unwrap();
        // SGLang OpenAI paths: the header wins over the body.
        assert_eq!(ok(Kind::Sglang, Path::OpenAi, &h2, &body1), Some(2));
        assert_eq!(ok(Kind::Sglang, Path::OpenAi, &none, &body1), Some(1));
        assert_eq!(ok(Kind::Sglang, Path::OpenAi, &none, &alias3), Some(3));
        assert_eq!(ok(Kind::Sglang, Path::OpenAi, &none, &both), Some(0));
        // SGLang /generate: the header is ignored.
        assert_eq!(ok(Kind::Sglang, Path::Generate, &h2, &empty), None);
        assert_eq!(ok(Kind::Sglang, Path::Generate, &h2, &body1), Some(1));
        assert_eq!(
            ok(Kind::Sglang, Path::Generate, &none, &room),
            Some(4242 % 4)
        );
        // vLLM: the header only; a non-integer is ignored.
        assert_eq!(ok(Kind::Vllm, Path::OpenAi, &h2, &body1), Some(2));
        assert_eq!(ok(Kind::Vllm, Path::OpenAi, &none, &body1), None);
        assert_eq!(
            ok(Kind::Vllm, Path::OpenAi, &with_header("x"), &empty),
            None
        );
        // Generic: the header everywhere.
        assert_eq!(ok(Kind::Generic, Path::Generate, &h2, &empty), Some(2));

        let status = |k, p, h: &[(String, String)], b: &Value| {
            honoured_rank(k, p, h, b, 4).expect_err("refused").status
        };
        assert_eq!(status(Kind::Vllm, Path::Generate, &none, &empty), 404);
        assert_eq!(
            status(Kind::Vllm, Path::OpenAi, &with_header("4"), &empty),
            400
        );
        assert_eq!(
            status(Kind::Sglang, Path::OpenAi, &with_header("x"), &empty),
            400
        );
        assert_eq!(
            status(Kind::Sglang, Path::OpenAi, &with_header("-1"), &empty),
            400
        );
        let far = json!({"routed_dp_rank": 9});
        assert_eq!(status(Kind::Sglang, Path::Generate, &none, &far), 400);
        let text = json!({"routed_dp_rank": "1"});
        assert_eq!(status(Kind::Sglang, Path::Generate, &none, &text), 400);
    }

    #[test]
    fn pd_legs_report_the_prefill_rank() {
        use serde_json::json;
        let decode = json!({"bootstrap_room": 10});
        assert_eq!(
            pd_info(Kind::Sglang, &decode, 4),
            Some(json!({"bootstrap_room": 10, "prefill_dp_rank": 2}))
        );
        let told = json!({"bootstrap_room": 10, "disagg_prefill_dp_rank": 1});
        assert_eq!(
            pd_info(Kind::Sglang, &told, 4).unwrap()["prefill_dp_rank"],
            1
        );
        assert_eq!(pd_info(Kind::Vllm, &decode, 4), None);
        assert_eq!(pd_info(Kind::Sglang, &json!({}), 4), None);
    }

    #[test]
    fn round_robin_cycles_and_resets() {
        let rr = RoundRobin::default();
        let picks: Vec<u32> = (0..6).map(|_| rr.pick(4)).collect();
        assert_eq!(picks, [0, 1, 2, 3, 0, 1]);
        rr.reset();
        assert_eq!(rr.pick(4), 0);
        assert_eq!(rr.pick(1), 0);
    }
}
