//! Dispatch benchmark: how fast the background worker drains the log into a SQL sink, against the
//! same work done by PgQ's batch consumer loop and by a hand-written SKIP LOCKED queue, and how
//! long an event takes from its commit to the sink's handler. Starts its own throwaway cluster
//! (fsync on, shared_buffers 1GB, pg_outbox preloaded), prints tables, stops the cluster.
//!
//! Run through `bash benches/dispatch.sh` (builds and installs the release build first).
//! BENCH_EVENTS (default 200000) sets the drain size, BENCH_SECONDS (default 10) each latency run,
//! BENCH_STALL_SECONDS (default 10) how long the horizon is held, BENCH_SIZE_SECONDS (default 300)
//! the long run and BENCH_SIZE_RETENTION (default 10) its retention in seconds (the hour at a
//! minute: 3600 and 60); BENCH_DRAIN_ONLY=1 stops after the drains; BENCH_STALL_ONLY=1 only the stall (by
//! the read horizon, then reading by ticks); BENCH_LATENCY_ONLY=1 measures
//! only the latencies.

use pg_outbox_benches::{
    drain_until_empty, env_or, head, raise_load, record, record_ratio, record_x_unit,
    with_bench_cluster, Latency,
};
use pg_outbox_tests::{eventually, Cluster};
use postgres::Client;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const SETUP: &str = "
    CREATE EXTENSION pg_outbox;
    CREATE EXTENSION pgq;
    SELECT pgq.create_queue('bench');
    -- The benchmark ticks (as pgqd would) after every 500 events: the default ticker_max_count.
    SELECT pgq.register_consumer('bench', 'ledger');
    -- The hand-written queue: rows claimed and deleted with SKIP LOCKED.
    CREATE TABLE plain_queue (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload jsonb NOT NULL);
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
/// When the handler wrote each event's key into the ledger, in microseconds since the epoch.
fn delivered_at(c: &mut Client) -> std::collections::HashMap<i64, i64> {
    c.query(
        "SELECT k, (extract(epoch FROM at) * 1000000)::int8 FROM ledger",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Makes `sink` read by ticks (issue 15) instead of by the read horizon.
fn read_by_ticks(c: &mut Client, sink: &str) {
    c.execute(
        "SELECT outbox.alter_sink($1, '{\"read_by\": \"ticks\"}')",
        &[&sink],
    )
    .unwrap();
}

/// Waits until the ledger holds `n` events. (A sink that reads by ticks ends at the last event of
/// its last batch, which need not be the log's head: `wait_for_cursor` is the read rule's.)
fn wait_for_ledger(c: &mut Client, n: usize, within: Duration) {
    eventually(&format!("{n} events in the ledger"), within, || {
        let got: i64 = c
            .query_one("SELECT count(*) FROM ledger", &[])
            .unwrap()
            .get(0);
        (got as usize >= n).then_some(())
    });
}

fn latency(
    cluster: &Cluster,
    c: &mut Client,
    clients: usize,
    per_client_rate: Option<f64>,
    seconds: u64,
    by_ticks: bool,
) -> Latency {
    let sink = "latency";
    new_sink(c, sink, 128);
    if by_ticks {
        read_by_ticks(c, sink);
    }
    let (commits, rate) = raise_load(cluster, clients, per_client_rate, seconds);
    wait_for_ledger(c, commits.len(), Duration::from_secs(120));
    let delivered = delivered_at(c);
    assert_eq!(delivered.len(), commits.len(), "every event delivered once");
    let ms = commits
        .iter()
        .map(|(k, at)| (delivered[k] - micros(*at)) as f64 / 1000.0)
        .collect();
    c.execute("SELECT outbox.drop_sink($1)", &[&sink]).unwrap();
    pg_outbox_benches::latency(rate, ms)
}

/// PgQ's consumer loop draining `n` events into the ledger: the events are inserted with
/// `pgq.insert_event` and ticked every `batch` (pgqd's default is 500), then one client runs
/// `next_batch`, copies `get_batch_events` into the ledger and calls `finish_batch`, one
/// transaction per batch, until no batch is left. Events per second of the loop.
fn pgq_drain(c: &mut Client, batch: i64, n: i64) -> f64 {
    c.batch_execute("TRUNCATE ledger").unwrap();
    // pgq.ticker(queue) ticks once ticker_max_count events wait (or ticker_max_lag passed).
    c.execute(
        "SELECT pgq.set_queue_config('bench', 'ticker_max_count', $1::int8::text)",
        &[&batch],
    )
    .unwrap();
    let mut raised = 0i64;
    while raised < n {
        let upto = (raised + batch).min(n);
        c.execute(
            "SELECT count(pgq.insert_event('bench', 'bench.tick', \
                    jsonb_build_object('k', i, 'amount', 150.5, 'currency', 'EUR')::text)) \
               FROM generate_series($1::int8 + 1, $2::int8) i",
            &[&raised, &upto],
        )
        .unwrap();
        c.batch_execute("SELECT pgq.ticker('bench')").unwrap();
        raised = upto;
    }
    c.batch_execute("CHECKPOINT").unwrap();
    let start = Instant::now();
    loop {
        let mut tx = c.transaction().unwrap();
        let batch: Option<i64> = tx
            .query_one("SELECT pgq.next_batch('bench', 'ledger')", &[])
            .unwrap()
            .get(0);
        let Some(batch) = batch else { break };
        tx.execute(
            "INSERT INTO ledger (k, pos) SELECT (ev_data::jsonb->>'k')::bigint, ev_id::text \
               FROM pgq.get_batch_events($1)",
            &[&batch],
        )
        .unwrap();
        tx.execute("SELECT pgq.finish_batch($1)", &[&batch])
            .unwrap();
        tx.commit().unwrap();
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let got: i64 = c
        .query_one("SELECT count(*) FROM ledger", &[])
        .unwrap()
        .get(0);
    assert_eq!(got, n, "PgQ delivered every event once");
    rate
}

/// A hand-written queue draining `n` rows into the ledger: `clients` connections (as many as the
/// workers) each delete up to `batch` rows with FOR UPDATE SKIP LOCKED and insert them into the
/// ledger in one statement, until the queue is empty.
fn skip_locked_drain(cluster: &Cluster, c: &mut Client, clients: usize, batch: i64, n: i64) -> f64 {
    c.batch_execute("TRUNCATE ledger, plain_queue").unwrap();
    c.execute(
        "INSERT INTO plain_queue (payload) \
         SELECT jsonb_build_object('k', i, 'amount', 150.5, 'currency', 'EUR') FROM generate_series(1, $1::int8) i",
        &[&n],
    )
    .unwrap();
    c.batch_execute("VACUUM ANALYZE plain_queue").unwrap();
    c.batch_execute("CHECKPOINT").unwrap();
    let seconds = drain_until_empty(
        cluster,
        clients,
        "WITH claimed AS ( \
             DELETE FROM plain_queue WHERE id IN ( \
                 SELECT id FROM plain_queue ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED) \
             RETURNING id, payload) \
         INSERT INTO ledger (k, pos) SELECT (payload->>'k')::bigint, id::text FROM claimed",
        batch,
    );
    let rate = n as f64 / seconds;
    let got: i64 = c
        .query_one("SELECT count(*) FROM ledger", &[])
        .unwrap()
        .get(0);
    assert_eq!(got, n, "the queue delivered every row once");
    rate
}

/// The stall: a steady 500 events/s for `3 * hold` seconds while, from `hold` to `2 * hold`, a
/// transaction in another connection holds a transaction id open (the read horizon). Events
/// committed meanwhile cannot be read until it ends. Returns each event's (seconds since the
/// start at its commit, commit-to-handler ms), when the holder committed (seconds since the
/// start), and how long after that the last delayed event was delivered (ms).
fn stall(
    cluster: &Cluster,
    c: &mut Client,
    hold: u64,
    by_ticks: bool,
) -> (Vec<(f64, f64)>, f64, f64) {
    let sink = "stall";
    new_sink(c, sink, 128);
    if by_ticks {
        read_by_ticks(c, sink);
    }
    let start = SystemTime::now();
    let holder = {
        let mut h = cluster.connect("bench", "postgres");
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(hold));
            let mut tx = h.transaction().unwrap();
            tx.batch_execute("SELECT pg_current_xact_id()").unwrap();
            std::thread::sleep(Duration::from_secs(hold));
            tx.commit().unwrap();
            SystemTime::now()
        })
    };
    let (commits, _) = raise_load(cluster, 4, Some(125.0), 3 * hold);
    let released = holder.join().unwrap();
    wait_for_ledger(c, commits.len(), Duration::from_secs(120));
    let delivered = delivered_at(c);
    assert_eq!(delivered.len(), commits.len(), "every event delivered once");
    let t0 = micros(start);
    let points: Vec<(f64, f64)> = commits
        .iter()
        .map(|(k, at)| {
            (
                (micros(*at) - t0) as f64 / 1e6,
                (delivered[k] - micros(*at)) as f64 / 1000.0,
            )
        })
        .collect();
    // The events committed while the horizon was held: the last of them to reach the handler.
    let released_us = micros(released);
    let caught_up = commits
        .iter()
        .filter(|(_, at)| micros(*at) < released_us)
        .map(|(k, _)| delivered[k])
        .max()
        .unwrap_or(released_us);
    c.execute("SELECT outbox.drop_sink($1)", &[&sink]).unwrap();
    (
        points,
        (released_us - t0) as f64 / 1e6,
        (caught_up - released_us) as f64 / 1000.0,
    )
}

