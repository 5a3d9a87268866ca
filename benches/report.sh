#!/usr/bin/env bash
# Every benchmark of pg_outbox in one run, then a report: REPORT.md with tables and PNG charts
# (matplotlib) under benches/results/<date>/, each figure beside its baselines measured in the
# same run on the same server (raise vs INSERT and PgQ; dispatch vs PgQ's consumer loop and a
# SKIP LOCKED queue; latency against rate; a long transaction's stall and recovery; the log's size
# over a long run with pruning; HTTP sinks; fan-out; jobs vs hand-written queues; Kafka sinks vs a
# plain librdkafka producer).
#
#   bash benches/report.sh                       # the full run (about 20 minutes on 2 cores)
#   BENCH_SHORT=1 bash benches/report.sh         # seconds per benchmark: checks it all still runs
#   BENCH_OUT=/tmp/r bash benches/report.sh      # somewhere else
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/lib.sh

if [ -n "${BENCH_SHORT:-}" ]; then
  export BENCH_SECONDS=1 BENCH_ROUNDS=1 BENCH_EVENTS=2000 BENCH_JOBS=2000 BENCH_SOAK_ROUNDS=2 \
         BENCH_MIN_EVALUATIONS=2000 BENCH_FANOUT_RUNS=1 BENCH_STALL_SECONDS=1 BENCH_SIZE_SECONDS=4 \
         BENCH_JOBS_RUNS=1 BENCH_DRAIN_SECONDS=1
  OUT=${BENCH_OUT:-/tmp/pg_outbox-report-short}
else
  OUT=${BENCH_OUT:-benches/results/$(date -u +%Y-%m-%d)}
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/figures.jsonl" "$OUT"/*.png
export BENCH_JSON="$OUT/figures.jsonl"

bench_prepare
# One build for all: the scripts below measure what is installed now.
export BENCH_INSTALLED=1

{
  echo "date:        $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "pg_outbox:   $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet -- . ':!benches/results' 2>/dev/null || echo ' (uncommitted changes)')"
  echo "build:       $([ -n "${BENCH_SHORT:-}" ] && echo 'as installed (short run)' || echo release)"
  echo "PostgreSQL:  $(/usr/lib/postgresql/15/bin/postgres --version)"
  echo "PgQ:         $(dpkg-query -W -f='${Version}' postgresql-15-pgq3 2>/dev/null)"
  echo "kernel:      $(uname -sr)"
  echo "CPU:         $(nproc) x $(awk -F': ' '/model name/ { print $2; exit }' /proc/cpuinfo)"
  echo "memory:      $(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
  echo "settings:    fsync on, shared_buffers 1GB, max_wal_size 4GB, pg_outbox.min_workers 2, each benchmark on its own throwaway cluster"
  echo "sizes:       BENCH_SECONDS=${BENCH_SECONDS:-default} BENCH_EVENTS=${BENCH_EVENTS:-default} BENCH_JOBS=${BENCH_JOBS:-default}"
} >"$OUT/machine.txt"

run() {
  local name=$1; shift
  echo "[report] $name" >&2
  "$@" 2>&1 | sed 's/\x1b\[[0-9;]*m//g' | tee "$OUT/$name.txt"
}
run raise bash benches/raise.sh
run dispatch bash benches/run.sh dispatch
run http bash benches/run.sh http
run subscriptions bash benches/run.sh subscriptions
run jobs bash benches/jobs.sh
run ticks bash benches/ticks.sh
run kafka bash benches/run.sh kafka
/usr/bin/python3 benches/report.py "$OUT"
