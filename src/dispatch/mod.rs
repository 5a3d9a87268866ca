//! One delivery pass of one sink, in the worker's transaction.
//!
//! Lease: a transaction-scoped lock on the sink's lease key (`crate::lease`), only tried, held
//! for the whole pass, so exactly one worker delivers to a sink at a time, and a worker that dies
//! releases it with its transaction. A role's own change to the sink (pause, alter, drop, replay)
//! takes the lease too, waiting, so the workers pass the sink over while that transaction is open
//! instead of waiting for the rows it holds.
//! Then: read a window with the read rule, hand the events that match the sink's topics to its
//! handler inside a subtransaction, as the sink's owner, under `pg_outbox.sink_timeout`; on
//! success move the cursor past the whole window in the same transaction -- the handler's writes
//! and the cursor commit together, exactly once. On failure the subtransaction is rolled back
//! and the failure policy (pg_outbox_core::policy) decides what the next pass hands over.

pub mod fanout;
pub mod http;
pub mod jobs;
pub mod kafka;
mod rows;

use crate::cursor::{self, At, Batch};
use crate::plans;
use crate::settings;
use crate::transaction::{in_subtransaction, Failure};
use pg_outbox_core::policy::{AfterFailure, AfterNeighbour, SinkState};
use pg_outbox_core::Position;
use pgrx::datum::DatumWithOid;
use pgrx::memcxt::PgMemoryContexts;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use rows::{Column, Row};
use std::time::{Duration, Instant};

// utils/timeout.h is not among pgrx's bindings. STATEMENT_TIMEOUT is the fourth TimeoutId in
// PostgreSQL 15 (its handler makes the next CHECK_FOR_INTERRUPTS raise 57014, as
// statement_timeout does); only pg15 is built and tested here.
const STATEMENT_TIMEOUT: i32 = 3;

/// How long a handler may go on after the cancel of `sink_timeout` before its worker is ended (at
/// most sink_timeout again).
const HARD_TIMEOUT_GRACE_MS: i32 = 2_000;

unsafe extern "C-unwind" {
    #[link_name = "enable_timeout_after"]
    fn enable_timeout_after_raw(id: i32, delay_ms: i32);
    #[link_name = "disable_timeout"]
    fn disable_timeout_raw(id: i32, keep_indicator: bool);
    #[link_name = "get_timeout_indicator"]
    fn get_timeout_indicator_raw(id: i32, reset: bool) -> bool;
}

thread_local! {
    /// Whether the last handler call was cancelled by its own timeout (see
    /// [`last_call_timed_out`]).
    static TIMED_OUT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the last handler call run by [`as_handler_owner_within`] was cancelled by its timeout
/// (not by a cancel from elsewhere, nor by an error it raised with that SQLSTATE).
pub(crate) fn last_call_timed_out() -> bool {
    TIMED_OUT.with(|t| t.get())
}

/// # Safety
/// Backend only; calls into the timeout module through pgrx's error boundary.
unsafe fn enable_timeout_after(id: i32, delay_ms: i32) {
    unsafe { pg_sys::ffi::pg_guard_ffi_boundary(|| enable_timeout_after_raw(id, delay_ms)) }
}

/// # Safety
/// Backend only; calls into the timeout module through pgrx's error boundary.
unsafe fn disable_timeout(id: i32, keep_indicator: bool) {
    unsafe { pg_sys::ffi::pg_guard_ffi_boundary(|| disable_timeout_raw(id, keep_indicator)) }
}

pub enum PassResult {
    /// The sink is paused, not due, or gone (or DDL holds the tables).
    Skipped,
    /// Another worker holds the sink's lease: it may not have seen the newest events, so this
    /// worker should look again soon.
    Contended,
    /// Nothing to read.
    Idle,
    /// `events` handed over (or skipped by topic); `full` when the window was full (read again).
    Delivered { events: usize, full: bool },
    /// A failed batch was halved: the next pass should come at once.
    Retry,
    /// A lone event failed and backs off, or the sink is down.
    Failed,
}

/// The sinks due for a pass, rotated so that workers start at different sinks.
pub struct DueSinks {
    /// (id, is an HTTP sink)
    pub due: Vec<(String, bool)>,
    pub count: usize,
    /// Time until the earliest back-off of a sink ends, if any.
    pub next_attempt_in: Option<Duration>,
    /// The topic patterns the sinks that are not paused read (None: some sink reads every topic).
    pub reads: Reads,
}

/// Topic patterns readers read; None: every topic.
pub type Reads = Option<Vec<String>>;

/// Adds a reader's topic patterns (None: every topic) to `reads`.
pub fn add_reads(reads: &mut Reads, topics: Option<Vec<String>>) {
    match (reads.as_mut(), topics) {
        (Some(all), Some(topics)) => {
            for t in topics {
                if !all.contains(&t) {
                    all.push(t);
                }
            }
        }
        _ => *reads = None,
    }
}

/// Every relation that is a member of the extension (identity sequences too), in the order the
/// extension script creates them. Indexes and TOAST tables are not members: DROP EXTENSION reaches
/// them through their table, which it must lock first. src/tests.rs checks that this list names
/// every member.
pub(crate) const MEMBER_RELATIONS: [&std::ffi::CStr; 23] = [
    c"lineage",
    c"events_seq",
    c"events",
    c"events_0",
    c"events_1",
    c"events_2",
    c"events_3",
    c"log_rotation",
    c"ticks",
    c"consumers",
    c"sinks",
    c"http_sinks",
    c"sinks_lease_key_seq",
    c"kafka_sinks",
    c"dead_letters",
    c"queues",
    c"queue_grants",
    c"jobs_id_seq",
    c"jobs",
    c"dead_jobs",
    c"subscriptions_lease_key_seq",
    c"subscriptions",
    c"schedules",
];

/// Whether a worker's transaction holds the relations of the extension (see [`lock_members`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Members {
    /// The extension is not installed in this database (its schema is missing).
    Absent,
    /// Every member is locked.
    Held,
    /// A member is missing (the installed SQL is of another version); the others are locked.
    Incomplete,
    /// A member is locked by DDL (DROP or ALTER EXTENSION, say).
    Refused,
}

