#!/usr/bin/env bash
# Builds and installs the release build of pg_outbox, then runs one benchmark binary of
# benches/src/bin (each starts and stops its own throwaway cluster).
#
#   bash benches/run.sh dispatch|http|filter|subscriptions
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: bash benches/run.sh dispatch|http|filter|subscriptions}
bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "[bench] building and installing pg_outbox (release)" >&2
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/tmp/pg_outbox-install.log 2>&1 \
  || { cat /tmp/pg_outbox-install.log; exit 1; }
cargo run --quiet --release -p pg_outbox_benches --bin "$bin"
