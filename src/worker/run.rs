//! The worker's main loop.
//!
//! One loop serves every sink and pruning, each step in its own short transaction, and waits on
//! its latch in between: a commit that raised events sets it, `pg_outbox.poll_interval` is only
//! the fallback. An error in one step is logged, recorded and the loop goes on: a bad row must not
//! crash-loop the worker. The launcher started it for one database; it exits when pg_outbox is not
//! installed there (any more), when the database leaves `pg_outbox.databases`, on SIGTERM, and,
//! as an extra worker, when it has had nothing to do for `RETIRE_AFTER`.

use super::{
    round_begins, round_ends, slot_claimed, slot_failure, slot_installed, slot_outcome, slot_pass,
    slot_started, OUTCOME_ABSENT, OUTCOME_EXCLUDED,
};
use crate::dispatch::{self, PassResult};
use crate::schedule::EachRun;
use crate::settings;
use crate::transaction::in_transaction;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// What the installed SQL of this database looks like to this binary.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Installed {
    Ready,
    Missing,
    Other(String),
}

fn installed() -> Installed {
    let version = crate::query::one::<String>(
        "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'pg_outbox'",
        &[],
    );
    match version {
        None => Installed::Missing,
        Some(v) if v == env!("CARGO_PKG_VERSION") => Installed::Ready,
        Some(v) => Installed::Other(v),
    }
}

/// How often the first worker of a database looks for lapsed leases (and, at the latest, for
/// jobs that came due or expired: those it looks for when they do, at most every JOBS_LOOK_MIN).
const JOBS_LOOK: Duration = Duration::from_secs(10);
const JOBS_LOOK_MIN: Duration = Duration::from_millis(100);

/// Job batches one subscription gets per round of the loop.
const JOB_BATCHES_PER_ROUND: usize = 20;

/// An extra worker exits once it has found nothing to do for this long (and its database keeps
/// its minimum and a free worker without it: `try_retire`).
const RETIRE_AFTER: Duration = Duration::from_secs(10);

struct Worker {
    slot: usize,
    database: String,
    /// Since when the rounds found nothing to do.
    idle_since: Option<Instant>,
    /// pg_outbox was found installed in the database.
    installed: bool,
    /// The one-off schedules were placed by this process's zone rules.
    placed: bool,
    /// A restored log could not be adopted, and the worker said so.
    lineage_warned: bool,
    /// This round did something (delivered, fanned out, ran jobs, fired schedules, sent requests).
    worked: bool,
    /// Each schedules whose rows another transaction held when their runs were to be recorded,
    /// and when: passed over for `EACH_HELD_WAIT`, so that their queries do not run every round.
    held_each: Vec<(String, Instant)>,
    /// The state last warned about, so an idle worker says why once, not every poll.
    warned: Option<Installed>,
    last_prune: Option<Instant>,
    /// When this worker last deleted the ticks no reader needs (crate::ticks::prune).
    last_tick_prune: Option<Instant>,
    /// While committed events wait behind the horizon, re-check sooner than the poll interval.
    waiting_backoff: Duration,
    /// While another worker holds a sink this one wanted, re-check sooner too.
    contention_backoff: Duration,
    /// HTTP clients by sink, kept for keep-alive connections.
    agents: dispatch::http::Agents,
    /// HTTP requests on their way. They outlive a round: the loop never waits for an endpoint
    /// (a tenant's endpoint that never answered once held every schedule, fan-out and SQL sink
    /// of the worker for its whole timeout).
    in_flight: Vec<dispatch::http::InFlight>,
    /// SIGTERM was seen (or the worker wants to start afresh).
    stop: bool,
    /// The first worker of its database announces jobs that come due with time: when it last
    /// looked (None: not yet; its first look announces every queue with jobs to claim) ...
    jobs_since: Option<TimestampWithTimeZone>,
    /// ... when it looks next, when it last looked for lapsed leases, and when it looks next.
    jobs_check_at: Instant,
    /// When it last said that the notification queue was too full to notify.
    notify_full_warned: Option<Instant>,
    leases_since: Option<TimestampWithTimeZone>,
    jobs_leases_at: Instant,
    /// How many settings the backend had once the worker was set up.
    settings_at_start: i32,
}

/// Custom settings handlers may leave in the worker before it restarts to drop them.
const SETTINGS_GROWTH_MAX: i32 = 2_000;

