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
use llguidance::earley::ParserError;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::Value;

mod depth;
mod error;

pub use depth::MAX_GRAMMAR_DEPTH;
pub use error::GuidedError;

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

/// How the engine's report of a sequence whose grammar failed while generating begins (a
/// grammar can compile and still exceed llguidance's per-step limits later, or run out of
/// lexer states): a gateway answers it as the grammar's fault, naming the field.
pub const GRAMMAR_FAILED: &str = "constrained decoding failed: ";

/// The largest grammar (as llguidance JSON: a schema, regex or Lark text with its framing)
/// a request may bring. Compile time grows with size; past this it is refused unread.
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// How long compiling one grammar may take before the request is refused. llguidance's own
/// limits (lexer fuel, grammar size) bound the work; this bounds the clock on top.
pub const COMPILE_BUDGET: Duration = Duration::from_millis(500);

/// The most memory compiled grammars kept for later requests may take (estimated from
/// their lexer tables and grammar size): past it the least recently used are dropped. The
/// usual case, one schema or one set of tools per application, takes a few of them.
pub const GRAMMAR_CACHE_BYTES: usize = 256 << 20;

/// The compiling thread's stack: compiling recurses along a grammar's structure, which
/// [`MAX_GRAMMAR_DEPTH`] bounds; this leaves a wide margin above what that depth needs.
const COMPILE_STACK_BYTES: usize = 64 << 20;

/// A compiled grammar kept for reuse: each sequence starts from a deep copy of it, so no
/// sequence's lexer state (which grows with what it generates, up to llguidance's state
/// limit) is shared with another's.
struct Cached {
    /// Fresh (nothing consumed), with the lexer tables its first mask built.
    parser: TokenParser,
    bytes: usize,
    last_used: u64,
}

#[derive(Default)]
struct GrammarCache {
    entries: std::collections::HashMap<Arc<str>, Cached>,
    bytes: usize,
    clock: u64,
}

impl GrammarCache {
    fn get(&mut self, key: &str) -> Option<TokenParser> {
        self.clock += 1;
        let now = self.clock;
        self.entries.get_mut(key).map(|c| {
            c.last_used = now;
            c.parser.deep_clone()
        })
    }

    /// Keeps `parser` under `key`, dropping the least recently used entries to stay within
    /// `budget` bytes; one larger than the whole budget is not kept.
    fn insert(&mut self, key: Arc<str>, parser: TokenParser, bytes: usize, budget: usize) {
        if bytes > budget {
            return;
        }
        self.clock += 1;
        if let Some(old) = self.entries.remove(&key) {
            self.bytes -= old.bytes;
        }
        while self.bytes + bytes > budget {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, c)| c.last_used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some(c) = self.entries.remove(&oldest) {
                self.bytes -= c.bytes;
            }
        }
        self.bytes += bytes;
        self.entries.insert(
            key,
            Cached {
                parser,
                bytes,
                last_used: self.clock,
            },
        );
    }
}

/// A model's vocabulary as llguidance sees it, and the factory of its matchers.
pub struct Guides {
    factory: Arc<ParserFactory>,
    vocab: usize,
    /// Compiled grammars by their text, within [`GRAMMAR_CACHE_BYTES`].
    cache: parking_lot::Mutex<GrammarCache>,
    cache_budget: usize,
    /// Grammars known to compile (see [`Guides::validate`]).
    validated: parking_lot::Mutex<TextSet>,
    /// Grammars compiled so far.
    compiles: std::sync::atomic::AtomicU64,
}

/// The most bytes of grammar text remembered as known to compile.
pub const VALIDATED_BYTES: usize = 16 << 20;

/// Texts within a byte budget; past it the set starts over.
#[derive(Default)]
struct TextSet {
    texts: std::collections::HashSet<Arc<str>>,
    bytes: usize,
}

impl TextSet {
    fn contains(&self, t: &str) -> bool {
        self.texts.contains(t)
    }

    fn insert(&mut self, t: Arc<str>, budget: usize) {
        if self.bytes + t.len() > budget {
            self.texts.clear();
            self.bytes = 0;
        }
        self.bytes += t.len();
        self.texts.insert(t);
    }
}

