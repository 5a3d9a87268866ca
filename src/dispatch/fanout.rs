//! Fan-out: one pass of one subscription, in the worker's transaction.
//!
//! Lease (a transaction advisory lock, as for sinks), read a window past the cursor with the read
//! rule, evaluate the filter on each event of the subscription's topics, write one job per match
//! (the event as its payload, the event's id as its key, so a job is never queued twice while
//! it waits), move the cursor past the whole window and count -- all in one transaction, so a
//! crash anywhere leaves either all of it or none.

use super::PassResult;
use crate::cursor;
use crate::transaction::refresh_snapshot;
use pg_outbox_core::filter::{EventContext, EventFields, Filter};
use pg_outbox_core::Position;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// The first key of the subscriptions' advisory locks ("outf"); the second is the lease_key.
const FANOUT_LEASE_CLASS: i32 = 0x6f75_7466;

/// Events read per pass. Jobs are small rows; a larger window amortises the pass.
pub const WINDOW: i32 = 1000;

thread_local! {
    /// Compiled filters of this process, by subscription, with the source they were compiled
    /// from: a subscription dropped and created again with another filter recompiles.
    static FILTERS: RefCell<HashMap<String, Rc<Filter>>> = RefCell::new(HashMap::new());
}

/// The compiled filter for `name`, from the cache when its source is unchanged.
fn compiled(name: &str, source: &str) -> Result<Rc<Filter>, String> {
    FILTERS.with(|cache| {
        let mut cache = cache.borrow_mut();
        if let Some(f) = cache.get(name).filter(|f| f.source() == source) {
            return Ok(Rc::clone(f));
        }
        // Subscribe refused filters that do not compile; one that does not now (a row written
        // by hand, another version of the CEL crate) stalls nothing: the pass reports it.
        let filter = Rc::new(Filter::compile(source).map_err(|e| e.to_string())?);
        if cache.len() >= 10_000 {
            cache.clear();
        }
        cache.insert(name.to_string(), Rc::clone(&filter));
        Ok(filter)
    })
}

struct Subscription {
    name: String,
    cursor: Position,
    topic_regex: Option<String>,
    filter: Option<String>,
    handler: Option<pg_sys::Oid>,
    queue: String,
    max_attempts: i32,
}

fn lease(client: &SpiClient<'_>, name: &str) -> Result<Option<Subscription>, PassResult> {
    let locked = client
        .select(
            "SELECT pg_catalog.pg_try_advisory_xact_lock($2, s.lease_key) FROM outbox.subscriptions s WHERE s.name = $1",
            Some(1),
            &[DatumWithOid::from(name), DatumWithOid::from(FANOUT_LEASE_CLASS)],
        )
        .expect("taking a subscription lease");
    if locked.is_empty() {
        return Err(PassResult::Skipped);
    }
    if locked.first().get_one::<bool>().expect("lease") != Some(true) {
        return Err(PassResult::Contended);
    }
    // The previous holder committed before it released the lease: see its cursor.
    refresh_snapshot();
    let rows = client
        .select(
            "SELECT c.txid::text, c.seq, s.topic_regex, s.filter, s.handler::pg_catalog.oid, s.queue, s.max_attempts \
               FROM outbox.subscriptions s JOIN outbox.consumers c ON c.name = s.name \
              WHERE s.name = $1 AND NOT s.paused",
            Some(1),
            &[DatumWithOid::from(name)],
        )
        .expect("reading a subscription");
    let mut found = None;
    for r in rows {
        let txid: String = r.get(1).unwrap().expect("cursor txid");
        found = Some(Subscription {
            name: name.to_string(),
            cursor: Position::new(txid.parse().expect("xid8"), r.get(2).unwrap().expect("seq")),
            topic_regex: r.get(3).unwrap(),
            filter: r.get(4).unwrap(),
            handler: r.get(5).unwrap(),
            queue: r.get(6).unwrap().expect("queue"),
            max_attempts: r.get(7).unwrap().expect("max_attempts"),
        });
    }
    Ok(found)
}

/// The window: each event's position, and for the events of the subscription's topics what a
/// filter sees (when there is a filter).
const WINDOW_SQL: &str = "\
    SELECT r.position, m, CASE WHEN m AND $5 THEN r.topic END, CASE WHEN m AND $5 THEN r.subject END, \
           CASE WHEN m AND $5 THEN r.tenant END, CASE WHEN m AND $5 THEN r.payload::text END, \
           CASE WHEN m AND $5 THEN r.headers::text END, \
           CASE WHEN m AND $5 THEN pg_catalog.to_char(r.raised_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') END \
      FROM outbox._read_after($1::pg_catalog.xid8, $2, $3) r, \
           LATERAL (SELECT $4::text IS NULL OR r.topic ~ $4 AS m) t";

/// Writes one job per selected event of the window (`positions`; NULL: every event of the
/// topics). An event whose job still waits is not queued again (a rewound cursor, say).
const INSERT_SQL: &str = "\
    INSERT INTO outbox.jobs (queue, payload, key, event, subscription, handler, max_attempts) \
    SELECT $4, pg_catalog.to_jsonb(r), r.id::text, r.id, $5, $6, $7 \
      FROM outbox._read_after($1::pg_catalog.xid8, $2, $3) r \
     WHERE CASE WHEN $8::text[] IS NULL THEN $9::text IS NULL OR r.topic ~ $9 \
                ELSE r.position = ANY ($8::text[]) END \
    ON CONFLICT (queue, key) WHERE key IS NOT NULL AND state = 'waiting' DO NOTHING";

/// What the filter made of a window.
#[derive(Default)]
struct Verdicts {
    /// Positions of the matching events (None: no filter, every event of the topics matches).
    matched: Option<Vec<String>>,
    matches: i64,
    skipped: i64,
    errors: i64,
    last_error: Option<String>,
}

