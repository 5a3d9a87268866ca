//! Dispatch benchmark: how fast the background worker drains the log into a SQL sink, and how long
//! an event takes from its commit to the sink's handler. Starts its own throwaway cluster (fsync
//! on, shared_buffers 1GB, pg_outbox preloaded), prints a table, stops the cluster.
//!
//! Run through `bash benches/dispatch.sh` (builds and installs the release build first).
//! BENCH_EVENTS (default 200000) sets the drain size, BENCH_SECONDS (default 10) each latency run.

use pg_outbox_tests::{eventually, Cluster};
use postgres::Client;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const SETUP: &str = "
    CREATE EXTENSION pg_outbox;
    CREATE TABLE ledger (k bigint, pos text, at timestamptz DEFAULT clock_timestamp());
    -- The sink: insert every event it is handed into a table.
    CREATE FUNCTION record(events outbox.event[]) RETURNS void LANGUAGE sql AS $$
        INSERT INTO public.ledger (k, pos) SELECT (e.payload->>'k')::bigint, e.position FROM unnest(events) e
    $$;";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn micros_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// The last position in the log.
fn head(c: &mut Client) -> String {
    c.query_one(
        "SELECT txid::text || ':' || seq FROM outbox.events ORDER BY txid DESC, seq DESC LIMIT 1",
        &[],
    )
    .unwrap()
    .get(0)
}

/// Waits until the sink's cursor reaches `position`.
fn wait_for_cursor(c: &mut Client, sink: &str, position: &str, within: Duration) {
    let (txid, seq) = position.split_once(':').unwrap();
    let (txid, seq): (String, i64) = (txid.to_string(), seq.parse().unwrap());
    eventually(&format!("sink {sink} to reach {position}"), within, || {
        let done: bool = c
            .query_one(
                "SELECT (txid, seq) >= ($2::text::xid8, $3) FROM outbox.consumers WHERE name = $1",
                &[&sink, &txid, &seq],
            )
            .unwrap()
            .get(0);
        done.then_some(())
    });
}

fn new_sink(c: &mut Client, sink: &str, batch: i32) {
    c.batch_execute("TRUNCATE ledger").unwrap();
    c.execute(
        "SELECT outbox.create_sink($1, 'record(outbox.event[])', batch_size => $2, start_at => 'now')",
        &[&sink, &batch],
    )
    .unwrap();
}

/// Events per second a sink is drained at: `n` events wait (the sink paused), then it resumes.
fn drain(c: &mut Client, batch: i32, n: i64) -> f64 {
    let sink = format!("drain_{batch}");
    new_sink(c, &sink, batch);
    c.execute("SELECT outbox.pause_sink($1)", &[&sink]).unwrap();
    let mut raised = 0i64;
    while raised < n {
        let upto = (raised + 10_000).min(n);
        c.execute(
            "SELECT outbox.raise_many(ARRAY['bench.tick'], \
                    array_agg(jsonb_build_object('k', i, 'amount', 150.5, 'currency', 'EUR') ORDER BY i)) \
               FROM generate_series($1::int8 + 1, $2::int8) i",
            &[&raised, &upto],
        )
        .unwrap();
        raised = upto;
    }
    let last = head(c);
    c.batch_execute("CHECKPOINT").unwrap();
    let start = Instant::now();
    c.execute("SELECT outbox.resume_sink($1)", &[&sink])
        .unwrap();
    wait_for_cursor(c, &sink, &last, Duration::from_secs(600));
    let elapsed = start.elapsed().as_secs_f64();
    let delivered: i64 = c
        .query_one("SELECT count(*) FROM ledger", &[])
        .unwrap()
        .get(0);
    assert_eq!(delivered, n, "every event delivered once");
    c.execute("SELECT outbox.drop_sink($1)", &[&sink]).unwrap();
    n as f64 / elapsed
}

struct Latency {
    rate: f64,
    p50: f64,
    p95: f64,
    p99: f64,
    max: f64,
}

