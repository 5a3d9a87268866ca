-- pg_outbox 0.1.0 -> 0.2.0 (ALTER EXTENSION pg_outbox UPDATE). Released: never edit.
--
-- Job queues get owners (issue #10): tables outbox.queues and outbox.queue_grants, the calls
-- create_queue, drop_queue, grant_queue, revoke_queue and queue_privileges, and every job call
-- checks what its caller may do on the queue. Keys given to enqueue() and the keys of fan-out
-- jobs live in separate namespaces. A schedule run whose owner lost the right to write is
-- skipped, with a WARNING. status() and queue_status() show tenants' error texts only to the
-- roles that own (or may work) what failed and to members of pg_read_all_stats. The workers'
-- windows are cut at pg_outbox.max_batch_bytes (outbox._read_window, outbox._event_size).
-- Delivery starts in every database where the extension is installed (a launcher; CREATE
-- EXTENSION tells it through outbox._start_delivery()), and outbox.metrics() gives monitoring
-- its numbers, with a count of failed deliveries per sink. pg_dump keeps the extension's tables
-- and sequences, positions survive a restore into another cluster (outbox.lineage, an epoch in
-- a position's txid), and roles are kept by name (regrole columns).
--
-- Queues that exist at the upgrade keep the access they had: each belongs to the role of the
-- subscription or schedule that feeds it (else to the owner of the log), and every role that could
-- call enqueue() or claim() before keeps that on it (0.1.0 had no per-queue check), except on the
-- queues of subscriptions with a handler, whose jobs only the worker runs. A NOTICE says how many;
-- outbox.queue_privileges() lists them, outbox.revoke_queue() narrows them.
\echo Use "ALTER EXTENSION pg_outbox UPDATE TO '0.2.0'" to load this file. \quit

-- Namespaces for keys: enqueue()'s per queue, the fan-out's per queue, subscription and event,
-- a schedule's per queue and schedule. All stay unique on the rows 0.1.0 left (its one index
-- covered them all).
-- A schedule's runs get a namespace of their own too. (0.1.0's waiting runs keep their place in
-- enqueue()'s, where they were queued.)
ALTER TABLE outbox.jobs ADD COLUMN schedule text;
DROP INDEX outbox.jobs_waiting_key;
CREATE UNIQUE INDEX jobs_waiting_key ON outbox.jobs (queue, key)
    WHERE key IS NOT NULL AND state = 'waiting' AND subscription IS NULL AND schedule IS NULL;
CREATE UNIQUE INDEX jobs_waiting_run ON outbox.jobs (queue, schedule, key)
    WHERE schedule IS NOT NULL AND state = 'waiting';

-- The claim index holds waiting jobs only (0.1.0's held running ones too, which every claim
-- stepped over); running jobs are found by when their lease lapses.
DROP INDEX outbox.jobs_claim;
CREATE INDEX jobs_claim ON outbox.jobs (queue, run_at, id) WHERE state = 'waiting';
CREATE INDEX jobs_leased ON outbox.jobs (queue, lease_until, id) WHERE state = 'running';

-- Failed deliveries per sink, beside the delivered count (outbox.metrics()). Added without a
-- default and filled, so the table is exactly a fresh install's (no stored missing value).
ALTER TABLE outbox.sinks ADD COLUMN failures bigint;
UPDATE outbox.sinks SET failures = 0;
ALTER TABLE outbox.sinks ALTER COLUMN failures SET DEFAULT 0, ALTER COLUMN failures SET NOT NULL;

-- Whether a sink's delivery transactions wait for their WAL flush (outbox.alter_sink), added as
-- failures is.
ALTER TABLE outbox.sinks ADD COLUMN synchronous_commit boolean;
UPDATE outbox.sinks SET synchronous_commit = true;
ALTER TABLE outbox.sinks ALTER COLUMN synchronous_commit SET DEFAULT true,
    ALTER COLUMN synchronous_commit SET NOT NULL;

-- Positions survive pg_dump and pg_restore into another cluster (src/lineage.rs). The log's
-- existing positions are this database's epoch 0, and were raised in.
CREATE FUNCTION outbox._log_txid() RETURNS pg_catalog.xid8
VOLATILE PARALLEL UNSAFE LANGUAGE c AS 'MODULE_PATHNAME', 'pg_outbox_log_txid';
CREATE FUNCTION outbox._log_horizon() RETURNS pg_catalog.xid8
STABLE PARALLEL SAFE LANGUAGE c AS 'MODULE_PATHNAME', 'pg_outbox_log_horizon';
CREATE TABLE outbox.lineage (
    system_identifier bigint      NOT NULL,   -- pg_control_system() of the cluster
    database          oid         NOT NULL,   -- the database in that cluster
    epoch             integer     NOT NULL CHECK (epoch BETWEEN 0 AND 65535),
    raised            boolean     NOT NULL DEFAULT false,   -- positions were made here
    since             timestamptz NOT NULL DEFAULT pg_catalog.now()
);
INSERT INTO outbox.lineage (system_identifier, database, epoch, raised)
SELECT s.system_identifier, d.oid, 0, true
  FROM pg_catalog.pg_control_system() s, pg_catalog.pg_database d
 WHERE d.datname = pg_catalog.current_database();
ALTER TABLE outbox.events ALTER COLUMN txid SET DEFAULT outbox._log_txid();

-- Roles by name: a dump names them, a restore finds them by name in the new cluster.
ALTER TABLE outbox.consumers ALTER COLUMN owner TYPE regrole;
ALTER TABLE outbox.schedules ALTER COLUMN owner TYPE regrole;

-- When a job died (NULL for jobs that died before 0.2.0 recorded it); dead_jobs shows it.
ALTER TABLE outbox.jobs ADD COLUMN dead_at timestamptz;
CREATE OR REPLACE VIEW outbox.dead_jobs AS
    SELECT id, queue, payload, key, attempts, max_attempts, last_error, created_at, event, subscription,
           dead_at
      FROM outbox.jobs WHERE state = 'dead';

-- Schedules: one-off runs at a local date and time (at), each schedules that queue a job per row
-- of a query (each), why a run wrote nothing (last_error) and how many failed in a row. outbox.schedule() gains the
-- arguments at and each, outbox.schedule_status() the column last_error: both are made again,
-- and keep the grants they had (saved here, put back at the end of this script).
ALTER TABLE outbox.schedules ADD COLUMN at_local timestamp, ADD COLUMN each text, ADD COLUMN last_error text,
    ADD COLUMN failed_runs integer;
UPDATE outbox.schedules SET failed_runs = 0;
ALTER TABLE outbox.schedules ALTER COLUMN failed_runs SET DEFAULT 0, ALTER COLUMN failed_runs SET NOT NULL;
ALTER TABLE outbox.schedules DROP CONSTRAINT schedules_one_form,
    ADD CONSTRAINT schedules_one_form CHECK (
        (every IS NOT NULL AND daily_at IS NULL AND zone IS NULL AND weekly_on IS NULL AND at_local IS NULL)
        OR (every IS NULL AND daily_at IS NOT NULL AND zone IS NOT NULL AND at_local IS NULL)
        OR (every IS NULL AND daily_at IS NULL AND weekly_on IS NULL AND at_local IS NOT NULL AND zone IS NOT NULL)),
    ADD CONSTRAINT schedules_each_queues CHECK (each IS NULL OR queue IS NOT NULL);
SELECT pg_catalog.set_config('outbox_upgrade.schedule_acl', coalesce(p.proacl::text, ''), true)
  FROM pg_catalog.pg_proc p
 WHERE p.oid = 'outbox.schedule(text, interval, time, text, text, text, text, jsonb)'::pg_catalog.regprocedure;
SELECT pg_catalog.set_config('outbox_upgrade.schedule_status_acl', coalesce(p.proacl::text, ''), true)
  FROM pg_catalog.pg_proc p
 WHERE p.oid = 'outbox.schedule_status()'::pg_catalog.regprocedure;
DROP FUNCTION outbox.schedule(text, interval, time, text, text, text, text, jsonb);
DROP FUNCTION outbox.schedule_status();
DROP FUNCTION outbox._schedule(text, interval, time, text, text, text, text, jsonb, oid);
CREATE UNIQUE INDEX jobs_waiting_event ON outbox.jobs (queue, subscription, event)
    WHERE subscription IS NOT NULL AND state = 'waiting';

-- The read rule, with the log's own columns (src/sql/schema.sql); _read_after reads through it.
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

CREATE OR REPLACE FUNCTION outbox._read_after(after_txid pg_catalog.xid8, after_seq bigint, max_events integer)
RETURNS SETOF outbox.event
LANGUAGE sql STABLE AS $$
    SELECT r.id,
           (r.txid::pg_catalog.text OPERATOR(pg_catalog.||) ':') OPERATOR(pg_catalog.||) r.seq::pg_catalog.text,
           r.topic, r.subject, r.tenant, r.payload, r.headers, r.raised_at
      FROM outbox._read_log(after_txid, after_seq, max_events) r
     ORDER BY r.txid, r.seq
$$;

CREATE FUNCTION outbox."_event_size"(
	"payload" jsonb,
	"headers" jsonb
) RETURNS bigint
IMMUTABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'event_size_wrapper';

-- A window of the log for the workers: the read rule's next events after a cursor, at most
-- max_events, numbered n from 1, and cut before their payloads and headers pass max_bytes
-- uncompressed (outbox._event_size reads that from each value's header, without decompressing
-- it); never empty while an event is readable. Bounds what a pass holds whatever events hold.
--
-- Inlined into the workers' kept statements with the read rule, like it (see _read_log): not
-- STRICT (a NULL argument reads nothing), no SET, every name and operator qualified. The window
-- is ordered by the log's columns, as the rows come from the read rule: the planner knows the
-- order, so neither the window nor the result is sorted again.
CREATE FUNCTION outbox._read_window(after_txid pg_catalog.xid8, after_seq bigint, max_events integer,
                                    max_bytes bigint)
RETURNS TABLE (id uuid, "position" text, topic text, subject text, tenant text, payload jsonb,
               headers jsonb, raised_at timestamptz, n bigint)
LANGUAGE sql STABLE AS $$
    SELECT w.id,
           (w.txid::pg_catalog.text OPERATOR(pg_catalog.||) ':') OPERATOR(pg_catalog.||) w.seq::pg_catalog.text,
           w.topic, w.subject, w.tenant, w.payload, w.headers, w.raised_at, w.n
      FROM (SELECT r.txid, r.seq, r.id, r.topic, r.subject, r.tenant, r.payload, r.headers, r.raised_at,
                   pg_catalog.row_number() OVER upto AS n,
                   -- Summed as int4 (capped) into an int8: a sum of int8 is a numeric, made and
                   -- compared for every row.
                   pg_catalog.sum(pg_catalog.int8smaller(outbox._event_size(r.payload, r.headers),
                                                         2147483647)::pg_catalog.int4) OVER upto AS upto
              FROM outbox._read_log(after_txid, after_seq, max_events) r
            WINDOW upto AS (ORDER BY r.txid, r.seq ROWS UNBOUNDED PRECEDING)) w
     WHERE (w.n OPERATOR(pg_catalog.=) 1 OR w.upto OPERATOR(pg_catalog.<=) max_bytes)
       AND max_bytes IS NOT NULL
     ORDER BY w.txid, w.seq
$$;

-- Queues belong to roles. The role that creates a queue (outbox.create_queue, or the first
-- enqueue() or subscribe() that names it) owns it; its members may do everything with its jobs,
-- other roles what the owner grants them: enqueue (queue jobs) and work (claim, complete, fail,
-- extend, replay). A subscription's queue is its owner's. The public functions are SECURITY
-- INVOKER (src/queue.rs): they read the caller, then call the functions below as the owner of
-- the log, passing the caller, and these check it. Nobody else can call them usefully: they are
-- SECURITY INVOKER too, and only the log's owner may touch these tables.
CREATE TABLE outbox.queues (
    name         text        NOT NULL PRIMARY KEY,
    owner        regrole     NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- A job for external workers that nobody claimed within this long after its run_at dies,
    -- with last_error 'expired' (NULL: jobs wait until claimed). outbox._announce_jobs().
    expire_after interval,
    CONSTRAINT queues_expire_after CHECK (
        EXTRACT(YEAR FROM expire_after) = 0 AND EXTRACT(MONTH FROM expire_after) = 0
        AND EXTRACT(EPOCH FROM expire_after) BETWEEN 1 AND 3650 * 86400)
);

CREATE TABLE outbox.queue_grants (
    queue   text    NOT NULL REFERENCES outbox.queues (name) ON DELETE CASCADE,
    grantee regrole NOT NULL,
    enqueue boolean NOT NULL,
    work    boolean NOT NULL,
    PRIMARY KEY (queue, grantee)
);

-- Whether role `who` may `privilege` ('enqueue' or 'work') on `queue`: a member of its owner
-- (superusers are members of every role), or of a role granted that privilege. 'own': a member
-- of the owner only. PL/pgSQL, not SQL: a SQL function whose body cannot be inlined (this one has
-- subqueries) is parsed and planned again in every transaction that calls it, a third of a claim;
-- PL/pgSQL keeps its plan for the session.
CREATE FUNCTION outbox._may(queue text, who oid, privilege text) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT FROM outbox.queues q
                    WHERE q.name OPERATOR(pg_catalog.=) _may.queue
                      AND pg_catalog.pg_has_role(_may.who, q.owner, 'USAGE'))
        OR _may.privilege OPERATOR(pg_catalog.<>) 'own' AND EXISTS (SELECT FROM outbox.queue_grants g
                    WHERE g.queue OPERATOR(pg_catalog.=) _may.queue
                      AND (_may.privilege OPERATOR(pg_catalog.=) 'enqueue' AND g.enqueue
                           OR _may.privilege OPERATOR(pg_catalog.=) 'work' AND g.work)
                      AND pg_catalog.pg_has_role(_may.who, g.grantee, 'USAGE'));
