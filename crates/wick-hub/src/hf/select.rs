//! Which files of a repository `wick get` fetches.
//!
//! - With `--include` patterns: exactly the files matching one of them.
//! - A safetensors repository: everything except other weight formats (`*.bin`, `*.pt`,
//!   `*.pth`, `*.h5`, `*.msgpack`, `*.onnx`, `*.ot`, `*.tflite`, `*.gguf`) — the same
//!   weights in another format would only double the download.
//! - A GGUF repository: the one GGUF model it holds (all shards of a split one) plus the
//!   small non-weight files; several quantizations and no pattern is
//!   [`GetError::ChooseQuant`], listing them. Vision projectors (`mmproj*`) are not models.
use super::client::RemoteFile;
use super::error::{GetError, QuantChoice};

const OTHER_WEIGHTS: &[&str] = &[
    ".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".ot", ".tflite", ".gguf", ".ckpt", ".pkl",
    ".npz", ".mlmodel",
];

fn lower_ends(path: &str, exts: &[&str]) -> bool {
    let p = path.to_ascii_lowercase();
    exts.iter().any(|e| p.ends_with(e))
}

fn is_gguf(path: &str) -> bool {
    lower_ends(path, &[".gguf"])
}

fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// `name-00001-of-00003.gguf` → (`name`, 1); a single file → its stem, 0.
fn shard_key(path: &str) -> (String, u32) {
    let stem = &path[..path.len() - ".gguf".len()];
    if let Some((head, total)) = stem.rsplit_once("-of-") {
        if let Some((base, index)) = head.rsplit_once('-') {
            if index.len() == 5
                && total.len() == 5
                && index
                    .bytes()
                    .chain(total.bytes())
                    .all(|b| b.is_ascii_digit())
            {
                return (base.to_string(), index.parse().unwrap_or(0));
            }
        }
    }
    (stem.to_string(), 0)
}

/// The quantization a GGUF name carries (`…Q4_K_M…`, `…f16…`), else the stem.
fn quant_of(path: &str) -> String {
    let (stem, _) = shard_key(base_name(path));
    let upper = stem.to_ascii_uppercase();
    let tokens: Vec<&str> = upper.split(['.', '-']).collect();
    for t in tokens.iter().rev() {
        let t = t.trim_start_matches("UD_");
        let quantish = (t.starts_with('Q') || t.starts_with("IQ"))
            && t.chars()
                .nth(if t.starts_with("IQ") { 2 } else { 1 })
                .is_some_and(|c| c.is_ascii_digit());
        if quantish || matches!(t, "F16" | "BF16" | "F32" | "FP16") {
            return t.to_string();
        }
    }
    stem
}

