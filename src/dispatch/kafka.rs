//! Kafka sinks: the producer (librdkafka, through rdkafka-sys) and how one window of events
//! becomes Kafka messages and an `Outcome` for the failure policy that every remote sink shares
//! (`dispatch::http`: lease, halving, the neighbour test, dead letters, replay).
//!
//! Threads and safety. A window is sent on a thread of its own (with every signal blocked, as
//! HTTP requests are): it produces the messages and polls the producer until every message is
//! acknowledged or fails, and never touches PostgreSQL. librdkafka's own threads are created
//! with every signal blocked too, so the worker's signal handlers only ever run on its thread.
//! Every connection the producer opens, to a bootstrap broker or to a broker the cluster's
//! metadata names, goes through `on_connect`, which refuses the addresses Kafka sinks may not
//! reach (`pg_outbox_core::kafka::check_address`) before any byte is sent.
//!
//! Messages follow the CloudEvents Kafka protocol binding in binary mode: the value is the
//! event's payload (its JSON text as PostgreSQL prints it), the attributes are `ce_*` headers
//! (`ce_specversion`, `ce_id`, `ce_source`, `ce_type` = the topic, `ce_time`, `ce_subject`, and the
//! extensions `ce_position`, `ce_tenant`, `ce_traceparent`, `ce_tracestate`), `content-type` is
//! `application/json`, and the event's own headers go along under their names. The key is the
//! event's subject (or tenant, or none): one key's messages land in one partition, in order.

use pg_outbox_core::http::Outcome;
use pg_outbox_core::kafka::{self as rules, Key, TopicTemplate};
use rdkafka_sys::bindings as rd;
use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

// librdkafka's error codes, read as the C ints they are: a broker may send a code that
// rdkafka-sys's Rust enum does not name, and such a value in that enum is undefined behaviour.
extern "C" {
    #[link_name = "rd_kafka_err2str"]
    fn err2str(err: c_int) -> *const c_char;
    #[link_name = "rd_kafka_error_code"]
    fn error_code(error: *const rd::rd_kafka_error_t) -> c_int;
    #[link_name = "rd_kafka_fatal_error"]
    fn fatal_error(rk: *mut rd::rd_kafka_t, text: *mut c_char, size: usize) -> c_int;
    #[link_name = "rd_kafka_last_error"]
    fn last_error() -> c_int;
}

use rd::rd_kafka_resp_err_t as E;

/// Errors that are about the message, not the brokers: no retry can make them pass.
const PERMANENT: [c_int; 10] = [
    E::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE as c_int,
    E::RD_KAFKA_RESP_ERR_RECORD_LIST_TOO_LARGE as c_int,
    E::RD_KAFKA_RESP_ERR_INVALID_RECORD as c_int,
    E::RD_KAFKA_RESP_ERR_INVALID_MSG as c_int,
    E::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED as c_int,
    E::RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION as c_int,
    E::RD_KAFKA_RESP_ERR_POLICY_VIOLATION as c_int,
    E::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART as c_int,
    E::RD_KAFKA_RESP_ERR__UNKNOWN_TOPIC as c_int,
    E::RD_KAFKA_RESP_ERR__INVALID_ARG as c_int,
];
const NO_ERROR: c_int = E::RD_KAFKA_RESP_ERR_NO_ERROR as c_int;
const QUEUE_FULL: c_int = E::RD_KAFKA_RESP_ERR__QUEUE_FULL as c_int;
const CRIT_SYS_RESOURCE: c_int = E::RD_KAFKA_RESP_ERR__CRIT_SYS_RESOURCE as c_int;

fn permanent(err: c_int) -> bool {
    PERMANENT.contains(&err)
}

/// What the callbacks share with the threads that produce and poll.
struct Context {
    allow: rules::Allow,
    /// `pg_outbox.kafka_allowed_brokers` when the producer was made: checked for every broker it
    /// connects to, those the cluster's metadata names too.
    allowed_brokers: String,
    /// Delivery reports not yet taken, and the windows' threads waiting for theirs.
    reports: Mutex<Reports>,
    /// A thread is in `rd_kafka_poll` (delivery callbacks run there): the others wait meanwhile,
    /// parked (see `Producer::poll`).
    polling: std::sync::atomic::AtomicBool,
    /// The last connection `on_connect` refused, and why.
    refused: Mutex<Option<String>>,
}

/// Delivery reports by window. Several windows of one sink fly at once, each waited for on a
/// thread of its own, while one of them polls for all.
#[derive(Default)]
struct Reports {
    /// By window ticket: (message index, error), not yet taken.
    taken: HashMap<u32, Vec<(usize, c_int)>>,
    /// The threads parked while another polls, by the ticket each waits for. Each is woken when
    /// reports for its window came in, or to poll in turn: never all of them for every report (a
    /// window of 128 messages would wake every other window's thread 128 times).
    waiting: Vec<(u32, std::thread::Thread)>,
}

