//! Dead letters and replay: `outbox.replay(sink, position)` and `outbox.replay(sink)` mark dead
//! letters for re-delivery; the worker hands each one alone to that sink (and no other) at the
//! start of the sink's next pass. Delivered: the dead letter is deleted. Failed again: it stays,
//! with one more attempt and the new error.

use crate::cursor::owned;
use crate::dispatch::PassResult;
use crate::error::{Error, OrReport};
use crate::owner::as_owner;
use crate::transaction::Failure;
use pg_outbox_core::{required, Position};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

/// In a sink's pass: re-delivers the first dead letter marked for replay, if any.
pub fn deliver_requested(
    client: &mut SpiClient<'_>,
    sink: &str,
    deliver: impl FnOnce(&mut SpiClient<'_>, pg_sys::Datum) -> Result<(), Failure>,
) -> Result<Option<PassResult>, pgrx::spi::Error> {
    // Every pass asks: a kept plan.
    let table = crate::plans::select(
        client,
        // d.txid: a bare txid in ORDER BY would be the text output column (see prune_bound).
        "SELECT d.txid::text, d.seq, ARRAY[d.event] FROM outbox.dead_letters d \
          WHERE d.sink = $1 AND d.replay_requested_at IS NOT NULL ORDER BY d.txid, d.seq LIMIT 1",
        Some(1),
        &[DatumWithOid::from(sink)],
    )?;
    if table.is_empty() {
        return Ok(None);
    }
    let row = table.first();
    let txid: String = row.get(1)?.expect("txid");
    let position = Position::new(txid.parse().expect("xid8"), row.get(2)?.expect("seq"));
    let events = row
        .get_datum_by_ordinal(3)?
        .expect("ARRAY[event] is not NULL");
    let key = [
        DatumWithOid::from(sink),
        DatumWithOid::from(position.txid.to_string()),
        DatumWithOid::from(position.seq),
    ];
    match deliver(client, events) {
        Ok(()) => {
            client.update(
                "DELETE FROM outbox.dead_letters WHERE sink = $1 AND txid = $2::pg_catalog.xid8 AND seq = $3",
                None,
                &key,
            )?;
            pgrx::log!("pg_outbox: sink \"{sink}\" accepted replayed event {position}");
            Ok(Some(PassResult::Delivered {
                events: 1,
                full: true,
            }))
        }
        Err(failure) => {
            let [s, t, q] = key;
            client.update(
                "UPDATE outbox.dead_letters SET attempts = attempts + 1, error = $4, sqlstate = $5, \
                        dead_at = pg_catalog.now(), replay_requested_at = NULL \
                  WHERE sink = $1 AND txid = $2::pg_catalog.xid8 AND seq = $3",
                None,
                &[s, t, q, DatumWithOid::from(failure.message.as_str()), DatumWithOid::from(failure.sqlstate.as_str())],
            )?;
            pgrx::warning!("pg_outbox: sink \"{sink}\" failed on replayed event {position}, back to the dead letters: {failure}");
            Ok(Some(PassResult::Retry))
        }
    }
}

/// The replayed dead letter a sink's handler was working on when its worker was ended (it ran
/// past `pg_outbox.sink_timeout` and did not stop, see `worker::InHandler`): the replay failed.
/// It goes back to the dead letters with one more attempt and that error, and is not replayed
/// again until asked, or every pass of the sink would end another worker on it. Runs in the
/// transaction of the worker started in the ended one's place.
pub fn after_hang(sink: &str) {
    if !crate::dispatch::lock_tables() {
        return;
    }
    let failure = crate::dispatch::hang_failure();
    let position = Spi::get_one_with_args::<String>(
        "UPDATE outbox.dead_letters d SET attempts = d.attempts + 1, error = $2, sqlstate = $3, \
                dead_at = pg_catalog.now(), replay_requested_at = NULL \
          WHERE (d.sink, d.txid, d.seq) = (SELECT f.sink, f.txid, f.seq FROM outbox.dead_letters f \
                                           WHERE f.sink = $1 AND f.replay_requested_at IS NOT NULL \
                                           ORDER BY f.txid, f.seq LIMIT 1) \
         RETURNING d.txid::text || ':' || d.seq::text",
        &[
            DatumWithOid::from(sink),
            DatumWithOid::from(failure.message.as_str()),
            DatumWithOid::from(failure.sqlstate.as_str()),
        ],
    )
    .unwrap_or(None);
    if let Some(position) = position {
        pgrx::warning!(
            "pg_outbox: sink \"{sink}\" failed on replayed event {position}, back to the dead letters: {failure}"
        );
    }
}

fn request(sink: &str, position: Option<Position>) -> i64 {
    let mut args = vec![DatumWithOid::from(sink)];
    if let Some(p) = position {
        args.push(DatumWithOid::from(p.txid.to_string()));
        args.push(DatumWithOid::from(p.seq));
    }
    let sql = if position.is_some() {
        "WITH r AS (UPDATE outbox.dead_letters SET replay_requested_at = now() \
                     WHERE sink = $1 AND txid = $2::xid8 AND seq = $3 RETURNING 1) SELECT count(*) FROM r"
    } else {
        "WITH r AS (UPDATE outbox.dead_letters SET replay_requested_at = now() \
                     WHERE sink = $1 RETURNING 1) SELECT count(*) FROM r"
    };
    as_owner(|| Spi::get_one_with_args::<i64>(sql, &args))
        .expect("requesting a replay")
        .unwrap_or(0)
}

fn owned_sink(sink: Option<&str>) -> String {
    let (name, consumer) = owned("sink", sink, "replay to");
    if consumer.kind != "sink" {
        Error::NotASink(name).report();
    }
    name
}

/// Re-delivers one dead event to its sink (only that sink). Logged.
#[pg_extern(volatile, parallel_unsafe, name = "replay")]
fn replay_one(sink: Option<&str>, position: Option<&str>) -> bool {
    let position: Position = required(position, "position")
        .or_report()
        .parse()
        .or_report();
    let sink = owned_sink(sink);
    if request(&sink, Some(position)) == 0 {
        Error::NoDeadLetter { sink, position }.report();
    }
    pgrx::log!("pg_outbox: replay of event {position} to sink \"{sink}\" requested");
    crate::worker::wake_at_commit_always();
    true
}

/// Re-delivers every dead event of a sink, in log order. Returns how many. Logged.
#[pg_extern(volatile, parallel_unsafe, name = "replay")]
fn replay_all(sink: Option<&str>) -> i64 {
    let sink = owned_sink(sink);
    let n = request(&sink, None);
    pgrx::log!("pg_outbox: replay of {n} dead events to sink \"{sink}\" requested");
    crate::worker::wake_at_commit_always();
    n
}
