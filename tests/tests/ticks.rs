//! Ticks (issue 15, the first part): snapshots taken one after another, and the batches between
//! them. Eight writers commit out of order with rollbacks while a long transaction holds an xid
//! and raises events too; a ticker takes ticks all along and a reader reads batch after batch
//! meanwhile. Every committed event is read exactly once, a transaction's events together and in
//! order, the short transactions are read while the long one is still open, and each transaction
//! is in the first tick taken after its commit returned.

use pg_outbox_tests::{buffers, sqlstate, test_db, worker_db};
use postgres::Client;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One event as a batch returns it: (tick, txid, seq, writer, transaction, index in it).
type Read = (i64, u64, i64, i32, i32, i32);

/// Reads the batch of tick `tick` (after the tick before it) page by page.
fn batch(c: &mut Client, tick: i64) -> Vec<Read> {
    let mut out: Vec<Read> = Vec::new();
    let (mut after_txid, mut after_seq) = ("0".to_string(), 0i64);
    loop {
        let rows = c
            .query(
                "SELECT txid::text, seq, (payload->>'w')::int, (payload->>'n')::int, (payload->>'j')::int \
                   FROM outbox._tick_log(outbox._tick_before($1::int8), $1::int8, $2::text::xid8, $3, 7)",
                &[&tick, &after_txid, &after_seq],
            )
            .unwrap();
        for r in &rows {
            let txid: String = r.get(0);
            out.push((
                tick,
                txid.parse().unwrap(),
                r.get(1),
                r.get(2),
                r.get(3),
                r.get(4),
            ));
        }
        match rows.last() {
            Some(r) if rows.len() == 7 => {
                after_txid = r.get(0);
                after_seq = r.get(1);
            }
            _ => return out,
        }
    }
}

fn newest_tick(c: &mut Client) -> i64 {
    c.query_one("SELECT coalesce(max(tick), 0) FROM outbox.ticks", &[])
        .unwrap()
        .get(0)
}

/// A small deterministic generator: the same run each time, different for each writer.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// (writer, transaction) -> (began, commit returned, events) for the committed ones.
type Committed = Arc<Mutex<HashMap<(i32, i32), (Instant, Instant, i32)>>>;
/// The (writer, transaction) pairs rolled back.
type RolledBack = Arc<Mutex<HashSet<(i32, i32)>>>;

/// Writers, each in a connection of its own until `stop`: transactions of 1 to 4 events raised
/// with pauses of up to `pause_us` between them (commits land out of raise order), one in
/// `rollback_one_in` rolled back; each event's payload names its writer `w`, transaction `n` and
/// place in it `j`. `seed` makes the run the same each time. What committed, and what rolled back.
fn spawn_writers(
    db: &pg_outbox_tests::TestDb,
    writers: i32,
    seed: u64,
    pause_us: u64,
    rollback_one_in: u64,
    stop: &Arc<AtomicBool>,
) -> (Vec<std::thread::JoinHandle<()>>, Committed, RolledBack) {
    let committed: Committed = Arc::new(Mutex::new(HashMap::new()));
    let rolled_back: RolledBack = Arc::new(Mutex::new(HashSet::new()));
    let handles = (0..writers)
        .map(|w| {
            let mut c = db.connect();
            let (stop, committed, rolled_back) = (stop.clone(), committed.clone(), rolled_back.clone());
            std::thread::spawn(move || {
                let mut rng = seed ^ ((w as u64 + 1) * 0x1000_0001);
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let began = Instant::now();
                    let mut tx = c.transaction().unwrap();
                    let events = 1 + (next(&mut rng) % 4) as i32;
                    for j in 0..events {
                        tx.execute(
                            "SELECT outbox.raise('short', jsonb_build_object('w', $1::int, 'n', $2::int, 'j', $3::int))",
                            &[&w, &n, &j],
                        )
                        .unwrap();
                        std::thread::sleep(Duration::from_micros(next(&mut rng) % pause_us));
                    }
                    if next(&mut rng).is_multiple_of(rollback_one_in) {
                        tx.rollback().unwrap();
                        rolled_back.lock().unwrap().insert((w, n));
                    } else {
                        tx.commit().unwrap();
                        committed.lock().unwrap().insert((w, n), (began, Instant::now(), events));
                    }
                    n += 1;
                }
            })
        })
        .collect();
    (handles, committed, rolled_back)
}

#[test]
fn every_committed_event_is_in_exactly_one_batch_and_a_long_transaction_holds_back_only_its_own() {
    let db = test_db("ticks");
    const WRITERS: i32 = 8;
    const LONG: i32 = 99;
    let run_for = Duration::from_secs(4);

    // A log that was raised in before (a log's first tick waits for its first raise to commit,
    // see outbox._tick: here that would be the long transaction's).
    db.connect()
        .batch_execute("UPDATE outbox.lineage SET raised = true")
        .unwrap();
    // The long transaction: raises first, holds its xid while the writers run, raises again.
    let mut long = db.connect();
    let long_began = Instant::now();
    long.batch_execute(
        "BEGIN; SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 0}'); \
                SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 1}')",
    )
    .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let (writers, committed, rolled_back) =
        spawn_writers(&db, WRITERS, 0x9E37_79B9_7F4A_7C15, 3000, 7, &stop);

    // Three tickers at once, as workers will: (tick returned, when the call began).
    let ticks = Arc::new(Mutex::new(Vec::<(i64, Instant)>::new()));
    let tickers: Vec<_> = (0..3)
        .map(|i| {
            let mut c = db.connect();
            let (stop, ticks) = (stop.clone(), ticks.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let began = Instant::now();
                    let tick: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
                    ticks.lock().unwrap().push((tick, began));
                    std::thread::sleep(Duration::from_millis(2 + i));
                }
            })
        })
        .collect();

    // The reader, batch after batch while everything runs: (read, when it was read).
    let reading = Arc::new(AtomicBool::new(true));
    let read_through = Arc::new(AtomicI64::new(0));
    let reader = {
        let mut c = db.connect();
        let (reading, read_through) = (reading.clone(), read_through.clone());
        std::thread::spawn(move || {
            let mut read: Vec<(Read, Instant)> = Vec::new();
            let mut done = 0i64;
            loop {
                let last_round = !reading.load(Ordering::SeqCst);
                let newest = newest_tick(&mut c);
                for t in done + 1..=newest {
                    let at = Instant::now();
                    read.extend(batch(&mut c, t).into_iter().map(|r| (r, at)));
                }
                done = newest;
                read_through.store(done, Ordering::SeqCst);
                if last_round {
                    return read;
                }
                std::thread::sleep(Duration::from_millis(3));
            }
        })
    };

    std::thread::sleep(run_for);
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    for t in tickers {
        t.join().unwrap();
    }
    long.execute(
        "SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 2}')",
        &[],
    )
    .unwrap();
    // Every short transaction has ended: a tick now holds them all, and the reader reads it
    // while the long transaction is still open.
    let mut c = db.connect();
    let all_short: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    let started = Instant::now();
    while read_through.load(Ordering::SeqCst) < all_short {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the reader did not reach tick {all_short} while the long transaction was open"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    long.batch_execute("COMMIT").unwrap();
    let long_committed = Instant::now();
    let final_tick: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    reading.store(false, Ordering::SeqCst);
    let read = reader.join().unwrap();

    let committed = committed.lock().unwrap().clone();
    let rolled_back = rolled_back.lock().unwrap().clone();
    let ticks = ticks.lock().unwrap().clone();
    assert!(
        committed.len() > 100 && !rolled_back.is_empty(),
        "the load ran: {} committed, {} rolled back",
        committed.len(),
        rolled_back.len()
    );

    // Every committed event exactly once, nothing rolled back.
    let mut seen = HashSet::new();
    for ((_, _, _, w, n, j), _) in &read {
        assert!(
            !rolled_back.contains(&(*w, *n)),
            "a rolled-back event was read: {w}/{n}"
        );
        assert!(seen.insert((*w, *n, *j)), "event {w}/{n}/{j} read twice");
    }
    let expected: usize = committed
        .values()
        .map(|(_, _, k)| *k as usize)
        .sum::<usize>()
        + 3;
    assert_eq!(seen.len(), expected, "every committed event read once");

    // The order: (tick, txid, seq) strictly increasing; a transaction's events together, in the
    // order raised, in one batch.
    let stream: Vec<Read> = read.iter().map(|(r, _)| *r).collect();
    for pair in stream.windows(2) {
        assert!(
            (pair[0].0, pair[0].1, pair[0].2) < (pair[1].0, pair[1].1, pair[1].2),
            "out of order: {:?} then {:?}",
            pair[0],
            pair[1]
        );
    }
    let mut tick_of: BTreeMap<(i32, i32), (i64, u64)> = BTreeMap::new();
    let mut last_j: HashMap<(i32, i32), i32> = HashMap::new();
    for (tick, txid, _, w, n, j) in &stream {
        let at = *tick_of.entry((*w, *n)).or_insert((*tick, *txid));
        assert_eq!(
            at,
            (*tick, *txid),
            "transaction {w}/{n} split between batches"
        );
        let prev = last_j.insert((*w, *n), *j);
        assert_eq!(
            prev.map_or(0, |p| p + 1),
            *j,
            "transaction {w}/{n} out of raise order"
        );
    }
    let mut txids = HashSet::new();
    for (tick, txid) in tick_of.values() {
        assert!(
            txids.insert(txid),
            "two transactions with txid {txid} (tick {tick})"
        );
    }

    // Each transaction is in the first tick taken after its commit returned: every tick call
    // that began after that returned its tick or a later one; and one that ended before it
    // began is never delivered after it.
    let mut all: Vec<((i32, i32), Instant, Instant)> = committed
        .iter()
        .map(|(k, (began, done, _))| (*k, *began, *done))
        .collect();
    all.push(((LONG, 0), long_began, long_committed));
    for (k, _, done) in &all {
        let (tick, _) = tick_of[k];
        for (taken, began) in &ticks {
            assert!(
                began < done || *taken >= tick,
                "transaction {k:?} (tick {tick}) had committed before tick call returning {taken} began"
            );
        }
    }
    assert!(tick_of[&(LONG, 0)].0 <= final_tick);
    // By when they began, the lowest tick of the transactions that began at or after each.
    all.sort_by_key(|(_, began, _)| *began);
    let mut lowest_from = vec![i64::MAX; all.len() + 1];
    for i in (0..all.len()).rev() {
        lowest_from[i] = lowest_from[i + 1].min(tick_of[&all[i].0].0);
    }
    for (a, (_, a_done, _)) in &committed {
        let later = all.partition_point(|(_, began, _)| began <= a_done);
        assert!(
            tick_of[a].0 <= lowest_from[later],
            "{a:?} committed before a transaction began that was delivered in an earlier batch"
        );
    }

    // The ticks, taken by three at once, follow their snapshots: each sees every transaction the
    // one before saw, and they are numbered without a gap.
    let disorder: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.ticks n JOIN outbox.ticks p ON p.tick = n.tick - 1 \
              WHERE pg_snapshot_xmax(n.snapshot) < pg_snapshot_xmax(p.snapshot) \
                 OR pg_snapshot_xmin(n.snapshot) < pg_snapshot_xmin(p.snapshot) \
                 OR EXISTS (SELECT FROM pg_snapshot_xip(n.snapshot) x \
                             WHERE pg_visible_in_snapshot(x, p.snapshot))",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(disorder, 0, "a tick saw less than the one before it");
    let (count, max): (i64, i64) = c
        .query_one("SELECT count(*), max(tick) FROM outbox.ticks", &[])
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(count, max, "tick numbers have no gap");

    // The long transaction held back only its own events: every short one was read before it
    // committed, and its own came after them.
    let read_late: Vec<_> = read
        .iter()
        .filter(|((_, _, _, w, _, _), at)| *w != LONG && *at >= long_committed)
        .collect();
    assert!(
        read_late.is_empty(),
        "short events were read only after the long transaction committed: {read_late:?}"
    );
    assert!(tick_of[&(LONG, 0)].0 > all_short);

    // A batch is the same whenever it is read: read again now, every batch gives what it gave.
    let again: Vec<Read> = (1..=final_tick).flat_map(|t| batch(&mut c, t)).collect();
    assert_eq!(
        again, stream,
        "a batch read later differs from the same batch read live"
    );
}

