//! Every setting of pg_outbox: its default, its context, and why.
//!
//! Times are integers with units, so `SET pg_outbox.poll_interval = '250ms'` and `'2s'` both work.

use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting, PostgresGucEnum};
use std::ffi::CString;
use std::time::Duration;

/// Which databases get delivery: comma-separated names; empty (the default): every database where
/// pg_outbox is installed. The launcher starts workers only in these; a worker whose database
/// leaves the list exits at the next reload.
pub static DATABASES: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c""));

/// Workers each database with pg_outbox keeps, however idle. One serves every sink of a database
/// whose handlers are quick; more start while handlers are slow (see `MAX_WORKERS`).
pub static MIN_WORKERS: GucSetting<i32> = GucSetting::<i32>::new(1);

/// Workers of the whole cluster at most (the launcher not counted). While every worker of a
/// database is inside a handler, the launcher starts another for it, up to this; an extra
/// worker that finds nothing to do for a while exits. The default leaves room within PostgreSQL's
/// default `max_worker_processes` (8) for the launcher, logical replication and parallel query.
pub static MAX_WORKERS: GucSetting<i32> = GucSetting::<i32>::new(4);
/// The shared-memory slots of workers: the highest `pg_outbox.max_workers`.
pub const WORKER_SLOTS: usize = 64;

/// The fallback poll: a commit wakes the worker at once through its latch, so this only matters
/// for work that no commit announces (back-off expiry, events another server raised via replica).
pub static POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);

/// Events a new sink is handed per pass unless `create_sink` says otherwise: big enough to
/// amortise a transaction per batch, small enough that a failing batch bisects in 7 steps.
pub static BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(128);

/// How many events one pass of a SQL sink may hand over, in batches of its batch size, before it
/// commits: the batches after the first go on in the same transaction while they come full, each
/// handler call in its own subtransaction, so a backlog costs one commit per pass, not per batch.
pub static PASS_MAX_EVENTS: GucSetting<i32> = GucSetting::<i32>::new(4096);

/// How long one pass of a SQL sink may go on handing over further batches (see
/// `PASS_MAX_EVENTS`). A pass holds a transaction id once its handler writes, and that holds back
/// the read horizon of every reader: this bounds how long. 0: one batch per pass.
pub static PASS_MAX_TIME_MS: GucSetting<i32> = GucSetting::<i32>::new(50);

/// The cap of the doubling back-off of a lone failing event (DESIGN: 1 s doubling to 5 min).
pub static MAX_BACKOFF_S: GucSetting<i32> = GucSetting::<i32>::new(300);

/// Failures of a lone event before its neighbour is tested (and it may be dead-lettered).
pub static POISON_AFTER: GucSetting<i32> = GucSetting::<i32>::new(5);

/// How long one call of a sink handler may run before it is cancelled and counted as a failure.
pub static SINK_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(30_000);

/// How long delivered events stay in the log (for new consumers starting at the origin, replay
/// and audit) before pruning may delete them.
pub static RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);

/// How often the worker prunes.
pub static PRUNE_INTERVAL_S: GucSetting<i32> = GucSetting::<i32>::new(3600);

/// HTTP sinks may post to plain http:// URLs. Superuser only: it lets credentials and events
/// cross the network in clear.
pub static HTTP_ALLOW_PLAIN: GucSetting<bool> = GucSetting::<bool>::new(false);

/// HTTP sinks may reach private, loopback, link-local, multicast and cloud-metadata addresses.
/// Superuser only: otherwise any role allowed to create a sink could probe the server's own
/// network (and its metadata service) through the worker.
pub static HTTP_ALLOW_PRIVATE: GucSetting<bool> = GucSetting::<bool>::new(false);

/// Hosts HTTP sinks may reach: comma-separated names or `*.suffix` patterns; empty: any host
/// the address rules allow. Superuser only.
pub static HTTP_ALLOWED_HOSTS: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c""));

/// Kafka sinks may connect to private, loopback and shared (CGNAT) addresses. Superuser only.
pub static KAFKA_ALLOW_PRIVATE: GucSetting<bool> = GucSetting::<bool>::new(false);

/// Broker hosts Kafka sinks may name: comma-separated names or `*.suffix` patterns; empty: any
/// host the address rules allow. Superuser only.
pub static KAFKA_ALLOWED_BROKERS: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c""));

/// Connecting to an HTTP sink may take this long before the attempt counts as a transient failure.
pub static HTTP_CONNECT_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(3_000);

