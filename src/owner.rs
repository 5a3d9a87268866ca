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
