//! Errors the engine reports. Each names what went wrong in words a user can act on.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    /// The model folder is missing a file, or a file is malformed.
    #[error("model: {0}")]
    BadModel(String),
    /// `config.json` is refused: which rule, with the values its message shows. Not a
    /// `#[source]` (the message already holds it, and a chain would print it twice); the
    /// `From` conversion is `config`'s.
    #[error("model: config.json: {0}")]
    Config(crate::config::error::ConfigError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A backend refuses to run, or to run this step: which rule, with the values its
    /// message shows. Not a `#[source]` (the message already holds it, and a chain would
    /// print it twice); the `From` conversions are `backend`'s.
    #[error("backend: {0}")]
    Backend(crate::backend::error::BackendError),
    /// A GPU library call failed: what was being done, and the library's own error (the
    /// driver's `CUresult`, cuBLAS's or NVRTC's status) kept as the source, so a caller can
    /// tell out-of-memory from a lost device without reading text.
    #[error("backend: {what}: {source:?}")]
    Device {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// `--sm-split` cannot be read, or cannot split this device's SMs.
    #[error(transparent)]
    SmSplit(#[from] crate::backend::sm_split::SmSplitError),
    /// A request the engine cannot take as given (too long, bad ids).
    #[error("{0}")]
    InvalidRequest(String),
    /// The waiting queue is at its limit.
    #[error("the server is at capacity: {waiting} requests are already waiting")]
    QueueFull { waiting: usize },
    /// The engine thread has stopped.
    #[error("the engine has stopped")]
    Stopped,
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

impl EngineError {
    /// A GPU library error while doing `what`.
    pub fn device(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> EngineError {
        EngineError::Device {
            what: what.into(),
            source: Box::new(source),
        }
    }

    pub fn io(context: impl Into<String>, source: std::io::Error) -> EngineError {
        EngineError::Io {
            context: context.into(),
            source,
        }
    }
}
