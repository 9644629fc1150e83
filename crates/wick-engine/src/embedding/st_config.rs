//! What a sentence-transformers model directory says about turning token states into one
//! vector: `modules.json` (Transformer → Pooling → Normalize), `1_Pooling/config.json`, the
//! truncation length in `sentence_bert_config.json` and the named prompts and
//! Matryoshka dimensions in `config_sentence_transformers.json`.
use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::{EngineError, Result};

/// How token states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The first token's state (`[CLS]`).
    Cls,
    /// The mean over the tokens.
    Mean,
    /// The mean times `sqrt(len)`: the sum divided by `sqrt(len)`.
    MeanSqrtLen,
    /// The element-wise maximum over the tokens.
    Max,
    /// The last token's state (decoder embedding models).
    LastToken,
}

impl Pooling {
    /// The name sentence-transformers gives the mode.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Cls => "cls",
            Pooling::Mean => "mean",
            Pooling::MeanSqrtLen => "mean_sqrt_len_tokens",
            Pooling::Max => "max",
            Pooling::LastToken => "lasttoken",
        }
    }

    /// Pools `states` (`[len][hidden]`, row-major) into `hidden` values.
    pub fn pool(self, states: &[f32], hidden: usize) -> Vec<f32> {
        let len = states.len() / hidden.max(1);
        let rows = || states.chunks_exact(hidden);
        match self {
            Pooling::Cls => states[..hidden].to_vec(),
            Pooling::LastToken => states[(len - 1) * hidden..].to_vec(),
            Pooling::Max => rows().fold(vec![f32::NEG_INFINITY; hidden], |mut m, r| {
                m.iter_mut().zip(r).for_each(|(m, &v)| *m = m.max(v));
                m
            }),
            Pooling::Mean | Pooling::MeanSqrtLen => {
                let mut sum = vec![0f64; hidden];
                for r in rows() {
                    sum.iter_mut().zip(r).for_each(|(s, &v)| *s += v as f64);
                }
                let div = match self {
                    Pooling::Mean => len as f64,
                    _ => (len as f64).sqrt(),
                };
                sum.into_iter().map(|s| (s / div) as f32).collect()
            }
        }
    }
}

