#!/usr/bin/env bash
# Benchmark: fan-out cost per event per subscription (1, 10 and 100 filtered subscriptions) and
# jobs per second run by the workers through a trivial SQL handler, on a throwaway cluster with
# fsync on.
#
#   bash benches/subscriptions.sh
#   BENCH_EVENTS=5000 BENCH_JOBS=20000 bash benches/subscriptions.sh     # a short run
exec bash "$(dirname "$0")/run.sh" subscriptions
