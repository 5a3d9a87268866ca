//! Every error pg_outbox raises, each with its SQLSTATE.
//!
//! Returning a Rust error type from a `#[pg_extern]` comes out as a bare 22000 with no hint; every
//! refusal here goes through `Error::report` instead, so a client can branch on the code.

use pg_outbox_core::{Invalid, InvalidKind, Position};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

#[derive(Debug)]
pub enum Error {
    /// Bad input caught by the pure core.
    Invalid(Invalid),
    UnknownConsumer(String),
    ConsumerExists(String),
    /// The caller is not a member of the role that owns the consumer.
    NotOwner {
        consumer: String,
        action: &'static str,
    },
    /// A position no reader can have been handed yet: its transaction may still be running.
    BeyondHorizon {
        position: Position,
        horizon: u64,
    },
    /// The installed SQL objects are missing (extension dropped, or a half-installed schema).
    NotInstalled,
}

impl From<Invalid> for Error {
    fn from(e: Invalid) -> Self {
        Error::Invalid(e)
    }
}

impl Error {
    pub fn sqlstate(&self) -> PgSqlErrorCode {
        use PgSqlErrorCode::*;
        match self {
            Error::Invalid(e) => match e.kind {
                InvalidKind::Null => ERRCODE_NULL_VALUE_NOT_ALLOWED,
                InvalidKind::Parameter => ERRCODE_INVALID_PARAMETER_VALUE,
                InvalidKind::Text => ERRCODE_INVALID_TEXT_REPRESENTATION,
                InvalidKind::Name => ERRCODE_INVALID_NAME,
            },
            Error::UnknownConsumer(_) => ERRCODE_UNDEFINED_OBJECT,
            Error::ConsumerExists(_) => ERRCODE_DUPLICATE_OBJECT,
            Error::NotOwner { .. } => ERRCODE_INSUFFICIENT_PRIVILEGE,
            Error::BeyondHorizon { .. } => ERRCODE_INVALID_PARAMETER_VALUE,
            Error::NotInstalled => ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        }
    }

    fn message(&self) -> String {
        match self {
            Error::Invalid(e) => e.message.clone(),
            Error::UnknownConsumer(name) => format!("consumer \"{name}\" does not exist"),
            Error::ConsumerExists(name) => format!("consumer \"{name}\" already exists"),
            Error::NotOwner { consumer, action } => {
                format!("permission denied to {action} consumer \"{consumer}\"")
            }
            Error::BeyondHorizon { position, .. } => {
                format!("position {position} is beyond the read horizon")
            }
            Error::NotInstalled => "pg_outbox is not installed in this database".into(),
        }
    }

    fn detail(&self) -> Option<String> {
        match self {
            Error::BeyondHorizon { horizon, .. } => Some(format!(
                "Transaction {horizon} and later ones may still be running, so no reader has been handed events from them."
            )),
            _ => None,
        }
    }

    fn hint(&self) -> Option<String> {
        match self {
            Error::Invalid(e) => e.hint.clone(),
            Error::UnknownConsumer(_) => Some("create it with outbox.create_consumer()".into()),
            Error::NotOwner { .. } => {
                Some("only members of the role that created the consumer may change it".into())
            }
            Error::BeyondHorizon { .. } => {
                Some("advance only to positions that outbox.read() returned".into())
            }
            Error::NotInstalled => Some("run CREATE EXTENSION pg_outbox".into()),
            _ => None,
        }
    }

    /// Raises the error in the current backend; never returns.
    #[track_caller]
    pub fn report(self) -> ! {
        let mut report = ErrorReport::new(self.sqlstate(), self.message(), "pg_outbox");
        if let Some(detail) = self.detail() {
            report = report.set_detail(detail);
        }
        if let Some(hint) = self.hint() {
            report = report.set_hint(hint);
        }
        report.report(PgLogLevel::ERROR);
        unreachable!("ereport(ERROR) returned")
    }
}

/// `result.or_report()`: the value, or the error raised with its SQLSTATE.
pub trait OrReport<T> {
    fn or_report(self) -> T;
}

impl<T, E: Into<Error>> OrReport<T> for Result<T, E> {
    #[track_caller]
    fn or_report(self) -> T {
        match self {
            Ok(v) => v,
            Err(e) => e.into().report(),
        }
    }
}
