//! LoRA adapters at serve time: a low-rank delta beside each targeted linear layer, never
//! a copied model.
//!
//! - `load.rs`: reading PEFT, mlx-lm and llama.cpp GGUF LoRA files into host deltas,
//!   checked all-or-nothing against the base model's shapes;
//! - `precision.rs`: which element type the factors are kept in (f16 where that loses
//!   nothing the base model does not already lose);
//! - `delta.rs`: the deltas on a backend and the grouped product of one batch (the base
//!   product once for every row, then one low-rank product per adapter over the rows that
//!   use it);
//! - this file: [`Adapter`], [`AdapterStack`] (what a request runs with) and
//!   [`AdapterRegistry`] (what is mounted, by id).
mod delta;
pub mod load;
mod precision;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

pub use self::delta::{AnyLora, LoraBatch, LoraOf, LoraPair, LoraWeights};
pub use self::load::{
    load_host, permute_rows, AdapterFormat, ExpertPart, HostAdapter, HostDelta, HostExpertDelta,
};
pub use self::precision::{
    choose as choose_factor_dtype, AdapterDtype, BasePrecision, FactorDtype,
};

/// The linear layers an adapter may target, in the decoder's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Attention query projection.
    Q,
    /// Attention key projection.
    K,
    /// Attention value projection.
    V,
    /// Attention output projection.
    O,
    /// MLP gate projection.
    Gate,
    /// MLP up projection.
    Up,
    /// MLP down projection.
    Down,
    /// Qwen 3.5's attention output gate: the gate rows of its `q_proj` (which holds, per
    /// head, the query rows then the gate rows), split off the file's `q_proj` delta.
    QGate,
    /// A DeltaNet layer's `linear_attn.in_proj_qkv`.
    DeltaQkv,
    /// A DeltaNet layer's `linear_attn.in_proj_z` (the output gate).
    DeltaZ,
    /// A DeltaNet layer's `linear_attn.in_proj_b` (the write strength).
    DeltaB,
    /// A DeltaNet layer's `linear_attn.in_proj_a` (the decay).
    DeltaA,
    /// A DeltaNet layer's `linear_attn.out_proj`.
    DeltaOut,
    /// Gemma 4's `per_layer_input_gate`.
    PleGate,
    /// Gemma 4's `per_layer_projection`.
    PleProj,
    /// Gemma 4's `per_layer_model_projection` (one for the model, kept at layer 0).
    PleModel,
    /// Gemma 4's expert router (`router.proj`).
    Router,
}

/// The parts of a fused `qkv_proj`, in its rows' order.
const QKV: [Target; 3] = [Target::Q, Target::K, Target::V];
/// The parts of a fused `gate_up_proj`, in its rows' order.
const GATE_UP: [Target; 2] = [Target::Gate, Target::Up];

