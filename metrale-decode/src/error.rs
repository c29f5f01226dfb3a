//! The engine's one error type: a metrale failure (driver, NVRTC, cuBLASLt),
//! or something about the model, its files or the request, named.

use std::fmt;

use metrale_runtime::MetraleError;

/// What went wrong, with the subject named.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A metrale call failed; its text names the call, the status and the subject.
    Metrale(MetraleError),
    /// A configuration the engine does not support, or a malformed `config.json`.
    Config(String),
    /// A weight file or tensor that does not fit the model.
    Weights(String),
    /// Reading or writing a file failed.
    Io(String, std::io::Error),
    /// A request the engine refuses (batch, context, prompt, flags).
    Invalid(String),
}

/// The engine's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Metrale(e) => write!(f, "{e}"),
            Error::Config(s) => write!(f, "configuration: {s}"),
            Error::Weights(s) => write!(f, "weights: {s}"),
            Error::Io(what, e) => write!(f, "{what}: {e}"),
            Error::Invalid(s) => write!(f, "{s}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Metrale(e) => Some(e),
            Error::Io(_, e) => Some(e),
            _ => None,
        }
    }
}

impl From<MetraleError> for Error {
    fn from(e: MetraleError) -> Error {
        Error::Metrale(e)
    }
}

/// An I/O error naming what was being done (`reading /path/x.safetensors`).
pub(crate) fn io(what: impl fmt::Display) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::Io(what.to_string(), e)
}
