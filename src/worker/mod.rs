//! The background workers: the launcher, shared memory, waking at commit, and their status.
//!
//! Registered from `_PG_init` only when pg_outbox is in `shared_preload_libraries`: one launcher
//! (`launcher.rs`) that starts the workers of every database where pg_outbox is installed as
//! dynamic background workers. Each worker keeps a slot in shared memory with its database, its
//! PGPROC (so a committing backend can set its latch), what handler it runs (so the launcher can
//! start another while all of a database's workers are busy) and counters that
//! `outbox.workers()` reads.

mod launcher;
mod run;

use crate::settings;
use pgrx::bgworkers::{BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::lwlock::PgLwLock;
use pgrx::prelude::*;
use pgrx::shmem::PGRXSharedMemory;
use pgrx::{pg_shmem_init, PgXactCallbackEvent};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const ERROR_BYTES: usize = 200;
/// `InHandler::kind` of a handler call in a fan-out pass.
const INLINE: u8 = 6;
/// Job ids one handler call can hold: dispatch::jobs::BATCH.
const JOBS_MAX: usize = 50;

/// What a worker's handler call is working on, kept in the worker's slot while the handler runs.
/// A handler that outlives `sink_timeout` and its grace ends the worker (it cannot be stopped
/// otherwise); shared memory outlives the worker's exit, so the worker started in its place finds
/// this and counts the failure durably (`dispatch::after_hang`), instead of running the same
/// handler on the same events for ever.
#[derive(Copy, Clone)]
struct InHandler {
    /// 0: none; 1: a sink's batch; 2: a sink's neighbour test; 3: a subscription's jobs; 4: an
    /// each schedule's query; 5: a sink's replayed dead letter; 6: a subscription's matches run
    /// in its fan-out pass.
    kind: u8,
    name: [u8; 64],
    name_len: u8,
    since: i64,
    jobs: [i64; JOBS_MAX],
    jobs_len: u8,
    /// A sink's batch: how many events its pass handed over before this one, in the same
    /// transaction (lost with the worker, so handed over again before the failure is counted).
    before: u32,
}

impl Default for InHandler {
    fn default() -> Self {
        InHandler {
            kind: 0,
            name: [0; 64],
            name_len: 0,
            since: 0,
            jobs: [0; JOBS_MAX],
            jobs_len: 0,
            before: 0,
        }
    }
}

/// What a handler call works on (see `InHandler`).
pub(crate) enum Target<'a> {
    Sink {
        id: &'a str,
        neighbour: bool,
        /// Events the pass handed over before this call, in the same transaction.
        before: u32,
    },
    Jobs {
        subscription: &'a str,
        ids: &'a [i64],
    },
    /// A subscription's matches run in the fan-out pass that found them (`dispatch::fanout`).
    Inline { subscription: &'a str },
    /// The query of an each schedule.
    Schedule { name: &'a str },
    /// A dead letter replayed to a sink.
    Replay { sink: &'a str },
}

/// A handler call that ended its worker: found by the worker started in its place.
#[derive(Debug)]
pub(crate) enum Hung {
    Sink {
        id: String,
        neighbour: bool,
        before: u32,
    },
    Jobs {
        subscription: String,
        ids: Vec<i64>,
    },
    Inline {
        subscription: String,
    },
    Schedule {
        name: String,
    },
    Replay {
        sink: String,
    },
}

/// A slot's life: the launcher takes a free slot for a database (Starting), the worker it starts
/// connects (Running), and on exit marks it Exited with an outcome; the launcher reaps it (Free,
/// or Starting again to finish the work of a worker that hung in a handler).
pub(crate) const FREE: u8 = 0;
pub(crate) const STARTING: u8 = 1;
pub(crate) const RUNNING: u8 = 2;
pub(crate) const EXITED: u8 = 3;

/// Why a worker exited (kept in its slot for the launcher).
pub(crate) const OUTCOME_NONE: u8 = 0;
/// pg_outbox is not installed in its database (any more).
pub(crate) const OUTCOME_ABSENT: u8 = 1;
/// An extra worker that had nothing to do.
pub(crate) const OUTCOME_RETIRED: u8 = 2;
/// Its database is not in `pg_outbox.databases` (any more).
pub(crate) const OUTCOME_EXCLUDED: u8 = 3;

#[derive(Copy, Clone)]
pub struct Slot {
    state: u8,
    outcome: u8,
    /// The worker found pg_outbox installed in its database (a worker starts as a probe).
    installed: bool,
    /// The worker connected (set once; a worker that exits without it never got in).
    connected: bool,
    /// An extra worker on its way out (`try_retire`): commits wake the others.
    retiring: bool,
    /// The launcher asks it to exit at its next step (another database needs the room).
    retire: bool,
    /// The launcher has counted its exit (see `launcher::Launcher::reap`).
    reaped: bool,
    /// Whether its database has any sink or subscription, as the worker last saw it. Commits wake
    /// the workers only then: without them a round finds nothing, and a wake per commit would
    /// spend the CPU the writers need.
    has_sinks: bool,
    /// The topics its sinks and subscriptions read, as the worker last saw them (see
    /// `Interest`): a commit that raised only other topics wakes nobody.
    interest: Interest,
    proc_ptr: usize,
    pid: i32,
    /// The database the worker delivers in (an Oid), set by the launcher.
    database: u32,
    /// When the launcher asked for the worker.
    requested_at: i64,
    /// In a round (not waiting on its latch): a commit wakes an idle worker instead.
    busy: bool,
    /// A commit wanted it while it was in a round. The latch alone is not enough: a handler
    /// that waits (pg_sleep, a lock) resets the latch, and the wake would be lost.
    woken: bool,
    /// Commits announced more queues than `WorkerTable::announced` holds: the worker notifies
    /// every queue of its database that has jobs to claim (see `announce_at_commit`).
    announce_all: bool,
    /// A job comes due or expires by then (a timestamptz; 0: none): a commit queued one not yet
    /// due (a delayed job, a retry's back-off), or another worker learnt of one. The first worker
    /// of the database looks for jobs then, if not sooner.
    look_by: i64,
    /// When the worker looks for jobs next (0: it does not, or not known).
    looks_at: i64,
    started_at: i64,
    last_pass_at: i64,
    passes: u64,
    delivered: u64,
    failures: u64,
    last_error: [u8; ERROR_BYTES],
    last_error_len: u16,
    handler: InHandler,
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            state: FREE,
            outcome: OUTCOME_NONE,
            installed: false,
            connected: false,
            retiring: false,
            retire: false,
            reaped: false,
            has_sinks: false,
            interest: Interest::default(),
            proc_ptr: 0,
            pid: 0,
            database: 0,
            requested_at: 0,
            busy: false,
            woken: false,
            announce_all: false,
            look_by: 0,
            looks_at: 0,
            started_at: 0,
            last_pass_at: 0,
            passes: 0,
            delivered: 0,
            failures: 0,
            last_error: [0; ERROR_BYTES],
            last_error_len: 0,
            handler: InHandler::default(),
        }
    }
}

impl Slot {
    /// A worker process holds it (or is about to).
    fn taken(&self) -> bool {
        self.state != FREE
    }

    /// A live worker of `database` whose latch can be set.
    fn serving(&self, database: u32) -> bool {
        self.state == RUNNING && self.database == database && self.proc_ptr != 0 && !self.retiring
    }

    /// Inside a tenant's handler.
    fn in_handler(&self) -> bool {
        self.handler.kind != 0
    }

    /// The handler it was running outlived `sink_timeout` (a fan-out pass's handler call: the
    /// worker was ended by its hard timeout, see `on_worker_exit`): the worker was ended inside
    /// it.
    fn hung(&self) -> bool {
        self.in_handler()
            && (self.handler.kind == INLINE
                || (now() - self.handler.since) / 1000 >= settings::SINK_TIMEOUT_MS.get() as i64)
    }
}

/// Databases where CREATE EXTENSION committed, for the launcher to look at (0: none).
const PROBE_REQUESTS: usize = 16;

/// An HTTP sink's lease while its request flies (see `try_http_lease`).
#[derive(Copy, Clone, Default)]
struct HttpLease {
    database: u32,
    key: i32,
    slot: u16,
    /// The holder; 0: free. Stale once the slot has another pid (its worker exited).
    pid: i32,
}

/// HTTP requests in flight at once, cluster-wide, and of one database (so that one database's
/// endpoints that never answer cannot hold every lease).
const HTTP_LEASES: usize = 512;
const HTTP_LEASES_PER_DATABASE: usize = 128;
/// Jobs remembered as suspects (see `mark_suspects`), cluster-wide; the oldest are forgotten.
const SUSPECTS: usize = 1024;
/// Subscriptions whose matches no longer run in the fan-out pass (see `queue_only`),
/// cluster-wide; the oldest are forgotten.
const QUEUE_ONLY: usize = 256;

#[derive(Copy, Clone)]
pub struct WorkerTable {
    slots: [Slot; settings::WORKER_SLOTS],
    /// The launcher's PGPROC (0: not running), so workers and backends can wake it.
    launcher_proc: usize,
    launcher_pid: i32,
    /// The launcher times a database whose workers are all in handlers already: they need not
    /// wake it at each handler call.
    launcher_watching: bool,
    probe_requests: [u32; PROBE_REQUESTS],
    /// More databases asked than `probe_requests` holds: look at every database again.
    probe_all: bool,
    http_leases: [HttpLease; HTTP_LEASES],
    /// (database, job id) of jobs whose batch ended its worker: they run one by one from then on.
    suspects: [(u32, i64); SUSPECTS],
    suspects_next: usize,
    /// (database, hash of the name, until when) of subscriptions whose handler hung or overran
    /// in a fan-out pass (see `queue_only`).
    queue_only: [(u32, u64, i64); QUEUE_ONLY],
    /// Queues that committed transactions gave jobs to claim, for a worker of their database to
    /// NOTIFY (see `announce_at_commit`).
    announced: [Announced; ANNOUNCED],
    /// Moves on whenever a worker publishes other interests, or a transaction that may change
    /// them (a sink or subscription created, resumed, altered) commits: a transaction that
    /// raised and decided against the interests it saw wakes the workers at commit after all if
    /// this moved meanwhile.
    interest_generation: u64,
}

/// What the sinks and subscriptions of a database read, for the commits that raise there.
#[derive(Clone, Copy)]
struct Interest {
    /// Some reader takes every topic, or the patterns did not fit, or nobody looked yet.
    all: bool,
    len: u16,
    /// The patterns, each ended by a newline (no pattern holds one).
    patterns: [u8; INTEREST_BYTES],
}

const INTEREST_BYTES: usize = 2048;
/// Patterns published at most (past that: every topic), so that the look of a raise stays cheap
/// whatever patterns tenants give their sinks.
const INTEREST_PATTERNS: usize = 64;

impl Default for Interest {
    fn default() -> Self {
        Interest {
            all: true,
            len: 0,
            patterns: [0; INTEREST_BYTES],
        }
    }
}

impl Interest {
    /// `None`: every topic.
    fn of(patterns: Option<&[String]>) -> Interest {
        let mut interest = Interest::default();
        let Some(patterns) = patterns else {
            return interest;
        };
        if patterns.len() > INTEREST_PATTERNS {
            return interest;
        }
        let mut len = 0;
        for p in patterns {
            let end = len + p.len() + 1;
            if end > INTEREST_BYTES || p.contains('\n') {
                return interest;
            }
            interest.patterns[len..end - 1].copy_from_slice(p.as_bytes());
            interest.patterns[end - 1] = b'\n';
            len = end;
        }
        interest.all = false;
        interest.len = len as u16;
        interest
    }

    fn same(&self, other: &Interest) -> bool {
        self.all == other.all
            && self.patterns[..self.len as usize] == other.patterns[..other.len as usize]
    }

    fn patterns(&self) -> impl Iterator<Item = &[u8]> {
        self.patterns[..self.len as usize]
            .split(|b| *b == b'\n')
            .filter(|p| !p.is_empty())
    }
}

/// Queues announced at once, all databases together; past that, `Slot::announce_all`.
const ANNOUNCED: usize = 256;
/// Queues one transaction announces by name; past that, every queue of its database.
const ANNOUNCED_PER_TRANSACTION: usize = 16;
/// Entries one database may hold in `WorkerTable::announced`; past that, every queue of that
/// database is announced (one busy database cannot push the others into that).
const ANNOUNCED_PER_DATABASE: usize = 32;

/// A queue (by name, in a database) with new jobs to claim, not yet notified.
#[derive(Clone, Copy)]
struct Announced {
    /// 0: a free entry.
    database: u32,
    len: u8,
    name: [u8; 63],
}

impl Default for Announced {
    fn default() -> Self {
        Announced {
            database: 0,
            len: 0,
            name: [0; 63],
        }
    }
}

impl Announced {
    fn name(&self) -> &[u8] {
        &self.name[..self.len as usize]
    }
}

impl Default for WorkerTable {
    fn default() -> Self {
        WorkerTable {
            slots: [Slot::default(); settings::WORKER_SLOTS],
            launcher_proc: 0,
            launcher_pid: 0,
            launcher_watching: false,
            probe_requests: [0; PROBE_REQUESTS],
            probe_all: false,
            http_leases: [HttpLease::default(); HTTP_LEASES],
            suspects: [(0, 0); SUSPECTS],
            suspects_next: 0,
            queue_only: [(0, 0, 0); QUEUE_ONLY],
            announced: [Announced::default(); ANNOUNCED],
            interest_generation: 0,
        }
    }
}

/// Remembers the jobs of a batch whose handler call ended its worker: which of them hung is
/// unknown, so from now on any batch that holds one of them runs its jobs one by one, and the one
/// that hangs is counted alone. Shared by every worker (a batch freed by a dead worker is
/// claimed by another).
pub(crate) fn mark_suspects(ids: &[i64]) {
    // SAFETY: reads a backend global of a connected worker.
    let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
    let mut table = WORKERS.exclusive();
    for &id in ids {
        let at = table.suspects_next % SUSPECTS;
        table.suspects[at] = (database, id);
        table.suspects_next = table.suspects_next.wrapping_add(1);
    }
}

/// Whether any of `ids` is a suspect (see `mark_suspects`).
pub(crate) fn any_suspect(ids: &[i64]) -> bool {
    let table = WORKERS.share();
    if table.suspects_next == 0 {
        return false;
    }
    // SAFETY: reads a backend global of a connected worker.
    let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
    table
        .suspects
        .iter()
        .any(|&(db, id)| db == database && id != 0 && ids.contains(&id))
}

/// A subscription's handler hung or overran its time in the fan-out pass that ran its matches
/// (see `dispatch::fanout`): for `how_long` (None: until the server restarts) its matches are
/// written as jobs, whose runner gives the handler `sink_timeout` and finds the one event that
/// hangs (`dispatch::jobs::after_hang`), instead of the pass stalling again on the same window.
/// Shared by every worker.
pub(crate) fn queue_only(subscription: &str, how_long: Option<Duration>) {
    let until = how_long.map_or(i64::MAX, |d| {
        now().saturating_add(d.as_micros().min(i64::MAX as u128) as i64)
    });
    mark_queue_only(
        &mut WORKERS.exclusive(),
        my_database(),
        name_hash(subscription),
        until,
    );
}

fn mark_queue_only(table: &mut WorkerTable, database: u32, hash: u64, until: i64) {
    if let Some(e) = table
        .queue_only
        .iter_mut()
        .find(|e| (e.0, e.1) == (database, hash))
    {
        e.2 = e.2.max(until);
    } else if let Some(e) = table.queue_only.iter_mut().min_by_key(|e| e.2) {
        // A free or lapsed entry, else the one that lapses first (one that would hang again
        // then costs its tenant a worker, and is marked again).
        *e = (database, hash, until);
    }
}

/// Whether `subscription`'s matches may run in its fan-out pass (see `queue_only`).
pub(crate) fn runs_inline(subscription: &str) -> bool {
    let table = WORKERS.share();
    let (database, hash, now) = (my_database(), name_hash(subscription), now());
    !table
        .queue_only
        .iter()
        .any(|e| (e.0, e.1) == (database, hash) && e.2 > now)
}

/// FNV-1a of `name` (a collision only sends another subscription's matches to its queue).
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    }) | 1
}

