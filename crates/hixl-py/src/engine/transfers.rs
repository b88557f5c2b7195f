//! `Hixl`: transfers (batches, put/get, strided) and their statuses.

use super::*;

#[pymethods]
impl Hixl {
    /// Runs one batch of transfers with `remote` and waits until it has ended.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `op` (TransferOp or str): `TransferOp.WRITE` copies local -> remote, `TransferOp.READ`
    ///   remote -> local; the name as a str ("WRITE", "read", any case) is the same.
    /// - `descs`: the batch: a list or tuple of `TransferOpDesc` or of `(local_addr, remote_addr,
    ///   length)` triples of ints (numpy integer scalars too), or an (N, 3) numpy array of any
    ///   integer dtype (uint64 in C order is read without a copy). Each range must lie inside one
    ///   registered region: the local one in this engine's, the remote one in the peer's regions
    ///   as of the last region-table update this engine received (a miss asks the peer for its
    ///   current table once). Adjacent descriptors are merged.
    /// - `timeout_ms` (float or None, default None): the request's deadline in milliseconds.
    ///   None: the engine's `hixl.transfer_timeout_ms` (default 10000). 0: the deadline is the
    ///   moment of submission, so the request times out unless it completed while being submitted.
    ///
    /// Returns None once every byte is at its destination. Raises `ParamInvalid` for an empty
    /// batch, a malformed descriptor, a zero length, a range outside the registered regions, a
    /// WRITE into a read-only region, a READ into a read-only buffer, or a range the target
    /// refused; `NotConnected` when `remote` is not connected or the link died; `Timeout` when the
    /// deadline passed; `ResourceExhausted` when the link's request queue is full
    /// (`hixl.queue_depth`); `Failed` when the engine was finalized meanwhile, before `initialize`
    /// or after `finalize`.
    ///
    /// Waits with the GIL released (a batch of up to 8 MiB is submitted and waited for during
    /// its first millisecond with the GIL held: a short transfer then never has to take it back
    /// from a busy Python thread); Ctrl-C raises `KeyboardInterrupt` within 50 ms, and the
    /// transfer goes on until it ends or its deadline passes.
    #[pyo3(signature = (remote, op, descs, timeout_ms = None))]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        remote: Addr,
        op: OpArg,
        descs: &Bound<'_, PyAny>,
        timeout_ms: Option<Millis>,
    ) -> PyResult<()> {
        let t = ms("timeout_ms", timeout_ms)?;
        let d = parse_descs(descs)?;
        self.check_tensors(py, d.iter().map(|x| x.local_addr))?;
        let e = self.engine.clone();
        let bytes = d.iter().fold(0u64, |n, x| n.saturating_add(x.len));
        let held = || e.try_submit_held(&remote, op.into(), &d, t);
        let released = || e.submit_transfer(&remote, op.into(), &d, None, t, Waiting::Now);
        let req = submit_sync(py, bytes, held, released)?;
        finish_sync(py, &req)
    }

    /// Validates and queues one batch of transfers with `remote`, and returns its `TransferReq`
    /// at once.
    ///
    /// Arguments:
    /// - `remote` (str), `op` (TransferOp), `descs`: as in `transfer_sync`.
    /// - `user_data` (any object, default None): kept on the request (`req.user_data`) and
    ///   reported by the no-argument `get_transfer_status()`.
    /// - `notify` (NotifyDesc or None, default None): a notification the peer receives after every
    ///   byte of the batch is at its destination; the request is COMPLETED only once the peer has
    ///   it. A failed batch sends none.
    /// - `timeout_ms` (float or None, default None): the request's deadline, as in
    ///   `transfer_sync` (None: `hixl.transfer_timeout_ms`).
    ///
    /// Errors found while submitting are raised here: `ParamInvalid` (the batch, or a notify name
    /// over 1,024 bytes or msg over 1 MiB), `NotConnected`, `ResourceExhausted` (queue full) and
    /// `Failed`, as in `transfer_sync`. Later failures show in `req.status()` / `req.wait()`
    /// (FAILED or TIMEOUT), and `req.result()` raises them.
    ///
    /// Does not wait for the transfer; the GIL is released while it submits.
    #[pyo3(signature = (remote, op, descs, user_data = None, notify = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_async(
        &self,
        py: Python<'_>,
        remote: Addr,
        op: OpArg,
        descs: &Bound<'_, PyAny>,
        user_data: Option<Py<PyAny>>,
        notify: Option<NotifyDesc>,
        timeout_ms: Option<Millis>,
    ) -> PyResult<Py<TransferReq>> {
        let t = ms("timeout_ms", timeout_ms)?;
        let d = parse_descs(descs)?;
        self.check_tensors(py, d.iter().map(|x| x.local_addr))?;
        let e = self.engine.clone();
        let n = notify.map(Into::into);
        let req = py.allow_threads(|| e.transfer_async(&remote, op.into(), &d, n, t)).map_err(to_py)?;
        self.track(py, req, user_data)
    }

    /// One-sided WRITE of one contiguous range: `length` bytes from `local_addr` here to
    /// `remote_addr` at `remote`; waits until they are there.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `local_addr` (int): the source, inside a region registered on this engine.
    /// - `remote_addr` (int): the destination, inside a region the peer registered read-write.
    /// - `length` (int): bytes, at least 1.
    /// - `timeout_ms` (float or None, default None): the deadline, as in `transfer_sync` (None:
    ///   `hixl.transfer_timeout_ms`).
    ///
    /// `transfer_sync(remote, TransferOp.WRITE, [(local_addr, remote_addr, length)], timeout_ms)`
    /// in one call: same return, errors and blocking (GIL released, Ctrl-C checked).
    #[pyo3(signature = (remote, local_addr, remote_addr, length, timeout_ms = None))]
    fn put(
        &self,
        py: Python<'_>,
        remote: Addr,
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        timeout_ms: Option<Millis>,
    ) -> PyResult<()> {
        let req = self.one(
            py,
            &remote,
            TransferOp::WRITE,
            (local_addr, remote_addr, length),
            timeout_ms,
            Waiting::Now,
        )?;
        finish_sync(py, &req)
    }

    /// One-sided READ of one contiguous range: `length` bytes from `remote_addr` at `remote` to
    /// `local_addr` here; waits until they are here.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `local_addr` (int): the destination, inside a writable region registered on this engine.
    /// - `remote_addr` (int): the source, inside a region the peer registered.
    /// - `length` (int): bytes, at least 1.
    /// - `timeout_ms` (float or None, default None): the deadline, as in `transfer_sync` (None:
    ///   `hixl.transfer_timeout_ms`).
    ///
    /// `transfer_sync(remote, TransferOp.READ, [(local_addr, remote_addr, length)], timeout_ms)`
    /// in one call: same return, errors and blocking (GIL released, Ctrl-C checked).
    #[pyo3(signature = (remote, local_addr, remote_addr, length, timeout_ms = None))]
    fn get(
        &self,
        py: Python<'_>,
        remote: Addr,
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        timeout_ms: Option<Millis>,
    ) -> PyResult<()> {
        let req = self.one(
            py,
            &remote,
            TransferOp::READ,
            (local_addr, remote_addr, length),
            timeout_ms,
            Waiting::Now,
        )?;
        finish_sync(py, &req)
    }

    /// Asynchronous `put`: queues the WRITE and returns its `TransferReq` at once.
    ///
    /// Arguments:
    /// - `remote`, `local_addr`, `remote_addr`, `length`, `timeout_ms`: as in `put`.
    /// - `user_data` (any object, default None): as in `transfer_async`.
    ///
    /// Errors and behaviour as `transfer_async` with one descriptor.
    #[pyo3(signature = (remote, local_addr, remote_addr, length, user_data = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn put_async(
        &self,
        py: Python<'_>,
        remote: Addr,
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        user_data: Option<Py<PyAny>>,
        timeout_ms: Option<Millis>,
    ) -> PyResult<Py<TransferReq>> {
        let req = self.one(
            py,
            &remote,
            TransferOp::WRITE,
            (local_addr, remote_addr, length),
            timeout_ms,
            Waiting::Later,
        )?;
        self.track(py, req, user_data)
    }

    /// Asynchronous `get`: queues the READ and returns its `TransferReq` at once.
    ///
    /// Arguments:
    /// - `remote`, `local_addr`, `remote_addr`, `length`, `timeout_ms`: as in `get`.
    /// - `user_data` (any object, default None): as in `transfer_async`.
    ///
    /// Errors and behaviour as `transfer_async` with one descriptor.
    #[pyo3(signature = (remote, local_addr, remote_addr, length, user_data = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn get_async(
        &self,
        py: Python<'_>,
        remote: Addr,
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        user_data: Option<Py<PyAny>>,
        timeout_ms: Option<Millis>,
    ) -> PyResult<Py<TransferReq>> {
        let req = self.one(
            py,
            &remote,
            TransferOp::READ,
            (local_addr, remote_addr, length),
            timeout_ms,
            Waiting::Later,
        )?;
        self.track(py, req, user_data)
    }

    /// Strided WRITE: `desc.count` elements of `desc.size` bytes, element i from
    /// `local_base + i * desc.stride` here to `remote_base + i * remote_stride` at `remote`
    /// (`remote_stride` defaults to `desc.stride`); waits until they are there.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `local_base` (int): address of element 0 here.
    /// - `remote_base` (int): address of element 0 at the peer.
    /// - `desc` (StridedDesc): the elements. Rules: count >= 1, size >= 1, each stride >= size;
    ///   bases and strides multiples of 64 bytes unless `hixl.strict_alignment=0`; the whole
    ///   strided range inside one registered region on each side.
    /// - `timeout_ms` (float or None, default None): the deadline, as in `transfer_sync` (None:
    ///   `hixl.transfer_timeout_ms`).
    ///
    /// One request and one descriptor on the wire, whatever `desc.count` is. Returns None; raises
    /// `ParamInvalid` naming the field for a broken rule, otherwise as `transfer_sync`. Waits with
    /// the GIL released, Ctrl-C checked.
    #[pyo3(signature = (remote, local_base, remote_base, desc, timeout_ms = None))]
    fn put_strided(
        &self,
        py: Python<'_>,
        remote: Addr,
        local_base: &Bound<'_, PyAny>,
        remote_base: &Bound<'_, PyAny>,
        desc: StridedDesc,
        timeout_ms: Option<Millis>,
    ) -> PyResult<()> {
        let req = self.strided(
            py,
            &remote,
            TransferOp::WRITE,
            local_base,
            remote_base,
            desc,
            None,
            timeout_ms,
            Waiting::Now,
        )?;
        finish_sync(py, &req)
    }

    /// Strided READ: `desc.count` elements of `desc.size` bytes, element i from
    /// `remote_base + i * remote_stride` at `remote` to `local_base + i * desc.stride` here
    /// (`remote_stride` defaults to `desc.stride`); waits until they are here.
    ///
    /// Arguments:
    /// - `remote`, `local_base`, `remote_base`, `desc`, `timeout_ms`: as in `put_strided` (the
    ///   local range must be writable).
    ///
    /// Returns None; errors and blocking as `put_strided`.
    #[pyo3(signature = (remote, local_base, remote_base, desc, timeout_ms = None))]
    fn get_strided(
        &self,
        py: Python<'_>,
        remote: Addr,
        local_base: &Bound<'_, PyAny>,
        remote_base: &Bound<'_, PyAny>,
        desc: StridedDesc,
        timeout_ms: Option<Millis>,
    ) -> PyResult<()> {
        let req = self.strided(
            py,
            &remote,
            TransferOp::READ,
            local_base,
            remote_base,
            desc,
            None,
            timeout_ms,
            Waiting::Now,
        )?;
        finish_sync(py, &req)
    }

    /// Asynchronous `put_strided`: queues the strided WRITE and returns its `TransferReq` at once.
    ///
    /// Arguments:
    /// - `remote`, `local_base`, `remote_base`, `desc`, `timeout_ms`: as in `put_strided`.
    /// - `user_data` (any object, default None): as in `transfer_async`.
    /// - `notify` (NotifyDesc or None, default None): reaches the peer after every byte, as in
    ///   `transfer_async`.
    ///
    /// Errors and behaviour as `transfer_async`.
    #[pyo3(signature = (remote, local_base, remote_base, desc, user_data = None, notify = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn put_strided_async(
        &self,
        py: Python<'_>,
        remote: Addr,
        local_base: &Bound<'_, PyAny>,
        remote_base: &Bound<'_, PyAny>,
        desc: StridedDesc,
        user_data: Option<Py<PyAny>>,
        notify: Option<NotifyDesc>,
        timeout_ms: Option<Millis>,
    ) -> PyResult<Py<TransferReq>> {
        let req = self.strided(
            py,
            &remote,
            TransferOp::WRITE,
            local_base,
            remote_base,
            desc,
            notify,
            timeout_ms,
            Waiting::Later,
        )?;
        self.track(py, req, user_data)
    }

    /// Asynchronous `get_strided`: queues the strided READ and returns its `TransferReq` at once.
    ///
    /// Arguments:
    /// - `remote`, `local_base`, `remote_base`, `desc`, `timeout_ms`: as in `get_strided`.
    /// - `user_data` (any object, default None): as in `transfer_async`.
    /// - `notify` (NotifyDesc or None, default None): sent to the peer once the bytes are here,
    ///   as in `transfer_async`.
    ///
    /// Errors and behaviour as `transfer_async`.
    #[pyo3(signature = (remote, local_base, remote_base, desc, user_data = None, notify = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn get_strided_async(
        &self,
        py: Python<'_>,
        remote: Addr,
        local_base: &Bound<'_, PyAny>,
        remote_base: &Bound<'_, PyAny>,
        desc: StridedDesc,
        user_data: Option<Py<PyAny>>,
        notify: Option<NotifyDesc>,
        timeout_ms: Option<Millis>,
    ) -> PyResult<Py<TransferReq>> {
        let req = self.strided(
            py,
            &remote,
            TransferOp::READ,
            local_base,
            remote_base,
            desc,
            notify,
            timeout_ms,
            Waiting::Later,
        )?;
        self.track(py, req, user_data)
    }

    /// Statuses of asynchronous requests, without waiting.
    ///
    /// Arguments:
    /// - `req` (TransferReq, list of TransferReq, or None; default None): one request gives its
    ///   `TransferStatus`; a list (or other iterable) gives a list of statuses, in order. None
    ///   gives `[(user_data, status), ...]` for every request this engine's async calls made that
    ///   was still in flight at the previous no-argument call or is newer: each final status is
    ///   reported once, and WAITING ones again next time. (Past 65,536 such requests, finished ones
    ///   not yet reported are dropped.)
    ///
    /// A WAITING request past its deadline reports TIMEOUT. Raises `ParamInvalid` when a list
    /// holds something other than a `TransferReq` (`TypeError` for an argument that is neither
    /// a request nor iterable). Does not block.
    #[pyo3(signature = (req = None))]
    fn get_transfer_status(&self, py: Python<'_>, req: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
        let Some(req) = req else {
            let mut out = Vec::new();
            self.unreported.lock().unwrap().retain(|r| {
                let r = r.get();
                let s = r.req.status();
                out.push((r.user_data.clone_ref(py), TransferStatus::from(s)));
                s == hixl_core::TransferStatus::Waiting
            });
            return Ok(out.into_pyobject(py)?.into_any().unbind());
        };
        if let Ok(r) = req.downcast::<TransferReq>() {
            let s: TransferStatus = r.get().req.status().into();
            return Ok(s.into_pyobject(py)?.into_any().unbind());
        }
        let mut out = Vec::new();
        for item in req.try_iter()? {
            let item = item?;
            let r =
                item.downcast::<TransferReq>().map_err(|_| errors::param("expected TransferReq items"))?;
            out.push(TransferStatus::from(r.get().req.status()));
        }
        Ok(out.into_pyobject(py)?.into_any().unbind())
    }
}
