//! Pruning: remove what every consumer has passed and the retention allows.
//!
//! An outbox that is never pruned takes the site down (pg_cron's run history did). One that is
//! pruned carelessly loses events. So: only events behind the lowest cursor of every consumer (a
//! consumer that never advanced holds the log) and behind the read horizon, only events older
//! than the retention.
//!
//! The workers prune every `pg_outbox.prune_interval` by truncating whole partitions of the log
//! (`pg_outbox_core::rotation`): no dead tuples and no index bloat on the hottest table. Only
//! when a reader holds a partition past a short wait, or a transaction older than the cursors
//! still runs after another (TRUNCATE is not MVCC-safe), do they DELETE its passed events
//! instead, batch by batch.
//! `outbox.prune()`, for operators, deletes exactly what may go, in bounded batches in log order.

use crate::error::{Error, OrReport};
use crate::owner::as_owner;
use crate::read_rule;
use crate::settings;
use pg_outbox_core::limits::PRUNE_BATCH_MAX;
use pg_outbox_core::rotation;
use pg_outbox_core::{required, Invalid, InvalidKind, Position};
use pgrx::datum::{DatumWithOid, Interval};
use pgrx::prelude::*;

/// The highest position pruning may reach: the lowest cursor, and never past the horizon.
///
/// Takes the cursor lock exclusively first, then reads the cursors with a fresh snapshot: a
/// consumer created (or rewound) concurrently has either committed and is seen, or waits for
/// this transaction and then reads the log as pruned. None when the lock cannot be had without
/// waiting and `wait` is false (the workers): pruning is skipped this time.
fn prune_bound(wait: bool) -> Option<Position> {
    if !crate::lease::cursors_exclusive(wait) {
        return None;
    }
    let horizon = Position::at_horizon(read_rule::horizon());
    // The read-write path on purpose: it takes a snapshot newer than the lock.
    // ORDER BY c.txid, not txid: a bare name in ORDER BY means the output column first, here
    // txid::text, and text orders "10674" before "5099". That bound let pruning delete events a
    // lagging consumer had not read (found by the chaos soak).
    // A reader by ticks has read every event of the transactions its batch's `since` sees: all
    // those before that snapshot's xmin (the rest of what it has read is not a prefix of the log).
    let lowest = Spi::get_two::<String, i64>(
        "SELECT b.txid::text, b.seq FROM (\
             SELECT CASE WHEN c.tick IS NULL THEN c.txid ELSE pg_snapshot_xmin(c.since) END AS txid, \
                    CASE WHEN c.tick IS NULL THEN c.seq ELSE 0 END AS seq \
               FROM outbox.consumers c) b \
          ORDER BY b.txid, b.seq LIMIT 1",
    );
    match lowest {
        Ok((Some(txid), Some(seq))) => {
            Some(Position::new(txid.parse().expect("xid8 prints as an integer"), seq).min(horizon))
        }
        Ok(_) | Err(pgrx::spi::Error::InvalidPosition) => Some(horizon),
        Err(e) => panic!("reading cursors: {e}"),
    }
}

