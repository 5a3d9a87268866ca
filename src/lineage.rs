//! Positions that survive `pg_dump` and `pg_restore` into another cluster.
//!
//! A position is `(txid, seq)` and the read rule compares `txid` with the oldest running
//! transaction. Transaction ids belong to a cluster: restored into a new one, the log's events
//! carry the old cluster's ids, which may be far above the new cluster's (the events would wait
//! until it caught up) or below them (new events would sort before restored cursors, and be
//! skipped). So the `txid` of a position is the transaction id plus an epoch in its top 16 bits
//! (`txid = epoch << 48 | xid8`; xid8 values stay below 2^48 for ages). Each database keeps its
//! epoch in `outbox.lineage`, one row naming the cluster (system identifier) and database it
//! belongs to; the table is dumped with the log.
//!
//! Restored elsewhere, the table holds the dumped row as well as the one CREATE EXTENSION wrote:
//! the first `raise` there adopts the log, in its own transaction: the epoch becomes one above
//! every epoch the table holds, and one row remains. Restored events and cursors keep their
//! positions, all below the new epoch's; new events sort after them. Readers behave as if the
//! log were adopted as soon as the dumped row is there: every event of an earlier epoch was
//! committed, so all of them are readable. Nothing is rewritten, so it does not matter in which
//! order pg_restore loads the tables, as long as nothing is raised in the database before the
//! dumped row is in (a transaction that raised there before is refused afterwards: see
//! `Error::LineageConflict`).

use crate::error::Error;
use crate::owner::as_owner;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use std::cell::Cell;

/// Bits of a position's txid below the epoch.
const EPOCH_SHIFT: u32 = 48;
const MAX_EPOCH: i32 = 0xFFFF;

thread_local! {
    /// (outbox.events' oid, epoch) of a settled lineage: one row, this database's, raised in.
    static SETTLED: Cell<Option<(u32, u64)>> = const { Cell::new(None) };
    static CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// DROP EXTENSION (and anything else that invalidates outbox.events) forgets the epoch: a new
/// installation starts its own lineage.
#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    SETTLED.with(|s| {
        if let Some((events, _)) = s.get() {
            if relid == pg_sys::InvalidOid || relid.to_u32() == events {
                s.set(None);
            }
        }
    });
}

fn events_relid() -> u32 {
    // SAFETY: syscache lookups by name.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"outbox".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return 0;
        }
        pg_sys::get_relname_relid(c"events".as_ptr(), nsp).to_u32()
    }
}

/// This cluster and database.
pub(crate) fn here() -> (i64, u32) {
    // SAFETY: reads the control file's identifier and a backend global.
    unsafe {
        (
            pg_sys::GetSystemIdentifier() as i64,
            pg_sys::MyDatabaseId.to_u32(),
        )
    }
}

#[derive(Debug)]
struct Row {
    system_identifier: i64,
    database: u32,
    epoch: i32,
    raised: bool,
    /// The row was last written by the current transaction (or one of its subtransactions).
    marked_here: bool,
}

fn rows() -> Vec<Row> {
    // Every round of a worker reads it (`adopt_if_restored`): from a kept plan.
    Spi::connect(|client| {
        crate::plans::select(
            client,
            "SELECT system_identifier, database, epoch, raised, xmin::text::int8 FROM outbox.lineage",
            None,
            &[],
        )?
        .map(|r| {
            Ok(Row {
                system_identifier: r.get(1)?.unwrap_or_default(),
                database: r.get::<pg_sys::Oid>(2)?.map_or(0, |o| o.to_u32()),
                epoch: r.get(3)?.unwrap_or_default(),
                raised: r.get(4)?.unwrap_or_default(),
                marked_here: {
                    let xmin = r.get::<i64>(5)?.unwrap_or_default() as u32;
                    // SAFETY: asks whether an xid is this backend's transaction or one of its
                    // subtransactions (false for a frozen or invalid one).
                    unsafe {
                        pg_sys::TransactionIdIsCurrentTransactionId(pg_sys::TransactionId::from(
                            xmin,
                        ))
                    }
                },
            })
        })
        .collect::<Result<Vec<_>, pgrx::spi::Error>>()
    })
    .unwrap_or_else(|e| panic!("reading outbox.lineage: {e}"))
}

fn settle(epoch: u64) -> u64 {
    if !CALLBACK.with(|c| c.replace(true)) {
        // SAFETY: registers a process-local callback once; PostgreSQL keeps up to 10 of them.
        unsafe {
            pg_sys::CacheRegisterRelcacheCallback(
                Some(on_relcache_invalidation),
                pg_sys::Datum::from(0),
            )
        };
    }
    SETTLED.with(|s| s.set(Some((events_relid(), epoch))));
    epoch
}

