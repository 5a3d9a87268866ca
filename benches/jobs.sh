#!/usr/bin/env bash
# Benchmark: external workers draining a job queue, outbox.claim + outbox.complete against a plain
# hand-written SKIP LOCKED queue table, measured in the same run on one throwaway cluster (fsync
# on). Each worker transaction claims 10 jobs and completes them; 2 and 4 workers (pgbench).
#
#   bash benches/jobs.sh
#   BENCH_JOBS=20000 bash benches/jobs.sh     # a short run
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cluster.sh

JOBS=${BENCH_JOBS:-100000}
DIR=/tmp/pg_outbox-bench-jobs.$$
PORT=$((30000 + $$ % 20000))

bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "[bench] building and installing pg_outbox (release)" >&2
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/tmp/pg_outbox-install.log 2>&1 \
  || { cat /tmp/pg_outbox-install.log; exit 1; }

trap 'cluster_stop "$DIR"' EXIT
cluster_start "$DIR" "$PORT" "shared_buffers = '1GB'" "max_wal_size = '4GB'"
cluster_psql "$DIR" "$PORT" -d postgres -c "CREATE DATABASE bench" >/dev/null
psql_bench() { cluster_psql "$DIR" "$PORT" -d bench "$@"; }

psql_bench <<'SQL' >/dev/null
CREATE EXTENSION pg_outbox;
-- The baseline: a queue table as people write it by hand.
CREATE TABLE plain_jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL,
    payload jsonb NOT NULL DEFAULT '{}',
    run_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX plain_jobs_claim ON plain_jobs (queue, run_at, id);
SQL

W=$DIR/scripts
mkdir -p "$W"
cat >"$W/outbox.sql" <<'SQL'
SELECT count(outbox.complete(j.id)) FROM outbox.claim('work', 10, '30 seconds') j;
SQL
# The usual hand-written queue: claim and delete in one statement (a worker that dies mid-job
# loses it, which the outbox lease does not).
cat >"$W/plain.sql" <<'SQL'
DELETE FROM plain_jobs WHERE id IN (
    SELECT id FROM plain_jobs WHERE queue = 'work' AND run_at <= now()
     ORDER BY run_at, id LIMIT 10 FOR UPDATE SKIP LOCKED);
SQL

# Jobs/s draining $JOBS jobs with $2 workers.
drain() {
  local script=$1 clients=$2 fill
  if [ "$script" = outbox ]; then
    fill="SELECT outbox.enqueue('work', jsonb_build_object('i', i)) FROM generate_series(1, $JOBS) i"
  else
    fill="INSERT INTO plain_jobs (queue, payload) SELECT 'work', jsonb_build_object('i', i) FROM generate_series(1, $JOBS) i"
  fi
  psql_bench -c "$fill" -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
  local tx=$((JOBS / 10 / clients))
  local tps
  tps=$(pgbench -h "$DIR" -p "$PORT" -U postgres -n -M prepared -c "$clients" -j "$clients" -t "$tx" \
          -f "$W/$script.sql" bench 2>&1 | awk '/^tps = / { print $3; exit }')
  [ -n "$tps" ] || { echo "pgbench $script failed" >&2; exit 1; }
  awk -v t="$tps" 'BEGIN { printf "%.0f", t * 10 }'
}

printf '\npg_outbox job queue benchmark: %s jobs, claim 10 + complete per transaction, fsync on\n\n' "$JOBS"
printf '%-10s %16s %16s %8s\n' "workers" "outbox jobs/s" "plain jobs/s" "ratio"
for clients in 2 4; do
  a=$(drain outbox "$clients")
  b=$(drain plain "$clients")
  printf '%-10s %16s %16s %8s\n' "$clients" "$a" "$b" "$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }')"
done
echo
