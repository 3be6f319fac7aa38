//! What the sections run with, and their runs of `kvmesh bench`.

use std::path::Path;

use kvmesh_bench::harness::Kvmesh;
use serde_json::Value;

/// What every section runs with.
pub struct Ctx {
    pub km: Kvmesh,
    pub http: reqwest::Client,
    pub quick: bool,
}

impl Ctx {
    /// Runs `kvmesh bench` with `args`, its results written under `dir`; panics, naming
    /// `label`, when it fails.
    pub fn kvmesh_bench(&self, args: &[&str], dir: &Path, label: &str) {
        let st = self
            .km
            .command()
            .arg("bench")
            .args(args)
            .arg("--result-dir")
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run kvmesh bench");
        assert!(st.success(), "kvmesh bench failed for {label}");
    }
}

/// The 99th percentile of a `kvmesh bench` statistic (`percentiles: [[p, value], …]`).
pub fn p99(stat: &Value) -> f64 {
    stat["percentiles"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p[0].as_f64() == Some(99.0)))
        .and_then(|p| p[1].as_f64())
        .unwrap_or(f64::NAN)
}
