//! The numbers a replay is judged by: token hit rate (what the prefix caches
//! reused), balance across ranks (max over mean of requests and of prompt
//! tokens: affinity must not pile everything on one rank), and latency
//! percentiles, plus how faithfully the open loop kept its schedule.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::run::Record;

/// Nearest-rank percentile `p` (0 < p <= 100) of `sorted` (ascending).
pub fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Max and mean of per-rank values, and their ratio (1.0 = perfectly even).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Balance {
    pub max: u64,
    pub mean: f64,
    /// `None` when the mean is 0.
    pub max_over_mean: Option<f64>,
}

impl Balance {
    /// `None` for no ranks at all.
    pub fn of(values: &[u64]) -> Option<Balance> {
        let max = *values.iter().max()?;
        let mean = values.iter().sum::<u64>() as f64 / values.len() as f64;
        Some(Balance {
            max,
            mean,
            max_over_mean: (mean > 0.0).then(|| max as f64 / mean),
        })
    }

    fn to_json(self) -> Value {
        json!({"max": self.max, "mean": self.mean, "max_over_mean": self.max_over_mean})
    }
}

/// Totals of one rank, over successful requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankTotals {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// Low and high percentiles of a latency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spread {
    pub p50: Option<u64>,
    /// The tail most requests of a loaded system still see, steadier than p99
    /// on a few hundred requests.
    pub p90: Option<u64>,
    pub p99: Option<u64>,
    pub max: Option<u64>,
}

impl Spread {
    fn of(mut values: Vec<u64>) -> Spread {
        values.sort_unstable();
        Spread {
            p50: percentile(&values, 50.0),
            p90: percentile(&values, 90.0),
            p99: percentile(&values, 99.0),
            max: values.last().copied(),
        }
    }

