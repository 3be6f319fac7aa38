//! The prompts a benchmark sends: random text of exact token lengths, passages of Shakespeare,
//! or the opening human turns of a ShareGPT conversation file. (`conversation`, multi-turn
//! chats, is built in `conversation.rs` from the passages here.)
//!
//! A prompt's length is counted the way `/v1/completions` counts it: the served model's
//! tokenizer with its special tokens (a leading bos, for most models). So a completions run
//! with `--input-len 32` makes the server report 32 prompt tokens per request; chat adds the
//! chat template's tokens on top.

use std::cmp::Ordering;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use kvmesh_gpu::tokenizer::TextTokenizer;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::Value;

/// Shakespeare's plays, the text the embedded model was trained on; compiled in so the
/// benchmark runs from any directory.
const SHAKESPEARE: &str = include_str!("../../data/tinyshakespeare.txt");

#[derive(Clone, Debug, PartialEq)]
pub enum DatasetArg {
    Random,
    Shakespeare,
    /// Multi-turn chats of Shakespeare passages, each turn sending the whole history.
    Conversation,
    ShareGpt(PathBuf),
}

/// A `--dataset` value that names no dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownDataset(pub String);

impl fmt::Display for UnknownDataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown dataset {:?}: use random, shakespeare, conversation or sharegpt:PATH",
            self.0
        )
    }
}

impl std::error::Error for UnknownDataset {}

impl FromStr for DatasetArg {
    type Err = UnknownDataset;

    fn from_str(s: &str) -> std::result::Result<Self, UnknownDataset> {
        match s {
            "random" => Ok(DatasetArg::Random),
            "shakespeare" => Ok(DatasetArg::Shakespeare),
            "conversation" => Ok(DatasetArg::Conversation),
            _ => match s.strip_prefix("sharegpt:") {
                Some(p) if !p.is_empty() => Ok(DatasetArg::ShareGpt(PathBuf::from(p))),
                _ => Err(UnknownDataset(s.to_string())),
            },
        }
    }
}

impl fmt::Display for DatasetArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DatasetArg::Random => write!(f, "random"),
            DatasetArg::Shakespeare => write!(f, "shakespeare"),
            DatasetArg::Conversation => write!(f, "conversation"),
            DatasetArg::ShareGpt(p) => write!(f, "sharegpt:{}", p.display()),
        }
    }
}

/// One request to send.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub prompt: String,
    pub prompt_len: usize,
    pub output_len: usize,
}

/// What to build: the lengths the flags ask for.
pub struct Spec<'a> {
    pub dataset: &'a DatasetArg,
    pub num_prompts: usize,
    pub input_len: usize,
    /// `None`: 128 for the synthetic datasets, the reply's length for ShareGPT.
    pub output_len: Option<usize>,
    pub range_ratio: f64,
    /// The served model's context, where the server said; longer requests are not made.
    pub max_model_len: Option<usize>,
    pub seed: u64,
}

pub const DEFAULT_OUTPUT_LEN: usize = 128;

