//! Who a peer is: every node makes a self-signed certificate at start-up and publishes the
//! SHA-256 of it in its registry record. Trust comes from the registry, not from a CA:
//!
//! - a node dialling another pins the certificate the registry names for it, so a process
//!   that is not that node (another listener on a reused port, a man in the middle) fails
//!   the handshake;
//! - a node accepting a connection requires a client certificate and accepts only the
//!   fingerprints of the cluster's current members, so a process outside the cluster cannot
//!   send it requests.
//!
//! TLS 1.3 only (QUIC requires it); signatures are still checked, so a peer must hold the
//! private key of the certificate it shows.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use parking_lot::RwLock;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::TransportError;

/// ALPN of kvmesh's node-to-node protocol; a version bump changes it.
pub const ALPN: &[u8] = b"kvmesh/6";

/// Hex SHA-256 of a certificate's DER bytes.
pub fn fingerprint(cert_der: &[u8]) -> String {
    Sha256::digest(cert_der)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A node's certificate and key, made fresh for each process.
#[derive(Clone)]
pub struct NodeIdentity {
    pub cert: CertificateDer<'static>,
    key: Arc<Vec<u8>>,
    pub fingerprint: String,
}

impl fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl NodeIdentity {
    pub fn generate(node_id: &str) -> Result<NodeIdentity, TransportError> {
        let ck = rcgen::generate_simple_self_signed(vec!["kvmesh".into(), node_id.to_string()])
            .map_err(|e| TransportError::Tls(format!("making the node certificate: {e}")))?;
        let cert = ck.cert.der().clone();
        Ok(NodeIdentity {
            fingerprint: fingerprint(&cert),
            cert,
            key: Arc::new(ck.key_pair.serialize_der()),
        })
    }

    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key.as_ref().clone()))
    }
}

/// The fingerprints a node accepts connections from, replaced as membership changes.
#[derive(Clone, Default, Debug)]
pub struct AllowList(Arc<RwLock<HashSet<String>>>);

impl AllowList {
    pub fn set(&self, fingerprints: impl IntoIterator<Item = String>) {
        *self.0.write() = fingerprints.into_iter().collect();
    }

    pub fn contains(&self, fp: &str) -> bool {
        self.0.read().contains(fp)
    }
}

/// One provider for the process: every connection's config refers to it.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: std::sync::OnceLock<Arc<CryptoProvider>> = std::sync::OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// The handshake-signature checks both verifiers share: trust comes from the fingerprint,
/// but the peer must still prove it holds the certificate's key (TLS 1.3 only).
#[derive(Debug)]
struct Signatures(WebPkiSupportedAlgorithms);

impl Signatures {
    fn new() -> Signatures {
        Signatures(provider().signature_verification_algorithms)
    }

    fn tls12() -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not used".into()))
    }

    fn tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// Accepts exactly one certificate: the one whose fingerprint the registry published.
#[derive(Debug)]
struct PinnedServer {
    expected: String,
    sigs: Signatures,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got = fingerprint(end_entity);
        if got == self.expected {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "peer certificate {got} is not the one its registry record names ({})",
                self.expected
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Signatures::tls12()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.sigs.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.sigs.schemes()
    }
}

/// Requires a client certificate whose fingerprint is on the allow list.
#[derive(Debug)]
struct MembersOnly {
    allowed: AllowList,
    sigs: Signatures,
}

impl ClientCertVerifier for MembersOnly {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let got = fingerprint(end_entity);
        if self.allowed.contains(&got) {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "client certificate {got} belongs to no member of this cluster"
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Signatures::tls12()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.sigs.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.sigs.schemes()
    }
}

pub(crate) fn server_config(
    id: &NodeIdentity,
    allowed: AllowList,
) -> Result<rustls::ServerConfig, TransportError> {
    let verifier = Arc::new(MembersOnly {
        allowed,
        sigs: Signatures::new(),
    });
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TransportError::Tls(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![id.cert.clone()], id.key())
        .map_err(|e| TransportError::Tls(e.to_string()))?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    // Clients do not resume (see `client_config`): tickets and a session cache (~30 KB an
    // endpoint) would only cost both ends.
    cfg.send_tls13_tickets = 0;
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(cfg)
}

pub(crate) fn client_config(
    id: &NodeIdentity,
    expected_fingerprint: &str,
) -> Result<rustls::ClientConfig, TransportError> {
    let verifier = Arc::new(PinnedServer {
        expected: expected_fingerprint.to_string(),
        sigs: Signatures::new(),
    });
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| TransportError::Tls(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(vec![id.cert.clone()], id.key())
        .map_err(|e| TransportError::Tls(e.to_string()))?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    // Each connection has a config of its own (its peer's pinned fingerprint), so a session
    // cache would serve no later connection; the default one costs ~16 KB a connection,
    // a router's largest cost per worker link.
    cfg.resumption = rustls::client::Resumption::disabled();
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_hex_sha256_and_differ_per_identity() {
        let a = NodeIdentity::generate("a").unwrap();
        let b = NodeIdentity::generate("a").unwrap();
        assert_eq!(a.fingerprint.len(), 64);
        assert!(a.fingerprint.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a.fingerprint, b.fingerprint, "fresh keys per process");
        assert_eq!(fingerprint(&a.cert), a.fingerprint);
    }

    #[test]
    fn allow_list_is_replaced_not_merged() {
        let l = AllowList::default();
        l.set(["x".to_string(), "y".to_string()]);
        assert!(l.contains("x"));
        l.set(["z".to_string()]);
        assert!(!l.contains("x") && l.contains("z"));
    }
}
