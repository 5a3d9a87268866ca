//! The options `outbox.alter_sink(id, options jsonb)` changes on a sink after its creation, and
//! `outbox.alter_consumer(consumer, options jsonb)` on a pull consumer, and
//! `outbox.alter_subscription(name, options jsonb)` on a subscription.
//!
//! A jsonb object rather than one argument per option, so that a new option never changes the
//! function's signature (and with it every grant on it). Each key is checked here: an unknown key,
//! a value of the wrong type or an empty object is refused, never ignored.

use crate::{Invalid, InvalidKind};
use serde_json::Value;

/// What an `alter_sink` call changes; `None`: left as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinkOptions {
    /// Whether the sink's delivery transactions wait for their commit to be flushed (see
    /// `synchronous_commit` in the README): off trades a crash's last commits, delivered again
    /// after it, for fewer waits on the disk.
    pub synchronous_commit: Option<bool>,
    /// How the sink reads the log: by ticks (`true`, no long transaction holds it back) or by the
    /// read horizon (`false`).
    pub read_by_ticks: Option<bool>,
}

/// The options a sink takes, for messages.
pub const SINK_OPTIONS: &str = "synchronous_commit (boolean), read_by (\"ticks\" or \"horizon\")";

/// The options a pull consumer (and a subscription) takes, for messages.
pub const CONSUMER_OPTIONS: &str = "read_by (\"ticks\" or \"horizon\")";

/// Parses the options object of `alter_sink`.
pub fn parse(options: &Value) -> Result<SinkOptions, Invalid> {
    parse_for("sink", SINK_OPTIONS, options)
}

/// Parses the options object of `alter_consumer`: `read_by` only (a pull consumer commits its
/// own cursor moves, so `synchronous_commit` is its session's).
pub fn parse_consumer(options: &Value) -> Result<SinkOptions, Invalid> {
    parse_for("consumer", CONSUMER_OPTIONS, options)
}

/// Parses the options object of `alter_subscription`: `read_by` only.
pub fn parse_subscription(options: &Value) -> Result<SinkOptions, Invalid> {
    parse_for("subscription", CONSUMER_OPTIONS, options)
}

fn parse_for(what: &str, known: &str, options: &Value) -> Result<SinkOptions, Invalid> {
    let hint = || format!("the options of a {what}: {known}");
    let Value::Object(map) = options else {
        return Err(Invalid::new(
            InvalidKind::Parameter,
            format!("options must be a JSON object, not {}", kind(options)),
        )
        .with_hint(hint()));
    };
    if map.is_empty() {
        return Err(
            Invalid::new(InvalidKind::Parameter, "options name nothing to change")
                .with_hint(hint()),
        );
    }
    let mut parsed = SinkOptions::default();
    for (key, value) in map {
        match (key.as_str(), value) {
            ("synchronous_commit", Value::Bool(on)) if what == "sink" => {
                parsed.synchronous_commit = Some(*on)
            }
            ("synchronous_commit", other) if what == "sink" => {
                return Err(Invalid::new(
                    InvalidKind::Parameter,
                    format!(
                        "option synchronous_commit must be true or false, not {}",
                        kind(other)
                    ),
                ))
            }
            ("read_by", Value::String(how)) if how == "ticks" => parsed.read_by_ticks = Some(true),
            ("read_by", Value::String(how)) if how == "horizon" => {
                parsed.read_by_ticks = Some(false)
            }
            ("read_by", other) => {
                return Err(Invalid::new(
                    InvalidKind::Parameter,
                    format!(
                        "option read_by must be \"ticks\" or \"horizon\", not {}",
                        match other {
                            Value::String(s) => format!("\"{}\"", clip(s)),
                            other => kind(other).to_string(),
                        }
                    ),
                ))
            }
            (other, _) => {
                return Err(Invalid::new(
                    InvalidKind::Parameter,
                    format!("unknown {what} option \"{}\"", clip(other)),
                )
                .with_hint(hint()))
            }
        }
    }
    Ok(parsed)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A key as a message shows it: at most 64 characters.
fn clip(key: &str) -> String {
    match key.char_indices().nth(64) {
        Some((at, _)) => format!("{}...", &key[..at]),
        None => key.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn synchronous_commit_is_a_boolean() {
        assert_eq!(
            parse(&json!({"synchronous_commit": false})).unwrap(),
            SinkOptions {
                synchronous_commit: Some(false),
                read_by_ticks: None,
            }
        );
        assert_eq!(
            parse(&json!({"synchronous_commit": true}))
                .unwrap()
                .synchronous_commit,
            Some(true)
        );
        for bad in [json!("off"), json!(0), json!(null), json!([true])] {
            let e = parse(&json!({ "synchronous_commit": bad })).unwrap_err();
            assert_eq!(e.kind, InvalidKind::Parameter);
            assert!(e.message.contains("true or false"), "{}", e.message);
        }
    }

    #[test]
    fn a_consumer_takes_read_by_only() {
        assert_eq!(
            parse_consumer(&json!({"read_by": "ticks"})).unwrap(),
            SinkOptions {
                synchronous_commit: None,
                read_by_ticks: Some(true),
            }
        );
        let e = parse_consumer(&json!({"synchronous_commit": false})).unwrap_err();
        assert_eq!(e.kind, InvalidKind::Parameter);
        assert!(
            e.message
                .contains("unknown consumer option \"synchronous_commit\""),
            "{}",
            e.message
        );
        assert!(parse_consumer(&json!({})).is_err());
        assert!(parse_consumer(&json!({"read_by": "xmin"})).is_err());
    }

    #[test]
    fn read_by_is_ticks_or_horizon() {
        assert_eq!(
            parse(&json!({"read_by": "ticks"})).unwrap().read_by_ticks,
            Some(true)
        );
        assert_eq!(
            parse(&json!({"read_by": "horizon", "synchronous_commit": true})).unwrap(),
            SinkOptions {
                synchronous_commit: Some(true),
                read_by_ticks: Some(false),
            }
        );
        for bad in [json!("Ticks"), json!("xmin"), json!(true), json!(null)] {
            let e = parse(&json!({ "read_by": bad })).unwrap_err();
            assert_eq!(e.kind, InvalidKind::Parameter);
            assert!(
                e.message.contains("\"ticks\" or \"horizon\""),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn anything_else_is_refused() {
        for bad in [json!(null), json!([]), json!("x"), json!({})] {
            assert_eq!(parse(&bad).unwrap_err().kind, InvalidKind::Parameter);
        }
        let e = parse(&json!({"synchronous_commit": true, "batch": 3})).unwrap_err();
        assert_eq!(e.message, "unknown sink option \"batch\"");
        assert!(e.hint.unwrap().contains("synchronous_commit"));
        let long = "k".repeat(500);
        let e = parse(&json!({ long: 1 })).unwrap_err();
        assert!(e.message.len() < 100, "{}", e.message);
    }
}
