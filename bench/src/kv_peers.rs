//! Reference figures for the KV transfer benchmark, measured in the same run on the same
//! machine as kvmesh's own rows: other projects' transfer tools moving the same block sizes
//! over loopback, and the CPU time each one spends per gigabyte moved.
//!
//! - [`ucx_perftest_put`]: UCX's `ucx_perftest` (Debian's `ucx-utils`), `ucp_put_bw` between
//!   a server and a client process, over whichever UCX transports `UCX_TLS` names (`tcp`,
//!   `sm`, `posix,cma`, ...).
//! - [`mooncake_tcp`]: Mooncake's `transfer_engine_bench` over its TCP transport, from the PyPI
//!   wheel `mooncake-transfer-engine-non-cuda`, which is installed once into a venv under
//!   `target/` ([`mooncake_venv`]).
//! - [`CpuClock`]: CPU seconds (user + system) of this process and of the child processes it
//!   has reaped, so the bench can put CPU seconds per GB beside every transport's throughput.
//!
//! The tools run as child processes of this one; each call waits for them with a time bound,
//! reaps them with `wait4` (which gives each one's own CPU time) and kills whatever is left
//! on every path out, errors included. Nothing here panics on a tool's failure: every way a
//! tool can fail to run comes back as an `Err` whose text says why, for the bench to print as
//! "not run: <why>".
//!
//! Gigabytes are 10^9 bytes throughout (`ucx_perftest` reports MB/s in units of 2^20 bytes;
//! [`ucx_perftest_put`] converts).

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

/// One reference row: a peer tool moving blocks of `bytes` over loopback.
#[derive(Clone, Debug, Serialize)]
pub struct PeerRow {
    /// What ran, e.g. `ucx_perftest ucp_put_bw (UCX_TLS=tcp)`.
    pub name: String,
    /// The size of each transfer (message, block).
    pub bytes: usize,
    /// Throughput as the tool measured it, in GB/s (10^9 bytes).
    pub gb_per_s: f64,
    /// CPU seconds (user + system) of all the tool's processes, both ends, start-up
    /// included, per GB moved; `None` where it could not be told.
    pub cpu_s_per_gb: Option<f64>,
    /// How it ran: parameters, iterations, bytes moved, wall and CPU time of each process.
    pub detail: String,
}

/// CPU time spent since [`CpuClock::start`]: this process's (every thread's) and its reaped
/// children's, user and system together.
///
/// Children count once they have been waited for (the peers in this module are); a child
/// still running when the clock is read does not count yet.
#[derive(Clone, Copy, Debug)]
pub struct CpuClock {
    own: f64,
    children: f64,
}

impl CpuClock {
    /// Starts counting now.
    pub fn start() -> CpuClock {
        CpuClock {
            own: rusage_seconds(libc::RUSAGE_SELF),
            children: rusage_seconds(libc::RUSAGE_CHILDREN),
        }
    }

    /// CPU seconds of this process and its reaped children since [`CpuClock::start`].
    pub fn elapsed_cpu(&self) -> f64 {
        self.elapsed_own() + self.elapsed_children()
    }

    /// CPU seconds of this process alone (all its threads) since [`CpuClock::start`].
    pub fn elapsed_own(&self) -> f64 {
        (rusage_seconds(libc::RUSAGE_SELF) - self.own).max(0.0)
    }

    /// CPU seconds of the children reaped since [`CpuClock::start`].
    pub fn elapsed_children(&self) -> f64 {
        (rusage_seconds(libc::RUSAGE_CHILDREN) - self.children).max(0.0)
    }
}

/// User + system seconds of `who` (`RUSAGE_SELF` or `RUSAGE_CHILDREN`).
fn rusage_seconds(who: libc::c_int) -> f64 {
    // SAFETY: an all-zero rusage is a valid value; getrusage writes into it and nothing else.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage for the call's duration.
    if unsafe { libc::getrusage(who, &mut ru) } != 0 {
        return 0.0;
    }
    cpu_seconds(&ru)
}