/// A librdkafka producer, shared by the worker (which keeps it between windows) and the thread
/// sending a window. Thread-safe, as librdkafka's handles are.
pub struct Producer {
    rk: *mut rd::rd_kafka_t,
    context: *const Context,
    /// Windows given a ticket so far: a window's messages carry its number, so that its reports
    /// go to it (and late reports of an earlier window that timed out are not taken for its).
    windows: AtomicU32,
    /// The last ticket whose messages are all produced (or that gave up its turn): windows produce
    /// in the order of their tickets, each after the one before, so that a key's events reach its
    /// partition in the order of the log while several windows fly.
    produced: Mutex<u32>,
    turn: Condvar,
    /// A window failed on it: it is not used again (see `send`).
    retired: std::sync::atomic::AtomicBool,
    /// When it was made, and whether the broker has acknowledged a message of it: see `warm`.
    born: Instant,
    acknowledged: std::sync::atomic::AtomicBool,
    /// Set once it is destroyed, every message it held gone (see `destroyed`).
    destroyed: Arc<std::sync::atomic::AtomicBool>,
}

/// How long an idempotent producer takes, at most, to be ready to send: librdkafka asks the broker
/// for its producer id on a timer (0.5 to 1.1 s measured on loopback), and holds every message
/// until it has one.
pub const WARM_AFTER: Duration = Duration::from_millis(1500);

// SAFETY: rd_kafka_t is thread-safe (librdkafka's documented contract for producers), and the
// context is only reached through its Mutexes.
unsafe impl Send for Producer {}
// SAFETY: as above.
unsafe impl Sync for Producer {}

fn err_text(err: c_int) -> String {
    // SAFETY: rd_kafka_err2str returns a static string for every code, known or not.
    unsafe { CStr::from_ptr(err2str(err)) }
        .to_string_lossy()
        .into_owned()
}

/// librdkafka's log: dropped. By default it writes to the server's stderr, outside the log's
/// format and rate, with text that brokers (and client.id) choose. Failures reach the sink's
/// status through the delivery reports.
unsafe extern "C" fn on_log(
    _rk: *const rd::rd_kafka_t,
    _level: c_int,
    _facility: *const c_char,
    _text: *const c_char,
) {
}

/// Delivery report callback: runs on the thread that polls (a window's thread).
unsafe extern "C" fn on_delivery(
    _rk: *mut rd::rd_kafka_t,
    message: *const rd::rd_kafka_message_t,
    opaque: *mut c_void,
) {
    // SAFETY: opaque is the Context the producer was created with, alive while it is; message is
    // valid for the callback's duration; its error is read as the C int it is.
    let (context, opaque, err) = unsafe {
        (
            &*(opaque as *const Context),
            (*message)._private as usize,
            std::ptr::addr_of!((*message).err).cast::<c_int>().read(),
        )
    };
    // The thread that polls wakes the windows' threads once the poll is over.
    if let Ok(mut reports) = context.reports.lock() {
        reports
            .taken
            .entry((opaque >> 32) as u32)
            .or_default()
            .push((opaque & 0xffff_ffff, err));
    }
}

/// Connect callback: runs on librdkafka's broker threads, for every connection it opens. Refuses
/// the addresses Kafka sinks may not reach; connects the others as librdkafka would.
unsafe extern "C" fn on_connect(
    socket: c_int,
    address: *const libc::sockaddr,
    length: c_int,
    id: *const c_char,
    opaque: *mut c_void,
) -> c_int {
    // SAFETY: opaque is the Context; address points to `length` bytes of a socket address; id is
    // the broker's "host:port", a C string, or NULL.
    let context = unsafe { &*(opaque as *const Context) };
    let ip = unsafe { socket_ip(address, length) };
    let host = (!id.is_null())
        .then(|| unsafe { CStr::from_ptr(id) }.to_string_lossy().into_owned())
        .map(|id| broker_host(&id).to_string());
    // The reasons name no address: a tenant chooses the names, and the server's resolver must
    // not become its map of the internal network.
    let verdict = match (ip, host) {
        (_, Some(host)) if !pg_outbox_core::http::host_allowed(&host, &context.allowed_brokers) => {
            Err(format!(
                "the cluster named broker \"{host}\", which is not in pg_outbox.kafka_allowed_brokers"
            ))
        }
        (Some(ip), _) => match pg_outbox_core::http::reach(ip) {
            pg_outbox_core::http::Reach::Global => Ok(()),
            pg_outbox_core::http::Reach::Private if context.allow.private_addresses => Ok(()),
            pg_outbox_core::http::Reach::Private => Err(
                "a broker's address is internal, and pg_outbox.kafka_allow_private is off".to_string(),
            ),
            pg_outbox_core::http::Reach::Never => Err(
                "a broker's address is link-local, metadata or otherwise never allowed".to_string(),
            ),
        },
        (None, _) => Err("a broker address that is neither IPv4 nor IPv6".to_string()),
    };
    if let Err(why) = verdict {
        if let Ok(mut refused) = context.refused.lock() {
            *refused = Some(why);
        }
        return libc::ECONNREFUSED;
    }
    // SAFETY: the socket and address librdkafka gave us; a non-blocking connect, as its own.
    let r = unsafe { libc::connect(socket, address, length as libc::socklen_t) };
    if r == -1 {
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINPROGRESS {
            return errno;
        }
    }
    0
}

