//! PEFT adapters on the tiny Qwen 3.5 and Gemma 4 goldens (scripts/goldens/peft_adapters.py
//! writes `goldens/adapters/hybrid/`): adapter `a` targets every linear layer PEFT's
//! `all-linear` picks (DeltaNet projections, the gated q_proj, per-layer-input projections,
//! the expert router), `b` a few; the logits of every position under none, `a` and `b`.
//! Generic over the backend, so the CPU, MLX and CUDA tests run the same checks.
use wick_engine::adapters::{load_host, FactorDtype, LoraWeights};
use wick_engine::backend::Backend;
use wick_engine::models::decoder::{BatchItem, Decoder, LogitsRequest, Want};
use wick_engine::weights::SafetensorsWeights;

use super::golden::{floats, goldens, ids_of, read_json, stored_logits};
use super::logits::worst;

/// The tiny models with adapters.
pub const MODELS: [&str; 3] = ["qwen35", "gemma4", "gemma4_moe"];
/// The selections with logits: the base model and each adapter.
pub const SELECTIONS: [&str; 3] = ["none", "a", "b"];

/// The adapters' goldens.
pub struct HybridAdapters {
    pub reference: serde_json::Value,
    logits: SafetensorsWeights,
}

impl HybridAdapters {
    pub fn open() -> HybridAdapters {
        let dir = goldens().join("adapters/hybrid");
        HybridAdapters {
            reference: read_json(&dir.join("reference.json")),
            logits: stored_logits(&dir),
        }
    }

    /// The prompt every logit is recorded for.
    pub fn ids(&self) -> Vec<u32> {
        ids_of(&self.reference["ids"])
    }

    /// PEFT's logits of every position of model `model` under `sel`.
    pub fn expected(&self, model: &str, sel: &str) -> Vec<f32> {
        floats(&self.logits, &format!("{model}.{sel}.logits"))
    }
}

/// Adapter `sel` of `model`, read and checked against `m`'s configuration and uploaded to
/// its backend with f32 factors.
pub fn upload<B: Backend>(m: &Decoder<B>, model: &str, sel: &str) -> LoraWeights<B> {
    let dir = goldens().join("adapters/hybrid").join(model).join(sel);
    let host = load_host(&dir, m.config(), None).unwrap();
    LoraWeights::upload(m.backend(), &host, m.config().num_layers, FactorDtype::F32).unwrap()
}

/// Adapters on the tiny Gemma 4 MoE's stacked experts (PEFT's `target_parameters`,
/// `goldens/adapters/experts`): `e` on both expert weights and `q_proj`, `d` (rsLoRA) on
/// the down projections only.
pub struct ExpertAdapters {
    pub reference: serde_json::Value,
    logits: SafetensorsWeights,
}

