#!/usr/bin/env bash
# Benchmark: outbox.raise against a plain INSERT into a table of the same shape, indexes and
# constraints, in one run on one throwaway cluster (fsync on, as in production). Prints events/s
# and the ratio raise/INSERT for:
#   - one event per transaction, 1, 8 and 32 clients (pgbench, prepared statements)
#   - 1,000 events per transaction (raise_many vs a multi-row INSERT), 1 and 2 clients
#   - the same against PgQ's pgq.insert_event (Debian postgresql-15-pgq3), the closest peer
#   - one event per transaction while the events are consumed: raise with a SQL sink delivering
#     them, against pgq.insert_event with PgQ's consumer running, and a plain INSERT alone
# With BENCH_JSON=<file>, each figure is also appended to <file> as a JSON line (for the report).
# Rounds alternate between the two sides so drift on a shared machine hits both alike.
#
#   bash benches/raise.sh                 # 10 s per measurement, 2 rounds
#   BENCH_SECONDS=3 BENCH_ROUNDS=1 bash benches/raise.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cluster.sh

SECONDS_PER=${BENCH_SECONDS:-10}
ROUNDS=${BENCH_ROUNDS:-2}
DIR=/tmp/pg_outbox-bench.$$
PORT=$((30000 + $$ % 20000))

source benches/lib.sh
bench_prepare

trap 'cluster_stop "$DIR"' EXIT
cluster_start "$DIR" "$PORT" "shared_buffers = '1GB'" "max_wal_size = '4GB'" "checkpoint_timeout = '30min'"
cluster_psql "$DIR" "$PORT" -d postgres -c "CREATE DATABASE bench" >/dev/null
psql_bench() { cluster_psql "$DIR" "$PORT" -d bench "$@"; }

psql_bench <<'SQL' >/dev/null
CREATE EXTENSION pg_outbox;
CREATE EXTENSION pgq;
SELECT pgq.create_queue('bench');
-- The baseline: outbox.events' shape, defaults, constraints and single index, written directly.
CREATE SCHEMA plain;
CREATE SEQUENCE plain.events_seq AS bigint CACHE 64;
CREATE TABLE plain.events (
    txid      xid8        NOT NULL DEFAULT pg_current_xact_id(),
    seq       bigint      NOT NULL DEFAULT nextval('plain.events_seq'),
    id        uuid        NOT NULL DEFAULT gen_random_uuid(),
    topic     text        NOT NULL,
    subject   text,
    tenant    text,
    payload   jsonb       NOT NULL,
    headers   jsonb       NOT NULL DEFAULT '{}',
    raised_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (txid, seq),
    CHECK (jsonb_typeof(payload) = 'object'),
    CHECK (jsonb_typeof(headers) = 'object')
);
SQL

W=$DIR/scripts
mkdir -p "$W"
PAYLOAD='{"order": 42, "amount": 150.5, "currency": "EUR", "customer": "c-1234"}'
echo "SELECT outbox.raise('order.placed', '$PAYLOAD', subject => 'order/42');" >"$W/raise.sql"
echo "INSERT INTO plain.events (topic, subject, payload) VALUES ('order.placed', 'order/42', '$PAYLOAD');" >"$W/insert.sql"
cat >"$W/raise_many.sql" <<'SQL'
SELECT outbox.raise_many(ARRAY['order.placed'],
       array_agg(jsonb_build_object('order', i, 'amount', 150.5, 'currency', 'EUR'))) FROM generate_series(1, 1000) i;
SQL
cat >"$W/insert_many.sql" <<'SQL'
INSERT INTO plain.events (topic, payload)
SELECT 'order.placed', jsonb_build_object('order', i, 'amount', 150.5, 'currency', 'EUR') FROM generate_series(1, 1000) i;
SQL
echo "SELECT pgq.insert_event('bench', 'order.placed', '$PAYLOAD');" >"$W/pgq.sql"
cat >"$W/pgq_many.sql" <<'SQL'
SELECT count(pgq.insert_event('bench', 'order.placed', jsonb_build_object('order', i, 'amount', 150.5, 'currency', 'EUR')::text))
  FROM generate_series(1, 1000) i;
SQL

