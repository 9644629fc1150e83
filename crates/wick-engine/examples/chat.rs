//! Using wick as a library: load a model, render a chat through its template, stream the
//! reply token by token.
//!
//! ```text
//! cargo run --release -p wick-engine --example chat -- ~/.cache/wick/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf "Why is the sky blue?"
//! ```
use std::io::Write;
use std::ops::ControlFlow;

use serde_json::json;
use wick_engine::sampler::SamplingParams;
use wick_engine::{GenerationRequest, LoadOptions, Model};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: chat MODEL.gguf|MODEL_DIR [QUESTION]")?;
    let question = args
        .next()
        .unwrap_or_else(|| "Write a haiku about candles.".into());

    let model = Model::load(path.as_ref(), &LoadOptions::default())?;
    let messages = [
        json!({"role": "system", "content": "You are a concise assistant."}),
        json!({"role": "user", "content": question}),
    ];
    let prompt = model.render_chat(&messages, None, &Default::default())?;
    let request = GenerationRequest::new(model.tokenize(&prompt)?)
        .max_tokens(200)
        .sampling(SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            seed: 7,
            ..SamplingParams::default()
        });

    let mut out = std::io::stdout().lock();
    let result = model.generate(&request, |token| {
        let _ = out.write_all(token.text.as_bytes());
        let _ = out.flush();
        ControlFlow::Continue(())
    })?;
    println!(
        "\n[{:?}; {} tokens at {:.1} tok/s]",
        result.finish_reason,
        result.usage.completion_tokens,
        result.usage.decode_tps()
    );
    Ok(())
}