/// The host of a broker's `host:port` (`[v6]:port` too).
fn broker_host(id: &str) -> &str {
    let host = id.rsplit_once(':').map_or(id, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// The IP address of a socket address, if it is one.
///
/// # Safety
/// `address` points to `length` readable bytes.
unsafe fn socket_ip(address: *const libc::sockaddr, length: c_int) -> Option<std::net::IpAddr> {
    if address.is_null() {
        return None;
    }
    // SAFETY: the family field is at the start of every socket address.
    match unsafe { (*address).sa_family } as c_int {
        libc::AF_INET if length as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: an AF_INET address of sockaddr_in's size.
            let a = unsafe { &*(address as *const libc::sockaddr_in) };
            Some(std::net::IpAddr::V4(std::net::Ipv4Addr::from(
                u32::from_be(a.sin_addr.s_addr),
            )))
        }
        libc::AF_INET6 if length as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: an AF_INET6 address of sockaddr_in6's size.
            let a = unsafe { &*(address as *const libc::sockaddr_in6) };
            let v6 = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            // An IPv4-mapped address is judged as the IPv4 address it is.
            Some(match v6.to_ipv4_mapped() {
                Some(v4) => std::net::IpAddr::V4(v4),
                None => std::net::IpAddr::V6(v6),
            })
        }
        _ => None,
    }
}

