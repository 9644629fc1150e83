//! `POST /api/finetune/merge` and `/api/finetune/export` on the tiny model: the merged
//! adapter is the weighted sum of the two deltas and mounts; the export is a model the store
//! finds; bad adapters, scales and methods are 400s naming the field.
mod support;

use std::path::{Path, PathBuf};

use axum::http::StatusCode;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use support::*;
use wick_engine::adapters::{load_host, HostAdapter, Target};
use wick_engine::config::ModelConfig;
use wick_train::adapter_io::save_adapter;
use wick_train::lora::{LoraConfig, LoraParams};

fn config_of(dir: &Path) -> ModelConfig {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    ModelConfig::from_hf(&serde_json::from_str(&text).unwrap(), "test").unwrap()
}

/// A PEFT adapter with random factors on `targets` of every layer.
fn adapter(dir: &Path, cfg: &ModelConfig, rank: usize, targets: &[Target], seed: u64) {
    let lora = LoraConfig {
        rank,
        scale: 1.5,
        targets: targets.to_vec(),
        ..LoraConfig::default()
    };
    let mut params = LoraParams::init(cfg, &lora, seed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed + 1);
    for pair in params.pairs_mut() {
        pair.b
            .iter_mut()
            .for_each(|v| *v = rng.random_range(-0.5..0.5));
    }
    save_adapter(dir, &params, &lora, cfg.num_layers, "tiny").unwrap();
}

/// `B·A` (the scale folded into B) of each module, by layer and target.
fn deltas(h: &HostAdapter) -> Vec<((usize, Target), Vec<f32>)> {
    h.deltas
        .iter()
        .map(|d| {
            let mut w = vec![0.0; d.out_dim * d.in_dim];
            for o in 0..d.out_dim {
                for r in 0..d.rank {
                    for i in 0..d.in_dim {
                        w[o * d.in_dim + i] += d.b[o * d.rank + r] * d.a[r * d.in_dim + i];
                    }
                }
            }
            ((d.layer, d.target), w)
        })
        .collect()
}

async fn post(r: &axum::Router, path: &str, body: Value) -> Answer {
    send(r, post_json(path, &body)).await
}

/// One test: it points `WICK_HOME` at a temporary folder before anything else runs.
#[tokio::test]
async fn merge_and_export_write_where_the_server_lists_them() {
    let home = tempfile::tempdir().unwrap();
    std::env::set_var("WICK_HOME", home.path());
    let cfg = config_of(&tiny_model_dir());
    let work = tempfile::tempdir().unwrap();
    let a = work.path().join("a");
    adapter(&a, &cfg, 2, &Target::ALL, 1);
    adapter(
        &home.path().join("adapters/b"),
        &cfg,
        3,
        &[Target::Q, Target::V],
        2,
    );
    let r = router(&state());

    let merged = post(
        &r,
        "/api/finetune/merge",
        json!({"adapter_a": a, "adapter_b": "b", "scales": [0.5, 2.0]}),
    )
    .await;
    assert_eq!(merged.status, StatusCode::OK, "{}", merged.text());
    let body = merged.json();
    let path = PathBuf::from(body["merged_path"].as_str().unwrap());
    assert_eq!(path.parent().unwrap(), home.path().join("adapters"));
    let stats = &body["stats"];
    assert_eq!(stats["rank"], 5);
    assert_eq!(stats["modules"], 14);
    assert_eq!(stats["shared_modules"], 4);
    assert_eq!(stats["only_a"], 10);
    let want_a = deltas(&load_host(&a, &cfg, None).unwrap());
    let want_b = deltas(&load_host(&home.path().join("adapters/b"), &cfg, None).unwrap());
    for (module, got) in deltas(&load_host(&path, &cfg, None).unwrap()) {
        let part = |w: &[((usize, Target), Vec<f32>)], i: usize| {
            w.iter().find(|m| m.0 == module).map_or(0.0, |m| m.1[i])
        };
        for (i, g) in got.iter().enumerate() {
            let want = 0.5 * part(&want_a, i) + 2.0 * part(&want_b, i);
            assert!(
                (g - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{module:?}[{i}]"
            );
        }
    }
    let mounted = post(&r, "/v1/adapters", json!({"id": "both", "path": path})).await;
    assert_eq!(mounted.status, StatusCode::OK, "{}", mounted.text());

    let missing = post(
        &r,
        "/api/finetune/merge",
        json!({"adapter_a": a, "adapter_b": "nope"}),
    )
    .await;
    let e = missing.assert_error(StatusCode::BAD_REQUEST, "invalid_value");
    assert_eq!(e["error"]["param"], "adapter_b");
    let scales = post(
        &r,
        "/api/finetune/merge",
        json!({"adapter_a": a, "adapter_b": "b", "scales": [1.0]}),
    )
    .await;
    assert_eq!(
        scales.assert_error(StatusCode::BAD_REQUEST, "invalid_value")["error"]["param"],
        "scales"
    );
    let mut other = config_of(&tiny_model_dir());
    other.intermediate_size = 96;
    let foreign = work.path().join("foreign");
    adapter(&foreign, &other, 2, &[Target::Up], 3);
    let misfit = post(
        &r,
        "/api/finetune/merge",
        json!({"adapter_a": foreign, "adapter_b": "b"}),
    )
    .await;
    let e = misfit.assert_error(StatusCode::BAD_REQUEST, "invalid_value");
    assert_eq!(e["error"]["param"], "adapter_a");

    let gguf = post(
        &r,
        "/api/finetune/export",
        json!({"adapter_path": a, "method": "gguf"}),
    )
    .await;
    gguf.assert_error(StatusCode::BAD_REQUEST, "unsupported_parameter");
    post(&r, "/api/finetune/export", json!({}))
        .await
        .assert_error(StatusCode::BAD_REQUEST, "missing_required_parameter");
    let exported = post(&r, "/api/finetune/export", json!({"adapter_path": a})).await;
    assert_eq!(exported.status, StatusCode::OK, "{}", exported.text());
    let body = exported.json();
    let out = PathBuf::from(body["export_path"].as_str().unwrap());
    assert_eq!(out.parent().unwrap(), home.path().join("models"));
    let manifest = &body["manifest"];
    assert_eq!(manifest["modules"], 14);
    assert_eq!(manifest["dtype"], "f32");
    let files: Vec<&str> = manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert!(
        files.contains(&"model.safetensors") && files.contains(&"config.json"),
        "{files:?}"
    );
    let name = manifest["model"].as_str().unwrap();
    let found = wick_hub::Store::from_env().unwrap().resolve(name).unwrap();
    assert_eq!(found.path, out);
}
