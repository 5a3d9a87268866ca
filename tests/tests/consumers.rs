//! Pull consumers: the read rule under concurrent, out-of-order commits, forward-only cursors,
//! rewind, ownership, and every refusal with its SQLSTATE.

use pg_outbox_tests::{eventually, position, read, sqlstate, test_db};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[test]
fn a_transaction_that_raises_first_and_commits_last_is_never_skipped() {
    let db = test_db("out_of_order");
    let mut reader = db.connect();
    reader
        .batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();
    let mut a = db.connect();
    let mut b = db.connect();

    // A raises first: it takes the lower seq.
    a.batch_execute("BEGIN; SELECT outbox.raise('a.first', '{\"who\":\"A\"}')")
        .unwrap();
    // B raises after A and commits while A is still open.
    b.batch_execute("BEGIN; SELECT outbox.raise('b.second', '{\"who\":\"B\"}'); COMMIT")
        .unwrap();

    // The reader, reading and advancing throughout, must not be handed B's event yet: moving past
    // it would skip A's forever.
    for _ in 0..5 {
        let got = read(&mut reader, "r", 100);
        assert!(
            got.is_empty(),
            "B's event was handed out while A could still commit behind it: {got:?}"
        );
    }

    a.batch_execute("COMMIT").unwrap();
    let got = eventually("both events", Duration::from_secs(10), || {
        let got = read(&mut reader, "r", 100);
        (got.len() == 2).then_some(got)
    });
    assert_eq!(
        got[0].1, "a.first",
        "A's event comes first: it holds the lower position"
    );
    assert_eq!(got[1].1, "b.second");
    assert!(position(&got[0].0) < position(&got[1].0));
}

#[test]
fn many_writers_with_random_commit_order_one_reader_misses_and_repeats_nothing() {
    let db = test_db("concurrent");
    let mut reader = db.connect();
    reader
        .batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();
    const WRITERS: usize = 8;
    const PER_WRITER: usize = 150;
    let done = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let mut c = db.connect();
            std::thread::spawn(move || {
                let mut rolled_back = 0;
                let mut n = 0;
                while n < PER_WRITER {
                    // Several events per transaction, a pause before commit of varying length so
                    // commit order differs from seq order, and some rollbacks.
                    let k = 1 + (n * 7 + w) % 3;
                    let mut tx = c.transaction().unwrap();
                    for j in 0..k.min(PER_WRITER - n) {
                        tx.execute(
                            "SELECT outbox.raise('load.tick', jsonb_build_object('w', $1::int, 'n', $2::int))",
                            &[&(w as i32), &((n + j) as i32)],
                        )
                        .unwrap();
                    }
                    std::thread::sleep(Duration::from_micros(((w * 131 + n * 17) % 2000) as u64));
                    // Roll back now and then, at different points for each writer and attempt.
                    if (n * 3 + w + rolled_back * 7) % 11 == 0 && rolled_back < 10 {
                        tx.execute("SELECT outbox.raise('load.ghost', '{}')", &[]).unwrap();
                        tx.rollback().unwrap();
                        rolled_back += 1;
                        continue;
                    }
                    tx.commit().unwrap();
                    n += k.min(PER_WRITER - n);
                }
            })
        })
        .collect();

    let finished = done.clone();
    let waiter = std::thread::spawn(move || {
        for w in writers {
            w.join().unwrap();
        }
        finished.store(true, Ordering::SeqCst);
    });

    let mut seen = Vec::new();
    let mut last: Option<(u64, i64)> = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let writers_done = done.load(Ordering::SeqCst);
        let batch = read(&mut reader, "r", 37);
        for (pos, topic, payload) in &batch {
            assert_eq!(topic, "load.tick", "a rolled-back event was read");
            let p = position(pos);
            assert!(
                last.is_none_or(|l| l < p),
                "positions go strictly forward: {last:?} then {p:?}"
            );
            last = Some(p);
            seen.push(payload.clone());
        }
        if let Some((pos, _, _)) = batch.last() {
            let moved: bool = reader
                .query_one("SELECT outbox.advance('r', $1)", &[pos])
                .unwrap()
                .get(0);
            assert!(moved);
        }
        if batch.is_empty() && writers_done && seen.len() >= WRITERS * PER_WRITER {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "reader saw only {} events",
            seen.len()
        );
    }
    waiter.join().unwrap();
    let unique: HashSet<_> = seen.iter().collect();
    assert_eq!(
        seen.len(),
        WRITERS * PER_WRITER,
        "every committed event exactly once"
    );
    assert_eq!(unique.len(), seen.len(), "no event twice");
}

