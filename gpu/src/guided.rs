//! Constrained decoding: a request's grammar (a JSON schema, a regex, a choice of strings, a
//! Lark grammar, or a tool call's shape) as the set of tokens allowed next, over the model's
//! own vocabulary. llguidance computes the masks; this module builds its view of the
//! vocabulary, compiles grammars within bounds, and keeps one matcher per sequence.
//!
//! A grammar travels between nodes as llguidance's `TopLevelGrammar` JSON (see [`Guide`]),
//! so what a gateway checked is exactly what every worker compiles.

use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::api::ParserLimits;
pub use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

/// A sequence's constraint as it travels: the grammar and how many of the prompt's last
/// tokens are output the grammar has already read (a sequence continued on another worker,
/// whose prompt ends with the tokens streamed so far).
#[derive(Clone, Debug, PartialEq)]
pub struct Guide {
    /// llguidance's `TopLevelGrammar`, as JSON.
    pub grammar: Arc<str>,
    pub replay: usize,
}

impl Guide {
    pub fn new(grammar: &TopLevelGrammar) -> Guide {
        Guide {
            grammar: serde_json::to_string(grammar)
                .expect("a grammar serialises")
                .into(),
            replay: 0,
        }
    }
}

/// Grammars for what requests ask, in llguidance's terms.
pub mod grammar {
    use super::*;

    /// JSON that validates against `schema`, written compactly (`", "` between items,
    /// `": "` after keys, no other whitespace): free whitespace lets a weak model pad its
    /// output with blanks until `max_tokens`.
    pub fn json_schema(schema: Value) -> TopLevelGrammar {
        TopLevelGrammar::from_json_schema(compact(schema))
    }

    /// The schema with llguidance's layout options for compact JSON, unless it sets its own.
    pub fn compact(mut schema: Value) -> Value {
        if let Some(o) = schema.as_object_mut() {
            o.entry("x-guidance").or_insert_with(|| {
                serde_json::json!({
                    "whitespace_flexible": false,
                    "item_separator": ", ",
                    "key_separator": ": ",
                })
            });
        }
        schema
    }

    /// Any JSON object (OpenAI's JSON mode).
    pub fn json_object() -> TopLevelGrammar {
        json_schema(serde_json::json!({"type": "object"}))
    }

    pub fn regex(rx: &str) -> TopLevelGrammar {
        TopLevelGrammar::from_regex(rx)
    }

    /// Exactly one of `choices`.
    pub fn choice(choices: &[String]) -> TopLevelGrammar {
        let alts: Vec<String> = choices.iter().map(|c| lark_string(c)).collect();
        TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
    }

    pub fn lark(text: &str) -> TopLevelGrammar {
        TopLevelGrammar::from_lark(text.to_string())
    }

    /// A Lark string literal for `s`.
    pub fn lark_string(s: &str) -> String {
        serde_json::to_string(s).expect("a string serialises")
    }
}

/// The largest grammar (as llguidance JSON: a schema, regex or Lark text with its framing)
/// a request may bring. Compile time grows with size; past this it is refused unread.
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// How long compiling one grammar may take before the request is refused. llguidance's own
/// limits (lexer fuel, grammar size) bound the work; this bounds the clock on top.
pub const COMPILE_BUDGET: Duration = Duration::from_millis(500);

/// Compiled grammars kept for the next request that brings the same one (the usual case:
/// one schema or one set of tools per application). Past this many the cache starts over.
const CACHED_GRAMMARS: usize = 256;

/// A model's vocabulary as llguidance sees it, and the factory of its matchers.
pub struct Guides {
    factory: Arc<ParserFactory>,
    vocab: usize,
    /// Fresh matchers by grammar text: a new sequence starts from a clone, which shares the
    /// original's lexer caches.
    cache: parking_lot::Mutex<std::collections::HashMap<Arc<str>, Matcher>>,
}

