//! The prompt's blocks as a chain of hashes: [`PrefixHasher`] holds the keys, derived once from
//! the configured seed, and [`Chain`] the chained block hashes of one request's canonical prompt.
//! The walker in `prompt` streams the canonical prompt (described there) into a `ChainBuilder` as
//! it reads the body, so no copy of the prompt is made. Hash `i` covers blocks `0..=i`, so a
//! chain's first `n` hashes name its first `n` blocks: what the prefix index stores.
//!
//! # Hash
//!
//! Per block, four lanes each absorb every fourth 8-byte word with
//! `x = lane ^ w; lane = lo32(x) * hi32(x) ^ rotl(x, 29)`: one 32×32→64 multiply (native in
//! wasm, unlike a 64×64→128 one, which wasm32 lowers to a `__multi3` call), serial per lane so
//! word order matters, and non-linear in every input bit, so no input difference cancels without
//! knowing the lane state. The lanes start from key-derived values; the block's tail stripe is
//! zero-padded (every block of a chain has the same length, so padding is unambiguous). The block
//! hash folds the lanes into the previous block's hash with the murmur3 64-bit finaliser, one
//! lane at a time, so each block's hash covers everything before it. The model then goes in with
//! one more finaliser round against a SipHash of the model name.
//!
//! All keys derive from the configured seed (SipHash-1-3, [`KeyedHasher`]): without the seed
//! nobody can choose prompts that land in one bucket of the index and evict everyone else. This
//! is not a cryptographic MAC: a collision, accidental or crafted, costs a cache miss or a
//! suboptimal placement, never a request on a rank outside the configured ones. (An attacker who
//! knows a victim's prompt can simply send it; no collision is needed to share its entries.)

use crate::config_sections::{PrefixConfig, MAX_BLOCK_BYTES, MAX_BLOCK_TOKENS};
use crate::hash::{fmix64, KeyedHasher};

const LANES: usize = 4;
/// Separates an opening's hash from a block hash over the same bytes.
const OPENING_TAG: u64 = 0x6f70_656e_696e_6721;
/// Bytes absorbed per round: one 8-byte word per lane.
const STRIPE: usize = 8 * LANES;

/// The three hash domains: a prompt of one kind never shares entries with another kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Domain {
    Chat = 0,
    Text = 1,
    Tokens = 2,
}

/// Keys of the chain hash, derived once from the configured seed.
#[derive(Debug, Clone)]
pub struct PrefixHasher {
    /// Hashes model names.
    model: KeyedHasher,
    /// Hashes tool definitions (a request's `tools`, raw JSON).
    tools: KeyedHasher,
    /// The model key of a body without a string `model`.
    no_model: u64,
    /// Initial lane values of every block.
    lanes: [u64; LANES],
    /// The "previous block hash" of a chain's first block, per domain.
    domains: [u64; 3],
}

impl PrefixHasher {
    /// Derives the keys from a seed of any length (the routing-key seed is a fine choice: the
    /// derivation is domain-separated from routing-key hashes).
    pub fn new(seed: &[u8]) -> Self {
        let tagged = |tag: &[u8]| {
            let mut s = seed.to_vec();
            s.extend_from_slice(tag);
            KeyedHasher::from_seed(&s)
        };
        let model = tagged(b"\0dp-affinity/prefix/model");
        let tools = tagged(b"\0dp-affinity/prefix/tools");
        let derive = tagged(b"\0dp-affinity/prefix/keys");
        let k = |i: u8| derive.hash(&[i]);
        PrefixHasher {
            model,
            tools,
            no_model: k(0),
            lanes: [k(1), k(2), k(3), k(4)],
            domains: [k(5), k(6), k(7)],
        }
    }

