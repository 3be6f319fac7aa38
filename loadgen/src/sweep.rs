//! One `kvmesh bench` sweep: settle the server, model, tokenizer and prompts once, prove the
//! endpoint with a warm-up request, then one run per load setting, each printed and (with
//! --result-dir) written; last the sweep's table, summary and charts.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use kvmesh_gpu::tokenizer::{TextTokenizer, TokenizerFiles};
use serde_json::Value;

use super::args::{conversation_spec, loads, BenchArgs, DEFAULT_NUM_PROMPTS};
use super::client::{self, Endpoint, Target};
use super::conversation::{self, Conversation};
use super::dataset::{self, Sample};
use super::metrics::{ConversationMetrics, Metrics};
use super::plot;
use super::report::{self, PerRequest, RunRecord, Settings, SummaryRecord, SummaryRow};
use super::run::{self, Axis, Load};

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

/// What a sweep's runs share, settled before the first.
struct Sweep<'a> {
    args: &'a BenchArgs,
    http: reqwest::Client,
    target: Target,
    label: String,
    tok: TextTokenizer,
    loads: Vec<Load>,
    work: Work,
    /// Requests per run.
    requests: usize,
    settings: Settings,
    /// The percentiles computed: those asked for, and P99, which the sweep table and charts
    /// always show.
    with_p99: Vec<f64>,
}

pub async fn bench(args: BenchArgs) -> Result<()> {
    let sweep = Sweep::prepare(&args).await?;
    let axis = sweep.loads[0].axis();
    let mut rows = Vec::new();
    for (r, load) in sweep.loads.iter().enumerate() {
        rows.push(sweep.run(r, load).await?);
    }
    sweep.finish(axis, rows)
}

/// `--base-url` without a trailing `/` or `/v1`; refused when it is https.
fn base_url(args: &BenchArgs) -> Result<String> {
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
    Ok(base_url)
}

/// The prompts of a dataset, the warm-up request's body and the requests per run.
fn prompts_work(
    args: &BenchArgs,
    tok: &TextTokenizer,
    target: &Target,
    max_model_len: Option<usize>,
) -> Result<(Work, Value, usize)> {
    let num_prompts = args.num_prompts.unwrap_or(DEFAULT_NUM_PROMPTS);
    let spec = dataset::Spec {
        dataset: &args.dataset,
        num_prompts,
        input_len: args.input_len,
        output_len: args.output_len,
        range_ratio: args.range_ratio,
        max_model_len,
        seed: args.seed,
    };
    let (samples, note) = dataset::build(tok, &spec)?;
    if let Some(note) = note {
        eprintln!("{note}");
    }
    let s0 = &samples[0];
    // Short, since only that it works matters.
    let warm = target.body(&s0.prompt, s0.output_len.min(16));
    let prompt_lens = samples.iter().map(|s| s.prompt_len).collect();
    let samples = Arc::new(samples);
    Ok((
        Work::Prompts {
            samples,
            prompt_lens,
        },
        warm,
        num_prompts,
    ))
}

/// Conversations for every run, the warm-up request's body and the requests per run.
fn conversations_work(
    spec: &conversation::Spec,
    tok: &TextTokenizer,
    target: &Target,
    loads: &[Load],
    max_model_len: Option<usize>,
) -> Result<(Work, Value, usize)> {
    if let Some(max) = max_model_len {
        conversation::check_context(tok, spec, max)?;
    }
    let all = conversation::build(
        tok,
        &conversation::Spec {
            conversations: spec.conversations * loads.len(),
            ..spec.clone()
        },
    )?;
    let warm = target.chat_body(
        &[serde_json::json!({
            "role": "user",
            "content": conversation::warm_up_message(tok, spec)?,
        })],
        spec.output_len.min(16),
    );
    for load in loads {
        if load.x() > spec.conversations as f64 {
            eprintln!(
                "note: {load} holds at most {} conversations at once, all there are",
                spec.conversations
            );
        }
    }
    Ok((
        Work::Conversations {
            all,
            per_run: spec.conversations,
            turns: spec.turns,
        },
        warm,
        spec.conversations * spec.turns,
    ))
}

