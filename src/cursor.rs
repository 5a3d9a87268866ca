//! Consumers and their cursors: create, advance, rewind, drop. (Reading is `outbox.read` in
//! `sql/schema.sql`, on top of the read rule.)
//!
//! A cursor is the position of the last event a consumer has consumed. It only moves forward:
//! `advance` (and a sink's delivery) is a conditional UPDATE that applies only when the new
//! position is greater, and a trigger on `outbox.consumers` refuses any other backward move;
//! `rewind` is the one explicit, logged way back.

use crate::error::{Error, OrReport};
use crate::owner::{acts_for, as_owner, caller};
use crate::read_rule;
use pg_outbox_core::{name as names, required, Position, StartAt};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

/// Taken shared by whatever adds or moves back a cursor (create, rewind) and exclusive by prune,
/// so that prune never computes its bound while a cursor behind it is being born.
pub fn lock_cursors_shared() {
    crate::lease::cursors_shared();
}

/// A consumer row as this module needs it.
pub struct Consumer {
    pub owner: pg_sys::Oid,
    pub kind: String,
    pub cursor: Position,
}

/// Looks a consumer up (as the owner) and locks its row against concurrent changes.
fn lookup_for_update(consumer: &str) -> Option<Consumer> {
    Spi::connect_mut(|client| {
        let rows = client.update(
            "SELECT owner, kind, txid::text, seq FROM outbox.consumers WHERE name = $1 FOR UPDATE",
            None,
            &[DatumWithOid::from(consumer)],
        )?;
        let mut found = None;
        for row in rows {
            let txid: String = row.get(3)?.expect("txid is NOT NULL");
            found = Some(Consumer {
                owner: row.get::<pg_sys::Oid>(1)?.expect("owner is NOT NULL"),
                kind: row.get(2)?.expect("kind is NOT NULL"),
                cursor: Position::new(
                    txid.parse().expect("xid8 prints as an integer"),
                    row.get(4)?.expect("seq"),
                ),
            });
        }
        Ok::<_, pgrx::spi::Error>(found)
    })
    .expect("reading outbox.consumers")
}

/// Validates the name argument of a consumer, sink or subscription (`what`, as the caller calls
/// it, in messages) and refuses a caller that does not act for its owner. Returns the consumer,
/// its row locked.
pub fn owned(what: &'static str, name: Option<&str>, action: &'static str) -> (String, Consumer) {
    let argument = if what == "sink" { "id" } else { what };
    let name = required(name, argument).or_report();
    names::validate(what, name).or_report();
    let me = caller();
    let found = as_owner(|| lookup_for_update(name)).unwrap_or_else(|| {
        Error::UnknownConsumer {
            what,
            name: name.into(),
        }
        .report()
    });
    if !acts_for(me, found.owner) {
        Error::NotOwner {
            what,
            consumer: name.into(),
            action,
        }
        .report();
    }
    (name.to_string(), found)
}

/// `owned` for a consumer of any kind.
pub fn owned_consumer(consumer: Option<&str>, action: &'static str) -> (String, Consumer) {
    owned("consumer", consumer, action)
}

/// `owned_consumer`, refusing a sink (its cursor moves with its deliveries).
fn owned_pull_consumer(consumer: Option<&str>, action: &'static str) -> String {
    let (name, found) = owned_consumer(consumer, action);
    if found.kind != "pull" {
        Error::NotPull {
            name,
            kind: found.kind,
        }
        .report();
    }
    name
}

/// Parses a position and refuses one no reader can have been handed yet.
fn readable_position(position: Option<&str>, argument: &str) -> Position {
    let position: Position = required(position, argument).or_report().parse().or_report();
    let horizon = read_rule::horizon();
    if !position.is_below(horizon) {
        Error::BeyondHorizon { position, horizon }.report();
    }
    position
}

fn cursor_args(consumer: &str, p: Position) -> [DatumWithOid<'static>; 3] {
    [
        DatumWithOid::from(consumer.to_string()),
        DatumWithOid::from(p.txid.to_string()),
        DatumWithOid::from(p.seq),
    ]
}

/// The cursor a new consumer or sink starts at; validated against the horizon.
pub fn start_cursor(start_at: Option<&str>) -> Position {
    let start: StartAt = required(start_at, "start_at")
        .or_report()
        .parse()
        .or_report();
    let horizon = read_rule::horizon();
    if let StartAt::After(position) = start {
        if !position.is_below(horizon) {
            Error::BeyondHorizon { position, horizon }.report();
        }
    }
    start.cursor(horizon)
}

/// Inserts a consumer row (as the owner); false when the name is taken.
pub fn insert_consumer(name: &str, kind: &str, cursor: Position, owner: pg_sys::Oid) -> bool {
    let [n, t, s] = cursor_args(name, cursor);
    as_owner(|| {
        Spi::get_one_with_args::<bool>(
            "INSERT INTO outbox.consumers (name, kind, txid, seq, owner) \
             VALUES ($1, $5, $2::xid8, $3, $4) ON CONFLICT (name) DO NOTHING RETURNING true",
            &[n, t, s, DatumWithOid::from(owner), DatumWithOid::from(kind)],
        )
    })
    .map(|inserted| inserted.unwrap_or(false))
    .or_else(|e| match e {
        pgrx::spi::Error::InvalidPosition => Ok(false),
        e => Err(e),
    })
    .unwrap_or_else(|e| panic!("creating consumer: {e}"))
}