    /// What seeds every block of a chain: the model, and the tool definitions when there are
    /// some (they are rendered into the prompt near its start, so requests with other tools share
    /// nothing the index can promise).
    fn seed_key(&self, model: Option<&[u8]>, tools: Option<&[u8]>) -> u64 {
        let model = model.map_or(self.no_model, |m| self.model.hash(m));
        model ^ tools.map_or(0, |t| self.tools.hash(t))
    }

    /// The part of the seed for a member that splits the engine's cache (`cache_salt`, …: see
    /// `prompt::CACHE_SPLITTING_MEMBERS`), member `which` of that list holding `raw` (its JSON as
    /// sent): rotated by its position, so two members swapping values do not cancel out.
    pub(crate) fn member_key(&self, which: usize, raw: &[u8]) -> u64 {
        self.tools.hash(raw).rotate_left(which as u32 * 8 + 1)
    }
}

/// One lane absorbing one word (see the module doc).
#[inline(always)]
fn step(lane: u64, w: u64) -> u64 {
    let x = lane ^ w;
    (x & 0xffff_ffff).wrapping_mul(x >> 32) ^ x.rotate_left(29)
}

#[inline(always)]
fn stripe(lanes: &mut [u64; LANES], s: &[u8; STRIPE]) {
    let (words, _) = s.as_chunks::<8>();
    for (lane, w) in lanes.iter_mut().zip(words) {
        *lane = step(*lane, u64::from_le_bytes(*w));
    }
}

/// The chained block hashes of one request's canonical prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chain {
    hashes: Vec<u64>,
    capped: bool,
    opening: Option<Opening>,
    /// The prompt goes on past its opening: a list of messages, whose later turns resend the
    /// opening unchanged (a first turn ends with it, as does a conversation folded into one
    /// growing message, whose opening changes every turn: the two cannot be told apart).
    past_opening: bool,
}

/// Where a chat's *opening* ends — everything up to and including its first user message — and a
/// hash of it. Every later turn of the conversation resends those bytes unchanged, so the hash
/// names the conversation from its first turn on, even while its own part is shorter than a block
/// or than the next indexed position (see `PrefixIndex::anchor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opening {
    /// Full blocks of the stream before the opening's end.
    pub blocks: usize,
    /// Covers the stream's bytes up to the opening's end (and the model).
    pub hash: u64,
}

impl Chain {
    /// Hash `i` covers blocks `0..=i` (and the model).
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    /// Number of full blocks hashed.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Whether the prompt reached `max_blocks` (the rest, if any, was not hashed).
    pub fn capped(&self) -> bool {
        self.capped
    }

    /// The chat's opening, if the prompt is a chat with a user message ending within
    /// `max_blocks`.
    pub fn opening(&self) -> Option<Opening> {
        self.opening
    }

    /// Whether the prompt goes on past its opening (see [`Chain::opening`]): then its next turns
    /// are known to resend the opening as it is.
    pub fn past_opening(&self) -> bool {
        self.past_opening
    }
}

/// Streams the canonical prompt into block hashes.
pub(crate) struct ChainBuilder<'h> {
    h: &'h PrefixHasher,
    text_block: usize,
    token_block: usize,
    max_blocks: usize,
    /// `None` until a prompt member starts; stays `None` for a body without one.
    domain: Option<Domain>,
    /// The prompt has a shape the chain does not describe: no chain at all.
    unusable: bool,
    /// Bytes per block in the current domain (>= 1).
    block_len: usize,
    /// Bytes of the current block absorbed so far (< `block_len`).
    filled: usize,
    lanes: [u64; LANES],
    /// A partial stripe: `carry[..ncarry]`.
    carry: [u8; STRIPE],
    ncarry: usize,
    /// Hash of the previous block (the domain key before the first).
    prev: u64,
    hashes: Vec<u64>,
    /// Set by [`mark_opening`](Self::mark_opening), once.
    opening: Option<Opening>,
    /// Bytes of the current block fed when the opening was marked (see `Chain::past_opening`).
    opening_filled: usize,
    /// While set, what is fed is recorded instead of hashed (see [`Recording`]).
    recording: Option<Recording>,
}

