//! `outbox.raise` and `outbox.raise_many`: write events in the caller's transaction.
//!
//! Both are SECURITY DEFINER so that an application role needs EXECUTE and nothing else; their SQL
//! names only schema-qualified objects and parameters, so the caller's search_path cannot reach
//! into it. The INSERT is prepared once per backend and kept: a raise costs one plan execution.

use crate::error::{Error, OrReport};
use crate::raw::{RawJsonb, RawJsonbArray, RawTextArray};
use pg_outbox_core::batch::{self, Column};
use pg_outbox_core::{name, required, topic, Invalid, InvalidKind};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use pgrx::PgOid;
use std::cell::RefCell;

const RAISE_SQL: &str = "INSERT INTO outbox.events (id, topic, subject, tenant, payload, headers) \
     VALUES ($1, $2, $3, $4, coalesce($5, '{}'::pg_catalog.jsonb), coalesce($6, '{}'::pg_catalog.jsonb))";

// Parallel arrays: for each column either $array (one element per event) or $scalar (one value
// for all) is set, never both; see `Spread`.
const RAISE_MANY_SQL: &str = "INSERT INTO outbox.events (id, topic, subject, tenant, payload, headers) \
     SELECT t.id, coalesce(t.topic, $4), coalesce(t.subject, $6), coalesce(t.tenant, $8), \
            coalesce(t.payload, '{}'::pg_catalog.jsonb), coalesce(t.headers, $10, '{}'::pg_catalog.jsonb) \
       FROM ROWS FROM (pg_catalog.unnest($1), pg_catalog.unnest($2), pg_catalog.unnest($3), \
                       pg_catalog.unnest($5), pg_catalog.unnest($7), pg_catalog.unnest($9)) \
            AS t(id, payload, topic, subject, tenant, headers)";

thread_local! {
    static RAISE_PLAN: RefCell<Option<OwnedPreparedStatement>> = const { RefCell::new(None) };
    static RAISE_MANY_PLAN: RefCell<Option<OwnedPreparedStatement>> = const { RefCell::new(None) };
}

fn new_id() -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(pg_outbox_core::id::new_event_id())
}

fn check_attributes(subject: Option<&str>, tenant: Option<&str>) -> Result<(), Invalid> {
    subject.map(name::validate_subject).transpose()?;
    tenant.map(name::validate_tenant).transpose()?;
    Ok(())
}

fn not_an_object(what: &str) -> Error {
    Error::Invalid(
        Invalid::new(
            InvalidKind::Parameter,
            format!("{what} must be a JSON object"),
        )
        .with_hint("wrap the value in an object, e.g. {\"value\": ...}; NULL means {}"),
    )
}

/// Refuses an event whose payload and headers are over `pg_outbox.max_event_size` together.
fn check_size(what: impl FnOnce() -> String, payload: Option<RawJsonb>, headers: Option<RawJsonb>) {
    let size = payload.map_or(0, RawJsonb::raw_size) + headers.map_or(0, RawJsonb::raw_size);
    let max = crate::settings::MAX_EVENT_SIZE.get().max(0) as u64;
    if size > max {
        Error::EventTooLarge {
            what: what(),
            size,
            max,
        }
        .report();
    }
}

