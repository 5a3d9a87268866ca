//! Ticks: the snapshots readers will read the log by, batch by batch (issue 15; the SQL, and
//! what a batch is, in `sql/ticks.sql`). The workers take them, never an application's
//! transaction, and no daemon outside the server is needed (PgQ needs pgqd).
//!
//! While a reader reads by ticks (`outbox.alter_sink(id, '{"read_by": "ticks"}')`), a worker
//! takes one at the start of every round it runs (woken by a commit, or on its poll),
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
use pg_outbox_core::snapshot::{batch_read, BatchRead, Snapshot};
use pg_outbox_core::Position;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

/// How the rest of the batch from snapshot `since` to `upto` after `after` is read, as the
/// arguments of [`batch_rows!`] and [`batch_window!`]: the position to read after ($1, $2), and
/// the two batch arguments, `a` and `b`. Read as one range of the log (`range`, `outbox._range_log`)
/// once `after` is past every transaction `since` saw running that `upto` sees ended: `a` is the
/// transaction the range ends below, `b` the snapshot whose running transactions it leaves out
/// (None: none is in the range). Otherwise both parts of the batch (`outbox._snapshot_log`): `a`
/// and `b` are `since` and `upto`.
pub(crate) struct BatchArgs {
    pub range: bool,
    pub after: Position,
    pub a: String,
    pub b: Option<String>,
}

impl BatchArgs {
    pub(crate) fn of(since: &str, upto: &str, after: Position) -> BatchArgs {
        let snapshot = |text: &str| {
            Snapshot::parse(text).unwrap_or_else(|e| panic!("a batch's snapshot: {}", e.message))
        };
        match batch_read(&snapshot(since), &snapshot(upto), after) {
            BatchRead::Range {
                after,
                below,
                exclude_running,
            } => BatchArgs {
                range: true,
                after,
                a: below.to_string(),
                b: exclude_running.then(|| upto.to_owned()),
            },
            BatchRead::BothParts => BatchArgs {
                range: false,
                after,
                a: since.to_owned(),
                b: Some(upto.to_owned()),
            },
        }
    }

    /// Whether the range is empty without reading it (nothing below its end is after `after`).
    pub(crate) fn empty(&self) -> bool {
        self.range
            && self
                .a
                .parse::<u64>()
                .is_ok_and(|below| below <= self.after.txid)
    }

    /// The arguments $1 and $2.
    pub(crate) fn position(&self) -> [DatumWithOid<'static>; 2] {
        [
            DatumWithOid::from(self.after.txid.to_string()),
            DatumWithOid::from(self.after.seq),
        ]
    }

    /// The two batch arguments, in the slots the statement gave them.
    pub(crate) fn batch(&self) -> [DatumWithOid<'_>; 2] {
        [
            DatumWithOid::from(self.a.as_str()),
            DatumWithOid::from(self.b.as_deref()),
        ]
    }
}

/// The rows of a batch after ($1, $2), at most $3, from `outbox._range_log` (`range`) or
/// `outbox._snapshot_log` (`both`), the batch arguments of [`BatchArgs`] in slots `$a` and `$b`.
macro_rules! batch_rows {
    (range, $a:literal, $b:literal) => {
        concat!(
            "outbox._range_log($1::pg_catalog.xid8, $2, ",
            $a,
            "::pg_catalog.text::pg_catalog.xid8, ",
            $b,
            "::pg_catalog.text::pg_catalog.pg_snapshot, $3)"
        )
    };
    (both, $a:literal, $b:literal) => {
        concat!(
            "outbox._snapshot_log(",
            $a,
            "::pg_catalog.text::pg_catalog.pg_snapshot, ",
            $b,
            "::pg_catalog.text::pg_catalog.pg_snapshot, $1::pg_catalog.xid8, $2, $3)"
        )
    };
}
pub(crate) use batch_rows;

/// [`batch_rows!`] as a window (`outbox._range_window`, `outbox._batch_window`), cut at the bytes
/// in slot `$bytes`.
macro_rules! batch_window {
    (range, $a:literal, $b:literal, $bytes:literal) => {
        concat!(
            "outbox._range_window($1::pg_catalog.xid8, $2, ",
            $a,
            "::pg_catalog.text::pg_catalog.xid8, ",
            $b,
            "::pg_catalog.text::pg_catalog.pg_snapshot, $3, ",
            $bytes,
            ")"
        )
    };
    (both, $a:literal, $b:literal, $bytes:literal) => {
        concat!(
            "outbox._batch_window(",
            $a,
            "::pg_catalog.text::pg_catalog.pg_snapshot, ",
            $b,
            "::pg_catalog.text::pg_catalog.pg_snapshot, $1::pg_catalog.xid8, $2, $3, ",
            $bytes,
            ")"
        )
    };
}
pub(crate) use batch_window;