/// Seconds as SHOW prints a setting in seconds (the largest unit that divides it), so that
/// `Cluster::set` sees it take effect: 60 is "1min".
fn as_shown(seconds: u64) -> String {
    match seconds {
        0 => "0".to_string(),
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s % 60 == 0 => format!("{}min", s / 60),
        s => format!("{s}s"),
    }
}

/// The log's size over a long run with pruning on: 2,000 events/s into a sink for `seconds`,
/// with a retention of `retention_s` pruned every `retention_s / 2` (and autovacuum looking every
/// 5 s), sampling outbox.events (its partitions, tables and indexes) every second. Returns the
/// (seconds, MB) samples and the rows pruning deleted and left dead in the partitions.
fn sizes(
    cluster: &Cluster,
    c: &mut Client,
    seconds: u64,
    retention_s: u64,
) -> (Vec<(f64, f64)>, i64) {
    cluster.set("pg_outbox.retention", &as_shown(retention_s));
    cluster.set(
        "pg_outbox.prune_interval",
        &as_shown((retention_s / 2).max(1)),
    );
    cluster.set("autovacuum_naptime", "5s");
    let sink = "sizes";
    new_sink(c, sink, 128);
    let mut samples = Vec::new();
    std::thread::scope(|scope| {
        let load = scope.spawn(|| raise_load(cluster, 4, Some(500.0), seconds));
        let start = Instant::now();
        while !load.is_finished() {
            let bytes: i64 = c
                .query_one(
                    "SELECT sum(pg_total_relation_size(relid))::int8 FROM pg_partition_tree('outbox.events')",
                    &[],
                )
                .unwrap()
                .get(0);
            samples.push((start.elapsed().as_secs_f64(), bytes as f64 / 1_048_576.0));
            std::thread::sleep(Duration::from_secs(1));
        }
        load.join().unwrap();
    });
    c.execute("SELECT outbox.drop_sink($1)", &[&sink]).unwrap();
    c.batch_execute("SELECT pg_stat_force_next_flush()")
        .unwrap();
    let dead: i64 = c
        .query_one(
            "SELECT coalesce(sum(n_tup_del + n_dead_tup), 0)::int8 FROM pg_stat_user_tables \
              WHERE relid IN (SELECT relid FROM pg_partition_tree('outbox.events'))",
            &[],
        )
        .unwrap()
        .get(0);
    (samples, dead)
}