/// The epoch new positions are made in, for a transaction that raises: adopts a restored log
/// first (see the module's comment), and marks this database's row as raised in.
pub fn epoch_for_raise() -> u64 {
    if let Some((_, epoch)) = SETTLED.with(|s| s.get()) {
        return epoch;
    }
    let (epoch, marked) = as_owner(|| {
        let rows = rows();
        if let Some(epoch) = steady(&rows) {
            // Marked by a transaction that has committed: not by this one (a second raise in
            // the transaction that marked it), which may still roll back.
            if rows[0].raised && !rows[0].marked_here {
                return (epoch, true);
            }
            // Marked without waiting: a transaction that raised first and is still open holds
            // the row; it marks it when it commits, or the next raise does (this backend's
            // included: the epoch is kept only once the mark is seen committed, so that a first
            // raise rolled back does not leave the log unmarked, and without ticks).
            Spi::run(
                "UPDATE outbox.lineage l SET raised = true \
                   FROM (SELECT ctid FROM outbox.lineage WHERE NOT raised FOR UPDATE SKIP LOCKED) r \
                  WHERE l.ctid = r.ctid",
            )
            .unwrap_or_else(|e| panic!("marking outbox.lineage: {e}"));
            return (epoch, false);
        }
        (adopt(true), false)
    });
    if marked {
        settle(epoch)
    } else {
        epoch
    }
}

/// The epoch of a settled lineage: one row, this database's.
fn steady(rows: &[Row]) -> Option<u64> {
    match rows {
        [row] if (row.system_identifier, row.database) == here() => Some(row.epoch.max(0) as u64),
        _ => None,
    }
}

/// Adopts a restored log: the epoch becomes one above every epoch the table holds, and one row
/// (this database's) remains. Serialised by a table lock (once after a restore; the workers do
/// it in a short transaction of their own as soon as they see the dumped row). `raising`: the
/// caller makes positions now.
fn adopt(raising: bool) -> u64 {
    Spi::run("LOCK TABLE outbox.lineage IN SHARE ROW EXCLUSIVE MODE")
        .unwrap_or_else(|e| panic!("locking outbox.lineage: {e}"));
    // Read again under the lock: another transaction may have adopted meanwhile.
    let rows = rows();
    if let Some(epoch) = steady(&rows) {
        if raising && !rows[0].raised {
            Spi::run("UPDATE outbox.lineage SET raised = true")
                .unwrap_or_else(|e| panic!("marking outbox.lineage: {e}"));
        }
        return epoch;
    }
    if rows.iter().filter(|r| r.raised).count() >= 2 {
        Error::LineageConflict.report();
    }
    let epoch = rows.iter().map(|r| r.epoch + 1).max().unwrap_or(0);
    if epoch > MAX_EPOCH {
        Error::LineageConflict.report();
    }
    let here = here();
    Spi::run("DELETE FROM outbox.lineage")
        .unwrap_or_else(|e| panic!("adopting outbox.lineage: {e}"));
    Spi::run_with_args(
        "INSERT INTO outbox.lineage (system_identifier, database, epoch, raised) \
         VALUES ($1, $2, $3, $4)",
        &[
            DatumWithOid::from(here.0),
            DatumWithOid::from(pg_sys::Oid::from(here.1)),
            DatumWithOid::from(epoch),
            DatumWithOid::from(raising || rows.iter().any(|r| r.raised)),
        ],
    )
    .unwrap_or_else(|e| panic!("adopting outbox.lineage: {e}"));
    if !rows.is_empty() {
        pgrx::log!(
            "pg_outbox: adopted a log restored from another database or cluster; new positions are in epoch {epoch}"
        );
    }
    epoch as u64
}

/// Whether the log was restored and is not adopted yet (the workers ask every round, in the
/// round's first transaction, and adopt in one of its own when it is).
pub fn restored() -> bool {
    as_owner(|| steady(&rows()).is_none())
}

/// For the workers, in a transaction of its own: adopts a restored log as soon as its dumped row
/// is in, so that no application transaction has to (and wait for another).
pub fn adopt_if_restored() {
    as_owner(|| {
        if steady(&rows()).is_none() {
            adopt(false);
        }
    });
}