/// Keeps the memory a window freed for the next one. A window of a few thousand events is a
/// few MB of rows, events and arrays, freed when it is done: with glibc's defaults those blocks
/// are mapped and unmapped (or the heap trimmed) at every window, and each page of the next one
/// faulted in again (about a tenth of a fan-out pass's time in perf). Blocks up to 32 MB come from
/// the heap instead, and up to 64 MB freed at its top stay there; a larger allocation (a window
/// near `max_batch_bytes`, say) is still mapped on its own and given back when freed.
fn keep_freed_memory() {
    // SAFETY: mallopt only tunes this process's allocator, before the worker allocates much.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
    }
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn pg_outbox_worker_main(arg: pg_sys::Datum) {
    let slot = arg.value();
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    super::install_sigterm();
    // A filter evaluation stops within a few hundred steps once an interrupt is pending.
    pg_outbox_core::budget::set_interrupt_probe(|| {
        // SAFETY: reads a sig_atomic_t flag that signal handlers set.
        unsafe { pg_sys::InterruptPending != 0 }
    });
    slot_claimed(slot);
    keep_freed_memory();
    let oid = super::slot_database(slot);
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from(oid)), None);
    let hung = slot_started(slot);
    // Before any statement of the worker's own: see crate::isolation.
    let named = crate::transaction::in_bare_transaction(|| {
        crate::isolation::pin_worker_settings();
        crate::isolation::name_worker(slot);
        // SAFETY: looks up the name of the database this worker is connected to.
        unsafe {
            let name = pg_sys::get_database_name(pg_sys::MyDatabaseId);
            std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned()
        }
    });
    let database = match named {
        Ok(name) => name,
        Err(e) => {
            pgrx::warning!("pg_outbox worker {slot}: cannot pin its settings: {e}");
            // SAFETY: ends this process; the launcher starts another.
            unsafe { pg_sys::proc_exit(1) };
        }
    };
    if !settings::serves(&database) {
        slot_outcome(slot, OUTCOME_EXCLUDED);
        // SAFETY: ends this process; its database is not in pg_outbox.databases.
        unsafe { pg_sys::proc_exit(0) };
    }
    // The worker this one replaces was ended inside a handler that would not stop: count it.
    if let Some(hung) = hung {
        pgrx::log!(
            "pg_outbox worker {slot}: the worker before it was ended in a handler: {hung:?}"
        );
        let recovered = match &hung {
            super::Hung::Sink {
                id,
                neighbour,
                before,
            } => in_transaction(|| crate::dispatch::after_hang(id, *neighbour, *before)),
            super::Hung::Jobs { subscription, ids } => {
                crate::dispatch::jobs::after_hang(subscription, ids);
                Ok(())
            }
            super::Hung::Inline { subscription } => {
                super::queue_only(subscription, None);
                Ok(())
            }
            super::Hung::Schedule { name } => {
                crate::schedule::after_hang(name);
                Ok(())
            }
            super::Hung::Replay { sink } => in_transaction(|| crate::replay::after_hang(sink)),
        };
        if let Err(e) = recovered {
            pgrx::warning!("pg_outbox worker {slot}: recording the ended handler call: {e}");
        }
    }
    let mut worker = Worker {
        slot,
        database,
        idle_since: None,
        installed: false,
        placed: false,
        lineage_warned: false,
        worked: false,
        held_each: Vec::new(),
        warned: None,
        last_prune: None,
        last_tick_prune: None,
        waiting_backoff: Duration::ZERO,
        contention_backoff: Duration::ZERO,
        agents: Default::default(),
        in_flight: Vec::new(),
        stop: false,
        jobs_since: None,
        jobs_check_at: Instant::now(),
        notify_full_warned: None,
        leases_since: None,
        jobs_leases_at: Instant::now(),
        // SAFETY: reads the size of this backend's settings table.
        settings_at_start: unsafe { pg_sys::GetNumConfigOptions() },
    };
    worker.run();
    // librdkafka's threads must be gone before the process exits (OpenSSL's exit handlers would
    // run under them): every Kafka producer is purged and destroyed, within a bound.
    worker.agents.shutdown(Duration::from_secs(5));
    // SAFETY: ends this process; the launcher decides whether another takes its place.
    unsafe { pg_sys::proc_exit(0) };
}

impl Worker {
    fn run(&mut self) {
        loop {
            if self.stopping() {
                self.abandon_flights();
                return;
            }
            if BackgroundWorker::sighup_received() {
                let period = crate::prune::period_s();
                // SAFETY: the documented way to reload configuration in a background worker.
                unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
                if crate::prune::period_s() != period {
                    if let Err(e) = in_transaction(crate::prune::record_period) {
                        self.failed(&format!("recording the log's period: {e}"));
                    }
                }
                if !settings::serves(&self.database) {
                    pgrx::log!(
                        "pg_outbox worker {} exits: database \"{}\" left pg_outbox.databases",
                        self.slot,
                        self.database
                    );
                    slot_outcome(self.slot, OUTCOME_EXCLUDED);
                    self.abandon_flights();
                    return;
                }
            }
            round_begins(self.slot);
            self.worked = false;
            let cpu = thread_cpu();
            let mut timeout = self.step();
            // A round that filled a batch goes on at once; one that did not rests (below).
            let rest = if timeout.is_zero() {
                Duration::ZERO
            } else {
                coalescing_rest(thread_cpu().saturating_sub(cpu))
            };
            let ended = Instant::now();
            if round_ends(self.slot) {
                timeout = Duration::ZERO;
            }
            idle();
            if self.retiring() {
                self.abandon_flights();
                return;
            }
            if !self.wait(timeout) {
                self.abandon_flights();
                return;
            }
            // Woken by a commit soon after a round that did little: let more commits gather.
            if let Some(left) = rest.checked_sub(ended.elapsed()) {
                sleep(left);
            }
        }
    }

