//! The worker's lifecycle: it leaves a database being dropped, idles while the installed SQL does
//! not match the binary, and features that need it refuse clearly when pg_outbox is not preloaded.

use pg_outbox_tests::{eventually, sqlstate, test_db, worker_db, Cluster};
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
