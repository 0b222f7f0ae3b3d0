//! The host layer: the only code that talks to Envoy. It reads headers and bodies, feeds the core,
//! and turns the core's decisions into header changes, local replies and counter increments.

mod abi;

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::rc::Rc;

use log::{debug, error, info, warn};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

use crate::body_rewrite::{rewrite, RankEdit};
use crate::chain::Chain;
use crate::clock::{decode_floor, SteadyClock, FLOOR_KEY};
use crate::config::{Config, TargetMode};
use crate::decide::{
    decide_body_with_prefix, decide_headers, explicit_header_ignored, resolve_key, without_body,
};
use crate::decide::{Decision, HeaderStep, Reason};
use crate::extract::{HeaderFacts, ResponseFacts};
use crate::failure::{classify, cut_by_rank, judge, Answer, Chooser};
use crate::metrics::{self, Counter};
use crate::placement::{plan, Facts, KeyFacts, PrefixChoice, Tag, Target};
use crate::prefix_index::{Anchor, CountingStore, Kept, Match, PrefixIndex};
use crate::prompt::Api;
use crate::ranks::{BoardEvents, LocalLoad, RankBoard, RankLoad, RankStates};
use crate::table::{AffinityTable, Store, StoreError, Stored, TableEvents, READ_FAILED};
use crate::target::{engine_parses_as_json, EngineTarget};
use abi::{HeaderMap, REQUEST_HEADERS, RESPONSE_HEADERS};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Envoy shared data as the table's store (one per Envoy process, all workers).
struct SharedData;

impl Store for SharedData {
    fn get(&self, key: &str) -> Stored {
        abi::shared_get(key).unwrap_or(READ_FAILED)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        abi::shared_set(key, value, cas.unwrap_or(0)).map_err(|e| match e.0 {
            abi::CAS_MISMATCH => StoreError::CasMismatch,
            _ => StoreError::Other,
        })
    }
}

/// Shared data for the prefix index, counting its host calls (`prefix_reads`, `prefix_writes`).
/// Built per operation: the counts also tell whether an operation wrote anything.
struct IndexStore<'c> {
    counters: &'c Counters,
    store: CountingStore<'static>,
}

impl<'c> IndexStore<'c> {
    fn new(counters: &'c Counters) -> Self {
        IndexStore {
            counters,
            store: CountingStore::new(&SharedData),
        }
    }
}

impl Store for IndexStore<'_> {
    fn get(&self, key: &str) -> Stored {
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.store.set(key, value, cas)
    }
}

impl Drop for IndexStore<'_> {
    fn drop(&mut self) {
        self.counters.add(Counter::PrefixReads, self.store.reads());
        self.counters
            .add(Counter::PrefixWrites, self.store.writes());
    }
}

/// The filter's counters for one VM (one Envoy worker).
///
/// Requests add to in-VM cells; `flush` hands the sums to Envoy once per tick. Every host call
/// crosses the wasm boundary, which costs more than the rest of a request's routing work, so
/// counting per request would double the filter's cost; stats lag by at most one tick instead.
struct Counters {
    ids: [Option<u32>; Counter::ALL.len()],
    pending: [Cell<u32>; Counter::ALL.len()],
}

impl Counters {
    fn define() -> Counters {
        let mut ids = [None; Counter::ALL.len()];
        for c in Counter::ALL {
            match abi::define_counter(c.name()) {
                Ok(id) => ids[c.index()] = Some(id),
                Err(e) => warn!("cannot define metric {}: status {}", c.name(), e.0),
            }
        }
        Counters {
            ids,
            // `Default` stops at 32 elements.
            pending: std::array::from_fn(|_| Cell::new(0)),
        }
    }

    fn add(&self, c: Counter, by: u32) {
        let cell = &self.pending[c.index()];
        cell.set(cell.get().saturating_add(by));
    }

    fn add_table_events(&self, ev: TableEvents) {
        self.add(Counter::Evictions, ev.evictions);
        self.add(Counter::CasRetries, ev.cas_retries);
        self.add(Counter::CasExhausted, ev.cas_exhausted);
        self.add(Counter::BucketUndecodable, ev.undecodable);
    }

    /// The prefix index's events: its evictions apart (the affinity table's `evictions` stay
    /// about keys), conflicts and undecodable buckets with the table's.
    fn add_index_events(&self, ev: TableEvents) {
        self.add(Counter::PrefixEvictions, ev.evictions);
        self.add(Counter::CasRetries, ev.cas_retries);
        self.add(Counter::CasExhausted, ev.cas_exhausted);
        self.add(Counter::BucketUndecodable, ev.undecodable);
    }

    /// What the prefix stage decided, if it was consulted.
    fn add_prefix_choice(&self, choice: Option<PrefixChoice>) {
        match choice {
            None => {}
            Some(PrefixChoice::Hit { blocks, .. }) => {
                self.add(Counter::PrefixHit, 1);
                self.add(Counter::prefix_hit_blocks(blocks), 1);
            }
            Some(PrefixChoice::Miss) => self.add(Counter::PrefixMiss, 1),
            Some(PrefixChoice::SkippedFull { .. }) => self.add(Counter::PrefixSkippedFull, 1),
            Some(PrefixChoice::Spread { .. }) => self.add(Counter::PrefixSpread, 1),
        }
    }

    fn add_board_events(&self, ev: BoardEvents) {
        self.add(Counter::CasRetries, ev.cas_retries);
        self.add(Counter::CasExhausted, ev.cas_exhausted);
    }

    /// Hands the pending sums to Envoy. Every flush also counts itself (`stats_flushes`), so a
    /// reader of `/stats` can tell that each VM has flushed since a given moment: a counter that
    /// still reads 0 after that is really 0, not merely unflushed.
    fn flush(&self) {
        self.add(Counter::StatsFlushes, 1);
        for (id, cell) in self.ids.iter().zip(&self.pending) {
            let n = cell.replace(0);
            if let (Some(id), true) = (id, n > 0) {
                let _ = abi::increment(*id, i64::from(n));
            }
        }
    }
}

/// The per-rank gauges: what placement believes about each rank (requests in flight, cooling
/// down). Every VM sets them from its view of the shared board once per tick; the views agree
/// (one board), so whichever VM wrote last, the gauge shows the board.
struct Gauges {
    inflight: Vec<Option<u32>>,
    cooling: Vec<Option<u32>>,
    /// The last values written, per rank (a gauge is written only when it changes).
    last: RefCell<Vec<(u64, u64)>>,
}

