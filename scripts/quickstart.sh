#!/usr/bin/env bash
# Sets up what is missing, builds and installs pg_outbox, starts a throwaway PostgreSQL 15 cluster
# with pg_outbox preloaded (unix socket under /tmp, its own port), and walks through the job end
# to end: raise events in transactions (one rolled back), read them as a consumer, advance the
# cursor, deliver to a SQL sink, see the horizon, fan events out through a filtered subscription
# to a SQL handler, post them to an HTTP endpoint on loopback, install pg_outbox in a second
# database that gets delivery with no setting, and (when Java and the Kafka jars scripts/setup.sh
# fetches are there) deliver into an Apache Kafka broker on loopback. The cluster stays up for you
# to explore; `stop` removes it (and the broker).
#
#   bash scripts/quickstart.sh          run it (again: it starts from scratch)
#   bash scripts/quickstart.sh stop     stop the cluster and delete its directory
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cluster.sh
source scripts/kafka.sh

DIR=${PG_OUTBOX_QUICKSTART_DIR:-/tmp/pg_outbox-quickstart}
PORT=${PG_OUTBOX_QUICKSTART_PORT:-54329}

HOOK_PORT=${PG_OUTBOX_QUICKSTART_HOOK_PORT:-54330}
# The broker listens on KAFKA_PORT and its controller on KAFKA_PORT + 1.
KAFKA_PORT=${PG_OUTBOX_QUICKSTART_KAFKA_PORT:-54331}

stop_receiver() {
  if [ -f "$DIR/receiver.pid" ]; then kill "$(cat "$DIR/receiver.pid")" 2>/dev/null || true; fi
}

if [ "${1:-}" = stop ]; then
  stop_receiver
  [ -d "$DIR/kafka" ] && kafka_stop "$DIR/kafka"
  cluster_stop "$DIR"
  echo "stopped; $DIR removed"
  exit 0
fi

bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "[quickstart] building and installing pg_outbox (release; the first build takes a few minutes)" >&2
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >"/tmp/pg_outbox-install.log" 2>&1 \
  || { cat /tmp/pg_outbox-install.log; exit 1; }

stop_receiver
[ -d "$DIR/kafka" ] && kafka_stop "$DIR/kafka"
cluster_stop "$DIR"
# HTTP and Kafka sinks refuse plain http:// and loopback addresses unless a superuser allows
# them: the endpoint of step 9 is a receiver on 127.0.0.1, the broker of step 11 too.
cluster_start "$DIR" "$PORT" "pg_outbox.http_allow_plain = on" "pg_outbox.http_allow_private = on" \
  "pg_outbox.kafka_allow_private = on"
cluster_psql "$DIR" "$PORT" -d postgres -c "CREATE DATABASE app" >/dev/null

run() { cluster_psql "$DIR" "$PORT" -d app --echo-queries "$@"; }

cat <<'TXT'

== 1. Install the extension (the server was started with shared_preload_libraries = 'pg_outbox')
TXT
run -c "CREATE EXTENSION pg_outbox"
# No setting names the database: the launcher starts its workers when CREATE EXTENSION commits.
wait_for_worker() {
  for _ in $(seq 100); do
    n=$(cluster_psql "$DIR" "$PORT" -d postgres -Atc \
          "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker' AND datname = '$1'")
    [ "$n" -ge 1 ] && return 0
    sleep 0.1
  done
  echo "no pg_outbox worker in database $1 after 10 s; see $DIR/server.log" >&2
  exit 1
}
wait_for_worker app
run -c "SELECT pid, backend_type, datname, application_name FROM pg_stat_activity WHERE backend_type LIKE 'pg_outbox%'"

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

cat <<'TXT'

== 8. A subscription with a CEL filter and a SQL handler: one job per matching event
TXT
run <<'SQL'
CREATE TABLE big_orders (order_id int, amount numeric);
CREATE FUNCTION flag_big(e outbox.event) RETURNS void LANGUAGE sql AS $$
  INSERT INTO public.big_orders VALUES ((e.payload->>'order')::int, (e.payload->>'amount')::numeric)
$$;
SELECT outbox.subscribe('big-orders', '{order.placed}', handler => 'flag_big(outbox.event)',
                        filter => 'payload.amount > 100', start_at => 'now');
SELECT outbox.raise('order.placed', '{"order": 50, "amount": 20}');
SELECT outbox.raise('order.placed', '{"order": 51, "amount": 480}');
DO $$ BEGIN
  FOR i IN 1..500 LOOP
    EXIT WHEN (SELECT count(*) FROM public.big_orders) >= 1
          AND (SELECT skipped FROM outbox.status() WHERE name = 'big-orders') >= 1;
    PERFORM pg_sleep(0.01);
  END LOOP;
