//! The background workers: registration, shared memory, waking at commit, and their status.
//!
//! Registered from `_PG_init` only when pg_outbox is in `shared_preload_libraries`. Each worker
//! keeps a slot in shared memory with its PGPROC (so a committing backend can set its latch) and
//! counters that `outbox.workers()` reads.

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
/// Job ids one handler call can hold: dispatch::jobs::BATCH.
const JOBS_MAX: usize = 50;

/// What a worker's handler call is working on, kept in the worker's slot while the handler runs.
/// A handler that outlives `sink_timeout` and its grace ends the worker (it cannot be stopped
/// otherwise); shared memory outlives the worker's exit, so the worker started in its place finds
/// this and counts the failure durably (`dispatch::after_hang`), instead of running the same
/// handler on the same events for ever.
#[derive(Copy, Clone)]
struct InHandler {
    /// 0: none; 1: a sink's batch; 2: a sink's neighbour test; 3: a subscription's jobs.
    kind: u8,
    name: [u8; 64],
    name_len: u8,
    since: i64,
    jobs: [i64; JOBS_MAX],
    jobs_len: u8,
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
        }
    }
}

/// What a handler call works on (see `InHandler`).
pub(crate) enum Target<'a> {
    Sink {
        id: &'a str,
        neighbour: bool,
    },
    Jobs {
        subscription: &'a str,
        ids: &'a [i64],
    },
}

/// A handler call that ended its worker: found by the worker started in its place.
#[derive(Debug)]
pub(crate) enum Hung {
    Sink { id: String, neighbour: bool },
    Jobs { subscription: String, ids: Vec<i64> },
}

#[derive(Copy, Clone)]
pub struct Slot {
    proc_ptr: usize,
    pid: i32,
    /// The database the worker is connected to (an Oid), so DROP DATABASE can ask it to leave.
    database: u32,
    /// In a round (not waiting on its latch): a commit wakes an idle worker instead.
    busy: bool,
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
            proc_ptr: 0,
            pid: 0,
            database: 0,
            busy: false,
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

/// An HTTP sink's lease while its request flies (see `try_http_lease`).
#[derive(Copy, Clone, Default)]
struct HttpLease {
    database: u32,
    key: i32,
    slot: u16,
    /// The holder; 0: free. Stale once the slot has another pid (its worker exited).
    pid: i32,
}

/// HTTP requests in flight at once, cluster-wide.
const HTTP_LEASES: usize = 256;
/// Jobs remembered as suspects (see `mark_suspects`), cluster-wide; the oldest are forgotten.
const SUSPECTS: usize = 1024;

#[derive(Copy, Clone)]
pub struct WorkerTable {
    slots: [Slot; settings::MAX_WORKERS as usize],
    /// Whether the workers' database has any sink, as the workers last saw it. Commits wake the
    /// workers only then: without sinks a round finds nothing, and a wake per commit would spend
    /// the CPU the writers need.
    has_sinks: bool,
    http_leases: [HttpLease; HTTP_LEASES],
    /// (database, job id) of jobs whose batch ended its worker: they run one by one from then on.
    suspects: [(u32, i64); SUSPECTS],
    suspects_next: usize,
}

impl Default for WorkerTable {
    fn default() -> Self {
        WorkerTable {
            slots: Default::default(),
            has_sinks: false,
            http_leases: [HttpLease::default(); HTTP_LEASES],
            suspects: [(0, 0); SUSPECTS],
            suspects_next: 0,
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
    }
    // SAFETY: reading a postmaster global during _PG_init.
    if unsafe { pg_sys::IsBinaryUpgrade } {
        return; // pg_upgrade starts the server only to move catalogs: deliver nothing
    }
    for slot in 0..settings::WORKERS.get().clamp(0, settings::MAX_WORKERS) {
        BackgroundWorkerBuilder::new(&format!("pg_outbox worker {slot}"))
            .set_type("pg_outbox worker")
            .set_library("pg_outbox")
            .set_function("pg_outbox_worker_main")
            .set_argument(Some(pg_sys::Datum::from(slot)))
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::RecoveryFinished)
            // pgrx's default is never; a worker that exits (crash, SIGTERM, new database) comes back.
            .set_restart_time(Some(Duration::from_secs(1)))
            .load();
    }
}

static mut PREV_OBJECT_ACCESS_HOOK: pg_sys::object_access_hook_type = None;

/// DROP DATABASE waits up to 5 s for other sessions to leave the database and then fails; it
/// only asks autovacuum to go. Its drop hook runs before that wait, so here the backend dropping
/// our workers' database asks them to leave: SIGINT cancels a handler in flight, SIGTERM ends the
/// worker (it exits 1 and is started again, and waits for the drop to finish before it connects).
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
    let pids: Vec<i32> = WORKERS
        .share()
        .slots
        .iter()
        .filter(|s| s.pid != 0 && s.database == object_id.to_u32())
        .map(|s| s.pid)
        .collect();
    for pid in pids {
        pgrx::log!("pg_outbox: asking worker (pid {pid}) to leave the database being dropped");
        // SAFETY: signalling a server process of this cluster, as pg_terminate_backend does.
        unsafe {
            libc::kill(pid, libc::SIGINT);
            libc::kill(pid, libc::SIGTERM);
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

/// The slot of this worker process (usize::MAX in other processes).
static MY_SLOT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// Marks a tenant's handler as running while alive: SIGTERM then ends the worker at once, and
/// the worker's slot says what the handler works on (see `InHandler`).
pub(crate) struct HandlerRunning;

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
                    Target::Sink { id, neighbour } => {
                        h.kind = if neighbour { 2 } else { 1 };
                        id
                    }
                    Target::Jobs { subscription, ids } => {
                        h.kind = 3;
                        let n = ids.len().min(JOBS_MAX);
                        h.jobs[..n].copy_from_slice(&ids[..n]);
                        h.jobs_len = n as u8;
                        subscription
                    }
                };
                let n = name.len().min(h.name.len());
                h.name[..n].copy_from_slice(&name.as_bytes()[..n]);
                h.name_len = n as u8;
                s.handler = h;
            })
        });
        IN_HANDLER.store(true, Ordering::SeqCst);
        if STOP.load(Ordering::SeqCst) {
            die_at_next_interrupt_check();
        }
        HandlerRunning
    }
}

