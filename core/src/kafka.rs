//! Kafka sinks: the rules for what `outbox.create_kafka_sink` accepts (brokers, the Kafka topic
//! or its template, the message key, the client properties a tenant may set) and for the
//! addresses the producer may connect to.
//!
//! The producer is librdkafka, inside a worker that runs as the superuser: a tenant's properties
//! are an allowlist, never passed through (`plugin.library.paths` would load a library into the
//! server, `ssl.key.location` would read the server's files), and every address the producer
//! connects to (the bootstrap brokers and those the cluster's metadata names) is checked at
//! connection time against the same rules as HTTP sinks (`check_address`).

use crate::http::{host_allowed, reach, Reach};
use crate::{Invalid, InvalidKind};
use std::net::IpAddr;

fn refuse(message: impl Into<String>) -> Invalid {
    Invalid::new(InvalidKind::Parameter, message)
}

/// What the superuser allows Kafka sinks to reach (`pg_outbox.kafka_*` settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allow {
    /// Private, loopback and shared (CGNAT) addresses.
    pub private_addresses: bool,
}

/// A bootstrap broker: `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broker {
    pub host: String,
    pub port: u16,
}

/// Brokers one sink may name.
pub const MAX_BROKERS: usize = 16;

/// Parses `host:port[,host:port...]` (an IPv6 address in brackets) and checks every host against
/// the allowlist (comma-separated names or `*.suffix` patterns; empty: any host). The addresses
/// the names resolve to are checked when the producer connects.
pub fn parse_brokers(text: &str, allowlist: &str) -> Result<Vec<Broker>, Invalid> {
    let hint = "brokers is host:port, or several separated by commas: 'kafka-1.example.com:9092,kafka-2.example.com:9092'";
    let mut brokers = Vec::new();
    for entry in text.split(',').map(str::trim) {
        if entry.is_empty() {
            return Err(refuse(format!(
                "invalid brokers \"{}\": an empty entry",
                text.escape_debug()
            ))
            .with_hint(hint));
        }
        let bad = |why: &str| {
            refuse(format!(
                "invalid broker \"{}\": {why}",
                entry.escape_debug()
            ))
            .with_hint(hint)
        };
        let (host, port) = match entry.strip_prefix('[') {
            Some(rest) => {
                let (host, port) = rest
                    .split_once("]:")
                    .ok_or_else(|| bad("an IPv6 address is [address]:port"))?;
                host.parse::<std::net::Ipv6Addr>()
                    .map_err(|_| bad("not an IPv6 address in brackets"))?;
                (host, port)
            }
            None => entry
                .rsplit_once(':')
                .ok_or_else(|| bad("it has no port"))?,
        };
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| bad("the port is not a number from 1 to 65535"))?;
        let name_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == ':';
        if host.is_empty() || host.len() > 253 || !host.chars().all(name_char) {
            return Err(bad("the host is not a name or an address"));
        }
        if !host_allowed(host, allowlist) {
            return Err(refuse(format!(
                "broker host \"{host}\" is not in pg_outbox.kafka_allowed_brokers"
            ))
            .with_hint("a superuser sets the hosts Kafka sinks may reach"));
        }
        // An address given as such is checked now as well as at connection time.
        if let Ok(ip) = host.parse::<IpAddr>() {
            check_address(
                ip,
                Allow {
                    private_addresses: true,
                },
            )?;
        }
        brokers.push(Broker {
            host: host.to_string(),
            port,
        });
    }
    if brokers.len() > MAX_BROKERS {
        return Err(refuse(format!(
            "at most {MAX_BROKERS} brokers, not {}",
            brokers.len()
        )));
    }
    Ok(brokers)
}

