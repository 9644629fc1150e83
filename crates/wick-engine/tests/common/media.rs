//! What the media goldens' tests share (`hf_gemma3_vision`, `hf_gemma4_vision`,
//! `hf_gemma4_audio`, `hf_qwen_vision`): a golden directory is a tiny random model made by
//! a script in `scripts/goldens/`, its `reference.json` (cases with token ids and media
//! spans, the greedy continuation) and `logits.safetensors` (transformers' f32 logits at
//! every position of each case, and the preprocessed media). Each test file says how its
//! cases' media are built (the function given to [`MediaGolden::open`]); the passes and
//! comparisons are these.
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use wick_engine::media::{AudioFeatures, ImagePixels, MediaData, MediaSpan};
use wick_engine::scheduler::{Engine, EngineConfig, EngineHandle};
use wick_engine::weights::SafetensorsWeights;
use wick_engine::{GenerationRequest, LoadOptions, LogitsRequest, Model, Step};

use super::golden::{floats, golden_dir, ids_of, read_json, stored_logits};
use super::logits::model_pass;
use super::serving::reply_and_cached;

/// Largest difference from transformers' f32 logits the media goldens allow.
pub const TOLERANCE: f32 = 1e-4;

/// How far from transformers' outputs a backend may be.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tolerance {
    /// Every value within this (the CPU backend: [`TOLERANCE`]).
    Absolute(f32),
    /// Within this times the largest magnitude expected (at least 1): the GPU's, whose
    /// sums run in another order.
    Scaled(f32),
}

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
    /// How close its logits must be to transformers'.
    pub tolerance: Tolerance,
    media_of: MediaOf,
}

impl MediaGolden {
    /// Golden `name`, whose cases' media `media_of` builds.
    pub fn open(name: &str, media_of: MediaOf) -> MediaGolden {
        Self::open_with(name, media_of, &LoadOptions::default())
    }

    /// The same golden held to `tolerance`.
    pub fn within(self, tolerance: Tolerance) -> MediaGolden {
        MediaGolden { tolerance, ..self }
    }