END
$$;

-- Refuses (42501) unless `who` may `privilege` on `queue`.
CREATE FUNCTION outbox._check_may(queue text, who oid, privilege text) RETURNS void
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT outbox._may(queue, who, privilege) THEN
        RAISE EXCEPTION 'permission denied for queue "%"', queue USING ERRCODE = 'insufficient_privilege',
            DETAIL = format('role %s may not %s on it', who::regrole,
                            CASE privilege WHEN 'enqueue' THEN 'enqueue jobs' WHEN 'own' THEN 'act as its owner'
                                           ELSE 'work (claim, complete, fail, extend or replay jobs)' END),
            HINT = CASE privilege WHEN 'own' THEN 'a subscription with a handler queues its jobs on a queue of its own name, which its role must own: choose another name'
                   ELSE 'the queue''s owner grants it with outbox.grant_queue()' END;
    END IF;
END
$$;

-- The queue `name`, created for `who` if it does not exist yet; refuses (42501) unless `who`
-- may `privilege` on it.
CREATE FUNCTION outbox._use_queue(name text, who oid, privilege text) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM outbox._check_queue(name);
    INSERT INTO outbox.queues AS q (name, owner) VALUES (name, who) ON CONFLICT DO NOTHING;
    PERFORM outbox._check_may(name, who, privilege);
END
$$;