impl Guides {
    /// From the model's `tokenizer.json` (as a value), its eos ids and the number of logits
    /// it produces (which may exceed the tokenizer's vocabulary: the rest are never allowed).
    pub fn new(
        tokenizer_json: &Value,
        eos_ids: &[u32],
        n_logits: usize,
    ) -> Result<Guides, GuidedError> {
        let mut words = llguidance::token_bytes_from_tokenizer_json(tokenizer_json)
            .map_err(|e| GuidedError::Vocabulary(e.to_string()))?;
        if words.len() > n_logits {
            return Err(GuidedError::MoreTokensThanLogits {
                tokens: words.len(),
                logits: n_logits,
            });
        }
        while words.len() < n_logits {
            let mut w = format!(".<[{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let Some(&eos) = eos_ids.first() else {
            return Err(GuidedError::NoEos);
        };
        let info = TokRxInfo::new(n_logits as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if eos_ids.len() > 1 {
            trie = trie.with_eos_tokens(eos_ids);
        }
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GuidedError::Setup(e.to_string()))?;
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
            cache_budget: GRAMMAR_CACHE_BYTES,
            validated: Default::default(),
            compiles: Default::default(),
        })
    }

    /// The same with llguidance's limits changed by `f` (before any grammar is compiled).
    pub fn with_limits(mut self, f: impl FnOnce(&mut ParserLimits)) -> Guides {
        if let Some(factory) = Arc::get_mut(&mut self.factory) {
            f(factory.limits_mut());
        }
        self
    }

    /// The same, keeping at most `bytes` of compiled grammars.
    pub fn with_cache_budget(mut self, bytes: usize) -> Guides {
        self.cache_budget = bytes;
        self
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Grammars compiled so far (kept ones started again are not compiled again).
    pub fn compiles(&self) -> u64 {
        self.compiles.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// (grammars, estimated bytes) kept for reuse.
    pub fn cache_usage(&self) -> (usize, usize) {
        let c = self.cache.lock();
        (c.entries.len(), c.bytes)
    }

    /// Compiles `guide`'s grammar unless it is kept already, and keeps it: what a gateway
    /// checks before submitting, so the engine starts the sequence from the kept copy.
    pub fn prepare(&self, guide: &Guide) -> Result<(), GuidedError> {
        if self.cache.lock().entries.contains_key(&guide.grammar) {
            return Ok(());
        }
        self.compile_and_keep(guide).map(drop)
    }

    /// Checks that `grammar` compiles, without keeping the compiled grammar: what a
    /// gateway does with each tool's parameters. Grammars found good are remembered (their
    /// text, within [`VALIDATED_BYTES`]), so a request that brings the same tools as the last
    /// one compiles nothing.
    pub fn validate(&self, grammar: TopLevelGrammar) -> Result<(), GuidedError> {
        let text: Arc<str> = serde_json::to_string(&grammar)
            .map_err(|e| GuidedError::Serialise(e.to_string()))?
            .into();
        if self.validated.lock().contains(&text) {
            return Ok(());
        }
        self.compile(grammar)?;
        let mut v = self.validated.lock();
        if text.len() <= VALIDATED_BYTES {
            v.insert(text, VALIDATED_BYTES);
        }
        Ok(())
    }

    fn compile_and_keep(&self, guide: &Guide) -> Result<Guided, GuidedError> {
        let grammar: TopLevelGrammar = serde_json::from_str(&guide.grammar)
            .map_err(|e| GuidedError::NotJson(e.to_string()))?;
        let built = self.compile_built(grammar)?;
        let bytes = built.bytes.saturating_add(guide.grammar.len());
        // A copy of its own: the first sequence's lexer grows apart from the kept one.
        self.cache.lock().insert(
            guide.grammar.clone(),
            built.fresh.deep_clone(),
            bytes,
            self.cache_budget,
        );
        Ok(built.guided)
    }

    /// A matcher of its own for `guide`, its replayed tokens consumed; a grammar that does
    /// not compile (or takes longer than [`COMPILE_BUDGET`]) is refused with llguidance's
    /// reason.
    pub fn start(&self, guide: &Guide, prompt: &[u32]) -> Result<Guided, GuidedError> {
        let cached = self.cache.lock().get(&guide.grammar);
        let mut g = match cached {
            Some(parser) => Guided::from_parser(parser),
            None => self.compile_and_keep(guide)?,
        };
        if guide.replay > prompt.len() {
            return Err(GuidedError::Replay {
                replay: guide.replay,
                prompt: prompt.len(),
            });
        }
        for &t in &prompt[prompt.len() - guide.replay..] {
            g.consume(t)?;
        }
        Ok(g)
    }

    /// Compiles `grammar` and computes its first mask (which is where a schema's or
    /// regex's errors surface), within [`COMPILE_BUDGET`], and refuses a grammar nested
    /// deeper than [`MAX_GRAMMAR_DEPTH`] or larger than [`MAX_GRAMMAR_BYTES`] unread.
    pub fn compile(&self, grammar: TopLevelGrammar) -> Result<Guided, GuidedError> {
        self.compile_built(grammar).map(|b| b.guided)
    }

    /// [`Guides::compile`], with a fresh parser to keep and the estimated size.
    fn compile_built(&self, grammar: TopLevelGrammar) -> Result<Built, GuidedError> {
        let started = Instant::now();
        let size = serde_json::to_string(&grammar).map_or(usize::MAX, |s| s.len());
        if size > MAX_GRAMMAR_BYTES {
            return Err(GuidedError::TooLarge {
                size,
                limit: MAX_GRAMMAR_BYTES,
            });
        }
        depth::check(&grammar)?;
        self.compiles
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::channel();
        let factory = self.factory.clone();
        // Built on a thread of its own, with a deep stack: past [`COMPILE_BUDGET`] the
        // request is refused and that thread's result discarded, so a grammar slow to build
        // never holds the caller.
        std::thread::Builder::new()
            .name("kvmesh-grammar".into())
            .stack_size(COMPILE_STACK_BYTES)
            .spawn(move || {
                let _ = tx.send(build(&factory, grammar));
            })
            .map_err(|e| GuidedError::CompileThread(e.to_string()))?;
        let built = match rx.recv_timeout(COMPILE_BUDGET) {
            Ok(r) => r?,
            Err(_) => {
                return Err(GuidedError::CompileTimeout {
                    limit_ms: COMPILE_BUDGET.as_millis(),
                })
            }
        };
        let took = started.elapsed();
        if took > COMPILE_BUDGET {
            return Err(GuidedError::CompileSlow {
                took_ms: took.as_millis(),
                limit_ms: COMPILE_BUDGET.as_millis(),
            });
        }
        Ok(Built {
            bytes: built
                .bytes
                .saturating_add(size.saturating_mul(GRAMMAR_BYTES_PER_TEXT_BYTE)),
            ..built
        })
    }
}

/// Compiled grammar structures (rules, symbols, lexemes) per byte of grammar text, beyond
/// the lexer tables llguidance reports: an estimate, for the cache's budget. Calibrated on
/// 300 distinct 30-property schemas: estimated 220 KiB each with this, resident memory grew
/// 231 KiB each.
const GRAMMAR_BYTES_PER_TEXT_BYTE: usize = 48;

/// A compiled grammar: a matcher past its first mask, the parser it started from (fresh,
/// sharing its lexer), and their estimated size in bytes.
struct Built {
    guided: Guided,
    fresh: TokenParser,
    bytes: usize,
}

/// llguidance's parser for `grammar` and its first mask, and the lexer tables' size.
fn build(factory: &ParserFactory, grammar: TopLevelGrammar) -> Result<Built, GuidedError> {
    let parser = factory
        .create_parser(grammar)
        .map_err(|e| GuidedError::Invalid(e.to_string()))?;
    let fresh = parser.clone();
    let mut g = Guided::from_parser(parser);
    if let Some(e) = g.matcher.get_error() {
        return Err(GuidedError::Invalid(e));
    }
    let mut mask = Vec::new();
    g.fill_mask(&mut mask);
    if let Some(e) = g.failed.take() {
        return Err(GuidedError::Invalid(e));
    }
    // The lexer's tables as the first mask left them.
    let bytes = fresh.parser.lexer_stats().num_bytes;
    Ok(Built {
        guided: g,
        fresh,
        bytes,
    })
}

/// [`Guides`] built the first time a request asks for a grammar: reading a large vocabulary
/// into llguidance's trie takes a while, and most servers may never need it.
pub struct LazyGuides {
    tokenizer_json: Box<dyn Fn() -> Value + Send + Sync>,
    eos_ids: Vec<u32>,
    n_logits: usize,
    built: std::sync::OnceLock<Result<Guides, GuidedError>>,
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

    pub fn get(&self) -> Result<&Guides, GuidedError> {
        self.built
            .get_or_init(|| Guides::new(&(self.tokenizer_json)(), &self.eos_ids, self.n_logits))
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// One sequence's matcher.
pub struct Guided {
    matcher: Matcher,
    /// A parser sharing the matcher's lexer (its own parse state is not used): how the
    /// lexer's state is seen, which the matcher does not show.
    lexer: TokenParser,
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
    fn from_parser(parser: TokenParser) -> Guided {
        let lexer = parser.clone();
        Guided {
            matcher: Matcher::new(Ok(parser)),
            lexer,
            failed: None,
        }
    }

    /// Why the lexer stopped, once it has: past its state limit every byte leads nowhere,
    /// including bytes of tokens a mask computed just before allowed.
    fn lexer_failure(&self) -> Option<String> {
        match self.lexer.parser.get_error() {
            Some(ParserError::LexerError(e)) => Some(format!(
                "the grammar outgrew its matcher's lexer ({e}): the output needs more \
                 distinct lexer states than allowed, as a very long bounded string or \
                 repetition does"
            )),
            _ => None,
        }
    }

    /// The tokens allowed next, as a bitmask (see [`mask_words`]). When the matcher fails it
    /// allows nothing and [`Guided::failure`] says why. A mask whose computation exhausted
    /// the lexer is not used: it may allow tokens the lexer can no longer read.
    pub fn fill_mask(&mut self, out: &mut Vec<u32>) {
        out.clear();
        if self.failed.is_some() {
            return;
        }
        match self.matcher.compute_mask_or_eos() {
            Ok(v) => match self.lexer_failure() {
                None => out.extend_from_slice(v.as_slice()),
                Some(e) => self.failed = Some(e),
            },
            Err(e) => {
                self.failed = Some(self.lexer_failure().unwrap_or_else(|| e.to_string()));
            }
        }
    }

    /// Reads a chosen token. A token the grammar does not allow fails the matcher.
    pub fn consume(&mut self, token: u32) -> Result<(), GuidedError> {
        if let Some(e) = &self.failed {
            return Err(GuidedError::Rejected(e.clone()));
        }
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| {
            let e = self
                .lexer_failure()
                .unwrap_or_else(|| format!("the matcher refused token {token}: {e}"));
            self.failed = Some(e.clone());
            GuidedError::Rejected(e)
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
        assert!(
            matches!(&e, GuidedError::Invalid(m) if !m.is_empty()),
            "{e:?}"
        );
        let e = guides
            .compile(grammar::lark("start: undefined_rule"))
            .unwrap_err();
        assert!(matches!(e, GuidedError::Invalid(_)), "{e:?}");
        assert!(e.to_string().contains("undefined_rule"), "{e}");
        let e = guides
            .compile(grammar::json_schema(
                serde_json::json!({"type": "no-such-type"}),
            ))
            .unwrap_err();
        assert!(e.to_string().contains("no-such-type"), "{e}");
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
        assert!(e.to_string().contains("bytes, over the"), "{e}");
    }

    /// One sequence exhausting its lexer (a string of 200,000 characters needs a state
    /// per character) fails that sequence alone: the next one from the same kept grammar
    /// starts afresh.
    #[test]
    fn a_failing_matcher_never_poisons_the_kept_grammar() {
        let (guides, tok) = guides();
        let guides = guides.with_limits(|l| l.max_lexer_states = 3_000);
        let schema = serde_json::json!({"type": "object", "properties":
            {"s": {"type": "string", "maxLength": 200_000}}, "required": ["s"]});
        let guide = Guide::new(&grammar::json_schema(schema));
        guides.prepare(&guide).unwrap();
        let eos = tok.eos_ids()[0];
        let n = tok.vocab_size();
        // A "model" that likes long runs of letters.
        let pref: Vec<f32> = (0..n)
            .map(|i| {
                let t = tok.token_text(i as u32);
                t.len() as f32 * f32::from(t.bytes().all(|b| b.is_ascii_lowercase()))
            })
            .collect();
        let drive = |g: &mut Guided, steps: usize| -> Option<String> {
            let mut mask = Vec::new();
            for _ in 0..steps {
                g.fill_mask(&mut mask);
                if let Some(e) = g.failure() {
                    return Some(e.to_string());
                }
                let mut l = pref.clone();
                apply_mask(&mut l, &mask);
                let t = crate::sampler::argmax_of(&l);
                if t == eos {
                    return None;
                }
                if let Err(e) = g.consume(t) {
                    return Some(e.to_string());
                }
            }
            None
        };
        let mut first = guides.start(&guide, &[]).unwrap();
        let e = drive(&mut first, 5_000).expect("the lexer's state limit is reached");
        assert!(e.to_string().contains("too many states"), "{e}");
        // A new sequence of the same grammar is unharmed, and fails only as late.
        let mut second = guides.start(&guide, &[]).unwrap();
        assert_eq!(drive(&mut second, 20), None);
    }

    /// What a gateway checks is what the engine starts from: one compile per grammar, and
    /// tools validated once are not compiled again.
    #[test]
    fn a_grammar_is_compiled_once_however_often_it_is_used() {
        let (guides, _) = guides();
        let guide = Guide::new(&grammar::regex("[a-z]{1,5}"));
        guides.prepare(&guide).unwrap();
        guides.prepare(&guide).unwrap();
        for _ in 0..3 {
            guides.start(&guide, &[]).unwrap();
        }
        assert_eq!(guides.compiles(), 1);
        let tool = || grammar::json_schema(serde_json::json!({"type": "object"}));
        guides.validate(tool()).unwrap();
        guides.validate(tool()).unwrap();
        assert_eq!(guides.compiles(), 2);
    }

    /// Compiled grammars are kept within a byte budget, the least recently used dropped.
    #[test]
    fn kept_grammars_stay_within_their_byte_budget() {
        let (guides, _) = guides();
        let budget = 8 << 20;
        let guides = guides.with_cache_budget(budget);
        let schema = |i: usize| {
            let props: serde_json::Map<String, Value> = (0..40)
                .map(|j| (format!("f{i}_{j}"), serde_json::json!({"type": "string"})))
                .collect();
            Guide::new(&grammar::json_schema(
                serde_json::json!({"type": "object", "properties": props}),
            ))
        };
        let first = schema(0);
        guides.prepare(&first).unwrap();
        let (n, one) = guides.cache_usage();
        assert_eq!(n, 1);
        assert!(
            one > 10_000,
            "an estimate of {one} bytes is too small to be real"
        );
        let mut kept_max = 0;
        for i in 1..(3 * budget / one).max(4) {
            guides.prepare(&schema(i)).unwrap();
            // The first stays in use, so it is never the least recently used.
            guides.start(&first, &[]).unwrap();
            let (n, bytes) = guides.cache_usage();
            assert!(
                bytes <= budget,
                "{bytes} bytes kept over a budget of {budget}"
            );
            kept_max = kept_max.max(n);
        }
        let (n, _) = guides.cache_usage();
        assert!(n < kept_max + 1 && n >= 2, "{n} kept");
        assert!(guides.cache.lock().entries.contains_key(&first.grammar));
        assert!(!guides.cache.lock().entries.contains_key(&schema(1).grammar));
    }

    /// Grammars nested past the limit are refused before compiling, naming it; this one
    /// would take a compiling thread's default stack.
    #[test]
    fn deep_grammars_are_refused_before_compiling() {
        let (guides, _) = guides();
        let mut rules = String::from("start: r0\n");
        for i in 0..2_000 {
            rules.push_str(&format!("r{i}: \"a\" r{}\n", i + 1));
        }
        rules.push_str("r2000: \"z\"\n");
        let e = guides.compile(grammar::lark(&rules)).unwrap_err();
        assert!(e.to_string().contains("256 levels"), "{e}");
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
