//! Reading adapter files into host deltas: PEFT (`adapter_config.json` +
//! `adapter_model.safetensors`, `lora_A [r, in]` / `lora_B [out, r]`), mlx-lm
//! (`adapters.safetensors`, `lora_a [in, r]` / `lora_b [r, out]`) and llama.cpp GGUF LoRA
//! (`general.type = adapter`). Every delta is checked against the base model before
//! anything is mounted: one bad tensor refuses the whole adapter.
use crate::backend::capability::{Part, Requirement};
use std::path::{Path, PathBuf};

use serde_json::Value;
use wick_gguf::GgufFile;

use super::{AdapterError, Target};
use crate::config::ModelConfig;
use crate::weights::{HostWeight, SafetensorsWeights};

/// The file format an adapter came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterFormat {
    /// Hugging Face PEFT.
    Peft,
    /// mlx-lm (`mlx_lm.lora`).
    MlxLm,
    /// llama.cpp's GGUF LoRA.
    Gguf,
}

impl AdapterFormat {
    /// A short name for listings.
    pub fn name(self) -> &'static str {
        match self {
            AdapterFormat::Peft => "peft",
            AdapterFormat::MlxLm => "mlx-lm",
            AdapterFormat::Gguf => "gguf",
        }
    }
}

/// One linear layer's delta, on the host: `y += (x · Aᵀ) · Bᵀ` with the scale folded
/// into `B`.
#[derive(Debug, Clone)]
pub struct HostDelta {
    /// Decoder layer.
    pub layer: usize,
    /// Which projection.
    pub target: Target,
    /// Rank.
    pub rank: usize,
    /// The scale folded into `b`.
    pub scale: f32,
    /// `A`, `[rank, in]` row-major.
    pub a: Vec<f32>,
    /// `scale · B`, `[out, rank]` row-major.
    pub b: Vec<f32>,
    /// Input width.
    pub in_dim: usize,
    /// Output width.
    pub out_dim: usize,
}

/// Which stacked weight of a mixture-of-experts layer a [`HostExpertDelta`] adapts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertPart {
    /// Every expert's `[gate; up]` (`experts.gate_up_proj`, `[experts, 2·inner, hidden]`).
    GateUp,
    /// Every expert's down projection (`experts.down_proj`, `[experts, hidden, inner]`).
    Down,
}

impl ExpertPart {
    /// Index in a layer's pair of expert slots.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The parameter's name in Hugging Face checkpoints (PEFT's `target_parameters`).
    pub fn hf_parameter(self) -> &'static str {
        match self {
            ExpertPart::GateUp => "experts.gate_up_proj",
            ExpertPart::Down => "experts.down_proj",
        }
    }
}

/// One stacked expert weight's deltas (PEFT's `target_parameters` on a 3-D parameter), on
/// the host: expert `e`'s output gains `(x · A_eᵀ) · B_eᵀ` with the scale folded into `B`.
#[derive(Debug, Clone)]
pub struct HostExpertDelta {
    /// Decoder layer.
    pub layer: usize,
    /// Which stacked weight.
    pub part: ExpertPart,
    /// Experts (each has its own pair).
    pub experts: usize,
    /// Rank of each expert's pair.
    pub rank: usize,
    /// The scale folded into `b`.
    pub scale: f32,
    /// Every expert's `A`, `[rank, in]` row-major, expert after expert.
    pub a: Vec<f32>,
    /// Every expert's `scale · B`, `[out, rank]` row-major, expert after expert.
    pub b: Vec<f32>,
    /// Input width of one expert's product.
    pub in_dim: usize,
    /// Output width of one expert's product.
    pub out_dim: usize,
}

impl HostExpertDelta {
    /// Expert `e`'s `A` (`[rank, in]`) and `scale · B` (`[out, rank]`).
    pub fn pair(&self, e: usize) -> (&[f32], &[f32]) {
        let (na, nb) = (self.rank * self.in_dim, self.out_dim * self.rank);
        (&self.a[e * na..(e + 1) * na], &self.b[e * nb..(e + 1) * nb])
    }
}

/// An adapter read from disk and checked against a base model.
#[derive(Debug, Clone)]
pub struct HostAdapter {
    /// Where it came from.
    pub path: PathBuf,
    /// Its format.
    pub format: AdapterFormat,
    /// Every delta, by layer then target.
    pub deltas: Vec<HostDelta>,
    /// Deltas of stacked expert weights (Gemma 4's mixture of experts), by layer then part.
    pub expert_deltas: Vec<HostExpertDelta>,
    /// Tensors that target nothing wick adapts, skipped.
    pub skipped_tensors: usize,
    /// The base model the adapter records.
    pub base_model: Option<String>,
}

