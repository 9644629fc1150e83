//! A fine-tune job's configuration: the reference's `FinetuneSubmit` fields with their
//! defaults, checked at submit time, and the `wick train` command line it becomes.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use wick_train::data::PromptStyle;

use crate::error::ApiError;
use crate::extract::{struct_fields, typed, RequestBody};

/// `target_modules` as a list or a comma-separated string.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum Modules {
    /// `["q_proj", "v_proj"]`.
    List(Vec<String>),
    /// `"q_proj,v_proj"`.
    Text(String),
}

impl Modules {
    fn joined(&self) -> String {
        match self {
            Modules::List(v) => v.join(","),
            Modules::Text(s) => s.clone(),
        }
    }
}

/// `POST /api/finetune/submit` body (absent fields take the reference's API defaults).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct FinetuneSubmit {
    /// Base model: a catalog name, a stored model, a directory or a GGUF file.
    pub model_dir: Option<String>,
    /// Directory with `train.jsonl` (and optionally `valid.jsonl`).
    pub data_dir: Option<String>,
    /// Output directory (empty: `$WICK_HOME/adapters/adapter-<unix time>`).
    pub adapter_path: Option<String>,
    /// `sft` (default), `dpo` or `orpo`.
    pub method: Option<String>,
    /// LoRA rank (8).
    pub rank: Option<usize>,
    /// LoRA α (1.0).
    pub scale: Option<f32>,
    /// Only `constant` changes nothing; `by_bits` and `by_kl` apply to quantized bases.
    pub rank_scaling: Option<String>,
    /// Projections to adapt.
    pub target_modules: Option<Modules>,
    /// Last N layers (-1: all).
    pub num_layers: Option<i64>,
    /// Optimizer steps (100).
    pub iters: Option<usize>,
    /// Peak learning rate (sft 2e-4, dpo 5e-5, orpo 1e-5).
    pub learning_rate: Option<f32>,
    /// Truncation length (512).
    pub max_seq_length: Option<usize>,
    /// Examples per micro-batch (1).
    pub batch_size: Option<usize>,
    /// Micro-batches per step (1).
    pub grad_accumulation_steps: Option<usize>,
    /// Shuffle and initialization seed (0).
    pub seed: Option<u64>,
    /// Steps between progress reports (10); every step is logged.
    pub steps_per_report: Option<usize>,
    /// Steps between validations (50).
    pub steps_per_eval: Option<usize>,
    /// AdamW weight decay (0.01).
    pub weight_decay: Option<f32>,
    /// LoRA dropout in [0, 1) (0).
    pub lora_dropout: Option<f32>,
    /// Scale α/√r.
    pub rs_lora: Option<bool>,
    /// LR multiplier of B (1.0).
    pub lora_plus_ratio: Option<f32>,
    /// Gradient checkpointing (false).
    pub grad_checkpoint: Option<bool>,
    /// Write a mountable checkpoint at every validation.
    pub save_checkpoints: Option<bool>,
    /// Global-norm clip (1.0; 0 off).
    pub grad_clip_norm: Option<f32>,
    /// Validation examples at most (256).
    pub val_max_examples: Option<usize>,
    /// DPO β (0.1).
    pub dpo_beta: Option<f32>,
    /// DPO warm-up steps (0).
    pub dpo_warmup_iters: Option<usize>,
    /// DPO schedule (cosine).
    pub dpo_lr_schedule: Option<String>,
    /// ORPO λ (0.1).
    pub orpo_lambda: Option<f32>,
    /// ORPO warm-up steps (0).
    pub orpo_warmup_iters: Option<usize>,
    /// ORPO schedule (cosine).
    pub orpo_lr_schedule: Option<String>,
    /// SFT warm-up steps (0; a wick extension).
    pub warmup_iters: Option<usize>,
    /// SFT schedule (cosine; a wick extension).
    pub lr_schedule: Option<String>,
    /// Only `full` (ORPO's NLL over prompt and response).
    pub sft_scope: Option<String>,
    /// Not supported yet (use `wick train --resume`).
    pub warm_start_adapter: Option<String>,
    /// Trainer threads (default: all cores, at a lower priority than serving).
    pub threads: Option<usize>,
    /// A string `prompt` as plain text instead of a user turn of the chat template (false;
    /// a wick extension, `wick train --raw-prompt`).
    pub raw_prompt: Option<bool>,
    /// Metal-specific memory and speed switches of the reference: accepted, no effect.
    pub segment_size: Option<Value>,
    /// See `segment_size`.
    pub mlp_split: Option<Value>,
    /// See `segment_size`.
    pub orpo_chunk_size: Option<Value>,
    /// See `segment_size`.
    pub orpo_fused_ce: Option<Value>,
    /// See `segment_size`.
    pub orpo_flash_ce: Option<Value>,
    /// See `segment_size`.
    pub orpo_prefix_shared: Option<Value>,
}