/// The sentence-transformers settings of a model directory.
#[derive(Debug, Clone, PartialEq)]
pub struct SentenceConfig {
    /// Pooling mode.
    pub pooling: Pooling,
    /// Whether vectors are L2-normalised (a `Normalize` module).
    pub normalize: bool,
    /// Longest input in tokens; longer texts are cut (`max_seq_length`).
    pub max_seq_length: Option<usize>,
    /// Named prompts put before a text (`prompts`).
    pub prompts: BTreeMap<String, String>,
    /// The prompt used when a request names none (`default_prompt_name`).
    pub default_prompt: Option<String>,
    /// The smallest dimension the model was trained to be truncated to
    /// (`matryoshka_dimensions`), if it declares any.
    pub matryoshka_min: Option<usize>,
    /// Whether the directory had sentence-transformers files at all.
    pub found: bool,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| EngineError::Config {
                source_name: path.display().to_string(),
                reason: format!("not valid JSON: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(EngineError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

impl SentenceConfig {
    /// The settings of a model without sentence-transformers files.
    pub fn defaults(pooling: Pooling, normalize: bool) -> Self {
        SentenceConfig {
            pooling,
            normalize,
            max_seq_length: None,
            prompts: BTreeMap::new(),
            default_prompt: None,
            matryoshka_min: None,
            found: false,
        }
    }

    /// Reads `dir`'s settings; without sentence-transformers files, `default_pooling` and
    /// `default_normalize` apply.
    pub fn read(dir: &Path, default_pooling: Pooling, default_normalize: bool) -> Result<Self> {
        let bad = |path: &Path, reason: String| EngineError::Config {
            source_name: path.display().to_string(),
            reason,
        };
        let mut cfg = Self::defaults(default_pooling, default_normalize);
        let modules_path = dir.join("modules.json");
        if let Some(modules) = read_json(&modules_path)? {
            cfg.found = true;
            cfg.normalize = false;
            let list = modules
                .as_array()
                .ok_or_else(|| bad(&modules_path, "not a list of modules".into()))?;
            for m in list {
                let ty = m.get("type").and_then(Value::as_str).unwrap_or("");
                let sub = m.get("path").and_then(Value::as_str).unwrap_or("");
                match ty.rsplit('.').next().unwrap_or(ty) {
                    "Transformer" => {}
                    "Normalize" => cfg.normalize = true,
                    "Pooling" => {
                        if sub.contains("..") || Path::new(sub).is_absolute() {
                            return Err(bad(
                                &modules_path,
                                format!("module path '{sub}' leaves the model directory"),
                            ));
                        }
                        let path = dir.join(sub).join("config.json");
                        let pooling = read_json(&path)?
                            .ok_or_else(|| bad(&path, "missing (named by modules.json)".into()))?;
                        cfg.pooling = pooling_mode(&pooling).map_err(|r| bad(&path, r))?;
                    }
                    other => {
                        return Err(bad(
                            &modules_path,
                            format!(
                            "module '{other}' is not supported (Transformer, Pooling, Normalize)"
                        ),
                        ))
                    }
                }
            }
        }
        if let Some(sb) = read_json(&dir.join("sentence_bert_config.json"))? {
            cfg.max_seq_length = sb
                .get("max_seq_length")
                .and_then(Value::as_u64)
                .filter(|&n| n > 0)
                .map(|n| n as usize);
        }
        let mut matryoshka = None;
        if let Some(st) = read_json(&dir.join("config_sentence_transformers.json"))? {
            if let Some(prompts) = st.get("prompts").and_then(Value::as_object) {
                cfg.prompts = prompts
                    .iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect();
            }
            cfg.default_prompt = st
                .get("default_prompt_name")
                .and_then(Value::as_str)
                .map(str::to_string);
            if let Some(name) = &cfg.default_prompt {
                if !cfg.prompts.contains_key(name) {
                    return Err(bad(
                        &dir.join("config_sentence_transformers.json"),
                        format!("default_prompt_name '{name}' is not one of the prompts"),
                    ));
                }
            }
            matryoshka = st.get("matryoshka_dimensions").cloned();
        }
        if matryoshka.is_none() {
            if let Some(model) = read_json(&dir.join("config.json"))? {
                matryoshka = model.get("matryoshka_dimensions").cloned();
            }
        }
        cfg.matryoshka_min = matryoshka
            .as_ref()
            .and_then(Value::as_array)
            .and_then(|dims| dims.iter().filter_map(Value::as_u64).min())
            .filter(|&d| d > 0)
            .map(|d| d as usize);
        Ok(cfg)
    }
}

/// The one pooling mode a `1_Pooling/config.json` turns on.
fn pooling_mode(json: &Value) -> std::result::Result<Pooling, String> {
    let on = |key: &str| json.get(key).and_then(Value::as_bool).unwrap_or(false);
    if on("pooling_mode_weightedmean_tokens") {
        return Err("pooling_mode_weightedmean_tokens is not supported".into());
    }
    let modes = [
        ("pooling_mode_cls_token", Pooling::Cls),
        ("pooling_mode_mean_tokens", Pooling::Mean),
        ("pooling_mode_max_tokens", Pooling::Max),
        ("pooling_mode_mean_sqrt_len_tokens", Pooling::MeanSqrtLen),
        ("pooling_mode_lasttoken", Pooling::LastToken),
    ];
    let set: Vec<Pooling> = modes
        .iter()
        .filter(|(k, _)| on(k))
        .map(|(_, p)| *p)
        .collect();
    match set.as_slice() {
        [one] => Ok(*one),
        [] => Err("no pooling mode is turned on".into()),
        _ => Err("several pooling modes at once (concatenated vectors) are not supported".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_modes() {
        let states = [1.0, 2.0, 3.0, -4.0, 5.0, 0.0];
        assert_eq!(Pooling::Cls.pool(&states, 2), vec![1.0, 2.0]);
        assert_eq!(Pooling::LastToken.pool(&states, 2), vec![5.0, 0.0]);
        assert_eq!(Pooling::Max.pool(&states, 2), vec![5.0, 2.0]);
        assert_eq!(Pooling::Mean.pool(&states, 2), vec![3.0, -2.0 / 3.0]);
        let s = Pooling::MeanSqrtLen.pool(&states, 2);
        assert!((s[0] - 9.0 / 3f32.sqrt()).abs() < 1e-6);
    }

    #[test]
    fn reads_a_sentence_transformers_directory() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(
            d.join("modules.json"),
            r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
               {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
               {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
        )
        .unwrap();
        std::fs::create_dir(d.join("1_Pooling")).unwrap();
        std::fs::write(
            d.join("1_Pooling/config.json"),
            r#"{"word_embedding_dimension": 8, "pooling_mode_mean_tokens": true}"#,
        )
        .unwrap();
        std::fs::write(
            d.join("sentence_bert_config.json"),
            r#"{"max_seq_length": 16}"#,
        )
        .unwrap();
        std::fs::write(
            d.join("config_sentence_transformers.json"),
            r#"{"prompts": {"query": "q: ", "document": ""}, "default_prompt_name": null,
                "matryoshka_dimensions": [8, 4, 2]}"#,
        )
        .unwrap();
        let cfg = SentenceConfig::read(d, Pooling::LastToken, false).unwrap();
        assert_eq!(cfg.pooling, Pooling::Mean);
        assert!(cfg.normalize && cfg.found);
        assert_eq!(cfg.max_seq_length, Some(16));
        assert_eq!(cfg.prompts["query"], "q: ");
        assert_eq!(cfg.matryoshka_min, Some(2));

        // A module wick does not run is an error naming it.
        std::fs::write(
            d.join("modules.json"),
            r#"[{"path":"2_Dense","type":"sentence_transformers.models.Dense"}]"#,
        )
        .unwrap();
        let err = SentenceConfig::read(d, Pooling::Mean, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Dense"), "{err}");

        // No files: the defaults.
        let empty = tempfile::tempdir().unwrap();
        let cfg = SentenceConfig::read(empty.path(), Pooling::LastToken, true).unwrap();
        assert_eq!(
            (cfg.pooling, cfg.normalize, cfg.found),
            (Pooling::LastToken, true, false)
        );
    }
}
