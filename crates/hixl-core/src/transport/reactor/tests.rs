//! Unit tests of the reactor: sources never run concurrently, EOF removes them, the timer ticks.
use super::*;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

struct Echo {
    sock: UnixStream,
    runs: AtomicUsize,
    inside: AtomicUsize,
    overlap: AtomicBool,
}

impl Echo {
    fn new(sock: UnixStream) -> Arc<Echo> {
        Arc::new(Echo {
            sock,
            runs: AtomicUsize::new(0),
            inside: AtomicUsize::new(0),
            overlap: AtomicBool::new(false),
        })
    }
}

impl Source for Echo {
    fn run(&self, _events: u32) -> Interest {
        if self.inside.fetch_add(1, Ordering::SeqCst) != 0 {
            self.overlap.store(true, Ordering::SeqCst);
        }
        self.runs.fetch_add(1, Ordering::SeqCst);
        let mut buf = [0u8; 64];
        let mut s = &self.sock;
        loop {
            match s.read(&mut buf) {
                Ok(0) => {
                    self.inside.fetch_sub(1, Ordering::SeqCst);
                    return Interest::Gone;
                }
                Ok(n) => {
                    let _ = s.write_all(&buf[..n]);
                }
                Err(_) => break,
            }
        }
        self.inside.fetch_sub(1, Ordering::SeqCst);
        Interest::Read
    }
}

#[test]
fn sources_run_on_readiness_and_schedule_never_concurrently() {
    let r = Reactor::start(3, Duration::ZERO, None).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let src = Echo::new(a);
    let token = r.add(src.sock.as_raw_fd(), src.clone(), Interest::Read, r.next_shard()).unwrap();
    let mut b2 = b.try_clone().unwrap();
    b2.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    for i in 0..200u32 {
        b2.write_all(&i.to_le_bytes()).unwrap();
        for _ in 0..3 {
            r.schedule(token);
        }
        r.run_here(token);
        let mut got = [0u8; 4];
        b2.read_exact(&mut got).unwrap();
        assert_eq!(u32::from_le_bytes(got), i);
    }
    assert!(!src.overlap.load(Ordering::SeqCst), "a source ran on two threads at once");
    // The peer closing ends the source: it is removed.
    drop(b2);
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.entries.read().unwrap().contains_key(&token) {
        assert!(Instant::now() < deadline, "source not removed after EOF");
        std::thread::sleep(Duration::from_millis(5));
    }
    r.stop();
}

struct Count(AtomicUsize);
impl Tick for Count {
    fn tick(&self, _now: Instant) -> bool {
        self.0.fetch_add(1, Ordering::SeqCst);
        true
    }
}

#[test]
fn the_timer_ticks_every_period_and_forgets_dropped_ticks() {
    let r = Reactor::start(1, Duration::ZERO, None).unwrap();
    let c = Arc::new(Count(AtomicUsize::new(0)));
    let weak: Weak<dyn Tick> = Arc::downgrade(&(c.clone() as Arc<dyn Tick>));
    r.every(Duration::from_millis(20), weak);
    std::thread::sleep(Duration::from_millis(230));
    let n = c.0.load(Ordering::SeqCst);
    assert!((5..=12).contains(&n), "{n} ticks in 230 ms at 20 ms");
    drop(c);
    std::thread::sleep(Duration::from_millis(50));
    assert!(r.timers.0.lock().unwrap().is_empty());
    r.stop();
}

/// Holds work of its own (like bytes a reader read ahead) and does one piece per run.
struct Backlog {
    _sock: UnixStream,
    left: AtomicUsize,
}

impl Source for Backlog {
    fn run(&self, _events: u32) -> Interest {
        match self.left.load(Ordering::SeqCst) {
            0 => Interest::Read,
            n => {
                self.left.store(n - 1, Ordering::SeqCst);
                if n > 1 {
                    Interest::Again
                } else {
                    Interest::Read
                }
            }
        }
    }
}