    /// One round: every due sink once, pruning when due. Returns how long to sleep.
    fn step(&mut self) -> Duration {
        let poll = settings::ms(&settings::POLL_INTERVAL_MS);
        // The worker lives long: a restore into its database must reach its next raise.
        crate::lineage::forget();

        if !settings::ENABLED.get() {
            return poll;
        }
        // Each handler's settings are undone when it returns (crate::isolation); should one ever
        // leak anyway, it is put back before the worker runs a statement of its own.
        // Handlers may create custom settings (set_config('x.y', ...)); they are undone, but
        // PostgreSQL keeps their names, and every transaction end walks them all. Past a few
        // thousand, start afresh.
        // SAFETY: reads the size of this backend's settings table.
        let settings_now = unsafe { pg_sys::GetNumConfigOptions() };
        if settings_now > self.settings_at_start.saturating_add(SETTINGS_GROWTH_MAX) {
            pgrx::log!(
                "pg_outbox worker {}: handlers created {} custom settings; restarting to drop them",
                self.slot,
                settings_now - self.settings_at_start
            );
            self.stop = true;
            return Duration::ZERO;
        }
        let drifted = crate::isolation::drifted();
        if !drifted.is_empty() {
            self.failed(&format!(
                "settings changed under the worker, restored: {}",
                drifted.join(", ")
            ));
            if let Err(e) =
                crate::transaction::in_bare_transaction(crate::isolation::pin_worker_settings)
            {
                self.failed(&format!("restoring settings: {e}"));
                return poll;
            }
        }
        // One short transaction decides what this round does: is the SQL installed, which sinks
        // are due.
        // It also asks whether a restored log waits to be adopted, and whether committed events
        // wait behind the read horizon (then the worker looks again soon, see the end).
        let round = in_transaction(|| {
            let state = installed();
            let ready = state == Installed::Ready;
            let sinks = ready.then(|| dispatch::due_sinks(self.slot));
            let (subscriptions, schedule_due_in, restored, waiting, ticking) =
                if ready && dispatch::lock_tables() {
                    (
                        dispatch::fanout::active(self.slot),
                        crate::schedule::due_in(),
                        crate::lineage::restored(),
                        dispatch::events_waiting(),
                        crate::ticks::wanted(),
                    )
                } else {
                    ((Vec::new(), Some(Vec::new())), None, false, false, false)
                };
            // The round's tick, last, in this transaction (one commit less a round; the tick
            // lock is held for the moment until it commits): but not while a restored log waits
            // to be adopted (below), and in a subtransaction, so that a tick that cannot be
            // taken does not undo the round.
            let ticked = (ticking && !restored)
                .then(|| crate::transaction::in_subtransaction(crate::ticks::take).map(|_| ()));
            (
                state,
                sinks,
                subscriptions,
                schedule_due_in,
                (restored, ticking, ticked),
                waiting,
            )
        });
        let (
            state,
            sinks,
            (subscriptions, subscriptions_read),
            schedule_due_in,
            (restored, ticking, ticked),
            waiting,
        ) = match round {
            Ok(round) => round,
            Err(e) => {
                self.failed(&e.to_string());
                return poll;
            }
        };
        if state == Installed::Missing {
            // A probe found nothing, or DROP EXTENSION: the launcher remembers, and looks again
            // when CREATE EXTENSION asks it to.
            if self.installed {
                pgrx::log!(
                    "pg_outbox worker {}: pg_outbox was dropped from database \"{}\"; exiting",
                    self.slot,
                    self.database
                );
            }
            slot_outcome(self.slot, OUTCOME_ABSENT);
            self.stop = true;
            return Duration::ZERO;
        }
        if !self.installed {
            self.installed = true;
            slot_installed(self.slot);
            pgrx::log!(
                "pg_outbox worker {} started in database \"{}\"",
                self.slot,
                self.database
            );
        }
        if state != Installed::Ready {
            if self.warned.as_ref() != Some(&state) {
                match &state {
                    Installed::Missing => {}
                    Installed::Other(v) => pgrx::warning!(
                        "pg_outbox worker {} is idle: the installed SQL is version {v}, this binary is {}; run ALTER EXTENSION pg_outbox UPDATE",
                        self.slot,
                        env!("CARGO_PKG_VERSION")
                    ),
                    Installed::Ready => {}
                }
                self.warned = Some(state);
            }
            return poll;
        }
        self.warned = None;
        if !self.placed {
            // Once per process: the zone rules it loaded may be newer than those that placed the
            // one-off runs.
            match in_transaction(crate::schedule::place_one_offs) {
                Ok(()) => self.placed = true,
                Err(e) => self.failed(&format!("placing one-off runs: {e}")),
            }
        }
        // A restored log is adopted as soon as its dumped row is in (crate::lineage).
        let mut adopted = true;
        if restored {
            match in_transaction(crate::lineage::adopt_if_restored) {
                Ok(()) => self.lineage_warned = false,
                Err(e) if !self.lineage_warned => {
                    adopted = false;
                    self.lineage_warned = true;
                    self.failed(&format!("adopting a restored log: {e}"));
                }
                Err(_) => adopted = false,
            }
        }
        // A tick, before anything is read: it holds every commit up to now (crate::ticks). Only
        // while a reader reads by ticks (no transaction a round for a log nobody reads so), and
        // not while a restored log waits to be adopted: its snapshot would be in the terms of an
        // epoch that is not settled yet.
        if adopted && ticking {
            let tick = match ticked {
                Some(taken) => taken,
                None => in_transaction(crate::ticks::take).map(|_| ()),
            };
            if let Err(e) = tick {
                self.failed(&format!("taking a tick: {e}"));
            }
            // The ticks readers have passed go often: a tick a round makes many.
            if super::first_of_database(self.slot)
                && self
                    .last_tick_prune
                    .is_none_or(|t| t.elapsed() >= crate::ticks::PRUNE_EVERY)
            {
                self.last_tick_prune = Some(Instant::now());
                if let Err(e) = in_transaction(crate::ticks::prune) {
                    self.failed(&format!("pruning ticks: {e}"));
                }
            }
        }

        let mut sleep = poll;
        let mut busy = false;
        let mut contended = false;
        let sinks = sinks.expect("due sinks are read when the SQL is ready");
        let consumers = sinks.count + subscriptions.len();
        super::set_has_sinks(consumers > 0);
        let mut reads = sinks.reads;
        dispatch::add_reads(&mut reads, subscriptions_read);
        super::publish_interest(self.slot, reads.as_deref());
        let mut results = Vec::new();
        self.finished_flights(&mut results);
        for (sink, is_http) in sinks.due {
            if self.stopping() {
                break;
            }
            let result = if is_http {
                match self.send_windows(&sink) {
                    Some(result) => result,
                    None => continue,
                }
            } else {
                activity(&format!("sink \"{sink}\": delivering a batch"));
                in_transaction(|| dispatch::pass(&sink))
            };
            results.push((sink, result));
        }
        // The HTTP requests fly while the SQL sinks are served; those done by now are recorded,
        // the others in a later round (the wait between rounds ends when one lands).
        self.finished_flights(&mut results);
        self.agents.expire();
        for (sink, result) in results {
            match result {
                Ok(PassResult::Delivered { events, full }) => {
                    slot_pass(self.slot, events as u64);
                    self.worked |= events > 0;
                    busy |= full;
                }
                Ok(PassResult::Retry) => busy = true,
                Ok(PassResult::Contended) => contended = true,
                Ok(_) => slot_pass(self.slot, 0),
                Err(e) => self.failed(&format!("sink \"{sink}\": {e}")),
            }
        }
        if let Some(next) = sinks.next_attempt_in {
            sleep = sleep.min(next);
        }
        // Due schedules fire in one statement; with several workers each run fires once.
        match schedule_due_in {
            Some(0) => {
                activity("firing due schedules");
                match in_transaction(crate::schedule::fire_due) {
                    // Look again soon: the next run, or a run that came due meanwhile. (Not when
                    // nothing fired: a due run whose row a tenant's transaction holds stays due,
                    // and the worker would go round every millisecond until it ends.)
                    Ok(fired) if fired > 0 => {
                        self.worked = true;
                        sleep = sleep.min(Duration::from_millis(1));
                    }
                    // Runs that wrote nothing (a job still waiting, say) moved on all the same.
                    Ok(_) => {
                        if let Ok(Some(ms)) = in_transaction(crate::schedule::due_in) {
                            if ms > 0 {
                                sleep = sleep.min(Duration::from_millis(ms as u64));
                            }
                        }
                    }
                    Err(e) => self.failed(&format!("firing schedules: {e}")),
                }
                // Each schedules one by one, each in a transaction of its own: a tenant's query
                // runs in each (see schedule::fire_one_each).
                self.held_each
                    .retain(|(_, at)| at.elapsed() < EACH_HELD_WAIT);
                let mut skip: Vec<String> = self
                    .held_each
                    .iter()
                    .map(|(name, _)| name.clone())
                    .collect();
                let started = Instant::now();
                // More may be due than one round fires: go round again soon.
                let mut more_each = true;
                for _ in 0..crate::schedule::EACH_PER_ROUND {
                    if self.stopping() || started.elapsed() > crate::schedule::EACH_ROUND_TIME {
                        break;
                    }
                    match in_transaction(|| crate::schedule::fire_one_each(&skip)) {
                        Ok(EachRun::Ran) => self.worked = true,
                        Ok(EachRun::Held(name)) => {
                            skip.push(name.clone());
                            self.held_each.push((name, Instant::now()));
                        }
                        Ok(EachRun::None) => {
                            more_each = false;
                            break;
                        }
                        Err(e) => {
                            self.failed(&format!("firing an each schedule: {e}"));
                            more_each = false;
                            break;
                        }
                    }
                }
                if more_each {
                    sleep = sleep.min(Duration::from_millis(1));
                }
            }
            Some(ms) => sleep = sleep.min(Duration::from_millis(ms as u64)),
            None => {}
        }
        if let Some(next) = self.announce_jobs() {
            sleep = sleep.min(next);
        }
        let (more, next_job) = self.subscriptions(&subscriptions, &mut contended);
        busy |= more;
        if let Some(next) = next_job {
            sleep = sleep.min(next);
        }
        if busy {
            return Duration::ZERO;
        }
        // Another worker held a sink while this one was woken: it may have read its window before
        // the commit that woke us. Look again soon (1 ms doubling to 50 ms while it lasts), or
        // that commit would wait for the poll interval.
        if contended {
            self.contention_backoff = (self.contention_backoff * 2)
                .clamp(Duration::from_millis(1), Duration::from_millis(50));
            sleep = sleep.min(self.contention_backoff);
        } else {
            self.contention_backoff = Duration::ZERO;
        }
        // One worker prunes; the cursor lock would serialise two anyway.
        if super::first_of_database(self.slot) {
            self.maybe_prune();
        }
        // Events committed but not yet readable when the round began: a transaction holds the
        // horizon. Look again soon (2 ms doubling to 100 ms) instead of after a full poll
        // interval. (Those committed since woke the worker, and it goes round again at once.)
        match consumers > 0 && waiting {
            true => {
                self.waiting_backoff = (self.waiting_backoff * 2)
                    .clamp(Duration::from_millis(2), Duration::from_millis(100));
                sleep.min(self.waiting_backoff)
            }
            false => {
                self.waiting_backoff = Duration::ZERO;
                sleep
            }
        }
    }

