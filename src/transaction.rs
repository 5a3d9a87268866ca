//! Transactions and subtransactions that catch errors instead of ending the process.
//!
//! A background worker that lets an ERROR escape exits; one bad sink must not take the worker
//! (and every other sink) with it. These helpers run a closure, and on a Postgres ERROR roll back
//! and hand the error back as a value. Rust panics are not caught here: they are bugs.

use pgrx::pg_sys::panic::CaughtError;
use pgrx::prelude::*;
use std::panic::AssertUnwindSafe;

/// A caught Postgres error: its SQLSTATE and message.
#[derive(Debug, Clone)]
pub struct Failure {
    pub sqlstate: String,
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (SQLSTATE {})", self.message, self.sqlstate)
    }
}

/// The five-character SQLSTATE of a packed error code (MAKE_SQLSTATE in elog.h).
fn unpack_sqlstate(code: i32) -> String {
    (0..5)
        .map(|i| (((code >> (6 * i)) & 0x3F) as u8 + b'0') as char)
        .collect()
}

fn failure_from(e: CaughtError) -> Failure {
    match e {
        CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) => Failure {
            sqlstate: unpack_sqlstate(r.sql_error_code() as i32),
            message: r.message().to_string(),
        },
        panic @ CaughtError::RustPanic { .. } => panic.rethrow(),
    }
}

/// What a worker's transaction returns, untried, while DDL holds a relation of the extension.
pub const LOCKED_BY_DDL: &str = "a relation of pg_outbox is locked by DDL; the step waits for it";
/// lock_not_available
pub const LOCKED_BY_DDL_STATE: &str = "55P03";

/// Whether an error, as a worker reports it (a Failure displayed, perhaps after some context), says
/// the transaction did not run because DDL held a relation of the extension. Not a failure of the
/// step: it runs again on a later round.
pub fn locked_by_ddl(error: &str) -> bool {
    error.ends_with(&format!("{LOCKED_BY_DDL} (SQLSTATE {LOCKED_BY_DDL_STATE})"))
}

/// Runs `f` in a transaction of its own (with a snapshot), which first takes every relation of the
/// extension without waiting; while DDL holds one, `f` does not run and the error says so
/// ([`Failure::locked_by_ddl`]). Commits on success; on an ERROR rolls
/// back and returns it.
pub fn in_transaction<R>(f: impl FnOnce() -> R) -> Result<R, Failure> {
    transaction(true, f)
}

/// [`in_transaction`] for a transaction that touches no relation of the extension (the worker's
/// first, which names it and pins its settings): it runs even while DDL holds them.
pub fn in_bare_transaction<R>(f: impl FnOnce() -> R) -> Result<R, Failure> {
    transaction(false, f)
}

fn transaction<R>(lock: bool, f: impl FnOnce() -> R) -> Result<R, Failure> {
    // SAFETY: called from the worker's top level, outside any transaction.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    // Before anything else: every relation of the extension, or nothing (see lock_members).
    let members = if lock {
        crate::isolation::bound_lock_waits();
        crate::dispatch::lock_members()
    } else {
        crate::dispatch::Members::Absent
    };
    let result = match members {
        crate::dispatch::Members::Refused => Err(Failure {
            sqlstate: LOCKED_BY_DDL_STATE.into(),
            message: LOCKED_BY_DDL.into(),
        }),
        _ => PgTryBuilder::new(AssertUnwindSafe(|| Ok(f())))
            .catch_others(|e| Err(failure_from(e)))
            .execute(),
    };
    // SAFETY: ends the transaction begun above, one way or the other.
    let result = unsafe {
        let result = match result {
            Ok(value) => {
                pg_sys::PopActiveSnapshot();
                // The commit itself can raise an ERROR (a full notification queue, a deferred
                // constraint): caught like any other, the transaction is then rolled back.
                PgTryBuilder::new(|| {
                    pg_sys::CommitTransactionCommand();
                    Ok(())
                })
                .catch_others(|e| Err(failure_from(e)))
                .execute()
                .map(|()| value)
            }
            Err(e) => Err(e),
        };
        if result.is_err() {
            pg_sys::AbortCurrentTransaction();
        }
        // Let autovacuum see what the worker wrote and deleted (the outbox churns).
        pg_sys::pgstat_report_stat(false);
        result
    };
    result
}

/// Replaces the active snapshot with a new one (READ COMMITTED: it sees every commit so far), for
/// the statements that follow in the worker's transaction.
pub fn refresh_snapshot() {
    // SAFETY: the worker pushed the active snapshot in `in_transaction`; no SPI statement is
    // running, so the top of the stack is that one.
    unsafe {
        pg_sys::PopActiveSnapshot();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
}

/// Runs `f` in a subtransaction: released on success, rolled back on an ERROR, which is returned.
/// Everything `f` did is undone on failure; what the caller did before is kept.
pub fn in_subtransaction<R>(f: impl FnOnce() -> R) -> Result<R, Failure> {
    in_subtransaction_kept_if(|| (f(), true))
}

/// Runs `f` in a subtransaction that is released (kept) when `f` says so, with the second value
/// it returns, and otherwise rolled back: that undoes what it did and lets go of the locks it
/// took. An ERROR rolls it back too, and is returned.
pub fn in_subtransaction_kept_if<R>(f: impl FnOnce() -> (R, bool)) -> Result<R, Failure> {
    // SAFETY: the same sequence as PL/pgSQL's exception blocks (pl_exec.c, exec_stmt_block): keep
    // running in the caller's memory context and restore the resource owner afterwards.
    unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
        let result = PgTryBuilder::new(AssertUnwindSafe(|| Ok(f())))
            .catch_others(|e| Err(failure_from(e)))
            .execute();
        match result {
            Ok((_, true)) => pg_sys::ReleaseCurrentSubTransaction(),
            Ok((_, false)) | Err(_) => pg_sys::RollbackAndReleaseCurrentSubTransaction(),
        }
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
        result.map(|(value, _)| value)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sqlstates_unpack() {
        let pack = |s: &str| {
            s.bytes().enumerate().fold(0i32, |acc, (i, b)| {
                acc | (((b - b'0') as i32 & 0x3F) << (6 * i))
            })
        };
        for s in ["22023", "57014", "P0001", "42501", "XX000"] {
            assert_eq!(super::unpack_sqlstate(pack(s)), s);
        }
    }
}
