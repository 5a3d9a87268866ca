//! Schedules: `schedule` and `unschedule` check the caller, then call the SQL in
//! `sql/schedules.sql` as the log's owner. The workers fire due schedules (`fire_due`), and run
//! the query of each schedule as its owner, as they run handlers (`dispatch::as_handler_owner`).

use crate::error::{Error, OrReport};
use crate::owner::{acts_for, as_owner, caller};
use crate::raw::{RawTime, RawTimestamp};
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
/// `every` fixed interval, `daily_at` a local time in `zone` (only on `weekly_on`, a day name,
/// if given), or once `at` a local date and time in `zone`. With `each` (a query, or the name of
/// a function returning rows), a run queues one job per row instead. Returns the first run.
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
    at: default!(Option<RawTimestamp>, "NULL"),
    each: default!(Option<&str>, "NULL"),
) -> TimestampWithTimeZone {
    let form = Form::checked(
        name, every, daily_at, zone, weekly_on, topic, queue, payload, at, each,
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
    at: default!(Option<RawTimestamp>, "NULL"),
    each: default!(Option<&str>, "NULL"),
) -> TimestampWithTimeZone {
    let form = Form::checked(
        name, every, daily_at, zone, weekly_on, topic, queue, payload, at, each,
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
    at: Option<RawTimestamp>,
    /// The each query as it runs (a function name made `SELECT * FROM` it).
    each: Option<String>,
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
        at: Option<RawTimestamp>,
        each: Option<&str>,
    ) -> Form<'a> {
        if !crate::worker::preloaded() {
            Error::NotPreloaded.report();
        }
        let name = required(name, "name").or_report();
        names::validate("schedule", name).or_report();
        if let Some(t) = topic {
            topic::validate(t).or_report();
        }
        let each = each.map(each_query);
        let form = Form {
            name,
            every,
            daily_at,
            zone,
            weekly_on,
            topic,
            queue,
            payload,
            at,
            each,
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
            "SELECT outbox._schedule($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
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
                self.at.map_or_else(
                    DatumWithOid::null::<pgrx::datum::Timestamp>,
                    RawTimestamp::datum,
                ),
                DatumWithOid::from(self.each.as_deref()),
            ],
        )
        .unwrap_or_else(|e| panic!("scheduling: {e}"))
        .expect("_schedule returns the first run")
    }
}

/// The most rows one run of an each query may return, and the most bytes (its rows as jsonb
/// text, together): they are held in the worker's memory until its jobs are written. A run past
/// either fails (nothing is queued); a row past `pg_outbox.max_event_size` too.
const EACH_MAX_ROWS: usize = 100_000;
const EACH_MAX_BYTES: usize = 64 * 1024 * 1024;

/// The longest each text.
const EACH_MAX_TEXT: usize = 64 * 1024;

/// Each schedules a worker fires per round at most, and the time after which it fires no more
/// in that round (the others wait for the next round, soon).
pub const EACH_PER_ROUND: usize = 16;
pub const EACH_ROUND_TIME: std::time::Duration = std::time::Duration::from_secs(1);

/// An each query as it will run, checked with the caller's rights: one query, or the name of a
/// function called with no arguments (`SELECT * FROM` it). It is planned and started (nothing is
/// fetched) with the settings it runs with: search_path `"$user", public` as for handlers, and
/// standard_conforming_strings on, as in the workers (a string literal must end where it will end
/// there). A name that does not resolve, a missing column or a table the caller may not read is
/// an error now, not at its first run. (The query is always wrapped as `(<query>\n) r`: the
/// newline ends a `--` comment that the query may end with.)
fn each_query(each: &str) -> String {
    if each.len() > EACH_MAX_TEXT {
        Error::BadEach(format!("it is longer than {EACH_MAX_TEXT} bytes")).report();
    }
    let _settings = crate::isolation::NestLevel::for_handler();
    crate::isolation::set_in_level(c"standard_conforming_strings", c"on");
    let query = match function_name(each) {
        Some(name) => function_query(name),
        None => one_query(each),
    };
    Spi::run(&format!("SELECT * FROM ({query}\n) r LIMIT 0"))
        .unwrap_or_else(|e| pgrx::error!("checking each: {e}"));
    query
}

/// `each` as a function's name (`reports.due_digests` or `reports.due_digests()`), if it looks
/// like one: a query always has a space or a parenthesis with something in it.
fn function_name(each: &str) -> Option<&str> {
    let name = each.trim();
    let name = name.strip_suffix("()").unwrap_or(name).trim_end();
    (!name.is_empty()
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '.' | '"' | '$')))
    .then_some(name)
}

