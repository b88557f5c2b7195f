//! Non-blocking socket I/O for the I/O workers (see `reactor`): a frame assembled across as
//! many reads as it takes, reading ahead (`nbio_reader.rs`), and vectored jobs (a frame's header and its bulk straight between
//! the socket and registered memory) that move what the socket takes now and resume later.
//! No protocol logic lives here beyond the frame layout.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use crate::sys::mem::{KeptRanges, PinnedMemory, PinnedRanges, RawIov};
use crate::sys::sockio;
use crate::transport::io::IOV_MAX;
use crate::wire::StridedRanges;

/// What one step of non-blocking I/O achieved.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// All of it moved.
    Done,
    /// The socket has no more to give (or no room) now.
    WouldBlock,
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

/// How long a job in the middle of its bytes waits for the socket before it gives the worker
/// back. A large transfer then streams in one run the way a blocking call would, instead of
/// going back to epoll every time the socket buffer fills or drains. The wait happens inside
/// the kernel (a blocking `sendmsg`/`recvmsg` bounded by the socket's send and receive
/// timeouts, see [`prepare`]): waiting in `poll` instead woke the reader for every segment
/// that arrived and cost a third of a single 128 MiB READ's bandwidth here (650 context
/// switches per READ instead of 40). A stalled peer costs the worker at most this per run,
/// and the run's budget bounds how long one stream keeps a worker.
pub(crate) const MID_JOB_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Readies a stream's socket for the I/O workers. Every call on it passes `MSG_DONTWAIT`
/// except the in-kernel mid-job wait, so the descriptor itself stays blocking, with send and
/// receive timeouts of [`MID_JOB_WAIT`] that bound that wait.
pub(crate) fn prepare(sock: &std::net::TcpStream) -> io::Result<()> {
    sock.set_nonblocking(false)?;
    sock.set_read_timeout(Some(MID_JOB_WAIT))?;
    sock.set_write_timeout(Some(MID_JOB_WAIT))
}

/// One `recv` into `buf` without blocking: how many bytes came (at least one), or None when
/// the socket has nothing now; EOF is an error.
fn recv_some(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        let r = match sockio::recv(fd, buf, libc::MSG_DONTWAIT) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if would_block(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
        }
        return Ok(Some(r));
    }
}

/// Reads into `buf[*got..]` without blocking; EOF is an error.
pub(crate) fn fill(fd: RawFd, buf: &mut [u8], got: &mut usize) -> io::Result<Step> {
    while *got < buf.len() {
        match recv_some(fd, &mut buf[*got..])? {
            Some(n) => *got += n,
            None => return Ok(Step::WouldBlock),
        }
    }
    Ok(Step::Done)
}

#[path = "nbio_reader.rs"]
mod reader;
pub(crate) use reader::FrameReader;

/// A list of iovecs to move, with its position, and the buffers some of them point into
/// (frame headers, MACs), which it owns so that they live as long as it does.
///
/// Raw memory enters a job through [`IoJob::push_pinned`] or [`IoJob::with_owner`], which
/// take a [`PinnedRanges`] value (whose `unsafe impl` proves its ranges valid while it lives)
/// and keep it as long as the job: a boxed value in `held`, or the job's typed `owner` (`H`),
/// which its holder reads back (a served WRITE hashes its ranges when the bytes are in). The
/// initiator's parts enter through [`IoJob::push_kept`], which takes a part's checked local
/// view ([`KeptRanges`]) and keeps its keeper (the request's pins). The target's staging
/// buffers still enter through [`IoJob::push_raw`], an unsafe function whose caller names what
/// keeps the memory. From then on its iovecs
/// are [`RawIov`]s, and sending and receiving them ([`IoJob::send`], [`IoJob::recv`], the hot
/// path) are safe calls.
///
/// Strided ranges are never expanded into iovecs all at once (a peer names the count): they
/// wait in `later`, in order with what was pushed after them, and [`IoJob::refill`] takes
/// iovecs from them into the window as the window drains, at most [`IOV_MAX`] at a time.
pub(crate) struct IoJob<H = ()> {
    /// The window: what the next system call moves, from `start` on.
    iovs: Vec<RawIov>,
    start: usize,
    /// What follows the window, walked into it lazily.
    later: VecDeque<Later>,
    /// Bytes pushed in all.
    total: u64,
    keep: Vec<Vec<u8>>,
    /// What keeps the raw iovecs' memory valid (pins), dropped with the job.
    held: Vec<Box<dyn Send>>,
    /// The keepers of the [`KeptRanges`] pushed (an initiator part's pins), dropped with the job.
    kept: Vec<std::sync::Arc<dyn PinnedMemory>>,
    /// Bytes moved so far.
    pub(crate) moved: u64,
    /// The pinned ranges the job was made for ([`IoJob::with_owner`]), kept until it drops.
    owner: Option<H>,
}

