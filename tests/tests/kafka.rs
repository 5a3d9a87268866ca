//! Kafka sinks against a real Apache Kafka 4 broker (KRaft, one node on 127.0.0.1, started by
//! scripts/kafka.sh): every committed event arrives, once by `ce_id`, in order per key, from
//! writers committing out of order with rollbacks; a message the broker refuses for itself is
//! dead-lettered after the neighbour test while its neighbours arrive; a broker killed mid-stream
//! loses nothing; a topic the sink may not write (ACLs over SASL) dead-letters only the events
//! bound for it; internal addresses are refused and secrets stay out of sight.

use pg_outbox_tests::kafka::{Broker, Record};
use pg_outbox_tests::{eventually, position, sqlstate, worker_db};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

/// The records with the first of each `ce_id` only (a redelivery after a failure repeats some).
fn first_of_each(records: &[Record]) -> Vec<Record> {
    let mut seen = HashSet::new();
    let mut by_partition: BTreeMap<i32, Vec<&Record>> = BTreeMap::new();
    for r in records {
        by_partition.entry(r.partition).or_default().push(r);
    }
    let mut out = Vec::new();
    for (_, mut rs) in by_partition {
        rs.sort_by_key(|r| r.offset);
        for r in rs {
            if seen.insert(r.header("ce_id").unwrap_or_default().to_string()) {
                out.push(r.clone());
            }
        }
    }
    out
}

/// The last error `outbox.status()` shows for sink `name`, as the connected role sees it.
fn last_error(c: &mut pg_outbox_tests::postgres::Client, name: &str) -> Option<String> {
    c.query_one(
        "SELECT last_error FROM outbox.status() WHERE name = $1",
        &[&name],
    )
    .unwrap()
    .get(0)
}

/// Waits (up to 90 s) for the one dead letter of `sink`: "<the event's n>: <error>".
fn dead_letter(c: &mut pg_outbox_tests::postgres::Client, sink: &str, what: &str) -> String {
    eventually(what, Duration::from_secs(90), || {
        c.query_opt(
            "SELECT (event).payload->>'n' || ': ' || error FROM outbox.dead_letters WHERE sink = $1",
            &[&sink],
        )
        .unwrap()
        .map(|r| r.get(0))
    })
}

/// The `n` of each record's payload, in the records' order.
fn values_of_n(records: &[Record]) -> Vec<i64> {
    records
        .iter()
        .map(|r| {
            serde_json::from_str::<serde_json::Value>(&r.value).unwrap()["n"]
                .as_i64()
                .unwrap()
        })
        .collect()
}

/// Checks that each key's events arrive in the order of their positions (within a partition,
/// where one key's messages all are).
fn in_order_per_key(records: &[Record]) {
    let mut last: BTreeMap<String, (u64, i64)> = BTreeMap::new();
    let mut by_partition: BTreeMap<i32, Vec<&Record>> = BTreeMap::new();
    for r in records {
        by_partition.entry(r.partition).or_default().push(r);
    }
    for (_, mut rs) in by_partition {
        rs.sort_by_key(|r| r.offset);
        for r in rs {
            let key = r.key.clone().unwrap_or_default();
            let at = position(r.header("ce_position").expect("ce_position"));
            if let Some(before) = last.insert(key.clone(), at) {
                assert!(before < at, "key {key}: {before:?} then {at:?}");
            }
        }
    }
}

/// Eight writers, each committing and rolling back `rounds` transactions of one to three
/// events on five keys shared between them: commits land out of order. The ids of the events
/// committed.
fn write_orders(db: &pg_outbox_tests::TestDb, rounds: i32) -> HashSet<String> {
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let mut c = db.connect();
            std::thread::spawn(move || {
                let mut committed = Vec::new();
                for i in 0..rounds {
                    let mut tx = c.transaction().unwrap();
                    let mut ids = Vec::new();
                    for j in 0..(1 + (w + i) % 3) {
                        let id: String = tx
                            .query_one(
                                "SELECT outbox.raise('order.placed', jsonb_build_object('w', $1::int, 'i', $2::int, 'j', $3::int, 'big', 12345678901234567890123), subject => $4)::text",
                                &[&w, &i, &j, &format!("key-{}", (w + j) % 5)],
                            )
                            .unwrap()
                            .get(0);
                        ids.push(id);
                    }
                    if i % 4 == 3 {
                        tx.rollback().unwrap();
                    } else {
                        tx.commit().unwrap();
                        committed.extend(ids);
                    }
                }
                committed
            })
        })
        .collect();
    writers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect()
}

