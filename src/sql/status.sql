-- outbox.status() (src/status.rs) for the role `who`: one row per consumer (pull consumers, sinks,
-- subscriptions). Error texts come from tenants' code and may quote their data: `who` sees them
-- for the consumers of roles it acts for, or as a member of pg_read_all_stats (the rule of
-- pg_stat_activity's query); otherwise '<insufficient privilege>'.
CREATE FUNCTION outbox._status(who oid)
RETURNS TABLE (
    name            text,
    kind            text,
    "position"      text,
    events_behind   bigint,         -- readable events after the cursor that it will receive (its topics)
    age_behind      interval,       -- age of the oldest event of its topics it has not passed, readable or not
    state           text,           -- idle | behind | delivering | backing off | down | paused | held by horizon
                                    -- (status() adds: waiting for a worker)
    next_attempt_at timestamptz,
    attempts        integer,
    batch_size      integer,
    last_error      text,
    last_sqlstate   text,
    dead_letters    bigint,
    -- Subscriptions: events that matched (a job each), that the filter turned down, and on which
    -- the filter failed (counted as false; last_error holds the last such error).
    matched         bigint,
    skipped         bigint,
    predicate_errors bigint,
    -- Sinks: events delivered and failed deliveries since the sink was created (outbox.metrics()).
    delivered       bigint,
    failures        bigint
)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    WITH h AS (SELECT outbox._log_horizon() AS x)
    SELECT c.name, c.kind, c.txid::text || ':' || c.seq::text, b.n, now() - b.oldest,
           CASE WHEN s.paused OR sub.paused THEN 'paused'
                WHEN s.down THEN 'down'
                WHEN s.next_attempt_at > now() THEN 'backing off'
                WHEN b.n > 0 AND c.kind = 'sink' THEN 'delivering'
                WHEN b.n > 0 THEN 'behind'
                WHEN b.held > 0 THEN 'held by horizon'
                ELSE 'idle' END,
           s.next_attempt_at, greatest(s.attempts, s.transient), s.current_batch,
           CASE WHEN coalesce(s.last_error, sub.last_predicate_error) IS NULL THEN NULL
                WHEN pg_has_role(who, c.owner, 'USAGE') OR pg_has_role(who, 'pg_read_all_stats', 'USAGE')
                THEN coalesce(s.last_error, sub.last_predicate_error)
                ELSE '<insufficient privilege>' END,
           s.last_sqlstate,
           (SELECT count(*) FROM outbox.dead_letters d WHERE d.sink = c.name),
           sub.matched, sub.skipped, sub.predicate_errors, s.delivered, s.failures
      FROM outbox.consumers c
      LEFT JOIN outbox.sinks s ON s.id = c.name
      LEFT JOIN outbox.subscriptions sub ON sub.name = c.name
     CROSS JOIN h
     -- Only the events of its topics (a pull consumer has none: all of them): readable, the
     -- oldest readable or not, and those held behind the horizon. A reader by ticks has not
     -- passed the events its batch's `since` does not see, but for those of its batch up to its
     -- cursor; none of them is held by the horizon (those committed are read at the next tick).
     CROSS JOIN LATERAL (SELECT count(*) FILTER (WHERE c.tick IS NOT NULL OR e.txid < h.x) AS n,
                                min(e.raised_at) AS oldest,
                                count(*) FILTER (WHERE c.tick IS NULL AND e.txid >= h.x) AS held
                           FROM (SELECT r.txid, r.topic, r.raised_at FROM outbox.events r
                                  WHERE c.tick IS NULL AND (r.txid, r.seq) > (c.txid, c.seq)
                                 -- By ticks: those `since` saw running, and those after its xmax
                                 -- (two index scans, however old a transaction still running).
                                 UNION ALL
                                 SELECT r.txid, r.topic, r.raised_at FROM outbox.events r
                                  WHERE c.tick IS NOT NULL
                                    AND r.txid = ANY (ARRAY(SELECT pg_snapshot_xip(c.since)))
                                    AND NOT ((r.txid, r.seq) <= (c.txid, c.seq)
                                             AND pg_visible_in_snapshot(r.txid, c.upto))
                                 UNION ALL
                                 SELECT r.txid, r.topic, r.raised_at FROM outbox.events r
                                  WHERE c.tick IS NOT NULL AND r.txid >= pg_snapshot_xmax(c.since)
                                    AND NOT ((r.txid, r.seq) <= (c.txid, c.seq)
                                             AND pg_visible_in_snapshot(r.txid, c.upto))) e
                          WHERE coalesce(s.topic_regex, sub.topic_regex) IS NULL
                                OR e.topic ~ coalesce(s.topic_regex, sub.topic_regex)) b
     ORDER BY c.name
$$;

-- outbox.queue_status() (src/status.rs) for the role `who`: one row per job queue. A
-- subscription with a handler queues under its own name. The jobs table holds only unfinished
-- jobs, so this stays cheap. The last error is shown as in _status(), to roles that may work the
-- queue.
CREATE FUNCTION outbox._queue_status(who oid)
RETURNS TABLE (
    queue        text,
    waiting      bigint,        -- never tried, waiting to run (due or not)
    running      bigint,        -- claimed by an external worker, lease not lapsed
    retrying     bigint,        -- failed before, waiting for their back-off to end
    dead         bigint,        -- out of attempts or failed for good: see outbox.dead_jobs
    oldest_due   interval,      -- how long the oldest due, unclaimed job has waited
    last_error   text           -- of the most recently failed job
)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT j.queue,
           count(*) FILTER (WHERE j.state = 'waiting' AND j.attempts = 0),
           count(*) FILTER (WHERE j.state = 'running' AND j.lease_until >= now()),
           count(*) FILTER (WHERE (j.state = 'waiting' AND j.attempts > 0)
                               OR (j.state = 'running' AND j.lease_until < now())),
           count(*) FILTER (WHERE j.state = 'dead'),
           now() - min(j.run_at) FILTER (WHERE j.state = 'waiting' AND j.run_at <= now()),
           CASE WHEN outbox._may(j.queue, who, 'work') OR pg_has_role(who, 'pg_read_all_stats', 'USAGE')
                THEN (array_agg(j.last_error ORDER BY j.id DESC) FILTER (WHERE j.last_error IS NOT NULL))[1]
                WHEN count(j.last_error) > 0 THEN '<insufficient privilege>' END
      FROM outbox.jobs j
     GROUP BY j.queue
     ORDER BY j.queue
$$;