/// Moves a cursor forward to `to`; false (and nothing changed) when it is not ahead. The
/// condition, not the caller, decides: a late save from a holder that lost its lease compares
/// against the row as it is now and changes nothing. A cursor of the read horizon's: a reader
/// that reads by ticks is past it (see [`At`]).
pub fn save(name: &str, to: Position) -> bool {
    as_owner(|| {
        crate::plans::applied(
            "UPDATE outbox.consumers SET txid = $2::xid8, seq = $3, moved_at = now() \
              WHERE name = $1 AND (coalesce(tick, 0), txid, seq) < (0, $2::xid8, $3) RETURNING true",
            &cursor_args(name, to),
        )
    })
    .unwrap_or_else(|e| panic!("moving cursor of \"{name}\": {e}"))
}

/// The batch a reader by ticks is in (issue 15, `sql/ticks.sql`): the events of the transactions
/// the snapshot of `tick` (`upto`) sees and `since` does not. Both snapshots are kept with the
/// cursor (pg_snapshot text, in the log's terms): the batch does not need its ticks any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub tick: i64,
    pub since: String,
    pub upto: String,
}

/// Where a reader is: `pos`, read by the read horizon (`batch` None), or within a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct At {
    pub pos: Position,
    pub batch: Option<Batch>,
}

impl At {
    pub fn horizon(pos: Position) -> At {
        At { pos, batch: None }
    }
}

impl std::fmt::Display for At {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.batch {
            None => write!(f, "{}", self.pos),
            Some(b) => write!(f, "{} (tick {})", self.pos, b.tick),
        }
    }
}

/// [`save`] for a reader that may read by ticks: moves it forward to `to`, batch and all.
pub fn save_at(name: &str, to: &At) -> bool {
    let Some(batch) = &to.batch else {
        return save(name, to.pos);
    };
    let [n, t, s] = cursor_args(name, to.pos);
    as_owner(|| {
        crate::plans::applied(
            "UPDATE outbox.consumers SET tick = $4, since = $5::text::pg_catalog.pg_snapshot, \
                    upto = $6::text::pg_catalog.pg_snapshot, txid = $2::xid8, seq = $3, moved_at = now() \
              WHERE name = $1 AND (coalesce(tick, 0), txid, seq) < ($4, $2::xid8, $3) RETURNING true",
            &[
                n,
                t,
                s,
                DatumWithOid::from(batch.tick),
                DatumWithOid::from(batch.since.as_str()),
                DatumWithOid::from(batch.upto.as_str()),
            ],
        )
    })
    .unwrap_or_else(|e| panic!("moving cursor of \"{name}\": {e}"))
}

/// Creates a pull consumer and returns its starting cursor.
///
/// `start_at`: 'origin' (everything the log still holds), 'now' (only transactions not yet
/// readable at creation), or a position to start after.
#[pg_extern(volatile, parallel_unsafe)]
fn create_consumer(name: Option<&str>, start_at: default!(Option<&str>, "'origin'")) -> String {
    let consumer = required(name, "name").or_report();
    names::validate("consumer", consumer).or_report();
    lock_cursors_shared();
    let cursor = start_cursor(start_at);
    if !insert_consumer(consumer, "pull", cursor, caller()) {
        Error::ConsumerExists(consumer.into()).report();
    }
    cursor.to_string()
}

/// Moves a pull consumer's cursor forward to `position` (the last event it has consumed).
/// Returns false, and leaves the cursor alone, when that would not move it forward.
#[pg_extern(volatile, parallel_unsafe)]
fn advance(consumer: Option<&str>, position: Option<&str>) -> bool {
    let target = readable_position(position, "position");
    let consumer = owned_pull_consumer(consumer, "advance");
    save(&consumer, target)
}

/// Moves a consumer's (or sink's) cursor to `position`, backward or forward, on purpose. Logged.
/// Returns the position it had before. Events already pruned do not come back.
#[pg_extern(volatile, parallel_unsafe)]
fn rewind(consumer: Option<&str>, position: Option<&str>) -> String {
    let target = readable_position(position, "position");
    lock_cursors_shared();
    let (consumer, found) = owned_consumer(consumer, "rewind");
    as_owner(|| {
        Spi::run_with_args(
            "UPDATE outbox.consumers SET txid = $2::xid8, seq = $3, tick = NULL, since = NULL, upto = NULL, \
                    rewinds = rewinds + 1, moved_at = now() WHERE name = $1",
            &cursor_args(&consumer, target),
        )
    })
    .unwrap_or_else(|e| panic!("rewinding consumer: {e}"));
    // SAFETY: the caller's role exists while it is calling; noerr returns NULL otherwise.
    let by = unsafe {
        let name = pg_sys::GetUserNameFromId(caller(), true);
        if name.is_null() {
            "?".to_string()
        } else {
            std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned()
        }
    };
    pgrx::log!(
        "pg_outbox: {} \"{consumer}\" rewound from {} to {target} by role {}",
        found.kind,
        found.cursor,
        pgrx::spi::quote_identifier(&by)
    );
    found.cursor.to_string()
}

/// Drops a pull consumer and its cursor. Events it alone was holding become prunable.
#[pg_extern(volatile, parallel_unsafe)]
fn drop_consumer(name: Option<&str>) {
    let consumer = owned_pull_consumer(name, "drop");
    as_owner(|| {
        Spi::run_with_args(
            "DELETE FROM outbox.consumers WHERE name = $1",
            &[DatumWithOid::from(consumer.as_str())],
        )
    })
    .unwrap_or_else(|e| panic!("dropping consumer: {e}"));
}
