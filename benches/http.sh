#!/usr/bin/env bash
# Benchmark: HTTP sink throughput to a loopback receiver (1 and 4 sinks; batch 1, 128, 1000) and
# commit-to-request latency at 500 events/s, on a throwaway cluster with fsync on.
#
#   bash benches/http.sh
#   BENCH_EVENTS=10000 BENCH_SECONDS=3 bash benches/http.sh     # a short run
exec bash "$(dirname "$0")/run.sh" http
