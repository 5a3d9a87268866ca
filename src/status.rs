//! `outbox.status()` and `outbox.queue_status()`: what every consumer and queue is doing, for
//! operators.
//!
//! Error texts come from tenants' code (a handler's exception, a job worker's `fail` message, a
//! filter's error on an event) and may quote their data. Like `pg_stat_activity`'s `query`, an
//! operator sees them only for what its role owns (or, for a queue, may work), or as a member
//! of `pg_read_all_stats`; otherwise they read `<insufficient privilege>`. So these functions are
//! SECURITY INVOKER: they read the caller, then call `outbox._status(who)` /
//! `outbox._queue_status(who)` as the owner of the log.

use crate::owner::{as_owner, caller};
use pgrx::datum::{DatumWithOid, Interval};
use pgrx::prelude::*;

type StatusRow = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<Interval>,
    Option<String>,
    Option<TimestampWithTimeZone>,
    Option<i32>,
    Option<i32>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
);

/// One row per consumer (pull consumers, sinks, subscriptions).
#[pg_extern(stable, parallel_unsafe, requires = ["status"])]
#[allow(clippy::type_complexity)]
fn status() -> TableIterator<
    'static,
    (
        name!(name, Option<String>),
        name!(kind, Option<String>),
        name!(position, Option<String>),
        name!(events_behind, Option<i64>),
        name!(age_behind, Option<Interval>),
        name!(state, Option<String>),
        name!(next_attempt_at, Option<TimestampWithTimeZone>),
        name!(attempts, Option<i32>),
        name!(batch_size, Option<i32>),
        name!(last_error, Option<String>),
        name!(last_sqlstate, Option<String>),
        name!(dead_letters, Option<i64>),
        name!(matched, Option<i64>),
        name!(skipped, Option<i64>),
        name!(predicate_errors, Option<i64>),
    ),
> {
    let who = caller();
    let rows: Vec<StatusRow> = as_owner(|| {
        Spi::connect(|client| {
            let mut rows = Vec::new();
            for r in client.select(
                "SELECT * FROM outbox._status($1)",
                None,
                &[DatumWithOid::from(who)],
            )? {
                rows.push((
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                    r.get(8)?,
                    r.get(9)?,
                    r.get(10)?,
                    r.get(11)?,
                    r.get(12)?,
                    r.get(13)?,
                    r.get(14)?,
                    r.get(15)?,
                ));
            }
            Ok::<_, pgrx::spi::Error>(rows)
        })
    })
    .unwrap_or_else(|e| panic!("outbox._status: {e}"));
    TableIterator::new(rows)
}

type QueueRow = (
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<Interval>,
    Option<String>,
);

/// One row per job queue that holds jobs.
#[pg_extern(stable, parallel_unsafe, requires = ["status"])]
#[allow(clippy::type_complexity)]
fn queue_status() -> TableIterator<
    'static,
    (
        name!(queue, Option<String>),
        name!(waiting, Option<i64>),
        name!(running, Option<i64>),
        name!(retrying, Option<i64>),
        name!(dead, Option<i64>),
        name!(oldest_due, Option<Interval>),
        name!(last_error, Option<String>),
    ),
> {
    let who = caller();
    let rows: Vec<QueueRow> = as_owner(|| {
        Spi::connect(|client| {
            let mut rows = Vec::new();
            for r in client.select(
                "SELECT * FROM outbox._queue_status($1)",
                None,
                &[DatumWithOid::from(who)],
            )? {
                rows.push((
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                ));
            }
            Ok::<_, pgrx::spi::Error>(rows)
        })
    })
    .unwrap_or_else(|e| panic!("outbox._queue_status: {e}"));
    TableIterator::new(rows)
}
