//! Shared per-rank state: requests in flight, failure strikes and cool-downs, in one shared-data
//! key, so one read gives an assigner the whole picture — a picture that cannot drift.
//!
//! Why the in-flight counts converge to the truth by themselves: nobody adds to or subtracts
//! from a shared count. Each VM (one per Envoy worker) keeps the counts of *its own* streams in
//! memory ([`LocalLoad`]) — exact, since a VM is single-threaded and `on_log` (or `on_done`,
//! whichever comes first) ends every stream it saw start — and publishes them whole as its own *column* of the board, stamped with the
//! time of writing. The load of a rank is the sum over the columns stamped within
//! [`LEASE_SECONDS`]. Hence:
//! - a lost compare-and-swap loses nothing: the VM still holds the truth and its next write (the
//!   next request, or its tick within a second) publishes it whole;
//! - a VM that traps, is replaced, or is reloaded with its streams in flight stops stamping its
//!   column: the column drops out of every sum after [`LEASE_SECONDS`] and the next writer
//!   removes it;
//! - a VM with streams in flight re-stamps its column every tick; one with none removes it.
//!
//! So after any fault the counts are back to the truth within `LEASE_SECONDS + 1` seconds, with
//! nothing to reset by hand.
//!
//! Each column also carries the VM's *recent work* per rank: the prompt blocks it sent there
//! lately, decayed every tick. Summed like the counts, it is the Envoy's (not one worker's) view
//! of how much work each rank was given, which keeps every worker — and replicas seeing similar
//! traffic — breaking ties between ranks the same way.
//!
//! Value layout (little endian), `v2`:
//! - header, 12 bytes: `b"DPB2" | next_id: u32 | columns: u16 | dp_size: u16`;
//! - per rank, 12 bytes: `down_until: u32 | strike_since: u32 | strikes: u32` (unix seconds);
//! - per column, `8 + 8 × dp_size` bytes: `id: u32 | stamp: u32 | inflight: u32 × dp_size |
//!   recent: u32 × dp_size`.
//!
//! The key, `<namespace>/load2/<dp_size>`, names the layout's version. A value that does not
//! decode (garbage, another `dp_size`) reads as an idle board and is
//! replaced on the next write: corruption costs a few seconds of load view, never a panic.

use crate::clock::plausible_stamp;
use crate::table::{Store, StoreError, NO_KEY_TOKEN};

/// A column stamped more than this many seconds ago is a dead VM's: ignored and removed.
/// Ticks re-stamp live columns every second; the margin covers a busy worker's late tick and
/// the one-second resolution of the clock.
pub const LEASE_SECONDS: u32 = 5;

/// The longest cool-down a configuration may set (`assign.cooldown_seconds`).
pub const MAX_COOLDOWN_SECONDS: u32 = 3600;

/// A rank's cool-down end as the board holds it, or 0 when no configuration could have set it
/// (further ahead than the longest cool-down): a stray value must not keep a rank out for good.
fn cooling_until(down_until: u32, now: u32) -> u32 {
    if plausible_stamp(down_until, now.saturating_add(MAX_COOLDOWN_SECONDS)) {
        down_until
    } else {
        0
    }
}

/// At most this many columns (VMs with requests in flight on one Envoy); beyond, the stalest
/// goes. Envoy runs one VM per worker, so this bounds the value to a few KiB whatever happens.
pub const MAX_COLUMNS: usize = 256;

const MAGIC: &[u8; 4] = b"DPB2";
const HEADER: usize = 12;
const RANK_RECORD: usize = 12;
/// Where a rank's strike count lies in its health record (after `down_until`, `strike_since`).
const STRIKES_AT: usize = 8;

/// One rank as the assigners see it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankLoad {
    /// Requests in flight, summed over the live columns.
    pub inflight: u32,
    /// Cooling down until (unix seconds): not usable before.
    pub down_until: u32,
    /// Prompt blocks sent to the rank lately by every live column (this Envoy's VMs), decayed
    /// by 1/8 a second (half-life ~5 s): how much work the rank was given, including requests
    /// that already ended.
    pub recent: u32,
}

/// All ranks' state, as an assigner sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankStates {
    pub ranks: Vec<RankLoad>,
}

impl RankStates {
    /// Whether `rank` may receive new work at `now`.
    pub fn usable(&self, rank: u32, now: u32) -> bool {
        self.ranks
            .get(rank as usize)
            .is_some_and(|r| r.down_until <= now)
    }

    /// Sum of in-flight requests over the usable ranks, and how many ranks are usable.
    pub fn usable_load(&self, now: u32) -> (u64, u32) {
        let mut total = 0u64;
        let mut usable = 0u32;
        for r in self.ranks.iter().filter(|r| r.down_until <= now) {
            total += u64::from(r.inflight);
            usable += 1;
        }
        (total, usable)
    }

    pub fn inflight(&self, rank: u32) -> u32 {
        self.ranks.get(rank as usize).map_or(0, |r| r.inflight)
    }

    /// Prompt blocks sent to `rank` lately (see [`RankLoad::recent`]).
    pub fn recent(&self, rank: u32) -> u32 {
        self.ranks.get(rank as usize).map_or(0, |r| r.recent)
    }
}

/// This VM's own streams in flight per rank: the truth its column publishes.
#[derive(Debug, Clone, Default)]
pub struct LocalLoad {
    /// The column this VM writes (given out by the board on its first write).
    id: Option<u32>,
    inflight: Vec<u32>,
    /// The counts changed since they were last published.
    dirty: bool,
    /// Prompt blocks sent to each rank lately, decayed every tick, published with the counts.
    recent: Vec<u32>,
    /// The last successful write left a column of ours on the board (it had counts).
    in_board: bool,
    /// Strikes that requests this VM saw served cancel, as (rank, count), whose write lost every
    /// retry: the next write that succeeds carries them (else strikes would only add up under
    /// contention, and a rank that serves more than it fails could still cool down). Empty
    /// but for that, so a write does not walk every rank for it.
    unforgiven: Vec<(usize, u32)>,
    /// Buffers every read-modify-write of the board reuses (no allocation per request).
    scratch: Scratch,
}

/// What one read-modify-write of the board works in: the counts being changed, the view
/// handed to a chooser, and the value to write. Kept with the VM's counts and reused, so the
/// board's per-request work allocates nothing once they have grown to size.
#[derive(Debug, Clone, Default)]
struct Scratch {
    counts: Vec<u32>,
    recent: Vec<u32>,
    view: RankStates,
    out: Vec<u8>,
    /// A rank one of whose strikes the write cancels (see [`RankBoard::release`]).
    forgive: Option<usize>,
}

