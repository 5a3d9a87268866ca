//! Topic names: dot-separated segments such as `order.placed` or `billing.invoice-paid.v2`.
//!
//! `*` and `#` are kept out of topics because sink and subscription patterns use them as
//! wildcards; spaces, slashes and quotes are kept out so a topic is safe in logs, URLs and headers.

use crate::limits::TOPIC_MAX_BYTES;
use crate::{Invalid, InvalidKind};

fn segment_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// Accepts a topic or says why not.
pub fn validate(topic: &str) -> Result<(), Invalid> {
    let refuse = |why: &str| {
        Invalid::new(
            InvalidKind::Parameter,
            format!("invalid topic \"{}\": {why}", topic.escape_debug()),
        )
        .with_hint(
            "a topic is dot-separated segments of letters, digits, '_' and '-', e.g. order.placed",
        )
    };
    if topic.is_empty() {
        return Err(refuse("it is empty"));
    }
    if topic.len() > TOPIC_MAX_BYTES {
        return Err(Invalid::new(
            InvalidKind::Parameter,
            format!(
                "invalid topic: {} bytes long, the limit is {TOPIC_MAX_BYTES}",
                topic.len()
            ),
        ));
    }
    for segment in topic.split('.') {
        if segment.is_empty() {
            return Err(refuse("it has an empty segment"));
        }
        if let Some(c) = segment
            .chars()
            .find(|c| !c.is_ascii() || !segment_char(*c as u8))
        {
            return Err(refuse(&format!(
                "character '{}' is not allowed",
                c.escape_debug()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_topics() {
        for t in [
            "order.placed",
            "a",
            "billing.invoice-paid.v2",
            "User_Created",
            "x.1.2.3",
        ] {
            validate(t).unwrap();
        }
        validate(&"a".repeat(TOPIC_MAX_BYTES)).unwrap();
    }

    #[test]
    fn refuses_bad_topics() {
        for t in [
            "",
            ".",
            "order.",
            ".order",
            "order..placed",
            "order placed",
            "order.*",
            "#",
            "order/42",
            "ordér",
            "a'b",
            "a;b",
            "a\nb",
            "a\0b",
        ] {
            let err = validate(t).unwrap_err();
            assert_eq!(err.kind, InvalidKind::Parameter, "{t:?}");
        }
        assert!(validate(&"a".repeat(TOPIC_MAX_BYTES + 1))
            .unwrap_err()
            .message
            .contains("limit"));
    }
}
