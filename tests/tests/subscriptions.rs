//! Subscriptions: CEL filters route events into jobs; the worker runs jobs with a SQL handler
//! exactly once; refusals; runtime filter errors that neither stall nor crash.

use pg_outbox_tests::{eventually, sqlstate, worker_db};
use postgres::Client;
use std::collections::BTreeSet;
use std::time::Duration;

fn count(c: &mut Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).unwrap().get(0)
}

/// Waits until every subscription has read the whole log.
fn caught_up(c: &mut Client) {
    eventually("subscriptions caught up", Duration::from_secs(30), || {
        // Idle: nothing readable left, and nothing held behind a running transaction either
        // (a worker's round that began before the events were raised holds them for a moment).
        let busy = count(
            c,
            "SELECT count(*) FROM outbox.status() WHERE kind = 'subscription' AND state <> 'idle'",
        );
        (busy == 0).then_some(())
    });
}

fn queued(c: &mut Client, queue: &str) -> BTreeSet<i64> {
    c.query(
        "SELECT (payload->'payload'->>'n')::int8 FROM outbox.jobs WHERE queue = $1",
        &[&queue],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[test]
fn filters_route_exactly_the_matching_events_to_each_subscription() {
    let db = worker_db("sub_routing");
    let mut c = db.connect();
    c.batch_execute(
        "SELECT outbox.subscribe('big-acme', '{orders.*}', queue => 'big-acme',
                                 filter => 'payload.amount > 100 && tenant == \"acme\"');
         SELECT outbox.subscribe('vip', NULL, queue => 'vip', filter => 'has(payload.vip) && payload.vip');
         SELECT outbox.subscribe('vip-too', '{orders.created}', queue => 'vip', filter => 'has(payload.vip)');
         SELECT outbox.subscribe('all-refunds', '{refunds.#}', queue => 'refunds');
         SELECT outbox.subscribe('by-subject', NULL, queue => 'subj',
                                 filter => 'subject != null && subject.startsWith(\"cust-1\")');",
    )
    .unwrap();
    // 200 events over three topics, two tenants, amounts 0..199, every 7th a VIP.
    c.batch_execute(
        "SELECT outbox.raise(CASE WHEN n % 3 = 0 THEN 'orders.created' WHEN n % 3 = 1 THEN 'orders.paid'
                                  ELSE 'refunds.issued.eu' END,
                             jsonb_build_object('n', n, 'amount', n) || CASE WHEN n % 7 = 0 THEN '{\"vip\": true}'::jsonb
                                                                            ELSE '{}' END,
                             subject => 'cust-' || (n % 20),
                             tenant => CASE WHEN n % 2 = 0 THEN 'acme' ELSE 'globex' END)
           FROM generate_series(0, 199) n",
    )
    .unwrap();
    caught_up(&mut c);
    let topic = |n: i64| match n % 3 {
        0 => "orders.created",
        1 => "orders.paid",
        _ => "refunds.issued.eu",
    };
    let expect =
        |pred: &dyn Fn(i64) -> bool| -> BTreeSet<i64> { (0..200).filter(|n| pred(*n)).collect() };
    assert_eq!(
        queued(&mut c, "big-acme"),
        expect(&|n| topic(n).starts_with("orders.") && n > 100 && n % 2 == 0)
    );
    assert_eq!(queued(&mut c, "vip"), expect(&|n| n % 7 == 0));
    // Two subscriptions feeding one queue each get their job for an event both match.
    let both = (0..200).filter(|n| n % 7 == 0 && n % 3 == 0).count() as i64;
    let vip_jobs = count(
        &mut c,
        "SELECT count(*) FROM outbox.jobs WHERE queue = 'vip'",
    );
    assert_eq!(vip_jobs, expect(&|n| n % 7 == 0).len() as i64 + both);
    assert_eq!(
        queued(&mut c, "refunds"),
        expect(&|n| topic(n).starts_with("refunds."))
    );
    assert_eq!(
        queued(&mut c, "subj"),
        expect(&|n| (n % 20).to_string().starts_with('1'))
    );
    // Each job carries its event and the event's id as its key; the counts add up.
    let bad = count(
        &mut c,
        "SELECT count(*) FROM outbox.jobs WHERE key <> subscription || ':' || event OR payload->>'id' <> event::text
                                         OR subscription IS NULL OR handler IS NOT NULL",
    );
    assert_eq!(bad, 0);
    // The payload is the event exactly as a reader gets it (position and time included), and each
    // subscription's jobs were queued in the order of the log.
    let differs = count(
        &mut c,
        "SELECT count(*) FROM outbox.jobs j
           LEFT JOIN outbox._read_after('0', 0, 1000) r ON r.id = j.event
          WHERE r.id IS NULL OR j.payload <> to_jsonb(r)",
    );
    assert_eq!(differs, 0);
    let out_of_order = count(
        &mut c,
        "SELECT count(*) FROM (
             SELECT j.id, lag(j.id) OVER (PARTITION BY j.subscription ORDER BY r.position_order) AS before
               FROM outbox.jobs j
               JOIN (SELECT r.id, row_number() OVER () AS position_order
                       FROM outbox._read_after('0', 0, 1000) r) r ON r.id = j.event) o
          WHERE o.id < o.before",
    );
    assert_eq!(out_of_order, 0);
    let row = c
        .query_one(
            "SELECT matched, skipped, predicate_errors FROM outbox.status() WHERE name = 'big-acme'",
            &[],
        )
        .unwrap();
    let (matched, skipped, errors): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    let orders = (0..200).filter(|n| n % 3 != 2).count() as i64;
    assert_eq!(matched, queued(&mut c, "big-acme").len() as i64);
    assert_eq!(
        matched + skipped,
        orders,
        "every event of its topics is counted once"
    );
    assert_eq!(errors, 0);
}

