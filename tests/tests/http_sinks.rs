//! HTTP sinks against a real receiver on loopback: CloudEvents batches in order, signed so that
//! the Standard Webhooks reference library accepts them; the failure policy for every kind of
//! failure (an event answered 4xx, 5xx or a timeout is dead-lettered after the neighbour test; an
//! outage dead-letters nothing; Retry-After is honoured); destinations refused; secrets kept out
//! of sight.

use pg_outbox_tests::http_server::{Received, Receiver};
use pg_outbox_tests::{eventually, sqlstate, worker_db, TestDb};
use std::time::Duration;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const TOKEN: &str = "Bearer very-secret-token-42";

/// A test database whose cluster lets HTTP sinks reach the loopback receiver; the settings go
/// back to their defaults when it is dropped, even when the test fails.
struct Loopback(TestDb);

impl Drop for Loopback {
    fn drop(&mut self) {
        self.0.cluster().set("pg_outbox.http_allow_plain", "off");
        self.0.cluster().set("pg_outbox.http_allow_private", "off");
    }
}

impl std::ops::Deref for Loopback {
    type Target = TestDb;
    fn deref(&self) -> &TestDb {
        &self.0
    }
}

fn setup(label: &str) -> (Loopback, postgres::Client) {
    let db = worker_db(label);
    db.cluster().set("pg_outbox.http_allow_plain", "on");
    db.cluster().set("pg_outbox.http_allow_private", "on");
    let c = db.connect();
    (Loopback(db), c)
}

/// The events of the requests answered 2xx, in the order they arrived.
fn delivered(r: &Receiver) -> Vec<serde_json::Value> {
    r.received()
        .into_iter()
        .filter(|q| (200..300).contains(&q.status))
        .flat_map(|q| serde_json::from_slice::<Vec<serde_json::Value>>(&q.body).unwrap())
        .collect()
}

fn wait_delivered(r: &Receiver, n: usize) -> Vec<serde_json::Value> {
    eventually(
        &format!("{n} events at the receiver"),
        Duration::from_secs(60),
        || {
            let d = delivered(r);
            (d.len() >= n).then_some(d)
        },
    )
}

fn positions(events: &[serde_json::Value]) -> Vec<(u64, i64)> {
    events
        .iter()
        .map(|e| pg_outbox_tests::position(e["position"].as_str().unwrap()))
        .collect()
}

/// Dead letters of every sink of the test's database.
fn dead_letters(c: &mut postgres::Client) -> i64 {
    c.query_one("SELECT count(*) FROM outbox.dead_letters", &[])
        .unwrap()
        .get(0)
}

/// Whether a request's body holds an event whose payload has `"<flag>": true`.
fn flagged(q: &Received, flag: &str) -> bool {
    let body = String::from_utf8_lossy(&q.body);
    body.contains(&format!("\"{flag}\": true")) || body.contains(&format!("\"{flag}\":true"))
}

/// Creates HTTP sink `hook` posting to `rx` (`extra`: more arguments of create_http_sink).
fn hook(c: &mut postgres::Client, rx: &Receiver, extra: &str) {
    c.execute(
        &format!("SELECT outbox.create_http_sink('hook', $1{extra})"),
        &[&rx.url("/in")],
    )
    .unwrap();
}

/// The dead letter of sink `hook`: its event's `i` and the error.
fn the_dead_letter(c: &mut postgres::Client) -> (String, String) {
    eventually("the dead letter", Duration::from_secs(60), || {
        c.query_opt(
            "SELECT (event).payload->>'i', error FROM outbox.dead_letters WHERE sink = 'hook'",
            &[],
        )
        .unwrap()
        .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
    })
}

fn verify(q: &Received) {
    let mut headers = http::HeaderMap::new();
    for (k, v) in &q.headers {
        if let (Ok(name), Ok(value)) = (http::HeaderName::from_bytes(k.as_bytes()), v.parse()) {
            headers.insert(name, value);
        }
    }
    standardwebhooks::Webhook::new(SECRET)
        .unwrap()
        .verify(&q.body, &headers)
        .expect("signature verifies");
}

