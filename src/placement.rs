//! Where a request goes once no explicit rank or bootstrap room decided it: the key's pin, the
//! prompt's prefix match weighed against the request's home, and the configured assigner.
//!
//! [`plan`] is the whole decision for such a request, a pure function of what the host gathered
//! (the key and its pin, the index's answer, the prompt's anchor and size) and a snapshot of the
//! rank state (a pin decides unless the prompt shows the key names other conversations too:
//! `pin_overruled`); it returns a [`Plan`] — where to route, whether to write or learn the key's pin,
//! which counters to bump — that the host only carries out.

use crate::assign::{
    choose_least_inflight, choose_round_robin, clearly_less_work, home_of_two, keep_pin,
    rendezvous_pair, Home, HomeBy, Mode, QUEUE_MARGIN,
};
use crate::config::Config;
use crate::metrics::Counter;
use crate::prefix_index::{Kept, Match};
use crate::ranks::RankStates;
use crate::table;

/// What the host knows about a request the plan places.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Facts {
    /// The routing key, if the request has one.
    pub key: Option<KeyFacts>,
    /// The prefix index's answer for the request's prompt chain; `None`: no chain (prefix off,
    /// not an LLM path, or the body was not read), so the prefix has no say.
    pub matched: Option<Match>,
    /// The prompt's anchor (`PrefixIndex::anchor`): stands for a key when there is none, or when
    /// the prompt overrules the key's pin (see `pin_overruled`).
    pub anchor: Option<u64>,
    /// The prompt's chain length in blocks (0: no chain).
    pub chain_blocks: usize,
    /// Whether the anchor names every later turn of the prompt's conversation too (see
    /// `prefix_index::Kept`).
    pub anchor_kept: Kept,
    /// For a chat that goes on past its opening (`Chain::past_opening`), whose later turns are
    /// known to resend it unchanged: the anchor its prompt gets past nothing (its opening's
    /// name, the same on every turn). `None` otherwise.
    pub opening_name: Option<u64>,
    /// Rotates least-in-flight ties and round robin (a per-VM counter).
    pub turn: u32,
}

/// A routing key's hash, the rank the affinity table pins it to, and the tag of the conversation
/// that wrote the pin (0: not known) with the depth it was taken at (see `conversation_tags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyFacts {
    pub hash: u64,
    pub pinned: Option<u32>,
    pub tag: u8,
    /// The prefix depth (blocks) the pin's tag was taken past.
    pub depth: u16,
}

/// Where the request goes and what the host remembers about it until the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// To `rank`, with the key pinned there (`write_pin`: the pin must be written first).
    Pinned {
        hash: u64,
        rank: u32,
        write_pin: bool,
    },
    /// Envoy balances; the key's rank is learned from the response.
    Learn { hash: u64 },
    /// To `rank`, chosen by the filter, with no key to pin.
    Direct { rank: u32 },
    /// Envoy balances and there is nothing to learn.
    Balanced,
}

impl Target {
    /// The rank the filter routes to (`None`: Envoy balances).
    pub fn rank(&self) -> Option<u32> {
        match *self {
            Target::Pinned { rank, .. } | Target::Direct { rank } => Some(rank),
            Target::Learn { .. } | Target::Balanced => None,
        }
    }
}

/// The decision for one request, for the host to carry out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub target: Target,
    /// What the prefix stage said, if it was consulted (counted by `Counters::add_prefix_choice`).
    pub prefix: Option<PrefixChoice>,
    /// Counters to add one to: the key's outcome, `assigned`, and why the home is the rank it
    /// is when the request went home (see [`HomeBy`]).
    pub counters: [Option<Counter>; 3],
    /// The conversation tag and depth to store with the key's pin when it is written (see
    /// `conversation_tags`).
    pub pin_tag: Tag,
}

/// The whole placement of a request that has a key or none (explicit ranks and rooms are decided
/// before): the pin, the prefix and the assigner in [`place`]'s order, then what follows for the
/// key. `states`: a snapshot of the rank board when the filter counts load (`None` in `envoy`
/// mode: Envoy balances whatever the pin and the prefix leave open). `blocks`: the request's
/// prompt size, for the home's tie-break.
pub fn plan(
    cfg: &Config,
    now: u32,
    facts: &Facts,
    states: Option<&RankStates>,
    blocks: u32,
) -> Plan {
    let (tag, sure) = conversation_tags(facts);
    let overruled = facts
        .key
        .is_some_and(|key| pin_overruled(key, facts.matched.as_ref(), tag));
    let pinned = facts.key.and_then(|k| k.pinned).filter(|_| !overruled);
    let request = Request {
        anchor: home_anchor(facts, overruled),
        blocks,
        keyed: facts.key.is_some_and(|k| k.pinned.is_none()),
    };
    let mut home_by = None;
    let p = place(
        cfg,
        now,
        pinned,
        facts.matched.as_ref(),
        states,
        request,
        || {
            let home = states
                .and_then(|st| assign_home(cfg, st, now, request.anchor, facts.turn, blocks))?;
            home_by = Some(home.by);
            Some(home.rank)
        },
    );
    let rank = placed_rank(p.placed);
    // Why the home is that rank counts only when the request went there.
    let home = match p.placed {
        Placed::Assigned(Some(_)) => home_by.and_then(home_counter),
        _ => None,
    };
    let (target, counters) = match (facts.key, rank) {
        (Some(key), Some(rank)) => {
            // A pin the prompt overruled still holds when the prompt chose its rank too.
            let held =
                matches!(p.placed, Placed::Pin(_)) || (overruled && key.pinned == Some(rank));
            let outcome = if held {
                Counter::AffinityHit
            } else if overruled {
                Counter::KeyOverruled
            } else if key.pinned.is_some() {
                Counter::Moved
            } else {
                Counter::AffinityMiss
            };
            let assigned = (!held && !overruled && matches!(p.placed, Placed::Assigned(_)))
                .then_some(Counter::Assigned);
            // An overruled pin stays where it is: it serves the key's other conversations, and
            // a key every request of an application sends would otherwise be rewritten by
            // nearly every request. A held pin whose conversation is not known yet learns it
            // (or its name past a shared prefix, when the pin knows only one past nothing).
            // A pin held although the prompt overruled it (the prompt chose its rank too) is
            // another conversation's: it learns nothing from this one.
            let write_pin = if held {
                !overruled && sure.tag != 0 && (key.tag == 0 || (key.depth == 0 && sure.depth != 0))
            } else {
                !overruled
            };
            let target = Target::Pinned {
                hash: key.hash,
                rank,
                write_pin,
            };
            (target, [Some(outcome), assigned, home])
        }
        // Envoy balances and, with no usable rank, the pin another conversation of the key
        // holds stays where it is: nothing to learn from this one's answer.
        (Some(_), None) if overruled => (
            Target::Balanced,
            [Some(unplaced(states, Counter::KeyOverruled)), None, None],
        ),
        // Envoy balances: a miss the response teaches, or (with load counted) no usable rank.
        (Some(key), None) => (
            Target::Learn { hash: key.hash },
            [Some(unplaced(states, Counter::AffinityMiss)), None, None],
        ),
        (None, Some(rank)) => (Target::Direct { rank }, [None, None, home]),
        (None, None) => (
            Target::Balanced,
            [states.map(|_| Counter::NoUsableRank), None, None],
        ),
    };
    // A pin that moves keeps the tag it had when this request knows none, or knows only its
    // name past nothing (a turn of its own history) and the pin a name past a shared prefix:
    // new conversations past that prefix are compared with the deeper name.
    let keep = facts.key.filter(|k| {
        k.pinned.is_some() && (sure.tag == 0 || (sure.depth == 0 && k.tag != 0 && k.depth != 0))
    });
    Plan {
        target,
        prefix: p.prefix,
        counters,
        pin_tag: keep.map_or(sure, |k| Tag {
            tag: k.tag,
            depth: k.depth,
        }),
    }
}

/// A conversation's tag (1..=15; 0: not known) and the prefix depth, in blocks, it was taken
/// past (see `conversation_tags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tag {
    pub tag: u8,
    pub depth: u16,
}

