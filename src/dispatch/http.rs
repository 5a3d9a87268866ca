//! One delivery pass of a remote sink: an HTTP sink, or a Kafka sink (`dispatch::kafka`).
//!
//! Unlike a SQL sink, the network call must happen with no transaction open. So a pass is:
//! transaction 1 takes the sink's lease (in the workers' shared memory, which outlives the
//! transaction), reads a window with the read rule and renders it (a CloudEvents batch for HTTP,
//! one message per event for Kafka); the POST, or the produce and the wait for every
//! acknowledgement, runs on a thread of its own that never calls Postgres; transaction 2 records
//! the outcome (cursor, failure policy, dead letter) and the lease is released. A worker that
//! dies releases the lease with its session. The cursor moves only after a 2xx, or once every
//! message of the window is acknowledged: at least once.

use super::{save_state, PassResult};
use crate::cursor::{At, Batch};
use crate::plans;
use crate::settings;
use crate::transaction::{in_transaction, Failure};
use pg_outbox_core::http::{self, Outcome, Secret};
use pg_outbox_core::policy::{AfterFailure, AfterNeighbour, SinkState};
use pg_outbox_core::Position;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One request, with everything it needs and nothing from Postgres.
struct Request {
    url: String,
    headers: Vec<(String, String)>,
    secret: Option<String>,
    key: String,
    body: String,
}

/// Where a remote sink's windows go.
#[derive(Clone)]
enum Transport {
    Http {
        url: String,
        headers: Vec<(String, String)>,
        secret: Option<String>,
    },
    Kafka {
        /// `host:port,...` as created (checked again against the allowlist at each pass).
        brokers: String,
        target: super::kafka::Target,
        /// The sink's properties, checked (`pg_outbox_core::kafka::check_properties`); None when
        /// the stored ones no longer pass (the pass fails, saying why).
        properties: Result<Vec<(String, String)>, String>,
    },
}

#[derive(Clone)]
struct Sink {
    id: String,
    /// Key of the session-level lease this pass holds.
    lease_key: i32,
    /// The cursor's rewind count when read: a save after a rewind (or for a sink dropped and
    /// created again under the same name) must not apply.
    rewinds: i64,
    /// Off: the transaction that records a delivered window does not wait for the WAL flush.
    synchronous_commit: bool,
    /// The sink's topics compiled (NULL: every topic).
    topic_regex: Option<String>,
    /// Consecutive transient failures (5xx, timeouts, refused connections).
    transient: u32,
    max_batch: u32,
    state: SinkState,
    /// Where it is: by the read horizon, or within a batch when it reads by ticks.
    cursor: At,
    /// It reads by ticks (`read_by`).
    by_ticks: bool,
    transport: Transport,
    timeout_ms: i32,
}

impl Sink {
    fn is_kafka(&self) -> bool {
        matches!(self.transport, Transport::Kafka { .. })
    }

    /// `http sink "id"` or `kafka sink "id"`, for the server log.
    fn label(&self) -> String {
        let kind = if self.is_kafka() { "kafka" } else { "http" };
        format!("{kind} sink \"{}\"", self.id)
    }
}

/// A window rendered for the wire.
struct Window {
    count: usize,
    last: Option<Position>,
    /// The batch it was read in (a sink that reads by ticks; a window never spans batches).
    batch: Option<Batch>,
    /// It ended its batch short and a later tick is taken: the sink has more to read now.
    more: bool,
    matching: usize,
    body: Option<String>,
    ids: Vec<String>,
}

impl Window {
    fn empty(batch: Option<Batch>) -> Window {
        Window {
            count: 0,
            last: None,
            batch,
            more: false,
            matching: 0,
            body: None,
            ids: Vec::new(),
        }
    }

    /// Where the sink is once this window is delivered.
    fn end(&self) -> Option<At> {
        self.last.map(|pos| At {
            pos,
            batch: self.batch.clone(),
        })
    }

    /// More events may wait behind it for a sink whose windows are of `batch` events.
    fn full(&self, batch: u32) -> bool {
        self.count as u32 >= batch || self.more
    }
}

enum Prepared {
    Absent,
    Contended,
    /// The window, and for a Kafka sink with a backlog the windows after it, read in the same
    /// transaction to chain behind it.
    Ready(Box<(Sink, Window, Vec<Window>)>),
    /// A dead letter marked for replay: it goes first, alone.
    Replay(Box<(Sink, Position, Window)>),
    /// The window (its event count and where it ends) could not be rendered, for this reason.
    Unreadable(Box<(Sink, (usize, Option<At>), String)>),
}

/// A window chained behind the windows of a Kafka sink in flight (`InFlight::chain_after`): it
/// reads on from the last of them, under their lease, into their producer.
pub struct Chain {
    after: At,
    lease_key: i32,
    rewinds: i64,
    producer: std::sync::Arc<super::kafka::Producer>,
}

