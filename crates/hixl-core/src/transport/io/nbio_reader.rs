//! The read side of a stream for the I/O workers: [`FrameReader`] assembles one frame at a
//! time and reads ahead, handing the bytes it holds to whoever reads the stream next.

use std::io;
use std::os::fd::RawFd;

use super::{discard, fill, recv_some, IoJob, Step};
use crate::auth::{FrameMac, MAC_LEN};
use crate::sys::mem::RawIov;
use crate::transport::io::{proto, Received, PAYLOAD_START};
use crate::transport::reactor::Interest;
use crate::wire::{self, Header, HEADER_LEN};

/// How many bytes a stream's reader asks the socket for when it looks for the next frame. A
/// small request's header, descriptors and bytes then come in one system call instead of
/// three, and a read that returns less than this says the socket is empty, which saves the
/// read that would only report EAGAIN. Bulk bytes that arrive with a frame (at most this many
/// per frame) are copied into their memory once the kernel has checked that it may write
/// there (see [`FrameReader::copy_into`]); the rest of a bulk goes straight from the socket
/// into its memory.
pub(crate) const READ_AHEAD: usize = 8 * 1024;

/// Most iovecs one copy out of the read-ahead buffer covers (kept on the stack).
const COPY_IOVS: usize = 32;

/// `/dev/zero`, opened once: reading it into memory is how a reader checks that the memory
/// it copies bytes read ahead into is still writable (see [`FrameReader::copy_into`]); None
/// where it cannot be opened (then nothing past a frame is read ahead).
pub(super) fn zero_source() -> Option<RawFd> {
    static ZERO: std::sync::OnceLock<Option<std::fs::File>> = std::sync::OnceLock::new();
    use std::os::fd::AsRawFd;
    ZERO.get_or_init(|| std::fs::File::open("/dev/zero").ok()).as_ref().map(|f| f.as_raw_fd())
}

