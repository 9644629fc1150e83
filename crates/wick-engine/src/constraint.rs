//! Structured output: constraining a sequence's tokens to a grammar — a JSON schema, a
//! regular expression, a list of choices or a Lark grammar — with llguidance.
//!
//! - [`Grammars`] is built once per model (lazily, [`Model::grammars`]): the token trie of
//!   the model's own vocabulary (bytes per token, special tokens marked with llguidance's
//!   `0xFF` prefix), which covers GGUF-only models too, and llguidance's parser factory.
//! - [`Grammars::compile`] turns a [`ConstraintSpec`] into a [`Constraint`], or an error with
//!   llguidance's own message (bad regex, unsupported schema keyword, Lark syntax error).
//! - A [`Constraint`] rides in [`SamplingParams::constraint`](crate::sampler::SamplingParams):
//!   each sequence clones its own matcher from it ([`RowConstraint`]). Sampling draws from the
//!   unmasked row first and keeps the token when the grammar accepts it; only on a rejection
//!   is the mask computed and the draw redone on the masked row (same step, same random
//!   numbers), which samples from exactly the masked distribution but computes most masks
//!   never. The matcher lives in the sequence, so preemption (recompute) and checkpoint
//!   replays keep it in step with the tokens.
//! - The grammar may wait for the end of a reasoning block ([`Constraint::after_reasoning`]):
//!   when the prompt ends inside `<think>`, tokens are free until `</think>` is generated.
//! - A lazy grammar ([`Constraint::triggered_by`], more arms with [`Constraint::or_triggered`])
//!   leaves tokens free until the model writes one of its triggers (a tool call's opening
//!   tag, or the start of a bare call), constrains what follows with that trigger's grammar
//!   until it is complete (the call's end), then is free again until the next trigger:
//!   strict tools under `tool_choice: auto`. Free tokens cost nothing: no matcher is asked.
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use wick_chat::tokenizer::Tokenizer;

use crate::sampler::{Sampled, Sampler};

/// Errors of building or running a constraint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// The request's grammar, schema or regex does not compile (llguidance's message).
    #[error("{0}")]
    Invalid(String),
    /// The vocabulary could not be turned into a token trie.
    #[error("structured output is unavailable for this model: {0}")]
    Unavailable(String),
    /// The matcher failed while generating.
    #[error("constrained decoding failed: {0}")]
    Failed(String),
}

impl ConstraintError {
    /// What the message of a [`ConstraintError::Failed`] starts with. A failure reaches the
    /// request's owner as text ([`EngineEvent::Failed`](crate::scheduler::EngineEvent)),
    /// where this tells a grammar that could not be followed from other failures.
    pub const FAILED_PREFIX: &'static str = "constrained decoding failed: ";
}

/// What a reply must match.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// A JSON Schema (draft 2020-12 as llguidance supports it).
    JsonSchema(Value),
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// A regular expression (Rust `regex` syntax) the whole reply matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (`%json{…}` embeds a schema).
    Lark(String),
}

impl ConstraintSpec {
    /// A short name for logs (`json_schema`, `regex` …).
    pub fn kind(&self) -> &'static str {
        match self {
            ConstraintSpec::JsonSchema(_) => "json_schema",
            ConstraintSpec::JsonObject => "json_object",
            ConstraintSpec::Regex(_) => "regex",
            ConstraintSpec::Choice(_) => "choice",
            ConstraintSpec::Lark(_) => "grammar",
        }
    }

    fn grammar(&self) -> Result<TopLevelGrammar, ConstraintError> {
        Ok(match self {
            ConstraintSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(bounded_whitespace(schema.clone()))
            }
            ConstraintSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(bounded_whitespace(json!({"type": "object"})))
            }
            ConstraintSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            ConstraintSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(ConstraintError::Invalid("the choice list is empty".into()));
                }
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| Value::String(c.clone()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}\n", alternatives.join(" | ")))
            }
            ConstraintSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// Whitespace JSON may have between two tokens: at most this much, so that a small model
/// cannot spend its whole budget on blank lines (llguidance's default is unbounded).
pub const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,24}";

