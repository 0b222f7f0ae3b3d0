//! Choosing a rank for a request the table does not decide: rendezvous hashing with bounded load,
//! least in-flight, round robin, and SGLang's bootstrap-room rule.
//!
//! All functions are pure over a snapshot of the shared rank state (`RankStates`), so every Envoy
//! replica with the same configuration computes the same rendezvous order without talking to the
//! others; only the load bound depends on the replica's own view of in-flight requests.

use crate::hash::fmix64;
use crate::ranks::RankStates;

/// How a new key (or a keyless request) is placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Envoy's load balancer picks; the filter learns the rank from the response.
    Envoy,
    /// Rendezvous hash of the key over usable ranks, bounded by load.
    Hash,
    /// The usable rank with the fewest requests in flight.
    LeastInflight,
    /// Usable ranks in turn.
    RoundRobin,
    /// `bootstrap_room % dp_size` from the body (SGLang PD); other requests as `LeastInflight`.
    BootstrapRoom,
}

/// Rendezvous weight of `rank` for `key`: the highest weight wins. Depends only on the seed, the
/// key hash and the rank, so removing a rank moves only the keys whose winner it was.
pub fn weight(seed: u64, key: u64, rank: u32) -> u64 {
    let rank_id = fmix64(seed ^ (u64::from(rank) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    fmix64(key ^ rank_id)
}

/// The load bound of a placement: a rank is full at `max(floor, ceil(factor × (total + 1) /
/// usable))` requests in flight (the `+ 1` counts the request being placed).
///
/// The floor matters on a quiet cluster: with one request in flight the bare formula gives a
/// capacity of 1, so a second turn of the same conversation (or a key next to one long
/// generation) would leave its cached rank for an idle one. An engine batches many requests;
/// a handful in flight is not "full".
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    pub factor: f64,
    pub floor: u32,
}

impl Bound {
    pub fn capacity(&self, total: u64, usable: u32) -> u64 {
        if usable == 0 {
            return 0;
        }
        let cap = (self.factor * (total + 1) as f64 / f64::from(usable)).ceil();
        let cap = if cap.is_finite() && cap >= 1.0 {
            cap as u64
        } else {
            1
        };
        cap.max(u64::from(self.floor))
    }
}

/// The rendezvous choice among usable ranks that are not full under `bound`; when every usable
/// rank is full (only possible with a factor below 1), the top of the order. `None` if no rank is
/// usable.
pub fn choose_hash(
    states: &RankStates,
    now: u32,
    seed: u64,
    key: u64,
    bound: Bound,
) -> Option<u32> {
    let (total, usable) = states.usable_load(now);
    let cap = bound.capacity(total, usable);
    let mut best: Option<(u64, u32)> = None; // (weight, rank) among non-full ranks
    let mut top: Option<(u64, u32)> = None; // among all usable ranks
    for rank in 0..states.ranks.len() as u32 {
        if !states.usable(rank, now) {
            continue;
        }
        let w = weight(seed, key, rank);
        if top.is_none_or(|(tw, _)| w > tw) {
            top = Some((w, rank));
        }
        if u64::from(states.inflight(rank)) < cap && best.is_none_or(|(bw, _)| w > bw) {
            best = Some((w, rank));
        }
    }
    best.or(top).map(|(_, r)| r)
}

/// A request's home and why it is that rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Home {
    pub rank: u32,
    pub by: HomeBy,
}

/// Why a home is the rank it is. Behind several Envoy replicas, each reason but `Preferred`
/// rests on one replica's view of the load, so a conversation's turns placed by different
/// replicas can land on different ranks for it; the `dp_affinity.home_*` counters say how often.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HomeBy {
    /// The assigner's first choice: the top usable rank of the rendezvous order (`hash`), or
    /// the least loaded / next rank (the other modes, which have no second choice).
    Preferred,
    /// The second of the two: the first was given clearly more work lately.
    SecondLessWork,
    /// The second of the two: a queue is forming on the first.
    SecondQueue,
    /// Not the top usable rank of the rendezvous order: that one is full under the bound.
    PreferredFull,
}

