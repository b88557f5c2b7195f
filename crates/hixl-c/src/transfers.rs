//! Transfers (batches, put/get, strided), requests, and the completion descriptor.

use std::ffi::c_char;

use hixl_core::{Error, StridedDesc, TransferReq, Waiting};

use crate::engine::{descs, engine, notify, op, HixlDesc, HixlEngine, HixlRequest, HixlStrided};
use crate::{arg_str, guard, out, timeout, HIXL_READ, HIXL_WRITE};

/// Queues a batch of `n` descriptors (`op`: `HIXL_READ` or `HIXL_WRITE`) and returns at once
/// with `*req`, to free with `hixl_request_free`. `notify_name`/`notify_msg` (both NULL: none)
/// is delivered to the peer after every byte. `timeout_ms` is the request's deadline.
///
/// # Safety
/// `e` is live; `remote` is a string; `descs` is readable for `n`; the local ranges lie in
/// registered memory; `req` is writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hixl_transfer_async(
    e: *const HixlEngine,
    remote: *const c_char,
    op_: u32,
    descs_: *const HixlDesc,
    n: usize,
    notify_name: *const c_char,
    notify_msg: *const c_char,
    timeout_ms: u64,
    req: *mut *mut HixlRequest,
) -> u32 {
    guard(|| {
        out(req, "req")?;
        // SAFETY: the caller's contract.
        unsafe {
            let eng = engine(e)?;
            let d = descs(descs_, n)?;
            let nt = notify(notify_name, notify_msg)?;
            let r = eng.transfer_async(arg_str(remote, "remote")?, op(op_)?, &d, nt, timeout(timeout_ms))?;
            *req = Box::into_raw(Box::new(HixlRequest { inner: r }));
        }
        Ok(())
    })
}

/// `hixl_transfer_async`, then waits for it (up to its deadline).
///
/// # Safety
/// As `hixl_transfer_async`, without `req`.
#[no_mangle]
pub unsafe extern "C" fn hixl_transfer_sync(
    e: *const HixlEngine,
    remote: *const c_char,
    op_: u32,
    descs_: *const HixlDesc,
    n: usize,
    timeout_ms: u64,
) -> u32 {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            let eng = engine(e)?;
            let d = descs(descs_, n)?;
            let r = eng.submit_transfer(
                arg_str(remote, "remote")?,
                op(op_)?,
                &d,
                None,
                timeout(timeout_ms),
                Waiting::Now,
            )?;
            r.wait(None);
            r.result()
        }
    })
}

/// One-sided WRITE of `len` bytes, waiting for it.
///
/// # Safety
/// As `hixl_transfer_sync`.
#[no_mangle]
pub unsafe extern "C" fn hixl_put(
    e: *const HixlEngine,
    remote: *const c_char,
    local_addr: u64,
    remote_addr: u64,
    len: u64,
    timeout_ms: u64,
) -> u32 {
    let d = HixlDesc { local_addr, remote_addr, len };
    // SAFETY: the caller's contract; `d` is one live descriptor.
    unsafe { hixl_transfer_sync(e, remote, HIXL_WRITE, &d, 1, timeout_ms) }
}

/// One-sided READ of `len` bytes, waiting for it.
///
/// # Safety
/// As `hixl_transfer_sync`.
#[no_mangle]
pub unsafe extern "C" fn hixl_get(
    e: *const HixlEngine,
    remote: *const c_char,
    local_addr: u64,
    remote_addr: u64,
    len: u64,
    timeout_ms: u64,
) -> u32 {
    let d = HixlDesc { local_addr, remote_addr, len };
    // SAFETY: the caller's contract; `d` is one live descriptor.
    unsafe { hixl_transfer_sync(e, remote, HIXL_READ, &d, 1, timeout_ms) }
}

