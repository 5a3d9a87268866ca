//! The worker's lifecycle: it leaves a database being dropped, idles while the installed SQL does
//! not match the binary, and features that need it refuse clearly when pg_outbox is not preloaded.

use pg_outbox_tests::{eventually, read, sqlstate, test_db, worker_db, Cluster};
use std::time::{Duration, Instant};

#[test]
fn drop_database_succeeds_while_the_workers_are_connected_to_it() {
    let db = worker_db("drop_db");
    let mut c = db.connect();
    c.batch_execute(
        "CREATE TABLE slow_ledger (pos text);
         CREATE FUNCTION slow(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$
           BEGIN PERFORM pg_sleep(20); INSERT INTO slow_ledger SELECT e.position FROM unnest(events) e; END $$;
         SELECT outbox.create_sink('slow', 'slow(outbox.event[])');
         SELECT outbox.raise('x.y');",
    )
    .unwrap();
    // A worker is inside the 20 s handler when the database is dropped.
    eventually(
        "a worker in the slow handler",
        Duration::from_secs(10),
        || {
            let n: i64 = c
            .query_one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker' AND wait_event = 'PgSleep'", &[])
            .unwrap()
            .get(0);
            (n == 1).then_some(())
        },
    );
    drop(c);
    let mut admin = db.cluster().connect("postgres", "postgres");
    let start = Instant::now();
    admin
        .batch_execute(&format!("DROP DATABASE \"{}\"", db.name))
        .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "DROP DATABASE took {:?}",
        start.elapsed()
    );
}

#[test]
fn the_worker_idles_while_the_installed_sql_is_another_version() {
    let db = worker_db("version");
    let mut c = db.connect();
    c.batch_execute(
        "CREATE TABLE ledger (pos text);
         CREATE FUNCTION rec(events outbox.event[]) RETURNS void LANGUAGE sql AS
           $$ INSERT INTO public.ledger SELECT e.position FROM unnest(events) e $$;
         SELECT outbox.create_sink('rec', 'rec(outbox.event[])');
         UPDATE pg_extension SET extversion = '0.0.1' WHERE extname = 'pg_outbox';
         SELECT outbox.raise('x.y');",
    )
    .unwrap();
    eventually("the idle warning", Duration::from_secs(10), || {
        db.cluster()
            .log()
            .contains("the installed SQL is version 0.0.1")
            .then_some(())
    });
    let n: i64 = c
        .query_one("SELECT count(*) FROM ledger", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "nothing delivered against SQL of another version");
    let pids = db.cluster().worker_pids();
    assert!(!pids.is_empty(), "idle, not exited");
    // The version this binary was built as: the installed control file's.
    c.batch_execute(
        "UPDATE pg_extension SET extversion = (SELECT default_version FROM pg_available_extensions                                                 WHERE name = 'pg_outbox')           WHERE extname = 'pg_outbox'",
    )
    .unwrap();
    eventually(
        "delivery once the versions match",
        Duration::from_secs(10),
        || {
            let n: i64 = c
                .query_one("SELECT count(*) FROM ledger", &[])
                .unwrap()
                .get(0);
            (n == 1).then_some(())
        },
    );
    assert_eq!(db.cluster().worker_pids(), pids);
}