#[test]
fn a_kafka_sink_delivers_every_committed_event_once_in_order_per_key() {
    let db = worker_db("kafka_order");
    db.cluster().set("pg_outbox.kafka_allow_private", "on");
    let broker = Broker::start("order");
    broker.topic("orders", 3, &[]);
    let mut c = db.connect();
    c.batch_execute(&format!(
        "SELECT outbox.create_kafka_sink('to-kafka', '{}', 'orders', topics => '{{order.*}}', batch_size => 50)",
        broker.address()
    ))
    .unwrap();
    let committed = write_orders(&db, 40);
    // An event of another topic is not for this sink.
    c.batch_execute("SELECT outbox.raise('invoice.sent', '{}')")
        .unwrap();
    let records = broker.consume("orders", committed.len(), Duration::from_secs(60));
    let firsts = first_of_each(&records);
    let got: HashSet<String> = firsts
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_string())
        .collect();
    assert_eq!(got.len(), committed.len(), "{} records", records.len());
    assert_eq!(got, committed, "every committed event, and nothing else");
    in_order_per_key(&firsts);
    // CloudEvents binary mode: the payload is the value, the attributes are headers.
    let r = &firsts[0];
    assert_eq!(r.header("ce_specversion"), Some("1.0"));
    assert_eq!(r.header("ce_type"), Some("order.placed"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.header("ce_source"),
        Some(format!("/pg_outbox/{}", db.name).as_str())
    );
    assert_eq!(r.header("ce_subject"), r.key.as_deref());
    assert!(r.header("ce_time").is_some_and(|t| t.ends_with('Z')));
    let value: serde_json::Value = serde_json::from_str(&r.value).unwrap();
    assert!(value.get("w").is_some());
    assert!(
        r.value.contains("12345678901234567890123"),
        "numbers pass unrounded: {}",
        r.value
    );
    // The cursor moved past everything, and the sink says so.
    eventually("the sink to be caught up", Duration::from_secs(10), || {
        let state: String = c
            .query_one(
                "SELECT state FROM outbox.status() WHERE name = 'to-kafka'",
                &[],
            )
            .unwrap()
            .get(0);
        (state == "idle").then_some(())
    });
}

#[test]
fn a_message_the_broker_refuses_is_dead_lettered_after_the_neighbour_test() {
    let db = worker_db("kafka_poison");
    db.cluster().set("pg_outbox.kafka_allow_private", "on");
    let broker = Broker::start("poison");
    broker.topic("small", 1, &["max.message.bytes=1000"]);
    let mut c = db.connect();
    // Windows of 4, chained 8 deep behind one another: the windows after the poison one are in
    // flight when it fails, and must not land ahead of what it is sent again with.
    c.batch_execute(&format!(
        "SELECT outbox.create_kafka_sink('small', '{}', 'small', timeout_ms => 5000, batch_size => 4);
         SELECT outbox.raise('t', jsonb_build_object('n', n, 'pad', CASE WHEN n = 15 THEN repeat('x', 3000) ELSE '' END), subject => 'k')
           FROM generate_series(1, 40) n;",
        broker.address()
    ))
    .unwrap();
    let dead = dead_letter(&mut c, "small", "the big event dead-lettered");
    assert!(dead.starts_with("15: "), "{dead}");
    assert!(dead.to_lowercase().contains("too large"), "{dead}");
    let records = broker.consume("small", 39, Duration::from_secs(30));
    let ns = values_of_n(&first_of_each(&records));
    assert_eq!(
        ns,
        (1..=40).filter(|n| *n != 15).collect::<Vec<i64>>(),
        "its neighbours arrive, in order"
    );
    // A replay tries it again: still too large, so it goes back to the dead letters.
    c.batch_execute("SELECT outbox.replay('small')").unwrap();
    eventually("the replay to fail back", Duration::from_secs(30), || {
        let attempts: i32 = c
            .query_one(
                "SELECT attempts FROM outbox.dead_letters WHERE sink = 'small' AND replay_requested_at IS NULL",
                &[],
            )
            .ok()?
            .get(0);
        (attempts > 1).then_some(())
    });
}

