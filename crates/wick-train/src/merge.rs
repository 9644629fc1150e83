//! Merging two LoRA adapters into one, exactly: the sum of two deltas
//! `w_a·s_a·B_a·A_a + w_b·s_b·B_b·A_b` is one LoRA of rank `r_a + r_b` with
//! `A = [A_a; A_b]` (stacked rows) and `B = [w_a·s_a·B_a | w_b·s_b·B_b]` (side by side
//! columns) at scale 1. A module only one adapter changes keeps its own factors; every
//! module is padded with zeros to one rank, so the result is an ordinary adapter (one
//! `r`, `lora_alpha = r`), written as the trainer writes them: `wick serve --adapter`,
//! PEFT and mlx-lm load it.
use std::path::Path;

use wick_engine::adapters::{AdapterError, HostAdapter, HostDelta, Target};
use wick_engine::config::ModelConfig;

use crate::adapter_io::save_adapter;
use crate::error::{io, Result, TrainError};
use crate::lora::{rows_of, LoraConfig, LoraParams};

/// What a merge made.
#[derive(Debug, Clone, PartialEq)]
pub struct MergeStats {
    /// Projections the merged adapter changes.
    pub modules: usize,
    /// Of them, changed by both adapters.
    pub shared: usize,
    /// Changed by the first adapter only.
    pub only_a: usize,
    /// Changed by the second adapter only.
    pub only_b: usize,
    /// The merged rank (the largest `r_a + r_b` of a module).
    pub rank: usize,
    /// The inputs' ranks.
    pub ranks: [usize; 2],
    /// The weights each adapter's delta was multiplied by.
    pub weights: [f32; 2],
    /// Values in the merged factors.
    pub params: usize,
}

/// Two adapters merged into one, ready to write.
#[derive(Debug, Clone)]
pub struct MergedAdapter {
    /// The factors, one rank for every module.
    pub params: LoraParams,
    /// Its layout: the rank, scale 1, the targets and layers either adapter changes.
    pub lora: LoraConfig,
    /// What was merged.
    pub stats: MergeStats,
}

fn delta_at(adapter: &HostAdapter, layer: usize, target: Target) -> Option<&HostDelta> {
    adapter
        .deltas
        .iter()
        .find(|d| d.layer == layer && d.target == target)
}

