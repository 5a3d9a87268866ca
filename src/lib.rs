//! pg_outbox: a durable event dispatcher inside PostgreSQL.
//!
//! Module list and `_PG_init` only; the rules live in `pg_outbox_core` (no database needed) and
//! each SQL-facing function sits in the module named after its concept.

use pgrx::prelude::*;

mod cursor;
mod dispatch;
mod error;
mod horizon;
mod isolation;
mod lease;
mod lineage;
mod owner;
mod plans;
mod prune;
mod query;
mod queue;
mod raise;
mod raw;
mod read_rule;
mod replay;
mod schedule;
mod secrets;
mod settings;
mod sink;
mod status;
mod subscription;
mod ticks;
mod transaction;
mod worker;

#[cfg(any(test, feature = "pg_test"))]
mod tests;

pgrx::pg_module_magic!();

// The schema, the log, the cursor table and the read rule, before any function that uses them.
pgrx::extension_sql_file!("sql/schema.sql", name = "schema", bootstrap);
pgrx::extension_sql_file!(
    "sql/window.sql",
    name = "window",
    requires = ["schema", read_rule::event_size]
);
pgrx::extension_sql_file!(
    "sql/ticks.sql",
    name = "ticks",
    requires = ["schema", read_rule::event_size]
);
pgrx::extension_sql_file!("sql/sinks.sql", name = "sinks", requires = ["schema"]);
pgrx::extension_sql_file!("sql/jobs.sql", name = "jobs", requires = ["schema"]);
pgrx::extension_sql_file!("sql/schedules.sql", name = "schedules", requires = ["jobs"]);
pgrx::extension_sql_file!(
    "sql/subscriptions.sql",
    name = "subscriptions",
    requires = ["jobs"]
);
pgrx::extension_sql_file!(
    "sql/status.sql",
    name = "status",
    requires = ["sinks", "subscriptions", "ticks"]
);

// Last: nothing is usable by PUBLIC until a DBA grants it (see the README's "Privileges").
pgrx::extension_sql_file!("sql/privileges.sql", name = "privileges", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // SAFETY: reads a postmaster global. Only a preload may request shared memory and register
    // workers; CREATE EXTENSION and plain LOAD get the SQL functions, and the ones that need the
    // workers refuse with a hint (worker::preloaded()).
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    settings::init();
    secrets::init();
    if preloading {
        worker::register();
    }
}

/// Test-framework hooks: the cluster `cargo pgrx test` starts preloads pg_outbox as a real
/// installation would.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![
            "shared_preload_libraries = 'pg_outbox'",
            "pg_outbox.databases = 'pgrx_tests'",
        ]
    }
}