/// A strided transfer (one request, one descriptor on the wire), waiting for it.
///
/// # Safety
/// As `hixl_transfer_sync`; `desc` is readable.
#[no_mangle]
pub unsafe extern "C" fn hixl_transfer_strided(
    e: *const HixlEngine,
    remote: *const c_char,
    op_: u32,
    local_base: u64,
    remote_base: u64,
    desc: *const HixlStrided,
    timeout_ms: u64,
) -> u32 {
    guard(|| {
        if desc.is_null() {
            return Err(Error::param("desc is NULL"));
        }
        // SAFETY: the caller's contract.
        unsafe {
            let s = *desc;
            let rs = (s.remote_stride != 0).then_some(s.remote_stride);
            let d = StridedDesc { count: s.count, size: s.size, stride: s.stride, remote_stride: rs };
            let r = engine(e)?.submit_strided(
                arg_str(remote, "remote")?,
                op(op_)?,
                (local_base, remote_base),
                &d,
                None,
                timeout(timeout_ms),
                Waiting::Now,
            )?;
            r.wait(None);
            r.result()
        }
    })
}

/// # Safety
/// `r` is NULL or a live request.
unsafe fn request<'a>(r: *const HixlRequest) -> Result<&'a TransferReq, Error> {
    if r.is_null() {
        return Err(Error::param("req is NULL"));
    }
    // SAFETY: non-NULL and live per the caller's contract.
    Ok(unsafe { &(*r).inner })
}

/// The request's state now (`HIXL_REQ_*`; past its deadline a waiting one turns TIMEOUT).
/// NULL gives `HIXL_REQ_FAILED`.
///
/// # Safety
/// `r` is NULL or a live request.
#[no_mangle]
pub unsafe extern "C" fn hixl_request_status(r: *const HixlRequest) -> u32 {
    let mut state = crate::HIXL_REQ_FAILED;
    // Guarded like every entry point: settling a request past its deadline wakes its waiters,
    // code that is not ours.
    let rc = guard(|| {
        // SAFETY: the caller's contract.
        state = unsafe { request(r) }?.status() as u32;
        Ok(())
    });
    if rc == crate::HIXL_SUCCESS {
        state
    } else {
        crate::HIXL_REQ_FAILED
    }
}

/// Waits up to `timeout_ms` (`HIXL_TIMEOUT_DEFAULT`: its deadline) and writes its state to
/// `*state`. Blocks.
///
/// # Safety
/// `r` is a live request; `state` is writable.
#[no_mangle]
pub unsafe extern "C" fn hixl_request_wait(r: *const HixlRequest, timeout_ms: u64, state: *mut u32) -> u32 {
    guard(|| {
        out(state, "state")?;
        // SAFETY: the caller's contract.
        unsafe { *state = request(r)?.wait(timeout(timeout_ms)) as u32 };
        Ok(())
    })
}

/// `HIXL_SUCCESS` when the request completed; otherwise its error code (and last error), or
/// `HIXL_TIMEOUT` while it is still waiting.
///
/// # Safety
/// `r` is a live request.
#[no_mangle]
pub unsafe extern "C" fn hixl_request_result(r: *const HixlRequest) -> u32 {
    // SAFETY: the caller's contract.
    guard(|| unsafe { request(r) }?.result())
}

/// Asks for `token` to be queued on the process's completion queue when the request settles
/// (see `hixl_completion_fd`). `*pending` becomes 1 when a token will be queued, and
/// `*queued` that token (a request reports one token: asked again, it keeps the first); 0
/// when the request has settled already (do not wait for a token).
///
/// # Safety
/// `r` is a live request; `pending` and `queued` are writable.
#[no_mangle]
pub unsafe extern "C" fn hixl_request_report(
    r: *const HixlRequest,
    token: u64,
    pending: *mut u32,
    queued: *mut u64,
) -> u32 {
    guard(|| {
        out(pending, "pending")?;
        out(queued, "queued")?;
        // SAFETY: the caller's contract.
        unsafe {
            let got = request(r)?.report_to(completions()?, token);
            *pending = u32::from(got.is_some());
            *queued = got.unwrap_or(0);
        }
        Ok(())
    })
}

/// Frees a request (the transfer goes on). NULL is ignored.
///
/// # Safety
/// `r` is NULL or from a `*_async` call, freed once.
#[no_mangle]
pub unsafe extern "C" fn hixl_request_free(r: *mut HixlRequest) {
    if !r.is_null() {
        // SAFETY: from Box::into_raw, freed once per the contract.
        let b = unsafe { Box::from_raw(r) };
        let _ = guard(move || {
            drop(b);
            Ok(())
        });
    }
}