impl Drop for HandlerRunning {
    fn drop(&mut self) {
        IN_HANDLER.store(false, Ordering::SeqCst);
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

/// The hard handler timeout fired: the handler outlived `sink_timeout` (whose cancel it may have
/// caught) and the grace after it. Called in signal context: flags only.
unsafe extern "C-unwind" fn on_hard_timeout() {
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

/// Sets the latch of one idle worker (it serves every sink in its round), or of every worker
/// when all are in a round (each looks again when it ends). Safe in a commit callback: no
/// allocation, no ERROR.
pub fn wake_one() {
    if !preloaded() {
        return;
    }
    let table = WORKERS.share();
    let live = table.slots.iter().filter(|s| s.proc_ptr != 0);
    match live.clone().find(|s| !s.busy) {
        Some(idle) => set_latch(idle),
        None => live.for_each(set_latch),
    }
}

thread_local! {
    static WAKE_REGISTERED: Cell<bool> = const { Cell::new(false) };
}

/// Wakes a worker when the current transaction commits (once per transaction, however many
/// events it raises), if there is a sink to deliver to. A rollback wakes nobody.
pub fn wake_at_commit() {
    if !preloaded() || WAKE_REGISTERED.with(|r| r.get()) || !WORKERS.share().has_sinks {
        return;
    }
    register_wake();
}

/// Wakes a worker at commit whether or not sinks exist (a sink was created, resumed, replayed).
pub fn wake_at_commit_always() {
    if !preloaded() {
        return;
    }
    // A sink exists from this commit on: commits that raise events wake the workers at once,
    // without waiting for a worker's round to notice it.
    pgrx::register_xact_callback(PgXactCallbackEvent::Commit, || set_has_sinks(true));
    if !WAKE_REGISTERED.with(|r| r.get()) {
        register_wake();
    }
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

fn with_slot(slot: usize, f: impl FnOnce(&mut Slot)) {
    if let Some(s) = WORKERS.exclusive().slots.get_mut(slot) {
        f(s)
    }
}

fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Claims the slot for this process. Returns the handler call that ended the worker that had it
/// before, if one was running for longer than `sink_timeout` when it ended.
pub(crate) fn slot_started(slot: usize) -> Option<Hung> {
    MY_SLOT.store(slot, Ordering::Relaxed);
    register_hard_timeout();
    let mut hung = None;
    with_slot(slot, |s| {
        let h = s.handler;
        let ran_ms = (now() - h.since) / 1000;
        if h.kind != 0 && ran_ms >= settings::SINK_TIMEOUT_MS.get() as i64 {
            let name = String::from_utf8_lossy(&h.name[..h.name_len as usize]).into_owned();
            hung = Some(match h.kind {
                3 => Hung::Jobs {
                    subscription: name,
                    ids: h.jobs[..h.jobs_len as usize].to_vec(),
                },
                kind => Hung::Sink {
                    id: name,
                    neighbour: kind == 2,
                },
            });
        }
        *s = Slot::default();
        // SAFETY: MyProc and MyProcPid are set for a connected worker.
        unsafe {
            s.proc_ptr = pg_sys::MyProc as usize;
            s.pid = pg_sys::MyProcPid;
            s.database = pg_sys::MyDatabaseId.to_u32();
        }
        s.started_at = now();
    });
    hung
}

pub(crate) fn slot_busy(slot: usize, busy: bool) {
    with_slot(slot, |s| s.busy = busy)
}

pub(crate) fn set_has_sinks(has: bool) {
    let mut table = WORKERS.exclusive();
    table.has_sinks = has;
}

pub(crate) fn slot_stopped(slot: usize) {
    with_slot(slot, |s| {
        s.proc_ptr = 0;
        s.pid = 0;
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

/// The workers of this cluster: one row per configured slot.
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
    let n = settings::WORKERS.get().clamp(0, settings::MAX_WORKERS) as usize;
    TableIterator::new(
        table
            .slots
            .into_iter()
            .take(n)
            .enumerate()
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
    let table = WORKERS.share();
    table
        .slots
        .iter()
        .filter(|s| s.proc_ptr != 0)
        .for_each(set_latch);
}
