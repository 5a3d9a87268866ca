//! SQL sinks: `create_sink`, `pause_sink`, `resume_sink`, `drop_sink`. Delivery is in
//! `dispatch`.

use crate::cursor::{insert_consumer, lock_cursors_shared, owned, start_cursor};
use crate::error::{Error, OrReport};
use crate::owner::{as_owner, caller};
use crate::raw::RawRegprocedure;
use crate::settings;
use pg_outbox_core::limits::{PATTERNS_MAX, PATTERNS_MAX_BYTES};
use pg_outbox_core::pattern::Pattern;
use pg_outbox_core::{http, kafka, name as names, required, Invalid, InvalidKind, Position};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

/// Refuses a handler that is not `f(<argument>)` (`outbox.event[]` for a sink, `outbox.event`
/// for a subscription) or that the caller may not execute.
pub(crate) fn check_handler(handler: pg_sys::Oid, argument: &str) {
    let row = crate::query::two::<String, String>(
        "SELECT p.oid::pg_catalog.regprocedure::text, \
                CASE WHEN p.prokind <> 'f' THEN 'must be a plain function, not a procedure or aggregate' \
                     WHEN p.pronargs <> 1 OR p.proargtypes[0] <> $2::pg_catalog.regtype \
                     THEN 'must take exactly one argument of type ' || $2 \
                     WHEN p.provariadic <> 0 THEN 'must not be VARIADIC' \
                     WHEN p.proretset THEN 'must not return a set' \
                     WHEN n.nspname LIKE 'pg\\_temp\\_%' OR n.nspname = 'pg_temp' \
                     THEN 'must not be a temporary function (it goes with the session that made it)' END \
           FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace \
          WHERE p.oid = $1",
        &[DatumWithOid::from(handler), DatumWithOid::from(argument)],
    );
    let Some((Some(name), why)) = row else {
        Error::UnknownHandler(handler.to_u32()).report()
    };
    if let Some(why) = why {
        Error::BadHandler { handler: name, why }.report();
    }
    let allowed = crate::query::one::<bool>(
        "SELECT pg_catalog.has_function_privilege($1, $2, 'EXECUTE')",
        &[DatumWithOid::from(caller()), DatumWithOid::from(handler)],
    )
    .unwrap_or(false);
    if !allowed {
        Error::HandlerNotExecutable(name).report();
    }
}

/// Compiles topic patterns into one regular expression (NULL patterns: every topic).
pub(crate) fn topic_regex(topics: Option<Vec<Option<String>>>) -> Result<Option<String>, Invalid> {
    let Some(topics) = topics else {
        return Ok(None);
    };
    if topics.is_empty() {
        return Err(
            Invalid::new(InvalidKind::Parameter, "topics must not be empty")
                .with_hint("pass NULL for a sink that receives every topic, or '{#}'"),
        );
    }
    if topics.len() > PATTERNS_MAX {
        return Err(Invalid::new(
            InvalidKind::Parameter,
            format!(
                "too many topic patterns: {}, at most {PATTERNS_MAX}",
                topics.len()
            ),
        )
        .with_hint(
            "every event is matched against each pattern; use wildcards ('order.*', 'billing.#')",
        ));
    }
    let bytes: usize = topics.iter().flatten().map(|t| t.len()).sum();
    if bytes > PATTERNS_MAX_BYTES {
        return Err(Invalid::new(
            InvalidKind::Parameter,
            format!("topic patterns too long: {bytes} bytes in all, at most {PATTERNS_MAX_BYTES}"),
        ));
    }
    let mut alternatives = Vec::with_capacity(topics.len());
    for (i, t) in topics.iter().enumerate() {
        let t = t
            .as_deref()
            .ok_or_else(|| Invalid::null(&format!("topics[{}]", i + 1)))?;
        alternatives.push(format!("({})", Pattern::parse(t)?.to_regex()));
    }
    let regex = alternatives.join("|");
    // The sink's passes match with this regex inside SQL: one PostgreSQL cannot compile would
    // fail every pass. Refuse it now.
    let compiles = crate::transaction::in_subtransaction(|| {
        crate::query::one::<bool>(
            "SELECT '' OPERATOR(pg_catalog.~) $1",
            &[DatumWithOid::from(regex.as_str())],
        )
    });
    if let Err(failure) = compiles {
        return Err(Invalid::new(
            InvalidKind::Parameter,
            format!("topic patterns cannot be matched: {}", failure.message),
        ));
    }
    Ok(Some(regex))
}