    /// Wakes external job workers: `NOTIFY outbox_jobs, '<queue>'` for the queues that
    /// applications' commits announced (`worker::announce_at_commit`), and, by the first worker
    /// of the database, for those whose jobs came due (a delayed run_at or a retry, at the time it
    /// comes; a lapsed lease, within `JOBS_LOOK`), after expiring the jobs nobody claimed in time,
    /// when they expire (`outbox._announce_jobs`). Fan-out and schedules notify in their own transactions. Returns
    /// how long until the first worker looks again.
    fn announce_jobs(&mut self) -> Option<Duration> {
        let (queues, all) = super::take_announced(self.slot);
        let first = super::first_of_database(self.slot);
        let now = Instant::now();
        if let Some(due) = super::take_look_by(self.slot).filter(|_| first) {
            // A job comes due or expires later: look then (JOBS_LOOK_MIN after, so that its
            // notification is not sent before it is due).
            self.jobs_check_at = self.jobs_check_at.min(now + due + JOBS_LOOK_MIN);
        }
        let look = first && now >= self.jobs_check_at;
        if queues.is_empty() && !all && !look {
            return self.next_jobs_look(first, now);
        }
        let leases = look && now >= self.jobs_leases_at;
        let every = all || (look && self.jobs_since.is_none());
        activity("announcing jobs");
        let looked = in_transaction(|| {
            // Never waits: a DDL in progress on the tables holds this look until the next round.
            if !dispatch::lock_tables() {
                return Ok((None, None, None));
            }
            let args = [
                DatumWithOid::from(queues),
                DatumWithOid::from(self.jobs_since),
                DatumWithOid::from(if leases {
                    self.leases_since.or(self.jobs_since)
                } else {
                    None
                }),
                DatumWithOid::from(every),
            ];
            // Every round that fanned jobs out asks: a kept plan.
            Spi::connect_mut(|client| {
                let rows = crate::plans::update(
                    client,
                    "SELECT checked, due_in, notified FROM outbox._announce_jobs($1, $2, $3, $4)",
                    Some(1),
                    &args,
                )?;
                if rows.is_empty() {
                    return Ok((None, None, None));
                }
                let row = rows.first();
                Ok::<_, pgrx::spi::Error>((
                    row.get::<TimestampWithTimeZone>(1)?,
                    row.get::<i64>(2)?,
                    row.get::<i32>(3)?,
                ))
            })
        });
        match looked {
            // DDL holds the tables: look again soon, not at once.
            Ok(Ok((None, _, _))) if look => self.jobs_check_at = now + JOBS_LOOK_MIN,
            Ok(Ok((None, _, _))) => {}
            Ok(Ok((checked, due_in, notified))) => {
                if notified == Some(-1)
                    && self
                        .notify_full_warned
                        .is_none_or(|at| at.elapsed() > Duration::from_secs(60))
                {
                    self.notify_full_warned = Some(now);
                    pgrx::warning!(
                        "pg_outbox worker {}: the server's notification queue is more than half full; external job workers are not notified until it drains",
                        self.slot
                    );
                }
                // At least JOBS_LOOK_MIN: a job that expired but is held by a claim without a
                // lease stays due until that transaction ends.
                let due_in = due_in.map_or(JOBS_LOOK, |ms| Duration::from_millis(ms as u64));
                let due_in = due_in.clamp(JOBS_LOOK_MIN, JOBS_LOOK);
                let next = now + due_in;
                if look {
                    self.jobs_since = checked;
                    if leases || every {
                        self.leases_since = checked;
                        self.jobs_leases_at = now + JOBS_LOOK;
                    }
                    // Leases that lapse are looked for every JOBS_LOOK, whatever comes due.
                    self.jobs_check_at = next.min(self.jobs_leases_at);
                } else if first {
                    // Announced jobs may come due or expire before the next look.
                    self.jobs_check_at = self.jobs_check_at.min(next);
                } else if due_in < JOBS_LOOK {
                    // The first worker looks: it may not know of these before its next look.
                    super::look_by(super::timestamp_after(due_in));
                }
            }
            Ok(Err(e)) => self.look_failed(look, now, &e.to_string()),
            Err(e) => self.look_failed(look, now, &e.to_string()),
        }
        self.next_jobs_look(first, Instant::now())
    }

