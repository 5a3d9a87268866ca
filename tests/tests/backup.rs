//! Backup and restore (issue #11, item 3): a database caught mid-flight is dumped with pg_dump
//! from one cluster and restored with pg_restore into a new one whose transaction ids are far
//! lower; then more events are raised. Every ledger must read exactly as if nothing had happened:
//! nothing lost, nothing twice, nothing out of order.

use pg_outbox_tests::postgres::Client;
use pg_outbox_tests::{eventually, Cluster};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const SYSTEM_BIN: &str = "/usr/lib/postgresql/15/bin";

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Runs a PostgreSQL client program as postgres (as the server's own tools would be run).
fn pg_tool(tool: &str, args: &[&str]) {
    let path = format!("{SYSTEM_BIN}/{tool}");
    let mut c = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", &path]);
        c
    } else {
        Command::new(&path)
    };
    let out = c.args(args).output().expect(tool);
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn conn_args(cluster: &Cluster) -> Vec<String> {
    vec![
        "-h".into(),
        cluster.socket_dir().display().to_string(),
        "-p".into(),
        cluster.port().to_string(),
        "-U".into(),
        "postgres".into(),
    ]
}

fn count(c: &mut Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).unwrap().get(0)
}

/// Roles, as `pg_dumpall --globals-only` would carry them.
const ROLES: &str = "CREATE ROLE shop_app; CREATE ROLE shop_ops;";

