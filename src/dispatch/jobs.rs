//! Jobs with a SQL handler, run by the worker: exactly once inside the database.
//!
//! One transaction claims a batch of a subscription's due jobs with FOR UPDATE SKIP LOCKED (the
//! row lock is the lease: several worker processes take different jobs, and one that dies gives
//! its jobs back with its transaction), runs the handler on them as the subscription's owner,
//! and deletes the jobs that went through in the same transaction: the handler's writes and the
//! job's removal commit together.
//!
//! The batch is tried in one subtransaction first (one statement for all of its jobs); if it
//! fails, each job runs alone in its own, so one failing job neither blocks nor undoes the others.

use super::as_handler_owner;
use crate::plans;
use crate::transaction::Failure;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::time::Duration;

/// Jobs claimed per transaction. Under 64, so that even when every job runs alone the
/// subtransactions fit the backend's cache of subtransaction ids (no overflow for everyone's
/// snapshots).
pub const BATCH: i64 = 50;

/// The outcome of one batch.
pub struct Ran {
    pub done: usize,
    /// The batch was full: more jobs may be due.
    pub full: bool,
}

/// The handler subscriptions that are not paused: (name, time until its next job is due, when it
/// has waiting jobs; zero when one is due now).
pub fn handler_queues() -> Vec<(String, Option<Duration>)> {
    let mut out = Vec::new();
    Spi::connect(|client| {
        for row in plans::select(
            client,
            "SELECT s.name, (SELECT greatest(0, extract(epoch FROM j.run_at - pg_catalog.now()) * 1000)::int8 \
                               FROM outbox.jobs j \
                              WHERE j.subscription = s.name AND j.handler IS NOT NULL AND j.state = 'waiting' \
                              ORDER BY j.run_at, j.id LIMIT 1) \
               FROM outbox.subscriptions s WHERE s.handler IS NOT NULL AND NOT s.paused ORDER BY s.name",
            None,
            &[],
        )? {
            let name: String = row.get(1)?.expect("name");
            let due = row.get::<i64>(2)?.map(|ms| Duration::from_millis(ms as u64));
            out.push((name, due));
        }
        Ok::<_, pgrx::spi::Error>(())
    })
    .expect("listing handler subscriptions");
    out
}

struct Job {
    id: i64,
    /// The event, as the jobs.payload text.
    event: String,
}

/// Claims and runs one batch of `subscription`'s due jobs. Runs inside the worker's transaction.
pub fn run(subscription: &str) -> Ran {
    let nothing = Ran {
        done: 0,
        full: false,
    };
    if !super::lock_tables() {
        return nothing;
    }
    Spi::connect_mut(|client| {
        let Some((call, owner)) = handler_of(client, subscription) else {
            return nothing;
        };
        let mut jobs = Vec::new();
        for row in plans::update(
            client,
            "SELECT j.id, j.payload::text FROM outbox.jobs j \
                  WHERE j.subscription = $1 AND j.handler IS NOT NULL AND j.state = 'waiting' \
                    AND j.run_at <= pg_catalog.now() \
                  ORDER BY j.run_at, j.id LIMIT $2 FOR UPDATE SKIP LOCKED",
            None,
            &[DatumWithOid::from(subscription), DatumWithOid::from(BATCH)],
        )
        .expect("claiming jobs")
        {
            jobs.push(Job {
                id: row.get(1).unwrap().expect("id"),
                event: row.get(2).unwrap().expect("payload"),
            });
        }
        if jobs.is_empty() {
            return nothing;
        }
        let full = jobs.len() as i64 >= BATCH;
        let all = format!(
            "SELECT {call}(pg_catalog.jsonb_populate_record(NULL::outbox.event, e::jsonb)) \
               FROM pg_catalog.unnest($1::text[]) e"
        );
        let texts: Vec<&str> = jobs.iter().map(|j| j.event.as_str()).collect();
        let ids: Vec<i64> = jobs.iter().map(|j| j.id).collect();
        let target = crate::worker::Target::Jobs {
            subscription,
            ids: &ids,
        };
        // A batch with a job that was in a batch that ended its worker runs one by one.
        let suspect = crate::worker::any_suspect(&ids);
        let batch = if suspect {
            Err(())
        } else {
            as_handler_owner(owner, target, || {
                plans::call(client, all.as_str(), &[DatumWithOid::from(texts.clone())])
                    .map(|_| ())
                    .unwrap_or_else(|e| panic!("{e}"));
            })
            .map_err(|_| ())
        };
        let mut done = Vec::with_capacity(jobs.len());
        let mut failed = Vec::new();
        match batch {
            Ok(()) => done.extend(jobs.iter().map(|j| j.id)),
            Err(_) => {
                let one = format!(
                    "SELECT {call}(pg_catalog.jsonb_populate_record(NULL::outbox.event, $1::jsonb))"
                );
                for job in &jobs {
                    let target = crate::worker::Target::Jobs {
                        subscription,
                        ids: std::slice::from_ref(&job.id),
                    };
                    let result = as_handler_owner(owner, target, || {
                        plans::call(
                            client,
                            one.as_str(),
                            &[DatumWithOid::from(job.event.as_str())],
                        )
                        .map(|_| ())
                        .unwrap_or_else(|e| panic!("{e}"));
                    });
                    match result {
                        Ok(()) => done.push(job.id),
                        Err(failure) => failed.push((job.id, failure)),
                    }
                }
            }
        }
        if !done.is_empty() {
            plans::update(
                client,
                "DELETE FROM outbox.jobs WHERE id = ANY ($1)",
                None,
                &[DatumWithOid::from(done.clone())],
            )
            .expect("deleting finished jobs");
        }
        for (id, failure) in &failed {
            record_failure(client, subscription, *id, failure);
        }
        Ran {
            done: done.len(),
            full,
        }
    })
}

