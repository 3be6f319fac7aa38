//! Text in and out: the Hugging Face tokenizer, the chat template, eos ids, and incremental
//! detokenization that never splits a UTF-8 character and never lets a stop string leak.

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde_json::Value;

use crate::config::token_ids;
use crate::error::{EngineError, Result};

/// The text side of a model: tokenizer, chat template and the token ids that end generation.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<Environment<'static>>,
    /// The chat template's text (what tool-call format the model speaks is read from it).
    template_text: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos: bool,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    defaults: SamplingDefaults,
    /// Where the chat template and the eos ids were read from, for `model inspect`.
    template_source: Option<&'static str>,
    eos_source: &'static str,
    /// The vocabulary's size, added tokens included: counted once (the library builds the
    /// whole vocabulary map to count it, and requests ask for it).
    vocab_size: usize,
}

/// Sampling settings the model's `generation_config.json` recommends; requests that leave a
/// setting out get these, as vLLM does.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
}

/// The files a tokenizer is made from, read from a model folder or from the binary.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerFiles {
    pub tokenizer_json: Vec<u8>,
    pub tokenizer_config: Option<String>,
    pub chat_template_jinja: Option<String>,
    pub generation_config: Option<String>,
}

impl TokenizerFiles {
    pub fn read_dir(dir: &Path) -> Result<TokenizerFiles> {
        let tj = dir.join("tokenizer.json");
        let tokenizer_json = std::fs::read(&tj).map_err(|e| {
            EngineError::BadModel(format!("{} is missing or unreadable ({e})", tj.display()))
        })?;
        let opt = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        Ok(TokenizerFiles {
            tokenizer_json,
            tokenizer_config: opt("tokenizer_config.json"),
            chat_template_jinja: opt("chat_template.jinja"),
            generation_config: opt("generation_config.json"),
        })
    }
}

/// A special token given as a string or as an AddedToken object.
fn token_content(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

fn template_error(e: minijinja::Error) -> EngineError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    EngineError::ChatTemplate(msg)
}

