//! `kvmesh cluster status`: the records in etcd, each node's `/status`, and what the routers
//! say they cannot reach or refuse.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Args;
use serde_json::{json, Value};

use kvmesh_discovery::{EtcdRegistry, NodeRecord, Registry};

#[derive(Args, Debug)]
pub struct ClusterStatusArgs {
    #[arg(long, value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
    #[arg(long, default_value = "default")]
    pub cluster: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// List every node and every problem; by default a cluster of thousands shows its first
    /// rows and problems, and counts the rest by state.
    #[arg(long)]
    pub all: bool,
}

/// Nodes listed, and problems printed, without `--all`.
const ROWS_SHOWN: usize = 50;
const PROBLEMS_SHOWN: usize = 20;

/// A member's record and its `/status`, when it answered.
type Row = (NodeRecord, Option<Value>);

pub fn cluster_status(args: ClusterStatusArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let rows = rt.block_on(fetch(&args))?;
    if args.json {
        let v: Vec<Value> = rows
            .iter()
            .map(|(r, s)| json!({"record": r, "status": s}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "cluster '{}': {} node{}",
        args.cluster,
        rows.len(),
        if rows.len() == 1 { "" } else { "s" }
    );
    print_table(rows, args.all);
    Ok(())
}

/// Every record, with the status its node serves.
async fn fetch(args: &ClusterStatusArgs) -> anyhow::Result<Vec<Row>> {
    let registry = EtcdRegistry::connect(&args.etcd, &args.cluster, 3).await?;
    let records = registry.list().await?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    // Several nodes at once; a router lists every worker link it holds (by default it
    // lists the first thousand), so that none it cannot reach goes unsaid.
    use futures::stream::{self, StreamExt};
    let http = &http;
    let rows = stream::iter(records)
        .map(|r| async move {
            let status = match &r.http_url {
                Some(u) => match http.get(format!("{u}/status?workers=all")).send().await {
                    Ok(resp) => resp.json::<Value>().await.ok(),
                    Err(_) => None,
                },
                None => None,
            };
            (r, status)
        })
        .buffer_unordered(16)
        .collect()
        .await;
    Ok(rows)
}

/// What the routers say of the workers: who cannot reach each (worker → routers), and who
/// refuses each and why (worker → (router, reason)).
#[derive(Default)]
struct RouterViews {
    unreached: BTreeMap<String, Vec<String>>,
    refused: BTreeMap<String, Vec<(String, String)>>,
}

impl RouterViews {
    fn of(rows: &[Row]) -> RouterViews {
        let mut v = RouterViews::default();
        for (r, s) in rows {
            let router = s.as_ref().map(|s| &s["router"]);
            for w in router
                .and_then(|x| x["refused"].as_array())
                .into_iter()
                .flatten()
            {
                if let (Some(id), Some(why)) = (w["node_id"].as_str(), w["reason"].as_str()) {
                    v.refused
                        .entry(id.to_string())
                        .or_default()
                        .push((r.node_id.clone(), why.to_string()));
                }
            }
            for w in router
                .and_then(|x| x["workers"].as_array())
                .into_iter()
                .flatten()
            {
                if w["connected"] == json!(false) {
                    if let Some(id) = w["node_id"].as_str() {
                        v.unreached
                            .entry(id.to_string())
                            .or_default()
                            .push(r.node_id.clone());
                    }
                }
            }
        }
        v
    }

    /// A node's state in the table, and the problems to print below it.
    fn state(&self, r: &NodeRecord, s: Option<&Value>, problems: &mut Vec<String>) -> String {
        if r.draining || s.is_some_and(|s| s["draining"] == json!(true)) {
            "draining".to_string()
        } else if let Some(by) = self.refused.get(&r.node_id) {
            for (router, why) in by {
                problems.push(format!(
                    "{}: router {router} does not route to it: it {why}",
                    r.node_id
                ));
            }
            "refused".to_string()
        } else if let Some(routers) = self.unreached.get(&r.node_id) {
            problems.push(format!(
                "{}: router(s) {} cannot reach it at its advertised QUIC address {} \
                 (a wrong --advertise-addr, a firewall, or a cut link); it gets no requests",
                r.node_id,
                routers.join(", "),
                r.quic_addr
            ));
            "unreachable".to_string()
        } else if s.is_none() {
            "no status".to_string()
        } else {
            "ok".to_string()
        }
    }
}

fn print_table(rows: Vec<Row>, all: bool) {
    let views = RouterViews::of(&rows);
    println!(
        "{:<20} {:<21} {:<21} {:<14} {:<14} {:<12} {:>9} {:>9} {:>7} {:>8}  STATE",
        "NODE",
        "ROLES",
        "QUIC",
        "MODEL",
        "DEVICE",
        "KV XFER",
        "CAP tok/s",
        "RUN/WAIT",
        "KV %",
        "UPTIME"
    );
    let mut problems = Vec::new();
    // Grouped by model (nodes without one, gateways and routers, first), in id order.
    let mut rows = rows;
    rows.sort_by(|a, b| (&a.0.model, &a.0.node_id).cmp(&(&b.0.model, &b.0.node_id)));
    let mut fingerprints: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    for (r, _) in &rows {
        let f = r.model_fingerprint.clone().unwrap_or_else(|| "none".into());
        fingerprints.entry(r.model.clone()).or_default().insert(f);
    }
    let mut group: Option<String> = None;
    // Beyond the rows shown: how many nodes in each state.
    let mut rest: BTreeMap<String, usize> = BTreeMap::new();
    for (shown, (r, s)) in rows.into_iter().enumerate() {
        if !all && shown >= ROWS_SHOWN {
            let state = views.state(&r, s.as_ref(), &mut problems);
            *rest.entry(state).or_default() += 1;
            continue;
        }
        if group.as_ref() != Some(&r.model) {
            group = Some(r.model.clone());
            let fs: Vec<&str> = fingerprints[&r.model].iter().map(String::as_str).collect();
            match (r.model.as_str(), fs.as_slice()) {
                ("", _) => println!("-- no model (gateways and routers of every model)"),
                (m, [f]) => println!("-- model {m} (fingerprint {f})"),
                (m, fs) => println!(
                    "-- model {m}: {} fingerprints under one name ({}); routers serve one",
                    fs.len(),
                    fs.join(", ")
                ),
            }
        }
        let state = views.state(&r, s.as_ref(), &mut problems);
        let load = s
            .as_ref()
            .and_then(|s| s.get("load"))
            .map(|l| format!("{}/{}", l["running"], l["waiting"]))
            .unwrap_or_else(|| "-".into());
        let worker = r.roles.iter().any(|x| x.runs_engine());
        let cap = match s
            .as_ref()
            .and_then(|s| s["load"]["capacity_tokens_per_s"].as_f64())
        {
            Some(c) => format!("{c:.1}"),
            None if worker => format!("{:.1}", r.capacity_tokens_per_s),
            None => "-".into(),
        };
        let kv = s
            .as_ref()
            .and_then(|s| s["load"]["kv_usage"].as_f64())
            .map(|k| format!("{:.1}", 100.0 * k))
            .unwrap_or_else(|| "-".into());
        let uptime = s
            .as_ref()
            .and_then(|s| s["uptime_s"].as_f64())
            .map(|u| format!("{u:.0}s"))
            .unwrap_or_else(|| "unreachable".into());
        let roles: Vec<&str> = r.roles.iter().map(|x| x.as_str()).collect();
        println!(
            "{:<20} {:<21} {:<21} {:<14} {:<14} {:<12} {:>9} {:>9} {:>7} {:>8}  {}",
            r.node_id,
            roles.join(","),
            r.quic_addr,
            if r.model.is_empty() { "-" } else { &r.model },
            r.device,
            if r.kv_transports.is_empty() {
                "-".to_string()
            } else {
                r.kv_transports.join(",")
            },
            cap,
            load,
            kv,
            uptime,
            state
        );
    }
    if !rest.is_empty() {
        let counts: Vec<String> = rest.iter().map(|(s, n)| format!("{n} {s}")).collect();
        println!(
            "... and {} more nodes: {} (--all lists them)",
            rest.values().sum::<usize>(),
            counts.join(", ")
        );
    }
    let more = if all {
        0
    } else {
        problems.len().saturating_sub(PROBLEMS_SHOWN)
    };
    for p in &problems[..problems.len() - more] {
        println!("! {p}");
    }
    if more > 0 {
        println!("! ... and {more} more problems (--all lists them)");
    }
}
