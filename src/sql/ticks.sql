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
    -- 1, 2, 3... in the order taken: tick n's snapshot sees every transaction tick n-1's saw.
    tick     bigint                 PRIMARY KEY CHECK (tick > 0),
    snapshot pg_catalog.pg_snapshot NOT NULL,
    taken_at timestamptz            NOT NULL DEFAULT pg_catalog.now()
);

-- Takes a tick unless its batch would be empty; returns the newest tick. One taker at a
-- time: the table's lock (which readers do not take) orders them, and the snapshot is taken by a
-- statement that starts once the lock is held, so after the previous taker committed: it sees
-- every transaction the previous tick saw, and the tick numbers follow the snapshots. In READ
-- COMMITTED only (each statement its own snapshot). Commit soon: the lock is held until then.
CREATE FUNCTION outbox._tick() RETURNS bigint
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    last outbox.ticks;
    taken pg_snapshot;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'a tick is taken in a READ COMMITTED transaction'
            USING ERRCODE = 'invalid_transaction_state',
                  DETAIL = 'its snapshot must be taken after the previous tick committed';
    END IF;
    LOCK TABLE outbox.ticks IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO last FROM outbox.ticks t ORDER BY t.tick DESC LIMIT 1;
    taken := outbox._log_snapshot()::pg_snapshot;
    -- A tick whose batch would be empty is not taken (the workers ask at every commit and poll,
    -- and each tick's own transaction moves the snapshot on): the next one's batch holds what it
    -- would have. Read with a snapshot newer than `taken`, filtered by `taken`.
    IF last.tick IS NOT NULL AND NOT EXISTS (
        SELECT FROM outbox.events e
         WHERE (e.txid = ANY (ARRAY(SELECT x FROM pg_snapshot_xip(last.snapshot) x
                                     WHERE pg_visible_in_snapshot(x, taken)))
                OR e.txid >= pg_snapshot_xmax(last.snapshot) AND e.txid < pg_snapshot_xmax(taken))
           AND pg_visible_in_snapshot(e.txid, taken)) THEN
        RETURN last.tick;
    END IF;
    INSERT INTO outbox.ticks (tick, snapshot) VALUES (coalesce(last.tick, 0) + 1, taken);
    RETURN coalesce(last.tick, 0) + 1;
END
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

-- The batch of tick `to_tick` after tick `from_tick`: the events of the transactions its snapshot
-- sees and from_tick's does not, after (after_txid, after_seq), at most max_events, in the order
-- of the log's columns (a transaction's events together, in the order it raised them). Those
-- transactions are the ones from_tick saw running, and those that began after it (from its xmax):
-- two index scans, however old the oldest transaction still running.
CREATE FUNCTION outbox._tick_log(from_tick bigint, to_tick bigint, after_txid pg_catalog.xid8,
                                 after_seq bigint, max_events integer)
RETURNS TABLE (txid pg_catalog.xid8, seq bigint, id uuid, topic text, subject text, tenant text,
               payload jsonb, headers jsonb, raised_at timestamptz)
LANGUAGE sql STABLE AS $$
    WITH s AS MATERIALIZED (
        -- Of those from_tick saw running, the ones to_tick sees ended: a transaction still running
        -- (a long one with many events, say) is not scanned for at every tick.
        SELECT t.a, t.b, ARRAY(SELECT x FROM pg_catalog.pg_snapshot_xip(t.a) x
                                WHERE pg_catalog.pg_visible_in_snapshot(x, t.b)) AS running
          FROM (SELECT outbox._tick_snapshot(from_tick) AS a, outbox._tick_snapshot(to_tick) AS b
                OFFSET 0) t)
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
     WHERE after_seq IS NOT NULL AND from_tick OPERATOR(pg_catalog.<) to_tick
     ORDER BY e.txid, e.seq
     LIMIT COALESCE(max_events, 0)
$$;
