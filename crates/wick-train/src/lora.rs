//! The trained parameters: a LoRA pair `(A [r, in], B [out, r])` beside each targeted
//! projection, `y = W·x + s·B·A·x`, initialized as PEFT does (A Kaiming-uniform with
//! a = √5, i.e. U(±1/√in); B zero).
use rand::{Rng, SeedableRng};
use wick_engine::adapters::Target;
use wick_engine::config::{Arch, ModelConfig};

use crate::error::{Result, TrainError};

/// What to adapt and how.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` (at least 1).
    pub rank: usize,
    /// The absolute scale of the update (`s`): `lora_alpha = scale · r`, or with rsLoRA
    /// `s = scale · √r` and `lora_alpha = scale · r` still (PEFT divides by √r).
    pub scale: f32,
    /// rsLoRA: `s = alpha / √r`.
    pub rs_lora: bool,
    /// Projections adapted, in [`Target`] order.
    pub targets: Vec<Target>,
    /// Adapt only the last N layers (`None`: all).
    pub num_layers: Option<usize>,
    /// LoRA dropout on the adapter branch's input while training, in `[0, 1)`.
    pub dropout: f32,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 8,
            scale: 1.0,
            rs_lora: false,
            targets: Target::ALL.to_vec(),
            num_layers: None,
            dropout: 0.0,
        }
    }
}

impl LoraConfig {
    /// PEFT's `lora_alpha`.
    pub fn alpha(&self) -> f32 {
        self.scale * self.rank as f32
    }

    /// The multiplier `s` of `B·A`.
    pub fn multiplier(&self) -> f32 {
        if self.rs_lora {
            self.alpha() / (self.rank as f32).sqrt()
        } else {
            self.scale
        }
    }

    /// The first adapted layer of a model with `layers` layers.
    pub fn first_layer(&self, layers: usize) -> usize {
        layers - self.num_layers.unwrap_or(layers).min(layers)
    }

    /// Checks the ranges.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(TrainError::Config("--rank must be at least 1".into()));
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(TrainError::Config(
                "--scale must be a positive number".into(),
            ));
        }
        if self.targets.is_empty() {
            return Err(TrainError::Config(
                "--target-modules names no module".into(),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(TrainError::Config(
                "--lora-dropout must be in [0, 1)".into(),
            ));
        }
        if self.num_layers == Some(0) {
            return Err(TrainError::Config("--num-layers must be at least 1".into()));
        }
        Ok(())
    }
}

/// One adapted projection's factors (or their gradients, or optimizer moments).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPair {
    /// `A`, `[rank, in]` row-major.
    pub a: Vec<f32>,
    /// `B`, `[out, rank]` row-major.
    pub b: Vec<f32>,
    /// Input width.
    pub in_dim: usize,
    /// Output width.
    pub out_dim: usize,
}

impl LoraPair {
    fn zeros(in_dim: usize, out_dim: usize, rank: usize) -> LoraPair {
        LoraPair {
            a: vec![0.0; rank * in_dim],
            b: vec![0.0; out_dim * rank],
            in_dim,
            out_dim,
        }
    }
}

/// Every adapted projection: `layers[l][target.index()]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraParams {
    /// Rank.
    pub rank: usize,
    /// The base's architecture, which names the modules in adapter files
    /// ([`Target::hf_module_of`]).
    pub arch: Arch,
    /// Per layer, per [`Target`] slot ([`Target::index`]). A module the base holds
    /// fused (Phi-3's `qkv_proj`, see [`Target::fused_group`]) is one pair in its first
    /// part's slot, `B`'s rows the parts' in order, as PEFT adapts it; the other parts'
    /// slots are empty. Qwen 3.5's `q_proj` is one pair in [`Target::Q`]'s slot whose `B`
    /// holds, per head, the query rows then the output gate's ([`parts_of`]).
    pub layers: Vec<[Option<LoraPair>; Target::COUNT]>,
}

/// `[out, in]` of the base matrix `t` sits beside in `layer` of a model of `cfg` (its
/// own head size and MLP width in a Gemma 4 layer).
pub fn shape_of(cfg: &ModelConfig, layer: usize, t: Target) -> (usize, usize) {
    t.file_shape(cfg, layer)
        .unwrap_or_else(|| t.base_shape(cfg))
}