#[test]
fn a_broker_killed_mid_stream_loses_nothing() {
    let db = worker_db("kafka_crash");
    db.cluster().set("pg_outbox.kafka_allow_private", "on");
    let broker = Broker::start("crash");
    broker.topic("stream", 3, &[]);
    let mut c = db.connect();
    c.batch_execute(&format!(
        "SELECT outbox.create_kafka_sink('stream', '{}', 'stream', timeout_ms => 3000)",
        broker.address()
    ))
    .unwrap();
    let raise = |c: &mut pg_outbox_tests::postgres::Client, from: i32, to: i32| {
        c.query(
            "SELECT outbox.raise('s', jsonb_build_object('n', n), subject => 'k' || (n % 7))::text
               FROM generate_series($1::int, $2::int) n",
            &[&from, &to],
        )
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect::<Vec<_>>()
    };
    let mut ids = raise(&mut c, 1, 300);
    std::thread::sleep(Duration::from_millis(300));
    broker.kill();
    ids.extend(raise(&mut c, 301, 600));
    // The sink fails while the broker is down, and dead-letters nothing.
    eventually("the sink to notice", Duration::from_secs(30), || {
        last_error(&mut c, "stream")
    });
    broker.restart();
    ids.extend(raise(&mut c, 601, 700));
    let records = broker.consume("stream", ids.len(), Duration::from_secs(90));
    let firsts = first_of_each(&records);
    let got: HashSet<String> = firsts
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_string())
        .collect();
    assert_eq!(got, ids.iter().cloned().collect::<HashSet<_>>());
    in_order_per_key(&firsts);
    let dead: i64 = c
        .query_one("SELECT count(*) FROM outbox.dead_letters", &[])
        .unwrap()
        .get(0);
    assert_eq!(dead, 0, "an outage dead-letters nothing");
}

