//! The fuzz target run as a plain test: a bounded number of inputs mutated from the corpus and
//! from markup fragments go through `fuzz_one` (no panic, no hang, streaming agrees with
//! parsing). `WICK_FUZZ_ITERS` sets the number of inputs (default 4000) and `WICK_FUZZ_SEED`
//! the random seed; the same checks run
//! unbounded under `cargo fuzz run tool_call` in `crates/wick-chat/fuzz`.

mod support;

use support::check::Rng;
use support::fuzz_input::fuzz_one;

const FRAGMENTS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "<parameter=",
    "</parameter>",
    "</function>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<function name=\"",
    "<param name=\"",
    "</param>",
    "<![CDATA[",
    "]]>",
    "<|tool_call>",
    "<tool_call|>",
    "call:",
    "<|\"|>",
    "<|channel>",
    "<channel|>",
    "thought\n",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|python_tag|>",
    "```json\n",
    "```",
    "{",
    "}",
    "[",
    "]",
    "\"",
    "'",
    ",",
    ":",
    ";",
    "\\",
    "\n",
    " ",
    "True",
    "null",
    "é",
    "🌧",
    "get_weather",
    "search",
    "\"name\"",
    "\"arguments\"",
    "\"parameters\"",
];

fn corpus_texts() -> Vec<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/tool_calls");
    let mut texts = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("corpus directory") {
        let path = entry.expect("entry").path();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        for case in json["cases"].as_array().expect("cases") {
            texts.push(case["text"].as_str().expect("text").to_string());
        }
    }
    texts
}

fn boundary(text: &str, rng: &mut Rng) -> usize {
    let mut at = rng.below(text.len() + 1);
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn mutate(seeds: &[String], rng: &mut Rng) -> String {
    let mut text = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(4) {
        match rng.below(5) {
            0 => {
                let a = boundary(&text, rng);
                let b = boundary(&text, rng);
                text.replace_range(a.min(b)..a.max(b), "");
            }
            1 => {
                let at = boundary(&text, rng);
                text.insert_str(at, FRAGMENTS[rng.below(FRAGMENTS.len())]);
            }
            2 => {
                let a = boundary(&text, rng);
                let b = boundary(&text, rng);
                let piece = text[a.min(b)..a.max(b)].to_string();
                let at = boundary(&text, rng);
                text.insert_str(at, &piece);
            }
            3 => {
                let other = &seeds[rng.below(seeds.len())];
                let cut = boundary(other, rng);
                let at = boundary(&text, rng);
                text = format!("{}{}", &text[..at], &other[cut..]);
            }
            _ => {
                let at = boundary(&text, rng);
                let c = char::from_u32(rng.below(0x80) as u32).unwrap_or('x');
                text.insert(at, c);
            }
        }
    }
    text
}

#[test]
fn mutated_inputs_never_break_the_parser() {
    let iterations: usize = std::env::var("WICK_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000);
    let mut seeds = corpus_texts();
    seeds.extend(FRAGMENTS.iter().map(|f| f.to_string()));
    let seed = std::env::var("WICK_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5EED);
    let mut rng = Rng::new(seed);
    for _ in 0..iterations {
        let text = mutate(&seeds, &mut rng);
        let selector = rng.below(256) as u8;
        let mut data = vec![selector];
        data.extend_from_slice(text.as_bytes());
        fuzz_one(&data);
    }
}

#[test]
fn random_bytes_never_break_the_parser() {
    let mut rng = Rng::new(42);
    for _ in 0..2000 {
        let len = rng.below(64);
        let data: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
        fuzz_one(&data);
    }
}