#[test]
fn events_arrive_in_order_batched_and_signed() {
    let (_db, mut c) = setup("http_order");
    let rx = Receiver::start(|_, _| (200, vec![]));
    c.execute(
        "SELECT outbox.create_http_sink('hook', $1, batch_size => 50, secret => $2, headers => jsonb_build_object('Authorization', $3::text))",
        &[&rx.url("/in"), &SECRET, &TOKEN],
    )
    .unwrap();
    c.batch_execute(
        "SELECT outbox.raise('order.placed', jsonb_build_object('i', i), subject => 'order/' || i, tenant => 'acme')
           FROM generate_series(1, 120) i",
    )
    .unwrap();
    let events = wait_delivered(&rx, 120);
    assert_eq!(events.len(), 120, "each event once");
    let p = positions(&events);
    assert!(p.windows(2).all(|w| w[0] < w[1]), "in position order");
    let e = &events[0];
    assert_eq!(e["specversion"], "1.0");
    assert_eq!(e["type"], "order.placed");
    assert_eq!(e["subject"], "order/1");
    assert_eq!(e["tenant"], "acme");
    assert_eq!(e["data"], serde_json::json!({"i": 1}));
    assert!(
        e["id"].as_str().unwrap().len() == 36 && e["time"].is_string() && e["source"].is_string()
    );
    let requests = rx.received();
    assert!(
        requests.len() >= 3,
        "batches of at most 50: {} requests",
        requests.len()
    );
    for q in &requests {
        assert_eq!(
            q.headers["content-type"],
            "application/cloudevents-batch+json"
        );
        assert_eq!(q.headers["authorization"], TOKEN);
        assert_eq!(q.headers["idempotency-key"], q.headers["webhook-id"]);
        assert!(
            serde_json::from_slice::<Vec<serde_json::Value>>(&q.body)
                .unwrap()
                .len()
                <= 50
        );
        verify(q);
    }
}

#[test]
fn server_errors_are_retried_and_everything_arrives_once() {
    let (_db, mut c) = setup("http_500");
    // The first three requests fail with 500 (one with Retry-After), then all succeed.
    let rx = Receiver::start(|_, n| match n {
        0 => (500, vec![("retry-after".into(), "1".into())]),
        1 | 2 => (503, vec![]),
        _ => (200, vec![]),
    });
    hook(&mut c, &rx, "");
    c.batch_execute(
        "SELECT outbox.raise('t.x', jsonb_build_object('i', i)) FROM generate_series(1, 30) i",
    )
    .unwrap();
    let events = wait_delivered(&rx, 30);
    assert_eq!(events.len(), 30);
    assert!(positions(&events).windows(2).all(|w| w[0] < w[1]));
    // Each failure halved the batch; the first waited for its Retry-After.
    let r = rx.received();
    let sizes: Vec<usize> = r
        .iter()
        .map(|q| {
            serde_json::from_slice::<Vec<serde_json::Value>>(&q.body)
                .unwrap()
                .len()
        })
        .collect();
    assert_eq!(sizes[..4], [30, 15, 7, 3]);
    assert!(r[1].at.duration_since(r[0].at).unwrap() >= Duration::from_secs(1));
    assert_eq!(dead_letters(&mut c), 0, "server errors never dead-letter");
}

#[test]
fn an_event_the_endpoint_refuses_is_dead_lettered_after_the_neighbour_test() {
    let (_db, mut c) = setup("http_422");
    let rx = Receiver::start(|q, _| match flagged(q, "poison") {
        true => (422, vec![]),
        false => (200, vec![]),
    });
    hook(&mut c, &rx, ", batch_size => 16");
    c.batch_execute(
        "SELECT outbox.raise_many(ARRAY['t.x'], array_agg(CASE WHEN i = 9 THEN jsonb_build_object('i', i, 'poison', true)
                                                              ELSE jsonb_build_object('i', i) END ORDER BY i))
           FROM generate_series(1, 40) i",
    )
    .unwrap();
    let events = wait_delivered(&rx, 39);
    assert_eq!(events.len(), 39);
    assert!(events.iter().all(|e| e["data"].get("poison").is_none()));
    let dead = eventually("the dead letter", Duration::from_secs(30), || {
        c.query_opt("SELECT (event).payload::text, attempts, error FROM outbox.dead_letters WHERE sink = 'hook'", &[])
            .unwrap()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i32>(1), r.get::<_, String>(2)))
    });
    assert_eq!(dead.0, r#"{"i": 9, "poison": true}"#);
    assert_eq!(dead.1, 5);
    assert_eq!(dead.2, "HTTP 422");
}