/// Deletes prunable events raised before `cutoff_sql` (an SQL expression over $4), in batches of
/// `batch_size`. Runs as the owner; waits for the cursor lock (an operator's call, which they can
/// cancel).
fn prune_events(retention: DatumWithOid<'_>, cutoff_sql: &str, batch_size: i32) -> i64 {
    // SAFETY: reads a backend global.
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        Error::Isolation {
            what: "outbox.prune()",
            why: "it needs to see cursors committed while it waited",
        }
        .report();
    }
    let sql = format!(
        "WITH batch AS ( \
            SELECT txid, seq, part, raised_at FROM outbox.events \
             WHERE (txid, seq) <= ($1::xid8, $2) \
             ORDER BY txid, seq LIMIT $3), \
         gone AS ( \
            DELETE FROM outbox.events e USING batch b \
             WHERE (e.txid, e.seq, e.part) = (b.txid, b.seq, b.part) \
               AND b.raised_at < {cutoff_sql} \
            RETURNING 1) \
         SELECT (SELECT count(*) FROM batch), (SELECT count(*) FROM gone)"
    );
    as_owner(|| {
        let Some(bound) = prune_bound(true) else {
            return 0;
        };
        let mut total = 0i64;
        loop {
            let (scanned, deleted) = Spi::get_two_with_args::<i64, i64>(
                &sql,
                &[
                    DatumWithOid::from(bound.txid.to_string()),
                    DatumWithOid::from(bound.seq),
                    DatumWithOid::from(batch_size as i64),
                    // SAFETY: the same value and type, once per batch.
                    unsafe { DatumWithOid::new_from_datum(retention.datum(), retention.oid()) },
                ],
            )
            .expect("pruning a batch");
            let (scanned, deleted) = (scanned.unwrap_or(0), deleted.unwrap_or(0));
            total += deleted;
            // A short batch reached the bound; a batch with a kept (young) event reached the
            // retained part of the log. Either way, the rest waits for a later call.
            if scanned < batch_size as i64 || deleted < scanned {
                break total;
            }
        }
    })
}

/// Deletes events that every consumer has passed and that are older than `retention`; returns
/// how many. Works in batches of `batch_size` in log order and stops at a batch that holds an event
/// still within the retention, so one call never scans the retained part of the log.
#[pg_extern(volatile, parallel_unsafe)]
fn prune(
    retention: default!(Option<Interval>, "'7 days'"),
    batch_size: default!(Option<i32>, "10000"),
) -> i64 {
    let retention = required(retention, "retention").or_report();
    let batch_size = required(batch_size, "batch_size").or_report();
    if !(1..=PRUNE_BATCH_MAX).contains(&batch_size) {
        Error::from(Invalid::new(
            InvalidKind::Parameter,
            format!("batch_size must be between 1 and {PRUNE_BATCH_MAX}, not {batch_size}"),
        ))
        .report();
    }
    // Checked here: now() - retention out of the timestamp range would fail inside the DELETE.
    let in_range = crate::query::one::<bool>(
        "SELECT $1 OPERATOR(pg_catalog.>=) '0'::pg_catalog.interval \
            AND $1 OPERATOR(pg_catalog.<=) '1000 years'::pg_catalog.interval",
        &[DatumWithOid::from(retention)],
    )
    .unwrap_or(false);
    if !in_range {
        Error::from(Invalid::new(
            InvalidKind::Parameter,
            "retention must be between 0 and 1000 years",
        ))
        .report();
    }
    prune_events(DatumWithOid::from(retention), "now() - $4", batch_size)
}

/// The partitions of the log that have aged past `pg_outbox.retention` by the clock (see
/// `pg_outbox_core::rotation`); the worker prunes each in a transaction of its own
/// ([`prune_partition`]).
pub fn aged_partitions() -> Vec<i16> {
    let retention_s = settings::RETENTION_S.get() as i64;
    let period_s = period_s();
    // SAFETY: reads the clock.
    let now_us = unix_us(unsafe { pg_sys::GetCurrentTimestamp() });
    (0..rotation::PARTITIONS as i16)
        .filter(|&k| rotation::aged(k, now_us, period_s, retention_s))
        .collect()
}

/// The period by which the partitions of the log take turns, in seconds, from the settings.
pub fn period_s() -> i64 {
    rotation::period_s(
        settings::RETENTION_S.get() as i64,
        settings::PRUNE_INTERVAL_S.get() as i64,
    )
}

/// Records the period in `outbox.log_rotation` if it is not the one recorded: a worker does as
/// soon as it reloads settings that change it, so that the hold-off after a change starts then,
/// not at the next prune (a change and a change back between two prunes would go unseen).
pub fn record_period() {
    if !crate::dispatch::lock_tables() {
        return;
    }
    // SAFETY: reads the clock.
    let now_us = unix_us(unsafe { pg_sys::GetCurrentTimestamp() });
    as_owner(|| rotation_since(period_s(), now_us));
}

