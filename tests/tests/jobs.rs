//! The job queue for external workers: enqueue, claim with SKIP LOCKED, complete, fail with
//! retries and death, leases that lapse, replay of dead jobs, and refusals.

use pg_outbox_tests::{buffers, eventually, sqlstate, test_db, TestDb};
use postgres::fallible_iterator::FallibleIterator;
use postgres::GenericClient;
use std::collections::HashSet;
use std::time::Duration;

#[test]
fn enqueue_claim_complete_and_keys_queue_once() {
    let db = test_db("jobs_basic");
    let mut c = db.connect();
    let a: i64 = c
        .query_one(
            "SELECT outbox.enqueue('mail', '{\"to\": \"a@example.com\"}')",
            &[],
        )
        .unwrap()
        .get(0);
    let k1: i64 = c
        .query_one(
            "SELECT outbox.enqueue('mail', '{}', key => 'welcome-42')",
            &[],
        )
        .unwrap()
        .get(0);
    let k2: i64 = c
        .query_one(
            "SELECT outbox.enqueue('mail', '{}', key => 'welcome-42')",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(k1, k2, "a key that is already waiting is not queued twice");
    c.batch_execute("SELECT outbox.enqueue('mail', run_at => now() + interval '1 hour')")
        .unwrap();
    let claimed: Vec<i64> = c
        .query("SELECT id FROM outbox.claim('mail', 10, '1 minute')", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(claimed, [a, k1], "due jobs in order; the future one waits");
    assert!(
        c.query("SELECT * FROM outbox.claim('mail', 10)", &[])
            .unwrap()
            .is_empty(),
        "claimed jobs are not claimed again"
    );
    let done: bool = c
        .query_one("SELECT outbox.complete($1)", &[&a])
        .unwrap()
        .get(0);
    assert!(done);
    let again: bool = c
        .query_one("SELECT outbox.complete($1)", &[&a])
        .unwrap()
        .get(0);
    assert!(!again, "a finished job is gone");
    // Once it runs, the key may be queued again.
    let k3: i64 = c
        .query_one(
            "SELECT outbox.enqueue('mail', '{}', key => 'welcome-42')",
            &[],
        )
        .unwrap()
        .get(0);
    assert_ne!(k3, k1);
}

/// Claims with `claim` and completes each job, from four connections at once, until the queue is
/// empty (each round in one transaction when `in_transaction`). Returns every job completed.
fn drain_with_four_workers(db: &TestDb, claim: &'static str, in_transaction: bool) -> Vec<i64> {
    fn take(c: &mut impl GenericClient, claim: &str) -> Vec<i64> {
        let ids: Vec<i64> = c
            .query(claim, &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        for id in &ids {
            let ok: bool = c
                .query_one("SELECT outbox.complete($1)", &[id])
                .unwrap()
                .get(0);
            assert!(ok, "a job this worker claimed completes");
        }
        ids
    }
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let mut c = db.connect();
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                loop {
                    let ids = if in_transaction {
                        let mut tx = c.transaction().unwrap();
                        let ids = take(&mut tx, claim);
                        tx.commit().unwrap();
                        ids
                    } else {
                        take(&mut c, claim)
                    };
                    if ids.is_empty() {
                        return mine;
                    }
                    mine.extend(ids);
                }
            })
        })
        .collect();
    workers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect()
}

#[test]
fn four_workers_claiming_at_once_never_get_the_same_job() {
    let db = test_db("jobs_concurrent");
    let mut c = db.connect();
    c.batch_execute(
        "SELECT outbox.enqueue('work', jsonb_build_object('i', i)) FROM generate_series(1, 2000) i",
    )
    .unwrap();
    let all = drain_with_four_workers(
        &db,
        "SELECT id FROM outbox.claim('work', 7, '1 minute')",
        false,
    );
    let unique: HashSet<i64> = all.iter().copied().collect();
    assert_eq!(all.len(), 2000, "every job done");
    assert_eq!(unique.len(), 2000, "none twice");
    let left: i64 = c
        .query_one("SELECT count(*) FROM outbox.jobs", &[])
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "finished jobs are deleted");
}