impl Target {
    /// The dense decoder's seven targets, in index order (what the trainer adapts).
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// Every target, in index order.
    pub const EVERY: [Target; Target::COUNT] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
        Target::QGate,
        Target::DeltaQkv,
        Target::DeltaZ,
        Target::DeltaB,
        Target::DeltaA,
        Target::DeltaOut,
        Target::PleGate,
        Target::PleProj,
        Target::PleModel,
        Target::Router,
    ];

    /// How many targets there are (the length of a layer's slot array).
    pub const COUNT: usize = 17;

    /// Index in a layer's slot array.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The Hugging Face module path within a decoder layer (within the model for
    /// [`Target::PleModel`]; [`Target::QGate`] comes out of `q_proj`).
    pub fn hf_module(self) -> &'static str {
        match self {
            Target::Q | Target::QGate => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
            Target::DeltaQkv => "linear_attn.in_proj_qkv",
            Target::DeltaZ => "linear_attn.in_proj_z",
            Target::DeltaB => "linear_attn.in_proj_b",
            Target::DeltaA => "linear_attn.in_proj_a",
            Target::DeltaOut => "linear_attn.out_proj",
            Target::PleGate => "per_layer_input_gate",
            Target::PleProj => "per_layer_projection",
            Target::PleModel => "per_layer_model_projection",
            Target::Router => "router.proj",
        }
    }

    /// The target a Hugging Face module path within a layer names.
    pub fn from_hf_module(module: &str) -> Option<Target> {
        match module {
            // StarCoder 2's MLP.
            "mlp.c_fc" => Some(Target::Up),
            "mlp.c_proj" => Some(Target::Down),
            _ => Target::EVERY
                .into_iter()
                .filter(|&t| t != Target::QGate)
                .find(|t| t.hf_module() == module),
        }
    }

    /// The module path of this target in `arch`'s Hugging Face checkpoints (and so in
    /// its PEFT and mlx-lm adapters): [`Target::hf_module`], but StarCoder 2 names its
    /// ungated MLP `c_fc` (in) and `c_proj` (out).
    pub fn hf_module_of(self, arch: crate::config::Arch) -> &'static str {
        use crate::config::Arch;
        match (arch, self) {
            (Arch::Starcoder2, Target::Up) => "mlp.c_fc",
            (Arch::Starcoder2, Target::Down) => "mlp.c_proj",
            (Arch::Phi3, Target::Q | Target::K | Target::V) => "self_attn.qkv_proj",
            (Arch::Phi3 | Arch::Glm4, Target::Gate | Target::Up) => "mlp.gate_up_proj",
            _ => self.hf_module(),
        }
    }

    /// The targets that one module of `arch`'s checkpoints holds fused, in the order of
    /// its rows: Phi-3's `qkv_proj` (Q, K, V) and `gate_up_proj` (gate, up), GLM-4's
    /// `gate_up_proj`. A PEFT adapter has one `A` and one `B` for such a module: the
    /// parts share `A`, and `B`'s rows split over them. `None`: a module of its own.
    pub fn fused_group(self, arch: crate::config::Arch) -> Option<&'static [Target]> {
        use crate::config::Arch;
        match (arch, self) {
            (Arch::Phi3, Target::Q | Target::K | Target::V) => Some(&QKV),
            (Arch::Phi3 | Arch::Glm4, Target::Gate | Target::Up) => Some(&GATE_UP),
            _ => None,
        }
    }

    /// The parts of a fused module path (`self_attn.qkv_proj`, `mlp.gate_up_proj`).
    pub fn fused_module(module: &str) -> Option<&'static [Target]> {
        match module {
            "self_attn.qkv_proj" => Some(&QKV),
            "mlp.gate_up_proj" => Some(&GATE_UP),
            _ => None,
        }
    }

    /// The GGUF tensor stem within a block (`blk.N.<stem>.weight`) of the dense targets
    /// (GGUF adapters exist for those only).
    pub fn gguf_stem(self) -> Option<&'static str> {
        Some(match self {
            Target::Q => "attn_q",
            Target::K => "attn_k",
            Target::V => "attn_v",
            Target::O => "attn_output",
            Target::Gate => "ffn_gate",
            Target::Up => "ffn_up",
            Target::Down => "ffn_down",
            _ => return None,
        })
    }

    /// `[out, in]` of the dense decoder's base matrix this target sits beside.
    pub fn base_shape(self, cfg: &crate::config::ModelConfig) -> (usize, usize) {
        let h = cfg.hidden_size;
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.num_kv_heads * cfg.head_dim;
        let f = cfg.intermediate_size;
        match self {
            Target::Q | Target::QGate => (q, h),
            Target::K | Target::V => (kv, h),
            Target::O => (h, q),
            Target::Gate | Target::Up => (f, h),
            Target::Down => (h, f),
            _ => (0, 0),
        }
    }

    /// `[out, in]` of the matrix the adapter file holds for this target of `layer` (for
    /// Qwen 3.5's `q_proj`, the query and gate rows together), or `None` where that layer
    /// has no such projection.
    pub fn file_shape(
        self,
        cfg: &crate::config::ModelConfig,
        layer: usize,
    ) -> Option<(usize, usize)> {
        let h = cfg.hidden_size;
        if layer >= cfg.num_layers {
            return None;
        }
        if let Some(q35) = &cfg.qwen35 {
            let linear = *q35.linear_layers.get(layer)?;
            let sh = q35.delta;
            let vd = sh.v_heads * sh.v_dim;
            return match self {
                Target::Gate | Target::Up | Target::Down => Some(self.base_shape(cfg)),
                Target::Q if !linear => Some((2 * cfg.num_heads * cfg.head_dim, h)),
                Target::K | Target::V | Target::O if !linear => Some(self.base_shape(cfg)),
                Target::DeltaQkv if linear => Some((sh.conv_dim(), h)),
                Target::DeltaZ if linear => Some((vd, h)),
                Target::DeltaB | Target::DeltaA if linear => Some((sh.v_heads, h)),
                Target::DeltaOut if linear => Some((h, vd)),
                _ => None,
            };
        }
        if let Some(g) = &cfg.gemma4 {
            let l = g.layers.get(layer)?;
            let q = cfg.num_heads * l.head_dim;
            let kv = l.kv_heads * l.head_dim;
            let f = l.intermediate;
            return match self {
                Target::Q => Some((q, h)),
                // KV-shared layers have no K/V projections of their own.
                Target::K if l.kv_source.is_none() => Some((kv, h)),
                Target::V if l.kv_source.is_none() && !l.k_eq_v => Some((kv, h)),
                Target::O => Some((h, q)),
                Target::Gate | Target::Up => Some((f, h)),
                Target::Down => Some((h, f)),
                Target::PleGate if g.ple_dim > 0 => Some((g.ple_dim, h)),
                Target::PleProj if g.ple_dim > 0 => Some((h, g.ple_dim)),
                Target::PleModel if g.ple_dim > 0 && layer == 0 => {
                    Some((g.layers.len() * g.ple_dim, h))
                }
                Target::Router => g.moe.as_ref().map(|m| (m.experts, h)),
                _ => None,
            };
        }
        if self == Target::Gate && cfg.features.mlp == crate::config::MlpKind::Plain {
            return None;
        }
        Target::ALL.contains(&self).then(|| self.base_shape(cfg))
    }
}