/// What a walk fed, kept to be fed again after a prefix found later in the body: a Responses or
/// Messages body whose lead (the system text the chain starts with) comes after its list, as
/// alphabetical serialisers write them. Replaying costs the hashing only, not a second walk of
/// the JSON. Bounded: nothing is recorded past what `max_blocks` blocks can hold, and a walk
/// that would need more than `MAX_PIECES` pieces (a body of many tiny items) is given up
/// (`overflowed`: the caller walks the JSON again instead), so a recording holds at most a few
/// tens of KiB whatever the body. While recording, the walk is gated by the list's own bytes
/// (the lead's length is not known yet): content a lead-first walk would have stopped before, past
/// `max_blocks`, is still read, and a malformed one there makes the prompt unusable.
#[derive(Debug, Default)]
pub(crate) struct Recording {
    /// The body the walk reads, by address: a fed slice inside it is kept as a span.
    base: usize,
    len: usize,
    pieces: Vec<Piece>,
    /// The bytes fed from elsewhere (the walk's separators and labels), in order.
    extra: Vec<u8>,
    bytes: usize,
    cap: usize,
    opened: bool,
    unusable: bool,
    /// More was needed than `MAX_PIECES` pieces or `MAX_EXTRA` bytes: nothing after that was
    /// kept.
    pub(crate) overflowed: bool,
}

impl Recording {
    /// Appends a piece, or gives the recording up when it holds `MAX_PIECES` already.
    fn push(&mut self, piece: Piece) {
        if self.pieces.len() == MAX_PIECES {
            self.overflowed = true;
        } else {
            self.pieces.push(piece);
        }
    }
}

/// Pieces a recording may hold (spans next to each other in the body, and bytes fed from
/// elsewhere one after the other, are merged into one).
const MAX_PIECES: usize = 4096;
/// Bytes fed from elsewhere than the body a recording may hold (two separators a message).
const MAX_EXTRA: usize = 16 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Piece {
    /// A span of the body: start, length.
    Body(usize, usize),
    /// A span of `Recording::extra`: start, length.
    Extra(usize, usize),
    Opening,
}

impl<'h> ChainBuilder<'h> {
    pub(crate) fn new(h: &'h PrefixHasher, cfg: &PrefixConfig) -> Self {
        ChainBuilder {
            h,
            text_block: cfg.block_bytes.clamp(1, MAX_BLOCK_BYTES) as usize,
            token_block: 4 * cfg.block_tokens.clamp(1, MAX_BLOCK_TOKENS) as usize,
            max_blocks: cfg.max_blocks(),
            domain: None,
            unusable: false,
            block_len: 1,
            filled: 0,
            lanes: h.lanes,
            carry: [0; STRIPE],
            ncarry: 0,
            prev: 0,
            hashes: Vec::new(),
            opening: None,
            opening_filled: 0,
            recording: None,
        }
    }

    /// Forgets everything: a prompt member starts (again).
    pub(crate) fn reset(&mut self) {
        self.domain = None;
        self.unusable = false;
        self.hashes.clear();
        self.opening = None;
        self.recording = None;
    }

    /// [`reset`](Self::reset), for a call that walks the prompt member next.
    pub(crate) fn restart(&mut self) -> &mut Self {
        self.reset();
        self
    }

    /// Notes the end of the chat's opening here (the first call only; none once the chain is
    /// full). The hash covers every byte fed so far: the previous block's hash, the lanes of the
    /// current block with its partial stripe zero-padded, and how many bytes of it there are
    /// (which the padding alone would not tell).
    pub(crate) fn mark_opening(&mut self) {
        if let Some(r) = self.recording.as_mut() {
            if !r.opened && r.bytes < r.cap && !r.overflowed {
                r.opened = true;
                r.push(Piece::Opening);
            }
            return;
        }
        if self.opening.is_some() || !self.active() {
            return;
        }
        let h = self.block_hash(fmix64(self.prev ^ OPENING_TAG ^ self.filled as u64));
        self.opening = Some(Opening {
            blocks: self.hashes.len(),
            hash: h,
        });
        self.opening_filled = self.filled;
    }

