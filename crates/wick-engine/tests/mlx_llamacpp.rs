//! The MLX backend (on MLX's CPU device) on the real GGUF models: greedy tokens against
//! llama.cpp's goldens (the acceptance of tests/llamacpp_reference.rs) and logits against
//! the candle backend on the same file. Needs `--features mlx` and `wick pull` of the
//! models. MLX runs GGUF in f32 with the Q4/Q5/Q8 blocks re-laid out losslessly as MLX
//! affine groups, so its logits are the exact dequantized product; candle and llama.cpp
//! quantize activations to 8 bits inside their dot products, which moves logits by
//! ~0.05–0.3 on these small models (hence the near-tie allowance).
#![cfg(feature = "mlx")]
mod common;

use common::llamacpp::LlamaCppGolden;
use common::logits::{argmax, pass};
use wick_engine::backend::candle::CandleBackend;
use wick_engine::backend::mlx::{Dtype, MlxBackend, MlxDevice};
use wick_engine::backend::Backend;
use wick_engine::models::decoder::{BatchItem, Decoder, Input, LogitsRequest, RowOutput, Want};

/// llama.cpp margin below which a different kernel may pick the other token.
const NEAR_TIE: f64 = 0.25;
/// MLX's own margin (exact dequantized products) below which its pick is a tie that
/// llama.cpp's 8-bit activations may have resolved the other way.
const OWN_TIE: f32 = 0.1;

/// Logits of every position of `tokens`.
fn all_logits<B: Backend>(d: &Decoder<B>, tokens: &[u32]) -> wick_engine::Logits {
    pass(d, tokens, &mut d.new_cache(), LogitsRequest::All).unwrap()
}

fn check(name: &str, cases: usize) {
    let g = LlamaCppGolden::open(name);
    let mlx = g.decoder(MlxBackend::new(MlxDevice::Cpu, Dtype::F32).unwrap());
    let candle = g.decoder(CandleBackend::cpu());
    let (mut agree, mut total, mut long_runs) = (0usize, 0usize, 0usize);
    let (mut diff2, mut norm2) = (0f64, 0f64);
    let mut worst_top5 = 0f32;
    let mut report = Vec::new();
    for case in g.cases.iter().take(cases) {
        let (case_name, prompt, continuation, gaps) =
            (&case.name, &case.prompt, &case.continuation, &case.gaps);
        // Teacher forced against llama.cpp, and every logit against candle.
        let mut all = prompt.clone();
        all.extend_from_slice(&continuation[..continuation.len() - 1]);
        let ours = all_logits(&mlx, &all);
        let theirs = all_logits(&candle, &all);
        for (a, b) in ours.data.iter().zip(&theirs.data) {
            diff2 += ((a - b) as f64).powi(2);
            norm2 += (*b as f64).powi(2);
        }
        // The first step's top logits are close to llama.cpp's.
        let first = ours.row(prompt.len() - 1);
        for &(id, v) in case.top20.iter().take(5) {
            worst_top5 = worst_top5.max((first[id as usize] - v).abs());
        }
        for (i, &want) in continuation.iter().enumerate() {
            total += 1;
            let got = argmax(ours.row(prompt.len() - 1 + i));
            if got == want {
                agree += 1;
            } else {
                // A near tie on either side: llama.cpp's margin, or MLX's own (exact
                // products) — 8-bit activations can widen a 0.03 tie to ~0.3 (gemma-3-270m).
                let row = ours.row(prompt.len() - 1 + i);
                let own = row[got as usize] - row[want as usize];
                assert!(
                    gaps[i] < NEAR_TIE || own < OWN_TIE,
                    "{name}/{case_name} teacher-forced step {i}: chose {got} by {own}, llama.cpp {want} with a clear margin {}",
                    gaps[i]
                );
            }
        }
        // Free running through the pipelined greedy path (argmax on the backend).
        let mut cache = mlx.new_cache();
        let first = match mlx
            .execute(&mut [BatchItem::new(prompt, &mut cache, Want::Token)], None)
            .unwrap()
            .remove(0)
        {
            RowOutput::Token(id) => id,
            other => panic!("no token: {other:?}"),
        };
        let mut current = None;
        let mut same = 0;
        for &want in continuation {
            let id = match &current {
                None => first,
                Some(ids) => mlx.backend().ids_to_host(ids).unwrap()[0],
            };
            if id != want {
                // Every token so far was llama.cpp's, so the teacher-forced row of this
                // position holds MLX's own margin.
                let row = ours.row(prompt.len() - 1 + same);
                let own = row[id as usize] - row[want as usize];
                assert!(
                    gaps[same] < NEAR_TIE || own < OWN_TIE,
                    "{name}/{case_name} free-running step {same}: chose {id} by {own}, llama.cpp {want} with a clear margin {}",
                    gaps[same]
                );
                break;
            }
            same += 1;
            let input = match &current {
                None => Input::Host(std::slice::from_ref(&first)),
                Some(ids) => Input::Backend(ids),
            };
            current = Some(mlx.decode_ids(input, &mut [&mut cache]).unwrap());
        }
        long_runs += usize::from(same >= 16 || same == continuation.len());
        report.push(format!("{case_name}: {same}/{}", continuation.len()));
    }
    let rate = agree as f64 / total as f64;
    let rel = (diff2 / norm2).sqrt();
    eprintln!(
        "{name} on MLX (cpu, f32): teacher-forced {agree}/{total} ({:.1}%), free-running {}; \
         ‖logits − candle‖/‖candle‖ {rel:.4}, first-step top-5 vs llama.cpp within {worst_top5:.3}",
        rate * 100.0,
        report.join(", ")
    );
    assert!(
        rate >= 0.97,
        "{name}: teacher-forced agreement {:.1}%",
        rate * 100.0
    );
    let n = report.len();
    assert!(
        long_runs * 8 >= n * 5,
        "{name}: only {long_runs}/{n} prompts kept ≥ 16 greedy tokens: {}",
        report.join(", ")
    );
    assert!(
        rel < 0.05,
        "{name}: MLX logits are {rel:.4} (relative) from candle's"
    );
    assert!(
        worst_top5 < 1.0,
        "{name}: first-step top-5 logits differ from llama.cpp's by up to {worst_top5}"
    );
}

#[test]
fn smollm2_on_mlx_matches_llama_cpp_and_candle() {
    check("smollm2-135m-instruct", 8);
}

#[test]
fn qwen2_5_coder_on_mlx_matches_llama_cpp_and_candle() {
    check("qwen2.5-coder-0.5b-instruct", 4);
}

#[test]
fn gemma3_on_mlx_matches_llama_cpp_and_candle() {
    check("gemma-3-270m", 4);
}
