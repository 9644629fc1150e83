//! `wick bench --concurrency N --url URL`: load on a running server. N clients each
//! stream chat completions of about `--prompt-tokens` prompt and exactly `--gen-tokens`
//! output tokens (`ignore_eos`), all starting together; reported: aggregate output and
//! decode tok/s, time to first token and inter-token latency percentiles.
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use wick_server::sse::SseReader;

/// What one load run is asked to do.
pub struct LoadSpec {
    /// Server base URL (`http://host:port`, with or without `/v1`).
    pub url: String,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Requests each client sends, one after the other.
    pub rounds: usize,
    /// Approximate prompt length in tokens.
    pub prompt_tokens: usize,
    /// Output tokens per request.
    pub gen_tokens: usize,
    /// Sampling temperature.
    pub temperature: f32,
    /// Print JSON.
    pub json: bool,
    /// LoRA adapters the clients use, client `i` the `i % len`-th (`none`: the base
    /// model); empty: requests name no adapter.
    pub adapters: Vec<String>,
}

/// Timings of one streamed request.
#[derive(Debug, Clone)]
struct Stream {
    ttft: Duration,
    /// When each content frame arrived (at least one).
    frames: Vec<Instant>,
    completion_tokens: usize,
    prompt_tokens: usize,
}

impl Stream {
    /// From the first content frame to the last.
    fn decode(&self) -> Duration {
        match (self.frames.first(), self.frames.last()) {
            (Some(first), Some(last)) => *last - *first,
            _ => Duration::ZERO,
        }
    }

    /// The inter-token gaps: between consecutive content frames.
    fn gaps(&self) -> impl Iterator<Item = Duration> + '_ {
        self.frames.windows(2).map(|w| w[1] - w[0])
    }
}

/// `host:port` and the path prefix of a base URL.
fn split_url(url: &str) -> Result<(String, String)> {
    let rest = url
        .strip_prefix("http://")
        .context("--url must start with http:// (https is not supported by the load tool)")?;
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let path = path.trim_end_matches('/');
    let prefix = if path.is_empty() || path == "v1" {
        "/v1".to_string()
    } else {
        format!("/{path}")
    };
    Ok((authority.to_string(), prefix))
}

async fn connect(authority: &str) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
    let stream = tokio::net::TcpStream::connect(authority)
        .await
        .with_context(|| format!("connecting to {authority}"))?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

/// The served model id (`GET /v1/models`).
async fn model_id(authority: &str, prefix: &str) -> Result<String> {
    let mut sender = connect(authority).await?;
    let request = hyper::Request::get(format!("{prefix}/models"))
        .header("host", authority)
        .body(Full::new(Bytes::new()))?;
    let response = sender.send_request(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("GET {prefix}/models: HTTP {status}");
    }
    let v: Value = serde_json::from_slice(&body)?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .context("the server lists no model")
}

/// A prompt of about `tokens` tokens of plain English (one word is about one token).
fn prompt_text(tokens: usize, client: usize) -> String {
    let words = [
        "the", "river", "runs", "past", "an", "old", "mill", "where", "a", "miller", "counts",
        "sacks", "of", "grain", "every", "morning", "before", "sunrise",
    ];
    let mut text = format!("Client {client}. Continue this story:");
    for i in 0..tokens.saturating_sub(8) {
        text.push(' ');
        text.push_str(words[(i * 7 + client) % words.len()]);
    }
    text
}

/// Streams one chat completion and times its content frames.
async fn one_stream(authority: &str, prefix: &str, body: Value) -> Result<Stream> {
    let mut sender = connect(authority).await?;
    let request = hyper::Request::post(format!("{prefix}/chat/completions"))
        .header("host", authority)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let started = Instant::now();
    let response = sender.send_request(request).await?;
    let status = response.status();
    if !status.is_success() {
        let body = response.into_body().collect().await?.to_bytes();
        bail!("HTTP {status}: {}", String::from_utf8_lossy(&body));
    }
    let mut body = response.into_body();
    let mut times = Vec::new();
    let mut usage = (0usize, 0usize);
    let mut reader = SseReader::default();
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        let now = Instant::now();
        for payload in reader.push(data) {
            let v: Value = serde_json::from_str(&payload)?;
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                usage = (
                    u["prompt_tokens"].as_u64().unwrap_or(0) as usize,
                    u["completion_tokens"].as_u64().unwrap_or(0) as usize,
                );
            }
            let text = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
            if !text.is_empty() {
                times.push(now);
            }
        }
    }
    let first = *times.first().context("the stream carried no token")?;
    Ok(Stream {
        ttft: first - started,
        completion_tokens: if usage.1 > 0 { usage.1 } else { times.len() },
        frames: times,
        prompt_tokens: usage.0,
    })
}

/// Tokens per second over the window in which every stream was decoding (from the last
/// stream's first token to the first stream's last token): no prompt of another stream is
/// being prefilled then, so this is the batch's own decode rate. Each content frame counts
/// as the stream's tokens over its frames (one token a frame, unless the server held text
/// back). `None` when the streams never all decoded at once.
fn steady_decode_rate(streams: &[Stream]) -> Option<f64> {
    let from = streams.iter().filter_map(|s| s.frames.first()).max()?;
    let to = streams.iter().filter_map(|s| s.frames.last()).min()?;
    let secs = to.checked_duration_since(*from)?.as_secs_f64();
    if secs <= 0.0 {
        return None;
    }
    let tokens: f64 = streams
        .iter()
        .map(|s| {
            let inside = s.frames.iter().filter(|t| *t > from && *t <= to).count();
            inside as f64 * s.completion_tokens as f64 / s.frames.len().max(1) as f64
        })
        .sum();
    Some(tokens / secs)
}

