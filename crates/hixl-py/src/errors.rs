//! Maps core errors onto the one exception hierarchy defined in `hixl/_errors.py`.

use hixl_core::{Error, Status};
use pyo3::prelude::*;
use pyo3::types::PyModule;

fn class_name(s: Status) -> &'static str {
    match s {
        Status::Success | Status::Failed => "Failed",
        Status::ParamInvalid => "ParamInvalid",
        Status::Timeout => "Timeout",
        Status::NotConnected => "NotConnected",
        Status::AlreadyConnected => "AlreadyConnected",
        Status::NotifyFailed => "NotifyFailed",
        Status::Unsupported => "Unsupported",
        Status::ResourceExhausted => "ResourceExhausted",
    }
}

/// Builds the Python exception for a core error (`hixl.<Subclass>(message)` with `.code`).
pub fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        let made = (|| -> PyResult<PyErr> {
            let m = PyModule::import(py, "hixl._errors")?;
            let cls = m.getattr(class_name(e.status))?;
            let inst = cls.call1((e.message.clone(),))?;
            Ok(PyErr::from_value(inst))
        })();
        made.unwrap_or_else(|err| err)
    })
}

/// `ParamInvalid` with a message.
pub fn param(msg: impl Into<String>) -> PyErr {
    to_py(Error::param(msg))
}
