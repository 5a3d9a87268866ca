//! Snapshots as ticks record them (`pg_snapshot` text, `xmin:xmax:xip,...`, in the log's terms),
//! and what a reader by ticks makes of the two that bound its batch.
//!
//! A batch is the events of the transactions snapshot `upto` sees and snapshot `since` does not.
//! Those are the ones `since` saw running (its xip) that `upto` sees ended, and those from
//! `since`'s xmax on that `upto` sees ended. Read in position order, the first kind comes first
//! wherever it is (the running ones are older than `since`'s xmax), so a reader whose cursor has
//! passed every one of them reads the rest of its batch as one range of the log: from the cursor
//! (or `since`'s xmax) to `upto`'s xmax, leaving out `upto`'s own running transactions.

use crate::{Invalid, InvalidKind, Position};

/// A snapshot: every transaction below `xmin` had ended, none from `xmax` on had, and of those
/// between, all but the ones in `xip` had (sorted, as PostgreSQL prints them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub xmin: u64,
    pub xmax: u64,
    pub xip: Vec<u64>,
}

fn bad(text: &str) -> Invalid {
    Invalid::new(
        InvalidKind::Text,
        format!("invalid snapshot \"{text}\": expected xmin:xmax:xip,..."),
    )
}

impl Snapshot {
    /// Parses `pg_snapshot` text, with PostgreSQL's checks: xmin <= every xip < xmax, xip
    /// ascending.
    pub fn parse(text: &str) -> Result<Snapshot, Invalid> {
        let mut parts = text.splitn(3, ':');
        let number = |s: Option<&str>| -> Result<u64, Invalid> {
            s.filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad(text))
        };
        let xmin = number(parts.next())?;
        let xmax = number(parts.next())?;
        let rest = parts.next().ok_or_else(|| bad(text))?;
        let xip = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split(',')
                .map(|x| number(Some(x)))
                .collect::<Result<Vec<_>, _>>()?
        };
        let ordered = xip.windows(2).all(|w| w[0] <= w[1]);
        let bounded = xip.iter().all(|&x| xmin <= x && x < xmax);
        if xmin == 0 || xmin > xmax || !ordered || !bounded {
            return Err(bad(text));
        }
        Ok(Snapshot { xmin, xmax, xip })
    }

    /// Whether transaction `txid` had ended when the snapshot was taken
    /// (`pg_visible_in_snapshot`).
    pub fn sees(&self, txid: u64) -> bool {
        txid < self.xmin || (txid < self.xmax && self.xip.binary_search(&txid).is_err())
    }
}

/// How the events of a batch after a position are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchRead {
    /// As one range of the log: the events after `after` whose transaction is below `below`,
    /// leaving out those of `upto`'s running transactions when `exclude_running` (none of them
    /// is in the range otherwise).
    Range {
        after: Position,
        below: u64,
        exclude_running: bool,
    },
    /// A transaction `since` saw running, ended by `upto`, may still have events after the
    /// position: both parts of the batch are read (`outbox._snapshot_log`).
    BothParts,
}