/// What the worker's prune did to one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pruned {
    /// Nothing: the period has not settled, a reader has not passed all of it, it was empty, or
    /// the cursors were locked.
    Nothing,
    /// Truncated: every event in it was passed.
    Truncated,
    /// Not truncated, though every reader passed it: the worker DELETEs what they passed instead,
    /// batch by batch ([`delete_passed`]), as `outbox.prune()` does.
    Delete(Why),
}

/// Why a partition every reader passed was not truncated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Its lock could not be had in time: readers of the log held it.
    Held,
    /// A transaction older than the cursors read for the bound was running (pg_dump's, say):
    /// TRUNCATE is not MVCC-safe, and it would find the partition empty while it still sees
    /// cursors behind the events.
    OlderSnapshot,
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Why::Held => "a reader held it",
            Why::OlderSnapshot => "a transaction older than the cursors was running",
        })
    }
}

/// The worker's timed prune of partition `k` (one of [`aged_partitions`]), in a transaction of
/// its own: truncates it once every reader has passed all of it. The partition's lock is held
/// only while that is checked and done: when it is not done, the lock goes with a subtransaction
/// rolled back, before any DELETE.
pub fn prune_partition(k: i16) -> Pruned {
    if !crate::dispatch::lock_tables() {
        return Pruned::Nothing;
    }
    let retention_s = settings::RETENTION_S.get() as i64;
    let period_s = period_s();
    // SAFETY: reads the clock.
    let now_us = unix_us(unsafe { pg_sys::GetCurrentTimestamp() });
    let settled = as_owner(|| {
        rotation::settled(
            rotation_since(period_s, now_us),
            now_us,
            period_s,
            retention_s,
        )
    });
    if !settled || !rotation::aged(k, now_us, period_s, retention_s) {
        return Pruned::Nothing;
    }
    let table = format!("outbox.events_{k}");
    let outcome = crate::transaction::in_subtransaction_kept_if(|| {
        // One pruner at a time: two that each held the partition ROW EXCLUSIVE (every worker
        // step does) and waited for it ACCESS EXCLUSIVE would each time out on the other.
        if !crate::lease::cursors_exclusive(false) {
            return (Pruned::Nothing, false);
        }
        // The bound, read before the partition is locked: cursors only move forward, and the
        // bound is below every transaction still running (the read rule's horizon), so it stays
        // a bound for whatever the partition holds once it is locked.
        let Some(bound) = as_owner(|| prune_bound(false)) else {
            return (Pruned::Nothing, false);
        };
        // After the cursors were read: a transaction that began later sees them as they were
        // read, or further on. Those that began before are waited for a moment: under load some
        // application transaction has always just begun, and ends within milliseconds; only
        // one that goes on (a dump, a long report) makes the worker DELETE instead.
        // SAFETY: reads the clock.
        let bound_at = unsafe { pg_sys::GetCurrentTimestamp() };
        // Nothing to truncate, or not all of it passed: nothing to wait for either. (The
        // partition's newest event only grows; it is read again under the lock.)
        if newest_of(&table).is_none_or(|newest| newest > bound) {
            return (Pruned::Nothing, false);
        }
        if !older_snapshots_end(bound_at, OLDER_SNAPSHOT_WAIT) {
            return (Pruned::Delete(Why::OlderSnapshot), false);
        }
        if !lock_partition(k) {
            return (Pruned::Delete(Why::Held), false);
        }
        // Under the lock, nobody raises into the partition, and every transaction that did has
        // ended: its newest position now is the newest it will have held when TRUNCATE empties it.
        if newest_of(&table).is_none_or(|newest| newest > bound) {
            return (Pruned::Nothing, false);
        }
        as_owner(|| Spi::run(&format!("TRUNCATE {table}")))
            .expect("truncating a partition of the log");
        (Pruned::Truncated, true)
    });
    outcome.unwrap_or_else(|f| panic!("pruning {table}: {f}"))
}

