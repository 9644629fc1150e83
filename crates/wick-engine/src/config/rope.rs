//! Rotary scalings for long contexts that go beyond a divisor per frequency: YaRN,
//! LongRoPE and dynamic NTK, read from a Hugging Face `rope_scaling` / `rope_parameters`
//! object ([`from_hf`]) and turned into inverse frequencies plus the factor the cosines
//! and sines are multiplied by (as transformers' `modeling_rope_utils` defines them).
use serde_json::Value;

use crate::config::{HfKeys, RopeScaling};
use crate::Result;

/// YaRN parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Yarn {
    /// Context extension factor.
    pub factor: f64,
    /// Training context of the unscaled model.
    pub original_max_position: f64,
    /// Rotations above which a frequency is kept (extrapolated).
    pub beta_fast: f64,
    /// Rotations below which a frequency is fully interpolated.
    pub beta_slow: f64,
    /// The cos/sin multiplier.
    pub attention_factor: f64,
    /// Whether the correction range is rounded outwards to whole dimensions.
    pub truncate: bool,
}

/// `0.1 · m · ln(scale) + 1`, 1 for no extension.
fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl Yarn {
    /// Inverse frequencies and the cos/sin factor for `dims` rotated dimensions.
    pub fn inv_freq(&self, theta: f64, dims: usize) -> (Vec<f32>, f32) {
        let d = dims as f64;
        let correction_dim = |rotations: f64| {
            d * (self.original_max_position / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (
            correction_dim(self.beta_fast),
            correction_dim(self.beta_slow),
        );
        if self.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min(d - 1.0);
        if low == high {
            high += 0.001;
        }
        let freqs = (0..dims / 2)
            .map(|i| {
                let pos_freq = theta.powf(2.0 * i as f64 / d);
                let extrapolation = 1.0 / pos_freq;
                let interpolation = 1.0 / (self.factor * pos_freq);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                (interpolation * (1.0 - keep) + extrapolation * keep) as f32
            })
            .collect();
        (freqs, self.attention_factor as f32)
    }

    pub(crate) fn parameters(&self) -> Vec<f64> {
        vec![
            self.factor,
            self.original_max_position,
            self.beta_fast,
            self.beta_slow,
            self.attention_factor,
        ]
    }
}

/// LongRoPE parameters (Phi-3).
#[derive(Debug, Clone, PartialEq)]
pub struct LongRope {
    /// Divisors of the inverse frequencies within the trained context.
    pub short_factor: Vec<f64>,
    /// Divisors once a sequence is longer than the trained context.
    pub long_factor: Vec<f64>,
    /// Training context of the unscaled model.
    pub original_max_position: usize,
    /// The cos/sin multiplier.
    pub attention_factor: f64,
}

impl LongRope {
    /// Inverse frequencies and the cos/sin factor for a pass reaching `seq_len` tokens.
    pub fn inv_freq(&self, theta: f64, dims: usize, seq_len: usize) -> (Vec<f32>, f32) {
        let factors = if seq_len > self.original_max_position {
            &self.long_factor
        } else {
            &self.short_factor
        };
        let freqs = (0..dims / 2)
            .map(|i| {
                let ext = factors.get(i).copied().unwrap_or(1.0);
                (1.0 / (ext * theta.powf(2.0 * i as f64 / dims as f64))) as f32
            })
            .collect();
        (freqs, self.attention_factor as f32)
    }

    pub(crate) fn parameters(&self) -> Vec<f64> {
        let mut p = vec![self.attention_factor, self.original_max_position as f64];
        p.extend(&self.short_factor);
        p.extend(&self.long_factor);
        p
    }

    /// Both factor lists must hold one divisor per rotated pair.
    pub(crate) fn check(&self, rotary_dims: usize) -> std::result::Result<(), String> {
        let pairs = rotary_dims / 2;
        for (name, f) in [
            ("short_factor", &self.short_factor),
            ("long_factor", &self.long_factor),
        ] {
            if f.len() != pairs {
                return Err(format!(
                    "longrope {name} has {} values for {pairs} rotary pairs",
                    f.len()
                ));
            }
        }
        Ok(())
    }
}

/// Dynamic NTK parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicNtk {
    /// Scaling factor.
    pub factor: f64,
    /// Context up to which the frequencies are the unscaled ones.
    pub max_position: usize,
}

impl DynamicNtk {
    /// Inverse frequencies for a pass reaching `seq_len` tokens: the base grows as
    /// `θ · (factor · len / max − (factor − 1))^(d / (d − 2))` once `len` passes `max`.
    pub fn inv_freq(&self, theta: f64, dims: usize, seq_len: usize) -> Vec<f32> {
        let len = seq_len.max(self.max_position) as f64;
        let d = dims as f64;
        let grown = self.factor * len / self.max_position as f64 - (self.factor - 1.0);
        let base = if dims > 2 {
            theta * grown.powf(d / (d - 2.0))
        } else {
            theta
        };
        crate::backend::RopeSpec::base_inv_freq(base, dims)
    }

    pub(crate) fn parameters(&self) -> Vec<f64> {
        vec![self.factor, self.max_position as f64]
    }
}

/// The scaling of a `rope_scaling` / `rope_parameters` object `s` of type `kind` (`yarn`,
/// `longrope` or `dynamic`); fields the object leaves out fall back on the config's
/// top-level ones as transformers does.
pub(crate) fn from_hf(keys: &HfKeys<'_>, kind: &str, s: &Value) -> Result<RopeScaling> {
    let num = |k: &str| -> Result<Option<f64>> {
        match s.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| keys.bad("rope_scaling", &format!("field '{k}' must be a number"))),
        }
    };
    let max_position = keys.opt_usize("max_position_embeddings")?;
    let original = match num("original_max_position_embeddings")? {
        Some(v) => Some(v),
        None => keys
            .opt_usize("original_max_position_embeddings")?
            .map(|v| v as f64),
    };
    let missing = |what: &str| keys.bad("rope_scaling", &format!("of type '{kind}' needs {what}"));
    Ok(match kind {
        "yarn" => {
            let original = original
                .or(max_position.map(|v| v as f64))
                .ok_or_else(|| missing("original_max_position_embeddings"))?;
            let factor = match num("factor")? {
                Some(f) => f,
                None => max_position.ok_or_else(|| missing("factor"))? as f64 / original,
            };
            let attention_factor = match num("attention_factor")? {
                Some(a) => a,
                None => match (num("mscale")?, num("mscale_all_dim")?) {
                    (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        yarn_mscale(factor, m) / yarn_mscale(factor, all)
                    }
                    _ => yarn_mscale(factor, 1.0),
                },
            };
            RopeScaling::Yarn(Yarn {
                factor,
                original_max_position: original,
                beta_fast: num("beta_fast")?.filter(|b| *b != 0.0).unwrap_or(32.0),
                beta_slow: num("beta_slow")?.filter(|b| *b != 0.0).unwrap_or(1.0),
                attention_factor,
                truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            })
        }
        "longrope" => {
            let list = |k: &str| -> Result<Vec<f64>> {
                s.get(k)
                    .and_then(Value::as_array)
                    .ok_or_else(|| missing(&format!("a '{k}' list")))?
                    .iter()
                    .map(|v| {
                        v.as_f64().ok_or_else(|| {
                            keys.bad("rope_scaling", &format!("'{k}' must hold numbers"))
                        })
                    })
                    .collect()
            };
            let original = original.ok_or_else(|| missing("original_max_position_embeddings"))?;
            let factor = match num("factor")? {
                Some(f) => f,
                None => max_position.map_or(1.0, |m| m as f64 / original),
            };
            let attention_factor = match num("attention_factor")? {
                Some(a) => a,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / original.ln()).sqrt(),
            };
            RopeScaling::LongRope(LongRope {
                short_factor: list("short_factor")?,
                long_factor: list("long_factor")?,
                original_max_position: original as usize,
                attention_factor,
            })
        }
        _ => RopeScaling::Dynamic(DynamicNtk {
            factor: num("factor")?.ok_or_else(|| missing("factor"))?,
            max_position: max_position.unwrap_or(4096),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RopeStyle;
    use crate::config::RopeConfig;

    /// Inverse frequencies and cos/sin factors transformers computes for the configs in
    /// tests/goldens/rope/rope.json (written by scripts/goldens/rope_scalings.py).
    #[test]
    fn scalings_match_transformers() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/goldens/rope/rope.json");
        let cases: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = cases["cases"].as_array().unwrap();
        assert!(cases.len() >= 6);
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let config = &case["config"];
            let keys = HfKeys {
                json: config,
                source: name,
            };
            let rope: RopeConfig = keys.rope(None, 10_000.0).unwrap();
            let dims = case["dims"].as_u64().unwrap() as usize;
            for point in case["points"].as_array().unwrap() {
                let seq_len = point["seq_len"].as_u64().unwrap() as usize;
                let spec = rope.spec_for_len(RopeStyle::Neox, dims, seq_len);
                let want: Vec<f32> = point["inv_freq"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect();
                assert_eq!(spec.inv_freq.len(), want.len(), "{name}");
                // Linear scaling divides the positions, transformers the frequencies.
                let scaled = spec.inv_freq.iter().map(|f| f * spec.position_scale);
                for (i, (g, w)) in scaled.zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                        "{name} at {seq_len}: inv_freq[{i}] {g} vs {w}"
                    );
                }
                let af = point["attention_factor"].as_f64().unwrap() as f32;
                assert!(
                    (spec.attention_factor - af).abs() < 1e-6,
                    "{name}: attention factor {} vs {af}",
                    spec.attention_factor
                );
            }
        }
    }

    #[test]
    fn early_phi3_su_is_longrope_with_top_level_context() {
        let config = serde_json::json!({
            "max_position_embeddings": 256, "original_max_position_embeddings": 64,
            "rope_scaling": {"type": "su", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}
        });
        let keys = HfKeys {
            json: &config,
            source: "config.json",
        };
        let RopeScaling::LongRope(l) = keys.rope(None, 10_000.0).unwrap().scaling else {
            panic!("not LongRoPE");
        };
        assert_eq!(l.original_max_position, 64);
        assert_eq!(l.long_factor, vec![3.0, 4.0]);
        // factor 256 / 64 = 4: sqrt(1 + ln 4 / ln 64).
        assert!((l.attention_factor - (4f64 / 3.0).sqrt()).abs() < 1e-12);
    }

    #[test]
    fn bad_scaling_objects_are_clear_errors() {
        for (bad, what) in [
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": "x", "original_max_position_embeddings": 16}}),
                "factor",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "longrope", "original_max_position_embeddings": 8}}),
                "short_factor",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "dynamic"}}),
                "factor",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "ntk-by-parts"}}),
                "yarn",
            ),
        ] {
            let keys = HfKeys {
                json: &bad,
                source: "config.json",
            };
            let err = keys.rope(None, 10_000.0).unwrap_err().to_string();
            assert!(err.contains("config.json") && err.contains(what), "{err}");
        }
    }
}
