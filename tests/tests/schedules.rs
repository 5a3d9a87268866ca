//! Schedules: refusals, the next run across clock changes (spring forward runs where the gap
//! ends, fall back runs once), missed runs firing once, two sessions firing at once, and the
//! workers firing each run exactly once.
//!
//! Instants are compared as UTC text ('YYYY-MM-DD HH24:MI:SS'), rendered with AT TIME ZONE 'UTC'
//! so that the session's TimeZone, which must not matter, cannot change the expectation either.

use pg_outbox_tests::postgres::Client;
use pg_outbox_tests::{eventually, sqlstate, test_db, worker_db};
use std::time::{Duration, Instant};

/// An SQL timestamptz expression as UTC text.
fn utc(c: &mut Client, expr: &str) -> String {
    let sql = format!("SELECT to_char(({expr}) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')");
    c.query_one(&sql, &[])
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

fn fired(c: &mut Client, name: &str) -> i64 {
    c.query_one(
        "SELECT coalesce((SELECT fired FROM outbox.schedules WHERE name = $1), -1)",
        &[&name],
    )
    .unwrap()
    .get(0)
}

#[test]
fn schedule_refuses_bad_input_with_sqlstates() {
    let db = test_db("sched_refusals");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.schedule('dup', every => '1 hour', queue => 'q')")
        .unwrap();
    for (sql, code) in [
        // Names.
        ("SELECT outbox.schedule(NULL, every => '1 minute', queue => 'q')", "22004"),
        ("SELECT outbox.schedule('', every => '1 minute', queue => 'q')", "42602"),
        ("SELECT outbox.schedule('bad name', every => '1 minute', queue => 'q')", "42602"),
        ("SELECT outbox.schedule('x''; drop table outbox.schedules; --', every => '1 minute', queue => 'q')", "42602"),
        ("SELECT outbox.schedule('dup', every => '1 minute', queue => 'q')", "42710"),
        // Neither or both forms.
        ("SELECT outbox.schedule('s', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 minute', daily_at => '02:30', zone => 'UTC', queue => 'q')", "22023"),
        // every: positive, at least a second, a fixed length, and with nothing of the other form.
        ("SELECT outbox.schedule('s', every => '0 seconds', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '-1 minute', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '500 milliseconds', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 month', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 year', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 mon -30 days', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '3651 days', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 hour', zone => 'UTC', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 hour', weekly_on => 'monday', queue => 'q')", "22023"),
        // daily_at, zone and weekly_on.
        ("SELECT outbox.schedule('s', daily_at => '02:30', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', zone => 'UTC', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', weekly_on => 'monday', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '24:00', zone => 'UTC', queue => 'q')", "22023"),
        // Not a time at all: the time type's own error.
        ("SELECT outbox.schedule('s', daily_at => '25:00', zone => 'UTC', queue => 'q')", "22008"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => 'Mars/Olympus_Mons', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => 'PST', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => 'CEST', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => '+02', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => 'UTC+3', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => '', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => 'UTC', weekly_on => 'mondays', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => 'UTC', weekly_on => 'mo', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => 'UTC', weekly_on => '1', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', daily_at => '02:30', zone => 'UTC', weekly_on => '', queue => 'q')", "22023"),
        // What a run writes.
        ("SELECT outbox.schedule('s', every => '1 minute')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 minute', topic => 'a.b', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 minute', queue => 'bad queue')", "42602"),
        ("SELECT outbox.schedule('s', every => '1 minute', topic => 'order placed')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 minute', queue => 'q', payload => '[1]')", "22023"),
        ("SELECT outbox.schedule('s', every => '1 minute', queue => 'q', payload => '\"x\"')", "22023"),
        ("SELECT outbox.unschedule(NULL)", "22004"),
    ] {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
    let names: Vec<String> = c
        .query("SELECT name FROM outbox.schedules", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(names, ["dup"], "nothing refused was stored");

    // What is accepted: every's first run is one interval away; a zone is stored in its own
    // spelling, a day as its number; the session's TimeZone changes nothing.
    let first_in: f64 = c
        .query_one(
            "SELECT extract(epoch FROM outbox.schedule('tick', every => '90 seconds', queue => 'q') - now())::float8",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(first_in, 90.0);
    c.batch_execute(
        "SET TimeZone = 'UTC';
         SELECT outbox.schedule('weekly', daily_at => '09:15', zone => 'europe/berlin', weekly_on => 'SAT',
                                topic => 'report.weekly', payload => '{\"k\": 1}');
         SET TimeZone = 'Pacific/Auckland';
         SELECT outbox.schedule('weekly2', daily_at => '09:15', zone => 'Europe/Berlin', weekly_on => 'saturday',
                                topic => 'report.weekly');",
    )
    .unwrap();
    let row = c
        .query_one(
            "SELECT zone, weekly_on::int4, extract(dow FROM next_run AT TIME ZONE zone)::int4,
                    to_char(next_run AT TIME ZONE zone, 'HH24:MI'), payload::text, next_run > now(),
                    next_run <= now() + interval '7 days'
               FROM outbox.schedules WHERE name = 'weekly'",
            &[],
        )
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, i32>(1),
            row.get::<_, i32>(2),
            row.get::<_, String>(3),
            row.get::<_, String>(4),
            row.get::<_, bool>(5),
            row.get::<_, bool>(6),
        ),
        (
            "Europe/Berlin".to_string(),
            6,
            6,
            "09:15".to_string(),
            "{\"k\": 1}".to_string(),
            true,
            true
        )
    );
    let same: bool = c
        .query_one(
            "SELECT count(DISTINCT next_run) = 1 FROM outbox.schedules WHERE name IN ('weekly', 'weekly2')",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(
        same,
        "the session's TimeZone does not move a wall-clock run"
    );

    let dropped: bool = c
        .query_one("SELECT outbox.unschedule('tick')", &[])
        .unwrap()
        .get(0);
    assert!(dropped);
    let again: bool = c
        .query_one("SELECT outbox.unschedule('tick')", &[])
        .unwrap()
        .get(0);
    assert!(!again, "an unknown schedule is not an error, but false");
}

#[test]
fn the_next_run_follows_the_zones_clocks_whatever_the_session_time_zone() {
    let db = test_db("sched_next_run");
    let mut c = db.connect();
    // (what, _next_run arguments, the run in UTC)
    let cases = [
        // America/New_York springs forward on 2026-03-08: 02:00 EST becomes 03:00 EDT (07:00 UTC).
        (
            "02:30 on the spring-forward day runs where the gap ends, 03:00 EDT",
            "NULL, '02:30', 'America/New_York', NULL, '2026-03-07 12:00Z', NULL",
            "2026-03-08 07:00:00",
        ),
        (
            "any time in the gap runs at its end",
            "NULL, '02:59:59', 'America/New_York', NULL, '2026-03-07 12:00Z', NULL",
            "2026-03-08 07:00:00",
        ),
        (
            "03:00 exists and is the same instant",
            "NULL, '03:00', 'America/New_York', NULL, '2026-03-07 12:00Z', NULL",
            "2026-03-08 07:00:00",
        ),
        (
            "then 02:30 EDT the next day",
            "NULL, '02:30', 'America/New_York', NULL, '2026-03-08 07:00Z', '2026-03-08 07:00Z'",
            "2026-03-09 06:30:00",
        ),
        // It falls back on 2026-11-01: 01:00-02:00 happens twice, EDT (05:00-06:00 UTC) then EST
        // (06:00-07:00 UTC). The run is the first 01:30, once.
        (
            "01:30 on the fall-back day runs at the first 01:30, EDT",
            "NULL, '01:30', 'America/New_York', NULL, '2026-10-31 12:00Z', NULL",
            "2026-11-01 05:30:00",
        ),
        (
            "after the first 01:30 (EDT) has passed, the second one does not run: the next day",
            "NULL, '01:30', 'America/New_York', NULL, '2026-11-01 05:45Z', NULL",
            "2026-11-02 06:30:00",
        ),
        (
            "weekly on Sunday 01:30 from a Wednesday: the first 01:30 of the fall-back Sunday",
            "NULL, '01:30', 'America/New_York', 0::smallint, '2026-10-28 12:00Z', NULL",
            "2026-11-01 05:30:00",
        ),
        (
            "fired at 01:30 EST, the next is the next day",
            "NULL, '01:30', 'America/New_York', NULL, '2026-11-01 06:30Z', '2026-11-01 06:30Z'",
            "2026-11-02 06:30:00",
        ),
        (
            "a run already fired that date (at 01:30 EDT) is not run again at 01:30 EST",
            "NULL, '01:30', 'America/New_York', NULL, '2026-11-01 05:30Z', '2026-11-01 05:30Z'",
            "2026-11-02 06:30:00",
        ),
        // Europe/Berlin: 2026-03-29 02:00 CET -> 03:00 CEST; 2026-10-25 03:00 CEST -> 02:00 CET.
        (
            "Berlin 02:30 on its spring-forward day: 03:00 CEST",
            "NULL, '02:30', 'Europe/Berlin', NULL, '2026-03-28 12:00Z', NULL",
            "2026-03-29 01:00:00",
        ),
        (
            "Berlin 02:30 on its fall-back day: 02:30 CEST, the first",
            "NULL, '02:30', 'Europe/Berlin', NULL, '2026-10-24 12:00Z', NULL",
            "2026-10-25 00:30:00",
        ),
        (
            "Berlin, fired at the first 02:30: the next is the next day's 02:30 CET",
            "NULL, '02:30', 'Europe/Berlin', NULL, '2026-10-25 00:30Z', '2026-10-25 00:30Z'",
            "2026-10-26 01:30:00",
        ),
        (
            "Berlin weekly on Sunday 02:30: the first 02:30 of the fall-back Sunday",
            "NULL, '02:30', 'Europe/Berlin', 0::smallint, '2026-10-21 12:00Z', NULL",
            "2026-10-25 00:30:00",
        ),
        // Australia/Sydney (southern hemisphere): 2026-04-05 03:00 AEDT -> 02:00 AEST (fall back,
        // in April); 2026-10-04 02:00 AEST -> 03:00 AEDT (spring forward, in October).
        (
            "Sydney 02:30 on its fall-back day: 02:30 AEDT, the first",
            "NULL, '02:30', 'Australia/Sydney', NULL, '2026-04-04 00:00Z', NULL",
            "2026-04-04 15:30:00",
        ),
        (
            "Sydney, fired at the first 02:30: the next is the next day's 02:30 AEST",
            "NULL, '02:30', 'Australia/Sydney', NULL, '2026-04-04 15:30Z', '2026-04-04 15:30Z'",
            "2026-04-05 16:30:00",
        ),
        (
            "Sydney weekly on Sunday 02:30 from a Wednesday: the first 02:30 of the fall-back Sunday",
            "NULL, '02:30', 'Australia/Sydney', 0::smallint, '2026-04-01 00:00Z', NULL",
            "2026-04-04 15:30:00",
        ),
        (
            "Sydney 02:30 on its spring-forward day: 03:00 AEDT",
            "NULL, '02:30', 'Australia/Sydney', NULL, '2026-10-03 00:00Z', NULL",
            "2026-10-03 16:00:00",
        ),
        // Lord Howe Island moves by 30 minutes: 2026-10-04 02:00 (+10:30) -> 02:30 (+11).
        (
            "a 30-minute gap ends at 02:30 +11",
            "NULL, '02:15', 'Australia/Lord_Howe', NULL, '2026-10-03 00:00Z', NULL",
            "2026-10-03 15:30:00",
        ),
        // weekly_on (0 = Sunday): the spring-forward Sunday, and a Monday already past.
        (
            "weekly on Sunday 02:30 from a Wednesday: the gap's end that Sunday",
            "NULL, '02:30', 'America/New_York', 0::smallint, '2026-03-04 12:00Z', NULL",
            "2026-03-08 07:00:00",
        ),
        (
            "weekly on Monday 09:00, asked at Monday 08:00 EDT: that day",
            "NULL, '09:00', 'America/New_York', 1::smallint, '2026-03-09 12:00Z', NULL",
            "2026-03-09 13:00:00",
        ),
        (
            "weekly on Monday 09:00, asked at Monday 10:00 EDT: a week later",
            "NULL, '09:00', 'America/New_York', 1::smallint, '2026-03-09 14:00Z', NULL",
            "2026-03-16 13:00:00",
        ),
        // Missed runs fire once: the next is the next regular time after now.
        (
            "daily, last fired three days ago, now noon: tomorrow 02:30",
            "NULL, '02:30', 'America/New_York', NULL, '2026-03-12 16:00Z', '2026-03-09 06:30Z'",
            "2026-03-13 06:30:00",
        ),
        (
            "every 10 minutes, missed for three days: the next slot of the grid",
            "'10 minutes', NULL, NULL, NULL, '2026-03-10 12:34:56Z', '2026-03-07 12:00Z'",
            "2026-03-10 12:40:00",
        ),
        // every is a fixed length, the clocks notwithstanding.
        (
            "every 1 day across the spring-forward is 86400 s (13:00 EDT after 12:00 EST)",
            "'1 day', NULL, NULL, NULL, '2026-03-07 17:00Z', '2026-03-07 17:00Z'",
            "2026-03-08 17:00:00",
        ),
        (
            "a new every schedule first runs one interval later",
            "'1 hour', NULL, NULL, NULL, '2026-03-08 06:10Z', NULL",
            "2026-03-08 07:10:00",
        ),
        (
            "a run exactly at `after` is not after it",
            "'7 seconds', NULL, NULL, NULL, '2026-03-07 12:00:14Z', '2026-03-07 12:00:00Z'",
            "2026-03-07 12:00:21",
        ),
    ];
    for tz in [
        "UTC",
        "America/New_York",
        "Asia/Kolkata",
        "Australia/Lord_Howe",
    ] {
        c.batch_execute(&format!("SET TimeZone = '{tz}'")).unwrap();
        for (what, args, expected) in cases {
            assert_eq!(
                utc(&mut c, &format!("outbox._next_run({args})")),
                expected,
                "{what} (session TimeZone {tz})"
            );
        }
    }
    // The local times of those runs, for the record: the gap's end and the first 01:30 (EDT).
    assert_eq!(
        c.query_one(
            "SELECT to_char(outbox._next_run(NULL, '02:30', 'America/New_York', NULL, '2026-03-07 12:00Z', NULL)
                            AT TIME ZONE 'America/New_York', 'YYYY-MM-DD HH24:MI'),
                    to_char(outbox._next_run(NULL, '01:30', 'America/New_York', NULL, '2026-10-31 12:00Z', NULL)
                            AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI')",
            &[],
        )
        .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
        .unwrap(),
        ("2026-03-08 03:00".to_string(), "2026-11-01 05:30".to_string())
    );
    // The gap's end to the microsecond: the instant before it is still 01:59:59.999999 EST.
    assert_eq!(
        c.query_one(
            "SELECT outbox._zoned_instant('2026-03-08 02:30', 'America/New_York') = '2026-03-08 07:00Z',
                    ('2026-03-08 07:00Z'::timestamptz - interval '1 microsecond') AT TIME ZONE 'America/New_York'
                        = '2026-03-08 01:59:59.999999'",
            &[],
        )
        .map(|r| (r.get::<_, bool>(0), r.get::<_, bool>(1)))
        .unwrap(),
        (true, true)
    );
}

#[test]
fn a_missed_wall_clock_run_fires_once_late_and_two_sessions_never_fire_it_twice() {
    let db = test_db("sched_late");
    let mut a = db.connect();
    let mut b = db.connect();
    let none: Option<i64> = a
        .query_one("SELECT outbox._schedule_due_in()", &[])
        .unwrap()
        .get(0);
    assert_eq!(none, None, "no schedules, nothing to wait for");
    // A local time six hours ago (so the next regular run is hours away), fired last three days
    // ago at that time: the worker was down. Tokyo keeps no DST, so the next run is at daily_at
    // whatever day the test runs (the clock changes are the test above); the session's TimeZone
    // is another zone, and must not matter.
    a.batch_execute(
        "SET TimeZone = 'America/New_York';
         SELECT outbox.schedule('late', daily_at => date_trunc('minute', (now() AT TIME ZONE 'Asia/Tokyo') - interval '6 hours')::time,
                                zone => 'Asia/Tokyo', queue => 'late-q', payload => '{\"n\": 1}');",
    )
    .unwrap();
    let wait_ms: i64 = a
        .query_one("SELECT outbox._schedule_due_in()", &[])
        .unwrap()
        .get(0);
    assert!(
        wait_ms > 3_600_000 && wait_ms <= 25 * 3_600_000,
        "the first run is the next regular time, not {wait_ms} ms away"
    );
    let forced: String = a
        .query_one(
            "UPDATE outbox.schedules SET next_run = outbox._zoned_instant((now() AT TIME ZONE zone)::date - 3 + daily_at, zone)
              WHERE name = 'late'
             RETURNING to_char(next_run AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
            &[],
        )
        .unwrap()
        .get(0);
    let due: i64 = a
        .query_one("SELECT outbox._schedule_due_in()", &[])
        .unwrap()
        .get(0);
    assert_eq!(due, 0);

    // Two sessions fire at once: a holds the run while b tries. b skips it at once (a wait
    // would hit the lock timeout), and once a has committed the run is no longer due.
    b.batch_execute("SET lock_timeout = '5s'").unwrap();
    a.batch_execute("BEGIN").unwrap();
    let by_a: i32 = a
        .query_one("SELECT outbox._fire_schedules()", &[])
        .unwrap()
        .get(0);
    assert_eq!(by_a, 1);
    let started = Instant::now();
    let by_b: i32 = b
        .query_one("SELECT outbox._fire_schedules()", &[])
        .unwrap()
        .get(0);
    assert_eq!(by_b, 0, "the run a is firing is not fired by b");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "b did not wait for a"
    );
    a.batch_execute("COMMIT").unwrap();
    for c in [&mut a, &mut b] {
        let n: i32 = c
            .query_one("SELECT outbox._fire_schedules()", &[])
            .unwrap()
            .get(0);
        assert_eq!(n, 0, "fired once, however many runs were missed");
    }

    let jobs: Vec<(String, String)> = a
        .query(
            "SELECT key, payload::text FROM outbox.jobs WHERE queue = 'late-q'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        jobs,
        [(format!("late@{forced}"), "{\"n\": 1}".to_string())],
        "one job, keyed by the run it stands for"
    );
    let row = a
        .query_one(
            "SELECT fired, last_run IS NOT NULL,
                    (next_run AT TIME ZONE zone)::time = daily_at,
                    next_run > last_run AND next_run - last_run < interval '25 hours',
                    next_run = outbox._next_run(NULL, daily_at, zone, NULL, last_run, NULL)
               FROM outbox.schedules WHERE name = 'late'",
            &[],
        )
        .unwrap();
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, bool>(1),
            row.get::<_, bool>(2),
            row.get::<_, bool>(3),
            row.get::<_, bool>(4),
        ),
        (1, true, true, true, true),
        "fired once, and moved to the next regular time"
    );
    let dropped: bool = a
        .query_one("SELECT outbox.unschedule('late')", &[])
        .unwrap()
        .get(0);
    assert!(dropped);
    let none: Option<i64> = a
        .query_one("SELECT outbox._schedule_due_in()", &[])
        .unwrap()
        .get(0);
    assert_eq!(none, None);
}

#[test]
fn the_workers_fire_each_run_exactly_once() {
    let db = worker_db("sched_worker");
    let mut c = db.connect();
    let start = Instant::now();
    c.batch_execute(
        "SELECT outbox.schedule('tick-q', every => '1 second', queue => 'ticks', payload => '{\"n\": 1}');
         SELECT outbox.schedule('tick-e', every => '1 second', topic => 'sched.tick');
         SELECT outbox.schedule('late', daily_at => date_trunc('minute', (now() AT TIME ZONE 'Asia/Tokyo') - interval '6 hours')::time,
                                zone => 'Asia/Tokyo', topic => 'sched.late');",
    )
    .unwrap();
    // The daily run of three days ago was missed (Tokyo: no DST, as in the test above).
    let forced: String = c
        .query_one(
            "UPDATE outbox.schedules SET next_run = outbox._zoned_instant((now() AT TIME ZONE zone)::date - 3 + daily_at, zone)
              WHERE name = 'late'
             RETURNING to_char(next_run AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
            &[],
        )
        .unwrap()
        .get(0);
    eventually("the missed run to fire", Duration::from_secs(15), || {
        (fired(&mut c, "late") >= 1).then_some(())
    });
    let ticks_then = fired(&mut c, "tick-e");
    // Two more passes of the workers after it fired, and four runs of each tick.
    eventually(
        "the ticks to fire four times",
        Duration::from_secs(20),
        || {
            let (q, e) = (fired(&mut c, "tick-q"), fired(&mut c, "tick-e"));
            (q >= 4 && e >= 4 && e >= ticks_then + 2).then_some(())
        },
    );
    let elapsed = start.elapsed();

    // One snapshot: a run and its job or event commit together, so the counts must match.
    let row = c
        .query_one(
            "SELECT (SELECT fired FROM outbox.schedules WHERE name = 'tick-q'),
                    (SELECT count(*) FROM outbox.jobs WHERE queue = 'ticks'),
                    (SELECT count(DISTINCT key) FROM outbox.jobs WHERE queue = 'ticks'),
                    (SELECT fired FROM outbox.schedules WHERE name = 'tick-e'),
                    (SELECT count(*) FROM outbox.events WHERE headers->>'schedule' = 'tick-e'),
                    (SELECT count(DISTINCT headers->>'scheduled_for') FROM outbox.events WHERE headers->>'schedule' = 'tick-e')",
            &[],
        )
        .unwrap();
    let (q_fired, jobs, job_keys, e_fired, events, runs): (i64, i64, i64, i64, i64, i64) = (
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
    );
    assert_eq!(
        jobs, q_fired,
        "one job per run (a run fired twice would be one job: same key)"
    );
    assert_eq!(job_keys, jobs);
    assert_eq!(events, e_fired, "one event per run");
    assert_eq!(runs, events, "no run raised twice");
    // The k-th run is k seconds after the schedule was made: no more runs than seconds passed.
    for n in [q_fired, e_fired] {
        assert!(
            n as f64 <= elapsed.as_secs_f64() + 0.5,
            "{n} runs in {elapsed:?}: faster than once a second"
        );
    }
    // The runs keep to the 1 s grid: whole seconds apart, never the same.
    for sql in [
        "SELECT bool_and(d >= 1 AND d = trunc(d)) FROM (
            SELECT extract(epoch FROM t - lag(t) OVER (ORDER BY t)) AS d
              FROM (SELECT split_part(key, '@', 2)::timestamptz AS t FROM outbox.jobs WHERE queue = 'ticks') r) g",
        "SELECT bool_and(d >= 1 AND d = trunc(d)) FROM (
            SELECT extract(epoch FROM t - lag(t) OVER (ORDER BY t)) AS d
              FROM (SELECT (headers->>'scheduled_for')::timestamptz AS t FROM outbox.events
                     WHERE headers->>'schedule' = 'tick-e') r) g",
    ] {
        let on_grid: Option<bool> = c.query_one(sql, &[]).unwrap().get(0);
        assert_eq!(on_grid, Some(true), "{sql}");
    }

    // The missed daily run: once, late, for the time it was due; then the next regular time.
    let late: Vec<(String, String)> = c
        .query(
            "SELECT headers->>'scheduled_for', payload::text FROM outbox.events WHERE topic = 'sched.late'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(late, [(forced, "{}".to_string())]);
    let row = c
        .query_one(
            "SELECT fired, (next_run AT TIME ZONE zone)::time = daily_at,
                    next_run > now() AND next_run - last_run < interval '25 hours'
               FROM outbox.schedules WHERE name = 'late'",
            &[],
        )
        .unwrap();
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, bool>(1),
            row.get::<_, bool>(2)
        ),
        (1, true, true)
    );

    for name in ["tick-q", "tick-e", "late"] {
        let dropped: bool = c
            .query_one("SELECT outbox.unschedule($1)", &[&name])
            .unwrap()
            .get(0);
        assert!(dropped, "{name}");
    }
    let left: i64 = c
        .query_one("SELECT count(*) FROM outbox.schedules", &[])
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
}