#[test]
fn without_preloading_the_worker_features_refuse_with_a_hint_and_raise_still_works() {
    // Holds the shared cluster's test lock too, so the two clusters do not compete for the cores.
    let _serial = test_db("nopreload_guard");
    let cluster = Cluster::start_with("pg_outbox_nopreload", &["shared_preload_libraries = ''"]);
    let result = std::panic::catch_unwind(|| {
        let mut admin = cluster.connect("postgres", "postgres");
        admin.batch_execute("CREATE DATABASE app").unwrap();
        let mut c = cluster.connect("app", "postgres");
        c.batch_execute(
            "CREATE EXTENSION pg_outbox;
             CREATE FUNCTION h(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ SELECT $$;",
        )
        .unwrap();
        for sql in [
            "SELECT outbox.create_sink('s', 'h(outbox.event[])')",
            "SELECT outbox.wake()",
            "SELECT * FROM outbox.workers()",
        ] {
            assert_eq!(sqlstate(&mut c, sql), "55000", "{sql}");
        }
        let hint = match c.batch_execute("SELECT outbox.wake()") {
            Err(e) => e
                .as_db_error()
                .and_then(|d| d.hint().map(str::to_string))
                .unwrap_or_default(),
            Ok(()) => String::new(),
        };
        assert!(hint.contains("shared_preload_libraries"), "{hint}");
        c.batch_execute("SELECT outbox.create_consumer('r'); SELECT outbox.raise('still.works')")
            .unwrap();
        let n: i64 = c
            .query_one("SELECT count(*) FROM outbox.read('r')", &[])
            .unwrap()
            .get(0);
        assert_eq!(n, 1);
    });
    cluster.stop();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

#[test]
fn the_workers_show_in_pg_stat_activity_what_they_are_doing() {
    let db = worker_db("activity");
    let mut c = db.connect();
    c.batch_execute(
        "CREATE FUNCTION public.slow(e outbox.event[]) RETURNS void LANGUAGE sql AS
           $$ SELECT pg_sleep(3) $$;
         SELECT outbox.create_sink('slow', 'public.slow(outbox.event[])');
         SELECT outbox.raise('x.y');",
    )
    .unwrap();
    let (app, state) = eventually(
        "a worker to show the sink it delivers to",
        Duration::from_secs(10),
        || {
            c.query(
                "SELECT application_name, state FROM pg_stat_activity \
                  WHERE backend_type = 'pg_outbox worker' \
                    AND query = 'pg_outbox: sink \"slow\": delivering a batch'",
                &[],
            )
            .unwrap()
            .first()
            .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
        },
    );
    assert!(app.starts_with("pg_outbox worker "), "{app}");
    assert_eq!(state, "active");
    // Every worker is named, busy or not.
    let (named, all): (i64, i64) = c
        .query_one(
            "SELECT count(*) FILTER (WHERE application_name LIKE 'pg_outbox worker %'), count(*) \
               FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker'",
            &[],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert!(all >= 1);
    assert_eq!(named, all);
}

/// Waits (10 s at most) until `done`, then asserts that it took less than `limit` since `start`:
/// a delivery the commit's wake-up made, not the poll (1 s).
fn promptly(what: &str, start: Instant, limit: Duration, mut done: impl FnMut() -> bool) {
    eventually(what, Duration::from_secs(10), || done().then_some(()));
    assert!(start.elapsed() < limit, "{what} took {:?}", start.elapsed());
}

/// A commit wakes the workers only when a sink or subscription there reads a topic it raised:
/// raising topics nobody reads costs no round per commit (each round passes every due sink).
#[test]
fn commits_raising_only_topics_nobody_reads_wake_nobody() {
    let db = worker_db("interest");
    let mut c = db.connect();
    c.batch_execute(
        "CREATE TABLE ledger (pos text, topic text);
         CREATE FUNCTION rec(events outbox.event[]) RETURNS void LANGUAGE sql AS
           $$ INSERT INTO public.ledger SELECT e.position, e.topic FROM unnest(events) e $$;
         SELECT outbox.create_sink('rec', 'rec(outbox.event[])', topics => ARRAY['order.#']);",
    )
    .unwrap();
    let ledger = |c: &mut postgres::Client| -> i64 {
        c.query_one("SELECT count(*) FROM ledger", &[])
            .unwrap()
            .get(0)
    };
    let passes = |c: &mut postgres::Client| -> i64 {
        c.query_one(
            "SELECT coalesce(sum(passes), 0)::int8 FROM outbox.workers()",
            &[],
        )
        .unwrap()
        .get(0)
    };
    // The workers have seen the sink: a read topic is delivered at its commit.
    c.batch_execute("SELECT outbox.raise('order.placed')")
        .unwrap();
    eventually("the first delivery", Duration::from_secs(10), || {
        (ledger(&mut c) == 1).then_some(())
    });
    c.batch_execute("SELECT outbox.create_consumer('audit', start_at => 'now')")
        .unwrap();

    // 200 commits of a topic only a pull consumer reads, 2 ms apart: a round each would pass
    // the sink 200 times; without wake-ups the workers go round on their poll (1 s).
    let before = passes(&mut c);
    let start = Instant::now();
    for i in 0..200 {
        c.execute(
            "SELECT outbox.raise('audit.read', jsonb_build_object('i', $1::int4))",
            &[&i],
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let took = start.elapsed();
    let unread = passes(&mut c) - before;
    // Two workers polling, and their short re-checks while events wait behind the horizon.
    let polls = 4 * (took.as_secs() as i64 + 2);
    assert!(
        unread <= polls,
        "200 commits of an unread topic in {took:?} made {unread} passes"
    );
    assert_eq!(
        read(&mut c, "audit", 1000).len(),
        200,
        "the consumer reads them"
    );

    // A read topic still wakes them at each commit: delivered long before a poll would.
    for i in 0..5 {
        let start = Instant::now();
        c.execute(
            "SELECT outbox.raise('order.paid', jsonb_build_object('i', $1::int4))",
            &[&i],
        )
        .unwrap();
        promptly(
            "delivery of a read topic",
            start,
            Duration::from_millis(500),
            || ledger(&mut c) == 2 + i as i64,
        );
    }

    // A prepared transaction woke nobody when it prepared: COMMIT PREPARED does (five times,
    // so that a poll cannot pass for it by chance).
    let mut preparer = db.connect();
    let mut manager = db.connect();
    // The pauses of 1.1 s before each timed commit (here and below) are not waits for the
    // server: they let the rounds an earlier commit started end, so that only this commit's
    // wake-up, or the poll, can deliver what it raised.
    let mut delivered = ledger(&mut c);
    for round in 0..5 {
        preparer
            .batch_execute(&format!(
                "BEGIN; SELECT outbox.raise('order.prepared'); PREPARE TRANSACTION 'interest-{round}'"
            ))
            .unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        let start = Instant::now();
        // From another session, as a transaction manager would.
        manager
            .batch_execute(&format!("COMMIT PREPARED 'interest-{round}'"))
            .unwrap();
        delivered += 1;
        promptly(
            "delivery after COMMIT PREPARED",
            start,
            Duration::from_millis(200),
            || ledger(&mut c) == delivered,
        );
    }

    // A sink created while another transaction that raised is open: that transaction's commit
    // wakes the workers after all, and the new sink gets the event at once (three times).
    for round in 0..3 {
        c.batch_execute(&format!(
            "CREATE TABLE late_{round} (pos text);
             CREATE FUNCTION late_{round}(events outbox.event[]) RETURNS void LANGUAGE sql AS
               $$ INSERT INTO public.late_{round} SELECT e.position FROM unnest(events) e $$;"
        ))
        .unwrap();
        let mut raiser = db.connect();
        raiser
            .batch_execute(&format!("BEGIN; SELECT outbox.raise('late.r{round}')"))
            .unwrap();
        c.batch_execute(&format!(
            "SELECT outbox.create_sink('late_{round}', 'late_{round}(outbox.event[])', \
                                       topics => ARRAY['late.r{round}'], start_at => 'now')"
        ))
        .unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        let start = Instant::now();
        raiser.batch_execute("COMMIT").unwrap();
        promptly(
            "the late sink's delivery",
            start,
            Duration::from_millis(300),
            || {
                let n: i64 = c
                    .query_one(&format!("SELECT count(*) FROM late_{round}"), &[])
                    .unwrap()
                    .get(0);
                n == 1
            },
        );
    }

    // A backend that raised while no worker served the database (the workers restarting) looks
    // again once one does: its later commits wake it. (With a sink that reads every topic the
    // workers publish what a new worker starts with: nothing else tells the backend to look.)
    c.batch_execute(
        "CREATE TABLE everything (pos text);
         CREATE FUNCTION everything(events outbox.event[]) RETURNS void LANGUAGE sql AS
           $$ INSERT INTO public.everything SELECT e.position FROM unnest(events) e $$;
         SELECT outbox.create_sink('everything', 'everything(outbox.event[])', start_at => 'now');",
    )
    .unwrap();
    let mut pooled = db.connect();
    db.cluster().set("pg_outbox.databases", "no_such_database");
    eventually("the workers to leave", Duration::from_secs(30), || {
        db.cluster().worker_pids().is_empty().then_some(())
    });
    pooled
        .batch_execute("SELECT outbox.raise('order.unserved')")
        .unwrap();
    db.cluster().set("pg_outbox.databases", &db.name);
    db.cluster().wait_for_workers(&db.name);
    delivered += 1;
    eventually(
        "the backlog after the restart",
        Duration::from_secs(10),
        || (ledger(&mut c) == delivered).then_some(()),
    );
    for round in 0..3 {
        std::thread::sleep(Duration::from_millis(1100));
        let start = Instant::now();
        pooled
            .batch_execute(&format!("SELECT outbox.raise('order.served.r{round}')"))
            .unwrap();
        delivered += 1;
        promptly(
            "delivery after the restart",
            start,
            Duration::from_millis(300),
            || ledger(&mut c) == delivered,
        );
    }
}
