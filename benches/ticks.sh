#!/usr/bin/env bash
# Benchmark: what ticks cost (issue 15), on one throwaway cluster (fsync on), the workers idle
# (pg_outbox.enabled off) so that this script alone ticks and reads. Prints:
#   - raise at 8 clients alone, and while one client takes ticks flat out (asynchronous commit,
#     as the workers take them): the ratio, and ticks taken per second
#   - reading the same events in ticks of 100 (one _tick_log per batch) against the read rule
#     (_read_log in pages of 1,000): microseconds per event, and the ratio
#   - taking a tick and reading a batch of 100 while a transaction that raised 100,000 events is
#     still open, against the same with no such transaction: a long transaction is not scanned
#     again at every tick
#   - the cost of one tick from a client: after a one-event commit, and with nothing raised since
# With BENCH_JSON=<file>, each figure is also appended to <file> as a JSON line (for the report).
#
#   bash benches/ticks.sh                     # 10 s per measurement
#   BENCH_SECONDS=2 BENCH_EVENTS=10000 bash benches/ticks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cluster.sh

SECONDS_PER=${BENCH_SECONDS:-10}
EVENTS=${BENCH_EVENTS:-100000}
DIR=/tmp/pg_outbox-bench-ticks.$$
PORT=$((30000 + $$ % 20000))

source benches/lib.sh
bench_prepare

trap 'cluster_stop "$DIR"' EXIT
cluster_start "$DIR" "$PORT" "shared_buffers = '1GB'" "max_wal_size = '4GB'" "checkpoint_timeout = '30min'" \
  "pg_outbox.enabled = off"
cluster_psql "$DIR" "$PORT" -d postgres -c "CREATE DATABASE bench" >/dev/null
psql_bench() { cluster_psql "$DIR" "$PORT" -d bench "$@"; }
psql_bench -c "CREATE EXTENSION pg_outbox" -c "SELECT outbox.raise('first')" >/dev/null

W=$DIR/scripts
mkdir -p "$W"
echo "SELECT outbox.raise('order.placed', '{\"order\": 42, \"amount\": 150.5}', subject => 'order/42');" >"$W/raise.sql"
echo "SELECT outbox._tick();" >"$W/tick.sql"

# tps of one pgbench run of $1 with $2 clients for $3 seconds (extra options after).
tps() {
  local script=$1 clients=$2 seconds=$3
  shift 3
  pgbench -h "$DIR" -p "$PORT" -U postgres -n -M prepared -c "$clients" -j "$clients" -T "$seconds" \
    "$@" -f "$W/$script" bench 2>&1 | awk '/^tps = / { printf "%.0f", $3; exit }'
}

json() { [ -z "${BENCH_JSON:-}" ] || echo "$1" >>"$BENCH_JSON"; }

# Stops with a message when a figure is missing or not above zero (it divides a ratio).
need() {
  awk -v x="${1:-}" 'BEGIN { exit !(x + 0 > 0) }' || { echo "ticks.sh: no figure for $2 ('${1:-}')" >&2; exit 1; }
}

printf '\npg_outbox ticks benchmark: PostgreSQL %s, %s cores, fsync on, %s s per measurement\n\n' \
  "$(psql_bench -Atc 'SHOW server_version')" "$(nproc)" "$SECONDS_PER"

# 1. Raise with and without a ticker.
psql_bench -c "CHECKPOINT" >/dev/null
alone=$(tps raise.sql 8 "$SECONDS_PER")
need "$alone" "raise alone"
ticks_before=$(psql_bench -Atc "SELECT count(*) FROM outbox.ticks")
PGOPTIONS='-c synchronous_commit=off' tps tick.sql 1 "$SECONDS_PER" >/dev/null &
ticker=$!
ticked=$(tps raise.sql 8 "$SECONDS_PER")
wait "$ticker"
need "$ticked" "raise with a ticker"
ticks_taken=$(($(psql_bench -Atc "SELECT count(*) FROM outbox.ticks") - ticks_before))
ratio=$(awk -v a="$ticked" -v b="$alone" 'BEGIN { printf "%.2f", a / b }')
printf '%-58s %12s\n' "raise, 8 clients, events/s" "$alone"
printf '%-58s %12s\n' "raise, 8 clients, one client ticking flat out, events/s" "$ticked"
printf '%-58s %12s\n' "  ratio" "$ratio"
printf '%-58s %12s\n' "ticks taken per second meanwhile" "$((ticks_taken / SECONDS_PER))"
json "{\"ratio\": \"raise at 8 clients while ticks are taken flat out / raise alone\", \"value\": $ratio, \"target\": null}"
json "{\"chart\": \"tick_cost\", \"title\": \"raise at 8 clients, with a ticker\", \"unit\": \"events/s\", \"series\": \"raise\", \"x\": \"alone\", \"y\": $alone}"
json "{\"chart\": \"tick_cost\", \"title\": \"raise at 8 clients, with a ticker\", \"unit\": \"events/s\", \"series\": \"raise\", \"x\": \"one client ticking\", \"y\": $ticked}"

