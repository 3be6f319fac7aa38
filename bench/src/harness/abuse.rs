//! Strangers and frozen peers on the mesh's own ports, as `tests/reliability.rs` asserts on
//! them and `soak-bench` reports them: one scenario, two readers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvmesh_discovery::testing::Etcd;
use serde_json::json;

use super::http::{post, wait_for};
use super::{Kvmesh, Proc};

/// A process's resident memory, MiB.
pub fn rss_mib(p: &Proc) -> f64 {
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", p.child.id())).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// A loopback port nothing listens on (yet), below the ephemeral range
/// (`kvmesh_discovery::testing::free_port`).
pub fn free_port() -> u16 {
    kvmesh_discovery::testing::free_port()
}

/// Whether the peer has closed `s` (a read sees the end or an error) within `wait`.
pub fn closed_within(s: &TcpStream, wait: Duration) -> bool {
    let _ = s.set_read_timeout(Some(wait));
    let mut buf = [0u8; 64];
    let mut reader = s;
    loop {
        match reader.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            }
        }
    }
}

/// Whether the peer has closed `s` already.
pub fn closed_now(s: &TcpStream) -> bool {
    let _ = s.set_nonblocking(true);
    let mut buf = [0u8; 64];
    let mut reader = s;
    let closed = match reader.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = s.set_nonblocking(false);
    closed
}

/// A decode node with a TCP KV listener on `kv`, in `cluster`.
pub fn kv_listener_node(km: &Kvmesh, etcd: &Etcd, cluster: &str, kv: &str) -> Proc {
    km.node(
        etcd,
        cluster,
        "d1",
        &[
            "--roles",
            "decode",
            "--backend",
            "sim",
            "--kv-transport",
            "tcp",
            "--kv-listen",
            kv,
        ],
    )
}

/// What strangers on a KV listener got.
#[derive(Debug)]
pub struct KvStrangers {
    pub rss_before_mib: f64,
    /// Per round: connections that each declared a hello just under 64 MiB, the node's
    /// memory half a second into them, and how many it had closed within 3 s.
    pub rounds: Vec<(usize, f64, usize)>,
    /// Silent connections: how many, closed 0.3 s after they connected (those over the
    /// bound of connections waiting for a hello), closed within 3 s, and when the last
    /// closed.
    pub silent: usize,
    pub silent_closed_at_once: usize,
    pub silent_closed: usize,
    pub silent_all_closed_s: f64,
    pub rss_after_mib: f64,
}

impl KvStrangers {
    pub fn json(&self) -> serde_json::Value {
        json!({
            "rss_before_mib": self.rss_before_mib,
            "rounds": self.rounds.iter().map(|r| json!({
                "hostile_hellos": r.0, "rss_during_mib": r.1, "closed_within_3s": r.2,
            })).collect::<Vec<_>>(),
            "silent_connections": self.silent,
            "silent_closed_at_once": self.silent_closed_at_once,
            "silent_closed": self.silent_closed,
            "silent_all_closed_s": self.silent_all_closed_s,
            "rss_after_mib": self.rss_after_mib,
        })
    }
}

/// Strangers on `node`'s KV listener at `kv`: 20 and then 40 connections each declaring a
/// hello just under 64 MiB (and sending 4 KiB of it), then 80 that say nothing.
pub fn kv_listener_strangers(node: &Proc, kv: &str) -> KvStrangers {
    let rss_before_mib = rss_mib(node);
    let mut rounds = Vec::new();
    for n in [20, 40] {
        let conns: Vec<TcpStream> = (0..n)
            .filter_map(|_| {
                let mut s = TcpStream::connect(kv).ok()?;
                let _ = s.write_all(&(64u32 * 1024 * 1024 - 16).to_le_bytes());
                let _ = s.write_all(&[0xAB; 4096]);
                Some(s)
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let during = rss_mib(node);
        let closed = conns
            .iter()
            .filter(|s| closed_within(s, Duration::from_secs(3)))
            .count();
        rounds.push((n, during, closed));
    }
    let silent = 80;
    let conns: Vec<TcpStream> = (0..silent)
        .filter_map(|_| TcpStream::connect(kv).ok())
        .collect();
    let t = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    let silent_closed_at_once = conns.iter().filter(|s| closed_now(s)).count();
    let silent_closed = conns
        .iter()
        .filter(|s| closed_within(s, Duration::from_secs(3)))
        .count();
    KvStrangers {
        rss_before_mib,
        rounds,
        silent,
        silent_closed_at_once,
        silent_closed,
        silent_all_closed_s: t.elapsed().as_secs_f64(),
        rss_after_mib: rss_mib(node),
    }
}

/// What 16 long prompts met with one of two prefill peers frozen.
#[derive(Debug)]
pub struct FrozenPrefill {
    /// Each request's status and when it finished, from when all were sent.
    pub finished: Vec<(u16, Duration)>,
    /// The decode node's prefills by where they ran.
    pub remote: f64,
    pub fallbacks: f64,
}

/// A decode node, two prefill nodes and a gateway in `cluster`; the second prefill node is
/// SIGSTOPped before the decode node has dialed it, then 16 prompts of 200 tokens go in at
/// once. The frozen node is thawed before this returns.
pub async fn frozen_prefill_peer(
    km: &Kvmesh,
    etcd: &Etcd,
    cluster: &str,
    http: &reqwest::Client,
) -> FrozenPrefill {
    let engine = ["--backend", "sim", "--num-kv-blocks", "1024"];
    let node = |id: &str, roles: &str| -> Proc {
        let args = [&["--roles", roles][..], &engine[..]].concat();
        km.node(etcd, cluster, id, &args)
    };
    let decode = node("d1", "decode");
    let _p1 = node("p1", "prefill");
    let p2 = node("p2", "prefill");
    let gw = km.gateway_with(
        etcd,
        cluster,
        "gw",
        "least-loaded",
        &["--disagg-min-tokens", "32"],
    );
    wait_for("the router connected to every role", 30, async || {
        gw.try_metric(http, "kvmesh:router_workers_routable").await == Some(1.0)
            && gw
                .try_metric(http, "kvmesh:router_prefill_workers_connected")
                .await
                == Some(2.0)
    })
    .await;
    p2.signal("STOP");
    let start = Instant::now();
    let tasks: Vec<_> = (0..16u64)
        .map(|i| {
            let prompt: Vec<u64> = (0..200).map(|j| 5 + (j * 37 + i * 11) % 90).collect();
            let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0,
                              "ignore_eos": true});
            let (http, base) = (http.clone(), gw.http.clone());
            tokio::spawn(async move {
                let (st, _) = post(&http, &base, body).await;
                (st, start.elapsed())
            })
        })
        .collect();
    let mut finished = Vec::new();
    for t in tasks {
        let r = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("a request hung")
            .expect("a request's task");
        finished.push(r);
    }
    p2.signal("CONT");
    let outcome = |o: &str| format!("kvmesh:disagg_prefills_total{{outcome=\"{o}\"}}");
    FrozenPrefill {
        finished,
        remote: decode.metric(http, &outcome("remote")).await,
        fallbacks: decode.metric(http, &outcome("fallback")).await,
    }
}