/// Raises one event and returns its id. It exists only if the caller's transaction commits.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
fn raise(
    topic: Option<&str>,
    payload: default!(Option<RawJsonb>, "'{}'"),
    subject: default!(Option<&str>, "NULL"),
    tenant: default!(Option<&str>, "NULL"),
    headers: default!(Option<RawJsonb>, "NULL"),
) -> pgrx::Uuid {
    let topic = required(topic, "topic").or_report();
    topic::validate(topic).or_report();
    check_attributes(subject, tenant).or_report();
    if payload.is_some_and(|p| !p.is_object()) {
        not_an_object("payload").report();
    }
    if headers.is_some_and(|h| !h.is_object()) {
        not_an_object("headers").report();
    }
    check_size(|| "payload and headers".into(), payload, headers);
    let id = new_id();
    let args = [
        DatumWithOid::from(id),
        DatumWithOid::from(topic),
        DatumWithOid::from(subject),
        DatumWithOid::from(tenant),
        DatumWithOid::from(payload),
        DatumWithOid::from(headers),
    ];
    Spi::connect_mut(|client| {
        RAISE_PLAN.with(|cell| {
            let mut plan = cell.borrow_mut();
            if plan.is_none() {
                let types = [
                    PgOid::from(pg_sys::UUIDOID),
                    PgOid::from(pg_sys::TEXTOID),
                    PgOid::from(pg_sys::TEXTOID),
                    PgOid::from(pg_sys::TEXTOID),
                    PgOid::from(pg_sys::JSONBOID),
                    PgOid::from(pg_sys::JSONBOID),
                ];
                *plan = Some(
                    client
                        .prepare_mut(RAISE_SQL, &types)
                        .expect("the raise INSERT prepares")
                        .keep(),
                );
            }
            client
                .update(plan.as_ref().unwrap(), None, &args)
                .map(|_| ())
        })
    })
    .unwrap_or_else(|e| panic!("raise failed: {e}"));
    crate::worker::wake_at_commit(&mut std::iter::once(topic));
    id
}

/// How one argument array of `raise_many` reaches the INSERT: the caller's array as it is (one
/// element per event), its single element as a scalar (unnest pads a short array with NULLs, it
/// does not repeat it), or nothing.
enum Spread<A, E> {
    Each(A),
    All(E),
    Absent,
}

impl<A: Copy, E: Clone> Spread<A, E> {
    fn of(raw: Option<A>, elements: &Option<Vec<Option<E>>>, n: usize) -> Self {
        match (raw, elements) {
            (Some(_), Some(e)) if e.len() == 1 && n > 1 => {
                e[0].clone().map_or(Spread::Absent, Spread::All)
            }
            (Some(a), Some(_)) => Spread::Each(a),
            _ => Spread::Absent,
        }
    }

    /// ($array, $scalar) parameters for `coalesce(t.column, $scalar)`.
    fn params<'a>(self) -> [DatumWithOid<'a>; 2]
    where
        A: pgrx::IntoDatum,
        E: pgrx::IntoDatum,
    {
        match self {
            Spread::Each(a) => [DatumWithOid::from(Some(a)), DatumWithOid::null::<E>()],
            Spread::All(e) => [DatumWithOid::null::<A>(), DatumWithOid::from(Some(e))],
            Spread::Absent => [DatumWithOid::null::<A>(), DatumWithOid::null::<E>()],
        }
    }
}

