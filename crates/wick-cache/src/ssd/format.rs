//! The `.wkv` file: one cache entry, self-describing, checked at every level.
//!
//! ```text
//! 0   magic    8 bytes  "WICKKV\r\n"  (the CR LF catches text-mode mangling)
//! 8   version  u32 LE   FORMAT_VERSION
//! 12  hlen     u32 LE   length of the JSON header
//! 16  hhash    u64 LE   xxh3-64 of the JSON header
//! 24  header   hlen bytes of JSON (FileHeader)
//! ..  zero padding up to `data_start` (a multiple of 4096)
//! data_start  per layer: keys, then values, raw little-endian f32, each tensor at a
//!             64-byte aligned offset named in the header with its xxh3-64; then (version
//!             2) per recurrent layer its convolution state and its delta-rule state
//! ```
//!
//! Version 2 added the header's `recurrent` list (the states of a hybrid model's
//! linear-attention layers); a version-1 file reads as an entry without recurrent state.
//!
//! Payload: raw f32, the engine's own KV dtype. A restored cache is then bit-identical
//! to the one saved, so greedy output after a restart equals an uninterrupted run; f16
//! would halve the bytes but change logits near ties. The header's `dtype` names the
//! encoding, so a backend with f16/bf16 KV can store its native type in a later version.
//!
//! Writing is streamed: the per-tensor hashes are computed from the host snapshot first
//! (hashing runs at memory speed), then header and tensors go out one after the other
//! through a buffered writer, never as one serialized copy.
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::checkpoint::CheckpointMeta;
use crate::value::{KvSnapshot, LayerSnapshot, StateSnapshot};
use crate::{CacheError, Result};

/// The file magic.
pub const MAGIC: &[u8; 8] = b"WICKKV\r\n";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 2;
/// Older versions this build still reads.
const READABLE_VERSIONS: [u32; 2] = [1, 2];
/// The file name extension of entries.
pub const EXTENSION: &str = "wkv";
/// Bytes before the JSON header.
const PREFIX: usize = 24;
/// Alignment of the data section.
const DATA_ALIGN: u64 = 4096;
/// Alignment of each tensor.
const TENSOR_ALIGN: u64 = 64;
/// Largest header accepted (a 1M-token entry's header is about 8 MiB).
const MAX_HEADER: usize = 64 << 20;
/// The only payload encoding of this version.
const DTYPE: &str = "f32le";

/// Where one tensor lies and its hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRef {
    /// Byte offset from the file start.
    pub offset: u64,
    /// Length in bytes.
    pub bytes: u64,
    /// xxh3-64 of the bytes, 16 hex digits.
    pub xxh3: String,
}

/// One layer's shape and tensors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerHeader {
    /// Logical position of the first stored token.
    pub start: usize,
    /// Logical length.
    pub len: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Sliding window, if any.
    pub window: Option<usize>,
    /// The keys.
    pub keys: TensorRef,
    /// The values.
    pub values: TensorRef,
}

/// One recurrent layer's state tensors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateHeader {
    /// The convolution state.
    pub conv: TensorRef,
    /// The delta-rule state.
    pub ssm: TensorRef,
}

/// The JSON header of a `.wkv` file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileHeader {
    /// The model/config/tokenizer fingerprint the KV was computed under.
    pub fingerprint: String,
    /// Display name of the model (informational).
    pub model: String,
    /// The cache namespace.
    pub namespace: String,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The tokens the KV holds.
    pub tokens: Vec<u32>,
    /// Payload encoding (`f32le`).
    pub dtype: String,
    /// Offset of the data section.
    pub data_start: u64,
    /// Total file length.
    pub file_bytes: u64,
    /// The layers.
    pub layers: Vec<LayerHeader>,
    /// Set on generation checkpoints.
    pub checkpoint: Option<CheckpointMeta>,
    /// The recurrent layers' states (version 2; absent in version 1).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recurrent: Vec<StateHeader>,
}

impl FileHeader {
    /// The shortest length the entry can be cut back to (see
    /// [`LayerSnapshot::trim_floor`]).
    pub fn trim_floor(&self) -> usize {
        // Recurrent state cannot be cut back: only the exact length is usable.
        if !self.recurrent.is_empty() {
            return self.tokens.len();
        }
        self.layers
            .iter()
            .map(|l| match l.window {
                Some(w) if l.start > 0 => (l.start + w).saturating_sub(1).min(l.len),
                _ => 0,
            })
            .max()
            .unwrap_or(0)
    }
}

