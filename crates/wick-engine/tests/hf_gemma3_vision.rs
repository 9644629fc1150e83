//! Gemma 3 with its vision tower (a tiny random model made by
//! scripts/goldens/hf_tiny_gemma3_vision.py) against transformers' f32 logits: one image, two
//! images, text only through the multimodal checkpoint, chunked prefill whose chunks would
//! cut an image, a batch mixing an image row and a text row, the greedy continuation of
//! `generate()`, and a prompt cache that never serves one image's KV to another.
use std::ops::ControlFlow;
use std::sync::Arc;

use wick_engine::media::{ImagePixels, MediaData, MediaSpan, VisionProcessor};
use wick_engine::models::decoder::LogitsRequest;
use wick_engine::scheduler::{Engine, EngineConfig};
use wick_engine::weights::SafetensorsWeights;
use wick_engine::{GenerationRequest, LoadOptions, Model, Step};

mod common;
use common::{assert_close, collect, floats, golden_dir, load_parts, Cases};

struct Golden {
    model: Model,
    reference: serde_json::Value,
    logits: SafetensorsWeights,
}

fn load() -> Golden {
    let (model, reference, logits) = load_parts(&golden_dir("gemma3_vision"));
    Golden {
        model,
        reference,
        logits,
    }
}

impl Cases for Golden {
    fn model(&self) -> &Model {
        &self.model
    }
    fn reference(&self) -> &serde_json::Value {
        &self.reference
    }
    fn logits(&self) -> &SafetensorsWeights {
        &self.logits
    }
    fn media(&self, name: &str) -> Vec<MediaSpan> {
        Golden::media(self, name)
    }
}

impl Golden {
    /// Image `i` of the committed pixel values (what Gemma3ImageProcessor made of the test
    /// images), with a digest standing in for the server's hash.
    fn pixels(&self, i: usize) -> ImagePixels {
        let all = floats(&self.logits, "pixel_values");
        let n = 3 * 64 * 64;
        ImagePixels {
            channels: 3,
            height: 64,
            width: 64,
            data: Arc::from(&all[i * n..(i + 1) * n]),
        }
    }

    /// The case's media spans: image `k` of the case is committed image `k`.
    fn media(&self, name: &str) -> Vec<MediaSpan> {
        self.case(name)["spans"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(k, s)| MediaSpan {
                start: s[0].as_u64().unwrap() as usize,
                len: s[1].as_u64().unwrap() as usize,
                data: MediaData::Image(self.pixels(k)),
                digest: 1000 + k as u64,
            })
            .collect()
    }
}

#[test]
fn the_tower_is_reported_only_when_it_loaded() {
    let g = load();
    let vision = g.model.info().media.vision.clone().expect("vision caps");
    assert_eq!(vision.processor, VisionProcessor::Gemma3 { size: 64 });
    assert_eq!(vision.tokens_per_image, Some(16));
    assert_eq!(
        (
            vision.image_token_id,
            vision.boi_token_id,
            vision.eoi_token_id
        ),
        (8, 6, 7)
    );
    let text = golden_dir("gemma3");
    let text = Model::load(&text, &LoadOptions::default()).unwrap();
    assert!(text.info().media.vision.is_none());
    let mut cache = text.new_cache();
    let err = text
        .attach_media(&mut cache, &g.media("one_image"))
        .unwrap_err();
    assert!(err.to_string().contains("no vision tower"), "{err}");
    // Refused before it runs, naming the model.
    let err = text
        .generate(&g.request("one_image", 12), |_| ControlFlow::Continue(()))
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("'gemma3' has no vision tower"),
        "{err}"
    );
}

#[test]
fn every_position_matches_transformers() {
    let g = load();
    for name in ["one_image", "two_images", "text_only"] {
        let got = g.chunked(name, usize::MAX);
        assert_close(name, &got, &g.expected(name));
    }
}

#[test]
fn chunked_prefill_never_cuts_an_image() {
    let g = load();
    for chunk in [1, 5, 7, 13, 20] {
        for name in ["one_image", "two_images"] {
            let got = g.chunked(name, chunk);
            assert_close(
                &format!("{name} in chunks of {chunk}"),
                &got,
                &g.expected(name),
            );
        }
    }
}

