//! Fan-out: one pass of one subscription, in the worker's transaction.
//!
//! Lease (a transaction-scoped lock of `crate::lease`, as for sinks), read a window past the cursor with the read
//! rule, evaluate the filter on each event of the subscription's topics, write one job per match
//! (the event as its payload, the event's id as its key, so a job is never queued twice while
//! it waits), move the cursor past the whole window and count -- all in one transaction, so a
//! crash anywhere leaves either all of it or none.
//!
//! A subscription with a SQL handler runs its matches in the pass instead (`run_inline`), as its
//! job runner would (as its owner, a batch per subtransaction): the handler's writes commit with
//! the cursor move, so a job that ran at once is never written, read back, locked and deleted.
//! The matches of a batch that fails, or that the pass has no time left for, are written as
//! jobs, and the job runner (`dispatch::jobs`) retries them one by one as before.

use super::rows::{self, allocating_in, deformed_rows, event_array, Column, Row};
use super::PassResult;
use crate::cursor::{self, At, Batch};
use crate::plans;
use crate::transaction::refresh_snapshot;
use pg_outbox_core::filter::{EventContext, EventFields, Filter, Needs, Operand, Scalar};
use pg_outbox_core::pattern::Pattern;
use pg_outbox_core::Position;
use pgrx::datum::DatumWithOid;
use pgrx::memcxt::PgMemoryContexts;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Events read per window, for as many subscriptions as read it: a pass costs the same whatever
/// it reads (its leases, its statements, its commit), so a window for one subscription is larger,
/// up to `WINDOW_MAX`; for many it is `WINDOW`, and its evaluations (`WINDOW_EVALUATIONS`) take
/// about as long as one subscription's largest window.
const WINDOW: usize = 1000;
const WINDOW_MAX: usize = 8000;
const WINDOW_EVALUATIONS: usize = 8000;

/// The window for `subscriptions` reading it together.
fn window_for(subscriptions: usize) -> usize {
    (WINDOW_EVALUATIONS / subscriptions.max(1)).clamp(WINDOW, WINDOW_MAX)
}

thread_local! {
    /// Compiled filters of this process, by subscription, with the source they were compiled
    /// from: a subscription dropped and created again with another filter recompiles.
    static FILTERS: RefCell<HashMap<String, Rc<Filter>>> = RefCell::new(HashMap::new());
}

/// The compiled filter for `name`, from the cache when its source is unchanged.
fn compiled(name: &str, source: &str) -> Result<Rc<Filter>, String> {
    FILTERS.with(|cache| {
        let mut cache = cache.borrow_mut();
        if let Some(f) = cache.get(name).filter(|f| f.source() == source) {
            return Ok(Rc::clone(f));
        }
        // Subscribe refused filters that do not compile; one that does not now (a row written
        // by hand, another version of the CEL crate) stalls nothing: the pass reports it.
        let filter = Rc::new(Filter::compile(source).map_err(|e| e.to_string())?);
        if cache.len() >= 10_000 {
            cache.clear();
        }
        cache.insert(name.to_string(), Rc::clone(&filter));
        Ok(filter)
    })
}

struct Subscription {
    name: String,
    /// Its cursor: within `batch` when it reads by ticks and has started to.
    cursor: Position,
    batch: Option<Batch>,
    /// It reads by ticks (`read_by`).
    by_ticks: bool,
    /// Batches it moved on to in this pass ([`MAX_BATCHES`]).
    batches: usize,
    /// It moved on to a batch since its cursor was last saved.
    unsaved: bool,
    /// Topic patterns; None: every topic.
    topics: Option<Vec<Pattern>>,
    filter: Option<Result<Rc<Filter>, String>>,
    handler: Option<pg_sys::Oid>,
    queue: String,
    max_attempts: i32,
    verdicts: Verdicts,
    /// Time its filter took in this pass.
    spent: std::time::Duration,
    /// The last event it was evaluated on, once its filter used up its time for this pass: its
    /// cursor moves only that far, and the rest of the window waits for its next pass.
    stopped_at: Option<Position>,
    /// A subscription with a handler: its matches in this window, to run in this pass
    /// (`run_inline`) rather than be written as jobs. None: they are written as jobs.
    inline: Option<Vec<pg_sys::Datum>>,
    /// Matches its next handler call in this pass gets (`run_inline`): the pace its calls so far
    /// in this pass allow, so that a pass of several windows does not start each at the smallest.
    next_call: usize,
    /// Windows it read in this pass.
    windows: usize,
    /// Its rows are locked for this pass (`claim_rows`).
    claimed: bool,
    /// Its rows, or its queue for its matches, could not be held in this pass (another
    /// transaction is changing or dropping them): its cursor stays, and it reads the window again
    /// in a later pass.
    held_off: bool,
}

/// The time one subscription's filter may take in one pass. Every subscription at the same cursor
/// shares the pass: without this, a filter that runs to its per-event budget on every event held
/// the others for up to a thousand times that.
const PASS_FILTER_BUDGET: std::time::Duration = std::time::Duration::from_millis(500);

impl Subscription {
    /// The order subscriptions read in: those by the read horizon, then by batch, then by cursor.
    /// Those of one window share its frame: the horizon, or one batch.
    fn key(&self) -> (i64, &str, Position) {
        match &self.batch {
            None => (-1, "", self.cursor),
            Some(b) => (b.tick, b.since.as_str(), self.cursor),
        }
    }

    fn same_frame(&self, other: &Subscription) -> bool {
        self.batch == other.batch
    }

    fn at(&self, pos: Position) -> At {
        At {
            pos,
            batch: self.batch.clone(),
        }
    }

    fn wants_topic(&self, topic: &str) -> bool {
        self.topics
            .as_ref()
            .is_none_or(|patterns| patterns.iter().any(|p| p.matches(topic)))
    }
}