/// Where `t`'s rows are in `layer` of a model of `cfg`'s factors: the slot holding them
/// (its fused module's first part, or itself) and the rows of that pair's `B`.
pub fn rows_of(cfg: &ModelConfig, layer: usize, t: Target) -> (Target, std::ops::Range<usize>) {
    match t.fused_group(cfg.arch) {
        Some(group) => {
            let mut at = 0;
            for &p in group {
                let rows = shape_of(cfg, layer, p).0;
                if p == t {
                    return (group[0], at..at + rows);
                }
                at += rows;
            }
            (t, 0..shape_of(cfg, layer, t).0)
        }
        None => (t, 0..shape_of(cfg, layer, t).0),
    }
}

/// The targets the trainer adapts: the dense decoder's seven and Qwen 3.5's DeltaNet
/// projections (in its DeltaNet layers).
pub const TRAINED: [Target; 12] = [
    Target::Q,
    Target::K,
    Target::V,
    Target::O,
    Target::Gate,
    Target::Up,
    Target::Down,
    Target::DeltaQkv,
    Target::DeltaZ,
    Target::DeltaB,
    Target::DeltaA,
    Target::DeltaOut,
];

/// The projections the pair in `t`'s slot of `layer` adapts, with their rows of its `B`:
/// `t` alone, the parts of the fused module it stands for, or Qwen 3.5's `q_proj` (per
/// head, the query rows then the output gate's: [`Target::Q`] and [`Target::QGate`]).
pub fn parts_of(cfg: &ModelConfig, layer: usize, t: Target) -> Vec<(Target, Vec<usize>)> {
    if cfg.qwen35.is_some() && t == Target::Q {
        let hd = cfg.head_dim;
        let rows = |first: usize| -> Vec<usize> {
            (0..cfg.num_heads)
                .flat_map(|h| (0..hd).map(move |i| 2 * h * hd + first + i))
                .collect()
        };
        return vec![(Target::Q, rows(0)), (Target::QGate, rows(hd))];
    }
    match t.fused_group(cfg.arch) {
        Some(group) => group
            .iter()
            .map(|&p| (p, rows_of(cfg, layer, p).1.collect()))
            .collect(),
        None => vec![(t, rows_of(cfg, layer, t).1.collect())],
    }
}

impl LoraParams {
    /// Zero factors in the shapes `lora` asks for on a model of `cfg`'s shape.
    pub fn zeros(cfg: &ModelConfig, lora: &LoraConfig) -> LoraParams {
        let first = lora.first_layer(cfg.num_layers);
        let layers = (0..cfg.num_layers)
            .map(|l| {
                std::array::from_fn(|slot| {
                    let t = Target::EVERY[slot];
                    // A target the layer does not have (a gate in an ungated MLP) is
                    // skipped, as PEFT skips a name it does not find; a fused module is
                    // adapted whole when any of its parts is asked for.
                    let parts = t.fused_group(cfg.arch).unwrap_or(std::slice::from_ref(&t));
                    let present = t.file_shape(cfg, l).is_some();
                    let asked = parts.iter().any(|p| lora.targets.contains(p));
                    let trained = TRAINED.contains(&t);
                    (l >= first && present && parts[0] == t && asked && trained).then(|| {
                        let out = parts.iter().map(|&p| shape_of(cfg, l, p).0).sum();
                        LoraPair::zeros(shape_of(cfg, l, t).1, out, lora.rank)
                    })
                })
            })
            .collect();
        LoraParams {
            rank: lora.rank,
            arch: cfg.arch,
            layers,
        }
    }

    /// PEFT's initialization from `seed`: A ~ U(±1/√in), B = 0.
    pub fn init(cfg: &ModelConfig, lora: &LoraConfig, seed: u64) -> LoraParams {
        let mut p = Self::zeros(cfg, lora);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for pair in p.pairs_mut() {
            let bound = 1.0 / (pair.in_dim as f32).sqrt();
            for v in &mut pair.a {
                *v = rng.random_range(-bound..bound);
            }
        }
        p
    }

    /// The same shapes, all zero (a gradient or moment buffer).
    pub fn zeros_like(&self) -> LoraParams {
        let mut z = self.clone();
        for pair in z.pairs_mut() {
            pair.a.fill(0.0);
            pair.b.fill(0.0);
        }
        z
    }

