-- Ticks: snapshots of which transactions had ended, taken one after another by the workers, so
-- that readers can read the log batch by batch without waiting for the oldest transaction still
-- running (issue 15; PgQ's ticks are the prior art). A batch is the events of the transactions
-- visible in one tick's snapshot and not in the previous tick's: snapshots taken later only ever
-- see more transactions end, so every committed event falls in exactly one batch, and a long
-- transaction delays only its own events, which land in the first batch after it ends.
--
-- The snapshots are in the log's terms (each transaction id as positions carry it, see
-- src/lineage.rs), so pg_visible_in_snapshot(e.txid, snapshot) is the test for an event e.

-- The current statement's snapshot in the log's terms, as pg_snapshot text.
CREATE FUNCTION outbox._log_snapshot() RETURNS text
VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'pg_outbox_log_snapshot';

CREATE TABLE outbox.ticks (
    -- In the order taken: each tick's snapshot sees every transaction the one before saw. The log's
    -- epoch is in the top bits (epoch << 40, then 1, 2, 3...), so that the ticks taken after a
    -- restored log is adopted (in a new epoch) number after every restored one, whichever of the
    -- two pg_restore writes first.
    tick     bigint                 PRIMARY KEY CHECK (tick > 0),
    snapshot pg_catalog.pg_snapshot NOT NULL,
    taken_at timestamptz            NOT NULL DEFAULT pg_catalog.now(),
    -- Where it was taken (as outbox.lineage names a log): restored ticks name another.
    cluster  bigint                 NOT NULL,
    database oid                    NOT NULL
);

-- outbox._tick(), which takes a tick, is in src/ticks.rs.

-- The tick before `tick`: the one whose snapshot its batch starts from (for the first tick of a
-- new epoch, the last one restored). 0 (no transaction seen) when there is none: the first tick
-- of the log, and the first tick kept once older ones are pruned (whose batch then holds every
-- event the log keeps up to it; a reader by ticks keeps the snapshot its batch starts from).
CREATE FUNCTION outbox._tick_before(tick bigint) RETURNS bigint
LANGUAGE sql STABLE STRICT SET search_path = pg_catalog, pg_temp AS $$
    SELECT COALESCE(pg_catalog.max(t.tick), 0) FROM outbox.ticks t
     WHERE t.tick OPERATOR(pg_catalog.<) _tick_before.tick
$$;

-- The snapshot of tick `tick`; tick 0 (before the first) sees no transaction. A tick that does not
-- exist (pruned, or not taken yet) is an error: a batch from it would be empty, not complete.
CREATE FUNCTION outbox._tick_snapshot(tick bigint) RETURNS pg_catalog.pg_snapshot
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    s pg_snapshot;
BEGIN
    IF tick IS NULL THEN
        RAISE EXCEPTION 'tick must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF tick = 0 THEN
        RETURN '1:1:'::pg_snapshot;
    END IF;
    SELECT t.snapshot INTO s FROM outbox.ticks t WHERE t.tick = _tick_snapshot.tick;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'tick % does not exist', tick USING ERRCODE = 'object_not_in_prerequisite_state',
            HINT = 'ticks are pruned once every reader has passed them';
    END IF;
    RETURN s;
END
$$;

-- The events of the transactions snapshot `b` sees and snapshot `a` does not, after
-- (after_txid, after_seq), at most max_events, in the order of the log's columns (a transaction's
-- events together, in the order it raised them): a batch between two ticks (_tick_log), and what
-- _tick asks of the batch it would take. Those transactions are the ones `a` saw running, and
-- those that began after it (from its xmax): two index scans, however old the oldest transaction
-- still running. Inlined into its callers: no SET, every name and operator qualified.
CREATE FUNCTION outbox._snapshot_log(a pg_catalog.pg_snapshot, b pg_catalog.pg_snapshot,
                                     after_txid pg_catalog.xid8, after_seq bigint, max_events integer)
RETURNS TABLE (txid pg_catalog.xid8, seq bigint, id uuid, topic text, subject text, tenant text,
               payload jsonb, headers jsonb, raised_at timestamptz)
