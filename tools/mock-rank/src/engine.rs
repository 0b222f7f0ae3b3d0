//! Engine mode: one process standing for one engine with internal data
//! parallelism (SGLang `--dp-size N`). A request names its internal rank with
//! the `x-data-parallel-rank` header, or the engine picks one round robin.

use std::sync::atomic::{AtomicU64, Ordering};

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