    /// Every pair with its layer and target, in order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, Target, &LoraPair)> {
        self.layers.iter().enumerate().flat_map(|(l, slots)| {
            slots
                .iter()
                .enumerate()
                .filter_map(move |(s, p)| p.as_ref().map(|p| (l, Target::EVERY[s], p)))
        })
    }

    /// Every pair, mutably, in order.
    pub fn pairs_mut(&mut self) -> impl Iterator<Item = &mut LoraPair> {
        self.layers
            .iter_mut()
            .flat_map(|slots| slots.iter_mut().filter_map(Option::as_mut))
    }

    /// The number of trained values.
    pub fn len(&self) -> usize {
        self.iter().map(|(_, _, p)| p.a.len() + p.b.len()).sum()
    }

    /// Whether nothing is trained.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds `other · k` to `self` (same shapes).
    pub fn add_scaled(&mut self, other: &LoraParams, k: f32) {
        for (dst, src) in self.pairs_mut().zip(other.iter().map(|(_, _, p)| p)) {
            for (d, s) in dst.a.iter_mut().zip(&src.a) {
                *d += k * s;
            }
            for (d, s) in dst.b.iter_mut().zip(&src.b) {
                *d += k * s;
            }
        }
    }

    /// The L2 norm over every value.
    pub fn norm(&self) -> f32 {
        let sq: f64 = self
            .iter()
            .flat_map(|(_, _, p)| p.a.iter().chain(&p.b))
            .map(|&v| f64::from(v) * f64::from(v))
            .sum();
        sq.sqrt() as f32
    }

    /// Multiplies every value by `k`.
    pub fn scale(&mut self, k: f32) {
        for p in self.pairs_mut() {
            p.a.iter_mut().chain(p.b.iter_mut()).for_each(|v| *v *= k);
        }
    }
}

/// Parses `--target-modules` (`q_proj,v_proj` or `q,v`; Qwen 3.5's DeltaNet projections
/// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`; `all` for every
/// projection).
pub fn parse_targets(spec: &str) -> Result<Vec<Target>> {
    let mut out = Vec::new();
    for name in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if name == "all" || name == "all-linear" {
            return Ok(TRAINED.to_vec());
        }
        let stem = name.strip_suffix("_proj").unwrap_or(name);
        let t = match stem {
            "q" => Target::Q,
            "k" => Target::K,
            "v" => Target::V,
            "o" => Target::O,
            "gate" => Target::Gate,
            "up" => Target::Up,
            "down" => Target::Down,
            "in_proj_qkv" => Target::DeltaQkv,
            "in_proj_z" => Target::DeltaZ,
            "in_proj_b" => Target::DeltaB,
            "in_proj_a" => Target::DeltaA,
            "out" => Target::DeltaOut,
            _ => {
                return Err(TrainError::Config(format!(
                    "unknown target module '{name}' (use q,k,v,o,gate,up,down with or without \
                 _proj, or Qwen 3.5's in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj)"
                )))
            }
        };
        if !out.contains(&t) {
            out.push(t);
        }
    }
    out.sort();
    Ok(out)
}

/// The PEFT module name of a target (`q_proj`).
pub fn peft_name(t: Target) -> &'static str {
    last_part(t.hf_module())
}

/// The PEFT module name of a target in `arch`'s checkpoints (`q_proj`, StarCoder 2's
/// `c_fc`).
pub fn peft_name_of(t: Target, arch: Arch) -> &'static str {
    last_part(t.hf_module_of(arch))
}

fn last_part(module: &str) -> &str {
    module.rsplit('.').next().unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltanet_projections_are_target_names() {
        assert_eq!(
            parse_targets("out_proj, in_proj_qkv,q,in_proj_b").unwrap(),
            vec![
                Target::Q,
                Target::DeltaQkv,
                Target::DeltaB,
                Target::DeltaOut
            ]
        );
        assert_eq!(parse_targets("all").unwrap(), TRAINED.to_vec());
        for t in TRAINED {
            assert_eq!(parse_targets(peft_name(t)).unwrap(), vec![t]);
        }
        assert!(parse_targets("in_proj").is_err());
    }
}
