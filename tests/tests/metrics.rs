//! Metrics (issue #11, item 5): the real postgres_exporter (Debian's
//! prometheus-postgres-exporter) reads `contrib/postgres_exporter/pg_outbox.yaml` against the
//! test cluster as a role with only the README's monitoring grants, and its `/metrics` shows lag,
//! delivered / failed / dead-lettered counts, queue depth and the horizon's holder.

use pg_outbox_tests::{eventually, worker_db};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const EXPORTER: &str = "/usr/bin/prometheus-postgres-exporter";
const QUERIES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../contrib/postgres_exporter/pg_outbox.yaml"
);

/// The README's grants for a monitoring role (pg_monitor: the horizon holder's transaction age).
const MONITOR_GRANTS: &str = "
    GRANT pg_monitor TO outbox_monitor;
    GRANT USAGE ON SCHEMA outbox TO outbox_monitor;
    GRANT EXECUTE ON FUNCTION outbox.metrics(), outbox.queue_status(), outbox.horizon(),
                              outbox.workers() TO outbox_monitor;";

/// The exporter process, stopped when dropped.
struct Exporter(Child);

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// GET /metrics: the samples, by metric name with labels as printed.
fn scrape(port: u16) -> Option<HashMap<String, f64>> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let (_, body) = body.split_once("\r\n\r\n")?;
    Some(
        body.lines()
            .filter(|l| l.starts_with("pg_outbox_"))
            .filter_map(|l| {
                let (name, value) = l.rsplit_once(' ')?;
                Some((name.to_string(), value.parse().ok()?))
            })
            .collect(),
    )
}

/// The value of the one sample of `metric` whose labels include every `label="value"` given.
fn sample(samples: &HashMap<String, f64>, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = samples.iter().filter(|(name, _)| {
        name.starts_with(&format!("{metric}{{"))
            && labels
                .iter()
                .all(|(k, v)| name.contains(&format!("{k}=\"{v}\"")))
    });
    let (_, value) = found.next()?;
    assert!(found.next().is_none(), "one sample of {metric} {labels:?}");
    Some(*value)
}