    pub(crate) fn begin(&mut self, domain: Domain) {
        self.domain = Some(domain);
        self.block_len = match domain {
            Domain::Tokens => self.token_block,
            Domain::Chat | Domain::Text => self.text_block,
        };
        self.filled = 0;
        self.lanes = self.h.lanes;
        self.ncarry = 0;
        self.prev = self.h.domains[domain as usize];
        if self.hashes.capacity() == 0 {
            self.hashes.reserve_exact(self.max_blocks.min(256));
        }
    }

    pub(crate) fn unusable(&mut self) {
        self.unusable = true;
    }

    /// Whether more input can still change the chain.
    #[inline]
    pub(crate) fn active(&self) -> bool {
        self.domain.is_some()
            && !self.unusable
            && self.hashes.len() < self.max_blocks
            && self.recording.as_ref().is_none_or(|r| r.bytes < r.cap)
    }

    /// From now on, records what is fed from `body` (and the opening) instead of hashing it,
    /// until [`take_recording`](Self::take_recording).
    pub(crate) fn record(&mut self, body: &[u8]) {
        self.recording = Some(Recording {
            base: body.as_ptr() as usize,
            len: body.len(),
            cap: self.max_blocks.saturating_mul(self.block_len),
            ..Recording::default()
        });
    }

    /// Stops recording; the recording (with whether the walk found the prompt unusable).
    pub(crate) fn take_recording(&mut self) -> Option<Recording> {
        let mut r = self.recording.take()?;
        r.unusable = self.unusable;
        Some(r)
    }

    /// Feeds a recording again (of a walk over `body`), as the walk fed it.
    pub(crate) fn replay(&mut self, body: &[u8], r: &Recording) {
        if r.unusable {
            self.unusable();
        }
        for piece in &r.pieces {
            match *piece {
                Piece::Body(at, len) => self.feed(body.get(at..at + len).unwrap_or_default()),
                Piece::Extra(at, len) => self.feed(r.extra.get(at..at + len).unwrap_or_default()),
                Piece::Opening => self.mark_opening(),
            }
        }
    }

    #[cold]
    #[inline(never)]
    fn record_piece(&mut self, data: &[u8]) {
        let Some(r) = self.recording.as_mut() else {
            return;
        };
        let at = (data.as_ptr() as usize).wrapping_sub(r.base);
        let data = data.get(..r.cap.saturating_sub(r.bytes)).unwrap_or(data);
        if data.is_empty() || r.overflowed {
            return;
        }
        r.bytes += data.len();
        let in_body = at <= r.len && data.len() <= r.len - at;
        let piece = match (r.pieces.last_mut(), in_body) {
            (Some(Piece::Body(start, len)), true) if *start + *len == at => {
                *len += data.len();
                None
            }
            (Some(Piece::Extra(_, len)), false) => {
                *len += data.len();
                None
            }
            (_, true) => Some(Piece::Body(at, data.len())),
            (_, false) => Some(Piece::Extra(r.extra.len(), data.len())),
        };
        if !in_body {
            if r.extra.len() + data.len() > MAX_EXTRA {
                r.overflowed = true;
                return;
            }
            r.extra.extend_from_slice(data);
        }
        if let Some(piece) = piece {
            r.push(piece);
        }
    }

    /// Appends bytes to the canonical stream.
    pub(crate) fn feed(&mut self, mut data: &[u8]) {
        #[cfg(test)]
        tests::FED.with(|f| f.set(f.get() + data.len()));
        if self.recording.is_some() {
            return self.record_piece(data);
        }
        while !data.is_empty() && self.active() {
            let room = self.block_len.saturating_sub(self.filled).max(1);
            let (now, rest) = data.split_at(room.min(data.len()));
            self.absorb(now);
            self.filled += now.len();
            if self.filled >= self.block_len {
                self.finish_block();
            }
            data = rest;
        }
    }