/// The samples, and for ShareGPT a line saying what was skipped.
pub fn build(tok: &TextTokenizer, spec: &Spec) -> Result<(Vec<Sample>, Option<String>)> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    match spec.dataset {
        DatasetArg::Random | DatasetArg::Shakespeare => {
            let out_len = spec.output_len.unwrap_or(DEFAULT_OUTPUT_LEN);
            let inputs = length_range(spec.input_len, spec.range_ratio);
            let outputs = length_range(out_len, spec.range_ratio);
            let floor = count(tok, "")? + 1;
            if *inputs.start() < floor {
                bail!(
                    "--input-len {} (with --range-ratio {}) allows prompts shorter than {floor} tokens, \
                     the tokenizer's special tokens plus one",
                    spec.input_len,
                    spec.range_ratio
                );
            }
            if *outputs.start() == 0 {
                bail!("--output-len must be at least 1");
            }
            if let Some(max) = spec.max_model_len {
                if inputs.end() + outputs.end() > max {
                    bail!(
                        "prompts of up to {} tokens plus {} generated exceed the served model's \
                         context of {max} tokens; lower --input-len or --output-len",
                        inputs.end(),
                        outputs.end()
                    );
                }
            }
            let vocab = if *spec.dataset == DatasetArg::Random {
                plain_tokens(tok)?
            } else {
                vec![]
            };
            (0..spec.num_prompts)
                .map(|_| {
                    let target = rng.random_range(inputs.clone());
                    let output_len = rng.random_range(outputs.clone());
                    let prompt = if vocab.is_empty() {
                        shakespeare_prompt(tok, target, &mut rng)?
                    } else {
                        random_prompt(tok, target, &vocab, &mut rng)?
                    };
                    Ok(Sample {
                        prompt,
                        prompt_len: target,
                        output_len,
                    })
                })
                .collect::<Result<Vec<_>>>()
                .map(|s| (s, None))
        }
        DatasetArg::ShareGpt(path) => {
            sharegpt(tok, path, spec, &mut rng).map(|(s, n)| (s, Some(n)))
        }
        DatasetArg::Conversation => {
            bail!("--dataset conversation makes conversations, not single prompts")
        }
    }
}

/// Tokens in `text` as the completions endpoint counts them.
pub fn count(tok: &TextTokenizer, text: &str) -> Result<usize> {
    Ok(tok.encode(text, true)?.len())
}

/// `len` widened by `ratio` either way, as an inclusive range.
pub(super) fn length_range(len: usize, ratio: f64) -> std::ops::RangeInclusive<usize> {
    let lo = (len as f64 * (1.0 - ratio)).floor() as usize;
    let hi = (len as f64 * (1.0 + ratio)).floor() as usize;
    lo..=hi.max(lo)
}

/// Tokens that decode on their own to printable ASCII. Random prompts are drawn from these so
/// the text never holds half a UTF-8 character (which would decode to a replacement sign and
/// re-tokenize into something else) or a special token's name.
fn plain_tokens(tok: &TextTokenizer) -> Result<Vec<u32>> {
    let ids: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&id| {
            let t = tok.decode(&[id], true).unwrap_or_default();
            !t.is_empty() && t.bytes().all(|b| b == b' ' || b.is_ascii_graphic())
        })
        .collect();
    if ids.len() < 16 {
        bail!("the tokenizer has too few plain-text tokens to make random prompts from");
    }
    Ok(ids)
}

/// Text of exactly `target` tokens. Cutting a token sequence and decoding it can tokenize
/// differently at the cut (pieces merge across it), so the text is cut and topped up until
/// its count is exact; with a byte-level or word-piece tokenizer that takes a round or two.
fn fit(
    tok: &TextTokenizer,
    target: usize,
    more: &mut dyn FnMut(usize) -> String,
) -> Result<String> {
    let mut text = more(target);
    for _ in 0..64 {
        let ids = tok.encode(&text, true)?;
        match ids.len().cmp(&target) {
            Ordering::Equal => return Ok(text),
            // Special tokens are skipped: the tokenizer adds them back on encode.
            Ordering::Greater => text = tok.decode(&ids[..target], true)?,
            Ordering::Less => text.push_str(&more(target - ids.len())),
        }
    }
    bail!("could not make a prompt of exactly {target} tokens with this tokenizer")
}

fn random_prompt(
    tok: &TextTokenizer,
    target: usize,
    vocab: &[u32],
    rng: &mut StdRng,
) -> Result<String> {
    fit(tok, target, &mut |n| {
        let ids: Vec<u32> = (0..n)
            .map(|_| vocab[rng.random_range(0..vocab.len())])
            .collect();
        tok.decode(&ids, true).unwrap_or_default()
    })
}

/// Consecutive text from a random line of the plays, wrapping at the end.
fn shakespeare_prompt(tok: &TextTokenizer, target: usize, rng: &mut StdRng) -> Result<String> {
    shakespeare_from(tok, target, random_line(rng))
}

