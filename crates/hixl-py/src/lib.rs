//! Python bindings of hixl-core, built by maturin into `hixl._hixl`. Thin by design: every
//! call that can block or copy releases the GIL. Modules mirror the core crate's.

mod args;
mod buffer;
mod descs;
mod device;
mod engine;
mod errors;
mod keep;
mod request;
mod types;

use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyString};

/// Sets the level of hixl's log (stderr) for this process: `level` is "DEBUG", "INFO",
/// "WARN" (or "WARNING") or "ERROR", in any case (`ParamInvalid` otherwise). The start level
/// comes from `HIXL_LOG_LEVEL` (default WARN).
#[pyfunction]
fn set_log_level(level: args::Text) -> PyResult<()> {
    hixl_core::log::set_level(&level).map_err(errors::to_py)
}

/// Internal (hixl._logging): the log records queued now (waiting up to `max_wait_ms` for the
/// first), as (level 0 ERROR..3 DEBUG, target, message); GIL released while waiting.
#[pyfunction]
fn _log_take(py: Python<'_>, max_wait_ms: u64) -> Vec<(u8, String, String)> {
    let q = hixl_core::log::init_queue();
    let records = py.allow_threads(|| q.take(std::time::Duration::from_millis(max_wait_ms)));
    records.into_iter().map(|r| (r.level, r.target, r.message)).collect()
}

/// Internal (hixl._logging, at exit): ends a `_log_take` that waits now, and every later one,
/// at once.
#[pyfunction]
fn _log_wake() {
    hixl_core::log::init_queue().wake();
}

/// Log records lost because Python did not take them in time (the queue holds 4096).
#[pyfunction]
fn log_dropped() -> u64 {
    hixl_core::log::init_queue().dropped()
}

/// The current level of hixl's log: "DEBUG", "INFO", "WARN" or "ERROR".
#[pyfunction]
fn get_log_level() -> &'static str {
    hixl_core::log::level()
}

/// The one definition of hixl's status codes: a list of (name, code), SUCCESS first.
/// `hixl.Status` and the exception classes carry the same codes.
#[pyfunction]
fn status_codes() -> Vec<(&'static str, u32)> {
    hixl_core::Status::ALL.iter().map(|s| (s.name(), s.code())).collect()
}

/// The one definition of the transfer states: a list of (name, number), as `TransferStatus`
/// has them.
#[pyfunction]
fn transfer_states() -> Vec<(&'static str, u8)> {
    hixl_core::TransferStatus::ALL.iter().map(|s| (s.name(), *s as u8)).collect()
}

/// The engine's option keys, as `Hixl.initialize` takes them: a list of (key, default,
/// meaning); an empty default means unset.
#[pyfunction]
fn option_keys() -> Vec<(&'static str, &'static str, &'static str)> {
    hixl_core::option_keys()
}