#[test]
fn ticks_refuse_what_would_break_them() {
    let db = test_db("ticks_refusals");
    let mut c = db.connect();
    assert_eq!(
        sqlstate(
            &mut c,
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT outbox._tick()"
        ),
        "25000",
        "a tick needs a fresh snapshot after the lock"
    );
    c.batch_execute("ROLLBACK").unwrap();
    assert_eq!(
        sqlstate(&mut c, "SELECT * FROM outbox._tick_log(0, 5, '0', 0, 10)"),
        "55000",
        "a batch from a tick not taken is an error, not an empty batch"
    );
    assert_eq!(
        sqlstate(&mut c, "SELECT outbox._tick_snapshot(NULL)"),
        "22004"
    );
    // The snapshots and position outbox.read passes to outbox._batch_range: bad ones are refused
    // as such, not a crash of the backend.
    for bad in [
        "SELECT count(*) FROM outbox._batch_range('10:20:', 'x', '0', 0)",
        "SELECT count(*) FROM outbox._batch_range('20:10:', '10:20:', '0', 0)",
        "SELECT count(*) FROM outbox._batch_range('10:20:', '10:20:', '-1', 0)",
    ] {
        assert_eq!(sqlstate(&mut c, bad), "22P02", "{bad}");
    }
    // As the read rule: a NULL argument reads nothing (it is not STRICT, to be inlined).
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox._tick_log(NULL, 1, '0', 0, 10)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
    // Nothing raised in this database yet (it could be a restore still loading): no tick. A raise
    // makes the first; none while nothing new commits.
    let none: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    assert_eq!(none, 0, "no tick before anything was raised here");
    c.batch_execute("SELECT outbox.raise('t', '{\"w\": 1, \"n\": 1, \"j\": 0}')")
        .unwrap();
    // A range of the log reads that event, and nothing when an argument is NULL.
    let far = "'9223372036854775807'";
    for (sql, want) in [
        (format!("outbox._range_log('0', 0, {far}, NULL, 10)"), 1),
        (format!("outbox._range_after('0', 0, {far}, NULL, 10)"), 1),
        (
            format!("outbox._range_window('0', 0, {far}, NULL, 10, 1000)"),
            1,
        ),
        (format!("outbox._range_log('0', NULL, {far}, NULL, 10)"), 0),
        (format!("outbox._range_log(NULL, 0, {far}, NULL, 10)"), 0),
        ("outbox._range_log('0', 0, NULL, NULL, 10)".to_string(), 0),
        (format!("outbox._range_log('0', 0, {far}, NULL, NULL)"), 0),
        (
            format!("outbox._range_after('0', NULL, {far}, NULL, 10)"),
            0,
        ),
        (
            format!("outbox._range_window('0', 0, {far}, NULL, 10, NULL)"),
            0,
        ),
    ] {
        let n: i64 = c
            .query_one(&format!("SELECT count(*) FROM {sql}"), &[])
            .unwrap()
            .get(0);
        assert_eq!(n, want, "{sql}");
    }
    let first: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    let again: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    assert_eq!(
        (first, again),
        (1, 1),
        "a tick with an empty batch is not taken"
    );
    let got = batch(&mut c, 1);
    assert_eq!(got.len(), 1);
    c.batch_execute("SELECT outbox.raise('t', '{\"w\": 1, \"n\": 2, \"j\": 0}')")
        .unwrap();
    let next: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    assert_eq!(next, 2);
    assert_eq!(batch(&mut c, 2).len(), 1);
    // A second lineage row (a restore loading into this database): no tick until it is adopted.
    c.batch_execute(
        "INSERT INTO outbox.lineage (system_identifier, database, epoch, raised) VALUES (42, 1, 3, true); \
         INSERT INTO outbox.events (txid, seq, id, topic, payload) \
         VALUES ((3::int8 << 48)::text::xid8, 1, gen_random_uuid(), 'restored', '{}')",
    )
    .unwrap();
    let held: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    assert_eq!(held, 2, "no tick while the log's lineage is not settled");
    c.batch_execute("DELETE FROM outbox.lineage WHERE system_identifier = 42")
        .unwrap();
    // A role with the README's grants may not take ticks or read batches.
    c.batch_execute(
        "CREATE ROLE ticks_app LOGIN; GRANT USAGE ON SCHEMA outbox TO ticks_app; \
         GRANT EXECUTE ON FUNCTION outbox.raise(text, jsonb, text, text, jsonb) TO ticks_app",
    )
    .unwrap();
    let mut app = db.connect_as("ticks_app");
    for sql in [
        "SELECT outbox._tick()",
        "SELECT * FROM outbox._tick_log(0, 1, '0', 0, 10)",
        "SELECT outbox._tick_snapshot(1)",
        "SELECT outbox._tick_before(1)",
        "SELECT outbox._lock_ticks()",
        "SELECT * FROM outbox._snapshot_log('1:1:', '1:1:', '0', 0, 1)",
        "SELECT * FROM outbox._batch_window('1:1:', '1:1:', '0', 0, 1, 1000)",
        "SELECT * FROM outbox._range_log('0', 0, '5', NULL, 10)",
        "SELECT * FROM outbox._range_window('0', 0, '5', NULL, 10, 1000)",
        "SELECT * FROM outbox._range_after('0', 0, '5', NULL, 10)",
        "SELECT * FROM outbox._batch_range('1:1:', '1:1:', '0', 0)",
        "SELECT outbox._log_snapshot()",
        "SELECT * FROM outbox.ticks",
    ] {
        assert_eq!(sqlstate(&mut app, sql), "42501", "{sql}");
    }
}

/// A tick is taken exactly when its batch would hold an event, whichever way that is asked: a
/// transaction the last tick saw running ended (having raised or not), transactions began and
/// ended since, or only transactions still running raised.
#[test]
fn a_tick_is_taken_exactly_when_its_batch_holds_an_event() {
    let db = test_db("ticks_when_taken");
    let mut c = db.connect();
    let mut other = db.connect();
    let raise = |c: &mut Client, n: i32| {
        c.batch_execute(&format!(
            "SELECT outbox.raise('t', '{{\"w\": 1, \"n\": {n}, \"j\": 0}}')"
        ))
        .unwrap();
    };
    let tick =
        |c: &mut Client| -> i64 { c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0) };
    let ns = |c: &mut Client, t: i64| -> Vec<i32> { batch(c, t).iter().map(|r| r.4).collect() };
    raise(&mut c, 1);
    let t1 = tick(&mut c);
    assert_eq!(ns(&mut c, t1), vec![1]);
    // Nothing began or ended since: no tick.
    assert_eq!(tick(&mut c), t1);
    // A transaction still running raised; one that began after it committed an event.
    other.batch_execute("BEGIN").unwrap();
    raise(&mut other, 2);
    raise(&mut c, 3);
    let t2 = tick(&mut c);
    assert_eq!((t2, ns(&mut c, t2)), (t1 + 1, vec![3]));
    // Only the running one has events past the last tick: no tick.
    assert_eq!(
        tick(&mut c),
        t2,
        "the events of a running transaction are no batch"
    );
    // It ends: its events are the next batch.
    other.batch_execute("COMMIT").unwrap();
    let t3 = tick(&mut c);
    assert_eq!((t3, ns(&mut c, t3)), (t2 + 1, vec![2]));
    // One that began after the last tick raised and still runs: no tick, until it commits.
    other.batch_execute("BEGIN").unwrap();
    raise(&mut other, 5);
    assert_eq!(tick(&mut c), t3, "a transaction begun since still runs");
    other.batch_execute("COMMIT").unwrap();
    let t5 = tick(&mut c);
    assert_eq!((t5, ns(&mut c, t5)), (t3 + 1, vec![5]));
    // A transaction the last tick saw running ends without having raised: no tick.
    other
        .batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .unwrap();
    raise(&mut c, 4);
    let t4 = tick(&mut c);
    assert_eq!(ns(&mut c, t4), vec![4]);
    other.batch_execute("COMMIT").unwrap();
    assert_eq!(tick(&mut c), t4, "a transaction that raised nothing ended");
    // Transactions that raised nothing began and ended since: no tick.
    c.batch_execute("SELECT pg_current_xact_id()").unwrap();
    assert_eq!(tick(&mut c), t4);
}

#[test]
fn ticks_are_in_the_log_epoch() {
    // As after a restore elsewhere: this database's positions carry epoch 3 in their top bits.
    let db = test_db("ticks_epoch");
    let mut c = db.connect();
    c.batch_execute("UPDATE outbox.lineage SET epoch = 3")
        .unwrap();
    c.batch_execute("SELECT outbox.raise('t', '{\"w\": 1, \"n\": 1, \"j\": 0}')")
        .unwrap();
    let tick: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    assert_eq!(tick, (3 << 40) + 1, "the first tick of epoch 3");
    let got = batch(&mut c, tick);
    assert_eq!(got.len(), 1, "the event is in the batch of the first tick");
    assert!(got[0].1 >= 3 << 48, "a position of epoch 3: {}", got[0].1);
    let xmax: String = c
        .query_one(
            "SELECT pg_snapshot_xmax(snapshot)::text FROM outbox.ticks WHERE tick = $1",
            &[&tick],
        )
        .unwrap()
        .get(0);
    assert!(
        xmax.parse::<u64>().unwrap() > got[0].1,
        "the snapshot is in the same terms"
    );
}