impl Default for IoJob<()> {
    fn default() -> Self {
        IoJob::empty()
    }
}

/// A piece of a job behind its window.
enum Later {
    Iov(RawIov),
    /// Ranges vouched for by a [`PinnedRanges`] value the job keeps (or its keeper), or in
    /// tests by the caller of `IoJob::push_strided`.
    Strided(StridedRanges),
}

impl<P: PinnedRanges> IoJob<P> {
    /// A job over the ranges of `p`, which it keeps (see [`IoJob::owner`]) until it drops.
    pub(crate) fn with_owner(p: P) -> Self {
        let mut job = IoJob::empty();
        job.push_ranges_of(&p);
        job.owner = Some(p);
        job
    }

    /// The pinned ranges the job was made for.
    pub(crate) fn owner(&self) -> &P {
        self.owner.as_ref().expect("a job made by with_owner")
    }
}

impl<H> IoJob<H> {
    fn empty() -> Self {
        IoJob {
            iovs: Vec::new(),
            start: 0,
            later: VecDeque::new(),
            total: 0,
            keep: Vec::new(),
            held: Vec::new(),
            kept: Vec::new(),
            moved: 0,
            owner: None,
        }
    }

    /// Adds the ranges of `p` and keeps `p` until the job is dropped.
    pub(crate) fn push_pinned<P: PinnedRanges + Send + 'static>(&mut self, p: P) {
        self.push_ranges_of(&p);
        self.held.push(Box::new(p));
    }

    /// Adds the ranges of `p` (a part's local side) and keeps its keeper until the job is
    /// dropped (one reference per run of pushes with the same keeper, no allocation per push).
    pub(crate) fn push_kept<P: KeptRanges>(&mut self, p: &P) {
        let keeper = p.keeper();
        if !self.kept.last().is_some_and(|k| std::sync::Arc::ptr_eq(k, keeper)) {
            self.kept.push(keeper.clone());
        }
        self.push_ranges_of(p);
    }

    /// Adds the ranges of `p` (a strided shape stays lazy). Private: its callers keep `p`, or
    /// the keeper of its ranges, for as long as the job lives.
    fn push_ranges_of<P: PinnedRanges>(&mut self, p: &P) {
        match p.strided() {
            Some(sh) => {
                if let Some(r) = StridedRanges::new(sh.addr, sh.count, sh.size, sh.stride) {
                    self.push_lazy(r)
                }
            }
            None => p.for_each_range(|addr, len| {
                if len > 0 {
                    // SAFETY: `p` vouches for every range it yields while it lives (the
                    // promise of `PinnedRanges`), and the job keeps it (in `held` or `owner`),
                    // or its keeper (in `kept`, the promise of `KeptRanges`), until it drops.
                    self.push_iov(unsafe { RawIov::new(addr, len) })
                }
            }),
        }
    }

    /// Adds an owned buffer (sent as is).
    pub(crate) fn push_owned(&mut self, b: Vec<u8>) {
        if !b.is_empty() {
            // SAFETY: the job keeps `b` (its heap buffer never moves) until it is dropped.
            self.push_iov(unsafe { RawIov::new(b.as_ptr() as u64, b.len() as u64) });
            self.keep.push(b);
        }
    }

    /// Adds `len` bytes at `addr`.
    ///
    /// # Safety
    /// As for [`RawIov::new`], until the job is dropped: the memory must stay valid (readable
    /// for a job that sends, writable for one that receives) while the job lives, usually by
    /// a pin the job or its owner holds. (The tests' way in; the transports push
    /// [`PinnedRanges`] values.)
    #[cfg(test)]
    pub(crate) unsafe fn push_raw(&mut self, addr: u64, len: u64) {
        if len > 0 {
            // SAFETY: the caller's contract.
            self.push_iov(unsafe { RawIov::new(addr, len) });
        }
    }

    /// Adds the ranges of a strided range, walked into iovecs only as the job gets to them
    /// (the tests' way in; the transports push a [`PinnedRanges`] value's strided shape).
    ///
    /// # Safety
    /// As for [`IoJob::push_raw`], for every range of `ranges`.
    #[cfg(test)]
    pub(crate) unsafe fn push_strided(&mut self, ranges: StridedRanges) {
        self.push_lazy(ranges)
    }

    /// Queues strided ranges behind the window. Its callers vouch for every range (the
    /// [`PinnedRanges`] value the job keeps, or its keeper; in tests the caller of
    /// `IoJob::push_strided`): `refill` turns them into iovecs.
    fn push_lazy(&mut self, ranges: StridedRanges) {
        let bytes: u64 = match ranges.clone().next() {
            Some((_, len)) => len.saturating_mul(ranges.remaining()),
            None => return,
        };
        self.total += bytes;
        self.later.push_back(Later::Strided(ranges));
    }

    fn push_iov(&mut self, v: RawIov) {
        self.total += v.len() as u64;
        if self.later.is_empty() {
            self.iovs.push(v);
        } else {
            self.later.push_back(Later::Iov(v));
        }
    }

    /// Bytes left to move.
    pub(crate) fn left(&self) -> u64 {
        self.total - self.moved
    }

    /// Whether every byte moved.
    pub(crate) fn is_done(&self) -> bool {
        self.start == self.iovs.len() && self.later.is_empty()
    }

    /// Tops the window up from what waits behind it (when fewer than half of [`IOV_MAX`]
    /// iovecs are left in it), so that it holds at most [`IOV_MAX`] iovecs of strided ranges;
    /// returns what is left of it.
    pub(crate) fn refill(&mut self) -> &[RawIov] {
        if !self.later.is_empty() && self.iovs.len() - self.start < IOV_MAX / 2 {
            self.iovs.drain(..self.start);
            self.start = 0;
            while self.iovs.len() < IOV_MAX {
                let Some(next) = self.later.front_mut() else { break };
                match next {
                    Later::Iov(v) => {
                        self.iovs.push(*v);
                        self.later.pop_front();
                    }
                    Later::Strided(r) => {
                        let room = IOV_MAX - self.iovs.len();
                        // SAFETY: every range was vouched for when it was queued (`push_lazy`):
                        // by the `PinnedRanges` value the job keeps until it drops (in `held`,
                        // `owner`, or its keeper in `kept`), or by the caller of `push_strided`.
                        self.iovs.extend(r.by_ref().take(room).map(|(a, n)| unsafe { RawIov::new(a, n) }));
                        if r.remaining() == 0 {
                            self.later.pop_front();
                        }
                    }
                }
            }
        }
        &self.iovs[self.start..]
    }

    /// How many iovecs the window holds now (a bound the tests check).
    #[cfg(test)]
    pub(crate) fn in_hand(&self) -> usize {
        self.iovs.len()
    }

    fn advance(&mut self, mut n: usize) {
        self.moved += n as u64;
        while n > 0 {
            let v = &mut self.iovs[self.start];
            if n >= v.len() {
                n -= v.len();
                self.start += 1;
            } else {
                v.skip(n);
                n = 0;
            }
        }
    }

    /// The mid-job wait: one blocking `sendmsg` (or `recvmsg` with `MSG_WAITALL`) of at most
    /// `budget` bytes, which the socket's timeout ([`MID_JOB_WAIT`]) bounds. False when
    /// nothing moved within it (the worker then gives the stream back to epoll).
    fn wait_and_move(&mut self, fd: RawFd, budget: &mut u64, write: bool) -> io::Result<bool> {
        let mut capped = Vec::new();
        let mut room = *budget;
        for v in self.refill().iter().take(IOV_MAX) {
            if room == 0 {
                break;
            }
            let len = (v.len() as u64).min(room);
            capped.push(v.prefix(len as usize));
            room -= len;
        }
        let r = if write {
            sockio::send_iovs(fd, &capped, libc::MSG_NOSIGNAL)
        } else {
            sockio::recv_iovs(fd, &capped, libc::MSG_WAITALL)
        };
        let r = match r {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(true),
            Err(e) if would_block(&e) => return Ok(false),
            Err(e) => return Err(e),
        };
        if r == 0 && !write {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
        }
        *budget = budget.saturating_sub(r as u64);
        self.advance(r);
        Ok(r > 0)
    }

    /// Sends what the socket takes now, at most about `budget` bytes.
    pub(crate) fn send(&mut self, fd: RawFd, budget: &mut u64) -> io::Result<Step> {
        while !self.refill().is_empty() {
            if *budget == 0 {
                return Ok(Step::WouldBlock);
            }
            let end = self.iovs.len().min(self.start + IOV_MAX);
            let r = match sockio::send_iovs(
                fd,
                &self.iovs[self.start..end],
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            ) {
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if would_block(&e) => {
                    if self.moved > 0 && self.wait_and_move(fd, budget, true)? {
                        continue;
                    }
                    return Ok(Step::WouldBlock);
                }
                Err(e) => return Err(e),
            };
            *budget = budget.saturating_sub(r as u64);
            self.advance(r);
        }
        Ok(Step::Done)
    }

    /// Receives into the iovecs what has arrived, at most about `budget` bytes; EOF is an
    /// error. After an error, `moved` says how many bytes of the stream were consumed.
    pub(crate) fn recv(&mut self, fd: RawFd, budget: &mut u64) -> io::Result<Step> {
        while !self.refill().is_empty() {
            if *budget == 0 {
                return Ok(Step::WouldBlock);
            }
            let end = self.iovs.len().min(self.start + IOV_MAX);
            let r = match sockio::recv_iovs(fd, &self.iovs[self.start..end], libc::MSG_DONTWAIT) {
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if would_block(&e) => {
                    if self.moved > 0 && self.wait_and_move(fd, budget, false)? {
                        continue;
                    }
                    return Ok(Step::WouldBlock);
                }
                Err(e) => return Err(e),
            };
            if r == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
            }
            *budget = budget.saturating_sub(r as u64);
            self.advance(r);
        }
        Ok(Step::Done)
    }
}

