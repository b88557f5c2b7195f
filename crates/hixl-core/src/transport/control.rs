//! The control half of a link: the peer's region table (whole tables and deltas, queries,
//! confirmations), heartbeats and liveness. Every backend's link has exactly one, and no
//! backend's data path reads or writes the table except through it. Today it runs over the
//! TCP link's streams (stream 0 carries the table updates; see `tcp` for the data half).

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLockReadGuard};
use std::time::{Duration, Instant};

use crate::auth::FrameMac;
use crate::error::{Error, Result};
use crate::registry::RemoteTable;
use crate::transport::io;
use crate::transport::liveness::{self, Liveness};
use crate::transport::server::addr_text;
use crate::transport::tcp::{Stream, TcpLink};
use crate::transport::{DataPath, PeerInfo};
use crate::wire::{self, Frame, RegionEntry};

impl TcpLink {
    /// Probes the peer every `every` (a Heartbeat on each stream that is idle; zero: never) and
    /// closes the link once the peer has made no progress for `liveness::MISSED` intervals.
    ///
    /// The same thread sends the region-table confirmations that a reader could not send at
    /// once (a reader never waits for the send lock: see `confirm_table`).
    pub(super) fn control(self: &Arc<Self>, every: Duration) {
        let period = if every.is_zero() { Duration::from_secs(3600) } else { every };
        let mut live = Liveness::new(period, Instant::now());
        let mut probes_sent: u64 = 0;
        let mut next_probe = Instant::now() + period;
        loop {
            {
                // One wake-up per interval (an idle engine stays idle); close() and readers with
                // a confirmation to send ring earlier.
                let mut g = self.closing.0.lock().unwrap();
                let left = next_probe.saturating_duration_since(Instant::now());
                if !*g && !left.is_zero() && self.is_alive() {
                    g = self.closing.1.wait_timeout(g, left).unwrap().0;
                }
                *g = false;
            }
            if !self.is_alive() {
                return;
            }
            for s in &self.streams {
                if s.ack_due.load(Ordering::Acquire) != 0 {
                    let mut mac = s.send_lock.lock().unwrap();
                    if self.send_ack_locked(s, &mut mac).is_err() {
                        drop(mac);
                        self.close(Error::not_connected(format!("stream to {} failed", self.peer)));
                        return;
                    }
                }
            }
            let now = Instant::now();
            if every.is_zero() || now < next_probe {
                continue;
            }
            next_probe = now + period;
            for s in &self.streams {
                // Only on a stream nobody is writing to and whose send queue is empty, so the
                // probe can never block this thread (a cut link leaves data queued; then the
                // missing progress speaks for itself).
                if let Ok(mut mac) = s.send_lock.try_lock() {
                    let fd = s.sock.as_raw_fd();
                    if io::queued_bytes(fd) == Some(0) {
                        let mut probe = wire::encode(&Frame::Heartbeat, 0, 0);
                        mac.seal(&mut probe);
                        if io::send_bytes(fd, &probe).is_ok() {
                            probes_sent += probe.len() as u64;
                        }
                    }
                }
            }
            let mut progress: i128 = -(probes_sent as i128);
            for s in &self.streams {
                let Some((received, acked)) = liveness::tcp_progress(s.sock.as_raw_fd()) else { return };
                progress += received as i128 + acked as i128;
            }
            let (missed, dead) = live.observe_counting(progress, now);
            if missed {
                self.done.stats().heartbeat_misses.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(silent) = dead {
                self.close(Error::not_connected(format!(
                    "{} stopped answering: no progress for {} ms ({} heartbeats of {} ms missed)",
                    self.peer,
                    silent.as_millis(),
                    liveness::MISSED,
                    every.as_millis()
                )));
                return;
            }
        }
    }

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

    /// Waits (up to `timeout`) until the installed region table has at least `version`.
    pub fn wait_table_version(&self, version: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut n = self.tables.0.lock().unwrap();
        while self.table_version.load(Ordering::Acquire) < version {
            let left = deadline.saturating_duration_since(Instant::now());
            if !self.is_alive() || left.is_zero() {
                return Err(Error::timeout(format!(
                    "{} did not send region table version {version} in time",
                    self.peer
                )));
            }
            n = self.tables.1.wait_timeout(n, left.min(Duration::from_millis(50))).unwrap().0;
        }
        Ok(())
    }

    /// Confirms region-table `version` to the peer. A reader never waits for the send lock nor
    /// on a full socket (the peer may be blocked sending to us, waiting for us to read): it
    /// sends at once only when the lock is free and the socket's send queue is empty, and
    /// otherwise leaves the confirmation to the control thread.
    pub(super) fn confirm_table(&self, s: &Stream, version: u64) {
        s.ack_due.fetch_max(version, Ordering::AcqRel);
        if let Ok(mut mac) = s.send_lock.try_lock() {
            if io::queued_bytes(s.sock.as_raw_fd()) == Some(0) {
                if self.send_ack_locked(s, &mut mac).is_err() {
                    drop(mac);
                    self.close(Error::not_connected(format!("stream to {} failed", self.peer)));
                }
                return;
            }
        }
        self.ring_control();
    }

    /// Sends the pending confirmation of stream `s`, if any; the caller holds its send lock.
    fn send_ack_locked(&self, s: &Stream, mac: &mut FrameMac) -> std::io::Result<()> {
        let version = s.ack_due.swap(0, Ordering::AcqRel);
        if version == 0 {
            return Ok(());
        }
        let mut ack = wire::encode(&Frame::RegionsAck { version }, 0, 0);
        mac.seal(&mut ack);
        io::send_bytes(s.sock.as_raw_fd(), &ack)
    }

    pub(super) fn ring_control(&self) {
        *self.closing.0.lock().unwrap() = true;
        self.closing.1.notify_all();
    }

    /// Our descriptor of stream 0 (the same-host proof shows it to the peer).
    pub fn stream0_fd(&self) -> std::os::fd::RawFd {
        self.streams[0].sock.as_raw_fd()
    }

    /// The two ends of stream 0 (ours, the peer's), as the same-host proof names them.
    pub fn stream0_ends(&self) -> Result<(String, String)> {
        let s = &self.streams[0].sock;
        let ends = s.local_addr().and_then(|l| Ok((l, s.peer_addr()?)));
        let (l, p) = ends.map_err(|e| Error::not_connected(format!("stream to {}: {e}", self.peer)))?;
        Ok((addr_text(l), addr_text(p)))
    }

    /// The peer's address as the engine was asked to connect to it.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Handshake facts about the peer (`regions` as of the handshake).
    pub fn handshake(&self) -> &PeerInfo {
        &self.info
    }

    /// Handshake facts about the peer (its table as of now).
    pub fn peer_info(&self) -> PeerInfo {
        PeerInfo { regions: self.table.read().unwrap().clone(), ..self.info.clone() }
    }

    /// The peer's current region table; hold the guard only briefly (updates wait for it).
    pub fn table(&self) -> RwLockReadGuard<'_, RemoteTable> {
        self.table.read().unwrap()
    }

