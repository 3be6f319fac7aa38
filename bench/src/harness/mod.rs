//! Real `kvmesh` processes around a real etcd, for the bench programs and the end-to-end
//! tests alike: starting `kvmesh serve` and `kvmesh node` and waiting until they serve
//! ([`Kvmesh`], [`Proc`]), asking them over HTTP ([`http`]), and driving streamed requests
//! through the OpenAI API with per-token timestamps, then summarising them ([`load`]).
//!
//! The harness does not look for the binary: its callers know where theirs is (a test has
//! Cargo's `CARGO_BIN_EXE_kvmesh`, a bench program the folder it runs from) and say so
//! through [`Kvmesh::new`].
//!
//! Everything here panics on what it does not expect: a process that does not start, an
//! answer that is not JSON. Its callers are tests and measurements, where that is the report.

pub mod abuse;
pub mod http;
pub mod load;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvmesh_discovery::testing::Etcd;

pub use http::{
    client, connected_workers, get_json, load_client, post, routed, sse, status, wait_for,
    wait_workers,
};

/// How long a process may take to say it serves.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The `kvmesh` binary and how its processes start.
#[derive(Clone, Debug)]
pub struct Kvmesh {
    bin: PathBuf,
    /// Flags every `kvmesh node` gets ahead of its own.
    node_flags: Vec<String>,
    /// Flags every gateway started by [`Kvmesh::gateway`] gets after its policy.
    gateway_flags: Vec<String>,
    /// Whether the processes' logs (stderr) go to ours, or nowhere.
    logs: bool,
    /// The niceness its processes start with (every thread inherits it).
    niceness: i32,
}

impl Kvmesh {
    /// The binary at `bin`; its processes log to this process's stderr.
    pub fn new(bin: impl Into<PathBuf>) -> Kvmesh {
        Kvmesh {
            bin: bin.into(),
            node_flags: Vec::new(),
            gateway_flags: Vec::new(),
            logs: true,
            niceness: 0,
        }
    }

    /// Every `kvmesh node` started from here gets `flags` ahead of its own.
    pub fn node_flags(mut self, flags: &[&str]) -> Kvmesh {
        self.node_flags = flags.iter().map(|f| f.to_string()).collect();
        self
    }

    /// Every gateway started from here gets `flags` after its policy.
    pub fn gateway_flags(mut self, flags: &[&str]) -> Kvmesh {
        self.gateway_flags = flags.iter().map(|f| f.to_string()).collect();
        self
    }

    /// Its processes start at this niceness (above 0: they yield the CPU to the measured
    /// ones, as a harness should that shares their machine).
    pub fn niceness(mut self, n: i32) -> Kvmesh {
        self.niceness = n;
        self
    }

    /// The processes' logs are dropped: a measurement prints its own figures only.
    pub fn quiet(mut self) -> Kvmesh {
        self.logs = false;
        self
    }

    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// A command running the binary, for what the helpers below do not cover.
    pub fn command(&self) -> Command {
        Command::new(&self.bin)
    }

