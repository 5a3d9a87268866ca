//! A throwaway PostgreSQL 15 cluster with pg_outbox preloaded, for client-side tests.
//!
//! Each test binary starts one cluster on first use (a unix socket under /tmp, no TCP) and stops
//! and deletes it when the process exits. The extension must be installed in the system
//! PostgreSQL first (`scripts/test.sh` does it). Tests take a fresh database each, and hold a
//! lock while they run: the read horizon is cluster-wide, so a test that holds a transaction open
//! would stall another test's reader.
//!
//! Nothing here sleeps a fixed time to wait for the server: `eventually` polls with a deadline.

pub mod http_server;
pub mod kafka;

use postgres::{Client, NoTls};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub use postgres;

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

pub struct Cluster {
    dir: PathBuf,
    port: u16,
    /// The PostgreSQL binaries that run it (the system's, or a private tree's).
    bin: PathBuf,
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();
static SERIAL: Mutex<()> = Mutex::new(());
static DB_COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Runs the PostgreSQL binary `bin` of `dir`, as `postgres` when we are root (the server refuses
/// root).
fn pg_command_in(dir: &Path, bin: &str) -> Command {
    let path = format!("{}/{bin}", dir.display());
    let mut c = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", &path]);
        c
    } else {
        Command::new(path)
    };
    // A server started from a shell that sets RUST_BACKTRACE would add a Rust backtrace to the
    // DETAIL of errors raised through SPI: not what a server normally says, nor deterministic.
    c.env_remove("RUST_BACKTRACE");
    c
}

fn run(mut cmd: Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

extern "C" fn stop_cluster_at_exit() {
    if let Some(c) = CLUSTER.get() {
        c.stop();
    }
}

impl Cluster {
    /// The test cluster: fsync off (tests measure behaviour, not durability cost), short back-off.
    fn start() -> Cluster {
        // SAFETY: registering a plain extern "C" fn; it only reads the OnceLock.
        unsafe { libc::atexit(stop_cluster_at_exit) };
        Cluster::start_with(
            "pg_outbox_it",
            &[
                "fsync = off",
                "max_prepared_transactions = 4",
                // Tests take a database each; only the one a test asks for (worker_db) gets
                // workers, as if it were the cluster's only database with pg_outbox.
                "pg_outbox.databases = 'postgres'",
                "pg_outbox.max_backoff = '1s'",
            ],
        )
    }

    /// A throwaway cluster under /tmp/<name>.<pid> with pg_outbox preloaded and `settings` added
    /// to postgresql.conf. Stop it with `stop` (tests' shared cluster stops at process exit).
    pub fn start_with(name: &str, settings: &[&str]) -> Cluster {
        Cluster::start_with_bin(Path::new(PG_BIN), name, settings)
    }

    /// `start_with`, running the PostgreSQL binaries in `bin` (a private installation tree: its
    /// lib and share directories are found next to it, as PostgreSQL finds them).
    pub fn start_with_bin(bin: &Path, name: &str, settings: &[&str]) -> Cluster {
        let dir = PathBuf::from(format!("/tmp/{name}.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the cluster directory");
        if is_root() {
            run(
                {
                    let mut c = Command::new("chown");
                    c.args(["postgres:postgres", dir.to_str().unwrap()]);
                    c
                },
                "chown",
            );
        }
        let data = dir.join("data");
        let mut initdb = pg_command_in(bin, "initdb");
        initdb.args([
            "-D",
            data.to_str().unwrap(),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--locale=C.UTF-8",
            "-E",
            "UTF8",
        ]);
        run(initdb, "initdb");
        let port = 40000 + (std::process::id() % 20000) as u16;
        let mut conf = format!(
            "listen_addresses = ''\nunix_socket_directories = '{}'\nport = {port}\n\
             shared_preload_libraries = 'pg_outbox'\nlog_min_messages = warning\n",
            dir.display()
        );
        for line in settings {
            conf.push_str(line);
            conf.push('\n');
        }
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, conf.as_bytes()))
            .expect("writing postgresql.conf");
        let mut start = pg_command_in(bin, "pg_ctl");
        start.args([
            "-D",
            data.to_str().unwrap(),
            "-l",
            dir.join("log").to_str().unwrap(),
            "-w",
            "-t",
            "60",
            "start",
        ]);
        run(start, "pg_ctl start");
        Cluster {
            dir,
            port,
            bin: bin.to_path_buf(),
        }
    }

    /// Stops the server and deletes its directory.
    pub fn stop(&self) {
        let mut stop = pg_command_in(&self.bin, "pg_ctl");
        stop.args([
            "-D",
            self.dir.join("data").to_str().unwrap(),
            "-m",
            "immediate",
            "-w",
            "stop",
        ]);
        let _ = stop.output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    pub fn socket_dir(&self) -> &Path {
        &self.dir
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    fn data_dir(&self) -> String {
        self.dir.join("data").to_string_lossy().into_owned()
    }

    /// `pg_ctl restart -m immediate`: the server stops without a checkpoint, as in a crash.
    pub fn restart_immediate(&self) {
        self.restart("immediate");
    }

    /// Stops the server (`pg_ctl stop -m <mode>`) and starts it again.
    pub fn restart(&self, mode: &str) {
        let mut stop = pg_command_in(&self.bin, "pg_ctl");
        stop.args(["-D", &self.data_dir(), "-m", mode, "-w", "stop"]);
        run(stop, "pg_ctl stop");
        let mut start = pg_command_in(&self.bin, "pg_ctl");
        start.args([
            "-D",
            &self.data_dir(),
            "-l",
            self.dir.join("log").to_str().unwrap(),
            "-w",
            "-t",
            "60",
            "start",
        ]);
        run(start, "pg_ctl start");
    }

    /// Sets a configuration parameter with ALTER SYSTEM and reloads.
    pub fn set(&self, name: &str, value: &str) {
        let mut c = self.connect("postgres", "postgres");
        for sql in [
            format!("ALTER SYSTEM SET {name} = '{value}'"),
            "SELECT pg_reload_conf()".to_string(),
        ] {
            c.batch_execute(&sql)
                .unwrap_or_else(|e| panic!("{sql}: {}", db_message(&e)));
        }
        // The reload is asynchronous. Once a new backend sees the value, the postmaster has
        // reloaded and signalled every existing backend, which rereads before its next command.
        eventually(
            &format!("{name} = '{value}' to take effect"),
            Duration::from_secs(10),
            || {
                let shown: Option<String> = self
                    .connect("postgres", "postgres")
                    .query_one("SELECT current_setting($1, true)", &[&name])
                    .unwrap()
                    .get(0);
                (shown.as_deref() == Some(value)).then_some(())
            },
        );
    }

    /// Waits until `pg_outbox.min_workers` workers are connected to `db`, and none to another
    /// database (they leave when `pg_outbox.databases` no longer names theirs).
    pub fn wait_for_workers(&self, db: &str) {
        let mut c = self.connect("postgres", "postgres");
        eventually(
            &format!("pg_outbox workers in database {db}"),
            Duration::from_secs(30),
            || {
                let row = c
                .query_one(
                    "SELECT count(*) FILTER (WHERE datname = $1) >= current_setting('pg_outbox.min_workers')::int8 \
                            AND count(*) FILTER (WHERE datname IS DISTINCT FROM $1) = 0 \
                       FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker'",
                    &[&db],
                )
                .unwrap();
                row.get::<_, bool>(0).then_some(())
            },
        );
    }

    /// The pids of the running pg_outbox workers.
    pub fn worker_pids(&self) -> Vec<i32> {
        let mut c = self.connect("postgres", "postgres");
        c.query(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
    }

    pub fn connect(&self, db: &str, user: &str) -> Client {
        postgres::Config::new()
            .host_path(&self.dir)
            .port(self.port)
            .user(user)
            .dbname(db)
            .application_name("pg_outbox_tests")
            .connect(NoTls)
            .unwrap_or_else(|e| panic!("connecting to {db} as {user}: {e}"))
    }
}

/// One test's database, with pg_outbox created in it. Holds the test lock while alive.
pub struct TestDb {
    pub name: String,
    cluster: &'static Cluster,
    _serial: MutexGuard<'static, ()>,
}

impl TestDb {
    /// A superuser connection.
    pub fn connect(&self) -> Client {
        self.cluster.connect(&self.name, "postgres")
    }

    /// A connection as another role (created by the test).
    pub fn connect_as(&self, role: &str) -> Client {
        self.cluster.connect(&self.name, role)
    }

    pub fn cluster(&self) -> &'static Cluster {
        self.cluster
    }
}

/// A fresh database with `CREATE EXTENSION pg_outbox`, on this binary's cluster.
pub fn test_db(label: &str) -> TestDb {
    let serial = SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let cluster = CLUSTER.get_or_init(Cluster::start);
    let n = DB_COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let name = format!("t{n}_{label}");
    let mut admin = cluster.connect("postgres", "postgres");
    admin
        .batch_execute(&format!("CREATE DATABASE \"{name}\""))
        .expect("CREATE DATABASE");
    let mut c = cluster.connect(&name, "postgres");
    c.batch_execute("CREATE EXTENSION pg_outbox")
        .unwrap_or_else(|e| panic!("CREATE EXTENSION: {e}\n{}", cluster.log()));
    TestDb {
        name,
        cluster,
        _serial: serial,
    }
}

/// A fresh database with pg_outbox whose workers deliver in it (pg_outbox.databases names it).
pub fn worker_db(label: &str) -> TestDb {
    let db = test_db(label);
    db.cluster.set("pg_outbox.databases", &db.name);
    db.cluster.wait_for_workers(&db.name);
    db
}

/// Polls `probe` until it returns Some, or panics with `what` after `deadline`.
pub fn eventually<T>(what: &str, deadline: Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The server's message of a client error, or the error itself.
pub fn db_message(e: &postgres::Error) -> String {
    e.as_db_error()
        .map(|d| format!("{} ({})", d.message(), d.code().code()))
        .unwrap_or_else(|| e.to_string())
}

/// The SQLSTATE of the error `sql` raises (panics if it succeeds).
pub fn sqlstate(client: &mut Client, sql: &str) -> String {
    match client.batch_execute(sql) {
        Ok(()) => panic!("expected an error from: {sql}"),
        Err(e) => {
            let db = e
                .as_db_error()
                .unwrap_or_else(|| panic!("not a server error from {sql}: {e}"));
            db.code().code().to_string()
        }
    }
}

/// The error message `sql` raises (panics if it succeeds).
pub fn error_message(client: &mut Client, sql: &str) -> String {
    match client.batch_execute(sql) {
        Ok(()) => panic!("expected an error from: {sql}"),
        Err(e) => e
            .as_db_error()
            .map(|d| d.message().to_string())
            .unwrap_or_else(|| e.to_string()),
    }
}

/// Events as a reader sees them: (position, topic, payload text) read through the read rule.
pub fn read(client: &mut Client, consumer: &str, max: i32) -> Vec<(String, String, String)> {
    client
        .query(
            "SELECT position, topic, payload::text FROM outbox.read($1, $2)",
            &[&consumer, &max],
        )
        .expect("outbox.read")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// Splits a position "<txid>:<seq>" into numbers, for ordering checks in tests.
pub fn position(text: &str) -> (u64, i64) {
    let (t, s) = text.split_once(':').expect("position has a colon");
    (t.parse().unwrap(), s.parse().unwrap())
}

/// Shared buffers a statement touched (hit or read), from EXPLAIN (ANALYZE, BUFFERS): the first
/// "Buffers:" line is the top node's, which counts everything below it.
pub fn buffers(c: &mut Client, sql: &str) -> i64 {
    let plan: Vec<String> = c
        .query(&format!("EXPLAIN (ANALYZE, BUFFERS) {sql}"), &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let line = plan
        .iter()
        .find(|l| l.trim_start().starts_with("Buffers:"))
        .unwrap_or_else(|| panic!("no buffers in {plan:#?}"));
    line.split_whitespace()
        .filter_map(|w| w.strip_prefix("hit=").or_else(|| w.strip_prefix("read=")))
        .map(|n| n.parse::<i64>().unwrap())
        .sum()
}
