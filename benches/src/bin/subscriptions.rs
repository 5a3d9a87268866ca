//! Subscriptions benchmark: the fan-out cost per event per subscription with 1, 10 and 100
//! filtered subscriptions, and how many jobs per second the workers run through a trivial SQL
//! handler. Starts its own throwaway cluster (fsync on, pg_outbox preloaded), prints tables,
//! stops the cluster.
//!
//! Run through `bash benches/subscriptions.sh` (builds and installs the release build first).
//! BENCH_EVENTS (default 20000) sets the events per fan-out run, BENCH_JOBS (default 100000) the
//! jobs per run of the handler, BENCH_FANOUT_SUBS one count of subscriptions to fan out to (default
//! 1, 10 and 100).

use pg_outbox_benches::{
    drain_until_empty, env_or, head, record, record_ratio, record_x_unit, with_bench_cluster,
};
use pg_outbox_tests::{eventually, Cluster};
use postgres::Client;
use std::time::{Duration, Instant};

const SETUP: &str = "
    CREATE EXTENSION pg_outbox;
    CREATE TABLE done (k bigint);
    -- The hand-written queue the jobs are measured against: the same payloads, the same work.
    CREATE TABLE plain_jobs (id bigserial PRIMARY KEY, payload jsonb NOT NULL);
    -- The trivial handler: one row per job.
    CREATE FUNCTION work(e outbox.event) RETURNS void LANGUAGE sql AS $$
        INSERT INTO public.done VALUES ((e.payload->>'k')::bigint)
    $$;";

/// Raises `n` events `{k, amount 0..99}` in transactions of 10,000, tenants acme and globex.
fn raise(c: &mut Client, n: i64) {
    let mut raised = 0i64;
    while raised < n {
        let upto = (raised + 10_000).min(n);
        c.execute(
            "SELECT outbox.raise_many(ARRAY['orders.created'], \
                    array_agg(jsonb_build_object('k', i, 'amount', i % 100, 'currency', 'EUR') ORDER BY i), \
                    tenants => array_agg(CASE WHEN i % 2 = 0 THEN 'acme' ELSE 'globex' END ORDER BY i)) \
               FROM generate_series($1::int8 + 1, $2::int8) i",
            &[&raised, &upto],
        )
        .unwrap();
        raised = upto;
    }
}

/// Waits until every subscription's cursor has reached `position`.
fn wait_for_subscriptions(c: &mut Client, position: &str, within: Duration) {
    let (txid, seq) = position.split_once(':').unwrap();
    let (txid, seq): (String, i64) = (txid.to_string(), seq.parse().unwrap());
    eventually("subscriptions to catch up", within, || {
        let behind: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox.consumers WHERE kind = 'subscription' \
                    AND (txid, seq) < ($1::text::xid8, $2)",
                &[&txid, &seq],
            )
            .unwrap()
            .get(0);
        (behind == 0).then_some(())
    });
}

/// Microseconds of wall-clock time per event per subscription: `subs` paused subscriptions with
/// a filter each, `events` waiting, then all resumed at once.
fn fanout(c: &mut Client, subs: usize, events: i64) -> (f64, i64) {
    for s in 0..subs {
        c.execute(
            "SELECT outbox.subscribe($1, '{orders.*}', queue => 'fan', start_at => 'now', filter => $2)",
            &[
                &format!("fan_{s}"),
                &format!("payload.amount > {} && tenant == \"acme\"", 90 - s % 10),
            ],
        )
        .unwrap();
        c.execute(
            "SELECT outbox.pause_subscription($1)",
            &[&format!("fan_{s}")],
        )
        .unwrap();
    }
    raise(c, events);
    let last = head(c);
    // Autovacuum of the events just raised would otherwise share the two cores with the pass.
    c.batch_execute("VACUUM outbox.events").unwrap();
    c.batch_execute("CHECKPOINT").unwrap();
    let start = Instant::now();
    for s in 0..subs {
        c.execute(
            "SELECT outbox.resume_subscription($1)",
            &[&format!("fan_{s}")],
        )
        .unwrap();
    }
    wait_for_subscriptions(c, &last, Duration::from_secs(600));
    let elapsed = start.elapsed();
    let jobs: i64 = c
        .query_one("SELECT count(*) FROM outbox.jobs", &[])
        .unwrap()
        .get(0);
    for s in 0..subs {
        c.execute("SELECT outbox.unsubscribe($1)", &[&format!("fan_{s}")])
            .unwrap();
    }
    c.batch_execute("DELETE FROM outbox.jobs").unwrap();
    (
        elapsed.as_secs_f64() * 1e6 / (events as f64 * subs as f64),
        jobs,
    )
}

