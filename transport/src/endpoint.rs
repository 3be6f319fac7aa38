//! A node's QUIC endpoint: server and client at once, with windows sized for KV transfers
//! and keep-alives that notice a vanished peer within seconds.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::{Connection, Incoming};

use crate::tls::{self, fingerprint, AllowList, NodeIdentity};
use crate::TransportError;

/// Window sizes for KV transfers: a layer's piece of a long prompt is megabytes, and the
/// defaults (a 1.25 MB stream window) would stall each stream once per window per round
/// trip. 16 MiB per stream and 64 MiB per connection keep several streams busy at once on a
/// fast link; memory is only used while data is in flight.
const STREAM_WINDOW: u32 = 16 << 20;
const CONNECTION_WINDOW: u32 = 64 << 20;

/// The largest UDP payload taken from peers: what a 9000-byte link carries (MTU discovery
/// goes no higher). quinn sizes each endpoint's receive buffers by it, so the default
/// (65527, for jumbo loopback datagrams) costs every endpoint megabytes, and `--replicas`
/// hosts thousands.
const MAX_UDP_PAYLOAD: u16 = 8952;

fn endpoint_config() -> quinn::EndpointConfig {
    let mut c = quinn::EndpointConfig::default();
    c.max_udp_payload_size(MAX_UDP_PAYLOAD)
        .expect("8952 is within QUIC's UDP payload bounds");
    c
}

/// Which end of a connection the config is for: the dialed end accepts requests (bidi
/// streams); the dialing end accepts only unidirectional ones (load reports and KV events
/// from a worker, KV from a prefill node), and grants no bidirectional stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    Dialed,
    Dialing,
}

/// The dialing end's keep-alive: each is acknowledged at once, so a live peer is heard
/// from at least this often even when idle, which is what `until_silent` watches for. The
/// dialed end sends none of its own (its acknowledgements answer the dialer's), so a router
/// holding thousands of worker links sets the pace of all of them. The idle timeout is
/// several beats, and never under 3 s; the dialed end offers more and the smaller wins.
///
/// A dialer with no keep-alive (`None`) sends heartbeats of its own instead, at a pace it
/// may change while the connection lives (see [`until_silent`]): quinn fixes a
/// connection's keep-alive when it is dialed, and a router's first links, dialed while the
/// cluster was small, would ping at the small cluster's pace for ever.
fn transport_config(end: End, keep_alive: Option<Duration>) -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    let idle = match (end, keep_alive) {
        (End::Dialing, Some(keep_alive)) => {
            t.keep_alive_interval(Some(keep_alive));
            (keep_alive * 5).max(Duration::from_secs(3))
        }
        _ => {
            t.keep_alive_interval(None);
            Duration::from_secs(30)
        }
    };
    // Heartbeats are datagrams, acknowledged and dropped: the dialed end keeps room for a
    // few and never reads them. (quinn sends datagrams only from an end that accepts
    // them, so the dialing end offers the same room, which nothing fills.)
    t.datagram_receive_buffer_size(Some(HEARTBEAT.len() * 64));
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(idle).expect("an idle timeout of seconds is valid"),
    ));
    // One stream per in-flight request, and a few unidirectional ones per KV transfer: a
    // small grant at first, raised as a connection uses it (`grant`), so that a control
    // link does not keep state for thousands of streams it never opens.
    t.max_concurrent_bidi_streams(match end {
        End::Dialed => crate::grant::FIRST_BIDI.into(),
        End::Dialing => 0u32.into(),
    });
    t.max_concurrent_uni_streams(crate::grant::FIRST_UNI.into());
    t.stream_receive_window(STREAM_WINDOW.into());
    t.receive_window(CONNECTION_WINDOW.into());
    t.send_window(CONNECTION_WINDOW as u64);
    // Inside a data centre round trips are short: a small first estimate keeps the first
    // bulk transfer from being paced for a WAN (quinn's default guess is 333 ms).
    t.initial_rtt(Duration::from_millis(10));
    // Probe for jumbo frames (9000-byte links are common between GPU hosts); discovery
    // backs off on paths that drop them.
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(MAX_UDP_PAYLOAD);
    t.mtu_discovery_config(Some(mtu));
    // Large UDP sends through GSO where the kernel offers it (quinn checks at run time).
    t.enable_segmentation_offload(true);
    Arc::new(t)
}

/// A node's QUIC endpoint: accepts members of its cluster, dials members by pinned
/// fingerprint.
#[derive(Clone)]
pub struct NodeEndpoint {
    endpoint: quinn::Endpoint,
    identity: NodeIdentity,
}