fn lease_and_read(id: &str, chain: Option<&Chain>, flying: usize) -> Prepared {
    let after = chain.map(|c| c.after.clone());
    // The lease goes back when no window flies, and stays with the windows in flight else.
    let unlock = |key: i32| {
        if chain.is_none() {
            unlock(key)
        }
    };
    if !super::lock_tables() {
        return Prepared::Absent;
    }
    Spi::connect(|client| {
        let key = plans::select(
            client,
            "SELECT s.lease_key FROM outbox.sinks s \
              WHERE s.id OPERATOR(pg_catalog.=) $1 AND s.kind OPERATOR(pg_catalog.<>) 'sql'",
            Some(1),
            &[DatumWithOid::from(id)],
        )?;
        if key.is_empty() {
            return Ok(Prepared::Absent);
        }
        let lease_key = key.first().get_one::<i32>()?.expect("lease_key is NOT NULL");
        if chain.is_some_and(|c| c.lease_key != lease_key) {
            // Dropped and made again meanwhile: the windows in flight belong to the old one.
            return Ok(Prepared::Absent);
        }
        // A role's own change to the sink holds its lock until that transaction ends
        // (`cursor::owned`): nothing more is sent meanwhile, so nothing lands to be recorded
        // into the rows that change holds.
        if !crate::lease::try_xact(crate::lease::Class::Sink, lease_key)
            || !crate::worker::try_http_lease(lease_key)
        {
            return Ok(Prepared::Contended);
        }
        crate::transaction::refresh_snapshot();
        let rows = plans::select(
            client,
            "SELECT s.batch_size, s.current_batch, s.attempts, c.txid::text, c.seq, \
                    h.url, h.headers::text, h.secret, coalesce(h.timeout_ms, k.timeout_ms), c.rewinds, \
                    s.transient, c.owner, k.brokers, k.kafka_topic, k.key, k.properties::text, \
                    pg_catalog.current_database()::text, s.synchronous_commit, s.topic_regex, \
                    c.read_by = 'ticks', c.tick, c.since::text, c.upto::text \
               FROM outbox.sinks s JOIN outbox.consumers c ON c.name = s.id \
               LEFT JOIN outbox.http_sinks h ON h.id = s.id \
               LEFT JOIN outbox.kafka_sinks k ON k.id = s.id \
              WHERE s.id = $1 AND NOT s.paused AND (h.id IS NOT NULL OR k.id IS NOT NULL) \
                AND (s.next_attempt_at IS NULL OR s.next_attempt_at <= pg_catalog.now())",
            Some(1),
            &[DatumWithOid::from(id)],
        )?;
        if rows.is_empty() {
            // Paused or backing off after all: give the lease back now.
            unlock(lease_key);
            return Ok(Prepared::Absent);
        }
        let r = rows.first();
        let owner: pg_sys::Oid = r.get(12)?.expect("owner");
        if !crate::owner::role_exists(owner) {
            super::pause_orphan(id, owner)?;
            unlock(lease_key);
            return Ok(Prepared::Absent);
        }
        let txid: String = r.get(4)?.expect("txid");
        let transport = match r.get::<String>(13)? {
            Some(brokers) => {
                let template: String = r.get(14)?.expect("kafka_topic");
                let key: String = r.get(15)?.expect("key");
                let properties: String = r.get(16)?.expect("properties");
                let database: String = r.get(17)?.expect("database");
                let properties = serde_json::from_str::<serde_json::Value>(&properties)
                    .map_err(|e| e.to_string())
                    .and_then(|p| {
                        pg_outbox_core::kafka::check_properties(&p).map_err(|e| e.message)
                    });
                let target = pg_outbox_core::kafka::TopicTemplate::parse(&template)
                    .and_then(|t| pg_outbox_core::kafka::Key::parse(&key).map(|k| (t, k)));
                match target {
                    Ok((template, key)) => Transport::Kafka {
                        brokers,
                        target: super::kafka::Target {
                            template,
                            key,
                            source: format!("/pg_outbox/{}", super::kafka::source_name(&database)),
                        },
                        properties,
                    },
                    Err(e) => {
                        let why = format!(
                            "paused: its stored configuration is invalid ({}); drop the sink and create it again",
                            e.message
                        );
                        pgrx::warning!("pg_outbox: kafka sink \"{id}\" {why}");
                        Spi::run_with_args(
                            "UPDATE outbox.sinks SET paused = true, last_error = $2, last_sqlstate = '22023', \
                                    last_error_at = pg_catalog.now() WHERE id = $1",
                            &[DatumWithOid::from(id), DatumWithOid::from(why.as_str())],
                        )?;
                        unlock(lease_key);
                        return Ok(Prepared::Absent);
                    }
                }
            }
            None => {
                let headers: String = r.get(7)?.expect("headers");
                let headers: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_str(&headers).expect("http_sinks.headers is a JSON object");
                Transport::Http {
                    url: r.get(6)?.expect("url"),
                    headers: headers
                        .into_iter()
                        .map(|(k, v)| (k, v.as_str().unwrap_or_default().to_string()))
                        .collect(),
                    secret: r.get(8)?,
                }
            }
        };
        let mut sink = Sink {
            id: id.to_string(),
            lease_key,
            rewinds: r.get(10)?.expect("rewinds"),
            synchronous_commit: r.get(18)?.expect("synchronous_commit is NOT NULL"),
            topic_regex: r.get(19)?,
            transient: r.get::<i32>(11)?.expect("transient").max(0) as u32,
            max_batch: r.get::<i32>(1)?.expect("batch_size").max(1) as u32,
            state: SinkState {
                batch: r.get::<i32>(2)?.expect("current_batch").max(1) as u32,
                attempts: r.get::<i32>(3)?.expect("attempts").max(0) as u32,
            },
            cursor: At {
                pos: Position::new(txid.parse().expect("xid8"), r.get(5)?.expect("seq")),
                batch: match (r.get::<i64>(21)?, r.get(22)?, r.get(23)?) {
                    (Some(tick), Some(since), Some(upto)) => Some(Batch { tick, since, upto }),
                    _ => None,
                },
            },
            by_ticks: r.get(20)?.expect("read_by is NOT NULL"),
            transport,
            // Capped by the superuser's setting, whatever the sink asked for.
            timeout_ms: r
                .get::<i32>(9)?
                .expect("timeout_ms")
                .min(settings::HTTP_MAX_TIMEOUT_MS.get()),
        };
        let body = if sink.is_kafka() {
            kafka_frame("(d.event).{}")
        } else {
            "pg_catalog.jsonb_build_array(outbox._cloudevent(d.event))::text".into()
        };
        if let Some(chain) = chain {
            if chain.rewinds != sink.rewinds {
                // Rewound meanwhile: the windows in flight are not recorded, and this one reads
                // from the rewound cursor once they have landed.
                return Ok(Prepared::Absent);
            }
            // It reads on from the last of the windows in flight.
            sink.cursor = chain.after.clone();
        } else if sink.by_ticks && sink.cursor.batch.is_none() {
            // Reads by ticks, its cursor still the read horizon's (new, or rewound): its first
            // batch starts when a tick allows (as a SQL sink's, `dispatch::first_batch`).
            if let Some(at) = super::first_batch(client, &sink.cursor)? {
                if save_cursor(&sink, &at) {
                    sink.cursor = at;
                }
            }
        }
        let replay = plans::select(
            client,
            &format!(
                "SELECT d.txid::text, d.seq, {body}, (d.event).id::text \
                   FROM outbox.dead_letters d WHERE d.sink = $1 AND d.replay_requested_at IS NOT NULL \
                  ORDER BY d.txid, d.seq LIMIT 1"
            ),
            Some(1),
            &[DatumWithOid::from(id)],
        )?;
        if after.is_some() && !replay.is_empty() {
            // A replay waits for the windows in flight: the chain grows no more, so it drains.
            return Ok(Prepared::Absent);
        }
        if !replay.is_empty() {
            let r = replay.first();
            let txid: String = r.get(1)?.expect("txid");
            let position = Position::new(txid.parse().expect("xid8"), r.get(2)?.expect("seq"));
            let window = Window {
                count: 1,
                last: Some(position),
                batch: None,
                more: false,
                matching: 1,
                body: r.get(3)?,
                ids: vec![r.get::<String>(4)?.expect("id")],
            };
            return Ok(Prepared::Replay(Box::new((sink, position, window))));
        }
        let max = sink.state.batch.min(sink.max_batch);
        // A window that cannot be rendered goes through the failure policy, as a refusal would.
        let kafka = sink.is_kafka();
        // A sink by ticks at the end of its batch goes on to the next (its cursor saved there
        // when nothing is read: no scan of the batches it passed again), within one window read.
        if chain.is_none() && sink.cursor.batch.is_some() {
            let start = sink.cursor.clone();
            let at = window_start(client, &sink.cursor)?;
            if at != start && !save_cursor(&sink, &at) {
                unlock(lease_key);
                return Ok(Prepared::Absent);
            }
            sink.cursor = at;
        }
        match crate::transaction::in_subtransaction(|| read_window(client, &sink.topic_regex, &sink.cursor, max, kafka)) {
            Ok(window) => {
                let window = window?;
                let more = more_windows(client, &sink, &window, flying)?;
                Ok(Prepared::Ready(Box::new((sink, window, more))))
            }
            Err(failure) => {
                let shape = super::window_shape_at(client, &sink.cursor, max)?;
                Ok(Prepared::Unreadable(Box::new((
                    sink,
                    shape,
                    format!("rendering the batch failed: {}", failure.message),
                ))))
            }
        }
    })
    .unwrap_or_else(|e: pgrx::spi::Error| panic!("preparing sink \"{id}\": {e}"))
}

/// An HTTP sink's window after `$1`/`$2` (read from `$source`): its count, last position and
/// matching count, the CloudEvents batch of the events the sink's topics match, and their ids.
macro_rules! http_window {
    ($source:expr) => {
        concat!(
            "SELECT count(*)::int8, (pg_catalog.array_agg(r.position ORDER BY r.n))[count(*)::int4], \
                count(*) FILTER (WHERE m.ok)::int8, \
                (pg_catalog.jsonb_agg(outbox._cloudevent(e.e) ORDER BY r.n) FILTER (WHERE m.ok))::text, \
                pg_catalog.array_agg(r.id::text ORDER BY r.n) FILTER (WHERE m.ok) \
           FROM ",
            $source,
            " r \
          CROSS JOIN LATERAL (SELECT $4::text IS NULL OR r.topic ~ $4 AS ok) m \
          CROSS JOIN LATERAL (SELECT ROW(r.id, r.position, r.topic, r.subject, r.tenant, r.payload, \
                                         r.headers, r.raised_at)::outbox.event AS e) e"
        )
    };
}

/// The read rule's window (`outbox._read_window`).
const HTTP_WINDOW: &str = http_window!("outbox._read_window($1::pg_catalog.xid8, $2, $3, $5)");

/// A sink by ticks' window, within its batch ([`crate::ticks::BatchArgs`] in `$6`, `$7`): both
/// its parts, or the range left of it.
const HTTP_BATCH_WINDOW: &str = http_window!(crate::ticks::batch_window!(both, "$6", "$7", "$5"));
const HTTP_RANGE_WINDOW: &str = http_window!(crate::ticks::batch_window!(range, "$6", "$7", "$5"));

/// Where the next window of a sink by ticks starts: at its cursor while its batch has an event
/// after it; past the end of its batch, at the beginning of the next batch that has one (at most
/// 64 batches on), or of the last batch there is. A cursor of the read horizon's stays.
fn window_start(client: &pgrx::spi::SpiClient<'_>, cursor: &At) -> Result<At, pgrx::spi::Error> {
    let mut at = cursor.clone();
    for _ in 0..64 {
        let Some(batch) = &at.batch else {
            return Ok(at);
        };
        let args = crate::ticks::BatchArgs::of(&batch.since, &batch.upto, at.pos);
        let sql = match args.range {
            true => concat!(
                "SELECT EXISTS (SELECT FROM ",
                crate::ticks::batch_rows!(range, "$4", "$5"),
                ")"
            ),
            false => concat!(
                "SELECT EXISTS (SELECT FROM ",
                crate::ticks::batch_rows!(both, "$4", "$5"),
                ")"
            ),
        };
        let [t, q] = args.position();
        let [a, b] = args.batch();
        let any = !args.empty()
            && plans::select(
                client,
                sql,
                Some(1),
                &[t, q, DatumWithOid::from(1i32), a, b],
            )?
            .first()
            .get::<bool>(1)?
            .unwrap_or(false);
        if any {
            return Ok(at);
        }
        match super::next_batch(client, &at)? {
            Some(next) => at = next,
            None => return Ok(at),
        }
    }
    Ok(at)
}