# 2. Reading by ticks against the read rule: EVENTS events, committed and ticked 100 at a time.
psql_bench >/dev/null <<SQL
TRUNCATE outbox.events, outbox.ticks;
CREATE PROCEDURE fill(n int) LANGUAGE plpgsql AS \$\$
BEGIN
    FOR i IN 1 .. n / 100 LOOP
        PERFORM outbox.raise_many(ARRAY['order.placed'],
                                  (SELECT array_agg(jsonb_build_object('order', j, 'amount', 150.5))
                                     FROM generate_series(1, 100) j));
        COMMIT;
        PERFORM outbox._tick();
        COMMIT;
    END LOOP;
END \$\$;
CALL fill($EVENTS);
VACUUM ANALYZE outbox.events;
CREATE FUNCTION read_rule_us() RETURNS float8 LANGUAGE plpgsql AS \$\$
DECLARE
    t timestamptz := clock_timestamp();
    a xid8 := '0';
    s bigint := 0;
    n bigint := 0;
    r record;
    got int;
BEGIN
    LOOP
        got := 0;
        FOR r IN SELECT l.txid, l.seq FROM outbox._read_log(a, s, 1000) l LOOP
            a := r.txid; s := r.seq; got := got + 1;
        END LOOP;
        n := n + got;
        EXIT WHEN got < 1000;
    END LOOP;
    RETURN extract(epoch FROM clock_timestamp() - t) * 1e6 / greatest(n, 1);
END \$\$;
CREATE FUNCTION ticks_us() RETURNS float8 LANGUAGE plpgsql AS \$\$
DECLARE
    t timestamptz := clock_timestamp();
    b record;
    r record;
    n bigint := 0;
BEGIN
    -- Each batch as a reader reads it from its start: one range of the log when it is one
    -- (outbox._batch_range), both its parts otherwise.
    FOR b IN SELECT coalesce(lag(k.snapshot) OVER (ORDER BY k.tick), '1:1:') AS since, k.snapshot AS upto
               FROM outbox.ticks k ORDER BY k.tick LOOP
        SELECT * INTO r FROM outbox._batch_range(b.since::text, b.upto::text, '0', 0);
        IF FOUND THEN
            n := n + (SELECT count(*) FROM outbox._range_log(r.after_txid::xid8, r.after_seq, r.below::xid8,
                                                             r.running::pg_snapshot, 1000));
        ELSE
            n := n + (SELECT count(*) FROM outbox._snapshot_log(b.since, b.upto, '0', 0, 1000));
        END IF;
    END LOOP;
    RETURN extract(epoch FROM clock_timestamp() - t) * 1e6 / greatest(n, 1);
END \$\$;
SQL
# Twice each, the second counted (the first warms the cache and the plans).
psql_bench -Atc "SELECT read_rule_us(), ticks_us()" >/dev/null
figures=$(psql_bench -AtF ' ' -c "SELECT round(read_rule_us()::numeric, 3), round(ticks_us()::numeric, 3)")
read -r rule_us ticks_us <<<"$figures"
need "$rule_us" "reading by the read rule"
need "$ticks_us" "reading by ticks"
ratio=$(awk -v a="$ticks_us" -v b="$rule_us" 'BEGIN { printf "%.2f", a / b }')
printf '%-58s %12s\n' "read $EVENTS events, read rule in pages of 1,000, us/event" "$rule_us"
printf '%-58s %12s\n' "read them by ticks of 100, batch by batch, us/event" "$ticks_us"
printf '%-58s %12s\n' "  ratio (at most)" "$ratio"
json "{\"ratio\": \"reading by ticks of 100 / the read rule, time per event (at most)\", \"value\": $ratio, \"target\": null}"