/// Errors of loading, mounting and selecting adapters (all of them client-facing: a bad
/// directory, a shape that does not fit, an unknown id).
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// The files could not be read or are malformed.
    #[error("adapter {path}: {reason}")]
    Invalid {
        /// The adapter's path.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// An id that cannot name an adapter.
    #[error("invalid adapter id '{0}': ids are non-empty and contain no '+', ',' or '/'")]
    BadId(String),
    /// A request named an adapter that is not mounted.
    #[error("adapter '{id}' is not mounted (mounted: {mounted})")]
    NotMounted {
        /// The unknown id.
        id: String,
        /// The mounted ids, comma-separated (`none` when there are none).
        mounted: String,
    },
    /// An id already taken.
    #[error("adapter '{0}' is already mounted")]
    AlreadyMounted(String),
    /// An `--adapter-dtype` that is not `auto`, `f32` or `f16`.
    #[error("invalid adapter dtype '{0}': expected auto, f32 or f16")]
    BadDtype(String),
    /// The same adapter named twice in one stack.
    #[error("adapter '{0}' appears twice in the selection")]
    Repeated(String),
}

impl AdapterError {
    pub(crate) fn invalid(path: &Path, reason: impl Into<String>) -> Self {
        AdapterError::Invalid {
            path: path.display().to_string(),
            reason: reason.into(),
        }
    }
}

/// Facts about a mounted adapter (`GET /v1/adapters`).
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    /// The id requests select it by.
    pub id: String,
    /// Where it was loaded from.
    pub path: PathBuf,
    /// The file format.
    pub format: AdapterFormat,
    /// The rank (the largest, when modules differ).
    pub rank: usize,
    /// The scale applied to `B·A` (of the first module, when modules differ).
    pub scale: f32,
    /// Bytes of the adapter's factors as kept in memory.
    pub size_bytes: usize,
    /// The element type the factors are kept in.
    pub factor_dtype: FactorDtype,
    /// Linear layers the adapter changes.
    pub mounted_layers: usize,
    /// Tensors in the files that target nothing wick adapts (embeddings, heads), skipped.
    pub skipped_tensors: usize,
    /// The base model the adapter records, if any.
    pub base_model: Option<String>,
    /// A digest of the deltas: two adapters with the same id but other weights never share
    /// cached KV.
    pub digest: u64,
}

/// A loaded adapter: its deltas on the model's backend.
pub struct Adapter {
    info: AdapterInfo,
    weights: AnyLora,
}

impl std::fmt::Debug for Adapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adapter").field("info", &self.info).finish()
    }
}

impl Adapter {
    pub(crate) fn new(info: AdapterInfo, weights: AnyLora) -> Self {
        Adapter { info, weights }
    }

    /// Facts about it.
    pub fn info(&self) -> &AdapterInfo {
        &self.info
    }

    /// Its id.
    pub fn id(&self) -> &str {
        &self.info.id
    }

    pub(crate) fn weights(&self) -> &AnyLora {
        &self.weights
    }
}

/// The adapters one request runs with, deltas summed in order; empty for the base model.
/// Holding one keeps its adapters alive, so unmounting lets running requests finish.
#[derive(Debug, Clone, Default)]
pub struct AdapterStack(Vec<Arc<Adapter>>);

impl AdapterStack {
    /// No adapter: the base model.
    pub fn none() -> Self {
        AdapterStack(Vec::new())
    }

    /// A stack of `adapters`, in order; the same adapter twice is refused.
    pub fn new(adapters: Vec<Arc<Adapter>>) -> Result<Self, AdapterError> {
        for (i, a) in adapters.iter().enumerate() {
            if adapters[..i].iter().any(|b| Arc::ptr_eq(a, b)) {
                return Err(AdapterError::Repeated(a.id().to_string()));
            }
        }
        Ok(AdapterStack(adapters))
    }

    /// Whether this is the base model.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The adapters, in order.
    pub fn adapters(&self) -> &[Arc<Adapter>] {
        &self.0
    }

    /// The ids joined with `+` (`""` for none), as requests name the stack.
    pub fn name(&self) -> String {
        self.0.iter().map(|a| a.id()).collect::<Vec<_>>().join("+")
    }