/// Jobs per second the workers run through `work(outbox.event)`. With `fan_out`, the clock covers
/// the fan-out of `jobs` waiting events too; without, the jobs are already queued.
fn handler_jobs(c: &mut Client, jobs: i64, fan_out: bool) -> f64 {
    c.batch_execute(
        "TRUNCATE done;
         SELECT outbox.subscribe('work', '{orders.*}', handler => 'work(outbox.event)', start_at => 'now');
         SELECT outbox.pause_subscription('work');",
    )
    .unwrap();
    raise(c, jobs);
    if !fan_out {
        // The read rule makes committed events readable only once every transaction that could
        // still commit before them has ended (a worker's, say): wait until all are.
        eventually("the events to be readable", Duration::from_secs(60), || {
            let readable: i64 = c
                .query_one(
                    "SELECT count(*) FROM outbox.consumers c, outbox._read_after(c.txid, c.seq, 100000000) r \
                      WHERE c.name = 'work'",
                    &[],
                )
                .unwrap()
                .get(0);
            (readable >= jobs).then_some(())
        });
        // Fan out while paused for jobs is not possible; queue the jobs as fan-out would, and
        // move the cursor past them.
        let queued = c
            .execute(
                "WITH r AS (
                     SELECT r AS e FROM outbox.consumers c, outbox._read_after(c.txid, c.seq, 100000000) r
                      WHERE c.name = 'work'),
                 moved AS (
                     UPDATE outbox.consumers
                        SET (txid, seq) = (SELECT split_part((e).position, ':', 1)::xid8,
                                                  split_part((e).position, ':', 2)::int8
                                             FROM r ORDER BY 1 DESC, 2 DESC LIMIT 1)
                      WHERE name = 'work')
                 INSERT INTO outbox.jobs (queue, payload, key, event, subscription, handler)
                 SELECT 'work', to_jsonb(e), 'work:' || (e).id, (e).id, 'work', 'work(outbox.event)'::regprocedure
                   FROM r",
                &[],
            )
            .unwrap() as i64;
        assert_eq!(queued, jobs, "every raised event queued as a job");
        c.batch_execute("VACUUM ANALYZE outbox.jobs").unwrap();
    }
    c.batch_execute("CHECKPOINT").unwrap();
    let start = Instant::now();
    c.batch_execute("SELECT outbox.resume_subscription('work')")
        .unwrap();
    eventually("the jobs to run", Duration::from_secs(600), || {
        let ran: i64 = c
            .query_one("SELECT count(*) FROM done", &[])
            .unwrap()
            .get(0);
        (ran >= jobs).then_some(())
    });
    let rate = jobs as f64 / start.elapsed().as_secs_f64();
    let (ran, distinct, left): (i64, i64, i64) = {
        let r = c
            .query_one(
                "SELECT count(*), count(DISTINCT k), (SELECT count(*) FROM outbox.jobs) FROM done",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!((ran, distinct, left), (jobs, jobs, 0), "every job ran once");
    c.batch_execute("SELECT outbox.unsubscribe('work')")
        .unwrap();
    rate
}

/// The same `jobs` done by a hand-written queue: rows holding the payloads the jobs carry, and two
/// clients (as many as the workers) that each take up to 128 with FOR UPDATE SKIP LOCKED, insert
/// one `done` row per job and delete them, in one statement, until the queue is empty. Jobs/s.
fn skip_locked_jobs(cluster: &Cluster, c: &mut Client, jobs: i64) -> f64 {
    c.batch_execute("TRUNCATE done, plain_jobs").unwrap();
    c.execute(
        "INSERT INTO plain_jobs (payload) \
         SELECT jsonb_build_object('k', i, 'amount', i % 100, 'currency', 'EUR') FROM generate_series(1, $1::int8) i",
        &[&jobs],
    )
    .unwrap();
    c.batch_execute("VACUUM ANALYZE plain_jobs").unwrap();
    c.batch_execute("CHECKPOINT").unwrap();
    let seconds = drain_until_empty(
        cluster,
        2,
        "WITH claimed AS ( \
             DELETE FROM plain_jobs WHERE id IN ( \
                 SELECT id FROM plain_jobs ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED) \
             RETURNING payload) \
         INSERT INTO done SELECT (payload->>'k')::bigint FROM claimed",
        128,
    );
    let rate = jobs as f64 / seconds;
    let (ran, distinct): (i64, i64) = {
        let r = c
            .query_one("SELECT count(*), count(DISTINCT k) FROM done", &[])
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(
        (ran, distinct),
        (jobs, jobs),
        "the queue ran every job once"
    );
    c.batch_execute("TRUNCATE done").unwrap();
    rate
}

fn main() {
    let events: i64 = env_or("BENCH_EVENTS", 20_000);
    let jobs: i64 = env_or("BENCH_JOBS", 100_000);
    let settings = [
        // The soak below runs for seconds, not hours: let autovacuum look every 5 s.
        "autovacuum_naptime = '5s'",
    ];
    with_bench_cluster("pg_outbox_bench_subs", &settings, SETUP, |cluster, c| {
        let version: String = c.query_one("SHOW server_version", &[]).unwrap().get(0);
        let workers: String = c
            .query_one("SHOW pg_outbox.min_workers", &[])
            .unwrap()
            .get(0);
        println!(
            "\npg_outbox subscriptions benchmark: PostgreSQL {version}, fsync on, {workers} workers at least"
        );
        println!(
            "fan-out: {events} waiting events (200,000 with 1 subscription), each subscription \
             filtering with `payload.amount > N && tenant == \"acme\"` (about 5% match, a job each)\n"
        );
        // Runs per figure, the median kept: one run swings by a third on this machine.
        let runs = env_or("BENCH_FANOUT_RUNS", 3).max(1) as usize;
        println!(
            "{:<16} {:>22} {:>12}   runs",
            "subscriptions", "µs per event per sub", "jobs written"
        );
        // BENCH_FANOUT_SUBS: one count of subscriptions only (to profile it, say).
        let counts: Vec<usize> = match env_or("BENCH_FANOUT_SUBS", 0usize) {
            0 => vec![1, 10, 100],
            n => vec![n],
        };
        for subs in counts {
            // At least 200,000 evaluations per run, so that fixed costs do not dominate.
            let n = events.max(env_or("BENCH_MIN_EVALUATIONS", 200_000) / subs as i64);
            let mut each: Vec<(f64, i64)> = (0..runs).map(|_| fanout(c, subs, n)).collect();
            let shown: Vec<String> = each.iter().map(|(us, _)| format!("{us:.2}")).collect();
            each.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (us, written) = each[each.len() / 2];
            println!("{subs:<16} {us:>22.2} {written:>12}   {}", shown.join(" "));
            record_x_unit("fanout", "subscriptions");
            record(
                "fanout",
                "Fan-out cost per event per subscription",
                "µs",
                "pg_outbox",
                subs as f64,
                us,
            );
            record_ratio(
                &format!("fan-out µs per event per subscription, {subs} subscription(s) (target: at most 2)"),
                us,
                Some(2.0),
            );
        }
        println!("\njobs run by the workers through a one-INSERT SQL handler ({jobs} jobs)\n");
        println!("{:<40} {:>12}", "", "jobs/s");
        let queued = handler_jobs(c, jobs, false);
        println!("{:<40} {:>12.0}", "already queued", queued);
        let fanned = handler_jobs(c, jobs, true);
        println!("{:<40} {:>12.0}", "fan-out and run, end to end", fanned);
        let queue = skip_locked_jobs(cluster, c, jobs);
        println!(
            "{:<40} {:>12.0}",
            "SKIP LOCKED queue (128, 2 clients)", queue
        );
        let title = "Jobs run by the workers through a SQL handler";
        record(
            "handler_jobs",
            title,
            "jobs/s",
            "pg_outbox",
            "already queued",
            queued,
        );
        record(
            "handler_jobs",
            title,
            "jobs/s",
            "pg_outbox",
            "fan-out and run",
            fanned,
        );
        record(
            "handler_jobs",
            title,
            "jobs/s",
            "SKIP LOCKED queue (128, 2 clients)",
            "fan-out and run",
            queue,
        );
        record_ratio(
            "handler jobs per second / 20,000 (target)",
            queued / 20_000.0,
            Some(1.0),
        );
        record_ratio(
            "subscription + SQL handler, end to end / SKIP LOCKED queue (128, 2 clients)",
            fanned / queue,
            Some(0.5),
        );
        // Soak: rounds of churn through the handler. Finished jobs are deleted and autovacuum
        // (set on outbox.jobs to run after 10,000 dead rows) lets the space be reused, so the
        // table's size levels off instead of growing with every job that ever ran.
        let size = |c: &mut Client| -> i64 {
            c.query_one("SELECT pg_total_relation_size('outbox.jobs')", &[])
                .unwrap()
                .get(0)
        };
        let rounds: usize = env_or("BENCH_SOAK_ROUNDS", 6);
        println!(
            "\nsoak: {rounds} rounds of {jobs} jobs fanned out and run; outbox.jobs (table and indexes) after each"
        );
        for round in 1..=rounds {
            handler_jobs(c, jobs, true);
            // Give autovacuum its turn (naptime 5 s), as it would have between bursts.
            std::thread::sleep(Duration::from_secs(6));
            let kb = size(c) / 1024;
            println!(
                "  round {round}: {} jobs ran in all, {kb} kB",
                (round as i64 + 2) * jobs,
            );
            record_x_unit("jobs_size", "jobs run");
            record(
                "jobs_size",
                "outbox.jobs size over a soak (table and indexes)",
                "kB",
                "outbox.jobs",
                ((round as i64 + 2) * jobs) as f64,
                kb as f64,
            );
        }
        println!();
    });
}