    fn to_json(self) -> Value {
        json!({"p50": self.p50, "p90": self.p90, "p99": self.p99, "max": self.max})
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub requests: u64,
    pub ok: u64,
    pub errors: u64,
    pub wall_s: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// cached / prompt over ok requests; `None` without prompt tokens.
    pub token_hit_rate: Option<f64>,
    pub per_rank: BTreeMap<u32, RankTotals>,
    /// Ranks the balance is computed over: 0..dp_size, else those seen.
    pub ranks_counted: usize,
    pub requests_per_rank: Option<Balance>,
    pub prompt_tokens_per_rank: Option<Balance>,
    /// Ok requests whose answer named no rank.
    pub no_rank: u64,
    /// Answers by status code ("none" = no answer).
    pub statuses: BTreeMap<String, u64>,
    pub first_error: Option<String>,
    pub ttfb_us: Spread,
    pub total_us: Spread,
    pub lateness_us: Spread,
    pub inflight_delayed: u64,
    /// Turns that waited for their session's previous answer (`--turns in-order`).
    pub turns_waited: u64,
}

pub fn summarize(records: &[Record], wall_s: f64, dp_size: Option<u32>) -> Summary {
    let ok: Vec<&Record> = records.iter().filter(|r| r.ok()).collect();
    let mut per_rank: BTreeMap<u32, RankTotals> = BTreeMap::new();
    if let Some(n) = dp_size {
        for rank in 0..n {
            per_rank.entry(rank).or_default();
        }
    }
    let mut no_rank = 0;
    for r in &ok {
        match r.rank {
            Some(rank) => {
                let totals = per_rank.entry(rank).or_default();
                totals.requests += 1;
                totals.prompt_tokens += r.prompt_tokens.unwrap_or(0);
                totals.cached_tokens += r.cached_tokens.unwrap_or(0);
            }
            None => no_rank += 1,
        }
    }
    let counted: Vec<RankTotals> = per_rank
        .iter()
        .filter(|(&rank, _)| dp_size.is_none_or(|n| rank < n))
        .map(|(_, &t)| t)
        .collect();
    let prompt_tokens: u64 = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let cached_tokens: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let mut statuses = BTreeMap::new();
    for r in records {
        let status = r
            .status
            .map_or_else(|| "none".to_string(), |s| s.to_string());
        *statuses.entry(status).or_insert(0) += 1;
    }
    Summary {
        requests: records.len() as u64,
        ok: ok.len() as u64,
        errors: (records.len() - ok.len()) as u64,
        wall_s,
        prompt_tokens,
        cached_tokens,
        token_hit_rate: (prompt_tokens > 0).then(|| cached_tokens as f64 / prompt_tokens as f64),
        ranks_counted: counted.len(),
        requests_per_rank: Balance::of(&counted.iter().map(|t| t.requests).collect::<Vec<_>>()),
        prompt_tokens_per_rank: Balance::of(
            &counted.iter().map(|t| t.prompt_tokens).collect::<Vec<_>>(),
        ),
        per_rank,
        no_rank,
        statuses,
        first_error: records.iter().find_map(|r| r.error.clone()),
        ttfb_us: Spread::of(ok.iter().filter_map(|r| r.ttfb_us).collect()),
        total_us: Spread::of(ok.iter().filter_map(|r| r.total_us).collect()),
        lateness_us: Spread::of(records.iter().map(|r| r.lateness_us).collect()),
        inflight_delayed: records.iter().filter(|r| r.inflight_delayed).count() as u64,
        turns_waited: records.iter().filter(|r| r.turn_wait_us > 0).count() as u64,
    }
}

impl Summary {
    pub fn to_json(&self) -> Value {
        let per_rank: Vec<Value> = self
            .per_rank
            .iter()
            .map(|(rank, t)| {
                json!({
                    "rank": rank,
                    "requests": t.requests,
                    "prompt_tokens": t.prompt_tokens,
                    "cached_tokens": t.cached_tokens,
                })
            })
            .collect();
        json!({
            "requests": self.requests,
            "ok": self.ok,
            "errors": self.errors,
            "wall_s": self.wall_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "token_hit_rate": self.token_hit_rate,
            "per_rank": per_rank,
            "ranks_counted": self.ranks_counted,
            "requests_per_rank": self.requests_per_rank.map(Balance::to_json),
            "prompt_tokens_per_rank": self.prompt_tokens_per_rank.map(Balance::to_json),
            "no_rank": self.no_rank,
            "statuses": self.statuses,
            "first_error": self.first_error,
            "ttfb_us": self.ttfb_us.to_json(),
            "total_us": self.total_us.to_json(),
            "send_lateness_us": self.lateness_us.to_json(),
            "inflight_delayed": self.inflight_delayed,
            "turns_waited": self.turns_waited,
        })
    }

