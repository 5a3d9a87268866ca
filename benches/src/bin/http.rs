//! HTTP sink benchmark: events/s delivered to a receiver on loopback (one sink and four, batch
//! sizes 1, 128 and 1000), and commit-to-request latency at 500 events/s. Starts its own
//! throwaway cluster (fsync on) with loopback and plain HTTP allowed for the receiver.
//!
//! Run through `bash benches/http.sh`. BENCH_EVENTS (default 50000) sets the drain size,
//! BENCH_SECONDS (default 10) the latency run.

use pg_outbox_benches::{
    env_or, head, ms_between, raise_load, record, with_bench_cluster, Latency,
};
use pg_outbox_tests::http_server::Receiver;
use pg_outbox_tests::{eventually, Cluster};
use postgres::Client;
use std::time::{Duration, Instant};

fn caught_up(c: &mut Client, sinks: &[String], position: &str) -> bool {
    let (txid, seq) = position.split_once(':').unwrap();
    let seq: i64 = seq.parse().unwrap();
    let n: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.consumers WHERE name = ANY($1) AND (txid, seq) >= ($2::text::xid8, $3)",
            &[&sinks, &txid, &seq],
        )
        .unwrap()
        .get(0);
    n as usize == sinks.len()
}

/// Events/s (summed over the sinks) for `sinks` HTTP sinks at `batch`, draining `n` events each.
fn drain(c: &mut Client, rx: &Receiver, sinks: usize, batch: i32, n: i64) -> f64 {
    let names: Vec<String> = (0..sinks).map(|i| format!("h{batch}_{i}")).collect();
    for name in &names {
        c.execute(
            "SELECT outbox.create_http_sink($1, $2, batch_size => $3, start_at => 'now')",
            &[name, &rx.url("/in"), &batch],
        )
        .unwrap();
        c.execute("SELECT outbox.pause_sink($1)", &[name]).unwrap();
    }
    let mut raised = 0i64;
    while raised < n {
        let upto = (raised + 10_000).min(n);
        c.execute(
            "SELECT outbox.raise_many(ARRAY['bench.tick'], array_agg(jsonb_build_object('k', i, 'amount', 150.5) ORDER BY i)) \
               FROM generate_series($1::int8 + 1, $2::int8) i",
            &[&raised, &upto],
        )
        .unwrap();
        raised = upto;
    }
    let last = head(c);
    let start = Instant::now();
    for name in &names {
        c.execute("SELECT outbox.resume_sink($1)", &[name]).unwrap();
    }
    eventually("the sinks to drain", Duration::from_secs(900), || {
        caught_up(c, &names, &last).then_some(())
    });
    let rate = (n as f64 * sinks as f64) / start.elapsed().as_secs_f64();
    for name in &names {
        c.execute("SELECT outbox.drop_sink($1)", &[name]).unwrap();
    }
    rate
}

fn latency(cluster: &Cluster, c: &mut Client, rx: &Receiver, seconds: u64) -> Latency {
    c.execute(
        "SELECT outbox.create_http_sink('lat', $1, start_at => 'now')",
        &[&rx.url("/lat")],
    )
    .unwrap();
    let before = rx.received().len();
    let (commits, rate) = raise_load(cluster, 4, Some(125.0), seconds);
    let last = head(c);
    eventually(
        "the latency sink to catch up",
        Duration::from_secs(60),
        || caught_up(c, &["lat".to_string()], &last).then_some(()),
    );
    let mut arrived = std::collections::HashMap::new();
    for q in rx
        .received()
        .into_iter()
        .skip(before)
        .filter(|q| q.status == 200)
    {
        for e in serde_json::from_slice::<Vec<serde_json::Value>>(&q.body).unwrap() {
            arrived
                .entry(e["data"]["k"].as_i64().unwrap())
                .or_insert(q.at);
        }
    }
    let ms = commits
        .iter()
        .map(|(k, at)| ms_between(*at, arrived[k]))
        .collect();
    c.execute("SELECT outbox.drop_sink('lat')", &[]).unwrap();
    pg_outbox_benches::latency(rate, ms)
}

fn main() {
    let events: i64 = env_or("BENCH_EVENTS", 50_000);
    let seconds: u64 = env_or("BENCH_SECONDS", 10);
    let rx = Receiver::start(|_, _| (200, vec![]));
    let settings = [
        "pg_outbox.http_allow_plain = on",
        "pg_outbox.http_allow_private = on",
    ];
    with_bench_cluster(
        "pg_outbox_bench_http",
        &settings,
        "CREATE EXTENSION pg_outbox",
        |cluster, c| {
            println!("\npg_outbox HTTP sink benchmark: receiver on loopback answering 200, fsync on, 2 workers\n");
            println!(
                "{:<40} {:>12}",
                "drain of waiting events (all sinks)", "events/s"
            );
            for (sinks, batch, n) in [
                (1, 1, (events / 10).max(1000)),
                (1, 128, events),
                (1, 1000, events),
                (4, 1, (events / 40).max(500)),
                (4, 128, events / 4),
                (4, 1000, events / 4),
            ] {
                let rate = drain(c, &rx, sinks, batch, n);
                record(
                    "http",
                    "HTTP sinks draining waiting events to a loopback receiver (all sinks)",
                    "events/s",
                    &format!("{sinks} sink(s)"),
                    format!("batch {batch}"),
                    rate,
                );
                println!(
                    "{:<40} {:>12.0}",
                    format!("{sinks} sink(s), batch_size {batch}, {n} events each"),
                    rate
                );
            }
            let Latency {
                rate,
                p50,
                p99,
                max,
                ..
            } = latency(cluster, c, &rx, seconds);
            println!(
                "\n{:<40} {:>10} {:>8} {:>8} {:>8}",
                "commit-to-request latency (ms)", "events/s", "p50", "p99", "max"
            );
            println!(
                "{:<40} {:>10.0} {:>8.2} {:>8.2} {:>8.2}\n",
                "steady 500 events/s, 1 sink", rate, p50, p99, max
            );
            for (series, y) in [("p50", p50), ("p99", p99), ("max", max)] {
                record(
                    "http_latency",
                    "HTTP sink: commit-to-request latency at 500 events/s",
                    "ms",
                    series,
                    "500 events/s",
                    y,
                );
            }
        },
    );
}
