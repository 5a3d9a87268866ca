//! The launcher: one background worker per cluster that starts the workers of every database
//! where pg_outbox is installed, as dynamic background workers.
//!
//! It is connected to no database, so it reads only the shared catalog `pg_database`. Whether
//! pg_outbox is installed in a database it learns by starting a worker there: the worker looks,
//! and exits with `OUTCOME_ABSENT` when it is not (a probe). After that the launcher looks again
//! only when asked: CREATE EXTENSION's script calls `outbox._start_delivery()`, which hands the
//! database to the launcher at commit. A database it has not seen yet (`CREATE DATABASE ...
//! TEMPLATE` a database with pg_outbox) is probed when the next scan finds it.
//!
//! Each database keeps `pg_outbox.min_workers`; while every worker of a database has been inside a
//! handler for `ELASTIC_AFTER`, one more starts (up to `pg_outbox.max_workers` for the cluster,
//! leaving room for other databases' minimum); an extra worker with nothing to do exits by itself
//! (`try_retire`). A worker that was ended inside a handler that would not stop is started again
//! in the same slot, so that its successor records the failure (`Hung`). TimescaleDB's launcher
//! is the prior art; pg_cron's one-database rule is what this replaces.

use super::{
    now, Slot, WorkerTable, EXITED, FREE, OUTCOME_ABSENT, OUTCOME_NONE, RUNNING, STARTING, WORKERS,
};
use crate::settings;
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::prelude::*;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// How long every worker of a database must have been inside a handler before another starts.
const ELASTIC_AFTER: Duration = Duration::from_millis(200);
/// How often `pg_database` is read for new and dropped databases.
const SCAN_EVERY: Duration = Duration::from_secs(5);
/// Probes (workers not yet known to have pg_outbox in their database) running at once.
const PROBES_AT_ONCE: usize = 2;
/// A worker the postmaster was asked for that has not connected after this is given up.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// A worker that ran this long before it ended is started again after a second; one that ended
/// sooner, after a wait that doubles each time.
const RAN_LONG: Duration = Duration::from_secs(10);
/// The longest wait before a database where workers could not start is tried again.
const MAX_RETRY: Duration = Duration::from_secs(60);

/// A database the launcher may start workers in.
#[derive(Debug, Clone)]
struct Database {
    oid: u32,
    name: String,
}

/// Why a worker is started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// To learn whether pg_outbox is installed there (and serve it if so).
    Probe,
    /// Below `pg_outbox.min_workers`.
    Minimum,
    /// Every worker there is busy in a handler.
    Extra,
}

struct Launcher {
    /// The postmaster's handles of the workers this launcher started, by slot.
    handles: Vec<*mut pg_sys::BackgroundWorkerHandle>,
    /// Databases where a worker found no pg_outbox.
    absent: HashSet<u32>,
    /// Databases where workers failed to start: how many times, and when to try again.
    failing: HashMap<u32, (u32, Instant)>,
    /// Databases where a worker found pg_outbox installed (until one finds it gone).
    known: HashSet<u32>,
    databases: Vec<Database>,
    scanned_at: Option<Instant>,
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn pg_outbox_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: the launcher reads only shared catalogs.
    BackgroundWorker::connect_worker_to_spi(None, None);
    {
        let mut table = WORKERS.exclusive();
        // SAFETY: MyProc and MyProcPid are set for a connected worker.
        unsafe {
            table.launcher_proc = pg_sys::MyProc as usize;
            table.launcher_pid = pg_sys::MyProcPid;
        }
    }
    check_sizing();
    warn_obsolete_settings();
    let mut launcher = Launcher {
        handles: vec![std::ptr::null_mut(); settings::WORKER_SLOTS],
        absent: HashSet::new(),
        failing: HashMap::new(),
        known: HashSet::new(),
        databases: Vec::new(),
        scanned_at: None,
    };
    pgrx::log!("pg_outbox launcher started");
    loop {
        if BackgroundWorker::sighup_received() {
            // SAFETY: the documented way to reload configuration in a background worker.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
            launcher.scanned_at = None; // pg_outbox.databases may have changed
        }
        if BackgroundWorker::sigterm_received() {
            break;
        }
        let sleep = launcher.round();
        if !BackgroundWorker::wait_latch(Some(sleep)) {
            break;
        }
    }
    WORKERS.exclusive().launcher_proc = 0;
    // SAFETY: ends this process; exit code 1 asks the postmaster to start the launcher again
    // (at shutdown it is not).
    unsafe { pg_sys::proc_exit(1) };
}

