//! A small GGUF writer: builds files for tests and for tools that emit GGUF. Tensors are
//! given with their bytes, or declared by length and streamed at write time (a model too
//! large to hold in memory).
use std::borrow::Cow;
use std::io::{self, Write};

use crate::{GgmlType, MetadataValue, DEFAULT_ALIGNMENT, MAGIC};

/// One tensor's directory entry, and its bytes when they were given up front.
#[derive(Debug)]
struct Entry {
    name: String,
    dims: Vec<u64>,
    dtype: GgmlType,
    len: usize,
    data: Option<Vec<u8>>,
}

/// Collects metadata and tensors, then writes a version-3 GGUF file.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetadataValue)>,
    tensors: Vec<Entry>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry.
    pub fn metadata(&mut self, key: impl Into<String>, value: MetadataValue) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// Adds a tensor with ggml `dims` (innermost first) and its raw bytes.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        dims: Vec<u64>,
        dtype: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(Entry {
            name: name.into(),
            dims,
            dtype,
            len: data.len(),
            data: Some(data),
        });
        self
    }

    /// Declares a tensor of `len` bytes whose data [`GgufWriter::write_streaming`] asks for
    /// when it reaches it.
    pub fn tensor_of_len(
        &mut self,
        name: impl Into<String>,
        dims: Vec<u64>,
        dtype: GgmlType,
        len: usize,
    ) -> &mut Self {
        self.tensors.push(Entry {
            name: name.into(),
            dims,
            dtype,
            len,
            data: None,
        });
        self
    }

    /// The data alignment: `general.alignment` when the metadata sets it (readers honour
    /// it), else the format's default.
    fn alignment(&self) -> usize {
        self.metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT) as usize
    }

    /// Serializes everything (every tensor must have been given its bytes).
    pub fn write(&self, out: &mut impl Write) -> io::Result<()> {
        self.write_streaming(out, |i| {
            Err(io::Error::other(format!(
                "tensor '{}' was declared without data",
                self.tensors[i].name
            )))
        })
    }

    /// Serializes everything, asking `data` for the bytes of each tensor declared with
    /// [`GgufWriter::tensor_of_len`], in order, once each; a wrong length is an error.
    pub fn write_streaming<'a>(
        &self,
        out: &mut impl Write,
        mut data: impl FnMut(usize) -> io::Result<Cow<'a, [u8]>>,
    ) -> io::Result<()> {
        let mut header = Vec::new();
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_string(&mut header, k);
            header.extend_from_slice(&type_id(v).to_le_bytes());
            put_value(&mut header, v);
        }
        let align = self.alignment();
        let mut offset = 0usize;
        for t in &self.tensors {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.dtype.id().to_le_bytes());
            header.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += t.len.div_ceil(align) * align;
        }
        header.resize(header.len().div_ceil(align) * align, 0);
        out.write_all(&header)?;
        for (i, t) in self.tensors.iter().enumerate() {
            let bytes = match &t.data {
                Some(d) => Cow::Borrowed(&d[..]),
                None => data(i)?,
            };
            if bytes.len() != t.len {
                return Err(io::Error::other(format!(
                    "tensor '{}' has {} bytes, {} were declared",
                    t.name,
                    bytes.len(),
                    t.len
                )));
            }
            out.write_all(&bytes)?;
            let pad = t.len.div_ceil(align) * align - t.len;
            out.write_all(&vec![0u8; pad])?;
        }
        Ok(())
    }

    /// Serializes into a byte vector (every tensor given its bytes; panics otherwise).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.write(&mut v).expect("writing to a Vec cannot fail");
        v
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn type_id(v: &MetadataValue) -> u32 {
    match v {
        MetadataValue::U8(_) => 0,
        MetadataValue::I8(_) => 1,
        MetadataValue::U16(_) => 2,
        MetadataValue::I16(_) => 3,
        MetadataValue::U32(_) => 4,
        MetadataValue::I32(_) => 5,
        MetadataValue::F32(_) => 6,
        MetadataValue::Bool(_) => 7,
        MetadataValue::String(_) => 8,
        MetadataValue::Array(_) => 9,
        MetadataValue::U64(_) => 10,
        MetadataValue::I64(_) => 11,
        MetadataValue::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &MetadataValue) {
    match v {
        MetadataValue::U8(x) => out.push(*x),
        MetadataValue::I8(x) => out.push(*x as u8),
        MetadataValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::Bool(x) => out.push(u8::from(*x)),
        MetadataValue::String(s) => put_string(out, s),
        MetadataValue::Array(items) => {
            let elem = items.first().map(type_id).unwrap_or(4);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        MetadataValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetadataValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}
