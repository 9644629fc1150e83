//! Typed metadata values of a GGUF header and typed lookups that fail with the key name.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::GgufError;

/// One metadata value.
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetadataValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetadataValue {
    /// The name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetadataValue::U8(_) => "u8",
            MetadataValue::I8(_) => "i8",
            MetadataValue::U16(_) => "u16",
            MetadataValue::I16(_) => "i16",
            MetadataValue::U32(_) => "u32",
            MetadataValue::I32(_) => "i32",
            MetadataValue::F32(_) => "f32",
            MetadataValue::Bool(_) => "bool",
            MetadataValue::String(_) => "string",
            MetadataValue::Array(_) => "array",
            MetadataValue::U64(_) => "u64",
            MetadataValue::I64(_) => "i64",
            MetadataValue::F64(_) => "f64",
        }
    }

    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetadataValue::U8(v) => Some(v.into()),
            MetadataValue::U16(v) => Some(v.into()),
            MetadataValue::U32(v) => Some(v.into()),
            MetadataValue::U64(v) => Some(v),
            MetadataValue::I8(v) => u64::try_from(v).ok(),
            MetadataValue::I16(v) => u64::try_from(v).ok(),
            MetadataValue::I32(v) => u64::try_from(v).ok(),
            MetadataValue::I64(v) => u64::try_from(v).ok(),
            MetadataValue::Bool(v) => Some(v.into()),
            _ => None,
        }
    }

    /// The value as a signed integer, when it is an integer.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetadataValue::I8(v) => Some(v.into()),
            MetadataValue::I16(v) => Some(v.into()),
            MetadataValue::I32(v) => Some(v.into()),
            MetadataValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, when it is any number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetadataValue::F32(v) => Some(v.into()),
            MetadataValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetadataValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            MetadataValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// All metadata of one file, in file order, with lookups by key.
#[derive(Debug, Clone, Default)]
pub struct Metadata {
    path: PathBuf,
    entries: Vec<(String, MetadataValue)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    pub(crate) fn new(path: &Path, entries: Vec<(String, MetadataValue)>) -> Self {
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        Metadata {
            path: path.to_path_buf(),
            entries,
            index,
        }
    }

    /// The file the metadata was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// All entries in file order.
    pub fn entries(&self) -> &[(String, MetadataValue)] {
        &self.entries
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    fn require(&self, key: &str) -> Result<&MetadataValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.into(),
        })
    }

    fn wrong(&self, key: &str, v: &MetadataValue, expected: &'static str) -> GgufError {
        GgufError::WrongType {
            path: self.path.clone(),
            key: key.into(),
            found: v.type_name(),
            expected,
        }
    }

    /// A required string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong(key, v, "string"))
    }

    /// A required non-negative integer value.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong(key, v, "unsigned integer"))
    }

    /// A required number.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| self.wrong(key, v, "number"))
    }

    /// A required array.
    pub fn get_array(&self, key: &str) -> Result<&[MetadataValue], GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| self.wrong(key, v, "array"))
    }

    /// An optional string value; present with another type is an error.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.wrong(key, v, "string")))
            .transpose()
    }

    /// An optional non-negative integer; present with another type is an error.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong(key, v, "unsigned integer"))
            })
            .transpose()
    }

    /// An optional number; present with another type is an error.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.wrong(key, v, "number")))
            .transpose()
    }

    /// An optional bool; present with another type is an error.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.wrong(key, v, "bool")))
            .transpose()
    }

    /// An optional array of strings.
    pub fn opt_strings(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.wrong(key, v, "array of strings"))?;
        arr.iter()
            .map(|x| {
                x.as_str()
                    .ok_or_else(|| self.wrong(key, x, "array of strings"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// An optional array of numbers as f32.
    pub fn opt_f32s(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.wrong(key, v, "array of numbers"))?;
        arr.iter()
            .map(|x| {
                x.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| self.wrong(key, x, "array of numbers"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// An optional array of integers as i64.
    pub fn opt_i64s(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.wrong(key, v, "array of integers"))?;
        arr.iter()
            .map(|x| {
                x.as_i64()
                    .ok_or_else(|| self.wrong(key, x, "array of integers"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}
