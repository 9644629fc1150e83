//! The sampling parameters of one request, their defaults and their validation.
use super::error::SamplingError;

/// The most top log-probabilities one step can report (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Default window of the repetition, presence and frequency penalties (mlx-lm's).
pub const DEFAULT_PENALTY_CONTEXT: usize = 20;

/// How to pick the next token, with mlx-lm's meaning for every field.
///
/// [`Default`] is greedy decoding with every processor off. Fields that switch a stage off:
/// `temperature == 0` (argmax, and the truncations below are skipped), `top_p == 1`,
/// `top_k == 0`, `min_p == 0`, `xtc_probability == 0`, `repetition_penalty` 1 or 0, and
/// zero presence / frequency penalties.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens until their mass reaches `top_p`;
    /// 1 is off. (mlx-bun treats 0 as off too: map it to 1 when resolving a request.)
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 is off.
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 is off.
    pub min_p: f32,
    /// XTC ("exclude top choices"): the chance per step of removing every token above
    /// `xtc_threshold` except the least likely of them; 0 is off.
    pub xtc_probability: f32,
    /// XTC's probability threshold, in `[0, 0.5]`.
    pub xtc_threshold: f32,
    /// Divides positive logits and multiplies negative ones of recently seen tokens; 1 (or
    /// 0, as in mlx-lm) is off.
    pub repetition_penalty: f32,
    /// How many of the last tokens the repetition penalty looks at; 0 = the whole history.
    pub repetition_context_size: usize,
    /// Subtracted once from the logit of every distinct recent token; 0 is off.
    pub presence_penalty: f32,
    /// Window of the presence penalty; 0 = the whole history.
    pub presence_context_size: usize,
    /// Subtracted from a token's logit once per recent occurrence; 0 is off.
    pub frequency_penalty: f32,
    /// Window of the frequency penalty; 0 = the whole history.
    pub frequency_context_size: usize,
    /// Added to the logits of these token ids before anything else.
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the per-step random draws; the same seed gives the same tokens.
    pub seed: u64,
    /// Log-probabilities to report: `None` = none, `Some(k)` = the chosen token's plus the
    /// `k` most likely ones (`Some(0)` = only the chosen token's).
    pub logprobs: Option<usize>,
    /// Structured output: the grammar every sampled token must keep the reply within.
    pub constraint: Option<crate::constraint::Constraint>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.0,
            repetition_penalty: 1.0,
            repetition_context_size: DEFAULT_PENALTY_CONTEXT,
            presence_penalty: 0.0,
            presence_context_size: DEFAULT_PENALTY_CONTEXT,
            frequency_penalty: 0.0,
            frequency_context_size: DEFAULT_PENALTY_CONTEXT,
            logit_bias: Vec::new(),
            seed: 0,
            logprobs: None,
            constraint: None,
        }
    }
}

fn check(
    field: &'static str,
    value: f32,
    bound: &'static str,
    ok: impl Fn(f32) -> bool,
) -> Result<(), SamplingError> {
    if value.is_finite() && ok(value) {
        Ok(())
    } else {
        Err(SamplingError::OutOfRange {
            field,
            bound,
            value: value.into(),
        })
    }
}

impl SamplingParams {
    /// Greedy decoding (the default), spelled out.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Whether the next token is the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether the next token is the argmax of the model's raw logits: greedy, with no
    /// logit processor and no log-probabilities asked for. The backend may then pick it
    /// without the logits leaving the device.
    pub fn is_raw_argmax(&self) -> bool {
        self.is_masked_argmax() && self.constraint.is_none()
    }

    /// Whether the next token is the argmax of the model's logits with only the
    /// structured-output constraint's mask applied (no other processor, no
    /// log-probabilities): the backend may then pick it from the masked row on the device.
    pub fn is_masked_argmax(&self) -> bool {
        self.is_greedy()
            && self.logprobs.is_none()
            && self.logit_bias.is_empty()
            && (self.repetition_penalty == 0.0 || self.repetition_penalty == 1.0)
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
    }

