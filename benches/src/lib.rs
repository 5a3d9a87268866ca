//! What the benchmark binaries share: settings from the environment, the head of the log, a
//! load of clients raising one event per transaction, and latency percentiles.

use pg_outbox_tests::Cluster;
use postgres::Client;
use std::time::{Duration, Instant, SystemTime};

pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The last position in the log.
pub fn head(c: &mut Client) -> String {
    c.query_one(
        "SELECT txid::text || ':' || seq FROM outbox.events ORDER BY txid DESC, seq DESC LIMIT 1",
        &[],
    )
    .unwrap()
    .get(0)
}

/// `clients` connections to database `bench` each raise one event per transaction for `seconds`,
/// at `per_client_rate` events/s (None: as fast as they can). The payload is `{"k": <unique>}`.
/// Returns each event's key with the time its commit returned, and the events per second.
pub fn raise_load(
    cluster: &Cluster,
    clients: usize,
    per_client_rate: Option<f64>,
    seconds: u64,
) -> (Vec<(i64, SystemTime)>, f64) {
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
                    commits.push((k, SystemTime::now()));
                    i += 1;
                }
                commits
            })
        })
        .collect();
    let commits: Vec<(i64, SystemTime)> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let rate = commits.len() as f64 / started.elapsed().as_secs_f64();
    (commits, rate)
}

pub struct Latency {
    pub rate: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

/// Percentiles of latencies in milliseconds.
pub fn latency(rate: f64, mut ms: Vec<f64>) -> Latency {
    assert!(!ms.is_empty(), "no latencies measured");
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| ms[((ms.len() as f64 * p) as usize).min(ms.len() - 1)];
    Latency {
        rate,
        p50: pct(0.50),
        p95: pct(0.95),
        p99: pct(0.99),
        max: *ms.last().unwrap(),
    }
}

/// Milliseconds from `from` to `to`.
pub fn ms_between(from: SystemTime, to: SystemTime) -> f64 {
    match to.duration_since(from) {
        Ok(d) => d.as_secs_f64() * 1000.0,
        Err(e) => -e.duration().as_secs_f64() * 1000.0,
    }
}

/// Starts a throwaway cluster named `name` for a benchmark (fsync on, shared_buffers 1GB,
/// max_wal_size 4GB, workers in database `bench`, plus `settings`), creates database `bench` with
/// `setup` run in it, waits for the workers, runs `body` with the cluster and a connection, and
/// stops the cluster whatever `body` does.
pub fn with_bench_cluster(
    name: &str,
    settings: &[&str],
    setup: &str,
    body: impl FnOnce(&Cluster, &mut Client),
) {
    let mut all = vec![
        "shared_buffers = '1GB'",
        "max_wal_size = '4GB'",
        "checkpoint_timeout = '30min'",
        "pg_outbox.databases = 'bench'",
        // Two workers, as every report before elastic workers measured.
        "pg_outbox.min_workers = 2",
    ];
    all.extend_from_slice(settings);
    let cluster = Cluster::start_with(name, &all);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut admin = cluster.connect("postgres", "postgres");
        admin.batch_execute("CREATE DATABASE bench").unwrap();
        let mut c = cluster.connect("bench", "postgres");
        c.batch_execute(setup).unwrap();
        cluster.wait_for_workers("bench");
        body(&cluster, &mut c);
    }));
    cluster.stop();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

/// Appends a JSON line to the file named by BENCH_JSON, if set (for `benches/report.py`).
fn append(line: serde_json::Value) {
    let Ok(path) = std::env::var("BENCH_JSON") else {
        return;
    };
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("opening {path}: {e}"));
    writeln!(file, "{line}").unwrap();
}

/// Records one figure: figures of one `chart` share a `title` and `unit`; each is a point
/// (`x`, `y`) of a `series` (pg_outbox, or the baseline it is measured against). `x` is a number
/// (a line chart) or a label (grouped bars).
pub fn record(
    chart: &str,
    title: &str,
    unit: &str,
    series: &str,
    x: impl Into<serde_json::Value>,
    y: f64,
) {
    append(serde_json::json!({
        "chart": chart, "title": title, "unit": unit, "series": series, "x": x.into(), "y": y,
    }));
}

/// Names the unit of a line chart's x axis.
pub fn record_x_unit(chart: &str, unit: &str) {
    append(serde_json::json!({ "chart": chart, "x_unit": unit }));
}

/// Records a ratio against a baseline, with its target if it has one.
pub fn record_ratio(what: &str, ratio: f64, target: Option<f64>) {
    append(serde_json::json!({ "ratio": what, "value": ratio, "target": target }));
}

/// A hand-written queue's clients: `clients` connections of their own each run `sql` (a statement
/// that moves up to `$1` = `batch` rows) until it moves none. Returns the seconds until all of
/// them were done.
pub fn drain_until_empty(cluster: &Cluster, clients: usize, sql: &'static str, batch: i64) -> f64 {
    let start = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let mut c = cluster.connect("bench", "postgres");
            std::thread::spawn(move || while c.execute(sql, &[&batch]).unwrap() > 0 {})
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    start.elapsed().as_secs_f64()
}
