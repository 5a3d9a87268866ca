//! Fan-out predicate cost: CEL filters evaluated against events, per event per subscription, for
//! 1, 10 and 100 subscriptions with a simple predicate. Pure Rust (no cluster): the part of
//! fan-out that grows with the number of subscriptions. `cargo run --release -p pg_outbox_benches
//! --bin filter`.

use pg_outbox_core::filter::{EventContext, EventFields, Filter, Needs};
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let payloads: Vec<serde_json::Value> = (0..1000)
        .map(|i| serde_json::json!({"order": i, "amount": (i * 37) % 400, "currency": "EUR", "items": [1, 2, 3]}))
        .collect();
    let headers =
        serde_json::json!({"trace": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"});
    let tenants = ["acme", "globex", "initech"];
    println!(
        "\nfan-out predicate cost (CEL, release build, {} events per round)\n",
        payloads.len()
    );
    println!(
        "{:<16} {:>22} {:>26}",
        "subscriptions", "µs per event (all)", "µs per event per sub"
    );
    for subs in [1usize, 10, 100] {
        let filters: Vec<Filter> = (0..subs)
            .map(|i| {
                Filter::compile(&format!(
                    "payload.amount > {} && tenant == \"acme\"",
                    i % 300
                ))
                .unwrap()
            })
            .collect();
        // What fan-out converts of each event: what the filters read.
        let needs = Needs::of(filters.iter());
        let mut matched = 0usize;
        let rounds = (2000 / subs).max(5);
        let start = Instant::now();
        for _ in 0..rounds {
            for (n, p) in payloads.iter().enumerate() {
                let fields = EventFields {
                    topic: "order.placed",
                    subject: Some("order/42"),
                    tenant: Some(tenants[n % 3]),
                    payload: p,
                    headers: &headers,
                    raised_at: "2026-11-30T10:00:00.123456+00:00",
                };
                // Converted once per event, evaluated by every subscription.
                let context = EventContext::for_needs(&fields, &needs);
                for f in &filters {
                    matched += f.matches_in(&context).unwrap_or(false) as usize;
                }
            }
        }
        let events = (rounds * payloads.len()) as f64;
        let per_event = start.elapsed().as_secs_f64() * 1e6 / events;
        black_box(matched);
        println!(
            "{:<16} {:>22.2} {:>26.3}",
            subs,
            per_event,
            per_event / subs as f64
        );
    }
    println!("\ntarget: at most 5 µs per event per subscription for a simple predicate\n");
}