fn cpu_seconds(ru: &libc::rusage) -> f64 {
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// How long one peer measurement may take, start-up and clean-up included (the Mooncake
/// venv's one-time installation has its own bound, [`INSTALL_TIMEOUT`]).
const RUN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long installing the Mooncake wheel into its venv may take.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(600);

// ---------------------------------------------------------------------------------------
// Child processes: spawned with their output collected, reaped with their CPU time.

/// How a child process ended.
#[derive(Clone, Copy, Debug)]
struct Exit {
    /// Its exit code, or `None` when a signal ended it.
    code: Option<i32>,
    /// User + system seconds it (and the children it reaped) used.
    cpu_s: f64,
}

impl Exit {
    fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// A child process whose stdout and stderr are collected as it runs. It is reaped here
/// with `wait4` (never through `std::process::Child`), and killed and reaped on drop if it
/// is still running, so that no error path leaves one behind.
struct Proc {
    pid: libc::pid_t,
    what: String,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
    exit: Option<Exit>,
}

impl Proc {
    /// Starts `cmd` with stdin closed and stdout and stderr collected; `what` names it in
    /// errors.
    fn spawn(mut cmd: Command, what: &str) -> std::io::Result<Proc> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn()?;
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            readers.push(collect(out, stdout.clone()));
        }
        if let Some(err) = child.stderr.take() {
            readers.push(collect(err, stderr.clone()));
        }
        Ok(Proc {
            pid: child.id() as libc::pid_t,
            what: what.to_string(),
            stdout,
            stderr,
            readers,
            exit: None,
        })
    }

    /// Reaps the process if it has ended, without blocking.
    fn try_reap(&mut self) -> Option<Exit> {
        if self.exit.is_none() {
            self.exit = wait4(self.pid, libc::WNOHANG);
            if self.exit.is_some() {
                self.join_readers();
            }
        }
        self.exit
    }

    /// Waits until the process ends or `deadline` passes (then kills it); `None` when it had
    /// to be killed.
    fn wait_until(&mut self, deadline: Instant) -> Option<Exit> {
        loop {
            if let Some(e) = self.try_reap() {
                return Some(e);
            }
            if Instant::now() >= deadline {
                self.kill();
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Kills the process (if it still runs) and reaps it.
    fn kill(&mut self) -> Exit {
        if let Some(e) = self.exit {
            return e;
        }
        // SAFETY: kill(2) on our own child, not yet reaped, so its pid is still ours.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        let e = wait4(self.pid, 0).unwrap_or(Exit {
            code: None,
            cpu_s: 0.0,
        });
        self.exit = Some(e);
        self.join_readers();
        e
    }

    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Its stdout, then its stderr.
    fn output(&self) -> String {
        format!("{}{}", self.stdout(), self.stderr())
    }

    /// The last lines of its output, for an error message.
    fn tail(&self) -> String {
        tail_lines(&self.output(), 6)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Appends everything `from` yields to `into`, on a thread of its own.
fn collect(mut from: impl Read + Send + 'static, into: Arc<Mutex<String>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => into
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
    })
}

/// `wait4` on `pid` with `flags`: how it ended, or `None` if it has not (with `WNOHANG`) or
/// cannot be waited for.
fn wait4(pid: libc::pid_t, flags: libc::c_int) -> Option<Exit> {
    let mut status: libc::c_int = 0;
    // SAFETY: as in `rusage_seconds`.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `status` and `ru` are valid and writable for the call; `pid` is our child.
        let r = unsafe { libc::wait4(pid, &mut status, flags, &mut ru) };
        if r == pid {
            let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
            return Some(Exit {
                code,
                cpu_s: cpu_seconds(&ru),
            });
        }
        if r == -1 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return None;
    }
}

/// A port free on loopback right now (bound, then let go).
fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free loopback port: {e}"))
}

fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// `n` bytes as a short size: 64 KiB, 1 MiB, 1000 B.
fn size(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

// ---------------------------------------------------------------------------------------
// ucx_perftest

/// The figures of `ucx_perftest`'s final line (`-v -f`: CSV, final numbers only).
#[derive(Clone, Copy, Debug, PartialEq)]
struct PerftestFinal {
    iterations: u64,
    /// `overall_lat`: microseconds per message over the whole run.
    overall_lat_us: f64,
    /// `overall_bw`: MB/s, with MB = 2^20 bytes.
    overall_bw_mib: f64,
}

impl PerftestFinal {
    fn gb_per_s(&self) -> f64 {
        self.overall_bw_mib * (1u64 << 20) as f64 / 1e9
    }
}

/// Parses `ucx_perftest -v` output: a CSV header naming the columns
/// (`iterations,...,overall_lat,...,overall_bw,...`), progress lines prefixed
/// `[thread N]` (absent with `-f`), and the final line last.
fn parse_perftest(out: &str) -> Result<PerftestFinal, String> {
    let mut header: Option<Vec<&str>> = None;
    let mut last: Option<Vec<&str>> = None;
    for line in out.lines() {
        let line = line.trim();
        if line.starts_with("iterations,") {
            header = Some(line.split(',').map(str::trim).collect());
            last = None;
        } else if header.is_some() && !line.starts_with('[') {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            if fields.len() == header.as_ref().map_or(0, |h| h.len())
                && fields[0].parse::<u64>().is_ok()
            {
                last = Some(fields);
            }
        }
    }
    let header = header.ok_or("ucx_perftest printed no CSV header (iterations,...)")?;
    let last = last.ok_or("ucx_perftest printed no final line")?;
    let col = |name: &str| -> Result<f64, String> {
        let i = header
            .iter()
            .position(|h| *h == name)
            .ok_or_else(|| format!("ucx_perftest's CSV has no {name} column"))?;
        last[i]
            .parse::<f64>()
            .map_err(|_| format!("ucx_perftest's {name} is not a number: {}", last[i]))
    };
    Ok(PerftestFinal {
        iterations: col("iterations")? as u64,
        overall_lat_us: col("overall_lat")?,
        overall_bw_mib: col("overall_bw")?,
    })
}

/// `ucx_perftest`'s line for a client that found no server listening yet (UCX logs to
/// stdout).
fn perftest_refused(output: &str) -> bool {
    output.contains("Connection refused") || output.contains("connect() failed")
}

/// UCX's own put bandwidth between two processes on loopback: `ucx_perftest` as a server
/// and as a client (`127.0.0.1`, a free port), test `ucp_put_bw`, `iters` messages of
/// `bytes` (plus a tenth as many warm-up messages, as `ucx_perftest` does by default), both
/// with `UCX_TLS=<tls>` (`tcp`, which also gets `UCX_NET_DEVICES=lo`; `sm`; `posix,cma`;
/// ...).
///
/// `gb_per_s` is the tool's final overall bandwidth (its MB/s are 2^20 bytes; converted to
/// 10^9). `cpu_s_per_gb` is both processes' CPU time, start-up and warm-up included, over
/// every byte they put (warm-up included). Both processes busy-poll, so on a 2-core machine
/// that is about two cores for the whole run, whatever the transport.
///
/// Caveat: `ucx_perftest` puts the same buffer to the same remote buffer every time, so a
/// message that fits the last-level cache (both ends' buffers together) is a cache-to-cache
/// copy under shared memory: far above what memory bandwidth allows for data that does not
/// stay in cache, and not comparable to a transfer of a whole KV prompt.
///
/// Takes about `iters * bytes` over the bandwidth, plus a few tenths of a second; bounded by
/// 60 s in all. Pick `iters` so that a run moves a few GB. On 2 cores, over `tcp` it makes
/// 0.5 to 0.8 GB/s at 64 KiB and 1 MiB but only 0.12 to 0.18 GB/s at 8 MiB (its client then
/// spends a whole core), so 2 GB there takes up to 16 s; shared memory makes 4 to 20 GB/s.
pub fn ucx_perftest_put(tls: &str, bytes: usize, iters: usize) -> Result<PeerRow, String> {
    if bytes == 0 || iters == 0 {
        return Err("ucx_perftest: bytes and iters must be positive".into());
    }
    let deadline = Instant::now() + RUN_TIMEOUT;
    let port = free_port()?;
    let warmup = (iters / 10).max(1);
    let command = || {
        let mut c = Command::new("ucx_perftest");
        c.env("UCX_TLS", tls)
            .env("UCX_WARN_UNUSED_ENV_VARS", "n")
            .args(["-p", &port.to_string()]);
        if tls.split(',').any(|t| t.trim() == "tcp") {
            c.env("UCX_NET_DEVICES", "lo");
        }
        c
    };
    let spawn_err = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::NotFound {
            "ucx_perftest not found: install Debian's ucx-utils (apt-get install ucx-utils)"
                .to_string()
        } else {
            format!("ucx_perftest did not start: {e}")
        }
    };
    let wall = Instant::now();
    let mut server = Proc::spawn(command(), "ucx_perftest server").map_err(spawn_err)?;
    // The server is ready once it listens; until then a client's connect() is refused and
    // it exits at once, so the client is simply tried again.
    let mut tries = 0;
    let (client, exit) = loop {
        tries += 1;
        let mut c = command();
        c.args(["127.0.0.1", "-t", "ucp_put_bw", "-v", "-f"])
            .args(["-s", &bytes.to_string()])
            .args(["-n", &iters.to_string()])
            .args(["-w", &warmup.to_string()]);
        let mut client = Proc::spawn(c, "ucx_perftest client").map_err(spawn_err)?;
        let exit = client.wait_until(deadline);
        match exit {
            Some(e) if !e.success() && perftest_refused(&client.output()) && tries < 100 => {
                if let Some(s) = server.try_reap() {
                    return Err(format!(
                        "ucx_perftest server (UCX_TLS={tls}) exited ({:?}) before a client \
                         could connect: {}",
                        s.code,
                        server.tail()
                    ));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            _ => break (client, exit),
        }
    };
    // The server ends by itself after one test; give it a moment, then stop it.
    let server_exit = server
        .wait_until(Instant::now() + Duration::from_secs(3))
        .unwrap_or_else(|| server.kill());
    let wall_s = wall.elapsed().as_secs_f64();
    let client_exit = match exit {
        None => {
            return Err(format!(
                "ucx_perftest (UCX_TLS={tls}, {} x {iters}) did not finish within {} s: {}",
                size(bytes),
                RUN_TIMEOUT.as_secs(),
                client.tail()
            ))
        }
        Some(e) if !e.success() => {
            return Err(format!(
                "ucx_perftest client (UCX_TLS={tls}) failed ({}): {}",
                e.code
                    .map_or("killed by a signal".to_string(), |c| format!("exit {c}")),
                client.tail()
            ))
        }
        Some(e) => e,
    };
    let fin = parse_perftest(&client.stdout()).map_err(|e| format!("{e}: {}", client.tail()))?;
    let moved = bytes as f64 * (iters + warmup) as f64;
    let cpu = client_exit.cpu_s + server_exit.cpu_s;
    Ok(PeerRow {
        name: format!("ucx_perftest ucp_put_bw (UCX_TLS={tls})"),
        bytes,
        gb_per_s: fin.gb_per_s(),
        cpu_s_per_gb: Some(cpu / (moved / 1e9)),
        detail: format!(
            "{} puts of {} (+{warmup} warm-up), {:.1} us each; {:.2} s wall; CPU s: client {:.2}, \
             server {:.2}",
            fin.iterations,
            size(bytes),
            fin.overall_lat_us,
            wall_s,
            client_exit.cpu_s,
            server_exit.cpu_s
        ),
    })
}

// ---------------------------------------------------------------------------------------
// Mooncake

/// The PyPI package Mooncake's transfer engine comes from, without CUDA.
pub const MOONCAKE_PACKAGE: &str = "mooncake-transfer-engine-non-cuda";
/// The version of [`MOONCAKE_PACKAGE`] installed and measured.
pub const MOONCAKE_VERSION: &str = "0.3.13.post1";

/// How long `transfer_engine_bench` runs its transfers (it runs for a time, not an amount).
const MOONCAKE_SECONDS: u32 = 2;

/// The venv Mooncake's wheel is installed into: `$KVMESH_MOONCAKE_VENV`, or
/// `target/mooncake-venv` in this workspace.
pub fn mooncake_venv() -> PathBuf {
    std::env::var_os("KVMESH_MOONCAKE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .unwrap_or(Path::new("."))
                .join("target/mooncake-venv")
        })
}

/// Runs `cmd` to the end (bounded by `timeout`) and returns its stdout, or an error naming
/// `what` with the end of its output.
fn run_to_end(cmd: Command, what: &str, timeout: Duration) -> Result<String, String> {
    let mut p = Proc::spawn(cmd, what).map_err(|e| format!("{what} did not start: {e}"))?;
    match p.wait_until(Instant::now() + timeout) {
        Some(e) if e.success() => Ok(p.stdout()),
        Some(e) => Err(format!(
            "{} failed ({}): {}",
            p.what,
            e.code.map_or("signal".into(), |c| format!("exit {c}")),
            p.tail()
        )),
        None => Err(format!(
            "{} did not finish within {} s: {}",
            p.what,
            timeout.as_secs(),
            p.tail()
        )),
    }
}

/// The `transfer_engine_bench` binary in the installed wheel, if the venv has the wanted
/// version (asked without importing the package, whose `__init__` loads its libraries).
fn installed_mooncake_bench(python: &Path) -> Option<PathBuf> {
    if !python.exists() {
        return None;
    }
    let script = format!(
        "import importlib.metadata as m, importlib.util as u\n\
         print(m.version('{MOONCAKE_PACKAGE}'))\n\
         print(u.find_spec('mooncake').submodule_search_locations[0])\n"
    );
    let mut c = Command::new(python);
    c.args(["-c", &script]);
    let out = run_to_end(c, "python", Duration::from_secs(30)).ok()?;
    let mut lines = out.lines();
    if lines.next()?.trim() != MOONCAKE_VERSION {
        return None;
    }
    let bin = Path::new(lines.next()?.trim()).join("transfer_engine_bench");
    bin.is_file().then_some(bin)
}

/// Mooncake's `transfer_engine_bench`, installing the wheel ([`MOONCAKE_PACKAGE`] at
/// [`MOONCAKE_VERSION`], without its Python dependencies: only the binary is used) into
/// [`mooncake_venv`] the first time, under a lock file beside it so that concurrent runs
/// install once.
pub fn mooncake_bench_binary() -> Result<PathBuf, String> {
    let venv = mooncake_venv();
    let python = venv.join("bin/python");
    if let Some(dir) = venv.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let lock_path = venv.with_extension("lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| format!("cannot open {}: {e}", lock_path.display()))?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor we own; released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(format!(
            "cannot lock {}: {}",
            lock_path.display(),
            std::io::Error::last_os_error()
        ));
    }
    let bin = match installed_mooncake_bench(&python) {
        Some(bin) => bin,
        None => {
            let deadline = Instant::now() + INSTALL_TIMEOUT;
            if !python.exists() {
                let mut c = Command::new("python3");
                c.args(["-m", "venv"]).arg(&venv);
                run_to_end(c, "python3 -m venv", INSTALL_TIMEOUT).map_err(|e| {
                    format!("cannot make a venv for Mooncake at {}: {e}", venv.display())
                })?;
            }
            let mut c = Command::new(&python);
            c.args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg("--no-deps")
            .arg(format!("{MOONCAKE_PACKAGE}=={MOONCAKE_VERSION}"));
            run_to_end(
                c,
                "pip install",
                deadline.saturating_duration_since(Instant::now()),
            )
            .map_err(|e| {
                format!(
                    "cannot install {MOONCAKE_PACKAGE}=={MOONCAKE_VERSION} from PyPI into {} \
                     (its wheels are for CPython 3.10 to 3.13 on x86_64/aarch64 Linux): {e}",
                    venv.display()
                )
            })?;
            installed_mooncake_bench(&python).ok_or_else(|| {
                format!(
                    "{MOONCAKE_PACKAGE}=={MOONCAKE_VERSION} installed into {} but its \
                     mooncake/transfer_engine_bench binary is not there",
                    venv.display()
                )
            })?
        }
    };
    // The wheel may ship it without its execute bits (its own wrapper sets them too).
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(&bin) {
        let mode = meta.permissions().mode();
        if mode & 0o111 != 0o111 {
            let _ = std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(mode | 0o111));
        }
    }
    Ok(bin)
}