#[test]
fn a_pass_that_cuts_an_image_is_an_error() {
    let g = load();
    let ids = g.ids("one_image");
    let media = g.media("one_image");
    let mut cache = g.model.new_cache();
    g.model.attach_media(&mut cache, &media).unwrap();
    let cut = media[0].start + 3;
    let mut steps = [Step {
        tokens: &ids[..cut],
        cache: &mut cache,
        logits: LogitsRequest::None,
    }];
    let err = g.model.forward(&mut steps).unwrap_err();
    assert!(err.to_string().contains("cuts the image"), "{err}");
}

#[test]
fn bad_spans_are_refused() {
    let g = load();
    let mut media = g.media("one_image");
    media[0].len = 15;
    let mut cache = g.model.new_cache();
    let err = g.model.attach_media(&mut cache, &media).unwrap_err();
    assert!(err.to_string().contains("soft tokens"), "{err}");
    let mut media = g.media("one_image");
    if let MediaData::Image(p) = &mut media[0].data {
        p.height = 32;
    }
    let err = g.model.attach_media(&mut cache, &media).unwrap_err();
    assert!(err.to_string().contains("pixel values"), "{err}");
    let mut req = g.request("one_image", 12);
    req.media[0].start = req.prompt.len() - 4;
    let err = g
        .model
        .generate(&req, |_| ControlFlow::Continue(()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("outside the"), "{err}");
}

#[test]
fn a_batch_mixes_an_image_row_and_a_text_row() {
    load().batch_beside_text("gemma3_vision", "one_image", "text_only");
}

#[test]
fn greedy_continuation_matches_generate() {
    let g = load();
    let want: Vec<u32> = g.reference["greedy"]["continuation_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let out = g
        .model
        .generate(&g.request("one_image", 12), |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(out.tokens, want);
}

#[test]
fn the_engine_batches_images_and_keys_the_prompt_cache_by_image() {
    let g = load();
    let model = Arc::new(load().model);
    // A step budget of 7 tokens: prompt chunks that would cut the images.
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            step_token_budget: 7,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let want = g.reference["greedy"]["continuation_ids"].clone();
    let mut first = g.request("one_image", 12);
    first.prefill_chunk = 7;
    let cold = model
        .generate(&first, |_| ControlFlow::Continue(()))
        .unwrap()
        .tokens;
    assert_eq!(serde_json::json!(cold), want);
    // An image request and a text request side by side, prefilled in 7-token chunks.
    let mut text = GenerationRequest::new(g.ids("text_only")).max_tokens(6);
    text.prefill_chunk = 7;
    let text_cold = model
        .generate(&text, |_| ControlFlow::Continue(()))
        .unwrap()
        .tokens;
    let (e1, e2) = (engine.clone(), engine.clone());
    let (r1, r2) = (first.clone(), text.clone());
    let a = std::thread::spawn(move || collect(&e1, r1));
    let b = std::thread::spawn(move || collect(&e2, r2));
    assert_eq!(a.join().unwrap().0, cold);
    assert_eq!(b.join().unwrap().0, text_cold);

    // The same text with the other image: only the text before the image may be reused.
    let mut other = first.clone();
    if let MediaData::Image(p) = &mut other.media[0].data {
        *p = g.pixels(1);
    }
    other.media[0].digest = 2000;
    let other_cold = model
        .generate(&other, |_| ControlFlow::Continue(()))
        .unwrap()
        .tokens;
    assert_ne!(other_cold, cold, "the second image should change the reply");
    let (ids, cached) = collect(&engine, other.clone());
    assert_eq!(ids, other_cold);
    assert!(
        cached <= other.media[0].start,
        "reused {cached} tokens past the image start"
    );
    // The first image again: its whole prompt is cached now.
    let (ids, cached) = collect(&engine, first.clone());
    assert_eq!(ids, cold);
    assert!(
        cached > first.media[0].start + first.media[0].len,
        "cached {cached}"
    );
}

#[test]
fn a_preempted_image_sequence_recomputes_the_same_reply() {
    load().preempted_reply_is_unchanged("two_images", 9);
}