#[test]
fn a_source_that_stops_with_work_in_hand_runs_again_without_its_socket() {
    let r = Reactor::start(2, Duration::ZERO, None).unwrap();
    let (a, _b) = UnixStream::pair().unwrap();
    let src = Arc::new(Backlog { _sock: a, left: AtomicUsize::new(0) });
    let fd = src._sock.as_raw_fd();
    let token = r.add(fd, src.clone(), Interest::Read, r.next_shard()).unwrap();
    let drained = |src: &Backlog| {
        let until = Instant::now() + Duration::from_secs(5);
        while src.left.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        src.left.load(Ordering::SeqCst) == 0
    };
    // Scheduled once: the workers run it until its work is done; the socket stays silent.
    src.left.store(50, Ordering::SeqCst);
    r.schedule(token);
    assert!(drained(&src), "{} pieces left behind", src.left.load(Ordering::SeqCst));
    // A waiter driving it hands it back mid-way: the workers finish the rest.
    src.left.store(50, Ordering::SeqCst);
    let mut runs = 0;
    assert!(r.drive_here(token, |_| {
        runs += 1;
        (runs < 10).then_some(Duration::from_secs(1))
    }));
    assert!(drained(&src), "{} pieces left behind", src.left.load(Ordering::SeqCst));
    // While the waiter drives it, `Again` runs it at once instead of waiting a second for the
    // socket.
    src.left.store(20, Ordering::SeqCst);
    let t0 = Instant::now();
    assert!(r.drive_here(token, |_| (src.left.load(Ordering::SeqCst) > 0).then_some(Duration::from_secs(1))));
    assert!(t0.elapsed() < Duration::from_millis(500), "waited for the socket: {:?}", t0.elapsed());
    r.stop();
}

#[test]
fn a_source_that_always_asks_again_does_not_starve_its_worker() {
    let r = Reactor::start(1, Duration::ZERO, None).unwrap();
    let (a, _a2) = UnixStream::pair().unwrap();
    // Always more work in hand: it would hold its worker for ever if `Again` ran it at once.
    let greedy = Arc::new(Backlog { _sock: a, left: AtomicUsize::new(usize::MAX) });
    let g = r.add(greedy._sock.as_raw_fd(), greedy.clone(), Interest::Read, 0).unwrap();
    r.schedule(g);
    let (b, c) = UnixStream::pair().unwrap();
    b.set_nonblocking(true).unwrap();
    let echo = Echo::new(b);
    r.add(echo.sock.as_raw_fd(), echo.clone(), Interest::Read, 0).unwrap();
    let mut c = c;
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    for i in 0..20u32 {
        c.write_all(&i.to_le_bytes()).unwrap();
        let mut got = [0u8; 4];
        c.read_exact(&mut got).expect("the other source on the same worker still runs");
        assert_eq!(u32::from_le_bytes(got), i);
    }
    let runs = usize::MAX - greedy.left.load(Ordering::SeqCst);
    assert!(runs > 20, "the greedy source kept running too ({runs} runs)");
    let t0 = Instant::now();
    r.stop();
    assert!(t0.elapsed() < Duration::from_secs(2), "stop took {:?}", t0.elapsed());
}

/// Stops its first entry and, in the same run, adds itself again (as a timer armed on demand
/// does when work arrives while it disarms); ticks on after that.
struct Rearm {
    reactor: Arc<Reactor>,
    me: Mutex<Weak<dyn Tick>>,
    runs: AtomicUsize,
}
impl Tick for Rearm {
    fn tick(&self, _now: Instant) -> bool {
        if self.runs.fetch_add(1, Ordering::SeqCst) == 0 {
            self.reactor.every(Duration::from_millis(10), self.me.lock().unwrap().clone());
            return false;
        }
        true
    }
}

#[test]
fn a_tick_that_stops_one_entry_keeps_the_entry_it_added_again() {
    let r = Reactor::start(1, Duration::ZERO, None).unwrap();
    let t = Arc::new(Rearm {
        reactor: r.clone(),
        me: Mutex::new(Weak::<Count>::new()),
        runs: AtomicUsize::new(0),
    });
    let weak: Weak<dyn Tick> = Arc::downgrade(&(t.clone() as Arc<dyn Tick>));
    *t.me.lock().unwrap() = weak.clone();
    r.every(Duration::from_millis(10), weak);
    std::thread::sleep(Duration::from_millis(200));
    let n = t.runs.load(Ordering::SeqCst);
    assert!(n >= 3, "the re-added entry was dropped with the stopped one: {n} runs in 200 ms at 10 ms");
    r.stop();
}