impl Sweep<'_> {
    async fn prepare(args: &BenchArgs) -> Result<Sweep<'_>> {
        let base_url = base_url(args)?;
        let http = client::http_client(Duration::from_secs_f64(args.timeout))?;
        let info = client::server_info(&http, &base_url, args.api_key.as_deref()).await?;
        let model = match (&args.model, info.models.first()) {
            (Some(m), _) => m.clone(),
            (None, Some(m)) => m.clone(),
            (None, None) => {
                bail!(
                    "the server at {base_url} lists no models at /v1/models; name one with --model"
                )
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
        let conv_spec = conversation_spec(args);
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
        let loads = loads(args);
        let (work, warm_body, requests) = match &conv_spec {
            None => prompts_work(args, &tok, &target, info.max_model_len)?,
            Some(spec) => conversations_work(spec, &tok, &target, &loads, info.max_model_len)?,
        };
        let what = match &conv_spec {
            Some(c) => format!(
                "{} conversations of {} turns ({requests} requests) per run",
                c.conversations, c.turns
            ),
            None => format!("{requests} {} prompts", args.dataset),
        };
        warm_up(&http, &target, &warm_body, &what).await?;
        let settings = Settings {
            label: label.clone(),
            model,
            base_url,
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
        let mut with_p99 = args.percentiles.clone();
        if !with_p99.contains(&99.0) {
            with_p99.push(99.0);
        }
        Ok(Sweep {
            args,
            http,
            target,
            label,
            tok,
            loads,
            work,
            requests,
            settings,
            with_p99,
        })
    }

    /// Run `r` of the sweep, at `load`: printed, written with --result-dir, and its row of
    /// the sweep table.
    async fn run(&self, r: usize, load: &Load) -> Result<SummaryRow> {
        let (args, http, target, label) = (self.args, &self.http, &self.target, &self.label);
        let bar = progress_bar(self.requests, load.to_string());
        let started_unix = unix_now();
        let (outcomes, prompt_lens, duration) = match &self.work {
            Work::Prompts {
                samples,
                prompt_lens,
            } => {
                let (o, d) = run::run(http, target, samples, *load, args.seed, &bar).await;
                (o, prompt_lens.clone(), d)
            }
            Work::Conversations { all, per_run, .. } => {
                let convs = Arc::new(all[r * per_run..(r + 1) * per_run].to_vec());
                let active = load.x() as usize;
                let think = args.think_time.map(|t| (t, args.seed));
                let (o, d) = conversation::run(http, target, &convs, active, think, &bar).await;
                let lens = conversation::prompt_lens(&self.tok, &convs, &o)?;
                (o, lens, d)
            }
        };
        bar.finish_and_clear();
        let mut m = Metrics::compute(&outcomes, &prompt_lens, duration, &self.with_p99);
        if let Work::Conversations { turns, .. } = &self.work {
            m.conversation = Some(ConversationMetrics::compute(
                &outcomes,
                *turns,
                &self.with_p99,
            ));
        }
        print!("{}", report::run_block(label, load, &m, &args.percentiles));
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
                settings: self.settings.clone(),
                load: *load,
                started_unix,
                metrics: m.clone(),
                requests: PerRequest::new(&outcomes, &prompt_lens),
            };
            let name = format!("{}-{}.json", report::slug(label), load.file_stem());
            report::write_json(dir, &name, &record, false)?;
        }
        Ok(SummaryRow::new(*load, &m))
    }

    /// The sweep's table (when it has several runs), summary file and charts.
    fn finish(self, axis: Axis, rows: Vec<SummaryRow>) -> Result<()> {
        if rows.len() > 1 {
            println!("{}", report::summary_table(&self.label, axis, &rows));
        }
        let summary = SummaryRecord {
            format: report::FORMAT.into(),
            settings: self.settings,
            axis,
            runs: rows,
        };
        if let Some(dir) = &self.args.result_dir {
            let path = report::write_json(
                dir,
                &format!("{}-summary.json", report::slug(&self.label)),
                &summary,
                true,
            )?;
            eprintln!("results in {} (summary {})", dir.display(), path.display());
        }
        if let Some(dir) = &self.args.plot {
            let mut series = vec![plot::Series {
                label: self.label.clone(),
                rows: summary.runs.clone(),
            }];
            series.extend(compared(&self.args.compare, axis)?);
            let files = plot::draw(dir, axis, &series)?;
            eprintln!("charts: {}", list(&files));
        }
        Ok(())
    }
}

/// One request first, not counted: it proves the endpoint and model answer before a sweep
/// starts, and opens the connection.
async fn warm_up(http: &reqwest::Client, target: &Target, body: &Value, what: &str) -> Result<()> {
    let warm = client::send_body(http, target, body).await;
    if !warm.ok {
        bail!(
            "the warm-up request to {} failed: {}",
            target.url(),
            warm.error.unwrap_or_default()
        );
    }
    eprintln!(
        "benchmarking {} ({}, {}) with {what}; warm-up TTFT {:.1} ms",
        target.url(),
        target.model,
        target.endpoint.name(),
        warm.ttft * 1e3
    );
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
pub fn plot_only(args: &BenchArgs) -> Result<()> {
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

    #[test]
    fn a_tokenizer_json_path_or_none_loads() {
        let embedded = load_tokenizer(None).unwrap();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/shakespeare");
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
