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
    /// It reads by ticks (`read_by`)...
    pub by_ticks: bool,
    /// ...and is in this batch (None: at `cursor` of the read horizon's).
    pub batch: Option<Batch>,
}

/// Looks a consumer up (as the owner) and locks its row against concurrent changes. A SQL sink's
/// or a subscription's lease is taken first (waiting for a worker's pass to end), so that the
/// workers pass it over for as long as this transaction stays open rather than wait for its row.
/// (`leases` false: a pull consumer's own calls, which no worker writes for.)
fn lookup_for_update(consumer: &str, leases: bool) -> Option<Consumer> {
    Spi::connect_mut(|client| {
        if leases {
            take_leases(client, consumer)?;
        }
        let rows = client.update(
            "SELECT owner, kind, txid::text, seq, read_by = 'ticks', tick, since::text, upto::text \
               FROM outbox.consumers WHERE name = $1 FOR UPDATE",
            None,
            &[DatumWithOid::from(consumer)],
        )?;
        let mut found = None;
        for row in rows {
            let txid: String = row.get(3)?.expect("txid is NOT NULL");
            let batch = match (row.get::<i64>(6)?, row.get(7)?, row.get(8)?) {
                (Some(tick), Some(since), Some(upto)) => Some(Batch { tick, since, upto }),
                _ => None,
            };
            found = Some(Consumer {
                owner: row.get::<pg_sys::Oid>(1)?.expect("owner is NOT NULL"),
                kind: row.get(2)?.expect("kind is NOT NULL"),
                cursor: Position::new(
                    txid.parse().expect("xid8 prints as an integer"),
                    row.get(4)?.expect("seq"),
                ),
                by_ticks: row.get(5)?.expect("read_by is NOT NULL"),
                batch,
            });
        }
        Ok::<_, pgrx::spi::Error>(found)
    })
    .expect("reading outbox.consumers")
}

/// The lease of `consumer`, if it is a sink or a subscription (`lookup_for_update`). An HTTP or
/// Kafka sink's lease spans its requests and lives in the workers' shared memory: its lock keeps
/// the workers from sending more (`dispatch::http` tries it before a window), and what flies
/// already lands and is recorded first (`wait_for_http_lease`).
fn take_leases(client: &mut pgrx::spi::SpiClient<'_>, consumer: &str) -> pgrx::spi::SpiResult<()> {
    let leases = client.select(
        "SELECT s.lease_key, s.kind = 'sql', x.lease_key \
           FROM outbox.consumers c \
           LEFT JOIN outbox.sinks s ON s.id = c.name \
           LEFT JOIN outbox.subscriptions x ON x.name = c.name \
          WHERE c.name = $1",
        None,
        &[DatumWithOid::from(consumer)],
    )?;
    for row in leases {
        if let Some(key) = row.get::<i32>(1)? {
            crate::lease::xact(crate::lease::Class::Sink, key);
            if row.get::<bool>(2)? == Some(false) {
                crate::worker::wait_for_http_lease(key);
            }
        }
        if let Some(key) = row.get::<i32>(3)? {
            crate::lease::xact(crate::lease::Class::Subscription, key);
        }
    }
    Ok(())
}

/// Validates the name argument of a consumer, sink or subscription (`what`, as the caller calls
/// it, in messages) and refuses a caller that does not act for its owner. Returns the consumer,
/// its row locked.
pub fn owned(what: &'static str, name: Option<&str>, action: &'static str) -> (String, Consumer) {
    owned_with(what, name, action, true)
}

