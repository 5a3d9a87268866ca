//! The trust boundary between the workers (a superuser process) and the code tenants wrote.
//!
//! Two rules, both as PostgreSQL keeps them for SECURITY DEFINER functions (`fmgr_security_definer`):
//! - The workers' own SQL runs under settings pinned for the life of the process, above all
//!   `search_path = pg_catalog, pg_temp`: no user schema is searched for an operator, a function
//!   or a type while the workers act as the superuser. `ALTER DATABASE ... SET` (which a
//!   database owner may run) applies at connection with a lower priority and is overridden.
//! - Every handler call runs in a GUC nest level of its own, and everything it set is undone when
//!   it returns, whether it succeeded or failed: a handler that ran `set_config('search_path',
//!   'shipping, pg_catalog', false)` once made the worker resolve `=` to the tenant's operator as
//!   the superuser (issue #10). Unlike a SECURITY DEFINER function, a plain `SET` in a handler does
//!   not survive either: the nest level is closed as if aborted.

use pgrx::pg_sys;
use std::ffi::CStr;

/// What the workers' own statements rely on. Each would otherwise come from the database's or
/// the bootstrap role's defaults, which a database owner can change.
const PINNED: [(&CStr, &CStr); 11] = [
    // The workers act as the role they connected as (the bootstrap superuser), whatever
    // `ALTER DATABASE ... SET role` says: a database owner could otherwise make them run as
    // itself, and their own SQL fail (or worse) there.
    (c"role", c"none"),
    // Nothing but the catalog resolves an unqualified name in the workers' SQL.
    (c"search_path", c"pg_catalog, pg_temp"),
    // The workers write (cursors, jobs, dead letters) and rely on READ COMMITTED snapshots.
    (c"default_transaction_read_only", c"off"),
    (c"default_transaction_isolation", c"read committed"),
    // The handler timeout is the workers' own; no inherited timeout may cut their bookkeeping.
    // (Each of the workers' transactions bounds its own lock waits: bound_lock_waits.)
    (c"statement_timeout", c"0"),
    (c"lock_timeout", c"0"),
    (c"idle_in_transaction_session_timeout", c"0"),
    // How the workers' SQL text itself parses and compares.
    (c"standard_conforming_strings", c"on"),
    (c"transform_null_equals", c"off"),
    (c"array_nulls", c"on"),
    // No JIT: the workers run their statements from cached plans, and a plan's JIT code is
    // compiled again at every execution. A query of the job runner's (an aggregate over nested
    // loops whose estimate passes `jit_above_cost`) spent more time in LLVM than in running; with
    // JIT off, running already queued jobs went from 48k to 70k a second. A handler that wants
    // JIT says so (`ALTER FUNCTION ... SET jit = on`).
    (c"jit", c"off"),
];

/// Sets the pinned settings for the rest of this process's life (at session level: above the
/// database's and role's defaults and the configuration file). Call in a transaction.
pub fn pin_worker_settings() {
    // The session's role first: `ALTER DATABASE ... SET session_authorization`, which a database
    // owner may run, applies to a worker at connection (it connected as the bootstrap superuser,
    // who may take any identity) and would make the whole process that owner.
    // SAFETY: reads the name of a role that always exists.
    let bootstrap = unsafe {
        CStr::from_ptr(pg_sys::GetUserNameFromId(
            pg_sys::Oid::from(pg_sys::BOOTSTRAP_SUPERUSERID),
            false,
        ))
    };
    set(c"session_authorization", bootstrap);
    for (name, value) in PINNED {
        set(name, value);
    }
}

/// Names the worker in `pg_stat_activity.application_name` (`pg_outbox worker <slot>`): operators
/// and monitoring find it there as they find any client.
pub fn name_worker(slot: usize) {
    let name = std::ffi::CString::new(format!("pg_outbox worker {slot}")).expect("no NUL");
    set(c"application_name", &name);
}

/// For the rest of the worker's transaction, its commit does not wait for its WAL to be flushed
/// (a sink with `synchronous_commit` off, see `outbox.alter_sink`). Like SET LOCAL: gone when the
/// transaction ends, and taken before a handler's nest level, so the handler cannot undo it.
pub fn commit_without_waiting_for_flush() {
    set_config(
        c"synchronous_commit",
        c"off",
        pg_sys::GucAction::GUC_ACTION_LOCAL,
    );
}

/// How long a statement of the workers' own may wait for a lock (`bound_lock_waits`).
pub const WORKER_LOCK_WAIT_MS: u32 = 1000;

/// For the rest of the worker's transaction, a lock that one of its own statements waits for
/// longer than [`WORKER_LOCK_WAIT_MS`] fails the statement (`55P03`), and the step it was part
/// of is tried again in a later round. The workers pass over what another session holds (leases
/// are only tried; rows a tenant's open transaction holds are skipped, SKIP LOCKED): this bounds
/// any wait that was missed, so that no transaction another role leaves open can hold a worker.
/// Handlers are not bound by it (their nest level sets `lock_timeout` back to 0: the handler
/// timeout bounds them).
pub fn bound_lock_waits() {
    lock_timeout_local(WORKER_LOCK_WAIT_MS);
}

