//! The service-time model: prefill costs time per prompt token missing from
//! the prefix cache, decode costs time per output token. Both default to 0,
//! where the mock answers as fast as before (plus `--delay-ms`).

use std::ops::Range;
use std::time::Duration;

use crate::cli::Config;

/// Most decode time one SSE event stands for: long generations are sent as
/// groups of tokens instead of thousands of tiny sleeps and writes.
const MAX_EVENT_DECODE_US: f64 = 5_000.0;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServiceModel {
    pub prefill_us_per_token: f64,
    pub decode_us_per_token: f64,
}

impl ServiceModel {
    pub fn from_config(cfg: &Config) -> Self {
        ServiceModel {
            prefill_us_per_token: cfg.prefill_us_per_token,
            decode_us_per_token: cfg.decode_us_per_token,
        }
    }

    /// Time to prefill `uncached` prompt tokens.
    pub fn prefill(&self, uncached: u64) -> Duration {
        micros(uncached as f64 * self.prefill_us_per_token)
    }

    /// Time to decode `tokens` output tokens.
    pub fn decode(&self, tokens: u64) -> Duration {
        micros(tokens as f64 * self.decode_us_per_token)
    }

    /// Whether decode time is modelled (it then paces the SSE events).
    pub fn decodes(&self) -> bool {
        self.decode_us_per_token > 0.0
    }

    /// Output tokens one SSE event carries after the first.
    pub fn tokens_per_event(&self) -> u64 {
        if !self.decodes() {
            return 1;
        }
        // Float to int casts saturate; at least one token per event.
        ((MAX_EVENT_DECODE_US / self.decode_us_per_token) as u64).max(1)
    }
}

/// `us` microseconds. The cast saturates (and maps NaN to 0), so this cannot
/// panic the way `Duration::from_secs_f64` can.
fn micros(us: f64) -> Duration {
    Duration::from_nanos((us * 1_000.0) as u64)
}

/// The tokens of each SSE event: the first token alone (it ends the prefill,
/// the time to first token), then groups of `per_event`.
pub fn event_ranges(tokens: u64, per_event: u64) -> impl Iterator<Item = Range<u64>> {
    let per_event = per_event.max(1);
    let first = (tokens > 0).then_some(0..1);
    let rest = (1..tokens)
        .step_by(usize::try_from(per_event).unwrap_or(usize::MAX))
        .map(move |start| start..tokens.min(start.saturating_add(per_event)));
    first.into_iter().chain(rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(prefill: f64, decode: f64) -> ServiceModel {
        ServiceModel {
            prefill_us_per_token: prefill,
            decode_us_per_token: decode,
        }
    }

    #[test]
    fn durations() {
        let m = model(2.5, 40.0);
        assert_eq!(m.prefill(1000), Duration::from_micros(2500));
        assert_eq!(m.prefill(0), Duration::ZERO);
        assert_eq!(m.decode(3), Duration::from_micros(120));
        assert_eq!(model(0.0, 0.0).prefill(1 << 40), Duration::ZERO);
        assert_eq!(micros(f64::NAN), Duration::ZERO);
        assert_eq!(micros(-1.0), Duration::ZERO);
    }

    #[test]
    fn event_grouping() {
        assert_eq!(model(0.0, 0.0).tokens_per_event(), 1);
        assert_eq!(model(0.0, 10_000.0).tokens_per_event(), 1);
        assert_eq!(model(0.0, 1_000.0).tokens_per_event(), 5);
        assert_eq!(model(0.0, 0.001).tokens_per_event(), 5_000_000);
        assert!(!model(1.0, 0.0).decodes());
        assert!(model(0.0, 0.5).decodes());
    }

    #[test]
    fn ranges_cover_every_token_once() {
        let ranges = |tokens, per| event_ranges(tokens, per).collect::<Vec<_>>();
        assert_eq!(ranges(3, 1), [0..1, 1..2, 2..3]);
        assert_eq!(ranges(6, 2), [0..1, 1..3, 3..5, 5..6]);
        assert_eq!(ranges(1, 4), vec![Range { start: 0, end: 1 }]);
        assert_eq!(ranges(4, 100), [0..1, 1..4]);
        assert_eq!(ranges(2, 0), [0..1, 1..2], "0 is treated as 1");
        assert!(ranges(0, 1).is_empty());
        assert_eq!(ranges(3, u64::MAX), [0..1, 1..3]);
    }
}
