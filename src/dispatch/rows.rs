//! The rows of a window of the log as the workers read them: the log's columns as they are
//! (values stored out of line stay so), deformed once, and made outbox.event datums and arrays
//! of them only for the events that go somewhere. Fan-out and SQL sinks read their windows so:
//! the work a SQL statement would do to number, measure and aggregate the rows (a window
//! function, two sorted aggregates) costs more than the rows themselves.

use crate::cursor::At;
use crate::plans;
use crate::ticks::BatchArgs;
use pg_outbox_core::Position;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

/// A window's SELECT: the log's columns as they are, the reader's own column ($4 is its
/// argument), outbox.event's oid, then where the rows come from (`from_horizon!`, `from_range!`,
/// `from_both_parts!`).
macro_rules! window_sql {
    ($extra:expr, $source:expr) => {
        concat!(
            "SELECT r.txid, r.seq, r.id, r.topic, r.subject, r.tenant, r.payload, r.headers, \
                    r.raised_at, ",
            $extra,
            ", 'outbox.event'::pg_catalog.regtype::pg_catalog.oid ",
            $source
        )
    };
}
pub(super) use window_sql;

/// The read rule's next events after the cursor ($1, $2), at most $3.
macro_rules! from_horizon {
    () => {
        "FROM outbox._read_log($1::pg_catalog.xid8, $2, $3) r ORDER BY r.txid, r.seq"
    };
}
pub(super) use from_horizon;

/// The rest of a batch read as one range of the log (`BatchArgs::range`): after ($1, $2), below
/// the transaction $5, leaving out the running transactions of snapshot $6 (NULL: none is in the
/// range), at most $3. One index scan per partition, as the read rule's.
macro_rules! from_range {
    () => {
        concat!(
            "FROM ",
            crate::ticks::batch_rows!(range, "$5", "$6"),
            " r ORDER BY r.txid, r.seq"
        )
    };
}
pub(super) use from_range;

/// The rest of a batch, both its parts: from snapshot $5 to snapshot $6 after ($1, $2), at most
/// $3 (`outbox._snapshot_log`).
macro_rules! from_both_parts {
    () => {
        concat!(
            "FROM ",
            crate::ticks::batch_rows!(both, "$5", "$6"),
            " r ORDER BY r.txid, r.seq"
        )
    };
}
pub(super) use from_both_parts;

/// A reader's three window statements (`window_sql!` with each source).
pub(super) struct WindowSql {
    pub(super) horizon: &'static str,
    pub(super) range: &'static str,
    pub(super) both_parts: &'static str,
}

/// Runs the window after `after` of at most `max` events, `extra` the argument of the reader's
/// own column; its rows are then SPI's last result (`deformed_rows`).
pub(super) fn select_window(
    client: &SpiClient<'_>,
    sql: &WindowSql,
    after: &At,
    max: usize,
    extra: DatumWithOid<'_>,
) -> Result<(), pgrx::spi::Error> {
    let arguments = |after: Position, extra| {
        vec![
            DatumWithOid::from(after.txid.to_string()),
            DatumWithOid::from(after.seq),
            DatumWithOid::from(max.min(i32::MAX as usize) as i32),
            extra,
        ]
    };
    let Some(batch) = &after.batch else {
        plans::select(client, sql.horizon, None, &arguments(after.pos, extra))?;
        return Ok(());
    };
    let batch = BatchArgs::of(&batch.since, &batch.upto, after.pos);
    let mut args = arguments(batch.after, extra);
    args.extend(batch.batch());
    let sql = match batch.range {
        true => sql.range,
        false => sql.both_parts,
    };
    plans::select(client, sql, None, &args)?;
    Ok(())
}

/// The columns of a window's rows, as `Row` holds them: the log's, then one the reader
/// chooses, then outbox.event's oid.
#[derive(Clone, Copy)]
pub(super) enum Column {
    Txid,
    Seq,
    Id,
    Topic,
    Subject,
    Tenant,
    Payload,
    Headers,
    RaisedAt,
    /// Fan-out: raised_at as text, when a filter reads it. A sink: whether its topics match.
    Extra,
    EventType,
}
const COLUMNS: usize = 11;

/// One row of the window, deformed once (SPI's per-column access walks the tuple again for each
/// column after a variable-length one).
pub(super) struct Row {
    values: [pg_sys::Datum; COLUMNS],
    nulls: [bool; COLUMNS],
}

impl Row {
    pub(super) fn get(&self, c: Column) -> Option<pg_sys::Datum> {
        (!self.nulls[c as usize]).then_some(self.values[c as usize])
    }

    pub(super) fn position(&self) -> Position {
        let txid = self.get(Column::Txid).expect("txid").value() as u64;
        let seq = self.get(Column::Seq).expect("seq").value() as i64;
        Position::new(txid, seq)
    }