    /// `kvmesh serve` on a free loopback port, with extra flags; returns once it listens.
    pub fn serve(&self, args: &[&str]) -> Proc {
        let mut cmd = self.command();
        cmd.args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args);
        self.start(cmd, Ready::Listening, &format!("kvmesh serve {args:?}"))
    }

    /// `kvmesh node` in `cluster` under `id`, with `args`; returns once it is ready.
    pub fn node(&self, etcd: &Etcd, cluster: &str, id: &str, args: &[&str]) -> Proc {
        let mut cmd = self.command();
        cmd.args(["node", "--etcd", &etcd.url()])
            .args(["--cluster", cluster, "--node-id", id])
            .args(&self.node_flags)
            .args(args);
        self.start(cmd, Ready::Node, &format!("node {id}"))
    }

    /// `kvmesh node --no-etcd` under `id` with `args`: a node that is a whole cluster by
    /// itself; returns once it is ready.
    pub fn node_alone(&self, id: &str, args: &[&str]) -> Proc {
        let mut cmd = self.command();
        cmd.args(["node", "--no-etcd", "--node-id", id])
            .args(&self.node_flags)
            .args(args);
        self.start(cmd, Ready::Node, &format!("node {id} (no etcd)"))
    }

    /// `kvmesh node --registry-dir DIR` under `id` with `args`: one of several processes
    /// of this machine finding each other through files in `dir`; returns once it is ready.
    pub fn node_in_dir(&self, dir: &std::path::Path, id: &str, args: &[&str]) -> Proc {
        let mut cmd = self.command();
        cmd.args(["node", "--registry-dir"])
            .arg(dir)
            .args(["--node-id", id])
            .args(&self.node_flags)
            .args(args);
        self.start(
            cmd,
            Ready::Node,
            &format!("node {id} (registry {})", dir.display()),
        )
    }

    /// A worker on the `sim` backend, with extra flags.
    pub fn worker(&self, etcd: &Etcd, cluster: &str, id: &str, extra: &[&str]) -> Proc {
        let mut args = vec!["--roles", "worker", "--backend", "sim"];
        args.extend_from_slice(extra);
        self.node(etcd, cluster, id, &args)
    }

    /// A gateway with its router on a free loopback port, routing by `policy`.
    pub fn gateway(&self, etcd: &Etcd, cluster: &str, id: &str, policy: &str) -> Proc {
        self.gateway_with(etcd, cluster, id, policy, &[])
    }

    /// [`Kvmesh::gateway`] with extra flags.
    pub fn gateway_with(
        &self,
        etcd: &Etcd,
        cluster: &str,
        id: &str,
        policy: &str,
        extra: &[&str],
    ) -> Proc {
        let mut args = vec!["--roles", "gateway,router", "--host", "127.0.0.1"];
        args.extend(["--port", "0", "--policy", policy]);
        args.extend(self.gateway_flags.iter().map(String::as_str));
        args.extend_from_slice(extra);
        self.node(etcd, cluster, id, &args)
    }

    /// What `kvmesh cluster status` prints for `cluster`; panics when it fails.
    pub fn cluster_status(&self, etcd: &Etcd, cluster: &str) -> String {
        let out = self
            .command()
            .args(["cluster", "status", "--etcd", &etcd.url()])
            .args(["--cluster", cluster])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn start(&self, mut cmd: Command, ready: Ready, what: &str) -> Proc {
        let stderr = if self.logs {
            Stdio::inherit()
        } else {
            Stdio::null()
        };
        let niceness = self.niceness;
        if niceness != 0 {
            use std::os::unix::process::CommandExt;
            // SAFETY: only setpriority (a system call, async-signal-safe) runs between fork
            // and exec, and it touches no memory of the parent's.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setpriority(libc::PRIO_PROCESS, 0, niceness) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.bin.display()));
        let http = wait_ready(&mut child, ready, what);
        Proc { child, http }
    }
}

/// A running `kvmesh` process and its HTTP address; killed on drop.
pub struct Proc {
    pub child: Child,
    /// `http://host:port`: the OpenAI API of `serve` and of a gateway; a worker's status.
    pub http: String,
}

impl Proc {
    /// Sends a signal (STOP, CONT, TERM, KILL) to the process.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill -{sig} failed");
    }

    /// SIGKILL, and the exit reaped.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and waits for the process to end.
    pub fn terminate(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }

    /// This process's `/metrics`, as text.
    pub async fn metrics(&self, http: &reqwest::Client) -> String {
        http.get(format!("{}/metrics", self.http))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text")
    }

    /// A metric's value on this process's /metrics: the first series of that name carrying
    /// the labels `series` gives, whatever others it has (`name`, `name{` for a series with
    /// labels, or `name{a="x",b="y"}`).
    pub async fn metric(&self, http: &reqwest::Client, series: &str) -> f64 {
        let text = self.metrics(http).await;
        value_of(&text, series).unwrap_or_else(|| panic!("no {series} in:\n{text}"))
    }

    /// [`Proc::metric`], or `None` while the series does not exist yet (a router's pool
    /// series appear once it has seen the pool's first worker): for waits.
    pub async fn try_metric(&self, http: &reqwest::Client, series: &str) -> Option<f64> {
        value_of(&self.metrics(http).await, series)
    }
}

