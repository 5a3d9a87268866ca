#!/usr/bin/env bash
# Benchmark: dispatch throughput into a table sink (batch 128, 500 and 1000) against PgQ's batch
# consumer loop and a SKIP LOCKED queue; commit-to-handler latency at 100 to 2,000 events/s and at
# saturation; the stall while a transaction holds the read horizon and the recovery after it; the
# log's size over a long run with pruning on. A throwaway cluster with fsync on.
#
#   bash benches/dispatch.sh
#   BENCH_EVENTS=20000 BENCH_SECONDS=3 BENCH_STALL_SECONDS=3 BENCH_SIZE_SECONDS=30 bash benches/dispatch.sh
exec bash "$(dirname "$0")/run.sh" dispatch
