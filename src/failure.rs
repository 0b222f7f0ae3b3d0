//! What an answer (or its absence) says about the rank that served a request, and what the filter
//! does about it. The rule keeps clients from faking a rank's failure:
//!
//! - Only evidence the rank itself is failing cools it down for everyone: Envoy's own answer
//!   that the rank could not be reached (no connection could be made, no healthy upstream) at
//!   once — not the cluster's circuit breaker or a stream refused for lack of room, which say it
//!   is busy; the rank's own 5xx, its reset of the stream or the connection before the
//!   response, Envoy's upstream time-outs and an answer the rank cut short, only once
//!   `assign.failure_threshold` different requests got one within
//!   `assign.failure_window_seconds` (strikes), and each request the rank serves (2xx) cancels
//!   one. These are strikes, not proof: a client that holds its own request open (a body it
//!   never finishes) can make a time-out happen, a client can make an engine answer 500 (a bad
//!   parameter) or drop its connection on a rank the filter chose, a client that stops reading
//!   a long streamed answer lets Envoy's idle timer run out on it, and a healthy engine closes
//!   a kept-alive connection just as Envoy reuses it now and then. Cancelled by what the rank
//!   serves, such strikes cool down only a rank that serves less than it fails.
//! - A request whose rank the client chose (explicit rank, bootstrap room) never counts: a
//!   client can make an engine answer 500 (a bad parameter) on any rank it names.
//! - A single failure, of any kind, unpins only the routing key of the request that got it.
//! - The prompt's chain is kept in the prefix index only when the rank answered 2xx: it then
//!   computed the prompt. (The filter records a chain as soon as it places the request, so the
//!   conversation's next turn finds it even while this one is still being computed; any other
//!   answer withdraws what this request added, and only that.) Other index entries pointing at a
//!   rank are removed only on evidence that the rank failed.

/// How a request ended, as the filter sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// 2xx: the rank served the prompt.
    Served,
    /// Any other status below 500 (400, 413, 429, …): the request, not the rank.
    Refused,
    /// A 5xx the rank itself sent (`response.code_details` is `via_upstream`).
    RankError,
    /// Envoy's own 5xx because the rank could not be reached.
    RankUnreachable,
    /// Envoy's own 5xx because the rank did not answer in time.
    RankTimeout,
    /// Envoy's own 5xx because the rank closed the connection or reset the stream before
    /// answering ([`DROPPED`]).
    RankDropped,
    /// Envoy's own 5xx for another reason (overload, the cluster's circuit breaker, a stream the
    /// rank refused for lack of room, …): not proof the rank is failing.
    ProxyError,
    /// The stream ended with no response at all (client gone, stream reset).
    Unanswered,
    /// A 2xx the rank stopped short of its end: Envoy timed the stream out, or the rank reset
    /// it, after the response had started ([`cut_by_rank`]). A streamed answer's status is sent
    /// with its first event, so this is how a rank that hangs or dies mid-answer shows.
    Cut,
}

/// Envoy's `response.code_details` for answers the upstream sent.
const VIA_UPSTREAM: &[u8] = b"via_upstream";

/// Envoy's `response.code_details` when no endpoint of the rank's cluster is healthy.
const NO_HEALTHY_UPSTREAM: &[u8] = b"no_healthy_upstream";

/// Envoy's `response.code_details` when the route names a cluster Envoy does not have: for a
/// rank the filter chose, its cluster (`target.cluster_template`) is missing from Envoy's
/// configuration (`dp_size` above the clusters defined). No client can cause it: the filter
/// removes a client's copy of the cluster header.
const CLUSTER_NOT_FOUND: &[u8] = b"cluster_not_found";

/// Envoy's `response.code_details` for an upstream stream reset before any response, followed by
/// `{reason}` (and, for a connect failure, the transport's own reason after it).
const RESET_BEFORE_RESPONSE: &[u8] = b"upstream_reset_before_response_started{";

/// The reset reasons (Envoy's names, spaces as `_`) that say the rank could not be reached: no
/// connection to it could be made. No client can cause them.
const CONNECT_FAILURES: [&[u8]; 4] = [
    b"connection_failure", // older Envoy: one reason for both sides
    b"local_connection_failure",
    b"remote_connection_failure",
    b"connection_timeout",
];

