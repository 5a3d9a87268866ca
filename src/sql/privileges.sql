-- Nothing in schema outbox is usable by PUBLIC. An application role needs USAGE on the schema and
-- EXECUTE on the functions it calls; it never needs a grant on a table: the functions that touch
-- the tables check their arguments and the caller, then act as the schema's owner.
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON SCHEMA outbox FROM PUBLIC;

-- pg_dump keeps everything: every table and sequence of the extension is dumped with its data
-- (a dump without them restores an empty outbox). Positions survive a restore into another
-- cluster through outbox.lineage (src/lineage.rs); roles are named (regrole), not numbered.
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

-- Delivery starts in this database as soon as the transaction that installs pg_outbox commits:
-- the launcher is told (src/worker/launcher.rs).
SELECT outbox._start_delivery();