impl RequestBody for FinetuneSubmit {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        typed(value)
    }

    fn known_fields() -> Vec<&'static str> {
        struct_fields::<FinetuneSubmit>().to_vec()
    }
}

/// A checked job configuration, every default filled in: what the job row stores and what
/// `wick train` is run with.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FinetuneConfig {
    /// Base model argument.
    pub model_dir: String,
    /// Dataset directory.
    pub data_dir: String,
    /// Output directory.
    pub adapter_path: String,
    /// `sft`, `dpo` or `orpo`.
    pub method: String,
    /// LoRA rank.
    pub rank: usize,
    /// LoRA α.
    pub scale: f32,
    /// As submitted (recorded; the trainer uses `rank`).
    pub rank_scaling: String,
    /// Comma-separated projections.
    pub target_modules: String,
    /// Last N layers (-1: all).
    pub num_layers: i64,
    /// Optimizer steps.
    pub iters: usize,
    /// Peak learning rate.
    pub learning_rate: f32,
    /// Truncation length.
    pub max_seq_length: usize,
    /// Examples per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per step.
    pub grad_accumulation_steps: usize,
    /// Shuffle and initialization seed.
    pub seed: u64,
    /// Steps between progress reports.
    pub steps_per_report: usize,
    /// Steps between validations.
    pub steps_per_eval: usize,
    /// AdamW weight decay.
    pub weight_decay: f32,
    /// rsLoRA scaling.
    pub rs_lora: bool,
    /// LR multiplier of B.
    pub lora_plus_ratio: f32,
    /// LoRA dropout.
    #[serde(default)]
    pub lora_dropout: f32,
    /// Gradient checkpointing.
    #[serde(default)]
    pub grad_checkpoint: bool,
    /// A checkpoint at every validation.
    pub save_checkpoints: bool,
    /// Global-norm clip (0: off).
    pub grad_clip_norm: f32,
    /// Validation examples at most.
    pub val_max_examples: usize,
    /// DPO β.
    pub beta: f32,
    /// ORPO λ.
    pub lambda: f32,
    /// Warm-up steps.
    pub warmup_iters: usize,
    /// Learning-rate schedule.
    pub lr_schedule: String,
    /// Trainer threads.
    pub threads: Option<usize>,
    /// String prompts as plain text (`--raw-prompt`).
    #[serde(default)]
    pub raw_prompt: bool,
    /// What `inspect-dataset` found at submit time.
    pub dataset: Value,
}

const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Qwen 3.5's DeltaNet projections: adapted when named (`wick train --target-modules`).
const DELTANET_TARGETS: [&str; 5] = [
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
];

fn positive<T: PartialOrd + Default + Copy + std::fmt::Display>(
    field: &str,
    v: Option<T>,
    default: T,
) -> Result<T, ApiError> {
    let v = v.unwrap_or(default);
    if v <= T::default() {
        return Err(ApiError::field(field, format!("must be positive, got {v}")));
    }
    Ok(v)
}

fn finite_at_least_zero(field: &str, v: Option<f32>, default: f32) -> Result<f32, ApiError> {
    let v = v.unwrap_or(default);
    if !(v.is_finite() && v >= 0.0) {
        return Err(ApiError::field(
            field,
            format!("must be 0 or more, got {v}"),
        ));
    }
    Ok(v)
}

fn schedule(field: &str, v: Option<String>) -> Result<String, ApiError> {
    let v = v.unwrap_or_else(|| "cosine".into());
    match v.as_str() {
        "cosine" | "linear" | "constant" => Ok(v),
        _ => Err(ApiError::field(
            field,
            format!("'{v}': expected cosine, linear or constant"),
        )),
    }
}

fn required(field: &str, v: Option<String>) -> Result<String, ApiError> {
    v.filter(|s| !s.trim().is_empty())
        .ok_or_else(|| ApiError::Missing {
            param: field.into(),
        })
}