/// The reset reasons that say the rank dropped the exchange: closed the connection or reset the
/// stream. A failing engine does that, but so does a healthy one closing a kept-alive connection
/// just as Envoy reuses it (uvicorn, which serves SGLang and vLLM, closes idle connections after
/// 5 s; Envoy keeps them an hour), and one dropping a request it will not read (too large, not
/// HTTP it accepts). Evidence, not proof.
const DROPPED: [&[u8]; 3] = [
    b"connection_termination",
    b"remote_reset",
    b"protocol_error",
];

// The other reasons say nothing against the rank: `overflow` is the cluster's circuit breaker (the
// rank is busy, and a client holding many requests on a rank it names could trip it),
// `remote_refused_stream_reset` the rank declining a stream it has no room for, and the local
// resets and `overload_manager_reset` are Envoy's own doing.

/// Envoy's `response.code_details` for an upstream stream reset after the response started
/// (the status already sent), followed by `{reason}` as [`RESET_BEFORE_RESPONSE`].
const RESET_AFTER_RESPONSE: &[u8] = b"upstream_reset_after_response_started{";

/// Whether `details` say the rank could not be reached: no healthy endpoint, no such cluster,
/// or no connection (see [`CONNECT_FAILURES`]).
fn unreachable(details: &[u8]) -> bool {
    [NO_HEALTHY_UPSTREAM, CLUSTER_NOT_FOUND]
        .iter()
        .any(|p| details.starts_with(p))
        || reset_for(details, RESET_BEFORE_RESPONSE, &CONNECT_FAILURES)
}

/// Whether `details` are `prefix{reason…}` with `reason` one of `reasons`.
fn reset_for(details: &[u8], prefix: &[u8], reasons: &[&[u8]]) -> bool {
    let Some(reason) = details.strip_prefix(prefix) else {
        return false;
    };
    // The reason ends at `}`, or at `|` / `,` before the transport's detail.
    let end = reason
        .iter()
        .position(|&c| matches!(c, b'}' | b'|' | b','))
        .unwrap_or(reason.len());
    reason.get(..end).is_some_and(|r| reasons.contains(&r))
}

/// Whether `details` name one of Envoy's upstream time-outs ([`TIMED_OUT`]).
fn timed_out(details: &[u8]) -> bool {
    TIMED_OUT.iter().any(|p| details.starts_with(p))
}

/// Whether `details` (of a stream whose 2xx answer never reached its end) say the rank stopped
/// short of it: Envoy's upstream time-outs, or the rank's reset of the stream or the connection
/// ([`DROPPED`]). Not a client that left (`downstream_remote_disconnect`, …), which is its own
/// doing.
pub fn cut_by_rank(details: &[u8]) -> bool {
    timed_out(details) || reset_for(details, RESET_AFTER_RESPONSE, &DROPPED)
}

/// Prefixes of Envoy's `response.code_details` for an upstream that did not answer in time.
/// The route's time-out is `response_timeout` (Envoy 1.40 writes nothing else for it; its docs
/// still list the older `upstream_response_timeout`, kept for older Envoys).
const TIMED_OUT: [&[u8]; 5] = [
    b"response_timeout",
    b"upstream_response_timeout",
    b"upstream_per_try_timeout",
    b"upstream_per_try_idle_timeout",
    b"upstream_max_stream_duration_reached",
];

/// Classifies a response from its status and `response.code_details` (`None`: not read — the
/// host reads it only for a 5xx, or it was unavailable, which counts as the rank's own answer).
/// A missing status (0) is treated as a 5xx.
pub fn classify(status: u64, details: Option<&[u8]>) -> Answer {
    match status {
        200..=299 => Answer::Served,
        0 | 500..=599 => match details {
            None => Answer::RankError,
            Some(d) if d == VIA_UPSTREAM => Answer::RankError,
            Some(d) if unreachable(d) => Answer::RankUnreachable,
            Some(d) if reset_for(d, RESET_BEFORE_RESPONSE, &DROPPED) => Answer::RankDropped,
            Some(d) if timed_out(d) => Answer::RankTimeout,
            Some(_) => Answer::ProxyError,
        },
        _ => Answer::Refused,
    }
}