/// `max_worker_processes` must hold the launcher and `pg_outbox.max_workers` beside PostgreSQL's
/// own background workers (logical replication's launcher, parallel query): say so once, clearly.
fn check_sizing() {
    // SAFETY: reads postmaster settings.
    let (available, parallel) =
        unsafe { (pg_sys::max_worker_processes, pg_sys::max_parallel_workers) };
    let workers = settings::MAX_WORKERS.get();
    let wanted = workers + 2;
    if available < wanted {
        pgrx::warning!(
            "pg_outbox: max_worker_processes = {available} is too small for pg_outbox.max_workers = {workers}: \
             the launcher, {workers} workers and logical replication's launcher need {wanted}; set \
             max_worker_processes to at least {} (with max_parallel_workers = {parallel}, which \
             parallel query takes from the same pool) and restart",
            wanted + parallel
        );
    } else if available < wanted + parallel {
        pgrx::log!(
            "pg_outbox: max_worker_processes = {available} holds pg_outbox's launcher and {workers} \
             workers, but when they all run, parallel query gets fewer than max_parallel_workers = \
             {parallel}; {} would hold both",
            wanted + parallel
        );
    }
}

/// Settings of 0.1.0 that mean nothing now: a configuration still setting them is told so.
fn warn_obsolete_settings() {
    for (name, instead) in [
        (
            c"pg_outbox.database",
            "every database where pg_outbox is installed gets delivery; pg_outbox.databases restricts the set",
        ),
        (
            c"pg_outbox.workers",
            "pg_outbox.min_workers (per database) and pg_outbox.max_workers (cluster) size the workers",
        ),
    ] {
        // SAFETY: looks up a setting by name; missing_ok, so no ERROR.
        let value = unsafe { pg_sys::GetConfigOption(name.as_ptr(), true, false) };
        if !value.is_null() {
            pgrx::warning!(
                "pg_outbox: the setting {} is no longer used: {instead}",
                name.to_string_lossy()
            );
        }
    }
}

impl Launcher {
    /// One look at every slot and database. Returns how long to sleep.
    fn round(&mut self) -> Duration {
        self.reap();
        let asked = take_probe_requests();
        let rescan = match &asked {
            Asked::All => {
                self.absent.clear();
                self.failing.clear();
                true
            }
            Asked::Some(databases) => {
                for d in databases {
                    self.absent.remove(d);
                    self.failing.remove(d);
                    // CREATE EXTENSION committed there: it is owed its minimum like any other.
                    self.known.insert(*d);
                }
                !databases.is_empty()
            }
        };
        if rescan || self.scanned_at.is_none_or(|t| t.elapsed() >= SCAN_EVERY) {
            self.databases = scan_databases();
            self.scanned_at = Some(Instant::now());
            let known: HashSet<u32> = self.databases.iter().map(|d| d.oid).collect();
            self.absent.retain(|d| known.contains(d));
            self.failing.retain(|d, _| known.contains(d));
            self.known.retain(|d| known.contains(d));
        }
        let (starts, wake_in) = self.plan();
        for (database, why) in starts {
            self.start(&database, why, None);
        }
        SCAN_EVERY
            .min(wake_in.unwrap_or(SCAN_EVERY))
            .max(Duration::from_millis(10))
    }