/// The default whole-request timeout of an HTTP sink (create_http_sink can set its own).
pub static HTTP_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(10_000);

/// The longest any HTTP sink's request may take, whatever its own timeout_ms says: a tenant's
/// endpoint that accepts and never answers holds a lease (and a thread) that long.
pub static HTTP_MAX_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(30_000);

/// Most bytes of payloads and headers (uncompressed) one window the workers read may hold: a
/// sink's batch, an HTTP request's body, a fan-out pass. A window always holds one event at least
/// (at most `max_event_size`). Bounds what one pass holds in memory whatever the events are.
pub static MAX_BATCH_BYTES: GucSetting<i32> = GucSetting::<i32>::new(16 * 1024 * 1024);

/// Bytes of a response body read (and discarded) at most: a webhook answers with a status.
pub static HTTP_MAX_RESPONSE_BYTES: GucSetting<i32> = GucSetting::<i32>::new(65_536);

/// The most bytes an event's payload and headers may hold together, uncompressed. Every sink and
/// filter handles events whole: an event of 100 MB is a batch of 100 MB for each of them, and two
/// events that compressed to 3 MB once expanded past jsonb's limit while an HTTP batch was built
/// and wedged the sink (issue #10). 1 MB is ample for events; documents belong in tables.
pub static MAX_EVENT_SIZE: GucSetting<i32> = GucSetting::<i32>::new(1024 * 1024);

/// How the readers created from now on read the log (each keeps its own mode: `read_by` of
/// outbox.consumers, turned from horizon to ticks by alter_sink, alter_consumer and
/// alter_subscription).
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum ReadBy {
    #[name = c"horizon"]
    Horizon,
    #[name = c"ticks"]
    Ticks,
}

pub static READ_BY: GucSetting<ReadBy> = GucSetting::<ReadBy>::new(ReadBy::Horizon);

/// Off: workers stay connected but deliver nothing (maintenance windows).
pub static ENABLED: GucSetting<bool> = GucSetting::<bool>::new(true);