impl HostAdapter {
    /// The largest rank.
    pub fn rank(&self) -> usize {
        let experts = self.expert_deltas.iter().map(|d| d.rank);
        self.deltas
            .iter()
            .map(|d| d.rank)
            .chain(experts)
            .max()
            .unwrap_or(0)
    }

    /// The first delta's scale (0 with none).
    pub fn scale(&self) -> f32 {
        self.deltas.first().map_or(0.0, |d| d.scale)
    }

    /// Bytes of the deltas (f32).
    pub fn size_bytes(&self) -> usize {
        let experts: usize = self
            .expert_deltas
            .iter()
            .map(|d| (d.a.len() + d.b.len()) * 4)
            .sum();
        self.deltas
            .iter()
            .map(|d| (d.a.len() + d.b.len()) * 4)
            .sum::<usize>()
            + experts
    }

    /// A digest of the deltas' values (XXH3 over each delta's layer, target and f32 bits).
    pub fn digest(&self) -> u64 {
        fn values(h: &mut xxhash_rust::xxh3::Xxh3, v: &[f32]) {
            if cfg!(target_endian = "little") {
                h.update(bytemuck::cast_slice(v));
            } else {
                for x in v.iter() {
                    h.update(&x.to_le_bytes());
                }
            }
        }
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for d in &self.deltas {
            h.update(&(d.layer as u64).to_le_bytes());
            h.update(&(d.target.index() as u64).to_le_bytes());
            values(&mut h, &d.a);
            values(&mut h, &d.b);
        }
        // Expert deltas are tagged past the plain targets' indices.
        for d in &self.expert_deltas {
            h.update(&(d.layer as u64).to_le_bytes());
            h.update(&((Target::COUNT + d.part.index()) as u64).to_le_bytes());
            values(&mut h, &d.a);
            values(&mut h, &d.b);
        }
        h.digest()
    }
}

/// How the base model lays out its Q/K rows: GGUF Llama files hold them permuted for
/// interleaved rope, so the `B` of a Hugging Face-format adapter must be permuted the same
/// way (llama.cpp's converter permutes its GGUF adapters already).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkPermutation {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
}

/// Reads the adapter at `path` (a directory, or a `.gguf` file) and checks every delta
/// against `cfg`'s shapes. `permute` is set for bases whose Q/K rows are permuted.
pub fn load_host(
    path: &Path,
    cfg: &ModelConfig,
    permute: Option<QkPermutation>,
) -> Result<HostAdapter, AdapterError> {
    if !path.exists() {
        return Err(AdapterError::invalid(path, "no such file or directory"));
    }
    // A family whose layers carry no adapter deltas yet declares so: refuse rather than
    // mount an adapter that would change nothing.
    let unbuilt = crate::models::needs(cfg)
        .into_iter()
        .find(|n| n.part == Part::Adapters && matches!(n.requirement, Requirement::NotBuilt(_)));
    if let Some(n) = unbuilt {
        return Err(AdapterError::invalid(
            path,
            format!(
                "adapters on {} models are not supported yet ({})",
                cfg.arch, n.requirement
            ),
        ));
    }
    if path.is_file() {
        return load_gguf(path, path, cfg);
    }
    let st = ["adapter_model.safetensors", "adapters.safetensors"]
        .iter()
        .map(|f| path.join(f))
        .find(|p| p.is_file());
    if let Some(file) = st {
        let config = read_config(path)?;
        return load_safetensors(path, &file, &config, cfg, permute);
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| AdapterError::invalid(path, e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    match ggufs.as_slice() {
        [one] => load_gguf(path, one, cfg),
        [] => Err(AdapterError::invalid(
            path,
            "no adapter weights (adapter_model.safetensors, adapters.safetensors or a .gguf file)",
        )),
        _ => Err(AdapterError::invalid(
            path,
            "several .gguf files; name the one to mount",
        )),
    }
}

fn read_config(dir: &Path) -> Result<Value, AdapterError> {
    let file = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&file)
        .map_err(|e| AdapterError::invalid(dir, format!("cannot read adapter_config.json: {e}")))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| AdapterError::invalid(dir, format!("adapter_config.json: {e}")))?;
    if !v.is_object() {
        return Err(AdapterError::invalid(
            dir,
            "adapter_config.json is not an object",
        ));
    }
    Ok(v)
}

/// Which factor a tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Factor {
    A,
    B,
}

/// Module paths of the vision and audio towers (Gemma 3/4, Qwen 2.5-VL/3.5): adapters on
/// them are skipped.
const TOWERS: [&str; 4] = ["vision_tower.", "audio_tower.", "vision_model.", "visual."];

