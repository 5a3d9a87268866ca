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

// Parallel arrays; a one-element header array was turned into $7 by the caller, because unnest
// pads a short array with NULLs rather than repeating it.
const RAISE_MANY_SQL: &str = "INSERT INTO outbox.events (id, topic, subject, tenant, payload, headers) \
     SELECT t.id, t.topic, t.subject, t.tenant, coalesce(t.payload, '{}'::pg_catalog.jsonb), \
            coalesce(t.headers, $7, '{}'::pg_catalog.jsonb) \
       FROM ROWS FROM (pg_catalog.unnest($1), pg_catalog.unnest($2), pg_catalog.unnest($3), \
                       pg_catalog.unnest($4), pg_catalog.unnest($5), pg_catalog.unnest($6)) \
            AS t(id, topic, subject, tenant, payload, headers)";

thread_local! {
    static RAISE_PLAN: RefCell<Option<OwnedPreparedStatement>> = const { RefCell::new(None) };
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
    id
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
    let payloads = payloads_raw.elements("payloads");
    let headers_raw = headers;
    let topics = topics.map(|a| a.strings("topics"));
    let subjects = subjects.map(|a| a.strings("subjects"));
    let tenants = tenants.map(|a| a.strings("tenants"));
    let headers = headers.map(|a| a.elements("headers"));
    let len = |v: &Option<Vec<_>>| v.as_ref().map(Vec::len);
    let n = batch::event_count(
        payloads.len(),
        &[
            Column {
                name: "topics",
                len: len(&topics),
                required: true,
            },
            Column {
                name: "subjects",
                len: len(&subjects),
                required: false,
            },
            Column {
                name: "tenants",
                len: len(&tenants),
                required: false,
            },
            Column {
                name: "headers",
                len: headers.as_ref().map(Vec::len),
                required: false,
            },
        ],
    )
    .or_report();
    let topics = topics.expect("event_count refuses NULL topics");

    // Every column is spread to one element per event (unnest pads, it does not repeat), then
    // checked element by element so an error can name the index the caller got wrong.
    let spread = |column: Option<Vec<Option<String>>>| -> Vec<Option<String>> {
        match column {
            None => vec![None; n],
            Some(v) => (0..n).map(|i| v[batch::pick(v.len(), i)].clone()).collect(),
        }
    };
    let topics = spread(Some(topics));
    let subjects = spread(subjects);
    let tenants = spread(tenants);
    for i in 0..n {
        let at = |what: &str| format!("{what}[{}]", i + 1);
        let topic = topics[i]
            .as_deref()
            .ok_or_else(|| Invalid::null(&at("topics")))
            .or_report();
        topic::validate(topic).or_report();
        check_attributes(subjects[i].as_deref(), tenants[i].as_deref()).or_report();
        if payloads[i].is_some_and(|p| !p.is_object()) {
            not_an_object(&at("payloads")).report();
        }
    }
    for (i, h) in headers.iter().flatten().enumerate() {
        if h.is_some_and(|h| !h.is_object()) {
            not_an_object(&format!("headers[{}]", i + 1)).report();
        }
    }
    // One header object for all events travels as $7; a full array goes through unnest.
    let (header_array, header_all) = match &headers {
        Some(h) if h.len() == 1 && n > 1 => (None, h[0]),
        _ => (headers_raw, None),
    };

    let ids: Vec<pgrx::Uuid> = (0..n).map(|_| new_id()).collect();
    let args = [
        DatumWithOid::from(ids.clone()),
        DatumWithOid::from(topics),
        DatumWithOid::from(subjects),
        DatumWithOid::from(tenants),
        DatumWithOid::from(payloads_raw),
        DatumWithOid::from(header_array),
        DatumWithOid::from(header_all),
    ];
    Spi::connect_mut(|client| client.update(RAISE_MANY_SQL, None, &args).map(|_| ()))
        .unwrap_or_else(|e| panic!("raise_many failed: {e}"));
    ids
}
