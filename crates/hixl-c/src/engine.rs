//! The C API's types and the engine's calls: lifecycle, memory, links.

use std::collections::HashMap;
use std::ffi::{c_char, c_void};

use hixl_core::{
    Access, Engine, Error, MemDesc, MemHandle, MemType, NotifyDesc, TransferOp, TransferOpDesc, TransferReq,
};

use crate::{arg_str, copy_out, guard, out, timeout, HIXL_ACCESS_R, HIXL_ACCESS_RW, HIXL_READ, HIXL_WRITE};

/// An engine (opaque). Created by `hixl_engine_new`, freed by `hixl_engine_free`.
pub struct HixlEngine {
    pub(crate) inner: Engine,
}

/// A transfer in flight or ended (opaque). Returned by the `*_async` calls, freed by
/// `hixl_request_free` (freeing it does not cancel the transfer).
pub struct HixlRequest {
    pub(crate) inner: TransferReq,
}

/// One descriptor of a batch: `len` bytes between `local_addr` and `remote_addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HixlDesc {
    /// Address in this process.
    pub local_addr: u64,
    /// Address in the peer's process.
    pub remote_addr: u64,
    /// Bytes.
    pub len: u64,
}

/// A registered region, as `hixl_register` fills it; `hixl_deregister` takes it back.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HixlMemHandle {
    /// Registry id.
    pub id: u64,
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// `count` elements of `size` bytes, `stride` apart here and `remote_stride` apart at the
/// peer (0: the same as `stride`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HixlStrided {
    /// Elements.
    pub count: u64,
    /// Bytes per element.
    pub size: u64,
    /// Local distance between elements.
    pub stride: u64,
    /// Remote distance between elements (0: `stride`).
    pub remote_stride: u64,
}

/// A region the peer registered, as `hixl_remote_region` fills it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HixlRemoteRegion {
    /// Start address in the peer's process.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// 1 when peers may WRITE it, 0 when it is read-only.
    pub writable: u32,
}

/// Called once per notification by `hixl_get_notifies` / `hixl_wait_notifies`, with the
/// caller's `ctx`; `name` and `msg` are valid during the call only.
pub type HixlNotifyFn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, name: *const c_char, msg: *const c_char)>;

/// Called once per notification by `hixl_get_notifies_from` / `hixl_wait_notifies_from`, with
/// the caller's `ctx`; `peer` is the engine id of the connection it arrived on ("ip:port",
/// "ip#pid"; see docs/RELIABILITY.md, "Notifications' sender"). All three strings are valid
/// during the call only.
pub type HixlNotifyFromFn = Option<
    unsafe extern "C" fn(ctx: *mut c_void, peer: *const c_char, name: *const c_char, msg: *const c_char),
>;

/// # Safety
/// `e` is NULL or an engine from `hixl_engine_new` not yet freed.
pub(crate) unsafe fn engine<'a>(e: *const HixlEngine) -> Result<&'a Engine, Error> {
    if e.is_null() {
        return Err(Error::param("engine is NULL"));
    }
    // SAFETY: non-NULL and live per the caller's contract.
    Ok(unsafe { &(*e).inner })
}

pub(crate) fn op(v: u32) -> Result<TransferOp, Error> {
    match v {
        HIXL_READ => Ok(TransferOp::Read),
        HIXL_WRITE => Ok(TransferOp::Write),
        other => Err(Error::param(format!("op={other} must be HIXL_READ (0) or HIXL_WRITE (1)"))),
    }
}

/// # Safety
/// `descs` is NULL (with `n` 0) or readable for `n` descriptors.
pub(crate) unsafe fn descs(descs: *const HixlDesc, n: usize) -> Result<Vec<TransferOpDesc>, Error> {
    if descs.is_null() && n > 0 {
        return Err(Error::param("descs is NULL"));
    }
    let s: &[HixlDesc] = if n == 0 {
        &[]
    } else {
        // SAFETY: non-NULL and readable for `n` elements per the contract.
        unsafe { std::slice::from_raw_parts(descs, n) }
    };
    Ok(s.iter()
        .map(|d| TransferOpDesc { local_addr: d.local_addr, remote_addr: d.remote_addr, len: d.len })
        .collect())
}