/// Takes the leases of the subscriptions it can (a transaction-scoped lock each, without
/// waiting) and reads them. Returns them, and whether another worker held one.
fn lease(client: &mut SpiClient<'_>, names: &[&str]) -> (Vec<Subscription>, bool) {
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut leased = Vec::new();
    let mut contended = false;
    for row in plans::select(
        client,
        "SELECT s.name, s.lease_key FROM outbox.subscriptions s \
          WHERE s.name OPERATOR(pg_catalog.=) ANY ($1) ORDER BY s.name",
        None,
        &[DatumWithOid::from(names)],
    )
    .expect("taking subscription leases")
    {
        let name: String = row.get(1).unwrap().expect("name");
        let key: i32 = row.get(2).unwrap().expect("lease_key is NOT NULL");
        if crate::lease::try_xact(crate::lease::Class::Subscription, key) {
            leased.push(name);
        } else {
            contended = true;
        }
    }
    if leased.is_empty() {
        return (Vec::new(), contended);
    }
    // The previous holders committed before they released their leases: see their cursors.
    refresh_snapshot();
    // A subscription queues jobs as its owner: one whose owner may no longer do so on its queue
    // (a grant or a role membership taken back since) is paused, saying why, not fanned out. One
    // whose row another transaction holds (its owner pausing or dropping it, say) is not waited
    // for: it is left out of this pass, and paused by a later one.
    let row = plans::update(
        client,
        "WITH denied AS ( \
             SELECT s.name FROM outbox.subscriptions s JOIN outbox.consumers c ON c.name = s.name \
              WHERE s.name = ANY ($1) AND NOT s.paused \
                AND NOT outbox._may(s.queue, c.owner, CASE WHEN s.handler IS NULL THEN 'enqueue' ELSE 'own' END)), \
         held AS ( \
             SELECT s.name FROM outbox.subscriptions s WHERE s.name IN (SELECT d.name FROM denied d) \
                FOR NO KEY UPDATE OF s SKIP LOCKED), \
         paused AS ( \
             UPDATE outbox.subscriptions s SET paused = true, \
                    last_predicate_error = pg_catalog.format( \
                        'paused: its owner %s may no longer queue jobs on queue \"%s\"; grant that back, then resume it', \
                        c.owner::pg_catalog.regrole, s.queue), \
                    last_predicate_error_at = pg_catalog.now() \
               FROM held h, outbox.consumers c \
              WHERE s.name = h.name AND c.name = s.name \
             RETURNING s.last_predicate_error) \
         SELECT (SELECT pg_catalog.array_agg(d.name) FROM denied d), \
                (SELECT pg_catalog.array_agg(p.last_predicate_error) FROM paused p)",
        None,
        &[DatumWithOid::from(leased.clone())],
    )
    .expect("checking the subscriptions' queues");
    let row = row.first();
    let denied: Vec<String> = row.get(1).expect("denied").unwrap_or_default();
    let paused: Vec<String> = row.get(2).expect("paused").unwrap_or_default();
    for r in &paused {
        pgrx::warning!("pg_outbox: a subscription was {r}");
    }
    if denied.len() > paused.len() {
        contended = true;
    }
    leased.retain(|name| !denied.contains(name));
    if leased.is_empty() {
        return (Vec::new(), contended);
    }
    let mut subs = Vec::new();
    for r in plans::select(
        client,
        "SELECT s.name, c.txid::text, c.seq, s.topics, s.filter, s.handler::pg_catalog.oid, s.queue, s.max_attempts, \
                c.read_by OPERATOR(pg_catalog.=) 'ticks', c.tick, c.since::pg_catalog.text, c.upto::pg_catalog.text \
           FROM outbox.subscriptions s JOIN outbox.consumers c ON c.name = s.name \
          WHERE s.name = ANY ($1) AND NOT s.paused ORDER BY s.name",
        None,
        &[DatumWithOid::from(leased)],
    )
    .expect("reading subscriptions")
    {
        let name: String = r.get(1).unwrap().expect("name");
        let txid: String = r.get(2).unwrap().expect("cursor txid");
        let topics = r.get::<Vec<Option<String>>>(4).unwrap().map(|patterns| {
            patterns
                .into_iter()
                .flatten()
                .filter_map(|p| Pattern::parse(&p).ok())
                .collect()
        });
        let filter = r
            .get::<String>(5)
            .unwrap()
            .map(|source| compiled(&name, &source));
        let batch = match (r.get::<i64>(10).unwrap(), r.get(11).unwrap(), r.get(12).unwrap()) {
            (Some(tick), Some(since), Some(upto)) => Some(Batch { tick, since, upto }),
            _ => None,
        };
        subs.push(Subscription {
            cursor: Position::new(txid.parse().expect("xid8"), r.get(3).unwrap().expect("seq")),
            batch,
            by_ticks: r.get(9).unwrap().expect("read_by is NOT NULL"),
            batches: 0,
            unsaved: false,
            topics,
            filter,
            handler: r.get(6).unwrap(),
            queue: r.get(7).unwrap().expect("queue"),
            max_attempts: r.get(8).unwrap().expect("max_attempts"),
            name,
            verdicts: Verdicts::default(),
            spent: std::time::Duration::ZERO,
            stopped_at: None,
            inline: None,
            next_call: INLINE_FIRST,
            windows: 0,
            claimed: false,
            held_off: false,
        });
    }
    for sub in subs.iter_mut() {
        if sub.handler.is_some() && crate::worker::runs_inline(&sub.name) {
            sub.inline = Some(Vec::new());
        }
    }
    (subs, contended)
}

/// The window: the next events after a cursor, at most $3, with the log's columns as they are
/// (`Column`): values stored out of line stay so, and the byte cap is applied while reading them
/// (`fan_out`); an event is made an outbox.event only once a filter matched it, and its payload
/// and headers are read for filters only then too (`EventReader`). As text only raised_at, when
/// a filter reads it ($4).
const WINDOW_SQL: rows::WindowSql = {
    use rows::{from_both_parts, from_horizon, from_range, window_sql};
    macro_rules! raised_at_text {
        () => {
            "CASE WHEN $4 THEN pg_catalog.to_char(r.raised_at AT TIME ZONE 'UTC', \
                                                  'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') END"
        };
    }
    rows::WindowSql {
        horizon: window_sql!(raised_at_text!(), from_horizon!()),
        range: window_sql!(raised_at_text!(), from_range!()),
        both_parts: window_sql!(raised_at_text!(), from_both_parts!()),
    }
};

