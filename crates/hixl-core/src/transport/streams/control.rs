//! The TCP link as a control channel: the peer's region table (whole tables and deltas,
//! queries, confirmations), BackendOpen, heartbeats and liveness (see `transport::control`).

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::RwLockReadGuard;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::queue::Part;
use crate::registry::RemoteTable;
use crate::stats::PeerStats;
use crate::transport::control::channel::{ControlChannel, OnClose};
use crate::transport::control::liveness;
use crate::transport::io;
use crate::transport::io::addr_text;
use crate::transport::reactor::Tick;
use crate::transport::streams::{Stream, TcpLink};
use crate::transport::{DataPath, PeerInfo};
use crate::wire::{Frame, RegionEntry};

impl Tick for TcpLink {
    /// Every heartbeat interval (from the engine's timer): samples the peer's progress, closes
    /// the link once `liveness::MISSED` samples in a row showed none, and probes the peer on
    /// each stream that has nothing queued to send. The sample comes before this tick's probes:
    /// the last tick's are acknowledged by now (by a live kernel), so how fast an
    /// acknowledgement comes back never reads as progress.
    fn tick(&self, now: Instant) -> bool {
        if !self.alive() {
            return false;
        }
        let mut beat = self.beat.lock().unwrap();
        let mut progress: i128 = -(beat.probes_sent as i128);
        // Whether this process, not the peer, is behind: bytes from the peer wait unread, or
        // our frames wait in user space while the kernel has nothing of ours left to send.
        let mut behind = false;
        for s in &self.streams {
            let fd = s.sock.as_raw_fd();
            let Some((received, acked)) = liveness::tcp_progress(fd) else { return false };
            progress += received as i128 + acked as i128;
            let unsent = s.tx.try_lock().map_or(true, |tx| !tx.out.is_empty());
            behind |=
                io::unread_bytes(fd).is_some_and(|n| n > 0) || (unsent && io::queued_bytes(fd) == Some(0));
        }
        let (missed, dead) = beat.live.observe_counting(progress, now, behind);
        if missed {
            self.done.stats().heartbeat_misses.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(silent) = dead {
            let every = beat.every;
            drop(beat);
            DataPath::close(
                self,
                Error::not_connected(format!(
                    "{} stopped answering: no progress for {} ms ({} heartbeats of {} ms missed)",
                    self.peer,
                    silent.as_millis(),
                    liveness::MISSED,
                    every.as_millis()
                )),
            );
            return false;
        }
        for s in &self.streams {
            // Only where nothing is queued, so that a probe never waits behind data (a cut link
            // leaves data queued; then the missing progress speaks for itself).
            let idle = s.tx.try_lock().is_ok_and(|tx| tx.out.is_empty());
            if idle && io::queued_bytes(s.sock.as_raw_fd()) == Some(0) {
                beat.probes_sent += self.send_own(s, &Frame::Heartbeat, 0);
            }
        }
        true
    }
}

impl TcpLink {
    /// Replaces the peer's region table unless ours is newer (waiting for direct copies that
    /// hold the old one) and wakes `refresh_table` / `wait_table_version` callers.
    pub(super) fn install_table(&self, version: u64, regions: Vec<RegionEntry>, answers: Option<u64>) {
        {
            let mut t = self.table.write().unwrap();
            if version >= self.table_version.load(Ordering::Acquire) {
                *t = RemoteTable::new(regions);
                self.table_version.store(version, Ordering::Release);
            }
        }
        self.tables_changed(answers);
    }

    /// Applies a delta to the peer's region table: ignored when ours is already as new; an
    /// error when it starts after ours (a change would be lost).
    pub(super) fn apply_delta(
        &self,
        from: u64,
        version: u64,
        added: Vec<RegionEntry>,
        removed: &[u64],
    ) -> Result<()> {
        {
            let mut t = self.table.write().unwrap();
            let ours = self.table_version.load(Ordering::Acquire);
            if version <= ours {
                return Ok(());
            }
            if from > ours {
                return Err(Error::not_connected(format!(
                    "{} sent region-table changes from version {from}, but this engine has version {ours}: \
                     closing the link",
                    self.peer
                )));
            }
            t.apply(added, removed);
            self.table_version.store(version, Ordering::Release);
        }
        self.tables_changed(None);
        Ok(())
    }

    fn tables_changed(&self, answers: Option<u64>) {
        let mut answered = self.tables.0.lock().unwrap();
        if let Some(tag) = answers {
            *answered = (*answered).max(tag);
        }
        self.tables.1.notify_all();
    }

    /// Confirms region-table `version` to the peer (queued on the stream; never waits).
    pub(super) fn confirm_table(&self, s: &Stream, version: u64) {
        self.send_own(s, &Frame::RegionsAck { version }, 0);
    }