/// A Kafka sink's windows, read in one statement: up to `windows` windows after `after`, each of
/// `max` events at most, together holding at most `pg_outbox.max_batch_bytes` (the first event
/// whatever its size: the rule of `outbox._read_window`, which reads them), and none after one
/// that came short. Each event is framed here as [`kafka_frame`] frames it in SQL (`kafka::messages`
/// reads either); the statement makes only the text PostgreSQL must (the payload and headers as
/// JSON text), and only for the events the sink's topics match. One statement for many windows,
/// because a statement's fixed cost is most of a 128-event window's.
fn read_kafka_windows(
    client: &pgrx::spi::SpiClient<'_>,
    topic_regex: &Option<String>,
    after: &At,
    max: u32,
    windows: usize,
) -> Result<Vec<Window>, pgrx::spi::Error> {
    /// An event the sink's topics match: its id and time, and its topic, subject, tenant,
    /// headers and payload.
    type Matched<'a> = (pgrx::Uuid, Option<i64>, [Option<&'a str>; 5]);
    struct Row<'a> {
        position: Position,
        text: &'a str,
        event: Option<Matched<'a>>,
        size: i64,
    }
    let limit = (max as usize)
        .saturating_mul(windows.max(1))
        .min(i32::MAX as usize);
    // All the windows read at once hold at most what one may: no more text is made than for one
    // window (the byte cut is the read rule's, before any payload is turned into text).
    let max_bytes = settings::MAX_BATCH_BYTES.get() as i64;
    /// The statement, reading from `$source`.
    macro_rules! kafka_windows {
        ($source:expr) => {
            concat!(
                "SELECT r.position, m.ok, r.id, r.topic, r.subject, r.tenant, \
                        CASE WHEN m.ok THEN r.headers::pg_catalog.text END, r.raised_at, \
                        CASE WHEN m.ok THEN r.payload::pg_catalog.text END, \
                        outbox._event_size(r.payload, r.headers) \
                   FROM ",
                $source,
                " r \
                  CROSS JOIN LATERAL (SELECT $4::pg_catalog.text IS NULL OR r.topic OPERATOR(pg_catalog.~) $4 AS ok) m \
                  ORDER BY r.n"
            )
        };
    }
    let mut args = vec![
        DatumWithOid::from(after.pos.txid.to_string()),
        DatumWithOid::from(after.pos.seq),
        DatumWithOid::from(limit as i32),
        DatumWithOid::from(topic_regex.clone()),
        DatumWithOid::from(max_bytes),
    ];
    let read = after
        .batch
        .as_ref()
        .map(|b| crate::ticks::BatchArgs::of(&b.since, &b.upto, after.pos));
    let sql = match &read {
        None => kafka_windows!("outbox._read_window($1::pg_catalog.xid8, $2, $3, $5)"),
        Some(read) => {
            [args[0], args[1]] = read.position();
            args.extend(read.batch());
            match read.range {
                true => kafka_windows!(crate::ticks::batch_window!(range, "$6", "$7", "$5")),
                false => kafka_windows!(crate::ticks::batch_window!(both, "$6", "$7", "$5")),
            }
        }
    };
    let table = plans::select(client, sql, None, &args)?;
    let mut rows = Vec::with_capacity(table.len());
    for row in table {
        let text: &str = row.get(1)?.expect("position");
        let event = if row.get::<bool>(2)?.unwrap_or(false) {
            Some((
                row.get::<pgrx::Uuid>(3)?.expect("id"),
                row.get::<pgrx::datum::TimestampWithTimeZone>(8)?
                    .map(i64::from),
                [
                    row.get(4)?,
                    row.get(5)?,
                    row.get(6)?,
                    row.get(7)?,
                    row.get(9)?,
                ],
            ))
        } else {
            None
        };
        rows.push(Row {
            position: text.parse().expect("positions are well-formed"),
            text,
            event,
            size: row.get(10)?.unwrap_or(0),
        });
    }
    let cuts = cut_windows(
        rows.iter().map(|r| r.size),
        max as usize,
        max_bytes,
        windows,
    );
    let mut out: Vec<Window> = Vec::with_capacity(cuts.len());
    let mut rows = rows.into_iter();
    for count in cuts {
        let mut window = Window::empty(after.batch.clone());
        window.count = count;
        let mut body = String::new();
        for row in rows.by_ref().take(count) {
            window.last = Some(row.position);
            let Some((id, time, [topic, subject, tenant, headers, payload])) = row.event else {
                continue;
            };
            window.matching += 1;
            let id = super::kafka::uuid_text(&id);
            let field = |body: &mut String, text: Option<&str>| match text {
                None => body.push('~'),
                Some(text) => {
                    super::kafka::push_decimal(body, text.len());
                    body.push(':');
                    body.push_str(text);
                }
            };
            let time = time.map(super::kafka::utc_time);
            for text in [
                Some(id.as_str()),
                Some(row.text),
                topic,
                subject,
                tenant,
                headers,
                time.as_deref(),
                payload,
            ] {
                field(&mut body, text);
            }
            window.ids.push(id);
        }
        if window.matching > 0 {
            window.body = Some(body);
        }
        out.push(window);
    }
    // The last window came short within a batch: it ended the batch, and the sink has more to
    // read now if a later tick is taken (as `read_window` says of a lone window).
    if let (Some(batch), Some(last)) = (&after.batch, out.last_mut()) {
        last.more = (last.count as u32) < max && super::later_tick(client, batch.tick)?;
    }
    Ok(out)
}

/// How many of the events whose sizes come in order go into each window, for at most `windows`
/// windows: `max` events each at most, the first of a window whatever its size, the next while
/// the window's sizes add up to at most `max_bytes` (the rule of `outbox._read_window`); none
/// after a window that came short (the events after it are read again once it is delivered).
fn cut_windows(
    sizes: impl Iterator<Item = i64>,
    max: usize,
    max_bytes: i64,
    windows: usize,
) -> Vec<usize> {
    let mut cuts: Vec<usize> = Vec::new();
    let (mut count, mut bytes) = (0usize, 0i64);
    for size in sizes {
        if count > 0 && (count >= max || bytes.saturating_add(size) > max_bytes) {
            cuts.push(count);
            if count < max || cuts.len() >= windows.max(1) {
                return cuts;
            }
            (count, bytes) = (0, 0);
        }
        count += 1;
        bytes = bytes.saturating_add(size);
    }
    if count > 0 {
        cuts.push(count);
    }
    cuts
}

/// One event framed for a Kafka sink (`kafka::messages` reads it), from the fields `field` names
/// (`r.{}`: the column of a row, `(d.event).{}`: the field of an outbox.event): id, position,
/// topic, subject, tenant, headers, time and value, each `<bytes>:<text>`, or `~` for NULL. Made
/// by plain string functions, at a fraction of the cost of building JSON per event. Each field is
/// rendered once, in a subquery kept from being flattened (`OFFSET 0`): the frame names it three
/// times, and a jsonb or a time rendered three times cost more than the rest of the window.
pub(crate) fn kafka_frame(field: &str) -> String {
    let f = |name: &str| field.replace("{}", name);
    let rendered = [
        format!("{}::text", f("id")),
        f("position"),
        f("topic"),
        f("subject"),
        f("tenant"),
        format!("{}::text", f("headers")),
        format!(
            "pg_catalog.to_char({} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
            f("raised_at")
        ),
        format!("{}::text", f("payload")),
    ];
    let fields = rendered
        .iter()
        .enumerate()
        .map(|(i, expr)| format!("{expr} AS f{i}"))
        .collect::<Vec<_>>()
        .join(", ");
    let frame = (0..rendered.len())
        .map(|i| {
            format!(
                "CASE WHEN t.f{i} IS NULL THEN '~' \
                      ELSE pg_catalog.octet_length(t.f{i})::text OPERATOR(pg_catalog.||) ':' \
                           OPERATOR(pg_catalog.||) t.f{i} END"
            )
        })
        .collect::<Vec<_>>()
        .join(" OPERATOR(pg_catalog.||) ");
    format!("(SELECT {frame} FROM (SELECT {fields} OFFSET 0) t)")
}

/// A Kafka sink's backlog: the windows after `first` that may chain behind it (see
/// [`InFlight::chain`]), read in the same transaction, each of `batch_size` events, while they
/// come full. None for an HTTP sink, a sink retrying a failure, or a window that came short. One
/// that cannot be read ends them: it is read again, alone, once the windows ahead have landed.
fn more_windows(
    client: &pgrx::spi::SpiClient<'_>,
    sink: &Sink,
    first: &Window,
    flying: usize,
) -> Result<Vec<Window>, pgrx::spi::Error> {
    let healthy = sink.is_kafka()
        && sink.state.attempts == 0
        && sink.transient == 0
        && sink.state.batch >= sink.max_batch;
    let room = CHAIN_WINDOWS
        .min(CHAIN_EVENTS.max(sink.max_batch) as usize / sink.max_batch.max(1) as usize)
        .saturating_sub(flying + 1);
    let Some(after) = first
        .end()
        .filter(|_| healthy && room > 0 && first.count as u32 >= sink.max_batch)
    else {
        return Ok(Vec::new());
    };
    let read = crate::transaction::in_subtransaction(|| {
        read_kafka_windows(client, &sink.topic_regex, &after, sink.max_batch, room)
    });
    match read {
        Ok(windows) => windows,
        Err(_) => Ok(Vec::new()),
    }
}

fn read_window(
    client: &pgrx::spi::SpiClient<'_>,
    topic_regex: &Option<String>,
    after: &At,
    max: u32,
    kafka: bool,
) -> Result<Window, pgrx::spi::Error> {
    let mut window = if kafka {
        read_kafka_windows(client, topic_regex, after, max, 1)?
            .into_iter()
            .next()
            .unwrap_or(Window::empty(after.batch.clone()))
    } else {
        let mut args = vec![
            DatumWithOid::from(after.pos.txid.to_string()),
            DatumWithOid::from(after.pos.seq),
            DatumWithOid::from(max as i32),
            DatumWithOid::from(topic_regex.clone()),
            DatumWithOid::from(settings::MAX_BATCH_BYTES.get() as i64),
        ];
        let read = after
            .batch
            .as_ref()
            .map(|b| crate::ticks::BatchArgs::of(&b.since, &b.upto, after.pos));
        let sql = match &read {
            None => HTTP_WINDOW,
            Some(read) => {
                [args[0], args[1]] = read.position();
                args.extend(read.batch());
                match read.range {
                    true => HTTP_RANGE_WINDOW,
                    false => HTTP_BATCH_WINDOW,
                }
            }
        };
        let t = plans::select(client, sql, Some(1), &args)?;
        let r = t.first();
        Window {
            count: r.get::<i64>(1)?.unwrap_or(0) as usize,
            last: r
                .get::<String>(2)?
                .map(|p| p.parse().expect("positions are well-formed")),
            batch: after.batch.clone(),
            more: false,
            matching: r.get::<i64>(3)?.unwrap_or(0) as usize,
            body: r.get(4)?,
            ids: r.get::<Vec<String>>(5)?.unwrap_or_default(),
        }
    };
    // A window that ended its batch short: the sink has more to read now if a later tick is
    // taken (the next pass starts on that batch at once). (A Kafka sink's windows say so where
    // they are cut, `read_kafka_windows`.)
    if let (Some(batch), false) = (&after.batch, kafka) {
        window.more = (window.count as u32) < max && super::later_tick(client, batch.tick)?;
    }
    Ok(window)
}

