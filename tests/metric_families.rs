//! `/metrics` keeps its families: the name, type and label names of every family on each kind
//! of page (`kvmesh serve`; a cluster gateway with its router; a worker; one node with a
//! prefill and a decode engine), compared with `tests/fixtures/metric_families.txt`. The file
//! was written from the pages of the version whose exposition was hand-written, before
//! metrics went through the prometheus crate, so dashboards and alerts built on those names
//! keep working. `KVMESH_WRITE_FAMILIES=1` writes the file from the binary under test
//! (`KVMESH_BIN` picks another one) instead of comparing.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{kvmesh, Server};
use kvmesh_bench::harness::{client, post, wait_for};
use kvmesh_discovery::testing::Etcd;
use serde_json::json;

const FIXTURE: &str = "tests/fixtures/metric_families.txt";

/// Family name → (type, label names) of an exposition in the text format.
fn families(text: &str) -> BTreeMap<String, (String, BTreeSet<String>)> {
    let mut out: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name type");
            out.entry(name.to_string()).or_default().0 = kind.to_string();
        }
    }
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let series = line.rsplit_once(' ').map_or(line, |(s, _)| s);
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => (n, l.trim_end_matches('}')),
            None => (series, ""),
        };
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| name.strip_suffix(suffix))
            .find(|base| out.get(*base).is_some_and(|f| f.0 == "histogram"))
            .unwrap_or(name);
        let entry = out
            .get_mut(family)
            .unwrap_or_else(|| panic!("sample {line:?} has no # TYPE line"));
        for pair in split_labels(labels) {
            let key = pair.split_once('=').map_or(pair.as_str(), |(k, _)| k);
            if key != "le" {
                entry.1.insert(key.to_string());
            }
        }
    }
    out
}

/// `a="x",b="y, z"` → its `key="value"` pairs (commas inside quoted values kept).
fn split_labels(labels: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted, mut escaped) = (Vec::new(), String::new(), false, false);
    for c in labels.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// One line per family of a page: `page name type labels`.
fn lines(page: &str, text: &str) -> Vec<String> {
    families(text)
        .into_iter()
        .map(|(name, (kind, labels))| {
            let labels: Vec<String> = labels.into_iter().collect();
            format!("{page} {name} {kind} {}", labels.join(","))
        })
        .collect()
}

async fn scrape(http: &reqwest::Client, base: &str) -> String {
    http.get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_keeps_its_metric_families() {
    let http = client();
    let mut got = Vec::new();

    // One process: the gateway and its engine, after a request.
    let serve = Server::start(&["--max-model-len", "256"]);
    let (status, _) = serve
        .post(
            "/v1/completions",
            json!({"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200);
    got.extend(lines("serve", &scrape(&http, &serve.base).await));

    // A cluster: a gateway with its router, a worker, and a node with both a prefill and a
    // decode engine.
    let etcd = Etcd::start();
    let cluster = "families";
    let gateway = kvmesh().gateway(&etcd, cluster, "g", "least-loaded");
    let worker = kvmesh().worker(&etcd, cluster, "w", &[]);
    let pd = kvmesh().node(
        &etcd,
        cluster,
        "pd",
        &["--roles", "prefill,decode", "--backend", "sim"],
    );
    wait_for("the router to reach every worker", 30, async || {
        let text = scrape(&http, &gateway.http).await;
        text.contains("kvmesh:router_workers_routable{model_name=\"shakespeare\"} 2")
            && text
                .contains("kvmesh:router_prefill_workers_connected{model_name=\"shakespeare\"} 1")
    })
    .await;
    let (status, body) = post(
        &http,
        &gateway.http,
        json!({"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    got.extend(lines("gateway", &scrape(&http, &gateway.http).await));
    got.extend(lines("worker", &scrape(&http, &worker.http).await));
    got.extend(lines("prefill-decode", &scrape(&http, &pd.http).await));

    let path = format!("{}/{FIXTURE}", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("KVMESH_WRITE_FAMILIES").is_some() {
        std::fs::write(&path, got.join("\n") + "\n").expect("write the fixture");
        return;
    }
    let want: Vec<String> = std::fs::read_to_string(&path)
        .expect("the fixture")
        .lines()
        .map(String::from)
        .collect();
    let (want_set, got_set): (BTreeSet<_>, BTreeSet<_>) =
        (want.iter().collect(), got.iter().collect());
    let missing: Vec<_> = want_set.difference(&got_set).collect();
    let added: Vec<_> = got_set.difference(&want_set).collect();
    assert!(
        missing.is_empty() && added.is_empty(),
        "families changed:\nmissing (were there before): {missing:#?}\nnew: {added:#?}"
    );
}

#[test]
fn families_are_read_with_their_types_and_label_names() {
    let text = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\",y=\"q\\\",r\"} 2\n\
                # TYPE h histogram\nh_bucket{m=\"z\",le=\"0.1\"} 1\nh_sum{m=\"z\"} 1\n\
                h_count{m=\"z\"} 1\n# TYPE g gauge\ng 3\n";
    assert_eq!(
        lines("p", text),
        ["p a_total counter x,y", "p g gauge ", "p h histogram m"]
    );
}