fn value_of(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| series_matches(l, series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Whether the exposition `line` is a sample of `series`: the same name, and every label
/// pair `series` names among its own.
fn series_matches(line: &str, series: &str) -> bool {
    if line.starts_with('#') {
        return false;
    }
    let (name, wanted) = match series.split_once('{') {
        Some((n, rest)) => (n, Some(rest.trim_end_matches('}'))),
        None => (series, None),
    };
    let Some(rest) = line.strip_prefix(name) else {
        return false;
    };
    match wanted {
        None => rest.starts_with([' ', '{']),
        Some(wanted) => {
            let Some(labels) = rest.strip_prefix('{').and_then(|r| r.split_once('}')) else {
                return false;
            };
            let have: Vec<&str> = split_labels(labels.0);
            split_labels(wanted).iter().all(|w| have.contains(w))
        }
    }
}

/// `a="x",b="y,z"` as `a="x"`, `b="y,z"` (commas inside quoted values kept).
fn split_labels(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < s.len() {
        out.push(&s[start..]);
    }
    out
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The line on stdout by which a starting process says it serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ready {
    /// `kvmesh listening on URL`: `kvmesh serve`, or a gateway.
    Listening,
    /// `kvmesh node ID ready: quic ADDR http URL`: any node, once all its roles run.
    Node,
}

impl Ready {
    /// The HTTP address in `line` when it is the awaited one.
    fn address(self, line: &str) -> Option<String> {
        match self {
            Ready::Listening => line.strip_prefix("kvmesh listening on ").map(String::from),
            Ready::Node => line
                .split(" ready: ")
                .nth(1)
                .map(|rest| rest.split(" http ").nth(1).unwrap_or("").to_string()),
        }
    }

    fn awaited(self) -> &'static str {
        match self {
            Ready::Listening => "start listening",
            Ready::Node => "become ready",
        }
    }
}

/// Waits (a minute at most) for `child`, started with its stdout piped, to say it serves,
/// and returns its HTTP address. Kills it and panics, naming it `what`, when it does not.
pub fn wait_ready(child: &mut Child, ready: Ready, what: &str) -> String {
    let stdout = child.stdout.take().expect("the child's stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    // The reader keeps draining stdout after the line, so the child never blocks on it.
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(url) = ready.address(&line) {
                let _ = tx.send(url);
            }
        }
    });
    rx.recv_timeout(START_TIMEOUT).unwrap_or_else(|_| {
        let _ = child.kill();
        let _ = child.wait();
        panic!("{what} did not {}", ready.awaited());
    })
}

#[cfg(test)]
mod tests {
    use super::series_matches;

    #[test]
    fn a_series_is_found_by_its_name_and_any_of_its_labels() {
        let line = "kvmesh:disagg_decisions_total{model_name=\"m,1\",reason=\"remote\"} 3";
        assert!(series_matches(line, "kvmesh:disagg_decisions_total"));
        assert!(series_matches(line, "kvmesh:disagg_decisions_total{"));
        assert!(series_matches(
            line,
            "kvmesh:disagg_decisions_total{reason=\"remote\"}"
        ));
        assert!(series_matches(
            line,
            "kvmesh:disagg_decisions_total{reason=\"remote\",model_name=\"m,1\"}"
        ));
        assert!(!series_matches(
            line,
            "kvmesh:disagg_decisions_total{reason=\"short\"}"
        ));
        assert!(!series_matches(line, "kvmesh:disagg_decisions"));
        assert!(!series_matches("kvmesh:a_total 1", "kvmesh:a{"));
        assert!(series_matches("kvmesh:a_total 1", "kvmesh:a_total"));
        assert!(!series_matches(
            "# TYPE kvmesh:a_total counter",
            "kvmesh:a_total"
        ));
    }
}