    /// The table's read guard when it can be had without waiting (None: a writer holds or
    /// waits for it); for guards kept past one call (`cuda::hold`).
    pub fn try_table(&self) -> Option<RwLockReadGuard<'_, RemoteTable>> {
        self.table.try_read().ok()
    }

    /// Asks the peer for its current region table and waits (up to `timeout`) until it is
    /// installed: for a range the peer registered so recently that its update is still on
    /// the way (it told us about the range through another channel).
    pub fn refresh_table(&self, timeout: Duration) -> Result<()> {
        let tag = self.next_query.fetch_add(1, Ordering::Relaxed);
        // On the first stream: the one the peer sends its table updates on, so the answer
        // comes after every update sent before it.
        let s = &self.streams[0];
        let mut query = wire::encode(&Frame::RegionsQuery, tag, 0);
        {
            let mut mac = s.send_lock.lock().unwrap();
            mac.seal(&mut query);
            io::send_bytes(s.sock.as_raw_fd(), &query)
                .map_err(|e| Error::not_connected(format!("stream to {} failed: {e}", self.peer)))?;
        }
        let deadline = Instant::now() + timeout;
        let mut n = self.tables.0.lock().unwrap();
        while *n < tag {
            let left = deadline.saturating_duration_since(Instant::now());
            if !self.is_alive() || left.is_zero() {
                return Err(Error::timeout(format!("{} did not send its region table in time", self.peer)));
            }
            n = self.tables.1.wait_timeout(n, left.min(Duration::from_millis(50))).unwrap().0;
        }
        Ok(())
    }
}
