//! UCX's failures, typed: the library's status code is kept where UCX gave one
//! ([`UcxError::Status`]), and the other ways the UCX thread can fail are named.

#[derive(Debug, thiserror::Error)]
pub enum UcxError {
    /// The library is not installed, or lacks a function this transport calls.
    #[error("{0}")]
    Unavailable(String),
    /// A UCX call returned an error status: what was being done, UCX's code (its
    /// `ucs_status_t`, negative) and its text.
    #[error("{what}: {text}")]
    Status {
        what: String,
        code: i8,
        text: String,
    },
    /// An operating-system call the UCX thread relies on failed.
    #[error("{what}: {source}")]
    Os {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The UCX thread is gone: it stopped, ended while starting, or dropped the request.
    #[error("{0}")]
    Thread(&'static str),
    /// The peer's endpoint failed earlier; a restarted peer has a new address, so it is not
    /// dialed again.
    #[error("the peer's UCX endpoint failed earlier; it is not dialed again")]
    PeerGone,
    /// A request UCX cannot carry out as asked: a put outside the peer's registered buffers,
    /// a transport list that is not a C string.
    #[error("{0}")]
    Invalid(String),
}

impl UcxError {
    /// UCX's status code, where the failure came with one.
    pub fn code(&self) -> Option<i8> {
        match self {
            UcxError::Status { code, .. } => Some(*code),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    #[test]
    fn the_status_code_and_the_os_error_stay_reachable() {
        let e = UcxError::Status {
            what: "UCX put".into(),
            code: -25,
            text: "Endpoint timeout".into(),
        };
        assert_eq!(e.code(), Some(-25));
        assert_eq!(e.to_string(), "UCX put: Endpoint timeout");
        let os = UcxError::Os {
            what: "eventfd",
            source: std::io::Error::from_raw_os_error(libc::EMFILE),
        };
        assert_eq!(os.code(), None);
        let src = os.source().expect("the OS error");
        assert_eq!(
            src.downcast_ref::<std::io::Error>()
                .and_then(|e| e.raw_os_error()),
            Some(libc::EMFILE)
        );
    }
}
