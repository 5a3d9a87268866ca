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
    /// No consumer of that name; `what` is how the caller called it (consumer, sink,
    /// subscription).
    UnknownConsumer {
        what: &'static str,
        name: String,
    },
    ConsumerExists(String),
    /// The caller is not a member of the role that owns the consumer.
    NotOwner {
        what: &'static str,
        consumer: String,
        action: &'static str,
    },
    /// A position no reader can have been handed yet: its transaction may still be running.
    BeyondHorizon {
        position: Position,
        horizon: u64,
    },
    /// A position no reader by ticks can have been handed yet: no tick sees its transaction ended.
    NotInBatch {
        position: Position,
    },
    /// The installed SQL objects are missing (extension dropped, or a half-installed schema).
    NotInstalled,
    /// A feature that needs the background workers, without pg_outbox preloaded.
    NotPreloaded,
    /// outbox.lineage names two logs that both made positions: events were raised in this
    /// database before the dump being restored into it was in (src/lineage.rs).
    LineageConflict,
    /// A pull-consumer operation on a sink (or the other way round).
    NotPull {
        name: String,
        kind: String,
    },
    NotASink(String),
    NotASubscription(String),
    /// The caller may not write what a schedule would write (raise, or enqueue).
    ScheduleDenied(&'static str),
    NotScheduleOwner(String),
    /// An each query that is not one query (why says what it is instead).
    BadEach(String),
    /// An each function name that names no function of no arguments.
    UnknownEachFunction(String),
    NoDeadLetter {
        sink: String,
        position: Position,
    },
    /// A handler whose signature is not `(outbox.event[])`.
    BadHandler {
        handler: String,
        why: String,
    },
    /// A handler oid that names no function.
    UnknownHandler(u32),
    /// The caller may not execute the handler it registers.
    HandlerNotExecutable(String),
    /// An operation that needs READ COMMITTED (fresh snapshots per statement): what, and why.
    Isolation {
        what: &'static str,
        why: &'static str,
    },
    /// A way of reading the log a sink or consumer cannot take (`alter_sink`'s, `alter_consumer`'s
    /// read_by).
    ReadBy {
        what: &'static str,
        name: String,
        why: &'static str,
    },
    /// An event's payload and headers over `pg_outbox.max_event_size`; `what` names the argument.
    EventTooLarge {
        what: String,
        size: u64,
        max: u64,
    },
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
            Error::UnknownConsumer { .. } => ERRCODE_UNDEFINED_OBJECT,
            Error::ConsumerExists(_) => ERRCODE_DUPLICATE_OBJECT,
            Error::NotOwner { .. } | Error::ScheduleDenied(_) | Error::NotScheduleOwner(_) => {
                ERRCODE_INSUFFICIENT_PRIVILEGE
            }
            Error::BeyondHorizon { .. } | Error::NotInBatch { .. } => {
                ERRCODE_INVALID_PARAMETER_VALUE
            }
            Error::NotInstalled => ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            Error::NotPreloaded => ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            Error::LineageConflict => ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            Error::NotPull { .. } => ERRCODE_WRONG_OBJECT_TYPE,
            Error::NotASink(_) | Error::NotASubscription(_) => ERRCODE_WRONG_OBJECT_TYPE,
            Error::NoDeadLetter { .. } => ERRCODE_UNDEFINED_OBJECT,
            Error::BadEach(_) => ERRCODE_INVALID_PARAMETER_VALUE,
            Error::UnknownEachFunction(_) => ERRCODE_UNDEFINED_FUNCTION,
            Error::BadHandler { .. } => ERRCODE_INVALID_FUNCTION_DEFINITION,
            Error::UnknownHandler(_) => ERRCODE_UNDEFINED_FUNCTION,
            Error::HandlerNotExecutable(_) => ERRCODE_INSUFFICIENT_PRIVILEGE,
            Error::Isolation { .. } => ERRCODE_ACTIVE_SQL_TRANSACTION,
            Error::EventTooLarge { .. } => ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            Error::ReadBy { .. } => ERRCODE_FEATURE_NOT_SUPPORTED,
        }
    }

    fn message(&self) -> String {
        match self {
            Error::Invalid(e) => e.message.clone(),
            Error::UnknownConsumer { what, name } => format!("{what} \"{name}\" does not exist"),
            Error::ConsumerExists(name) => format!("consumer \"{name}\" already exists"),
            Error::NotOwner {
                what,
                consumer,
                action,
            } => {
                format!("permission denied to {action} {what} \"{consumer}\"")
            }
            Error::BeyondHorizon { position, .. } => {
                format!("position {position} is beyond the read horizon")
            }
            Error::NotInBatch { position } => {
                format!("position {position} is in no batch yet")
            }
            Error::NotInstalled => "pg_outbox is not installed in this database".into(),
            Error::NotPreloaded => {
                "pg_outbox is not preloaded: its background workers are not running".into()
            }
            Error::LineageConflict => {
                "this database holds a log restored from another database and events raised here before the restore was complete: their order is not known".into()
            }
            Error::NotPull { name, kind } => format!("\"{name}\" is a {kind}, not a pull consumer"),
            Error::NotASink(name) => format!("\"{name}\" is not a sink"),
            Error::NotASubscription(name) => format!("\"{name}\" is not a subscription"),
            Error::ScheduleDenied(function) => {
                format!("permission denied to schedule runs of {function}")
            }
            Error::NotScheduleOwner(name) => {
                format!("permission denied to drop schedule \"{name}\"")
            }
            Error::NoDeadLetter { sink, position } => {
                format!("sink \"{sink}\" has no dead letter at position {position}")
            }
            Error::BadEach(why) => format!("each must be one query: {why}"),
            Error::UnknownEachFunction(name) => {
                format!("each names function {name}, which does not exist or needs arguments")
            }
            Error::BadHandler { handler, why } => format!("handler {handler} {why}"),
            Error::UnknownHandler(oid) => format!("handler {oid} does not exist"),
            Error::HandlerNotExecutable(handler) => {
                format!("permission denied to register handler {handler}")
            }
            Error::Isolation { what, .. } => {
                format!("{what} must run in a READ COMMITTED transaction")
            }
            Error::EventTooLarge { what, size, max } => {
                format!("{what} of an event must be at most {max} bytes together, not {size}")
            }
            Error::ReadBy { what, name, why } => format!("{what} \"{name}\" {why}"),
        }
    }

    fn detail(&self) -> Option<String> {
        match self {
            Error::BeyondHorizon { horizon, .. } => Some(format!(
                "Transaction {horizon} and later ones may still be running, so no reader has been handed events from them."
            )),
            Error::NotInBatch { position } => Some(format!(
                "No tick has seen transaction {} end yet, so no reader by ticks has been handed its events.",
                position.txid
            )),
            _ => None,
        }
    }

    fn hint(&self) -> Option<String> {
        match self {
            Error::Invalid(e) => e.hint.clone(),
            Error::UnknownConsumer { what, .. } => Some(match *what {
                "sink" => "create it with outbox.create_sink() or outbox.create_http_sink()".into(),
                "subscription" => "create it with outbox.subscribe()".into(),
                _ => "create it with outbox.create_consumer()".into(),
            }),
            Error::ScheduleDenied(_) => Some(
                "a schedule writes as the extension's owner: the scheduling role needs EXECUTE on what its runs call".into(),
            ),
            Error::NotScheduleOwner(_) => {
                Some("only members of the role that created the schedule may drop it".into())
            }
            Error::BadEach(_) | Error::UnknownEachFunction(_) => Some(
                "each is one query (SELECT ..., VALUES ... or WITH ... SELECT ...) or the name of a function called with no arguments; each row it returns is a job's payload".into(),
            ),
            Error::NotOwner { what, .. } => Some(format!(
                "only members of the role that created the {what} may change it"
            )),
            Error::BeyondHorizon { .. } | Error::NotInBatch { .. } => {
                Some("advance only to positions that outbox.read() returned".into())
            }
            Error::NotInstalled => Some("run CREATE EXTENSION pg_outbox".into()),
            Error::LineageConflict => Some(
                "restore into a database where nothing is raised until the restore is complete; to deliver on in the order the log holds, a superuser may delete every row of outbox.lineage but one".into(),
            ),
            Error::NotPreloaded => Some(
                "add pg_outbox to shared_preload_libraries in postgresql.conf and restart the server".into(),
            ),
            Error::NotPull { kind, .. } if kind == "sink" => {
                Some("a sink's cursor moves with its deliveries; use outbox.drop_sink() or outbox.rewind()".into())
            }
            Error::NotASink(_) | Error::NotASubscription(_) => {
                Some("it is a consumer of another kind: outbox.status() shows each one's kind".into())
            }
            Error::BadHandler { .. } => Some(
                "a sink handler takes one argument of type outbox.event[] (raising an error fails the batch); a subscription handler takes one outbox.event (raising an error fails the job)".into(),
            ),
            Error::HandlerNotExecutable(_) => {
                Some("the registering role needs EXECUTE on the handler; the handler runs as that role".into())
            }
            Error::Isolation { why, .. } => Some(why.to_string()),
            Error::EventTooLarge { .. } => Some(
                "pg_outbox.max_event_size (superuser) sets the limit; store large documents in a table and put their key in the event".into(),
            ),
            Error::ReadBy { what: "sink", .. } => Some(
                "a sink reads by ticks (read_by \"ticks\") or by the read horizon (\"horizon\", the default); one that reads by ticks goes on doing so".into(),
            ),
            Error::ReadBy {
                what: "subscription",
                ..
            } => Some(
                "a subscription reads by ticks (read_by \"ticks\") or by the read horizon (\"horizon\", the default); one that reads by ticks goes on doing so".into(),
            ),
            Error::ReadBy { .. } => Some(
                "a pull consumer reads by ticks (read_by \"ticks\") or by the read horizon (\"horizon\", the default); one that reads by ticks goes on doing so".into(),
            ),
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