#[test]
fn a_filter_that_fails_at_run_time_counts_as_false_and_does_not_stall() {
    let db = worker_db("sub_errors");
    let mut c = db.connect();
    c.batch_execute(
        "SELECT outbox.subscribe('amounts', NULL, queue => 'amounts', filter => 'payload.amount > 10');
         SELECT outbox.subscribe('not-bool', NULL, queue => 'nb', filter => 'payload.amount');
         SELECT outbox.raise('t', '{\"n\": 1, \"amount\": 50}');
         SELECT outbox.raise('t', '{\"n\": 2}');
         SELECT outbox.raise('t', '{\"n\": 3, \"amount\": \"lots\"}');
         SELECT outbox.raise('t', '{\"n\": 4, \"amount\": 11}');
         SELECT outbox.raise('t', '{\"n\": 5, \"amount\": 1}');",
    )
    .unwrap();
    caught_up(&mut c);
    assert_eq!(queued(&mut c, "amounts"), BTreeSet::from([1, 4]));
    let row = c
        .query_one(
            "SELECT matched, skipped, predicate_errors, last_error, state FROM outbox.status() WHERE name = 'amounts'",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 2);
    assert_eq!(row.get::<_, i64>(1), 1);
    assert_eq!(row.get::<_, i64>(2), 2, "the missing field and the string");
    let last: String = row.get(3);
    assert!(last.contains("event "), "the error names the event: {last}");
    assert_eq!(row.get::<_, String>(4), "idle");
    // A filter that gives no boolean matches nothing, and says why.
    assert!(queued(&mut c, "nb").is_empty());
    let last: String = c
        .query_one(
            "SELECT last_error FROM outbox.status() WHERE name = 'not-bool'",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(last.contains("not a boolean"), "{last}");
    // The worker lives on and later events still flow.
    c.batch_execute("SELECT outbox.raise('t', '{\"n\": 6, \"amount\": 99}')")
        .unwrap();
    caught_up(&mut c);
    assert_eq!(queued(&mut c, "amounts"), BTreeSet::from([1, 4, 6]));
}

#[test]
fn subscribe_refuses_bad_input() {
    let db = worker_db("sub_refusals");
    let mut c = db.connect();
    c.batch_execute(
        "CREATE FUNCTION ok_handler(e outbox.event) RETURNS void LANGUAGE sql AS 'SELECT';
         CREATE FUNCTION batch_handler(e outbox.event[]) RETURNS void LANGUAGE sql AS 'SELECT';
         CREATE FUNCTION private_handler(e outbox.event) RETURNS void LANGUAGE sql AS 'SELECT';
         REVOKE EXECUTE ON FUNCTION private_handler(outbox.event) FROM PUBLIC;
         CREATE ROLE sub_app LOGIN;
         GRANT USAGE ON SCHEMA outbox TO sub_app;
         GRANT EXECUTE ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, text, integer, text),
                                   outbox.unsubscribe(text), outbox.pause_subscription(text) TO sub_app;
         SELECT outbox.subscribe('taken', queue => 'q');
         SELECT outbox.create_consumer('puller');",
    )
    .unwrap();
    let cases = [
        (
            "SELECT outbox.subscribe('s', queue => 'q', filter => 'payload.amount >')",
            "22023",
        ),
        (
            "SELECT outbox.subscribe('s', queue => 'q', filter => 'amount > 100')",
            "22023",
        ),
        (
            "SELECT outbox.subscribe('s', queue => 'q', filter => '   ')",
            "22023",
        ),
        ("SELECT outbox.subscribe('s')", "22023"),
        (
            "SELECT outbox.subscribe('s', handler => 'ok_handler(outbox.event)', queue => 'q')",
            "22023",
        ),
        (
            "SELECT outbox.subscribe('s', handler => 'batch_handler(outbox.event[])')",
            "42P13",
        ),
        (
            "SELECT outbox.subscribe('s', queue => 'no spaces')",
            "42602",
        ),
        ("SELECT outbox.subscribe('bad name', queue => 'q')", "42602"),
        ("SELECT outbox.subscribe(NULL, queue => 'q')", "22004"),
        (
            "SELECT outbox.subscribe('s', queue => 'q', max_attempts => 0)",
            "22023",
        ),
        (
            "SELECT outbox.subscribe('s', queue => 'q', max_attempts => NULL)",
            "22004",
        ),
        ("SELECT outbox.subscribe('s', '{}', queue => 'q')", "22023"),
        (
            "SELECT outbox.subscribe('s', '{a..b}', queue => 'q')",
            "22023",
        ),
        (
            "SELECT outbox.subscribe('s', queue => 'q', start_at => 'yesterday')",
            "22023",
        ),
        ("SELECT outbox.subscribe('taken', queue => 'q')", "42710"),
        ("SELECT outbox.unsubscribe('nobody')", "42704"),
        ("SELECT outbox.unsubscribe('puller')", "42809"),
    ];
    for (sql, code) in cases {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
    let mut app = db.connect_as("sub_app");
    assert_eq!(
        sqlstate(
            &mut app,
            "SELECT outbox.subscribe('s', handler => 'private_handler(outbox.event)')"
        ),
        "42501",
        "registering a handler needs EXECUTE on it"
    );
    assert_eq!(
        sqlstate(&mut app, "SELECT outbox.unsubscribe('taken')"),
        "42501",
        "only the owner drops a subscription"
    );
    app.batch_execute("SELECT outbox.subscribe('mine', handler => 'ok_handler(outbox.event)')")
        .unwrap();
    app.batch_execute(
        "SELECT outbox.pause_subscription('mine'); SELECT outbox.unsubscribe('mine')",
    )
    .unwrap();
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM outbox.subscriptions"),
        1
    );
}