/// # Safety
/// `name` and `msg` are both NULL (no notification) or NUL-terminated strings.
pub(crate) unsafe fn notify(name: *const c_char, msg: *const c_char) -> Result<Option<NotifyDesc>, Error> {
    if name.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    let (name, msg) = unsafe { (arg_str(name, "notify_name")?, arg_str(msg, "notify_msg")?) };
    Ok(Some(NotifyDesc::new(name.to_string(), msg.to_string())))
}

/// A new engine that does nothing until `hixl_initialize`. Never NULL. Free it with
/// `hixl_engine_free`.
#[no_mangle]
pub extern "C" fn hixl_engine_new() -> *mut HixlEngine {
    Box::into_raw(Box::new(HixlEngine { inner: Engine::new() }))
}

/// Finalizes (if needed) and frees an engine. NULL is ignored. No call on it may run
/// concurrently or follow.
///
/// # Safety
/// `e` is NULL or from `hixl_engine_new`, freed once.
#[no_mangle]
pub unsafe extern "C" fn hixl_engine_free(e: *mut HixlEngine) {
    if !e.is_null() {
        // SAFETY: from Box::into_raw in hixl_engine_new, freed once per the contract.
        let b = unsafe { Box::from_raw(e) };
        // The drop runs inside the guard too: no panic may cross.
        let _ = guard(move || {
            let res = b.inner.finalize();
            drop(b);
            res
        });
    }
}

/// Starts the engine: `local_engine` "ip:port" listens (port 0: any free port), "ip" alone is
/// a client only. `keys`/`values` are `n` option pairs (`hixl.*` keys, HIXL's own keys), or
/// NULL with `n` 0.
///
/// # Safety
/// `e` is live; `local_engine` is a string; `keys`/`values` are readable for `n` strings.
#[no_mangle]
pub unsafe extern "C" fn hixl_initialize(
    e: *const HixlEngine,
    local_engine: *const c_char,
    keys: *const *const c_char,
    values: *const *const c_char,
    n: usize,
) -> u32 {
    guard(|| {
        // SAFETY: the caller's contract, for every pointer below.
        unsafe {
            let eng = engine(e)?;
            let local = arg_str(local_engine, "local_engine")?;
            let mut opts = HashMap::new();
            if n > 0 && (keys.is_null() || values.is_null()) {
                return Err(Error::param("keys or values is NULL"));
            }
            for i in 0..n {
                let k = arg_str(*keys.add(i), "an option key")?;
                let v = arg_str(*values.add(i), "an option value")?;
                opts.insert(k.to_string(), v.to_string());
            }
            eng.initialize(local, &opts)
        }
    })
}

/// Stops the engine: fails what is in flight, closes links, deregisters memory. A second call
/// does nothing (or reports again the failure of the first).
///
/// # Safety
/// `e` is live.
#[no_mangle]
pub unsafe extern "C" fn hixl_finalize(e: *const HixlEngine) -> u32 {
    // SAFETY: the caller's contract.
    guard(|| unsafe { engine(e) }?.finalize())
}