/// How the rest of the batch from `since` to `upto` after `after` is read.
pub fn batch_read(since: &Snapshot, upto: &Snapshot, after: Position) -> BatchRead {
    let ended_since = since.xip.iter().any(|&x| x >= after.txid && upto.sees(x));
    if ended_since {
        return BatchRead::BothParts;
    }
    // Every event of a transaction at or after since's xmax has seq >= 1.
    let after = after.max(Position::at_horizon(since.xmax));
    BatchRead::Range {
        after,
        below: upto.xmax,
        exclude_running: upto.xip.iter().any(|&x| x >= after.txid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(text: &str) -> Snapshot {
        Snapshot::parse(text).unwrap()
    }

    /// The batch by definition: the transactions `upto` sees and `since` does not.
    fn in_batch(since: &Snapshot, upto: &Snapshot, txid: u64) -> bool {
        upto.sees(txid) && !since.sees(txid)
    }

    /// Whether `read` reads exactly the batch's events after `after`, for events of every
    /// transaction in 1..60 at seqs 1..3.
    fn reads_the_batch(since: &Snapshot, upto: &Snapshot, after: Position) -> bool {
        let read = batch_read(since, upto, after);
        (1..60u64).all(|txid| {
            (1..4i64).all(|seq| {
                let e = Position::new(txid, seq);
                let want = in_batch(since, upto, txid) && e > after;
                let got = match &read {
                    BatchRead::BothParts => want,
                    BatchRead::Range {
                        after: from,
                        below,
                        exclude_running,
                    } => {
                        e > *from
                            && txid < *below
                            && (!*exclude_running || !upto.xip.contains(&txid))
                    }
                };
                got == want
            })
        })
    }

    #[test]
    fn parses_what_postgres_prints() {
        assert_eq!(
            s("10:20:10,12,15"),
            Snapshot {
                xmin: 10,
                xmax: 20,
                xip: vec![10, 12, 15]
            }
        );
        assert_eq!(s("7:7:").xip, Vec::<u64>::new());
        for text in [
            "", "1", "1:2", "0:1:", "5:4:", "1:5:6", "1:5:3,2", "a:b:", "1:5:2,", "-1:5:", "1:5: 2",
        ] {
            assert_eq!(
                Snapshot::parse(text).map_err(|e| e.kind),
                Err(InvalidKind::Text),
                "{text:?}"
            );
        }
    }

    #[test]
    fn sees_as_pg_visible_in_snapshot() {
        let snap = s("10:20:10,12,15");
        let seen: Vec<u64> = (5..25).filter(|&x| snap.sees(x)).collect();
        assert_eq!(seen, vec![5, 6, 7, 8, 9, 11, 13, 14, 16, 17, 18, 19]);
    }

    #[test]
    fn a_batch_without_running_transactions_left_is_one_range() {
        let (since, upto) = (s("10:20:10,12,15"), s("30:40:33"));
        // Before the running ones that ended: both parts.
        assert_eq!(
            batch_read(&since, &upto, Position::ORIGIN),
            BatchRead::BothParts
        );
        assert_eq!(
            batch_read(&since, &upto, Position::new(15, 2)),
            BatchRead::BothParts
        );
        // Past all of them: the range from the cursor, or from since's xmax.
        assert_eq!(
            batch_read(&since, &upto, Position::new(16, 0)),
            BatchRead::Range {
                after: Position::new(20, 0),
                below: 40,
                exclude_running: true
            }
        );
        assert_eq!(
            batch_read(&since, &upto, Position::new(34, 1)),
            BatchRead::Range {
                after: Position::new(34, 1),
                below: 40,
                exclude_running: false
            }
        );
        // A running one that upto still sees running does not count (and is below the range).
        assert_eq!(
            batch_read(&s("10:20:12"), &s("12:40:12"), Position::ORIGIN),
            BatchRead::Range {
                after: Position::new(20, 0),
                below: 40,
                exclude_running: false
            }
        );
    }

    #[test]
    fn every_read_is_exactly_the_rest_of_its_batch() {
        // Snapshot pairs where upto sees everything since saw end, and more; cursors anywhere.
        let pairs = [
            ("1:1:", "5:5:"),
            ("3:8:3,5", "9:12:10"),
            ("3:8:3,5", "5:12:5,9,10"),
            ("10:20:10,12,15", "30:40:33"),
            ("10:20:10,12,15", "12:25:12,21,24"),
            ("2:30:2,3,4,5,29", "2:50:2,31,49"),
            ("20:20:", "20:20:"),
        ];
        for (since, upto) in pairs {
            let (since, upto) = (s(since), s(upto));
            for txid in 0..60 {
                for seq in 0..4 {
                    let after = Position::new(txid, seq);
                    assert!(
                        reads_the_batch(&since, &upto, after),
                        "{since:?} {upto:?} after {after}"
                    );
                }
            }
        }
    }
}
