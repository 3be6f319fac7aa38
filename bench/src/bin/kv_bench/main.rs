//! KV transfer throughput, every transport side by side in one run on this machine:
//!
//! - `memcpy`: one copy of the same bytes in memory (the ceiling for in-process);
//! - `raw tcp`: the bytes over one loopback TCP connection, no framing (the ceiling for any
//!   stream transport here);
//! - kvmesh's transports moving a transfer between two KV pools exactly as workers do
//!   (piece headers, block tables, payloads read straight into the destination blocks):
//!   `in-process`, `tcp` (1 and 4 connections), `quic` (1 and 4 streams, TLS 1.3) and
//!   `ucx` (puts into the registered destination pool, over UCX's `tcp` and shared memory,
//!   between two UCX workers of this process);
//! - peers, in the same run: UCX's own `ucx_perftest` (`ucp_put_bw`, the library's ceiling)
//!   over the same UCX transports and piece sizes, and Mooncake's transfer engine over TCP
//!   (`kvmesh_bench::kv_peers`).
//!
//! Every row also gives CPU seconds per GB moved (this process's, both ends; the peers':
//! both of their processes'), a figure that carries to other machines better than GB/s.
//!
//! The transfer is a prompt's KV for a model of Llama-3.2-1B's shape (16 layers, 8 KV heads
//! of 64, bf16: 32 KiB per token), 4096 tokens (128 MiB), sent as each layer's positions in
//! pieces of 64 KiB to 4 MiB (what chunked prefill sends) and as whole layers (8 MiB).
//!
//! `cargo build --release && target/release/kv-bench [--quick] [--json PATH]`
//! (writes `bench/results/kv-transfer.json` by default).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use kvmesh_bench::kv_peers::{self, CpuClock};
use kvmesh_bench::programs::write_json;
use kvmesh_gpu::kv_pool::{HostKvPool, KvDtype, KvKind, KvSpec};
use kvmesh_transport::kv::local::{self, LocalSender};
use kvmesh_transport::kv::streams::{KvInbox, StreamReceiver, StreamSender, Target};
use kvmesh_transport::kv::{random_u64, KvReceiver, KvRegion, KvSender, Landing};
use kvmesh_transport::wire::{self, UniHeader};
use kvmesh_transport::{AllowList, NodeEndpoint, NodeIdentity};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// KV transfer throughput of every transport, side by side, on this machine.
#[derive(Parser)]
#[command(
    name = "kv-bench",
    after_help = "KV_BENCH_ONLY=quic (or tcp, in-process) runs one transport, for profiling."
)]
struct Args {
    /// A 1024-token transfer (4096 without), fewer piece sizes, best of 2 (of 4).
    #[arg(long)]
    quick: bool,
    /// Where the results go.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "bench/results/kv-transfer.json"
    )]
    json: PathBuf,
}

/// Llama-3.2-1B's KV shape.
fn spec() -> KvSpec {
    KvSpec {
        num_layers: 16,
        block_size: 16,
        num_kv_heads: 8,
        head_dim: 64,
        dtype: KvDtype::Bf16,
    }
}

/// A pool holding `tokens` positions, filled with a pattern (so pages are real).
fn pool(tokens: usize, seed: u8) -> Arc<HostKvPool> {
    let s = spec();
    let p = HostKvPool::new(s.clone(), tokens.div_ceil(s.block_size)).expect("pool");
    for l in 0..s.num_layers {
        for kind in [KvKind::K, KvKind::V] {
            // SAFETY: the pool is ours alone here; layer_bytes is its buffer's size.
            let buf = unsafe { std::slice::from_raw_parts_mut(p.base(l, kind), p.layer_bytes()) };
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
            }
        }
    }
    Arc::new(p)
}