/// Locks every relation of the extension, without waiting ([`step_lock_mode`]). Every transaction of a
/// worker begins with it (`crate::transaction::in_transaction`) and does nothing more when it is
/// refused, so the worker never waits behind DDL, and DDL waits at most for the step in flight,
/// never deadlocks with it: a step may then touch any relation of the extension (the read rule
/// reads `outbox.lineage`, say) without waiting on a lock DDL holds, as it holds every one.
pub fn lock_members() -> Members {
    // SAFETY: reads this backend's PGPROC and transaction state.
    let (lxid, top) = unsafe {
        (
            (*pg_sys::MyProc).lxid,
            pg_sys::GetCurrentTransactionNestLevel() == 1,
        )
    };
    // Held by this transaction at its top level already: a step asks again and again (a
    // worker's round did 25 catalog lookups and lock calls three times over). Locks taken at the
    // top level stay until the transaction ends; those taken in a subtransaction could go with
    // its rollback, so only the top level's are remembered.
    if HELD_IN.with(|h| h.get()) == Some(lxid) {
        return Members::Held;
    }
    let members = lock_members_now();
    HELD_IN.with(|h| h.set((members == Members::Held && top).then_some(lxid)));
    members
}

thread_local! {
    /// The local transaction (`PGPROC.lxid`) that holds every member, locked at its top level.
    static HELD_IN: std::cell::Cell<Option<pg_sys::LocalTransactionId>> = const { std::cell::Cell::new(None) };
}

fn lock_members_now() -> Members {
    // SAFETY: catalog lookups and lock-manager calls in a transaction; a lock that cannot be had
    // returns false instead of waiting.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"outbox".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return Members::Absent;
        }
        let mut held = Members::Held;
        for name in MEMBER_RELATIONS {
            let relid = pg_sys::get_relname_relid(name.as_ptr(), nsp);
            if relid == pg_sys::InvalidOid {
                held = Members::Incomplete;
            } else if !pg_sys::ConditionalLockRelationOid(relid, step_lock_mode(relid)) {
                return Members::Refused;
            }
        }
        held
    }
}

/// The lock a worker step takes on a member up front: the strongest it may need later, so that
/// it never waits to upgrade while DDL that let it in waits for it. ROW EXCLUSIVE on tables and
/// sequences (a step writes them, nextval takes it), ACCESS SHARE on the view.
fn step_lock_mode(relid: pg_sys::Oid) -> pg_sys::LOCKMODE {
    // SAFETY: a syscache lookup of a relation that exists.
    let kind = unsafe { pg_sys::get_rel_relkind(relid) } as u8;
    if kind == pg_sys::RELKIND_VIEW {
        pg_sys::AccessShareLock as pg_sys::LOCKMODE
    } else {
        pg_sys::RowExclusiveLock as pg_sys::LOCKMODE
    }
}

/// True when every relation of the extension is locked (see [`lock_members`]); a step that reads
/// or writes them goes on only then.
pub fn lock_tables() -> bool {
    lock_members() == Members::Held
}