/// The tag of the conversation a request's prompt belongs to (1..=15, from the prompt's anchor,
/// with the depth of the shared prefix it was taken past; 0 when not known), twice: as it is
/// compared with the key's pin, and as a pin this request writes may store it (0 when the name
/// is not sure to be its conversation's next turns' too).
///
/// Known for a prompt whose anchor its next turns keep (see `Kept`) that goes on past a prefix
/// the index knows to be shared (a branched match), or of which the index knows nothing at all
/// (depth 0: chats without a system prompt, which share nothing). Past an unbranched match the
/// prompt is the conversation's own history, or a prefix one other prompt went past; a name
/// taken at the chain's last block changes with the next turn (a block-id trace's turns that
/// replace their last partial block mark their own ends branched, and would read as another
/// conversation every other turn). A name taken past nothing is compared only with names taken
/// past nothing (see [`pin_overruled`]): a conversation's first prompt is named inside a system
/// prompt not yet known to be shared.
///
/// Stored: past a shared prefix, a chat's opening or a position the chain goes past, as it
/// always was; a name taken past nothing, or at a last block inside the opening, only from a
/// chat seen to resend its messages (one that goes on past its opening): a first turn that ends
/// with its opening cannot tell a chat client from one that folds the conversation into one
/// growing message (whose opening changes every turn), nor a completions prompt from a block-id
/// trace's whose next turn replaces its first block. Such a name still overrules a pin that
/// stores another.
fn conversation_tags(facts: &Facts) -> (Tag, Tag) {
    let (Some(anchor), Some(m)) = (facts.anchor, facts.matched.as_ref()) else {
        return (Tag::default(), Tag::default());
    };
    // A turn of a conversation's own history: rule (a) of `pin_overruled` compares it, but a
    // chat seen to resend its messages tells its pin its name past nothing, which is what a
    // new conversation under the same key without a shared prefix is compared with.
    if m.blocks > 0 && !m.branched {
        return (
            Tag::default(),
            facts.opening_name.map_or(Tag::default(), unshared_tag),
        );
    }
    let unshared = m.blocks == 0;
    let known = facts.anchor_kept != Kept::No
        && (unshared || (m.branched && facts.chain_blocks > m.blocks));
    if !known {
        return (Tag::default(), Tag::default());
    }
    let tag = Tag {
        depth: u16::try_from(m.blocks).unwrap_or(u16::MAX),
        ..unshared_tag(anchor)
    };
    let sure = facts.opening_name.is_some() || (!unshared && facts.anchor_kept == Kept::Yes);
    (tag, if sure { tag } else { Tag::default() })
}

/// The tag of a conversation's name past nothing (see [`conversation_tags`]).
fn unshared_tag(name: u64) -> Tag {
    Tag {
        tag: 1 + (name % u64::from(table::MAX_TAG)) as u8,
        depth: 0,
    }
}

/// Whether the request's prompt says that its key's pin is not this conversation's rank, when
/// the key names many conversations (an end user's id in `user`, an application's
/// `prompt_cache_key`): its pin would otherwise pull every new conversation of that user onto
/// one rank, and the older ones' next turns off their history whenever it moved. Measured on
/// the kv trace with one key for every request (`scripts/bench-affinity.py --suite kv --trace
/// <that trace>`, 4 ranks): 0.752 × oracle and TTFB p90 2.9 s with the pin deciding, against
/// 0.999 × and 0.6 s without the key. Two signs, either enough:
///
/// - its own history (an unbranched match) is indexed on a rank other than the pin that does
///   not hold it too (a turn the pin moved to another rank records the matched position's new
///   holder, so a conversation moved off a full rank is not sent back). Ranks from 13 on have
///   no holder flag: there the pin decides. A position inside a shared prompt where the search
///   stopped because a deeper entry was lost (evicted, expired) reads the same and overrules
///   the pin too; requiring the match to be where an earlier prompt ended would keep such pins
///   but also every new conversation of a shared key on its pin (kv trace, one key: max/mean
///   prompt tokens 1.23 → 1.29, BENCHMARKS.md), so it is not done;
/// - it has nothing of its own indexed, and its conversation's tag (`tag`, see
///   [`conversation_tags`]) differs from the one stored with the pin, taken past a shared prefix
///   of the same depth or matched on another rank than the pin's: another conversation wrote
///   the pin. Either tag unknown (0), taken at another depth on the pin's own rank, or one of
///   them taken past nothing and the other past a shared prefix: the pin decides. So a
///   conversation whose first turn had nothing of its own keeps its pin, on every replica.
///
/// Without a chain (prefix placement off, no prompt) the pin decides.
fn pin_overruled(key: KeyFacts, matched: Option<&Match>, tag: Tag) -> bool {
    let (Some(pin), Some(m)) = (key.pinned, matched) else {
        return false;
    };
    if m.blocks > 0 && !m.branched {
        let pin_flag = table::holder_flag(pin);
        return pin_flag != 0
            && m.holders & pin_flag == 0
            && m.rank.is_some_and(|rank| rank != pin);
    }
    // Past a shared prefix of another depth, a name is only compared when the match is not on
    // the pin's rank: a conversation whose turns replace their last block marks its own ends
    // branched, on its own rank, and is named past each at a new depth. A name taken past
    // nothing is compared only with another taken past nothing: a conversation's first prompt
    // is named inside a system prompt not yet known to be shared, and a prompt the index has
    // forgotten (its entries evicted, its key's pin not) is named past nothing.
    let comparable =
        key.depth == tag.depth || (key.depth != 0 && tag.depth != 0 && m.rank != Some(pin));
    key.tag != 0 && tag.tag != 0 && comparable && key.tag != tag.tag
}

/// What names the request's home: its key, unless the prompt overrules the key's pin (the key
/// names many conversations), then, as without a key, the prompt's anchor.
fn home_anchor(facts: &Facts, overruled: bool) -> Option<u64> {
    let key = facts.key.map(|k| k.hash);
    if overruled {
        facts.anchor.or(key)
    } else {
        key.or(facts.anchor)
    }
}

/// The counter of a placement Envoy makes: with load counted every placement has a rank unless
/// none is usable; without, `otherwise`.
fn unplaced(states: Option<&RankStates>, otherwise: Counter) -> Counter {
    match states {
        Some(_) => Counter::NoUsableRank,
        None => otherwise,
    }
}

/// The configured assigner's choice (the request's *home*) over a snapshot of rank state: the
/// rendezvous rank of the key, or of the prompt's anchor when there is no key, in `hash` mode;
/// the least loaded or the next rank in the others. `None` in `envoy` mode or with no usable
/// rank.
pub fn assign(cfg: &Config, st: &RankStates, now: u32, facts: &Facts, blocks: u32) -> Option<u32> {
    let anchor = home_anchor(facts, false);
    assign_home(cfg, st, now, anchor, facts.turn, blocks).map(|home| home.rank)
}

/// [`assign`], with why the home is that rank.
fn assign_home(
    cfg: &Config,
    st: &RankStates,
    now: u32,
    anchor: Option<u64>,
    turn: u32,
    blocks: u32,
) -> Option<Home> {
    let a = &cfg.assign;
    let preferred = |rank: Option<u32>| {
        rank.map(|rank| Home {
            rank,
            by: HomeBy::Preferred,
        })
    };
    match (a.mode, anchor) {
        (Mode::Envoy, _) => None,
        (Mode::Hash, Some(anchor)) => home_of_two(st, now, a.seed, anchor, a.new_key_bound, blocks),
        (Mode::RoundRobin, _) => preferred(choose_round_robin(st, now, turn, a.new_key_bound)),
        // No key and no anchor in hash mode, and every placement in the others.
        _ => preferred(choose_least_inflight(st, now, turn)),
    }
}

/// The counter of a home that is not the assigner's first choice.
fn home_counter(by: HomeBy) -> Option<Counter> {
    match by {
        HomeBy::Preferred => None,
        HomeBy::SecondLessWork => Some(Counter::HomeSecondWork),
        HomeBy::SecondQueue => Some(Counter::HomeSecondQueue),
        HomeBy::PreferredFull => Some(Counter::HomeFull),
    }
}

/// What the prefix stage made of a request the explicit rank and the key's pin left open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixChoice {
    /// Route to the rank holding the longest indexed prefix (`blocks` blocks of it).
    Hit { rank: u32, blocks: usize },
    /// No indexed prefix of at least `prefix.min_match_blocks` blocks: the next choice decides.
    Miss,
    /// A prefix of `blocks` blocks is on `rank`, but the rank is full under the load bound (the
    /// pinned one, `assign.pinned_load_factor`, from `prefix.sticky_blocks` deep: every match by
    /// default; the new-key one, `assign.load_factor`, below) or cooling down: the next choice
    /// decides.
    SkippedFull { rank: u32, blocks: usize },
    /// The blocks the match on `rank` saves do not outweigh the work queued there beyond the
    /// request's home (see [`prefix_choice_at`]): the request goes home.
    Spread { rank: u32, blocks: usize },
}

/// The prefix stage on a lookup's result. `states`: the shared rank state when the filter counts
/// requests in flight (every `assign.mode` but `envoy`); `None` only for a match without a rank
/// state, which the configuration rules out (prefix placement is refused in `envoy` mode) and
/// tests: nothing is weighed then.
///
/// Which bound makes a rank full depends on the match's depth: from `prefix.sticky_blocks` on it
/// is the looser bound of a pinned key (`assign.pinned_load_factor`), below it the one new keys
/// get (`assign.load_factor`). The default `sticky_blocks` 1 gives every match the pinned bound:
/// what tells a shared prefix from a conversation's own history is the branched flag below, and
/// a deployment whose short prefixes are all shared can still raise it.
///
/// A match on a branched position is a prefix other prompts share, not this prompt's own
/// history: the least loaded of the ranks known to hold it stands for it. Whether it beats the
/// request's home is [`prefix_choice_at`]'s question; without a home it routes.
pub fn prefix_choice(
    cfg: &Config,
    m: &Match,
    states: Option<&RankStates>,
    now: u32,
) -> PrefixChoice {
    prefix_choice_at(cfg, m, states, now, None, Request::default())
}

/// What weighing a match against the request's home needs to know of the request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Request {
    /// What names the home: the key's hash, or the prompt's anchor when there is no key.
    pub anchor: Option<u64>,
    /// The prompt's size in blocks.
    pub blocks: u32,
    /// A routing key that has no pin on this Envoy names the home (see `outweighs_home`).
    pub keyed: bool,
}

