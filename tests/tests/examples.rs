//! The example job workers (examples/python, examples/node; issue #12, item 6): each drains its
//! queue when it starts, then sleeps until a pg_outbox worker's `NOTIFY outbox_jobs, '<queue>'`
//! says the queue has jobs, completes them, and exits 0 after `--exit-after` jobs. Its safety-net
//! poll is 60 s and the test allows 10: only the notification can wake it in time.
//!
//! They need /usr/bin/python3 with psycopg and examples/node/node_modules: scripts/setup.sh
//! installs both.

use pg_outbox_tests::worker_db;
use postgres::Client;
use serde_json::{json, Value};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const QUEUE: &str = "mail";

fn examples() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples"))
}

/// An example's process, killed when dropped: a failing test leaves none running.
struct Example {
    child: Child,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
}

fn read_all(mut from: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = from.read_to_string(&mut s);
        s
    })
}

impl Example {
    fn spawn(program: &str, args: &[String], database_url: &str) -> Example {
        let mut child = Command::new(program)
            .args(args)
            .env("DATABASE_URL", database_url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {program} {args:?}: {e}"));
        let stdout: ChildStdout = child.stdout.take().unwrap();
        let stderr: ChildStderr = child.stderr.take().unwrap();
        Example {
            child,
            stdout: Some(read_all(stdout)),
            stderr: Some(read_all(stderr)),
        }
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("waiting for the example")
    }

    /// Stops it if it still runs; what it printed to stdout and stderr.
    fn output(&mut self) -> (String, String) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let join = |h: Option<JoinHandle<String>>| h.map(|h| h.join().unwrap()).unwrap_or_default();
        (join(self.stdout.take()), join(self.stderr.take()))
    }

    /// Panics with `what` and everything the example printed.
    fn fail(&mut self, what: &str) -> ! {
        let (out, err) = self.output();
        panic!("{what}\n--- its stdout:\n{out}--- its stderr:\n{err}");
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Enqueues three jobs on QUEUE in one committed transaction: their ids and payloads.
fn enqueue_three(c: &mut Client, first: i32) -> Vec<(i64, Value)> {
    let mut tx = c.transaction().unwrap();
    let jobs = (first..first + 3)
        .map(|n| {
            let id: i64 = tx
                .query_one(
                    "SELECT outbox.enqueue($1, jsonb_build_object('n', $2::int4, 'to', 'someone@example.com'))",
                    &[&QUEUE, &n],
                )
                .unwrap()
                .get(0);
            (id, json!({"n": n, "to": "someone@example.com"}))
        })
        .collect();
    tx.commit().unwrap();
    jobs
}

fn jobs_left(c: &mut Client) -> i64 {
    c.query_one(
        "SELECT count(*) FROM outbox.jobs WHERE queue = $1",
        &[&QUEUE],
    )
    .unwrap()
    .get(0)
}

/// Runs `program` with `script` (an example worker) on QUEUE in a database with running workers:
/// it drains the three jobs queued before it started, then the three queued while it sleeps,
/// woken by the workers' notification, and exits 0 having printed the six.
fn the_example_drains_then_wakes_on_the_workers_notify(
    label: &str,
    program: &str,
    script: PathBuf,
) {
    let db = worker_db(label);
    let mut c = db.connect();
    let cluster = db.cluster();
    // A URL both libpq and node-postgres read; application_name finds its session below.
    let url = format!(
        "postgresql://postgres@/{}?host={}&port={}&application_name={label}",
        db.name,
        cluster.socket_dir().display(),
        cluster.port()
    );
    let mut expected = enqueue_three(&mut c, 1);
    let args = [
        script.to_string_lossy().into_owned(),
        QUEUE.to_string(),
        "--exit-after".to_string(),
        "6".to_string(),
        "--poll".to_string(),
        "60".to_string(),
    ];
    let mut example = Example::spawn(program, &args, &url);

    // The three are done, and the example is waiting: its session is idle after a claim (its last
    // statement before it waits; after a job it is complete()).
    let start = Instant::now();
    loop {
        if let Some(status) = example.exited() {
            example.fail(&format!(
                "the example exited ({status}) before its six jobs"
            ));
        }
        // In this order: once all three are completed, a session idle after a claim is idle
        // after the claim that found nothing.
        let drained = jobs_left(&mut c) == 0;
        let waiting: bool = c
            .query_one(
                "SELECT count(*) = 1 FROM pg_stat_activity
                  WHERE datname = current_database() AND application_name = $1 AND state = 'idle'
                    AND query LIKE '%outbox.claim(%'",
                &[&label],
            )
            .unwrap()
            .get(0);
        if drained && waiting {
            break;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let left = jobs_left(&mut c);
            example.fail(&format!(
                "the example did not complete the three jobs queued before it started, and wait, \
                 in 30 s ({left} left)"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    // Three more, committed while it sleeps: only the workers' NOTIFY can wake it within 10 s.
    expected.extend(enqueue_three(&mut c, 4));
    let committed = Instant::now();
    let status = loop {
        if let Some(status) = example.exited() {
            break status;
        }
        if committed.elapsed() > Duration::from_secs(10) {
            let left = jobs_left(&mut c);
            example.fail(&format!(
                "the example did not complete the three jobs queued while it waited within 10 s \
                 ({left} left; its poll is 60 s): did a worker send NOTIFY outbox_jobs, '{QUEUE}'?"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = example.output();
    assert!(
        status.success(),
        "the example exited with {status}\n--- stdout:\n{out}--- stderr:\n{err}"
    );
    let printed: Vec<(String, i64, Value)> = out
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| {
                panic!("not a line of JSON: {line:?}: {e}\n--- stderr:\n{err}")
            });
            (
                v["queue"].as_str().expect("queue").to_string(),
                v["job"].as_i64().expect("job is a number"),
                v["payload"].clone(),
            )
        })
        .collect();
    let expected: Vec<(String, i64, Value)> = expected
        .into_iter()
        .map(|(id, payload)| (QUEUE.to_string(), id, payload))
        .collect();
    assert_eq!(
        printed, expected,
        "the six jobs, in order\n--- stderr:\n{err}"
    );
    assert_eq!(jobs_left(&mut c), 0, "all six completed");
}

#[test]
fn the_python_example_drains_its_queue_then_wakes_on_the_workers_notify() {
    let has_psycopg = Command::new("/usr/bin/python3")
        .args(["-c", "import psycopg"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_psycopg,
        "/usr/bin/python3 cannot import psycopg: run scripts/setup.sh (it installs python3-psycopg)"
    );
    the_example_drains_then_wakes_on_the_workers_notify(
        "examples_py",
        "/usr/bin/python3",
        examples().join("python/worker.py"),
    );
}

#[test]
fn the_node_example_drains_its_queue_then_wakes_on_the_workers_notify() {
    assert!(
        examples().join("node/node_modules/pg").is_dir(),
        "examples/node/node_modules is missing: run scripts/setup.sh (it runs npm ci there)"
    );
    the_example_drains_then_wakes_on_the_workers_notify(
        "examples_node",
        "node",
        examples().join("node/worker.js"),
    );
}
