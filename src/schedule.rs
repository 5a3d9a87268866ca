//! Schedules: `schedule` and `unschedule` check the caller, then call the SQL in
//! `sql/schedules.sql` as the log's owner. The workers fire due schedules (`fire_due`).

use crate::error::{Error, OrReport};
use crate::owner::{acts_for, as_owner, caller};
use crate::raw::RawTime;
use pg_outbox_core::{name as names, required, topic};
use pgrx::datum::{DatumWithOid, Interval, TimestampWithTimeZone};
use pgrx::prelude::*;

/// True when `role` may execute `function` (a regprocedure text).
fn may_execute(role: pg_sys::Oid, function: &str) -> bool {
    crate::query::one::<bool>(
        "SELECT pg_catalog.has_function_privilege($1, $2::pg_catalog.regprocedure, 'EXECUTE')",
        &[DatumWithOid::from(role), DatumWithOid::from(function)],
    )
    .unwrap_or(false)
}

/// Schedules runs that raise an event on `topic` or queue a job on `queue`, with `payload`:
/// `every` fixed interval, or `daily_at` a local time in `zone` (only on `weekly_on`, a day name,
/// if given). Returns the first run.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::too_many_arguments)]
fn schedule(
    name: Option<&str>,
    every: default!(Option<Interval>, "NULL"),
    daily_at: default!(Option<RawTime>, "NULL"),
    zone: default!(Option<&str>, "NULL"),
    weekly_on: default!(Option<&str>, "NULL"),
    topic: default!(Option<&str>, "NULL"),
    queue: default!(Option<&str>, "NULL"),
    payload: default!(Option<pgrx::JsonB>, "'{}'"),
) -> TimestampWithTimeZone {
    let form = Form::checked(
        name, every, daily_at, zone, weekly_on, topic, queue, payload,
    );
    let me = caller();
    let first = as_owner(|| form.create(me));
    crate::worker::wake_at_commit_always();
    first
}

/// `schedule`, or the schedule of that name replaced in place (the same transaction drops the
/// old one and creates the new one): for a user setting such as "my digest at 09:00 in my zone".
/// Only members of the role that created it may replace it; it keeps that owner.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::too_many_arguments)]
fn set_schedule(
    name: Option<&str>,
    every: default!(Option<Interval>, "NULL"),
    daily_at: default!(Option<RawTime>, "NULL"),
    zone: default!(Option<&str>, "NULL"),
    weekly_on: default!(Option<&str>, "NULL"),
    topic: default!(Option<&str>, "NULL"),
    queue: default!(Option<&str>, "NULL"),
    payload: default!(Option<pgrx::JsonB>, "'{}'"),
) -> TimestampWithTimeZone {
    let form = Form::checked(
        name, every, daily_at, zone, weekly_on, topic, queue, payload,
    );
    let me = caller();
    let owner = locked_owner(form.name).unwrap_or(me);
    if !acts_for(me, owner) {
        Error::NotScheduleOwner(form.name.into()).report();
    }
    // Its runs write as the owner's: the owner needs the rights too (a member may have more).
    form.check_rights(owner);
    let first = as_owner(|| {
        Spi::run_with_args(
            "SELECT outbox._unschedule($1)",
            &[DatumWithOid::from(form.name)],
        )
        .unwrap_or_else(|e| panic!("replacing schedule: {e}"));
        form.create(owner)
    });
    crate::worker::wake_at_commit_always();
    first
}

/// The arguments of `schedule` and `set_schedule`, checked (with the caller's rights).
struct Form<'a> {
    name: &'a str,
    every: Option<Interval>,
    daily_at: Option<RawTime>,
    zone: Option<&'a str>,
    weekly_on: Option<&'a str>,
    topic: Option<&'a str>,
    queue: Option<&'a str>,
    payload: Option<pgrx::JsonB>,
}