/// The HTTP status a gRPC status stands for, as Envoy maps them (`grpcToHttpStatus`): a gRPC
/// answer is a `200` whose `grpc-status` says how it went, and Envoy's own failure answers to a
/// gRPC request (no connection, no healthy upstream, a time-out) are such `200`s too.
pub fn grpc_as_http(grpc_status: u64) -> u64 {
    // Indexed by gRPC status (0 OK … 16 UNAUTHENTICATED); any other is UNKNOWN's.
    const HTTP: [u16; 17] = [
        200, 499, 500, 400, 504, 404, 409, 403, 429, 400, 409, 400, 501, 500, 503, 500, 401,
    ];
    let status = usize::try_from(grpc_status).ok().and_then(|i| HTTP.get(i));
    u64::from(status.copied().unwrap_or(500))
}

/// Who chose the rank a request went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chooser {
    /// The client: an explicit rank, a bootstrap room.
    Client,
    /// The filter: a pin, a prefix match, an assigner.
    Filter,
}

/// What to do after a request ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Remove this request's own key pin (the next turn is placed afresh).
    pub unpin_key: bool,
    /// Cool the rank down now.
    pub cool_down: bool,
    /// Count one strike against the rank (cool-down after several within the window).
    pub strike: bool,
    /// Cancel one strike counted against the rank: it served the request.
    pub forgive_strike: bool,
    /// Keep the prompt's chain in the index under the rank (record it, if it is not yet);
    /// otherwise what this request added to the index is withdrawn.
    pub record_prefix: bool,
    /// Remove the index entries of this prompt that point at the rank.
    pub forget_prefix: bool,
}

