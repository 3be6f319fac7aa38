//! `--product-sweep`: each kind of a dense model's decode products timed alone and over
//! every layer back to back (`CudaBackend::time_products`), beside the bytes it reads.

use kvmesh_gpu::backend::cuda::ProductTiming;

/// The table lines and the JSON of a sweep, against the device's copy bandwidth `bw`
/// (bytes/s).
pub fn summary(sweep: &[ProductTiming], bw: f64) -> (Vec<String>, serde_json::Value) {
    if sweep.is_empty() {
        return (Vec::new(), serde_json::Value::Null);
    }
    let mut lines = vec![format!(
        "{:>5} {:<15} {:>14} {:>9} {:>10} {:>11} {:>11} {:>9}",
        "rows", "products", "n x k", "MB", "alone us", "chained us", "at copy bw", "GB/s"
    )];
    let mut json = Vec::new();
    for p in sweep {
        // What the bytes would take at the copy bandwidth, and the rate each launch reached
        // within the back-to-back run.
        let bound_us = p.bytes as f64 / bw * 1e6;
        let gbps = p.bytes as f64 / (p.chained_us * 1e-6) / 1e9;
        lines.push(format!(
            "{:>5} {:<15} {:>14} {:>9.2} {:>10.2} {:>11.2} {:>11.2} {:>9.0}",
            p.rows,
            p.name,
            format!("{} x {}", p.n, p.k),
            p.bytes as f64 / 1e6,
            p.alone_us,
            p.chained_us,
            bound_us,
            gbps
        ));
        json.push(serde_json::json!({
            "rows": p.rows, "products": p.name, "n": p.n, "k": p.k, "bytes": p.bytes,
            "alone_us": p.alone_us, "chained_us": p.chained_us,
            "us_at_copy_bandwidth": bound_us, "chained_gb_per_s": gbps,
        }));
    }
    (lines, serde_json::Value::Array(json))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_puts_each_kind_beside_its_bandwidth_time() {
        let p = ProductTiming {
            name: "down",
            rows: 1,
            n: 1000,
            k: 1000,
            bytes: 2_000_000,
            alone_us: 5.0,
            chained_us: 2.0,
        };
        // 2 MB at 1 TB/s: 2 us; at 2 us a launch, 1,000 GB/s.
        let (lines, json) = summary(&[p], 1e12);
        assert_eq!(lines.len(), 2);
        assert!(lines[1].contains("1000 x 1000"), "{}", lines[1]);
        assert_eq!(json[0]["us_at_copy_bandwidth"], 2.0);
        assert_eq!(json[0]["chained_gb_per_s"], 1000.0);
        assert_eq!(summary(&[], 1e12).0.len(), 0);
    }
}
