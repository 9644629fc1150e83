//! How BPE vocabularies cut text into words before merging, chosen by `tokenizer.ggml.pre`.
//!
//! Each family is a list of regexes applied one after the other; every regex splits each
//! piece into its matches and the gaps between them (`Isolated`). The regexes are the ones
//! llama.cpp uses for the same names (Hugging Face's originals where its engine allowed them),
//! run here by Oniguruma through `tokenizers`' `Split` pre-tokenizer.
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

/// A word-splitting family of BPE tokenizers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WordSplit {
    /// llama.cpp's fallback for unknown or missing names: punctuation runs, GPT-2 words, digit runs.
    Default,
    /// Llama 3: GPT-4-style words, numbers in groups of up to three; whole words in the vocabulary
    /// skip merging and BOS is added by default.
    Llama3,
    /// The Llama 3 regex without its flags (DBRX, Smaug).
    Llama3Regex,
    /// Jais 2: Llama 3 words with whitespace runs cut into powers of two.
    Jais2,
    /// DeepSeek LLM: newlines, Latin/Greek/Cyrillic… letter runs, punctuation, CJK runs, numbers.
    DeepseekLlm,
    /// DeepSeek V3 and relatives: numbers of up to three digits, CJK/kana runs, then words.
    Deepseek3,
    /// DeepSeek Coder: newlines, letter runs, punctuation runs, CJK runs, single digits.
    DeepseekCoder,
    /// Spark 2.5: like DeepSeek V3 with single digits.
    Spark25,
    /// Youtu: Hangul/CJK runs, then case-aware words; whole-word lookup first.
    Youtu,
    /// Falcon: punctuation runs, GPT-2 words, numbers in groups of three.
    Falcon,
    /// GPT-2 words: `'s`, ` word`, ` 123`, ` !!`, whitespace (GPT-2, MPT, OLMo, Phi-2 …).
    Gpt2,
    /// Single digits, then GPT-2 words (StarCoder, Refact, Command-R, SmolLM …).
    Starcoder,
    /// Qwen 2: GPT-4-style words with single digits.
    Qwen2,
    /// Qwen 3.5: Qwen 2 with combining marks kept inside words.
    Qwen35,
    /// Qwen 2 without the English contraction group (Turkish apostrophe suffixes stay attached).
    Ufakzeka,
    /// BLOOM, Poro, GPT-3 Finnish: everything between spaces and punctuation.
    Poro,
    /// ChatGLM 4 / GLM 4: the Llama 3 regex, no BOS by default.
    ChatGlm4,
    /// Viking: BLOOM-style words, single digits.
    Viking,
    /// Mistral Tekken: case-aware words, single digits; whole-word lookup first, BOS by default.
    Tekken,
    /// GPT-4o / Llama 4: case-aware words with contractions, numbers of up to three digits.
    Gpt4o,
    /// Granite multilingual embedding (97m): GPT-4o words keeping combining marks; whole-word lookup.
    GraniteEmbedMulti,
    /// Tiny Aya: digit groups aligned to thousands, then GPT-4o words.
    TinyAya,
    /// Seed-Coder: Qwen-2-like words that never swallow newlines.
    SeedCoder,
    /// Grok 2: the Qwen 2 regex.
    Grok2,
    /// Bailing MoE: Qwen-2-like words, one newline per piece.
    BailingMoe,
    /// EXAONE MoE: words that may span single spaces between letters.
    ExaoneMoe,
    /// MiniCPM 5: numbers of up to three digits, then Llama-3-like words; whole-word lookup.
    MiniCpm5,
    /// Laguna: lines, then Qwen 2 words.
    Laguna,
    /// Gemma 4: spaces become `▁`, text is cut only at newline runs, no byte-level mapping.
    Gemma4,
    /// Sarvam MoE: as Gemma 4.
    SarvamMoe,
}

