-- Bad input catalogue: every public function of pg_outbox called with NULLs, empty strings,
-- overlong names, malformed positions and intervals, unknown sinks and queues, wrong handler
-- signatures, invalid CEL, invalid zones and hostile identifiers. Each call must give its
-- documented error (README, "SQL reference": 22004 NULL, 22023 out of bounds, 22P02 malformed
-- position, 42602 bad name, 42704 unknown, 42710 exists, 42809 wrong kind, 42P13 bad handler,
-- 42883 no such handler, 42501 not allowed), and afterwards the extension's tables must be
-- exactly as the fixtures left them.
--
-- Calls the documentation says are accepted (a no-op, or an edge the workers judge later) run
-- inside BEGIN ... ROLLBACK so that they cannot change the tables. Nothing printed may depend on
-- the run: no ids, positions, timestamps or pids.

-- ===================================================================================== fixtures
CREATE FUNCTION public.good_sink(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.good_job(e outbox.event) RETURNS void LANGUAGE sql AS $$ SELECT $$;
-- Handlers with the wrong shape.
CREATE FUNCTION public.no_args() RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.text_arg(t text) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.two_args(events outbox.event[], n integer) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.two_args_job(e outbox.event, n integer) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.defaulted(events outbox.event[], n integer DEFAULT 0) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE PROCEDURE public.a_procedure(events outbox.event[]) LANGUAGE sql AS $$ SELECT $$;
CREATE PROCEDURE public.a_procedure_job(e outbox.event) LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.a_set(events outbox.event[]) RETURNS SETOF integer LANGUAGE sql AS $$ SELECT 1 $$;
CREATE FUNCTION public.a_set_job(e outbox.event) RETURNS SETOF integer LANGUAGE sql AS $$ SELECT 1 $$;
CREATE FUNCTION public.variadic_sink(VARIADIC events outbox.event[]) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION pg_temp.temp_sink(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ SELECT $$;

SELECT outbox.create_consumer('c1') IS NOT NULL AS created;
SELECT outbox.create_sink('s1', 'good_sink(outbox.event[])', ARRAY['order.*']) IS NOT NULL AS created;
SELECT outbox.create_http_sink('h1', 'https://hooks.example.com/in', headers => '{"Authorization": "Bearer s3cr3t-token"}',
                               secret => 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw') IS NOT NULL AS created;
SELECT outbox.subscribe('sub1', ARRAY['order.*'], handler => 'good_job(outbox.event)') IS NOT NULL AS created;
SELECT outbox.subscribe('sub2', ARRAY['refund.#'], queue => 'q1', filter => 'payload.amount > 100') IS NOT NULL AS created;
SELECT outbox.raise('order.placed', '{"order": 1}', subject => 'order/1', tenant => 'acme') IS NOT NULL AS raised;
SELECT cardinality(outbox.raise_many(ARRAY['order.shipped'], ARRAY['{"order": 1}', '{"order": 2}']::jsonb[])) AS raised;
SELECT outbox.enqueue('q1', '{"job": 1}', key => 'k1') IS NOT NULL AS enqueued;
SELECT outbox.schedule('sch1', every => '1 hour', topic => 'system.tick') IS NOT NULL AS scheduled;
SELECT outbox.schedule('sch2', daily_at => '02:30', zone => 'Europe/Berlin', weekly_on => 'monday',
                       queue => 'q1', payload => '{"kind": "weekly"}') IS NOT NULL AS scheduled;

-- A fingerprint of every table in schema outbox, taken now and again at the end.
CREATE TEMP VIEW fingerprint_now AS
          SELECT 'consumers' AS tab, md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) AS md5 FROM outbox.consumers t
UNION ALL SELECT 'dead_letters', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.dead_letters t
UNION ALL SELECT 'events', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.events t
UNION ALL SELECT 'http_sinks', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.http_sinks t
UNION ALL SELECT 'jobs', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.jobs t
UNION ALL SELECT 'lineage', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.lineage t
UNION ALL SELECT 'queue_grants', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.queue_grants t
UNION ALL SELECT 'queues', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.queues t
UNION ALL SELECT 'schedules', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.schedules t
UNION ALL SELECT 'sinks', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.sinks t
UNION ALL SELECT 'subscriptions', md5(coalesce(string_agg(t::text, ',' ORDER BY t::text), '')) FROM outbox.subscriptions t;
CREATE TEMP TABLE fingerprint_before AS SELECT * FROM fingerprint_now;
-- Every table of the schema is in the fingerprint.
SELECT array_agg(tablename::text ORDER BY tablename) = (SELECT array_agg(tab ORDER BY tab) FROM fingerprint_before) AS all_tables
  FROM pg_tables WHERE schemaname = 'outbox';
SELECT (SELECT count(*) FROM outbox.events) AS events, (SELECT count(*) FROM outbox.consumers) AS consumers,
       (SELECT count(*) FROM outbox.sinks) AS sinks, (SELECT count(*) FROM outbox.http_sinks) AS http_sinks,
       (SELECT count(*) FROM outbox.subscriptions) AS subscriptions, (SELECT count(*) FROM outbox.jobs) AS jobs,
       (SELECT count(*) FROM outbox.schedules) AS schedules, (SELECT count(*) FROM outbox.dead_letters) AS dead_letters;

-- Two kinds of refusal cannot be printed as psql prints them, because part of them differs from
-- run to run; they go through pg_temp.refused(), which prints the SQLSTATE, the message, the
-- DETAIL and the HINT the same way, minus that part:
-- * a position beyond the read horizon: the DETAIL names the horizon, a transaction id
--   (show_detail => false leaves the DETAIL out);
-- * an error raised by SQL that the extension runs through SPI (outbox.schedule() checks its
--   arguments in outbox._schedule()): pgrx re-raises it with a Rust backtrace appended to the
--   DETAIL when RUST_BACKTRACE is set in the server's environment. The backtrace is cut off.
CREATE FUNCTION pg_temp.refused(call text, show_detail boolean DEFAULT true) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    state text;
    message text;
    detail text;
    hint text;
BEGIN
    EXECUTE call;
    RETURN 'accepted';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, message = MESSAGE_TEXT,
                            detail = PG_EXCEPTION_DETAIL, hint = PG_EXCEPTION_HINT;
    detail := CASE WHEN show_detail THEN nullif(regexp_replace(detail, '(^|\n) +0: .*$', ''), '') END;
    RETURN 'ERROR:  ' || state || ': ' || message || coalesce(E'\nDETAIL:  ' || detail, '')
        || coalesce(E'\nHINT:  ' || nullif(hint, ''), '');
END
$$;

-- ======================================================================================== raise
-- NULL and empty topic
SELECT outbox.raise(NULL);
SELECT outbox.raise('');
SELECT outbox.raise(NULL, '{}', 'order/1', 'acme', '{}');
-- topics that break the topic rules
SELECT outbox.raise('order..placed');
SELECT outbox.raise('.order');
SELECT outbox.raise('order.');
SELECT outbox.raise('.');
SELECT outbox.raise('order placed');
SELECT outbox.raise('order.*');
SELECT outbox.raise('order.#');
SELECT outbox.raise('order/42');
SELECT outbox.raise('ordér.placed');
SELECT outbox.raise(E'order\nplaced');
SELECT outbox.raise('x''; DROP TABLE outbox.events; --');
SELECT outbox.raise('a"b');
SELECT outbox.raise(repeat('a', 256));
SELECT outbox.raise(repeat('a', 1000));
-- payloads that are not objects
SELECT outbox.raise('order.placed', '[1, 2]');
SELECT outbox.raise('order.placed', '"a string"');
SELECT outbox.raise('order.placed', '42');
SELECT outbox.raise('order.placed', 'true');
SELECT outbox.raise('order.placed', 'null');
SELECT outbox.raise('order.placed', '{"unterminated": ');
-- subject and tenant: empty, too long
SELECT outbox.raise('order.placed', '{}', '');
SELECT outbox.raise('order.placed', '{}', repeat('s', 1025));
SELECT outbox.raise('order.placed', '{}', NULL, '');
SELECT outbox.raise('order.placed', '{}', NULL, repeat('t', 256));
-- headers that are not objects
SELECT outbox.raise('order.placed', '{}', NULL, NULL, '[]');
SELECT outbox.raise('order.placed', '{}', NULL, NULL, '"traceparent"');
SELECT outbox.raise('order.placed', '{}', NULL, NULL, '7');

-- =================================================================================== raise_many
-- NULL arrays and NULL elements
SELECT outbox.raise_many(NULL, ARRAY['{}']::jsonb[]);
SELECT outbox.raise_many(ARRAY['order.placed'], NULL);
SELECT outbox.raise_many(NULL, NULL);
SELECT outbox.raise_many(ARRAY[NULL, 'order.placed'], ARRAY['{}', '{}']::jsonb[]);
-- array lengths that do not pair up
SELECT outbox.raise_many(ARRAY['a', 'b'], ARRAY['{}', '{}', '{}']::jsonb[]);
SELECT outbox.raise_many(ARRAY[]::text[], ARRAY['{}']::jsonb[]);
SELECT outbox.raise_many(ARRAY['a'], ARRAY['{}', '{}']::jsonb[], ARRAY['s1', 's2', 's3']);
SELECT outbox.raise_many(ARRAY['a'], ARRAY['{}', '{}']::jsonb[], NULL, ARRAY['t1', 't2', 't3']);
SELECT outbox.raise_many(ARRAY['a'], ARRAY['{}', '{}']::jsonb[], NULL, NULL, ARRAY['{}', '{}', '{}']::jsonb[]);
-- two-dimensional arrays
SELECT outbox.raise_many(ARRAY[['a', 'b'], ['c', 'd']], ARRAY['{}', '{}', '{}', '{}']::jsonb[]);
SELECT outbox.raise_many(ARRAY['a'], ARRAY[['{}', '{}'], ['{}', '{}']]::jsonb[]);
-- elements that break the rules, named by index
SELECT outbox.raise_many(ARRAY['order.placed', 'order..placed'], ARRAY['{}', '{}']::jsonb[]);
SELECT outbox.raise_many(ARRAY['x''; DROP TABLE outbox.events; --'], ARRAY['{}']::jsonb[]);
SELECT outbox.raise_many(ARRAY['order.placed'], ARRAY['{}', '[]', '{}']::jsonb[]);
SELECT outbox.raise_many(ARRAY['order.placed'], ARRAY['"s"']::jsonb[]);
SELECT outbox.raise_many(ARRAY['order.placed'], ARRAY['{}', '{}']::jsonb[], ARRAY['s1', '']);
SELECT outbox.raise_many(ARRAY['order.placed'], ARRAY['{}', '{}']::jsonb[], NULL, ARRAY['', 't2']);
SELECT outbox.raise_many(ARRAY['order.placed'], ARRAY['{}', '{}']::jsonb[], NULL, ARRAY[repeat('t', 256)]);
SELECT outbox.raise_many(ARRAY['order.placed'], ARRAY['{}', '{}']::jsonb[], NULL, NULL, ARRAY['{}', '1']::jsonb[]);
-- more events than one call may raise
SELECT outbox.raise_many(ARRAY['order.placed'], array_fill('{}'::jsonb, ARRAY[100001]));
-- accepted: no payloads raise nothing
BEGIN;
SELECT outbox.raise_many(ARRAY[]::text[], ARRAY[]::jsonb[]) AS ids;
ROLLBACK;

-- ============================================================================== create_consumer
-- NULLs
SELECT outbox.create_consumer(NULL);
SELECT outbox.create_consumer('c2', NULL);
-- names: empty, overlong, hostile
SELECT outbox.create_consumer('');
SELECT outbox.create_consumer(repeat('n', 64));
SELECT outbox.create_consumer(repeat('n', 1000));
SELECT outbox.create_consumer('x''; DROP TABLE outbox.events; --');
SELECT outbox.create_consumer('x;y');
SELECT outbox.create_consumer('a"b');
SELECT outbox.create_consumer('a b');
SELECT outbox.create_consumer(' a');
SELECT outbox.create_consumer('.hidden');
SELECT outbox.create_consumer('-dash');
SELECT outbox.create_consumer('_under');
SELECT outbox.create_consumer('café');
SELECT outbox.create_consumer('🙂');
SELECT outbox.create_consumer(E'tab\there');
SELECT outbox.create_consumer('a/b');
-- names that exist (consumers, sinks and subscriptions share one namespace)
SELECT outbox.create_consumer('c1');
SELECT outbox.create_consumer('s1');
SELECT outbox.create_consumer('h1');
SELECT outbox.create_consumer('sub1');
-- start_at: not a word, malformed positions
SELECT outbox.create_consumer('c2', '');
SELECT outbox.create_consumer('c2', 'Origin');
SELECT outbox.create_consumer('c2', 'NOW');
SELECT outbox.create_consumer('c2', 'abc');
SELECT outbox.create_consumer('c2', '1');
SELECT outbox.create_consumer('c2', ':');
SELECT outbox.create_consumer('c2', '1:');
SELECT outbox.create_consumer('c2', ':1');
SELECT outbox.create_consumer('c2', '-1:2');
SELECT outbox.create_consumer('c2', '1:-2');
SELECT outbox.create_consumer('c2', '+1:2');
SELECT outbox.create_consumer('c2', ' 1:2');
SELECT outbox.create_consumer('c2', '1.5:2');
SELECT outbox.create_consumer('c2', '1e3:1');
SELECT outbox.create_consumer('c2', '007:1');
SELECT outbox.create_consumer('c2', '1:2:3');
SELECT outbox.create_consumer('c2', 'a:b');
SELECT outbox.create_consumer('c2', '99999999999999999999:1');
SELECT outbox.create_consumer('c2', '1:9223372036854775808');
SELECT outbox.create_consumer('c2', '1:2''; DROP TABLE outbox.events; --');
-- start_at beyond the read horizon
SELECT pg_temp.refused($$SELECT outbox.create_consumer('c2', '18446744073709551615:1')$$, show_detail => false);
SELECT pg_temp.refused($$SELECT outbox.create_consumer('c2', '9223372036854775808:0')$$, show_detail => false);

-- ========================================================================================= read
-- NULLs
SELECT * FROM outbox.read(NULL);
SELECT * FROM outbox.read('c1', NULL);
-- max_events out of range
SELECT * FROM outbox.read('c1', 0);
SELECT * FROM outbox.read('c1', -1);
SELECT * FROM outbox.read('c1', 100001);
SELECT * FROM outbox.read('c1', 2147483647);
-- unknown consumers, bad names
SELECT * FROM outbox.read('nope');
SELECT * FROM outbox.read('');
SELECT * FROM outbox.read(repeat('n', 64));
SELECT * FROM outbox.read('x''; DROP TABLE outbox.events; --');
-- accepted: read does not check the kind (any consumer's events may be read), nor move a cursor
SELECT count(*) >= 0 AS read FROM outbox.read('s1');

-- ====================================================================================== advance
-- NULLs
SELECT outbox.advance(NULL, '1:1');
SELECT outbox.advance('c1', NULL);
SELECT outbox.advance(NULL, NULL);
-- malformed positions
SELECT outbox.advance('c1', '');
SELECT outbox.advance('c1', 'abc');
SELECT outbox.advance('c1', 'origin');
SELECT outbox.advance('c1', '1:');
SELECT outbox.advance('c1', ':1');
SELECT outbox.advance('c1', '-1:2');
SELECT outbox.advance('c1', '1:2:3');
SELECT outbox.advance('c1', '99999999999999999999:1');
SELECT outbox.advance('c1', '１:2');
-- positions beyond the read horizon
SELECT pg_temp.refused($$SELECT outbox.advance('c1', '18446744073709551615:1')$$, show_detail => false);
SELECT pg_temp.refused($$SELECT outbox.advance('c1', '9223372036854775807:9223372036854775807')$$, show_detail => false);
-- unknown consumers, bad names
SELECT outbox.advance('nope', '1:1');
SELECT outbox.advance(repeat('n', 63), '1:1');
SELECT outbox.advance('', '1:1');
SELECT outbox.advance(repeat('n', 64), '1:1');
SELECT outbox.advance(repeat('n', 1000), '1:1');
SELECT outbox.advance('x''; DROP TABLE outbox.events; --', '1:1');
SELECT outbox.advance('a b', '1:1');
SELECT outbox.advance('.c1', '1:1');
SELECT outbox.advance('café', '1:1');
-- not a pull consumer
SELECT outbox.advance('s1', '1:1');
SELECT outbox.advance('h1', '1:1');
SELECT outbox.advance('sub1', '1:1');
-- accepted: a position not ahead of the cursor changes nothing and returns false
SELECT outbox.advance('c1', '0:0');

-- ======================================================================================= rewind
-- NULLs
SELECT outbox.rewind(NULL, '1:1');
SELECT outbox.rewind('c1', NULL);
-- malformed positions
SELECT outbox.rewind('c1', '');
SELECT outbox.rewind('c1', 'abc');
SELECT outbox.rewind('c1', '1:');
SELECT outbox.rewind('c1', ':1');
SELECT outbox.rewind('c1', '-1:2');
SELECT outbox.rewind('c1', '1:2:3');
SELECT outbox.rewind('c1', '99999999999999999999:1');
-- positions beyond the read horizon
SELECT pg_temp.refused($$SELECT outbox.rewind('c1', '18446744073709551615:1')$$, show_detail => false);
SELECT pg_temp.refused($$SELECT outbox.rewind('s1', '18446744073709551615:1')$$, show_detail => false);
-- unknown consumers, bad names
SELECT outbox.rewind('nope', '1:1');
SELECT outbox.rewind('', '1:1');
SELECT outbox.rewind(repeat('n', 64), '1:1');
SELECT outbox.rewind(repeat('n', 1000), '1:1');
SELECT outbox.rewind('x''; DROP TABLE outbox.events; --', '1:1');
SELECT outbox.rewind('a b', '1:1');
SELECT outbox.rewind('.c1', '1:1');

-- ================================================================================ drop_consumer
SELECT outbox.drop_consumer(NULL);
SELECT outbox.drop_consumer('');
SELECT outbox.drop_consumer(repeat('n', 64));
SELECT outbox.drop_consumer(repeat('n', 1000));
SELECT outbox.drop_consumer('x''; DROP TABLE outbox.events; --');
SELECT outbox.drop_consumer('a b');
SELECT outbox.drop_consumer('.c1');
SELECT outbox.drop_consumer('café');
SELECT outbox.drop_consumer('nope');
SELECT outbox.drop_consumer(repeat('n', 63));
-- not a pull consumer
SELECT outbox.drop_consumer('s1');
SELECT outbox.drop_consumer('h1');
SELECT outbox.drop_consumer('sub1');

-- ================================================================================= create_sink
-- NULLs
SELECT outbox.create_sink(NULL, 'good_sink(outbox.event[])');
SELECT outbox.create_sink('s2', NULL);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', start_at => NULL);
-- ids: empty, overlong, hostile, taken
SELECT outbox.create_sink('', 'good_sink(outbox.event[])');
SELECT outbox.create_sink(repeat('n', 64), 'good_sink(outbox.event[])');
SELECT outbox.create_sink(repeat('n', 1000), 'good_sink(outbox.event[])');
SELECT outbox.create_sink('x''; DROP TABLE outbox.events; --', 'good_sink(outbox.event[])');
SELECT outbox.create_sink('a b', 'good_sink(outbox.event[])');
SELECT outbox.create_sink('.s2', 'good_sink(outbox.event[])');
SELECT outbox.create_sink('sïnk', 'good_sink(outbox.event[])');
SELECT outbox.create_sink('s1', 'good_sink(outbox.event[])');
SELECT outbox.create_sink('c1', 'good_sink(outbox.event[])');
SELECT outbox.create_sink('sub1', 'good_sink(outbox.event[])');
-- handlers with the wrong signature
SELECT outbox.create_sink('s2', 'good_job(outbox.event)');
SELECT outbox.create_sink('s2', 'no_args()');
SELECT outbox.create_sink('s2', 'text_arg(text)');
SELECT outbox.create_sink('s2', 'two_args(outbox.event[], integer)');
SELECT outbox.create_sink('s2', 'defaulted(outbox.event[], integer)');
SELECT outbox.create_sink('s2', 'a_procedure(outbox.event[])');
SELECT outbox.create_sink('s2', 'a_set(outbox.event[])');
SELECT outbox.create_sink('s2', 'pg_catalog.count("any")');
SELECT outbox.create_sink('s2', 'pg_catalog.array_length(anyarray, integer)');
-- handlers that do not exist: the regprocedure cast refuses most before the call
SELECT outbox.create_sink('s2', 'nope(outbox.event[])');
SELECT outbox.create_sink('s2', 'good_sink');
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[]); DROP TABLE outbox.events; --');
SELECT outbox.create_sink('s2', '');
SELECT outbox.create_sink('s2', 4294967295::oid::regprocedure);
SELECT outbox.create_sink('s2', 0::oid::regprocedure);
-- topics: empty array, NULL element, patterns that break the rules
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY[]::text[]);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY[NULL]::text[]);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY['order.*', NULL]);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY['']);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY['order..placed']);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY['order.**']);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY['order.#x']);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY['order placed']);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY['order.(placed|shipped)']);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY['x''; DROP TABLE outbox.events; --']);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', ARRAY[repeat('a', 256)]);
-- batch_size out of range
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', batch_size => 0);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', batch_size => -1);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', batch_size => 10001);
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', batch_size => 2147483647);
-- start_at
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', start_at => '');
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', start_at => 'later');
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', start_at => '1:');
SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', start_at => '1:2:3');
SELECT pg_temp.refused($$SELECT outbox.create_sink('s2', 'good_sink(outbox.event[])', start_at => '18446744073709551615:1')$$, show_detail => false);
-- handlers the workers could not call: a VARIADIC one (the call passes the array without
-- VARIADIC) and a temporary function (gone with the session that made it)
SELECT outbox.create_sink('s-variadic', 'variadic_sink(outbox.event[])');
SELECT outbox.create_sink('s-temp', 'pg_temp.temp_sink(outbox.event[])');

