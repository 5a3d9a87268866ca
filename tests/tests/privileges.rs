//! Privileges: nothing for PUBLIC; EXECUTE on raise is enough to raise; consumers belong to the
//! role that created them.

use pg_outbox_tests::{read, sqlstate, test_db};

#[test]
fn an_application_role_raises_with_execute_alone_and_cannot_touch_the_tables() {
    let db = test_db("privileges_app");
    let mut su = db.connect();
    su.batch_execute(&format!(
        "CREATE ROLE app LOGIN; CREATE ROLE stranger LOGIN;
         GRANT USAGE ON SCHEMA outbox TO app, stranger;
         GRANT EXECUTE ON FUNCTION outbox.raise(text, jsonb, text, text, jsonb) TO app;
         GRANT EXECUTE ON FUNCTION outbox.raise_many(text[], jsonb[], text[], text[], jsonb[]) TO app;
         GRANT CONNECT ON DATABASE \"{}\" TO app, stranger;
         SELECT outbox.create_consumer('audit');",
        db.name
    ))
    .unwrap();
    let mut app = db.connect_as("app");
    app.batch_execute("SELECT outbox.raise('app.event', '{\"ok\": true}')")
        .unwrap();
    app.batch_execute("SELECT outbox.raise_many(ARRAY['app.bulk'], ARRAY['{}','{}']::jsonb[])")
        .unwrap();
    for sql in [
        "SELECT * FROM outbox.events",
        "INSERT INTO outbox.events (id, topic, payload) VALUES (gen_random_uuid(), 'x', '{}')",
        "DELETE FROM outbox.events",
        "UPDATE outbox.consumers SET seq = 0",
        "SELECT * FROM outbox.read('audit')",
        "SELECT outbox.prune('0 seconds')",
    ] {
        assert_eq!(sqlstate(&mut app, sql), "42501", "{sql}");
    }
    let mut stranger = db.connect_as("stranger");
    assert_eq!(
        sqlstate(&mut stranger, "SELECT outbox.raise('x.y')"),
        "42501"
    );
    assert_eq!(read(&mut su, "audit", 10).len(), 3);
}

#[test]
fn a_consumer_is_moved_and_dropped_only_by_members_of_its_owner() {
    let db = test_db("privileges_owner");
    let mut su = db.connect();
    su.batch_execute(&format!(
        "CREATE ROLE alice LOGIN; CREATE ROLE bob LOGIN; CREATE ROLE alice_team; GRANT alice TO alice_team;
         CREATE ROLE carol LOGIN IN ROLE alice_team;
         GRANT USAGE ON SCHEMA outbox TO alice, bob, carol;
         GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO alice, bob, carol;
         GRANT CONNECT ON DATABASE \"{}\" TO alice, bob, carol;
         SELECT outbox.raise('o.e');",
        db.name
    ))
    .unwrap();
    let mut alice = db.connect_as("alice");
    alice
        .batch_execute("SELECT outbox.create_consumer('alices')")
        .unwrap();
    let p = read(&mut alice, "alices", 1)[0].0.clone();
    let mut bob = db.connect_as("bob");
    for sql in [
        format!("SELECT outbox.advance('alices', '{p}')"),
        "SELECT outbox.rewind('alices', '0:0')".to_string(),
        "SELECT outbox.drop_consumer('alices')".to_string(),
    ] {
        assert_eq!(sqlstate(&mut bob, &sql), "42501", "{sql}");
    }
    // A member of alice's role acts for alice.
    let mut carol = db.connect_as("carol");
    let moved: bool = carol
        .query_one("SELECT outbox.advance('alices', $1)", &[&p])
        .unwrap()
        .get(0);
    assert!(moved);
    alice
        .batch_execute("SELECT outbox.drop_consumer('alices')")
        .unwrap();
}
