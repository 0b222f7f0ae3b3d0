//! `synth`: a deterministic synthetic multi-turn chat workload, the shape that
//! makes prefix-cache affinity matter. Tenants each share a long system
//! prompt; sessions belong to tenants (Zipf-popular) and run a Zipf-distributed
//! number of turns; every turn resends the whole conversation so far plus a
//! new user message, exactly as a chat client does. Sessions start as a
//! Poisson process and turns are spaced by an assumed response time plus an
//! exponential think time. Same flags and seed, same bytes.

use std::io::{self, Write};

use serde_json::{json, Value};

use crate::jsonl;
use crate::rng::{derive, Rng, Zipf};
use crate::text;

/// Stream tags for `derive`, one per independent random quantity.
const TENANT_TEXT: u64 = 1;
const SESSION: u64 = 2;
const USER_TEXT: u64 = 3;
const ASSISTANT_TEXT: u64 = 4;
const ARRIVALS: u64 = 5;

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub seed: u64,
    pub tenants: u64,
    pub sessions: u64,
    /// Tokens of each tenant's system prompt.
    pub system_tokens: u64,
    /// Mean tokens of a new user message (uniform in [mean/2, 3*mean/2]).
    pub user_tokens: u64,
    /// Tokens of each assistant answer, and the `output_tokens` asked for.
    pub output_tokens: u64,
    pub max_turns: u64,
    /// Exponent of the Zipf-like tenant popularity and turns per session.
    pub zipf: f64,
    /// Session starts per second (Poisson).
    pub session_rate: f64,
    /// Mean think time between an answer and the next turn (exponential).
    pub think_ms: f64,
    /// Assumed time to answer a turn, added before the think time.
    pub response_ms: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            seed: 1,
            tenants: 4,
            sessions: 100,
            system_tokens: 1000,
            user_tokens: 64,
            output_tokens: 32,
            max_turns: 8,
            zipf: 1.0,
            session_rate: 2.0,
            think_ms: 2000.0,
            response_ms: 500.0,
        }
    }
}

/// One conversation: its tenant, its texts and when each turn is sent.
#[derive(Debug, Clone, PartialEq)]
struct Session {
    tenant: u64,
    user: Vec<String>,
    assistant: Vec<String>,
    /// Send time of each turn, ms.
    times: Vec<f64>,
}

/// The generated workload, kept as texts (not as prompts, which grow
/// quadratically) until written.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    system: Vec<String>,
    sessions: Vec<Session>,
    output_tokens: u64,
}

pub fn generate(cfg: &Config) -> Workload {
    let system = (0..cfg.tenants)
        .map(|t| text::words(derive(cfg.seed, &[TENANT_TEXT, t]), cfg.system_tokens))
        .collect();
    let tenant_zipf = Zipf::new(cfg.tenants, cfg.zipf);
    let turns_zipf = Zipf::new(cfg.max_turns, cfg.zipf);
    let mut arrivals = Rng::new(derive(cfg.seed, &[ARRIVALS]));
    let mean_gap_ms = 1000.0 / cfg.session_rate;
    let mut start = 0.0;
    let sessions = (0..cfg.sessions)
        .map(|s| {
            if s > 0 {
                start += arrivals.exp(mean_gap_ms);
            }
            session(cfg, s, start, &tenant_zipf, &turns_zipf)
        })
        .collect();
    Workload {
        system,
        sessions,
        output_tokens: cfg.output_tokens,
    }
}

fn session(cfg: &Config, s: u64, start: f64, tenant_zipf: &Zipf, turns_zipf: &Zipf) -> Session {
    let mut rng = Rng::new(derive(cfg.seed, &[SESSION, s]));
    let tenant = tenant_zipf.sample(&mut rng) - 1;
    let turns = turns_zipf.sample(&mut rng);
    let lo = (cfg.user_tokens / 2).max(1);
    let hi = (cfg.user_tokens + cfg.user_tokens / 2).max(lo);
    let mut t = start;
    let mut session = Session {
        tenant,
        user: Vec::new(),
        assistant: Vec::new(),
        times: Vec::new(),
    };
    for k in 0..turns {
        if k > 0 {
            t += cfg.response_ms + rng.exp(cfg.think_ms);
        }
        session.times.push(t);
        let user_seed = derive(cfg.seed, &[USER_TEXT, s, k]);
        session.user.push(text::words(user_seed, rng.range(lo, hi)));
        let answer_seed = derive(cfg.seed, &[ASSISTANT_TEXT, s, k]);
        session
            .assistant
            .push(text::words(answer_seed, cfg.output_tokens));
    }
    session
}

impl Workload {
    /// `(t_ms, session, turn)` of every request in send order (ties broken
    /// by session, then turn, so the order is total and reproducible).
    fn schedule(&self) -> Vec<(f64, usize, usize)> {
        let mut events: Vec<_> = self
            .sessions
            .iter()
            .enumerate()
            .flat_map(|(s, session)| {
                session
                    .times
                    .iter()
                    .enumerate()
                    .map(move |(k, &t)| (t, s, k))
            })
            .collect();
        events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        events
    }