/// What `transfer_engine_bench`'s initiator reports at the end: `Test completed: duration
/// 2.03, batch count 116, throughput 0.48 GB/s`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct MooncakeResult {
    duration_s: f64,
    batches: u64,
    /// Its own figure, in GB/s (10^9 bytes), rounded to two decimals.
    reported_gb_per_s: f64,
}

fn parse_mooncake(log: &str) -> Result<MooncakeResult, String> {
    let line = log
        .lines()
        .rev()
        .find_map(|l| l.split_once("Test completed:").map(|(_, r)| r))
        .ok_or("transfer_engine_bench printed no 'Test completed' line")?;
    let field = |name: &str| -> Result<&str, String> {
        line.split(',')
            .map(str::trim)
            .find_map(|f| f.strip_prefix(name))
            .map(str::trim)
            .ok_or_else(|| format!("transfer_engine_bench's result has no {name}: {line}"))
    };
    let num = |name: &str, s: &str| -> Result<f64, String> {
        s.parse::<f64>()
            .map_err(|_| format!("transfer_engine_bench's {name} is not a number: {line}"))
    };
    let duration_s = num("duration", field("duration")?)?;
    let batches = num("batch count", field("batch count")?)? as u64;
    let tp = field("throughput")?;
    let reported_gb_per_s = match tp.split_whitespace().collect::<Vec<_>>()[..] {
        [v, "GB/s"] => num("throughput", v)?,
        _ => {
            return Err(format!(
                "transfer_engine_bench's throughput is not in GB/s: {line}"
            ))
        }
    };
    Ok(MooncakeResult {
        duration_s,
        batches,
        reported_gb_per_s,
    })
}

