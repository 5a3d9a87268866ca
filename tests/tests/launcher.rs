//! The launcher and elastic workers (issue #11, items 1 and 2): every database where pg_outbox is
//! installed gets delivery with no setting to edit, CREATE/DROP EXTENSION and DROP DATABASE start
//! and stop it, slow handlers get workers of their own up to `pg_outbox.max_workers`, and idle
//! extra workers leave.
//!
//! Each test starts a cluster of its own with the defaults (the shared test cluster restricts
//! delivery to one database at a time), one test at a time.

use pg_outbox_tests::postgres::Client;
use pg_outbox_tests::{eventually, Cluster};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `body` on a fresh cluster with `settings`, and stops it (printing its log on failure).
fn with_cluster(name: &str, settings: &[&str], body: impl FnOnce(&Cluster)) {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut all = vec!["fsync = off"];
    all.extend_from_slice(settings);
    let cluster = Cluster::start_with(name, &all);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&cluster)));
    let log = cluster.log();
    cluster.stop();
    if let Err(e) = result {
        eprintln!("server log:\n{log}");
        std::panic::resume_unwind(e);
    }
}

/// A recording handler `public.rec` and its table `got` (sink, event id, when it ran).
const RECORDER: &str = "
    CREATE TABLE got (sink text, id uuid, at timestamptz DEFAULT clock_timestamp());
    CREATE FUNCTION rec(events outbox.event[]) RETURNS void LANGUAGE sql AS
      $$ INSERT INTO public.got (sink, id) SELECT 'rec', e.id FROM unnest(events) e $$;
    CREATE FUNCTION slow(events outbox.event[]) RETURNS void LANGUAGE sql AS
      $$ SELECT pg_sleep(8); INSERT INTO public.got (sink, id) SELECT 'slow', e.id FROM unnest(events) e $$;";