    /// A text column (topic, subject, tenant, the text ones).
    pub(super) fn text(&self, c: Column) -> Option<&str> {
        // SAFETY: the column is text (the window's SELECT), its datum alive in the window's rows.
        self.get(c)
            .and_then(|d| unsafe { <&str as pgrx::FromDatum>::from_datum(d, false) })
    }

    /// A jsonb column's uncompressed size (of its header, not decompressed).
    pub(super) fn size(&self, c: Column) -> i64 {
        self.get(c)
            .map_or(0, |d| crate::raw::RawJsonb(d).raw_size() as i64)
    }

    /// The event as an outbox.event (a composite datum in the current memory context).
    pub(super) fn event(&self, tupdesc: pg_sys::TupleDesc) -> pg_sys::Datum {
        use Column::*;
        let position = self.position();
        let position = pgrx::IntoDatum::into_datum(format!("{}:{}", position.txid, position.seq))
            .expect("text");
        let columns = [Id, Txid, Topic, Subject, Tenant, Payload, Headers, RaisedAt];
        let mut values = columns.map(|c| self.values[c as usize]);
        let mut nulls = columns.map(|c| self.nulls[c as usize]);
        (values[1], nulls[1]) = (position, false);
        // SAFETY: `tupdesc` is outbox.event's, whose columns these are in its order; the datums
        // are alive (the window's rows, the text just made). HeapTupleHeaderGetDatum flattens
        // values stored out of line into the composite, as a composite datum must be.
        unsafe {
            assert_eq!(
                (*tupdesc).natts as usize,
                columns.len(),
                "outbox.event's columns"
            );
            let tuple = pg_sys::heap_form_tuple(tupdesc, values.as_mut_ptr(), nulls.as_mut_ptr());
            pg_sys::HeapTupleHeaderGetDatum((*tuple).t_data)
        }
    }
}

/// The rows of the result the last SPI statement returned, deformed, and that result (to free
/// once they are no longer used: SPI keeps every result until the connection ends).
pub(super) fn deformed_rows() -> (Vec<Row>, *mut pg_sys::SPITupleTable) {
    // SAFETY: called right after the window's SELECT, whose result SPI_tuptable is (alive until
    // the SPI connection ends); it has COLUMNS columns.
    unsafe {
        let table = pg_sys::SPI_tuptable;
        if table.is_null() {
            return (Vec::new(), table);
        }
        let tupdesc = (*table).tupdesc;
        assert_eq!((*tupdesc).natts as usize, COLUMNS, "the window's columns");
        let n = (*table).numvals as usize;
        let mut rows = Vec::with_capacity(n);
        for i in 0..n {
            let mut row = Row {
                values: [pg_sys::Datum::from(0); COLUMNS],
                nulls: [true; COLUMNS],
            };
            pg_sys::heap_deform_tuple(
                *(*table).vals.add(i),
                tupdesc,
                row.values.as_mut_ptr(),
                row.nulls.as_mut_ptr(),
            );
            rows.push(row);
        }
        (rows, table)
    }
}

/// How many of `rows`, from the first, a window holds: cut before their payloads and headers pass
/// `pg_outbox.max_batch_bytes`, never before the first (the rule `outbox._read_window` states in
/// SQL, which the readers of whole windows read by).
pub(super) fn within_bytes(rows: &[Row]) -> usize {
    let max_bytes = crate::settings::MAX_BATCH_BYTES.get() as i64;
    let mut bytes = 0i64;
    rows.iter()
        .position(|row| {
            bytes += row.size(Column::Payload) + row.size(Column::Headers);
            bytes > max_bytes
        })
        .map_or(rows.len(), |over| over.max(1))
}

/// Runs `f` with `cx` as the current memory context (back to the one before afterwards; an
/// error aborts the transaction, which resets it anyway).
pub(super) fn allocating_in<R>(cx: pg_sys::MemoryContext, f: impl FnOnce() -> R) -> R {
    // SAFETY: `cx` is a live memory context of this transaction.
    unsafe {
        let before = pg_sys::MemoryContextSwitchTo(cx);
        let result = f();
        pg_sys::MemoryContextSwitchTo(before);
        result
    }
}

/// An outbox.event[] of `events` (outbox.event datums), in the current memory context.
pub(super) fn event_array(events: &[pg_sys::Datum], event_type: pg_sys::Oid) -> pg_sys::Datum {
    let mut elems = events.to_vec();
    // SAFETY: `elems` are outbox.event datums (composites: varlena, double-aligned) alive in this
    // SPI connection; construct_array copies them into an array palloc'd in the current context.
    let array = unsafe {
        pg_sys::construct_array(
            elems.as_mut_ptr(),
            elems.len() as i32,
            event_type,
            -1,
            false,
            pg_sys::TYPALIGN_DOUBLE as std::ffi::c_char,
        )
    };
    pg_sys::Datum::from(array)
}
