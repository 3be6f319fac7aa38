//! What a benchmark prints and writes: the result block of each run, the table across a
//! sweep, and the JSON files later runs and `--compare` read back.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::metrics::{Metrics, Outcome, Stats};
use super::run::{fmt_x, Axis, Load};

/// Marks the files so `--compare` can tell them from other JSON.
pub const FORMAT: &str = "kvmesh-bench/1";

/// The settings every run of one invocation shares.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub label: String,
    pub model: String,
    pub base_url: String,
    pub endpoint: String,
    pub dataset: String,
    pub tokenizer: String,
    pub num_prompts: usize,
    pub input_len: usize,
    /// `None`: the dataset's own lengths (ShareGPT replies) or the default.
    pub output_len: Option<usize>,
    pub range_ratio: f64,
    pub seed: u64,
    /// `--dataset conversation`: conversations per run, turns each, and the tokens of each
    /// later user message (absent for the other datasets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversations: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_input_len: Option<usize>,
    /// `--think-time`: the mean pause before each turn, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub think_time_ms: Option<f64>,
}

/// One run's file: its settings, metrics, and what each request measured.
#[derive(Serialize, Deserialize)]
pub struct RunRecord {
    pub format: String,
    #[serde(flatten)]
    pub settings: Settings,
    pub load: Load,
    /// Seconds since 1970 when the run started.
    pub started_unix: u64,
    pub metrics: Metrics,
    pub requests: PerRequest,
}

/// Per-request arrays, index i being the i-th prompt (for conversations: turn t of
/// conversation c at `c * turns + t`); failed requests have their error and whatever timings
/// they got to.
#[derive(Serialize, Deserialize)]
pub struct PerRequest {
    pub prompt_len: Vec<usize>,
    /// Prompt tokens the server said it found cached; null where it did not say.
    #[serde(default)]
    pub cached_tokens: Vec<Option<usize>>,
    pub output_len: Vec<usize>,
    pub ttft_ms: Vec<f64>,
    pub itl_ms: Vec<Vec<f64>>,
    pub e2el_ms: Vec<f64>,
    pub error: Vec<Option<String>>,
}

impl PerRequest {
    pub fn new(outcomes: &[Outcome], prompt_lens: &[usize]) -> PerRequest {
        // Microseconds are finer than a network measures; more digits only bloat the file.
        let ms = |s: f64| (s * 1e6).round() / 1e3;
        PerRequest {
            prompt_len: prompt_lens.to_vec(),
            cached_tokens: outcomes.iter().map(|o| o.cached_tokens).collect(),
            output_len: outcomes.iter().map(|o| o.output_tokens).collect(),
            ttft_ms: outcomes.iter().map(|o| ms(o.ttft)).collect(),
            itl_ms: outcomes
                .iter()
                .map(|o| o.itl.iter().map(|&s| ms(s)).collect())
                .collect(),
            e2el_ms: outcomes.iter().map(|o| ms(o.e2el)).collect(),
            error: outcomes.iter().map(|o| o.error.clone()).collect(),
        }
    }
}

/// One row of a sweep: the headline numbers of one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SummaryRow {
    pub load: Load,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub mean_ttft_ms: f64,
    pub median_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    pub mean_tpot_ms: f64,
    pub p99_tpot_ms: f64,
    pub mean_itl_ms: f64,
    pub p99_itl_ms: f64,
    pub mean_e2el_ms: f64,
    pub p99_e2el_ms: f64,
    /// Σ cached / Σ prompt tokens as the server reported them; null where it did not.
    #[serde(default)]
    pub prefix_cache_hit_rate: Option<f64>,
    /// A conversation run's split by turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<ConversationRow>,
}

/// The first turn against the later ones, in a sweep's row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConversationRow {
    pub first_turn_hit_rate: Option<f64>,
    pub later_turns_hit_rate: Option<f64>,
    pub mean_ttft_first_turn_ms: f64,
    pub mean_ttft_later_turns_ms: f64,
}