#[test]
fn kafka_sinks_refuse_internal_addresses_and_keep_their_secrets() {
    let db = worker_db("kafka_safety");
    let broker = Broker::start("safety");
    broker.topic("safe", 1, &[]);
    let mut c = db.connect();
    let role = format!("kafka_tenant_{}", db.name);
    c.batch_execute(&format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA outbox TO {role};
         GRANT EXECUTE ON FUNCTION outbox.raise(text, jsonb, text, text, jsonb), outbox.status(),
                                   outbox.create_kafka_sink(text, text, text, text[], text, integer, jsonb, integer, text)
            TO {role};"
    ))
    .unwrap();
    let mut t = db.connect_as(&role);
    let address = broker.address();
    db.cluster().set("pg_outbox.kafka_allow_private", "off");
    for (sql, code) in [
        // Internal addresses, unless a superuser allows them; metadata never.
        (format!("SELECT outbox.create_kafka_sink('k', '{address}', 'safe')"), "22023"),
        ("SELECT outbox.create_kafka_sink('k', '169.254.169.254:9092', 'safe')".into(), "22023"),
        ("SELECT outbox.create_kafka_sink('k', '[::1]:9092', 'safe')".into(), "22023"),
        // Properties are an allowlist: nothing that reads a file or loads a library.
        ("SELECT outbox.create_kafka_sink('k', 'kafka.example.com:9092', 'safe', properties => '{\"plugin.library.paths\": \"/tmp/evil.so\"}')".into(), "22023"),
        ("SELECT outbox.create_kafka_sink('k', 'kafka.example.com:9092', 'safe', properties => '{\"ssl.key.location\": \"/etc/ssl/private/server.key\"}')".into(), "22023"),
        ("SELECT outbox.create_kafka_sink('k', 'kafka.example.com:9092', 'safe', properties => '{\"acks\": \"0\"}')".into(), "22023"),
        // Bad input.
        ("SELECT outbox.create_kafka_sink('k', 'kafka.example.com', 'safe')".into(), "22023"),
        ("SELECT outbox.create_kafka_sink('k', 'kafka.example.com:9092', 'bad topic')".into(), "22023"),
        ("SELECT outbox.create_kafka_sink('k', 'kafka.example.com:9092', 'safe', key => 'payload')".into(), "22023"),
        ("SELECT outbox.create_kafka_sink('k', 'kafka.example.com:9092', 'safe', timeout_ms => 10)".into(), "22023"),
        ("SELECT outbox.create_kafka_sink('k', NULL, 'safe')".into(), "22004"),
    ] {
        assert_eq!(sqlstate(&mut t, &sql), code, "{sql}");
    }
    // A name that resolves to loopback passes creation (a name is not an address), but the
    // producer never connects there: every connection is checked.
    t.batch_execute(&format!(
        "SELECT outbox.create_kafka_sink('named', 'localhost:{}', 'safe', timeout_ms => 2000,
                properties => '{{\"sasl.password\": \"hunter2-kafka-secret\", \"sasl.username\": \"u\"}}');
         SELECT outbox.raise('t', '{{}}');",
        broker.port
    ))
    .unwrap();
    let error: String = eventually("the refused connection", Duration::from_secs(30), || {
        last_error(&mut t, "named")
    });
    assert!(error.contains("address is internal"), "{error}");
    assert!(
        !error.contains("127.0.0.1"),
        "the address itself is not shown: {error}"
    );
    // The password is nowhere a role or the log can see.
    let mut su = db.connect();
    let visible: i64 = su
        .query_one(
            "SELECT count(*) FROM outbox.status() WHERE coalesce(last_error, '') LIKE '%hunter2%'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(visible, 0);
    assert_eq!(
        sqlstate(&mut t, "SELECT * FROM outbox.kafka_sinks"),
        "42501"
    );
    assert!(
        !db.cluster().log().contains("hunter2-kafka-secret"),
        "the secret is in the server log"
    );
    // The allowlist holds for the brokers the cluster's metadata names too: bootstrapped through
    // an allowed name, a broker that advertises itself as 127.0.0.1 is not reached.
    db.cluster().set("pg_outbox.kafka_allow_private", "on");
    db.cluster()
        .set("pg_outbox.kafka_allowed_brokers", "localhost");
    su.batch_execute(&format!(
        "SELECT outbox.create_kafka_sink('meta', 'localhost:{}', 'safe', timeout_ms => 2000, start_at => 'now');
         SELECT outbox.raise('t.meta', '{{\"via\": \"metadata\"}}');",
        broker.port
    ))
    .unwrap();
    let error: String = eventually("the refused broker", Duration::from_secs(30), || {
        last_error(&mut su, "meta")
    });
    assert!(
        error.contains(
            "named broker \"127.0.0.1\", which is not in pg_outbox.kafka_allowed_brokers"
        ),
        "{error}"
    );
    let dead: i64 = su
        .query_one(
            "SELECT count(*) FROM outbox.dead_letters WHERE sink = 'meta'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(dead, 0, "a refused broker is an outage, not poison");
    // Once a superuser allows it, the waiting event goes through.
    db.cluster()
        .set("pg_outbox.kafka_allowed_brokers", "localhost, 127.0.0.1");
    let got = broker.consume("safe", 1, Duration::from_secs(60));
    assert!(got.iter().any(|r| r.value.contains("metadata")), "{got:?}");
    db.cluster().set("pg_outbox.kafka_allowed_brokers", "");
}

/// A connection to `db`, waiting out a server that is restarting after a crash.
fn reconnect(db: &pg_outbox_tests::TestDb) -> pg_outbox_tests::postgres::Client {
    eventually(
        "the server to take connections",
        Duration::from_secs(60),
        || {
            pg_outbox_tests::postgres::Config::new()
                .host_path(db.cluster().socket_dir())
                .port(db.cluster().port())
                .user("postgres")
                .dbname(&db.name)
                .connect_timeout(Duration::from_secs(5))
                .connect(pg_outbox_tests::postgres::NoTls)
                .ok()
        },
    )
}

#[test]
fn a_worker_killed_between_produce_and_acknowledgement_loses_nothing() {
    let db = worker_db("kafka_kill");
    db.cluster().set("pg_outbox.kafka_allow_private", "on");
    let broker = Broker::start("kill");
    broker.topic("killed", 3, &[]);
    let mut c = db.connect();
    c.batch_execute(&format!(
        "SELECT outbox.create_kafka_sink('killed', '{}', 'killed', batch_size => 200)",
        broker.address()
    ))
    .unwrap();
    let mut ids = Vec::new();
    for t in 0..10 {
        ids.extend(
            c.query(
                "SELECT outbox.raise('k', jsonb_build_object('t', $1::int, 'n', n), subject => 'k' || (n % 10))::text
                   FROM generate_series(1, 300) n",
                &[&t],
            )
            .unwrap()
            .iter()
            .map(|r| r.get::<_, String>(0)),
        );
    }
    // SIGKILL the workers while windows fly: each kill resets the whole server (as a crash), with
    // messages produced and not yet acknowledged, or acknowledged and not yet recorded.
    let mut kills = 0;
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(400));
        for pid in db.cluster().worker_pids() {
            // SAFETY: a signal to a process of the test's own cluster.
            if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                kills += 1;
            }
        }
        drop(reconnect(&db));
    }
    assert!(kills > 0, "no worker to kill");
    let records = broker.consume("killed", ids.len(), Duration::from_secs(120));
    let firsts = first_of_each(&records);
    let got: HashSet<String> = firsts
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_string())
        .collect();
    assert_eq!(
        got,
        ids.iter().cloned().collect::<HashSet<_>>(),
        "{} records",
        records.len()
    );
    in_order_per_key(&firsts);
    let mut c = reconnect(&db);
    let dead: i64 = c
        .query_one("SELECT count(*) FROM outbox.dead_letters", &[])
        .unwrap()
        .get(0);
    assert_eq!(dead, 0);
}