#[test]
fn a_lapsed_lease_is_claimed_again_and_extend_keeps_it() {
    let db = test_db("jobs_lease");
    let mut c = db.connect();
    let a: i64 = c
        .query_one("SELECT outbox.enqueue('q')", &[])
        .unwrap()
        .get(0);
    let b: i64 = c
        .query_one("SELECT outbox.enqueue('q')", &[])
        .unwrap()
        .get(0);
    c.batch_execute("SELECT * FROM outbox.claim('q', 2, '300 milliseconds')")
        .unwrap();
    // b's worker is alive and extends; a's worker died.
    let extended: bool = c
        .query_one("SELECT outbox.extend($1, '1 minute')", &[&b])
        .unwrap()
        .get(0);
    assert!(extended);
    let reclaimed = eventually("a's lease to lapse", Duration::from_secs(10), || {
        let r = c
            .query(
                "SELECT id, attempts FROM outbox.claim('q', 5, '1 minute')",
                &[],
            )
            .unwrap();
        (!r.is_empty()).then(|| {
            r.iter()
                .map(|r| (r.get::<_, i64>(0), r.get::<_, i32>(1)))
                .collect::<Vec<_>>()
        })
    });
    assert_eq!(
        reclaimed,
        [(a, 2)],
        "only the lapsed one, on its second attempt"
    );
}