    /// The prompt-cache namespace: `""` for the base model, else every adapter's id and
    /// digest in order, so KV made under one adapter set never seeds another (nor a
    /// different adapter mounted later under the same id).
    pub fn cache_namespace(&self) -> String {
        self.0
            .iter()
            .map(|a| format!("{}@{:016x}", a.id(), a.info.digest))
            .collect::<Vec<_>>()
            .join("+")
    }
}

/// Checks that `id` can name an adapter.
pub fn validate_id(id: &str) -> Result<(), AdapterError> {
    let bad = id.is_empty()
        || id.eq_ignore_ascii_case("none")
        || id.contains(['+', ',', '/', '\\'])
        || id.chars().any(char::is_control);
    if bad {
        return Err(AdapterError::BadId(id.to_string()));
    }
    Ok(())
}

/// The mounted adapters by id, and the default one. Mounting and unmounting take the
/// lock for a map insert or remove only (the files are read and uploaded before), so they
/// never stall the engine; a request holds its [`AdapterStack`], so removing an adapter
/// that running requests use lets them finish with it.
#[derive(Debug, Default)]
pub struct AdapterRegistry {
    inner: RwLock<RegistryState>,
}

#[derive(Debug, Default)]
struct RegistryState {
    mounted: BTreeMap<String, Arc<Adapter>>,
    default: Option<String>,
}

impl AdapterRegistry {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, RegistryState> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, RegistryState> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a loaded adapter under its id.
    pub fn insert(&self, adapter: Arc<Adapter>) -> Result<(), AdapterError> {
        let mut s = self.write();
        if s.mounted.contains_key(adapter.id()) {
            return Err(AdapterError::AlreadyMounted(adapter.id().to_string()));
        }
        s.mounted.insert(adapter.id().to_string(), adapter);
        Ok(())
    }

    /// Removes `id`; `None` when it is not mounted. The default is cleared with it.
    pub fn remove(&self, id: &str) -> Option<Arc<Adapter>> {
        let mut s = self.write();
        let removed = s.mounted.remove(id)?;
        if s.default.as_deref() == Some(id) {
            s.default = None;
        }
        Some(removed)
    }

    /// Makes `id` (mounted) the adapter of requests that name none.
    pub fn set_default(&self, id: &str) -> Result<(), AdapterError> {
        let mut s = self.write();
        if !s.mounted.contains_key(id) {
            return Err(not_mounted(id, &s.mounted));
        }
        s.default = Some(id.to_string());
        Ok(())
    }

    /// The default adapter's id.
    pub fn default_id(&self) -> Option<String> {
        self.read().default.clone()
    }

    /// The mounted adapter `id`.
    pub fn get(&self, id: &str) -> Option<Arc<Adapter>> {
        self.read().mounted.get(id).cloned()
    }

    /// Whether `id` is mounted.
    pub fn contains(&self, id: &str) -> bool {
        self.read().mounted.contains_key(id)
    }

    /// Every mounted adapter, by id.
    pub fn list(&self) -> Vec<Arc<Adapter>> {
        self.read().mounted.values().cloned().collect()
    }

    /// The stack a request's selection names: `None` (the field absent) is the default
    /// adapter or the base model; `"none"` (or `""`) the base model; `"a+b"` adapters `a`
    /// then `b`. An unknown id is an error that lists the mounted ones.
    pub fn resolve(&self, selection: Option<&str>) -> Result<AdapterStack, AdapterError> {
        let s = self.read();
        let names: Vec<&str> = match selection {
            None => s.default.as_deref().into_iter().collect(),
            Some(sel) => {
                let sel = sel.trim();
                if sel.is_empty() || sel.eq_ignore_ascii_case("none") {
                    Vec::new()
                } else {
                    sel.split('+').map(str::trim).collect()
                }
            }
        };
        let adapters = names
            .iter()
            .map(|n| {
                s.mounted
                    .get(*n)
                    .cloned()
                    .ok_or_else(|| not_mounted(n, &s.mounted))
            })
            .collect::<Result<Vec<_>, _>>()?;
        AdapterStack::new(adapters)
    }
}

fn not_mounted(id: &str, mounted: &BTreeMap<String, Arc<Adapter>>) -> AdapterError {
    let list: Vec<&str> = mounted.keys().map(String::as_str).collect();
    AdapterError::NotMounted {
        id: id.to_string(),
        mounted: if list.is_empty() {
            "none".to_string()
        } else {
            list.join(", ")
        },
    }
}

/// The id an adapter directory (or GGUF file) gets by default: its folder name (the file
/// stem for a GGUF file).
pub fn default_id(path: &Path) -> String {
    let stem = if path.is_file() {
        path.file_stem()
    } else {
        path.file_name()
    };
    stem.map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "adapter".to_string())
}
