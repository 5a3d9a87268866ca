//! SQL sinks delivered by the background worker, from clients against a live preloaded cluster:
//! exactly once and in order under concurrent writers, poison isolated by bisecting and the
//! neighbour test, outages that lose nothing, isolation between sinks, a worker killed mid-batch
//! and a server crash, privileges, pause/resume/drop, replay, timed pruning, DROP EXTENSION.

use pg_outbox_tests::{eventually, position, read, sqlstate, worker_db, TestDb};
use postgres::Client;
use std::time::{Duration, Instant};

const LEDGER: &str = "
    CREATE TABLE ledger (n bigserial PRIMARY KEY, sink text, id uuid, pos text, topic text, payload jsonb,
                         at timestamptz DEFAULT clock_timestamp());
    CREATE TABLE control (sink text PRIMARY KEY, fail_all boolean NOT NULL DEFAULT false,
                          poison_ok boolean NOT NULL DEFAULT false, sleep float8 NOT NULL DEFAULT 0);
    GRANT SELECT, INSERT ON ledger TO PUBLIC; GRANT USAGE ON SEQUENCE ledger_n_seq TO PUBLIC;
    GRANT SELECT ON control TO PUBLIC;";

/// A handler `rec_<sink>` that records every event it gets in `ledger`, and fails or sleeps as
/// `control` says: on every batch while fail_all, on a batch with a {"poison": true} payload
/// unless poison_ok.
fn recording_handler(c: &mut Client, sink: &str) {
    c.batch_execute(&format!(
        "INSERT INTO control (sink) VALUES ('{sink}');
         CREATE FUNCTION rec_{sink}(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$
         DECLARE ctl control;
         BEGIN
           SELECT * INTO ctl FROM control WHERE sink = '{sink}';
           IF ctl.fail_all THEN RAISE EXCEPTION 'sink {sink} is down' USING ERRCODE = 'P0002'; END IF;
           IF NOT ctl.poison_ok AND EXISTS (SELECT 1 FROM unnest(events) e WHERE e.payload->>'poison' = 'true') THEN
             RAISE EXCEPTION 'poison in batch' USING ERRCODE = 'P0001';
           END IF;
           IF ctl.sleep > 0 THEN PERFORM pg_sleep(ctl.sleep); END IF;
           INSERT INTO ledger (sink, id, pos, topic, payload)
             SELECT '{sink}', e.id, e.position, e.topic, e.payload FROM unnest(events) e;
         END $$;"
    ))
    .unwrap();
}

fn recording_sink(c: &mut Client, sink: &str, extra: &str) {
    recording_handler(c, sink);
    c.batch_execute(&format!(
        "SELECT outbox.create_sink('{sink}', 'rec_{sink}(outbox.event[])'{extra})"
    ))
    .unwrap();
}

fn ledger(c: &mut Client, sink: &str) -> Vec<(String, String)> {
    c.query(
        "SELECT pos, payload::text FROM ledger WHERE sink = $1 ORDER BY n",
        &[&sink],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

fn count(c: &mut Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).unwrap().get(0)
}

fn wait_ledger(c: &mut Client, sink: &str, n: usize, within: Duration) -> Vec<(String, String)> {
    eventually(&format!("{n} events in {sink}'s ledger"), within, || {
        let l = ledger(c, sink);
        (l.len() >= n).then_some(l)
    })
}

fn assert_in_order_once(rows: &[(String, String)]) {
    let mut last = None;
    for (pos, _) in rows {
        let p = position(pos);
        assert!(
            last < Some(p),
            "delivered out of order or twice: {last:?} then {p:?}"
        );
        last = Some(p);
    }
}

/// Cluster settings changed for one test, put back when it ends, even if it fails.
struct Settings<'a> {
    db: &'a TestDb,
    changed: Vec<(&'static str, &'static str)>,
}

impl<'a> Settings<'a> {
    fn set(db: &'a TestDb, changes: &[(&'static str, &str, &'static str)]) -> Self {
        let mut changed = Vec::new();
        for (name, value, default) in changes {
            db.cluster().set(name, value);
            changed.push((*name, *default));
        }
        Settings { db, changed }
    }
}

impl Drop for Settings<'_> {
    fn drop(&mut self) {
        for (name, default) in self.changed.iter().rev() {
            self.db.cluster().set(name, default);
        }
    }
}

fn setup(label: &str) -> (TestDb, Client) {
    let db = worker_db(label);
    let mut c = db.connect();
    c.batch_execute(LEDGER).unwrap();
    (db, c)
}

