//! Prefix-aware placement without a routing key: the request's canonical prompt is cut
//! into fixed-size blocks hashed as a chain, and a second bounded table in shared data (the
//! *prefix index*) maps chained block hashes to the rank that served them. A request whose leading
//! blocks are in the index can go where that prefix is already cached.
//!
//! Pure core: nothing here touches the host. The caller (decision layer, host glue) builds a
//! [`PrefixHasher`] and a [`PrefixIndex`] at configure time, runs [`scan_prompt`] (or
//! [`prompt_chain`]) on the request body, [`PrefixIndex::longest_match`] when the prefix may
//! decide, and [`PrefixIndex::record`] once the serving rank is known.
//!
//! Where it is wired: `config` reads the `prefix` section into a [`PrefixConfig`] and keys the
//! [`PrefixHasher`] with `routing_key.hash_seed`; `extract::scan_body_and_prompt` runs
//! [`scan_prompt`] with the body fields the filter wants (one pass); `placement::plan` puts the
//! match after the key's pin, weighed against the request's home (`placement::prefix_choice_at`),
//! which also applies the load bound to the matched rank; the host records the chain under the serving rank and calls
//! [`PrefixIndex::forget`] when that rank fails the request.
//!
//! The modules: `prompt` reads the canonical prompt out of the body, `chain` hashes it into
//! chained block hashes, this one indexes them; `config_sections` holds [`PrefixConfig`].
//!
//! [`PrefixHasher`]: crate::chain::PrefixHasher
//! [`scan_prompt`]: crate::prompt::scan_prompt
//! [`prompt_chain`]: crate::prompt::prompt_chain
//!
//! # The index
//!
//! An [`AffinityTable`] with its own namespace: fixed buckets × ways of 16-byte entries (chained
//! hash, rank and tag, flags, last use), LRU within a bucket, idle TTL, compare-and-swap writes. Memory is
//! `buckets × ways × 16` bytes whatever the traffic (16 MiB by default).
//!
//! **Sparse positions.** Writing every block of every chain would cost one compare-and-swap
//! (a shared-data read and a write, ~3.5 µs in Envoy) per block: 128 for a 64 KiB prompt. The
//! index holds a chain only at *grid* positions: block counts `p >= min_match_blocks` whose binary
//! form has at most `grid_bits` significant bits (1, 2, 3, 4, 6, 8, 12, 16, 24, ... for 2 bits),
//! plus `max_blocks`, the length every long prompt ends at. With the defaults a chain has at most
//! 18 grid positions: 1 2 3 4 6 8 12 16 24 32 48 64 96 128 192 256 384 512.
//! - Precision: a match is reported at the deepest grid position the index holds, at least 2/3
//!   of the true shared prefix (exact up to 4 blocks); 3 bits give 4/5 at 24 positions.
//! - Writes: [`PrefixIndex::record`] writes only the grid positions beyond the match, bottom up
//!   (a concurrent lookup never sees a position without those below it): up to 14 for a new
//!   64 KiB prompt, 18 for 256 KiB; for a conversation's next turn usually none, one when it
//!   crosses a grid position, so at most 18 over its whole life (instead of one per block per turn).
//! - Reads: chains are prefix-closed (a position is written only after the ones below it), so
//!   presence is monotone over the grid and [`PrefixIndex::longest_match`] searches it: the
//!   deepest position first (1 read: every turn of a conversation that did not cross a grid
//!   position, and every repeat of a capped prompt), then the next one down (2 reads: a turn
//!   that crossed one), then the shallowest (3 reads: a prompt sharing nothing), then a binary
//!   search in between: at most `3 + ceil(log2(t - 2))` reads for `t` grid positions, 7 with the
//!   defaults. Looking at the top first also keeps the search on entries that are fresh: those a
//!   conversation's last turns wrote or refreshed.
//! - Freshness: every entry the search finds is refreshed in the same step when older than
//!   `refresh_seconds` (one write with the compare-and-swap token of the read just made, as the
//!   affinity table does), so the entries that routing actually uses stay recent for the LRU and
//!   the TTL, and entries nobody matches age out. An evicted or expired entry below live ones
//!   only shortens a match if the search happens to probe it, and the next record rewrites it.
//! - Fine positions past a match: past a long shared prefix (an agent's 96 KiB of
//!   instructions ends at grid position 192; the next is 256) a conversation's own part may take
//!   many turns to reach the next grid position, and until then the grid sees none of its
//!   history: every turn would be placed like a new conversation. So when a chain goes past its
//!   grid match `m`, it is also indexed at `m`'s *fine* positions `m + 1, m + 2, m + 4, …`
//!   below the next grid position, written bottom up and searched like the grid (top first,
//!   then binary search): the next turn finds its own history there. The same when `m` is the
//!   deepest grid position a new prompt has: it indexes its tail there, so that the first other
//!   conversation behind the same long prefix, which matches all of its grid positions, finds
//!   that it went on differently (and, recording its own, marks `m` branched for every later
//!   one). Past an unshared match too: a conversation's turn that crossed the next grid position
//!   finds where its previous turn ended (and was tagged, below) rather than the grid position
//!   before it, and a block-id trace's turns, which replace their previous turn's last block,
//!   growing by less than a block a turn keep matching their own latest turn instead of the
//!   grid position all of them went on from. Cost: the fine search's reads — a prompt going
//!   past the grid position it matched searches that position's fine positions too, so a
//!   conversation's next turn usually costs 2–3 reads rather than the 1 above (one more for a
//!   new conversation behind a short system prompt: 4 blocks have one fine position, 5, below
//!   6; up to 3 more, all misses, for a prompt sharing a grid position with one that went
//!   straight past it) — and one write per fine position a conversation passes, once
//!   ([`Match::fine_base`] carries the base from the lookup to the writes).
//!
//! Each hash maps to one rank: the last to record a position beyond what it matched. A request
//! placed elsewhere than its match (the matched rank was full) records only the positions beyond
//! the match, so a position keeps pointing at a rank that holds at least that prefix.
//!
//! # Shared prefixes and a conversation's own history
//!
//! A match means two different things. A conversation's next turn matches the deepest position
//! its previous turn recorded: moving it elsewhere recomputes its whole history. A new prompt that
//! opens with a popular system prompt or document matches where that prefix ends: every rank can
//! compute it once and then serve it, and sending all such prompts to the rank that happened to
//! see the prefix first would pile them up there. The index tells them apart with one flag per
//! entry: when a request records positions beyond its match, the matched position is marked
//! *branched* (a prompt went on past it). A later request whose match stops at a branched
//! position is therefore not that prompt's continuation (it would have matched deeper) but
//! another prompt sharing the prefix; `placement::prefix_choice_at` weighs what it saves against
//! the request's home (`prefix.load_blocks`, `prefix.home_blocks`). A conversation's own turns keep matching unmarked
//! positions: each turn marks the position it matched, and the next turn matches deeper.
//! Ranks that served a request sharing a position, other than the position's own, are
//! remembered in the same flags (*holders*, ranks 0–12), so a shared prefix goes to the least
//! loaded rank already holding it before it is copied to yet another one.
//!
//! The two entries where a prompt ends also remember where its anchor was taken (the entry's
//! 4-bit tag, see [`PrefixIndex::anchor`]): the conversation's next turn, which matches there, is
//! named as its earlier turns were, instead of by the position past a match that deepens every
//! turn. They are flagged as a prompt's end, also where the tag cannot hold the anchor's
//! position. Such an end is marked *continued*, not branched, by the first prompt that goes on
//! past it, and branched by the second: a block-id trace's next turn replaces its previous turn's
//! partial last block, so when a turn grows by less than a block or two it matches where the
//! previous turn went on from (that turn's match), which it would otherwise read as branched by
//! that very turn and be named past it, a new name every other turn.

use std::cell::Cell;

use crate::chain::Opening;
use crate::config_sections::PrefixConfig;
use crate::table::{
    holder_flag, AffinityTable, Lookup, Store, StoreError, Stored, TableEvents, FLAG_BRANCHED,
    FLAG_CONTINUED, FLAG_END, MAX_TAG,
};

/// What [`PrefixIndex::longest_match`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Match {
    /// Leading blocks of the chain found in the index (an indexed position: on the grid, or one
    /// of `fine_base`'s fine positions; 0 = none). A lower bound of the true shared prefix, to
    /// the index's precision; never below `min_match_blocks` when non-zero.
    pub blocks: usize,
    /// The rank recorded at that position (always in `0..dp_size`); `None` = no match.
    pub rank: Option<u32>,
    /// The position is marked branched: another prompt already continued past it, so this
    /// request shares only this prefix with others (a system prompt, a document) and is not that
    /// prompt's next turn.
    pub branched: bool,
    /// Holder flags of that position ([`holder_flag`]): other ranks known to hold the prefix too
    /// (requests sharing it were served there).
    pub holders: u16,
    /// The position is marked continued: one prompt went on past it where the prompt that
    /// recorded it ended. Still read as a conversation's own history (unbranched): a next
    /// turn that does not repeat its previous turn's last block exactly matches here, at the
    /// point that turn went on from. The next prompt to go on past it marks it branched.
    pub continued: bool,
    /// The position is one of the two a prompt recorded last, at its end: the first prompt to
    /// go on past it may be that prompt's next turn, and marks it continued, not branched.
    pub ended: bool,
    /// How the request that recorded that position was anchored (`None`: not known), so that
    /// the conversation's next turn, whose match on its own history ends deeper, is named as
    /// its earlier turns were (see [`PrefixIndex::anchor`]).
    pub anchored_at: Option<AnchorAt>,
    /// The grid position whose *fine* positions this chain is indexed at too (0: none): its
    /// grid match, when the chain ends before the next grid position (see the module doc).
    pub fine_base: usize,
    /// Store reads made.
    pub reads: u32,
    /// Store writes made (refreshes of found entries older than `refresh_seconds`).
    pub refreshes: u32,
}

