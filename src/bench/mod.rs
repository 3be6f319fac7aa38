//! `kvmesh bench`: measures a running OpenAI-compatible server (kvmesh or any other) the way
//! serving benchmarks do. It sends streamed requests at a set concurrency or request rate,
//! times every chunk, and reports throughput and TTFT / TPOT / ITL / end-to-end latency; a
//! sweep over several settings ends in a table, JSON files and PNG charts.

mod client;
mod conversation;
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
use conversation::Conversation;
use dataset::{DatasetArg, Sample};
use metrics::{ConversationMetrics, Metrics};
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
    /// The API to call (default: completions; chat for --dataset conversation, which needs it).
    #[arg(long, value_enum)]
    pub endpoint: Option<Endpoint>,
    /// `random` (random text of exact token lengths), `shakespeare` (passages of the plays,
    /// exact token lengths), `conversation` (multi-turn chats of passages, each turn sending
    /// the whole history) or `sharegpt:PATH` (first human turns of a ShareGPT JSON file).
    #[arg(long, default_value = "random")]
    pub dataset: DatasetArg,
    /// --dataset conversation: conversations per run (default 32).
    #[arg(long)]
    pub conversations: Option<usize>,
    /// --dataset conversation: turns per conversation, each a request (default 5).
    #[arg(long)]
    pub turns: Option<usize>,
    /// --dataset conversation: tokens of each user message after the first (default 32);
    /// the first has --input-len.
    #[arg(long)]
    pub turn_input_len: Option<usize>,
    /// --dataset conversation: mean pause, in milliseconds, before each turn (exponentially
    /// distributed, seeded): the user reading and typing (default 0, turns back to back).
    #[arg(long, value_name = "MS")]
    pub think_time: Option<f64>,
    /// The served model's tokenizer, to count prompt tokens: a model folder or its
    /// tokenizer.json (default: the embedded Shakespeare model's).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Prompt tokens per request (random and shakespeare), special tokens included; for
    /// conversation, the tokens of each conversation's opening message.
    #[arg(long, default_value_t = 256)]
    pub input_len: usize,
    /// Tokens generated per request, each turn's for conversation (default 128; for ShareGPT,
    /// each reply's length).
    #[arg(long)]
    pub output_len: Option<usize>,
    /// Lengths vary uniformly within ±ratio of --input-len and --output-len.
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
    /// Requests per run (default 100; --dataset conversation sends conversations × turns).
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Requests kept in flight; a comma-separated list runs a sweep (1,2,4,8). With
    /// --dataset conversation: conversations held at once, each with one turn in flight.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["request_rate", "max_concurrency"])]
    pub concurrency: Vec<usize>,
    /// Requests per second, arriving as a Poisson process; `inf` sends all at once. A
    /// comma-separated list runs a sweep. The default, without --concurrency, is inf.
    #[arg(long, value_delimiter = ',')]
    pub request_rate: Vec<f64>,
    /// Shape of the gamma-distributed gaps between arrivals: 1 is Poisson, lower is burstier.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// With --request-rate: at most this many requests in flight; later arrivals wait. With
    /// --dataset conversation: at most this many conversations at once (default: all).
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

const DEFAULT_NUM_PROMPTS: usize = 100;

