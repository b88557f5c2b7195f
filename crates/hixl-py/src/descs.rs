//! Transfer descriptors from Python: TransferOpDesc objects, tuples or lists of three ints, or
//! an (N, 3) integer numpy array (uint64 C-order is read in place; others are converted once).

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::{errors, types};

/// A numpy array of descriptors in any integer dtype and any order, as a C-contiguous uint64
/// copy; anything else is ParamInvalid naming what it got.
fn as_uint64_rows<'py>(descs: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let what = "descs must be a list of TransferOpDesc / (local_addr, remote_addr, length), or an \
                integer numpy array of shape (N, 3)";
    let Ok(dtype) = descs.getattr("dtype") else {
        let t = descs.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        return Err(errors::param(format!("{what}; got a {t}")));
    };
    let shape: Vec<usize> = descs.getattr("shape")?.extract()?;
    if shape.len() != 2 || shape[1] != 3 {
        return Err(errors::param(format!("descs array must have shape (N, 3), got shape {shape:?}")));
    }
    let kind: String = dtype.getattr("kind")?.extract()?;
    if kind != "i" && kind != "u" {
        return Err(errors::param(format!(
            "descs array has dtype {dtype}: expected an integer dtype (uint64 is read without a copy)"
        )));
    }
    if kind == "i" && shape[0] > 0 {
        let min = descs.call_method0("min")?;
        if min.lt(0)? {
            return Err(errors::param(format!("descs array (dtype {dtype}) holds a negative value ({min})")));
        }
    }
    descs.py().import("numpy")?.call_method1("ascontiguousarray", (descs, "uint64"))
}

/// One `(local_addr, remote_addr, length)` row, read through the tuple's own slots.
fn triple(i: usize, t: &Bound<'_, PyTuple>) -> PyResult<hixl_core::TransferOpDesc> {
    if t.len() != 3 {
        return Err(errors::param(format!("descs[{i}] must have 3 fields, got {}", t.len())));
    }
    let field = |k: usize, name: &str| -> PyResult<u64> {
        types::uint_named(|| format!("descs[{i}].{name}"), &*t.get_borrowed_item(k)?)
    };
    Ok(hixl_core::TransferOpDesc {
        local_addr: field(0, "local_addr")?,
        remote_addr: field(1, "remote_addr")?,
        len: field(2, "length")?,
    })
}

/// The rows of a list or tuple of descriptors, each a `(local, remote, length)` tuple (or list)
/// or a `TransferOpDesc`.
fn rows<'py>(
    n: usize,
    rows: impl Iterator<Item = Bound<'py, PyAny>>,
) -> PyResult<Vec<hixl_core::TransferOpDesc>> {
    let mut out = Vec::with_capacity(n);
    for (i, item) in rows.enumerate() {
        // Tuples first: a type-flag test, where the class test looks up the class object.
        if let Ok(t) = item.downcast::<PyTuple>() {
            out.push(triple(i, t)?);
        } else if let Ok(l) = item.downcast::<PyList>() {
            out.push(triple(i, &l.to_tuple())?);
        } else if let Ok(d) = item.downcast::<types::TransferOpDesc>() {
            out.push((*d.get()).into());
        } else {
            let t = item.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            return Err(errors::param(format!(
                "descs[{i}] is a {t}; expected hixl.TransferOpDesc or (local_addr, remote_addr, length)"
            )));
        }
    }
    Ok(out)
}

pub(crate) fn parse_descs(descs: &Bound<'_, PyAny>) -> PyResult<Vec<hixl_core::TransferOpDesc>> {
    // A list or tuple of rows, read through the sequence's own iterator (no iterator object, no
    // index object per field: the 4 KiB synchronous call spends a part of its time here).
    if let Ok(l) = descs.downcast::<PyList>() {
        return rows(l.len(), l.iter());
    }
    if let Ok(t) = descs.downcast::<PyTuple>() {
        return rows(t.len(), t.iter());
    }
    // Fast path: a C-contiguous uint64 array of shape (N, 3), read once.
    let buf = match PyBuffer::<u64>::get(descs) {
        Ok(b) if b.shape().len() == 2 && b.shape()[1] == 3 && b.is_c_contiguous() => b,
        Ok(b) if b.shape().len() != 2 || b.shape()[1] != 3 => {
            return Err(errors::param(format!(
                "descs array must have shape (N, 3), got shape {:?}",
                b.shape()
            )))
        }
        // Another integer dtype, or another memory order: converted once, checked first.
        _ => return parse_descs(&as_uint64_rows(descs)?),
    };
    // One pass straight from the array's memory into the descriptors (no intermediate copy).
    let cells = buf
        .as_slice(descs.py())
        .ok_or_else(|| errors::param("descs array must be C-contiguous with shape (N, 3)"))?;
    Ok(cells
        .chunks_exact(3)
        .map(|c| hixl_core::TransferOpDesc {
            local_addr: c[0].get(),
            remote_addr: c[1].get(),
            len: c[2].get(),
        })
        .collect())
}