    fn look_failed(&mut self, look: bool, now: Instant, error: &str) {
        if look {
            // Not at once again: a look that fails would spin, warning each time.
            self.jobs_check_at = now + JOBS_LOOK;
        }
        self.failed(&format!("announcing jobs: {error}"));
    }

    /// How long until this worker looks at the jobs again (None: it does not), as it also tells
    /// the others (`look_by` wakes it only for sooner).
    fn next_jobs_look(&self, first: bool, now: Instant) -> Option<Duration> {
        let next = first.then(|| self.jobs_check_at.saturating_duration_since(now));
        super::set_looks_at(self.slot, next);
        next
    }

    /// Fan-out for every active subscription, then the due jobs of those with a handler. Returns
    /// whether more work is waiting (go round again at once) and when the next job is due.
    fn subscriptions(
        &mut self,
        subscriptions: &[(String, bool)],
        contended: &mut bool,
    ) -> (bool, Option<Duration>) {
        let mut more = false;
        // One pass serves every subscription this worker can lease.
        let names: Vec<&str> = subscriptions.iter().map(|(n, _)| n.as_str()).collect();
        activity(&format!("fan-out of {} subscriptions", names.len()));
        match in_transaction(|| dispatch::fanout::pass(&names)) {
            Ok((result, held_off)) => {
                // A subscription whose queue is being dropped is looked at again soon.
                *contended |= held_off;
                match result {
                    PassResult::Delivered { events, full } => {
                        slot_pass(self.slot, events as u64);
                        self.worked |= events > 0;
                        more |= full;
                    }
                    PassResult::Contended => *contended = true,
                    _ => {}
                }
            }
            Err(e) => {
                // One subscription's trouble must not stall the others: go one by one.
                self.failed(&format!("fan-out: {e}"));
                for name in &names {
                    match in_transaction(|| dispatch::fanout::pass(&[name])) {
                        Ok((PassResult::Delivered { events, full }, held_off)) => {
                            slot_pass(self.slot, events as u64);
                            more |= full;
                            *contended |= held_off;
                        }
                        Ok((_, held_off)) => *contended |= held_off,
                        Err(e) => self.failed(&format!("subscription \"{name}\": {e}")),
                    }
                }
            }
        }
        if !subscriptions.iter().any(|(_, handler)| *handler) {
            return (more, None);
        }
        let queues = match in_transaction(dispatch::jobs::handler_queues) {
            Ok(queues) => queues,
            Err(e) => {
                self.failed(&format!("listing jobs: {e}"));
                return (more, None);
            }
        };
        let mut next: Option<Duration> = None;
        for (name, due) in queues {
            match due {
                Some(d) if d.is_zero() => {}
                Some(d) => {
                    next = Some(next.map_or(d, |n| n.min(d)));
                    continue;
                }
                None => continue,
            }
            // A bounded number of batches per round, so that sinks are never starved.
            for _ in 0..JOB_BATCHES_PER_ROUND {
                if self.stopping() {
                    return (false, None);
                }
                activity(&format!("subscription \"{name}\": running jobs"));
                match in_transaction(|| dispatch::jobs::run(&name)) {
                    Ok(ran) => {
                        slot_pass(self.slot, ran.done as u64);
                        self.worked |= ran.done > 0;
                        if !ran.full {
                            break;
                        }
                        more = true;
                    }
                    Err(e) => {
                        self.failed(&format!("jobs of subscription \"{name}\": {e}"));
                        break;
                    }
                }
            }
        }
        (more, next)
    }

