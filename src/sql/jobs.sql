-- Jobs: units of work with their own retries. Queued by outbox.enqueue() and by subscriptions
-- (fan-out, see subscriptions.sql). Jobs without a handler wait for external workers in any
-- language, who claim them with outbox.claim() (FOR UPDATE SKIP LOCKED), then complete or fail
-- them; jobs with a handler are run by the background worker. Finished jobs are deleted: the
-- table stays small.
CREATE TABLE outbox.jobs (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
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
    handler      regprocedure
)
-- A queue churns: every finished job is a dead row. Vacuum after a fixed number of them rather
-- than a fraction of a table that is small by design, so the space is reused and it stays small.
WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
      autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 10000);
-- The claim path: per queue, in run_at order, dead jobs left out.
CREATE INDEX jobs_claim ON outbox.jobs (queue, run_at, id) WHERE state <> 'dead';
-- A key is queued once while it waits.
-- The worker's path: due jobs of a subscription with a handler, in run_at order.
CREATE INDEX jobs_worker ON outbox.jobs (subscription, run_at, id) WHERE handler IS NOT NULL AND state = 'waiting';
CREATE UNIQUE INDEX jobs_waiting_key ON outbox.jobs (queue, key) WHERE key IS NOT NULL AND state = 'waiting';

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

CREATE FUNCTION outbox.enqueue(queue text, payload jsonb DEFAULT '{}', run_at timestamptz DEFAULT NULL,
                               key text DEFAULT NULL, max_attempts integer DEFAULT 10)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
    INSERT INTO outbox.jobs AS j (queue, payload, key, run_at, max_attempts)
    VALUES (queue, coalesce(payload, '{}'), key, coalesce(run_at, now()), max_attempts)
    ON CONFLICT (queue, key) WHERE key IS NOT NULL AND state = 'waiting' DO NOTHING
    RETURNING j.id INTO job;
    IF job IS NULL THEN
        -- The key is already waiting: that job stands for this one.
        SELECT j.id INTO job FROM outbox.jobs j WHERE j.queue = enqueue.queue AND j.key = enqueue.key AND j.state = 'waiting';
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

-- Claims up to max_jobs due jobs of a queue, in run_at order, skipping jobs others hold.
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
-- search_path (the save and restore cost 5-10% of a claim) and, in return, qualify every name
-- they use: tables, functions, types and operators (OPERATOR(pg_catalog.=)). A caller's
-- search_path can then change nothing they do. Keep it so when editing them.
CREATE FUNCTION outbox.claim(queue text, max_jobs integer DEFAULT 1, lease interval DEFAULT '30 seconds')
RETURNS SETOF outbox.job
LANGUAGE plpgsql VOLATILE SECURITY DEFINER AS $$
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
    IF lease IS NULL THEN
        RETURN QUERY
        SELECT j.id, j.queue, j.payload, j.key, j.attempts OPERATOR(pg_catalog.+) 1, j.max_attempts,
               NULL::pg_catalog.timestamptz, j.created_at, j.event, j.subscription
          FROM outbox.jobs j
         WHERE j.queue OPERATOR(pg_catalog.=) claim.queue AND j.state OPERATOR(pg_catalog.=) 'waiting'
           AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.now() AND j.handler IS NULL
         ORDER BY j.run_at, j.id
         LIMIT max_jobs
           FOR UPDATE SKIP LOCKED;
        RETURN;
    END IF;
    IF lease OPERATOR(pg_catalog.<=) '0' OR lease OPERATOR(pg_catalog.>) '1 day' THEN
        RAISE EXCEPTION 'lease must be positive and at most a day (or NULL: held by this transaction)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Waiting jobs that are due, and running jobs whose lease lapsed (their worker died).
    RETURN QUERY
    WITH c AS (
        SELECT j.id FROM outbox.jobs j
         WHERE j.queue OPERATOR(pg_catalog.=) claim.queue AND j.state OPERATOR(pg_catalog.<>) 'dead'
           AND j.run_at OPERATOR(pg_catalog.<=) pg_catalog.now()
           AND (j.state OPERATOR(pg_catalog.=) 'waiting' OR j.lease_until OPERATOR(pg_catalog.<) pg_catalog.now())
           AND j.handler IS NULL
         ORDER BY j.run_at, j.id
         LIMIT max_jobs
           FOR UPDATE SKIP LOCKED)
    UPDATE outbox.jobs j SET state = 'running', lease_until = pg_catalog.now() OPERATOR(pg_catalog.+) lease,
           attempts = j.attempts OPERATOR(pg_catalog.+) 1
      FROM c WHERE j.id OPERATOR(pg_catalog.=) c.id
    RETURNING j.id, j.queue, j.payload, j.key, j.attempts, j.max_attempts, j.lease_until, j.created_at,
              j.event, j.subscription;