# 3. A transaction that raised 100,000 events and is still open: taking a tick and reading a
# batch of 100 cost what they cost without it.
cat >"$W/step.sql" <<'SQL'
SELECT outbox.raise_many(ARRAY['order.placed'], (SELECT array_agg(jsonb_build_object('order', j)) FROM generate_series(1, 100) j));
SELECT outbox._tick() AS t \gset
SELECT count(*) FROM outbox._tick_log(outbox._tick_before(:t), :t, '0', 0, 1000);
SQL
step_ms() {
  pgbench -h "$DIR" -p "$PORT" -U postgres -n -c 1 -T "$SECONDS_PER" -f "$W/step.sql" bench 2>&1 |
    awk '/^latency average = / { print $4; exit }'
}
without=$(step_ms)
need "$without" "a step alone"
psql_bench -c "BEGIN" \
  -c "SELECT outbox.raise_many(ARRAY['long'], (SELECT array_agg(jsonb_build_object('i', i)) FROM generate_series(1, 100000) i))" \
  -c "SELECT pg_sleep($SECONDS_PER + 3)" -c "COMMIT" >/dev/null &
long=$!
# Measured once the long transaction has raised its events and sleeps.
for _ in $(seq 1 600); do
  [ "$(psql_bench -Atc "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(%' AND state = 'active'")" -gt 0 ] && break
  sleep 0.1
done
with=$(step_ms)
wait "$long"
need "$with" "a step beside the long transaction"
ratio=$(awk -v a="$with" -v b="$without" 'BEGIN { printf "%.2f", a / b }')
printf '%-58s %12s\n' "raise 100 + tick + read the batch, ms" "$without"
printf '%-58s %12s\n' "  the same while 100,000 events wait in an open transaction" "$with"
printf '%-58s %12s\n' "  ratio" "$ratio"
json "{\"ratio\": \"tick and read a batch while a transaction holds 100,000 events / without (at most)\", \"value\": $ratio, \"target\": 1.2}"

# 4. The cost of a tick, committed asynchronously as the workers commit theirs, from pgbench's
# per-statement latencies (a client's round trip and the commit included; a worker calls it in
# its own process): after a one-event transaction (a tick is taken), and with nothing committed
# since the last but the last tick's own transaction (none is taken: the tick reads that one
# transaction's range of the log and finds no event).
psql_bench -c "TRUNCATE outbox.events, outbox.ticks" -c "SELECT outbox.raise('first')" -c "CHECKPOINT" >/dev/null
printf 'SELECT outbox.raise(\x27order.placed\x27);\nSELECT outbox._tick();\n' >"$W/raise_tick.sql"
# The microseconds of the script's line $2 (1-based) over a run of script $1.
line_us() {
  PGOPTIONS='-c synchronous_commit=off' pgbench -h "$DIR" -p "$PORT" -U postgres -n -M prepared -r -c 1 \
    -T "$SECONDS_PER" -f "$W/$1" bench 2>&1 |
    awk -v want="$2" '/statement latencies in milliseconds/ { on = 1; next } on && /^ +[0-9.]+ / { if (++n == want) { printf "%.0f", $1 * 1000; exit } }'
}
taken=$(line_us raise_tick.sql 2)
need "$taken" "a tick after a raise"
empty=$(line_us tick.sql 1)
need "$empty" "a tick with nothing to take"
printf '%-58s %12s\n' "a tick after a one-event commit, client round trip, us" "$taken"
printf '%-58s %12s\n' "a tick with nothing raised since the last (none taken), us" "$empty"
json "{\"chart\": \"tick_cost_us\", \"title\": \"the cost of a tick\", \"unit\": \"us\", \"series\": \"tick\", \"x\": \"after a one-event commit\", \"y\": $taken}"
json "{\"chart\": \"tick_cost_us\", \"title\": \"the cost of a tick\", \"unit\": \"us\", \"series\": \"tick\", \"x\": \"nothing raised since\", \"y\": $empty}"
echo