/// The process's completion queue, made on first use (an error when no eventfd can be had).
fn completions() -> Result<&'static std::sync::Arc<hixl_core::CompletionQueue>, Error> {
    static Q: std::sync::OnceLock<std::sync::Arc<hixl_core::CompletionQueue>> = std::sync::OnceLock::new();
    if let Some(q) = Q.get() {
        return Ok(q);
    }
    let q = std::sync::Arc::new(hixl_core::CompletionQueue::new()?);
    Ok(Q.get_or_init(|| q))
}

/// The process's completion descriptor: readable (poll, epoll, an event loop) while tokens of
/// settled requests wait (`hixl_request_report`, `hixl_completion_take`). Owned by the
/// library; do not close it. -1 when none can be made (`hixl_last_error` says why).
#[no_mangle]
pub extern "C" fn hixl_completion_fd() -> i32 {
    let mut fd = -1;
    let rc = guard(|| {
        fd = completions()?.fd();
        Ok(())
    });
    if rc == crate::HIXL_SUCCESS {
        fd
    } else {
        -1
    }
}

/// Takes up to `cap` tokens of settled requests into `tokens`; `*n` gets how many. The
/// descriptor stays readable while more wait.
///
/// # Safety
/// `tokens` is writable for `cap` values; `n` is writable.
#[no_mangle]
pub unsafe extern "C" fn hixl_completion_take(tokens: *mut u64, cap: usize, n: *mut usize) -> u32 {
    guard(|| {
        out(n, "n")?;
        if tokens.is_null() && cap > 0 {
            return Err(Error::param("tokens is NULL"));
        }
        let got = completions()?.take(cap);
        if !got.is_empty() {
            // SAFETY: `tokens` is non-NULL (cap > 0 here) and writable for `cap` >= got.len().
            unsafe { std::ptr::copy_nonoverlapping(got.as_ptr(), tokens, got.len()) };
        }
        // SAFETY: `n` is non-NULL (checked) and writable per the contract.
        unsafe { *n = got.len() };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};
    use std::time::Duration;

    use hixl_core::{Request, TransferOp};

    use super::*;

    /// Holds up the thread that wakes it (the process's deadline thread, here).
    struct Stall;
    impl Wake for Stall {
        fn wake(self: Arc<Self>) {
            std::thread::sleep(Duration::from_secs(3));
        }
    }

    /// Panics in the thread that wakes it.
    struct Boom;
    impl Wake for Boom {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics");
        }
    }

    /// A request of `ms` milliseconds awaited by a task with waker `w` (the future is kept:
    /// dropping it would abandon the wait).
    fn awaited(ms: u64, w: Waker) -> (Arc<Request>, std::pin::Pin<Box<hixl_core::Completion>>) {
        let timeout = Duration::from_millis(ms);
        let r = Arc::new(Request::new(1, TransferOp::Write, "peer", 0, 1, 1, timeout, Vec::new(), None));
        let mut f = Box::pin(r.completion());
        assert!(std::future::Future::poll(f.as_mut(), &mut Context::from_waker(&w)).is_pending());
        (r, f)
    }

    #[test]
    fn a_panic_under_request_status_does_not_cross_the_boundary() {
        // The first request's waker holds the process's deadline thread up, so the second's
        // deadline is acted on by hixl_request_status, where its waker panics.
        let _stalled = awaited(5, Waker::from(Arc::new(Stall)));
        std::thread::sleep(Duration::from_millis(100));
        let (r, _f) = awaited(10, Waker::from(Arc::new(Boom)));
        let req = HixlRequest { inner: r };
        std::thread::sleep(Duration::from_millis(50));
        // SAFETY: `req` is a live request.
        assert_eq!(unsafe { hixl_request_status(&req) }, crate::HIXL_REQ_FAILED);
        // SAFETY: hixl_last_error returns a live NUL-terminated string.
        let msg =
            unsafe { std::ffi::CStr::from_ptr(crate::hixl_last_error()) }.to_string_lossy().into_owned();
        assert!(msg.contains("a panic inside hixl"), "{msg}");
        // SAFETY: as above.
        assert_eq!(unsafe { hixl_request_status(&req) }, crate::HIXL_REQ_TIMEOUT, "it settled");
    }
}