/// The part of registering any sink that its kind does not change: checks the id, topics and
/// batch size, creates the cursor and the sinks row. Returns the starting cursor.
fn register(
    id: &str,
    kind: &str,
    handler: Option<pg_sys::Oid>,
    topics: Option<Vec<Option<String>>>,
    batch_size: Option<i32>,
    start_at: Option<&str>,
) -> Position {
    if !crate::worker::preloaded() {
        Error::NotPreloaded.report();
    }
    names::validate("sink", id).or_report();
    let patterns = topics.clone();
    let regex = topic_regex(topics).or_report();
    let batch_size = batch_size.unwrap_or_else(|| settings::BATCH_SIZE.get());
    if !(1..=10_000).contains(&batch_size) {
        Error::from(Invalid::new(
            InvalidKind::Parameter,
            format!("batch_size must be between 1 and 10000, not {batch_size}"),
        ))
        .report();
    }
    lock_cursors_shared();
    let cursor = start_cursor(start_at);
    if !insert_consumer(id, "sink", cursor, caller()) {
        Error::ConsumerExists(id.into()).report();
    }
    as_owner(|| {
        Spi::run_with_args(
            "INSERT INTO outbox.sinks (id, kind, handler, topics, topic_regex, batch_size, current_batch) \
             VALUES ($1, $6, $2, $3, $4, $5, $5)",
            &[
                DatumWithOid::from(id),
                // SAFETY: an oid datum typed as regprocedure, which is an oid.
                unsafe { DatumWithOid::new(handler, pg_sys::REGPROCEDUREOID) },
                DatumWithOid::from(patterns),
                DatumWithOid::from(regex),
                DatumWithOid::from(batch_size),
                DatumWithOid::from(kind),
            ],
        )
    })
    .unwrap_or_else(|e| panic!("creating sink: {e}"));
    crate::worker::wake_at_commit_always();
    cursor
}

/// Registers a SQL sink: the worker calls `handler(outbox.event[])` with batches of the events
/// whose topic matches `topics` (NULL: all), as the role that registered it, and moves the sink's
/// cursor in the same transaction. Returns the starting cursor.
#[pg_extern(volatile, parallel_unsafe)]
fn create_sink(
    id: Option<&str>,
    handler: Option<RawRegprocedure>,
    topics: default!(Option<Vec<Option<String>>>, "NULL"),
    batch_size: default!(Option<i32>, "NULL"),
    start_at: default!(Option<&str>, "'origin'"),
) -> String {
    let id = required(id, "id").or_report();
    names::validate("sink", id).or_report();
    let handler = required(handler, "handler").or_report().oid();
    check_handler(handler, "outbox.event[]");
    register(id, "sql", Some(handler), topics, batch_size, start_at).to_string()
}

/// Registers an HTTP sink: the worker POSTs batches of the events whose topic matches `topics`
/// to `url` as CloudEvents JSON, signed when `secret` is set. Returns the starting cursor.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::too_many_arguments)]
fn create_http_sink(
    id: Option<&str>,
    url: Option<&str>,
    topics: default!(Option<Vec<Option<String>>>, "NULL"),
    batch_size: default!(Option<i32>, "NULL"),
    headers: default!(Option<pgrx::JsonB>, "NULL"),
    secret: default!(Option<&str>, "NULL"),
    timeout_ms: default!(Option<i32>, "NULL"),
    start_at: default!(Option<&str>, "'origin'"),
) -> String {
    // Whatever fails from here on, the log must not show the statement: it may hold a secret,
    // headers, or a url whose path is a credential (many webhook urls are).
    crate::secrets::hide_statement_until_transaction_end();
    let id = required(id, "id").or_report();
    names::validate("sink", id).or_report();
    let url = required(url, "url").or_report();
    let destination = http::Destination::parse(url, settings::http_allow()).or_report();
    http::check_host(&destination.url, &settings::http_allowed_hosts()).or_report();
    let headers = match headers.map(|h| h.0) {
        None => serde_json::Map::new(),
        Some(serde_json::Value::Object(map)) => map,
        Some(_) => Error::from(Invalid::new(
            InvalidKind::Parameter,
            "headers must be a JSON object of strings",
        ))
        .report(),
    };
    for (name, value) in &headers {
        let value = value.as_str().unwrap_or_else(|| {
            Error::from(Invalid::new(
                InvalidKind::Parameter,
                format!("header \"{name}\" must be a string"),
            ))
            .report()
        });
        http::check_header(name, value).or_report();
    }
    if let Some(secret) = secret {
        http::Secret::parse(secret).or_report();
    }
    let timeout_ms = timeout_ms.unwrap_or_else(|| settings::HTTP_TIMEOUT_MS.get());
    if !(100..=600_000).contains(&timeout_ms) {
        Error::from(Invalid::new(
            InvalidKind::Parameter,
            format!("timeout_ms must be between 100 and 600000, not {timeout_ms}"),
        ))
        .report();
    }
    let cursor = register(id, "http", None, topics, batch_size, start_at);
    as_owner(|| {
        Spi::run_with_args(
            "INSERT INTO outbox.http_sinks (id, url, headers, secret, timeout_ms) VALUES ($1, $2, $3, $4, $5)",
            &[
                DatumWithOid::from(id),
                DatumWithOid::from(destination.url.as_str()),
                DatumWithOid::from(pgrx::JsonB(serde_json::Value::Object(headers))),
                DatumWithOid::from(secret),
                DatumWithOid::from(timeout_ms),
            ],
        )
    })
    .unwrap_or_else(|e| panic!("creating http sink: {e}"));
    cursor.to_string()
}

