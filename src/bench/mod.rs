//! `kvmesh bench`: measures a running OpenAI-compatible server (kvmesh or any other) the way
//! serving benchmarks do. It sends streamed requests at a set concurrency or request rate,
//! times every chunk, and reports throughput and TTFT / TPOT / ITL / end-to-end latency; a
//! sweep over several settings ends in a table, JSON files and PNG charts.

mod client;
mod dataset;
mod metrics;
mod plot;
mod report;
mod run;
mod schedule;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvmesh_gpu::tokenizer::{TextTokenizer, TokenizerFiles};

use client::{Endpoint, Target};
use dataset::DatasetArg;
use metrics::Metrics;
use report::{PerRequest, RunRecord, Settings, SummaryRecord, SummaryRow};
use run::{Axis, Load};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The server, without `/v1`.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// The model to ask for (default: the first the server lists at /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value = "completions")]
    pub endpoint: Endpoint,
    /// `random` (random text of exact token lengths), `shakespeare` (passages of the plays,
    /// exact token lengths) or `sharegpt:PATH` (first human turns of a ShareGPT JSON file).
    #[arg(long, default_value = "random")]
    pub dataset: DatasetArg,
    /// The served model's tokenizer, to count prompt tokens: a model folder or its
    /// tokenizer.json (default: the embedded Shakespeare model's).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Prompt tokens per request (random and shakespeare), special tokens included.
    #[arg(long, default_value_t = 256)]
    pub input_len: usize,
    /// Tokens generated per request (default 128; for ShareGPT, each reply's length).
    #[arg(long)]
    pub output_len: Option<usize>,
    /// Lengths vary uniformly within ±ratio of --input-len and --output-len.
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
    /// Requests per run.
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Requests kept in flight; a comma-separated list runs a sweep (1,2,4,8).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["request_rate", "max_concurrency"])]
    pub concurrency: Vec<usize>,
    /// Requests per second, arriving as a Poisson process; `inf` sends all at once. A
    /// comma-separated list runs a sweep. The default, without --concurrency, is inf.
    #[arg(long, value_delimiter = ',')]
    pub request_rate: Vec<f64>,
    /// Shape of the gamma-distributed gaps between arrivals: 1 is Poisson, lower is burstier.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// With --request-rate: at most this many requests in flight; later arrivals wait.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Seeds the prompts and the arrival schedule.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Latency percentiles to report besides mean and median.
    #[arg(long, value_delimiter = ',', default_value = "99")]
    pub percentiles: Vec<f64>,
    /// Names the run in tables, files and charts (default: the model's name).
    #[arg(long)]
    pub label: Option<String>,
    /// Write one JSON file per run and a sweep summary here.
    #[arg(long)]
    pub result_dir: Option<PathBuf>,
    /// Draw PNG charts (TTFT, TPOT, output throughput) here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Summary JSON files of earlier runs to draw beside this one (needs --plot).
    #[arg(long, num_args = 1.., requires = "plot")]
    pub compare: Vec<PathBuf>,
    /// Run nothing: only chart the --compare files.
    #[arg(long, requires = "compare")]
    pub plot_only: bool,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "KVMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Seconds a single request may take before it counts as failed.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
}

pub fn run(args: BenchArgs) -> Result<()> {
    check(&args)?;
    if args.plot_only {
        return plot_only(&args);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(bench(args))
}

fn check(a: &BenchArgs) -> Result<()> {
    anyhow::ensure!(a.num_prompts > 0, "--num-prompts must be positive");
    anyhow::ensure!(
        a.concurrency.iter().all(|&c| c > 0),
        "--concurrency values must be positive"
    );
    anyhow::ensure!(
        a.request_rate.iter().all(|&r| r > 0.0),
        "--request-rate values must be positive (or inf)"
    );
    anyhow::ensure!(
        a.burstiness > 0.0 && a.burstiness.is_finite(),
        "--burstiness must be positive"
    );
    anyhow::ensure!(
        a.max_concurrency != Some(0),
        "--max-concurrency must be positive"
    );
    anyhow::ensure!(
        (0.0..1.0).contains(&a.range_ratio),
        "--range-ratio must be at least 0 and below 1"
    );
    anyhow::ensure!(
        a.percentiles.iter().all(|&p| p > 0.0 && p <= 100.0),
        "--percentiles must lie in (0, 100]"
    );
    anyhow::ensure!(
        a.timeout > 0.0 && a.timeout.is_finite(),
        "--timeout must be positive"
    );
    Ok(())
}

/// The settings the sweep runs, in order.
fn loads(a: &BenchArgs) -> Vec<Load> {
    if !a.concurrency.is_empty() {
        return a
            .concurrency
            .iter()
            .map(|&concurrency| Load::Concurrency { concurrency })
            .collect();
    }
    let rates = if a.request_rate.is_empty() {
        vec![f64::INFINITY]
    } else {
        a.request_rate.clone()
    };
    rates
        .into_iter()
        .map(|request_rate| Load::RequestRate {
            request_rate,
            burstiness: a.burstiness,
            max_concurrency: a.max_concurrency,
        })
        .collect()
}

/// The tokenizer prompts are counted with: a model folder, a tokenizer.json (with whatever
/// tokenizer_config.json lies beside it), or the embedded model's.
fn load_tokenizer(path: Option<&Path>) -> Result<TextTokenizer> {
    let files = match path {
        None => crate::embedded::default_tokenizer(),
        Some(p) if p.is_dir() => TokenizerFiles::read_dir(p)?,
        Some(p) => {
            let tokenizer_json =
                std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
            let dir = p.parent().unwrap_or(Path::new("."));
            let opt = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
            TokenizerFiles {
                tokenizer_json,
                tokenizer_config: opt("tokenizer_config.json"),
                chat_template_jinja: opt("chat_template.jinja"),
                generation_config: None,
            }
        }
    };
    TextTokenizer::from_files(&files, &[]).context("loading the tokenizer")
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn progress_bar(len: usize, what: String) -> ProgressBar {
    // A bar only for a person watching; logs and CI get one line per run instead.
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:32}] {pos}/{len} requests, {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what);
    bar
}

