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
//! [`scan_prompt`] with the body fields the filter wants (one pass); `decide::place` puts the
//! match after the key's pin and before the assigner, and `decide::prefix_choice` applies the
//! load bound to the matched rank (there is none in `assign.mode` `envoy`, which counts no
//! requests in flight); the host records the chain under the serving rank and calls
//! [`PrefixIndex::forget`] when that rank fails the request.
//!
//! # Canonical prompt
//!
//! A byte stream (or, for token ids, a stream of little-endian `u32`s), built from the body in
//! one pass by API ([`Api`], from the request path):
//! - chat completions: for each element of `messages`, in order: the role, `"`, the text content
//!   (a string, or the `text` of every `{"type":"text"}` part of an array content, concatenated;
//!   other parts and other members are ignored), `"`. Role and content are taken in that order
//!   whatever their order in the message object;
//! - completions (`prompt`) and SGLang `/generate` (`text`): a string as is; a list of strings
//!   (a batch) as each string followed by `"`; a list of integers as token ids; a list of lists of
//!   integers as each list followed by the separator id `u32::MAX`. `/generate`'s `input_ids`
//!   is read the same way. Text and token prompts are separate hash domains, and chat is a third
//!   (so a completions batch can never collide with a chat that renders to the same bytes).
//!
//! `"` is an unambiguous separator: it never appears unescaped inside a JSON string.
//!
//! **Strings are hashed as their raw JSON bytes**: escapes are not decoded. Decoding would cost a
//! copy (or a branch per byte) of a prompt that may be megabytes, for no routing gain: a client
//! resends its conversation with the same serialiser, so the same prompt arrives as the same
//! bytes. The price is that two clients escaping the same text differently (`\u00e9` against `é`,
//! as Python's `ensure_ascii` does) do not share entries: a missed sharing, never a wrong answer.
//!
//! The `model` member (anywhere in the object, raw bytes, last one wins) seeds the chain so that
//! models never share entries. It may come after the prompt, so the walk hashes a
//! model-independent chain and mixes the model into each block hash at the end (at most
//! `max_blocks` values). A prompt member present twice: the last one wins, as in serde and
//! Python; inside a message a duplicated `role` or `content` makes the prompt unusable.
//!
//! Only full blocks are hashed (`block_bytes` bytes of text, `block_tokens` ids): a partial last
//! block identifies no cached prefix. Only the first `max_blocks` blocks are hashed; the walk
//! then continues at the scanner's speed only to find `model`, the caller's wanted fields and the
//! end of the body. A body that is not a well-formed JSON object is an error (the caller passes
//! the request through); a well-formed body without a usable prompt (missing, empty, wrong shape,
//! token ids that are not `u32`) gives an empty chain. No recursion: the walker follows only the
//! fixed shapes above and skips everything else with the non-recursive scanner of `json_scan`,
//! so 100,000 nested brackets cost no stack.
//!
//! [`scan_prompt`] also reports wanted top-level members exactly as
//! [`json_scan::scan_top_level`](crate::json_scan::scan_top_level) does, so the body-field
//! extraction and the chain can share one pass over the body.
//!
//! # The index
//!
//! An [`AffinityTable`] with its own namespace: fixed buckets × ways of 16-byte entries (chained
//! hash, rank, last use), LRU within a bucket, idle TTL, compare-and-swap writes. Memory is
//! `buckets × ways × 16` bytes whatever the traffic (16 MiB by default).
//!
//! **Sparse positions.** Writing every block of every chain would cost one compare-and-swap
//! (a shared-data read and a write, ~3.5 µs in Envoy) per block: 128 for a 64 KiB prompt. The
//! index holds a chain only at *grid* positions: block counts `p >= min_match_blocks` whose binary
//! form has at most `grid_bits` significant bits (1, 2, 3, 4, 6, 8, 12, 16, 24, ... for 2 bits),
//! plus `max_blocks`, the length every long prompt ends at. With the defaults a chain has at most
//! 14 grid positions: 1 2 3 4 6 8 12 16 24 32 48 64 96 128.
//! - Precision: a match is reported at the deepest grid position the index holds, at least 2/3
//!   of the true shared prefix (exact up to 4 blocks); 3 bits give 4/5 at 24 positions.
//! - Writes: [`PrefixIndex::record`] writes only the grid positions beyond the match, bottom up
//!   (a concurrent lookup never sees a position without those below it): up to 14 for a new
//!   64 KiB prompt; for a conversation's next turn usually none, one when it crosses a grid
//!   position, so at most 14 over its whole life (instead of one per block per turn).
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
//! another prompt sharing the prefix; `decide::prefix_choice` places it by load among equally
//! good ranks (`prefix.shared_slack`). A conversation's own turns keep matching unmarked
//! positions: each turn marks the position it matched, and the next turn matches deeper.
//! Ranks that served a request sharing a position, other than the position's own, are
//! remembered in the same flags (*holders*, ranks 0–14), so a shared prefix goes to the least
//! loaded rank already holding it before it is copied to yet another one.

use std::cell::Cell;

use crate::chain::{Chain, ChainBuilder, Domain, PrefixHasher};
use crate::config_sections::PrefixConfig;
use crate::json_scan::{ScanError, Scanner, Value};
use crate::table::{
    holder_flag, AffinityTable, Lookup, Store, StoreError, Stored, TableEvents, FLAG_BRANCHED,
};

// ---------------------------------------------------------------------------------------------
// APIs
// ---------------------------------------------------------------------------------------------

/// Which request shape the body has, hence where its prompt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// OpenAI chat completions: `messages`.
    Chat,
    /// OpenAI completions: `prompt`.
    Completions,
    /// SGLang native `/generate`: `text` or `input_ids`.
    Generate,
}

impl Api {
    /// The API of a request path (`:path`, query ignored): `.../chat/completions`,
    /// `.../completions` or `.../generate`. `None`: no prompt the filter knows how to read.
    pub fn from_path(path: &[u8]) -> Option<Api> {
        let end = path
            .iter()
            .position(|&c| c == b'?' || c == b'#')
            .unwrap_or(path.len());
        let mut p = &path[..end];
        while let [rest @ .., b'/'] = p {
            p = rest;
        }
        if p.ends_with(b"/chat/completions") {
            Some(Api::Chat)
        } else if p.ends_with(b"/completions") {
            Some(Api::Completions)
        } else if p.ends_with(b"/generate") {
            Some(Api::Generate)
        } else {
            None
        }
    }

