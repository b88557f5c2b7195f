//! Non-blocking socket I/O for the I/O workers (see `reactor`): a frame assembled across as
//! many reads as it takes, reading ahead (`nbio_reader.rs`), and vectored jobs (a frame's header and its bulk straight between
//! the socket and registered memory) that move what the socket takes now and resume later.
//! No protocol logic lives here beyond the frame layout.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use crate::sys::iovs::IovQueue;
use crate::sys::mem::{KeptRanges, PinnedRanges, RawIov};
use crate::sys::sockio;
use crate::transport::io::IOV_MAX;
#[cfg(test)]
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

/// The iovecs of one frame's bytes (a header and its bulk, straight between the socket and
/// registered memory) with its position: what the socket takes now moves, the rest later.
///
/// Its iovecs and what keeps their memory valid are one [`IovQueue`] (sys/iovs.rs), the only
/// place they are made: raw memory enters through [`IoJob::push_pinned`] or
/// [`IoJob::with_owner`], which take a [`PinnedRanges`] value (whose `unsafe impl` proves its
/// ranges valid while it lives) and keep it as long as the job (the typed `owner`, `H`, is read
/// back by its holder: a served WRITE hashes its ranges when the bytes are in), and through
/// [`IoJob::push_kept`], which takes a part's checked local view ([`KeptRanges`]) and keeps its
/// keeper (the request's pins). Sending and receiving them ([`IoJob::send`], [`IoJob::recv`],
/// the hot path) are safe calls; only the tests push raw addresses (their `push_raw`, unsafe,
/// in this module's tests).
///
/// Strided ranges stay lazy in the queue, at most [`IOV_MAX`] of their iovecs at a time.
pub(crate) struct IoJob<H = ()> {
    q: IovQueue<H>,
    /// Bytes moved so far.
    pub(crate) moved: u64,
}

impl Default for IoJob<()> {
    fn default() -> Self {
        IoJob { q: IovQueue::default(), moved: 0 }
    }
}

impl<P: PinnedRanges> IoJob<P> {
    /// A job over the ranges of `p`, which it keeps (see [`IoJob::owner`]) until it drops.
    pub(crate) fn with_owner(p: P) -> Self {
        IoJob { q: IovQueue::with_owner(p), moved: 0 }
    }

    /// The pinned ranges the job was made for.
    pub(crate) fn owner(&self) -> &P {
        self.q.owner().expect("a job made by with_owner")
    }
}

impl<H> IoJob<H> {
    /// Adds the ranges of `p` and keeps `p` until the job is dropped.
    pub(crate) fn push_pinned<P: PinnedRanges + Send + 'static>(&mut self, p: P) {
        self.q.push_pinned(p)
    }

    /// Adds the ranges of `p` (a part's local side) and keeps its keeper until the job is
    /// dropped.
    pub(crate) fn push_kept<P: KeptRanges>(&mut self, p: &P) {
        self.q.push_kept(p)
    }

    /// Adds an owned buffer (sent as is).
    pub(crate) fn push_owned(&mut self, b: Vec<u8>) {
        self.q.push_owned(b)
    }

    /// Bytes left to move.
    pub(crate) fn left(&self) -> u64 {
        self.q.total() - self.moved
    }

    /// Whether every byte moved.
    pub(crate) fn is_done(&self) -> bool {
        self.q.is_done()
    }

    /// The window (see [`IovQueue::refill`]), topped up to at most [`IOV_MAX`] iovecs of
    /// strided ranges.
    pub(crate) fn refill(&mut self) -> &[RawIov] {
        self.q.refill(IOV_MAX)
    }

    /// How many iovecs the window holds now (a bound the tests check).
    #[cfg(test)]
    pub(crate) fn in_hand(&self) -> usize {
        self.q.in_hand()
    }

    fn advance(&mut self, n: usize) {
        self.moved += n as u64;
        self.q.advance(n);
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
        loop {
            let window = self.refill();
            if window.is_empty() {
                break;
            }
            if *budget == 0 {
                return Ok(Step::WouldBlock);
            }
            let window = &window[..window.len().min(IOV_MAX)];
            let r = match sockio::send_iovs(fd, window, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) {
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
        loop {
            let window = self.refill();
            if window.is_empty() {
                break;
            }
            if *budget == 0 {
                return Ok(Step::WouldBlock);
            }
            let window = &window[..window.len().min(IOV_MAX)];
            let r = match sockio::recv_iovs(fd, window, libc::MSG_DONTWAIT) {
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
