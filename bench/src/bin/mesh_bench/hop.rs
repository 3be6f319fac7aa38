//! Where a hop's microseconds go, piece by piece, in this process.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvmesh_transport::wire::{self, Finish, GenerateRequest, StreamRequest, TokenEvent};
use kvmesh_transport::{AllowList, NodeEndpoint, NodeIdentity};
use serde_json::{json, Value};

/// Percentile `p` (0..=100) of microsecond samples.
fn pct(xs: &mut [f64], p: f64) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    if xs.is_empty() {
        return f64::NAN;
    }
    xs[((p / 100.0) * (xs.len() - 1) as f64).round() as usize]
}

/// A short generate request, as the router sends one.
fn request(id: u64) -> GenerateRequest {
    GenerateRequest {
        request_id: id,
        prompt: (0..16).collect(),
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: None,
        max_tokens: 16,
        stop_token_ids: vec![],
        ignore_eos: false,
        logprobs: None,
        resume_draws: 0,
        traceparent: None,
        prefill: None,
        logit_bias: vec![],
        guide: None,
    }
}

/// One token event, the last of its stream or not.
fn token(t: u32, last: bool) -> TokenEvent {
    TokenEvent::Token {
        token: t,
        logprob: 0.0,
        top: vec![],
        finish: last.then_some(Finish::Length),
        cached_tokens: 0,
    }
}

/// Where the hop's microseconds go, piece by piece, in this process: a QUIC request and
/// first answer between two endpoints on loopback (each on its own runtime, as two nodes
/// are), with a new stream per request as the router opens, and on one kept stream; rkyv
/// framing of a request and a token; a task spawn plus a channel hand-off. Set against the
/// added TTFT the overhead section measures end to end.
pub fn hop_profile(quick: bool) -> Value {
    let iters = if quick { 500 } else { 3000 };
    let (a, b) = (
        NodeIdentity::generate("hop-a").unwrap(),
        NodeIdentity::generate("hop-b").unwrap(),
    );
    let addr = token_server(b.clone(), &a);
    let rt = tokio::runtime::Handle::current();
    let (mut fresh, mut kept) =
        tokio::task::block_in_place(|| rt.block_on(quic_round_trips(a, &b, addr, iters)));
    let (rkyv_request_us, rkyv_token_us) = rkyv_costs(iters);
    // A spawned task sending one value back over a channel: the router's per-request task.
    let mut hand_off = tokio::task::block_in_place(|| rt.block_on(hand_offs(iters)));
    // The floor under all of it: one UDP datagram to a peer thread blocked on its socket and
    // straight back, with no QUIC, runtime or encoding; back to back, and after 1 ms idle
    // (both threads asleep, as a worker between requests is).
    let (mut udp_busy, mut udp_idle) = udp_round_trips(iters);
    let row = json!({
        "udp_round_trip_us": {"back_to_back_p50": pct(&mut udp_busy, 50.0),
            "back_to_back_p99": pct(&mut udp_busy, 99.0),
            "after_idle_p50": pct(&mut udp_idle, 50.0), "after_idle_p99": pct(&mut udp_idle, 99.0)},
        "quic_new_stream_round_trip_us": {"p50": pct(&mut fresh, 50.0), "p99": pct(&mut fresh, 99.0)},
        "quic_kept_stream_round_trip_us": {"p50": pct(&mut kept, 50.0), "p99": pct(&mut kept, 99.0)},
        "rkyv_request_encode_decode_us": rkyv_request_us,
        "rkyv_token_encode_decode_us": rkyv_token_us,
        "spawn_and_channel_us": {"p50": pct(&mut hand_off, 50.0), "p99": pct(&mut hand_off, 99.0)},
    });
    print_hop(&row, iters);
    row
}

/// The worker side, on a thread and runtime of its own (as another node's): an endpoint as
/// `b` that lets `a` in and answers each request with one token per message. Its address.
fn token_server(b: NodeIdentity, a: &NodeIdentity) -> SocketAddr {
    let allow = AllowList::default();
    allow.set([a.fingerprint.clone()]);
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let ep = NodeEndpoint::bind("127.0.0.1:0".parse().unwrap(), b, allow).unwrap();
            addr_tx.send(ep.local_addr()).unwrap();
            let conn = ep.accept().await.unwrap().await.unwrap();
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                tokio::spawn(async move {
                    // A stream carries either one request, or (the kept stream) many.
                    while let Ok(Some(StreamRequest::Generate(r))) =
                        wire::read_msg::<StreamRequest>(&mut recv).await
                    {
                        if wire::write_msg(&mut send, &token(r.request_id as u32, true))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                    let _ = send.finish();
                });
            }
        });
    });
    addr_rx.recv().unwrap()
}

