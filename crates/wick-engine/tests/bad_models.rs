//! Missing, truncated, corrupted and unsupported model files give clear errors that name
//! the file and the problem — never a panic.
use std::path::{Path, PathBuf};

use wick_engine::{EngineError, LoadOptions, Model};
use wick_gguf::{GgmlType, GgufWriter, MetadataValue as V};

#[path = "common/safetensors.rs"]
mod safetensors;
#[path = "common/serving.rs"]
mod serving;
use serving::smollm2_path as smollm2;
#[path = "common/gguf.rs"]
mod gguf;
use gguf::{f32_bytes, hyperparameters, tensors};

/// A tiny llama GGUF (one layer, hidden 32, byte-level vocab) with F32 weights.
fn tiny_gguf(
    arch: &str,
    odd_tensor: Option<(&str, GgmlType)>,
    template: Option<&str>,
) -> GgufWriter {
    tiny_gguf_with(arch, odd_tensor, template, &[])
}

/// [`tiny_gguf`] with metadata values replaced (`overrides`: full key, value).
fn tiny_gguf_with(
    arch: &str,
    odd_tensor: Option<(&str, GgmlType)>,
    template: Option<&str>,
    overrides: &[(&str, V)],
) -> GgufWriter {
    let vocab = 256u64 + 3;
    let mut w = GgufWriter::new();
    for (key, value) in overrides {
        w.metadata(*key, value.clone());
    }
    let mut w = Overriding {
        w,
        skip: overrides.iter().map(|(k, _)| k.to_string()).collect(),
    };
    let mut tokens: Vec<V> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| V::String(s.to_string()))
        .collect();
    // GPT-2 byte-level alphabet: printable bytes map to themselves, others to U+0100+.
    let mut n = 0u32;
    for b in 0u32..256 {
        let c = if (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b) {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
        tokens.push(V::String(c.to_string()));
    }
    let mut types = vec![V::I32(3); 3];
    types.extend(std::iter::repeat_n(V::I32(1), 256));
    w.metadata("general.architecture", V::String(arch.into()));
    for (key, value) in hyperparameters(arch, 256) {
        w.metadata(key, value);
    }
    w.metadata("tokenizer.ggml.model", V::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", V::String("gpt-2".into()))
        .metadata("tokenizer.ggml.tokens", V::Array(tokens))
        .metadata("tokenizer.ggml.token_type", V::Array(types))
        .metadata(
            "tokenizer.ggml.merges",
            V::Array(vec![V::String("a b".into())]),
        )
        .metadata("tokenizer.ggml.bos_token_id", V::U32(1))
        .metadata("tokenizer.ggml.eos_token_id", V::U32(2));
    if let Some(t) = template {
        w.metadata("tokenizer.chat_template", V::String(t.into()));
    }
    let mut w = w.w;
    for (name, dims) in tensors(vocab) {
        let n: u64 = dims.iter().product();
        match odd_tensor {
            Some((odd, dtype)) if odd == name => {
                let bytes = dtype.bytes_for(n).unwrap() as usize;
                w.tensor(name, dims, dtype, vec![0u8; bytes]);
            }
            _ => {
                w.tensor(
                    name,
                    dims,
                    GgmlType::F32,
                    f32_bytes(n as usize, name.len() as u32),
                );
            }
        }
    }
    w
}

/// A writer that drops metadata keys already given as overrides.
struct Overriding {
    w: GgufWriter,
    skip: Vec<String>,
}

impl Overriding {
    fn metadata(&mut self, key: impl Into<String>, value: V) -> &mut Self {
        let key = key.into();
        if !self.skip.contains(&key) {
            self.w.metadata(key, value);
        }
        self
    }
}

fn write(dir: &Path, name: &str, w: &GgufWriter) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, w.to_bytes()).unwrap();
    p
}

fn load_err(path: &Path) -> String {
    match Model::load(path, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_tiny_f32_gguf_loads_and_generates() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "tiny.gguf",
        &tiny_gguf(
            "llama",
            None,
            Some("{% for m in messages %}{{ m.content }}{% endfor %}"),
        ),
    );
    let m = Model::load(&p, &LoadOptions::default()).unwrap();
    let ids = m.tokenize("hello").unwrap();
    let mut req = wick_engine::GenerationRequest::new(ids).max_tokens(5);
    req.ignore_eos = true;
    let out = m
        .generate(&req, |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(out.tokens.len(), 5);
}

#[test]
fn missing_file() {
    let e = load_err(Path::new("/nonexistent/model.gguf"));
    assert!(e.contains("/nonexistent/model.gguf"), "{e}");
}

#[test]
fn not_a_gguf_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("notes.gguf");
    std::fs::write(&p, "just some text, not a model").unwrap();
    let e = load_err(&p);
    assert!(
        e.contains("notes.gguf") && e.contains("not a GGUF file"),
        "{e}"
    );
}

