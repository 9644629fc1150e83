//! What the media goldens' tests share (`hf_gemma3_vision`, `hf_gemma4_vision`,
//! `hf_gemma4_audio`, `hf_qwen_vision`): a golden directory is a tiny random model made by
//! a script in `scripts/goldens/`, its `reference.json` (cases with token ids and media
//! spans, the greedy continuation) and `logits.safetensors` (transformers' f32 logits at
//! every position of each case, and the preprocessed media). Each test file says how its
//! cases' media are built (the function given to [`MediaGolden::open`]); the passes and
//! comparisons are these.
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use wick_engine::media::{AudioFeatures, ImagePixels, MediaData, MediaSpan};
use wick_engine::scheduler::{Engine, EngineConfig, EngineHandle};
use wick_engine::weights::SafetensorsWeights;
use wick_engine::{GenerationRequest, LoadOptions, LogitsRequest, Model, Step};

use super::golden::{floats, golden_dir, ids_of, read_json, stored_logits};
use super::logits::model_pass;
use super::serving::reply_and_cached;

/// Largest difference from transformers' f32 logits the media goldens allow.
pub const TOLERANCE: f32 = 1e-4;

/// The media spans of a golden's case, as the server would attach them.
pub type MediaOf = fn(&MediaGolden, &str) -> Vec<MediaSpan>;

/// A media golden: its model loaded as `wick serve` loads it, its reference and stored
/// tensors, and how its cases' media are built.
pub struct MediaGolden {
    pub name: String,
    pub dir: PathBuf,
    pub model: Arc<Model>,
    pub reference: serde_json::Value,
    pub logits: SafetensorsWeights,
    media_of: MediaOf,
}

impl MediaGolden {
    /// Golden `name`, whose cases' media `media_of` builds.
    pub fn open(name: &str, media_of: MediaOf) -> MediaGolden {
        Self::open_with(name, media_of, &LoadOptions::default())
    }

    /// Golden `name` with its model loaded with `options` (another backend).
    pub fn open_with(name: &str, media_of: MediaOf, options: &LoadOptions) -> MediaGolden {
        let dir = golden_dir(name);
        MediaGolden {
            name: name.to_string(),
            model: Arc::new(Model::load(&dir, options).unwrap()),
            reference: read_json(&dir.join("reference.json")),
            logits: stored_logits(&dir),
            dir,
            media_of,
        }
    }

    /// The media spans of case `name`.
    pub fn media(&self, name: &str) -> Vec<MediaSpan> {
        (self.media_of)(self, name)
    }