#[test]
fn ten_thousand_events_from_eight_connections_reach_a_sink_once_and_in_order() {
    let (db, mut c) = setup("sink_10k");
    recording_sink(&mut c, "books", "");
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let mut c = db.connect();
            std::thread::spawn(move || {
                let mut i = 0;
                while i < 1250 {
                    // 1 to 4 events per transaction, commits interleaving with the other writers.
                    let k = (1 + (i + w) % 4).min(1250 - i);
                    let mut tx = c.transaction().unwrap();
                    for j in 0..k {
                        tx.execute(
                            "SELECT outbox.raise('load.tick', jsonb_build_object('w', $1::int, 'i', $2::int))",
                            &[&w, &(i + j)],
                        )
                        .unwrap();
                    }
                    if (i + w) % 5 == 0 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    tx.commit().unwrap();
                    i += k;
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let rows = wait_ledger(&mut c, "books", 10_000, Duration::from_secs(120));
    assert_eq!(rows.len(), 10_000);
    assert_in_order_once(&rows);
    let distinct = count(&mut c, "SELECT count(DISTINCT payload) FROM ledger");
    assert_eq!(distinct, 10_000, "every event exactly once");
    // The sink's cursor is at the last event and the status says so.
    let r = c
        .query_one(
            "SELECT events_behind, state, dead_letters FROM outbox.status() WHERE name = 'books'",
            &[],
        )
        .unwrap();
    assert_eq!(
        (
            r.get::<_, i64>(0),
            r.get::<_, String>(1),
            r.get::<_, i64>(2)
        ),
        (0, "idle".to_string(), 0)
    );
}

#[test]
fn a_poison_event_is_dead_lettered_after_the_neighbour_test_and_everything_else_delivered() {
    let (_db, mut c) = setup("sink_poison");
    recording_sink(&mut c, "books", "");
    // 128 events in one transaction, the 57th poison: one batch of 128 that fails.
    c.batch_execute(
        "SELECT outbox.raise_many(ARRAY['load.tick'],
                array_agg(CASE WHEN i = 57 THEN jsonb_build_object('i', i, 'poison', true)
                               ELSE jsonb_build_object('i', i) END ORDER BY i))
           FROM generate_series(1, 128) i",
    )
    .unwrap();
    let rows = wait_ledger(&mut c, "books", 127, Duration::from_secs(60));
    assert_eq!(rows.len(), 127);
    assert_in_order_once(&rows);
    assert!(rows.iter().all(|r| !r.1.contains("poison")));
    let dead = c
        .query_one("SELECT (event).payload::text, attempts, sqlstate, error FROM outbox.dead_letters WHERE sink = 'books'", &[])
        .unwrap();
    assert_eq!(dead.get::<_, String>(0), r#"{"i": 57, "poison": true}"#);
    assert_eq!(
        dead.get::<_, i32>(1),
        5,
        "dead-lettered after pg_outbox.poison_after failures"
    );
    assert_eq!(dead.get::<_, String>(2), "P0001");
    assert_eq!(dead.get::<_, String>(3), "poison in batch");
    let r = c
        .query_one(
            "SELECT dead_letters, state, attempts FROM outbox.status() WHERE name = 'books'",
            &[],
        )
        .unwrap();
    assert_eq!(r.get::<_, i64>(0), 1);

    // Replay: refused while it would fail? No -- it is re-delivered and fails again, keeping it.
    c.batch_execute("SELECT outbox.replay('books')").unwrap();
    eventually(
        "the failed replay to come back",
        Duration::from_secs(20),
        || {
            let a: i32 = c
                .query_one(
                    "SELECT attempts FROM outbox.dead_letters WHERE sink = 'books'",
                    &[],
                )
                .unwrap()
                .get(0);
            (a == 6).then_some(())
        },
    );
    // Fixed: a replay re-delivers it to this sink, and the dead letter is gone.
    c.batch_execute("UPDATE control SET poison_ok = true; SELECT outbox.replay('books', (SELECT txid || ':' || seq FROM outbox.dead_letters))")
        .unwrap();
    let rows = wait_ledger(&mut c, "books", 128, Duration::from_secs(20));
    assert!(rows[127].1.contains("poison"));
    assert_eq!(count(&mut c, "SELECT count(*) FROM outbox.dead_letters"), 0);
    assert_eq!(
        sqlstate(&mut c, "SELECT outbox.replay('books', '1:1')"),
        "42704"
    );
}

/// A backlog goes over in several batches per transaction (`pg_outbox.pass_max_events`), each
/// handler call in a subtransaction of its own. A batch that fails ends its pass: the batches
/// before it commit, and the failure policy takes the failing one as it would at the start of a
/// pass, down to the poison event, which alone is dead-lettered.
#[test]
fn a_pass_hands_over_several_batches_in_one_transaction_and_a_failing_one_keeps_those_before() {
    let (db, mut c) = setup("sink_pass");
    let _settings = Settings::set(
        &db,
        &[
            ("pg_outbox.pass_max_time", "10s", "50ms"),
            ("pg_outbox.poison_after", "2", "5"),
        ],
    );
    c.batch_execute(
        "CREATE TABLE calls (xid xid8, first int, last int, events int);
         CREATE FUNCTION passes(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$ BEGIN
           INSERT INTO calls SELECT pg_current_xact_id(), min((e.payload->>'i')::int),
                                    max((e.payload->>'i')::int), count(*) FROM unnest(events) e;
           IF EXISTS (SELECT 1 FROM unnest(events) e WHERE e.payload ? 'poison') THEN
             RAISE EXCEPTION 'poison in batch' USING ERRCODE = 'P0001';
           END IF;
           INSERT INTO ledger (sink, id, pos, topic, payload)
             SELECT 'passes', e.id, e.position, e.topic, e.payload FROM unnest(events) e;
         END $$;
         SELECT outbox.create_sink('passes', 'passes(outbox.event[])', batch_size => 4);
         SELECT outbox.pause_sink('passes');
         SELECT outbox.raise_many(ARRAY['load.tick'],
                array_agg(CASE WHEN i = 43 THEN jsonb_build_object('i', i, 'poison', true)
                               ELSE jsonb_build_object('i', i) END ORDER BY i))
           FROM generate_series(1, 64) i;
         SELECT outbox.resume_sink('passes');",
    )
    .unwrap();
    let rows = wait_ledger(&mut c, "passes", 63, Duration::from_secs(60));
    assert_eq!(rows.len(), 63);
    assert_in_order_once(&rows);
    assert!(rows.iter().all(|r| !r.1.contains("poison")));
    let dead: String = c
        .query_one(
            "SELECT (event).payload->>'i' FROM outbox.dead_letters WHERE sink = 'passes'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(dead, "43");
    // The first pass: ten batches of four in one transaction (the eleventh, holding the poison,
    // failed: its subtransaction, and the row it wrote in `calls`, rolled back).
    let first: Vec<(i32, i32, i64)> = c
        .query(
            "SELECT first, last, count(*) OVER (PARTITION BY xid) FROM calls
              WHERE xid = (SELECT xid FROM calls WHERE first = 1) ORDER BY first",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let expected: Vec<(i32, i32, i64)> = (0..10).map(|k| (4 * k + 1, 4 * k + 4, 10)).collect();
    assert_eq!(first, expected, "one pass, batch after batch");
    // What went before the failing batch committed, and it alone was retried (halved).
    let next: (i32, i32) = c
        .query_one(
            "SELECT first, last FROM calls WHERE xid > (SELECT xid FROM calls WHERE first = 1)
              ORDER BY xid, first LIMIT 1",
            &[],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(next, (41, 42));
    // Every event but the poison was handed over once in a batch that went through.
    assert_eq!(
        count(&mut c, "SELECT count(*) FROM ledger WHERE sink = 'passes'"),
        63
    );
}

#[test]
fn an_outage_dead_letters_nothing_and_delivers_everything_once_it_recovers() {
    let (_db, mut c) = setup("sink_outage");
    recording_sink(&mut c, "books", ", batch_size => 16");
    c.batch_execute("UPDATE control SET fail_all = true")
        .unwrap();
    c.batch_execute("SELECT outbox.raise('load.tick', jsonb_build_object('i', i)) FROM generate_series(1, 50) i").unwrap();
    c.batch_execute("SELECT outbox.raise('load.tick', jsonb_build_object('i', i)) FROM generate_series(51, 60) i").unwrap();
    // Past poison_after, the neighbour fails too: the sink is down, not the event poison.
    eventually("the sink to be down", Duration::from_secs(60), || {
        let r = c
            .query_one(
                "SELECT state, attempts FROM outbox.status() WHERE name = 'books'",
                &[],
            )
            .unwrap();
        (r.get::<_, i32>(1) >= 6).then_some(())
    });
    let down: bool = c
        .query_one("SELECT down FROM outbox.sinks WHERE id = 'books'", &[])
        .unwrap()
        .get(0);
    assert!(down);
    assert_eq!(count(&mut c, "SELECT count(*) FROM outbox.dead_letters"), 0);
    assert_eq!(count(&mut c, "SELECT count(*) FROM ledger"), 0);
    let sqlstate: String = c
        .query_one(
            "SELECT last_sqlstate FROM outbox.status() WHERE name = 'books'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(sqlstate, "P0002");

    c.batch_execute("UPDATE control SET fail_all = false")
        .unwrap();
    let rows = wait_ledger(&mut c, "books", 60, Duration::from_secs(60));
    assert_eq!(rows.len(), 60);
    assert_in_order_once(&rows);
    assert_eq!(count(&mut c, "SELECT count(*) FROM outbox.dead_letters"), 0);
    let r = c
        .query_one(
            "SELECT attempts, state FROM outbox.status() WHERE name = 'books'",
            &[],
        )
        .unwrap();
    assert_eq!(r.get::<_, i32>(0), 0);
}

#[test]
fn a_slow_sink_does_not_delay_another() {
    let (_db, mut c) = setup("sink_slow");
    recording_sink(&mut c, "slow", "");
    recording_sink(&mut c, "fast", "");
    c.batch_execute("UPDATE control SET sleep = 4 WHERE sink = 'slow'")
        .unwrap();
    let start = Instant::now();
    c.batch_execute("SELECT outbox.raise('load.tick', '{\"i\": 1}')")
        .unwrap();
    wait_ledger(&mut c, "fast", 1, Duration::from_secs(10));
    let fast = start.elapsed();
    assert!(
        fast < Duration::from_secs(2),
        "the fast sink waited {fast:?} for the slow one"
    );
    assert!(
        ledger(&mut c, "slow").is_empty(),
        "the slow sink is still in its handler"
    );
    c.batch_execute("SELECT outbox.raise('load.tick', '{\"i\": 2}')")
        .unwrap();
    wait_ledger(&mut c, "fast", 2, Duration::from_secs(2));
    wait_ledger(&mut c, "slow", 2, Duration::from_secs(30));
}

#[test]
fn a_worker_killed_mid_batch_and_a_server_crash_lose_and_duplicate_nothing() {
    let (db, mut c) = setup("sink_crash");
    recording_sink(&mut c, "books", ", batch_size => 10");
    // The same with synchronous_commit off: a crash may lose its last commits, handler's writes
    // and cursor together, and those events come again.
    recording_sink(&mut c, "quick", ", batch_size => 10");
    c.batch_execute("SELECT outbox.alter_sink('quick', '{\"synchronous_commit\": false}')")
        .unwrap();
    c.batch_execute("UPDATE control SET sleep = 0.05").unwrap();
    c.batch_execute("SELECT outbox.raise('load.tick', jsonb_build_object('i', i)) FROM generate_series(1, 300) i").unwrap();
    // Mid-delivery: some batches are in, the rest are not.
    wait_ledger(&mut c, "books", 20, Duration::from_secs(30));
    drop(c);
    // SIGKILL a worker in the middle of a batch: the postmaster resets every backend.
    let pid = db.cluster().worker_pids()[0];
    kill9(pid);
    // And then stop the server without a checkpoint, as a power loss would.
    eventually(
        "the server back after the kill",
        Duration::from_secs(30),
        || std::panic::catch_unwind(|| db.cluster().connect(&db.name, "postgres")).ok(),
    );
    db.cluster().restart_immediate();
    db.cluster().wait_for_workers(&db.name);
    let mut c = db.connect();
    for sink in ["books", "quick"] {
        let rows = wait_ledger(&mut c, sink, 300, Duration::from_secs(60));
        assert_eq!(rows.len(), 300, "{sink}: nothing lost, nothing twice");
        assert_in_order_once(&rows);
    }
}

/// `alter_sink` turns synchronous_commit off for one sink's delivery transactions, not for
/// another's, and not in a way its handler could undo for the commit.
#[test]
fn a_sink_altered_to_commit_without_waiting_does_so_and_only_it() {
    let (db, mut c) = setup("sink_async");
    // One event per call, the calls of a backlog in one pass: what one call sets must not reach
    // the next, nor the commit.
    let _settings = Settings::set(&db, &[("pg_outbox.pass_max_time", "10s", "50ms")]);
    c.batch_execute(
        "CREATE TABLE seen (sink text, setting text);
         CREATE FUNCTION seen_by(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$ BEGIN
           INSERT INTO seen SELECT e.payload->>'to', current_setting('synchronous_commit')
             FROM unnest(events) e;
           -- What a handler sets is undone when its call ends.
           SET LOCAL synchronous_commit = on;
         END $$;
         SELECT outbox.create_sink('quick', 'seen_by(outbox.event[])', topics => ARRAY['to.quick'],
                                   batch_size => 1);
         SELECT outbox.create_sink('careful', 'seen_by(outbox.event[])', topics => ARRAY['to.careful'],
                                   batch_size => 1);
         SELECT outbox.alter_sink('quick', '{\"synchronous_commit\": false}');
         SELECT outbox.raise_many(ARRAY['to.quick', 'to.careful', 'to.quick', 'to.careful'],
                                  ARRAY['{\"to\": \"quick\"}', '{\"to\": \"careful\"}',
                                        '{\"to\": \"quick\"}', '{\"to\": \"careful\"}']::jsonb[]);",
    )
    .unwrap();
    eventually("both sinks' events", Duration::from_secs(30), || {
        (count(&mut c, "SELECT count(*) FROM seen") == 4).then_some(())
    });
    let seen: Vec<(String, String)> = c
        .query("SELECT sink, setting FROM seen ORDER BY 1, 2", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        seen,
        [
            ("careful".to_string(), "on".to_string()),
            ("careful".to_string(), "on".to_string()),
            ("quick".to_string(), "off".to_string()),
            ("quick".to_string(), "off".to_string())
        ]
    );
    let stored: Vec<(String, bool)> = c
        .query(
            "SELECT id, synchronous_commit FROM outbox.sinks ORDER BY id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        stored,
        [("careful".to_string(), true), ("quick".to_string(), false)]
    );
    // And back on.
    c.batch_execute(
        "SELECT outbox.alter_sink('quick', '{\"synchronous_commit\": true}');
         TRUNCATE seen;
         SELECT outbox.raise('to.quick', '{\"to\": \"quick\"}');",
    )
    .unwrap();
    eventually("the quick sink's event", Duration::from_secs(30), || {
        (count(&mut c, "SELECT count(*) FROM seen") == 1).then_some(())
    });
    let setting: String = c.query_one("SELECT setting FROM seen", &[]).unwrap().get(0);
    assert_eq!(setting, "on");
}

/// The workers run their statements from cached plans, whose JIT code would be compiled again at
/// every execution: they run without JIT, whatever the database says, and a handler that wants
/// it says so in its own definition.
#[test]
fn the_workers_run_without_jit_and_a_handler_may_ask_for_it() {
    let (db, mut c) = setup("sink_jit");
    c.batch_execute(&format!(
        "ALTER DATABASE \"{}\" SET jit = on;
         CREATE TABLE seen (handler text, jit text);
         CREATE FUNCTION plain(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$ BEGIN
           INSERT INTO seen SELECT 'plain', current_setting('jit') FROM unnest(events);
         END $$;
         CREATE FUNCTION wants_jit(events outbox.event[]) RETURNS void LANGUAGE plpgsql
           SET jit = on AS $$ BEGIN
           INSERT INTO seen SELECT 'wants_jit', current_setting('jit') FROM unnest(events);
         END $$;
         SELECT outbox.create_sink('plain', 'plain(outbox.event[])');
         SELECT outbox.create_sink('wants_jit', 'wants_jit(outbox.event[])');",
        db.name
    ))
    .unwrap();
    // Workers that connected before the ALTER DATABASE would not see it: restart them.
    c.batch_execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE backend_type = 'pg_outbox worker' AND datname = current_database()",
    )
    .unwrap();
    c.batch_execute("SELECT outbox.raise('order.placed', '{}') FROM generate_series(1, 3)")
        .unwrap();
    eventually("both handlers' events", Duration::from_secs(30), || {
        (count(&mut c, "SELECT count(*) FROM seen") == 6).then_some(())
    });
    let seen: Vec<(String, String)> = c
        .query("SELECT DISTINCT handler, jit FROM seen ORDER BY 1", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        seen,
        [
            ("plain".to_string(), "off".to_string()),
            ("wants_jit".to_string(), "on".to_string())
        ]
    );
}

fn kill9(pid: i32) {
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn a_sink_runs_as_its_owner_and_cannot_write_where_the_owner_cannot() {
    let (db, mut c) = setup("sink_owner");
    c.batch_execute(&format!(
        "CREATE ROLE weak LOGIN; GRANT CONNECT ON DATABASE \"{}\" TO weak;
         GRANT USAGE ON SCHEMA outbox TO weak;
         GRANT EXECUTE ON FUNCTION outbox.create_sink(text, regprocedure, text[], integer, text) TO weak;
         CREATE TABLE secret (x text);
         CREATE FUNCTION steal(events outbox.event[]) RETURNS void LANGUAGE sql
           AS $$ INSERT INTO public.secret SELECT e.topic FROM unnest(events) e $$;
         CREATE FUNCTION private_handler(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ SELECT $$;
         REVOKE EXECUTE ON FUNCTION private_handler(outbox.event[]) FROM PUBLIC;",
        db.name
    ))
    .unwrap();
    let mut weak = db.connect_as("weak");
    assert_eq!(
        sqlstate(
            &mut weak,
            "SELECT outbox.create_sink('nope', 'private_handler(outbox.event[])')"
        ),
        "42501"
    );
    weak.batch_execute(
        "SELECT outbox.create_sink('thief', 'steal(outbox.event[])', batch_size => 1)",
    )
    .unwrap();
    c.batch_execute("SELECT outbox.raise('secret.thing')")
        .unwrap();
    eventually(
        "the handler to fail on privileges",
        Duration::from_secs(20),
        || {
            let r = c
                .query_one(
                    "SELECT last_sqlstate FROM outbox.status() WHERE name = 'thief'",
                    &[],
                )
                .unwrap();
            (r.get::<_, Option<String>>(0).as_deref() == Some("42501")).then_some(())
        },
    );
    assert_eq!(count(&mut c, "SELECT count(*) FROM secret"), 0);
}

#[test]
fn pause_resume_drop_and_topic_patterns() {
    let (db, mut c) = setup("sink_pause");
    recording_sink(&mut c, "orders", ", topics => ARRAY['order.*']");
    recording_sink(&mut c, "all", "");
    c.batch_execute("SELECT outbox.pause_sink('orders')")
        .unwrap();
    c.batch_execute("SELECT outbox.raise('order.placed'); SELECT outbox.raise('user.created'); SELECT outbox.raise('order.shipped')")
        .unwrap();
    wait_ledger(&mut c, "all", 3, Duration::from_secs(10));
    // A paused sink gets nothing while other sinks are served; several passes have happened.
    let passes = |c: &mut Client| -> i64 {
        c.query_one("SELECT sum(passes)::int8 FROM outbox.workers()", &[])
            .unwrap()
            .get(0)
    };
    let before = passes(&mut c);
    c.batch_execute("SELECT outbox.wake()").unwrap();
    eventually("more worker passes", Duration::from_secs(10), || {
        (passes(&mut c) > before + 2).then_some(())
    });
    assert!(ledger(&mut c, "orders").is_empty());
    let state: String = c
        .query_one(
            "SELECT state FROM outbox.status() WHERE name = 'orders'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(state, "paused");

    c.batch_execute("SELECT outbox.resume_sink('orders')")
        .unwrap();
    let rows = wait_ledger(&mut c, "orders", 2, Duration::from_secs(10));
    let topics: Vec<String> = c
        .query(
            "SELECT topic FROM ledger WHERE sink = 'orders' ORDER BY n",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(topics, ["order.placed", "order.shipped"]);
    assert_eq!(rows.len(), 2);
    // Its cursor still moved past what it skipped.
    let behind: i64 = c
        .query_one(
            "SELECT events_behind FROM outbox.status() WHERE name = 'orders'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(behind, 0);

    c.batch_execute("SELECT outbox.drop_sink('orders')")
        .unwrap();
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.consumers WHERE name = 'orders'"
        ),
        0
    );
    assert_eq!(
        sqlstate(&mut c, "SELECT outbox.pause_sink('orders')"),
        "42704"
    );
    c.batch_execute("SELECT outbox.raise('order.cancelled')")
        .unwrap();
    wait_ledger(&mut c, "all", 4, Duration::from_secs(10));
    assert_eq!(ledger(&mut c, "orders").len(), 2);
    drop(db);
}

#[test]
fn create_sink_refuses_bad_input() {
    let (_db, mut c) = setup("sink_refusals");
    recording_sink(&mut c, "taken", "");
    c.batch_execute(
        "CREATE FUNCTION two_args(a outbox.event[], b int) RETURNS void LANGUAGE sql AS $$ SELECT $$;
         CREATE FUNCTION wrong_type(a jsonb) RETURNS void LANGUAGE sql AS $$ SELECT $$;
         CREATE PROCEDURE a_procedure(a outbox.event[]) LANGUAGE sql AS $$ SELECT $$;",
    )
    .unwrap();
    let h = "'rec_taken(outbox.event[])'";
    for (sql, code) in [
        (format!("SELECT outbox.create_sink(NULL, {h})"), "22004"),
        (format!("SELECT outbox.create_sink('', {h})"), "42602"),
        (
            format!("SELECT outbox.create_sink('bad name', {h})"),
            "42602",
        ),
        (
            format!("SELECT outbox.create_sink('x''; drop table ledger; --', {h})"),
            "42602",
        ),
        ("SELECT outbox.create_sink('s', NULL)".to_string(), "22004"),
        (
            "SELECT outbox.create_sink('s', 'no_such_function(outbox.event[])')".to_string(),
            "42883",
        ),
        (
            "SELECT outbox.create_sink('s', 'two_args(outbox.event[], int)')".to_string(),
            "42P13",
        ),
        (
            "SELECT outbox.create_sink('s', 'wrong_type(jsonb)')".to_string(),
            "42P13",
        ),
        (
            "SELECT outbox.create_sink('s', 'a_procedure(outbox.event[])')".to_string(),
            "42P13",
        ),
        (
            format!("SELECT outbox.create_sink('s', {h}, topics => ARRAY['order..x'])"),
            "22023",
        ),
        (
            format!("SELECT outbox.create_sink('s', {h}, topics => ARRAY['ord*'])"),
            "22023",
        ),
        (
            format!("SELECT outbox.create_sink('s', {h}, topics => ARRAY[]::text[])"),
            "22023",
        ),
        (
            format!("SELECT outbox.create_sink('s', {h}, topics => ARRAY[NULL])"),
            "22004",
        ),
        (
            format!("SELECT outbox.create_sink('s', {h}, batch_size => 0)"),
            "22023",
        ),
        (
            format!("SELECT outbox.create_sink('s', {h}, batch_size => 10001)"),
            "22023",
        ),
        (
            format!("SELECT outbox.create_sink('s', {h}, start_at => 'later')"),
            "22023",
        ),
        (format!("SELECT outbox.create_sink('taken', {h})"), "42710"),
        ("SELECT outbox.pause_sink('nobody')".to_string(), "42704"),
        ("SELECT outbox.resume_sink(NULL)".to_string(), "22004"),
        ("SELECT outbox.drop_sink('nobody')".to_string(), "42704"),
        ("SELECT outbox.advance('taken', '1:1')".to_string(), "42809"),
        ("SELECT outbox.drop_consumer('taken')".to_string(), "42809"),
        ("SELECT outbox.replay('nobody')".to_string(), "42704"),
    ] {
        assert_eq!(sqlstate(&mut c, &sql), code, "{sql}");
    }
    assert_eq!(count(&mut c, "SELECT count(*) FROM outbox.sinks"), 1);
}

/// Deletes and dead tuples that pruning left in the partitions of the log.
fn dead_rows(c: &mut Client) -> i64 {
    c.batch_execute("SELECT pg_stat_force_next_flush()")
        .unwrap();
    c.query_one(
        "SELECT coalesce(sum(n_tup_del + n_dead_tup), 0)::int8 FROM pg_stat_user_tables \
          WHERE schemaname = 'outbox' AND relname LIKE 'events\\_%'",
        &[],
    )
    .unwrap()
    .get(0)
}

/// Waits until the workers have recorded `period` seconds as the log's period, `secs` seconds
/// ago at least.
fn wait_period(c: &mut Client, period: i64, secs: i64) {
    eventually(
        "the period to be recorded and settled",
        Duration::from_secs(40),
        || {
            let settled: Option<bool> = c
                .query_one(
                    "SELECT bool_and(period_s = $1 AND since < now() - make_interval(secs => $2)) \
                       FROM outbox.log_rotation",
                    &[&period, &(secs as f64)],
                )
                .unwrap()
                .get(0);
            settled.unwrap_or(false).then_some(())
        },
    );
}

/// Raises events `from` to `to` and waits for the sink to have them.
fn raise_delivered(c: &mut Client, from: i32, to: i32) {
    c.execute(
        "SELECT outbox.raise('load.tick', jsonb_build_object('i', i)) FROM generate_series($1::int4, $2::int4) i",
        &[&from, &to],
    )
    .unwrap();
    wait_ledger(c, "books", to as usize, Duration::from_secs(10));
}

/// Moves the laggard past the `n` events it has not read yet.
fn pass_all(c: &mut Client, n: usize) {
    let events = read(c, "laggard", 100);
    assert_eq!(events.len(), n);
    c.execute(
        "SELECT outbox.advance('laggard', $1)",
        &[&events.last().unwrap().0],
    )
    .unwrap();
}

/// Waits for the worker to have emptied the log.
fn wait_pruned(c: &mut Client) {
    eventually("the worker to prune", Duration::from_secs(30), || {
        (count(c, "SELECT count(*) FROM outbox.events") == 0).then_some(())
    });
}

#[test]
fn the_worker_prunes_on_a_timer_whole_partitions_that_every_consumer_passed() {
    let (db, mut c) = setup("sink_prune");
    recording_sink(&mut c, "books", "");
    c.batch_execute("SELECT outbox.create_consumer('laggard')")
        .unwrap();
    db.cluster().set("pg_outbox.retention", "0");
    db.cluster().set("pg_outbox.prune_interval", "1s");
    raise_delivered(&mut c, 1, 20);
    // Once the workers have kept the one-second period (the new period) for as long as they
    // wait before truncating anything, and then a few prunes more: the laggard, which has passed
    // only ten of the events, still holds the partition of all twenty.
    let p: String = c
        .query_one(
            "SELECT position FROM outbox.read('laggard', 10) OFFSET 9",
            &[],
        )
        .unwrap()
        .get(0);
    c.execute("SELECT outbox.advance('laggard', $1)", &[&p])
        .unwrap();
    wait_period(&mut c, 1, 9);
    assert_eq!(count(&mut c, "SELECT count(*) FROM outbox.events"), 20);
    assert_eq!(
        read(&mut c, "laggard", 100).len(),
        10,
        "the laggard still reads what it has not passed"
    );
    // Once it has passed them all, the partition goes, whole.
    let p: String = c
        .query_one(
            "SELECT position FROM outbox.read('laggard', 100) OFFSET 9",
            &[],
        )
        .unwrap()
        .get(0);
    c.execute("SELECT outbox.advance('laggard', $1)", &[&p])
        .unwrap();
    wait_pruned(&mut c);
    assert_eq!(
        dead_rows(&mut c),
        0,
        "pruning deleted nothing: it truncated"
    );
    // The worker logs a truncation once it has committed: the log may trail the empty table.
    eventually("the truncation in the log", Duration::from_secs(10), || {
        db.cluster()
            .log()
            .contains("pg_outbox: pruned the log: truncated outbox.events_")
            .then_some(())
    });
    // The log goes on after the truncation: new events reach the laggard and the sink.
    raise_delivered(&mut c, 21, 25);
    pass_all(&mut c, 5);

    // With a retention, a partition every reader passed still waits until its newest event is
    // that old. A new period (2 s): nothing is truncated until it has settled.
    db.cluster().set("pg_outbox.retention", "3s");
    wait_period(&mut c, 2, 11);
    raise_delivered(&mut c, 26, 30);
    pass_all(&mut c, 5);
    let newest: std::time::SystemTime = c
        .query_one("SELECT max(raised_at) FROM outbox.events", &[])
        .unwrap()
        .get(0);
    wait_pruned(&mut c);
    let kept = std::time::SystemTime::now()
        .duration_since(newest)
        .unwrap_or_default();
    assert!(
        kept >= Duration::from_secs(3),
        "events passed by every reader were kept only {kept:?}, under the 3 s retention"
    );
    assert_eq!(dead_rows(&mut c), 0);

    // A transaction older than the cursors (pg_dump's, say) would find a truncated partition
    // empty while it still sees the cursors behind its events: then the workers DELETE instead.
    raise_delivered(&mut c, 31, 35);
    let mut dump = db.connect();
    dump.batch_execute(
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM outbox.consumers",
    )
    .unwrap();
    pass_all(&mut c, 5);
    wait_pruned(&mut c);
    assert_eq!(
        count(&mut dump, "SELECT count(*) FROM outbox.events"),
        5,
        "the older transaction still sees the events its cursors have not passed"
    );
    dump.batch_execute("COMMIT").unwrap();
    let line = eventually("the deletion in the log", Duration::from_secs(10), || {
        db.cluster()
            .log()
            .lines()
            .find(|l| l.contains("pg_outbox: pruned the log: deleted 5 events of outbox.events_"))
            .map(str::to_string)
    });
    assert!(
        line.contains("(a transaction older than the cursors was running)"),
        "{line}"
    );

    // A reader that holds the partitions (a lock, no snapshot) longer than the worker waits:
    // the passed events are deleted around it.
    raise_delivered(&mut c, 36, 40);
    dump.batch_execute("BEGIN; LOCK TABLE outbox.events IN ACCESS SHARE MODE")
        .unwrap();
    pass_all(&mut c, 5);
    wait_pruned(&mut c);
    dump.batch_execute("COMMIT").unwrap();
    eventually(
        "the worker to say a reader held the partition",
        Duration::from_secs(10),
        || {
            db.cluster()
                .log()
                .contains("instead of truncating it (a reader held it)")
                .then_some(())
        },
    );

    // A role with nothing but CONNECT that keeps a snapshot open can make the workers DELETE,
    // never stop them pruning; once it ends, whole partitions are truncated again.
    let older = |log: &str| {
        log.lines()
            .filter(|l| {
                l.contains("pg_outbox: pruned the log: deleted 5 events of outbox.events_")
                    && l.contains("(a transaction older than the cursors was running)")
            })
            .count()
    };
    let before = older(&db.cluster().log());
    let mut su = db.connect();
    su.batch_execute(&format!(
        "DO $$ BEGIN CREATE ROLE prune_idler LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
         GRANT CONNECT ON DATABASE \"{}\" TO prune_idler;",
        db.name
    ))
    .unwrap();
    let mut idler = db.connect_as("prune_idler");
    idler
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .unwrap();
    raise_delivered(&mut c, 41, 45);
    pass_all(&mut c, 5);
    wait_pruned(&mut c);
    eventually(
        "the worker to delete the passed events around the idle session",
        Duration::from_secs(10),
        || (older(&db.cluster().log()) == before + 1).then_some(()),
    );
    idler.batch_execute("COMMIT").unwrap();
    let truncated = |log: &str| log.matches("pg_outbox: pruned the log: truncated").count();
    let before = truncated(&db.cluster().log());
    raise_delivered(&mut c, 46, 50);
    pass_all(&mut c, 5);
    wait_pruned(&mut c);
    eventually(
        "a partition truncated again",
        Duration::from_secs(30),
        || (truncated(&db.cluster().log()) > before).then_some(()),
    );

    // Under load some transaction has always just begun when the worker reads the cursors; it
    // waits for those to end (milliseconds) and still truncates, instead of deleting.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut busy = db.connect();
    let load = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut statements = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                busy.batch_execute("SELECT pg_sleep(0.003)").unwrap();
                statements += 1;
            }
            statements
        })
    };
    let deleted = |log: &str| log.matches("pg_outbox: pruned the log: deleted").count();
    let (truncated_before, deleted_before) =
        (truncated(&db.cluster().log()), deleted(&db.cluster().log()));
    raise_delivered(&mut c, 51, 55);
    pass_all(&mut c, 5);
    wait_pruned(&mut c);
    eventually("the truncation in the log", Duration::from_secs(10), || {
        (truncated(&db.cluster().log()) > truncated_before).then_some(())
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(load.join().unwrap() > 0);
    // (The server log, not the statistics: a truncation resets a partition's dead tuples.)
    assert_eq!(
        deleted(&db.cluster().log()),
        deleted_before,
        "pruning under load deleted nothing"
    );
    db.cluster().set("pg_outbox.retention", "7d");
    db.cluster().set("pg_outbox.prune_interval", "1h");
}

#[test]
fn drop_extension_with_the_worker_running_succeeds_and_create_extension_brings_it_back() {
    let (db, mut c) = setup("sink_drop_ext");
    recording_sink(&mut c, "books", ", batch_size => 5");
    // Slow batches, so that the DROP lands while a worker is inside a pass.
    c.batch_execute("UPDATE control SET sleep = 0.3").unwrap();
    c.batch_execute("SELECT outbox.raise('load.tick') FROM generate_series(1, 50)")
        .unwrap();
    wait_ledger(&mut c, "books", 5, Duration::from_secs(10));
    let start = Instant::now();
    c.batch_execute("DROP EXTENSION pg_outbox CASCADE").unwrap();
    assert!(start.elapsed() < Duration::from_secs(5));
    // The workers leave the database, and the launcher starts none there again: no crash loop.
    eventually("the workers to leave", Duration::from_secs(10), || {
        db.cluster().worker_pids().is_empty().then_some(())
    });
    c.batch_execute("SELECT pg_sleep(1.5)").unwrap();
    assert_eq!(
        db.cluster().worker_pids(),
        Vec::<i32>::new(),
        "no worker started in a database without pg_outbox"
    );
    assert!(
        !db.cluster().log().contains("pg_outbox worker 0 is idle"),
        "no worker waits there"
    );
    c.batch_execute("DROP TABLE ledger, control CASCADE; CREATE EXTENSION pg_outbox")
        .unwrap();
    c.batch_execute(LEDGER).unwrap();
    recording_sink(&mut c, "books", "");
    c.batch_execute("SELECT outbox.raise('load.again')")
        .unwrap();
    wait_ledger(&mut c, "books", 1, Duration::from_secs(10));
}

#[test]
fn ddl_that_locks_the_extension_in_any_order_never_deadlocks_with_the_workers() {
    let (db, mut c) = setup("sink_ddl_order");
    recording_sink(&mut c, "books", ", batch_size => 5");
    // Fan-out and jobs too: they write outbox.jobs and take ids from its sequence.
    c.batch_execute(
        "SELECT outbox.subscribe('fan', '{load.*}', queue => 'fanned');
         UPDATE control SET sleep = 0.02",
    )
    .unwrap();
    let members: Vec<(String, bool)> = c
        .query(
            "SELECT c.oid::regclass::text, c.relkind = 'S' FROM pg_depend d JOIN pg_class c ON c.oid = d.objid \
              WHERE d.classid = 'pg_class'::regclass AND d.deptype = 'e' \
                AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pg_outbox') \
              ORDER BY c.oid",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(members.len() > 10, "{members:?}");
    // Events keep coming while the DDL runs, so that the workers are always inside a step.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let raiser = {
        let stop = stop.clone();
        let mut r = db.connect();
        std::thread::spawn(move || {
            // An application waits on the DDL like on any other; it gives up before a deadlock
            // could be detected, so that any deadlock found is the workers'.
            r.batch_execute("SET lock_timeout = '100ms'").unwrap();
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match r.batch_execute("SELECT outbox.raise('load.tick')") {
                    Ok(()) => n += 1,
                    Err(e) => assert_eq!(
                        e.code(),
                        Some(&postgres::error::SqlState::LOCK_NOT_AVAILABLE),
                        "{e}"
                    ),
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            n
        })
    };
    let deadlocks = |db: &TestDb| db.cluster().log().matches("deadlock detected").count();
    let before = deadlocks(&db);
    let mut raised = 0;
    // DDL takes the extension's relations one at a time, as DROP and ALTER EXTENSION do: here each
    // one first, then the tables every worker step reads, while the workers deliver, fan out and
    // announce jobs.
    for (i, (rel, sequence)) in members.iter().enumerate() {
        if i % 6 == 0 {
            c.batch_execute("SELECT outbox.raise('load.tick') FROM generate_series(1, 30)")
                .unwrap();
            raised += 30;
        }
        let mut t = c.transaction().unwrap();
        t.batch_execute("SET LOCAL lock_timeout = '10s'").unwrap();
        // A sequence cannot be named in LOCK TABLE; ALTER SEQUENCE takes a lock that nextval
        // waits for.
        let lock = if *sequence {
            format!("ALTER SEQUENCE {rel} NO CYCLE")
        } else {
            format!("LOCK TABLE {rel} IN ACCESS EXCLUSIVE MODE")
        };
        t.batch_execute(&format!(
            "{lock}; SELECT pg_sleep(0.15); \
             LOCK TABLE outbox.jobs, outbox.events, outbox.sinks IN ACCESS EXCLUSIVE MODE"
        ))
        .unwrap_or_else(|e| panic!("locking {rel}: {e}"));
        t.commit().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    raised += raiser.join().unwrap();
    let ledger = wait_ledger(&mut c, "books", raised, Duration::from_secs(20));
    assert_eq!(ledger.len(), raised, "each event once");
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.jobs WHERE queue = 'fanned'"
        ),
        raised as i64
    );
    let log = db.cluster().log();
    assert_eq!(
        deadlocks(&db),
        before,
        "no deadlock, on either side: {}",
        log.lines()
            .filter(|l| l.contains("deadlock")
                || l.contains("Process ")
                || l.contains("STATEMENT")
                || l.contains("CONTEXT"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn every_commit_wakes_a_worker_without_waiting_for_the_poll_interval() {
    let (db, mut c) = setup("sink_wake");
    // A lost wake-up would now cost 30 s; each event must arrive within 5.
    db.cluster().set("pg_outbox.poll_interval", "30s");
    recording_sink(&mut c, "books", "");
    recording_sink(&mut c, "other", "");
    for i in 1..=20 {
        c.batch_execute("SELECT outbox.raise('wake.one')").unwrap();
        wait_ledger(&mut c, "books", i, Duration::from_secs(5));
    }
    // Concurrent writers while one worker sits in a slow handler: a commit then wakes the other
    // worker, which finds the sink leased and must look again rather than sleep.
    c.batch_execute("UPDATE control SET sleep = 0.05 WHERE sink = 'books'")
        .unwrap();
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let mut c = db.connect();
            std::thread::spawn(move || {
                for i in 0..25u64 {
                    c.batch_execute("SELECT outbox.raise('wake.many')").unwrap();
                    std::thread::sleep(Duration::from_millis((i * 7 + w * 3) % 11));
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    wait_ledger(&mut c, "books", 120, Duration::from_secs(5));
    wait_ledger(&mut c, "other", 120, Duration::from_secs(5));
    db.cluster().set("pg_outbox.poll_interval", "1s");
}

#[test]
fn a_handler_that_runs_past_the_sink_timeout_is_cancelled_and_counted_as_a_failure() {
    let (db, mut c) = setup("sink_timeout");
    db.cluster().set("pg_outbox.sink_timeout", "300ms");
    recording_sink(&mut c, "books", "");
    c.batch_execute("UPDATE control SET sleep = 5").unwrap();
    let start = Instant::now();
    c.batch_execute("SELECT outbox.raise('slow.event')")
        .unwrap();
    eventually(
        "the timeout to be recorded",
        Duration::from_secs(10),
        || {
            let r = c
                .query_one(
                    "SELECT last_sqlstate, attempts FROM outbox.status() WHERE name = 'books'",
                    &[],
                )
                .unwrap();
            (r.get::<_, Option<String>>(0).as_deref() == Some("57014")).then_some(())
        },
    );
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "cancelled long before the handler's 5 s"
    );
    assert!(ledger(&mut c, "books").is_empty());
    // Fast again: delivered, once.
    c.batch_execute("UPDATE control SET sleep = 0").unwrap();
    let rows = wait_ledger(&mut c, "books", 1, Duration::from_secs(10));
    assert_eq!(rows.len(), 1);
    db.cluster().set("pg_outbox.sink_timeout", "30s");
}

#[test]
fn status_counts_only_the_events_of_a_readers_topics_and_the_age_of_the_oldest() {
    let db = worker_db("status_topics");
    let mut c = db.connect();
    c.batch_execute(
        "CREATE FUNCTION public.nothing(e outbox.event[]) RETURNS void LANGUAGE sql AS $$ SELECT $$;
         CREATE FUNCTION public.nothing_one(e outbox.event) RETURNS void LANGUAGE sql AS $$ SELECT $$;
         SELECT outbox.create_sink('orders', 'public.nothing(outbox.event[])', ARRAY['order.*']);
         SELECT outbox.pause_sink('orders');
         SELECT outbox.subscribe('refunds', ARRAY['refund.#'], 'public.nothing_one(outbox.event)');
         SELECT outbox.pause_subscription('refunds');
         SELECT outbox.create_consumer('all');
         SELECT outbox.raise('order.placed') FROM generate_series(1, 3);
         SELECT outbox.raise('refund.issued.eu');
         SELECT outbox.raise('stock.moved') FROM generate_series(1, 5);",
    )
    .unwrap();
    let behind = |c: &mut Client| -> Vec<(String, i64, bool, String)> {
        c.query(
            "SELECT name, events_behind, age_behind IS NOT NULL, state FROM outbox.status() \
             ORDER BY name",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
    };
    assert_eq!(
        behind(&mut c),
        [
            ("all".to_string(), 9, true, "behind".to_string()),
            ("orders".into(), 3, true, "paused".into()),
            ("refunds".into(), 1, true, "paused".into()),
        ]
    );
    // Held behind a running transaction: the oldest is still aged, and only a reader whose
    // topics it holds waits for it.
    let mut holder = db.connect();
    holder
        .batch_execute("BEGIN; SELECT pg_current_xact_id();")
        .unwrap();
    c.batch_execute(
        "SELECT outbox.advance('all', (SELECT r.position FROM outbox.read('all', 100) WITH ORDINALITY r
                                       ORDER BY r.ordinality DESC LIMIT 1));
         SELECT outbox.raise('stock.moved');",
    )
    .unwrap();
    let all: (i64, bool, String) = {
        let r = c
            .query_one(
                "SELECT events_behind, age_behind IS NOT NULL, state FROM outbox.status() \
                 WHERE name = 'all'",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(all, (0, true, "held by horizon".to_string()));
    c.batch_execute("SELECT outbox.resume_sink('orders')")
        .unwrap();
    eventually("orders to pass its events", Duration::from_secs(20), || {
        let r = c
            .query_one(
                "SELECT events_behind, age_behind IS NULL, state FROM outbox.status() \
                 WHERE name = 'orders'",
                &[],
            )
            .unwrap();
        // The stock event behind the horizon is not its topic: it is idle, not held.
        (r.get::<_, i64>(0) == 0 && r.get::<_, bool>(1) && r.get::<_, String>(2) == "idle")
            .then_some(())
    });
    holder.batch_execute("ROLLBACK").unwrap();
}