# events/s of one pgbench run: tps times events per transaction.
measure() {
  local script=$1 clients=$2 per_tx=$3
  psql_bench -c "TRUNCATE outbox.events, plain.events" -c "CHECKPOINT" >/dev/null
  local tps
  tps=$(pgbench -h "$DIR" -p "$PORT" -U postgres -n -M prepared -c "$clients" -j "$clients" \
          -T "$SECONDS_PER" -f "$W/$script" bench 2>&1 |
        awk '/^tps = / { print $3; exit }')
  [ -n "$tps" ] || { echo "pgbench $script failed" >&2; exit 1; }
  awk -v t="$tps" -v n="$per_tx" 'BEGIN { printf "%.0f", t * n }'
}

# Alternates the two scripts ROUNDS times; prints the mean events/s of each.
compare() {
  local ours=$1 theirs=$2 clients=$3 per_tx=$4
  local a=0 b=0 r
  for ((r = 0; r < ROUNDS; r++)); do
    a=$((a + $(measure "$ours" "$clients" "$per_tx")))
    b=$((b + $(measure "$theirs" "$clients" "$per_tx")))
  done
  echo "$((a / ROUNDS)) $((b / ROUNDS))"
}

printf '\npg_outbox raise benchmark: PostgreSQL %s, %s cores, fsync on, %s s x %s rounds per figure\n\n' \
  "$(psql_bench -Atc 'SHOW server_version')" "$(nproc)" "$SECONDS_PER" "$ROUNDS"
printf '%-44s %8s %14s %14s %8s\n' "case" "clients" "pg_outbox/s" "plain/s" "ratio"
row() {
  local label=$1 ours=$2 theirs=$3 clients=$4 per_tx=$5 baseline=$6 chart=$7
  read -r a b < <(compare "$ours" "$theirs" "$clients" "$per_tx")
  local ratio
  ratio=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }')
  printf '%-44s %8s %14s %14s %8s\n' "$label" "$clients" "$a" "$b" "$ratio"
  if [ -n "${BENCH_JSON:-}" ]; then
    # For benches/report.py: both figures on one chart per case, and the ratio.
    local title="$label"
    printf '{"chart": "%s", "title": "%s", "unit": "events/s", "series": "pg_outbox", "x": "%s clients", "y": %s}\n' \
      "$chart" "$title" "$clients" "$a" >>"$BENCH_JSON"
    printf '{"chart": "%s", "title": "%s", "unit": "events/s", "series": "%s", "x": "%s clients", "y": %s}\n' \
      "$chart" "$title" "$baseline" "$clients" "$b" >>"$BENCH_JSON"
    printf '{"ratio": "%s, %s clients", "value": %s, "target": %s}\n' "$label" "$clients" "$ratio" \
      "$(case "$chart,$clients" in raise_insert_other,8) echo 0.95 ;; raise_insert,8) echo 0.9 ;; raise_pgq,8) echo 1.15 ;; *) echo null ;; esac)" >>"$BENCH_JSON"
  fi
}
for clients in 1 8 32; do
  row "1 event/tx: raise vs INSERT" raise.sql insert.sql "$clients" 1 "plain INSERT" raise_insert
done
row "1000 events/tx: raise_many vs multi-row INSERT" raise_many.sql insert_many.sql 1 1000 "plain INSERT" raise_many_insert
row "1000 events/tx: raise_many vs multi-row INSERT" raise_many.sql insert_many.sql 2 1000 "plain INSERT" raise_many_insert
for clients in 1 8 32; do
  row "1 event/tx: raise vs pgq.insert_event" raise.sql pgq.sql "$clients" 1 "PgQ" raise_pgq
done
row "1000 events/tx: raise_many vs pgq.insert_event" raise_many.sql pgq_many.sql 1 1000 "PgQ" raise_many_pgq

