//! Leases and serialisation that no other role can take or block.
//!
//! Until 0.1.0 the leases were advisory locks with predictable keys, and any role with CONNECT
//! could take them first: `SELECT pg_advisory_lock(1869968499, k) FROM generate_series(1, 20) k`
//! stopped every sink. These are heavyweight locks of the lock manager too (so they are released
//! with the transaction or the session that holds them, and a worker that dies releases its own),
//! but on a tag that no SQL function can build: the advisory-lock functions only ever set the
//! tag's fourth field to 1 (one bigint key) or 2 (two integer keys), and this module sets it to
//! `FIELD4`. They still show in `pg_locks` (locktype `advisory`, objsubid 28533), which is
//! what an operator wants to see.

use pgrx::pg_sys;

/// The tag's fourth field ("ou"): never 1 or 2, the only values SQL's advisory locks use.
const FIELD4: u16 = 0x6f75;

/// What a lock serialises; the tag's second field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// A SQL sink's delivery: one worker at a time. Key: the sink's lease_key. (An HTTP sink's
    /// lease spans transactions and lives in the workers' shared memory: worker::try_http_lease.)
    Sink = 1,
    /// A subscription's fan-out. Key: the subscription's lease_key.
    Subscription = 2,
    /// Cursors being born or moved back (shared) against pruning's bound (exclusive). Key: 0.
    Cursors = 3,
    /// An each schedule's run: one worker at a time. Key: hashtext of its name (two names that
    /// share one only take turns).
    Schedule = 4,
    /// Taking a tick (`outbox._tick()`): one taker at a time, in the order they asked. Key: 0.
    Ticks = 5,
}

fn tag(class: Class, key: i32) -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        // SAFETY: reads a backend global, set once the process is connected to its database.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: class as u32,
        locktag_field3: key as u32,
        locktag_field4: FIELD4,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

fn acquire(class: Class, key: i32, mode: u32, wait: bool) -> bool {
    let tag = tag(class, key);
    // SAFETY: a lock-manager call with a valid tag from this backend, inside a transaction (the
    // lock is transaction-scoped: released with it, whatever ends it).
    let result = unsafe { pg_sys::LockAcquire(&tag, mode as pg_sys::LOCKMODE, false, !wait) };
    result != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
}

/// Takes the lease of `class`/`key` until the transaction ends, without waiting. False when
/// another process holds it.
pub fn try_xact(class: Class, key: i32) -> bool {
    acquire(class, key, pg_sys::ExclusiveLock, false)
}

/// Takes the lease of `class`/`key` until the transaction ends, waiting for a worker's pass that
/// holds it. What a role's own change to a sink or subscription does (`cursor::owned`): while its
/// transaction stays open the workers, which only try leases, pass that consumer over instead of
/// waiting for the rows it holds.
pub fn xact(class: Class, key: i32) {
    acquire(class, key, pg_sys::ExclusiveLock, true);
}

/// Shared: a cursor is being created or moved back in this transaction. Waits while pruning
/// computes its bound (a few milliseconds).
pub fn cursors_shared() {
    acquire(Class::Cursors, 0, pg_sys::ShareLock, true);
}

/// Exclusive, for pruning's bound: false (and nothing pruned this time) while any transaction is
/// creating or rewinding a cursor. `wait` only for an operator's own `outbox.prune()` call, which
/// they can cancel; the workers never wait, so a role that leaves such a transaction open cannot
/// hold a worker.
pub fn cursors_exclusive(wait: bool) -> bool {
    acquire(Class::Cursors, 0, pg_sys::ExclusiveLock, wait)
}

/// Exclusive, waiting: this transaction takes a tick, after the one before it committed (the lock
/// is released when it does). Held by the workers' tick transactions only, which are short.
pub fn ticks_exclusive() {
    acquire(Class::Ticks, 0, pg_sys::ExclusiveLock, true);
}

/// Runs `f` holding the tick takers' lock, released as soon as it returns (an error releases it
/// with the transaction): a reader that starts a batch of its own (`cursor::start_batch`) takes
/// its snapshot after the newest tick committed and before the next is taken, and needs nothing
/// more. A role's own call so never holds a tick back, however long its transaction stays open.
pub fn with_ticks_held<R>(f: impl FnOnce() -> R) -> R {
    ticks_exclusive();
    let result = f();
    let tag = tag(Class::Ticks, 0);
    // SAFETY: releases the hold this backend took above (one of its holds, if it had more).
    unsafe { pg_sys::LockRelease(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, false) };
    result
}
