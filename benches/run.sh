#!/usr/bin/env bash
# Builds and installs the release build of pg_outbox, then runs one benchmark binary of
# benches/src/bin (each starts and stops its own throwaway cluster).
#
#   bash benches/run.sh dispatch|http|filter|subscriptions|kafka
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: bash benches/run.sh dispatch|http|filter|subscriptions|kafka}
source benches/lib.sh
bench_prepare
bench_bin "$bin"
