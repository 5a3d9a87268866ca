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

/// The rows of `SELECT * FROM <function>(who)` run as the log's owner for the caller, each made
/// into a `T` by `row`.
fn for_caller<T>(
    function: &str,
    row: impl Fn(&pgrx::spi::SpiHeapTupleData<'_>) -> Result<T, pgrx::spi::Error>,
) -> Vec<T> {
    let who = caller();
    let sql = format!("SELECT * FROM {function}($1)");
    as_owner(|| {
        Spi::connect(|client| {
            client
                .select(&sql, None, &[DatumWithOid::from(who)])?
                .map(|r| row(&r))
                .collect::<Result<Vec<T>, _>>()
        })
    })
    .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

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
    let rows: Vec<StatusRow> = for_caller("outbox._status", |r| {
        Ok((
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
        ))
    });
    // Every worker of this database is inside a handler and no other may start: what is behind
    // and not in one of those handlers waits for a worker, not for its own handler.
    let rows = match crate::worker::saturated() {
        None => rows,
        Some(running) => rows
            .into_iter()
            .map(|mut row| {
                let behind = matches!(row.5.as_deref(), Some("delivering" | "behind"));
                if behind && !row.0.as_ref().is_some_and(|n| running.contains(n)) {
                    row.5 = Some("waiting for a worker".into());
                }
                row
            })
            .collect(),
    };
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
    let rows: Vec<QueueRow> = for_caller("outbox._queue_status", |r| {
        Ok((
            r.get(1)?,
            r.get(2)?,
            r.get(3)?,
            r.get(4)?,
            r.get(5)?,
            r.get(6)?,
            r.get(7)?,
        ))
    });
    TableIterator::new(rows)
}

type MetricsRow = (
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<f64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
);

/// One row per consumer, numbers only, for monitoring (the postgres_exporter queries file in
/// `contrib/`): no error text, so what it shows needs no rule beyond `status()`'s.
#[pg_extern(stable, parallel_unsafe, requires = ["status"])]
#[allow(clippy::type_complexity)]
fn metrics() -> TableIterator<
    'static,
    (
        name!(name, Option<String>),
        name!(kind, Option<String>),
        name!(events_behind, Option<i64>),
        name!(seconds_behind, Option<f64>),
        name!(delivered, Option<i64>),
        name!(failures, Option<i64>),
        name!(dead_letters, Option<i64>),
        name!(matched, Option<i64>),
        name!(skipped, Option<i64>),
        name!(predicate_errors, Option<i64>),
    ),
> {
    let rows: Vec<MetricsRow> = for_caller("outbox._status", |r| {
        let age: Option<Interval> = r.get(5)?;
        let seconds = age.map(|a| a.as_micros() as f64 / 1e6);
        Ok((
            r.get(1)?,
            r.get(2)?,
            r.get(4)?,
            seconds,
            r.get(16)?,
            r.get(17)?,
            r.get(12)?,
            r.get(13)?,
            r.get(14)?,
            r.get(15)?,
        ))
    });
    TableIterator::new(rows)
}