impl Guides {
    /// From the model's `tokenizer.json` (as a value), its eos ids and the number of logits
    /// it produces (which may exceed the tokenizer's vocabulary: the rest are never allowed).
    pub fn new(tokenizer_json: &Value, eos_ids: &[u32], n_logits: usize) -> Result<Guides, String> {
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(tokenizer_json).map_err(|e| {
                format!("cannot read this tokenizer's vocabulary for constrained decoding: {e}")
            })?;
        if words.len() > n_logits {
            return Err(format!(
                "the tokenizer has {} tokens but the model only {n_logits} logits",
                words.len()
            ));
        }
        while words.len() < n_logits {
            let mut w = format!(".<[{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let Some(&eos) = eos_ids.first() else {
            return Err("the model has no eos token to end a constrained output with".into());
        };
        let info = TokRxInfo::new(n_logits as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if eos_ids.len() > 1 {
            trie = trie.with_eos_tokens(eos_ids);
        }
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        let limits = factory.limits_mut();
        *limits = ParserLimits {
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Guides {
            factory: Arc::new(factory),
            vocab: n_logits,
            cache: Default::default(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// A matcher for `guide`, its replayed tokens consumed; a grammar that does not compile
    /// (or takes longer than [`COMPILE_BUDGET`]) is refused with llguidance's reason.
    pub fn start(&self, guide: &Guide, prompt: &[u32]) -> Result<Guided, String> {
        let cached = self.cache.lock().get(&guide.grammar).cloned();
        let mut g = match cached {
            Some(matcher) => Guided {
                matcher,
                failed: None,
            },
            None => {
                let grammar: TopLevelGrammar = serde_json::from_str(&guide.grammar)
                    .map_err(|e| format!("the grammar is not llguidance JSON: {e}"))?;
                let g = self.compile(grammar)?;
                let mut cache = self.cache.lock();
                if cache.len() >= CACHED_GRAMMARS {
                    cache.clear();
                }
                cache.insert(guide.grammar.clone(), g.matcher.clone());
                g
            }
        };
        if guide.replay > prompt.len() {
            return Err(format!(
                "the grammar replays {} tokens of a {}-token prompt",
                guide.replay,
                prompt.len()
            ));
        }
        for &t in &prompt[prompt.len() - guide.replay..] {
            g.consume(t)?;
        }
        Ok(g)
    }

    /// llguidance's parser for `grammar`, built on a thread of its own: past
    /// [`COMPILE_BUDGET`] the request is refused and that thread's result discarded, so a
    /// grammar slow to build never holds the caller.
    fn create_within_budget(
        &self,
        grammar: TopLevelGrammar,
    ) -> Result<llguidance::TokenParser, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let factory = self.factory.clone();
        std::thread::Builder::new()
            .name("kvmesh-grammar".into())
            .spawn(move || {
                let _ = tx.send(factory.create_parser(grammar).map_err(|e| e.to_string()));
            })
            .map_err(|e| format!("cannot start compiling the grammar: {e}"))?;
        match rx.recv_timeout(COMPILE_BUDGET) {
            Ok(r) => r,
            Err(_) => Err(format!(
                "the grammar did not compile within {} ms",
                COMPILE_BUDGET.as_millis()
            )),
        }
    }

    /// Compiles `grammar` and computes its first mask (which is where a schema's or
    /// regex's errors surface), within [`COMPILE_BUDGET`].
    pub fn compile(&self, grammar: TopLevelGrammar) -> Result<Guided, String> {
        let started = Instant::now();
        let size = serde_json::to_string(&grammar).map_or(usize::MAX, |s| s.len());
        if size > MAX_GRAMMAR_BYTES {
            return Err(format!(
                "the grammar is {size} bytes, over the {MAX_GRAMMAR_BYTES} allowed"
            ));
        }
        let parser = self.create_within_budget(grammar)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        let mut mask = Vec::new();
        let mut g = Guided {
            matcher,
            failed: None,
        };
        g.fill_mask(&mut mask);
        if let Some(e) = g.failed.take() {
            return Err(e);
        }
        let took = started.elapsed();
        if took > COMPILE_BUDGET {
            return Err(format!(
                "the grammar took {} ms to compile, over the {} ms allowed",
                took.as_millis(),
                COMPILE_BUDGET.as_millis()
            ));
        }
        Ok(g)
    }
}

/// [`Guides`] built the first time a request asks for a grammar: reading a large vocabulary
/// into llguidance's trie takes a while, and most servers may never need it.
pub struct LazyGuides {
    tokenizer_json: Box<dyn Fn() -> Value + Send + Sync>,
    eos_ids: Vec<u32>,
    n_logits: usize,
    built: std::sync::OnceLock<Result<Guides, String>>,
}

impl LazyGuides {
    pub fn new(tok: Arc<crate::tokenizer::TextTokenizer>, n_logits: usize) -> LazyGuides {
        LazyGuides {
            eos_ids: tok.eos_ids().to_vec(),
            tokenizer_json: Box::new(move || tok.tokenizer_json()),
            n_logits,
            built: std::sync::OnceLock::new(),
        }
    }

    pub fn get(&self) -> Result<&Guides, String> {
        self.built
            .get_or_init(|| Guides::new(&(self.tokenizer_json)(), &self.eos_ids, self.n_logits))
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// One sequence's matcher.
pub struct Guided {
    matcher: Matcher,
    failed: Option<String>,
}

impl std::fmt::Debug for Guided {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guided")
            .field("stopped", &self.matcher.is_stopped())
            .field("failed", &self.failed)
            .finish()
    }
}

/// Words of a mask over `vocab` tokens: bit `t % 32` of word `t / 32` allows token `t`.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

impl Guided {
    /// The tokens allowed next, as a bitmask (see [`mask_words`]). When the matcher fails it
    /// allows nothing and [`Guided::failure`] says why.
    pub fn fill_mask(&mut self, out: &mut Vec<u32>) {
        out.clear();
        match self.matcher.compute_mask_or_eos() {
            Ok(v) => out.extend_from_slice(v.as_slice()),
            Err(e) => {
                self.failed.get_or_insert(e.to_string());
            }
        }
    }

    /// Reads a chosen token. A token the grammar does not allow fails the matcher.
    pub fn consume(&mut self, token: u32) -> Result<(), String> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| {
            let e = format!("token {token} does not fit the grammar: {e}");
            self.failed = Some(e.clone());
            e
        })
    }

    /// The grammar is complete and allows nothing more.
    pub fn is_stopped(&self) -> bool {
        self.failed.is_none() && self.matcher.is_stopped()
    }

    /// Fails the matcher from outside (its mask could not be computed).
    pub fn poison(&mut self, why: &str) {
        self.failed.get_or_insert_with(|| why.to_string());
    }

    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }
}

/// Sets the logits of tokens the mask does not allow to minus infinity.
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let word = mask.get(w).copied().unwrap_or(0);
        if word == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if word >> b & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded;

    fn guides() -> (Guides, crate::tokenizer::TextTokenizer) {
        let tok = crate::tokenizer::TextTokenizer::from_files(&embedded::default_tokenizer(), &[])
            .unwrap();
        let g = Guides::new(&tok.tokenizer_json(), tok.eos_ids(), tok.vocab_size()).unwrap();
        (g, tok)
    }

    /// Greedy through the mask with a "model" that prefers token `pref`: the text the
    /// grammar lets through.
    fn run(
        g: &mut Guided,
        tok: &crate::tokenizer::TextTokenizer,
        pref: &[f32],
        eos: u32,
    ) -> String {
        let mut mask = Vec::new();
        let mut out = Vec::new();
        for _ in 0..200 {
            g.fill_mask(&mut mask);
            assert!(g.failure().is_none(), "{:?}", g.failure());
            let mut l = pref.to_vec();
            apply_mask(&mut l, &mask);
            let t = crate::sampler::argmax_of(&l);
            if t == eos {
                break;
            }
            g.consume(t).unwrap();
            out.push(t);
            if g.is_stopped() {
                break;
            }
        }
        tok.decode(&out, true).unwrap()
    }

    #[test]
    fn schemas_regexes_and_choices_shape_the_output() {
        let (guides, tok) = guides();
        let eos = tok.eos_ids()[0];
        let n = tok.vocab_size();
        // A "model" that likes letters and spaces best.
        let pref: Vec<f32> = (0..n).map(|i| ((i * 7919) % 101) as f32 / 10.0).collect();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
            "required": ["name", "age"], "additionalProperties": false
        });
        let mut g = guides.compile(grammar::json_schema(schema)).unwrap();
        let text = run(&mut g, &tok, &pref, eos);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(v["name"].is_string() && v["age"].is_i64(), "{text}");

        let mut g = guides.compile(grammar::regex("[0-9]{3}-[a-z]{2}")).unwrap();
        let text = run(&mut g, &tok, &pref, eos);
        assert_eq!(text.len(), 6, "{text}");
        assert!(text.as_bytes()[3] == b'-', "{text}");

        let choices = vec!["yes".to_string(), "no way".to_string()];
        let mut g = guides.compile(grammar::choice(&choices)).unwrap();
        let text = run(&mut g, &tok, &pref, eos);
        assert!(choices.contains(&text), "{text}");
    }

