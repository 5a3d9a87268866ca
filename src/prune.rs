//! Pruning: remove what every consumer has passed and the retention allows.
//!
//! An outbox that is never pruned takes the site down (pg_cron's run history did). One that is
//! pruned carelessly loses events. So: only events behind the lowest cursor of every consumer (a
//! consumer that never advanced holds the log) and behind the read horizon, only events older
//! than the retention.
//!
//! The workers prune every `pg_outbox.prune_interval` by truncating whole partitions of the log
//! (`pg_outbox_core::rotation`): no DELETE, so no dead tuples and no index bloat on the hottest
//! table. `outbox.prune()`, for operators, deletes exactly what may go, in bounded batches in log
//! order.

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
    let lowest = Spi::get_two::<String, i64>(
        "SELECT c.txid::text, c.seq FROM outbox.consumers c ORDER BY c.txid, c.seq LIMIT 1",
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
/// `batch_size`. Runs as the owner.
fn prune_events(retention: DatumWithOid<'_>, cutoff_sql: &str, batch_size: i32, wait: bool) -> i64 {
    // SAFETY: reads a backend global.
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        Error::Isolation("outbox.prune()").report();
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
        let Some(bound) = prune_bound(wait) else {
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
    prune_events(
        DatumWithOid::from(retention),
        "now() - $4",
        batch_size,
        true,
    )
}

/// The worker's timed prune: truncates every partition of the log that has aged past
/// `pg_outbox.retention` and that every reader has passed; returns how many it truncated.
pub fn prune_for_worker() -> i64 {
    if !crate::dispatch::lock_tables() {
        return 0;
    }
    let retention_s = settings::RETENTION_S.get() as i64;
    let period_s = rotation::period_s(retention_s, settings::PRUNE_INTERVAL_S.get() as i64);
    // SAFETY: reads the clock.
    let now_us = unix_us(unsafe { pg_sys::GetCurrentTimestamp() });
    as_owner(|| {
        let since_us = rotation_since(period_s, now_us);
        if !rotation::settled(since_us, now_us, period_s, retention_s) {
            return 0;
        }
        let aged: Vec<i16> = (0..rotation::PARTITIONS as i16)
            .filter(|&k| rotation::aged(k, now_us, period_s, retention_s))
            .collect();
        if aged.is_empty() {
            return 0;
        }
        let Some(bound) = prune_bound(false) else {
            return 0;
        };
        aged.into_iter()
            .filter(|&k| truncate_if_passed(k, bound))
            .count() as i64
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

/// How long a worker waits for the lock that truncating a partition takes: readers of the log
/// (other workers' steps, pull consumers) wait behind it for at most this long.
const TRUNCATE_LOCK_TIMEOUT: &str = "200ms";

/// Truncates partition `k` if every event in it is at or behind `bound`; false when it held
/// none, held one past the bound, or its lock could not be had in time.
///
/// The partition is locked ACCESS EXCLUSIVE first: no transaction that raised into it is still
/// running (those hold it), none can raise into it until this one ends, so the newest position
/// read under the lock is the newest it will ever have held when TRUNCATE empties it.
fn truncate_if_passed(k: i16, bound: Position) -> bool {
    let table = format!("outbox.events_{k}");
    // At once when nobody holds it (an idle log): then no reader ever queues behind the lock.
    let locked = lock_partition_now(k);
    let outcome = crate::transaction::in_subtransaction(|| {
        if !locked {
            Spi::run(&format!(
                "SET LOCAL lock_timeout = '{TRUNCATE_LOCK_TIMEOUT}'; \
                 LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
            ))
            .expect("locking a partition of the log");
        }
        let newest = Spi::get_two::<String, i64>(&format!(
            "SELECT txid::text, seq FROM {table} ORDER BY txid DESC, seq DESC LIMIT 1"
        ));
        let passed = match newest {
            Ok((Some(txid), Some(seq))) => {
                Position::new(txid.parse().expect("xid8 prints as an integer"), seq) <= bound
            }
            Ok(_) | Err(pgrx::spi::Error::InvalidPosition) => false,
            Err(e) => panic!("reading a partition of the log: {e}"),
        };
        if passed {
            Spi::run(&format!("TRUNCATE {table}")).expect("truncating a partition of the log");
        }
        passed
    });
    // The subtransaction kept or undid the SET LOCAL: the rest of the transaction waits as usual.
    Spi::run("SET LOCAL lock_timeout = DEFAULT").expect("resetting lock_timeout");
    match outcome {
        Ok(truncated) => truncated,
        // 55P03: readers held the partition for longer than the timeout; next time.
        Err(f) if f.sqlstate == "55P03" => false,
        Err(f) => panic!("pruning {table}: {f}"),
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
    let period_s = rotation::period_s(
        settings::RETENTION_S.get() as i64,
        settings::PRUNE_INTERVAL_S.get() as i64,
    );
    // SAFETY: reads the start time of the current transaction (now()).
    let began = unix_us(unsafe { pg_sys::GetCurrentTransactionStartTimestamp() });
    pg_sys::Datum::from(rotation::part(began, period_s))
}
