//! raise and raise_many from a client: what lands, what is refused (with its SQLSTATE), and that a
//! rollback leaves nothing.

use pg_outbox_tests::{read, sqlstate, test_db};

#[test]
fn raise_writes_one_event_that_a_consumer_reads_after_commit() {
    let db = test_db("raise_basic");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();
    let row = c
        .query_one(
            "SELECT outbox.raise('order.placed', '{\"order\": 42}', subject => 'order/42', tenant => 'acme', \
                                 headers => '{\"trace\": \"abc\"}')::text",
            &[],
        )
        .unwrap();
    let id: String = row.get(0);
    let r = c
        .query_one(
            "SELECT id::text, topic, subject, tenant, payload::text, headers::text FROM outbox.read('r', 10)",
            &[],
        )
        .unwrap();
    assert_eq!(r.get::<_, String>(0), id);
    assert_eq!(r.get::<_, String>(1), "order.placed");
    assert_eq!(r.get::<_, Option<String>>(2).as_deref(), Some("order/42"));
    assert_eq!(r.get::<_, Option<String>>(3).as_deref(), Some("acme"));
    assert_eq!(r.get::<_, String>(4), r#"{"order": 42}"#);
    assert_eq!(r.get::<_, String>(5), r#"{"trace": "abc"}"#);
    // uuid v7: the version nibble is 7
    assert_eq!(&id[14..15], "7", "{id}");
}

#[test]
fn null_payload_means_empty_object_and_defaults_apply() {
    let db = test_db("raise_defaults");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r'); SELECT outbox.raise('a.b'); SELECT outbox.raise('a.c', NULL)")
        .unwrap();
    let events = read(&mut c, "r", 10);
    assert_eq!(events.len(), 2);
    assert!(events.iter().all(|e| e.2 == "{}"), "{events:?}");
}

#[test]
fn rolled_back_raise_leaves_nothing() {
    let db = test_db("raise_rollback");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();
    c.batch_execute("BEGIN; SELECT outbox.raise('gone.event', '{}'); ROLLBACK")
        .unwrap();
    c.batch_execute(
        "BEGIN; SELECT outbox.raise_many(ARRAY['gone.many'], ARRAY['{}','{}']::jsonb[]); ROLLBACK",
    )
    .unwrap();
    c.batch_execute("BEGIN; SAVEPOINT s; SELECT outbox.raise('gone.sub', '{}'); ROLLBACK TO s; SELECT outbox.raise('kept.event', '{}'); COMMIT")
        .unwrap();
    let events = read(&mut c, "r", 10);
    assert_eq!(
        events.iter().map(|e| e.1.as_str()).collect::<Vec<_>>(),
        ["kept.event"]
    );
    let n: i64 = c
        .query_one("SELECT count(*) FROM outbox.events", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
}

#[test]
fn raise_refuses_bad_input_with_sqlstates() {
    let db = test_db("raise_refusals");
    let mut c = db.connect();
    let cases = [
        ("SELECT outbox.raise(NULL, '{}')", "22004"),
        ("SELECT outbox.raise('', '{}')", "22023"),
        ("SELECT outbox.raise('order..placed', '{}')", "22023"),
        ("SELECT outbox.raise('order placed', '{}')", "22023"),
        ("SELECT outbox.raise('order.*', '{}')", "22023"),
        ("SELECT outbox.raise('a;drop table x', '{}')", "22023"),
        ("SELECT outbox.raise(repeat('a', 256), '{}')", "22023"),
        ("SELECT outbox.raise('a', '[1,2]')", "22023"),
        ("SELECT outbox.raise('a', '42')", "22023"),
        ("SELECT outbox.raise('a', 'null')", "22023"),
        ("SELECT outbox.raise('a', '\"text\"')", "22023"),
        ("SELECT outbox.raise('a', '{}', subject => '')", "22023"),
        (
            "SELECT outbox.raise('a', '{}', tenant => repeat('t', 256))",
            "22023",
        ),
        ("SELECT outbox.raise('a', '{}', headers => '[]')", "22023"),
        ("SELECT outbox.raise('a', '{not json')", "22P02"),
    ];
    for (sql, code) in cases {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
    let n: i64 = c
        .query_one("SELECT count(*) FROM outbox.events", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "no refused call left an event");
}

#[test]
fn raise_many_keeps_order_broadcasts_single_elements_and_returns_ids() {
    let db = test_db("raise_many");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();
    let ids: Vec<String> = c
        .query_one(
            "SELECT outbox.raise_many(ARRAY['bulk.item'], \
                     ARRAY['{\"i\":1}','{\"i\":2}','{\"i\":3}', NULL]::jsonb[], \
                     subjects => ARRAY['s1', NULL, 's3', 's4'], tenants => ARRAY['acme'], \
                     headers => ARRAY['{\"h\":true}']::jsonb[])::text[]",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(ids.len(), 4);
    let rows = c
        .query("SELECT id::text, topic, subject, payload::text, headers::text FROM outbox.read('r', 10)", &[])
        .unwrap();
    assert_eq!(rows.len(), 4);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(
            r.get::<_, String>(0),
            ids[i],
            "ids come back in payload order"
        );
        assert_eq!(r.get::<_, String>(1), "bulk.item");
        assert_eq!(r.get::<_, String>(4), r#"{"h": true}"#);
    }
    let subjects: Vec<Option<String>> = rows.iter().map(|r| r.get(2)).collect();
    assert_eq!(
        subjects,
        [
            Some("s1".into()),
            None,
            Some("s3".into()),
            Some("s4".into())
        ]
    );
    let tenants: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.events WHERE tenant = 'acme'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(tenants, 4, "a one-element array applies to every event");
    let payloads: Vec<String> = rows.iter().map(|r| r.get(3)).collect();
    assert_eq!(
        payloads,
        [r#"{"i": 1}"#, r#"{"i": 2}"#, r#"{"i": 3}"#, "{}"]
    );

    // Per-event topics and an empty batch.
    c.batch_execute("SELECT outbox.raise_many(ARRAY['x.one','x.two'], ARRAY['{}','{}']::jsonb[], headers => ARRAY['{\"k\":1}', NULL]::jsonb[])")
        .unwrap();
    let empty: Vec<String> = c
        .query_one(
            "SELECT outbox.raise_many(ARRAY[]::text[], ARRAY[]::jsonb[])::text[]",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(empty.is_empty());
    let topics: Vec<String> = read(&mut c, "r", 10).into_iter().map(|e| e.1).collect();
    assert_eq!(topics[4..], ["x.one", "x.two"]);
    let headers: Vec<String> = c
        .query(
            "SELECT headers::text FROM outbox.events WHERE topic LIKE 'x.%' ORDER BY txid, seq",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(headers, [r#"{"k": 1}"#, "{}"]);
}

#[test]
fn raise_many_refuses_bad_batches() {
    let db = test_db("raise_many_refusals");
    let mut c = db.connect();
    let cases = [
        ("SELECT outbox.raise_many(NULL, ARRAY['{}']::jsonb[])", "22004"),
        ("SELECT outbox.raise_many(ARRAY['a'], NULL)", "22004"),
        ("SELECT outbox.raise_many(ARRAY['a', NULL], ARRAY['{}','{}']::jsonb[])", "22004"),
        ("SELECT outbox.raise_many(ARRAY['a','b','c'], ARRAY['{}','{}']::jsonb[])", "22023"),
        ("SELECT outbox.raise_many(ARRAY['a'], ARRAY['{}','[]']::jsonb[])", "22023"),
        ("SELECT outbox.raise_many(ARRAY['a'], ARRAY['{}','{}']::jsonb[], subjects => ARRAY['x','y','z'])", "22023"),
        ("SELECT outbox.raise_many(ARRAY['a'], ARRAY['{}','{}']::jsonb[], tenants => ARRAY[''])", "22023"),
        ("SELECT outbox.raise_many(ARRAY['a'], ARRAY['{}']::jsonb[], headers => ARRAY['1']::jsonb[])", "22023"),
        ("SELECT outbox.raise_many(ARRAY['bad topic'], ARRAY['{}']::jsonb[])", "22023"),
        ("SELECT outbox.raise_many(ARRAY['a'], ARRAY[['{}'],['{}']]::jsonb[])", "22023"),
        ("SELECT outbox.raise_many(ARRAY['a'], ARRAY[]::jsonb[])", "22023"),
    ];
    for (sql, code) in cases {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
    let msg = pg_outbox_tests::error_message(
        &mut c,
        "SELECT outbox.raise_many(ARRAY['a'], ARRAY['{}','[]']::jsonb[])",
    );
    assert!(
        msg.contains("payloads[2]"),
        "the error names the element: {msg}"
    );
    let n: i64 = c
        .query_one("SELECT count(*) FROM outbox.events", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
}