const EFFECTS: &str = "
    CREATE TABLE effects (n int8 NOT NULL, pid int NOT NULL DEFAULT pg_backend_pid(), by_role name DEFAULT current_user);
    CREATE TABLE flaky (on_ boolean NOT NULL);
    INSERT INTO flaky VALUES (true);
    CREATE ROLE job_owner;
    GRANT USAGE ON SCHEMA outbox TO job_owner;
    GRANT INSERT ON effects TO job_owner;
    GRANT SELECT ON flaky TO job_owner;
    GRANT EXECUTE ON FUNCTION outbox.subscribe(text, text[], regprocedure, text, text, integer, text) TO job_owner;
    -- Records the event's effect; fails (retryably) for every 97th event while flaky is on, and
    -- with a data error for an event marked bad.
    CREATE FUNCTION apply_event(e outbox.event) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
      INSERT INTO effects (n) VALUES ((e.payload->>'n')::int8);
      IF (e.payload->>'n')::int8 % 97 = 0 AND (SELECT on_ FROM flaky) THEN
        RAISE EXCEPTION 'flaky dependency' USING ERRCODE = 'P0001';
      END IF;
      IF e.payload ? 'bad' AND (SELECT on_ FROM flaky) THEN
        PERFORM 1 / 0;
      END IF;
    END $$;
    ALTER FUNCTION apply_event(outbox.event) OWNER TO job_owner;";

#[test]
fn ten_thousand_jobs_run_exactly_once_by_a_sql_handler_with_transient_failures() {
    let db = worker_db("sub_jobs");
    let mut c = db.connect();
    c.batch_execute(&EFFECTS.replace("job_owner", &format!("job_owner_{}", db.name)))
        .unwrap();
    c.batch_execute(&format!(
        "SET ROLE job_owner_{db};
         SELECT outbox.subscribe('apply', '{{work.*}}', handler => 'apply_event(outbox.event)',
                                 filter => 'payload.n >= 0');
         RESET ROLE;",
        db = db.name
    ))
    .unwrap();
    // 10,000 matching events from many transactions, interleaved with events of other topics.
    for chunk in 0..20 {
        c.batch_execute(&format!(
            "SELECT outbox.raise('work.item', jsonb_build_object('n', n)) FROM generate_series({a}, {b}) n;
             SELECT outbox.raise('other', '{{}}') FROM generate_series(1, 10);",
            a = chunk * 500,
            b = chunk * 500 + 499
        ))
        .unwrap();
    }
    // Every job that does not fail has run once; the flaky ones are retrying.
    let flaky = (0..10_000).filter(|n| n % 97 == 0).count() as i64;
    eventually(
        "the non-failing jobs to run",
        Duration::from_secs(60),
        || (count(&mut c, "SELECT count(*) FROM effects") == 10_000 - flaky).then_some(()),
    );
    let retrying = eventually(
        "the flaky jobs to be retrying",
        Duration::from_secs(30),
        || {
            let r: i64 = count(
                &mut c,
                "SELECT count(*) FROM outbox.jobs WHERE attempts > 0 AND state = 'waiting'",
            );
            (r == flaky).then_some(r)
        },
    );
    assert_eq!(retrying, flaky);
    let row = c
        .query_one(
            "SELECT retrying, dead FROM outbox.queue_status() WHERE queue = 'apply'",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), flaky);
    assert_eq!(row.get::<_, i64>(1), 0);
    c.batch_execute("UPDATE flaky SET on_ = false").unwrap();
    eventually("every job to run", Duration::from_secs(60), || {
        (count(&mut c, "SELECT count(*) FROM outbox.jobs") == 0).then_some(())
    });
    let row = c
        .query_one(
            "SELECT count(*), count(DISTINCT n), min(n), max(n), bool_and(by_role = $1) FROM effects",
            &[&format!("job_owner_{}", db.name)],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 10_000, "each effect exactly once");
    assert_eq!(row.get::<_, i64>(1), 10_000);
    assert_eq!((row.get::<_, i64>(2), row.get::<_, i64>(3)), (0, 9_999));
    assert!(
        row.get::<_, bool>(4),
        "the handler runs as the subscription's owner"
    );
    let workers = count(&mut c, "SELECT count(DISTINCT pid) FROM effects");
    println!("jobs ran in {workers} worker process(es)");
}