#[test]
fn scheduling_needs_the_rights_a_run_uses_and_only_the_owner_unschedules() {
    let db = test_db("sched_privileges");
    let mut c = db.connect();
    let (app, other) = (
        format!("sched_app_{}", db.name),
        format!("sched_other_{}", db.name),
    );
    c.batch_execute(&format!(
        "CREATE ROLE {app} LOGIN; CREATE ROLE {other} LOGIN;
         GRANT USAGE ON SCHEMA outbox TO {app}, {other};
         GRANT EXECUTE ON FUNCTION outbox.schedule(text, interval, time, text, text, text, text, jsonb, timestamp, text),
                                   outbox.unschedule(text) TO {app}, {other};
         GRANT EXECUTE ON FUNCTION outbox.enqueue(text, jsonb, timestamptz, text, integer) TO {app};"
    ))
    .unwrap();
    let mut a = db.connect_as(&app);
    assert_eq!(
        sqlstate(
            &mut a,
            "SELECT outbox.schedule('t', every => '1 minute', topic => 'a.b')"
        ),
        "42501",
        "no EXECUTE on outbox.raise: may not schedule events"
    );
    a.batch_execute("SELECT outbox.schedule('mine', every => '1 minute', queue => 'q')")
        .unwrap();
    let mut o = db.connect_as(&other);
    assert_eq!(
        sqlstate(
            &mut o,
            "SELECT outbox.schedule('theirs', every => '1 minute', queue => 'q')"
        ),
        "42501",
        "no EXECUTE on outbox.enqueue: may not schedule jobs"
    );
    assert_eq!(
        sqlstate(&mut o, "SELECT outbox.unschedule('mine')"),
        "42501"
    );
    let dropped: bool = a
        .query_one("SELECT outbox.unschedule('mine')", &[])
        .unwrap()
        .get(0);
    assert!(dropped);
}