/// The `bootstrap.servers` value for `brokers`.
pub fn bootstrap_servers(brokers: &[Broker]) -> String {
    brokers
        .iter()
        .map(|b| {
            if b.host.contains(':') {
                format!("[{}]:{}", b.host, b.port)
            } else {
                format!("{}:{}", b.host, b.port)
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Refuses an address a Kafka sink may not connect to: as HTTP sinks, internal addresses only
/// when a superuser allows them (`pg_outbox.kafka_allow_private`), link-local, metadata,
/// multicast and other special addresses never.
pub fn check_address(ip: IpAddr, allow: Allow) -> Result<(), Invalid> {
    match reach(ip) {
        Reach::Global => Ok(()),
        Reach::Private if allow.private_addresses => Ok(()),
        Reach::Private => Err(refuse(format!("a broker resolves to {ip}, an internal address"))
            .with_hint("private, loopback and shared (CGNAT) addresses need pg_outbox.kafka_allow_private = on (superuser only)")),
        Reach::Never => Err(refuse(format!("a broker resolves to {ip}, an address that is not globally reachable"))
            .with_hint("link-local, metadata, multicast, reserved and special-purpose addresses are refused whatever the settings")),
    }
}

/// The longest Kafka topic name.
pub const KAFKA_TOPIC_MAX: usize = 249;

fn kafka_topic_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-'
}

/// Where a sink's messages go: one Kafka topic, or one per event topic through a template with
/// `{topic}` once (`orders.{topic}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicTemplate {
    prefix: String,
    /// None: a fixed topic (the prefix).
    suffix: Option<String>,
}

impl TopicTemplate {
    pub fn parse(text: &str) -> Result<TopicTemplate, Invalid> {
        let hint = "kafka_topic is a Kafka topic name ('orders'), or a template with {topic} once ('events.{topic}'): letters, digits, '.', '_' and '-', at most 249 characters";
        let bad = |why: String| {
            refuse(format!(
                "invalid kafka_topic \"{}\": {why}",
                text.escape_debug()
            ))
            .with_hint(hint)
        };
        let (prefix, suffix) = match text.split_once("{topic}") {
            Some((p, s)) => (p, Some(s)),
            None => (text, None),
        };
        let fixed_part = format!("{prefix}{}", suffix.unwrap_or_default());
        if let Some(c) = fixed_part.chars().find(|c| !kafka_topic_char(*c)) {
            return Err(bad(format!(
                "character '{}' is not allowed",
                c.escape_debug()
            )));
        }
        if fixed_part.len() > KAFKA_TOPIC_MAX {
            return Err(bad(format!("longer than {KAFKA_TOPIC_MAX} characters")));
        }
        if suffix.is_none() && (text.is_empty() || text == "." || text == "..") {
            return Err(bad("not a topic name".into()));
        }
        Ok(TopicTemplate {
            prefix: prefix.to_string(),
            suffix: suffix.map(str::to_string),
        })
    }

    /// The Kafka topic of an event of `topic`, or why it has none (a name too long: the event
    /// cannot be delivered, and goes the way of poison).
    pub fn render(&self, topic: &str) -> Result<String, String> {
        let name = match &self.suffix {
            None => return Ok(self.prefix.clone()),
            Some(suffix) => format!("{}{topic}{suffix}", self.prefix),
        };
        if name.len() > KAFKA_TOPIC_MAX {
            return Err(format!(
                "the Kafka topic \"{name}\" would be longer than {KAFKA_TOPIC_MAX} characters"
            ));
        }
        if name == "." || name == ".." || !name.chars().all(kafka_topic_char) {
            return Err(format!("\"{name}\" is not a Kafka topic name"));
        }
        Ok(name)
    }

    pub fn is_fixed(&self) -> bool {
        self.suffix.is_none()
    }
}

/// Which field of an event becomes its message's key: one key's messages stay in one partition,
/// in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    Subject,
    Tenant,
    None,
}

impl Key {
    pub fn parse(text: &str) -> Result<Key, Invalid> {
        match text {
            "subject" => Ok(Key::Subject),
            "tenant" => Ok(Key::Tenant),
            "none" => Ok(Key::None),
            other => Err(refuse(format!("invalid key \"{}\"", other.escape_debug()))
                .with_hint("key is 'subject' (the default), 'tenant' or 'none'")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Key::Subject => "subject",
            Key::Tenant => "tenant",
            Key::None => "none",
        }
    }
}

/// Client properties a sink may set, with the values each takes (None: any value of at most
/// `PROPERTY_VALUE_MAX` bytes). Everything else is refused: a file path, a plugin or an
/// interceptor would run or read as the server, and the delivery guarantees depend on the
/// properties the worker sets itself (`FIXED_PROPERTIES`).
const ALLOWED_PROPERTIES: &[(&str, Option<&[&str]>)] = &[
    ("client.id", None),
    ("compression.type", Some(&["none", "gzip", "snappy", "lz4"])),
    ("linger.ms", None),
    ("batch.num.messages", None),
    ("batch.size", None),
    ("message.max.bytes", None),
    ("request.timeout.ms", None),
    ("socket.timeout.ms", None),
    ("socket.keepalive.enable", Some(&["true", "false"])),
    ("topic.metadata.refresh.interval.ms", None),
    (
        "partitioner",
        Some(&[
            "murmur2_random",
            "murmur2",
            "consistent_random",
            "consistent",
            "fnv1a",
            "fnv1a_random",
        ]),
    ),
    (
        "security.protocol",
        Some(&["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"]),
    ),
    (
        "sasl.mechanism",
        Some(&["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]),
    ),
    ("sasl.username", None),
    ("sasl.password", None),
    ("ssl.ca.pem", None),
    ("ssl.certificate.pem", None),
    ("ssl.key.pem", None),
    ("ssl.key.password", None),
    (
        "ssl.endpoint.identification.algorithm",
        Some(&["https", "none"]),
    ),
];

/// Properties whose values are credentials: never shown to anyone, never logged.
pub const SECRET_PROPERTIES: &[&str] = &["sasl.password", "ssl.key.pem", "ssl.key.password"];

/// The properties the worker sets on every producer, whatever the sink says: an idempotent
/// producer that waits for every in-sync replica and never leaves a gap (a message that fails
/// while a later one of its partition went through is a fatal error of the producer, which the
/// worker replaces: the window is sent again, in order, so one key's messages are never seen out
/// of order once duplicates are dropped by `ce_id`).
pub const FIXED_PROPERTIES: &[(&str, &str)] = &[
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("max.in.flight.requests.per.connection", "5"),
    ("enable.gapless.guarantee", "true"),
    // Messages never time out inside librdkafka: the worker bounds a window's wait itself, and a
    // window that fails is sent again by a new producer, once the old one and everything it still
    // held are gone (so that no late message of the old one lands after the new one's).
    ("message.timeout.ms", "0"),
    // What one broker response may hold: a producer's are small (librdkafka's 100 MB default is
    // for consumers), and the worker's memory is the database's.
    ("receive.message.max.bytes", "4194304"),
    ("fetch.max.bytes", "1048576"),
];

pub const PROPERTY_VALUE_MAX: usize = 65536;

/// The numeric properties a sink may set, with the values allowed: librdkafka accepts far more,
/// and a metadata refresh every millisecond or a request timeout of a quarter of an hour would
/// cost the database's host, or the brokers, or break the worker's timing (a window waits for
/// its acknowledgements within the sink's timeout).
const NUMERIC_BOUNDS: &[(&str, i64, i64)] = &[
    ("linger.ms", 0, 1_000),
    ("batch.num.messages", 1, 100_000),
    ("batch.size", 1, 16 * 1024 * 1024),
    ("message.max.bytes", 1_000, 16 * 1024 * 1024),
    ("request.timeout.ms", 1_000, 300_000),
    ("socket.timeout.ms", 10_000, 300_000),
    ("topic.metadata.refresh.interval.ms", 10_000, 3_600_000),
];

/// Checks a sink's `properties` (a JSON object of strings, numbers or booleans) and returns them
/// as librdkafka key/value pairs, sorted by key.
pub fn check_properties(properties: &serde_json::Value) -> Result<Vec<(String, String)>, Invalid> {
    let hint = || {
        format!(
            "properties may set {}",
            ALLOWED_PROPERTIES
                .iter()
                .map(|(k, _)| *k)
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let object = properties
        .as_object()
        .ok_or_else(|| refuse("properties must be a JSON object").with_hint(hint()))?;
    let mut out = Vec::with_capacity(object.len());
    for (key, value) in object {
        let Some((_, values)) = ALLOWED_PROPERTIES.iter().find(|(k, _)| k == key) else {
            let why = if FIXED_PROPERTIES.iter().any(|(k, _)| k == key) {
                "pg_outbox sets it itself (an idempotent producer with acks=all)"
            } else {
                "it is not one a Kafka sink may set"
            };
            return Err(refuse(format!(
                "property \"{}\" is refused: {why}",
                key.escape_debug()
            ))
            .with_hint(hint()));
        };
        let value = match value {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Number(n) => n.to_string(),
            serde_json::Value::Bool(b) => b.to_string(),
            _ => {
                return Err(refuse(format!(
                    "property \"{key}\" must be a string, a number or a boolean"
                )))
            }
        };
        if value.len() > PROPERTY_VALUE_MAX || value.contains('\0') {
            return Err(refuse(format!(
                "property \"{key}\" is too long or holds a NUL character"
            )));
        }
        if let Some(values) = values {
            if !values.contains(&value.as_str()) {
                return Err(refuse(format!(
                    "property \"{key}\" is \"{}\"",
                    value.escape_debug()
                ))
                .with_hint(format!("{key} is one of: {}", values.join(", "))));
            }
        }
        if let Some((_, min, max)) = NUMERIC_BOUNDS.iter().find(|(k, _, _)| k == key) {
            match value.parse::<i64>() {
                Ok(n) if (*min..=*max).contains(&n) => {}
                _ => {
                    return Err(refuse(format!(
                        "property \"{key}\" must be a whole number from {min} to {max}, not \"{}\"",
                        value.escape_debug()
                    )))
                }
            }
        }
        if key == "client.id"
            && (value.is_empty()
                || value.len() > KAFKA_TOPIC_MAX
                || !value.chars().all(kafka_topic_char))
        {
            return Err(refuse(format!(
                "property \"client.id\" is \"{}\"",
                value.escape_debug()
            ))
            .with_hint("client.id is 1 to 249 letters, digits, '.', '_' and '-'"));
        }
        out.push((key.clone(), value));
    }
    out.sort();
    Ok(out)
}

/// `properties` with the values of secret properties replaced, for anything a role may see.
pub fn redacted(properties: &serde_json::Value) -> serde_json::Value {
    match properties.as_object() {
        Some(object) => serde_json::Value::Object(
            object
                .iter()
                .map(|(k, v)| {
                    let v = if SECRET_PROPERTIES.contains(&k.as_str()) {
                        serde_json::Value::String("(hidden)".into())
                    } else {
                        v.clone()
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        None => serde_json::Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn brokers_are_host_port_lists_on_the_allowlist() {
        let b = parse_brokers(
            "kafka-1.example.com:9092, 10.0.0.7:9093,[2606:4700::1111]:9094",
            "",
        )
        .unwrap();
        assert_eq!(b.len(), 3);
        assert_eq!(
            bootstrap_servers(&b),
            "kafka-1.example.com:9092,10.0.0.7:9093,[2606:4700::1111]:9094"
        );
        for bad in [
            "",
            "kafka",
            "kafka:",
            "kafka:0",
            "kafka:70000",
            "kafka:x",
            ",kafka:1",
            "ka fka:1",
            "[::1:9092",
            "[nope]:1",
            "a:1,,b:2",
            "kafka/x:1",
        ] {
            assert!(parse_brokers(bad, "").is_err(), "{bad}");
        }
        assert!(parse_brokers("a.example.com:9092", "*.example.com").is_ok());
        assert!(parse_brokers("a.example.org:9092", "*.example.com").is_err());
        // Metadata and link-local addresses are refused whatever the settings.
        assert!(parse_brokers("169.254.169.254:80", "").is_err());
        assert!(parse_brokers("[fe80::1]:9092", "").is_err());
        let many = vec!["k:1"; MAX_BROKERS + 1].join(",");
        assert!(parse_brokers(&many, "").is_err());
    }

    #[test]
    fn internal_addresses_need_the_setting_and_some_never_pass() {
        let private = Allow {
            private_addresses: true,
        };
        let public = Allow {
            private_addresses: false,
        };
        assert!(check_address("127.0.0.1".parse().unwrap(), public).is_err());
        assert!(check_address("127.0.0.1".parse().unwrap(), private).is_ok());
        assert!(check_address("10.1.2.3".parse().unwrap(), public).is_err());
        assert!(check_address("169.254.169.254".parse().unwrap(), private).is_err());
        assert!(check_address("8.8.8.8".parse().unwrap(), public).is_ok());
    }

    #[test]
    fn topic_templates_map_event_topics_to_legal_kafka_topics() {
        let fixed = TopicTemplate::parse("orders").unwrap();
        assert!(fixed.is_fixed());
        assert_eq!(fixed.render("order.placed").unwrap(), "orders");
        let mapped = TopicTemplate::parse("events.{topic}.v1").unwrap();
        assert_eq!(
            mapped.render("order.placed").unwrap(),
            "events.order.placed.v1"
        );
        for bad in [
            "",
            ".",
            "..",
            "a b",
            "a/b",
            "{topic}{topic}",
            "é",
            &"a".repeat(250),
        ] {
            assert!(TopicTemplate::parse(bad).is_err(), "{bad}");
        }
        let long = TopicTemplate::parse(&format!("{}.{{topic}}", "a".repeat(240))).unwrap();
        assert!(long.render("order.placed.and.more").is_err());
        assert!(TopicTemplate::parse("{topic}")
            .unwrap()
            .render("a.b")
            .is_ok());
    }

    #[test]
    fn keys() {
        assert_eq!(Key::parse("subject").unwrap(), Key::Subject);
        assert_eq!(Key::parse("tenant").unwrap().as_str(), "tenant");
        assert!(Key::parse("Subject").is_err());
        assert!(Key::parse("").is_err());
    }

    #[test]
    fn numeric_properties_are_bounded_and_client_id_is_a_name() {
        for bad in [
            json!({"topic.metadata.refresh.interval.ms": 1}),
            json!({"linger.ms": "5000"}),
            json!({"request.timeout.ms": 900000}),
            json!({"batch.size": "lots"}),
            json!({"client.id": "a\nb"}),
            json!({"client.id": ""}),
            json!({"client.id": "x".repeat(300)}),
            json!({"message.timeout.ms": 0}),
        ] {
            assert!(check_properties(&bad).is_err(), "{bad}");
        }
        assert!(check_properties(&json!({"linger.ms": "20", "client.id": "shop-1"})).is_ok());
    }

    #[test]
    fn properties_are_an_allowlist() {
        let ok = check_properties(&json!({"linger.ms": 5, "compression.type": "lz4",
            "sasl.password": "s3cret", "socket.keepalive.enable": true}))
        .unwrap();
        assert_eq!(ok[0], ("compression.type".into(), "lz4".into()));
        assert!(ok.contains(&("linger.ms".into(), "5".into())));
        assert!(ok.contains(&("socket.keepalive.enable".into(), "true".into())));
        for bad in [
            json!([]),
            json!({"plugin.library.paths": "/tmp/x.so"}),
            json!({"ssl.key.location": "/var/lib/postgresql/server.key"}),
            json!({"acks": "1"}),
            json!({"enable.idempotence": false}),
            json!({"compression.type": "zstd"}),
            json!({"linger.ms": [1]}),
            json!({"security.protocol": "SASL_SSL "}),
            json!({"debug": "all"}),
        ] {
            assert!(check_properties(&bad).is_err(), "{bad}");
        }
        let shown = redacted(&json!({"sasl.password": "s3cret", "sasl.username": "u"}));
        assert_eq!(
            shown,
            json!({"sasl.password": "(hidden)", "sasl.username": "u"})
        );
    }
}