    /// Golden `name` with its model loaded with `options` (another backend).
    pub fn open_with(name: &str, media_of: MediaOf, options: &LoadOptions) -> MediaGolden {
        let dir = golden_dir(name);
        MediaGolden {
            name: name.to_string(),
            model: Arc::new(Model::load(&dir, options).unwrap()),
            reference: read_json(&dir.join("reference.json")),
            logits: stored_logits(&dir),
            tolerance: Tolerance::Absolute(TOLERANCE),
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
                self.assert_logits_close(
                    &format!("{} {name} {how}", self.name),
                    &self.chunked(name, chunk),
                    &self.expected(name),
                );
            }
        }
    }

    /// Fails unless logits `got` (every position's, one after another) are within the
    /// golden's tolerance of `want`, naming the position of the largest difference.
    pub fn assert_logits_close(&self, what: &str, got: &[f32], want: &[f32]) {
        let vocab = self.model.vocab_size();
        check_close(what, got, want, self.tolerance, |i| {
            format!("position {}, logit {}", i / vocab, i % vocab)
        });
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
        self.assert_logits_close(
            &format!("{what} text row"),
            row(0),
            &self.expected(text_case),
        );
        self.assert_logits_close(
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
    check_close(what, got, want, Tolerance::Absolute(TOLERANCE), |i| {
        format!("value {i}")
    });
}

/// Fails unless every value of `got` is within `tolerance` of `want`; prints the largest
/// difference and, on failure, where it is (`at` names an index).
pub fn check_close(
    what: &str,
    got: &[f32],
    want: &[f32],
    tolerance: Tolerance,
    at: impl Fn(usize) -> String,
) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (i, diff) = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold((0, 0f32), |m, (i, d)| if d > m.1 { (i, d) } else { m });
    let bound = match tolerance {
        Tolerance::Absolute(t) => t,
        Tolerance::Scaled(t) => t * want.iter().fold(1f32, |m, v| m.max(v.abs())),
    };
    eprintln!("{what}: max |diff| {diff} (allowed {bound})");
    assert!(
        diff <= bound,
        "{what}: max |diff| {diff} > {bound} at {} ({} vs {})",
        at(i),
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

/// Each media golden's media, as its cases' spans ([`MediaOf`]).
pub mod cases {
    use super::*;

    /// Gemma 3's image `i` of the committed pixel values (what Gemma3ImageProcessor made of
    /// the test images).
    pub fn gemma3_pixels(g: &MediaGolden, i: usize) -> ImagePixels {
        let all = floats(&g.logits, "pixel_values");
        let n = 3 * 64 * 64;
        ImagePixels {
            channels: 3,
            height: 64,
            width: 64,
            data: Arc::from(&all[i * n..(i + 1) * n]),
        }
    }

    /// `gemma3_vision`'s cases: image `k` of the case is committed image `k`.
    pub fn gemma3_media(g: &MediaGolden, name: &str) -> Vec<MediaSpan> {
        spans(
            g.case(name),
            |k| MediaData::Image(gemma3_pixels(g, k)),
            |k| 1000 + k as u64,
        )
    }

    /// The bytes of tensor `name` of a safetensors file, read directly (the engine's reader
    /// takes float tensors only; Gemma 4's patch positions are int64).
    fn tensor_bytes(file: &Path, name: &str) -> Vec<u8> {
        let bytes = std::fs::read(file).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let offsets = &header[name]["data_offsets"];
        let (a, b) = (
            offsets[0].as_u64().unwrap() as usize,
            offsets[1].as_u64().unwrap() as usize,
        );
        bytes[8 + n + a..8 + n + b].to_vec()
    }

    /// `(pixel_values, image_position_ids)` as stored with `gemma4_vision` (every Gemma 4
    /// vision variant reads them).
    fn gemma4_stored() -> &'static (Vec<f32>, Vec<i64>) {
        static STORED: OnceLock<(Vec<f32>, Vec<i64>)> = OnceLock::new();
        STORED.get_or_init(|| {
            let file = golden_dir("gemma4_vision").join("logits.safetensors");
            let values = tensor_bytes(&file, "pixel_values")
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let positions = tensor_bytes(&file, "image_position_ids")
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (values, positions)
        })
    }

    /// Gemma 4's image `i` of the committed pixel values (Gemma4ImageProcessorPil's
    /// patches, padded to its budget) put back together as the `[3, h, w]` image the server
    /// hands the engine.
    pub fn gemma4_pixels(i: usize) -> ImagePixels {
        let (values, positions) = gemma4_stored();
        let (budget, patch_len) = (630, 192);
        let p = 8;
        let pos = &positions[i * budget * 2..(i + 1) * budget * 2];
        let real: Vec<(usize, usize)> = pos
            .chunks_exact(2)
            .take_while(|xy| xy[0] >= 0)
            .map(|xy| (xy[0] as usize, xy[1] as usize))
            .collect();
        let w = (real.iter().map(|r| r.0).max().unwrap() + 1) * p;
        let h = (real.iter().map(|r| r.1).max().unwrap() + 1) * p;
        let mut data = vec![0f32; 3 * h * w];
        for (k, &(gx, gy)) in real.iter().enumerate() {
            let patch = &values[(i * budget + k) * patch_len..(i * budget + k + 1) * patch_len];
            for y in 0..p {
                for x in 0..p {
                    for c in 0..3 {
                        data[c * h * w + (gy * p + y) * w + gx * p + x] =
                            patch[(y * p + x) * 3 + c];
                    }
                }
            }
        }
        ImagePixels {
            channels: 3,
            height: h,
            width: w,
            data: Arc::from(data),
        }
    }

    /// The Gemma 4 vision goldens' cases: image `k` of the case is committed image `k`.
    pub fn gemma4_media(g: &MediaGolden, name: &str) -> Vec<MediaSpan> {
        spans(
            g.case(name),
            |k| MediaData::Image(gemma4_pixels(k)),
            |k| 1000 + k as u64,
        )
    }

    /// `gemma4_audio_vision`'s case `both`: its image, then the 16 kHz mono clip.
    pub fn gemma4_image_and_clip(g: &MediaGolden, name: &str) -> Vec<MediaSpan> {
        let shape: Vec<usize> = g.reference["image_shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let frames = g.reference["clip"]["valid_frames"].as_u64().unwrap() as usize;
        let features = floats(&g.logits, "mono16k.features");
        let data = |k: usize| match k {
            0 => MediaData::Image(ImagePixels {
                channels: shape[0],
                height: shape[1],
                width: shape[2],
                data: Arc::from(floats(&g.logits, "image")),
            }),
            _ => MediaData::Audio(AudioFeatures {
                frames,
                bins: 128,
                data: Arc::from(&features[..frames * 128]),
            }),
        };
        spans(g.case(name), data, |k| k as u64 + 1)
    }

    /// Qwen-VL's committed image `i` as the processor made it (`[3, h, w]`, transformers'
    /// patch rows folded back into the image).
    pub fn qwen_pixels(g: &MediaGolden, i: usize) -> ImagePixels {
        let meta = &g.reference["images"][i];
        ImagePixels {
            channels: 3,
            height: meta["height"].as_u64().unwrap() as usize,
            width: meta["width"].as_u64().unwrap() as usize,
            data: Arc::from(floats(&g.logits, &format!("image_{i}.pixels"))),
        }
    }

    /// The Qwen-VL goldens' cases: image `k` of the case is the committed image the case
    /// names.
    pub fn qwen_media(g: &MediaGolden, name: &str) -> Vec<MediaSpan> {
        let images = &g.case(name)["images"];
        spans(
            g.case(name),
            |k| MediaData::Image(qwen_pixels(g, images[k].as_u64().unwrap() as usize)),
            |k| 1000 + k as u64,
        )
    }
}
