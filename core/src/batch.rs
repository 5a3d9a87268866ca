//! The shape of a `raise_many` call: parallel arrays, each either one element (applies to every
//! event) or one per payload, or absent.

use crate::limits::RAISE_MANY_MAX;
use crate::{Invalid, InvalidKind};

/// One argument array of a batch: its name, and its length (None when the array is NULL).
pub struct Column<'a> {
    pub name: &'a str,
    pub len: Option<usize>,
    pub required: bool,
}

/// Returns how many events a batch raises, given its payload count and the other columns.
pub fn event_count(payloads: usize, columns: &[Column<'_>]) -> Result<usize, Invalid> {
    if payloads > RAISE_MANY_MAX {
        return Err(Invalid::new(
            InvalidKind::Parameter,
            format!("{payloads} events in one call, the limit is {RAISE_MANY_MAX}"),
        )
        .with_hint("split the batch into several calls in the same transaction"));
    }
    for c in columns {
        match c.len {
            None if c.required => return Err(Invalid::null(c.name)),
            None => {}
            Some(n) if n == payloads || (n == 1 && payloads > 0) => {}
            Some(n) => {
                return Err(Invalid::new(
                    InvalidKind::Parameter,
                    format!(
                        "{} has {n} elements but there are {payloads} payloads",
                        c.name
                    ),
                )
                .with_hint("each array has one element per payload, or a single element for all"))
            }
        }
    }
    Ok(payloads)
}

/// The index into a column for event `i`: a one-element column applies to every event.
pub fn pick(len: usize, i: usize) -> usize {
    if len == 1 {
        0
    } else {
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str, len: Option<usize>, required: bool) -> Column<'_> {
        Column {
            name,
            len,
            required,
        }
    }

    #[test]
    fn lengths() {
        assert_eq!(
            event_count(
                3,
                &[col("topics", Some(1), true), col("subjects", None, false)]
            )
            .unwrap(),
            3
        );
        assert_eq!(
            event_count(
                3,
                &[
                    col("topics", Some(3), true),
                    col("subjects", Some(3), false)
                ]
            )
            .unwrap(),
            3
        );
        assert_eq!(event_count(0, &[col("topics", Some(0), true)]).unwrap(), 0);
        let e = event_count(3, &[col("topics", Some(2), true)]).unwrap_err();
        assert_eq!(e.kind, InvalidKind::Parameter);
        assert!(e.message.contains("topics has 2 elements"));
        assert_eq!(
            event_count(3, &[col("topics", None, true)])
                .unwrap_err()
                .kind,
            InvalidKind::Null
        );
        assert_eq!(
            event_count(0, &[col("topics", Some(1), true)])
                .unwrap_err()
                .kind,
            InvalidKind::Parameter
        );
        assert!(event_count(RAISE_MANY_MAX + 1, &[]).is_err());
    }

    #[test]
    fn broadcast() {
        assert_eq!(pick(1, 7), 0);
        assert_eq!(pick(9, 7), 7);
    }
}
