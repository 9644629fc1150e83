//! Truncated, bit-flipped and hand-damaged GGUF files must give errors, never panics.
use wick_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetadataValue};

fn sample() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.metadata(
        "general.architecture",
        MetadataValue::String("llama".into()),
    )
    .metadata("llama.block_count", MetadataValue::U32(2))
    .metadata(
        "tokenizer.ggml.tokens",
        MetadataValue::Array(vec![
            MetadataValue::String("a".into()),
            MetadataValue::String("b".into()),
        ]),
    )
    .metadata("llama.rope.freq_base", MetadataValue::F32(10000.0));
    let floats: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    w.tensor("a.weight", vec![8, 8], GgmlType::F32, floats);
    w.tensor("b.weight", vec![32, 1], GgmlType::Q8_0, vec![1u8; 34]);
    w.to_bytes()
}

fn open_bytes(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, bytes).unwrap();
    GgufFile::open(&path)
}

#[test]
fn round_trip() {
    let f = open_bytes(&sample()).unwrap();
    assert_eq!(
        f.metadata().get_str("general.architecture").unwrap(),
        "llama"
    );
    assert_eq!(f.metadata().get_u64("llama.block_count").unwrap(), 2);
    assert_eq!(
        f.metadata()
            .opt_strings("tokenizer.ggml.tokens")
            .unwrap()
            .unwrap(),
        vec!["a", "b"]
    );
    let t = f.tensor("a.weight").unwrap();
    assert_eq!(t.info.shape(), vec![8, 8]);
    assert_eq!(&t.data[4..8], &1f32.to_le_bytes());
    assert_eq!(f.tensor("b.weight").unwrap().data.len(), 34);
    assert!(matches!(
        f.tensor("nope"),
        Err(GgufError::MissingTensor { .. })
    ));
    assert!(matches!(
        f.metadata().get_u64("general.architecture"),
        Err(GgufError::WrongType { .. })
    ));
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = sample();
    for len in 0..bytes.len() - 1 {
        let cut = &bytes[..len];
        match open_bytes(cut) {
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("m.gguf"), "error must name the file: {msg}");
            }
            // Cutting only alignment padding after the last tensor still leaves a valid file.
            Ok(f) => assert!(f.tensors().iter().all(|t| t.offset + t.len <= len as u64)),
        }
    }
}

#[test]
fn bit_flips_never_panic() {
    let bytes = sample();
    for i in 0..bytes.len() {
        for bit in [0, 3, 7] {
            let mut b = bytes.clone();
            b[i] ^= 1 << bit;
            if let Ok(f) = open_bytes(&b) {
                for t in f.tensors() {
                    f.tensor(&t.name).unwrap();
                }
            }
        }
    }
}

#[test]
fn huge_lengths_are_rejected_without_allocating() {
    let mut b = sample();
    // tensor count at byte 8
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = open_bytes(&b).unwrap_err().to_string();
    assert!(e.contains("tensor count"), "{e}");
}

#[test]
fn not_gguf() {
    let e = open_bytes(b"PK\x03\x04 this is a zip").unwrap_err();
    assert!(matches!(e, GgufError::BadMagic { .. }), "{e}");
    let e = open_bytes(b"").unwrap_err();
    assert!(matches!(e, GgufError::BadMagic { .. }), "{e}");
}

/// Byte position of `tensor`'s data offset field in a `sample()`-style header (name, dims
/// count, two dims, type, offset).
fn offset_field(bytes: &[u8], tensor: &[u8]) -> usize {
    let at = bytes
        .windows(tensor.len())
        .position(|w| w == tensor)
        .expect("tensor name in header");
    at + tensor.len() + 4 + 16 + 4
}

#[test]
fn overlapping_tensors_are_rejected() {
    let mut bytes = sample();
    let field = offset_field(&bytes, b"b.weight");
    // b.weight's offset 0: it would read a.weight's bytes.
    bytes[field..field + 8].copy_from_slice(&0u64.to_le_bytes());
    let err = open_bytes(&bytes).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, GgufError::Corrupt { .. }) && msg.contains("overlaps"),
        "{msg}"
    );
    assert!(msg.contains("a.weight") && msg.contains("b.weight") && msg.contains("m.gguf"));

    // a.weight's type made wider (F32 -> F64) so its bytes run into b.weight's.
    let mut bytes = sample();
    let type_at = offset_field(&bytes, b"a.weight") - 4;
    bytes[type_at..type_at + 4].copy_from_slice(&28u32.to_le_bytes());
    // Pad the file so that the wider tensor still fits in it: only the overlap is wrong.
    bytes.extend_from_slice(&[0u8; 512]);
    let msg = open_bytes(&bytes).unwrap_err().to_string();
    assert!(msg.contains("overlaps"), "{msg}");
}

#[test]
fn out_of_file_tensor_ranges_are_rejected() {
    let mut bytes = sample();
    let field = offset_field(&bytes, b"b.weight");
    bytes[field..field + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        open_bytes(&bytes),
        Err(GgufError::Truncated { .. })
    ));
    // An offset that overflows when added to the data start.
    bytes[field..field + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    assert!(open_bytes(&bytes).is_err());
}

#[test]
fn streamed_tensors_follow_the_declared_alignment() {
    let mut w = GgufWriter::new();
    w.metadata("general.alignment", MetadataValue::U32(64));
    w.tensor_of_len("a.weight", vec![3], GgmlType::F32, 12);
    w.tensor("b.weight", vec![2], GgmlType::F32, vec![0u8; 8]);
    let mut bytes = Vec::new();
    let a: Vec<u8> = [1.0f32, 2.0, 3.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    w.write_streaming(&mut bytes, |i| {
        assert_eq!(i, 0, "only the declared tensor is asked for");
        Ok(std::borrow::Cow::Owned(a.clone()))
    })
    .unwrap();
    let f = open_bytes(&bytes).unwrap();
    assert_eq!(f.tensor("a.weight").unwrap().data, &a[..]);
    assert_eq!(f.tensors()[1].offset % 64, 0);
    let mut short = Vec::new();
    let err = w
        .write_streaming(&mut short, |_| Ok(std::borrow::Cow::Owned(vec![0u8; 4])))
        .unwrap_err();
    assert!(err.to_string().contains("12 were declared"), "{err}");
}