thread_local! {
    /// The most events the next window reads, after a window the byte cap cut short: about
    /// twice what that one held (growing back by doubling), so that large events are not read
    /// by the thousand to keep a few. None: the window's size.
    static NEXT_LIMIT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Writes one job per (subscription, event) pair the filters matched: the event (of the window's
/// rows, $5) as the payload, `<subscription>:<event id>` as the key. Two subscriptions feeding one
/// queue each get their job. Keys given to `enqueue` live apart (index `jobs_waiting_key`): they
/// cannot hide an event.
macro_rules! insert_jobs_sql {
    () => {
        "INSERT INTO outbox.jobs (queue, payload, key, event, subscription, handler, max_attempts) \
         SELECT m.queue, \
                pg_catalog.to_jsonb(ROW(m.id, m.position, m.topic, m.subject, m.tenant, m.payload, \
                                        m.headers, m.raised_at)::outbox.event), \
                m.sub || ':' || m.id::text, m.id, m.sub, m.handler::pg_catalog.regprocedure, m.max_attempts \
           FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::text[]), \
                           pg_catalog.unnest($3::pg_catalog.oid[]), pg_catalog.unnest($4::int4[]), \
                           pg_catalog.unnest($5::outbox.event[])) WITH ORDINALITY \
                AS m(sub, queue, handler, max_attempts, id, position, topic, subject, tenant, payload, \
                     headers, raised_at, n) \
          ORDER BY m.n"
    };
}
const INSERT_SQL: &str = insert_jobs_sql!();

/// INSERT_SQL where a (subscription, event) whose job still waits (a rewound cursor, say) is not
/// queued twice. Run only once INSERT_SQL met one (`write_jobs`): the speculative insertion
/// that ON CONFLICT makes of every row cost a quarter of a job's write.
const INSERT_SKIPPING_WAITING_SQL: &str = concat!(
    insert_jobs_sql!(),
    " ON CONFLICT (queue, subscription, event) WHERE subscription IS NOT NULL AND state = 'waiting' DO NOTHING"
);

/// What a filter made of a window.
#[derive(Default)]
struct Verdicts {
    matches: i64,
    skipped: i64,
    errors: i64,
    last_error: Option<String>,
}

/// One fan-out pass over the subscriptions `names` that this worker can lease. Runs inside the
/// worker's transaction. Subscriptions read the log together: a window is read from the lowest
/// cursor, and every subscription whose cursor falls inside it takes its events from that one
/// read (and one conversion of each event); each filter then runs on the events past its own
/// cursor. Subscriptions created or resumed at different times so end the pass at one position,
/// and read together from then on. Also says whether a subscription was held off (its queue is
/// being dropped): the worker should look again soon, as when another worker holds a lease.
pub fn pass(names: &[&str]) -> (PassResult, bool) {
    if names.is_empty() || !super::lock_tables() {
        return (PassResult::Skipped, false);
    }
    // Tenants' filters run here: SIGTERM ends the worker at once, as inside a handler.
    let _tenant_code = crate::worker::TenantCode::enter();
    Spi::connect_mut(|client| {
        let (mut subs, contended) = lease(client, names);
        if subs.is_empty() {
            return if contended {
                (PassResult::Contended, false)
            } else {
                (PassResult::Skipped, false)
            };
        }
        // Those done with this pass; saved at the end if they moved on to a batch unsaved.
        let mut finished: Vec<Subscription> = Vec::new();
        let mut held_off = false;
        // A subscription that reads by ticks and is not in a batch yet (new, or rewound) starts
        // one when a tick allows (as a sink does, dispatch::first_batch), saved at once.
        let starting: Vec<&mut Subscription> = subs
            .iter_mut()
            .filter(|s| s.by_ticks && s.batch.is_none())
            .collect();
        if !starting.is_empty() {
            claim_rows(client, starting);
            for sub in subs
                .iter_mut()
                .filter(|s| s.by_ticks && s.batch.is_none() && s.claimed)
            {
                if let Some(at) = super::first_batch(client, &At::horizon(sub.cursor))
                    .unwrap_or_else(|e| panic!("subscription \"{}\": {e}", sub.name))
                {
                    cursor::save_at(&sub.name, &at);
                    sub.batch = at.batch;
                }
            }
            for sub in std::mem::take(&mut subs) {
                if sub.held_off {
                    held_off = true;
                    finished.push(sub);
                } else {
                    subs.push(sub);
                }
            }
        }
        // By frame and cursor (stable: by name within one cursor).
        subs.sort_by(|a, b| a.key().cmp(&b.key()));
        let (mut matched, mut full) = (0usize, false);
        let mut any = false;
        let mut budget = InlineBudget {
            calls: INLINE_CALLS,
            time: INLINE_BUDGET,
            inserts: PLAIN_INSERTS,
        };
        let started = std::time::Instant::now();
        while !subs.is_empty() {
            let Some((m, f, group)) = fan_out(client, &mut subs, &mut budget) else {
                // Nothing readable after the lowest cursor of the first frame: nothing after the
                // others of that frame either. Those in a batch go on to the next one.
                let frame = subs.iter().take_while(|s| s.same_frame(&subs[0])).count();
                for sub in subs.drain(..frame).collect::<Vec<_>>() {
                    let (moved, more) = next_batch(client, sub, &mut subs, &mut finished, started);
                    any |= moved;
                    full |= more;
                }
                continue;
            };
            any = true;
            matched += m;
            // Subscriptions behind others not read yet in this pass read on, up to a few
            // windows, so that they join those: staggered cursors (subscriptions resumed one
            // after another, say) would otherwise each cost a window read per pass for good.
            let behind_others = subs.iter().any(|s| s.windows == 0);
            for sub in group {
                if sub.held_off {
                    held_off = true;
                    finished.push(sub);
                } else if f
                    && behind_others
                    && sub.windows < CATCH_UP_WINDOWS
                    && sub.stopped_at.is_none()
                {
                    insert_by_key(&mut subs, sub);
                } else if f
                    && sub.inline.is_some()
                    && sub.stopped_at.is_none()
                    && budget.more_windows(&sub, started)
                {
                    // A handler subscription with more to read reads on while the pass has the
                    // calls and time for its handler: one commit for several windows.
                    insert_by_key(&mut subs, sub);
                } else if !f && sub.batch.is_some() && sub.stopped_at.is_none() {
                    // At the end of its batch: on to the next, in this pass.
                    full |= next_batch(client, sub, &mut subs, &mut finished, started).1;
                } else {
                    full |= f;
                    finished.push(sub);
                }
            }
        }
        claim_rows(client, finished.iter_mut().filter(|s| s.unsaved).collect());
        for sub in finished.iter().filter(|s| s.unsaved && s.claimed) {
            cursor::save_at(&sub.name, &sub.at(sub.cursor));
        }
        if !any {
            return if contended {
                (PassResult::Contended, false)
            } else {
                (PassResult::Idle, false)
            };
        }
        let result = PassResult::Delivered {
            events: matched,
            full,
        };
        (result, held_off)
    })
}

/// Batches one subscription may move through in one pass: a backlog of many small batches goes in
/// one pass (a few of them), not a batch a pass; and no later than `BATCHES_TIME` into the pass
/// (once it wrote a job, the pass's transaction holds an xid, which holds back the readers by the
/// read horizon).
const MAX_BATCHES: usize = 64;
const BATCHES_TIME: std::time::Duration = std::time::Duration::from_millis(200);

/// Puts `sub` in the order `subs` reads in.
fn insert_by_key(subs: &mut Vec<Subscription>, sub: Subscription) {
    let at = subs.partition_point(|s| s.key() <= sub.key());
    subs.insert(at, sub);
}

/// Moves `sub`, at the end of its batch, on to the next batch if a tick after its own is taken
/// and it may move on in this pass (back into `subs`); else it is done with this pass
/// (`finished`). Returns whether it moved, and whether it has more to read than this pass reads.
fn next_batch(
    client: &SpiClient<'_>,
    mut sub: Subscription,
    subs: &mut Vec<Subscription>,
    finished: &mut Vec<Subscription>,
    started: std::time::Instant,
) -> (bool, bool) {
    let next = super::next_batch(client, &sub.at(sub.cursor))
        .unwrap_or_else(|e| panic!("subscription \"{}\": {e}", sub.name));
    match next {
        Some(at) if sub.batches < MAX_BATCHES && started.elapsed() < BATCHES_TIME => {
            sub.cursor = at.pos;
            sub.batch = at.batch;
            sub.batches += 1;
            sub.unsaved = true;
            insert_by_key(subs, sub);
            (true, false)
        }
        more => {
            finished.push(sub);
            (false, more.is_some())
        }
    }
}

/// Reads one window after the lowest cursor of `waiting` (sorted by [`Subscription::key`]) and
/// fans it out to the subscriptions of its frame whose cursors fall inside it, taking them out of `waiting`: evaluates each
/// event past a subscription's cursor, writes the jobs, moves the cursors, counts. None when there
/// is nothing to read.
fn fan_out(
    client: &mut SpiClient<'_>,
    waiting: &mut Vec<Subscription>,
    budget: &mut InlineBudget,
) -> Option<(usize, bool, Vec<Subscription>)> {
    // What the filters read whole, as text; any subscription of `waiting` may join this window.
    let read = Reads::of(waiting);
    // A handler's matches run in the pass, within its time and subtransactions (`run_inline`):
    // its window stays at what those can take.
    let window = if waiting.iter().any(|s| s.inline.is_some()) {
        WINDOW
    } else {
        window_for(waiting.len())
    };
    let window = NEXT_LIMIT.get().map_or(window, |limit| limit.min(window));
    rows_of_window(
        client,
        waiting[0].cursor,
        waiting[0].batch.as_ref(),
        window,
        &read,
    );
    let (rows, table) = deformed_rows();
    // The matches as outbox.event datums, and the arrays made of them: freed with the window.
    let window_cx = PgMemoryContexts::new("pg_outbox fan-out window");
    // What filters read of one event: freed after each.
    let event_cx = PgMemoryContexts::new("pg_outbox fan-out event");
    let end = rows::within_bytes(&rows);
    let full = end < rows.len() || rows.len() >= window;
    NEXT_LIMIT.set(if end < rows.len() {
        Some((2 * end).max(16))
    } else if rows.len() >= window {
        NEXT_LIMIT
            .get()
            .map(|limit| 2 * limit)
            .filter(|&limit| limit < WINDOW_MAX)
    } else {
        None
    });
    let Some(last) = end.checked_sub(1).map(|i| rows[i].position()) else {
        drop(rows);
        // SAFETY: nothing read from the (empty) window is kept.
        unsafe { pg_sys::SPI_freetuptable(table) };
        return None;
    };
    let inside = waiting
        .iter()
        .take_while(|s| s.same_frame(&waiting[0]) && s.cursor < last)
        .count();
    let mut group: Vec<Subscription> = waiting.drain(..inside).collect();
    let reads = Reads::of(&group);
    let mut tupdesc: Option<pg_sys::TupleDesc> = None;
    let mut event_type = pg_sys::InvalidOid;
    // The matches, as parallel arrays for INSERT_SQL, in the order of the window (then of the
    // group, which is by cursor, then name); the events are outbox.event datums.
    let (mut subs, mut queues, mut handlers, mut attempts, mut events) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for row in &rows[..end] {
        // Cancel and terminate are answered between events, and within an evaluation through the
        // filter budget's interrupt probe (set in worker::run).
        pg_sys::check_for_interrupts!();
        let position = row.position();
        let topic = row.text(Column::Topic).expect("topic");
        // Converted once, for every filter that looks at this event, and only if one does.
        let mut reader = EventReader::new(row, topic, &reads, event_cx.value());
        // Made an outbox.event once, for every subscription that matched it.
        let mut event: Option<pg_sys::Datum> = None;
        for (sub, class) in group.iter_mut().zip(&reads.class_of) {
            if position <= sub.cursor || sub.stopped_at.is_some() || !sub.wants_topic(topic) {
                continue;
            }
            let verdict = match &sub.filter {
                None => Ok(true),
                Some(Err(e)) => Err(e.clone()),
                // Decided natively when it can be (no context built, bounded work: no time
                // counted), else by CEL.
                Some(Ok(filter)) => match reader.native_verdict(filter) {
                    Some(verdict) => Ok(verdict),
                    None => {
                        let context = reader.context(class.expect("a filter has a class"));
                        let started = std::time::Instant::now();
                        let verdict = filter.matches_in(context);
                        if pg_outbox_core::budget::interrupted() {
                            pg_sys::check_for_interrupts!();
                        }
                        sub.spent += started.elapsed();
                        if sub.spent > PASS_FILTER_BUDGET {
                            sub.stopped_at = Some(position);
                        }
                        verdict
                    }
                },
            };
            match verdict {
                Ok(true) => {
                    sub.verdicts.matches += 1;
                    let event = *event.get_or_insert_with(|| {
                        event_type = pg_sys::Oid::from(
                            row.get(Column::EventType).expect("outbox.event").value() as u32,
                        );
                        let tupdesc = *tupdesc.get_or_insert_with(|| {
                            // SAFETY: outbox.event is a composite type; the copy lives in the
                            // current memory context, as long as the datums made with it.
                            unsafe { pg_sys::lookup_rowtype_tupdesc_copy(event_type, -1) }
                        });
                        allocating_in(window_cx.value(), || row.event(tupdesc))
                    });
                    if let Some(inline) = sub.inline.as_mut() {
                        inline.push(event);
                        continue;
                    }
                    subs.push(sub.name.clone());
                    queues.push(sub.queue.clone());
                    handlers.push(sub.handler);
                    attempts.push(sub.max_attempts);
                    events.push(event);
                }
                Ok(false) => sub.verdicts.skipped += 1,
                Err(e) => {
                    sub.verdicts.errors += 1;
                    sub.verdicts.last_error = Some(format!("event {position}: {e}"));
                }
            }
        }
        drop(reader);
        // SAFETY: nothing made in it outlives the event (the contexts hold Rust values only).
        unsafe { pg_sys::MemoryContextReset(event_cx.value()) };
    }
    // Before anything is written or a handler runs: the subscriptions' rows (`claim_rows`: their
    // cursors and counts are written below) and the queues of their matches (`hold_queues`) are
    // held until the pass commits. Taken now, not before the filters ran, so that the pass takes
    // its transaction id as late as it can. A subscription whose rows or queue cannot be held is
    // held off: its matches are dropped, and its cursor stays.
    claim_rows(client, group.iter_mut().collect());
    let wanted: std::collections::BTreeSet<&str> = group
        .iter()
        .filter(|s| s.verdicts.matches > 0 && !s.held_off)
        .map(|s| s.queue.as_str())
        .collect();
    let held = if wanted.is_empty() {
        Default::default()
    } else {
        hold_queues(client, wanted.into_iter().map(String::from).collect())
    };
    for sub in group.iter_mut() {
        if sub.verdicts.matches > 0 && !held.contains(&sub.queue) {
            sub.held_off = true;
        }
        if sub.held_off {
            sub.inline = None;
            sub.verdicts = Verdicts::default();
        }
    }
    let kept_off: std::collections::BTreeSet<&str> = group
        .iter()
        .filter(|s| s.held_off)
        .map(|s| s.name.as_str())
        .collect();
    if subs.iter().any(|name| kept_off.contains(name.as_str())) {
        let keep: Vec<bool> = subs
            .iter()
            .map(|n| !kept_off.contains(n.as_str()))
            .collect();
        retain_kept(&mut subs, &keep);
        retain_kept(&mut queues, &keep);
        retain_kept(&mut handlers, &keep);
        retain_kept(&mut attempts, &keep);
        retain_kept(&mut events, &keep);
    }
    // A handler subscription's matches run now, in this transaction; what did not (a call that
    // failed, the pass's time for them used up) is written as jobs like any other match.
    for sub in group.iter_mut() {
        let Some(inline) = sub.inline.take() else {
            continue;
        };
        let ran = run_inline(client, sub, &inline, event_type, budget, window_cx.value());
        for event in inline.into_iter().skip(ran) {
            subs.push(sub.name.clone());
            queues.push(sub.queue.clone());
            handlers.push(sub.handler);
            attempts.push(sub.max_attempts);
            events.push(event);
        }
    }
    let matched = group.iter().map(|s| s.verdicts.matches as usize).sum();
    if !subs.is_empty() {
        // External workers of the queues that get jobs to claim are woken once this commits.
        let announced: std::collections::BTreeSet<&str> = group
            .iter()
            .filter(|s| s.handler.is_none() && s.verdicts.matches > 0)
            .map(|s| s.queue.as_str())
            .collect();
        for queue in announced {
            crate::worker::announce_at_commit(queue, None);
        }
        // SAFETY: an outbox.event[] built in this SPI connection, still alive.
        let events = unsafe {
            DatumWithOid::new(
                allocating_in(window_cx.value(), || event_array(&events, event_type)),
                pg_sys::get_array_type(event_type),
            )
        };
        let args = [
            DatumWithOid::from(subs),
            DatumWithOid::from(queues),
            DatumWithOid::from(handlers),
            DatumWithOid::from(attempts),
            events,
        ];
        write_jobs(client, &args, budget);
    }
    let mut stopped = false;
    for sub in group.iter_mut() {
        if sub.held_off {
            continue;
        }
        if sub.stopped_at.is_some() {
            stopped = true;
        }
        cursor::save_at(&sub.name, &sub.at(sub.stopped_at.unwrap_or(last)));
        sub.unsaved = false;
        if let Some(e) = &sub.verdicts.last_error {
            pgrx::warning!(
                "pg_outbox: the filter of subscription \"{}\" failed on {} event(s), counted as false; last: {e}",
                sub.name,
                sub.verdicts.errors
            );
        }
    }
    let counted: Vec<&Subscription> = group.iter().filter(|s| !s.held_off).collect();
    plans::update(
            client,
            "UPDATE outbox.subscriptions s SET matched = s.matched + v.matched, skipped = s.skipped + v.skipped, \
                    predicate_errors = s.predicate_errors + v.errors, \
                    last_predicate_error = coalesce(v.last_error, s.last_predicate_error), \
                    last_predicate_error_at = CASE WHEN v.last_error IS NULL THEN s.last_predicate_error_at \
                                                   ELSE pg_catalog.now() END, \
                    last_fanout_at = pg_catalog.now() \
               FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::int8[]), \
                               pg_catalog.unnest($3::int8[]), pg_catalog.unnest($4::int8[]), \
                               pg_catalog.unnest($5::text[])) \
                    AS v(name, matched, skipped, errors, last_error) \
              WHERE s.name = v.name",
            None,
            &[
                DatumWithOid::from(counted.iter().map(|s| s.name.clone()).collect::<Vec<_>>()),
                DatumWithOid::from(counted.iter().map(|s| s.verdicts.matches).collect::<Vec<_>>()),
                DatumWithOid::from(counted.iter().map(|s| s.verdicts.skipped).collect::<Vec<_>>()),
                DatumWithOid::from(counted.iter().map(|s| s.verdicts.errors).collect::<Vec<_>>()),
                DatumWithOid::from(
                    counted
                        .iter()
                        .map(|s| s.verdicts.last_error.clone())
                        .collect::<Vec<_>>(),
                ),
            ],
        )
        .expect("counting fan-out");
    drop(rows);
    // SAFETY: the window's rows are no longer used (the matches are copies, in window_cx).
    unsafe { pg_sys::SPI_freetuptable(table) };
    // Ready for another window in this pass: at its new cursor, its verdicts counted.
    for sub in group.iter_mut() {
        if !sub.held_off {
            sub.cursor = sub.stopped_at.unwrap_or(last);
        }
        sub.windows += 1;
        sub.verdicts = Verdicts::default();
        if sub.handler.is_some() && crate::worker::runs_inline(&sub.name) {
            sub.inline = Some(Vec::new());
        }
    }
    // A subscription stopped short, or a window cut short, has more to read: come back at once.
    Some((matched, stopped || full, group))
}

/// The windows a subscription behind others may read in one pass to join them (`pass`).
const CATCH_UP_WINDOWS: usize = 4;

/// Writes the jobs of INSERT_SQL's `args`. A job of the same (subscription, event) still waiting
/// makes the INSERT fail on index `jobs_waiting_event` (the only unique index a fan-out job can
/// meet): it is tried in a subtransaction, and on that failure again skipping those. A pass out
/// of such tries (`InlineBudget::inserts`) skips them at once.
fn write_jobs(client: &mut SpiClient<'_>, args: &[DatumWithOid<'_>], budget: &mut InlineBudget) {
    if budget.inserts > 0 {
        budget.inserts -= 1;
        let plain = crate::transaction::in_subtransaction(|| {
            plans::update(client, INSERT_SQL, None, args).unwrap_or_else(|e| panic!("{e}"));
        });
        match plain {
            Ok(()) => return,
            Err(failure) if failure.sqlstate == "23505" => {}
            Err(failure) => panic!("writing jobs: {failure}"),
        }
    }
    plans::update(client, INSERT_SKIPPING_WAITING_SQL, None, args).expect("writing jobs");
}

/// Locks the rows of `subs` that are not locked yet in this pass (their cursors and their counts,
/// which the pass is about to write), or holds them off: a tenant's transaction that unsubscribes,
/// pauses or alters a subscription holds its rows for as long as it stays open, and the worker's
/// pass must not wait on it (SKIP LOCKED). Only once the pass writes: one with nothing to read
/// writes nothing, and takes no transaction id.
fn claim_rows(client: &mut SpiClient<'_>, subs: Vec<&mut Subscription>) {
    let wanted: Vec<&mut Subscription> = subs
        .into_iter()
        .filter(|s| !s.claimed && !s.held_off)
        .collect();
    if wanted.is_empty() {
        return;
    }
    let got = locked(
        client,
        "SELECT c.name FROM outbox.consumers c JOIN outbox.subscriptions s \
             ON s.name OPERATOR(pg_catalog.=) c.name \
          WHERE c.name OPERATOR(pg_catalog.=) ANY ($1) FOR NO KEY UPDATE OF c, s SKIP LOCKED",
        wanted.iter().map(|s| s.name.clone()).collect(),
    )
    .unwrap_or_else(|e| panic!("locking the subscriptions' cursors: {e}"));
    for sub in wanted {
        if got.contains(&sub.name) {
            sub.claimed = true;
        } else {
            sub.held_off = true;
        }
    }
}

/// Keeps the items of `v` whose `keep` is true.
fn retain_kept<T>(v: &mut Vec<T>, keep: &[bool]) {
    let mut at = keep.iter();
    v.retain(|_| *at.next().expect("a flag per item"));
}

/// Holds those of `queues` that exist until the pass commits, and returns them: FOR KEY SHARE,
/// as `outbox._hold_queues` does on the other paths that queue jobs (drop_queue takes its queue
/// FOR UPDATE before it deletes the queue's jobs, so no job outlives its queue). In this
/// transaction, not in write_jobs' subtransaction, whose rollback would let go. Not waited for:
/// a queue whose row is locked is being dropped by a tenant's transaction, which may stay open
/// as long as its role likes, and the worker's pass must not wait on it (SKIP LOCKED leaves it
/// out, as it leaves out one that is gone).
fn hold_queues(
    client: &mut SpiClient<'_>,
    queues: Vec<String>,
) -> std::collections::BTreeSet<String> {
    locked(
        client,
        "SELECT q.name FROM outbox.queues q WHERE q.name OPERATOR(pg_catalog.=) ANY ($1) \
            FOR KEY SHARE OF q SKIP LOCKED",
        queues,
    )
    .unwrap_or_else(|e| panic!("holding the queues of the jobs: {e}"))
}

/// The names `sql` (a kept statement that locks rows of `names`, SKIP LOCKED, and returns their
/// names) could lock: those it left out are held by another transaction, or gone.
fn locked(
    client: &mut SpiClient<'_>,
    sql: &str,
    names: Vec<String>,
) -> pgrx::spi::SpiResult<std::collections::BTreeSet<String>> {
    plans::update(client, sql, None, &[DatumWithOid::from(names)])?
        .map(|row| row.get::<String>(1).map(|name| name.expect("a name")))
        .collect()
}

/// Runs WINDOW_SQL after `cursor` (within `batch`), with the text columns `reads` asks for; its
/// rows are then SPI's last result (`deformed_rows`).
fn rows_of_window(
    client: &mut SpiClient<'_>,
    cursor: Position,
    batch: Option<&Batch>,
    window: usize,
    reads: &Reads,
) {
    let after = At {
        pos: cursor,
        batch: batch.cloned(),
    };
    rows::select_window(
        client,
        &WINDOW_SQL,
        &after,
        window,
        DatumWithOid::from(reads.uses("raised_at")),
    )
    .expect("reading a fan-out window");
}

/// What the filters of a window read of each event: each filter's share (filters that read the
/// same share one context per event), and together what the window's text columns and the
/// fields read from the binary values must hold. A filter's verdict so depends on what it reads
/// alone, never on which other filters share its window.
struct Reads {
    /// The distinct needs of the filters.
    classes: Vec<Needs>,
    /// Each subscription's class (in the order given), None without a filter.
    class_of: Vec<Option<usize>>,
    /// The fields of payload and of headers some class selects by name.
    payload_keys: Vec<String>,
    headers_keys: Vec<String>,
}

impl Reads {
    fn of(subs: &[Subscription]) -> Reads {
        let mut reads = Reads {
            classes: Vec::new(),
            class_of: Vec::new(),
            payload_keys: Vec::new(),
            headers_keys: Vec::new(),
        };
        for sub in subs {
            let class = sub.filter.as_ref().and_then(|f| f.as_ref().ok()).map(|f| {
                let needs = Needs::of([f.as_ref()]);
                match reads.classes.iter().position(|c| *c == needs) {
                    Some(i) => i,
                    None => {
                        reads.classes.push(needs);
                        reads.classes.len() - 1
                    }
                }
            });
            reads.class_of.push(class);
        }
        for class in &reads.classes {
            reads
                .payload_keys
                .extend(class.payload_fields().into_iter().flatten().cloned());
            reads
                .headers_keys
                .extend(class.headers_fields().into_iter().flatten().cloned());
        }
        for keys in [&mut reads.payload_keys, &mut reads.headers_keys] {
            keys.sort_unstable();
            keys.dedup();
        }
        reads
    }

    fn uses(&self, variable: &str) -> bool {
        self.classes.iter().any(|c| c.uses(variable))
    }
}

/// One event as the filters read it: its JSON read once (the fields some filter selects, the
/// whole values some filter reads), a context built once per class of filters.
struct EventReader<'w> {
    row: &'w Row,
    topic: &'w str,
    reads: &'w Reads,
    payload_fields: Option<crate::raw::Fields>,
    headers_fields: Option<crate::raw::Fields>,
    payload_whole: Option<Result<serde_json::Value, String>>,
    headers_whole: Option<Result<serde_json::Value, String>>,
    /// The fields of `Reads::payload_keys` (and `headers_keys`) as native filters read them,
    /// borrowing the values detoasted into `cx`: they never leave the reader, which is dropped
    /// before `cx` is reset.
    payload_scalars: Option<Vec<Scalar<'w>>>,
    headers_scalars: Option<Vec<Scalar<'w>>>,
    /// Built on first use (most windows' filters never need one).
    contexts: Vec<Option<EventContext<'static>>>,
    /// Where what PostgreSQL makes of the event's values goes (detoasted copies, printed text).
    cx: pg_sys::MemoryContext,
}