    fn is_prompt_field(self, name: &[u8]) -> bool {
        match self {
            Api::Chat => name == b"messages",
            Api::Completions => name == b"prompt",
            Api::Generate => name == b"text" || name == b"input_ids",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The canonical stream's separators
// ---------------------------------------------------------------------------------------------

/// Separates roles, contents and batch elements in the canonical text stream.
const SEP: u8 = b'"';
/// Separates the lists of a batch of token-id prompts (never a real token id).
const SEP_TOKEN: u32 = u32::MAX;

// ---------------------------------------------------------------------------------------------
// The walk
// ---------------------------------------------------------------------------------------------

/// The chain of `body`'s canonical prompt. `Err` when the body is not a well-formed JSON object.
pub fn prompt_chain(
    body: &[u8],
    api: Api,
    cfg: &PrefixConfig,
    hasher: &PrefixHasher,
) -> Result<Chain, ScanError> {
    scan_prompt(body, api, cfg, hasher, &[], |_, _| {})
}

/// [`prompt_chain`] that also reports the top-level members named in `wanted`, exactly as
/// [`scan_top_level`](crate::json_scan::scan_top_level) would (same values, document order,
/// duplicates each time), in the same single pass over the body.
pub fn scan_prompt<'a>(
    body: &'a [u8],
    api: Api,
    cfg: &PrefixConfig,
    hasher: &PrefixHasher,
    wanted: &[&str],
    mut found: impl FnMut(usize, Value<'a>),
) -> Result<Chain, ScanError> {
    let mut s = Scanner { b: body, i: 0 };
    let mut chain = ChainBuilder::new(hasher, cfg);
    let mut model: Option<(usize, usize)> = None;
    s.skip_ws();
    if s.peek() != Some(b'{') {
        return Err(ScanError::NotAnObject);
    }
    s.i += 1;
    s.skip_ws();
    if s.peek() == Some(b'}') {
        s.i += 1;
    } else {
        loop {
            let name = member_name(&mut s)?;
            let start = s.i;
            if name.as_ref() == b"model" {
                model = if s.peek() == Some(b'"') {
                    Some(string_span(&mut s)?)
                } else {
                    s.skip_value()?;
                    None
                };
            } else if api.is_prompt_field(&name) {
                chain.reset();
                match api {
                    Api::Chat => walk_messages(&mut s, &mut chain)?,
                    Api::Completions | Api::Generate => walk_text_or_ids(&mut s, &mut chain)?,
                }
            }
            match wanted.iter().position(|w| w.as_bytes() == &*name) {
                Some(idx) if s.i == start => found(idx, s.value()?),
                Some(idx) => {
                    // Already walked for the prompt or the model: read it again for the caller.
                    let mut again = Scanner { b: body, i: start };
                    found(idx, again.value()?);
                }
                None if s.i == start => s.skip_value()?,
                None => {}
            }
            s.skip_ws();
            match s.next_byte()? {
                b',' => {}
                b'}' => break,
                _ => return Err(ScanError::Syntax(s.i - 1)),
            }
        }
    }
    s.expect_end()?;
    let model = model.map(|span| bytes(body, span));
    Ok(chain.finish(model))
}

/// The raw bytes between the quotes of the string at the cursor, as a span of the body.
fn string_span(s: &mut Scanner<'_>) -> Result<(usize, usize), ScanError> {
    let start = s.i + 1;
    s.skip_string()?;
    Ok((start, s.i - 1))
}

fn bytes(b: &[u8], (start, end): (usize, usize)) -> &[u8] {
    b.get(start..end).unwrap_or(&[])
}

/// After an element of an array: `,` (more) or `]` (done).
fn array_next(s: &mut Scanner<'_>) -> Result<bool, ScanError> {
    s.skip_ws();
    match s.next_byte()? {
        b',' => Ok(true),
        b']' => Ok(false),
        _ => Err(ScanError::Syntax(s.i - 1)),
    }
}

/// After a member of an object: `,` (more) or `}` (done).
fn object_next(s: &mut Scanner<'_>) -> Result<bool, ScanError> {
    s.skip_ws();
    match s.next_byte()? {
        b',' => Ok(true),
        b'}' => Ok(false),
        _ => Err(ScanError::Syntax(s.i - 1)),
    }
}

/// Enters an array or object at the cursor (`open`): `false` if it is empty (and consumed).
fn enter(s: &mut Scanner<'_>, open: u8, close: u8) -> Result<bool, ScanError> {
    s.expect(open)?;
    s.skip_ws();
    if s.peek() == Some(close) {
        s.i += 1;
        return Ok(false);
    }
    Ok(true)
}

/// Reads `"name" :` inside an object, leaving the cursor on the value.
fn member_name<'a>(s: &mut Scanner<'a>) -> Result<std::borrow::Cow<'a, [u8]>, ScanError> {
    s.skip_ws();
    let name = s.string()?;
    s.skip_ws();
    s.expect(b':')?;
    s.skip_ws();
    Ok(name)
}

/// `messages`: an array of message objects.
fn walk_messages(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    if s.peek() != Some(b'[') {
        c.unusable();
        return s.skip_value();
    }
    c.begin(Domain::Chat);
    each_object(s, c, walk_message)
}

/// Walks an array whose elements should be objects, calling `walk` on each; any other element
/// makes the prompt unusable (and is skipped).
fn each_object(
    s: &mut Scanner<'_>,
    c: &mut ChainBuilder<'_>,
    walk: fn(&mut Scanner<'_>, &mut ChainBuilder<'_>) -> Result<(), ScanError>,
) -> Result<(), ScanError> {
    if !enter(s, b'[', b']')? {
        return Ok(());
    }
    loop {
        s.skip_ws();
        if s.peek() == Some(b'{') {
            walk(s, c)?;
        } else {
            c.unusable();
            s.skip_value()?;
        }
        if !array_next(s)? {
            return Ok(());
        }
    }
}

/// One message: role, `"`, text content, `"`, whatever the member order.
fn walk_message(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    let mut role: Option<(usize, usize)> = None;
    let mut role_fed = false;
    let mut seen_content = false;
    // Start of a content value that came before the role: walked again once the role is fed.
    let mut deferred: Option<usize> = None;
    if enter(s, b'{', b'}')? {
        loop {
            let name = member_name(s)?;
            match &*name {
                b"role" => {
                    if role.is_some() {
                        c.unusable();
                    }
                    let span = if s.peek() == Some(b'"') {
                        string_span(s)?
                    } else {
                        c.unusable();
                        s.skip_value()?;
                        (0, 0)
                    };
                    role = Some(span);
                    if !seen_content {
                        c.feed(bytes(s.b, span));
                        c.feed(&[SEP]);
                        role_fed = true;
                    }
                }
                b"content" => {
                    if seen_content {
                        c.unusable();
                    }
                    seen_content = true;
                    if role_fed {
                        walk_content(s, c)?;
                    } else {
                        deferred = Some(s.i);
                        s.skip_value()?;
                    }
                }
                _ => s.skip_value()?,
            }
            if !object_next(s)? {
                break;
            }
        }
    }
    if !role_fed {
        if let Some(span) = role {
            c.feed(bytes(s.b, span));
        }
        c.feed(&[SEP]);
    }
    if let Some(at) = deferred {
        if c.active() {
            walk_content(&mut Scanner { b: s.b, i: at }, c)?;
        }
    }
    c.feed(&[SEP]);
    Ok(())
}

/// A message's `content`: a string, an array of parts, or null.
fn walk_content(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    match s.peek() {
        Some(b'"') => {
            let span = string_span(s)?;
            c.feed(bytes(s.b, span));
            Ok(())
        }
        Some(b'[') => walk_parts(s, c),
        Some(b'n') => s.value().map(|_| ()),
        _ => {
            c.unusable();
            s.skip_value()
        }
    }
}

/// `[{"type":"text","text":"..."}, {"type":"image_url",...}, ...]`: the text parts, in order.
fn walk_parts(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    each_object(s, c, walk_part)
}

fn walk_part(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    let mut is_text = false;
    let mut text: Option<(usize, usize)> = None;
    if enter(s, b'{', b'}')? {
        loop {
            let name = member_name(s)?;
            let string = s.peek() == Some(b'"');
            match &*name {
                b"type" if string => is_text = bytes(s.b, string_span(s)?) == b"text",
                b"text" if string => text = Some(string_span(s)?),
                b"type" => {
                    is_text = false;
                    s.skip_value()?;
                }
                b"text" => {
                    text = None;
                    s.skip_value()?;
                }
                _ => s.skip_value()?,
            }
            if !object_next(s)? {
                break;
            }
        }
    }
    if let (true, Some(span)) = (is_text, text) {
        c.feed(bytes(s.b, span));
    }
    Ok(())
}

/// `prompt` / `text` / `input_ids`: a string, a list of strings, ids, or lists of ids.
fn walk_text_or_ids(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    match s.peek() {
        Some(b'"') => {
            c.begin(Domain::Text);
            let span = string_span(s)?;
            c.feed(bytes(s.b, span));
            Ok(())
        }
        Some(b'[') => walk_prompt_list(s, c),
        _ => {
            c.unusable();
            s.skip_value()
        }
    }
}

fn walk_prompt_list(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Kind {
        Strings,
        Ids,
        IdLists,
    }
    if !enter(s, b'[', b']')? {
        return Ok(()); // `[]`: an empty prompt
    }
    // The first element decides what the list is; an element of another kind spoils it.
    let kind = match s.peek() {
        Some(b'"') => Kind::Strings,
        Some(b'[') => Kind::IdLists,
        _ => Kind::Ids,
    };
    c.begin(match kind {
        Kind::Strings => Domain::Text,
        Kind::Ids | Kind::IdLists => Domain::Tokens,
    });
    if kind == Kind::Ids {
        return id_elements(s, c);
    }
    loop {
        s.skip_ws();
        match (kind, s.peek()) {
            (Kind::Strings, Some(b'"')) => {
                let span = string_span(s)?;
                c.feed(bytes(s.b, span));
                c.feed(&[SEP]);
            }
            (Kind::Ids, Some(b'-' | b'0'..=b'9')) => token_id(s, c)?,
            (Kind::IdLists, Some(b'[')) => {
                walk_ids(s, c)?;
                c.push_u32(SEP_TOKEN);
            }
            _ => {
                c.unusable();
                s.skip_value()?;
            }
        }
        if !array_next(s)? {
            return Ok(());
        }
    }
}

/// An inner list of token ids.
fn walk_ids(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    if !enter(s, b'[', b']')? {
        return Ok(());
    }
    id_elements(s, c)
}

/// The elements of a non-empty list of token ids, from the first one to the closing `]`.
fn id_elements(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    loop {
        // Fast path: `digits,` or `digits]`, as serialisers write ids (a few ns an id).
        if let Some(word) = s.b.get(s.i..s.i + 8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            let (len, v) = swar_digits(u64::from_le_bytes(w));
            if len > 0 && !(len > 1 && w[0] == b'0') {
                match w.get(len) {
                    Some(b',') => {
                        s.i += len + 1;
                        c.push_u32(v as u32);
                        continue;
                    }
                    Some(b']') => {
                        s.i += len + 1;
                        c.push_u32(v as u32);
                        return Ok(());
                    }
                    _ => {}
                }
            }
        }
        s.skip_ws();
        if let Some(b'-' | b'0'..=b'9') = s.peek() {
            token_id(s, c)?;
        } else {
            c.unusable();
            s.skip_value()?;
        }
        if !array_next(s)? {
            return Ok(());
        }
    }
}

/// One token id at the cursor (a number). Up to 7 plain digits (every real vocabulary) are
/// parsed eight bytes at a time; anything else (sign, fraction, exponent, more digits) takes the
/// scalar path, and is checked by the scanner and spoils the prompt unless it is a plain `u32`.
#[inline]
fn token_id(s: &mut Scanner<'_>, c: &mut ChainBuilder<'_>) -> Result<(), ScanError> {
    let start = s.i;
    if let Some(word) = s.b.get(start..start + 8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(word);
        let (len, v) = swar_digits(u64::from_le_bytes(w));
        if let Some(&next) = w.get(len) {
            let leading_zero = len > 1 && w[0] == b'0';
            if len > 0 && !leading_zero && !matches!(next, b'.' | b'e' | b'E') {
                s.i += len;
                c.push_u32(v as u32); // < 10^7: always a u32 and never SEP_TOKEN
                return Ok(());
            }
        }
    }
    let mut v: u64 = 0;
    while let Some(&d @ b'0'..=b'9') = s.b.get(s.i) {
        v = v * 10 + u64::from(d - b'0');
        s.i += 1;
        if s.i - start > 10 {
            break;
        }
    }
    let digits = s.i - start;
    let leading_zero = digits > 1 && s.b.get(start) == Some(&b'0');
    let plain = digits > 0
        && digits <= 10
        && !leading_zero
        && !matches!(s.peek(), Some(b'0'..=b'9' | b'.' | b'e' | b'E'));
    match u32::try_from(v) {
        Ok(id) if plain && id != SEP_TOKEN => c.push_u32(id),
        _ => {
            s.i = start;
            s.number()?;
            c.unusable();
        }
    }
    Ok(())
}

/// The leading ASCII digits of eight bytes (little-endian word): how many (0..=8) and, when
/// fewer than 8, their value. No loop and no data-dependent branch (simdjson's eight-digit
/// trick on the digits shifted to the top, the bytes below them reading as leading zeros).
#[inline]
fn swar_digits(w: u64) -> (usize, u64) {
    const LO: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    const HI: u64 = 0xf0f0_f0f0_f0f0_f0f0;
    const SEVENS: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    // A byte is a digit iff its high nibble is 3 and its low nibble at most 9 (no carries
    // between bytes: each sum stays below 0x16).
    let bad = ((w & HI) ^ 0x3030_3030_3030_3030) | (((w & LO) + 0x0606_0606_0606_0606) & HI);
    let nonzero = (((bad & SEVENS) + SEVENS) | bad) & !SEVENS;
    let len = (nonzero.trailing_zeros() / 8) as usize;
    if len == 0 || len == 8 {
        return (len, 0);
    }
    let mut v = (w & LO) << (8 * (8 - len));
    v = v.wrapping_mul(10).wrapping_add(v >> 8);
    v = ((v & 0x0000_00ff_0000_00ff).wrapping_mul(100 + (1_000_000 << 32))
        + ((v >> 16) & 0x0000_00ff_0000_00ff).wrapping_mul(1 + (10_000 << 32)))
        >> 32;
    (len, v)
}

// ---------------------------------------------------------------------------------------------
// The index
// ---------------------------------------------------------------------------------------------

/// What [`PrefixIndex::longest_match`] found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Match {
    /// Leading blocks of the chain found in the index (a grid position; 0 = none). A lower bound
    /// of the true shared prefix, to the grid's precision; never below `min_match_blocks` when
    /// non-zero.
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
    /// Store reads made.
    pub reads: u32,
    /// Store writes made (refreshes of found entries older than `refresh_seconds`).
    pub refreshes: u32,
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

