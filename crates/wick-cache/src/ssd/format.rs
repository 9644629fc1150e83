//! The SSD tier's two kinds of file, self-describing and checked at every level: an entry
//! file (`.wkv`, one per stored prefix) and a chunk file (`.wkc`, the KV of a run of tokens,
//! shared by every entry whose tokens pass through it).
//!
//! Both are containers of one shape:
//!
//! ```text
//! 0   magic    8 bytes  "WICKKV\r\n" (entry) or "WICKKC\r\n" (chunk); the CR LF catches
//!                       text-mode mangling
//! 8   version  u32 LE   FORMAT_VERSION (entry) or CHUNK_VERSION (chunk)
//! 12  hlen     u32 LE   length of the JSON header
//! 16  hhash    u64 LE   xxh3-64 of the JSON header
//! 24  header   hlen bytes of JSON (FileHeader or ChunkHeader)
//! ..  zero padding up to `data_start` (a multiple of 4096)
//! data_start  tensors, raw little-endian f32, each at a 64-byte aligned offset named in
//!             the header with its xxh3-64
//! ```
//!
//! An entry holds its tokens, each layer's shape, and the KV the chunks do not: per layer
//! the rows before and after its group's chunked range (a layer's rows are those of the
//! positions it still stores), then (version 2 on) per recurrent layer its convolution
//! state and its delta-rule state. Version 3 added the header's `chunks`: per group of
//! layers with one window, the token range `[from, to)` whose rows live in chunk files,
//! named by [`super::chunks`]; an entry without it holds every row itself, as versions 1
//! and 2 did. Version 2 added the `recurrent` list; a version-1 file reads as an entry
//! without recurrent state. Recurrent state summarizes every token seen, so it cannot be
//! split by position: it always stays in the entry.
//!
//! A chunk holds, for one group of layers, the rows of positions `[from, to)`, with the
//! tokens of that range and the name of the prefix before it, so a chunk file can be
//! checked against its own name and against the entry that reads it.
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

/// The magic of entry files.
pub const MAGIC: &[u8; 8] = b"WICKKV\r\n";
/// The entry format version this build writes.
pub const FORMAT_VERSION: u32 = 3;
/// Entry versions this build reads.
const READABLE_VERSIONS: [u32; 3] = [1, 2, 3];
/// The file name extension of entries.
pub const EXTENSION: &str = "wkv";
/// The magic of chunk files.
pub const CHUNK_MAGIC: &[u8; 8] = b"WICKKC\r\n";
/// The chunk format version this build writes and reads.
pub const CHUNK_VERSION: u32 = 1;
/// The file name extension of chunks.
pub const CHUNK_EXTENSION: &str = "wkc";
/// Bytes before the JSON header.
const PREFIX: usize = 24;
/// Alignment of the data section.
const DATA_ALIGN: u64 = 4096;
/// Alignment of each tensor.
const TENSOR_ALIGN: u64 = 64;
/// Largest header accepted (a 1M-token entry's header is about 8 MiB).
const MAX_HEADER: usize = 64 << 20;
/// Largest chunk accepted, in tokens.
pub const MAX_CHUNK_TOKENS: usize = 1 << 16;
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

/// One layer's shape and the tensors the entry itself holds.
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
    /// The keys of the rows not in chunks (those before the chunked range, then those
    /// after it).
    pub keys: TensorRef,
    /// The values, same rows.
    pub values: TensorRef,
}

impl LayerHeader {
    fn row_bytes(&self) -> Option<u64> {
        (self.kv_heads as u64)
            .checked_mul(self.head_dim as u64)?
            .checked_mul(4)
    }
}

/// One recurrent layer's state tensors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateHeader {
    /// The convolution state.
    pub conv: TensorRef,
    /// The delta-rule state.
    pub ssm: TensorRef,
}

/// Which rows of an entry live in chunk files (version 3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRefs {
    /// Tokens per chunk; chunk boundaries are multiples of it.
    pub chunk_tokens: usize,
    /// The namespace whose KV the chunks hold: the entry's own, or for a generation
    /// checkpoint the namespace its prompt was computed under (so a checkpoint shares its
    /// prompt's chunks).
    pub kv_namespace: String,
    /// Per group of layers, the chunked range.
    pub groups: Vec<ChunkGroup>,
}

/// Layers of one window whose rows `[from, to)` live in chunks of
/// [`ChunkRefs::chunk_tokens`] tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkGroup {
    /// Layer indexes, ascending.
    pub layers: Vec<usize>,
    /// First chunked position (a multiple of the chunk size).
    pub from: usize,
    /// End of the chunked range (a multiple of the chunk size).
    pub to: usize,
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
    /// The rows kept in chunk files (version 3; absent when the entry holds them all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<ChunkRefs>,
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

    /// The chunked range of layer `i`, if its group has one.
    pub fn chunked(&self, i: usize) -> Option<(usize, usize)> {
        let c = self.chunks.as_ref()?;
        c.groups
            .iter()
            .find(|g| g.layers.contains(&i))
            .map(|g| (g.from, g.to))
    }
}