impl<'w> EventReader<'w> {
    fn new(row: &'w Row, topic: &'w str, reads: &'w Reads, cx: pg_sys::MemoryContext) -> Self {
        EventReader {
            cx,
            row,
            topic,
            reads,
            payload_fields: None,
            headers_fields: None,
            payload_whole: None,
            headers_whole: None,
            payload_scalars: None,
            headers_scalars: None,
            contexts: Vec::new(),
        }
    }

    /// The verdict of `filter`'s native evaluator on this event, when it gives one (then it is
    /// the verdict CEL would give: `pg_outbox_core::filter::native`).
    fn native_verdict(&mut self, filter: &Filter) -> Option<bool> {
        if !filter.is_native() {
            return None;
        }
        filter.native_verdict(&mut |o| self.scalar(o))
    }

    /// A field of the event as a native filter reads it.
    fn scalar(&mut self, o: &Operand) -> Scalar<'w> {
        let row = self.row;
        let text = |s: Option<&'w str>| s.map_or(Scalar::Null, Scalar::string);
        match o {
            Operand::Topic => Scalar::string(self.topic),
            Operand::Subject => text(allocating_in(self.cx, || row.text(Column::Subject))),
            Operand::Tenant => text(allocating_in(self.cx, || row.text(Column::Tenant))),
            Operand::RaisedAt => Scalar::string(row.text(Column::Extra).unwrap_or_default()),
            Operand::Payload(key) => self.field(true, key),
            Operand::Headers(key) => self.field(false, key),
        }
    }

    /// A top-level field of payload (or headers), of the ones some filter of the window selects.
    fn field(&mut self, payload: bool, key: &str) -> Scalar<'w> {
        let (keys, column, cache) = if payload {
            (
                &self.reads.payload_keys,
                Column::Payload,
                &mut self.payload_scalars,
            )
        } else {
            (
                &self.reads.headers_keys,
                Column::Headers,
                &mut self.headers_scalars,
            )
        };
        let (row, cx) = (self.row, self.cx);
        let scalars = cache.get_or_insert_with(|| {
            let mut scalars = Vec::with_capacity(keys.len());
            match row.get(column) {
                None => scalars.extend(keys.iter().map(|_| Scalar::Other)),
                // SAFETY: detoasted into `cx`, which outlives the reader (see payload_scalars).
                Some(d) => allocating_in(cx, || unsafe {
                    crate::raw::RawJsonb(d).scalars(keys, &mut scalars)
                }),
            }
            scalars
        });
        // A native filter's fields are among the keys (`Filter::compile`); were one not, CEL
        // would decide, rather than the pass fail.
        keys.binary_search_by(|k| k.as_str().cmp(key))
            .map_or(Scalar::Other, |i| scalars[i])
    }

    /// The context of filters of class `class`.
    fn context(&mut self, class: usize) -> &EventContext<'static> {
        if self.contexts.is_empty() {
            self.contexts.resize_with(self.reads.classes.len(), || None);
        }
        if self.contexts[class].is_none() {
            let needs = &self.reads.classes[class];
            let (payload, headers) = allocating_in(self.cx, || {
                (self.json(true, needs), self.json(false, needs))
            });
            let unreadable = payload.as_ref().err().or(headers.as_ref().err());
            let (subject, tenant) = allocating_in(self.cx, || {
                (
                    self.row.text(Column::Subject),
                    self.row.text(Column::Tenant),
                )
            });
            let fields = EventFields {
                topic: self.topic,
                subject,
                tenant,
                payload: payload.as_ref().unwrap_or(&serde_json::Value::Null),
                headers: headers.as_ref().unwrap_or(&serde_json::Value::Null),
                raised_at: self.row.text(Column::Extra).unwrap_or_default(),
            };
            self.contexts[class] = Some(match unreadable {
                // Never handed over as null: a filter that reads it fails instead.
                Some(why) => EventContext::unreadable(&fields, needs, why.clone()),
                None => EventContext::for_needs(&fields, needs),
            });
        }
        self.contexts[class].as_ref().expect("built above")
    }

    /// Payload (or headers) as `needs` reads it: the fields it selects, or the whole value.
    fn json(&mut self, payload: bool, needs: &Needs) -> Result<serde_json::Value, String> {
        let (variable, binary, selected, keys, fields, whole) = if payload {
            (
                "payload",
                Column::Payload,
                needs.payload_fields(),
                &self.reads.payload_keys,
                &mut self.payload_fields,
                &mut self.payload_whole,
            )
        } else {
            (
                "headers",
                Column::Headers,
                needs.headers_fields(),
                &self.reads.headers_keys,
                &mut self.headers_fields,
                &mut self.headers_whole,
            )
        };
        if !needs.uses(variable) {
            return Ok(serde_json::Value::Null);
        }
        let row = self.row;
        let read = match selected {
            Some(selected) => {
                let all = fields.get_or_insert_with(|| match row.get(binary) {
                    None => crate::raw::Fields::NotAnObject(Ok(serde_json::Value::Null)),
                    Some(d) => crate::raw::RawJsonb(d).fields(keys),
                });
                match all {
                    crate::raw::Fields::NotAnObject(v) => v.clone(),
                    crate::raw::Fields::Of(all) => selected
                        .iter()
                        .filter_map(|key| all.iter().find(|(k, _)| k == key))
                        .map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
                        .collect::<Result<serde_json::Map<_, _>, _>>()
                        .map(serde_json::Value::Object),
                }
            }
            None => whole
                .get_or_insert_with(|| {
                    row.get(binary).map_or(Ok(serde_json::Value::Null), |d| {
                        crate::raw::RawJsonb(d).whole()
                    })
                })
                .clone(),
        };
        // serde_json's recursion limit is 128 levels, and PostgreSQL's jsonb allows deeper.
        read.map_err(|e| format!("the event's JSON cannot be read by filters: {e}"))
    }
}