impl TextTokenizer {
    /// `config_eos` are the eos ids from config.json, used when generation_config.json has none.
    pub fn from_files(files: &TokenizerFiles, config_eos: &[u32]) -> Result<TextTokenizer> {
        let inner = tokenizers::Tokenizer::from_bytes(&files.tokenizer_json)
            .map_err(|e| EngineError::Tokenizer(format!("tokenizer.json: {e}")))?;
        let tc: Value = match &files.tokenizer_config {
            Some(t) => serde_json::from_str(t)
                .map_err(|e| EngineError::BadModel(format!("tokenizer_config.json: {e}")))?,
            None => Value::Null,
        };
        let bos_token = token_content(tc.get("bos_token"));
        let eos_token = token_content(tc.get("eos_token"));
        let (template_text, template_source) = match files.chat_template_jinja.clone() {
            Some(t) => (Some(t), Some("chat_template.jinja")),
            None => match tc.get("chat_template") {
                Some(Value::String(s)) => (
                    Some(s.clone()),
                    Some("tokenizer_config.json (chat_template)"),
                ),
                Some(Value::Array(list)) => (
                    list.iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                        .or(list.first())
                        .and_then(|t| t.get("template"))
                        .and_then(Value::as_str)
                        .map(String::from),
                    Some("tokenizer_config.json (chat_template list, the default entry)"),
                ),
                _ => (None, None),
            },
        };
        let chat_template = match template_text.clone() {
            Some(t) => Some(Self::compile_template(t)?),
            None => None,
        };
        let gen: Value = files
            .generation_config
            .as_deref()
            .and_then(|g| serde_json::from_str::<Value>(g).ok())
            .unwrap_or(Value::Null);
        let defaults = SamplingDefaults {
            temperature: gen.get("temperature").and_then(Value::as_f64),
            top_p: gen.get("top_p").and_then(Value::as_f64),
            top_k: gen.get("top_k").and_then(Value::as_i64),
        };
        let mut eos_ids: Vec<u32> = gen.get("eos_token_id").map(token_ids).unwrap_or_default();
        let mut eos_source = "generation_config.json";
        if eos_ids.is_empty() {
            eos_ids = config_eos.to_vec();
            eos_source = "config.json";
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
                eos_source = if eos_ids.len() == 1 {
                    "tokenizer_config.json (eos_token)"
                } else {
                    "generation_config.json / config.json, plus tokenizer_config.json's eos_token"
                };
            }
        }
        let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let vocab_size = inner.get_vocab_size(true);
        Ok(TextTokenizer {
            vocab_size,
            add_bos: tc
                .get("add_bos_token")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            template_source: chat_template.is_some().then_some(template_source).flatten(),
            inner,
            chat_template,
            template_text,
            bos_token,
            eos_token,
            bos_id,
            eos_ids,
            defaults,
            eos_source,
        })
    }

    fn compile_template(text: String) -> Result<Environment<'static>> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", text)
            .map_err(template_error)?;
        Ok(env)
    }

    /// Which file the chat template came from, if there is one.
    pub fn chat_template_source(&self) -> Option<&'static str> {
        self.template_source
    }

    /// Which file the eos ids came from.
    pub fn eos_source(&self) -> &'static str {
        self.eos_source
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    pub fn chat_template_text(&self) -> Option<&str> {
        self.template_text.as_deref()
    }

    /// The id of an added token whose text is `content`, if the vocabulary has one.
    pub fn added_token_id(&self, content: &str) -> Option<u32> {
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .find(|(_, t)| t.content == content)
            .map(|(id, _)| id)
    }

    /// Renders `messages` (OpenAI-shaped objects with `role` and string `content`).
    pub fn apply_chat_template(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders `messages` with the functions the model may call given to the template as
    /// `tools` (the OpenAI tool objects, as Hugging Face templates take them).
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = self.chat_template.as_ref().ok_or_else(|| {
            EngineError::ChatTemplate(
                "this model has no chat template (tokenizer_config.json or chat_template.jinja); \
                 use /v1/completions"
                    .into(),
            )
        })?;
        let tmpl = env.get_template("chat").map_err(template_error)?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(template_error)
    }

    /// Tokenizes text. With `add_special`, a completion prompt starts with bos where the model
    /// expects one; a rendered chat template already carries its own.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        // Ids only: the offsets `encode` also works out are never read here.
        let enc = self
            .inner
            .encode_fast(text, add_special)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special && self.add_bos {
            if let Some(b) = self.bos_id {
                if ids.first() != Some(&b) {
                    ids.insert(0, b);
                }
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// Every (token, id) of the vocabulary, added tokens included, sorted by id: what two
    /// tokenizers must share for the same ids to mean the same text.
    pub fn vocabulary(&self) -> Vec<(u32, String)> {
        let mut v: Vec<(u32, String)> = self
            .inner
            .get_vocab(true)
            .into_iter()
            .map(|(t, id)| (id, t))
            .collect();
        v.sort_unstable();
        v
    }

    /// The token's own text, for logprobs.
    pub fn token_text(&self, id: u32) -> String {
        self.inner.decode(&[id], false).unwrap_or_default()
    }

    pub fn sampling_defaults(&self) -> &SamplingDefaults {
        &self.defaults
    }

    /// The tokenizer as its `tokenizer.json` holds it (constrained decoding reads the
    /// vocabulary's bytes from it).
    pub fn tokenizer_json(&self) -> Value {
        serde_json::to_value(&self.inner).unwrap_or(Value::Null)
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

/// Turns a stream of token ids into text deltas: a character split across tokens is held back
/// until complete, and so is any tail that could still become a stop string.
pub struct TextStream {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Decoded but not yet released text.
    pending: String,
    stops: Vec<String>,
    longest_stop: usize,
    stopped: bool,
}

/// What one more token released.
#[derive(Debug, Default, PartialEq)]
pub struct Delta {
    pub text: String,
    /// A stop string was found: `text` ends just before it and the stream is over.
    pub stopped: bool,
}

impl TextStream {
    /// `context` is the tail of the prompt, so the first token decodes with the spacing it
    /// has in context (sentencepiece tokenizers drop a leading space when decoded alone).
    pub fn new(context: &[u32], stops: Vec<String>) -> TextStream {
        let tail = &context[context.len().saturating_sub(4)..];
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        TextStream {
            ids: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
            pending: String::new(),
            longest_stop: stops.iter().map(|s| s.len()).max().unwrap_or(0),
            stops,
            stopped: false,
        }
    }

    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<Delta> {
        if self.stopped {
            return Ok(Delta {
                text: String::new(),
                stopped: true,
            });
        }
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let after = tok.decode(&self.ids[self.prefix_offset..], true)?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            if let Some(new) = after.get(before.len()..) {
                self.pending.push_str(new);
            } else {
                self.pending.push_str(&after);
            }
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
        }
        Ok(self.release(false))
    }

    /// Releases what is held back once generation has ended for another reason.
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<Delta> {
        if self.stopped {
            return Ok(Delta {
                text: String::new(),
                stopped: true,
            });
        }
        if self.read_offset < self.ids.len() {
            let before = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
            let after = tok.decode(&self.ids[self.prefix_offset..], true)?;
            if let Some(new) = after.get(before.len()..) {
                self.pending.push_str(new);
            }
            self.read_offset = self.ids.len();
        }
        Ok(self.release(true))
    }

    fn release(&mut self, all: bool) -> Delta {
        if let Some(pos) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let text = self.pending[..pos].to_string();
            self.pending.clear();
            self.stopped = true;
            return Delta {
                text,
                stopped: true,
            };
        }
        let keep = if all {
            0
        } else {
            self.longest_stop.saturating_sub(1)
        };
        let mut cut = self.pending.len().saturating_sub(keep);
        while !self.pending.is_char_boundary(cut) {
            cut -= 1;
        }
        let text: String = self.pending.drain(..cut).collect();
        Delta {
            text,
            stopped: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn default_tokenizer() -> TextTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/shakespeare");
        TextTokenizer::from_files(&TokenizerFiles::read_dir(&dir).unwrap(), &[]).unwrap()
    }

    fn stream_all(tok: &TextTokenizer, ids: &[u32], stops: &[&str]) -> (Vec<String>, bool) {
        let mut s = TextStream::new(&[], stops.iter().map(|s| s.to_string()).collect());
        let mut parts = Vec::new();
        for &id in ids {
            let d = s.push(tok, id).unwrap();
            parts.push(d.text);
            if d.stopped {
                return (parts, true);
            }
        }
        let d = s.finish(tok).unwrap();
        parts.push(d.text);
        (parts, d.stopped)
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let tok = default_tokenizer();
        let text = "Naïve café — ünïcödé 🎭 and 日本語, good my lord.";
        let ids = tok.encode(text, false).unwrap();
        let (parts, stopped) = stream_all(&tok, &ids, &[]);
        assert!(!stopped);
        assert!(parts.iter().all(|p| !p.contains('\u{FFFD}')), "{parts:?}");
        assert_eq!(parts.concat(), text);
    }

    #[test]
    fn stop_strings_cut_and_do_not_leak_across_tokens() {
        let tok = default_tokenizer();
        let text = "To be, or not to be, that is the question.";
        let ids = tok.encode(text, false).unwrap();
        let (parts, stopped) = stream_all(&tok, &ids, &["not to", "zzz"]);
        assert!(stopped);
        assert_eq!(parts.concat(), "To be, or ");
        assert!(parts.iter().all(|p| !p.contains("not")));
        let (parts, stopped) = stream_all(&tok, &ids, &["zzz"]);
        assert!(!stopped);
        assert_eq!(parts.concat(), text);
    }

    #[test]
    fn chat_template_renders_with_a_generation_prompt() {
        let tok = default_tokenizer();
        let msgs = vec![serde_json::json!({"role": "user", "content": "Good morrow."})];
        let text = tok.apply_chat_template(&msgs, true).unwrap();
        assert!(text.contains("Good morrow."), "{text}");
        assert!(
            text.ends_with(":\n"),
            "ends with the assistant's speaker line: {text:?}"
        );
    }
}