/// The first tick whose snapshot sees transaction `txid` (in the log's terms), if any.
fn tick_seeing(c: &mut Client, txid: &str) -> Option<i64> {
    c.query_one(
        "SELECT min(tick) FROM outbox.ticks WHERE pg_visible_in_snapshot($1::text::xid8, snapshot)",
        &[&txid],
    )
    .unwrap()
    .get(0)
}

/// Raises one event in a transaction of its own and returns its transaction id, as positions
/// carry it.
fn raise_one(c: &mut Client, topic: &str) -> String {
    let mut t = c.transaction().unwrap();
    t.execute("SELECT outbox.raise($1)", &[&topic]).unwrap();
    let txid: String = t
        .query_one(
            "SELECT txid::text FROM outbox.events ORDER BY txid DESC, seq DESC LIMIT 1",
            &[],
        )
        .unwrap()
        .get(0);
    t.commit().unwrap();
    txid
}

#[test]
fn the_workers_tick_when_a_commit_wakes_them_and_a_long_transaction_does_not_stop_them() {
    let db = worker_db("ticks_workers");
    let mut c = db.connect();
    // A lost wake-up would cost the poll interval: 30 s. Each commit must be in a tick within 5.
    let _poll = Setting::new(&db, "pg_outbox.poll_interval", "30s", "1s");
    c.batch_execute(
        "CREATE TABLE seen (n bigint); \
         CREATE FUNCTION keep(events outbox.event[]) RETURNS void LANGUAGE sql \
           AS 'INSERT INTO seen SELECT count(*) FROM unnest(events)'; \
         SELECT outbox.create_sink('keeper', 'keep(outbox.event[])'); \
         SELECT outbox.alter_sink('keeper', '{\"read_by\": \"ticks\"}')",
    )
    .unwrap();
    let in_a_tick = |c: &mut Client, txid: &str| {
        pg_outbox_tests::eventually(
            &format!("a tick that sees transaction {txid}"),
            Duration::from_secs(5),
            || tick_seeing(c, txid),
        )
    };
    for _ in 0..5 {
        let txid = raise_one(&mut c, "tick.me");
        in_a_tick(&mut c, &txid);
    }

    // A long transaction holds an xid and has raised: the others' commits are still in ticks at
    // once, and its own event is in the first tick after it commits, not before.
    let mut long = db.connect();
    long.batch_execute("BEGIN; SELECT outbox.raise('long')")
        .unwrap();
    let long_txid: String = long
        .query_one("SELECT outbox._log_txid()::text", &[])
        .unwrap()
        .get(0);
    for _ in 0..3 {
        let txid = raise_one(&mut c, "short");
        let t = in_a_tick(&mut c, &txid);
        assert_eq!(tick_seeing(&mut c, &long_txid), None, "tick {t}");
    }
    long.batch_execute("COMMIT").unwrap();
    in_a_tick(&mut c, &long_txid);
}

/// A cluster setting changed for one test, put back when it ends, even if it fails.
struct Setting<'a> {
    db: &'a pg_outbox_tests::TestDb,
    name: &'static str,
    default: &'static str,
}

impl<'a> Setting<'a> {
    fn new(
        db: &'a pg_outbox_tests::TestDb,
        name: &'static str,
        value: &str,
        default: &'static str,
    ) -> Self {
        db.cluster().set(name, value);
        Setting { db, name, default }
    }
}

impl Drop for Setting<'_> {
    fn drop(&mut self) {
        self.db.cluster().set(self.name, self.default);
    }
}

#[test]
fn a_long_transaction_with_many_events_is_not_scanned_again_at_every_tick() {
    let db = test_db("ticks_long");
    let mut c = db.connect();
    c.batch_execute("SELECT outbox.raise('first')").unwrap();
    // A long transaction has raised 20,000 events and is still open: it is in the running list of
    // every tick taken meanwhile.
    let mut long = db.connect();
    long.batch_execute(
        "BEGIN; SELECT outbox.raise_many(ARRAY['long'], array_agg(jsonb_build_object('i', i))) \
           FROM generate_series(1, 20000) i",
    )
    .unwrap();
    let mut tick = 0i64;
    for _ in 0..3 {
        c.batch_execute("SELECT outbox.raise('short')").unwrap();
        tick = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    }
    // Reading a batch, or asking whether one would be empty, does not visit its rows (a scan of
    // the index for it would touch a buffer for each of them).
    let read = buffers(
        &mut c,
        &format!("SELECT count(*) FROM outbox._tick_log(outbox._tick_before({tick}), {tick}, '0', 0, 1000)"),
    );
    assert!(read < 200, "reading a batch touched {read} buffers");
    c.batch_execute("SELECT outbox.raise('short')").unwrap();
    let take = buffers(&mut c, "SELECT outbox._tick()");
    assert!(take < 200, "taking a tick touched {take} buffers");
    long.batch_execute("COMMIT").unwrap();
    // Once it has ended, its events are in the next batch, all of them.
    let next: i64 = c.query_one("SELECT outbox._tick()", &[]).unwrap().get(0);
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox._tick_log(outbox._tick_before($1), $1, '0', 0, 100000) \
              WHERE topic = 'long'",
            &[&next],
        )
        .unwrap()
        .get(0);
    assert_eq!(n, 20000);
}

/// Checks what a reader by ticks got, in order, as (writer, transaction, index in it), against
/// what the writers committed (`long`: the writer of a transaction the writers did not run): each
/// event once, none rolled back, each transaction's events together and in the order raised, and
/// no transaction that committed before another began got after it. Where each transaction's
/// first event is.
fn check_order(
    what: &str,
    got: &[(i32, i32, i32)],
    committed: &HashMap<(i32, i32), (Instant, Instant, i32)>,
    long: i32,
) -> HashMap<(i32, i32), usize> {
    let mut seen = HashSet::new();
    let mut first_of: HashMap<(i32, i32), usize> = HashMap::new();
    for (i, &(w, k, j)) in got.iter().enumerate() {
        assert!(seen.insert((w, k, j)), "{what}: ({w}, {k}, {j}) twice");
        if w != long {
            let (_, _, events) = committed
                .get(&(w, k))
                .unwrap_or_else(|| panic!("{what}: ({w}, {k}) was rolled back, yet got"));
            assert!(j < *events);
        }
        let at = *first_of.entry((w, k)).or_insert(i);
        assert_eq!(
            i - at,
            j as usize,
            "{what}: ({w}, {k}) is not together and in order"
        );
    }
    let mut by_begin: Vec<((i32, i32), Instant)> = committed
        .iter()
        .filter(|(k, _)| first_of.contains_key(k))
        .map(|(k, (b, _, _))| (*k, *b))
        .collect();
    by_begin.sort_by_key(|(_, b)| *b);
    for (a, (_, a_done, _)) in committed.iter().filter(|(k, _)| first_of.contains_key(k)) {
        let later = by_begin.partition_point(|(_, b)| b <= a_done);
        for (b, _) in &by_begin[later..] {
            assert!(
                first_of[a] < first_of[b],
                "{what}: {a:?} committed before {b:?} began, yet got after it"
            );
        }
    }
    first_of
}

