-- outbox.status(): one row per consumer (pull consumers and sinks), for operators.
CREATE FUNCTION outbox.status()
RETURNS TABLE (
    name            text,
    kind            text,
    "position"      text,
    events_behind   bigint,         -- readable events after the cursor
    age_behind      interval,       -- age of the oldest of them
    state           text,           -- idle | behind | delivering | backing off | down | paused | held by horizon
    next_attempt_at timestamptz,
    attempts        integer,
    batch_size      integer,
    last_error      text,
    last_sqlstate   text,
    dead_letters    bigint
)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH h AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS x),
         waiting AS (SELECT count(*) AS n FROM outbox.events, h WHERE txid >= h.x)
    SELECT c.name, c.kind, c.txid::text || ':' || c.seq::text, b.n, now() - b.oldest,
           CASE WHEN s.paused THEN 'paused'
                WHEN s.down THEN 'down'
                WHEN s.next_attempt_at > now() THEN 'backing off'
                WHEN b.n > 0 AND c.kind = 'sink' THEN 'delivering'
                WHEN b.n > 0 THEN 'behind'
                WHEN waiting.n > 0 THEN 'held by horizon'
                ELSE 'idle' END,
           s.next_attempt_at, greatest(s.attempts, s.transient), s.current_batch, s.last_error, s.last_sqlstate,
           (SELECT count(*) FROM outbox.dead_letters d WHERE d.sink = c.name)
      FROM outbox.consumers c
      LEFT JOIN outbox.sinks s ON s.id = c.name
     CROSS JOIN h CROSS JOIN waiting
     CROSS JOIN LATERAL (SELECT count(*) AS n, min(e.raised_at) AS oldest
                           FROM outbox.events e
                          WHERE (e.txid, e.seq) > (c.txid, c.seq) AND e.txid < h.x) b
     ORDER BY c.name
$$;