/// Registers a Kafka sink: the worker produces the events whose topic matches `topics` (NULL:
/// all) to `kafka_topic` on `brokers`, one message per event (CloudEvents binary mode: the
/// payload as value, the attributes as `ce_*` headers), keyed by the event's subject (or tenant,
/// or nothing). `kafka_topic` is a Kafka topic, or a template with `{topic}`, the event's topic.
/// `properties` are librdkafka settings from an allowlist (TLS, SASL, compression, batching).
/// Returns the starting cursor.
#[pg_extern(volatile, parallel_unsafe)]
#[allow(clippy::too_many_arguments)]
fn create_kafka_sink(
    id: Option<&str>,
    brokers: Option<&str>,
    kafka_topic: Option<&str>,
    topics: default!(Option<Vec<Option<String>>>, "NULL"),
    key: default!(Option<&str>, "'subject'"),
    batch_size: default!(Option<i32>, "NULL"),
    properties: default!(Option<pgrx::JsonB>, "'{}'"),
    timeout_ms: default!(Option<i32>, "30000"),
    start_at: default!(Option<&str>, "'origin'"),
) -> String {
    // Whatever fails from here on, the log must not show the statement: properties may hold a
    // password or a private key.
    crate::secrets::hide_statement_until_transaction_end();
    let id = required(id, "id").or_report();
    names::validate("sink", id).or_report();
    let brokers = required(brokers, "brokers").or_report();
    let parsed = kafka::parse_brokers(brokers, &settings::kafka_allowed_brokers()).or_report();
    for broker in &parsed {
        if let Ok(ip) = broker.host.parse::<std::net::IpAddr>() {
            kafka::check_address(ip, settings::kafka_allow()).or_report();
        }
    }
    kafka::TopicTemplate::parse(required(kafka_topic, "kafka_topic").or_report()).or_report();
    let key = kafka::Key::parse(required(key, "key").or_report()).or_report();
    let properties = properties
        .map(|p| p.0)
        .unwrap_or_else(|| serde_json::Value::Object(Default::default()));
    kafka::check_properties(&properties).or_report();
    let timeout_ms = required(timeout_ms, "timeout_ms").or_report();
    if !(1_000..=600_000).contains(&timeout_ms) {
        Error::from(Invalid::new(
            InvalidKind::Parameter,
            format!("timeout_ms must be between 1000 and 600000, not {timeout_ms}"),
        ))
        .report();
    }
    let cursor = register(id, "kafka", None, topics, batch_size, start_at);
    as_owner(|| {
        Spi::run_with_args(
            "INSERT INTO outbox.kafka_sinks (id, brokers, kafka_topic, key, properties, timeout_ms) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            &[
                DatumWithOid::from(id),
                DatumWithOid::from(kafka::bootstrap_servers(&parsed).as_str()),
                DatumWithOid::from(kafka_topic),
                DatumWithOid::from(key.as_str()),
                DatumWithOid::from(pgrx::JsonB(properties)),
                DatumWithOid::from(timeout_ms),
            ],
        )
    })
    .unwrap_or_else(|e| panic!("creating kafka sink: {e}"));
    cursor.to_string()
}

