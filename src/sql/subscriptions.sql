-- Subscriptions: one job per matching event. A subscription is a consumer (kind 'subscription')
-- whose cursor the worker moves: per pass it reads a window past the cursor with the read rule,
-- evaluates the CEL filter on each event of its topics, writes one job per match and advances the
-- cursor, in one transaction. A false filter still advances it.
CREATE TABLE outbox.subscriptions (
    name                   text        NOT NULL PRIMARY KEY
                                       REFERENCES outbox.consumers (name) ON DELETE CASCADE,
    topics                 text[],                 -- patterns; NULL: every topic
    topic_regex            text,                   -- the patterns compiled; NULL: every topic
    filter                 text,                   -- CEL; NULL: every event of the topics
    -- Exactly one way to run the jobs: a SQL handler f(outbox.event), run by the worker as the
    -- subscription's owner (its jobs queue under the subscription's name), or a queue that
    -- external workers claim from.
    handler                regprocedure,
    queue                  text        NOT NULL REFERENCES outbox.queues (name),
    max_attempts           integer     NOT NULL CHECK (max_attempts BETWEEN 1 AND 1000),
    paused                 boolean     NOT NULL DEFAULT false,
    matched                bigint      NOT NULL DEFAULT 0,
    skipped                bigint      NOT NULL DEFAULT 0,
    -- A filter that fails on an event (a missing field, a type mismatch) counts as false there;
    -- the error is counted and the last one kept here, for outbox.status().
    predicate_errors       bigint      NOT NULL DEFAULT 0,
    last_predicate_error   text,
    last_predicate_error_at timestamptz,
    last_fanout_at         timestamptz,
    created_at             timestamptz NOT NULL DEFAULT pg_catalog.now(),
    -- Key of the subscription's lease (see src/lease.rs).
    lease_key              integer     GENERATED ALWAYS AS IDENTITY,
    CONSTRAINT subscriptions_handler_queue CHECK (handler IS NULL OR queue = name)
);
