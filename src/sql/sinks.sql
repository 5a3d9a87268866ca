-- Sinks: consumers the background worker pushes batches to. A sink's cursor is its row in
-- outbox.consumers (kind 'sink'), so pruning and rewind treat it like every other consumer.
CREATE TABLE outbox.sinks (
    id                text        NOT NULL PRIMARY KEY
                                  REFERENCES outbox.consumers (name) ON DELETE CASCADE,
    kind              text        NOT NULL DEFAULT 'sql' CHECK (kind IN ('sql', 'http', 'kafka')),
    -- SQL sinks: runs as the role that created the sink (outbox.consumers.owner), never as the
    -- worker's. HTTP and Kafka sinks: NULL, see outbox.http_sinks and outbox.kafka_sinks.
    handler           regprocedure CHECK ((handler IS NOT NULL) = (kind = 'sql')),
    topics            text[],                     -- patterns; NULL: every topic
    topic_regex       text,                       -- the patterns compiled; NULL: every topic
    batch_size        integer     NOT NULL CHECK (batch_size BETWEEN 1 AND 10000),
    -- Failure policy state (see dispatch/policy in the core crate).
    current_batch     integer     NOT NULL CHECK (current_batch >= 1),
    attempts          integer     NOT NULL DEFAULT 0,
    -- HTTP sinks: consecutive transient failures (5xx, timeouts), counted apart from attempts so
    -- that an outage never pushes an event towards the dead letters.
    transient         integer     NOT NULL DEFAULT 0,
    next_attempt_at   timestamptz,
    down              boolean     NOT NULL DEFAULT false,
    paused            boolean     NOT NULL DEFAULT false,
    last_error        text,
    last_sqlstate     text,
    last_error_at     timestamptz,
    last_delivered_at timestamptz,
    delivered         bigint      NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- Key of the sink's lease (see src/lease.rs).
    lease_key         integer     GENERATED ALWAYS AS IDENTITY,
    -- Failed deliveries since the sink was created (a batch, a lone event, a neighbour test, a
    -- request): with `delivered`, the counters metrics export.
    failures          bigint      NOT NULL DEFAULT 0,
    -- Off (outbox.alter_sink): the sink's delivery transactions commit without waiting for the
    -- flush of their WAL. A crash may lose the last of them, handler's writes and cursor
    -- together, and those events are delivered again.
    synchronous_commit boolean    NOT NULL DEFAULT true
);

-- Where an HTTP sink posts, and how. No role but the extension's owner can read it: the headers
-- and the secret are credentials. outbox.status() shows none of them.
CREATE TABLE outbox.http_sinks (
    id         text    NOT NULL PRIMARY KEY REFERENCES outbox.sinks (id) ON DELETE CASCADE,
    url        text    NOT NULL,
    headers    jsonb   NOT NULL DEFAULT '{}' CHECK (pg_catalog.jsonb_typeof(headers) = 'object'),
    secret     text,
    timeout_ms integer NOT NULL CHECK (timeout_ms BETWEEN 100 AND 600000)
);

-- Where a Kafka sink produces, and how (src/dispatch/kafka.rs). No role but the extension's owner
-- can read it: properties may hold credentials (sasl.password, ssl.key.pem, ssl.key.password).
-- outbox.status() shows none of it.
CREATE TABLE outbox.kafka_sinks (
    id          text    NOT NULL PRIMARY KEY REFERENCES outbox.sinks (id) ON DELETE CASCADE,
    -- host:port[,host:port...], checked against pg_outbox.kafka_allowed_brokers at each pass.
    brokers     text    NOT NULL,
    -- A Kafka topic, or a template with {topic} (the event's topic) once.
    kafka_topic text    NOT NULL,
    -- The message key: the event's subject, its tenant, or none.
    key         text    NOT NULL CHECK (key IN ('subject', 'tenant', 'none')),
    -- librdkafka properties from pg_outbox_core::kafka's allowlist.
    properties  jsonb   NOT NULL DEFAULT '{}' CHECK (pg_catalog.jsonb_typeof(properties) = 'object'),
    -- A message not acknowledged within this long fails (message.timeout.ms).
    timeout_ms  integer NOT NULL CHECK (timeout_ms BETWEEN 1000 AND 600000)
);

-- One event as an HTTP sink sends it: a CloudEvents 1.0 JSON object. Optional attributes that
-- are NULL are left out (CloudEvents' rule); position and tenant are extension attributes, and
-- the event's traceparent and tracestate headers (strings) become the attributes of the
-- CloudEvents distributed tracing extension.
CREATE FUNCTION outbox._cloudevent(e outbox.event) RETURNS jsonb
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT jsonb_build_object('specversion', '1.0', 'id', e.id, 'source', '/pg_outbox/' || regexp_replace(current_database(), '[^A-Za-z0-9._~-]', '_', 'g'),
                              'type', e.topic, 'time', e.raised_at, 'datacontenttype', 'application/json',
                              'data', e.payload, 'position', e.position)
           || CASE WHEN e.subject IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('subject', e.subject) END
           || CASE WHEN e.tenant IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('tenant', e.tenant) END
           || CASE WHEN jsonb_typeof(e.headers -> 'traceparent') = 'string'
                   THEN jsonb_build_object('traceparent', e.headers -> 'traceparent') ELSE '{}'::jsonb END
           || CASE WHEN jsonb_typeof(e.headers -> 'tracestate') = 'string'
                   THEN jsonb_build_object('tracestate', e.headers -> 'tracestate') ELSE '{}'::jsonb END
$$;

-- Events a sink could never accept, kept for inspection and replay.
CREATE TABLE outbox.dead_letters (
    sink                text            NOT NULL REFERENCES outbox.sinks (id) ON DELETE CASCADE,
    txid                pg_catalog.xid8 NOT NULL,
    seq                 bigint          NOT NULL,
    event               outbox.event    NOT NULL,
    error               text            NOT NULL,
    sqlstate            text,
    attempts            integer         NOT NULL,
    dead_at             timestamptz     NOT NULL DEFAULT pg_catalog.now(),
    -- Set by outbox.replay(); the worker re-delivers and deletes the row, or clears this again.
    replay_requested_at timestamptz,
    PRIMARY KEY (sink, txid, seq)
);