/// `outbox._batch_range(since, upto, after_txid, after_seq)`: [`BatchArgs`] for `outbox.read`
/// (PL/pgSQL): one row, the arguments of `outbox._range_after`, when the rest of the batch after
/// the position is one range of the log; none when both its parts are read (`_batch_after`).
#[pg_extern(name = "_batch_range", immutable, parallel_safe, strict)]
fn batch_range(
    since: &str,
    upto: &str,
    after_txid: &str,
    after_seq: i64,
) -> TableIterator<
    'static,
    (
        name!(after_txid, String),
        name!(after_seq, i64),
        name!(below, String),
        name!(running, Option<String>),
    ),
> {
    use crate::error::OrReport;
    Snapshot::parse(since).or_report();
    Snapshot::parse(upto).or_report();
    let txid = after_txid
        .parse::<u64>()
        .map_err(|_| {
            pg_outbox_core::Invalid::new(
                pg_outbox_core::InvalidKind::Text,
                format!("invalid transaction id \"{after_txid}\""),
            )
        })
        .or_report();
    let args = BatchArgs::of(since, upto, Position::new(txid, after_seq));
    let row = args
        .range
        .then(|| (args.after.txid.to_string(), args.after.seq, args.a, args.b));
    TableIterator::new(row)
}

/// Takes a tick, in the worker's own transaction (commit it at once: the tick lock is held until
/// then). Returns the newest tick (0 before the first). Waits for the tick lock at most
/// [`LOCK_WAIT_MS`]: only another taker holds it, for a moment (or a role someone let execute
/// `outbox._lock_ticks()`: then this round goes on without a tick, and says so).
pub fn take() -> i64 {
    if !crate::dispatch::lock_tables() {
        return 0;
    }
    crate::isolation::commit_without_waiting_for_flush();
    crate::isolation::lock_timeout_local(LOCK_WAIT_MS);
    as_owner(tick)
}

/// `outbox._tick()`: takes a tick unless its batch would be empty; returns the newest tick (0
/// before the first). One taker at a time: a lock of their own (`outbox._lock_ticks`) orders
/// them, and the snapshot is taken once it is held, so after the previous taker committed: it
/// sees every transaction the previous tick saw, and the tick numbers follow the snapshots. In
/// READ COMMITTED only (each statement its own snapshot). Commit soon: the lock is held until
/// then.
///
/// Only in a log that is this database's (outbox.lineage, src/lineage.rs), and whose first tick
/// of this epoch comes after something was raised in it: not in a database where nothing was
/// raised yet, which may be the target of a restore still loading (a tick taken there would be
/// in terms the restored log does not share, and could take the number of a restored one). A
/// transaction that raises first marks the log raised when it commits: the first tick waits for
/// it (once in the life of a log: later ticks go on from the one before).
///
/// Every statement after the lock runs with a snapshot of its own, taken after it, and names
/// only schema-qualified objects and operators.
#[pg_extern(name = "_tick", volatile, parallel_unsafe)]
fn tick() -> i64 {
    // SAFETY: reads a backend global.
    if unsafe { pg_sys::XactIsoLevel } != pg_sys::XACT_READ_COMMITTED as i32 {
        pgrx::pg_sys::panic::ErrorReport::new(
            PgSqlErrorCode::ERRCODE_INVALID_TRANSACTION_STATE,
            "a tick is taken in a READ COMMITTED transaction",
            "pg_outbox",
        )
        .set_detail("its snapshot must be taken after the previous tick committed")
        .report(PgLogLevel::ERROR);
    }
    crate::lease::ticks_exclusive();
    Spi::connect_mut(|client| -> Result<i64, pgrx::spi::Error> {
        let last = {
            let table = plans::update(
                client,
                "SELECT t.tick, t.snapshot::pg_catalog.text, t.cluster, t.database \
                   FROM outbox.ticks t ORDER BY t.tick DESC LIMIT 1",
                Some(1),
                &[],
            )?;
            match table.is_empty() {
                true => None,
                false => {
                    let row = table.first();
                    Some(Last {
                        tick: row.get::<i64>(1)?.expect("tick is NOT NULL"),
                        snapshot: row.get::<String>(2)?.expect("snapshot is NOT NULL"),
                        cluster: row.get::<i64>(3)?.expect("cluster is NOT NULL"),
                        database: row.get::<pg_sys::Oid>(4)?.expect("NOT NULL").to_u32(),
                    })
                }
            }
        };
        let newest = last.as_ref().map_or(0, |l| l.tick);
        let Some(epoch) = tickable(client, last.as_ref())? else {
            return Ok(newest);
        };
        let taken = fresh_snapshot_text();
        if let Some(last) = &last {
            if !batch_holds_an_event(client, &last.snapshot, &taken)? {
                return Ok(newest);
            }
        }
        let (cluster, database) = crate::lineage::here();
        let number = (newest + 1).max(((epoch as i64) << 40) + 1);
        plans::update(
            client,
            "INSERT INTO outbox.ticks (tick, snapshot, cluster, database) \
             VALUES ($1, $2::pg_catalog.text::pg_catalog.pg_snapshot, $3, $4)",
            None,
            &[
                DatumWithOid::from(number),
                DatumWithOid::from(taken.as_str()),
                DatumWithOid::from(cluster),
                DatumWithOid::from(pg_sys::Oid::from(database)),
            ],
        )?;
        Ok(number)
    })
    .unwrap_or_else(|e| panic!("taking a tick: {e}"))
}

