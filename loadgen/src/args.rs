//! `kvmesh bench`'s command line: the flags, what they may not say together, and the runs
//! a sweep makes of them.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use super::client::Endpoint;
use super::conversation;
use super::dataset::{self, DatasetArg};
use super::run::Load;

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

pub const DEFAULT_NUM_PROMPTS: usize = 100;

pub fn check(a: &BenchArgs) -> Result<()> {
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
pub fn loads(a: &BenchArgs) -> Vec<Load> {
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
pub fn conversation_spec(a: &BenchArgs) -> Option<conversation::Spec> {
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
}
