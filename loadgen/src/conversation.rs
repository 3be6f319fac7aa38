//! `--dataset conversation`: multi-turn chats, the workload a prefix cache (and prefix-aware
//! routing) is for.
//!
//! Each conversation opens with a passage of the plays (`--input-len` tokens) and goes on for
//! `--turns` turns; every later turn sends the whole history — the earlier user messages and
//! the assistant's replies exactly as the server streamed them — plus a new passage
//! (`--turn-input-len` tokens). A turn is sent when the previous one's answer has ended, so
//! all but the new message is a prefix the server has seen. Conversations open with different
//! passages, so they share no prefix beyond the chat template's own tokens.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use indicatif::ProgressBar;
use kvmesh_gpu::tokenizer::TextTokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::client::{self, Target};
use super::dataset;
use super::metrics::Outcome;

pub const DEFAULT_CONVERSATIONS: usize = 32;
pub const DEFAULT_TURNS: usize = 5;
pub const DEFAULT_TURN_INPUT_LEN: usize = 32;

/// An opening passage starts at a line of a speech at least this long, so two conversations
/// do not open alike ("Ay.", "Come, come.").
const MIN_OPENING_LINE: usize = 24;

/// Openings differ within this many tokens (the line they start with differs too).
const OPENING_KEY_TOKENS: usize = 3;

/// Draws of an opening before one is taken even if it starts like another (only thousands
/// of conversations run out of fresh lines).
const OPENING_DRAWS: usize = 64;

/// What to build.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Conversations to make (a sweep makes fresh ones for each of its runs).
    pub conversations: usize,
    pub turns: usize,
    /// Tokens of the opening message.
    pub input_len: usize,
    /// Tokens of each later user message.
    pub turn_input_len: usize,
    /// Tokens generated per turn.
    pub output_len: usize,
    pub range_ratio: f64,
    pub seed: u64,
}

/// One conversation's user side; the assistant's side is whatever the server answers.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    /// The user message of each turn.
    pub user: Vec<String>,
    /// Tokens to generate in each turn.
    pub output_lens: Vec<usize>,
}

impl Conversation {
    pub fn turns(&self) -> usize {
        self.user.len()
    }

    /// The messages of the turn after `replies`, the assistant's answers so far: every
    /// earlier exchange, then the next user message.
    pub fn messages(&self, replies: &[String]) -> Vec<Value> {
        let turn = replies.len();
        assert!(
            turn < self.turns(),
            "a conversation has {} turns",
            self.turns()
        );
        let mut m = Vec::with_capacity(2 * turn + 1);
        for (user, reply) in self.user.iter().zip(replies) {
            m.push(json!({"role": "user", "content": user}));
            m.push(json!({"role": "assistant", "content": reply}));
        }
        m.push(json!({"role": "user", "content": self.user[turn]}));
        m
    }
}