/// `tokenizer.ggml.pre` names and their family, as llama.cpp maps them.
const NAMES: &[(&str, WordSplit)] = &[
    ("", WordSplit::Default),
    ("default", WordSplit::Default),
    ("llama3", WordSplit::Llama3),
    ("llama-v3", WordSplit::Llama3),
    ("llama-bpe", WordSplit::Llama3),
    ("falcon3", WordSplit::Llama3),
    ("falcon-h1", WordSplit::Llama3),
    ("pixtral", WordSplit::Llama3),
    ("midm-2.0", WordSplit::Llama3),
    ("lfm2", WordSplit::Llama3),
    ("jina-v5-nano", WordSplit::Llama3),
    ("dbrx", WordSplit::Llama3Regex),
    ("smaug-bpe", WordSplit::Llama3Regex),
    ("jais-2", WordSplit::Jais2),
    ("deepseek-llm", WordSplit::DeepseekLlm),
    ("deepseek-v3", WordSplit::Deepseek3),
    ("hunyuan-dense", WordSplit::Deepseek3),
    ("joyai-llm", WordSplit::Deepseek3),
    ("hy_v4", WordSplit::Deepseek3),
    ("deepseek-coder", WordSplit::DeepseekCoder),
    ("spark2_5", WordSplit::Spark25),
    ("youtu", WordSplit::Youtu),
    ("falcon", WordSplit::Falcon),
    ("gpt-2", WordSplit::Gpt2),
    ("mpt", WordSplit::Gpt2),
    ("phi-2", WordSplit::Gpt2),
    ("olmo", WordSplit::Gpt2),
    ("jais", WordSplit::Gpt2),
    ("trillion", WordSplit::Gpt2),
    ("granite-docling", WordSplit::Gpt2),
    ("jina-es", WordSplit::Gpt2),
    ("jina-de", WordSplit::Gpt2),
    ("gigachat", WordSplit::Gpt2),
    ("jina-v2-es", WordSplit::Gpt2),
    ("jina-v2-de", WordSplit::Gpt2),
    ("jina-v1-en", WordSplit::Gpt2),
    ("jina-v2-code", WordSplit::Gpt2),
    ("roberta-bpe", WordSplit::Gpt2),
    ("a.x-4.0", WordSplit::Gpt2),
    ("mellum", WordSplit::Gpt2),
    ("modern-bert", WordSplit::Gpt2),
    ("exaone4", WordSplit::Gpt2),
    ("starcoder", WordSplit::Starcoder),
    ("refact", WordSplit::Starcoder),
    ("command-r", WordSplit::Starcoder),
    ("smollm", WordSplit::Starcoder),
    ("codeshell", WordSplit::Starcoder),
    ("exaone", WordSplit::Starcoder),
    ("minerva-7b", WordSplit::Starcoder),
    ("mellum2", WordSplit::Starcoder),
    ("qwen2", WordSplit::Qwen2),
    ("deepseek-r1-qwen", WordSplit::Qwen2),
    ("kormo", WordSplit::Qwen2),
    ("f2llmv2", WordSplit::Qwen2),
    ("megrez", WordSplit::Qwen2),
    ("stablelm2", WordSplit::Qwen2),
    ("hunyuan", WordSplit::Qwen2),
    ("solar-open", WordSplit::Qwen2),
    ("qwen35", WordSplit::Qwen35),
    ("ufakzeka", WordSplit::Ufakzeka),
    ("poro-chat", WordSplit::Poro),
    ("bloom", WordSplit::Poro),
    ("gpt3-finnish", WordSplit::Poro),
    ("glm4", WordSplit::ChatGlm4),
    ("chatglm-bpe", WordSplit::ChatGlm4),
    ("viking", WordSplit::Viking),
    ("tekken", WordSplit::Tekken),
    ("gpt-4o", WordSplit::Gpt4o),
    ("llama4", WordSplit::Gpt4o),
    ("kanana2", WordSplit::Gpt4o),
    ("talkie", WordSplit::Gpt4o),
    ("minimax-m2", WordSplit::Gpt4o),
    ("granite-embed-multi-97m", WordSplit::GraniteEmbedMulti),
    ("tiny_aya", WordSplit::TinyAya),
    ("cohere2moe", WordSplit::TinyAya),
    ("seed-coder", WordSplit::SeedCoder),
    ("grok-2", WordSplit::Grok2),
    ("bailingmoe", WordSplit::BailingMoe),
    ("bailingmoe2", WordSplit::BailingMoe),
    ("llada-moe", WordSplit::BailingMoe),
    ("exaone-moe", WordSplit::ExaoneMoe),
    ("minicpm5", WordSplit::MiniCpm5),
    ("laguna", WordSplit::Laguna),
    ("gemma4", WordSplit::Gemma4),
    ("granite-embed-multi-311m", WordSplit::Gemma4),
    ("sarvam-moe", WordSplit::SarvamMoe),
];

