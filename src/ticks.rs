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

/// Deletes the ticks no reader needs: those older than `pg_outbox.retention` and before the tick
/// of every reader's batch (its snapshot is what the batch reads up to, and the next batch starts
/// from it), always keeping the newest (the next tick is numbered after it, and needs its
/// snapshot). Returns how many went. Cursors only move forward, to later ticks, and a reader
/// starts its first batch at the newest tick (`dispatch::first_batch`): what this reads as the
/// lowest tick in use stays below every tick a reader may come to.
pub fn prune() -> i64 {
    if !crate::dispatch::lock_tables() {
        return 0;
    }
    as_owner(|| Spi::connect_mut(|client| {
        plans::update(
            client,
            "WITH gone AS (DELETE FROM outbox.ticks t \
                           WHERE t.taken_at OPERATOR(pg_catalog.<) \
                                 (pg_catalog.now() OPERATOR(pg_catalog.-) \
                                  pg_catalog.make_interval(secs => $1::pg_catalog.float8)) \
                             AND t.tick OPERATOR(pg_catalog.<) (SELECT pg_catalog.max(n.tick) FROM outbox.ticks n) \
                             AND NOT EXISTS (SELECT FROM outbox.consumers c \
                                              WHERE c.tick OPERATOR(pg_catalog.<=) t.tick) \
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

/// `outbox._lock_ticks()`: the lock `outbox._tick()` takes first (see `crate::lease`): not a lock
/// on outbox.ticks, which every worker transaction holds ROW EXCLUSIVE from its start (a stronger
/// one taken by the ticker would wait for all of them, and two tickers would deadlock), nor an
/// advisory lock, which any role could take first and hold.
#[pg_extern(name = "_lock_ticks", volatile, parallel_unsafe)]
fn lock_ticks() {
    crate::lease::ticks_exclusive();
}
