//! The I/O workers of an engine: every TCP stream of every link and every served stream is a
//! [`Source`] registered here, and a fixed set of worker threads (`hixl.tcp.io_threads`) runs
//! them when their socket is ready or when they are scheduled, so that threads do not grow
//! with the number of peers. One timer thread drives every link's heartbeat.
//!
//! Each worker waits on an epoll set of its own, and each source belongs to one worker (its
//! shard, chosen in turn as sources are added; both directions of a stream share one): a
//! stream is always served by the same thread, so the scheduler can keep that thread beside
//! the peer's thread that feeds it, and a transfer's bytes stay in the cache of the core that
//! copies them out. With one set shared by all workers, the two streams of a 128 MiB READ
//! moved between workers from one transfer to the next and ran at 0.7x of a thread per
//! stream here.
//!
//! Every registration is one-shot: the kernel reports a socket to its worker, which runs its
//! source and then re-arms it with the interest the source returned. A source therefore never
//! runs on two threads at once; a wake-up that arrives while it runs (an event, or `schedule`
//! from another thread) makes it run once more before it is re-armed. Sources do not wait
//! between transfers: they read and write what the socket takes now and return; only in the
//! middle of a transfer's bytes does a job wait for its socket, at most 100 ms (see `io::nbio`).

pub mod copy_pool;

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sys;
use crate::transport::reactor::copy_pool::CopyPool;

/// What a source waits for next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Interest {
    /// Bytes to read (or the peer closing).
    Read,
    /// Room to write.
    Write,
    /// Nothing from the socket: the source runs again only when scheduled.
    Idle,
    /// Bytes to read, some of which it already holds (it stopped to let other sources run):
    /// it runs again soon whether or not the socket becomes readable.
    Again,
    /// The source is done: it is removed.
    Gone,
}

/// Something the workers run: one direction of one stream.
pub(crate) trait Source: Send + Sync {
    /// Does what can be done now without blocking (`events`: the epoll events that woke it,
    /// 0 when it was scheduled) and says what to wait for next.
    fn run(&self, events: u32) -> Interest;
}

/// Something the timer calls periodically; returns false to be dropped.
pub(crate) trait Tick: Send + Sync {
    /// Called every period; `now` is the timer's clock.
    fn tick(&self, now: Instant) -> bool;
}

const IDLE: u8 = 0;
const RUNNING: u8 = 1;
/// Running, and woken again meanwhile: runs once more before it is re-armed.
const AGAIN: u8 = 2;

/// Ticks due within this much of each other run in one wake-up of the timer (an idle engine
/// with many links wakes about once per heartbeat interval, not once per link); a tick's
/// slack is at most a tenth of its period.
const TIMER_SLACK: Duration = Duration::from_millis(20);

fn slack(period: Duration) -> Duration {
    TIMER_SLACK.min(period / 10)
}

mod shard;
use shard::{Shard, SECOND, WAKE};

struct Entry {
    fd: RawFd,
    shard: usize,
    /// Registered in the shard's second set ([`Reactor::add_second`]).
    second: bool,
    state: AtomicU8,
    events: AtomicU32,
    /// The interest its epoll registration is armed with ([`armed_code`]), or `FIRED` once an
    /// event used the one-shot registration up: a run that ends with the interest still armed
    /// (a writer run inline that finds nothing more to send) needs no `epoll_ctl`.
    armed: AtomicU8,
    source: Arc<dyn Source>,
}

/// `Entry::armed` once an event has disarmed the registration.
const FIRED: u8 = u8::MAX;

fn armed_code(i: Interest) -> u8 {
    match i {
        Interest::Again => Interest::Read as u8,
        i => i as u8,
    }
}

struct TimerEntry {
    /// Names this entry alone (one `Tick` may be added again after it stopped once).
    id: u64,
    /// Set when its tick returned false: removed at the next pass.
    done: bool,
    next: Instant,
    period: Duration,
    tick: Weak<dyn Tick>,
}