/// The claim index holds waiting jobs only: a claim goes straight to them past any number of jobs
/// other workers are running, and takes a job whose lease lapsed before waiting ones, even one due
/// earlier.
#[test]
fn a_claim_steps_over_no_running_job_and_takes_lapsed_leases_first() {
    let db = test_db("jobs_claim_index");
    let mut c = db.connect();
    let ids = |c: &mut postgres::Client, sql: &str| -> Vec<i64> {
        c.query(sql, &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let lapsing = ids(
        &mut c,
        "SELECT outbox.enqueue('q', run_at => now() - interval '2 hours')",
    )[0];
    let claimed = ids(&mut c, "SELECT id FROM outbox.claim('q', 1, '1 hour')");
    assert_eq!(claimed, [lapsing]);
    // 3,000 jobs running under a long lease, each of 1.3 kB (six to a page: reading them reads
    // 500 pages).
    c.batch_execute(
        "SELECT outbox.enqueue('q', jsonb_build_object('pad', repeat(md5(i::text), 40)))
           FROM generate_series(1, 3000) i",
    )
    .unwrap();
    for _ in 0..3 {
        let n = ids(&mut c, "SELECT id FROM outbox.claim('q', 1000, '1 hour')").len();
        assert_eq!(n, 1000);
    }
    // Waiting: one due before the lapsing job was, two behind the running ones.
    let early = ids(
        &mut c,
        "SELECT outbox.enqueue('q', run_at => now() - interval '3 hours')",
    )[0];
    let behind = ids(
        &mut c,
        "SELECT outbox.enqueue('q') FROM generate_series(1, 2)",
    );
    // Its lease lapses now, not after a short lease: a lease short enough to lapse in the test
    // lapsed during the setup on a slow build, and one of the claims above took the job.
    c.execute(
        "UPDATE outbox.jobs SET lease_until = now() - interval '1 second' WHERE id = $1",
        &[&lapsing],
    )
    .unwrap();
    let first: Vec<(i64, i32)> = c
        .query(
            "SELECT id, attempts FROM outbox.claim('q', 1, '1 hour')",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        first,
        [(lapsing, 2)],
        "the lapsed lease before a waiting job due earlier"
    );
    let next = ids(&mut c, "SELECT id FROM outbox.claim('q', 2, '1 hour')");
    assert_eq!(
        next,
        [early, behind[0]],
        "then waiting jobs in run_at order"
    );
    // With 3,002 jobs running ahead of it in run_at order (and no dead index entries: vacuumed),
    // claiming the last waiting job reads a handful of pages, not the running jobs' rows (a
    // claim index that held running jobs too made every claim read them all: over 500 buffers).
    c.batch_execute("VACUUM outbox.jobs").unwrap();
    let read = buffers(&mut c, "SELECT * FROM outbox.claim('q', 1, '1 hour')");
    assert!(read < 300, "claiming one job touched {read} buffers");
    let waiting = ids(&mut c, "SELECT id FROM outbox.jobs WHERE state = 'waiting'");
    assert!(waiting.is_empty(), "the last claim took {:?}", behind[1]);
    let running: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.jobs WHERE state = 'running'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(running, 3004);
}

#[test]
fn failures_retry_with_back_off_then_die_and_replay() {
    let db = test_db("jobs_fail");
    let mut c = db.connect();
    let j: i64 = c
        .query_one("SELECT outbox.enqueue('q', max_attempts => 2)", &[])
        .unwrap()
        .get(0);
    c.batch_execute("SELECT * FROM outbox.claim('q')").unwrap();
    let s: String = c
        .query_one("SELECT outbox.fail($1, 'smtp timeout')", &[&j])
        .unwrap()
        .get(0);
    assert_eq!(s, "waiting");
    let delay: f64 = c
        .query_one(
            "SELECT extract(epoch FROM run_at - now())::float8 FROM outbox.jobs WHERE id = $1",
            &[&j],
        )
        .unwrap()
        .get(0);
    assert!(
        (0.5..=1.5).contains(&delay),
        "first retry after about 1 s, not {delay}"
    );
    assert!(
        c.query("SELECT * FROM outbox.claim('q')", &[])
            .unwrap()
            .is_empty(),
        "not before its time"
    );
    eventually("the retry to be due", Duration::from_secs(5), || {
        (!c.query("SELECT * FROM outbox.claim('q')", &[])
            .unwrap()
            .is_empty())
        .then_some(())
    });
    let s: String = c
        .query_one("SELECT outbox.fail($1, 'smtp timeout again')", &[&j])
        .unwrap()
        .get(0);
    assert_eq!(s, "dead", "out of attempts");
    let dead: (i64, String, bool) = c
        .query_one(
            "SELECT id, last_error, dead_at BETWEEN now() - interval '10 seconds' AND clock_timestamp() \
               FROM outbox.dead_jobs",
            &[],
        )
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .unwrap();
    assert_eq!(
        dead,
        (j, "smtp timeout again".to_string(), true),
        "when it died, and why"
    );
    assert!(
        c.query("SELECT * FROM outbox.claim('q')", &[])
            .unwrap()
            .is_empty(),
        "dead jobs are never claimed"
    );
    // A failure that cannot pass on retry dies at once.
    let k: i64 = c
        .query_one("SELECT outbox.enqueue('q2')", &[])
        .unwrap()
        .get(0);
    c.batch_execute("SELECT * FROM outbox.claim('q2')").unwrap();
    let s: String = c
        .query_one(
            "SELECT outbox.fail($1, 'bad address', retry => false)",
            &[&k],
        )
        .unwrap()
        .get(0);
    assert_eq!(s, "dead");
    // Replay: attempts reset, claimable again, logged with its queue and attempts; a job that is
    // not dead is refused.
    c.execute("SELECT outbox.replay_job($1)", &[&j]).unwrap();
    let line = format!("job {j} of queue \"q\" replayed by role postgres after 2 attempts");
    eventually("the replay's log line", Duration::from_secs(5), || {
        db.cluster().log().contains(&line).then_some(())
    });
    let r = c
        .query_one("SELECT id, attempts FROM outbox.claim('q')", &[])
        .unwrap();
    assert_eq!((r.get::<_, i64>(0), r.get::<_, i32>(1)), (j, 1));
    assert_eq!(
        sqlstate(&mut c, &format!("SELECT outbox.replay_job({j})")),
        "55000"
    );
    assert_eq!(
        sqlstate(&mut c, "SELECT outbox.replay_job(999999)"),
        "42704"
    );
}

#[test]
fn job_functions_refuse_bad_input() {
    let db = test_db("jobs_refusals");
    let mut c = db.connect();
    for (sql, code) in [
        ("SELECT outbox.enqueue(NULL)", "22004"),
        ("SELECT outbox.enqueue('')", "42602"),
        ("SELECT outbox.enqueue('bad queue')", "42602"),
        (
            "SELECT outbox.enqueue('q''; drop table outbox.jobs; --')",
            "42602",
        ),
        ("SELECT outbox.enqueue('q', '[1]')", "22023"),
        ("SELECT outbox.enqueue('q', key => '')", "22023"),
        ("SELECT outbox.enqueue('q', max_attempts => 0)", "22023"),
        ("SELECT * FROM outbox.claim('q', 0)", "22023"),
        ("SELECT * FROM outbox.claim('q', 1001)", "22023"),
        ("SELECT * FROM outbox.claim('q', 1, '-1 second')", "22023"),
        ("SELECT * FROM outbox.claim('q', 1, '2 days')", "22023"),
        ("SELECT * FROM outbox.claim(NULL)", "22004"),
        ("SELECT outbox.complete(NULL)", "22004"),
        ("SELECT outbox.fail(12345, 'x')", "55000"),
        ("SELECT outbox.fail(NULL, 'x')", "22004"),
        ("SELECT outbox.extend(1, '2 days')", "22023"),
        ("SELECT outbox.replay_job(NULL)", "22004"),
    ] {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
    let n: i64 = c
        .query_one("SELECT count(*) FROM outbox.jobs", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
}

#[test]
fn without_a_lease_jobs_are_held_by_the_claiming_transaction() {
    let db = test_db("jobs_in_transaction");
    let mut c = db.connect();
    c.batch_execute(
        "SELECT outbox.enqueue('tx', jsonb_build_object('i', i)) FROM generate_series(1, 1000) i",
    )
    .unwrap();
    // Four workers, each claiming and completing in one transaction: every job once.
    let all = drain_with_four_workers(
        &db,
        "SELECT id FROM outbox.claim('tx', 5, lease => NULL)",
        true,
    );
    let unique: HashSet<i64> = all.iter().copied().collect();
    assert_eq!((all.len(), unique.len()), (1000, 1000), "every job once");

    // Held, not leased: nothing is written, another transaction skips it, and a rollback (or a
    // dead connection) frees it at once.
    let id: i64 = c
        .query_one("SELECT outbox.enqueue('tx', '{}')", &[])
        .unwrap()
        .get(0);
    let mut a = db.connect();
    let mut b = db.connect();
    a.batch_execute("BEGIN").unwrap();
    let held: Vec<(i64, i32)> = a
        .query(
            "SELECT id, attempts FROM outbox.claim('tx', 10, lease => NULL)",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(held, [(id, 1)], "the attempt it would be");
    assert!(b
        .query("SELECT id FROM outbox.claim('tx', 10, lease => NULL)", &[])
        .unwrap()
        .is_empty());
    let theirs: bool = b
        .query_one("SELECT outbox.complete($1)", &[&id])
        .unwrap()
        .get(0);
    assert!(
        !theirs,
        "another transaction's job is not completed (nor waited for)"
    );
    assert_eq!(
        sqlstate(&mut b, &format!("SELECT outbox.fail({id}, 'x')")),
        "55000"
    );
    a.batch_execute("ROLLBACK").unwrap();
    let row = b
        .query_one(
            "SELECT state, attempts FROM outbox.jobs WHERE id = $1",
            &[&id],
        )
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, i32>(1)),
        ("waiting".into(), 0)
    );
    let unclaimed: bool = b
        .query_one("SELECT outbox.complete($1)", &[&id])
        .unwrap()
        .get(0);
    assert!(!unclaimed, "a job nobody claimed is not completed");
    // Failing a held job counts the attempt and backs off.
    a.batch_execute(&format!(
        "BEGIN; SELECT * FROM outbox.claim('tx', 1, lease => NULL);
         SELECT outbox.fail({id}, 'boom'); COMMIT;"
    ))
    .unwrap();
    let row = b
        .query_one(
            "SELECT state, attempts, last_error, run_at > now() FROM outbox.jobs WHERE id = $1",
            &[&id],
        )
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "waiting");
    assert_eq!(row.get::<_, i32>(1), 1);
    assert_eq!(row.get::<_, String>(2), "boom");
    assert!(row.get::<_, bool>(3), "backing off");
}

#[test]
fn complete_many_finishes_the_jobs_this_worker_holds_and_no_others() {
    let db = test_db("jobs_complete_many");
    let mut c = db.connect();
    c.batch_execute(
        "SELECT outbox.enqueue('m', jsonb_build_object('i', i)) FROM generate_series(1, 6) i",
    )
    .unwrap();
    let leased: Vec<i64> = c
        .query("SELECT id FROM outbox.claim('m', 2, '1 minute')", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut other = db.connect();
    other.batch_execute("BEGIN").unwrap();
    let theirs: Vec<i64> = other
        .query("SELECT id FROM outbox.claim('m', 2, lease => NULL)", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let all: Vec<i64> = c
        .query("SELECT id FROM outbox.jobs ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // Everything: two leased (done), two held by the other transaction and two nobody claimed
    // (left alone).
    let done: i32 = c
        .query_one("SELECT outbox.complete_many($1)", &[&all])
        .unwrap()
        .get(0);
    assert_eq!(done, 2);
    let mine: i32 = other
        .query_one("SELECT outbox.complete_many($1)", &[&theirs])
        .unwrap()
        .get(0);
    assert_eq!(mine, 2);
    other.batch_execute("COMMIT").unwrap();
    let left: Vec<i64> = c
        .query("SELECT id FROM outbox.jobs ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let expect: Vec<i64> = all
        .into_iter()
        .filter(|id| !leased.contains(id) && !theirs.contains(id))
        .collect();
    assert_eq!(left, expect);
    assert_eq!(
        sqlstate(&mut c, "SELECT outbox.complete_many(NULL)"),
        "22004"
    );
}

#[test]
fn a_hostile_search_path_changes_nothing_claim_and_complete_do() {
    let db = test_db("jobs_search_path");
    let mut c = db.connect();
    // claim and complete do not pin search_path (see jobs.sql); every name in them is qualified.
    // A caller who puts look-alike operators and functions first must get the same answers.
    c.batch_execute(
        "CREATE SCHEMA evil;
         CREATE FUNCTION evil.eq(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT true';
         CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.eq);
         CREATE FUNCTION evil.le(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql AS 'SELECT true';
         CREATE OPERATOR evil.<= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = evil.le);
         CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE sql AS $$SELECT 'infinity'::timestamptz$$;
         SELECT outbox.enqueue('mine', '{}');
         SELECT outbox.enqueue('other', '{}');
         SELECT outbox.enqueue('mine', '{}', run_at => now() + interval '1 hour');
         SET search_path = evil, pg_catalog, public;",
    )
    .unwrap();
    for lease in ["'1 minute'", "NULL"] {
        let mut tx = c.transaction().unwrap();
        let queues: Vec<String> = tx
            .query(
                &format!("SELECT queue FROM outbox.claim('mine', 10, {lease})"),
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(
            queues,
            ["mine"],
            "only the due job of this queue (lease {lease})"
        );
        tx.rollback().unwrap();
    }
    let other: i64 = c
        .query_one(
            "SELECT id FROM outbox.jobs WHERE queue OPERATOR(pg_catalog.=) 'other'",
            &[],
        )
        .unwrap()
        .get(0);
    let done: bool = c
        .query_one("SELECT outbox.complete($1)", &[&other])
        .unwrap()
        .get(0);
    assert!(!done, "a job nobody claimed is not completed");
    let done: i32 = c
        .query_one("SELECT outbox.complete_many(ARRAY[$1::int8])", &[&other])
        .unwrap()
        .get(0);
    assert_eq!(done, 0);
}

/// The notifications `c` (which LISTENs on outbox_jobs) receives within `wait`: (sender's pid,
/// queue).
fn notified(c: &mut postgres::Client, wait: Duration) -> Vec<(i32, String)> {
    let deadline = std::time::Instant::now() + wait;
    let mut got = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return got;
        }
        let mut notes = c.notifications();
        let mut it = notes.timeout_iter(left);
        match it.next() {
            Ok(Some(n)) => {
                assert_eq!(n.channel(), "outbox_jobs");
                got.push((n.process_id(), n.payload().to_string()));
            }
            Ok(None) => return got,
            Err(e) => panic!("waiting for notifications: {e}"),
        }
    }
}

/// Waits for the first notification of `queue`, and returns how long it took.
fn first_notice(c: &mut postgres::Client, queue: &str, within: Duration) -> Duration {
    let start = std::time::Instant::now();
    loop {
        let left = within.saturating_sub(start.elapsed());
        assert!(
            !left.is_zero(),
            "no notification for queue {queue} within {within:?}"
        );
        let mut notes = c.notifications();
        let mut it = notes.timeout_iter(left);
        if let Ok(Some(n)) = it.next() {
            if n.payload() == queue {
                return start.elapsed();
            }
        }
    }
}

#[test]
fn the_workers_notify_once_per_queue_with_new_or_due_jobs_never_the_application() {
    let db = pg_outbox_tests::worker_db("jobs_notify");
    let mut listener = db.connect();
    listener.batch_execute("LISTEN outbox_jobs").unwrap();
    let mut app = db.connect();
    let app_pid: i32 = app
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    // Three jobs in one queue and one in another, committed together: one notification each,
    // from a worker, once the transaction committed.
    let mut tx = app.transaction().unwrap();
    tx.batch_execute(
        "SELECT outbox.enqueue('mail', '{\"n\": 1}'); SELECT outbox.enqueue('mail', '{\"n\": 2}');
         SELECT outbox.enqueue('mail', '{\"n\": 3}'); SELECT outbox.enqueue('sms');",
    )
    .unwrap();
    assert_eq!(notified(&mut listener, Duration::from_millis(700)), []);
    tx.commit().unwrap();
    let got = notified(&mut listener, Duration::from_secs(2));
    let mut queues: Vec<&str> = got.iter().map(|(_, q)| q.as_str()).collect();
    queues.sort();
    assert_eq!(queues, ["mail", "sms"], "{got:?}");
    let workers = db.cluster().worker_pids();
    for (pid, _) in &got {
        assert!(
            workers.contains(pid) && *pid != app_pid,
            "sent by a worker ({workers:?}), not the application ({app_pid}): {pid}"
        );
    }
    // A rollback announces nothing.
    let mut tx = app.transaction().unwrap();
    tx.batch_execute("SELECT outbox.enqueue('mail')").unwrap();
    tx.rollback().unwrap();
    assert_eq!(notified(&mut listener, Duration::from_secs(1)), []);
    // Nothing is announced twice: a job due when it was written is announced at its commit, and
    // the workers' look for jobs coming due (at least every 10 s, now that they run) passes over
    // it.
    app.batch_execute("SELECT outbox.enqueue('mail')").unwrap();
    assert_eq!(
        notified(&mut listener, Duration::from_secs(11))
            .iter()
            .map(|(_, q)| q.as_str())
            .collect::<Vec<_>>(),
        ["mail"]
    );
    // A delayed job: nothing at commit, a notification when it comes due.
    app.batch_execute("SELECT outbox.enqueue('later', run_at => now() + interval '2 seconds')")
        .unwrap();
    let took = first_notice(&mut listener, "later", Duration::from_secs(6));
    assert!(
        took >= Duration::from_millis(1500),
        "notified {took:?} after the commit, before the job was due"
    );
    // A replayed dead job.
    let dead: i64 = app
        .query_one("SELECT outbox.enqueue('retry', max_attempts => 1)", &[])
        .unwrap()
        .get(0);
    first_notice(&mut listener, "retry", Duration::from_secs(3));
    app.batch_execute(&format!(
        "SELECT id FROM outbox.claim('retry'); SELECT outbox.fail({dead}, 'no', retry => false);"
    ))
    .unwrap();
    app.batch_execute(&format!("SELECT outbox.replay_job({dead})"))
        .unwrap();
    first_notice(&mut listener, "retry", Duration::from_secs(3));
    // A subscription without a handler, and a schedule: the workers' own transactions.
    app.batch_execute(
        "SELECT outbox.subscribe('fan', '{order.*}', queue => 'fanned');
         SELECT outbox.raise('order.placed', '{}');",
    )
    .unwrap();
    first_notice(&mut listener, "fanned", Duration::from_secs(5));
    app.batch_execute("SELECT outbox.schedule('tick', every => '1 second', queue => 'ticks')")
        .unwrap();
    first_notice(&mut listener, "ticks", Duration::from_secs(5));
    app.batch_execute("SELECT outbox.unschedule('tick')")
        .unwrap();
    // A lease that lapses: the job can be claimed again (within the workers' 10 s look).
    app.batch_execute("SELECT outbox.enqueue('leased'); ")
        .unwrap();
    first_notice(&mut listener, "leased", Duration::from_secs(3));
    app.batch_execute("SELECT id FROM outbox.claim('leased', 1, '1 second')")
        .unwrap();
    let took = first_notice(&mut listener, "leased", Duration::from_secs(15));
    assert!(took >= Duration::from_millis(900), "{took:?}");
    // A retry that comes due before its failing transaction commits (a claim without a lease,
    // held past the 1 s back-off): announced when that transaction commits, not at the next look
    // for due jobs (which could not see it, and goes by when jobs came due).
    app.batch_execute("SELECT outbox.enqueue('slow')").unwrap();
    first_notice(&mut listener, "slow", Duration::from_secs(3));
    let mut tx = app.transaction().unwrap();
    tx.batch_execute("SELECT outbox.fail(id, 'slow work') FROM outbox.claim('slow')")
        .unwrap();
    std::thread::sleep(Duration::from_millis(1300));
    tx.commit().unwrap();
    let took = first_notice(&mut listener, "slow", Duration::from_secs(9));
    assert!(
        took < Duration::from_millis(800),
        "announced {took:?} after the commit"
    );
}

#[test]
fn jobs_nobody_claims_in_time_expire() {
    let db = pg_outbox_tests::worker_db("jobs_expire");
    let mut c = db.connect();
    let other = format!("exp_other_{}", db.name);
    c.batch_execute(&format!(
        "CREATE ROLE {other} LOGIN; GRANT USAGE ON SCHEMA outbox TO {other};
         GRANT EXECUTE ON FUNCTION outbox.alter_queue(text, interval) TO {other};"
    ))
    .unwrap();
    for (sql, code) in [
        (
            "SELECT outbox.create_queue('e1', expire_after => '0 seconds')",
            "22023",
        ),
        (
            "SELECT outbox.create_queue('e1', expire_after => '-1 minute')",
            "22023",
        ),
        (
            "SELECT outbox.create_queue('e1', expire_after => '1 month')",
            "22023",
        ),
        (
            "SELECT outbox.create_queue('e1', expire_after => '3651 days')",
            "22023",
        ),
        ("SELECT outbox.alter_queue('nope', '1 minute')", "42704"),
        ("SELECT outbox.alter_queue(NULL, '1 minute')", "22004"),
    ] {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
    c.batch_execute(
        "SELECT outbox.create_queue('short', expire_after => '1 second');
         SELECT outbox.create_queue('long');",
    )
    .unwrap();
    let mut o = db.connect_as(&other);
    assert_eq!(
        sqlstate(&mut o, "SELECT outbox.alter_queue('short', NULL)"),
        "42501"
    );
    let ids: Vec<i64> = c
        .query(
            "SELECT outbox.enqueue('short', '{\"n\": 1}') UNION ALL SELECT outbox.enqueue('short', '{\"n\": 2}')
             UNION ALL SELECT outbox.enqueue('long')",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // One is claimed in time (and failed back for a retry): claimed once, it never expires.
    let claimed: i64 = c
        .query_one("SELECT id FROM outbox.claim('short', 1, '1 minute')", &[])
        .unwrap()
        .get(0);
    c.batch_execute(&format!("SELECT outbox.fail({claimed}, 'later')"))
        .unwrap();
    let expired = if claimed == ids[0] { ids[1] } else { ids[0] };
    eventually(
        "the unclaimed job to expire",
        Duration::from_secs(8),
        || {
            let r = c
                .query_one(
                    "SELECT last_error, dead_at IS NOT NULL FROM outbox.dead_jobs WHERE id = $1",
                    &[&expired],
                )
                .ok()?;
            Some((r.get::<_, String>(0), r.get::<_, bool>(1)))
        },
    );
    let states: Vec<(i64, String)> = c
        .query("SELECT id, state FROM outbox.jobs ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let state = |id: i64| states.iter().find(|(i, _)| *i == id).unwrap().1.clone();
    assert_eq!(state(expired), "dead");
    assert_eq!(
        state(claimed),
        "waiting",
        "claimed once: it does not expire"
    );
    assert_eq!(
        state(ids[2]),
        "waiting",
        "a queue without expire_after keeps its jobs"
    );
    let error: String = c
        .query_one(
            "SELECT last_error FROM outbox.dead_jobs WHERE id = $1",
            &[&expired],
        )
        .unwrap()
        .get(0);
    assert_eq!(error, "expired: nobody claimed it within 00:00:01");
    // Unset: new jobs wait.
    c.batch_execute("SELECT outbox.alter_queue('short', NULL)")
        .unwrap();
    let kept: i64 = c
        .query_one("SELECT outbox.enqueue('short')", &[])
        .unwrap()
        .get(0);
    std::thread::sleep(Duration::from_millis(2500));
    let state: String = c
        .query_one("SELECT state FROM outbox.jobs WHERE id = $1", &[&kept])
        .unwrap()
        .get(0);
    assert_eq!(state, "waiting");
}

/// What a worker's look at the queues tells it: the time to the next job to come due or to
/// expire, and nothing when none will (then it waits its longest, instead of looking again at
/// once: `greatest(0, NULL)` is 0, which it was).
#[test]
fn the_workers_look_again_when_the_next_job_comes_due_or_expires() {
    let db = test_db("jobs_due_in");
    let mut c = db.connect();
    let due_in = |c: &mut postgres::Client| -> Option<i64> {
        c.query_one(
            "SELECT due_in FROM outbox._announce_jobs(NULL, now(), NULL, false)",
            &[],
        )
        .unwrap()
        .get(0)
    };
    c.batch_execute("SELECT outbox.create_queue('later')")
        .unwrap();
    assert_eq!(due_in(&mut c), None, "no queue has a job to come");
    c.batch_execute("SELECT outbox.enqueue('later', run_at => now() + interval '30 seconds')")
        .unwrap();
    let ms = due_in(&mut c).expect("a job comes due");
    assert!((25_000..=30_000).contains(&ms), "{ms}");
    // A job due now is no job to come; one that will expire is.
    c.batch_execute(
        "SELECT outbox.create_queue('expiring', expire_after => '20 seconds');
         SELECT outbox.enqueue('expiring');",
    )
    .unwrap();
    let ms = due_in(&mut c).expect("a job expires");
    assert!((15_000..=20_000).contains(&ms), "{ms}");
    c.batch_execute("DELETE FROM outbox.jobs").unwrap();
    assert_eq!(due_in(&mut c), None, "every job gone");
}

/// A delayed job committed beside one due now, in its queue: the one due now is announced at the
/// commit, the delayed one when it comes due (the first worker is told to look then), not at the
/// workers' next periodic look, up to 10 s later.
#[test]
fn a_delayed_job_is_announced_when_it_comes_due_even_beside_one_due_now() {
    let db = pg_outbox_tests::worker_db("jobs_due_beside");
    let mut listener = db.connect();
    listener.batch_execute("LISTEN outbox_jobs").unwrap();
    let mut app = db.connect();
    app.batch_execute("SELECT outbox.create_queue('q')")
        .unwrap();
    // The workers' first look (every queue) is behind us.
    std::thread::sleep(Duration::from_millis(1500));
    notified(&mut listener, Duration::from_millis(100));
    for round in 0..2 {
        let mut tx = app.transaction().unwrap();
        tx.batch_execute(
            "SELECT outbox.enqueue('q');
             SELECT outbox.enqueue('q', run_at => now() + interval '2 seconds');",
        )
        .unwrap();
        tx.commit().unwrap();
        let at_commit = first_notice(&mut listener, "q", Duration::from_secs(2));
        assert!(at_commit < Duration::from_secs(1), "{at_commit:?}");
        let delayed = first_notice(&mut listener, "q", Duration::from_secs(6));
        assert!(
            (Duration::from_millis(900)..Duration::from_millis(3500)).contains(&delayed),
            "round {round}: the delayed job was announced {delayed:?} after the one due at once"
        );
    }
}
