//! The log's partitions (`outbox.events_0` to `_3`): they take the new events in turn, each for
//! one period, chosen by the time the raising transaction began. The workers prune the log by
//! truncating a partition once every reader has passed all of it and the newest event it can hold
//! is older than the retention; the partition of the current period is never truncated.

/// How many partitions the log has.
pub const PARTITIONS: i64 = 4;

/// Seconds, besides a retention and a period, during which nothing is truncated after the
/// period changed: a backend that has not reloaded the configuration yet raises by the old one.
pub const RELOAD_MARGIN_S: i64 = 5;

const US: i64 = 1_000_000;

/// The period, in seconds, for a retention and a prune interval: half their sum, so that a
/// partition left by the current period ages past the retention and is pruned (one interval
/// later at most) before its turn comes again, three periods on.
pub fn period_s(retention_s: i64, prune_interval_s: i64) -> i64 {
    (retention_s.max(0) + prune_interval_s.max(0))
        .div_euclid(2)
        .max(1)
}

/// The number of the period that holds `unix_us` (microseconds since 1970).
fn slot(unix_us: i64, period_s: i64) -> i64 {
    unix_us.div_euclid(period_s * US)
}

/// The partition of the events raised by a transaction that began at `unix_us`.
pub fn part(unix_us: i64, period_s: i64) -> i16 {
    slot(unix_us, period_s).rem_euclid(PARTITIONS) as i16
}

/// Whether every event partition `part` can hold was raised a retention before `now_us`: it is
/// not the partition of the current period, and the last period it took events in ended then.
/// Holds only for events raised under this period ([`settled`]).
pub fn aged(part: i16, now_us: i64, period_s: i64, retention_s: i64) -> bool {
    let current = slot(now_us, period_s);
    let back = (current - part as i64).rem_euclid(PARTITIONS);
    if back == 0 {
        return false;
    }
    let ended_us = (current - back + 1) * period_s * US;
    ended_us <= now_us - retention_s * US
}

/// Whether the period, the same since `since_us`, has been so for long enough that every event
/// raised under an earlier one is older than the retention.
pub fn settled(since_us: i64, now_us: i64, period_s: i64, retention_s: i64) -> bool {
    now_us - since_us >= (retention_s + period_s + RELOAD_MARGIN_S) * US
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_period_is_half_of_retention_and_interval_and_at_least_a_second() {
        assert_eq!(period_s(7 * 86_400, 3_600), (7 * 86_400 + 3_600) / 2);
        assert_eq!(period_s(0, 1), 1);
        assert_eq!(period_s(60, 10), 35);
        assert_eq!(period_s(i32::MAX as i64, i32::MAX as i64), i32::MAX as i64);
    }

    #[test]
    fn partitions_take_turns_period_by_period() {
        let p = 10;
        let parts: Vec<i16> = (0..9).map(|i| part(i * p * US + 3, p)).collect();
        assert_eq!(parts, [0, 1, 2, 3, 0, 1, 2, 3, 0]);
        assert_eq!(part(p * US - 1, p), 0);
        assert_eq!(part(p * US, p), 1);
        // Before 1970 as well (a clock set far back must not give a negative partition).
        assert_eq!(part(-1, p), 3);
    }

    #[test]
    fn the_current_partition_is_never_aged() {
        let (p, r) = (10, 0);
        for now in (0..200).map(|s| s * US + 1) {
            assert!(!aged(part(now, p), now, p, r), "{now}");
        }
    }

    #[test]
    fn a_partition_ages_a_retention_after_its_last_period_ended() {
        let (p, r) = (10, 15);
        // At 100 s (period 10, partition 2): partition 1 took 90-100 s, 0 took 80-90 s, 3 took
        // 70-80 s.
        let now = 100 * US;
        assert_eq!(part(now, p), 2);
        assert!(
            !aged(1, now, p, r),
            "ended at 100 s, the retention runs to 115 s"
        );
        assert!(!aged(0, now, p, r), "ended at 90 s");
        assert!(aged(3, now, p, r), "ended at 80 s, 20 s ago");
        assert!(aged(0, 105 * US, p, r));
        assert!(!aged(0, 105 * US - 1, p, r));
        // With no retention every partition but the current one has aged.
        assert!((0..4).filter(|&k| aged(k, now, p, 0)).count() == 3);
    }

    #[test]
    fn every_event_of_an_aged_partition_is_older_than_the_retention() {
        // Brute force over raise times: a partition judged aged holds only events older than
        // the retention.
        for (p, r) in [(1, 0), (3, 5), (10, 15), (35, 60)] {
            for now_s in 0..300i64 {
                let now = now_s * US + 500_000;
                for raised_s in 0..=now_s {
                    let raised = raised_s * US + 250_000;
                    if raised > now {
                        continue;
                    }
                    if aged(part(raised, p), now, p, r) {
                        assert!(
                            raised <= now - r * US,
                            "p {p} r {r} now {now} raised {raised}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_new_period_settles_after_a_retention_a_period_and_the_margin() {
        let since = 1_000 * US;
        assert!(!settled(since, since + 20 * US - 1, 10, 5));
        assert!(settled(since, since + 20 * US, 10, 5));
    }
}