/// The backends of this build, in the order of `auto` (the one table in hixl-core): a list of
/// dicts with `name`, `meaning` (what it reaches), `reach` (the engines it serves: "process",
/// "host" or "network"), `domains` (the memory it moves, as text),
/// `offered` (when `auto` offers it, if not always), `cli` (whether the `hixl` command offers
/// it as a transport), `baseline` (what `hixl bench` compares it with; empty: nothing) and
/// `options` (its own option keys: a list of (key, default, meaning)).
#[pyfunction]
fn backends(py: Python<'_>) -> PyResult<Vec<Bound<'_, pyo3::types::PyDict>>> {
    hixl_core::BACKENDS
        .iter()
        .map(|e| {
            let d = e.decl;
            let out = pyo3::types::PyDict::new(py);
            out.set_item("name", d.name)?;
            out.set_item("meaning", d.meaning)?;
            out.set_item("reach", d.reach.as_str())?;
            out.set_item("domains", d.domains)?;
            out.set_item("offered", d.offered)?;
            out.set_item("cli", d.cli)?;
            out.set_item("baseline", d.baseline)?;
            let opts: Vec<_> = d.options.iter().map(|o| (o.key, o.default, o.meaning)).collect();
            out.set_item("options", opts)?;
            Ok(out)
        })
        .collect()
}

/// Internal (`hixl info`): what each backend of this build finds out about this host without
/// a peer, as {name: (usable, note)}: `usable` is True or False where that is known without a
/// connection (an RDMA device with an active port) and None where only a connection tells;
/// `note` is a remark for its row ("" when none). GIL released (opening devices takes a while).
#[pyfunction]
fn _host_facts(py: Python<'_>) -> std::collections::HashMap<&'static str, (Option<bool>, String)> {
    py.allow_threads(|| {
        hixl_core::BACKENDS
            .iter()
            .map(|e| {
                let f = (e.decl.host_facts)();
                (e.decl.name, (f.usable, f.note))
            })
            .collect()
    })
}

/// Prometheus text exposition (format 0.0.4) of `engines` (engines not initialized, or
/// finalized, are left out); every engine's peers past the `max_peers` that moved the most
/// bytes are summed under `peer="_other"`. `hixl.metrics.serve` serves it over HTTP.
#[pyfunction]
#[pyo3(signature = (engines, max_peers = 32))]
fn metrics_text(py: Python<'_>, engines: Vec<PyRef<'_, engine::Hixl>>, max_peers: usize) -> String {
    let cores: Vec<_> = engines.iter().map(|e| e.engine.clone()).collect();
    py.allow_threads(|| {
        let snaps: Vec<_> =
            cores.iter().filter_map(|e| hixl_core::metrics::EngineMetrics::of(e).ok()).collect();
        hixl_core::metrics::render(&snaps, max_peers)
    })
}

/// Internal (hixl's Python threads): the CPU set of the engine initialized last in this
/// process (see `Hixl.cpus`), None before any.
#[pyfunction]
fn _process_cpus() -> Option<std::collections::BTreeSet<usize>> {
    hixl_core::place::last().map(|c| c.iter().copied().collect())
}

/// Internal (hixl.aio): the completion queue's file descriptor, readable while tokens wait.
#[pyfunction]
fn _completion_fd() -> PyResult<i32> {
    Ok(request::completions()?.fd())
}

/// Internal (hixl.aio): the tokens of the requests settled since the last call.
#[pyfunction]
fn _drain_completions() -> PyResult<Vec<u64>> {
    Ok(request::completions()?.drain())
}

/// The option keys of Huawei's HIXL that initialize accepts: list of (key, what hixl does with
/// it). Keys without an effect here are checked and logged once.
#[pyfunction]
fn hixl_option_keys() -> Vec<(&'static str, &'static str)> {
    hixl_core::HIXL_OPTIONS.iter().map(|c| (c.key, c.effect)).collect()
}

/// Internal (`hixl bench`, benches/), a baseline: starts a raw TCP sink (Rust recv loop) in
/// this process; returns its address.
#[pyfunction]
fn _raw_tcp_sink(listen: &str) -> PyResult<String> {
    hixl_core::bench::raw_tcp_sink(listen).map_err(errors::to_py)
}

/// Internal (`hixl bench`, benches/), a baseline: sends `iters` messages of `size` bytes to a
/// raw sink over `streams` connections; seconds per message.
#[pyfunction]
#[pyo3(signature = (addr, size, iters, streams = 1))]
fn _raw_tcp_send(
    py: Python<'_>,
    addr: &str,
    size: usize,
    iters: usize,
    streams: usize,
) -> PyResult<Vec<f64>> {
    py.allow_threads(|| hixl_core::bench::raw_tcp_send(addr, size, iters, streams)).map_err(errors::to_py)
}

/// Internal (`hixl bench`, benches/), a baseline: raw process_vm_writev/readv of `descs` (a
/// (N, 3) uint64 array of local, remote, length) to `pid`; seconds per round.
#[pyfunction]
fn _raw_cma(
    py: Python<'_>,
    pid: u32,
    write: bool,
    descs: &Bound<'_, PyAny>,
    iters: usize,
) -> PyResult<Vec<f64>> {
    let d: Vec<(u64, u64, u64)> =
        descs::parse_descs(descs)?.into_iter().map(|d| (d.local_addr, d.remote_addr, d.len)).collect();
    // SAFETY: the contract passes to the Python caller (a benchmark helper: `hixl bench` and
    // benches/ pass ranges of buffers they hold for the whole call).
    py.allow_threads(|| unsafe { hixl_core::bench::raw_cma(pid, write, &d, iters) }).map_err(errors::to_py)
}

/// Internal (`hixl bench`, benches/), a baseline: one-thread memcpy of `count` blocks of
/// `block` bytes; seconds per round.
#[pyfunction]
fn _raw_memcpy(py: Python<'_>, block: usize, count: usize, iters: usize) -> PyResult<Vec<f64>> {
    py.allow_threads(|| hixl_core::bench::raw_memcpy(block, count, iters)).map_err(errors::to_py)
}

/// Internal (`hixl info`): this host's identity as same-host peers compare it:
/// "boot_id/hostname".
#[pyfunction]
fn _host_identity() -> String {
    hixl_core::host_id()
}

/// Internal (`hixl info`): RDMA here with the provider `hixl.rdma.provider` names ("verbs":
/// libibverbs loaded at run time; "soft"): "not loadable: ...", "no device ..." or
/// "devices: ...". GIL released (opening devices can take a while).
#[pyfunction]
#[pyo3(signature = (provider = "verbs"))]
fn _rdma_info(py: Python<'_>, provider: &str) -> PyResult<String> {
    py.allow_threads(|| hixl_core::rdma_info(provider)).map_err(errors::to_py)
}

/// Internal (`hixl info`): how the rdma backend would register GPU memory here with the
/// provider `hixl.rdma.provider` names: "dmabuf", "peermem" or "no (missing: ...)". GIL
/// released (it initialises CUDA where present).
#[pyfunction]
#[pyo3(signature = (provider = "verbs"))]
fn _gpudirect_info(py: Python<'_>, provider: &str) -> PyResult<String> {
    py.allow_threads(|| hixl_core::gpudirect_info(provider)).map_err(errors::to_py)
}

/// Adds `f` to `m` under its own name without listing it in `__all__` (which
/// `add_function` does): an internal of hixl, not part of the module's public API.
fn add_internal(m: &Bound<'_, PyModule>, f: Bound<'_, PyCFunction>) -> PyResult<()> {
    let name = f.getattr(pyo3::intern!(m.py(), "__name__"))?;
    m.setattr(name.downcast_into::<PyString>()?, f)
}

#[pymodule]
fn _hixl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", hixl_core::VERSION)?;
    m.add_class::<types::MemType>()?;
    m.add_class::<types::TransferOp>()?;
    m.add_class::<types::TransferStatus>()?;
    m.add_class::<types::AsyncConnectStatus>()?;
    // Python programs get hixl's records in Python's `hixl` logger (hixl._logging drains the
    // queue); Rust hosts choose their own subscriber.
    hixl_core::log::init_queue();
    m.add_class::<types::MemDesc>()?;
    m.add_class::<types::RemoteRegion>()?;
    m.add_class::<types::TransferOpDesc>()?;
    m.add_class::<types::NotifyDesc>()?;
    m.add_class::<types::StridedDesc>()?;
    m.add_class::<request::MemHandle>()?;
    m.add_class::<request::TransferReq>()?;
    m.add_class::<engine::Hixl>()?;
    m.add_class::<buffer::ShmBuffer>()?;
    m.add_function(wrap_pyfunction!(set_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(get_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(option_keys, m)?)?;
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    m.add_function(wrap_pyfunction!(hixl_option_keys, m)?)?;
    m.add_function(wrap_pyfunction!(metrics_text, m)?)?;
    m.add_function(wrap_pyfunction!(log_dropped, m)?)?;
    m.add_function(wrap_pyfunction!(status_codes, m)?)?;
    m.add_function(wrap_pyfunction!(device::cuda_info, m)?)?;
    m.add_function(wrap_pyfunction!(device::cuda_alloc, m)?)?;
    m.add_class::<device::DeviceBuffer>()?;
    m.add_function(wrap_pyfunction!(transfer_states, m)?)?;
    // hixl's own internals (its Python modules, `hixl bench` and benches/ import them by
    // name), kept out of `__all__`, which lists the public names only.
    add_internal(m, wrap_pyfunction!(_completion_fd, m)?)?;
    add_internal(m, wrap_pyfunction!(_process_cpus, m)?)?;
    add_internal(m, wrap_pyfunction!(_drain_completions, m)?)?;
    add_internal(m, wrap_pyfunction!(_log_take, m)?)?;
    add_internal(m, wrap_pyfunction!(_log_wake, m)?)?;
    add_internal(m, wrap_pyfunction!(_raw_tcp_sink, m)?)?;
    add_internal(m, wrap_pyfunction!(_raw_tcp_send, m)?)?;
    add_internal(m, wrap_pyfunction!(_raw_cma, m)?)?;
    add_internal(m, wrap_pyfunction!(_raw_memcpy, m)?)?;
    add_internal(m, wrap_pyfunction!(_host_identity, m)?)?;
    add_internal(m, wrap_pyfunction!(_rdma_info, m)?)?;
    add_internal(m, wrap_pyfunction!(_host_facts, m)?)?;
    add_internal(m, wrap_pyfunction!(_gpudirect_info, m)?)?;
    Ok(())
}