/// Verifies every address a host resolves to before ureq may connect to it (no DNS rebinding
/// between the check and the connection: ureq connects to exactly what this returns).
#[derive(Debug)]
struct CheckedResolver {
    allow: http::Allow,
    inner: ureq::unversioned::resolver::DefaultResolver,
}

impl ureq::unversioned::resolver::Resolver for CheckedResolver {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: ureq::unversioned::transport::NextTimeout,
    ) -> Result<ureq::unversioned::resolver::ResolvedSocketAddrs, ureq::Error> {
        let addrs = self.inner.resolve(uri, config, timeout)?;
        for a in addrs.iter() {
            http::check_address(a.ip(), self.allow).map_err(|e| ureq::Error::BadUri(e.message))?;
        }
        Ok(addrs)
    }
}

fn agent(timeout: Duration, allow: http::Allow) -> ureq::Agent {
    let config = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .timeout_connect(Some(settings::ms(&settings::HTTP_CONNECT_TIMEOUT_MS)))
        // Never a proxy from the server's environment: the address checks would only see the
        // proxy, and the proxy would reach what they refuse.
        .proxy(None)
        .max_redirects(0)
        .max_redirects_will_error(false)
        .http_status_as_error(false)
        .https_only(!allow.plain_http)
        .user_agent(concat!("pg_outbox/", env!("CARGO_PKG_VERSION")))
        .build();
    ureq::Agent::with_parts(
        config,
        ureq::unversioned::transport::DefaultConnector::new(),
        CheckedResolver {
            allow,
            inner: Default::default(),
        },
    )
}

/// The outcome of a request that landed (its thread has finished, or is about to).
fn join(flying: Flying) -> Outcome {
    match flying.handle {
        Ok(handle) => handle.join().unwrap_or(Outcome::Transient {
            retry_after: None,
            reason: "the request thread panicked".into(),
        }),
        // Retried like an outage: the process was out of threads or memory for a moment.
        Err(why) => Outcome::Transient {
            retry_after: None,
            reason: format!("no thread for the request: {why}"),
        },
    }
}

/// A request's thread. `done` is set, and then the worker's latch, as soon as its outcome is
/// ready: the worker's wait ends at once, and it sees the request as landed.
struct Flying {
    /// Its thread, or why none could be started (then it has landed already).
    handle: Result<std::thread::JoinHandle<Outcome>, String>,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Whether its landing sets the worker's latch: a window chained behind others of its sink
    /// cannot be recorded before them, so it wakes nobody until it is the oldest (see
    /// `InFlight::wake_when_landed`).
    wake: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Set, before `done`, when its outcome is `Delivered`: the worker reads it without joining.
    delivered: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Flying {
    fn landed(&self) -> bool {
        self.done.load(std::sync::atomic::Ordering::Acquire)
    }

    fn delivered(&self) -> bool {
        self.landed() && self.delivered.load(std::sync::atomic::Ordering::Acquire)
    }
}

fn spawn(agent: ureq::Agent, req: Request, max_response: u64) -> Flying {
    let work = move || {
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        let mut r = agent
            .post(&req.url)
            .header("content-type", "application/cloudevents-batch+json")
            .header("idempotency-key", &req.key)
            .header("webhook-id", &req.key)
            .header("webhook-timestamp", timestamp.to_string());
        match req.secret.as_deref().map(Secret::parse) {
            // Never unsigned when a secret is configured, even if someone broke it in the table.
            Some(Err(_)) => {
                return Outcome::Transient {
                    retry_after: None,
                    reason: "the stored signing secret is invalid".into(),
                }
            }
            Some(Ok(secret)) => {
                r = r.header(
                    "webhook-signature",
                    secret.sign(&req.key, timestamp, req.body.as_bytes()),
                )
            }
            None => {}
        }
        for (k, v) in &req.headers {
            r = r.header(k, v);
        }
        match r.send(req.body.as_bytes()) {
            Ok(mut response) => {
                let status = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                // Read (and drop) at most the cap, so a keep-alive connection can be reused.
                let _ = response
                    .body_mut()
                    .with_config()
                    .limit(max_response)
                    .read_to_vec();
                http::classify(status, retry_after.as_deref())
            }
            // Never the request or its headers in the reason: only what went wrong.
            Err(ureq::Error::BadUri(why)) => Outcome::Transient {
                retry_after: None,
                reason: why,
            },
            Err(ureq::Error::Timeout(t)) => Outcome::Transient {
                retry_after: None,
                reason: format!("timed out ({t})"),
            },
            Err(e) => Outcome::Transient {
                retry_after: None,
                reason: format!("request failed: {}", kind_of(&e)),
            },
        }
    };
    spawn_without_signals(work)
}

/// Starts a request's thread with every signal blocked in it: the worker's signal handlers
/// (SIGTERM, SIGALRM for timeouts, SIGUSR1, ...) touch the backend's state and must run on its
/// own thread, which a signal sent to the process could otherwise miss.
fn spawn_without_signals<F: FnOnce() -> Outcome + Send + 'static>(work: F) -> Flying {
    spawn_waking(work, true)
}

/// The stack of a request's or a window's thread: a Kafka sink may have 64 windows in flight,
/// each on its thread, and Rust's default (2 MiB) would reserve 128 MiB of address space per
/// sink. The deepest thing run there is serde_json reading an event's headers, which stops at
/// 128 levels: that takes 128 to 256 KiB in a debug build (measured), so 1 MiB leaves room.
const REQUEST_THREAD_STACK: usize = 1024 * 1024;

/// [`spawn_without_signals`], waking the worker when it lands only if `wake` (then or since).
fn spawn_waking<F: FnOnce() -> Outcome + Send + 'static>(work: F, wake: bool) -> Flying {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let wake = std::sync::Arc::new(AtomicBool::new(wake));
    let latch = crate::worker::OwnLatch::current();
    /// Set when the thread's work is over, however it ended (a panic too: the flight is then
    /// recorded as a failed request instead of holding its lease for ever). Done, then the wake
    /// flag read (the worker sets the flag, then reads done: one of the two sees the other).
    struct Landed(
        std::sync::Arc<AtomicBool>,
        std::sync::Arc<AtomicBool>,
        crate::worker::OwnLatch,
    );
    impl Drop for Landed {
        fn drop(&mut self) {
            self.0.store(true, SeqCst);
            if self.1.load(SeqCst) {
                self.2.wake_from_thread();
            }
        }
    }
    let landed = Landed(done.clone(), wake.clone(), latch);
    let delivered = std::sync::Arc::new(AtomicBool::new(false));
    let was_delivered = delivered.clone();
    let work = move || {
        let _landed = landed;
        let outcome = work();
        if matches!(outcome, Outcome::Delivered) {
            was_delivered.store(true, SeqCst);
        }
        outcome
    };
    // SAFETY: plain signal-mask calls on this thread; the new thread inherits the blocked mask,
    // and this thread's own mask is put back right after, whether the thread started or not.
    let handle = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut previous: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut previous);
        let handle = std::thread::Builder::new()
            .stack_size(REQUEST_THREAD_STACK)
            .spawn(work);
        libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut());
        // Not started: `work` was dropped, and with it `Landed`, which marked the flight landed.
        handle.map_err(|e| e.to_string())
    };
    Flying {
        handle,
        done,
        wake,
        delivered,
    }
}

fn kind_of(e: &ureq::Error) -> String {
    match e {
        ureq::Error::ConnectionFailed => "connection failed".into(),
        ureq::Error::HostNotFound => "host not found".into(),
        ureq::Error::Io(io) => format!("i/o error ({})", io.kind()),
        ureq::Error::Tls(m) => format!("TLS error ({m})"),
        ureq::Error::Rustls(r) => format!("TLS error ({r})"),
        ureq::Error::RequireHttpsOnly(_) => "plain http is not allowed".into(),
        other => other.to_string().chars().take(200).collect(),
    }
}

/// Moves the cursor after a response (batch and all, for a sink by ticks), unless the sink was
/// rewound, or dropped and created again, while the request was in flight.
fn save_cursor(sink: &Sink, to: &At) -> bool {
    let batch = to.batch.as_ref();
    crate::owner::as_owner(|| {
        plans::applied(
            "UPDATE outbox.consumers c SET txid = $2::xid8, seq = $3, tick = $6, \
                    since = $7::text::pg_snapshot, upto = $8::text::pg_snapshot, moved_at = now() \
              WHERE c.name = $1 AND (coalesce(c.tick, 0), c.txid, c.seq) < (coalesce($6, 0), $2::xid8, $3) \
                AND c.rewinds = $4 \
                AND EXISTS (SELECT 1 FROM outbox.sinks s WHERE s.id = c.name AND s.lease_key = $5) \
             RETURNING true",
            &[
                DatumWithOid::from(sink.id.as_str()),
                DatumWithOid::from(to.pos.txid.to_string()),
                DatumWithOid::from(to.pos.seq),
                DatumWithOid::from(sink.rewinds),
                DatumWithOid::from(sink.lease_key),
                DatumWithOid::from(batch.map(|b| b.tick)),
                DatumWithOid::from(batch.map(|b| b.since.as_str())),
                DatumWithOid::from(batch.map(|b| b.upto.as_str())),
            ],
        )
    })
    .unwrap_or_else(|e| panic!("moving cursor of \"{}\": {e}", sink.id))
}