impl LocalLoad {
    pub fn new(dp_size: u32) -> LocalLoad {
        LocalLoad {
            id: None,
            inflight: vec![0; dp_size as usize],
            dirty: false,
            in_board: false,
            recent: vec![0; dp_size as usize],
            unforgiven: Vec::new(),
            scratch: Scratch::default(),
        }
    }

    /// This VM's own requests in flight on `rank`.
    pub fn inflight(&self, rank: u32) -> u32 {
        self.inflight.get(rank as usize).copied().unwrap_or(0)
    }

    /// Ages the recent work by one tick (× 7/8, rounded down so it reaches zero).
    pub fn decay(&mut self) {
        for n in &mut self.recent {
            if *n > 0 {
                *n -= (*n).div_ceil(8);
                self.dirty = true;
            }
        }
    }

    /// Nothing in flight and no recent work: nothing to publish.
    fn idle(&self) -> bool {
        self.inflight.iter().all(|&n| n == 0) && self.recent.iter().all(|&n| n == 0)
    }
}

/// What a read-modify-write cost, for the counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BoardEvents {
    pub cas_retries: u32,
    pub cas_exhausted: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct RankHealth {
    down_until: u32,
    strike_since: u32,
    strikes: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Column {
    id: u32,
    stamp: u32,
    inflight: Vec<u32>,
    recent: Vec<u32>,
}

/// The decoded value of the board key.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Board {
    next_id: u32,
    health: Vec<RankHealth>,
    columns: Vec<Column>,
}