#[test]
fn a_data_error_kills_a_job_at_once_and_a_replay_runs_it() {
    let db = worker_db("sub_dead");
    let mut c = db.connect();
    c.batch_execute(&EFFECTS.replace("job_owner", &format!("job_owner_{}", db.name)))
        .unwrap();
    c.batch_execute(
        &"UPDATE flaky SET on_ = true;
         SET ROLE job_owner;
         SELECT outbox.subscribe('apply', NULL, handler => 'apply_event(outbox.event)');
         RESET ROLE;
         SELECT outbox.raise('t', '{\"n\": 1}');
         SELECT outbox.raise('t', '{\"n\": 2, \"bad\": true}');
         SELECT outbox.raise('t', '{\"n\": 3}');"
            .replace("job_owner", &format!("job_owner_{}", db.name)),
    )
    .unwrap();
    let id: i64 = eventually("the bad job to die", Duration::from_secs(30), || {
        c.query_opt("SELECT id FROM outbox.dead_jobs WHERE queue = 'apply'", &[])
            .unwrap()
            .map(|r| r.get(0))
    });
    let row = c
        .query_one(
            "SELECT attempts, last_error FROM outbox.jobs WHERE id = $1",
            &[&id],
        )
        .unwrap();
    // The payload is exactly the documented event, and the job says when it died.
    let keys: Vec<String> = c
        .query(
            "SELECT k FROM outbox.dead_jobs, jsonb_object_keys(payload) k WHERE id = $1 ORDER BY k",
            &[&id],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        keys,
        [
            "headers",
            "id",
            "payload",
            "position",
            "raised_at",
            "subject",
            "tenant",
            "topic"
        ]
    );
    assert_eq!(
        count(
            &mut c,
            &format!(
                "SELECT count(*) FROM outbox.dead_jobs WHERE id = {id} AND dead_at IS NOT NULL"
            )
        ),
        1
    );
    assert_eq!(
        row.get::<_, i32>(0),
        1,
        "a data error does not pass on retry: no second attempt"
    );
    assert!(
        row.get::<_, String>(1).contains("22012"),
        "{}",
        row.get::<_, String>(1)
    );
    assert_eq!(
        c.query("SELECT n FROM effects ORDER BY n", &[])
            .unwrap()
            .iter()
            .map(|r| r.get::<_, i64>(0))
            .collect::<Vec<_>>(),
        [1, 3],
        "the failed job's writes were rolled back; its neighbours ran"
    );
    c.batch_execute("UPDATE flaky SET on_ = false").unwrap();
    c.execute("SELECT outbox.replay_job($1)", &[&id]).unwrap();
    eventually("the replayed job to run", Duration::from_secs(30), || {
        (count(&mut c, "SELECT count(*) FROM effects") == 3).then_some(())
    });
    assert_eq!(count(&mut c, "SELECT count(*) FROM outbox.jobs"), 0);
}

#[test]
fn unsubscribe_drops_handler_jobs_but_not_queued_ones_and_pause_holds_jobs() {
    let db = worker_db("sub_pause");
    let mut c = db.connect();
    c.batch_execute(&EFFECTS.replace("job_owner", &format!("job_owner_{}", db.name)))
        .unwrap();
    c.batch_execute(
        &"UPDATE flaky SET on_ = false;
         SET ROLE job_owner;
         SELECT outbox.subscribe('apply', NULL, handler => 'apply_event(outbox.event)');
         RESET ROLE;
         SELECT outbox.subscribe('ext', NULL, queue => 'ext');
         SELECT outbox.pause_subscription('apply');
         SELECT outbox.raise('t', jsonb_build_object('n', n)) FROM generate_series(1, 5) n;"
            .replace("job_owner", &format!("job_owner_{}", db.name)),
    )
    .unwrap();
    eventually(
        "the queue subscription to fan out",
        Duration::from_secs(30),
        || {
            (count(
                &mut c,
                "SELECT count(*) FROM outbox.jobs WHERE queue = 'ext'",
            ) == 5)
                .then_some(())
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM effects"),
        0,
        "paused: no fan-out, no runs"
    );
    c.batch_execute("SELECT outbox.resume_subscription('apply')")
        .unwrap();
    eventually(
        "the resumed subscription to run",
        Duration::from_secs(30),
        || (count(&mut c, "SELECT count(*) FROM effects") == 5).then_some(()),
    );
    c.batch_execute(
        "SELECT outbox.pause_subscription('apply');
         SELECT outbox.raise('t', '{\"n\": 6}');",
    )
    .unwrap();
    c.batch_execute("SELECT outbox.unsubscribe('apply'); SELECT outbox.unsubscribe('ext')")
        .unwrap();
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.jobs WHERE handler IS NOT NULL"
        ),
        0
    );
    assert!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.jobs WHERE queue = 'ext'"
        ) >= 5,
        "jobs queued for external workers stay"
    );
}

