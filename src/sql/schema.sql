-- pg_outbox schema: the event log, the composite readers receive, cursors, and the read rule.
-- Every name is schema-qualified and every function pins search_path: the install script and the
-- functions run as the installing superuser, and an unqualified name is a hijack waiting to happen.

-- Positions survive pg_dump and pg_restore into another cluster (src/lineage.rs): a position's
-- txid is the transaction id plus this database's epoch in its top 16 bits. _log_txid() makes
-- one for the current transaction; _log_horizon() is the read rule's bound in the same terms.
CREATE FUNCTION outbox._log_txid() RETURNS pg_catalog.xid8
VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'pg_outbox_log_txid';
CREATE FUNCTION outbox._log_horizon() RETURNS pg_catalog.xid8
STABLE PARALLEL SAFE LANGUAGE c AS 'MODULE_PATHNAME', 'pg_outbox_log_horizon';
-- Which partition of the log the current transaction's events go to (src/prune.rs).
CREATE FUNCTION outbox._log_part() RETURNS smallint
STABLE PARALLEL SAFE LANGUAGE c AS 'MODULE_PATHNAME', 'pg_outbox_log_part';

-- Which cluster and database this log's positions belong to, and its epoch. One row; after a
-- restore elsewhere two, until the first raise adopts the log (src/lineage.rs). Dumped with the
-- log, like every table of the extension (see privileges.sql).
CREATE TABLE outbox.lineage (
    system_identifier bigint      NOT NULL,   -- pg_control_system() of the cluster
    database          oid         NOT NULL,   -- the database in that cluster
    epoch             integer     NOT NULL CHECK (epoch BETWEEN 0 AND 65535),
    raised            boolean     NOT NULL DEFAULT false,   -- positions were made here
    since             timestamptz NOT NULL DEFAULT pg_catalog.now()
);
INSERT INTO outbox.lineage (system_identifier, database, epoch)
SELECT s.system_identifier, d.oid, 0
  FROM pg_catalog.pg_control_system() s, pg_catalog.pg_database d
 WHERE d.datname = pg_catalog.current_database();

-- seq only has to increase within one transaction (positions order by txid first), so each
-- backend may cache a block of numbers: that takes the sequence off the hot path of 8 writers.
CREATE SEQUENCE outbox.events_seq AS bigint CACHE 64;

