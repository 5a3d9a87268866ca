//! Golden SQL tests: each `tests/golden/<name>.sql` runs through psql against a fresh database with
//! pg_outbox, echoing every statement and every error (with its SQLSTATE); the output must match
//! `tests/golden/<name>.out` line for line. `GOLDEN_BLESS=1 cargo test -p pg_outbox_tests --test
//! golden` writes the .out files instead: review the diff before committing it.

use pg_outbox_tests::test_db;
use std::path::{Path, PathBuf};
use std::process::Command;

const PSQL: &str = "/usr/lib/postgresql/15/bin/psql";

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden")
}

/// The output with what differs between runs and checkouts taken out: LOCATION lines (source file
/// and line of the server that raised the error), the SQL file's directory in psql's
/// "psql:<file>:<line>:" prefixes, and the number of the session's temporary schema.
fn normalise(output: &str, sql: &Path) -> String {
    let dir = format!("{}/", sql.parent().unwrap().display());
    output
        .lines()
        .filter(|l| !l.starts_with("LOCATION:"))
        .map(|l| format!("{}\n", temp_schemas(&l.replace(&dir, "")).trim_end()))
        .collect()
}

/// `pg_temp_<n>` (n depends on the backend) written as `pg_temp_N`.
fn temp_schemas(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(i) = rest.find("pg_temp_") {
        out.push_str(&rest[..i + "pg_temp_".len()]);
        rest = &rest[i + "pg_temp_".len()..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 {
            out.push('N');
            rest = &rest[digits..];
        }
    }
    out.push_str(rest);
    out
}

fn run(sql: &Path) -> String {
    let stem = sql.file_stem().unwrap().to_string_lossy().to_string();
    let db = test_db(&format!("golden_{stem}"));
    let cluster = db.cluster();
    let command = format!(
        "{PSQL} -X -a -q -h '{}' -p {} -U postgres -d '{}' -v VERBOSITY=verbose -v SHOW_CONTEXT=never -f '{}' 2>&1",
        cluster.socket_dir().display(),
        cluster.port(),
        db.name,
        sql.display()
    );
    let out = Command::new("sh")
        .arg("-c")
        .arg(&command)
        .env("PGTZ", "UTC")
        .env("PGDATESTYLE", "ISO")
        .output()
        .expect("running psql");
    assert!(out.status.success(), "psql failed: {command}");
    normalise(&String::from_utf8_lossy(&out.stdout), sql)
}

#[test]
fn golden_sql_files_give_their_expected_output() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .expect("tests/golden")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no golden SQL files");
    let bless = std::env::var_os("GOLDEN_BLESS").is_some();
    let mut failed = Vec::new();
    for sql in &files {
        let actual = run(sql);
        let expected_path = sql.with_extension("out");
        if bless {
            std::fs::write(&expected_path, &actual).unwrap();
            continue;
        }
        let expected = std::fs::read_to_string(&expected_path)
            .unwrap_or_else(|_| panic!("{} is missing: bless it", expected_path.display()));
        if actual != expected {
            let actual_path = sql.with_extension("actual");
            std::fs::write(&actual_path, &actual).unwrap();
            // The first differing line, to read without a diff tool.
            let (line, (e, a)) = expected
                .lines()
                .zip(actual.lines())
                .enumerate()
                .find(|(_, (e, a))| e != a)
                .unwrap_or((
                    expected.lines().count().min(actual.lines().count()),
                    ("<end>", "<end>"),
                ));
            failed.push(format!(
                "{}: line {}:\n  expected: {e}\n  actual:   {a}\n  (whole output in {})",
                sql.display(),
                line + 1,
                actual_path.display()
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "golden output differs:\n{}",
        failed.join("\n")
    );
}