    /// Appends one token id (as its 4 little-endian bytes).
    #[inline(always)]
    pub(crate) fn push_u32(&mut self, id: u32) {
        debug_assert!(self.recording.is_none(), "token ids are never recorded");
        // Token blocks are a multiple of 4 bytes, so a token never straddles a stripe or a block.
        let fits = self.active() && self.block_len.saturating_sub(self.filled) >= 4;
        let at = self.ncarry;
        match self.carry.get_mut(at..at + 4) {
            Some(dst) if fits => {
                dst.copy_from_slice(&id.to_le_bytes());
                self.ncarry += 4;
                self.filled += 4;
                if self.ncarry == STRIPE {
                    let c = self.carry;
                    stripe(&mut self.lanes, &c);
                    self.ncarry = 0;
                }
                if self.filled >= self.block_len {
                    self.finish_block();
                }
            }
            _ => self.feed(&id.to_le_bytes()),
        }
    }

    /// Absorbs bytes that all belong to the current block.
    #[inline]
    fn absorb(&mut self, mut d: &[u8]) {
        if self.ncarry > 0 {
            let take = (STRIPE - self.ncarry).min(d.len());
            let (head, rest) = d.split_at(take);
            if let Some(dst) = self.carry.get_mut(self.ncarry..self.ncarry + take) {
                dst.copy_from_slice(head);
            }
            self.ncarry += take;
            d = rest;
            if self.ncarry < STRIPE {
                return;
            }
            let c = self.carry;
            stripe(&mut self.lanes, &c);
            self.ncarry = 0;
        }
        let (stripes, rest) = d.as_chunks::<STRIPE>();
        for s in stripes {
            stripe(&mut self.lanes, s);
        }
        if let Some(dst) = self.carry.get_mut(..rest.len()) {
            dst.copy_from_slice(rest);
            self.ncarry = rest.len();
        }
    }

    /// The current block's lanes, with its partial stripe zero-padded, folded into `prev`: a
    /// full block's hash (from the previous block's), or an opening's (see `mark_opening`).
    fn block_hash(&self, prev: u64) -> u64 {
        let mut lanes = self.lanes;
        if self.ncarry > 0 {
            let mut last = [0u8; STRIPE];
            if let (Some(dst), Some(src)) =
                (last.get_mut(..self.ncarry), self.carry.get(..self.ncarry))
            {
                dst.copy_from_slice(src);
            }
            stripe(&mut lanes, &last);
        }
        lanes.iter().fold(prev, |h, &lane| fmix64(h ^ lane))
    }

    fn finish_block(&mut self) {
        let h = self.block_hash(self.prev);
        self.ncarry = 0;
        self.hashes.push(h);
        self.prev = h;
        self.lanes = self.h.lanes;
        self.filled = 0;
    }

    /// The chain, every block seeded by `model` and `tools` (see `PrefixHasher::seed_key`) and
    /// `members` (the [`PrefixHasher::member_key`]s of the request, XORed; 0 for none).
    pub(crate) fn finish(
        mut self,
        model: Option<&[u8]>,
        tools: Option<&[u8]>,
        members: u64,
    ) -> Chain {
        if self.unusable || self.domain.is_none() {
            return Chain::default();
        }
        let key = self.h.seed_key(model, tools) ^ members;
        for h in &mut self.hashes {
            *h = fmix64(*h ^ key);
        }
        let capped = self.hashes.len() >= self.max_blocks;
        let past_opening = self
            .opening
            .is_some_and(|o| self.hashes.len() > o.blocks || self.filled != self.opening_filled);
        let opening = self.opening.map(|o| Opening {
            hash: fmix64(o.hash ^ key),
            ..o
        });
        Chain {
            hashes: self.hashes,
            capped,
            opening,
            past_opening,
        }
    }
}