/// Merges `a` and `b` (read with [`wick_engine::adapters::load_host`] against `cfg`,
/// without a Q/K permutation: their factors in Hugging Face row order) into one adapter
/// whose delta is `weights[0]·Δa + weights[1]·Δb`.
pub fn merge(
    cfg: &ModelConfig,
    a: &HostAdapter,
    b: &HostAdapter,
    weights: [f32; 2],
) -> Result<MergedAdapter> {
    if weights.iter().any(|w| !w.is_finite()) {
        return Err(TrainError::Config(format!(
            "merge weights must be finite numbers, got {weights:?}"
        )));
    }
    if let Some(h) = [a, b].iter().find(|h| !h.expert_deltas.is_empty()) {
        return Err(TrainError::Config(format!(
            "{}: merging adapters of the mixture-of-experts weights is not supported",
            h.path.display()
        )));
    }
    let modules: Vec<(usize, Target)> = {
        let mut m: Vec<(usize, Target)> = a
            .deltas
            .iter()
            .chain(&b.deltas)
            .map(|d| (d.layer, d.target))
            .collect();
        m.sort_unstable();
        m.dedup();
        m
    };
    let Some(first) = modules.iter().map(|m| m.0).min() else {
        return Err(TrainError::Config(
            "neither adapter changes a module".into(),
        ));
    };
    for &(layer, target) in &modules {
        if let (Some(da), Some(db)) = (delta_at(a, layer, target), delta_at(b, layer, target)) {
            if (da.in_dim, da.out_dim) != (db.in_dim, db.out_dim) {
                return Err(AdapterError::Invalid {
                    path: b.path.display().to_string(),
                    reason: format!(
                        "layer {layer} {} is [{}, {}] here but [{}, {}] in {}: the adapters are for different bases",
                        target.hf_module(),
                        db.out_dim,
                        db.in_dim,
                        da.out_dim,
                        da.in_dim,
                        a.path.display()
                    ),
                }
                .into());
            }
        }
    }
    let rank_of =
        |x: &HostAdapter, m: &(usize, Target)| delta_at(x, m.0, m.1).map_or(0, |d| d.rank);
    let rank = modules
        .iter()
        .map(|m| rank_of(a, m) + rank_of(b, m))
        .max()
        .unwrap_or(0);
    let targets: Vec<Target> = Target::ALL
        .into_iter()
        .filter(|t| modules.iter().any(|m| m.1 == *t))
        .collect();
    let layers = cfg.num_layers;
    let lora = LoraConfig {
        rank,
        scale: 1.0,
        targets,
        num_layers: (first > 0).then(|| layers - first),
        ..LoraConfig::default()
    };
    // The grid PEFT will build from the config (every target on every adapted layer),
    // all zero; the modules the adapters change are filled in below.
    let mut params = LoraParams::zeros(cfg, &lora);
    let mut stats = MergeStats {
        modules: modules.len(),
        shared: 0,
        only_a: 0,
        only_b: 0,
        rank,
        ranks: [a.rank(), b.rank()],
        weights,
        params: 0,
    };
    for &(layer, target) in &modules {
        let parts = [delta_at(a, layer, target), delta_at(b, layer, target)];
        match parts {
            [Some(_), Some(_)] => stats.shared += 1,
            [Some(_), None] => stats.only_a += 1,
            _ => stats.only_b += 1,
        }
        // A part of a fused module (Phi-3's q of qkv_proj) is rows of its module's pair.
        let (holder, rows) = rows_of(cfg, layer, target);
        let Some(pair) = params.layers[layer][holder.index()].as_mut() else {
            return Err(TrainError::Config(format!(
                "layer {layer} {} has no place in the merged adapter",
                target.hf_module()
            )));
        };
        if rows.len() != parts.iter().flatten().map(|d| d.out_dim).max().unwrap_or(0) {
            return Err(TrainError::Config(format!(
                "layer {layer} {}: {} rows, the base has {}",
                target.hf_module(),
                parts.iter().flatten().map(|d| d.out_dim).max().unwrap_or(0),
                rows.len()
            )));
        }
        let mut offset = 0;
        for (delta, w) in parts.into_iter().zip(weights) {
            let Some(d) = delta else { continue };
            // A's rows `offset..offset + r`; B's columns the same, B already holding s.
            // The parts of a fused module share their A: the first part writes it, and
            // parts with another A cannot be one module.
            let a_rows = &mut pair.a[offset * d.in_dim..(offset + d.rank) * d.in_dim];
            if holder != target && a_rows.iter().any(|&v| v != 0.0) && a_rows != &d.a[..] {
                return Err(TrainError::Config(format!(
                    "layer {layer} {}: the parts of {} have different A factors, which one \
                     fused module cannot hold",
                    target.hf_module(),
                    target.hf_module_of(cfg.arch)
                )));
            }
            a_rows.copy_from_slice(&d.a);
            for o in 0..d.out_dim {
                let src = &d.b[o * d.rank..(o + 1) * d.rank];
                let o = rows.start + o;
                let dst = &mut pair.b[o * rank + offset..o * rank + offset + d.rank];
                for (x, y) in dst.iter_mut().zip(src) {
                    *x = w * y;
                }
            }
            offset += d.rank;
        }
    }
    stats.params = params.len();
    Ok(MergedAdapter {
        params,
        lora,
        stats,
    })
}