LANGUAGE sql STABLE AS $$
    WITH s AS MATERIALIZED (
        -- Of those `a` saw running, the ones `b` sees ended: a transaction still running (a long
        -- one with many events, say) is not scanned for at every tick.
        SELECT t.a, t.b, ARRAY(SELECT x FROM pg_catalog.pg_snapshot_xip(t.a) x
                                WHERE pg_catalog.pg_visible_in_snapshot(x, t.b)) AS running
          FROM (SELECT a, b OFFSET 0) t)
    SELECT e.txid, e.seq, e.id, e.topic, e.subject, e.tenant, e.payload, e.headers, e.raised_at
      FROM ((SELECT r.* FROM outbox.events r
             WHERE r.txid OPERATOR(pg_catalog.=) ANY ((SELECT s.running FROM s)::pg_catalog.xid8[])
               AND pg_catalog.pg_visible_in_snapshot(r.txid, (SELECT s.b FROM s))
               -- After the cursor: not as a row comparison, which the index would start from
               -- instead of the batch's own bounds (a scan through every older event).
               AND r.txid OPERATOR(pg_catalog.>=) after_txid
               AND (r.txid OPERATOR(pg_catalog.>) after_txid OR r.seq OPERATOR(pg_catalog.>) after_seq)
             ORDER BY r.txid, r.seq
             LIMIT COALESCE(max_events, 0))
            UNION ALL
            (SELECT r.* FROM outbox.events r
             WHERE r.txid OPERATOR(pg_catalog.>=) (SELECT pg_catalog.pg_snapshot_xmax(s.a) FROM s)
               AND r.txid OPERATOR(pg_catalog.<) (SELECT pg_catalog.pg_snapshot_xmax(s.b) FROM s)
               AND pg_catalog.pg_visible_in_snapshot(r.txid, (SELECT s.b FROM s))
               -- After the cursor: not as a row comparison, which the index would start from
               -- instead of the batch's own bounds (a scan through every older event).
               AND r.txid OPERATOR(pg_catalog.>=) after_txid
               AND (r.txid OPERATOR(pg_catalog.>) after_txid OR r.seq OPERATOR(pg_catalog.>) after_seq)
             ORDER BY r.txid, r.seq
             LIMIT COALESCE(max_events, 0))) e
     WHERE after_seq IS NOT NULL
     ORDER BY e.txid, e.seq
     LIMIT COALESCE(max_events, 0)
$$;

-- The rest of a batch read as one range of the log, once a reader is past every transaction its
-- `since` snapshot saw running that its `upto` sees ended (pg_outbox_core::snapshot, whose
-- outbox._batch_range says when, and from where): the events after (after_txid, after_seq) of the
-- transactions below `below` (upto's xmax), leaving out those `running` (upto) saw running (NULL:
-- none is in the range), at most max_events. One index scan per partition, as the read rule's,
-- where _snapshot_log needs two behind a CTE. Inlined into its callers: no SET, every name and
-- operator qualified.
CREATE FUNCTION outbox._range_log(after_txid pg_catalog.xid8, after_seq bigint, below pg_catalog.xid8,
                                  running pg_catalog.pg_snapshot, max_events integer)