impl Producer {
    /// A producer for `properties` (the sink's, checked by `rules::check_properties`, and the
    /// worker's own), connecting only where `allow` and `allowed_brokers` let it.
    pub fn new(
        properties: &[(String, String)],
        allow: rules::Allow,
        allowed_brokers: &str,
    ) -> Result<Producer, String> {
        let context = Box::into_raw(Box::new(Context {
            allow,
            allowed_brokers: allowed_brokers.to_string(),
            reports: Mutex::new(Reports::default()),
            polling: std::sync::atomic::AtomicBool::new(false),
            refused: Mutex::new(None),
        }));
        // SAFETY: a configuration object built and handed to rd_kafka_new, which owns it on
        // success; destroyed here on failure. The context outlives the producer (freed in Drop,
        // after rd_kafka_destroy).
        unsafe {
            let conf = rd::rd_kafka_conf_new();
            let mut error = [0 as c_char; 512];
            for (key, value) in properties {
                let (Ok(k), Ok(v)) = (CString::new(key.as_str()), CString::new(value.as_str()))
                else {
                    rd::rd_kafka_conf_destroy(conf);
                    drop(Box::from_raw(context));
                    return Err(format!("property \"{key}\" holds a NUL character"));
                };
                let r = rd::rd_kafka_conf_set(
                    conf,
                    k.as_ptr(),
                    v.as_ptr(),
                    error.as_mut_ptr(),
                    error.len(),
                );
                if r != rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK {
                    rd::rd_kafka_conf_destroy(conf);
                    drop(Box::from_raw(context));
                    // librdkafka's message names the property, never its value.
                    return Err(CStr::from_ptr(error.as_ptr())
                        .to_string_lossy()
                        .into_owned());
                }
            }
            rd::rd_kafka_conf_set_opaque(conf, context as *mut c_void);
            rd::rd_kafka_conf_set_dr_msg_cb(conf, Some(on_delivery));
            rd::rd_kafka_conf_set_connect_cb(conf, Some(on_connect));
            rd::rd_kafka_conf_set_log_cb(conf, Some(on_log));
            // librdkafka's threads inherit this mask: none of them may run the worker's
            // signal handlers.
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut previous: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut previous);
            let rk = rd::rd_kafka_new(
                rd::rd_kafka_type_t::RD_KAFKA_PRODUCER,
                conf,
                error.as_mut_ptr(),
                error.len(),
            );
            libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut());
            if rk.is_null() {
                let why = CStr::from_ptr(error.as_ptr())
                    .to_string_lossy()
                    .into_owned();
                // Its threads failed to start in time: they may still run, and use both. Leaked.
                if last_error() != CRIT_SYS_RESOURCE {
                    rd::rd_kafka_conf_destroy(conf);
                    drop(Box::from_raw(context));
                }
                return Err(why);
            }
            Ok(Producer {
                rk,
                context,
                windows: AtomicU32::new(0),
                produced: Mutex::new(0),
                turn: Condvar::new(),
                retired: std::sync::atomic::AtomicBool::new(false),
                born: Instant::now(),
                acknowledged: std::sync::atomic::AtomicBool::new(false),
                destroyed: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            })
        }
    }

    fn context(&self) -> &Context {
        // SAFETY: freed only in Drop.
        unsafe { &*self.context }
    }

    /// Whether it sends without first waiting for its producer id: the broker acknowledged a
    /// message of it, or it is older than [`WARM_AFTER`].
    pub fn warm(&self) -> bool {
        self.acknowledged.load(Ordering::Acquire) || self.born.elapsed() >= WARM_AFTER
    }

    /// Set once the last reference is dropped and `rd_kafka_destroy` returned (whichever thread
    /// dropped it: a window's, discarded, may hold it after the worker let it go).
    pub fn destroyed(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.destroyed.clone()
    }

    /// Whether it must be replaced: a window failed on it, or it has a fatal error.
    pub fn spent(&self) -> bool {
        self.retired.load(Ordering::Acquire) || self.fatal().is_some()
    }

    /// Gives back what it still holds (queued and in-flight messages fail at once): before it is
    /// dropped, so that its destruction does not wait for them.
    pub fn purge(&self) {
        // SAFETY: a valid handle.
        unsafe {
            rd::rd_kafka_purge(
                self.rk,
                (rd::RD_KAFKA_PURGE_F_QUEUE | rd::RD_KAFKA_PURGE_F_INFLIGHT) as c_int,
            )
        };
    }

    /// The fatal error of an idempotent producer (a gap it cannot close): it must be replaced.
    pub fn fatal(&self) -> Option<String> {
        let mut text = [0 as c_char; 512];
        // SAFETY: a valid handle and buffer.
        let err = unsafe { fatal_error(self.rk, text.as_mut_ptr(), text.len()) };
        (err != NO_ERROR).then(|| {
            // SAFETY: librdkafka wrote a NUL-terminated string.
            unsafe { CStr::from_ptr(text.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        })
    }

    /// A window's place in the order of production: taken on the worker's thread, in the order
    /// of the log, before the window's thread starts. Every ticket must reach `send`.
    pub fn ticket(&self) -> u32 {
        self.windows.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
    }

    /// Sends `messages` (or, when they could not be made, passes its turn and says why) and waits
    /// until every one is acknowledged or failed, or until `timeout`. On a thread of the window's
    /// own; the windows of one producer produce in the order of their tickets. A window that is
    /// not delivered whole retires the producer (purged, and replaced for the next window once it
    /// is gone): a message of it still queued or in flight must not land after the messages the
    /// window is sent again with, or one key's events could be seen out of order; the windows
    /// after it that have not produced yet do not, and fail.
    pub fn send(
        &self,
        ticket: u32,
        messages: Result<Vec<Message>, String>,
        timeout: Duration,
    ) -> Outcome {
        let deadline = Instant::now() + timeout;
        let produced = 'turn: {
            let Some(_turn) = Turn::wait(self, ticket, deadline) else {
                // The producer is retired below: should the window before produce after all, it
                // fails, and both are sent again, in order, by the next producer.
                break 'turn Err(Outcome::Transient {
                    retry_after: None,
                    reason: "the window before this one did not produce in time".into(),
                });
            };
            let produced = match messages {
                Err(reason) => Err(Outcome::Rejected { reason }),
                Ok(_) if self.retired.load(Ordering::Acquire) => Err(Outcome::Transient {
                    retry_after: None,
                    reason: "a window before this one failed; it is sent again after it".into(),
                }),
                Ok(messages) => self
                    .produce_all(ticket, &messages, deadline)
                    .map(|()| messages),
            };
            if produced.is_err() {
                // Before the turn passes: the windows after this one must not produce.
                self.retired.store(true, Ordering::Release);
            }
            produced
        };
        let outcome = match produced {
            Ok(messages) => self.acknowledged(ticket, &messages, deadline, timeout),
            Err(outcome) => outcome,
        };
        if let Ok(mut reports) = self.context().reports.lock() {
            reports.taken.remove(&ticket);
        }
        if !matches!(outcome, Outcome::Delivered) {
            self.retired.store(true, Ordering::Release);
            self.purge();
        }
        outcome
    }

    /// Produces a window's messages, in order. Err: the outcome of the window, failed.
    fn produce_all(
        &self,
        ticket: u32,
        messages: &[Message],
        deadline: Instant,
    ) -> Result<(), Outcome> {
        let tag = |i: usize| ((ticket as usize) << 32) | i;
        for (i, m) in messages.iter().enumerate() {
            if self.retired.load(Ordering::Acquire) {
                // A window ahead failed while this one waited for room in the queue.
                return Err(Outcome::Transient {
                    retry_after: None,
                    reason: "a window before this one failed; it is sent again after it".into(),
                });
            }
            loop {
                match self.produce(m, tag(i)) {
                    Ok(()) => break,
                    // The producer's queue is full: let it drain.
                    Err(QUEUE_FULL) if Instant::now() < deadline => {
                        self.poll(ticket, Duration::from_millis(10))
                    }
                    Err(err) => return Err(self.outcome_of(m, err)),
                }
            }
        }
        Ok(())
    }

    /// Serves delivery reports for up to `wait`: in `rd_kafka_poll` if no other thread is, else
    /// parked until that thread hands some out for this window, or passes polling on to it. The
    /// poll ends under the `reports` lock, under which a waiter checks before it parks: no
    /// wakeup is lost (an unpark before the park makes the park return at once).
    fn poll(&self, ticket: u32, wait: Duration) {
        let context = self.context();
        if context
            .polling
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // SAFETY: a valid handle; delivery callbacks run here, on this thread.
            unsafe { rd::rd_kafka_poll(self.rk, wait.as_millis().clamp(1, 100) as c_int) };
            let Ok(mut reports) = context.reports.lock() else {
                context.polling.store(false, Ordering::Release);
                return;
            };
            context.polling.store(false, Ordering::Release);
            // Those with reports, and of the others the one whose window follows this thread's
            // most closely, which polls next should this thread's window be done.
            let Reports { taken, waiting } = &mut *reports;
            let next = waiting
                .iter()
                .filter(|(t, _)| taken.get(t).is_none_or(|r| r.is_empty()))
                .map(|(t, _)| t.wrapping_sub(ticket))
                .min();
            waiting.retain(|(t, thread)| {
                let wake = taken.get(t).is_some_and(|r| !r.is_empty())
                    || Some(t.wrapping_sub(ticket)) == next;
                if wake {
                    thread.unpark();
                }
                !wake
            });
        } else if let Ok(mut reports) = context.reports.lock() {
            let mine = reports.taken.get(&ticket).is_some_and(|r| !r.is_empty());
            if mine || !context.polling.load(Ordering::Acquire) {
                return;
            }
            reports.waiting.push((ticket, std::thread::current()));
            drop(reports);
            std::thread::park_timeout(wait.min(Duration::from_millis(100)));
            if let Ok(mut reports) = context.reports.lock() {
                reports.waiting.retain(|(t, _)| *t != ticket);
            }
        }
    }

    /// Waits for the reports of window `ticket`: Delivered when every message was acknowledged.
    fn acknowledged(
        &self,
        ticket: u32,
        messages: &[Message],
        deadline: Instant,
        timeout: Duration,
    ) -> Outcome {
        let mut done = vec![false; messages.len()];
        let mut left = messages.len();
        let mut failed: Option<(usize, c_int)> = None;
        while left > 0 {
            let reports = self
                .context()
                .reports
                .lock()
                .ok()
                .and_then(|mut r| r.taken.get_mut(&ticket).map(std::mem::take))
                .unwrap_or_default();
            for (i, err) in reports {
                if i >= done.len() || done[i] {
                    continue;
                }
                done[i] = true;
                left -= 1;
                if err != NO_ERROR {
                    // The first refusal for good decides; else the first failure.
                    let worse = match failed {
                        None => true,
                        Some((_, e)) => !permanent(e) && permanent(err),
                    };
                    if worse {
                        failed = Some((i, err));
                    }
                }
            }
            if left == 0 {
                break;
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return Outcome::Transient {
                    retry_after: None,
                    reason: self.with_refusal(format!(
                        "{left} of {} messages not acknowledged within {} ms",
                        messages.len(),
                        timeout.as_millis()
                    )),
                };
            }
            self.poll(ticket, wait);
        }
        match failed {
            None => {
                self.acknowledged.store(true, Ordering::Release);
                Outcome::Delivered
            }
            Some((i, err)) => self.outcome_of(&messages[i], err),
        }
    }

    fn produce(&self, m: &Message, opaque: usize) -> Result<(), c_int> {
        use rd::rd_kafka_vtype_t as T;
        let vu = |vtype: T, u: rd::rd_kafka_vu_s__bindgen_ty_1| rd::rd_kafka_vu_t { vtype, u };
        let mut vus = Vec::with_capacity(6 + m.headers.len());
        vus.push(vu(
            T::RD_KAFKA_VTYPE_TOPIC,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                cstr: m.topic.as_ptr(),
            },
        ));
        vus.push(vu(
            T::RD_KAFKA_VTYPE_MSGFLAGS,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                i: rd::RD_KAFKA_MSG_F_COPY as c_int,
            },
        ));
        vus.push(vu(
            T::RD_KAFKA_VTYPE_VALUE,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                    ptr: m.value.as_ptr() as *mut c_void,
                    size: m.value.len(),
                },
            },
        ));
        if let Some(key) = &m.key {
            vus.push(vu(
                T::RD_KAFKA_VTYPE_KEY,
                rd::rd_kafka_vu_s__bindgen_ty_1 {
                    mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                        ptr: key.as_ptr() as *mut c_void,
                        size: key.len(),
                    },
                },
            ));
        }
        vus.push(vu(
            T::RD_KAFKA_VTYPE_OPAQUE,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                ptr: opaque as *mut c_void,
            },
        ));
        for (name, value) in &m.headers {
            vus.push(vu(
                T::RD_KAFKA_VTYPE_HEADER,
                rd::rd_kafka_vu_s__bindgen_ty_1 {
                    header: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_2 {
                        name: name.as_ptr(),
                        val: value.as_ptr() as *const c_void,
                        size: value.len() as isize,
                    },
                },
            ));
        }
        // SAFETY: every pointer in `vus` points into `m`, alive for the call; librdkafka copies
        // the value, key and headers (RD_KAFKA_MSG_F_COPY).
        unsafe {
            let error = rd::rd_kafka_produceva(self.rk, vus.as_ptr(), vus.len());
            if error.is_null() {
                Ok(())
            } else {
                let code = error_code(error);
                rd::rd_kafka_error_destroy(error);
                Err(code)
            }
        }
    }

    /// The failure policy's reading of `err` for message `m`: refused for good (a message the
    /// broker will never take: too large, a topic that refuses it or does not exist, no right to
    /// write it) or transient (everything else: an outage, a timeout, a leader election).
    fn outcome_of(&self, m: &Message, err: c_int) -> Outcome {
        let reason = format!(
            "event {} to Kafka topic \"{}\": {}",
            m.id,
            m.topic.to_string_lossy(),
            err_text(err)
        );
        if permanent(err) {
            Outcome::Rejected { reason }
        } else {
            Outcome::Transient {
                retry_after: None,
                reason: self.with_refusal(reason),
            }
        }
    }

    /// `reason`, with why `on_connect` refused a broker, if it did.
    fn with_refusal(&self, reason: String) -> String {
        match self.context().refused.lock().ok().and_then(|r| r.clone()) {
            Some(why) => format!("{reason} ({why})"),
            None => reason,
        }
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        // SAFETY: the handle is destroyed once, nothing uses it after; the context after it.
        unsafe {
            rd::rd_kafka_purge(
                self.rk,
                (rd::RD_KAFKA_PURGE_F_QUEUE | rd::RD_KAFKA_PURGE_F_INFLIGHT) as c_int,
            );
            rd::rd_kafka_destroy(self.rk);
            drop(Box::from_raw(self.context as *mut Context));
        }
        self.destroyed.store(true, Ordering::Release);
    }
}