#[test]
fn the_workers_fire_a_run_a_clock_change_skipped_once_at_the_gap_end() {
    let db = worker_db("sched_dst");
    let mut c = db.connect();
    // Daily 02:30 in New York: on 2026-03-08 the clocks jump from 02:00 to 03:00, so that run is
    // due at 03:00 EDT (07:00 UTC). Put the schedule back to that run, as if the workers had been
    // stopped since; they fire it once, late, and move on to the next regular 02:30.
    c.batch_execute(
        "SELECT outbox.schedule('nightly', daily_at => '02:30', zone => 'America/New_York', queue => 'nightly');",
    )
    .unwrap();
    let gap_end = utc(
        &mut c,
        "outbox._next_run(NULL, '02:30', 'America/New_York', NULL, '2026-03-08 06:00+00', NULL)",
    );
    assert_eq!(gap_end, "2026-03-08 07:00:00");
    c.batch_execute(
        "UPDATE outbox.schedules SET next_run = '2026-03-08 07:00+00' WHERE name = 'nightly'",
    )
    .unwrap();
    eventually("the skipped run to fire", Duration::from_secs(15), || {
        (fired(&mut c, "nightly") >= 1).then_some(())
    });
    std::thread::sleep(Duration::from_millis(1500));
    let keys: Vec<String> = c
        .query("SELECT key FROM outbox.jobs WHERE queue = 'nightly'", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(keys, ["nightly@2026-03-08T07:00:00.000000Z"], "fired once");
    assert_eq!(fired(&mut c, "nightly"), 1);
    let local: String = c
        .query_one(
            "SELECT to_char(next_run AT TIME ZONE 'America/New_York', 'HH24:MI') || ' ' || (next_run > now())
               FROM outbox.schedules WHERE name = 'nightly'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(local, "02:30 true", "then the next regular run");
}

#[test]
fn set_schedule_creates_or_replaces_in_place_for_its_owner_only() {
    let db = test_db("sched_set");
    let mut c = db.connect();
    let (app, other) = (
        format!("set_app_{}", db.name),
        format!("set_other_{}", db.name),
    );
    c.batch_execute(&format!(
        "CREATE ROLE {app} LOGIN; CREATE ROLE {other} LOGIN;
         GRANT USAGE ON SCHEMA outbox TO {app}, {other};
         GRANT EXECUTE ON FUNCTION outbox.set_schedule(text, interval, time, text, text, text, text, jsonb, timestamp, text),
                                   outbox.schedule_status(),
                                   outbox.raise(text, jsonb, text, text, jsonb) TO {app}, {other};"
    ))
    .unwrap();
    let mut a = db.connect_as(&app);
    // None of that name yet: created, owned by the caller.
    a.batch_execute(
        "SELECT outbox.set_schedule('digest', daily_at => '09:00', zone => 'Europe/Berlin', topic => 'digest.send')",
    )
    .unwrap();
    let row = |c: &mut pg_outbox_tests::postgres::Client| -> (String, String, String) {
        let r = c
            .query_one(
                "SELECT form, owner::text, to_char(next_run AT TIME ZONE 'America/New_York', 'HH24:MI')
                   FROM outbox.schedule_status() WHERE name = 'digest'",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    let (_, owner, _) = row(&mut a);
    assert_eq!(owner, app);
    // Set again: the same name, a new time in another zone, the same owner, one schedule.
    a.batch_execute(
        "SELECT outbox.set_schedule('digest', daily_at => '09:00', zone => 'America/New_York', topic => 'digest.send')",
    )
    .unwrap();
    let (_, owner, at) = row(&mut a);
    assert_eq!((owner.as_str(), at.as_str()), (app.as_str(), "09:00"));
    assert_eq!(
        a.query_one(
            "SELECT count(*) FROM outbox.schedule_status() WHERE name = 'digest'",
            &[]
        )
        .unwrap()
        .get::<_, i64>(0),
        1
    );
    // A replacement that fails leaves the schedule as it was: one transaction.
    assert_eq!(
        sqlstate(
            &mut a,
            "SELECT outbox.set_schedule('digest', daily_at => '09:00', zone => 'PST', topic => 'digest.send')"
        ),
        "22023"
    );
    assert_eq!(row(&mut a).2, "09:00");
    // Another role may not replace it (nor take its name).
    let mut o = db.connect_as(&other);
    assert_eq!(
        sqlstate(
            &mut o,
            "SELECT outbox.set_schedule('digest', every => '1 minute', topic => 'digest.send')"
        ),
        "42501"
    );
    assert_eq!(row(&mut a).1, app);
}

#[test]
fn a_one_off_run_is_placed_by_its_zones_rules_fires_once_and_is_gone() {
    let db = test_db("sched_at");
    let mut c = db.connect();
    for (sql, code) in [
        ("SELECT outbox.schedule('s', at => '2099-01-01 09:00', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', at => '2099-01-01 09:00', zone => 'UTC', every => '1 hour', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', at => '2099-01-01 09:00', zone => 'UTC', daily_at => '09:00', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', at => '2099-01-01 09:00', zone => 'UTC', weekly_on => 'monday', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', at => '2099-01-01 09:00', zone => 'PST', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', at => '2001-01-01 09:00', zone => 'UTC', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', at => 'infinity', zone => 'UTC', queue => 'q')", "22023"),
        ("SELECT outbox.schedule('s', at => 'tomorrow at nine', zone => 'UTC', queue => 'q')", "22007"),
    ] {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
    // Placed as daily_at is: a repeated local time at its first occurrence, a skipped one at the
    // end of the gap (New York, 2027: fall back on 7 November, spring forward on 14 March).
    for (at, zone, expected) in [
        (
            "2027-11-07 01:30",
            "America/New_York",
            "2027-11-07 05:30:00",
        ),
        (
            "2027-03-14 02:30",
            "America/New_York",
            "2027-03-14 07:00:00",
        ),
        ("2027-10-31 02:30", "Europe/Berlin", "2027-10-31 00:30:00"),
        (
            "2027-04-04 02:30",
            "Australia/Sydney",
            "2027-04-03 15:30:00",
        ),
        ("2027-01-15 09:00", "Asia/Kolkata", "2027-01-15 03:30:00"),
    ] {
        let first = utc(
            &mut c,
            &format!("outbox.schedule('once', at => '{at}', zone => '{zone}', queue => 'q')"),
        );
        assert_eq!(first, expected, "{at} in {zone}");
        let form: String = c
            .query_one(
                "SELECT form FROM outbox.schedule_status() WHERE name = 'once'",
                &[],
            )
            .unwrap()
            .get(0);
        assert_eq!(form, format!("once at {at}:00 {zone}"));
        c.batch_execute("SELECT outbox.unschedule('once')").unwrap();
    }
    // A worker that starts places the runs again by the zone rules it has: a tz database update
    // that moved the zone's clocks (here: a run left at a wrong instant) moves the run.
    let placed = utc(
        &mut c,
        "outbox.schedule('once', at => '2099-06-01 12:00', zone => 'Europe/Berlin', queue => 'q')",
    );
    c.batch_execute(
        "UPDATE outbox.schedules SET next_run = next_run + interval '1 hour' WHERE name = 'once'",
    )
    .unwrap();
    let moved: i32 = c
        .query_one("SELECT outbox._place_one_offs()", &[])
        .unwrap()
        .get(0);
    assert_eq!(moved, 1);
    assert_eq!(
        utc(
            &mut c,
            "(SELECT next_run FROM outbox.schedules WHERE name = 'once')"
        ),
        placed
    );
}

#[test]
fn the_workers_fire_a_one_off_run_once_then_drop_it() {
    let db = worker_db("sched_at_worker");
    let mut c = db.connect();
    // Two seconds from now on Kolkata's clock (+05:30): a job and an event.
    c.batch_execute(
        "SELECT outbox.schedule('remind-q', at => date_trunc('second', (now() AT TIME ZONE 'Asia/Kolkata') + interval '2 seconds'),
                                zone => 'Asia/Kolkata', queue => 'reminders', payload => '{\"to\": \"ada\"}');
         SELECT outbox.schedule('remind-e', at => date_trunc('second', (now() AT TIME ZONE 'Asia/Kolkata') + interval '2 seconds'),
                                zone => 'Asia/Kolkata', topic => 'reminder.due');",
    )
    .unwrap();
    let due = utc(
        &mut c,
        "(SELECT next_run FROM outbox.schedules WHERE name = 'remind-q')",
    );
    eventually("both one-off runs to fire", Duration::from_secs(15), || {
        let left: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.schedules WHERE name LIKE 'remind-%'",
                &[],
            )
            .unwrap()
            .get(0);
        (left == 0).then_some(())
    });
    let job = c
        .query_one(
            "SELECT payload::text, key, to_char(split_part(key, '@', 2)::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')
               FROM outbox.jobs WHERE queue = 'reminders'",
            &[],
        )
        .unwrap();
    assert_eq!(job.get::<_, String>(0), r#"{"to": "ada"}"#);
    assert!(job.get::<_, String>(1).starts_with("remind-q@"));
    assert_eq!(job.get::<_, String>(2), due, "the job is of the run due");
    let events: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.events WHERE topic = 'reminder.due' AND headers->>'schedule' = 'remind-e'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(events, 1);
    // Gone, and nothing fires again.
    std::thread::sleep(Duration::from_millis(1500));
    let jobs: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.jobs WHERE queue = 'reminders'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(jobs, 1);
}

#[test]
fn an_each_schedule_queues_one_job_per_row_as_its_owner() {
    let db = worker_db("sched_each");
    let mut c = db.connect();
    let (app, other) = (
        format!("each_app_{}", db.name),
        format!("each_other_{}", db.name),
    );
    c.batch_execute(&format!(
        "CREATE ROLE {app} LOGIN; CREATE ROLE {other} LOGIN;
         GRANT USAGE ON SCHEMA outbox TO {app}, {other};
         GRANT EXECUTE ON FUNCTION outbox.schedule(text, interval, time, text, text, text, text, jsonb, timestamp, text),
                                   outbox.set_schedule(text, interval, time, text, text, text, text, jsonb, timestamp, text),
                                   outbox.schedule_status(), outbox.unschedule(text),
                                   outbox.enqueue(text, jsonb, timestamptz, text, integer),
                                   outbox.raise(text, jsonb, text, text, jsonb),
                                   outbox.claim(text, integer, interval), outbox.complete(bigint) TO {app}, {other};
         CREATE TABLE public.secret (v text); INSERT INTO public.secret VALUES ('s3cr3t');
         CREATE TABLE public.digests (user_id int, email text, due boolean);
         ALTER TABLE public.digests OWNER TO {app};
         INSERT INTO public.digests VALUES (1, 'a@example.com', true), (2, 'b@example.com', true),
                                           (3, 'c@example.com', false);
         CREATE FUNCTION public.digest_rows() RETURNS SETOF jsonb LANGUAGE sql AS
           $$ SELECT jsonb_build_object('user', user_id) FROM public.digests WHERE due $$;
         ALTER FUNCTION public.digest_rows() OWNER TO {app};
         CREATE TABLE public.fail_each (fail boolean); INSERT INTO public.fail_each VALUES (false);
         ALTER TABLE public.fail_each OWNER TO {app};
         CREATE FUNCTION public.maybe_fail() RETURNS SETOF jsonb LANGUAGE plpgsql AS $$
         BEGIN
           IF (SELECT fail FROM public.fail_each) THEN RAISE EXCEPTION 'the digest source is down'; END IF;
           RETURN QUERY SELECT jsonb_build_object('ok', true);
         END $$;
         ALTER FUNCTION public.maybe_fail() OWNER TO {app};
         CREATE FUNCTION public.escalate() RETURNS SETOF jsonb LANGUAGE plpgsql AS $$
         BEGIN
           EXECUTE format('ALTER ROLE %I SUPERUSER', current_user);
           RETURN QUERY SELECT jsonb_build_object('became', 'superuser');
         END $$;
         ALTER FUNCTION public.escalate() OWNER TO {app};"
    ))
    .unwrap();
    let mut a = db.connect_as(&app);
    for (sql, code) in [
        // Jobs only, and the rows are the payloads.
        ("SELECT outbox.schedule('e', every => '1 hour', topic => 't', each => 'SELECT 1')", "22023"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', payload => '{\"a\": 1}', each => 'SELECT 1')", "22023"),
        // One query.
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => '')", "22023"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'SELECT 1; SELECT 2')", "22023"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'DELETE FROM public.digests')", "22023"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'SELECT 1) r; DELETE FROM public.digests; SELECT (1')", "42601"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'SELECT * INTO public.copy FROM public.digests')", "22023"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'WITH d AS (DELETE FROM public.digests RETURNING *) SELECT * FROM d')", "0A000"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'SELEC 1')", "42601"),
        // Checked with the caller's rights and the search_path it runs with.
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'SELECT * FROM public.secret')", "42501"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'SELECT * FROM nowhere')", "42P01"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'no_such_function')", "42883"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'pg_catalog.lower')", "42883"),
        ("SELECT outbox.schedule('e', every => '1 hour', queue => 'q', each => 'SELECT pg_catalog.pg_read_file(''/etc/passwd'')')", "42501"),
    ] {
        assert_eq!(sqlstate(&mut a, sql), code, "{sql}");
    }
    a.batch_execute(
        "SELECT outbox.schedule('digest', every => '1 second', queue => 'digests',
                                each => 'SELECT user_id, email, current_user AS who FROM digests WHERE due;');
         SELECT outbox.schedule('digest-fn', every => '1 second', queue => 'digests-fn', each => 'digest_rows');
         SELECT outbox.schedule('flaky', every => '1 second', queue => 'flaky', each => 'maybe_fail()');
         SELECT outbox.schedule('escalate', every => '1 second', queue => 'escalate', each => 'escalate');
         SELECT outbox.schedule('commented', every => '1 hour', queue => 'c', each => 'SELECT 1 AS n -- the end');
         SELECT outbox.unschedule('commented');",
    )
    .unwrap();
    let payloads = |c: &mut pg_outbox_tests::postgres::Client, queue: &str| -> Vec<String> {
        c.query(
            "SELECT payload::text FROM outbox.jobs WHERE queue = $1 ORDER BY payload::text",
            &[&queue],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
    };
    eventually("three runs of each", Duration::from_secs(20), || {
        (fired(&mut c, "digest") >= 3 && fired(&mut c, "digest-fn") >= 3).then_some(())
    });
    // One job per row, whatever the number of runs: a row whose job waits gets no second.
    assert_eq!(
        payloads(&mut c, "digests"),
        [
            format!(r#"{{"who": "{app}", "email": "a@example.com", "user_id": 1}}"#),
            format!(r#"{{"who": "{app}", "email": "b@example.com", "user_id": 2}}"#),
        ],
        "the rows, as the owner saw them"
    );
    assert_eq!(
        payloads(&mut c, "digests-fn"),
        [r#"{"user": 1}"#, r#"{"user": 2}"#],
        "a function's jsonb rows are the payloads"
    );
    // A job done, its row is queued again at the next run; a row that became due is queued too.
    let done: i64 = a
        .query_one("SELECT id FROM outbox.claim('digests', 1, '1 minute')", &[])
        .unwrap()
        .get(0);
    a.batch_execute(&format!(
        "SELECT outbox.complete({done}); UPDATE public.digests SET due = true WHERE user_id = 3;"
    ))
    .unwrap();
    eventually(
        "the completed row and the new one queued",
        Duration::from_secs(10),
        || {
            let waiting: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.jobs WHERE queue = 'digests' AND state = 'waiting'",
                &[],
            )
            .unwrap()
            .get(0);
            (waiting == 3).then_some(())
        },
    );
    // A query that fails queues nothing, says why, and the schedule goes on.
    c.batch_execute("UPDATE public.fail_each SET fail = true")
        .unwrap();
    let fired_then = fired(&mut c, "flaky");
    eventually("a failed run", Duration::from_secs(10), || {
        let e: Option<String> = a
            .query_one(
                "SELECT last_error FROM outbox.schedule_status() WHERE name = 'flaky'",
                &[],
            )
            .unwrap()
            .get(0);
        e.filter(|e| e.contains("the digest source is down"))
    });
    assert!(fired(&mut c, "flaky") > fired_then);
    c.batch_execute(
        "UPDATE public.fail_each SET fail = false; DELETE FROM outbox.jobs WHERE queue = 'flaky'",
    )
    .unwrap();
    eventually(
        "a run that goes through again",
        Duration::from_secs(10),
        || {
            let r = c
            .query_one(
                "SELECT last_error IS NULL, (SELECT count(*) FROM outbox.jobs WHERE queue = 'flaky')
                   FROM outbox.schedule_status() WHERE name = 'flaky'",
                &[],
            )
            .unwrap();
            (r.get::<_, bool>(0) && r.get::<_, i64>(1) == 1).then_some(())
        },
    );
    // The query runs as the owner: a role that may not read a table it names gets no rows of
    // it, and no run reads as the superuser. (Revoked after scheduling: the run fails.)
    c.batch_execute(&format!(
        "GRANT SELECT ON public.secret TO {other}; GRANT USAGE ON SCHEMA outbox TO {other};"
    ))
    .unwrap();
    let mut o = db.connect_as(&other);
    o.batch_execute(
        "SELECT outbox.schedule('peek', every => '1 second', queue => 'peek', each => 'SELECT v FROM public.secret')",
    )
    .unwrap();
    c.batch_execute(&format!("REVOKE SELECT ON public.secret FROM {other}"))
        .unwrap();
    eventually("the run to be refused", Duration::from_secs(10), || {
        let e: Option<String> = o
            .query_one(
                "SELECT last_error FROM outbox.schedule_status() WHERE name = 'peek'",
                &[],
            )
            .unwrap()
            .get(0);
        e.filter(|e| e.contains("permission denied"))
    });
    let peeked: i64 = c
        .query_one("SELECT count(*) FROM outbox.jobs WHERE queue = 'peek'", &[])
        .unwrap()
        .get(0);
    assert_eq!(peeked, 0);
    assert!(
        db.cluster()
            .log()
            .contains("schedule \"flaky\" skipped a run"),
        "the failure is in the server log"
    );
    // A query that tries to make its owner superuser runs as the owner: refused, no job.
    let e: String = eventually("the escalation to fail", Duration::from_secs(10), || {
        a.query_one(
            "SELECT last_error FROM outbox.schedule_status() WHERE name = 'escalate'",
            &[],
        )
        .unwrap()
        .get::<_, Option<String>>(0)
    });
    assert!(e.contains("must be superuser"), "{e}");
    let superuser: bool = c
        .query_one("SELECT rolsuper FROM pg_roles WHERE rolname = $1", &[&app])
        .unwrap()
        .get(0);
    assert!(!superuser, "{app} became superuser through its each query");
    a.batch_execute("SELECT outbox.unschedule('escalate')")
        .unwrap();
    for name in ["digest", "digest-fn", "flaky"] {
        a.batch_execute(&format!("SELECT outbox.unschedule('{name}')"))
            .unwrap();
    }
    o.batch_execute("SELECT outbox.unschedule('peek')").unwrap();
}

#[test]
fn each_schedules_cannot_stall_crash_or_flood_the_workers() {
    let db = worker_db("sched_each_abuse");
    let mut c = db.connect();
    let (app, other) = (
        format!("abuse_app_{}", db.name),
        format!("abuse_other_{}", db.name),
    );
    c.batch_execute(&format!(
        "CREATE ROLE {app} LOGIN; CREATE ROLE {other} LOGIN;
         GRANT USAGE ON SCHEMA outbox TO {app}, {other};
         GRANT EXECUTE ON FUNCTION outbox.schedule(text, interval, time, text, text, text, text, jsonb, timestamp, text),
                                   outbox.schedule_status(), outbox.unschedule(text),
                                   outbox.enqueue(text, jsonb, timestamptz, text, integer) TO {app}, {other};"
    ))
    .unwrap();
    let mut a = db.connect_as(&app);
    // The parse rules of the workers hold at creation, whatever the session says: with
    // standard_conforming_strings off, '\' would not end this string and the text would be one
    // SELECT; in the workers it is a SELECT, a DELETE and another SELECT.
    a.batch_execute("SET standard_conforming_strings = off")
        .unwrap();
    assert_eq!(
        sqlstate(
            &mut a,
            "SELECT outbox.schedule('sneak', every => '1 minute', queue => 'sneak', each => $q$SELECT 1 AS a, '\\' ) r; DELETE FROM outbox.jobs; SELECT * FROM (SELECT 1 AS a /*' -- */
, 2 AS b$q$)"
        ),
        "42601"
    );
    a.batch_execute("RESET standard_conforming_strings")
        .unwrap();
    assert_eq!(
        sqlstate(
            &mut a,
            &format!(
                "SELECT outbox.schedule('long', every => '1 minute', queue => 'q', each => 'SELECT 1 AS n{}')",
                " ".repeat(70_000)
            )
        ),
        "22023"
    );
    let workers = db.cluster().worker_pids();
    a.batch_execute(
        "SELECT outbox.schedule('many', every => '1 second', queue => 'many',
                                each => 'SELECT g FROM generate_series(1, 100001) g');
         SELECT outbox.schedule('huge', every => '1 second', queue => 'huge',
                                each => 'SELECT repeat(''x'', 2000000) AS x');
         SELECT outbox.schedule('slow', every => '1 second', queue => 'slow',
                                each => 'SELECT 1 AS x FROM pg_sleep(2)');",
    )
    .unwrap();
    // While a tenant's query runs, the worker holds no transaction id (which would hold every
    // reader's horizon back).
    let mut seen_sleeping = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while seen_sleeping < 5 && Instant::now() < deadline {
        for row in c
            .query(
                "SELECT backend_xid::text FROM pg_stat_activity
                  WHERE backend_type = 'pg_outbox worker' AND wait_event = 'PgSleep'",
                &[],
            )
            .unwrap()
        {
            seen_sleeping += 1;
            assert_eq!(
                row.get::<_, Option<String>>(0),
                None,
                "a worker holds an xid while a tenant's query runs"
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(seen_sleeping >= 5, "the slow query was never seen running");
    let mut error = |name: &str| -> Option<String> {
        a.query_one(
            "SELECT last_error FROM outbox.schedule_status() WHERE name = $1",
            &[&name],
        )
        .unwrap()
        .get(0)
    };
    let many = eventually("the 100,001 rows refused", Duration::from_secs(15), || {
        error("many")
    });
    assert!(many.contains("more than 100000 rows"), "{many}");
    let huge = eventually("the huge row refused", Duration::from_secs(15), || {
        error("huge")
    });
    assert!(huge.contains("pg_outbox.max_event_size"), "{huge}");
    // Failing runs back off: 1 s, 2 s, 4 s ... between runs, not one a second.
    eventually("a third failed run", Duration::from_secs(20), || {
        let failed: i32 = c
            .query_one(
                "SELECT failed_runs FROM outbox.schedules WHERE name = 'many'",
                &[],
            )
            .unwrap()
            .get(0);
        (failed >= 3).then_some(())
    });
    let gap: f64 = c
        .query_one(
            "SELECT extract(epoch FROM next_run - last_run)::float8 FROM outbox.schedules WHERE name = 'many'",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(
        gap >= 3.5,
        "the next run after three failures is {gap} s after the last"
    );
    let jobs: i64 = c
        .query_one("SELECT count(*) FROM outbox.jobs", &[])
        .unwrap()
        .get(0);
    assert_eq!(jobs, 1, "only the slow schedule's row became a job");
    let now = db.cluster().worker_pids();
    assert!(
        workers.iter().all(|pid| now.contains(pid)),
        "no worker exited: {workers:?} then {now:?}"
    );
    // Another role sees that a run failed, not the query or the error.
    let mut o = db.connect_as(&other);
    let row = o
        .query_one(
            "SELECT target, last_error FROM outbox.schedule_status() WHERE name = 'many'",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "queue many, each row of a query");
    assert_eq!(
        row.get::<_, Option<String>>(1).as_deref(),
        Some("a run failed (the error is shown to its owner)")
    );
    for name in ["many", "huge", "slow"] {
        a.batch_execute(&format!("SELECT outbox.unschedule('{name}')"))
            .unwrap();
    }
}
