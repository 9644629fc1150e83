//! The `tokenizer.ggml.*` metadata of a GGUF file, read and checked, with llama.cpp's
//! defaults for special ids and flags and its adjustments of token attributes.
use std::path::{Path, PathBuf};

use tokenizers::models::bpe::Vocab;
use wick_gguf::{GgufFile, Metadata};

use super::pre_tokenizer::WordSplit;
use super::token_attrs::TokenAttrs;
use super::TokenizerError;

/// The tokenizer family named by `tokenizer.ggml.model`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum VocabModel {
    /// `gpt2`: byte-level BPE from tokens and merges, words cut by a `tokenizer.ggml.pre` regex.
    Gpt2,
    /// `llama`: SentencePiece-style BPE driven by scores, `▁` for spaces, `<0xXX>` byte fallback.
    Llama,
    /// `gemma4`: BPE from merges over raw UTF-8 with `▁` for spaces and `<0xXX>` byte fallback.
    Gemma4,
    /// `bert`: WordPiece, words marked by a leading `▁` in the GGUF vocabulary.
    Bert,
}

/// Special ids a GGUF file names (or llama.cpp assumes for the tokenizer family).
#[derive(Clone, Debug, Default)]
pub(crate) struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
}

/// Everything the tokenizer needs from a GGUF header.
pub(crate) struct GgufVocab<'a> {
    pub path: PathBuf,
    pub model: VocabModel,
    /// How words are cut before BPE (`gpt2` and `gemma4` only).
    pub word_split: Option<WordSplit>,
    pub tokens: Vec<String>,
    /// Piece → id, for lookups while building (moved into the BPE model at the end).
    pub index: Vocab,
    pub scores: Vec<f32>,
    pub attrs: Vec<TokenAttrs>,
    pub merges: Vec<&'a str>,
    pub ids: SpecialIds,
    /// Ids that end generation: eos, eot, eom and the tokens llama.cpp recognises by text.
    pub end_of_generation: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// Append the separator token after the text (BERT).
    pub add_sep: bool,
    pub add_space_prefix: bool,
}

/// Texts llama.cpp takes as end-of-turn when `tokenizer.ggml.eot_token_id` is absent.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts llama.cpp takes as end-of-generation, whatever the metadata says.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Fill-in-the-middle tokens: (metadata keys, texts llama.cpp recognises, ends generation).
const FIM_KINDS: &[(&[&str], &[&str], bool)] = &[
    (
        &[
            "tokenizer.ggml.fim_pre_token_id",
            "tokenizer.ggml.prefix_token_id",
        ],
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        false,
    ),
    (
        &[
            "tokenizer.ggml.fim_suf_token_id",
            "tokenizer.ggml.suffix_token_id",
        ],
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        false,
    ),
    (
        &[
            "tokenizer.ggml.fim_mid_token_id",
            "tokenizer.ggml.middle_token_id",
        ],
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        false,
    ),
    (
        &["tokenizer.ggml.fim_pad_token_id"],
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        true,
    ),
    (
        &["tokenizer.ggml.fim_rep_token_id"],
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
        true,
    ),
    (
        &["tokenizer.ggml.fim_sep_token_id"],
        &["<|file_sep|>"],
        true,
    ),
];

/// Tokens gpt-oss templates need rendered even when special tokens are skipped.
const ALWAYS_RENDERED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

