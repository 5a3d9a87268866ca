//! Dispatch benchmark: how fast the background worker drains the log into a SQL sink, and how long
//! an event takes from its commit to the sink's handler. Starts its own throwaway cluster (fsync
//! on, shared_buffers 1GB, pg_outbox preloaded), prints a table, stops the cluster.
//!
//! Run through `bash benches/dispatch.sh` (builds and installs the release build first).
//! BENCH_EVENTS (default 200000) sets the drain size, BENCH_SECONDS (default 10) each latency run.

use pg_outbox_benches::{env_or, head, raise_load, with_bench_cluster, Latency};
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

fn micros(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
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
    let (commits, rate) = raise_load(cluster, clients, per_client_rate, seconds);
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
    let ms = commits
        .iter()
        .map(|(k, at)| (delivered[k] - micros(*at)) as f64 / 1000.0)
        .collect();
    c.execute("SELECT outbox.drop_sink($1)", &[&sink]).unwrap();
    pg_outbox_benches::latency(rate, ms)
}

fn main() {
    let events: i64 = env_or("BENCH_EVENTS", 200_000);
    let seconds: u64 = env_or("BENCH_SECONDS", 10);
    with_bench_cluster("pg_outbox_bench", &[], SETUP, |cluster, c| {
        let version: String = c.query_one("SHOW server_version", &[]).unwrap().get(0);
        let workers: String = c.query_one("SHOW pg_outbox.workers", &[]).unwrap().get(0);
        println!(
            "\npg_outbox dispatch benchmark: PostgreSQL {version}, fsync on, {workers} workers"
        );
        println!("sink: a SQL function inserting every event it is handed into a table\n");
        println!("{:<46} {:>12}", "drain of waiting events", "events/s");
        for batch in [128, 1000] {
            let rate = drain(c, batch, events);
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
            let l = latency(cluster, c, clients, rate, seconds);
            println!(
                "{:<46} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                label, l.rate, l.p50, l.p95, l.p99, l.max
            );
        }
        println!();
    });
}
