//! Logging through `tracing`. The engine only emits events (targets `hixl_core::...`); which
//! subscriber shows them is the host program's choice. [`init`] installs hixl's own stderr
//! logger, whose level comes from `HIXL_LOG_LEVEL` (DEBUG | INFO | WARN | ERROR, default
//! WARN) and can be changed at run time. [`init_queue`] instead formats each record into a
//! bounded queue that a host drains on its own thread (the Python module forwards them to
//! Python's `hixl` logger): the threads that log never wait for the host.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Condvar, Mutex, Once, OnceLock};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

use tracing::Level;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::error::{Error, Result};

static LEVEL: AtomicU8 = AtomicU8::new(2);
static INIT: Once = Once::new();

fn rank(l: &Level) -> u8 {
    match *l {
        Level::ERROR => 0,
        Level::WARN => 1,
        Level::INFO => 2,
        _ => 3,
    }
}

fn parse(s: &str) -> Option<u8> {
    match s.trim().to_ascii_uppercase().as_str() {
        "ERROR" => Some(0),
        "WARN" | "WARNING" => Some(1),
        "INFO" => Some(2),
        "DEBUG" => Some(3),
        _ => None,
    }
}

fn filter() -> impl Fn(&tracing::Metadata<'_>) -> bool {
    |m| m.target().starts_with("hixl") && rank(m.level()) <= LEVEL.load(Ordering::Relaxed)
}

fn level_from_env() -> u8 {
    std::env::var("HIXL_LOG_LEVEL").ok().and_then(|v| parse(&v)).unwrap_or(1)
}

/// Installs hixl's stderr logger once, as the global `tracing` subscriber (reading
/// `HIXL_LOG_LEVEL`), unless the program already has one. Never called by the engine itself.
pub fn init() {
    INIT.call_once(|| {
        LEVEL.store(level_from_env(), Ordering::Relaxed);
        let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(false);
        let only_hixl = tracing_subscriber::filter::filter_fn(filter());
        // Another global subscriber may exist in a Rust host program: then we log through it.
        let _ = tracing_subscriber::registry().with(fmt.with_filter(only_hixl)).try_init();
    });
}

/// Records a [`LogQueue`] holds at most. Fixed: a host that stops draining loses the newest
/// records past it (counted), and memory stays bounded.
pub const LOG_QUEUE_LEN: usize = 4096;

/// One log record, formatted where it was emitted.
#[derive(Debug, Clone)]
pub struct Record {
    /// 0 ERROR, 1 WARN, 2 INFO, 3 DEBUG.
    pub level: u8,
    /// The module that emitted it (`hixl_core::...`).
    pub target: String,
    /// The message followed by its fields as ` key=value`.
    pub message: String,
}

/// Records waiting for a host to take them, with a count of those dropped when it was full.
pub struct LogQueue {
    records: ArrayQueue<Record>,
    dropped: AtomicU64,
    /// `.0` set for good by [`LogQueue::wake`] (the host's drain is stopping): no `take`
    /// waits after it, whichever thread takes first. `.1` set by [`LogQueue::nudge`] and
    /// cleared by the one `take` it ends early.
    lock: Mutex<(bool, bool)>,
    ready: Condvar,
}

impl LogQueue {
    fn push(&self, r: Record) {
        if self.records.push(r).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        let _g = self.lock.lock().unwrap();
        self.ready.notify_one();
    }

    /// The records queued now, waiting up to `max_wait` for the first one (or for
    /// [`LogQueue::wake`]).
    pub fn take(&self, max_wait: Duration) -> Vec<Record> {
        if self.records.is_empty() {
            let mut st = self.lock.lock().unwrap();
            if self.records.is_empty() && !st.0 && !st.1 {
                st = self.ready.wait_timeout(st, max_wait).unwrap().0;
            }
            st.1 = false;
        }
        std::iter::from_fn(|| self.records.pop()).collect()
    }

    /// Ends a `take` that waits now, and every later one, at once (a host stopping its drain
    /// thread, which may otherwise wait long: an idle process then does not wake for it).
    pub fn wake(&self) {
        self.lock.lock().unwrap().0 = true;
        self.ready.notify_all();
    }

    /// Ends the `take` that waits now (or the next one) early, once: the host's drain thread
    /// gets a turn (to move to a new engine's CPUs) and then waits as before.
    pub fn nudge(&self) {
        self.lock.lock().unwrap().1 = true;
        self.ready.notify_all();
    }

    /// Records lost because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// Formats an event's fields: `message`, then ` key=value` for the others.
#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        use std::fmt::Write;
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={value}", field.name());
        }
    }
}

struct QueueLayer(&'static LogQueue);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for QueueLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: tracing_subscriber::layer::Context<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let m = event.metadata();
        self.0.push(Record {
            level: rank(m.level()),
            target: m.target().to_string(),
            message: f.message + &f.rest,
        });
    }
}

/// Installs, once, a global subscriber that queues hixl's records (level from
/// `HIXL_LOG_LEVEL`, changed by [`set_level`]) for the host to [`LogQueue::take`]; returns the
/// queue. Exclusive with [`init`]: whichever runs first decides.
pub fn init_queue() -> &'static LogQueue {
    static QUEUE: OnceLock<LogQueue> = OnceLock::new();
    let q = QUEUE.get_or_init(|| LogQueue {
        records: ArrayQueue::new(LOG_QUEUE_LEN),
        dropped: AtomicU64::new(0),
        lock: Mutex::new((false, false)),
        ready: Condvar::new(),
    });
    INIT.call_once(|| {
        LEVEL.store(level_from_env(), Ordering::Relaxed);
        let only_hixl = tracing_subscriber::filter::filter_fn(filter());
        let _ = tracing_subscriber::registry().with(QueueLayer(q).with_filter(only_hixl)).try_init();
    });
    q
}

/// Sets the level: "DEBUG", "INFO", "WARN" or "ERROR".
pub fn set_level(level: &str) -> Result<()> {
    init();
    let l = parse(level).ok_or_else(|| {
        Error::param(format!("log level {level:?} is invalid: expected DEBUG, INFO, WARN or ERROR"))
    })?;
    LEVEL.store(l, Ordering::Relaxed);
    // The filter's verdict is cached per call site ("never" for a DEBUG site hit while the
    // level was WARN): recompute them, or a raised level would not show those sites.
    tracing::callsite::rebuild_interest_cache();
    Ok(())
}

/// The current level's name.
pub fn level() -> &'static str {
    ["ERROR", "WARN", "INFO", "DEBUG"][LEVEL.load(Ordering::Relaxed) as usize]
}

use tracing_subscriber::Layer as _;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn queue() -> LogQueue {
        LogQueue {
            records: ArrayQueue::new(4),
            dropped: AtomicU64::new(0),
            lock: Mutex::new((false, false)),
            ready: Condvar::new(),
        }
    }

    #[test]
    fn a_nudge_ends_one_take_early_and_later_takes_wait_again() {
        let q = queue();
        q.nudge();
        let t = Instant::now();
        assert!(q.take(Duration::from_secs(30)).is_empty());
        assert!(t.elapsed() < Duration::from_secs(10), "the nudged take waited");
        // The nudge is used up, and nothing stops the next take from waiting: a nudge is not
        // a wake (which would make the drain thread spin).
        assert_eq!(*q.lock.lock().unwrap(), (false, false));
        q.wake();
        let t = Instant::now();
        assert!(q.take(Duration::from_secs(30)).is_empty());
        assert!(q.take(Duration::from_secs(30)).is_empty());
        assert!(t.elapsed() < Duration::from_secs(10), "takes after wake waited");
    }
}
