# Sourced by the benchmark scripts: sets up what is missing and installs the build to measure.
#
#   BENCH_INSTALLED=1   measure the pg_outbox already installed (the report's short run uses the
#                       test build scripts/test.sh installed, and skips a release build)
#   BENCH_DEBUG=1       build the benchmark binaries without --release (quicker to compile)

bench_prepare() {
  bash scripts/setup.sh
  export PATH="$HOME/.cargo/bin:$PATH"
  if [ -n "${BENCH_INSTALLED:-}" ]; then
    return
  fi
  echo "[bench] building and installing pg_outbox (release)" >&2
  cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/tmp/pg_outbox-install.log 2>&1 \
    || { cat /tmp/pg_outbox-install.log; exit 1; }
}

# Runs one benchmark binary of benches/src/bin.
bench_bin() {
  local profile=--release
  [ -n "${BENCH_DEBUG:-}" ] && profile=
  cargo run --quiet $profile -p pg_outbox_benches --bin "$1"
}