-- ============================================================================ create_http_sink
-- NULLs
SELECT outbox.create_http_sink(NULL, 'https://hooks.example.com/in');
SELECT outbox.create_http_sink('h2', NULL);
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', start_at => NULL);
-- ids: empty, overlong, hostile, taken
SELECT outbox.create_http_sink('', 'https://hooks.example.com/in');
SELECT outbox.create_http_sink(repeat('n', 64), 'https://hooks.example.com/in');
SELECT outbox.create_http_sink(repeat('n', 1000), 'https://hooks.example.com/in');
SELECT outbox.create_http_sink('x''; DROP TABLE outbox.events; --', 'https://hooks.example.com/in');
SELECT outbox.create_http_sink('a b', 'https://hooks.example.com/in');
SELECT outbox.create_http_sink('h1', 'https://hooks.example.com/in');
SELECT outbox.create_http_sink('c1', 'https://hooks.example.com/in');
-- malformed urls
SELECT outbox.create_http_sink('h2', '');
SELECT outbox.create_http_sink('h2', 'not a url');
SELECT outbox.create_http_sink('h2', 'hooks.example.com/in');
SELECT outbox.create_http_sink('h2', 'https://');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com:99999/in');
SELECT outbox.create_http_sink('h2', 'https://hooks example.com/in');
SELECT outbox.create_http_sink('h2', 'https://[::1/in');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in#fragment');
-- schemes other than https
SELECT outbox.create_http_sink('h2', 'http://hooks.example.com/in');
SELECT outbox.create_http_sink('h2', 'ftp://hooks.example.com/in');
SELECT outbox.create_http_sink('h2', 'file:///etc/passwd');
SELECT outbox.create_http_sink('h2', 'javascript:alert(1)');
-- credentials in the url (never echoed)
SELECT outbox.create_http_sink('h2', 'https://user:hunter2@hooks.example.com/in');
SELECT outbox.create_http_sink('h2', 'https://token@hooks.example.com/in');
-- private, loopback, link-local, metadata and other internal addresses
SELECT outbox.create_http_sink('h2', 'https://127.0.0.1/in');
SELECT outbox.create_http_sink('h2', 'https://127.1/in');
SELECT outbox.create_http_sink('h2', 'https://2130706433/in');
SELECT outbox.create_http_sink('h2', 'https://0x7f000001/in');
SELECT outbox.create_http_sink('h2', 'https://0177.0.0.1/in');
SELECT outbox.create_http_sink('h2', 'https://0.0.0.0/in');
SELECT outbox.create_http_sink('h2', 'https://10.1.2.3/in');
SELECT outbox.create_http_sink('h2', 'https://172.16.0.1/in');
SELECT outbox.create_http_sink('h2', 'https://192.168.1.1/in');
SELECT outbox.create_http_sink('h2', 'https://100.64.0.1/in');
SELECT outbox.create_http_sink('h2', 'https://169.254.169.254/latest/meta-data/');
SELECT outbox.create_http_sink('h2', 'https://224.0.0.1/in');
SELECT outbox.create_http_sink('h2', 'https://255.255.255.255/in');
SELECT outbox.create_http_sink('h2', 'https://[::1]/in');
SELECT outbox.create_http_sink('h2', 'https://[::]/in');
SELECT outbox.create_http_sink('h2', 'https://[::ffff:127.0.0.1]/in');
SELECT outbox.create_http_sink('h2', 'https://[fd00:ec2::254]/in');
SELECT outbox.create_http_sink('h2', 'https://[fe80::1]/in');
SELECT outbox.create_http_sink('h2', 'https://[64:ff9b::10.0.0.1]/in');
SELECT outbox.create_http_sink('h2', 'https://[2002:a00:1::]/in');
-- headers that are not an object of strings, or that pg_outbox sets itself (values never echoed)
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '[]');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '"Authorization: Bearer x"');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '42');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"X-Retries": 3}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"X-Token": null}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"Authorization": {"Bearer": "hunter2"}}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"Authorization": ["Bearer hunter2"]}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"": "x"}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"X Token": "x"}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"X-Token:": "x"}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"X-Tökén": "x"}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"X-Token": "hunter2\r\nX-Injected: 1"}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => jsonb_build_object('X-Token', repeat('t', 8193)));
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => jsonb_build_object(repeat('h', 129), 'x'));
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"Content-Type": "text/plain"}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"host": "evil.example.com"}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"Idempotency-Key": "x"}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"Webhook-Signature": "v1,x"}');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', headers => '{"Content-Length": "0"}');
-- malformed secrets (never echoed)
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', secret => '');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', secret => 'whsec_');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', secret => 'hunter2');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', secret => 'MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', secret => 'whsec_c2hvcnQ=');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', secret => 'whsec_not*base64!');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', secret => 'whsec_' || encode(convert_to(repeat('k', 65), 'UTF8'), 'base64'));
-- timeout_ms, batch_size, topics, start_at out of range
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', timeout_ms => 0);
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', timeout_ms => 99);
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', timeout_ms => -1);
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', timeout_ms => 600001);
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', batch_size => 0);
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', batch_size => 10001);
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', ARRAY[]::text[]);
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', ARRAY['order..x']);
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', start_at => 'abc');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', start_at => '1:2:3');
SELECT pg_temp.refused($$SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in', start_at => '18446744073709551615:1')$$, show_detail => false);
-- accepted: a host name is checked when the workers resolve it, right before each request
BEGIN;
SELECT outbox.create_http_sink('h-localhost', 'https://localhost/in') IS NOT NULL AS accepted;
ROLLBACK;
-- a url with an empty host (the url parser alone would read https:///in as https://in/)
SELECT outbox.create_http_sink('h-no-host', 'https:///in');
SELECT outbox.create_http_sink('h-no-host', 'https:/in');

-- =========================================================================== create_kafka_sink
-- NULLs
SELECT outbox.create_kafka_sink(NULL, 'kafka.example.com:9092', 'events');
SELECT outbox.create_kafka_sink('k2', NULL, 'events');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', NULL);
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', key => NULL);
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', timeout_ms => NULL);
-- brokers: host:port lists, no internal address unless allowed, metadata never
SELECT outbox.create_kafka_sink('k2', '', 'events');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com', 'events');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:0', 'events');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:99999', 'events');
SELECT outbox.create_kafka_sink('k2', 'a:1,,b:2', 'events');
SELECT outbox.create_kafka_sink('k2', 'kafka example:9092', 'events');
SELECT outbox.create_kafka_sink('k2', 'x''; DROP TABLE outbox.sinks; --:9092', 'events');
SELECT outbox.create_kafka_sink('k2', '127.0.0.1:9092', 'events');
SELECT outbox.create_kafka_sink('k2', '10.1.2.3:9092', 'events');
SELECT outbox.create_kafka_sink('k2', '169.254.169.254:9092', 'events');
SELECT outbox.create_kafka_sink('k2', '[::1]:9092', 'events');
SELECT outbox.create_kafka_sink('k2', '[fe80::1]:9092', 'events');
-- kafka_topic: a Kafka topic name, or a template with {topic} once
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', '');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'a b');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', '..');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', '{topic}.{topic}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', repeat('t', 250));
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'x''; DROP TABLE outbox.sinks; --');
-- key, timeout_ms, properties (an allowlist)
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', key => 'payload');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', timeout_ms => 999);
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', timeout_ms => 600001);
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '[]');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"plugin.library.paths": "/tmp/x.so"}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"ssl.ca.location": "/etc/ssl/certs"}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"acks": "1"}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"compression.type": "zstd"}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"linger.ms": null}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"sasl.password": {"a": 1}}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"topic.metadata.refresh.interval.ms": 1}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"request.timeout.ms": "900000"}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"client.id": "a\nb"}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', properties => '{"message.timeout.ms": 1}');
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', batch_size => 0);
SELECT outbox.create_kafka_sink('k2', 'kafka.example.com:9092', 'events', topics => '{"a b"}');
SELECT outbox.create_kafka_sink('bad name', 'kafka.example.com:9092', 'events');
-- the name of an existing sink
SELECT pg_temp.refused($$SELECT outbox.create_kafka_sink('h1', 'kafka.example.com:9092', 'events')$$);