RETURNS TABLE (txid pg_catalog.xid8, seq bigint, id uuid, topic text, subject text, tenant text,
               payload jsonb, headers jsonb, raised_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT r.txid, r.seq, r.id, r.topic, r.subject, r.tenant, r.payload, r.headers, r.raised_at
      FROM outbox.events r
     WHERE ROW(r.txid, r.seq) OPERATOR(pg_catalog.>) ROW(after_txid, after_seq)
       AND r.txid OPERATOR(pg_catalog.<) below
       -- NULL when `running` is: none to leave out (the snapshot is made once, not for every row).
       AND COALESCE(pg_catalog.pg_visible_in_snapshot(r.txid, (SELECT running)), true)
       -- A NULL argument reads nothing, as _read_log and _snapshot_log (a row comparison with a NULL
       -- seq would still be true for every later transaction).
       AND after_seq IS NOT NULL
     ORDER BY r.txid, r.seq
     LIMIT COALESCE(max_events, 0)
$$;

-- The batch of tick `to_tick` after tick `from_tick` (_snapshot_log between their snapshots).
CREATE FUNCTION outbox._tick_log(from_tick bigint, to_tick bigint, after_txid pg_catalog.xid8,
                                 after_seq bigint, max_events integer)
RETURNS TABLE (txid pg_catalog.xid8, seq bigint, id uuid, topic text, subject text, tenant text,
               payload jsonb, headers jsonb, raised_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT l.txid, l.seq, l.id, l.topic, l.subject, l.tenant, l.payload, l.headers, l.raised_at
      FROM outbox._snapshot_log(outbox._tick_snapshot(from_tick), outbox._tick_snapshot(to_tick),
                                after_txid, after_seq, max_events) l
     WHERE from_tick OPERATOR(pg_catalog.<) to_tick
     ORDER BY l.txid, l.seq
$$;

-- _snapshot_log's rows as a pull consumer receives them (outbox.read), as _read_after is the read
-- rule's.
CREATE FUNCTION outbox._batch_after(since pg_catalog.pg_snapshot, upto pg_catalog.pg_snapshot,
                                    after_txid pg_catalog.xid8, after_seq bigint, max_events integer)
RETURNS SETOF outbox.event
LANGUAGE sql STABLE AS $$
    SELECT r.id,
           (r.txid::pg_catalog.text OPERATOR(pg_catalog.||) ':') OPERATOR(pg_catalog.||) r.seq::pg_catalog.text,
           r.topic, r.subject, r.tenant, r.payload, r.headers, r.raised_at
      FROM outbox._snapshot_log(since, upto, after_txid, after_seq, max_events) r
     ORDER BY r.txid, r.seq
$$;

-- _range_log's rows as a pull consumer receives them (outbox.read).
CREATE FUNCTION outbox._range_after(after_txid pg_catalog.xid8, after_seq bigint, below pg_catalog.xid8,
                                    running pg_catalog.pg_snapshot, max_events integer)
RETURNS SETOF outbox.event
LANGUAGE sql STABLE AS $$
    SELECT r.id,
           (r.txid::pg_catalog.text OPERATOR(pg_catalog.||) ':') OPERATOR(pg_catalog.||) r.seq::pg_catalog.text,
           r.topic, r.subject, r.tenant, r.payload, r.headers, r.raised_at
      FROM outbox._range_log(after_txid, after_seq, below, running, max_events) r
     ORDER BY r.txid, r.seq
$$;

-- The batch window of a reader by ticks, as outbox._read_window is the read horizon's: the next
-- events of the batch from snapshot `since` to snapshot `till` after (after_txid, after_seq), at most
-- max_events, numbered n from 1, cut before their payloads and headers pass max_bytes (never
-- empty while the batch has an event left). Inlined into the workers' kept statements.
CREATE FUNCTION outbox._batch_window(since pg_catalog.pg_snapshot, till pg_catalog.pg_snapshot,
                                     after_txid pg_catalog.xid8, after_seq bigint,
                                     max_events integer, max_bytes bigint)
RETURNS TABLE (id uuid, "position" text, topic text, subject text, tenant text, payload jsonb,
               headers jsonb, raised_at timestamptz, n bigint)
LANGUAGE sql STABLE AS $$
    SELECT w.id,
           (w.txid::pg_catalog.text OPERATOR(pg_catalog.||) ':') OPERATOR(pg_catalog.||) w.seq::pg_catalog.text,
           w.topic, w.subject, w.tenant, w.payload, w.headers, w.raised_at, w.n
      FROM (SELECT r.txid, r.seq, r.id, r.topic, r.subject, r.tenant, r.payload, r.headers, r.raised_at,
                   pg_catalog.row_number() OVER upto AS n,
                   pg_catalog.sum(pg_catalog.int8smaller(outbox._event_size(r.payload, r.headers),
                                                         2147483647)::pg_catalog.int4) OVER upto AS upto
              FROM outbox._snapshot_log(since, till, after_txid, after_seq, max_events) r
            WINDOW upto AS (ORDER BY r.txid, r.seq ROWS UNBOUNDED PRECEDING)) w
     WHERE (w.n OPERATOR(pg_catalog.=) 1 OR w.upto OPERATOR(pg_catalog.<=) max_bytes)
       AND max_bytes IS NOT NULL
     ORDER BY w.txid, w.seq
$$;

-- _batch_window over _range_log: the window of a reader by ticks past the transactions its batch
-- started with running (outbox._batch_range).
CREATE FUNCTION outbox._range_window(after_txid pg_catalog.xid8, after_seq bigint, below pg_catalog.xid8,
                                     running pg_catalog.pg_snapshot, max_events integer, max_bytes bigint)
RETURNS TABLE (id uuid, "position" text, topic text, subject text, tenant text, payload jsonb,
               headers jsonb, raised_at timestamptz, n bigint)
LANGUAGE sql STABLE AS $$
    SELECT w.id,
           (w.txid::pg_catalog.text OPERATOR(pg_catalog.||) ':') OPERATOR(pg_catalog.||) w.seq::pg_catalog.text,
           w.topic, w.subject, w.tenant, w.payload, w.headers, w.raised_at, w.n
      FROM (SELECT r.txid, r.seq, r.id, r.topic, r.subject, r.tenant, r.payload, r.headers, r.raised_at,
                   pg_catalog.row_number() OVER upto AS n,
                   pg_catalog.sum(pg_catalog.int8smaller(outbox._event_size(r.payload, r.headers),
                                                         2147483647)::pg_catalog.int4) OVER upto AS upto
              FROM outbox._range_log(after_txid, after_seq, below, running, max_events) r
            WINDOW upto AS (ORDER BY r.txid, r.seq ROWS UNBOUNDED PRECEDING)) w
     WHERE (w.n OPERATOR(pg_catalog.=) 1 OR w.upto OPERATOR(pg_catalog.<=) max_bytes)
       AND max_bytes IS NOT NULL
     ORDER BY w.txid, w.seq
$$;