/// Request to first answer over QUIC from `a` to the server at `addr`, microseconds: with a
/// new stream per request (as the router opens them), then on one kept stream. The first
/// 100 of each warm up and are not counted.
async fn quic_round_trips(
    a: NodeIdentity,
    b: &NodeIdentity,
    addr: SocketAddr,
    iters: usize,
) -> (Vec<f64>, Vec<f64>) {
    let ep = NodeEndpoint::bind("127.0.0.1:0".parse().unwrap(), a, AllowList::default()).unwrap();
    let conn = ep.connect(addr, &b.fingerprint).await.unwrap();
    let mut fresh = Vec::with_capacity(iters);
    for i in 0..(iters + 100) as u64 {
        let t0 = Instant::now();
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        wire::write_msg(&mut send, &StreamRequest::Generate(request(i)))
            .await
            .unwrap();
        let _ = send.finish();
        let _: TokenEvent = wire::read_msg(&mut recv).await.unwrap().unwrap();
        if i >= 100 {
            fresh.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let mut kept = Vec::with_capacity(iters);
    for i in 0..(iters + 100) as u64 {
        let t0 = Instant::now();
        wire::write_msg(&mut send, &StreamRequest::Generate(request(i)))
            .await
            .unwrap();
        let _: TokenEvent = wire::read_msg(&mut recv).await.unwrap().unwrap();
        if i >= 100 {
            kept.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    conn.close(0u32.into(), b"done");
    (fresh, kept)
}

/// rkyv framing, both ways, per message: (request, token) microseconds.
fn rkyv_costs(iters: usize) -> (f64, f64) {
    let n = iters * 20;
    let t0 = Instant::now();
    for i in 0..n as u64 {
        let f = wire::encode(&StreamRequest::Generate(request(i))).unwrap();
        let back = wire::decode::<StreamRequest>(&f).unwrap();
        std::hint::black_box(back);
    }
    let rkyv_request_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    let t0 = Instant::now();
    for i in 0..n as u32 {
        let f = wire::encode(&token(i, false)).unwrap();
        let back = wire::decode::<TokenEvent>(&f).unwrap();
        std::hint::black_box(back);
    }
    let rkyv_token_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    (rkyv_request_us, rkyv_token_us)
}

/// A task spawned to send one value back over a channel, `iters` times: microseconds each.
async fn hand_offs(iters: usize) -> Vec<f64> {
    let mut xs = Vec::with_capacity(iters);
    for i in 0..iters {
        let t0 = Instant::now();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let _ = tx.send(i);
        });
        let _ = rx.recv().await;
        xs.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    xs
}

/// The hop's pieces, one line each.
fn print_hop(row: &Value, iters: usize) {
    let (rkyv_request_us, rkyv_token_us) = (
        row["rkyv_request_encode_decode_us"].as_f64().unwrap(),
        row["rkyv_token_encode_decode_us"].as_f64().unwrap(),
    );
    println!("\n== where the hop goes (in-process pieces, {iters} each) ==");
    println!(
        "  QUIC request -> first answer, new stream per request  p50 {:>7.1}us  p99 {:>7.1}us",
        row["quic_new_stream_round_trip_us"]["p50"]
            .as_f64()
            .unwrap(),
        row["quic_new_stream_round_trip_us"]["p99"]
            .as_f64()
            .unwrap()
    );
    println!(
        "  QUIC request -> answer on one kept stream             p50 {:>7.1}us  p99 {:>7.1}us",
        row["quic_kept_stream_round_trip_us"]["p50"]
            .as_f64()
            .unwrap(),
        row["quic_kept_stream_round_trip_us"]["p99"]
            .as_f64()
            .unwrap()
    );
    let udp = &row["udp_round_trip_us"];
    println!(
        "  plain UDP datagram there and back (the floor)        p50 {:>7.1}us  p99 {:>7.1}us; after 1 ms idle p50 {:.1}us  p99 {:.1}us",
        udp["back_to_back_p50"].as_f64().unwrap(),
        udp["back_to_back_p99"].as_f64().unwrap(),
        udp["after_idle_p50"].as_f64().unwrap(),
        udp["after_idle_p99"].as_f64().unwrap()
    );
    println!("  rkyv encode + validate + decode: request {rkyv_request_us:.2}us, token {rkyv_token_us:.2}us");
    println!(
        "  task spawn + channel hand-off                         p50 {:>7.1}us  p99 {:>7.1}us",
        row["spawn_and_channel_us"]["p50"].as_f64().unwrap(),
        row["spawn_and_channel_us"]["p99"].as_f64().unwrap()
    );
}

/// Round trips of one 100-byte UDP datagram between this thread and an echoing one, both
/// blocking on loopback sockets: back to back, then each after a 1 ms pause. Microseconds.
fn udp_round_trips(iters: usize) -> (Vec<f64>, Vec<f64>) {
    use std::net::UdpSocket;
    let echo = UdpSocket::bind("127.0.0.1:0").expect("bind echo socket");
    let there = echo.local_addr().unwrap();
    let me = UdpSocket::bind("127.0.0.1:0").expect("bind socket");
    me.connect(there).unwrap();
    me.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let echoer = std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        // Ends on the empty datagram.
        while let Ok((n, from)) = echo.recv_from(&mut buf) {
            if n == 0 || echo.send_to(&buf[..n], from).is_err() {
                break;
            }
        }
    });
    let msg = [7u8; 100];
    let mut buf = [0u8; 256];
    let mut trip = || {
        let t0 = Instant::now();
        me.send(&msg).unwrap();
        me.recv(&mut buf).expect("echo");
        t0.elapsed().as_secs_f64() * 1e6
    };
    let busy: Vec<f64> = (0..iters).map(|_| trip()).collect();
    let idle: Vec<f64> = (0..iters.min(1000))
        .map(|_| {
            std::thread::sleep(Duration::from_millis(1));
            trip()
        })
        .collect();
    let _ = me.send(&[]);
    let _ = echoer.join();
    (busy, idle)
}