/// The position of the newest event of a partition of the log (`table`), None when it is empty.
fn newest_of(table: &str) -> Option<Position> {
    let newest = as_owner(|| {
        // ORDER BY e.txid, not txid: a bare name would sort by the text column of the output
        // ("99998" after "100003"), and truncate past the bound.
        Spi::get_two::<String, i64>(&format!(
            "SELECT e.txid::text, e.seq FROM {table} e ORDER BY e.txid DESC, e.seq DESC LIMIT 1"
        ))
    });
    match newest {
        Ok((Some(txid), Some(seq))) => Some(Position::new(
            txid.parse().expect("xid8 prints as an integer"),
            seq,
        )),
        Ok(_) | Err(pgrx::spi::Error::InvalidPosition) => None,
        Err(e) => panic!("reading {table}: {e}"),
    }
}

/// How long a worker waits for the lock that truncating a partition takes, when readers hold it:
/// the log's other readers (other workers' steps, pull consumers) queue behind it for at most
/// this long.
const TRUNCATE_LOCK_TIMEOUT: &str = "200ms";

/// Locks partition `k` ACCESS EXCLUSIVE: at once when nobody holds it (an idle log: then no
/// reader ever queues behind it), else waiting at most [`TRUNCATE_LOCK_TIMEOUT`]. False when it
/// could not be had (a lock timeout or a deadlock).
fn lock_partition(k: i16) -> bool {
    if lock_partition_now(k) {
        return true;
    }
    let locked = crate::transaction::in_subtransaction(|| {
        Spi::run(&format!(
            "SET LOCAL lock_timeout = '{TRUNCATE_LOCK_TIMEOUT}'; \
             LOCK TABLE outbox.events_{k} IN ACCESS EXCLUSIVE MODE; \
             SET LOCAL lock_timeout = {}",
            crate::isolation::WORKER_LOCK_WAIT_MS
        ))
        .expect("locking a partition of the log");
    });
    match locked {
        Ok(()) => true,
        // 55P03: readers held it past the timeout; 40P01: a deadlock with one, which lost this.
        Err(f) if f.sqlstate == "55P03" || f.sqlstate == "40P01" => false,
        Err(f) => panic!("locking outbox.events_{k}: {f}"),
    }
}

/// How long the worker's prune waits for the transactions that began before it read the cursors
/// to end, before it gives up truncating (and DELETEs). No lock on the log is held meanwhile.
const OLDER_SNAPSHOT_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Waits up to `within` until no other transaction of this database that began before `at` has
/// a snapshot; false if one still has.
fn older_snapshots_end(at: pg_sys::TimestampTz, within: std::time::Duration) -> bool {
    let start = std::time::Instant::now();
    loop {
        if !older_snapshot_running(at) {
            return true;
        }
        if start.elapsed() >= within {
            return false;
        }
        // SAFETY: drops this transaction's copy of the backends' status, so that the next look
        // at pg_stat_activity reads it afresh; then sleeps a millisecond.
        unsafe {
            pg_sys::pgstat_clear_snapshot();
            pg_sys::pg_usleep(1_000);
        }
        pg_sys::check_for_interrupts!();
    }
}

/// Whether another transaction of this database that began before `at` has a snapshot. The
/// workers' own do not count: a worker's transaction holds every partition from its start to its
/// end (see `crate::dispatch::lock_members`), so the partition's lock, taken after this, waits
/// for it to end, and none begins while the caller holds that lock.
fn older_snapshot_running(at: pg_sys::TimestampTz) -> bool {
    // The worker's own identity (a superuser) sees every backend's columns.
    Spi::get_one_with_args::<bool>(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_stat_activity \
                         WHERE pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid() \
                           AND datid = (SELECT oid FROM pg_catalog.pg_database \
                                         WHERE datname = pg_catalog.current_database()) \
                           AND backend_type OPERATOR(pg_catalog.<>) 'autovacuum worker' \
                           AND backend_type OPERATOR(pg_catalog.<>) 'pg_outbox worker' \
                           AND backend_xmin IS NOT NULL \
                           AND (xact_start OPERATOR(pg_catalog.<) $1 \
                                OR xact_start IS NULL AND backend_type OPERATOR(pg_catalog.=) 'client backend'))",
        &[DatumWithOid::from(
            pgrx::datum::TimestampWithTimeZone::try_from(at).expect("a timestamp"),
        )],
    )
    .expect("looking for older snapshots")
    .unwrap_or(true)
}