/// An engine's I/O workers and its timer.
pub struct Reactor {
    shards: Vec<Shard>,
    next_shard: AtomicUsize,
    entries: RwLock<HashMap<u64, Arc<Entry>>>,
    next_token: AtomicU64,
    stopping: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    timers: (Mutex<Vec<TimerEntry>>, Condvar),
    /// The origin of the timer's grid (see [`Reactor::every`]).
    epoch: Instant,
    /// `hixl.tcp.busy_poll_us`: how long a worker keeps polling after activity.
    busy_poll: Duration,
    /// The same-host copy workers, started with the first same-host link.
    copies: Mutex<Option<Arc<CopyPool>>>,
    /// Where the engine's threads run (captured at `initialize`; None: where started).
    cpus: Option<crate::place::Cpus>,
}

impl std::fmt::Debug for Reactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reactor").field("workers", &self.shards.len()).finish_non_exhaustive()
    }
}

thread_local! {
    static ON_REACTOR: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a reactor's (an I/O worker or the timer): code that may run
/// there schedules sources instead of running them inline, and never blocks.
pub(crate) fn on_reactor_thread() -> bool {
    ON_REACTOR.with(|c| c.get())
}

fn os_error(what: &str) -> Error {
    Error::failed(format!("{what}: {}", std::io::Error::last_os_error()))
}

impl Reactor {
    /// Starts `workers` I/O threads (at least one) and the timer thread, pinned to `cpus`
    /// (None: they keep the caller's mask), as every thread started through the reactor later
    /// is ([`Reactor::spawn`]); each worker keeps polling its sockets for `busy_poll` after
    /// activity before it sleeps (low-latency mode; zero: it sleeps at once).
    pub fn start(
        workers: usize,
        busy_poll: Duration,
        cpus: Option<crate::place::Cpus>,
    ) -> Result<Arc<Reactor>> {
        let workers = workers.max(1);
        let r = Arc::new(Reactor {
            shards: (0..workers).map(|_| Shard::new()).collect::<Result<_>>()?,
            next_shard: AtomicUsize::new(0),
            entries: RwLock::new(HashMap::new()),
            next_token: AtomicU64::new(WAKE + 1),
            stopping: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            timers: (Mutex::new(Vec::new()), Condvar::new()),
            epoch: Instant::now(),
            busy_poll,
            copies: Mutex::new(None),
            cpus,
        });
        for i in 0..=workers {
            let me = r.clone();
            let (name, timer) =
                if i == workers { ("hixl-timer".to_string(), true) } else { (format!("hixl-io{i}"), false) };
            let started = r.spawn(name.clone(), move || {
                ON_REACTOR.with(|c| c.set(true));
                if timer {
                    me.timer_loop()
                } else {
                    me.worker_loop(i)
                }
            });
            match started {
                Ok(h) => r.threads.lock().unwrap().push(h),
                Err(e) => {
                    r.stop();
                    return Err(Error::failed(format!("cannot start thread {name}: {e}")));
                }
            }
        }
        Ok(r)
    }

    /// The engine's same-host copy workers (`workers` of them, started on first use).
    pub(crate) fn copy_pool(&self, workers: usize) -> Result<Arc<CopyPool>> {
        let mut c = self.copies.lock().unwrap();
        if self.stopping.load(Ordering::Acquire) {
            return Err(Error::failed("the engine is finalizing"));
        }
        if let Some(p) = &*c {
            return Ok(p.clone());
        }
        let p = CopyPool::start(workers, self.cpus.clone())?;
        *c = Some(p.clone());
        Ok(p)
    }

    /// Starts a named thread of the engine, pinned to the engine's CPU set (see `place`).
    pub(crate) fn spawn<F, T>(&self, name: String, f: F) -> std::io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        crate::place::spawn_on(name, self.cpus.clone().or_else(crate::place::inherited), f)
    }

    /// The engine's CPU set (None: not pinned by the engine).
    pub(crate) fn cpus(&self) -> Option<crate::place::Cpus> {
        self.cpus.clone()
    }

    /// The worker for the next stream's sources (each in turn).
    pub(crate) fn next_shard(&self) -> usize {
        self.next_shard.fetch_add(1, Ordering::Relaxed) % self.shards.len()
    }

    /// Registers a source on `fd` (which it must keep open until it is removed), armed with
    /// `interest`, to be run by worker `shard` (from [`Reactor::next_shard`]); returns its
    /// token.
    pub(crate) fn add(
        &self,
        fd: RawFd,
        source: Arc<dyn Source>,
        interest: Interest,
        shard: usize,
    ) -> Result<u64> {
        self.register(fd, source, interest, shard, false)
    }

    /// As [`Reactor::add`], for a second source on a descriptor that a source added with
    /// `add` on the same `shard` holds (a stream's writer beside its reader): no `dup` of the
    /// descriptor is needed. The two run independently, each at most on one thread at a time.
    pub(crate) fn add_second(
        &self,
        fd: RawFd,
        source: Arc<dyn Source>,
        interest: Interest,
        shard: usize,
    ) -> Result<u64> {
        self.register(fd, source, interest, shard, true)
    }

    fn register(
        &self,
        fd: RawFd,
        source: Arc<dyn Source>,
        interest: Interest,
        shard: usize,
        second: bool,
    ) -> Result<u64> {
        let shard = shard % self.shards.len();
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(Entry {
            fd,
            shard,
            second,
            state: AtomicU8::new(IDLE),
            events: AtomicU32::new(0),
            armed: AtomicU8::new(armed_code(interest)),
            source,
        });
        self.entries.write().unwrap().insert(token, entry);
        let epfd = self.shards[shard].set(second);
        if sys::epoll::add(epfd, fd, mask(interest), token).is_err() {
            self.entries.write().unwrap().remove(&token);
            return Err(os_error("epoll_ctl(add)"));
        }
        Ok(token)
    }

    /// Removes a source: it is not run again once a run under way returns.
    pub(crate) fn remove(&self, token: u64) {
        if let Some(e) = self.entries.write().unwrap().remove(&token) {
            // The entry holds the source, which keeps `fd` open; deleting an fd that is not
            // registered only fails.
            let _ = sys::epoll::delete(self.shards[e.shard].set(e.second), e.fd);
        }
    }

    /// Has a worker run the source soon (from any thread; never runs it here).
    pub(crate) fn schedule(&self, token: u64) {
        let Some(shard) = self.entries.read().unwrap().get(&token).map(|e| e.shard) else { return };
        self.shards[shard].schedule(token);
    }

    /// Runs the source on the calling thread now, unless a worker is running it (which then
    /// runs it once more). For the latency path: a small send needs no hand-off.
    pub(crate) fn run_here(&self, token: u64) {
        self.dispatch(token, 0);
    }

    /// Calls `tick` every `period` from the timer thread until it returns false or is dropped.
    /// Ticks fall on a grid of `period` from the reactor's start, so that every link with the
    /// same heartbeat period is probed in one wake-up of the timer and their answers arrive
    /// together (a worker takes them in one wake-up too): an idle engine with hundreds of
    /// peers then wakes about twice per period, not twice per peer per period.
    pub(crate) fn every(&self, period: Duration, tick: Weak<dyn Tick>) {
        let period = period.max(Duration::from_millis(1));
        let p = period.as_nanos();
        let k = self.epoch.elapsed().as_nanos() / p + 1;
        let next = self.epoch + Duration::from_nanos(u64::try_from(k * p).unwrap_or(u64::MAX));
        let mut t = self.timers.0.lock().unwrap();
        let id = self.next_token.fetch_add(1, Ordering::Relaxed);
        t.push(TimerEntry { id, done: false, next, period, tick });
        self.timers.1.notify_all();
    }

    fn entry(&self, token: u64) -> Option<Arc<Entry>> {
        self.entries.read().unwrap().get(&token).cloned()
    }

    fn dispatch(&self, token: u64, events: u32) {
        let Some(e) = self.entry(token) else { return };
        if events != 0 {
            // The one-shot registration is used up.
            e.armed.store(FIRED, Ordering::Release);
        }
        e.events.fetch_or(events, Ordering::AcqRel);
        loop {
            match e.state.compare_exchange(IDLE, RUNNING, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(RUNNING) => {
                    if e.state.compare_exchange(RUNNING, AGAIN, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                        return;
                    }
                }
                Err(_) => return, // AGAIN: it runs once more anyway
            }
        }
        self.run_claimed(token, &e, None);
    }

    /// Runs a source this thread holds (RUNNING) until no wake-up arrived during a run, then
    /// re-arms it with the interest the last run returned (`done`: a run already made).
    fn run_claimed(&self, token: u64, e: &Entry, mut done: Option<Interest>) {
        loop {
            let interest = done.take().unwrap_or_else(|| e.source.run(e.events.swap(0, Ordering::AcqRel)));
            if interest == Interest::Gone {
                self.remove(token);
                e.state.store(IDLE, Ordering::Release);
                return;
            }
            self.arm(e, token, interest);
            if interest == Interest::Again {
                self.shards[e.shard].schedule(token);
            }
            if e.state.compare_exchange(RUNNING, IDLE, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return;
            }
            e.state.store(RUNNING, Ordering::Release);
        }
    }

    fn arm(&self, e: &Entry, token: u64, interest: Interest) {
        // Still armed with it (no event used it up since): nothing to change. An event that
        // fires after this check finds the source RUNNING and makes it run once more, and
        // that run re-arms.
        if e.armed.swap(armed_code(interest), Ordering::AcqRel) == armed_code(interest) {
            return;
        }
        // `e` holds the source, which keeps the fd open; MOD of an fd removed meanwhile fails
        // with ENOENT, which is fine.
        let _ = sys::epoll::modify(self.shards[e.shard].set(e.second), e.fd, mask(interest), token);
    }

    /// Runs the source on the calling thread over and over: after each run, `more` (given
    /// what the run returned) says how long to wait for the source's socket to become
    /// readable before the next run (zero: yield the processor once), or `None` to hand the
    /// source back to its worker. Its worker is not woken for it meanwhile (its registration
    /// is disarmed). This is how a thread waiting for the answer to its own small request
    /// reads that answer itself: no worker wake-up, no hand-off. False, with nothing run, when
    /// another thread runs the source now.
    pub(crate) fn drive_here(&self, token: u64, mut more: impl FnMut(Interest) -> Option<Duration>) -> bool {
        let Some(e) = self.entry(token) else { return false };
        if e.state.compare_exchange(IDLE, RUNNING, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return false;
        }
        self.arm(&e, token, Interest::Idle);
        loop {
            let interest = e.source.run(e.events.swap(0, Ordering::AcqRel));
            let wait = if interest == Interest::Gone { None } else { more(interest) };
            let Some(wait) = wait else {
                self.run_claimed(token, &e, Some(interest));
                return true;
            };
            if interest == Interest::Again {
                continue;
            }
            if wait.is_zero() {
                std::thread::yield_now();
                continue;
            }
            let events = libc::POLLIN | libc::POLLRDHUP;
            let ms = wait.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            let _ = sys::poll_one(e.fd, events, ms); // the entry keeps the fd open
        }
    }

    /// How long a waiting thread spins before it sleeps (`hixl.tcp.busy_poll_us`, or zero).
    pub(crate) fn busy_poll(&self) -> Duration {
        self.busy_poll
    }

    fn worker_loop(&self, shard: usize) {
        let me = &self.shards[shard];
        let mut evs = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
        let mut second = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
        // Low-latency mode: after activity, poll without sleeping (yielding the processor
        // between polls) until `busy_poll` passes with nothing to do.
        let mut active_until: Option<Instant> = None;
        while !self.stopping.load(Ordering::Acquire) {
            let spin = active_until.is_some_and(|t| Instant::now() < t);
            let timeout = if spin { 0 } else { -1 };
            let Ok(n) = sys::epoll::wait(&me.epfd, &mut evs, timeout) else {
                continue; // EINTR
            };
            if n == 0 {
                std::thread::yield_now();
                continue;
            }
            if !self.busy_poll.is_zero() {
                active_until = Some(Instant::now() + self.busy_poll);
            }
            for ev in &evs[..n] {
                let (token, events) = (ev.u64, ev.events);
                if token == WAKE {
                    sys::eventfd::take(&me.wake);
                    if self.stopping.load(Ordering::Acquire) {
                        return;
                    }
                    // Only what was queued before this pass: a source that asks to run
                    // again (`Interest::Again`) queues itself and rings again, so it waits
                    // for the next `epoll_wait` like every other ready source instead of
                    // holding this worker.
                    for _ in 0..me.scheduled.len() {
                        let Some(t) = me.scheduled.pop() else { break };
                        if self.stopping.load(Ordering::Acquire) {
                            return;
                        }
                        self.dispatch(t, 0);
                    }
                } else if token == SECOND {
                    // Level-triggered: more than 64 ready come back at the next pass.
                    let m = sys::epoll::wait(&me.second, &mut second, 0).unwrap_or(0);
                    for ev in &second[..m] {
                        self.dispatch(ev.u64, ev.events);
                    }
                } else {
                    self.dispatch(token, events);
                }
            }
        }
    }

    fn timer_loop(&self) {
        let mut due: Vec<(u64, Arc<dyn Tick>)> = Vec::new();
        let mut finished: Vec<u64> = Vec::new();
        loop {
            {
                let mut t = self.timers.0.lock().unwrap();
                loop {
                    if self.stopping.load(Ordering::Acquire) {
                        return;
                    }
                    // Only the entry whose tick said so: the same tick may have been added
                    // again meanwhile (a timer re-armed on demand), and that one runs on.
                    for id in finished.drain(..) {
                        t.iter_mut().filter(|e| e.id == id).for_each(|e| e.done = true);
                    }
                    t.retain(|e| !e.done && e.tick.strong_count() > 0);
                    let now = Instant::now();
                    // Each entry may run up to its slack early, so that ticks close together
                    // share one wake-up.
                    let wake = t.iter().map(|e| e.next.checked_sub(slack(e.period)).unwrap_or(e.next)).min();
                    match wake {
                        Some(w) if w <= now => break,
                        Some(w) => t = self.timers.1.wait_timeout(t, w - now).unwrap().0,
                        None => t = self.timers.1.wait(t).unwrap(),
                    }
                }
                let now = Instant::now();
                for e in t.iter_mut() {
                    if e.next <= now + slack(e.period) {
                        while e.next <= now + slack(e.period) {
                            e.next += e.period;
                        }
                        if let Some(tick) = e.tick.upgrade() {
                            due.push((e.id, tick));
                        }
                    }
                }
            }
            let now = Instant::now();
            for (id, tick) in due.drain(..) {
                if !tick.tick(now) {
                    finished.push(id);
                }
            }
        }
    }

    /// Stops every thread (bounded: workers never block in a source). Sources still
    /// registered are not run again.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        {
            let _t = self.timers.0.lock().unwrap();
            self.timers.1.notify_all();
        }
        self.shards.iter().for_each(Shard::ring);
        let me = std::thread::current().id();
        let handles = std::mem::take(&mut *self.threads.lock().unwrap());
        for h in handles {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
        self.entries.write().unwrap().clear();
        let copies = self.copies.lock().unwrap().take();
        if let Some(p) = copies {
            p.stop();
        }
    }
}

fn mask(i: Interest) -> u32 {
    let base = (libc::EPOLLONESHOT | libc::EPOLLRDHUP) as u32;
    match i {
        Interest::Read | Interest::Again => base | libc::EPOLLIN as u32,
        Interest::Write => base | libc::EPOLLOUT as u32,
        Interest::Idle | Interest::Gone => base,
    }
}

#[cfg(test)]
mod tests;
