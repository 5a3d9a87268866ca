//! outbox.horizon(): a held transaction is named, its events wait, releasing it lets them through.

use pg_outbox_tests::{eventually, read, test_db};
use std::time::Duration;

#[test]
fn a_held_transaction_is_named_and_releasing_it_lets_events_through() {
    let db = test_db("horizon");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();

    let idle: (String, i64, Option<i32>) = {
        let r = c
            .query_one(
                "SELECT horizon, waiting_events, pid FROM outbox.horizon()",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(idle.1, 0);
    assert_eq!(
        idle.2, None,
        "nothing holds the horizon while no transaction runs"
    );

    // A forgotten transaction in *another* database holds every reader back.
    let mut admin = db.cluster().connect("postgres", "postgres");
    let holder_pid: i32 = admin
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    admin
        .batch_execute("BEGIN; SELECT pg_current_xact_id(), 'the forgotten transaction'")
        .unwrap();

    c.batch_execute(
        "SELECT outbox.raise('behind.horizon', '{}'); SELECT outbox.raise('behind.horizon', '{}')",
    )
    .unwrap();
    assert!(
        read(&mut c, "r", 10).is_empty(),
        "events wait behind the held horizon"
    );

    let r = c
        .query_one("SELECT waiting_events, pid, datname, xid_age, xact_age IS NOT NULL, state, query FROM outbox.horizon()", &[])
        .unwrap();
    assert_eq!(r.get::<_, i64>(0), 2, "two committed events wait");
    assert_eq!(r.get::<_, Option<i32>>(1), Some(holder_pid));
    assert_eq!(r.get::<_, Option<String>>(2).as_deref(), Some("postgres"));
    assert!(r.get::<_, Option<i32>>(3).unwrap() >= 1);
    assert!(r.get::<_, bool>(4));
    assert_eq!(
        r.get::<_, Option<String>>(5).as_deref(),
        Some("idle in transaction")
    );
    let query = r.get::<_, Option<String>>(6).unwrap();
    assert!(query.contains("the forgotten transaction"), "{query}");

    admin.batch_execute("COMMIT").unwrap();
    let got = eventually("events after release", Duration::from_secs(10), || {
        let got = read(&mut c, "r", 10);
        (got.len() == 2).then_some(got)
    });
    assert!(got.iter().all(|e| e.1 == "behind.horizon"));
    let after: i64 = c
        .query_one("SELECT waiting_events FROM outbox.horizon()", &[])
        .unwrap()
        .get(0);
    assert_eq!(after, 0);
}

#[test]
fn a_prepared_transaction_is_named_as_the_holder() {
    let db = test_db("horizon_prepared");
    let mut c = db.connect();
    let mut p = db.connect();
    p.batch_execute(
        "BEGIN; SELECT outbox.raise('prepared.event'); PREPARE TRANSACTION 'held-by-2pc'",
    )
    .unwrap();
    let r = c
        .query_one("SELECT pid, state, query FROM outbox.horizon()", &[])
        .unwrap();
    assert_eq!(r.get::<_, Option<i32>>(0), None);
    assert_eq!(r.get::<_, Option<String>>(1).as_deref(), Some("prepared"));
    assert!(r
        .get::<_, Option<String>>(2)
        .unwrap()
        .contains("held-by-2pc"));
    c.batch_execute("COMMIT PREPARED 'held-by-2pc'").unwrap();
    let r = c
        .query_one("SELECT pid, state FROM outbox.horizon()", &[])
        .unwrap();
    assert_eq!(r.get::<_, Option<String>>(1), None);
}