-- ============================================================== pause_sink, resume_sink, drop_sink
SELECT outbox.pause_sink(NULL);
SELECT outbox.pause_sink('');
SELECT outbox.pause_sink(repeat('n', 64));
SELECT outbox.pause_sink(repeat('n', 1000));
SELECT outbox.pause_sink('x''; DROP TABLE outbox.events; --');
SELECT outbox.pause_sink('a b');
SELECT outbox.pause_sink('nope');
SELECT outbox.pause_sink('c1');
SELECT outbox.pause_sink('sub1');
SELECT outbox.resume_sink(NULL);
SELECT outbox.resume_sink('');
SELECT outbox.resume_sink(repeat('n', 64));
SELECT outbox.resume_sink('x''; DROP TABLE outbox.events; --');
SELECT outbox.resume_sink('nope');
SELECT outbox.resume_sink('c1');
SELECT outbox.resume_sink('sub1');
SELECT outbox.drop_sink(NULL);
SELECT outbox.drop_sink('');
SELECT outbox.drop_sink(repeat('n', 64));
SELECT outbox.drop_sink(repeat('n', 1000));
SELECT outbox.drop_sink('x''; DROP TABLE outbox.events; --');
SELECT outbox.drop_sink('.s1');
SELECT outbox.drop_sink('nope');
SELECT outbox.drop_sink('c1');
SELECT outbox.drop_sink('sub1');