/// A job handler call ended its worker (see `worker::InHandler`). One job: its failure is
/// counted (back-off, then dead after its attempts), so a job whose handler always hangs stops
/// being retried at once. Several (a batch): which one hung is unknown, so they become suspects
/// and run one by one from now on (`run`): the one that hangs again is counted alone.
pub fn after_hang(subscription: &str, ids: &[i64]) {
    match ids {
        [] => {}
        [id] => {
            let recorded = crate::transaction::in_transaction(|| {
                if super::lock_tables() {
                    Spi::connect_mut(|client| {
                        record_failure(client, subscription, *id, &super::hang_failure())
                    });
                }
            });
            if let Err(e) = recorded {
                pgrx::warning!("pg_outbox: job {id} of subscription \"{subscription}\": {e}");
            }
        }
        many => crate::worker::mark_suspects(many),
    }
}

/// The handler to call (schema-qualified, quoted) and the role it runs as.
pub(super) fn handler_of(
    client: &SpiClient<'_>,
    subscription: &str,
) -> Option<(String, pg_sys::Oid)> {
    let rows = plans::select(
            client,
            "SELECT pg_catalog.quote_ident(n.nspname) || '.' || pg_catalog.quote_ident(p.proname), c.owner \
               FROM outbox.subscriptions s \
               JOIN outbox.consumers c ON c.name = s.name \
               JOIN pg_catalog.pg_proc p ON p.oid = s.handler \
               JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace \
              WHERE s.name = $1 AND NOT s.paused",
            Some(1),
            &[DatumWithOid::from(subscription)],
        )
        .expect("reading a subscription's handler");
    let mut found = None;
    for row in rows {
        found = Some((
            row.get::<String>(1).unwrap().expect("handler"),
            row.get::<pg_sys::Oid>(2).unwrap().expect("owner"),
        ));
    }
    if let Some((_, owner)) = found {
        if !crate::owner::role_exists(owner) {
            // Dropped from another database: its handler can run as nobody. Paused, once.
            let why = format!(
                "paused: its owner (role {}) no longer exists; unsubscribe it",
                owner.to_u32()
            );
            pgrx::warning!("pg_outbox: subscription \"{subscription}\" {why}");
            Spi::run_with_args(
                "UPDATE outbox.subscriptions SET paused = true, last_predicate_error = $2, \
                        last_predicate_error_at = pg_catalog.now() WHERE name = $1",
                &[
                    DatumWithOid::from(subscription),
                    DatumWithOid::from(why.as_str()),
                ],
            )
            .expect("pausing a subscription");
            return None;
        }
    }
    found
}

/// A data error (SQLSTATE class 22: a bad value, a division by zero) fails the same way on every
/// retry: the job dies at once instead of spending its attempts.
fn cannot_pass_on_retry(failure: &Failure) -> bool {
    failure.sqlstate.starts_with("22")
}

fn record_failure(client: &mut SpiClient<'_>, subscription: &str, id: i64, failure: &Failure) {
    let rows = plans::update(
            client,
            // Back-off: 1 s doubling per attempt, capped at an hour (as outbox.fail()).
            "UPDATE outbox.jobs SET attempts = attempts + 1, last_error = $2, \
                    state = CASE WHEN $3 OR attempts + 1 >= max_attempts THEN 'dead' ELSE 'waiting' END, \
                    dead_at = CASE WHEN $3 OR attempts + 1 >= max_attempts THEN pg_catalog.now() END, \
                    run_at = CASE WHEN $3 OR attempts + 1 >= max_attempts THEN run_at \
                                  ELSE pg_catalog.now() + least(interval '1 second' * pg_catalog.power(2, least(attempts, 20)), \
                                                                           interval '1 hour') END \
              WHERE id = $1 RETURNING state, attempts",
            None,
            &[
                DatumWithOid::from(id),
                DatumWithOid::from(failure.to_string()),
                DatumWithOid::from(cannot_pass_on_retry(failure)),
            ],
        )
        .expect("recording a job failure");
    for row in rows {
        let state: String = row.get(1).unwrap().expect("state");
        let attempts: i32 = row.get(2).unwrap().expect("attempts");
        if state == "dead" {
            pgrx::warning!(
                "pg_outbox: job {id} of subscription \"{subscription}\" is dead after {attempts} attempt(s): {failure}"
            );
        } else {
            pgrx::log!(
                "pg_outbox: job {id} of subscription \"{subscription}\" failed (attempt {attempts}), retrying: {failure}"
            );
        }
    }
}