/// Records a transient failure: the endpoint, not an event.
fn transient_failure(
    id: &str,
    transient: u32,
    window: usize,
    delay: Duration,
    down: bool,
    reason: &str,
) {
    Spi::run_with_args(
        "UPDATE outbox.sinks SET transient = $2, current_batch = greatest($3, 1), down = $5, \
                next_attempt_at = pg_catalog.now() + $4::int8 * interval '1 millisecond', \
                last_error = $6, last_sqlstate = NULL, last_error_at = pg_catalog.now(), \
                failures = failures + 1 \
          WHERE id = $1",
        &[
            DatumWithOid::from(id),
            DatumWithOid::from(transient.min(i32::MAX as u32) as i32),
            DatumWithOid::from(window.min(i32::MAX as usize) as i32),
            DatumWithOid::from(delay.as_millis().min(i64::MAX as u128) as i64),
            DatumWithOid::from(down),
            DatumWithOid::from(reason),
        ],
    )
    .expect("recording a transient failure");
}

/// Records a refused batch under the failure policy, in a transaction of its own.
fn record_failure(
    sink: &Sink,
    state: SinkState,
    delay: Option<Duration>,
    down: bool,
    reason: &str,
) -> Result<(), Failure> {
    in_transaction(|| {
        Spi::connect_mut(|c| save_state(c, &sink.id, state, delay, down, Some(&failure(reason)), 0))
    })?
    .map_err(|e| failure(&e.to_string()))
}

fn failure(reason: &str) -> Failure {
    Failure {
        sqlstate: String::new(),
        message: reason.to_string(),
    }
}

