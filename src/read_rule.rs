//! The Rust face of the read rule.
//!
//! The rule itself is SQL, in one place: `outbox._read_after` in `sql/schema.sql`, through which
//! every reader goes. What Rust needs is the horizon it reads below: the oldest transaction
//! still running anywhere in the cluster. Everything older has ended, so a position below the
//! horizon can have been handed to a reader and nothing can commit behind it any more.

/// The read horizon in positions: `pg_snapshot_xmin(pg_current_snapshot())` of the current
/// statement as a full 64-bit xid, in this database's epoch (see `crate::lineage`).
pub fn horizon() -> u64 {
    crate::lineage::horizon()
}

/// How many bytes an event's payload and headers take uncompressed (`outbox._event_size`), read
/// from each value's varlena header or toast pointer: nothing is decompressed or fetched. The
/// workers' windows (`outbox._read_window`) are cut on it.
#[pgrx::pg_extern(name = "_event_size", immutable, parallel_safe)]
pub fn event_size(
    payload: Option<crate::raw::RawJsonb>,
    headers: Option<crate::raw::RawJsonb>,
) -> i64 {
    [payload, headers]
        .into_iter()
        .flatten()
        .map(|v| v.raw_size() as i64)
        .sum()
}