/// `schema` with llguidance's options set to [`JSON_WHITESPACE`], unless the schema sets its
/// own (`x-guidance`).
fn bounded_whitespace(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
    schema
}

/// The token environment of one model's vocabulary for llguidance.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
    /// The tokenizer's encoding of text is the bytes' own spelling (byte-level BPE): true;
    /// SentencePiece-style tokenizers prepend spaces, so llguidance tokenizes greedily.
    canonical: bool,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        if self.canonical {
            if let Ok(text) = std::str::from_utf8(s) {
                if let Ok(ids) = self.tokenizer.encode_literal(text, false) {
                    return ids;
                }
            }
        }
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

/// Every token's bytes as llguidance sees them: special tokens as `0xFF` + their text (so a
/// Lark grammar names them `<|im_end|>` or `<[id]>`, and plain text never matches them).
pub fn trie_words(tokenizer: &Tokenizer) -> Vec<Vec<u8>> {
    let mut words = tokenizer.vocabulary_bytes();
    for (id, word) in words.iter_mut().enumerate() {
        if tokenizer.is_special(id as u32) {
            let text = tokenizer.token_piece(id as u32).unwrap_or_default();
            let mut marked = Vec::with_capacity(text.len() + 1);
            marked.push(TokTrie::SPECIAL_TOKEN_MARKER);
            marked.extend_from_slice(text.as_bytes());
            *word = marked;
        }
    }
    words
}

/// The grammar machinery of one model: its token trie and llguidance's parser factory.
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish()
    }
}

impl Grammars {
    /// Builds the trie of `tokenizer`'s vocabulary; `eos_ids` end a reply (the grammar
    /// allows them where it may end).
    pub fn new(tokenizer: &Tokenizer, eos_ids: &[u32]) -> Result<Grammars, ConstraintError> {
        let words = trie_words(tokenizer);
        let vocab_size = u32::try_from(words.len())
            .map_err(|_| ConstraintError::Unavailable("the vocabulary is too large".into()))?;
        // A configured end id past the tokenizer's vocabulary can never be allowed anyway.
        let eos_ids: Vec<u32> = eos_ids
            .iter()
            .copied()
            .filter(|&id| id < vocab_size)
            .collect();
        let Some(&eos) = eos_ids.first() else {
            return Err(ConstraintError::Unavailable(
                "the model has no end-of-sequence token in its vocabulary".into(),
            ));
        };
        let mut info = TokRxInfo::new(vocab_size, eos);
        info.tok_bos = tokenizer.bos_id().filter(|&id| id < vocab_size);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos_ids);
        let canonical = is_canonical(tokenizer, &trie);
        let env: TokEnv = Arc::new(VocabEnv {
            trie,
            tokenizer: tokenizer.clone(),
            canonical,
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ConstraintError::Unavailable(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            // The message of a failed request names the problem; the grammar dump would
            // repeat the whole schema back.
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Grammars { factory })
    }

    /// Compiles `spec`; the error carries llguidance's message.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint, ConstraintError> {
        let started = Instant::now();
        let grammar = spec.grammar()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ConstraintError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Invalid(e));
        }
        let took = started.elapsed();
        tracing::debug!(
            kind = spec.kind(),
            compile_us = took.as_micros() as u64,
            "grammar compiled"
        );
        Ok(Constraint {
            inner: Arc::new(Compiled {
                proto: Mutex::new(matcher),
                env: self.factory.tok_env().clone(),
                kind: spec.kind(),
                compile_time: took,
            }),
            reasoning: None,
            arms: Vec::new(),
        })
    }

    /// The trie the masks index.
    pub fn trie(&self) -> &TokTrie {
        self.factory.tok_env().tok_trie()
    }
}

/// Whether encoding text spells exactly its bytes (checked on a sample with spaces, digits,
/// punctuation and a newline).
fn is_canonical(tokenizer: &Tokenizer, trie: &TokTrie) -> bool {
    let sample = "{\"a b\": [1, 23.5, \"x\\ny\"]}\n  ok";
    match tokenizer.encode_literal(sample, false) {
        Ok(ids) => trie.decode(&ids) == sample.as_bytes(),
        Err(_) => false,
    }
}