fn workers_in(cluster: &Cluster, db: &str) -> Vec<i32> {
    cluster
        .connect("postgres", "postgres")
        .query(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker' AND datname = $1",
            &[&db],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn count(c: &mut Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).unwrap().get(0)
}

/// Creates pg_outbox, a recording sink and one event in `db`; returns how long the event took
/// from the commit of CREATE EXTENSION to its handler.
fn install_and_deliver(cluster: &Cluster, db: &str) -> Duration {
    let mut c = cluster.connect(db, "postgres");
    let start = Instant::now();
    c.batch_execute("CREATE EXTENSION pg_outbox").unwrap();
    c.batch_execute(RECORDER).unwrap();
    c.batch_execute(
        "SELECT outbox.create_sink('rec', 'rec(outbox.event[])'); SELECT outbox.raise('x.y');",
    )
    .unwrap();
    eventually(
        &format!("delivery in {db}"),
        Duration::from_secs(10),
        || (count(&mut c, "SELECT count(*) FROM got") == 1).then_some(()),
    );
    start.elapsed()
}

#[test]
fn every_database_with_pg_outbox_gets_delivery_and_create_drop_start_and_stop_it() {
    with_cluster("pg_outbox_launch", &[], |cluster| {
        let mut admin = cluster.connect("postgres", "postgres");
        for db in ["a", "b", "plain"] {
            admin
                .batch_execute(&format!("CREATE DATABASE {db}"))
                .unwrap();
        }
        // No setting names a database: CREATE EXTENSION is enough, in any of them.
        for db in ["a", "b"] {
            let took = install_and_deliver(cluster, db);
            assert!(
                took < Duration::from_secs(3),
                "delivery in {db} started {took:?} after CREATE EXTENSION"
            );
        }
        // A database without pg_outbox keeps no worker (the probe left).
        eventually("no worker in plain", Duration::from_secs(10), || {
            workers_in(cluster, "plain").is_empty().then_some(())
        });
        // Each database's workers() shows its own workers only.
        for db in ["a", "b"] {
            let mut c = cluster.connect(db, "postgres");
            let listed: Vec<i32> = c
                .query("SELECT pid FROM outbox.workers() ORDER BY pid", &[])
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            let mut connected = workers_in(cluster, db);
            connected.sort();
            assert!(!listed.is_empty(), "{db} has a worker");
            assert_eq!(
                listed, connected,
                "workers() in {db} lists that database's workers"
            );
        }
        // DROP EXTENSION: the workers leave and no other starts there.
        let mut a = cluster.connect("a", "postgres");
        a.batch_execute("DROP EXTENSION pg_outbox CASCADE").unwrap();
        eventually("a's workers to leave", Duration::from_secs(5), || {
            workers_in(cluster, "a").is_empty().then_some(())
        });
        std::thread::sleep(Duration::from_millis(1500));
        assert!(
            workers_in(cluster, "a").is_empty(),
            "none started again in a"
        );
        // ... and CREATE EXTENSION brings delivery back.
        a.batch_execute("DROP TABLE got").unwrap(); // the handlers went with the CASCADE
        drop(a);
        let took = install_and_deliver(cluster, "a");
        assert!(
            took < Duration::from_secs(3),
            "delivery in a again after {took:?}"
        );
        // CREATE DATABASE ... TEMPLATE a database with workers: they leave it for the copy, and the
        // copy (with pg_outbox in it) gets delivery too.
        let start = Instant::now();
        admin
            .batch_execute("CREATE DATABASE a_copy TEMPLATE a")
            .unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "CREATE DATABASE took {:?}",
            start.elapsed()
        );
        let mut copy = cluster.connect("a_copy", "postgres");
        copy.batch_execute("SELECT outbox.raise('x.y')").unwrap();
        eventually("delivery in the copy", Duration::from_secs(15), || {
            (count(&mut copy, "SELECT count(*) FROM got") == 2).then_some(())
        });
        eventually("a's workers back", Duration::from_secs(10), || {
            (!workers_in(cluster, "a").is_empty()).then_some(())
        });
        // A role that may not copy it cannot make the workers leave by trying.
        admin
            .batch_execute("CREATE ROLE copier LOGIN CREATEDB")
            .unwrap();
        let before = workers_in(cluster, "a");
        let mut copier = cluster.connect("postgres", "copier");
        assert!(copier
            .batch_execute("CREATE DATABASE stolen TEMPLATE a")
            .is_err());
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(workers_in(cluster, "a"), before, "the workers stayed");
        // DROP DATABASE goes through at once while its workers run, and the launcher does not
        // keep starting workers for a database that is gone.
        assert!(!workers_in(cluster, "b").is_empty());
        let start = Instant::now();
        admin.batch_execute("DROP DATABASE b").unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "DROP DATABASE took {:?}",
            start.elapsed()
        );
        std::thread::sleep(Duration::from_secs(4));
        let missing = cluster.log().matches("does not exist").count();
        assert!(missing <= 1, "{missing} workers tried the dropped database");
        // pg_outbox.databases restricts the set: a database left out loses its workers, and gets
        // them back when it is named.
        cluster.set("pg_outbox.databases", "plain");
        eventually("a's workers to leave", Duration::from_secs(5), || {
            workers_in(cluster, "a").is_empty().then_some(())
        });
        cluster.set("pg_outbox.databases", "plain, a");
        let mut a = cluster.connect("a", "postgres");
        a.batch_execute("SELECT outbox.raise('x.y')").unwrap();
        eventually("delivery in a once named", Duration::from_secs(10), || {
            (count(&mut a, "SELECT count(*) FROM got") == 2).then_some(())
        });
        assert!(
            !cluster.log().contains("pg_outbox worker 0 is idle"),
            "no worker waited in a database without pg_outbox"
        );
    });
}

#[test]
fn a_max_worker_processes_too_small_for_the_workers_is_reported_at_start() {
    with_cluster(
        "pg_outbox_sizing",
        &["max_worker_processes = 3", "pg_outbox.max_workers = 4"],
        |cluster| {
            eventually("the sizing warning", Duration::from_secs(10), || {
                cluster
                    .log()
                    .contains("max_worker_processes = 3 is too small for pg_outbox.max_workers = 4")
                    .then_some(())
            });
        },
    );
}

