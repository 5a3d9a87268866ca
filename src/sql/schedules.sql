-- Schedules: a named schedule raises an event or queues a job, either every fixed interval, at a
-- wall-clock time in a time zone (daily, or weekly on one day), or once at a local date and time
-- in a zone. An each schedule runs a query as its owner at each run and queues one job per row it
-- returns (src/schedule.rs runs the query; see _ran_each). The workers call
-- outbox._fire_schedules(); the public outbox.schedule() and outbox.unschedule() check the caller,
-- then call outbox._schedule() and outbox._unschedule() here as the extension owner.
--
-- The time rules, in one place:
-- * every: a fixed length in seconds; a day is 86400 s whatever the clocks do, so a
--   '1 day' schedule drifts by an hour against the wall clock across a DST change (use
--   daily_at for wall-clock times). Months have no fixed length and are refused. Runs keep to
--   the grid first_run + k * every: a worker that was down fires the missed run once, then the
--   next slot of the grid.
-- * daily_at + zone (+ weekly_on): the zone's local clock, as the tz database has it. A local time
--   a spring-forward skips runs at the instant the gap ends (02:30 in New York on the
--   spring-forward day runs at 03:00 EDT). A local time a fall-back repeats runs once: at its
--   first occurrence (01:30 EDT, not 01:30 EST), and never again that day. Missed runs fire
--   once, late, then the next regular time.
-- * at + zone: one run, at the instant the zone's rules give that local date and time (the same
--   rules as daily_at), then the schedule is gone. The instant is placed again by each worker
--   that starts, so a tz database update that moves the zone's clocks (a country leaving
--   daylight saving time) moves the run with them once the workers restart on the new rules.
-- * Nothing depends on the session's TimeZone: the workers run with the server's, tests and
--   users with their own. Local times are only computed with AT TIME ZONE and an explicit zone,
--   and instants only move by intervals with no days part (timestamptz + '1 day' adds a
--   calendar day in the session's zone).

CREATE TABLE outbox.schedules (
    name       text        NOT NULL PRIMARY KEY,
    -- The fixed-interval form ...
    every      interval,
    -- ... or the wall-clock form: daily_at in zone, on every day or only on weekly_on
    -- (0 = Sunday .. 6 = Saturday, as extract(dow)).
    daily_at   time,
    zone       text,
    weekly_on  smallint,
    -- What a run writes: an event with this topic, or a job in this queue.
    topic      text,
    queue      text        REFERENCES outbox.queues (name),
    payload    jsonb       NOT NULL DEFAULT '{}',
    -- The role that created the schedule; only its members (or a superuser) may drop it.
    owner      regrole     NOT NULL,
    next_run   timestamptz NOT NULL,
    last_run   timestamptz,
    fired      bigint      NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- (0.2.0) The one-off form, instead of every or daily_at: once, at this local date and time
    -- in zone.
    at_local   timestamp,
    -- (0.2.0) An each schedule: this query, run as the owner at each run, gives one job per row
    -- (the row is the payload; payload is not used).
    each       text,
    -- (0.2.0) Why the last run wrote nothing (its owner lost a right, an each query failed); NULL
    -- after a run that went through.
    last_error text,
    -- (0.2.0) Runs of an each schedule that failed in a row: each waits longer (_ran_each).
    failed_runs integer NOT NULL DEFAULT 0,
    -- _schedule() checks all of these with a clear message; the constraints keep the table sound
    -- against any other writer (a superuser's INSERT, a restore), since a row the firing
    -- statement cannot handle would stop every schedule from firing.
    -- The same rule as queue, consumer and sink names (pg_outbox_core::name).
    CONSTRAINT schedules_name CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'),
    CONSTRAINT schedules_one_form CHECK (
        (every IS NOT NULL AND daily_at IS NULL AND zone IS NULL AND weekly_on IS NULL AND at_local IS NULL)
        OR (every IS NULL AND daily_at IS NOT NULL AND zone IS NOT NULL AND at_local IS NULL)
        OR (every IS NULL AND daily_at IS NULL AND weekly_on IS NULL AND at_local IS NOT NULL AND zone IS NOT NULL)),
    CONSTRAINT schedules_every_fixed CHECK (
        EXTRACT(YEAR FROM every) = 0 AND EXTRACT(MONTH FROM every) = 0
        AND EXTRACT(EPOCH FROM every) BETWEEN 1 AND 3650 * 86400),
    CONSTRAINT schedules_daily_at CHECK (daily_at < '24:00'),
    CONSTRAINT schedules_weekly_on CHECK (weekly_on BETWEEN 0 AND 6),
    CONSTRAINT schedules_one_target CHECK ((topic IS NULL) <> (queue IS NULL)),
    CONSTRAINT schedules_payload_object CHECK (pg_catalog.jsonb_typeof(payload) = 'object'),
    CONSTRAINT schedules_each_queues CHECK (each IS NULL OR queue IS NOT NULL)
);
-- The firing statement and _schedule_due_in() look for the earliest next_run.
CREATE INDEX schedules_next_run ON outbox.schedules (next_run);

COMMENT ON TABLE outbox.schedules IS
    'Schedules: every fixed interval, daily/weekly at a local time in a zone, or once at a local time; each run raises an event or queues a job (or one job per row of an each query).';

-- The first instant whose local time in zone is at or after wall: the instant of wall itself
-- when that local time exists (the first of the two when a clock change repeats it), the end of
-- the gap when a clock change skips it.
--
-- How PostgreSQL reads a local time at a clock change (Appendix B.2 of its manual, and checked:
-- see the tests): a skipped time (spring forward) with the offset in force before the change, so
-- '2026-03-08 02:30' in America/New_York becomes 07:30 UTC, shown as 03:30 EDT: as far past the
-- gap's end as 02:30 is past its start. A repeated time (fall back) with the offset after the
-- change: '2026-11-01 01:30' becomes 06:30 UTC, 01:30 EST, the later of the two; the run belongs
-- at the first, 05:30 UTC (01:30 EDT), earlier by the change: the offset three hours before minus
-- the offset at PostgreSQL's instant (no zone changes its offset twice in three hours). For
-- the skipped one we look for the gap's
-- end, the instant the clocks jumped: PostgreSQL's instant is on one side of it and that instant
-- moved back by the gap's length on the other, and local time only rises in between, so a binary
-- search to the microsecond finds it (32 steps for an hour's gap, and only on a gap day).
CREATE FUNCTION outbox._zoned_instant(wall timestamp, zone text) RETURNS timestamptz
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

-- The first run strictly after `after`; previous is the run being fired (NULL for a new
-- schedule).
--
-- every: runs are previous + k * every with k >= 1 the smallest giving a time after `after`:
-- however many slots were missed, one firing, then back on the grid. A new schedule first runs
-- at after + every.
--
-- daily_at/zone/weekly_on: the first local date d in zone, on or after the local date of
-- `after` and after the day previous ran for, that is weekly_on (if set) and whose run is after
-- `after`. The day previous ran for is its local date, or the day before when its local time is
-- earlier than daily_at: a gap that ends past midnight moved it to the next date (Pacific/Apia
-- skipped 2011-12-30; a run that day happened at 2011-12-31 00:00), and that next date still has
-- its own run. A repeated local time runs once, at its first occurrence (_zoned_instant); never
-- firing twice for one date keeps it once even if the instant computed for a date ever changes
-- (a tz database update).
CREATE FUNCTION outbox._next_run(every interval, daily_at time, zone text, weekly_on smallint,
                                 after timestamptz, previous timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    step_us   bigint;
    k         bigint;
    prev_wall timestamp;
    day       date;
    run       timestamptz;
BEGIN
    IF after IS NULL THEN
        RAISE EXCEPTION 'after must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF (every IS NULL) = (daily_at IS NULL OR zone IS NULL) THEN
        RAISE EXCEPTION 'a schedule has every, or daily_at and zone' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF every IS NOT NULL THEN
        -- extract(epoch) counts a day as 86400 s and is exact (numeric) to the microsecond;
        -- whole microseconds keep the arithmetic exact (see _zoned_instant).
        step_us := (extract(epoch FROM every) * 1000000)::bigint;
        IF step_us <= 0 OR extract(year FROM every) <> 0 OR extract(month FROM every) <> 0 THEN
            RAISE EXCEPTION 'every must be a positive fixed length, not %', every
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF previous IS NULL THEN
            RETURN after + step_us::float8 * interval '1 microsecond';
        END IF;
        k := greatest(floor((extract(epoch FROM after) - extract(epoch FROM previous)) * 1000000 / step_us) + 1, 1);
        RETURN previous + (k * step_us)::float8 * interval '1 microsecond';
    END IF;

    day := (after AT TIME ZONE zone)::date;
    IF previous IS NOT NULL THEN
        prev_wall := previous AT TIME ZONE zone;
        day := greatest(day, prev_wall::date - CASE WHEN prev_wall::time < daily_at THEN 1 ELSE 0 END + 1);
    END IF;
    -- A week and two days always holds a run: the first date's run may be at or before `after`,
    -- and a fall-back across midnight can make the next date's too.
    FOR i IN 1..16 LOOP
        IF weekly_on IS NULL OR extract(dow FROM day) = weekly_on THEN
            run := outbox._zoned_instant(day + daily_at, zone);
            IF run > after THEN
                RETURN run;
            END IF;
        END IF;
        day := day + 1;
    END LOOP;
    RAISE EXCEPTION 'no run of daily_at % in % (weekly_on %) after %', daily_at, zone, weekly_on, after
        USING ERRCODE = 'internal_error';
END
$$;

-- Creates a schedule after checking every argument; returns its first run. Topics, and an each
-- query, are checked by the caller, outbox.schedule(), with raise()'s own rules and the caller's
-- rights.
CREATE FUNCTION outbox._schedule(name text, every interval, daily_at time, zone text, weekly_on text,
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

-- Drops a schedule; false when there was none. A run being fired concurrently holds the row:
-- the DELETE waits for it, and the run counts.
CREATE FUNCTION outbox._unschedule(name text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'schedule name must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    DELETE FROM outbox.schedules s WHERE s.name = _unschedule.name;
    RETURN FOUND;
END
$$;

-- Whether a run of a schedule may write, as its owner: EXECUTE on raise(), or on enqueue() with
-- the enqueue privilege on the queue.
CREATE FUNCTION outbox._schedule_allowed(owner oid, topic text, queue text) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN topic IS NOT NULL
                THEN has_function_privilege(owner, 'outbox.raise(text, jsonb, text, text, jsonb)', 'EXECUTE')
                ELSE has_function_privilege(owner, 'outbox.enqueue(text, jsonb, timestamptz, text, integer)', 'EXECUTE')
                     AND outbox._may(queue, owner, 'enqueue')
           END
$$;

-- Why a run that may not write was skipped.
CREATE FUNCTION outbox._schedule_denied(owner oid, topic text, queue text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT format('its owner %s may no longer write to %s', owner::regrole,
                  coalesce('topic ' || topic, 'queue ' || queue))
$$;

-- Fires every due schedule; returns how many fired. One statement moves each due schedule to its
-- next run and writes its event or job, so a run and its write commit or roll back together.
--
-- Concurrency (the workers call this at once, READ COMMITTED): `due` locks the due rows FOR
-- UPDATE SKIP LOCKED. A row another worker is firing is skipped, not waited for: no worker
-- stalls behind another's transaction and no two can deadlock. A row another worker fired and
-- committed after this statement's snapshot is locked in its new version and `next_run <= now()`
-- is checked again on it (READ COMMITTED re-check): no longer due, it drops out; due again (its
-- new run already passed by this transaction's now()), it fires that new run, a different one.
-- `due` returns the values of the version it locked, and nobody can change a locked row, so
-- due.next_run is exactly the run being fired: the old next_run that RETURNING cannot give. (A
-- plain self-join would not do: on the re-check it keeps the joined copy from the snapshot, and
-- a stale next_run would fire the other worker's run a second time.)
--
-- scheduled_for is the run's instant in UTC ISO 8601 ('2026-03-08T07:00:00.000000Z'), so the
-- headers and job keys do not depend on the session TimeZone. A job's key, name@scheduled_for,
-- is one run: a run queued twice would be one job.
--
-- A run writes only what its owner may still write: EXECUTE on raise() (or enqueue(), and the
-- enqueue privilege on the queue). A run whose owner lost that right is skipped (the schedule
-- moves on to its next run), last_error and a WARNING in the server log say which and why.
--
-- A one-off schedule (at) is deleted by its run. Each schedules are left to src/schedule.rs,
-- which runs their query as the owner and then calls _ran_each().
CREATE FUNCTION outbox._fire_schedules() RETURNS integer
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

-- Records the run `run` of each schedule `name`, whose query `each` src/schedule.rs ran as the
-- owner (holding the schedule's advisory lock, with no row lock and no transaction id while the
-- tenant's query ran): rows are the payloads, a job each, keyed by the row's md5 in the
-- schedule's own namespace (index jobs_waiting_run; the run keys of other schedules have an
-- '@'), so a row whose job still waits gets no second one. error (rows NULL) is why the run
-- wrote nothing. The schedule moves on to its next run (a one-off is deleted); runs that fail in
-- a row wait longer and longer (1 s doubling, up to an hour, and never less than the next regular
-- run), and a one-off gives up after 10. Nothing is written when the schedule changed or went
-- while the query ran (returns NULL), nor while another transaction holds its row (returns -1:
-- a tenant changing or dropping it, whose transaction may stay open as long as it likes; the
-- worker tries again later rather than wait). Returns the jobs queued.
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

-- Places every one-off run again by its zone's rules as this process has them: a worker that
-- starts after a tz database update moves the runs the update moved. Returns how many moved.
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

-- outbox.schedule_status() (src/schedule.rs) for the role `who`: one row per schedule. An each
-- schedule's query and a run's error (which may quote its rows) are shown only to the roles that
-- act for the schedule's owner and to members of pg_read_all_stats, as status() does.
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
