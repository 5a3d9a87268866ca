-- Nothing in schema outbox is usable by PUBLIC. An application role needs USAGE on the schema and
-- EXECUTE on the functions it calls; it never needs a grant on a table: the functions that touch
-- the tables check their arguments and the caller, then act as the schema's owner.
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON SCHEMA outbox FROM PUBLIC;

-- Delivery starts in this database as soon as the transaction that installs pg_outbox commits:
-- the launcher is told (src/worker/launcher.rs).
SELECT outbox._start_delivery();
