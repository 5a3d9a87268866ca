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

use super::PassResult;
use crate::cursor;
use crate::plans;
use crate::transaction::refresh_snapshot;
use pg_outbox_core::filter::{EventContext, EventFields, Filter, Needs};
use pg_outbox_core::pattern::Pattern;
use pg_outbox_core::Position;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

/// Events read per pass. Jobs are small rows; a larger window amortises the pass.
pub const WINDOW: i32 = 1000;

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
    cursor: Position,
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
    stopped_at: Option<String>,
    /// A subscription with a handler: its matches in this window, to run in this pass
    /// (`run_inline`) rather than be written as jobs. None: they are written as jobs.
    inline: Option<Vec<pg_sys::Datum>>,
}

/// The time one subscription's filter may take in one pass. Every subscription at the same cursor
/// shares the pass: without this, a filter that runs to its per-event budget on every event held
/// the others for up to a thousand times that.
const PASS_FILTER_BUDGET: std::time::Duration = std::time::Duration::from_millis(500);

impl Subscription {
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
    // (a grant or a role membership taken back since) is paused, saying why, not fanned out.
    for r in plans::update(
        client,
        "WITH denied AS (            UPDATE outbox.subscriptions s SET paused = true,                   last_predicate_error = pg_catalog.format(                       'paused: its owner %s may no longer queue jobs on queue \"%s\"; grant that back, then resume it',                       c.owner::pg_catalog.regrole, s.queue),                   last_predicate_error_at = pg_catalog.now()              FROM outbox.consumers c             WHERE c.name = s.name AND s.name = ANY ($1) AND NOT s.paused               AND NOT outbox._may(s.queue, c.owner, CASE WHEN s.handler IS NULL THEN 'enqueue' ELSE 'own' END)            RETURNING s.last_predicate_error)          SELECT pg_catalog.array_agg(d.last_predicate_error) FROM denied d",
        None,
        &[DatumWithOid::from(leased.clone())],
    )
    .and_then(|t| t.first().get_one::<Vec<String>>())
    .expect("checking the subscriptions' queues")
    .unwrap_or_default()
    {
        pgrx::warning!("pg_outbox: a subscription was {r}");
    }
    let mut subs = Vec::new();
    for r in plans::select(
        client,
        "SELECT s.name, c.txid::text, c.seq, s.topics, s.filter, s.handler::pg_catalog.oid, s.queue, s.max_attempts \
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
        subs.push(Subscription {
            cursor: Position::new(txid.parse().expect("xid8"), r.get(3).unwrap().expect("seq")),
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
        });
    }
    for sub in subs.iter_mut() {
        if sub.handler.is_some() && crate::worker::runs_inline(&sub.name) {
            sub.inline = Some(Vec::new());
        }
    }
    (subs, contended)
}

/// The window: each event's position and topic, the fields the filters read ($4..$8 say which:
/// subject, tenant, payload, headers, raised_at), and the event as an outbox.event (read once
/// here, for the jobs written and the handlers run, not again by key), and that type's oid.
const WINDOW_SQL: &str = "\
    SELECT r.position, r.topic, CASE WHEN $4 THEN r.subject END, CASE WHEN $5 THEN r.tenant END, \
           CASE WHEN $6 THEN r.payload::text END, CASE WHEN $7 THEN r.headers::text END, \
           CASE WHEN $8 THEN pg_catalog.to_char(r.raised_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') END, \
           ROW(r.id, r.position, r.topic, r.subject, r.tenant, r.payload, r.headers, \
               r.raised_at)::outbox.event, \
           'outbox.event'::pg_catalog.regtype::pg_catalog.oid \
      FROM outbox._read_window($1::pg_catalog.xid8, $2, $3, $9) r";

