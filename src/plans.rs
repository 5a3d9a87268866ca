//! The statements a worker runs on every pass, prepared once per process and kept.
//!
//! Parsing and planning a statement costs more than running it on a window of a hundred events
//! (perf on a draining worker: about 40 % of its time). Each statement here is prepared on its
//! first use with SPI_prepare and kept with SPI_keepplan, keyed by its text, for the life of the
//! worker process. A kept plan is PostgreSQL's plan cache at work: DDL on anything it reads (a
//! relation, a function, a type; `ALTER EXTENSION UPDATE`, `DROP` and `CREATE EXTENSION`) or a
//! change of `search_path` invalidates it, and its next use parses and plans it again from its
//! text, so nothing stale is ever run. Only statements with a fixed text belong here (and the
//! handler calls of sinks and of subscriptions' jobs, a few per handler, bounded by MAX_KEPT).

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::PgOid;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiResult, SpiTupleTable};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

thread_local! {
    static KEPT: RefCell<HashMap<String, Rc<OwnedPreparedStatement>>> = RefCell::new(HashMap::new());
}

/// Handler calls kept at most: past that the map is emptied (sinks come and go, and each one's
/// call is planned again on its next pass).
const MAX_KEPT: usize = 512;

/// Runs `sql`, read-only, from its kept generic plan (prepared on first use for the types of
/// `args`): the plan cache plans it once, not per run (`NestLevel::for_kept_statement`).
pub fn select<'conn>(
    client: &SpiClient<'conn>,
    sql: &str,
    limit: Option<libc::c_long>,
    args: &[DatumWithOid<'_>],
) -> SpiResult<SpiTupleTable<'conn>> {
    let statement = kept(client, sql, args, false)?;
    let _generic = crate::isolation::NestLevel::for_kept_statement();
    client.select(&*statement, limit, args)
}

/// Runs `sql`, a handler call, from its kept plan, under the settings in force: what the handler
/// plans is planned as the handler's owner would have it.
pub fn call<'conn>(
    client: &SpiClient<'conn>,
    sql: &str,
    args: &[DatumWithOid<'_>],
) -> SpiResult<SpiTupleTable<'conn>> {
    let statement = kept(client, sql, args, false)?;
    client.select(&*statement, None, args)
}

/// Runs `sql`, which writes, from its kept plan (prepared on first use for the types of `args`).
pub fn update<'conn>(
    client: &mut SpiClient<'conn>,
    sql: &str,
    limit: Option<libc::c_long>,
    args: &[DatumWithOid<'_>],
) -> SpiResult<SpiTupleTable<'conn>> {
    let statement = kept(client, sql, args, true)?;
    let _generic = crate::isolation::NestLevel::for_kept_statement();
    client.update(&*statement, limit, args)
}

/// Runs `sql`, a write with a RETURNING clause, from its kept plan in an SPI connection of its
/// own: whether it returned a row (a conditional UPDATE that applied).
pub fn applied(sql: &str, args: &[DatumWithOid<'_>]) -> SpiResult<bool> {
    pgrx::spi::Spi::connect_mut(|client| Ok(!update(client, sql, Some(1), args)?.is_empty()))
}

/// The kept plan of `sql` for arguments of these types, prepared now if it is not yet. Handed
/// out, not borrowed while it runs: what it runs (a handler) may use another kept statement.
fn kept(
    client: &SpiClient<'_>,
    sql: &str,
    args: &[DatumWithOid<'_>],
    mutating: bool,
) -> SpiResult<Rc<OwnedPreparedStatement>> {
    // The types are part of the key: the same text may be run with other types, and a type made
    // again (DROP and CREATE EXTENSION) has a new oid.
    let types: Vec<PgOid> = args.iter().map(|a| PgOid::from(a.oid())).collect();
    let key = types.iter().fold(sql.to_string(), |key, t| {
        format!("{key}\0{}", t.value().to_u32())
    });
    if let Some(statement) = KEPT.with(|kept| kept.borrow().get(&key).cloned()) {
        return Ok(statement);
    }
    let prepared = if mutating {
        client.prepare_mut(sql, &types)?
    } else {
        client.prepare(sql, &types)?
    };
    let statement = Rc::new(prepared.keep());
    KEPT.with(|kept| {
        let mut kept = kept.borrow_mut();
        if kept.len() >= MAX_KEPT {
            kept.clear();
        }
        kept.insert(key, statement.clone());
    });
    Ok(statement)
}