/// The home of `key`: the highest-weighted usable rank that is not full under `bound`, unless
/// the second-highest was given clearly less work lately (see [`clearly_less_work`]) or a queue
/// is forming on the first (see [`queue_forming`]): "power of two choices" over the rendezvous
/// order, with margins. Every replica considers the same two
/// ranks for a key; the margin makes them pick the same one unless the work they saw differs by
/// more than their samples of the traffic explain, while the second choice keeps the rank that
/// happened to get the long conversations from running hot. Falls back like [`choose_hash`]
/// when fewer than two ranks qualify. Says why it chose the rank it did (see [`HomeBy`]).
pub fn home_of_two(
    states: &RankStates,
    now: u32,
    seed: u64,
    key: u64,
    bound: Bound,
    blocks: u32,
) -> Option<Home> {
    let (total, usable) = states.usable_load(now);
    let cap = bound.capacity(total, usable);
    let not_full = |rank| states.usable(rank, now) && u64::from(states.inflight(rank)) < cap;
    let home = match top_two(states, seed, key, not_full) {
        [Some(first), Some(second)] => {
            if clearly_less_work(states.recent(first), states.recent(second), blocks) {
                Home {
                    rank: second,
                    by: HomeBy::SecondLessWork,
                }
            } else if queue_forming(states.inflight(first), states.inflight(second)) {
                Home {
                    rank: second,
                    by: HomeBy::SecondQueue,
                }
            } else {
                Home {
                    rank: first,
                    by: HomeBy::Preferred,
                }
            }
        }
        _ => Home {
            rank: choose_hash(states, now, seed, key, bound)?,
            by: HomeBy::Preferred,
        },
    };
    // Only a full rank puts a home below the top of the order, and at ordinary loads none is:
    // the order is then not walked again (a hash per rank, on every placement).
    let full = |rank| states.usable(rank, now) && !not_full(rank);
    if !(0..states.ranks.len() as u32).any(full) {
        return Some(home);
    }
    // Every rank full leaves the top of the order (`choose_hash`): still the preferred one.
    let [top, _] = rendezvous_pair(states, now, seed, key);
    Some(match top {
        Some(top) if top != home.rank && !not_full(top) => Home {
            by: HomeBy::PreferredFull,
            ..home
        },
        _ => home,
    })
}

/// The two highest-weighted usable ranks of `key`, whatever their load: the ranks
/// [`home_of_two`] chooses between when neither is full.
pub fn rendezvous_pair(states: &RankStates, now: u32, seed: u64, key: u64) -> [Option<u32>; 2] {
    top_two(states, seed, key, |rank| states.usable(rank, now))
}

/// The two highest-weighted ranks of `key` among those `eligible` says yes to, highest first.
fn top_two(
    states: &RankStates,
    seed: u64,
    key: u64,
    eligible: impl Fn(u32) -> bool,
) -> [Option<u32>; 2] {
    let mut two: [Option<(u64, u32)>; 2] = [None, None];
    for rank in (0..states.ranks.len() as u32).filter(|&r| eligible(r)) {
        let w = weight(seed, key, rank);
        if two[0].is_none_or(|(tw, _)| w > tw) {
            two = [Some((w, rank)), two[0]];
        } else if two[1].is_none_or(|(sw, _)| w > sw) {
            two[1] = Some((w, rank));
        }
    }
    two.map(|t| t.map(|(_, r)| r))
}

/// More requests in flight on the first rank than on the second by this many and more: a queue is
/// forming there now, and a new conversation placed on it waits behind it. Each Envoy replica
/// counts only the requests it sent, so behind two replicas a small margin fires on one replica's
/// half of the traffic and not on the other's, and a conversation's later turn, placed by the
/// replica that has not seen it, goes to the other of its two ranks. Measured at 80 % load
/// (`scripts/bench-affinity.py --suite kv`, a public Mooncake trace and three kv traces): a
/// margin of 4 instead of 2 kept +0.025 to +0.032 × oracle more of the hits behind two replicas
/// on four of the five (−0.004 on the fifth) and cost 0–15 % of TTFB p90 on one.
pub const QUEUE_MARGIN: u32 = 4;

/// Whether the first of a key's two ranks has a queue forming that the second has not: more than
/// [`QUEUE_MARGIN`] requests in flight beyond the second's. Recent work says which rank was given
/// more over the last seconds; this says which one is busier now, which is what a first token
/// waits for. Measured at 80 % load (`scripts/bench-affinity.py --suite kv`, margin 2 against
/// none): TTFB p90 on 4 ranks 671 → 555 ms, hit rate unchanged.
pub fn queue_forming(first: u32, second: u32) -> bool {
    first > second.saturating_add(QUEUE_MARGIN)
}