-- ==================================================================================== alter_sink
SELECT outbox.alter_sink(NULL, '{"synchronous_commit": false}');
SELECT outbox.alter_sink('', '{"synchronous_commit": false}');
SELECT outbox.alter_sink(repeat('n', 64), '{"synchronous_commit": false}');
SELECT outbox.alter_sink('x''; DROP TABLE outbox.events; --', '{"synchronous_commit": false}');
SELECT outbox.alter_sink('nope', '{"synchronous_commit": false}');
SELECT outbox.alter_sink('c1', '{"synchronous_commit": false}');
SELECT outbox.alter_sink('sub1', '{"synchronous_commit": false}');
SELECT outbox.alter_sink('s1', NULL);
SELECT outbox.alter_sink('s1', '{}');
SELECT outbox.alter_sink('s1', '[]');
SELECT outbox.alter_sink('s1', 'null');
SELECT outbox.alter_sink('s1', '"synchronous_commit"');
SELECT outbox.alter_sink('s1', '{"synchronous_commit": "off"}');
SELECT outbox.alter_sink('s1', '{"synchronous_commit": null}');
SELECT outbox.alter_sink('s1', '{"synchronous_commit": 0}');
SELECT outbox.alter_sink('s1', '{"synchronous_commit": false, "batch_size": 10}');
SELECT outbox.alter_sink('s1', jsonb_build_object(repeat('k', 1000), 1));
SELECT outbox.alter_sink('s1', '{"read_by": "xmin"}');
SELECT outbox.alter_sink('s1', '{"read_by": "TICKS"}');
SELECT outbox.alter_sink('s1', '{"read_by": true}');
SELECT outbox.alter_sink('s1', '{"read_by": null}');
SELECT outbox.alter_sink('s1', jsonb_build_object('read_by', repeat('t', 1000)));

