//! Kafka sink benchmark: events/s from a backlog into a 3-partition topic at batch 128 and 1,000,
//! against the ceiling of a plain librdkafka producer sending the same messages (same size, key,
//! headers, idempotent, acks=all) to the same broker in the same run; and latency at 500
//! events/s: from the commit returning to the broker appending the message (the topic stamps each
//! message with its append time, `LogAppendTime`: the acknowledgement follows it), and to a
//! consumer reading it. Starts its own broker (scripts/kafka.sh) and throwaway cluster (fsync
//! on).
//!
//! Run through `bash benches/run.sh kafka`. BENCH_EVENTS (default 200000) sets the backlog,
//! BENCH_SECONDS (default 10) the latency run.

use pg_outbox_benches::{
    env_or, head, ms_between, raise_load, record, record_ratio, with_bench_cluster, Latency,
};
use pg_outbox_tests::eventually;
use pg_outbox_tests::kafka::Broker;
use postgres::Client;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

fn caught_up(c: &mut Client, sink: &str, position: &str) -> bool {
    let (txid, seq) = position.split_once(':').unwrap();
    let seq: i64 = seq.parse().unwrap();
    c.query_one(
        "SELECT (txid, seq) >= ($2::text::xid8, $3) FROM outbox.consumers WHERE name = $1",
        &[&sink, &txid, &seq],
    )
    .unwrap()
    .get(0)
}

/// Raises `n` events of the benchmark's shape (a payload of about 60 bytes, 16 keys).
fn backlog(c: &mut Client, n: i64) {
    let mut raised = 0i64;
    while raised < n {
        let upto = (raised + 10_000).min(n);
        c.execute(
            "SELECT outbox.raise_many(ARRAY['bench.tick'], array_agg(jsonb_build_object('k', i, 'amount', 150.5) ORDER BY i), \
                                      array_agg('customer-' || (i % 16) ORDER BY i)) \
               FROM generate_series($1::int8 + 1, $2::int8) i",
            &[&raised, &upto],
        )
        .unwrap();
        raised = upto;
    }
}

/// Events/s of a Kafka sink at `batch` draining `n` waiting events into `topic`.
fn drain(c: &mut Client, broker: &Broker, topic: &str, batch: i32, n: i64) -> f64 {
    let name = format!("k{batch}");
    c.execute(
        "SELECT outbox.create_kafka_sink($1, $2, $3, batch_size => $4, start_at => 'now')",
        &[&name, &broker.address(), &topic, &batch],
    )
    .unwrap();
    c.execute("SELECT outbox.pause_sink($1)", &[&name]).unwrap();
    backlog(c, n);
    let last = head(c);
    let start = Instant::now();
    c.execute("SELECT outbox.resume_sink($1)", &[&name])
        .unwrap();
    eventually("the sink to drain", Duration::from_secs(1800), || {
        caught_up(c, &name, &last).then_some(())
    });
    let rate = n as f64 / start.elapsed().as_secs_f64();
    c.execute("SELECT outbox.drop_sink($1)", &[&name]).unwrap();
    rate
}

/// Messages/s of a plain librdkafka producer sending `n` messages like a Kafka sink's (the same
/// value, key and nine headers; idempotent, acks=all), all acknowledged: the ceiling.
fn ceiling(broker: &Broker, topic: &str, n: i64) -> f64 {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.address())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "1")
        .set("queue.buffering.max.messages", "100000")
        .create()
        .expect("a producer");
    let start = Instant::now();
    for i in 0..n {
        let value = format!("{{\"k\": {i}, \"amount\": 150.5}}");
        let key = format!("customer-{}", i % 16);
        let id = format!("01a2339d-0e08-749c-8a45-{i:012}");
        let headers = [
            ("ce_specversion", "1.0"),
            ("ce_id", id.as_str()),
            ("ce_source", "/pg_outbox/bench"),
            ("ce_type", "bench.tick"),
            ("ce_time", "2026-12-01T10:00:00.123456Z"),
            ("ce_position", "123456789:12345"),
            ("content-type", "application/json"),
            ("ce_subject", key.as_str()),
            ("ce_tenant", "t"),
        ]
        .iter()
        .fold(OwnedHeaders::new_with_capacity(9), |h, (k, v)| {
            h.insert(Header {
                key: k,
                value: Some(*v),
            })
        });
        let mut record = BaseRecord::to(topic)
            .payload(&value)
            .key(&key)
            .headers(headers);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((_, back)) => {
                    producer.poll(Duration::from_millis(5));
                    record = back;
                }
            }
        }
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(300)).expect("flushing");
    n as f64 / start.elapsed().as_secs_f64()
}

/// When an event arrived: (the broker appended it, a consumer read it).
type Arrivals = HashMap<i64, (SystemTime, SystemTime)>;