/// A window's turn to produce: waited for in the order of tickets, passed on when dropped (on
/// every path, a panic's too, so that the windows after it never wait forever).
struct Turn<'a> {
    producer: &'a Producer,
    ticket: u32,
}

impl<'a> Turn<'a> {
    /// None when the window before did not pass its turn by `deadline`.
    fn wait(producer: &'a Producer, ticket: u32, deadline: Instant) -> Option<Turn<'a>> {
        let mut produced = producer.produced.lock().unwrap_or_else(|e| e.into_inner());
        while *produced != ticket.wrapping_sub(1) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            produced = producer
                .turn
                .wait_timeout(produced, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Some(Turn { producer, ticket })
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *self
            .producer
            .produced
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = self.ticket;
        self.producer.turn.notify_all();
    }
}

/// One message, ready for the wire.
pub struct Message<'a> {
    id: &'a str,
    topic: Rc<CString>,
    key: Option<&'a [u8]>,
    value: &'a [u8],
    headers: Vec<(Cow<'a, CStr>, Cow<'a, [u8]>)>,
}

/// Where and how a sink's events go.
#[derive(Clone)]
pub struct Target {
    pub template: TopicTemplate,
    pub key: Key,
    /// `ce_source`: `/pg_outbox/<database>`.
    pub source: String,
}

/// A UUID's text form (`8-4-4-4-12` lowercase hex digits), as PostgreSQL writes it.
pub fn uuid_text(id: &pgrx::Uuid) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(36);
    for (i, byte) in id.as_bytes().iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        out.push(HEX[usize::from(byte >> 4)] as char);
        out.push(HEX[usize::from(byte & 0xf)] as char);
    }
    out
}