pub fn due_sinks(slot: usize) -> DueSinks {
    if !lock_tables() {
        return DueSinks {
            due: Vec::new(),
            count: 0,
            next_attempt_in: None,
            reads: Some(Vec::new()),
        };
    }
    let mut due = Vec::new();
    let mut next: Option<Duration> = None;
    let mut count = 0;
    let mut reads: Reads = Some(Vec::new());
    Spi::connect(|client| {
        let rows = plans::select(
            client,
            "SELECT id, next_attempt_at IS NULL OR next_attempt_at <= pg_catalog.now(), \
                    (extract(epoch FROM next_attempt_at - pg_catalog.now()) * 1000)::int8, \
                    kind <> 'sql', topics \
               FROM outbox.sinks WHERE NOT paused ORDER BY id",
            None,
            &[],
        )?;
        for row in rows {
            count += 1;
            add_reads(&mut reads, row.get::<Vec<String>>(5)?);
            let id: String = row.get(1)?.expect("sinks.id is NOT NULL");
            if row.get::<bool>(2)?.unwrap_or(true) {
                due.push((id, row.get::<bool>(4)?.unwrap_or(false)));
            } else if let Some(ms) = row.get::<i64>(3)? {
                let d = Duration::from_millis(ms.max(1) as u64);
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        Ok::<_, pgrx::spi::Error>(())
    })
    .expect("listing sinks");
    if !due.is_empty() {
        let k = slot % due.len();
        due.rotate_left(k);
    }
    DueSinks {
        due,
        count,
        next_attempt_in: next,
        reads,
    }
}

/// True when committed events wait behind the read horizon (a transaction holds it).
pub fn events_waiting() -> bool {
    if !lock_tables() {
        return false;
    }
    crate::query::one::<bool>(
        // max(txid) reads one entry at the end of the primary key; an EXISTS over the inequality
        // was planned as a sequential scan (25 ms on 400,000 events, every round).
        "SELECT max(txid) >= outbox._log_horizon() FROM outbox.events",
        &[],
    )
    .unwrap_or(false)
}

/// A sink as one pass needs it.
struct Sink {
    id: String,
    /// The handler, schema-qualified and quoted, for the call statement.
    call: String,
    owner: pg_sys::Oid,
    topic_regex: Option<String>,
    max_batch: u32,
    state: SinkState,
    cursor: At,
    /// Reads by ticks (`outbox.alter_sink(id, '{"read_by": "ticks"}')`), not by the read horizon.
    by_ticks: bool,
    event_array_type: pg_sys::Oid,
    /// Off: this pass's commit does not wait for the WAL flush (`outbox.alter_sink`).
    synchronous_commit: bool,
}

enum Leased {
    Sink(Sink),
    /// Another worker holds the lease.
    Contended,
    /// Paused, not due, or gone.
    Absent,
}

/// Takes the sink's lease and reads its state. None: another worker holds it, or it is paused,
/// not due, or gone.
///
/// The lease is a transaction-scoped lock (see `crate::lease`), not a row lock: locking a row would
/// give the pass a transaction id from its first statement, and a transaction id held through a
/// slow handler holds back the read horizon of every reader in the cluster. This way the pass
/// takes an id only when its handler first writes, and when it saves the cursor at the end.
fn lease(client: &SpiClient<'_>, id: &str) -> Result<Leased, pgrx::spi::Error> {
    let key = plans::select(
        client,
        "SELECT s.lease_key FROM outbox.sinks s WHERE s.id OPERATOR(pg_catalog.=) $1",
        Some(1),
        &[DatumWithOid::from(id)],
    )?;
    if key.is_empty() {
        return Ok(Leased::Absent);
    }
    let key = key
        .first()
        .get_one::<i32>()?
        .expect("lease_key is NOT NULL");
    if !crate::lease::try_xact(crate::lease::Class::Sink, key) {
        return Ok(Leased::Contended);
    }
    // The previous holder committed before it released the lease: a snapshot taken now sees its
    // cursor. (The statement above ran on an older one.)
    crate::transaction::refresh_snapshot();
    let rows = plans::select(
        client,
        "SELECT s.id, pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(p.proname), \
                c.owner, s.topic_regex, s.batch_size, s.current_batch, s.attempts, \
                c.txid::text, c.seq, 'outbox.event[]'::pg_catalog.regtype::pg_catalog.oid, \
                s.synchronous_commit, c.read_by = 'ticks', c.tick, c.since::text, c.upto::text \
           FROM outbox.sinks s \
           JOIN outbox.consumers c ON c.name = s.id \
           JOIN pg_catalog.pg_proc p ON p.oid = s.handler \
           JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace \
          WHERE s.id = $1 AND s.kind = 'sql' AND NOT s.paused \
            AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= pg_catalog.now())",
        Some(1),
        &[DatumWithOid::from(id)],
    )?;
    let mut found = None;
    for r in rows {
        let txid: String = r.get(8)?.expect("cursor txid");
        found = Some(Sink {
            id: r.get(1)?.expect("id"),
            call: r.get(2)?.expect("handler"),
            owner: r.get(3)?.expect("owner"),
            topic_regex: r.get(4)?,
            max_batch: r.get::<i32>(5)?.expect("batch_size").max(1) as u32,
            state: SinkState {
                batch: r.get::<i32>(6)?.expect("current_batch").max(1) as u32,
                attempts: r.get::<i32>(7)?.expect("attempts").max(0) as u32,
            },
            cursor: At {
                pos: Position::new(txid.parse().expect("xid8"), r.get(9)?.expect("seq")),
                batch: match (
                    r.get::<i64>(13)?,
                    r.get::<String>(14)?,
                    r.get::<String>(15)?,
                ) {
                    (Some(tick), Some(since), Some(upto)) => Some(Batch { tick, since, upto }),
                    _ => None,
                },
            },
            by_ticks: r.get(12)?.expect("read_by is NOT NULL"),
            event_array_type: r.get(10)?.expect("type oid"),
            synchronous_commit: r.get(11)?.expect("synchronous_commit is NOT NULL"),
        });
    }
    if let Some(sink) = &found {
        if !crate::owner::role_exists(sink.owner) {
            pause_orphan(&sink.id, sink.owner)?;
            return Ok(Leased::Absent);
        }
    }
    Ok(found.map_or(Leased::Absent, Leased::Sink))
}

/// A sink whose owner was dropped (from another database, where pg_outbox could not refuse it)
/// can run nothing as that owner: it is paused, once, with the reason in its status. It keeps its
/// cursor, and so holds the log, until an operator drops it.
pub(crate) fn pause_orphan(id: &str, owner: pg_sys::Oid) -> Result<(), pgrx::spi::Error> {
    let why = format!(
        "paused: its owner (role {}) no longer exists; drop the sink",
        owner.to_u32()
    );
    pgrx::warning!("pg_outbox: sink \"{id}\" {why}");
    Spi::run_with_args(
        "UPDATE outbox.sinks SET paused = true, last_error = $2, last_sqlstate = '42704', \
                last_error_at = pg_catalog.now() WHERE id = $1",
        &[DatumWithOid::from(id), DatumWithOid::from(why.as_str())],
    )
}

/// A window of the log after the cursor: how many events, the last position, and the events the
/// sink's topics match (NULL when none do), as one outbox.event[] datum.
struct Window {
    count: usize,
    /// More may be read at once: the window came full, or the batch it is in ended and a later
    /// tick is taken.
    more: bool,
    last: Option<At>,
    matching: usize,
    events: Option<pg_sys::Datum>,
}

/// A window's rows: the next events after a cursor, at most $3, with the log's columns as they
/// are (`rows::Column`), and whether the sink's topics ($4, a regular expression; NULL: all)
/// match each. [`read_window_in`] cuts them at the byte cap, counts them and makes the matching
/// ones the handler's outbox.event[].
const WINDOW_SQL: rows::WindowSql = {
    use rows::{from_both_parts, from_horizon, from_range, window_sql};
    macro_rules! topic_matches {
        () => {
            "($4::text IS NULL OR r.topic ~ $4)"
        };
    }
    rows::WindowSql {
        horizon: window_sql!(topic_matches!(), from_horizon!()),
        range: window_sql!(topic_matches!(), from_range!()),
        both_parts: window_sql!(topic_matches!(), from_both_parts!()),
    }
};

fn read_window(
    client: &SpiClient<'_>,
    after: &At,
    max: u32,
    regex: &Option<String>,
) -> Result<Window, pgrx::spi::Error> {
    let mut at = after.clone();
    let mut more = true;
    for _ in 0..BATCHES_PER_WINDOW {
        let window = read_window_in(client, &at, max, regex)?;
        if window.count > 0 {
            return Ok(window);
        }
        match next_batch(client, &at)? {
            Some(next) => at = next,
            None => {
                more = false;
                break;
            }
        }
    }
    // Nothing to read, but batches passed that held nothing for this reader: the cursor moves
    // past them (an empty window that ends after them), and on if there may be more.
    let moved = at != *after;
    Ok(Window {
        count: 0,
        more: moved && more,
        last: moved.then_some(at),
        matching: 0,
        events: None,
    })
}

/// Batches a window read looks through for its first event: the reader moves on from a batch
/// it has read to the end only when it reads again, and a batch may hold nothing for it (pruned).
const BATCHES_PER_WINDOW: usize = 64;

/// The window of [`read_window`] within the reader's batch (or after its read-horizon cursor).
fn read_window_in(
    client: &SpiClient<'_>,
    after: &At,
    max: u32,
    regex: &Option<String>,
) -> Result<Window, pgrx::spi::Error> {
    rows::select_window(
        client,
        &WINDOW_SQL,
        after,
        max as usize,
        DatumWithOid::from(regex.as_deref()),
    )?;
    let (rows, table) = rows::deformed_rows();
    let count = rows::within_bytes(&rows);
    let rows = &rows[..count];
    let last = rows.last().map(|row| At {
        pos: row.position(),
        batch: after.batch.clone(),
    });
    let matches: Vec<&Row> = rows
        .iter()
        .filter(|row| row.get(Column::Extra).is_some_and(|m| m.value() != 0))
        .collect();
    let matching = matches.len();
    let events = matches.first().map(|first| {
        let event_type =
            pg_sys::Oid::from(first.get(Column::EventType).expect("outbox.event").value() as u32);
        // The events one by one, freed once the array holds them.
        let scratch = PgMemoryContexts::new("pg_outbox sink window");
        let events: Vec<pg_sys::Datum> = rows::allocating_in(scratch.value(), || {
            // SAFETY: outbox.event is a composite type; the copy lives in `scratch`, as long as
            // the datums made with it.
            let tupdesc = unsafe { pg_sys::lookup_rowtype_tupdesc_copy(event_type, -1) };
            matches.iter().map(|row| row.event(tupdesc)).collect()
        });
        rows::event_array(&events, event_type)
    });
    // SAFETY: nothing read from the rows is used past here (the array holds copies).
    unsafe { pg_sys::SPI_freetuptable(table) };
    let more = count as u32 >= max
        || match &after.batch {
            Some(batch) if count > 0 => later_tick(client, batch.tick)?,
            _ => false,
        };
    Ok(Window {
        count,
        more,
        last,
        matching,
        events,
    })
}

/// Whether a tick after `tick` is taken.
pub(crate) fn later_tick(client: &SpiClient<'_>, tick: i64) -> Result<bool, pgrx::spi::Error> {
    Ok(plans::select(
        client,
        "SELECT EXISTS (SELECT FROM outbox.ticks t WHERE t.tick OPERATOR(pg_catalog.>) $1)",
        Some(1),
        &[DatumWithOid::from(tick)],
    )?
    .first()
    .get::<bool>(1)?
    .unwrap_or(false))
}

/// The start of the batch after `at`'s, once a tick after its tick is taken: that batch starts
/// from the snapshot `at`'s ended at. None for a read-horizon cursor.
pub(crate) fn next_batch(client: &SpiClient<'_>, at: &At) -> Result<Option<At>, pgrx::spi::Error> {
    let Some(batch) = &at.batch else {
        return Ok(None);
    };
    let table = plans::select(
        client,
        "SELECT t.tick, t.snapshot::text FROM outbox.ticks t \
          WHERE t.tick OPERATOR(pg_catalog.>) $1 ORDER BY t.tick LIMIT 1",
        Some(1),
        &[DatumWithOid::from(batch.tick)],
    )?;
    if table.is_empty() {
        return Ok(None);
    }
    let row = table.first();
    Ok(Some(At {
        pos: Position::ORIGIN,
        batch: Some(Batch {
            tick: row.get::<i64>(1)?.expect("tick is NOT NULL"),
            since: batch.upto.clone(),
            upto: row.get::<String>(2)?.expect("snapshot is NOT NULL"),
        }),
    }))
}

/// Where a reader by ticks whose cursor is still the read horizon's (new, or rewound) starts
/// reading by ticks: in a batch from the snapshot that sees exactly what it has read (every
/// transaction before its position's, as the horizon's cursor means; of its position's own, the
/// events up to it) to the newest tick, once that tick sees all of those ended: every
/// transaction before the position's, and the position's own unless none of its events was read
/// (a position's transaction that this tick saw running would be in the next batch, whole).
/// None until then: it reads by the horizon meanwhile.
pub(crate) fn first_batch(client: &SpiClient<'_>, at: &At) -> Result<Option<At>, pgrx::spi::Error> {
    let table = plans::select(
        client,
        "SELECT t.tick, t.snapshot::text FROM outbox.ticks t \
          WHERE (pg_catalog.pg_snapshot_xmin(t.snapshot) OPERATOR(pg_catalog.>) $1::pg_catalog.xid8 \
                 OR pg_catalog.pg_snapshot_xmin(t.snapshot) OPERATOR(pg_catalog.=) $1::pg_catalog.xid8 \
                    AND $2 OPERATOR(pg_catalog.=) 0) \
          ORDER BY t.tick DESC LIMIT 1",
        Some(1),
        &[
            DatumWithOid::from(at.pos.txid.to_string()),
            DatumWithOid::from(at.pos.seq),
        ],
    )?;
    if table.is_empty() {
        return Ok(None);
    }
    let row = table.first();
    let seen = at.pos.txid.max(1);
    Ok(Some(At {
        pos: at.pos,
        batch: Some(Batch {
            tick: row.get::<i64>(1)?.expect("tick is NOT NULL"),
            since: format!("{seen}:{seen}:"),
            upto: row.get::<String>(2)?.expect("snapshot is NOT NULL"),
        }),
    }))
}

/// How many events the window after `after` holds, and the last one's position, without reading
/// the events themselves (for a window that could not be read whole).
pub(crate) fn window_shape(
    client: &SpiClient<'_>,
    after: Position,
    max: u32,
) -> Result<(usize, Option<Position>), pgrx::spi::Error> {
    let table = plans::select(
        client,
        "SELECT count(*)::int8, (pg_catalog.array_agg(r.position ORDER BY r.n))[count(*)::int4] \
           FROM outbox._read_window($1::pg_catalog.xid8, $2, $3, $4) r",
        Some(1),
        &[
            DatumWithOid::from(after.txid.to_string()),
            DatumWithOid::from(after.seq),
            DatumWithOid::from(max as i32),
            DatumWithOid::from(settings::MAX_BATCH_BYTES.get() as i64),
        ],
    )?;
    let row = table.first();
    let count = row.get::<i64>(1)?.unwrap_or(0) as usize;
    let last = row
        .get::<String>(2)?
        .map(|p| p.parse().expect("positions are well-formed"));
    Ok((count, last))
}

/// [`window_shape`] for a sink that may read by ticks (the window [`read_window`] would read).
pub(crate) fn window_shape_at(
    client: &SpiClient<'_>,
    after: &At,
    max: u32,
) -> Result<(usize, Option<At>), pgrx::spi::Error> {
    let mut at = after.clone();
    for _ in 0..BATCHES_PER_WINDOW {
        let Some(batch) = &at.batch else {
            let (count, last) = window_shape(client, at.pos, max)?;
            return Ok((count, last.map(At::horizon)));
        };
        /// The count and last position of a window from `$source`.
        macro_rules! shape {
            ($source:expr) => {
                concat!(
                    "SELECT count(*)::int8, (pg_catalog.array_agg(r.position ORDER BY r.n))[count(*)::int4] FROM ",
                    $source,
                    " r"
                )
            };
        }
        let read = crate::ticks::BatchArgs::of(&batch.since, &batch.upto, at.pos);
        let sql = match read.range {
            true => shape!(crate::ticks::batch_window!(range, "$5", "$6", "$4")),
            false => shape!(crate::ticks::batch_window!(both, "$5", "$6", "$4")),
        };
        let [t, q] = read.position();
        let [a, b] = read.batch();
        let table = plans::select(
            client,
            sql,
            Some(1),
            &[
                t,
                q,
                DatumWithOid::from(max as i32),
                DatumWithOid::from(settings::MAX_BATCH_BYTES.get() as i64),
                a,
                b,
            ],
        )?;
        let row = table.first();
        let count = row.get::<i64>(1)?.unwrap_or(0) as usize;
        if count > 0 {
            let last = row.get::<String>(2)?.map(|p| At {
                pos: p.parse().expect("positions are well-formed"),
                batch: at.batch.clone(),
            });
            return Ok((count, last));
        }
        match next_batch(client, &at)? {
            Some(next) => at = next,
            None => break,
        }
    }
    Ok((0, None))
}

/// Calls the handler on `events` (an outbox.event[] datum) in a subtransaction, as the sink's
/// owner, under the sink timeout.
fn deliver(
    client: &mut SpiClient<'_>,
    sink: &Sink,
    events: pg_sys::Datum,
    neighbour: bool,
    before: usize,
) -> Result<(), Failure> {
    let target = crate::worker::Target::Sink {
        id: &sink.id,
        neighbour,
        before: before.min(u32::MAX as usize) as u32,
    };
    call_handler(client, sink, events, target)
}

/// Calls the sink's handler on `events` as [`deliver`] does; `target` says what the call works
/// on, should it hang.
fn call_handler(
    client: &mut SpiClient<'_>,
    sink: &Sink,
    events: pg_sys::Datum,
    target: crate::worker::Target<'_>,
) -> Result<(), Failure> {
    let sql = format!("SELECT {}($1)", sink.call);
    // SAFETY: the datum is an outbox.event[] read in this SPI connection, still alive.
    let arg = unsafe { DatumWithOid::new(events, sink.event_array_type) };
    as_handler_owner(sink.owner, target, || {
        // select, not update: pgrx's update path asks for a transaction id before the handler
        // runs (see `lease`). The handler, a volatile function, still writes.
        plans::call(client, &sql, &[arg])
            .map(|_| ())
            .unwrap_or_else(|e| panic!("{e}"));
    })
}

/// Runs `f` (a handler call) in a subtransaction, as `owner`, under the handler timeout
/// (`pg_outbox.sink_timeout`): the way SECURITY DEFINER switches users, restricted so the handler
/// cannot SET ROLE its way out, in a GUC nest level of its own so that nothing it sets outlives
/// it (`crate::isolation`). An ERROR rolls the subtransaction back and comes back as a value.
pub(crate) fn as_handler_owner<R>(
    owner: pg_sys::Oid,
    target: crate::worker::Target<'_>,
    f: impl FnOnce() -> R,
) -> Result<R, Failure> {
    as_handler_owner_within(owner, target, settings::SINK_TIMEOUT_MS.get(), f)
}

/// SET CONSTRAINTS ALL IMMEDIATE, without SPI (whose write path would take a transaction id,
/// held while a tenant's code runs).
fn all_constraints_immediate() {
    let mut stmt = pg_sys::ConstraintsSetStmt {
        type_: pg_sys::NodeTag::T_ConstraintsSetStmt,
        constraints: std::ptr::null_mut(),
        deferred: false,
    };
    // SAFETY: a ConstraintsSetStmt for ALL (a NIL list) and IMMEDIATE, as the parser makes it;
    // AfterTriggerSetState only reads it.
    unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| pg_sys::AfterTriggerSetState(&mut stmt));
    }
}