/// Takes the lease of HTTP sink `key` for this worker, across transactions, without waiting.
/// False when another live worker holds it (or, should 256 requests be in flight, when none is
/// free). Kept in the extension's shared memory rather than the lock manager: a session-level
/// lock there could be released by any handler this worker runs (`pg_advisory_unlock_all`
/// releases every session lock of its kind), and a second worker would then send the same batch
/// at the same time. A worker that exits loses its leases: its slot gets another pid.
pub(crate) fn try_http_lease(key: i32) -> bool {
    let slot = MY_SLOT.load(Ordering::Relaxed);
    if slot == usize::MAX {
        return false;
    }
    // SAFETY: reads backend globals of a connected worker.
    let (database, pid) = unsafe { (pg_sys::MyDatabaseId.to_u32(), pg_sys::MyProcPid) };
    let mut table = WORKERS.exclusive();
    let live = |l: &HttpLease, slots: &[Slot]| {
        l.pid != 0 && slots.get(l.slot as usize).is_some_and(|s| s.pid == l.pid)
    };
    let slots = table.slots;
    if let Some(held) = table
        .http_leases
        .iter()
        .find(|l| l.database == database && l.key == key && live(l, &slots))
    {
        return held.pid == pid;
    }
    let mine = table
        .http_leases
        .iter()
        .filter(|l| l.database == database && live(l, &slots))
        .count();
    if mine >= HTTP_LEASES_PER_DATABASE {
        return false;
    }
    match table.http_leases.iter_mut().find(|l| !live(l, &slots)) {
        Some(free) => {
            *free = HttpLease {
                database,
                key,
                slot: slot as u16,
                pid,
            };
            true
        }
        None => false,
    }
}