#[test]
fn a_rewind_while_windows_fly_sends_everything_again_in_order() {
    let db = worker_db("kafka_rewind");
    db.cluster().set("pg_outbox.kafka_allow_private", "on");
    let broker = Broker::start("rewind");
    broker.topic("again", 1, &[]);
    let mut c = db.connect();
    // Windows of 4, chained 8 deep: the rewind comes while windows fly.
    c.batch_execute(&format!(
        "SELECT outbox.create_kafka_sink('again', '{}', 'again', batch_size => 4);
         SELECT outbox.raise('t', jsonb_build_object('n', n), subject => 'k') FROM generate_series(1, 2000) n;",
        broker.address()
    ))
    .unwrap();
    eventually("the first windows", Duration::from_secs(60), || {
        let delivered: i64 = c
            .query_one("SELECT delivered FROM outbox.sinks WHERE id = 'again'", &[])
            .unwrap()
            .get(0);
        (delivered >= 100).then_some(())
    });
    c.batch_execute("SELECT outbox.rewind('again', '0:0')")
        .unwrap();
    eventually("the sink to catch up", Duration::from_secs(120), || {
        let behind: i64 = c
            .query_one(
                "SELECT events_behind FROM outbox.status() WHERE name = 'again'",
                &[],
            )
            .unwrap()
            .get(0);
        (behind == 0).then_some(())
    });
    let mut records = broker.consume("again", 2000, Duration::from_secs(60));
    records.sort_by_key(|r| r.offset);
    let ns = values_of_n(&records);
    // From the origin again: after the last copy of the first event, every event, in order.
    let again = ns.iter().rposition(|n| *n == 1).expect("the first event");
    assert!(again > 0, "sent again from the origin");
    assert_eq!(ns[again..], (1..=2000).collect::<Vec<i64>>()[..]);
}

#[test]
fn a_topic_the_sink_may_not_write_is_dead_lettered_while_its_neighbours_arrive() {
    let db = worker_db("kafka_acl");
    db.cluster().set("pg_outbox.kafka_allow_private", "on");
    // The sink authenticates as "tenant" (SASL PLAIN), which may write t.ok and not t.no.
    let broker = Broker::start_with_sasl("acl", &[("tenant", "tenant-secret")]);
    broker.topic("t.ok", 1, &[]);
    broker.topic("t.no", 1, &[]);
    broker.allow("tenant", "t.ok", &["Write", "Describe"]);
    let mut c = db.connect();
    c.batch_execute(&format!(
        "SELECT outbox.create_kafka_sink('acl', '{}', 't.{{topic}}', timeout_ms => 5000,
                properties => '{{\"security.protocol\": \"sasl_plaintext\", \"sasl.mechanism\": \"PLAIN\",
                                 \"sasl.username\": \"tenant\", \"sasl.password\": \"tenant-secret\"}}');
         SELECT outbox.raise(CASE WHEN n = 5 THEN 'no' ELSE 'ok' END, jsonb_build_object('n', n), subject => 'k')
           FROM generate_series(1, 10) n;",
        broker.sasl_address()
    ))
    .unwrap();
    let dead = dead_letter(&mut c, "acl", "the forbidden event dead-lettered");
    assert!(dead.starts_with("5: "), "{dead}");
    assert!(dead.to_lowercase().contains("authorization"), "{dead}");
    assert!(!dead.contains("tenant-secret"), "{dead}");
    let records = broker.consume("t.ok", 9, Duration::from_secs(30));
    let ns = values_of_n(&first_of_each(&records));
    assert_eq!(
        ns,
        [1, 2, 3, 4, 6, 7, 8, 9, 10],
        "its neighbours arrive, in order"
    );
    assert!(broker.consume("t.no", 0, Duration::from_secs(2)).is_empty());
}

