//! Server overhead: decode speed and time to first token over HTTP (SSE, a real socket)
//! against the same engine called directly, in one process and one run.
//!
//! `cargo bench -p wick-server --bench server_overhead [-- TOKENS RUNS]`
//! (default 256 tokens, 5 runs of each, interleaved: direct, HTTP, direct, HTTP …). Uses the
//! default model under `$WICK_HOME` (`wick pull smollm2-135m-instruct`), or the `.gguf` file or
//! model directory named by `WICK_BENCH_MODEL`.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent, EngineHandle};
use wick_engine::{GenerationRequest, LoadOptions, Model};
use wick_server::sse::SseReader;
use wick_server::{AppState, ServerConfig};

const PROMPT: &str = "Write a detailed story about a lighthouse keeper.";

/// One run's timings.
#[derive(Debug, Clone, Copy)]
struct Run {
    ttft: Duration,
    decode_tps: f64,
}

fn model_path() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("WICK_BENCH_MODEL") {
        return Ok(PathBuf::from(path));
    }
    let home = std::env::var_os("WICK_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/wick")))
        .context("no HOME")?;
    let path = home.join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        bail!(
            "{} missing: run `wick pull smollm2-135m-instruct`",
            path.display()
        );
    }
    Ok(path)
}

async fn direct(engine: &EngineHandle, prompt: &[u32], tokens: usize) -> Result<Run> {
    let mut request = GenerationRequest::new(prompt.to_vec()).max_tokens(tokens);
    request.ignore_eos = true;
    let started = Instant::now();
    let mut handle = engine.submit(request)?;
    let mut first = None;
    let mut last = started;
    let mut n = 0;
    while let Some(event) = handle.next().await {
        match event {
            EngineEvent::Token(_) => {
                let now = Instant::now();
                first.get_or_insert(now);
                last = now;
                n += 1;
            }
            EngineEvent::Done(_) => break,
            EngineEvent::Failed(e) => bail!("generation failed: {e}"),
        }
    }
    let first = first.context("no token")?;
    Ok(Run {
        ttft: first - started,
        decode_tps: (n - 1) as f64 / (last - first).as_secs_f64(),
    })
}