#[test]
fn destinations_and_options_are_refused_with_clear_errors() {
    let db = worker_db("http_refusals");
    let mut c = db.connect();
    for (sql, code) in [
        ("SELECT outbox.create_http_sink('h', 'http://hooks.example.com/in')", "22023"),
        ("SELECT outbox.create_http_sink('h', 'https://127.0.0.1/in')", "22023"),
        ("SELECT outbox.create_http_sink('h', 'https://169.254.169.254/latest/meta-data')", "22023"),
        ("SELECT outbox.create_http_sink('h', 'https://[::1]/in')", "22023"),
        ("SELECT outbox.create_http_sink('h', 'not a url')", "22023"),
        ("SELECT outbox.create_http_sink('h', 'https://user:pw@hooks.example.com/')", "22023"),
        ("SELECT outbox.create_http_sink('h', NULL)", "22004"),
        ("SELECT outbox.create_http_sink(NULL, 'https://hooks.example.com/')", "22004"),
        ("SELECT outbox.create_http_sink('bad id', 'https://hooks.example.com/')", "42602"),
        ("SELECT outbox.create_http_sink('h', 'https://hooks.example.com/', secret => 'hunter2')", "22023"),
        ("SELECT outbox.create_http_sink('h', 'https://hooks.example.com/', headers => '{\"Webhook-Signature\": \"x\"}')", "22023"),
        ("SELECT outbox.create_http_sink('h', 'https://hooks.example.com/', headers => '{\"X\": 1}')", "22023"),
        ("SELECT outbox.create_http_sink('h', 'https://hooks.example.com/', headers => '[]')", "22023"),
        ("SELECT outbox.create_http_sink('h', 'https://hooks.example.com/', timeout_ms => 5)", "22023"),
    ] {
        assert_eq!(sqlstate(&mut c, sql), code, "{sql}");
    }
    let msg = pg_outbox_tests::error_message(
        &mut c,
        "SELECT outbox.create_http_sink('h', 'https://hooks.example.com/', secret => 'hunter2')",
    );
    assert!(!msg.contains("hunter2"), "the secret is not echoed: {msg}");
    let n: i64 = c
        .query_one("SELECT count(*) FROM outbox.sinks", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
}

#[test]
fn redirects_are_not_followed_and_secrets_stay_out_of_sight() {
    let (db, mut c) = setup("http_redirect");
    // Redirects to the receiver itself: following it would show up as a request for /elsewhere.
    let port = Receiver::free_port();
    let rx = Receiver::start_on(port, move |_, _| {
        (
            302,
            vec![(
                "location".into(),
                format!("http://127.0.0.1:{port}/elsewhere"),
            )],
        )
    });
    c.execute(
        "SELECT outbox.create_http_sink('hook', $1, secret => $2, headers => jsonb_build_object('Authorization', $3::text))",
        &[&rx.url("/in"), &SECRET, &TOKEN],
    )
    .unwrap();
    c.batch_execute(
        "SELECT outbox.raise('t.x', '{\"i\": 1}'); SELECT outbox.raise('t.x', '{\"i\": 2}')",
    )
    .unwrap();
    eventually(
        "the neighbour test to mark the sink down",
        Duration::from_secs(40),
        || {
            let down: bool = c
                .query_one("SELECT down FROM outbox.sinks WHERE id = 'hook'", &[])
                .unwrap()
                .get(0);
            down.then_some(())
        },
    );
    let r = c
        .query_one(
            "SELECT last_error, dead_letters, state FROM outbox.status() WHERE name = 'hook'",
            &[],
        )
        .unwrap();
    let error: String = r.get(0);
    assert!(error.contains("redirect"), "{error}");
    assert_eq!(
        r.get::<_, i64>(1),
        0,
        "a redirecting endpoint dead-letters nothing"
    );
    assert!(
        rx.received().iter().all(|q| q.path == "/in"),
        "the location was never followed"
    );
    // Nowhere an operator looks shows the secret or the token.
    let status: String = c
        .query_one(
            "SELECT string_agg(s::text, ' ') FROM outbox.status() s",
            &[],
        )
        .unwrap()
        .get(0);
    for secret in [SECRET, TOKEN] {
        assert!(!status.contains(secret));
        assert!(
            !db.cluster().log().contains(secret),
            "the server log shows {secret}"
        );
    }
    // And a role that may use the sink API cannot read them.
    c.batch_execute(&format!(
        "CREATE ROLE ops LOGIN; GRANT CONNECT ON DATABASE \"{}\" TO ops; GRANT USAGE ON SCHEMA outbox TO ops;
         GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO ops;",
        db.name
    ))
    .unwrap();
    let mut ops = db.connect_as("ops");
    assert_eq!(
        sqlstate(&mut ops, "SELECT * FROM outbox.http_sinks"),
        "42501"
    );
}

#[test]
fn a_hanging_endpoint_times_out_without_holding_up_another_sink() {
    let (_db, mut c) = setup("http_hang");
    let hanging = Receiver::start(|_, _| {
        std::thread::sleep(Duration::from_secs(30));
        (200, vec![])
    });
    let fine = Receiver::start(|_, _| (200, vec![]));
    c.execute(
        // 'a-hang' sorts first: a worker starts its request before the fine sink's.
        "SELECT outbox.create_http_sink('a-hang', $1, timeout_ms => 3000)",
        &[&hanging.url("/in")],
    )
    .unwrap();
    c.execute(
        "SELECT outbox.create_http_sink('fine', $1)",
        &[&fine.url("/in")],
    )
    .unwrap();
    let start = std::time::Instant::now();
    c.batch_execute("SELECT outbox.raise('t.x', '{\"i\": 1}')")
        .unwrap();
    // Delivered means recorded: the fine sink's cursor is past the event.
    eventually(
        "the fine sink's cursor to move",
        Duration::from_secs(10),
        || {
            let behind: i64 = c
                .query_one(
                    "SELECT events_behind FROM outbox.status() WHERE name = 'fine'",
                    &[],
                )
                .unwrap()
                .get(0);
            (behind == 0).then_some(())
        },
    );
    assert!(
        start.elapsed() < Duration::from_millis(2500),
        "the fine sink waited {:?}",
        start.elapsed()
    );
    eventually(
        "the timeout on the hanging sink",
        Duration::from_secs(20),
        || {
            let e: Option<String> = c
                .query_one(
                    "SELECT last_error FROM outbox.status() WHERE name = 'a-hang'",
                    &[],
                )
                .unwrap()
                .get(0);
            e.filter(|e| e.contains("timed out")).map(|_| ())
        },
    );
    // And more events keep flowing to the fine one meanwhile.
    c.batch_execute("SELECT outbox.raise('t.x', '{\"i\": 2}')")
        .unwrap();
    wait_delivered(&fine, 2);
}

#[test]
fn an_endpoint_down_for_a_while_loses_nothing() {
    let (_db, mut c) = setup("http_down");
    let port = Receiver::free_port();
    c.execute(
        "SELECT outbox.create_http_sink('hook', $1)",
        &[&format!("http://127.0.0.1:{port}/in")],
    )
    .unwrap();
    c.batch_execute(
        "SELECT outbox.raise('t.x', jsonb_build_object('i', i)) FROM generate_series(1, 25) i",
    )
    .unwrap();
    eventually(
        "connection failures to be recorded",
        Duration::from_secs(20),
        || {
            let a: i32 = c
                .query_one(
                    "SELECT attempts FROM outbox.status() WHERE name = 'hook'",
                    &[],
                )
                .unwrap()
                .get(0);
            (a >= 2).then_some(())
        },
    );
    let rx = Receiver::start_on(port, |_, _| (200, vec![]));
    let events = wait_delivered(&rx, 25);
    assert_eq!(events.len(), 25);
    assert!(positions(&events).windows(2).all(|w| w[0] < w[1]));
    assert_eq!(dead_letters(&mut c), 0);
}

#[test]
fn a_server_crash_mid_request_redelivers_the_batch() {
    let (db, mut c) = setup("http_crash");
    // The first request is held for 3 s (the server dies meanwhile); later ones succeed.
    let rx = Receiver::start(|_, n| {
        if n == 0 {
            std::thread::sleep(Duration::from_secs(3));
        }
        (200, vec![])
    });
    hook(&mut c, &rx, "");
    c.batch_execute(
        "SELECT outbox.raise('t.x', jsonb_build_object('i', i)) FROM generate_series(1, 10) i",
    )
    .unwrap();
    eventually("the first request", Duration::from_secs(10), || {
        (!rx.received().is_empty()).then_some(())
    });
    drop(c);
    db.cluster().restart_immediate();
    db.cluster().wait_for_workers(&db.name);
    eventually(
        "the batch again after the restart",
        Duration::from_secs(30),
        || (rx.received().len() >= 2).then_some(()),
    );
    let r = rx.received();
    assert_eq!(
        r[0].headers["idempotency-key"], r[1].headers["idempotency-key"],
        "the same batch, the same key"
    );
    assert_eq!(r[0].body, r[1].body);
    let mut c = db.connect();
    eventually("the cursor past the batch", Duration::from_secs(10), || {
        let behind: i64 = c
            .query_one(
                "SELECT events_behind FROM outbox.status() WHERE name = 'hook'",
                &[],
            )
            .unwrap()
            .get(0);
        (behind == 0).then_some(())
    });
}

#[test]
fn a_dead_letter_is_replayed_to_its_http_sink() {
    let (_db, mut c) = setup("http_replay");
    let accept = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let gate = accept.clone();
    let rx = Receiver::start(move |q, _| {
        let poison = String::from_utf8_lossy(&q.body).contains("poison");
        if poison && !gate.load(std::sync::atomic::Ordering::SeqCst) {
            (422, vec![])
        } else {
            (200, vec![])
        }
    });
    hook(&mut c, &rx, "");
    c.batch_execute("SELECT outbox.raise('t.x', '{\"poison\": true}'); SELECT outbox.raise('t.x', '{\"ok\": 1}')").unwrap();
    eventually("the dead letter", Duration::from_secs(30), || {
        let n: i64 = c
            .query_one("SELECT count(*) FROM outbox.dead_letters", &[])
            .unwrap()
            .get(0);
        (n == 1).then_some(())
    });
    accept.store(true, std::sync::atomic::Ordering::SeqCst);
    c.batch_execute("SELECT outbox.replay('hook')").unwrap();
    eventually(
        "the replayed event accepted",
        Duration::from_secs(20),
        || {
            let n: i64 = c
                .query_one("SELECT count(*) FROM outbox.dead_letters", &[])
                .unwrap()
                .get(0);
            (n == 0).then_some(())
        },
    );
    let events = delivered(&rx);
    assert_eq!(events.len(), 2);
    assert_eq!(
        events[1]["data"],
        serde_json::json!({"poison": true}),
        "replayed after the neighbour went through"
    );
}

#[test]
fn an_event_answered_500_is_dead_lettered_after_the_neighbour_test_and_the_rest_arrive_in_order() {
    let (_db, mut c) = setup("http_500_one");
    let rx = Receiver::start(|q, _| match flagged(q, "poison") {
        true => (500, vec![]),
        false => (200, vec![]),
    });
    hook(&mut c, &rx, ", batch_size => 16");
    c.batch_execute(
        "SELECT outbox.raise_many(ARRAY['t.x'], array_agg(CASE WHEN i = 9 THEN jsonb_build_object('i', i, 'poison', true)
                                                              ELSE jsonb_build_object('i', i) END ORDER BY i))
           FROM generate_series(1, 40) i",
    )
    .unwrap();
    let events = wait_delivered(&rx, 39);
    assert_eq!(events.len(), 39);
    assert!(positions(&events).windows(2).all(|w| w[0] < w[1]));
    let ids: Vec<i64> = events
        .iter()
        .map(|e| e["data"]["i"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, (1..=40).filter(|i| *i != 9).collect::<Vec<i64>>());
    assert_eq!(
        the_dead_letter(&mut c),
        ("9".to_string(), "HTTP 500".to_string())
    );
}

