#!/usr/bin/env bash
# Benchmark: dispatch throughput into a table sink (batch 128 and 1000) and commit-to-handler
# latency (steady 500 events/s, and saturation) on a throwaway cluster with fsync on.
#
#   bash benches/dispatch.sh
#   BENCH_EVENTS=20000 BENCH_SECONDS=3 bash benches/dispatch.sh     # a short run
exec bash "$(dirname "$0")/run.sh" dispatch