/// `(layer, module path within the layer, factor, whether the key is mlx-lm's lower-case
/// form)` of a LoRA tensor name; `None` for names that are not LoRA factors of a layer.
fn parse_hf_key(key: &str) -> Option<(usize, &str, Factor, bool)> {
    // A multimodal checkpoint's towers have `layers.N` of their own: never the text's.
    if TOWERS.iter().any(|t| key.contains(t)) {
        return None;
    }
    let at = key.find(".lora_")?;
    let (module, rest) = (&key[..at], &key[at + ".lora_".len()..]);
    let (factor, lower) = match rest.split('.').next()? {
        "A" => (Factor::A, false),
        "B" => (Factor::B, false),
        "a" => (Factor::A, true),
        "b" => (Factor::B, true),
        _ => return None,
    };
    let Some(li) = module.rfind("layers.") else {
        // Gemma 4's per-layer-input projection of the whole model sits outside the layers.
        let model_level = Target::PleModel.hf_module();
        let at = module.rfind(model_level)?;
        let whole =
            at + model_level.len() == module.len() && (at == 0 || module[..at].ends_with('.'));
        return whole.then_some((0, model_level, factor, lower));
    };
    let after = &module[li + "layers.".len()..];
    let (num, inner) = after.split_once('.')?;
    let layer = num.parse().ok()?;
    Some((layer, inner, factor, lower))
}

/// Whether PEFT's `rank_pattern`/`alpha_pattern` key `pattern` names module `name`.
fn pattern_matches(pattern: &str, name: &str) -> bool {
    name == pattern || name.ends_with(&format!(".{pattern}"))
}

struct ScaleRule {
    /// mlx-lm's `lora_parameters.scale`: one scale whatever the rank.
    fixed: Option<f32>,
    alpha: f32,
    alpha_pattern: Vec<(String, f32)>,
    rslora: bool,
    /// Whether `fixed` is divided by √r (mlx-lm-side `lora_parameters.rs_lora`).
    fixed_rslora: bool,
}

impl ScaleRule {
    fn from_config(dir: &Path, c: &Value, mlx: bool) -> Result<ScaleRule, AdapterError> {
        let lp = c.get("lora_parameters");
        let num = |v: Option<&Value>| v.and_then(Value::as_f64).map(|x| x as f32);
        let fixed = num(lp.and_then(|p| p.get("scale")));
        let alpha = num(c.get("lora_alpha"));
        // mlx-lm's scale is absolute; only its own `rs_lora` divides it (PEFT's
        // `use_rslora` beside it is about `lora_alpha`: wick's trainer writes both).
        let lp_rslora = lp
            .and_then(|p| p.get("rs_lora"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let rslora = lp_rslora
            || c.get("use_rslora")
                .and_then(Value::as_bool)
                .unwrap_or(false);
        let alpha_pattern = match c.get("alpha_pattern") {
            Some(Value::Object(m)) => m
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_f64()? as f32)))
                .collect(),
            _ => Vec::new(),
        };
        // mlx-lm writes only `lora_parameters.scale` (its default is 20); PEFT only
        // `lora_alpha` (its default is 8).
        let fixed = match (fixed, alpha, mlx) {
            (Some(s), _, _) => Some(s),
            (None, None, true) => Some(20.0),
            _ => None,
        };
        let rule = ScaleRule {
            fixed,
            alpha: alpha.unwrap_or(8.0),
            alpha_pattern,
            rslora,
            fixed_rslora: lp_rslora,
        };
        if rule.fixed.is_some_and(|s| !s.is_finite()) || !rule.alpha.is_finite() {
            return Err(AdapterError::invalid(
                dir,
                "the scale is not a finite number",
            ));
        }
        Ok(rule)
    }

    fn scale(&self, module_name: &str, rank: usize) -> f32 {
        let div = |x: f32| {
            if self.rslora {
                x / (rank as f32).sqrt()
            } else {
                x / rank as f32
            }
        };
        if let Some(s) = self.fixed {
            return if self.fixed_rslora {
                s / (rank as f32).sqrt()
            } else {
                s
            };
        }
        let alpha = self
            .alpha_pattern
            .iter()
            .find(|(p, _)| pattern_matches(p, module_name))
            .map_or(self.alpha, |(_, a)| *a);
        div(alpha)
    }
}

fn refuse_unsupported(dir: &Path, c: &Value) -> Result<(), AdapterError> {
    if let Some(t) = c.get("peft_type").and_then(Value::as_str) {
        if !t.eq_ignore_ascii_case("lora") {
            return Err(AdapterError::invalid(
                dir,
                format!("peft_type {t} is not supported (only LORA)"),
            ));
        }
    }
    if c.get("use_dora").and_then(Value::as_bool) == Some(true) {
        return Err(AdapterError::invalid(
            dir,
            "DoRA adapters are not supported",
        ));
    }
    if let Some(t) = c.get("fine_tune_type").and_then(Value::as_str) {
        if t != "lora" {
            return Err(AdapterError::invalid(
                dir,
                format!("fine_tune_type {t} is not supported (only lora)"),
            ));
        }
    }
    Ok(())
}