#[test]
fn an_endpoint_answering_503_for_a_while_dead_letters_nothing_and_gets_everything_after() {
    let (_db, mut c) = setup("http_503_outage");
    let up = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = up.clone();
    let rx = Receiver::start(
        move |_, _| match flag.load(std::sync::atomic::Ordering::SeqCst) {
            true => (200, vec![]),
            false => (503, vec![]),
        },
    );
    hook(&mut c, &rx, ", batch_size => 8");
    c.batch_execute(
        "SELECT outbox.raise('t.x', jsonb_build_object('i', i)) FROM generate_series(1, 25) i",
    )
    .unwrap();
    // Halved to the lone event, retried, its neighbour tested and refused too: down, not poison.
    eventually("the sink down", Duration::from_secs(30), || {
        let state: String = c
            .query_one("SELECT state FROM outbox.status() WHERE name = 'hook'", &[])
            .unwrap()
            .get(0);
        (state == "down").then_some(())
    });
    // The neighbour test was sent: a request holding the second event alone.
    let lone_keys: Vec<String> = rx
        .received()
        .iter()
        .filter(|q| {
            serde_json::from_slice::<Vec<serde_json::Value>>(&q.body)
                .unwrap()
                .len()
                == 1
        })
        .map(|q| q.headers["idempotency-key"].clone())
        .collect();
    assert!(lone_keys.len() >= 2);
    // Retries of the lone event carry its idempotency key again.
    assert!(lone_keys.windows(2).any(|w| w[0] == w[1]));
    up.store(true, std::sync::atomic::Ordering::SeqCst);
    let events = wait_delivered(&rx, 25);
    assert_eq!(events.len(), 25);
    assert!(positions(&events).windows(2).all(|w| w[0] < w[1]));
    assert_eq!(dead_letters(&mut c), 0, "an outage dead-letters nothing");
}