/// Commit-to-handler latency at steady rates and at saturation, one sink at batch 128.
fn latencies(cluster: &Cluster, c: &mut Client, seconds: u64) {
    println!(
        "\n{:<46} {:>10} {:>8} {:>8} {:>8} {:>8}",
        "commit-to-handler latency (ms)", "events/s", "p50", "p95", "p99", "max"
    );
    for (label, clients, rate) in [
        ("steady 100 events/s (4 clients x 25/s)", 4, Some(25.0)),
        ("steady 500 events/s (4 clients x 125/s)", 4, Some(125.0)),
        ("steady 1000 events/s (4 clients x 250/s)", 4, Some(250.0)),
        ("steady 2000 events/s (4 clients x 500/s)", 4, Some(500.0)),
        ("saturation, 4 clients", 4, None),
    ] {
        let l = latency(cluster, c, clients, rate, seconds, false);
        println!(
            "{:<46} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
            label, l.rate, l.p50, l.p95, l.p99, l.max
        );
        let title = "Commit-to-handler latency against rate (SQL sink)";
        record_x_unit("latency", "events/s");
        for (series, y) in [
            ("p50", l.p50),
            ("p95", l.p95),
            ("p99", l.p99),
            ("max", l.max),
        ] {
            record("latency", title, "ms", series, l.rate.round(), y);
        }
        if rate == Some(125.0) {
            record_ratio(
                "latency p99 at 500 events/s (ms; target: at most 25)",
                l.p99,
                Some(25.0),
            );
        }
    }
    // The same sink reading by ticks, at 500 events/s: no worse than by the read horizon.
    let l = latency(cluster, c, 4, Some(125.0), seconds, true);
    println!(
        "{:<46} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
        "steady 500 events/s, the sink reading by ticks", l.rate, l.p50, l.p95, l.p99, l.max
    );
    record_ratio(
        "latency p99 at 500 events/s, a sink reading by ticks (ms; at most 5)",
        l.p99,
        Some(5.0),
    );
}