/// Records every job row written (by a trigger the test puts on outbox.jobs): which
/// subscription's matches were queued as jobs rather than run in the pass that found them.
const WRITTEN: &str = "
    CREATE TABLE written (subscription text);
    CREATE FUNCTION note_written() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN INSERT INTO public.written VALUES (NEW.subscription); RETURN NULL; END $$;
    CREATE TRIGGER note_written AFTER INSERT ON outbox.jobs FOR EACH ROW EXECUTE FUNCTION note_written();";

/// A database with EFFECTS (its handler owned by a role of its own, returned) and WRITTEN.
fn effects_db(label: &str) -> (pg_outbox_tests::TestDb, Client, String) {
    let db = worker_db(label);
    let mut c = db.connect();
    let owner = format!("job_owner_{}", db.name);
    c.batch_execute(&EFFECTS.replace("job_owner", &owner))
        .unwrap();
    c.batch_execute(WRITTEN).unwrap();
    (db, c, owner)
}

#[test]
fn a_handler_runs_its_matches_in_the_pass_that_finds_them_and_only_failures_become_jobs() {
    let (_db, mut c, owner) = effects_db("sub_inline");
    // A second handler at the same cursor (one pass serves both), which never fails.
    c.batch_execute(&format!(
        "CREATE FUNCTION apply_twin(e outbox.event) RETURNS void LANGUAGE sql AS
           $$ INSERT INTO effects (n) VALUES (1000000 + (e.payload->>'n')::int8) $$;
         ALTER FUNCTION apply_twin(outbox.event) OWNER TO {owner};
         SET ROLE {owner};
         SELECT outbox.subscribe('apply', '{{work.*}}', handler => 'apply_event(outbox.event)',
                                 filter => 'payload.n >= 0');
         SELECT outbox.subscribe('twin', '{{work.*}}', handler => 'apply_twin(outbox.event)');
         RESET ROLE;"
    ))
    .unwrap();
    // 1,000 events in one transaction (one window and a bit), interleaved with others; every 97th
    // fails in `apply` while flaky is on.
    c.batch_execute(
        "BEGIN;
         SELECT outbox.raise(CASE WHEN n % 10 = 0 THEN 'other' ELSE 'work.item' END,
                             jsonb_build_object('n', n)) FROM generate_series(1, 1111) n;
         COMMIT;",
    )
    .unwrap();
    let work = (1..=1111).filter(|n| n % 10 != 0).count() as i64;
    let flaky = (1..=1111).filter(|n| n % 10 != 0 && n % 97 == 0).count() as i64;
    eventually("the twin's matches to run", Duration::from_secs(60), || {
        (count(&mut c, "SELECT count(*) FROM effects WHERE n > 1000000") == work).then_some(())
    });
    eventually(
        "the rest of apply's matches to run, its failures to retry",
        Duration::from_secs(60),
        || {
            let ran = count(&mut c, "SELECT count(*) FROM effects WHERE n < 1000000");
            let retrying = count(
                &mut c,
                "SELECT count(*) FROM outbox.jobs WHERE subscription = 'apply' AND attempts > 0",
            );
            (ran == work - flaky && retrying == flaky).then_some(())
        },
    );
    // The twin wrote no job at all; apply wrote its failures as jobs, and with them the rest of
    // the batch each failure was in, but not every match.
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM written WHERE subscription = 'twin'"
        ),
        0,
        "matches that ran in the pass are never written as jobs"
    );
    let queued = count(
        &mut c,
        "SELECT count(*) FROM written WHERE subscription = 'apply'",
    );
    assert!(
        (flaky..work).contains(&queued),
        "{queued} of {work} matches queued"
    );
    c.batch_execute("UPDATE flaky SET on_ = false").unwrap();
    eventually("every job to run", Duration::from_secs(60), || {
        (count(&mut c, "SELECT count(*) FROM outbox.jobs") == 0).then_some(())
    });
    let row = c
        .query_one(
            "SELECT count(*), count(DISTINCT n), bool_and(by_role = $1) FROM effects",
            &[&owner],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 2 * work, "each effect exactly once");
    assert_eq!(row.get::<_, i64>(1), 2 * work);
    assert!(row.get::<_, bool>(2), "the handlers run as their owner");
}

#[test]
fn a_handlers_backlog_runs_several_windows_to_a_commit_and_writes_no_job() {
    let (_db, mut c, owner) = effects_db("sub_inline_windows");
    c.batch_execute(&format!(
        "UPDATE flaky SET on_ = false;
         -- The transaction each effect committed in (a handler call's subtransaction is its xmin).
         ALTER TABLE effects ADD COLUMN tx xid8 DEFAULT pg_current_xact_id();
         SET ROLE {owner};
         SELECT outbox.subscribe('apply', '{{work.*}}', handler => 'apply_event(outbox.event)');
         RESET ROLE;
         SELECT outbox.pause_subscription('apply');"
    ))
    .unwrap();
    // Three windows of a fan-out pass with a handler (1,000 events each), waiting; a tenth of
    // them match, so that the handler's calls for a window take a small part of what a pass may
    // spend on them, on a slow machine too (every event matching, they took over a third).
    c.batch_execute(
        "SELECT outbox.raise(CASE WHEN n % 10 = 0 THEN 'work.item' ELSE 'other' END, \
                             jsonb_build_object('n', n)) \
           FROM generate_series(1, 3000) n",
    )
    .unwrap();
    c.batch_execute("SELECT outbox.resume_subscription('apply')")
        .unwrap();
    eventually("the backlog to run", Duration::from_secs(120), || {
        (count(&mut c, "SELECT count(*) FROM effects") >= 300).then_some(())
    });
    caught_up(&mut c);
    let row = c
        .query_one(
            "SELECT count(*), count(DISTINCT n), count(DISTINCT tx) FROM effects",
            &[],
        )
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, i64>(1)),
        (300, 300),
        "each effect exactly once"
    );
    // A pass reads on while its handler has the calls and time for another window: the three
    // windows commit in fewer transactions than one a window.
    let commits: i64 = row.get(2);
    assert!(commits < 3, "3 windows took {commits} commits");
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM written"),
        0,
        "no match is written as a job while the pass has the time for it"
    );
}