CREATE TABLE outbox.events (
    txid      pg_catalog.xid8        NOT NULL DEFAULT outbox._log_txid(),
    seq       bigint                 NOT NULL DEFAULT pg_catalog.nextval('outbox.events_seq'::pg_catalog.regclass),
    id        uuid                   NOT NULL,
    topic     text                   NOT NULL,
    subject   text,
    tenant    text,
    payload   jsonb                  NOT NULL,
    headers   jsonb                  NOT NULL DEFAULT '{}',
    raised_at timestamptz            NOT NULL DEFAULT pg_catalog.now(),
    -- The partition: chosen by the time the transaction began, so that each partition takes the
    -- new events for one period in turn (see outbox.log_rotation).
    part      smallint               NOT NULL DEFAULT outbox._log_part(),
    -- The only index: readers scan it from a cursor (its first two columns are the position).
    -- Every extra index would cost every raise.
    CONSTRAINT events_pkey PRIMARY KEY (txid, seq, part),
    -- raise() checks these with a clear message; the constraints keep the log sound against any
    -- other writer (a superuser's INSERT, a restore).
    CONSTRAINT events_payload_object CHECK (pg_catalog.jsonb_typeof(payload) = 'object'),
    CONSTRAINT events_headers_object CHECK (pg_catalog.jsonb_typeof(headers) = 'object')
) PARTITION BY LIST (part);
ALTER SEQUENCE outbox.events_seq OWNED BY outbox.events.seq;

-- Four partitions take the new events in turn, each for one period of
-- (pg_outbox.retention + pg_outbox.prune_interval) / 2. The workers prune the log by truncating a
-- partition once every reader has passed all of it and its newest event is older than the
-- retention: no DELETE, no dead tuples, no index bloat (PgQ rotates its tables the same way).
CREATE TABLE outbox.events_0 PARTITION OF outbox.events FOR VALUES IN (0);
CREATE TABLE outbox.events_1 PARTITION OF outbox.events FOR VALUES IN (1);
CREATE TABLE outbox.events_2 PARTITION OF outbox.events FOR VALUES IN (2);
CREATE TABLE outbox.events_3 PARTITION OF outbox.events FOR VALUES IN (3);

-- The period the workers last saw, and since when. A partition is truncated by the time its
-- period ended only once the period has been the same for a whole retention: events raised
-- under another period may sit in any partition.
CREATE TABLE outbox.log_rotation (
    period_s bigint      NOT NULL CHECK (period_s > 0),
    since    timestamptz NOT NULL
);

COMMENT ON TABLE outbox.events IS
    'The event log. Read it through outbox.read() or a sink; positions order by (txid, seq).';

-- What readers and sinks receive. The position is text "<txid>:<seq>"; order by the log, never
-- by this text. Fan-out (src/dispatch/fanout.rs, INSERT_SQL and WAITING_SQL) names these
-- attributes in this order when it unnests an outbox.event[]: change them together.
CREATE TYPE outbox.event AS (
    id        uuid,
    position  text,
    topic     text,
    subject   text,
    tenant    text,
    payload   jsonb,
    headers   jsonb,
    raised_at timestamptz
);

-- One row per consumer: its cursor is the position of the last event it has consumed.
CREATE TABLE outbox.consumers (
    name       text                   NOT NULL PRIMARY KEY,
    kind       text                   NOT NULL DEFAULT 'pull' CHECK (kind IN ('pull', 'sink', 'subscription')),
    txid       pg_catalog.xid8        NOT NULL,
    seq        bigint                 NOT NULL,
    -- The role that created the consumer; only its members (or a superuser) may move or drop it.
    -- regrole: a dump names the role, and a restore finds it by name in the new cluster.
    owner      regrole                NOT NULL,
    -- Bumped by each outbox.rewind(): the only way the trigger below lets a cursor move back.
    rewinds    bigint                 NOT NULL DEFAULT 0,
    created_at timestamptz            NOT NULL DEFAULT pg_catalog.now(),
    moved_at   timestamptz            NOT NULL DEFAULT pg_catalog.now(),
    -- How the reader reads the log: by the read horizon (below), or by ticks (src/sql/ticks.sql),
    -- which no long transaction holds back. A reader by ticks is in the batch of tick `tick`: the
    -- events of the transactions that snapshot `upto` (the tick's) sees and `since` does not, read
    -- through (txid, seq); it keeps both, so that pruning ticks never takes its batch away. All
    -- NULL: (txid, seq) is a cursor of the read horizon's, which the reader turns into a batch
    -- when it next reads (src/dispatch/mod.rs): how every reader starts, and where a rewind puts it.
    read_by    text                   NOT NULL DEFAULT 'horizon',
    tick       bigint,
    since      pg_catalog.pg_snapshot,
    upto       pg_catalog.pg_snapshot,
    CONSTRAINT consumers_read_by CHECK (read_by IN ('horizon', 'ticks')),
    CONSTRAINT consumers_batch CHECK ((tick IS NULL) = (since IS NULL) AND (tick IS NULL) = (upto IS NULL)
                                      AND (tick IS NULL OR read_by = 'ticks'))
);

-- Forward-only cursors, enforced by the database itself: whatever code path updates a cursor, a
-- stale or concurrent writer cannot move it back. outbox.rewind() is the one way back, and it
-- says so by bumping rewinds in the same UPDATE. A reader by ticks moves by (tick, txid, seq),
-- and a cursor of the read horizon's is before every batch.
CREATE FUNCTION outbox._cursor_forward_only() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF (coalesce(NEW.tick, 0), NEW.txid, NEW.seq) < (coalesce(OLD.tick, 0), OLD.txid, OLD.seq)
       AND NEW.rewinds <> OLD.rewinds + 1 THEN
        RAISE EXCEPTION 'cursor of consumer "%" cannot move back from %:% to %:%',
            OLD.name, OLD.txid, OLD.seq, NEW.txid, NEW.seq
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'outbox.rewind() moves a cursor back on purpose';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER consumers_forward_only BEFORE UPDATE OF txid, seq, tick ON outbox.consumers
    FOR EACH ROW EXECUTE FUNCTION outbox._cursor_forward_only();

-- THE READ RULE. Every reader in pg_outbox -- outbox.read(), the worker's sinks and fan-out, the
-- tests -- reads through this one function (or _read_after, the same rows as outbox.event), and
-- nowhere else.
--
-- Sequence numbers are drawn at insert but transactions commit in another order: A takes seq 41,
-- B takes 42, B commits first. A reader that saw 42 and moved past it would never see 41. So only
-- transactions older than the oldest one still running (the snapshot's xmin) are read: they have
-- all ended, and nothing can commit behind a cursor any more. Ordering is by the columns, never
-- by the text of a position.
--
-- Neither STRICT nor SET search_path, so that the planner inlines it into the statement that reads
-- through it (the workers keep those plans: nothing is parsed, planned or materialised per window).
-- In exchange every name and operator in it is schema-qualified, so that it means the same under
-- any search_path (tested against a hostile one), and a NULL argument reads nothing, as STRICT did.
-- The columns are the log's own (no position text is made): fan-out reads them as they are.
CREATE FUNCTION outbox._read_log(after_txid pg_catalog.xid8, after_seq bigint, max_events integer)
RETURNS TABLE (txid pg_catalog.xid8, seq bigint, id uuid, topic text, subject text, tenant text,
               payload jsonb, headers jsonb, raised_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT e.txid, e.seq, e.id, e.topic, e.subject, e.tenant, e.payload, e.headers, e.raised_at
      FROM outbox.events e
     WHERE e.txid OPERATOR(pg_catalog.<) outbox._log_horizon()
       AND ROW(e.txid, e.seq) OPERATOR(pg_catalog.>) ROW(after_txid, after_seq)
       AND after_txid IS NOT NULL AND after_seq IS NOT NULL
     ORDER BY e.txid, e.seq
     LIMIT COALESCE(max_events, 0)
$$;

-- The read rule's rows as readers receive them. Ordered by the columns again: the planner knows
-- the inlined rows come in that order, so this costs no sort.
CREATE FUNCTION outbox._read_after(after_txid pg_catalog.xid8, after_seq bigint, max_events integer)
RETURNS SETOF outbox.event
LANGUAGE sql STABLE AS $$
    SELECT r.id,
           (r.txid::pg_catalog.text OPERATOR(pg_catalog.||) ':') OPERATOR(pg_catalog.||) r.seq::pg_catalog.text,
           r.topic, r.subject, r.tenant, r.payload, r.headers, r.raised_at
      FROM outbox._read_log(after_txid, after_seq, max_events) r
     ORDER BY r.txid, r.seq
$$;

-- A consumer that reads by ticks (src/sql/ticks.sql) reads the rest of its batch, then the batches
-- of the ticks after it, in order, each from the snapshot the one before ends at; advance() finds
-- a position's batch the same way (src/cursor.rs). The ticks are flushed to disk before their
-- batches are handed out (outbox._flush_log).
CREATE FUNCTION outbox.read(consumer text, max_events integer DEFAULT 100)
RETURNS SETOF outbox.event
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    c outbox.consumers;
    t record;
    r record;
    got bigint;
    left_over bigint;
    flushed boolean := false;
BEGIN
    IF consumer IS NULL THEN
        RAISE EXCEPTION 'consumer must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF max_events IS NULL THEN
        RAISE EXCEPTION 'max_events must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- The rule of pg_outbox_core::name, so that a bad name says so rather than "does not exist".
    IF consumer !~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION 'invalid consumer name "%"', consumer USING ERRCODE = 'invalid_name',
            HINT = 'a consumer name is 1 to 63 letters, digits, ''_'', ''-'' or ''.'', starting with a letter or digit';
    END IF;
    -- 100000: pg_outbox_core::limits::READ_MAX (the result is materialised).
    IF max_events < 1 OR max_events > 100000 THEN
        RAISE EXCEPTION 'max_events must be between 1 and 100000, not %', max_events
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO c FROM outbox.consumers WHERE name = consumer;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'consumer "%" does not exist', consumer
            USING ERRCODE = 'undefined_object',
                  HINT = 'create it with outbox.create_consumer()';
    END IF;
    IF c.tick IS NULL THEN
        RETURN QUERY SELECT * FROM outbox._read_after(c.txid, c.seq, max_events);
        RETURN;
    END IF;
    -- The rest of the consumer's batch, then the batches of the ticks after it (c.since, c.upto
    -- and the position after which to read move on to each). Each is read as one range of the
    -- log when it can be (outbox._batch_range), both its parts otherwise.
    left_over := max_events;
    LOOP
        SELECT * INTO r FROM outbox._batch_range(c.since::text, c.upto::text, c.txid::text, c.seq);
        IF FOUND THEN
            RETURN QUERY SELECT * FROM outbox._range_after(r.after_txid::xid8, r.after_seq, r.below::xid8,
                                                           r.running::pg_snapshot, left_over::integer);
        ELSE
            RETURN QUERY SELECT * FROM outbox._batch_after(c.since, c.upto, c.txid, c.seq, left_over::integer);
        END IF;
        GET DIAGNOSTICS got = ROW_COUNT;
        left_over := left_over - got;
        EXIT WHEN left_over <= 0;
        SELECT k.tick, k.snapshot INTO t FROM outbox.ticks k WHERE k.tick > c.tick ORDER BY k.tick LIMIT 1;
        EXIT WHEN NOT FOUND;
        IF NOT flushed THEN
            PERFORM outbox._flush_log();
            flushed := true;
        END IF;
        c.since := c.upto;
        c.upto := t.snapshot;
        c.tick := t.tick;
        c.txid := '0';
        c.seq := 0;
    END LOOP;
END
$$;

COMMENT ON FUNCTION outbox.read(text, integer) IS
    'The next events after the consumer''s cursor, in the order it reads them; does not move the cursor.';
