//! Who is calling, and acting as the owner of the log.
//!
//! The tables of schema `outbox` grant nothing to PUBLIC. Functions that need the caller's
//! identity (to record or check who owns a consumer) are SECURITY INVOKER: they read the caller,
//! check it, then run their fixed, schema-qualified SQL as the owner of the log -- the
//! same switch Postgres makes for a SECURITY DEFINER function, but after the check instead of
//! before it.

use crate::error::Error;
use pgrx::pg_sys;

/// The role the caller is acting as (`current_user`).
pub fn caller() -> pg_sys::Oid {
    // SAFETY: reads backend-local state that is always initialised in a normal backend.
    unsafe { pg_sys::GetUserId() }
}

/// True when `role` has the privileges of `owner` (is a member, or a superuser).
pub fn acts_for(role: pg_sys::Oid, owner: pg_sys::Oid) -> bool {
    // SAFETY: plain catalog lookups; both are role oids (a dropped owner simply matches nobody
    // but superusers).
    unsafe { pg_sys::has_privs_of_role(role, owner) }
}

/// The owner of `outbox.events`: the role that ran CREATE EXTENSION (the same role owns raise and
/// read, which are SECURITY DEFINER). Not the schema's owner: a schema that existed before the
/// extension, or was given away later, must not decide whose rights these functions use.
fn log_owner() -> pg_sys::Oid {
    // SAFETY: syscache lookups by name and oid; the tuple is released before returning and only
    // a plain Oid is copied out of it.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"outbox".as_ptr(), true);
        let relid = if nsp == pg_sys::InvalidOid {
            pg_sys::InvalidOid
        } else {
            pg_sys::get_relname_relid(c"events".as_ptr(), nsp)
        };
        if relid == pg_sys::InvalidOid {
            Error::NotInstalled.report();
        }
        let tuple = pg_sys::SearchSysCache1(
            pg_sys::SysCacheIdentifier::RELOID as i32,
            pg_sys::Datum::from(relid),
        );
        if tuple.is_null() {
            Error::NotInstalled.report();
        }
        let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_class>(tuple);
        let owner = (*form).relowner;
        pg_sys::ReleaseSysCache(tuple);
        owner
    }
}

/// Runs `f` as the owner of the log (see `log_owner`), with `search_path = pg_catalog, pg_temp`.
///
/// This is what Postgres does for a SECURITY DEFINER function with a pinned search_path. If `f`
/// raises an ERROR, the (sub)transaction abort restores the previous user and settings; on a
/// normal return the guard restores them here.
pub fn as_owner<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(pg_sys::Oid, i32, i32);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: puts back exactly what was saved below, innermost first.
            unsafe {
                pg_sys::AtEOXact_GUC(true, self.2);
                pg_sys::SetUserIdAndSecContext(self.0, self.1);
            }
        }
    }
    let owner = log_owner();
    let (mut user, mut context) = (pg_sys::InvalidOid, 0i32);
    // SAFETY: out-parameters are valid locals; the new context keeps every flag already set and
    // adds LOCAL_USERID_CHANGE, so SET ROLE inside cannot escape it.
    let _restore = unsafe {
        pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
        pg_sys::SetUserIdAndSecContext(
            owner,
            context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32,
        );
        let nest = pg_sys::NewGUCNestLevel();
        pg_sys::set_config_option(
            c"search_path".as_ptr(),
            c"pg_catalog, pg_temp".as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
        Restore(user, context, nest)
    };
    f()
}

/// Whether `role` still exists (a role can be dropped while it owns sinks in another database).
pub fn role_exists(role: pg_sys::Oid) -> bool {
    // SAFETY: a syscache existence probe by oid.
    unsafe {
        pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::AUTHOID as i32,
            pg_sys::Datum::from(role),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    }
}

/// DROP ROLE of a role that owns consumers (sinks, subscriptions, pull consumers) or schedules in
/// this database is refused, as PostgreSQL refuses to drop a role that owns objects: a sink whose
/// owner is gone can run nothing (its handler runs as that owner) and would hold the log for
/// ever. Called from the object-access hook, in the dropping session. (Another database's
/// consumers cannot be seen from here: the workers pause those when they meet them.)
pub fn refuse_drop_of_owner(role: pg_sys::Oid) {
    // SAFETY: catalog lookups by name in the current database.
    let installed = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"outbox".as_ptr(), true);
        nsp != pg_sys::InvalidOid
            && pg_sys::get_relname_relid(c"consumers".as_ptr(), nsp) != pg_sys::InvalidOid
            && pg_sys::get_relname_relid(c"schedules".as_ptr(), nsp) != pg_sys::InvalidOid
    };
    if !installed {
        return;
    }
    let owned = as_owner(|| {
        crate::query::one::<String>(
            "SELECT pg_catalog.string_agg(n, ', ' ORDER BY n) FROM ( \
                 SELECT c.kind || ' \"' || c.name || '\"' AS n FROM outbox.consumers c WHERE c.owner = $1 \
                 UNION ALL \
                 SELECT 'schedule \"' || s.name || '\"' FROM outbox.schedules s WHERE s.owner = $1 \
                 UNION ALL \
                 SELECT 'queue \"' || q.name || '\"' FROM outbox.queues q WHERE q.owner = $1 \
                 UNION ALL \
                 SELECT 'privileges on queue \"' || g.queue || '\"' FROM outbox.queue_grants g \
                  WHERE g.grantee = $1) o",
            &[pgrx::datum::DatumWithOid::from(role)],
        )
    });
    if let Some(owned) = owned {
        pgrx::pg_sys::panic::ErrorReport::new(
            pgrx::PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST,
            format!("role cannot be dropped because it owns pg_outbox objects in this database: {owned}"),
            "pg_outbox",
        )
        .set_hint("drop them first (outbox.drop_sink, outbox.unsubscribe, outbox.drop_consumer, outbox.unschedule, outbox.drop_queue, outbox.revoke_queue)")
        .report(pgrx::PgLogLevel::ERROR);
    }
}
