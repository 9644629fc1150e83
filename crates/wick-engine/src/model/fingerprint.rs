//! [`Model::fingerprint`]: what a saved KV cache must match to be reused — the model
//! files, the architecture configuration, the tokenizer and the backend's numerics.
use std::path::Path;
use std::time::UNIX_EPOCH;

use wick_cache::KeyBuilder;

use super::{Model, ModelFormat};

/// Bumped whenever the engine computes KV differently (kernels, layouts), so caches of
/// an older build are not reused.
const KV_NUMERICS: &str = "candle-cpu-f32-kv1";

fn file_identity(b: KeyBuilder, label: &str, path: &Path) -> KeyBuilder {
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let meta = std::fs::metadata(path).ok();
    let size = meta.as_ref().map_or(0, |m| m.len());
    let mtime = meta
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    b.str(label, &canonical.to_string_lossy())
        .u64("size", size)
        .u64("mtime_ns", mtime)
}

impl Model {
    /// A file-name-safe identity of everything a KV cache depends on: the model files
    /// (canonical path, size and modification time of the GGUF file, or of every file of
    /// a Hugging Face directory), the architecture configuration, the tokenizer's
    /// vocabulary and special tokens, and the backend's KV numerics. SSD cache entries
    /// live under a directory of this name; another fingerprint's directory is never
    /// read.
    pub fn fingerprint(&self) -> String {
        let info = self.info();
        let mut b = KeyBuilder::default()
            .str("numerics", KV_NUMERICS)
            .str("backend", info.backend)
            .str("kv_type", info.kv_type)
            .str("arch", &info.arch.to_string())
            .str("config", &format!("{:?}", self.config()));
        match info.format {
            ModelFormat::Gguf => b = file_identity(b, "gguf", &info.path),
            ModelFormat::HuggingFace => {
                let mut files: Vec<_> = std::fs::read_dir(&info.path)
                    .map(|d| d.flatten().map(|e| e.path()).collect())
                    .unwrap_or_default();
                files.sort();
                for f in files.iter().filter(|f| f.is_file()) {
                    b = file_identity(b, "file", f);
                }
            }
        }
        let tok = self.tokenizer();
        b = b
            .u64("vocab", tok.vocab_size() as u64)
            .u64("bos", tok.bos_id().map_or(u64::MAX, u64::from))
            .u64("add_bos", u64::from(tok.add_bos()));
        for &id in tok.eos_ids() {
            b = b.u64("eos", u64::from(id));
        }
        let mut pieces = Vec::new();
        for id in 0..tok.vocab_size() as u32 {
            let piece = tok.token_piece(id).unwrap_or("");
            pieces.extend_from_slice(&(piece.len() as u32).to_le_bytes());
            pieces.extend_from_slice(piece.as_bytes());
        }
        b = b.bytes("pieces", &pieces);
        format!("{}-{}", info.arch, b.finish_hex())
    }
}