/// Waits while another process holds the lease of HTTP or Kafka sink `key` of this database (its
/// windows in flight, until their outcomes are recorded): what a role's own change to such a sink
/// does once it holds the sink's lock (`crate::lease::xact`), which keeps the workers from
/// sending more. The change then takes the sink's rows with nothing in flight that would record
/// into them. It can be cancelled, and waits no longer than a request may fly
/// (`pg_outbox.http_max_timeout`) and five seconds more: a worker that holds the lease while it
/// does not go round (pg_outbox.enabled off, say) does not hold the change; should what it holds
/// land later, recording it waits a second at most (`isolation::bound_lock_waits`), fails, and
/// the window is sent again.
pub(crate) fn wait_for_http_lease(key: i32) {
    if !preloaded() {
        return;
    }
    // SAFETY: reads backend globals.
    let (database, pid) = unsafe { (pg_sys::MyDatabaseId.to_u32(), pg_sys::MyProcPid) };
    let deadline = std::time::Instant::now()
        + std::time::Duration::from_millis(
            crate::settings::HTTP_MAX_TIMEOUT_MS.get().max(0) as u64 + 5_000,
        );
    while std::time::Instant::now() < deadline {
        let held = {
            let table = WORKERS.share();
            table.http_leases.iter().any(|l| {
                l.database == database
                    && l.key == key
                    && l.pid != 0
                    && l.pid != pid
                    && table
                        .slots
                        .get(l.slot as usize)
                        .is_some_and(|s| s.pid == l.pid)
            })
        };
        if !held {
            return;
        }
        // SAFETY: a plain latch wait of a backend, 10 ms at most.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                10,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        pg_sys::check_for_interrupts!();
    }
}

/// Gives back this worker's lease of HTTP sink `key`, if it holds it.
pub(crate) fn release_http_lease(key: i32) {
    // SAFETY: reads backend globals of a connected worker.
    let (database, pid) = unsafe { (pg_sys::MyDatabaseId.to_u32(), pg_sys::MyProcPid) };
    if MY_SLOT.load(Ordering::Relaxed) == usize::MAX {
        return;
    }
    let mut table = WORKERS.exclusive();
    for l in table.http_leases.iter_mut() {
        if l.database == database && l.key == key && l.pid == pid {
            *l = HttpLease::default();
        }
    }
}

// SAFETY: plain old data (integers and byte arrays), valid at any bit pattern, no pointers that
// are dereferenced without a check (proc_ptr is only handed to SetLatch while non-zero).
unsafe impl PGRXSharedMemory for WorkerTable {}

static WORKERS: PgLwLock<WorkerTable> = unsafe { PgLwLock::new(c"pg_outbox_workers") };

/// Process-local: true in the postmaster and every backend forked from it once the shared memory
/// was requested, i.e. when pg_outbox is preloaded. A plain `CREATE EXTENSION` load leaves it false.
static PRELOADED: AtomicBool = AtomicBool::new(false);

pub fn preloaded() -> bool {
    PRELOADED.load(Ordering::Relaxed)
}