fn owned_sink(id: Option<&str>, action: &'static str) -> String {
    let (name, found) = owned("sink", id, action);
    if found.kind != "sink" {
        Error::NotASink(name).report();
    }
    name
}

fn set_paused(id: &str, paused: bool) {
    as_owner(|| {
        Spi::run_with_args(
            "UPDATE outbox.sinks SET paused = $2 WHERE id = $1",
            &[DatumWithOid::from(id), DatumWithOid::from(paused)],
        )
    })
    .unwrap_or_else(|e| panic!("updating sink: {e}"));
}

/// Stops deliveries to a sink; its cursor stays where it is and holds the log.
#[pg_extern(volatile, parallel_unsafe)]
fn pause_sink(id: Option<&str>) {
    let id = owned_sink(id, "pause");
    set_paused(&id, true);
}

/// Resumes deliveries to a paused sink (and ends a back-off: the next pass tries at once).
#[pg_extern(volatile, parallel_unsafe)]
fn resume_sink(id: Option<&str>) {
    let id = owned_sink(id, "resume");
    set_paused(&id, false);
    as_owner(|| {
        Spi::run_with_args(
            "UPDATE outbox.sinks SET next_attempt_at = NULL WHERE id = $1",
            &[DatumWithOid::from(id.as_str())],
        )
    })
    .unwrap_or_else(|e| panic!("updating sink: {e}"));
    crate::worker::wake_at_commit_always();
}

/// Changes options of a sink after its creation (see `pg_outbox_core::options`): its owner's
/// call, like pause and resume. The workers take the new options at the sink's next pass.
#[pg_extern(volatile, parallel_unsafe)]
fn alter_sink(id: Option<&str>, options: Option<pgrx::JsonB>) {
    let id = owned_sink(id, "alter");
    let options = required(options, "options").or_report();
    let options = pg_outbox_core::options::parse(&options.0).or_report();
    if let Some(on) = options.synchronous_commit {
        as_owner(|| {
            Spi::run_with_args(
                "UPDATE outbox.sinks SET synchronous_commit = $2 WHERE id = $1",
                &[DatumWithOid::from(id.as_str()), DatumWithOid::from(on)],
            )
        })
        .unwrap_or_else(|e| panic!("updating sink: {e}"));
    }
    if let Some(ticks) = options.read_by_ticks {
        read_by(&id, ticks);
    }
}

/// Sets how a sink reads the log (`read_by`): a sink of any kind may read by ticks, and one that
/// does goes on doing so (its cursor is a batch; a rewind puts it back at a position of the
/// horizon's, from which it starts a batch again).
fn read_by(id: &str, ticks: bool) {
    let now = as_owner(|| {
        Spi::get_one_with_args::<String>(
            "SELECT c.read_by FROM outbox.consumers c WHERE c.name = $1",
            &[DatumWithOid::from(id)],
        )
    })
    .unwrap_or_else(|e| panic!("reading sink: {e}"))
    .unwrap_or_default();
    let why = match (ticks, now.as_str()) {
        (true, _) | (false, "horizon") => None,
        (false, _) => Some("reads by ticks and cannot go back to the read horizon"),
    };
    if let Some(why) = why {
        Error::ReadBy {
            what: "sink",
            name: id.to_string(),
            why,
        }
        .report();
    }
    as_owner(|| {
        Spi::run_with_args(
            "UPDATE outbox.consumers SET read_by = $2 WHERE name = $1",
            &[
                DatumWithOid::from(id),
                DatumWithOid::from(if ticks { "ticks" } else { "horizon" }),
            ],
        )
    })
    .unwrap_or_else(|e| panic!("updating sink: {e}"));
    if ticks {
        // The workers tick once it reads by ticks (crate::ticks::wanted): soon, not at a poll.
        crate::worker::wake_at_commit_always();
    }
}

/// Drops a sink, its cursor and its dead letters.
#[pg_extern(volatile, parallel_unsafe)]
fn drop_sink(id: Option<&str>) {
    let id = owned_sink(id, "drop");
    as_owner(|| {
        Spi::run_with_args(
            "DELETE FROM outbox.consumers WHERE name = $1",
            &[DatumWithOid::from(id.as_str())],
        )
    })
    .unwrap_or_else(|e| panic!("dropping sink: {e}"));
}
