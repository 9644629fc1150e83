//! Gemma 4 with its audio Conformer (a tiny random model made by
//! scripts/goldens/hf_tiny_gemma4_audio.py) against transformers' f32 outputs: the tower's
//! projected rows for a 16 kHz mono and a 44.1 kHz stereo clip, logits at every position
//! with each clip and with text only, chunked prefill, a batch mixing an audio row and a
//! text row, the greedy continuation of `generate()`, and (on `gemma4_audio_vision`, the same
//! model with hf_tiny_gemma4_vision.py's vision tower too) a prompt holding an image and a clip.
use std::ops::ControlFlow;

use wick_engine::media::MediaData;
use wick_engine::{LoadOptions, Model};

mod common;
use common::golden::{floats, golden_dir};
use common::media::cases::gemma4_image_and_clip;
use common::media::{assert_close, audio_media, MediaGolden};

fn load() -> MediaGolden {
    MediaGolden::open("gemma4_audio", audio_media)
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
    load().chunked_matches(&["mono", "stereo", "text_only"], &[usize::MAX]);
}

#[test]
fn chunked_prefill_matches() {
    load().chunked_matches(&["mono"], &[1, 7, 20]);
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
    load().greedy_continuation_matches_generate("mono");
}

#[test]
fn an_image_and_a_clip_in_one_prompt_match_transformers() {
    let g = MediaGolden::open("gemma4_audio_vision", gemma4_image_and_clip);
    let media = &g.model.info().media;
    assert!(media.audio.is_some() && media.vision.is_some());
    g.chunked_matches(&["both"], &[usize::MAX, 9]);
}
