//! Arguments whose wrong type gets a message naming the value: pyo3 prefixes a `TypeError`
//! raised here with the argument's name (`argument 'timeout_ms': '100' (str) is not ...`).

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::PyString;

/// `repr(v) (type)`, as the messages of wrong arguments name a value.
pub fn shown(v: &Bound<'_, PyAny>) -> String {
    let r = v.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
    let t = v.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    format!("{r} ({t})")
}

/// Milliseconds: an int or a float (what converts to a C double: not a str).
#[derive(Clone, Copy)]
pub struct Millis(pub f64);

impl<'py> FromPyObject<'py> for Millis {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        ob.extract::<f64>().map(Millis).map_err(|_| {
            PyTypeError::new_err(format!(
                "{} is not a number of milliseconds: pass an int or a float (100, 2.5)",
                shown(ob)
            ))
        })
    }
}

/// A str argument (no conversion of other types).
pub struct Text(pub String);

impl<'py> FromPyObject<'py> for Text {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        match ob.downcast::<PyString>() {
            Ok(s) => Ok(Text(s.to_str()?.to_string())),
            Err(_) => Err(PyTypeError::new_err(format!("{} is not a str", shown(ob)))),
        }
    }
}

impl std::ops::Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// An address argument (`remote`, `local_engine`): a str, "host:port"; another type gets a
/// message saying what to pass. The text stays in the Python str (no copy on a transfer's hot
/// path).
pub struct Addr(pub PyBackedStr);

impl<'py> FromPyObject<'py> for Addr {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        match ob.downcast::<PyString>() {
            Ok(s) => Ok(Addr(PyBackedStr::try_from(s.clone())?)),
            Err(_) => Err(PyTypeError::new_err(format!(
                "{} is not a str: pass the address as \"host:port\" (\"10.0.0.5:19501\", \
                 \"localhost:19501\")",
                shown(ob)
            ))),
        }
    }
}

impl std::ops::Deref for Addr {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// `wait_notifies(name=...)`: one name, or several (a list or tuple of str); anything else
/// gets a message naming the value (or the item) that is not a str.
pub enum Names {
    One(String),
    Many(Vec<String>),
}

impl<'py> FromPyObject<'py> for Names {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(s) = ob.downcast::<PyString>() {
            return Ok(Names::One(s.to_str()?.to_string()));
        }
        let Ok(seq) = ob.downcast::<pyo3::types::PySequence>() else {
            return Err(PyTypeError::new_err(format!(
                "{} is not a str, a list or tuple of str, or None",
                shown(ob)
            )));
        };
        let items = seq.try_iter()?.collect::<PyResult<Vec<_>>>()?;
        let mut names = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            match it.downcast::<PyString>() {
                Ok(s) => names.push(s.to_str()?.to_string()),
                Err(_) => return Err(PyTypeError::new_err(format!("item [{i}] {} is not a str", shown(it)))),
            }
        }
        Ok(Names::Many(names))
    }
}
