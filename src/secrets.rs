//! Keeping HTTP and Kafka sinks' secrets out of the server log.
//!
//! A failing `create_http_sink` was logged with its `STATEMENT:` line, and that line held the
//! `Authorization` header and the `whsec_` signing secret in clear (issue #10). Messages pg_outbox
//! writes never echo a secret; this hides the statement of every message the backend emits for
//! the rest of a transaction that was handed one, as PostgreSQL's own `errhidestmt` does for a
//! single message. What it cannot reach is logging that happens before the function runs
//! (`log_statement = 'all'`) or after it (`log_min_duration_statement`): the README says so.

use pgrx::{pg_guard, pg_sys, register_xact_callback, PgXactCallbackEvent};
use std::cell::Cell;

thread_local! {
    static HIDE_STATEMENT: Cell<bool> = const { Cell::new(false) };
}

static mut PREV_EMIT_LOG_HOOK: pg_sys::emit_log_hook_type = None;

/// Installs the log hook in this process (from `_PG_init`: in every backend that loads pg_outbox,
/// which it does before running any of its functions).
pub fn init() {
    // SAFETY: hooks are process-global and installed once per process, from _PG_init; the
    // previous hook is kept and called after ours.
    unsafe {
        PREV_EMIT_LOG_HOOK = pg_sys::emit_log_hook;
        pg_sys::emit_log_hook = Some(on_emit_log);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_emit_log(edata: *mut pg_sys::ErrorData) {
    if !edata.is_null() && HIDE_STATEMENT.with(|h| h.get()) {
        // SAFETY: PostgreSQL hands the hook the message being emitted, ours to adjust. The
        // context too: called from PL/pgSQL or a DO block, it quotes the statement.
        unsafe {
            (*edata).hide_stmt = true;
            (*edata).hide_ctx = true;
        }
    }
    // SAFETY: chaining to the hook installed before ours, with the same argument.
    unsafe {
        if let Some(prev) = PREV_EMIT_LOG_HOOK {
            prev(edata);
        }
    }
}

/// No message logged for the rest of this transaction shows its statement text. The flag is
/// cleared when the transaction ends, after an error's report was written (PostgreSQL emits the
/// report before it aborts the transaction).
pub fn hide_statement_until_transaction_end() {
    if HIDE_STATEMENT.with(|h| h.replace(true)) {
        return;
    }
    register_xact_callback(PgXactCallbackEvent::Commit, || {
        HIDE_STATEMENT.with(|h| h.set(false))
    });
    register_xact_callback(PgXactCallbackEvent::Abort, || {
        HIDE_STATEMENT.with(|h| h.set(false))
    });
}