#[test]
fn a_handler_that_overruns_the_pass_is_cut_off_and_its_matches_are_queued() {
    let (_db, mut c, owner) = effects_db("sub_inline_slow");
    // Two subscriptions in one pass: a fast handler, and one that takes 10 ms an event (a call
    // of 16 overruns the pass's 100 ms).
    c.batch_execute(&format!(
        "CREATE FUNCTION apply_slowly(e outbox.event) RETURNS void LANGUAGE sql AS
           $$ SELECT pg_sleep(0.01); INSERT INTO effects (n) VALUES ((e.payload->>'n')::int8) $$;
         CREATE FUNCTION apply_fast(e outbox.event) RETURNS void LANGUAGE sql AS
           $$ INSERT INTO effects (n) VALUES (1000000 + (e.payload->>'n')::int8) $$;
         ALTER FUNCTION apply_slowly(outbox.event) OWNER TO {owner};
         ALTER FUNCTION apply_fast(outbox.event) OWNER TO {owner};
         SET ROLE {owner};
         SELECT outbox.subscribe('fast', NULL, handler => 'apply_fast(outbox.event)');
         SELECT outbox.subscribe('slow', NULL, handler => 'apply_slowly(outbox.event)');
         RESET ROLE;"
    ))
    .unwrap();
    let started = std::time::Instant::now();
    c.batch_execute(
        "SELECT outbox.raise('t', jsonb_build_object('n', n)) FROM generate_series(1, 200) n",
    )
    .unwrap();
    eventually(
        "the fast handler's matches to run",
        Duration::from_secs(30),
        || (count(&mut c, "SELECT count(*) FROM effects WHERE n > 1000000") == 200).then_some(()),
    );
    // Not held behind the slow one's 2 s of work.
    let fast = started.elapsed();
    eventually(
        "the slow handler's matches to run",
        Duration::from_secs(60),
        || (count(&mut c, "SELECT count(*) FROM effects WHERE n < 1000000") == 200).then_some(()),
    );
    assert!(fast < Duration::from_millis(1500), "{fast:?}");
    assert_eq!(count(&mut c, "SELECT count(DISTINCT n) FROM effects"), 400);
    // The slow handler's call was cancelled at the pass's time and its matches queued, for the
    // job runners of every worker (each call under sink_timeout); the fast one's ran at once.
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM written WHERE subscription = 'slow'"
        ),
        200
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM written WHERE subscription = 'fast'"
        ),
        0
    );
    eventually("the jobs to be gone", Duration::from_secs(30), || {
        (count(&mut c, "SELECT count(*) FROM outbox.jobs") == 0).then_some(())
    });
}

#[test]
fn a_rewound_handler_does_not_run_an_event_whose_job_still_waits() {
    let (_db, mut c, owner) = effects_db("sub_inline_rewind");
    c.batch_execute(&format!("SET ROLE {owner}")).unwrap();
    let start: String = c
        .query_one(
            "SELECT outbox.subscribe('apply', NULL, handler => 'apply_event(outbox.event)', max_attempts => 100)",
            &[],
        )
        .unwrap()
        .get(0);
    c.batch_execute("RESET ROLE; SELECT outbox.raise('t', jsonb_build_object('n', n)) FROM generate_series(1, 200) n")
        .unwrap();
    // 97 and 194 fail while flaky is on: their jobs wait for a retry.
    eventually(
        "the others to run, two jobs to wait",
        Duration::from_secs(30),
        || {
            let ran = count(&mut c, "SELECT count(*) FROM effects");
            let waiting = count(
                &mut c,
                "SELECT count(*) FROM outbox.jobs WHERE attempts > 0 AND state = 'waiting'",
            );
            (ran == 198 && waiting == 2).then_some(())
        },
    );
    // Their retries held back; the dependency mended; the subscription rewound to its start: the
    // pass runs every event again but those two, whose jobs still wait.
    c.batch_execute(
        "UPDATE outbox.jobs SET run_at = now() + interval '1 hour'; UPDATE flaky SET on_ = false",
    )
    .unwrap();
    c.query_one("SELECT outbox.rewind('apply', $1)", &[&start])
        .unwrap();
    eventually(
        "the rewound pass to run again",
        Duration::from_secs(30),
        || (count(&mut c, "SELECT count(*) FROM effects") == 2 * 198).then_some(()),
    );
    caught_up(&mut c);
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM effects WHERE n IN (97, 194)"),
        0,
        "an event whose job waits is left to its job"
    );
    c.batch_execute("UPDATE outbox.jobs SET run_at = now()")
        .unwrap();
    eventually("the two jobs to run", Duration::from_secs(30), || {
        (count(&mut c, "SELECT count(*) FROM outbox.jobs") == 0).then_some(())
    });
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM effects WHERE n IN (97, 194)"),
        2,
        "once each"
    );
}

