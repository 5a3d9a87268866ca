//! Chaos soak: writers raise events continuously, with random rollbacks and random transaction
//! lengths, into three SQL sinks (one reading by ticks), an HTTP sink reading by ticks, a pull
//! consumer reading by ticks, a subscription by ticks whose SQL handler runs jobs and a
//! subscription queueing jobs for an external worker, while a driver kills worker processes with
//! SIGKILL (each kill makes the postmaster reset the whole cluster), restarts the server with
//! `pg_ctl restart -m immediate`, makes a sink and the HTTP endpoint fail for a while, and one
//! event is poison for one sink. The log is pruned every second with no retention. At the end a
//! verifier checks, from the ledgers the sinks and handlers wrote:
//!
//! - every committed event reached each SQL sink exactly once, in log order (the sink that reads
//!   by ticks: each transaction's events together and in the order raised);
//! - the pull consumer by ticks recorded every committed event exactly once, each transaction's
//!   events together and in the order raised (it records a page and advances past it in one
//!   transaction, and records a page read before the server went down once it is back);
//! - the HTTP receiver got every committed event at least once;
//! - every matching job ran exactly once in the database (SQL handler and external worker);
//! - no rolled-back event went anywhere;
//! - the poison event, and only it, is dead-lettered, for the one sink it poisons;
//! - the log was pruned, and only behind every cursor (nothing is missing anywhere).
//!
//! CHAOS_SECONDS sets the duration (default 20, the short version the test command runs). The
//! long version: `CHAOS_SECONDS=600 cargo test -p pg_outbox_tests --test chaos -- --nocapture`
//! (it asserts at least 20 kills and 3 restarts).

use pg_outbox_tests::http_server::Receiver;
use pg_outbox_tests::{worker_db, Cluster};
use postgres::{Client, NoTls};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// xorshift64*: enough randomness for a soak, with the seed printed so a run can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

fn try_connect(cluster: &Cluster, db: &str) -> Option<Client> {
    postgres::Config::new()
        .host_path(cluster.socket_dir())
        .port(cluster.port())
        .user("postgres")
        .dbname(db)
        .connect_timeout(Duration::from_secs(5))
        .connect(NoTls)
        .ok()
}