/// The rule of the module doc, as a table.
pub fn judge(answer: Answer, chooser: Chooser) -> Verdict {
    let filter_chose = chooser == Chooser::Filter;
    match answer {
        Answer::Served => Verdict {
            record_prefix: true,
            // As with strikes, only the filter's choices count: a client naming a rank could
            // otherwise keep a failing rank in use with requests it knows succeed.
            forgive_strike: filter_chose,
            ..Verdict::default()
        },
        Answer::Refused => Verdict::default(),
        Answer::RankError | Answer::RankTimeout | Answer::RankDropped => Verdict {
            unpin_key: true,
            strike: filter_chose,
            ..Verdict::default()
        },
        Answer::RankUnreachable => Verdict {
            unpin_key: true,
            cool_down: filter_chose,
            forget_prefix: filter_chose,
            ..Verdict::default()
        },
        // The rank computed the prompt (its answer had started): the chain stays.
        Answer::Cut => Verdict {
            unpin_key: true,
            strike: filter_chose,
            record_prefix: true,
            ..Verdict::default()
        },
        Answer::ProxyError | Answer::Unanswered => Verdict {
            unpin_key: true,
            ..Verdict::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_classified_by_status_and_envoys_details() {
        for (status, details, want) in [
            (200, None, Answer::Served),
            (204, None, Answer::Served),
            (400, None, Answer::Refused),
            (
                413,
                Some(&b"request_payload_too_large"[..]),
                Answer::Refused,
            ),
            (429, None, Answer::Refused),
            (301, None, Answer::Refused),
            (500, Some(&b"via_upstream"[..]), Answer::RankError),
            (503, Some(&b"via_upstream"[..]), Answer::RankError),
            (500, None, Answer::RankError),
            (
                503,
                Some(&b"upstream_reset_before_response_started{connection_failure}"[..]),
                Answer::RankUnreachable,
            ),
            (
                503,
                Some(&b"upstream_reset_before_response_started{remote_reset}"[..]),
                Answer::RankDropped,
            ),
            (
                503,
                Some(&b"no_healthy_upstream"[..]),
                Answer::RankUnreachable,
            ),
            (
                503,
                Some(&b"upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}"[..]),
                Answer::RankUnreachable,
            ),
            (
                503,
                Some(&b"upstream_reset_before_response_started{connection_termination}"[..]),
                Answer::RankDropped,
            ),
            (
                503,
                Some(&b"upstream_reset_before_response_started{connection_failure,delayed_connect_error:_111}"[..]),
                Answer::RankUnreachable,
            ),
            (
                503,
                Some(&b"upstream_reset_before_response_started{protocol_error}"[..]),
                Answer::RankDropped,
            ),
            (
                503,
                Some(&b"upstream_reset_before_response_started{connection_timeout}"[..]),
                Answer::RankUnreachable,
            ),
            // Busy, not broken: the cluster's circuit breaker, a stream refused for lack of room.
            (
                503,
                Some(&b"upstream_reset_before_response_started{overflow}"[..]),
                Answer::ProxyError,
            ),
            (
                503,
                Some(&b"upstream_reset_before_response_started{remote_refused_stream_reset}"[..]),
                Answer::ProxyError,
            ),
            (
                503,
                Some(&b"upstream_reset_before_response_started{overload_manager_reset}"[..]),
                Answer::ProxyError,
            ),
            (
                503,
                Some(&b"upstream_reset_before_response_started{remote_reset_is_not_a_reason}"[..]),
                Answer::ProxyError,
            ),
            (503, Some(&b"upstream_reset_before_response_started"[..]), Answer::ProxyError),
            (504, Some(&b"response_timeout"[..]), Answer::RankTimeout),
            (
                504,
                Some(&b"upstream_response_timeout"[..]),
                Answer::RankTimeout,
            ),
            (
                504,
                Some(&b"upstream_per_try_idle_timeout"[..]),
                Answer::RankTimeout,
            ),
            (503, Some(&b"overload"[..]), Answer::ProxyError),
            // The rank's cluster is missing from Envoy's configuration: nothing reaches it.
            (503, Some(&b"cluster_not_found"[..]), Answer::RankUnreachable),
            (500, Some(&b""[..]), Answer::ProxyError),
            (0, None, Answer::RankError),
        ] {
            assert_eq!(classify(status, details), want, "{status} {details:?}");
        }
    }

    /// A 2xx whose stream never reached its end: the rank's doing, or the client's.
    #[test]
    fn an_answer_cut_short_is_read_from_envoys_details() {
        for (details, want) in [
            (&b"upstream_per_try_idle_timeout"[..], true),
            (b"response_timeout", true),
            (b"upstream_response_timeout", true),
            (b"upstream_reset_after_response_started{remote_reset}", true),
            (
                b"upstream_reset_after_response_started{connection_termination}",
                true,
            ),
            (
                b"upstream_reset_after_response_started{protocol_error}",
                true,
            ),
            (b"upstream_reset_after_response_started{local_reset}", false),
            (b"upstream_reset_after_response_started{overflow}", false),
            (
                b"upstream_reset_before_response_started{remote_reset}",
                false,
            ),
            (b"downstream_remote_disconnect", false),
            (b"stream_idle_timeout", false),
            (b"via_upstream", false),
            (b"", false),
        ] {
            assert_eq!(
                cut_by_rank(details),
                want,
                "{:?}",
                String::from_utf8_lossy(details)
            );
        }
    }

    #[test]
    fn only_the_filters_choices_count_against_a_rank() {
        use Answer::*;
        use Chooser::*;
        let v = |unpin_key, cool_down, strike, record_prefix, forget_prefix| Verdict {
            unpin_key,
            cool_down,
            strike,
            forgive_strike: false,
            record_prefix,
            forget_prefix,
        };
        let served = Verdict {
            forgive_strike: true,
            ..v(false, false, false, true, false)
        };
        for (answer, chooser, want) in [
            (Served, Filter, served),
            (Served, Client, v(false, false, false, true, false)),
            (Refused, Filter, v(false, false, false, false, false)),
            (RankError, Filter, v(true, false, true, false, false)),
            (RankError, Client, v(true, false, false, false, false)),
            (RankTimeout, Filter, v(true, false, true, false, false)),
            (RankTimeout, Client, v(true, false, false, false, false)),
            (RankDropped, Filter, v(true, false, true, false, false)),
            (RankDropped, Client, v(true, false, false, false, false)),
            (RankUnreachable, Filter, v(true, true, false, false, true)),
            (RankUnreachable, Client, v(true, false, false, false, false)),
            (ProxyError, Filter, v(true, false, false, false, false)),
            (Unanswered, Filter, v(true, false, false, false, false)),
            (Unanswered, Client, v(true, false, false, false, false)),
            (Cut, Filter, v(true, false, true, true, false)),
            (Cut, Client, v(true, false, false, true, false)),
        ] {
            assert_eq!(judge(answer, chooser), want, "{answer:?} {chooser:?}");
        }
    }
}
