//! The failure policy of a sink, as pure arithmetic over its state.
//!
//! 1. A batch that fails leaves the cursor where it was; the next pass hands the sink half as many
//!    events, until the failing event is alone. After a success the batch grows back (doubling).
//! 2. A lone failing event is retried after 1 s, doubling up to `max_backoff`.
//! 3. After `poison_after` failures it is tested against its neighbour: the next event alone.
//! 4. If the neighbour goes through, the lone event is poison: dead-lettered, and the cursor moves
//!    past both. If the neighbour fails too, the sink is down: nothing is dead-lettered and the
//!    back-off goes on, so an outage never loses events. With no neighbour yet, keep retrying.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// The sink's configured batch size: where growth stops.
    pub max_batch: u32,
    /// The first retry delay of a lone failing event.
    pub first_backoff: Duration,
    pub max_backoff: Duration,
    /// Failures of a lone event before its neighbour is tested.
    pub poison_after: u32,
}

/// What the policy remembers between passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkState {
    /// Events to hand the sink on its next pass.
    pub batch: u32,
    /// Consecutive failures of the current lone event (0 while delivering normally).
    pub attempts: u32,
}

impl SinkState {
    pub fn fresh(policy: &Policy) -> Self {
        SinkState {
            batch: policy.max_batch,
            attempts: 0,
        }
    }
}

/// What to do after a delivery failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterFailure {
    /// More than one event was handed over: try again at once with half as many.
    Halve(SinkState),
    /// A lone event failed: retry it after `delay`.
    Retry { state: SinkState, delay: Duration },
    /// A lone event failed `poison_after` times or more: deliver its neighbour alone now.
    TestNeighbour(SinkState),
}

/// What to do after the neighbour test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterNeighbour {
    /// The neighbour went through: dead-letter the lone event, move past both, start afresh.
    DeadLetter(SinkState),
    /// The neighbour failed too (or there is none yet): the sink is down; back off.
    Down { state: SinkState, delay: Duration },
}

impl Policy {
    /// The delay before retry number `attempts` (1-based): 1 s, 2 s, 4 s, … capped.
    pub fn backoff(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(31);
        self.first_backoff
            .saturating_mul(1u32 << doublings)
            .min(self.max_backoff)
    }

    /// After a delivered batch: forget failures, grow the batch back towards the maximum.
    pub fn after_success(&self, state: SinkState) -> SinkState {
        SinkState {
            batch: state
                .batch
                .saturating_mul(2)
                .clamp(1, self.max_batch.max(1)),
            attempts: 0,
        }
    }

    /// After a failed delivery of `handed` events.
    pub fn after_failure(&self, state: SinkState, handed: u32) -> AfterFailure {
        if handed > 1 {
            return AfterFailure::Halve(SinkState {
                batch: (handed / 2).max(1),
                attempts: 0,
            });
        }
        let attempts = state.attempts.saturating_add(1);
        let state = SinkState { batch: 1, attempts };
        if attempts >= self.poison_after {
            AfterFailure::TestNeighbour(state)
        } else {
            AfterFailure::Retry {
                state,
                delay: self.backoff(attempts),
            }
        }
    }

    /// After the neighbour of a lone failing event was tried (None: there is no neighbour yet).
    pub fn after_neighbour(&self, state: SinkState, neighbour_ok: Option<bool>) -> AfterNeighbour {
        match neighbour_ok {
            Some(true) => AfterNeighbour::DeadLetter(SinkState {
                batch: 1,
                attempts: 0,
            }),
            Some(false) | None => AfterNeighbour::Down {
                state,
                delay: self.backoff(state.attempts),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy {
            max_batch: 128,
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            poison_after: 5,
        }
    }

    #[test]
    fn backoff_doubles_from_one_second_and_caps() {
        let p = policy();
        let secs: Vec<u64> = (1..=11).map(|a| p.backoff(a).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(p.backoff(u32::MAX), Duration::from_secs(300));
    }

    #[test]
    fn a_failing_batch_halves_down_to_the_lone_event() {
        let p = policy();
        let mut state = SinkState::fresh(&p);
        let mut handed = Vec::new();
        loop {
            handed.push(state.batch);
            match p.after_failure(state, state.batch) {
                AfterFailure::Halve(s) => state = s,
                AfterFailure::Retry { state: s, delay } => {
                    assert_eq!(s.attempts, 1);
                    assert_eq!(delay, Duration::from_secs(1));
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(handed, [128, 64, 32, 16, 8, 4, 2, 1]);
    }

    #[test]
    fn a_short_read_halves_what_was_handed_not_the_configured_size() {
        let p = policy();
        assert_eq!(
            p.after_failure(SinkState::fresh(&p), 10),
            AfterFailure::Halve(SinkState {
                batch: 5,
                attempts: 0
            })
        );
        assert_eq!(
            p.after_failure(SinkState::fresh(&p), 3),
            AfterFailure::Halve(SinkState {
                batch: 1,
                attempts: 0
            })
        );
    }

    #[test]
    fn the_neighbour_is_tested_after_poison_after_failures() {
        let p = policy();
        let mut state = SinkState {
            batch: 1,
            attempts: 0,
        };
        for expected in 1..p.poison_after {
            match p.after_failure(state, 1) {
                AfterFailure::Retry { state: s, delay } => {
                    assert_eq!(s.attempts, expected);
                    assert_eq!(delay, p.backoff(expected));
                    state = s;
                }
                other => panic!("attempt {expected}: {other:?}"),
            }
        }
        let AfterFailure::TestNeighbour(s) = p.after_failure(state, 1) else {
            panic!()
        };
        assert_eq!(s.attempts, 5);
        // Neighbour through: poison.
        assert_eq!(
            p.after_neighbour(s, Some(true)),
            AfterNeighbour::DeadLetter(SinkState {
                batch: 1,
                attempts: 0
            })
        );
        // Neighbour failing too, or absent: down, back off, dead-letter nothing; keep testing.
        for n in [Some(false), None] {
            let AfterNeighbour::Down { state: d, delay } = p.after_neighbour(s, n) else {
                panic!()
            };
            assert_eq!(d.attempts, 5);
            assert_eq!(delay, Duration::from_secs(16));
            assert!(
                matches!(p.after_failure(d, 1), AfterFailure::TestNeighbour(x) if x.attempts == 6)
            );
        }
    }

    #[test]
    fn success_grows_the_batch_back_and_forgets_attempts() {
        let p = policy();
        let mut s = SinkState {
            batch: 1,
            attempts: 3,
        };
        let mut sizes = Vec::new();
        for _ in 0..9 {
            s = p.after_success(s);
            sizes.push(s.batch);
            assert_eq!(s.attempts, 0);
        }
        assert_eq!(sizes, [2, 4, 8, 16, 32, 64, 128, 128, 128]);
        let one = Policy { max_batch: 1, ..p };
        assert_eq!(
            one.after_success(SinkState {
                batch: 1,
                attempts: 0
            })
            .batch,
            1
        );
    }
}