    /// Starts the next window of an HTTP or Kafka sink, and for a Kafka sink goes on while the
    /// windows come full and its chain has room ([`dispatch::http::InFlight::chain`]), so that
    /// a backlog fills the chain at once instead of one window per landing. None: the windows
    /// fly (or wait behind those in flight); else what the sink's pass came to.
    fn send_windows(
        &mut self,
        sink: &str,
    ) -> Option<Result<PassResult, crate::transaction::Failure>> {
        let mut first = true;
        loop {
            // Its windows from earlier rounds still on their way: a Kafka sink's next window may
            // chain behind them, else the sink waits for them. After the first, only behind a
            // full window (a backlog): a window that came short read all there was.
            let flying: Vec<_> = self
                .in_flight
                .iter()
                .filter(|f| f.sink_id() == sink)
                .collect();
            let counted = dispatch::http::chain_count(flying.len(), self.in_flight.len());
            let chain = match flying.last() {
                None => None,
                Some(newest) if !first && !newest.full() => return None,
                Some(newest) => match newest.chain(counted, &mut self.agents) {
                    Some(chain) if flying.iter().all(|f| !f.discarded()) => Some(chain),
                    _ => return None,
                },
            };
            activity(&format!("sink \"{sink}\": reading and sending a batch"));
            let flying = counted;
            match dispatch::http::start(sink, &mut self.agents, chain, flying) {
                Ok(dispatch::http::Started::InFlight(flight, behind)) => {
                    self.in_flight.push(*flight);
                    self.in_flight.extend(behind);
                }
                Ok(dispatch::http::Started::Done(result)) => return Some(Ok(result)),
                Err(e) => return Some(Err(e)),
            }
            first = false;
            if self.stopping() {
                return None;
            }
        }
    }