/// Writes one job per (subscription, event) pair the filters matched: the event (of the window's
/// rows, $5) as the payload, `<subscription>:<event id>` as the key. A (subscription, event)
/// whose job still waits is not queued twice (a rewound cursor, say), while two subscriptions
/// feeding one queue each get their job. Keys given to `enqueue` live apart (index
/// `jobs_waiting_key`): they cannot hide an event.
const INSERT_SQL: &str = "\
    INSERT INTO outbox.jobs (queue, payload, key, event, subscription, handler, max_attempts) \
    SELECT m.queue, \
           pg_catalog.to_jsonb(ROW(m.id, m.position, m.topic, m.subject, m.tenant, m.payload, m.headers, \
                                   m.raised_at)::outbox.event), \
           m.sub || ':' || m.id::text, m.id, m.sub, m.handler::pg_catalog.regprocedure, m.max_attempts \
      FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::text[]), \
                      pg_catalog.unnest($3::pg_catalog.oid[]), pg_catalog.unnest($4::int4[]), \
                      pg_catalog.unnest($5::outbox.event[])) WITH ORDINALITY \
           AS m(sub, queue, handler, max_attempts, id, position, topic, subject, tenant, payload, headers, \
                raised_at, n) \
     ORDER BY m.n \
    ON CONFLICT (queue, subscription, event) WHERE subscription IS NOT NULL AND state = 'waiting' DO NOTHING";

/// What a filter made of a window.
#[derive(Default)]
struct Verdicts {
    matches: i64,
    skipped: i64,
    errors: i64,
    last_error: Option<String>,
}

/// One fan-out pass over the subscriptions `names` that this worker can lease. Runs inside the
/// worker's transaction. Subscriptions whose cursors are at the same position (the usual case:
/// caught up) share one read of the window and one conversion of each event; each filter then
/// runs on it.
pub fn pass(names: &[&str]) -> PassResult {
    if names.is_empty() || !super::lock_tables() {
        return PassResult::Skipped;
    }
    // Tenants' filters run here: SIGTERM ends the worker at once, as inside a handler.
    let _tenant_code = crate::worker::TenantCode::enter();
    Spi::connect_mut(|client| {
        let (subs, contended) = lease(client, names);
        if subs.is_empty() {
            return if contended {
                PassResult::Contended
            } else {
                PassResult::Skipped
            };
        }
        let mut groups: BTreeMap<Position, Vec<Subscription>> = BTreeMap::new();
        for sub in subs {
            groups.entry(sub.cursor).or_default().push(sub);
        }
        let (mut matched, mut full) = (0usize, false);
        let mut any = false;
        let mut budget = InlineBudget {
            calls: INLINE_CALLS,
            time: INLINE_BUDGET,
        };
        for (cursor, mut group) in groups {
            if let Some((m, f)) = fan_out(client, cursor, &mut group, &mut budget) {
                any = true;
                matched += m;
                full |= f;
            }
        }
        if !any {
            return if contended {
                PassResult::Contended
            } else {
                PassResult::Idle
            };
        }
        PassResult::Delivered {
            events: matched,
            full,
        }
    })
}

