-- A window of the log for the workers: the read rule's next events after a cursor, at most
-- max_events, numbered n from 1, and cut before their payloads and headers pass max_bytes
-- uncompressed (outbox._event_size reads that from each value's header, without decompressing
-- it); never empty while an event is readable. Bounds what a pass holds whatever events hold.
CREATE FUNCTION outbox._read_window(after_txid pg_catalog.xid8, after_seq bigint, max_events integer,
                                    max_bytes bigint)
RETURNS TABLE (id uuid, "position" text, topic text, subject text, tenant text, payload jsonb,
               headers jsonb, raised_at timestamptz, n bigint)
LANGUAGE sql STABLE STRICT SET search_path = pg_catalog, pg_temp AS $$
    SELECT w.id, w.position, w.topic, w.subject, w.tenant, w.payload, w.headers, w.raised_at, w.n
      FROM (SELECT r.*, sum(outbox._event_size(r.payload, r.headers)) OVER (ORDER BY r.n) AS upto
              FROM outbox._read_after(after_txid, after_seq, max_events) WITH ORDINALITY
                   AS r(id, position, topic, subject, tenant, payload, headers, raised_at, n)) w
     WHERE w.n = 1 OR w.upto <= max_bytes
     ORDER BY w.n
$$;