    /// The trace line of turn `k` of session `s`.
    fn line(&self, t_ms: f64, s: usize, k: usize) -> String {
        let session = &self.sessions[s];
        let mut messages = Vec::with_capacity(2 * k + 2);
        let system = self
            .system
            .get(session.tenant as usize)
            .map_or("", String::as_str);
        messages.push(json!({"role": "system", "content": system}));
        for j in 0..k {
            messages.push(json!({"role": "user", "content": session.user[j]}));
            messages.push(json!({"role": "assistant", "content": session.assistant[j]}));
        }
        messages.push(json!({"role": "user", "content": session.user[k]}));
        jsonl::object(&[
            ("t_ms", json!((t_ms * 10.0).round() / 10.0)),
            ("key", json!(format!("t{}-s{}", session.tenant, s))),
            ("messages", Value::Array(messages)),
            ("output_tokens", json!(self.output_tokens)),
        ])
    }

    /// Every trace line, in send order.
    pub fn lines(&self) -> impl Iterator<Item = String> + '_ {
        self.schedule()
            .into_iter()
            .map(|(t, s, k)| self.line(t, s, k))
    }

    /// Writes the trace as JSONL.
    pub fn write<W: Write>(&self, w: &mut W) -> io::Result<()> {
        for line in self.lines() {
            w.write_all(line.as_bytes())?;
            w.write_all(b"\n")?;
        }
        w.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{self, Prompt};
    use std::collections::HashMap;

    fn small() -> Config {
        Config {
            sessions: 30,
            system_tokens: 50,
            user_tokens: 10,
            output_tokens: 6,
            max_turns: 5,
            ..Config::default()
        }
    }

    fn render(cfg: &Config) -> Vec<u8> {
        let mut out = Vec::new();
        generate(cfg).write(&mut out).expect("write to memory");
        out
    }

    #[test]
    fn deterministic_per_seed() {
        let cfg = small();
        assert_eq!(render(&cfg), render(&cfg));
        let other = Config { seed: 2, ..small() };
        assert_ne!(render(&cfg), render(&other));
    }

    #[test]
    fn output_is_a_valid_sorted_trace() {
        let out = render(&small());
        let reqs = trace::read(out.as_slice()).expect("synth output parses");
        let lines = out.iter().filter(|&&b| b == b'\n').count();
        assert_eq!(reqs.len(), lines);
        assert!(reqs.len() >= 30, "at least one turn per session");
        // Already in time order: reading did not reorder.
        assert!(reqs.windows(2).all(|w| w[0].line < w[1].line));
        assert!(reqs.iter().all(|r| r.output_tokens == 6));
    }

    #[test]
    fn turns_grow_by_prefix() {
        let reqs = trace::read(render(&small()).as_slice()).expect("parses");
        let mut by_key: HashMap<String, Vec<Vec<Value>>> = HashMap::new();
        for r in reqs {
            let Prompt::Messages(m) = r.prompt else {
                panic!("chat expected")
            };
            by_key.entry(r.key.expect("key")).or_default().push(m);
        }
        let mut multi_turn = 0;
        for (key, turns) in &by_key {
            for (k, pair) in turns.windows(2).enumerate() {
                let (prev, next) = (&pair[0], &pair[1]);
                assert_eq!(next.len(), prev.len() + 2, "{key} turn {k}");
                assert_eq!(&next[..prev.len()], prev.as_slice(), "{key} turn {k}");
                assert_eq!(next[prev.len()]["role"], "assistant");
                assert_eq!(
                    next[prev.len()]["content"].as_str().map(str::len),
                    Some(6 * 4)
                );
                multi_turn += 1;
            }
            let system = turns[0][0]["content"].as_str().expect("system");
            assert_eq!(system.len(), 50 * 4);
            let user = turns[0][1]["content"].as_str().expect("user").len();
            assert!((5 * 4..=15 * 4).contains(&user), "{user}");
        }
        assert!(multi_turn > 0, "some session has several turns");
    }

    #[test]
    fn tenants_and_sessions_differ() {
        let w = generate(&small());
        assert_eq!(w.system.len(), 4);
        for (i, a) in w.system.iter().enumerate() {
            for b in &w.system[i + 1..] {
                assert_ne!(a, b);
            }
        }
        let first_user: Vec<&String> = w.sessions.iter().map(|s| &s.user[0]).collect();
        for (i, a) in first_user.iter().enumerate() {
            assert!(first_user[i + 1..].iter().all(|b| b != a));
        }
        // Zipf: tenant 0 is the most popular.
        let count = |t| w.sessions.iter().filter(|s| s.tenant == t).count();
        assert!(count(0) >= count(3));
    }
}