/// Writes `merged` into the new folder `dir` as the trainer writes adapters (PEFT and
/// mlx-lm weights, one config), built under a hidden temporary name beside it and renamed
/// into place; returns the bytes written.
pub fn save_merged(
    dir: &Path,
    merged: &MergedAdapter,
    layers: usize,
    base_model: &str,
) -> Result<u64> {
    if dir.exists() {
        return Err(TrainError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::AlreadyExists, "already exists"),
        });
    }
    let tmp = crate::fuse::temporary_beside(dir);
    save_adapter(&tmp, &merged.params, &merged.lora, layers, base_model)?;
    let mut bytes = 0;
    for entry in std::fs::read_dir(&tmp).map_err(io(&tmp))? {
        bytes += entry.and_then(|e| e.metadata()).map_err(io(&tmp))?.len();
    }
    std::fs::rename(&tmp, dir).map_err(io(dir))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::path::PathBuf;
    use wick_engine::adapters::AdapterFormat;

    fn tiny_config() -> ModelConfig {
        let json = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 3,
            "rms_norm_eps": 1e-5, "vocab_size": 32, "rope_theta": 10000.0,
        });
        ModelConfig::from_hf(&json, "test").unwrap()
    }

    fn random_adapter(
        cfg: &ModelConfig,
        modules: &[(usize, Target)],
        rank: usize,
        seed: u64,
    ) -> HostAdapter {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let deltas = modules
            .iter()
            .map(|&(layer, target)| {
                let (out_dim, in_dim) = target.base_shape(cfg);
                let mut v = |n: usize| (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                HostDelta {
                    layer,
                    target,
                    rank,
                    scale: 2.0,
                    a: v(rank * in_dim),
                    b: v(out_dim * rank),
                    in_dim,
                    out_dim,
                }
            })
            .collect();
        HostAdapter {
            path: PathBuf::from(format!("adapter-{seed}")),
            format: AdapterFormat::Peft,
            deltas,
            expert_deltas: Vec::new(),
            skipped_tensors: 0,
            base_model: None,
        }
    }

    /// `B·A` of one module, `[out, in]`.
    fn product(b: &[f32], a: &[f32], out: usize, rank: usize, inp: usize) -> Vec<f32> {
        let mut w = vec![0.0; out * inp];
        for o in 0..out {
            for r in 0..rank {
                for i in 0..inp {
                    w[o * inp + i] += b[o * rank + r] * a[r * inp + i];
                }
            }
        }
        w
    }

    #[test]
    fn merged_delta_is_the_weighted_sum_of_the_deltas() {
        let cfg = tiny_config();
        let a = random_adapter(
            &cfg,
            &[(1, Target::Q), (1, Target::Down), (2, Target::V)],
            4,
            1,
        );
        let b = random_adapter(&cfg, &[(1, Target::Q), (2, Target::Up)], 3, 2);
        let weights = [0.7, -1.3];
        let m = merge(&cfg, &a, &b, weights).unwrap();
        assert_eq!(m.stats.rank, 7);
        assert_eq!(
            (
                m.stats.modules,
                m.stats.shared,
                m.stats.only_a,
                m.stats.only_b
            ),
            (4, 1, 2, 1)
        );
        // Layers 1.. with every target either adapter uses: PEFT's grid.
        assert_eq!(m.lora.num_layers, Some(2));
        assert_eq!(
            m.lora.targets,
            vec![Target::Q, Target::V, Target::Up, Target::Down]
        );
        for (layer, target, pair) in m.params.iter() {
            let (out, inp) = target.base_shape(&cfg);
            let got = product(&pair.b, &pair.a, out, m.stats.rank, inp);
            let mut want = vec![0.0; out * inp];
            for (x, w) in [&a, &b].into_iter().zip(weights) {
                if let Some(d) = delta_at(x, layer, target) {
                    let p = product(&d.b, &d.a, out, d.rank, inp);
                    want.iter_mut().zip(p).for_each(|(v, p)| *v += w * p);
                }
            }
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "layer {layer} {target:?}: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn a_saved_merge_loads_back_as_the_same_deltas() {
        let cfg = tiny_config();
        let a = random_adapter(&cfg, &[(0, Target::K), (2, Target::O)], 2, 3);
        let m = merge(&cfg, &a, &a, [0.5, 0.5]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("merged");
        let bytes = save_merged(&out, &m, cfg.num_layers, "tiny").unwrap();
        assert!(bytes > 0);
        let back = wick_engine::adapters::load_host(&out, &cfg, None).unwrap();
        assert_eq!(back.scale(), 1.0);
        for d in &a.deltas {
            let got = delta_at(&back, d.layer, d.target).unwrap();
            let want = product(&d.b, &d.a, d.out_dim, d.rank, d.in_dim);
            let have = product(&got.b, &got.a, d.out_dim, got.rank, d.in_dim);
            for (h, w) in have.iter().zip(&want) {
                assert!((h - w).abs() <= 1e-5 * w.abs().max(1.0), "{h} vs {w}");
            }
        }
        assert!(save_merged(&out, &m, cfg.num_layers, "tiny").is_err());
    }

    #[test]
    fn adapters_of_other_shapes_are_refused() {
        let cfg = tiny_config();
        let a = random_adapter(&cfg, &[(0, Target::Q)], 2, 4);
        let mut b = random_adapter(&cfg, &[(0, Target::Q)], 2, 5);
        b.deltas[0].in_dim += 1;
        let err = merge(&cfg, &a, &b, [1.0, 1.0]).unwrap_err().to_string();
        assert!(err.contains("different bases"), "{err}");
    }
}
