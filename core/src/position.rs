//! Positions in the log: the pair `(txid, seq)`, written `<txid>:<seq>`.
//!
//! `txid` is the full 64-bit transaction id (`xid8`) of the transaction that raised the event and
//! `seq` a number drawn at insert. Ordering is by the pair, never by the text: `'10:1' < '9:1'` as
//! text, which is exactly the bug the field keeps shipping.

use crate::{Invalid, InvalidKind};
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Position {
    pub txid: u64,
    pub seq: i64,
}

impl Position {
    /// Before every event: a cursor here has consumed nothing.
    pub const ORIGIN: Position = Position { txid: 0, seq: 0 };

    pub fn new(txid: u64, seq: i64) -> Self {
        Position { txid, seq }
    }

    /// The first position a consumer starting "now" may still be handed: every event of a
    /// transaction at or beyond `horizon` (the oldest transaction still running) has seq >= 1.
    pub fn at_horizon(horizon: u64) -> Self {
        Position {
            txid: horizon,
            seq: 0,
        }
    }

    /// True when a reader could have been handed this position: its transaction is older than
    /// the horizon, so it has ended (and if it committed, its events are readable).
    pub fn is_below(&self, horizon: u64) -> bool {
        self.txid < horizon
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.txid, self.seq)
    }
}

impl FromStr for Position {
    type Err = Invalid;

    fn from_str(text: &str) -> Result<Self, Invalid> {
        let malformed = || {
            Invalid::new(
                InvalidKind::Text,
                format!("malformed position \"{}\"", text.escape_debug()),
            )
            .with_hint(
                "a position is written <txid>:<seq>, two non-negative integers, e.g. 7421:17",
            )
        };
        let (txid, seq) = text.split_once(':').ok_or_else(malformed)?;
        // Digits only, no leading zeros: no signs, spaces or exponents, so that one position has
        // one spelling.
        let digits = |s: &str| {
            !s.is_empty()
                && s.len() <= 20
                && s.bytes().all(|b| b.is_ascii_digit())
                && (s == "0" || !s.starts_with('0'))
        };
        if !digits(txid) || !digits(seq) {
            return Err(malformed());
        }
        let txid = txid.parse::<u64>().map_err(|_| malformed())?;
        let seq = seq.parse::<i64>().map_err(|_| malformed())?;
        Ok(Position { txid, seq })
    }
}

/// Where a new consumer starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAt {
    /// Everything the log still holds.
    Origin,
    /// Only transactions that were not yet readable when the consumer was created.
    Now,
    /// Just after an explicit position.
    After(Position),
}

impl FromStr for StartAt {
    type Err = Invalid;

    fn from_str(text: &str) -> Result<Self, Invalid> {
        match text {
            "origin" => Ok(StartAt::Origin),
            "now" => Ok(StartAt::Now),
            // Something that looks like a position is parsed as one, with its own error.
            other if other.contains(':') => other.parse::<Position>().map(StartAt::After),
            other => other.parse::<Position>().map(StartAt::After).map_err(|_| {
                Invalid::new(
                    InvalidKind::Parameter,
                    format!("invalid start_at \"{}\"", other.escape_debug()),
                )
                .with_hint("start_at is 'origin', 'now' or a position <txid>:<seq>")
            }),
        }
    }
}

impl StartAt {
    /// The cursor a consumer gets, given the read horizon at creation.
    pub fn cursor(self, horizon: u64) -> Position {
        match self {
            StartAt::Origin => Position::ORIGIN,
            StartAt::Now => Position::at_horizon(horizon),
            StartAt::After(p) => p,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_round_trip() {
        for text in ["0:0", "7421:17", "18446744073709551615:9223372036854775807"] {
            assert_eq!(text.parse::<Position>().unwrap().to_string(), text);
        }
    }

    #[test]
    fn refuses_malformed_text() {
        for bad in [
            "",
            ":",
            "1",
            "1:",
            ":1",
            "1:2:3",
            "-1:2",
            "1:-2",
            "+1:2",
            " 1:2",
            "1:2 ",
            "1.5:2",
            "a:b",
            "18446744073709551616:1",
            "1:9223372036854775808",
            "1e3:1",
            "１:2",
            "007:1",
            "1:00",
        ] {
            let err = bad.parse::<Position>().unwrap_err();
            assert_eq!(err.kind, InvalidKind::Text, "{bad:?}");
            assert!(err.hint.is_some());
        }
    }

    #[test]
    fn orders_by_pair_not_text() {
        let p = |s: &str| s.parse::<Position>().unwrap();
        assert!(p("9:1") < p("10:1"), "txid compares as a number");
        assert!("10:1" < "9:1", "while text compares the other way");
        assert!(p("10:2") < p("10:10"));
        assert!(p("10:99") < p("11:1"), "txid first, then seq");
    }

    #[test]
    fn horizon_bounds_what_a_reader_can_have_seen() {
        assert!(Position::new(99, 5).is_below(100));
        assert!(!Position::new(100, 0).is_below(100));
        assert!(Position::at_horizon(100) > Position::new(99, i64::MAX));
        assert!(Position::at_horizon(100) < Position::new(100, 1));
    }

    #[test]
    fn start_at_parses_words_and_positions() {
        assert_eq!("origin".parse::<StartAt>().unwrap(), StartAt::Origin);
        assert_eq!("now".parse::<StartAt>().unwrap(), StartAt::Now);
        assert_eq!(
            "5:6".parse::<StartAt>().unwrap(),
            StartAt::After(Position::new(5, 6))
        );
        assert_eq!(
            "Origin".parse::<StartAt>().unwrap_err().kind,
            InvalidKind::Parameter
        );
        assert_eq!(
            "".parse::<StartAt>().unwrap_err().kind,
            InvalidKind::Parameter
        );
        assert_eq!(
            "5:x".parse::<StartAt>().unwrap_err().kind,
            InvalidKind::Text
        );
        assert_eq!(StartAt::Origin.cursor(50), Position::ORIGIN);
        assert_eq!(StartAt::Now.cursor(50), Position::new(50, 0));
    }
}