/// A `timestamptz` (microseconds since 2000-01-01 UTC) as `ce_time` carries it, in UTC:
/// `YYYY-MM-DDTHH:MM:SS.ffffffZ`, as `to_char(t AT TIME ZONE 'UTC',
/// 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')` writes it for the years 1 to 9999.
pub fn utc_time(t: i64) -> String {
    let mut out = String::with_capacity(27);
    push_utc_time(&mut out, t);
    out
}

/// Appends [`utc_time`]`(t)` to `out`: digit by digit, a tenth of what `format!` costs (the
/// worker writes one per event it sends to Kafka).
fn push_utc_time(out: &mut String, t: i64) {
    const DAY: i64 = 86_400_000_000;
    let days = t.div_euclid(DAY);
    let micros = t.rem_euclid(DAY);
    // Days since 1970-01-01, then the civil date (Howard Hinnant's days_from_civil inverse).
    let z = days + 10_957 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let seconds = micros / 1_000_000;
    if !(1..=9999).contains(&year) {
        // Outside what PostgreSQL's timestamps hold as four-digit years: as format! writes it.
        use std::fmt::Write;
        let _ = write!(
            out,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
            seconds / 3600,
            seconds / 60 % 60,
            seconds % 60,
            micros % 1_000_000
        );
        return;
    }
    let mut buf = *b"0000-00-00T00:00:00.000000Z";
    let mut put = |at: usize, width: usize, mut n: i64| {
        for i in (at..at + width).rev() {
            buf[i] = b'0' + (n % 10) as u8;
            n /= 10;
        }
    };
    put(0, 4, year);
    put(5, 2, month);
    put(8, 2, day);
    put(11, 2, seconds / 3600);
    put(14, 2, seconds / 60 % 60);
    put(17, 2, seconds % 60);
    put(20, 6, micros % 1_000_000);
    out.push_str(std::str::from_utf8(&buf).expect("ASCII digits"));
}

