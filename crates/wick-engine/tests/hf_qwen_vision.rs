//! Qwen 3.5 and Qwen2.5-VL with their vision towers (tiny random models made by
//! scripts/goldens/hf_tiny_qwen35_vision.py and hf_tiny_qwen25_vl.py) against transformers'
//! f32 logits, every test on both: one image, two images of different grids (their M-RoPE
//! positions resume after each image), text only through the multimodal checkpoint, chunked
//! prefill, a batch mixing an image row and a text row, the greedy continuation of
//! `generate()` (decode positions shifted by the images), preemption, and a prompt cache
//! that never serves one image's state to another.
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use wick_engine::media::{ImagePixels, MediaData, MediaSpan, VisionProcessor};
use wick_engine::models::decoder::LogitsRequest;
use wick_engine::models::vision::ImageRows;
use wick_engine::scheduler::{Engine, EngineConfig};
use wick_engine::weights::SafetensorsWeights;
use wick_engine::{GenerationRequest, LoadOptions, Model, Step};

mod common;
use common::{assert_close, collect, floats, golden_dir, load_parts, Cases};

/// Each golden and the text-only golden of the same text architecture.
const GOLDENS: [(&str, &str); 2] = [("qwen35_vision", "qwen35"), ("qwen25_vl", "qwen2")];

struct Golden {
    dir: PathBuf,
    model: Model,
    reference: serde_json::Value,
    logits: SafetensorsWeights,
}

fn load(name: &str) -> Golden {
    let dir = golden_dir(name);
    let (model, reference, logits) = load_parts(&dir);
    Golden {
        dir,
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
    /// Committed image `i` as the processor made it (`[3, h, w]`, transformers' patch rows
    /// folded back into the image).
    fn pixels(&self, i: usize) -> ImagePixels {
        let meta = &self.reference["images"][i];
        ImagePixels {
            channels: 3,
            height: meta["height"].as_u64().unwrap() as usize,
            width: meta["width"].as_u64().unwrap() as usize,
            data: Arc::from(floats(&self.logits, &format!("image_{i}.pixels"))),
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
                data: MediaData::Image(
                    self.pixels(self.case(name)["images"][k].as_u64().unwrap() as usize),
                ),
                digest: 1000 + k as u64,
            })
            .collect()
    }

    /// The case's images as a sequence's cache keeps them (positions and merged grids; the
    /// rows do not matter for positions).
    fn model_images(&self, name: &str) -> Vec<ImageRows> {
        self.media(name)
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
    fn mean_std(&self) -> ([f32; 3], [f32; 3]) {
        let pre: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(self.dir.join("preprocessor_config.json")).unwrap(),
        )
        .unwrap();
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
                mean: g.mean_std().0,
                std: g.mean_std().1,
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
        let text = golden_dir(text_golden);
        let text = Model::load(&text, &LoadOptions::default()).unwrap();
        assert!(text.info().media.vision.is_none());
        let mut cache = text.new_cache();
        let err = text
            .attach_media(&mut cache, &g.media("one_image"))
            .unwrap_err();
        assert!(err.to_string().contains("no vision tower"), "{err}");
    }
}

#[test]
fn every_position_matches_transformers() {
    for (golden, _) in GOLDENS {
        let g = load(golden);
        for name in ["one_image", "two_images", "text_only"] {
            let got = g.chunked(name, usize::MAX);
            assert_close(name, &got, &g.expected(name));
        }
    }
}

#[test]
fn chunked_prefill_never_cuts_an_image() {
    for (golden, _) in GOLDENS {
        let g = load(golden);
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
}

#[test]
fn a_pass_that_cuts_an_image_is_an_error() {
    for (golden, _) in GOLDENS {
        let g = load(golden);
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
        for name in ["one_image", "two_images"] {
            let want = floats(&g.logits, &format!("{name}.positions"));
            let n = want.len() / 3;
            let got = wick_engine::models::mrope::positions(&g.model_images(name), 0..n);
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
        load(golden).batch_beside_text(golden, "one_image", "text_only");
    }
}

#[test]
fn greedy_continuation_matches_generate() {
    for (golden, _) in GOLDENS {
        let g = load(golden);
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
}

#[test]
fn the_engine_batches_images_and_keys_the_prompt_cache_by_image() {
    for (golden, _) in GOLDENS {
        let g = load(golden);
        let model = Arc::new(load(golden).model);
        // A step budget of 7 tokens: prompt chunks that would cut the images.
        let engine = Engine::start(
            model.clone(),
            EngineConfig {
                step_token_budget: 7,
                // Qwen 3.5's recurrent state is cached at prompt boundaries: for short prompts too.
                prompt_boundary_min_tokens: 8,
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
        // Another picture of the same size (the first one's negative).
        if let MediaData::Image(p) = &mut other.media[0].data {
            p.data = p.data.iter().map(|v| -v).collect();
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
        // A follow-up that extends the first image's prompt: the recurrent state is cached at
        // that prompt's boundary, so everything up to it is reused, image included.
        let mut follow = first.clone();
        follow.prompt.extend([100, 101, 102]);
        let follow_cold = model
            .generate(&follow, |_| ControlFlow::Continue(()))
            .unwrap()
            .tokens;
        let (ids, cached) = collect(&engine, follow.clone());
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