/// The `p`-th percentile (0–100) of sorted values, nearest rank.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted_ms(values: impl Iterator<Item = Duration>) -> Vec<f64> {
    let mut v: Vec<f64> = values.map(|d| d.as_secs_f64() * 1e3).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Runs the load and prints the report.
pub fn run(spec: LoadSpec) -> Result<()> {
    anyhow::ensure!(spec.concurrency > 0, "--concurrency must be at least 1");
    let (authority, prefix) = split_url(&spec.url)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let model = model_id(&authority, &prefix).await?;
        let started = Instant::now();
        let mut clients = Vec::new();
        for client in 0..spec.concurrency {
            let (authority, prefix, model) = (authority.clone(), prefix.clone(), model.clone());
            let (rounds, gen, temperature) = (spec.rounds, spec.gen_tokens, spec.temperature);
            let prompt = prompt_text(spec.prompt_tokens, client);
            let adapter = (!spec.adapters.is_empty())
                .then(|| spec.adapters[client % spec.adapters.len()].clone());
            clients.push(tokio::spawn(async move {
                let mut streams = Vec::new();
                for _ in 0..rounds.max(1) {
                    let mut body = json!({
                        "model": model,
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": gen,
                        "temperature": temperature,
                        "ignore_eos": true,
                        "stream": true,
                        "stream_options": {"include_usage": true},
                    });
                    if let Some(a) = &adapter {
                        body["adapter"] = json!(a);
                    }
                    streams.push(one_stream(&authority, &prefix, body).await?);
                }
                anyhow::Ok(streams)
            }));
        }
        let mut streams = Vec::new();
        for c in clients {
            streams.extend(c.await??);
        }
        let wall = started.elapsed().as_secs_f64();
        report(&spec, &streams, wall);
        anyhow::Ok(())
    })
}

fn report(spec: &LoadSpec, streams: &[Stream], wall: f64) {
    let output: usize = streams.iter().map(|s| s.completion_tokens).sum();
    let prompt_avg =
        streams.iter().map(|s| s.prompt_tokens).sum::<usize>() as f64 / streams.len() as f64;
    // Each client's decode rate (tokens after the first over the time they took), summed
    // over the clients: the aggregate rate while all streams decode together.
    let per_client: f64 = streams
        .iter()
        .map(|s| {
            let secs = s.decode().as_secs_f64();
            if secs > 0.0 {
                s.completion_tokens.saturating_sub(1) as f64 / secs
            } else {
                0.0
            }
        })
        .sum::<f64>()
        / spec.rounds.max(1) as f64;
    let steady = (spec.rounds == 1)
        .then(|| steady_decode_rate(streams))
        .flatten();
    let ttft = sorted_ms(streams.iter().map(|s| s.ttft));
    let itl = sorted_ms(streams.iter().flat_map(Stream::gaps));
    let p = |v: &[f64]| [50.0, 90.0, 99.0].map(|q| percentile(v, q));
    let (t, i) = (p(&ttft), p(&itl));
    if spec.json {
        println!(
            "{}",
            json!({
                "concurrency": spec.concurrency, "temperature": spec.temperature,
                "requests": streams.len(),
                "prompt_tokens_avg": prompt_avg, "gen_tokens": spec.gen_tokens,
                "wall_seconds": wall, "output_tokens": output,
                "output_tps": output as f64 / wall, "decode_tps": per_client,
                "steady_decode_tps": steady,
                "ttft_ms": {"p50": t[0], "p90": t[1], "p99": t[2]},
                "itl_ms": {"p50": i[0], "p90": i[1], "p99": i[2]},
            })
        );
    } else {
        println!(
            "concurrency {}: {} requests, prompt ~{:.0} tokens, {} output tokens each, {:.1}s",
            spec.concurrency,
            streams.len(),
            prompt_avg,
            spec.gen_tokens,
            wall
        );
        println!(
            "  output {:.1} tok/s | decode {:.1} tok/s (sum of streams){}",
            output as f64 / wall,
            per_client,
            steady
                .map(|r| format!(" | {r:.1} tok/s while all decode"))
                .unwrap_or_default()
        );
        println!(
            "  TTFT ms p50 {:.1} p90 {:.1} p99 {:.1} | ITL ms p50 {:.1} p90 {:.1} p99 {:.1}",
            t[0], t[1], t[2], i[0], i[1], i[2]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_authority_and_api_prefix() {
        assert_eq!(
            split_url("http://127.0.0.1:8080").unwrap(),
            ("127.0.0.1:8080".into(), "/v1".into())
        );
        assert_eq!(
            split_url("http://h:1/v1/").unwrap(),
            ("h:1".into(), "/v1".into())
        );
        assert!(split_url("https://h").is_err());
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0], 90.0), 3.0);
        assert_eq!(percentile(&[], 90.0), 0.0);
    }
}
