//! `Hixl`: links to other engines (connect, disconnect) and what they tell of the peer (its
//! regions).

use super::*;

#[pymethods]
impl Hixl {
    /// Links this engine to the engine listening at `remote` and waits until the link is up.
    ///
    /// Arguments:
    /// - `remote` (str): the peer's "ip:port" (its `local_engine`). This exact string names the
    ///   peer in every later call.
    /// - `timeout_ms` (float or None, default None): how long to try, in milliseconds; refused
    ///   connections are retried until then, so the peer may still be starting. None: the engine's
    ///   `hixl.connect_timeout_ms` (default 3000). 0: no time at all (`Timeout`).
    ///
    /// A link is a TCP control channel (handshake, the peer's region table, notifications,
    /// heartbeats) plus a data path, from the first backend of `hixl.backends` that can serve the
    /// peer. A link that died is replaced by a new `connect`.
    ///
    /// Returns None. Raises `ParamInvalid` for an address that does not parse; `AlreadyConnected`
    /// when a live link or a connect to `remote` exists; `Timeout` when nobody answered in time;
    /// `NotConnected` for any other failure (a refused handshake, a missing or different cluster
    /// secret, ...); `Unsupported` when no backend of `hixl.backends` can reach the peer; `Failed`
    /// before `initialize`, after `finalize`, or when the engine was finalized meanwhile.
    ///
    /// Waits with the GIL released; Ctrl-C raises `KeyboardInterrupt` within 50 ms, and a connect
    /// given up that way is disconnected when it ends.
    #[pyo3(signature = (remote, timeout_ms = None))]
    fn connect(&self, py: Python<'_>, remote: Addr, timeout_ms: Option<Millis>) -> PyResult<()> {
        let e = self.engine.clone();
        let t = match ms("timeout_ms", timeout_ms)? {
            Some(t) => t,
            None => e.default_timeouts().map_err(to_py)?.1,
        };
        connect_interruptibly(py, &e, &remote, t)
    }

    /// Closes the link to `remote`.
    ///
    /// Arguments:
    /// - `remote` (str): the peer, as given to `connect`.
    /// - `timeout_ms` (float or None, default None): how long to wait for the transfers already
    ///   submitted to `remote` to end before closing. None: the engine's
    ///   `hixl.transfer_timeout_ms` (default 10000). 0: close at once.
    ///
    /// New transfers to `remote` are refused (`NotConnected`) from the start of the call; requests
    /// still pending when the link closes fail with `NotConnected`. Afterwards
    /// `get_async_connect_status(&remote)` is NOT_CONNECT.
    ///
    /// Returns None, also for a link whose `connect_async` had failed. Raises `NotConnected` when
    /// there is no link to `remote`; `Failed` while a connect to it is in progress, and before
    /// `initialize` or after `finalize`.
    ///
    /// Blocks up to `timeout_ms` with the GIL released (no Ctrl-C check).
    #[pyo3(signature = (remote, timeout_ms = None))]
    fn disconnect(&self, py: Python<'_>, remote: Addr, timeout_ms: Option<Millis>) -> PyResult<()> {
        let e = self.engine.clone();
        let t = match ms("timeout_ms", timeout_ms)? {
            Some(t) => t,
            None => e.default_timeouts().map_err(to_py)?.0,
        };
        py.allow_threads(|| e.disconnect(&remote, t)).map_err(to_py)
    }

    /// Starts a connect to `remote` in the background and returns at once.
    ///
    /// Arguments:
    /// - `remote` (str): the peer's "ip:port", as for `connect`.
    ///
    /// The connect tries for the engine's `hixl.connect_timeout_ms`. Poll
    /// `get_async_connect_status(&remote)`: CONNECTING, then CONNECTED or CONNECT_FAILED (the error
    /// is logged as a WARN). `finalize` waits for connects still under way.
    ///
    /// Returns None. Raises `ParamInvalid` for an address that does not parse; `AlreadyConnected`
    /// when a live link or a connect to `remote` exists; `Failed` before `initialize`, after
    /// `finalize`, or when no thread can be started. Does not block.
    fn connect_async(&self, remote: Addr) -> PyResult<()> {
        self.engine.connect_async(&remote).map_err(to_py)
    }