/// [`as_handler_owner`], with `timeout_ms` in place of `pg_outbox.sink_timeout` (the grace
/// before the worker is ended stays that of `sink_timeout`).
///
/// Every constraint is made immediate first: PostgreSQL refuses to queue a deferred trigger
/// event in a handler (a security-restricted operation), so a handler's deferrable constraints
/// are checked at the end of its statements, as its owner, whatever a handler before it in this
/// transaction (another role's, in a fan-out pass) did with SET CONSTRAINTS. No deferred event
/// is pending then (none can be queued in a handler), so this fires nothing.
pub(crate) fn as_handler_owner_within<R>(
    owner: pg_sys::Oid,
    target: crate::worker::Target<'_>,
    timeout_ms: i32,
    f: impl FnOnce() -> R,
) -> Result<R, Failure> {
    all_constraints_immediate();
    TIMED_OUT.with(|t| t.set(false));
    let grace = settings::SINK_TIMEOUT_MS.get().min(HARD_TIMEOUT_GRACE_MS);
    in_subtransaction(|| {
        let (mut user, mut context) = (pg_sys::InvalidOid, 0i32);
        // SAFETY: the subtransaction's end restores the user if the handler raises. The timeout
        // is the one statement_timeout uses; disabled on both paths.
        unsafe {
            pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
            pg_sys::SetUserIdAndSecContext(
                owner,
                context
                    | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32
                    | pg_sys::SECURITY_RESTRICTED_OPERATION as i32,
            );
            enable_timeout_after(STATEMENT_TIMEOUT, timeout_ms);
            // A handler may catch the cancel: after a grace the worker itself is ended.
            if let Some(hard) = crate::worker::hard_timeout_id() {
                enable_timeout_after(hard, timeout_ms.saturating_add(grace));
            }
        }
        struct Restore(pg_sys::Oid, i32);
        impl Drop for Restore {
            fn drop(&mut self) {
                // SAFETY: undoes exactly the two changes above (reading first whether the
                // timeout fired).
                unsafe {
                    let fired = pg_sys::ffi::pg_guard_ffi_boundary(|| {
                        get_timeout_indicator_raw(STATEMENT_TIMEOUT, false)
                    });
                    TIMED_OUT.with(|t| t.set(fired));
                    disable_timeout(STATEMENT_TIMEOUT, false);
                    if let Some(hard) = crate::worker::hard_timeout_id() {
                        disable_timeout(hard, false);
                    }
                    pg_sys::SetUserIdAndSecContext(self.0, self.1);
                }
            }
        }
        let _restore = Restore(user, context);
        // Dropped first: the handler's settings are undone while still acting as its owner.
        let _nest = crate::isolation::NestLevel::for_handler();
        let _running = crate::worker::HandlerRunning::enter(target);
        f()
    })
}

