//! Gemma 4 with its vision tower (tiny random models made by
//! scripts/goldens/hf_tiny_gemma4_vision.py) against transformers' f32 logits, for both
//! variants (causal soft tokens, and `use_bidirectional_attention: "vision"`) and the tower
//! with clipped linears and standardization (one image only): one image,
//! two images, text only through the multimodal checkpoint, chunked prefill whose chunks
//! would cut an image, a batch mixing an image row and a text row, the greedy continuation
//! of `generate()`, and a prompt cache that never serves one image's KV to another.
use wick_engine::media::{MediaData, VisionProcessor};
use wick_engine::scheduler::EngineConfig;

mod common;
use common::media::cases::{gemma4_media, gemma4_pixels as pixels};
use common::media::MediaGolden;
use common::serving::reply_and_cached;

const VARIANTS: [&str; 2] = ["gemma4_vision", "gemma4_vision_bidir"];
/// `use_clipped_linears` and `standardize` on; its reference has the one-image case only.
const CLIPPED: &str = "gemma4_vision_clipped";

fn load(variant: &str) -> MediaGolden {
    MediaGolden::open(variant, gemma4_media)
}

#[test]
fn the_tower_is_reported_with_the_processor_budget() {
    for variant in VARIANTS {
        let g = load(variant);
        let vision = g.model.info().media.vision.clone().expect("vision caps");
        assert_eq!(
            vision.processor,
            VisionProcessor::Gemma4 {
                patch: 8,
                pool: 3,
                max_patches: 630
            }
        );
        assert_eq!(vision.tokens_per_image, None);
        assert_eq!(
            (
                vision.image_token_id,
                vision.boi_token_id,
                vision.eoi_token_id
            ),
            (8, 6, 7)
        );
        // The soft tokens the reference counted are the tower's patches over 3×3.
        let counts = g.reference["num_soft_tokens_per_image"].as_array().unwrap();
        for (k, n) in counts.iter().enumerate() {
            let px = pixels(k);
            assert_eq!(
                (px.height / 8) * (px.width / 8) / 9,
                n.as_u64().unwrap() as usize
            );
        }
    }
}

#[test]
fn a_text_only_gemma4_lists_no_tower_and_refuses_images() {
    load(VARIANTS[0]).text_model_refuses_images("gemma4");
}

#[test]
fn every_position_matches_transformers() {
    for variant in VARIANTS {
        load(variant).chunked_matches(&["one_image", "two_images", "text_only"], &[usize::MAX]);
    }
}

#[test]
fn clipped_linears_and_standardization_match_transformers() {
    let g = load(CLIPPED);
    g.chunked_matches(&["one_image"], &[usize::MAX, 5]);
    g.greedy_continuation_matches_generate("one_image");
}

#[test]
fn chunked_prefill_never_cuts_an_image() {
    for variant in VARIANTS {
        load(variant).chunked_matches(&["one_image", "two_images"], &[1, 5, 8, 13, 40]);
    }
}

#[test]
fn a_pass_that_cuts_an_image_is_an_error() {
    load(VARIANTS[1]).a_pass_that_cuts_the_image_fails();
}

#[test]
fn bad_spans_are_refused() {
    let g = load(VARIANTS[0]);
    let mut media = g.media("one_image");
    media[0].len -= 1;
    let mut cache = g.model.new_cache();
    let err = g.model.attach_media(&mut cache, &media).unwrap_err();
    assert!(err.to_string().contains("soft tokens"), "{err}");
    let mut media = g.media("one_image");
    if let MediaData::Image(p) = &mut media[0].data {
        p.height += 8;
    }
    let err = g.model.attach_media(&mut cache, &media).unwrap_err();
    assert!(err.to_string().contains("multiples of 24"), "{err}");
}

#[test]
fn a_batch_mixes_an_image_row_and_a_text_row() {
    for variant in VARIANTS {
        load(variant).batch_beside_text(variant, "one_image", "text_only");
    }
}

#[test]
fn greedy_continuation_matches_generate() {
    for variant in VARIANTS {
        load(variant).greedy_continuation_matches_generate("one_image");
    }
}

#[test]
fn the_engine_batches_images_and_keys_the_prompt_cache_by_image() {
    let g = load(VARIANTS[1]);
    // The other image has as many soft tokens.
    let (engine, first, cold) =
        g.engine_keys_the_prompt_cache_by_image(EngineConfig::default(), |p| *p = pixels(1));
    let (ids, cached) = reply_and_cached(&engine, first.clone());
    assert_eq!(ids, cold);
    assert!(
        cached > first.media[0].start + first.media[0].len,
        "cached {cached}"
    );
}