-- Refuses an expire_after that is not a fixed length of 1 second to 3650 days (NULL: never).
CREATE FUNCTION outbox._check_expire_after(expire_after interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF extract(year FROM expire_after) <> 0 OR extract(month FROM expire_after) <> 0 THEN
        RAISE EXCEPTION 'expire_after must not have months or years, not %', expire_after
            USING ERRCODE = 'invalid_parameter_value', HINT = 'use days (''30 days'')';
    END IF;
    IF extract(epoch FROM expire_after) < 1 OR extract(epoch FROM expire_after) > 3650 * 86400 THEN
        RAISE EXCEPTION 'expire_after must be between 1 second and 3650 days, not %', expire_after
            USING ERRCODE = 'invalid_parameter_value', HINT = 'NULL: jobs wait until they are claimed';
    END IF;
END
$$;

CREATE FUNCTION outbox._create_queue(name text, expire_after interval, who oid) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM outbox._check_queue(name);
    PERFORM outbox._check_expire_after(expire_after);
    INSERT INTO outbox.queues AS q (name, owner, expire_after) VALUES (name, who, expire_after)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" already exists', name USING ERRCODE = 'duplicate_object';
    END IF;
END
$$;

-- The owner of `name`, after checking that `who` acts for it (42501) and that it exists (42704).
CREATE FUNCTION outbox._owned_queue(name text, who oid, action text) RETURNS oid
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    owner oid;
BEGIN
    PERFORM outbox._check_queue(name);
    SELECT q.owner INTO owner FROM outbox.queues q WHERE q.name = _owned_queue.name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'queue "%" does not exist', name USING ERRCODE = 'undefined_object';
    END IF;
    IF NOT pg_has_role(who, owner, 'USAGE') THEN
        RAISE EXCEPTION 'must be a member of the owner of queue "%" to %', name, action
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN owner;
END
$$;

-- Sets the queue's expire_after (NULL: jobs wait until claimed); only members of its owner may.
-- Jobs already waiting are judged by the new one.
CREATE FUNCTION outbox._alter_queue(name text, expire_after interval, who oid) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM outbox._owned_queue(name, who, 'alter it');
    PERFORM outbox._check_expire_after(expire_after);
    UPDATE outbox.queues q SET expire_after = _alter_queue.expire_after WHERE q.name = _alter_queue.name;
END
$$;

CREATE FUNCTION outbox._drop_queue(name text, drop_jobs boolean, who oid) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    feeders text;
    jobs bigint;
BEGIN
    IF drop_jobs IS NULL THEN
        RAISE EXCEPTION 'drop_jobs must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM outbox._owned_queue(name, who, 'drop it');
    PERFORM FROM outbox.queues q WHERE q.name = _drop_queue.name FOR UPDATE;
    SELECT string_agg(format('"%s"', s.name), ', ' ORDER BY s.name) INTO feeders
      FROM outbox.subscriptions s WHERE s.queue = _drop_queue.name;
    IF feeders IS NOT NULL THEN
        RAISE EXCEPTION 'cannot drop queue "%": subscriptions % queue jobs on it', name, feeders
            USING ERRCODE = 'dependent_objects_still_exist', HINT = 'unsubscribe them first';
    END IF;
    SELECT string_agg(format('"%s"', s.name), ', ' ORDER BY s.name) INTO feeders
      FROM outbox.schedules s WHERE s.queue = _drop_queue.name;
    IF feeders IS NOT NULL THEN
        RAISE EXCEPTION 'cannot drop queue "%": schedules % queue jobs on it', name, feeders
            USING ERRCODE = 'dependent_objects_still_exist', HINT = 'unschedule them first';
    END IF;
    SELECT count(*) INTO jobs FROM outbox.jobs j WHERE j.queue = _drop_queue.name;
    IF jobs > 0 AND NOT drop_jobs THEN
        RAISE EXCEPTION 'cannot drop queue "%": it holds % jobs', name, jobs
            USING ERRCODE = 'dependent_objects_still_exist',
                  HINT = 'let them finish, or drop them with it: drop_jobs => true';
    END IF;
    DELETE FROM outbox.jobs j WHERE j.queue = _drop_queue.name;
    DELETE FROM outbox.queues q WHERE q.name = _drop_queue.name;
    IF jobs > 0 THEN
        RAISE LOG 'pg_outbox: queue % dropped with % jobs by role %', name, jobs, who::regrole;
    END IF;
END
$$;

-- The arguments of a grant or revoke, and that `who` acts for the queue's owner.
CREATE FUNCTION outbox._check_grant(queue text, grantee oid, enqueue boolean, work boolean, who oid,
                                    action text) RETURNS void
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF grantee IS NULL THEN
        RAISE EXCEPTION 'role must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF enqueue IS NULL OR work IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', CASE WHEN enqueue IS NULL THEN 'enqueue' ELSE 'work' END
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM outbox._owned_queue(queue, who, action);
END
$$;

CREATE FUNCTION outbox._grant_queue(queue text, grantee oid, enqueue boolean, work boolean, who oid) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM outbox._check_grant(queue, grantee, enqueue, work, who, 'grant on it');
    IF NOT (enqueue OR work) THEN
        RETURN;
    END IF;
    INSERT INTO outbox.queue_grants AS g (queue, grantee, enqueue, work)
    VALUES (queue, grantee, enqueue, work)
    ON CONFLICT ON CONSTRAINT queue_grants_pkey
    DO UPDATE SET enqueue = g.enqueue OR excluded.enqueue, work = g.work OR excluded.work;
END
$$;

-- Revoking enqueue from a role whose subscription or schedule queues jobs on the queue is
-- refused: it would go on queueing them as if nothing had changed.
CREATE FUNCTION outbox._revoke_queue(queue text, grantee oid, enqueue boolean, work boolean, who oid) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    feeders text;
BEGIN
    PERFORM outbox._check_grant(queue, grantee, enqueue, work, who, 'revoke on it');
    UPDATE outbox.queue_grants g
       SET enqueue = g.enqueue AND NOT _revoke_queue.enqueue, work = g.work AND NOT _revoke_queue.work
     WHERE g.queue = _revoke_queue.queue AND g.grantee = _revoke_queue.grantee;
    IF enqueue THEN
        SELECT string_agg(f, ', ' ORDER BY f) INTO feeders FROM (
            SELECT format('subscription "%s"', s.name) AS f
              FROM outbox.subscriptions s JOIN outbox.consumers c ON c.name = s.name
             WHERE s.queue = _revoke_queue.queue AND NOT outbox._may(s.queue, c.owner, 'enqueue')
            UNION ALL
            SELECT format('schedule "%s"', s.name)
              FROM outbox.schedules s
             WHERE s.queue = _revoke_queue.queue AND NOT outbox._may(s.queue, s.owner, 'enqueue')) x;
        IF feeders IS NOT NULL THEN
            RAISE EXCEPTION 'cannot revoke enqueue on queue "%": % would lose the right to queue jobs on it',
                queue, feeders USING ERRCODE = 'dependent_objects_still_exist',
                HINT = 'drop them first (outbox.unsubscribe, outbox.unschedule)';
        END IF;
    END IF;
    DELETE FROM outbox.queue_grants g WHERE g.queue = _revoke_queue.queue AND NOT (g.enqueue OR g.work);
END
$$;

-- outbox.queue_privileges(): who owns each queue and what it granted to whom, for operators.
CREATE FUNCTION outbox.queue_privileges()
RETURNS TABLE (queue text, owner regrole, grantee regrole, enqueue boolean, work boolean)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT q.name, q.owner::regrole, g.grantee::regrole, g.enqueue, g.work
      FROM outbox.queues q LEFT JOIN outbox.queue_grants g ON g.queue = q.name
     ORDER BY q.name, g.grantee::regrole::text
$$;

-- Holds the queues `queues` (FOR KEY SHARE) until the transaction ends, or fails (42704) if one
-- does not exist. Every path that queues jobs calls it, in the transaction of its INSERT, before
-- or after it: drop_queue takes its queue FOR UPDATE before it counts and deletes the queue's
-- jobs, so it either waits for that transaction and then sees its jobs, or went first, and then
-- this fails and the jobs are rolled back. No job outlives its queue. (What the foreign key from
-- jobs to queues did, once per statement instead of once per row.)
CREATE FUNCTION outbox._hold_queues(queues text[]) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    missing text;
BEGIN
    SELECT pg_catalog.min(n) INTO missing
      FROM pg_catalog.unnest(queues) n
     WHERE NOT EXISTS (SELECT FROM outbox.queues q WHERE q.name OPERATOR(pg_catalog.=) n FOR KEY SHARE);
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'queue "%" does not exist', missing USING ERRCODE = 'undefined_object',
            HINT = 'it was dropped while jobs were being queued on it';
    END IF;
END
$$;

-- outbox.enqueue() (src/queue.rs) for the role `who`.
CREATE FUNCTION outbox._enqueue(queue text, payload jsonb, run_at timestamptz, key text, max_attempts integer, who oid)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    job bigint;
BEGIN
    PERFORM outbox._check_queue(queue);
    IF payload IS NOT NULL AND jsonb_typeof(payload) <> 'object' THEN
        RAISE EXCEPTION 'payload must be a JSON object' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF key = '' OR length(key) > 255 THEN
        RAISE EXCEPTION 'key must be 1 to 255 characters (NULL for none)' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF max_attempts IS NULL THEN
        RAISE EXCEPTION 'max_attempts must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts must be between 1 and 1000' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF run_at IS NOT NULL AND NOT isfinite(run_at) THEN
        RAISE EXCEPTION 'run_at must be a finite time' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'a job at infinity would never run; NULL means now';
    END IF;
    IF NOT outbox._may(queue, who, 'enqueue') THEN
        PERFORM outbox._use_queue(queue, who, 'enqueue');
    END IF;
    PERFORM outbox._hold_queues(ARRAY[queue]);
    INSERT INTO outbox.jobs AS j (queue, payload, key, run_at, max_attempts)
    VALUES (queue, coalesce(payload, '{}'), key, coalesce(run_at, now()), max_attempts)
    ON CONFLICT (queue, key) WHERE key IS NOT NULL AND state = 'waiting' AND subscription IS NULL AND schedule IS NULL
    DO NOTHING
    RETURNING j.id INTO job;
    IF job IS NULL THEN
        -- The key is already waiting: that job stands for this one.
        SELECT j.id INTO job FROM outbox.jobs j
         WHERE j.queue = _enqueue.queue AND j.key = _enqueue.key AND j.state = 'waiting'
           AND j.subscription IS NULL AND j.schedule IS NULL;
    END IF;
    RETURN job;
END
$$;

-- outbox.claim() (src/queue.rs) for the role `who`: up to max_jobs due jobs of a queue, in
-- run_at order, skipping jobs others hold. A queue that does not exist has no jobs to claim.
--
-- With a lease (the default), each job is marked running until lease_until and its attempt is
-- counted: the claim commits, the worker works with no transaction open, then completes or fails
-- the job; a worker that dies loses the lease and the job is claimed again when it lapses.
--
-- With lease => NULL, nothing is written: the jobs are held by the caller's transaction (row locks,
-- FOR UPDATE SKIP LOCKED) until it ends. Complete or fail them in that transaction; if it rolls
-- back or the connection dies they are free at once. Half the writes of a lease (the attempt is
-- counted only by fail()), for workers whose jobs are short enough to hold a transaction open.
-- claim, complete and complete_many are the hot path of every external worker. They do not pin
-- search_path (the save and restore cost 5-10% of a claim) and qualify every name they use:
-- tables, functions, types and operators (OPERATOR(pg_catalog.=)). Keep it so when editing them.
CREATE FUNCTION outbox._claim(queue text, max_jobs integer, lease interval, who oid)
RETURNS SETOF outbox.job
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    ids bigint[];
BEGIN
    -- Only a name that fails the rule pays for the call that explains why.
    IF queue IS NULL OR queue OPERATOR(pg_catalog.!~) '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$' THEN
        PERFORM outbox._check_queue(queue);
    END IF;
    IF max_jobs IS NULL THEN
        RAISE EXCEPTION 'max_jobs must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF max_jobs OPERATOR(pg_catalog.<) 1 OR max_jobs OPERATOR(pg_catalog.>) 1000 THEN
        RAISE EXCEPTION 'max_jobs must be between 1 and 1000' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF lease OPERATOR(pg_catalog.<=) '0' OR lease OPERATOR(pg_catalog.>) '1 day' THEN
        RAISE EXCEPTION 'lease must be positive and at most a day (or NULL: held by this transaction)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT outbox._may(queue, who, 'work') THEN
        IF EXISTS (SELECT FROM outbox.queues q WHERE q.name OPERATOR(pg_catalog.=) _claim.queue) THEN
            PERFORM outbox._check_may(queue, who, 'work');
        END IF;
        RETURN;
    END IF;
    IF lease IS NULL THEN
        RETURN QUERY
        SELECT j.id, j.queue, j.payload, j.key, j.attempts OPERATOR(pg_catalog.+) 1, j.max_attempts,
               NULL::pg_catalog.timestamptz, j.created_at, j.event, j.subscription
          FROM outbox.jobs j
         WHERE j.queue OPERATOR(pg_catalog.=) _claim.queue AND j.state OPERATOR(pg_catalog.=) 'waiting'
           AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.now() AND j.handler IS NULL
         ORDER BY j.run_at, j.id
         LIMIT max_jobs
           FOR UPDATE SKIP LOCKED;
        RETURN;
    END IF;
    -- Running jobs whose lease lapsed (their worker died) first, oldest lease first, then waiting
    -- jobs that are due, each from its own partial index: jobs_claim holds waiting jobs only, so a
    -- claim never steps over the jobs other workers are running (their versions are in
    -- jobs_leased). The claim runs from its generic plan (src/queue.rs): the jobs are found by
    -- key (an array), not joined, whose generic plan (LIMIT unknown) hashes the whole table.
    -- Returned in run_at order.
    ids := ARRAY(
        SELECT c.id FROM outbox.jobs c
         WHERE c.queue OPERATOR(pg_catalog.=) _claim.queue AND c.state OPERATOR(pg_catalog.=) 'running'
           AND c.lease_until OPERATOR(pg_catalog.<) pg_catalog.now() AND c.handler IS NULL
         ORDER BY c.lease_until, c.id
         LIMIT max_jobs
           FOR UPDATE SKIP LOCKED);
    IF pg_catalog.cardinality(ids) OPERATOR(pg_catalog.<) max_jobs THEN
        ids := ids OPERATOR(pg_catalog.||) ARRAY(
            SELECT c.id FROM outbox.jobs c
             WHERE c.queue OPERATOR(pg_catalog.=) _claim.queue AND c.state OPERATOR(pg_catalog.=) 'waiting'
               AND c.run_at OPERATOR(pg_catalog.<=) pg_catalog.now() AND c.handler IS NULL
             ORDER BY c.run_at, c.id
             LIMIT max_jobs OPERATOR(pg_catalog.-) pg_catalog.cardinality(ids)
               FOR UPDATE SKIP LOCKED);
    END IF;
    RETURN QUERY
    WITH claimed AS (
        UPDATE outbox.jobs j SET state = 'running', lease_until = pg_catalog.now() OPERATOR(pg_catalog.+) lease,
               attempts = j.attempts OPERATOR(pg_catalog.+) 1
         WHERE j.id OPERATOR(pg_catalog.=) ANY (ids)
        RETURNING j.id, j.queue, j.payload, j.key, j.attempts, j.max_attempts, j.lease_until, j.created_at,
                  j.event, j.subscription, j.run_at)
    SELECT k.id, k.queue, k.payload, k.key, k.attempts, k.max_attempts, k.lease_until, k.created_at,
           k.event, k.subscription
      FROM claimed k ORDER BY k.run_at, k.id;