/// The whole pool as one sequence's region; `table` maps the sequence's blocks.
fn region(p: &Arc<HostKvPool>, table: &[u32], tokens: usize) -> KvRegion {
    let s = p.spec();
    let k = (0..s.num_layers).map(|l| p.base(l, KvKind::K)).collect();
    let v = (0..s.num_layers).map(|l| p.base(l, KvKind::V)).collect();
    // SAFETY: the pool outlives the region (kept alive by it); the benchmark runs one
    // transfer at a time, so source and destination positions are not shared.
    unsafe {
        KvRegion::new(
            k,
            v,
            p.layer_bytes(),
            s.bytes_per_pos(),
            s.block_size,
            table.to_vec(),
            0..tokens,
            p.clone(),
        )
    }
}

/// Pieces of `piece_tokens` positions per layer, layer after layer within each chunk, as a
/// chunked prefill sends them.
fn pieces(tokens: usize, piece_tokens: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let mut first = 0;
    while first < tokens {
        let n = piece_tokens.min(tokens - first);
        for layer in 0..spec().num_layers {
            out.push((layer, first, n));
        }
        first += n;
    }
    out
}

struct Setup {
    tokens: usize,
    src: Arc<HostKvPool>,
    dst: Arc<HostKvPool>,
    src_table: Vec<u32>,
    dst_table: Vec<u32>,
}

impl Setup {
    fn new(tokens: usize) -> Setup {
        let blocks = tokens.div_ceil(spec().block_size) as u32;
        // The destination's blocks in another order, as a decode worker's would be.
        let dst_table: Vec<u32> = (0..blocks).map(|b| (b * 7) % blocks).collect();
        let mut seen = vec![false; blocks as usize];
        for &b in &dst_table {
            assert!(
                !std::mem::replace(&mut seen[b as usize], true),
                "a block count divisible by 7 does not permute"
            );
        }
        Setup {
            tokens,
            src: pool(tokens, 1),
            dst: pool(tokens, 0),
            src_table: (0..blocks).collect(),
            dst_table,
        }
    }

    fn bytes(&self) -> usize {
        self.tokens * spec().bytes_per_token()
    }

    fn landing(&self) -> Arc<Landing> {
        Arc::new(Landing::new(
            region(&self.dst, &self.dst_table, self.tokens),
            random_u64(),
        ))
    }

    fn source(&self) -> Arc<KvRegion> {
        Arc::new(region(&self.src, &self.src_table, self.tokens))
    }

    /// The destination holds the source's bytes, position by position.
    fn verify(&self) {
        let s = spec();
        let bpp = s.bytes_per_pos();
        for l in [0, s.num_layers - 1] {
            for pos in [0, self.tokens / 2, self.tokens - 1] {
                let sb = self.src_table[pos / s.block_size] as usize;
                let db = self.dst_table[pos / s.block_size] as usize;
                let off = pos % s.block_size;
                // SAFETY: reading inside the pools after the transfer finished.
                let (a, b) = unsafe {
                    (
                        std::slice::from_raw_parts(
                            self.src
                                .base(l, KvKind::V)
                                .add((sb * s.block_size + off) * bpp),
                            bpp,
                        ),
                        std::slice::from_raw_parts(
                            self.dst
                                .base(l, KvKind::V)
                                .add((db * s.block_size + off) * bpp),
                            bpp,
                        ),
                    )
                };
                assert_eq!(a, b, "layer {l} position {pos} did not land");
            }
        }
    }
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// The best of `reps` timings of `f` (each returns seconds) and the CPU seconds per GB
/// over all of them (`bytes` moved by each).
async fn best<F, Fut>(reps: usize, bytes: usize, mut f: F) -> (f64, f64)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = f64>,
{
    let cpu = CpuClock::start();
    let mut b = f64::INFINITY;
    for _ in 0..reps {
        b = b.min(f().await);
    }
    (b, cpu.elapsed_own() / (reps * bytes) as f64 * 1e9)
}

fn memcpy(bytes: usize) -> f64 {
    let src = vec![7u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src); // touch the pages first
    let t = Instant::now();
    dst.copy_from_slice(&src);
    std::hint::black_box(&dst);
    t.elapsed().as_secs_f64()
}

async fn raw_tcp(bytes: usize) -> f64 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    // Touched before the clock starts, as the KV pools are.
    let mut buf = vec![1u8; bytes];
    let reader = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        s.read_exact(&mut buf).await.unwrap();
        std::hint::black_box(&buf);
    });
    let chunk = vec![9u8; 1 << 20];
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let t = Instant::now();
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min(bytes - sent);
        s.write_all(&chunk[..n]).await.unwrap();
        sent += n;
    }
    reader.await.unwrap();
    t.elapsed().as_secs_f64()
}

