//! `outbox.prune(retention)`: delete what every consumer has passed and the retention allows.
//!
//! An outbox that is never pruned takes the site down (pg_cron's run history did). One that is
//! pruned carelessly loses events. So: only events behind the lowest cursor of every consumer (a
//! consumer that never advanced holds the log) and behind the read horizon, only events older
//! than the retention, in bounded batches in log order.

use crate::error::{Error, OrReport};
use crate::owner::as_owner;
use crate::read_rule;
use pg_outbox_core::limits::PRUNE_BATCH_MAX;
use pg_outbox_core::{required, Invalid, InvalidKind, Position};
use pgrx::datum::{DatumWithOid, Interval};
use pgrx::prelude::*;

/// The highest position pruning may reach: the lowest cursor, and never past the horizon.
fn prune_bound() -> Position {
    let horizon = Position::at_horizon(read_rule::horizon());
    let lowest = crate::query::two::<String, i64>(
        "SELECT txid::text, seq FROM outbox.consumers ORDER BY txid, seq LIMIT 1",
        &[],
    );
    match lowest {
        Some((Some(txid), Some(seq))) => {
            Position::new(txid.parse().expect("xid8 prints as an integer"), seq).min(horizon)
        }
        _ => horizon,
    }
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
    let negative = crate::query::one::<bool>(
        "SELECT $1 OPERATOR(pg_catalog.<) '0'::pg_catalog.interval",
        &[DatumWithOid::from(retention)],
    )
    .unwrap_or(false);
    if negative {
        Error::from(Invalid::new(
            InvalidKind::Parameter,
            "retention must not be negative",
        ))
        .report();
    }

    as_owner(|| {
        let bound = prune_bound();
        let mut total = 0i64;
        loop {
            let (scanned, deleted) = Spi::get_two_with_args::<i64, i64>(
                "WITH batch AS ( \
                    SELECT ctid, raised_at FROM outbox.events \
                     WHERE (txid, seq) <= ($1::xid8, $2) \
                     ORDER BY txid, seq LIMIT $3), \
                 gone AS ( \
                    DELETE FROM outbox.events WHERE ctid = ANY (ARRAY( \
                        SELECT ctid FROM batch WHERE raised_at < now() - $4)) \
                    RETURNING 1) \
                 SELECT (SELECT count(*) FROM batch), (SELECT count(*) FROM gone)",
                &[
                    DatumWithOid::from(bound.txid.to_string()),
                    DatumWithOid::from(bound.seq),
                    DatumWithOid::from(batch_size as i64),
                    DatumWithOid::from(retention),
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
