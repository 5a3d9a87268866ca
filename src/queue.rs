//! Job queues and who may use them: `create_queue`, `drop_queue`, `grant_queue`, `revoke_queue`,
//! and the job calls that act on a queue's jobs (`enqueue`, `claim`, `complete`, `complete_many`,
//! `fail`, `extend`, `replay_job`).
//!
//! Each is SECURITY INVOKER: it reads the caller (`current_user`, as PostgreSQL's own privilege
//! checks do, so a SECURITY DEFINER function of another role acts as that role), then calls the
//! matching `outbox._<name>(..., who)` of `src/sql/jobs.sql` as the owner of the log. Those check
//! what `who` may do on the queue. They are SECURITY INVOKER too, and only the log's owner may read
//! the tables, so calling them directly gets a role nothing it could not do itself.

use crate::error::OrReport;
use crate::owner::{as_owner, caller};
use crate::raw::{RawJsonb, RawRegrole};
use pgrx::callconv::{BoxRet, FcInfo};
use pgrx::datum::{Datum, DatumWithOid};
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use pgrx::{IntoDatum, PgMemoryContexts, PgOid};

/// Runs `SELECT outbox._<function>(args..., who)` as the log's owner, with the caller as `who`
/// (the calls that are not on the hot path: no kept plan).
fn run(sql: &str, mut args: Vec<DatumWithOid<'_>>) {
    args.push(DatumWithOid::from(caller()));
    as_owner(|| Spi::run_with_args(sql, &args)).unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A statement of the job calls' hot path (`enqueue`, `claim`, `complete`...): its plan is made
/// once per backend and kept, so a call does not parse and plan it again (that was half of what
/// an `enqueue` cost). `types`: of its parameters, the caller's oid last.
struct Hot {
    sql: &'static str,
    types: &'static [pg_sys::PgBuiltInOids],
}

thread_local! {
    static PLANS: std::cell::RefCell<std::collections::HashMap<&'static str, std::rc::Rc<OwnedPreparedStatement>>> =
        Default::default();
}

/// The kept plan of `hot`, made on first use. Names in it are qualified, so the search_path it is
/// made under does not matter; a plan whose functions are replaced (an extension update) is made
/// again by the plan cache.
fn plan(hot: &Hot) -> std::rc::Rc<OwnedPreparedStatement> {
    if let Some(plan) = PLANS.with(|p| p.borrow().get(hot.sql).cloned()) {
        return plan;
    }
    let types: Vec<PgOid> = hot.types.iter().map(|t| PgOid::BuiltIn(*t)).collect();
    let plan = std::rc::Rc::new(
        as_owner(|| Spi::connect(|c| c.prepare_mut(hot.sql, &types).map(|s| s.keep())))
            .unwrap_or_else(|e| panic!("preparing {}: {e}", hot.sql)),
    );
    PLANS.with(|p| p.borrow_mut().insert(hot.sql, plan.clone()));
    plan
}

/// Runs `hot` as the log's owner with the caller appended to `args`, and reads its result.
fn execute<R>(
    hot: &Hot,
    mut args: Vec<DatumWithOid<'_>>,
    read: impl FnOnce(pgrx::spi::SpiTupleTable<'_>) -> Result<R, pgrx::spi::Error>,
) -> R {
    args.push(DatumWithOid::from(caller()));
    let plan = plan(hot);
    as_owner(|| {
        // Generic plans for what the call runs (its PL/pgSQL statements included): left to itself
        // the plan cache plans the claim again on every call (a LIMIT it cannot see makes the
        // generic plan look dear), a tenth of a claim. Undone with as_owner's level.
        crate::isolation::set_in_level(c"plan_cache_mode", c"force_generic_plan");
        Spi::connect_mut(|client| read(client.update(&*plan, None, &args)?))
    })
    .unwrap_or_else(|e| panic!("{}: {e}", hot.sql))
}

/// `execute` for a statement that gives one value.
fn execute_one<T: pgrx::FromDatum + IntoDatum>(
    hot: &Hot,
    args: Vec<DatumWithOid<'_>>,
) -> Option<T> {
    execute(hot, args, |t| t.first().get_one::<T>())
}

use pg_sys::BuiltinOid::{
    BOOLOID, INT4OID, INT8ARRAYOID, INT8OID, INTERVALOID, JSONBOID, OIDOID, TEXTOID, TIMESTAMPTZOID,
};

const ENQUEUE: Hot = Hot {
    sql: "SELECT outbox._enqueue($1, $2, $3, $4, $5, $6)",
    types: &[TEXTOID, JSONBOID, TIMESTAMPTZOID, TEXTOID, INT4OID, OIDOID],
};
const CLAIM: Hot = Hot {
    sql: "SELECT c FROM outbox._claim($1, $2, $3, $4) c",
    types: &[TEXTOID, INT4OID, INTERVALOID, OIDOID],
};
const COMPLETE: Hot = Hot {
    sql: "SELECT outbox._complete_many(ARRAY[$1], $2)",
    types: &[INT8OID, OIDOID],
};
const COMPLETE_MANY: Hot = Hot {
    sql: "SELECT outbox._complete_many($1, $2)",
    types: &[INT8ARRAYOID, OIDOID],
};
const FAIL: Hot = Hot {
    sql: "SELECT outbox._fail($1, $2, $3, $4)",
    types: &[INT8OID, TEXTOID, BOOLOID, OIDOID],
};
const EXTEND: Hot = Hot {
    sql: "SELECT outbox._extend($1, $2, $3)",
    types: &[INT8OID, INTERVALOID, OIDOID],
};

/// A row of type `outbox.job`, copied out of SPI into the memory of the set-returning call.
pub struct Job(pg_sys::Datum);

// SAFETY: the datum is a composite of type outbox.job, which the function declares it returns.
unsafe impl BoxRet for Job {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> Datum<'fcx> {
        // SAFETY: the caller returns this datum from the function, as BoxRet requires.
        unsafe { fcinfo.return_raw_datum(self.0) }
    }
}

// SAFETY: the SQL type named here is the composite the datum holds.
unsafe impl SqlTranslatable for Job {
    const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!(Job);
    const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
    const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> =
        Ok(SqlMappingRef::literal("outbox.job"));
    const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
        Ok(ReturnsRef::SetOf(SqlMappingRef::literal("outbox.job")));
}

/// Creates the queue `name`, owned by the caller. 42710 if it exists. (`enqueue` and
/// `subscribe` create a queue they name that does not exist yet; this reserves a name first.)
/// With `expire_after`, a job for external workers that nobody claims within that long after it
/// is due dies with the error 'expired'.
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn create_queue(name: Option<&str>, expire_after: default!(Option<Interval>, "NULL")) {
    run(
        "SELECT outbox._create_queue($1, $2, $3)",
        vec![DatumWithOid::from(name), DatumWithOid::from(expire_after)],
    );
}

/// Sets the queue's `expire_after` (NULL: its jobs wait until claimed); only members of its
/// owner may.
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn alter_queue(name: Option<&str>, expire_after: Option<Interval>) {
    run(
        "SELECT outbox._alter_queue($1, $2, $3)",
        vec![DatumWithOid::from(name), DatumWithOid::from(expire_after)],
    );
}

/// Drops the queue `name`; only members of its owner may. Refused while a subscription or a
/// schedule queues jobs on it, or while it holds jobs (unless `drop_jobs`).
#[pg_extern(volatile, parallel_unsafe, requires = ["subscriptions", "schedules"])]
fn drop_queue(name: Option<&str>, drop_jobs: default!(Option<bool>, "false")) {
    run(
        "SELECT outbox._drop_queue($1, $2, $3)",
        vec![DatumWithOid::from(name), DatumWithOid::from(drop_jobs)],
    );
}

/// Lets `role` (and its members) enqueue jobs on `queue` and/or work them (claim, complete, fail,
/// extend, replay). Only members of the queue's owner may grant. Adds to what was granted before.
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn grant_queue(
    queue: Option<&str>,
    role: Option<RawRegrole>,
    enqueue: default!(Option<bool>, "true"),
    work: default!(Option<bool>, "true"),
) {
    run(
        "SELECT outbox._grant_queue($1, $2, $3, $4, $5)",
        vec![
            DatumWithOid::from(queue),
            DatumWithOid::from(role.map(RawRegrole::oid)),
            DatumWithOid::from(enqueue),
            DatumWithOid::from(work),
        ],
    );
}

/// Takes back what `grant_queue` gave `role` on `queue` (the privileges passed as true).
#[pg_extern(volatile, parallel_unsafe, requires = ["subscriptions", "schedules"])]
fn revoke_queue(
    queue: Option<&str>,
    role: Option<RawRegrole>,
    enqueue: default!(Option<bool>, "true"),
    work: default!(Option<bool>, "true"),
) {
    run(
        "SELECT outbox._revoke_queue($1, $2, $3, $4, $5)",
        vec![
            DatumWithOid::from(queue),
            DatumWithOid::from(role.map(RawRegrole::oid)),
            DatumWithOid::from(enqueue),
            DatumWithOid::from(work),
        ],
    );
}

/// Queues a job on `queue` with `payload`, due at `run_at` (NULL: now). A `key` is queued once
/// while its job waits: enqueueing it again returns the waiting job. Returns the job's id.
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn enqueue(
    queue: Option<&str>,
    payload: default!(Option<RawJsonb>, "'{}'"),
    run_at: default!(Option<TimestampWithTimeZone>, "NULL"),
    key: default!(Option<&str>, "NULL"),
    max_attempts: default!(Option<i32>, "10"),
) -> Option<i64> {
    let id = execute_one::<i64>(
        &ENQUEUE,
        vec![
            DatumWithOid::from(queue),
            payload.map_or_else(DatumWithOid::null::<pgrx::JsonB>, |p| {
                // SAFETY: a jsonb datum typed as jsonb.
                unsafe { DatumWithOid::new(p.0, pg_sys::JSONBOID) }
            }),
            DatumWithOid::from(run_at),
            DatumWithOid::from(key),
            DatumWithOid::from(max_attempts),
        ],
    );
    // Due by the time this transaction commits: its queue's external workers are woken then (a
    // job due later is announced by the workers when it comes due).
    if let Some(queue) = queue {
        crate::worker::announce_at_commit(queue, run_at.map(i64::from));
    }
    id
}

/// Claims up to `max_jobs` due jobs of `queue` (see `outbox._claim` for leases).
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn claim(
    queue: Option<&str>,
    max_jobs: default!(Option<i32>, "1"),
    lease: default!(Option<Interval>, "'30 seconds'"),
) -> SetOfIterator<'static, Job> {
    // The memory of this set-returning call: the rows must outlive SPI's.
    let target = PgMemoryContexts::CurrentMemoryContext.value();
    let jobs = execute(
        &CLAIM,
        vec![
            DatumWithOid::from(queue),
            DatumWithOid::from(max_jobs),
            DatumWithOid::from(lease),
        ],
        |rows| {
            let mut jobs = Vec::with_capacity(rows.len());
            for row in rows {
                if let Some(datum) = row.get_datum_by_ordinal(1)?.value::<RawDatum>()? {
                    // SAFETY: a non-null composite datum (a flat varlena), copied whole into the
                    // call's memory context, which outlives every row this call returns.
                    let copy = unsafe {
                        PgMemoryContexts::For(target)
                            .switch_to(|_| pg_sys::pg_detoast_datum_copy(datum.0.cast_mut_ptr()))
                    };
                    jobs.push(Job(pg_sys::Datum::from(copy)));
                }
            }
            Ok(jobs)
        },
    );
    SetOfIterator::new(jobs)
}