#[test]
fn advance_is_forward_only_and_a_late_advance_changes_nothing() {
    let db = test_db("forward_only");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r'); SELECT outbox.raise('e.one'); SELECT outbox.raise('e.two')")
        .unwrap();
    let events = read(&mut c, "r", 10);
    let (first, second) = (&events[0].0, &events[1].0);
    let adv = |c: &mut postgres::Client, p: &str| -> bool {
        c.query_one("SELECT outbox.advance('r', $1)", &[&p])
            .unwrap()
            .get(0)
    };
    assert!(adv(&mut c, second));
    assert!(
        !adv(&mut c, first),
        "a late advance to an older position returns false"
    );
    assert!(
        !adv(&mut c, second),
        "advancing to where it is returns false"
    );
    assert!(
        read(&mut c, "r", 10).is_empty(),
        "the cursor stayed at the newer position"
    );

    // The database itself refuses a backward move, whoever writes the row.
    assert_eq!(
        sqlstate(
            &mut c,
            "UPDATE outbox.consumers SET txid = '0', seq = 0 WHERE name = 'r'"
        ),
        "55000"
    );

    // rewind is the explicit way back; it returns where the cursor was.
    let was: String = c
        .query_one("SELECT outbox.rewind('r', $1)", &[first])
        .unwrap()
        .get(0);
    assert_eq!(&was, second);
    let again = read(&mut c, "r", 10);
    assert_eq!(again.len(), 1);
    assert_eq!(&again[0].0, second);
    let rewinds: i64 = c
        .query_one("SELECT rewinds FROM outbox.consumers WHERE name = 'r'", &[])
        .unwrap()
        .get(0);
    assert_eq!(rewinds, 1);
    c.batch_execute("SELECT outbox.rewind('r', '0:0')").unwrap();
    assert_eq!(read(&mut c, "r", 10).len(), 2);
}