/// [`prefix_choice`] weighed against the request's *home*: the rank the assigner gives it
/// without the prefix (in `hash` mode the rendezvous rank of its key or anchor, the same on
/// every replica). The match keeps its rank only when the prompt blocks it saves there,
/// beyond what the home holds, outweigh the work already queued there beyond the home's:
///
/// `saved > prefix.load_blocks × max(0, in flight there − in flight at home) + prefix.home_blocks`
///
/// for a shared (branched) match. A conversation's own history (unbranched) counts only the
/// difference beyond `QUEUE_MARGIN` in flight, and gets no home bonus when its rank is the
/// other of its anchor's two rendezvous ranks (see `outweighs_home`).
///
/// So a long conversation history (80 blocks) stays over a difference of a request or two, a
/// short shared system prompt (4 blocks) never outweighs the home's bonus, and on a quiet
/// cluster new conversations spread by their home instead of piling onto the first rank that
/// computed a popular prefix. A shared prefix the home lacks also goes home, whatever it saves,
/// once its holder runs hot against the home (see `runs_hot`: clearly more work lately and at
/// least `HOT_FACTOR` times as much; it is computed at home once, then serves every
/// conversation that comes home). `request`: what names the home (the key, or
/// the prompt's anchor), for the bonus's one exception, and the prompt's size (see
/// `outweighs_home`).
pub fn prefix_choice_at(
    cfg: &Config,
    m: &Match,
    states: Option<&RankStates>,
    now: u32,
    home: Option<u32>,
    request: Request,
) -> PrefixChoice {
    let min = cfg.prefix.min_match_blocks.max(1) as usize;
    let rank = match m.rank {
        Some(rank) if m.blocks >= min && rank < cfg.dp_size => rank,
        _ => return PrefixChoice::Miss,
    };
    let blocks = m.blocks;
    // A shared prefix may be held by other ranks too: the least loaded of them stands for it.
    let rank = match states {
        Some(st) if m.branched => least_loaded_holder(st, now, rank, m.holders, cfg.dp_size),
        _ => rank,
    };
    // At least `sticky_blocks` deep (every match, by default): it stays like a pin. Shallower: it
    // yields like a new key.
    let bound = if blocks >= cfg.prefix.sticky_blocks as usize {
        cfg.assign.pinned_bound
    } else {
        cfg.assign.new_key_bound
    };
    match (states, home) {
        (Some(st), _) if !keep_pin(st, now, rank, bound) => {
            PrefixChoice::SkippedFull { rank, blocks }
        }
        (Some(st), Some(home))
            if home != rank && !outweighs_home(cfg, m, st, now, rank, home, request) =>
        {
            PrefixChoice::Spread { rank, blocks }
        }
        _ => PrefixChoice::Hit { rank, blocks },
    }
}

/// How many times the home's recent work a shared prefix's holder must have been given to run
/// hot. Differences below it are what many shared prefixes spread over the ranks produce anyway
/// (each computed on one rank, each drawing its own conversations); copying a prefix shared by a
/// few sessions then costs more prefill than it evens out (block-id trace: 0.978 -> 0.965 x
/// oracle without this factor, 0.973 with it; see BENCHMARKS.md).
const HOT_FACTOR: u64 = 2;

/// Whether a shared prefix's holder, given `holder` blocks of work lately, runs hot against a
/// home given `home`, for a request of `blocks` blocks: clearly more work (beyond the request and
/// what sampling explains, so that replicas agree) and at least [`HOT_FACTOR`] times as much.
fn runs_hot(holder: u32, home: u32, blocks: u32) -> bool {
    clearly_less_work(holder, home, blocks) && u64::from(holder) >= HOT_FACTOR * u64::from(home)
}

/// Whether the match on `rank` saves more prompt blocks than the extra work queued there costs,
/// compared with going `home` (see [`prefix_choice_at`]).
fn outweighs_home(
    cfg: &Config,
    m: &Match,
    st: &RankStates,
    now: u32,
    rank: u32,
    home: u32,
    request: Request,
) -> bool {
    let blocks = m.blocks as u64;
    // A shared prefix held at home too saves nothing by going elsewhere.
    let home_holds =
        m.branched && (m.rank == Some(home) || m.holders & table::holder_flag(home) != 0);
    // A shared prefix the home lacks is computed there once, then serves every conversation that
    // comes home: its blocks are a one-time cost, not each request's. So once its holder runs hot
    // against the home, the home takes the request and becomes a holder. Without this, at low
    // load (nothing queued anywhere) every new conversation behind a long shared prompt — an
    // agent's tools and instructions — piles onto the prompt's first holder.
    if m.branched && !home_holds && runs_hot(st.recent(rank), st.recent(home), request.blocks) {
        return false;
    }
    let saved = if home_holds { 0 } else { blocks };
    // Only extra work counts against the match: a holder idler than the home gains nothing from
    // it, or a replica that sees other loads would send the conversation elsewhere.
    let queued = st.inflight(rank).saturating_sub(st.inflight(home));
    // A conversation's own history (unbranched) yields only to a queue that is forming, as its
    // home's second choice does: a difference of a request or two in flight is what the ranks'
    // loads wobble by, and counting it sent a short history (a few blocks: chats without a
    // system prompt) back and forth between its two homes, losing it on every move.
    let queued = if m.branched {
        queued
    } else {
        queued.saturating_sub(QUEUE_MARGIN)
    };
    // The bonus is for a home every replica computes alike and every turn returns to: the
    // rendezvous rank (`hash`). Another assigner's choice (the least loaded rank) changes from
    // one request to the next, so it earns none.
    //
    // Nor does a conversation's own history (an unbranched match) on the other of its anchor's
    // two rendezvous ranks: both are its homes on every replica, and which one was a matter of
    // load when an earlier turn was placed. Each turn asks again, so a turn placed on the
    // second, whose history is still too short to outweigh the bonus, would otherwise go back to
    // the first as soon as the load evens out, and lose what it had. The load term stays.
    let in_home_pair =
        |anchor| rendezvous_pair(st, now, cfg.assign.seed, anchor).contains(&Some(rank));
    //
    // A key's request that the prefix stage sees has no pin here: its conversation's earlier
    // turns, had they come through this Envoy, would have pinned it. So what it matches is
    // another conversation's (a prefix only one other prompt went past yet reads as
    // unbranched), and it earns the bonus: a replica that has not indexed that prefix sends the
    // key home, and so must this one, or the two pin the key to different ranks for good.
    let bonus = match (cfg.assign.mode, request.anchor) {
        (Mode::Hash, Some(anchor)) if !m.branched && !request.keyed && in_home_pair(anchor) => 0,
        (Mode::Hash, _) => cfg.prefix.home_blocks,
        _ => 0,
    };
    let cost = u64::from(cfg.prefix.load_blocks) * u64::from(queued) + u64::from(bonus);
    saved > cost
}

/// Where a request goes once no explicit rank or room decided it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// The key's pin holds (usable and under `assign.pinned_load_factor` when load is counted).
    Pin(u32),
    /// The rank of the longest indexed prompt prefix.
    Prefix { rank: u32, blocks: usize },
    /// The assigner's choice; `None`: Envoy balances (`envoy` mode, or no usable rank).
    Assigned(Option<u32>),
}

/// A placement, and what the prefix stage said if it was consulted (`None`: a pin decided first,
/// or the request has no prompt chain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub placed: Placed,
    pub prefix: Option<PrefixChoice>,
}

/// The decision order below the explicit rank: the key's pin (`pinned`, from the affinity
/// table), then the prefix match (`prefix`: the index lookup of this request's chain, `None`
/// when it has none), then `assign` (the configured assigner; it returns `None` in `envoy` mode).
/// `states` as in [`prefix_choice`]; with states, a pin is kept only while its rank is usable and
/// under the pinned bound, else the key moves to the next choice. `request`: what names the
/// request's home and its size, as in [`prefix_choice_at`].
///
/// Pure: the host calls it inside the rank board's atomic update (so the choice and the
/// in-flight count agree), or directly in `envoy` mode.
pub fn place(
    cfg: &Config,
    now: u32,
    pinned: Option<u32>,
    prefix: Option<&Match>,
    states: Option<&RankStates>,
    request: Request,
    assign: impl FnOnce() -> Option<u32>,
) -> Placement {
    if let Some(rank) = pinned {
        let kept = match states {
            Some(st) => keep_pin(st, now, rank, cfg.assign.pinned_bound),
            None => true,
        };
        if kept {
            return Placement {
                placed: Placed::Pin(rank),
                prefix: None,
            };
        }
    }
    let Some(m) = prefix else {
        return Placement {
            placed: Placed::Assigned(assign()),
            prefix: None,
        };
    };
    // With load counted, the assigner's choice is the request's home, weighed against the
    // match; without (`envoy` mode) the assigner only stands in when the prefix does not decide.
    let (choice, placed) = match states {
        Some(_) => {
            let home = assign();
            let choice = prefix_choice_at(cfg, m, states, now, home, request);
            (choice, hit_or(choice, || home))
        }
        None => {
            let choice = prefix_choice(cfg, m, None, now);
            (choice, hit_or(choice, assign))
        }
    };
    let choice = Some(choice);
    Placement {
        placed,
        prefix: choice,
    }
}

