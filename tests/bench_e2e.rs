//! End-to-end tests of `kvmesh bench`: the real binary against a real `kvmesh serve` with the
//! sim backend (deterministic, no math, generates exactly `max_tokens`) on loopback.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::Server;
use serde_json::Value;

const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

fn sim_server() -> Server {
    Server::start(&["--backend", "sim", "--sim-decode-ms", "3"])
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .arg("bench")
        .args(args)
        .env_remove("KVMESH_API_KEY")
        .output()
        .expect("run kvmesh bench")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A fresh folder under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p =
            std::env::temp_dir().join(format!("kvmesh-bench-e2e-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn json(path: &Path) -> Value {
    let t = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&t).unwrap()
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        bytes.starts_with(PNG_SIGNATURE),
        "{} is no PNG",
        path.display()
    );
    assert!(
        bytes.len() > 10_000,
        "{} is suspiciously small",
        path.display()
    );
}

#[test]
fn a_concurrency_sweep_measures_every_request_and_writes_json_and_charts() {
    let s = sim_server();
    let dir = TempDir::new("sweep");
    let (results, plots) = (dir.join("results"), dir.join("plots"));
    let out = bench(&[
        "--base-url",
        &s.base,
        "--concurrency",
        "1,4",
        "--num-prompts",
        "8",
        "--input-len",
        "32",
        "--output-len",
        "16",
        "--percentiles",
        "50,90,99",
        "--label",
        "sim run",
        "--result-dir",
        results.to_str().unwrap(),
        "--plot",
        plots.to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(
        stdout.matches("Serving Benchmark Result").count(),
        2,
        "{stdout}"
    );
    for want in [
        "Successful requests:                             8",
        "Failed requests:                                 0",
        "Total input tokens:                            256",
        "Total generated tokens:                        128",
        "P90 ITL (ms):",
        "| concurrency | req/s |",
    ] {
        assert!(stdout.contains(want), "{want:?} not in\n{stdout}");
    }
    // The server counted the same prompt lengths as the benchmark's tokenizer.
    assert!(!stdout.contains("as the server counted"), "{stdout}");
    // Without a terminal: no progress bar, one line per finished setting.
    assert!(stderr.contains("concurrency 1: 8 ok, 0 failed"), "{stderr}");
    assert!(stderr.contains("concurrency 4: 8 ok, 0 failed"), "{stderr}");

    for (c, file) in [(1, "sim_run-c1.json"), (4, "sim_run-c4.json")] {
        let r = json(&results.join(file));
        assert_eq!(r["format"], "kvmesh-bench/1");
        assert_eq!(r["label"], "sim run");
        assert_eq!(
            r["model"], "shakespeare",
            "--model defaults to the served one"
        );
        assert_eq!(r["endpoint"], "completions");
        assert_eq!(r["load"]["mode"], "concurrency");
        assert_eq!(r["load"]["concurrency"], c);
        let m = &r["metrics"];
        assert_eq!(m["completed"], 8);
        assert_eq!(m["failed"], 0);
        assert_eq!(m["total_output_tokens"], 8 * 16);
        assert_eq!(m["total_input_tokens"], 8 * 32);
        assert_eq!(m["server_input_tokens"], 8 * 32, "usage agrees");
        for k in ["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"] {
            assert!(m[k]["mean"].as_f64().unwrap() > 0.0, "{k}: {m}");
            assert!(m[k]["median"].as_f64().is_some(), "{k}");
            assert_eq!(m[k]["percentiles"].as_array().unwrap().len(), 3, "{k}");
        }
        assert!(m["output_throughput"].as_f64().unwrap() > 0.0);
        let q = &r["requests"];
        for k in [
            "prompt_len",
            "output_len",
            "ttft_ms",
            "itl_ms",
            "e2el_ms",
            "error",
        ] {
            assert_eq!(q[k].as_array().unwrap().len(), 8, "{k}");
        }
        for i in 0..8 {
            assert_eq!(q["prompt_len"][i], 32);
            assert_eq!(q["output_len"][i], 16);
            assert!(q["error"][i].is_null());
            let ttft = q["ttft_ms"][i].as_f64().unwrap();
            let e2el = q["e2el_ms"][i].as_f64().unwrap();
            assert!(ttft > 0.0 && ttft < e2el, "{ttft} {e2el}");
            // One gap per content chunk after the first (a chunk may hold several tokens),
            // all of them within the request's decode time.
            let gaps: Vec<f64> = q["itl_ms"][i]
                .as_array()
                .unwrap()
                .iter()
                .map(|g| g.as_f64().unwrap())
                .collect();
            assert!((1..=15).contains(&gaps.len()), "{gaps:?}");
            assert!(gaps.iter().sum::<f64>() <= e2el - ttft + 0.01, "{gaps:?}");
        }
    }
    let summary = json(&results.join("sim_run-summary.json"));
    assert_eq!(summary["axis"], "concurrency");
    let runs = summary["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1]["load"]["concurrency"], 4);
    for r in runs {
        for k in [
            "request_throughput",
            "output_throughput",
            "mean_ttft_ms",
            "p99_ttft_ms",
            "mean_tpot_ms",
            "p99_tpot_ms",
            "mean_itl_ms",
        ] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
        }
    }
    // Four requests at a time finish the same work sooner.
    assert!(
        runs[1]["request_throughput"].as_f64().unwrap()
            > runs[0]["request_throughput"].as_f64().unwrap()
    );
    for png in ["ttft.png", "tpot.png", "throughput.png", "overview.png"] {
        assert_png(&plots.join(png));
    }
}

#[test]
fn a_chat_rate_sweep_and_charts_compared_with_it() {
    let s = sim_server();
    let dir = TempDir::new("rate");
    let results = dir.join("results");
    let out = bench(&[
        "--base-url",
        &format!("{}/v1/", s.base),
        "--endpoint",
        "chat",
        "--dataset",
        "shakespeare",
        "--request-rate",
        "40,inf",
        "--max-concurrency",
        "3",
        "--num-prompts",
        "6",
        "--input-len",
        "24",
        "--output-len",
        "8",
        "--seed",
        "3",
        "--result-dir",
        results.to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for want in [
        "Request rate (req/s):                           40",
        "Request rate (req/s):                          inf",
        "Max concurrency:                                 3",
        "Successful requests:                             6",
        "Total input tokens:                            144",
        "Total generated tokens:                         48",
        // The chat template wraps each prompt in its own tokens, and the server says so.
        "Input tokens, as the server counted:",
        "| request rate (req/s) |",
    ] {
        assert!(stdout.contains(want), "{want:?} not in\n{stdout}");
    }
    let r = json(&results.join("shakespeare-rateinf.json"));
    assert_eq!(r["load"]["request_rate"], "inf");
    assert_eq!(r["load"]["max_concurrency"], 3);
    assert_eq!(r["endpoint"], "chat");
    assert_eq!(r["dataset"], "shakespeare");
    assert_eq!(r["metrics"]["total_output_tokens"], 48);

    // A second configuration, charted beside the first from its summary alone.
    let out = bench(&[
        "--base-url",
        &s.base,
        "--request-rate",
        "20,inf",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--label",
        "short",
        "--result-dir",
        results.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{:?}", text(&out));
    let charts = dir.join("compare");
    let out = bench(&[
        "--plot-only",
        "--plot",
        charts.to_str().unwrap(),
        "--compare",
        results.join("shakespeare-summary.json").to_str().unwrap(),
        results.join("short-summary.json").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{:?}", text(&out));
    for png in ["ttft.png", "tpot.png", "throughput.png", "overview.png"] {
        assert_png(&charts.join(png));
    }
    let out = bench(&[
        "--plot-only",
        "--plot",
        charts.to_str().unwrap(),
        "--compare",
        results.join("shakespeare-rate40.json").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out).1.contains("is not a kvmesh bench summary"),
        "{:?}",
        text(&out)
    );
}

#[test]
fn no_server_a_wrong_model_and_a_missing_dataset_fail_clearly() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let out = bench(&["--base-url", &url, "--num-prompts", "2"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("cannot reach the server at {url}")),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    let s = sim_server();
    let out = bench(&[
        "--base-url",
        &s.base,
        "--model",
        "nosuch",
        "--num-prompts",
        "2",
    ]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    let want = format!(
        "the warm-up request to {}/v1/completions failed: HTTP 404: The model `nosuch` does not exist",
        s.base
    );
    assert!(stderr.contains(&want), "{stderr}");

    let out = bench(&[
        "--base-url",
        &s.base,
        "--dataset",
        "sharegpt:/nonexistent/sharegpt.json",
    ]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot read the ShareGPT file /nonexistent/sharegpt.json"),
        "{stderr}"
    );

    // Longer than the served model's context: refused before anything is sent.
    let out = bench(&[
        "--base-url",
        &s.base,
        "--input-len",
        "500",
        "--output-len",
        "64",
    ]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("exceed the served model's context"),
        "{stderr}"
    );
}

#[test]
fn conversations_carry_their_history_and_later_turns_hit_the_prefix_cache() {
    let s = sim_server();
    let dir = TempDir::new("conversation");
    let results = dir.join("results");
    let (conversations, turns) = (3, 3);
    let out = bench(&[
        "--base-url",
        &s.base,
        "--dataset",
        "conversation",
        "--conversations",
        "3",
        "--turns",
        "3",
        "--input-len",
        "48",
        "--turn-input-len",
        "16",
        "--output-len",
        "8",
        "--max-concurrency",
        "2",
        "--label",
        "conv",
        "--result-dir",
        results.to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for want in [
        "Concurrency:                                     2",
        "Successful requests:                             9",
        "Failed requests:                                 0",
        "Total generated tokens:                         72",
        "----------------- Conversations ------------------",
        "Conversations:                                   3",
        "Turns per conversation:                          3",
        "Prefix cache hit rate, turn 1:",
        "Prefix cache hit rate, later turns:",
    ] {
        assert!(stdout.contains(want), "{want:?} not in\n{stdout}");
    }
    assert!(
        !stdout.contains("n/a"),
        "kvmesh reports cached tokens:\n{stdout}"
    );
    // The benchmark counts each turn's prompt with the served model's tokenizer and chat
    // template, replies included: the server counted the same.
    assert!(!stdout.contains("as the server counted"), "{stdout}");
    assert!(
        stderr.contains("3 conversations of 3 turns (9 requests)"),
        "{stderr}"
    );
    assert!(stderr.contains("concurrency 2: 9 ok, 0 failed"), "{stderr}");

    let r = json(&results.join("conv-c2.json"));
    assert_eq!(r["dataset"], "conversation");
    assert_eq!(r["endpoint"], "chat", "conversations default to chat");
    assert_eq!(r["conversations"], conversations);
    assert_eq!(r["turns"], turns);
    assert_eq!(r["turn_input_len"], 16);
    assert_eq!(r["num_prompts"], conversations * turns);
    assert_eq!(r["load"]["mode"], "concurrency");
    assert_eq!(r["load"]["concurrency"], 2);
    let m = &r["metrics"];
    assert_eq!(m["completed"], conversations * turns);
    assert_eq!(m["failed"], 0);
    assert_eq!(m["total_output_tokens"], 9 * 8);
    assert_eq!(m["server_input_tokens"], m["total_input_tokens"]);
    assert!(m["ttft_ms"]["mean"].as_f64().unwrap() > 0.0, "{m}");
    let overall = m["prefix_cache_hit_rate"]
        .as_f64()
        .unwrap_or_else(|| panic!("no hit rate: {m}"));
    let c = &m["conversation"];
    assert_eq!(c["conversations"], conversations);
    assert_eq!(c["turns"], turns);
    assert_eq!(c["first_turn"]["completed"], 3);
    assert_eq!(c["later_turns"]["completed"], 6);
    let first = c["first_turn"]["prefix_cache_hit_rate"]
        .as_f64()
        .unwrap_or_else(|| panic!("no turn-1 hit rate: {c}"));
    let later = c["later_turns"]["prefix_cache_hit_rate"]
        .as_f64()
        .unwrap_or_else(|| panic!("no later-turn hit rate: {c}"));
    // Each later turn resends the history the engine just computed; first turns open with
    // different passages and share at most the chat template's few tokens (under a block).
    assert!(later > 0.3, "later turns' hit rate {later}: {c}");
    assert!(first < later, "turn 1 {first} vs later {later}: {c}");
    assert!(first < 0.2, "turn 1 {first}: {c}");
    assert!(
        first < overall && overall < later,
        "{first} {overall} {later}"
    );
    assert_eq!(c["per_turn"].as_array().unwrap().len(), 3);

    // Per request, conversation by conversation: each turn's prompt is the last one plus its
    // reply and a new message, and finds more of itself cached.
    let q = &r["requests"];
    let num = |k: &str, i: usize| q[k][i].as_u64().unwrap_or_else(|| panic!("{k}[{i}]: {q}"));
    assert_eq!(q["prompt_len"].as_array().unwrap().len(), 9);
    for conv in 0..3 {
        let i = conv * 3;
        assert!(q["error"][i].is_null());
        for t in 1..3 {
            assert!(
                num("prompt_len", i + t) >= num("prompt_len", i + t - 1) + 8 + 16,
                "conversation {conv}: {q}"
            );
            assert!(
                num("cached_tokens", i + t) > num("cached_tokens", i + t - 1),
                "conversation {conv}: {q}"
            );
        }
    }

    let summary = json(&results.join("conv-summary.json"));
    let row = &summary["runs"][0];
    assert_eq!(row["prefix_cache_hit_rate"].as_f64(), Some(overall));
    assert_eq!(
        row["conversation"]["later_turns_hit_rate"].as_f64(),
        Some(later)
    );
    assert_eq!(
        row["conversation"]["first_turn_hit_rate"].as_f64(),
        Some(first)
    );

    // A request-rate schedule does not drive conversations; the error names the flags.
    let out = bench(&[
        "--base-url",
        &s.base,
        "--dataset",
        "conversation",
        "--request-rate",
        "5",
    ]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--request-rate does not apply to --dataset conversation")
            && stderr.contains("--max-concurrency"),
        "{stderr}"
    );
}
