//! [`Model::check_request`] and [`Model::generate`]: one request checked against the model
//! and run alone, step by step, on the caller's thread.
use std::ops::ControlFlow;
use std::time::Instant;

use super::{Model, Step};
use crate::generation::{GenerationOutput, GenerationRequest, Sequence, TokenEvent};
use crate::Result;

impl Model {
    /// Checks a request against the model before any work: a non-empty prompt of valid
    /// ids, prompt + max_tokens within the context, valid sampling parameters.
    pub fn check_request(&self, request: &GenerationRequest) -> Result<()> {
        if request.prompt.is_empty() {
            return Err(crate::EngineError::InvalidInput(
                "the prompt is empty".into(),
            ));
        }
        self.check_media(request)?;
        let vocab = self.vocab_size();
        // A soft token's id is never looked up (its image's rows replace it).
        let in_media = |i: usize| {
            request
                .media
                .iter()
                .any(|s| (s.start..s.start + s.len).contains(&i))
        };
        if let Some((_, &bad)) = request
            .prompt
            .iter()
            .enumerate()
            .find(|&(i, &id)| id as usize >= vocab && !in_media(i))
        {
            return Err(crate::EngineError::InvalidInput(format!(
                "prompt token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        let needed = request.prompt.len() + request.max_tokens;
        let limit = self.info().context_length;
        if needed > limit {
            return Err(crate::EngineError::ContextOverflow { needed, limit });
        }
        request.sampling.validate_for_vocab(vocab)?;
        Ok(())
    }

    /// The request's media fit the prompt and the model's towers.
    fn check_media(&self, request: &GenerationRequest) -> Result<()> {
        let bad = |m: String| Err(crate::EngineError::InvalidInput(m));
        for span in &request.media {
            if span.len == 0 || span.start + span.len > request.prompt.len() {
                return bad(format!(
                    "a media span at {}..{} lies outside the {}-token prompt",
                    span.start,
                    span.start + span.len,
                    request.prompt.len()
                ));
            }
            match (&span.data, &self.info().media.vision) {
                (crate::media::MediaData::Audio(_), _) => {
                    if self.info().media.audio.is_none() {
                        return bad(format!("model '{}' has no audio tower", self.info().name));
                    }
                }
                (crate::media::MediaData::Image(_), None) => {
                    return bad(format!("model '{}' has no vision tower", self.info().name))
                }
                (crate::media::MediaData::Image(_), Some(v)) => {
                    if v.tokens_per_image.is_some_and(|n| n != span.len) {
                        return bad(format!(
                            "an image span at position {} has {} soft tokens; model '{}' reads {} per image",
                            span.start,
                            span.len,
                            self.info().name,
                            v.tokens_per_image.unwrap_or(0)
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Generates for one request on a fresh cache, calling `on_token` for every sampled
    /// token (return `Break` to stop early: the finish reason is then `Cancelled`).
    pub fn generate(
        &self,
        request: &GenerationRequest,
        on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<GenerationOutput> {
        self.generate_with_cache(request, self.new_cache(), on_token)
    }

    /// Like [`Model::generate`], continuing from `cache`, which must hold a prefix of the
    /// prompt (its length is reported as cached tokens).
    pub fn generate_with_cache(
        &self,
        request: &GenerationRequest,
        cache: crate::KvCache,
        mut on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<GenerationOutput> {
        let mut seq = Sequence::new(self, request, cache)?;
        while !seq.is_finished() {
            let step = seq.next_step(request.prefill_chunk);
            let started = Instant::now();
            let out = {
                let (tokens, cache) = seq.input_and_cache(&step);
                self.forward(&mut [Step {
                    tokens: &tokens,
                    cache,
                    logits: step.logits,
                }])?
            };
            if let Some(event) =
                seq.advance(&step, out.into_iter().next().flatten(), started.elapsed())?
            {
                if on_token(&event).is_break() {
                    seq.cancel();
                }
            }
        }
        Ok(seq.finish())
    }
}