/// The stall, by the read horizon and then reading by ticks: the chart and the figures.
fn stalls(cluster: &Cluster, c: &mut Client) {
    let hold: u64 = env_or("BENCH_STALL_SECONDS", 10);
    let (points, released_at, recovery_ms) = stall(cluster, c, hold, false);
    println!(
        "\nstall: 500 events/s for {} s, a transaction holding an xid from {hold} s to {released_at:.1} s",
        3 * hold
    );
    let worst = points.iter().map(|p| p.1).fold(0.0, f64::max);
    println!(
        "  worst commit-to-handler latency {worst:.0} ms; the backlog was delivered {recovery_ms:.1} ms \
         after the transaction ended (poll interval 1000 ms)"
    );
    let title =
        format!("Commit-to-handler latency over time, a {hold} s transaction holding the horizon");
    // One point per 100 ms of commits (the highest latency in it), so the chart stays light.
    let mut buckets: std::collections::BTreeMap<i64, f64> = Default::default();
    for (t, ms) in &points {
        let b = buckets.entry((t * 10.0) as i64).or_insert(0.0);
        *b = b.max(*ms);
    }
    record_x_unit("stall", "seconds since the start");
    for (b, ms) in buckets {
        record(
            "stall",
            &title,
            "ms",
            "latency (worst per 100 ms)",
            b as f64 / 10.0,
            ms,
        );
    }
    record_ratio(
        "stall: backlog delivered after the long transaction ended (ms; target: at most 1000, the poll interval)",
        recovery_ms,
        Some(1000.0),
    );
    // The same with the sink reading by ticks: the long transaction holds back only itself.
    let (points, _, _) = stall(cluster, c, hold, true);
    let mut ms: Vec<f64> = points.iter().map(|p| p.1).collect();
    let worst = ms.iter().copied().fold(0.0, f64::max);
    let l = pg_outbox_benches::latency(0.0, std::mem::take(&mut ms));
    println!(
        "  reading by ticks: p50 {:.2} ms, p99 {:.2} ms, worst {worst:.0} ms over the same run",
        l.p50, l.p99
    );
    let mut buckets: std::collections::BTreeMap<i64, f64> = Default::default();
    for (t, ms) in &points {
        let b = buckets.entry((t * 10.0) as i64).or_insert(0.0);
        *b = b.max(*ms);
    }
    for (b, ms) in buckets {
        record(
            "stall",
            &title,
            "ms",
            "reading by ticks (worst per 100 ms)",
            b as f64 / 10.0,
            ms,
        );
    }
    record_ratio(
        "stall, a sink reading by ticks: p99 commit-to-handler latency while a transaction holds an xid (ms; target: at most 10)",
        l.p99,
        Some(10.0),
    );
}

