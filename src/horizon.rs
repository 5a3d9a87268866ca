//! `outbox.horizon()`: why delivery waits.
//!
//! Readers see only transactions older than the oldest one still running in the whole cluster.
//! One forgotten `BEGIN` in any database holds every reader back; this names it instead of
//! leaving the user to guess.

use crate::owner::as_owner;
use crate::read_rule;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

/// Who holds the horizon: a backend's row of pg_stat_activity, or a prepared transaction.
type Holder = (
    Option<i32>,
    Option<String>,
    Option<String>,
    Option<i32>,
    Option<pgrx::datum::Interval>,
    Option<String>,
    Option<String>,
);

fn holder(horizon: u64) -> Holder {
    // Runs as the caller, so pg_stat_activity shows only what the caller may see (another role's
    // query reads "<insufficient privilege>" unless the caller has pg_read_all_stats).
    let args = [DatumWithOid::from(horizon.to_string())];
    let backend = Spi::connect(|client| {
        let rows = client.select(
            "SELECT a.pid, a.datname::text, a.usename::text, pg_catalog.age(a.backend_xid), \
                    pg_catalog.now() OPERATOR(pg_catalog.-) a.xact_start, a.state, \
                    pg_catalog.left(a.query, 200) \
               FROM pg_catalog.pg_stat_activity a \
              WHERE a.backend_xid OPERATOR(pg_catalog.=) pg_catalog.xid($1::pg_catalog.xid8)",
            Some(1),
            &args,
        )?;
        let mut found = None;
        for r in rows {
            found = Some((
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
                r.get(6)?,
                r.get(7)?,
            ));
        }
        Ok::<_, pgrx::spi::Error>(found)
    })
    .expect("reading pg_stat_activity");
    if let Some(found) = backend {
        return found;
    }
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT p.database::text, p.owner::text, pg_catalog.age(p.transaction), \
                    pg_catalog.now() OPERATOR(pg_catalog.-) p.prepared, \
                    'PREPARE TRANSACTION ' OPERATOR(pg_catalog.||) pg_catalog.quote_literal(p.gid) \
               FROM pg_catalog.pg_prepared_xacts p \
              WHERE p.transaction OPERATOR(pg_catalog.=) pg_catalog.xid($1::pg_catalog.xid8)",
            Some(1),
            &args,
        )?;
        let mut found = (None, None, None, None, None, None, None);
        for r in rows {
            found = (
                None,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                Some("prepared".into()),
                r.get(5)?,
            );
        }
        Ok::<_, pgrx::spi::Error>(found)
    })
    .expect("reading pg_prepared_xacts")
}

/// The read horizon, how many committed events wait behind it, and who holds it (NULLs when no
/// transaction is running).
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)]
fn horizon() -> TableIterator<
    'static,
    (
        name!(horizon, String),
        name!(waiting_events, i64),
        name!(pid, Option<i32>),
        name!(datname, Option<String>),
        name!(usename, Option<String>),
        name!(xid_age, Option<i32>),
        name!(xact_age, Option<pgrx::datum::Interval>),
        name!(state, Option<String>),
        name!(query, Option<String>),
    ),
> {
    // The holder is found by its transaction id; events are counted in positions (the same id
    // in this database's epoch, see crate::lineage).
    let h = crate::lineage::xmin();
    let (pid, datname, usename, xid_age, xact_age, state, query) = holder(h);
    let bound = read_rule::horizon();
    // Planned for this bound, not from a kept generic plan (crate::query): the events past the
    // horizon are the end of the log, an index range a generic plan could take for a third of it.
    let waiting = as_owner(|| {
        Spi::connect(|client| {
            client
                .select(
                    "SELECT count(*) FROM outbox.events WHERE txid >= $1::xid8",
                    Some(1),
                    &[DatumWithOid::from(bound.to_string())],
                )?
                .first()
                .get_one::<i64>()
        })
        .unwrap_or_else(|e| panic!("counting the events past the horizon: {e}"))
    })
    .unwrap_or(0);
    TableIterator::once((
        h.to_string(),
        waiting,
        pid,
        datname,
        usename,
        xid_age,
        xact_age,
        state,
        query,
    ))
}