/// Where a request's anchor was taken (see [`PrefixIndex::anchor`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnchorAt {
    /// The chain's hash at this indexed position (or at the chain's end, when it is shorter).
    Position(usize),
    /// The chat's opening.
    Opening,
}

/// A request's anchor: the hash that names its conversation, and where it was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchor {
    pub hash: u64,
    pub at: AnchorAt,
    /// Whether the conversation's next turns take the same name.
    pub kept: Kept,
}

/// Whether a conversation's next turns name it as this one does (see [`PrefixIndex::anchor`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kept {
    /// Taken at the chain's last block (or a shorter chain's stand-in for a position it did not
    /// reach): the next turn extends or replaces that block (a block-id trace's turns replace
    /// their last, partial block).
    #[default]
    No,
    /// The chain's last block, where the next turns name it too, inside a chat's opening: kept
    /// when the client resends its messages, as chat clients do, but not when it folds the
    /// conversation into one growing message, whose opening changes every turn.
    InsideOpening,
    /// A chat's opening, or a position the chain goes past.
    Yes,
}

/// The tag of an entry recorded by a request anchored by its opening; a position is tagged
/// with its index on the grid plus one (0: not known, or beyond what 4 bits hold).
const TAG_OPENING: u8 = MAX_TAG;

/// A request anchored by its opening.
fn opened(o: Opening) -> Anchor {
    Anchor {
        kept: Kept::Yes,
        hash: o.hash,
        at: AnchorAt::Opening,
    }
}

/// The prefix index over a store. Cheap to build once per configuration.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    table: AffinityTable,
    /// Indexed positions (block counts), ascending.
    grid: Vec<u32>,
}

impl PrefixIndex {
    pub fn new(cfg: &PrefixConfig) -> Self {
        let max = cfg.max_blocks() as u32;
        let min = cfg.min_match_blocks.max(1);
        let bits = cfg.grid_bits.clamp(1, 32);
        let grid = (min..=max)
            .filter(|&p| p == max || on_grid(p, bits))
            .collect();
        PrefixIndex {
            table: AffinityTable::new(cfg.table.clone()),
            grid,
        }
    }

    /// The table underneath (for `ensure_buckets` at configure time).
    pub fn table(&self) -> &AffinityTable {
        &self.table
    }

    /// Every indexed position (block count), ascending.
    pub fn grid(&self) -> &[u32] {
        &self.grid
    }

    /// Grid positions of a chain of `len` blocks.
    fn positions(&self, len: usize) -> &[u32] {
        let n = self.grid.partition_point(|&p| p as usize <= len);
        self.grid.get(..n).unwrap_or(&[])
    }

    /// The first grid position past `p`.
    fn next_grid(&self, p: usize) -> Option<usize> {
        let i = self.grid.partition_point(|&q| q as usize <= p);
        self.grid.get(i).map(|&q| q as usize)
    }

    /// The fine positions of grid position `base` in a chain of `len` blocks, ascending:
    /// `base + 1`, `base + 2`, `base + 4`, … up to `len` and below the next grid position.
    fn fine_positions(
        &self,
        base: usize,
        len: usize,
    ) -> impl DoubleEndedIterator<Item = u32> + use<> {
        let base32 = base as u32;
        (0..self.fine_count(base, len) as u32).map(move |j| base32 + (1 << j))
    }

    /// How many fine positions grid position `base` has in a chain of `len` blocks (0 for no
    /// base).
    fn fine_count(&self, base: usize, len: usize) -> usize {
        let end = len.min(self.next_grid(base).unwrap_or(usize::MAX).saturating_sub(1));
        match end.checked_sub(base) {
            Some(span) if base > 0 && span > 0 => span.ilog2() as usize + 1,
            _ => 0,
        }
    }

