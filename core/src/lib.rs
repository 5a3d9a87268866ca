//! The database-free core of pg_outbox.
//!
//! Everything here is plain Rust: positions, names, topics, batch shapes and limits. The
//! extension (`src/`) is a thin shell that calls into this crate, so plain `#[test]`s and the
//! benches reach the rules without a server.

pub mod batch;
pub mod budget;
pub mod filter;
pub mod http;
pub mod id;
pub mod kafka;
pub mod limits;
pub mod name;
pub mod options;
pub mod pattern;
pub mod policy;
pub mod position;
pub mod rotation;
pub mod snapshot;
pub mod topic;

pub use position::{Position, StartAt};

/// A refusal of bad input, with the SQLSTATE the extension reports it under.
///
/// The core does not know about pgrx; it names the condition, and `src/error.rs` maps the
/// condition to Postgres' error codes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub kind: InvalidKind,
    pub message: String,
    pub hint: Option<String>,
}

/// Which class of bad input, chosen to match Postgres' own SQLSTATEs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvalidKind {
    /// 22004 null_value_not_allowed: a required argument was NULL.
    Null,
    /// 22023 invalid_parameter_value: a value of the right type but outside what is allowed.
    Parameter,
    /// 22P02 invalid_text_representation: text that does not parse (a position, say).
    Text,
    /// 42602 invalid_name: a consumer or sink name with bad characters or length.
    Name,
}

impl Invalid {
    pub fn new(kind: InvalidKind, message: impl Into<String>) -> Self {
        Invalid {
            kind,
            message: message.into(),
            hint: None,
        }
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// A required argument was NULL.
    pub fn null(argument: &str) -> Self {
        Invalid::new(InvalidKind::Null, format!("{argument} must not be NULL"))
    }
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Invalid {}

/// Unwraps a required argument or refuses it as NULL.
pub fn required<T>(value: Option<T>, argument: &str) -> Result<T, Invalid> {
    value.ok_or_else(|| Invalid::null(argument))
}
