//! Names of consumers (and, later, sinks and subscriptions).

use crate::limits::{NAME_MAX_BYTES, SUBJECT_MAX_BYTES, TENANT_MAX_BYTES};
use crate::{Invalid, InvalidKind};

/// A consumer name: 1 to 63 bytes of letters, digits, `_`, `-` and `.`, starting with a letter or
/// digit. No quoting is ever needed to put one in a log line or a status row.
pub fn validate(what: &str, name: &str) -> Result<(), Invalid> {
    let refuse = |why: String| {
        Invalid::new(InvalidKind::Name, format!("invalid {what} name \"{}\": {why}", name.escape_debug()))
            .with_hint(format!(
                "a {what} name is 1 to {NAME_MAX_BYTES} letters, digits, '_', '-' or '.', starting with a letter or digit"
            ))
    };
    let first = name
        .bytes()
        .next()
        .ok_or_else(|| refuse("it is empty".into()))?;
    if name.len() > NAME_MAX_BYTES {
        return Err(refuse(format!(
            "{} bytes long, the limit is {NAME_MAX_BYTES}",
            name.len()
        )));
    }
    if !first.is_ascii_alphanumeric() {
        return Err(refuse("it must start with a letter or digit".into()));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(refuse(format!(
            "character '{}' is not allowed",
            c.escape_debug()
        )));
    }
    Ok(())
}

/// An optional free-text attribute of an event (subject, tenant): NULL means none, so an empty
/// string is refused rather than stored as a second spelling of "none".
fn attribute(what: &str, value: &str, max: usize) -> Result<(), Invalid> {
    if value.is_empty() {
        return Err(
            Invalid::new(InvalidKind::Parameter, format!("{what} must not be empty"))
                .with_hint(format!("pass NULL for an event without a {what}")),
        );
    }
    if value.len() > max {
        return Err(Invalid::new(
            InvalidKind::Parameter,
            format!("{what} is {} bytes long, the limit is {max}", value.len()),
        ));
    }
    Ok(())
}

pub fn validate_subject(subject: &str) -> Result<(), Invalid> {
    attribute("subject", subject, SUBJECT_MAX_BYTES)
}

pub fn validate_tenant(tenant: &str) -> Result<(), Invalid> {
    attribute("tenant", tenant, TENANT_MAX_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in [
            "billing",
            "a",
            "shop.orders-v2",
            "X_1",
            &"n".repeat(NAME_MAX_BYTES),
        ] {
            validate("consumer", ok).unwrap();
        }
        for bad in [
            "",
            "-a",
            ".a",
            "_a",
            "a b",
            "a\"b",
            "a;drop",
            "ä",
            &"n".repeat(NAME_MAX_BYTES + 1),
        ] {
            assert_eq!(
                validate("consumer", bad).unwrap_err().kind,
                InvalidKind::Name,
                "{bad:?}"
            );
        }
        assert!(validate("sink", "")
            .unwrap_err()
            .message
            .starts_with("invalid sink name"));
    }

    #[test]
    fn subject_and_tenant() {
        validate_subject("order/42").unwrap();
        validate_tenant("acme").unwrap();
        assert_eq!(
            validate_subject("").unwrap_err().kind,
            InvalidKind::Parameter
        );
        assert!(validate_tenant(&"t".repeat(TENANT_MAX_BYTES + 1)).is_err());
        assert!(validate_subject(&"s".repeat(SUBJECT_MAX_BYTES)).is_ok());
    }
}