/// Lowers the strikes of `rank` by `n` (not below none) in a written board value (its health
/// records are copied there unchanged, right after the header).
fn forgive_strikes(out: &mut [u8], rank: usize, n: u32) {
    let at = HEADER + rank * RANK_RECORD + STRIKES_AT;
    if let Some(strikes) = u32_at(out, at).filter(|&s| s > 0 && n > 0) {
        if let Some(field) = out.get_mut(at..at + 4) {
            field.copy_from_slice(&strikes.saturating_sub(n).to_le_bytes());
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

/// Bytes of one column: `id | stamp | inflight × dp_size | recent × dp_size`.
fn column_bytes(dp_size: usize) -> usize {
    8 + 8 * dp_size
}

/// A board value read where it lies, without decoding it into vectors: what every request's
/// acquire and release use. [`BoardBytes::parse`] accepts exactly what [`Board::decode`] does,
/// and [`BoardBytes::write_with_column`] writes exactly what `put_column` then `encode` would,
/// byte for byte (a test holds the two to it).
#[derive(Debug, Clone, Copy)]
struct BoardBytes<'a> {
    b: &'a [u8],
    dp_size: usize,
}

impl<'a> BoardBytes<'a> {
    fn parse(b: &'a [u8], dp_size: usize) -> Option<BoardBytes<'a>> {
        if b.get(0..4)? != MAGIC || usize::from(u16_at(b, 10)?) != dp_size {
            return None;
        }
        let columns = usize::from(u16_at(b, 8)?);
        if b.len() != HEADER + RANK_RECORD * dp_size + column_bytes(dp_size) * columns {
            return None;
        }
        Some(BoardBytes { b, dp_size })
    }

    fn next_id(&self) -> u32 {
        u32_at(self.b, 4).unwrap_or(0)
    }

    /// The strikes counted against `rank` (0 for a rank the board does not have).
    fn strikes(&self, rank: usize) -> u32 {
        u32_at(self.health(), rank * RANK_RECORD + STRIKES_AT).unwrap_or(0)
    }

    /// The per-rank health records, 12 bytes each.
    fn health(&self) -> &'a [u8] {
        self.b
            .get(HEADER..HEADER + RANK_RECORD * self.dp_size)
            .unwrap_or(&[])
    }

    /// The columns, in board order (the length was checked, so they divide exactly).
    fn columns(&self) -> std::slice::ChunksExact<'a, u8> {
        let start = HEADER + RANK_RECORD * self.dp_size;
        self.b
            .get(start..)
            .unwrap_or(&[])
            .chunks_exact(column_bytes(self.dp_size))
    }

    /// [`Board::view`] of this value, into `out` (its allocation is reused).
    fn view_into(
        &self,
        now: u32,
        own: Option<u32>,
        local: Option<(&[u32], &[u32])>,
        out: &mut Vec<RankLoad>,
    ) {
        out.clear();
        out.extend(self.health().chunks_exact(RANK_RECORD).map(|h| RankLoad {
            inflight: 0,
            down_until: cooling_until(u32_at(h, 0).unwrap_or(0), now),
            recent: 0,
        }));
        let dp_size = self.dp_size;
        for column in self.columns() {
            let skip =
                !column_live(column, now) || (local.is_some() && Some(column_id(column)) == own);
            if skip {
                continue;
            }
            let (inflight, recent) = column_counts(column, dp_size);
            for (r, (n, w)) in out.iter_mut().zip(inflight.zip(recent)) {
                r.inflight = r.inflight.saturating_add(n);
                r.recent = r.recent.saturating_add(w);
            }
        }
        // Unsigned saturating sums do not depend on their order: adding this VM's own counts
        // last gives what adding them in column order would.
        if let Some((counts, recent)) = local {
            for (r, n) in out.iter_mut().zip(counts) {
                r.inflight = r.inflight.saturating_add(*n);
            }
            for (r, n) in out.iter_mut().zip(recent) {
                r.recent = r.recent.saturating_add(*n);
            }
        }
    }

    /// A column id no column uses, advancing `next_id` past it ([`Board::take_id`]).
    fn take_id(&self, next_id: &mut u32) -> u32 {
        loop {
            let id = *next_id;
            *next_id = next_id.wrapping_add(1);
            if self.columns().all(|c| column_id(c) != id) {
                return id;
            }
        }
    }

    /// Writes into `out` this board with `next_id`, column `id` holding `counts` and `recent`
    /// (or removed when both are all zero), dead columns dropped and, past [`MAX_COLUMNS`], the
    /// stalest: what [`Board::put_column`] then [`Board::encode`] give.
    fn write_with_column(
        &self,
        next_id: u32,
        id: u32,
        (counts, recent): (&[u32], &[u32]),
        now: u32,
        out: &mut Vec<u8>,
    ) {
        let keep = |c: &&[u8]| column_id(c) != id && column_live(c, now);
        let ours = counts.iter().chain(recent).any(|&n| n > 0);
        let kept = self.columns().filter(keep).count();
        // `put_column` swap-removes the stalest kept column (the first of equal stamps) when
        // the board is full: the last kept column takes its place.
        let stalest = (ours && kept >= MAX_COLUMNS)
            .then(|| {
                self.columns()
                    .filter(keep)
                    .enumerate()
                    .min_by_key(|(_, c)| column_stamp(c))
                    .map(|(i, _)| i)
            })
            .flatten();
        let last = stalest.and_then(|_| self.columns().rfind(keep));
        let written = kept - usize::from(stalest.is_some()) + usize::from(ours);
        out.clear();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&next_id.to_le_bytes());
        // Both fit: columns are capped at MAX_COLUMNS and dp_size by the config.
        out.extend_from_slice(&(written as u16).to_le_bytes());
        out.extend_from_slice(&(self.dp_size as u16).to_le_bytes());
        out.extend_from_slice(self.health());
        for (i, column) in self.columns().filter(keep).enumerate() {
            match stalest {
                // The last kept column moved into the stalest one's place (or was the stalest).
                Some(_) if i + 1 == kept => {}
                Some(s) if i == s => out.extend_from_slice(last.unwrap_or(column)),
                _ => out.extend_from_slice(column),
            }
        }
        if ours {
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&now.to_le_bytes());
            for n in counts.iter().chain(recent) {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
    }
}

fn column_id(column: &[u8]) -> u32 {
    u32_at(column, 0).unwrap_or(0)
}

fn column_stamp(column: &[u8]) -> u32 {
    u32_at(column, 4).unwrap_or(0)
}

/// A column stamped more than [`LEASE_SECONDS`] ago is a dead VM's ([`Board::live`]); one
/// stamped ahead of the clock is no VM's.
fn column_live(column: &[u8], now: u32) -> bool {
    let stamp = column_stamp(column);
    stamp.saturating_add(LEASE_SECONDS) >= now && plausible_stamp(stamp, now)
}

/// A column's in-flight counts and recent work, per rank.
fn column_counts(
    column: &[u8],
    dp_size: usize,
) -> (
    impl Iterator<Item = u32> + '_,
    impl Iterator<Item = u32> + '_,
) {
    let values = |from: usize| {
        column
            .get(from..from + 4 * dp_size)
            .unwrap_or(&[])
            .chunks_exact(4)
            .map(|w| u32_at(w, 0).unwrap_or(0))
    };
    (values(8), values(8 + 4 * dp_size))
}

impl Board {
    /// An idle board. `seed` starts the column ids somewhere a board rebuilt after corruption is
    /// unlikely to hand out an id a live VM still uses.
    fn empty(dp_size: usize, seed: u32) -> Board {
        Board {
            next_id: seed.wrapping_mul(0x9e37_79b9),
            health: vec![RankHealth::default(); dp_size],
            columns: Vec::new(),
        }
    }

    fn decode(b: &[u8], dp_size: usize) -> Option<Board> {
        if b.get(0..4)? != MAGIC || usize::from(u16_at(b, 10)?) != dp_size {
            return None;
        }
        let next_id = u32_at(b, 4)?;
        let columns = usize::from(u16_at(b, 8)?);
        let column_bytes = 8 + 8 * dp_size;
        if b.len() != HEADER + RANK_RECORD * dp_size + column_bytes * columns {
            return None;
        }
        let health = (0..dp_size)
            .map(|r| {
                let at = HEADER + RANK_RECORD * r;
                Some(RankHealth {
                    down_until: u32_at(b, at)?,
                    strike_since: u32_at(b, at + 4)?,
                    strikes: u32_at(b, at + STRIKES_AT)?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        let start = HEADER + RANK_RECORD * dp_size;
        let columns = (0..columns)
            .map(|c| {
                let at = start + column_bytes * c;
                Some(Column {
                    id: u32_at(b, at)?,
                    stamp: u32_at(b, at + 4)?,
                    inflight: (0..dp_size)
                        .map(|r| u32_at(b, at + 8 + 4 * r))
                        .collect::<Option<Vec<_>>>()?,
                    recent: (0..dp_size)
                        .map(|r| u32_at(b, at + 8 + 4 * (dp_size + r)))
                        .collect::<Option<Vec<_>>>()?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Board {
            next_id,
            health,
            columns,
        })
    }

    fn encode(&self) -> Vec<u8> {
        let dp_size = self.health.len();
        let mut out = Vec::with_capacity(
            HEADER + RANK_RECORD * dp_size + (8 + 8 * dp_size) * self.columns.len(),
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.next_id.to_le_bytes());
        // Both fit: columns are capped at MAX_COLUMNS and dp_size by the config.
        out.extend_from_slice(&(self.columns.len() as u16).to_le_bytes());
        out.extend_from_slice(&(dp_size as u16).to_le_bytes());
        for h in &self.health {
            out.extend_from_slice(&h.down_until.to_le_bytes());
            out.extend_from_slice(&h.strike_since.to_le_bytes());
            out.extend_from_slice(&h.strikes.to_le_bytes());
        }
        for c in &self.columns {
            out.extend_from_slice(&c.id.to_le_bytes());
            out.extend_from_slice(&c.stamp.to_le_bytes());
            for n in c.inflight.iter().chain(&c.recent) {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
        out
    }

    // The operations below, on the decoded form, are the reference model the byte-level ones
    // of `BoardBytes` (what requests run) are tested against.

    #[cfg(test)]
    fn live(column: &Column, now: u32) -> bool {
        column.stamp.saturating_add(LEASE_SECONDS) >= now && plausible_stamp(column.stamp, now)
    }

    /// The assigners' view: live columns other than `own`, plus `local` (its counts and recent
    /// work) in its place.
    #[cfg(test)]
    fn view(&self, now: u32, own: Option<u32>, local: Option<(&[u32], &[u32])>) -> RankStates {
        let mut ranks: Vec<RankLoad> = self
            .health
            .iter()
            .map(|h| RankLoad {
                inflight: 0,
                down_until: cooling_until(h.down_until, now),
                recent: 0,
            })
            .collect();
        let others = self
            .columns
            .iter()
            .filter(|c| Board::live(c, now) && (local.is_none() || Some(c.id) != own));
        let (own_counts, own_recent) = local.unwrap_or((&[], &[]));
        let counts = others
            .clone()
            .map(|c| c.inflight.as_slice())
            .chain([own_counts]);
        for column in counts {
            for (r, n) in ranks.iter_mut().zip(column) {
                r.inflight = r.inflight.saturating_add(*n);
            }
        }
        let recent = others.map(|c| c.recent.as_slice()).chain([own_recent]);
        for column in recent {
            for (r, n) in ranks.iter_mut().zip(column) {
                r.recent = r.recent.saturating_add(*n);
            }
        }
        RankStates { ranks }
    }

    /// Writes `counts` and `recent` as column `id` (or removes it when both are all zero),
    /// drops dead columns and, past [`MAX_COLUMNS`], the stalest.
    #[cfg(test)]
    fn put_column(&mut self, id: u32, counts: &[u32], recent: &[u32], now: u32) {
        self.columns.retain(|c| c.id != id && Board::live(c, now));
        if counts.iter().chain(recent).any(|&n| n > 0) {
            if self.columns.len() >= MAX_COLUMNS {
                if let Some(stalest) =
                    (0..self.columns.len()).min_by_key(|&i| self.columns[i].stamp)
                {
                    self.columns.swap_remove(stalest);
                }
            }
            self.columns.push(Column {
                id,
                stamp: now,
                inflight: counts.to_vec(),
                recent: recent.to_vec(),
            });
        }
    }

    /// A column id no column uses.
    #[cfg(test)]
    fn take_id(&mut self) -> u32 {
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            if self.columns.iter().all(|c| c.id != id) {
                return id;
            }
        }
    }
}

/// When repeated upstream errors put a rank into cool-down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StrikeRule {
    /// Errors from this many different requests…
    pub threshold: u32,
    /// …within this many seconds of the first.
    pub window_seconds: u32,
    /// The cool-down they cause.
    pub cooldown_seconds: u32,
}

/// The shared rank-state key of one filter configuration.
#[derive(Debug, Clone)]
pub struct RankBoard {
    key: String,
    dp_size: usize,
    cas_retries: u32,
}

impl RankBoard {
    pub fn new(namespace: &str, dp_size: u32, cas_retries: u32) -> RankBoard {
        RankBoard {
            // The layout's version is in the key: VMs of a filter build with another layout
            // (during an upgrade) keep their own board instead of reading each other's as garbage
            // and overwriting it.
            key: format!("{namespace}/load2/{dp_size}"),
            dp_size: dp_size as usize,
            cas_retries,
        }
    }

    /// The shared-data key (VMs with the same key share one [`LocalLoad`] across reloads).
    pub fn key(&self) -> &str {
        &self.key
    }

    fn decode(&self, value: Option<&[u8]>, now: u32) -> Board {
        let mut board = value
            .and_then(|b| Board::decode(b, self.dp_size))
            .unwrap_or_else(|| Board::empty(self.dp_size, now));
        for h in &mut board.health {
            h.down_until = cooling_until(h.down_until, now);
        }
        board
    }

    /// The assigners' view (one store read): every live column, with this VM's own counts from
    /// memory in place of its column (they may be newer than what it last published).
    pub fn read(&self, store: &dyn Store, local: &LocalLoad, now: u32) -> RankStates {
        let (value, _) = store.get(&self.key);
        let mut view = RankStates::default();
        self.with_bytes(value.as_deref(), now, |board| {
            board.view_into(
                now,
                local.id,
                Some((&local.inflight, &local.recent)),
                &mut view.ranks,
            )
        });
        view
    }

    /// Runs `f` on the board `value` holds, or on an idle board when it holds none that decodes
    /// (corruption, another layout): the next write replaces it.
    fn with_bytes<T>(
        &self,
        value: Option<&[u8]>,
        now: u32,
        f: impl FnOnce(BoardBytes<'_>) -> T,
    ) -> T {
        if let Some(board) = value.and_then(|b| BoardBytes::parse(b, self.dp_size)) {
            return f(board);
        }
        let empty = Board::empty(self.dp_size, now).encode();
        let board = BoardBytes::parse(&empty, self.dp_size).unwrap_or(BoardBytes {
            b: &[],
            dp_size: self.dp_size,
        });
        f(board)
    }

    /// Reads the state, lets `choose` pick a rank from it, and counts one more request in flight
    /// on that rank, atomically: a lost race re-reads and chooses again, so two workers never
    /// both take the last free slot of a rank. When every retry loses, the last choice stands
    /// and is counted in memory: the next write publishes it.
    /// `blocks`: the request's prompt size, added to the chosen rank's recent work.
    pub fn acquire(
        &self,
        store: &dyn Store,
        local: &mut LocalLoad,
        now: u32,
        blocks: u32,
        mut choose: impl FnMut(&RankStates) -> Option<u32>,
    ) -> (Option<u32>, BoardEvents) {
        let mut chosen = None;
        let events = self.publish_with(store, local, now, |board, id, work| {
            board.view_into(
                now,
                id,
                Some((&work.counts, &work.recent)),
                &mut work.view.ranks,
            );
            chosen = choose(&work.view);
            let Some(r) = chosen.map(|r| r as usize) else {
                return false;
            };
            match (work.counts.get_mut(r), work.recent.get_mut(r)) {
                (Some(n), Some(w)) => {
                    *n = n.saturating_add(1);
                    *w = w.saturating_add(blocks);
                    true
                }
                _ => false,
            }
        });
        (chosen, events)
    }

    /// Counts one request on `rank` as finished (never below zero) and publishes. `served`:
    /// the rank served it (a 2xx on a rank the filter chose), which cancels one strike counted
    /// against the rank, in the same write. So strikes cool a rank down only while its errors
    /// outnumber what it serves: a client failing its own requests on a rank that serves others
    /// cannot take it out, and a rank that fails everything still goes.
    pub fn release(
        &self,
        store: &dyn Store,
        local: &mut LocalLoad,
        now: u32,
        rank: u32,
        served: bool,
    ) -> BoardEvents {
        self.publish_with(store, local, now, |board, _, work| {
            let released = match work.counts.get_mut(rank as usize) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    true
                }
                _ => false,
            };
            let rank = rank as usize;
            work.forgive = (served && board.strikes(rank) > 0).then_some(rank);
            released || work.forgive.is_some()
        })
    }

    /// The tick's work: re-stamps this VM's column with its counts (or removes it when idle)
    /// and returns the view after the write, for the gauges. Idle with no column: one read.
    pub fn publish(
        &self,
        store: &dyn Store,
        local: &mut LocalLoad,
        now: u32,
    ) -> (RankStates, BoardEvents) {
        if !local.in_board && !local.dirty && local.idle() {
            return (self.read(store, local, now), BoardEvents::default());
        }
        local.dirty = true;
        let mut view = None;
        let events = self.publish_with(store, local, now, |board, id, work| {
            let mut states = RankStates::default();
            board.view_into(
                now,
                id,
                Some((&work.counts, &work.recent)),
                &mut states.ranks,
            );
            view = Some(states);
            true
        });
        let view = view.unwrap_or_else(|| self.read(store, local, now));
        (view, events)
    }

    /// Writes this VM's column after `change` (given the board as read, the column's id, and
    /// the scratch holding copies of the counts and the recent work to change; `false`: nothing
    /// to do, unless an earlier change is still unpublished). Memory takes the change whether
    /// or not a write succeeded.
    fn publish_with(
        &self,
        store: &dyn Store,
        local: &mut LocalLoad,
        now: u32,
        change: impl FnMut(BoardBytes<'_>, Option<u32>, &mut Scratch) -> bool,
    ) -> BoardEvents {
        // Taken out for the call (the change reads `local` while it fills the scratch).
        let mut scratch = std::mem::take(&mut local.scratch);
        let mut change = change;
        let events = self.publish_attempts(store, local, now, &mut scratch, &mut change);
        local.scratch = scratch;
        events
    }

    fn publish_attempts(
        &self,
        store: &dyn Store,
        local: &mut LocalLoad,
        now: u32,
        work: &mut Scratch,
        // One body for every change (acquire, release, publish), not one per closure: the
        // module's size is a goal.
        change: &mut dyn FnMut(BoardBytes<'_>, Option<u32>, &mut Scratch) -> bool,
    ) -> BoardEvents {
        let mut events = BoardEvents::default();
        let mut changed = false;
        let mut forgave = None;
        for attempt in 0..=self.cas_retries {
            let (value, cas) = store.get(&self.key);
            let step = self.with_bytes(value.as_deref(), now, |board| {
                work.counts.clone_from(&local.inflight);
                work.recent.clone_from(&local.recent);
                let changes = change(board, local.id, work);
                if !changes && !local.dirty {
                    return None;
                }
                // A VM keeps its id for life, even when another VM dropped its column
                // meanwhile (its ticks stalled past the lease): the write puts the column back.
                let mut next_id = board.next_id();
                let id = match local.id {
                    Some(id) => id,
                    None => board.take_id(&mut next_id),
                };
                let mut out = std::mem::take(&mut work.out);
                board.write_with_column(next_id, id, (&work.counts, &work.recent), now, &mut out);
                forgave = work.forgive.take();
                for &(rank, n) in forgave
                    .map(|rank| (rank, 1))
                    .iter()
                    .chain(&local.unforgiven)
                {
                    forgive_strikes(&mut out, rank, n);
                }
                work.out = out;
                Some((changes, id))
            });
            let Some((changes, id)) = step else {
                return events;
            };
            let written = store.set(&self.key, &work.out, cas);
            if written.is_ok() {
                local.in_board = work.counts.iter().chain(&work.recent).any(|&n| n > 0);
                // Swapped, not moved: the scratch keeps the old vectors' allocations.
                std::mem::swap(&mut local.inflight, &mut work.counts);
                std::mem::swap(&mut local.recent, &mut work.recent);
                local.id = Some(id);
                local.dirty = false;
                local.unforgiven.clear();
                return events;
            }
            // Kept for the memory if every retry loses.
            changed = changes;
            match written {
                Err(StoreError::CasMismatch) if attempt < self.cas_retries => {
                    events.cas_retries += 1
                }
                _ => break,
            }
        }
        events.cas_exhausted += 1;
        if let Some(rank) = forgave {
            match local.unforgiven.iter_mut().find(|(r, _)| *r == rank) {
                Some((_, n)) => *n = n.saturating_add(1),
                None => local.unforgiven.push((rank, 1)),
            }
        }
        if changed {
            std::mem::swap(&mut local.inflight, &mut work.counts);
            std::mem::swap(&mut local.recent, &mut work.recent);
        }
        local.dirty = true;
        events
    }

    /// Takes `rank` out of every assigner's choice until `until` (unix seconds). Returns whether
    /// the rank was not cooling down already.
    pub fn mark_down(
        &self,
        store: &dyn Store,
        rank: u32,
        until: u32,
        now: u32,
    ) -> (bool, BoardEvents) {
        let mut started = false;
        let events = self.update(store, now, |board| {
            started = false;
            match board.health.get_mut(rank as usize) {
                Some(h) if h.down_until < until => {
                    started = h.down_until <= now;
                    h.down_until = until;
                    h.strikes = 0;
                    true
                }
                _ => false,
            }
        });
        (started && events.cas_exhausted == 0, events)
    }

    /// One request placed on `rank` by the filter got an error from it. Errors from
    /// `rule.threshold` requests within `rule.window_seconds` put the rank into cool-down for
    /// `rule.cooldown_seconds`. Returns whether this strike started one.
    pub fn strike(
        &self,
        store: &dyn Store,
        rank: u32,
        now: u32,
        rule: StrikeRule,
    ) -> (bool, BoardEvents) {
        let mut cooled = false;
        let events = self.update(store, now, |board| {
            cooled = false;
            let Some(h) = board.health.get_mut(rank as usize) else {
                return false;
            };
            if h.down_until > now {
                return false; // already out: nothing to add
            }
            if h.strikes == 0 || now >= h.strike_since.saturating_add(rule.window_seconds) {
                h.strike_since = now;
                h.strikes = 0;
            }
            h.strikes = h.strikes.saturating_add(1);
            if h.strikes >= rule.threshold && rule.cooldown_seconds > 0 {
                h.down_until = now.saturating_add(rule.cooldown_seconds);
                h.strikes = 0;
                cooled = true;
            }
            true
        });
        (cooled && events.cas_exhausted == 0, events)
    }

    fn update(
        &self,
        store: &dyn Store,
        now: u32,
        mut change: impl FnMut(&mut Board) -> bool,
    ) -> BoardEvents {
        let mut events = BoardEvents::default();
        for attempt in 0..=self.cas_retries {
            let (value, cas) = store.get(&self.key);
            let mut board = self.decode(value.as_deref(), now);
            if !change(&mut board) {
                return events;
            }
            match store.set(&self.key, &board.encode(), cas) {
                Ok(()) => return events,
                Err(StoreError::CasMismatch) if attempt < self.cas_retries => {
                    events.cas_retries += 1
                }
                Err(_) => break,
            }
        }
        events.cas_exhausted += 1;
        events
    }

    /// Creates the key if missing, so later writes are real compare-and-swaps.
    pub fn ensure(&self, store: &dyn Store, now: u32) {
        // Creates the key only if it is missing: no read (which may fail) decides it.
        let empty = Board::empty(self.dp_size, now).encode();
        let _ = store.set(&self.key, &empty, Some(NO_KEY_TOKEN));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::tests::{values, FailingReads, MemStore};

    const RULE: StrikeRule = StrikeRule {
        threshold: 3,
        window_seconds: 10,
        cooldown_seconds: 30,
    };

    fn board(dp_size: u32, retries: u32) -> (MemStore, RankBoard) {
        let s = MemStore::default();
        let b = RankBoard::new("t", dp_size, retries);
        b.ensure(&s, 100);
        (s, b)
    }

    /// The view of a VM with nothing of its own in flight (what any other VM sees).
    fn seen(s: &MemStore, b: &RankBoard, now: u32) -> Vec<u32> {
        let nobody = LocalLoad::new(b.dp_size as u32);
        let st = b.read(s, &nobody, now);
        st.ranks.iter().map(|r| r.inflight).collect()
    }

    #[test]
    fn acquire_release_never_negative() {
        let (s, b) = board(4, 3);
        let mut vm = LocalLoad::new(4);
        let (r, _) = b.acquire(&s, &mut vm, 100, 1, |_| Some(2));
        assert_eq!(r, Some(2));
        assert_eq!(seen(&s, &b, 100), [0, 0, 1, 0]);
        b.release(&s, &mut vm, 100, 2, false);
        b.release(&s, &mut vm, 100, 2, false);
        b.release(&s, &mut vm, 100, 9, false);
        assert_eq!(seen(&s, &b, 100), [0, 0, 0, 0]);
        assert_eq!(vm.inflight(2), 0);
        let (none, _) = b.acquire(&s, &mut vm, 100, 1, |_| None);
        assert_eq!(none, None);
        assert_eq!(b.read(&s, &vm, 100).usable_load(100), (0, 4));
    }

    #[test]
    fn columns_of_several_vms_add_up_and_idle_ones_leave() {
        let (s, b) = board(2, 3);
        let (mut a, mut c) = (LocalLoad::new(2), LocalLoad::new(2));
        b.acquire(&s, &mut a, 100, 1, |_| Some(0));
        b.acquire(&s, &mut a, 100, 1, |_| Some(1));
        b.acquire(&s, &mut c, 100, 1, |_| Some(0));
        assert_eq!(seen(&s, &b, 100), [2, 1]);
        assert_ne!(a.id, c.id, "each VM has a column of its own");
        // A VM sees the others' columns plus its own memory.
        assert_eq!(b.read(&s, &a, 100).inflight(0), 2);
        b.release(&s, &mut a, 101, 0, false);
        b.release(&s, &mut a, 101, 1, false);
        let columns = |s: &MemStore| {
            let value = s.get("t/load2/2").0.unwrap();
            Board::decode(&value, 2).unwrap().columns.len()
        };
        // Nothing in flight, but the recent work is still published until it has decayed.
        assert_eq!(columns(&s), 2);
        a.decay();
        b.publish(&s, &mut a, 101);
        // Idle: that tick removed the column; the next ones only read.
        assert_eq!(columns(&s), 1);
        let cas = s.get("t/load2/2").1;
        b.publish(&s, &mut a, 102);
        b.publish(&s, &mut a, 103);
        assert_eq!(s.get("t/load2/2").1, cas, "an idle VM's tick wrote");
        assert_eq!(seen(&s, &b, 103), [1, 0]);
    }

    #[test]
    fn failed_reads_overwrite_no_column() {
        let (s, b) = board(2, 3);
        let mut other = LocalLoad::new(2);
        b.acquire(&s, &mut other, 100, 1, |_| Some(1));
        b.mark_down(&s, 0, 130, 100);
        let before = values(&s);
        let failing = FailingReads(&s);
        b.ensure(&failing, 101);
        let mut vm = LocalLoad::new(2);
        let (rank, ev) = b.acquire(&failing, &mut vm, 101, 1, |_| Some(1));
        assert_eq!((rank, ev.cas_exhausted), (Some(1), 1));
        b.release(&failing, &mut vm, 101, 1, true);
        b.publish(&failing, &mut vm, 102);
        assert_eq!(values(&s), before, "a failed read let a write through");
        assert_eq!(seen(&s, &b, 102), [0, 1], "the other VM's column stays");
        assert!(
            !b.read(&s, &vm, 102).usable(0, 102),
            "so does the cool-down"
        );
    }

    #[test]
    fn a_lost_release_is_published_by_the_next_tick() {
        let (s, b) = board(2, 0);
        let mut vm = LocalLoad::new(2);
        b.acquire(&s, &mut vm, 100, 1, |_| Some(1));
        s.lose_races.set(1);
        let ev = b.release(&s, &mut vm, 100, 1, false);
        assert_eq!(ev.cas_exhausted, 1);
        assert_eq!(seen(&s, &b, 100), [0, 1], "the write was lost");
        assert_eq!(vm.inflight(1), 0, "but the VM knows the truth");
        let (view, _) = b.publish(&s, &mut vm, 101);
        assert_eq!(view.inflight(1), 0);
        assert_eq!(seen(&s, &b, 101), [0, 0]);
    }

    #[test]
    fn a_lost_acquire_still_counts_and_routes() {
        let (s, b) = board(2, 0);
        let mut vm = LocalLoad::new(2);
        s.lose_races.set(1);
        let (r, ev) = b.acquire(&s, &mut vm, 100, 1, |_| Some(0));
        assert_eq!((r, ev.cas_exhausted), (Some(0), 1));
        assert_eq!(vm.inflight(0), 1);
        b.publish(&s, &mut vm, 100);
        assert_eq!(seen(&s, &b, 100), [1, 0]);
    }

    #[test]
    fn a_dead_vms_column_expires_after_the_lease() {
        let (s, b) = board(2, 3);
        let mut dead = LocalLoad::new(2);
        for _ in 0..16 {
            b.acquire(&s, &mut dead, 100, 1, |_| Some(1));
        }
        assert_eq!(seen(&s, &b, 100), [0, 16]);
        assert_eq!(seen(&s, &b, 100 + LEASE_SECONDS), [0, 16]);
        assert_eq!(
            seen(&s, &b, 101 + LEASE_SECONDS),
            [0, 0],
            "dead after the lease"
        );
        // A live VM's next write removes it.
        let mut live = LocalLoad::new(2);
        b.acquire(&s, &mut live, 101 + LEASE_SECONDS, 1, |_| Some(0));
        let value = s.get("t/load2/2").0.unwrap();
        assert_eq!(Board::decode(&value, 2).unwrap().columns.len(), 1);
    }

    #[test]
    fn a_live_vm_restamps_every_tick_and_rejoins_if_dropped() {
        let (s, b) = board(2, 3);
        let mut vm = LocalLoad::new(2);
        b.acquire(&s, &mut vm, 100, 1, |_| Some(0));
        for now in 101..120 {
            b.publish(&s, &mut vm, now);
            assert_eq!(seen(&s, &b, now), [1, 0]);
        }
        // Another VM dropped our column (our ticks stalled): the next publish puts it back.
        s.raw_set("t/load2/2", Board::empty(2, 7).encode());
        assert_eq!(seen(&s, &b, 120), [0, 0]);
        b.publish(&s, &mut vm, 121);
        assert_eq!(seen(&s, &b, 121), [1, 0]);
    }

    #[test]
    fn cooldown_makes_a_rank_unusable_until_it_ends() {
        let (s, b) = board(4, 3);
        let vm = LocalLoad::new(4);
        assert!(b.mark_down(&s, 1, 110, 100).0);
        let st = b.read(&s, &vm, 100);
        assert!(!st.usable(1, 100));
        assert!(st.usable(1, 110));
        assert!(st.usable(0, 100));
        assert!(!st.usable(7, 100), "out of range is never usable");
        assert_eq!(st.usable_load(100), (0, 3));
        // An earlier deadline does not shorten a later one.
        assert!(!b.mark_down(&s, 1, 105, 100).0);
        assert!(!b.read(&s, &vm, 108).usable(1, 108));
    }

    #[test]
    fn strikes_from_several_requests_within_the_window_cool_a_rank_down() {
        let (s, b) = board(2, 3);
        let vm = LocalLoad::new(2);
        assert!(!b.strike(&s, 0, 100, RULE).0);
        assert!(!b.strike(&s, 0, 105, RULE).0);
        // The window (10 s from the first) has passed: counting starts again.
        assert!(!b.strike(&s, 0, 110, RULE).0);
        assert!(!b.strike(&s, 0, 111, RULE).0);
        assert!(b.read(&s, &vm, 111).usable(0, 111));
        assert!(b.strike(&s, 0, 112, RULE).0, "third within 10 s");
        assert!(!b.read(&s, &vm, 112).usable(0, 112));
        assert!(b.read(&s, &vm, 142).usable(0, 142));
        assert!(b.read(&s, &vm, 112).usable(1, 112), "other ranks untouched");
        // Strikes while cooling add nothing; after it, counting starts from zero.
        assert!(!b.strike(&s, 0, 120, RULE).0);
        assert!(!b.strike(&s, 0, 142, RULE).0);
        assert!(!b.strike(&s, 0, 143, RULE).0);
        assert!(b.strike(&s, 0, 144, RULE).0);
    }

    #[test]
    fn what_a_rank_serves_cancels_its_strikes() {
        let (s, b) = board(2, 3);
        let mut vm = LocalLoad::new(2);
        // Two errors, then two requests served: the strikes are gone, so a third error within
        // the window does not cool the rank down (a client failing its own requests on a rank
        // that serves others).
        assert!(!b.strike(&s, 0, 100, RULE).0);
        assert!(!b.strike(&s, 0, 101, RULE).0);
        for _ in 0..2 {
            b.acquire(&s, &mut vm, 102, 1, |_| Some(0));
            b.release(&s, &mut vm, 102, 0, true);
        }
        assert!(!b.strike(&s, 0, 103, RULE).0);
        assert!(!b.strike(&s, 0, 104, RULE).0);
        // Released without being served (an error, a refusal), or served by another rank:
        // nothing is cancelled.
        b.acquire(&s, &mut vm, 104, 1, |_| Some(0));
        b.release(&s, &mut vm, 104, 0, false);
        b.acquire(&s, &mut vm, 104, 1, |_| Some(1));
        b.release(&s, &mut vm, 104, 1, true);
        assert!(
            b.strike(&s, 0, 105, RULE).0,
            "errors outnumber what it served"
        );
        assert!(!b.read(&s, &vm, 105).usable(0, 105));
        // Served with no strikes counted: the count is released, nothing else changes.
        b.acquire(&s, &mut vm, 106, 1, |_| Some(1));
        b.release(&s, &mut vm, 106, 1, true);
        assert_eq!(b.read(&s, &vm, 106).inflight(1), 0);
        assert!(b.read(&s, &vm, 106).usable(1, 106));
    }

    #[test]
    fn a_served_requests_forgiveness_outlives_a_lost_write() {
        let (s, b) = board(2, 3);
        let mut vm = LocalLoad::new(2);
        assert!(!b.strike(&s, 0, 100, RULE).0);
        assert!(!b.strike(&s, 0, 101, RULE).0);
        b.acquire(&s, &mut vm, 102, 1, |_| Some(0));
        // The release of a request rank 0 served loses every retry: its forgiveness is not on
        // the board yet, and the next write carries it.
        s.lose_races.set(4);
        assert_eq!(b.release(&s, &mut vm, 102, 0, true).cas_exhausted, 1);
        b.publish(&s, &mut vm, 103);
        // Two strikes, one forgiven: a third error within the window does not cool it down.
        assert!(!b.strike(&s, 0, 104, RULE).0);
        assert!(b.read(&s, &vm, 104).usable(0, 104));
        assert!(
            b.strike(&s, 0, 105, RULE).0,
            "errors outnumber what it served"
        );
    }

    #[test]
    fn garbage_reads_as_idle_and_is_replaced() {
        let (s, b) = board(4, 3);
        s.raw_set("t/load2/4", vec![0xff; 13]);
        assert_eq!(seen(&s, &b, 100), [0, 0, 0, 0]);
        let mut vm = LocalLoad::new(4);
        let (r, _) = b.acquire(&s, &mut vm, 100, 1, |_| Some(0));
        assert_eq!(r, Some(0));
        assert_eq!(seen(&s, &b, 100), [1, 0, 0, 0]);
        // A board of another dp_size under the same key is garbage too.
        s.raw_set("t/load2/4", Board::empty(3, 1).encode());
        assert_eq!(seen(&s, &b, 100), [0, 0, 0, 0]);
    }

    /// Stamps ahead of the clock were not written by it: a column stamped in the future is
    /// no VM's (it would be counted until the clock caught up), a cool-down longer than any
    /// configuration sets is none (it would keep the rank out, and take no strike, for good).
    #[test]
    fn stamps_ahead_of_the_clock_are_no_ones() {
        let (s, b) = board(2, 3);
        let mut stray = Board::empty(2, 100);
        stray.health[0].down_until = u32::MAX;
        stray.health[1].down_until = 100 + MAX_COOLDOWN_SECONDS;
        stray.columns.push(Column {
            id: 7,
            stamp: u32::MAX,
            inflight: vec![50, 50],
            recent: vec![0, 0],
        });
        s.raw_set("t/load2/2", stray.encode());
        let nobody = LocalLoad::new(2);
        let view = b.read(&s, &nobody, 100);
        assert_eq!(seen(&s, &b, 100), [0, 0]);
        assert!(view.usable(0, 100), "a stray cool-down is none");
        assert!(!view.usable(1, 100), "the longest one configurable holds");
        // Strikes count again on the rank, and its cool-down starts.
        for _ in 0..RULE.threshold {
            b.strike(&s, 0, 100, RULE);
        }
        assert!(!b.read(&s, &nobody, 100).usable(0, 100));
        assert!(b
            .read(&s, &nobody, 100 + RULE.cooldown_seconds)
            .usable(0, 100 + RULE.cooldown_seconds));
    }

    #[test]
    fn lost_race_rechooses_on_fresh_state() {
        let (s, b) = board(2, 3);
        let rival_board = b.clone();
        *s.rival.borrow_mut() = Some(Box::new(move |store: &MemStore, _k: &str| {
            // Another worker takes rank 0 five times meanwhile.
            let mut other = LocalLoad::new(2);
            for _ in 0..5 {
                rival_board.acquire(store, &mut other, 100, 1, |_| Some(0));
            }
        }));
        s.lose_races.set(1);
        let mut vm = LocalLoad::new(2);
        let mut seen_zero = Vec::new();
        let (r, ev) = b.acquire(&s, &mut vm, 100, 1, |st| {
            seen_zero.push(st.inflight(0));
            Some(if st.inflight(0) <= st.inflight(1) {
                0
            } else {
                1
            })
        });
        assert_eq!(ev.cas_retries, 1);
        assert_eq!(seen_zero, vec![0, 5]);
        assert_eq!(r, Some(1));
        assert_eq!(seen(&s, &b, 100), [5, 1]);
    }

    #[test]
    fn recent_work_adds_up_per_rank_and_decays() {
        let (s, b) = board(2, 3);
        let mut vm = LocalLoad::new(2);
        b.acquire(&s, &mut vm, 100, 80, |_| Some(1));
        b.acquire(&s, &mut vm, 100, 16, |_| Some(1));
        b.release(&s, &mut vm, 100, 1, false);
        b.release(&s, &mut vm, 100, 1, false);
        // Ended requests still count as recent work, and the board carries it to other VMs.
        let st = b.read(&s, &vm, 100);
        assert_eq!((st.recent(0), st.recent(1), st.inflight(1)), (0, 96, 0));
        assert_eq!(seen(&s, &b, 100), [0, 0]);
        let other = LocalLoad::new(2);
        assert_eq!(b.read(&s, &other, 100).recent(1), 96);
        // The chooser sees it too.
        let mut saw = 0;
        b.acquire(&s, &mut vm, 100, 1, |st| {
            saw = st.recent(1);
            Some(0)
        });
        assert_eq!(saw, 96);
        vm.decay();
        assert_eq!(b.read(&s, &vm, 101).recent(1), 84);
        b.release(&s, &mut vm, 101, 0, false);
        assert_eq!(b.read(&s, &other, 101).recent(1), 84);
        for t in 0..60 {
            vm.decay();
            b.publish(&s, &mut vm, 102 + t);
        }
        // Decayed to nothing, and the column is gone with it.
        assert_eq!(b.read(&s, &other, 161).recent(1), 0);
        assert_eq!(b.read(&s, &vm, 161).recent(1), 0);
        assert!(!vm.in_board);
    }

    /// A deterministic stream of test values (splitmix64).
    fn rng(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut x = seed;
        move |below| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % below.max(1)
        }
    }

    /// A board with random health, column ids (colliding now and then), stamps around `now`
    /// (live, dead and on the lease's edge, often equal) and counts (zeros, saturating ones).
    fn random_board(next: &mut impl FnMut(u64) -> u64, dp_size: usize, now: u32) -> Board {
        let value = |next: &mut dyn FnMut(u64) -> u64| match next(4) {
            0 => 0,
            1 => u32::MAX - next(3) as u32,
            _ => next(50) as u32,
        };
        // A full board (past MAX_COLUMNS the stalest column goes) has mostly live columns.
        let (columns, ages) = match next(4) {
            0 => (MAX_COLUMNS - 1 + next(4) as usize, LEASE_SECONDS as u64 + 1),
            _ => (next(6) as usize, LEASE_SECONDS as u64 + 3),
        };
        Board {
            next_id: next(20) as u32,
            health: (0..dp_size)
                .map(|_| RankHealth {
                    down_until: now + next(3) as u32 - 1,
                    strike_since: next(1000) as u32,
                    strikes: next(4) as u32,
                })
                .collect(),
            columns: (0..columns)
                .map(|_| Column {
                    id: next(24) as u32,
                    stamp: now - next(ages) as u32,
                    inflight: (0..dp_size).map(|_| value(next)).collect(),
                    recent: (0..dp_size).map(|_| value(next)).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn byte_level_board_work_matches_the_decoded_reference() {
        let mut next = rng(7);
        let now = 1000;
        let mut capped = 0;
        for case in 0..3000 {
            let dp_size = 1 + next(5) as usize;
            let board = random_board(&mut next, dp_size, now);
            let bytes = board.encode();
            let parsed = BoardBytes::parse(&bytes, dp_size).expect("an encoded board parses");
            let own = (next(3) > 0).then(|| next(24) as u32);
            let zeros = next(3) == 0;
            let counts: Vec<u32> = (0..dp_size)
                .map(|_| if zeros { 0 } else { next(5) as u32 })
                .collect();
            let recent: Vec<u32> = (0..dp_size)
                .map(|_| if zeros { 0 } else { next(90) as u32 })
                .collect();
            // The view, with and without this VM's own counts.
            for local in [None, Some((&counts[..], &recent[..]))] {
                let mut view = Vec::new();
                parsed.view_into(now, own, local, &mut view);
                assert_eq!(view, board.view(now, own, local).ranks, "case {case}");
            }
            // A new column id, then the write.
            let mut reference = board.clone();
            let mut next_id = parsed.next_id();
            let id = match own {
                Some(id) => id,
                None => {
                    let id = parsed.take_id(&mut next_id);
                    assert_eq!(id, reference.take_id(), "case {case}");
                    id
                }
            };
            let before = reference.columns.len();
            reference.put_column(id, &counts, &recent, now);
            capped += usize::from(before >= MAX_COLUMNS && reference.columns.len() == MAX_COLUMNS);
            let mut out = vec![0xAA; 3];
            parsed.write_with_column(next_id, id, (&counts, &recent), now, &mut out);
            assert_eq!(out, reference.encode(), "case {case}");
        }
        assert!(capped > 50, "the full-board case ran {capped} times");
    }

    #[test]
    fn byte_level_parse_accepts_what_decode_accepts() {
        let mut next = rng(11);
        for _ in 0..2000 {
            let dp_size = 1 + next(4) as usize;
            let mut bytes = random_board(&mut next, dp_size, 1000).encode();
            match next(4) {
                0 => bytes.truncate(next(bytes.len() as u64 + 1) as usize),
                1 => {
                    let at = next(bytes.len().min(16) as u64) as usize;
                    if let Some(b) = bytes.get_mut(at) {
                        *b ^= 1 << next(8);
                    }
                }
                2 => bytes.push(next(256) as u8),
                _ => {}
            }
            for d in [dp_size, dp_size + 1] {
                assert_eq!(
                    BoardBytes::parse(&bytes, d).is_some(),
                    Board::decode(&bytes, d).is_some()
                );
            }
        }
    }

    #[test]
    fn columns_are_bounded() {
        let (s, b) = board(1, 3);
        for _ in 0..(MAX_COLUMNS + 20) {
            let mut vm = LocalLoad::new(1);
            b.acquire(&s, &mut vm, 100, 1, |_| Some(0));
        }
        let value = s.get("t/load2/1").0.unwrap();
        assert_eq!(Board::decode(&value, 1).unwrap().columns.len(), MAX_COLUMNS);
    }
}
