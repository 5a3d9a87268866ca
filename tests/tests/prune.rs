//! outbox.prune(): never deletes an event some consumer has not passed, honours the retention,
//! works in batches, refuses bad input.

use pg_outbox_tests::{read, sqlstate, test_db};

fn count(c: &mut postgres::Client) -> i64 {
    c.query_one("SELECT count(*) FROM outbox.events", &[])
        .unwrap()
        .get(0)
}

#[test]
fn prune_deletes_only_what_every_consumer_has_passed() {
    let db = test_db("prune_cursors");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('fast'); SELECT outbox.create_consumer('slow')")
        .unwrap();
    c.batch_execute("SELECT outbox.raise_many(ARRAY['p.e'], array_agg(jsonb_build_object('i', i))) FROM generate_series(1, 50) i")
        .unwrap();
    let events = read(&mut c, "fast", 100);
    assert_eq!(events.len(), 50);

    // Neither consumer has advanced: a consumer that never advanced holds the log.
    let n: i64 = c
        .query_one("SELECT outbox.prune('0 seconds')", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 0);

    c.execute("SELECT outbox.advance('fast', $1)", &[&events[49].0])
        .unwrap();
    c.execute("SELECT outbox.advance('slow', $1)", &[&events[19].0])
        .unwrap();
    let n: i64 = c
        .query_one("SELECT outbox.prune('0 seconds', batch_size => 7)", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 20, "exactly the events both consumers passed");
    assert_eq!(count(&mut c), 30);
    let slow = read(&mut c, "slow", 100);
    assert_eq!(
        slow.len(),
        30,
        "the slow consumer still gets everything it has not passed"
    );
    assert_eq!(slow[0].0, events[20].0);

    // Dropping the slow consumer releases what it held.
    c.batch_execute("SELECT outbox.drop_consumer('slow')")
        .unwrap();
    let n: i64 = c
        .query_one("SELECT outbox.prune('0 seconds')", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 30);
    assert_eq!(count(&mut c), 0);
}

#[test]
fn prune_keeps_events_within_the_retention() {
    let db = test_db("prune_retention");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();
    // Old events (raised_at set back as if raised two days ago), then fresh ones.
    c.batch_execute(
        "SELECT outbox.raise('p.old') FROM generate_series(1, 5);
         UPDATE outbox.events SET raised_at = now() - interval '2 days';
         SELECT outbox.raise('p.new') FROM generate_series(1, 5);",
    )
    .unwrap();
    let events = read(&mut c, "r", 100);
    c.execute("SELECT outbox.advance('r', $1)", &[&events[9].0])
        .unwrap();
    let n: i64 = c
        .query_one("SELECT outbox.prune('1 day')", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 5);
    let left: Vec<String> = c
        .query("SELECT topic FROM outbox.events", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, vec!["p.new"; 5]);
    let n: i64 = c.query_one("SELECT outbox.prune()", &[]).unwrap().get(0);
    assert_eq!(n, 0, "the default retention is 7 days");
}

#[test]
fn prune_never_passes_the_horizon_even_without_consumers() {
    let db = test_db("prune_horizon");
    let mut c = db.connect();
    let mut holder = db.connect();
    c.batch_execute("SELECT outbox.raise('before.hold')")
        .unwrap();
    holder
        .batch_execute("BEGIN; SELECT outbox.raise('held')")
        .unwrap();
    c.batch_execute("SELECT outbox.raise('after.hold')")
        .unwrap();
    let n: i64 = c
        .query_one("SELECT outbox.prune('0 seconds')", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 1, "only the event below the horizon");
    holder.batch_execute("COMMIT").unwrap();
    let n: i64 = c
        .query_one("SELECT outbox.prune('0 seconds')", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
}

#[test]
fn prune_refuses_bad_input() {
    let db = test_db("prune_refusals");
    let mut c = db.connect();
    for (sql, code) in [
        ("SELECT outbox.prune(NULL)", "22004"),
        ("SELECT outbox.prune('-1 day')", "22023"),
        ("SELECT outbox.prune('1 day', 0)", "22023"),
        ("SELECT outbox.prune('1 day', NULL)", "22004"),
        ("SELECT outbox.prune('1 day', 2000000)", "22023"),
        ("SELECT outbox.prune('forever')", "22007"),
    ] {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
}

#[test]
fn prune_waits_for_a_consumer_being_created_and_then_respects_it() {
    let db = test_db("prune_race");
    let mut c = db.connect();
    c.batch_execute(
        "SELECT outbox.create_consumer('done'); SELECT outbox.raise('p.e') FROM generate_series(1, 10)",
    )
    .unwrap();
    let last = read(&mut c, "done", 10)[9].0.clone();
    c.execute("SELECT outbox.advance('done', $1)", &[&last])
        .unwrap();
    // A consumer starting at the origin, not yet committed, while prune runs.
    let mut creator = db.connect();
    creator
        .batch_execute("BEGIN; SELECT outbox.create_consumer('newcomer')")
        .unwrap();
    let mut p = db.connect();
    let pruner = std::thread::spawn(move || -> i64 {
        p.query_one("SELECT outbox.prune('0 seconds')", &[])
            .unwrap()
            .get(0)
    });
    pg_outbox_tests::eventually(
        "prune to wait for the cursor lock",
        std::time::Duration::from_secs(10),
        || {
            let waiting: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' AND query LIKE '%outbox.prune%'",
                &[],
            )
            .unwrap()
            .get(0);
            (waiting == 1).then_some(())
        },
    );
    creator.batch_execute("COMMIT").unwrap();
    assert_eq!(
        pruner.join().unwrap(),
        0,
        "the newcomer at the origin holds the log"
    );
    assert_eq!(read(&mut c, "newcomer", 100).len(), 10);
}

#[test]
fn the_lowest_cursor_is_found_by_number_not_by_text() {
    // A cursor at a transaction id with fewer digits than another's sorts after it as text
    // ("999" > "1234"). Pruning once took its bound from such a text order and deleted events a
    // lagging consumer had not read; the chaos soak caught it.
    let db = test_db("prune_numeric_order");
    let mut c = db.connect();
    c.batch_execute(
        "SELECT outbox.raise('t', jsonb_build_object('i', i)) FROM generate_series(1, 3) i",
    )
    .unwrap();
    let head: String = c
        .query_one("SELECT max(txid)::text FROM outbox.events", &[])
        .unwrap()
        .get(0);
    assert!(
        head.len() >= 2,
        "the test needs a transaction id of two digits or more"
    );
    // The largest number with one digit less: below the head as a number, above it as text
    // (unless the head is all nines, which the next line rules out).
    let behind = "9".repeat(head.len() - 1);
    assert!(behind.as_str() > head.as_str() || head.chars().all(|d| d == '9'));
    c.execute(
        "SELECT outbox.create_consumer('behind', start_at => $1)",
        &[&format!("{behind}:0")],
    )
    .unwrap();
    c.batch_execute("SELECT outbox.create_consumer('ahead')")
        .unwrap();
    let last = read(&mut c, "ahead", 100).last().unwrap().0.clone();
    c.execute("SELECT outbox.advance('ahead', $1)", &[&last])
        .unwrap();
    let pruned: i64 = c
        .query_one("SELECT outbox.prune('0 seconds')", &[])
        .unwrap()
        .get(0);
    assert_eq!(pruned, 0, "'behind' has read nothing yet");
    assert_eq!(read(&mut c, "behind", 100).len(), 3);
}