async fn bench(args: BenchArgs) -> Result<()> {
    let base_url = args
        .base_url
        .trim_end_matches('/')
        .trim_end_matches("/v1")
        .to_string();
    // The client is built without TLS, to keep the binary free of a crypto stack; a
    // benchmark normally runs beside the server anyway.
    if base_url.starts_with("https://") {
        bail!("--base-url {base_url}: kvmesh bench speaks plain http only; use http://");
    }
    let http = client::http_client(Duration::from_secs_f64(args.timeout))?;
    let info = client::server_info(&http, &base_url, args.api_key.as_deref()).await?;
    let model = match (&args.model, info.models.first()) {
        (Some(m), _) => m.clone(),
        (None, Some(m)) => m.clone(),
        (None, None) => {
            bail!("the server at {base_url} lists no models at /v1/models; name one with --model")
        }
    };
    let label = args.label.clone().unwrap_or_else(|| model.clone());
    let embedded = crate::embedded::DEFAULT_MODEL.name;
    if args.tokenizer.is_none() && model != embedded {
        eprintln!(
            "note: counting tokens with the embedded {embedded} model's tokenizer; \
             pass --tokenizer for {model}'s own"
        );
    }
    let tok = load_tokenizer(args.tokenizer.as_deref())?;
    let spec = dataset::Spec {
        dataset: &args.dataset,
        num_prompts: args.num_prompts,
        input_len: args.input_len,
        output_len: args.output_len,
        range_ratio: args.range_ratio,
        max_model_len: info.max_model_len,
        seed: args.seed,
    };
    let (samples, note) = dataset::build(&tok, &spec)?;
    if let Some(note) = note {
        eprintln!("{note}");
    }
    let samples = Arc::new(samples);
    let prompt_lens: Vec<usize> = samples.iter().map(|s| s.prompt_len).collect();
    let target = Target {
        base_url: base_url.clone(),
        model: model.clone(),
        endpoint: args.endpoint,
        api_key: args.api_key.clone(),
    };

    // One request first, not counted: it proves the endpoint and model answer before a
    // sweep starts, and opens the connection. Short, since only that it works matters.
    let warm = client::send(&http, &target, &samples[0], samples[0].output_len.min(16)).await;
    if !warm.ok {
        bail!(
            "the warm-up request to {} failed: {}",
            target.url(),
            warm.error.unwrap_or_default()
        );
    }
    eprintln!(
        "benchmarking {} ({model}, {}) with {} {} prompts; warm-up TTFT {:.1} ms",
        target.url(),
        args.endpoint.name(),
        args.num_prompts,
        args.dataset,
        warm.ttft * 1e3
    );

    let percentiles = &args.percentiles;
    // The sweep table and charts always show P99, whatever is printed per run.
    let mut with_p99 = percentiles.clone();
    if !with_p99.contains(&99.0) {
        with_p99.push(99.0);
    }
    let settings = Settings {
        label: label.clone(),
        model: model.clone(),
        base_url: base_url.clone(),
        endpoint: args.endpoint.name().into(),
        dataset: args.dataset.to_string(),
        tokenizer: match &args.tokenizer {
            Some(p) => p.display().to_string(),
            None => format!("embedded ({embedded})"),
        },
        num_prompts: args.num_prompts,
        input_len: args.input_len,
        output_len: args.output_len,
        range_ratio: args.range_ratio,
        seed: args.seed,
    };
    let loads = loads(&args);
    let axis = loads[0].axis();
    let mut rows = Vec::new();
    for load in &loads {
        let bar = progress_bar(samples.len(), load.to_string());
        let started_unix = unix_now();
        let (outcomes, duration) = run::run(&http, &target, &samples, *load, args.seed, &bar).await;
        bar.finish_and_clear();
        let m = Metrics::compute(&outcomes, &prompt_lens, duration, &with_p99);
        print!("{}", report::run_block(&label, load, &m, percentiles));
        print!("{}", report::failures(&outcomes, 3));
        println!();
        eprintln!(
            "{load}: {} ok, {} failed in {:.2} s; {:.1} output tok/s, mean TTFT {:.1} ms, mean TPOT {:.2} ms",
            m.completed,
            m.failed,
            m.duration_s,
            m.output_throughput,
            m.ttft_ms.mean,
            m.tpot_ms.mean
        );
        if let Some(dir) = &args.result_dir {
            let record = RunRecord {
                format: report::FORMAT.into(),
                settings: settings.clone(),
                load: *load,
                started_unix,
                metrics: m.clone(),
                requests: PerRequest::new(&outcomes, &prompt_lens),
            };
            let name = format!("{}-{}.json", report::slug(&label), load.file_stem());
            report::write_json(dir, &name, &record, false)?;
        }
        rows.push(SummaryRow::new(*load, &m));
    }
    if rows.len() > 1 {
        println!("{}", report::summary_table(&label, axis, &rows));
    }
    let summary = SummaryRecord {
        format: report::FORMAT.into(),
        settings,
        axis,
        runs: rows,
    };
    if let Some(dir) = &args.result_dir {
        let path = report::write_json(
            dir,
            &format!("{}-summary.json", report::slug(&label)),
            &summary,
            true,
        )?;
        eprintln!("results in {} (summary {})", dir.display(), path.display());
    }
    if let Some(dir) = &args.plot {
        let mut series = vec![plot::Series {
            label: label.clone(),
            rows: summary.runs.clone(),
        }];
        series.extend(compared(&args.compare, axis)?);
        let files = plot::draw(dir, axis, &series)?;
        eprintln!("charts: {}", list(&files));
    }
    Ok(())
}

