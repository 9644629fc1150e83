//! Gemma 3 with its vision tower (a tiny random model made by
//! scripts/goldens/hf_tiny_gemma3_vision.py) against transformers' f32 logits: one image, two
//! images, text only through the multimodal checkpoint, chunked prefill whose chunks would
//! cut an image, a batch mixing an image row and a text row, the greedy continuation of
//! `generate()`, and a prompt cache that never serves one image's KV to another.
use std::ops::ControlFlow;

use wick_engine::media::{MediaData, VisionProcessor};
use wick_engine::scheduler::EngineConfig;

mod common;
use common::media::cases::{gemma3_media, gemma3_pixels as pixels};
use common::media::MediaGolden;
use common::serving::reply_and_cached;

fn load() -> MediaGolden {
    MediaGolden::open("gemma3_vision", gemma3_media)
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
    let text = g.text_model_refuses_images("gemma3");
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
    load().chunked_matches(&["one_image", "two_images", "text_only"], &[usize::MAX]);
}

#[test]
fn chunked_prefill_never_cuts_an_image() {
    load().chunked_matches(&["one_image", "two_images"], &[1, 5, 7, 13, 20]);
}

#[test]
fn a_pass_that_cuts_an_image_is_an_error() {
    load().a_pass_that_cuts_the_image_fails();
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
    load().greedy_continuation_matches_generate("one_image");
}

#[test]
fn the_engine_batches_images_and_keys_the_prompt_cache_by_image() {
    let g = load();
    let (engine, first, cold) =
        g.engine_keys_the_prompt_cache_by_image(EngineConfig::default(), |p| *p = pixels(&g, 1));
    // The first image again: its whole prompt is cached now.
    let (ids, cached) = reply_and_cached(&engine, first.clone());
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