/// Events per second a sink drains a backlog of one-event transactions at (8 clients raising for
/// `seconds` while it is paused), reading by the read horizon or by ticks. By ticks, the workers
/// took a tick a round meanwhile, and a window never spans two batches: the backlog's batches,
/// and so its windows, are as small as the rounds were short.
fn drain_small_transactions(
    cluster: &Cluster,
    c: &mut Client,
    seconds: u64,
    by_ticks: bool,
) -> f64 {
    let sink = if by_ticks {
        "small_ticks"
    } else {
        "small_horizon"
    };
    new_sink(c, sink, 128);
    if by_ticks {
        read_by_ticks(c, sink);
        // In a batch before the backlog (a sink turns to ticks at its first pass after a tick).
        c.batch_execute("SELECT outbox.raise('bench.first', '{\"k\": -1}')")
            .unwrap();
        wait_for_ledger(c, 1, Duration::from_secs(30));
    }
    c.execute("SELECT outbox.pause_sink($1)", &[&sink]).unwrap();
    let before: i64 = c
        .query_one("SELECT count(*) FROM ledger", &[])
        .unwrap()
        .get(0);
    let (commits, _) = raise_load(cluster, 8, None, seconds);
    let ticks: i64 = c
        .query_one("SELECT count(*) FROM outbox.ticks", &[])
        .unwrap()
        .get(0);
    c.batch_execute("CHECKPOINT").unwrap();
    let start = Instant::now();
    c.execute("SELECT outbox.resume_sink($1)", &[&sink])
        .unwrap();
    wait_for_ledger(c, before as usize + commits.len(), Duration::from_secs(600));
    let rate = commits.len() as f64 / start.elapsed().as_secs_f64();
    println!(
        "{:<46} {:>12.0}",
        format!(
            "{} one-event transactions, {}",
            commits.len(),
            if by_ticks {
                format!("by ticks ({ticks} ticks)")
            } else {
                "by the horizon".to_string()
            }
        ),
        rate
    );
    c.execute("SELECT outbox.drop_sink($1)", &[&sink]).unwrap();
    rate
}

/// Drain of a backlog of small transactions, by the read horizon and by ticks, same run.
fn drains_by_ticks(cluster: &Cluster, c: &mut Client) {
    let seconds: u64 = env_or("BENCH_DRAIN_SECONDS", 10);
    println!(
        "\n{:<46} {:>12}",
        "drain of a backlog of small transactions", "events/s"
    );
    let horizon = drain_small_transactions(cluster, c, seconds, false);
    let ticks = drain_small_transactions(cluster, c, seconds, true);
    let title = "Draining a backlog of one-event transactions (batch 128)";
    record(
        "drain_small",
        title,
        "events/s",
        "by the read horizon",
        "batch 128",
        horizon,
    );
    record(
        "drain_small",
        title,
        "events/s",
        "by ticks",
        "batch 128",
        ticks,
    );
    record_ratio(
        "drain of small transactions: by ticks / by the read horizon (target: at least 1.0)",
        ticks / horizon,
        Some(1.0),
    );
}