/// The prefix's rank on a hit, else what `otherwise` assigns.
fn hit_or(choice: PrefixChoice, otherwise: impl FnOnce() -> Option<u32>) -> Placed {
    match choice {
        PrefixChoice::Hit { rank, blocks } => Placed::Prefix { rank, blocks },
        _ => Placed::Assigned(otherwise()),
    }
}

/// Among `rank` and the ranks flagged in `holders` (below `dp_size`), the usable one with the
/// fewest requests in flight; `rank` wins ties, and stands if none is usable.
fn least_loaded_holder(st: &RankStates, now: u32, rank: u32, holders: u16, dp_size: u32) -> u32 {
    std::iter::once(rank)
        .chain(table::holders(holders).filter(|&r| r < dp_size && r != rank))
        .filter(|&r| st.usable(r, now))
        .min_by_key(|&r| st.inflight(r))
        .unwrap_or(rank)
}

/// The rank a placement routes to (`None`: Envoy balances).
fn placed_rank(placed: Placed) -> Option<u32> {
    match placed {
        Placed::Pin(rank) | Placed::Prefix { rank, .. } => Some(rank),
        Placed::Assigned(rank) => rank,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::{decide_body_with_prefix, Decision, Reason};
    use crate::prefix_index::PrefixIndex;
    use crate::prompt::Api;
    use crate::ranks::RankLoad;
    use crate::table::tests::MemStore;

    fn cfg(extra: &str) -> Config {
        Config::from_json(format!(r#"{{"dp_size":4{extra}}}"#).as_bytes()).unwrap()
    }

    const PREFIX_ON: &str = r#","prefix":{"enabled":true,"block_bytes":64}"#;

    /// Envoy balances and the filter learns; prefix placement is refused in that mode.
    const ENVOY_MODE: &str = r#","assign":{"mode":"envoy"},"prefix":{"enabled":false}"#;

    fn states(loads: &[(u32, u32)]) -> RankStates {
        RankStates {
            ranks: loads
                .iter()
                .map(|&(inflight, down_until)| RankLoad {
                    inflight,
                    down_until,
                    recent: 0,
                })
                .collect(),
        }
    }

    fn matched(blocks: usize, rank: u32) -> Match {
        Match {
            blocks,
            rank: Some(rank),
            ..Match::default()
        }
    }

    fn system_chat(system: &str, user: &str) -> String {
        serde_json::json!({"model":"m","messages":[
            {"role":"system","content":system},{"role":"user","content":user}]})
        .to_string()
    }

    #[test]
    fn prefix_choice_rules() {
        let c = cfg(
            r#","assign":{"mode":"hash","min_capacity":1},"prefix":{"min_match_blocks":2,"sticky_blocks":16}"#,
        );
        let idle = states(&[(0, 0); 4]);
        assert_eq!(
            prefix_choice(&c, &Match::default(), Some(&idle), 0),
            PrefixChoice::Miss
        );
        assert_eq!(
            prefix_choice(&c, &matched(1, 2), Some(&idle), 0),
            PrefixChoice::Miss,
            "shorter than min_match_blocks"
        );
        assert_eq!(
            prefix_choice(&c, &matched(2, 7), Some(&idle), 0),
            PrefixChoice::Miss,
            "rank out of range"
        );
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&idle), 0),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
        // Rank 2 holds 3 of 4 in flight: capacity ceil(1.25 × 5 / 4) = 2 → full.
        let busy = states(&[(1, 0), (0, 0), (3, 0), (0, 0)]);
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&busy), 0),
            PrefixChoice::SkippedFull { rank: 2, blocks: 8 }
        );
        // Cooling down counts as full; envoy mode (no states) never is.
        let down = states(&[(0, 0), (0, 0), (0, 50), (0, 0)]);
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&down), 10),
            PrefixChoice::SkippedFull { rank: 2, blocks: 8 }
        );
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&down), 50),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), None, 0),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
        // A match of sticky_blocks (16 here) or more yields only at the pinned bound. With
        // 4 in flight, 2 of them on rank 2: the new-key capacity is ceil(1.25 × 5 / 4) = 2 (full),
        // the pinned one ceil(2.0 × 5 / 4) = 3 (not full).
        let two = states(&[(2, 0), (0, 0), (2, 0), (0, 0)]);
        assert_eq!(
            prefix_choice(&c, &matched(8, 2), Some(&two), 0),
            PrefixChoice::SkippedFull { rank: 2, blocks: 8 },
            "a shallow match yields at the new-key bound"
        );
        assert_eq!(
            prefix_choice(&c, &matched(16, 2), Some(&two), 0),
            PrefixChoice::Hit {
                rank: 2,
                blocks: 16
            },
            "a deep match stays until the pinned bound"
        );
        // The default floor (min_capacity 8) keeps a quiet rank usable.
        let floored = cfg(r#","assign":{"mode":"hash"}"#);
        assert_eq!(
            prefix_choice(&floored, &matched(8, 2), Some(&busy), 0),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
    }

    #[test]
    fn holders_stand_for_a_shared_prefix() {
        // Floor 8: no rank is full below.
        let c = cfg(r#","assign":{"mode":"hash"}"#);
        let shared = |blocks, rank| Match {
            branched: true,
            ..matched(blocks, rank)
        };
        // Rank 2 has 2 in flight, rank 1 one; rank 3 is down until 50.
        let st = states(&[(0, 0), (1, 0), (2, 0), (0, 50)]);
        // Without a home a match routes, shared or not.
        assert_eq!(
            prefix_choice(&c, &shared(8, 2), Some(&st), 10),
            PrefixChoice::Hit { rank: 2, blocks: 8 },
        );
        // The default sticky_blocks 1: an unbranched match of any depth stays until the pinned
        // bound. Rank 2 with 1 of 2 in flight, floor 1: the new-key capacity ceil(1.25 × 3 / 4)
        // = 1 is reached, the pinned one ceil(2.0 × 3 / 4) = 2 is not.
        let own = cfg(r#","assign":{"mode":"hash","min_capacity":1}"#);
        let one = states(&[(1, 0), (0, 0), (1, 0), (0, 0)]);
        assert_eq!(
            prefix_choice(&own, &matched(2, 2), Some(&one), 0),
            PrefixChoice::Hit { rank: 2, blocks: 2 },
        );
        let shallow =
            cfg(r#","assign":{"mode":"hash","min_capacity":1},"prefix":{"sticky_blocks":16}"#);
        assert_eq!(
            prefix_choice(&shallow, &matched(2, 2), Some(&one), 0),
            PrefixChoice::SkippedFull { rank: 2, blocks: 2 },
        );
        // Ranks known to hold the prefix stand for it: the least loaded of them is taken (rank 0,
        // idle, over the entry's rank 2); an unusable holder (3, down) or one out of range is not.
        let held = Match {
            holders: table::holder_flag(0) | table::holder_flag(3) | table::holder_flag(9),
            ..shared(8, 2)
        };
        assert_eq!(
            prefix_choice(&c, &held, Some(&st), 10),
            PrefixChoice::Hit { rank: 0, blocks: 8 }
        );
        let busy_holder = Match {
            holders: table::holder_flag(1),
            ..shared(8, 2)
        };
        assert_eq!(
            prefix_choice(&c, &busy_holder, Some(&st), 10),
            PrefixChoice::Hit { rank: 1, blocks: 8 },
            "holder 1 (1 in flight) is less loaded than the entry's rank 2"
        );
        // Not branched: holders are not consulted (a conversation's own rank).
        let own_held = Match {
            holders: table::holder_flag(0),
            ..matched(8, 2)
        };
        assert_eq!(
            prefix_choice(&c, &own_held, Some(&st), 10),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
        // Without a rank state nothing is weighed.
        assert_eq!(
            prefix_choice(&c, &shared(8, 2), None, 10),
            PrefixChoice::Hit { rank: 2, blocks: 8 }
        );
    }

    #[test]
    fn a_match_is_weighed_against_the_home() {
        // load_blocks 32, home_blocks 8; a generous load bound so that only the weighing decides.
        let c = cfg(
            r#","assign":{"mode":"hash","min_capacity":64},"prefix":{"load_blocks":32,"home_blocks":8}"#,
        );
        let at = |m: &Match, loads: &[u32], home| {
            let st = states(&loads.iter().map(|&n| (n, 0)).collect::<Vec<_>>());
            prefix_choice_at(&c, m, Some(&st), 10, Some(home), Request::default())
        };
        let shared = |blocks, rank, holders| Match {
            blocks,
            rank: Some(rank),
            branched: true,
            holders,
            ..Match::default()
        };
        let hit = |rank, blocks| PrefixChoice::Hit { rank, blocks };
        let spread = |rank, blocks| PrefixChoice::Spread { rank, blocks };
        // A conversation's own 80-block history (40 KiB) counts only the requests in flight
        // beyond the queue margin (4): it stays over 4 more (nothing counted), 5 or 6 more
        // (80 > 32 + 8, 80 > 64 + 8), not over 7 (80 < 96 + 8).
        assert_eq!(at(&matched(80, 1), &[0, 4, 0, 0], 2), hit(1, 80));
        assert_eq!(at(&matched(80, 1), &[0, 5, 0, 0], 2), hit(1, 80));
        assert_eq!(at(&matched(80, 1), &[0, 6, 0, 0], 2), hit(1, 80));
        assert_eq!(at(&matched(80, 1), &[0, 7, 0, 0], 2), spread(1, 80));
        // A shared prefix counts every request: 160 blocks stay over 4 more, not 5 (below).
        // A 4-block (2 KiB) shared system prompt never outweighs going home on an idle
        // cluster: new conversations spread by their home instead of piling onto its holder.
        assert_eq!(at(&shared(4, 1, 0), &[0, 0, 0, 0], 2), spread(1, 4));
        // Not even when the holder is idler than the home: a replica with another view of the
        // loads would send the conversation elsewhere.
        assert_eq!(at(&shared(4, 1, 0), &[0, 0, 3, 0], 2), spread(1, 4));
        // A 160-block shared document stays with its holder over 4 more requests, not 5.
        assert_eq!(at(&shared(160, 1, 0), &[0, 4, 0, 0], 2), hit(1, 160));
        assert_eq!(at(&shared(160, 1, 0), &[0, 5, 0, 0], 2), spread(1, 160));
        // The home holds the shared prefix too: nothing is saved elsewhere.
        let home_holds = shared(160, 1, table::holder_flag(2));
        assert_eq!(at(&home_holds, &[0, 0, 0, 0], 2), spread(1, 160));
        // The match is at home: a hit whatever the load.
        assert_eq!(at(&matched(4, 2), &[0, 0, 9, 0], 2), hit(2, 4));
        // A shared prefix the home lacks goes home once its holder runs hot: given clearly more
        // work lately than the home and at least twice as much (a request of 200 blocks: 1000
        // against 0 is beyond the request and sampling's margin, 300 against 0 is not), even
        // on an idle cluster where the 192 blocks it saves outweigh any queue: the home
        // computes it once and holds it.
        let recent = |recent: [u32; 4]| RankStates {
            ranks: recent
                .iter()
                .map(|&recent| RankLoad {
                    inflight: 0,
                    down_until: 0,
                    recent,
                })
                .collect(),
        };
        let request = Request {
            anchor: None,
            blocks: 200,
            keyed: false,
        };
        let weigh =
            |m: &Match, st: &RankStates| prefix_choice_at(&c, m, Some(st), 10, Some(2), request);
        let worked = recent([0, 1000, 0, 0]);
        assert_eq!(weigh(&shared(192, 1, 0), &worked), spread(1, 192));
        assert_eq!(
            weigh(&shared(192, 1, 0), &recent([0, 300, 0, 0])),
            hit(1, 192)
        );
        // Clearly more work (1400 beyond the request's 200 and sampling's 959), but not twice
        // the home's: the shared prefix stays on its holder.
        assert_eq!(
            weigh(&shared(192, 1, 0), &recent([0, 3000, 1600, 0])),
            hit(1, 192)
        );
        // A conversation's own history is of no use to other conversations: it stays.
        assert_eq!(weigh(&matched(192, 1), &worked), hit(1, 192));
        // Only a rendezvous home (hash mode) earns the bonus: with least_inflight, the least
        // loaded rank of the moment, a 4-block match on an idle cluster stays.
        let li = cfg(r#","assign":{"mode":"least_inflight","min_capacity":64}"#);
        assert_eq!(
            prefix_choice_at(
                &li,
                &shared(4, 1, 0),
                Some(&states(&[(0, 0); 4])),
                10,
                Some(2),
                Request::default()
            ),
            hit(1, 4)
        );
        // The weights are knobs: home_blocks 0 and a 4-block prefix on an idle cluster stays.
        let c0 = cfg(r#","assign":{"mode":"hash","min_capacity":64},"prefix":{"home_blocks":0}"#);
        // The defaults (8, 8): an 80-block history stays over 8 more requests in flight.
        let d = cfg(r#","assign":{"mode":"hash","min_capacity":64}"#);
        let eight_more = states(&[(0, 0), (8, 0), (0, 0), (0, 0)]);
        assert_eq!(
            prefix_choice_at(
                &d,
                &matched(80, 1),
                Some(&eight_more),
                10,
                Some(2),
                Request::default()
            ),
            hit(1, 80)
        );
        let idle = states(&[(0, 0); 4]);
        assert_eq!(
            prefix_choice_at(
                &c0,
                &shared(4, 1, 0),
                Some(&idle),
                10,
                Some(2),
                Request::default()
            ),
            hit(1, 4)
        );
    }

    #[test]
    fn placement_order_pin_then_prefix_then_assigner() {
        let c = cfg(r#","assign":{"mode":"hash","min_capacity":1}"#);
        let idle = states(&[(0, 0); 4]);
        let m = matched(16, 3);
        let never = || -> Option<u32> { panic!("the assigner must not run") };
        // A kept pin wins; the prefix is not even consulted.
        assert_eq!(
            place(
                &c,
                0,
                Some(1),
                Some(&m),
                Some(&idle),
                Request::default(),
                never
            ),
            Placement {
                placed: Placed::Pin(1),
                prefix: None
            }
        );
        // No pin: the prefix (16 blocks outweigh the home's bonus on an idle cluster).
        assert_eq!(
            place(
                &c,
                0,
                None,
                Some(&m),
                Some(&idle),
                Request::default(),
                || Some(0)
            ),
            Placement {
                placed: Placed::Prefix {
                    rank: 3,
                    blocks: 16
                },
                prefix: Some(PrefixChoice::Hit {
                    rank: 3,
                    blocks: 16
                })
            }
        );
        // A pin over the pinned bound (rank 1: 9 of 9 in flight) moves to the prefix's rank.
        let pin_busy = states(&[(0, 0), (9, 0), (0, 0), (0, 0)]);
        assert_eq!(
            place(
                &c,
                0,
                Some(1),
                Some(&m),
                Some(&pin_busy),
                Request::default(),
                || Some(0)
            )
            .placed,
            Placed::Prefix {
                rank: 3,
                blocks: 16
            }
        );
        // The prefix's rank full: the assigner decides, and the skip is reported.
        let prefix_busy = states(&[(0, 0), (0, 0), (0, 0), (5, 0)]);
        assert_eq!(
            place(
                &c,
                0,
                None,
                Some(&m),
                Some(&prefix_busy),
                Request::default(),
                || Some(0)
            ),
            Placement {
                placed: Placed::Assigned(Some(0)),
                prefix: Some(PrefixChoice::SkippedFull {
                    rank: 3,
                    blocks: 16
                })
            }
        );
        // No match, or no chain at all (not consulted).
        assert_eq!(
            place(
                &c,
                0,
                None,
                Some(&Match::default()),
                Some(&idle),
                Request::default(),
                || Some(2)
            ),
            Placement {
                placed: Placed::Assigned(Some(2)),
                prefix: Some(PrefixChoice::Miss)
            }
        );
        assert_eq!(
            place(&c, 0, None, None, Some(&idle), Request::default(), || None),
            Placement {
                placed: Placed::Assigned(None),
                prefix: None
            }
        );
        // Envoy mode: no states, a pin always holds, a match always routes.
        let envoy = cfg(ENVOY_MODE);
        assert_eq!(
            place(
                &envoy,
                0,
                Some(0),
                Some(&m),
                None,
                Request::default(),
                never
            )
            .placed,
            Placed::Pin(0)
        );
        assert_eq!(
            place(&envoy, 0, None, Some(&m), None, Request::default(), never).placed,
            Placed::Prefix {
                rank: 3,
                blocks: 16
            }
        );
    }

    #[test]
    fn keyless_requests_sharing_a_system_prompt_follow_the_first() {
        let c = cfg(PREFIX_ON);
        let (s, idx) = (MemStore::default(), PrefixIndex::new(&c.prefix));
        idx.table().ensure_buckets(&s);
        let system = "You are the support bot of a large company. Be brief. ".repeat(100);
        let chain_of = |user: &str| {
            let body = system_chat(&system, user);
            let (d, chain) =
                decide_body_with_prefix(&c, body.as_bytes(), None, true, Some(Api::Chat));
            assert_eq!(d, Decision::Fallback(Reason::NoKey));
            chain
        };
        // First request: nothing indexed; Envoy (or the assigner) places it on rank 2, then it
        // is recorded under rank 2.
        let first = chain_of("How do I reset my password?");
        let m = idx.longest_match(&s, first.hashes(), 100, c.dp_size);
        let p = place(&c, 100, None, Some(&m), None, Request::default(), || None);
        assert_eq!(p.prefix, Some(PrefixChoice::Miss));
        idx.record(&s, first.hashes(), 2, 100, &m);
        // Another user message after the same system prompt: the prefix sends it to rank 2.
        let second = chain_of("Where is my invoice?");
        let m = idx.longest_match(&s, second.hashes(), 101, c.dp_size);
        assert!(m.blocks * 64 >= system.len() * 2 / 3, "{} blocks", m.blocks);
        let p = place(&c, 101, None, Some(&m), None, Request::default(), || None);
        assert!(matches!(p.placed, Placed::Prefix { rank: 2, .. }), "{p:?}");
        // An unrelated prompt shares nothing.
        let body = system_chat(&"Translate to French. ".repeat(200), "Hello");
        let (_, other) = decide_body_with_prefix(&c, body.as_bytes(), None, true, Some(Api::Chat));
        let m = idx.longest_match(&s, other.hashes(), 101, c.dp_size);
        assert_eq!(m.rank, None);
    }

    /// One row of a plan table: the request's facts and the plan expected.
    struct Row {
        what: &'static str,
        key: Option<KeyFacts>,
        matched: Option<Match>,
        anchor: Option<u64>,
        states: Option<RankStates>,
        want_target: Target,
        want_counters: [Option<Counter>; 3],
    }

    fn key(hash: u64, pinned: Option<u32>) -> Option<KeyFacts> {
        Some(KeyFacts {
            hash,
            pinned,
            tag: 0,
            depth: 0,
        })
    }

    fn check(c: &Config, rows: &[Row]) {
        for r in rows {
            let facts = Facts {
                key: r.key,
                matched: r.matched,
                anchor: r.anchor,
                chain_blocks: 0,
                anchor_kept: Kept::No,
                opening_name: None,
                turn: 0,
            };
            let p = plan(c, 0, &facts, r.states.as_ref(), 10);
            assert_eq!(p.target, r.want_target, "{}", r.what);
            assert_eq!(p.counters, r.want_counters, "{}", r.what);
        }
    }

    /// The rendezvous home of `anchor` on an idle cluster of `c`'s size.
    fn home_of(c: &Config, anchor: u64) -> u32 {
        let idle = states(&vec![(0, 0); c.dp_size as usize]);
        let facts = Facts {
            anchor: Some(anchor),
            ..Facts::default()
        };
        assign(c, &idle, 0, &facts, 1).expect("an idle cluster has a home")
    }

    #[test]
    fn plans_in_hash_mode() {
        let c = cfg(r#","assign":{"mode":"hash","min_capacity":2}"#);
        let idle = || Some(states(&[(0, 0); 4]));
        let home = home_of(&c, 77);
        let busy_pin = states(&[(0, 0), (9, 0), (0, 0), (0, 0)]);
        let down = states(&[(0, 9), (0, 9), (0, 9), (0, 9)]);
        use Counter::*;
        check(
            &c,
            &[
                Row {
                    what: "a held pin decides; nothing to write",
                    key: key(77, Some(1)),
                    matched: None,
                    anchor: None,
                    states: idle(),
                    want_target: Target::Pinned {
                        hash: 77,
                        rank: 1,
                        write_pin: false,
                    },
                    want_counters: [Some(AffinityHit), None, None],
                },
                Row {
                    what: "a new key goes home (the rendezvous rank of the key) and is pinned",
                    key: key(77, None),
                    matched: None,
                    anchor: Some(5),
                    states: idle(),
                    want_target: Target::Pinned {
                        hash: 77,
                        rank: home,
                        write_pin: true,
                    },
                    want_counters: [Some(AffinityMiss), Some(Assigned), None],
                },
                Row {
                    what: "a pin over the bound moves home",
                    key: key(77, Some(1)),
                    matched: None,
                    anchor: None,
                    states: Some(busy_pin),
                    want_target: Target::Pinned {
                        hash: 77,
                        rank: if home == 1 {
                            home_of_busy(&c, 77)
                        } else {
                            home
                        },
                        write_pin: true,
                    },
                    want_counters: [Some(Moved), Some(Assigned), None],
                },
                Row {
                    what: "a deep history on another rank beats the home",
                    key: key(77, None),
                    matched: Some(matched(80, (home + 1) % 4)),
                    anchor: None,
                    states: idle(),
                    want_target: Target::Pinned {
                        hash: 77,
                        rank: (home + 1) % 4,
                        write_pin: true,
                    },
                    want_counters: [Some(AffinityMiss), None, None],
                },
                Row {
                    what: "no key: the anchor's home, nothing to pin",
                    key: None,
                    matched: None,
                    anchor: Some(77),
                    states: idle(),
                    want_target: Target::Direct { rank: home },
                    want_counters: [None, None, None],
                },
                Row {
                    what: "no usable rank, keyed: Envoy balances and the answer teaches",
                    key: key(77, None),
                    matched: None,
                    anchor: None,
                    states: Some(down.clone()),
                    want_target: Target::Learn { hash: 77 },
                    want_counters: [Some(NoUsableRank), None, None],
                },
                Row {
                    what: "no usable rank, keyless: Envoy balances",
                    key: None,
                    matched: None,
                    anchor: Some(77),
                    states: Some(down),
                    want_target: Target::Balanced,
                    want_counters: [Some(NoUsableRank), None, None],
                },
            ],
        );
    }

    /// A home that is not the rendezvous order's first choice says why, and only when the request
    /// went home: behind several replicas these are the placements each replica makes from its
    /// own view of the load.
    #[test]
    fn plans_say_why_the_home_is_not_the_first_choice() {
        let c = cfg(r#","assign":{"mode":"hash"}"#);
        let idle = states(&[(0, 0); 4]);
        let [Some(first), Some(second)] = rendezvous_pair(&idle, 0, c.assign.seed, 77) else {
            panic!("four usable ranks have a pair");
        };
        let mut worked = idle.clone();
        worked.ranks[first as usize].recent = 1000;
        let mut queued = idle.clone();
        queued.ranks[first as usize].inflight = 5;
        let mut full = idle.clone();
        // Floor 8: a rank with 8 in flight is full for a new conversation.
        full.ranks[first as usize].inflight = 8;
        let past_full = plan(
            &c,
            0,
            &Facts {
                anchor: Some(77),
                ..Facts::default()
            },
            Some(&full),
            10,
        );
        assert_ne!(past_full.target.rank(), Some(first));
        use Counter::*;
        check(
            &c,
            &[
                Row {
                    what: "the first was given clearly more work: the second, counted",
                    key: None,
                    matched: None,
                    anchor: Some(77),
                    states: Some(worked.clone()),
                    want_target: Target::Direct { rank: second },
                    want_counters: [None, None, Some(HomeSecondWork)],
                },
                Row {
                    what: "a new key the same way, pinned there",
                    key: key(77, None),
                    matched: None,
                    anchor: None,
                    states: Some(worked.clone()),
                    want_target: Target::Pinned {
                        hash: 77,
                        rank: second,
                        write_pin: true,
                    },
                    want_counters: [Some(AffinityMiss), Some(Assigned), Some(HomeSecondWork)],
                },
                Row {
                    what: "a queue forming on the first: the second, counted",
                    key: None,
                    matched: None,
                    anchor: Some(77),
                    states: Some(queued),
                    want_target: Target::Direct { rank: second },
                    want_counters: [None, None, Some(HomeSecondQueue)],
                },
                Row {
                    what: "the first is full: the next choice, counted",
                    key: None,
                    matched: None,
                    anchor: Some(77),
                    states: Some(full),
                    want_target: past_full.target,
                    want_counters: [None, None, Some(HomeFull)],
                },
                Row {
                    what: "a history on the first decides: the home did not, nothing counted",
                    key: None,
                    matched: Some(matched(80, first)),
                    anchor: Some(77),
                    states: Some(worked),
                    want_target: Target::Direct { rank: first },
                    want_counters: [None, None, None],
                },
                Row {
                    what: "the first choice: nothing counted",
                    key: None,
                    matched: None,
                    anchor: Some(77),
                    states: Some(idle),
                    want_target: Target::Direct { rank: first },
                    want_counters: [None, None, None],
                },
            ],
        );
    }

    /// Where key 77 goes when rank 1 is over the bound.
    fn home_of_busy(c: &Config, hash: u64) -> u32 {
        let busy = states(&[(0, 0), (9, 0), (0, 0), (0, 0)]);
        let facts = Facts {
            key: key(hash, None),
            ..Facts::default()
        };
        assign(c, &busy, 0, &facts, 1).expect("three usable ranks")
    }

    /// A request overruling an untagged pin with its own history, on a rank that is cooling
    /// down, goes home, and its home is the pin's rank: held, but the pin does not take this
    /// other conversation's name.
    #[test]
    fn a_pin_held_although_overruled_learns_no_name() {
        let c = cfg("");
        let mut st = states(&[(0, 0); 4]);
        let (pin, history) = (1u32, 2u32);
        st.ranks[history as usize].down_until = 99;
        let anchor = (0u64..)
            .find(|&a| rendezvous_pair(&st, 0, c.assign.seed, a)[0] == Some(pin))
            .expect("an anchor whose home is the pin's rank");
        let facts = Facts {
            key: Some(KeyFacts {
                hash: 7,
                pinned: Some(pin),
                tag: 0,
                depth: 0,
            }),
            matched: Some(matched(40, history)),
            anchor: Some(anchor),
            chain_blocks: 60,
            anchor_kept: Kept::Yes,
            opening_name: Some(9),
            turn: 0,
        };
        let p = plan(&c, 0, &facts, Some(&st), 60);
        assert_eq!(
            p.target,
            Target::Pinned {
                hash: 7,
                rank: pin,
                write_pin: false
            }
        );
    }

    /// A key that many conversations share (an end user's id, an application's cache key):
    /// the prompt tells which conversation a request continues, and overrules the pin when the
    /// two disagree. A key of one conversation keeps its pin.
    #[test]
    fn a_key_shared_by_many_conversations_yields_to_their_prompts() {
        let c = cfg(r#","prefix":{"enabled":true}"#);
        let idle = states(&[(0, 0); 4]);
        let prompt_home = home_of(&c, 5);
        let tag = 1 + (5 % u64::from(table::MAX_TAG)) as u8;
        let other = (prompt_home + 1) % 4;
        let third = (prompt_home + 2) % 4;
        let shared = |blocks, rank| Match {
            branched: true,
            ..matched(blocks, rank)
        };
        let history_held_by_pin = Match {
            holders: table::holder_flag(other),
            ..matched(40, third)
        };
        let pinned_to = |rank, write_pin| Target::Pinned {
            hash: 77,
            rank,
            write_pin,
        };
        // Pins whose tag was taken past the 4-block shared prefix the rows match.
        let pin = |pinned, tag| {
            Some(KeyFacts {
                hash: 77,
                pinned,
                tag,
                depth: 4,
            })
        };
        // Pins whose tag was taken past nothing (no prefix of the prompt was indexed).
        let unshared = |pinned, tag| {
            Some(KeyFacts {
                depth: 0,
                ..pin(pinned, tag).unwrap()
            })
        };
        use Counter::*;
        // (what, key, match, chain blocks, target, counters)
        let rows = [
            (
                "its own history on the pin: the pin decides",
                pin(Some(other), tag + 1),
                Some(matched(40, other)),
                60,
                pinned_to(other, false),
                [Some(AffinityHit), None, None],
            ),
            (
                "its own history on another rank: the history decides, the pin stays",
                pin(Some(other), tag),
                Some(matched(40, third)),
                60,
                pinned_to(third, false),
                [Some(KeyOverruled), None, None],
            ),
            (
                "its own history elsewhere, but the pin's rank holds it too (the key moved there)",
                pin(Some(other), tag),
                Some(history_held_by_pin),
                60,
                pinned_to(other, false),
                [Some(AffinityHit), None, None],
            ),
            (
                "nothing of its own indexed, another conversation's pin: the prompt's home",
                pin(Some(other), tag + 1),
                Some(shared(4, other)),
                20,
                pinned_to(prompt_home, false),
                [Some(KeyOverruled), None, None],
            ),
            (
                "nothing indexed at all: not known to be another conversation, the pin decides",
                pin(Some(other), tag + 1),
                Some(Match::default()),
                20,
                pinned_to(other, false),
                [Some(AffinityHit), None, None],
            ),
            (
                "another conversation's tag, taken past a shared prefix of another depth on the \
                 pin's rank (its own ends, branched by its own turns): the pin decides",
                Some(KeyFacts {
                    depth: 6,
                    ..pin(Some(other), tag + 1).unwrap()
                }),
                Some(shared(4, other)),
                20,
                pinned_to(other, false),
                [Some(AffinityHit), None, None],
            ),
            (
                "another conversation's tag, past a shared prefix of another depth held \
                 elsewhere (a shared document): the prompt's home",
                Some(KeyFacts {
                    depth: 6,
                    ..pin(Some(other), tag + 1).unwrap()
                }),
                Some(shared(4, third)),
                20,
                pinned_to(prompt_home, false),
                [Some(KeyOverruled), None, None],
            ),
            (
                "nothing of its own indexed, its own conversation's pin: the pin decides",
                pin(Some(other), tag),
                Some(shared(4, other)),
                20,
                pinned_to(other, false),
                [Some(AffinityHit), None, None],
            ),
            (
                "a pin whose conversation is not known (its first turn was all shared): the \
                 pin decides and learns this one",
                pin(Some(other), 0),
                Some(shared(4, other)),
                20,
                pinned_to(other, true),
                [Some(AffinityHit), None, None],
            ),
            (
                "a prompt with nothing of its own past a shared prefix: the pin decides",
                pin(Some(other), tag + 1),
                Some(shared(4, third)),
                4,
                pinned_to(other, false),
                [Some(AffinityHit), None, None],
            ),
            (
                "overruled, and the prompt's home is the pin: held",
                pin(Some(prompt_home), tag + 1),
                Some(shared(4, third)),
                20,
                pinned_to(prompt_home, false),
                [Some(AffinityHit), None, None],
            ),
            (
                "no prompt chain: the pin decides",
                pin(Some(other), tag + 1),
                None,
                0,
                pinned_to(other, false),
                [Some(AffinityHit), None, None],
            ),
            (
                "nothing indexed at all, a pin another conversation wrote past nothing (no \
                 shared prefix anywhere): the prompt's home",
                unshared(Some(other), tag + 1),
                Some(Match::default()),
                20,
                pinned_to(prompt_home, false),
                [Some(KeyOverruled), None, None],
            ),
            (
                "nothing indexed at all, its own conversation's pin written past nothing: the \
                 pin decides",
                unshared(Some(other), tag),
                Some(Match::default()),
                20,
                pinned_to(other, false),
                [Some(AffinityHit), None, None],
            ),
            (
                "a pin named past nothing, a prompt past a shared prefix (its first turn came \
                 before the prefix was known to be shared): the pin decides and learns this name",
                unshared(Some(other), tag + 1),
                Some(shared(4, third)),
                20,
                pinned_to(other, true),
                [Some(AffinityHit), None, None],
            ),
            (
                "a pin named past nothing, the same name past a shared prefix: the pin decides \
                 and learns the deeper name",
                unshared(Some(other), tag),
                Some(shared(4, other)),
                20,
                pinned_to(other, true),
                [Some(AffinityHit), None, None],
            ),
            (
                "a key seen first goes to the key's home whatever its prompt, pinned with its tag",
                pin(None, 0),
                Some(shared(4, third)),
                60,
                pinned_to(home_of(&c, 77), true),
                [Some(AffinityMiss), Some(Assigned), None],
            ),
        ];
        // Overruled while no rank is usable: Envoy balances, and the pin (another
        // conversation's) is not rewritten from this answer, as a Learn target would.
        let down = states(&[(0, 100); 4]);
        let overruled_facts = Facts {
            key: pin(Some(other), tag + 1),
            matched: Some(shared(4, other)),
            anchor: Some(5),
            chain_blocks: 20,
            anchor_kept: Kept::Yes,
            opening_name: None,
            turn: 0,
        };
        let p = plan(&c, 0, &overruled_facts, Some(&down), 20);
        assert_eq!(
            (p.target, p.counters),
            (Target::Balanced, [Some(NoUsableRank), None, None])
        );
        let known = |m: Option<Match>| Tag {
            tag,
            depth: m.map_or(0, |m| m.blocks as u16),
        };
        for (what, key, m, chain_blocks, target, counters) in rows {
            let facts = Facts {
                key,
                matched: m,
                anchor: Some(5),
                chain_blocks,
                anchor_kept: Kept::Yes,
                opening_name: None,
                turn: 0,
            };
            let p = plan(&c, 0, &facts, Some(&idle), chain_blocks as u32);
            assert_eq!((p.target, p.counters), (target, counters), "{what}");
            // A written pin carries the request's tag, or keeps its own when the request has none.
            if let Target::Pinned {
                write_pin: true, ..
            } = p.target
            {
                assert_eq!(p.pin_tag, known(m), "{what}");
            }
            // An anchor the next turn does not keep (the chain's last block) names no
            // conversation: the same request then leaves the pin alone.
            let unstable = plan(
                &c,
                0,
                &Facts {
                    anchor_kept: Kept::No,
                    opening_name: None,
                    ..facts
                },
                Some(&idle),
                chain_blocks as u32,
            );
            if key.is_some_and(|k| k.pinned.is_some())
                && m.is_some_and(|m| m.branched || m.blocks == 0)
            {
                assert_eq!(
                    unstable.target,
                    pinned_to(key.and_then(|k| k.pinned).unwrap(), false),
                    "{what}, anchor not kept"
                );
            }
        }
        // A pin on a rank without a holder flag (13 and up) is never overruled by a history
        // elsewhere: that its rank holds the history too could not have been recorded.
        let wide = Config::from_json(br#"{"dp_size":16,"prefix":{"enabled":true}}"#).unwrap();
        let facts = Facts {
            key: Some(KeyFacts {
                hash: 77,
                pinned: Some(13),
                tag,
                depth: 4,
            }),
            matched: Some(matched(40, 3)),
            anchor: Some(5),
            chain_blocks: 60,
            anchor_kept: Kept::Yes,
            opening_name: None,
            turn: 0,
        };
        let p = plan(&wide, 0, &facts, Some(&states(&[(0, 0); 16])), 60);
        assert_eq!(
            (p.target, p.counters[0]),
            (
                Target::Pinned {
                    hash: 77,
                    rank: 13,
                    write_pin: false
                },
                Some(AffinityHit)
            )
        );
        // A name taken past nothing, or at a last block inside the opening, is stored only from
        // a chat seen to resend its messages (one that went on past its opening): it overrules
        // another conversation's pin either way.
        let unshared_pin = |tag| {
            Some(KeyFacts {
                hash: 77,
                pinned: Some(other),
                tag,
                depth: 0,
            })
        };
        let inside = |key, m, past_opening: bool| Facts {
            key,
            matched: Some(m),
            anchor: Some(5),
            chain_blocks: 20,
            anchor_kept: Kept::InsideOpening,
            opening_name: past_opening.then_some(5),
            turn: 0,
        };
        for past_opening in [false, true] {
            let sure = |t: Tag| if past_opening { t } else { Tag::default() };
            let first = plan(
                &c,
                0,
                &inside(pin(None, 0), Match::default(), past_opening),
                Some(&idle),
                20,
            );
            assert_eq!(first.counters[0], Some(AffinityMiss));
            assert_eq!(
                first.pin_tag,
                sure(Tag { tag, depth: 0 }),
                "past opening {past_opening}"
            );
            let learns = plan(
                &c,
                0,
                &inside(unshared_pin(0), Match::default(), past_opening),
                Some(&idle),
                20,
            );
            assert_eq!(
                learns.target,
                pinned_to(other, past_opening),
                "past opening {past_opening}"
            );
            let deeper = plan(
                &c,
                0,
                &inside(pin(Some(other), 0), shared(4, other), past_opening),
                Some(&idle),
                20,
            );
            assert_eq!(
                deeper.target,
                pinned_to(other, past_opening),
                "past opening {past_opening}"
            );
            if past_opening {
                assert_eq!(deeper.pin_tag, known(Some(shared(4, other))));
            }
            let another = plan(
                &c,
                0,
                &inside(unshared_pin(tag + 1), Match::default(), past_opening),
                Some(&idle),
                20,
            );
            assert_eq!(
                (another.target, another.counters[0]),
                (pinned_to(prompt_home, false), Some(KeyOverruled)),
                "past opening {past_opening}"
            );
        }
        // A turn of its own history on a pin that knows no name teaches it the conversation's
        // name past nothing, when it is a chat seen to resend its messages.
        for (pin_tag, name, learns) in [(0, Some(9), true), (0, None, false), (tag, Some(9), false)]
        {
            let own = Facts {
                key: unshared_pin(pin_tag),
                matched: Some(matched(40, other)),
                anchor: Some(5),
                chain_blocks: 60,
                anchor_kept: Kept::Yes,
                opening_name: name,
                turn: 0,
            };
            let p = plan(&c, 0, &own, Some(&idle), 60);
            assert_eq!(
                p.target,
                pinned_to(other, learns),
                "pin tag {pin_tag}, name {name:?}"
            );
            if learns {
                assert_eq!(p.pin_tag, unshared_tag(9));
            }
        }
        // A pin that moves (its rank cooling down) keeps its tag when the request knows none.
        let mut down = states(&[(0, 0); 4]);
        down.ranks[other as usize].down_until = 99;
        let moving = Facts {
            key: pin(Some(other), tag),
            matched: Some(matched(40, other)),
            anchor: Some(5),
            chain_blocks: 60,
            anchor_kept: Kept::Yes,
            opening_name: None,
            turn: 0,
        };
        let p = plan(&c, 0, &moving, Some(&down), 60);
        assert!(
            matches!(p.target, Target::Pinned { rank, write_pin: true, .. } if rank != other),
            "{p:?}"
        );
        assert_eq!(p.pin_tag, Tag { tag, depth: 4 });
        // ... and when the request knows only its name past nothing: the name past the shared
        // prefix is the one new conversations under the key are compared with. A pin that
        // knows no name, or one past nothing, takes the request's.
        for (key, stored) in [
            (pin(Some(other), tag), Tag { tag, depth: 4 }),
            (pin(Some(other), 0), unshared_tag(9)),
            (unshared_pin(tag), unshared_tag(9)),
        ] {
            let named = Facts {
                key,
                opening_name: Some(9),
                ..moving
            };
            let p = plan(&c, 0, &named, Some(&down), 60);
            assert!(
                matches!(p.target, Target::Pinned { rank, write_pin: true, .. } if rank != other),
                "{p:?}"
            );
            assert_eq!(p.pin_tag, stored, "{key:?}");
        }
    }

    #[test]
    fn plans_in_envoy_mode() {
        let c = cfg(ENVOY_MODE);
        use Counter::*;
        check(
            &c,
            &[
                Row {
                    what: "a pin decides over a shared prefix elsewhere (no load is counted)",
                    key: key(9, Some(2)),
                    matched: Some(Match {
                        branched: true,
                        ..matched(80, 1)
                    }),
                    anchor: None,
                    states: None,
                    want_target: Target::Pinned {
                        hash: 9,
                        rank: 2,
                        write_pin: false,
                    },
                    want_counters: [Some(AffinityHit), None, None],
                },
                Row {
                    what: "a new key follows its prompt's prefix and is pinned at once",
                    key: key(9, None),
                    matched: Some(matched(80, 1)),
                    anchor: None,
                    states: None,
                    want_target: Target::Pinned {
                        hash: 9,
                        rank: 1,
                        write_pin: true,
                    },
                    want_counters: [Some(AffinityMiss), None, None],
                },
                Row {
                    what: "a new key without a match: Envoy balances, the answer teaches",
                    key: key(9, None),
                    matched: None,
                    anchor: Some(3),
                    states: None,
                    want_target: Target::Learn { hash: 9 },
                    want_counters: [Some(AffinityMiss), None, None],
                },
                Row {
                    what: "keyless with a match goes to it",
                    key: None,
                    matched: Some(matched(80, 3)),
                    anchor: None,
                    states: None,
                    want_target: Target::Direct { rank: 3 },
                    want_counters: [None, None, None],
                },
                Row {
                    what: "keyless without: Envoy balances, nothing counted",
                    key: None,
                    matched: None,
                    anchor: Some(3),
                    states: None,
                    want_target: Target::Balanced,
                    want_counters: [None, None, None],
                },
            ],
        );
    }

    #[test]
    fn a_short_own_history_stays_on_either_rank_of_its_home_pair() {
        let c = cfg(r#","assign":{"mode":"hash","min_capacity":8}"#);
        let idle = states(&[(0, 0); 4]);
        let anchor = 77;
        let [Some(first), Some(second)] = rendezvous_pair(&idle, 0, c.assign.seed, anchor) else {
            panic!("four usable ranks have a pair");
        };
        let outside = (0..4).find(|r| ![first, second].contains(r)).unwrap_or(0);
        let at = |m: Match| {
            let facts = Facts {
                matched: Some(m),
                anchor: Some(anchor),
                ..Facts::default()
            };
            plan(&c, 0, &facts, Some(&idle), 10).target
        };
        // 8 blocks of its own history do not outweigh the home's bonus (8): on the second of
        // the pair they stay (the load chose it on an earlier turn)...
        assert_eq!(at(matched(8, second)), Target::Direct { rank: second });
        // ...elsewhere, and for a shared prefix on the second, the request goes home.
        assert_eq!(at(matched(8, outside)), Target::Direct { rank: first });
        let shared_there = Match {
            branched: true,
            ..matched(8, second)
        };
        assert_eq!(at(shared_there), Target::Direct { rank: first });
        // The load still counts once a queue is forming: 8 more in flight on the second than at
        // home, 4 beyond the queue margin, cost 2 × 4 = 8 blocks, as much as the history saves,
        // so the request goes home; 7 more do not. (Counting every request, a history of a few
        // blocks went back and forth between its two homes over a request or two.)
        let mut loads = vec![(0, 0); 4];
        loads[second as usize] = (8, 0);
        let busy = states(&loads);
        let facts = Facts {
            matched: Some(matched(8, second)),
            anchor: Some(anchor),
            ..Facts::default()
        };
        assert_eq!(
            plan(&c, 0, &facts, Some(&busy), 10).target,
            Target::Direct { rank: first }
        );
        loads[second as usize] = (7, 0);
        assert_eq!(
            plan(&c, 0, &facts, Some(&states(&loads)), 10).target,
            Target::Direct { rank: second }
        );
    }

    /// A pin moved off a full rank goes to a rank that is not full, in round robin too (which
    /// used to take the next rank in turn, the full one included).
    #[test]
    fn round_robin_moves_a_pin_off_a_full_rank_for_good() {
        let c = cfg(r#","assign":{"mode":"round_robin","min_capacity":1}"#);
        let busy = states(&[(9, 0), (0, 0), (0, 0), (0, 0)]);
        let facts = Facts {
            key: Some(KeyFacts {
                hash: 7,
                pinned: Some(0),
                tag: 0,
                depth: 0,
            }),
            turn: 0,
            ..Facts::default()
        };
        let p = plan(&c, 0, &facts, Some(&busy), 10);
        assert!(
            matches!(
                p.target,
                Target::Pinned {
                    rank: 1,
                    write_pin: true,
                    ..
                }
            ),
            "{p:?}"
        );
        assert_eq!(p.counters[0], Some(Counter::Moved), "{p:?}");
    }

    #[test]
    fn each_mode_assigns_its_way() {
        let loads = states(&[(3, 0), (1, 0), (1, 0), (2, 0)]);
        let at = |mode: &str, turn: u32, anchor: Option<u64>| {
            let c = cfg(&format!(
                r#","assign":{{"mode":"{mode}","min_capacity":8}},"prefix":{{"enabled":false}}"#
            ));
            let facts = Facts {
                anchor,
                turn,
                ..Facts::default()
            };
            assign(&c, &loads, 0, &facts, 1)
        };
        // Least in flight, ties rotated by the turn.
        assert_eq!(at("least_inflight", 0, None), Some(1));
        assert_eq!(at("least_inflight", 2, None), Some(2));
        // Round robin: the next rank from the turn under the bound (none is full here).
        assert_eq!(at("round_robin", 3, None), Some(3));
        assert_eq!(at("round_robin", 5, None), Some(1));
        // Room mode places what has no room like least_inflight.
        assert_eq!(at("bootstrap_room", 0, None), Some(1));
        // Hash: a function of the anchor alone on equal loads; least in flight without one.
        assert_eq!(at("hash", 0, Some(42)), at("hash", 7, Some(42)));
        assert_eq!(at("hash", 0, None), Some(1));
        assert_eq!(at("envoy", 0, Some(42)), None);
    }
}