    /// Records the HTTP requests that have landed.
    fn finished_flights(
        &mut self,
        results: &mut Vec<(String, Result<PassResult, crate::transaction::Failure>)>,
    ) {
        // The windows of a sink are recorded in the order they were read (the oldest first); the
        // sink's lease goes back with the last of them to land.
        while let Some(i) = self.landed_head() {
            let flight = self.in_flight.remove(i);
            let sink = flight.sink_id().to_string();
            if flight.discarded() {
                if !self.in_flight.iter().any(|f| f.sink_id() == sink) {
                    dispatch::http::abandon(flight);
                }
                continue;
            }
            // The windows chained behind a delivered one that were delivered too are recorded
            // with it, in one transaction.
            let mut also = Vec::new();
            if flight.delivered_window() {
                while let Some(j) = self.in_flight.iter().position(|f| f.sink_id() == sink) {
                    if !self.in_flight[j].delivered_window() {
                        break;
                    }
                    also.push(self.in_flight.remove(j));
                }
            }
            let behind = self.in_flight.iter().any(|f| f.sink_id() == sink);
            match dispatch::http::finish(flight, also, &mut self.agents, behind) {
                dispatch::http::Landed::Recorded(result) => {
                    if !matches!(result, Ok(PassResult::Delivered { .. })) {
                        // The windows behind a failed one are sent again after it: none of
                        // their outcomes counts.
                        self.in_flight
                            .iter_mut()
                            .filter(|f| f.sink_id() == sink)
                            .for_each(|f| f.discard());
                    }
                    results.push((sink, result));
                }
                // The neighbour test flies on its own, like any request.
                dispatch::http::Landed::Next(next) => {
                    self.in_flight
                        .iter_mut()
                        .filter(|f| f.sink_id() == sink)
                        .for_each(|f| f.discard());
                    self.in_flight.push(*next);
                }
            }
        }
    }

    /// A flight that landed and may be recorded now: the oldest of its sink's.
    fn landed_head(&self) -> Option<usize> {
        self.in_flight.iter().enumerate().position(|(i, f)| {
            f.is_finished()
                && !self.in_flight[..i]
                    .iter()
                    .any(|older| older.sink_id() == f.sink_id())
        })
    }

    /// Stopping: the requests in flight are left to themselves and their leases given back; the
    /// cursors did not move, so those batches go out again (with the same idempotency keys).
    fn abandon_flights(&mut self) {
        self.in_flight.drain(..).for_each(dispatch::http::abandon);
    }

    /// Waits for the latch, the timeout, or (while requests fly) the first of them to land.
    fn wait(&self, timeout: Duration) -> bool {
        if self.in_flight.is_empty() || timeout.is_zero() {
            return wait(timeout);
        }
        // The oldest window of each sink is the one to record next: its landing wakes the
        // worker (the windows chained behind it land without waking anybody).
        for (i, f) in self.in_flight.iter().enumerate() {
            if !self.in_flight[..i]
                .iter()
                .any(|older| older.sink_id() == f.sink_id())
            {
                f.wake_when_landed();
            }
        }
        let start = Instant::now();
        loop {
            if self.landed_head().is_some() {
                return true;
            }
            let left = timeout.saturating_sub(start.elapsed());
            let (alive, latched) = wait_once(left.min(FLIGHT_POLL));
            if !alive {
                return false;
            }
            if latched || left <= FLIGHT_POLL {
                return true;
            }
        }
    }

    /// An extra worker that has found nothing to do for `RETIRE_AFTER` leaves, if its database
    /// keeps enough workers without it (`try_retire`). Requests in flight count as work.
    fn retiring(&mut self) -> bool {
        if self.worked || !self.in_flight.is_empty() {
            self.idle_since = None;
            return false;
        }
        let since = *self.idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < RETIRE_AFTER || !super::try_retire(self.slot) {
            return false;
        }
        pgrx::log!(
            "pg_outbox worker {}: idle for {} s with other workers free in database \"{}\"; exiting",
            self.slot,
            RETIRE_AFTER.as_secs(),
            self.database
        );
        true
    }

    /// True once SIGTERM has arrived (and from then on).
    fn stopping(&mut self) -> bool {
        if !self.stop && super::retire_requested(self.slot) {
            pgrx::log!(
                "pg_outbox worker {}: making room for another database's worker; exiting",
                self.slot
            );
            super::slot_outcome(self.slot, super::OUTCOME_RETIRED);
            self.stop = true;
        }
        self.stop |= super::stop_requested();
        self.stop
    }