impl<'a> Form<'a> {
    #[allow(clippy::too_many_arguments)]
    fn checked(
        name: Option<&'a str>,
        every: Option<Interval>,
        daily_at: Option<RawTime>,
        zone: Option<&'a str>,
        weekly_on: Option<&'a str>,
        topic: Option<&'a str>,
        queue: Option<&'a str>,
        payload: Option<pgrx::JsonB>,
    ) -> Form<'a> {
        if !crate::worker::preloaded() {
            Error::NotPreloaded.report();
        }
        let name = required(name, "name").or_report();
        names::validate("schedule", name).or_report();
        if let Some(t) = topic {
            topic::validate(t).or_report();
        }
        let form = Form {
            name,
            every,
            daily_at,
            zone,
            weekly_on,
            topic,
            queue,
            payload,
        };
        form.check_rights(caller());
        form
    }

    /// A run writes as the log's owner: scheduling must not let a role raise or enqueue what it
    /// could not itself.
    fn check_rights(&self, role: pg_sys::Oid) {
        if self.topic.is_some()
            && !may_execute(role, "outbox.raise(text, jsonb, text, text, jsonb)")
        {
            Error::ScheduleDenied("outbox.raise").report();
        }
        if self.queue.is_some()
            && !may_execute(
                role,
                "outbox.enqueue(text, jsonb, timestamptz, text, integer)",
            )
        {
            Error::ScheduleDenied("outbox.enqueue").report();
        }
    }

    /// Creates the schedule for `owner` (as the log's owner); returns its first run.
    fn create(self, owner: pg_sys::Oid) -> TimestampWithTimeZone {
        Spi::get_one_with_args::<TimestampWithTimeZone>(
            "SELECT outbox._schedule($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            &[
                DatumWithOid::from(self.name),
                DatumWithOid::from(self.every),
                self.daily_at
                    .map_or_else(DatumWithOid::null::<pgrx::datum::Time>, RawTime::datum),
                DatumWithOid::from(self.zone),
                DatumWithOid::from(self.weekly_on),
                DatumWithOid::from(self.topic),
                DatumWithOid::from(self.queue),
                DatumWithOid::from(self.payload),
                DatumWithOid::from(owner),
            ],
        )
        .unwrap_or_else(|e| panic!("scheduling: {e}"))
        .expect("_schedule returns the first run")
    }
}

/// The owner of schedule `name`, its row locked until the transaction ends (None: no such
/// schedule).
fn locked_owner(name: &str) -> Option<pg_sys::Oid> {
    as_owner(|| {
        Spi::get_one_with_args::<pg_sys::Oid>(
            "SELECT owner FROM outbox.schedules WHERE name = $1 FOR UPDATE",
            &[DatumWithOid::from(name)],
        )
    })
    .or_else(|e| match e {
        // No row: no such schedule.
        pgrx::spi::Error::InvalidPosition => Ok(None),
        e => Err(e),
    })
    .unwrap_or_else(|e| panic!("reading schedule: {e}"))
}

/// Drops a schedule; false when there was none. Only members of the role that created it (or a
/// superuser) may.
#[pg_extern(volatile, parallel_unsafe)]
fn unschedule(name: Option<&str>) -> bool {
    let name = required(name, "name").or_report();
    let Some(owner) = locked_owner(name) else {
        return false;
    };
    if !acts_for(caller(), owner) {
        Error::NotScheduleOwner(name.into()).report();
    }
    as_owner(|| {
        Spi::get_one_with_args::<bool>("SELECT outbox._unschedule($1)", &[DatumWithOid::from(name)])
    })
    .unwrap_or_else(|e| panic!("unscheduling: {e}"))
    .unwrap_or(false)
}

/// Milliseconds until the earliest run (0: one is due), None without schedules. In the worker.
pub fn due_in() -> Option<i64> {
    crate::query::one::<i64>("SELECT outbox._schedule_due_in()", &[])
}

/// Fires every due schedule (one statement: see `outbox._fire_schedules`). In the worker, in a
/// transaction of its own.
pub fn fire_due() -> i32 {
    Spi::get_one::<i32>("SELECT outbox._fire_schedules()")
        .expect("firing schedules")
        .unwrap_or(0)
}