END
$$;

-- outbox.complete_many() (src/queue.rs) for the role `who`: one statement for all the jobs.
-- Returns how many were completed (jobs not running under a lease nor held by this transaction
-- are left alone). A job of a queue `who` may not work fails the whole call (42501), checked
-- once per queue after the delete, which the error then undoes.
CREATE FUNCTION outbox._complete_many(jobs bigint[], who oid) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n integer;
    denied text;
BEGIN
    IF jobs IS NULL THEN
        RAISE EXCEPTION 'jobs must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- Running under a lease, or held by this transaction (claimed with lease => NULL: the row's
    -- xmax is our lock). A job another transaction holds does not match: no waiting for it.
    WITH done AS (
        DELETE FROM outbox.jobs j
         WHERE j.id OPERATOR(pg_catalog.=) ANY (jobs)
           AND (j.state OPERATOR(pg_catalog.=) 'running'
                OR (j.state OPERATOR(pg_catalog.=) 'waiting' AND j.xmax OPERATOR(pg_catalog.=) outbox._my_xid()))
        RETURNING j.queue
    ), per_queue AS (
        SELECT d.queue, pg_catalog.count(*) AS n FROM done d GROUP BY d.queue)
    SELECT coalesce(pg_catalog.sum(p.n), 0)::pg_catalog.int4,
           pg_catalog.min(p.queue) FILTER (WHERE NOT outbox._may(p.queue, who, 'work'))
      INTO n, denied
      FROM per_queue p;
    -- Not all completed: those left must not be another role's (a refusal whatever their state,
    -- so that the answer tells nothing about another role's jobs).
    IF denied IS NULL AND n OPERATOR(pg_catalog.<) pg_catalog.cardinality(jobs) THEN
        SELECT pg_catalog.min(q.queue) INTO denied
          FROM (SELECT DISTINCT j.queue FROM outbox.jobs j WHERE j.id OPERATOR(pg_catalog.=) ANY (jobs)) q
         WHERE NOT outbox._may(q.queue, who, 'work');
    END IF;
    IF denied IS NOT NULL THEN
        PERFORM outbox._check_may(denied, who, 'work');
    END IF;
    RETURN n;
END
$$;

-- Refuses (42501) unless `who` may work the queue of job `job`; false when there is no such job.
-- Takes no lock (a job never changes queue): the callers lock what they change, and a job another
-- transaction holds must not make them wait.
CREATE FUNCTION outbox._check_job(job bigint, who oid) RETURNS boolean
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q text;
BEGIN
    SELECT j.queue INTO q FROM outbox.jobs j WHERE j.id = job;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM outbox._check_may(q, who, 'work');
    RETURN true;
END
$$;

CREATE FUNCTION outbox._fail(job bigint, error text, retry boolean, who oid) RETURNS text
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    j outbox.jobs;
BEGIN
    IF job IS NULL OR retry IS NULL THEN
        RAISE EXCEPTION 'job and retry must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    PERFORM outbox._check_job(job, who);
    SELECT * INTO j FROM outbox.jobs jj
     WHERE jj.id = job AND (jj.state = 'running' OR (jj.state = 'waiting' AND jj.xmax = outbox._my_xid()))
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'job % is not running', job USING ERRCODE = 'object_not_in_prerequisite_state',
            HINT = 'claim it first; a job whose lease lapsed may have been claimed again';
    END IF;
    IF j.state = 'waiting' THEN
        -- Held by this transaction (no lease): this failure is the attempt.
        j.attempts := j.attempts + 1;
        UPDATE outbox.jobs SET attempts = j.attempts WHERE id = job;
    END IF;
    IF retry AND j.attempts < j.max_attempts THEN
        -- 1 s doubling, capped at an hour.
        UPDATE outbox.jobs SET state = 'waiting', lease_until = NULL, last_error = error,
               run_at = now() + least(interval '1 second' * power(2, least(j.attempts - 1, 20)), interval '1 hour')
         WHERE id = job;
        RETURN 'waiting';
    END IF;
    UPDATE outbox.jobs SET state = 'dead', lease_until = NULL, last_error = error, dead_at = now() WHERE id = job;
    RETURN 'dead';
END
$$;

CREATE FUNCTION outbox._extend(job bigint, lease interval, who oid) RETURNS boolean
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF job IS NULL OR lease IS NULL THEN
        RAISE EXCEPTION 'job and lease must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF lease <= '0' OR lease > '1 day' THEN
        RAISE EXCEPTION 'lease must be positive and at most a day' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM outbox._check_job(job, who);
    UPDATE outbox.jobs SET lease_until = now() + lease WHERE id = job AND state = 'running';
    RETURN FOUND;
END
$$;

-- Returns the job's queue when external workers claim it (NULL for a job a worker runs), so the
-- caller can announce it (src/queue.rs).
CREATE FUNCTION outbox._replay_job(job bigint, who oid) RETURNS text
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    was outbox.jobs;
BEGIN
    IF job IS NULL THEN
        RAISE EXCEPTION 'job must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF NOT outbox._check_job(job, who) THEN
        RAISE EXCEPTION 'job % does not exist', job USING ERRCODE = 'undefined_object';
    END IF;
    SELECT * INTO was FROM outbox.jobs j WHERE j.id = job AND j.state = 'dead' FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'job % is not dead', job USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    UPDATE outbox.jobs SET state = 'waiting', attempts = 0, run_at = now(), lease_until = NULL,
           dead_at = NULL
     WHERE id = job;
    RAISE LOG 'pg_outbox: job % of queue "%" replayed by role % after % attempts (dead since %)',
        job, was.queue, who::regrole, was.attempts, coalesce(was.dead_at::text, 'before 0.2.0');
    RETURN CASE WHEN was.handler IS NULL THEN was.queue END;
END
$$;

-- Wake-ups for external workers, and expiry: one round of the workers (src/worker/run.rs), in a
-- transaction of its own. Sends one NOTIFY outbox_jobs, '<queue>' per queue of external workers
-- that got jobs to claim: those in `queues` (committed by applications, announced through shared
-- memory: an application's transaction never notifies, as NOTIFY serialises committers), those
-- whose waiting jobs' run_at passed after `since` (delayed jobs, retries after a failure: a job
-- due when it was written, run_at <= created_at, was announced at its commit and is not again), those
-- with running jobs whose lease lapsed after `leases_since` (NULL: not looked for), and with
-- `every` every queue
-- with jobs to claim (a worker that starts, or more announcements than shared memory held). Jobs
-- that nobody claimed within their queue's expire_after die first ('expired'). The
-- notifications go out when this commits; they carry nothing but the queue's name. While the
-- server's notification queue is more than half full (a listener that stopped reading), nothing
-- is sent and notified is -1: a full queue would fail the commit, and the workers with it.
-- Returns the time it looked (the next `since`) and the milliseconds until the next waiting job
-- comes due or expires (NULL: none).
CREATE FUNCTION outbox._announce_jobs(queues text[], since timestamptz, leases_since timestamptz, every boolean,
                                      OUT checked timestamptz, OUT due_in bigint, OUT notified integer)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q text;
BEGIN
    checked := now();
    notified := 0;
    -- A job held by a claim without a lease (a row lock) is being worked on: skipped. Each queue
    -- that expires jobs reads only the range of its claim index that is old enough, so this costs
    -- nothing per round however many jobs wait (it scanned every waiting job of every queue).
    WITH old AS (
        SELECT j.id, x.expire_after
          FROM outbox.queues x
          JOIN LATERAL (SELECT j.id FROM outbox.jobs j
                         WHERE j.queue = x.name AND j.state = 'waiting' AND j.run_at <= now() - x.expire_after
                           AND j.attempts = 0 AND j.handler IS NULL
                           FOR UPDATE OF j SKIP LOCKED) j ON true
         WHERE x.expire_after IS NOT NULL)
    UPDATE outbox.jobs j
       SET state = 'dead', dead_at = now(),
           last_error = format('expired: nobody claimed it within %s', old.expire_after)
      FROM old
     WHERE j.id = old.id;
    FOR q IN
        SELECT x.name FROM outbox.queues x
         WHERE NOT EXISTS (SELECT FROM outbox.subscriptions s WHERE s.queue = x.name AND s.handler IS NOT NULL)
           AND (x.name = ANY (queues)
                OR EXISTS (SELECT FROM outbox.jobs j
                            WHERE j.queue = x.name AND j.state = 'waiting' AND j.run_at <= now()
                              AND (every OR (j.run_at > since AND j.run_at > j.created_at))
                              AND j.handler IS NULL)
                OR ((every OR leases_since IS NOT NULL) AND EXISTS (SELECT FROM outbox.jobs j
                            WHERE j.queue = x.name AND j.state = 'running' AND j.lease_until <= now()
                              AND (every OR j.lease_until > leases_since) AND j.handler IS NULL)))
         ORDER BY x.name
    LOOP
        IF notified < 0 OR pg_notification_queue_usage() > 0.5 THEN
            notified := -1;
        ELSE
            PERFORM pg_notify('outbox_jobs', q);
            notified := notified + 1;
        END IF;
    END LOOP;
    -- The next job to come due, and the next to expire (the oldest waiting job of a queue that
    -- expires them; one that was claimed before never expires, and is passed over).
    SELECT ceil(extract(epoch FROM least(min(n.run_at), min(e.expires)) - clock_timestamp()) * 1000)::bigint
      INTO due_in
      FROM outbox.queues x
      LEFT JOIN LATERAL (SELECT j.run_at FROM outbox.jobs j
                          WHERE j.queue = x.name AND j.state = 'waiting' AND j.run_at > now()
                          ORDER BY j.run_at LIMIT 1) n ON true
      LEFT JOIN LATERAL (SELECT j.run_at + x.expire_after AS expires FROM outbox.jobs j
                          WHERE x.expire_after IS NOT NULL AND j.queue = x.name AND j.state = 'waiting'
                            AND j.attempts = 0 AND j.handler IS NULL
                          ORDER BY j.run_at LIMIT 1) e ON true
     WHERE NOT EXISTS (SELECT FROM outbox.subscriptions s WHERE s.queue = x.name AND s.handler IS NOT NULL);
    -- Not greatest(0, ...), which skips a NULL: nothing to come was 0, and the workers looked
    -- again at once instead of after their longest wait.
    IF due_in < 0 THEN
        due_in := 0;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox._cloudevent(e outbox.event) RETURNS jsonb
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