/// Fans one window after `cursor` out to `group` (subscriptions at that cursor): evaluates,
/// writes the jobs, moves the cursors, counts. None when there is nothing to read.
fn fan_out(
    client: &mut SpiClient<'_>,
    cursor: Position,
    group: &mut [Subscription],
    budget: &mut InlineBudget,
) -> Option<(usize, bool)> {
    let filters: Vec<&Rc<Filter>> = group
        .iter()
        .filter_map(|s| s.filter.as_ref().and_then(|f| f.as_ref().ok()))
        .collect();
    let uses = |v: &str| filters.iter().any(|f| f.uses(v));
    // What every filter of the group reads, converted once per event for all of them.
    let event_needs = Needs::of(filters.iter().map(|f| f.as_ref()));
    let needs = [
        uses("subject"),
        uses("tenant"),
        uses("payload"),
        uses("headers"),
        uses("raised_at"),
    ];
    let rows = plans::select(
        client,
        WINDOW_SQL,
        None,
        &[
            DatumWithOid::from(cursor.txid.to_string()),
            DatumWithOid::from(cursor.seq),
            DatumWithOid::from(WINDOW),
            DatumWithOid::from(needs[0]),
            DatumWithOid::from(needs[1]),
            DatumWithOid::from(needs[2]),
            DatumWithOid::from(needs[3]),
            DatumWithOid::from(needs[4]),
            DatumWithOid::from(crate::settings::MAX_BATCH_BYTES.get() as i64),
        ],
    )
    .expect("reading a fan-out window");
    let mut event_type = pg_sys::InvalidOid;
    let count = rows.len();
    // The matches, as parallel arrays for INSERT_SQL, in the order of the window (then of the
    // group, which is by name); the events are outbox.event datums of the window's rows.
    let (mut subs, mut queues, mut handlers, mut attempts, mut events) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut last: Option<String> = None;
    for row in rows {
        // Cancel and terminate are answered between events, and within an evaluation through the
        // filter budget's interrupt probe (set in worker::run).
        pg_sys::check_for_interrupts!();
        let position: String = row.get(1).unwrap().expect("position");
        let topic: String = row.get(2).unwrap().expect("topic");
        // Converted once, for every filter that looks at this event, and only if one does.
        let mut context: Option<EventContext<'static>> = None;
        for sub in group.iter_mut() {
            if sub.stopped_at.is_some() || !sub.wants_topic(&topic) {
                continue;
            }
            let verdict = match &sub.filter {
                None => Ok(true),
                Some(Err(e)) => Err(e.clone()),
                Some(Ok(filter)) => {
                    let context = context.get_or_insert_with(|| {
                        let subject: Option<String> = row.get(3).unwrap();
                        let tenant: Option<String> = row.get(4).unwrap();
                        let payload = json(row.get::<String>(5).unwrap());
                        let headers = json(row.get::<String>(6).unwrap());
                        let raised_at: String = row.get(7).unwrap().unwrap_or_default();
                        let unreadable = payload.as_ref().err().or(headers.as_ref().err());
                        let fields = EventFields {
                            topic: &topic,
                            subject: subject.as_deref(),
                            tenant: tenant.as_deref(),
                            payload: payload.as_ref().unwrap_or(&serde_json::Value::Null),
                            headers: headers.as_ref().unwrap_or(&serde_json::Value::Null),
                            raised_at: &raised_at,
                        };
                        match unreadable {
                            // Never handed over as null: a filter that reads it fails instead.
                            Some(why) => {
                                EventContext::unreadable(&fields, &event_needs, why.clone())
                            }
                            None => EventContext::for_needs(&fields, &event_needs),
                        }
                    });
                    let started = std::time::Instant::now();
                    let verdict = filter.matches_in(context);
                    if pg_outbox_core::budget::interrupted() {
                        pg_sys::check_for_interrupts!();
                    }
                    sub.spent += started.elapsed();
                    if sub.spent > PASS_FILTER_BUDGET {
                        sub.stopped_at = Some(position.clone());
                    }
                    verdict
                }
            };
            match verdict {
                Ok(true) => {
                    sub.verdicts.matches += 1;
                    // The datum in the window's rows (not copied).
                    let event = row
                        .get::<pgrx::AnyElement>(8)
                        .unwrap()
                        .expect("the event")
                        .datum();
                    event_type = row.get(9).unwrap().expect("outbox.event");
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
        last = Some(position);
    }
    let last: Position = last?.parse().expect("positions are well-formed");
    // A handler subscription's matches run now, in this transaction; what did not (a call that
    // failed, the pass's time for them used up) is written as jobs like any other match.
    for sub in group.iter_mut() {
        let Some(inline) = sub.inline.take() else {
            continue;
        };
        let ran = run_inline(client, sub, &inline, event_type, budget);
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
        plans::update(
            client,
            INSERT_SQL,
            None,
            &[
                DatumWithOid::from(subs),
                DatumWithOid::from(queues),
                DatumWithOid::from(handlers),
                DatumWithOid::from(attempts),
                // SAFETY: an outbox.event[] built in this SPI connection, still alive.
                unsafe {
                    DatumWithOid::new(
                        event_array(&events, event_type),
                        pg_sys::get_array_type(event_type),
                    )
                },
            ],
        )
        .expect("writing jobs");
    }
    let mut stopped = false;
    for sub in group.iter() {
        match &sub.stopped_at {
            Some(at) => {
                stopped = true;
                cursor::save(&sub.name, at.parse().expect("positions are well-formed"));
            }
            None => {
                cursor::save(&sub.name, last);
            }
        }
        if let Some(e) = &sub.verdicts.last_error {
            pgrx::warning!(
                "pg_outbox: the filter of subscription \"{}\" failed on {} event(s), counted as false; last: {e}",
                sub.name,
                sub.verdicts.errors
            );
        }
    }
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
                DatumWithOid::from(group.iter().map(|s| s.name.clone()).collect::<Vec<_>>()),
                DatumWithOid::from(group.iter().map(|s| s.verdicts.matches).collect::<Vec<_>>()),
                DatumWithOid::from(group.iter().map(|s| s.verdicts.skipped).collect::<Vec<_>>()),
                DatumWithOid::from(group.iter().map(|s| s.verdicts.errors).collect::<Vec<_>>()),
                DatumWithOid::from(
                    group
                        .iter()
                        .map(|s| s.verdicts.last_error.clone())
                        .collect::<Vec<_>>(),
                ),
            ],
        )
        .expect("counting fan-out");
    // A subscription stopped short has more to read: come back at once.
    Some((matched, stopped || count >= WINDOW as usize))
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

/// Handler calls in one pass, each a subtransaction: the transaction's subtransaction ids stay
/// within the cache every backend keeps (64), so nobody's snapshots overflow to pg_subtrans.
const INLINE_CALLS: usize = 32;

/// How long a subscription whose handler call overran the pass's time has its matches queued.
const QUEUED_AFTER_OVERRUN: std::time::Duration = std::time::Duration::from_secs(600);

/// What the handlers of one pass may still take (see [`INLINE_BUDGET`], [`INLINE_CALLS`]).
struct InlineBudget {
    calls: usize,
    time: std::time::Duration,
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

/// An outbox.event[] of `events` (outbox.event datums), in the SPI connection's memory.
fn event_array(events: &[pg_sys::Datum], event_type: pg_sys::Oid) -> pg_sys::Datum {
    let mut elems = events.to_vec();
    // SAFETY: `elems` are outbox.event datums (composites: varlena, double-aligned) alive in this
    // SPI connection; construct_array copies them into an array palloc'd in the current context.
    let array = unsafe {
        pg_sys::construct_array(
            elems.as_mut_ptr(),
            elems.len() as i32,
            event_type,
            -1,
            false,
            pg_sys::TYPALIGN_DOUBLE as std::ffi::c_char,
        )
    };
    pg_sys::Datum::from(array)
}

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
    sub: &Subscription,
    matches: &[pg_sys::Datum],
    event_type: pg_sys::Oid,
    budget: &mut InlineBudget,
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
    let (mut ran, mut size) = (0, INLINE_FIRST);
    while ran < matches.len() && budget.calls > 0 && budget.time.as_millis() >= 1 {
        budget.calls -= 1;
        let batch = &matches[ran..matches.len().min(ran + size)];
        let call_started = std::time::Instant::now();
        let mut events = batch.to_vec();
        if any_waiting {
            // SAFETY: an outbox.event[] built in this SPI connection, still alive.
            let arg = unsafe { DatumWithOid::new(event_array(&events, event_type), array_type) };
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
            let arg = unsafe { DatumWithOid::new(event_array(&events, event_type), array_type) };
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
    ran
}

/// An event's payload or headers as JSON for filters; an error when the parser refuses it (its
/// recursion limit is 128 levels, and PostgreSQL's jsonb allows deeper).
fn json(text: Option<String>) -> Result<serde_json::Value, String> {
    match text {
        None => Ok(serde_json::Value::Null),
        Some(t) => serde_json::from_str(&t)
            .map_err(|e| format!("the event's JSON cannot be read by filters: {e}")),
    }
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
