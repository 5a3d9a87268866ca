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