/// Reads and drops up to `*left` bytes without blocking (the bulk of a refused frame).
pub(crate) fn discard(fd: RawFd, left: &mut u64) -> io::Result<Step> {
    let mut scratch = [0u8; 16 * 1024];
    while *left > 0 {
        let k = (*left).min(scratch.len() as u64) as usize;
        let mut got = 0;
        let step = fill(fd, &mut scratch[..k], &mut got)?;
        *left -= got as u64;
        if step == Step::WouldBlock {
            return Ok(Step::WouldBlock);
        }
    }
    Ok(Step::Done)
}

/// What one direction of a stream still has to send, in order: frames are sealed as they are
/// queued, so the order here is the order of their sequence numbers.
#[derive(Default)]
pub(crate) struct Outbox {
    jobs: VecDeque<IoJob>,
    /// Bytes queued (not yet sent) in all.
    pub(crate) bytes: u64,
}

impl Outbox {
    /// Queues a sealed frame.
    pub(crate) fn push_frame(&mut self, b: Vec<u8>) {
        let mut j = IoJob::default();
        j.push_owned(b);
        self.push(j);
    }

    /// Queues a job.
    pub(crate) fn push(&mut self, j: IoJob) {
        self.bytes += j.left();
        self.jobs.push_back(j);
    }

    /// Whether nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Jobs queued.
    pub(crate) fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Sends queued jobs until the socket is full, the budget is spent or nothing is left
    /// (then `Done`).
    pub(crate) fn flush(&mut self, fd: RawFd, budget: &mut u64) -> io::Result<Step> {
        while let Some(j) = self.jobs.front_mut() {
            let before = j.left();
            let step = j.send(fd, budget)?;
            self.bytes -= before - j.left();
            if step == Step::WouldBlock {
                return Ok(Step::WouldBlock);
            }
            self.jobs.pop_front();
        }
        Ok(Step::Done)
    }

    /// Drops everything queued (the stream is closing).
    pub(crate) fn clear(&mut self) {
        self.jobs.clear();
        self.bytes = 0;
    }
}

#[cfg(test)]
#[path = "nbio_tests.rs"]
mod tests;
