//! A real Apache Kafka broker for the tests (KRaft, one node on 127.0.0.1), started and stopped
//! with `scripts/kafka.sh` (which `scripts/setup.sh` installed), and a consumer that reads what
//! the Kafka sinks produced.

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/kafka.sh")
}

fn run(args: &[&str]) {
    run_with(args, &[]);
}

fn run_with(args: &[&str], env: &[(&str, String)]) {
    let out = Command::new("bash")
        .arg(script())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v.as_str())))
        .output()
        .expect("bash scripts/kafka.sh");
    assert!(
        out.status.success(),
        "scripts/kafka.sh {}: {}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One broker, stopped (and its directory removed) when dropped.
pub struct Broker {
    dir: PathBuf,
    pub port: u16,
    /// The SASL_PLAINTEXT listener's port and its users (`name:password ...`), if it has one.
    sasl: Option<(u16, String)>,
}

impl Broker {
    /// Starts a broker on a free loopback port (its controller on the next one).
    pub fn start(label: &str) -> Broker {
        Broker::start_with(label, None)
    }

    /// Starts a broker that also has a SASL_PLAINTEXT listener (PLAIN) for `users` (name,
    /// password), with ACLs on: those users may do only what [`Broker::allow`] grants, while the
    /// PLAINTEXT listener the tests' tools use stays a super user.
    pub fn start_with_sasl(label: &str, users: &[(&str, &str)]) -> Broker {
        let port = crate::http_server::Receiver::free_port();
        let users = users
            .iter()
            .map(|(u, p)| format!("{u}:{p}"))
            .collect::<Vec<_>>()
            .join(" ");
        Broker::start_with(label, Some((port, users)))
    }

    fn start_with(label: &str, sasl: Option<(u16, String)>) -> Broker {
        let port = loop {
            let p = crate::http_server::Receiver::free_port();
            if p < 65000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
                break p;
            }
        };
        let dir = PathBuf::from(format!("/tmp/pgo-kafka-{label}.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let broker = Broker { dir, port, sasl };
        broker.run(&["start", broker.dir.to_str().unwrap(), &port.to_string()]);
        broker
    }

    fn run(&self, args: &[&str]) {
        let env = match &self.sasl {
            Some((port, users)) => vec![
                ("KAFKA_SASL_PORT", port.to_string()),
                ("KAFKA_SASL_USERS", users.clone()),
            ],
            None => Vec::new(),
        };
        run_with(args, &env);
    }

    /// `127.0.0.1:<port>` of the SASL_PLAINTEXT listener.
    pub fn sasl_address(&self) -> String {
        let (port, _) = self.sasl.as_ref().expect("a broker with a SASL listener");
        format!("127.0.0.1:{port}")
    }

    /// Grants `User:<principal>` the `operations` (Write, Describe, ...) on `topic`.
    pub fn allow(&self, principal: &str, topic: &str, operations: &[&str]) {
        let port = self.port.to_string();
        let mut args = vec!["acl", self.dir.to_str().unwrap(), &port, principal, topic];
        args.extend_from_slice(operations);
        run(&args);
    }

    /// `127.0.0.1:<port>`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates a topic with `partitions`, and topic configs such as `max.message.bytes=1000`.
    pub fn topic(&self, name: &str, partitions: u32, configs: &[&str]) {
        let mut args = vec![
            "topic".to_string(),
            self.dir.to_str().unwrap().to_string(),
            self.port.to_string(),
            name.to_string(),
            partitions.to_string(),
        ];
        args.extend(configs.iter().map(|c| c.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run(&args);
    }

    /// Kills the broker at once (SIGKILL), as a crash would.
    pub fn kill(&self) {
        run(&["kill", self.dir.to_str().unwrap()]);
    }

    /// Starts it again on the same data and port.
    pub fn restart(&self) {
        self.run(&["start", self.dir.to_str().unwrap(), &self.port.to_string()]);
    }

    /// Every record of `topic` from the beginning, once at least `at_least` have arrived (or
    /// `within` has passed), in the order of each partition.
    pub fn consume(&self, topic: &str, at_least: usize, within: Duration) -> Vec<Record> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.address())
            .set("group.id", format!("pg-outbox-tests-{topic}"))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .expect("a consumer");
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .expect("topic metadata");
        let partitions = metadata.topics()[0].partitions().len() as i32;
        let mut list = TopicPartitionList::new();
        for p in 0..partitions {
            list.add_partition_offset(topic, p, Offset::Beginning)
                .unwrap();
        }
        consumer.assign(&list).expect("assigning partitions");
        let deadline = Instant::now() + within;
        let mut out = Vec::new();
        while Instant::now() < deadline {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    let headers = m
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| {
                                    (
                                        h.key.to_string(),
                                        String::from_utf8_lossy(h.value.unwrap_or_default())
                                            .into_owned(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    out.push(Record {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                        value: String::from_utf8_lossy(m.payload().unwrap_or_default())
                            .into_owned(),
                        headers,
                    });
                }
                Some(Err(e)) => panic!("consuming {topic}: {e}"),
                None if out.len() >= at_least => break,
                None => {}
            }
        }
        out
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .args(["stop", self.dir.to_str().unwrap()])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A record as a consumer reads it.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub value: String,
    /// Headers by name (the last of a name, should there be several).
    pub headers: BTreeMap<String, String>,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}