/// The time from the commit of the event raised on `topic` to its handler, with `slow` slow sinks
/// already inside their handlers.
fn delay_behind_slow_sinks(c: &mut Client, slow: usize) -> Duration {
    for i in 0..slow {
        c.batch_execute(&format!("SELECT outbox.raise('slow{i}')"))
            .unwrap();
    }
    eventually("the slow handlers to run", Duration::from_secs(10), || {
        let n = count(
            c,
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker' AND wait_event = 'PgSleep'",
        );
        (n == slow as i64).then_some(())
    });
    c.batch_execute(
        "CREATE TEMP TABLE t0 AS SELECT clock_timestamp() AS at; SELECT outbox.raise('fast');",
    )
    .unwrap();
    let ms: f64 = eventually("the fast event", Duration::from_secs(30), || {
        c.query_opt(
            "SELECT extract(epoch FROM g.at - t0.at)::float8 * 1000 FROM got g, t0 WHERE g.sink = 'rec'",
            &[],
        )
        .unwrap()
        .map(|r| r.get(0))
    });
    c.batch_execute("DROP TABLE t0; DELETE FROM got").unwrap();
    Duration::from_micros((ms * 1000.0) as u64)
}

#[test]
fn slow_handlers_get_workers_of_their_own_up_to_max_workers_and_idle_extras_leave() {
    with_cluster("pg_outbox_elastic", &[], |cluster| {
        let mut admin = cluster.connect("postgres", "postgres");
        admin.batch_execute("CREATE DATABASE app").unwrap();
        let mut c = cluster.connect("app", "postgres");
        c.batch_execute("CREATE EXTENSION pg_outbox").unwrap();
        c.batch_execute(RECORDER).unwrap();
        c.batch_execute(
            "SELECT outbox.create_sink('slow0', 'slow(outbox.event[])', topics => '{slow0}');
             SELECT outbox.create_sink('slow1', 'slow(outbox.event[])', topics => '{slow1}');
             SELECT outbox.create_sink('slow2', 'slow(outbox.event[])', topics => '{slow2}');
             SELECT outbox.create_sink('rec', 'rec(outbox.event[])', topics => '{fast}');",
        )
        .unwrap();
        eventually("the minimum of one worker", Duration::from_secs(10), || {
            (workers_in(cluster, "app").len() == 1).then_some(())
        });
        // Three handlers of 8 s; the defaults (one worker at least, four at most) allow four.
        let delay = delay_behind_slow_sinks(&mut c, 3);
        assert!(
            delay < Duration::from_millis(1500),
            "three slow sinks delayed another by {delay:?}"
        );
        // Once the slow handlers are done, the extra workers find nothing to do and leave.
        eventually(
            "the extra workers to leave",
            Duration::from_secs(40),
            || (workers_in(cluster, "app").len() == 1).then_some(()),
        );

        // At the cap, what waits says so, and goes through once a handler returns.
        cluster.set("pg_outbox.max_workers", "2");
        for i in 0..2 {
            c.batch_execute(&format!("SELECT outbox.raise('slow{i}')"))
                .unwrap();
        }
        eventually(
            "both slow handlers running",
            Duration::from_secs(10),
            || {
                let n = count(
                &mut c,
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker' AND wait_event = 'PgSleep'",
            );
                (n == 2).then_some(())
            },
        );
        c.batch_execute("SELECT outbox.raise('fast')").unwrap();
        let state: String = eventually("the fast sink to wait", Duration::from_secs(5), || {
            let s: String = c
                .query_one("SELECT state FROM outbox.status() WHERE name = 'rec'", &[])
                .unwrap()
                .get(0);
            (s == "waiting for a worker").then_some(s)
        });
        assert_eq!(state, "waiting for a worker");
        let slow_states: Vec<String> = c
            .query(
                "SELECT state FROM outbox.status() WHERE name IN ('slow0', 'slow1') ORDER BY name",
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(
            slow_states,
            ["delivering", "delivering"],
            "the slow sinks are being delivered"
        );
        assert!(
            workers_in(cluster, "app").len() <= 2,
            "no more than max_workers"
        );
        eventually(
            "the fast event after a slow handler",
            Duration::from_secs(20),
            || (count(&mut c, "SELECT count(*) FROM got WHERE sink = 'rec'") == 1).then_some(()),
        );
    });
}

#[test]
fn a_database_without_a_worker_gets_one_at_the_cap_when_another_keeps_extras_busy() {
    with_cluster(
        "pg_outbox_fair",
        &["pg_outbox.max_workers = 3"],
        |cluster| {
            let mut admin = cluster.connect("postgres", "postgres");
            for db in ["busy", "quiet"] {
                admin
                    .batch_execute(&format!("CREATE DATABASE {db}"))
                    .unwrap();
            }
            // busy: three sinks whose handlers take 3 s a batch of one, with a long backlog: its
            // workers stay inside handlers and it keeps the cap's three.
            let mut c = cluster.connect("busy", "postgres");
            c.batch_execute("CREATE EXTENSION pg_outbox").unwrap();
            c.batch_execute(
            "CREATE FUNCTION slow(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ SELECT pg_sleep(3) $$;
             SELECT outbox.create_sink('s' || i, 'slow(outbox.event[])', batch_size => 1) FROM generate_series(1, 3) i;
             SELECT outbox.raise('x.y') FROM generate_series(1, 50);",
        )
        .unwrap();
            eventually("busy to take the cap", Duration::from_secs(20), || {
                (workers_in(cluster, "busy").len() == 3).then_some(())
            });
            // quiet: installed now, at the cap. It waits for a worker, and gets one once a handler
            // of busy returns (an extra of busy makes room).
            let took = install_and_deliver(cluster, "quiet");
            assert!(
                took < Duration::from_secs(8),
                "quiet waited {took:?} for a worker"
            );
            assert!(workers_in(cluster, "busy").len() <= 2);
            // The minimum holds: busy keeps a worker.
            assert!(!workers_in(cluster, "busy").is_empty());
        },
    );
}

#[test]
fn a_database_owner_cannot_make_the_workers_run_as_itself() {
    with_cluster("pg_outbox_owner_role", &[], |cluster| {
        let mut admin = cluster.connect("postgres", "postgres");
        admin.batch_execute("CREATE ROLE owner1 LOGIN").unwrap();
        admin
            .batch_execute("CREATE DATABASE owned OWNER owner1")
            .unwrap();
        let took = install_and_deliver(cluster, "owned");
        assert!(took < Duration::from_secs(3), "delivery took {took:?}");
        // What a database owner may set for every session of its database (a superuser's too),
        // then the workers start again and connect with it.
        let mut owner = cluster.connect("owned", "owner1");
        owner
            .batch_execute(
                "ALTER DATABASE owned SET role = 'owner1';
                 ALTER DATABASE owned SET session_authorization = 'owner1';",
            )
            .unwrap();
        let before = workers_in(cluster, "owned");
        admin
            .batch_execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker'",
            )
            .unwrap();
        eventually("a new worker in owned", Duration::from_secs(10), || {
            let now = workers_in(cluster, "owned");
            (!now.is_empty() && now.iter().all(|p| !before.contains(p))).then_some(())
        });
        // The event goes through the new worker: raised as postgres (the database's settings do
        // would make this session owner1 too: take postgres back).
        let mut c = cluster.connect("owned", "postgres");
        c.batch_execute(
            "SET SESSION AUTHORIZATION postgres; SET ROLE NONE; SELECT outbox.raise('x.y')",
        )
        .unwrap();
        eventually(
            "delivery by the new worker",
            Duration::from_secs(10),
            || (count(&mut c, "SELECT count(*) FROM got") == 2).then_some(()),
        );
        let who: Vec<String> = admin
            .query(
                "SELECT usename::text FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker'",
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(!who.is_empty());
        // pg_stat_activity shows the session's role as it was at connection: the worker took its
        // own back at once. What counts is what its SQL runs as.
        assert!(
            !cluster
                .log()
                .contains("permission denied for schema outbox"),
            "the workers' own SQL ran as the owner"
        );
    });
}