    /// Every indexed position of a chain of `len` blocks whose fine base is `fine_base`,
    /// ascending: the grid's, with the base's fine positions in between, and with `tail` the
    /// fine positions of the chain's deepest grid position too.
    fn indexed(
        &self,
        len: usize,
        fine_base: usize,
        tail: bool,
    ) -> impl DoubleEndedIterator<Item = u32> + '_ {
        let grid = self.positions(len);
        let split = grid.partition_point(|&p| p as usize <= fine_base);
        let (below, above) = grid.split_at(split);
        let last = grid.last().map_or(0, |&p| p as usize);
        let tail_base = if tail && last != fine_base { last } else { 0 };
        below
            .iter()
            .copied()
            .chain(self.fine_positions(fine_base, len))
            .chain(above.iter().copied())
            .chain(self.fine_positions(tail_base, len))
    }

    /// The positions [`record`](Self::record) writes for a chain of `len` blocks (those beyond
    /// `matched` among them): the lookup's fine base, and a new prompt's tail. A prompt the
    /// index has never seen indexes where it ends at fine positions, so that the next prompt
    /// sharing all of its grid positions (a second conversation behind the same long prefix,
    /// which ends before the next grid position) can tell that it went on differently.
    fn recorded(&self, len: usize, matched: &Match) -> impl DoubleEndedIterator<Item = u32> + '_ {
        self.indexed(len, matched.fine_base, matched.blocks == 0)
    }

    /// The deepest indexed position of `chain` present in the index on a rank in `0..dp_size`,
    /// searched as the module doc describes. Found entries older than `refresh_seconds` are
    /// refreshed (one write each, with the token of the read).
    pub fn longest_match(&self, store: &dyn Store, chain: &[u64], now: u32, dp_size: u32) -> Match {
        let counting = CountingStore::new(store);
        let probe = |p: u32| {
            let h = *chain.get((p as usize).checked_sub(1)?)?;
            match self.table.lookup_flagged(&counting, h, now, dp_size) {
                (Lookup::Hit { rank }, flags, tag) => Some((p, rank, flags, tag)),
                (Lookup::Miss | Lookup::Undecodable, _, _) => None,
            }
        };
        let pos = self.positions(chain.len());
        let mut found = search(pos.len(), |i| probe(*pos.get(i)?)).map(|(_, hit)| hit);
        // Past a shared (branched) prefix, the prompt's own history is searched at the match's
        // fine positions: a conversation's turns behind a long shared prefix may not reach the
        // next grid position for a while. So is a prompt ending past the deepest grid position
        // it has, where a new prompt recorded its tail: the other conversation that shares
        // all of its grid positions finds out there (and marks the match branched). And so is
        // a prompt going past any other grid match: the previous turn of a conversation that
        // has now crossed the next grid position may have ended there and tagged its end there,
        // not at the grid match (found at the grid match, the turn would be named past it: a
        // new name, a new home, for a history under `home_blocks`); and a block-id trace's turn
        // growing by less than a block matches the grid position its previous turn went on
        // from, again and again, unless that turn indexed its own part past it. In each case
        // the chain is indexed at those fine positions too (`fine_base`).
        let fine_base = match found {
            Some((p, _, _, _)) if (p as usize) < chain.len() => p as usize,
            _ => 0,
        };
        let fine_count = self.fine_count(fine_base, chain.len());
        let fine_at = |i: usize| (fine_base + (1 << i)) as u32;
        if let Some((_, deeper)) = search(fine_count, |i| probe(fine_at(i))) {
            found = Some(deeper);
        }
        let fine_base = if fine_count == 0 { 0 } else { fine_base };
        Match {
            blocks: found.map_or(0, |(p, _, _, _)| p as usize),
            rank: found.map(|(_, rank, _, _)| rank),
            branched: found.is_some_and(|(_, _, flags, _)| flags & FLAG_BRANCHED != 0),
            holders: found.map_or(0, |(_, _, flags, _)| {
                flags & !(FLAG_BRANCHED | FLAG_END | FLAG_CONTINUED)
            }),
            continued: found.is_some_and(|(_, _, flags, _)| flags & FLAG_CONTINUED != 0),
            ended: found.is_some_and(|(_, _, flags, _)| flags & FLAG_END != 0),
            anchored_at: found.and_then(|(_, _, _, tag)| self.anchored_at(tag)),
            fine_base,
            reads: counting.reads.get(),
            refreshes: counting.writes.get(),
        }
    }

    /// Records `chain` under `rank`: writes the indexed positions beyond `matched` (the lookup's
    /// result for this chain; `Match::default()` if none was made), bottom up. When it writes
    /// any, the matched position is marked branched (once): this prompt went on past it, so a
    /// later request whose match stops there is a different prompt sharing that prefix. Served
    /// elsewhere than the match's rank, `rank` is added to the matched position's holders.
    pub fn record(
        &self,
        store: &dyn Store,
        chain: &[u64],
        rank: u32,
        now: u32,
        matched: &Match,
    ) -> TableEvents {
        let at = self.anchor(chain, None, matched).map(|a| a.at);
        let (mut events, wrote) = self.record_positions(store, chain, rank, now, matched, at);
        events.add(self.mark_matched(store, chain, rank, now, matched, wrote));
        events
    }

    /// The first half of [`record`](Self::record): writes the positions beyond `matched`
    /// (bottom up) and says whether any write took. The filter does this when it places a
    /// request, and [`mark_matched`](Self::mark_matched) once the rank has served it: a request
    /// that is not served withdraws its positions ([`withdraw`](Self::withdraw)) and has marked
    /// nothing. `anchored_at`: where the request's anchor was taken, remembered with the two
    /// deepest positions written, at the prompt's end ([`Match::anchored_at`]).
    pub fn record_positions(
        &self,
        store: &dyn Store,
        chain: &[u64],
        rank: u32,
        now: u32,
        matched: &Match,
        anchored_at: Option<AnchorAt>,
    ) -> (TableEvents, bool) {
        let mut events = TableEvents::default();
        let mut wrote = false;
        // Only the prompt's end is tagged and flagged as an end (the flag also where the tag
        // cannot say where the anchor was: off the grid, or past the positions 4 bits hold),
        // and the position before it: the conversation's next
        // turn matches there (before it when the next turn does not repeat this prompt's last
        // block exactly: a trace's partial last block, a template's closing), while a match
        // further inside the prompt is another prompt sharing a prefix of it (which may not be
        // marked branched yet: requests sharing a system prompt arrive together), whose name
        // must not be this one's (measured: tagging every position lost 0.01-0.02 x oracle
        // behind two replicas on the kv-cache-trace shape, the end alone half the gain on
        // Mooncake's conversations rendered compactly).
        let mut last_two = self.recorded(chain.len(), matched).rev();
        let (end, before_end) = (last_two.next(), last_two.next());
        let tag = self.tag(anchored_at);
        for p in self.recorded(chain.len(), matched) {
            if p as usize <= matched.blocks {
                continue;
            }
            if let Some(&h) = chain.get(p as usize - 1) {
                let near_end = Some(p) == end || Some(p) == before_end;
                let written_tag = if near_end { tag } else { 0 };
                let pinned = self
                    .table
                    .pin_tagged(store, h, rank, written_tag, near_end, now);
                events.add(pinned);
                // A write lost to a race recorded nothing: the prompt did not go on past the
                // match as far as the index knows, so the match must not become branched. Nor
                // does the prompt go on past the lost position: writing above it would leave a
                // hole, where the search below would stop short for every prompt sharing it.
                if pinned.cas_exhausted > 0 {
                    break;
                }
                wrote = true;
            }
        }
        (events, wrote)
    }

    /// The second half of [`record`](Self::record): marks the matched position branched when the
    /// prompt went on past it (`wrote`: [`record_positions`](Self::record_positions) wrote) and
    /// adds `rank` to its holders when it is not the position's rank.
    pub fn mark_matched(
        &self,
        store: &dyn Store,
        chain: &[u64],
        rank: u32,
        now: u32,
        matched: &Match,
        wrote: bool,
    ) -> TableEvents {
        let flags = marks_needed(matched, rank, wrote);
        match matched.blocks.checked_sub(1).and_then(|i| chain.get(i)) {
            Some(&h) if flags != 0 => self.table.mark(store, h, flags, now),
            _ => TableEvents::default(),
        }
    }

    /// The request's *anchor*: a hash every Envoy replica derives the same from the request and
    /// the shared part of its prompt, naming the conversation rather than what it shares with
    /// others. It is the chain's hash at the first indexed position past a branched match (the
    /// prefix other prompts share: a system prompt, a document), so it covers the first block of
    /// the prompt's own part, which every later turn of the conversation repeats. With no match,
    /// the first indexed position stands in for it. `None`: an empty chain and no opening.
    ///
    /// A match on a conversation's own history (unbranched) ends deeper at every turn, and so
    /// would the position past it: the anchor is taken where the turn that recorded the match
    /// took its own ([`Match::anchored_at`], remembered in the index), so the conversation keeps
    /// its name, hence its home, from turn to turn. When that is not known (an entry written
    /// before, or a position beyond what the index remembers), the first position past the
    /// match stands in for it.
    ///
    /// A chat's opening (its messages through the first user message, see [`Opening`]) names
    /// the conversation when the prompt's own part does not reach that position yet: the chain
    /// there would end wherever this turn's prompt ends, a new name on every turn, while the
    /// opening is resent unchanged by every later turn. So the opening is the anchor when it
    /// ends before the position (and not inside a shared match: it would name the shared part).
    /// An opening that reaches the position is named by the chain there, a prefix of it, as a
    /// prompt without an opening is: the same for a chat whose opening is resent unchanged, and
    /// the same for a conversation sent as one user message growing turn by turn (as clients
    /// that fold a history into one message, and trace replayers, send it), whose opening is a
    /// new one on every turn.
    ///
    /// Conversations opening with the same messages (a fixed greeting after the same system
    /// prompt) share the anchor, hence its two home ranks, until the load bound spills them.
    pub fn anchor(
        &self,
        chain: &[u64],
        opening: Option<Opening>,
        matched: &Match,
    ) -> Option<Anchor> {
        let remembered = matched.anchored_at.filter(|_| !matched.branched);
        let next = match remembered {
            Some(AnchorAt::Opening) => match opening {
                Some(o) => return Some(opened(o)),
                None => self.next_grid(matched.blocks),
            },
            Some(AnchorAt::Position(p)) => Some(p),
            None => self.next_grid(matched.blocks),
        }
        .unwrap_or(chain.len());
        match opening {
            Some(o)
                if remembered.is_none()
                    && o.blocks < next
                    && !(matched.branched && o.blocks < matched.blocks) =>
            {
                Some(opened(o))
            }
            _ => {
                // A chain ending before the position is named by its last block: that is the
                // position its tag may claim (off the grid: none), not the one it did not reach.
                let at = next.min(chain.len());
                let hash = *chain.get(at.checked_sub(1)?)?;
                Some(Anchor {
                    hash,
                    at: AnchorAt::Position(at),
                    kept: if at < chain.len() {
                        Kept::Yes
                    } else if at == next && opening.is_some_and(|o| at <= o.blocks) {
                        Kept::InsideOpening
                    } else {
                        Kept::No
                    },
                })
            }
        }
    }

    /// The tag remembering `at` in the entries a request records (see [`Match::anchored_at`]).
    pub fn tag(&self, at: Option<AnchorAt>) -> u8 {
        match at {
            Some(AnchorAt::Opening) => TAG_OPENING,
            Some(AnchorAt::Position(p)) => self
                .grid
                .binary_search(&u32::try_from(p).unwrap_or(u32::MAX))
                .ok()
                .and_then(|i| u8::try_from(i + 1).ok())
                .filter(|&t| t < TAG_OPENING)
                .unwrap_or(0),
            None => 0,
        }
    }

    /// What an entry's tag remembers (the inverse of [`tag`](Self::tag)).
    fn anchored_at(&self, tag: u8) -> Option<AnchorAt> {
        match tag {
            0 => None,
            TAG_OPENING => Some(AnchorAt::Opening),
            t => self
                .grid
                .get(usize::from(t) - 1)
                .map(|&p| AnchorAt::Position(p as usize)),
        }
    }

    /// How many positions [`record`](Self::record) would write.
    pub fn writes_needed(&self, chain_len: usize, matched: &Match) -> usize {
        self.recorded(chain_len, matched)
            .filter(|&p| p as usize > matched.blocks)
            .count()
    }

    /// Undoes [`record`](Self::record) for a request that was not served: removes the positions
    /// beyond `matched` that still point at `rank`, top down — the ones this request added, never
    /// what it matched (a client cannot make the index forget a prefix others share by failing
    /// its own requests). One read per position, a write per removal.
    pub fn withdraw(
        &self,
        store: &dyn Store,
        chain: &[u64],
        rank: u32,
        matched: &Match,
    ) -> TableEvents {
        let added = self.recorded(chain.len(), matched).rev();
        self.unpin_all(
            store,
            chain,
            rank,
            added.take_while(|&p| p as usize > matched.blocks),
        )
    }

    /// After `rank` failed this request: removes the positions up to the match (`matched.blocks`;
    /// only its `rank` and length are read) that still point at it — every grid position and
    /// every fine position — top down, so the next request
    /// sharing the prefix is placed afresh. Entries re-pointed elsewhere since are kept. One read
    /// per position (74 for a 512-block chain with the defaults; a rank failure is rare), a write
    /// per removal.
    pub fn forget(
        &self,
        store: &dyn Store,
        chain: &[u64],
        rank: u32,
        matched: &Match,
    ) -> TableEvents {
        if matched.rank != Some(rank) {
            return TableEvents::default();
        }
        // Every grid position's fine positions, not only this lookup's: an earlier turn of the
        // conversation recorded those of the shared prefix it matched then, and with the grid
        // entries above them gone, the next lookup would find them on the failed rank.
        let len = matched.blocks.min(chain.len());
        let every_position = self
            .positions(len)
            .iter()
            .flat_map(|&p| std::iter::once(p).chain(self.fine_positions(p as usize, len)));
        self.unpin_all(store, chain, rank, every_position.rev())
    }

    /// Removes the entries of `chain` at `positions` that still point at `rank` (one read each,
    /// a write per removal).
    fn unpin_all(
        &self,
        store: &dyn Store,
        chain: &[u64],
        rank: u32,
        positions: impl Iterator<Item = u32>,
    ) -> TableEvents {
        let mut events = TableEvents::default();
        for p in positions {
            if let Some(&h) = (p as usize).checked_sub(1).and_then(|i| chain.get(i)) {
                events.add(self.table.unpin(store, h, rank).1);
            }
        }
        events
    }
}