/// The start of a random line of the plays.
fn random_line(rng: &mut StdRng) -> usize {
    let text = SHAKESPEARE;
    let guess = rng.random_range(0..text.len());
    text[guess..].find('\n').map_or(0, |i| guess + i + 1)
}

/// A passage of the plays for a chat message, of `content_tokens` tokens without the
/// tokenizer's special tokens (a chat template adds its own), starting at a line of a speech
/// of at least `min_line` characters: not at a blank line or a speaker's name, which recur.
/// Returns the passage and its first line.
pub(super) fn dialogue_passage(
    tok: &TextTokenizer,
    content_tokens: usize,
    min_line: usize,
    rng: &mut StdRng,
) -> Result<(String, String)> {
    let text = SHAKESPEARE;
    let mut pos = random_line(rng);
    // Some line qualifies within a few speeches; the bound only guards against a bad text.
    for _ in 0..text.len() {
        let end = text[pos..].find('\n').map_or(text.len(), |i| pos + i);
        let line = &text[pos..end];
        if line.len() >= min_line && !line.ends_with(':') {
            let specials = count(tok, "")?;
            let passage = shakespeare_from(tok, content_tokens + specials, pos)?;
            return Ok((passage, line.to_string()));
        }
        pos = if end + 1 >= text.len() { 0 } else { end + 1 };
    }
    bail!("no line of the plays is {min_line} characters long")
}

/// Consecutive text from byte `pos` of the plays (a line start), wrapping at the end, of
/// exactly `target` tokens as the completions endpoint counts them.
fn shakespeare_from(tok: &TextTokenizer, target: usize, mut pos: usize) -> Result<String> {
    let text = SHAKESPEARE;
    fit(tok, target, &mut |n| {
        // Plenty of characters for n tokens; `fit` cuts what is over.
        let mut want = n * 8 + 16;
        let mut out = String::new();
        while want > 0 {
            if pos >= text.len() {
                pos = 0;
            }
            let mut end = (pos + want).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            out.push_str(&text[pos..end]);
            want = want.saturating_sub(end - pos);
            pos = end;
        }
        out
    })
}

/// A ShareGPT file: `[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
/// "value": ...}, ...]}, ...]`. Each usable conversation gives its first human turn as the
/// prompt and the reply's length as the output length (unless `--output-len` fixes it).
fn sharegpt(
    tok: &TextTokenizer,
    path: &Path,
    spec: &Spec,
    rng: &mut StdRng,
) -> Result<(Vec<Sample>, String)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the ShareGPT file {}", path.display()))?;
    let not_sharegpt = || {
        anyhow::anyhow!(
            "{} is not a ShareGPT file: expected a JSON list of {{\"conversations\": \
             [{{\"from\": \"human\", \"value\": ...}}, {{\"from\": \"gpt\", \"value\": ...}}]}}",
            path.display()
        )
    };
    let all: Value = serde_json::from_str(&text).map_err(|e| not_sharegpt().context(e))?;
    let entries = all.as_array().ok_or_else(not_sharegpt)?;
    if !entries.is_empty() && !entries.iter().any(|e| e.get("conversations").is_some()) {
        return Err(not_sharegpt());
    }
    // Shuffled first, then tokenized only until there are enough: real ShareGPT files hold
    // tens of thousands of conversations.
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.shuffle(rng);
    let (mut malformed, mut too_short, mut too_long) = (0, 0, 0);
    let mut samples = Vec::new();
    for &i in &order {
        if samples.len() == spec.num_prompts {
            break;
        }
        let Some((prompt, reply)) = first_exchange(&entries[i]) else {
            malformed += 1;
            continue;
        };
        let prompt_len = count(tok, prompt)?;
        let output_len = match spec.output_len {
            Some(n) => n,
            None => tok.encode(reply, false)?.len(),
        };
        // Too short to say anything about a server: what serving benchmarks conventionally drop.
        if prompt_len < 4 || output_len < 4 {
            too_short += 1;
            continue;
        }
        if spec
            .max_model_len
            .is_some_and(|max| prompt_len + output_len > max)
        {
            too_long += 1;
            continue;
        }
        samples.push(Sample {
            prompt: prompt.to_string(),
            prompt_len,
            output_len,
        });
    }
    if samples.is_empty() {
        bail!(
            "{} has no usable conversations ({} entries: {malformed} without a human turn and a \
             reply, {too_short} too short, {too_long} longer than the model's context)",
            path.display(),
            entries.len()
        );
    }
    let usable = samples.len();
    // Fewer usable conversations than prompts asked: reuse them, so every run has the count.
    for i in 0..spec.num_prompts.saturating_sub(usable) {
        samples.push(samples[i % usable].clone());
    }
    let mut note = format!(
        "{}: {} conversations, {usable} used",
        path.display(),
        entries.len()
    );
    for (n, what) in [
        (malformed, "malformed"),
        (too_short, "too short"),
        (too_long, "too long for the model"),
    ] {
        if n > 0 {
            note.push_str(&format!(", {n} skipped as {what}"));
        }
    }
    if usable < spec.num_prompts {
        note.push_str(&format!(", reused to make {}", spec.num_prompts));
    }
    Ok((samples, note))
}