pub(crate) fn save_state(
    client: &mut SpiClient<'_>,
    sink: &str,
    state: SinkState,
    delay: Option<Duration>,
    down: bool,
    failure: Option<&Failure>,
    delivered: usize,
) -> Result<(), pgrx::spi::Error> {
    plans::update(
        client,
        "UPDATE outbox.sinks SET current_batch = $2, attempts = $3, \
                next_attempt_at = CASE WHEN $4::int8 IS NULL THEN NULL \
                                       ELSE pg_catalog.now() + $4::int8 * interval '1 millisecond' END, \
                down = $5, transient = 0, \
                last_error = coalesce($6, last_error), last_sqlstate = coalesce($7, last_sqlstate), \
                last_error_at = CASE WHEN $6 IS NULL THEN last_error_at ELSE pg_catalog.now() END, \
                delivered = delivered + $8, failures = failures + CASE WHEN $6 IS NULL THEN 0 ELSE 1 END, \
                last_delivered_at = CASE WHEN $8 > 0 THEN pg_catalog.now() ELSE last_delivered_at END \
          WHERE id = $1",
        None,
        &[
            DatumWithOid::from(sink),
            DatumWithOid::from(state.batch.min(i32::MAX as u32) as i32),
            DatumWithOid::from(state.attempts.min(i32::MAX as u32) as i32),
            DatumWithOid::from(delay.map(|d| d.as_millis().min(i64::MAX as u128) as i64)),
            DatumWithOid::from(down),
            DatumWithOid::from(failure.map(|f| f.message.clone())),
            // HTTP failures have no SQLSTATE.
            DatumWithOid::from(failure.map(|f| f.sqlstate.clone()).filter(|s| !s.is_empty())),
            DatumWithOid::from(delivered as i64),
        ],
    )?;
    Ok(())
}