/// The flags recording under `rank` adds to the matched position (0: none): branched when the
/// prompt went on past it, `rank` as a holder when it is not the position's rank. Where a
/// prompt ended (flagged as its end), the first prompt to go on past it marks it continued
/// instead, and only the second branched: a block-id trace's next turn replaces its previous
/// turn's partial last block, so it matches where that turn went on from, not where it ended
/// (measured on Mooncake's conversations at 384 bytes a block: 0.964 → 0.986 × oracle on 4
/// ranks, with the fine search past a grid match). The price: one more prompt sharing such a
/// prefix is taken for its first prompt's conversation before the prefix reads as shared.
fn marks_needed(matched: &Match, rank: u32, wrote: bool) -> u16 {
    let Some(own) = matched.rank.filter(|_| matched.blocks > 0) else {
        return 0;
    };
    let mut flags = 0;
    if wrote && !matched.branched {
        if matched.ended && !matched.continued {
            flags |= FLAG_CONTINUED;
        } else {
            flags |= FLAG_BRANCHED;
        }
    }
    if own != rank {
        flags |= holder_flag(rank) & !matched.holders;
    }
    flags
}

/// Whether `p` has at most `bits` significant bits.
fn on_grid(p: u32, bits: u32) -> bool {
    let len = 32 - p.leading_zeros();
    len <= bits || p.trailing_zeros() >= len - bits
}

/// The deepest present index in `0..t`, presence being monotone (present up to some index,
/// absent above), with `probe(i)` returning the rank stored at index `i`. Order: the top, the
/// one below, the bottom, then a binary search between the bottom and the one below the top.
fn search<T: Copy>(t: usize, mut probe: impl FnMut(usize) -> Option<T>) -> Option<(usize, T)> {
    let top = t.checked_sub(1)?;
    if let Some(rank) = probe(top) {
        return Some((top, rank));
    }
    let below = top.checked_sub(1)?;
    if let Some(rank) = probe(below) {
        return Some((below, rank));
    }
    if below == 0 {
        return None;
    }
    let mut best = (0, probe(0)?);
    // Invariant: `lo` present (its rank in `best`), `hi` absent.
    let (mut lo, mut hi) = (0, below);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match probe(mid) {
            Some(rank) => {
                best = (mid, rank);
                lo = mid;
            }
            None => hi = mid,
        }
    }
    Some(best)
}

/// A store that counts the calls made through it (the index's reads and writes, for `Match`, the
/// host's counters and the tests).
pub struct CountingStore<'s> {
    inner: &'s dyn Store,
    reads: Cell<u32>,
    writes: Cell<u32>,
}

impl<'s> CountingStore<'s> {
    pub fn new(inner: &'s dyn Store) -> Self {
        CountingStore {
            inner,
            reads: Cell::new(0),
            writes: Cell::new(0),
        }
    }

    /// Reads made through this store so far.
    pub fn reads(&self) -> u32 {
        self.reads.get()
    }

    /// Writes made through this store so far.
    pub fn writes(&self) -> u32 {
        self.writes.get()
    }
}