    /// Case `name` of the reference.
    pub fn case(&self, name: &str) -> &serde_json::Value {
        self.reference["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()
    }

    /// The prompt ids of case `name`.
    pub fn ids(&self, name: &str) -> Vec<u32> {
        ids_of(&self.case(name)["ids"])
    }

    /// transformers' logits at every position of case `name`.
    pub fn expected(&self, name: &str) -> Vec<f32> {
        floats(&self.logits, &format!("{name}.logits"))
    }

    /// transformers' greedy continuation of the greedy case.
    pub fn greedy(&self) -> Vec<u32> {
        ids_of(&self.reference["greedy"]["continuation_ids"])
    }

    /// Every position's logits with the prompt of case `name` fed in passes of at most
    /// `chunk` tokens, each moved so that it cuts no media item.
    pub fn chunked(&self, name: &str, chunk: usize) -> Vec<f32> {
        chunked(&self.model, &self.ids(name), &self.media(name), chunk)
    }

    /// Cases `names`, fed in passes of at most each of `chunks` tokens (each moved so that
    /// it cuts no media item; `usize::MAX`: one pass), match transformers' logits at every
    /// position.
    pub fn chunked_matches(&self, names: &[&str], chunks: &[usize]) {
        for &chunk in chunks {
            for &name in names {
                let how = match chunk {
                    usize::MAX => "in one pass".to_string(),
                    _ => format!("in chunks of {chunk}"),
                };
                assert_close(
                    &format!("{} {name} {how}", self.name),
                    &self.chunked(name, chunk),
                    &self.expected(name),
                );
            }
        }
    }

    /// Case `name` as a generation request of `max_tokens` (end of sequence ignored).
    pub fn request(&self, name: &str, max_tokens: usize) -> GenerationRequest {
        let mut req = GenerationRequest::new(self.ids(name)).max_tokens(max_tokens);
        req.media = self.media(name);
        req.ignore_eos = true;
        req
    }

    /// `generate()` continues case `name` with transformers' greedy tokens.
    pub fn greedy_continuation_matches_generate(&self, name: &str) {
        let want = self.greedy();
        let out = self
            .model
            .generate(&self.request(name, want.len()), |_| {
                ControlFlow::Continue(())
            })
            .unwrap();
        assert_eq!(out.tokens, want, "{}", self.name);
    }

    /// Text-only golden `text` lists no vision tower and refuses case `one_image`'s
    /// images; returns its model.
    pub fn text_model_refuses_images(&self, text: &str) -> Model {
        let text = Model::load(&golden_dir(text), &LoadOptions::default()).unwrap();
        assert!(text.info().media.vision.is_none());
        let mut cache = text.new_cache();
        let err = text
            .attach_media(&mut cache, &self.media("one_image"))
            .unwrap_err();
        assert!(err.to_string().contains("no vision tower"), "{err}");
        text
    }

    /// A pass that ends inside case `one_image`'s image is an error.
    pub fn a_pass_that_cuts_the_image_fails(&self) {
        let ids = self.ids("one_image");
        let media = self.media("one_image");
        let mut cache = self.model.new_cache();
        self.model.attach_media(&mut cache, &media).unwrap();
        let cut = media[0].start + 3;
        let mut steps = [Step {
            tokens: &ids[..cut],
            cache: &mut cache,
            logits: LogitsRequest::None,
        }];
        let err = self.model.forward(&mut steps).unwrap_err();
        assert!(err.to_string().contains("cuts the image"), "{err}");
    }

    /// Case `media_case` prefilled in one batch beside the text-only case `text_case`: both
    /// rows' logits at every position match transformers'; then the two rows decode a
    /// token together, the media row like any other.
    pub fn batch_beside_text(&self, what: &str, media_case: &str, text_case: &str) {
        let (a, b) = (self.ids(media_case), self.ids(text_case));
        let model = &self.model;
        let mut ca = model.new_cache();
        model
            .attach_media(&mut ca, &self.media(media_case))
            .unwrap();
        let mut cb = model.new_cache();
        let mut steps = [
            Step {
                tokens: &b,
                cache: &mut cb,
                logits: LogitsRequest::All,
            },
            Step {
                tokens: &a,
                cache: &mut ca,
                logits: LogitsRequest::All,
            },
        ];
        let out = model.forward(&mut steps).unwrap();
        let row = |i: usize| &out[i].as_ref().unwrap().data;
        assert_close(
            &format!("{what} text row"),
            row(0),
            &self.expected(text_case),
        );
        assert_close(
            &format!("{what} media row"),
            row(1),
            &self.expected(media_case),
        );
        let mut steps = [
            Step {
                tokens: &[10],
                cache: &mut cb,
                logits: LogitsRequest::Last,
            },
            Step {
                tokens: &[10],
                cache: &mut ca,
                logits: LogitsRequest::Last,
            },
        ];
        for out in model.forward(&mut steps).unwrap() {
            assert!(
                out.unwrap().data.iter().all(|v| v.is_finite()),
                "{what}: decode"
            );
        }
    }

    /// Case `name` run step by step with the sequence preempted once inside its prompt
    /// (prefilled `chunk` tokens at a time) and once while decoding: the recomputed reply
    /// equals the uninterrupted one.
    pub fn preempted_reply_is_unchanged(&self, name: &str, chunk: usize) {
        let model = &self.model;
        let mut req = self.request(name, 12);
        req.prefill_chunk = chunk;
        let cold = model
            .generate(&req, |_| ControlFlow::Continue(()))
            .unwrap()
            .tokens;
        let mut seq = wick_engine::Sequence::new(model, &req, model.new_cache()).unwrap();
        let mut steps = 0;
        while !seq.is_finished() {
            if steps == 3 || steps == 12 {
                seq.preempt(model.new_cache());
            }
            steps += 1;
            let step = seq.next_step(req.prefill_chunk);
            let out = {
                let (tokens, cache) = seq.input_and_cache(&step);
                model_pass(model, &tokens, cache, step.logits)
            };
            seq.advance(&step, out, std::time::Duration::ZERO).unwrap();
        }
        assert_eq!(seq.preemptions(), 2);
        assert_eq!(seq.finish().tokens, cold);
    }

    /// An engine whose prompt chunks are 7 tokens long (they would cut the images), else
    /// `config`, serves case `one_image` and the text-only case side by side with each
    /// one's reply alone; for the same prompt with the image changed by `other` (the
    /// reply changes), its prompt cache serves at most the text before the image. Returns
    /// the engine, the `one_image` request and its reply, for what the family's cache
    /// keeps past that.
    pub fn engine_keys_the_prompt_cache_by_image(
        &self,
        config: EngineConfig,
        other: impl FnOnce(&mut ImagePixels),
    ) -> (EngineHandle, GenerationRequest, Vec<u32>) {
        let model = self.model.clone();
        let engine = Engine::start(
            model.clone(),
            EngineConfig {
                step_token_budget: 7,
                ..config
            },
        )
        .unwrap();
        let mut first = self.request("one_image", self.greedy().len());
        first.prefill_chunk = 7;
        let cold = model
            .generate(&first, |_| ControlFlow::Continue(()))
            .unwrap()
            .tokens;
        assert_eq!(cold, self.greedy());
        // An image request and a text request side by side, prefilled in 7-token chunks.
        let mut text = GenerationRequest::new(self.ids("text_only")).max_tokens(6);
        text.prefill_chunk = 7;
        let text_cold = model
            .generate(&text, |_| ControlFlow::Continue(()))
            .unwrap()
            .tokens;
        let (e1, e2) = (engine.clone(), engine.clone());
        let (r1, r2) = (first.clone(), text.clone());
        let a = std::thread::spawn(move || reply_and_cached(&e1, r1));
        let b = std::thread::spawn(move || reply_and_cached(&e2, r2));
        assert_eq!(a.join().unwrap().0, cold);
        assert_eq!(b.join().unwrap().0, text_cold);

        // The same text with the other image: only the text before the image may be reused.
        let mut changed = first.clone();
        if let MediaData::Image(p) = &mut changed.media[0].data {
            other(p);
        }
        changed.media[0].digest = 2000;
        let changed_cold = model
            .generate(&changed, |_| ControlFlow::Continue(()))
            .unwrap()
            .tokens;
        assert_ne!(
            changed_cold, cold,
            "the second image should change the reply"
        );
        let (ids, cached) = reply_and_cached(&engine, changed.clone());
        assert_eq!(ids, changed_cold);
        assert!(
            cached <= changed.media[0].start,
            "reused {cached} tokens past the image start"
        );
        (engine, first, cold)
    }
}

/// Every position's logits of `ids` with `media` attached, fed in passes of at most
/// `chunk` tokens, each moved so that it cuts no media item.
pub fn chunked(model: &Model, ids: &[u32], media: &[MediaSpan], chunk: usize) -> Vec<f32> {
    let mut cache = model.new_cache();
    model.attach_media(&mut cache, media).unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    while at < ids.len() {
        let end = cache.chunk_end(at, (at + chunk).min(ids.len()));
        let logits = model_pass(model, &ids[at..end], &mut cache, LogitsRequest::All);
        out.extend(logits.unwrap().data);
        at = end;
    }
    out
}

/// The spans of a case (`[start, len]` pairs) holding `data(k)` as item `k`.
pub fn spans(
    case: &serde_json::Value,
    mut data: impl FnMut(usize) -> MediaData,
    digest: impl Fn(usize) -> u64,
) -> Vec<MediaSpan> {
    case["spans"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(k, s)| MediaSpan {
            start: s[0].as_u64().unwrap() as usize,
            len: s[1].as_u64().unwrap() as usize,
            data: data(k),
            digest: digest(k),
        })
        .collect()
}

/// Fails unless every value of `got` is within [`TOLERANCE`] of `want` (and prints the
/// largest difference, which the closing notes quote).
pub fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (i, diff) = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold((0, 0f32), |m, (i, d)| if d > m.1 { (i, d) } else { m });
    eprintln!("{what}: max |diff| {diff}");
    assert!(
        diff <= TOLERANCE,
        "{what}: max |diff| {diff} at {i} ({} vs {})",
        got[i],
        want[i]
    );
}

/// Clip `clip` of an audio golden's stored features, as the server hands them over: the extractor's frames that hold
/// samples (the trailing padded frames dropped).
pub fn audio_features(g: &MediaGolden, clip: &str) -> AudioFeatures {
    let all = floats(&g.logits, &format!("{clip}.features"));
    let frames = g.reference["clips"][clip]["valid_frames"].as_u64().unwrap() as usize;
    AudioFeatures {
        frames,
        bins: 128,
        data: Arc::from(&all[..frames * 128]),
    }
}

/// The media spans of case `name` of an audio golden: each holds the case's clip.
pub fn audio_media(g: &MediaGolden, name: &str) -> Vec<MediaSpan> {
    let case = g.case(name);
    let clip = |_| MediaData::Audio(audio_features(g, case["clip"].as_str().unwrap()));
    spans(case, clip, |_| 7)
}