/// Writes the engine's id ("ip:port" it listens on, or "ip#pid") into `buf` (`cap` bytes,
/// NUL-terminated); `*len` gets its length. Too small: `HIXL_RESOURCE_EXHAUSTED` with `*len`
/// the length needed.
///
/// # Safety
/// `e` is live; `buf` is writable for `cap` bytes; `len` is writable.
#[no_mangle]
pub unsafe extern "C" fn hixl_local_engine(
    e: *const HixlEngine,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> u32 {
    // SAFETY: the caller's contract.
    guard(|| unsafe { copy_out(&engine(e)?.local_engine()?, buf, cap, len) })
}

/// Registers `[addr, addr+len)` of this process for peers (`access`: `HIXL_ACCESS_RW` or
/// `HIXL_ACCESS_R`), under `name` (NULL: none); fills `*handle`.
///
/// # Safety
/// `e` is live; the memory stays mapped and valid until deregistered (peers write into it);
/// `name` is NULL or a string; `handle` is writable.
#[no_mangle]
pub unsafe extern "C" fn hixl_register(
    e: *const HixlEngine,
    addr: u64,
    len: u64,
    access: u32,
    name: *const c_char,
    handle: *mut HixlMemHandle,
) -> u32 {
    guard(|| {
        out(handle, "handle")?;
        let access = match access {
            HIXL_ACCESS_RW => Access::ReadWrite,
            HIXL_ACCESS_R => Access::ReadOnly,
            other => {
                return Err(Error::param(format!("access={other} must be HIXL_ACCESS_RW or HIXL_ACCESS_R")))
            }
        };
        // SAFETY: the caller's contract (the memory outlives its registration).
        unsafe {
            let name = if name.is_null() { "" } else { arg_str(name, "name")? };
            let h = engine(e)?.register_named(MemDesc { addr, len }, MemType::Host, access, name)?;
            *handle = HixlMemHandle { id: h.id, addr: h.addr, len: h.len };
        }
        Ok(())
    })
}

/// Deregisters a region (waits for transfers using it, up to `hixl.deregister_timeout_ms`).
/// Idempotent.
///
/// # Safety
/// `e` is live; `handle` points to a handle `hixl_register` filled.
#[no_mangle]
pub unsafe extern "C" fn hixl_deregister(e: *const HixlEngine, handle: *const HixlMemHandle) -> u32 {
    guard(|| {
        if handle.is_null() {
            return Err(Error::param("handle is NULL"));
        }
        // SAFETY: the caller's contract.
        let (eng, h) = unsafe { (engine(e)?, *handle) };
        eng.deregister_mem(&MemHandle { id: h.id, addr: h.addr, len: h.len, mem_type: MemType::Host })
    })
}

/// Links to `remote` ("ip:port"), retrying refused connections until `timeout_ms`
/// (`HIXL_TIMEOUT_DEFAULT`: `hixl.connect_timeout_ms`). Blocks.
///
/// # Safety
/// `e` is live; `remote` is a string.
#[no_mangle]
pub unsafe extern "C" fn hixl_connect(e: *const HixlEngine, remote: *const c_char, timeout_ms: u64) -> u32 {
    guard(|| {
        // SAFETY: the caller's contract.
        let (eng, remote) = unsafe { (engine(e)?, arg_str(remote, "remote")?) };
        let t = match timeout(timeout_ms) {
            Some(t) => t,
            None => eng.default_timeouts()?.1,
        };
        eng.connect(remote, t)
    })
}

/// Starts linking to `remote` in the background; `hixl_connect_status` follows it.
///
/// # Safety
/// `e` is live; `remote` is a string.
#[no_mangle]
pub unsafe extern "C" fn hixl_connect_async(e: *const HixlEngine, remote: *const c_char) -> u32 {
    // SAFETY: the caller's contract.
    guard(|| unsafe { engine(e)?.connect_async(arg_str(remote, "remote")?) })
}

/// The state of a link: `*status` = 0 not connected, 1 connecting, 2 connected, 3 failed.
///
/// # Safety
/// `e` is live; `remote` is a string; `status` is writable.
#[no_mangle]
pub unsafe extern "C" fn hixl_connect_status(
    e: *const HixlEngine,
    remote: *const c_char,
    status: *mut u32,
) -> u32 {
    guard(|| {
        out(status, "status")?;
        // SAFETY: the caller's contract.
        unsafe {
            let s = engine(e)?.get_async_connect_status(arg_str(remote, "remote")?)?;
            *status = s as u32;
        }
        Ok(())
    })
}

/// Waits up to `timeout_ms` for the transfers already submitted to `remote`, then closes the
/// link.
///
/// # Safety
/// `e` is live; `remote` is a string.
#[no_mangle]
pub unsafe extern "C" fn hixl_disconnect(
    e: *const HixlEngine,
    remote: *const c_char,
    timeout_ms: u64,
) -> u32 {
    guard(|| {
        // SAFETY: the caller's contract.
        let (eng, remote) = unsafe { (engine(e)?, arg_str(remote, "remote")?) };
        let t = match timeout(timeout_ms) {
            Some(t) => t,
            None => eng.default_timeouts()?.0,
        };
        eng.disconnect(remote, t)
    })
}

/// Finds the region `remote` registered under `name` (asking the peer once when this
/// engine's copy of its table lacks it); fills `*region`.
///
/// # Safety
/// `e` is live; `remote` and `name` are strings; `region` is writable.
#[no_mangle]
pub unsafe extern "C" fn hixl_remote_region(
    e: *const HixlEngine,
    remote: *const c_char,
    name: *const c_char,
    region: *mut HixlRemoteRegion,
) -> u32 {
    guard(|| {
        out(region, "region")?;
        // SAFETY: the caller's contract.
        unsafe {
            let r = engine(e)?.remote_region(arg_str(remote, "remote")?, arg_str(name, "name")?)?;
            *region = HixlRemoteRegion { addr: r.addr, len: r.len, writable: u32::from(r.writable) };
        }
        Ok(())
    })
}