#[test]
fn concurrent_advances_never_move_a_cursor_back() {
    let db = test_db("concurrent_advance");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();
    c.batch_execute("SELECT outbox.raise_many(ARRAY['e.x'], array_agg('{}'::jsonb)) FROM generate_series(1, 200)")
        .unwrap();
    let positions: Vec<String> = read(&mut c, "r", 200).into_iter().map(|e| e.0).collect();
    let top = positions.last().unwrap().clone();
    // Two holders save cursors in opposite orders at the same time; the highest must win.
    let handles: Vec<_> = [false, true]
        .into_iter()
        .map(|reverse| {
            let mut c = db.connect();
            let mut ps = positions.clone();
            if reverse {
                ps.reverse();
            }
            std::thread::spawn(move || {
                for p in ps {
                    c.query_one("SELECT outbox.advance('r', $1)", &[&p])
                        .unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let cursor: String = c
        .query_one(
            "SELECT txid::text || ':' || seq FROM outbox.consumers WHERE name = 'r'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(cursor, top);
}

#[test]
fn start_at_now_skips_what_is_already_readable() {
    let db = test_db("start_now");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.raise('old.event')").unwrap();
    // A transaction still running at creation is not readable yet: 'now' must not skip it.
    let mut inflight = db.connect();
    inflight
        .batch_execute("BEGIN; SELECT outbox.raise('inflight.event')")
        .unwrap();
    c.batch_execute("SELECT outbox.create_consumer('late', start_at => 'now'); SELECT outbox.create_consumer('all')")
        .unwrap();
    inflight.batch_execute("COMMIT").unwrap();
    c.batch_execute("SELECT outbox.raise('new.event')").unwrap();
    let late: Vec<String> = read(&mut c, "late", 10).into_iter().map(|e| e.1).collect();
    let all: Vec<String> = read(&mut c, "all", 10).into_iter().map(|e| e.1).collect();
    assert_eq!(late, ["inflight.event", "new.event"]);
    assert_eq!(all, ["old.event", "inflight.event", "new.event"]);
    // Starting after an explicit position.
    let p = read(&mut c, "all", 1)[0].0.clone();
    c.execute(
        "SELECT outbox.create_consumer('after', start_at => $1)",
        &[&p],
    )
    .unwrap();
    assert_eq!(read(&mut c, "after", 10).len(), 2);
}

#[test]
fn consumer_functions_refuse_bad_input_with_sqlstates() {
    let db = test_db("consumer_refusals");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();
    let cases = [
        ("SELECT outbox.create_consumer(NULL)", "22004"),
        ("SELECT outbox.create_consumer('')", "42602"),
        ("SELECT outbox.create_consumer('has space')", "42602"),
        (
            "SELECT outbox.create_consumer('x\"; DROP TABLE outbox.events; --')",
            "42602",
        ),
        ("SELECT outbox.create_consumer(repeat('n', 64))", "42602"),
        ("SELECT outbox.create_consumer('r')", "42710"),
        (
            "SELECT outbox.create_consumer('s', start_at => 'yesterday')",
            "22023",
        ),
        (
            "SELECT outbox.create_consumer('s', start_at => NULL)",
            "22004",
        ),
        (
            "SELECT outbox.create_consumer('s', start_at => '99999999999:1')",
            "22023",
        ),
        ("SELECT * FROM outbox.read(NULL)", "22004"),
        ("SELECT * FROM outbox.read('nobody')", "42704"),
        ("SELECT * FROM outbox.read('r', 0)", "22023"),
        ("SELECT * FROM outbox.read('r', -5)", "22023"),
        ("SELECT * FROM outbox.read('r', 100001)", "22023"),
        ("SELECT * FROM outbox.read('r', NULL)", "22004"),
        ("SELECT outbox.advance('r', '007:1')", "22P02"),
        (
            "SELECT outbox.create_consumer('s', start_at => '5:x')",
            "22P02",
        ),
        ("SELECT outbox.advance('r', NULL)", "22004"),
        ("SELECT outbox.advance(NULL, '1:1')", "22004"),
        ("SELECT outbox.advance('nobody', '1:1')", "42704"),
        ("SELECT outbox.advance('r', '1')", "22P02"),
        ("SELECT outbox.advance('r', '1:x')", "22P02"),
        ("SELECT outbox.advance('r', '-1:1')", "22P02"),
        ("SELECT outbox.advance('r', '1:2:3')", "22P02"),
        ("SELECT outbox.advance('r', '')", "22P02"),
        (
            "SELECT outbox.advance('r', '18446744073709551615:1')",
            "22023",
        ),
        ("SELECT outbox.rewind('r', 'origin')", "22P02"),
        ("SELECT outbox.rewind('nobody', '0:0')", "42704"),
        ("SELECT outbox.drop_consumer('nobody')", "42704"),
        ("SELECT outbox.drop_consumer(NULL)", "22004"),
    ];
    for (sql, code) in cases {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
    let n: i64 = c
        .query_one("SELECT count(*) FROM outbox.consumers", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 1, "refused calls created nothing");
    c.batch_execute("SELECT outbox.drop_consumer('r')").unwrap();
    assert_eq!(sqlstate(&mut c, "SELECT * FROM outbox.read('r')"), "42704");
}

#[test]
fn advance_past_the_horizon_is_refused_while_a_transaction_holds_it() {
    let db = test_db("advance_horizon");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.create_consumer('r')")
        .unwrap();
    let mut holder = db.connect();
    holder
        .batch_execute("BEGIN; SELECT outbox.raise('held.event')")
        .unwrap();
    let txid: String = holder
        .query_one("SELECT pg_current_xact_id()::text", &[])
        .unwrap()
        .get(0);
    assert_eq!(
        sqlstate(&mut c, &format!("SELECT outbox.advance('r', '{txid}:1')")),
        "22023"
    );
    holder.batch_execute("COMMIT").unwrap();
    let got = eventually("the held event", Duration::from_secs(10), || {
        let got = read(&mut c, "r", 10);
        (!got.is_empty()).then_some(got)
    });
    let moved: bool = c
        .query_one("SELECT outbox.advance('r', $1)", &[&got[0].0])
        .unwrap()
        .get(0);
    assert!(moved);
}

/// The read rule and the workers' window over it are inlined into the statements that call them,
/// so they pin no search_path: every name and operator in them is qualified. Look-alike operators
/// first on the search_path must change nothing: not the horizon (`<` on xid8), not the cursor
/// (`>` on bigint in the row comparison), not the positions (`||`), not the byte cut (`<=`).
#[test]
fn the_read_rule_reads_the_same_under_a_hostile_search_path() {
    let db = test_db("read_search_path");
    let mut c = db.connect();
    c.batch_execute(
        "SELECT outbox.raise('a.b', jsonb_build_object('i', i)) FROM generate_series(1, 3) i",
    )
    .unwrap();
    // A transaction still running holds the horizon: neither its event nor a later one is read.
    let mut holder = db.connect();
    holder
        .batch_execute("BEGIN; SELECT outbox.raise('a.b', '{\"i\": 4}')")
        .unwrap();
    c.batch_execute("SELECT outbox.raise('a.b', '{\"i\": 5}')")
        .unwrap();
    let after: String = c
        .query_one(
            "SELECT txid::text || ':' || seq FROM outbox.events ORDER BY txid, seq LIMIT 1",
            &[],
        )
        .unwrap()
        .get(0);
    let (txid, seq) = after.split_once(':').unwrap();
    let reads = format!(
        "SELECT string_agg(pg_catalog.concat(position, '=', payload->>'i'), ' ')
           FROM outbox._read_after('{txid}'::xid8, {seq}, 10)
         UNION ALL
         SELECT string_agg(pg_catalog.concat(position, '#', n), ' ')
           FROM outbox._read_window('0'::xid8, 0, 10, 1)
         UNION ALL
         SELECT count(*)::text FROM outbox._read_after(NULL, 0, 10)
         UNION ALL
         SELECT count(*)::text FROM outbox._read_after('0'::xid8, 0, NULL)
         UNION ALL
         SELECT count(*)::text FROM outbox._read_after('0'::xid8, NULL, 10)
         UNION ALL
         SELECT count(*)::text FROM outbox._read_window('0'::xid8, 0, 10, NULL)"
    );
    let read = |c: &mut postgres::Client| -> Vec<Option<String>> {
        c.query(&reads, &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let plain = read(&mut c);
    assert_eq!(plain[0].as_deref().map(|s| s.split(' ').count()), Some(2));
    assert_eq!(
        plain[1].as_deref().map(|s| s.split(' ').count()),
        Some(1),
        "one byte: the first event alone"
    );
    assert_eq!(plain[2].as_deref(), Some("0"));
    assert_eq!(plain[3].as_deref(), Some("0"));
    assert_eq!(
        plain[4].as_deref(),
        Some("0"),
        "a NULL argument reads nothing"
    );
    assert_eq!(plain[5].as_deref(), Some("0"));
    c.batch_execute(
        "CREATE SCHEMA evil;
         CREATE FUNCTION evil.t(xid8, xid8) RETURNS boolean LANGUAGE sql AS 'SELECT true';
         CREATE OPERATOR evil.< (LEFTARG = xid8, RIGHTARG = xid8, FUNCTION = evil.t);
         CREATE OPERATOR evil.> (LEFTARG = xid8, RIGHTARG = xid8, FUNCTION = evil.t);
         CREATE FUNCTION evil.b(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true';
         CREATE OPERATOR evil.> (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.b);
         CREATE OPERATOR evil.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.b);
         CREATE FUNCTION evil.n(numeric, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true';
         CREATE OPERATOR evil.<= (LEFTARG = numeric, RIGHTARG = bigint, FUNCTION = evil.n);
         CREATE FUNCTION evil.cat(text, text) RETURNS text LANGUAGE sql AS 'SELECT ''x''';
         CREATE OPERATOR evil.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.cat);
         SET search_path = evil, pg_catalog, public;",
    )
    .unwrap();
    let hostile = read(&mut c);
    c.batch_execute("RESET search_path").unwrap();
    assert_eq!(hostile, plain);
    holder.batch_execute("ROLLBACK").unwrap();
}