struct Compiled {
    /// The matcher right after compiling; every sequence clones it.
    proto: Mutex<Matcher>,
    env: TokEnv,
    kind: &'static str,
    compile_time: Duration,
}

/// A compiled grammar, cheap to clone, that a request's sampling carries.
#[derive(Clone)]
pub struct Constraint {
    inner: Arc<Compiled>,
    /// The reasoning block's tags `(open, close)`: when the prompt ends inside the block,
    /// the grammar applies from the close tag on.
    reasoning: Option<(String, String)>,
    /// A lazy grammar's arms: after each occurrence of a trigger, its grammar applies.
    arms: Vec<(String, Arc<Compiled>)>,
}

impl Constraint {
    /// Applies the grammar after the reasoning block when the prompt leaves one open
    /// (`open` seen after the last `close`).
    pub fn after_reasoning(mut self, open: &str, close: &str) -> Constraint {
        self.reasoning = Some((open.to_string(), close.to_string()));
        self
    }

    /// Makes the grammar lazy: tokens are free until the generated text contains `trigger`,
    /// the grammar constrains what follows until it is complete, and then tokens are free
    /// again until the next `trigger` (each time on a fresh matcher). A lazy grammar never
    /// ends the reply itself. The grammar describes what follows the trigger, without it.
    pub fn triggered_by(mut self, trigger: &str) -> Constraint {
        self.arms = vec![(trigger.to_string(), self.inner.clone())];
        self
    }

    /// Adds an arm to a lazy grammar: after `trigger`, `grammar`'s grammar applies (until it
    /// is complete). `grammar`'s own reasoning setting and arms are not used.
    pub fn or_triggered(mut self, trigger: &str, grammar: &Constraint) -> Constraint {
        self.arms.push((trigger.to_string(), grammar.inner.clone()));
        self
    }

    /// The lazy grammar's triggers (empty for a grammar that applies from the start).
    pub fn triggers(&self) -> Vec<&str> {
        self.arms.iter().map(|(t, _)| t.as_str()).collect()
    }

    /// The kind of grammar (`json_schema`, `regex` …).
    pub fn kind(&self) -> &'static str {
        self.inner.kind
    }

    /// How long compiling took.
    pub fn compile_time(&self) -> Duration {
        self.inner.compile_time
    }

    /// How many tokens the grammar allows first, computed on a fresh matcher (benchmarks
    /// and diagnostics: this is the cost of one full mask).
    pub fn first_mask_allowed(&self) -> Result<usize, ConstraintError> {
        let mut matcher = self
            .inner
            .proto
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Ok(matcher.compute_mask().map_err(failed)?.num_set())
    }

    /// The matcher state of a new sequence with `prompt` (the engine keeps one per row).
    pub fn start(&self, prompt: &[u32]) -> RowConstraint {
        let matcher = self
            .inner
            .proto
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let trie = self.inner.env.tok_trie();
        let reasoning_open = self.reasoning.as_ref().and_then(|(open, close)| {
            // Only the prompt's tail can leave a block open; 64 tokens hold any tag.
            let tail = &prompt[prompt.len().saturating_sub(64)..];
            let text = trie.decode(tail);
            let last = |tag: &str| find_last(&text, tag.as_bytes());
            match (last(open), last(close)) {
                (Some(o), Some(c)) if c > o => None,
                (Some(_), _) => Some(close.as_bytes().to_vec()),
                _ => None,
            }
        });
        let arms: Vec<(Vec<u8>, Arc<Compiled>)> = self
            .arms
            .iter()
            .map(|(t, c)| (t.as_bytes().to_vec(), c.clone()))
            .collect();
        // Inside an open reasoning block a lazy grammar's triggers only count after it.
        let free = reasoning_open.is_none() && !arms.is_empty();
        RowConstraint {
            matcher,
            env: self.inner.env.clone(),
            reasoning_close: reasoning_open,
            arms,
            free,
            seen: Vec::new(),
            saved: Vec::new(),
        }
    }
}

fn find_last(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    (0..=haystack.len() - needle.len())
        .rev()
        .find(|&i| &haystack[i..i + needle.len()] == needle)
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("kind", &self.inner.kind)
            .field("reasoning", &self.reasoning)
            .field("triggers", &self.triggers())
            .finish()
    }
}

impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            && self.reasoning == other.reasoning
            && self.arms.len() == other.arms.len()
            && self
                .arms
                .iter()
                .zip(&other.arms)
                .all(|((a, x), (b, y))| a == b && Arc::ptr_eq(x, y))
    }
}

/// One sequence's grammar state.
pub struct RowConstraint {
    matcher: Matcher,
    env: TokEnv,
    /// The reasoning block's close, while the prompt's open block has not closed.
    reasoning_close: Option<Vec<u8>>,
    /// A lazy grammar's arms (trigger, grammar); empty otherwise.
    arms: Vec<(Vec<u8>, Arc<Compiled>)>,
    /// A lazy grammar waiting for one of its triggers.
    free: bool,
    /// Generated bytes while waiting (only a tag's length of them is kept).
    seen: Vec<u8>,
    /// The logits row as it came, for a redraw on the masked row.
    saved: Vec<f32>,
}

impl RowConstraint {
    /// Whether the grammar applies to the next token.
    pub fn is_active(&self) -> bool {
        self.reasoning_close.is_none() && !self.free
    }

    /// Whether the grammar is complete and can take nothing more: the reply is done. A lazy
    /// grammar never is (the model ends the reply).
    pub fn is_done(&self) -> bool {
        self.arms.is_empty() && self.is_active() && self.matcher.is_stopped()
    }

    /// Samples a token the grammar allows.
    pub fn sample(
        &mut self,
        sampler: &mut Sampler,
        logits: &mut [f32],
        history: &[u32],
    ) -> Result<Sampled, ConstraintError> {
        self.saved.clear();
        self.saved.extend_from_slice(logits);
        let step = sampler.step();
        let first = sampler.sample(logits, history);
        if self.allows(first.id)? {
            return Ok(first);
        }
        let Some(mask) = self.allowed()? else {
            // The grammar does not apply to this token.
            return Ok(first);
        };
        apply_mask(&mask, &mut self.saved);
        sampler.set_step(step);
        let picked = sampler.sample(&mut self.saved, history);
        if !mask.is_allowed(picked.id) {
            return Err(ConstraintError::Failed(format!(
                "no allowed token has a finite logit (picked {})",
                picked.id
            )));
        }
        Ok(picked)
    }

    /// The tokens the grammar allows next, as bit words (token `i` is bit `i % 32` of word
    /// `i / 32`), or `None` while the grammar does not apply (an open reasoning block, a
    /// lazy grammar's free text). What a backend that masks on the device needs; the
    /// token it picks is then recorded with [`Self::commit`] as any other.
    pub fn next_mask(&mut self) -> Result<Option<Vec<u32>>, ConstraintError> {
        Ok(self.allowed()?.map(|m| m.as_slice().to_vec()))
    }

    /// The tokens the grammar allows next, `None` while it does not apply; an error where
    /// it allows none.
    fn allowed(&mut self) -> Result<Option<SimpleVob>, ConstraintError> {
        if !self.is_active() {
            return Ok(None);
        }
        let mask = self.matcher.compute_mask().map_err(failed)?;
        if mask.is_zero() {
            return Err(ConstraintError::Failed(
                "the grammar allows no token here".into(),
            ));
        }
        Ok(Some(mask))
    }

    /// How many of `ids`, in order from here, the grammar accepts (none consumed): a
    /// speculative row's drafts are cut there. All of them while the grammar does not
    /// apply (reasoning, a lazy grammar's free text), where a draft is checked as it is
    /// verified instead.
    pub fn valid_prefix(&mut self, ids: &[u32]) -> Result<usize, ConstraintError> {
        if !self.is_active() {
            return Ok(ids.len());
        }
        let vocab = self.env.tok_trie().vocab_size();
        let known = ids
            .iter()
            .position(|&id| id as usize >= vocab)
            .unwrap_or(ids.len());
        self.matcher.validate_tokens(&ids[..known]).map_err(failed)
    }