/// A datum left as SPI gave it (copied by the caller).
#[derive(Clone, Copy)]
struct RawDatum(pg_sys::Datum);

impl pgrx::FromDatum for RawDatum {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<Self> {
        (!is_null).then_some(RawDatum(datum))
    }
}

impl IntoDatum for RawDatum {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.0)
    }
    fn type_oid() -> pg_sys::Oid {
        pg_sys::RECORDOID
    }
    fn is_compatible_with(_: pg_sys::Oid) -> bool {
        true
    }
}

/// Completes a job this caller holds (claimed with a lease, or with `lease => NULL` in this
/// transaction): deletes it. False when it is not running (its lease lapsed and someone else
/// took it, say).
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn complete(job: Option<i64>) -> bool {
    let job = pg_outbox_core::required(job, "job").or_report();
    execute_one::<i32>(&COMPLETE, vec![DatumWithOid::from(job)]) == Some(1)
}

/// `complete` for many jobs in one statement; returns how many were completed.
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn complete_many(jobs: Option<Vec<Option<i64>>>) -> Option<i32> {
    execute_one::<i32>(&COMPLETE_MANY, vec![DatumWithOid::from(jobs)])
}

/// Fails a job this caller holds: back to waiting with a back-off while attempts remain and
/// `retry`, else dead. Returns its new state.
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn fail(
    job: Option<i64>,
    error: default!(Option<&str>, "NULL"),
    retry: default!(Option<bool>, "true"),
) -> Option<String> {
    let state = execute_one::<String>(
        &FAIL,
        vec![
            DatumWithOid::from(job),
            DatumWithOid::from(error),
            DatumWithOid::from(retry),
        ],
    );
    // A retry that comes due before this transaction commits (a claim without a lease held for
    // longer than the back-off) is announced at commit: the workers' look for jobs coming due
    // passes over those due before it could see them.
    if state.as_deref() == Some("waiting") {
        let due = as_owner(|| {
            Spi::get_two_with_args::<String, TimestampWithTimeZone>(
                "SELECT queue, run_at FROM outbox.jobs WHERE id = $1 AND handler IS NULL",
                &[DatumWithOid::from(job)],
            )
        });
        if let Ok((Some(queue), Some(run_at))) = due {
            crate::worker::announce_at_commit(&queue, Some(i64::from(run_at)));
        }
    }
    state
}

/// Extends the lease of a running job; false when it is not running.
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn extend(job: Option<i64>, lease: default!(Option<Interval>, "'30 seconds'")) -> Option<bool> {
    execute_one::<bool>(
        &EXTEND,
        vec![DatumWithOid::from(job), DatumWithOid::from(lease)],
    )
}

/// Puts a dead job back in its queue, with its attempts reset. Logged.
#[pg_extern(volatile, parallel_unsafe, requires = ["jobs"])]
fn replay_job(job: Option<i64>) {
    // The caller, read before acting as the log's owner.
    let who = caller();
    let queue = as_owner(|| {
        Spi::get_one_with_args::<String>(
            "SELECT outbox._replay_job($1, $2)",
            &[DatumWithOid::from(job), DatumWithOid::from(who)],
        )
    })
    .unwrap_or_else(|e| panic!("replaying job: {e}"));
    if let Some(queue) = queue {
        crate::worker::announce_at_commit(&queue, None);
    }
}