impl NodeEndpoint {
    /// Binds `addr` (port 0 picks a free one). Incoming connections must present a
    /// certificate on `allowed`.
    pub fn bind(
        addr: SocketAddr,
        identity: NodeIdentity,
        allowed: AllowList,
    ) -> Result<NodeEndpoint, TransportError> {
        let crypto = tls::server_config(&identity, allowed)?;
        let quic = quinn::crypto::rustls::QuicServerConfig::try_from(crypto)
            .map_err(|e| TransportError::Tls(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(quic));
        server.transport_config(transport_config(End::Dialed, None));
        let bind = |source| TransportError::Bind { addr, source };
        let socket = std::net::UdpSocket::bind(addr).map_err(bind)?;
        // A router's one socket takes the packets of thousands of worker links; the
        // default receive buffer (about 200 KiB) overflows in bursts and every drop costs a
        // retransmission. Raised as far as the host allows (`net.core.rmem_max`).
        let buffer = SOCKET_BUFFER as libc::c_int;
        for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
            // SAFETY: a valid socket, option and int-sized value.
            unsafe {
                libc::setsockopt(
                    std::os::fd::AsRawFd::as_raw_fd(&socket),
                    libc::SOL_SOCKET,
                    opt,
                    &buffer as *const libc::c_int as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
        let runtime = quinn::default_runtime()
            .ok_or_else(|| bind(std::io::Error::other("no async runtime")))?;
        let endpoint =
            quinn::Endpoint::new(endpoint_config(), Some(server), socket, runtime).map_err(bind)?;
        Ok(NodeEndpoint { endpoint, identity })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint
            .local_addr()
            .expect("a bound endpoint has an address")
    }

    pub fn identity(&self) -> &NodeIdentity {
        &self.identity
    }

    /// The next incoming connection attempt; `None` once the endpoint is closed.
    pub async fn accept(&self) -> Option<Incoming> {
        self.endpoint.accept().await
    }

    /// Dials `addr`, accepting only the certificate with `fingerprint`, with keep-alives
    /// every [`KEEP_ALIVE`].
    pub async fn connect(
        &self,
        addr: SocketAddr,
        fingerprint: &str,
    ) -> Result<Connection, TransportError> {
        self.connect_paced(addr, fingerprint, Some(KEEP_ALIVE))
            .await
    }

    /// Dials `addr` as [`NodeEndpoint::connect`] does, with keep-alives every `keep_alive`,
    /// or none (the caller sends heartbeats: [`until_silent`] with `ping`).
    pub async fn connect_paced(
        &self,
        addr: SocketAddr,
        fingerprint: &str,
        keep_alive: Option<Duration>,
    ) -> Result<Connection, TransportError> {
        let fail = |reason: String| TransportError::Connect { addr, reason };
        let crypto = tls::client_config(&self.identity, fingerprint)?;
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
            .map_err(|e| TransportError::Tls(e.to_string()))?;
        let mut client = quinn::ClientConfig::new(Arc::new(quic));
        client.transport_config(transport_config(End::Dialing, keep_alive));
        // quinn runs the connection in a task that keeps the caller's tracing span open for
        // as long as the connection lives; a request's span must not be that caller, so the
        // connection starts from a task of its own.
        let endpoint = self.endpoint.clone();
        let connecting = tokio::spawn(async move { endpoint.connect_with(client, addr, "kvmesh") })
            .await
            .map_err(|e| fail(e.to_string()))?
            .map_err(|e| fail(e.to_string()))?;
        match tokio::time::timeout(Duration::from_secs(5), connecting).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(fail(e.to_string())),
            Err(_) => Err(fail("no handshake within 5 s".into())),
        }
    }

    /// Closes every connection and stops accepting.
    pub fn close(&self) {
        self.endpoint.close(0u32.into(), b"node shutting down");
    }
}

/// How often an idle connection pings its peer.
pub const KEEP_ALIVE: Duration = Duration::from_millis(200);

/// What a heartbeat datagram carries.
const HEARTBEAT: &[u8] = b"\0";

/// A socket's receive and send buffers, as far as the host allows.
const SOCKET_BUFFER: usize = 4 << 20;

/// Resolves once nothing at all (no data, no acknowledgement of a keep-alive) has arrived
/// on `conn` for `limit()` (asked again at each check, so it may follow a changing pace): a
/// peer that died without closing (SIGKILL, a lost machine), long before QUIC's idle
/// timeout says so. The limit must be several keep-alives, so a busy but live peer is never
/// taken for a dead one.
///
/// With `ping` (a connection dialed without keep-alives) it sends a heartbeat at each
/// check, every quarter of the limit, which the peer acknowledges at once.
pub async fn until_silent(conn: &Connection, limit: impl Fn() -> Duration, ping: bool) {
    // Tokio's clock (paused in tests that pause it), as a plain instant.
    let now = || tokio::time::Instant::now().into_std();
    let mut silence = Silence::new(conn.stats().udp_rx.datagrams, now());
    let mut warned = false;
    loop {
        let limit = limit();
        if ping {
            if let Err(e) = conn.send_datagram(bytes::Bytes::from_static(HEARTBEAT)) {
                // A peer that takes no datagrams (another version) is soon taken for a
                // silent one: say why once.
                if !warned && !matches!(e, quinn::SendDatagramError::ConnectionLost(_)) {
                    tracing::warn!(peer = %conn.remote_address(), "cannot send heartbeats: {e}");
                    warned = true;
                }
            }
        }
        tokio::time::sleep(Silence::check_every(limit)).await;
        let datagrams = conn.stats().udp_rx.datagrams;
        if silence.is_silent(datagrams, now(), limit) {
            return;
        }
    }
}

/// When a connection counts as silent, from its count of datagrams received, checked from
/// time to time: silent once the count has not moved for `limit`. The clock and the count
/// are given, so the rule is tested without a connection (`until_silent` is its I/O).
#[derive(Clone, Copy, Debug)]
pub struct Silence {
    heard: u64,
    last: std::time::Instant,
}

impl Silence {
    /// Starting from `datagrams` received by `now`.
    pub fn new(datagrams: u64, now: std::time::Instant) -> Silence {
        Silence {
            heard: datagrams,
            last: now,
        }
    }

    /// How often to check against `limit`: four times within it (at least every 10 ms).
    pub fn check_every(limit: Duration) -> Duration {
        (limit / 4).max(Duration::from_millis(10))
    }

    /// A check at `now` with `datagrams` received in all: whether nothing has arrived for
    /// `limit` (anything new restarts the wait).
    pub fn is_silent(&mut self, datagrams: u64, now: std::time::Instant, limit: Duration) -> bool {
        if datagrams != self.heard {
            self.heard = datagrams;
            self.last = now;
            return false;
        }
        now.saturating_duration_since(self.last) >= limit
    }
}

/// The fingerprint of the certificate a connection's peer presented.
pub fn peer_fingerprint(conn: &Connection) -> Option<String> {
    let certs = conn.peer_identity()?;
    let certs = certs
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .ok()?;
    certs.first().map(|c| fingerprint(c))
}

#[cfg(test)]
mod silence_tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_peer_is_silent_only_after_a_whole_limit_without_a_datagram() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let limit = Duration::from_millis(700);
        let mut s = Silence::new(10, t0);
        assert!(!s.is_silent(10, ms(175), limit));
        assert!(!s.is_silent(10, ms(699), limit));
        // A keep-alive's acknowledgement at 650 ms restarts the wait from the check that saw it.
        assert!(!s.is_silent(11, ms(700), limit));
        assert!(!s.is_silent(11, ms(1399), limit));
        assert!(s.is_silent(11, ms(1400), limit));
        // A limit that grows (the cluster's pace) is taken as asked at each check.
        let mut s = Silence::new(0, t0);
        assert!(!s.is_silent(0, ms(900), Duration::from_secs(1)));
        assert!(s.is_silent(0, ms(900), Duration::from_millis(800)));
    }