END $$;
SELECT * FROM big_orders;
SELECT name, kind, state, matched, skipped FROM outbox.status() WHERE name = 'big-orders';
SQL

cat <<'TXT'

== 9. An HTTP sink: signed CloudEvents batches POSTed to a receiver on 127.0.0.1
TXT
cat >"$DIR/receiver.py" <<'PY'
import http.server, sys
class Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(sys.argv[2], "ab") as f:
            f.write(body + b"\n")
        self.send_response(204)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Hook).serve_forever()
PY
python3 "$DIR/receiver.py" "$HOOK_PORT" "$DIR/received.jsonl" >/dev/null 2>&1 &
echo $! >"$DIR/receiver.pid"
run <<SQL
SELECT outbox.create_http_sink('shipping-hook', 'http://127.0.0.1:$HOOK_PORT/hooks/outbox',
         topics => ARRAY['order.shipped'], secret => 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw', start_at => 'now');
SELECT outbox.raise('order.shipped', '{"order": 51, "carrier": "fedex"}', subject => 'order/51');
SQL
for _ in $(seq 100); do
  [ -s "$DIR/received.jsonl" ] && break
  sleep 0.1
done
echo "-- the receiver got:"
cat "$DIR/received.jsonl" 2>/dev/null || { echo "nothing after 10 s; see $DIR/server.log" >&2; exit 1; }
run -c "SELECT name, kind, events_behind, state FROM outbox.status() WHERE name = 'shipping-hook'"

cat <<'TXT'

== 10. A second database: CREATE EXTENSION there, and it gets delivery too, with no setting
TXT
cluster_psql "$DIR" "$PORT" -d postgres -c "CREATE DATABASE shop" >/dev/null
cluster_psql "$DIR" "$PORT" -d shop --echo-queries <<'SQL'
CREATE EXTENSION pg_outbox;
CREATE TABLE audit (topic text, at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION record(events outbox.event[]) RETURNS void LANGUAGE sql AS $$
  INSERT INTO public.audit (topic) SELECT e.topic FROM unnest(events) e
$$;
SELECT outbox.create_sink('audit', 'record(outbox.event[])');
SELECT outbox.raise('cart.checked_out', '{"cart": 7}');
DO $$ BEGIN
  FOR i IN 1..500 LOOP
    EXIT WHEN (SELECT count(*) FROM public.audit) >= 1;
    PERFORM pg_sleep(0.01);
  END LOOP;
END $$;
SELECT topic FROM audit;
SQL
run -c "SELECT datname, count(*) AS workers FROM pg_stat_activity WHERE backend_type = 'pg_outbox worker' GROUP BY datname ORDER BY datname"

cat <<'TXT'

== 11. A Kafka sink: the log delivered into Apache Kafka, one message per event, keyed by subject
TXT
if command -v java >/dev/null && kafka_lib >/dev/null 2>&1; then
  echo "-- starting a one-node Kafka broker on 127.0.0.1:$KAFKA_PORT (KRaft; its files in $DIR/kafka)"
  kafka_start "$DIR/kafka" "$KAFKA_PORT"
  kafka_topic "$DIR/kafka" "$KAFKA_PORT" shop.order.placed 3
  run <<SQL
SELECT outbox.create_kafka_sink('to-kafka', '127.0.0.1:$KAFKA_PORT', kafka_topic => 'shop.{topic}',
         topics => ARRAY['order.placed'], start_at => 'now');
BEGIN;
SELECT outbox.raise('order.placed', '{"order": 61, "amount": 20}', subject => 'order/61');
SELECT outbox.raise('order.placed', '{"order": 62, "amount": 35}', subject => 'order/62');
COMMIT;
SELECT outbox.raise('order.placed', '{"order": 61, "amount": 25}', subject => 'order/61');
SQL
  echo "-- a Kafka consumer reads them (key, CloudEvents headers, value):"
  kafka_tool org.apache.kafka.tools.consumer.ConsoleConsumer --bootstrap-server "127.0.0.1:$KAFKA_PORT" \
    --topic shop.order.placed --from-beginning --max-messages 3 --timeout-ms 30000 \
    --formatter-property print.key=true --formatter-property print.headers=true \
    --formatter-property print.partition=true
  run -c "SELECT name, kind, events_behind, state FROM outbox.status() WHERE name = 'to-kafka'"
else
  echo "-- skipped: no Java 17, or no Kafka jars (scripts/setup.sh fetches them where Maven Central is reachable)"
fi

cat <<TXT

pg_outbox is running in a throwaway cluster (data in $DIR, server log $DIR/server.log).
Connect:  psql -h $DIR -p $PORT -U postgres app
Stop:     bash scripts/quickstart.sh stop
TXT