# A sink with nothing to deliver in another database: commits here must not wake its workers
# (they once ran a pass for every commit anywhere in the cluster: raise fell to 0.43 of INSERT).
cluster_psql "$DIR" "$PORT" -d postgres -c "CREATE DATABASE other" >/dev/null
cluster_psql "$DIR" "$PORT" -d other >/dev/null <<'SQL'
CREATE EXTENSION pg_outbox;
CREATE FUNCTION public.take(e outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$ BEGIN END $$;
SELECT outbox.create_sink('idle', 'public.take(outbox.event[])', start_at => 'now');
SQL
# Its worker is up (it counts the sink) before the measurement.
for _ in $(seq 1 100); do
  [ "$(cluster_psql "$DIR" "$PORT" -d other -Atc "SELECT count(*) FROM pg_stat_activity WHERE datname = 'other' AND backend_type LIKE 'pg_outbox%'")" -gt 0 ] && break
  sleep 0.1
done
row "1 event/tx, an idle sink in another database: raise vs INSERT" raise.sql insert.sql 8 1 "plain INSERT" raise_insert_other
cluster_psql "$DIR" "$PORT" -d other -c "SELECT outbox.drop_sink('idle')" >/dev/null

# While the events are consumed: raise with a SQL sink delivering them, against pgq.insert_event
# with PgQ's consumer running (ticks made by the consumer itself, more often than pgqd would), and
# against a plain INSERT with nothing consuming. The sink's handler and the PgQ consumer take each
# batch and do nothing with it, so what is measured is what consuming costs the writers.
psql_bench <<'SQL' >/dev/null
CREATE SCHEMA sink;
CREATE FUNCTION sink.take(e outbox.event[]) RETURNS void LANGUAGE plpgsql AS $$ BEGIN END $$;
SELECT outbox.create_sink('take', 'sink.take(outbox.event[])', start_at => 'now');
SELECT outbox.pause_sink('take');
SELECT pgq.register_consumer('bench', 'take');
CREATE PROCEDURE sink.pgq_consume(seconds float8) LANGUAGE plpgsql AS $$
DECLARE
    b bigint;
    stop timestamptz := clock_timestamp() + seconds * interval '1 second';
BEGIN
    WHILE clock_timestamp() < stop LOOP
        PERFORM pgq.ticker();
        COMMIT;
        b := pgq.next_batch('bench', 'take');
        IF b IS NULL THEN
            PERFORM pg_sleep(0.005);
        ELSE
            PERFORM count(*) FROM pgq.get_batch_events(b);
            PERFORM pgq.finish_batch(b);
        END IF;
        COMMIT;
    END LOOP;
END $$;
SQL
consumed() {
  local clients=$1 a=0 b=0 c=0 r pid
  for ((r = 0; r < ROUNDS; r++)); do
    psql_bench -c "SELECT outbox.resume_sink('take')" >/dev/null
    a=$((a + $(measure raise.sql "$clients" 1)))
    psql_bench -c "SELECT outbox.pause_sink('take')" >/dev/null
    psql_bench -c "CALL sink.pgq_consume($SECONDS_PER + 5)" >/dev/null &
    pid=$!
    b=$((b + $(measure pgq.sql "$clients" 1)))
    wait "$pid"
    c=$((c + $(measure insert.sql "$clients" 1)))
  done
  a=$((a / ROUNDS)) b=$((b / ROUNDS)) c=$((c / ROUNDS))
  local label="1 event/tx, consumed meanwhile"
  printf '%-44s %8s %14s %14s %8s\n' "consumed: raise+sink vs PgQ+consumer" "$clients" "$a" "$b" \
    "$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }')"
  printf '%-44s %8s %14s %14s %8s\n' "consumed: raise+sink vs INSERT alone" "$clients" "$a" "$c" \
    "$(awk -v a="$a" -v c="$c" 'BEGIN { printf "%.2f", a / c }')"
  if [ -n "${BENCH_JSON:-}" ]; then
    printf '{"chart": "raise_consumed", "title": "%s", "unit": "events/s", "series": "%s", "x": "%s clients", "y": %s}\n' \
      "$label" "pg_outbox, a sink delivering" "$clients" "$a" >>"$BENCH_JSON"
    printf '{"chart": "raise_consumed", "title": "%s", "unit": "events/s", "series": "%s", "x": "%s clients", "y": %s}\n' \
      "$label" "PgQ, its consumer running" "$clients" "$b" >>"$BENCH_JSON"
    printf '{"chart": "raise_consumed", "title": "%s", "unit": "events/s", "series": "%s", "x": "%s clients", "y": %s}\n' \
      "$label" "plain INSERT, nothing consuming" "$clients" "$c" >>"$BENCH_JSON"
    printf '{"ratio": "%s: raise vs pgq.insert_event, %s clients", "value": %s, "target": null}\n' "$label" "$clients" \
      "$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }')" >>"$BENCH_JSON"
  fi
}
for clients in 1 8; do
  consumed "$clients"
done
echo
