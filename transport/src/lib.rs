//! Node-to-node transport: one QUIC endpoint per node (quinn), both server and client,
//! authenticated both ways by certificate fingerprints that the registry publishes (see
//! [`tls`]), with rkyv-framed messages (see [`wire`]).
//!
//! Dead peers: keep-alives every 500 ms and a 3 s idle timeout, so a peer that vanishes
//! without closing (SIGKILL, a pulled cable) breaks its connection within a few seconds,
//! before its registry lease (the backstop) expires.

mod endpoint;
mod error;
pub mod grant;
pub mod kv;
pub mod tls;
pub mod wire;

pub use endpoint::{peer_fingerprint, until_silent, NodeEndpoint, KEEP_ALIVE};
pub use error::TransportError;
pub use quinn::{Connection, ConnectionError, Incoming, RecvStream, SendStream};
pub use tls::{fingerprint, AllowList, NodeIdentity};
