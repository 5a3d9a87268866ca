//! Subscriptions: `subscribe`, `unsubscribe`, `pause_subscription`, `resume_subscription`,
//! `alter_subscription`.
//! Fan-out is in `dispatch::fanout`, running their jobs in `dispatch::jobs`.

use crate::cursor::{insert_consumer, lock_cursors_shared, owned, start_cursor};
use crate::error::{Error, OrReport};
use crate::owner::{as_owner, caller};
use crate::raw::RawRegprocedure;
use crate::sink::{check_handler, topic_regex};
use pg_outbox_core::filter::Filter;
use pg_outbox_core::{name as names, required, Invalid, InvalidKind};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

fn invalid(message: String) -> ! {
    Error::from(Invalid::new(InvalidKind::Parameter, message)).report()
}

/// Subscribes to the events whose topic matches `topics` (NULL: all) and for which the CEL
/// `filter` is true (NULL: all): the worker writes one job per such event, run by `handler`
/// (a function `f(outbox.event)`, as the subscribing role) or queued on `queue` for external
/// workers. Returns the starting cursor.
#[pg_extern(volatile, parallel_unsafe)]
fn subscribe(
    name: Option<&str>,
    topics: default!(Option<Vec<Option<String>>>, "NULL"),
    handler: default!(Option<RawRegprocedure>, "NULL"),
    queue: default!(Option<&str>, "NULL"),
    filter: default!(Option<&str>, "NULL"),
    max_attempts: default!(Option<i32>, "10"),
    start_at: default!(Option<&str>, "'origin'"),
) -> String {
    if !crate::worker::preloaded() {
        Error::NotPreloaded.report();
    }
    let name = required(name, "name").or_report();
    names::validate("subscription", name).or_report();
    let handler = handler.map(|h| h.oid());
    let queue = match (handler, queue) {
        (Some(_), None) => name,
        (None, Some(queue)) => {
            names::validate("queue", queue).or_report();
            queue
        }
        _ => Error::from(
            Invalid::new(
                InvalidKind::Parameter,
                "a subscription takes exactly one of handler and queue",
            )
            .with_hint(
                "handler => 'f(outbox.event)'::regprocedure runs each job in the database; \
                 queue => 'name' queues them for outbox.claim()",
            ),
        )
        .report(),
    };
    if let Some(filter) = filter {
        Filter::compile(filter).or_report();
    }
    let max_attempts = required(max_attempts, "max_attempts").or_report();
    if !(1..=1000).contains(&max_attempts) {
        invalid(format!(
            "max_attempts must be between 1 and 1000, not {max_attempts}"
        ));
    }
    if let Some(handler) = handler {
        check_handler(handler, "outbox.event");
    }
    let patterns = topics.clone();
    let regex = topic_regex(topics).or_report();
    lock_cursors_shared();
    let cursor = start_cursor(start_at);
    let me = caller();
    if !insert_consumer(name, "subscription", cursor, me) {
        Error::ConsumerExists(name.into()).report();
    }
    // The jobs go on a queue of the subscriber's: one it owns for a handler (created if need be;
    // the worker runs them, nobody else may touch them), one it may enqueue on otherwise.
    let privilege = if handler.is_some() { "own" } else { "enqueue" };
    as_owner(|| {
        Spi::run_with_args(
            "SELECT outbox._use_queue($1, $2, $3)",
            &[
                DatumWithOid::from(queue),
                DatumWithOid::from(me),
                DatumWithOid::from(privilege),
            ],
        )
    })
    .unwrap_or_else(|e| panic!("checking the queue: {e}"));
    as_owner(|| {
        Spi::run_with_args(
            "INSERT INTO outbox.subscriptions (name, topics, topic_regex, filter, handler, queue, max_attempts) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[
                DatumWithOid::from(name),
                DatumWithOid::from(patterns),
                DatumWithOid::from(regex),
                DatumWithOid::from(filter),
                // SAFETY: an oid datum typed as regprocedure, which is an oid.
                unsafe { DatumWithOid::new(handler, pg_sys::REGPROCEDUREOID) },
                DatumWithOid::from(queue),
                DatumWithOid::from(max_attempts),
            ],
        )
    })
    .unwrap_or_else(|e| panic!("creating subscription: {e}"));
    crate::worker::wake_at_commit_always();
    cursor.to_string()
}

fn owned_subscription(name: Option<&str>, action: &'static str) -> String {
    let (name, found) = owned("subscription", name, action);
    if found.kind != "subscription" {
        Error::NotASubscription(name).report();
    }
    name
}

fn set_paused(name: &str, paused: bool) {
    as_owner(|| {
        Spi::run_with_args(
            "UPDATE outbox.subscriptions SET paused = $2 WHERE name = $1",
            &[DatumWithOid::from(name), DatumWithOid::from(paused)],
        )
    })
    .unwrap_or_else(|e| panic!("updating subscription: {e}"));
}

/// Stops fan-out (and the running of its jobs, for a handler); its cursor holds the log.
#[pg_extern(volatile, parallel_unsafe)]
fn pause_subscription(name: Option<&str>) {
    let name = owned_subscription(name, "pause");
    set_paused(&name, true);
}

/// Resumes a paused subscription.
#[pg_extern(volatile, parallel_unsafe)]
fn resume_subscription(name: Option<&str>) {
    let name = owned_subscription(name, "resume");
    set_paused(&name, false);
    crate::worker::wake_at_commit_always();
}

/// Changes options of a subscription its caller owns (see `pg_outbox_core::options`): `read_by`
/// "ticks" makes its fan-out read the log batch by batch, no long transaction holding it back.
/// The workers start its first batch at its next pass, under its lease (as for a sink: a
/// cursor moved here could race a pass that reads by the read horizon); one that reads by ticks
/// goes on doing so.
#[pg_extern(volatile, parallel_unsafe)]
fn alter_subscription(name: Option<&str>, options: Option<pgrx::JsonB>) {
    let (name, found) = owned("subscription", name, "alter");
    if found.kind != "subscription" {
        Error::NotASubscription(name).report();
    }
    let options = required(options, "options").or_report();
    let options = pg_outbox_core::options::parse_subscription(&options.0).or_report();
    match (options.read_by_ticks, found.by_ticks) {
        (Some(false), true) => Error::ReadBy {
            what: "subscription",
            name,
            why: "reads by ticks and cannot go back to the read horizon",
        }
        .report(),
        (Some(true), false) => {
            as_owner(|| {
                Spi::run_with_args(
                    "UPDATE outbox.consumers SET read_by = 'ticks' WHERE name = $1",
                    &[DatumWithOid::from(name.as_str())],
                )
            })
            .unwrap_or_else(|e| panic!("altering subscription: {e}"));
            crate::worker::wake_at_commit_always();
        }
        _ => {}
    }
}

/// Drops a subscription and its cursor. The jobs of a handler subscription go with it (nothing
/// could run them); jobs already queued for external workers stay in their queue.
#[pg_extern(volatile, parallel_unsafe)]
fn unsubscribe(name: Option<&str>) {
    let name = owned_subscription(name, "drop");
    as_owner(|| {
        Spi::run_with_args(
            "DELETE FROM outbox.jobs WHERE subscription = $1 AND handler IS NOT NULL",
            &[DatumWithOid::from(name.as_str())],
        )?;
        Spi::run_with_args(
            "DELETE FROM outbox.consumers WHERE name = $1",
            &[DatumWithOid::from(name.as_str())],
        )
    })
    .unwrap_or_else(|e| panic!("dropping subscription: {e}"));
}