/// Whether a rank given `second` blocks of work lately was given clearly less than one given
/// `first`, for a request of `blocks` blocks: the difference exceeds the request itself (after
/// taking it, the second would still have less) plus the difference that sampling alone
/// produces, `sqrt((first + second) × blocks)` — about what two ranks that were given the same
/// share of requests of this size differ by. Each Envoy replica (and worker) sees only its sample
/// of the traffic; below that margin their views disagree on which rank is idler as often as
/// not, above it they agree, and a rank that really got more (long conversations) loses new ones.
///
/// The noise is taken at [`NOISE_FLOOR_BLOCKS`] at least: see there.
pub fn clearly_less_work(first: u32, second: u32, blocks: u32) -> bool {
    let Some(excess) = first
        .checked_sub(second)
        .and_then(|d| d.checked_sub(blocks))
    else {
        return false;
    };
    let excess = u128::from(excess);
    let noise_blocks = u128::from(blocks.max(NOISE_FLOOR_BLOCKS));
    excess * excess > (u128::from(first) + u128::from(second)) * noise_blocks
}

/// The request size below which [`clearly_less_work`] takes the sampling noise as if the request
/// were this large (16 blocks: 8 KiB with the default 512-byte blocks). The ranks' recent work is
/// made of requests of every size; a request of a block or two, taken at its own size, would see
/// ordinary sampling differences as clear ones, and a chat of short turns (no system prompt)
/// would get a different home on every turn until one is recorded, and on each replica. Such a
/// request cannot even out what the ranks differ by anyway. Measured (`BENCH_CHAT_SYSTEM_TOKENS=0
/// scripts/bench-affinity.py --suite prefix --ranks 4 --policies filter-shipped`): behind two
/// replicas 0.925 → 0.970 × oracle, one 0.989 → 0.990 × with TTFB p90 222 → 208 ms.
pub const NOISE_FLOOR_BLOCKS: u32 = 16;

/// Whether a key pinned to `rank` stays there: the rank is usable and its load is under the
/// looser bound (default factor 2 × mean). Above it, the key moves (once: its new rank is then below).
pub fn keep_pin(states: &RankStates, now: u32, rank: u32, bound: Bound) -> bool {
    if !states.usable(rank, now) {
        return false;
    }
    let (total, usable) = states.usable_load(now);
    u64::from(states.inflight(rank)) < bound.capacity(total, usable)
}

/// Every rank once, from `start` on (modulo the rank count). `start` is a turn counter that
/// wraps: reducing it first keeps the order a rotation at the wrap too (added first, a count not a
/// power of two would visit one rank twice there and skip another).
fn ranks_from(n: u32, start: u32) -> impl Iterator<Item = u32> {
    let first = start.checked_rem(n).unwrap_or(0);
    (0..n).map(move |i| (first + i) % n)
}

/// The usable rank with the fewest in flight; ties go to the first at or after `start`, so equal
/// ranks share the work instead of rank 0 taking every tie.
pub fn choose_least_inflight(states: &RankStates, now: u32, start: u32) -> Option<u32> {
    ranks_from(states.ranks.len() as u32, start)
        .filter(|&r| states.usable(r, now))
        .min_by_key(|&r| states.inflight(r))
}

/// The first usable rank at or after `counter` that is not full under `bound` (as a new key's
/// rank is bounded in every other mode: a pin or a prefix match moved off a full rank must not
/// land on it again); when every usable rank is full (only possible with a factor below 1), the
/// first usable one.
pub fn choose_round_robin(
    states: &RankStates,
    now: u32,
    counter: u32,
    bound: Bound,
) -> Option<u32> {
    let n = states.ranks.len() as u32;
    let (total, usable) = states.usable_load(now);
    let cap = bound.capacity(total, usable);
    let mut usable_ranks = ranks_from(n, counter).filter(|&r| states.usable(r, now));
    let first = usable_ranks.next()?;
    let not_full = |r: &u32| u64::from(states.inflight(*r)) < cap;
    Some(
        std::iter::once(first)
            .chain(usable_ranks)
            .find(not_full)
            .unwrap_or(first),
    )
}