    /// The reader's half of `open_backend`: records the answer to BackendOpen `tag`.
    pub(super) fn backend_opened(&self, tag: u64, res: Result<Vec<u8>>) {
        let _g = self.tables.0.lock().unwrap();
        let mut o = self.opened.lock().unwrap();
        if o.len() < 64 {
            o.push((tag, res));
        }
        self.tables.1.notify_all();
    }
}

impl ControlChannel for TcpLink {
    /// Waits (up to `timeout`) until the installed region table has at least `version`.
    fn wait_table_version(&self, version: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut n = self.tables.0.lock().unwrap();
        while self.table_version.load(Ordering::Acquire) < version {
            let left = deadline.saturating_duration_since(Instant::now());
            if !DataPath::is_alive(self) || left.is_zero() {
                return Err(Error::timeout(format!(
                    "{} did not send region table version {version} in time",
                    self.peer
                )));
            }
            n = self.tables.1.wait_timeout(n, left.min(Duration::from_millis(50))).unwrap().0;
        }
        Ok(())
    }

    /// Our descriptor of stream 0 (the same-host proof shows it to the peer).
    fn stream0_fd(&self) -> std::os::fd::RawFd {
        self.streams[0].sock.as_raw_fd()
    }

    /// The two ends of stream 0 (ours, the peer's), as the same-host proof names them.
    fn stream0_ends(&self) -> Result<(String, String)> {
        let s = &self.streams[0].sock;
        let ends = s.local_addr().and_then(|l| Ok((l, s.peer_addr()?)));
        let (l, p) = ends.map_err(|e| Error::not_connected(format!("stream to {}: {e}", self.peer)))?;
        Ok((addr_text(l), addr_text(p)))
    }

    /// The peer's address as the engine was asked to connect to it.
    fn peer(&self) -> &str {
        &self.peer
    }

    /// Handshake facts about the peer (`regions` as of the handshake).
    fn handshake(&self) -> &PeerInfo {
        &self.info
    }

    /// Handshake facts about the peer (its table as of now).
    fn peer_info(&self) -> PeerInfo {
        PeerInfo { regions: self.table.read().unwrap().clone(), ..self.info.clone() }
    }

    /// The peer's current region table; hold the guard only briefly (updates wait for it).
    fn table(&self) -> RwLockReadGuard<'_, RemoteTable> {
        self.table.read().unwrap()
    }

    /// Asks the peer's `backend` to open its side of a data path (BackendOpen with `payload`,
    /// on stream 0) and waits up to `timeout` for its answer's payload.
    fn open_backend(&self, backend: &str, payload: Vec<u8>, timeout: Duration) -> Result<Vec<u8>> {
        let tag = self.next_query.fetch_add(1, Ordering::Relaxed);
        if !self.alive() {
            return Err(self.close_reason());
        }
        self.send_own(&self.streams[0], &Frame::BackendOpen { backend: backend.to_string(), payload }, tag);
        let deadline = Instant::now() + timeout;
        let mut g = self.tables.0.lock().unwrap();
        loop {
            let got = {
                let mut o = self.opened.lock().unwrap();
                o.iter().position(|(t, _)| *t == tag).map(|i| o.swap_remove(i).1)
            };
            if let Some(res) = got {
                return res;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if !DataPath::is_alive(self) || left.is_zero() {
                return Err(Error::timeout(format!(
                    "{} did not answer the {backend} BackendOpen in time",
                    self.peer
                )));
            }
            g = self.tables.1.wait_timeout(g, left.min(Duration::from_millis(50))).unwrap().0;
        }
    }

    /// The table's read guard when it can be had without waiting (None: a writer holds or
    /// waits for it); for guards kept past one call (`cuda::hold`).
    fn try_table(&self) -> Option<RwLockReadGuard<'_, RemoteTable>> {
        self.table.try_read().ok()
    }

    /// Asks the peer for its current region table and waits (up to `timeout`) until it is
    /// installed: for a range the peer registered so recently that its update is still on
    /// the way (it told us about the range through another channel).
    fn refresh_table(&self, timeout: Duration) -> Result<()> {
        let tag = self.next_query.fetch_add(1, Ordering::Relaxed);
        // On the first stream: the one the peer sends its table updates on, so the answer
        // comes after every update sent before it.
        if !self.alive() {
            return Err(self.close_reason());
        }
        self.send_own(&self.streams[0], &Frame::RegionsQuery, tag);
        let deadline = Instant::now() + timeout;
        let mut n = self.tables.0.lock().unwrap();
        while *n < tag {
            let left = deadline.saturating_duration_since(Instant::now());
            if !DataPath::is_alive(self) || left.is_zero() {
                return Err(Error::timeout(format!("{} did not send its region table in time", self.peer)));
            }
            n = self.tables.1.wait_timeout(n, left.min(Duration::from_millis(50))).unwrap().0;
        }
        Ok(())
    }

    fn read_received(&self) {
        self.read_received_all();
    }

    fn on_close(&self, hook: OnClose) {
        self.on_close_hook(hook);
    }

    fn send_notifies(&self, parts: Vec<Part>) -> Result<()> {
        DataPath::submit(self, parts)
    }

    fn stats(&self) -> Arc<PeerStats> {
        DataPath::stats(self)
    }

    fn is_alive(&self) -> bool {
        DataPath::is_alive(self)
    }

    fn dead_reason(&self) -> Option<String> {
        DataPath::dead_reason(self)
    }

    fn close_reason(&self) -> Error {
        TcpLink::close_reason(self)
    }

    fn close(&self, why: Error) {
        DataPath::close(self, why);
    }
}