#[test]
fn subscriptions_behind_one_another_read_one_window_and_a_rewind_queues_nothing_twice() {
    let db = worker_db("sub_together");
    let mut c = db.connect();
    let start: String = c
        .query_one(
            "SELECT outbox.subscribe('early', NULL, queue => 'q_early')",
            &[],
        )
        .unwrap()
        .get(0);
    c.batch_execute(
        "SELECT outbox.subscribe('late', NULL, queue => 'q_late', filter => 'payload.n % 2 == 0');
         SELECT outbox.pause_subscription('late');
         SELECT outbox.raise('t', jsonb_build_object('n', n)) FROM generate_series(1, 2500) n;",
    )
    .unwrap();
    eventually("early to read 2500", Duration::from_secs(30), || {
        (count(
            &mut c,
            "SELECT count(*) FROM outbox.jobs WHERE queue = 'q_early'",
        ) == 2500)
            .then_some(())
    });
    // late resumes 2,500 events (two and a half windows) behind early: it reads on in the pass
    // until its window reaches early's cursor, and early takes from that window only the events
    // past its own.
    c.batch_execute(
        "SELECT outbox.resume_subscription('late');
         SELECT outbox.raise('t', jsonb_build_object('n', n)) FROM generate_series(2501, 2700) n;",
    )
    .unwrap();
    caught_up(&mut c);
    assert_eq!(queued(&mut c, "q_early"), (1..=2700).collect());
    assert_eq!(
        queued(&mut c, "q_late"),
        (1..=2700).filter(|n| n % 2 == 0).collect()
    );
    // Every event evaluated once per subscription: a job waiting already would hide a second
    // evaluation from the queue, not from the counts.
    assert_eq!(
        count(
            &mut c,
            "SELECT matched + skipped FROM outbox.subscriptions WHERE name = 'early'"
        ),
        2700
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT matched + skipped FROM outbox.subscriptions WHERE name = 'late'"
        ),
        2700
    );
    // Both at one cursor now: one window for both.
    assert_eq!(
        count(
            &mut c,
            "SELECT count(DISTINCT (txid, seq)) FROM outbox.consumers WHERE kind = 'subscription'"
        ),
        1
    );
    // Jobs of 1..100 done; early rewound to its start: those are queued again, the 2,600 that
    // still wait are not queued twice, and the pass that met them goes through.
    c.batch_execute(
        "DELETE FROM outbox.jobs WHERE queue = 'q_early' AND (payload->'payload'->>'n')::int <= 100",
    )
    .unwrap();
    c.query_one("SELECT outbox.rewind('early', $1)", &[&start])
        .unwrap();
    eventually("the rewound pass", Duration::from_secs(30), || {
        (count(
            &mut c,
            "SELECT count(*) FROM outbox.jobs WHERE queue = 'q_early'",
        ) == 2700)
            .then_some(())
    });
    caught_up(&mut c);
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.jobs WHERE queue = 'q_early'"
        ),
        2700,
        "none twice"
    );
    assert_eq!(queued(&mut c, "q_early"), (1..=2700).collect());
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.subscriptions WHERE last_predicate_error IS NOT NULL"
        ),
        0
    );
}

#[test]
fn filters_see_the_fields_they_select_as_they_would_see_the_whole_payload() {
    let db = worker_db("sub_fields");
    let mut c = db.connect();
    // Each predicate holds for the one event below, read field by field from the stored jsonb
    // (a filter that selects fields by name) or whole (one that does not): the same values.
    let predicates = [
        // int + int, double + double: a mix has no overload, so these tell the two apart.
        "payload.i + 1 == 4",
        "payload.neg + 1 == -6",
        "payload.f + 0.5 == 2.0",
        // jsonb keeps 2.0 as written: a double, as the text of the whole payload says.
        "payload.two + 0.5 == 2.5",
        "payload.big + 0.5 > 1e29",
        r#"payload.s == "é \"q\" \\ \n""#,
        r#"payload.o.k == "v" && payload.o.n[1] == 2"#,
        "payload.a[2] == 3 && size(payload.a) == 3",
        "payload.z == null && payload.b == true",
        "!has(payload.missing) && has(payload.other)",
        r#"headers.trace == "t-1""#,
        // Whole: size of the payload, its keys.
        r#"size(payload) == 11 && "i" in payload"#,
    ];
    for (i, p) in predicates.iter().enumerate() {
        c.execute(
            "SELECT outbox.subscribe($1, NULL, queue => 'fields', filter => $2)",
            &[&format!("p{i}"), p],
        )
        .unwrap();
    }
    c.batch_execute(
        r#"SELECT outbox.raise('t', '{"i": 3, "neg": -7, "f": 1.5, "two": 2.0, "big": 1e30,
                                      "s": "é \"q\" \\ \n", "o": {"k": "v", "n": [1, 2]},
                                      "a": [1, 2, 3], "z": null, "b": true, "other": "x"}',
                                headers => '{"trace": "t-1"}');
           SELECT outbox.raise('t', '{"i": 4}');"#,
    )
    .unwrap();
    caught_up(&mut c);
    let rows = c
        .query(
            "SELECT name, matched, skipped, predicate_errors, last_predicate_error FROM outbox.subscriptions ORDER BY name",
            &[],
        )
        .unwrap();
    assert_eq!(rows.len(), predicates.len());
    for r in rows {
        let name: String = r.get(0);
        let p = predicates[name[1..].parse::<usize>().unwrap()];
        let (matched, skipped, errors): (i64, i64, i64) = (r.get(1), r.get(2), r.get(3));
        let error: Option<String> = r.get(4);
        // The second event lacks the fields: false or an error, never a match.
        assert_eq!((matched, skipped + errors), (1, 1), "{p}: {error:?}");
    }
}