/// The address a P2P-handshake engine's RPC listens on, from its log line `Transfer Engine
/// RPC using P2P handshake, listening on 127.0.0.1:16932`: that is its segment's name.
fn parse_p2p_segment(log: &str) -> Option<String> {
    log.lines()
        .find_map(|l| l.split_once("P2P handshake, listening on ").map(|(_, r)| r))
        .and_then(|r| r.split_whitespace().next())
        .map(str::to_string)
}

/// A loader failure: the binary needs system libraries the wheel does not ship.
fn missing_library(log: &str) -> Option<String> {
    let l = log
        .lines()
        .find(|l| l.contains("error while loading shared libraries"))?;
    let lib = l
        .split("shared libraries:")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .unwrap_or("?")
        .trim()
        .to_string();
    Some(format!(
        "Mooncake's transfer_engine_bench cannot load {lib}: it needs Debian's libibverbs1, \
         libnuma1 and libcurl4 (apt-get install libibverbs1 libnuma1 libcurl4)"
    ))
}

/// Mooncake's transfer engine over its TCP transport on loopback: `transfer_engine_bench`
/// from the PyPI wheel (installed on first use, see [`mooncake_bench_binary`]) as a target
/// and an initiator, metadata exchanged by P2P handshake (no etcd), one submitting thread
/// writing batches of blocks of `bytes` into the target, each batch covering `total_bytes`
/// (so both ends register a buffer of `total_bytes` rounded down to whole blocks, at least
/// one block), for 2 s.
///
/// `gb_per_s` is the bytes the initiator saw completed over its measured duration (the
/// tool's own figure is printed with two decimals; this one is recomputed from its batch
/// count). `cpu_s_per_gb` is both processes' CPU time, start-up included, over the bytes
/// moved. The initiator's submitting thread polls its batch's completion in a busy loop, so
/// one core is spent on that whatever the throughput.
///
/// The tool runs for a time rather than an amount: a call takes about 3.5 s, plus the
/// one-time installation (a 46 MB wheel; some seconds on a fast link). Bounded by 60 s, the
/// installation by 10 minutes.
///
/// About the tool (wheel 0.3.13.post1 on x86_64, CPython 3.11): the wheel
/// ships the binary itself (`mooncake/transfer_engine_bench`; the `transfer_engine_bench`
/// console script only wraps it) with its own glog, gflags, jsoncpp, yaml-cpp, asio and etcd
/// client, but links the system's libibverbs.so.1, libnuma.so.1 and libcurl.so.4. Its
/// `--metadata_server` and `--segment_id` default to 192.168.x addresses, so both are always
/// given here. With `--metadata_server=P2PHANDSHAKE` each engine listens on a random RPC
/// port (on all interfaces; the port in `--local_server_name` is not used) and names its
/// segment after it, so the target's name is read from its log. With its defaults (12
/// threads, batches of 128) on 2 cores it loses half its throughput to contention; one
/// thread writing is its best here.
pub fn mooncake_tcp(bytes: usize, total_bytes: usize) -> Result<PeerRow, String> {
    if bytes == 0 {
        return Err("mooncake: bytes must be positive".into());
    }
    let bin = mooncake_bench_binary()?;
    let deadline = Instant::now() + RUN_TIMEOUT;
    let batch = (total_bytes / bytes).max(1);
    let buffer = batch * bytes;
    let common = |port: u16| {
        let mut c = Command::new(&bin);
        c.arg("--metadata_server=P2PHANDSHAKE")
            .arg(format!("--local_server_name=127.0.0.1:{port}"))
            .arg("--protocol=tcp")
            .arg("--logtostderr")
            .arg("--threads=1")
            .arg(format!("--block_size={bytes}"))
            .arg(format!("--batch_size={batch}"))
            .arg(format!("--buffer_size={buffer}"));
        c
    };
    let failed = |p: &Proc, what: &str| -> String {
        missing_library(&p.output()).unwrap_or_else(|| format!("{what}: {}", p.tail()))
    };
    let wall = Instant::now();
    let mut target = {
        let mut c = common(free_port()?);
        c.arg("--mode=target");
        Proc::spawn(c, "transfer_engine_bench target")
            .map_err(|e| format!("Mooncake's {} did not start: {e}", bin.display()))?
    };
    let segment = loop {
        if let Some(s) = parse_p2p_segment(&target.stderr()) {
            break s;
        }
        if target.try_reap().is_some() {
            return Err(failed(&target, "Mooncake's target exited at start"));
        }
        if Instant::now() >= deadline {
            return Err(failed(
                &target,
                "Mooncake's target never said where it listens",
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // It registers its buffer just after it starts listening.
    std::thread::sleep(Duration::from_millis(300));
    let mut c = common(free_port()?);
    c.arg("--mode=initiator")
        .arg(format!("--segment_id={segment}"))
        .arg("--operation=write")
        .arg(format!("--duration={MOONCAKE_SECONDS}"));
    let mut initiator = Proc::spawn(c, "transfer_engine_bench initiator")
        .map_err(|e| format!("Mooncake's initiator did not start: {e}"))?;
    let exit = initiator.wait_until(deadline);
    // The target only waits (checking a flag once a second on SIGTERM); it holds nothing
    // that outlives it, so it is killed outright.
    let target_exit = target.kill();
    let wall_s = wall.elapsed().as_secs_f64();
    let init_exit = match exit {
        Some(e) if e.success() => e,
        Some(_) => return Err(failed(&initiator, "Mooncake's initiator failed")),
        None => {
            return Err(failed(
                &initiator,
                &format!(
                    "Mooncake's initiator did not finish within {} s",
                    RUN_TIMEOUT.as_secs()
                ),
            ))
        }
    };
    let r = parse_mooncake(&initiator.stderr())?;
    let moved = r.batches as f64 * buffer as f64;
    let gb_per_s = moved / r.duration_s / 1e9;
    let cpu = init_exit.cpu_s + target_exit.cpu_s;
    Ok(PeerRow {
        name: "mooncake transfer engine (tcp)".into(),
        bytes,
        gb_per_s,
        cpu_s_per_gb: (moved > 0.0).then(|| cpu / (moved / 1e9)),
        detail: format!(
            "transfer_engine_bench {MOONCAKE_VERSION}, P2P handshake, 1 thread writing batches \
             of {batch} x {}; {} batches ({:.2} GB) in {:.2} s (it reports {:.2} GB/s); \
             {wall_s:.2} s wall; CPU s: initiator {:.2}, target {:.2}",
            size(bytes),
            r.batches,
            moved / 1e9,
            r.duration_s,
            r.reported_gb_per_s,
            init_exit.cpu_s,
            target_exit.cpu_s
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ucx_perftest -t ucp_put_bw -s 1048576 -n 3000 -v` over tcp (without `-f`: progress
    /// lines first).
    const PERFTEST_PROGRESS: &str = "\
iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
[thread 0] 725,0.190,1379.615,1379.615,724.84,724.84,725,725
[thread 0]1448,0.191,1387.804,1383.704,720.56,722.70,721,723
[thread 0]2086,0.221,1617.774,1455.294,618.13,687.15,618,687
[thread 0]2772,0.571,1497.063,1465.631,667.97,682.30,668,682
3000,1.033,6434.772,1843.285,155.41,542.51,155,543
";

    /// The same with `-f`, as [`ucx_perftest_put`] runs it.
    const PERFTEST_FINAL: &str = "\
iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
3000,1332.141,6998.986,1841.972,142.88,542.90,143,543
";

    #[test]
    fn perftest_final_line_and_units() {
        let f = parse_perftest(PERFTEST_FINAL).unwrap();
        assert_eq!(f.iterations, 3000);
        assert_eq!(f.overall_bw_mib, 542.90);
        // MB/s there are 2^20 bytes: 1 MiB per 1841.972 us is 542.9 of them.
        let from_lat = (1u64 << 20) as f64 / (f.overall_lat_us * 1e-6);
        assert!((from_lat / 1e9 - f.gb_per_s()).abs() < 1e-3, "{from_lat}");
        assert!((f.gb_per_s() - 0.5693).abs() < 1e-3);

        let p = parse_perftest(PERFTEST_PROGRESS).unwrap();
        assert_eq!(p.iterations, 3000);
        assert_eq!(p.overall_bw_mib, 542.51);
    }

    #[test]
    fn perftest_without_result() {
        assert!(parse_perftest("").is_err());
        assert!(parse_perftest(
            "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n"
        )
        .is_err());
        let refused = "[1795658873.229875] [vm:10682:0]        perftest.c:405  UCX  ERROR \
                       client failed. connect() failed: Connection refused";
        assert!(perftest_refused(refused));
        assert!(parse_perftest(refused).is_err());
    }

    const MOONCAKE_TARGET: &str = "\
WARNING: Logging before InitGoogleLogging() is written to STDERR
I1126 02:08:31.227114 11171 transfer_engine_impl.cpp:116] Transfer Engine parseHostNameWithPort. server_name: 127.0.0.1 port: 17801
I1126 02:08:31.227191 11171 transfer_engine_impl.cpp:183] Transfer Engine RPC using P2P handshake, listening on 127.0.0.1:16932
E1126 02:08:31.227308 11171 transfer_metadata.cpp:1098] Local segment descriptor not found
I1126 02:08:31.227342 11171 tcp_transport.cpp:391] TcpTransport: listen on port 15359
";

    const MOONCAKE_INITIATOR: &str = "\
I1126 02:08:34.250543 11193 transfer_engine_bench.cpp:440] Worker 0 stopped!
I1126 02:08:34.265527 11184 transfer_engine_bench.cpp:569] Test completed: duration 2.03, batch count 116, throughput 0.48 GB/s
I1126 02:08:34.266345 11184 transfer_metadata.cpp:616] removeSegmentDesc 127.0.0.1:16258 finish
";

    #[test]
    fn mooncake_logs() {
        assert_eq!(
            parse_p2p_segment(MOONCAKE_TARGET).as_deref(),
            Some("127.0.0.1:16932")
        );
        assert_eq!(parse_p2p_segment("nothing yet"), None);
        assert_eq!(
            parse_mooncake(MOONCAKE_INITIATOR).unwrap(),
            MooncakeResult {
                duration_s: 2.03,
                batches: 116,
                reported_gb_per_s: 0.48
            }
        );
        assert!(parse_mooncake(MOONCAKE_TARGET).is_err());
        let loader = "/x/transfer_engine_bench: error while loading shared libraries: \
                      libibverbs.so.1: cannot open shared object file: No such file or directory";
        let why = missing_library(loader).unwrap();
        assert!(
            why.contains("libibverbs.so.1") && why.contains("apt-get"),
            "{why}"
        );
        assert_eq!(missing_library(MOONCAKE_TARGET), None);
    }
}
