//! Gemma 4 with its audio Conformer (a tiny random model made by
//! scripts/goldens/hf_tiny_gemma4_audio.py) against transformers' f32 outputs: the tower's
//! projected rows for a 16 kHz mono and a 44.1 kHz stereo clip, logits at every position
//! with each clip and with text only, chunked prefill, a batch mixing an audio row and a
//! text row, the greedy continuation of `generate()`, and (on `gemma4_audio_vision`, the same
//! model with hf_tiny_gemma4_vision.py's vision tower too) a prompt holding an image and a clip.
use std::ops::ControlFlow;
use std::sync::Arc;

use wick_engine::media::{AudioFeatures, MediaData, MediaSpan};
use wick_engine::models::decoder::LogitsRequest;
use wick_engine::weights::SafetensorsWeights;
use wick_engine::{LoadOptions, Model, Step};

mod common;
use common::{assert_close, floats, golden_dir, load_parts, Cases};

struct Golden {
    model: Model,
    reference: serde_json::Value,
    logits: SafetensorsWeights,
}

fn load() -> Golden {
    let (model, reference, logits) = load_parts(&golden_dir("gemma4_audio"));
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
    /// The clip's features as the server hands them over: the extractor's frames that hold
    /// samples (the trailing padded frames dropped).
    fn features(&self, clip: &str) -> AudioFeatures {
        let all = floats(&self.logits, &format!("{clip}.features"));
        let frames = self.reference["clips"][clip]["valid_frames"]
            .as_u64()
            .unwrap() as usize;
        AudioFeatures {
            frames,
            bins: 128,
            data: Arc::from(&all[..frames * 128]),
        }
    }

    fn media(&self, name: &str) -> Vec<MediaSpan> {
        let case = self.case(name);
        case["spans"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| MediaSpan {
                start: s[0].as_u64().unwrap() as usize,
                len: s[1].as_u64().unwrap() as usize,
                data: MediaData::Audio(self.features(case["clip"].as_str().unwrap())),
                digest: 7,
            })
            .collect()
    }
}

#[test]
fn the_tower_is_reported_only_when_it_loaded() {
    let g = load();
    let audio = g.model.info().media.audio.clone().expect("audio caps");
    assert_eq!(
        (audio.sample_rate, audio.mel_bins, audio.max_tokens),
        (16_000, 128, 750)
    );
    assert_eq!(
        (audio.audio_token_id, audio.boa_token_id, audio.eoa_token_id),
        (11, 9, 10)
    );
    assert!(g.model.info().media.vision.is_none());
    let text = golden_dir("gemma4");
    let text = Model::load(&text, &LoadOptions::default()).unwrap();
    assert!(text.info().media.audio.is_none());
    let err = text
        .generate(&g.request("mono", 12), |_| ControlFlow::Continue(()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("has no audio tower"), "{err}");
}

#[test]
fn tower_rows_match_transformers() {
    let g = load();
    for (case, clip) in [("mono", "mono16k"), ("stereo", "stereo44k")] {
        let rows = g.model.media_rows(&g.media(case)).unwrap();
        assert_eq!(rows.len(), 1);
        assert_close(clip, &rows[0], &floats(&g.logits, &format!("{clip}.rows")));
    }
}

#[test]
fn every_position_matches_transformers() {
    let g = load();
    for name in ["mono", "stereo", "text_only"] {
        let got = g.chunked(name, usize::MAX);
        assert_close(name, &got, &g.expected(name));
    }
}

#[test]
fn chunked_prefill_matches() {
    let g = load();
    for chunk in [1, 7, 20] {
        let got = g.chunked("mono", chunk);
        assert_close(
            &format!("mono in chunks of {chunk}"),
            &got,
            &g.expected("mono"),
        );
    }
}

#[test]
fn bad_spans_are_refused() {
    let g = load();
    let mut media = g.media("mono");
    media[0].len -= 1;
    let mut cache = g.model.new_cache();
    let err = g.model.attach_media(&mut cache, &media).unwrap_err();
    assert!(err.to_string().contains("soft tokens"), "{err}");
    let mut media = g.media("mono");
    if let MediaData::Audio(a) = &mut media[0].data {
        a.bins = 64;
    }
    let err = g.model.attach_media(&mut cache, &media).unwrap_err();
    assert!(err.to_string().contains("mel bins"), "{err}");
}

#[test]
fn a_batch_mixes_an_audio_row_and_a_text_row() {
    load().batch_beside_text("gemma4_audio", "mono", "text_only");
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
        .generate(&g.request("mono", 12), |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(out.tokens, want);
}

#[test]
fn an_image_and_a_clip_in_one_prompt_match_transformers() {
    let d = golden_dir("gemma4_audio_vision");
    let model = Model::load(&d, &LoadOptions::default()).unwrap();
    assert!(model.info().media.audio.is_some() && model.info().media.vision.is_some());
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("reference.json")).unwrap()).unwrap();
    let stored = SafetensorsWeights::open_files(&d, &[d.join("logits.safetensors")]).unwrap();
    let case = &reference["cases"][0];
    let ids: Vec<u32> = case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let shape: Vec<usize> = reference["image_shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let frames = reference["clip"]["valid_frames"].as_u64().unwrap() as usize;
    let features = floats(&stored, "mono16k.features");
    let spans = case["spans"].as_array().unwrap();
    let span = |i: usize| {
        (
            spans[i][0].as_u64().unwrap() as usize,
            spans[i][1].as_u64().unwrap() as usize,
        )
    };
    let (image, clip) = (span(0), span(1));
    let media = vec![
        MediaSpan {
            start: image.0,
            len: image.1,
            data: MediaData::Image(wick_engine::media::ImagePixels {
                channels: shape[0],
                height: shape[1],
                width: shape[2],
                data: Arc::from(floats(&stored, "image")),
            }),
            digest: 1,
        },
        MediaSpan {
            start: clip.0,
            len: clip.1,
            data: MediaData::Audio(AudioFeatures {
                frames,
                bins: 128,
                data: Arc::from(&features[..frames * 128]),
            }),
            digest: 2,
        },
    ];
    let want = floats(&stored, "both.logits");
    for chunk in [usize::MAX, 9] {
        let mut cache = model.new_cache();
        model.attach_media(&mut cache, &media).unwrap();
        let mut got = Vec::new();
        let mut at = 0;
        while at < ids.len() {
            let end = cache.chunk_end(at, (at + chunk).min(ids.len()));
            let mut steps = [Step {
                tokens: &ids[at..end],
                cache: &mut cache,
                logits: LogitsRequest::All,
            }];
            got.extend(model.forward(&mut steps).unwrap().remove(0).unwrap().data);
            at = end;
        }
        assert_close(&format!("image and clip, chunks of {chunk}"), &got, &want);
    }
}