/// Who the entry is for: written into the header, checked on every read.
#[derive(Debug, Clone)]
pub struct EntryLabel<'a> {
    /// Model fingerprint.
    pub fingerprint: &'a str,
    /// Model display name.
    pub model: &'a str,
    /// Namespace.
    pub namespace: &'a str,
    /// Tokens held.
    pub tokens: &'a [u32],
    /// Checkpoint record, if it is one.
    pub checkpoint: Option<&'a CheckpointMeta>,
}

fn align(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

fn f32_bytes(x: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(x))
    } else {
        std::borrow::Cow::Owned(x.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

fn hex64(h: u64) -> String {
    format!("{h:016x}")
}

/// Lays out the header for `snap`: offsets and hashes of every tensor.
pub fn plan(label: &EntryLabel<'_>, snap: &KvSnapshot, created_unix_ms: u64) -> Result<FileHeader> {
    snap.validate()?;
    if snap.len() != label.tokens.len() {
        return Err(CacheError::LengthMismatch {
            tokens: label.tokens.len(),
            cached: snap.len(),
        });
    }
    let mut header = FileHeader {
        fingerprint: label.fingerprint.to_string(),
        model: label.model.to_string(),
        namespace: label.namespace.to_string(),
        created_unix_ms,
        tokens: label.tokens.to_vec(),
        dtype: DTYPE.to_string(),
        data_start: 0,
        file_bytes: 0,
        layers: Vec::with_capacity(snap.layers.len()),
        checkpoint: label.checkpoint.cloned(),
        recurrent: Vec::with_capacity(snap.recurrent.len()),
    };
    // The header's own length depends on the offsets written into it: lay out once with
    // a generous data start, then fix the start and shift (offsets are relative until then).
    let mut rel = 0u64;
    for l in &snap.layers {
        let mut tensor = |data: &[f32]| {
            let bytes = f32_bytes(data);
            let t = TensorRef {
                offset: align(rel, TENSOR_ALIGN),
                bytes: bytes.len() as u64,
                xxh3: hex64(xxh3_64(&bytes)),
            };
            rel = t.offset + t.bytes;
            t
        };
        let keys = tensor(&l.keys);
        let values = tensor(&l.values);
        header.layers.push(LayerHeader {
            start: l.start,
            len: l.len,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            window: l.window,
            keys,
            values,
        });
    }
    for s in &snap.recurrent {
        let mut tensor = |data: &[f32]| {
            let bytes = f32_bytes(data);
            let t = TensorRef {
                offset: align(rel, TENSOR_ALIGN),
                bytes: bytes.len() as u64,
                xxh3: hex64(xxh3_64(&bytes)),
            };
            rel = t.offset + t.bytes;
            t
        };
        let conv = tensor(&s.conv);
        let ssm = tensor(&s.ssm);
        header.recurrent.push(StateHeader { conv, ssm });
    }
    // Offsets and sizes are at most 20 digits each; pad the estimate for them.
    let estimate = serde_json::to_vec(&header).map_err(json_err)?.len() as u64
        + 2 * 20 * ((header.layers.len() + header.recurrent.len()) as u64 * 2 + 2);
    let data_start = align(PREFIX as u64 + estimate, DATA_ALIGN);
    for l in &mut header.layers {
        l.keys.offset += data_start;
        l.values.offset += data_start;
    }
    for s in &mut header.recurrent {
        s.conv.offset += data_start;
        s.ssm.offset += data_start;
    }
    header.data_start = data_start;
    header.file_bytes = data_start + rel;
    Ok(header)
}

fn json_err(e: serde_json::Error) -> CacheError {
    CacheError::InvalidSnapshot(format!("header does not serialize: {e}"))
}

/// Writes a whole entry file to `out` (already created), returning its length.
pub fn write(out: &mut File, path: &Path, header: &FileHeader, snap: &KvSnapshot) -> Result<u64> {
    let json = serde_json::to_vec(header).map_err(json_err)?;
    if PREFIX as u64 + json.len() as u64 > header.data_start {
        return Err(CacheError::InvalidSnapshot(format!(
            "header of {} bytes does not fit before the data start {}",
            json.len(),
            header.data_start
        )));
    }
    let mut w = BufWriter::with_capacity(1 << 20, out);
    let io = |e| CacheError::Io {
        op: "write",
        path: path.to_path_buf(),
        source: e,
    };
    let mut at = 0u64;
    let put = |w: &mut BufWriter<&mut File>, bytes: &[u8], at: &mut u64| -> Result<()> {
        w.write_all(bytes).map_err(io)?;
        *at += bytes.len() as u64;
        Ok(())
    };
    put(&mut w, MAGIC, &mut at)?;
    put(&mut w, &FORMAT_VERSION.to_le_bytes(), &mut at)?;
    put(&mut w, &(json.len() as u32).to_le_bytes(), &mut at)?;
    put(&mut w, &xxh3_64(&json).to_le_bytes(), &mut at)?;
    put(&mut w, &json, &mut at)?;
    let zeros = [0u8; DATA_ALIGN as usize];
    let pad_to = |w: &mut BufWriter<&mut File>, to: u64, at: &mut u64| -> Result<()> {
        while *at < to {
            let n = ((to - *at) as usize).min(zeros.len());
            put(w, &zeros[..n], at)?;
        }
        Ok(())
    };
    for (l, lh) in snap.layers.iter().zip(&header.layers) {
        for (data, t) in [(&l.keys, &lh.keys), (&l.values, &lh.values)] {
            pad_to(&mut w, t.offset, &mut at)?;
            put(&mut w, &f32_bytes(data), &mut at)?;
        }
    }
    for (s, sh) in snap.recurrent.iter().zip(&header.recurrent) {
        for (data, t) in [(&s.conv, &sh.conv), (&s.ssm, &sh.ssm)] {
            pad_to(&mut w, t.offset, &mut at)?;
            put(&mut w, &f32_bytes(data), &mut at)?;
        }
    }
    // An entry without tensors still ends at its data start.
    pad_to(&mut w, header.file_bytes, &mut at)?;
    w.flush().map_err(io)?;
    Ok(at)
}

fn corrupt(path: &Path, reason: impl Into<String>) -> CacheError {
    CacheError::Corrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads and checks the header: magic, version, header hash, that every tensor lies
/// inside the file and has the size its shape says, and that the file is not short.
pub fn read_header(file: &mut File, path: &Path) -> Result<FileHeader> {
    let len = file.metadata().map_err(CacheError::io("stat", path))?.len();
    let mut prefix = [0u8; PREFIX];
    file.read_exact(&mut prefix).map_err(|_| {
        corrupt(
            path,
            format!("only {len} bytes, shorter than the file prefix"),
        )
    })?;
    if &prefix[..8] != MAGIC {
        return Err(corrupt(path, "not a wick KV file (bad magic)"));
    }
    let version = u32::from_le_bytes(prefix[8..12].try_into().unwrap_or_default());
    if !READABLE_VERSIONS.contains(&version) {
        return Err(CacheError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
            expected: FORMAT_VERSION,
        });
    }
    let hlen = u32::from_le_bytes(prefix[12..16].try_into().unwrap_or_default()) as usize;
    let hhash = u64::from_le_bytes(prefix[16..24].try_into().unwrap_or_default());
    if hlen > MAX_HEADER || (PREFIX + hlen) as u64 > len {
        return Err(corrupt(
            path,
            format!("header length {hlen} does not fit the file of {len} bytes"),
        ));
    }
    let mut json = vec![0u8; hlen];
    file.read_exact(&mut json)
        .map_err(|e| corrupt(path, format!("header unreadable: {e}")))?;
    if xxh3_64(&json) != hhash {
        return Err(corrupt(path, "header hash mismatch"));
    }
    let header: FileHeader = serde_json::from_slice(&json)
        .map_err(|e| corrupt(path, format!("header is not valid JSON: {e}")))?;
    if version < 2 && !header.recurrent.is_empty() {
        return Err(corrupt(path, "a version-1 file with recurrent state"));
    }
    check_layout(&header, path, len)?;
    Ok(header)
}

fn check_layout(h: &FileHeader, path: &Path, len: u64) -> Result<()> {
    if h.dtype != DTYPE {
        return Err(corrupt(path, format!("unknown dtype {:?}", h.dtype)));
    }
    if h.file_bytes != len {
        return Err(corrupt(
            path,
            format!("file is {len} bytes, header says {}", h.file_bytes),
        ));
    }
    let n = h.tokens.len();
    for (i, l) in h.layers.iter().enumerate() {
        if l.len != n || l.start > l.len {
            return Err(corrupt(
                path,
                format!(
                    "layer {i} holds {} tokens from {}, entry has {n}",
                    l.len, l.start
                ),
            ));
        }
        let want = ((l.len - l.start) as u64)
            .checked_mul((l.kv_heads * l.head_dim * 4) as u64)
            .ok_or_else(|| corrupt(path, "layer size overflows"))?;
        for t in [&l.keys, &l.values] {
            let end = t.offset.checked_add(t.bytes);
            if t.bytes != want || t.offset < h.data_start || end.is_none_or(|e| e > len) {
                return Err(corrupt(
                    path,
                    format!("layer {i} tensor outside the file or of the wrong size"),
                ));
            }
        }
    }
    for (i, s) in h.recurrent.iter().enumerate() {
        for t in [&s.conv, &s.ssm] {
            let end = t.offset.checked_add(t.bytes);
            if !t.bytes.is_multiple_of(4) || t.offset < h.data_start || end.is_none_or(|e| e > len)
            {
                return Err(corrupt(
                    path,
                    format!("recurrent layer {i} tensor outside the file or of the wrong size"),
                ));
            }
        }
    }
    Ok(())
}

/// Reads the tensors of a checked header, verifying each tensor's hash.
pub fn read_payload(file: &mut File, path: &Path, header: &FileHeader) -> Result<KvSnapshot> {
    let mut layers = Vec::with_capacity(header.layers.len());
    let mut read = |t: &TensorRef, i: usize, what: &str| -> Result<Vec<f32>> {
        file.seek(SeekFrom::Start(t.offset))
            .map_err(CacheError::io("seek", path))?;
        let mut data = vec![0f32; (t.bytes / 4) as usize];
        {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut data);
            file.read_exact(bytes)
                .map_err(|e| corrupt(path, format!("layer {i} {what} unreadable: {e}")))?;
            if hex64(xxh3_64(bytes)) != t.xxh3 {
                return Err(corrupt(path, format!("layer {i} {what} hash mismatch")));
            }
        }
        if cfg!(target_endian = "big") {
            for v in &mut data {
                *v = f32::from_bits(u32::from_le(v.to_bits()));
            }
        }
        Ok(data)
    };
    for (i, l) in header.layers.iter().enumerate() {
        let keys = read(&l.keys, i, "keys")?;
        let values = read(&l.values, i, "values")?;
        layers.push(LayerSnapshot {
            start: l.start,
            len: l.len,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            window: l.window,
            keys,
            values,
        });
    }
    let mut recurrent = Vec::with_capacity(header.recurrent.len());
    for (i, s) in header.recurrent.iter().enumerate() {
        recurrent.push(StateSnapshot {
            conv: read(&s.conv, i, "recurrent conv state")?,
            ssm: read(&s.ssm, i, "recurrent state")?,
        });
    }
    Ok(KvSnapshot { layers, recurrent })
}

/// Streams through every tensor checking hashes without keeping the data (deep scan).
pub fn verify_payload(file: &mut File, path: &Path, header: &FileHeader) -> Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let tensors = header
        .layers
        .iter()
        .flat_map(|l| [&l.keys, &l.values])
        .chain(header.recurrent.iter().flat_map(|s| [&s.conv, &s.ssm]));
    for (j, t) in tensors.enumerate() {
        let i = j / 2;
        {
            file.seek(SeekFrom::Start(t.offset))
                .map_err(CacheError::io("seek", path))?;
            let mut h = Xxh3::new();
            let mut left = t.bytes as usize;
            while left > 0 {
                let n = left.min(buf.len());
                file.read_exact(&mut buf[..n])
                    .map_err(|e| corrupt(path, format!("layer {i} unreadable: {e}")))?;
                h.update(&buf[..n]);
                left -= n;
            }
            if hex64(h.digest()) != t.xxh3 {
                return Err(corrupt(path, format!("layer {i} hash mismatch")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::testing::FakeKv;

    fn label<'a>(tokens: &'a [u32]) -> EntryLabel<'a> {
        EntryLabel {
            fingerprint: "fp",
            model: "m",
            namespace: "",
            tokens,
            checkpoint: None,
        }
    }

    #[test]
    fn recurrent_state_round_trips_and_version_1_files_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let tokens: Vec<u32> = (0..20).collect();
        let mut snap = FakeKv::new(&tokens, None).snapshot;
        let plain = snap.clone();
        snap.recurrent = vec![
            StateSnapshot {
                conv: vec![0.5; 9],
                ssm: (0..24).map(|i| i as f32).collect(),
            },
            StateSnapshot {
                conv: vec![-1.0; 9],
                ssm: vec![2.5; 24],
            },
        ];
        let save = |name: &str, snap: &KvSnapshot| {
            let path = dir.path().join(name);
            let header = plan(&label(&tokens), snap, 5).unwrap();
            let mut f = File::create(&path).unwrap();
            write(&mut f, &path, &header, snap).unwrap();
            (path, header)
        };
        let (path, header) = save("r.wkv", &snap);
        assert_eq!(
            header.trim_floor(),
            tokens.len(),
            "recurrent state is untrimmable"
        );
        let mut f = File::open(&path).unwrap();
        let h = read_header(&mut f, &path).unwrap();
        assert_eq!(h, header);
        verify_payload(&mut f, &path, &h).unwrap();
        assert_eq!(read_payload(&mut f, &path, &h).unwrap(), snap);
        // A damaged state tensor is caught by its hash.
        let mut bytes = std::fs::read(&path).unwrap();
        let at = h.recurrent[1].ssm.offset as usize + 3;
        bytes[at] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let mut f = File::open(&path).unwrap();
        let h = read_header(&mut f, &path).unwrap();
        assert!(read_payload(&mut f, &path, &h).is_err());

        // A file written by version 1 (no recurrent list) reads as a plain entry.
        let (old, _) = save("v1.wkv", &plain);
        let mut bytes = std::fs::read(&old).unwrap();
        bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
        std::fs::write(&old, &bytes).unwrap();
        let mut f = File::open(&old).unwrap();
        let h = read_header(&mut f, &old).unwrap();
        assert!(h.recurrent.is_empty());
        assert_eq!(read_payload(&mut f, &old, &h).unwrap(), plain);
        // But a "version 1" file that claims recurrent state is corrupt.
        let (bad, _) = save("bad.wkv", &snap);
        let mut bytes = std::fs::read(&bad).unwrap();
        bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
        std::fs::write(&bad, &bytes).unwrap();
        let mut f = File::open(&bad).unwrap();
        assert!(matches!(
            read_header(&mut f, &bad),
            Err(CacheError::Corrupt { .. })
        ));
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.wkv");
        let tokens: Vec<u32> = (0..77).collect();
        let snap = FakeKv::new(&tokens, None).snapshot;
        let header = plan(&label(&tokens), &snap, 5).unwrap();
        let mut f = File::create(&path).unwrap();
        let n = write(&mut f, &path, &header, &snap).unwrap();
        assert_eq!(n, header.file_bytes);
        drop(f);
        let mut f = File::open(&path).unwrap();
        let h = read_header(&mut f, &path).unwrap();
        assert_eq!(h, header);
        assert_eq!(h.data_start % DATA_ALIGN, 0);
        verify_payload(&mut f, &path, &h).unwrap();
        assert_eq!(read_payload(&mut f, &path, &h).unwrap(), snap);
    }

    #[test]
    fn every_damage_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.wkv");
        let tokens: Vec<u32> = (0..50).collect();
        let snap = FakeKv::new(&tokens, None).snapshot;
        let header = plan(&label(&tokens), &snap, 5).unwrap();
        let mut f = File::create(&path).unwrap();
        write(&mut f, &path, &header, &snap).unwrap();
        drop(f);
        let good = std::fs::read(&path).unwrap();
        let check = |bytes: &[u8]| -> Result<KvSnapshot> {
            std::fs::write(&path, bytes).unwrap();
            let mut f = File::open(&path).unwrap();
            let h = read_header(&mut f, &path)?;
            read_payload(&mut f, &path, &h)
        };
        assert!(check(&good).is_ok());
        // Truncated anywhere.
        for cut in [0, 5, 23, 40, good.len() / 2, good.len() - 1] {
            assert!(check(&good[..cut]).is_err(), "cut at {cut}");
        }
        // A flipped bit anywhere: prefix, header, padding is not covered, payload.
        let payload_at = header.layers[0].keys.offset as usize;
        for at in [0, 9, 13, 17, 30, payload_at, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            assert!(check(&bad).is_err(), "flip at {at}");
        }
        // Another version.
        let mut bad = good.clone();
        bad[8] = 9;
        assert!(matches!(
            check(&bad),
            Err(CacheError::UnsupportedVersion { found: 9, .. })
        ));
    }
}