impl<'a> GgufVocab<'a> {
    /// Reads and checks the tokenizer metadata of `gguf`.
    pub fn read(gguf: &'a GgufFile) -> Result<Self, TokenizerError> {
        let path = gguf.path().to_path_buf();
        let md = gguf.metadata();
        let invalid = |key: &str, reason: String| TokenizerError::InvalidMetadata {
            path: path.clone(),
            key: key.to_string(),
            reason,
        };

        let model_name = md.get_str("tokenizer.ggml.model")?;
        let model = match model_name {
            "gpt2" => VocabModel::Gpt2,
            "llama" => VocabModel::Llama,
            "gemma4" => VocabModel::Gemma4,
            "bert" => VocabModel::Bert,
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    path,
                    model: other.to_string(),
                })
            }
        };
        let pre = match model {
            VocabModel::Gemma4 => "gemma4",
            _ => md.opt_str("tokenizer.ggml.pre")?.unwrap_or(""),
        };
        if model == VocabModel::Gpt2 && pre.is_empty() {
            tracing::warn!(
                path = %path.display(),
                "tokenizer.ggml.pre is missing: using llama.cpp's default word split, which may \
                 tokenize differently from the model's training"
            );
        }
        let word_split = match model {
            VocabModel::Gpt2 | VocabModel::Gemma4 => {
                Some(WordSplit::from_name(pre).ok_or_else(|| {
                    TokenizerError::UnsupportedPreTokenizer {
                        path: path.clone(),
                        pre: pre.to_string(),
                    }
                })?)
            }
            VocabModel::Llama | VocabModel::Bert => None,
        };

        let raw_tokens = md
            .opt_strings("tokenizer.ggml.tokens")?
            .ok_or_else(|| invalid("tokenizer.ggml.tokens", "missing".into()))?;
        let n = raw_tokens.len();
        if n == 0 || n > u32::MAX as usize / 2 {
            return Err(invalid(
                "tokenizer.ggml.tokens",
                format!("{n} tokens is not a usable vocabulary"),
            ));
        }
        let mut tokens = Vec::with_capacity(n);
        let mut index = Vocab::with_capacity(n);
        for (i, t) in raw_tokens.iter().enumerate() {
            let id = i as u32;
            // llama.cpp names empty entries so that they stay addressable.
            let token = if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.to_string()
            };
            if let Some(first) = index.insert(token.clone(), id) {
                return Err(TokenizerError::DuplicateToken {
                    path,
                    token,
                    first,
                    second: id,
                });
            }
            tokens.push(token);
        }

        let scores = match md.opt_f32s("tokenizer.ggml.scores")? {
            Some(s) if s.len() >= n => s[..n].to_vec(),
            Some(s) => {
                return Err(invalid(
                    "tokenizer.ggml.scores",
                    format!("{} scores for {n} tokens", s.len()),
                ))
            }
            None => vec![0.0; n],
        };
        let mut attrs = match md.opt_i64s("tokenizer.ggml.token_type")? {
            Some(t) if t.len() >= n => t[..n]
                .iter()
                .map(|&t| TokenAttrs::from_gguf_type(t))
                .collect(),
            Some(t) => {
                return Err(invalid(
                    "tokenizer.ggml.token_type",
                    format!("{} token types for {n} tokens", t.len()),
                ))
            }
            None => vec![TokenAttrs::NORMAL; n],
        };
        let merges = match model {
            VocabModel::Gpt2 | VocabModel::Gemma4 => md
                .opt_strings("tokenizer.ggml.merges")?
                .ok_or_else(|| invalid("tokenizer.ggml.merges", "missing".into()))?,
            VocabModel::Llama | VocabModel::Bert => Vec::new(),
        };

        let mut ids = default_ids(model, n);
        let id_keys: [(&str, &mut Option<u32>); 7] = [
            ("tokenizer.ggml.bos_token_id", &mut ids.bos),
            ("tokenizer.ggml.eos_token_id", &mut ids.eos),
            ("tokenizer.ggml.eot_token_id", &mut ids.eot),
            ("tokenizer.ggml.eom_token_id", &mut ids.eom),
            ("tokenizer.ggml.unknown_token_id", &mut ids.unk),
            ("tokenizer.ggml.seperator_token_id", &mut ids.sep),
            ("tokenizer.ggml.padding_token_id", &mut ids.pad),
        ];
        for (key, slot) in id_keys {
            if let Some(id) = read_id(md, key, n) {
                *slot = Some(id);
            }
        }
        if let Some(ws) = word_split {
            if ws.has_no_bos() && read_id(md, "tokenizer.ggml.bos_token_id", n).is_none() {
                ids.bos = None;
            }
        }

        let mut add_bos = match model {
            VocabModel::Llama | VocabModel::Bert => true,
            VocabModel::Gpt2 | VocabModel::Gemma4 => word_split.is_some_and(|w| w.adds_bos()),
        };
        if let Some(b) = md.opt_bool("tokenizer.ggml.add_bos_token")? {
            add_bos = b;
        }
        if model == VocabModel::Gemma4 {
            // llama.cpp forces BOS on for Gemma 4 whatever the file says.
            add_bos = true;
        }
        let add_eos = md
            .opt_bool("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false);
        let add_sep = md
            .opt_bool("tokenizer.ggml.add_sep_token")?
            .unwrap_or(model == VocabModel::Bert);
        let add_space_prefix = md
            .opt_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(model == VocabModel::Llama);
        if add_bos && ids.bos.is_none() {
            return Err(invalid(
                "tokenizer.ggml.add_bos_token",
                "is true but no BOS token id is set".into(),
            ));
        }
        if add_eos && ids.eos.is_none() {
            return Err(invalid(
                "tokenizer.ggml.add_eos_token",
                "is true but no EOS token id is set".into(),
            ));
        }

        if add_sep && ids.sep.is_none() {
            return Err(invalid(
                "tokenizer.ggml.add_sep_token",
                "is true but no separator token id is set".into(),
            ));
        }

        let name = md.opt_str("general.name")?.unwrap_or("").to_lowercase();
        let arch = md.opt_str("general.architecture")?.unwrap_or("");
        let end_of_generation = adjust_attrs(md, &tokens, &index, &mut attrs, &mut ids);
        adjust_strip_attrs(&index, &mut attrs, &name, arch, pre);

        Ok(GgufVocab {
            path,
            model,
            word_split,
            tokens,
            index,
            scores,
            attrs,
            merges,
            ids,
            end_of_generation,
            add_bos,
            add_eos,
            add_sep,
            add_space_prefix,
        })
    }

    /// The model file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// llama.cpp's default special ids per tokenizer family, kept only when inside the vocabulary.
