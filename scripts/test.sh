#!/usr/bin/env bash
# Sets up what is missing, then runs every test of pg_outbox: formatting and lints, the pure core,
# the in-backend tests (cargo pgrx test), and the client-side suite against a throwaway cluster
# with pg_outbox preloaded. Ends with one summary line of all test counts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
log=$(mktemp /tmp/pg_outbox-test.XXXXXX)
trap 'rm -f "$log"' EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "format and lints"
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings

step "pure core (no database)"
cargo test -p pg_outbox_core 2>&1 | tee -a "$log"

step "in-backend tests (cargo pgrx test; installs a test build into PostgreSQL 15)"
cargo pgrx test pg15 --runas postgres --pgdata /tmp/pgrx-test-pgdata 2>&1 | tee -a "$log"

step "client-side tests against a throwaway preloaded cluster"
# A plain build replaces the test build that cargo pgrx test installed.
cargo pgrx install --pg-config "$PG_CONFIG" >/dev/null
cargo test -p pg_outbox_tests 2>&1 | tee -a "$log"

step "benchmark report, short run (every benchmark for a second or two, with the test build)"
# So that the benchmarks and the report cannot rot; the figures of this run mean nothing.
BENCH_SHORT=1 BENCH_INSTALLED=1 BENCH_DEBUG=1 bash benches/report.sh >/tmp/pg_outbox-report-short.log 2>&1 \
  || { tail -50 /tmp/pg_outbox-report-short.log; exit 1; }
tail -1 /tmp/pg_outbox-report-short.log

# pipefail stops the run at the first failing step; this sums what all suites ran.
awk '/^test result:/ { p += $4; f += $6 } END { printf "\nsummary: %d passed, %d failed\n", p, f; exit (f > 0) }' \
  <(sed 's/;//g' "$log")
