//! The Rust face of the read rule.
//!
//! The rule itself is SQL, in one place: `outbox._read_after` in `sql/schema.sql`, through which
//! every reader goes. What Rust needs is the horizon it reads below: the oldest transaction
//! still running anywhere in the cluster. Everything older has ended, so a position below the
//! horizon can have been handed to a reader and nothing can commit behind it any more.

/// `pg_snapshot_xmin(pg_current_snapshot())` of the current statement, as a full 64-bit xid.
pub fn horizon() -> u64 {
    let text = crate::query::one::<String>(
        "SELECT pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())::text",
        &[],
    )
    .expect("a snapshot always has an xmin");
    text.parse().expect("xid8 prints as an unsigned integer")
}