fn default_ids(model: VocabModel, n: usize) -> SpecialIds {
    let within = |id: u32| ((id as usize) < n).then_some(id);
    match model {
        VocabModel::Llama => SpecialIds {
            bos: within(1),
            eos: within(2),
            unk: within(0),
            ..SpecialIds::default()
        },
        VocabModel::Bert => SpecialIds {
            bos: within(101),
            unk: within(100),
            sep: within(102),
            pad: within(0),
            ..SpecialIds::default()
        },
        VocabModel::Gpt2 | VocabModel::Gemma4 => SpecialIds::default(),
    }
}

/// A token id from metadata; negative, non-integer or out-of-vocabulary values count as absent.
fn read_id(md: &Metadata, key: &str, n: usize) -> Option<u32> {
    let id = md.get(key)?.as_i64()?;
    match u32::try_from(id) {
        Ok(id) if (id as usize) < n => Some(id),
        _ => {
            tracing::warn!(key, id, vocab = n, "ignoring out-of-range special token id");
            None
        }
    }
}

/// Marks the tokens llama.cpp treats as control by their text and collects the ids that end
/// generation. Returns the end-of-generation ids, `eos` first.
fn adjust_attrs(
    md: &Metadata,
    tokens: &[String],
    by_text: &Vocab,
    attrs: &mut [TokenAttrs],
    ids: &mut SpecialIds,
) -> Vec<u32> {
    let n = tokens.len();
    let first_of = |texts: &[&str]| texts.iter().filter_map(|t| by_text.get(*t).copied()).min();

    if ids.eot.is_none() {
        ids.eot = first_of(EOT_TEXTS);
    }
    if ids.eom.is_none() {
        ids.eom = first_of(&["<|eom_id|>"]);
    }
    let mut eog: Vec<u32> = Vec::new();
    for (keys, texts, ends_generation) in FIM_KINDS {
        let id = keys
            .iter()
            .find_map(|k| read_id(md, k, n))
            .or_else(|| first_of(texts));
        if let Some(id) = id {
            attrs[id as usize] = attrs[id as usize].with(TokenAttrs::CONTROL);
            if *ends_generation {
                eog.push(id);
            }
        }
    }
    for id in [ids.eot, ids.eom].into_iter().flatten() {
        attrs[id as usize] = attrs[id as usize].with(TokenAttrs::CONTROL);
    }
    for text in EOG_TEXTS {
        if let Some(&id) = by_text.get(*text) {
            attrs[id as usize] = attrs[id as usize].with(TokenAttrs::CONTROL);
            eog.push(id);
        }
    }
    for text in ALWAYS_RENDERED {
        if let Some(&id) = by_text.get(*text) {
            attrs[id as usize] = TokenAttrs::USER_DEFINED;
        }
    }
    eog.extend([ids.eos, ids.eot, ids.eom].into_iter().flatten());
    eog.sort_unstable();
    eog.dedup();

    let has = |eog: &[u32], text: &str| eog.iter().any(|&id| tokens[id as usize] == text);
    // o200k_harmony and solar-open: "<|end|>" ends a message, not the generation.
    if has(&eog, "<|end|>")
        && ((has(&eog, "<|return|>") && has(&eog, "<|call|>"))
            || (has(&eog, "<|calls|>") && has(&eog, "<|flush|>")))
    {
        if let Some(&end) = by_text.get("<|end|>") {
            eog.retain(|&id| id != end);
            attrs[end as usize] = TokenAttrs::USER_DEFINED;
        }
    }
    // Gemma 4: "</s>" is text there.
    if has(&eog, "<|tool_response>") && has(&eog, "</s>") {
        if let Some(&s) = by_text.get("</s>") {
            eog.retain(|&id| id != s);
            attrs[s as usize] = TokenAttrs::NORMAL;
        }
    }

    let mut out = Vec::with_capacity(eog.len());
    if let Some(eos) = ids.eos {
        out.push(eos);
    }
    out.extend(eog.into_iter().filter(|&id| Some(id) != ids.eos));
    out
}