async fn run_sender(
    mut sender: Box<dyn KvSender>,
    mut receiver: Box<dyn KvReceiver>,
    plan: &[(usize, usize, usize)],
) -> f64 {
    let t = Instant::now();
    let recv = tokio::spawn(async move { receiver.complete().await });
    for &(l, f, n) in plan {
        sender.send(l, f, n).await.expect("send");
    }
    let sent = sender.finish().await.expect("finish");
    let got = recv.await.unwrap().expect("receive");
    assert_eq!(sent.bytes, got.bytes);
    t.elapsed().as_secs_f64()
}

mod ucx;

async fn ucx_transfer(p: &ucx::UcxPair, s: &Setup, plan: &[(usize, usize, usize)]) -> f64 {
    let (send, recv) = p.transfer(s.landing(), s.source(), s.dst_table.clone(), 1);
    run_sender(send, recv, plan).await
}

async fn in_process(s: &Setup, plan: &[(usize, usize, usize)]) -> f64 {
    let (target, recv) = local::channel(s.landing());
    run_sender(
        Box::new(LocalSender::new(s.source(), target)),
        Box::new(recv),
        plan,
    )
    .await
}

async fn tcp(s: &Setup, plan: &[(usize, usize, usize)], conns: usize) -> f64 {
    let inbox = KvInbox::default();
    let listener = Arc::new(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    let addr = listener.local_addr().unwrap();
    let serve = tokio::spawn(inbox.clone().serve_tcp(listener));
    let landing = s.landing();
    let id = landing.transfer_id;
    let (_entry, incoming) = inbox.register(id, 5);
    let recv = StreamReceiver::new(landing, incoming, conns);
    let target = Target {
        source: s.source(),
        transfer_id: id,
        dest_blocks: s.dst_table.clone(),
        span: tracing::Span::none(),
    };
    let t = Instant::now();
    let sender = StreamSender::tcp(addr, target, 5, conns)
        .await
        .expect("connect");
    let secs = run_sender(Box::new(sender), Box::new(recv), plan).await;
    serve.abort();
    // Connection set-up is part of a transfer's cost here (one connection set per transfer).
    secs.max(t.elapsed().as_secs_f64())
}

/// A QUIC pair: the decode side dials the prefill side, which opens the streams back, as
/// in the mesh.
struct QuicPair {
    prefill_conn: kvmesh_transport::Connection,
    inbox: KvInbox,
    _ends: (NodeEndpoint, NodeEndpoint),
}

async fn quic_pair() -> QuicPair {
    let (p, d) = (
        NodeIdentity::generate("prefill").unwrap(),
        NodeIdentity::generate("decode").unwrap(),
    );
    let allow = AllowList::default();
    allow.set([p.fingerprint.clone(), d.fingerprint.clone()]);
    let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let pe = NodeEndpoint::bind(lo, p.clone(), allow.clone()).unwrap();
    let de = NodeEndpoint::bind(lo, d, allow).unwrap();
    let accept = {
        let pe = pe.clone();
        tokio::spawn(async move { pe.accept().await.unwrap().await.unwrap() })
    };
    let dconn = de.connect(pe.local_addr(), &p.fingerprint).await.unwrap();
    let prefill_conn = accept.await.unwrap();
    let inbox = KvInbox::default();
    {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            while let Ok(mut r) = dconn.accept_uni().await {
                if let Ok(Some(UniHeader::Kv(h))) = wire::read_msg::<UniHeader>(&mut r).await {
                    let _ = inbox.deliver(&h, Box::new(r));
                }
            }
        });
    }
    QuicPair {
        prefill_conn,
        inbox,
        _ends: (pe, de),
    }
}