#[test]
fn a_sql_sink_that_reads_by_ticks_gets_every_event_once_while_a_long_transaction_is_open() {
    let db = worker_db("ticks_sink");
    let mut c = db.connect();
    c.batch_execute(
        "CREATE TABLE got (n bigserial, pos text, w int, k int, j int); \
         CREATE FUNCTION keep(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ \
           INSERT INTO got (pos, w, k, j) \
           SELECT e.position, (e.payload->>'w')::int, (e.payload->>'n')::int, (e.payload->>'j')::int \
             FROM unnest(events) WITH ORDINALITY AS e ORDER BY e.ordinality $$; \
         SELECT outbox.create_sink('reader', 'keep(outbox.event[])', start_at => 'now'); \
         SELECT outbox.alter_sink('reader', '{\"read_by\": \"ticks\"}'); \
         CREATE FUNCTION ignore(events outbox.event[]) RETURNS void LANGUAGE sql AS 'SELECT'; \
         SELECT outbox.create_sink('old', 'ignore(outbox.event[])', start_at => 'now')",
    )
    .unwrap();
    const LONG: i32 = 99;
    // A log that was raised in before (a log's first tick waits for its first raise to commit,
    // see outbox._tick: here that would be the long transaction's).
    c.batch_execute("UPDATE outbox.lineage SET raised = true")
        .unwrap();
    // The long transaction has raised, and holds its transaction id while the others run.
    let mut long = db.connect();
    long.batch_execute("BEGIN; SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 0}')")
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let (writers, committed, _) = spawn_writers(&db, 8, 0x2545_F491_4F6C_DD1D, 4000, 5, &stop);
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    let committed = committed.lock().unwrap().clone();
    let short: i64 = committed.values().map(|(_, _, e)| *e as i64).sum();
    // Every short transaction's events reach the sink while the long one is still open.
    let got_short = |c: &mut Client| -> i64 {
        c.query_one("SELECT count(*) FROM got WHERE w <> 99", &[])
            .unwrap()
            .get(0)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while got_short(&mut c) < short {
        if Instant::now() > deadline {
            let state: String = c
                .query_one(
                    "SELECT format('%s of %s short events; cursor %s; ticks %s; sink %s', \
                            (SELECT count(*) FROM got WHERE w <> 99), $1::int8, \
                            (SELECT row(c.*)::text FROM outbox.consumers c WHERE name = 'reader'), \
                            (SELECT row(count(*), min(tick), max(tick))::text FROM outbox.ticks), \
                            (SELECT row(s.*)::text FROM outbox.sinks s WHERE id = 'reader'))",
                    &[&short],
                )
                .unwrap()
                .get(0);
            let log = db.cluster().log();
            panic!(
                "the short transactions' events did not all reach the sink while the long one was open: {state}\n{}",
                &log[log.len().saturating_sub(6000)..]
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // status() tells the two apart: the sink by ticks has nothing left; the one by the read
    // horizon waits behind the long transaction.
    let status = |c: &mut Client, sink: &str| -> (String, i64) {
        c.query_one(
            "SELECT state, events_behind FROM outbox.status() WHERE name = $1",
            &[&sink],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap()
    };
    assert_eq!(status(&mut c, "reader"), ("idle".to_string(), 0));
    assert_eq!(status(&mut c, "old").0, "held by horizon");
    long.batch_execute("SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 1}'); COMMIT")
        .unwrap();
    pg_outbox_tests::eventually(
        "the long transaction's events in the sink",
        Duration::from_secs(30),
        || {
            let n: i64 = c.query_one("SELECT count(*) FROM got", &[]).unwrap().get(0);
            (n >= short + 2).then_some(())
        },
    );
    let got: Vec<(i64, String, i32, i32, i32)> = c
        .query("SELECT n, pos, w, k, j FROM got ORDER BY n", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    assert_eq!(got.len() as i64, short + 2, "every committed event once");
    // Positions are the events' own.
    assert!(got.iter().all(|(_, pos, ..)| pos.contains(':')));
    let order: Vec<(i32, i32, i32)> = got.iter().map(|&(_, _, w, k, j)| (w, k, j)).collect();
    let first_of = check_order("sink", &order, &committed, LONG);
    // The long transaction, visible last, is delivered last.
    assert_eq!(first_of[&(LONG, 0)], got.len() - 2);
    // The sink's cursor is a batch: it reads by ticks.
    let tick: Option<i64> = c
        .query_one(
            "SELECT tick FROM outbox.consumers WHERE name = 'reader'",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(tick.is_some());
}

#[test]
fn a_sink_by_ticks_dead_letters_a_poison_event_at_the_end_of_a_batch_after_testing_the_next_batch()
{
    let db = worker_db("ticks_poison");
    let mut c = db.connect();
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; \
         CREATE TABLE got (n bigserial, topic text, i int); \
         CREATE FUNCTION keep(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$ \
         BEGIN \
           IF EXISTS (SELECT FROM unnest(events) e WHERE e.payload ? 'poison') THEN \
             RAISE EXCEPTION 'poison in batch'; \
           END IF; \
           INSERT INTO got (topic, i) SELECT e.topic, (e.payload->>'i')::int \
             FROM unnest(events) WITH ORDINALITY AS e ORDER BY e.ordinality; \
         END $$; \
         SELECT outbox.create_sink('picky', 'keep(outbox.event[])', topics => ARRAY['keep.*'], \
                                   start_at => 'now'); \
         SELECT outbox.alter_sink('picky', '{\"read_by\": \"ticks\"}'); \
         SELECT outbox.pause_sink('picky')",
    )
    .unwrap();
    let in_a_tick = |c: &mut Client, txid: &str| {
        pg_outbox_tests::eventually(
            &format!("a tick that sees transaction {txid}"),
            Duration::from_secs(10),
            || tick_seeing(c, txid),
        )
    };
    // One batch: nine events, the poison, and three the sink's topics do not match. The next
    // batch (a tick later): five more.
    let mut t = c.transaction().unwrap();
    t.batch_execute(
        "SELECT outbox.raise('keep.a', jsonb_build_object('i', i)) FROM generate_series(1, 9) i; \
         SELECT outbox.raise('keep.a', '{\"i\": 10, \"poison\": true}'); \
         SELECT outbox.raise('other.x', jsonb_build_object('i', i)) FROM generate_series(11, 13) i",
    )
    .unwrap();
    let first: String = t
        .query_one("SELECT outbox._log_txid()::text", &[])
        .unwrap()
        .get(0);
    t.commit().unwrap();
    let first_tick = in_a_tick(&mut c, &first);
    let second = raise_one(&mut c, "keep.b");
    let second_tick = in_a_tick(&mut c, &second);
    assert!(second_tick > first_tick, "two batches");
    c.batch_execute("SELECT outbox.resume_sink('picky')")
        .unwrap();
    let dead: (String, i32) = pg_outbox_tests::eventually(
        "the poison dead-lettered",
        Duration::from_secs(60),
        || {
            c.query_opt(
                "SELECT (event).payload::text, attempts FROM outbox.dead_letters WHERE sink = 'picky'",
                &[],
            )
            .unwrap()
            .map(|r| (r.get(0), r.get(1)))
        },
    );
    assert_eq!(dead, (r#"{"i": 10, "poison": true}"#.to_string(), 5));
    let got: Vec<(String, Option<i32>)> =
        pg_outbox_tests::eventually("the rest delivered", Duration::from_secs(30), || {
            let got: Vec<(String, Option<i32>)> = c
                .query("SELECT topic, i FROM got ORDER BY n", &[])
                .unwrap()
                .iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect();
            (got.len() >= 10).then_some(got)
        });
    let mut want: Vec<(String, Option<i32>)> =
        (1..=9).map(|i| ("keep.a".to_string(), Some(i))).collect();
    want.push(("keep.b".to_string(), None));
    assert_eq!(got, want, "everything but the poison, once, in order");
    let (tick, status): (Option<i64>, String) = c
        .query_one(
            "SELECT c.tick, s.state FROM outbox.consumers c JOIN outbox.status() s ON s.name = c.name \
              WHERE c.name = 'picky'",
            &[],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(tick, Some(second_tick), "its cursor is in the second batch");
    assert_ne!(status, "down");
}

#[test]
fn read_by_is_refused_where_it_does_not_apply() {
    let db = test_db("ticks_read_by");
    let mut c = db.connect();
    c.batch_execute(
        "CREATE FUNCTION keep(events outbox.event[]) RETURNS void LANGUAGE sql AS 'SELECT'; \
         SELECT outbox.create_sink('s', 'keep(outbox.event[])'); \
         SET pg_outbox.http_allow_plain = on; SET pg_outbox.http_allow_private = on; \
         SELECT outbox.create_http_sink('h', 'http://127.0.0.1:9/in')",
    )
    .unwrap();
    let read_by = |c: &mut Client, name: &str| -> (String, Option<i64>) {
        c.query_one(
            "SELECT read_by, tick FROM outbox.consumers WHERE name = $1",
            &[&name],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap()
    };
    // Back to the horizon while it reads by it: nothing to do.
    c.batch_execute("SELECT outbox.alter_sink('h', '{\"read_by\": \"horizon\"}')")
        .unwrap();
    for bad in ["\"xmin\"", "\"Ticks\"", "true", "null"] {
        assert_eq!(
            sqlstate(
                &mut c,
                &format!("SELECT outbox.alter_sink('s', '{{\"read_by\": {bad}}}')")
            ),
            "22023",
            "{bad}"
        );
    }
    assert_eq!(read_by(&mut c, "s"), ("horizon".into(), None));
    c.batch_execute("SELECT outbox.alter_sink('s', '{\"read_by\": \"ticks\"}')")
        .unwrap();
    c.batch_execute("SELECT outbox.alter_sink('s', '{\"read_by\": \"ticks\"}')")
        .unwrap();
    assert_eq!(read_by(&mut c, "s"), ("ticks".into(), None));
    assert_eq!(
        sqlstate(
            &mut c,
            "SELECT outbox.alter_sink('s', '{\"read_by\": \"horizon\"}')"
        ),
        "0A000",
        "a sink that reads by ticks goes on doing so"
    );
    // A cursor in a batch goes back to one of the read rule's with a rewind (and the database
    // keeps the batch and the cursor together).
    c.batch_execute(
        "UPDATE outbox.consumers SET tick = 1, since = '5:5:', upto = '6:6:' WHERE name = 's'; \
         SELECT outbox.rewind('s', '0:0')",
    )
    .unwrap();
    assert_eq!(read_by(&mut c, "s"), ("ticks".into(), None));
    assert_eq!(
        sqlstate(
            &mut c,
            "UPDATE outbox.consumers SET tick = 1 WHERE name = 's'"
        ),
        "23514",
        "a tick without the snapshot its batch starts from"
    );
    assert_eq!(
        sqlstate(
            &mut c,
            "UPDATE outbox.consumers SET tick = 1, since = '5:5:', upto = '6:6:' WHERE name = 'h'"
        ),
        "23514",
        "a batch for a reader that reads by the horizon"
    );
    // An HTTP sink reads by ticks too, and goes on doing so.
    c.batch_execute("SELECT outbox.alter_sink('h', '{\"read_by\": \"ticks\"}')")
        .unwrap();
    assert_eq!(read_by(&mut c, "h"), ("ticks".into(), None));
    assert_eq!(
        sqlstate(
            &mut c,
            "SELECT outbox.alter_sink('h', '{\"read_by\": \"horizon\"}')"
        ),
        "0A000"
    );
}

#[test]
fn pruning_keeps_what_a_sink_by_ticks_has_not_read() {
    let db = worker_db("ticks_prune");
    let mut c = db.connect();
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; \
         CREATE TABLE got (n bigserial, topic text); \
         CREATE FUNCTION keep(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ \
           INSERT INTO got (topic) SELECT e.topic FROM unnest(events) WITH ORDINALITY AS e \
            ORDER BY e.ordinality $$; \
         SELECT outbox.create_sink('p', 'keep(outbox.event[])', start_at => 'now'); \
         SELECT outbox.alter_sink('p', '{\"read_by\": \"ticks\"}')",
    )
    .unwrap();
    let got = |c: &mut Client, n: usize| -> Vec<String> {
        pg_outbox_tests::eventually(
            &format!("{n} events delivered"),
            Duration::from_secs(20),
            || {
                let got: Vec<String> = c
                    .query("SELECT topic FROM got ORDER BY n", &[])
                    .unwrap()
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                (got.len() >= n).then_some(got)
            },
        )
    };
    let log = |c: &mut Client| -> Vec<String> {
        c.query("SELECT topic FROM outbox.events ORDER BY txid, seq", &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    // A long transaction has raised; a later one commits and is delivered.
    let mut long = db.connect();
    long.batch_execute("BEGIN; SELECT outbox.raise('long')")
        .unwrap();
    raise_one(&mut c, "a");
    assert_eq!(got(&mut c, 1), ["a"]);
    // Pruning now keeps what the sink has read after the long transaction's events: its cursor
    // is not a prefix of the log.
    c.batch_execute("SELECT outbox.prune('0')").unwrap();
    assert_eq!(log(&mut c), ["a"]);
    long.batch_execute("COMMIT").unwrap();
    assert_eq!(got(&mut c, 2), ["a", "long"]);
    raise_one(&mut c, "b");
    assert_eq!(got(&mut c, 3), ["a", "long", "b"]);
    // Once the sink is in a batch after the one that held them, they go.
    c.batch_execute("SELECT outbox.prune('0')").unwrap();
    assert_eq!(log(&mut c), ["b"]);
    // And delivery goes on.
    raise_one(&mut c, "c");
    assert_eq!(got(&mut c, 4), ["a", "long", "b", "c"]);
}

/// A sink `name` by ticks whose handler records each event's topic in `got`, in order.
fn recording_sink_by_ticks(c: &mut Client, name: &str) {
    c.batch_execute(&format!(
        "UPDATE outbox.lineage SET raised = true; \
         CREATE TABLE IF NOT EXISTS got (n bigserial, topic text); \
         CREATE OR REPLACE FUNCTION keep(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ \
           INSERT INTO got (topic) SELECT e.topic FROM unnest(events) WITH ORDINALITY AS e \
            ORDER BY e.ordinality $$; \
         SELECT outbox.create_sink('{name}', 'keep(outbox.event[])', start_at => 'now'); \
         SELECT outbox.alter_sink('{name}', '{{\"read_by\": \"ticks\"}}')"
    ))
    .unwrap();
}

fn got(c: &mut Client) -> Vec<String> {
    c.query("SELECT topic FROM got ORDER BY n", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[test]
fn a_backlog_of_many_ticks_goes_over_at_once_and_the_ticks_go_after_it() {
    let db = worker_db("ticks_backlog");
    let mut c = db.connect();
    // A pass that stopped at the end of each batch would leave the rest for the next poll: 30 s.
    let _poll = Setting::new(&db, "pg_outbox.poll_interval", "30s", "1s");
    recording_sink_by_ticks(&mut c, "b");
    // The sink turns to ticks, then waits paused while 20 transactions commit, a tick each.
    raise_one(&mut c, "t.0");
    pg_outbox_tests::eventually("the first event", Duration::from_secs(10), || {
        (got(&mut c).len() == 1).then_some(())
    });
    c.batch_execute("SELECT outbox.pause_sink('b')").unwrap();
    let mut want = vec!["t.0".to_string()];
    for i in 1..=20 {
        let topic = format!("t.{i}");
        raise_one(&mut c, &topic);
        c.batch_execute("SELECT outbox._tick()").unwrap();
        want.push(topic);
    }
    let ticks: i64 = c
        .query_one("SELECT count(*) FROM outbox.ticks", &[])
        .unwrap()
        .get(0);
    assert!(ticks >= 20, "{ticks} ticks");
    c.batch_execute("SELECT outbox.resume_sink('b')").unwrap();
    let all = pg_outbox_tests::eventually(
        "the backlog of 20 batches delivered",
        Duration::from_secs(10),
        || {
            let got = got(&mut c);
            (got.len() >= want.len()).then_some(got)
        },
    );
    assert_eq!(all, want, "once each, in the order they became visible");
    // The ticks the sink has passed go, but the newest.
    pg_outbox_tests::eventually("the passed ticks pruned", Duration::from_secs(30), || {
        let left: i64 = c
            .query_one("SELECT count(*) FROM outbox.ticks", &[])
            .unwrap()
            .get(0);
        (left <= 2).then_some(())
    });
}

#[test]
fn a_sink_by_ticks_goes_on_when_the_ticks_of_its_batches_are_gone() {
    let db = worker_db("ticks_gone");
    let mut c = db.connect();
    recording_sink_by_ticks(&mut c, "g");
    raise_one(&mut c, "a");
    pg_outbox_tests::eventually("the first event", Duration::from_secs(10), || {
        (got(&mut c).len() == 1).then_some(())
    });
    c.batch_execute("SELECT outbox.pause_sink('g')").unwrap();
    for topic in ["b", "c", "d"] {
        raise_one(&mut c, topic);
        c.batch_execute("SELECT outbox._tick()").unwrap();
    }
    // More than pruning would take: every tick but the newest, the sink's own among them.
    c.batch_execute(
        "DELETE FROM outbox.ticks WHERE tick < (SELECT max(tick) FROM outbox.ticks); \
         SELECT outbox.resume_sink('g')",
    )
    .unwrap();
    let all = pg_outbox_tests::eventually("the rest delivered", Duration::from_secs(10), || {
        let got = got(&mut c);
        (got.len() >= 4).then_some(got)
    });
    assert_eq!(all, ["a", "b", "c", "d"]);
    raise_one(&mut c, "e");
    let all = pg_outbox_tests::eventually("one more", Duration::from_secs(10), || {
        let got = got(&mut c);
        (got.len() >= 5).then_some(got)
    });
    assert_eq!(all, ["a", "b", "c", "d", "e"]);
}

#[test]
fn a_first_raise_rolled_back_leaves_the_log_to_be_marked_by_the_next() {
    let db = test_db("ticks_first_raise");
    let mut c = db.connect();
    let raised = |c: &mut Client| -> bool {
        c.query_one("SELECT raised FROM outbox.lineage", &[])
            .unwrap()
            .get(0)
    };
    // The first raises of this backend mark the log in a transaction that rolls back: once in a
    // savepoint, then after it, then reading the horizon (what status() and sinks do).
    c.batch_execute(
        "BEGIN; SAVEPOINT s; SELECT outbox.raise('a'); RELEASE s; SELECT outbox.raise('b'); \
         SELECT count(*) FROM outbox.status(); SAVEPOINT t; SELECT outbox.raise('c'); ROLLBACK",
    )
    .unwrap();
    assert!(!raised(&mut c));
    assert_eq!(
        c.query_one("SELECT outbox._tick()", &[])
            .unwrap()
            .get::<_, i64>(0),
        0,
        "no tick in a log never raised in"
    );
    // The same backend's next raise marks it, and ticks start.
    c.batch_execute("SELECT outbox.raise('d')").unwrap();
    assert!(raised(&mut c));
    assert_eq!(
        c.query_one("SELECT outbox._tick()", &[])
            .unwrap()
            .get::<_, i64>(0),
        1
    );
}

/// One event a pull consumer read: (position, writer, transaction, index in it).
type Pulled = (String, i32, i32, i32);

/// Reads `consumer` until `done` says so: pages of 1 to 40 events; of each, consumes a first part
/// (sometimes all of it, sometimes none) and advances to its last event, so the rest of the page
/// is read again next time. What it consumed, in order.
fn pull_until(
    c: &mut Client,
    consumer: &str,
    seed: u64,
    done: impl Fn(&[Pulled]) -> bool,
) -> Vec<Pulled> {
    let mut rng = seed;
    let mut consumed: Vec<Pulled> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(&consumed) {
        assert!(
            Instant::now() < deadline,
            "{consumer} consumed {} events, then no more",
            consumed.len()
        );
        let max = 1 + (next(&mut rng) % 40) as i32;
        let page: Vec<Pulled> = c
            .query(
                "SELECT position, (payload->>'w')::int, (payload->>'n')::int, (payload->>'j')::int \
                   FROM outbox.read($1, $2)",
                &[&consumer, &max],
            )
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
            .collect();
        if page.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let take = match next(&mut rng) % 4 {
            0 => 0,
            1 => 1 + (next(&mut rng) as usize % page.len()),
            _ => page.len(),
        };
        if take == 0 {
            continue;
        }
        let moved: bool = c
            .query_one(
                "SELECT outbox.advance($1, $2)",
                &[&consumer, &page[take - 1].0],
            )
            .unwrap()
            .get(0);
        assert!(
            moved,
            "advance to {} did not move {consumer}",
            page[take - 1].0
        );
        consumed.extend(page.into_iter().take(take));
    }
    consumed
}

/// Reads pull consumer `consumer` on a thread of its own (as `pull_until`) until every event the
/// writers committed is consumed, counted once `written` is set (every writer returned, its last
/// commit counted). What it consumed.
fn pull_while_writing(
    db: &pg_outbox_tests::TestDb,
    consumer: &'static str,
    seed: u64,
    committed: &Committed,
) -> (Arc<AtomicBool>, std::thread::JoinHandle<Vec<Pulled>>) {
    let written = Arc::new(AtomicBool::new(false));
    let (writing, shared) = (written.clone(), committed.clone());
    let mut puller = db.connect();
    let reader = std::thread::spawn(move || {
        pull_until(&mut puller, consumer, seed, |consumed| {
            if !writing.load(Ordering::SeqCst) {
                return false;
            }
            let short: usize = shared
                .lock()
                .unwrap()
                .values()
                .map(|(_, _, e)| *e as usize)
                .sum();
            consumed.len() >= short
        })
    });
    (written, reader)
}

#[test]
fn a_pull_consumer_that_reads_by_ticks_gets_every_event_once_while_a_long_transaction_is_open() {
    let db = worker_db("ticks_pull");
    let mut c = db.connect();
    // A log that was raised in before (a log's first tick waits for its first raise to commit).
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; \
         SELECT outbox.create_consumer('puller', 'now'); \
         SELECT outbox.alter_consumer('puller', '{\"read_by\": \"ticks\"}'); \
         SELECT outbox.create_consumer('old', 'now')",
    )
    .unwrap();
    // It is in a batch at once: no wait for a tick, nor for the read horizon.
    let tick: Option<i64> = c
        .query_one(
            "SELECT tick FROM outbox.consumers WHERE name = 'puller'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(tick, Some(0), "in a batch before the first tick");
    const LONG: i32 = 99;
    let mut long = db.connect();
    long.batch_execute("BEGIN; SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 0}')")
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let (writers, committed, _) = spawn_writers(&db, 8, 0x9E37_79B9_7F4A_7C15, 4000, 5, &stop);
    // The consumer reads while the writers write, and goes on until it has every short event.
    let (written, reader) = pull_while_writing(&db, "puller", 0xD1B5_4A32_D192_ED03, &committed);
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    written.store(true, Ordering::SeqCst);
    let mut consumed = reader.join().unwrap();
    let committed = committed.lock().unwrap().clone();
    let short: i64 = committed.values().map(|(_, _, e)| *e as i64).sum();
    assert_eq!(
        consumed.len() as i64,
        short,
        "every short event, while the long transaction is open"
    );
    // status() tells the two apart, as for sinks.
    let status = |c: &mut Client, name: &str| -> (String, i64) {
        c.query_one(
            "SELECT state, events_behind FROM outbox.status() WHERE name = $1",
            &[&name],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap()
    };
    assert_eq!(status(&mut c, "puller"), ("idle".to_string(), 0));
    assert_eq!(status(&mut c, "old").0, "held by horizon");
    long.batch_execute("SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 1}'); COMMIT")
        .unwrap();
    let mut puller = db.connect();
    consumed.extend(pull_until(&mut puller, "puller", 7, |consumed| {
        consumed.len() == 2
    }));
    assert!(pull_until(&mut puller, "puller", 8, |_| true).is_empty());
    assert!(c
        .query("SELECT * FROM outbox.read('puller', 100)", &[])
        .unwrap()
        .is_empty());

    // Once each, nothing rolled back, a transaction's events together and in raise order, the
    // long one last, and none committed before another began read after it.
    let order: Vec<(i32, i32, i32)> = consumed.iter().map(|&(_, w, k, j)| (w, k, j)).collect();
    let first_of = check_order("puller", &order, &committed, LONG);
    assert_eq!(consumed.len() as i64, short + 2);
    assert_eq!(first_of[&(LONG, 0)], consumed.len() - 2);
    // The consumer by the read horizon beside it reads the same events, in log order.
    let old = pull_until(&mut c, "old", 9, |consumed| {
        consumed.len() as i64 == short + 2
    });
    let mut a: Vec<_> = old.iter().map(|(_, w, k, j)| (*w, *k, *j)).collect();
    let mut b: Vec<_> = consumed.iter().map(|(_, w, k, j)| (*w, *k, *j)).collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
}

#[test]
fn a_pull_consumer_by_ticks_advances_batch_by_batch_and_refuses_what_it_was_not_handed() {
    let db = test_db("ticks_pull_advance");
    let mut c = db.connect();
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; \
         SELECT outbox.raise('t', '{\"n\": 1}'); \
         SELECT outbox.create_consumer('p'); \
         SELECT outbox.create_consumer('h')",
    )
    .unwrap();
    // No tick yet: its batch is from its cursor to a snapshot of its own.
    c.batch_execute("SELECT outbox.alter_consumer('p', '{\"read_by\": \"ticks\"}')")
        .unwrap();
    let ns = |c: &mut Client, max: i32| -> Vec<(String, i32)> {
        c.query(
            "SELECT position, (payload->>'n')::int FROM outbox.read('p', $1)",
            &[&max],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
    };
    let first = ns(&mut c, 10);
    assert_eq!(first.iter().map(|(_, n)| *n).collect::<Vec<_>>(), vec![1]);
    // A transaction that commits now is in no batch until a tick sees it.
    c.batch_execute("SELECT outbox.raise('t', '{\"n\": 2}')")
        .unwrap();
    let pos: String = c
        .query_one("SELECT position FROM outbox.read('h', 10) OFFSET 1", &[])
        .unwrap()
        .get(0);
    assert_eq!(ns(&mut c, 10).len(), 1, "n 2 is in no batch yet");
    assert_eq!(
        sqlstate(&mut c, &format!("SELECT outbox.advance('p', '{pos}')")),
        "22023",
        "a position no tick has seen"
    );
    // A long transaction holds the horizon; ticks go on past it.
    let mut long = db.connect();
    long.batch_execute("BEGIN; SELECT outbox.raise('long', '{\"n\": 100}')")
        .unwrap();
    // (Each statement its own transaction: a tick sees only what committed before it.)
    for sql in [
        "SELECT outbox._tick()",
        "SELECT outbox.raise('t', '{\"n\": 3}')",
        "SELECT outbox._tick()",
        "SELECT outbox.raise('t', '{\"n\": 4}')",
        "SELECT outbox._tick()",
    ] {
        c.batch_execute(sql).unwrap();
    }
    let all = ns(&mut c, 10);
    assert_eq!(
        all.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    // Pages cross batches; advancing into a later batch moves the consumer there.
    assert_eq!(
        ns(&mut c, 2).iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        vec![1, 2]
    );
    let advance = |c: &mut Client, to: &str| -> bool {
        c.query_one("SELECT outbox.advance('p', $1)", &[&to])
            .unwrap()
            .get(0)
    };
    assert!(advance(&mut c, &all[2].0));
    assert_eq!(
        ns(&mut c, 10).iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        vec![4]
    );
    assert!(!advance(&mut c, &all[2].0), "not forward");
    assert!(!advance(&mut c, &all[0].0), "a batch it has passed");
    assert!(advance(&mut c, &all[3].0));
    assert!(ns(&mut c, 10).is_empty());
    let tick: i64 = c
        .query_one("SELECT tick FROM outbox.consumers WHERE name = 'p'", &[])
        .unwrap()
        .get(0);
    assert_eq!(tick, newest_tick(&mut c));
    // The one by the horizon is held behind the long transaction: n 1 and 2 only.
    assert_eq!(
        c.query("SELECT * FROM outbox.read('h', 10)", &[])
            .unwrap()
            .len(),
        2
    );
    long.batch_execute("COMMIT").unwrap();
    c.batch_execute("SELECT outbox._tick()").unwrap();
    assert_eq!(
        ns(&mut c, 10).iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        vec![100]
    );

    // A rewind starts a batch from the position at once: one batch to now, in transaction order
    // (the long transaction began before n 3's).
    c.batch_execute(&format!("SELECT outbox.rewind('p', '{}')", all[0].0))
        .unwrap();
    assert!(c
        .query_one(
            "SELECT tick IS NOT NULL FROM outbox.consumers WHERE name = 'p'",
            &[]
        )
        .unwrap()
        .get::<_, bool>(0));
    assert_eq!(
        ns(&mut c, 10).iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        vec![2, 100, 3, 4]
    );

    // Refusals: back to the horizon, a sink's option, a sink, REPEATABLE READ, another role's.
    for (sql, state) in [
        (
            "SELECT outbox.alter_consumer('p', '{\"read_by\": \"horizon\"}')",
            "0A000",
        ),
        (
            "SELECT outbox.alter_consumer('h', '{\"synchronous_commit\": false}')",
            "22023",
        ),
        (
            "SELECT outbox.alter_consumer('h', '{\"read_by\": 1}')",
            "22023",
        ),
        ("SELECT outbox.alter_consumer('h', '{}')", "22023"),
        ("SELECT outbox.alter_consumer('h', NULL)", "22004"),
        (
            "SELECT outbox.alter_consumer('nope', '{\"read_by\": \"ticks\"}')",
            "42704",
        ),
    ] {
        assert_eq!(sqlstate(&mut c, sql), state, "{sql}");
    }
    assert_eq!(
        sqlstate(
            &mut c,
            "BEGIN ISOLATION LEVEL REPEATABLE READ; \
             SELECT outbox.alter_consumer('h', '{\"read_by\": \"ticks\"}')"
        ),
        "25001"
    );
    c.batch_execute("ROLLBACK").unwrap();
    c.batch_execute(
        "CREATE FUNCTION keep(events outbox.event[]) RETURNS void LANGUAGE sql AS 'SELECT'; \
         SELECT outbox.create_sink('s', 'keep(outbox.event[])')",
    )
    .unwrap();
    assert_eq!(
        sqlstate(
            &mut c,
            "SELECT outbox.alter_consumer('s', '{\"read_by\": \"ticks\"}')"
        ),
        "42809"
    );
    c.batch_execute(
        "CREATE ROLE ticks_tenant LOGIN; GRANT USAGE ON SCHEMA outbox TO ticks_tenant; \
         GRANT EXECUTE ON FUNCTION outbox.alter_consumer(text, jsonb) TO ticks_tenant",
    )
    .unwrap();
    let mut tenant = db.connect_as("ticks_tenant");
    assert_eq!(
        sqlstate(
            &mut tenant,
            "SELECT outbox.alter_consumer('h', '{\"read_by\": \"ticks\"}')"
        ),
        "42501"
    );
    for internal in [
        "outbox._flush_log()",
        "outbox._batch_after('1:1:', '1:1:', '0', 0, 1)",
    ] {
        assert_eq!(
            sqlstate(&mut tenant, &format!("SELECT {internal}")),
            "42501",
            "{internal}"
        );
    }
    assert_eq!(
        c.query_one("SELECT read_by FROM outbox.consumers WHERE name = 'h'", &[])
            .unwrap()
            .get::<_, String>(0),
        "horizon"
    );
}

#[test]
fn read_flushes_the_ticks_whose_batches_it_hands_out() {
    let db = test_db("ticks_pull_flush");
    let mut c = db.connect();
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; \
         SELECT outbox.create_consumer('p', 'now'); \
         SELECT outbox.alter_consumer('p', '{\"read_by\": \"ticks\"}'); \
         SELECT outbox.raise('t', '{}')",
    )
    .unwrap();
    // A tick committed as the workers commit theirs: without waiting for the flush, which the
    // WAL writer would do within wal_writer_delay (10 s here). Something else may flush first
    // (a commit elsewhere in the cluster): then that try proves nothing, and it goes again.
    let _delay = Setting::new(&db, "wal_writer_delay", "10s", "200ms");
    let mut proven = 0;
    for i in 0..10 {
        if i > 0 {
            c.batch_execute("SELECT outbox.raise('t', '{}')").unwrap();
        }
        c.batch_execute("BEGIN; SET LOCAL synchronous_commit = off; SELECT outbox._tick(); COMMIT")
            .unwrap();
        let tick_lsn: String = c
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .unwrap()
            .get(0);
        let flushed = |c: &mut Client| -> bool {
            c.query_one(
                "SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn",
                &[&tick_lsn],
            )
            .unwrap()
            .get(0)
        };
        let flushed_before = flushed(&mut c);
        let events: i64 = c
            .query_one("SELECT count(*) FROM outbox.read('p', 100)", &[])
            .unwrap()
            .get(0);
        assert_eq!(events, i + 1);
        assert!(
            flushed(&mut c),
            "the tick at {tick_lsn} is on disk once read() handed its batch out"
        );
        proven += usize::from(!flushed_before);
    }
    assert!(
        proven > 0,
        "every tick was flushed before read() was called"
    );
}

#[test]
fn subscriptions_that_read_by_ticks_queue_every_event_once_while_a_long_transaction_is_open() {
    let db = worker_db("ticks_subs");
    let mut c = db.connect();
    // Two subscriptions by ticks (one filtered, one turned to ticks once events wait), one by the
    // read horizon; jobs for external workers, in the order fan-out wrote them (job ids).
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; \
         SELECT outbox.subscribe('all', '{short,long}', queue => 'q_all', start_at => 'now'); \
         SELECT outbox.alter_subscription('all', '{\"read_by\": \"ticks\"}'); \
         SELECT outbox.subscribe('even', '{short,long}', queue => 'q_even', start_at => 'now', \
                                 filter => 'int(payload.w) % 2 == 0'); \
         SELECT outbox.subscribe('old', '{short,long}', queue => 'q_old', start_at => 'now')",
    )
    .unwrap();
    const LONG: i32 = 99;
    let mut long = db.connect();
    long.batch_execute("BEGIN; SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 0}')")
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (writers, committed, _) = spawn_writers(&db, 8, 0x2F1A_0C3B_55D7_91E3, 4000, 5, &stop);
    std::thread::sleep(Duration::from_millis(1500));
    c.batch_execute("SELECT outbox.alter_subscription('even', '{\"read_by\": \"ticks\"}')")
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    let committed = committed.lock().unwrap().clone();
    let short = |even: bool| -> i64 {
        committed
            .iter()
            .filter(|((w, _), _)| !even || w % 2 == 0)
            .map(|(_, (_, _, e))| *e as i64)
            .sum()
    };
    let jobs = |c: &mut Client, sub: &str| -> Vec<(String, i32, i32, i32)> {
        c.query(
            "SELECT payload->>'position', (payload->'payload'->>'w')::int, \
                    (payload->'payload'->>'n')::int, (payload->'payload'->>'j')::int \
               FROM outbox.jobs WHERE subscription = $1 ORDER BY id",
            &[&sub],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect()
    };
    // Every short event is queued while the long transaction is still open.
    for (sub, even) in [("all", false), ("even", true)] {
        pg_outbox_tests::eventually(
            &format!("{sub}: the short events queued while the long one is open"),
            Duration::from_secs(30),
            || (jobs(&mut c, sub).len() as i64 == short(even)).then_some(()),
        );
    }
    let status = |c: &mut Client, name: &str| -> (String, i64) {
        c.query_one(
            "SELECT state, events_behind FROM outbox.status() WHERE name = $1",
            &[&name],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap()
    };
    assert_eq!(status(&mut c, "all"), ("idle".to_string(), 0));
    assert_eq!(status(&mut c, "old").0, "held by horizon");
    long.batch_execute("SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 1}'); COMMIT")
        .unwrap();
    for (sub, total) in [
        ("all", short(false) + 2),
        ("even", short(true)),
        ("old", short(false) + 2),
    ] {
        pg_outbox_tests::eventually(
            &format!("{sub}: every event queued"),
            Duration::from_secs(30),
            || (jobs(&mut c, sub).len() as i64 == total).then_some(()),
        );
    }
    // Once each, nothing rolled back, each transaction's events together and in raise order, and
    // none committed before another began queued after it (by the read horizon too: by txid);
    // by ticks, the long one last.
    for sub in ["all", "even", "old"] {
        let queued = jobs(&mut c, sub);
        let order: Vec<(i32, i32, i32)> = queued.iter().map(|&(_, w, k, j)| (w, k, j)).collect();
        assert!(
            sub != "even" || order.iter().all(|(w, ..)| *w == LONG || w % 2 == 0),
            "{sub}: an event its filter turns down"
        );
        let first_of = check_order(sub, &order, &committed, LONG);
        if sub == "all" {
            assert_eq!(
                first_of[&(LONG, 0)],
                queued.len() - 2,
                "{sub}: the long one last"
            );
        }
    }
    let read_by: Vec<(String, String, bool)> = c
        .query(
            "SELECT name, read_by, tick IS NOT NULL FROM outbox.consumers ORDER BY name",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        read_by,
        [
            ("all".to_string(), "ticks".to_string(), true),
            ("even".to_string(), "ticks".to_string(), true),
            ("old".to_string(), "horizon".to_string(), false)
        ]
    );
    // Refusals: back to the horizon, a sink's option, not a subscription.
    for (sql, state) in [
        (
            "SELECT outbox.alter_subscription('all', '{\"read_by\": \"horizon\"}')",
            "0A000",
        ),
        (
            "SELECT outbox.alter_subscription('old', '{\"synchronous_commit\": false}')",
            "22023",
        ),
        ("SELECT outbox.alter_subscription('old', '{}')", "22023"),
        (
            "SELECT outbox.alter_subscription('nope', '{\"read_by\": \"ticks\"}')",
            "42704",
        ),
    ] {
        assert_eq!(sqlstate(&mut c, sql), state, "{sql}");
    }
}

#[test]
fn a_subscription_by_ticks_goes_through_a_backlog_of_many_batches_at_once_beside_others() {
    let db = worker_db("ticks_subs_backlog");
    let mut c = db.connect();
    // No poll to catch up by: commits wake the workers, and they go on while there is work.
    let _poll = Setting::new(&db, "pg_outbox.poll_interval", "30s", "1s");
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; \
         SELECT outbox.subscribe('x', NULL, queue => 'qx', start_at => 'now'); \
         SELECT outbox.subscribe('y', NULL, queue => 'qy', start_at => 'now'); \
         SELECT outbox.subscribe('h', NULL, queue => 'qh', start_at => 'now'); \
         SELECT outbox.alter_subscription('x', '{\"read_by\": \"ticks\"}'); \
         SELECT outbox.alter_subscription('y', '{\"read_by\": \"ticks\"}')",
    )
    .unwrap();
    let queued = |c: &mut Client, sub: &str| -> Vec<String> {
        c.query(
            "SELECT payload->>'topic' FROM outbox.jobs WHERE subscription = $1 ORDER BY id",
            &[&sub],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
    };
    raise_one(&mut c, "t.0");
    pg_outbox_tests::eventually(
        "the first event, everywhere",
        Duration::from_secs(10),
        || {
            ["x", "y", "h"]
                .iter()
                .all(|s| queued(&mut c, s).len() == 1)
                .then_some(())
        },
    );
    // x waits paused while 20 transactions commit, a tick each; y and h go on.
    c.batch_execute("SELECT outbox.pause_subscription('x')")
        .unwrap();
    let mut want = vec!["t.0".to_string()];
    for i in 1..=20 {
        let topic = format!("t.{i}");
        raise_one(&mut c, &topic);
        c.batch_execute("SELECT outbox._tick()").unwrap();
        want.push(topic);
    }
    pg_outbox_tests::eventually("y and h up to date", Duration::from_secs(10), || {
        ["y", "h"]
            .iter()
            .all(|s| queued(&mut c, s).len() == want.len())
            .then_some(())
    });
    c.batch_execute("SELECT outbox.resume_subscription('x')")
        .unwrap();
    let all = pg_outbox_tests::eventually(
        "x's backlog of 20 batches queued",
        Duration::from_secs(10),
        || {
            let got = queued(&mut c, "x");
            (got.len() >= want.len()).then_some(got)
        },
    );
    assert_eq!(all, want, "once each, in the order they became visible");
    for sub in ["y", "h"] {
        assert_eq!(queued(&mut c, sub), want, "{sub}");
    }
    // Then all three read on, x and y from one batch, in one window.
    raise_one(&mut c, "t.21");
    want.push("t.21".into());
    pg_outbox_tests::eventually("one more, everywhere", Duration::from_secs(10), || {
        ["x", "y", "h"]
            .iter()
            .all(|s| queued(&mut c, s) == want)
            .then_some(())
    });
    let same: bool = c
        .query_one(
            "SELECT count(DISTINCT (tick, since::text, upto::text, txid, seq)) = 1 \
               FROM outbox.consumers WHERE name IN ('x', 'y')",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(same, "x and y end at one cursor, in one batch");
}

/// HTTP sinks may reach the loopback receiver while it lives (back to the defaults after).
fn loopback(db: &pg_outbox_tests::TestDb) -> [Setting<'_>; 2] {
    [
        Setting::new(db, "pg_outbox.http_allow_plain", "on", "off"),
        Setting::new(db, "pg_outbox.http_allow_private", "on", "off"),
    ]
}

/// The events of the requests answered 2xx, in the order they arrived: (position, payload).
fn posted(rx: &pg_outbox_tests::http_server::Receiver) -> Vec<(String, serde_json::Value)> {
    rx.received()
        .into_iter()
        .filter(|q| (200..300).contains(&q.status))
        .flat_map(|q| serde_json::from_slice::<Vec<serde_json::Value>>(&q.body).unwrap())
        .map(|e| {
            (
                e["position"].as_str().unwrap().to_string(),
                e["data"].clone(),
            )
        })
        .collect()
}

/// HTTP sink `hook` posting to `rx` in windows of `batch`, reading by ticks from now on, in a log
/// raised in before (a log's first tick waits for its first raise to commit).
fn hook_by_ticks(c: &mut Client, rx: &pg_outbox_tests::http_server::Receiver, batch: i32) {
    c.execute(
        "SELECT outbox.create_http_sink('hook', $1, batch_size => $2, start_at => 'now')",
        &[&rx.url("/in"), &batch],
    )
    .unwrap();
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; \
         SELECT outbox.alter_sink('hook', '{\"read_by\": \"ticks\"}')",
    )
    .unwrap();
}

#[test]
fn an_http_sink_that_reads_by_ticks_gets_every_event_while_a_long_transaction_is_open() {
    let db = worker_db("ticks_http");
    let _loopback = loopback(&db);
    // Every seventh request fails with 503 first: retried, halved, and sent again.
    let rx = pg_outbox_tests::http_server::Receiver::start(|_, n| {
        if n % 7 == 3 {
            (503, vec![])
        } else {
            (200, vec![])
        }
    });
    let mut c = db.connect();
    hook_by_ticks(&mut c, &rx, 16);
    const LONG: i32 = 99;
    let mut long = db.connect();
    long.batch_execute("BEGIN; SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 0}')")
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (writers, committed, _) = spawn_writers(&db, 8, 0x7A3D_19C5_E2B4_6F01, 4000, 5, &stop);
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    let committed = committed.lock().unwrap().clone();
    let short: usize = committed.values().map(|(_, _, e)| *e as usize).sum();
    pg_outbox_tests::eventually(
        "every short event posted while the long transaction is open",
        Duration::from_secs(60),
        || (posted(&rx).len() >= short).then_some(()),
    );
    assert_eq!(
        c.query_one("SELECT state FROM outbox.status() WHERE name = 'hook'", &[])
            .unwrap()
            .get::<_, String>(0),
        "idle"
    );
    long.batch_execute("SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 1}'); COMMIT")
        .unwrap();
    let all = pg_outbox_tests::eventually("the long one posted", Duration::from_secs(30), || {
        let all = posted(&rx);
        (all.len() >= short + 2).then_some(all)
    });
    assert_eq!(all.len(), short + 2, "every committed event once");
    let order: Vec<(i32, i32, i32)> = all
        .iter()
        .map(|(_, d)| {
            let n = |f: &str| d[f].as_i64().unwrap() as i32;
            (n("w"), n("n"), n("j"))
        })
        .collect();
    let first_of = check_order("hook", &order, &committed, LONG);
    assert_eq!(first_of[&(LONG, 0)], all.len() - 2, "the long one last");
    assert!(
        rx.received().iter().any(|q| q.status == 503),
        "some requests failed and were sent again"
    );
}

#[test]
fn an_http_sink_by_ticks_dead_letters_a_poison_event_at_the_end_of_a_batch() {
    let db = worker_db("ticks_http_poison");
    let _loopback = loopback(&db);
    let rx = pg_outbox_tests::http_server::Receiver::start(|q, _| {
        if String::from_utf8_lossy(&q.body).contains("\"poison\"") {
            (422, vec![])
        } else {
            (200, vec![])
        }
    });
    let mut c = db.connect();
    hook_by_ticks(&mut c, &rx, 8);
    raise_one(&mut c, "t.first");
    pg_outbox_tests::eventually("the first event", Duration::from_secs(10), || {
        (posted(&rx).len() == 1).then_some(())
    });
    // The poison ends its batch; its neighbour is in the next one.
    c.batch_execute("SELECT outbox.pause_sink('hook')").unwrap();
    c.batch_execute(
        "BEGIN; SELECT outbox.raise('t.a', '{}'); SELECT outbox.raise('t.poison', '{\"poison\": true}'); COMMIT",
    )
    .unwrap();
    c.batch_execute("SELECT outbox._tick()").unwrap();
    raise_one(&mut c, "t.b");
    c.batch_execute("SELECT outbox._tick()").unwrap();
    c.batch_execute("SELECT outbox.resume_sink('hook')")
        .unwrap();
    let dead: String =
        pg_outbox_tests::eventually("the dead letter", Duration::from_secs(60), || {
            c.query_opt(
                "SELECT (event).topic FROM outbox.dead_letters WHERE sink = 'hook'",
                &[],
            )
            .unwrap()
            .map(|r| r.get(0))
        });
    assert_eq!(dead, "t.poison");
    raise_one(&mut c, "t.c");
    let topics = pg_outbox_tests::eventually("the rest", Duration::from_secs(30), || {
        let got: Vec<String> = rx
            .received()
            .into_iter()
            .filter(|q| (200..300).contains(&q.status))
            .flat_map(|q| serde_json::from_slice::<Vec<serde_json::Value>>(&q.body).unwrap())
            .map(|e| e["type"].as_str().unwrap_or_default().to_string())
            .collect();
        (got.len() >= 4).then_some(got)
    });
    assert_eq!(
        topics,
        ["t.first", "t.a", "t.b", "t.c"],
        "the rest once each, in order"
    );
}

#[test]
fn a_consumer_turned_to_ticks_in_a_transaction_that_raised_reads_those_events_once_after_it_commits(
) {
    let db = test_db("ticks_pull_own");
    let mut c = db.connect();
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; SELECT outbox.create_consumer('q', 'now')",
    )
    .unwrap();
    let mut own = db.connect();
    own.batch_execute("BEGIN; SELECT outbox.raise('own', '{}')")
        .unwrap();
    // A transaction that began after it commits first: the own one is below the snapshot's xmax.
    c.batch_execute("SELECT outbox.raise('other', '{}')")
        .unwrap();
    own.batch_execute("SELECT outbox.alter_consumer('q', '{\"read_by\": \"ticks\"}')")
        .unwrap();
    let topics = |c: &mut Client| -> Vec<String> {
        c.query("SELECT topic FROM outbox.read('q', 100)", &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    assert_eq!(
        topics(&mut own),
        ["other"],
        "its own events are not read before it commits"
    );
    // A tick while it is open sees it running; the next, after its commit, sees it ended.
    c.batch_execute("SELECT outbox.raise('other.2', '{}')")
        .unwrap();
    c.batch_execute("SELECT outbox._tick()").unwrap();
    own.batch_execute("COMMIT").unwrap();
    c.batch_execute("SELECT outbox._tick()").unwrap();
    assert_eq!(topics(&mut c), ["other", "other.2", "own"], "each once");
}

#[test]
fn pg_outbox_read_by_chooses_how_the_readers_created_from_then_on_read() {
    let db = test_db("ticks_default");
    let mut c = db.connect();
    c.batch_execute(
        "CREATE FUNCTION keep(events outbox.event[]) RETURNS void LANGUAGE sql AS 'SELECT'; \
         CREATE FUNCTION one(e outbox.event) RETURNS void LANGUAGE sql AS 'SELECT'; \
         SET pg_outbox.read_by = 'ticks'; \
         SELECT outbox.create_consumer('p'); \
         SELECT outbox.create_sink('s', 'keep(outbox.event[])'); \
         SELECT outbox.subscribe('u', handler => 'one(outbox.event)'); \
         RESET pg_outbox.read_by; \
         SELECT outbox.create_consumer('h')",
    )
    .unwrap();
    let modes: Vec<(String, String, bool)> = c
        .query(
            "SELECT name, read_by, tick IS NOT NULL FROM outbox.consumers ORDER BY name",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let want = |n: &str, m: &str, batch: bool| (n.to_string(), m.to_string(), batch);
    assert_eq!(
        modes,
        [
            want("h", "horizon", false),
            // A pull consumer is in a batch at once; a sink or subscription from its first pass.
            want("p", "ticks", true),
            want("s", "ticks", false),
            want("u", "ticks", false),
        ]
    );
    assert_eq!(
        c.query_one("SHOW pg_outbox.read_by", &[])
            .unwrap()
            .get::<_, String>(0),
        "horizon"
    );
    assert_eq!(sqlstate(&mut c, "SET pg_outbox.read_by = 'xmin'"), "22023");
    // A superuser's choice: a role could otherwise make the workers tick every round.
    c.batch_execute(&format!(
        "DO $$ BEGIN CREATE ROLE ticks_chooser LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
         GRANT CONNECT ON DATABASE \"{}\" TO ticks_chooser",
        db.name
    ))
    .unwrap();
    let mut tenant = db.connect_as("ticks_chooser");
    assert_eq!(
        sqlstate(&mut tenant, "SET pg_outbox.read_by = 'ticks'"),
        "42501"
    );
    assert_eq!(
        sqlstate(
            &mut c,
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SET LOCAL pg_outbox.read_by = 'ticks'; \
             SELECT outbox.create_consumer('rr')"
        ),
        "25001"
    );
    c.batch_execute("ROLLBACK").unwrap();
}

#[test]
fn every_kind_of_reader_by_ticks_gets_every_event_in_order_while_a_30_s_transaction_raises_too() {
    let seconds: u64 = std::env::var("TICKS_LONG_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let db = worker_db("ticks_all");
    let _loopback = loopback(&db);
    let rx = pg_outbox_tests::http_server::Receiver::start(|_, _| (200, vec![]));
    let mut c = db.connect();
    // Every reader created by ticks (pg_outbox.read_by), but one sink by the horizon beside them.
    c.batch_execute(
        "UPDATE outbox.lineage SET raised = true; \
         CREATE TABLE got (n bigserial, w int, k int, j int); \
         CREATE FUNCTION keep(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ \
           INSERT INTO got (w, k, j) \
           SELECT (e.payload->>'w')::int, (e.payload->>'n')::int, (e.payload->>'j')::int \
             FROM unnest(events) WITH ORDINALITY AS e ORDER BY e.ordinality $$; \
         CREATE FUNCTION ignore(events outbox.event[]) RETURNS void LANGUAGE sql AS 'SELECT'; \
         SELECT outbox.create_sink('old', 'ignore(outbox.event[])', start_at => 'now'); \
         SET pg_outbox.read_by = 'ticks'; \
         SELECT outbox.create_sink('sql', 'keep(outbox.event[])', batch_size => 16, start_at => 'now'); \
         SELECT outbox.create_consumer('pull', 'now'); \
         SELECT outbox.subscribe('sub', '{short,long}', queue => 'q', start_at => 'now')",
    )
    .unwrap();
    c.execute(
        "SELECT outbox.create_http_sink('http', $1, batch_size => 16, start_at => 'now')",
        &[&rx.url("/in")],
    )
    .unwrap();
    c.batch_execute("RESET pg_outbox.read_by").unwrap();
    // The long transaction raises at its start, then every few seconds, and commits at the end.
    const LONG: i32 = 99;
    let mut long = db.connect();
    long.batch_execute("BEGIN; SELECT outbox.raise('long', '{\"w\": 99, \"n\": 0, \"j\": 0}')")
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (writers, committed, _) = spawn_writers(&db, 8, 0x1C69_B3F7_4AD2_0E55, 20_000, 4, &stop);
    let (written, reader) = pull_while_writing(&db, "pull", 0xA076_1D64_78BD_642F, &committed);
    let mut raised_long = 1;
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_secs(5).min(Duration::from_secs(seconds)));
        long.execute(
            "SELECT outbox.raise('long', jsonb_build_object('w', 99, 'n', 0, 'j', $1::int))",
            &[&raised_long],
        )
        .unwrap();
        raised_long += 1;
    }
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    written.store(true, Ordering::SeqCst);
    let mut pulled: Vec<(i32, i32, i32)> = reader
        .join()
        .unwrap()
        .into_iter()
        .map(|(_, w, k, j)| (w, k, j))
        .collect();
    let committed = committed.lock().unwrap().clone();
    let short: usize = committed.values().map(|(_, _, e)| *e as usize).sum();
    let sql = |c: &mut Client| -> Vec<(i32, i32, i32)> {
        c.query("SELECT w, k, j FROM got ORDER BY n", &[])
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    };
    let jobs = |c: &mut Client| -> Vec<(i32, i32, i32)> {
        c.query(
            "SELECT (payload->'payload'->>'w')::int, (payload->'payload'->>'n')::int, \
                    (payload->'payload'->>'j')::int FROM outbox.jobs WHERE subscription = 'sub' ORDER BY id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
    };
    let http = |rx: &pg_outbox_tests::http_server::Receiver| -> Vec<(i32, i32, i32)> {
        posted(rx)
            .iter()
            .map(|(_, d)| {
                let n = |f: &str| d[f].as_i64().unwrap() as i32;
                (n("w"), n("n"), n("j"))
            })
            .collect()
    };
    // While the long transaction is still open, every reader by ticks has every short event.
    assert_eq!(
        pulled.len(),
        short,
        "pull: every short event while the long one is open"
    );
    pg_outbox_tests::eventually(
        "every short event everywhere while the long transaction is open",
        Duration::from_secs(60),
        || {
            (sql(&mut c).len() == short && jobs(&mut c).len() == short && http(&rx).len() == short)
                .then_some(())
        },
    );
    assert_eq!(
        c.query_one("SELECT state FROM outbox.status() WHERE name = 'old'", &[])
            .unwrap()
            .get::<_, String>(0),
        "held by horizon"
    );
    long.batch_execute("COMMIT").unwrap();
    let total = short + raised_long as usize;
    let mut puller = db.connect();
    pulled.extend(
        pull_until(&mut puller, "pull", 3, |consumed| {
            consumed.len() == raised_long as usize
        })
        .into_iter()
        .map(|(_, w, k, j)| (w, k, j)),
    );
    pg_outbox_tests::eventually(
        "the long transaction's events everywhere",
        Duration::from_secs(60),
        || {
            (sql(&mut c).len() == total && jobs(&mut c).len() == total && http(&rx).len() == total)
                .then_some(())
        },
    );
    for (what, got) in [
        ("sql", sql(&mut c)),
        ("pull", pulled),
        ("sub", jobs(&mut c)),
        ("http", http(&rx)),
    ] {
        assert_eq!(got.len(), total, "{what}: every committed event once");
        let first_of = check_order(what, &got, &committed, LONG);
        // The long transaction, visible last, comes last, whole.
        assert_eq!(first_of[&(LONG, 0)], total - raised_long as usize, "{what}");
    }
}
