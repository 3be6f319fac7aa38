//! Node-to-node transport: one QUIC endpoint per node (quinn), both server and client,
//! authenticated both ways by certificate fingerprints that the registry publishes (see
//! [`tls`]), with rkyv-framed messages (see [`wire`]).
//!
//! Dead peers: the dialing end sends keep-alives at a pace its caller picks (200 ms by
//! default; routers stretch it as their clusters grow) and the dialed end acknowledges
//! them, so a peer that vanishes without closing (SIGKILL, a pulled cable) is noticed by
//! silence within a few beats, and by QUIC's idle timeout (3 s or more) at the latest,
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