    /// Sets every logit of `logits` the grammar does not allow next to `-inf` (nothing
    /// while it does not apply): the distribution a sampled speculative row verifies its
    /// draft against.
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        if let Some(mask) = self.allowed()? {
            apply_mask(&mask, logits);
        }
        Ok(())
    }

    /// Whether the grammar accepts `id` next (it is not consumed).
    pub fn allows(&mut self, id: u32) -> Result<bool, ConstraintError> {
        if id as usize >= self.env.tok_trie().vocab_size() {
            return Ok(false);
        }
        Ok(self.matcher.validate_tokens(&[id]).map_err(failed)? == 1)
    }

    /// Records a generated token.
    pub fn commit(&mut self, id: u32) -> Result<(), ConstraintError> {
        if self.reasoning_close.is_some() || self.free {
            let trie = self.env.tok_trie();
            self.seen.extend_from_slice(&trie.decode(&[id]));
            let keep = if let Some(close) = &self.reasoning_close {
                if find_last(&self.seen, close).is_some() {
                    self.reasoning_close = None;
                    self.seen.clear();
                    self.free = !self.arms.is_empty();
                    return Ok(());
                }
                close.len()
            } else {
                let hit = self.arms.iter().find_map(|(trigger, grammar)| {
                    find_last(&self.seen, trigger).map(|at| (at + trigger.len(), grammar))
                });
                if let Some((end, grammar)) = hit {
                    // Each call starts on a fresh matcher of its arm's grammar.
                    self.matcher = grammar
                        .proto
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .clone();
                    self.free = false;
                    // The token that completed the trigger may hold more (Qwen's `",` after
                    // a name): those bytes are the grammar's first.
                    let rest = self.seen[end..].to_vec();
                    self.seen.clear();
                    if !rest.is_empty() {
                        let ids = self.env.tok_trie().greedy_tokenize(&rest);
                        if self.matcher.validate_tokens(&ids).map_err(failed)? == ids.len() {
                            self.matcher.consume_tokens(&ids).map_err(failed)?;
                        }
                    }
                    return Ok(());
                }
                self.arms.iter().map(|(t, _)| t.len()).max().unwrap_or(0)
            };
            let cut = self.seen.len().saturating_sub(keep.saturating_sub(1));
            self.seen.drain(..cut);
            return Ok(());
        }
        self.matcher.consume_token(id).map_err(failed)?;
        if !self.arms.is_empty() && self.matcher.is_stopped() {
            // The call is complete: free text again until the next trigger.
            self.free = true;
        }
        Ok(())
    }
}

fn failed(e: impl std::fmt::Display) -> ConstraintError {
    ConstraintError::Failed(e.to_string())
}

/// Sets every logit the mask does not allow to `-inf` (ids past the mask too: a padded
/// output row has more ids than the vocabulary).
fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    crate::backend::apply_token_mask(mask.as_slice(), logits);
}