/// Earlier sweeps to chart beside this one; those over the other axis cannot share its charts.
fn compared(paths: &[PathBuf], axis: Axis) -> Result<Vec<plot::Series>> {
    let mut out = Vec::new();
    for p in paths {
        let rec = SummaryRecord::read(p)?;
        if rec.axis != axis {
            eprintln!(
                "note: {} sweeps {}, not {}; left out of the charts",
                p.display(),
                rec.axis.title(),
                axis.title()
            );
            continue;
        }
        out.push(plot::Series {
            label: rec.settings.label,
            rows: rec.runs,
        });
    }
    Ok(out)
}

/// `--plot-only`: charts of earlier sweeps, over the first file's axis.
fn plot_only(args: &BenchArgs) -> Result<()> {
    let dir = args
        .plot
        .as_ref()
        .expect("clap requires --plot with --compare");
    let axis = SummaryRecord::read(&args.compare[0])?.axis;
    let series = compared(&args.compare, axis)?;
    let files = plot::draw(dir, axis, &series)?;
    eprintln!("charts: {}", list(&files));
    Ok(())
}

fn list(files: &[PathBuf]) -> String {
    files
        .iter()
        .map(|f| f.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|c| c.bench)
    }

    #[test]
    fn sweeps_parse_into_loads() {
        let a = parse(&["--concurrency", "1,2,4"]).unwrap();
        assert_eq!(
            loads(&a),
            [1, 2, 4].map(|concurrency| Load::Concurrency { concurrency })
        );
        let a = parse(&[
            "--request-rate",
            "0.5,inf",
            "--burstiness",
            "2",
            "--max-concurrency",
            "3",
        ])
        .unwrap();
        check(&a).unwrap();
        let l = loads(&a);
        assert_eq!(l.len(), 2);
        assert_eq!(l[1].x(), f64::INFINITY);
        assert_eq!(
            l[0],
            Load::RequestRate {
                request_rate: 0.5,
                burstiness: 2.0,
                max_concurrency: Some(3)
            }
        );
        // Neither: everything at once, as other serving benchmarks default to.
        assert_eq!(loads(&parse(&[]).unwrap())[0].x(), f64::INFINITY);
    }

    #[test]
    fn contradictory_or_bad_flags_are_refused() {
        assert!(parse(&["--concurrency", "2", "--request-rate", "1"]).is_err());
        assert!(
            parse(&["--compare", "a.json"]).is_err(),
            "--compare needs --plot"
        );
        assert!(parse(&["--dataset", "wiki"]).is_err());
        for bad in [
            &["--concurrency", "0"][..],
            &["--request-rate=-1"],
            &["--range-ratio", "1"],
            &["--percentiles", "0"],
            &["--num-prompts", "0"],
        ] {
            assert!(check(&parse(bad).unwrap()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_tokenizer_json_path_or_none_loads() {
        let embedded = load_tokenizer(None).unwrap();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/shakespeare");
        let from_dir = load_tokenizer(Some(&dir)).unwrap();
        let from_file = load_tokenizer(Some(&dir.join("tokenizer.json"))).unwrap();
        let text = "ROMEO:\nBut soft, what light";
        let ids = embedded.encode(text, true).unwrap();
        assert_eq!(from_dir.encode(text, true).unwrap(), ids);
        assert_eq!(from_file.encode(text, true).unwrap(), ids);
        let Err(e) = load_tokenizer(Some(Path::new("/nonexistent/tokenizer.json"))) else {
            panic!("a missing tokenizer loaded");
        };
        assert!(e.to_string().contains("/nonexistent/tokenizer.json"), "{e}");
    }
}