/// The JSON header of a `.wkc` file: one group's rows of positions `[from, to)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkHeader {
    /// The model/config/tokenizer fingerprint.
    pub fingerprint: String,
    /// The namespace the KV was computed under.
    pub kv_namespace: String,
    /// The chain hash of the prefix before `from` (32 hex digits); the file's name is the
    /// chain hash of this and `tokens`.
    pub parent: String,
    /// First position.
    pub from: usize,
    /// End position.
    pub to: usize,
    /// The tokens of positions `[from, to)`.
    pub tokens: Vec<u32>,
    /// The group's sliding window, if any.
    pub window: Option<usize>,
    /// Payload encoding (`f32le`).
    pub dtype: String,
    /// Offset of the data section.
    pub data_start: u64,
    /// Total file length.
    pub file_bytes: u64,
    /// The group's layers.
    pub layers: Vec<ChunkLayer>,
}

/// One layer's rows in a chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkLayer {
    /// The layer's index in the model's KV.
    pub index: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Keys, `[to - from][kv_heads][head_dim]`.
    pub keys: TensorRef,
    /// Values, same layout.
    pub values: TensorRef,
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

/// Lays tensors out one after the other (offsets relative to the data start until
/// [`Layout::place`]).
#[derive(Default)]
struct Layout {
    rel: u64,
}

impl Layout {
    /// A tensor made of `parts`, in order; its hash covers them as one.
    fn tensor(&mut self, parts: &[&[f32]]) -> TensorRef {
        let mut h = Xxh3::new();
        let mut bytes = 0u64;
        for p in parts {
            let b = f32_bytes(p);
            h.update(&b);
            bytes += b.len() as u64;
        }
        let t = TensorRef {
            offset: align(self.rel, TENSOR_ALIGN),
            bytes,
            xxh3: hex64(h.digest()),
        };
        self.rel = t.offset + t.bytes;
        t
    }

    /// The data start for a header that serializes to about `json_len` bytes with
    /// `tensors` offsets still to be written into it; shifts the offsets there and
    /// returns `(data_start, file_bytes)`.
    fn place<'a>(
        &self,
        json_len: usize,
        tensors: impl Iterator<Item = &'a mut TensorRef>,
    ) -> (u64, u64) {
        let tensors: Vec<&mut TensorRef> = tensors.collect();
        // Offsets and sizes are at most 20 digits each; pad the estimate for them.
        let estimate = json_len as u64 + 2 * 20 * (tensors.len() as u64 + 2);
        let data_start = align(PREFIX as u64 + estimate, DATA_ALIGN);
        for t in tensors {
            t.offset += data_start;
        }
        (data_start, data_start + self.rel)
    }
}

/// The float range of positions `[a, b)` in one of a layer's buffers (`a >= start`).
fn rows(l: &LayerSnapshot, a: usize, b: usize) -> std::ops::Range<usize> {
    (a - l.start) * l.row()..(b - l.start) * l.row()
}

/// The parts of a layer's buffer an entry holds: everything, or the rows around `chunked`.
fn inline_parts<'a>(
    l: &LayerSnapshot,
    data: &'a [f32],
    chunked: Option<(usize, usize)>,
) -> Vec<&'a [f32]> {
    match chunked {
        None => vec![data],
        Some((from, to)) => vec![&data[rows(l, l.start, from)], &data[rows(l, to, l.len)]],
    }
}

/// Lays out the entry header for `snap`: offsets and hashes of every tensor the entry
/// holds itself. With `chunks`, each group's chunked rows are left to the chunk files.
pub fn plan(
    label: &EntryLabel<'_>,
    snap: &KvSnapshot,
    created_unix_ms: u64,
    chunks: Option<ChunkRefs>,
) -> Result<FileHeader> {
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
        chunks: chunks.filter(|c| !c.groups.is_empty()),
    };
    check_chunk_refs(&header, snap).map_err(CacheError::InvalidSnapshot)?;
    // The header's own length depends on the offsets written into it: lay out with
    // relative offsets, then fix the data start and shift them.
    let mut layout = Layout::default();
    for (i, l) in snap.layers.iter().enumerate() {
        let chunked = header.chunked(i);
        let keys = layout.tensor(&inline_parts(l, &l.keys, chunked));
        let values = layout.tensor(&inline_parts(l, &l.values, chunked));
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
        let conv = layout.tensor(&[&s.conv]);
        let ssm = layout.tensor(&[&s.ssm]);
        header.recurrent.push(StateHeader { conv, ssm });
    }
    let json_len = serde_json::to_vec(&header).map_err(json_err)?.len();
    let (data_start, file_bytes) = layout.place(
        json_len,
        header
            .layers
            .iter_mut()
            .flat_map(|l| [&mut l.keys, &mut l.values])
            .chain(
                header
                    .recurrent
                    .iter_mut()
                    .flat_map(|s| [&mut s.conv, &mut s.ssm]),
            ),
    );
    header.data_start = data_start;
    header.file_bytes = file_bytes;
    Ok(header)
}