/// Where [`Model::grammars`] keeps its value.
pub(crate) type GrammarsSlot = OnceLock<Result<Arc<Grammars>, ConstraintError>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_clears_disallowed_and_padded_ids() {
        let mut mask = SimpleVob::alloc(40);
        mask.allow_token(3);
        mask.allow_token(35);
        let mut logits = vec![1.0f32; 70];
        apply_mask(&mask, &mut logits);
        let finite: Vec<usize> = (0..70).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(finite, vec![3, 35]);
    }

    /// The real SmolLM2 vocabulary (byte-level BPE read from the GGUF).
    fn smollm2() -> Tokenizer {
        let home = std::env::var_os("WICK_HOME")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::Path::new(&std::env::var("HOME").unwrap_or_default()).join(".cache/wick")
            });
        let path = home.join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            path.is_file(),
            "{} missing: run `wick pull default`",
            path.display()
        );
        let gguf = wick_gguf::GgufFile::open(&path).unwrap();
        Tokenizer::from_gguf(&gguf).unwrap()
    }

    fn grammars(tok: &Tokenizer) -> Grammars {
        Grammars::new(tok, tok.eos_ids()).unwrap()
    }

    #[test]
    fn the_trie_spells_the_real_vocabulary() {
        let tok = smollm2();
        let words = trie_words(&tok);
        assert_eq!(words.len(), 49152);
        // Special tokens carry llguidance's marker; plain text never matches them.
        assert_eq!(words[2], b"\xff<|im_end|>");
        let g = grammars(&tok);
        let trie = g.trie();
        assert!(trie.is_special_token(2));
        assert_eq!(trie.get_special_token("<|im_end|>"), Some(2));
        assert!(trie.eos_tokens().contains(&2));
        // Every id decodes to the bytes the tokenizer gives the text, multi-byte characters
        // split across byte-level tokens included.
        let text = "{\"name\": \"Zoë 東京\", \"n\": [1, 2.5]}\n\tend";
        let ids = tok.encode_literal(text, false).unwrap();
        assert!(ids
            .iter()
            .any(|&id| std::str::from_utf8(trie.token(id)).is_err()));
        assert_eq!(trie.decode(&ids), text.as_bytes());
    }

    #[test]
    fn a_schema_mask_allows_only_what_the_schema_can_start_with() {
        let tok = smollm2();
        let g = grammars(&tok);
        let schema = json!({
            "type": "object",
            "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
            "required": ["n", "tag"],
            "additionalProperties": false
        });
        let c = g.compile(&ConstraintSpec::JsonSchema(schema)).unwrap();
        let mut row = c.start(&[1]);
        let mask = row.matcher.compute_mask().unwrap();
        let id = |t: &str| {
            let ids = tok.encode_literal(t, false).unwrap();
            assert_eq!(ids.len(), 1, "{t:?} is {ids:?}");
            ids[0]
        };
        assert!(mask.is_allowed(id("{")));
        assert!(!mask.is_allowed(id("hello")));
        assert!(!mask.is_allowed(id("[")));
        assert!(!mask.is_allowed(2), "nothing generated yet: no end");
        // Walk a valid reply through the matcher; at the end only ending is left.
        let reply = "{\"n\": 42, \"tag\": \"b\"}";
        for t in tok.encode_literal(reply, false).unwrap() {
            assert!(row.allows(t).unwrap(), "token {t} of {reply}");
            row.commit(t).unwrap();
        }
        let end = row.matcher.compute_mask_or_eos().unwrap();
        assert!(end.is_allowed(2));
        assert!(!end.is_allowed(id(",")));
        assert!(row.matcher.is_accepting().unwrap());
    }

    #[test]
    fn sampling_redraws_on_the_masked_row_when_the_grammar_rejects() {
        let tok = smollm2();
        let g = grammars(&tok);
        let c = g
            .compile(&ConstraintSpec::Choice(vec!["yes".into(), "no".into()]))
            .unwrap();
        let mut row = c.start(&[1]);
        let mut sampler = Sampler::new(
            crate::sampler::SamplingParams::default(),
            crate::sampler::SamplerTokens::default(),
        )
        .unwrap();
        let hello = tok.encode_literal("hello", false).unwrap()[0];
        let no = tok.encode_literal("no", false).unwrap()[0];
        let mut logits = vec![0.0f32; 49152];
        logits[hello as usize] = 10.0;
        logits[no as usize] = 1.0;
        let picked = row.sample(&mut sampler, &mut logits, &[]).unwrap();
        assert_eq!(picked.id, no);
        assert_eq!(sampler.step(), 1, "the redraw reuses the step");
        row.commit(picked.id).unwrap();
        assert!(row.is_done(), "nothing can follow a finished choice");
    }

    #[test]
    fn bad_grammars_are_refused_with_llguidance_messages() {
        let tok = smollm2();
        let g = grammars(&tok);
        let cases = [
            ConstraintSpec::Regex("(ab".into()),
            ConstraintSpec::Lark("start: foo(".into()),
            ConstraintSpec::JsonSchema(json!({"type": "object", "properties": 7})),
            ConstraintSpec::Choice(Vec::new()),
        ];
        for spec in cases {
            match g.compile(&spec) {
                Err(ConstraintError::Invalid(m)) => assert!(!m.is_empty(), "{spec:?}"),
                other => panic!("{spec:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_prompt_inside_a_think_block_frees_tokens_until_it_closes() {
        let tok = smollm2();
        let g = grammars(&tok);
        let c = g
            .compile(&ConstraintSpec::Regex("[0-9]+".into()))
            .unwrap()
            .after_reasoning("<think>", "</think>");
        let prompt = tok.encode_literal("assistant\n<think>\n", false).unwrap();
        let mut row = c.start(&prompt);
        assert!(!row.is_active());
        for t in tok.encode_literal("hmm, four. </thi", false).unwrap() {
            row.commit(t).unwrap();
        }
        assert!(!row.is_active());
        for t in tok.encode_literal("nk>", false).unwrap() {
            row.commit(t).unwrap();
        }
        assert!(row.is_active());
        let four = tok.encode_literal("4", false).unwrap()[0];
        assert!(row.allows(four).unwrap());
        assert!(!row
            .allows(tok.encode_literal("hello", false).unwrap()[0])
            .unwrap());
        // A closed block in the prompt: the grammar applies at once.
        let closed = tok.encode_literal("<think>x</think>", false).unwrap();
        assert!(c.start(&closed).is_active());
    }

    #[test]
    fn a_lazy_grammar_applies_from_each_trigger_to_the_end_of_its_call() {
        let tok = smollm2();
        let g = grammars(&tok);
        let c = g
            .compile(&ConstraintSpec::Lark(
                "start: \"{\" /[0-9]+/ \"}\" \"</call>\"\n".into(),
            ))
            .unwrap()
            .triggered_by("<call>");
        let mut row = c.start(&[1]);
        let first = |t: &str| tok.encode_literal(t, false).unwrap()[0];
        let commit = |row: &mut RowConstraint, text: &str| {
            for t in tok.encode_literal(text, false).unwrap() {
                assert!(!row.is_active() || row.allows(t).unwrap(), "{text:?}");
                row.commit(t).unwrap();
            }
        };
        // Free text, however it looks, until the trigger.
        assert!(!row.is_active());
        commit(&mut row, "Sure, hello! {not a call} <cal");
        assert!(!row.is_active());
        commit(&mut row, "l>");
        assert!(row.is_active());
        assert!(row.allows(first("{")).unwrap());
        assert!(!row.allows(first("hello")).unwrap());
        commit(&mut row, "{42}</call>");
        // The call is complete: free again, and never done (the model ends the reply).
        assert!(!row.is_active() && !row.is_done());
        commit(&mut row, " and more text");
        assert!(!row.is_active());
        commit(&mut row, "<call>");
        assert!(row.is_active(), "the next call is constrained too");
        assert!(!row.allows(first("hello")).unwrap());
        assert!(row.allows(first("{")).unwrap());

        // A token that completes the trigger and goes on: the rest counts for the grammar.
        let mut row = c.start(&[1]);
        commit(&mut row, "x <cal");
        commit(&mut row, "l>{4");
        assert!(row.is_active());
        assert!(row.allows(first("}")).unwrap(), "after {{4 a brace closes");
        assert!(!row.allows(first("{")).unwrap());

        // A second arm: its own trigger, its own grammar.
        let digits = g
            .compile(&ConstraintSpec::Lark("start: /[0-9]{2}/ \"!\"\n".into()))
            .unwrap();
        let two = c.clone().or_triggered("CODE=", &digits);
        assert_eq!(two.triggers(), ["<call>", "CODE="]);
        let mut row = two.start(&[1]);
        commit(&mut row, "the code: CODE=");
        assert!(row.is_active());
        assert!(!row.allows(first("{")).unwrap(), "the other arm's grammar");
        commit(&mut row, "42!");
        assert!(!row.is_active());
        commit(&mut row, " <call>");
        assert!(row.is_active() && row.allows(first("{")).unwrap());
    }

    #[test]
    fn a_failure_message_starts_with_the_prefix_servers_look_for() {
        let message = ConstraintError::Failed("lexer error: too many states".into()).to_string();
        assert_eq!(
            message.strip_prefix(ConstraintError::FAILED_PREFIX),
            Some("lexer error: too many states")
        );
    }

    #[test]
    fn find_last_finds_the_last_occurrence() {
        assert_eq!(find_last(b"<think>a</think><think>", b"<think>"), Some(16));
        assert_eq!(find_last(b"abc", b"abcd"), None);
        assert_eq!(find_last(b"abc", b""), None);
    }
}