impl SummaryRow {
    pub fn new(load: Load, m: &Metrics) -> SummaryRow {
        let p99 = |s: &Stats| s.p(99.0).unwrap_or(0.0);
        SummaryRow {
            load,
            completed: m.completed,
            failed: m.failed,
            duration_s: m.duration_s,
            request_throughput: m.request_throughput,
            output_throughput: m.output_throughput,
            total_token_throughput: m.total_token_throughput,
            mean_ttft_ms: m.ttft_ms.mean,
            median_ttft_ms: m.ttft_ms.median,
            p99_ttft_ms: p99(&m.ttft_ms),
            mean_tpot_ms: m.tpot_ms.mean,
            p99_tpot_ms: p99(&m.tpot_ms),
            mean_itl_ms: m.itl_ms.mean,
            p99_itl_ms: p99(&m.itl_ms),
            mean_e2el_ms: m.e2el_ms.mean,
            p99_e2el_ms: p99(&m.e2el_ms),
            prefix_cache_hit_rate: m.prefix_cache_hit_rate,
            conversation: m.conversation.as_ref().map(|c| ConversationRow {
                first_turn_hit_rate: c.first_turn.prefix_cache_hit_rate,
                later_turns_hit_rate: c.later_turns.prefix_cache_hit_rate,
                mean_ttft_first_turn_ms: c.first_turn.ttft_ms.mean,
                mean_ttft_later_turns_ms: c.later_turns.ttft_ms.mean,
            }),
        }
    }
}

/// A sweep's file: one row per run, what `--compare` reads.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SummaryRecord {
    pub format: String,
    #[serde(flatten)]
    pub settings: Settings,
    pub axis: Axis,
    pub runs: Vec<SummaryRow>,
}

impl SummaryRecord {
    pub fn read(path: &Path) -> Result<SummaryRecord> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let rec: SummaryRecord = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a kvmesh bench summary (a *-summary.json from --result-dir)",
                path.display()
            )
        })?;
        anyhow::ensure!(
            rec.format == FORMAT,
            "{} has format {:?}; this kvmesh reads {FORMAT:?}",
            path.display(),
            rec.format
        );
        Ok(rec)
    }
}

/// A label made safe to be part of a file name.
pub fn slug(label: &str) -> String {
    let s: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "run".into()
    } else {
        s
    }
}

