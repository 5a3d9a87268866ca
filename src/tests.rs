//! In-backend tests (`cargo pgrx test`): each runs inside one transaction that is rolled back, so
//! they cover what a single transaction can see. Commit-time behaviour, concurrency and every
//! refusal's SQLSTATE are tested from clients in `tests/`.

#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    fn one<T: pgrx::FromDatum + pgrx::IntoDatum>(sql: &str) -> T {
        Spi::get_one::<T>(sql)
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .unwrap_or_else(|| panic!("{sql}: NULL"))
    }

    #[pg_test]
    fn kafka_times_and_ids_are_written_as_postgresql_writes_them() {
        // A Kafka sink's window writes ce_time and ce_id itself (a replayed dead letter's are
        // written by to_char and uuid::text): the same text for every instant and every id.
        // Random instants over the years 1 to 9999, and the edges (leap days, ends of months
        // and years, before and after 2000-01-01, whole seconds).
        let rows: Vec<(i64, String, pgrx::Uuid, String)> = Spi::connect(|c| {
            c.select(
                "WITH t(t) AS (SELECT timestamptz '0001-01-01 00:00:00+00' + random() * interval '9998 years' \
                                 FROM generate_series(1, 20000) \
                               UNION ALL SELECT unnest(ARRAY['2000-01-01 00:00:00+00', '1999-12-31 23:59:59.999999+00', \
                                 '2000-02-29 12:00:00.5+00', '1900-02-28 23:59:59+00', '1900-03-01 00:00:00+00', \
                                 '2024-02-29 23:59:59.000001+00', '2100-03-01 00:00:00+00', '1970-01-01 00:00:00+00', \
                                 '0001-01-01 00:00:00+00', '9999-12-31 23:59:59.999999+00', \
                                 '1600-02-29 06:07:08.09+00']::timestamptz[])) \
                 SELECT ((extract(epoch FROM t) - 946684800) * 1000000)::int8, \
                        to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), u, u::text \
                   FROM t, LATERAL (SELECT gen_random_uuid() AS u WHERE t IS NOT NULL) g",
                None,
                &[],
            )
            .unwrap()
            .map(|r| {
                (
                    r.get::<i64>(1).unwrap().unwrap(),
                    r.get::<String>(2).unwrap().unwrap(),
                    r.get::<pgrx::Uuid>(3).unwrap().unwrap(),
                    r.get::<String>(4).unwrap().unwrap(),
                )
            })
            .collect()
        });
        assert_eq!(rows.len(), 20011);
        for (micros, time, id, text) in rows {
            assert_eq!(crate::dispatch::kafka::utc_time(micros), time, "{micros}");
            assert_eq!(crate::dispatch::kafka::uuid_text(&id), text);
        }
    }

    #[pg_test]
    fn the_workers_lock_every_relation_of_the_extension_before_a_step() {
        // DROP EXTENSION locks each member relation in its own order; a worker step that held
        // some and then waited on another would deadlock with it. So a step takes every member
        // up front, without waiting: the list must name them all.
        let mut listed: Vec<String> = crate::dispatch::MEMBER_RELATIONS
            .iter()
            .map(|n| n.to_str().unwrap().to_owned())
            .collect();
        listed.sort();
        let members: Vec<String> = Spi::connect(|c| {
            c.select(
                "SELECT c.relname::text FROM pg_catalog.pg_depend d \
                   JOIN pg_catalog.pg_class c ON c.oid = d.objid \
                  WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.deptype = 'e' \
                    AND d.refobjid = (SELECT oid FROM pg_catalog.pg_extension WHERE extname = 'pg_outbox') \
                  ORDER BY 1",
                None,
                &[],
            )
            .unwrap()
            .map(|r| r.get::<String>(1).unwrap().unwrap())
            .collect()
        });
        assert_eq!(members, listed);
        assert!(crate::dispatch::lock_tables());
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM pg_catalog.pg_depend d JOIN pg_catalog.pg_class c ON c.oid = d.objid \
                  WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.deptype = 'e' \
                    AND d.refobjid = (SELECT oid FROM pg_catalog.pg_extension WHERE extname = 'pg_outbox') \
                    AND EXISTS (SELECT FROM pg_catalog.pg_locks l \
                                 WHERE l.pid = pg_catalog.pg_backend_pid() AND l.relation = c.oid AND l.granted \
                                   AND l.mode = CASE c.relkind WHEN 'v' THEN 'AccessShareLock' ELSE 'RowExclusiveLock' END)"
            ),
            members.len() as i64
        );
    }

    #[pg_test]
    fn events_of_a_running_transaction_are_not_readable_even_by_itself() {
        Spi::run("SELECT outbox.create_consumer('self')").unwrap();
        Spi::run("SELECT outbox.raise('order.placed', '{\"order\": 1}')").unwrap();
        assert_eq!(one::<i64>("SELECT count(*) FROM outbox.events"), 1);
        assert_eq!(one::<i64>("SELECT count(*) FROM outbox.read('self')"), 0);
        // The event carries this transaction's id: the horizon is at or below it.
        assert!(one::<bool>(
            "SELECT txid = pg_current_xact_id() AND txid >= pg_snapshot_xmin(pg_current_snapshot()) FROM outbox.events"
        ));
    }

    #[pg_test]
    fn events_in_one_transaction_take_increasing_positions() {
        // Raised in the order of i: ordered by position, i must come back in that order.
        Spi::run(
            "SELECT outbox.raise('a.b', jsonb_build_object('i', i)) FROM generate_series(1, 200) i",
        )
        .unwrap();
        Spi::run(
            "SELECT outbox.raise_many(ARRAY['a.c'], array_agg(jsonb_build_object('i', i) ORDER BY i)) \
               FROM generate_series(201, 500) i",
        )
        .unwrap();
        assert_eq!(
            one::<String>(
                "SELECT string_agg(payload->>'i', ',' ORDER BY txid, seq) FROM outbox.events"
            ),
            (1..=500)
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        assert_eq!(
            one::<i64>("SELECT count(DISTINCT txid) FROM outbox.events"),
            1
        );
    }

    #[pg_test]
    fn the_log_has_only_the_index_readers_and_pruning_need() {
        assert_eq!(
            one::<i64>("SELECT count(*) FROM pg_index WHERE indrelid = 'outbox.events'::regclass"),
            1
        );
        assert_eq!(
            one::<String>(
                "SELECT pg_get_indexdef(indexrelid) FROM pg_index WHERE indrelid = 'outbox.events'::regclass"
            ),
            "CREATE UNIQUE INDEX events_pkey ON ONLY outbox.events USING btree (txid, seq, part)"
        );
        // Each partition has that index and no other.
        assert_eq!(
            one::<String>(
                "SELECT string_agg(c.relname || ': ' || pg_get_indexdef(i.indexrelid), '; ' ORDER BY c.relname) \
                   FROM pg_inherits h JOIN pg_class c ON c.oid = h.inhrelid \
                   JOIN pg_index i ON i.indrelid = c.oid \
                  WHERE h.inhparent = 'outbox.events'::regclass"
            ),
            (0..4)
                .map(|k| format!(
                    "events_{k}: CREATE UNIQUE INDEX events_{k}_pkey ON outbox.events_{k} USING btree (txid, seq, part)"
                ))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }

    #[pg_test]
    fn public_gets_nothing_and_raise_runs_as_owner() {
        Spi::run("CREATE ROLE outbox_test_nobody").unwrap();
        for (object, check) in [
            ("outbox.events", "has_table_privilege('outbox_test_nobody', 'outbox.events', 'SELECT,INSERT,UPDATE,DELETE')"),
            ("outbox.consumers", "has_table_privilege('outbox_test_nobody', 'outbox.consumers', 'SELECT,INSERT,UPDATE,DELETE')"),
            ("outbox.events_0", "has_table_privilege('outbox_test_nobody', 'outbox.events_0', 'SELECT,INSERT,UPDATE,DELETE,TRUNCATE')"),
            ("outbox.log_rotation", "has_table_privilege('outbox_test_nobody', 'outbox.log_rotation', 'SELECT,INSERT,UPDATE,DELETE')"),
            ("schema", "has_schema_privilege('outbox_test_nobody', 'outbox', 'USAGE')"),
            ("raise", "has_function_privilege('outbox_test_nobody', 'outbox.raise(text,jsonb,text,text,jsonb)', 'EXECUTE')"),
            ("read", "has_function_privilege('outbox_test_nobody', 'outbox.read(text,integer)', 'EXECUTE')"),
        ] {
            assert!(!one::<bool>(&format!("SELECT {check}")), "PUBLIC can use {object}");
        }
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
                  WHERE n.nspname = 'outbox' AND p.proname IN ('raise', 'raise_many', 'read') AND p.prosecdef"
            ),
            3
        );
        // Every SQL-language and plpgsql function pins its search_path, but for the job queue's
        // hot path and the read rule with the workers' window over it (inlined into the
        // statements that call them), which qualify every name instead (see jobs.sql and
        // schema.sql; tested against a hostile search_path in tests/tests/jobs.rs and
        // tests/tests/consumers.rs). A new exception must be added here on purpose.
        assert_eq!(
            one::<String>(
                "SELECT coalesce(string_agg(p.proname, ',' ORDER BY p.proname), '') \
                   FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
                   JOIN pg_language l ON l.oid = p.prolang \
                  WHERE n.nspname = 'outbox' AND l.lanname IN ('sql', 'plpgsql') \
                    AND NOT coalesce('search_path=pg_catalog, pg_temp' = ANY (p.proconfig), false)"
            ),
            "_batch_after,_batch_window,_claim,_complete_many,_may,_my_xid,_range_after,_range_log,_range_window,_read_after,_read_log,_read_window,_snapshot_log,_tick_log"
        );
    }

    #[pg_test]
    fn a_batch_is_read_as_one_range_once_past_the_transactions_it_started_with_running() {
        // 15 ran when the batch started and has ended: a reader before it reads both parts.
        let range = |after: &str| {
            one::<String>(&format!(
                "SELECT coalesce((SELECT row(r.*)::text FROM outbox._batch_range('10:20:12,15', '12:25:12,22', {after}) r), 'both')"
            ))
        };
        assert_eq!(range("'14', 3"), "both");
        assert_eq!(range("'15', 1"), "both");
        // Past it: the range from the batch's first new transaction (20) below 25, leaving out 22
        // (still running; 12 is below the range).
        assert_eq!(range("'16', 0"), "(20,0,25,\"12:25:12,22\")");
        assert_eq!(range("'23', 4"), "(23,4,25,)");
        assert_eq!(range("'21', 2"), "(21,2,25,\"12:25:12,22\")");
    }

    #[pg_test]
    fn the_event_type_is_what_readers_receive() {
        assert_eq!(
            one::<String>(
                "SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum) \
                   FROM pg_attribute WHERE attrelid = (SELECT typrelid FROM pg_type WHERE oid = 'outbox.event'::regtype) AND attnum > 0"
            ),
            "id uuid, position text, topic text, subject text, tenant text, payload jsonb, headers jsonb, raised_at timestamp with time zone"
        );
    }
}