#[test]
fn unsupported_architecture_lists_the_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "mamba.gguf", &tiny_gguf("mamba", None, None));
    let e = load_err(&p);
    assert!(
        e.contains("mamba.gguf")
            && e.contains("unsupported architecture 'mamba'")
            && e.contains("qwen3"),
        "{e}"
    );
}

#[test]
fn unsupported_quant_type_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "iq.gguf",
        &tiny_gguf(
            "llama",
            Some(("blk.0.ffn_up.weight", GgmlType::Iq4Nl)),
            None,
        ),
    );
    let e = load_err(&p);
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("IQ4_NL"),
        "{e}"
    );
}

#[test]
fn a_template_that_raises_reports_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let t = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok";
    let p = write(dir.path(), "t.gguf", &tiny_gguf("llama", None, Some(t)));
    let m = Model::load(&p, &LoadOptions::default()).unwrap();
    let e = m
        .render_chat(
            &[serde_json::json!({"role": "system", "content": "x"})],
            None,
            &Default::default(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("System role not supported"), "{e}");
    let none = write(dir.path(), "none.gguf", &tiny_gguf("llama", None, None));
    let m = Model::load(&none, &LoadOptions::default()).unwrap();
    assert!(matches!(
        m.render_chat(&[], None, &Default::default()),
        Err(EngineError::NoChatTemplate(_))
    ));
}

#[test]
fn truncated_real_model_files() {
    let src = std::fs::read(smollm2()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for len in [0, 3, 100, 1 << 20, 5 << 20, src.len() / 2, src.len() - 1] {
        let p = dir.path().join(format!("cut-{len}.gguf"));
        std::fs::write(&p, &src[..len]).unwrap();
        let e = load_err(&p);
        assert!(e.contains(&format!("cut-{len}.gguf")), "{e}");
        assert!(
            e.contains("truncated") || e.contains("not a GGUF") || e.contains("remain"),
            "cut at {len}: {e}"
        );
    }
}

#[test]
fn bit_flipped_headers_never_panic() {
    let mut bytes = std::fs::read(smollm2()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("flipped.gguf");
    // Offsets across the magic, counts, metadata keys/values and the tensor directory.
    let offsets = [
        0usize, 5, 9, 17, 24, 40, 200, 1_000, 10_000, 100_000, 500_000, 1_000_000, 1_600_000,
        1_700_000, 1_750_000,
    ];
    for &at in &offsets {
        for bit in [0u8, 6] {
            bytes[at] ^= 1 << bit;
            std::fs::write(&p, &bytes).unwrap();
            // Either a clean error or a model that loads; never a panic.
            let result =
                std::panic::catch_unwind(|| Model::load(&p, &LoadOptions::default()).map(|_| ()));
            assert!(result.is_ok(), "panic with bit {bit} of byte {at} flipped");
            bytes[at] ^= 1 << bit;
        }
    }
}

#[test]
fn absurd_layer_counts_are_errors_not_aborts() {
    let dir = tempfile::tempdir().unwrap();
    for (name, value) in [
        ("u32max", V::U32(u32::MAX)),
        ("trillion", V::U64(1_000_000_000_000)),
    ] {
        let w = tiny_gguf_with("llama", None, None, &[("llama.block_count", value)]);
        let p = write(dir.path(), &format!("{name}.gguf"), &w);
        let e = load_err(&p);
        assert!(
            e.contains(&format!("{name}.gguf")) && e.contains("llama.block_count"),
            "{e}"
        );
    }
    // A count the tensors do not back: two layers claimed, one held.
    let w = tiny_gguf_with("llama", None, None, &[("llama.block_count", V::U32(2))]);
    let p = write(dir.path(), "two.gguf", &w);
    let e = load_err(&p);
    assert!(
        e.contains("two.gguf") && e.contains("says 2 layers but the weights hold 1"),
        "{e}"
    );
    // A Hugging Face config.json claiming 10^12 layers fails on the config, before any
    // allocation sized by it.
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    std::fs::write(
        hf.join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2,
            "num_hidden_layers": 1000000000000, "vocab_size": 259, "intermediate_size": 64}"#,
    )
    .unwrap();
    let e = load_err(&hf);
    assert!(
        e.contains("config.json") && e.contains("num_hidden_layers"),
        "{e}"
    );
}

#[test]
fn non_finite_or_negative_norm_and_rope_parameters_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let eps = "llama.attention.layer_norm_rms_epsilon";
    let base = "llama.rope.freq_base";
    let cases = [
        ("eps-nan", eps, V::F32(f32::NAN), "epsilon"),
        ("eps-inf", eps, V::F32(f32::INFINITY), "epsilon"),
        ("eps-neg", eps, V::F32(-1e-5), "epsilon"),
        ("base-nan", base, V::F32(f32::NAN), "freq_base"),
        ("base-neg", base, V::F32(-10000.0), "freq_base"),
        ("base-zero", base, V::F32(0.0), "freq_base"),
        ("base-inf", base, V::F64(f64::INFINITY), "freq_base"),
    ];
    for (name, key, value, field) in cases {
        let w = tiny_gguf_with("llama", None, None, &[(key, value)]);
        let p = write(dir.path(), &format!("{name}.gguf"), &w);
        let e = load_err(&p);
        assert!(
            e.contains(&format!("{name}.gguf")) && e.contains(field),
            "{name}: {e}"
        );
    }
}