#[test]
fn retry_after_is_honoured_before_the_next_request() {
    let (_db, mut c) = setup("http_429");
    let rx = Receiver::start(|_, n| match n {
        0 => (429, vec![("retry-after".into(), "2".into())]),
        _ => (200, vec![]),
    });
    hook(&mut c, &rx, "");
    c.batch_execute(
        "SELECT outbox.raise('t.x', jsonb_build_object('i', i)) FROM generate_series(1, 10) i",
    )
    .unwrap();
    let events = wait_delivered(&rx, 10);
    assert_eq!(events.len(), 10);
    let r = rx.received();
    let waited = r[1].at.duration_since(r[0].at).unwrap();
    assert!(
        waited >= Duration::from_secs(2),
        "the next request came after {waited:?}"
    );
}

#[test]
fn an_event_whose_request_times_out_is_dead_lettered_after_the_neighbour_test() {
    let (_db, mut c) = setup("http_timeout_one");
    let rx = Receiver::start(|q, _| {
        if flagged(q, "slow") {
            // Answered after the sink gave up; recorded apart from what was delivered.
            std::thread::sleep(Duration::from_millis(1500));
            return (599, vec![]);
        }
        (200, vec![])
    });
    hook(&mut c, &rx, ", batch_size => 4, timeout_ms => 300");
    c.batch_execute(
        "SELECT outbox.raise('t.x', CASE WHEN i = 3 THEN jsonb_build_object('i', i, 'slow', true)
                                         ELSE jsonb_build_object('i', i) END) FROM generate_series(1, 8) i",
    )
    .unwrap();
    assert_eq!(the_dead_letter(&mut c).0, "3");
    // Every other event arrived once, in order.
    let events = wait_delivered(&rx, 7);
    let ids: Vec<i64> = events
        .iter()
        .map(|e| e["data"]["i"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, [1, 2, 4, 5, 6, 7, 8]);
}