/// The epoch readers compare with: this database's, or (a restored log not adopted yet) the one
/// the first raise will adopt, so that every restored event is readable already.
pub fn epoch_for_read() -> u64 {
    if let Some((_, epoch)) = SETTLED.with(|s| s.get()) {
        return epoch;
    }
    let rows = as_owner(rows);
    match steady(&rows) {
        Some(epoch) => {
            // Kept only once the mark is another transaction's, committed (see epoch_for_raise).
            if rows[0].raised && !rows[0].marked_here {
                settle(epoch);
            }
            epoch
        }
        None => rows.iter().map(|r| r.epoch + 1).max().unwrap_or(0).max(0) as u64,
    }
}

/// The oldest transaction still running anywhere in the cluster (`pg_snapshot_xmin` of the
/// current snapshot), as a full transaction id.
pub fn xmin() -> u64 {
    // SAFETY: called inside a query or a worker's transaction, which have an active snapshot.
    unsafe {
        let snapshot = pg_sys::GetActiveSnapshot();
        if snapshot.is_null() {
            panic!("no active snapshot to read the horizon from");
        }
        pgrx::xid::xid_to_64bit((*snapshot).xmin)
    }
}

/// The read horizon in positions: readers read the events whose txid is below it.
pub fn horizon() -> u64 {
    (epoch_for_read() << EPOCH_SHIFT) + xmin()
}

/// The txid of a position made by the current transaction (it gets a transaction id).
fn txid() -> u64 {
    let epoch = epoch_for_raise();
    // SAFETY: assigns the current transaction its id if it has none, as pg_current_xact_id().
    let xid = unsafe { pg_sys::GetTopFullTransactionId().value };
    (epoch << EPOCH_SHIFT) + xid
}

/// `outbox._log_txid()`: the default of `outbox.events.txid`.
#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo_pg_outbox_log_txid() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn pg_outbox_log_txid(
    _fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    pg_sys::Datum::from(txid())
}

/// `outbox._log_horizon()`: the read rule's bound (`outbox._read_after`, `status()`).
#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo_pg_outbox_log_horizon() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn pg_outbox_log_horizon(
    _fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    pg_sys::Datum::from(horizon())
}

/// The statement's snapshot in the log's terms, as `pg_snapshot` text ("xmin:xmax:xip,..."):
/// each transaction id as a position carries it (this database's epoch in the top bits), so that
/// `pg_visible_in_snapshot(e.txid, s)` says whether event `e`'s transaction had ended when it was
/// taken. What `pg_current_snapshot()` gives, shifted like the log (a tick, `outbox._tick()`).
pub(crate) fn snapshot_text() -> String {
    let epoch = epoch_for_read() << EPOCH_SHIFT;
    // SAFETY: called inside a statement, which has an active snapshot; xip holds xcnt ids.
    unsafe {
        let snapshot = pg_sys::GetActiveSnapshot();
        if snapshot.is_null() {
            panic!("no active snapshot to take a tick from");
        }
        let s = &*snapshot;
        // On a standby the running transactions are in subxip, not xip: read as they are, every
        // one would look ended.
        if s.takenDuringRecovery {
            pgrx::pg_sys::panic::ErrorReport::new(
                pgrx::PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
                "ticks are taken on the primary, not during recovery",
                "pg_outbox",
            )
            .report(pgrx::PgLogLevel::ERROR);
        }
        let full = |xid: pg_sys::TransactionId| epoch + pgrx::xid::xid_to_64bit(xid);
        let mut running: Vec<u64> = (0..s.xcnt as usize).map(|i| full(*s.xip.add(i))).collect();
        // A snapshot leaves its own transaction out of xip (it sees its own work): this one has not
        // ended either, for anyone else. (A reader that starts a batch here, `cursor::start_batch`,
        // in a transaction that raised events, must not count them read.)
        let own = pg_sys::GetTopTransactionIdIfAny();
        if own != pg_sys::InvalidTransactionId && pg_sys::TransactionIdPrecedes(own, s.xmax) {
            running.push(full(own));
        }
        // pg_snapshot's text lists them in order, once each.
        running.sort_unstable();
        running.dedup();
        let running: Vec<String> = running.iter().map(u64::to_string).collect();
        format!("{}:{}:{}", full(s.xmin), full(s.xmax), running.join(","))
    }
}

/// `outbox._log_snapshot()`: see `snapshot_text`.
#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo_pg_outbox_log_snapshot() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn pg_outbox_log_snapshot(
    _fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    let text = snapshot_text();
    // SAFETY: a text datum made in the current memory context, which the caller owns.
    unsafe {
        pg_sys::Datum::from(pg_sys::cstring_to_text_with_len(
            text.as_ptr().cast(),
            text.len() as i32,
        ))
    }
}

/// Forgets the settled epoch (the workers do at each round: a worker lives long, and a restore
/// into its database must be seen by its next raise).
pub fn forget() {
    SETTLED.with(|s| s.set(None));
}
