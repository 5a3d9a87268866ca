//! Sizes that bound user input. Each has a reason; changing one changes the documented API.

/// Topics are routing keys (`order.placed`), matched by patterns in every sink pass: long enough
/// for a namespace and a few levels, short enough to stay cheap to compare and to index.
pub const TOPIC_MAX_BYTES: usize = 255;

/// Consumer and sink names become parts of log lines and status rows; 63 is Postgres' own
/// identifier limit (NAMEDATALEN - 1), so a name can also serve as an identifier elsewhere.
pub const NAME_MAX_BYTES: usize = 63;

/// A subject names the entity an event is about (`order/42`, a URL, a key path).
pub const SUBJECT_MAX_BYTES: usize = 1024;

/// A tenant is an account or organisation key.
pub const TENANT_MAX_BYTES: usize = 255;

/// `outbox.read` materialises its result; a hundred thousand events is already far beyond what a
/// consumer should hold uncommitted, and keeps one call's memory bounded.
pub const READ_MAX: i32 = 100_000;

/// Upper bound of one pruning batch (the default is 10,000): one DELETE's locks and WAL stay short.
pub const PRUNE_BATCH_MAX: i32 = 1_000_000;

/// One `raise_many` call; beyond this, callers should split (a single statement's memory).
pub const RAISE_MANY_MAX: usize = 100_000;

/// Topic patterns of one sink or subscription. Every event of a pass is matched against each;
/// 100,000 patterns once made one fan-out window take 24 s, and 20,000 made a sink's regular
/// expression too complex for PostgreSQL to compile. A few dozen cover any real routing table.
pub const PATTERNS_MAX: usize = 64;

/// The patterns' total length, for the same reason: it bounds the matching work per event.
pub const PATTERNS_MAX_BYTES: usize = 4096;