/// Checks the chunk references against the snapshot they were planned for.
fn check_chunk_refs(h: &FileHeader, snap: &KvSnapshot) -> std::result::Result<(), String> {
    let shapes: Vec<(usize, usize, Option<usize>)> = snap
        .layers
        .iter()
        .map(|l| (l.start, l.len, l.window))
        .collect();
    check_groups(h.chunks.as_ref(), &shapes, snap.len())
}

/// Chunk references must name each layer at most once, group layers of one window, and
/// cover whole chunks inside every layer's stored rows.
fn check_groups(
    chunks: Option<&ChunkRefs>,
    layers: &[(usize, usize, Option<usize>)],
    len: usize,
) -> std::result::Result<(), String> {
    let Some(c) = chunks else { return Ok(()) };
    if c.chunk_tokens == 0 || c.chunk_tokens > MAX_CHUNK_TOKENS {
        return Err(format!("chunk size {} out of range", c.chunk_tokens));
    }
    let mut seen = vec![false; layers.len()];
    for g in &c.groups {
        if g.from >= g.to
            || g.to > len
            || !g.from.is_multiple_of(c.chunk_tokens)
            || !g.to.is_multiple_of(c.chunk_tokens)
            || g.layers.is_empty()
        {
            return Err(format!(
                "chunked range {}..{} of {len} tokens",
                g.from, g.to
            ));
        }
        let window = layers.get(g.layers[0]).map(|l| l.2);
        for &i in &g.layers {
            let Some(&(start, _, w)) = layers.get(i) else {
                return Err(format!("chunk group names layer {i} of {}", layers.len()));
            };
            if seen[i] || Some(w) != window || start > g.from {
                return Err(format!("chunk group with layer {i} is inconsistent"));
            }
            seen[i] = true;
        }
    }
    Ok(())
}

fn json_err(e: serde_json::Error) -> CacheError {
    CacheError::InvalidSnapshot(format!("header does not serialize: {e}"))
}

/// What a container starts with, and where its data lies.
struct Container<'a> {
    magic: &'a [u8; 8],
    version: u32,
    json: &'a [u8],
    data_start: u64,
    file_bytes: u64,
}