async fn quic(q: &QuicPair, s: &Setup, plan: &[(usize, usize, usize)], streams: usize) -> f64 {
    let landing = s.landing();
    let id = landing.transfer_id;
    let (_entry, incoming) = q.inbox.register(id, 6);
    let recv = StreamReceiver::new(landing, incoming, streams);
    let target = Target {
        source: s.source(),
        transfer_id: id,
        dest_blocks: s.dst_table.clone(),
        span: tracing::Span::none(),
    };
    let t = Instant::now();
    let sender = StreamSender::quic(&q.prefill_conn, target, 6, streams)
        .await
        .expect("streams");
    let secs = run_sender(Box::new(sender), Box::new(recv), plan).await;
    secs.max(t.elapsed().as_secs_f64())
}

/// UCX's own put bandwidth and Mooncake's TCP transport at one piece size.
fn peer_rows(label: &str, piece_bytes: usize, quick: bool) -> Vec<Value> {
    let moved = if quick { 1usize << 29 } else { 3 << 29 };
    let iters = (moved / piece_bytes).max(8);
    let peers = [
        kv_peers::ucx_perftest_put("tcp", piece_bytes, iters),
        kv_peers::ucx_perftest_put("sm", piece_bytes, iters),
        kv_peers::mooncake_tcp(piece_bytes, 64 << 20),
    ];
    let names = ["ucx_perftest tcp", "ucx_perftest sm", "mooncake tcp"];
    names
        .iter()
        .zip(peers)
        .map(|(what, p)| match p {
            Ok(p) => json!({"transport": what, "pieces": label, "piece_bytes": piece_bytes,
                "gb_per_s": p.gb_per_s, "cpu_s_per_gb": p.cpu_s_per_gb, "peer": true,
                "detail": p.detail}),
            Err(e) => {
                println!("{what} ({label}): not run: {e}");
                json!({"transport": what, "pieces": label, "piece_bytes": piece_bytes,
                    "not_run": e, "peer": true})
            }
        })
        .collect()
}

