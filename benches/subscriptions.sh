#!/usr/bin/env bash
# Benchmark for subscriptions and jobs, in one run: fan-out cost per event per subscription (1, 10
# and 100 filtered subscriptions), jobs per second run by the workers through a trivial SQL
# handler, the jobs table's size after that churn, then external claim + complete against a
# hand-written SKIP LOCKED queue (benches/jobs.sh). Throwaway clusters, fsync on.
#
#   bash benches/subscriptions.sh
#   BENCH_EVENTS=5000 BENCH_JOBS=20000 bash benches/subscriptions.sh     # a short run
set -euo pipefail
here=$(dirname "$0")
bash "$here/run.sh" subscriptions
bash "$here/jobs.sh"