-- Kafka sinks (issue #13): a kind of sink, where each produces, how an event becomes a message.
ALTER TABLE outbox.sinks DROP CONSTRAINT sinks_kind_check,
    ADD CONSTRAINT sinks_kind_check CHECK (kind IN ('sql', 'http', 'kafka'));
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

CREATE OR REPLACE FUNCTION outbox._zoned_instant(wall timestamp, zone text) RETURNS timestamptz
LANGUAGE plpgsql STABLE STRICT SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t     timestamptz := wall AT TIME ZONE zone;
    shown timestamp   := t AT TIME ZONE zone;
    back  interval;   -- how far a fall back put the clocks back
    gap   bigint;
    lo    bigint;  -- microseconds from t; the local time at lo is before wall, at hi not
    hi    bigint;
    mid   bigint;
BEGIN
    IF shown = wall THEN
        back := ((t - interval '3 hours') AT TIME ZONE zone) - ((t - interval '3 hours') AT TIME ZONE 'UTC')
                - ((t AT TIME ZONE zone) - (t AT TIME ZONE 'UTC'));
        IF back > interval '0' AND ((t - back) AT TIME ZONE zone) = wall THEN
            RETURN t - back;  -- the first of a repeated local time
        END IF;
        RETURN t;
    END IF;
    gap := abs(extract(epoch FROM shown - wall) * 1000000)::bigint;
    IF shown > wall THEN
        lo := -gap; hi := 0;  -- PostgreSQL's documented reading: t is past the gap's end
    ELSE
        lo := 0; hi := gap;   -- the other reading, should a release ever change it
    END IF;
    -- Whole microseconds below 2^53 times '1 microsecond': exact in float8 (a non-integral
    -- factor would be truncated by interval * float8).
    WHILE hi - lo > 1 LOOP
        mid := lo + (hi - lo) / 2;
        IF ((t + mid::float8 * interval '1 microsecond') AT TIME ZONE zone) >= wall THEN
            hi := mid;
        ELSE
            lo := mid;
        END IF;
    END LOOP;
    RETURN t + hi::float8 * interval '1 microsecond';
END
$$;

CREATE OR REPLACE FUNCTION outbox._schedule(name text, every interval, daily_at time, zone text, weekly_on text,
                                 topic text, queue text, payload jsonb, owner oid,
                                 at_local timestamp, each text)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    forms      constant text := 'outbox.schedule(name, every => ''5 minutes'', ...), '
        'outbox.schedule(name, daily_at => ''02:30'', zone => ''Europe/Berlin'', weekly_on => ''monday'', ...) '
        '(weekly_on is optional) or outbox.schedule(name, at => ''2027-01-15 09:00'', zone => ''Europe/Berlin'', ...)';
    tz         text;
    dow        smallint;
    first_run  timestamptz;
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'schedule name must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- The same rule as queue, consumer and sink names (pg_outbox_core::name).
    IF name !~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION 'invalid schedule name "%"', name USING ERRCODE = 'invalid_name',
            HINT = 'a schedule name is 1 to 63 letters, digits, ''_'', ''-'' or ''.'', starting with a letter or digit';
    END IF;
    IF owner IS NULL THEN
        RAISE EXCEPTION 'owner must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;

    IF every IS NULL AND daily_at IS NULL AND weekly_on IS NOT NULL THEN
        RAISE EXCEPTION 'weekly_on needs daily_at' USING ERRCODE = 'invalid_parameter_value', HINT = forms;
    END IF;
    IF every IS NULL AND daily_at IS NULL AND at_local IS NULL AND zone IS NOT NULL THEN
        RAISE EXCEPTION 'zone needs daily_at or at' USING ERRCODE = 'invalid_parameter_value', HINT = forms;
    END IF;
    IF every IS NULL AND daily_at IS NULL AND at_local IS NULL THEN
        RAISE EXCEPTION 'a schedule needs every, daily_at or at' USING ERRCODE = 'invalid_parameter_value',
            HINT = forms;
    END IF;
    IF (every IS NOT NULL)::int + (daily_at IS NOT NULL)::int + (at_local IS NOT NULL)::int > 1 THEN
        RAISE EXCEPTION 'a schedule has one of every, daily_at or at, not %',
            concat_ws(' and ', CASE WHEN every IS NOT NULL THEN 'every' END,
                      CASE WHEN daily_at IS NOT NULL THEN 'daily_at' END,
                      CASE WHEN at_local IS NOT NULL THEN 'at' END)
            USING ERRCODE = 'invalid_parameter_value', HINT = forms;
    END IF;
    IF weekly_on IS NOT NULL AND at_local IS NOT NULL THEN
        RAISE EXCEPTION 'weekly_on goes with daily_at, not with at' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'at is one run; daily_at with weekly_on repeats every week';
    END IF;

    IF every IS NOT NULL THEN
        IF zone IS NOT NULL OR weekly_on IS NOT NULL THEN
            RAISE EXCEPTION '% goes with daily_at, not with every', CASE WHEN zone IS NOT NULL THEN 'zone' ELSE 'weekly_on' END
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'every is a fixed length that ignores clocks; for a local time use daily_at and zone';
        END IF;
        IF extract(year FROM every) <> 0 OR extract(month FROM every) <> 0 THEN
            RAISE EXCEPTION 'every must not have months or years, not %', every
                USING ERRCODE = 'invalid_parameter_value',
                      DETAIL = 'Months have no fixed length, and every is a fixed length.',
                      HINT = 'use days (''30 days''), or daily_at with weekly_on for calendar times';
        END IF;
        IF extract(epoch FROM every) <= 0 THEN
            RAISE EXCEPTION 'every must be positive, not %', every USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF extract(epoch FROM every) < 1 THEN
            RAISE EXCEPTION 'every must be at least 1 second, not %', every USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- A bound far beyond any real schedule, so that next_run can never leave the timestamp
        -- range: the overflow would fail the firing statement, and with it every schedule.
        IF extract(epoch FROM every) > 3650 * 86400 THEN
            RAISE EXCEPTION 'every must be at most 3650 days, not %', every USING ERRCODE = 'invalid_parameter_value';
        END IF;
    ELSE
        IF zone IS NULL THEN
            RAISE EXCEPTION '% needs a zone', CASE WHEN daily_at IS NOT NULL THEN 'daily_at' ELSE 'at' END
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'a time zone name such as ''America/New_York'' or ''UTC'' (see pg_timezone_names)';
        END IF;
        -- time accepts 24:00, the next day's midnight: it would run on the day after weekly_on.
        IF daily_at >= '24:00' THEN
            RAISE EXCEPTION 'daily_at must be before 24:00' USING ERRCODE = 'invalid_parameter_value',
                HINT = 'use 00:00 for midnight';
        END IF;
        -- Names only: an abbreviation ('PST') or an offset ('+02', 'UTC+3') is a fixed offset,
        -- not a zone's rules, and POSIX strings read signs backwards. Case is forgiven, as
        -- PostgreSQL does; the zone's own spelling is stored.
        SELECT z.name INTO tz FROM pg_timezone_names z WHERE z.name = zone;
        IF tz IS NULL THEN
            SELECT min(z.name) INTO tz FROM pg_timezone_names z WHERE lower(z.name) = lower(zone);
        END IF;
        IF tz IS NULL THEN
            RAISE EXCEPTION 'unknown time zone "%"', zone USING ERRCODE = 'invalid_parameter_value',
                HINT = 'use a zone name from pg_timezone_names, such as ''Europe/Berlin'' or ''UTC''; '
                       'abbreviations such as ''PST'' and offsets such as ''+02'' are not zones';
        END IF;
        IF weekly_on IS NOT NULL THEN
            SELECT (d.n - 1)::smallint INTO dow
              FROM unnest(ARRAY['sunday', 'monday', 'tuesday', 'wednesday', 'thursday', 'friday', 'saturday'])
                   WITH ORDINALITY AS d(day, n)
             WHERE lower(weekly_on) IN (d.day, left(d.day, 3));
            IF dow IS NULL THEN
                RAISE EXCEPTION 'invalid weekly_on "%"', weekly_on USING ERRCODE = 'invalid_parameter_value',
                    HINT = 'a day of the week: sunday, monday, tuesday, wednesday, thursday, friday or saturday, '
                           'or its first three letters (''mon'')';
            END IF;
        END IF;
    END IF;

    IF topic IS NULL AND queue IS NULL THEN
        RAISE EXCEPTION 'a schedule needs a topic or a queue' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'topic => ''...'' raises an event at each run; queue => ''...'' queues a job';
    END IF;
    IF topic IS NOT NULL AND queue IS NOT NULL THEN
        RAISE EXCEPTION 'a schedule has either a topic or a queue, not both' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'topic => ''...'' raises an event at each run; queue => ''...'' queues a job';
    END IF;
    IF queue IS NOT NULL THEN
        PERFORM outbox._check_queue(queue);
    END IF;
    IF each IS NOT NULL AND queue IS NULL THEN
        RAISE EXCEPTION 'each queues jobs: it needs a queue, not a topic' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'queue => ''...'' queues one job per row the query returns';
    END IF;
    IF each IS NOT NULL AND payload IS NOT NULL AND payload <> '{}' THEN
        RAISE EXCEPTION 'an each schedule takes no payload: each row is a job''s payload'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- NULL means {}, as in raise() and enqueue().
    IF payload IS NOT NULL AND jsonb_typeof(payload) <> 'object' THEN
        RAISE EXCEPTION 'payload must be a JSON object' USING ERRCODE = 'invalid_parameter_value',
            HINT = 'wrap the value in an object, e.g. {"value": ...}; NULL means {}';
    END IF;

    IF queue IS NOT NULL THEN
        -- Its runs queue jobs as the owner: the owner must be allowed to (the queue is created,
        -- owned by the owner, if it does not exist yet).
        PERFORM outbox._use_queue(queue, owner, 'enqueue');
    END IF;
    IF at_local IS NOT NULL THEN
        IF NOT isfinite(at_local) THEN
            RAISE EXCEPTION 'at must be a date and time, not %', at_local USING ERRCODE = 'invalid_parameter_value';
        END IF;
        first_run := outbox._zoned_instant(at_local, tz);
        -- A one-off run already past is a mistake (a date in the wrong year, a zone mixed up),
        -- not a run to fire at once.
        IF first_run <= now() THEN
            RAISE EXCEPTION 'at % in % is in the past', at_local, tz USING ERRCODE = 'invalid_parameter_value',
                DETAIL = format('That is %s UTC.', to_char(first_run AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'));
        END IF;
    ELSE
        first_run := outbox._next_run(every, daily_at, tz, dow, now(), NULL);
    END IF;
    -- ON CONFLICT rather than a look first: of two sessions creating one name at once, the second
    -- waits for the first and then gets the clear error, not a unique violation.
    INSERT INTO outbox.schedules AS s (name, every, daily_at, zone, weekly_on, at_local, topic, queue, payload,
                                       each, owner, next_run)
    VALUES (name, every, daily_at, tz, dow, at_local, topic, queue, coalesce(payload, '{}'), each, owner, first_run)
    ON CONFLICT ON CONSTRAINT schedules_pkey DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'schedule "%" already exists', name USING ERRCODE = 'duplicate_object',
            HINT = 'outbox.unschedule() it first to change it';
    END IF;
    RETURN first_run;
END
$$;

CREATE FUNCTION outbox._schedule_allowed(owner oid, topic text, queue text) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN topic IS NOT NULL
                THEN has_function_privilege(owner, 'outbox.raise(text, jsonb, text, text, jsonb)', 'EXECUTE')
                ELSE has_function_privilege(owner, 'outbox.enqueue(text, jsonb, timestamptz, text, integer)', 'EXECUTE')
                     AND outbox._may(queue, owner, 'enqueue')
           END
$$;

CREATE FUNCTION outbox._schedule_denied(owner oid, topic text, queue text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT format('its owner %s may no longer write to %s', owner::regrole,
                  coalesce('topic ' || topic, 'queue ' || queue))
$$;

CREATE FUNCTION outbox._ran_each(name text, run timestamptz, each text, rows text[], error text) RETURNS integer
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    s     outbox.schedules;
    bad   text;
    n     integer := 0;
    after timestamptz;
BEGIN
    -- Not waited for: a tenant's transaction that changes or drops it holds its row for as long
    -- as it stays open (-1: try again later).
    SELECT * INTO s FROM outbox.schedules x WHERE x.name = _ran_each.name FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN CASE WHEN EXISTS (SELECT FROM outbox.schedules x WHERE x.name = _ran_each.name) THEN -1 END;
    END IF;
    IF s.next_run IS DISTINCT FROM run OR s.each IS DISTINCT FROM _ran_each.each THEN
        RETURN NULL;
    END IF;
    IF error IS NULL THEN
        SELECT coalesce(r, 'NULL') INTO bad
          FROM unnest(rows) r WHERE r IS NULL OR jsonb_typeof(r::jsonb) <> 'object' LIMIT 1;
        IF FOUND THEN
            error := format('each returned a row that is not a JSON object: %s', left(bad, 200));
        END IF;
    END IF;
    IF error IS NULL THEN
        INSERT INTO outbox.jobs AS j (queue, payload, key, schedule, max_attempts)
        SELECT s.queue, r::jsonb, md5(r::jsonb::text), s.name, 10
          FROM unnest(rows) r
        ON CONFLICT (queue, schedule, key) WHERE schedule IS NOT NULL AND state = 'waiting' DO NOTHING;
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n > 0 THEN
            PERFORM outbox._hold_queues(ARRAY[s.queue]);
            -- External workers of the queue are woken once this commits (src/worker).
            PERFORM outbox._announce(s.queue);
        END IF;
    END IF;
    IF error IS NULL OR (s.at_local IS NOT NULL AND s.failed_runs >= 9) THEN
        IF s.at_local IS NOT NULL THEN
            DELETE FROM outbox.schedules x WHERE x.name = s.name;
        ELSE
            UPDATE outbox.schedules x
               SET next_run = outbox._next_run(x.every, x.daily_at, x.zone, x.weekly_on, now(), run),
                   last_run = now(), fired = x.fired + 1, last_error = error, failed_runs = 0
             WHERE x.name = s.name;
        END IF;
    ELSE
        after := now() + least(interval '1 hour', interval '1 second' * power(2, least(s.failed_runs, 12)));
        UPDATE outbox.schedules x
           SET next_run = CASE WHEN x.at_local IS NOT NULL THEN after
                               ELSE greatest(after, outbox._next_run(x.every, x.daily_at, x.zone, x.weekly_on, now(), run)) END,
               last_run = now(), fired = x.fired + 1, last_error = error, failed_runs = x.failed_runs + 1
         WHERE x.name = s.name;
    END IF;
    IF error IS NOT NULL THEN
        RAISE WARNING 'pg_outbox: schedule "%" skipped a run: %', s.name, error
            USING HINT = CASE WHEN s.at_local IS NOT NULL AND s.failed_runs >= 9
                              THEN 'it ran once and failed 10 times: it is dropped'
                              ELSE 'outbox.schedule_status() shows the last error; outbox.set_schedule() changes the query' END;
    END IF;
    RETURN n;
END
$$;

CREATE FUNCTION outbox._place_one_offs() RETURNS integer
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    -- Not one that failed and backs off (its next_run is its retry), nor one whose row a
    -- tenant's open transaction holds (not waited for; set_schedule places it again anyway).
    UPDATE outbox.schedules s SET next_run = outbox._zoned_instant(s.at_local, s.zone)
      FROM (SELECT x.name FROM outbox.schedules x
             WHERE x.at_local IS NOT NULL AND x.failed_runs = 0
               AND x.next_run <> outbox._zoned_instant(x.at_local, x.zone)
               FOR UPDATE SKIP LOCKED) m
     WHERE s.name = m.name;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

CREATE FUNCTION outbox._schedule_status(who oid)
RETURNS TABLE (
    name       text,
    form       text,          -- 'every 00:00:30', 'daily at 02:30:00 America/New_York', 'weekly on monday at ...'
                              -- or 'once at 2027-01-15 09:00:00 Europe/Berlin'
    target     text,          -- 'topic <topic>', 'queue <queue>', or 'queue <queue>, each row of <query>'
    next_run   timestamptz,
    last_run   timestamptz,
    fired      bigint,
    owner      name,
    last_error text           -- why the last run wrote nothing; NULL after one that went through
)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.name,
           CASE WHEN s.every IS NOT NULL THEN 'every ' || s.every::text
                WHEN s.at_local IS NOT NULL THEN 'once at ' || s.at_local::text || ' ' || s.zone
                WHEN s.weekly_on IS NOT NULL
                THEN 'weekly on ' || (ARRAY['sunday','monday','tuesday','wednesday','thursday','friday','saturday'])[s.weekly_on + 1]
                     || ' at ' || s.daily_at::text || ' ' || s.zone
                ELSE 'daily at ' || s.daily_at::text || ' ' || s.zone END,
           CASE WHEN s.topic IS NOT NULL THEN 'topic ' || s.topic
                WHEN s.each IS NOT NULL AND v.visible THEN 'queue ' || s.queue || ', each row of ' || s.each
                WHEN s.each IS NOT NULL THEN 'queue ' || s.queue || ', each row of a query'
                ELSE 'queue ' || s.queue END,
           s.next_run, s.last_run, s.fired, r.rolname,
           CASE WHEN v.visible THEN s.last_error
                WHEN s.last_error IS NOT NULL THEN 'a run failed (the error is shown to its owner)' END
      FROM outbox.schedules s
      LEFT JOIN pg_catalog.pg_roles r ON r.oid = s.owner
     CROSS JOIN LATERAL (SELECT pg_has_role(who, s.owner, 'USAGE')
                                OR pg_has_role(who, 'pg_read_all_stats', 'USAGE') AS visible) v
     ORDER BY s.name
$$;

CREATE OR REPLACE FUNCTION outbox._fire_schedules() RETURNS integer
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
    queues text[];
    denied text[];
    d text;
BEGIN
    WITH due AS (
        SELECT s.name, s.next_run, s.at_local IS NOT NULL AS once, outbox._schedule_allowed(s.owner, s.topic, s.queue) AS allowed
          FROM outbox.schedules s
         WHERE s.next_run <= now() AND s.each IS NULL
           FOR UPDATE SKIP LOCKED
    ), moved AS (
        UPDATE outbox.schedules s
           SET next_run = outbox._next_run(s.every, s.daily_at, s.zone, s.weekly_on, now(), due.next_run),
               last_run = now(),
               fired = s.fired + 1,
               last_error = CASE WHEN due.allowed THEN NULL ELSE outbox._schedule_denied(s.owner, s.topic, s.queue) END
          FROM due
         WHERE s.name = due.name AND NOT due.once
        RETURNING s.name, s.topic, s.queue, s.payload, s.owner, due.next_run AS run, due.allowed
    ), done AS (
        DELETE FROM outbox.schedules s
         USING due
         WHERE s.name = due.name AND due.once
        RETURNING s.name, s.topic, s.queue, s.payload, s.owner, due.next_run AS run, due.allowed
    ), fired AS (
        SELECT r.name, r.topic, r.queue, r.payload, r.owner, r.allowed,
               to_char(r.run AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS scheduled_for
          FROM (SELECT * FROM moved UNION ALL SELECT * FROM done) r
    ), queued AS (
        -- A run's job, keyed <schedule>@<instant> in the schedule's own namespace (index
        -- jobs_waiting_run): no key given to enqueue() can stand in for it.
        INSERT INTO outbox.jobs AS j (queue, payload, key, schedule, max_attempts)
        SELECT f.queue, f.payload, f.name || '@' || f.scheduled_for, f.name, 10
          FROM fired f
         WHERE f.allowed AND f.queue IS NOT NULL
        ON CONFLICT (queue, schedule, key) WHERE schedule IS NOT NULL AND state = 'waiting' DO NOTHING
        RETURNING j.id, j.queue
    )
    -- count(x) evaluates x for every row: each run raises once (raise() never returns NULL).
    SELECT count(CASE WHEN f.allowed AND f.topic IS NOT NULL
                      THEN outbox.raise(f.topic, f.payload, NULL, NULL,
                                        jsonb_build_object('schedule', f.name, 'scheduled_for', f.scheduled_for))::text
                 END) + (SELECT count(*) FROM queued),
           array_agg(format('schedule "%s" skipped a run: %s', f.name,
                            outbox._schedule_denied(f.owner, f.topic, f.queue)))
               FILTER (WHERE NOT f.allowed),
           (SELECT array_agg(DISTINCT q.queue) FROM queued q)
      INTO n, denied, queues
      FROM fired f;
    -- The queues that got jobs are held until this commits (no job outlives its queue).
    PERFORM outbox._hold_queues(queues);
    -- External workers of the queues that got jobs are woken once this commits (src/worker).
    PERFORM outbox._announce(q) FROM unnest(queues) q;
    FOREACH d IN ARRAY coalesce(denied, '{}') LOOP
        RAISE WARNING 'pg_outbox: %', d USING HINT = 'grant the right back, or outbox.unschedule() it';
    END LOOP;
    RETURN n;
END
$$;

-- The lock outbox._tick() takes first (src/ticks.rs).
CREATE FUNCTION outbox."_lock_ticks"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'lock_ticks_wrapper';

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

-- Takes a tick unless its batch would be empty; returns the newest tick (src/ticks.rs).
CREATE FUNCTION outbox."_tick"() RETURNS bigint
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'tick_wrapper';

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

-- Whether the rest of a batch after a position is one range of the log, and its bounds
-- (src/ticks.rs; outbox.read asks).
CREATE FUNCTION outbox."_batch_range"("since" TEXT, "upto" TEXT, "after_txid" TEXT, "after_seq" bigint)
RETURNS TABLE ("after_txid" TEXT, "after_seq" bigint, "below" TEXT, "running" TEXT)
IMMUTABLE STRICT PARALLEL SAFE LANGUAGE c AS 'MODULE_PATHNAME', 'batch_range_wrapper';

-- Readers by ticks: the cursor's batch (see schema.sql). read_by added as sinks.failures is.
ALTER TABLE outbox.consumers
    ADD COLUMN read_by text,
    ADD COLUMN tick bigint,
    ADD COLUMN since pg_catalog.pg_snapshot,
    ADD COLUMN upto pg_catalog.pg_snapshot;
UPDATE outbox.consumers SET read_by = 'horizon';
ALTER TABLE outbox.consumers
    ALTER COLUMN read_by SET DEFAULT 'horizon',
    ALTER COLUMN read_by SET NOT NULL,
    ADD CONSTRAINT consumers_read_by CHECK (read_by IN ('horizon', 'ticks')),
    ADD CONSTRAINT consumers_batch CHECK ((tick IS NULL) = (since IS NULL) AND (tick IS NULL) = (upto IS NULL)
                                          AND (tick IS NULL OR read_by = 'ticks'));
CREATE OR REPLACE FUNCTION outbox._cursor_forward_only() RETURNS trigger
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
DROP TRIGGER consumers_forward_only ON outbox.consumers;
CREATE TRIGGER consumers_forward_only BEFORE UPDATE OF txid, seq, tick ON outbox.consumers
    FOR EACH ROW EXECUTE FUNCTION outbox._cursor_forward_only();

-- Pull consumers and subscriptions read by ticks too (outbox.alter_consumer, src/cursor.rs;
-- outbox.alter_subscription, src/subscription.rs).
-- A consumer that reads by ticks (src/sql/ticks.sql) reads the rest of its batch, then the batches
-- of the ticks after it, in order, each from the snapshot the one before ends at; advance() finds
-- a position's batch the same way (src/cursor.rs). The ticks are flushed to disk before their
-- batches are handed out (outbox._flush_log).
CREATE OR REPLACE FUNCTION outbox.read(consumer text, max_events integer DEFAULT 100)
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

CREATE FUNCTION outbox."_flush_log"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'flush_log_wrapper';

CREATE FUNCTION outbox."alter_consumer"(
	"consumer" TEXT,
	"options" jsonb
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'alter_consumer_wrapper';

CREATE FUNCTION outbox."alter_subscription"(
	"name" TEXT,
	"options" jsonb
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'alter_subscription_wrapper';

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

-- The worker asks it every round: now Rust with a kept plan (src/schedule.rs); a SQL function
-- with a SET clause was parsed and planned again at every call.
CREATE OR REPLACE FUNCTION outbox."_schedule_due_in"() RETURNS bigint
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'schedule_due_in_wrapper';

-- The calls, now SECURITY INVOKER in src/queue.rs. OR REPLACE keeps their grants.
CREATE OR REPLACE FUNCTION outbox."enqueue"(
	"queue" TEXT,
	"payload" jsonb DEFAULT '{}',
	"run_at" timestamp with time zone DEFAULT NULL,
	"key" TEXT DEFAULT NULL,
	"max_attempts" INT DEFAULT 10
) RETURNS bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'enqueue_wrapper';

CREATE OR REPLACE FUNCTION outbox."claim"(
	"queue" TEXT,
	"max_jobs" INT DEFAULT 1,
	"lease" interval DEFAULT '30 seconds'
) RETURNS SETOF outbox.job
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'claim_wrapper';

CREATE OR REPLACE FUNCTION outbox."complete"(
	"job" bigint
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'complete_wrapper';

CREATE OR REPLACE FUNCTION outbox."complete_many"(
	"jobs" bigint[]
) RETURNS INT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'complete_many_wrapper';

CREATE OR REPLACE FUNCTION outbox."fail"(
	"job" bigint,
	"error" TEXT DEFAULT NULL,
	"retry" bool DEFAULT true
) RETURNS TEXT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'fail_wrapper';

CREATE OR REPLACE FUNCTION outbox."extend"(
	"job" bigint,
	"lease" interval DEFAULT '30 seconds'
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'extend_wrapper';

CREATE OR REPLACE FUNCTION outbox."replay_job"(
	"job" bigint
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'replay_job_wrapper';

CREATE OR REPLACE FUNCTION outbox."status"() RETURNS TABLE (
	"name" TEXT,
	"kind" TEXT,
	"position" TEXT,
	"events_behind" bigint,
	"age_behind" interval,
	"state" TEXT,
	"next_attempt_at" timestamp with time zone,
	"attempts" INT,
	"batch_size" INT,
	"last_error" TEXT,
	"last_sqlstate" TEXT,
	"dead_letters" bigint,
	"matched" bigint,
	"skipped" bigint,
	"predicate_errors" bigint
)
STRICT STABLE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'status_wrapper';

CREATE OR REPLACE FUNCTION outbox."queue_status"() RETURNS TABLE (
	"queue" TEXT,
	"waiting" bigint,
	"running" bigint,
	"retrying" bigint,
	"dead" bigint,
	"oldest_due" interval,
	"last_error" TEXT
)
STRICT STABLE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'queue_status_wrapper';

CREATE FUNCTION outbox."create_queue"(
	"name" TEXT,
	"expire_after" interval DEFAULT NULL
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'create_queue_wrapper';

CREATE FUNCTION outbox."drop_queue"(
	"name" TEXT,
	"drop_jobs" bool DEFAULT false
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'drop_queue_wrapper';

CREATE FUNCTION outbox."grant_queue"(
	"queue" TEXT,
	"role" regrole,
	"enqueue" bool DEFAULT true,
	"work" bool DEFAULT true
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'grant_queue_wrapper';

CREATE FUNCTION outbox."revoke_queue"(
	"queue" TEXT,
	"role" regrole,
	"enqueue" bool DEFAULT true,
	"work" bool DEFAULT true
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'revoke_queue_wrapper';

CREATE FUNCTION outbox."_start_delivery"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'start_delivery_wrapper';

CREATE FUNCTION outbox."metrics"() RETURNS TABLE (
	"name" TEXT,
	"kind" TEXT,
	"events_behind" bigint,
	"seconds_behind" double precision,
	"delivered" bigint,
	"failures" bigint,
	"dead_letters" bigint,
	"matched" bigint,
	"skipped" bigint,
	"predicate_errors" bigint
)
STRICT STABLE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'metrics_wrapper';

CREATE FUNCTION outbox."set_schedule"(
	"name" TEXT,
	"every" interval DEFAULT NULL,
	"daily_at" time DEFAULT NULL,
	"zone" TEXT DEFAULT NULL,
	"weekly_on" TEXT DEFAULT NULL,
	"topic" TEXT DEFAULT NULL,
	"queue" TEXT DEFAULT NULL,
	"payload" jsonb DEFAULT '{}',
	"at" timestamp DEFAULT NULL,
	"each" TEXT DEFAULT NULL
) RETURNS timestamp with time zone
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'set_schedule_wrapper';

CREATE FUNCTION outbox."schedule"(
	"name" TEXT,
	"every" interval DEFAULT NULL,
	"daily_at" time DEFAULT NULL,
	"zone" TEXT DEFAULT NULL,
	"weekly_on" TEXT DEFAULT NULL,
	"topic" TEXT DEFAULT NULL,
	"queue" TEXT DEFAULT NULL,
	"payload" jsonb DEFAULT '{}',
	"at" timestamp DEFAULT NULL,
	"each" TEXT DEFAULT NULL
) RETURNS timestamp with time zone
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'schedule_wrapper';

CREATE FUNCTION outbox."alter_queue"(
	"name" TEXT,
	"expire_after" interval
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'alter_queue_wrapper';

CREATE FUNCTION outbox."schedule_status"() RETURNS TABLE (
	"name" TEXT,
	"form" TEXT,
	"target" TEXT,
	"next_run" timestamp with time zone,
	"last_run" timestamp with time zone,
	"fired" bigint,
	"owner" TEXT,
	"last_error" TEXT
)
STRICT STABLE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'schedule_status_wrapper';

CREATE FUNCTION outbox."_announce"(
	"queue" TEXT
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'announce_sql_wrapper';

CREATE FUNCTION outbox."alter_sink"(
	"id" TEXT,
	"options" jsonb
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'alter_sink_wrapper';

CREATE FUNCTION outbox."create_kafka_sink"(
	"id" TEXT,
	"brokers" TEXT,
	"kafka_topic" TEXT,
	"topics" TEXT[] DEFAULT NULL,
	"key" TEXT DEFAULT 'subject',
	"batch_size" INT DEFAULT NULL,
	"properties" jsonb DEFAULT '{}',
	"timeout_ms" INT DEFAULT 30000,
	"start_at" TEXT DEFAULT 'origin'
) RETURNS TEXT
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'create_kafka_sink_wrapper';

-- Nothing new is usable by PUBLIC (as src/sql/privileges.sql does at install), named one by one:
-- a REVOKE on every function would record the grants users made on the others as the
-- extension's own initial privileges (pg_dump would then leave them out), and default
-- privileges may have given the new ones ACLs of their own.
REVOKE ALL ON TABLE outbox.queues, outbox.queue_grants, outbox.lineage, outbox.kafka_sinks, outbox.ticks FROM PUBLIC;
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'outbox'::pg_catalog.regnamespace
                AND p.proname = ANY (ARRAY['_event_size', '_read_window', '_read_log', '_may', '_check_may',
                    '_use_queue', '_create_queue', '_owned_queue', '_drop_queue', '_check_grant', '_grant_queue',
                    '_revoke_queue', 'queue_privileges', '_hold_queues', '_enqueue', '_claim', '_complete_many',
                    '_check_job', '_fail', '_extend', '_replay_job', '_status', '_queue_status',
                    'create_queue', 'drop_queue', 'grant_queue', 'revoke_queue',
                    '_start_delivery', 'metrics', '_log_txid', '_log_horizon',
                    'set_schedule', 'schedule', 'schedule_status', '_schedule', '_schedule_allowed',
                    '_schedule_denied', '_ran_each', '_place_one_offs', '_check_expire_after', '_alter_queue',
                    'alter_queue', '_announce_jobs', '_schedule_status', '_announce', 'create_kafka_sink', 'alter_sink',
                    '_log_snapshot', '_lock_ticks', '_tick', '_tick_before', '_tick_snapshot', '_snapshot_log', '_tick_log', '_batch_window',
                    '_batch_after', '_range_log', '_range_after', '_range_window', '_batch_range', '_flush_log', 'alter_consumer',
                    'alter_subscription']) LOOP
        EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

-- The queues that exist, and who keeps what on them.
DO $$
DECLARE
    log_owner oid := (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = 'outbox.events'::pg_catalog.regclass);
    queues bigint;
    grants bigint;
BEGIN
    -- A subscription with a handler owns the queue of its name (0.1.0 let other subscriptions
    -- name it too: those become grantees below).
    INSERT INTO outbox.queues (name, owner)
    SELECT s.queue, c.owner
      FROM outbox.subscriptions s JOIN outbox.consumers c ON c.name = s.name
     WHERE s.handler IS NOT NULL
    ON CONFLICT DO NOTHING;
    -- Another subscription's queue: its owner's (the oldest subscription's, if several feed one).
    INSERT INTO outbox.queues (name, owner)
    SELECT DISTINCT ON (s.queue) s.queue, c.owner
      FROM outbox.subscriptions s JOIN outbox.consumers c ON c.name = s.name
     ORDER BY s.queue, s.created_at, s.name
    ON CONFLICT DO NOTHING;
    INSERT INTO outbox.queues (name, owner)
    SELECT DISTINCT ON (s.queue) s.queue, s.owner
      FROM outbox.schedules s WHERE s.queue IS NOT NULL
     ORDER BY s.queue, s.created_at, s.name
    ON CONFLICT DO NOTHING;
    INSERT INTO outbox.queues (name, owner)
    SELECT DISTINCT j.queue, log_owner FROM outbox.jobs j
    ON CONFLICT DO NOTHING;
    -- Other subscriptions and schedules feeding a queue keep doing so.
    INSERT INTO outbox.queue_grants AS g (queue, grantee, enqueue, work)
    SELECT DISTINCT f.queue, f.owner, true, false
      FROM (SELECT s.queue, c.owner FROM outbox.subscriptions s JOIN outbox.consumers c ON c.name = s.name
            UNION
            SELECT s.queue, s.owner FROM outbox.schedules s WHERE s.queue IS NOT NULL) f
      JOIN outbox.queues q ON q.name = f.queue
     WHERE NOT pg_catalog.pg_has_role(f.owner, q.owner, 'USAGE')
    ON CONFLICT ON CONSTRAINT queue_grants_pkey DO UPDATE SET enqueue = true;
    -- Every role granted EXECUTE on enqueue() or claim() could use every queue.
    INSERT INTO outbox.queue_grants AS g (queue, grantee, enqueue, work)
    SELECT q.name, r.grantee, pg_catalog.bool_or(r.f = 'enqueue'), pg_catalog.bool_or(r.f = 'claim')
      FROM outbox.queues q
     CROSS JOIN (SELECT a.grantee, p.proname::text AS f
                   FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
                  WHERE p.oid IN ('outbox.enqueue(text, jsonb, timestamptz, text, integer)'::pg_catalog.regprocedure,
                                  'outbox.claim(text, integer, interval)'::pg_catalog.regprocedure)
                    AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0) r
     WHERE NOT EXISTS (SELECT FROM outbox.subscriptions s WHERE s.queue = q.name AND s.handler IS NOT NULL)
       AND NOT pg_catalog.pg_has_role(r.grantee, q.owner, 'USAGE')
     GROUP BY q.name, r.grantee
    ON CONFLICT ON CONSTRAINT queue_grants_pkey
    DO UPDATE SET enqueue = g.enqueue OR excluded.enqueue, work = g.work OR excluded.work;
    SELECT pg_catalog.count(*) INTO queues FROM outbox.queues;
    SELECT pg_catalog.count(*) INTO grants FROM outbox.queue_grants;
    IF queues > 0 THEN
        RAISE NOTICE 'pg_outbox 0.2.0: job queues now have owners; the % existing queues keep the access of 0.1.0 (% grants)', queues, grants
            USING HINT = 'review them with SELECT * FROM outbox.queue_privileges(); narrow them with outbox.revoke_queue()';
    END IF;
END
$$;

-- Every subscription and schedule names a queue that exists, for as long as it does. (Jobs too,
-- by outbox._hold_queues, without a foreign key: its check is a query per row.)
ALTER TABLE outbox.subscriptions
    ADD CONSTRAINT subscriptions_queue_fkey FOREIGN KEY (queue) REFERENCES outbox.queues (name);
ALTER TABLE outbox.schedules
    ADD CONSTRAINT schedules_queue_fkey FOREIGN KEY (queue) REFERENCES outbox.queues (name);

-- The log becomes four partitions that take the new events in turn, pruned by truncating a
-- partition every reader has passed (src/prune.rs). The events of 0.1.0's table move into the
-- partition of this moment, in one statement of this transaction: none is lost, none is read
-- twice (positions are kept). Copied, not attached, so that the table is exactly a fresh
-- install's; the copy leaves the old table's dead tuples behind with it.
CREATE FUNCTION outbox._log_part() RETURNS smallint
STABLE PARALLEL SAFE LANGUAGE c AS 'MODULE_PATHNAME', 'pg_outbox_log_part';
ALTER SEQUENCE outbox.events_seq OWNED BY NONE;
ALTER TABLE outbox.events RENAME TO events_010;
ALTER TABLE outbox.events_010 RENAME CONSTRAINT events_pkey TO events_010_pkey;
ALTER TABLE outbox.events_010 RENAME CONSTRAINT events_payload_object TO events_010_payload_object;
ALTER TABLE outbox.events_010 RENAME CONSTRAINT events_headers_object TO events_010_headers_object;
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
    part      smallint               NOT NULL DEFAULT outbox._log_part(),
    CONSTRAINT events_pkey PRIMARY KEY (txid, seq, part),
    CONSTRAINT events_payload_object CHECK (pg_catalog.jsonb_typeof(payload) = 'object'),
    CONSTRAINT events_headers_object CHECK (pg_catalog.jsonb_typeof(headers) = 'object')
) PARTITION BY LIST (part);
ALTER SEQUENCE outbox.events_seq OWNED BY outbox.events.seq;
CREATE TABLE outbox.events_0 PARTITION OF outbox.events FOR VALUES IN (0);
CREATE TABLE outbox.events_1 PARTITION OF outbox.events FOR VALUES IN (1);
CREATE TABLE outbox.events_2 PARTITION OF outbox.events FOR VALUES IN (2);
CREATE TABLE outbox.events_3 PARTITION OF outbox.events FOR VALUES IN (3);
CREATE TABLE outbox.log_rotation (
    period_s bigint      NOT NULL CHECK (period_s > 0),
    since    timestamptz NOT NULL
);
INSERT INTO outbox.events (txid, seq, id, topic, subject, tenant, payload, headers, raised_at)
SELECT txid, seq, id, topic, subject, tenant, payload, headers, raised_at
  FROM outbox.events_010 ORDER BY txid, seq;
DROP TABLE outbox.events_010;
REVOKE ALL ON TABLE outbox.events, outbox.events_0, outbox.events_1, outbox.events_2, outbox.events_3,
    outbox.log_rotation FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION outbox._log_part() FROM PUBLIC;
COMMENT ON TABLE outbox.events IS
    'The event log. Read it through outbox.read() or a sink; positions order by (txid, seq).';

-- pg_dump keeps everything from now on: every table and sequence, as a fresh install marks them.
DO $$
DECLARE
    r regclass;
BEGIN
    FOR r IN SELECT c.oid FROM pg_catalog.pg_class c
              WHERE c.relnamespace = 'outbox'::pg_catalog.regnamespace AND c.relkind IN ('r', 'S')
              ORDER BY c.relname LOOP
        PERFORM pg_catalog.pg_extension_config_dump(r, '');
    END LOOP;
END
$$;

-- outbox.schedule() and outbox.schedule_status() were made again: they get back the grants they
-- had (saved at the start). Set as the ACL itself, not by GRANT: a GRANT in this script would be
-- recorded as the extension's initial privileges, which pg_dump leaves out.
UPDATE pg_catalog.pg_proc p
   SET proacl = nullif(pg_catalog.current_setting('outbox_upgrade.schedule_acl'), '')::pg_catalog.aclitem[]
 WHERE p.oid = 'outbox.schedule(text, interval, time, text, text, text, text, jsonb, timestamp, text)'::pg_catalog.regprocedure;
UPDATE pg_catalog.pg_proc p
   SET proacl = nullif(pg_catalog.current_setting('outbox_upgrade.schedule_status_acl'), '')::pg_catalog.aclitem[]
 WHERE p.oid = 'outbox.schedule_status()'::pg_catalog.regprocedure;