/// One pass over one sink. Runs inside the worker's transaction: a dead letter asked for again,
/// or the windows after the cursor, one batch after the other while they come full, up to
/// `pg_outbox.pass_max_events` and `pg_outbox.pass_max_time` ([`deliver_windows`]).
pub fn pass(id: &str) -> PassResult {
    if !lock_tables() {
        return PassResult::Skipped;
    }
    let leased = Spi::connect_mut(|client| {
        let sink = match lease(&*client, id)? {
            Leased::Sink(sink) => sink,
            Leased::Contended => return Ok(Err(PassResult::Contended)),
            Leased::Absent => return Ok(Err(PassResult::Skipped)),
        };
        match crate::replay::deliver_requested(client, &sink.id, |c, events| {
            call_handler(
                c,
                &sink,
                events,
                crate::worker::Target::Replay { sink: &sink.id },
            )
        })? {
            Some(result) => Ok(Err(result)),
            None => Ok(Ok(sink)),
        }
    })
    .map_err(|e: pgrx::spi::Error| e);
    let mut sink = match leased {
        Ok(Ok(sink)) => sink,
        Ok(Err(result)) => return result,
        Err(e) => panic!("sink \"{id}\": {e}"),
    };
    if !sink.synchronous_commit {
        crate::isolation::commit_without_waiting_for_flush();
    }
    let reach = Reach {
        events: settings::PASS_MAX_EVENTS.get().max(1) as usize,
        until: Some(
            Instant::now() + Duration::from_millis(settings::PASS_MAX_TIME_MS.get().max(0) as u64),
        ),
        exact: false,
    };
    start_reading_by_ticks(&mut sink);
    match deliver_windows(&mut sink, &reach) {
        Ok(Windows::Failed(result)) => result,
        Ok(Windows::Went { handed: 0, .. }) => PassResult::Idle,
        Ok(Windows::Went {
            delivered, full, ..
        }) => PassResult::Delivered {
            events: delivered,
            full,
        },
        Err(e) => panic!("sink \"{id}\": {e}"),
    }
}

/// A sink that reads by ticks and whose cursor is still the read horizon's starts its first batch
/// when a tick allows ([`first_batch`]), saved at once (with the pass).
fn start_reading_by_ticks(sink: &mut Sink) {
    if !sink.by_ticks || sink.cursor.batch.is_some() {
        return;
    }
    if let Some(at) = Spi::connect(|client| first_batch(client, &sink.cursor))
        .unwrap_or_else(|e: pgrx::spi::Error| panic!("sink \"{}\": {e}", sink.id))
    {
        cursor::save_at(&sink.id, &at);
        sink.cursor = at;
    }
}

/// Handler calls one pass makes at most, whatever `pg_outbox.pass_max_events` allows: each is a
/// subtransaction, and a handler that writes gives each its own transaction id, held until the
/// pass commits. Past 64 of them PostgreSQL's per-backend cache of subtransaction ids overflows,
/// and every snapshot in the cluster then looks them up in pg_subtrans; each also holds a lock.
const MAX_CALLS_PER_PASS: usize = 32;

/// How far a pass goes on after its first window.
struct Reach {
    /// Events handed over at most (the first window is always read whole).
    events: usize,
    /// No further window after this.
    until: Option<Instant>,
    /// Windows are cut to end exactly at `events` (replaying what a lost pass handed over).
    exact: bool,
}

/// Where a pass's windows ended.
enum Windows {
    /// Every window read went through; `full`: the last one was full (more may wait).
    Went {
        handed: usize,
        delivered: usize,
        full: bool,
    },
    /// A window failed; what went through before it is saved, and the failure policy gave this.
    Failed(PassResult),
}

/// Hands the windows after `sink`'s cursor to its handler, each in a subtransaction of the
/// caller's transaction, one after the other while they come full and `reach` allows. The cursor
/// and the sink's state are saved once, at the end. A window that fails ends it: what went
/// through is saved, then the failure policy takes that window as the first of a pass would, so
/// a pass of many windows behaves as many passes of one that commit together.
fn deliver_windows(sink: &mut Sink, reach: &Reach) -> Result<Windows, pgrx::spi::Error> {
    let policy = settings::policy(sink.max_batch);
    let start = sink.cursor.clone();
    let (mut handed, mut delivered, mut went) = (0usize, 0usize, false);
    let mut calls = 0usize;
    loop {
        let mut max = sink.state.batch.min(sink.max_batch);
        if reach.exact {
            max = max.min(reach.events.saturating_sub(handed).max(1) as u32);
        }
        // Each window in an SPI connection of its own: what it read is freed before the next.
        let step = Spi::connect_mut(|client| {
            // Reading the window is the events' doing as much as a handler's failure is: one that
            // cannot be read goes through the failure policy too, so it is bisected to the event
            // that cannot be, which is dead-lettered after the neighbour test.
            let window = match crate::transaction::in_subtransaction(|| {
                read_window(client, &sink.cursor, max, &sink.topic_regex)
            }) {
                Ok(window) => window?,
                Err(failure) => {
                    let (count, last) = window_shape_at(client, &sink.cursor, max)?;
                    let Some(last) = last else {
                        return Ok(None);
                    };
                    let failure = Failure {
                        message: format!("reading the batch failed: {}", failure.message),
                        ..failure
                    };
                    save_progress(client, sink, &start, went.then_some(delivered))?;
                    return failed_batch(client, sink, count, last, None, failure, handed)
                        .map(|r| Some(Err(r)));
                }
            };
            let Some(last) = window.last else {
                return Ok(None);
            };
            // Nothing here for this sink's topics: move past the window.
            if let Some(events) = window.events {
                calls += 1;
                if let Err(failure) = deliver(client, sink, events, false, handed) {
                    save_progress(client, sink, &start, went.then_some(delivered))?;
                    return failed_batch(
                        client,
                        sink,
                        window.count,
                        last,
                        Some(events),
                        failure,
                        handed,
                    )
                    .map(|r| Some(Err(r)));
                }
                sink.state = policy.after_success(sink.state);
                delivered += window.matching;
                went = true;
            }
            sink.cursor = last;
            handed += window.count;
            Ok(Some(Ok(window.more)))
        })?;
        let full = match step {
            Some(Ok(full)) => full,
            Some(Err(failed)) => return Ok(Windows::Failed(failed)),
            None => false,
        };
        let more = full
            && handed < reach.events
            && calls < MAX_CALLS_PER_PASS
            && reach.until.is_none_or(|until| Instant::now() < until)
            && !crate::worker::stop_requested();
        if !more {
            Spi::connect_mut(|client| {
                save_progress(client, sink, &start, went.then_some(delivered))
            })?;
            return Ok(Windows::Went {
                handed,
                delivered,
                full,
            });
        }
    }
}