/// Reads `topic` from its end on a thread, noting when each event's `k` was appended and read,
/// until stopped.
fn receipts(broker: &Broker, topic: &str) -> (Arc<AtomicBool>, std::thread::JoinHandle<Arrivals>) {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", broker.address())
        .set("group.id", "pg-outbox-bench")
        .set("fetch.wait.max.ms", "5")
        .set("enable.auto.commit", "false")
        .create()
        .expect("a consumer");
    let mut list = TopicPartitionList::new();
    for p in 0..3 {
        list.add_partition_offset(topic, p, Offset::End).unwrap();
    }
    consumer.assign(&list).unwrap();
    // Wait until the consumer has its positions, so that nothing produced from now is missed.
    for _ in 0..50 {
        consumer.poll(Duration::from_millis(100));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let arrived = Arc::new(Mutex::new(HashMap::new()));
    let handle = std::thread::spawn(move || {
        while !stopped.load(Ordering::Relaxed) {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(50)) {
                let now = SystemTime::now();
                let appended = m
                    .timestamp()
                    .to_millis()
                    .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms as u64))
                    .unwrap_or(now);
                let value =
                    serde_json::from_slice::<serde_json::Value>(m.payload().unwrap_or_default());
                if let Some(k) = value.ok().and_then(|v| v["k"].as_i64()) {
                    arrived.lock().unwrap().entry(k).or_insert((appended, now));
                }
            }
        }
        let out = arrived.lock().unwrap().clone();
        out
    });
    (stop, handle)
}

fn main() {
    let events: i64 = env_or("BENCH_EVENTS", 200_000);
    let seconds: u64 = env_or("BENCH_SECONDS", 10);
    // The broker with the JVM's own defaults (the tests' C1-only, serial-collector options start
    // it sooner, and pause it longer).
    std::env::set_var("KAFKA_JAVA_OPTS", "");
    let broker = Broker::start("bench");
    for topic in ["b128", "b1000", "ceiling"] {
        broker.topic(topic, 3, &[]);
    }
    broker.topic("lat", 3, &["message.timestamp.type=LogAppendTime"]);
    with_bench_cluster(
        "pg_outbox_bench_kafka",
        &["pg_outbox.kafka_allow_private = on"],
        "CREATE EXTENSION pg_outbox",
        |cluster, c| {
            println!("\npg_outbox Kafka sink benchmark: Apache Kafka 4 (one KRaft node) on loopback, 3 partitions, fsync on\n");
            println!("{:<52} {:>12}", "drain of waiting events", "events/s");
            let ceiling = ceiling(&broker, "ceiling", events);
            println!(
                "{:<52} {:>12.0}",
                format!("plain librdkafka producer, {events} messages"),
                ceiling
            );
            record(
                "kafka",
                "Kafka: draining waiting events into a 3-partition topic",
                "events/s",
                "plain librdkafka producer",
                "same messages",
                ceiling,
            );
            for (batch, topic) in [(128, "b128"), (1000, "b1000")] {
                let rate = drain(c, &broker, topic, batch, events);
                println!(
                    "{:<52} {:>12.0}",
                    format!("Kafka sink, batch_size {batch}, {events} events"),
                    rate
                );
                record(
                    "kafka",
                    "Kafka: draining waiting events into a 3-partition topic",
                    "events/s",
                    "pg_outbox Kafka sink",
                    format!("batch {batch}"),
                    rate,
                );
                record_ratio(
                    &format!("Kafka sink at batch {batch} / plain librdkafka producer"),
                    rate / ceiling,
                    Some(0.8),
                );
            }
            c.execute(
                "SELECT outbox.create_kafka_sink('lat', $1, 'lat', start_at => 'now')",
                &[&broker.address()],
            )
            .unwrap();
            // The producer is made (connected, its idempotence initialised) by the first window:
            // once, before the measurement.
            c.execute("SELECT outbox.raise('bench.warmup', '{}')", &[])
                .unwrap();
            let warm = head(c);
            eventually(
                "the latency sink to warm up",
                Duration::from_secs(60),
                || caught_up(c, "lat", &warm).then_some(()),
            );
            let (stop, reader) = receipts(&broker, "lat");
            let (commits, rate) = raise_load(cluster, 4, Some(125.0), seconds);
            let last = head(c);
            eventually(
                "the latency sink to catch up",
                Duration::from_secs(60),
                || caught_up(c, "lat", &last).then_some(()),
            );
            std::thread::sleep(Duration::from_millis(500));
            stop.store(true, Ordering::Relaxed);
            let arrived = reader.join().unwrap();
            let between = |pick: fn(&(SystemTime, SystemTime)) -> SystemTime| -> Vec<f64> {
                commits
                    .iter()
                    .filter_map(|(k, at)| arrived.get(k).map(|got| ms_between(*at, pick(got))))
                    .collect()
            };
            let (appended, read) = (between(|a| a.0), between(|a| a.1));
            assert_eq!(read.len(), commits.len(), "every event arrived");
            println!(
                "\n{:<40} {:>10} {:>8} {:>8} {:>8}",
                "latency at 500 events/s, 1 sink (ms)", "events/s", "p50", "p99", "max"
            );
            for (what, ms) in [
                ("commit to the broker's append", appended),
                ("commit to a consumer's read", read),
            ] {
                let Latency {
                    rate,
                    p50,
                    p99,
                    max,
                    ..
                } = pg_outbox_benches::latency(rate, ms);
                println!("{what:<40} {rate:>10.0} {p50:>8.2} {p99:>8.2} {max:>8.2}");
                for (series, y) in [("p50", p50), ("p99", p99), ("max", max)] {
                    record(
                        "kafka_latency",
                        "Kafka sink: latency at 500 events/s",
                        "ms",
                        series,
                        what,
                        y,
                    );
                }
            }
            println!();
        },
    );
}