END
$$;

CREATE FUNCTION outbox.complete(job bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER AS $$
BEGIN
    IF job IS NULL THEN
        RAISE EXCEPTION 'job must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- Running under a lease, or held by this transaction (claimed with lease => NULL: the row's
    -- xmax is our lock). A job another transaction holds does not match: no waiting for it.
    DELETE FROM outbox.jobs j
     WHERE j.id OPERATOR(pg_catalog.=) job
       AND (j.state OPERATOR(pg_catalog.=) 'running'
            OR (j.state OPERATOR(pg_catalog.=) 'waiting' AND j.xmax OPERATOR(pg_catalog.=) outbox._my_xid()));
    RETURN FOUND;
END
$$;

-- complete() for a batch: one statement for all of them. Returns how many were completed (jobs
-- not running under a lease nor held by this transaction are left alone, as complete() does).
CREATE FUNCTION outbox.complete_many(jobs bigint[]) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER AS $$
DECLARE
    n integer;
BEGIN
    IF jobs IS NULL THEN
        RAISE EXCEPTION 'jobs must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    DELETE FROM outbox.jobs j
     WHERE j.id OPERATOR(pg_catalog.=) ANY (jobs)
       AND (j.state OPERATOR(pg_catalog.=) 'running'
            OR (j.state OPERATOR(pg_catalog.=) 'waiting' AND j.xmax OPERATOR(pg_catalog.=) outbox._my_xid()));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

CREATE FUNCTION outbox.fail(job bigint, error text DEFAULT NULL, retry boolean DEFAULT true) RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    j outbox.jobs;
BEGIN
    IF job IS NULL OR retry IS NULL THEN
        RAISE EXCEPTION 'job and retry must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
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
    UPDATE outbox.jobs SET state = 'dead', lease_until = NULL, last_error = error WHERE id = job;
    RETURN 'dead';
END
$$;

CREATE FUNCTION outbox.extend(job bigint, lease interval DEFAULT '30 seconds') RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF job IS NULL OR lease IS NULL THEN
        RAISE EXCEPTION 'job and lease must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF lease <= '0' OR lease > '1 day' THEN
        RAISE EXCEPTION 'lease must be positive and at most a day' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE outbox.jobs SET lease_until = now() + lease WHERE id = job AND state = 'running';
    RETURN FOUND;
END
$$;

CREATE FUNCTION outbox.replay_job(job bigint) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF job IS NULL THEN
        RAISE EXCEPTION 'job must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE outbox.jobs SET state = 'waiting', attempts = 0, run_at = now(), lease_until = NULL
     WHERE id = job AND state = 'dead';
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM outbox.jobs WHERE id = job) THEN
            RAISE EXCEPTION 'job % is not dead', job USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        RAISE EXCEPTION 'job % does not exist', job USING ERRCODE = 'undefined_object';
    END IF;
    RAISE LOG 'pg_outbox: job % replayed by role %', job, current_user;
END
$$;

CREATE VIEW outbox.dead_jobs AS
    SELECT id, queue, payload, key, attempts, max_attempts, last_error, created_at, event, subscription
      FROM outbox.jobs WHERE state = 'dead';