/// Connects, waiting out a server that is restarting (at most two minutes).
fn connect(cluster: &Cluster, db: &str) -> Client {
    let start = Instant::now();
    loop {
        if let Some(c) = try_connect(cluster, db) {
            return c;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the server did not come back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

const SETUP: &str = "
    CREATE TABLE ledger (n bigserial PRIMARY KEY, sink text NOT NULL, k int8 NOT NULL,
                         txid xid8 NOT NULL, seq int8 NOT NULL);
    CREATE TABLE control (sink text PRIMARY KEY, fail_until timestamptz NOT NULL DEFAULT '-infinity');
    INSERT INTO control VALUES ('b');
    -- Sink a: poisoned by the event marked so, and by nothing else.
    CREATE FUNCTION sink_a(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
      IF EXISTS (SELECT 1 FROM unnest(events) e WHERE e.payload ? 'poison') THEN
        RAISE EXCEPTION 'poison';
      END IF;
      INSERT INTO ledger (sink, k, txid, seq)
        SELECT 'a', (e.payload->>'k')::int8, split_part(e.position, ':', 1)::xid8, split_part(e.position, ':', 2)::int8
          FROM unnest(events) e;
    END $$;
    -- Sink t: as sink a, reading by ticks.
    CREATE FUNCTION sink_t(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
      IF EXISTS (SELECT 1 FROM unnest(events) e WHERE e.payload ? 'poison') THEN
        RAISE EXCEPTION 'poison';
      END IF;
      INSERT INTO ledger (sink, k, txid, seq)
        SELECT 't', (e.payload->>'k')::int8, split_part(e.position, ':', 1)::xid8, split_part(e.position, ':', 2)::int8
          FROM unnest(events) e;
    END $$;
    -- Sink b: down for a while whenever the driver says so.
    CREATE FUNCTION sink_b(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
      IF (SELECT fail_until FROM control WHERE sink = 'b') > clock_timestamp() THEN
        RAISE EXCEPTION 'sink b is down for a while';
      END IF;
      INSERT INTO ledger (sink, k, txid, seq)
        SELECT 'b', (e.payload->>'k')::int8, split_part(e.position, ':', 1)::xid8, split_part(e.position, ':', 2)::int8
          FROM unnest(events) e;
    END $$;
    CREATE TABLE effects (k int8 NOT NULL);
    CREATE FUNCTION apply(e outbox.event) RETURNS void LANGUAGE sql AS
      'INSERT INTO effects VALUES ((e.payload->>''k'')::int8)';
    CREATE TABLE ext_done (k int8 NOT NULL);
    SELECT outbox.create_sink('a', 'sink_a(outbox.event[])', batch_size => 64);
    SELECT outbox.create_sink('b', 'sink_b(outbox.event[])', batch_size => 64);
    SELECT outbox.create_sink('t', 'sink_t(outbox.event[])', batch_size => 64);
    SELECT outbox.alter_sink('t', '{\"read_by\": \"ticks\"}');
    SELECT outbox.create_consumer('p');
    SELECT outbox.alter_consumer('p', '{\"read_by\": \"ticks\"}');
    SELECT outbox.subscribe('apply', '{chaos.*}', handler => 'apply(outbox.event)', filter => 'payload.k % 3 == 0');
    SELECT outbox.alter_subscription('apply', '{\"read_by\": \"ticks\"}');
    SELECT outbox.subscribe('ext', '{chaos.*}', queue => 'ext', filter => 'payload.k % 5 == 0');";

/// What the writers know of their transactions.
#[derive(Default)]
struct Outcomes {
    committed: HashSet<i64>,
    rolled_back: HashSet<i64>,
    /// The connection died during COMMIT: committed or not, nobody can say.
    uncertain: HashSet<i64>,
}

/// One transaction of a writer: raises `keys`, maybe waits, then commits or rolls back, and
/// records what became of them. False when the connection is lost.
fn one_transaction(c: &mut Client, rng: &mut Rng, keys: &[i64], out: &mut Outcomes) -> bool {
    let Ok(mut tx) = c.transaction() else {
        out.rolled_back.extend(keys);
        return false;
    };
    for k in keys {
        let topic = if k % 2 == 0 { "chaos.a" } else { "chaos.b" };
        if tx
            .execute(
                "SELECT outbox.raise($1, jsonb_build_object('k', $2::int8))",
                &[&topic, k],
            )
            .is_err()
        {
            // It failed before COMMIT was sent: nothing of it committed.
            out.rolled_back.extend(keys);
            return false;
        }
    }
    if rng.chance(0.3) {
        std::thread::sleep(Duration::from_millis(rng.below(30)));
    }
    if rng.chance(0.2) {
        out.rolled_back.extend(keys);
        return tx.rollback().is_ok();
    }
    match tx.commit() {
        Ok(()) => {
            out.committed.extend(keys);
            true
        }
        Err(e) if e.as_db_error().is_some() => {
            out.rolled_back.extend(keys);
            true
        }
        Err(_) => {
            out.uncertain.extend(keys);
            false
        }
    }
}

fn writer(
    cluster: &'static Cluster,
    db: String,
    id: i64,
    seed: u64,
    stop: Arc<AtomicBool>,
) -> Outcomes {
    let mut rng = Rng(seed);
    let mut out = Outcomes::default();
    let mut next = id * 1_000_000_000;
    let mut conn: Option<Client> = None;
    while !stop.load(Ordering::Relaxed) {
        let keys: Vec<i64> = (0..1 + rng.below(4))
            .map(|_| {
                next += 1;
                next
            })
            .collect();
        let c = conn.get_or_insert_with(|| connect(cluster, &db));
        if !one_transaction(c, &mut rng, &keys, &mut out) {
            conn = None;
        }
    }
    out
}

/// Claims jobs of queue 'ext' under a 2 s lease and, for each, records it and completes it in one
/// transaction (rolled back if the lease was lost meanwhile): exactly once in the database.
fn external_worker(cluster: &'static Cluster, db: String, stop: Arc<AtomicBool>) -> usize {
    let mut done = 0;
    let mut conn: Option<Client> = None;
    while !stop.load(Ordering::Relaxed) {
        let c = conn.get_or_insert_with(|| connect(cluster, &db));
        let jobs: Vec<(i64, i64)> = match c.query(
            "SELECT id, (payload->'payload'->>'k')::int8 FROM outbox.claim('ext', 10, '2 seconds')",
            &[],
        ) {
            Ok(rows) => rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
            Err(_) => {
                conn = None;
                continue;
            }
        };
        if jobs.is_empty() {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        for (id, k) in jobs {
            let result = (|| -> Result<bool, postgres::Error> {
                let mut tx = c.transaction()?;
                tx.execute("INSERT INTO ext_done VALUES ($1)", &[&k])?;
                let completed: bool = tx.query_one("SELECT outbox.complete($1)", &[&id])?.get(0);
                if completed {
                    tx.commit()?;
                } else {
                    tx.rollback()?;
                }
                Ok(completed)
            })();
            match result {
                Ok(true) => done += 1,
                Ok(false) => {}
                Err(_) => {
                    conn = None;
                    break;
                }
            }
        }
    }
    done
}

/// Reads pull consumer 'p' (by ticks) page by page and, for each page, records its events in the
/// ledger and advances past them in one transaction, rolled back if the advance did not move (a
/// retry after a commit whose answer was lost): exactly once in the database. A page read before
/// the connection or the server went down is recorded and advanced once it is back, as a client
/// that had handled it would. Stops with no page pending once `stop` is set.
fn puller(cluster: &'static Cluster, db: String, seed: u64, stop: Arc<AtomicBool>) -> usize {
    let mut rng = Rng(seed);
    let mut pages = 0;
    let mut conn: Option<Client> = None;
    let mut page: Vec<(String, i64)> = Vec::new();
    loop {
        let c = conn.get_or_insert_with(|| connect(cluster, &db));
        if page.is_empty() {
            if stop.load(Ordering::Relaxed) {
                return pages;
            }
            let max = 1 + rng.below(100) as i32;
            match c.query(
                "SELECT position, (payload->>'k')::int8 FROM outbox.read('p', $1)",
                &[&max],
            ) {
                Ok(rows) => page = rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
                Err(_) => {
                    conn = None;
                    continue;
                }
            }
            if page.is_empty() {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        }
        let result = (|| -> Result<(), postgres::Error> {
            let mut tx = c.transaction()?;
            let (positions, ks): (Vec<String>, Vec<i64>) = page.iter().cloned().unzip();
            tx.execute(
                "INSERT INTO ledger (sink, k, txid, seq) \
                 SELECT 'p', u.k, split_part(u.pos, ':', 1)::xid8, split_part(u.pos, ':', 2)::int8 \
                   FROM unnest($1::text[], $2::int8[]) WITH ORDINALITY AS u(pos, k, i) ORDER BY u.i",
                &[&positions, &ks],
            )?;
            let moved: bool = tx
                .query_one(
                    "SELECT outbox.advance('p', $1)",
                    &[&positions[positions.len() - 1]],
                )?
                .get(0);
            if moved {
                tx.commit()
            } else {
                tx.rollback()
            }
        })();
        match result {
            Ok(()) => {
                pages += 1;
                page.clear();
            }
            Err(_) => conn = None,
        }
    }
}

/// Prints what the ledgers and the log say around events a sink is missing, and keeps the server
/// log in /tmp/pg_outbox-chaos-failure.log.
fn diagnose(c: &mut Client, cluster: &Cluster, sink: &str, missing: &[i64]) {
    let sample: Vec<i64> = missing.iter().copied().take(20).collect();
    for row in c
        .query(
            "SELECT l.sink, l.k, l.txid::text || ':' || l.seq, l.n FROM ledger l WHERE l.k = ANY ($1) ORDER BY l.sink, l.n",
            &[&sample],
        )
        .unwrap()
    {
        println!(
            "  ledger {}: k {} at {} (row {})",
            row.get::<_, String>(0),
            row.get::<_, i64>(1),
            row.get::<_, String>(2),
            row.get::<_, i64>(3)
        );
    }
    // The rows sink `sink` wrote around the first missing event's position (from sink a's ledger).
    for row in c
        .query(
            "WITH p AS (SELECT txid, seq FROM ledger WHERE k = $2 AND sink <> $1 LIMIT 1),
                  before AS (SELECT max(l.n) AS n FROM ledger l, p WHERE l.sink = $1 AND (l.txid, l.seq) < (p.txid, p.seq))
             SELECT l.k, l.txid::text || ':' || l.seq, l.n FROM ledger l, before
              WHERE l.sink = $1 AND l.n BETWEEN before.n - 3 AND before.n + 4
              ORDER BY l.n",
            &[&sink, &sample[0]],
        )
        .unwrap_or_default()
    {
        println!(
            "  near, in {sink}: k {} at {} (row {})",
            row.get::<_, i64>(0),
            row.get::<_, String>(1),
            row.get::<_, i64>(2)
        );
    }
    let _ = std::fs::write("/tmp/pg_outbox-chaos-failure.log", cluster.log());
    println!("  server log kept in /tmp/pg_outbox-chaos-failure.log");
}

fn keys(c: &mut Client, sql: &str) -> Vec<i64> {
    c.query(sql, &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[test]
fn nothing_is_lost_or_duplicated_when_everything_breaks() {
    let seconds: u64 = std::env::var("CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("chaos soak: {seconds} s, CHAOS_SEED={seed}");
    let db = worker_db("chaos");
    let cluster = db.cluster();
    cluster.set("pg_outbox.http_allow_plain", "on");
    cluster.set("pg_outbox.http_allow_private", "on");
    cluster.set("pg_outbox.retention", "0");
    cluster.set("pg_outbox.prune_interval", "1s");
    let http_failing = Arc::new(AtomicBool::new(false));
    let failing = http_failing.clone();
    let rx = Receiver::start(move |_, _| {
        if failing.load(Ordering::Relaxed) {
            (503, vec![])
        } else {
            (200, vec![])
        }
    });
    let mut c = db.connect();
    c.batch_execute(SETUP).unwrap();
    c.execute(
        "SELECT outbox.create_http_sink('h', $1, batch_size => 64)",
        &[&rx.url("/in")],
    )
    .unwrap();
    // The HTTP sink reads by ticks.
    c.batch_execute("SELECT outbox.alter_sink('h', '{\"read_by\": \"ticks\"}')")
        .unwrap();
    // The poison: one committed event that sink a can never take.
    const POISON: i64 = -1;
    c.batch_execute("SELECT outbox.raise('chaos.poison', '{\"k\": -1, \"poison\": true}')")
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (1..=3)
        .map(|id| {
            let (name, stop) = (db.name.clone(), stop.clone());
            std::thread::spawn(move || {
                writer(cluster, name, id, seed.wrapping_add(id as u64), stop)
            })
        })
        .collect();
    let stop_ext = Arc::new(AtomicBool::new(false));
    let ext = {
        let (name, stop) = (db.name.clone(), stop_ext.clone());
        std::thread::spawn(move || external_worker(cluster, name, stop))
    };
    let pull = {
        let (name, stop) = (db.name.clone(), stop_ext.clone());
        std::thread::spawn(move || puller(cluster, name, seed ^ 0x5851_F42D_4C95_7F2D, stop))
    };

    // The driver.
    let mut rng = Rng(seed ^ 0x9E37_79B9_7F4A_7C15);
    let (mut kills, mut restarts, mut outages) = (0, 0, 0);
    let start = Instant::now();
    let deadline = Duration::from_secs(seconds);
    let restart_every = deadline / 4;
    let mut next_restart = restart_every;
    while start.elapsed() < deadline {
        std::thread::sleep(Duration::from_millis(300 + rng.below(900)));
        if start.elapsed() >= next_restart {
            cluster.restart_immediate();
            restarts += 1;
            next_restart += restart_every;
            continue;
        }
        if rng.chance(0.6) {
            let pids = match try_connect(cluster, "postgres") {
                Some(mut admin) => admin
                    .query(
                        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker'",
                        &[],
                    )
                    .map(|rows| rows.iter().map(|r| r.get::<_, i32>(0)).collect::<Vec<_>>())
                    .unwrap_or_default(),
                None => Vec::new(),
            };
            if !pids.is_empty() {
                let pid = pids[rng.below(pids.len() as u64) as usize];
                // SAFETY: sends a signal to a process of the test's own cluster.
                if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                    kills += 1;
                }
            }
        } else {
            // Sink b and the HTTP endpoint fail for 0.8 s: shorter than the neighbour test
            // takes to begin, so an outage never dead-letters an event.
            if let Some(mut c) = try_connect(cluster, &db.name) {
                if c
                    .execute(
                        "UPDATE control SET fail_until = clock_timestamp() + interval '800 milliseconds' WHERE sink = 'b'",
                        &[],
                    )
                    .is_ok()
                {
                    outages += 1;
                }
            }
            http_failing.store(true, Ordering::Relaxed);
            let failing = http_failing.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(800));
                failing.store(false, Ordering::Relaxed);
            });
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut outcomes = Outcomes::default();
    for w in writers {
        let o = w.join().unwrap();
        outcomes.committed.extend(o.committed);
        outcomes.rolled_back.extend(o.rolled_back);
        outcomes.uncertain.extend(o.uncertain);
    }
    outcomes.committed.insert(POISON);
    println!(
        "{kills} worker kills, {restarts} immediate restarts, {outages} outages; {} committed, {} rolled back, {} uncertain",
        outcomes.committed.len(),
        outcomes.rolled_back.len(),
        outcomes.uncertain.len()
    );

    // Let everything catch up: every consumer at the head, the poison dead, no job left.
    let mut c = connect(cluster, &db.name);
    let settle = Instant::now();
    loop {
        let done: bool = c
            .query_one(
                "SELECT (SELECT count(*) FROM outbox.consumers c
                          WHERE c.tick IS NULL
                            AND (c.txid, c.seq) < (SELECT e.txid, e.seq FROM outbox.events e
                                                    ORDER BY e.txid DESC, e.seq DESC LIMIT 1)) = 0
                    AND (SELECT count(*) FROM outbox.status() s
                          WHERE s.name IN ('t', 'p', 'apply', 'h') AND s.events_behind > 0) = 0
                    AND (SELECT tick FROM outbox.consumers WHERE name = 't') IS NOT NULL
                    AND (SELECT count(*) FROM outbox.dead_letters) = 2
                    AND (SELECT count(*) FROM outbox.jobs) = 0",
                &[],
            )
            .map(|r| r.get(0))
            .unwrap_or(false);
        if done {
            break;
        }
        assert!(
            settle.elapsed() < Duration::from_secs(180),
            "did not settle: {}",
            c.query_one(
                "SELECT (SELECT string_agg(name || ' ' || state || ' ' || events_behind, ', ') FROM outbox.status())
                        || ' | dead ' || (SELECT count(*) FROM outbox.dead_letters) || ' | jobs ' || (SELECT count(*) FROM outbox.jobs)",
                &[]
            )
            .map(|r| r.get::<_, String>(0))
            .unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    stop_ext.store(true, Ordering::Relaxed);
    let ext_done = ext.join().unwrap();
    let pages = pull.join().unwrap();

    // The uncertain commits: whether each happened is what the log (sink b, which takes every
    // event) says; it must then be the same everywhere.
    let in_b: HashSet<i64> = keys(&mut c, "SELECT k FROM ledger WHERE sink = 'b'")
        .into_iter()
        .collect();
    let happened: HashSet<i64> = outcomes
        .committed
        .iter()
        .copied()
        .chain(
            outcomes
                .uncertain
                .iter()
                .copied()
                .filter(|k| in_b.contains(k)),
        )
        .collect();

    // SQL sinks and the pull consumer: exactly once, in log order (t and p: in the order their
    // batches came, each transaction's events together and in the order raised), nothing rolled
    // back.
    for sink in ["a", "b", "t", "p"] {
        let rows: Vec<(i64, String, i64)> = c
            .query(
                "SELECT k, txid::text, seq FROM ledger WHERE sink = $1 ORDER BY n",
                &[&sink],
            )
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let mut last: Option<(u64, i64)> = None;
        let mut done_with = HashSet::new();
        for (k, txid, seq) in &rows {
            let p = (txid.parse::<u64>().unwrap(), *seq);
            if sink == "t" || sink == "p" {
                if let Some(last) = last.filter(|l| l.0 != p.0) {
                    done_with.insert(last.0);
                }
                assert!(
                    !done_with.contains(&p.0) && last.is_none_or(|l| l.0 != p.0 || l.1 < p.1),
                    "{sink}: event {k} apart from its transaction, out of order or twice"
                );
            } else {
                assert!(
                    last < Some(p),
                    "sink {sink}: event {k} out of order or twice"
                );
            }
            last = Some(p);
        }
        let got: BTreeSet<i64> = rows.iter().map(|r| r.0).collect();
        assert_eq!(got.len(), rows.len(), "sink {sink}: duplicates");
        let mut want: BTreeSet<i64> = happened.iter().copied().collect();
        if sink == "a" || sink == "t" {
            want.remove(&POISON);
        }
        let missing: Vec<i64> = want.difference(&got).copied().collect();
        let extra: Vec<_> = got.difference(&want).take(5).collect();
        if !missing.is_empty() {
            diagnose(&mut c, cluster, sink, &missing);
        }
        assert!(
            missing.is_empty() && extra.is_empty(),
            "sink {sink}: missing {:?} ({} in all), not committed {extra:?}",
            &missing[..missing.len().min(5)],
            missing.len()
        );
    }

    // HTTP: at least once, nothing missing, nothing rolled back.
    let mut http: HashMap<i64, usize> = HashMap::new();
    for r in rx.received().iter().filter(|r| r.status == 200) {
        let batch: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        for e in batch.as_array().unwrap() {
            *http.entry(e["data"]["k"].as_i64().unwrap()).or_default() += 1;
        }
    }
    let missing: Vec<_> = happened
        .iter()
        .filter(|k| !http.contains_key(k))
        .take(5)
        .collect();
    assert!(missing.is_empty(), "HTTP: missing {missing:?}");
    let extra: Vec<_> = http
        .keys()
        .filter(|k| !happened.contains(k))
        .take(5)
        .collect();
    assert!(
        extra.is_empty(),
        "HTTP: events that never committed {extra:?}"
    );
    let resent = http.values().filter(|n| **n > 1).count();

    // Jobs: exactly once each, for exactly the matching events.
    for (table, modulo) in [("effects", 3), ("ext_done", 5)] {
        let ran = keys(&mut c, &format!("SELECT k FROM {table}"));
        let set: BTreeSet<i64> = ran.iter().copied().collect();
        assert_eq!(set.len(), ran.len(), "{table}: a job ran twice");
        let want: BTreeSet<i64> = happened
            .iter()
            .copied()
            .filter(|k| k % modulo == 0)
            .collect();
        let missing: Vec<_> = want.difference(&set).take(5).collect();
        let extra: Vec<_> = set.difference(&want).take(5).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "{table}: missing {missing:?}, not committed or not matching {extra:?}"
        );
    }

    // The poison, and only it, is dead: for sinks a and t.
    let dead: Vec<(String, i64)> = c
        .query(
            "SELECT sink, ((event).payload->>'k')::int8 FROM outbox.dead_letters ORDER BY sink",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(dead, [("a".to_string(), POISON), ("t".to_string(), POISON)]);

    // Pruned, behind every cursor (the ledgers above are complete).
    let left: i64 = c
        .query_one("SELECT count(*) FROM outbox.events", &[])
        .unwrap()
        .get(0);
    println!(
        "verified: {} events, {resent} sent to HTTP more than once, {ext_done} external jobs, {pages} pages pulled; {left} left in the log",
        happened.len()
    );
    assert!(
        (left as usize) < happened.len(),
        "the log was never pruned ({left} events left)"
    );
    assert!(restarts >= 3, "only {restarts} restarts");
    if seconds >= 600 {
        assert!(kills >= 20, "only {kills} kills");
    }
}