/// `SELECT * FROM` the function `name` (resolved by the caller's search_path), schema-qualified.
fn function_query(name: &str) -> String {
    let found = Spi::get_one_with_args::<String>(
        "SELECT pg_catalog.format('SELECT * FROM %I.%I()', n.nspname, p.proname) \
           FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace \
          WHERE p.oid = pg_catalog.to_regproc($1) AND p.pronargs = p.pronargdefaults AND p.prokind = 'f'",
        &[DatumWithOid::from(name)],
    )
    .or_else(|e| match e {
        pgrx::spi::Error::InvalidPosition => Ok(None),
        e => Err(e),
    })
    .unwrap_or_else(|e| panic!("resolving each: {e}"));
    found.unwrap_or_else(|| Error::UnknownEachFunction(name.into()).report())
}

/// The text of `each`'s one statement, which must be a query (SELECT, VALUES, WITH ... SELECT):
/// not several statements, not a command. A syntax error is reported as the parser reports it.
fn one_query(each: &str) -> String {
    let text = std::ffi::CString::new(each)
        .unwrap_or_else(|_| Error::BadEach("it contains a NUL character".into()).report());
    // SAFETY: parses a NUL-terminated string in the current memory context; the list and its
    // nodes are read before anything else runs.
    let (count, select, location, len) = unsafe {
        let list = pgrx::PgList::<pg_sys::RawStmt>::from_pg(pg_sys::raw_parser(
            text.as_ptr(),
            pg_sys::RawParseMode::RAW_PARSE_DEFAULT,
        ));
        match list.get_ptr(0) {
            Some(raw) => (
                list.len(),
                (*(*raw).stmt).type_ == pg_sys::NodeTag::T_SelectStmt
                    && (*(*raw).stmt.cast::<pg_sys::SelectStmt>())
                        .intoClause
                        .is_null(),
                (*raw).stmt_location.max(0) as usize,
                (*raw).stmt_len.max(0) as usize,
            ),
            None => (0, false, 0, 0),
        }
    };
    match count {
        0 => Error::BadEach("it is empty".into()).report(),
        1 if select => {}
        1 => Error::BadEach("it is a command, not a query".into()).report(),
        n => Error::BadEach(format!("it has {n} statements")).report(),
    }
    // The statement without what surrounds it (a trailing ';', comments): it goes inside
    // parentheses. stmt_len 0 means the rest of the string.
    let end = if len == 0 { each.len() } else { location + len };
    each.get(location..end).unwrap_or(each).trim().to_string()
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

/// One row per schedule, for operators: its form, target, next and last runs, how many fired,
/// its owner and why its last run wrote nothing. A schedule's query and errors are shown only to
/// roles that act for its owner and to members of pg_read_all_stats.
#[pg_extern(stable, parallel_unsafe, requires = ["schedules"])]
#[allow(clippy::type_complexity)]
fn schedule_status() -> TableIterator<
    'static,
    (
        name!(name, Option<String>),
        name!(form, Option<String>),
        name!(target, Option<String>),
        name!(next_run, Option<TimestampWithTimeZone>),
        name!(last_run, Option<TimestampWithTimeZone>),
        name!(fired, Option<i64>),
        name!(owner, Option<String>),
        name!(last_error, Option<String>),
    ),
> {
    let who = caller();
    let rows = as_owner(|| {
        Spi::connect(|client| {
            client
                .select(
                    "SELECT name, form, target, next_run, last_run, fired, owner::text, last_error \
                       FROM outbox._schedule_status($1)",
                    None,
                    &[DatumWithOid::from(who)],
                )?
                .map(|r| {
                    Ok((
                        r.get(1)?,
                        r.get(2)?,
                        r.get(3)?,
                        r.get(4)?,
                        r.get(5)?,
                        r.get(6)?,
                        r.get(7)?,
                        r.get(8)?,
                    ))
                })
                .collect::<Result<Vec<_>, pgrx::spi::Error>>()
        })
    })
    .unwrap_or_else(|e| panic!("schedule status: {e}"));
    TableIterator::new(rows)
}

/// Milliseconds until the earliest run: 0 when one is due, None when there is no schedule. Read
/// from the clock, not now(), so a worker sleeping this long wakes when the run is due; the next
/// `fire_due` then has to be in a new transaction (its now() is that transaction's start). The
/// worker asks every round: a kept plan, not a SQL function (one with a SET clause is parsed and
/// planned again at every call, a tenth of a delivering worker's time).
pub fn due_in() -> Option<i64> {
    crate::query::one::<i64>(
        "SELECT greatest(0, pg_catalog.ceil(extract(epoch FROM s.next_run OPERATOR(pg_catalog.-) \
                pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.*) 1000))::pg_catalog.int8 \
           FROM outbox.schedules s ORDER BY s.next_run LIMIT 1",
        &[],
    )
}

/// `outbox._schedule_due_in()`: `due_in`, for the tests. Not for PUBLIC.
#[pg_extern(volatile, parallel_unsafe, name = "_schedule_due_in")]
fn schedule_due_in() -> Option<i64> {
    due_in()
}

/// Fires every due schedule but each schedules, in one statement (see `outbox._fire_schedules`).
/// Returns the runs fired. In the worker, in a transaction of its own: a run and what it wrote
/// commit together.
pub fn fire_due() -> i32 {
    Spi::get_one::<i32>("SELECT outbox._fire_schedules()")
        .expect("firing schedules")
        .unwrap_or(0)
}

/// What `fire_one_each` did.
pub enum EachRun {
    /// No each schedule was due (outside those skipped) that no other worker was firing.
    None,
    /// One ran, and its run was recorded (or it had changed meanwhile, and nothing was).
    Ran,
    /// One ran, but another transaction held its row (a tenant changing or dropping it, which
    /// may stay open as long as it likes): nothing was recorded, and it is still due.
    Held(String),
}

/// Fires one due each schedule that no other worker is firing. In the
/// worker, in a transaction of its own, which holds no row lock and no transaction id while the
/// tenant's query runs (a transaction id would hold every reader's horizon back): the schedule's
/// lease (`lease::Class::Schedule`) keeps other workers off it, and `outbox._ran_each` then
/// checks that the schedule is still the one that ran, queues a job per row and moves it on. The
/// query runs as the schedule's owner, as handlers run (a subtransaction, the handler timeout); a
/// run whose owner may no longer enqueue, or whose query fails, queues nothing and says why
/// (last_error, a WARNING), and the schedule backs off. Those named in `skip` are passed over (the
/// worker's round tried them already, or their rows were held).
pub fn fire_one_each(skip: &[String]) -> EachRun {
    Spi::connect_mut(|client| {
        let due = client
            .select(
                "SELECT s.name, s.each, s.owner::pg_catalog.oid, s.next_run, pg_catalog.hashtext(s.name), \
                        CASE WHEN NOT outbox._schedule_allowed(s.owner, s.topic, s.queue) \
                             THEN outbox._schedule_denied(s.owner, s.topic, s.queue) END \
                   FROM outbox.schedules s \
                  WHERE s.each IS NOT NULL AND s.next_run <= pg_catalog.now() \
                    AND s.name OPERATOR(pg_catalog.<>) ALL ($2) \
                  ORDER BY s.next_run LIMIT $1",
                None,
                &[
                    DatumWithOid::from(EACH_PER_ROUND as i64),
                    DatumWithOid::from(skip.to_vec()),
                ],
            )
            .expect("finding due each schedules");
        let mut chosen = None;
        for row in due {
            let key: i32 = row.get(5).unwrap().expect("hashtext");
            if crate::lease::try_xact(crate::lease::Class::Schedule, key) {
                chosen = Some((
                    row.get::<String>(1).unwrap().expect("name"),
                    row.get::<String>(2).unwrap().expect("each"),
                    row.get::<pg_sys::Oid>(3).unwrap().expect("owner"),
                    row.get::<TimestampWithTimeZone>(4)
                        .unwrap()
                        .expect("next_run"),
                    row.get::<String>(6).unwrap(),
                ));
                break;
            }
        }
        let Some((name, query, owner, run, denied)) = chosen else {
            return EachRun::None;
        };
        let (rows, error) = match denied {
            Some(denied) => (None, Some(denied)),
            None => match run_each(client, &name, &query, owner) {
                Ok(rows) => (Some(rows), None),
                Err(failure) => (None, Some(failure.message)),
            },
        };
        // Writing the jobs can fail too (rows PostgreSQL cannot put in one array): then the run
        // is recorded as failed, not left due for ever.
        let record = |rows: Option<Vec<String>>, error: Option<String>| {
            crate::transaction::in_subtransaction(|| {
                Spi::get_one_with_args::<i32>(
                    "SELECT outbox._ran_each($1, $2, $3, $4, $5)",
                    &[
                        DatumWithOid::from(name.as_str()),
                        DatumWithOid::from(run),
                        DatumWithOid::from(query.as_str()),
                        DatumWithOid::from(rows),
                        DatumWithOid::from(error),
                    ],
                )
                .unwrap_or_else(|e| pgrx::error!("{e}"))
            })
        };
        let recorded = match record(rows, error) {
            Ok(recorded) => recorded,
            Err(failure) => record(
                None,
                Some(format!("queueing its jobs failed: {}", failure.message)),
            )
            .unwrap_or_else(|f| pgrx::error!("recording a failed run of \"{name}\": {f}")),
        };
        if recorded == Some(-1) {
            EachRun::Held(name)
        } else {
            EachRun::Ran
        }
    })
}

/// The rows of an each query, as jsonb texts: a query of one jsonb column gives its values,
/// any other the row as an object (`to_jsonb`). Runs as `owner`, as a handler runs; read through
/// a cursor, a few rows at a time, so that the limits hold before the memory is spent. Every
/// refusal is an ERROR (caught by the subtransaction, recorded as the run's failure).
fn run_each(
    client: &mut pgrx::spi::SpiClient<'_>,
    name: &str,
    query: &str,
    owner: pg_sys::Oid,
) -> Result<Vec<String>, crate::transaction::Failure> {
    let target = crate::worker::Target::Schedule { name };
    let max_row = crate::settings::MAX_EVENT_SIZE.get().max(1) as i64;
    crate::dispatch::as_handler_owner(owner, target, || {
        let fail = |e: pgrx::spi::Error| -> ! { pgrx::error!("{e}") };
        // Checked again under the workers' own settings: it is still one query here.
        let query = one_query(query);
        let shape = client
            .select(&format!("SELECT * FROM ({query}\n) r LIMIT 0"), None, &[])
            .unwrap_or_else(|e| fail(e));
        let whole = !(shape.columns().unwrap_or_else(|e| fail(e)) == 1
            && shape.column_type_oid(1).unwrap_or_else(|e| fail(e)).value() == pg_sys::JSONBOID);
        let row = if whole {
            "pg_catalog.to_jsonb(r)::pg_catalog.text FROM (SELECT * FROM"
        } else {
            "r.x::pg_catalog.text FROM (SELECT * FROM"
        };
        let alias = if whole { "r" } else { "r(x)" };
        // A row past the limit comes back as NULL with its length: never the row itself.
        let sql = format!(
            "SELECT CASE WHEN pg_catalog.octet_length(j) <= $1 THEN j END, pg_catalog.octet_length(j) \
               FROM (SELECT {row} ({query}\n) q) {alias}) s(j)"
        );
        let mut cursor = client.open_cursor(&sql, &[DatumWithOid::from(max_row)]);
        let (mut rows, mut bytes) = (Vec::new(), 0usize);
        loop {
            let batch = cursor.fetch(50).unwrap_or_else(|e| fail(e));
            if batch.is_empty() {
                break;
            }
            for r in batch {
                let length = r.get::<i32>(2).unwrap_or_else(|e| fail(e));
                let Some(text) = r.get::<String>(1).unwrap_or_else(|e| fail(e)) else {
                    match length {
                        None => pgrx::error!("each returned a NULL row"),
                        Some(n) => pgrx::error!(
                            "each returned a row of {n} bytes; pg_outbox.max_event_size is {max_row}"
                        ),
                    }
                };
                bytes += text.len();
                if rows.len() >= EACH_MAX_ROWS {
                    pgrx::error!("each returned more than {EACH_MAX_ROWS} rows");
                }
                if bytes > EACH_MAX_BYTES {
                    pgrx::error!("each returned more than {EACH_MAX_BYTES} bytes");
                }
                rows.push(text);
            }
        }
        rows
    })
}

/// The each schedule `name` ran a query that would not stop and ended its worker (see
/// `worker::InHandler`): the run is recorded as failed, so the schedule backs off instead of
/// ending every worker that fires it.
pub fn after_hang(name: &str) {
    let recorded = crate::transaction::in_transaction(|| {
        Spi::connect_mut(|client| {
            let due = client.select(
                "SELECT s.next_run, s.each FROM outbox.schedules s \
                  WHERE s.name = $1 AND s.each IS NOT NULL AND s.next_run <= pg_catalog.now()",
                None,
                &[DatumWithOid::from(name)],
            )?;
            if let Some(row) = due.into_iter().next() {
                let run: TimestampWithTimeZone = row.get(1)?.expect("next_run");
                let each: String = row.get(2)?.expect("each");
                client.update(
                    "SELECT outbox._ran_each($1, $2, $3, NULL, $4)",
                    None,
                    &[
                        DatumWithOid::from(name),
                        DatumWithOid::from(run),
                        DatumWithOid::from(each.as_str()),
                        DatumWithOid::from(crate::dispatch::hang_failure().message),
                    ],
                )?;
            }
            Ok::<_, pgrx::spi::Error>(())
        })
    });
    match recorded {
        Ok(Ok(())) => {}
        Ok(Err(e)) => pgrx::warning!("pg_outbox: schedule \"{name}\": {e}"),
        Err(e) => pgrx::warning!("pg_outbox: schedule \"{name}\": {e}"),
    }
}

/// Places the one-off runs again by the zone rules of this process (a worker that starts).
pub fn place_one_offs() {
    Spi::run("SELECT outbox._place_one_offs()").expect("placing one-off runs");
}
