use pg_outbox_tests::kafka::Broker;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::ClientConfig;
use std::time::{Duration, Instant};
fn main() {
    let broker = Broker::start("kwarm");
    broker.topic("t", 3, &[]);
    for linger in ["0", "1", "5"] {
        for idem in ["true", "false"] {
            let p: BaseProducer = ClientConfig::new()
                .set("bootstrap.servers", broker.address())
                .set("enable.idempotence", idem)
                .set("acks", "all")
                .set("linger.ms", linger)
                .create()
                .unwrap();
            p.send(BaseRecord::to("t").payload("x").key("k")).unwrap();
            while p.in_flight_count() > 0 {
                p.poll(Duration::from_millis(1));
            }
            let mut v = vec![];
            for _ in 0..50 {
                let s = Instant::now();
                for i in 0..128 {
                    let k = format!("k{}", i % 16);
                    p.send(
                        BaseRecord::to("t")
                            .payload("xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx")
                            .key(&k),
                    )
                    .unwrap();
                }
                while p.in_flight_count() > 0 {
                    p.poll(Duration::from_millis(1));
                }
                v.push(s.elapsed().as_secs_f64() * 1000.0);
            }
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            println!(
                "linger {linger} idem {idem}: 128-message window ack p50 {:.2} ms p90 {:.2} ms",
                v[25], v[45]
            );
        }
    }
}
