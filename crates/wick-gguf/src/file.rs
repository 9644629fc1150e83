//! A memory-mapped, validated GGUF file.
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::reader::{parse_header, tensor_bytes};
use crate::{GgmlType, GgufError, Metadata, DEFAULT_ALIGNMENT};

/// Where one tensor lives and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// ggml dimensions, innermost first (`[columns, rows]` for a matrix).
    pub dims: Vec<u64>,
    /// Element type.
    pub dtype: GgmlType,
    /// Byte offset from the start of the file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

impl TensorInfo {
    /// Dimensions outermost first (row-major shape, as tensors libraries use).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A tensor's directory entry and its bytes, borrowed from the mapping.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Where the tensor lives.
    pub info: &'a TensorInfo,
    /// The raw ggml bytes.
    pub data: &'a [u8],
}

/// An open GGUF file: header parsed and validated, data mapped.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.entries().len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Rejects tensors whose bytes overlap (as llama.cpp does): two tensors sharing bytes means
/// a damaged or crafted directory (an offset of 0 repeated, a type changed so sizes grew), and
/// loading it would compute with garbage. Zero-length tensors overlap nothing.
fn check_no_overlap(path: &Path, header_end: u64, tensors: &[TensorInfo]) -> Result<(), GgufError> {
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.len > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.offset + a.len > b.offset {
            return Err(GgufError::Corrupt {
                path: path.to_path_buf(),
                offset: header_end,
                reason: format!(
                    "tensor '{}' (bytes {}..{}) overlaps tensor '{}' (bytes {}..{})",
                    a.name,
                    a.offset,
                    a.offset + a.len,
                    b.name,
                    b.offset,
                    b.offset + b.len
                ),
            });
        }
    }
    Ok(())
}

impl GgufFile {
    /// Opens, maps and validates `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the mapping is read-only; wick never writes model files while serving
        // them. A file truncated underneath a running process is outside what any mmap
        // reader (llama.cpp included) can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::from_map(path, map)
    }

    fn from_map(path: PathBuf, map: Mmap) -> Result<Self, GgufError> {
        let header = parse_header(&path, &map)?;
        let metadata = Metadata::new(&path, header.metadata);
        let alignment = metadata
            .opt_u64("general.alignment")?
            .unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() || alignment > 1 << 20 {
            return Err(GgufError::Corrupt {
                path,
                offset: 0,
                reason: format!("general.alignment {alignment} is not a power of two"),
            });
        }
        let data_start = header.end.div_ceil(alignment) * alignment;
        let file_len = map.len() as u64;
        let mut tensors = Vec::with_capacity(header.tensors.len());
        let mut by_name = HashMap::with_capacity(header.tensors.len());
        for raw in &header.tensors {
            let (dtype, len) = tensor_bytes(&path, raw)?;
            if raw.offset % alignment != 0 {
                return Err(GgufError::Corrupt {
                    path,
                    offset: header.end,
                    reason: format!(
                        "tensor '{}' offset {} is not aligned to {alignment}",
                        raw.name, raw.offset
                    ),
                });
            }
            let offset = data_start
                .checked_add(raw.offset)
                .ok_or_else(|| GgufError::Corrupt {
                    path: path.clone(),
                    offset: header.end,
                    reason: format!("tensor '{}' offset {} overflows", raw.name, raw.offset),
                })?;
            let end = offset.saturating_add(len);
            if end > file_len {
                return Err(GgufError::Truncated {
                    path,
                    tensor: raw.name.clone(),
                    needed: end,
                    len: file_len,
                });
            }
            if by_name.insert(raw.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::Corrupt {
                    path,
                    offset: header.end,
                    reason: format!("tensor '{}' appears twice", raw.name),
                });
            }
            tensors.push(TensorInfo {
                name: raw.name.clone(),
                dims: raw.dims.clone(),
                dtype,
                offset,
                len,
            });
        }
        check_no_overlap(&path, header.end, &tensors)?;
        Ok(GgufFile {
            path,
            map,
            version: header.version,
            metadata,
            tensors,
            by_name,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The tensor directory in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Whether a tensor named `name` exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// A tensor's directory entry and bytes.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, GgufError> {
        let &i = self
            .by_name
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor {
                path: self.path.clone(),
                name: name.into(),
            })?;
        let info = &self.tensors[i];
        let data = &self.map[info.offset as usize..(info.offset + info.len) as usize];
        Ok(TensorView { info, data })
    }
}