impl FinetuneSubmit {
    /// Checks the request and fills in the defaults. `inspect` reads `data_dir` with the
    /// job's prompt style (the format it finds decides which methods fit); `adapters_dir`
    /// is where an empty `adapter_path` goes.
    pub fn check(
        self,
        inspect: impl FnOnce(&Path, PromptStyle) -> Result<Value, String>,
        adapters_dir: &Path,
        now: u64,
    ) -> Result<FinetuneConfig, ApiError> {
        let model_dir = required("model_dir", self.model_dir)?;
        let data_dir = required("data_dir", self.data_dir)?;
        let method = self.method.unwrap_or_else(|| "sft".into());
        let (default_lr, preference) = match method.as_str() {
            "sft" => (2e-4, false),
            "dpo" => (5e-5, true),
            "orpo" => (1e-5, true),
            _ => {
                return Err(ApiError::field(
                    "method",
                    format!("'{method}': expected sft, dpo or orpo"),
                ))
            }
        };
        let raw_prompt = self.raw_prompt.unwrap_or(false);
        let dataset = inspect(Path::new(&data_dir), PromptStyle::from_raw_flag(raw_prompt))
            .map_err(|e| ApiError::field("data_dir", e))?;
        let format = dataset["format"].as_str().unwrap_or("");
        if preference != (format == "preference") {
            return Err(ApiError::field(
                "data_dir",
                if preference {
                    format!("{method} needs preference rows (prompt, chosen, rejected); this dataset has {format} rows")
                } else {
                    "preference rows (prompt, chosen, rejected) train with method dpo or orpo"
                        .into()
                },
            ));
        }
        let lora_dropout = self.lora_dropout.unwrap_or(0.0);
        if !(0.0..1.0).contains(&lora_dropout) {
            return Err(ApiError::field(
                "lora_dropout",
                "lora_dropout must be at least 0 and below 1",
            ));
        }
        if self.sft_scope.as_deref().is_some_and(|s| s != "full") {
            return Err(ApiError::unsupported(
                "sft_scope",
                "only 'full' (ORPO's NLL over prompt and response) is supported",
            ));
        }
        if self
            .warm_start_adapter
            .as_deref()
            .is_some_and(|s| !s.is_empty())
        {
            return Err(ApiError::unsupported(
                "warm_start_adapter",
                "warm starts are not supported over HTTP yet; `wick train --resume DIR` continues a checkpoint",
            ));
        }
        let rank_scaling = self.rank_scaling.unwrap_or_else(|| "by_bits".into());
        if !matches!(rank_scaling.as_str(), "constant" | "by_bits" | "by_kl") {
            return Err(ApiError::field(
                "rank_scaling",
                format!("'{rank_scaling}': expected constant, by_bits or by_kl"),
            ));
        }
        let target_modules = self
            .target_modules
            .map(|m| m.joined())
            .unwrap_or_else(|| TARGETS.join(","));
        for t in target_modules.split(',').map(str::trim) {
            if !TARGETS.contains(&t) && !DELTANET_TARGETS.contains(&t) {
                return Err(ApiError::field(
                    "target_modules",
                    format!(
                        "'{t}': expected some of {} (Qwen 3.5 also {})",
                        TARGETS.join(", "),
                        DELTANET_TARGETS.join(", ")
                    ),
                ));
            }
        }
        let (beta, lambda) = (
            positive("dpo_beta", self.dpo_beta, 0.1)?,
            positive("orpo_lambda", self.orpo_lambda, 0.1)?,
        );
        let (warmup, lr_schedule) = match method.as_str() {
            "dpo" => (
                self.dpo_warmup_iters,
                schedule("dpo_lr_schedule", self.dpo_lr_schedule)?,
            ),
            "orpo" => (
                self.orpo_warmup_iters,
                schedule("orpo_lr_schedule", self.orpo_lr_schedule)?,
            ),
            _ => (
                self.warmup_iters,
                schedule("lr_schedule", self.lr_schedule)?,
            ),
        };
        let adapter_path = match self.adapter_path.filter(|p| !p.trim().is_empty()) {
            Some(p) => p,
            None => adapters_dir
                .join(format!("adapter-{now}"))
                .display()
                .to_string(),
        };
        let lr = positive("learning_rate", self.learning_rate, default_lr)?;
        if !lr.is_finite() {
            return Err(ApiError::field("learning_rate", "must be finite"));
        }
        let scale = positive("scale", self.scale, 1.0)?;
        let lora_plus_ratio = positive("lora_plus_ratio", self.lora_plus_ratio, 1.0)?;
        if !(scale.is_finite() && lora_plus_ratio.is_finite()) {
            return Err(ApiError::field("scale", "must be finite"));
        }
        Ok(FinetuneConfig {
            model_dir,
            data_dir,
            adapter_path,
            method,
            rank: positive("rank", self.rank, 8)?,
            scale,
            rank_scaling,
            target_modules,
            num_layers: self.num_layers.unwrap_or(-1),
            iters: positive("iters", self.iters, 100)?,
            learning_rate: lr,
            max_seq_length: positive("max_seq_length", self.max_seq_length, 512)?,
            batch_size: positive("batch_size", self.batch_size, 1)?,
            grad_accumulation_steps: positive(
                "grad_accumulation_steps",
                self.grad_accumulation_steps,
                1,
            )?,
            seed: self.seed.unwrap_or(0),
            steps_per_report: positive("steps_per_report", self.steps_per_report, 10)?,
            steps_per_eval: positive("steps_per_eval", self.steps_per_eval, 50)?,
            weight_decay: finite_at_least_zero("weight_decay", self.weight_decay, 0.01)?,
            rs_lora: self.rs_lora.unwrap_or(false),
            lora_plus_ratio,
            lora_dropout,
            grad_checkpoint: self.grad_checkpoint.unwrap_or(false),
            save_checkpoints: self.save_checkpoints.unwrap_or(false),
            grad_clip_norm: finite_at_least_zero("grad_clip_norm", self.grad_clip_norm, 1.0)?,
            val_max_examples: self.val_max_examples.unwrap_or(256),
            beta,
            lambda,
            warmup_iters: warmup.unwrap_or(0),
            lr_schedule,
            threads: match self.threads {
                Some(0) => return Err(ApiError::field("threads", "must be positive")),
                t => t,
            },
            raw_prompt,
            dataset,
        })
    }
}