/// The first human turn with text and the reply that follows it.
fn first_exchange(entry: &Value) -> Option<(&str, &str)> {
    fn role(t: &Value) -> Option<&str> {
        t.get("from").and_then(Value::as_str)
    }
    fn text(t: &Value) -> Option<&str> {
        t.get("value").and_then(Value::as_str)
    }
    let turns = entry.get("conversations")?.as_array()?;
    let h = turns.iter().position(|t| {
        matches!(role(t), Some("human" | "user")) && text(t).is_some_and(|s| !s.is_empty())
    })?;
    let reply = turns.get(h + 1)?;
    if !matches!(role(reply), Some("gpt" | "assistant" | "chatgpt")) {
        return None;
    }
    Some((text(&turns[h])?, text(reply)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> TextTokenizer {
        TextTokenizer::from_files(&kvmesh_gpu::embedded::default_tokenizer(), &[]).unwrap()
    }

    fn spec(dataset: &DatasetArg, input_len: usize, range_ratio: f64, seed: u64) -> Spec<'_> {
        Spec {
            dataset,
            num_prompts: 40,
            input_len,
            output_len: Some(16),
            range_ratio,
            max_model_len: Some(512),
            seed,
        }
    }

    #[test]
    fn synthetic_prompts_tokenize_to_exactly_their_length() {
        let tok = tokenizer();
        for dataset in [DatasetArg::Random, DatasetArg::Shakespeare] {
            for input_len in (2..=480).step_by(19) {
                let mut s = spec(&dataset, input_len, 0.0, input_len as u64);
                s.num_prompts = 12;
                let (samples, _) = build(&tok, &s).unwrap();
                assert_eq!(samples.len(), 12);
                for s in &samples {
                    assert_eq!(s.prompt_len, input_len);
                    assert_eq!(
                        count(&tok, &s.prompt).unwrap(),
                        input_len,
                        "{dataset} {s:?}"
                    );
                    assert_eq!(s.output_len, 16);
                }
            }
        }
    }

    #[test]
    fn range_ratio_spreads_lengths_and_the_seed_reproduces_them() {
        let tok = tokenizer();
        let d = DatasetArg::Random;
        let (a, _) = build(&tok, &spec(&d, 64, 0.5, 11)).unwrap();
        let (b, _) = build(&tok, &spec(&d, 64, 0.5, 11)).unwrap();
        let (c, _) = build(&tok, &spec(&d, 64, 0.5, 12)).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|s| (32..=96).contains(&s.prompt_len)));
        assert!(a.iter().any(|s| s.prompt_len != a[0].prompt_len));
        assert!(a.iter().all(|s| (8..=24).contains(&s.output_len)));
        for s in &a {
            assert_eq!(count(&tok, &s.prompt).unwrap(), s.prompt_len);
        }
    }

    #[test]
    fn lengths_the_model_cannot_hold_are_refused_up_front() {
        let tok = tokenizer();
        let d = DatasetArg::Random;
        let mut s = spec(&d, 500, 0.0, 0);
        let e = build(&tok, &s).unwrap_err().to_string();
        assert!(e.contains("context of 512"), "{e}");
        s.input_len = 1;
        let e = build(&tok, &s).unwrap_err().to_string();
        assert!(e.contains("shorter than 2 tokens"), "{e}");
    }

    #[test]
    fn dataset_names_parse() {
        assert_eq!("random".parse(), Ok(DatasetArg::Random));
        assert_eq!("conversation".parse(), Ok(DatasetArg::Conversation));
        assert_eq!(DatasetArg::Conversation.to_string(), "conversation");
        assert_eq!(
            "sharegpt:/x/y.json".parse(),
            Ok(DatasetArg::ShareGpt("/x/y.json".into()))
        );
        assert!("sharegpt:".parse::<DatasetArg>().is_err());
        let e = "wiki".parse::<DatasetArg>().unwrap_err();
        assert_eq!(e, UnknownDataset("wiki".into()));
        assert!(e.to_string().contains("sharegpt:PATH"), "{e}");
    }

    fn write(name: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("kvmesh-bench-{}-{name}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn sharegpt_uses_first_human_turns_and_skips_malformed_entries() {
        let tok = tokenizer();
        let reply = "Thou art as wise as thou art beautiful, and speak like a king.";
        let file = serde_json::json!([
            {"conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "What news from Verona, good sir?"},
                {"from": "gpt", "value": reply},
                {"from": "human", "value": "Never the second turn."},
            ]},
            {"conversations": [{"from": "human", "value": "No reply here at all."}]},
            {"id": "no conversations"},
            {"conversations": "not a list"},
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend."}]},
        ]);
        let path = write("ok.json", &file.to_string());
        let d = DatasetArg::ShareGpt(path.clone());
        let mut s = spec(&d, 0, 0.0, 1);
        s.output_len = None;
        s.num_prompts = 3;
        let (samples, note) = build(&tok, &s).unwrap();
        let note = note.unwrap();
        assert_eq!(samples.len(), 3, "the one usable entry is reused");
        for x in &samples {
            assert_eq!(x.prompt, "What news from Verona, good sir?");
            assert_eq!(x.prompt_len, count(&tok, &x.prompt).unwrap());
            assert_eq!(x.output_len, tok.encode(reply, false).unwrap().len());
        }
        assert!(note.contains("1 used"), "{note}");
        assert!(note.contains("3 skipped as malformed"), "{note}");
        assert!(note.contains("1 skipped as too short"), "{note}");
        // --output-len overrides the reply's length.
        s.output_len = Some(9);
        assert!(build(&tok, &s).unwrap().0.iter().all(|x| x.output_len == 9));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn sharegpt_errors_name_the_file_and_the_problem() {
        let tok = tokenizer();
        let err = |d: DatasetArg| {
            let mut s = spec(&d, 0, 0.0, 1);
            s.output_len = None;
            format!("{:#}", build(&tok, &s).unwrap_err())
        };
        let e = err(DatasetArg::ShareGpt("/nonexistent/sg.json".into()));
        assert!(
            e.contains("cannot read the ShareGPT file /nonexistent/sg.json"),
            "{e}"
        );
        for (name, text) in [
            ("obj.json", r#"{"conversations": []}"#),
            ("list.json", r#"[{"prompt": "x"}]"#),
            ("bad.json", "not json"),
        ] {
            let p = write(name, text);
            let e = err(DatasetArg::ShareGpt(p.clone()));
            assert!(e.contains("is not a ShareGPT file"), "{name}: {e}");
            std::fs::remove_file(p).unwrap();
        }
        let p = write(
            "empty.json",
            r#"[{"conversations": [{"from": "gpt", "value": "x"}]}]"#,
        );
        let e = err(DatasetArg::ShareGpt(p.clone()));
        assert!(e.contains("no usable conversations"), "{e}");
        std::fs::remove_file(p).unwrap();
    }
}