/// Appends `n` in decimal to `out` (a frame's field length), without `format!`.
pub fn push_decimal(out: &mut String, mut n: usize) {
    let mut buf = [0u8; 20];
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.push_str(std::str::from_utf8(&buf[at..]).expect("ASCII digits"));
}

/// The next field of a frame (`http::kafka_frame`): `<bytes>:<text>`, or `~` for NULL.
fn next_field<'a>(frame: &mut &'a str) -> Result<Option<&'a str>, String> {
    if let Some(rest) = frame.strip_prefix('~') {
        *frame = rest;
        return Ok(None);
    }
    let (length, rest) = frame
        .split_once(':')
        .ok_or_else(|| "reading the window: a field without its length".to_string())?;
    let length: usize = length
        .parse()
        .map_err(|_| format!("reading the window: a field length of \"{length}\""))?;
    if rest.len() < length || !rest.is_char_boundary(length) {
        return Err("reading the window: a field shorter than its length".into());
    }
    let (field, rest) = rest.split_at(length);
    *frame = rest;
    Ok(Some(field))
}

/// The messages of a window, from its events framed by `http::kafka_frame`; or why an event cannot
/// become one (a Kafka topic name its template cannot make): a refusal for good. They borrow the
/// window's text (librdkafka copies what it keeps): most of a message is a few pointers into it.
pub fn messages<'a>(target: &'a Target, window: &'a str) -> Result<Vec<Message<'a>>, String> {
    let cstring = |s: &str| CString::new(s.replace('\0', "")).expect("no NUL left");
    let mut rest = window;
    let mut messages = Vec::new();
    // The Kafka topics of this window's events so far (a window has one or a few).
    let mut topics: Vec<(&str, Rc<CString>)> = Vec::new();
    while !rest.is_empty() {
        let mut field = || next_field(&mut rest);
        let id = field()?.unwrap_or_default();
        let position = field()?.unwrap_or_default();
        let topic = field()?.unwrap_or_default();
        let subject = field()?;
        let tenant = field()?;
        let own = field()?;
        let time = field()?.unwrap_or_default();
        let value = field()?.unwrap_or_default();
        let kafka_topic = match topics.iter().find(|(t, _)| *t == topic) {
            Some((_, made)) => made.clone(),
            None => {
                let made = Rc::new(cstring(
                    &target
                        .template
                        .render(topic)
                        .map_err(|why| format!("event {id}: {why}"))?,
                ));
                topics.push((topic, made.clone()));
                made
            }
        };
        let key = match target.key {
            Key::Subject => subject,
            Key::Tenant => tenant,
            Key::None => None,
        };
        let mut headers: Vec<(Cow<'a, CStr>, Cow<'a, [u8]>)> = Vec::with_capacity(10);
        let mut header = |name: &'static CStr, value: &'a str| {
            headers.push((Cow::Borrowed(name), Cow::Borrowed(value.as_bytes())));
        };
        header(c"ce_specversion", "1.0");
        header(c"ce_id", id);
        header(c"ce_source", &target.source);
        header(c"ce_type", topic);
        header(c"ce_time", time);
        header(c"ce_position", position);
        header(c"content-type", "application/json");
        if let Some(s) = subject {
            header(c"ce_subject", s);
        }
        if let Some(t) = tenant {
            header(c"ce_tenant", t);
        }
        if let Some(own) = own.filter(|h| *h != "{}") {
            let own: serde_json::Map<String, serde_json::Value> = serde_json::from_str(own)
                .map_err(|e| format!("reading the headers of event {id}: {e}"))?;
            let mut header = |name: &str, value: &str| {
                headers.push((
                    Cow::Owned(cstring(name)),
                    Cow::Owned(value.as_bytes().to_vec()),
                ));
            };
            for name in ["traceparent", "tracestate"] {
                if let Some(serde_json::Value::String(v)) = own.get(name) {
                    header(&format!("ce_{name}"), v);
                }
            }
            // The event's own headers, under their names; none may pose as an attribute.
            for (name, value) in &own {
                if name.to_ascii_lowercase().starts_with("ce_")
                    || name.eq_ignore_ascii_case("content-type")
                {
                    continue;
                }
                match value {
                    serde_json::Value::String(s) => header(name, s),
                    other => header(name, &other.to_string()),
                }
            }
        }
        messages.push(Message {
            id,
            topic: kafka_topic,
            key: key.map(str::as_bytes),
            value: value.as_bytes(),
            headers,
        });
    }
    Ok(messages)
}