impl FinetuneConfig {
    /// The output directory.
    pub fn output(&self) -> PathBuf {
        PathBuf::from(&self.adapter_path)
    }

    /// `wick train …` arguments (after the program name).
    pub fn trainer_args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "train".into(),
            self.model_dir.clone(),
            "--data".into(),
            self.data_dir.clone(),
            "--adapter".into(),
            self.adapter_path.clone(),
            "--method".into(),
            self.method.clone(),
            "--events".into(),
        ];
        let mut flag = |name: &str, value: String| {
            a.push(format!("--{name}"));
            a.push(value);
        };
        flag("rank", self.rank.to_string());
        flag("scale", self.scale.to_string());
        flag("target-modules", self.target_modules.clone());
        flag("num-layers", self.num_layers.to_string());
        flag("iters", self.iters.to_string());
        flag("lr", self.learning_rate.to_string());
        flag("seq", self.max_seq_length.to_string());
        flag("batch", self.batch_size.to_string());
        flag("grad-accum", self.grad_accumulation_steps.to_string());
        flag("seed", self.seed.to_string());
        flag("eval-every", self.steps_per_eval.to_string());
        flag("weight-decay", self.weight_decay.to_string());
        flag("lora-plus-ratio", self.lora_plus_ratio.to_string());
        flag("grad-clip", self.grad_clip_norm.to_string());
        flag("val-size", self.val_max_examples.to_string());
        flag("beta", self.beta.to_string());
        flag("lambda", self.lambda.to_string());
        flag("warmup", self.warmup_iters.to_string());
        flag("schedule", self.lr_schedule.clone());
        if self.save_checkpoints {
            flag("save-every", self.steps_per_eval.to_string());
        }
        if let Some(t) = self.threads {
            flag("threads", t.to_string());
        }
        if self.lora_dropout > 0.0 {
            flag("lora-dropout", self.lora_dropout.to_string());
        }
        if self.rs_lora {
            a.push("--rs-lora".into());
        }
        if self.grad_checkpoint {
            a.push("--grad-checkpoint".into());
        }
        if self.raw_prompt {
            a.push("--raw-prompt".into());
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sft_data(_: &Path, _: PromptStyle) -> Result<Value, String> {
        Ok(json!({"format": "messages", "n_train": 3, "n_valid": 0}))
    }

    fn submit(v: Value) -> Result<FinetuneConfig, ApiError> {
        FinetuneSubmit::from_json(&v)?.check(sft_data, Path::new("/home/a"), 42)
    }

    #[test]
    fn defaults_are_the_references_and_become_train_flags() {
        let c = submit(json!({"model_dir": "default", "data_dir": "/d"})).unwrap();
        assert_eq!(
            (
                c.method.as_str(),
                c.rank,
                c.scale,
                c.iters,
                c.max_seq_length
            ),
            ("sft", 8, 1.0, 100, 512)
        );
        assert_eq!(c.learning_rate, 2e-4);
        assert_eq!(c.adapter_path, "/home/a/adapter-42");
        let args = c.trainer_args();
        let at = |f: &str| args[args.iter().position(|a| a == f).unwrap() + 1].clone();
        assert_eq!(&args[..2], ["train", "default"]);
        assert_eq!(at("--seq"), "512");
        assert_eq!(at("--lr"), "0.0002");
        assert_eq!(at("--method"), "sft");
        assert!(args.contains(&"--events".to_string()));
        assert!(!args.contains(&"--save-every".to_string()));
        assert!(!args.contains(&"--raw-prompt".to_string()));
    }

    #[test]
    fn raw_prompt_reaches_the_inspection_and_the_trainer() {
        let mut seen = None;
        let c = FinetuneSubmit::from_json(
            &json!({"model_dir": "m", "data_dir": "/d", "raw_prompt": true}),
        )
        .unwrap()
        .check(
            |_, style| {
                seen = Some(style);
                sft_data(Path::new("/d"), style)
            },
            Path::new("/a"),
            0,
        )
        .unwrap();
        assert_eq!(seen, Some(PromptStyle::Raw));
        assert!(c.raw_prompt);
        assert!(c.trainer_args().contains(&"--raw-prompt".to_string()));
    }

    #[test]
    fn bad_requests_name_the_field() {
        let param = |v: Value| submit(v).unwrap_err().param().map(str::to_string);
        assert_eq!(
            param(json!({"data_dir": "/d"})).as_deref(),
            Some("model_dir")
        );
        assert_eq!(
            param(json!({"model_dir": "m"})).as_deref(),
            Some("data_dir")
        );
        let base = |extra: Value| {
            let mut v = json!({"model_dir": "m", "data_dir": "/d"});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            v
        };
        for (extra, field) in [
            (json!({"method": "ppo"}), "method"),
            (json!({"method": "dpo"}), "data_dir"),
            (json!({"rank": 0}), "rank"),
            (json!({"iters": 0}), "iters"),
            (json!({"learning_rate": -1.0}), "learning_rate"),
            (json!({"lora_dropout": 1.0}), "lora_dropout"),
            (
                json!({"target_modules": ["q_proj", "lm_head"]}),
                "target_modules",
            ),
            (json!({"lr_schedule": "step"}), "lr_schedule"),
        ] {
            assert_eq!(
                param(base(extra.clone())).as_deref(),
                Some(field),
                "{extra}"
            );
        }
        let e = FinetuneSubmit::from_json(&json!({"model_dir": "m", "data_dir": "/d"}))
            .unwrap()
            .check(|_, _| Err("no train.jsonl".into()), Path::new("/a"), 0)
            .unwrap_err();
        assert!(e.to_string().contains("no train.jsonl"), "{e}");
        let c = submit(base(
            json!({"target_modules": "q_proj,v_proj", "save_checkpoints": true,
                                   "steps_per_eval": 5, "orpo_flash_ce": true,
                                   "lora_dropout": 0.05, "grad_checkpoint": true}),
        ))
        .unwrap();
        let args = c.trainer_args();
        let at = |f: &str| args[args.iter().position(|a| a == f).unwrap() + 1].clone();
        assert_eq!(at("--target-modules"), "q_proj,v_proj");
        assert_eq!(at("--save-every"), "5");
        assert_eq!(at("--lora-dropout"), "0.05");
        assert!(args.contains(&"--grad-checkpoint".to_string()));
        // Qwen 3.5's DeltaNet projections are names the trainer takes.
        let c = submit(base(
            json!({"target_modules": ["q_proj", "in_proj_qkv", "out_proj"]}),
        ))
        .unwrap();
        let args = c.trainer_args();
        let at = |f: &str| args[args.iter().position(|a| a == f).unwrap() + 1].clone();
        assert_eq!(at("--target-modules"), "q_proj,in_proj_qkv,out_proj");
    }
}
