//! A throw-away etcd server for tests.
//!
//! ```no_run
//! let mut etcd = kvmesh_discovery::testing::Etcd::start();
//! let endpoints = vec![etcd.url()];
//! // ... EtcdRegistry::connect(&endpoints, "test", 3) ...
//! etcd.kill();    // SIGKILL, like a crash
//! etcd.restart(); // same data dir and ports
//! ```
//!
//! Each server gets its own temporary directory and free ports, and is killed (and its directory
//! removed) when the [`Etcd`] is dropped. Set `KVMESH_KEEP_ETCD_DIR=1` to keep the directory
//! (data and `etcd.log`) for a post-mortem.
//!
//! The binary is `$ETCD_BIN` if set, else `etcd` on `PATH`, else `/usr/bin/etcd` or
//! `/usr/local/bin/etcd` (Debian's `etcd-server` package; `scripts/test.sh` installs it).
//!
//! The calls block the calling thread (start-up takes about a second); from async tests prefer a
//! multi-threaded runtime so that background tasks keep running meanwhile.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long `start`/`restart` wait for etcd to report itself healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A single-member etcd server on 127.0.0.1, for tests.
pub struct Etcd {
    bin: PathBuf,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// Where the etcd binary is, if anywhere (see the module docs).
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("ETCD_BIN").filter(|b| !b.is_empty()) {
        return Some(PathBuf::from(bin));
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("etcd"));
    let fixed = ["/usr/bin/etcd", "/usr/local/bin/etcd"].map(PathBuf::from);
    on_path.chain(fixed).find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

impl Etcd {
    /// Starts a fresh server and waits until it serves requests. Panics, with etcd's log, if it
    /// cannot be started.
    pub fn start() -> Etcd {
        let bin = etcd_binary().unwrap_or_else(|| {
            panic!(
                "kvmesh_discovery::testing: no `etcd` binary found (looked at $ETCD_BIN, $PATH, \
                 /usr/bin/etcd, /usr/local/bin/etcd). Install it, e.g. `apt-get install etcd-server` \
                 (scripts/test.sh does this), or set ETCD_BIN=/path/to/etcd."
            )
        });
        assert!(
            is_executable(&bin),
            "kvmesh_discovery::testing: {} (from $ETCD_BIN) is not an executable file",
            bin.display()
        );
        let mut etcd = Etcd {
            bin,
            dir: unique_dir(),
            client_port: 0,
            peer_port: 0,
            child: None,
        };
        let mut last_failure = String::new();
        // Free ports are picked by binding to port 0 and closing again, so another process can
        // take one before etcd binds it; try a few times.
        for _ in 0..5 {
            (etcd.client_port, etcd.peer_port) = (free_port(), free_port());
            if etcd.client_port == etcd.peer_port {
                continue;
            }
            match etcd.launch() {
                Ok(()) => return etcd,
                Err(failure) => {
                    last_failure = failure.to_string();
                    etcd.kill();
                    // The data names the failed attempt's peer URL; start over (the log stays).
                    let _ = fs::remove_dir_all(etcd.data_dir());
                }
            }
        }
        panic!(
            "kvmesh_discovery::testing: etcd ({}) did not start: {last_failure}\n--- etcd.log (tail) ---\n{}",
            etcd.bin.display(),
            tail(&etcd.dir.join("etcd.log"))
        );
    }

    /// The client URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// `vec![self.url()]`, the shape `EtcdRegistry::connect` takes.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.url()]
    }

    /// The lease `key` is attached to (0: none), or `None` when there is no such key.
    pub async fn lease_of(&self, key: &str) -> Option<i64> {
        let mut client = etcd_client::Client::connect(self.endpoints(), None)
            .await
            .expect("connect to the test etcd");
        let got = client.get(key, None).await.expect("get from the test etcd");
        got.kvs().first().map(|kv| kv.lease())
    }