-- ================================================================================ alter_consumer
SELECT outbox.alter_consumer(NULL, '{"read_by": "ticks"}');
SELECT outbox.alter_consumer('', '{"read_by": "ticks"}');
SELECT outbox.alter_consumer(repeat('n', 64), '{"read_by": "ticks"}');
SELECT outbox.alter_consumer('x''; DROP TABLE outbox.events; --', '{"read_by": "ticks"}');
SELECT outbox.alter_consumer('nope', '{"read_by": "ticks"}');
SELECT outbox.alter_consumer('s1', '{"read_by": "ticks"}');
SELECT outbox.alter_consumer('sub1', '{"read_by": "ticks"}');
SELECT outbox.alter_consumer('c1', NULL);
SELECT outbox.alter_consumer('c1', '{}');
SELECT outbox.alter_consumer('c1', '[]');
SELECT outbox.alter_consumer('c1', '{"synchronous_commit": false}');
SELECT outbox.alter_consumer('c1', '{"read_by": "xmin"}');
SELECT outbox.alter_consumer('c1', '{"read_by": null}');
SELECT outbox.alter_consumer('c1', jsonb_build_object(repeat('k', 1000), 1));
-- accepted: the read horizon, as it was
SELECT outbox.alter_consumer('c1', '{"read_by": "horizon"}');

-- ============================================================================ alter_subscription
SELECT outbox.alter_subscription(NULL, '{"read_by": "ticks"}');
SELECT outbox.alter_subscription('', '{"read_by": "ticks"}');
SELECT outbox.alter_subscription('x''; DROP TABLE outbox.events; --', '{"read_by": "ticks"}');
SELECT outbox.alter_subscription('nope', '{"read_by": "ticks"}');
SELECT outbox.alter_subscription('c1', '{"read_by": "ticks"}');
SELECT outbox.alter_subscription('s1', '{"read_by": "ticks"}');
SELECT outbox.alter_subscription('sub1', NULL);
SELECT outbox.alter_subscription('sub1', '{}');
SELECT outbox.alter_subscription('sub1', '"read_by"');
SELECT outbox.alter_subscription('sub1', '{"synchronous_commit": false}');
SELECT outbox.alter_subscription('sub1', '{"read_by": "TICKS"}');
SELECT outbox.alter_subscription('sub1', '{"read_by": 1}');
-- accepted: the read horizon, as it was
SELECT outbox.alter_subscription('sub1', '{"read_by": "horizon"}');

-- ======================================================================= replay(sink, position)
SELECT outbox.replay(NULL, '1:1');
SELECT outbox.replay('s1', NULL);
SELECT outbox.replay('s1', '');
SELECT outbox.replay('s1', 'abc');
SELECT outbox.replay('s1', '1:');
SELECT outbox.replay('s1', ':1');
SELECT outbox.replay('s1', '-1:2');
SELECT outbox.replay('s1', '1:2:3');
SELECT outbox.replay('s1', '99999999999999999999:1');
-- no such dead letter
SELECT outbox.replay('s1', '1:1');
SELECT outbox.replay('h1', '18446744073709551615:1');
-- unknown sinks, bad names, not a sink
SELECT outbox.replay('nope', '1:1');
SELECT outbox.replay('', '1:1');
SELECT outbox.replay(repeat('n', 64), '1:1');
SELECT outbox.replay('x''; DROP TABLE outbox.events; --', '1:1');
SELECT outbox.replay('c1', '1:1');
SELECT outbox.replay('sub1', '1:1');

-- ================================================================================= replay(sink)
SELECT outbox.replay(NULL);
SELECT outbox.replay('');
SELECT outbox.replay(repeat('n', 64));
SELECT outbox.replay(repeat('n', 1000));
SELECT outbox.replay('x''; DROP TABLE outbox.events; --');
SELECT outbox.replay('nope');
SELECT outbox.replay('c1');
SELECT outbox.replay('sub1');

-- ================================================================================= horizon
SELECT count(*) AS rows FROM outbox.horizon();
SELECT * FROM outbox.horizon('c1');

-- ======================================================================================== prune
SELECT outbox.prune(NULL);
SELECT outbox.prune('7 days', NULL);
SELECT outbox.prune('-1 second');
SELECT outbox.prune('-7 days');
SELECT outbox.prune('1 mon -31 days');
SELECT outbox.prune('-1 microsecond');
SELECT outbox.prune('7 days', 0);
SELECT outbox.prune('7 days', -1);
SELECT outbox.prune('7 days', 1000001);
SELECT outbox.prune('7 days', 2147483647);
SELECT outbox.prune('forever');
SELECT outbox.prune('7 days', 'many');
-- not in READ COMMITTED
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT outbox.prune();
ROLLBACK;
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT outbox.prune();
ROLLBACK;
-- accepted: a zero retention; nothing is prunable (c1 never advanced)
SELECT outbox.prune('0 seconds') AS pruned;
-- a retention too big to subtract from now()
SELECT outbox.prune('178000000 years', 1);
SELECT outbox.prune('1001 years', 1);

-- ========================================================== status, queue_status, schedule_status
SELECT count(*) AS rows FROM outbox.status();
SELECT count(*) AS rows FROM outbox.queue_status();
SELECT count(*) AS rows FROM outbox.schedule_status();
SELECT * FROM outbox.status('c1');
SELECT * FROM outbox.queue_status('q1');
SELECT * FROM outbox.schedule_status('sch1');

-- =============================================================================== workers, wake
SELECT count(*) >= 0 AS listed FROM outbox.workers();
SELECT outbox.wake();
SELECT * FROM outbox.workers(1);
SELECT outbox.wake('now');

