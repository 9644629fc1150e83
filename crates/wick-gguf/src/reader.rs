//! Bounds-checked parsing of the GGUF header from a byte slice.
//!
//! Every length read from the file is checked against the bytes that remain before it is
//! used, so a truncated or bit-flipped file becomes a [`GgufError`], never a panic or a
//! huge allocation.
use std::path::Path;

use crate::metadata::MetadataValue;
use crate::{GgmlType, GgufError, MAGIC};

/// Deepest nesting of metadata arrays accepted (real files use 1).
const MAX_ARRAY_DEPTH: usize = 4;
/// Most dimensions a ggml tensor has.
const MAX_DIMS: u32 = 4;

pub(crate) struct RawTensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub offset: u64,
}

pub(crate) struct RawHeader {
    pub version: u32,
    pub metadata: Vec<(String, MetadataValue)>,
    pub tensors: Vec<RawTensorInfo>,
    /// Offset just past the tensor directory (before alignment padding).
    pub end: u64,
}

pub(crate) struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(path: &'a Path, bytes: &'a [u8]) -> Self {
        Cursor {
            path,
            bytes,
            pos: 0,
        }
    }

    fn corrupt(&self, reason: impl Into<String>) -> GgufError {
        GgufError::Corrupt {
            path: self.path.to_path_buf(),
            offset: self.pos as u64,
            reason: reason.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.corrupt(format!(
                "{what} needs {n} bytes but only {} remain (file truncated?)",
                self.remaining()
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// A length that must fit in what remains, given `unit` bytes per item at least.
    fn len(&mut self, what: &str, unit: usize) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let max = (self.remaining() / unit.max(1)) as u64;
        if n > max {
            self.pos -= 8;
            return Err(self.corrupt(format!(
                "{what} {n} is larger than the rest of the file allows ({max}): truncated or corrupt file?"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.len(what, 1)?;
        let start = self.pos;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Corrupt {
            path: self.path.to_path_buf(),
            offset: start as u64,
            reason: format!("{what} is not valid UTF-8"),
        })
    }

    fn value(&mut self, type_id: u32, depth: usize) -> Result<MetadataValue, GgufError> {
        use MetadataValue as V;
        Ok(match type_id {
            0 => V::U8(self.array::<1>("u8 value")?[0]),
            1 => V::I8(self.array::<1>("i8 value")?[0] as i8),
            2 => V::U16(u16::from_le_bytes(self.array("u16 value")?)),
            3 => V::I16(i16::from_le_bytes(self.array("i16 value")?)),
            4 => V::U32(self.u32("u32 value")?),
            5 => V::I32(i32::from_le_bytes(self.array("i32 value")?)),
            6 => V::F32(f32::from_le_bytes(self.array("f32 value")?)),
            7 => match self.array::<1>("bool value")?[0] {
                0 => V::Bool(false),
                1 => V::Bool(true),
                b => return Err(self.corrupt(format!("bool value {b} is neither 0 nor 1"))),
            },
            8 => V::String(self.string("string value length")?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.corrupt("metadata arrays nested too deeply"));
                }
                let elem = self.u32("array element type")?;
                let unit = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    t => return Err(self.corrupt(format!("unknown array element type {t}"))),
                };
                let n = self.len("array length", unit)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                V::Array(items)
            }
            10 => V::U64(self.u64("u64 value")?),
            11 => V::I64(i64::from_le_bytes(self.array("i64 value")?)),
            12 => V::F64(f64::from_le_bytes(self.array("f64 value")?)),
            t => return Err(self.corrupt(format!("unknown metadata value type {t}"))),
        })
    }
}

/// Parses magic, version, metadata and the tensor directory.
pub(crate) fn parse_header(path: &Path, bytes: &[u8]) -> Result<RawHeader, GgufError> {
    let mut c = Cursor::new(path, bytes);
    let magic = c.take(4, "magic").map_err(|_| GgufError::BadMagic {
        path: path.to_path_buf(),
        found: format!("{:?}", String::from_utf8_lossy(bytes)),
    })?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic {
            path: path.to_path_buf(),
            found: String::from_utf8_lossy(magic).into_owned(),
        });
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    // A tensor entry takes at least 8 (name len) + 4 (dims) + 4 (type) + 8 (offset) bytes,
    // a metadata entry at least 8 (key len) + 4 (type) + 1.
    let n_tensors = c.len("tensor count", 24)?;
    let n_kv = c.len("metadata count", 13)?;
    let mut metadata = Vec::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = c.string("metadata key length")?;
        let type_id = c.u32("metadata value type")?;
        let value = c.value(type_id, 0).map_err(|e| match e {
            GgufError::Corrupt {
                path,
                offset,
                reason,
            } => GgufError::Corrupt {
                path,
                offset,
                reason: format!("{reason} (in key '{key}')"),
            },
            e => e,
        })?;
        metadata.push((key, value));
    }
    let mut tensors = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name length")?;
        let n_dims = c.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(c.corrupt(format!(
                "tensor '{name}' has {n_dims} dimensions (1..={MAX_DIMS} allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64("tensor dimension")?);
        }
        let type_id = c.u32("tensor type")?;
        let offset = c.u64("tensor offset")?;
        tensors.push(RawTensorInfo {
            name,
            dims,
            type_id,
            offset,
        });
    }
    Ok(RawHeader {
        version,
        metadata,
        tensors,
        end: c.pos as u64,
    })
}

/// Checks a tensor's shape against its type and returns its byte size.
pub(crate) fn tensor_bytes(path: &Path, t: &RawTensorInfo) -> Result<(GgmlType, u64), GgufError> {
    let dtype = GgmlType::from_id(t.type_id).ok_or_else(|| GgufError::UnknownType {
        path: path.to_path_buf(),
        tensor: t.name.clone(),
        id: t.type_id,
    })?;
    let corrupt = |reason: String| GgufError::Corrupt {
        path: path.to_path_buf(),
        offset: 0,
        reason,
    };
    let mut elements: u64 = 1;
    for &d in &t.dims {
        elements = elements
            .checked_mul(d)
            .ok_or_else(|| corrupt(format!("tensor '{}' shape {:?} overflows", t.name, t.dims)))?;
    }
    if !t.dims[0].is_multiple_of(dtype.block_len()) {
        return Err(corrupt(format!(
            "tensor '{}' rows of {} elements are not a whole number of {dtype} blocks ({})",
            t.name,
            t.dims[0],
            dtype.block_len()
        )));
    }
    let bytes = dtype
        .bytes_for(elements)
        .ok_or_else(|| corrupt(format!("tensor '{}' size overflows", t.name)))?;
    Ok((dtype, bytes))
}
