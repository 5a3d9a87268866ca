#!/usr/bin/env bash
# Installs what building and testing pg_outbox needs on a fresh Debian 12 machine, as root, with no
# stdin. Idempotent: every step checks first, so a second run takes about a second.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
export PATH="$HOME/.cargo/bin:$PATH"

# cargo-pgrx must equal the pgrx crate version in Cargo.toml; 0.19.x needs rustc 1.96.
PGRX_VERSION=0.18.1
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config

say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  say "run as root (it installs Debian packages; tests run the server as the postgres user)"
  exit 1
fi

need=()
# postgresql-15-pgq3 and pgqd: PgQ, the peer the benchmarks measure pg_outbox against;
# python3-matplotlib draws the benchmark report's charts; prometheus-postgres-exporter is the
# exporter contrib/postgres_exporter/pg_outbox.yaml is written for (the metrics test runs it);
# python3-psycopg runs examples/python/worker.py (the examples test runs it with /usr/bin/python3).
for p in postgresql-15 postgresql-server-dev-15 postgresql-contrib libclang-dev clang pkg-config \
         libssl-dev sudo postgresql-15-pgq3 pgqd python3-matplotlib prometheus-postgres-exporter \
         python3-psycopg; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
# The machine's Node.js and npm run examples/node/worker.js; Debian's only where there are none.
command -v npm >/dev/null || need+=(nodejs npm)
# Java 17 and Maven fetch and run the Apache Kafka broker of the Kafka sink tests (scripts/kafka.sh).
command -v java >/dev/null || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need+=(maven)
if ((${#need[@]})); then
  say "installing Debian packages: ${need[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# The Debian package starts a 'main' cluster on 5432; pg_outbox never uses it. Leave it alone.

# Apache Kafka 4's jars from Maven Central, once, into the cache outside the clone (about 30 s).
source "$(dirname "$0")/kafka.sh"
kafka_install

if ! cargo pgrx --version 2>/dev/null | grep -qx "cargo-pgrx $PGRX_VERSION"; then
  say "installing cargo-pgrx $PGRX_VERSION (about 5 minutes on 2 cores)"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked --quiet
fi

if ! grep -qs "^pg15 = \"$PG_CONFIG\"" "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
  say "cargo pgrx init --pg15 $PG_CONFIG"
  cargo pgrx init --pg15 "$PG_CONFIG" >/dev/null
fi

# The Node.js example's dependencies, as its package-lock.json pins them: installed again when
# the lock file is newer than node_modules (the touch marks when npm ci ran).
node_example="$(cd "$(dirname "$0")/../examples/node" && pwd)"
if [ ! -d "$node_example/node_modules" ] || [ "$node_example/package-lock.json" -nt "$node_example/node_modules" ]; then
  say "npm ci in examples/node"
  (cd "$node_example" && npm ci --no-audit --no-fund --loglevel=error >/dev/null && touch node_modules)
fi

# Postgres refuses root: tests run initdb/pg_ctl as postgres (through sudo) under a short parent
# directory that postgres owns; it is also the unix-socket directory (~100-byte path limit).
install -d -o postgres -g postgres /tmp/pgrx-test-pgdata
say "ready"