/// GPT-2 words as llama.cpp writes them (Hugging Face's extra `|\s+` adds nothing: a lone
/// whitespace it would match is left as a gap, which `Isolated` keeps as its own piece).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const JAIS2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const UFAKZEKA: &str =
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const SEED_CODER: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const EXAONE_MOE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+";
const MINICPM5: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK_LLM_LETTERS: &str = r"\s?[\x{0041}-\x{005A}\x{0061}-\x{007A}\x{00B5}\x{00C0}-\x{00D6}\x{00D8}-\x{00F6}\x{00F8}-\x{01BA}\x{01BC}-\x{01BF}\x{01C4}-\x{0293}\x{0295}-\x{02AF}\x{0370}-\x{0373}\x{0376}-\x{0377}\x{037B}-\x{037D}\x{037F}\x{0386}\x{0388}-\x{038A}\x{038C}\x{038E}-\x{03A1}\x{03A3}-\x{03F5}\x{03F7}-\x{0481}\x{048A}-\x{052F}\x{0531}-\x{0556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}-\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}-\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+";
const DEEPSEEK3_WORDS: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;
const SPARK25_WORDS: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"##;
const YOUTU_WORDS: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GRANITE_EMBED_MULTI: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TINY_AYA_WORDS: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const CJK_RUNS: &str = r"[\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+";
const CJK_KANA_RUNS: &str = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+";
const BLOOM_WORDS: &str =
    r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{0964}\x{06D4}\x{060C})]+";
const LINES: &str = "[^\n]+|[\n]+";

impl WordSplit {
    /// The family of a `tokenizer.ggml.pre` name, if wick implements it.
    pub fn from_name(name: &str) -> Option<Self> {
        NAMES.iter().find(|(n, _)| *n == name).map(|&(_, w)| w)
    }

