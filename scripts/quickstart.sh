#!/usr/bin/env bash
# Sets up what is missing, builds and installs pg_outbox, starts a throwaway PostgreSQL 15 cluster
# with pg_outbox preloaded (unix socket under /tmp, its own port), and walks through the job end
# to end: raise events in transactions (one rolled back), read them as a consumer, advance the
# cursor, see the horizon. The cluster stays up for you to explore; `stop` removes it.
#
#   bash scripts/quickstart.sh          run it (again: it starts from scratch)
#   bash scripts/quickstart.sh stop     stop the cluster and delete its directory
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cluster.sh

DIR=${PG_OUTBOX_QUICKSTART_DIR:-/tmp/pg_outbox-quickstart}
PORT=${PG_OUTBOX_QUICKSTART_PORT:-54329}

if [ "${1:-}" = stop ]; then
  cluster_stop "$DIR"
  echo "stopped; $DIR removed"
  exit 0
fi

bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "[quickstart] building and installing pg_outbox (release; the first build takes a few minutes)" >&2
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >"/tmp/pg_outbox-install.log" 2>&1 \
  || { cat /tmp/pg_outbox-install.log; exit 1; }

cluster_stop "$DIR"
cluster_start "$DIR" "$PORT" "pg_outbox.database = 'app'"
cluster_psql "$DIR" "$PORT" -d postgres -c "CREATE DATABASE app" >/dev/null

run() { cluster_psql "$DIR" "$PORT" -d app --echo-queries "$@"; }

cat <<'TXT'

== 1. Install the extension (the server was started with shared_preload_libraries = 'pg_outbox')
TXT
run -c "CREATE EXTENSION pg_outbox"
# The workers started before database app existed; wait (10 s at most) until they are connected.
for _ in $(seq 100); do
  n=$(cluster_psql "$DIR" "$PORT" -d app -Atc \
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker' AND datname = 'app'")
  [ "$n" -ge 1 ] && break
  sleep 0.1
done

cat <<'TXT'

== 2. A consumer with its own cursor, starting at the origin of the log
TXT
run -c "SELECT outbox.create_consumer('billing')"

cat <<'TXT'

== 3. Raise events inside application transactions; one transaction rolls back
TXT
run <<'SQL'
BEGIN;
CREATE TABLE orders (id int PRIMARY KEY, amount numeric);
INSERT INTO orders VALUES (42, 150);
SELECT outbox.raise('order.placed', '{"order": 42, "amount": 150}', subject => 'order/42');
COMMIT;

BEGIN;
INSERT INTO orders VALUES (43, 99);
SELECT outbox.raise('order.placed', '{"order": 43, "amount": 99}', subject => 'order/43');
ROLLBACK;

SELECT outbox.raise_many(ARRAY['order.shipped'],
                         ARRAY['{"order": 42, "carrier": "dhl"}', '{"order": 42, "parcel": 2}']::jsonb[],
                         subjects => ARRAY['order/42']);
SQL

cat <<'TXT'

== 4. Read as the consumer: the rolled-back event never existed
TXT
run -c "SELECT position, topic, subject, payload FROM outbox.read('billing', 10)"

cat <<'TXT'

== 5. Advance the cursor past what was handled; a late advance to an older position is refused
TXT
run <<'SQL'
SELECT outbox.advance('billing', (SELECT position FROM outbox.read('billing', 2) OFFSET 1)) AS advanced;
SELECT outbox.advance('billing', (SELECT txid || ':' || seq FROM outbox.events ORDER BY txid, seq LIMIT 1)) AS moved_back;
SELECT position, topic, payload FROM outbox.read('billing', 10);
SQL

cat <<'TXT'

== 6. A SQL sink: the background worker pushes every event to a function, exactly once
TXT
run <<'SQL'
CREATE TABLE shipments (position text, order_id int, carrier text);
CREATE FUNCTION ship(events outbox.event[]) RETURNS void LANGUAGE sql AS $$
  INSERT INTO public.shipments
  SELECT e.position, (e.payload->>'order')::int, e.payload->>'carrier' FROM unnest(events) e
$$;
SELECT outbox.create_sink('shipping', 'ship(outbox.event[])', topics => ARRAY['order.shipped']);
SELECT outbox.raise('order.shipped', '{"order": 44, "carrier": "ups"}');
-- Delivery takes a few milliseconds; wait for it (5 s at most).
DO $$ BEGIN
  FOR i IN 1..500 LOOP
    EXIT WHEN (SELECT count(*) FROM public.shipments) >= 3;
    PERFORM pg_sleep(0.01);
  END LOOP;
END $$;
SELECT * FROM shipments;
SELECT name, kind, position, events_behind, state FROM outbox.status();
SQL

cat <<'TXT'

== 7. The read horizon: nothing is holding delivery back right now
TXT
run -c "SELECT horizon, waiting_events, pid, state FROM outbox.horizon()"

cat <<TXT

pg_outbox is running in a throwaway cluster (data in $DIR, server log $DIR/server.log).
Connect:  psql -h $DIR -p $PORT -U postgres app
Stop:     bash scripts/quickstart.sh stop
TXT