const SETUP: &str = "
    CREATE TABLE ledger (n bigserial PRIMARY KEY, sink text, id uuid, pos text);
    CREATE TABLE control (poison_ok boolean NOT NULL DEFAULT false);
    INSERT INTO control DEFAULT VALUES;
    CREATE FUNCTION rec(events outbox.event[]) RETURNS void LANGUAGE sql AS $$
      INSERT INTO public.ledger (sink, id, pos) SELECT 'books', e.id, e.position FROM unnest(events) e $$;
    CREATE FUNCTION late(events outbox.event[]) RETURNS void LANGUAGE sql AS $$
      INSERT INTO public.ledger (sink, id, pos) SELECT 'late', e.id, e.position FROM unnest(events) e $$;
    CREATE FUNCTION picky(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
      IF NOT (SELECT poison_ok FROM public.control)
         AND EXISTS (SELECT 1 FROM unnest(events) e WHERE e.payload ? 'poison') THEN
        RAISE EXCEPTION 'poison in batch';
      END IF;
      INSERT INTO public.ledger (sink, id, pos) SELECT 'picky', e.id, e.position FROM unnest(events) e;
    END $$;
    GRANT USAGE ON SCHEMA outbox TO shop_app;
    GRANT EXECUTE ON FUNCTION outbox.raise(text, jsonb, text, text, jsonb) TO shop_app;
    SELECT outbox.create_sink('books', 'rec(outbox.event[])', topics => '{order.*}');
    SELECT outbox.create_sink('late', 'late(outbox.event[])', topics => '{order.*}');
    SELECT outbox.create_sink('picky', 'picky(outbox.event[])', topics => '{order.*}');
    CREATE FUNCTION ticked(events outbox.event[]) RETURNS void LANGUAGE sql AS $$
      INSERT INTO public.ledger (sink, id, pos) SELECT 'ticked', e.id, e.position FROM unnest(events) e $$;
    SELECT outbox.create_sink('ticked', 'ticked(outbox.event[])', topics => '{order.*}');
    SELECT outbox.alter_sink('ticked', '{\"read_by\": \"ticks\"}');
    SELECT outbox.pause_sink('late');
    SELECT outbox.create_http_sink('hook', 'http://127.0.0.1:9/hooks', topics => '{report.*}',
             headers => jsonb_build_object('Authorization', 'Bearer s3cr3t'),
             secret => 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw');
    SELECT outbox.pause_sink('hook');
    SELECT outbox.create_consumer('audit');
    SELECT outbox.subscribe('big', '{order.*}', queue => 'big', filter => 'payload.amount > 90');
    SELECT outbox.create_queue('mail');
    SELECT outbox.enqueue('mail', jsonb_build_object('to', 'ada@example.com'));
    SELECT outbox.enqueue('mail', jsonb_build_object('to', 'grace@example.com'));
    SELECT outbox.schedule('nightly', daily_at => '03:00', zone => 'UTC', topic => 'report.nightly');";

/// Every event of the log in log order: (id, topic).
fn log(c: &mut Client) -> Vec<(String, String)> {
    c.query(
        "SELECT id::text, topic FROM outbox.events ORDER BY txid, seq",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// A sink's ledger: event ids in the order delivered.
fn ledger(c: &mut Client, sink: &str) -> Vec<String> {
    c.query(
        "SELECT id::text FROM ledger WHERE sink = $1 ORDER BY n",
        &[&sink],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

fn wait_ledger(c: &mut Client, sink: &str, n: usize) -> Vec<String> {
    eventually(
        &format!("{n} events in {sink}'s ledger"),
        Duration::from_secs(60),
        || {
            let l = ledger(c, sink);
            (l.len() >= n).then_some(l)
        },
    )
}

fn raise_orders(c: &mut Client, from: i32, to: i32) {
    c.batch_execute(&format!(
        "SELECT outbox.raise('order.placed', jsonb_build_object('i', i, 'amount', i * 3))
           FROM generate_series({from}, {to}) i"
    ))
    .unwrap();
}

#[test]
fn a_database_dumped_mid_flight_and_restored_into_a_new_cluster_delivers_on_as_if_nothing_happened()
{
    let settings = [
        "fsync = off",
        "pg_outbox.max_backoff = '1s'",
        "pg_outbox.poison_after = 2",
        "pg_outbox.http_allow_plain = on",
        "pg_outbox.http_allow_private = on",
    ];
    let old = Cluster::start_with("pg_outbox_dump_from", &settings);
    let new = Cluster::start_with("pg_outbox_dump_to", &settings);
    let dump = std::env::temp_dir().join(format!("pg_outbox_shop.{}.dump", std::process::id()));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        mid_flight_dump_and_restore(&old, &new, &dump)
    }));
    let logs = format!("old cluster:\n{}\nnew cluster:\n{}", old.log(), new.log());
    old.stop();
    new.stop();
    let _ = std::fs::remove_file(&dump);
    if let Err(e) = result {
        eprintln!("{logs}");
        std::panic::resume_unwind(e);
    }
}

fn mid_flight_dump_and_restore(old: &Cluster, new: &Cluster, dump: &Path) {
    let mut admin = old.connect("postgres", "postgres");
    admin.batch_execute(ROLES).unwrap();
    admin.batch_execute("CREATE DATABASE shop").unwrap();
    // The old cluster is far ahead in transaction ids: restored positions sit high above the new
    // cluster's.
    admin
        .batch_execute(
            "DO $$ BEGIN FOR i IN 1..5000 LOOP PERFORM pg_current_xact_id(); COMMIT; END LOOP; END $$",
        )
        .unwrap();
    let mut c = old.connect("shop", "postgres");
    c.batch_execute("CREATE EXTENSION pg_outbox").unwrap();
    c.batch_execute(SETUP).unwrap();
    // 1..15 delivered; the 11th poison, dead-lettered by picky after the neighbour test.
    raise_orders(&mut c, 1, 10);
    c.batch_execute("SELECT outbox.raise('order.placed', '{\"poison\": true}')")
        .unwrap();
    raise_orders(&mut c, 12, 15);
    wait_ledger(&mut c, "books", 15);
    eventually("picky's dead letter", Duration::from_secs(60), || {
        (count(
            &mut c,
            "SELECT count(*) FROM outbox.dead_letters WHERE sink = 'picky'",
        ) == 1)
            .then_some(())
    });
    wait_ledger(&mut c, "picky", 14);
    // The sink by ticks has read them too, and its cursor is a batch (two snapshots of the old
    // cluster's) when the dump is taken.
    wait_ledger(&mut c, "ticked", 15);
    eventually("ticked in a batch", Duration::from_secs(30), || {
        (count(
            &mut c,
            "SELECT count(*) FROM outbox.consumers WHERE name = 'ticked' AND tick IS NOT NULL",
        ) == 1)
            .then_some(())
    });
    // The pull consumer reads half way.
    let half: String = c
        .query_one("SELECT position FROM outbox.read('audit', 6) OFFSET 5", &[])
        .unwrap()
        .get(0);
    c.execute("SELECT outbox.advance('audit', $1)", &[&half])
        .unwrap();
    // Delivery stops; a backlog builds up.
    old.set("pg_outbox.enabled", "off");
    raise_orders(&mut c, 16, 40);
    let before = log(&mut c);
    assert_eq!(before.len(), 40);
    let books_before = ledger(&mut c, "books");
    let hook_before: String = c
        .query_one("SELECT row(h.*)::text FROM outbox.http_sinks h", &[])
        .unwrap()
        .get(0);
    let picky_before = ledger(&mut c, "picky");
    let jobs_before = count(&mut c, "SELECT count(*) FROM outbox.jobs");
    let max_job: i64 = c
        .query_one("SELECT max(id) FROM outbox.jobs", &[])
        .unwrap()
        .get(0);

    pg_tool(
        "pg_dump",
        &[
            conn_args(old),
            vec![
                "-Fc".into(),
                "-f".into(),
                dump.display().to_string(),
                "shop".into(),
            ],
        ]
        .concat()
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
    drop(c);

    // The new cluster: the roles, then the database, restored table by table (no single
    // transaction: the workers start as soon as CREATE EXTENSION commits).
    let mut admin = new.connect("postgres", "postgres");
    admin.batch_execute(ROLES).unwrap();
    admin.batch_execute("CREATE DATABASE shop").unwrap();
    if is_root() {
        Command::new("chown")
            .args(["postgres", &dump.display().to_string()])
            .status()
            .unwrap();
    }
    pg_tool(
        "pg_restore",
        &[
            conn_args(new),
            vec!["-d".into(), "shop".into(), dump.display().to_string()],
        ]
        .concat()
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
    let mut c = new.connect("shop", "postgres");
    assert_eq!(log(&mut c), before, "the log, in the same order");
    assert_eq!(ledger(&mut c, "books")[..books_before.len()], books_before);
    // The backlog is delivered without a new event: restored events are readable at once.
    let books = wait_ledger(&mut c, "books", 40);
    assert_eq!(
        books,
        before.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>()
    );

    // More events, raised by the application's role.
    let mut app = new.connect("shop", "postgres");
    app.batch_execute("SET ROLE shop_app").unwrap();
    raise_orders(&mut app, 41, 50);
    let after = log(&mut c);
    assert_eq!(after.len(), 50);
    assert_eq!(after[..40], before[..], "restored events stay first");
    let all: Vec<String> = after.iter().map(|(id, _)| id.clone()).collect();

    // books: everything once, in log order.
    assert_eq!(wait_ledger(&mut c, "books", 50), all);
    // ticked: everything once; the events were raised one transaction after another, so the
    // order the ticks saw them in is the log's. The ticks taken here number after the restored
    // ones (a new epoch).
    assert_eq!(wait_ledger(&mut c, "ticked", 50), all);
    assert!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.ticks WHERE tick > 1::int8 << 40 AND cluster <> 42"
        ) >= 1
    );
    // late: still paused; resumed, it gets everything once, in order.
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.status() WHERE name = 'late' AND state = 'paused'"
        ),
        1
    );
    c.batch_execute("SELECT outbox.resume_sink('late')")
        .unwrap();
    assert_eq!(wait_ledger(&mut c, "late", 50), all);
    // picky: everything but the dead letter, once, in order; the dead letter is still there and
    // replays.
    let poison: String = c
        .query_one(
            "SELECT (event).id::text FROM outbox.dead_letters WHERE sink = 'picky'",
            &[],
        )
        .unwrap()
        .get(0);
    let not_poison: Vec<String> = all.iter().filter(|id| **id != poison).cloned().collect();
    let picky = wait_ledger(&mut c, "picky", 49);
    assert_eq!(picky[..picky_before.len()], picky_before);
    assert_eq!(picky, not_poison);
    c.batch_execute("UPDATE control SET poison_ok = true; SELECT outbox.replay('picky')")
        .unwrap();
    let picky = wait_ledger(&mut c, "picky", 50);
    assert_eq!(picky.last(), Some(&poison));
    // The pull consumer goes on after its cursor: the rest of the log once, in order.
    let read: Vec<String> = c
        .query("SELECT id::text FROM outbox.read('audit', 1000)", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(read, all[6..]);
    // The subscription's jobs: those queued before the dump are there once, and the new events
    // that match are queued after (amount > 90: i >= 31).
    eventually(
        "the subscription caught up",
        Duration::from_secs(30),
        || {
            (count(
                &mut c,
                "SELECT count(*) FROM outbox.jobs WHERE queue = 'big'",
            ) == 20)
                .then_some(())
        },
    );
    let big: Vec<i32> = c
        .query(
            "SELECT (payload->'payload'->>'i')::int FROM outbox.jobs WHERE queue = 'big' ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(big, (31..=50).collect::<Vec<i32>>());
    // The waiting mail jobs are there, claimable, and new jobs get new ids.
    assert!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.jobs WHERE queue = 'mail' AND state = 'waiting'"
        ) == 2
    );
    assert!(jobs_before >= 2);
    let id: i64 = c
        .query_one("SELECT outbox.enqueue('mail', '{}')", &[])
        .unwrap()
        .get(0);
    assert!(id > max_job, "job ids go on after the restored ones");
    // The schedule and the roles came along.
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM outbox.schedule_status() WHERE name = 'nightly' AND owner::text = 'postgres'"),
        1
    );
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM outbox.queue_privileges() WHERE queue = 'mail' AND owner::text = 'postgres'"),
        1
    );
    // The HTTP sink with its credentials (the dump was a superuser's).
    let hook_after: String = c
        .query_one("SELECT row(h.*)::text FROM outbox.http_sinks h", &[])
        .unwrap()
        .get(0);
    assert_eq!(hook_after, hook_before);
    assert!(hook_after.contains("whsec_") && hook_after.contains("s3cr3t"));
    // One lineage: this cluster's, in a new epoch.
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.lineage WHERE epoch = 1 AND raised"
        ),
        1
    );
}