/// Matches run per handler call in the fan-out pass: the first call gets [`INLINE_FIRST`], and
/// each next one twice as many, up to a sink's default batch, while the time the last one took
/// says the next would take at most half of what is left of [`INLINE_BUDGET`].
const INLINE_FIRST: usize = 16;
const INLINE_BATCH: usize = 128;

/// The time the handlers of a fan-out pass may take in all: a call starts only while some is
/// left, and the matches it has no time for are written as jobs (which several workers then run
/// side by side, each call under `sink_timeout`). A slow handler holds neither the subscriptions
/// that share its pass nor its own matches behind one worker.
const INLINE_BUDGET: std::time::Duration = std::time::Duration::from_millis(100);

/// The time one call in the pass may take (or `sink_timeout`, if shorter): cancelled then, the
/// handler is too slow to run in a pass at all (see [`QUEUED_AFTER_OVERRUN`]).
const INLINE_CALL_TIMEOUT_MS: i32 = 100;

/// Handler calls in one pass, each a subtransaction: with [`PLAIN_INSERTS`], the transaction's
/// subtransaction ids stay within the cache every backend keeps (64), so nobody's snapshots
/// overflow to pg_subtrans.
const INLINE_CALLS: usize = 32;

/// Job INSERTs per pass tried without ON CONFLICT, each in a subtransaction (`write_jobs`).
const PLAIN_INSERTS: usize = 8;