/// Raises many events in one call: parallel arrays, one element per event, or a single element
/// that applies to every event. Returns the ids in the order of `payloads`.
#[pg_extern(volatile, parallel_unsafe, security_definer)]
fn raise_many(
    topics: Option<RawTextArray>,
    payloads: Option<RawJsonbArray>,
    subjects: default!(Option<RawTextArray>, "NULL"),
    tenants: default!(Option<RawTextArray>, "NULL"),
    headers: default!(Option<RawJsonbArray>, "NULL"),
) -> Vec<pgrx::Uuid> {
    let payloads_raw = required(payloads, "payloads").or_report();
    let payload_elems = payloads_raw.elements("payloads");
    let topic_elems = topics.map(|a| a.strings("topics"));
    let subject_elems = subjects.map(|a| a.strings("subjects"));
    let tenant_elems = tenants.map(|a| a.strings("tenants"));
    let header_elems = headers.map(|a| a.elements("headers"));
    let len = |v: &Option<Vec<Option<String>>>| v.as_ref().map(Vec::len);
    let n = batch::event_count(
        payload_elems.len(),
        &[
            Column {
                name: "topics",
                len: len(&topic_elems),
                required: true,
            },
            Column {
                name: "subjects",
                len: len(&subject_elems),
                required: false,
            },
            Column {
                name: "tenants",
                len: len(&tenant_elems),
                required: false,
            },
            Column {
                name: "headers",
                len: header_elems.as_ref().map(Vec::len),
                required: false,
            },
        ],
    )
    .or_report();

    // Checked element by element, so an error names the index the caller got wrong.
    let at = |what: &str, i: usize| format!("{what}[{}]", i + 1);
    for (i, topic) in topic_elems.iter().flatten().enumerate() {
        let topic = topic
            .as_deref()
            .ok_or_else(|| Invalid::null(&at("topics", i)))
            .or_report();
        topic::validate(topic).or_report();
    }
    for subject in subject_elems.iter().flatten().flatten() {
        name::validate_subject(subject).or_report();
    }
    for tenant in tenant_elems.iter().flatten().flatten() {
        name::validate_tenant(tenant).or_report();
    }
    for (what, column) in [
        ("payloads", Some(&payload_elems)),
        ("headers", header_elems.as_ref()),
    ] {
        for (i, value) in column.into_iter().flatten().enumerate() {
            if value.is_some_and(|v| !v.is_object()) {
                not_an_object(&at(what, i)).report();
            }
        }
    }
    // headers may be one value for every event, or one per event.
    for (i, payload) in payload_elems.iter().enumerate() {
        let header = header_elems.as_ref().and_then(|h| {
            if h.len() == 1 {
                h[0]
            } else {
                h.get(i).copied().flatten()
            }
        });
        check_size(
            || format!("payloads[{}] and its headers", i + 1),
            *payload,
            header,
        );
    }

    let ids: Vec<pgrx::Uuid> = (0..n).map(|_| new_id()).collect();
    let [topic_each, topic_all] = Spread::of(topics, &topic_elems, n).params();
    let [subject_each, subject_all] = Spread::of(subjects, &subject_elems, n).params();
    let [tenant_each, tenant_all] = Spread::of(tenants, &tenant_elems, n).params();
    let [header_each, header_all] = Spread::of(headers, &header_elems, n).params();
    let args = [
        DatumWithOid::from(ids.clone()),
        DatumWithOid::from(payloads_raw),
        topic_each,
        topic_all,
        subject_each,
        subject_all,
        tenant_each,
        tenant_all,
        header_each,
        header_all,
    ];
    Spi::connect_mut(|client| {
        RAISE_MANY_PLAN.with(|cell| {
            let mut plan = cell.borrow_mut();
            if plan.is_none() {
                let text = PgOid::from(pg_sys::TEXTOID);
                let texts = PgOid::from(pg_sys::TEXTARRAYOID);
                let types = [
                    PgOid::from(pg_sys::UUIDARRAYOID),
                    PgOid::from(pg_sys::JSONBARRAYOID),
                    texts,
                    text,
                    texts,
                    text,
                    texts,
                    text,
                    PgOid::from(pg_sys::JSONBARRAYOID),
                    PgOid::from(pg_sys::JSONBOID),
                ];
                let prepared = client
                    .prepare_mut(RAISE_MANY_SQL, &types)
                    .expect("the raise_many INSERT prepares");
                *plan = Some(prepared.keep());
            }
            client
                .update(plan.as_ref().unwrap(), None, &args)
                .map(|_| ())
        })
    })
    .unwrap_or_else(|e| panic!("raise_many failed: {e}"));
    if n > 0 {
        // Each run of one topic is looked at once (a batch usually has one or a few).
        let mut last: Option<&str> = None;
        let mut topics = topic_elems.iter().flatten().flatten().filter_map(|t| {
            let fresh = last != Some(t.as_str());
            last = Some(t.as_str());
            fresh.then_some(t.as_str())
        });
        crate::worker::wake_at_commit(&mut topics);
    }
    ids
}