#[test]
fn unknown_hidden_act_and_bad_hf_numbers_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let config = |extra: &str| {
        format!(
            r#"{{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2,
                "num_hidden_layers": 1, "vocab_size": 259, "intermediate_size": 64{extra}}}"#
        )
    };
    for (name, extra, field) in [
        ("act", r#", "hidden_act": "relu_squared""#, "hidden_act"),
        ("act-type", r#", "hidden_act": 3"#, "hidden_act"),
        ("eps", r#", "rms_norm_eps": -0.5"#, "rms_norm_eps"),
        ("theta", r#", "rope_theta": -1"#, "rope_theta"),
    ] {
        let hf = dir.path().join(name);
        std::fs::create_dir(&hf).unwrap();
        std::fs::write(hf.join("config.json"), config(extra)).unwrap();
        let e = load_err(&hf);
        assert!(
            e.contains("config.json") && e.contains(field),
            "{name}: {e}"
        );
    }
}

/// Every size a config gives is checked at load, not left to fail (or panic) in the first
/// forward pass: a 0 sliding window (which panicked the engine thread), 0 vocabulary,
/// MLP, head or rotary sizes, head counts that do not divide, an odd rotary size, a
/// negative logit multiplier.
#[test]
fn every_size_of_a_config_is_checked_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let llama = |extra: &str| {
        format!(
            r#"{{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2,
                "num_hidden_layers": 1, "vocab_size": 259, "intermediate_size": 64{extra}}}"#
        )
    };
    let cases = [
        (
            "vocab",
            llama(r#", "vocab_size": 0"#),
            "vocabulary size is 0",
        ),
        (
            "mlp",
            llama(r#", "intermediate_size": 0"#),
            "intermediate (MLP) size is 0",
        ),
        (
            "heads",
            llama(r#", "num_attention_heads": 0"#),
            "head count is 0",
        ),
        (
            "head-dim",
            llama(r#", "head_dim": 0"#),
            "head dimension is 0",
        ),
        (
            "kv-heads",
            llama(r#", "num_key_value_heads": 3"#),
            "not a multiple of 3",
        ),
        (
            "kv-zero",
            llama(r#", "num_key_value_heads": 0"#),
            "key/value heads",
        ),
        (
            "rotary-zero",
            llama(r#", "partial_rotary_factor": 0.0"#),
            "rotary dimensions 0",
        ),
        (
            "rotary-odd",
            llama(r#", "head_dim": 16, "partial_rotary_factor": 0.5625"#),
            "rotary dimensions 9",
        ),
        (
            "granite-logits",
            r#"{"model_type": "granite", "hidden_size": 32, "num_attention_heads": 2,
            "num_hidden_layers": 1, "vocab_size": 259, "intermediate_size": 64,
            "logits_scaling": -4.0}"#
                .to_string(),
            "logit multiplier",
        ),
        (
            "gemma3-window",
            r#"{"model_type": "gemma3_text", "hidden_size": 32,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "num_hidden_layers": 2, "vocab_size": 259, "intermediate_size": 64,
            "sliding_window": 0}"#
                .to_string(),
            "sliding window of 0 tokens",
        ),
    ];
    for (name, config, want) in cases {
        let hf = dir.path().join(name);
        std::fs::create_dir(&hf).unwrap();
        std::fs::write(hf.join("config.json"), config).unwrap();
        let e = load_err(&hf);
        assert!(e.contains("config.json") && e.contains(want), "{name}: {e}");
    }
    // The same sizes in GGUF metadata.
    for (name, arch, key, value, want) in [
        (
            "rope-dims",
            "llama",
            "llama.rope.dimension_count",
            V::U32(0),
            "rotary dimensions 0",
        ),
        (
            "window",
            "gemma3",
            "gemma3.attention.sliding_window",
            V::U32(0),
            "sliding window of 0",
        ),
        (
            "ffn",
            "llama",
            "llama.feed_forward_length",
            V::U32(0),
            "intermediate (MLP) size is 0",
        ),
        (
            "heads",
            "llama",
            "llama.attention.head_count_kv",
            V::U32(3),
            "not a multiple of 3",
        ),
    ] {
        let w = tiny_gguf_with(arch, None, None, &[(key, value)]);
        let p = write(dir.path(), &format!("{name}.gguf"), &w);
        let e = load_err(&p);
        assert!(
            e.contains(&format!("{name}.gguf")) && e.contains(want),
            "{name}: {e}"
        );
    }
}

/// Loading a model never opens a FIFO (the open would block for good), a device or a
/// directory where a model file belongs: each is refused by name before anything reads.
#[cfg(unix)]
#[test]
fn special_files_in_place_of_model_files_are_refused_without_hanging() {
    use std::sync::mpsc;
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let fifo = |path: &Path| {
        let status = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .unwrap();
        assert!(status.success(), "mkfifo {}", path.display());
    };
    // Each case: the path to load, and what the error must name.
    let mut cases: Vec<(PathBuf, PathBuf, &str)> = Vec::new();
    for file in [
        "model.safetensors",
        "tokenizer.json",
        "config.json",
        "tokenizer_config.json",
    ] {
        let model = safetensors::copy_golden("qwen2", &dir.path().join(format!("fifo-{file}")));
        std::fs::remove_file(model.join(file)).unwrap();
        fifo(&model.join(file));
        cases.push((model.clone(), model.join(file), "is a FIFO"));
    }
    let gguf = dir.path().join("fifo.gguf");
    fifo(&gguf);
    cases.push((gguf.clone(), gguf, "is a FIFO"));
    let model = safetensors::copy_golden("qwen2", &dir.path().join("dir-weights"));
    std::fs::remove_file(model.join("model.safetensors")).unwrap();
    std::fs::create_dir(model.join("model.safetensors")).unwrap();
    cases.push((
        model.clone(),
        model.join("model.safetensors"),
        "is a directory",
    ));
    let model = safetensors::copy_golden("qwen2", &dir.path().join("device-weights"));
    std::fs::remove_file(model.join("model.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", model.join("model.safetensors")).unwrap();
    cases.push((
        model.clone(),
        model.join("model.safetensors"),
        "is a device",
    ));
    cases.push((
        PathBuf::from("/dev/null"),
        PathBuf::from("/dev/null"),
        "is a device",
    ));
    for (path, culprit, want) in cases {
        let (tx, rx) = mpsc::channel();
        let load = path.clone();
        std::thread::spawn(move || {
            let _ = tx.send(Model::load(&load, &LoadOptions::default()).map(|_| ()));
        });
        let result = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("loading {} hung", path.display()));
        let e = result.expect_err("a special file loaded").to_string();
        assert!(
            e.contains(&culprit.display().to_string()) && e.contains(want),
            "{}: {e}",
            path.display()
        );
    }
}

/// A Hugging Face model whose config says its head is untied but whose weights have no
/// `lm_head.weight` is refused (it used to run tied: another model); with
/// `tie_word_embeddings: true` the same weights load.
#[test]
fn an_untied_model_without_its_output_head_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = safetensors::copy_golden("qwen2", &dir.path().join("headless"));
    let weights = model.join("model.safetensors");
    let tensors: Vec<_> = safetensors::read(&weights)
        .into_iter()
        .filter(|t| t.name != "lm_head.weight")
        .collect();
    safetensors::write(&weights, &tensors);
    let e = load_err(&model);
    assert!(
        e.contains("no output head") && e.contains("tie_word_embeddings is false"),
        "{e}"
    );
    safetensors::edit_config(&model, |c| c["tie_word_embeddings"] = true.into());
    Model::load(&model, &LoadOptions::default()).unwrap();
}

/// A Qwen-VL image processor config whose `image_std` is zero (or so small that pixels
/// divided by it blow up), or whose `image_mean` is not finite, is refused at load.
#[test]
fn a_preprocessor_that_would_divide_pixels_by_zero_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (name, key, value) in [
        ("zero", "image_std", serde_json::json!([0, 0, 0])),
        ("tiny", "image_std", serde_json::json!([1e-30, 0.26, 0.27])),
        (
            "negative",
            "image_std",
            serde_json::json!([0.26, -0.26, 0.27]),
        ),
        ("mean", "image_mean", serde_json::json!([0.5, 1e39, 0.5])),
    ] {
        let model = safetensors::copy_golden("qwen25_vl", &dir.path().join(name));
        let path = model.join("preprocessor_config.json");
        let mut pre: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        pre[key] = value;
        std::fs::write(&path, pre.to_string()).unwrap();
        let e = load_err(&model);
        assert!(
            e.contains("preprocessor_config.json") && e.contains(key),
            "{name}: {e}"
        );
    }
}
