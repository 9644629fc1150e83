//! Gemma 4 checkpoints with a vision tower (tiny random models made by
//! scripts/goldens/hf_tiny_gemma4_vision.py). The tower itself is not implemented yet: the
//! text model loads from the multimodal checkpoint and matches transformers on a text-only
//! prompt, the model lists no vision tower, and an image request is refused clearly.
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use wick_engine::media::{ImagePixels, MediaData, MediaSpan};
use wick_engine::models::decoder::LogitsRequest;
use wick_engine::weights::SafetensorsWeights;
use wick_engine::{GenerationRequest, LoadOptions, Model, Step};

const VARIANTS: [&str; 2] = ["gemma4_vision", "gemma4_vision_bidir"];
const TOLERANCE: f32 = 1e-4;

fn dir(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/goldens/hf")
        .join(variant)
}

fn case_ids(reference: &serde_json::Value, name: &str) -> Vec<u32> {
    reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn text_through_the_multimodal_checkpoint_matches_transformers() {
    for variant in VARIANTS {
        let d = dir(variant);
        let model = Model::load(&d, &LoadOptions::default()).unwrap();
        assert!(model.info().media.vision.is_none(), "{variant}");
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("reference.json")).unwrap())
                .unwrap();
        let ids = case_ids(&reference, "text_only");
        let mut cache = model.new_cache();
        let out = model
            .forward(&mut [Step {
                tokens: &ids,
                cache: &mut cache,
                logits: LogitsRequest::All,
            }])
            .unwrap();
        let got = &out[0].as_ref().unwrap().data;
        let logits = SafetensorsWeights::open_files(&d, &[d.join("logits.safetensors")]).unwrap();
        let want: Vec<f32> = logits
            .raw("text_only.logits")
            .unwrap()
            .bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got.len(), want.len());
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff <= TOLERANCE, "{variant}: max |diff| {diff}");
    }
}

#[test]
fn an_image_request_is_refused_until_the_tower_exists() {
    let d = dir("gemma4_vision");
    let model = Model::load(&d, &LoadOptions::default()).unwrap();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("reference.json")).unwrap()).unwrap();
    let mut req = GenerationRequest::new(case_ids(&reference, "one_image")).max_tokens(2);
    let span = &reference["cases"][0]["spans"][0];
    req.media = vec![MediaSpan {
        start: span[0].as_u64().unwrap() as usize,
        len: span[1].as_u64().unwrap() as usize,
        data: MediaData::Image(ImagePixels {
            channels: 3,
            height: 8,
            width: 8,
            data: Arc::from(vec![0.0f32; 3 * 8 * 8]),
        }),
        digest: 1,
    }];
    let err = model
        .generate(&req, |_| ControlFlow::Continue(()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("has no vision tower"), "{err}");
}
