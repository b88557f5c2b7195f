//! Notifications (send, collect, wait with a callback), stats and metrics.

use std::ffi::{c_char, c_void, CString};

use hixl_core::{Error, NotifyDesc};

use crate::engine::{engine, HixlEngine, HixlNotifyFn, HixlNotifyFromFn};
use crate::{arg_str, copy_out, guard, timeout};

/// Sends a notification to `remote`, after the transfers already submitted to it have ended.
///
/// # Safety
/// `e` is live; `remote`, `name` and `msg` are strings.
#[no_mangle]
pub unsafe extern "C" fn hixl_send_notify(
    e: *const HixlEngine,
    remote: *const c_char,
    name: *const c_char,
    msg: *const c_char,
    timeout_ms: u64,
) -> u32 {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            let eng = engine(e)?;
            let n = NotifyDesc::new(arg_str(name, "name")?, arg_str(msg, "msg")?);
            let t = match timeout(timeout_ms) {
                Some(t) => t,
                None => eng.default_timeouts()?.0,
            };
            eng.send_notify(arg_str(remote, "remote")?, n, t)
        }
    })
}

/// One of the two callback kinds, checked not NULL before any notification is taken from the
/// engine (PARAM_INVALID).
#[derive(Clone, Copy)]
enum NotifyCb {
    Plain(unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char)),
    From(unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char, *const c_char)),
}

fn callback(cb: HixlNotifyFn) -> Result<NotifyCb, Error> {
    cb.map(NotifyCb::Plain).ok_or_else(|| Error::param("callback is NULL"))
}

fn callback_from(cb: HixlNotifyFromFn) -> Result<NotifyCb, Error> {
    cb.map(NotifyCb::From).ok_or_else(|| Error::param("callback is NULL"))
}

fn c_text(s: &str) -> CString {
    CString::new(s.replace('\0', " ")).unwrap_or_default()
}

/// The wait both `hixl_wait_notifies` forms share: up to `timeout_ms`
/// (`HIXL_TIMEOUT_DEFAULT`: `hixl.transfer_timeout_ms`) for notifications named `name`.
///
/// # Safety
/// `e` is live; `name` is NULL or a string.
unsafe fn wait(e: *const HixlEngine, timeout_ms: u64, name: *const c_char) -> Result<Vec<NotifyDesc>, Error> {
    // SAFETY: the caller's contract.
    let eng = unsafe { engine(e) }?;
    // SAFETY: the caller's contract.
    let name = if name.is_null() { None } else { Some(unsafe { arg_str(name, "name") }?) };
    let t = match timeout(timeout_ms) {
        Some(t) => t,
        None => eng.default_timeouts()?.0,
    };
    eng.wait_notifies(t, name)
}

fn deliver(notes: Vec<NotifyDesc>, cb: NotifyCb, ctx: *mut c_void) -> Result<(), Error> {
    for n in notes {
        let (name, msg) = (c_text(&n.name), c_text(&n.msg));
        match cb {
            // SAFETY: the caller's callback gets two strings valid for the call, and its ctx.
            NotifyCb::Plain(f) => unsafe { f(ctx, name.as_ptr(), msg.as_ptr()) },
            NotifyCb::From(f) => {
                let peer = c_text(&n.peer);
                // SAFETY: as above, with the sender's engine id first.
                unsafe { f(ctx, peer.as_ptr(), name.as_ptr(), msg.as_ptr()) }
            }
        }
    }
    Ok(())
}

/// Hands every pending notification to `cb` (then forgets them). Does not block.
///
/// # Safety
/// `e` is live; `cb` is a function that may be called with `ctx`.
#[no_mangle]
pub unsafe extern "C" fn hixl_get_notifies(e: *const HixlEngine, cb: HixlNotifyFn, ctx: *mut c_void) -> u32 {
    // SAFETY: the caller's contract.
    guard(|| {
        let cb = callback(cb)?;
        // SAFETY: the caller's contract.
        deliver(unsafe { engine(e) }?.get_notifies()?, cb, ctx)
    })
}

/// Waits up to `timeout_ms` (`HIXL_TIMEOUT_DEFAULT`: `hixl.transfer_timeout_ms`) until a
/// notification named `name` (NULL: any) is pending, hands those to `cb` and leaves the
/// others; `HIXL_TIMEOUT` when none came.
///
/// # Safety
/// `e` is live; `name` is NULL or a string; `cb` may be called with `ctx`.
#[no_mangle]
pub unsafe extern "C" fn hixl_wait_notifies(
    e: *const HixlEngine,
    timeout_ms: u64,
    name: *const c_char,
    cb: HixlNotifyFn,
    ctx: *mut c_void,
) -> u32 {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            let cb = callback(cb)?;
            deliver(wait(e, timeout_ms, name)?, cb, ctx)
        }
    })
}

/// As `hixl_get_notifies`, with each notification's sender: `cb` gets the engine id of the
/// connection it arrived on before its name and message.
///
/// # Safety
/// `e` is live; `cb` is a function that may be called with `ctx`.
#[no_mangle]
pub unsafe extern "C" fn hixl_get_notifies_from(
    e: *const HixlEngine,
    cb: HixlNotifyFromFn,
    ctx: *mut c_void,
) -> u32 {
    guard(|| {
        let cb = callback_from(cb)?;
        // SAFETY: the caller's contract.
        deliver(unsafe { engine(e) }?.get_notifies()?, cb, ctx)
    })
}

/// As `hixl_wait_notifies`, with each notification's sender (as `hixl_get_notifies_from`).
///
/// # Safety
/// `e` is live; `name` is NULL or a string; `cb` may be called with `ctx`.
#[no_mangle]
pub unsafe extern "C" fn hixl_wait_notifies_from(
    e: *const HixlEngine,
    timeout_ms: u64,
    name: *const c_char,
    cb: HixlNotifyFromFn,
    ctx: *mut c_void,
) -> u32 {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe {
            let cb = callback_from(cb)?;
            deliver(wait(e, timeout_ms, name)?, cb, ctx)
        }
    })
}

/// Per-peer stats as a JSON object (`{"peer": {"backend": ..., "bytes_write": ..., ...}}`)
/// into `buf` (`cap` bytes, NUL-terminated); `*len` gets its length. Too small:
/// `HIXL_RESOURCE_EXHAUSTED` with `*len` the length needed.
///
/// # Safety
/// `e` is live; `buf` is writable for `cap` bytes; `len` is writable.
#[no_mangle]
pub unsafe extern "C" fn hixl_stats_json(
    e: *const HixlEngine,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> u32 {
    // SAFETY: the caller's contract.
    guard(|| unsafe { copy_out(&crate::json::stats(&engine(e)?.stats()?), buf, cap, len) })
}

/// The engine's Prometheus metrics (text format 0.0.4), peer labels capped at `max_peers`,
/// into `buf` like `hixl_stats_json`.
///
/// # Safety
/// As `hixl_stats_json`.
#[no_mangle]
pub unsafe extern "C" fn hixl_metrics_text(
    e: *const HixlEngine,
    max_peers: usize,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> u32 {
    guard(|| {
        // SAFETY: the caller's contract.
        let m = hixl_core::metrics::EngineMetrics::of(unsafe { engine(e) }?)?;
        // SAFETY: the caller's contract.
        unsafe { copy_out(&hixl_core::metrics::render(&[m], max_peers), buf, cap, len) }
    })
}
