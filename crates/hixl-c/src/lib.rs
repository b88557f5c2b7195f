//! The C API of hixl (`include/hixl.h`, generated from this file by cbindgen): an engine
//! registers memory, links to other engines and READs or WRITEs their registered memory
//! one-sidedly, in batches.
//!
//! Conventions: functions return a status code (`HIXL_SUCCESS` or one of the `HIXL_*` codes,
//! the engine's own numbers); the calling thread's last error message is `hixl_last_error()`.
//! No panic crosses the boundary (it becomes `HIXL_FAILED`). Every pointer argument is checked
//! for NULL. Objects returned to the caller are owned by it and freed with their `*_free`
//! function; strings passed in are borrowed for the call only.

#![warn(clippy::undocumented_unsafe_blocks)]
#![allow(clippy::missing_safety_doc)] // each function's contract is in its doc comment

mod engine;
mod json;
mod notifies;
mod transfers;

pub use engine::*;
pub use notifies::*;
pub use transfers::*;

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use hixl_core::{Error, Status};

/// The call succeeded.
pub const HIXL_SUCCESS: u32 = 0;
/// A caller-supplied value is wrong (the message names it).
pub const HIXL_PARAM_INVALID: u32 = 103900;
/// A deadline passed.
pub const HIXL_TIMEOUT: u32 = 103901;
/// No usable link to the peer.
pub const HIXL_NOT_CONNECTED: u32 = 103902;
/// A second connect to the same peer.
pub const HIXL_ALREADY_CONNECTED: u32 = 103903;
/// A notification could not be delivered.
pub const HIXL_NOTIFY_FAILED: u32 = 103904;
/// Memory type or backend not available here.
pub const HIXL_UNSUPPORTED: u32 = 103905;
/// A queue or table is full, or an output buffer is too small.
pub const HIXL_RESOURCE_EXHAUSTED: u32 = 203900;
/// Anything else (use before initialize or after finalize, a request failed, ...).
pub const HIXL_FAILED: u32 = 503900;

/// `timeout_ms` value meaning "the engine's option" (`hixl.transfer_timeout_ms` or
/// `hixl.connect_timeout_ms`).
pub const HIXL_TIMEOUT_DEFAULT: u64 = u64::MAX;

/// Request states (`hixl_request_status`): in flight.
pub const HIXL_REQ_WAITING: u32 = 0;
/// Every byte is at its destination.
pub const HIXL_REQ_COMPLETED: u32 = 1;
/// Its deadline passed.
pub const HIXL_REQ_TIMEOUT: u32 = 2;
/// It failed (`hixl_request_result` gives why).
pub const HIXL_REQ_FAILED: u32 = 3;

/// Transfer direction: remote -> local.
pub const HIXL_READ: u32 = 0;
/// Transfer direction: local -> remote.
pub const HIXL_WRITE: u32 = 1;

