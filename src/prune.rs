//! Pruning: delete what every consumer has passed and the retention allows.
//!
//! An outbox that is never pruned takes the site down (pg_cron's run history did). One that is
//! pruned carelessly loses events. So: only events behind the lowest cursor of every consumer (a
//! consumer that never advanced holds the log) and behind the read horizon, only events older
//! than the retention, in bounded batches in log order. The worker calls it every
//! `pg_outbox.prune_interval`; operators may call `outbox.prune()`.

use crate::error::{Error, OrReport};
use crate::owner::as_owner;
use crate::read_rule;
use crate::settings;
use pg_outbox_core::limits::PRUNE_BATCH_MAX;
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
            SELECT ctid, raised_at FROM outbox.events \
             WHERE (txid, seq) <= ($1::xid8, $2) \
             ORDER BY txid, seq LIMIT $3), \
         gone AS ( \
            DELETE FROM outbox.events WHERE ctid = ANY (ARRAY( \
                SELECT ctid FROM batch WHERE raised_at < {cutoff_sql})) \
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

/// The worker's timed prune: `pg_outbox.retention`, batches of 10,000.
pub fn prune_for_worker() -> i64 {
    if !crate::dispatch::lock_tables() {
        return 0;
    }
    prune_events(
        DatumWithOid::from(settings::RETENTION_S.get() as i64),
        "now() - $4 * interval '1 second'",
        10_000,
        false,
    )
}
