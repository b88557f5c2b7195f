//! Links to peers: connect (the control channel, then the first backend of `hixl.backends`
//! that the peer offers and that opens), connect_async, disconnect, and the peer slots.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{failover, parse_addr, sides, ConnectStatus, Engine, PeerConn, PeerSlot, Running};
use crate::error::{Error, Result, Status};
use crate::transport::backend;
use crate::transport::control::channel::ControlChannel;
use crate::transport::streams::{ConnectParams, TcpLink};
use crate::transport::DataPath;
use crate::wire::Domain;

impl Engine {
    fn link_params(r: &Running, timeout: Duration) -> ConnectParams {
        ConnectParams {
            local_id: r.local_engine.clone(),
            streams: r.opts.streams,
            queue_depth: r.opts.queue_depth,
            timeout,
            host: r.host.clone(),
            coalesce: r.opts.coalesce,
            coalesce_max_ops: r.opts.coalesce_max_ops,
            secret: r.opts.secret.clone(),
            heartbeat: r.opts.heartbeat,
            data_mac: r.opts.data_mac,
            reactor: r.reactor.clone(),
        }
    }

    fn begin_connect(r: &Running, key: &str) -> Result<()> {
        let old = {
            let mut peers = r.peers.lock().unwrap();
            match peers.get(key) {
                Some(PeerSlot::Connected(c)) if c.link.is_alive() => {
                    return Err(Error::new(Status::AlreadyConnected, format!("already connected to {key}")));
                }
                Some(PeerSlot::Connecting) => {
                    return Err(Error::new(
                        Status::AlreadyConnected,
                        format!("a connect to {key} is already in progress"),
                    ));
                }
                _ => peers.insert(key.to_string(), PeerSlot::Connecting),
            }
        };
        // The old link died: close it (joins its threads; an RDMA link waits for its flush)
        // only now, outside the peers lock that every submit to every peer takes.
        if let Some(PeerSlot::Connected(c)) = old {
            c.close(Error::not_connected(format!("link to {key} replaced")));
        }
        Ok(())
    }

    /// Connects the control channel, then asks each backend of `hixl.backends` that the peer
    /// offers, in order, for a data path to it; the first that can serve it wins.
    fn open_link(r: &Running, key: &str, addr: SocketAddr, timeout: Duration) -> Result<PeerConn> {
        // The control channel needs one stream; a backend that moves data over TCP opens its own.
        let params = ConnectParams { streams: 1, ..Self::link_params(r, timeout) };
        let control: Arc<dyn ControlChannel> = TcpLink::connect(key, addr, &params)?;
        let ctx = backend::OpenCtx {
            opts: &r.opts,
            addr,
            params: &params,
            host: &r.host,
            timeout,
            stager: &r.stager,
        };
        let mut not_chosen: Vec<String> = Vec::new();
        for (i, b) in r.backends.iter().enumerate() {
            let offer = match control.handshake().offer(b.name()) {
                None => Err("the peer does not offer it".to_string()),
                Some(o) if !o.domains.contains(&(Domain::Host, Domain::Host)) => {
                    Err("the peer offers it for other memory domains only".to_string())
                }
                Some(o) => b.connect(&ctx, &control, o),
            };
            match offer {
                Ok(link) => {
                    if not_chosen.is_empty() {
                        tracing::info!(peer = %key, backend = b.name(), "data path chosen");
                    } else {
                        tracing::info!(peer = %key, backend = b.name(), not_chosen = %not_chosen.join("; "), "data path chosen");
                    }
                    let (domains, not_chosen) = (b.domains(), not_chosen.join("; "));
                    let next: Vec<_> = r.backends[i + 1..].to_vec();
                    let opener = || failover::Opener {
                        next: next.clone(),
                        opts: r.opts.clone(),
                        addr,
                        params: params.clone(),
                        host: r.host.clone(),
                        timeout,
                        stager: r.stager.clone(),
                    };
                    let sides = sides::Sides::new(control.as_ref(), opener());
                    let failover = (!next.is_empty())
                        .then(|| failover::Failover::wrap(control.clone(), link.clone(), domains, opener()))
                        .flatten();
                    let link = match &failover {
                        Some(f) => f.clone() as Arc<dyn DataPath>,
                        None => link,
                    };
                    return Ok(PeerConn {
                        name: Arc::from(key),
                        control,
                        link,
                        domains,
                        not_chosen,
                        failover,
                        sides,
                        recent: Mutex::new(Vec::new()),
                    });
                }
                Err(why) => not_chosen.push(format!("{}: {why}", b.name())),
            }
        }
        let e = Error::new(
            Status::Unsupported,
            format!(
                "{key} cannot be reached directly or otherwise by hixl.backends={}: {}",
                r.opts.backends.join(","),
                not_chosen.join("; ")
            ),
        );
        control.close(e.clone());
        Err(e)
    }