/// Commit-to-handler latency with `clients` connections raising one event per transaction for
/// `seconds`, each at `per_client_rate` events/s (None: as fast as it can).
fn latency(
    cluster: &Cluster,
    c: &mut Client,
    clients: usize,
    per_client_rate: Option<f64>,
    seconds: u64,
) -> Latency {
    let sink = "latency";
    new_sink(c, sink, 128);
    let started = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|t| {
            let mut client = cluster.connect("bench", "postgres");
            std::thread::spawn(move || {
                let stmt = client
                    .prepare(
                        "SELECT outbox.raise('bench.latency', jsonb_build_object('k', $1::int8))",
                    )
                    .unwrap();
                let mut commits = Vec::new();
                let mut i = 0i64;
                while started.elapsed() < Duration::from_secs(seconds) {
                    if let Some(rate) = per_client_rate {
                        let due = Duration::from_secs_f64(i as f64 / rate);
                        if let Some(wait) = due.checked_sub(started.elapsed()) {
                            std::thread::sleep(wait);
                        }
                    }
                    let k = t as i64 * 1_000_000_000 + i;
                    client.execute(&stmt, &[&k]).unwrap();
                    // The call returned: the transaction has committed.
                    commits.push((k, micros_now()));
                    i += 1;
                }
                commits
            })
        })
        .collect();
    let commits: Vec<(i64, i64)> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let elapsed = started.elapsed().as_secs_f64();
    let last = head(c);
    wait_for_cursor(c, sink, &last, Duration::from_secs(120));
    let delivered: std::collections::HashMap<i64, i64> = c
        .query(
            "SELECT k, (extract(epoch FROM at) * 1000000)::int8 FROM ledger",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(delivered.len(), commits.len(), "every event delivered once");
    let mut ms: Vec<f64> = commits
        .iter()
        .map(|(k, at)| (delivered[k] - at) as f64 / 1000.0)
        .collect();
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| ms[((ms.len() as f64 * p) as usize).min(ms.len() - 1)];
    c.execute("SELECT outbox.drop_sink($1)", &[&sink]).unwrap();
    Latency {
        rate: commits.len() as f64 / elapsed,
        p50: pct(0.50),
        p95: pct(0.95),
        p99: pct(0.99),
        max: *ms.last().unwrap(),
    }
}

fn main() {
    let events: i64 = env_or("BENCH_EVENTS", 200_000);
    let seconds: u64 = env_or("BENCH_SECONDS", 10);
    let cluster = Cluster::start_with(
        "pg_outbox_bench",
        &[
            "shared_buffers = '1GB'",
            "max_wal_size = '4GB'",
            "checkpoint_timeout = '30min'",
            "pg_outbox.database = 'bench'",
        ],
    );
    let result = std::panic::catch_unwind(|| {
        let mut admin = cluster.connect("postgres", "postgres");
        admin.batch_execute("CREATE DATABASE bench").unwrap();
        let mut c = cluster.connect("bench", "postgres");
        c.batch_execute(SETUP).unwrap();
        cluster.wait_for_workers("bench");
        let version: String = c.query_one("SHOW server_version", &[]).unwrap().get(0);
        let workers: String = c.query_one("SHOW pg_outbox.workers", &[]).unwrap().get(0);
        println!(
            "\npg_outbox dispatch benchmark: PostgreSQL {version}, fsync on, {workers} workers"
        );
        println!("sink: a SQL function inserting every event it is handed into a table\n");
        println!("{:<46} {:>12}", "drain of waiting events", "events/s");
        for batch in [128, 1000] {
            let rate = drain(&mut c, batch, events);
            println!(
                "{:<46} {:>12.0}",
                format!("{events} events, batch_size {batch}"),
                rate
            );
        }
        println!(
            "\n{:<46} {:>10} {:>8} {:>8} {:>8} {:>8}",
            "commit-to-handler latency (ms)", "events/s", "p50", "p95", "p99", "max"
        );
        for (label, clients, rate) in [
            ("steady 500 events/s (4 clients x 125/s)", 4, Some(125.0)),
            ("saturation, 4 clients", 4, None),
        ] {
            let l = latency(&cluster, &mut c, clients, rate, seconds);
            println!(
                "{:<46} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                label, l.rate, l.p50, l.p95, l.p99, l.max
            );
        }
        println!();
    });
    cluster.stop();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
