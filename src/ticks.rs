//! Ticks: the snapshots readers will read the log by, batch by batch (issue 15; the SQL, and
//! what a batch is, in `sql/ticks.sql`). The workers take them, never an application's
//! transaction, and no daemon outside the server is needed (PgQ needs pgqd).
//!
//! A worker takes one at the start of every round it runs (woken by a commit, or on its poll),
//! in a short transaction of its own, so a tick holds every commit since the previous round: under
//! load ticks are large and few, and at a low rate each commit gets its own. A tick whose batch
//! would be empty is not taken. The taker waits for the tick lock rather than skip: a tick skipped
//! because another worker was taking one might not see the commit that woke this worker.
//!
//! The tick's commit does not wait for its WAL to be flushed. A reader that moves a cursor past
//! a batch commits later, and its commit's flush covers the tick too. A reader that hands a batch
//! outside the database without committing (a pull consumer's `read`) must flush the WAL up to
//! the tick before it does, or a crash could take the tick back and a new tick of the same number
//! would hold another batch.

use crate::owner::as_owner;
use crate::plans;
use crate::settings;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

/// Takes a tick, in the worker's own transaction (commit it at once: the tick lock is held until
/// then). Returns the newest tick (0 before the first).
pub fn take() -> i64 {
    if !crate::dispatch::lock_tables() {
        return 0;
    }
    crate::isolation::commit_without_waiting_for_flush();
    as_owner(|| {
        Spi::connect_mut(|client| {
            plans::update(client, "SELECT outbox._tick()", Some(1), &[])?
                .first()
                .get_one::<i64>()
        })
    })
    .unwrap_or_else(|e| panic!("taking a tick: {e}"))
    .unwrap_or(0)
}

/// Deletes the ticks no reader needs: for now (until readers read by ticks) those older than
/// `pg_outbox.retention`, always keeping the newest (the next tick is numbered after it, and
/// needs its snapshot). Returns how many went.
pub fn prune() -> i64 {
    if !crate::dispatch::lock_tables() {
        return 0;
    }
    as_owner(|| Spi::connect_mut(|client| {
        plans::update(
            client,
            "WITH gone AS (DELETE FROM outbox.ticks t \
                           WHERE t.taken_at OPERATOR(pg_catalog.<) \
                                 pg_catalog.now() OPERATOR(pg_catalog.-) \
                                 pg_catalog.make_interval(secs => $1::pg_catalog.float8) \
                             AND t.tick OPERATOR(pg_catalog.<) (SELECT pg_catalog.max(n.tick) FROM outbox.ticks n) \
                          RETURNING 1) \
             SELECT pg_catalog.count(*) FROM gone",
            Some(1),
            &[DatumWithOid::from(settings::RETENTION_S.get() as f64)],
        )?
        .first()
        .get_one::<i64>()
    }))
    .unwrap_or_else(|e| panic!("pruning ticks: {e}"))
    .unwrap_or(0)
}