/// Access of a registered region: peers may READ and WRITE it.
pub const HIXL_ACCESS_RW: u32 = 0;
/// Access of a registered region: peers may only READ it.
pub const HIXL_ACCESS_R: u32 = 1;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f`, turning its error or panic into a status code and the thread's last error.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Error>) -> u32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => HIXL_SUCCESS,
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            e.status.code()
        }
        Err(_) => {
            set_last_error("FAILED: a panic inside hixl (a bug; please report it)");
            HIXL_FAILED
        }
    }
}

/// Borrows a NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid for the call.
pub(crate) unsafe fn arg_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, Error> {
    if p.is_null() {
        return Err(Error::param(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| Error::param(format!("{what} is not UTF-8")))
}

/// Checks that an output pointer is not NULL.
pub(crate) fn out<T>(p: *mut T, what: &str) -> Result<(), Error> {
    if p.is_null() {
        Err(Error::param(format!("{what} (an output) is NULL")))
    } else {
        Ok(())
    }
}

/// `HIXL_TIMEOUT_DEFAULT` -> None (the engine's option), else milliseconds.
pub(crate) fn timeout(ms: u64) -> Option<Duration> {
    (ms != HIXL_TIMEOUT_DEFAULT).then(|| Duration::from_millis(ms))
}

/// Copies `text` (plus a NUL) into `buf` of `cap` bytes; `*len` gets its length without the
/// NUL. Too small: `HIXL_RESOURCE_EXHAUSTED`, `*len` is the length needed, nothing is copied.
///
/// # Safety
/// `buf` is NULL (with `cap` 0) or writable for `cap` bytes; `len` is writable.
pub(crate) unsafe fn copy_out(
    text: &str,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> Result<(), Error> {
    out(len, "len")?;
    // SAFETY: `len` is non-NULL and writable per the contract.
    unsafe { *len = text.len() };
    if buf.is_null() || cap < text.len() + 1 {
        return Err(Error::new(
            Status::ResourceExhausted,
            format!("the output buffer holds {cap} bytes; {} are needed", text.len() + 1),
        ));
    }
    // SAFETY: `buf` is writable for `cap` >= len + 1 bytes; the regions cannot overlap (ours
    // is a Rust string).
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast(), text.len());
        *buf.add(text.len()) = 0;
    }
    Ok(())
}

/// The version of this library ("0.1.0"); a static string, never freed.
#[no_mangle]
pub extern "C" fn hixl_version() -> *const c_char {
    static V: std::sync::OnceLock<CString> = std::sync::OnceLock::new();
    V.get_or_init(|| CString::new(hixl_core::VERSION).unwrap_or_default()).as_ptr()
}

/// The message of the calling thread's last failed call ("" when none failed). Owned by the
/// library: valid until the thread's next hixl call.
#[no_mangle]
pub extern "C" fn hixl_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_codes_are_the_engines() {
        let ours = [
            HIXL_SUCCESS,
            HIXL_PARAM_INVALID,
            HIXL_TIMEOUT,
            HIXL_NOT_CONNECTED,
            HIXL_ALREADY_CONNECTED,
            HIXL_NOTIFY_FAILED,
            HIXL_UNSUPPORTED,
            HIXL_RESOURCE_EXHAUSTED,
            HIXL_FAILED,
        ];
        let engine: Vec<u32> = Status::ALL.iter().map(|s| s.code()).collect();
        assert_eq!(ours.to_vec(), engine);
        let states = [HIXL_REQ_WAITING, HIXL_REQ_COMPLETED, HIXL_REQ_TIMEOUT, HIXL_REQ_FAILED];
        let core: Vec<u32> = hixl_core::TransferStatus::ALL.iter().map(|s| *s as u32).collect();
        assert_eq!(states.to_vec(), core);
    }

    fn last_error() -> String {
        // SAFETY: hixl_last_error returns a live NUL-terminated string.
        unsafe { CStr::from_ptr(hixl_last_error()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn null_pointers_and_small_buffers_are_refused_with_a_message() {
        // SAFETY: every pointer is NULL or live; that is what is being tested.
        unsafe {
            assert_eq!(hixl_finalize(std::ptr::null()), HIXL_PARAM_INVALID);
            assert_eq!(last_error(), "PARAM_INVALID (103900): engine is NULL");
            let e = hixl_engine_new();
            let local = CString::new("127.0.0.1:0").unwrap();
            assert_eq!(
                hixl_initialize(e, local.as_ptr(), std::ptr::null(), std::ptr::null(), 1),
                HIXL_PARAM_INVALID
            );
            assert!(last_error().contains("keys or values is NULL"));
            assert_eq!(
                hixl_initialize(e, local.as_ptr(), std::ptr::null(), std::ptr::null(), 0),
                HIXL_SUCCESS
            );
            let mut small = [0 as c_char; 4];
            let mut len = 0usize;
            let rc = hixl_local_engine(e, small.as_mut_ptr(), small.len(), &mut len);
            assert_eq!(rc, HIXL_RESOURCE_EXHAUSTED);
            assert!(len > 4, "the length needed is reported");
            let mut big = vec![0 as c_char; len + 1];
            assert_eq!(hixl_local_engine(e, big.as_mut_ptr(), big.len(), &mut len), HIXL_SUCCESS);
            assert!(CStr::from_ptr(big.as_ptr()).to_str().unwrap().starts_with("127.0.0.1:"));
            let mut h = HixlMemHandle::default();
            assert_eq!(hixl_register(e, 0x1000, 64, 7, std::ptr::null(), &mut h), HIXL_PARAM_INVALID);
            assert!(last_error().contains("access=7"));
            assert_eq!(hixl_register(e, 0, 64, HIXL_ACCESS_RW, std::ptr::null(), &mut h), HIXL_PARAM_INVALID);
            let remote = CString::new("127.0.0.1:1").unwrap();
            assert_eq!(
                hixl_transfer_sync(e, remote.as_ptr(), 9, std::ptr::null(), 0, 10),
                HIXL_PARAM_INVALID
            );
            assert_eq!(hixl_request_status(std::ptr::null()), HIXL_REQ_FAILED);
            assert_eq!(hixl_finalize(e), HIXL_SUCCESS);
            assert_eq!(hixl_finalize(e), HIXL_SUCCESS, "a second finalize does nothing");
            hixl_engine_free(e);
        }
    }

    #[test]
    fn a_reported_request_makes_the_completion_fd_readable_and_gives_its_token() {
        // SAFETY: every pointer below is live for the calls; the buffers are leaked.
        unsafe {
            let (t, i) = (hixl_engine_new(), hixl_engine_new());
            let (listen, client) = (CString::new("127.0.0.1:0").unwrap(), CString::new("127.0.0.1").unwrap());
            assert_eq!(
                hixl_initialize(t, listen.as_ptr(), std::ptr::null(), std::ptr::null(), 0),
                HIXL_SUCCESS
            );
            // TCP, so the request is still in flight when it asks to be reported (a same-process
            // link would copy inline, inside the call).
            let (k, v) = (CString::new("hixl.backends").unwrap(), CString::new("tcp").unwrap());
            let (keys, values) = ([k.as_ptr()], [v.as_ptr()]);
            assert_eq!(hixl_initialize(i, client.as_ptr(), keys.as_ptr(), values.as_ptr(), 1), HIXL_SUCCESS);
            let dst: &'static mut [u8] = Box::leak(vec![0u8; 4096].into_boxed_slice());
            let src: &'static mut [u8] = Box::leak(vec![9u8; 4096].into_boxed_slice());
            let (mut hd, mut hs) = (HixlMemHandle::default(), HixlMemHandle::default());
            let kv = CString::new("kv").unwrap();
            assert_eq!(hixl_register(t, dst.as_ptr() as u64, 4096, HIXL_ACCESS_RW, kv.as_ptr(), &mut hd), 0);
            assert_eq!(
                hixl_register(i, src.as_ptr() as u64, 4096, HIXL_ACCESS_R, std::ptr::null(), &mut hs),
                0
            );
            let mut buf = [0 as c_char; 64];
            let mut len = 0usize;
            assert_eq!(hixl_local_engine(t, buf.as_mut_ptr(), buf.len(), &mut len), 0);
            assert_eq!(hixl_connect(i, buf.as_ptr(), 5000), HIXL_SUCCESS);
            let d = crate::HixlDesc { local_addr: hs.addr, remote_addr: hd.addr, len: 4096 };
            // A request still in flight when it is reported (on a loaded machine the round trip
            // may end before the call: then another one is tried).
            let (mut req, mut pending, mut queued) = (std::ptr::null_mut::<HixlRequest>(), 0u32, 0u64);
            for _ in 0..50 {
                let rc = hixl_transfer_async(
                    i,
                    buf.as_ptr(),
                    HIXL_WRITE,
                    &d,
                    1,
                    std::ptr::null(),
                    std::ptr::null(),
                    HIXL_TIMEOUT_DEFAULT,
                    &mut req,
                );
                assert_eq!(rc, HIXL_SUCCESS);
                assert_eq!(hixl_request_report(req, 42, &mut pending, &mut queued), HIXL_SUCCESS);
                if pending == 1 {
                    break;
                }
                let mut state = 0;
                assert_eq!(hixl_request_wait(req, 5000, &mut state), HIXL_SUCCESS);
                hixl_request_free(req);
            }
            let (mut again, mut queued_again) = (0u32, 0u64);
            assert_eq!(hixl_request_report(req, 43, &mut again, &mut queued_again), HIXL_SUCCESS);
            let mut state = 0;
            assert_eq!(hixl_request_wait(req, 5000, &mut state), HIXL_SUCCESS);
            assert_eq!(state, HIXL_REQ_COMPLETED);
            assert_eq!(
                (pending, queued),
                (1, 42),
                "a TCP round trip is still in flight right after the call"
            );
            assert_eq!(queued_again, 42, "asked twice, the request keeps its first token");
            {
                let mut p = libc::pollfd { fd: hixl_completion_fd(), events: libc::POLLIN, revents: 0 };
                assert_eq!(libc::poll(&mut p, 1, 5000), 1, "the descriptor became readable");
                let mut tokens = [0u64; 8];
                let mut n = 0usize;
                assert_eq!(hixl_completion_take(tokens.as_mut_ptr(), tokens.len(), &mut n), HIXL_SUCCESS);
                assert!(tokens[..n].contains(&42), "{:?}", &tokens[..n]);
            }
            let mut n = 7usize;
            assert_eq!(hixl_completion_take(std::ptr::null_mut(), 0, &mut n), HIXL_SUCCESS);
            assert_eq!(n, 0);
            assert!(dst.iter().all(|b| *b == 9), "the bytes landed");
            hixl_request_free(req);
            hixl_engine_free(i);
            hixl_engine_free(t);
        }
    }
}