/// The newest tick, as `tick` reads it.
struct Last {
    tick: i64,
    snapshot: String,
    cluster: i64,
    database: u32,
}

/// The epoch a tick is taken in, if one may be (see `tick`): the log's lineage is one row, this
/// database's, and it was raised in, or the newest tick is of this epoch and was taken here.
fn tickable(
    client: &mut pgrx::spi::SpiClient<'_>,
    last: Option<&Last>,
) -> Result<Option<u64>, pgrx::spi::Error> {
    let table = plans::update(
        client,
        "SELECT l.system_identifier, l.database, l.epoch, l.raised FROM outbox.lineage l \
          WHERE (SELECT pg_catalog.count(*) FROM outbox.lineage) OPERATOR(pg_catalog.=) 1",
        None,
        &[],
    )?;
    if table.is_empty() {
        return Ok(None);
    }
    let row = table.first();
    let here = crate::lineage::here();
    let lineage = (
        row.get::<i64>(1)?.unwrap_or_default(),
        row.get::<pg_sys::Oid>(2)?.map_or(0, |o| o.to_u32()),
    );
    if lineage != here {
        return Ok(None);
    }
    let epoch = row.get::<i32>(3)?.unwrap_or_default().max(0) as u64;
    let raised = row.get::<bool>(4)?.unwrap_or_default();
    let ticked_here =
        last.is_some_and(|l| l.tick > ((epoch as i64) << 40) && (l.cluster, l.database) == here);
    Ok((raised || ticked_here).then_some(epoch))
}

/// A snapshot taken now, in the log's terms (`outbox._log_snapshot()`).
fn fresh_snapshot_text() -> String {
    // SAFETY: in READ COMMITTED each call takes a new snapshot; it is made the active one for as
    // long as it is read, then popped.
    unsafe {
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        let text = crate::lineage::snapshot_text();
        pg_sys::PopActiveSnapshot();
        text
    }
}

/// Whether the batch from snapshot `since` to `upto` holds an event: a tick whose batch would be
/// empty is not taken (the workers ask at every commit and poll, and each tick's own transaction
/// moves the snapshot on); the next one's batch holds what it would have. Read with a snapshot
/// newer than `upto`, filtered by it. No transaction ended between them: nothing to read.
fn batch_holds_an_event(
    client: &mut pgrx::spi::SpiClient<'_>,
    since: &str,
    upto: &str,
) -> Result<bool, pgrx::spi::Error> {
    let args = BatchArgs::of(since, upto, Position::ORIGIN);
    if args.empty() {
        return Ok(false);
    }
    let sql = match args.range {
        true => concat!(
            "SELECT EXISTS (SELECT FROM ",
            batch_rows!(range, "$4", "$5"),
            ")"
        ),
        false => concat!(
            "SELECT EXISTS (SELECT FROM ",
            batch_rows!(both, "$4", "$5"),
            ")"
        ),
    };
    let [t, q] = args.position();
    let [a, b] = args.batch();
    let table = plans::update(
        client,
        sql,
        Some(1),
        &[t, q, DatumWithOid::from(1i32), a, b],
    )?;
    Ok(table.first().get::<bool>(1)?.unwrap_or(false))
}

/// Whether a reader reads by ticks (or is set to): the workers take ticks only then. Asked in the
/// round's first transaction.
pub fn wanted() -> bool {
    as_owner(|| {
        Spi::connect(|client| {
            plans::select(
                client,
                "SELECT EXISTS (SELECT FROM outbox.consumers c WHERE c.read_by OPERATOR(pg_catalog.=) 'ticks')",
                Some(1),
                &[],
            )?
            .first()
            .get_one::<bool>()
        })
    })
    .unwrap_or_else(|e| panic!("asking for ticks: {e}"))
    .unwrap_or(false)
}