/// How many bytes at the start of `dst` the kernel could write, found by reading
/// `/dev/zero` into them (which zeroes them): all of them, or up to the first byte of memory
/// that is unmapped or may not be written (EFAULT). Looks at the first [`COPY_IOVS`] iovecs
/// of `dst` only (see `sys::mem::writable_prefix`).
pub(super) fn writable_prefix(zero: RawFd, dst: &[RawIov]) -> usize {
    crate::sys::mem::writable_prefix::<COPY_IOVS>(zero, dst)
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
    /// Payload then MAC: `rest_want` bytes, received into `rest` (grown as they arrive).
    rest: Vec<u8>,
    rest_got: usize,
    rest_want: usize,
    /// After the handshake: which direction this reader's frames travel (true: from an
    /// initiator to a target), whose kinds alone are accepted; None: any kind.
    to_target: Option<bool>,
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
    /// A reader of a stream after its handshake that accepts only the kinds of one direction
    /// (`to_target`: a served stream, reading what an initiator sends), checked on the header.
    pub(crate) fn after_handshake(to_target: bool) -> FrameReader {
        FrameReader { to_target: Some(to_target), ..FrameReader::default() }
    }

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

    /// What a reader run that ends with `next` asks of the reactor: to wait for its socket,
    /// unless bytes read ahead are still here (then `Again`: run again without it).
    pub(crate) fn end_run(&self, next: Interest) -> Interest {
        if next == Interest::Read && self.has_buffered() {
            Interest::Again
        } else {
            next
        }
    }

    /// Bytes set aside for the payload of the frame under way (what the tests bound).
    #[cfg(test)]
    pub(crate) fn payload_capacity(&self) -> usize {
        self.rest.capacity()
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
        match recv_some(fd, &mut self.ahead[..ask])? {
            Some(n) => {
                self.hi = n;
                self.drained = n < ask;
                Ok(Step::Done)
            }
            None => {
                self.drained = true;
                Ok(Step::WouldBlock)
            }
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
    pub(crate) fn recv_job<H>(
        &mut self,
        fd: RawFd,
        job: &mut IoJob<H>,
        budget: &mut u64,
    ) -> io::Result<Step> {
        let took = self.has_buffered();
        while self.has_buffered() && !job.is_done() {
            let k = self.copy_into(job)?;
            *budget = budget.saturating_sub(k as u64);
        }
        if job.is_done() {
            return Ok(Step::Done);
        }
        if self.drained && !took {
            return Ok(Step::WouldBlock);
        }
        job.recv(fd, budget)
    }

    /// Copies bytes read ahead into the job's next iovecs. Registered memory that its owner
    /// unmapped or write-protected since must fail the request with EFAULT, as a `recvmsg`
    /// into it does, not crash the process: so the kernel first writes zeros there (one
    /// `readv` of `/dev/zero`, which fails with EFAULT on memory it may not write; a third of
    /// what a `process_vm_writev` on this process costs here), then the bytes are copied. An
    /// owner that unmaps the memory between the two, while a transfer into it is under way,
    /// is not caught. Returns how many bytes moved; EFAULT (with those that did moved) when
    /// the memory refused them.
    fn copy_into<H>(&mut self, job: &mut IoJob<H>) -> io::Result<usize> {
        let Some(zero) = zero_source() else {
            return Err(io::Error::other("bytes were read ahead without a way to check their memory"));
        };
        // At most COPY_IOVS iovecs per call (the caller calls again for the rest): no
        // allocation on the path of every small WRITE.
        let mut want = self.hi - self.lo;
        let mut slots = [RawIov::EMPTY; COPY_IOVS];
        let mut used = 0;
        for v in job.refill().iter().take(COPY_IOVS) {
            if want == 0 {
                break;
            }
            let len = v.len().min(want);
            slots[used] = v.prefix(len);
            used += 1;
            want -= len;
        }
        let dst = &slots[..used];
        let k: usize = dst.iter().map(|v| v.len()).sum();
        let ok = writable_prefix(zero, dst); // copy those, then fail if short
        let mut from = self.lo;
        let mut left = ok;
        for v in dst {
            // The kernel just wrote these bytes of the job's memory.
            let n = v.prefix(left).copy_from(&self.ahead[from..from + v.len().min(left)]);
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
    /// the bytes read ahead first, and at most about `budget` of them in this run (a peer
    /// that streams a huge refused bulk does not keep the worker: WouldBlock when the budget
    /// is spent).
    pub(crate) fn discard(&mut self, fd: RawFd, left: &mut u64, budget: &mut u64) -> io::Result<Step> {
        let k = ((self.hi - self.lo) as u64).min(*left);
        self.lo += k as usize;
        *left -= k;
        *budget = budget.saturating_sub(k);
        if *left == 0 {
            return Ok(Step::Done);
        }
        if self.drained || *budget == 0 {
            return Ok(Step::WouldBlock);
        }
        let mut now = (*left).min(*budget);
        let before = now;
        discard(fd, &mut now)?;
        *left -= before - now;
        *budget -= before - now;
        // Not all of it: the socket ran dry or the budget is spent.
        Ok(if *left == 0 { Step::Done } else { Step::WouldBlock })
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
                if let Some(to_target) = self.to_target {
                    wire::after_handshake(&h, to_target).map_err(proto)?;
                }
                let mac_len = if mac.sealed() { MAC_LEN } else { 0 };
                self.rest_want = h.payload_len as usize + mac_len;
                self.rest.clear();
                self.rest.resize(self.rest_want.min(PAYLOAD_START), 0);
                self.rest_got = 0;
                self.header = Some(h);
                h
            }
        };
        loop {
            let (mut rest, mut rest_got) = (std::mem::take(&mut self.rest), self.rest_got);
            let step = self.fill(fd, &mut rest, &mut rest_got);
            (self.rest, self.rest_got) = (rest, rest_got);
            if step? == Step::WouldBlock {
                return Ok(None);
            }
            if self.rest.len() == self.rest_want {
                break;
            }
            // All that was set aside arrived: twice as much for the rest.
            let grown = (self.rest.len() * 2).min(self.rest_want);
            self.rest.resize(grown, 0);
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