/// Sends a window: what a window's thread runs, with the ticket the worker took for it.
pub fn send_window(
    producer: Arc<Producer>,
    ticket: u32,
    target: &Target,
    window: &str,
    timeout: Duration,
) -> Outcome {
    producer.send(ticket, messages(target, window), timeout)
}

/// The database's name as `ce_source` carries it (`/pg_outbox/<name>`), as HTTP sinks do: any
/// character outside `A-Za-z0-9._~-` becomes `_`.
pub fn source_name(database: &str) -> String {
    database
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._~-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The producer's whole configuration: the worker's defaults, then the sink's properties, then
/// what the worker insists on (`FIXED_PROPERTIES`: an idempotent producer, acks=all, no gaps).
pub fn producer_properties(
    brokers: &str,
    sink: &[(String, String)],
    timeout_ms: i32,
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = vec![
        ("bootstrap.servers".into(), brokers.into()),
        // A key lands in the partition a Java producer would put it in.
        ("partitioner".into(), "murmur2_random".into()),
        // What the producer may hold in memory.
        ("queue.buffering.max.kbytes".into(), "65536".into()),
        ("queue.buffering.max.messages".into(), "100000".into()),
        ("client.id".into(), "pg_outbox".into()),
        // A window's messages are produced all at once and batch by themselves: waiting longer
        // for more (librdkafka's default is 5 ms) only adds to every window's latency.
        ("linger.ms".into(), "1".into()),
    ];
    for (k, v) in sink {
        out.retain(|(key, _)| key != k);
        out.push((k.clone(), v.clone()));
    }
    // A request the brokers do not answer fails within the sink's timeout (librdkafka's
    // message.timeout.ms is off: the window's thread bounds the wait, see FIXED_PROPERTIES).
    if !sink.iter().any(|(k, _)| k == "request.timeout.ms") {
        out.push((
            "request.timeout.ms".into(),
            timeout_ms.clamp(1000, 300_000).to_string(),
        ));
    }
    for (k, v) in rules::FIXED_PROPERTIES {
        out.retain(|(key, _)| key != k);
        out.push((k.to_string(), v.to_string()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A field as `http::kafka_frame` frames it.
    fn framed(field: Option<&str>) -> String {
        field.map_or("~".into(), |f| format!("{}:{f}", f.len()))
    }

    fn event(fields: [Option<&str>; 8]) -> String {
        fields.iter().map(|f| framed(*f)).collect()
    }

    #[test]
    fn framed_events_become_messages() {
        let target = Target {
            template: TopicTemplate::parse("shop.{topic}").unwrap(),
            key: Key::parse("subject").unwrap(),
            source: "/pg_outbox/app".into(),
        };
        let window = event([
            Some("01a2-1"),
            Some("991:257"),
            Some("order.placed"),
            Some("órder/61:~"),
            None,
            Some(r#"{"traceparent": "00-ab-cd-01", "ce_id": "forged", "n": 7}"#),
            Some("2026-12-02T00:12:14.409713Z"),
            Some(r#"{"order": 61, "note": "2:~"}"#),
        ]) + &event([
            Some("01a2-2"),
            Some("991:258"),
            Some("order.placed"),
            None,
            Some("t1"),
            Some("{}"),
            Some("2026-12-02T00:12:14.409713Z"),
            Some("{}"),
        ]);
        let m = messages(&target, &window).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].id, "01a2-1");
        assert_eq!(m[0].topic.to_str().unwrap(), "shop.order.placed");
        assert_eq!(m[0].key, Some("órder/61:~".as_bytes()));
        assert_eq!(m[0].value, br#"{"order": 61, "note": "2:~"}"#);
        let headers = |m: &Message| -> Vec<(String, String)> {
            m.headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_str().unwrap().to_string(),
                        String::from_utf8(v.to_vec()).unwrap(),
                    )
                })
                .collect()
        };
        let h = headers(&m[0]);
        let get = |h: &[(String, String)], k: &str| -> Vec<String> {
            h.iter()
                .filter(|(name, _)| name == k)
                .map(|(_, v)| v.clone())
                .collect()
        };
        assert_eq!(
            get(&h, "ce_id"),
            ["01a2-1"],
            "no header poses as an attribute"
        );
        assert_eq!(get(&h, "ce_traceparent"), ["00-ab-cd-01"]);
        assert_eq!(get(&h, "ce_subject"), ["órder/61:~"]);
        assert_eq!(get(&h, "ce_position"), ["991:257"]);
        assert_eq!(get(&h, "n"), ["7"]);
        assert!(get(&h, "ce_tenant").is_empty());
        let h = headers(&m[1]);
        assert_eq!(m[1].key, None, "no subject, no key");
        assert_eq!(get(&h, "ce_tenant"), ["t1"]);
        // A frame cut short, or a length that does not fit, is an error, never a wrong message.
        assert!(messages(&target, &window[..window.len() - 3]).is_err());
        assert!(messages(&target, "6:01a2-1x").is_err());
        assert!(messages(&target, "99:short").is_err());
    }
}
