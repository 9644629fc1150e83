//! Checking a text completion request: the prompt's forms, `echo`, `logprobs`, the fields
//! wick does not support — into a [`ValidCompletion`].
use serde_json::Value;
use wick_engine::sampler::MAX_TOP_LOGPROBS;

use super::structured::{compile, vllm_spec};
use super::{resolve_generation, GenerationContext, ValidGeneration};
use crate::config::BUILTIN_COMPLETION_MAX_TOKENS;
use crate::error::ApiError;
use crate::openai::completions::CompletionRequest;
use crate::state::AppState;

/// The prompt as the client gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Text, tokenized as-is (no chat template).
    Text(String),
    /// Token ids, fed as-is.
    Tokens(Vec<u32>),
}

/// A checked completion request.
#[derive(Debug, Clone)]
pub struct ValidCompletion {
    /// The prompt.
    pub prompt: PromptInput,
    /// Prepend the prompt to the returned text.
    pub echo: bool,
    /// Log-probabilities: `Some(k)` = the token's and `k` alternatives.
    pub logprobs: Option<usize>,
    /// Sampling and limits.
    pub generation: ValidGeneration,
}

/// Checks `req` against the served model and settings.
pub fn validate(mut req: CompletionRequest, state: &AppState) -> Result<ValidCompletion, ApiError> {
    let prompt = prompt_input(req.prompt.as_ref())?;
    let echo = req.echo.unwrap_or(false);
    // `echo` with `max_tokens: 0` scores the prompt without generating (what evaluation
    // harnesses send); without `echo` it would return nothing and stays an error.
    let zero_tokens =
        echo && req.sampling.max_completion_tokens.is_none() && req.sampling.max_tokens == Some(0);
    if zero_tokens {
        req.sampling.max_tokens = Some(1);
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "insertion (suffix) is not supported",
        ));
    }
    match req.best_of {
        None | Some(1) => {}
        Some(n) => {
            return Err(ApiError::unsupported(
                "best_of",
                format!("only best_of = 1 is supported, got {n}"),
            ))
        }
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::field(
                "logprobs",
                format!("must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
            ))
        }
    };
    let model = state.model();
    let mut generation = resolve_generation(
        &req.sampling,
        GenerationContext {
            flags: &state.config().defaults,
            model: model.generation_defaults(),
            builtin_max_tokens: BUILTIN_COMPLETION_MAX_TOKENS,
            logprobs,
            thinking_off: false,
            vocab_size: model.config().vocab_size,
        },
    )?;
    generation.adapters =
        super::adapter::select(state, req.sampling.adapter.as_deref(), req.model.as_deref())?;
    if let Some((param, spec)) = vllm_spec(&req.sampling)? {
        generation.sampling.constraint = Some(compile(model, &param, &spec, false)?);
    }
    if zero_tokens {
        generation.max_tokens = super::MaxTokens::Requested(0);
    }
    if let PromptInput::Tokens(ids) = &prompt {
        check_token_ids(model.config().vocab_size, ids)?;
    }
    Ok(ValidCompletion {
        prompt,
        echo,
        logprobs,
        generation,
    })
}

/// A token-id prompt's ids must be in the model's vocabulary of `vocab` ids (`prompt[i]`
/// names the first that is not).
fn check_token_ids(vocab: usize, ids: &[u32]) -> Result<(), ApiError> {
    match ids.iter().position(|&id| id as usize >= vocab) {
        Some(i) => Err(ApiError::field(
            format!("prompt[{i}]"),
            format!("token id {} is outside the vocabulary ({vocab})", ids[i]),
        )),
        None => Ok(()),
    }
}

/// `"text"`, `[1, 2, 3]`, `["text"]` or `[[1, 2, 3]]`; several prompts are refused.
fn prompt_input(prompt: Option<&Value>) -> Result<PromptInput, ApiError> {
    let bad = || {
        ApiError::field(
            "prompt",
            "must be a string, an array of token ids, or a one-element array of either",
        )
    };
    let input = match prompt {
        None | Some(Value::Null) => {
            return Err(ApiError::Missing {
                param: "prompt".into(),
            })
        }
        Some(Value::String(s)) => PromptInput::Text(s.clone()),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::Missing {
                param: "prompt".into(),
            })
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            PromptInput::Tokens(token_ids(items)?)
        }
        Some(Value::Array(items)) if items.len() > 1 => {
            return Err(ApiError::unsupported(
                "prompt",
                format!(
                    "one prompt per request is supported, got {}; send them separately",
                    items.len()
                ),
            ))
        }
        Some(Value::Array(items)) => match &items[0] {
            Value::String(s) => PromptInput::Text(s.clone()),
            Value::Array(ids) if ids.iter().all(Value::is_number) => {
                PromptInput::Tokens(token_ids(ids)?)
            }
            _ => return Err(bad()),
        },
        Some(_) => return Err(bad()),
    };
    match &input {
        PromptInput::Text(s) if s.is_empty() => Err(ApiError::Missing {
            param: "prompt".into(),
        }),
        PromptInput::Tokens(ids) if ids.is_empty() => Err(ApiError::Missing {
            param: "prompt".into(),
        }),
        _ => Ok(input),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    ApiError::field(
                        format!("prompt[{i}]"),
                        format!("token ids are non-negative integers, got {v}"),
                    )
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_forms() {
        assert_eq!(
            prompt_input(Some(&json!("hi"))),
            Ok(PromptInput::Text("hi".into()))
        );
        assert_eq!(
            prompt_input(Some(&json!([1, 2]))),
            Ok(PromptInput::Tokens(vec![1, 2]))
        );
        assert_eq!(
            prompt_input(Some(&json!(["hi"]))),
            Ok(PromptInput::Text("hi".into()))
        );
        assert_eq!(
            prompt_input(Some(&json!([[3]]))),
            Ok(PromptInput::Tokens(vec![3]))
        );
        for bad in [
            json!(""),
            json!([]),
            json!(null),
            json!(["a", "b"]),
            json!([1, -2]),
            json!([1.5]),
            json!(42),
            json!({"a": 1}),
        ] {
            let e = prompt_input(Some(&bad)).unwrap_err();
            assert!(e.status().is_client_error(), "{bad}");
            assert!(e.param().is_some_and(|p| p.starts_with("prompt")), "{bad}");
        }
    }
}
