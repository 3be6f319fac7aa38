//! Several hosts on one machine: etcd, a gateway and workers each in its own network
//! namespace with its own address on a bridge, joined only through etcd and
//! `--advertise-addr`. Real network failures: a worker's link cut while its process lives
//! on, the gateway cut off from etcd, a node that advertises an address nobody has.
//!
//! Needs root (as CI runs) and `ip` from iproute2; elsewhere it prints why it is skipped.
//! Everything it makes (namespaces, the bridge, veth pairs) lives in namespaces of its own
//! and is removed when it ends; no traffic leaves them.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvmesh_bench::harness::{wait_ready, Ready};
use serde_json::{json, Value};

fn bin() -> String {
    std::env::var("KVMESH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvmesh").into())
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A bridge in a namespace of its own and hosts (namespaces) plugged into it, one veth each.
struct Net {
    prefix: String,
    hosts: Vec<String>,
}

const SUBNET: &str = "10.77.0";

impl Net {
    fn new() -> Result<Net, String> {
        let mut net = Net {
            prefix: format!("kvmt{}", std::process::id()),
            hosts: Vec::new(),
        };
        let br = net.ns("br");
        ip(&["netns", "add", &br])?;
        net.hosts.push(br.clone());
        ip(&["-n", &br, "link", "set", "lo", "up"])?;
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &br, "link", "set", "br0", "up"])?;
        Ok(net)
    }

    fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    /// A host `name` at 10.77.0.`last`.
    fn host(&mut self, name: &str, last: u8) -> Result<Host, String> {
        let (br, ns) = (self.ns("br"), self.ns(name));
        ip(&["netns", "add", &ns])?;
        self.hosts.push(ns.clone());
        let veth = format!("v{last}");
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&[
            "-n", &br, "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ])?;
        ip(&["-n", &br, "link", "set", &veth, "master", "br0"])?;
        ip(&["-n", &br, "link", "set", &veth, "up"])?;
        let addr = format!("{SUBNET}.{last}");
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        Ok(Host { ns, addr })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.hosts.iter().rev() {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

#[derive(Clone)]
struct Host {
    ns: String,
    addr: String,
}

impl Host {
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    fn link(&self, up: bool) {
        ip(&[
            "-n",
            &self.ns,
            "link",
            "set",
            "eth0",
            if up { "up" } else { "down" },
        ])
        .unwrap();
    }

    /// An HTTP request from this host with curl: (status, JSON body or Null).
    fn curl(&self, method: &str, url: &str, body: Option<&Value>) -> (u16, Value) {
        let mut c = self.command("curl");
        c.args(["-s", "-m", "30", "-X", method, "-w", "\n%{http_code}"]);
        if let Some(b) = body {
            c.args(["-H", "content-type: application/json", "-d", &b.to_string()]);
        }
        let out = c.arg(url).output().expect("run curl");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (
            code.trim().parse().unwrap_or(0),
            serde_json::from_str(body).unwrap_or(Value::Null),
        )
    }
}

/// A process in a host's namespace; killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_etcd(host: &Host, dir: &std::path::Path) -> Proc {
    let bin = kvmesh_discovery::testing::etcd_binary()
        .expect("no etcd binary (scripts/test.sh installs Debian's etcd-server)");
    let client = format!("http://{}:2379", host.addr);
    let peer = "http://127.0.0.1:2380";
    let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
    let child = host
        .command(bin.to_str().unwrap())
        .arg(format!("--data-dir={}", dir.join("etcd").display()))
        .arg(format!("--listen-client-urls={client}"))
        .arg(format!("--advertise-client-urls={client}"))
        .arg(format!("--listen-peer-urls={peer}"))
        .arg(format!("--initial-advertise-peer-urls={peer}"))
        .arg(format!("--initial-cluster=default={peer}"))
        .args([
            "--name=default",
            "--heartbeat-interval=50",
            "--election-timeout=250",
        ])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start etcd");
    let p = Proc(child);
    let t = Instant::now();
    while host.curl("GET", &format!("{client}/health"), None).0 != 200 {
        assert!(t.elapsed() < Duration::from_secs(30), "etcd did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    p
}

/// `kvmesh node` on a host, listening on every interface of its namespace and advertising
/// `advertise` (its own address unless a test says otherwise).
fn start_node(host: &Host, etcd: &str, id: &str, advertise: &str, args: &[&str]) -> Proc {
    let mut child = host
        .command(&bin())
        .args(["node", "--etcd", etcd, "--node-id", id, "--lease-ttl", "2"])
        .args(["--listen", "0.0.0.0:7000", "--advertise-addr", advertise])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start kvmesh node");
    wait_ready(&mut child, Ready::Node, &format!("node {id}"));
    Proc(child)
}

/// The gateway's router's view: node_id -> (connected, routed).
fn router_view(client: &Host, gw: &str) -> Vec<(String, bool, u64)> {
    let (st, v) = client.curl("GET", &format!("{gw}/status"), None);
    if st != 200 {
        return Vec::new();
    }
    v["router"]["workers"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|w| {
            (
                w["node_id"].as_str().unwrap_or("").to_string(),
                w["connected"].as_bool() == Some(true) && w["draining"].as_bool() != Some(true),
                w["routed"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

fn routed(view: &[(String, bool, u64)], id: &str) -> u64 {
    view.iter().find(|w| w.0 == id).map_or(0, |w| w.2)
}

fn routable(view: &[(String, bool, u64)], id: &str) -> bool {
    view.iter().any(|w| w.0 == id && w.1)
}

fn wait(what: &str, secs: u64, mut cond: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        if cond() {
            return t.elapsed();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what}: not within {secs} s");
}

fn completion(i: usize) -> Value {
    json!({"model": "shakespeare", "prompt": format!("Request {i} crosses hosts:"),
           "max_tokens": 8, "temperature": 0, "ignore_eos": true})
}

/// Sends `count` requests from `client`, `every` apart, each on its own thread; returns
/// the statuses in order. Bounded by count, and each request by curl's 30 s.
fn load(client: &Host, gw: &str, count: usize, every: Duration) -> Vec<u16> {
    let handles: Vec<_> = (0..count)
        .map(|i| {
            let (client, url) = (client.clone(), format!("{gw}/v1/completions"));
            let h = std::thread::spawn(move || client.curl("POST", &url, Some(&completion(i))).0);
            std::thread::sleep(every);
            h
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_mesh_across_hosts_survives_cut_links_and_names_a_wrong_address() {
    if !cfg!(target_os = "linux")
        || Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout.trim_ascii() != b"0")
            .unwrap_or(true)
    {
        println!("SKIPPED: network namespaces need root on Linux (CI runs as root)");
        return;
    }
    let mut net = match Net::new() {
        Ok(n) => n,
        Err(e) => {
            println!("SKIPPED: cannot make network namespaces here: {e}");
            return;
        }
    };
    let hosts: Vec<Host> = [("etcd", 1), ("gw", 2), ("w1", 3), ("w2", 4), ("bad", 5)]
        .iter()
        .map(|(n, a)| net.host(n, *a).expect("make a host"))
        .collect();
    let (etcd_host, gw_host, w1_host, w2_host, bad_host) =
        (&hosts[0], &hosts[1], &hosts[2], &hosts[3], &hosts[4]);
    if gw_host.command("curl").arg("--version").output().is_err() {
        println!("SKIPPED: no curl to send requests from inside a namespace");
        return;
    }
    let dir = std::env::temp_dir().join(format!("{}-etcd", net.prefix));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let _etcd = start_etcd(etcd_host, &dir);
    let etcd = format!("http://{}:2379", etcd_host.addr);
    let gw_url = format!("http://{}:8000", gw_host.addr);
    let _gw = start_node(
        gw_host,
        &etcd,
        "gw",
        &format!("{}:7000", gw_host.addr),
        &[
            "--roles",
            "gateway,router",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--policy",
            "round-robin",
        ],
    );
    let worker = [
        "--roles",
        "worker",
        "--backend",
        "sim",
        "--status-port",
        "9090",
    ];
    let _w1 = start_node(
        w1_host,
        &etcd,
        "w1",
        &format!("{}:7000", w1_host.addr),
        &worker,
    );
    let _w2 = start_node(
        w2_host,
        &etcd,
        "w2",
        &format!("{}:7000", w2_host.addr),
        &worker,
    );
    // Listens on its own address but tells the cluster to dial one nobody has.
    let _bad = start_node(
        bad_host,
        &etcd,
        "bad",
        &format!("{SUBNET}.99:7000"),
        &worker,
    );
    wait("w1 and w2 routable from the gateway's host", 30, || {
        let v = router_view(gw_host, &gw_url);
        routable(&v, "w1") && routable(&v, "w2")
    });

    // 1. Requests flow end to end across hosts; the wrong address gets none.
    for i in 0..6 {
        let (st, body) = gw_host.curl(
            "POST",
            &format!("{gw_url}/v1/completions"),
            Some(&completion(i)),
        );
        assert_eq!(st, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 8);
    }
    // ...and from another host too (the gateway listens on its address, not loopback).
    let (st, _) = w2_host.curl("GET", &format!("{gw_url}/v1/models"), None);
    assert_eq!(st, 200);
    let v = router_view(gw_host, &gw_url);
    assert_eq!(routed(&v, "w1") + routed(&v, "w2"), 6, "{v:?}");
    assert!(routed(&v, "w1") > 0 && routed(&v, "w2") > 0, "{v:?}");
    assert!(
        v.iter().any(|w| w.0 == "bad"),
        "the bad node is not even listed: {v:?}"
    );
    assert!(!routable(&v, "bad") && routed(&v, "bad") == 0, "{v:?}");
    let out = gw_host
        .command(&bin())
        .args(["cluster", "status", "--etcd", &etcd])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    println!("{table}");
    let bad_line = table
        .lines()
        .find(|l| l.starts_with("bad "))
        .expect("bad listed");
    assert!(bad_line.contains("unreachable"), "{table}");
    assert!(
        table.lines().any(|l| l.starts_with("! bad:")
            && l.contains(&format!("{SUBNET}.99:7000"))
            && l.contains("gw")),
        "cluster status does not say why bad gets nothing:\n{table}"
    );
    for id in ["w1 ", "w2 "] {
        let l = table.lines().find(|l| l.starts_with(id)).unwrap();
        assert!(l.trim_end().ends_with("ok"), "{table}");
    }

    // 2. The gateway loses etcd: it serves on over the connections it has.
    ip(&[
        "-n",
        &gw_host.ns,
        "route",
        "add",
        "blackhole",
        &format!("{}/32", etcd_host.addr),
    ])
    .unwrap();
    // Longer than the lease: its own record expires meanwhile.
    std::thread::sleep(Duration::from_secs(4));
    let before = router_view(gw_host, &gw_url);
    let statuses = load(gw_host, &gw_url, 8, Duration::from_millis(100));
    assert!(
        statuses.iter().all(|&s| s == 200),
        "cut off from etcd: {statuses:?}"
    );
    let after = router_view(gw_host, &gw_url);
    assert!(
        routed(&after, "w1") > routed(&before, "w1")
            && routed(&after, "w2") > routed(&before, "w2"),
        "both workers keep serving: {before:?} -> {after:?}"
    );
    ip(&[
        "-n",
        &gw_host.ns,
        "route",
        "del",
        "blackhole",
        &format!("{}/32", etcd_host.addr),
    ])
    .unwrap();
    wait("the gateway back in the registry", 20, || {
        let out = w1_host
            .command(&bin())
            .args(["cluster", "status", "--etcd", &etcd])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.starts_with("gw "))
    });

    // 3. w1's link goes down while its process lives on: a bounded load runs across the
    // cut; routing must avoid w1 and lose no request.
    let gw2 = gw_host.clone();
    let url = gw_url.clone();
    let loader = std::thread::spawn(move || load(&gw2, &url, 60, Duration::from_millis(100)));
    std::thread::sleep(Duration::from_secs(1));
    let cut = Instant::now();
    w1_host.link(false);
    let avoided = wait("routing avoids w1", 15, || {
        !routable(&router_view(gw_host, &gw_url), "w1")
    });
    let statuses = loader.join().unwrap();
    let lost = statuses.iter().filter(|&&s| s != 200).count();
    let routed_down = routed(&router_view(gw_host, &gw_url), "w1");
    // A few more with w1 still cut off: none goes there.
    for i in 0..4 {
        let (st, body) = gw_host.curl(
            "POST",
            &format!("{gw_url}/v1/completions"),
            Some(&completion(i)),
        );
        assert_eq!(st, 200, "{body}");
    }
    assert_eq!(
        routed(&router_view(gw_host, &gw_url), "w1"),
        routed_down,
        "routed to a cut-off worker"
    );
    std::thread::sleep(Duration::from_secs(2));
    let restored = Instant::now();
    w1_host.link(true);
    let rejoined = wait("w1 routable again after its link returns", 30, || {
        routable(&router_view(gw_host, &gw_url), "w1")
    });
    for i in 0..4 {
        let (st, body) = gw_host.curl(
            "POST",
            &format!("{gw_url}/v1/completions"),
            Some(&completion(i)),
        );
        assert_eq!(st, 200, "{body}");
    }
    assert!(
        routed(&router_view(gw_host, &gw_url), "w1") > routed_down,
        "w1 gets no traffic after rejoining"
    );
    let figures = json!({
        "link_cut_routing_avoids_worker_after_s": avoided.as_secs_f64(),
        "link_cut_requests_sent": statuses.len(),
        "link_cut_requests_lost": lost,
        "link_restored_worker_routable_after_s": rejoined.as_secs_f64(),
        "cut_at": format!("{:?} before the end", cut.elapsed()),
        "restored_at": format!("{:?} before the end", restored.elapsed()),
    });
    println!("netns recovery figures: {figures}");
    let _ = std::fs::create_dir_all("target");
    let _ = std::fs::write(
        "target/netns-recovery.json",
        serde_json::to_string_pretty(&figures).unwrap(),
    );
    assert_eq!(lost, 0, "requests lost across the link cut: {statuses:?}");
}