impl ExpertAdapters {
    /// The model they adapt.
    pub const MODEL: &'static str = "gemma4_moe";
    /// The selections with logits.
    pub const SELECTIONS: [&'static str; 3] = ["none", "e", "d"];

    pub fn open() -> ExpertAdapters {
        let dir = goldens().join("adapters/experts");
        ExpertAdapters {
            reference: read_json(&dir.join("reference.json")),
            logits: stored_logits(&dir),
        }
    }

    pub fn ids(&self) -> Vec<u32> {
        ids_of(&self.reference["ids"])
    }

    /// PEFT's logits of every position under `sel`.
    pub fn expected(&self, sel: &str) -> Vec<f32> {
        floats(&self.logits, &format!("{sel}.logits"))
    }

    /// Adapter `sel`, read against `m`'s configuration (it must hold expert deltas) and
    /// uploaded to its backend with f32 factors.
    pub fn upload<B: Backend>(&self, m: &Decoder<B>, sel: &str) -> LoraWeights<B> {
        let dir = goldens().join("adapters/experts").join(sel);
        let host = load_host(&dir, m.config(), None).unwrap();
        assert!(!host.expert_deltas.is_empty(), "{sel} has no expert deltas");
        LoraWeights::upload(m.backend(), &host, m.config().num_layers, FactorDtype::F32).unwrap()
    }

    /// Every selection's logits on `m` (in one pass, in pieces, and with rows on `e`, on
    /// no adapter and on `d` in one batch) held to PEFT's within `tolerance`.
    pub fn check<B: Backend>(&self, m: &Decoder<B>, tolerance: f32) {
        let ids = self.ids();
        let (e, d) = (self.upload(m, "e"), self.upload(m, "d"));
        for (sel, stack) in [("none", vec![]), ("e", vec![&e]), ("d", vec![&d])] {
            let moved = self.reference["max_abs_diff_from_base"][sel]
                .as_f64()
                .unwrap_or(1.0);
            assert!(moved > 0.1, "{sel} moves the logits by only {moved}");
            let want = self.expected(sel);
            let one = all_with(m, &ids, &[ids.len()], &stack);
            assert_near(&format!("experts {sel}"), &one, &want, tolerance);
            let pieces = all_with(m, &ids, &[4, 1, 1, 6], &stack);
            assert_near(
                &format!("experts {sel} in pieces"),
                &pieces,
                &want,
                tolerance,
            );
        }
        let got = mixed_batch(m, &ids, 9, &[vec![&e], Vec::new(), vec![&d]]);
        for (sel, got) in ["e", "none", "d"].iter().zip(&got) {
            assert_near(
                &format!("experts {sel} batched"),
                got,
                &self.expected(sel),
                tolerance,
            );
        }
    }
}

/// The logits of every position of `ids` under `adapters`, fed in pieces of `chunks`
/// (cycled) through one cache.
pub fn all_with<B: Backend>(
    m: &Decoder<B>,
    ids: &[u32],
    chunks: &[usize],
    adapters: &[&LoraWeights<B>],
) -> Vec<f32> {
    let mut cache = m.new_cache();
    let mut got = Vec::new();
    let mut at = 0;
    for &c in chunks.iter().cycle() {
        if at >= ids.len() {
            break;
        }
        let end = (at + c).min(ids.len());
        let mut item = BatchItem::new(&ids[at..end], &mut cache, Want::logits(LogitsRequest::All));
        item.adapters = adapters.to_vec();
        let out = m.forward_logits(&mut [item]).unwrap().remove(0).unwrap();
        got.extend_from_slice(&out.data);
        at = end;
    }
    got
}

/// One sequence per entry of `stacks` (the same `ids`), prefilled `split` tokens together
/// in one pass, then decoded one token a pass, all together: each sequence's logits of
/// every position.
pub fn mixed_batch<B: Backend>(
    m: &Decoder<B>,
    ids: &[u32],
    split: usize,
    stacks: &[Vec<&LoraWeights<B>>],
) -> Vec<Vec<f32>> {
    let mut caches: Vec<_> = stacks.iter().map(|_| m.new_cache()).collect();
    let mut got: Vec<Vec<f32>> = stacks.iter().map(|_| Vec::new()).collect();
    let mut at = 0;
    while at < ids.len() {
        let end = if at == 0 { split } else { at + 1 };
        let mut items: Vec<_> = caches
            .iter_mut()
            .zip(stacks)
            .map(|(c, s)| {
                let mut item = BatchItem::new(&ids[at..end], c, Want::logits(LogitsRequest::All));
                item.adapters = s.clone();
                item
            })
            .collect();
        let out = m.forward_logits(&mut items).unwrap();
        for (g, o) in got.iter_mut().zip(out) {
            g.extend_from_slice(&o.unwrap().data);
        }
        at = end;
    }
    got
}

/// Asserts `got` is within `tolerance` of `want`, relative to the largest |logit| of `want`.
pub fn assert_near(what: &str, got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let (w, scale) = worst(got, want);
    eprintln!("{what}: max |diff| {w:.2e} (scale {scale:.1})");
    assert!(
        w <= tolerance * scale,
        "{what}: max |diff| {w} > {tolerance} × {scale}"
    );
}
