//! Upgrades (issue #11, item 4): a database full of state made by release 0.1.0, running 0.1.0's
//! binary, gets this build's binary, then `ALTER EXTENSION pg_outbox UPDATE`. Nothing is lost,
//! duplicated or skipped, delivery goes on, and the schema ends exactly as a fresh install's.
//!
//! Two versions of one extension cannot share the system's installation, so the test builds a
//! private one: a copy of PostgreSQL's binaries in a directory of its own, whose lib and share
//! directories (found next to the binaries, as PostgreSQL finds them) link to the system's files,
//! except pg_outbox's. 0.1.0 is built once from its commit by `scripts/build-release.sh` into a
//! cache outside the checkout.

use pg_outbox_tests::{eventually, Cluster};
use postgres::Client;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const SYSTEM_BIN: &str = "/usr/lib/postgresql/15/bin";
const SYSTEM_LIB: &str = "/usr/lib/postgresql/15/lib";
const SYSTEM_SHARE: &str = "/usr/share/postgresql/15";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The package directory of a released version (built on first use).
fn release(version: &str) -> PathBuf {
    let out = Command::new("bash")
        .arg(repo().join("scripts/build-release.sh"))
        .arg(version)
        .output()
        .expect("running scripts/build-release.sh");
    assert!(
        out.status.success(),
        "building release {version} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// This build's version: the default of the installed control file.
fn current_version() -> String {
    let control = fs::read_to_string(format!("{SYSTEM_SHARE}/extension/pg_outbox.control"))
        .expect("pg_outbox is installed (scripts/test.sh installs it)");
    control
        .lines()
        .find_map(|l| l.strip_prefix("default_version = "))
        .expect("default_version")
        .trim_matches('\'')
        .to_string()
}

/// A private PostgreSQL installation under `root`, with pg_outbox's files taken from `pkg` (a
/// package tree as `cargo pgrx package` lays it out).
struct Tree {
    root: PathBuf,
}

impl Tree {
    fn new(root: PathBuf, pkg: &Path) -> Tree {
        let _ = fs::remove_dir_all(&root);
        let tree = Tree { root };
        fs::create_dir_all(tree.bin()).unwrap();
        for bin in ["postgres", "pg_ctl", "initdb"] {
            fs::copy(format!("{SYSTEM_BIN}/{bin}"), tree.bin().join(bin)).unwrap();
        }
        link_all_but_ours(Path::new(SYSTEM_LIB), &tree.lib());
        fs::create_dir_all(tree.share()).unwrap();
        for entry in fs::read_dir(SYSTEM_SHARE).unwrap() {
            let entry = entry.unwrap();
            if entry.file_name() != "extension" {
                symlink(entry.path(), tree.share().join(entry.file_name())).unwrap();
            }
        }
        link_all_but_ours(
            &Path::new(SYSTEM_SHARE).join("extension"),
            &tree.extension(),
        );
        tree.install(pkg, None);
        tree
    }

    fn bin(&self) -> PathBuf {
        self.root.join("usr/lib/postgresql/15/bin")
    }
    fn lib(&self) -> PathBuf {
        self.root.join("usr/lib/postgresql/15/lib")
    }
    fn share(&self) -> PathBuf {
        self.root.join("usr/share/postgresql/15")
    }
    fn extension(&self) -> PathBuf {
        self.share().join("extension")
    }

    /// Puts pg_outbox's library, control file and scripts from `pkg` (a package tree, or `/` for
    /// the system's installation) in place, replacing the library and control file. `upgrades`:
    /// the directory of upgrade scripts to add.
    fn install(&self, pkg: &Path, upgrades: Option<&Path>) {
        let lib = pkg.join(SYSTEM_LIB.trim_start_matches('/'));
        let ext = pkg
            .join(SYSTEM_SHARE.trim_start_matches('/'))
            .join("extension");
        let _ = fs::remove_file(self.lib().join("pg_outbox.so"));
        fs::copy(lib.join("pg_outbox.so"), self.lib().join("pg_outbox.so")).unwrap();
        let _ = fs::remove_file(self.extension().join("pg_outbox.control"));
        fs::copy(
            ext.join("pg_outbox.control"),
            self.extension().join("pg_outbox.control"),
        )
        .unwrap();
        let version = fs::read_to_string(ext.join("pg_outbox.control"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("default_version = ").map(str::to_string))
            .unwrap();
        let script = format!("pg_outbox--{}.sql", version.trim_matches('\''));
        fs::copy(ext.join(&script), self.extension().join(&script)).unwrap();
        if let Some(dir) = upgrades {
            for entry in fs::read_dir(dir).unwrap() {
                let name = entry.unwrap().file_name();
                let name = name.to_string_lossy();
                if name.starts_with("pg_outbox--") && name.matches("--").count() == 2 {
                    fs::copy(dir.join(&*name), self.extension().join(&*name)).unwrap();
                }
            }
        }
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// Links every entry of `from` into `to`, except pg_outbox's own files.
fn link_all_but_ours(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if !entry.file_name().to_string_lossy().starts_with("pg_outbox") {
            symlink(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

fn count(c: &mut Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).unwrap().get(0)
}

fn ints(c: &mut Client, sql: &str) -> Vec<i32> {
    c.query(sql, &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// The schema of `db` as pg_dump writes it in binary-upgrade mode (the one mode that writes an
/// extension's member objects), without the object ids that mode also writes.
fn schema(cluster: &Cluster, db: &str) -> String {
    let out = Command::new(format!("{SYSTEM_BIN}/pg_dump"))
        .args(["--schema-only", "--binary-upgrade", "--no-comments"])
        .args(["-h", cluster.socket_dir().to_str().unwrap()])
        .args(["-p", &cluster.port().to_string(), "-U", "postgres", db])
        .output()
        .expect("pg_dump");
    assert!(
        out.status.success(),
        "pg_dump {db}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| {
            // Object ids, where sequences stand (data), and the random key of psql's \restrict
            // guard.
            !l.contains("binary_upgrade_set_next")
                && !l.starts_with("SELECT pg_catalog.setval(")
                && !l.starts_with("\\restrict")
                && !l.starts_with("\\unrestrict")
        })
        // Transaction ids and object ids that differ from database to database.
        .map(|l| {
            if l.starts_with("SET relfrozenxid = ") {
                "SET relfrozenxid = <xid>".to_string()
            } else if l.starts_with("WHERE oid = '") {
                "WHERE oid = <oid>".to_string()
            } else if l.starts_with("SELECT pg_catalog.binary_upgrade_create_empty_extension(") {
                // The oids of the tables pg_dump keeps (compared by name in `dumped_tables`).
                let digits = |c: char| c.is_ascii_digit() || c == ',';
                let mut out = String::new();
                let mut rest = l;
                while let Some(i) = rest.find("'{") {
                    out.push_str(&rest[..i + 2]);
                    rest = &rest[i + 2..];
                    let end = rest.find('}').unwrap_or(rest.len());
                    if !rest[..end].is_empty() && rest[..end].chars().all(digits) {
                        out.push_str("<oids>");
                        rest = &rest[end..];
                    }
                }
                out.push_str(rest);
                out
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Default privileges that give every function made from now on an ACL (EXECUTE for up_mailer).
const DEFAULT_PRIVILEGES: &str =
    "ALTER DEFAULT PRIVILEGES FOR ROLE postgres GRANT EXECUTE ON FUNCTIONS TO up_mailer;";

/// Grants of the README's kind, the same in every database of the test.
const GRANTS: &str = "
    GRANT USAGE ON SCHEMA outbox TO up_app, up_mailer;
    GRANT EXECUTE ON FUNCTION outbox.raise(text, jsonb, text, text, jsonb),
        outbox.subscribe(text, text[], regprocedure, text, text, integer, text) TO up_app;
    GRANT EXECUTE ON FUNCTION outbox.enqueue(text, jsonb, timestamptz, text, integer),
        outbox.claim(text, integer, interval), outbox.complete(bigint),
        outbox.fail(bigint, text, boolean) TO up_mailer;
    GRANT EXECUTE ON FUNCTION outbox.schedule, outbox.schedule_status TO up_app;";

/// The application's own objects: the handlers and the table they fill.
const USER_OBJECTS: &str = "
    CREATE TABLE public.got (sink text, n int);
    CREATE FUNCTION public.main(e outbox.event[]) RETURNS void LANGUAGE sql AS
      $$ INSERT INTO public.got SELECT 'main', (x.payload->>'n')::int FROM unnest(e) x $$;
    CREATE FUNCTION public.later(e outbox.event[]) RETURNS void LANGUAGE sql AS
      $$ INSERT INTO public.got SELECT 'later', (x.payload->>'n')::int FROM unnest(e) x $$;
    CREATE FUNCTION public.picky(e outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$
    BEGIN
      IF EXISTS (SELECT FROM unnest(e) x WHERE x.payload ? 'poison') THEN
        RAISE EXCEPTION 'poison';
      END IF;
      INSERT INTO public.got SELECT 'picky', (x.payload->>'n')::int FROM unnest(e) x;
    END $$;
    CREATE FUNCTION public.job(e outbox.event) RETURNS void LANGUAGE sql AS
      $$ INSERT INTO public.got VALUES ('sub', (e.payload->>'n')::int) $$;";

#[test]
fn a_database_of_the_last_release_upgrades_with_nothing_lost_and_the_schema_of_a_fresh_install() {
    let old = release("0.1.0");
    let tree = Tree::new(
        PathBuf::from(format!("/tmp/pg_outbox_tree.{}", std::process::id())),
        &old,
    );
    let cluster = Cluster::start_with_bin(
        &tree.bin(),
        "pg_outbox_upgrade",
        &[
            "fsync = off",
            "pg_outbox.database = 'shop'", // 0.1.0
            "pg_outbox.databases = 'shop'",
            "pg_outbox.max_backoff = '1s'",
        ],
    );
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| upgrade(&cluster, &tree)));
    let log = cluster.log();
    cluster.stop();
    if let Err(e) = result {
        eprintln!("server log:\n{log}");
        std::panic::resume_unwind(e);
    }
}

fn upgrade(cluster: &Cluster, tree: &Tree) {
    let mut admin = cluster.connect("postgres", "postgres");
    for sql in [
        "CREATE DATABASE shop",
        "CREATE DATABASE fresh",
        "CREATE ROLE up_app LOGIN",
        "CREATE ROLE up_mailer LOGIN",
    ] {
        admin.batch_execute(sql).unwrap();
    }
    let mut su = cluster.connect("shop", "postgres");
    // Default privileges give every new function an ACL of its own: the upgrade must still keep
    // the new ones from PUBLIC, as a fresh install does.
    su.batch_execute(&format!("{DEFAULT_PRIVILEGES} CREATE EXTENSION pg_outbox"))
        .unwrap();
    assert_eq!(
        su.query_one(
            "SELECT extversion FROM pg_extension WHERE extname = 'pg_outbox'",
            &[]
        )
        .unwrap()
        .get::<_, String>(0),
        "0.1.0"
    );
    // State of every kind: sinks delivering, paused and with a dead letter; subscriptions with a
    // handler and with a queue; a pull consumer half way; jobs waiting and dead; a schedule.
    su.batch_execute(GRANTS).unwrap();
    su.batch_execute(USER_OBJECTS).unwrap();
    su.batch_execute(
        "SELECT outbox.create_sink('main', 'public.main(outbox.event[])');
         SELECT outbox.create_sink('later', 'public.later(outbox.event[])');
         SELECT outbox.pause_sink('later');
         SELECT outbox.create_sink('picky', 'public.picky(outbox.event[])');
         SET ROLE up_app;
         SELECT outbox.subscribe('early', ARRAY['none'], queue => 'sub');
         RESET ROLE;
         SELECT outbox.subscribe('sub', handler => 'public.job(outbox.event)');
         SELECT outbox.subscribe('feed', queue => 'feed_q');
         SELECT outbox.create_consumer('puller');
         SELECT outbox.schedule('hourly', every => '1 hour', queue => 'reports');",
    )
    .unwrap();
    let mut app = cluster.connect("shop", "up_app");
    let mut mailer = cluster.connect("shop", "up_mailer");
    mailer
        .batch_execute(
            "SELECT outbox.enqueue('mail', jsonb_build_object('n', n)) FROM generate_series(1, 3) n",
        )
        .unwrap();
    let dead: i64 = mailer
        .query_one("SELECT id FROM outbox.claim('mail')", &[])
        .unwrap()
        .get(0);
    mailer
        .execute("SELECT outbox.fail($1, 'bounced', false)", &[&dead])
        .unwrap();
    let raise = |app: &mut Client, from: i32, to: i32| {
        for n in from..=to {
            let payload = if n == 7 {
                format!("{{\"n\": {n}, \"poison\": true}}")
            } else {
                format!("{{\"n\": {n}}}")
            };
            app.execute(
                "SELECT outbox.raise('order.placed', $1::text::jsonb)",
                &[&payload],
            )
            .unwrap();
        }
    };
    raise(&mut app, 1, 20);
    let delivered = |su: &mut Client, sink: &str, n: i64| {
        eventually(
            &format!("{n} events at {sink}"),
            Duration::from_secs(60),
            || {
                (count(
                    su,
                    &format!("SELECT count(*) FROM public.got WHERE sink = '{sink}'"),
                ) >= n)
                    .then_some(())
            },
        )
    };
    delivered(&mut su, "main", 20);
    delivered(&mut su, "picky", 19);
    delivered(&mut su, "sub", 20);
    eventually("the dead letter", Duration::from_secs(60), || {
        (count(&mut su, "SELECT count(*) FROM outbox.dead_letters") == 1).then_some(())
    });
    eventually("the fan-out to feed_q", Duration::from_secs(60), || {
        (count(
            &mut su,
            "SELECT count(*) FROM outbox.jobs WHERE queue = 'feed_q'",
        ) == 20)
            .then_some(())
    });
    let tenth: String = su
        .query("SELECT position FROM outbox.read('puller', 10)", &[])
        .unwrap()
        .last()
        .unwrap()
        .get(0);
    su.execute("SELECT outbox.advance('puller', $1)", &[&tenth])
        .unwrap();

    // The new binary, the old SQL: events raised in between wait, nothing breaks.
    tree.install(Path::new("/"), Some(&repo().join("sql")));
    cluster.restart("fast");
    let mut app = cluster.connect("shop", "up_app");
    raise(&mut app, 21, 25);
    eventually(
        "the workers to wait for the update",
        Duration::from_secs(30),
        || {
            cluster
                .log()
                .contains("the installed SQL is version 0.1.0")
                .then_some(())
        },
    );
    let mut su = cluster.connect("shop", "postgres");
    su.batch_execute("ALTER EXTENSION pg_outbox UPDATE")
        .unwrap();
    assert_eq!(
        su.query_one(
            "SELECT extversion FROM pg_extension WHERE extname = 'pg_outbox'",
            &[]
        )
        .unwrap()
        .get::<_, String>(0),
        current_version()
    );
    raise(&mut app, 26, 30);

    // Every ledger as if nothing had happened: each event once, in order.
    let all: Vec<i32> = (1..=30).collect();
    let without_poison: Vec<i32> = all.iter().copied().filter(|&n| n != 7).collect();
    delivered(&mut su, "main", 30);
    delivered(&mut su, "picky", 29);
    delivered(&mut su, "sub", 30);
    let got = |su: &mut Client, sink: &str| {
        ints(
            su,
            &format!("SELECT n FROM public.got WHERE sink = '{sink}' ORDER BY ctid"),
        )
    };
    assert_eq!(got(&mut su, "main"), all);
    assert_eq!(got(&mut su, "picky"), without_poison);
    let mut sub = got(&mut su, "sub");
    sub.sort();
    assert_eq!(sub, all);
    assert_eq!(
        count(
            &mut su,
            "SELECT count(*) FROM outbox.dead_letters WHERE (event).payload ? 'poison'"
        ),
        1
    );
    // Every reader of 0.1.0 reads by the read horizon, as it did; each may turn to ticks from
    // where it is (issue 15).
    assert_eq!(
        count(
            &mut su,
            "SELECT count(*) FROM outbox.consumers WHERE read_by <> 'horizon' OR tick IS NOT NULL"
        ),
        0
    );
    // The paused sink kept its place, turns to ticks, and delivers everything once resumed.
    assert!(got(&mut su, "later").is_empty());
    su.batch_execute(
        "SELECT outbox.alter_sink('later', '{\"read_by\": \"ticks\"}'); \
         SELECT outbox.resume_sink('later')",
    )
    .unwrap();
    delivered(&mut su, "later", 30);
    assert_eq!(got(&mut su, "later"), all);
    // The pull consumer turns to ticks and goes on after its tenth event.
    su.batch_execute("SELECT outbox.alter_consumer('puller', '{\"read_by\": \"ticks\"}')")
        .unwrap();
    let rest: Vec<i32> = su
        .query(
            "SELECT (payload->>'n')::int FROM outbox.read('puller', 100)",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rest, (11..=30).collect::<Vec<_>>());
    // Jobs: the fan-out's all there, the waiting and dead ones kept, and the roles that used the
    // queues before still may (0.1.0 had no per-queue rights; the upgrade keeps what they had).
    eventually(
        "the fan-out of every event",
        Duration::from_secs(60),
        || {
            (count(
                &mut su,
                "SELECT count(*) FROM outbox.jobs WHERE queue = 'feed_q'",
            ) == 30)
                .then_some(())
        },
    );
    let mut mailer = cluster.connect("shop", "up_mailer");
    let mut mine = ints(
        &mut mailer,
        "SELECT (payload->>'n')::int FROM outbox.claim('mail', 10)",
    );
    mine.sort();
    assert_eq!(mine, [2, 3]);
    assert_eq!(
        count(
            &mut mailer,
            "SELECT count(*) FROM outbox.claim('feed_q', 100)"
        ),
        30
    );
    assert_eq!(
        count(
            &mut su,
            "SELECT count(*) FROM outbox.dead_jobs WHERE last_error = 'bounced'"
        ),
        1
    );
    assert_eq!(
        count(
            &mut su,
            "SELECT count(*) FROM outbox.queue_privileges() WHERE grantee = 'up_mailer'::regrole \
             AND enqueue AND work"
        ),
        3,
        "mail, feed_q and reports"
    );
    assert_eq!(
        count(
            &mut su,
            "SELECT count(*) FROM outbox.schedule_status() WHERE name = 'hourly'"
        ),
        1
    );
    // schedule() and schedule_status() changed shape and were made again: their grants stay.
    assert_eq!(
        count(
            &mut su,
            "SELECT count(*) FROM pg_proc p WHERE p.oid IN ('outbox.schedule'::regproc, 'outbox.schedule_status'::regproc) \
              AND has_function_privilege('up_app', p.oid, 'EXECUTE') AND pronargs IN (0, 10)"
        ),
        2
    );
    // A handler subscription owns the queue of its name, even when another role's subscription
    // named it first; that role keeps feeding it.
    let sub_queue: Vec<(String, Option<String>, Option<bool>)> = su
        .query(
            "SELECT owner::text, grantee::text, enqueue FROM outbox.queue_privileges() \
              WHERE queue = 'sub' ORDER BY grantee::text",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        sub_queue,
        [(
            "postgres".to_string(),
            Some("up_app".to_string()),
            Some(true)
        )]
    );
    // Nothing new is PUBLIC's.
    assert_eq!(
        count(
            &mut su,
            "SELECT count(*) FROM pg_proc p, aclexplode(p.proacl) a \
              WHERE p.pronamespace = 'outbox'::regnamespace AND a.grantee = 0"
        ),
        0
    );

    // The upgraded schema is a fresh install's (with the same grants and objects of the
    // application's: a binary-upgrade dump, the one that lists an extension's objects, is of the
    // whole database).
    let mut fresh = cluster.connect("fresh", "postgres");
    fresh
        .batch_execute(&format!(
            "{DEFAULT_PRIVILEGES} CREATE EXTENSION pg_outbox; {GRANTS} {USER_OBJECTS}"
        ))
        .unwrap();
    // pg_dump keeps the same tables and sequences, with their data.
    let dumped = |db: &str| -> Vec<String> {
        cluster
            .connect(db, "postgres")
            .query(
                "SELECT c::regclass::text FROM pg_extension e, unnest(e.extconfig) WITH ORDINALITY u(c, i) \
                  WHERE e.extname = 'pg_outbox' ORDER BY i",
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    assert_eq!(dumped("shop"), dumped("fresh"));
    // The log's events are in its partitions (the partitioned table itself holds none).
    for k in 0..4 {
        assert!(dumped("shop").contains(&format!("outbox.events_{k}")));
    }
    let (upgraded, installed) = (schema(cluster, "shop"), schema(cluster, "fresh"));
    if upgraded != installed {
        let dir = std::env::temp_dir();
        fs::write(dir.join("pg_outbox_upgraded.sql"), &upgraded).unwrap();
        fs::write(dir.join("pg_outbox_fresh.sql"), &installed).unwrap();
        let diff = Command::new("diff")
            .args(["-u"])
            .arg(dir.join("pg_outbox_fresh.sql"))
            .arg(dir.join("pg_outbox_upgraded.sql"))
            .output()
            .unwrap();
        panic!(
            "the upgraded schema differs from a fresh install's:\n{}",
            String::from_utf8_lossy(&diff.stdout)
        );
    }
    assert!(
        upgraded.contains("CREATE TABLE outbox.queues"),
        "the dump has the extension's objects:\n{upgraded}"
    );
}