/// Saves what a pass's windows did: the cursor if it moved past `start`, and the sink's state if
/// a handler call went through (`delivered`: how many events they were handed).
fn save_progress(
    client: &mut SpiClient<'_>,
    sink: &Sink,
    start: &At,
    delivered: Option<usize>,
) -> Result<(), pgrx::spi::Error> {
    if sink.cursor != *start {
        cursor::save_at(&sink.id, &sink.cursor);
    }
    match delivered {
        Some(delivered) => save_state(client, &sink.id, sink.state, None, false, None, delivered),
        None => Ok(()),
    }
}

/// A batch of `count` events ending at `last` failed: the failure policy decides (halve, back
/// off, or test the neighbour and maybe dead-letter), and the sink's state is saved.
fn failed_batch(
    client: &mut SpiClient<'_>,
    sink: &Sink,
    count: usize,
    last: At,
    events: Option<pg_sys::Datum>,
    failure: Failure,
    before: usize,
) -> Result<PassResult, pgrx::spi::Error> {
    let policy = settings::policy(sink.max_batch);
    match policy.after_failure(sink.state, count as u32) {
        AfterFailure::Halve(state) => {
            save_state(client, &sink.id, state, None, false, Some(&failure), 0)?;
            Ok(PassResult::Retry)
        }
        AfterFailure::Retry { state, delay } => {
            pgrx::warning!(
                "pg_outbox: sink \"{}\" failed on event {last} (attempt {}), retrying in {delay:?}: {failure}",
                sink.id,
                state.attempts
            );
            save_state(
                client,
                &sink.id,
                state,
                Some(delay),
                false,
                Some(&failure),
                0,
            )?;
            Ok(PassResult::Failed)
        }
        AfterFailure::TestNeighbour(state) => {
            pgrx::warning!(
                "pg_outbox: sink \"{}\" failed on event {last} (attempt {}), testing its neighbour: {failure}",
                sink.id,
                state.attempts
            );
            neighbour_test(client, sink, state, last, events, failure, before)
        }
    }
}

/// The failure a handler call that ended its worker counts as.
pub(crate) fn hang_failure() -> Failure {
    Failure {
        sqlstate: "57014".into(),
        message: format!(
            "the handler ran past pg_outbox.sink_timeout ({} ms) and did not stop; the worker running it was ended",
            settings::SINK_TIMEOUT_MS.get()
        ),
    }
}

/// A sink's handler call ended its worker (see `worker::InHandler`): count that as the failure of
/// that batch, durably, and go on with the failure policy, so that a handler that always hangs
/// moves through halving, back-off and the neighbour test to the dead letters like any failing
/// handler. `neighbour`: the hung call was the neighbour test, so the sink is down. `before`: the
/// pass had handed over that many events before, in the transaction lost with the worker; they
/// are handed over again first, so the failure is counted against the batch that hung. Runs in
/// the transaction of the worker started in the ended one's place, before its first round.
pub fn after_hang(id: &str, neighbour: bool, before: u32) {
    if !lock_tables() {
        return;
    }
    let Leased::Sink(mut sink) = Spi::connect(|client| lease(client, id))
        .unwrap_or_else(|e: pgrx::spi::Error| panic!("sink \"{id}\": {e}"))
    else {
        return;
    };
    start_reading_by_ticks(&mut sink);
    if before > 0 {
        let again = Reach {
            events: before as usize,
            until: None,
            exact: true,
        };
        match deliver_windows(&mut sink, &again) {
            // The batches before went through again: the next one is the one that hung.
            Ok(Windows::Went { handed, .. }) if handed >= before as usize => {}
            // One of them failed now (its failure is counted), or the log is not as it was.
            Ok(_) => return,
            Err(e) => panic!("sink \"{id}\": {e}"),
        }
    }
    Spi::connect_mut(|client| {
        let failure = hang_failure();
        let policy = settings::policy(sink.max_batch);
        let window = read_window(
            client,
            &sink.cursor,
            sink.state.batch.min(sink.max_batch),
            &sink.topic_regex,
        )?;
        let (Some(last), Some(events)) = (window.last, window.events) else {
            return Ok(());
        };
        if neighbour {
            pgrx::warning!("pg_outbox: sink \"{id}\" is down (its neighbour test hung): {failure}");
            // The lone event's failures that led to the test were counted in the lost transaction
            // when the pass handed events over before it: count its failure again first.
            let state = match policy.after_failure(sink.state, 1) {
                AfterFailure::TestNeighbour(state) | AfterFailure::Retry { state, .. } => state,
                AfterFailure::Halve(state) => state,
            };
            let AfterNeighbour::Down { state, delay } = policy.after_neighbour(state, Some(false))
            else {
                unreachable!()
            };
            return save_state(
                client,
                &sink.id,
                state,
                Some(delay),
                true,
                Some(&failure),
                0,
            );
        }
        failed_batch(
            client,
            &sink,
            window.count,
            last,
            Some(events),
            failure,
            before as usize,
        )
        .map(|_| ())
    })
    .unwrap_or_else(|e: pgrx::spi::Error| panic!("sink \"{id}\": {e}"))
}