    #[test]
    fn checks_come_four_times_a_limit_and_never_faster_than_every_10_ms() {
        assert_eq!(
            Silence::check_every(Duration::from_millis(700)),
            Duration::from_millis(175)
        );
        assert_eq!(
            Silence::check_every(Duration::from_millis(20)),
            Duration::from_millis(10)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{self, read_msg, write_msg, TokenEvent};

    fn loopback() -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    /// A server that accepts one stream and echoes a token event for the request id.
    fn serve(ep: NodeEndpoint) -> tokio::task::JoinHandle<Result<String, String>> {
        tokio::spawn(async move {
            let inc = ep.accept().await.ok_or("closed")?;
            let conn = inc.await.map_err(|e| e.to_string())?;
            let peer = peer_fingerprint(&conn).ok_or("no peer cert")?;
            let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| e.to_string())?;
            let req: wire::GenerateRequest = read_msg(&mut recv)
                .await
                .map_err(|e| e.to_string())?
                .ok_or("no request")?;
            let ev = TokenEvent::Token {
                token: req.request_id as u32,
                logprob: 0.0,
                top: vec![],
                finish: Some(wire::Finish::Stop),
                cached_tokens: 0,
            };
            write_msg(&mut send, &ev).await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            let _ = send.stopped().await;
            Ok(peer)
        })
    }

    fn request(id: u64) -> wire::GenerateRequest {
        wire::GenerateRequest {
            request_id: id,
            prompt: vec![1],
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: 1,
            stop_token_ids: vec![],
            ignore_eos: false,
            logprobs: None,
            resume_draws: 0,
            logit_bias: vec![],
            guide: None,
            traceparent: None,
            prefill: None,
        }
    }

    /// Members `a` (a client) and `b` (a server that admits `a`), and their endpoints.
    fn members() -> (NodeIdentity, NodeIdentity, NodeEndpoint, NodeEndpoint) {
        let (a, b) = (
            NodeIdentity::generate("a").unwrap(),
            NodeIdentity::generate("b").unwrap(),
        );
        let allow_b = AllowList::default();
        allow_b.set([a.fingerprint.clone()]);
        let server = NodeEndpoint::bind(loopback(), b.clone(), allow_b).unwrap();
        let client = NodeEndpoint::bind(loopback(), a.clone(), AllowList::default()).unwrap();
        (a, b, server, client)
    }

    #[tokio::test]
    async fn members_talk_and_the_server_sees_the_client_fingerprint() {
        let (a, b, server, client) = members();
        let task = serve(server.clone());
        let conn = client
            .connect(server.local_addr(), &b.fingerprint)
            .await
            .unwrap();
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        write_msg(&mut send, &request(42)).await.unwrap();
        let ev: TokenEvent = read_msg(&mut recv).await.unwrap().unwrap();
        assert!(matches!(ev, TokenEvent::Token { token: 42, .. }));
        assert!(read_msg::<TokenEvent>(&mut recv).await.unwrap().is_none());
        assert_eq!(task.await.unwrap().unwrap(), a.fingerprint);
    }

    #[tokio::test]
    async fn heartbeats_keep_an_idle_link_heard_and_a_frozen_peer_is_silent() {
        let (_, b, server, client) = members();
        let accepted = tokio::spawn({
            let server = server.clone();
            async move { server.accept().await.unwrap().await.unwrap() }
        });
        let conn = client
            .connect_paced(server.local_addr(), &b.fingerprint, None)
            .await
            .unwrap();
        let _held = accepted.await.unwrap();
        let limit = || Duration::from_millis(300);
        // No keep-alive and nothing to say: the heartbeats' acknowledgements are heard.
        tokio::select! {
            () = until_silent(&conn, limit, true) => panic!("a live idle peer taken for dead"),
            () = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
        // Without them, an idle live peer says nothing.
        let t = tokio::time::Instant::now();
        until_silent(&conn, limit, false).await;
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn a_server_with_another_certificate_is_refused() {
        let (a, b, impostor) = (
            NodeIdentity::generate("a").unwrap(),
            NodeIdentity::generate("b").unwrap(),
            NodeIdentity::generate("b").unwrap(),
        );
        let allow = AllowList::default();
        allow.set([a.fingerprint.clone()]);
        let server = NodeEndpoint::bind(loopback(), impostor, allow).unwrap();
        let client = NodeEndpoint::bind(loopback(), a, AllowList::default()).unwrap();
        let _task = serve(server.clone());
        let Err(err) = client.connect(server.local_addr(), &b.fingerprint).await else {
            panic!("the impostor's certificate must not pass");
        };
        assert!(err.to_string().contains("cannot connect"), "{err}");
    }

    #[tokio::test]
    async fn a_client_outside_the_cluster_is_refused() {
        let (outsider, b) = (
            NodeIdentity::generate("x").unwrap(),
            NodeIdentity::generate("b").unwrap(),
        );
        let allow = AllowList::default();
        allow.set(["0".repeat(64)]);
        let server = NodeEndpoint::bind(loopback(), b.clone(), allow).unwrap();
        let client = NodeEndpoint::bind(loopback(), outsider, AllowList::default()).unwrap();
        let task = serve(server.clone());
        // TLS 1.3 client auth fails after the client's side of the handshake completes, so
        // the refusal shows either at connect or on first use.
        let refused = match client.connect(server.local_addr(), &b.fingerprint).await {
            Err(_) => true,
            Ok(conn) => match conn.open_bi().await {
                Err(_) => true,
                Ok((mut send, mut recv)) => {
                    let _ = write_msg(&mut send, &request(1)).await;
                    read_msg::<TokenEvent>(&mut recv).await.is_err()
                }
            },
        };
        assert!(refused, "an outsider got an answer");
        assert!(
            task.await.unwrap().is_err(),
            "the server accepted an outsider"
        );
    }
}