    /// Indexed positions of a chain of `len` blocks.
    fn positions(&self, len: usize) -> &[u32] {
        let n = self.grid.partition_point(|&p| p as usize <= len);
        self.grid.get(..n).unwrap_or(&[])
    }

    /// The deepest indexed position of `chain` present in the index on a rank in `0..dp_size`,
    /// searched as the module doc describes. Found entries older than `refresh_seconds` are
    /// refreshed (one write each, with the token of the read).
    pub fn longest_match(&self, store: &dyn Store, chain: &[u64], now: u32, dp_size: u32) -> Match {
        let counting = CountingStore::new(store);
        let pos = self.positions(chain.len());
        let found = search(pos.len(), |i| {
            let h = *chain.get(*pos.get(i)? as usize - 1)?;
            match self.table.lookup_flagged(&counting, h, now, dp_size) {
                (Lookup::Hit { rank }, flags) => Some((rank, flags)),
                (Lookup::Miss | Lookup::Undecodable, _) => None,
            }
        });
        Match {
            blocks: found
                .and_then(|(i, _)| pos.get(i))
                .map_or(0, |&p| p as usize),
            rank: found.map(|(_, (rank, _))| rank),
            branched: found.is_some_and(|(_, (_, flags))| flags & FLAG_BRANCHED != 0),
            holders: found.map_or(0, |(_, (_, flags))| flags & !FLAG_BRANCHED),
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
        let mut events = TableEvents::default();
        let mut wrote = false;
        for &p in self.positions(chain.len()) {
            if p as usize <= matched.blocks {
                continue;
            }
            if let Some(&h) = chain.get(p as usize - 1) {
                let pinned = self.table.pin(store, h, rank, now);
                events.add(pinned);
                // A write lost to a race recorded nothing: the prompt did not go on past the
                // match as far as the index knows, so the match must not become branched.
                wrote |= pinned.cas_exhausted == 0;
            }
        }
        let flags = marks_needed(matched, rank, wrote);
        if flags != 0 {
            if let Some(&h) = matched.blocks.checked_sub(1).and_then(|i| chain.get(i)) {
                events.add(self.table.mark(store, h, flags, now));
            }
        }
        events
    }

    /// The request's *anchor*: a hash every Envoy replica derives the same from the request and
    /// the shared part of its prompt, naming the conversation rather than what it shares with
    /// others. It is the chain's hash at the first indexed position past a branched match (the
    /// prefix other prompts share: a system prompt, a document), so it covers the first block of
    /// the prompt's own part, which every later turn of the conversation repeats. With an
    /// unbranched match or none, the first position past the match stands in for it (the index
    /// does not know yet what is shared). `None`: an empty chain.
    pub fn anchor(&self, chain: &[u64], matched: &Match) -> Option<u64> {
        let last = chain.len().checked_sub(1)?;
        let next = self
            .grid
            .iter()
            .map(|&p| p as usize)
            .find(|&p| p > matched.blocks)
            .unwrap_or(chain.len());
        chain.get(next.min(last + 1) - 1).copied()
    }

    /// How many positions [`record`](Self::record) would write.
    pub fn writes_needed(&self, chain_len: usize, matched: &Match) -> usize {
        self.positions(chain_len)
            .iter()
            .filter(|&&p| p as usize > matched.blocks)
            .count()
    }

    /// After `rank` failed this request: removes the matched positions that still point at it,
    /// top down, so the next request sharing the prefix is placed afresh. Entries re-pointed
    /// elsewhere since are kept. One read per position up to the match, a write per removal.
    pub fn forget(
        &self,
        store: &dyn Store,
        chain: &[u64],
        rank: u32,
        matched: &Match,
    ) -> TableEvents {
        let mut events = TableEvents::default();
        if matched.rank != Some(rank) {
            return events;
        }
        for &p in self.positions(matched.blocks.min(chain.len())).iter().rev() {
            if let Some(&h) = chain.get(p as usize - 1) {
                events.add(self.table.unpin(store, h, rank).1);
            }
        }
        events
    }
}

/// The flags recording under `rank` adds to the matched position (0: none): branched when the
/// prompt went on past it, `rank` as a holder when it is not the position's rank.
fn marks_needed(matched: &Match, rank: u32, wrote: bool) -> u16 {
    let Some(own) = matched.rank.filter(|_| matched.blocks > 0) else {
        return 0;
    };
    let mut flags = 0;
    if wrote && !matched.branched {
        flags |= FLAG_BRANCHED;
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
    use crate::chain::tests::{cfg, direct, hasher, ids, splitmix};
    use crate::config_sections::MAX_BLOCKS_LIMIT;
    use crate::json_scan::scan_top_level;
    use crate::table::tests::MemStore;
    use serde_json::{json, Value as Json};

    fn chain(body: &str, api: Api, c: &PrefixConfig) -> Vec<u64> {
        prompt_chain(body.as_bytes(), api, c, &hasher())
            .unwrap_or_else(|e| panic!("{e:?} on {body}"))
            .hashes()
            .to_vec()
    }

    /// The canonical stream computed from a serde DOM (for bodies without escapes, where raw
    /// and decoded strings agree). `None`: no usable prompt.
    fn reference(body: &Json, api: Api) -> Option<(Domain, Vec<u8>)> {
        let text = |v: &Json| v.as_str().map(|s| s.as_bytes().to_vec());
        match api {
            Api::Chat => {
                let mut out = Vec::new();
                for m in body.get("messages")?.as_array()? {
                    let m = m.as_object()?;
                    if let Some(r) = m.get("role") {
                        out.extend(text(r)?);
                    }
                    out.push(SEP);
                    match m.get("content") {
                        None | Some(Json::Null) => {}
                        Some(Json::String(s)) => out.extend(s.as_bytes()),
                        Some(Json::Array(parts)) => {
                            for p in parts {
                                let p = p.as_object()?;
                                if p.get("type").and_then(Json::as_str) == Some("text") {
                                    if let Some(t) = p.get("text").and_then(Json::as_str) {
                                        out.extend(t.as_bytes());
                                    }
                                }
                            }
                        }
                        Some(_) => return None,
                    }
                    out.push(SEP);
                }
                Some((Domain::Chat, out))
            }
            Api::Completions | Api::Generate => {
                let field = match api {
                    Api::Completions => "prompt",
                    _ => ["text", "input_ids"]
                        .into_iter()
                        .find(|f| body.get(f).is_some())?,
                };
                let id = |v: &Json| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .filter(|&n| n != SEP_TOKEN)
                };
                match body.get(field)? {
                    Json::String(s) => Some((Domain::Text, s.as_bytes().to_vec())),
                    Json::Array(items) if items.is_empty() => None,
                    Json::Array(items) => match &items[0] {
                        Json::String(_) => {
                            let mut out = Vec::new();
                            for i in items {
                                out.extend(text(i)?);
                                out.push(SEP);
                            }
                            Some((Domain::Text, out))
                        }
                        Json::Array(_) => {
                            let mut out = Vec::new();
                            for l in items {
                                for i in l.as_array()? {
                                    out.extend(id(i)?.to_le_bytes());
                                }
                                out.extend(SEP_TOKEN.to_le_bytes());
                            }
                            Some((Domain::Tokens, out))
                        }
                        _ => {
                            let v: Option<Vec<u32>> = items.iter().map(id).collect();
                            Some((Domain::Tokens, ids(&v?)))
                        }
                    },
                    _ => None,
                }
            }
        }
    }

    fn check_against_reference(body: &str, api: Api, c: &PrefixConfig) {
        let v: Json = serde_json::from_str(body).unwrap();
        let model = v.get("model").and_then(Json::as_str);
        let want = match reference(&v, api) {
            Some((domain, stream)) => direct(domain, &stream, model, c),
            None => Vec::new(),
        };
        assert_eq!(chain(body, api, c), want, "{body}");
    }

    #[test]
    fn chat_canonical_form() {
        let c = cfg(16, 4, 64);
        let body = r#"{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant."},
            {"role":"user","content":"Hello there, how are you today?","name":"bob"}],"temperature":0}"#;
        let stream =
            b"system\"You are a helpful assistant.\"user\"Hello there, how are you today?\"";
        assert_eq!(
            chain(body, Api::Chat, &c),
            direct(Domain::Chat, stream, Some("m"), &c)
        );
        assert_eq!(chain(body, Api::Chat, &c).len(), stream.len() / 16);
        check_against_reference(body, Api::Chat, &c);
    }

    #[test]
    fn chat_multi_part_content_and_member_order() {
        let c = cfg(16, 4, 64);
        let plain = r#"{"model":"m","messages":[{"role":"user","content":"describe this picture please, in detail"}]}"#;
        let parts = r#"{"model":"m","messages":[{"role":"user","content":[
            {"type":"text","text":"describe this picture "},
            {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"},"text":"not me"},
            {"text":"please, in detail","type":"text"}]}]}"#;
        let reordered = r#"{"messages":[{"content":"describe this picture please, in detail","role":"user"}],"model":"m"}"#;
        let want = chain(plain, Api::Chat, &c);
        assert_eq!(want.len(), 2); // 45 bytes of canonical stream
        assert_eq!(chain(parts, Api::Chat, &c), want);
        assert_eq!(chain(reordered, Api::Chat, &c), want);
        for body in [plain, parts, reordered] {
            check_against_reference(body, Api::Chat, &c);
        }
        // Content-first with multi-part content, and a null content (an assistant tool call).
        let mixed = r#"{"messages":[{"content":[{"type":"text","text":"abcdefghijklmnopqrstuvwxyz"}],"role":"user"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"x"}]},{"role":"tool","content":"42"}]}"#;
        check_against_reference(mixed, Api::Chat, &c);
        assert_eq!(
            chain(mixed, Api::Chat, &c),
            direct(
                Domain::Chat,
                b"user\"abcdefghijklmnopqrstuvwxyz\"assistant\"\"tool\"42\"",
                None,
                &c
            )
        );
    }

    #[test]
    fn completions_and_generate_forms() {
        let c = cfg(8, 2, 64);
        let text = "the quick brown fox jumps over the lazy dog";
        let s = format!(r#"{{"model":"m","prompt":"{text}"}}"#);
        let want = direct(Domain::Text, text.as_bytes(), Some("m"), &c);
        assert_eq!(want.len(), text.len() / 8);
        assert_eq!(chain(&s, Api::Completions, &c), want);
        // /generate's `text` is the same prompt: the same chain (same tokens, same cache).
        let g = format!(r#"{{"text":"{text}","model":"m"}}"#);
        assert_eq!(chain(&g, Api::Generate, &c), want);
        // A batch of strings: each followed by a separator.
        let list = r#"{"model":"m","prompt":["the quick brown fox","jumps over the lazy dog"]}"#;
        assert_eq!(
            chain(list, Api::Completions, &c),
            direct(
                Domain::Text,
                b"the quick brown fox\"jumps over the lazy dog\"",
                Some("m"),
                &c
            )
        );
        // Token ids: blocks of `block_tokens` ids, the same in both APIs.
        let tok = r#"{"model":"m","prompt":[1,2,3,4,5,4294967294,0]}"#;
        let want = direct(
            Domain::Tokens,
            &ids(&[1, 2, 3, 4, 5, u32::MAX - 1]),
            Some("m"),
            &c,
        );
        assert_eq!(want.len(), 3);
        assert_eq!(chain(tok, Api::Completions, &c), want);
        let gen = r#"{"input_ids":[1,2,3,4,5,4294967294,0],"model":"m"}"#;
        assert_eq!(chain(gen, Api::Generate, &c), want);
        let lists = r#"{"prompt":[[1,2,3],[4]]}"#;
        assert_eq!(
            chain(lists, Api::Completions, &c),
            direct(
                Domain::Tokens,
                &ids(&[1, 2, 3, SEP_TOKEN, 4, SEP_TOKEN]),
                None,
                &c
            )
        );
        for body in [s.as_str(), g.as_str(), list, tok, gen, lists] {
            check_against_reference(body, Api::Completions, &c);
            check_against_reference(body, Api::Generate, &c);
        }
        // Text and tokens never share a chain, nor does chat.
        let as_text = direct(Domain::Text, &ids(&[1, 2, 3, 4]), None, &c);
        assert_ne!(
            as_text,
            direct(Domain::Tokens, &ids(&[1, 2, 3, 4]), None, &c)
        );
        assert_ne!(as_text, direct(Domain::Chat, &ids(&[1, 2, 3, 4]), None, &c));
    }

    #[test]
    fn unusable_or_missing_prompts_give_an_empty_chain() {
        let c = cfg(4, 1, 64);
        let cases: &[(&str, Api)] = &[
            (r#"{}"#, Api::Chat),
            (r#"{"model":"m"}"#, Api::Chat),
            (r#"{"messages":[]}"#, Api::Chat),
            (r#"{"messages":"hello hello hello"}"#, Api::Chat),
            (r#"{"messages":["hello hello hello"]}"#, Api::Chat),
            (r#"{"messages":[{"role":"user","content":5}]}"#, Api::Chat),
            (
                r#"{"messages":[{"role":7,"content":"hello hello"}]}"#,
                Api::Chat,
            ),
            (
                r#"{"messages":[{"role":"user","content":"hello hello","content":"x"}]}"#,
                Api::Chat,
            ),
            (
                r#"{"messages":[{"role":"user","role":"user","content":"hello hello"}]}"#,
                Api::Chat,
            ),
            (
                r#"{"messages":[{"role":"user","content":["hi there you"]}]}"#,
                Api::Chat,
            ),
            (r#"{"prompt":"hello hello"}"#, Api::Chat),
            (r#"{"prompt":""}"#, Api::Completions),
            (r#"{"prompt":[]}"#, Api::Completions),
            (r#"{"prompt":null}"#, Api::Completions),
            (r#"{"prompt":{"a":"hello hello"}}"#, Api::Completions),
            (r#"{"prompt":["hello hello",3]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,-4,5]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,4.0]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,1e2]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,4294967295]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,99999999999]}"#, Api::Completions),
            (r#"{"prompt":[1,2,3,"x"]}"#, Api::Completions),
            (r#"{"prompt":[[1,2],3]}"#, Api::Completions),
            (
                r#"{"messages":[{"role":"user","content":"hello hello"}]}"#,
                Api::Generate,
            ),
        ];
        for (body, api) in cases {
            assert!(chain(body, *api, &c).is_empty(), "{body}");
        }
        // Short of one block: nothing to hash either.
        assert!(chain(r#"{"prompt":"abc"}"#, Api::Completions, &c).is_empty());
        assert_eq!(chain(r#"{"prompt":"abcd"}"#, Api::Completions, &c).len(), 1);
        // The last duplicate of a prompt member wins, as in serde and Python.
        let dup = r#"{"prompt":"aaaaaaaa","prompt":"bbbbbbbb"}"#;
        assert_eq!(
            chain(dup, Api::Completions, &c),
            chain(r#"{"prompt":"bbbbbbbb"}"#, Api::Completions, &c)
        );
        let spoiled_then_fine = r#"{"prompt":[-1],"prompt":"bbbbbbbb"}"#;
        assert_eq!(chain(spoiled_then_fine, Api::Completions, &c).len(), 2);
    }

    #[test]
    fn malformed_bodies_are_errors() {
        let c = PrefixConfig::default();
        let h = hasher();
        for (body, err) in [
            ("", ScanError::NotAnObject),
            ("[]", ScanError::NotAnObject),
            ("\"x\"", ScanError::NotAnObject),
        ] {
            assert_eq!(
                prompt_chain(body.as_bytes(), Api::Chat, &c, &h),
                Err(err),
                "{body}"
            );
        }
        for body in [
            r#"{"messages":[{"role":"user","content":"hi"}]"#,
            r#"{"messages":[{"role":"user","content":"hi"},]}"#,
            r#"{"messages":[{"role":"user","content":"hi\x"}]}"#,
            r#"{"messages":[{"role":"user" "content":"hi"}]}"#,
            r#"{"messages":[{"content":"hi","role":"user"]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"]}]}"#,
            r#"{"prompt":[1,2,03]}"#,
            r#"{"prompt":[1,2,3,]}"#,
            r#"{"prompt":[1,2,-]}"#,
            r#"{"prompt":"x"}}"#,
            r#"{"model":"m","prompt":"x""#,
        ] {
            for api in [Api::Chat, Api::Completions] {
                assert!(
                    prompt_chain(body.as_bytes(), api, &c, &h).is_err(),
                    "{body} accepted"
                );
            }
        }
    }

    #[test]
    fn deep_nesting_does_not_recurse() {
        let c = cfg(4, 1, 64);
        let h = hasher();
        let deep =
            |open: &str, close: &str| format!("{}{}", open.repeat(100_000), close.repeat(100_000));
        let arrays = deep("[", "]");
        let objects = deep("{\"a\":", "}").replace(":}", ":1}");
        for (inner, ok) in [(arrays.as_str(), true), (&arrays[1..], false)] {
            for body in [
                format!(r#"{{"messages":{inner}}}"#),
                format!(r#"{{"messages":[{inner}]}}"#),
                format!(r#"{{"messages":[{{"role":"user","content":{inner}}}]}}"#),
                format!(r#"{{"messages":[{{"role":"user","content":[{inner}]}}]}}"#),
                format!(r#"{{"messages":[{{"content":[{{"type":"text","x":{inner}}}]}}]}}"#),
                format!(r#"{{"prompt":{inner}}}"#),
                format!(r#"{{"prompt":[[1],{inner}]}}"#),
                format!(r#"{{"other":{inner},"prompt":"abcdefgh"}}"#),
            ] {
                for api in [Api::Chat, Api::Completions] {
                    let r = prompt_chain(body.as_bytes(), api, &c, &h);
                    assert_eq!(r.is_ok(), ok, "{}", &body[..40]);
                }
            }
        }
        let body = format!(r#"{{"x":{objects},"prompt":"abcdefgh"}}"#);
        assert_eq!(chain(&body, Api::Completions, &c).len(), 2);
    }

    #[test]
    fn escapes_are_hashed_raw() {
        let c = cfg(4, 1, 64);
        // Same bytes, same chain; the same text escaped differently is another chain (documented).
        let a = r#"{"prompt":"line\none\u00e9\"q\"\\"}"#;
        let b = r#"{"prompt":"line\u000aone\u00e9\"q\"\\"}"#;
        assert_eq!(
            chain(a, Api::Completions, &c),
            direct(Domain::Text, br#"line\none\u00e9\"q\"\\"#, None, &c)
        );
        assert_ne!(
            chain(a, Api::Completions, &c),
            chain(b, Api::Completions, &c)
        );
        // Escaped member names are still recognised (names are unescaped, values are not).
        let named = r#"{"pr\u006fmpt":"abcdefgh","m\u006fdel":"m"}"#;
        assert_eq!(
            chain(named, Api::Completions, &c),
            direct(Domain::Text, b"abcdefgh", Some("m"), &c)
        );
    }

    #[test]
    fn model_seeds_the_chain_wherever_it_is() {
        let c = cfg(4, 1, 64);
        let first = r#"{"model":"a","prompt":"abcdefghijkl"}"#;
        let last = r#"{"prompt":"abcdefghijkl","model":"a"}"#;
        let other = r#"{"prompt":"abcdefghijkl","model":"b"}"#;
        let none = r#"{"prompt":"abcdefghijkl"}"#;
        let empty = r#"{"prompt":"abcdefghijkl","model":""}"#;
        let not_string = r#"{"prompt":"abcdefghijkl","model":7}"#;
        let dup = r#"{"model":"b","prompt":"abcdefghijkl","model":"a"}"#;
        let a = chain(first, Api::Completions, &c);
        assert_eq!(a.len(), 3);
        assert_eq!(chain(last, Api::Completions, &c), a);
        assert_eq!(chain(dup, Api::Completions, &c), a, "last model wins");
        assert_eq!(
            chain(not_string, Api::Completions, &c),
            chain(none, Api::Completions, &c)
        );
        for x in [other, none, empty] {
            let x = chain(x, Api::Completions, &c);
            assert!(a.iter().zip(&x).all(|(p, q)| p != q), "no shared hash");
        }
        assert_ne!(
            chain(none, Api::Completions, &c),
            chain(empty, Api::Completions, &c)
        );
    }

    #[test]
    fn seed_changes_every_hash() {
        let c = cfg(4, 1, 64);
        let body = br#"{"prompt":"abcdefghijkl"}"#;
        let a = prompt_chain(body, Api::Completions, &c, &PrefixHasher::new(b"")).unwrap();
        let b = prompt_chain(body, Api::Completions, &c, &PrefixHasher::new(b"x")).unwrap();
        assert!(a.hashes().iter().zip(b.hashes()).all(|(p, q)| p != q));
    }

    #[test]
    fn chains_extend_cap_and_drop_the_partial_block() {
        let c = cfg(16, 4, 10);
        let turn = |n: usize| {
            let mut msgs = vec![json!({"role":"system","content":"You are terse. ".repeat(5)})];
            for i in 0..n {
                msgs.push(json!({"role":"user","content":format!("question {i} ").repeat(3)}));
                msgs.push(json!({"role":"assistant","content":format!("answer {i}")}));
            }
            json!({"model":"m","messages":msgs}).to_string()
        };
        let one = chain(&turn(1), Api::Chat, &c);
        let two = chain(&turn(2), Api::Chat, &c);
        assert!(one.len() < two.len());
        // The block holding the end of turn 1 differs (turn 2 continues it); all before agree.
        let stream1 = reference(&serde_json::from_str(&turn(1)).unwrap(), Api::Chat)
            .unwrap()
            .1;
        let full = stream1.len() / 16;
        assert_eq!(one.len(), full, "partial last block not hashed");
        assert_eq!(one[..full], two[..full]);
        // Capped at max_blocks; a prompt beyond the cap keeps the same chain.
        let long = chain(&turn(40), Api::Chat, &c);
        assert_eq!(long.len(), 10);
        assert_eq!(chain(&turn(41), Api::Chat, &c), long);
        let capped = prompt_chain(turn(40).as_bytes(), Api::Chat, &c, &hasher()).unwrap();
        assert!(capped.capped());
        assert!(!prompt_chain(turn(1).as_bytes(), Api::Chat, &c, &hasher())
            .unwrap()
            .capped());
        // Exactly n blocks of text: n hashes.
        for n in 0..5 {
            let body = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(16 * n));
            assert_eq!(chain(&body, Api::Completions, &c).len(), n);
        }
    }

    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = splitmix(self.0);
            self.0 % n
        }

        fn text(&mut self, k: u64) -> String {
            const WORDS: [&str; 8] = [
                "alpha ", "beta ", "gamma", " delta ", "é ", "日本 ", "", "x",
            ];
            (0..k).map(|_| WORDS[self.below(8) as usize]).collect()
        }
    }

    /// An object with its members in the given order (serde_json's map would sort them).
    fn object(members: &[(&str, String)]) -> String {
        let inner: Vec<String> = members.iter().map(|(k, v)| format!("{k:?}:{v}")).collect();
        format!("{{{}}}", inner.join(","))
    }

    /// Random chat bodies (random member order, parts, extra members, model anywhere) against
    /// the serde reference.
    #[test]
    fn random_chat_bodies_match_the_reference() {
        let mut r = Rng(99);
        for _ in 0..2000 {
            let block = [1, 3, 8, 16, 40][r.below(5) as usize];
            let c = cfg(block, 2, 1 + r.below(30) as u32);
            let mut msgs = Vec::new();
            for _ in 0..r.below(6) {
                let content = match r.below(4) {
                    0 => "null".to_string(),
                    1 => {
                        let parts: Vec<String> = (0..r.below(4))
                            .map(|_| match r.below(3) {
                                0 => object(&[
                                    ("type", json!("text").to_string()),
                                    ("text", json!(r.text(3)).to_string()),
                                ]),
                                1 => object(&[
                                    ("text", json!(r.text(2)).to_string()),
                                    ("type", json!("text").to_string()),
                                ]),
                                _ => object(&[
                                    ("type", json!("image_url").to_string()),
                                    ("image_url", json!({"url":"u"}).to_string()),
                                ]),
                            })
                            .collect();
                        format!("[{}]", parts.join(","))
                    }
                    _ => {
                        let words = r.below(12);
                        json!(r.text(words)).to_string()
                    }
                };
                let mut members =
                    vec![("role", json!(r.text(1)).to_string()), ("content", content)];
                if r.below(2) == 0 {
                    members.reverse();
                }
                if r.below(3) == 0 {
                    let at = r.below(3) as usize;
                    members.insert(at, ("name", json!({"n":[1,2,{"k":"v"}]}).to_string()));
                }
                if r.below(5) == 0 {
                    members.retain(|(k, _)| *k != "role");
                }
                msgs.push(object(&members));
            }
            let mut top = vec![
                ("messages", format!("[{}]", msgs.join(","))),
                ("temperature", "0.5".to_string()),
                ("routing_key", "\"k\"".to_string()),
            ];
            if r.below(4) != 0 {
                let at = r.below(4) as usize;
                top.insert(at, ("model", json!(r.text(2)).to_string()));
            }
            check_against_reference(&object(&top), Api::Chat, &c);
        }
    }

    #[test]
    fn grammar_agrees_with_scan_top_level_on_mutated_bodies() {
        let seeds = [
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi \"there\""}]},{"content":"yo","role":"assistant"}],"stream":true}"#,
            r#"{"prompt":[[1,2,3],[4,5]],"model":"m","n":-1.5e3}"#,
            r#"{"input_ids":[1,20,300,4000],"text":"abc\u00e9","sampling_params":{"max_new_tokens":8}}"#,
        ];
        let c = cfg(4, 2, 16);
        let h = hasher();
        let alphabet = b"{}[]\":,\\ 0123456789-.eEtrufalsn\"xu";
        let mut r = 7u64;
        for seed in seeds {
            for _ in 0..4000 {
                let mut b = seed.as_bytes().to_vec();
                for _ in 0..1 + splitmix(r) % 3 {
                    r = splitmix(r);
                    let at = (r % b.len() as u64) as usize;
                    let c = alphabet[(r >> 32) as usize % alphabet.len()];
                    match (r >> 20) % 4 {
                        0 => b[at] = c,
                        1 => b.insert(at, c),
                        2 => {
                            b.remove(at);
                        }
                        _ => b.truncate(at),
                    }
                    if b.is_empty() {
                        b.push(b'{');
                    }
                }
                let top = scan_top_level(&b, &[], |_, _| {}).is_ok();
                for api in [Api::Chat, Api::Completions, Api::Generate] {
                    let ours = prompt_chain(&b, api, &c, &h);
                    assert_eq!(
                        ours.is_ok(),
                        top,
                        "{:?} on {}",
                        ours,
                        String::from_utf8_lossy(&b)
                    );
                }
            }
        }
    }

    #[test]
    fn wanted_fields_are_reported_like_scan_top_level() {
        let c = PrefixConfig::default();
        let h = hasher();
        let wanted = ["routing_key", "model", "messages", "user", "routed_dp_rank"];
        for body in [
            r#"{"model":"m\u00e9","messages":[{"role":"user","content":"x"}],"routing_key":"a\nb","routed_dp_rank":3,"user":null}"#,
            r#"{"user":"u","routing_key":"k","routing_key":"k2","messages":[]}"#,
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
        ] {
            let mut ours = Vec::new();
            let mut theirs = Vec::new();
            scan_prompt(body.as_bytes(), Api::Chat, &c, &h, &wanted, |i, v| {
                ours.push((i, v))
            })
            .unwrap();
            scan_top_level(body.as_bytes(), &wanted, |i, v| theirs.push((i, v))).unwrap();
            assert_eq!(ours, theirs, "{body}");
        }
    }

    #[test]
    fn swar_digits_agree_with_a_loop() {
        let mut r = Rng(5);
        for _ in 0..200_000 {
            let mut w = [0u8; 8];
            for b in &mut w {
                *b = match r.below(4) {
                    0 => b"0123456789,] .e-"[r.below(16) as usize],
                    _ => b'0' + r.below(10) as u8,
                };
            }
            if r.below(3) == 0 {
                w[r.below(8) as usize] = r.below(256) as u8;
            }
            let len = w.iter().take_while(|b| b.is_ascii_digit()).count();
            let value = w[..len]
                .iter()
                .fold(0u64, |v, d| v * 10 + u64::from(d - b'0'));
            let got = swar_digits(u64::from_le_bytes(w));
            assert_eq!(got.0, len, "{w:?}");
            if len < 8 {
                assert_eq!(got.1, value, "{w:?}");
            }
        }
    }

    #[test]
    fn api_from_path() {
        for (path, api) in [
            ("/v1/chat/completions", Some(Api::Chat)),
            ("/v1/chat/completions?x=1", Some(Api::Chat)),
            ("/openai/v1/chat/completions/", Some(Api::Chat)),
            ("/v1/completions", Some(Api::Completions)),
            ("/generate", Some(Api::Generate)),
            ("/generate?stream=1", Some(Api::Generate)),
            ("/v1/models", None),
            ("/", None),
            ("", None),
            ("/v1/embeddings", None),
        ] {
            assert_eq!(Api::from_path(path.as_bytes()), api, "{path}");
        }
    }

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

    // -----------------------------------------------------------------------------------------
    // The index
    // -----------------------------------------------------------------------------------------

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
            [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
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
                let want = idx.grid().iter().rev().find(|&&p| p as usize <= reach);
                assert_eq!(
                    m.blocks,
                    want.map_or(0, |&p| p as usize),
                    "len {len} shared {shared}"
                );
                assert_eq!(m.rank, want.map(|_| 2));
            }
        }
        let m = idx.longest_match(&s, &b, 1001, 4);
        assert_eq!((m.blocks, m.rank, m.reads), (16, Some(3), 1));
        // Another chain sharing 30 blocks of `a`, recorded on rank 1 beyond its match: deeper
        // positions go to rank 1, shallower ones keep rank 2.
        let c = random_chain(3, 60, &a, 30);
        let m = idx.longest_match(&s, &c, 1002, 4);
        assert_eq!((m.blocks, m.rank), (24, Some(2)));
        assert_eq!(idx.writes_needed(c.len(), &m), 2); // 32 48 (and not 64: only 60 blocks)
        idx.record(&s, &c, 1, 1002, &m);
        assert_eq!(idx.longest_match(&s, &c, 1003, 4).rank, Some(1));
        assert_eq!(idx.longest_match(&s, &a[..30], 1003, 4).rank, Some(2));
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

    #[test]
    fn the_anchor_is_the_first_position_past_the_shared_part() {
        let idx = PrefixIndex::new(&index_cfg(64, 16));
        let system = random_chain(1, 5, &[], 0);
        let a = random_chain(2, 40, &system, 5);
        let b = random_chain(3, 40, &system, 5);
        // The system prompt (5 blocks) is indexed down to grid position 4, branched.
        let shared = Match {
            blocks: 4,
            rank: Some(0),
            branched: true,
            ..Match::default()
        };
        // Past position 4 the next grid position is 6: the hash of the first 6 blocks, which
        // include the prompt's own sixth block, differs between the two conversations...
        assert_eq!(idx.anchor(&a, &shared), Some(a[5]));
        assert_ne!(idx.anchor(&a, &shared), idx.anchor(&b, &shared));
        // ...and stays the same for a later turn of the same conversation.
        let a_next = random_chain(2, 60, &a, 40);
        assert_eq!(idx.anchor(&a_next, &shared), idx.anchor(&a, &shared));
        // A chain shorter than the next position: its last block. Empty: none.
        assert_eq!(idx.anchor(&a[..5], &shared), Some(a[4]));
        assert_eq!(idx.anchor(&[], &shared), None);
        assert_eq!(idx.anchor(&a, &Match::default()), Some(a[0]));
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
        // The one deeper position's write loses every race (its retries included); the store
        // would take the mark that follows.
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
        // (8, then 12): its next turn cannot be told from a new prompt, and what it can lose by
        // being spread is those unindexed blocks.
        let a2 = random_chain(10, 14, &a1, 11);
        let m = idx.longest_match(&s, &a2, 1000, 4);
        assert_eq!((m.blocks, m.rank, m.branched), (8, Some(0), true));
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
            2,
            "position 12, and the holder flag"
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
        // Ranks from 15 on have no holder flag: nothing to write for them either.
        assert_eq!(writes(short, &m2, 15), 0);
    }

    #[test]
    fn record_writes_only_what_changed() {
        let s = MemStore::default();
        let idx = PrefixIndex::new(&index_cfg(64, 16));
        idx.table().ensure_buckets(&s);
        let counted = CountingStore::new(&s);
        let conv = random_chain(1, 128, &[], 0);
        let mut now = 1000;
        let mut total_writes = 0;
        let mut marks = 0;
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
                match crossed {
                    0 => assert_eq!(m.reads, 1, "len {len}"),
                    1 => assert_eq!(m.reads, 2, "len {len}"),
                    _ => assert!(m.reads <= 7),
                }
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
            total_writes += needed;
            marks += mark;
        }
        assert_eq!(
            total_writes, 14,
            "each grid position written once over the conversation"
        );
        // Turns after the first that crossed grid positions (at 8, 14, 17, 26, 32, 50, 65, 98
        // and 128 blocks) each marked the position they matched: one write more apiece.
        assert_eq!(
            marks, 9,
            "every turn that went past its match marked it, once"
        );
        // Fully matched: nothing to write.
        let m = idx.longest_match(&counted, &conv, now, 4);
        counted.writes.set(0);
        idx.record(&counted, &conv, 1, now, &m);
        assert_eq!(counted.writes.get(), 0);
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
        // Over a real index: at most 7 reads for the default 14 positions.
        let (s, idx) = (MemStore::default(), PrefixIndex::new(&index_cfg(64, 16)));
        let a = random_chain(1, 128, &[], 0);
        idx.record(&s, &a, 0, 1000, &Match::default());
        let worst = (0..=128)
            .map(|shared| {
                let q = random_chain(7 + shared as u64, 128, &a, shared);
                idx.longest_match(&s, &q, 1000, 4).reads
            })
            .max();
        assert_eq!(worst, Some(7));
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