    /// Frees the slots of workers that exited (restarting one that hung in a handler), ends
    /// workers that have not connected in time, and those of databases the launcher no longer
    /// serves.
    fn reap(&mut self) {
        let mut relaunch = Vec::new();
        let listed: HashSet<u32> = self.databases.iter().map(|d| d.oid).collect();
        {
            let mut table = WORKERS.exclusive();
            for (i, s) in table.slots.iter_mut().enumerate() {
                let handle = self.handles[i];
                if s.state == STARTING {
                    let waited = Duration::from_micros((now() - s.requested_at).max(0) as u64);
                    let gone = match handle.is_null() {
                        // Asked for by an earlier launcher: give up after a while.
                        true => waited > START_TIMEOUT,
                        false => handle_stopped(handle),
                    };
                    if gone {
                        s.state = EXITED;
                    } else if waited > START_TIMEOUT && !handle.is_null() {
                        // Stuck before it connected (a lock on its database, say): end it, or it
                        // holds a slot and a probe's turn for ever.
                        // SAFETY: a live handle of ours.
                        unsafe { pg_sys::TerminateBackgroundWorker(handle) };
                    }
                }
                if s.state == RUNNING
                    && self.scanned_at.is_some()
                    && !listed.contains(&s.database)
                    && s.pid != 0
                    && !s.retire
                {
                    // Its database became a template, stopped accepting connections or left
                    // pg_outbox.databases.
                    s.retire = true;
                    // SAFETY: signalling a worker of ours, as pg_terminate_backend does.
                    unsafe { libc::kill(s.pid, libc::SIGTERM) };
                }
                if s.state != EXITED {
                    continue;
                }
                let database = s.database;
                if !s.reaped {
                    s.reaped = true;
                    self.account(s);
                }
                if !handle.is_null() {
                    // SAFETY: a handle RegisterDynamicBackgroundWorker allocated for us.
                    unsafe { pg_sys::pfree(handle.cast()) };
                    self.handles[i] = std::ptr::null_mut();
                }
                if s.hung() && listed.contains(&database) {
                    // Its successor in the same slot records what hung (see `Hung`); until then
                    // the slot keeps the record.
                    if self.waiting(database).is_none() {
                        s.state = STARTING;
                        s.outcome = 0;
                        s.requested_at = now();
                        relaunch.push((i, database));
                    }
                } else {
                    *s = Slot::default();
                }
            }
        }
        for (slot, oid) in relaunch {
            if let Some(database) = self.databases.iter().find(|d| d.oid == oid).cloned() {
                pgrx::log!(
                    "pg_outbox launcher: restarting worker {slot} of database \"{}\" after it was ended in a handler",
                    database.name
                );
                self.start(&database, Why::Minimum, Some(slot));
            }
        }
    }

    /// What an exited worker tells the launcher: pg_outbox is not installed in its database, or
    /// it ended (SIGTERM, DROP DATABASE, an error) or never got in: then another starts after a
    /// second, longer each time it happens to a worker that ran briefly, and pg_database is read
    /// again before (the database may be gone).
    fn account(&mut self, s: &Slot) {
        let database = s.database;
        if s.outcome == OUTCOME_ABSENT {
            self.absent.insert(database);
            self.known.remove(&database);
        } else if s.outcome == OUTCOME_NONE && !s.hung() {
            // (A worker ended inside a handler that would not stop is expected to end: its
            // successor starts at once, to record it.)
            let ran_long = s.connected
                && Duration::from_micros((now() - s.started_at).max(0) as u64) > RAN_LONG;
            self.fail(database, ran_long);
            self.scanned_at = None;
        }
    }

    /// Starting a worker for `database` failed (or its worker ended soon): try again later.
    fn fail(&mut self, database: u32, reset: bool) {
        let n = match reset {
            true => 0,
            false => self.failing.get(&database).map_or(0, |(n, _)| *n),
        };
        let wait = Duration::from_secs(1 << n.min(6)).min(MAX_RETRY);
        self.failing
            .insert(database, (n + 1, Instant::now() + wait));
    }

