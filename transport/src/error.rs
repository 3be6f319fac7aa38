//! What can go wrong between nodes.

use std::net::SocketAddr;

use quinn::ConnectionError;

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("TLS set-up: {0}")]
    Tls(String),
    #[error("cannot bind the QUIC endpoint on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("connection lost: {0}")]
    Connection(#[from] ConnectionError),
    #[error("the peer stopped the stream")]
    Stopped,
    #[error("stream: {0}")]
    Stream(String),
    #[error("bad message: {0}")]
    Codec(String),
    #[error(
        "the KV blocks are in the memory of GPU {device}, which only a transfer between two \
         engines of one process can move"
    )]
    DeviceMemory { device: u32 },
    #[error("copying KV on the device: {0}")]
    DeviceCopy(String),
    #[error("an in-process transfer between host memory and a GPU's memory")]
    MixedMemory,
    #[error(transparent)]
    Ucx(#[from] crate::kv::ucx::UcxError),
}

impl From<quinn::WriteError> for TransportError {
    fn from(e: quinn::WriteError) -> Self {
        match e {
            quinn::WriteError::Stopped(_) => TransportError::Stopped,
            quinn::WriteError::ConnectionLost(c) => TransportError::Connection(c),
            other => TransportError::Stream(other.to_string()),
        }
    }
}

impl From<quinn::ReadError> for TransportError {
    fn from(e: quinn::ReadError) -> Self {
        match e {
            quinn::ReadError::ConnectionLost(c) => TransportError::Connection(c),
            other => TransportError::Stream(other.to_string()),
        }
    }
}
