//! What the bench programs (`src/bin/`) share beyond the harness: the `kvmesh` binary they
//! drive, and how they write their results.

use std::path::Path;

use serde_json::{json, Value};

use crate::harness::Kvmesh;

/// Flags of a `sim` worker that takes no time at all, so that the serving machinery is all
/// there is to measure.
pub const ZERO_COST: [&str; 8] = [
    "--backend",
    "sim",
    "--sim-prefill-us-per-token",
    "0",
    "--sim-decode-ms",
    "0",
    "--sim-decode-us-per-seq",
    "0",
];

/// The `kvmesh` binary beside this program's own executable (`cargo build --release` puts
/// them side by side in target/release), its processes' logs dropped.
pub fn kvmesh() -> Kvmesh {
    let me = std::env::current_exe().expect("current exe");
    let bin = me.with_file_name("kvmesh");
    assert!(
        bin.exists(),
        "no {} (build it: cargo build --release)",
        bin.display()
    );
    Kvmesh::new(bin).quiet()
}

/// Writes a cluster benchmark's results to `path` as pretty JSON, with the machine they were
/// measured on and whether the run was `--quick`, and says where.
pub fn write_results(path: &Path, quick: bool, mut out: Value) {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    out["machine"] = json!(format!(
        "{cpus} CPUs (shared VM); all processes on loopback"
    ));
    out["quick"] = json!(quick);
    write_json(path, &out).unwrap();
    println!("\nwrote {}", path.display());
}

/// Writes `out` to `path` as pretty JSON, making its folder first.
pub fn write_json(path: &Path, out: &Value) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string_pretty(out).expect("a JSON value serialises");
    std::fs::write(path, text)
}
