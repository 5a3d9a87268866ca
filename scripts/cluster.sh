#!/usr/bin/env bash
# A throwaway PostgreSQL 15 cluster with pg_outbox preloaded: unix socket only, its own port, all
# files under one directory. Sourced by the quickstart and the benchmarks.
#
#   cluster_start DIR PORT [extra postgresql.conf lines...]   initdb + start (as postgres if root)
#   cluster_stop DIR                                           stop and delete DIR
#   cluster_psql DIR PORT [psql args...]                       psql as the postgres superuser

PGBIN=${PGBIN:-/usr/lib/postgresql/15/bin}

as_postgres() {
  if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

cluster_start() {
  local dir=$1 port=$2; shift 2
  rm -rf "$dir"
  install -d -m 0700 "$dir"
  if [ "$(id -u)" -eq 0 ]; then chown postgres:postgres "$dir"; fi
  as_postgres "$PGBIN/initdb" -D "$dir/data" -A trust -U postgres --locale=C.UTF-8 -E UTF8 >"$dir/initdb.log"
  {
    echo "listen_addresses = ''"
    echo "unix_socket_directories = '$dir'"
    echo "port = $port"
    echo "shared_preload_libraries = 'pg_outbox'"
    local line
    for line in "$@"; do echo "$line"; done
  } >>"$dir/data/postgresql.conf"
  as_postgres "$PGBIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null
}

cluster_stop() {
  local dir=$1
  if [ -f "$dir/data/postmaster.pid" ]; then
    as_postgres "$PGBIN/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
  fi
  rm -rf "$dir"
}

cluster_psql() {
  local dir=$1 port=$2; shift 2
  psql -X -q -h "$dir" -p "$port" -U postgres -v ON_ERROR_STOP=1 "$@"
}
