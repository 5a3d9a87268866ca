#!/usr/bin/env bash
# Benchmark: external workers draining a job queue, outbox.claim + outbox.complete against plain
# hand-written SKIP LOCKED queue tables, measured in the same run on one throwaway cluster (fsync
# on), 2 and 4 workers (pgbench), 10 jobs per claim. pg_outbox without a lease (jobs held by the
# claiming transaction) against the hand-written queue with the same guarantee (lock, then delete
# in one transaction); pg_outbox with a lease (a second write per job) and the at-most-once
# delete-on-claim queue for reference.
#
#   bash benches/jobs.sh
#   BENCH_JOBS=20000 bash benches/jobs.sh     # a short run
#   BENCH_JOBS_RUNS=1 bash benches/jobs.sh    # one drain per figure (default: median of three)
#
# A drain leaves dead rows at the head of the claim index, and every claim steps over them until
# a vacuum: with autovacuum on, single drains of the same queue swung twofold with when it came.
# So autovacuum is off here, every drain starts from a vacuumed table (the same for both queues),
# and each figure is the median of BENCH_JOBS_RUNS drains.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cluster.sh

JOBS=${BENCH_JOBS:-100000}
RUNS=${BENCH_JOBS_RUNS:-3}
DIR=/tmp/pg_outbox-bench-jobs.$$
PORT=$((30000 + $$ % 20000))

source benches/lib.sh
bench_prepare

trap 'cluster_stop "$DIR"' EXIT
cluster_start "$DIR" "$PORT" "shared_buffers = '1GB'" "max_wal_size = '4GB'" "autovacuum = off"
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
# pg_outbox with a lease (claim commits; a worker that dies loses its lease, the job comes back).
cat >"$W/outbox_lease.sql" <<'SQL'
SELECT outbox.complete_many(array_agg(j.id)) FROM outbox.claim('work', 10, '30 seconds') j;
SQL
# pg_outbox without a lease: the jobs are held by the claiming transaction, like the hand-written
# lock-then-delete queue below.
cat >"$W/outbox_tx.sql" <<'SQL'
BEGIN;
SELECT outbox.complete_many(array_agg(j.id)) FROM outbox.claim('work', 10, lease => NULL) j;
COMMIT;
SQL
# Two hand-written queues. The canonical at-least-once one: lock jobs with SKIP LOCKED, work,
# delete them, in one transaction (a worker that dies rolls back and the jobs are free again).
cat >"$W/locked.sql" <<'SQL'
BEGIN;
SELECT array_agg(id) AS ids FROM (
    SELECT id FROM plain_jobs WHERE queue = 'work' AND run_at <= now()
     ORDER BY run_at, id LIMIT 10 FOR UPDATE SKIP LOCKED) j \gset
DELETE FROM plain_jobs WHERE id = ANY (:ids::bigint[]);
COMMIT;
SQL
# The cheapest: claim and delete in one statement (at most once: a worker that dies mid-job loses
# it).
cat >"$W/plain.sql" <<'SQL'
DELETE FROM plain_jobs WHERE id IN (
    SELECT id FROM plain_jobs WHERE queue = 'work' AND run_at <= now()
     ORDER BY run_at, id LIMIT 10 FOR UPDATE SKIP LOCKED);
SQL

# Jobs/s draining $JOBS jobs with $2 workers: the median of $RUNS drains.
drain() {
  local runs=() i
  for ((i = 0; i < RUNS; i++)); do
    runs+=("$(drain_once "$1" "$2")")
  done
  printf '%s\n' "${runs[@]}" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

drain_once() {
  local script=$1 clients=$2 fill
  if [ "${script%%_*}" = outbox ]; then
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

printf '\npg_outbox job queue benchmark: %s jobs, 10 jobs per claim, fsync on, median of %s drains\n\n' "$JOBS" "$RUNS"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
printf '%-8s %-58s %10s\n' "workers" "queue" "jobs/s"
for clients in 2 4; do
  tx=$(drain outbox_tx "$clients")
  locked=$(drain locked "$clients")
  lease=$(drain outbox_lease "$clients")
  plain=$(drain plain "$clients")
  printf '%-8s %-58s %10s\n' "$clients" "pg_outbox, claim(lease => NULL) + complete_many, one transaction" "$tx" \
    "" "hand-written: lock SKIP LOCKED, then delete, one transaction" "$locked" \
    "" "pg_outbox, claim with a 30 s lease + complete_many" "$lease" \
    "" "hand-written: delete-on-claim, one statement (at most once)" "$plain"
  printf '%-8s ratios: no lease / lock+delete %s; lease / lock+delete %s; no lease / delete-on-claim %s; lease / delete-on-claim %s\n\n' "" \
    "$(ratio "$tx" "$locked")" "$(ratio "$lease" "$locked")" "$(ratio "$tx" "$plain")" "$(ratio "$lease" "$plain")"
  if [ -n "${BENCH_JSON:-}" ]; then
    for pair in "pg_outbox, no lease:$tx" "hand-written lock+delete:$locked" "pg_outbox, 30 s lease:$lease" \
                "hand-written delete-on-claim:$plain"; do
      printf '{"chart": "jobs", "title": "External workers: claim 10 + complete", "unit": "jobs/s", "series": "%s", "x": "%s workers", "y": %s}\n' \
        "${pair%%:*}" "$clients" "${pair##*:}" >>"$BENCH_JSON"
    done
    printf '{"ratio": "claim(lease => NULL) + complete_many / hand-written lock+delete, %s workers", "value": %s, "target": 0.8}\n' \
      "$clients" "$(ratio "$tx" "$locked")" >>"$BENCH_JSON"
    printf '{"ratio": "claim with a 30 s lease + complete_many / hand-written lock+delete, %s workers", "value": %s, "target": 0.8}\n' \
      "$clients" "$(ratio "$lease" "$locked")" >>"$BENCH_JSON"
  fi
done
echo