#[test]
fn the_native_evaluator_and_cel_agree_on_every_stored_value() {
    let db = worker_db("sub_native");
    let mut c = db.connect();
    // Each predicate twice: as written (decided natively where it can be) and joined with a
    // test CEL alone evaluates (so the whole filter is CEL's): the same events must match, and
    // as many must fail.
    let predicates = [
        "payload.v == 1",
        "payload.v > 1",
        "payload.v >= 1.0",
        "payload.v < 1e19",
        "payload.v == 15",
        "payload.v == 20000",
        "payload.v < -9223372036854775807",
        "payload.v == 18446744073709551615.0",
        r#"payload.v == "1""#,
        r#"payload.v >= "é""#,
        "payload.v == null",
        "payload.v != false",
        "payload.v",
        "!payload.v",
        "has(payload.v)",
        r#"payload.v in [1, "é", true, null]"#,
        r#"tenant == "acme" || payload.v > 0"#,
        "tenant != null && payload.v <= 2.5",
        r#"payload.v != "é" && headers.h == 1"#,
        r#"subject == null || topic < "u""#,
        "false && payload.v > 0",
        "payload.v > 0 && false",
        // Text that only looks like a macro binding payload (once a worker's failed assertion,
        // at every pass, for a field no other filter of the window selects).
        r#"payload.zzz == "exists(payload, x" || payload.v == 1"#,
    ];
    for (i, p) in predicates.iter().enumerate() {
        for (kind, filter) in [
            ("n", p.to_string()),
            ("c", format!(r#"({p}) && size("") == 0"#)),
        ] {
            c.execute(
                "SELECT outbox.subscribe($1, NULL, queue => $1, filter => $2)",
                &[&format!("{kind}{i}"), &filter],
            )
            .unwrap();
        }
    }
    let values = [
        "1",
        "1.0",
        "-0",
        "2.5",
        "0.1",
        "9223372036854775807",
        "9223372036854775808",
        "18446744073709551615",
        "1e30",
        "123456789012345678901234567890.5",
        // Integers read from their digits (the fast path), and its edges.
        "-1",
        "0",
        "10000",
        "100000000",
        "2e4",
        "1.5e1",
        "-9223372036854775808",
        "-9223372036854775809",
        "99999999999999999999",
        r#""1""#,
        r#""é""#,
        r#""""#,
        "null",
        "true",
        "false",
        "[1]",
        r#"{"a": 1}"#,
    ];
    for (n, v) in values.iter().enumerate() {
        for (tenant, subject) in [(Some("acme"), None), (None, Some("s"))] {
            let n = 2 * n as i64 + i64::from(tenant.is_none());
            c.execute(
                "SELECT outbox.raise('t', jsonb_build_object('n', $1::int8, 'v', $2::text::jsonb),
                                     headers => $3::text::jsonb, tenant => $4, subject => $5)",
                &[&n, v, &format!(r#"{{"h": {v}}}"#), &tenant, &subject],
            )
            .unwrap();
        }
    }
    c.execute(
        "SELECT outbox.raise('u', '{\"n\": 100}', headers => '{}')",
        &[],
    )
    .unwrap();
    caught_up(&mut c);
    let counts = |c: &mut Client, name: &str| -> (i64, i64, i64) {
        let r = c
            .query_one(
                "SELECT matched, skipped, predicate_errors FROM outbox.subscriptions WHERE name = $1",
                &[&name],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    let mut matched_somewhere = 0;
    for (i, p) in predicates.iter().enumerate() {
        let (native, cel) = (format!("n{i}"), format!("c{i}"));
        let (n, c_) = (counts(&mut c, &native), counts(&mut c, &cel));
        assert_eq!(n, c_, "{p}: (matched, skipped, errors)");
        assert_eq!(n.0 + n.1 + n.2, 2 * values.len() as i64 + 1, "{p}");
        assert_eq!(queued(&mut c, &native), queued(&mut c, &cel), "{p}");
        matched_somewhere += i64::from(n.0 > 0);
    }
    // The predicates are not vacuous: most match some event.
    assert!(
        matched_somewhere >= predicates.len() as i64 - 3,
        "{matched_somewhere}"
    );
}
