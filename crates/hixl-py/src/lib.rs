//! Python bindings of hixl-core, built by maturin into `hixl._hixl`. Thin by design: every
//! call that can block or copy releases the GIL. Modules mirror the core crate's.

mod buffer;
mod engine;
mod errors;
mod types;

use pyo3::prelude::*;

/// Sets the log level: "DEBUG", "INFO", "WARN" or "ERROR".
#[pyfunction]
fn set_log_level(level: &str) -> PyResult<()> {
    hixl_core::log::set_level(level).map_err(errors::to_py)
}

/// The current log level.
#[pyfunction]
fn get_log_level() -> &'static str {
    hixl_core::log::level()
}

/// The documented option keys: list of (key, default, meaning).
#[pyfunction]
fn option_keys() -> Vec<(&'static str, &'static str, &'static str)> {
    hixl_core::options::KEYS.to_vec()
}

#[pymodule]
fn _hixl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", hixl_core::VERSION)?;
    m.add_class::<types::MemType>()?;
    m.add_class::<types::TransferOp>()?;
    m.add_class::<types::TransferStatus>()?;
    m.add_class::<types::AsyncConnectStatus>()?;
    m.add_class::<types::MemDesc>()?;
    m.add_class::<types::TransferOpDesc>()?;
    m.add_class::<types::NotifyDesc>()?;
    m.add_class::<engine::MemHandle>()?;
    m.add_class::<engine::TransferReq>()?;
    m.add_class::<engine::Hixl>()?;
    m.add_function(wrap_pyfunction!(set_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(get_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(option_keys, m)?)?;
    Ok(())
}
