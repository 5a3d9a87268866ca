#!/usr/bin/env bash
# Benchmark: dispatch throughput into a table sink (batch 128 and 1000) and commit-to-handler
# latency (steady 500 events/s, and saturation) on a throwaway cluster with fsync on.
#
#   bash benches/dispatch.sh
#   BENCH_EVENTS=20000 BENCH_SECONDS=3 bash benches/dispatch.sh     # a short run
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "[bench] building and installing pg_outbox (release)" >&2
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/tmp/pg_outbox-install.log 2>&1 \
  || { cat /tmp/pg_outbox-install.log; exit 1; }
cargo run --quiet --release -p pg_outbox_benches --bin dispatch