impl Store for CountingStore<'_> {
    fn get(&self, key: &str) -> Stored {
        self.reads.set(self.reads.get() + 1);
        self.inner.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.writes.set(self.writes.get() + 1);
        self.inner.set(key, value, cas)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::tests::{hasher, splitmix};
    use crate::config_sections::MAX_BLOCKS_LIMIT;
    use crate::prompt::{prompt_chain, Api};
    use crate::table::tests::MemStore;
    use serde_json::json;

    /// Out-of-range values never panic: they are clamped (the checks are
    /// `config_sections::tests::prefix_config_defaults_and_validation`).
    #[test]
    fn out_of_range_config_is_clamped() {
        let wild = PrefixConfig {
            block_bytes: 0,
            block_tokens: u32::MAX,
            max_blocks: u32::MAX,
            min_match_blocks: 0,
            grid_bits: 99,
            ..PrefixConfig::default()
        };
        let body = br#"{"prompt":"abcdefghijklmnopqrstuvwxyz","input_ids":[1,2]}"#;
        for api in [Api::Completions, Api::Generate] {
            assert!(prompt_chain(body, api, &wild, &hasher()).is_ok());
        }
        assert_eq!(
            PrefixIndex::new(&wild).grid().len(),
            MAX_BLOCKS_LIMIT as usize
        );
    }

    fn index_cfg(buckets: u32, ways: u32) -> PrefixConfig {
        let mut c = PrefixConfig::default();
        c.table.buckets = buckets;
        c.table.ways = ways;
        c.table.ttl_seconds = 100;
        c
    }

    /// A random chain of `len` hashes; `shared` leading ones taken from `base`.
    fn random_chain(tag: u64, len: usize, base: &[u64], shared: usize) -> Vec<u64> {
        (0..len)
            .map(|i| match base.get(i) {
                Some(&h) if i < shared => h,
                _ => splitmix(tag.wrapping_mul(1_000_003) ^ i as u64),
            })
            .collect()
    }

    #[test]
    fn default_grid() {
        let idx = PrefixIndex::new(&PrefixConfig::default());
        assert_eq!(
            idx.grid(),
            [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
        );
        let three = PrefixIndex::new(&PrefixConfig {
            grid_bits: 3,
            min_match_blocks: 5,
            max_blocks: 100,
            ..PrefixConfig::default()
        });
        assert_eq!(
            three.grid(),
            [5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 100]
        );
    }

    #[test]
    fn longest_match_finds_the_deepest_recorded_position() {
        let (s, idx) = (MemStore::default(), PrefixIndex::new(&index_cfg(64, 16)));
        idx.table().ensure_buckets(&s);
        let a = random_chain(1, 100, &[], 0);
        idx.record(&s, &a, 2, 1000, &Match::default());
        let b = random_chain(2, 20, &[], 0);
        idx.record(&s, &b, 3, 1000, &Match::default());
        for len in [1, 2, 5, 20, 50, 100, 128] {
            for shared in [0, 1, 3, 7, 16, 47, 64, 99, 100] {
                let q = random_chain(1000 + shared as u64, len, &a, shared);
                let m = idx.longest_match(&s, &q, 1001, 4);
                let reach = shared.min(len).min(100);
                let mut want = idx.grid().iter().rev().find(|&&p| p as usize <= reach);
                // `a` indexed its tail past its grid position 96 at fine positions: a prompt
                // going past its grid match 96 searches them.
                if want == Some(&96) && len > 96 {
                    want = [100, 98, 97]
                        .iter()
                        .find(|&&p| p as usize <= reach)
                        .or(want);
                }
                assert_eq!(
                    m.blocks,
                    want.map_or(0, |&p| p as usize),
                    "len {len} shared {shared}"
                );
                assert_eq!(m.rank, want.map(|_| 2));
            }
        }
        // b's 20 blocks end past its grid position 16: a new prompt, it indexed its tail at the
        // fine positions 17 18 20, found top first like the grid's.
        let m = idx.longest_match(&s, &b, 1001, 4);
        assert_eq!((m.blocks, m.rank, m.reads), (20, Some(3), 2));
        // Another chain sharing 30 blocks of `a`, recorded on rank 1 beyond its match: deeper
        // positions go to rank 1, shallower ones keep rank 2.
        let c = random_chain(3, 60, &a, 30);
        let m = idx.longest_match(&s, &c, 1002, 4);
        assert_eq!((m.blocks, m.rank), (24, Some(2)));
        // 25 26 28 (the fine positions past its grid match), 32 48 (and not 64: only 60 blocks)
        assert_eq!(idx.writes_needed(c.len(), &m), 5);
        idx.record(&s, &c, 1, 1002, &m);
        assert_eq!(idx.longest_match(&s, &c, 1003, 4).rank, Some(1));
        assert_eq!(idx.longest_match(&s, &a[..24], 1003, 4).rank, Some(2));
        // `a`'s first 30 blocks, which `c` shares, are found at `c`'s fine position 28.
        let m = idx.longest_match(&s, &a[..30], 1003, 4);
        assert_eq!((m.blocks, m.rank), (28, Some(1)));
    }

    #[test]
    fn absent_out_of_range_and_expired_read_as_no_match() {
        let (s, idx) = (MemStore::default(), PrefixIndex::new(&index_cfg(64, 16)));
        let a = random_chain(1, 128, &[], 0);
        let m = idx.longest_match(&s, &a, 1000, 4);
        assert_eq!((m.blocks, m.rank, m.reads, m.refreshes), (0, None, 3, 0));
        assert_eq!(idx.longest_match(&s, &[], 1000, 4), Match::default());
        idx.record(&s, &a, 5, 1000, &m);
        assert_eq!(idx.longest_match(&s, &a, 1000, 4).rank, None, "rank 5 of 4");
        assert_eq!(idx.longest_match(&s, &a, 1000, 8).rank, Some(5));
        // Idle past the TTL (100 s here): gone. Used within it: kept alive by the refresh.
        let b = random_chain(2, 128, &[], 0);
        idx.record(&s, &b, 1, 1000, &Match::default());
        let used = idx.longest_match(&s, &b, 1090, 4);
        assert_eq!((used.rank, used.refreshes), (Some(1), 1));
        assert_eq!(idx.longest_match(&s, &b, 1180, 4).rank, Some(1));
        assert_eq!(idx.longest_match(&s, &a, 1180, 8).rank, None);
    }

    /// An index, a 5-block system prompt and a 40-block conversation `a` opening with it, and
    /// the match such a prompt gets: the system prompt indexed down to grid position 4, branched.
    /// The anchor's hash.
    fn hash_of(
        idx: &PrefixIndex,
        chain: &[u64],
        opening: Option<Opening>,
        m: &Match,
    ) -> Option<u64> {
        idx.anchor(chain, opening, m).map(|a| a.hash)
    }

    fn anchor_fixture() -> (PrefixIndex, Vec<u64>, Vec<u64>, Match) {
        let idx = PrefixIndex::new(&index_cfg(64, 16));
        let system = random_chain(1, 5, &[], 0);
        let a = random_chain(2, 40, &system, 5);
        let shared = Match {
            blocks: 4,
            rank: Some(0),
            branched: true,
            ..Match::default()
        };
        (idx, system, a, shared)
    }

    #[test]
    fn the_anchor_is_the_first_position_past_the_shared_part() {
        let (idx, system, a, shared) = anchor_fixture();
        let b = random_chain(3, 40, &system, 5);
        // Past position 4 the next grid position is 6: the hash of the first 6 blocks, which
        // include the prompt's own sixth block, differs between the two conversations...
        assert_eq!(hash_of(&idx, &a, None, &shared), Some(a[5]));
        assert_ne!(
            hash_of(&idx, &a, None, &shared),
            hash_of(&idx, &b, None, &shared)
        );
        // ...and stays the same for a later turn of the same conversation.
        let a_next = random_chain(2, 60, &a, 40);
        assert_eq!(
            hash_of(&idx, &a_next, None, &shared),
            hash_of(&idx, &a, None, &shared)
        );
        // A chain shorter than the next position: its last block, and the position it was
        // taken at (5, off the grid: its records claim none). Empty: none.
        assert_eq!(hash_of(&idx, &a[..5], None, &shared), Some(a[4]));
        let short = idx.anchor(&a[..5], None, &shared).map(|a| a.at);
        assert_eq!(short, Some(AnchorAt::Position(5)));
        assert_eq!(idx.tag(short), 0);
        assert_eq!(hash_of(&idx, &[], None, &shared), None);
        assert_eq!(hash_of(&idx, &a, None, &Match::default()), Some(a[0]));
    }

    #[test]
    fn only_an_opening_or_a_position_the_chain_goes_past_or_inside_the_opening_is_kept() {
        let (idx, _, a, shared) = anchor_fixture();
        let kept = |chain: &[u64], opening_blocks: Option<usize>, m: &Match| {
            let opening = opening_blocks.map(|blocks| Opening { blocks, hash: 77 });
            let anchor = idx.anchor(chain, opening, m).expect("an anchor");
            (anchor.at, anchor.kept)
        };
        let at = AnchorAt::Position;
        // Past the shared 4 blocks the next grid position is 6.
        assert_eq!(kept(&a[..7], None, &shared), (at(6), Kept::Yes));
        assert_eq!(kept(&a[..6], None, &shared), (at(6), Kept::No));
        // The chain's last block inside a chat's opening: kept if the client resends it.
        assert_eq!(
            kept(&a[..6], Some(6), &shared),
            (at(6), Kept::InsideOpening)
        );
        // A chain that stops short of the position stands in for it with its last block: the
        // next, longer turn is named at the position (an opening that short names it instead).
        assert_eq!(kept(&a[..5], None, &shared), (at(5), Kept::No));
        assert_eq!(
            kept(&a[..5], Some(5), &shared),
            (AnchorAt::Opening, Kept::Yes)
        );
        // Past nothing the first block names the prompt.
        let nothing = Match::default();
        assert_eq!(kept(&a[..1], None, &nothing), (at(1), Kept::No));
        assert_eq!(
            kept(&a[..1], Some(1), &nothing),
            (at(1), Kept::InsideOpening)
        );
        assert_eq!(kept(&a[..2], None, &nothing), (at(1), Kept::Yes));
        // An opening shorter than the position names the conversation itself.
        assert_eq!(
            kept(&a[..1], Some(0), &nothing),
            (AnchorAt::Opening, Kept::Yes)
        );
    }

    #[test]
    fn a_chat_opening_anchors_the_conversation_until_its_prompt_reaches_the_anchor_position() {
        let (idx, _, a, shared) = anchor_fixture();
        let opening = |blocks| Some(Opening { blocks, hash: 77 });
        let opened = Some(77);
        // Past the shared part (4) the next grid position is 6: an opening ending before it
        // names the conversation, however long this turn is (the chain there would cover bytes
        // of later messages, or end wherever a short turn ends).
        for blocks in [4, 5] {
            assert_eq!(
                hash_of(&idx, &a, opening(blocks), &shared),
                opened,
                "{blocks}"
            );
        }
        assert_eq!(hash_of(&idx, &a[..5], opening(5), &shared), opened);
        // Reaching it, the chain there names it: a prefix of the opening, the same whether the
        // opening is resent unchanged (a chat's first user message) or grows turn by turn (a
        // conversation sent as one user message)...
        for blocks in [6, 7, 16, 30] {
            assert_eq!(
                hash_of(&idx, &a, opening(blocks), &shared),
                Some(a[5]),
                "{blocks}"
            );
        }
        let a_next = random_chain(2, 60, &a, 40);
        assert_eq!(hash_of(&idx, &a_next, opening(50), &shared), Some(a[5]));
        // ...and without a match at all: the first block.
        assert_eq!(hash_of(&idx, &a, opening(3), &Match::default()), Some(a[0]));
        assert_eq!(hash_of(&idx, &a, opening(0), &Match::default()), opened);
        // A later turn matching its own history (unbranched) past the opening: the opening.
        let own = |blocks| Match {
            blocks,
            rank: Some(1),
            ..Match::default()
        };
        assert_eq!(hash_of(&idx, &a, opening(5), &own(8)), opened);
        assert_eq!(hash_of(&idx, &a, opening(9), &own(24)), opened);
        // Ending inside a shared match it would name the shared part: not used.
        let longer_shared = Match {
            blocks: 8,
            ..shared
        };
        assert_eq!(hash_of(&idx, &a, opening(6), &longer_shared), Some(a[11]));
        // A first turn shorter than a block has no chain, but its opening is the one its next
        // turns (with blocks) resend: it names the conversation from the first turn on, so the
        // turns share a home and the second finds the first's cache. No opening, no anchor.
        assert_eq!(hash_of(&idx, &[], opening(0), &Match::default()), opened);
        assert_eq!(hash_of(&idx, &[], None, &Match::default()), None);
    }

    #[test]
    fn a_conversation_keeps_the_anchor_its_first_turn_was_named_by() {
        let s = MemStore::default();
        let idx = PrefixIndex::new(&index_cfg(64, 16));
        idx.table().ensure_buckets(&s);
        // A first turn of 3 blocks that matched nothing: named by its first block (position 1),
        // and that is remembered with what it records (positions 1 2 3).
        let turn1 = random_chain(1, 3, &[], 0);
        let first = idx.anchor(&turn1, None, &Match::default());
        assert_eq!(
            first.map(|a| (a.hash, a.at)),
            Some((turn1[0], AnchorAt::Position(1)))
        );
        idx.record(&s, &turn1, 2, 1000, &Match::default());
        // Its next turns match their own history ever deeper (3, then 8): the position past
        // the match would move (4, then 12); the remembered one does not.
        let turn2 = random_chain(1, 9, &turn1, 3);
        let m = idx.longest_match(&s, &turn2, 1000, 4);
        assert_eq!((m.blocks, m.branched), (3, false));
        assert_eq!(m.anchored_at, Some(AnchorAt::Position(1)));
        assert_eq!(hash_of(&idx, &turn2, None, &m), Some(turn1[0]));
        idx.record(&s, &turn2, 2, 1000, &m);
        let turn3 = random_chain(1, 14, &turn2, 9);
        let m = idx.longest_match(&s, &turn3, 1000, 4);
        assert_eq!((m.blocks, m.anchored_at), (8, Some(AnchorAt::Position(1))));
        assert_eq!(hash_of(&idx, &turn3, None, &m), Some(turn1[0]));
        // Only the last two positions a prompt records (4 6 8 for turn 2: 6 and 8) remember it:
        // a next turn whose prompt does not repeat this one's last block exactly (a trace's
        // partial last block, a chat template's closing) matches the one before the end.
        // Another prompt sharing only the first 4 blocks (not yet known to be shared: requests
        // behind one system prompt arrive together) matches inside and is named past its match.
        let retold = random_chain(8, 12, &turn2, 7);
        let before_end = idx.longest_match(&s, &retold, 1000, 4);
        assert_eq!(
            (before_end.blocks, before_end.anchored_at),
            (6, Some(AnchorAt::Position(1)))
        );
        let other = random_chain(9, 10, &turn2, 4);
        let shared_unknown = idx.longest_match(&s, &other, 1000, 4);
        assert_eq!(
            (shared_unknown.blocks, shared_unknown.anchored_at),
            (4, None)
        );
        assert_eq!(hash_of(&idx, &other, None, &shared_unknown), Some(other[5]));
        // A chat anchored by its opening keeps it, however far its opening now reaches.
        let opening = Some(Opening {
            blocks: 12,
            hash: 77,
        });
        let by_opening = Match {
            anchored_at: Some(AnchorAt::Opening),
            ..m
        };
        assert_eq!(hash_of(&idx, &turn3, opening, &by_opening), Some(77));
        // A shared (branched) match names the request past it, whoever recorded it.
        let shared = Match {
            branched: true,
            ..m
        };
        assert_eq!(hash_of(&idx, &turn3, None, &shared), Some(turn3[11]));
        // Tags: a grid position is its index plus one, the opening 15; positions the 4 bits
        // cannot hold (192 on: grid index 14) and off-grid ones are not remembered.
        assert_eq!(idx.tag(Some(AnchorAt::Position(1))), 1);
        assert_eq!(idx.tag(Some(AnchorAt::Position(128))), 14);
        assert_eq!(idx.tag(Some(AnchorAt::Position(192))), 0);
        assert_eq!(idx.tag(Some(AnchorAt::Position(5))), 0);
        assert_eq!(idx.tag(Some(AnchorAt::Opening)), 15);
        assert_eq!(idx.tag(None), 0);
        for t in 0..=15 {
            assert_eq!(idx.tag(idx.anchored_at(t)), t, "{t}");
        }
    }

    #[test]
    fn a_record_that_lost_its_deeper_writes_leaves_the_match_unbranched() {
        let s = MemStore::default();
        let idx = PrefixIndex::new(&index_cfg(64, 16));
        idx.table().ensure_buckets(&s);
        let system = random_chain(1, 8, &[], 0);
        idx.record(&s, &system, 0, 1000, &Match::default());
        let b = random_chain(20, 13, &system, 8);
        let m = idx.longest_match(&s, &b, 1000, 4);
        assert_eq!((m.blocks, m.branched), (8, false));
        // The first deeper position's write (fine 9 past the grid match) loses every race (its
        // retries included), which ends the record there; the store would take the writes above
        // it (fine 10, grid 12) and the mark that follows.
        let mut cfg = index_cfg(64, 16);
        cfg.table.cas_retries = 2;
        let idx = PrefixIndex::new(&cfg);
        s.lose_races.set(3);
        let events = idx.record(&s, &b, 0, 1000, &m);
        assert_eq!((events.cas_exhausted, s.lose_races.get()), (1, 0));
        let again = idx.longest_match(&s, &b, 1000, 4);
        assert_eq!((again.blocks, again.branched), (8, false));
    }

    #[test]
    fn an_end_whose_anchor_no_tag_holds_is_continued_by_the_next_turn() {
        let s = MemStore::default();
        let idx = PrefixIndex::new(&index_cfg(64, 16));
        idx.table().ensure_buckets(&s);
        // A 4-block system prompt two conversations went on from: branched.
        let system = random_chain(1, 4, &[], 0);
        for (tag, rank) in [(2, 0), (3, 1)] {
            let c = random_chain(tag, 10, &system, 4);
            let m = idx.longest_match(&s, &c, 1000, 4);
            idx.record(&s, &c, rank, 1000, &m);
        }
        // A third conversation's first turn ends one block past it, off the grid (6 is next):
        // named by its last block, a position no tag holds.
        let turn1 = random_chain(4, 5, &system, 4);
        let m = idx.longest_match(&s, &turn1, 1000, 4);
        assert_eq!((m.blocks, m.branched), (4, true));
        assert_eq!(idx.tag(idx.anchor(&turn1, None, &m).map(|a| a.at)), 0);
        idx.record(&s, &turn1, 2, 1000, &m);
        // Its second turn matches where the first ended (5), and goes on past it.
        let turn2 = random_chain(4, 6, &turn1, 5);
        let m = idx.longest_match(&s, &turn2, 1000, 4);
        assert_eq!(
            (m.blocks, m.rank, m.branched, m.ended),
            (5, Some(2), false, true)
        );
        idx.record(&s, &turn2, 2, 1000, &m);
        // A third turn that does not repeat the second's last block (a trace's partial block)
        // matches where the second went on from: still the conversation's own history, as at a
        // tagged end. (Read as branched, it was placed as a new conversation sharing a prefix.)
        let mut turn3 = random_chain(5, 8, &turn2, 5);
        turn3[5] ^= 1;
        let m = idx.longest_match(&s, &turn3, 1000, 4);
        assert_eq!((m.blocks, m.rank), (5, Some(2)));
        assert_eq!((m.branched, m.continued), (false, true));
        // The next prompt to go on past it marks it branched.
        idx.record(&s, &turn3, 2, 1000, &m);
        let other = random_chain(6, 8, &turn1, 5);
        assert!(idx.longest_match(&s, &other, 1000, 4).branched);
    }

    #[test]
    fn a_prompt_branching_from_a_shared_prefix_sees_it_branched() {
        let s = MemStore::default();
        let idx = PrefixIndex::new(&index_cfg(64, 16));
        idx.table().ensure_buckets(&s);
        let system = random_chain(1, 8, &[], 0);
        let conv = |tag, len| random_chain(tag, len, &system, 8);
        // The first conversation records from scratch: nothing is branched yet.
        let a1 = conv(10, 11);
        idx.record(&s, &a1, 0, 1000, &Match::default());
        // A second one matches the system prompt (8 blocks, on rank 0), unbranched: it may be the
        // first one's continuation, as far as the index can tell.
        let b = conv(20, 13);
        let m = idx.longest_match(&s, &b, 1000, 4);
        assert_eq!((m.blocks, m.rank, m.branched), (8, Some(0), false));
        // It went on past the match (recorded 12 under rank 1), so position 8 is now branched.
        idx.record(&s, &b, 1, 1000, &m);
        let c = conv(30, 12);
        let m = idx.longest_match(&s, &c, 1000, 4);
        assert_eq!((m.blocks, m.rank, m.branched), (8, Some(0), true));
        // The first conversation's own 3 blocks past the system prompt reach no grid position
        // (8, then 12), but a new prompt indexes its tail at fine positions (9, 10): its next
        // turn finds its own history there, unbranched.
        let a2 = random_chain(10, 14, &a1, 11);
        let m = idx.longest_match(&s, &a2, 1000, 4);
        assert_eq!((m.blocks, m.rank, m.branched), (10, Some(0), false));
        // Once its own part is indexed (12, recorded by this turn on rank 2), the next turn
        // matches it, unbranched, and so does every later one.
        idx.record(&s, &a2, 2, 1000, &m);
        let a3 = random_chain(10, 20, &a2, 14);
        let m = idx.longest_match(&s, &a3, 1000, 4);
        assert_eq!((m.blocks, m.rank, m.branched), (12, Some(2), false));
        idx.record(&s, &a3, 2, 1000, &m);
        let a4 = random_chain(10, 30, &a3, 20);
        let m = idx.longest_match(&s, &a4, 1000, 4);
        assert_eq!((m.blocks, m.rank, m.branched), (16, Some(2), false));
    }

    /// An index (64 x 16) holding 192 shared blocks (a grid position; the next one is 256)
    /// behind which two conversations went on: one to 200 blocks on rank 1, one past 256 on rank
    /// 2, so the shared prefix is branched.
    struct BehindShared {
        s: MemStore,
        idx: PrefixIndex,
        system: Vec<u64>,
    }

    impl BehindShared {
        fn new() -> Self {
            let fx = BehindShared {
                s: MemStore::default(),
                idx: PrefixIndex::new(&index_cfg(64, 16)),
                system: random_chain(1, 192, &[], 0),
            };
            fx.idx.table().ensure_buckets(&fx.s);
            fx.turn(&fx.conv(10), 200, 1);
            fx.turn(&fx.conv(20), 260, 2);
            fx
        }

        /// A conversation of 300 blocks behind the shared ones.
        fn conv(&self, tag: u64) -> Vec<u64> {
            random_chain(tag, 300, &self.system, 192)
        }

        /// A turn of `len` blocks of `c`, looked up and recorded on `rank`.
        fn turn(&self, c: &[u64], len: usize, rank: u32) -> Match {
            let m = self.idx.longest_match(&self.s, &c[..len], 1000, 4);
            self.idx.record(&self.s, &c[..len], rank, 1000, &m);
            m
        }
    }

    #[test]
    fn history_behind_a_shared_prefix_is_found_at_fine_positions() {
        let fx = BehindShared::new();
        let BehindShared { s, idx, .. } = &fx;
        let a = fx.conv(30);
        let m = fx.turn(&a, 200, 3);
        assert_eq!((m.blocks, m.branched, m.fine_base), (192, true, 192));
        // Its next turns find their own history (unbranched, on its rank) at the fine positions
        // 193 194 196 200 208 224, before and after they cross the grid position 256.
        for (len, want) in [(205, 200), (230, 200), (255, 224), (270, 224)] {
            let m = fx.turn(&a, len, 3);
            assert_eq!(
                (m.blocks, m.rank, m.branched),
                (want, Some(3), false),
                "len {len}"
            );
        }
        let m = idx.longest_match(s, &a[..280], 1000, 4);
        assert_eq!((m.blocks, m.rank), (256, Some(3)), "past 256: the grid");
        // Another conversation sharing only the prefix does not take a's history for its own,
        // and what it added is withdrawn, fine positions included, when it is not served.
        let b = fx.conv(40);
        let m = idx.longest_match(s, &b[..230], 1000, 4);
        assert_eq!((m.blocks, m.rank, m.branched), (192, Some(1), true));
        assert_eq!(idx.writes_needed(230, &m), 6, "193 194 196 200 208 224");
        idx.record_positions(s, &b[..230], 0, 1000, &m, None);
        assert_eq!(idx.longest_match(s, &b[..230], 1000, 4).blocks, 224);
        idx.withdraw(s, &b[..230], 0, &m);
        assert_eq!(idx.longest_match(s, &b[..230], 1000, 4).blocks, 192);
        // A failed rank forgets the fine positions it held for the request too.
        let m = idx.longest_match(s, &a[..255], 1000, 4);
        let all = Match { blocks: 255, ..m };
        idx.forget(s, &a[..255], 3, &all);
        let m = idx.longest_match(s, &a[..255], 1000, 4);
        assert_eq!((m.blocks, m.branched), (192, true));
    }

    #[test]
    fn ranks_serving_a_shared_prefix_become_its_holders() {
        let s = MemStore::default();
        let idx = PrefixIndex::new(&index_cfg(64, 16));
        idx.table().ensure_buckets(&s);
        let system = random_chain(1, 8, &[], 0);
        let conv = |tag| random_chain(tag, 13, &system, 8);
        idx.record(&s, &conv(10), 0, 1000, &Match::default());
        let m = idx.longest_match(&s, &conv(20), 1000, 4);
        idx.record(&s, &conv(20), 0, 1000, &m);
        // Branched now; a third prompt served on rank 2 makes rank 2 a holder of position 8.
        let m = idx.longest_match(&s, &conv(30), 1000, 4);
        assert_eq!((m.rank, m.branched, m.holders), (Some(0), true, 0));
        let writes = |chain: &[u64], m: &Match, rank| {
            let counted = CountingStore::new(&s);
            idx.record(&counted, chain, rank, 1000, m);
            counted.writes()
        };
        assert_eq!(
            writes(&conv(30), &m, 2),
            4,
            "fine positions 9 and 10 past the shared 8, grid position 12, and the holder flag"
        );
        let m = idx.longest_match(&s, &conv(40), 1000, 4);
        assert_eq!(
            (m.rank, m.branched, m.holders),
            (Some(0), true, holder_flag(2))
        );
        // Served on a rank already known (or the entry's own): nothing to add.
        let m2 = Match { blocks: 8, ..m };
        let short = &conv(40)[..8];
        assert_eq!(writes(short, &m2, 2), 0);
        assert_eq!(writes(short, &m2, 0), 0);
        assert_eq!(writes(short, &m2, 3), 1, "a new holder: one mark");
        // Ranks from 13 on have no holder flag: nothing to write for them either.
        assert_eq!(writes(short, &m2, 13), 0);
    }

    #[test]
    fn record_writes_only_what_changed() {
        let s = MemStore::default();
        let idx = PrefixIndex::new(&PrefixConfig {
            max_blocks: 128,
            ..index_cfg(64, 16)
        });
        idx.table().ensure_buckets(&s);
        let counted = CountingStore::new(&s);
        let conv = random_chain(1, 128, &[], 0);
        let mut now = 1000;
        let mut written = std::collections::BTreeSet::new();
        let (mut reads, mut turns) = (0, 0);
        let mut prev = 0;
        // A conversation growing by 3 blocks a turn, from 5 blocks to the cap and beyond.
        for len in (5..=140).step_by(3) {
            let turn = &conv[..len.min(128)];
            now += 10;
            counted.writes.set(0);
            let m = idx.longest_match(&counted, turn, now, 4);
            assert_eq!(counted.writes.get(), m.refreshes);
            let crossed = idx
                .grid()
                .iter()
                .filter(|&&p| prev < p as usize && p as usize <= turn.len())
                .count();
            if prev > 0 {
                assert_eq!(m.rank, Some(1));
                // The grid (1 read when no grid position was crossed, 2 when one was), then the
                // fine positions past a grid position the turn ends beyond (top first: the one
                // the last turn wrote, or the one below, or the bottom, then a binary search).
                let grid_reads = if crossed == 0 { 1 } else { 2 };
                assert!(m.reads >= grid_reads.min(7), "len {len}: {}", m.reads);
                assert!(m.reads <= grid_reads + 6, "len {len}: {}", m.reads);
                reads += m.reads;
                turns += 1;
            }
            prev = turn.len();
            // The conversation's own turns never match a branched position: each one marks the
            // position it matched, and the next one matches deeper.
            assert!(!m.branched, "len {len}");
            counted.writes.set(0);
            idx.record(&counted, turn, 1, now, &m);
            let needed = idx.writes_needed(turn.len(), &m);
            let mark = usize::from(needed > 0 && m.blocks > 0);
            assert_eq!(counted.writes.get() as usize, needed + mark);
            for p in idx
                .recorded(turn.len(), &m)
                .filter(|&p| p as usize > m.blocks)
            {
                assert!(written.insert(p), "len {len}: position {p} written again");
            }
        }
        let grid: std::collections::BTreeSet<u32> = idx.grid().iter().copied().collect();
        assert!(written.is_superset(&grid), "every grid position written");
        assert!(reads <= 3 * turns, "{reads} reads over {turns} turns");
        // Fully matched: nothing to write.
        let m = idx.longest_match(&counted, &conv, now, 4);
        counted.writes.set(0);
        idx.record(&counted, &conv, 1, now, &m);
        assert_eq!(counted.writes.get(), 0);
    }

    #[test]
    fn a_write_lost_to_races_ends_the_record_there() {
        let (s, cfg) = (MemStore::default(), index_cfg(64, 16));
        let idx = PrefixIndex::new(&cfg);
        idx.table().ensure_buckets(&s);
        let conv = random_chain(3, 40, &[], 0);
        let m = idx.longest_match(&s, &conv, 1000, 4);
        // Every attempt of the first (bottom) write loses; the writes above it would not.
        s.lose_races.set(cfg.table.cas_retries + 1);
        let (events, wrote) = idx.record_positions(&s, &conv, 2, 1000, &m, None);
        assert_eq!((events.cas_exhausted, wrote), (1, false));
        // Nothing above the lost position was written: no hole for a search to stop at.
        let after = idx.longest_match(&s, &conv, 1001, 4);
        assert_eq!((after.blocks, after.rank), (0, None), "{after:?}");
        let (_, wrote) = idx.record_positions(&s, &conv, 2, 1002, &m, None);
        assert!(wrote);
        assert_eq!(idx.longest_match(&s, &conv, 1003, 4).blocks, 40);
    }

    #[test]
    fn search_reads_are_logarithmic_and_exact() {
        for t in 0..=70usize {
            let bound = if t <= 2 {
                t
            } else {
                3 + (usize::BITS - (t - 3).leading_zeros()) as usize
            };
            for present in 0..=t {
                let mut probes = 0;
                let got = search(t, |i| {
                    probes += 1;
                    assert!(i < t);
                    (i < present).then_some(i as u32)
                });
                let want = present.checked_sub(1).map(|i| (i, i as u32));
                assert_eq!(got, want, "t {t} present {present}");
                assert!(
                    probes <= bound,
                    "t {t} present {present}: {probes} > {bound}"
                );
                if present == t && t > 0 {
                    assert_eq!(probes, 1, "top first");
                }
            }
        }
        // Over a real index: at most 7 reads for 14 positions, and 3 more for the fine
        // positions past a grid match the prompt goes beyond (absent here: `a` reached 128).
        let (s, idx) = (MemStore::default(), PrefixIndex::new(&index_cfg(64, 16)));
        let a = random_chain(1, 128, &[], 0);
        idx.record(&s, &a, 0, 1000, &Match::default());
        let worst = (0..=128)
            .map(|shared| {
                let q = random_chain(7 + shared as u64, 128, &a, shared);
                idx.longest_match(&s, &q, 1000, 4).reads
            })
            .max();
        assert_eq!(worst, Some(10));
    }

    #[test]
    fn memory_stays_bounded_over_many_chains() {
        let (buckets, ways) = (256, 8);
        let (s, idx) = (
            MemStore::default(),
            PrefixIndex::new(&index_cfg(buckets, ways)),
        );
        idx.table().ensure_buckets(&s);
        let mut evictions = 0;
        let len = |n: u64| 1 + (splitmix(n) % 5) as usize;
        for n in 0..100_000u64 {
            let c = random_chain(n, len(n), &[], 0);
            let m = if n % 64 == 0 {
                idx.longest_match(&s, &c, 1000, 4)
            } else {
                Match::default()
            };
            evictions += idx.record(&s, &c, (n % 4) as u32, 1000, &m).evictions;
        }
        assert!(evictions > 100_000);
        assert!(s.total_bytes() <= (buckets * ways * 16) as usize + 1);
        // The most recent chain survives.
        let last = random_chain(99_999, len(99_999), &[], 0);
        assert_eq!(idx.longest_match(&s, &last, 1000, 4).rank, Some(3));
    }

    /// The index's bound, with real prompts as the filter sees them: 100,000 distinct chat bodies
    /// (hashed by the walker, looked up, recorded under a rank, as the host does) leave the
    /// index at `buckets × ways × 16` bytes, and the newest prompts are still found.
    #[test]
    fn hundred_thousand_distinct_prompts_leave_the_index_at_its_bound() {
        let mut c = index_cfg(128, 4);
        c.block_bytes = 32;
        c.max_blocks = 8;
        let (s, idx, h) = (MemStore::default(), PrefixIndex::new(&c), hasher());
        idx.table().ensure_buckets(&s);
        let bound = 128 * 4 * 16; // bytes of entries; the store also holds a 1-byte marker
        let body = |n: u32| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"prompt {n}: {}"}}]}}"#,
                "tell me more about it. ".repeat(1 + (n % 12) as usize)
            )
        };
        let (mut evictions, mut written) = (0u64, 0u64);
        for n in 0..100_000u32 {
            let chain = prompt_chain(body(n).as_bytes(), Api::Chat, &c, &h).unwrap();
            assert!(!chain.is_empty());
            let m = idx.longest_match(&s, chain.hashes(), 1000, 4);
            written += idx.writes_needed(chain.len(), &m) as u64;
            evictions += u64::from(idx.record(&s, chain.hashes(), n % 4, 1000, &m).evictions);
            if n % 10_000 == 0 {
                assert!(
                    s.total_bytes() <= bound + 1,
                    "after {n}: {}",
                    s.total_bytes()
                );
            }
        }
        assert!(
            s.total_bytes() <= bound + 1,
            "{} > {bound}",
            s.total_bytes()
        );
        assert!(written > 300_000, "{written}");
        // Every entry written was new: it took a free way or evicted the bucket's oldest.
        let live = (s.total_bytes() as u64 - 1) / 16;
        assert_eq!(
            written,
            evictions + live,
            "{written} written, {evictions} evicted"
        );
        assert!(live > 400, "the index is used: {live} live entries");
        // The last prompt is still there, the first long gone.
        let last = prompt_chain(body(99_999).as_bytes(), Api::Chat, &c, &h).unwrap();
        assert_eq!(idx.longest_match(&s, last.hashes(), 1000, 4).rank, Some(3));
        let first = prompt_chain(body(0).as_bytes(), Api::Chat, &c, &h).unwrap();
        assert_eq!(idx.longest_match(&s, first.hashes(), 1000, 4).rank, None);
    }

    #[test]
    fn forget_removes_what_pointed_at_the_failed_rank() {
        let (s, idx) = (MemStore::default(), PrefixIndex::new(&index_cfg(64, 16)));
        let a = random_chain(1, 40, &[], 0);
        idx.record(&s, &a, 2, 1000, &Match::default());
        let m = idx.longest_match(&s, &a, 1000, 4);
        assert_eq!(m.rank, Some(2));
        // Another rank failing changes nothing.
        idx.forget(&s, &a, 1, &m);
        assert_eq!(idx.longest_match(&s, &a, 1000, 4).rank, Some(2));
        idx.forget(&s, &a, 2, &m);
        let after = idx.longest_match(&s, &a, 1000, 4);
        assert_eq!((after.blocks, after.rank), (0, None));
    }

    #[test]
    fn forget_removes_earlier_turns_fine_positions_too() {
        let fx = BehindShared::new();
        let BehindShared { s, idx, .. } = &fx;
        // A conversation on rank 3 records fine positions behind the shared 192 blocks (193 …
        // 224), then crosses the grid position 256 and records its fine positions too.
        let a = fx.conv(30);
        for len in [200, 230, 260] {
            fx.turn(&a, len, 3);
        }
        let m = idx.longest_match(s, &a[..270], 1000, 4);
        assert_eq!((m.blocks, m.rank), (256, Some(3)));
        // Rank 3 fails the next turn: the whole chain is forgotten there, as the host does.
        let all = Match {
            blocks: 270,
            rank: Some(3),
            ..Match::default()
        };
        idx.forget(s, &a[..270], 3, &all);
        let after = idx.longest_match(s, &a[..280], 1000, 4);
        assert_ne!(
            after.rank,
            Some(3),
            "an earlier turn's entry still points at the failed rank: {after:?}"
        );
        assert_eq!(
            after.blocks, 192,
            "the shared prefix is still found: {after:?}"
        );
    }

    /// A conversation growing a block or two a turn, or crossing grid positions, keeps the name
    /// its first turn got and never reads its own history as shared: whether each turn repeats
    /// the previous one whole (a chat's history), or replaces its last block (a block-id trace,
    /// whose partial last block gets a new id once the conversation goes on).
    #[test]
    fn a_growing_conversation_keeps_its_name() {
        let idx = PrefixIndex::new(&PrefixConfig {
            max_blocks: 128,
            ..index_cfg(64, 16)
        });
        let cases: [(usize, [usize; 6]); 6] = [
            (0, [11, 16, 21, 27, 33, 40]),
            (0, [5, 7, 9, 11, 13, 15]),
            (1, [3, 4, 5, 6, 7, 8]),
            (1, [5, 6, 8, 9, 11, 12]),
            (1, [11, 13, 15, 17, 19, 21]),
            (1, [20, 26, 33, 41, 50, 60]),
        ];
        for (drop, lens) in cases {
            let s = MemStore::default();
            idx.table().ensure_buckets(&s);
            let mut turn = random_chain(1, lens[0], &[], 0);
            let mut name = None;
            for (i, &len) in lens.iter().enumerate() {
                if i > 0 {
                    turn = random_chain(1 + i as u64, len, &turn, turn.len() - drop);
                }
                let now = 1000 + 10 * i as u32;
                let m = idx.longest_match(&s, &turn, now, 4);
                let anchor = idx.anchor(&turn, None, &m);
                if i == 0 {
                    name = anchor;
                } else {
                    let case = format!("drop {drop}, lens {lens:?}, turn {i}: {m:?}");
                    assert_eq!(m.rank, Some(1), "{case}");
                    assert!(!m.branched, "{case}");
                    assert_eq!(anchor, name, "{case}");
                }
                idx.record(&s, &turn, 1, now, &m);
            }
        }
    }

    #[test]
    fn a_withdrawn_turn_leaves_the_conversation_as_it_was() {
        let (s, idx) = (MemStore::default(), PrefixIndex::new(&index_cfg(64, 16)));
        idx.table().ensure_buckets(&s);
        let turn1 = random_chain(1, 12, &[], 0);
        idx.record(&s, &turn1, 2, 1000, &Match::default());
        // The next turn is recorded when placed (positions only), then not served: withdrawn.
        let turn2 = random_chain(1, 20, &turn1, 12);
        let m = idx.longest_match(&s, &turn2, 1000, 4);
        assert_eq!((m.blocks, m.rank, m.branched), (12, Some(2), false));
        let (_, wrote) = idx.record_positions(&s, &turn2, 2, 1000, &m, None);
        assert!(wrote);
        assert_eq!(idx.longest_match(&s, &turn2, 1000, 4).blocks, 16);
        idx.withdraw(&s, &turn2, 2, &m);
        // What turn 1 recorded is intact and still its own history (not branched), and a retry
        // of turn 2 matches exactly as the first attempt did.
        let again = idx.longest_match(&s, &turn2, 1000, 4);
        assert_eq!(
            (again.blocks, again.rank, again.branched),
            (12, Some(2), false)
        );
        // Served this time: positions, then the marks.
        let (_, wrote) = idx.record_positions(&s, &turn2, 2, 1000, &again, None);
        idx.mark_matched(&s, &turn2, 2, 1000, &again, wrote);
        let m = idx.longest_match(&s, &random_chain(1, 30, &turn2, 20), 1000, 4);
        assert_eq!((m.blocks, m.rank, m.branched), (16, Some(2), false));
        // Turn 1's end went on once: continued, still read as a conversation's own history (a
        // trace's next turn that does not repeat turn 2's last block matches here too). A
        // second prompt going on past it makes it branched.
        let other = random_chain(9, 14, &turn1, 12);
        let m = idx.longest_match(&s, &other, 1000, 4);
        assert_eq!((m.blocks, m.branched, m.continued), (12, false, true));
        idx.record(&s, &other, 2, 1000, &m);
        let third = random_chain(10, 14, &turn1, 12);
        let m = idx.longest_match(&s, &third, 1000, 4);
        assert_eq!(
            (m.blocks, m.branched),
            (12, true),
            "turn 1's end went on twice"
        );
        // Withdrawing for another rank removes nothing.
        idx.withdraw(&s, &turn2, 1, &again);
        assert_eq!(idx.longest_match(&s, &turn2, 1000, 4).blocks, 16);
    }

    #[test]
    fn prompts_end_to_end_through_the_index() {
        let c = PrefixConfig::default();
        let (s, idx, h) = (MemStore::default(), PrefixIndex::new(&c), hasher());
        let conv = |turns: usize| {
            let mut msgs = vec![json!({"role":"system","content":"Be helpful. ".repeat(100)})];
            for i in 0..turns {
                msgs.push(json!({"role":"user","content":format!("Question {i}? ").repeat(60)}));
                msgs.push(json!({"role":"assistant","content":format!("Answer {i}. ").repeat(80)}));
            }
            json!({"model":"llama","messages":msgs}).to_string()
        };
        let t1 = prompt_chain(conv(1).as_bytes(), Api::Chat, &c, &h).unwrap();
        let m = idx.longest_match(&s, t1.hashes(), 1000, 8);
        assert_eq!(m.rank, None);
        idx.record(&s, t1.hashes(), 6, 1001, &m);
        let t2 = prompt_chain(conv(2).as_bytes(), Api::Chat, &c, &h).unwrap();
        let m = idx.longest_match(&s, t2.hashes(), 1010, 8);
        assert_eq!(m.rank, Some(6));
        assert!(m.blocks * 3 >= t1.len() * 2, "{} of {}", m.blocks, t1.len());
        // Another model shares nothing.
        let other = conv(2).replace("llama", "mistral");
        let o = prompt_chain(other.as_bytes(), Api::Chat, &c, &h).unwrap();
        assert_eq!(idx.longest_match(&s, o.hashes(), 1010, 8).rank, None);
    }
}