fn print_table(rows: &[Value], raw: f64) {
    println!(
        "\n{:<30} {:<22} {:>9} {:>11} {:>10}",
        "transport", "pieces", "GB/s", "vs raw tcp", "CPU s/GB"
    );
    for r in rows {
        let Some(g) = r["gb_per_s"].as_f64() else {
            continue;
        };
        println!(
            "{:<30} {:<22} {:>9.2} {:>10.0}% {:>10}",
            r["transport"].as_str().unwrap(),
            r["pieces"].as_str().unwrap_or("-"),
            g,
            100.0 * g / raw,
            r["cpu_s_per_gb"]
                .as_f64()
                .map_or("-".to_string(), |c| format!("{c:.2}"))
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let quick = args.quick;
    let tokens = if quick { 1024 } else { 4096 };
    let reps = if quick { 2 } else { 4 };
    let s = Setup::new(tokens);
    let bytes = s.bytes();
    let per_pos_layer = 2 * spec().bytes_per_pos(); // K and V of one position, one layer
    println!(
        "KV transfer: {tokens} tokens of a Llama-3.2-1B-shaped model ({} KiB per token), {:.1} MiB; best of {reps}",
        spec().bytes_per_token() / 1024,
        bytes as f64 / (1 << 20) as f64
    );

    let memcpy_s = (0..reps)
        .map(|_| memcpy(bytes))
        .fold(f64::INFINITY, f64::min);
    let (raw_s, raw_cpu) = best(reps, bytes, || raw_tcp(bytes)).await;
    let q = quic_pair().await;
    let mut rows: Vec<Value> = vec![
        json!({"transport": "memcpy", "piece_bytes": bytes, "gb_per_s": gbps(bytes, memcpy_s)}),
        json!({"transport": "raw tcp (1 connection)", "piece_bytes": bytes, "gb_per_s": gbps(bytes, raw_s), "cpu_s_per_gb": raw_cpu}),
    ];
    // UCX between two workers of this process, over its TCP and its shared memory.
    let mut ucx_pairs = Vec::new();
    for tls in ["tcp", "sm"] {
        match ucx::UcxPair::new(&s.dst, tls).await {
            Ok(p) => ucx_pairs.push((tls, p)),
            Err(e) => println!("ucx over {tls}: not run: {e}"),
        }
    }
    let piece_sizes: Vec<usize> = if quick {
        vec![64 << 10, 1 << 20]
    } else {
        vec![64 << 10, 256 << 10, 1 << 20, 4 << 20]
    };
    let mut shapes: Vec<(String, usize)> = piece_sizes
        .iter()
        .map(|&b| (format!("{} KiB pieces", b >> 10), b / per_pos_layer))
        .collect();
    shapes.push((
        format!("whole layers ({} KiB)", (tokens * per_pos_layer) >> 10),
        tokens,
    ));
    // KV_BENCH_ONLY=quic (or tcp, in-process) runs one transport, for profiling.
    let only = std::env::var("KV_BENCH_ONLY").ok();
    let wanted = |t: &str| only.as_deref().is_none_or(|o| t.starts_with(o));
    for (label, piece_tokens) in &shapes {
        let plan = pieces(tokens, *piece_tokens);
        let piece_bytes = piece_tokens * per_pos_layer;
        let mut row = |transport: &str, (secs, cpu): (f64, f64)| {
            rows.push(
                json!({"transport": transport, "pieces": label, "piece_bytes": piece_bytes,
                "gb_per_s": gbps(bytes, secs), "ms": secs * 1e3, "cpu_s_per_gb": cpu}),
            );
        };
        if wanted("in-process") {
            row(
                "in-process",
                best(reps, bytes, || in_process(&s, &plan)).await,
            );
            s.verify();
        }
        if wanted("tcp") {
            row("tcp x1", best(reps, bytes, || tcp(&s, &plan, 1)).await);
            row("tcp x4", best(reps, bytes, || tcp(&s, &plan, 4)).await);
            s.verify();
        }
        if wanted("quic") {
            row(
                "quic x1",
                best(reps, bytes, || quic(&q, &s, &plan, 1)).await,
            );
            row(
                "quic x4",
                best(reps, bytes, || quic(&q, &s, &plan, 4)).await,
            );
            s.verify();
        }
        if wanted("ucx") {
            for (tls, p) in &ucx_pairs {
                let name = format!("ucx {tls} ({})", p.tl);
                row(
                    &name,
                    best(reps, bytes, || ucx_transfer(p, &s, &plan)).await,
                );
                s.verify();
            }
        }
        if wanted("peers") {
            rows.extend(peer_rows(label, piece_bytes, quick));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let raw = gbps(bytes, raw_s);
    let mem = gbps(bytes, memcpy_s);
    print_table(&rows, raw);
    println!("(memcpy {mem:.2} GB/s, raw loopback TCP {raw:.2} GB/s, measured in this run)");
    let out = json!({
        "machine": std::fs::read_to_string("/proc/cpuinfo").ok()
            .and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())),
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "tokens": tokens, "bytes": bytes, "kv_bytes_per_token": spec().bytes_per_token(),
        "memcpy_gb_per_s": mem, "raw_tcp_gb_per_s": raw, "rows": rows,
    });
    write_json(&args.json, &out).expect("write JSON");
    println!("wrote {}", args.json.display());
}
