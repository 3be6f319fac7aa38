//! Flags to plan: every refusal and every default, without a process, etcd or a model.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    node: NodeArgs,
}

/// The plan `kvmesh node --etcd http://e:2379 <flags>` gets.
fn plan(flags: &str) -> anyhow::Result<NodePlan> {
    let argv = ["node", "--etcd", "http://e:2379"]
        .into_iter()
        .chain(flags.split_whitespace());
    let cli = Cli::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?;
    NodePlan::from_args(cli.node)
}

fn refused(flags: &str) -> String {
    match plan(flags) {
        Ok(p) => panic!("`{flags}` was planned: {p:?}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn a_node_without_flags_is_one_worker_on_loopback() {
    let p = plan("").unwrap();
    assert_eq!(p.roles, [Role::Worker]);
    assert_eq!(p.engines.generate, Some(Role::Worker));
    assert!(!p.engines.prefill && p.engines.runs_engine());
    assert_eq!(p.engines.extra_replicas, 0);
    assert_eq!(p.engines.args.gpu_memory_utilization, 0.9);
    assert!(p.kv.is_none() && p.router.is_none() && p.gateway.is_none());
    let n = &p.network;
    assert_eq!(n.etcd, ["http://e:2379"]);
    assert_eq!(n.cluster, "default");
    assert_eq!(n.lease_ttl, kvmesh_discovery::DEFAULT_TTL_SECS);
    assert_eq!(n.listen, "127.0.0.1:0".parse::<SocketAddr>().unwrap());
    assert_eq!(n.advertise, None);
    // No gateway: the status listener on the QUIC interface, a free port.
    assert_eq!(n.http_bind, "127.0.0.1:0");
    assert_eq!(p.shutdown_grace, Duration::from_secs(30));
    assert!(!p.fault_injection);
    assert!(p.debug.advertise_fingerprint.is_none() && !p.debug.tamper_card);
    assert!(
        !p.node_id.is_empty(),
        "a node id is made up when none is given"
    );
}

#[test]
fn roles_that_cannot_go_together_are_refused() {
    assert!(refused("--roles gateway").contains("use --roles gateway,router"));
    for roles in ["worker,prefill", "worker,decode", "worker,prefill,decode"] {
        let e = refused(&format!("--roles {roles}"));
        assert!(
            e.contains("a worker prefills and decodes its own requests"),
            "{e}"
        );
    }
    assert!(refused("--roles cook").contains("in --roles"));
}

#[test]
fn a_gateway_node_plans_its_router_and_http_address() {
    let p = plan(
        "--roles gateway,router --port 9000 --host 127.0.0.2 --policy prefix \
         --disagg-min-tokens 33 --disagg-max-queue 5 --migration-limit 0 \
         --prefix-max-imbalance 2.5 --tool-call-parser hermes --cache-dir /tmp/cards",
    )
    .unwrap();
    assert!(!p.engines.runs_engine() && p.kv.is_none());
    let r = p.router.as_ref().unwrap();
    assert_eq!(r.policy, Policy::Prefix);
    assert_eq!(r.config.disagg.min_tokens, 33);
    assert_eq!(r.config.disagg.max_queue, 5);
    assert_eq!(r.config.migration_limit, 0);
    assert_eq!(r.config.prefix.max_imbalance, 2.5);
    let g = p.gateway.as_ref().unwrap();
    assert_eq!(g.tool_call_parser, Some(ToolFormat::Hermes));
    assert_eq!(
        g.cache_dir.as_deref(),
        Some(std::path::Path::new("/tmp/cards"))
    );
    assert_eq!(p.network.http_bind, "127.0.0.2:9000");
}

#[test]
fn the_router_defaults_are_the_router_configs() {
    let p = plan("--roles router").unwrap();
    let r = p.router.unwrap();
    let d = RouterConfig::default();
    assert_eq!(r.policy, Policy::LeastLoaded);
    assert_eq!(r.config.disagg.min_tokens, d.disagg.min_tokens);
    assert_eq!(r.config.disagg.max_queue, d.disagg.max_queue);
    assert_eq!(r.config.migration_limit, d.migration_limit);
    assert_eq!(r.config.prefix.max_imbalance, d.prefix.max_imbalance);
    assert!(p.gateway.is_none(), "a router alone serves no API");
    assert!(refused("--prefix-max-imbalance=-1").contains("is not a relative imbalance"));
    let inf = plan("--roles router --prefix-max-imbalance inf").unwrap();
    assert!(inf
        .router
        .unwrap()
        .config
        .prefix
        .max_imbalance
        .is_infinite());
}

#[test]
fn prefill_and_decode_in_one_node_split_the_device_and_plan_kv() {
    let p = plan("--roles prefill,decode --gpu-memory-utilization 0.8").unwrap();
    assert_eq!(p.engines.generate, Some(Role::Decode));
    assert!(p.engines.prefill);
    assert_eq!(p.engines.args.gpu_memory_utilization, 0.4);
    let kv = p.kv.unwrap();
    assert_eq!(kv.ucx, None);
    assert_eq!(kv.tcp_listener, None);
    assert_eq!(kv.streams, kvmesh_actors::worker::KvSide::DEFAULT_STREAMS);
    assert_eq!(
        kv.transfer_timeout,
        kvmesh_actors::worker::KvSide::DEFAULT_TIMEOUT
    );
    assert!(!kv.checksum);
    // One engine keeps the whole share.
    let d = plan("--roles decode --gpu-memory-utilization 0.8").unwrap();
    assert_eq!(d.engines.args.gpu_memory_utilization, 0.8);
    assert!(!d.engines.prefill);
}

#[test]
fn kv_transports_plan_listeners_and_ucx() {
    let tcp = plan("--roles decode --kv-transport tcp --kv-streams 3").unwrap();
    let kv = tcp.kv.unwrap();
    assert_eq!(
        kv.tcp_listener,
        Some(None),
        "a free port beside the QUIC address"
    );
    assert_eq!(kv.streams, 3);
    let at = plan("--roles decode --kv-transport tcp --kv-listen 127.0.0.1:7100").unwrap();
    let want: SocketAddr = "127.0.0.1:7100".parse().unwrap();
    assert_eq!(at.kv.unwrap().tcp_listener, Some(Some(want)));
    // A prefill node dials; it listens for nothing.
    let pre = plan("--roles prefill --kv-transport tcp").unwrap();
    assert_eq!(pre.kv.unwrap().tcp_listener, None);
    let ucx = plan("--roles decode --kv-transport ucx --ucx-tls sm --kv-checksum").unwrap();
    let kv = ucx.kv.unwrap();
    let want = UcxPlan {
        required: true,
        tls: Some("sm".into()),
    };
    assert_eq!(kv.ucx, Some(want));
    assert_eq!(kv.tcp_listener, None);
    assert!(kv.checksum);
    let auto = plan("--roles decode --kv-transport auto")
        .unwrap()
        .kv
        .unwrap();
    assert_eq!(auto.ucx.map(|u| u.required), Some(false));
    assert_eq!(auto.tcp_listener, Some(None), "auto falls back to TCP");
    // Nodes without the two roles move no KV, whatever the transport says.
    assert!(plan("--kv-transport ucx").unwrap().kv.is_none());
}

#[test]
fn transfer_and_lease_limits_are_refused_out_of_range() {
    assert!(refused("--lease-ttl 1").contains("--lease-ttl must be at least 2 seconds"));
    for t in ["0", "-1", "inf", "NaN"] {
        let e = refused(&format!("--kv-transfer-timeout={t}"));
        assert!(
            e.contains("--kv-transfer-timeout must be positive"),
            "{t}: {e}"
        );
    }
    for n in ["0", "17"] {
        let e = refused(&format!("--kv-streams {n}"));
        assert!(
            e.contains("--kv-streams must be between 1 and 16"),
            "{n}: {e}"
        );
    }
    assert!(plan("--kv-streams 16").is_ok());
    assert!(refused("--shutdown-grace inf").contains("--shutdown-grace"));
    // Negative grace is none, as before.
    assert_eq!(
        plan("--shutdown-grace=-3").unwrap().shutdown_grace,
        Duration::ZERO
    );
}

#[test]
fn every_interface_needs_an_advertised_address() {
    let e = refused("--listen 0.0.0.0:7000");
    assert!(
        e.contains("--listen 0.0.0.0:7000 is on every interface"),
        "{e}"
    );
    assert!(e.contains("--advertise-addr"), "{e}");
    let p =
        plan("--listen 0.0.0.0:7000 --advertise-addr 10.1.2.3:7000 --status-port 9100").unwrap();
    assert_eq!(p.network.advertise, Some("10.1.2.3:7000".parse().unwrap()));
    assert_eq!(p.network.http_bind, "0.0.0.0:9100");
    let v6 = plan("--listen [::1]:0 --status-port 9100").unwrap();
    assert_eq!(v6.network.http_bind, "[::1]:9100");
}

#[test]
fn replicas_are_sim_workers_alone() {
    let p = plan("--replicas 4 --backend sim").unwrap();
    assert_eq!(p.engines.extra_replicas, 3);
    assert!(refused("--replicas 0").contains("--replicas must be at least 1"));
    let e = refused("--replicas 2 --backend sim --roles worker,router");
    assert!(
        e.contains("it needs --roles worker alone, not worker,router"),
        "{e}"
    );
    assert!(refused("--replicas 2").contains("--replicas is for scale tests on --backend sim"));
    let e = refused("--replicas 2 --backend sim --debug-advertise-fingerprint ab");
    assert!(
        e.contains("--replicas and --debug-advertise-fingerprint"),
        "{e}"
    );
}

#[test]
fn engine_limits_are_refused_before_the_model_is_read() {
    assert!(refused("--block-size 0").contains("--block-size must be positive"));
    assert!(refused("--max-num-seqs 0").contains("--max-num-seqs must be positive"));
    let e = refused("--roles prefill --max-num-batched-tokens 0");
    assert!(
        e.contains("--max-num-batched-tokens must be positive"),
        "{e}"
    );
    // A router without an engine has no block size to check.
    assert!(plan("--roles router --block-size 0").is_ok());
    let e = refused("--served-model-name \u{7}bell");
    assert!(e.contains("--served-model-name"), "{e}");
}

#[test]
fn declared_capacity_follows_the_backend_until_given() {
    let p = plan("").unwrap();
    assert_eq!(p.engines.declared_capacity("cpu"), 20.0);
    assert_eq!(p.engines.declared_capacity("cuda:0 (H100)"), 100.0);
    let given = plan("--capacity 55").unwrap();
    assert_eq!(given.engines.declared_capacity("cpu"), 55.0);
    let sim =
        plan("--backend sim --sim-decode-ms 10 --sim-decode-us-per-seq 0 --sim-speed 1").unwrap();
    assert!((sim.engines.declared_capacity("sim") - 100.0).abs() < 1e-9);
}

#[test]
fn hidden_test_flags_reach_the_plan() {
    let p = plan("--debug-advertise-fingerprint ab --debug-tamper-card --enable-fault-injection")
        .unwrap();
    assert_eq!(p.debug.advertise_fingerprint.as_deref(), Some("ab"));
    assert!(p.debug.tamper_card && p.fault_injection);
    assert_eq!(plan("--node-id n7").unwrap().node_id, "n7");
}

/// The plan `kvmesh node --no-etcd <flags>` gets.
fn plan_alone(flags: &str) -> anyhow::Result<NodePlan> {
    let argv = ["node", "--no-etcd"]
        .into_iter()
        .chain(flags.split_whitespace());
    let cli = Cli::try_parse_from(argv).map_err(|e| anyhow::anyhow!("{e}"))?;
    NodePlan::from_args(cli.node)
}

#[test]
fn a_node_without_etcd_is_a_whole_cluster_or_refused() {
    let p = plan_alone("--roles gateway,router,prefill,decode").unwrap();
    assert!(p.network.etcd.is_empty(), "no etcd endpoints");
    assert!(p.gateway.is_some() && p.router.is_some() && p.kv.is_some());
    assert!(plan_alone("--roles router,worker").is_ok());
    for roles in [
        "worker",
        "gateway,router",
        "prefill,decode",
        "router,prefill",
    ] {
        let e = format!("{:#}", plan_alone(&format!("--roles {roles}")).unwrap_err());
        assert!(
            e.contains("--no-etcd makes this node the whole cluster"),
            "{roles}: {e}"
        );
    }
    // --replicas needs `--roles worker` alone, which is no whole cluster.
    assert!(plan_alone("--roles worker --replicas 2 --backend sim").is_err());
    // Either etcd or none, never both, and one of them.
    let both = Cli::try_parse_from(["node", "--no-etcd", "--etcd", "http://e:2379"]);
    assert!(both.is_err());
    assert!(
        Cli::try_parse_from(["node"]).is_err(),
        "--etcd is required without --no-etcd"
    );
}

#[test]
fn an_sm_split_needs_both_engines_on_a_gpu_backend() {
    let p = plan("--roles prefill,decode --sm-split prefill:96,decode:36").unwrap();
    assert_eq!(
        p.engines.sm_split,
        Some("prefill:96,decode:36".parse().unwrap())
    );
    assert_eq!(plan("").unwrap().engines.sm_split, None);
    // One side per process: the other side's engine runs in another process.
    for roles in ["prefill", "gateway,router,decode"] {
        let p = plan(&format!("--roles {roles} --sm-split 0.5")).unwrap();
        assert!(p.engines.sm_split.is_some(), "{roles}");
    }
    for roles in ["worker", "router", "gateway,router"] {
        let e = refused(&format!("--roles {roles} --sm-split 0.5"));
        assert!(
            e.contains("needs --roles with prefill, decode or both"),
            "{roles}: {e}"
        );
    }
    let e = refused("--roles prefill,decode --backend sim --sm-split 0.5");
    assert!(e.contains("--backend sim runs no GPU"), "{e}");
    // What the flag itself cannot read is refused by clap, naming the flag.
    let e = refused("--roles prefill,decode --sm-split cook:8");
    assert!(e.contains("not prefill or decode"), "{e}");
}

#[test]
fn a_registry_directory_stands_for_etcd_and_excludes_it() {
    let parse = |argv: &[&str]| {
        Cli::try_parse_from(argv.iter().copied())
            .map_err(|e| anyhow::anyhow!("{e}"))
            .and_then(|c| NodePlan::from_args(c.node))
    };
    let p = parse(&["node", "--registry-dir", "/tmp/r", "--roles", "prefill"]).unwrap();
    assert_eq!(
        p.network.registry_dir.as_deref(),
        Some(std::path::Path::new("/tmp/r"))
    );
    assert!(p.network.etcd.is_empty());
    for argv in [
        &[
            "node",
            "--registry-dir",
            "/tmp/r",
            "--etcd",
            "http://e:2379",
        ][..],
        &["node", "--registry-dir", "/tmp/r", "--no-etcd"][..],
    ] {
        let e = format!("{:#}", parse(argv).unwrap_err());
        assert!(e.contains("cannot be used with"), "{argv:?}: {e}");
    }
    let e = format!("{:#}", parse(&["node", "--roles", "prefill"]).unwrap_err());
    assert!(e.contains("--etcd"), "{e}");
}

#[test]
fn cuda_ipc_makes_a_decode_nodes_cache_exportable_and_asks_nothing_of_prefill_nodes() {
    let d = plan("--roles decode --kv-transport cuda-ipc").unwrap();
    let kv = d.kv.unwrap();
    assert!(kv.cuda_ipc && kv.ucx.is_none() && kv.tcp_listener.is_none());
    let p = plan("--roles prefill --kv-transport cuda-ipc").unwrap();
    assert!(!p.kv.unwrap().cuda_ipc, "a prefill node copies when asked");
    assert!(!plan("--roles decode").unwrap().kv.unwrap().cuda_ipc);
}