    /// A short human-readable report.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "requests {}  ok {}  errors {}  wall {:.1} s  delayed by --max-inflight {}  turns waiting for the previous answer {}",
            self.requests, self.ok, self.errors, self.wall_s, self.inflight_delayed, self.turns_waited
        );
        let _ = writeln!(
            s,
            "tokens   prompt {}  cached {}  hit rate {}",
            self.prompt_tokens,
            self.cached_tokens,
            self.token_hit_rate
                .map_or("-".to_string(), |r| format!("{:.1}%", r * 100.0))
        );
        let _ = writeln!(s, "rank  requests  prompt_tokens  cached_tokens");
        for (rank, t) in &self.per_rank {
            let _ = writeln!(
                s,
                "{rank:>4}  {:>8}  {:>13}  {:>13}",
                t.requests, t.prompt_tokens, t.cached_tokens
            );
        }
        if self.no_rank > 0 {
            let _ = writeln!(s, "   ?  {:>8}  (answers without x-dp-rank)", self.no_rank);
        }
        let ratio = |b: Option<Balance>| {
            b.and_then(|b| b.max_over_mean)
                .map_or("-".to_string(), |r| format!("{r:.2}"))
        };
        let _ = writeln!(
            s,
            "balance  max/mean over {} ranks: requests {}  prompt tokens {}",
            self.ranks_counted,
            ratio(self.requests_per_rank),
            ratio(self.prompt_tokens_per_rank)
        );
        let ms = |v: Option<u64>| v.map_or("-".to_string(), |us| format!("{:.1}", us as f64 / 1e3));
        let _ = writeln!(
            s,
            "latency  ttfb p50 {} p90 {} p99 {} ms  total p50 {} p99 {} ms  send lateness p99 {} ms",
            ms(self.ttfb_us.p50),
            ms(self.ttfb_us.p90),
            ms(self.ttfb_us.p99),
            ms(self.total_us.p50),
            ms(self.total_us.p99),
            ms(self.lateness_us.p99)
        );
        if let Some(err) = &self.first_error {
            let _ = writeln!(s, "first error: {err}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(rank: Option<u32>, prompt: u64, cached: u64, total_us: u64) -> Record {
        Record {
            status: Some(200),
            rank,
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            ttfb_us: Some(total_us / 2),
            total_us: Some(total_us),
            ..Record::default()
        }
    }

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 100.0), Some(100));
        assert_eq!(percentile(&[7], 99.0), Some(7));
        assert_eq!(percentile(&[1, 2], 50.0), Some(1));
        assert_eq!(percentile(&[1, 2], 51.0), Some(2));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn balance_max_over_mean() {
        let b = Balance::of(&[2, 4, 6, 0]).expect("ranks");
        assert_eq!(b.max, 6);
        assert_eq!(b.mean, 3.0);
        assert_eq!(b.max_over_mean, Some(2.0));
        assert_eq!(Balance::of(&[0, 0]).and_then(|b| b.max_over_mean), None);
        assert_eq!(Balance::of(&[]), None);
    }

    #[test]
    fn summary_counts_ok_requests_per_rank() {
        let failed = Record {
            status: Some(503),
            rank: Some(1),
            error: Some("HTTP 503".into()),
            lateness_us: 900,
            ..Record::default()
        };
        let unanswered = Record {
            error: Some("connect: refused".into()),
            inflight_delayed: true,
            ..Record::default()
        };
        let records = vec![
            record(Some(0), 100, 50, 10),
            record(Some(0), 100, 100, 20),
            record(Some(1), 200, 0, 30),
            record(None, 40, 0, 40),
            failed,
            unanswered,
        ];
        let s = summarize(&records, 2.0, None);
        assert_eq!((s.requests, s.ok, s.errors), (6, 4, 2));
        assert_eq!((s.prompt_tokens, s.cached_tokens), (440, 150));
        assert_eq!(s.token_hit_rate, Some(150.0 / 440.0));
        assert_eq!(s.per_rank[&0].requests, 2);
        assert_eq!(s.per_rank[&1].prompt_tokens, 200);
        assert_eq!(s.no_rank, 1);
        assert_eq!(s.ranks_counted, 2);
        let req = s.requests_per_rank.expect("balance");
        assert_eq!((req.max, req.mean), (2, 1.5));
        assert_eq!(s.statuses["200"], 4);
        assert_eq!(s.statuses["503"], 1);
        assert_eq!(s.statuses["none"], 1);
        assert_eq!(s.total_us.p50, Some(20));
        assert_eq!(s.total_us.p90, Some(40));
        assert_eq!(s.total_us.p99, Some(40));
        assert_eq!(s.lateness_us.max, Some(900));
        assert_eq!(s.inflight_delayed, 1);
        assert_eq!(s.first_error.as_deref(), Some("HTTP 503"));
        // --dp-size 4: ranks 2 and 3 served nothing and count in the mean.
        let s = summarize(&records, 2.0, Some(4));
        assert_eq!(s.ranks_counted, 4);
        let req = s.requests_per_rank.expect("balance");
        assert_eq!(
            (req.max, req.mean, req.max_over_mean),
            (2, 0.75, Some(2.0 / 0.75))
        );
        let json = s.to_json();
        assert_eq!(json["per_rank"].as_array().map(Vec::len), Some(4));
        assert_eq!(json["per_rank"][3]["requests"], 0);
        assert_eq!(json["requests_per_rank"]["max"], 2);
        assert_eq!(json["total_us"]["p90"], 40);
        assert!(s.table().contains("hit rate 34.1%"), "{}", s.table());
    }
}