fn main() {
    let events: i64 = env_or("BENCH_EVENTS", 200_000);
    let seconds: u64 = env_or("BENCH_SECONDS", 10);
    with_bench_cluster("pg_outbox_bench", &[], SETUP, |cluster, c| {
        let version: String = c.query_one("SHOW server_version", &[]).unwrap().get(0);
        let workers: String = c
            .query_one("SHOW pg_outbox.min_workers", &[])
            .unwrap()
            .get(0);
        println!(
            "\npg_outbox dispatch benchmark: PostgreSQL {version}, fsync on, {workers} workers at least"
        );
        println!("sink: a SQL function inserting every event it is handed into a table\n");
        if std::env::var_os("BENCH_STALL_ONLY").is_some() {
            stalls(cluster, c);
            return;
        }
        if std::env::var_os("BENCH_LATENCY_ONLY").is_some() {
            latencies(cluster, c, seconds);
            return;
        }
        if std::env::var_os("BENCH_DRAIN_TICKS_ONLY").is_some() {
            drains_by_ticks(cluster, c);
            return;
        }
        println!("{:<46} {:>12}", "drain of waiting events", "events/s");
        let ours = drain(c, 128, events);
        println!(
            "{:<46} {:>12.0}",
            format!("{events} events, batch_size 128"),
            ours
        );
        // PgQ's batches are the events between two ticks: 500 with pgqd's defaults.
        let as_pgq = drain(c, 500, events);
        println!(
            "{:<46} {:>12.0}",
            format!("{events} events, batch_size 500"),
            as_pgq
        );
        let big = drain(c, 1000, events);
        println!(
            "{:<46} {:>12.0}",
            format!("{events} events, batch_size 1000"),
            big
        );
        let pgq = pgq_drain(c, 500, events);
        println!(
            "{:<46} {:>12.0}",
            "PgQ consumer loop (batches of 500, 1 client)", pgq
        );
        let queue = skip_locked_drain(cluster, c, 2, 128, events);
        println!(
            "{:<46} {:>12.0}",
            "SKIP LOCKED delete+insert (128, 2 clients)", queue
        );
        println!(
            "ratios: batch_size 500 / PgQ (batches of 500) {:.2}; batch_size 128 / SKIP LOCKED (128) {:.2}",
            as_pgq / pgq,
            ours / queue
        );
        let title = format!("Draining {events} waiting events into a table");
        for (series, x, y) in [
            ("pg_outbox SQL sink", "batch 128", ours),
            ("pg_outbox SQL sink", "batch 500", as_pgq),
            ("pg_outbox SQL sink", "batch 1000", big),
            ("PgQ consumer loop", "batch 500", pgq),
            ("SKIP LOCKED queue, 2 clients", "batch 128", queue),
        ] {
            record("drain", &title, "events/s", series, x, y);
        }
        record_ratio(
            "dispatch (batch 500) / PgQ consumer loop (batches of 500)",
            as_pgq / pgq,
            Some(1.0),
        );
        record_ratio(
            "dispatch (batch 128) / SKIP LOCKED queue (128, 2 clients)",
            ours / queue,
            Some(2.0),
        );
        // Drain rate against batch size, the three side by side. Small batches drain slowly (a
        // commit per batch), so they drain fewer events: what is compared is the rate.
        println!(
            "\n{:<46} {:>12} {:>12} {:>12}",
            "drain against batch size (events/s)", "pg_outbox", "PgQ", "SKIP LOCKED"
        );
        let title = "Drain rate against batch size (waiting events into a table)";
        record_x_unit("drain_batch", "events per batch (transaction)");
        for batch in [1i64, 16, 128, 1000] {
            // Whole batches: PgQ ticks only once a batch is full.
            let n = (events * batch / 128).clamp(5_000.min(events), events) / batch * batch;
            let ours = match batch {
                128 => ours,
                1000 => big,
                _ => drain(c, batch as i32, n),
            };
            let theirs = pgq_drain(c, batch, n);
            let queue = match batch {
                128 => queue,
                _ => skip_locked_drain(cluster, c, 2, batch, n),
            };
            println!(
                "{:<46} {:>12.0} {:>12.0} {:>12.0}",
                format!("batch {batch} ({n} events)"),
                ours,
                theirs,
                queue
            );
            for (series, y) in [
                ("pg_outbox SQL sink", ours),
                ("PgQ consumer loop (1 client)", theirs),
                ("SKIP LOCKED queue (2 clients)", queue),
            ] {
                record("drain_batch", title, "events/s", series, batch, y);
            }
        }
        if std::env::var_os("BENCH_DRAIN_ONLY").is_some() {
            return;
        }
        latencies(cluster, c, seconds);
        stalls(cluster, c);
        drains_by_ticks(cluster, c);
        let seconds_long: u64 = env_or("BENCH_SIZE_SECONDS", 300);
        let retention: u64 = env_or("BENCH_SIZE_RETENTION", 10);
        let (samples, dead) = sizes(cluster, c, seconds_long, retention);
        // The log rotates through partitions, so its size is a saw: compare the peaks of the
        // middle and the last third of the run.
        let peak = |from: f64, to: f64| {
            samples
                .iter()
                .filter(|(t, _)| *t >= from * seconds_long as f64 && *t < to * seconds_long as f64)
                .map(|s| s.1)
                .fold(0.0, f64::max)
        };
        let (middle, end) = (peak(1.0 / 3.0, 2.0 / 3.0), peak(2.0 / 3.0, 1.01));
        println!(
            "\nlog size over {seconds_long} s at 2,000 events/s, retention {retention} s pruned every {} s: \
             peak {middle:.1} MB in the middle third, {end:.1} MB in the last; {dead} rows deleted or dead in the log",
            (retention / 2).max(1)
        );
        record_x_unit("sizes", "seconds");
        for (t, mb) in &samples {
            record(
                "sizes",
                "outbox.events (its partitions, tables and indexes) over a long run, pruning on",
                "MB",
                "outbox.events",
                (*t).round(),
                *mb,
            );
        }
        record_ratio(
            "log size: peak of the last third / of the middle third of the long run (target: at most 1.25, bounded)",
            end / middle,
            Some(1.25),
        );
        record_ratio(
            "rows deleted or left dead in the log by pruning over the long run (target: at most 0, it truncates)",
            dead as f64,
            Some(0.0),
        );
        println!();
    });
}
