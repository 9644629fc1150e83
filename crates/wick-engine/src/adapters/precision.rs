//! Which element type a mounted adapter's factors are kept in.
//!
//! Decode with adapters reads every factor of every adapter in the batch each step, so
//! their bytes are the step's cost. Half precision halves them; the rule keeps it where
//! it loses nothing the base model does not already lose:
//!
//! - a quantized or half-precision base (GGUF quantized, MLX affine, f16/bf16
//!   safetensors): f16 (10-bit mantissa), rounding f32 factors;
//! - an f32 base: f16 or bf16 only when every factor value (the scale folded into `B`)
//!   is exact in it, as the factors of an f16 or bf16 file usually are; else f32.
//!
//! `--adapter-dtype f32|f16` overrides the rule. `wick fuse` and merging read the files
//! again and work in f32: the rounded copy lives only on the backend.
use std::borrow::Cow;
use std::str::FromStr;

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use super::{AdapterError, HostAdapter};

/// How mounted adapters keep their factors, as `wick serve --adapter-dtype` names it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AdapterDtype {
    /// The rule of this module: f16 on a quantized or half-precision base, else the
    /// narrowest of f16, bf16 and f32 that holds every value exactly.
    #[default]
    Auto,
    /// Always f32 (the file's values, exactly).
    F32,
    /// Always f16 (f32 factors rounded to nearest).
    F16,
}

impl FromStr for AdapterDtype {
    type Err = AdapterError;

    fn from_str(s: &str) -> Result<Self, AdapterError> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(AdapterDtype::Auto),
            "f32" | "float32" => Ok(AdapterDtype::F32),
            "f16" | "float16" => Ok(AdapterDtype::F16),
            _ => Err(AdapterError::BadDtype(s.to_string())),
        }
    }
}

/// The element type one adapter's factors are stored in on the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FactorDtype {
    /// 4 bytes a value.
    F32,
    /// IEEE half: 10-bit mantissa, 5-bit exponent.
    F16,
    /// bfloat16: 7-bit mantissa, f32's exponent.
    Bf16,
}

impl FactorDtype {
    /// Its name in logs and listings.
    pub fn name(self) -> &'static str {
        match self {
            FactorDtype::F32 => "f32",
            FactorDtype::F16 => "f16",
            FactorDtype::Bf16 => "bf16",
        }
    }

    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            FactorDtype::F32 => 4,
            FactorDtype::F16 | FactorDtype::Bf16 => 2,
        }
    }
}

/// Whether the base model's products already round their weights (quantized or half
/// precision) or compute on exact f32 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BasePrecision {
    /// f32 weights.
    Exact,
    /// Quantized or half-precision weights.
    Rounded,
}

/// The type `host`'s factors are kept in under `setting` on a base of `base` precision,
/// and why (for the mount's log line).
pub fn choose(
    host: &HostAdapter,
    setting: AdapterDtype,
    base: BasePrecision,
) -> (FactorDtype, &'static str) {
    match (setting, base) {
        (AdapterDtype::F32, _) => (FactorDtype::F32, "--adapter-dtype f32"),
        (AdapterDtype::F16, _) => (FactorDtype::F16, "--adapter-dtype f16"),
        (AdapterDtype::Auto, BasePrecision::Rounded) => {
            (FactorDtype::F16, "the base model's weights are not f32")
        }
        (AdapterDtype::Auto, BasePrecision::Exact) => {
            let values = || {
                let experts = host
                    .expert_deltas
                    .iter()
                    .flat_map(|d| d.a.iter().chain(&d.b));
                host.deltas
                    .iter()
                    .flat_map(|d| d.a.iter().chain(&d.b))
                    .chain(experts)
            };
            if values().all(|&v| exact_in_f16(v)) {
                (FactorDtype::F16, "every value is exact in f16")
            } else if values().all(|&v| exact_in_bf16(v)) {
                (FactorDtype::Bf16, "every value is exact in bf16")
            } else {
                (
                    FactorDtype::F32,
                    "an f32 base and values half precision would round",
                )
            }
        }
    }
}

