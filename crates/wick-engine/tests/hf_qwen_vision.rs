//! Qwen 3.5 and Qwen2.5-VL with their vision towers (tiny random models made by
//! scripts/goldens/hf_tiny_qwen35_vision.py and hf_tiny_qwen25_vl.py) against transformers'
//! f32 logits, every test on both: one image, two images of different grids (their M-RoPE
//! positions resume after each image), text before two adjacent images, an image in an
//! earlier turn of a multi-turn chat, text only through the multimodal checkpoint, chunked
//! prefill, a batch mixing an image row and a text row, the greedy continuation of
//! `generate()` (decode positions shifted by the images), preemption, and a prompt cache
//! that never serves one image's state to another.
use std::ops::ControlFlow;
use std::sync::Arc;

use wick_engine::media::{MediaData, VisionProcessor};
use wick_engine::models::vision::ImageRows;
use wick_engine::scheduler::EngineConfig;
use wick_engine::{LoadOptions, Model};

mod common;
#[path = "common/safetensors.rs"]
mod safetensors;
use common::golden::{floats, read_json};
use common::media::cases::qwen_media;
use common::media::MediaGolden;
use common::serving::reply_and_cached;

/// Each golden and the text-only golden of the same text architecture.
const GOLDENS: [(&str, &str); 2] = [("qwen35_vision", "qwen35"), ("qwen25_vl", "qwen2")];

fn load(name: &str) -> MediaGolden {
    MediaGolden::open(name, qwen_media)
}

/// The case's images as a sequence's cache keeps them (positions and merged grids; the
/// rows do not matter for positions).
fn model_images(g: &MediaGolden, name: &str) -> Vec<ImageRows> {
    g.media(name)
        .iter()
        .map(|span| {
            let MediaData::Image(p) = &span.data else {
                unreachable!()
            };
            ImageRows {
                positions: span.start..span.start + span.len,
                rows: Arc::from(Vec::new()),
                bidirectional: false,
                grid: Some((p.height / 16, p.width / 16)),
            }
        })
        .collect()
}