    /// Checks every field against its bound; the error names the field, the bound and the
    /// value.
    pub fn validate(&self) -> Result<(), SamplingError> {
        check(
            "temperature",
            self.temperature,
            "a finite number >= 0",
            |v| v >= 0.0,
        )?;
        check("top_p", self.top_p, "in (0, 1]", |v| v > 0.0 && v <= 1.0)?;
        check("min_p", self.min_p, "in [0, 1]", |v| {
            (0.0..=1.0).contains(&v)
        })?;
        check("xtc_probability", self.xtc_probability, "in [0, 1]", |v| {
            (0.0..=1.0).contains(&v)
        })?;
        check("xtc_threshold", self.xtc_threshold, "in [0, 0.5]", |v| {
            (0.0..=0.5).contains(&v)
        })?;
        check(
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number >= 0",
            |v| v >= 0.0,
        )?;
        check(
            "presence_penalty",
            self.presence_penalty,
            "a finite number",
            |_| true,
        )?;
        check(
            "frequency_penalty",
            self.frequency_penalty,
            "a finite number",
            |_| true,
        )?;
        if let Some(&(token, bias)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(SamplingError::LogitBiasNotFinite { token, bias });
        }
        match self.logprobs {
            Some(requested) if requested > MAX_TOP_LOGPROBS => {
                Err(SamplingError::TooManyTopLogprobs {
                    requested,
                    max: MAX_TOP_LOGPROBS,
                })
            }
            _ => Ok(()),
        }
    }

    /// [`validate`](Self::validate), plus: every `logit_bias` id is below `vocab_size`.
    /// (The sampler itself skips ids past the end of the logits.)
    pub fn validate_for_vocab(&self, vocab_size: usize) -> Result<(), SamplingError> {
        self.validate()?;
        match self
            .logit_bias
            .iter()
            .find(|(token, _)| *token as usize >= vocab_size)
        {
            Some(&(token, _)) => Err(SamplingError::LogitBiasTokenOutOfVocab { token, vocab_size }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(params: SamplingParams) -> Option<&'static str> {
        match params.validate() {
            Err(SamplingError::OutOfRange { field, .. }) => Some(field),
            _ => None,
        }
    }

    #[test]
    fn default_is_greedy_and_valid() {
        let params = SamplingParams::default();
        assert!(params.is_greedy());
        assert_eq!(params.validate(), Ok(()));
        assert_eq!(params.repetition_context_size, 20);
    }

    #[test]
    fn each_bound_names_its_field() {
        let base = SamplingParams::default;
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    temperature: -0.1,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.01,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: -0.01,
                    ..base()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    min_p: 1.5,
                    ..base()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    xtc_probability: 2.0,
                    ..base()
                },
                "xtc_probability",
            ),
            (
                SamplingParams {
                    xtc_threshold: 0.6,
                    ..base()
                },
                "xtc_threshold",
            ),
            (
                SamplingParams {
                    repetition_penalty: -1.0,
                    ..base()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: f32::NAN,
                    ..base()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: f32::NEG_INFINITY,
                    ..base()
                },
                "frequency_penalty",
            ),
        ];
        for (params, field) in cases {
            assert_eq!(field_of(params), Some(field));
        }
        let bound_ok = SamplingParams {
            temperature: 2.0,
            top_p: 1.0,
            min_p: 1.0,
            xtc_probability: 1.0,
            xtc_threshold: 0.5,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            logprobs: Some(MAX_TOP_LOGPROBS),
            ..base()
        };
        assert_eq!(bound_ok.validate(), Ok(()));
    }

    #[test]
    fn logprobs_and_logit_bias_limits() {
        let params = SamplingParams {
            logprobs: Some(21),
            ..SamplingParams::default()
        };
        assert_eq!(
            params.validate(),
            Err(SamplingError::TooManyTopLogprobs {
                requested: 21,
                max: 20
            })
        );
        let params = SamplingParams {
            logit_bias: vec![(3, 1.0), (7, f32::INFINITY)],
            ..SamplingParams::default()
        };
        assert!(matches!(
            params.validate(),
            Err(SamplingError::LogitBiasNotFinite { token: 7, .. })
        ));
        let params = SamplingParams {
            logit_bias: vec![(3, 1.0), (10, -100.0)],
            ..SamplingParams::default()
        };
        assert_eq!(params.validate_for_vocab(11), Ok(()));
        assert_eq!(
            params.validate_for_vocab(10),
            Err(SamplingError::LogitBiasTokenOutOfVocab {
                token: 10,
                vocab_size: 10
            })
        );
        let message = params.validate_for_vocab(10).unwrap_err().to_string();
        assert!(message.contains("token 10"), "{message}");
    }
}