/// One fan-out pass over one subscription. Runs inside the worker's transaction.
pub fn pass(name: &str) -> PassResult {
    if !super::lock_tables() {
        return PassResult::Skipped;
    }
    Spi::connect_mut(|client| {
        let sub = match lease(client, name) {
            Ok(Some(sub)) => sub,
            Ok(None) => return PassResult::Skipped,
            Err(result) => return result,
        };
        let filter = sub
            .filter
            .as_deref()
            .map(|source| compiled(&sub.name, source));
        let rows = client
            .select(
                WINDOW_SQL,
                None,
                &[
                    DatumWithOid::from(sub.cursor.txid.to_string()),
                    DatumWithOid::from(sub.cursor.seq),
                    DatumWithOid::from(WINDOW),
                    DatumWithOid::from(sub.topic_regex.clone()),
                    DatumWithOid::from(filter.is_some()),
                ],
            )
            .expect("reading a fan-out window");
        let count = rows.len();
        let mut last: Option<String> = None;
        let mut verdicts = Verdicts {
            matched: filter.is_some().then(Vec::new),
            ..Default::default()
        };
        for row in rows {
            let position: String = row.get(1).unwrap().expect("position");
            let of_topics = row.get::<bool>(2).unwrap().unwrap_or(false);
            if of_topics {
                match &filter {
                    None => verdicts.matches += 1,
                    Some(filter) => {
                        let verdict = filter.as_ref().map_err(String::clone).and_then(|f| {
                            let payload = json(row.get::<String>(6).unwrap());
                            let headers = json(row.get::<String>(7).unwrap());
                            let topic: String = row.get(3).unwrap().unwrap_or_default();
                            let subject: Option<String> = row.get(4).unwrap();
                            let tenant: Option<String> = row.get(5).unwrap();
                            let raised_at: String = row.get(8).unwrap().unwrap_or_default();
                            f.matches_in(&EventContext::new(&EventFields {
                                topic: &topic,
                                subject: subject.as_deref(),
                                tenant: tenant.as_deref(),
                                payload: &payload,
                                headers: &headers,
                                raised_at: &raised_at,
                            }))
                        });
                        match verdict {
                            Ok(true) => {
                                verdicts.matches += 1;
                                verdicts.matched.as_mut().unwrap().push(position.clone());
                            }
                            Ok(false) => verdicts.skipped += 1,
                            Err(e) => {
                                verdicts.errors += 1;
                                verdicts.last_error = Some(format!("event {position}: {e}"));
                            }
                        }
                    }
                }
            }
            last = Some(position);
        }
        let Some(last) = last else {
            return PassResult::Idle;
        };
        let last: Position = last.parse().expect("positions are well-formed");
        if verdicts.matches > 0 {
            client
                .update(
                    INSERT_SQL,
                    None,
                    &[
                        DatumWithOid::from(sub.cursor.txid.to_string()),
                        DatumWithOid::from(sub.cursor.seq),
                        DatumWithOid::from(WINDOW),
                        DatumWithOid::from(sub.queue.as_str()),
                        DatumWithOid::from(sub.name.as_str()),
                        // SAFETY: an oid datum typed as regprocedure, which is an oid.
                        unsafe { DatumWithOid::new(sub.handler, pg_sys::REGPROCEDUREOID) },
                        DatumWithOid::from(sub.max_attempts),
                        DatumWithOid::from(verdicts.matched.clone()),
                        DatumWithOid::from(sub.topic_regex.clone()),
                    ],
                )
                .expect("writing jobs");
        }
        cursor::save(&sub.name, last);
        if let Some(e) = &verdicts.last_error {
            pgrx::warning!(
                "pg_outbox: the filter of subscription \"{}\" failed on {} event(s), counted as false; last: {e}",
                sub.name,
                verdicts.errors
            );
        }
        client
            .update(
                "UPDATE outbox.subscriptions SET matched = matched + $2, skipped = skipped + $3, \
                        predicate_errors = predicate_errors + $4, \
                        last_predicate_error = coalesce($5, last_predicate_error), \
                        last_predicate_error_at = CASE WHEN $5 IS NULL THEN last_predicate_error_at ELSE pg_catalog.now() END, \
                        last_fanout_at = pg_catalog.now() \
                  WHERE name = $1",
                None,
                &[
                    DatumWithOid::from(sub.name.as_str()),
                    DatumWithOid::from(verdicts.matches),
                    DatumWithOid::from(verdicts.skipped),
                    DatumWithOid::from(verdicts.errors),
                    DatumWithOid::from(verdicts.last_error.clone()),
                ],
            )
            .expect("counting fan-out");
        PassResult::Delivered {
            events: verdicts.matches as usize,
            full: count >= WINDOW as usize,
        }
    })
}

fn json(text: Option<String>) -> serde_json::Value {
    text.and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// The subscriptions that are not paused (name, has a handler), rotated so that workers start
/// at different ones.
pub fn active(slot: usize) -> Vec<(String, bool)> {
    let mut names = Vec::new();
    if !super::lock_tables() {
        return names;
    }
    Spi::connect(|client| {
        for row in client.select(
            "SELECT name, handler IS NOT NULL FROM outbox.subscriptions WHERE NOT paused ORDER BY name",
            None,
            &[],
        )? {
            names.push((
                row.get::<String>(1)?.expect("name"),
                row.get::<bool>(2)?.unwrap_or(false),
            ));
        }
        Ok::<_, pgrx::spi::Error>(())
    })
    .expect("listing subscriptions");
    if !names.is_empty() {
        let k = slot % names.len();
        names.rotate_left(k);
    }
    names
}