#[test]
fn windows_cut_by_max_batch_bytes_chain_in_order() {
    let db = worker_db("kafka_bytes");
    db.cluster().set("pg_outbox.kafka_allow_private", "on");
    // 1 MB a window (and, read at once, all the windows a worker reads behind it): a window of
    // 16 events holds at most three of the 300 kB ones; the windows after a short one are read
    // once it is delivered.
    db.cluster().set("pg_outbox.max_batch_bytes", "1MB");
    let broker = Broker::start("bytes");
    broker.topic("big", 3, &[]);
    let mut c = db.connect();
    c.batch_execute(&format!(
        "SELECT outbox.create_kafka_sink('big', '{}', 'big', batch_size => 16); SELECT outbox.pause_sink('big');
         SELECT outbox.raise('t', jsonb_build_object('n', n, 'pad', CASE WHEN n % 4 = 0 THEN repeat('x', 300000) ELSE '' END),
                             subject => 'k')
           FROM generate_series(1, 80) n;
         SELECT outbox.resume_sink('big');",
        broker.address()
    ))
    .unwrap();
    let records = broker.consume("big", 80, Duration::from_secs(60));
    db.cluster().set("pg_outbox.max_batch_bytes", "16MB");
    assert_eq!(
        values_of_n(&first_of_each(&records)),
        (1..=80).collect::<Vec<i64>>(),
        "every event once, in order"
    );
    assert_eq!(last_error(&mut c, "big"), None);
}

#[test]
fn a_kafka_sink_by_ticks_delivers_while_a_long_transaction_is_open() {
    let db = worker_db("kafka_ticks");
    db.cluster().set("pg_outbox.kafka_allow_private", "on");
    let broker = Broker::start("ticks");
    broker.topic("orders", 3, &[]);
    let mut c = db.connect();
    c.batch_execute(&format!(
        "UPDATE outbox.lineage SET raised = true; \
         SELECT outbox.create_kafka_sink('to-kafka', '{}', 'orders', topics => '{{order.*}}', batch_size => 20); \
         SELECT outbox.alter_sink('to-kafka', '{{\"read_by\": \"ticks\"}}')",
        broker.address()
    ))
    .unwrap();
    // A long transaction holds its xid, and raised an event, while the writers commit.
    let mut long = db.connect();
    let long_id: String = {
        long.batch_execute("BEGIN").unwrap();
        long.query_one(
            "SELECT outbox.raise('order.placed', '{\"long\": true}', subject => 'key-0')::text",
            &[],
        )
        .unwrap()
        .get(0)
    };
    let mut committed = write_orders(&db, 30);
    // Every short event arrives while the long transaction is still open.
    let records = broker.consume("orders", committed.len(), Duration::from_secs(60));
    let got: HashSet<String> = first_of_each(&records)
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_string())
        .collect();
    assert_eq!(
        got, committed,
        "every short committed event, and nothing else"
    );
    long.batch_execute("COMMIT").unwrap();
    let long_id_copy = long_id.clone();
    committed.insert(long_id);
    let records = broker.consume("orders", committed.len(), Duration::from_secs(60));
    let firsts = first_of_each(&records);
    let got: HashSet<String> = firsts
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_string())
        .collect();
    assert_eq!(got, committed, "and the long one once it commits");
    // By ticks, positions do not increase from batch to batch: per key, each transaction's events
    // arrive in the order raised, and the long one (visible last) comes after the rest of its key.
    let mut by_partition: BTreeMap<i32, Vec<&Record>> = BTreeMap::new();
    for r in &firsts {
        by_partition.entry(r.partition).or_default().push(r);
    }
    let mut last_of: BTreeMap<(String, u64), i64> = BTreeMap::new();
    let mut last_of_key: BTreeMap<String, String> = BTreeMap::new();
    for (_, mut rs) in by_partition {
        rs.sort_by_key(|r| r.offset);
        for r in rs {
            let key = r.key.clone().unwrap_or_default();
            let (txid, seq) = position(r.header("ce_position").expect("ce_position"));
            if let Some(before) = last_of.insert((key.clone(), txid), seq) {
                assert!(
                    before < seq,
                    "key {key}, transaction {txid}: {before} then {seq}"
                );
            }
            last_of_key.insert(key, r.header("ce_id").unwrap().to_string());
        }
    }
    assert_eq!(
        last_of_key["key-0"], long_id_copy,
        "the long transaction's event last"
    );
    let tick: Option<i64> = c
        .query_one(
            "SELECT tick FROM outbox.consumers WHERE name = 'to-kafka'",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(tick.is_some(), "it reads by ticks");
}
