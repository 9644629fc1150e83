//! Weights from a GGUF file (names are already canonical).
use std::borrow::Cow;

use wick_gguf::GgufFile;

use super::HostWeight;
use super::WeightSource;
use crate::Result;

/// Borrowing lookups into a memory-mapped GGUF file.
#[derive(Debug)]
pub struct GgufWeights<'a> {
    file: &'a GgufFile,
}

impl<'a> GgufWeights<'a> {
    /// Weights of `file`.
    pub fn new(file: &'a GgufFile) -> Self {
        GgufWeights { file }
    }
}

impl WeightSource for GgufWeights<'_> {
    fn source_name(&self) -> String {
        self.file.path().display().to_string()
    }

    fn get(&self, name: &str) -> Result<Option<HostWeight<'_>>> {
        if !self.file.has_tensor(name) {
            return Ok(None);
        }
        let t = self.file.tensor(name)?;
        Ok(Some(HostWeight {
            name: name.to_string(),
            dtype: t.info.dtype,
            shape: t.info.shape(),
            bytes: Cow::Borrowed(t.data),
        }))
    }

    fn contains(&self, name: &str) -> bool {
        self.file.has_tensor(name)
    }
}