/// llama.cpp's per-model whitespace stripping around special tokens (Phi-3, mask tokens).
fn adjust_strip_attrs(
    by_text: &Vocab,
    attrs: &mut [TokenAttrs],
    name: &str,
    arch: &str,
    pre: &str,
) {
    let set = |attrs: &mut [TokenAttrs], text: &str, attr: TokenAttrs, on: bool| {
        if let Some(&i) = by_text.get(text) {
            let i = i as usize;
            attrs[i] = if on {
                attrs[i].with(attr)
            } else {
                attrs[i].without(attr)
            };
        }
    };
    let jina_or_nomic = ["jina-v2-de", "jina-v2-es", "jina-v2-code"]
        .iter()
        .any(|p| pre.contains(p))
        || ["nomic-bert-moe", "jina-bert-v3"]
            .iter()
            .any(|a| arch.contains(a));
    if jina_or_nomic {
        set(attrs, "<mask>", TokenAttrs::LSTRIP, true);
    } else if name.contains("phi-3") || name.contains("phi3") {
        let matched = TokenAttrs::CONTROL
            .with(TokenAttrs::USER_DEFINED)
            .with(TokenAttrs::UNKNOWN);
        for a in attrs.iter_mut().filter(|a| a.intersects(matched)) {
            *a = a.with(TokenAttrs::RSTRIP);
        }
        set(attrs, "</s>", TokenAttrs::RSTRIP, true);
        for t in ["<unk>", "<s>", "<|endoftext|>"] {
            set(attrs, t, TokenAttrs::RSTRIP, false);
        }
    } else if name.contains("modern-bert") {
        set(attrs, "[MASK]", TokenAttrs::LSTRIP, true);
    }
}
