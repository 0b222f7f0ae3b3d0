//! Request and response header handling over arbitrary header lists: `HeaderFacts::collect`,
//! `decide_headers`, `rank_from_header`, `ResponseFacts::collect`.
//!
//! Input: the first byte picks a configuration; the rest is split into lines, one header each.
//! A line starting with a byte below 0x10 uses a known header name (so the interesting headers
//! appear often) and the rest of the line as the value; any other line is `name:value` (raw
//! bytes, no trimming, so names and values may hold anything).

#![no_main]

mod common;

use dp_affinity::decide::{decide_headers, HeaderStep};
use dp_affinity::extract::{rank_from_header, HeaderFacts, ResponseFacts};
use libfuzzer_sys::fuzz_target;

const KNOWN: [&[u8]; 11] = [
    b"x-router-token",
    b"x-data-parallel-rank",
    b"X-Routing-Key",
    b"x-smg-routing-key",
    b"content-type",
    b"content-length",
    b"x-dp-affinity-cluster",
    b"x-dp-rank",
    b":status",
    b"x-session-id",
    b"CONTENT-TYPE",
];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let configs = common::configs();
    let cfg = &configs[usize::from(pick) % configs.len()];
    let mut headers: Vec<(&[u8], &[u8])> = Vec::new();
    for line in rest.split(|&c| c == b'\n') {
        match line.split_first() {
            Some((&k, value)) if k < 0x10 => {
                headers.push((KNOWN[usize::from(k) % KNOWN.len()], value))
            }
            _ => {
                let at = line.iter().position(|&c| c == b':').unwrap_or(line.len());
                headers.push((&line[..at], line.get(at + 1..).unwrap_or(&[])));
            }
        }
    }

    let facts = HeaderFacts::collect(cfg, headers.iter().copied());
    let _ = facts.is_json(cfg);
    let _ = facts.declared_length();
    if let Some((prio, key)) = facts.key {
        assert!(prio < cfg.key.headers.len());
        assert!(!key.is_empty());
    }
    for end_of_stream in [false, true] {
        if let HeaderStep::Decided(d) = decide_headers(cfg, &facts, end_of_stream) {
            common::check_decision(cfg, &d);
        }
    }
    for (_, value) in &headers {
        match rank_from_header(cfg, value) {
            Ok(r) => assert!(r < cfg.dp_size),
            // The value is cut to 64 bytes before quoting; Debug escapes may still grow each
            // byte up to `\u{...}` (a 64-byte run of control bytes gives ~390 characters).
            Err(e) => assert!(e.problem.len() < 1024, "error message stays bounded"),
        }
    }
    let response = ResponseFacts::collect(cfg, headers.iter().copied());
    if let Some(r) = response.reported_rank {
        assert!(r < cfg.dp_size);
    }
    let _ = response.served();
});