#[test]
fn events_raised_before_a_restored_log_is_in_make_the_next_raise_refuse() {
    // What a restore into a database already raising in would leave: this database's row, raised
    // in, and the dump's, raised in too.
    let db = pg_outbox_tests::test_db("lineage_conflict");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.raise('a.b')").unwrap();
    c.batch_execute(
        "INSERT INTO outbox.lineage (system_identifier, database, epoch, raised) VALUES (42, 1, 3, true)",
    )
    .unwrap();
    // A new session cannot tell the order of the two logs: it refuses to raise.
    let mut fresh = db.connect();
    assert_eq!(
        pg_outbox_tests::sqlstate(&mut fresh, "SELECT outbox.raise('a.c')"),
        "55000"
    );
    // Reading goes on.
    fresh
        .batch_execute("SELECT outbox.create_consumer('r'); SELECT * FROM outbox.read('r')")
        .unwrap();
    // The hint's way out: a superuser keeps one row, and raising goes on.
    fresh
        .batch_execute("DELETE FROM outbox.lineage WHERE system_identifier = 42")
        .unwrap();
    let mut again = db.connect();
    again.batch_execute("SELECT outbox.raise('a.d')").unwrap();
    assert_eq!(count(&mut again, "SELECT count(*) FROM outbox.events"), 2);
}