/// Streams one request over HTTP/1.1 and times the SSE frames that carry tokens.
async fn over_http(addr: std::net::SocketAddr, path: &str, body: Value) -> Result<Run> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let request = hyper::Request::post(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let started = Instant::now();
    let response = sender.send_request(request).await?;
    if !response.status().is_success() {
        bail!("HTTP {}", response.status());
    }
    let mut body = response.into_body();
    let mut first = None;
    let mut last = started;
    let mut tokens = 0usize;
    let mut reader = SseReader::default();
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        let now = Instant::now();
        for payload in reader.push(data) {
            let v: Value = serde_json::from_str(&payload)?;
            let choice = &v["choices"][0];
            // OpenAI completions / chat, Anthropic `text_delta`, Responses `output_text.delta`.
            let text = choice["text"]
                .as_str()
                .or_else(|| choice["delta"]["content"].as_str())
                .or_else(|| v["delta"]["text"].as_str())
                .or_else(|| v["delta"].as_str())
                .unwrap_or("");
            if !text.is_empty() {
                first.get_or_insert(now);
                last = now;
                tokens += 1;
            }
        }
    }
    let first = first.context("no token frame")?;
    Ok(Run {
        ttft: first - started,
        decode_tps: (tokens - 1) as f64 / (last - first).as_secs_f64(),
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

/// Medians over run pairs of the decode-speed ratio and the TTFT difference (ms).
fn paired(direct: &[Run], http: &[Run]) -> (f64, f64) {
    let ratio = median(
        direct
            .iter()
            .zip(http)
            .map(|(d, h)| h.decode_tps / d.decode_tps)
            .collect(),
    );
    let added = median(
        direct
            .iter()
            .zip(http)
            .map(|(d, h)| (h.ttft.as_secs_f64() - d.ttft.as_secs_f64()) * 1e3)
            .collect(),
    );
    (ratio, added)
}

fn summary(name: &str, runs: &[Run]) -> (f64, f64) {
    let ttft = median(runs.iter().map(|r| r.ttft.as_secs_f64() * 1e3).collect());
    let tps = median(runs.iter().map(|r| r.decode_tps).collect());
    println!(
        "{name:<28} TTFT {ttft:8.2} ms   decode {tps:7.1} tok/s   (median of {})",
        runs.len()
    );
    (ttft, tps)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let tokens: usize = args.first().map(|s| s.parse()).transpose()?.unwrap_or(256);
    let runs: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(5);
    let path = model_path()?;
    let model = Arc::new(Model::load(&path, &LoadOptions::default())?);
    let chat_prompt = model.render_chat(
        &[json!({"role": "user", "content": PROMPT})],
        None,
        &Default::default(),
    )?;
    let chat_ids = model.tokenize(&chat_prompt)?;
    let raw_ids = model.tokenize(PROMPT)?;
    let engine = Engine::start(model, EngineConfig::default())?;
    let state = AppState::new(engine.clone(), ServerConfig::new("bench"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(wick_server::serve(listener, state, async move {
            let _ = stop_rx.await;
        }));
        let raw_body = json!({"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": true,
                              "temperature": 0, "stream": true});
        let chat_body = json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                               "ignore_eos": true, "temperature": 0, "stream": true});
        // Warm up both paths once.
        direct(&engine, &raw_ids, 8).await?;
        over_http(
            addr,
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 8, "ignore_eos": true, "stream": true}),
        )
        .await?;
        let messages_body = json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                                   "ignore_eos": true, "temperature": 0, "stream": true});
        let responses_body = json!({"input": PROMPT, "max_output_tokens": tokens, "store": false,
                                    "ignore_eos": true, "temperature": 0, "stream": true});
        let (mut d_raw, mut h_raw, mut d_chat, mut h_chat) = (vec![], vec![], vec![], vec![]);
        let (mut h_messages, mut h_responses) = (vec![], vec![]);
        for _ in 0..runs {
            d_raw.push(direct(&engine, &raw_ids, tokens).await?);
            h_raw.push(over_http(addr, "/v1/completions", raw_body.clone()).await?);
            d_chat.push(direct(&engine, &chat_ids, tokens).await?);
            h_chat.push(over_http(addr, "/v1/chat/completions", chat_body.clone()).await?);
            h_messages.push(over_http(addr, "/v1/messages", messages_body.clone()).await?);
            h_responses.push(over_http(addr, "/v1/responses", responses_body.clone()).await?);
        }
        println!("{tokens} tokens per run, greedy, ignore_eos, one request at a time");
        let (dt, dr) = summary("engine direct (raw prompt)", &d_raw);
        let (ht, hr) = summary("HTTP /v1/completions", &h_raw);
        let (ct, cr) = summary("engine direct (chat prompt)", &d_chat);
        let (hct, hcr) = summary("HTTP /v1/chat/completions", &h_chat);
        println!("medians      completions: decode ratio {:.3}, TTFT added {:+.2} ms", hr / dr, ht - dt);
        println!("medians      chat:        decode ratio {:.3}, TTFT added {:+.2} ms", hcr / cr, hct - ct);
        // Adjacent runs share the machine's load best: compare them pair by pair.
        let (ratio, added) = paired(&d_raw, &h_raw);
        println!("paired runs  completions: decode ratio {ratio:.3}, TTFT added {added:+.2} ms");
        let (ratio, added) = paired(&d_chat, &h_chat);
        println!("paired runs  chat:        decode ratio {ratio:.3}, TTFT added {added:+.2} ms");
        // Per streamed token, each agent protocol against chat completions (same prompt).
        let per_token = |runs: &[Run]| 1000.0 / median(runs.iter().map(|r| r.decode_tps).collect());
        let chat_ms = per_token(&h_chat);
        summary("HTTP /v1/messages", &h_messages);
        summary("HTTP /v1/responses", &h_responses);
        println!(
            "per token vs chat: messages {:+.4} ms, responses {:+.4} ms",
            per_token(&h_messages) - chat_ms,
            per_token(&h_responses) - chat_ms
        );
        let _ = stop_tx.send(());
        server.await??;
        anyhow::Ok(())
    })
}