/// The files to fetch (see the module docs).
pub(crate) fn select(
    repo: &str,
    files: &[RemoteFile],
    include: &[String],
) -> Result<Vec<RemoteFile>, GetError> {
    if !include.is_empty() {
        let patterns = include
            .iter()
            .map(|p| {
                glob::Pattern::new(p).map_err(|e| GetError::BadPattern {
                    pattern: p.clone(),
                    detail: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let chosen: Vec<RemoteFile> = files
            .iter()
            .filter(|f| patterns.iter().any(|p| p.matches(&f.path)))
            .cloned()
            .collect();
        if chosen.is_empty() {
            return Err(GetError::NothingMatches {
                repo: repo.to_string(),
                patterns: include.to_vec(),
                files: files.iter().map(|f| f.path.clone()).collect(),
            });
        }
        return Ok(chosen);
    }
    if files.iter().any(|f| lower_ends(&f.path, &[".safetensors"])) {
        return Ok(files
            .iter()
            .filter(|f| !lower_ends(&f.path, OTHER_WEIGHTS))
            .cloned()
            .collect());
    }
    let models: Vec<&RemoteFile> = files
        .iter()
        .filter(|f| {
            is_gguf(&f.path)
                && !base_name(&f.path)
                    .to_ascii_lowercase()
                    .starts_with("mmproj")
        })
        .collect();
    if models.is_empty() {
        return Ok(files.to_vec());
    }
    // Group shards: (directory + base) → files.
    let mut groups: Vec<(String, Vec<&RemoteFile>)> = Vec::new();
    for f in &models {
        let (key, _) = shard_key(&f.path);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(*f),
            None => groups.push((key, vec![*f])),
        }
    }
    if groups.len() > 1 {
        let mut choices: Vec<QuantChoice> = groups
            .iter()
            .map(|(_, g)| {
                let first = g
                    .iter()
                    .min_by_key(|f| shard_key(&f.path).1)
                    .map(|f| f.path.clone())
                    .unwrap_or_default();
                QuantChoice {
                    quant: quant_of(&first),
                    file: first,
                    bytes: g.iter().map(|f| f.size).sum(),
                }
            })
            .collect();
        choices.sort_by(|a, b| a.file.cmp(&b.file));
        // Suggest a common middle ground first when present.
        if let Some(i) = choices.iter().position(|c| c.quant == "Q4_K_M") {
            let c = choices.remove(i);
            choices.insert(0, c);
        }
        return Err(GetError::ChooseQuant {
            repo: repo.to_string(),
            choices,
        });
    }
    Ok(files
        .iter()
        .filter(|f| !lower_ends(&f.path, OTHER_WEIGHTS) || models.iter().any(|m| m.path == f.path))
        .cloned()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hf::client::Check;

    fn files(names: &[(&str, u64)]) -> Vec<RemoteFile> {
        names
            .iter()
            .map(|(n, s)| RemoteFile {
                path: n.to_string(),
                size: *s,
                etag: format!("{:040}", s),
                check: Check::Unverifiable,
            })
            .collect()
    }

    fn paths(v: &[RemoteFile]) -> Vec<&str> {
        v.iter().map(|f| f.path.as_str()).collect()
    }

    #[test]
    fn safetensors_repos_skip_other_weight_formats() {
        let f = files(&[
            ("config.json", 1),
            ("model.safetensors", 2),
            ("pytorch_model.bin", 3),
            ("onnx/model.onnx", 4),
            ("tokenizer.json", 5),
        ]);
        assert_eq!(
            paths(&select("o/r", &f, &[]).unwrap()),
            ["config.json", "model.safetensors", "tokenizer.json"]
        );
    }

    #[test]
    fn gguf_repos_need_a_quant_choice() {
        let f = files(&[
            ("README.md", 1),
            ("m.Q8_0.gguf", 200),
            ("m.Q4_K_M.gguf", 100),
            ("big/m-Q2_K-00001-of-00002.gguf", 30),
            ("big/m-Q2_K-00002-of-00002.gguf", 30),
            ("mmproj-f16.gguf", 5),
        ]);
        let err = select("o/r", &f, &[]).unwrap_err();
        let GetError::ChooseQuant { choices, .. } = &err else {
            panic!("{err}")
        };
        assert_eq!(choices.len(), 3);
        assert_eq!(choices[0].quant, "Q4_K_M");
        assert!(
            choices.iter().any(|c| c.quant == "Q2_K" && c.bytes == 60),
            "{choices:?}"
        );
        assert!(err.to_string().contains("--include '*Q4_K_M*'"), "{err}");
        let chosen = select("o/r", &f, &["*Q4_K_M*".into()]).unwrap();
        assert_eq!(paths(&chosen), ["m.Q4_K_M.gguf"]);
        let split = select("o/r", &f, &["*Q2_K*".into()]).unwrap();
        assert_eq!(split.len(), 2);
        let one = files(&[("README.md", 1), ("m.Q8_0.gguf", 2), ("mmproj-f16.gguf", 5)]);
        assert_eq!(
            paths(&select("o/r", &one, &[]).unwrap()),
            ["README.md", "m.Q8_0.gguf"]
        );
        assert!(matches!(
            select("o/r", &one, &["*.none".into()]),
            Err(GetError::NothingMatches { .. })
        ));
        assert!(matches!(
            select("o/r", &one, &["[".into()]),
            Err(GetError::BadPattern { .. })
        ));
    }
}