/// How long a worker waits for another's tick to commit before it goes on without one.
const LOCK_WAIT_MS: u32 = 1000;

/// How often the workers delete the ticks no reader needs.
pub const PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Deletes the ticks no reader needs, and returns how many went: every tick up to the lowest
/// tick a reader by ticks is in (a reader keeps the snapshots of its own batch, and needs only the
/// ticks after it), but the newest (the next tick is numbered after it, and its batch starts from
/// it; a reader that starts reading by ticks starts at it). A reader moves to later ticks only, so
/// a cursor this does not see yet is past what it deletes, or starts at a tick it keeps or one
/// whose snapshots that reader already holds; but for a pull consumer that started its batch in a
/// transaction still open (`cursor::start_batch`, under the cursors lock shared): it may have read
/// on through the ticks after its own, and advance through them once it commits. While such a
/// transaction may be running (the cursors lock is not free), the ticks taken since the oldest
/// running transaction began are kept too.
pub fn prune() -> i64 {
    if !crate::dispatch::lock_tables() {
        return 0;
    }
    let nobody_starting = crate::lease::cursors_exclusive(false);
    as_owner(|| {
        Spi::connect_mut(|client| {
            plans::update(
                client,
                "WITH gone AS (DELETE FROM outbox.ticks t \
                               WHERE t.tick OPERATOR(pg_catalog.<) (SELECT pg_catalog.max(n.tick) FROM outbox.ticks n) \
                                 AND t.tick OPERATOR(pg_catalog.<=) \
                                     coalesce((SELECT pg_catalog.min(c.tick) FROM outbox.consumers c), 9223372036854775807) \
                                 AND ($1 OR pg_catalog.pg_snapshot_xmax(t.snapshot) OPERATOR(pg_catalog.<=) \
                                     (SELECT pg_catalog.pg_snapshot_xmin(outbox._log_snapshot()::pg_catalog.pg_snapshot))) \
                              RETURNING 1) \
                 SELECT pg_catalog.count(*) FROM gone",
                Some(1),
                &[pgrx::datum::DatumWithOid::from(nobody_starting)],
            )?
            .first()
            .get_one::<i64>()
        })
    })
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

/// `outbox._flush_log()`: returns once the WAL written so far is on disk. The workers commit their
/// ticks without waiting for that (a sink that delivers a tick's batch commits later, and its
/// flush covers the tick); `outbox.read` hands a pull consumer the batches of ticks and commits
/// nothing, so it flushes first: a tick lost in a crash after its batch was handed out would be
/// taken again with another snapshot, and the batches after the reader's cursor would not be the
/// ones it read. Free when nothing is waiting to be flushed; nothing during recovery.
#[pg_extern(name = "_flush_log", volatile, parallel_unsafe)]
fn flush_log() {
    // SAFETY: plain calls into the WAL machinery, as any backend that commits makes them.
    unsafe {
        if !pg_sys::RecoveryInProgress() {
            pg_sys::XLogFlush(end_of_wal(
                pg_sys::GetXLogInsertRecPtr(),
                pg_sys::wal_segment_size as u64,
            ));
        }
    }
}

/// The end of the WAL inserted so far, from the insert position: where the next record would
/// start, which is past the page header when the last record ended at a page's end. Flushing up
/// to a position past a header not written yet fails ("xlog flush request ... is not
/// satisfied"): back off to the page's start (the end of the record before it).
fn end_of_wal(insert: u64, segment_size: u64) -> u64 {
    // MAXALIGN(sizeof(XLogPageHeaderData)) and MAXALIGN(sizeof(XLogLongPageHeaderData)): a
    // segment's first page has the long header.
    let align = |n: usize| n.next_multiple_of(8) as u64;
    let short = align(std::mem::size_of::<pg_sys::XLogPageHeaderData>());
    let long = align(std::mem::size_of::<pg_sys::XLogLongPageHeaderData>());
    if segment_size > 0 && insert % segment_size == long {
        insert - long
    } else if insert % pg_sys::XLOG_BLCKSZ as u64 == short {
        insert - short
    } else {
        insert
    }
}

#[cfg(test)]
mod tests {
    use super::end_of_wal;

    #[test]
    fn the_end_of_wal_is_before_a_page_header_not_written_yet() {
        let segment = 16 * 1024 * 1024;
        // A record ends mid-page: that is the end.
        assert_eq!(
            end_of_wal(segment + 8192 + 100, segment),
            segment + 8192 + 100
        );
        // Ended at a page's end: the insert position is past the next page's short header (24).
        assert_eq!(end_of_wal(segment + 8192 + 24, segment), segment + 8192);
        // At a segment's start, past its long header (40).
        assert_eq!(end_of_wal(2 * segment + 40, segment), 2 * segment);
    }
}