    fn maybe_prune(&mut self) {
        let interval = settings::secs(&settings::PRUNE_INTERVAL_S);
        if self.last_prune.is_some_and(|t| t.elapsed() < interval) {
            return;
        }
        self.last_prune = Some(Instant::now());
        activity("pruning the log");
        for k in crate::prune::aged_partitions() {
            use crate::prune::{Pruned, DELETE_BATCH};
            let why = match in_transaction(|| crate::prune::prune_partition(k)) {
                Ok(Pruned::Truncated) => {
                    pgrx::log!("pg_outbox: pruned the log: truncated outbox.events_{k}");
                    continue;
                }
                Ok(Pruned::Delete(why)) => why,
                Ok(Pruned::Nothing) => continue,
                Err(e) => {
                    self.failed(&format!("pruning: {e}"));
                    continue;
                }
            };
            // Batch by batch, each in its own transaction, while the worker is not asked to stop.
            let mut deleted = 0;
            loop {
                match in_transaction(|| crate::prune::delete_passed(k)) {
                    Ok(n) => {
                        deleted += n;
                        if n < DELETE_BATCH || self.stopping() {
                            break;
                        }
                    }
                    Err(e) => {
                        self.failed(&format!("pruning: {e}"));
                        break;
                    }
                }
            }
            if deleted > 0 {
                pgrx::log!(
                    "pg_outbox: pruned the log: deleted {deleted} events of outbox.events_{k} \
                     instead of truncating it ({why})"
                );
            }
        }
    }

    fn failed(&self, error: &str) {
        // DDL holds the extension's tables (DROP EXTENSION, say): the step runs later.
        if crate::transaction::locked_by_ddl(error) {
            return;
        }
        pgrx::warning!("pg_outbox worker {}: {error}", self.slot);
        slot_failure(self.slot, error);
    }
}

/// How long an each schedule whose row another transaction held is passed over before its query
/// runs again (`Worker::held_each`).
const EACH_HELD_WAIT: Duration = Duration::from_secs(1);

/// How often a worker whose requests fly looks whether one has landed, should the latch a
/// request's thread sets when it lands (the usual wakeup) ever be missed.
const FLIGHT_POLL: Duration = Duration::from_millis(50);

/// Waits for the latch or the timeout. (alive: the postmaster lives; latched: the latch was set.)
fn wait_once(timeout: Duration) -> (bool, bool) {
    // SAFETY: the standard latch wait of a background worker.
    let rc = unsafe {
        let rc = pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_POSTMASTER_DEATH) as i32,
            timeout.as_millis().clamp(1, i32::MAX as u128) as std::ffi::c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        rc
    };
    pg_sys::check_for_interrupts!();
    (
        rc & pg_sys::WL_POSTMASTER_DEATH as i32 == 0,
        rc & pg_sys::WL_LATCH_SET as i32 != 0,
    )
}

/// How long a worker rests after a round that did not fill a batch, before a commit's wake-up
/// starts the next one: `COALESCING_FACTOR` times the processor time the round took, at most
/// `COALESCING_MAX`. A worker woken by every commit would otherwise run a full round (a few short
/// transactions of its own) for each, however few events it brought; under a steady stream of
/// small commits its rounds then took about half a core from the applications committing (raise
/// at 8 clients with a sink delivering: 0.8 of PgQ with its consumer running). Resting in
/// proportion to its own work keeps a worker to a quarter of a core on such a stream, while the
/// commits that arrive meanwhile are delivered together by the next round; the delay a commit
/// can meet is at most `COALESCING_MAX`, and none at all when the worker was idle for longer.
fn coalescing_rest(cpu: Duration) -> Duration {
    (cpu * COALESCING_FACTOR).min(COALESCING_MAX)
}

const COALESCING_FACTOR: u32 = 3;
const COALESCING_MAX: Duration = Duration::from_millis(1);

/// Processor time this process has used.
fn thread_cpu() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes the clock into `t`; the thread's clock always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// Sleeps (at most `COALESCING_MAX`), not woken by the latch: it stays set for the next wait.
fn sleep(duration: Duration) {
    // SAFETY: PostgreSQL's sleep; a signal (SIGTERM) ends it early, and is seen just after.
    unsafe { pg_sys::pg_usleep(duration.as_micros().min(i64::MAX as u128) as std::ffi::c_long) };
    pg_sys::check_for_interrupts!();
}

/// Waits for the latch or the timeout. False when the postmaster died.
fn wait(timeout: Duration) -> bool {
    if timeout.is_zero() {
        pg_sys::check_for_interrupts!();
        return true;
    }
    // SAFETY: the standard latch wait of a background worker.
    let rc = unsafe {
        let rc = pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_POSTMASTER_DEATH) as i32,
            timeout.as_millis().min(i32::MAX as u128) as std::ffi::c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        rc
    };
    pg_sys::check_for_interrupts!();
    rc & pg_sys::WL_POSTMASTER_DEATH as i32 == 0
}

/// Shows the step the worker is on in `pg_stat_activity` (`state` active, `query` the step: the
/// sink or subscription and what it does). Handlers' own statements are not shown there (SPI does
/// not report them); the step names what runs them.
fn activity(what: &str) {
    let what = std::ffi::CString::new(format!("pg_outbox: {what}")).expect("no NUL in names");
    // SAFETY: copies the string into this backend's shared status entry.
    unsafe { pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_RUNNING, what.as_ptr()) };
}

/// Between rounds: `state` idle, `query` the last step.
fn idle() {
    // SAFETY: as above; a null text keeps the last one.
    unsafe { pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_IDLE, std::ptr::null()) };
}