/// How long a subscription whose handler call overran the pass's time has its matches queued.
const QUEUED_AFTER_OVERRUN: std::time::Duration = std::time::Duration::from_secs(600);

/// What the handlers of one pass may still take (see [`INLINE_BUDGET`], [`INLINE_CALLS`]).
struct InlineBudget {
    calls: usize,
    time: std::time::Duration,
    /// Job INSERTs tried first without ON CONFLICT, each in a subtransaction (`write_jobs`).
    inserts: usize,
}

impl InlineBudget {
    /// Whether `sub`, a handler subscription whose window came full, reads another in this pass:
    /// while the calls and the handlers' time left could run a whole window at the pace of this
    /// pass so far (twice over, for time), so that none of its matches is written as a job for
    /// want of them; and no later than `BATCHES_TIME` into the pass (its handlers' writes gave it
    /// a transaction id, which holds back the readers by the read horizon until it commits).
    fn more_windows(&self, sub: &Subscription, started: std::time::Instant) -> bool {
        let calls = WINDOW.div_ceil(sub.next_call.max(1));
        let per_window = INLINE_BUDGET.saturating_sub(self.time) / sub.windows.max(1) as u32;
        self.calls >= calls && self.time >= 2 * per_window && started.elapsed() < BATCHES_TIME
    }
}