/// Events one transaction of the worker's prune DELETEs from a partition at most.
pub const DELETE_BATCH: i64 = 10_000;

/// Deletes up to [`DELETE_BATCH`] of the events of partition `k` that every reader has passed
/// (the cursors' bound), in a transaction of the worker's own, and returns how many. The
/// partition has aged: all its events are older than the retention. MVCC-safe, unlike TRUNCATE.
pub fn delete_passed(k: i16) -> i64 {
    if !crate::dispatch::lock_tables() {
        return 0;
    }
    as_owner(|| {
        let Some(bound) = prune_bound(false) else {
            return 0;
        };
        Spi::get_one_with_args::<i64>(
            &format!(
                "WITH batch AS ( \
                    SELECT txid, seq FROM outbox.events_{k} WHERE (txid, seq) <= ($1::xid8, $2) \
                     ORDER BY txid, seq LIMIT $3), \
                 gone AS ( \
                    DELETE FROM outbox.events_{k} e USING batch b \
                     WHERE (e.txid, e.seq) = (b.txid, b.seq) RETURNING 1) \
                 SELECT count(*) FROM gone"
            ),
            &[
                DatumWithOid::from(bound.txid.to_string()),
                DatumWithOid::from(bound.seq),
                DatumWithOid::from(DELETE_BATCH),
            ],
        )
        .expect("deleting passed events")
        .unwrap_or(0)
    })
}

/// Microseconds since 1970 of a PostgreSQL timestamp (microseconds since 2000).
fn unix_us(ts: pg_sys::TimestampTz) -> i64 {
    const Y2K_US: i64 = 946_684_800 * 1_000_000;
    ts.saturating_add(Y2K_US)
}

/// Since when the log has rotated by `period_s` (microseconds since 1970); records the period
/// when it changed (or was never recorded), so that nothing is truncated until every event raised
/// under the old one is older than the retention.
fn rotation_since(period_s: i64, now_us: i64) -> i64 {
    let recorded = Spi::get_two::<i64, i64>(
        "SELECT period_s, (extract(epoch FROM since) * 1000000)::int8 FROM outbox.log_rotation LIMIT 1",
    );
    match recorded {
        Ok((Some(p), Some(since))) if p == period_s => since,
        Ok(_) | Err(pgrx::spi::Error::InvalidPosition) => {
            Spi::run_with_args(
                "WITH gone AS (DELETE FROM outbox.log_rotation) \
                 INSERT INTO outbox.log_rotation (period_s, since) VALUES ($1, pg_catalog.now())",
                &[DatumWithOid::from(period_s)],
            )
            .expect("recording the log's rotation");
            now_us
        }
        Err(e) => panic!("reading the log's rotation: {e}"),
    }
}

/// Locks partition `k` ACCESS EXCLUSIVE if that needs no wait.
fn lock_partition_now(k: i16) -> bool {
    let name = std::ffi::CString::new(format!("events_{k}")).expect("no NUL in a table name");
    // SAFETY: catalog lookups and a lock-manager call that returns false instead of waiting.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"outbox".as_ptr(), false);
        let relid = pg_sys::get_relname_relid(name.as_ptr(), nsp);
        relid != pg_sys::InvalidOid
            && pg_sys::ConditionalLockRelationOid(
                relid,
                pg_sys::AccessExclusiveLock as pg_sys::LOCKMODE,
            )
    }
}

/// `outbox._log_part()`: the default of `outbox.events.part`, the partition for the events of
/// the current transaction (by the time it began, like `raised_at`).
#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo_pg_outbox_log_part() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn pg_outbox_log_part(
    _fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let period_s = period_s();
    // SAFETY: reads the start time of the current transaction (now()).
    let began = unix_us(unsafe { pg_sys::GetCurrentTransactionStartTimestamp() });
    pg_sys::Datum::from(rotation::part(began, period_s))
}