fn owned_with(
    what: &'static str,
    name: Option<&str>,
    action: &'static str,
    leases: bool,
) -> (String, Consumer) {
    let argument = if what == "sink" { "id" } else { what };
    let name = required(name, argument).or_report();
    names::validate(what, name).or_report();
    let me = caller();
    let found = as_owner(|| lookup_for_update(name, leases)).unwrap_or_else(|| {
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
fn owned_pull_consumer(consumer: Option<&str>, action: &'static str) -> (String, Consumer) {
    let (name, found) = owned_with("consumer", consumer, action, false);
    if found.kind != "pull" {
        Error::NotPull {
            name,
            kind: found.kind,
        }
        .report();
    }
    (name, found)
}

/// Parses a position.
fn parse_position(position: Option<&str>, argument: &str) -> Position {
    required(position, argument).or_report().parse().or_report()
}

/// Refuses a position of the read horizon's that no reader can have been handed yet.
fn below_horizon(position: Position) -> Position {
    let horizon = read_rule::horizon();
    if !position.is_below(horizon) {
        Error::BeyondHorizon { position, horizon }.report();
    }
    position
}

/// Parses a position and refuses one no reader by the read horizon can have been handed yet.
fn readable_position(position: Option<&str>, argument: &str) -> Position {
    below_horizon(parse_position(position, argument))
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

/// Inserts a consumer row (as the owner); false when the name is taken. It reads the log as
/// `pg_outbox.read_by` says: by ticks, a pull consumer starts its batch at once (`start_batch`),
/// a sink or subscription at its first pass.
pub fn insert_consumer(name: &str, kind: &str, cursor: Position, owner: pg_sys::Oid) -> bool {
    let ticks = crate::settings::READ_BY.get() == crate::settings::ReadBy::Ticks;
    let batch = (ticks && kind == "pull")
        .then(|| start_batch(cursor, "creating a consumer that reads by ticks"));
    let [n, t, s] = cursor_args(name, cursor);
    as_owner(|| {
        Spi::get_one_with_args::<bool>(
            "INSERT INTO outbox.consumers (name, kind, txid, seq, owner, read_by, tick, since, upto) \
             VALUES ($1, $5, $2::xid8, $3, $4, $6, $7, $8::text::pg_snapshot, $9::text::pg_snapshot) \
             ON CONFLICT (name) DO NOTHING RETURNING true",
            &[
                n,
                t,
                s,
                DatumWithOid::from(owner),
                DatumWithOid::from(kind),
                DatumWithOid::from(if ticks { "ticks" } else { "horizon" }),
                DatumWithOid::from(batch.as_ref().map(|b| b.tick)),
                DatumWithOid::from(batch.as_ref().map(|b| b.since.clone())),
                DatumWithOid::from(batch.as_ref().map(|b| b.upto.clone())),
            ],
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
///
/// A consumer that reads by ticks moves into the batch that holds `position`: its own, or the
/// first batch after it whose tick sees the position's transaction ended (what `outbox.read`
/// handed out, batch after batch).
#[pg_extern(volatile, parallel_unsafe)]
fn advance(consumer: Option<&str>, position: Option<&str>) -> bool {
    let target = parse_position(position, "position");
    let (consumer, found) = owned_pull_consumer(consumer, "advance");
    let Some(batch) = found.batch else {
        return save(&consumer, below_horizon(target));
    };
    match batch_of(&batch, target) {
        Whose::Passed => false,
        Whose::Batch(batch) => save_at(
            &consumer,
            &At {
                pos: target,
                batch: Some(batch),
            },
        ),
        Whose::NotYet => Error::NotInBatch { position: target }.report(),
    }
}

/// Where a position falls for a reader in `batch`.
enum Whose {
    /// In a batch before it: passed.
    Passed,
    /// In this batch (`batch` itself, or one after it).
    Batch(Batch),
    /// In no batch yet: its transaction was running (or had not begun) at the newest tick.
    NotYet,
}

/// The batch of a reader in `batch` that holds `position`: its own if the position's transaction
/// is one `upto` sees and `since` does not; else the first batch after it (chained as
/// `outbox.read` reads them: each from the snapshot the one before ends at) whose tick sees it.
fn batch_of(batch: &Batch, position: Position) -> Whose {
    let row = as_owner(|| {
        Spi::connect(|client| {
            let table = client.select(
                "SELECT pg_catalog.pg_visible_in_snapshot($1::xid8, $2::text::pg_snapshot), \
                        pg_catalog.pg_visible_in_snapshot($1::xid8, $3::text::pg_snapshot), \
                        n.tick, n.since, n.upto \
                   FROM (SELECT 1) one \
                   LEFT JOIN LATERAL ( \
                        SELECT b.tick, b.since::text, b.upto::text \
                          FROM (SELECT t.tick, t.snapshot AS upto, \
                                       coalesce(lag(t.snapshot) OVER (ORDER BY t.tick), \
                                                $3::text::pg_snapshot) AS since \
                                  FROM outbox.ticks t WHERE t.tick > $4) b \
                         WHERE pg_catalog.pg_visible_in_snapshot($1::xid8, b.upto) \
                         ORDER BY b.tick LIMIT 1) n ON true",
                Some(1),
                &[
                    DatumWithOid::from(position.txid.to_string()),
                    DatumWithOid::from(batch.since.as_str()),
                    DatumWithOid::from(batch.upto.as_str()),
                    DatumWithOid::from(batch.tick),
                ],
            )?;
            let row = table.first();
            Ok::<_, pgrx::spi::Error>((
                row.get::<bool>(1)?.expect("visible"),
                row.get::<bool>(2)?.expect("visible"),
                match (row.get::<i64>(3)?, row.get(4)?, row.get(5)?) {
                    (Some(tick), Some(since), Some(upto)) => Some(Batch { tick, since, upto }),
                    _ => None,
                },
            ))
        })
    })
    .unwrap_or_else(|e| panic!("finding the batch of {position}: {e}"));
    match row {
        (true, _, _) => Whose::Passed,
        (false, true, _) => Whose::Batch(batch.clone()),
        (false, false, Some(later)) => Whose::Batch(later),
        (false, false, None) => Whose::NotYet,
    }
}

/// The batch a reader at `pos` that starts to read by ticks is in, from now on: from `since`, a
/// snapshot that sees every transaction before `pos` ended and none after (a position of the read
/// horizon's: they all had ended), to `upto`, this statement's snapshot, taken while the tick
/// takers' lock is held (only then, see `lease::with_ticks_held`): every tick after `tick`, the
/// newest, is taken after it and sees what it sees, so the batches after chain on from it.
/// `what` names the call, for the error in REPEATABLE READ (whose snapshot may be older than a
/// tick it cannot see).
pub fn start_batch(pos: Position, what: &'static str) -> Batch {
    // SAFETY: reads a backend global.
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        Error::Isolation {
            what,
            why: "a reader by ticks starts its batch at a snapshot taken after the newest tick committed",
        }
        .report();
    }
    let (tick, upto) = crate::lease::with_ticks_held(|| {
        as_owner(|| {
            Spi::get_two::<i64, String>(
                "SELECT coalesce(max(t.tick), 0), outbox._log_snapshot() FROM outbox.ticks t",
            )
        })
    })
    .unwrap_or_else(|e| panic!("starting a batch: {e}"));
    let seen = pos.txid.max(1);
    Batch {
        tick: tick.expect("coalesce"),
        since: format!("{seen}:{seen}:"),
        upto: upto.expect("a snapshot"),
    }
}

/// Changes options of a pull consumer its caller owns (see `pg_outbox_core::options`):
/// `read_by` "ticks" makes it read batch by batch, from where it is, at once; a consumer that
/// reads by ticks goes on doing so.
#[pg_extern(volatile, parallel_unsafe)]
fn alter_consumer(consumer: Option<&str>, options: Option<pgrx::JsonB>) {
    let (name, found) = owned_pull_consumer(consumer, "alter");
    let options = required(options, "options").or_report();
    let options = pg_outbox_core::options::parse_consumer(&options.0).or_report();
    match (options.read_by_ticks, found.by_ticks) {
        (None, _) | (Some(true), true) | (Some(false), false) => {}
        (Some(false), true) => Error::ReadBy {
            what: "consumer",
            name,
            why: "reads by ticks and cannot go back to the read horizon",
        }
        .report(),
        (Some(true), false) => {
            // Held until commit: pruning keeps the ticks this batch goes on from (ticks::prune).
            lock_cursors_shared();
            let batch = start_batch(found.cursor, "outbox.alter_consumer()");
            as_owner(|| {
                Spi::run_with_args(
                    "UPDATE outbox.consumers SET read_by = 'ticks', tick = $2, \
                            since = $3::text::pg_snapshot, upto = $4::text::pg_snapshot \
                      WHERE name = $1",
                    &[
                        DatumWithOid::from(name.as_str()),
                        DatumWithOid::from(batch.tick),
                        DatumWithOid::from(batch.since.as_str()),
                        DatumWithOid::from(batch.upto.as_str()),
                    ],
                )
            })
            .unwrap_or_else(|e| panic!("altering consumer: {e}"));
            // The workers tick once it reads by ticks (crate::ticks::wanted): soon, not at a poll.
            crate::worker::wake_at_commit_always();
        }
    }
}

/// Moves a consumer's (or sink's) cursor to `position`, backward or forward, on purpose. Logged.
/// Returns the position it had before. Events already pruned do not come back.
#[pg_extern(volatile, parallel_unsafe)]
fn rewind(consumer: Option<&str>, position: Option<&str>) -> String {
    let target = readable_position(position, "position");
    lock_cursors_shared();
    let (consumer, found) = owned_consumer(consumer, "rewind");
    // A pull consumer by ticks starts a batch there at once; a sink's or subscription's worker
    // does at its next pass, under its lease.
    let batch =
        (found.by_ticks && found.kind == "pull").then(|| start_batch(target, "outbox.rewind()"));
    let [n, t, s] = cursor_args(&consumer, target);
    as_owner(|| {
        Spi::run_with_args(
            "UPDATE outbox.consumers SET txid = $2::xid8, seq = $3, tick = $4, \
                    since = $5::text::pg_snapshot, upto = $6::text::pg_snapshot, \
                    rewinds = rewinds + 1, moved_at = now() WHERE name = $1",
            &[
                n,
                t,
                s,
                DatumWithOid::from(batch.as_ref().map(|b| b.tick)),
                DatumWithOid::from(batch.as_ref().map(|b| b.since.clone())),
                DatumWithOid::from(batch.as_ref().map(|b| b.upto.clone())),
            ],
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
    let (consumer, _) = owned_pull_consumer(name, "drop");
    as_owner(|| {
        Spi::run_with_args(
            "DELETE FROM outbox.consumers WHERE name = $1",
            &[DatumWithOid::from(consumer.as_str())],
        )
    })
    .unwrap_or_else(|e| panic!("dropping consumer: {e}"));
}
