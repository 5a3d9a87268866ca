//! Read-only SPI helpers.
//!
//! pgrx's `Spi::get_one*` take the read-write path, and marking a transaction read-write makes
//! pgrx ask for its transaction id: every call would burn an xid and, worse, make the caller a
//! running transaction that holds back the very horizon it is asking about. Reads go through here.
//! Their statements have fixed texts, run from kept plans (`crate::plans`): the workers run some of
//! them on every round, where parsing and planning cost more than the read.

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::{FromDatum, IntoDatum};

/// The first column of the first row, read-only; None for no row or NULL.
pub fn one<T: FromDatum + IntoDatum>(sql: &str, args: &[DatumWithOid<'_>]) -> Option<T> {
    Spi::connect(|client| {
        let table = crate::plans::select(client, sql, Some(1), args)?;
        if table.is_empty() {
            return Ok(None);
        }
        table.first().get_one::<T>()
    })
    .unwrap_or_else(|e: pgrx::spi::Error| panic!("{sql}: {e}"))
}

/// The first two columns of the first row, read-only; None for no row.
pub fn two<A, B>(sql: &str, args: &[DatumWithOid<'_>]) -> Option<(Option<A>, Option<B>)>
where
    A: FromDatum + IntoDatum,
    B: FromDatum + IntoDatum,
{
    Spi::connect(|client| {
        let table = crate::plans::select(client, sql, Some(1), args)?;
        if table.is_empty() {
            return Ok(None);
        }
        table.first().get_two::<A, B>().map(Some)
    })
    .unwrap_or_else(|e: pgrx::spi::Error| panic!("{sql}: {e}"))
}