fn exact_in_f16(v: f32) -> bool {
    half::f16::from_f32(v).to_f32().to_bits() == v.to_bits()
}

fn exact_in_bf16(v: f32) -> bool {
    half::bf16::from_f32(v).to_f32().to_bits() == v.to_bits()
}

/// `v` as little-endian bytes of `dtype` (rounded to nearest, ties to even).
pub(crate) fn factor_bytes(v: &[f32], dtype: FactorDtype) -> Cow<'_, [u8]> {
    let little = cfg!(target_endian = "little");
    match dtype {
        FactorDtype::F32 if little => Cow::Borrowed(bytemuck::cast_slice(v)),
        FactorDtype::F32 => Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        FactorDtype::F16 => {
            // `half` converts eight at a time with F16C where the CPU has it.
            let mut h = vec![0u16; v.len()];
            h.reinterpret_cast_mut::<half::f16>()
                .convert_from_f32_slice(v);
            Cow::Owned(le_bytes(h))
        }
        FactorDtype::Bf16 => Cow::Owned(le_bytes(
            v.iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect(),
        )),
    }
}

fn le_bytes(bits: Vec<u16>) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice(&bits).to_vec()
    } else {
        bits.iter().flat_map(|b| b.to_le_bytes()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::{AdapterFormat, HostDelta, Target};

    fn adapter(values: &[f32]) -> HostAdapter {
        HostAdapter {
            path: "x".into(),
            format: AdapterFormat::Peft,
            deltas: vec![HostDelta {
                layer: 0,
                target: Target::Q,
                rank: 1,
                scale: 1.0,
                a: values.to_vec(),
                b: vec![0.5],
                in_dim: values.len(),
                out_dim: 1,
            }],
            expert_deltas: Vec::new(),
            skipped_tensors: 0,
            base_model: None,
        }
    }

    #[test]
    fn rule() {
        let f16_exact = adapter(&[0.25, -1.5, 0.0009765625]);
        // 2^-30 is exact in bf16 and below f16's smallest subnormal.
        let bf16_exact = adapter(&[1.0 + 1.0 / 128.0, 1.0 / (1u64 << 30) as f32]);
        let f32_only = adapter(&[0.1, 1.0e-3]);
        let exact = BasePrecision::Exact;
        assert_eq!(
            choose(&f16_exact, AdapterDtype::Auto, exact).0,
            FactorDtype::F16
        );
        assert_eq!(
            choose(&bf16_exact, AdapterDtype::Auto, exact).0,
            FactorDtype::Bf16
        );
        assert_eq!(
            choose(&f32_only, AdapterDtype::Auto, exact).0,
            FactorDtype::F32
        );
        assert_eq!(
            choose(&f32_only, AdapterDtype::Auto, BasePrecision::Rounded).0,
            FactorDtype::F16
        );
        assert_eq!(
            choose(&f32_only, AdapterDtype::F16, exact).0,
            FactorDtype::F16
        );
        assert_eq!(
            choose(&f16_exact, AdapterDtype::F32, BasePrecision::Rounded).0,
            FactorDtype::F32
        );
        assert_eq!("F16".parse::<AdapterDtype>().unwrap(), AdapterDtype::F16);
        assert!("f8".parse::<AdapterDtype>().is_err());
    }

    #[test]
    fn bytes_round_to_nearest() {
        let v = [0.1f32, -2.0, 65504.0, 1.0e-8];
        let b = factor_bytes(&v, FactorDtype::F16);
        let back: Vec<f32> = b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let want: Vec<f32> = v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
        assert_eq!(back, want);
        assert_eq!(factor_bytes(&v, FactorDtype::F32).len(), 16);
        assert_eq!(factor_bytes(&v, FactorDtype::Bf16).len(), 8);
    }
}
