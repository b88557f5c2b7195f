//! Maps core errors onto the one exception hierarchy of `hixl/_errors.py`, by status code
//! (`hixl._errors.error_for`): the class is the one whose status has that code.

use hixl_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyModule;

/// Builds the Python exception for a core error (`hixl.<Subclass>(message)` with `.code`).
pub fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        let made = (|| -> PyResult<PyErr> {
            let m = PyModule::import(py, "hixl._errors")?;
            let inst = m.getattr("error_for")?.call1((e.status.code(), e.message.clone()))?;
            Ok(PyErr::from_value(inst))
        })();
        made.unwrap_or_else(|err| err)
    })
}

/// `ParamInvalid` with a message.
pub fn param(msg: impl Into<String>) -> PyErr {
    to_py(Error::param(msg))
}

/// `Failed` with a message.
pub fn failed(msg: impl Into<String>) -> PyErr {
    to_py(Error::failed(msg))
}