/// The lone event at `lone` failed `poison_after` times: deliver the next event alone. If it
/// goes through, `lone` is poison; if not, or there is none yet, the sink is down.
fn neighbour_test(
    client: &mut SpiClient<'_>,
    sink: &Sink,
    state: SinkState,
    lone: At,
    lone_events: Option<pg_sys::Datum>,
    failure: Failure,
    before: usize,
) -> Result<PassResult, pgrx::spi::Error> {
    let policy = settings::policy(sink.max_batch);
    // The neighbour is the next event this sink would receive, within one batch of the lone one.
    let (neighbour, outcome) =
        match first_match_span(client, &lone, sink.max_batch, &sink.topic_regex)? {
            Some((from, span)) => {
                let window = read_window(client, &from, span, &sink.topic_regex)?;
                let events = window.events.expect("the span ends at a matching event");
                (
                    window.last,
                    Some(deliver(client, sink, events, true, before)),
                )
            }
            None => (None, None),
        };
    match (neighbour, outcome) {
        (Some(neighbour), Some(Ok(()))) => {
            let AfterNeighbour::DeadLetter(fresh) = policy.after_neighbour(state, Some(true))
            else {
                unreachable!()
            };
            // The event as the handler got it; or, if it could not be read into a batch, as the
            // log holds it.
            client.update(
                "INSERT INTO outbox.dead_letters (sink, txid, seq, event, error, sqlstate, attempts) \
                 SELECT $1, $2::pg_catalog.xid8, $3, \
                        coalesce(($4::outbox.event[])[1], \
                                 ROW(e.id, e.txid::text || ':' || e.seq::text, e.topic, e.subject, \
                                     e.tenant, e.payload, e.headers, e.raised_at)::outbox.event), \
                        $5, $6, $7 \
                   FROM outbox.events e WHERE e.txid = $2::pg_catalog.xid8 AND e.seq = $3 \
                 ON CONFLICT (sink, txid, seq) DO UPDATE SET event = EXCLUDED.event, error = EXCLUDED.error, \
                      sqlstate = EXCLUDED.sqlstate, attempts = EXCLUDED.attempts, dead_at = pg_catalog.now(), \
                      replay_requested_at = NULL",
                None,
                &[
                    DatumWithOid::from(sink.id.as_str()),
                    DatumWithOid::from(lone.pos.txid.to_string()),
                    DatumWithOid::from(lone.pos.seq),
                    match lone_events {
                        // SAFETY: the lone event's outbox.event[] datum from this connection.
                        Some(events) => unsafe {
                            DatumWithOid::new(events, sink.event_array_type)
                        },
                        None => DatumWithOid::null_oid(sink.event_array_type),
                    },
                    DatumWithOid::from(failure.message.as_str()),
                    DatumWithOid::from(failure.sqlstate.as_str()),
                    DatumWithOid::from(state.attempts as i32),
                ],
            )?;
            cursor::save_at(&sink.id, &neighbour);
            save_state(client, &sink.id, fresh, None, false, Some(&failure), 1)?;
            pgrx::warning!(
                "pg_outbox: sink \"{}\" dead-lettered event {lone} after {} attempts (its neighbour {neighbour} went through): {failure}",
                sink.id,
                state.attempts
            );
            Ok(PassResult::Delivered {
                events: 1,
                full: false,
            })
        }
        (_, outcome) => {
            // Here the neighbour failed (Some(false)) or there is none yet (None).
            let neighbour_ok = outcome.as_ref().map(|o| o.is_ok());
            let AfterNeighbour::Down { state, delay } = policy.after_neighbour(state, neighbour_ok)
            else {
                unreachable!()
            };
            let down = neighbour_ok.is_some();
            if down {
                pgrx::warning!("pg_outbox: sink \"{}\" is down (its neighbour failed too), retrying in {delay:?}", sink.id);
            }
            save_state(
                client,
                &sink.id,
                state,
                Some(delay),
                down,
                Some(&failure),
                0,
            )?;
            Ok(PassResult::Failed)
        }
    }
}

/// Where to read from, and how many events, so that the window ends at the first event the sink's
/// topics match after `after` (the neighbour), at most `max_batch`. For a sink that reads by
/// ticks the window is within one batch: past the end of `after`'s batch (when what is left of it
/// is none of the sink's), it starts at the beginning of the next.
pub(crate) fn first_match_span(
    client: &SpiClient<'_>,
    after: &At,
    max_batch: u32,
    topic_regex: &Option<String>,
) -> Result<Option<(At, u32)>, pgrx::spi::Error> {
    let mut at = after.clone();
    for _ in 0..BATCHES_PER_WINDOW {
        let args = [
            DatumWithOid::from(at.pos.txid.to_string()),
            DatumWithOid::from(at.pos.seq),
            DatumWithOid::from(max_batch as i32),
            DatumWithOid::from(topic_regex.clone()),
        ];
        let Some(batch) = &at.batch else {
            let table = client.select(
                "SELECT r.n FROM outbox._read_after($1::pg_catalog.xid8, $2, $3) WITH ORDINALITY \
                      AS r(id, position, topic, subject, tenant, payload, headers, raised_at, n) \
                  WHERE $4::text IS NULL OR r.topic ~ $4 ORDER BY r.n LIMIT 1",
                Some(1),
                &args,
            )?;
            if table.is_empty() {
                return Ok(None);
            }
            return Ok(table.first().get::<i64>(1)?.map(|n| (at, n as u32)));
        };
        /// The first event after `$1`/`$2` the sink's topics match, within `$3` events of
        /// `$source`, and how many events those are.
        macro_rules! span {
            ($source:expr) => {
                concat!(
                    "SELECT (SELECT r.n FROM (SELECT l.topic, pg_catalog.row_number() OVER (ORDER BY l.txid, l.seq) AS n \
                                                FROM ",
                    $source,
                    " l) r WHERE $4::text IS NULL OR r.topic ~ $4 ORDER BY r.n LIMIT 1), \
                            (SELECT pg_catalog.count(*) FROM ",
                    $source,
                    " l)"
                )
            };
        }
        let read = crate::ticks::BatchArgs::of(&batch.since, &batch.upto, at.pos);
        let sql = match read.range {
            true => span!(crate::ticks::batch_rows!(range, "$5", "$6")),
            false => span!(crate::ticks::batch_rows!(both, "$5", "$6")),
        };
        let [_, _, m, re] = args;
        let [t, q] = read.position();
        let [a, b] = read.batch();
        let table = client.select(sql, Some(1), &[t, q, m, re, a, b])?;
        let row = table.first();
        if let Some(n) = row.get::<i64>(1)? {
            return Ok(Some((at, n as u32)));
        }
        // As many events after `at` as a batch takes, none of them the sink's: no neighbour
        // within one batch. Fewer: the rest of this tick's batch is none of the sink's.
        if row.get::<i64>(2)?.unwrap_or(0) >= max_batch as i64 {
            return Ok(None);
        }
        match next_batch(client, &at)? {
            Some(next) => at = next,
            None => return Ok(None),
        }
    }
    Ok(None)
}