-- ==================================================================================== subscribe
-- NULLs
SELECT outbox.subscribe(NULL, queue => 'q2');
SELECT outbox.subscribe('sub3', queue => 'q2', max_attempts => NULL);
SELECT outbox.subscribe('sub3', queue => 'q2', start_at => NULL);
-- names: empty, overlong, hostile, taken
SELECT outbox.subscribe('', queue => 'q2');
SELECT outbox.subscribe(repeat('n', 64), queue => 'q2');
SELECT outbox.subscribe(repeat('n', 1000), queue => 'q2');
SELECT outbox.subscribe('x''; DROP TABLE outbox.events; --', queue => 'q2');
SELECT outbox.subscribe('a b', queue => 'q2');
SELECT outbox.subscribe('.sub', queue => 'q2');
SELECT outbox.subscribe('sübscription', queue => 'q2');
SELECT outbox.subscribe('sub1', queue => 'q2');
SELECT outbox.subscribe('c1', queue => 'q2');
SELECT outbox.subscribe('s1', queue => 'q2');
-- neither or both of handler and queue
SELECT outbox.subscribe('sub3');
SELECT outbox.subscribe('sub3', ARRAY['order.*']);
SELECT outbox.subscribe('sub3', handler => 'good_job(outbox.event)', queue => 'q2');
-- queue names
SELECT outbox.subscribe('sub3', queue => '');
SELECT outbox.subscribe('sub3', queue => repeat('q', 64));
SELECT outbox.subscribe('sub3', queue => repeat('q', 1000));
SELECT outbox.subscribe('sub3', queue => 'x''; DROP TABLE outbox.jobs; --');
SELECT outbox.subscribe('sub3', queue => 'a b');
SELECT outbox.subscribe('sub3', queue => '.q');
SELECT outbox.subscribe('sub3', queue => 'qüeue');
-- handlers with the wrong signature
SELECT outbox.subscribe('sub3', handler => 'good_sink(outbox.event[])');
SELECT outbox.subscribe('sub3', handler => 'no_args()');
SELECT outbox.subscribe('sub3', handler => 'text_arg(text)');
SELECT outbox.subscribe('sub3', handler => 'two_args_job(outbox.event, integer)');
SELECT outbox.subscribe('sub3', handler => 'a_procedure_job(outbox.event)');
SELECT outbox.subscribe('sub3', handler => 'a_set_job(outbox.event)');
SELECT outbox.subscribe('sub3', handler => 'variadic_sink(outbox.event[])');
SELECT outbox.subscribe('sub3', handler => 'pg_catalog.count("any")');
SELECT outbox.subscribe('sub3', handler => 'nope(outbox.event)');
SELECT outbox.subscribe('sub3', handler => 'good_job(outbox.event); DROP TABLE outbox.jobs; --');
SELECT outbox.subscribe('sub3', handler => 4294967295::oid::regprocedure);
-- invalid CEL: empty, syntax errors, unknown variables, hostile text
SELECT outbox.subscribe('sub3', queue => 'q2', filter => '');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => '   ');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'payload.amount >');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'payload.amount > 100 &&');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => '(topic == "a"');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'topic = "a"');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'topic == ''a''''');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'amount > 100');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'event.payload.amount > 100');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'payload.amount > limit && tenant == who');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'payload.items.exists(i, i.sku == sku)');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'SELECT * FROM outbox.events');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => '"; DROP TABLE outbox.events; --');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'x''; DROP TABLE outbox.events; --');
-- filters too deep or too long to parse or evaluate safely (they once crashed the server: the
-- parser and the evaluator recurse per level)
SELECT outbox.subscribe('sub3', queue => 'q2', filter => repeat('(', 60) || 'true' || repeat(')', 60));
SELECT outbox.subscribe('sub3', queue => 'q2', filter => repeat('[', 60) || '1' || repeat(']', 60) || ' == 1');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'topic' || repeat('.a', 5000) || ' == 1');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => '1' || repeat(' + 1', 300) || ' > 0');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => '1' || repeat('+1', 1000) || ' > 0');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'payload.a' || repeat('.a', 40) || ' > 1');
-- matches() with a pattern built at run time, or a literal too long (a regex is compiled per
-- pattern: its size is what the budget cannot bound)
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'subject.matches(payload.pattern)');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'subject.matches("^a" + "b")');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'subject.matches("' || repeat('a', 257) || '")');
-- a worst case past the static cost limit: comprehensions nested over event data, or over
-- literal lists that multiply past it
SELECT outbox.subscribe('sub3', queue => 'q2', filter => 'payload.items.all(a, payload.items.all(b, a + b >= 0))');
SELECT outbox.subscribe('sub3', queue => 'q2', filter => '[[0,1,2,3,4,5,6,7,8,9]].all(L, L.all(a, L.all(b, true)))');
-- accepted, though the workers then count an error on every event: a filter that does not give
-- a boolean
BEGIN;
SELECT outbox.subscribe('sub-not-bool', queue => 'q2', filter => 'payload') IS NOT NULL AS accepted;
ROLLBACK;
-- max_attempts out of range
SELECT outbox.subscribe('sub3', queue => 'q2', max_attempts => 0);
SELECT outbox.subscribe('sub3', queue => 'q2', max_attempts => -1);
SELECT outbox.subscribe('sub3', queue => 'q2', max_attempts => 1001);
SELECT outbox.subscribe('sub3', queue => 'q2', max_attempts => 2147483647);
-- topics
SELECT outbox.subscribe('sub3', ARRAY[]::text[], queue => 'q2');
SELECT outbox.subscribe('sub3', ARRAY[NULL]::text[], queue => 'q2');
SELECT outbox.subscribe('sub3', ARRAY['orders.#', ''], queue => 'q2');
SELECT outbox.subscribe('sub3', ARRAY['orders..x'], queue => 'q2');
SELECT outbox.subscribe('sub3', ARRAY['orders.*x'], queue => 'q2');
SELECT outbox.subscribe('sub3', ARRAY['x''; DROP TABLE outbox.events; --'], queue => 'q2');
-- start_at
SELECT outbox.subscribe('sub3', queue => 'q2', start_at => '');
SELECT outbox.subscribe('sub3', queue => 'q2', start_at => 'beginning');
SELECT outbox.subscribe('sub3', queue => 'q2', start_at => '1:');
SELECT outbox.subscribe('sub3', queue => 'q2', start_at => '-1:2');
SELECT pg_temp.refused($$SELECT outbox.subscribe('sub3', queue => 'q2', start_at => '18446744073709551615:1')$$, show_detail => false);

-- ================================= pause_subscription, resume_subscription, unsubscribe
SELECT outbox.pause_subscription(NULL);
SELECT outbox.pause_subscription('');
SELECT outbox.pause_subscription(repeat('n', 64));
SELECT outbox.pause_subscription(repeat('n', 1000));
SELECT outbox.pause_subscription('x''; DROP TABLE outbox.events; --');
SELECT outbox.pause_subscription('nope');
SELECT outbox.pause_subscription('c1');
SELECT outbox.pause_subscription('s1');
SELECT outbox.resume_subscription(NULL);
SELECT outbox.resume_subscription('');
SELECT outbox.resume_subscription(repeat('n', 64));
SELECT outbox.resume_subscription('x''; DROP TABLE outbox.events; --');
SELECT outbox.resume_subscription('nope');
SELECT outbox.resume_subscription('c1');
SELECT outbox.resume_subscription('h1');
SELECT outbox.unsubscribe(NULL);
SELECT outbox.unsubscribe('');
SELECT outbox.unsubscribe(repeat('n', 64));
SELECT outbox.unsubscribe(repeat('n', 1000));
SELECT outbox.unsubscribe('x''; DROP TABLE outbox.events; --');
SELECT outbox.unsubscribe('.sub1');
SELECT outbox.unsubscribe('nope');
SELECT outbox.unsubscribe('c1');
SELECT outbox.unsubscribe('s1');

-- ====================================================================================== enqueue
-- NULLs
SELECT outbox.enqueue(NULL);
SELECT outbox.enqueue('q1', '{}', NULL, NULL, NULL);
-- queue names
SELECT outbox.enqueue('');
SELECT outbox.enqueue(repeat('q', 64));
SELECT outbox.enqueue(repeat('q', 1000));
SELECT outbox.enqueue('x''; DROP TABLE outbox.jobs; --');
SELECT outbox.enqueue('a b');
SELECT outbox.enqueue('.q1');
SELECT outbox.enqueue('qüeue');
SELECT outbox.enqueue(E'q1\n');
-- payloads that are not objects
SELECT outbox.enqueue('q1', '[]');
SELECT outbox.enqueue('q1', '"mail"');
SELECT outbox.enqueue('q1', '3.14');
SELECT outbox.enqueue('q1', 'null');
-- keys: empty, too long
SELECT outbox.enqueue('q1', '{}', key => '');
SELECT outbox.enqueue('q1', '{}', key => repeat('k', 256));
-- max_attempts out of range
SELECT outbox.enqueue('q1', '{}', max_attempts => 0);
SELECT outbox.enqueue('q1', '{}', max_attempts => -1);
SELECT outbox.enqueue('q1', '{}', max_attempts => 1001);
SELECT outbox.enqueue('q1', '{}', max_attempts => 2147483647);
-- run_at that is not a time
SELECT outbox.enqueue('q1', '{}', run_at => 'tomorrow-ish');
-- accepted: run_at in the far past or future, a key that is already waiting (its job's id)
BEGIN;
SELECT outbox.enqueue('q1', '{}', run_at => '-infinity') IS NOT NULL AS accepted;
SELECT outbox.enqueue('q1', '{}', run_at => 'infinity') IS NOT NULL AS accepted;
SELECT outbox.enqueue('q1', '{"other": true}', key => 'k1') = (SELECT id FROM outbox.jobs WHERE key = 'k1') AS same_job;
ROLLBACK;

-- ======================================================================================== claim
-- NULLs
SELECT * FROM outbox.claim(NULL);
SELECT * FROM outbox.claim('q1', NULL);
-- queue names
SELECT * FROM outbox.claim('');
SELECT * FROM outbox.claim(repeat('q', 64));
SELECT * FROM outbox.claim(repeat('q', 1000));
SELECT * FROM outbox.claim('x''; DROP TABLE outbox.jobs; --');
SELECT * FROM outbox.claim('a b');
SELECT * FROM outbox.claim('qüeue');
-- max_jobs out of range
SELECT * FROM outbox.claim('q1', 0);
SELECT * FROM outbox.claim('q1', -1);
SELECT * FROM outbox.claim('q1', 1001);
SELECT * FROM outbox.claim('q1', 2147483647);
-- leases: zero, negative, longer than a day, months
SELECT * FROM outbox.claim('q1', 1, '0 seconds');
SELECT * FROM outbox.claim('q1', 1, '-30 seconds');
SELECT * FROM outbox.claim('q1', 1, '-1 microsecond');
SELECT * FROM outbox.claim('q1', 1, '1 day 1 second');
SELECT * FROM outbox.claim('q1', 1, '1 mon');
SELECT * FROM outbox.claim('q1', 1, '178000000 years');
SELECT * FROM outbox.claim('q1', 1, 'a while');
-- accepted: a queue nobody uses has nothing to claim
SELECT count(*) AS claimed FROM outbox.claim('nope');

-- ===================================================================== complete, complete_many
SELECT outbox.complete(NULL);
SELECT outbox.complete_many(NULL);
-- accepted, returning false or 0: jobs that do not exist or are not claimed (the waiting job)
SELECT outbox.complete(-1);
SELECT outbox.complete(0);
SELECT outbox.complete(9223372036854775807);
SELECT outbox.complete((SELECT id FROM outbox.jobs WHERE key = 'k1'));
SELECT outbox.complete_many(ARRAY[]::bigint[]);
SELECT outbox.complete_many(ARRAY[NULL]::bigint[]);
SELECT outbox.complete_many(ARRAY[-1, 0, 9223372036854775807]);
SELECT outbox.complete_many(ARRAY[(SELECT id FROM outbox.jobs WHERE key = 'k1')]);
SELECT outbox.complete('one');

-- ========================================================================================= fail
SELECT outbox.fail(NULL);
SELECT outbox.fail(NULL, 'boom');
SELECT outbox.fail(1, 'boom', NULL);
-- jobs that do not exist, or are not claimed
SELECT outbox.fail(-1);
SELECT outbox.fail(9223372036854775807, 'boom');
SELECT outbox.fail((SELECT id FROM outbox.jobs WHERE key = 'k1'), 'boom');
SELECT outbox.fail((SELECT id FROM outbox.jobs WHERE key = 'k1'), 'boom', false);

-- ======================================================================================= extend
SELECT outbox.extend(NULL);
SELECT outbox.extend(1, NULL);
SELECT outbox.extend(1, '0 seconds');
SELECT outbox.extend(1, '-1 minute');
SELECT outbox.extend(1, '1 day 1 second');
SELECT outbox.extend(1, '1 mon');
SELECT outbox.extend(1, 'a while');
-- accepted, returning false: jobs that do not exist or are not claimed
SELECT outbox.extend(-1);
SELECT outbox.extend(9223372036854775807, '1 minute');
SELECT outbox.extend((SELECT id FROM outbox.jobs WHERE key = 'k1'), '1 minute');

-- =================================================================================== replay_job
SELECT outbox.replay_job(NULL);
SELECT outbox.replay_job(-1);
SELECT outbox.replay_job(9223372036854775807);
SELECT outbox.replay_job((SELECT id FROM outbox.jobs WHERE key = 'k1'));
SELECT outbox.replay_job('one');

-- ======================================================================================= queues
-- NULLs and bad names
SELECT outbox.create_queue(NULL);
SELECT outbox.create_queue('');
SELECT outbox.create_queue(repeat('q', 64));
SELECT outbox.create_queue('x''; DROP TABLE outbox.queues; --');
SELECT outbox.create_queue('qüeue');
-- expire_after: a fixed length of 1 second to 3650 days (NULL: never)
SELECT outbox.create_queue('q9', expire_after => '0 seconds');
SELECT outbox.create_queue('q9', expire_after => '-1 hour');
SELECT outbox.create_queue('q9', expire_after => '0.5 seconds');
SELECT outbox.create_queue('q9', expire_after => '1 mon');
SELECT outbox.create_queue('q9', expire_after => '3651 days');
SELECT outbox.create_queue('q9', expire_after => 'soon');
SELECT outbox.alter_queue(NULL, '1 hour');
SELECT outbox.alter_queue('a b', '1 hour');
SELECT outbox.alter_queue('nosuch', '1 hour');
SELECT outbox.alter_queue('q1', '1 year');
SELECT outbox.alter_queue('q1', '0 seconds');
SELECT outbox.drop_queue(NULL);
SELECT outbox.drop_queue('q1', NULL);
SELECT outbox.drop_queue('a b');
SELECT outbox.grant_queue(NULL, 'postgres');
SELECT outbox.grant_queue('q1', NULL);
SELECT outbox.grant_queue('q1', 'postgres', NULL);
SELECT outbox.grant_queue('q1', 'postgres', work => NULL);
SELECT outbox.grant_queue('q1', 'no_such_role');
SELECT outbox.revoke_queue(NULL, 'postgres');
SELECT outbox.revoke_queue('q1', NULL);
SELECT outbox.revoke_queue('q1', 'postgres', NULL);
-- a queue that exists already, or does not exist
SELECT outbox.create_queue('q1');
SELECT outbox.drop_queue('nosuch');
SELECT outbox.grant_queue('nosuch', 'postgres');
SELECT outbox.revoke_queue('nosuch', 'postgres');
-- a queue that a subscription feeds, or that still holds jobs
SELECT outbox.drop_queue('q1');
BEGIN;
SELECT outbox.create_queue('q9');
SELECT outbox.enqueue('q9') IS NOT NULL AS enqueued;
SELECT outbox.drop_queue('q9');
ROLLBACK;

-- ===================================================================================== schedule
-- outbox.schedule() checks the name and the topic itself, and the rest in outbox._schedule(),
-- which it runs through SPI: those refusals go through pg_temp.refused() (see above).
-- NULL and bad names, names taken
SELECT outbox.schedule(NULL, every => '1 hour', topic => 'system.tick');
SELECT outbox.schedule('', every => '1 hour', topic => 'system.tick');
SELECT outbox.schedule(repeat('n', 64), every => '1 hour', topic => 'system.tick');
SELECT outbox.schedule(repeat('n', 1000), every => '1 hour', topic => 'system.tick');
SELECT outbox.schedule('x''; DROP TABLE outbox.schedules; --', every => '1 hour', topic => 'system.tick');
SELECT outbox.schedule('a b', every => '1 hour', topic => 'system.tick');
SELECT outbox.schedule('.sch', every => '1 hour', topic => 'system.tick');
SELECT outbox.schedule('schédule', every => '1 hour', topic => 'system.tick');
SELECT pg_temp.refused($$SELECT outbox.schedule('sch1', every => '1 hour', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch2', every => '1 hour', topic => 'system.tick')$$);
-- set_schedule checks as schedule does; a replacement that fails leaves the schedule as it was
SELECT outbox.set_schedule(NULL, every => '1 hour', topic => 'system.tick');
SELECT outbox.set_schedule('a b', every => '1 hour', topic => 'system.tick');
SELECT outbox.set_schedule('sch3', every => '1 hour', topic => 'system..tick');
SELECT pg_temp.refused($$SELECT outbox.set_schedule('sch3', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.set_schedule('sch1', daily_at => '02:30', zone => 'PST', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.set_schedule('sch1', every => '1 hour', topic => 'system.tick', queue => 'q1')$$);
-- neither form, or both
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', daily_at => '02:30', zone => 'UTC', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', zone => 'UTC', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', weekly_on => 'monday', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', zone => 'UTC', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', weekly_on => 'monday', topic => 'system.tick')$$);
-- every: zero, negative, below a second, months, years, too long, not an interval
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '0 seconds', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '-1 hour', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 day -25 hours', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '0.5 seconds', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 microsecond', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 mon', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 mon -30 days', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 year', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '3651 days', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '87601 hours', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '178000000 years', topic => 'system.tick')$$);
SELECT outbox.schedule('sch3', every => 'fortnightly', topic => 'system.tick');
-- daily_at: without a zone, 24:00, not a time
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '24:00', zone => 'UTC', topic => 'system.tick')$$);
SELECT outbox.schedule('sch3', daily_at => '25:00', zone => 'UTC', topic => 'system.tick');
SELECT outbox.schedule('sch3', daily_at => '02:60', zone => 'UTC', topic => 'system.tick');
SELECT outbox.schedule('sch3', daily_at => 'half past two', zone => 'UTC', topic => 'system.tick');
-- zones that are not tz database names
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => '', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'PST', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'CEST', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => '+02', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'UTC+3', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'EST5EDT,M3.2.0,M11.1.0', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'Mars/Olympus_Mons', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'Europe/Berlin ', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'x''; DROP TABLE outbox.schedules; --', topic => 'system.tick')$$);
-- weekly_on: not a day
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'UTC', weekly_on => '', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'UTC', weekly_on => 'funday', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'UTC', weekly_on => 'mo', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'UTC', weekly_on => 'monday ', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'UTC', weekly_on => '1', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'UTC', weekly_on => 'montag', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', daily_at => '02:30', zone => 'UTC', weekly_on => 'x''; DROP TABLE outbox.schedules; --', topic => 'system.tick')$$);
-- targets: neither, both, a bad topic, a bad queue
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', topic => 'system.tick', queue => 'q1')$$);
SELECT outbox.schedule('sch3', every => '1 hour', topic => '');
SELECT outbox.schedule('sch3', every => '1 hour', topic => 'system..tick');
SELECT outbox.schedule('sch3', every => '1 hour', topic => 'system.*');
SELECT outbox.schedule('sch3', every => '1 hour', topic => 'x''; DROP TABLE outbox.events; --');
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', queue => '')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', queue => repeat('q', 64))$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', queue => 'x''; DROP TABLE outbox.jobs; --')$$);
-- payloads that are not objects
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', topic => 'system.tick', payload => '[]')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', topic => 'system.tick', payload => '"tick"')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', payload => '1')$$);
-- at: a one-off run at a local date and time in a zone, nothing of the other forms, not past
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', at => '2099-01-01 09:00', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', at => '2099-01-01 09:00', zone => 'UTC', every => '1 hour', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', at => '2099-01-01 09:00', zone => 'UTC', daily_at => '09:00', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', at => '2099-01-01 09:00', zone => 'UTC', weekly_on => 'monday', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', at => '2099-01-01 09:00', zone => 'PST', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', at => '2000-01-01 09:00', zone => 'UTC', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', at => 'infinity', zone => 'UTC', topic => 'system.tick')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', at => '-infinity', zone => 'UTC', topic => 'system.tick')$$);
SELECT outbox.schedule('sch3', at => 'next tuesday', zone => 'UTC', topic => 'system.tick');
SELECT outbox.schedule('sch3', at => '2099-02-30 09:00', zone => 'UTC', topic => 'system.tick');
-- each: one query or a function of no arguments, jobs only, no payload, checked as the caller
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', topic => 'system.tick', each => 'SELECT 1')$$);
SELECT pg_temp.refused($$SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', payload => '{"a": 1}', each => 'SELECT 1')$$);
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => '');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => '   ');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => ';');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => 'SELECT 1; SELECT 2');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => 'DELETE FROM outbox.jobs');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => 'SELECT * INTO pg_temp.x FROM outbox.jobs');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => 'SELECT 1) r; DROP TABLE outbox.jobs; SELECT (1');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => 'SELEC 1');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => 'SELECT * FROM no_such_table');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => 'no_such_function');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => 'pg_catalog.lower()');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => E'SELECT 1\u0000');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1', each => 'WITH d AS (DELETE FROM outbox.jobs RETURNING *) SELECT * FROM d');

-- =================================================================================== unschedule
SELECT outbox.unschedule(NULL);
-- accepted, returning false: no such schedule, whatever the name
SELECT outbox.unschedule('nope');
SELECT outbox.unschedule('');
SELECT outbox.unschedule(repeat('n', 1000));
SELECT outbox.unschedule('x''; DROP TABLE outbox.schedules; --');
SELECT outbox.unschedule('SCH1');

-- ================================================================ a role that may not (42501)
CREATE ROLE outbox_bad_input NOLOGIN;
GRANT USAGE ON SCHEMA outbox TO outbox_bad_input;
GRANT EXECUTE ON FUNCTION outbox.advance(text, text), outbox.rewind(text, text), outbox.drop_consumer(text),
      outbox.create_sink(text, regprocedure, text[], integer, text), outbox.pause_sink(text), outbox.drop_sink(text),
      outbox.alter_sink(text, jsonb), outbox.alter_consumer(text, jsonb),
      outbox.alter_subscription(text, jsonb),
      outbox.replay(text), outbox.subscribe(text, text[], regprocedure, text, text, integer, text),
      outbox.unsubscribe(text), outbox.schedule(text, interval, time, text, text, text, text, jsonb, timestamp, text),
      outbox.unschedule(text), outbox.claim(text, integer, interval), outbox.complete_many(bigint[]),
      outbox.fail(bigint, text, boolean), outbox.extend(bigint, interval), outbox.replay_job(bigint),
      outbox.drop_queue(text, boolean), outbox.grant_queue(text, regrole, boolean, boolean),
      outbox.revoke_queue(text, regrole, boolean, boolean) TO outbox_bad_input;
CREATE FUNCTION public.private_sink(events outbox.event[]) RETURNS void LANGUAGE sql AS $$ SELECT $$;
CREATE FUNCTION public.private_job(e outbox.event) RETURNS void LANGUAGE sql AS $$ SELECT $$;
REVOKE EXECUTE ON FUNCTION public.private_sink(outbox.event[]), public.private_job(outbox.event) FROM PUBLIC;
SELECT id AS k1_job FROM outbox.jobs WHERE key = 'k1' \gset
SET ROLE outbox_bad_input;
-- no EXECUTE on the function
SELECT outbox.raise('order.placed');
SELECT outbox.enqueue('q1');
SELECT outbox.create_http_sink('h2', 'https://hooks.example.com/in');
SELECT outbox.prune();
-- not the owner
SELECT outbox.advance('c1', '1:1');
SELECT outbox.rewind('c1', '1:1');
SELECT outbox.drop_consumer('c1');
SELECT outbox.alter_consumer('c1', '{"read_by": "ticks"}');
SELECT outbox.alter_subscription('sub1', '{"read_by": "ticks"}');
SELECT outbox.pause_sink('s1');
SELECT outbox.alter_sink('s1', '{"synchronous_commit": false}');
SELECT outbox.drop_sink('h1');
SELECT outbox.replay('s1');
SELECT outbox.unsubscribe('sub1');
SELECT outbox.unschedule('sch1');
-- another role's queue
SELECT * FROM outbox.claim('q1');
SELECT outbox.fail(:k1_job, 'x');
SELECT outbox.extend(:k1_job);
SELECT outbox.replay_job(:k1_job);
SELECT outbox.drop_queue('q1');
SELECT outbox.grant_queue('q1', 'outbox_bad_input');
SELECT outbox.revoke_queue('q1', 'postgres');
-- a handler the role may not execute
SELECT outbox.create_sink('s2', 'private_sink(outbox.event[])');
SELECT outbox.subscribe('sub3', handler => 'private_job(outbox.event)');
-- a schedule whose runs would call what the role may not
SELECT outbox.schedule('sch3', every => '1 hour', topic => 'system.tick');
SELECT outbox.schedule('sch3', every => '1 hour', queue => 'q1');
-- the tables themselves
SELECT count(*) FROM outbox.events;
DELETE FROM outbox.jobs;
RESET ROLE;
DROP OWNED BY outbox_bad_input;
DROP ROLE outbox_bad_input;

-- ==================================================================================== unchanged
SELECT b.tab, b.md5 = n.md5 AS unchanged FROM fingerprint_before b JOIN fingerprint_now n USING (tab) ORDER BY b.tab;
SELECT (SELECT count(*) FROM outbox.events) AS events, (SELECT count(*) FROM outbox.consumers) AS consumers,
       (SELECT count(*) FROM outbox.sinks) AS sinks, (SELECT count(*) FROM outbox.http_sinks) AS http_sinks,
       (SELECT count(*) FROM outbox.subscriptions) AS subscriptions, (SELECT count(*) FROM outbox.jobs) AS jobs,
       (SELECT count(*) FROM outbox.schedules) AS schedules, (SELECT count(*) FROM outbox.dead_letters) AS dead_letters;