#[test]
fn a_host_that_resolves_to_an_internal_address_is_refused_at_delivery() {
    let db = worker_db("http_resolve");
    db.cluster().set("pg_outbox.http_allow_plain", "on");
    let mut c = db.connect();
    let rx = Receiver::start(|_, _| (200, vec![]));
    // A name, not an address: it passes creation, and is checked each time it is resolved.
    c.execute(
        "SELECT outbox.create_http_sink('hook', $1)",
        &[&format!("http://localhost:{}/in", rx.port)],
    )
    .unwrap();
    c.batch_execute("SELECT outbox.raise('t.x')").unwrap();
    eventually(
        "the refusal to be recorded",
        Duration::from_secs(20),
        || {
            let e: Option<String> = c
                .query_one(
                    "SELECT last_error FROM outbox.status() WHERE name = 'hook'",
                    &[],
                )
                .unwrap()
                .get(0);
            e.filter(|e| e.contains("internal address")).map(|_| ())
        },
    );
    assert!(
        rx.received().is_empty(),
        "nothing reached the loopback receiver"
    );
    db.cluster().set("pg_outbox.http_allow_plain", "off");
}

#[test]
fn the_host_allowlist_is_enforced_at_creation_and_at_delivery() {
    let (db, mut c) = setup("http_allowlist");
    struct Reset<'a>(&'a TestDb);
    impl Drop for Reset<'_> {
        fn drop(&mut self) {
            self.0.cluster().set("pg_outbox.http_allowed_hosts", "");
        }
    }
    let _reset = Reset(&db);
    let rx = Receiver::start(|_, _| (200, vec![]));
    hook(&mut c, &rx, "");
    db.cluster().set(
        "pg_outbox.http_allowed_hosts",
        "hooks.example.com, *.corp.example",
    );
    for url in [
        "https://other.example.com/in",
        "https://corp.example/in",
        &rx.url("/in"),
    ] {
        let sql = format!("SELECT outbox.create_http_sink('new', '{url}')");
        assert_eq!(sqlstate(&mut c, &sql), "22023", "{url}");
    }
    // Delivery checks again: the existing sink's host is no longer allowed.
    c.batch_execute("SELECT outbox.raise('t.x')").unwrap();
    eventually(
        "the refusal to be recorded",
        Duration::from_secs(20),
        || {
            let e: Option<String> = c
                .query_one(
                    "SELECT last_error FROM outbox.status() WHERE name = 'hook'",
                    &[],
                )
                .unwrap()
                .get(0);
            e.filter(|e| e.contains("http_allowed_hosts")).map(|_| ())
        },
    );
    assert!(rx.received().is_empty());
}

#[test]
fn trace_context_headers_become_the_cloudevents_tracing_attributes() {
    let (_db, mut c) = setup("http_trace");
    let rx = Receiver::start(|_, _| (200, vec![]));
    hook(&mut c, &rx, "");
    c.batch_execute(
        "SELECT outbox.raise('t.x', '{\"i\": 1}', headers => jsonb_build_object(
             'traceparent', '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01',
             'tracestate', 'congo=t61rcWkgMzE', 'other', 'kept out'));
         SELECT outbox.raise('t.x', '{\"i\": 2}');
         SELECT outbox.raise('t.x', '{\"i\": 3}', headers => '{\"traceparent\": 42}');",
    )
    .unwrap();
    let events = wait_delivered(&rx, 3);
    assert_eq!(
        events[0]["traceparent"],
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
    assert_eq!(events[0]["tracestate"], "congo=t61rcWkgMzE");
    assert!(events[0].get("other").is_none());
    for e in &events[1..] {
        assert!(
            e.get("traceparent").is_none() && e.get("tracestate").is_none(),
            "{e}"
        );
    }
}