    /// The data directory (kept across [`restart`](Self::restart)).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The server's combined stdout/stderr so far, over all restarts.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    /// The process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the server process is running.
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Kills the server with SIGKILL (like a crash) and waits for it to exit. No-op if it is
    /// not running.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill(); // SIGKILL
            let _ = child.wait();
        }
    }

    /// Kills the server if it is running and deletes its data, so that the next
    /// [`restart`](Self::restart) comes up empty (a new cluster on the same ports).
    pub fn wipe(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(self.data_dir());
    }

    /// Kills the server if it is running and starts it again with the same data directory and
    /// ports; waits until it serves requests. Panics, with etcd's log, if it does not come up.
    pub fn restart(&mut self) {
        self.kill();
        if let Err(failure) = self.launch() {
            panic!(
                "kvmesh_discovery::testing: etcd did not restart at {}: {failure}\n--- etcd.log (tail) ---\n{}",
                self.url(),
                tail(&self.dir.join("etcd.log"))
            );
        }
    }

    fn launch(&mut self) -> Result<(), LaunchError> {
        let log_path = self.dir.join("etcd.log");
        let mut log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| LaunchError::Io {
                what: format!("cannot open {}", log_path.display()),
                source,
            })?;
        let _ = writeln!(
            log,
            "=== kvmesh_discovery::testing: starting etcd at {} ===",
            self.url()
        );
        let client_url = self.url();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--name=default")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=default={peer_url}"))
            .arg("--initial-cluster-state=new")
            .arg(format!(
                "--initial-cluster-token=kvmesh-test-{}",
                self.client_port
            ))
            // A single member has no peers to wait for: elect it quickly. This also lowers
            // etcd's minimum lease TTL to 1 s.
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=250")
            .arg("--logger=zap")
            .arg("--log-outputs=stderr")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|source| LaunchError::Io {
                what: "cannot share the log file".into(),
                source,
            })?)
            .stderr(log);
        // ETCD_* variables set flags too and conflict with the ones above; keep only the arch
        // override, which etcd 3.4 needs on arm64 and other non-amd64 machines.
        for (name, _) in std::env::vars_os() {
            if let Some(name) = name.to_str() {
                if name.starts_with("ETCD_") && name != "ETCD_UNSUPPORTED_ARCH" {
                    cmd.env_remove(name);
                }
            }
        }
        if std::env::var_os("ETCD_UNSUPPORTED_ARCH").is_none() {
            if let Some(arch) = go_arch_needing_override() {
                cmd.env("ETCD_UNSUPPORTED_ARCH", arch);
            }
        }
        let child = cmd.spawn().map_err(|source| LaunchError::Io {
            what: format!("cannot run {}", self.bin.display()),
            source,
        })?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), LaunchError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let addr: SocketAddr = ([127, 0, 0, 1], self.client_port).into();
        loop {
            if let Some(child) = &mut self.child {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(LaunchError::Exited(status));
                }
            }
            if health(addr) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(LaunchError::NotHealthy {
                    url: self.url(),
                    after: READY_TIMEOUT,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Why a test etcd did not come up.
#[derive(Debug, thiserror::Error)]
enum LaunchError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("etcd exited with {0}")]
    Exited(std::process::ExitStatus),
    #[error("not healthy at {url} after {after:?}")]
    NotHealthy { url: String, after: Duration },
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        if std::env::var_os("KVMESH_KEEP_ETCD_DIR").is_some() {
            eprintln!("kvmesh_discovery::testing: kept {}", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// `GET /health` on the client port answers `{"health":"true"}` once the member has a leader
/// and serves requests.
fn health(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.starts_with("HTTP/1.1 200") && response.contains(r#""health":"true""#)
}

/// A loopback port free now, for a process a test starts to bind. It is drawn below Linux's
/// default ephemeral range (32768–60999): a port `127.0.0.1:0` hands out comes from that
/// range, where the next outgoing connection of any process on the machine may take it
/// before the started process binds it (a CI run saw a node fail with "Address already in
/// use" so). Below it, only another test drawing the same port could.
pub fn free_port() -> u16 {
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let seed = u64::from(std::process::id())
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    for i in 0..512u64 {
        let n = DRAWS.fetch_add(1, Ordering::Relaxed) + i;
        let mix =
            (seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let port = 20_000 + (mix >> 40) as u16 % 12_000;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("cannot bind a free port on 127.0.0.1")
}

fn unique_dir() -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = std::env::temp_dir();
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = base.join(format!(
            "kvmesh-etcd-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        match fs::create_dir(&dir) {
            Ok(()) => return dir,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => panic!("cannot create {}: {e}", dir.display()),
        }
    }
}

fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// etcd 3.4 refuses to start on architectures other than amd64 and ppc64le unless
/// `ETCD_UNSUPPORTED_ARCH` names the (Go) architecture.
fn go_arch_needing_override() -> Option<&'static str> {
    match std::env::consts::ARCH {
        "x86_64" | "powerpc64" => None,
        "aarch64" => Some("arm64"),
        "x86" => Some("386"),
        "arm" => Some("arm"),
        other => Some(other),
    }
}