/// The hashing tests, and helpers the walker's and the index's tests share.
#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    thread_local! {
        /// Bytes given to `ChainBuilder::feed` on this thread (tests bound a walk's work by it).
        pub(crate) static FED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    pub(crate) fn cfg(block_bytes: u32, block_tokens: u32, max_blocks: u32) -> PrefixConfig {
        PrefixConfig {
            block_bytes,
            block_tokens,
            max_blocks,
            ..PrefixConfig::default()
        }
    }

    pub(crate) fn hasher() -> PrefixHasher {
        PrefixHasher::new(b"test-seed")
    }

    /// The chain of an explicit canonical stream, fed in one piece.
    pub(crate) fn direct(
        domain: Domain,
        stream: &[u8],
        model: Option<&str>,
        c: &PrefixConfig,
    ) -> Vec<u64> {
        let h = hasher();
        let mut b = ChainBuilder::new(&h, c);
        b.begin(domain);
        b.feed(stream);
        b.finish(model.map(str::as_bytes), None, 0).hashes
    }

    /// A walk recorded and replayed after a prefix fed later gives the chain (and opening) of
    /// the prefix fed first: body spans, bytes from elsewhere longer than a small piece, the
    /// opening, and the cap (nothing past `max_blocks` blocks is kept).
    #[test]
    fn a_recorded_walk_replays_after_a_later_prefix() {
        let body = b"0123456789abcdefghijklmnopqrstuvwxyz".repeat(4);
        let label = *b"a label longer than eight bytes";
        let walk = |b: &mut ChainBuilder<'_>| {
            b.feed(body.get(3..40).unwrap_or_default());
            b.feed(&label);
            b.mark_opening();
            b.feed(body.get(40..).unwrap_or_default());
        };
        for max_blocks in [64, 5] {
            let c = cfg(16, 4, max_blocks);
            let h = hasher();
            let mut direct = ChainBuilder::new(&h, &c);
            direct.begin(Domain::Chat);
            direct.feed(b"system\"lead\"");
            walk(&mut direct);
            let want = direct.finish(Some(b"m"), None, 0);

            let mut recorded = ChainBuilder::new(&h, &c);
            recorded.begin(Domain::Chat);
            recorded.record(&body);
            walk(&mut recorded);
            assert!(recorded.hashes.is_empty(), "recording hashes nothing");
            let recording = recorded.take_recording().expect("recording");
            recorded.restart().begin(Domain::Chat);
            recorded.feed(b"system\"lead\"");
            recorded.replay(&body, &recording);
            let got = recorded.finish(Some(b"m"), None, 0);
            assert_eq!(got.hashes(), want.hashes(), "max_blocks {max_blocks}");
            assert_eq!(got.opening(), want.opening(), "max_blocks {max_blocks}");
            assert_eq!(got.capped(), want.capped());
        }
    }

    /// A recording merges what lies next to each other, and gives up (rather than grow) past
    /// its bounds: many tiny pieces, or many bytes from elsewhere than the body.
    #[test]
    fn a_recording_stays_small() {
        let c = cfg(16, 4, 100_000);
        let h = hasher();
        let body = vec![b'x'; 16 * 1024];
        let record = |walk: &dyn Fn(&mut ChainBuilder<'_>)| {
            let mut b = ChainBuilder::new(&h, &c);
            b.begin(Domain::Chat);
            b.record(&body);
            walk(&mut b);
            b.take_recording().expect("recording")
        };
        // Contiguous spans of the body, and separators one after the other: two pieces.
        let r = record(&|b| {
            for at in (0..body.len()).step_by(64) {
                b.feed(body.get(at..at + 64).unwrap_or_default());
            }
            b.feed(b"\"");
            b.feed(b"\"");
        });
        assert_eq!((r.pieces.len(), r.extra.len(), r.overflowed), (2, 2, false));
        // Alternating body bytes and separators: given up at MAX_PIECES pieces.
        let r = record(&|b| {
            for at in 0..body.len() {
                b.feed(body.get(at..at + 1).unwrap_or_default());
                b.feed(b"\"");
            }
        });
        assert!(
            r.overflowed && r.pieces.len() == MAX_PIECES,
            "{}",
            r.pieces.len()
        );
        // Many bytes from elsewhere: given up at MAX_EXTRA.
        let r = record(&|b| {
            for _ in 0..MAX_EXTRA {
                b.feed(b"\"\"");
            }
        });
        assert!(
            r.overflowed && r.extra.len() <= MAX_EXTRA,
            "{}",
            r.extra.len()
        );
    }

    pub(crate) fn ids(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|i| i.to_le_bytes()).collect()
    }

    #[test]
    fn streaming_pieces_equal_one_piece() {
        let h = hasher();
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 131 % 251) as u8).collect();
        for block in [1, 7, 16, 31, 32, 33, 100, 512] {
            let c = cfg(block, 4, 64);
            let want = direct(Domain::Text, &data, None, &c);
            assert_eq!(want.len(), (data.len() / block as usize).min(64));
            let mut state = 12345u64;
            for _ in 0..20 {
                let mut b = ChainBuilder::new(&h, &c);
                b.begin(Domain::Text);
                let mut rest = &data[..];
                while !rest.is_empty() {
                    state = splitmix(state);
                    let n = (state % 70) as usize;
                    let (now, later) = rest.split_at(n.min(rest.len()));
                    b.feed(now);
                    rest = later;
                }
                assert_eq!(b.finish(None, None, 0).hashes, want, "block {block}");
            }
        }
        // Token ids pushed one at a time equal their bytes fed at once.
        for tokens in [1, 2, 3, 8, 9, 64] {
            let c = cfg(16, tokens, 64);
            let v: Vec<u32> = (0..500).map(|i| i * 7919).collect();
            let mut b = ChainBuilder::new(&h, &c);
            b.begin(Domain::Tokens);
            for &id in &v {
                b.push_u32(id);
            }
            assert_eq!(
                b.finish(None, None, 0).hashes,
                direct(Domain::Tokens, &ids(&v), None, &c)
            );
        }
    }

    #[test]
    fn every_bit_of_a_block_matters() {
        let c = cfg(64, 4, 8);
        let base: Vec<u8> = (0..128u8).collect();
        let want = direct(Domain::Text, &base, None, &c);
        let mut seen = std::collections::HashSet::new();
        for byte in 0..64 {
            for bit in 0..8 {
                let mut x = base.clone();
                x[byte] ^= 1 << bit;
                let got = direct(Domain::Text, &x, None, &c);
                assert_ne!(got[0], want[0], "byte {byte} bit {bit}");
                assert_ne!(got[1], want[1], "chained: the next block changes too");
                assert!(seen.insert(got[0]));
            }
        }
        // Swapping two words (same lane or not) changes the hash: the lanes are order-sensitive.
        for (a, b) in [(0, 32), (0, 8), (8, 40)] {
            let mut x = base.clone();
            for i in 0..8 {
                x.swap(a + i, b + i);
            }
            assert_ne!(direct(Domain::Text, &x, None, &c)[0], want[0]);
        }
        // No collisions among many near-identical blocks.
        let mut seen = std::collections::HashSet::new();
        for n in 0..100_000u32 {
            let mut x = [b' '; 64];
            x[..10].copy_from_slice(format!("{n:010}").as_bytes());
            assert!(seen.insert(direct(Domain::Text, &x, None, &c)[0]));
        }
    }

    pub(crate) fn splitmix(mut x: u64) -> u64 {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }
}