/// Defines the settings (in every process that loads the library: all of them may be set with
/// or without the workers).
pub fn init() {
    GucRegistry::define_enum_guc(
        c"pg_outbox.read_by",
        c"How sinks, pull consumers and subscriptions created from now on read the log: by the read horizon or by ticks.",
        c"Each reader keeps the mode it was created with; alter_sink, alter_consumer and alter_subscription turn one to ticks. A superuser's choice (for a database: ALTER DATABASE ... SET): reading by ticks makes the workers tick every round.",
        &READ_BY,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"pg_outbox.databases",
        c"Databases where the pg_outbox workers deliver (comma-separated; empty: every database with pg_outbox).",
        c"A database leaves or joins delivery at the next reload.",
        &DATABASES,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.min_workers",
        c"Workers each database with pg_outbox keeps running.",
        c"",
        &MIN_WORKERS,
        1,
        16,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.max_workers",
        c"Workers of the whole cluster at most (the launcher not counted).",
        c"Extra workers start while every worker of a database is busy in a handler.",
        &MAX_WORKERS,
        1,
        WORKER_SLOTS as i32,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.poll_interval",
        c"How long an idle worker sleeps when no commit wakes it.",
        c"",
        &POLL_INTERVAL_MS,
        10,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.pass_max_events",
        c"Events one pass of a SQL sink may hand over in successive batches before it commits.",
        c"",
        &PASS_MAX_EVENTS,
        1,
        1_000_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.pass_max_time",
        c"How long one pass of a SQL sink may go on handing over further batches before it commits (0: one batch per pass).",
        c"",
        &PASS_MAX_TIME_MS,
        0,
        60_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.batch_size",
        c"Events per delivery of a sink created without a batch size.",
        c"",
        &BATCH_SIZE,
        1,
        10_000,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.max_backoff",
        c"Longest wait between retries of a failing event.",
        c"",
        &MAX_BACKOFF_S,
        1,
        86_400,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.poison_after",
        c"Failures of a lone event before its neighbour is tested.",
        c"",
        &POISON_AFTER,
        1,
        1000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.sink_timeout",
        c"Longest a sink handler may run on one batch.",
        c"",
        &SINK_TIMEOUT_MS,
        10,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.retention",
        c"How long events stay in the log after every consumer has passed them.",
        c"",
        &RETENTION_S,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.prune_interval",
        c"How often the worker prunes the log.",
        c"",
        &PRUNE_INTERVAL_S,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_bool_guc(
        c"pg_outbox.http_allow_plain",
        c"Whether HTTP sinks may use plain http:// URLs.",
        c"",
        &HTTP_ALLOW_PLAIN,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"pg_outbox.http_allow_private",
        c"Whether HTTP sinks may reach private, loopback, link-local and metadata addresses.",
        c"",
        &HTTP_ALLOW_PRIVATE,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"pg_outbox.kafka_allow_private",
        c"Whether Kafka sinks may connect to private, loopback and shared (CGNAT) addresses.",
        c"Link-local, metadata, multicast and reserved addresses are refused whatever this says. Every connection the producer opens is checked, to the brokers the cluster's metadata names too.",
        &KAFKA_ALLOW_PRIVATE,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"pg_outbox.kafka_allowed_brokers",
        c"Broker hosts Kafka sinks may name (comma-separated names or *.suffix patterns; empty: any).",
        c"",
        &KAFKA_ALLOWED_BROKERS,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"pg_outbox.http_allowed_hosts",
        c"Hosts HTTP sinks may reach (comma-separated names or *.suffix patterns; empty: any).",
        c"",
        &HTTP_ALLOWED_HOSTS,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.http_connect_timeout",
        c"Longest an HTTP sink's connection attempt may take.",
        c"",
        &HTTP_CONNECT_TIMEOUT_MS,
        100,
        600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.http_timeout",
        c"Default whole-request timeout of an HTTP sink.",
        c"",
        &HTTP_TIMEOUT_MS,
        100,
        600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.max_event_size",
        c"Most bytes of payload and headers one event may hold (uncompressed).",
        c"raise and raise_many refuse a larger event (54000).",
        &MAX_EVENT_SIZE,
        1024,
        64 * 1024 * 1024,
        GucContext::Suset,
        GucFlags::UNIT_BYTE,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.max_batch_bytes",
        c"Most bytes of payloads and headers (uncompressed) in one window the workers read.",
        c"A sink's batch, an HTTP request or a fan-out pass stops before this many bytes (one event at least).",
        &MAX_BATCH_BYTES,
        64 * 1024,
        1024 * 1024 * 1024,
        GucContext::Sighup,
        GucFlags::UNIT_BYTE,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.http_max_timeout",
        c"Longest any HTTP sink's request may take (caps each sink's timeout_ms).",
        c"",
        &HTTP_MAX_TIMEOUT_MS,
        100,
        600_000,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"pg_outbox.http_max_response",
        c"Bytes of an HTTP sink's response body read at most.",
        c"",
        &HTTP_MAX_RESPONSE_BYTES,
        0,
        16 * 1024 * 1024,
        GucContext::Sighup,
        GucFlags::UNIT_BYTE,
    );
    GucRegistry::define_bool_guc(
        c"pg_outbox.enabled",
        c"Whether the workers deliver.",
        c"",
        &ENABLED,
        GucContext::Sighup,
        GucFlags::default(),
    );
}

/// Whether the workers deliver in database `name` (see `DATABASES`).
pub fn serves(name: &str) -> bool {
    let list = DATABASES
        .get()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    list.trim().is_empty() || list.split(',').any(|d| d.trim() == name)
}

pub fn ms(setting: &GucSetting<i32>) -> Duration {
    Duration::from_millis(setting.get().max(0) as u64)
}

pub fn secs(setting: &GucSetting<i32>) -> Duration {
    Duration::from_secs(setting.get().max(0) as u64)
}

/// The host allowlist as configured now ("" allows every host).
pub fn http_allowed_hosts() -> String {
    HTTP_ALLOWED_HOSTS
        .get()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The destination rules as configured now.
pub fn kafka_allowed_brokers() -> String {
    KAFKA_ALLOWED_BROKERS
        .get()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

pub fn kafka_allow() -> pg_outbox_core::kafka::Allow {
    pg_outbox_core::kafka::Allow {
        private_addresses: KAFKA_ALLOW_PRIVATE.get(),
    }
}

pub fn http_allow() -> pg_outbox_core::http::Allow {
    pg_outbox_core::http::Allow {
        plain_http: HTTP_ALLOW_PLAIN.get(),
        private_addresses: HTTP_ALLOW_PRIVATE.get(),
    }
}

/// The failure policy as configured now, for a sink of `max_batch`.
pub fn policy(max_batch: u32) -> pg_outbox_core::policy::Policy {
    pg_outbox_core::policy::Policy {
        max_batch,
        first_backoff: Duration::from_secs(1),
        max_backoff: secs(&MAX_BACKOFF_S),
        poison_after: POISON_AFTER.get().max(1) as u32,
    }
}