    /// The state of this engine's link to `remote`, as an `AsyncConnectStatus`.
    ///
    /// Arguments:
    /// - `remote` (str): the peer, as given to `connect` or `connect_async`.
    ///
    /// NOT_CONNECT: never connected, disconnected, or a synchronous `connect` that failed.
    /// CONNECTING: a connect is under way. CONNECTED: linked and alive. CONNECT_FAILED: a
    /// `connect_async` failed, or the link died.
    ///
    /// Raises `Failed` before `initialize` or after `finalize`. Does not block.
    fn get_async_connect_status(&self, remote: Addr) -> PyResult<AsyncConnectStatus> {
        self.engine.get_async_connect_status(&remote).map(Into::into).map_err(to_py)
    }

    /// The regions `remote` has registered, as a list of `MemDesc` sorted by address: the peer's
    /// regions as of the last region-table update this engine received.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    ///
    /// The peer sends its whole table when the link is made and an update after every
    /// registration and deregistration; a transfer or `remote_region` that misses a range or name
    /// asks for the current table once. A region the peer registered a moment ago may therefore be
    /// missing here. `remote_regions` gives the same regions with names and access.
    ///
    /// Raises `NotConnected` when `remote` is not connected or its link died; `Failed` before
    /// `initialize` or after `finalize`. No network round trip; does not block.
    fn remote_mems(&self, remote: Addr) -> PyResult<Vec<MemDesc>> {
        let v = self.engine.remote_mems(&remote).map_err(to_py)?;
        Ok(v.into_iter().map(|m| MemDesc { addr: m.addr, len: m.len }).collect())
    }

    /// The regions `remote` has registered, as a list of `RemoteRegion` (address, length, name,
    /// memory type, whether this engine may WRITE it) sorted by address: the peer's regions as of
    /// the last region-table update this engine received.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `refresh` (bool, default False): True asks the peer for its current table first (one
    ///   round trip, bounded by `hixl.handshake_timeout_ms`; GIL released), for a region it
    ///   registered a moment ago whose update has not arrived.
    ///
    /// See `remote_mems` for when updates arrive. Raises `NotConnected` when `remote` is not
    /// connected or its link died; `Timeout` when a refresh got no answer; `Failed` before
    /// `initialize` or after `finalize`. Without `refresh`: no network round trip, does not
    /// block.
    #[pyo3(signature = (remote, refresh = false))]
    fn remote_regions(&self, py: Python<'_>, remote: Addr, refresh: bool) -> PyResult<Vec<RemoteRegion>> {
        let e = self.engine.clone();
        let v = if refresh {
            py.allow_threads(|| e.refresh_remote_regions(&remote))
        } else {
            e.remote_regions(&remote)
        };
        Ok(v.map_err(to_py)?.into_iter().map(RemoteRegion::from).collect())
    }

    /// The `RemoteRegion` that `remote` registered under `name`.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `name` (str): the name the peer gave `register`, `register_mem` or `alloc`.
    ///
    /// It is looked up in the peer's regions as of the last region-table update this engine
    /// received; a name missing there is asked for once (one round trip, bounded by
    /// `hixl.handshake_timeout_ms`), so a region the peer registered a moment ago is found.
    ///
    /// Raises `ParamInvalid` naming it when the peer has no region of that name; `NotConnected`
    /// when `remote` is not connected or its link died; `Failed` before `initialize` or after
    /// `finalize`. The GIL is released while it asks (no Ctrl-C check).
    fn remote_region(&self, py: Python<'_>, remote: Addr, name: Text) -> PyResult<RemoteRegion> {
        let e = self.engine.clone();
        py.allow_threads(|| e.remote_region(&remote, &name)).map(RemoteRegion::from).map_err(to_py)
    }
}