/// Writes a container: magic, version, header, then each tensor (its parts) at its offset,
/// padded to `file_bytes`. Returns the bytes written.
fn write_container(
    out: &mut File,
    path: &Path,
    c: Container<'_>,
    tensors: &[(&TensorRef, Vec<&[f32]>)],
) -> Result<u64> {
    let Container {
        magic,
        version,
        json,
        data_start,
        file_bytes,
    } = c;
    if PREFIX as u64 + json.len() as u64 > data_start {
        return Err(CacheError::InvalidSnapshot(format!(
            "header of {} bytes does not fit before the data start {data_start}",
            json.len(),
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
    put(&mut w, magic, &mut at)?;
    put(&mut w, &version.to_le_bytes(), &mut at)?;
    put(&mut w, &(json.len() as u32).to_le_bytes(), &mut at)?;
    put(&mut w, &xxh3_64(json).to_le_bytes(), &mut at)?;
    put(&mut w, json, &mut at)?;
    let zeros = [0u8; DATA_ALIGN as usize];
    let pad_to = |w: &mut BufWriter<&mut File>, to: u64, at: &mut u64| -> Result<()> {
        while *at < to {
            let n = ((to - *at) as usize).min(zeros.len());
            put(w, &zeros[..n], at)?;
        }
        Ok(())
    };
    for (t, parts) in tensors {
        pad_to(&mut w, t.offset, &mut at)?;
        for p in parts {
            put(&mut w, &f32_bytes(p), &mut at)?;
        }
    }
    // A file without tensors still ends at its data start.
    pad_to(&mut w, file_bytes, &mut at)?;
    w.flush().map_err(io)?;
    Ok(at)
}

/// Writes a whole entry file to `out` (already created), returning its length.
pub fn write(out: &mut File, path: &Path, header: &FileHeader, snap: &KvSnapshot) -> Result<u64> {
    let json = serde_json::to_vec(header).map_err(json_err)?;
    let mut tensors = Vec::new();
    for (i, (l, lh)) in snap.layers.iter().zip(&header.layers).enumerate() {
        let chunked = header.chunked(i);
        tensors.push((&lh.keys, inline_parts(l, &l.keys, chunked)));
        tensors.push((&lh.values, inline_parts(l, &l.values, chunked)));
    }
    for (s, sh) in snap.recurrent.iter().zip(&header.recurrent) {
        tensors.push((&sh.conv, vec![&s.conv[..]]));
        tensors.push((&sh.ssm, vec![&s.ssm[..]]));
    }
    let c = Container {
        magic: MAGIC,
        version: FORMAT_VERSION,
        json: &json,
        data_start: header.data_start,
        file_bytes: header.file_bytes,
    };
    write_container(out, path, c, &tensors)
}

fn corrupt(path: &Path, reason: impl Into<String>) -> CacheError {
    CacheError::Corrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads the prefix and the JSON header of a container with `magic`: the version must be
/// one of `versions`, the header must fit the file and match its hash.
fn read_json(
    file: &mut File,
    path: &Path,
    magic: &[u8; 8],
    versions: &[u32],
) -> Result<(u32, Vec<u8>, u64)> {
    let len = file.metadata().map_err(CacheError::io("stat", path))?.len();
    let mut prefix = [0u8; PREFIX];
    file.read_exact(&mut prefix).map_err(|_| {
        corrupt(
            path,
            format!("only {len} bytes, shorter than the file prefix"),
        )
    })?;
    if &prefix[..8] != magic {
        return Err(corrupt(
            path,
            "not a wick cache file of this kind (bad magic)",
        ));
    }
    let version = u32::from_le_bytes(prefix[8..12].try_into().unwrap_or_default());
    if !versions.contains(&version) {
        return Err(CacheError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
            expected: versions.iter().copied().max().unwrap_or(0),
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
    Ok((version, json, len))
}

/// Reads and checks an entry's header: magic, version, header hash, that every tensor lies
/// inside the file and has the size its shape says, that chunk references are consistent,
/// and that the file is not short.
pub fn read_header(file: &mut File, path: &Path) -> Result<FileHeader> {
    let (version, json, len) = read_json(file, path, MAGIC, &READABLE_VERSIONS)?;
    let header: FileHeader = serde_json::from_slice(&json)
        .map_err(|e| corrupt(path, format!("header is not valid JSON: {e}")))?;
    if version < 2 && !header.recurrent.is_empty() {
        return Err(corrupt(path, "a version-1 file with recurrent state"));
    }
    if version < 3 && header.chunks.is_some() {
        return Err(corrupt(path, "a version-2 file with chunks"));
    }
    check_layout(&header, path, len)?;
    Ok(header)
}

fn check_tensor(t: &TensorRef, want: Option<u64>, data_start: u64, len: u64) -> bool {
    let end = t.offset.checked_add(t.bytes);
    want.is_none_or(|w| t.bytes == w)
        && t.bytes.is_multiple_of(4)
        && t.offset >= data_start
        && end.is_some_and(|e| e <= len)
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
    let shapes: Vec<(usize, usize, Option<usize>)> = h
        .layers
        .iter()
        .map(|l| (l.start, l.len, l.window))
        .collect();
    check_groups(h.chunks.as_ref(), &shapes, n).map_err(|e| corrupt(path, e))?;
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
        let chunked = h.chunked(i).map_or(0, |(from, to)| to - from);
        let row = l
            .row_bytes()
            .filter(|&r| usize::try_from(r).is_ok())
            .ok_or_else(|| corrupt(path, "layer row size overflows"))?;
        let want = ((l.len - l.start - chunked) as u64)
            .checked_mul(row)
            .ok_or_else(|| corrupt(path, "layer size overflows"))?;
        for t in [&l.keys, &l.values] {
            if !check_tensor(t, Some(want), h.data_start, len) {
                return Err(corrupt(
                    path,
                    format!("layer {i} tensor outside the file or of the wrong size"),
                ));
            }
        }
    }
    for (i, s) in h.recurrent.iter().enumerate() {
        for t in [&s.conv, &s.ssm] {
            if !check_tensor(t, None, h.data_start, len) {
                return Err(corrupt(
                    path,
                    format!("recurrent layer {i} tensor outside the file or of the wrong size"),
                ));
            }
        }
    }
    Ok(())
}

/// Reads one tensor, verifying its hash.
fn read_tensor(file: &mut File, path: &Path, t: &TensorRef, what: &str) -> Result<Vec<f32>> {
    file.seek(SeekFrom::Start(t.offset))
        .map_err(CacheError::io("seek", path))?;
    let mut data = vec![0f32; (t.bytes / 4) as usize];
    {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut data);
        file.read_exact(bytes)
            .map_err(|e| corrupt(path, format!("{what} unreadable: {e}")))?;
        if hex64(xxh3_64(bytes)) != t.xxh3 {
            return Err(corrupt(path, format!("{what} hash mismatch")));
        }
    }
    if cfg!(target_endian = "big") {
        for v in &mut data {
            *v = f32::from_bits(u32::from_le(v.to_bits()));
        }
    }
    Ok(data)
}

/// What an entry file holds itself: per layer its keys and values (the rows outside its
/// chunked range, in order), and the recurrent states.
pub struct Inline {
    /// Per layer, keys and values.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
    /// The recurrent states.
    pub recurrent: Vec<StateSnapshot>,
}

/// Reads the tensors an entry holds itself, verifying each tensor's hash.
pub fn read_inline(file: &mut File, path: &Path, header: &FileHeader) -> Result<Inline> {
    let mut layers = Vec::with_capacity(header.layers.len());
    for (i, l) in header.layers.iter().enumerate() {
        let keys = read_tensor(file, path, &l.keys, &format!("layer {i} keys"))?;
        let values = read_tensor(file, path, &l.values, &format!("layer {i} values"))?;
        layers.push((keys, values));
    }
    let mut recurrent = Vec::with_capacity(header.recurrent.len());
    for (i, s) in header.recurrent.iter().enumerate() {
        recurrent.push(StateSnapshot {
            conv: read_tensor(
                file,
                path,
                &s.conv,
                &format!("recurrent layer {i} conv state"),
            )?,
            ssm: read_tensor(file, path, &s.ssm, &format!("recurrent layer {i} state"))?,
        });
    }
    Ok(Inline { layers, recurrent })
}

/// Reads an entry that holds all of its KV itself (no chunks), verifying every hash.
pub fn read_payload(file: &mut File, path: &Path, header: &FileHeader) -> Result<KvSnapshot> {
    if header.chunks.is_some() {
        return Err(CacheError::InvalidSnapshot(format!(
            "{} keeps part of its KV in chunk files: read it through the SSD tier",
            path.display()
        )));
    }
    let inline = read_inline(file, path, header)?;
    let layers = header
        .layers
        .iter()
        .zip(inline.layers)
        .map(|(l, (keys, values))| LayerSnapshot {
            start: l.start,
            len: l.len,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            window: l.window,
            keys,
            values,
        })
        .collect();
    Ok(KvSnapshot {
        layers,
        recurrent: inline.recurrent,
    })
}

/// Streams through `tensors` checking hashes without keeping the data (deep scan).
fn verify_tensors<'a>(
    file: &mut File,
    path: &Path,
    tensors: impl Iterator<Item = &'a TensorRef>,
) -> Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    for (i, t) in tensors.enumerate() {
        file.seek(SeekFrom::Start(t.offset))
            .map_err(CacheError::io("seek", path))?;
        let mut h = Xxh3::new();
        let mut left = t.bytes as usize;
        while left > 0 {
            let n = left.min(buf.len());
            file.read_exact(&mut buf[..n])
                .map_err(|e| corrupt(path, format!("tensor {i} unreadable: {e}")))?;
            h.update(&buf[..n]);
            left -= n;
        }
        if hex64(h.digest()) != t.xxh3 {
            return Err(corrupt(path, format!("tensor {i} hash mismatch")));
        }
    }
    Ok(())
}

/// Checks every tensor an entry holds itself (deep scan).
pub fn verify_payload(file: &mut File, path: &Path, header: &FileHeader) -> Result<()> {
    verify_tensors(
        file,
        path,
        header
            .layers
            .iter()
            .flat_map(|l| [&l.keys, &l.values])
            .chain(header.recurrent.iter().flat_map(|s| [&s.conv, &s.ssm])),
    )
}

/// What a chunk is of: the identity written into its header and checked on every read.
#[derive(Debug, Clone)]
pub struct ChunkLabel<'a> {
    /// Model fingerprint.
    pub fingerprint: &'a str,
    /// The namespace the KV was computed under.
    pub kv_namespace: &'a str,
    /// The chain hash of the prefix before `from`.
    pub parent: u128,
    /// First position.
    pub from: usize,
    /// The tokens of `[from, from + tokens.len())`.
    pub tokens: &'a [u32],
    /// The group's window.
    pub window: Option<usize>,
    /// The group's layer indexes.
    pub layers: &'a [usize],
}

/// Lays out a chunk of `snap`'s rows for `label`.
pub fn plan_chunk(label: &ChunkLabel<'_>, snap: &KvSnapshot) -> Result<ChunkHeader> {
    let to = label.from + label.tokens.len();
    let mut header = ChunkHeader {
        fingerprint: label.fingerprint.to_string(),
        kv_namespace: label.kv_namespace.to_string(),
        parent: format!("{:032x}", label.parent),
        from: label.from,
        to,
        tokens: label.tokens.to_vec(),
        window: label.window,
        dtype: DTYPE.to_string(),
        data_start: 0,
        file_bytes: 0,
        layers: Vec::with_capacity(label.layers.len()),
    };
    let mut layout = Layout::default();
    for &i in label.layers {
        let l = snap
            .layers
            .get(i)
            .filter(|l| l.start <= label.from && to <= l.len);
        let Some(l) = l else {
            return Err(CacheError::InvalidSnapshot(format!(
                "layer {i} does not hold positions {}..{to}",
                label.from
            )));
        };
        let keys = layout.tensor(&[&l.keys[rows(l, label.from, to)]]);
        let values = layout.tensor(&[&l.values[rows(l, label.from, to)]]);
        header.layers.push(ChunkLayer {
            index: i,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            keys,
            values,
        });
    }
    let json_len = serde_json::to_vec(&header).map_err(json_err)?.len();
    let (data_start, file_bytes) = layout.place(
        json_len,
        header
            .layers
            .iter_mut()
            .flat_map(|l| [&mut l.keys, &mut l.values]),
    );
    header.data_start = data_start;
    header.file_bytes = file_bytes;
    Ok(header)
}

/// Writes a chunk file planned by [`plan_chunk`] to `out`, returning its length.
pub fn write_chunk(
    out: &mut File,
    path: &Path,
    header: &ChunkHeader,
    snap: &KvSnapshot,
) -> Result<u64> {
    let json = serde_json::to_vec(header).map_err(json_err)?;
    let mut tensors = Vec::new();
    for lh in &header.layers {
        let l = &snap.layers[lh.index];
        tensors.push((&lh.keys, vec![&l.keys[rows(l, header.from, header.to)]]));
        tensors.push((&lh.values, vec![&l.values[rows(l, header.from, header.to)]]));
    }
    let c = Container {
        magic: CHUNK_MAGIC,
        version: CHUNK_VERSION,
        json: &json,
        data_start: header.data_start,
        file_bytes: header.file_bytes,
    };
    write_container(out, path, c, &tensors)
}

/// Reads and checks a chunk's header: magic, version, header hash, tokens matching its
/// range, and every tensor inside the file with the size its shape says.
pub fn read_chunk_header(file: &mut File, path: &Path) -> Result<ChunkHeader> {
    let (_, json, len) = read_json(file, path, CHUNK_MAGIC, &[CHUNK_VERSION])?;
    let h: ChunkHeader = serde_json::from_slice(&json)
        .map_err(|e| corrupt(path, format!("chunk header is not valid JSON: {e}")))?;
    if h.dtype != DTYPE {
        return Err(corrupt(path, format!("unknown dtype {:?}", h.dtype)));
    }
    if h.file_bytes != len {
        return Err(corrupt(
            path,
            format!("file is {len} bytes, header says {}", h.file_bytes),
        ));
    }
    if h.from >= h.to || h.tokens.len() != h.to - h.from || h.tokens.len() > MAX_CHUNK_TOKENS {
        return Err(corrupt(
            path,
            format!(
                "chunk of positions {}..{} holds {} tokens",
                h.from,
                h.to,
                h.tokens.len()
            ),
        ));
    }
    for l in &h.layers {
        let want = (l.kv_heads as u64)
            .checked_mul(l.head_dim as u64)
            .and_then(|r| r.checked_mul(4 * h.tokens.len() as u64))
            .ok_or_else(|| corrupt(path, "chunk layer size overflows"))?;
        for t in [&l.keys, &l.values] {
            if !check_tensor(t, Some(want), h.data_start, len) {
                return Err(corrupt(
                    path,
                    format!(
                        "chunk layer {} tensor outside the file or of the wrong size",
                        l.index
                    ),
                ));
            }
        }
    }
    Ok(h)
}

/// Reads a checked chunk's tensors: per layer, keys and values, verifying every hash.
pub fn read_chunk_payload(
    file: &mut File,
    path: &Path,
    header: &ChunkHeader,
) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
    header
        .layers
        .iter()
        .map(|l| {
            let keys = read_tensor(
                file,
                path,
                &l.keys,
                &format!("chunk layer {} keys", l.index),
            )?;
            let values = read_tensor(
                file,
                path,
                &l.values,
                &format!("chunk layer {} values", l.index),
            )?;
            Ok((keys, values))
        })
        .collect()
}

/// Checks every tensor of a chunk (deep scan).
pub fn verify_chunk(file: &mut File, path: &Path, header: &ChunkHeader) -> Result<()> {
    verify_tensors(
        file,
        path,
        header.layers.iter().flat_map(|l| [&l.keys, &l.values]),
    )
}

/// Whether `file` starts with `magic`.
pub fn has_magic(file: &mut File, magic: &[u8; 8]) -> bool {
    let mut m = [0u8; 8];
    file.seek(SeekFrom::Start(0)).is_ok() && file.read_exact(&mut m).is_ok() && &m == magic
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
            let header = plan(&label(&tokens), snap, 5, None).unwrap();
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
        let header = plan(&label(&tokens), &snap, 5, None).unwrap();
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
        let header = plan(&label(&tokens), &snap, 5, None).unwrap();
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

    fn chunked_header(
        tokens: &[u32],
        snap: &KvSnapshot,
        from: usize,
        to: usize,
    ) -> Result<FileHeader> {
        plan(
            &label(tokens),
            snap,
            5,
            Some(ChunkRefs {
                chunk_tokens: 8,
                kv_namespace: String::new(),
                groups: vec![ChunkGroup {
                    layers: vec![0],
                    from,
                    to,
                }],
            }),
        )
    }

    #[test]
    fn chunk_files_round_trip_and_catch_damage() {
        let dir = tempfile::tempdir().unwrap();
        let tokens: Vec<u32> = (0..30).collect();
        let snap = FakeKv::new(&tokens, None).snapshot;
        let c = plan_chunk(
            &ChunkLabel {
                fingerprint: "fp",
                kv_namespace: "",
                parent: 7,
                from: 8,
                tokens: &tokens[8..16],
                window: None,
                layers: &[0],
            },
            &snap,
        )
        .unwrap();
        let path = dir.path().join("c.wkc");
        let mut f = File::create(&path).unwrap();
        assert_eq!(write_chunk(&mut f, &path, &c, &snap).unwrap(), c.file_bytes);
        drop(f);
        let good = std::fs::read(&path).unwrap();
        let read = |bytes: &[u8]| -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
            std::fs::write(&path, bytes).unwrap();
            let mut f = File::open(&path).unwrap();
            let h = read_chunk_header(&mut f, &path)?;
            verify_chunk(&mut f, &path, &h)?;
            read_chunk_payload(&mut f, &path, &h)
        };
        let rows = read(&good).unwrap();
        assert_eq!(rows[0].0, snap.layers[0].keys[16..32]);
        assert_eq!(rows[0].1, snap.layers[0].values[16..32]);
        for cut in [0, 7, 30, good.len() / 2, good.len() - 1] {
            assert!(read(&good[..cut]).is_err(), "cut at {cut}");
        }
        let payload_at = c.layers[0].keys.offset as usize;
        for at in [0, 8, 17, 40, payload_at, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            assert!(read(&bad).is_err(), "flip at {at}");
        }
        // An entry file is not a chunk, nor a chunk an entry.
        let entry = dir.path().join("e.wkv");
        let h = plan(&label(&tokens), &snap, 5, None).unwrap();
        write(&mut File::create(&entry).unwrap(), &entry, &h, &snap).unwrap();
        assert!(read_chunk_header(&mut File::open(&entry).unwrap(), &entry).is_err());
        std::fs::write(&path, &good).unwrap();
        assert!(read_header(&mut File::open(&path).unwrap(), &path).is_err());
    }

    #[test]
    fn an_entry_with_chunks_holds_the_rest_and_checks_its_references() {
        let dir = tempfile::tempdir().unwrap();
        let tokens: Vec<u32> = (0..30).collect();
        let snap = FakeKv::new(&tokens, None).snapshot;
        let h = chunked_header(&tokens, &snap, 8, 24).unwrap();
        let path = dir.path().join("e.wkv");
        write(&mut File::create(&path).unwrap(), &path, &h, &snap).unwrap();
        let mut f = File::open(&path).unwrap();
        let read = read_header(&mut f, &path).unwrap();
        assert_eq!(read, h);
        // Rows 0..8 and 24..30 are in the file, 8..24 in chunks.
        let inline = read_inline(&mut f, &path, &read).unwrap();
        let l = &snap.layers[0];
        let mut want = l.keys[..16].to_vec();
        want.extend_from_slice(&l.keys[48..]);
        assert_eq!(inline.layers[0].0, want);
        assert!(
            read_payload(&mut f, &path, &read).is_err(),
            "the chunks are needed"
        );
        // References that do not fit the entry are refused when planned.
        for (from, to) in [(8, 40), (3, 16), (16, 16), (16, 8)] {
            assert!(
                chunked_header(&tokens, &snap, from, to).is_err(),
                "{from}..{to}"
            );
        }
        let ring = FakeKv::new(&(0..100).collect::<Vec<u32>>(), Some(16)).snapshot;
        assert!(chunked_header(&(0..100).collect::<Vec<u32>>(), &ring, 0, 96).is_err());
        // A version-2 file that claims chunks is damaged.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            read_header(&mut File::open(&path).unwrap(), &path),
            Err(CacheError::Corrupt { .. })
        ));
    }

    /// Rewrites a container's JSON header in place, with a matching hash, so the checks past
    /// the hash are reached; the data stays where it was.
    fn with_json(file: &[u8], edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
        let hlen = u32::from_le_bytes(file[12..16].try_into().unwrap()) as usize;
        let mut v: serde_json::Value = serde_json::from_slice(&file[24..24 + hlen]).unwrap();
        let data_start = v["data_start"].as_u64().unwrap() as usize;
        edit(&mut v);
        let json = serde_json::to_vec(&v).unwrap();
        assert!(24 + json.len() <= data_start);
        let mut out = file.to_vec();
        out[12..16].copy_from_slice(&(json.len() as u32).to_le_bytes());
        out[16..24].copy_from_slice(&xxh3_64(&json).to_le_bytes());
        out[24..data_start].fill(0);
        out[24..24 + json.len()].copy_from_slice(&json);
        out
    }

    /// One change to a JSON header.
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;

    /// Headers whose hash is right but whose fields lie: refused with an error, never a
    /// panic or an allocation the file cannot back.
    #[test]
    fn lying_headers_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let tokens: Vec<u32> = (0..30).collect();
        let snap = FakeKv::new(&tokens, None).snapshot;
        let c = plan_chunk(
            &ChunkLabel {
                fingerprint: "fp",
                kv_namespace: "",
                parent: 7,
                from: 8,
                tokens: &tokens[8..16],
                window: None,
                layers: &[0],
            },
            &snap,
        )
        .unwrap();
        let path = dir.path().join("c.wkc");
        write_chunk(&mut File::create(&path).unwrap(), &path, &c, &snap).unwrap();
        let chunk = std::fs::read(&path).unwrap();
        std::fs::write(&path, with_json(&chunk, |_| {})).unwrap();
        assert!(read_chunk_header(&mut File::open(&path).unwrap(), &path).is_ok());
        let chunk_edits: Vec<Edit> = vec![
            Box::new(|v| v["to"] = 9.into()),
            Box::new(|v| v["from"] = 16.into()),
            Box::new(|v| v["tokens"] = serde_json::json!([1, 2])),
            Box::new(|v| v["layers"][0]["kv_heads"] = (1u64 << 62).into()),
            Box::new(|v| v["layers"][0]["head_dim"] = 0.into()),
            Box::new(|v| v["layers"][0]["keys"]["offset"] = (u64::MAX - 3).into()),
            Box::new(|v| v["layers"][0]["values"]["bytes"] = (1u64 << 40).into()),
            Box::new(|v| v["file_bytes"] = 1.into()),
            Box::new(|v| v["dtype"] = "f16".into()),
        ];
        for (i, edit) in chunk_edits.iter().enumerate() {
            std::fs::write(&path, with_json(&chunk, edit)).unwrap();
            let mut f = File::open(&path).unwrap();
            assert!(read_chunk_header(&mut f, &path).is_err(), "chunk edit {i}");
        }
        let h = chunked_header(&tokens, &snap, 8, 24).unwrap();
        let epath = dir.path().join("e.wkv");
        write(&mut File::create(&epath).unwrap(), &epath, &h, &snap).unwrap();
        let entry = std::fs::read(&epath).unwrap();
        std::fs::write(&epath, with_json(&entry, |_| {})).unwrap();
        assert!(read_header(&mut File::open(&epath).unwrap(), &epath).is_ok());
        let entry_edits: Vec<Edit> = vec![
            Box::new(|v| v["chunks"]["chunk_tokens"] = 0.into()),
            Box::new(|v| v["chunks"]["chunk_tokens"] = (1u64 << 40).into()),
            Box::new(|v| v["chunks"]["groups"][0]["to"] = 32.into()),
            Box::new(|v| v["chunks"]["groups"][0]["layers"] = serde_json::json!([0, 0])),
            Box::new(|v| v["chunks"]["groups"][0]["layers"] = serde_json::json!([5])),
            Box::new(|v| v["layers"][0]["kv_heads"] = (1u64 << 62).into()),
            Box::new(|v| v["layers"][0]["start"] = 12.into()),
        ];
        for (i, edit) in entry_edits.iter().enumerate() {
            std::fs::write(&epath, with_json(&entry, edit)).unwrap();
            let mut f = File::open(&epath).unwrap();
            assert!(read_header(&mut f, &epath).is_err(), "entry edit {i}");
        }
    }
}