    fn finish_connect(r: &Running, key: &str, res: Result<PeerConn>, keep_failure: bool) -> Result<()> {
        let mut peers = r.peers.lock().unwrap();
        if r.closed.load(Ordering::Acquire) {
            let e = Error::failed(format!("the engine was finalized while connecting to {key}"));
            if let Ok(conn) = res {
                drop(peers);
                conn.close(e.clone());
            }
            return Err(e);
        }
        match res {
            Ok(conn) => {
                tracing::info!(peer = %key, backend = conn.link.backend(), "connected");
                peers.insert(key.to_string(), PeerSlot::Connected(Arc::new(conn)));
                Ok(())
            }
            Err(e) => {
                if keep_failure {
                    tracing::warn!(peer = %key, error = %e, "async connect failed");
                    peers.insert(key.to_string(), PeerSlot::Failed);
                } else {
                    peers.remove(key);
                }
                Err(e)
            }
        }
    }

    /// Connects to the engine listening at `remote` ("ip:port"): handshake, region table.
    pub fn connect(&self, remote: &str, timeout: Duration) -> Result<()> {
        let timeout = crate::wait::capped(timeout);
        let r = self.running()?;
        let addr = parse_addr(remote)?;
        let key = remote.to_string();
        Self::begin_connect(&r, &key)?;
        let res = Self::open_link(&r, &key, addr, timeout);
        Self::finish_connect(&r, &key, res, false)
    }

    /// Starts a connect in the background; poll with [`Engine::get_async_connect_status`].
    pub fn connect_async(&self, remote: &str) -> Result<()> {
        let r = self.running()?;
        let addr = parse_addr(remote)?;
        let key = remote.to_string();
        Self::begin_connect(&r, &key)?;
        let timeout = r.opts.connect_timeout;
        let r2 = r.clone();
        let mut connects = r.connects.lock().unwrap();
        connects.retain(|h| !h.is_finished());
        let h = r
            .reactor
            .spawn("hixl-connect".into(), move || {
                let res = Self::open_link(&r2, &key, addr, timeout);
                let _ = Self::finish_connect(&r2, &key, res, true);
            })
            .map_err(|e| Error::failed(format!("cannot start the connect thread: {e}")))?;
        connects.push(h);
        Ok(())
    }

    /// The state of a connect to `remote`.
    pub fn get_async_connect_status(&self, remote: &str) -> Result<ConnectStatus> {
        let r = self.running()?;
        let peers = r.peers.lock().unwrap();
        Ok(match peers.get(remote) {
            None => ConnectStatus::NotConnect,
            Some(PeerSlot::Connecting) => ConnectStatus::Connecting,
            Some(PeerSlot::Connected(c)) if c.link.is_alive() => ConnectStatus::Connected,
            Some(_) => ConnectStatus::ConnectFailed,
        })
    }

    /// Closes the link to `remote`, after waiting up to `timeout` for the requests already
    /// submitted to it to end (zero: at once); what is still pending then fails with
    /// NOT_CONNECTED. New requests to `remote` are refused from the start of the call.
    pub fn disconnect(&self, remote: &str, timeout: Duration) -> Result<()> {
        let r = self.running()?;
        // One lock: a connect in progress keeps its slot, so that its `finish_connect` (which
        // may come at any moment) is never overwritten and its link never lost.
        let slot = {
            let mut peers = r.peers.lock().unwrap();
            if matches!(peers.get(remote), Some(PeerSlot::Connecting)) {
                return Err(Error::failed(format!(
                    "a connect to {remote} is in progress; wait for it first"
                )));
            }
            peers.remove(remote)
        };
        match slot {
            Some(PeerSlot::Connected(c)) => {
                let deadline = std::time::Instant::now() + crate::wait::capped(timeout);
                let pending: Vec<_> = c.recent.lock().unwrap().iter().filter_map(|w| w.upgrade()).collect();
                for q in pending {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    q.wait(Some(left));
                }
                c.close(Error::not_connected(format!("disconnected from {remote}")));
                Ok(())
            }
            Some(PeerSlot::Failed | PeerSlot::Connecting) => Ok(()),
            None => Err(Error::not_connected(format!("not connected to {remote}"))),
        }
    }

    pub(super) fn conn(r: &Running, remote: &str) -> Result<Arc<PeerConn>> {
        let peers = r.peers.lock().unwrap();
        // Set under this lock by `finalize` before it empties the map: a call racing finalize
        // fails the way finalize fails in-flight requests, not as "not connected".
        if r.closed.load(Ordering::Acquire) {
            return Err(Error::failed("the engine was finalized"));
        }
        match peers.get(remote) {
            Some(PeerSlot::Connected(c)) if c.link.is_alive() => Ok(c.clone()),
            Some(PeerSlot::Connected(c)) => Err(Error::not_connected(format!(
                "the link to {remote} died: {}",
                c.link.dead_reason().unwrap_or_default()
            ))),
            _ => Err(Error::not_connected(format!("not connected to {remote}: call connect() first"))),
        }
    }
}