/// Called from `_PG_init` while shared_preload_libraries is being processed.
pub fn register() {
    pg_shmem_init!(WORKERS);
    PRELOADED.store(true, Ordering::Relaxed);
    // SAFETY: hooks are installed once, in the postmaster, while preloading; the previous hook
    // is kept and called first.
    unsafe {
        PREV_OBJECT_ACCESS_HOOK = pg_sys::object_access_hook;
        pg_sys::object_access_hook = Some(on_object_access);
        PREV_PROCESS_UTILITY_HOOK = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(on_process_utility);
    }
    // SAFETY: reading a postmaster global during _PG_init.
    if unsafe { pg_sys::IsBinaryUpgrade } {
        return; // pg_upgrade starts the server only to move catalogs: deliver nothing
    }
    BackgroundWorkerBuilder::new("pg_outbox launcher")
        .set_type("pg_outbox launcher")
        .set_library("pg_outbox")
        .set_function("pg_outbox_launcher_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        // pgrx's default is never; a launcher that exits (crash, SIGTERM) comes back.
        .set_restart_time(Some(Duration::from_secs(1)))
        .load();
}

/// The current database (of a connected backend or worker).
fn my_database() -> u32 {
    // SAFETY: reads a backend global.
    unsafe { pg_sys::MyDatabaseId.to_u32() }
}

/// Sets the launcher's latch, if it runs.
fn wake_launcher(table: &WorkerTable) {
    if table.launcher_proc != 0 {
        // SAFETY: as set_latch: the PGPROC lives in shared memory for the life of the cluster.
        unsafe {
            pg_sys::SetLatch(&raw mut (*(table.launcher_proc as *mut pg_sys::PGPROC)).procLatch)
        };
    }
}

/// Asks the launcher to look at this database once the transaction commits (CREATE EXTENSION's
/// script calls it): delivery starts there within moments, with no setting to edit.
#[pg_extern(volatile, parallel_unsafe, name = "_start_delivery")]
fn start_delivery() {
    if !preloaded() {
        return;
    }
    let database = my_database();
    pgrx::register_xact_callback(PgXactCallbackEvent::Commit, move || {
        let mut table = WORKERS.exclusive();
        if !table.probe_requests.contains(&database) {
            match table.probe_requests.iter_mut().find(|d| **d == 0) {
                Some(free) => *free = database,
                None => table.probe_all = true,
            }
        }
        wake_launcher(&table);
    });
}

static mut PREV_OBJECT_ACCESS_HOOK: pg_sys::object_access_hook_type = None;

/// DROP DATABASE waits up to 5 s for other sessions to leave the database and then fails; it
/// only asks autovacuum to go. Its drop hook runs before that wait, so here the backend dropping
/// our workers' database asks them to leave with SIGTERM (the launcher starts none there again
/// once the database is gone).
#[pg_guard]
unsafe extern "C-unwind" fn on_object_access(
    access: pg_sys::ObjectAccessType::Type,
    class_id: pg_sys::Oid,
    object_id: pg_sys::Oid,
    sub_id: std::ffi::c_int,
    arg: *mut std::ffi::c_void,
) {
    // SAFETY: chaining to the hook that was installed before ours, with the same arguments.
    unsafe {
        if let Some(prev) = PREV_OBJECT_ACCESS_HOOK {
            prev(access, class_id, object_id, sub_id, arg);
        }
    }
    if access == pg_sys::ObjectAccessType::OAT_DROP && class_id == pg_sys::AuthIdRelationId {
        crate::owner::refuse_drop_of_owner(object_id);
        return;
    }
    if access != pg_sys::ObjectAccessType::OAT_DROP || class_id != pg_sys::DatabaseRelationId {
        return;
    }
    ask_to_leave(object_id.to_u32(), "being dropped");
}

/// Asks the workers of `database` to leave it (SIGTERM): DROP DATABASE and CREATE DATABASE from
/// it as a template wait for other sessions to leave, and fail after 5 s. The launcher starts
/// them again after a second; they then wait for the command's lock on the database before they
/// connect (or find it gone).
fn ask_to_leave(database: u32, why: &str) {
    let pids: Vec<i32> = WORKERS
        .share()
        .slots
        .iter()
        .filter(|s| s.pid != 0 && s.database == database)
        .map(|s| s.pid)
        .collect();
    for &pid in &pids {
        pgrx::log!("pg_outbox: asking worker (pid {pid}) to leave the database {why}");
        // SAFETY: signalling a server process of this cluster, as pg_terminate_backend does. A
        // worker inside a handler dies at the handler's next interrupt check (`on_sigterm`).
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    // Wait (5 s at most) until they are gone from the process array: DROP DATABASE WITH (FORCE)
    // by the database's owner would otherwise find them there and refuse to end a superuser's
    // process.
    for _ in 0..500 {
        // SAFETY: looks pids up in the process array (under its lock), as pg_stat_activity does.
        if pids
            .iter()
            .all(|&pid| unsafe { pg_sys::BackendPidGetProc(pid) }.is_null())
        {
            break;
        }
        // SAFETY: a plain sleep, then the usual interrupt check (a cancel ends the wait).
        unsafe { pg_sys::pg_usleep(10_000) };
        pg_sys::check_for_interrupts!();
    }
}

static mut PREV_PROCESS_UTILITY_HOOK: pg_sys::ProcessUtility_hook_type = None;

unsafe extern "C-unwind" {
    /// PostgreSQL's standard_ProcessUtility called directly: pgrx's binding catches every ERROR
    /// of every utility statement and raises it again, which loses nothing important but adds a
    /// Rust backtrace to its DETAIL when the server runs with RUST_BACKTRACE set.
    #[link_name = "standard_ProcessUtility"]
    fn standard_process_utility(
        pstmt: *mut pg_sys::PlannedStmt,
        query: *const std::ffi::c_char,
        read_only_tree: bool,
        context: pg_sys::ProcessUtilityContext::Type,
        params: pg_sys::ParamListInfo,
        env: *mut pg_sys::QueryEnvironment,
        dest: *mut pg_sys::DestReceiver,
        qc: *mut pg_sys::QueryCompletion,
    );
}

/// CREATE DATABASE ... TEMPLATE a database with pg_outbox: its workers leave it first, or the copy
/// would fail ("source database is being accessed by other users"). Not guarded by pgrx: it holds
/// nothing that needs dropping, and the statement's own errors pass through it untouched.
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn on_process_utility(
    pstmt: *mut pg_sys::PlannedStmt,
    query: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: PostgreSQL hands the hook a valid planned utility statement; the previous hook (or
    // the standard one) then runs with the same arguments.
    unsafe {
        let stmt = (*pstmt).utilityStmt;
        if !stmt.is_null() && (*stmt).type_ == pg_sys::NodeTag::T_CreatedbStmt {
            leave_template(stmt.cast());
        }
        if !stmt.is_null()
            && (*stmt).type_ == pg_sys::NodeTag::T_TransactionStmt
            && (*stmt.cast::<pg_sys::TransactionStmt>()).kind
                == pg_sys::TransactionStmtKind::TRANS_STMT_COMMIT_PREPARED
        {
            wake_at_commit_prepared();
        }
        match PREV_PROCESS_UTILITY_HOOK {
            Some(prev) => prev(pstmt, query, read_only_tree, context, params, env, dest, qc),
            None => standard_process_utility(
                pstmt,
                query,
                read_only_tree,
                context,
                params,
                env,
                dest,
                qc,
            ),
        }
    }
}

/// COMMIT PREPARED makes visible what a prepared transaction raised, and the transaction that
/// raised it woke nobody (PREPARE is not a commit): this one wakes a worker of the database (the
/// one it prepared in) when it commits, whatever it raised.
#[pg_guard]
unsafe extern "C-unwind" fn wake_at_commit_prepared() {
    if preloaded() {
        pgrx::register_xact_callback(PgXactCallbackEvent::Commit, wake_one);
    }
}

/// Asks the workers of the template of `stmt` to leave, if the role may copy it (createdb()
/// checks after this hook; without the check any role could stall another database's delivery
/// with a failing command): a superuser, or the template's owner with CREATEDB.
#[pg_guard]
unsafe extern "C-unwind" fn leave_template(stmt: *mut pg_sys::CreatedbStmt) {
    // SAFETY: the options of a CreatedbStmt are DefElems, read as createdb() reads them; the
    // role's row is read from the syscache and released.
    unsafe {
        let options = pgrx::PgList::<pg_sys::DefElem>::from_pg((*stmt).options);
        for option in options.iter_ptr() {
            let name = std::ffi::CStr::from_ptr((*option).defname);
            if name.to_bytes() != b"template" || (*option).arg.is_null() {
                continue;
            }
            let oid = pg_sys::get_database_oid(pg_sys::defGetString(option), true);
            if oid == pg_sys::InvalidOid {
                continue;
            }
            let user = pg_sys::GetUserId();
            let may_copy = pg_sys::superuser()
                || (pg_sys::pg_database_ownercheck(oid, user) && {
                    let tuple = pg_sys::SearchSysCache1(
                        pg_sys::SysCacheIdentifier::AUTHOID as i32,
                        pg_sys::Datum::from(user),
                    );
                    let createdb = !tuple.is_null()
                        && (*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_authid>(tuple))
                            .rolcreatedb;
                    if !tuple.is_null() {
                        pg_sys::ReleaseSysCache(tuple);
                    }
                    createdb
                });
            if may_copy {
                ask_to_leave(oid.to_u32(), "used as the template of a new database");
            }
        }
    }
}

/// SIGTERM was received (process-local; the handler below sets it).
static STOP: AtomicBool = AtomicBool::new(false);
/// A tenant's handler is running in this process (see `HandlerRunning`).
static IN_HANDLER: AtomicBool = AtomicBool::new(false);

/// Makes the next CHECK_FOR_INTERRUPTS end the process with FATAL, as PostgreSQL's own `die`
/// does for a backend: a handler cannot catch that (PL/pgSQL's EXCEPTION catches ERRORs only),
/// and its transaction rolls back.
fn die_at_next_interrupt_check() {
    // SAFETY: the two flags are sig_atomic_t globals that signal handlers set; this is what
    // die() in postgres.c does.
    unsafe {
        pg_sys::ProcDiePending = 1;
        pg_sys::InterruptPending = 1;
    }
}

unsafe extern "C" {
    /// PostgreSQL's SetLatch called directly: pgrx's binding goes through its error-boundary
    /// guard (thread checks, sigsetjmp), which must not run in a signal handler.
    #[link_name = "SetLatch"]
    fn set_latch_in_signal_handler(latch: *mut pg_sys::Latch);
}

/// A worker's own latch, to be set from one of its request threads when the request lands (see
/// `wake_from_thread`).
#[derive(Clone, Copy)]
pub(crate) struct OwnLatch(usize);

impl OwnLatch {
    pub(crate) fn current() -> OwnLatch {
        // SAFETY: reads a backend global; the latch lives in this process's PGPROC for its life.
        OwnLatch(unsafe { pg_sys::MyLatch } as usize)
    }

    /// Sets the latch from a thread that is not the backend's: the worker's wait ends as soon
    /// as a request lands. PostgreSQL's SetLatch is made to be called from signal handlers, so
    /// it touches nothing but the latch and a wakeup of the owning process; pgrx's binding
    /// would refuse a foreign thread, hence the direct call.
    pub(crate) fn wake_from_thread(self) {
        // SAFETY: the pointer was MyLatch of this process, valid for as long as the process.
        unsafe { set_latch_in_signal_handler(self.0 as *mut pg_sys::Latch) };
    }
}

/// SIGTERM (`pg_terminate_backend`, `pg_ctl stop -m fast`, DROP DATABASE): between steps the
/// worker's loop sees the flag and stops; inside a tenant's handler the worker dies at once. The
/// handler pgrx installs only sets a flag, so a handler that caught the cancel of sink_timeout and
/// looped kept the worker (and `pg_ctl stop`) waiting forever (issue #10).
unsafe extern "C-unwind" fn on_sigterm(_signal: std::ffi::c_int) {
    // SAFETY: signal handler: only atomics, sig_atomic_t flags and SetLatch (which PostgreSQL
    // makes async-signal-safe); errno is kept for the interrupted code.
    unsafe {
        let errno = *libc::__errno_location();
        STOP.store(true, Ordering::SeqCst);
        if IN_HANDLER.load(Ordering::SeqCst) {
            die_at_next_interrupt_check();
        }
        set_latch_in_signal_handler(pg_sys::MyLatch);
        *libc::__errno_location() = errno;
    }
}

/// Replaces pgrx's SIGTERM handler with `on_sigterm`. Call after `attach_signal_handlers`.
pub(crate) fn install_sigterm() {
    // SAFETY: installs a signal handler in this process, as pqsignal's callers in core do.
    unsafe { pg_sys::pqsignal(libc::SIGTERM, Some(on_sigterm)) };
}

/// Whether SIGTERM has arrived.
pub(crate) fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Whether the launcher asked this worker to make room for another database's (it exits at its
/// next step, after the handler in flight).
pub(crate) fn retire_requested(slot: usize) -> bool {
    WORKERS.share().slots.get(slot).is_some_and(|s| s.retire)
}

/// The slot of this worker process (usize::MAX in other processes).
static MY_SLOT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// Marks a tenant's handler as running while alive: SIGTERM then ends the worker at once, and
/// the worker's slot says what the handler works on (see `InHandler`).
pub(crate) struct HandlerRunning(bool);

impl HandlerRunning {
    pub(crate) fn enter(target: Target<'_>) -> HandlerRunning {
        let slot = MY_SLOT.load(Ordering::Relaxed);
        let in_worker = slot != usize::MAX;
        in_worker.then(|| {
            with_slot(slot, |s| {
                let mut h = InHandler {
                    since: now(),
                    ..InHandler::default()
                };
                let name = match target {
                    Target::Sink {
                        id,
                        neighbour,
                        before,
                    } => {
                        h.kind = if neighbour { 2 } else { 1 };
                        h.before = before;
                        id
                    }
                    Target::Jobs { subscription, ids } => {
                        h.kind = 3;
                        let n = ids.len().min(JOBS_MAX);
                        h.jobs[..n].copy_from_slice(&ids[..n]);
                        h.jobs_len = n as u8;
                        subscription
                    }
                    Target::Inline { subscription } => {
                        h.kind = INLINE;
                        subscription
                    }
                    Target::Schedule { name } => {
                        h.kind = 4;
                        name
                    }
                    Target::Replay { sink } => {
                        h.kind = 5;
                        sink
                    }
                };
                let n = name.len().min(h.name.len());
                h.name[..n].copy_from_slice(&name.as_bytes()[..n]);
                h.name_len = n as u8;
                s.handler = h;
            });
            // The last free worker of its database is now busy: the launcher times how long,
            // to start another while the handlers keep them all.
            let database = my_database();
            let table = WORKERS.share();
            if !table.launcher_watching
                && table
                    .slots
                    .iter()
                    .filter(|s| s.serving(database))
                    .all(|s| s.in_handler())
            {
                wake_launcher(&table);
            }
        });
        // Restored when it ends: a handler called inside other tenant code (a fan-out pass's
        // filters) leaves that marked.
        let outer = IN_HANDLER.swap(true, Ordering::SeqCst);
        if STOP.load(Ordering::SeqCst) {
            die_at_next_interrupt_check();
        }
        HandlerRunning(outer)
    }
}

impl Drop for HandlerRunning {
    fn drop(&mut self) {
        IN_HANDLER.store(self.0, Ordering::SeqCst);
        let slot = MY_SLOT.load(Ordering::Relaxed);
        if slot != usize::MAX {
            with_slot(slot, |s| s.handler.kind = 0);
        }
    }
}

/// Marks other tenant code (filters in a fan-out pass) as running: SIGTERM ends the worker at
/// once while it lives.
pub(crate) struct TenantCode(bool);

impl TenantCode {
    pub(crate) fn enter() -> TenantCode {
        let outer = IN_HANDLER.swap(true, Ordering::SeqCst);
        if STOP.load(Ordering::SeqCst) {
            die_at_next_interrupt_check();
        }
        TenantCode(outer)
    }
}

impl Drop for TenantCode {
    fn drop(&mut self) {
        IN_HANDLER.store(self.0, Ordering::SeqCst);
    }
}

// utils/timeout.h is not among pgrx's bindings: RegisterTimeout and the first user-definable
// TimeoutId of PostgreSQL 15 (the only version built here).
const USER_TIMEOUT: i32 = 12;

unsafe extern "C-unwind" {
    #[link_name = "RegisterTimeout"]
    fn register_timeout_raw(id: i32, handler: Option<unsafe extern "C-unwind" fn()>) -> i32;
}

static HARD_TIMEOUT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
/// The hard handler timeout fired in this process (it is about to end).
static HARD_TIMED_OUT: AtomicBool = AtomicBool::new(false);

/// The hard handler timeout fired: the handler outlived `sink_timeout` (whose cancel it may have
/// caught) and the grace after it. Called in signal context: flags only.
unsafe extern "C-unwind" fn on_hard_timeout() {
    HARD_TIMED_OUT.store(true, Ordering::SeqCst);
    die_at_next_interrupt_check();
    // SAFETY: SetLatch is async-signal-safe; MyLatch is this process's latch.
    unsafe { set_latch_in_signal_handler(pg_sys::MyLatch) };
}

/// The id of the hard handler timeout, registered once per worker process.
pub(crate) fn hard_timeout_id() -> Option<i32> {
    let id = HARD_TIMEOUT.load(Ordering::Relaxed);
    (id >= 0).then_some(id)
}

fn register_hard_timeout() {
    // SAFETY: registers a timeout handler in this process, as extensions do from their worker's
    // main; the id is kept for enable_timeout_after.
    let id = unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| {
            register_timeout_raw(USER_TIMEOUT, Some(on_hard_timeout))
        })
    };
    HARD_TIMEOUT.store(id, Ordering::Relaxed);
}

fn set_latch(slot: &Slot) {
    // SAFETY: the pointer was MyProc of a worker; PGPROCs live in shared memory for the life of
    // the cluster, so at worst a stale one wakes another process spuriously.
    unsafe { pg_sys::SetLatch(&raw mut (*(slot.proc_ptr as *mut pg_sys::PGPROC)).procLatch) };
}

/// Sets the latch of one idle worker of this database (it serves every sink in its round), or of
/// every one when all are in a round (each looks again when it ends). Safe in a commit callback:
/// no allocation, no ERROR.
pub fn wake_one() {
    if !preloaded() {
        return;
    }
    let database = my_database();
    {
        let table = WORKERS.share();
        let mut live = table.slots.iter().filter(|s| s.serving(database));
        if let Some(idle) = live.find(|s| !s.busy) {
            set_latch(idle);
            return;
        }
        // Every worker is in a round and some commit woke each already: each goes round again
        // when its round ends, and sees this commit then. Under load most commits end here,
        // under the shared lock, instead of queueing for the exclusive one.
        if table
            .slots
            .iter()
            .filter(|s| s.serving(database))
            .all(|s| s.woken)
        {
            return;
        }
    }
    // Every worker is in a round: each looks again when its round ends.
    let mut table = WORKERS.exclusive();
    for s in table.slots.iter_mut().filter(|s| s.serving(database)) {
        s.woken = true;
        set_latch(s);
    }
}

thread_local! {
    static WAKE_REGISTERED: Cell<bool> = const { Cell::new(false) };
    /// This transaction raised only topics nobody read when it looked: the interest generation
    /// it saw then (see `WorkerTable::interest_generation`).
    static UNREAD_SINCE: Cell<Option<u64>> = const { Cell::new(None) };
    /// The patterns of this database's readers, compiled, and the generation they are of.
    static READ: std::cell::RefCell<Option<(u64, u32, Read)>> = const { std::cell::RefCell::new(None) };
}

/// What this database's sinks and subscriptions read, compiled for matching raised topics.
enum Read {
    Nothing,
    Every,
    /// The patterns, and topics already found unread by them (a backend raises the same few).
    Patterns(
        Vec<pg_outbox_core::pattern::Pattern>,
        std::collections::HashSet<String>,
    ),
}

/// Unread topics a backend remembers per generation, at most.
const UNREAD_REMEMBERED: usize = 64;

impl Read {
    fn any(&mut self, topics: &mut dyn Iterator<Item = &str>) -> bool {
        match self {
            Read::Nothing => false,
            Read::Every => true,
            Read::Patterns(patterns, unread) => {
                for topic in topics {
                    if unread.contains(topic) {
                        continue;
                    }
                    if patterns.iter().any(|p| p.matches(topic)) {
                        return true;
                    }
                    if unread.len() < UNREAD_REMEMBERED {
                        unread.insert(topic.to_string());
                    }
                }
                false
            }
        }
    }
}

/// What the workers of this database last published that their readers read, and the
/// generation it is of. The patterns are copied out under the lock (each worker publishes the
/// same list: copied once) and compiled after it.
fn read_now() -> (u64, Read) {
    let database = my_database();
    let (generation, published) = {
        let table = WORKERS.share();
        let mut published: Vec<Interest> = Vec::new();
        for s in table
            .slots
            .iter()
            .filter(|s| s.serving(database) && s.has_sinks)
        {
            if s.interest.all {
                return (table.interest_generation, Read::Every);
            }
            if !published.iter().any(|p| p.same(&s.interest)) {
                published.push(s.interest);
            }
        }
        (table.interest_generation, published)
    };
    let mut patterns = Vec::new();
    for p in published.iter().flat_map(Interest::patterns) {
        match std::str::from_utf8(p)
            .ok()
            .and_then(|p| pg_outbox_core::pattern::Pattern::parse(p).ok())
        {
            Some(p) if !patterns.contains(&p) => patterns.push(p),
            Some(_) => {}
            None => return (generation, Read::Every),
        }
    }
    if patterns.is_empty() {
        return (generation, Read::Nothing);
    }
    (generation, Read::Patterns(patterns, Default::default()))
}

/// Wakes a worker when the current transaction commits (once per transaction, however many
/// events it raises), if a sink or subscription of this database reads one of `topics`. A
/// rollback wakes nobody.
///
/// Whether one does is what the workers last published (`publish_interest`, every round).
/// A reader created, resumed or altered since moves the interest generation on at its commit;
/// if it moved between this look and this transaction's commit, the commit wakes the workers
/// after all, so that no event waits for the next poll because of a stale look.
pub fn wake_at_commit(topics: &mut dyn Iterator<Item = &str>) {
    if !preloaded() || WAKE_REGISTERED.with(|r| r.get()) {
        return;
    }
    let database = my_database();
    let generation = WORKERS.share().interest_generation;
    let read = READ.with(|read| {
        let mut read = read.borrow_mut();
        if !matches!(&*read, Some((g, d, _)) if *g == generation && *d == database) {
            let (g, r) = read_now();
            *read = Some((g, database, r));
        }
        let (g, _, r) = read.as_mut().expect("just filled");
        (*g, r.any(topics))
    });
    match read {
        (_, true) => register_wake(),
        (seen, false) => {
            if UNREAD_SINCE.with(|u| u.get()).is_none() {
                UNREAD_SINCE.with(|u| u.set(Some(seen)));
                pgrx::register_xact_callback(PgXactCallbackEvent::Commit, || {
                    let seen = UNREAD_SINCE.with(|u| u.take());
                    if !WAKE_REGISTERED.with(|r| r.get())
                        && seen.is_some_and(|seen| WORKERS.share().interest_generation != seen)
                    {
                        wake_one();
                    }
                });
                pgrx::register_xact_callback(PgXactCallbackEvent::Abort, || {
                    UNREAD_SINCE.with(|u| u.set(None))
                });
            }
        }
    }
}

/// Wakes a worker at commit whether or not sinks exist (a sink was created, resumed, replayed).
pub fn wake_at_commit_always() {
    if !preloaded() {
        return;
    }
    // A reader exists from this commit on, or reads other topics: commits that raise events
    // wake the workers at once, without waiting for a worker's round to notice it. Said just
    // before the commit (an abort after it only wakes the workers more than needed), so that a
    // transaction that looked before and commits after this one is woken by its own commit, and
    // one that looks after sees every topic read, whatever order the commit callbacks run in.
    pgrx::register_xact_callback(PgXactCallbackEvent::PreCommit, || {
        let database = my_database();
        let mut table = WORKERS.exclusive();
        for s in table.slots.iter_mut().filter(|s| s.serving(database)) {
            s.has_sinks = true;
            s.interest.all = true;
        }
        table.interest_generation = table.interest_generation.wrapping_add(1);
    });
    if !WAKE_REGISTERED.with(|r| r.get()) {
        register_wake();
    }
}

/// Publishes what this worker's database reads (the topic patterns of its sinks and
/// subscriptions that are not paused; None: every topic), read in its round.
pub(crate) fn publish_interest(slot: usize, patterns: Option<&[String]>) {
    let interest = Interest::of(patterns);
    if WORKERS.share().slots[slot].interest.same(&interest) {
        return;
    }
    let mut table = WORKERS.exclusive();
    table.slots[slot].interest = interest;
    table.interest_generation = table.interest_generation.wrapping_add(1);
}

fn register_wake() {
    WAKE_REGISTERED.with(|r| r.set(true));
    pgrx::register_xact_callback(PgXactCallbackEvent::Commit, || {
        WAKE_REGISTERED.with(|r| r.set(false));
        wake_one();
    });
    pgrx::register_xact_callback(PgXactCallbackEvent::Abort, || {
        WAKE_REGISTERED.with(|r| r.set(false))
    });
}

/// The queues this transaction gave jobs that external workers claim, each with the time its
/// first job is due (`all`: more than `ANNOUNCED_PER_TRANSACTION`).
#[derive(Default)]
struct Announcing {
    queues: Vec<(String, i64)>,
    all: bool,
    /// The latest due time of any job announced (a queue keeps only its earliest).
    latest: i64,
}

thread_local! {
    static ANNOUNCING: std::cell::RefCell<Option<Announcing>> = const { std::cell::RefCell::new(None) };
}

/// Announces at commit that `queue` has new jobs to claim, due at `due` (a timestamptz; None:
/// now): a worker of this database then sends `NOTIFY outbox_jobs, '<queue>'` in its own
/// transaction. An application's transaction never notifies itself: NOTIFY takes a lock that
/// serialises every committing notifier, and a full notification queue fails the commit. A job
/// not yet due when the transaction commits is left to the workers, who announce it when it comes
/// due. A rollback announces nothing, and neither does PREPARE TRANSACTION (its COMMIT PREPARED
/// may come from another session: the workers' poll finds those jobs).
pub fn announce_at_commit(queue: &str, due: Option<i64>) {
    if !preloaded() {
        return;
    }
    // SAFETY: reads the statement's start time, as now() does.
    let due = due.unwrap_or_else(|| unsafe { pg_sys::GetCurrentStatementStartTimestamp() });
    let first = ANNOUNCING.with(|a| {
        let mut a = a.borrow_mut();
        let first = a.is_none();
        let pending = a.get_or_insert_with(Announcing::default);
        pending.latest = pending.latest.max(due);
        match pending.queues.iter().position(|(q, _)| q == queue) {
            Some(i) => pending.queues[i].1 = pending.queues[i].1.min(due),
            None if pending.all => {}
            None if pending.queues.len() < ANNOUNCED_PER_TRANSACTION && queue.len() <= 63 => {
                pending.queues.push((queue.to_string(), due))
            }
            None => pending.all = true,
        }
        first
    });
    if first {
        pgrx::register_xact_callback(PgXactCallbackEvent::Commit, || {
            if let Some(mut pending) = ANNOUNCING.with(|a| a.borrow_mut().take()) {
                let now = now();
                if pending.latest > now {
                    // A job comes due later: the first worker looks then. When which is not
                    // known here (its queue also got a job due now, or too many queues), it looks
                    // now, and its look learns from the table when the next one comes due.
                    let known = pending
                        .queues
                        .iter()
                        .map(|(_, due)| *due)
                        .filter(|due| *due > now)
                        .min();
                    let unknown = pending.all || pending.queues.iter().any(|(_, due)| *due <= now);
                    look_by(if unknown { now } else { known.unwrap_or(now) });
                }
                pending.queues.retain(|(_, due)| *due <= now);
                if pending.all || !pending.queues.is_empty() {
                    publish(&pending);
                    wake_one();
                }
            }
        });
        pgrx::register_xact_callback(PgXactCallbackEvent::Abort, || {
            ANNOUNCING.with(|a| a.borrow_mut().take());
        });
        pgrx::register_xact_callback(PgXactCallbackEvent::PrePrepare, || {
            ANNOUNCING.with(|a| a.borrow_mut().take());
        });
    }
}

/// `announce_at_commit` for the extension's own SQL (schedules' runs). Not for PUBLIC.
#[pg_extern(volatile, parallel_unsafe, name = "_announce")]
fn announce_sql(queue: &str) {
    announce_at_commit(queue, None);
}

/// Puts a committed transaction's announcements in shared memory. In a commit callback: no
/// allocation, no ERROR.
fn publish(pending: &Announcing) {
    let database = my_database();
    let mut table = WORKERS.exclusive();
    let mut all = pending.all;
    for (queue, _) in &pending.queues {
        let queue = queue.as_bytes();
        let mine = table
            .announced
            .iter()
            .filter(|e| e.database == database)
            .count();
        if table
            .announced
            .iter()
            .any(|e| e.database == database && e.name() == queue)
        {
            continue;
        }
        if mine >= ANNOUNCED_PER_DATABASE {
            all = true;
            break;
        }
        let free = match table.announced.iter().position(|e| e.database == 0) {
            Some(free) => Some(free),
            None => {
                // Entries of databases no worker serves now wait for nobody: their next worker
                // announces every queue when it starts.
                for i in 0..ANNOUNCED {
                    let db = table.announced[i].database;
                    if !table.slots.iter().any(|s| s.serving(db)) {
                        table.announced[i] = Announced::default();
                    }
                }
                table.announced.iter().position(|e| e.database == 0)
            }
        };
        match free {
            Some(i) => {
                let e = &mut table.announced[i];
                e.database = database;
                e.len = queue.len() as u8;
                e.name[..queue.len()].copy_from_slice(queue);
            }
            None => {
                all = true;
                break;
            }
        }
    }
    if all {
        for s in table.slots.iter_mut().filter(|s| s.serving(database)) {
            s.announce_all = true;
        }
    }
}

/// Tells the first worker of this database to look for jobs by `due` (a timestamptz): a job
/// comes due or expires then that nobody will announce otherwise. Wakes it when that is sooner
/// than it would look. Safe in a commit callback: no allocation, no ERROR.
pub(crate) fn look_by(due: i64) {
    if !preloaded() {
        return;
    }
    let database = my_database();
    let mut table = WORKERS.exclusive();
    let Some(first) = table.slots.iter_mut().find(|s| s.serving(database)) else {
        return;
    };
    if first.look_by != 0 && first.look_by <= due {
        return;
    }
    first.look_by = due;
    if first.looks_at == 0 || due < first.looks_at {
        set_latch(first);
    }
}

/// Takes the time by which this worker is to look for jobs (`look_by`), as a duration from now
/// (zero: it has passed).
pub(crate) fn take_look_by(slot: usize) -> Option<std::time::Duration> {
    if WORKERS
        .share()
        .slots
        .get(slot)
        .is_none_or(|s| s.look_by == 0)
    {
        return None;
    }
    let mut due = 0;
    with_slot(slot, |s| due = std::mem::take(&mut s.look_by));
    (due != 0).then(|| std::time::Duration::from_micros(due.saturating_sub(now()).max(0) as u64))
}

/// Records when this worker looks for jobs next, so that `look_by` wakes it only for sooner.
/// None: the worker does not look (it is not the first of its database). Every round says so:
/// the exclusive lock is taken only when the time moves by a millisecond or more.
pub(crate) fn set_looks_at(slot: usize, after: Option<std::time::Duration>) {
    let at = after.map_or(0, |after| {
        now().saturating_add(after.as_micros().min(i64::MAX as u128) as i64)
    });
    let was = WORKERS.share().slots[slot].looks_at;
    if (at == 0) == (was == 0) && at.abs_diff(was) < 1_000 {
        return;
    }
    with_slot(slot, |s| s.looks_at = at);
}

/// Now plus `after`, as a timestamptz.
pub(crate) fn timestamp_after(after: std::time::Duration) -> i64 {
    now().saturating_add(after.as_micros().min(i64::MAX as u128) as i64)
}

/// Takes the announcements for this worker's database: the queues named, and whether every
/// queue is to be notified.
pub(crate) fn take_announced(slot: usize) -> (Vec<String>, bool) {
    let database = my_database();
    let any = {
        let table = WORKERS.share();
        table.announced.iter().any(|e| e.database == database)
            || table.slots.get(slot).is_some_and(|s| s.announce_all)
    };
    if !any {
        return (Vec::new(), false);
    }
    let mut table = WORKERS.exclusive();
    let mut queues = Vec::new();
    for e in table
        .announced
        .iter_mut()
        .filter(|e| e.database == database)
    {
        queues.push(String::from_utf8_lossy(e.name()).into_owned());
        *e = Announced::default();
    }
    let mut all = false;
    for s in table.slots.iter_mut().filter(|s| s.database == database) {
        all |= s.announce_all;
        s.announce_all = false;
    }
    (queues, all)
}

fn with_slot(slot: usize, f: impl FnOnce(&mut Slot)) {
    if let Some(s) = WORKERS.exclusive().slots.get_mut(slot) {
        f(s)
    }
}

fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// The database the launcher meant slot `slot` for.
pub(crate) fn slot_database(slot: usize) -> u32 {
    WORKERS.share().slots.get(slot).map_or(0, |s| s.database)
}

/// Marks the slot's worker as exited (from its exit callback, so also after a FATAL error):
/// the launcher reaps it.
#[pg_guard]
unsafe extern "C-unwind" fn on_worker_exit(_code: std::ffi::c_int, arg: pg_sys::Datum) {
    let slot = arg.value();
    let mut table = WORKERS.exclusive();
    // Ended inside a fan-out pass's handler call. By its hard timeout (the handler would not
    // stop): no other worker runs that handler in a pass while this one's successor is started
    // (it records the same). Otherwise (SIGTERM, an error) it did not hang there.
    if let Some(s) = table
        .slots
        .get_mut(slot)
        .filter(|s| s.handler.kind == INLINE)
    {
        if HARD_TIMED_OUT.load(Ordering::SeqCst) {
            let h = s.handler;
            let hash = name_hash(&String::from_utf8_lossy(&h.name[..h.name_len as usize]));
            let database = s.database;
            mark_queue_only(&mut table, database, hash, i64::MAX);
        } else {
            s.handler.kind = 0;
        }
    }
    if let Some(s) = table.slots.get_mut(slot) {
        s.state = EXITED;
        s.proc_ptr = 0;
        s.pid = 0;
        s.busy = false;
    }
    wake_launcher(&table);
}

/// The first thing a worker does: its slot is marked exited however the process ends.
pub(crate) fn slot_claimed(slot: usize) {
    MY_SLOT.store(slot, Ordering::Relaxed);
    // SAFETY: registers a callback run at process exit, as extensions do from a worker's main.
    unsafe { pg_sys::before_shmem_exit(Some(on_worker_exit), pg_sys::Datum::from(slot)) };
}

/// The worker has connected to its database. Returns the handler call that ended the worker that
/// had this slot before, if one was running for longer than `sink_timeout` when it ended.
pub(crate) fn slot_started(slot: usize) -> Option<Hung> {
    register_hard_timeout();
    let mut hung = None;
    with_slot(slot, |s| {
        let h = s.handler;
        if s.hung() {
            let name = String::from_utf8_lossy(&h.name[..h.name_len as usize]).into_owned();
            hung = Some(match h.kind {
                3 => Hung::Jobs {
                    subscription: name,
                    ids: h.jobs[..h.jobs_len as usize].to_vec(),
                },
                4 => Hung::Schedule { name },
                5 => Hung::Replay { sink: name },
                INLINE => Hung::Inline { subscription: name },
                kind => Hung::Sink {
                    id: name,
                    neighbour: kind == 2,
                    before: h.before,
                },
            });
        }
        *s = Slot {
            state: RUNNING,
            connected: true,
            database: s.database,
            requested_at: s.requested_at,
            ..Slot::default()
        };
        // SAFETY: MyProc and MyProcPid are set for a connected worker.
        unsafe {
            s.proc_ptr = pg_sys::MyProc as usize;
            s.pid = pg_sys::MyProcPid;
        }
        s.started_at = now();
    });
    hung
}

/// A round begins: commits from now on wake the worker when it ends (see `Slot::woken`).
pub(crate) fn round_begins(slot: usize) {
    with_slot(slot, |s| {
        s.busy = true;
        s.woken = false;
    })
}

/// A round ended. True when a commit wanted the worker meanwhile: go round again at once.
pub(crate) fn round_ends(slot: usize) -> bool {
    let mut woken = false;
    with_slot(slot, |s| {
        s.busy = false;
        woken = std::mem::take(&mut s.woken);
    });
    woken
}

/// The worker found pg_outbox in its database: the launcher counts it as a delivering worker.
pub(crate) fn slot_installed(slot: usize) {
    with_slot(slot, |s| s.installed = true)
}

/// Why the worker is about to exit (see the OUTCOME_ constants).
pub(crate) fn slot_outcome(slot: usize, outcome: u8) {
    with_slot(slot, |s| s.outcome = outcome)
}

/// Records whether this database has sinks or subscriptions, for every worker of it.
pub(crate) fn set_has_sinks(has: bool) {
    let database = my_database();
    // Every round says so: the exclusive lock only when it changes.
    if WORKERS
        .share()
        .slots
        .iter()
        .filter(|s| s.serving(database))
        .all(|s| s.has_sinks == has)
    {
        return;
    }
    let mut table = WORKERS.exclusive();
    for s in table.slots.iter_mut().filter(|s| s.serving(database)) {
        s.has_sinks = has;
    }
    // Commits look at has_sinks too (`read_now`): a backend that saw none must look again.
    table.interest_generation = table.interest_generation.wrapping_add(1);
}

/// Whether this worker is the first of its database (the lowest slot): it prunes, and announces
/// the jobs that come due with time.
pub(crate) fn first_of_database(slot: usize) -> bool {
    let database = my_database();
    WORKERS
        .share()
        .slots
        .iter()
        .position(|s| s.serving(database))
        == Some(slot)
}

/// Whether another worker serves this worker's database.
pub(crate) fn not_alone() -> bool {
    let database = my_database();
    WORKERS
        .share()
        .slots
        .iter()
        .filter(|s| s.serving(database))
        .count()
        > 1
}

/// An extra worker that found nothing to do may exit: true (and it must exit) when its database
/// keeps more than `pg_outbox.min_workers` workers without it and another of them is free to
/// take new work (not inside a handler). Decided under the lock, so two idle workers never both
/// leave a database below its minimum.
pub(crate) fn try_retire(slot: usize) -> bool {
    let database = my_database();
    let mut table = WORKERS.exclusive();
    let others = table
        .slots
        .iter()
        .enumerate()
        .filter(|(i, s)| *i != slot && s.serving(database) && s.installed);
    let count = others.clone().count();
    let free = others.clone().any(|(_, s)| !s.in_handler());
    if count < settings::MIN_WORKERS.get().max(1) as usize || !free {
        return false;
    }
    if let Some(s) = table.slots.get_mut(slot) {
        s.outcome = OUTCOME_RETIRED;
        s.retiring = true; // no longer counted (nor woken) by the others
    }
    true
}

/// When every worker of this database is inside a handler and the cluster's `max_workers` are all
/// running: the sinks and subscriptions those handlers run (nothing else can start until one
/// returns). None otherwise.
pub(crate) fn saturated() -> Option<Vec<String>> {
    if !preloaded() {
        return None;
    }
    let database = my_database();
    let table = WORKERS.share();
    let mine: Vec<&Slot> = table
        .slots
        .iter()
        .filter(|s| s.serving(database) && s.installed)
        .collect();
    let taken = table.slots.iter().filter(|s| s.taken()).count();
    let full = taken >= settings::MAX_WORKERS.get().max(1) as usize;
    // No worker at all here at the cap: everything behind waits for one.
    (full && mine.iter().all(|s| s.in_handler())).then(|| {
        mine.iter()
            .map(|s| {
                String::from_utf8_lossy(&s.handler.name[..s.handler.name_len as usize]).into_owned()
            })
            .collect()
    })
}

pub(crate) fn slot_pass(slot: usize, delivered: u64) {
    with_slot(slot, |s| {
        s.last_pass_at = now();
        s.passes += 1;
        s.delivered += delivered;
    })
}

pub(crate) fn slot_failure(slot: usize, error: &str) {
    with_slot(slot, |s| {
        s.failures += 1;
        let mut n = error.len().min(ERROR_BYTES);
        while !error.is_char_boundary(n) {
            n -= 1;
        }
        s.last_error[..n].copy_from_slice(&error.as_bytes()[..n]);
        s.last_error_len = n as u16;
    })
}

/// The workers of this database: one row per running worker.
#[pg_extern(volatile, parallel_safe)]
#[allow(clippy::type_complexity)]
fn workers() -> TableIterator<
    'static,
    (
        name!(slot, i32),
        name!(pid, Option<i32>),
        name!(started_at, Option<TimestampWithTimeZone>),
        name!(last_pass_at, Option<TimestampWithTimeZone>),
        name!(passes, i64),
        name!(delivered, i64),
        name!(failures, i64),
        name!(last_error, Option<String>),
    ),
> {
    if !preloaded() {
        crate::error::Error::NotPreloaded.report();
    }
    let table = *WORKERS.share();
    let ts = |t: i64| {
        (t != 0)
            .then(|| TimestampWithTimeZone::try_from(t).ok())
            .flatten()
    };
    let database = my_database();
    TableIterator::new(
        table
            .slots
            .into_iter()
            .enumerate()
            .filter(move |(_, s)| s.serving(database))
            .map(move |(i, s)| {
                (
                    i as i32,
                    (s.pid != 0).then_some(s.pid),
                    ts(s.started_at),
                    ts(s.last_pass_at),
                    s.passes as i64,
                    s.delivered as i64,
                    s.failures as i64,
                    (s.last_error_len > 0).then(|| {
                        String::from_utf8_lossy(&s.last_error[..s.last_error_len as usize])
                            .into_owned()
                    }),
                )
            }),
    )
}

/// Wakes the workers now (operators; a commit that raised events wakes them by itself).
#[pg_extern(volatile, parallel_unsafe)]
fn wake() {
    if !preloaded() {
        crate::error::Error::NotPreloaded.report();
    }
    let database = my_database();
    let table = WORKERS.share();
    table
        .slots
        .iter()
        .filter(|s| s.serving(database))
        .for_each(set_latch);
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::{Interest, INTEREST_BYTES, INTEREST_PATTERNS};
    use pgrx::prelude::*;

    #[pg_test]
    fn interests_keep_their_patterns_or_say_every_topic() {
        let every = Interest::of(None);
        assert!(every.all);
        let some = Interest::of(Some(&["order.#".to_string(), "audit.*".to_string()]));
        assert!(!some.all);
        let patterns: Vec<&[u8]> = some.patterns().collect();
        assert_eq!(patterns, [b"order.#".as_slice(), b"audit.*".as_slice()]);
        assert!(some.same(&Interest::of(Some(&[
            "order.#".to_string(),
            "audit.*".to_string()
        ]))));
        assert!(!some.same(&Interest::of(Some(&["order.#".to_string()]))));
        assert!(!some.same(&every));
        // Readers with no pattern at all (none left): nothing is read.
        let none = Interest::of(Some(&[]));
        assert!(!none.all && none.patterns().next().is_none());
        // Patterns that do not fit, by number or by size: every topic, never a pattern cut short.
        let fits: Vec<String> = (0..INTEREST_PATTERNS)
            .map(|i| format!("t{i:05}.#"))
            .collect();
        let interest = Interest::of(Some(&fits));
        assert!(!interest.all);
        assert_eq!(interest.patterns().count(), INTEREST_PATTERNS);
        let mut many = fits.clone();
        many.push("one.more".to_string());
        assert!(Interest::of(Some(&many)).all);
        let long: Vec<String> = (0..INTEREST_PATTERNS)
            .map(|i| format!("{}.{i:05}", "a".repeat(INTEREST_BYTES / INTEREST_PATTERNS)))
            .collect();
        assert!(Interest::of(Some(&long)).all);
    }
}