impl Gauges {
    fn define(dp_size: u32) -> Gauges {
        let define = |name: String| match abi::define_gauge(&name) {
            Ok(id) => Some(id),
            Err(e) => {
                warn!("cannot define metric {name}: status {}", e.0);
                None
            }
        };
        Gauges {
            inflight: (0..dp_size)
                .map(|r| define(metrics::rank_inflight_gauge(r)))
                .collect(),
            cooling: (0..dp_size)
                .map(|r| define(metrics::rank_cooling_gauge(r)))
                .collect(),
            last: RefCell::new(vec![(u64::MAX, u64::MAX); dp_size as usize]),
        }
    }

    fn set(&self, states: &RankStates, now: u32) {
        let mut last = self.last.borrow_mut();
        for (rank, state) in states.ranks.iter().enumerate() {
            let value = (u64::from(state.inflight), u64::from(state.down_until > now));
            let Some(seen) = last.get_mut(rank) else {
                continue;
            };
            if *seen == value {
                continue;
            }
            *seen = value;
            if let Some(Some(id)) = self.inflight.get(rank) {
                let _ = abi::record(*id, value.0);
            }
            if let Some(Some(id)) = self.cooling.get(rank) {
                let _ = abi::record(*id, value.1);
            }
        }
    }
}

/// How often counters are flushed and the clock is read.
const TICK_MS: u32 = 1000;

/// Unix seconds, read from the host once per tick: the table works in whole seconds, so a
/// per-request clock call would buy nothing. Never goes back (see `clock`): a step back of the
/// wall clock is absorbed, and every VM meets the floor published in shared data.
#[derive(Default)]
struct Clock(Cell<SteadyClock>);

impl Clock {
    fn refresh(&self) {
        // The floor first, then the wall clock: a floor read after the wall clock could hold a
        // second another VM read in between, which this VM would take for a step back (and every
        // such race would push all VMs' time a second ahead of the wall clock for good).
        let (stored, cas) = SharedData.get(FLOOR_KEY);
        let floor = decode_floor(stored.as_deref());
        let Ok(wall) = abi::now_seconds() else {
            return;
        };
        let mut clock = self.0.get();
        let now = clock.read(wall, floor);
        self.0.set(clock);
        // Below the floor only when the floor was ignored (see `SteadyClock::read`): replaced.
        if now != floor {
            // Lost to another VM's write: it published this second or a later one.
            let _ = SharedData.set(FLOOR_KEY, &now.to_le_bytes(), cas);
        }
    }

    fn now(&self) -> u32 {
        self.0.get().now()
    }
}

/// Everything a request needs, swapped as a whole when a new configuration is accepted.
struct Runtime {
    cfg: Config,
    table: AffinityTable,
    /// The prefix index, when `prefix.enabled`.
    prefix: Option<PrefixIndex>,
    board: RankBoard,
    /// This VM's own requests in flight per rank, published as its column of `board`. Kept
    /// across a reload that keeps the board, so streams of the old configuration still count.
    local: Rc<RefCell<LocalLoad>>,
    gauges: Gauges,
    counters: Rc<Counters>,
    clock: Rc<Clock>,
    /// Per-VM turn counter for round robin and for rotating least-in-flight ties.
    turn: Cell<u32>,
}

impl Runtime {
    /// The tick's load work: publishes this VM's counts (re-stamping its column, or removing it
    /// when idle) and sets the gauges from the board.
    fn tick(&self) {
        if !self.cfg.assign.tracks_load() {
            return;
        }
        let now = self.clock.now();
        let mut local = self.local.borrow_mut();
        local.decay();
        let (view, events) = self.board.publish(&SharedData, &mut local, now);
        self.counters.add_board_events(events);
        self.gauges.set(&view, now);
    }
}

#[derive(Default)]
struct Root {
    runtime: Option<Rc<Runtime>>,
    counters: Option<Rc<Counters>>,
    clock: Rc<Clock>,
}

impl Context for Root {}

