-- Jobs: units of work with their own retries. Queued by outbox.enqueue() and by subscriptions
-- (fan-out, see subscriptions.sql). Jobs without a handler wait for external workers in any
-- language, who claim them with outbox.claim() (FOR UPDATE SKIP LOCKED), then complete or fail
-- them; jobs with a handler are run by the background worker. Finished jobs are deleted: the
-- table stays small.
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

CREATE TABLE outbox.jobs (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- A job's queue exists while it does: every path that queues jobs holds their queues
    -- (outbox._hold_queues), and drop_queue deletes a queue's jobs with it. No foreign key: its
    -- check is a query per inserted row, an eighth of a fan-out pass.
    queue        text        NOT NULL,
    payload      jsonb       NOT NULL DEFAULT '{}' CHECK (pg_catalog.jsonb_typeof(payload) = 'object'),
    key          text,
    run_at       timestamptz NOT NULL DEFAULT pg_catalog.now(),
    attempts     integer     NOT NULL DEFAULT 0,
    max_attempts integer     NOT NULL DEFAULT 10 CHECK (max_attempts BETWEEN 1 AND 1000),
    -- 'waiting' to be claimed (from run_at), 'running' under a lease, 'dead' out of attempts or
    -- failed for good: kept, never claimed, until outbox.replay_job().
    state        text        NOT NULL DEFAULT 'waiting' CHECK (state IN ('waiting', 'running', 'dead')),
    lease_until  timestamptz,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- Fan-out: the event the job carries (its payload is the event as JSON) and the subscription
    -- that matched it. NULL for outbox.enqueue().
    event        uuid,
    subscription text,
    -- Set for a subscription with a SQL handler: the worker runs the job, as the subscription's
    -- owner; outbox.claim() never hands it out.
    handler      regprocedure,
    -- The schedule whose run queued the job (its key is <schedule>@<instant>). NULL otherwise.
    schedule     text,
    -- When it died (NULL while it lives; a job that died before 0.2.0 recorded it has none).
    dead_at      timestamptz
)
-- A queue churns: every finished job is a dead row. Vacuum after a fixed number of them rather
-- than a fraction of a table that is small by design, so the space is reused and it stays small.
WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
      autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 10000);
-- The claim path: the waiting jobs of a queue, in run_at order. Only waiting ones: a claim with a
-- lease writes the job's running version, and with it here every claim stepped over the jobs
-- other workers were running (a third of a claim's time, never removed by vacuum while they ran).
CREATE INDEX jobs_claim ON outbox.jobs (queue, run_at, id) WHERE state = 'waiting';
-- The jobs of a queue running under a lease, by when it lapses: claim() takes lapsed ones first.
CREATE INDEX jobs_leased ON outbox.jobs (queue, lease_until, id) WHERE state = 'running';
-- The worker's path: due jobs of a subscription with a handler, in run_at order.
CREATE INDEX jobs_worker ON outbox.jobs (subscription, run_at, id) WHERE handler IS NOT NULL AND state = 'waiting';
-- Three namespaces, so that none can hide a job of another: a key given to enqueue() is queued
-- once per queue while it waits; a subscription queues an event once per queue while its job
-- waits; a schedule queues a run once while its job waits.
CREATE UNIQUE INDEX jobs_waiting_key ON outbox.jobs (queue, key)
    WHERE key IS NOT NULL AND state = 'waiting' AND subscription IS NULL AND schedule IS NULL;
CREATE UNIQUE INDEX jobs_waiting_run ON outbox.jobs (queue, schedule, key)
    WHERE schedule IS NOT NULL AND state = 'waiting';
CREATE UNIQUE INDEX jobs_waiting_event ON outbox.jobs (queue, subscription, event)
    WHERE subscription IS NOT NULL AND state = 'waiting';

CREATE TYPE outbox.job AS (
    id bigint, queue text, payload jsonb, key text, attempts integer, max_attempts integer,
    lease_until timestamptz, created_at timestamptz, event uuid, subscription text
);

CREATE FUNCTION outbox._check_queue(queue text) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF queue IS NULL THEN
        RAISE EXCEPTION 'queue must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- The same rule as consumer and sink names (pg_outbox_core::name).
    IF queue !~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$' THEN
        RAISE EXCEPTION 'invalid queue name "%"', queue USING ERRCODE = 'invalid_name',
            HINT = 'a queue name is 1 to 63 letters, digits, ''_'', ''-'' or ''.'', starting with a letter or digit';
    END IF;
END
$$;

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

-- The transaction id of the caller, as a row's xmax shows it (the 32 low bits), when it has one.
-- No SET clause, so that it is inlined (complete() runs it per job); every name in it is
-- qualified instead.
CREATE FUNCTION outbox._my_xid() RETURNS xid
LANGUAGE sql STABLE AS $$
    SELECT (pg_catalog.pg_current_xact_id_if_assigned()::pg_catalog.text::pg_catalog.numeric
            OPERATOR(pg_catalog.%) 4294967296)::pg_catalog.text::pg_catalog.xid
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

CREATE VIEW outbox.dead_jobs AS
    SELECT id, queue, payload, key, attempts, max_attempts, last_error, created_at, event, subscription,
           dead_at
      FROM outbox.jobs WHERE state = 'dead';