    #[test]
    fn bad_grammars_are_refused_with_the_reason() {
        let (guides, _) = guides();
        let e = guides.compile(grammar::regex("(unclosed")).unwrap_err();
        assert!(!e.is_empty());
        let e = guides
            .compile(grammar::lark("start: undefined_rule"))
            .unwrap_err();
        assert!(e.contains("undefined_rule"), "{e}");
        let e = guides
            .compile(grammar::json_schema(
                serde_json::json!({"type": "no-such-type"}),
            ))
            .unwrap_err();
        assert!(e.contains("no-such-type"), "{e}");
    }

    /// A grammar over the size limit is refused before it is read.
    #[test]
    fn an_oversized_grammar_is_refused_unread() {
        let (guides, _) = guides();
        let alts = |n: usize| -> String {
            let a: Vec<String> = (0..n).map(|i| format!("\"w{i}x\"")).collect();
            format!("start: a+\na: {}", a.join(" | "))
        };
        let e = guides.compile(grammar::lark(&alts(200_000))).unwrap_err();
        assert!(e.contains("bytes, over the"), "{e}");
    }

    #[test]
    fn a_replayed_guide_continues_where_the_first_left_off() {
        let (guides, tok) = guides();
        let g = Guide::new(&grammar::regex("abc[0-9]+"));
        let prompt = tok.encode("hello abc", false).unwrap();
        let out = tok.encode("abc", false).unwrap();
        let mut full = prompt.clone();
        full.extend_from_slice(&out);
        let resumed = Guide {
            replay: out.len(),
            ..g.clone()
        };
        let mut m = guides.start(&resumed, &full).unwrap();
        let mut mask = Vec::new();
        m.fill_mask(&mut mask);
        let digit = tok.encode("7", false).unwrap()[0];
        let letter = tok.encode("x", false).unwrap()[0];
        let allowed = |t: u32| mask[t as usize / 32] >> (t % 32) & 1 == 1;
        assert!(allowed(digit) && !allowed(letter));
        // Replaying tokens the grammar does not allow is refused.
        let bad = Guide { replay: 2, ..g };
        assert!(guides.start(&bad, &prompt).is_err());
    }
}