/// The processor's mean and std, as the golden's preprocessor_config.json has them.
fn mean_std(g: &MediaGolden) -> ([f32; 3], [f32; 3]) {
    let pre = read_json(&g.dir.join("preprocessor_config.json"));
    let triple = |k: &str| -> [f32; 3] {
        let v: Vec<f32> = pre[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        [v[0], v[1], v[2]]
    };
    (triple("image_mean"), triple("image_std"))
}

#[test]
fn the_tower_is_reported_only_when_it_loaded() {
    for (golden, text_golden) in GOLDENS {
        let g = load(golden);
        let vision = g.model.info().media.vision.clone().expect("vision caps");
        assert_eq!(
            vision.processor,
            VisionProcessor::Qwen {
                patch: 8,
                temporal_patch: 2,
                merge: 2,
                min_pixels: 1024,
                max_pixels: 4096,
                mean: mean_std(&g).0,
                std: mean_std(&g).1,
            }
        );
        assert_eq!(vision.tokens_per_image, None);
        assert_eq!(
            (
                vision.image_token_id,
                vision.boi_token_id,
                vision.eoi_token_id
            ),
            (5, 3, 4)
        );
        g.text_model_refuses_images(text_golden);
    }
}

#[test]
fn flat_pixel_keys_override_size_as_in_transformers() {
    // transformers' Qwen2VLImageProcessor lets `min_pixels` / `max_pixels` replace `size`'s
    // edges when a preprocessor config carries both: the same image must get the same grid
    // (and soft token count) here.
    let dir = tempfile::tempdir().unwrap();
    for (name, flat, want) in [
        (
            "both",
            serde_json::json!({"min_pixels": 2048, "max_pixels": 8192}),
            (2048, 8192),
        ),
        ("size", serde_json::json!({}), (1024, 4096)),
        ("max", serde_json::json!({"max_pixels": 2048}), (1024, 2048)),
    ] {
        let model = safetensors::copy_golden("qwen25_vl", &dir.path().join(name));
        let path = model.join("preprocessor_config.json");
        let mut pre: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (k, v) in flat.as_object().unwrap() {
            pre[k] = v.clone();
        }
        std::fs::write(&path, pre.to_string()).unwrap();
        let m = Model::load(&model, &LoadOptions::default()).unwrap();
        let Some(VisionProcessor::Qwen {
            min_pixels,
            max_pixels,
            ..
        }) = m.info().media.vision.as_ref().map(|v| v.processor.clone())
        else {
            panic!("{name}: no Qwen vision processor");
        };
        assert_eq!((min_pixels, max_pixels), want, "{name}");
    }
}

#[test]
fn every_position_matches_transformers() {
    for (golden, _) in GOLDENS {
        load(golden).chunked_matches(
            &[
                "one_image",
                "two_images",
                "text_only",
                "text_then_images",
                "image_then_turns",
            ],
            &[usize::MAX],
        );
    }
}

#[test]
fn chunked_prefill_never_cuts_an_image() {
    for (golden, _) in GOLDENS {
        load(golden).chunked_matches(
            &[
                "one_image",
                "two_images",
                "text_then_images",
                "image_then_turns",
            ],
            &[1, 5, 7, 13, 20],
        );
    }
}

#[test]
fn a_pass_that_cuts_an_image_is_an_error() {
    for (golden, _) in GOLDENS {
        load(golden).a_pass_that_cuts_the_image_fails();
    }
}

#[test]
fn bad_spans_are_refused() {
    for (golden, _) in GOLDENS {
        let g = load(golden);
        let mut media = g.media("one_image");
        media[0].len = 5;
        let mut cache = g.model.new_cache();
        let err = g.model.attach_media(&mut cache, &media).unwrap_err();
        assert!(err.to_string().contains("soft tokens"), "{err}");
        let mut media = g.media("one_image");
        if let MediaData::Image(p) = &mut media[0].data {
            p.data = Arc::from(&p.data[..10]);
        }
        let err = g.model.attach_media(&mut cache, &media).unwrap_err();
        assert!(err.to_string().contains("channels"), "{err}");
        let mut media = g.media("one_image");
        if let MediaData::Image(p) = &mut media[0].data {
            (p.height, p.width) = (24, 64);
        }
        let err = g.model.attach_media(&mut cache, &media).unwrap_err();
        assert!(err.to_string().contains("multiples of 16"), "{err}");
    }
}

#[test]
fn the_positions_are_transformers_m_rope_ids() {
    for (golden, _) in GOLDENS {
        let g = load(golden);
        for name in [
            "one_image",
            "two_images",
            "text_then_images",
            "image_then_turns",
        ] {
            let want = floats(&g.logits, &format!("{name}.positions"));
            let n = want.len() / 3;
            let got = wick_engine::models::mrope::positions(&model_images(&g, name), 0..n);
            for (i, t) in got.iter().enumerate() {
                let w = [want[i], want[n + i], want[2 * n + i]].map(|v| v as usize);
                assert_eq!(*t, w, "{name} position {i}");
            }
        }
    }
}

#[test]
fn a_batch_mixes_an_image_row_and_a_text_row() {
    for (golden, _) in GOLDENS {
        let g = load(golden);
        for name in ["one_image", "text_then_images", "image_then_turns"] {
            g.batch_beside_text(golden, name, "text_only");
        }
    }
}

#[test]
fn greedy_continuation_matches_generate() {
    for (golden, _) in GOLDENS {
        load(golden).greedy_continuation_matches_generate("one_image");
    }
}

#[test]
fn the_engine_batches_images_and_keys_the_prompt_cache_by_image() {
    for (golden, _) in GOLDENS {
        let g = load(golden);
        let config = EngineConfig {
            // Qwen 3.5's recurrent state is cached at prompt boundaries: for short prompts too.
            prompt_boundary_min_tokens: 8,
            ..EngineConfig::default()
        };
        // Another picture of the same size (the first one's negative).
        let (engine, first, _) = g.engine_keys_the_prompt_cache_by_image(config, |p| {
            p.data = p.data.iter().map(|v| -v).collect();
        });
        // A follow-up that extends the first image's prompt: the recurrent state is cached at
        // that prompt's boundary, so everything up to it is reused, image included.
        let mut follow = first.clone();
        follow.prompt.extend([100, 101, 102]);
        let follow_cold = g
            .model
            .generate(&follow, |_| ControlFlow::Continue(()))
            .unwrap()
            .tokens;
        let (ids, cached) = reply_and_cached(&engine, follow.clone());
        assert_eq!(ids, follow_cold);
        // Qwen 3.5's recurrent state only at that boundary; Qwen2.5-VL's KV trims to it.
        assert_eq!(cached, first.prompt.len(), "{golden}: cached {cached}");
    }
}

#[test]
fn a_preempted_image_sequence_recomputes_the_same_reply() {
    for (golden, _) in GOLDENS {
        load(golden).preempted_reply_is_unchanged("two_images", 9);
    }
}
