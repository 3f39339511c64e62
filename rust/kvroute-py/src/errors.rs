//! The Python exception hierarchy, defined once, and the one mapping from core errors to it.
//!
//! Several exceptions subclass both `KvrouteError` and a builtin (`ValueError` for bad input,
//! `KeyError` for an unknown worker), so `except ValueError` in caller code keeps working. PyO3's
//! `create_exception!` takes a single base, so the types are built with `type(name, bases, ns)`
//! on first use and cached for the life of the interpreter.
use kvroute_core::Error;
use pyo3::exceptions::{PyException, PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// Every exception class of `kvroute._native`; the discriminant indexes [`SPECS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Kvroute,
    InvalidEvent,
    InvalidArgument,
    UnknownWorker,
    NoEligibleWorker,
    TooManyWorkers,
    UnknownPolicy,
    Saturated,
}

/// The builtin a class derives from besides `KvrouteError`.
#[derive(Clone, Copy)]
enum Builtin {
    None,
    Value,
    Key,
}

struct Spec {
    name: &'static str,
    builtin: Builtin,
    doc: &'static str,
}

const SPECS: [Spec; 8] = [
    Spec {
        name: "KvrouteError",
        builtin: Builtin::None,
        doc: "Base class of every error raised by kvroute.",
    },
    Spec {
        name: "InvalidEventError",
        builtin: Builtin::Value,
        doc: "A KV-event payload is malformed; it was rejected as a unit and changed nothing.",
    },
    Spec {
        name: "InvalidArgumentError",
        builtin: Builtin::Value,
        doc: "An argument has the wrong value, dtype or length.",
    },
    Spec {
        name: "UnknownWorkerError",
        builtin: Builtin::Key,
        doc: "The worker id is not registered.",
    },
    Spec {
        name: "NoEligibleWorkerError",
        builtin: Builtin::None,
        doc: "No worker can take the request (all excluded, unhealthy or none registered).",
    },
    Spec {
        name: "TooManyWorkersError",
        builtin: Builtin::None,
        doc: "The worker limit of the index or scheduler is reached.",
    },
    Spec {
        name: "UnknownPolicyError",
        builtin: Builtin::Value,
        doc: "The routing policy name is not known.",
    },
    Spec {
        name: "SaturatedError",
        builtin: Builtin::None,
        doc: "Every eligible worker is at its in-flight limit (answer 429 and retry later).",
    },
];

static TYPES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

fn build(py: Python<'_>) -> PyResult<Vec<Py<PyType>>> {
    let mut out: Vec<Py<PyType>> = Vec::with_capacity(SPECS.len());
    for spec in &SPECS {
        let mut bases = Vec::with_capacity(2);
        bases.push(match out.first() {
            Some(root) => root.bind(py).clone(),
            None => py.get_type::<PyException>(),
        });
        match spec.builtin {
            Builtin::None => {}
            Builtin::Value => bases.push(py.get_type::<PyValueError>()),
            Builtin::Key => bases.push(py.get_type::<PyKeyError>()),
        }
        let ns = PyDict::new(py);
        ns.set_item("__module__", "kvroute._native")?;
        ns.set_item("__doc__", spec.doc)?;
        let ty = py
            .get_type::<PyType>()
            .call1((spec.name, PyTuple::new(py, bases)?, ns))?;
        out.push(ty.cast_into::<PyType>()?.unbind());
    }
    Ok(out)
}

/// The class for `kind` (built on first use).
pub(crate) fn exception_type(py: Python<'_>, kind: Kind) -> PyResult<Bound<'_, PyType>> {
    let types = TYPES.get_or_try_init(py, || build(py))?;
    Ok(types[kind as usize].bind(py).clone())
}

/// Adds every exception class to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let types = TYPES.get_or_try_init(m.py(), || build(m.py()))?;
    for (spec, ty) in SPECS.iter().zip(types) {
        m.add(spec.name, ty.bind(m.py()))?;
    }
    Ok(())
}

/// A new exception of class `kind` with message `msg`.
pub(crate) fn new_err(kind: Kind, msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| match exception_type(py, kind) {
        Ok(ty) => PyErr::from_type(ty, msg),
        Err(e) => e,
    })
}

/// `InvalidArgumentError(msg)`.
pub(crate) fn invalid_argument(msg: impl Into<String>) -> PyErr {
    new_err(Kind::InvalidArgument, msg)
}

/// The one mapping from core errors to Python exceptions.
pub(crate) fn map_err(e: Error) -> PyErr {
    let kind = match &e {
        Error::Event(_) => Kind::InvalidEvent,
        Error::UnknownWorker(_) => Kind::UnknownWorker,
        Error::DuplicateWorker(_) | Error::InvalidArgument(_) => Kind::InvalidArgument,
        Error::NoEligibleWorker => Kind::NoEligibleWorker,
        Error::UnknownPolicy(_) => Kind::UnknownPolicy,
        Error::TooManyWorkers(_) => Kind::TooManyWorkers,
        Error::Saturated => Kind::Saturated,
    };
    new_err(kind, e.to_string())
}