/// Which of the events of `$3` (an outbox.event[]) have a job of subscription `$2` on queue `$1`
/// still waiting (a cursor moved back by hand): their ordinals, left out of a handler call as
/// the job INSERT's ON CONFLICT leaves them out of the queue.
const WAITING_SQL: &str = "\
    SELECT pg_catalog.array_agg(e.n) \
      FROM pg_catalog.unnest($3::outbox.event[]) WITH ORDINALITY \
           AS e(id, position, topic, subject, tenant, payload, headers, raised_at, n) \
     WHERE EXISTS (SELECT FROM outbox.jobs j \
                    WHERE j.queue OPERATOR(pg_catalog.=) $1 AND j.subscription OPERATOR(pg_catalog.=) $2 \
                      AND j.event OPERATOR(pg_catalog.=) e.id AND j.state OPERATOR(pg_catalog.=) 'waiting')";

/// Runs `sub`'s handler on its `matches` (in window order), as its owner, in batches (see
/// [`INLINE_BATCH`]), each in a subtransaction of the pass's transaction: the handler's writes
/// commit with the cursor move, as a job's commit with the job's removal, so a match that ran is
/// never written as a job. Stops at the first batch that fails (its effects are rolled back), or
/// once the pass's `budget` is spent; a call cancelled by its timeout
/// ([`INLINE_CALL_TIMEOUT_MS`]) has the subscription's matches queued for a while
/// ([`QUEUED_AFTER_OVERRUN`]). Returns how
/// many of `matches` went through (or had a job waiting already); the rest become jobs, so a
/// failing event gets its attempts, back-off and dead state from the job runner
/// (`dispatch::jobs`), exactly as if it had been queued.
fn run_inline(
    client: &mut SpiClient<'_>,
    sub: &mut Subscription,
    matches: &[pg_sys::Datum],
    event_type: pg_sys::Oid,
    budget: &mut InlineBudget,
    cx: pg_sys::MemoryContext,
) -> usize {
    if matches.is_empty() || budget.calls == 0 || budget.time.is_zero() {
        return 0;
    }
    let Some((call, owner)) = super::jobs::handler_of(client, &sub.name) else {
        return 0;
    };
    // Jobs of this subscription wait only after a failure or a rewind: look for them event by
    // event only then.
    let any_waiting = plans::select(
        client,
        "SELECT EXISTS (SELECT FROM outbox.jobs j \
                         WHERE j.queue OPERATOR(pg_catalog.=) $1 AND j.subscription OPERATOR(pg_catalog.=) $2 \
                           AND j.event IS NOT NULL AND j.state OPERATOR(pg_catalog.=) 'waiting')",
        Some(1),
        &[
            DatumWithOid::from(sub.queue.as_str()),
            DatumWithOid::from(sub.name.as_str()),
        ],
    )
    .and_then(|t| t.first().get_one::<bool>())
    .expect("looking for a subscription's waiting jobs")
    .unwrap_or(true);
    // SAFETY: the array type of outbox.event, whose oid the window read.
    let array_type = unsafe { pg_sys::get_array_type(event_type) };
    let sql = format!("SELECT {call}(e) FROM pg_catalog.unnest($1::outbox.event[]) e");
    let (mut ran, mut size) = (0, sub.next_call);
    while ran < matches.len() && budget.calls > 0 && budget.time.as_millis() >= 1 {
        budget.calls -= 1;
        let batch = &matches[ran..matches.len().min(ran + size)];
        let call_started = std::time::Instant::now();
        let mut events = batch.to_vec();
        if any_waiting {
            // SAFETY: an outbox.event[] built in this SPI connection, still alive.
            let arg = unsafe {
                DatumWithOid::new(
                    allocating_in(cx, || event_array(&events, event_type)),
                    array_type,
                )
            };
            let waiting: Vec<i64> = plans::select(
                client,
                WAITING_SQL,
                Some(1),
                &[
                    DatumWithOid::from(sub.queue.as_str()),
                    DatumWithOid::from(sub.name.as_str()),
                    arg,
                ],
            )
            .and_then(|t| t.first().get_one::<Vec<i64>>())
            .expect("looking for waiting jobs of a subscription's matches")
            .unwrap_or_default();
            let mut n = 0i64;
            events.retain(|_| {
                n += 1;
                !waiting.contains(&n)
            });
        }
        if !events.is_empty() {
            // SAFETY: an outbox.event[] built in this SPI connection, still alive.
            let arg = unsafe {
                DatumWithOid::new(
                    allocating_in(cx, || event_array(&events, event_type)),
                    array_type,
                )
            };
            let target = crate::worker::Target::Inline {
                subscription: &sub.name,
            };
            let timeout = INLINE_CALL_TIMEOUT_MS.min(crate::settings::SINK_TIMEOUT_MS.get());
            let called = super::as_handler_owner_within(owner, target, timeout, || {
                plans::call(client, &sql, &[arg])
                    .map(|_| ())
                    .unwrap_or_else(|e| panic!("{e}"));
            });
            budget.time = budget.time.saturating_sub(call_started.elapsed());
            if let Err(failure) = called {
                pgrx::log!(
                    "pg_outbox: subscription \"{}\": its handler failed on a batch of {} match(es), queued as jobs: {failure}",
                    sub.name,
                    batch.len()
                );
                // Its own timeout (not a cancel from elsewhere, nor an error the handler raised
                // with that SQLSTATE): too slow for a pass.
                if super::last_call_timed_out() {
                    crate::worker::queue_only(&sub.name, Some(QUEUED_AFTER_OVERRUN));
                }
                break;
            }
        } else {
            budget.time = budget.time.saturating_sub(call_started.elapsed());
        }
        ran += batch.len();
        // The next call, at this one's pace, must take at most half of what is left (and of its
        // own timeout): a margin for the pace changing.
        let per_match = call_started.elapsed() / batch.len() as u32;
        let next = (size * 2).min(INLINE_BATCH);
        let left = budget.time.min(std::time::Duration::from_millis(
            INLINE_CALL_TIMEOUT_MS as u64,
        )) / 2;
        if per_match * next.min(matches.len() - ran) as u32 > left {
            size = (left.as_nanos() / per_match.as_nanos().max(1)) as usize;
            if size == 0 {
                break;
            }
        } else {
            size = next;
        }
    }
    sub.next_call = size.max(1);
    ran
}

/// The subscriptions that are not paused (name, has a handler), rotated so that workers start
/// at different ones.
pub fn active(slot: usize) -> (Vec<(String, bool)>, super::Reads) {
    let mut names = Vec::new();
    let mut reads: super::Reads = Some(Vec::new());
    if !super::lock_tables() {
        return (names, reads);
    }
    Spi::connect(|client| {
        for row in crate::plans::select(
            client,
            "SELECT name, handler IS NOT NULL, topics FROM outbox.subscriptions WHERE NOT paused ORDER BY name",
            None,
            &[],
        )? {
            names.push((
                row.get::<String>(1)?.expect("name"),
                row.get::<bool>(2)?.unwrap_or(false),
            ));
            super::add_reads(&mut reads, row.get::<Vec<String>>(3)?);
        }
        Ok::<_, pgrx::spi::Error>(())
    })
    .expect("listing subscriptions");
    if !names.is_empty() {
        let k = slot % names.len();
        names.rotate_left(k);
    }
    (names, reads)
}