    /// The regexes, applied in order.
    pub fn patterns(self) -> &'static [&'static str] {
        use WordSplit::*;
        match self {
            Default => &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
            Llama3 | Llama3Regex | ChatGlm4 => &[LLAMA3],
            Jais2 => &[JAIS2],
            DeepseekLlm => &[
                "[\r\n]",
                DEEPSEEK_LLM_LETTERS,
                r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
                r"\s+$",
                CJK_RUNS,
                r"\p{N}+",
            ],
            Deepseek3 => &[r"\p{N}{1,3}", CJK_KANA_RUNS, DEEPSEEK3_WORDS],
            DeepseekCoder => &["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_RUNS, r"\p{N}"],
            Spark25 => &[r"\p{N}{1,3}", CJK_KANA_RUNS, SPARK25_WORDS, r"\p{N}"],
            Youtu => &[
                r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
                YOUTU_WORDS,
            ],
            Falcon => &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
            Gpt2 => &[GPT2],
            Starcoder => &[r"\p{N}", GPT2],
            Qwen2 | Grok2 => &[QWEN2],
            Qwen35 => &[QWEN35],
            Ufakzeka => &[UFAKZEKA],
            Poro => &[BLOOM_WORDS],
            Viking => &[BLOOM_WORDS, r"\p{N}"],
            Tekken => &[TEKKEN],
            Gpt4o => &[GPT4O],
            GraniteEmbedMulti => &[GRANITE_EMBED_MULTI],
            TinyAya => &[r"\d{1,3}(?=(?:\d{3})*\b)", TINY_AYA_WORDS],
            SeedCoder => &[SEED_CODER],
            BailingMoe => &[BAILINGMOE],
            ExaoneMoe => &[EXAONE_MOE],
            MiniCpm5 => &[r"\p{N}{1,3}", MINICPM5],
            Laguna => &[LINES, QWEN2],
            Gemma4 | SarvamMoe => &[LINES],
        }
    }

    /// Whether a word found whole in the vocabulary is taken as one token without merging.
    pub fn ignores_merges(self) -> bool {
        use WordSplit::*;
        matches!(self, Llama3 | MiniCpm5 | Youtu | Tekken | GraniteEmbedMulti)
    }

    /// Whether llama.cpp adds BOS by default (before `tokenizer.ggml.add_bos_token`).
    pub fn adds_bos(self) -> bool {
        matches!(
            self,
            WordSplit::Llama3 | WordSplit::Tekken | WordSplit::Gemma4
        )
    }

    /// Whether the family has no BOS unless the metadata names one.
    pub fn has_no_bos(self) -> bool {
        self == WordSplit::ChatGlm4
    }

    /// Whether words are mapped to GPT-2's printable byte alphabet (`Ġ` for space …);
    /// otherwise pieces are raw UTF-8 with `▁` for spaces and `<0xXX>` byte fallback.
    pub fn byte_level(self) -> bool {
        !matches!(self, WordSplit::Gemma4 | WordSplit::SarvamMoe)
    }

    /// Whether a word made only of newlines is looked up whole before merging (Gemma 4).
    pub fn whole_newline_runs(self) -> bool {
        self == WordSplit::Gemma4
    }

    /// The `tokenizers` pre-tokenizer: the regex splits, then the byte-level mapping if any.
    ///
    /// `unspellable` are byte-level characters the vocabulary lacks: llama.cpp drops them, and
    /// merges never reach across the gap they leave, so they are removed as separators.
    pub fn build(self, unspellable: &[char]) -> Result<PreTokenizerWrapper, String> {
        let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
        for pattern in self.patterns() {
            let split = Split::new(
                SplitPattern::Regex((*pattern).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| format!("regex {pattern:?}: {e}"))?;
            steps.push(split.into());
        }
        if self.byte_level() {
            steps.push(ByteLevel::new(false, false, false).into());
            if !unspellable.is_empty() {
                let class: String = unspellable
                    .iter()
                    .map(|c| format!("\\x{{{:X}}}", u32::from(*c)))
                    .collect();
                let drop = Split::new(
                    SplitPattern::Regex(format!("[{class}]")),
                    SplitDelimiterBehavior::Removed,
                    false,
                )
                .map_err(|e| format!("unspellable bytes {class}: {e}"))?;
                steps.push(drop.into());
            }
        }
        Ok(Sequence::new(steps).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn words(split: WordSplit, text: &str) -> Vec<String> {
        let pre = split.build(&[]).expect("pre-tokenizer builds");
        let mut pts = PreTokenizedString::from(text);
        pre.pre_tokenize(&mut pts).expect("pre-tokenizes");
        pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s.to_string())
            .collect()
    }

    #[test]
    fn every_family_compiles() {
        for (name, split) in NAMES {
            if let Err(e) = split.build(&[]) {
                panic!("pre-tokenizer {name:?} does not build: {e}");
            }
        }
    }

    #[test]
    fn names_map_to_families() {
        assert_eq!(WordSplit::from_name("qwen2"), Some(WordSplit::Qwen2));
        assert_eq!(WordSplit::from_name("smollm"), Some(WordSplit::Starcoder));
        assert_eq!(WordSplit::from_name("llama-bpe"), Some(WordSplit::Llama3));
        assert_eq!(WordSplit::from_name("kimi-k2"), None);
    }

    #[test]
    fn qwen2_splits_digits_and_keeps_space_with_word() {
        assert_eq!(
            words(WordSplit::Qwen2, "Hello world 123"),
            ["Hello", "Ġworld", "Ġ", "1", "2", "3"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three() {
        assert_eq!(words(WordSplit::Llama3, "12345"), ["123", "45"]);
    }

    #[test]
    fn gpt2_keeps_lone_tab_as_its_own_piece() {
        assert_eq!(words(WordSplit::Gpt2, "a\tb"), ["a", "ĉ", "b"]);
    }

    #[test]
    fn unspellable_bytes_are_dropped_as_separators() {
        let pre = WordSplit::Gpt2.build(&['ċ']).expect("builds");
        let mut pts = PreTokenizedString::from("  \u{b} ");
        pre.pre_tokenize(&mut pts).expect("pre-tokenizes");
        let words: Vec<String> = pts
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s.to_string())
            .collect();
        assert_eq!(words, ["ĠĠ", "Ġ"]);
    }

    #[test]
    fn gemma4_cuts_only_at_newline_runs() {
        assert_eq!(words(WordSplit::Gemma4, "a b\n\nc"), ["a b", "\n\n", "c"]);
    }
}