/// SGLang's PD rule: the prefill and decode legs of one request agree without a lookup. Down
/// ranks are not skipped: skipping on one leg only would split the pair.
pub fn room_rank(room: u64, dp_size: u32) -> u32 {
    (room % u64::from(dp_size.max(1))) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ranks::RankLoad;

    fn idle(n: usize) -> RankStates {
        RankStates {
            ranks: vec![RankLoad::default(); n],
        }
    }

    fn with_load(loads: &[u32]) -> RankStates {
        RankStates {
            ranks: loads
                .iter()
                .map(|&inflight| RankLoad {
                    inflight,
                    recent: 0,
                    down_until: 0,
                })
                .collect(),
        }
    }

    /// A bound that never binds: the pure rendezvous distribution.
    const FREE: Bound = Bound {
        factor: 1e9,
        floor: 0,
    };

    fn bound(factor: f64) -> Bound {
        Bound { factor, floor: 0 }
    }

    fn keys(n: u64) -> impl Iterator<Item = u64> {
        let h = crate::hash::KeyedHasher::from_seed(b"");
        (0..n).map(move |i| h.hash(format!("conversation-{i}").as_bytes()))
    }

    #[test]
    fn rendezvous_spreads_keys_evenly() {
        for n in [4usize, 8, 16] {
            let states = idle(n);
            let mut per_rank = vec![0u32; n];
            for k in keys(100_000) {
                let r = choose_hash(&states, 0, 7, k, FREE).unwrap();
                per_rank[r as usize] += 1;
            }
            let max = *per_rank.iter().max().unwrap() as f64;
            let mean = 100_000.0 / n as f64;
            assert!(
                max / mean <= 1.10,
                "{n} ranks: {per_rank:?}, max/mean {}",
                max / mean
            );
        }
    }

    #[test]
    fn removing_a_rank_moves_only_its_keys() {
        let mut states = idle(8);
        let before: Vec<u32> = keys(20_000)
            .map(|k| choose_hash(&states, 0, 1, k, FREE).unwrap())
            .collect();
        states.ranks[3].down_until = 100;
        let mut moved = 0;
        for (k, was) in keys(20_000).zip(&before) {
            let now = choose_hash(&states, 50, 1, k, FREE).unwrap();
            if *was == 3 {
                assert_ne!(now, 3);
                moved += 1;
            } else {
                assert_eq!(now, *was, "a key of another rank moved");
            }
        }
        assert!(moved > 0);
        // Back after the cool-down: the same keys return.
        for (k, was) in keys(20_000).zip(&before) {
            assert_eq!(choose_hash(&states, 100, 1, k, FREE).unwrap(), *was);
        }
    }

    #[test]
    fn seeds_change_the_order_but_replicas_agree() {
        let states = idle(8);
        let a: Vec<u32> = keys(1000)
            .map(|k| choose_hash(&states, 0, 1, k, FREE).unwrap())
            .collect();
        let b: Vec<u32> = keys(1000)
            .map(|k| choose_hash(&states, 0, 1, k, FREE).unwrap())
            .collect();
        let c: Vec<u32> = keys(1000)
            .map(|k| choose_hash(&states, 0, 2, k, FREE).unwrap())
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn bounded_load_skips_full_ranks() {
        // 4 ranks, 12 in flight: cap = ceil(1.25 × 13 / 4) = 5.
        assert_eq!(bound(1.25).capacity(12, 4), 5);
        assert_eq!(
            Bound {
                factor: 1.25,
                floor: 8
            }
            .capacity(12, 4),
            8
        );
        let k = keys(1).next().unwrap();
        let first = choose_hash(&idle(4), 0, 0, k, bound(1.25)).unwrap();
        let mut loads = [2u32; 4];
        loads[first as usize] = 5;
        loads[(first as usize + 1) % 4] = 3;
        let states = with_load(&loads);
        let second = choose_hash(&states, 0, 0, k, bound(1.25)).unwrap();
        assert_ne!(second, first, "the full rank is skipped");
        // Under the cap (10 in flight: cap = ceil(1.25 × 11 / 4) = 4), the key's own rank is kept.
        loads[first as usize] = 3;
        assert_eq!(
            choose_hash(&with_load(&loads), 0, 0, k, bound(1.25)),
            Some(first)
        );
    }

    #[test]
    fn pins_move_only_above_the_looser_bound() {
        // 4 ranks, 16 in flight: cap(2.0) = ceil(2 × 17 / 4) = 9.
        let states = with_load(&[8, 4, 2, 2]);
        assert!(keep_pin(&states, 0, 0, bound(2.0)));
        let states = with_load(&[9, 3, 2, 2]);
        assert!(!keep_pin(&states, 0, 0, bound(2.0)));
        let mut down = with_load(&[0, 0, 0, 0]);
        down.ranks[1].down_until = 10;
        assert!(!keep_pin(&down, 5, 1, bound(2.0)));
        assert!(keep_pin(&down, 10, 1, bound(2.0)));
    }

    #[test]
    fn the_floor_keeps_pins_on_a_quiet_cluster() {
        // One request in flight on the pinned rank: without a floor its capacity is 1.
        let states = with_load(&[0, 1, 0, 0]);
        assert!(!keep_pin(&states, 0, 1, bound(2.0)));
        assert!(keep_pin(
            &states,
            0,
            1,
            Bound {
                factor: 2.0,
                floor: 8
            }
        ));
        let k = keys(1).next().unwrap();
        let free = choose_hash(&idle(4), 0, 0, k, FREE).unwrap();
        let mut loads = [0u32; 4];
        loads[free as usize] = 7;
        let floored = Bound {
            factor: 1.25,
            floor: 8,
        };
        assert_eq!(
            choose_hash(&with_load(&loads), 0, 0, k, floored),
            Some(free)
        );
        loads[free as usize] = 8;
        assert_ne!(
            choose_hash(&with_load(&loads), 0, 0, k, floored),
            Some(free)
        );
    }

    #[test]
    fn two_choices_take_the_second_only_when_clearly_idler() {
        let b = Bound {
            factor: 100.0,
            floor: 100,
        };
        let idle = idle(4);
        let mut order: Vec<u32> = (0..4).collect();
        order.sort_by_key(|&r| std::cmp::Reverse(weight(7, 42, r)));
        let (first, second) = (order[0], order[1]);
        let pick = |st: &RankStates, blocks: u32| {
            home_of_two(st, 0, 7, 42, b, blocks).map(|home| home.rank)
        };
        // Idle: the top of the rendezvous order, as choose_hash.
        assert_eq!(pick(&idle, 1), Some(first));
        assert_eq!(choose_hash(&idle, 0, 7, 42, b), Some(first));
        // The top one was given more work lately, but not clearly more: the top stays.
        let mut st = idle.clone();
        st.ranks[first as usize].recent = 150;
        st.ranks[second as usize].recent = 100;
        assert_eq!(pick(&st, 10), Some(first));
        // Clearly more: the second.
        st.ranks[first as usize].recent = 1000;
        assert_eq!(pick(&st, 10), Some(second));
        // A request as large as the difference would leave the second with more: the top.
        assert_eq!(pick(&st, 900), Some(first));
        // A queue forming on the top rank (5 more in flight than the second) sends the request
        // to the second even with equal recent work; 4 more do not.
        let mut queued = idle.clone();
        queued.ranks[first as usize].inflight = 4;
        assert_eq!(pick(&queued, 10), Some(first));
        queued.ranks[first as usize].inflight = 5;
        assert_eq!(pick(&queued, 10), Some(second));
        // The second's own requests in flight do not stop it when it was given clearly less.
        st.ranks[second as usize].inflight = 3;
        assert_eq!(pick(&st, 10), Some(second));
        // …but a rank full under the bound is not a choice: the next in the order is.
        st.ranks[order[2] as usize].recent = 1000;
        st.ranks[order[3] as usize].recent = 1000;
        let tight = Bound {
            factor: 1.0,
            floor: 1,
        };
        assert_eq!(
            home_of_two(&st, 0, 7, 42, tight, 1).map(|home| home.rank),
            Some(first),
            "the second is full and the third was given more work: the top stays"
        );
        // The others' work does not matter.
        st.ranks[second as usize].inflight = 0;
        st.ranks[order[2] as usize].recent = 0;
        assert_eq!(pick(&st, 1), Some(second));
        // One usable rank: that one.
        let mut one = idle.clone();
        for r in &mut one.ranks {
            r.down_until = 10;
        }
        one.ranks[3].down_until = 0;
        assert_eq!(pick(&one, 1), Some(3));
    }

    #[test]
    fn clearly_less_work_is_beyond_the_request_and_the_sampling_noise() {
        // (first, second, blocks, clearly less)
        let rows = [
            (0, 0, 1, false),
            (100, 100, 10, false),
            (100, 150, 10, false), // the second was given more
            (150, 100, 20, false), // 30 beyond the request; noise sqrt(250 × 20) = 71
            (200, 100, 20, true),  // 80 beyond; noise sqrt(300 × 20) = 77
            // Below 16 blocks, the noise of a 16-block request: 60 beyond a 10-block request
            // is clear at its own size (sqrt(270 × 10) = 52), not at 16 (66); 70 is (67).
            (170, 100, 10, false),
            (180, 100, 10, true),
            (1000, 100, 900, false),
            (1000, 100, 10, true),
            (u32::MAX, 0, u32::MAX, false),
            (u32::MAX, 0, 1, true),
        ];
        for (first, second, blocks, want) in rows {
            assert_eq!(
                clearly_less_work(first, second, blocks),
                want,
                "first {first}, second {second}, blocks {blocks}"
            );
        }
    }

    #[test]
    fn least_inflight_and_round_robin_skip_down_ranks() {
        let mut states = with_load(&[3, 1, 1, 0]);
        states.ranks[3].down_until = 100;
        assert_eq!(choose_least_inflight(&states, 0, 0), Some(1));
        assert_eq!(choose_least_inflight(&states, 0, 2), Some(2), "ties rotate");
        assert_eq!(choose_round_robin(&states, 0, 3, bound(4.0)), Some(0));
        assert_eq!(choose_round_robin(&states, 0, 2, bound(4.0)), Some(2));
        // Rank 0 over ceil(1.25 × 6 / 3) = 3: passed.
        assert_eq!(choose_round_robin(&states, 0, 3, bound(1.25)), Some(1));
        for r in &mut states.ranks {
            r.down_until = 100;
        }
        assert_eq!(choose_least_inflight(&states, 0, 0), None);
        assert_eq!(choose_round_robin(&states, 0, 0, bound(1.25)), None);
        assert_eq!(choose_hash(&states, 0, 0, 1, bound(1.25)), None);
    }

    /// The turn counter wraps (it starts at the clock's seconds): the ranks visited stay a
    /// rotation there, so none is skipped whatever the rank count.
    #[test]
    fn a_wrapping_turn_still_visits_every_rank() {
        let mut states = with_load(&[0, 0, 0]);
        states.ranks[0].down_until = 100;
        states.ranks[1].down_until = 100;
        for turn in [u32::MAX - 2, u32::MAX - 1, u32::MAX, 0] {
            assert_eq!(
                choose_round_robin(&states, 0, turn, bound(1.25)),
                Some(2),
                "{turn}"
            );
            assert_eq!(choose_least_inflight(&states, 0, turn), Some(2), "{turn}");
        }
        let idlest_last = with_load(&[5, 5, 0]);
        assert_eq!(choose_least_inflight(&idlest_last, 0, u32::MAX), Some(2));
    }

    /// Round robin skips a rank over the bound, so a pin moved off a full rank does not land
    /// on it again.
    #[test]
    fn round_robin_passes_a_full_rank() {
        let states = with_load(&[9, 0, 0, 0]);
        // Capacity ceil(1.25 × 10 / 4) = 4 (floor 1): rank 0 is full.
        assert_eq!(choose_round_robin(&states, 0, 0, bound(1.25)), Some(1));
        assert_eq!(choose_round_robin(&states, 0, 3, bound(1.25)), Some(3));
        let even = with_load(&[1, 1, 1, 1]);
        assert_eq!(choose_round_robin(&even, 0, 4, bound(1.25)), Some(0));
    }

    #[test]
    fn room_rule() {
        assert_eq!(room_rank(10, 4), 2);
        assert_eq!(room_rank(u64::MAX, 7), (u64::MAX % 7) as u32);
        assert_eq!(room_rank(5, 0), 0);
    }
}