/// For the rest of the worker's transaction, a lock it waits for longer than `ms` fails its
/// statement (`55P03`). Like SET LOCAL.
pub fn lock_timeout_local(ms: u32) {
    let value = std::ffi::CString::new(ms.to_string()).expect("no NUL");
    set_config(c"lock_timeout", &value, pg_sys::GucAction::GUC_ACTION_LOCAL);
}

fn set(name: &CStr, value: &CStr) {
    set_config(name, value, pg_sys::GucAction::GUC_ACTION_SET);
}

/// A session-level assignment (`SET`, or with GUC_ACTION_SAVE what a function's SET clause does).
fn set_config(name: &CStr, value: &CStr, action: pg_sys::GucAction::Type) {
    // SAFETY: a GUC assignment with valid C strings inside a transaction; a value that does not
    // apply raises an ERROR, which the caller's transaction catches.
    unsafe {
        pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_SESSION,
            action,
            true,
            0,
            false,
        );
    }
}

/// The current value of a setting, as SHOW prints it.
fn current(name: &CStr) -> Option<String> {
    // SAFETY: reads a GUC by name; missing_ok, so an unknown name gives NULL.
    unsafe {
        let v = pg_sys::GetConfigOption(name.as_ptr(), true, false);
        (!v.is_null()).then(|| CStr::from_ptr(v).to_string_lossy().into_owned())
    }
}

/// The pinned settings that no longer hold (defence in depth: the nest levels should make this
/// impossible). The worker checks before each round, puts them back and says so.
pub fn drifted() -> Vec<String> {
    // SAFETY: reads backend globals.
    let session = unsafe { pg_sys::GetSessionUserId() };
    let identity = (session != pg_sys::Oid::from(pg_sys::BOOTSTRAP_SUPERUSERID))
        .then(|| "session_authorization".to_string());
    identity
        .into_iter()
        .chain(
            PINNED
                .iter()
                .filter(|(name, value)| current(name).as_deref() != Some(&*value.to_string_lossy()))
                .map(|(name, _)| name.to_string_lossy().into_owned()),
        )
        .collect()
}

/// What a handler sees as its search_path: PostgreSQL's default, as in a fresh session of its
/// owner (`"$user"` is the owner while it runs). The workers' own pinned path would make every
/// unqualified name in a handler fail; the owner's `ALTER ROLE ... SET` is not applied. Whatever
/// a handler resolves through it, it resolves as its owner, never as the superuser.
const HANDLER_SEARCH_PATH: &CStr = c"\"$user\", public";

/// A GUC nest level around a handler call: everything set inside (SET, SET LOCAL, set_config,
/// a function's own SET clause) is undone when this is dropped, whether the call returned or
/// raised. On an ERROR the enclosing subtransaction's abort would undo it anyway; doing it here on
/// both paths means no setting reaches the worker's next statement.
pub struct NestLevel(i32);

impl NestLevel {
    /// Opens a level for a handler call, with the handler's search_path set inside it.
    pub fn for_handler() -> NestLevel {
        // SAFETY: opens a GUC nest level, as fmgr_security_definer does before calling a function;
        // search_path is then set inside it as a function's SET clause does (GUC_ACTION_SAVE).
        let level = NestLevel(unsafe { pg_sys::NewGUCNestLevel() });
        set_config(
            c"search_path",
            HANDLER_SEARCH_PATH,
            pg_sys::GucAction::GUC_ACTION_SAVE,
        );
        // The workers' own bound on lock waits is theirs (bound_lock_waits), not the handler's.
        set_config(c"lock_timeout", c"0", pg_sys::GucAction::GUC_ACTION_SAVE);
        level
    }

    /// Opens a level for one of the workers' kept statements (`crate::plans`), in which the plan
    /// cache uses the statement's generic plan. Left to itself it keeps making a custom plan for
    /// each run of the window read (a generic plan cannot see the LIMIT), which perf put at a
    /// quarter of a draining worker's time, the inlining of the read rule included.
    pub fn for_kept_statement() -> NestLevel {
        // SAFETY: as in for_handler.
        let level = NestLevel(unsafe { pg_sys::NewGUCNestLevel() });
        set_config(
            c"plan_cache_mode",
            c"force_generic_plan",
            pg_sys::GucAction::GUC_ACTION_SAVE,
        );
        level
    }
}

/// Sets `name` to `value` in the innermost nest level (a `NestLevel` the caller holds), as a
/// function's SET clause does: undone when that level is dropped.
pub fn set_in_level(name: &CStr, value: &CStr) {
    set_config(name, value, pg_sys::GucAction::GUC_ACTION_SAVE);
}

impl Drop for NestLevel {
    fn drop(&mut self) {
        // SAFETY: closes the level opened above; isCommit = false restores every setting changed
        // at or inside it to its prior value (AtEOXact_GUC's abort path), which is the point: a
        // committed plain SET would otherwise be kept.
        unsafe { pg_sys::AtEOXact_GUC(false, self.0) };
    }
}