fn check(a: &BenchArgs) -> Result<()> {
    anyhow::ensure!(a.num_prompts != Some(0), "--num-prompts must be positive");
    if a.dataset == DatasetArg::Conversation {
        anyhow::ensure!(
            a.request_rate.is_empty(),
            "--request-rate does not apply to --dataset conversation: a conversation's turns \
             follow one another as answers end; set how many conversations run at once with \
             --concurrency (a list sweeps) or --max-concurrency"
        );
        anyhow::ensure!(
            a.num_prompts.is_none(),
            "--num-prompts does not apply to --dataset conversation: a run sends --conversations \
             × --turns requests"
        );
        anyhow::ensure!(
            a.endpoint != Some(Endpoint::Completions),
            "--dataset conversation sends chat messages: it needs --endpoint chat, its default"
        );
        for (flag, v) in [
            ("--conversations", a.conversations),
            ("--turns", a.turns),
            ("--turn-input-len", a.turn_input_len),
        ] {
            anyhow::ensure!(v != Some(0), "{flag} must be positive");
        }
        if let Some(t) = a.think_time {
            anyhow::ensure!(
                t.is_finite() && (0.0..=3_600_000.0).contains(&t),
                "--think-time must be between 0 and 3600000 ms, not {t}"
            );
        }
    } else {
        for (flag, v) in [
            ("--conversations", a.conversations),
            ("--turns", a.turns),
            ("--turn-input-len", a.turn_input_len),
        ] {
            anyhow::ensure!(
                v.is_none(),
                "{flag} needs --dataset conversation (the dataset is {})",
                a.dataset
            );
        }
        if a.think_time.is_some() {
            anyhow::bail!(
                "--think-time needs --dataset conversation (the dataset is {})",
                a.dataset
            );
        }
    }
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

/// The settings the sweep runs, in order. Conversations always run at a concurrency (the
/// conversations held at once): the --concurrency list, else --max-concurrency, else all.
fn loads(a: &BenchArgs) -> Vec<Load> {
    if !a.concurrency.is_empty() {
        return a
            .concurrency
            .iter()
            .map(|&concurrency| Load::Concurrency { concurrency })
            .collect();
    }
    if let Some(spec) = conversation_spec(a) {
        let concurrency = a.max_concurrency.unwrap_or(spec.conversations);
        return vec![Load::Concurrency { concurrency }];
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

/// What --dataset conversation makes for one run, with the defaults filled in; `None` for the
/// other datasets.
fn conversation_spec(a: &BenchArgs) -> Option<conversation::Spec> {
    (a.dataset == DatasetArg::Conversation).then(|| conversation::Spec {
        conversations: a
            .conversations
            .unwrap_or(conversation::DEFAULT_CONVERSATIONS),
        turns: a.turns.unwrap_or(conversation::DEFAULT_TURNS),
        input_len: a.input_len,
        turn_input_len: a
            .turn_input_len
            .unwrap_or(conversation::DEFAULT_TURN_INPUT_LEN),
        output_len: a.output_len.unwrap_or(dataset::DEFAULT_OUTPUT_LEN),
        range_ratio: a.range_ratio,
        seed: a.seed,
    })
}

/// What the runs send.
enum Work {
    Prompts {
        samples: Arc<Vec<Sample>>,
        prompt_lens: Vec<usize>,
    },
    /// Fresh conversations for each run of a sweep (`per_run` each, run r's from
    /// `r * per_run`), so no run finds an earlier run's conversations in the server's cache.
    Conversations {
        all: Vec<Conversation>,
        per_run: usize,
        turns: usize,
    },
}

/// The tokenizer prompts are counted with: a model folder, a tokenizer.json (with whatever
/// tokenizer_config.json lies beside it), or the embedded model's.
fn load_tokenizer(path: Option<&Path>) -> Result<TextTokenizer> {
    let files = match path {
        None => kvmesh_gpu::embedded::default_tokenizer(),
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
    let embedded = kvmesh_gpu::embedded::DEFAULT_MODEL.name;
    if args.tokenizer.is_none() && model != embedded {
        eprintln!(
            "note: counting tokens with the embedded {embedded} model's tokenizer; \
             pass --tokenizer for {model}'s own"
        );
    }
    let tok = load_tokenizer(args.tokenizer.as_deref())?;
    let conv_spec = conversation_spec(&args);
    let endpoint = args.endpoint.unwrap_or(match conv_spec {
        Some(_) => Endpoint::Chat,
        None => Endpoint::Completions,
    });
    let target = Target {
        base_url: base_url.clone(),
        model: model.clone(),
        endpoint,
        api_key: args.api_key.clone(),
    };
    let loads = loads(&args);
    let (work, warm_body, requests) = match &conv_spec {
        None => {
            let num_prompts = args.num_prompts.unwrap_or(DEFAULT_NUM_PROMPTS);
            let spec = dataset::Spec {
                dataset: &args.dataset,
                num_prompts,
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
            let s0 = &samples[0];
            // Short, since only that it works matters.
            let warm = target.body(&s0.prompt, s0.output_len.min(16));
            let prompt_lens = samples.iter().map(|s| s.prompt_len).collect();
            let samples = Arc::new(samples);
            (
                Work::Prompts {
                    samples,
                    prompt_lens,
                },
                warm,
                num_prompts,
            )
        }
        Some(spec) => {
            if let Some(max) = info.max_model_len {
                conversation::check_context(&tok, spec, max)?;
            }
            let all = conversation::build(
                &tok,
                &conversation::Spec {
                    conversations: spec.conversations * loads.len(),
                    ..spec.clone()
                },
            )?;
            let warm = target.chat_body(
                &[serde_json::json!({
                    "role": "user",
                    "content": conversation::warm_up_message(&tok, spec)?,
                })],
                spec.output_len.min(16),
            );
            for load in &loads {
                if load.x() > spec.conversations as f64 {
                    eprintln!(
                        "note: {load} holds at most {} conversations at once, all there are",
                        spec.conversations
                    );
                }
            }
            (
                Work::Conversations {
                    all,
                    per_run: spec.conversations,
                    turns: spec.turns,
                },
                warm,
                spec.conversations * spec.turns,
            )
        }
    };

    // One request first, not counted: it proves the endpoint and model answer before a
    // sweep starts, and opens the connection.
    let warm = client::send_body(&http, &target, &warm_body).await;
    if !warm.ok {
        bail!(
            "the warm-up request to {} failed: {}",
            target.url(),
            warm.error.unwrap_or_default()
        );
    }
    let what = match &conv_spec {
        Some(c) => format!(
            "{} conversations of {} turns ({requests} requests) per run",
            c.conversations, c.turns
        ),
        None => format!("{requests} {} prompts", args.dataset),
    };
    eprintln!(
        "benchmarking {} ({model}, {}) with {what}; warm-up TTFT {:.1} ms",
        target.url(),
        endpoint.name(),
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
        endpoint: endpoint.name().into(),
        dataset: args.dataset.to_string(),
        tokenizer: match &args.tokenizer {
            Some(p) => p.display().to_string(),
            None => format!("embedded ({embedded})"),
        },
        num_prompts: requests,
        input_len: args.input_len,
        output_len: args.output_len,
        range_ratio: args.range_ratio,
        seed: args.seed,
        conversations: conv_spec.as_ref().map(|c| c.conversations),
        turns: conv_spec.as_ref().map(|c| c.turns),
        turn_input_len: conv_spec.as_ref().map(|c| c.turn_input_len),
        think_time_ms: conv_spec.as_ref().and(args.think_time),
    };
    let axis = loads[0].axis();
    let mut rows = Vec::new();
    for (r, load) in loads.iter().enumerate() {
        let bar = progress_bar(requests, load.to_string());
        let started_unix = unix_now();
        let (outcomes, prompt_lens, duration) = match &work {
            Work::Prompts {
                samples,
                prompt_lens,
            } => {
                let (o, d) = run::run(&http, &target, samples, *load, args.seed, &bar).await;
                (o, prompt_lens.clone(), d)
            }
            Work::Conversations { all, per_run, .. } => {
                let convs = Arc::new(all[r * per_run..(r + 1) * per_run].to_vec());
                let active = load.x() as usize;
                let think = args.think_time.map(|t| (t, args.seed));
                let (o, d) = conversation::run(&http, &target, &convs, active, think, &bar).await;
                let lens = conversation::prompt_lens(&tok, &convs, &o)?;
                (o, lens, d)
            }
        };
        bar.finish_and_clear();
        let mut m = Metrics::compute(&outcomes, &prompt_lens, duration, &with_p99);
        if let Work::Conversations { turns, .. } = &work {
            m.conversation = Some(ConversationMetrics::compute(&outcomes, *turns, &with_p99));
        }
        print!("{}", report::run_block(&label, load, &m, percentiles));
        print!("{}", report::failures(&outcomes, 3));
        println!();
        if let Some(r) = m
            .conversation
            .as_ref()
            .and_then(|c| c.first_turn.prefix_cache_hit_rate)
            .filter(|&r| r >= 0.5)
        {
            // Openings differ, so only an earlier run can have put them in the cache.
            eprintln!(
                "note: {} of the first turns' prompt tokens were already cached: the server has \
                 seen these conversations (an earlier run with --seed {}?); for a cold start \
                 use another --seed or restart the server",
                report::rate(Some(r)),
                args.seed
            );
        }
        let cache = match &m.conversation {
            Some(c) => format!(
                ", prefix cache hit rate {} (turn 1 {}, later turns {})",
                report::rate(m.prefix_cache_hit_rate),
                report::rate(c.first_turn.prefix_cache_hit_rate),
                report::rate(c.later_turns.prefix_cache_hit_rate)
            ),
            None => String::new(),
        };
        eprintln!(
            "{load}: {} ok, {} failed in {:.2} s; {:.1} output tok/s, mean TTFT {:.1} ms, mean TPOT {:.2} ms{cache}",
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
    fn conversations_run_at_a_concurrency_of_conversations() {
        let a = parse(&["--dataset", "conversation"]).unwrap();
        check(&a).unwrap();
        let spec = conversation_spec(&a).unwrap();
        assert_eq!(
            (
                spec.conversations,
                spec.turns,
                spec.turn_input_len,
                spec.output_len
            ),
            (32, 5, 32, 128)
        );
        assert_eq!(spec.input_len, 256);
        // All at once unless told otherwise, as the request-rate default sends everything.
        assert_eq!(loads(&a), [Load::Concurrency { concurrency: 32 }]);
        let a = parse(&[
            "--dataset",
            "conversation",
            "--conversations",
            "6",
            "--turns",
            "3",
            "--turn-input-len",
            "20",
            "--output-len",
            "8",
            "--seed",
            "4",
            "--max-concurrency",
            "2",
        ])
        .unwrap();
        check(&a).unwrap();
        let spec = conversation_spec(&a).unwrap();
        assert_eq!(
            (
                spec.conversations,
                spec.turns,
                spec.turn_input_len,
                spec.output_len,
                spec.seed
            ),
            (6, 3, 20, 8, 4)
        );
        assert_eq!(loads(&a), [Load::Concurrency { concurrency: 2 }]);
        let a = parse(&[
            "--dataset",
            "conversation",
            "--concurrency",
            "1,4",
            "--endpoint",
            "chat",
        ])
        .unwrap();
        check(&a).unwrap();
        assert_eq!(
            loads(&a),
            [1, 4].map(|concurrency| Load::Concurrency { concurrency })
        );
        assert!(conversation_spec(&parse(&[]).unwrap()).is_none());
    }

    #[test]
    fn flags_that_make_no_sense_with_conversations_are_refused_by_name() {
        let refused = |args: &[&str], flag: &str| {
            let a = parse(args).unwrap();
            let e = check(&a).unwrap_err().to_string();
            assert!(e.contains(flag), "{args:?}: {e}");
        };
        let conv = |extra: &[&'static str]| -> Vec<&'static str> {
            let mut v = vec!["--dataset", "conversation"];
            v.extend_from_slice(extra);
            v
        };
        refused(&conv(&["--request-rate", "4"]), "--request-rate");
        refused(
            &conv(&["--request-rate", "inf", "--max-concurrency", "2"]),
            "--request-rate",
        );
        refused(&conv(&["--num-prompts", "10"]), "--num-prompts");
        refused(&conv(&["--endpoint", "completions"]), "--endpoint chat");
        refused(
            &conv(&["--conversations", "0"]),
            "--conversations must be positive",
        );
        refused(&conv(&["--turns", "0"]), "--turns must be positive");
        refused(
            &conv(&["--turn-input-len", "0"]),
            "--turn-input-len must be positive",
        );
        // And the conversation flags without the dataset.
        refused(&["--turns", "3"], "--turns needs --dataset conversation");
        refused(
            &["--dataset", "shakespeare", "--conversations", "3"],
            "--conversations needs --dataset conversation",
        );
        refused(&["--turn-input-len", "3"], "--turn-input-len needs");
        refused(
            &["--think-time", "500"],
            "--think-time needs --dataset conversation",
        );
        refused(&conv(&["--think-time=-1"]), "--think-time must be between");
        refused(
            &conv(&["--think-time", "NaN"]),
            "--think-time must be between",
        );
        check(&parse(&conv(&["--think-time", "250.5"])).unwrap()).unwrap();
        // The other datasets keep their defaults.
        let a = parse(&["--num-prompts", "7"]).unwrap();
        check(&a).unwrap();
        assert_eq!((a.num_prompts, a.endpoint), (Some(7), None));
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
