//! File targets: GGUF models, safetensors headers, Hugging Face JSON configs, SSD cache
//! entries. Each input is written to a scratch file and opened the way wick opens it.
use std::path::{Path, PathBuf};

use serde_json::json;
use wick_cache::ssd::format;
use wick_cache::{KvSnapshot, LayerSnapshot, SsdConfig};
use wick_chat::tokenizer::Tokenizer;
use wick_engine::{LoadOptions, Model};
use wick_gguf::{GgmlType, GgufFile, GgufWriter, MetadataValue as V};

use crate::Target;

const HIDDEN: usize = 16;
const FFN: usize = 32;

/// A GPT-2 style byte-level vocabulary: three control tokens, then the 256 byte symbols.
fn vocab() -> Vec<String> {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut n = 0u32;
    for b in 0u32..256 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            char::from_u32(b)
        } else {
            n += 1;
            char::from_u32(255 + n)
        };
        tokens.push(c.unwrap_or('?').to_string());
    }
    tokens
}

fn floats(n: usize, seed: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| ((((i * 31 + seed * 7) % 97) as f32 / 970.0) - 0.05).to_le_bytes())
        .collect()
}

/// A one-layer llama GGUF with a byte-level tokenizer and a ChatML template.
fn tiny_gguf() -> Vec<u8> {
    let tokens = vocab();
    let vocab_len = tokens.len();
    let mut types = vec![V::I32(3); 3];
    types.extend(std::iter::repeat_n(V::I32(1), 256));
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", V::String("llama".into()))
        .metadata("llama.block_count", V::U32(1))
        .metadata("llama.context_length", V::U32(128))
        .metadata("llama.embedding_length", V::U32(HIDDEN as u32))
        .metadata("llama.feed_forward_length", V::U32(FFN as u32))
        .metadata("llama.attention.head_count", V::U32(2))
        .metadata("llama.attention.head_count_kv", V::U32(1))
        .metadata("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5))
        .metadata("llama.rope.freq_base", V::F32(10000.0))
        .metadata("tokenizer.ggml.model", V::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", V::String("gpt-2".into()))
        .metadata(
            "tokenizer.ggml.tokens",
            V::Array(tokens.into_iter().map(V::String).collect()),
        )
        .metadata("tokenizer.ggml.token_type", V::Array(types))
        .metadata(
            "tokenizer.ggml.merges",
            V::Array(vec![V::String("h e".into())]),
        )
        .metadata("tokenizer.ggml.bos_token_id", V::U32(1))
        .metadata("tokenizer.ggml.eos_token_id", V::U32(2))
        .metadata(
            "tokenizer.chat_template",
            V::String(
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n".into(),
            ),
        );
    let (h, ff, kv) = (HIDDEN as u64, FFN as u64, HIDDEN as u64 / 2);
    let mut seed = 0;
    let mut tensor = |name: &str, dims: Vec<u64>| {
        let n = dims.iter().product::<u64>() as usize;
        seed += 1;
        w.tensor(name, dims, GgmlType::F32, floats(n, seed));
    };
    tensor("token_embd.weight", vec![h, vocab_len as u64]);
    tensor("output_norm.weight", vec![h]);
    tensor("blk.0.attn_norm.weight", vec![h]);
    tensor("blk.0.ffn_norm.weight", vec![h]);
    tensor("blk.0.attn_q.weight", vec![h, h]);
    tensor("blk.0.attn_k.weight", vec![h, kv]);
    tensor("blk.0.attn_v.weight", vec![h, kv]);
    tensor("blk.0.attn_output.weight", vec![h, h]);
    tensor("blk.0.ffn_gate.weight", vec![h, ff]);
    tensor("blk.0.ffn_up.weight", vec![h, ff]);
    tensor("blk.0.ffn_down.weight", vec![ff, h]);
    w.to_bytes()
}

/// Loads a model and runs one greedy step when it loads: a model that loads must work.
fn load_and_run(path: &Path) -> bool {
    let Ok(model) = Model::load(path, &LoadOptions::default()) else {
        return false;
    };
    if let Ok(ids) = model.tokenize("hi <|im_start|>") {
        if !ids.is_empty() && ids.len() < 64 {
            let _ = model.generate_greedy(&[ids], 2, 64);
        }
    }
    true
}

/// GGUF files: header, metadata, tensor directory, tokenizer and model configuration.
pub fn gguf() -> anyhow::Result<Target> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("fuzz.gguf");
    let dict: Vec<Vec<u8>> = [
        &b"GGUF"[..],
        b"llama.block_count",
        b"tokenizer.ggml.tokens",
        b"general.alignment",
        b"<|im_start|>",
        &u64::MAX.to_le_bytes(),
        &0xFFFF_FFFFu32.to_le_bytes(),
        &f32::NAN.to_le_bytes(),
        &f32::INFINITY.to_le_bytes(),
        &(-1.0f32).to_le_bytes(),
    ]
    .iter()
    .map(|f| f.to_vec())
    .collect();
    Ok(Target {
        name: "gguf",
        seeds: vec![tiny_gguf()],
        dict,
        run: Box::new(move |input| {
            let _keep = &dir;
            if std::fs::write(&path, input).is_err() {
                return false;
            }
            let Ok(file) = GgufFile::open(&path) else {
                return false;
            };
            if let Ok(tok) = Tokenizer::from_gguf(&file) {
                if let Ok(ids) = tok.encode("Hello <|im_start|>user\n wörld", true) {
                    let _ = tok.decode(&ids, false);
                }
            }
            drop(file);
            load_and_run(&path)
        }),
    })
}

/// The tiny model as a Hugging Face directory: config.json, tokenizer.json, safetensors.
fn hf_files() -> anyhow::Result<(Vec<u8>, Vec<u8>, Vec<u8>)> {
    let dir = tempfile::tempdir()?;
    let gguf_path = dir.path().join("m.gguf");
    std::fs::write(&gguf_path, tiny_gguf())?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(&gguf_path)?)?;
    let tok_path = dir.path().join("tokenizer.json");
    tok.inner()
        .save(&tok_path, false)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let tokenizer = std::fs::read(&tok_path)?;
    let config = serde_json::to_vec_pretty(&json!({
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": tok.vocab_size(), "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": true, "max_position_embeddings": 128
    }))?;
    let (h, ff, kv, v) = (HIDDEN, FFN, HIDDEN / 2, tok.vocab_size());
    let shapes: Vec<(&str, Vec<usize>)> = vec![
        ("model.embed_tokens.weight", vec![v, h]),
        ("model.norm.weight", vec![h]),
        ("model.layers.0.input_layernorm.weight", vec![h]),
        ("model.layers.0.post_attention_layernorm.weight", vec![h]),
        ("model.layers.0.self_attn.q_proj.weight", vec![h, h]),
        ("model.layers.0.self_attn.k_proj.weight", vec![kv, h]),
        ("model.layers.0.self_attn.v_proj.weight", vec![kv, h]),
        ("model.layers.0.self_attn.o_proj.weight", vec![h, h]),
        ("model.layers.0.mlp.gate_proj.weight", vec![ff, h]),
        ("model.layers.0.mlp.up_proj.weight", vec![ff, h]),
        ("model.layers.0.mlp.down_proj.weight", vec![h, ff]),
    ];
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (i, (name, shape)) in shapes.iter().enumerate() {
        let n: usize = shape.iter().product();
        let start = data.len();
        data.extend(floats(n, i));
        header.insert(
            name.to_string(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::to_vec(&header)?;
    let mut st = (header.len() as u64).to_le_bytes().to_vec();
    st.extend_from_slice(&header);
    st.extend_from_slice(&data);
    Ok((config, tokenizer, st))
}

fn write_hf_dir(
    dir: &Path,
    config: &[u8],
    tokenizer: &[u8],
    st: &[u8],
    gen: Option<&[u8]>,
) -> bool {
    let ok = std::fs::write(dir.join("config.json"), config).is_ok()
        && std::fs::write(dir.join("tokenizer.json"), tokenizer).is_ok()
        && std::fs::write(dir.join("model.safetensors"), st).is_ok();
    match gen {
        Some(g) => ok && std::fs::write(dir.join("generation_config.json"), g).is_ok(),
        None => ok && remove_if_present(&dir.join("generation_config.json")),
    }
}

fn remove_if_present(path: &Path) -> bool {
    match std::fs::remove_file(path) {
        Ok(()) => true,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

const JSON_DICT: &[&str] = &[
    "\"F32\"",
    "\"BF16\"",
    "\"F16\"",
    "\"U32\"",
    "\"shape\"",
    "\"data_offsets\"",
    "[0, 0]",
    "18446744073709551615",
    "4294967295",
    "2147483648",
    "1000000000000",
    "-1",
    "0",
    "1e308",
    "NaN",
    "null",
    "[]",
    "{}",
    "\"x\"",
    "\"__metadata__\"",
    "\"num_hidden_layers\"",
    "\"hidden_act\"",
    "\"relu\"",
    "\"rms_norm_eps\"",
    "\"rope_theta\"",
    "\"temperature\"",
    "\"vocab_size\"",
    "\"added_tokens\"",
    "\"id\"",
    "\"special\": true",
];

fn json_dict() -> Vec<Vec<u8>> {
    JSON_DICT.iter().map(|s| s.as_bytes().to_vec()).collect()
}

/// safetensors files (8-byte length, JSON header, data) of a loadable model directory.
pub fn safetensors() -> anyhow::Result<Target> {
    let (config, tokenizer, st) = hf_files()?;
    let dir = tempfile::tempdir()?;
    let path: PathBuf = dir.path().to_path_buf();
    Ok(Target {
        name: "safetensors",
        seeds: vec![st],
        dict: json_dict(),
        run: Box::new(move |input| {
            let _keep = &dir;
            write_hf_dir(&path, &config, &tokenizer, input, None) && load_and_run(&path)
        }),
    })
}

/// config.json, generation_config.json and tokenizer.json of a Hugging Face directory: the
/// first byte picks the file, the rest replaces it.
pub fn hf_json() -> anyhow::Result<Target> {
    let (config, tokenizer, st) = hf_files()?;
    let gen = br#"{"temperature": 0.7, "top_p": 0.9, "top_k": 20, "eos_token_id": [2]}"#.to_vec();
    let dir = tempfile::tempdir()?;
    let path: PathBuf = dir.path().to_path_buf();
    let with = |which: u8, body: &[u8]| {
        let mut v = vec![which];
        v.extend_from_slice(body);
        v
    };
    Ok(Target {
        name: "hf-json",
        seeds: vec![with(0, &config), with(1, &gen), with(2, &tokenizer)],
        dict: json_dict(),
        run: Box::new(move |input| {
            let _keep = &dir;
            let Some((&which, body)) = input.split_first() else {
                return false;
            };
            let written = match which % 3 {
                0 => write_hf_dir(&path, body, &tokenizer, &st, None),
                1 => write_hf_dir(&path, &config, &tokenizer, &st, Some(body)),
                _ => write_hf_dir(&path, &config, body, &st, None),
            };
            written && load_and_run(&path)
        }),
    })
}

/// SSD cache entries: the header and payload readers directly, and every few inputs a full
/// directory scan (which must never fail on a bad file) plus a restore.
pub fn ssd() -> anyhow::Result<Target> {
    let root = tempfile::tempdir()?;
    let cfg = SsdConfig {
        root: root.path().to_path_buf(),
        fingerprint: "fuzz".into(),
        model: "fuzz".into(),
        max_bytes: 0,
        verify: true,
    };
    let tokens: Vec<u32> = (0..24).collect();
    let layer = |window| LayerSnapshot {
        start: 0,
        len: tokens.len(),
        kv_heads: 1,
        head_dim: 4,
        window,
        keys: (0..tokens.len() * 4).map(|i| i as f32 * 0.5).collect(),
        values: (0..tokens.len() * 4).map(|i| -(i as f32)).collect(),
    };
    let snap = KvSnapshot {
        layers: vec![layer(None), layer(Some(8))],
        recurrent: Vec::new(),
    };
    let entry_path = {
        let (tier, _) = wick_cache::ssd::SsdTier::open(cfg.clone())?;
        tier.store("base", &tokens, &snap, None)?;
        let entries = tier.entries();
        entries
            .first()
            .map(|e| e.path.clone())
            .ok_or_else(|| anyhow::anyhow!("the seed entry was not stored"))?
    };
    let seed = std::fs::read(&entry_path)?;
    let scratch = root.path().join("scratch.wkv");
    let mut count = 0u64;
    Ok(Target {
        name: "ssd",
        seeds: vec![seed],
        dict: vec![b"WKV".to_vec(), b"base".to_vec(), b"fuzz".to_vec()],
        run: Box::new(move |input| {
            let _keep = &root;
            count += 1;
            if std::fs::write(&scratch, input).is_err() {
                return false;
            }
            let accepted = (|| -> anyhow::Result<()> {
                let mut f = std::fs::File::open(&scratch)?;
                let header = format::read_header(&mut f, &scratch)?;
                let snap = format::read_payload(&mut f, &scratch, &header)?;
                snap.validate()?;
                Ok(())
            })();
            if std::env::var_os("WICK_FUZZ_TRACE").is_some() {
                if let Err(e) = &accepted {
                    eprintln!("ssd: {e}");
                }
            }
            let accepted = accepted.is_ok();
            if count.is_multiple_of(16) {
                // The same bytes under the entry's own name, then a scan and a lookup.
                if std::fs::write(&entry_path, input).is_ok() {
                    let opened = wick_cache::ssd::SsdTier::open(cfg.clone());
                    let (tier, _) = opened.expect("a bad cache file must never fail the scan");
                    if let Some(m) = tier.find("base", &tokens) {
                        let _ = tier.load(&m);
                    }
                }
            }
            accepted
        }),
    })
}