/// A producer being destroyed: gone once the thread that drops it is done and no window still
/// holds it (windows discarded behind a failed one may, for moments), so that its destruction
/// (`rd_kafka_destroy`, which waits for every message it held) is over.
struct Closing {
    /// Holds the agents' reference until it is dropped, off the worker's thread.
    _thread: Flying,
    /// Set when the producer's destruction is over (`kafka::Producer::destroyed`).
    gone: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Closing {
    fn landed(&self) -> bool {
        self.gone.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Agents by sink and configuration, kept between passes for keep-alive connections, and dropped
/// (with their connections) once unused for `AGENT_IDLE`: a dropped sink's, or one whose
/// configuration changed.
#[derive(Default)]
pub struct Agents {
    http: HashMap<String, (ureq::Agent, std::time::Instant)>,
    /// Kafka producers by sink: (producer, its configuration, last used).
    kafka: HashMap<String, KeptProducer>,
    /// Producers being destroyed on threads of their own, by sink: a sink gets a new producer
    /// only once its previous one is gone (with every message it still held).
    closing: HashMap<String, Closing>,
}

type KeptProducer = (
    std::sync::Arc<super::kafka::Producer>,
    String,
    std::time::Instant,
);

const AGENT_IDLE: Duration = Duration::from_secs(120);

/// Kafka producers one worker keeps at most (each has a few threads of librdkafka's): past it,
/// the least recently used goes.
const MAX_PRODUCERS: usize = 32;

/// How long a sink's next window waits for its previous producer to be gone.
const PRODUCER_CLOSE_WAIT: Duration = Duration::from_secs(3);

impl Agents {
    fn get(&mut self, sink: &Sink) -> ureq::Agent {
        let allow = settings::http_allow();
        let key = format!(
            "{}|{}|{:?}|{}",
            sink.id,
            sink.timeout_ms,
            allow,
            settings::HTTP_CONNECT_TIMEOUT_MS.get()
        );
        self.expire();
        let now = std::time::Instant::now();
        let entry = self.http.entry(key).or_insert_with(|| {
            (
                agent(Duration::from_millis(sink.timeout_ms as u64), allow),
                now,
            )
        });
        entry.1 = now;
        entry.0.clone()
    }

    /// The Kafka producer of `sink`: kept between passes, made again when its configuration or
    /// the allowed addresses changed, after a window failed on it, or after a fatal error.
    fn producer(&mut self, sink: &Sink) -> Result<std::sync::Arc<super::kafka::Producer>, String> {
        let Transport::Kafka {
            brokers,
            properties,
            ..
        } = &sink.transport
        else {
            unreachable!("a Kafka sink's producer");
        };
        let properties = properties.clone()?;
        let allow = settings::kafka_allow();
        let allowed_brokers = settings::kafka_allowed_brokers();
        let config = super::kafka::producer_properties(brokers, &properties, sink.timeout_ms);
        let fingerprint = format!("{config:?}|{allow:?}|{allowed_brokers}");
        self.expire();
        let now = std::time::Instant::now();
        if let Some((producer, seen, used)) = self.kafka.get_mut(&sink.id) {
            if *seen == fingerprint && !producer.spent() {
                *used = now;
                return Ok(producer.clone());
            }
        }
        if let Some((old, _, _)) = self.kafka.remove(&sink.id) {
            self.close(&sink.id, old);
        }
        // The previous producer is purged, so its destruction takes moments: wait for it (a
        // window sent meanwhile could land before the old one's last messages), within a bound.
        let waited = std::time::Instant::now();
        while self.closing.get(&sink.id).is_some_and(|c| !c.landed()) {
            if waited.elapsed() > PRODUCER_CLOSE_WAIT {
                return Err("the sink's previous Kafka producer is still closing".into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        if self.kafka.len() >= MAX_PRODUCERS {
            let oldest = self
                .kafka
                .iter()
                .min_by_key(|(_, (_, _, used))| *used)
                .map(|(id, _)| id.clone());
            if let Some(id) = oldest {
                let (old, _, _) = self.kafka.remove(&id).expect("present");
                self.close(&id, old);
            }
        }
        let producer =
            super::kafka::Producer::new(&config, allow, &allowed_brokers).map_err(|why| {
                // librdkafka may quote a value it refused: never a secret one.
                properties
                    .iter()
                    .filter(|(k, v)| {
                        pg_outbox_core::kafka::SECRET_PROPERTIES.contains(&k.as_str())
                            && !v.is_empty()
                    })
                    .fold(why, |why, (_, v)| why.replace(v.as_str(), "(hidden)"))
            })?;
        let producer = std::sync::Arc::new(producer);
        self.kafka
            .insert(sink.id.clone(), (producer.clone(), fingerprint, now));
        Ok(producer)
    }

    /// Whether `producer` is the one this worker keeps for `sink` (not replaced since); if so,
    /// it counts as used now (a producer that windows chain into is never idle).
    fn use_current(
        &mut self,
        sink: &str,
        producer: &std::sync::Arc<super::kafka::Producer>,
    ) -> bool {
        match self.kafka.get_mut(sink) {
            Some((kept, _, used)) if std::sync::Arc::ptr_eq(kept, producer) => {
                *used = std::time::Instant::now();
                true
            }
            _ => false,
        }
    }

    /// Makes the producer of a Kafka sink ahead of its first window, unless one exists or the
    /// previous one is still closing: an idempotent producer sends nothing until the broker gave
    /// it a producer id, which takes up to a second (`kafka::WARM_AFTER`), so a worker makes it
    /// while the sink is idle or another worker sends. True when it is ready to send.
    fn warm_up(&mut self, sink: &Sink) -> bool {
        if !sink.is_kafka() {
            return true;
        }
        if let Some((producer, _, _)) = self.kafka.get(&sink.id) {
            if !producer.spent() {
                return producer.warm();
            }
        }
        if self.closing.get(&sink.id).is_some_and(|c| !c.landed()) {
            return false;
        }
        // A producer that cannot be made says why in the pass that needs it.
        self.producer(sink).is_ok_and(|p| p.warm())
    }

    /// Destroys a producer on a thread of its own (with every signal blocked): librdkafka's
    /// destruction waits for its threads, which may be in a slow name lookup or handshake, and
    /// the worker must not wait with them. What it still held is purged first.
    fn close(&mut self, sink: &str, producer: std::sync::Arc<super::kafka::Producer>) {
        producer.purge();
        self.closing.retain(|_, c| !c.landed());
        let gone = producer.destroyed();
        let thread = spawn_without_signals(move || {
            drop(producer);
            Outcome::Delivered
        });
        self.closing.insert(
            sink.to_string(),
            Closing {
                _thread: thread,
                gone,
            },
        );
    }

    /// Closes every producer, and waits up to `bound` for them to be gone (the worker exits).
    pub fn shutdown(&mut self, bound: Duration) {
        let producers: Vec<_> = self.kafka.drain().collect();
        for (sink, (producer, _, _)) in producers {
            self.close(&sink, producer);
        }
        let deadline = std::time::Instant::now() + bound;
        while std::time::Instant::now() < deadline && self.closing.values().any(|c| !c.landed()) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Drops the agents and producers unused for a while (called every round, so that idle ones
    /// go too).
    pub fn expire(&mut self) {
        let now = std::time::Instant::now();
        self.http
            .retain(|_, (_, used)| now.duration_since(*used) < AGENT_IDLE);
        let idle: Vec<String> = self
            .kafka
            .iter()
            .filter(|(_, (_, _, used))| now.duration_since(*used) >= AGENT_IDLE)
            .map(|(id, _)| id.clone())
            .collect();
        for id in idle {
            let (producer, _, _) = self.kafka.remove(&id).expect("present");
            self.close(&id, producer);
        }
        self.closing.retain(|_, c| !c.landed());
    }
}

/// Sends `window` on a thread of its own: the POST of an HTTP sink, or a Kafka sink's messages.
/// The destination is checked against the settings as they are now (they may have changed since
/// the sink was created): one that is no longer allowed fails the pass, saying why.
fn fly(
    sink: &Sink,
    window: &Window,
    agents: &mut Agents,
) -> (Flying, Option<std::sync::Arc<super::kafka::Producer>>) {
    match &sink.transport {
        Transport::Http {
            url,
            headers,
            secret,
        } => {
            let allowed = url::Url::parse(url)
                .map_err(|e| e.to_string())
                .and_then(|u| {
                    http::check_host(&u, &settings::http_allowed_hosts()).map_err(|e| e.message)
                });
            if let Err(why) = allowed {
                let handle = spawn_without_signals(move || Outcome::Transient {
                    retry_after: None,
                    reason: why,
                });
                return (handle, None);
            }
            let request = Request {
                url: url.clone(),
                headers: headers.clone(),
                secret: secret.clone(),
                key: http::batch_key(&sink.id, &window.ids),
                body: window.body.clone().unwrap_or_default(),
            };
            let max_response = settings::HTTP_MAX_RESPONSE_BYTES.get().max(0) as u64;
            (spawn(agents.get(sink), request, max_response), None)
        }
        Transport::Kafka { brokers, .. } => {
            let producer =
                pg_outbox_core::kafka::parse_brokers(brokers, &settings::kafka_allowed_brokers())
                    .map_err(|e| e.message)
                    .and_then(|_| agents.producer(sink));
            match producer {
                Ok(producer) => (
                    fly_kafka(sink, window, producer.clone(), true),
                    Some(producer),
                ),
                Err(why) => {
                    let handle = spawn_without_signals(move || Outcome::Transient {
                        retry_after: None,
                        reason: why,
                    });
                    (handle, None)
                }
            }
        }
    }
}

/// Sends a Kafka sink's window into `producer` on a thread of its own (`wake`: see `Flying`).
fn fly_kafka(
    sink: &Sink,
    window: &Window,
    producer: std::sync::Arc<super::kafka::Producer>,
    wake: bool,
) -> Flying {
    let Transport::Kafka { target, .. } = &sink.transport else {
        unreachable!("a Kafka sink's window");
    };
    let (target, body) = (target.clone(), window.body.clone().unwrap_or_default());
    let timeout = Duration::from_millis(sink.timeout_ms.max(1) as u64);
    // Taken here, in the order the worker reads the windows: they produce in it.
    let ticket = producer.ticket();
    spawn_waking(
        move || super::kafka::send_window(producer, ticket, &target, &body, timeout),
        wake,
    )
}

/// Releases a sink's lease (it outlives transactions, so it is released explicitly; a worker
/// that dies loses it with its slot).
fn unlock(lease_key: i32) {
    crate::worker::release_http_lease(lease_key);
}

fn release(lease_key: i32) -> Result<(), Failure> {
    unlock(lease_key);
    Ok(())
}

/// A request on its way: started by `start` (or by `finish`, for a neighbour test), recorded by
/// `finish`. The sink's lease is held until it is recorded.
pub struct InFlight {
    sink: Sink,
    purpose: Purpose,
    handle: Flying,
    /// A window chained behind one that failed: its outcome is not recorded (the cursor stays
    /// before it, and it is sent again).
    discarded: bool,
    /// The producer a Kafka sink's window went into: the windows chained behind it go into the
    /// same one, or none is chained.
    producer: Option<std::sync::Arc<super::kafka::Producer>>,
}

/// Windows of one Kafka sink that fly at once, at most: they produce in order into one producer
/// while the worker reads the next (see `InFlight::chain_after`).
const CHAIN_WINDOWS: usize = 64;
/// Windows chained behind others that one worker keeps in flight, all sinks together, at most:
/// each has a thread, and a worker may drive up to `MAX_PRODUCERS` Kafka sinks.
const CHAINED_PER_WORKER: usize = 256;

/// How many windows to count a sink as having in flight when bounding its chain (`chain`,
/// `start`): its own (`sink`), or more when the worker's windows (`worker`, all sinks) leave less
/// room than that sink's own bound would, so that no chain takes the worker past
/// `CHAINED_PER_WORKER`.
pub fn chain_count(sink: usize, worker: usize) -> usize {
    sink.max((worker + CHAIN_WINDOWS).saturating_sub(CHAINED_PER_WORKER))
}
/// Events in the windows of one Kafka sink in flight at once, at most (one window, at least).
const CHAIN_EVENTS: u32 = 16384;

/// What a request in flight is for.
enum Purpose {
    /// The sink's next window; or, with `replay`, a dead letter marked for replay, alone.
    Window {
        window: Window,
        replay: Option<Position>,
    },
    /// The neighbour test: the event at `lone` was refused for good (`state`, `reason`), and
    /// `window` holds the next event this sink would get, alone.
    Neighbour {
        window: Window,
        state: SinkState,
        lone: At,
        reason: String,
    },
}

/// What `finish` made of a request that landed.
pub enum Landed {
    Recorded(Result<PassResult, Failure>),
    /// The outcome calls for another request first (the neighbour test): it is on its way, under
    /// the same lease.
    Next(Box<InFlight>),
}

impl InFlight {
    pub fn sink_id(&self) -> &str {
        &self.sink.id
    }

    pub fn discarded(&self) -> bool {
        self.discarded
    }

    /// A window of the sink (not a replay or a neighbour test) that landed delivered, whose
    /// outcome counts: it may be recorded together with the delivered window before it
    /// (see [`finish`]).
    pub fn delivered_window(&self) -> bool {
        matches!(self.purpose, Purpose::Window { replay: None, .. })
            && !self.discarded
            && self.handle.delivered()
    }

    /// The chain a window behind this one joins, if one may: this is a healthy Kafka sink's
    /// window (not a replay, a neighbour test, or a retry after a failure), `flying` windows of
    /// its sink fly (this one the newest) with room for one more, and its producer is still the
    /// sink's, not retired. Windows of an HTTP sink never chain: a request goes out only once the
    /// one before is answered.
    pub fn chain(&self, flying: usize, agents: &mut Agents) -> Option<Chain> {
        let Purpose::Window {
            window,
            replay: None,
        } = &self.purpose
        else {
            return None;
        };
        let sink = &self.sink;
        let healthy = sink.is_kafka()
            && !self.discarded
            && sink.state.attempts == 0
            && sink.transient == 0
            && sink.state.batch >= sink.max_batch;
        let room = flying < CHAIN_WINDOWS
            && (flying as u32 + 1).saturating_mul(sink.max_batch)
                <= CHAIN_EVENTS.max(sink.max_batch);
        let producer = self
            .producer
            .as_ref()
            .filter(|p| !p.spent() && agents.use_current(&sink.id, p))?;
        if !(healthy && room) {
            return None;
        }
        Some(Chain {
            after: window.end()?,
            lease_key: sink.lease_key,
            rewinds: sink.rewinds,
            producer: producer.clone(),
        })
    }

    pub fn is_finished(&self) -> bool {
        self.handle.landed()
    }

    /// A window that came full: more events may wait behind it (another may chain at once).
    pub fn full(&self) -> bool {
        match &self.purpose {
            Purpose::Window { window, .. } => window.full(self.sink.state.batch),
            Purpose::Neighbour { .. } => false,
        }
    }

    /// From now on its landing wakes the worker (it is the oldest of its sink's windows, which
    /// the worker waits for). Then check `is_finished`: it may have landed already.
    pub fn wake_when_landed(&self) {
        self.handle
            .wake
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Its outcome will not be recorded (a window ahead of it failed); it lets go of its
    /// producer, so that the producer is destroyed as soon as its thread is done with it.
    pub fn discard(&mut self) {
        self.discarded = true;
        self.producer = None;
    }
}

/// Gives the lease back without waiting for the response (the worker is stopping). The cursor
/// did not move: the batch goes out again, with the same idempotency key.
pub fn abandon(flight: InFlight) {
    let _ = release(flight.sink.lease_key);
}

pub enum Started {
    Done(PassResult),
    /// A window flies, and the windows chained behind it, oldest first.
    InFlight(Box<InFlight>, Vec<InFlight>),
}

/// First half of a pass: lease, read, and the request sent on its own thread. Several sinks'
/// requests fly at once while the worker goes on (it serves SQL sinks meanwhile).
/// `after`: the window is chained behind windows of the sink in flight (`InFlight::chain_after`),
/// under their lease, which it leaves to them.
pub fn start(
    id: &str,
    agents: &mut Agents,
    chain: Option<Chain>,
    flying: usize,
) -> Result<Started, Failure> {
    let chained = chain.is_some();
    // The lease goes back with a window that does not fly, unless windows in flight hold it.
    let release = |key: i32| if chained { Ok(()) } else { release(key) };
    let prepared =
        in_transaction(|| lease_and_read(id, chain.as_ref(), flying)).inspect_err(|_| {
            // The lease may have been taken before the error: it survives the abort.
            let _ = (!chained).then(|| {
                in_transaction(|| {
                    let key = crate::query::one::<i32>(
                    "SELECT s.lease_key FROM outbox.sinks s WHERE s.id OPERATOR(pg_catalog.=) $1",
                    &[DatumWithOid::from(id)],
                );
                    if let Some(key) = key {
                        unlock(key);
                    }
                })
            });
        })?;
    let (sink, window, more, replay) = match prepared {
        Prepared::Absent => return Ok(Started::Done(PassResult::Skipped)),
        Prepared::Contended => return Ok(Started::Done(PassResult::Contended)),
        Prepared::Ready(ready) => {
            let (sink, window, more) = *ready;
            (sink, window, more, None)
        }
        Prepared::Replay(replay) => {
            let (sink, position, window) = *replay;
            (sink, window, Vec::new(), Some(position))
        }
        // Chained windows only move on: one that cannot be read waits until the windows ahead
        // are recorded, and goes through the failure policy then, unchained.
        Prepared::Unreadable(_) if chained => return Ok(Started::Done(PassResult::Idle)),
        Prepared::Unreadable(unreadable) => {
            let (sink, (count, last), reason) = *unreadable;
            let window = Window {
                count,
                last: last.as_ref().map(|at| at.pos),
                batch: last
                    .as_ref()
                    .map_or(sink.cursor.batch.clone(), |at| at.batch.clone()),
                more: false,
                matching: count,
                body: None,
                ids: Vec::new(),
            };
            if window.last.is_none() {
                release(sink.lease_key)?;
                return Ok(Started::Done(PassResult::Idle));
            }
            pgrx::warning!("pg_outbox: {}: {reason}", sink.label());
            let step = record(&sink, window, Outcome::Rejected { reason }, agents);
            return match step {
                Ok(Step::Neighbour(next)) => Ok(Started::InFlight(next, Vec::new())),
                Ok(Step::Done(result)) => release(sink.lease_key).map(|()| Started::Done(result)),
                Err(e) => {
                    let _ = release(sink.lease_key);
                    Err(e)
                }
            };
        }
    };
    let Some(last) = window.end() else {
        // Nothing to send: a Kafka sink's producer gets ready meanwhile (see Agents::warm_up).
        if !chained {
            agents.warm_up(&sink);
        }
        release(sink.lease_key)?;
        return Ok(Started::Done(PassResult::Idle));
    };
    if !chained && sink.is_kafka() && !agents.warm_up(&sink) && crate::worker::not_alone() {
        // This worker's producer still waits for its producer id: another worker, whose
        // producer is ready, sends the window sooner. This one looks again soon.
        release(sink.lease_key)?;
        return Ok(Started::Done(PassResult::Contended));
    }
    if window.body.is_none() && !chained {
        // Nothing here for this sink's topics: move past the window. (A chained window flies
        // empty instead, so that the cursor passes it only after the windows ahead.)
        let full = window.full(sink.state.batch);
        let saved = in_transaction(|| save_cursor(&sink, &last));
        release(sink.lease_key)?;
        saved?;
        return Ok(Started::Done(PassResult::Delivered { events: 0, full }));
    }
    let (handle, producer) = match chain {
        // Nothing of it for this sink's topics: recorded as delivered once the windows ahead are,
        // so that the cursor passes it then.
        Some(_) if window.body.is_none() => (spawn_waking(|| Outcome::Delivered, false), None),
        Some(chain) => {
            let handle = fly_kafka(&sink, &window, chain.producer.clone(), false);
            (handle, Some(chain.producer))
        }
        None => fly(&sink, &window, agents),
    };
    // The windows read after it chain behind it, into its producer.
    let mut behind = Vec::new();
    if let Some(producer) = producer.as_ref().filter(|_| sink.is_kafka()) {
        let mut after = last;
        for window in more {
            let mut sink = sink.clone();
            sink.cursor = after;
            after = window.end().expect("only windows with events are read on");
            let handle = match window.body {
                None => spawn_waking(|| Outcome::Delivered, false),
                Some(_) => fly_kafka(&sink, &window, producer.clone(), false),
            };
            behind.push(InFlight {
                sink,
                purpose: Purpose::Window {
                    window,
                    replay: None,
                },
                handle,
                discarded: false,
                producer: Some(producer.clone()),
            });
        }
    }
    Ok(Started::InFlight(
        Box::new(InFlight {
            sink,
            purpose: Purpose::Window { window, replay },
            handle,
            discarded: false,
            producer,
        }),
        behind,
    ))
}

/// Second half: take the response, record what it means, release the lease (unless the
/// neighbour test goes out first, or `keep_lease`: other windows of the sink still fly).
pub fn finish(
    flight: InFlight,
    also: Vec<InFlight>,
    agents: &mut Agents,
    keep_lease: bool,
) -> Landed {
    if !also.is_empty() {
        let result = record_delivered(flight, also);
        let released = if keep_lease {
            Ok(())
        } else {
            release(result.1)
        };
        return Landed::Recorded(result.0.and_then(|r| released.map(|()| r)));
    }
    let InFlight {
        sink,
        purpose,
        handle,
        producer,
        ..
    } = flight;
    // Let go of the producer first: after a failure it is replaced (and a new one is made only
    // once the old one is gone) for the next request, the neighbour test's say.
    drop(producer);
    let outcome = join(handle);
    let result = match purpose {
        Purpose::Window {
            replay: Some(position),
            ..
        } => record_replay(&sink, position, outcome),
        Purpose::Window {
            window,
            replay: None,
        } => match record(&sink, window, outcome, agents) {
            Ok(Step::Done(result)) => Ok(result),
            Ok(Step::Neighbour(next)) => return Landed::Next(next),
            Err(e) => Err(e),
        },
        Purpose::Neighbour {
            window,
            state,
            lone,
            reason,
        } => after_neighbour(&sink, state, lone, reason, Some((window, outcome))),
    };
    let released = if keep_lease {
        Ok(())
    } else {
        release(sink.lease_key)
    };
    Landed::Recorded(result.and_then(|r| released.map(|()| r)))
}

/// Windows of one sink that landed delivered, each chained behind the one before
/// ([`InFlight::delivered_window`]): recorded in one transaction, the cursor moved past the last of
/// them, as recording each in turn would have (one commit, not one per window). Returns the
/// result and the sink's lease key.
fn record_delivered(first: InFlight, also: Vec<InFlight>) -> (Result<PassResult, Failure>, i32) {
    let sink = first.sink;
    let mut windows = Vec::with_capacity(also.len() + 1);
    for flight in std::iter::once((first.purpose, first.handle)).chain(also.into_iter().map(|f| {
        debug_assert_eq!(f.sink.lease_key, sink.lease_key);
        (f.purpose, f.handle)
    })) {
        let (
            Purpose::Window {
                window,
                replay: None,
            },
            handle,
        ) = flight
        else {
            unreachable!("only windows of the sink are recorded together");
        };
        let outcome = join(handle);
        debug_assert!(matches!(outcome, Outcome::Delivered));
        windows.push(window);
    }
    let last = windows
        .last()
        .and_then(|w| w.end())
        .expect("a request is sent only for a non-empty window");
    let events: usize = windows.iter().map(|w| w.matching).sum();
    let full = windows.last().is_some_and(|w| w.full(sink.state.batch));
    let result =
        save_delivered(&sink, &last, events).map(|()| PassResult::Delivered { events, full });
    (result, sink.lease_key)
}

/// Records that the sink's events up to `last` were delivered (`events` of them matching): the
/// cursor moves past them and the failure policy's state is reset, in one transaction.
fn save_delivered(sink: &Sink, last: &At, events: usize) -> Result<(), Failure> {
    let policy = settings::policy(sink.max_batch);
    in_transaction(|| {
        if !sink.synchronous_commit {
            crate::isolation::commit_without_waiting_for_flush();
        }
        save_cursor(sink, last);
        Spi::connect_mut(|c| {
            save_state(
                c,
                &sink.id,
                policy.after_success(sink.state),
                None,
                false,
                None,
                events,
            )
        })
    })?
    .map_err(|e| failure(&e.to_string()))
}

/// What `record` decided.
enum Step {
    Done(PassResult),
    Neighbour(Box<InFlight>),
}

/// A replayed dead letter: accepted, it is gone; refused or failed, it stays with one more attempt.
fn record_replay(sink: &Sink, position: Position, outcome: Outcome) -> Result<PassResult, Failure> {
    let run = |sql: &str, reason: Option<&str>| {
        let mut args = vec![
            DatumWithOid::from(sink.id.as_str()),
            DatumWithOid::from(position.txid.to_string()),
            DatumWithOid::from(position.seq),
        ];
        if let Some(r) = reason {
            args.push(DatumWithOid::from(r));
        }
        in_transaction(|| Spi::run_with_args(sql, &args).expect("updating a dead letter"))
    };
    match outcome {
        Outcome::Delivered => {
            run("DELETE FROM outbox.dead_letters WHERE sink = $1 AND txid = $2::pg_catalog.xid8 AND seq = $3", None)?;
            pgrx::log!(
                "pg_outbox: {} accepted replayed event {position}",
                sink.label()
            );
            Ok(PassResult::Delivered {
                events: 1,
                full: true,
            })
        }
        Outcome::Transient {
            retry_after,
            reason,
        } => {
            // The endpoint is not taking anything now: the replay waits, the sink backs off.
            let policy = settings::policy(sink.max_batch);
            let transient = sink.transient.saturating_add(1);
            let delay = retry_after
                .unwrap_or_default()
                .max(policy.backoff(transient));
            in_transaction(|| {
                transient_failure(
                    &sink.id,
                    transient,
                    1,
                    delay,
                    transient >= policy.poison_after,
                    &reason,
                )
            })?;
            Ok(PassResult::Failed)
        }
        Outcome::Rejected { reason } => {
            run(
                "UPDATE outbox.dead_letters SET attempts = attempts + 1, error = $4, sqlstate = NULL, \
                        dead_at = pg_catalog.now(), replay_requested_at = NULL \
                  WHERE sink = $1 AND txid = $2::pg_catalog.xid8 AND seq = $3",
                Some(&reason),
            )?;
            pgrx::warning!(
                "pg_outbox: {} failed on replayed event {position}, back to the dead letters: {reason}",
                sink.label()
            );
            Ok(PassResult::Retry)
        }
    }
}

fn record(
    sink: &Sink,
    window: Window,
    outcome: Outcome,
    agents: &mut Agents,
) -> Result<Step, Failure> {
    let last = window
        .end()
        .expect("a request is sent only for a non-empty window");
    let full = window.full(sink.state.batch);
    match outcome {
        Outcome::Delivered => {
            save_delivered(sink, &last, window.matching)?;
            Ok(Step::Done(PassResult::Delivered {
                events: window.matching,
                full,
            }))
        }
        Outcome::Transient {
            retry_after,
            reason,
        } => failed(sink, &window, last, reason, retry_after, agents),
        Outcome::Rejected { reason } => failed(sink, &window, last, reason, None, agents),
    }
}

/// Any failure, whatever it was (a refusal, a server error, a timeout, a refused connection): the
/// failure policy of every sink. The batch is halved down to the lone event, which is retried with
/// back-off and then tested against its neighbour: if the neighbour goes through, the lone event
/// is poison and is dead-lettered; if it fails too, the endpoint is down and nothing is
/// (an outage never loses an event). `wait`: the endpoint's `Retry-After`, honoured before the
/// next request, the neighbour test included.
fn failed(
    sink: &Sink,
    window: &Window,
    last: At,
    reason: String,
    wait: Option<Duration>,
    agents: &mut Agents,
) -> Result<Step, Failure> {
    let policy = settings::policy(sink.max_batch);
    let wait = wait.filter(|d| !d.is_zero());
    match policy.after_failure(sink.state, window.count as u32) {
        AfterFailure::Halve(state) => {
            record_failure(sink, state, wait, false, &reason)?;
            Ok(Step::Done(match wait {
                Some(_) => PassResult::Failed,
                None => PassResult::Retry,
            }))
        }
        AfterFailure::Retry { state, delay } => {
            let delay = delay.max(wait.unwrap_or_default());
            pgrx::warning!(
                "pg_outbox: {} failed on event {last} (attempt {}), retrying in {delay:?}: {reason}",
                sink.label(),
                state.attempts
            );
            record_failure(sink, state, Some(delay), false, &reason)?;
            Ok(Step::Done(PassResult::Failed))
        }
        AfterFailure::TestNeighbour(state) => match wait {
            // The endpoint asked for a pause: no request before it ends, the neighbour test's
            // neither. The lone event goes first again when it does.
            Some(wait) => {
                pgrx::warning!(
                    "pg_outbox: {} failed on event {last} (attempt {}), retrying in {wait:?} as the endpoint asked: {reason}",
                    sink.label(),
                    state.attempts
                );
                record_failure(sink, state, Some(wait), false, &reason)?;
                Ok(Step::Done(PassResult::Failed))
            }
            None => neighbour_test(sink, state, last, reason, agents),
        },
    }
}

/// The lone event at `lone` failed `poison_after` times: post the next event this sink would get,
/// alone, as a request of its own (the worker goes on meanwhile). Accepted: `lone` is poison.
/// Failed too, or none yet: the sink is down.
fn neighbour_test(
    sink: &Sink,
    state: SinkState,
    lone: At,
    reason: String,
    agents: &mut Agents,
) -> Result<Step, Failure> {
    pgrx::warning!(
        "pg_outbox: {} failed on event {lone} (attempt {}), testing its neighbour: {reason}",
        sink.label(),
        state.attempts
    );
    // The neighbour: the first matching event within one batch after the lone one (for a sink by
    // ticks, in the next batch with one when the rest of the lone one's has none).
    let window = in_transaction(|| {
        Spi::connect(|c| {
            match super::first_match_span(c, &lone, sink.max_batch, &sink.topic_regex)? {
                None => Ok(None),
                Some((from, span)) => {
                    read_window(c, &sink.topic_regex, &from, span, sink.is_kafka()).map(Some)
                }
            }
        })
    })?
    .map_err(|e| failure(&e.to_string()))?;
    let Some(window) = window else {
        return after_neighbour(sink, state, lone, reason, None).map(Step::Done);
    };
    let (handle, producer) = fly(sink, &window, agents);
    Ok(Step::Neighbour(Box::new(InFlight {
        sink: sink.clone(),
        purpose: Purpose::Neighbour {
            window,
            state,
            lone,
            reason,
        },
        handle,
        discarded: false,
        producer,
    })))
}

/// The neighbour test's verdict: `neighbour` is its window and outcome (None: no neighbour yet).
fn after_neighbour(
    sink: &Sink,
    state: SinkState,
    lone: At,
    reason: String,
    neighbour: Option<(Window, Outcome)>,
) -> Result<PassResult, Failure> {
    let policy = settings::policy(sink.max_batch);
    match neighbour {
        Some((w, Outcome::Delivered)) => {
            let neighbour = w.end().expect("the window has the neighbour");
            let AfterNeighbour::DeadLetter(fresh) = policy.after_neighbour(state, Some(true))
            else {
                unreachable!()
            };
            in_transaction(|| {
                Spi::run_with_args(
                    "INSERT INTO outbox.dead_letters (sink, txid, seq, event, error, sqlstate, attempts) \
                     SELECT $1, e.txid, e.seq, ROW(e.id, e.txid::text || ':' || e.seq::text, e.topic, e.subject, \
                            e.tenant, e.payload, e.headers, e.raised_at)::outbox.event, $4, NULL, $5 \
                       FROM outbox.events e WHERE e.txid = $2::pg_catalog.xid8 AND e.seq = $3 \
                     ON CONFLICT (sink, txid, seq) DO UPDATE SET error = EXCLUDED.error, attempts = EXCLUDED.attempts, \
                          dead_at = pg_catalog.now(), replay_requested_at = NULL",
                    &[
                        DatumWithOid::from(sink.id.as_str()),
                        DatumWithOid::from(lone.pos.txid.to_string()),
                        DatumWithOid::from(lone.pos.seq),
                        DatumWithOid::from(reason.as_str()),
                        DatumWithOid::from(state.attempts as i32),
                    ],
                )
                .expect("dead-lettering");
                save_cursor(sink, &neighbour);
                Spi::connect_mut(|c| save_state(c, &sink.id, fresh, None, false, Some(&failure(&reason)), 1))
            })?
            .map_err(|e| failure(&e.to_string()))?;
            pgrx::warning!(
                "pg_outbox: {} dead-lettered event {lone} after {} attempts (its neighbour {neighbour} went through): {reason}",
                sink.label(),
                state.attempts
            );
            Ok(PassResult::Delivered {
                events: 1,
                full: false,
            })
        }
        other => {
            let neighbour_ok = other.as_ref().map(|_| false);
            let AfterNeighbour::Down { state, delay } = policy.after_neighbour(state, neighbour_ok)
            else {
                unreachable!()
            };
            record_failure(sink, state, Some(delay), neighbour_ok.is_some(), &reason)?;
            Ok(PassResult::Failed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{chain_count, cut_windows, CHAINED_PER_WORKER, CHAIN_WINDOWS};

    #[test]
    fn chains_keep_the_windows_of_a_worker_within_its_bound() {
        for worker in 0..2 * CHAINED_PER_WORKER {
            for sink in 0..=worker.min(CHAIN_WINDOWS) {
                let counted = chain_count(sink, worker);
                // Never fewer than the sink's own: its own bound still holds.
                assert!(counted >= sink);
                // What a chain may add (`InFlight::chain`, `more_windows`: up to CHAIN_WINDOWS
                // counted) keeps the worker within its bound, or adds nothing once past it.
                let more = CHAIN_WINDOWS.saturating_sub(counted);
                if worker >= CHAINED_PER_WORKER {
                    assert_eq!(more, 0, "worker {worker}, sink {sink}");
                } else {
                    assert!(
                        worker + more <= CHAINED_PER_WORKER,
                        "worker {worker}, sink {sink}"
                    );
                }
            }
        }
        // A worker with room leaves a sink its whole chain.
        assert_eq!(chain_count(3, 10), 3);
    }

    #[test]
    fn windows_are_cut_by_count_and_bytes_and_end_after_a_short_one() {
        let cut = |sizes: &[i64], max, bytes, windows| {
            cut_windows(sizes.iter().copied(), max, bytes, windows)
        };
        // By count: full windows, then the rest of the log.
        assert_eq!(cut(&[1; 10], 4, 100, 8), [4, 4, 2]);
        // No more windows than asked for, full ones.
        assert_eq!(cut(&[1; 10], 4, 100, 2), [4, 4]);
        assert_eq!(cut(&[1; 10], 4, 100, 0), [4]);
        // By bytes: at most 10 per window, the first event of one whatever its size; a window cut
        // by its bytes is short, and ends the windows read.
        assert_eq!(cut(&[3, 3, 3, 3, 3], 4, 10, 8), [3]);
        assert_eq!(cut(&[30, 3, 3], 4, 10, 8), [1]);
        assert_eq!(cut(&[10, 3], 4, 10, 8), [1]);
        assert_eq!(cut(&[4, 6, 1, 1], 2, 10, 8), [2, 2]);
        assert_eq!(cut(&[i64::MAX, i64::MAX], 4, 10, 8), [1]);
        // Nothing to read, nothing cut.
        assert_eq!(cut(&[], 4, 10, 8), Vec::<usize>::new());
    }
}
