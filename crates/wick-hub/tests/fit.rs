//! `wick fit`'s numbers against the engine's own: the KV bytes the engine's configuration
//! and KV pool give for SmolLM2-135M, and the weights its GGUF tensor directory declares.
use wick_engine::backend::candle::KvDtype;
use wick_engine::config::ModelConfig;
use wick_engine::kv_pool::{block_bytes, blocks_for_tokens};
use wick_hub::fit::FitModel;
use wick_hub::{catalog, ModelKind, Store};

#[test]
fn smollm2_kv_and_weights_match_the_engine() {
    let store = Store::from_env().unwrap();
    let Some(path) = store.installed(catalog::item("default").unwrap()) else {
        panic!("SmolLM2 is not pulled: run `wick pull default`");
    };
    let fit = FitModel::read(&path, ModelKind::Gguf).unwrap();
    let gguf = wick_gguf::GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(gguf.metadata(), "smollm2").unwrap();
    // The engine bills f32 KV per token; f16 is half of it.
    let per_token_f16 = cfg.kv_bytes_per_token() / 2;
    assert_eq!(
        fit.kv_bytes(4096, KvDtype::F16),
        (per_token_f16 * 4096) as u64
    );
    assert_eq!(fit.kv_bytes(4096, KvDtype::F16), 94_371_840);
    // What the KV pool charges: blocks of every layer.
    let pool = cfg.num_layers
        * blocks_for_tokens(4096)
        * block_bytes(cfg.num_kv_heads * cfg.head_dim, KvDtype::F16.bytes());
    assert_eq!(fit.kv_bytes(4096, KvDtype::F16), pool as u64);
    let tensors: u64 = gguf.tensors().iter().map(|t| t.len).sum();
    assert_eq!(fit.weights_bytes, tensors);
    assert_eq!(fit.context_length, 8192);
    assert_eq!(fit.quant, "Q4_1");
    assert!(
        fit.params > 130_000_000 && fit.params < 140_000_000,
        "{}",
        fit.params
    );
}