    /// How long until workers may be started for `database` again (None: now).
    fn waiting(&self, database: u32) -> Option<Duration> {
        let (_, at) = self.failing.get(&database)?;
        let left = at.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// What to start now, and when to look again (an elastic threshold not yet reached, a
    /// retry). Each database where pg_outbox is known to be installed keeps its minimum before
    /// any database gets an extra worker; at the cap, an extra worker of the busiest database is
    /// asked to make room.
    fn plan(&mut self) -> (Vec<(Database, Why)>, Option<Duration>) {
        let table: WorkerTable = *WORKERS.share();
        for s in table.slots.iter().filter(|s| s.taken() && s.installed) {
            self.known.insert(s.database);
        }
        let max = settings::MAX_WORKERS.get().max(1) as usize;
        let min = settings::MIN_WORKERS.get().max(1) as usize;
        let mut taken = table.slots.iter().filter(|s| s.taken()).count();
        let mut probes = table
            .slots
            .iter()
            .filter(|s| s.taken() && !s.installed && !self.known.contains(&s.database))
            .count();
        let mut wake_in: Option<Duration> = None;
        let mut soonest = |d: Duration| wake_in = Some(wake_in.map_or(d, |w: Duration| w.min(d)));
        let now_ts = now();
        let mut wanted = Vec::new();
        let mut extras = Vec::new();
        let mut deficit = 0;
        let mut watching = false;
        for db in &self.databases {
            if self.absent.contains(&db.oid) {
                continue;
            }
            let mine: Vec<&Slot> = table
                .slots
                .iter()
                .filter(|s| s.taken() && s.database == db.oid)
                .collect();
            let known = self.known.contains(&db.oid) || mine.iter().any(|s| s.installed);
            let short = min.saturating_sub(mine.len());
            if known {
                // Reserved, even while it waits to be tried again.
                deficit += short;
            }
            if let Some(left) = self.waiting(db.oid) {
                soonest(left);
                continue;
            }
            let starting = mine.iter().any(|s| s.state == STARTING);
            if mine.is_empty() {
                wanted.push((db.clone(), if known { Why::Minimum } else { Why::Probe }));
            } else if known && short > 0 {
                if !starting {
                    wanted.push((db.clone(), Why::Minimum));
                }
            } else if known && !starting {
                let running: Vec<&&Slot> = mine.iter().filter(|s| s.state == RUNNING).collect();
                if !running.is_empty() && running.iter().all(|s| s.in_handler()) {
                    watching = true;
                    let busy_for = running
                        .iter()
                        .map(|s| now_ts - s.handler.since)
                        .min()
                        .unwrap_or(0);
                    let busy_for = Duration::from_micros(busy_for.max(0) as u64);
                    match ELASTIC_AFTER.checked_sub(busy_for) {
                        Some(left) if !left.is_zero() => soonest(left),
                        _ => extras.push((db.clone(), Why::Extra)),
                    }
                }
            }
        }
        WORKERS.exclusive().launcher_watching = watching;
        let mut starts = Vec::new();
        let mut make_room = 0;
        for (db, why) in wanted {
            if taken >= max {
                self.complain(&format!(
                    "database \"{}\" waits for a worker: pg_outbox.max_workers ({max}) are all running",
                    db.name
                ));
                if why == Why::Minimum {
                    make_room += 1;
                }
                continue;
            }
            if why == Why::Probe {
                if probes >= PROBES_AT_ONCE {
                    soonest(Duration::from_millis(100));
                    continue;
                }
                probes += 1;
            } else {
                deficit = deficit.saturating_sub(1);
            }
            taken += 1;
            starts.push((db, why));
        }
        for (db, why) in extras {
            // The minimum of every database comes before another extra anywhere.
            if taken + deficit >= max {
                break;
            }
            taken += 1;
            starts.push((db, why));
        }
        if make_room > 0 {
            ask_extras_to_leave(make_room, min);
            soonest(Duration::from_millis(100));
        }
        (starts, wake_in)
    }

    /// Starts a worker for `database` in a free slot (or in `slot`, already marked STARTING).
    fn start(&mut self, database: &Database, why: Why, slot: Option<usize>) {
        let slot = match slot {
            Some(slot) => slot,
            None => {
                let mut table = WORKERS.exclusive();
                let Some(free) = table.slots.iter().position(|s| s.state == FREE) else {
                    return;
                };
                table.slots[free] = Slot {
                    state: STARTING,
                    database: database.oid,
                    requested_at: now(),
                    ..Slot::default()
                };
                free
            }
        };
        // SAFETY: reads this process's pid.
        let me = unsafe { pg_sys::MyProcPid };
        let builder = BackgroundWorkerBuilder::new(&format!("pg_outbox worker {slot}"))
            .set_type("pg_outbox worker")
            .set_library("pg_outbox")
            .set_function("pg_outbox_worker_main")
            .set_argument(Some(pg_sys::Datum::from(slot)))
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::RecoveryFinished)
            .set_restart_time(None) // the launcher starts workers again, not the postmaster
            .set_notify_pid(me);
        let mut bgw: pg_sys::BackgroundWorker = (&builder).into();
        let mut handle: *mut pg_sys::BackgroundWorkerHandle = std::ptr::null_mut();
        // SAFETY: registers a worker with the postmaster; the handle is allocated in the
        // launcher's top memory context and freed when the worker is reaped.
        let registered = unsafe {
            let old = pg_sys::MemoryContextSwitchTo(pg_sys::TopMemoryContext);
            let ok = pg_sys::RegisterDynamicBackgroundWorker(&mut bgw, &mut handle);
            pg_sys::MemoryContextSwitchTo(old);
            ok
        };
        if registered {
            self.handles[slot] = handle;
            if why == Why::Extra {
                pgrx::log!(
                    "pg_outbox launcher: every worker of database \"{}\" is busy in a handler; starting worker {slot}",
                    database.name
                );
            }
            return;
        }
        {
            let mut table = WORKERS.exclusive();
            let s = &mut table.slots[slot];
            if s.hung() {
                // The record of what hung stays until a worker can take it over.
                s.state = EXITED;
                s.reaped = true;
            } else {
                *s = Slot::default();
            }
        }
        // SAFETY: reads a postmaster setting.
        let available = unsafe { pg_sys::max_worker_processes };
        self.complain(&format!(
            "no background worker slot is free to start a worker in database \"{}\": \
             max_worker_processes ({available}) are all in use; pg_outbox needs up to {} of them \
             (its launcher and pg_outbox.max_workers), beside logical replication and parallel query",
            database.name,
            settings::MAX_WORKERS.get() + 1
        ));
        self.fail(database.oid, false);
    }