/// Writes `value` as `dir/name`: indented for people, or on one line where it is mostly
/// per-request arrays (indented, those would take a line per number).
pub fn write_json(dir: &Path, name: &str, value: &impl Serialize, pretty: bool) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(name);
    let text = if pretty {
        serde_json::to_string_pretty(value)?
    } else {
        serde_json::to_string(value)?
    };
    std::fs::write(&path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

const WIDTH: usize = 50;

fn heading(title: &str, fill: char) -> String {
    let title = format!(" {title} ");
    let left = WIDTH.saturating_sub(title.len()) / 2;
    let right = WIDTH.saturating_sub(title.len() + left);
    format!(
        "{}{title}{}",
        fill.to_string().repeat(left),
        fill.to_string().repeat(right)
    )
}

fn line(out: &mut String, name: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{:<40}{:>10}", format!("{name}:"), value);
}

/// A hit rate as a percentage; "n/a" where the server did not report its cache.
pub fn rate(r: Option<f64>) -> String {
    match r {
        Some(r) => format!("{:.1}%", r * 100.0),
        None => "n/a".into(),
    }
}

/// The result block of one run.
pub fn run_block(label: &str, load: &Load, m: &Metrics, percentiles: &[f64]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", heading("Serving Benchmark Result", '='));
    line(&mut out, "Label", label);
    match *load {
        Load::Concurrency { concurrency } => line(&mut out, "Concurrency", concurrency),
        Load::RequestRate {
            request_rate,
            burstiness,
            max_concurrency,
        } => {
            line(&mut out, "Request rate (req/s)", fmt_x(request_rate));
            if request_rate.is_finite() {
                line(&mut out, "Burstiness", burstiness);
            }
            if let Some(c) = max_concurrency {
                line(&mut out, "Max concurrency", c);
            }
        }
    }
    line(&mut out, "Successful requests", m.completed);
    line(&mut out, "Failed requests", m.failed);
    line(
        &mut out,
        "Benchmark duration (s)",
        format!("{:.2}", m.duration_s),
    );
    line(&mut out, "Total input tokens", m.total_input_tokens);
    if let Some(n) = m.server_input_tokens.filter(|&n| n != m.total_input_tokens) {
        line(&mut out, "Input tokens, as the server counted", n);
    }
    line(&mut out, "Total generated tokens", m.total_output_tokens);
    line(
        &mut out,
        "Request throughput (req/s)",
        format!("{:.2}", m.request_throughput),
    );
    line(
        &mut out,
        "Output token throughput (tok/s)",
        format!("{:.2}", m.output_throughput),
    );
    line(
        &mut out,
        "Total token throughput (tok/s)",
        format!("{:.2}", m.total_token_throughput),
    );
    line(
        &mut out,
        "Prefix cache hit rate",
        rate(m.prefix_cache_hit_rate),
    );
    for (title, short, stats) in [
        ("Time to First Token", "TTFT", &m.ttft_ms),
        (
            "Time per Output Token (excl. 1st token)",
            "TPOT",
            &m.tpot_ms,
        ),
        ("Inter-token Latency", "ITL", &m.itl_ms),
        ("End-to-end Latency", "E2EL", &m.e2el_ms),
    ] {
        let _ = writeln!(out, "{}", heading(title, '-'));
        line(
            &mut out,
            &format!("Mean {short} (ms)"),
            format!("{:.2}", stats.mean),
        );
        line(
            &mut out,
            &format!("Median {short} (ms)"),
            format!("{:.2}", stats.median),
        );
        for &p in percentiles {
            let v = stats.p(p).unwrap_or(0.0);
            line(&mut out, &format!("P{p} {short} (ms)"), format!("{v:.2}"));
        }
    }
    if let Some(c) = &m.conversation {
        let _ = writeln!(out, "{}", heading("Conversations", '-'));
        line(&mut out, "Conversations", c.conversations);
        line(&mut out, "Turns per conversation", c.turns);
        line(
            &mut out,
            "Prefix cache hit rate, turn 1",
            rate(c.first_turn.prefix_cache_hit_rate),
        );
        line(
            &mut out,
            "Prefix cache hit rate, later turns",
            rate(c.later_turns.prefix_cache_hit_rate),
        );
        line(
            &mut out,
            "Mean TTFT, turn 1 (ms)",
            format!("{:.2}", c.first_turn.ttft_ms.mean),
        );
        line(
            &mut out,
            "Mean TTFT, later turns (ms)",
            format!("{:.2}", c.later_turns.ttft_ms.mean),
        );
    }
    let _ = writeln!(out, "{}", "=".repeat(WIDTH));
    out
}

/// The first few failures' errors, so a failing run says why without opening the JSON.
pub fn failures(outcomes: &[Outcome], show: usize) -> String {
    let failed: Vec<(usize, &str)> = outcomes
        .iter()
        .enumerate()
        .filter_map(|(i, o)| o.error.as_deref().map(|e| (i, e)))
        .collect();
    let mut out = String::new();
    if failed.is_empty() {
        return out;
    }
    let _ = writeln!(out, "{} request(s) failed; the first:", failed.len());
    for (i, e) in failed.iter().take(show) {
        let _ = writeln!(out, "  request {i}: {e}");
    }
    out
}

/// The sweep's table, in Markdown so it pastes into a README or an issue as it is.
pub fn summary_table(label: &str, axis: Axis, rows: &[SummaryRow]) -> String {
    let mut head = vec![
        axis.title(),
        "req/s",
        "output tok/s",
        "mean TTFT (ms)",
        "P99 TTFT (ms)",
        "mean TPOT (ms)",
        "P99 TPOT (ms)",
        "mean ITL (ms)",
        "failed",
    ];
    // Cache columns only where there is something to show in them.
    let hits = rows.iter().any(|r| r.prefix_cache_hit_rate.is_some());
    let conversations = rows.iter().any(|r| r.conversation.is_some());
    if hits || conversations {
        head.push("cache hit");
    }
    if conversations {
        head.extend(["turn 1 hit", "later hit"]);
    }
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut cells = vec![
                fmt_x(r.load.x()),
                format!("{:.2}", r.request_throughput),
                format!("{:.1}", r.output_throughput),
                format!("{:.1}", r.mean_ttft_ms),
                format!("{:.1}", r.p99_ttft_ms),
                format!("{:.2}", r.mean_tpot_ms),
                format!("{:.2}", r.p99_tpot_ms),
                format!("{:.2}", r.mean_itl_ms),
                r.failed.to_string(),
            ];
            if hits || conversations {
                cells.push(rate(r.prefix_cache_hit_rate));
            }
            if conversations {
                let c = r.conversation.as_ref();
                cells.push(rate(c.and_then(|c| c.first_turn_hit_rate)));
                cells.push(rate(c.and_then(|c| c.later_turns_hit_rate)));
            }
            cells
        })
        .collect();
    let widths: Vec<usize> = (0..head.len())
        .map(|c| {
            body.iter()
                .map(|r| r[c].len())
                .chain([head[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let row = |cells: Vec<String>| {
        let cells: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, &w)| format!("{c:>w$}"))
            .collect();
        format!("| {} |\n", cells.join(" | "))
    };
    let mut out = format!("Sweep summary: {label}\n\n");
    out += &row(head.iter().map(|s| s.to_string()).collect());
    out += &format!(
        "|{}|\n",
        widths
            .iter()
            .map(|&w| format!("{}:", "-".repeat(w + 1)))
            .collect::<Vec<_>>()
            .join("|")
    );
    for r in body {
        out += &row(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::metrics::ConversationMetrics;
    use super::*;

    fn metrics() -> Metrics {
        let o = Outcome {
            ok: true,
            ttft: 0.1,
            itl: vec![0.01; 3],
            e2el: 0.13,
            output_tokens: 4,
            server_prompt_tokens: Some(9),
            cached_tokens: None,
            text: "four".into(),
            error: None,
        };
        Metrics::compute(&[o.clone(), o], &[8, 8], 0.5, &[90.0, 99.0])
    }

    #[test]
    fn the_block_has_every_section_and_the_asked_percentiles() {
        let m = metrics();
        let b = run_block(
            "x",
            &Load::Concurrency { concurrency: 2 },
            &m,
            &[90.0, 99.0],
        );
        for want in [
            "Serving Benchmark Result",
            "Successful requests:                             2",
            "Total input tokens:                             16",
            "Input tokens, as the server counted:            18",
            "Total generated tokens:                          8",
            "Request throughput (req/s):                   4.00",
            "Output token throughput (tok/s):             16.00",
            "Mean TTFT (ms):                             100.00",
            "P90 TPOT (ms):                               10.00",
            "P99 ITL (ms):                                10.00",
            "Median E2EL (ms):                           130.00",
            "Time per Output Token (excl. 1st token)",
        ] {
            assert!(b.contains(want), "{want:?} not in\n{b}");
        }
        assert!(b.lines().all(|l| l.len() <= WIDTH), "{b}");
    }

    #[test]
    fn the_sweep_table_has_a_row_per_run() {
        let m = metrics();
        let rows: Vec<SummaryRow> = [1, 4]
            .map(|c| SummaryRow::new(Load::Concurrency { concurrency: c }, &m))
            .to_vec();
        let t = summary_table("lbl", Axis::Concurrency, &rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 6, "{t}");
        assert!(lines[2].starts_with("| concurrency | req/s |"), "{t}");
        assert!(lines[4].starts_with("|           1 |  4.00 |"), "{t}");
        assert!(lines[5].contains(" 16.0 |"), "{t}");
        let mut lens = lines[2..].iter().map(|l| l.len());
        let first = lens.next();
        assert!(lens.all(|l| Some(l) == first), "aligned columns:\n{t}");
    }

    #[test]
    fn conversation_runs_show_the_hit_rate_by_turn_and_n_a_when_unknown() {
        let turn = |ttft: f64, prompt: usize, cached: Option<usize>| Outcome {
            ok: true,
            ttft,
            e2el: ttft + 0.05,
            output_tokens: 4,
            server_prompt_tokens: Some(prompt),
            cached_tokens: cached,
            ..Outcome::default()
        };
        let outcomes = [turn(0.2, 100, Some(0)), turn(0.1, 200, Some(96))];
        let mut m = Metrics::compute(&outcomes, &[100, 200], 1.0, &[99.0]);
        m.conversation = Some(ConversationMetrics::compute(&outcomes, 2, &[99.0]));
        let load = Load::Concurrency { concurrency: 1 };
        let b = run_block("x", &load, &m, &[99.0]);
        for want in [
            "Prefix cache hit rate:                       32.0%",
            "----------------- Conversations ------------------",
            "Conversations:                                   1",
            "Turns per conversation:                          2",
            "Prefix cache hit rate, turn 1:                0.0%",
            "Prefix cache hit rate, later turns:          48.0%",
            "Mean TTFT, turn 1 (ms):                     200.00",
            "Mean TTFT, later turns (ms):                100.00",
        ] {
            assert!(b.contains(want), "{want:?} not in\n{b}");
        }
        assert!(b.lines().all(|l| l.len() <= WIDTH), "{b}");
        let row = SummaryRow::new(load, &m);
        let j = serde_json::to_value(&row).unwrap();
        assert_eq!(j["prefix_cache_hit_rate"], 0.32);
        assert_eq!(j["conversation"]["later_turns_hit_rate"], 0.48);
        let t = summary_table("x", Axis::Concurrency, &[row.clone(), row]);
        assert!(t.contains("| cache hit | turn 1 hit | later hit |"), "{t}");
        assert!(t.contains("|     32.0% |       0.0% |     48.0% |"), "{t}");

        // A server that does not report its cache: n/a and null, never 0.
        let unknown = [turn(0.2, 100, None), turn(0.1, 200, None)];
        let mut m = Metrics::compute(&unknown, &[100, 200], 1.0, &[99.0]);
        m.conversation = Some(ConversationMetrics::compute(&unknown, 2, &[99.0]));
        let b = run_block("x", &load, &m, &[99.0]);
        for name in [
            "Prefix cache hit rate:",
            "Prefix cache hit rate, later turns:",
        ] {
            let want = format!("{name:<40}{:>10}", "n/a");
            assert!(b.contains(&want), "{want:?} not in\n{b}");
        }
        let j = serde_json::to_value(SummaryRow::new(load, &m)).unwrap();
        assert!(j["prefix_cache_hit_rate"].is_null(), "{j}");
        assert!(j["conversation"]["first_turn_hit_rate"].is_null(), "{j}");
        let j = serde_json::to_value(&m).unwrap();
        assert!(
            j["conversation"]["later_turns"]["prefix_cache_hit_rate"].is_null(),
            "{j}"
        );
    }

    #[test]
    fn summaries_written_before_the_cache_fields_still_read() {
        let m = metrics();
        let mut row =
            serde_json::to_value(SummaryRow::new(Load::Concurrency { concurrency: 1 }, &m))
                .unwrap();
        row.as_object_mut().unwrap().remove("prefix_cache_hit_rate");
        let old: SummaryRow = serde_json::from_value(row).unwrap();
        assert_eq!(
            (old.prefix_cache_hit_rate, &old.conversation),
            (None, &None)
        );
        // Rows without a known rate add no cache column.
        let t = summary_table("x", Axis::Concurrency, &[old]);
        assert!(!t.contains("cache hit"), "{t}");
    }

    #[test]
    fn failures_are_listed_with_their_index() {
        let o = [
            Outcome::default(),
            Outcome::failed("HTTP 404: no such model", 0.0),
        ];
        assert_eq!(
            failures(&o, 3),
            "1 request(s) failed; the first:\n  request 1: HTTP 404: no such model\n"
        );
        assert_eq!(failures(&o[..1], 3), "");
        assert_eq!(slug("my model/v2 (fp8)"), "my_model_v2__fp8_");
    }
}
