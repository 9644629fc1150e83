//! Reading and writing small safetensors files, to derive odd or damaged models from the
//! golden ones in `goldens/hf` (a tensor removed, rows added). Included with
//! `#[path = "common/safetensors.rs"] mod safetensors;`.
#![allow(dead_code)] // each test crate uses its own subset

use std::path::{Path, PathBuf};

/// One tensor: its name, dtype (`"F32"` …), shape and raw little-endian bytes.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl Tensor {
    /// The values of an `F32` tensor.
    pub fn f32s(&self) -> Vec<f32> {
        assert_eq!(self.dtype, "F32", "{} is not F32", self.name);
        self.data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// Replaces the values and shape of an `F32` tensor.
    pub fn set_f32s(&mut self, values: &[f32], shape: Vec<usize>) {
        assert_eq!(values.len(), shape.iter().product::<usize>());
        self.dtype = "F32".into();
        self.shape = shape;
        self.data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    }
}

/// Every tensor of `path`, in file order.
pub fn read(path: &Path) -> Vec<Tensor> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut tensors: Vec<(usize, Tensor)> = header
        .iter()
        .filter(|(name, _)| name.as_str() != "__metadata__")
        .map(|(name, v)| {
            let offsets: Vec<usize> = v["data_offsets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o.as_u64().unwrap() as usize)
                .collect();
            let tensor = Tensor {
                name: name.clone(),
                dtype: v["dtype"].as_str().unwrap().to_string(),
                shape: v["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize)
                    .collect(),
                data: data[offsets[0]..offsets[1]].to_vec(),
            };
            (offsets[0], tensor)
        })
        .collect();
    tensors.sort_by_key(|(at, _)| *at);
    tensors.into_iter().map(|(_, t)| t).collect()
}

/// Writes `tensors` to `path`.
pub fn write(path: &Path, tensors: &[Tensor]) {
    let mut header = serde_json::Map::new();
    let mut at = 0;
    for t in tensors {
        header.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": t.dtype,
                "shape": t.shape,
                "data_offsets": [at, at + t.data.len()],
            }),
        );
        at += t.data.len();
    }
    let mut head = serde_json::to_vec(&header).unwrap();
    // The data starts 8-byte aligned, as the format recommends.
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    for t in tensors {
        out.extend_from_slice(&t.data);
    }
    std::fs::write(path, out).unwrap();
}

/// The golden tiny model `name` (`goldens/hf/<name>`).
pub fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/goldens/hf")
        .join(name)
}

/// A copy of golden model `name` as directory `dst` (its model files; not the reference
/// logits).
pub fn copy_golden(name: &str, dst: &Path) -> PathBuf {
    let src = golden(name);
    let dst = dst.to_path_buf();
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap();
        if file == "logits.safetensors" || file == "reference.json" {
            continue;
        }
        std::fs::copy(&path, dst.join(file)).unwrap();
    }
    dst
}

/// Edits the `config.json` of the model in `dir`.
pub fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}
