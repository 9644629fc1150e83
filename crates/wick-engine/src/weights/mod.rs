//! Where weights come from: GGUF files and Hugging Face safetensors directories (plain
//! or MLX-quantized), behind one lookup by canonical (GGUF-style) tensor name.
pub mod affine;
mod gguf;
mod host;
mod safetensors;

pub use self::affine::AffineWeight;
pub use self::gguf::GgufWeights;
pub use self::host::HostWeight;
pub use self::safetensors::{AffineParams, HfNamedWeights, MlxQuantization, SafetensorsWeights};

use crate::Result;

/// Prefix of a canonical name that stands for a Hugging Face tensor name as is: how a
/// media tower (which has no GGUF-style names) asks a safetensors source for its weights,
/// e.g. `hf:vision_tower.post_layernorm.weight`. Other sources hold no such tensors.
pub const RAW_PREFIX: &str = "hf:";

/// Checks that `path` (a link is followed) is a regular file before anything opens it:
/// opening a FIFO blocks until a writer comes, and a device or a directory is no model
/// file. `Ok(false)` when nothing is there.
pub(crate) fn check_regular_file(path: &std::path::Path) -> Result<bool> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(source) => {
            return Err(crate::EngineError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    if meta.is_file() {
        return Ok(true);
    }
    let kind = {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileTypeExt;
            let t = meta.file_type();
            if t.is_fifo() {
                "a FIFO"
            } else if t.is_char_device() || t.is_block_device() {
                "a device"
            } else if t.is_socket() {
                "a socket"
            } else if t.is_dir() {
                "a directory"
            } else {
                "a special file"
            }
        }
        #[cfg(not(unix))]
        {
            if meta.is_dir() {
                "a directory"
            } else {
                "a special file"
            }
        }
    };
    Err(crate::EngineError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("is {kind}, not a regular file (model files must be regular files)"),
        ),
    })
}

/// A set of named weights. Names are llama.cpp's: `token_embd.weight`,
/// `blk.3.attn_q.weight`, `output_norm.weight` …; each source maps them to its own.
pub trait WeightSource {
    /// A description for error messages (usually the path).
    fn source_name(&self) -> String;
    /// The weight with canonical name `name`, or `None` when the file has none.
    fn get(&self, name: &str) -> Result<Option<HostWeight<'_>>>;
    /// Whether a weight exists.
    fn contains(&self, name: &str) -> bool;
    /// The matrix `name` when the file stores it in MLX's affine quantized layout
    /// (packed weight + scales + biases); `None` when it is stored any other way.
    fn affine(&self, name: &str) -> Result<Option<AffineWeight<'_>>> {
        let _ = name;
        Ok(None)
    }
}