#[test]
fn the_exporter_reads_lag_counts_queues_and_the_horizon_with_the_monitoring_grants() {
    let db = worker_db("metrics");
    let mut c = db.connect();
    c.batch_execute(&format!(
        "DO $$ BEGIN
           IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_monitor') THEN
             CREATE ROLE outbox_monitor LOGIN;
           END IF;
         END $$;
         {MONITOR_GRANTS}
         CREATE TABLE got (id uuid);
         CREATE FUNCTION rec(events outbox.event[]) RETURNS void LANGUAGE sql AS
           $$ INSERT INTO public.got SELECT e.id FROM unnest(events) e $$;
         CREATE FUNCTION broken(events outbox.event[]) RETURNS void LANGUAGE plpgsql AS
           $$ BEGIN RAISE EXCEPTION 'the endpoint is down'; END $$;
         SELECT outbox.create_sink('books', 'rec(outbox.event[])', topics => '{{orders.*}}');
         SELECT outbox.create_sink('broken', 'broken(outbox.event[])', topics => '{{refunds.*}}');
         SELECT outbox.create_consumer('audit');
         SELECT outbox.subscribe('big', '{{orders.*}}', queue => 'big', filter => 'payload.amount > 10');
         SELECT outbox.create_queue('mail');
         SELECT outbox.enqueue('mail', '{{}}') FROM generate_series(1, 3);
         SELECT outbox.raise('orders.placed', jsonb_build_object('amount', n * 5)) FROM generate_series(1, 5) n;
         SELECT outbox.raise('refunds.issued', '{{}}');"
    ))
    .unwrap();
    eventually("books delivered", Duration::from_secs(10), || {
        let n: i64 = c.query_one("SELECT count(*) FROM got", &[]).unwrap().get(0);
        (n == 5).then_some(())
    });
    // A transaction holding the horizon, in another connection.
    let mut holder = db.connect();
    holder
        .batch_execute("BEGIN; SELECT pg_current_xact_id();")
        .unwrap();
    let holder_pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);

    let port = free_port();
    let cluster = db.cluster();
    let dsn = format!(
        "host={} port={} user=outbox_monitor dbname={} sslmode=disable",
        cluster.socket_dir().display(),
        cluster.port(),
        db.name
    );
    let log = std::env::temp_dir().join(format!("pg_outbox_exporter.{}.log", std::process::id()));
    let _exporter = Exporter(
        Command::new(EXPORTER)
            .args([
                &format!("--extend.query-path={QUERIES}"),
                &format!("--web.listen-address=127.0.0.1:{port}"),
                "--disable-default-metrics",
                "--disable-settings-metrics",
            ])
            .env("DATA_SOURCE_NAME", &dsn)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("the exporter's log"))
            .spawn()
            .expect("starting prometheus-postgres-exporter (scripts/setup.sh installs it)"),
    );
    let mut last = None;
    let start = std::time::Instant::now();
    let samples = loop {
        if let Some(s) = scrape(port) {
            let failed = sample(&s, "pg_outbox_sink_failures_total", &[("name", "broken")]);
            let held = sample(&s, "pg_outbox_horizon_age_seconds", &[]);
            if failed.is_some_and(|f| f >= 1.0) && held.is_some_and(|h| h > 0.0) {
                break s;
            }
            last = Some(s);
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the exporter did not show pg_outbox's metrics in 30 s; last scrape: {last:#?}\nexporter log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = std::fs::remove_file(&log);
    let db_label = ("datname", db.name.as_str());
    let get = |metric: &str, name: &str| {
        sample(&samples, metric, &[db_label, ("name", name)])
            .unwrap_or_else(|| panic!("{metric} of {name} in {samples:#?}"))
    };
    assert_eq!(get("pg_outbox_sink_delivered_total", "books"), 5.0);
    assert_eq!(get("pg_outbox_sink_failures_total", "books"), 0.0);
    assert_eq!(get("pg_outbox_sink_delivered_total", "broken"), 0.0);
    assert!(get("pg_outbox_sink_failures_total", "broken") >= 1.0);
    assert_eq!(get("pg_outbox_sink_dead_letters", "broken"), 0.0);
    // Lag: the pull consumer has read nothing (6 events), the failing sink has its 1 waiting.
    assert_eq!(get("pg_outbox_consumer_events_behind", "audit"), 6.0);
    assert!(get("pg_outbox_consumer_seconds_behind", "audit") > 0.0);
    assert_eq!(get("pg_outbox_consumer_events_behind", "broken"), 1.0);
    assert_eq!(get("pg_outbox_consumer_events_behind", "books"), 0.0);
    assert_eq!(get("pg_outbox_consumer_seconds_behind", "books"), 0.0);
    // The subscription matched the three events over 10 and skipped the other two.
    assert_eq!(get("pg_outbox_subscription_matched_total", "big"), 3.0);
    assert_eq!(get("pg_outbox_subscription_skipped_total", "big"), 2.0);
    // Queues: three waiting jobs in mail, three in big.
    let queue = |q: &str| {
        sample(
            &samples,
            "pg_outbox_queue_waiting",
            &[db_label, ("queue", q)],
        )
        .unwrap_or_else(|| panic!("queue {q} in {samples:#?}"))
    };
    assert_eq!(queue("mail"), 3.0);
    assert_eq!(queue("big"), 3.0);
    assert!(
        sample(
            &samples,
            "pg_outbox_queue_oldest_due_seconds",
            &[db_label, ("queue", "mail")]
        )
        .unwrap()
            > 0.0
    );
    // The horizon's holder, named.
    let pid = holder_pid.to_string();
    let held = sample(
        &samples,
        "pg_outbox_horizon_age_seconds",
        &[db_label, ("holder_pid", &pid), ("holder_datname", &db.name)],
    );
    assert!(held.is_some_and(|s| s > 0.0), "{samples:#?}");
    assert!(sample(&samples, "pg_outbox_workers_running", &[db_label]).unwrap() >= 1.0);
    holder.batch_execute("ROLLBACK").unwrap();
}