fn floats(dir: &Path, w: &HostWeight<'_>) -> Result<Vec<f32>, AdapterError> {
    w.float_values("adapter")
        .map_err(|e| AdapterError::invalid(dir, e.to_string()))
}

/// Transposes a row-major `[rows, cols]` matrix.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

/// Rows of `b` `[heads * head_dim, rank]` reordered as llama.cpp's converter reorders Q/K
/// rows for interleaved rope: within each head, row `j * 2 + t` takes row `t * hd/2 + j`.
pub fn permute_rows(b: &[f32], heads: usize, rank: usize) -> Vec<f32> {
    let rows = b.len() / rank.max(1);
    let hd = rows / heads.max(1);
    let half = hd / 2;
    let mut out = vec![0.0; b.len()];
    for h in 0..heads {
        for j in 0..half {
            for t in 0..2 {
                let dst = h * hd + j * 2 + t;
                let src = h * hd + t * half + j;
                out[dst * rank..(dst + 1) * rank].copy_from_slice(&b[src * rank..(src + 1) * rank]);
            }
        }
    }
    out
}

/// Qwen 3.5's `q_proj` holds, per head, the query rows then the output gate's rows, and
/// its layers run them as two products: each such delta becomes a [`Target::Q`] delta of
/// the query rows of `B` and a [`Target::QGate`] delta of the gate rows, `A` shared.
fn split_query_gate(cfg: &ModelConfig, deltas: Vec<HostDelta>) -> Vec<HostDelta> {
    if cfg.qwen35.is_none() {
        return deltas;
    }
    let hd = cfg.head_dim;
    let mut out = Vec::with_capacity(deltas.len() + cfg.num_layers);
    for d in deltas {
        if d.target != Target::Q {
            out.push(d);
            continue;
        }
        let (mut q, mut g) = (Vec::with_capacity(d.b.len() / 2), Vec::new());
        g.reserve(d.b.len() / 2);
        for head in d.b.chunks_exact(2 * hd * d.rank) {
            let (qh, gh) = head.split_at(hd * d.rank);
            q.extend_from_slice(qh);
            g.extend_from_slice(gh);
        }
        let half = d.out_dim / 2;
        out.push(HostDelta {
            target: Target::QGate,
            b: g,
            out_dim: half,
            a: d.a.clone(),
            ..d
        });
        out.push(HostDelta {
            target: Target::Q,
            b: q,
            out_dim: half,
            ..d
        });
    }
    out.sort_by_key(|d| (d.layer, d.target));
    out
}

