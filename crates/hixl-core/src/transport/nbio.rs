//! Non-blocking socket I/O for the I/O workers (see `reactor`): a frame assembled across as
//! many reads as it takes, and vectored jobs (a frame's header and its bulk straight between
//! the socket and registered memory) that move what the socket takes now and resume later.
//! No protocol logic lives here beyond the frame layout.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use crate::auth::{FrameMac, MAC_LEN};
use crate::transport::io::{proto, Received, IOV_MAX};
use crate::wire::{self, Header, HEADER_LEN};

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

/// Reads into `buf[*got..]` without blocking; EOF is an error.
pub(crate) fn fill(fd: RawFd, buf: &mut [u8], got: &mut usize) -> io::Result<Step> {
    while *got < buf.len() {
        // SAFETY: the pointer and length describe the unfilled rest of `buf`.
        let r =
            unsafe { libc::recv(fd, buf[*got..].as_mut_ptr().cast(), buf.len() - *got, libc::MSG_DONTWAIT) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if would_block(&e) {
                return Ok(Step::WouldBlock);
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
        }
        *got += r as usize;
    }
    Ok(Step::Done)
}

/// How many bytes a stream's reader asks the socket for when it looks for the next frame. A
/// small request's header, descriptors and bytes then come in one system call instead of
/// three, and a read that returns less than this says the socket is empty, which saves the
/// read that would only report EAGAIN. Bulk bytes that arrive with a frame (at most this many
/// per frame) are copied into their memory once the kernel has checked that it may write
/// there (see [`FrameReader::copy_into`]); the rest of a bulk goes straight from the socket
/// into its memory.
pub(crate) const READ_AHEAD: usize = 8 * 1024;

/// `/dev/zero`, opened once: reading it into memory is how a reader checks that the memory
/// it copies bytes read ahead into is still writable (see [`FrameReader::copy_into`]); None
/// where it cannot be opened (then nothing past a frame is read ahead).
fn zero_source() -> Option<RawFd> {
    static ZERO: std::sync::OnceLock<Option<std::fs::File>> = std::sync::OnceLock::new();
    use std::os::fd::AsRawFd;
    ZERO.get_or_init(|| std::fs::File::open("/dev/zero").ok()).as_ref().map(|f| f.as_raw_fd())
}

/// Assembles one frame at a time: header, payload and (on a sealed stream) MAC, checked
/// before decoding. It reads ahead (see [`READ_AHEAD`]): whoever reads the bulk after a frame
/// takes it through [`FrameReader::fill`], [`FrameReader::recv_job`] or
/// [`FrameReader::discard`], which hand out the bytes read ahead first.
#[derive(Default)]
pub(crate) struct FrameReader {
    head: [u8; HEADER_LEN],
    got: usize,
    header: Option<Header>,
    /// Payload then MAC.
    rest: Vec<u8>,
    rest_got: usize,
    /// Bytes read from the socket but not yet handed out: `ahead[lo..hi]` (allocated on first
    /// use).
    ahead: Vec<u8>,
    lo: usize,
    hi: usize,
    /// The last read in this run returned less than it asked for: the socket was empty then.
    /// Anything that arrives later makes the re-armed registration fire, so until the next
    /// run the reader does not ask the socket again.
    drained: bool,
}

impl FrameReader {
    /// Starts a run of the stream's reader (every wake-up, whatever woke it): whether the
    /// socket is empty is known only from this run's reads.
    pub(crate) fn begin_run(&mut self) {
        self.drained = false;
    }

    /// Whether bytes read ahead wait here: a reader that stops with some (for fairness)
    /// must be run again, since the socket may never become readable for them.
    pub(crate) fn has_buffered(&self) -> bool {
        self.lo < self.hi
    }

    /// Copies bytes read ahead into `dst`; returns how many.
    fn take(&mut self, dst: &mut [u8]) -> usize {
        let k = (self.hi - self.lo).min(dst.len());
        dst[..k].copy_from_slice(&self.ahead[self.lo..self.lo + k]);
        self.lo += k;
        k
    }

    /// One read into the (empty) read-ahead buffer: up to [`READ_AHEAD`] bytes, or only the
    /// `need` bytes the caller misses where `/dev/zero` cannot be opened (a sandbox): then no
    /// bulk byte is ever read ahead (see [`FrameReader::copy_into`]).
    fn refill(&mut self, fd: RawFd, need: usize) -> io::Result<Step> {
        debug_assert!(!self.has_buffered());
        if self.drained {
            return Ok(Step::WouldBlock);
        }
        if self.ahead.is_empty() {
            self.ahead = vec![0; READ_AHEAD];
        }
        let ask = if zero_source().is_some() { READ_AHEAD } else { need.min(READ_AHEAD) };
        (self.lo, self.hi) = (0, 0);
        loop {
            // SAFETY: the pointer and length describe (a prefix of) `ahead`, which is ours.
            let r = unsafe { libc::recv(fd, self.ahead.as_mut_ptr().cast(), ask, libc::MSG_DONTWAIT) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                if would_block(&e) {
                    self.drained = true;
                    return Ok(Step::WouldBlock);
                }
                return Err(e);
            }
            if r == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
            }
            self.hi = r as usize;
            self.drained = self.hi < ask;
            return Ok(Step::Done);
        }
    }

    /// Fills `buf[*got..]` without blocking, from the bytes read ahead and then the socket
    /// (straight into `buf` when what is missing is at least [`READ_AHEAD`]); EOF is an error.
    pub(crate) fn fill(&mut self, fd: RawFd, buf: &mut [u8], got: &mut usize) -> io::Result<Step> {
        loop {
            *got += self.take(&mut buf[*got..]);
            if *got == buf.len() {
                return Ok(Step::Done);
            }
            if self.drained {
                return Ok(Step::WouldBlock);
            }
            if buf.len() - *got >= READ_AHEAD {
                return fill(fd, buf, got);
            }
            if self.refill(fd, buf.len() - *got)? == Step::WouldBlock {
                return Ok(Step::WouldBlock);
            }
        }
    }

    /// Moves the bytes read ahead into `job`, then receives the rest of it from the socket
    /// as [`IoJob::recv`] does.
    ///
    /// # Safety
    /// As for [`IoJob::recv`].
    pub(crate) unsafe fn recv_job(
        &mut self,
        fd: RawFd,
        job: &mut IoJob,
        budget: &mut u64,
    ) -> io::Result<Step> {
        let took = self.has_buffered();
        while self.has_buffered() && job.start < job.iovs.len() {
            // SAFETY: the caller's contract.
            let k = unsafe { self.copy_into(job) }?;
            *budget = budget.saturating_sub(k as u64);
        }
        if job.start == job.iovs.len() {
            return Ok(Step::Done);
        }
        if self.drained && !took {
            return Ok(Step::WouldBlock);
        }
        // SAFETY: the caller's contract.
        unsafe { job.recv(fd, budget) }
    }

    /// Copies bytes read ahead into the job's next iovecs. Registered memory that its owner
    /// unmapped or write-protected since must fail the request with EFAULT, as a `recvmsg`
    /// into it does, not crash the process: so the kernel first writes zeros there (one
    /// `readv` of `/dev/zero`, which fails with EFAULT on memory it may not write; a third of
    /// what a `process_vm_writev` on this process costs here), then the bytes are copied. An
    /// owner that unmaps the memory between the two, while a transfer into it is under way,
    /// is not caught. Returns how many bytes moved; EFAULT (with those that did moved) when
    /// the memory refused them.
    ///
    /// # Safety
    /// As for [`IoJob::recv`].
    unsafe fn copy_into(&mut self, job: &mut IoJob) -> io::Result<usize> {
        let Some(zero) = zero_source() else {
            return Err(io::Error::other("bytes were read ahead without a way to check their memory"));
        };
        // At most this many iovecs per call (the caller calls again for the rest): no
        // allocation on the path of every small WRITE.
        const PER_CALL: usize = 32;
        let mut want = self.hi - self.lo;
        let mut slots = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; PER_CALL];
        let mut used = 0;
        for v in job.iovs[job.start..].iter().take(PER_CALL) {
            if want == 0 {
                break;
            }
            let len = v.iov_len.min(want);
            slots[used] = libc::iovec { iov_base: v.iov_base, iov_len: len };
            used += 1;
            want -= len;
        }
        let dst = &slots[..used];
        let k: usize = dst.iter().map(|v| v.iov_len).sum();
        // SAFETY: `dst` describes the job's memory, writable by the caller's contract; the
        // kernel checks it and fails with EFAULT where it is not, never faults us.
        let r = unsafe { libc::readv(zero, dst.as_ptr(), dst.len() as libc::c_int) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let ok = r as usize; // bytes the kernel could write: copy those, then fail if short
        let mut from = self.lo;
        let mut left = ok;
        for v in dst {
            let n = v.iov_len.min(left);
            // SAFETY: the kernel just wrote these `n` bytes of the job's memory; the source is
            // our buffer, which cannot overlap it.
            unsafe { std::ptr::copy_nonoverlapping(self.ahead[from..].as_ptr(), v.iov_base.cast::<u8>(), n) };
            from += n;
            left -= n;
        }
        self.lo += ok;
        job.advance(ok);
        if ok < k {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        Ok(ok)
    }

    /// Reads and drops up to `*left` bytes without blocking (the bulk of a refused frame),
    /// the bytes read ahead first.
    pub(crate) fn discard(&mut self, fd: RawFd, left: &mut u64) -> io::Result<Step> {
        let k = ((self.hi - self.lo) as u64).min(*left);
        self.lo += k as usize;
        *left -= k;
        if *left == 0 {
            return Ok(Step::Done);
        }
        if self.drained {
            return Ok(Step::WouldBlock);
        }
        discard(fd, left)
    }

    /// Reads what has arrived; `Some` once a whole frame is in (the next call starts the next
    /// frame). InvalidData for a malformed frame or a wrong MAC.
    pub(crate) fn poll(&mut self, fd: RawFd, mac: &mut FrameMac) -> io::Result<Option<Received>> {
        let h = match self.header {
            Some(h) => h,
            None => {
                let (mut head, mut got) = (self.head, self.got);
                let step = self.fill(fd, &mut head, &mut got);
                (self.head, self.got) = (head, got);
                if step? == Step::WouldBlock {
                    return Ok(None);
                }
                let h = wire::decode_header(&self.head).map_err(proto)?;
                let mac_len = if mac.sealed() { MAC_LEN } else { 0 };
                self.rest.clear();
                self.rest.resize(h.payload_len as usize + mac_len, 0);
                self.rest_got = 0;
                self.header = Some(h);
                h
            }
        };
        let (mut rest, mut rest_got) = (std::mem::take(&mut self.rest), self.rest_got);
        let step = self.fill(fd, &mut rest, &mut rest_got);
        (self.rest, self.rest_got) = (rest, rest_got);
        if step? == Step::WouldBlock {
            return Ok(None);
        }
        self.header = None;
        self.got = 0;
        let (payload, tag) = self.rest.split_at(h.payload_len as usize);
        let seq = mac
            .open(&[&self.head, payload], tag)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let frame = wire::decode_payload(&h, payload).map_err(proto)?;
        Ok(Some(Received { header: h, frame, seq }))
    }
}

/// A list of iovecs to move, with its position, and the buffers some of them point into
/// (frame headers, MACs), which it owns so that they live as long as it does.
#[derive(Default)]
pub(crate) struct IoJob {
    iovs: Vec<libc::iovec>,
    start: usize,
    keep: Vec<Vec<u8>>,
    /// What keeps the raw iovecs' memory valid (pins), dropped with the job.
    held: Vec<Box<dyn Send>>,
    /// Bytes moved so far.
    pub(crate) moved: u64,
}

// SAFETY: the iovecs point into the job's own buffers or into registered memory that the
// job's owner keeps pinned; the job is moved between threads, never shared.
unsafe impl Send for IoJob {}

impl IoJob {
    /// Adds an owned buffer (sent as is).
    pub(crate) fn push_owned(&mut self, b: Vec<u8>) {
        if !b.is_empty() {
            self.iovs.push(libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() });
            self.keep.push(b);
        }
    }

    /// Adds `len` bytes at `addr` (memory the owner keeps valid until the job ends).
    pub(crate) fn push_raw(&mut self, addr: u64, len: u64) {
        if len > 0 {
            self.iovs.push(libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len as usize });
        }
    }

    /// Keeps `x` (a pin of the memory the job points into) until the job is dropped.
    pub(crate) fn hold(&mut self, x: Box<dyn Send>) {
        self.held.push(x);
    }

    /// Bytes left to move.
    pub(crate) fn left(&self) -> u64 {
        self.iovs[self.start..].iter().map(|v| v.iov_len as u64).sum()
    }

    fn advance(&mut self, mut n: usize) {
        self.moved += n as u64;
        while n > 0 {
            let v = &mut self.iovs[self.start];
            if n >= v.iov_len {
                n -= v.iov_len;
                self.start += 1;
            } else {
                // SAFETY: n < iov_len: the new base stays inside the same buffer.
                v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
    }

    /// The mid-job wait: one blocking `sendmsg` (or `recvmsg` with `MSG_WAITALL`) of at most
    /// `budget` bytes, which the socket's timeout ([`MID_JOB_WAIT`]) bounds. False when
    /// nothing moved within it (the worker then gives the stream back to epoll).
    ///
    /// # Safety
    /// As for [`IoJob::send`] (`write`) or [`IoJob::recv`].
    unsafe fn wait_and_move(&mut self, fd: RawFd, budget: &mut u64, write: bool) -> io::Result<bool> {
        let mut capped = Vec::new();
        let mut room = *budget;
        for v in self.iovs[self.start..].iter().take(IOV_MAX) {
            if room == 0 {
                break;
            }
            let len = (v.iov_len as u64).min(room);
            capped.push(libc::iovec { iov_base: v.iov_base, iov_len: len as usize });
            room -= len;
        }
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = capped.as_mut_ptr();
        msg.msg_iovlen = capped.len();
        // SAFETY: the iovecs are a prefix of the job's, which describe readable (sending) or
        // writable (receiving) memory by the caller's contract.
        let r = unsafe {
            if write {
                libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL)
            } else {
                libc::recvmsg(fd, &mut msg, libc::MSG_WAITALL)
            }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::Interrupted => Ok(true),
                _ if would_block(&e) => Ok(false),
                _ => Err(e),
            };
        }
        if r == 0 && !write {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
        }
        *budget = budget.saturating_sub(r as u64);
        self.advance(r as usize);
        Ok(r > 0)
    }

    /// Sends what the socket takes now, at most about `budget` bytes.
    ///
    /// # Safety
    /// Every raw iovec must describe readable memory that stays valid during the call.
    pub(crate) unsafe fn send(&mut self, fd: RawFd, budget: &mut u64) -> io::Result<Step> {
        while self.start < self.iovs.len() {
            if *budget == 0 {
                return Ok(Step::WouldBlock);
            }
            // SAFETY: msghdr is plain data; all-zero is a valid empty header.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = self.iovs[self.start..].as_mut_ptr();
            msg.msg_iovlen = (self.iovs.len() - self.start).min(IOV_MAX);
            // SAFETY: the iovecs describe readable memory (the caller's contract).
            let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                if would_block(&e) {
                    // SAFETY: the caller's contract.
                    if self.moved > 0 && unsafe { self.wait_and_move(fd, budget, true) }? {
                        continue;
                    }
                    return Ok(Step::WouldBlock);
                }
                return Err(e);
            }
            *budget = budget.saturating_sub(r as u64);
            self.advance(r as usize);
        }
        Ok(Step::Done)
    }

    /// Receives into the iovecs what has arrived, at most about `budget` bytes; EOF is an
    /// error. After an error, `moved` says how many bytes of the stream were consumed.
    ///
    /// # Safety
    /// Every raw iovec must describe writable memory that stays valid during the call.
    pub(crate) unsafe fn recv(&mut self, fd: RawFd, budget: &mut u64) -> io::Result<Step> {
        while self.start < self.iovs.len() {
            if *budget == 0 {
                return Ok(Step::WouldBlock);
            }
            // SAFETY: msghdr is plain data; all-zero is a valid empty header.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = self.iovs[self.start..].as_mut_ptr();
            msg.msg_iovlen = (self.iovs.len() - self.start).min(IOV_MAX);
            // SAFETY: the iovecs describe writable memory (the caller's contract).
            let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                if would_block(&e) {
                    // SAFETY: the caller's contract.
                    if self.moved > 0 && unsafe { self.wait_and_move(fd, budget, false) }? {
                        continue;
                    }
                    return Ok(Step::WouldBlock);
                }
                return Err(e);
            }
            if r == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
            }
            *budget = budget.saturating_sub(r as u64);
            self.advance(r as usize);
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
    ///
    /// # Safety
    /// As for [`IoJob::send`], for every queued job.
    pub(crate) unsafe fn flush(&mut self, fd: RawFd, budget: &mut u64) -> io::Result<Step> {
        while let Some(j) = self.jobs.front_mut() {
            let before = j.left();
            // SAFETY: the caller's contract.
            let step = unsafe { j.send(fd, budget) }?;
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