    /// Logs a WARNING about capacity, once a minute at most.
    fn complain(&self, what: &str) {
        thread_local! {
            static LAST: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
        }
        LAST.with(|last| {
            if last
                .get()
                .is_none_or(|t| t.elapsed() >= Duration::from_secs(60))
            {
                pgrx::warning!("pg_outbox launcher: {what}");
                last.set(Some(Instant::now()));
            }
        });
    }
}

/// Whether the postmaster says the worker of `handle` has stopped (or never started).
fn handle_stopped(handle: *mut pg_sys::BackgroundWorkerHandle) -> bool {
    let mut pid: pg_sys::pid_t = 0;
    // SAFETY: a live handle from RegisterDynamicBackgroundWorker.
    let status = unsafe { pg_sys::GetBackgroundWorkerPid(handle, &mut pid) };
    status == pg_sys::BgwHandleStatus::BGWH_STOPPED
}

enum Asked {
    Some(Vec<u32>),
    All,
}

/// The databases where CREATE EXTENSION committed since the last look.
fn take_probe_requests() -> Asked {
    let mut table = WORKERS.exclusive();
    if std::mem::take(&mut table.probe_all) {
        table.probe_requests = Default::default();
        return Asked::All;
    }
    let asked = table
        .probe_requests
        .iter()
        .copied()
        .filter(|d| *d != 0)
        .collect();
    table.probe_requests = Default::default();
    Asked::Some(asked)
}

/// The databases that accept connections, are not templates (a worker connected to a template
/// would make CREATE DATABASE from it fail) and are in `pg_outbox.databases`.
fn scan_databases() -> Vec<Database> {
    BackgroundWorker::transaction(|| {
        let mut found = Vec::new();
        // SAFETY: a heap scan of a shared catalog inside a transaction, as the autovacuum
        // launcher does: the relation is opened and closed with its lock.
        unsafe {
            let rel = pg_sys::table_open(
                pg_sys::DatabaseRelationId,
                pg_sys::AccessShareLock as pg_sys::LOCKMODE,
            );
            let scan = pg_sys::table_beginscan_catalog(rel, 0, std::ptr::null_mut());
            loop {
                let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
                if tuple.is_null() {
                    break;
                }
                let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
                if !(*form).datallowconn || (*form).datistemplate {
                    continue;
                }
                let name = std::ffi::CStr::from_ptr((*form).datname.data.as_ptr())
                    .to_string_lossy()
                    .into_owned();
                if settings::serves(&name) {
                    found.push(Database {
                        oid: (*form).oid.to_u32(),
                        name,
                    });
                }
            }
            pg_sys::table_endscan(scan);
            pg_sys::table_close(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        }
        found
    })
}

/// Asks `n` extra workers (beyond `min` in their database) to exit at their next step, from the
/// databases with the most workers: a database without its minimum waits at most for the
/// handlers in flight.
fn ask_extras_to_leave(n: usize, min: usize) {
    let mut table = WORKERS.exclusive();
    for _ in 0..n {
        let mut count: HashMap<u32, usize> = HashMap::new();
        for s in table
            .slots
            .iter()
            .filter(|s| s.state == RUNNING && !s.retire)
        {
            *count.entry(s.database).or_default() += 1;
        }
        let Some((&busiest, &workers)) = count.iter().max_by_key(|(_, c)| **c) else {
            return;
        };
        if workers <= min {
            return;
        }
        // Prefer one that is not inside a handler: it leaves at once.
        let pick = table
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state == RUNNING && !s.retire && s.database == busiest)
            .min_by_key(|(_, s)| s.in_handler())
            .map(|(i, _)| i);
        match pick {
            Some(i) => {
                table.slots[i].retire = true;
                super::set_latch(&table.slots[i]);
            }
            None => return,
        }
    }
}