fn load_safetensors(
    dir: &Path,
    file: &Path,
    config: &Value,
    cfg: &ModelConfig,
    permute: Option<QkPermutation>,
) -> Result<HostAdapter, AdapterError> {
    refuse_unsupported(dir, config)?;
    let weights = SafetensorsWeights::open_files(dir, &[file.to_path_buf()])
        .map_err(|e| AdapterError::invalid(dir, e.to_string()))?;
    let mut names: Vec<&str> = weights.names().collect();
    names.sort_unstable();
    if names.iter().any(|n| n.contains("lora_magnitude_vector")) {
        return Err(AdapterError::invalid(
            dir,
            "DoRA adapters are not supported",
        ));
    }
    // The factor layout is the format: PEFT's `lora_A`/`lora_B`, mlx-lm's `lora_a`/`lora_b`.
    let mut factors: Vec<(usize, Target, Factor, &str)> = Vec::new();
    // `(layer, first part)` of the fused modules among them.
    let mut fused = std::collections::BTreeSet::new();
    let mut skipped = 0;
    let mut lower_seen = None;
    let mut expert_factors: Vec<(usize, &str, Factor, &str)> = Vec::new();
    for name in &names {
        let Some((layer, module, factor, lower)) = parse_hf_key(name) else {
            skipped += 1;
            continue;
        };
        if *lower_seen.get_or_insert(lower) != lower {
            return Err(AdapterError::invalid(
                dir,
                "mixes PEFT (lora_A/lora_B) and mlx-lm (lora_a/lora_b) tensor names",
            ));
        }
        match Target::from_hf_module(module) {
            Some(t) => factors.push((layer, t, factor, name)),
            // A fused module (Phi-3's qkv_proj, gate_up_proj) stands under its first part
            // until its B is split below.
            None if Target::fused_module(module).is_some() => {
                let parts = Target::fused_module(module).unwrap_or_default();
                if let Some(&t) = parts.first() {
                    fused.insert((layer, t));
                    factors.push((layer, t, factor, name));
                }
            }
            // PEFT's `target_parameters` on the stacked experts: one wrapper per parameter,
            // nested (`experts`, `experts.base_layer`, …); which parameter each adapts is
            // told by its factors' shapes below.
            None if module == "experts" || module.starts_with("experts.base_layer") => {
                if lower {
                    return Err(AdapterError::invalid(
                        dir,
                        format!("{name}: mlx-lm LoRA on the mixture-of-experts weights is not supported"),
                    ));
                }
                expert_factors.push((layer, module, factor, *name));
            }
            None => skipped += 1,
        }
    }
    let mlx = lower_seen.unwrap_or(false);
    let format = if mlx {
        AdapterFormat::MlxLm
    } else {
        AdapterFormat::Peft
    };
    let rule = ScaleRule::from_config(dir, config, mlx)?;
    let mut deltas = Vec::new();
    let mut pairs: Vec<(usize, Target)> = factors.iter().map(|f| (f.0, f.1)).collect();
    pairs.sort_unstable();
    pairs.dedup();
    for (layer, target) in pairs {
        let find = |want: Factor| {
            factors
                .iter()
                .find(|f| f.0 == layer && f.1 == target && f.2 == want)
                .map(|f| f.3)
        };
        let (Some(an), Some(bn)) = (find(Factor::A), find(Factor::B)) else {
            return Err(AdapterError::invalid(
                dir,
                format!(
                    "layer {layer} {}: lora A without B or B without A",
                    target.hf_module()
                ),
            ));
        };
        let get = |n: &str| {
            weights
                .raw(n)
                .ok_or_else(|| AdapterError::invalid(dir, format!("missing tensor {n}")))
        };
        let (aw, bw) = (get(an)?, get(bn)?);
        if layer >= cfg.num_layers {
            return Err(AdapterError::invalid(
                dir,
                format!(
                    "{an} targets layer {layer} but the base model has {} layers",
                    cfg.num_layers
                ),
            ));
        }
        // The targets the module holds: one, or a fused module's parts.
        let parts: &[Target] = if fused.contains(&(layer, target)) {
            target.fused_group(cfg.arch).ok_or_else(|| {
                AdapterError::invalid(
                    dir,
                    format!(
                        "{an} is a fused module, which {} models do not have",
                        cfg.arch
                    ),
                )
            })?
        } else {
            std::slice::from_ref(&target)
        };
        let mut part_rows = Vec::with_capacity(parts.len());
        let mut in_dim = 0;
        for &t in parts {
            let Some((o, i)) = t.file_shape(cfg, layer) else {
                return Err(AdapterError::invalid(
                    dir,
                    format!(
                        "{an} targets {} of layer {layer}, which the base model's layer does not have",
                        t.hf_module()
                    ),
                ));
            };
            part_rows.push(o);
            in_dim = i;
        }
        let out_dim: usize = part_rows.iter().sum();
        let bad_shape = |what: &str, found: &[usize], expected: String| {
            AdapterError::invalid(
                dir,
                format!(
                    "{what} has shape {found:?} but the base model's layer {layer} {} needs {expected}",
                    target.hf_module()
                ),
            )
        };
        if aw.shape.len() != 2 || bw.shape.len() != 2 {
            return Err(AdapterError::invalid(
                dir,
                format!("{an} and {bn} must be matrices"),
            ));
        }
        // (rank, in) of A and (out, rank) of B in the file's orientation.
        let (a_rank, a_in, b_out, b_rank) = if mlx {
            (aw.shape[1], aw.shape[0], bw.shape[1], bw.shape[0])
        } else {
            (aw.shape[0], aw.shape[1], bw.shape[0], bw.shape[1])
        };
        let rank = a_rank;
        if a_in != in_dim || rank == 0 {
            let want = if mlx {
                format!("[{in_dim}, rank]")
            } else {
                format!("[rank, {in_dim}]")
            };
            return Err(bad_shape(an, &aw.shape, want));
        }
        if b_out != out_dim || b_rank != rank {
            let want = if mlx {
                format!("[{rank}, {out_dim}]")
            } else {
                format!("[{out_dim}, {rank}]")
            };
            return Err(bad_shape(bn, &bw.shape, want));
        }
        let mut a = floats(dir, &aw)?;
        let mut b = floats(dir, &bw)?;
        if mlx {
            a = transpose(&a, in_dim, rank);
            b = transpose(&b, rank, out_dim);
        }
        let module_name = match target {
            Target::PleModel => target.hf_module().to_string(),
            _ => format!("layers.{layer}.{}", target.hf_module_of(cfg.arch)),
        };
        let scale = rule.scale(&module_name, rank);
        b.iter_mut().for_each(|v| *v *= scale);
        // A fused module's B rows split over its parts, which share A.
        let mut at = 0;
        for (&part, &rows) in parts.iter().zip(&part_rows) {
            let mut b = b[at * rank..(at + rows) * rank].to_vec();
            at += rows;
            if let Some(p) = permute {
                match part {
                    Target::Q => b = permute_rows(&b, p.heads, rank),
                    Target::K => b = permute_rows(&b, p.kv_heads, rank),
                    _ => {}
                }
            }
            deltas.push(HostDelta {
                layer,
                target: part,
                rank,
                scale,
                a: a.clone(),
                b,
                in_dim,
                out_dim: rows,
            });
        }
    }
    deltas.sort_by_key(|d| (d.layer, d.target));
    let expert_deltas = expert_deltas(dir, cfg, &weights, &expert_factors, &rule)?;
    if deltas.is_empty() && expert_deltas.is_empty() {
        return Err(AdapterError::invalid(
            dir,
            format!(
                "no LoRA tensor targets a projection wick adapts ({})",
                Target::EVERY
                    .iter()
                    .filter(|&&t| t != Target::QGate)
                    .map(|t| t.hf_module())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let deltas = split_query_gate(cfg, deltas);
    let base_model = config
        .get("base_model_name_or_path")
        .and_then(Value::as_str)
        .map(str::to_string);
    Ok(HostAdapter {
        path: dir.to_path_buf(),
        format,
        deltas,
        expert_deltas,
        skipped_tensors: skipped,
        base_model,
    })
}

/// The deltas PEFT's `target_parameters` puts on Gemma 4's stacked experts: for each
/// wrapped parameter, `lora_A` `[rank · experts, in]` (expert `e`'s rows `e·rank ..`) and
/// `lora_B` `[out, rank · experts]` (expert `e`'s column `j` at `j·experts + e`), where
/// `in`/`out` are one expert's product's (`hidden` → `2·inner` for `gate_up_proj`,
/// `inner` → `hidden` for `down_proj`: the shapes tell the two apart). Each expert's pair
/// is laid out on its own, its `B` scaled as a linear layer's of that rank would be.
fn expert_deltas(
    dir: &Path,
    cfg: &ModelConfig,
    weights: &SafetensorsWeights,
    factors: &[(usize, &str, Factor, &str)],
    rule: &ScaleRule,
) -> Result<Vec<HostExpertDelta>, AdapterError> {
    if factors.is_empty() {
        return Ok(Vec::new());
    }
    let Some(moe) = cfg.gemma4.as_ref().and_then(|g| g.moe.as_ref()) else {
        return Err(AdapterError::invalid(
            dir,
            format!(
                "{} adapts mixture-of-experts weights, which the base model does not have",
                factors[0].3
            ),
        ));
    };
    let (n, hidden, inner) = (moe.experts, cfg.hidden_size, moe.intermediate);
    let mut modules: Vec<(usize, &str)> = factors.iter().map(|f| (f.0, f.1)).collect();
    modules.sort_unstable();
    modules.dedup();
    let mut out: Vec<HostExpertDelta> = Vec::new();
    for (layer, module) in modules {
        let find = |want: Factor| {
            factors
                .iter()
                .find(|f| f.0 == layer && f.1 == module && f.2 == want)
                .map(|f| f.3)
        };
        let (Some(an), Some(bn)) = (find(Factor::A), find(Factor::B)) else {
            return Err(AdapterError::invalid(
                dir,
                format!("layer {layer} {module}: lora A without B or B without A"),
            ));
        };
        let get = |name: &str| {
            weights
                .raw(name)
                .ok_or_else(|| AdapterError::invalid(dir, format!("missing tensor {name}")))
        };
        let (aw, bw) = (get(an)?, get(bn)?);
        if layer >= cfg.num_layers {
            return Err(AdapterError::invalid(
                dir,
                format!(
                    "{an} targets layer {layer} but the base model has {} layers",
                    cfg.num_layers
                ),
            ));
        }
        let ([stacked_rank, a_in], [b_out, b_rank]) = (&aw.shape[..], &bw.shape[..]) else {
            return Err(AdapterError::invalid(
                dir,
                format!("{an} and {bn} must be matrices"),
            ));
        };
        let (stacked_rank, a_in, b_out, b_rank) = (*stacked_rank, *a_in, *b_out, *b_rank);
        let part = match (a_in, b_out) {
            (i, o) if i == hidden && o == 2 * inner => ExpertPart::GateUp,
            (i, o) if i == inner && o == hidden => ExpertPart::Down,
            _ => {
                return Err(AdapterError::invalid(
                    dir,
                    format!(
                        "{an} {:?} and {bn} {:?} fit neither experts.gate_up_proj \
                         ({hidden} → {}) nor experts.down_proj ({inner} → {hidden}) of layer {layer}",
                        aw.shape,
                        bw.shape,
                        2 * inner
                    ),
                ))
            }
        };
        if stacked_rank == 0 || !stacked_rank.is_multiple_of(n) || b_rank != stacked_rank {
            return Err(AdapterError::invalid(
                dir,
                format!(
                    "{an} {:?} and {bn} {:?}: the rank dimension must be rank × {n} experts in both",
                    aw.shape, bw.shape
                ),
            ));
        }
        if out.iter().any(|d| d.layer == layer && d.part == part) {
            return Err(AdapterError::invalid(
                dir,
                format!("layer {layer}: two deltas on {}", part.hf_parameter()),
            ));
        }
        let rank = stacked_rank / n;
        let (a, b) = (floats(dir, &aw)?, floats(dir, &bw)?);
        let scale = rule.scale(&format!("layers.{layer}.{}", part.hf_parameter()), rank);
        // A's rows are expert-major already; B's columns interleave the experts.
        let mut bb = Vec::with_capacity(b.len());
        for e in 0..n {
            for o in 0..b_out {
                let row = &b[o * stacked_rank..(o + 1) * stacked_rank];
                bb.extend((0..rank).map(|j| row[j * n + e] * scale));
            }
        }
        out.push(HostExpertDelta {
            layer,
            part,
            experts: n,
            rank,
            scale,
            a,
            b: bb,
            in_dim: a_in,
            out_dim: b_out,
        });
    }
    out.sort_by_key(|d| (d.layer, d.part));
    Ok(out)
}

fn load_gguf(path: &Path, file: &Path, cfg: &ModelConfig) -> Result<HostAdapter, AdapterError> {
    let f = GgufFile::open(file).map_err(|e| AdapterError::invalid(path, e.to_string()))?;
    let meta = f.metadata();
    let kind = meta.opt_str("general.type").ok().flatten();
    if kind != Some("adapter") {
        return Err(AdapterError::invalid(
            path,
            format!(
                "{} is not a GGUF adapter (general.type is {})",
                file.display(),
                kind.unwrap_or("absent")
            ),
        ));
    }
    if let Ok(Some(t)) = meta.opt_str("adapter.type") {
        if t != "lora" {
            return Err(AdapterError::invalid(
                path,
                format!("adapter.type {t} is not supported (only lora)"),
            ));
        }
    }
    let alpha = match meta.get("adapter.lora.alpha") {
        Some(_) => meta
            .get_f64("adapter.lora.alpha")
            .map_err(|e| AdapterError::invalid(path, e.to_string()))? as f32,
        None => 0.0,
    };
    let mut deltas = Vec::new();
    let mut skipped = 0;
    let names: Vec<String> = f.tensors().iter().map(|t| t.name.clone()).collect();
    for name in &names {
        let Some(stem) = name.strip_suffix(".weight.lora_a") else {
            if !name.ends_with(".weight.lora_b") {
                skipped += 1;
            }
            continue;
        };
        let parsed = stem.strip_prefix("blk.").and_then(|s| s.split_once('.'));
        let Some((layer, module)) = parsed.and_then(|(n, m)| Some((n.parse::<usize>().ok()?, m)))
        else {
            skipped += 1;
            continue;
        };
        let Some(&target) = Target::ALL.iter().find(|t| t.gguf_stem() == Some(module)) else {
            skipped += 2;
            continue;
        };
        let bn = format!("{stem}.weight.lora_b");
        if !f.has_tensor(&bn) {
            return Err(AdapterError::invalid(path, format!("{name} without {bn}")));
        }
        if layer >= cfg.num_layers {
            return Err(AdapterError::invalid(
                path,
                format!(
                    "{name} targets layer {layer} but the base model has {} layers",
                    cfg.num_layers
                ),
            ));
        }
        let view = |n: &str| -> Result<HostWeight<'_>, AdapterError> {
            let t = f
                .tensor(n)
                .map_err(|e| AdapterError::invalid(path, e.to_string()))?;
            Ok(HostWeight {
                name: n.to_string(),
                dtype: t.info.dtype,
                shape: t.info.shape(),
                bytes: std::borrow::Cow::Borrowed(t.data),
            })
        };
        let (aw, bw) = (view(name)?, view(&bn)?);
        let Some((out_dim, in_dim)) = target.file_shape(cfg, layer) else {
            return Err(AdapterError::invalid(
                path,
                format!(
                    "{name} targets {module}, which layer {layer} of the base model does not have"
                ),
            ));
        };
        let ok = aw.shape.len() == 2
            && bw.shape.len() == 2
            && aw.shape[1] == in_dim
            && aw.shape[0] > 0
            && bw.shape == [out_dim, aw.shape[0]];
        if !ok {
            return Err(AdapterError::invalid(
                path,
                format!(
                    "{name} {:?} / {bn} {:?} do not fit layer {layer} {module} [{out_dim}, {in_dim}]",
                    aw.shape, bw.shape
                ),
            ));
        }
        let rank = aw.shape[0];
        let scale = if alpha > 0.0 {
            alpha / rank as f32
        } else {
            1.0
        };
        let a = floats(path, &aw)?;
        let mut b = floats(path, &bw)?;
        b.iter_mut().for_each(|v| *v *= scale);
        deltas.push(HostDelta {
            layer,
            target,
            rank,
            scale,
            a,
            b,
            in_dim,
            out_dim,
        });
    }
    if deltas.is_empty() {
        return Err(AdapterError::invalid(
            path,
            "the GGUF adapter holds no LoRA tensor of a projection wick adapts",
        ));
    }
    deltas.sort_by_key(|d| (d.layer, d.target));
    let deltas = split_query_gate(cfg, deltas);
    Ok(HostAdapter {
        path: path.to_path_buf(),
        format: AdapterFormat::Gguf,
        deltas,
        expert_deltas: Vec::new(),
        skipped_tensors: skipped,
        base_model: meta
            .opt_str("general.base_model.0.name")
            .ok()
            .flatten()
            .map(str::to_string),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert_eq!(
            parse_hf_key("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"),
            Some((3, "self_attn.q_proj", Factor::A, false))
        );
        assert_eq!(
            parse_hf_key("base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight"),
            Some((0, "mlp.down_proj", Factor::B, false))
        );
        assert_eq!(
            parse_hf_key("model.layers.11.mlp.up_proj.lora_b"),
            Some((11, "mlp.up_proj", Factor::B, true))
        );
        assert_eq!(
            parse_hf_key("base_model.model.model.layers.2.linear_attn.in_proj_qkv.lora_A.weight"),
            Some((2, "linear_attn.in_proj_qkv", Factor::A, false))
        );
        // Gemma 4's per-layer-input projection of the whole model, text-only and
        // multimodal layouts; a module that merely ends alike is not it.
        for key in [
            "base_model.model.model.per_layer_model_projection.lora_B.weight",
            "base_model.model.model.language_model.per_layer_model_projection.lora_B.weight",
        ] {
            assert_eq!(
                parse_hf_key(key),
                Some((0, "per_layer_model_projection", Factor::B, false))
            );
        }
        assert_eq!(
            parse_hf_key("model.not_per_layer_model_projection.lora_B.weight"),
            None
        );
        assert_eq!(parse_hf_key("model.embed_tokens.lora_embedding_A"), None);
        assert_eq!(
            parse_hf_key(
                "base_model.model.model.audio_tower.layers.0.self_attn.q_proj.lora_A.weight"
            ),
            None
        );
        assert_eq!(
            parse_hf_key(
                "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_A.weight"
            ),
            Some((1, "self_attn.q_proj", Factor::A, false))
        );
        assert_eq!(parse_hf_key("lm_head.weight"), None);
    }

    #[test]
    fn permutation_matches_llama_cpp() {
        // One head of 4 rows, rank 1: rows (0, 1, 2, 3) → (0, 2, 1, 3).
        let b = [0.0, 1.0, 2.0, 3.0];
        assert_eq!(permute_rows(&b, 1, 1), vec![0.0, 2.0, 1.0, 3.0]);
    }

    #[test]
    fn scale_rules() {
        let dir = Path::new("x");
        let peft = serde_json::json!({"r": 8, "lora_alpha": 16, "alpha_pattern": {"q_proj": 4}});
        let r = ScaleRule::from_config(dir, &peft, false).unwrap();
        assert_eq!(r.scale("layers.0.self_attn.k_proj", 8), 2.0);
        assert_eq!(r.scale("layers.0.self_attn.q_proj", 8), 0.5);
        let rs = serde_json::json!({"r": 16, "lora_alpha": 16, "use_rslora": true});
        let r = ScaleRule::from_config(dir, &rs, false).unwrap();
        assert_eq!(r.scale("m", 16), 4.0);
        let mlx = serde_json::json!({"lora_parameters": {"rank": 8, "scale": 10.0}});
        let r = ScaleRule::from_config(dir, &mlx, true).unwrap();
        assert_eq!(r.scale("m", 8), 10.0);
        // Both layouts in one config (wick's trainer, rsLoRA): the absolute mlx-lm scale
        // is not divided again by PEFT's use_rslora; the reference's own rs_lora divides.
        let both = serde_json::json!({"r": 4, "lora_alpha": 8, "use_rslora": true,
            "lora_parameters": {"rank": 4, "scale": 4.0}});
        let r = ScaleRule::from_config(dir, &both, false).unwrap();
        assert_eq!(r.scale("m", 4), 4.0);
        let optiq =
            serde_json::json!({"lora_parameters": {"rank": 4, "scale": 4.0, "rs_lora": true}});
        let r = ScaleRule::from_config(dir, &optiq, true).unwrap();
        assert_eq!(r.scale("m", 4), 2.0);
        let bare = serde_json::json!({});
        assert_eq!(
            ScaleRule::from_config(dir, &bare, true)
                .unwrap()
                .scale("m", 4),
            20.0
        );
    }
}