/// Conversation `index`'s own random stream: a conversation is the same whatever the count.
fn rng_for(seed: u64, index: usize) -> StdRng {
    StdRng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// `spec.conversations` conversations, the same for the same seed. Each opens with a passage
/// whose first line no other opening starts with.
pub fn build(tok: &TextTokenizer, spec: &Spec) -> Result<Vec<Conversation>> {
    let inputs = dataset::length_range(spec.input_len, spec.range_ratio);
    let turn_inputs = dataset::length_range(spec.turn_input_len, spec.range_ratio);
    let outputs = dataset::length_range(spec.output_len, spec.range_ratio);
    if *inputs.start() == 0 || *turn_inputs.start() == 0 {
        bail!(
            "--input-len {} and --turn-input-len {} (with --range-ratio {}) must leave every \
             message at least one token",
            spec.input_len,
            spec.turn_input_len,
            spec.range_ratio
        );
    }
    if *outputs.start() == 0 {
        bail!("--output-len must be at least 1");
    }
    let (mut lines, mut keys) = (HashSet::new(), HashSet::new());
    (0..spec.conversations)
        .map(|i| {
            let mut rng = rng_for(spec.seed, i);
            let mut user = Vec::with_capacity(spec.turns);
            let mut output_lens = Vec::with_capacity(spec.turns);
            for turn in 0..spec.turns {
                let len = if turn == 0 {
                    rng.random_range(inputs.clone())
                } else {
                    rng.random_range(turn_inputs.clone())
                };
                output_lens.push(rng.random_range(outputs.clone()));
                let passage = if turn == 0 {
                    // Drawn again until it starts unlike every earlier opening: another line,
                    // other first tokens.
                    let mut draws = 0;
                    loop {
                        let (p, line) =
                            dataset::dialogue_passage(tok, len, MIN_OPENING_LINE, &mut rng)?;
                        let ids = tok.encode(&p, false)?;
                        let key = ids[..ids.len().min(OPENING_KEY_TOKENS)].to_vec();
                        draws += 1;
                        if (!lines.contains(&line) && !keys.contains(&key))
                            || draws == OPENING_DRAWS
                        {
                            lines.insert(line);
                            keys.insert(key);
                            break p;
                        }
                    }
                } else {
                    dataset::dialogue_passage(tok, len, 1, &mut rng)?.0
                };
                user.push(passage);
            }
            Ok(Conversation { user, output_lens })
        })
        .collect()
}

/// The warm-up request's message: a passage none of the conversations opens with (its own
/// random stream), so the warm-up leaves nothing in the cache that a first turn could hit.
pub fn warm_up_message(tok: &TextTokenizer, spec: &Spec) -> Result<String> {
    let mut rng = StdRng::seed_from_u64(spec.seed ^ 0x77a2_6d00_0000_0001);
    Ok(dataset::dialogue_passage(tok, spec.input_len.min(32), 1, &mut rng)?.0)
}

/// Prompt tokens of a chat request as a server with this tokenizer counts them: its chat
/// template rendered and tokenized, else (no template) the messages' own tokens.
pub fn prompt_len(tok: &TextTokenizer, messages: &[Value]) -> Result<usize> {
    if tok.has_chat_template() {
        let text = tok.apply_chat_template(messages, true)?;
        return Ok(tok.encode(&text, false)?.len());
    }
    let mut n = dataset::count(tok, "")?;
    for m in messages {
        n += tok
            .encode(m["content"].as_str().unwrap_or(""), false)?
            .len();
    }
    Ok(n)
}

/// Refuses conversations whose last turn cannot fit the served model's context: the opening,
/// every later message and reply, the last reply, and the chat template's tokens around them.
pub fn check_context(tok: &TextTokenizer, spec: &Spec, max_model_len: usize) -> Result<()> {
    let hi = |len: usize| *dataset::length_range(len, spec.range_ratio).end();
    let empty = Conversation {
        user: vec![String::new(); spec.turns],
        output_lens: vec![0; spec.turns],
    };
    let template = prompt_len(tok, &empty.messages(&vec![String::new(); spec.turns - 1]))?;
    let later = spec.turns - 1;
    let need = template
        + hi(spec.input_len)
        + later * (hi(spec.turn_input_len) + hi(spec.output_len))
        + hi(spec.output_len);
    if need > max_model_len {
        bail!(
            "a conversation's last turn needs about {need} tokens (an opening of {}, {later} \
             later turn(s) of {} plus {} generated each, {} generated last, {template} of chat \
             template), more than the served model's context of {max_model_len}; lower --turns, \
             --input-len, --turn-input-len or --output-len",
            hi(spec.input_len),
            hi(spec.turn_input_len),
            hi(spec.output_len),
            hi(spec.output_len),
        );
    }
    Ok(())
}

/// Holds every conversation, at most `active` at once (the next starts when one ends), and
/// waits for all. Returns the outcomes conversation by conversation — turn t of conversation
/// c at `c * turns + t` — and the wall time from the first send to the last answer.
///
/// With a think time (`think_ms`, the mean, and the run's seed), every turn, the first
/// included, waits a pause drawn from an exponential distribution before it is sent: users
/// read and type, so conversations drift apart in time instead of all sending at once.
pub async fn run(
    http: &reqwest::Client,
    target: &Target,
    conversations: &Arc<Vec<Conversation>>,
    active: usize,
    think: Option<(f64, u64)>,
    bar: &ProgressBar,
) -> (Vec<Outcome>, f64) {
    // Fair: conversations start in order as permits free.
    let permits = Arc::new(Semaphore::new(active.max(1)));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(conversations.len());
    for c in 0..conversations.len() {
        let permit = permits.clone().acquire_owned().await.expect("never closed");
        let (http, target, conversations, bar) = (
            http.clone(),
            target.clone(),
            conversations.clone(),
            bar.clone(),
        );
        // The conversation's own pauses, the same for the same seed.
        let pauses: Vec<f64> = match think {
            Some((mean_ms, seed)) if mean_ms > 0.0 => {
                let mut rng = rng_for(seed ^ 0x7468_696e_6b00_0000, c);
                (0..conversations[c].turns())
                    .map(|_| -mean_ms * (1.0 - rng.random::<f64>()).ln())
                    .collect()
            }
            _ => vec![0.0; conversations[c].turns()],
        };
        tasks.push(tokio::spawn(async move {
            let outcomes = talk(&http, &target, &conversations[c], &pauses, &bar).await;
            drop(permit);
            outcomes
        }));
    }
    let mut outcomes = Vec::new();
    for (c, t) in tasks.into_iter().enumerate() {
        match t.await {
            Ok(o) => outcomes.extend(o),
            Err(e) => outcomes.extend(
                (0..conversations[c].turns())
                    .map(|_| Outcome::failed(format!("conversation task failed: {e}"), 0.0)),
            ),
        }
    }
    (outcomes, start.elapsed().as_secs_f64())
}

/// One conversation, turn after turn. After a failed turn there is no reply to go on with:
/// the turns left fail unsent, so every conversation accounts for all its turns.
async fn talk(
    http: &reqwest::Client,
    target: &Target,
    conv: &Conversation,
    pauses_ms: &[f64],
    bar: &ProgressBar,
) -> Vec<Outcome> {
    let mut replies: Vec<String> = Vec::with_capacity(conv.turns());
    let mut outcomes = Vec::with_capacity(conv.turns());
    for turn in 0..conv.turns() {
        let pause = pauses_ms.get(turn).copied().unwrap_or(0.0);
        if pause > 0.0 {
            tokio::time::sleep(std::time::Duration::from_secs_f64(pause / 1e3)).await;
        }
        let body = target.chat_body(&conv.messages(&replies), conv.output_lens[turn]);
        let o = client::send_body(http, target, &body).await;
        bar.inc(1);
        let ok = o.ok;
        replies.push(o.text.clone());
        outcomes.push(o);
        if !ok {
            for _ in turn + 1..conv.turns() {
                outcomes.push(Outcome::failed(
                    format!("not sent: turn {} of this conversation failed", turn + 1),
                    0.0,
                ));
                bar.inc(1);
            }
            break;
        }
    }
    outcomes
}

/// Each request's prompt length, counted as [`prompt_len`] does, from the replies the run
/// got; 0 for a turn that was never sent.
pub fn prompt_lens(
    tok: &TextTokenizer,
    conversations: &[Conversation],
    outcomes: &[Outcome],
) -> Result<Vec<usize>> {
    let mut lens = Vec::with_capacity(outcomes.len());
    let mut i = 0;
    for conv in conversations {
        let turns = &outcomes[i..i + conv.turns()];
        i += conv.turns();
        let mut replies = Vec::new();
        for (t, o) in turns.iter().enumerate() {
            let sent = turns[..t].iter().all(|o| o.ok);
            lens.push(if sent {
                prompt_len(tok, &conv.messages(&replies))?
            } else {
                0
            });
            replies.push(o.text.clone());
        }
    }
    Ok(lens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> TextTokenizer {
        TextTokenizer::from_files(&kvmesh_gpu::embedded::default_tokenizer(), &[]).unwrap()
    }

    fn spec(conversations: usize, turns: usize, seed: u64) -> Spec {
        Spec {
            conversations,
            turns,
            input_len: 64,
            turn_input_len: 16,
            output_len: 8,
            range_ratio: 0.0,
            seed,
        }
    }

    fn common_prefix(a: &[u32], b: &[u32]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn conversations_are_reproducible_and_of_the_asked_lengths() {
        let tok = tokenizer();
        let a = build(&tok, &spec(6, 3, 5)).unwrap();
        assert_eq!(a, build(&tok, &spec(6, 3, 5)).unwrap());
        assert_ne!(a, build(&tok, &spec(6, 3, 6)).unwrap());
        // Conversation i does not depend on how many there are.
        assert_eq!(a[..4], build(&tok, &spec(4, 3, 5)).unwrap()[..]);
        for c in &a {
            assert_eq!(c.turns(), 3);
            assert_eq!(c.output_lens, [8, 8, 8]);
            // Content tokens, without the bos a chat template adds on its own.
            let len = |t: &str| tok.encode(t, false).unwrap().len();
            assert_eq!(len(&c.user[0]), 64, "{:?}", c.user[0]);
            assert_eq!(len(&c.user[1]), 16, "{:?}", c.user[1]);
            assert_eq!(len(&c.user[2]), 16);
        }
        let spread = build(
            &tok,
            &Spec {
                range_ratio: 0.5,
                ..spec(8, 4, 1)
            },
        )
        .unwrap();
        let outs: HashSet<usize> = spread.iter().flat_map(|c| c.output_lens.clone()).collect();
        assert!(
            outs.len() > 1 && outs.iter().all(|n| (4..=12).contains(n)),
            "{outs:?}"
        );
    }

    #[test]
    fn conversations_open_differently() {
        let tok = tokenizer();
        let convs = build(&tok, &spec(48, 2, 0)).unwrap();
        let template = |c: &Conversation| {
            let text = tok.apply_chat_template(&c.messages(&[]), true).unwrap();
            tok.encode(&text, false).unwrap()
        };
        // The template's own tokens before the message: what any two first turns share.
        let empty = Conversation {
            user: vec![String::new()],
            output_lens: vec![1],
        };
        let shared = common_prefix(&template(&empty), &template(&convs[0]));
        let ids: Vec<Vec<u32>> = convs.iter().map(template).collect();
        let mut most = 0;
        for i in 0..ids.len() {
            for j in 0..i {
                most = most.max(common_prefix(&ids[i], &ids[j]));
            }
        }
        // Beyond the template, fewer tokens in common than the openings are told apart by.
        assert!(
            most < shared + OPENING_KEY_TOKENS,
            "{most} tokens shared, the template has {shared}"
        );
        let firsts: HashSet<&str> = convs
            .iter()
            .map(|c| c.user[0].lines().next().unwrap())
            .collect();
        assert_eq!(firsts.len(), convs.len());
    }

    #[test]
    fn each_turn_carries_the_whole_history_with_the_replies_as_received() {
        let tok = tokenizer();
        let c = &build(&tok, &spec(1, 3, 2)).unwrap()[0];
        let m = c.messages(&[]);
        assert_eq!(m, [json!({"role": "user", "content": c.user[0]})]);
        let replies = [
            "Thou speak'st  aright;".to_string(),
            " I am that merry".to_string(),
        ];
        let m = c.messages(&replies);
        let roles: Vec<&str> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["user", "assistant", "user", "assistant", "user"]);
        // Replies go back verbatim, spaces and all, and the history only grows.
        assert_eq!(m[1]["content"], replies[0]);
        assert_eq!(m[3]["content"], replies[1]);
        assert_eq!(m[4]["content"], c.user[2]);
        assert_eq!(c.messages(&replies[..1])[..], m[..3]);
        // Each turn's rendered prompt starts with the previous turn's prompt and its reply.
        let render = |r: &[String]| tok.apply_chat_template(&c.messages(r), true).unwrap();
        let (t2, t3) = (render(&replies[..1]), render(&replies));
        assert!(t3.starts_with(&(render(&[]) + &replies[0])), "{t3:?}");
        assert!(t3.starts_with(&(t2 + &replies[1])), "{t3:?}");
    }

    #[test]
    fn prompt_lengths_follow_the_replies_and_stop_at_a_failure() {
        let tok = tokenizer();
        let convs = build(&tok, &spec(2, 3, 4)).unwrap();
        let reply = |text: &str| Outcome {
            ok: true,
            text: text.into(),
            ..Outcome::default()
        };
        let outcomes = [
            reply("Good morrow"),
            reply("to you"),
            reply("sir"),
            reply("Ay"),
            Outcome::failed("HTTP 500", 0.1),
            Outcome::failed("not sent", 0.0),
        ];
        let lens = prompt_lens(&tok, &convs, &outcomes).unwrap();
        let replies = ["Good morrow".to_string(), "to you".to_string()];
        assert_eq!(lens[0], prompt_len(&tok, &convs[0].messages(&[])).unwrap());
        assert_eq!(
            lens[2],
            prompt_len(&tok, &convs[0].messages(&replies)).unwrap()
        );
        assert!(lens[0] < lens[1] && lens[1] < lens[2], "{lens:?}");
        assert!(lens[4] > lens[3], "the failed turn was sent: {lens:?}");
        assert_eq!(lens[5], 0, "the turn after it was not");
    }

    #[test]
    fn conversations_longer_than_the_context_are_refused() {
        let tok = tokenizer();
        let s = spec(1, 5, 0);
        // 64 + 4 * (16 + 8) + 8 = 168, plus the template's tokens around 9 messages.
        let template = prompt_len(
            &tok,
            &Conversation {
                user: vec![String::new(); 5],
                output_lens: vec![8; 5],
            }
            .messages(&vec![String::new(); 4]),
        )
        .unwrap();
        assert!(template > 9, "{template}");
        check_context(&tok, &s, 168 + template).unwrap();
        let e = check_context(&tok, &s, 167 + template)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("needs about {}", 168 + template))
                && e.contains(&format!("context of {}", 167 + template))
                && e.contains("--turns"),
            "{e}"
        );
        let e = build(
            &tok,
            &Spec {
                turn_input_len: 1,
                range_ratio: 0.5,
                ..s
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--turn-input-len"), "{e}");
    }
}