/// Follows Envoy's level for the `wasm` logger: `--component-log-level wasm:debug` at start, or
/// `POST /logging?wasm=debug` on the admin port later (read again every tick), shows our debug
/// lines; below the level, log macros cost nothing on the request path.
fn follow_log_level() {
    if let Ok(level) = abi::log_level() {
        proxy_wasm::set_log_level(match level {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            _ => LogLevel::Critical,
        });
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        follow_log_level();
        info!("dp-affinity {} starting", env!("CARGO_PKG_VERSION"));
        self.clock.refresh();
        if let Err(e) = abi::set_tick_period_ms(TICK_MS) {
            warn!(
                "cannot set the tick period (counters will not be flushed): status {}",
                e.0
            );
        }
        true
    }

    fn on_tick(&mut self) {
        follow_log_level();
        self.clock.refresh();
        if let Some(runtime) = &self.runtime {
            runtime.tick();
        }
        if let Some(counters) = &self.counters {
            counters.flush();
        }
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let Some(bytes) = self.get_plugin_configuration() else {
            error!(
                "invalid plugin configuration: missing (at least {{\"dp_size\": N}} is required)"
            );
            return false;
        };
        let cfg = match Config::from_json(&bytes) {
            Ok(cfg) => cfg,
            Err(e) => {
                // Envoy refuses the filter (or keeps the previous config on reload).
                error!("{e}");
                return false;
            }
        };
        for warning in cfg.warnings() {
            warn!("{warning}");
        }
        let table = AffinityTable::new(cfg.table.clone());
        let created = table.ensure_buckets(&SharedData);
        // Created up front like the affinity table's, so every later write is a real
        // compare-and-swap (a marker key lets later VMs skip the walk).
        let prefix = cfg.prefix.enabled.then(|| PrefixIndex::new(&cfg.prefix));
        let prefix_created = prefix
            .as_ref()
            .map_or(0, |idx| idx.table().ensure_buckets(&SharedData));
        let board = RankBoard::new(&cfg.table.namespace, cfg.dp_size, cfg.table.cas_retries);
        if cfg.assign.tracks_load() {
            board.ensure(&SharedData, self.clock.now());
        }
        let local = match &self.runtime {
            Some(old) if old.board.key() == board.key() => old.local.clone(),
            // Another board (dp_size or namespace changed): the old streams end in the old
            // counts, whose column then expires; this configuration starts from zero.
            _ => Rc::new(RefCell::new(LocalLoad::new(cfg.dp_size))),
        };
        let gauges = Gauges::define(cfg.dp_size);
        // A mode that keeps no load view (`envoy`) never updates the gauges again: they read 0
        // rather than whatever the board held when it was configured.
        let shown = if cfg.assign.tracks_load() {
            board.read(&SharedData, &local.borrow(), self.clock.now())
        } else {
            RankStates {
                ranks: vec![RankLoad::default(); cfg.dp_size as usize],
            }
        };
        gauges.set(&shown, self.clock.now());
        let counters = self
            .counters
            .get_or_insert_with(|| Rc::new(Counters::define()))
            .clone();
        info!(
            "dp-affinity configured: dp_size {}, table {}x{} (created {} buckets), ttl {}s",
            cfg.dp_size, cfg.table.buckets, cfg.table.ways, created, cfg.table.ttl_seconds
        );
        if cfg.prefix.enabled {
            info!(
                "prefix placement on: blocks of {} B / {} ids, up to {}, min match {}, index {}x{} (created {} buckets), ttl {}s",
                cfg.prefix.block_bytes,
                cfg.prefix.block_tokens,
                cfg.prefix.max_blocks,
                cfg.prefix.min_match_blocks,
                cfg.prefix.table.buckets,
                cfg.prefix.table.ways,
                prefix_created,
                cfg.prefix.table.ttl_seconds
            );
        }
        self.runtime = Some(Rc::new(Runtime {
            cfg,
            table,
            prefix,
            board,
            local,
            gauges,
            counters,
            clock: self.clock.clone(),
            turn: Cell::new(self.clock.now()),
        }));
        true
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let runtime = self.runtime.clone()?;
        Some(Box::new(Filter {
            rt: runtime,
            id: context_id,
            awaiting_body: false,
            body_size: 0,
            header_key: None,
            routed: Routed::Unset,
            acquired: None,
            trusted: false,
            api: None,
            prefix: None,
            answered: false,
            response_ended: false,
            served: false,
            finished: false,
            may_choose_rank: false,
            path_target: None,
            body_editable: false,
            awaiting_edit: false,
            engine_rank: None,
            has_content_length: false,
            pin_to_write: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Where the request went, remembered for the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Routed {
    /// Not decided (still reading the body, or answered locally).
    Unset,
    /// Sent to a rank with no key to pin: chosen by the client (explicit, bootstrap room) or by
    /// the filter (a keyless placement).
    Direct { rank: u32, chooser: Chooser },
    /// The key is pinned to this rank (it was, or the filter just placed it there).
    Pinned { hash: u64, rank: u32 },
    /// The key was not pinned and Envoy balances: learn the rank from the response (`learned`,
    /// once a 2xx named it, so that an answer the rank cuts short unpins it again).
    Learn { hash: u64, learned: Option<u32> },
    /// No key and Envoy balances: nothing to learn.
    Balanced,
}

/// A request's prompt chain and what the prefix index said about it, kept from the decision to
/// the response: to record the chain once the serving rank is known, and to forget it if that
/// rank fails the request.
struct PrefixState {
    chain: Chain,
    /// The lookup's result (`Match::default()` until the lookup is made).
    matched: Match,
    /// The prompt's anchor for that result (`None` until the lookup is made, or when the prompt
    /// has none): what names its home, and where it was taken is recorded with its positions.
    anchor: Option<Anchor>,
    /// The rank the chain was recorded under (once recorded: a chain is recorded at most once).
    recorded: Option<u32>,
    /// The matched position's marks (branched, holder) still to write once the rank serves the
    /// request: `Some(whether the record wrote positions)`.
    marks_pending: Option<bool>,
}

struct Filter {
    rt: Rc<Runtime>,
    id: u32,
    awaiting_body: bool,
    body_size: usize,
    /// A key from a header, kept while the body is read (`bootstrap_room` mode only).
    header_key: Option<Vec<u8>>,
    routed: Routed,
    /// The rank this request is counted in flight on, released when the stream ends.
    acquired: Option<u32>,
    /// The caller may use the explicit-rank override (body fields included).
    trusted: bool,
    /// The prompt's API when prefix placement reads this request's body.
    api: Option<Api>,
    /// The prompt's chain, when the body gave one and the decision uses it.
    prefix: Option<PrefixState>,
    /// Response headers arrived (Envoy's own failure answers included).
    answered: bool,
    /// The response reached its end (its last body bytes or trailers went through).
    response_ended: bool,
    /// The rank the filter chose served the request (2xx): its release cancels one strike.
    served: bool,
    /// The stream's end was handled (see [`Filter::finish`]).
    finished: bool,
    /// The caller may choose a rank (the override is on and it is trusted): its own rank
    /// header and body fields may reach the engine.
    may_choose_rank: bool,
    /// Engine mode: the index of this request's path in the engine's paths.
    path_target: Option<usize>,
    /// Engine mode: the request has a body the engine parses as JSON, which the filter may
    /// have to edit (see `PathTarget::body_edit`).
    body_editable: bool,
    /// The headers are paused until the whole body is here, to edit it.
    awaiting_edit: bool,
    /// Engine mode: the rank the filter told the engine (set by `route_to`).
    engine_rank: Option<u32>,
    /// The request came with a `content-length`, which an edited body must correct.
    has_content_length: bool,
    /// The key's pin the placement chose to write, held back until the request is sure to reach
    /// its rank: in engine mode a body that must carry the rank and cannot be edited sends the
    /// request elsewhere (the engine places it) or nowhere (refused).
    pin_to_write: Option<(u64, u32, Tag)>,
}

impl Context for Filter {
    /// The stream's context is being destroyed. `on_log` has normally ended the stream already;
    /// where Envoy logs a stream late or not at all (HTTP/3 defers its access log until the
    /// client acknowledges the answer), this ends it, so its rank is never left counted.
    fn on_done(&mut self) -> bool {
        self.finish();
        true
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let headers = match HeaderMap::read(REQUEST_HEADERS) {
            Ok(h) => h,
            Err(e) => {
                // Undecided, the request goes where Envoy balances it; never where a client's
                // own copy of the cluster header would send it (removed unread).
                warn!("[{}] cannot read request headers: status {}", self.id, e.0);
                let _ = abi::remove_header(REQUEST_HEADERS, &self.rt.cfg.cluster_header);
                return Action::Continue;
            }
        };
        #[cfg(feature = "fault-injection")]
        if headers
            .pairs()
            .any(|(n, _)| n == b"x-dp-affinity-test-panic")
        {
            panic!("fault injection: x-dp-affinity-test-panic");
        }
        let rt = self.rt.clone();
        let cfg = &rt.cfg;
        let facts = HeaderFacts::collect(cfg, headers.pairs());
        if facts.has_cluster_header {
            // Only the filter may choose a cluster: drop the client's copy before routing.
            let _ = abi::remove_header(REQUEST_HEADERS, &cfg.cluster_header);
            rt.counters.add(Counter::ClusterHeaderStripped, 1);
        }
        if facts.explicit.is_some() && !(cfg.explicit.enabled && facts.trusted) {
            // The override is off, or this caller may not use it: the engine behind must not
            // see the client's rank either.
            let _ = abi::remove_header(REQUEST_HEADERS, &cfg.explicit.header);
            if cfg.explicit.enabled {
                rt.counters.add(Counter::UntrustedRank, 1);
            }
        }
        if explicit_header_ignored(cfg, &facts) {
            let _ = abi::remove_header(REQUEST_HEADERS, &cfg.explicit.header);
        }
        if facts.has_trust_header {
            // The secret is between the caller and this filter.
            if let Some(trust) = &cfg.explicit.trust {
                let _ = abi::remove_header(REQUEST_HEADERS, &trust.header);
            }
        }
        self.trusted = facts.trusted;
        self.may_choose_rank = cfg.explicit.enabled && facts.trusted;
        if let Some(engine) = cfg.target.engine() {
            self.strip_engine_headers(engine, &headers);
            let Some(index) = facts.engine_path else {
                // The engine reads no rank on this path: choosing one would only miscount.
                rt.counters.add(Counter::Untargeted, 1);
                return Action::Continue;
            };
            self.path_target = Some(index);
            self.body_editable = !end_of_stream && engine_parses_as_json(facts.content_type);
            self.has_content_length = facts.content_length.is_some();
        }
        self.api = facts.prefix_api(cfg);
        match decide_headers(cfg, &facts, end_of_stream) {
            HeaderStep::ReadBody => {
                self.awaiting_body = true;
                self.header_key = facts.key.map(|(_, k)| k.to_vec());
                Action::Pause
            }
            HeaderStep::Decided(d) => {
                let action = self.apply(d, false);
                if action == Action::Continue && self.pending_body_edit().is_some() {
                    // Decided, but the body still has to carry the rank (or lose a client's).
                    self.awaiting_edit = true;
                    return Action::Pause;
                }
                action
            }
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.awaiting_body && !self.awaiting_edit {
            return Action::Continue;
        }
        self.body_size = body_size;
        if body_size > self.rt.cfg.body.max_bytes {
            if self.awaiting_edit {
                return self.body_not_editable(true);
            }
            self.awaiting_body = false;
            let d = without_body(
                &self.rt.cfg,
                Reason::BodyTooLarge,
                self.header_key.as_deref(),
            );
            let action = self.apply(d, true);
            if action == Action::Continue && self.pending_body_edit().is_some() {
                return self.body_not_editable(true);
            }
            return action;
        }
        if !end_of_stream {
            return Action::Pause; // buffer until the whole body is here
        }
        self.body_complete()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A body followed by trailers never sees end_of_stream in the body callback.
        if self.awaiting_body || self.awaiting_edit {
            return self.body_complete();
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.answered = true;
        self.response_ended = end_of_stream;
        let echo_wanted = self.rt.cfg.echo_header.is_some();
        // Each branch reads only what it needs: host calls are the filter's main cost.
        // A chain the filter did not record at placement (Envoy balanced) is recorded from a
        // 2xx under the rank that answered; one it did is kept on a 2xx, withdrawn otherwise.
        let prefix_pending = self.prefix.is_some();
        let (served, echo_in_place) = match self.routed {
            Routed::Unset => return Action::Continue, // our own 400, or answered before us
            // The client chose the rank: its answer says nothing the filter acts on (no key, no
            // strike), so no read at all, just the echo.
            Routed::Direct {
                rank,
                chooser: Chooser::Client,
            } if !prefix_pending => (Some(rank), false),
            Routed::Direct { rank, chooser } => {
                let facts = self.response_facts();
                self.settle(rank, None, chooser, self.answer(&facts));
                (
                    Some(rank),
                    facts.echo_in_place && facts.reported_rank == Some(rank),
                )
            }
            Routed::Pinned { hash, rank } => {
                // One read gives both the status and whether the upstream already reports the
                // rank under the echo header's name (then the echo costs no write).
                let facts = self.response_facts();
                self.settle(rank, Some(hash), Chooser::Filter, self.answer(&facts));
                (
                    Some(rank),
                    facts.echo_in_place && facts.reported_rank == Some(rank),
                )
            }
            Routed::Learn { hash, .. } => {
                let facts = self.response_facts();
                let served = self.served_rank(&facts);
                if facts.served() {
                    self.learn(hash, served);
                    if let Some(rank) = served {
                        self.keep_prefix(rank);
                        self.routed = Routed::Learn {
                            hash,
                            learned: served,
                        };
                        self.served = true;
                    }
                }
                (served, facts.echo_in_place)
            }
            Routed::Balanced if echo_wanted || prefix_pending => {
                let facts = self.response_facts();
                let served = self.served_rank(&facts);
                if let (true, Some(rank)) = (facts.served(), served) {
                    self.keep_prefix(rank);
                }
                (served, facts.echo_in_place)
            }
            Routed::Balanced => (None, false),
        };
        if let (Some(echo), Some(rank), false) = (&self.rt.cfg.echo_header, served, echo_in_place) {
            let _ = abi::set_header(RESPONSE_HEADERS, echo, &rank.to_string());
        }
        Action::Continue
    }

    // Called for every response body chunk whether the filter reads it or not: noting the end
    // costs no host call.
    fn on_http_response_body(&mut self, _body_size: usize, end_of_stream: bool) -> Action {
        self.response_ended |= end_of_stream;
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.response_ended = true;
        Action::Continue
    }

    fn on_log(&mut self) {
        self.finish();
    }
}

impl Filter {
    /// The stream is over, whatever happened to it (answer, reset, timeout, client gone): at
    /// `on_log`, or at `on_done` when no log came first; once.
    /// No response at all: the key of a request sent to a rank is unpinned (a rank that never
    /// answers must not keep its conversations); nothing else, since a client can abandon its
    /// own requests at will.
    fn finish(&mut self) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        if !self.answered {
            match self.routed {
                Routed::Pinned { hash, rank } => {
                    self.settle(rank, Some(hash), Chooser::Filter, Answer::Unanswered)
                }
                Routed::Direct { rank, chooser } => {
                    self.settle(rank, None, chooser, Answer::Unanswered)
                }
                Routed::Unset | Routed::Learn { .. } | Routed::Balanced => {}
            }
        } else if self.served && !self.response_ended {
            self.settle_cut_answer();
        }
        // The request no longer loads its rank.
        self.release_acquired();
    }

    /// A 2xx from the rank the filter chose (or learned a key's pin from) never reached its end.
    /// The client may have left (its own doing: nothing to act on), or the rank stopped short of
    /// it — Envoy timed the stream out, or the rank reset it (`failure::cut_by_rank`): then the
    /// request failed after all, and is settled again as such (its key unpinned; where the filter
    /// chose, a strike and no strike forgiven). One property read, only for answers cut short.
    fn settle_cut_answer(&mut self) {
        let (rank, key, chooser) = match self.routed {
            Routed::Pinned { hash, rank } => (rank, Some(hash), Chooser::Filter),
            Routed::Direct {
                rank,
                chooser: Chooser::Filter,
            } => (rank, None, Chooser::Filter),
            // Envoy chose the rank the key was just pinned to: the pin goes, and as for a
            // client's choice, no strike.
            Routed::Learn {
                hash,
                learned: Some(rank),
            } => (rank, Some(hash), Chooser::Client),
            _ => return,
        };
        let details = abi::property(&["response", "code_details"]).ok().flatten();
        if !details.as_deref().is_some_and(cut_by_rank) {
            return;
        }
        debug!(
            "[{}] rank {rank} cut its answer short: {}",
            self.id,
            String::from_utf8_lossy(details.as_deref().unwrap_or_default())
        );
        self.rt.counters.add(Counter::AnswerCut, 1);
        self.settle(rank, key, chooser, Answer::Cut);
    }

    /// The whole body is buffered: decide from it if the decision waited for it, then edit it
    /// if the engine needs the rank in it.
    fn body_complete(&mut self) -> Action {
        let body = match abi::request_body(0, self.body_size) {
            Ok(body) => Some(body),
            Err(e) => {
                warn!("[{}] cannot read request body: status {}", self.id, e.0);
                None
            }
        };
        if self.awaiting_body {
            let action = self.decide_from_body(body.as_deref());
            if action != Action::Continue {
                return action;
            }
        }
        self.awaiting_edit = false;
        if self.pending_body_edit().is_none() {
            return Action::Continue;
        }
        let action = match body {
            Some(body) => self.edit_body(&body),
            None => self.body_not_editable(false),
        };
        // The body goes to the rank chosen (a body the filter could not edit dropped the pin).
        self.write_pin();
        action
    }

    fn decide_from_body(&mut self, body: Option<&[u8]>) -> Action {
        self.awaiting_body = false;
        let header_key = self.header_key.take();
        let (decision, chain) = match body {
            Some(body) => decide_body_with_prefix(
                &self.rt.cfg,
                body,
                header_key.as_deref(),
                self.trusted,
                self.api,
            ),
            None => {
                let d = without_body(&self.rt.cfg, Reason::NoKey, header_key.as_deref());
                (d, Chain::default())
            }
        };
        // A chat shorter than a block has no chain to look up or record, but its opening still
        // anchors its home (the same as its next turns').
        if (!chain.is_empty() || chain.opening().is_some()) && self.rt.prefix.is_some() {
            self.prefix = Some(PrefixState {
                chain,
                matched: Match::default(),
                anchor: None,
                recorded: None,
                marks_pending: None,
            });
        }
        self.apply(decision, true)
    }

    /// Engine mode: the edit the body still needs now that the rank is known (or known to be
    /// none), when its body is one the filter may edit.
    fn pending_body_edit(&self) -> Option<RankEdit<'_>> {
        if !self.body_editable {
            return None;
        }
        let engine = self.rt.cfg.target.engine()?;
        let path = engine.paths.get(self.path_target?)?;
        path.body_edit(self.engine_rank, self.may_choose_rank)
    }

    /// Writes the rank into the body (and drops a client's rank fields), correcting
    /// `content-length`: the headers are still paused, so they can change.
    fn edit_body(&mut self, body: &[u8]) -> Action {
        let rt = self.rt.clone();
        let Some(edit) = self.pending_body_edit() else {
            return Action::Continue;
        };
        let rewritten = match rewrite(body, edit) {
            Ok(Some(r)) => r,
            Ok(None) => return Action::Continue,
            Err(_) => return self.body_not_editable(false),
        };
        if let Err(e) = abi::set_request_body(0, body.len(), &rewritten.body) {
            warn!(
                "[{}] cannot replace the request body: status {}",
                self.id, e.0
            );
            return self.body_not_editable(false);
        }
        if self.has_content_length {
            let length = rewritten.body.len().to_string();
            if let Err(e) = abi::set_header(REQUEST_HEADERS, "content-length", &length) {
                warn!("[{}] cannot set content-length: status {}", self.id, e.0);
            }
        }
        if rewritten.rank_set {
            rt.counters.add(Counter::TargetBodyRewritten, 1);
        }
        if rewritten.removed > 0 {
            rt.counters.add(Counter::TargetBodyStripped, 1);
        }
        Action::Continue
    }

    /// The body needed an edit the filter cannot make (over `body.max_bytes`, or not a JSON
    /// object it reads). A caller who may choose a rank gets its request through as sent (the
    /// engine then places it, and the filter learns where); anyone else is refused, since the
    /// filter cannot take a rank field of theirs out of that body.
    fn body_not_editable(&mut self, too_large: bool) -> Action {
        self.awaiting_edit = false;
        // The request does not reach the rank chosen: its key keeps the pin it had.
        self.pin_to_write = None;
        self.rt.counters.add(Counter::TargetBodyUnwritable, 1);
        if self.may_choose_rank {
            self.rank_not_applied();
            return Action::Continue;
        }
        // Refused here: the chain recorded at placement was never served.
        self.withdraw_placed_prefix();
        self.routed = Routed::Unset;
        let (status, message) = if too_large {
            (413, "the request body is over body.max_bytes, so the filter cannot check its rank fields")
        } else {
            (400, "the request body is not a JSON object the filter can read, so it cannot check its rank fields")
        };
        let body = format!(
            r#"{{"error":{{"message":"{message}","type":"invalid_request_error","code":"rank_fields_unchecked"}}}}"#
        );
        let sent = abi::send_local_response(
            status,
            "dp_affinity_body_not_editable",
            &[("content-type", "application/json")],
            body.as_bytes(),
        );
        // Without the answer the request still must not go on with rank fields the client may
        // not send: it waits paused until Envoy's own timers end it.
        if let Err(e) = sent {
            warn!(
                "[{}] cannot send the {status} answer (status {}): the request stays paused",
                self.id, e.0
            );
        }
        Action::Pause
    }

    /// The rank the filter chose could not be written into the body: the engine places the
    /// request itself, so the filter learns the rank from the answer like a balanced one and no
    /// longer counts it on the rank it chose.
    fn rank_not_applied(&mut self) {
        // The chain was recorded under the rank chosen; the answer's rank is recorded instead.
        self.withdraw_placed_prefix();
        self.engine_rank = None;
        self.routed = match self.routed {
            Routed::Pinned { hash, .. } => Routed::Learn {
                hash,
                learned: None,
            },
            Routed::Direct { .. } => Routed::Balanced,
            other => other,
        };
        self.release_acquired();
    }

    /// The request no longer counts in flight on the rank it was counted on (if any); a rank
    /// that served it has one strike cancelled in the same write.
    fn release_acquired(&mut self) {
        if let Some(rank) = self.acquired.take() {
            let rt = &self.rt;
            let events = rt.board.release(
                &SharedData,
                &mut rt.local.borrow_mut(),
                rt.clock.now(),
                rank,
                self.served,
            );
            rt.counters.add_board_events(events);
        }
    }

    /// Removes a client's copies of the engine's rank headers unless it may choose a rank (the
    /// explicit-rank header itself is handled with the explicit rank).
    fn strip_engine_headers(&self, engine: &EngineTarget, headers: &HeaderMap) {
        if self.may_choose_rank {
            return;
        }
        let explicit = self.rt.cfg.explicit.header.as_str();
        for name in engine.headers.iter().filter(|h| h.as_str() != explicit) {
            let sent = headers
                .pairs()
                .any(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()));
            if sent && abi::remove_header(REQUEST_HEADERS, name).is_ok() {
                self.rt.counters.add(Counter::TargetHeaderStripped, 1);
            }
        }
    }

    /// Carries out a decision. `from_body`: the headers were paused, so the route must be
    /// recomputed after setting the cluster header.
    fn apply(&mut self, decision: Decision, from_body: bool) -> Action {
        let rt = self.rt.clone();
        match decision {
            Decision::Rank(rank) => {
                rt.counters.add(Counter::Explicit, 1);
                self.send_chosen(rank, from_body);
            }
            Decision::Room(rank) => {
                rt.counters.add(Counter::Room, 1);
                self.send_chosen(rank, from_body);
            }
            Decision::Key {
                hash,
                too_long,
                unread_body,
            } => {
                if too_long {
                    rt.counters.add(Counter::KeyTooLong, 1);
                }
                if let Some(reason) = unread_body {
                    rt.counters.add(fallback_counter(reason), 1);
                }
                let resolved = resolve_key(&rt.cfg, &rt.table, &SharedData, hash, rt.clock.now());
                if resolved.undecodable {
                    rt.counters.add(Counter::BucketUndecodable, 1);
                }
                // Looked up even when the pin will decide: recording then writes only what the
                // index does not hold yet (usually nothing, for a conversation's next turn).
                let key = KeyFacts {
                    hash,
                    pinned: resolved.pinned,
                    tag: resolved.tag,
                    depth: resolved.depth,
                };
                self.place(Some(key), from_body);
            }
            Decision::Fallback(reason) => {
                rt.counters.add(fallback_counter(reason), 1);
                self.place(None, from_body);
            }
            Decision::Unplaced => {
                rt.counters.add(Counter::RoomUnplaced, 1);
                self.routed = Routed::Balanced;
            }
            Decision::Reject(rejection) => {
                rt.counters.add(Counter::InvalidRank, 1);
                debug!("[{}] rejected: {}", self.id, rejection.body);
                let sent = abi::send_local_response(
                    rejection.status,
                    "dp_affinity_invalid_rank",
                    &[("content-type", "application/json")],
                    rejection.body.as_bytes(),
                );
                if let Err(e) = sent {
                    warn!("[{}] cannot send the 400 answer: status {}", self.id, e.0);
                    return Action::Continue;
                }
                return Action::Pause;
            }
        }
        Action::Continue
    }

    /// Sends to the rank the client chose (explicit, room), counting it in flight.
    fn send_chosen(&mut self, rank: u32, from_body: bool) {
        let rt = self.rt.clone();
        if rt.cfg.assign.tracks_load() {
            let (taken, events) = rt.board.acquire(
                &SharedData,
                &mut rt.local.borrow_mut(),
                rt.clock.now(),
                self.prompt_blocks(),
                |_| Some(rank),
            );
            rt.counters.add_board_events(events);
            self.acquired = taken;
        }
        self.route_to(rank, from_body);
        self.routed = Routed::Direct {
            rank,
            chooser: Chooser::Client,
        };
    }

    /// Places a request with a key or none: gathers the facts, lets `placement::plan` decide
    /// (inside the rank board's atomic update when load is counted, so the choice and the
    /// in-flight count agree) and carries the plan out.
    fn place(&mut self, key: Option<KeyFacts>, from_body: bool) {
        let rt = self.rt.clone();
        let matched = self.prefix_lookup();
        let turn = rt.turn.get();
        rt.turn.set(turn.wrapping_add(1));
        let facts = Facts {
            key,
            matched,
            // No key: the prompt's anchor stands for one, so every replica gives the
            // conversation the same home (a key is its own anchor, unless the prompt overrules
            // its pin).
            anchor: self.prefix.as_ref().and_then(|p| p.anchor).map(|a| a.hash),
            chain_blocks: self.prefix.as_ref().map_or(0, |p| p.chain.len()),
            anchor_kept: self
                .prefix
                .as_ref()
                .and_then(|p| p.anchor)
                .map_or(Kept::No, |a| a.kept),
            // Only a key's pin stores or compares names.
            opening_name: key.and_then(|_| self.opening_name()),
            turn,
        };
        let blocks = self.prompt_blocks();
        let now = rt.clock.now();
        let plan = if rt.cfg.assign.tracks_load() {
            let mut planned = None;
            let (taken, events) =
                rt.board
                    .acquire(&SharedData, &mut rt.local.borrow_mut(), now, blocks, |st| {
                        let p = plan(&rt.cfg, now, &facts, Some(st), blocks);
                        planned = Some(p);
                        p.target.rank()
                    });
            rt.counters.add_board_events(events);
            self.acquired = taken;
            planned
        } else {
            Some(plan(&rt.cfg, now, &facts, None, blocks))
        };
        let Some(plan) = plan else {
            return;
        };
        let overruled = plan.counters[0] == Some(Counter::KeyOverruled);
        debug!(
            "[{}] placed: {:?} (prefix {:?}, anchor {:?}, {blocks} blocks, home {}{})",
            self.id,
            plan.target,
            plan.prefix,
            key.map(|k| k.hash).filter(|_| !overruled).or(facts.anchor),
            plan.counters[2].map_or("-", |c| {
                let name = c.name();
                name.strip_prefix("dp_affinity.").unwrap_or(name)
            }),
            if overruled {
                ", the prompt overruled the key's pin"
            } else {
                ""
            }
        );
        rt.counters.add_prefix_choice(plan.prefix);
        for counter in plan.counters.into_iter().flatten() {
            rt.counters.add(counter, 1);
        }
        self.routed = match plan.target {
            Target::Pinned {
                hash,
                rank,
                write_pin,
            } => {
                if write_pin {
                    self.pin_to_write = Some((hash, rank, plan.pin_tag));
                }
                self.route_to(rank, from_body);
                self.record_prefix(rank);
                if self.pending_body_edit().is_none() {
                    self.write_pin();
                }
                Routed::Pinned { hash, rank }
            }
            Target::Direct { rank } => {
                self.route_to(rank, from_body);
                self.record_prefix(rank);
                Routed::Direct {
                    rank,
                    chooser: Chooser::Filter,
                }
            }
            // The key and the chain are learned and recorded from the answer.
            Target::Learn { hash } => Routed::Learn {
                hash,
                learned: None,
            },
            Target::Balanced => Routed::Balanced,
        };
    }

    /// Writes the key's pin the placement chose (see `pin_to_write`), if any.
    fn write_pin(&mut self) {
        if let Some((hash, rank, Tag { tag, depth })) = self.pin_to_write.take() {
            let rt = &self.rt;
            let events = rt
                .table
                .pin_flagged(&SharedData, hash, rank, tag, depth, rt.clock.now());
            rt.counters.add_table_events(events);
        }
    }

    /// Searches the prefix index for this request's chain (if it has one) and keeps the result
    /// for recording. `None`: no chain, so the prefix has no say.
    fn prefix_lookup(&mut self) -> Option<Match> {
        let rt = self.rt.clone();
        let idx = rt.prefix.as_ref()?;
        let state = self.prefix.as_mut()?;
        let store = IndexStore::new(&rt.counters);
        state.matched =
            idx.longest_match(&store, state.chain.hashes(), rt.clock.now(), rt.cfg.dp_size);
        state.anchor = idx.anchor(state.chain.hashes(), state.chain.opening(), &state.matched);
        if let Some(rank) = state.matched.rank {
            debug!(
                "[{}] prefix: {} of {} blocks indexed on rank {rank}",
                self.id,
                state.matched.blocks,
                state.chain.len()
            );
        }
        Some(state.matched)
    }

    /// For a chat that goes on past its opening: the anchor its prompt gets past nothing (see
    /// `placement::Facts::opening_name`).
    fn opening_name(&self) -> Option<u64> {
        let idx = self.rt.prefix.as_ref()?;
        let chain = &self.prefix.as_ref()?.chain;
        if !chain.past_opening() {
            return None;
        }
        idx.anchor(chain.hashes(), chain.opening(), &Match::default())
            .map(|a| a.hash)
    }

    /// The request's prompt size in blocks of `prefix.block_bytes` (its body's size; 1 when the
    /// body was not read): the work it adds to a rank's recent load.
    fn prompt_blocks(&self) -> u32 {
        let block = self.rt.cfg.prefix.block_bytes.max(1) as usize;
        u32::try_from(self.body_size / block)
            .unwrap_or(u32::MAX)
            .max(1)
    }

    /// Records this request's chain under the rank that serves it (once), writing only the
    /// positions beyond what the lookup found.
    fn record_prefix(&mut self, rank: u32) {
        let rt = self.rt.clone();
        let (Some(idx), Some(state)) = (rt.prefix.as_ref(), self.prefix.as_mut()) else {
            return;
        };
        if state.recorded.is_some() {
            return;
        }
        state.recorded = Some(rank);
        // A next turn that crossed no grid position and was served where it matched makes no
        // store call at all: `record_positions` only touches what changed.
        let new_positions = idx.writes_needed(state.chain.len(), &state.matched) > 0;
        let store = IndexStore::new(&rt.counters);
        // Where the anchor was taken is remembered with the positions, also for a keyed
        // request: a keyless next turn matching them names the conversation the same way. (A
        // request recorded without a lookup, placed by an explicit rank, is named here.)
        let anchored_at = state
            .anchor
            .or_else(|| idx.anchor(state.chain.hashes(), state.chain.opening(), &state.matched))
            .map(|a| a.at);
        let (events, wrote) = idx.record_positions(
            &store,
            state.chain.hashes(),
            rank,
            rt.clock.now(),
            &state.matched,
            anchored_at,
        );
        state.marks_pending = Some(wrote);
        rt.counters.add_index_events(events);
        if new_positions && events.cas_exhausted == 0 {
            rt.counters.add(Counter::PrefixRecorded, 1);
        }
    }

    /// The rank served the request: the chain stays (recorded now if it was not at placement)
    /// and the matched position gets its marks. Marks wait for the answer because a request
    /// that fails must not leave a conversation's own history looking shared.
    fn keep_prefix(&mut self, rank: u32) {
        self.record_prefix(rank);
        let rt = self.rt.clone();
        let (Some(idx), Some(state)) = (rt.prefix.as_ref(), self.prefix.as_mut()) else {
            return;
        };
        let (Some(recorded), Some(wrote)) = (state.recorded, state.marks_pending.take()) else {
            return;
        };
        let store = IndexStore::new(&rt.counters);
        let events = idx.mark_matched(
            &store,
            state.chain.hashes(),
            recorded,
            rt.clock.now(),
            &state.matched,
            wrote,
        );
        rt.counters.add_index_events(events);
    }

    /// Withdraws the chain recorded under the rank the filter placed this request on (if it did).
    fn withdraw_placed_prefix(&mut self) {
        if let Routed::Pinned { rank, .. } | Routed::Direct { rank, .. } = self.routed {
            self.withdraw_prefix(rank);
        }
    }

    /// The request was placed on `rank` and recorded there, but not served: the positions it
    /// added are removed (what it matched stays), so the index keeps only prompts a rank
    /// computed.
    fn withdraw_prefix(&mut self, rank: u32) {
        let rt = self.rt.clone();
        let (Some(idx), Some(state)) = (rt.prefix.as_ref(), self.prefix.as_mut()) else {
            return;
        };
        if state.recorded != Some(rank) {
            return;
        }
        state.recorded = None;
        state.marks_pending = None;
        let store = IndexStore::new(&rt.counters);
        let events = idx.withdraw(&store, state.chain.hashes(), rank, &state.matched);
        rt.counters.add_index_events(events);
        if store.store.writes() > 0 {
            rt.counters.add(Counter::PrefixWithdrawn, 1);
        }
    }

    /// `rank` failed this request: if the chain was recorded under it (or the prefix sent the
    /// request there), its entries pointing at `rank` are removed, so the next request sharing
    /// the prefix is placed afresh. Entries re-pointed elsewhere since are kept.
    fn forget_prefix(&mut self, rank: u32) {
        let rt = self.rt.clone();
        let (Some(idx), Some(state)) = (rt.prefix.as_ref(), self.prefix.as_ref()) else {
            return;
        };
        let ours = state.recorded == Some(rank) || state.matched.rank == Some(rank);
        if !ours {
            return;
        }
        // The whole chain, not only the matched part: what this request recorded goes too.
        let all = Match {
            blocks: state.chain.len(),
            rank: Some(rank),
            ..Match::default()
        };
        let store = IndexStore::new(&rt.counters);
        let events = idx.forget(&store, state.chain.hashes(), rank, &all);
        rt.counters.add_index_events(events);
        if store.store.writes() > 0 {
            rt.counters.add(Counter::PrefixForgotten, 1);
            info!(
                "[{}] rank {rank} failed; its prefix entries of this prompt forgotten",
                self.id
            );
        }
    }

    fn route_to(&mut self, rank: u32, from_body: bool) {
        let rt = self.rt.clone();
        let cfg = &rt.cfg;
        // The cluster name is precomputed per rank: no allocation on the cluster path.
        let (header, value) = match &cfg.target {
            TargetMode::Cluster => match cfg.cluster_names.get(rank as usize) {
                Some(cluster) => (cfg.cluster_header.as_str(), Cow::Borrowed(cluster.as_str())),
                None => return,
            },
            TargetMode::Engine(engine) => {
                self.engine_rank = Some(rank);
                // Where the engine takes no header, the rank goes into the body instead.
                let path = self.path_target.and_then(|i| engine.paths.get(i));
                match path.and_then(|p| p.header.as_ref()) {
                    Some(header) => (header.as_str(), Cow::Owned(rank.to_string())),
                    None => return,
                }
            }
        };
        if let Err(e) = abi::set_header(REQUEST_HEADERS, header, &value) {
            warn!("[{}] cannot set {header}: status {}", self.id, e.0);
            return;
        }
        // Only the cluster header changes the route; the engine header just rides along.
        if from_body && cfg.target == TargetMode::Cluster {
            if let Err(e) = abi::clear_route_cache() {
                warn!("[{}] clear_route_cache failed: status {}", self.id, e.0);
            }
        }
    }

    /// `:status` and the upstream's rank report, from one read of the response headers.
    fn response_facts(&self) -> ResponseFacts {
        match HeaderMap::read(RESPONSE_HEADERS) {
            Ok(headers) => ResponseFacts::collect(&self.rt.cfg, headers.pairs()),
            Err(_) => ResponseFacts::default(),
        }
    }

    /// The rank that served a balanced request: the upstream's own report, else its address.
    fn served_rank(&self, facts: &ResponseFacts) -> Option<u32> {
        if facts.reported_rank.is_some() {
            return facts.reported_rank;
        }
        let addresses = &self.rt.cfg.learn.upstream_addresses;
        if addresses.is_empty() {
            return None;
        }
        let addr = abi::property(&["upstream", "address"]).ok().flatten()?;
        addresses.get(std::str::from_utf8(&addr).ok()?).copied()
    }

    fn learn(&self, hash: u64, served: Option<u32>) {
        let counters = &self.rt.counters;
        let Some(rank) = served else {
            counters.add(Counter::LearnUnknown, 1);
            return;
        };
        let events = self
            .rt
            .table
            .pin(&SharedData, hash, rank, self.rt.clock.now());
        counters.add_table_events(events);
        if events.cas_exhausted == 0 {
            counters.add(Counter::Learned, 1);
        }
    }

    /// A request sent to a pinned rank failed: drop its own pin so its next turn is placed again
    /// (other keys on the rank keep theirs).
    fn unpin(&self, hash: u64, rank: u32) {
        let (removed, events) = self.rt.table.unpin(&SharedData, hash, rank);
        self.rt.counters.add_table_events(events);
        if removed {
            self.rt.counters.add(Counter::Unpinned, 1);
            info!(
                "[{}] request failed on rank {rank}; its key unpinned",
                self.id
            );
        }
    }

    /// What the answer to this request was (`response.code_details` read only for a 5xx: it
    /// tells Envoy's own failure answers from the rank's).
    fn answer(&self, facts: &ResponseFacts) -> Answer {
        let details = match facts.status {
            0 | 500..=599 => abi::property(&["response", "code_details"]).ok().flatten(),
            _ => None,
        };
        classify(facts.status, details.as_deref())
    }

    /// Acts on how a request sent to `rank` ended (see `failure`): unpin its own key, strike or
    /// cool down the rank, record or forget the prompt's chain.
    fn settle(&mut self, rank: u32, key: Option<u64>, chooser: Chooser, answer: Answer) {
        let verdict = judge(answer, chooser);
        let tracks_load = self.rt.cfg.assign.tracks_load();
        self.served = verdict.forgive_strike;
        if answer == Answer::Unanswered {
            self.rt.counters.add(Counter::Unanswered, 1);
        }
        if let (true, Some(hash)) = (verdict.unpin_key, key) {
            self.unpin(hash, rank);
        }
        if verdict.cool_down && tracks_load {
            self.cool_down(rank);
        }
        if verdict.strike && tracks_load {
            self.strike(rank);
        }
        if verdict.forget_prefix {
            self.forget_prefix(rank);
        } else if verdict.record_prefix {
            self.keep_prefix(rank);
        } else {
            self.withdraw_prefix(rank);
        }
    }

    /// Takes a failed rank out of every assigner for `assign.cooldown_seconds` (all workers).
    fn cool_down(&self, rank: u32) {
        let rt = &self.rt;
        let seconds = rt.cfg.assign.cooldown_seconds;
        if seconds == 0 {
            return;
        }
        let now = rt.clock.now();
        let (started, events) =
            rt.board
                .mark_down(&SharedData, rank, now.saturating_add(seconds), now);
        rt.counters.add_board_events(events);
        if started {
            rt.counters.add(Counter::RankCooldown, 1);
            info!(
                "[{}] rank {rank} unreachable (no connection, no healthy host, or no cluster of its name); cooling down for {seconds}s",
                self.id
            );
        }
    }

    /// Counts one upstream error against `rank`; enough of them from different requests within
    /// the window cool it down.
    fn strike(&self, rank: u32) {
        let rt = &self.rt;
        rt.counters.add(Counter::RankErrors, 1);
        let rule = rt.cfg.assign.strike_rule();
        let (cooled, events) = rt.board.strike(&SharedData, rank, rt.clock.now(), rule);
        rt.counters.add_board_events(events);
        if cooled {
            rt.counters.add(Counter::RankCooldown, 1);
            info!(
                "[{}] rank {rank}: {} errors within {}s; cooling down for {}s",
                self.id, rule.threshold, rule.window_seconds, rule.cooldown_seconds
            );
        }
    }
}

fn fallback_counter(reason: Reason) -> Counter {
    match reason {
        Reason::BodyTooLarge => Counter::BodyTooLarge,
        Reason::BodyMalformed => Counter::BodyMalformed,
        Reason::NoKey => Counter::NoKey,
    }
}
