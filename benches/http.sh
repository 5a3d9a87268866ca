#!/usr/bin/env bash
# Benchmark: HTTP sink throughput to a loopback receiver (1 and 4 sinks; batch 1, 128, 1000) and commit-to-request
# latency at 500 events/s, on a throwaway cluster with fsync on.
#
#   bash benches/http.sh
#   BENCH_EVENTS=10000 BENCH_SECONDS=3 bash benches/http.sh     # a short run
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "[bench] building and installing pg_outbox (release)" >&2
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/tmp/pg_outbox-install.log 2>&1 \
  || { cat /tmp/pg_outbox-install.log; exit 1; }
cargo run --quiet --release -p pg_outbox_benches --bin http
