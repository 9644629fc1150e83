//! Resolving model arguments and listing local models over a synthetic store and
//! Hugging Face cache.

mod support;

use std::path::{Path, PathBuf};

use wick_gguf::{GgufWriter, MetadataValue};
use wick_hub::{HubError, ModelKind, ModelOrigin, Store};

fn gguf_bytes(arch: &str) -> Vec<u8> {
    GgufWriter::new()
        .metadata("general.architecture", MetadataValue::String(arch.into()))
        .to_bytes()
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn hf_dir(dir: &Path, model_type: &str) {
    write(
        &dir.join("config.json"),
        format!(r#"{{"model_type": "{model_type}", "hidden_size": 8}}"#).as_bytes(),
    );
    write(
        &dir.join("model.safetensors"),
        b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
    );
}

/// The fixture: a store and an HF cache holding a bit of everything.
struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    store: Store,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let models = root.join("wick/models");
        write(&models.join("my-llama/model.gguf"), &gguf_bytes("llama"));
        // A pull's leftover temporary is invisible.
        write(&models.join("my-llama/.model.gguf.partial-abc"), b"half");
        write(&models.join("multi/a.Q4.gguf"), &gguf_bytes("qwen2"));
        write(&models.join("multi/a.Q8.gguf"), &gguf_bytes("qwen2"));
        hf_dir(&models.join("hf-style"), "qwen3");
        std::fs::create_dir_all(models.join("empty-dir")).unwrap();
        write(&models.join("loose.gguf"), &gguf_bytes("gemma3"));

        let hf = root.join("hf");
        // A safetensors repo with two revisions; refs/main picks "abc".
        let qwen = hf.join("models--Qwen--Qwen3-0.6B");
        write(&qwen.join("refs/main"), b"abc\n");
        hf_dir(&qwen.join("snapshots/abc"), "qwen3");
        hf_dir(&qwen.join("snapshots/0ld"), "qwen2");
        // A GGUF repo laid out like huggingface_hub does it: snapshot entries are
        // symlinks into blobs/.
        let qwen_gguf = hf.join("models--Qwen--Qwen3-0.6B-GGUF");
        write(&qwen_gguf.join("refs/main"), b"r1");
        write(&qwen_gguf.join("blobs/0123abcd"), &gguf_bytes("qwen3"));
        std::fs::create_dir_all(qwen_gguf.join("snapshots/r1")).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(
            "../../blobs/0123abcd",
            qwen_gguf.join("snapshots/r1/Qwen3-0.6B-Q8_0.gguf"),
        )
        .unwrap();
        #[cfg(not(unix))]
        write(
            &qwen_gguf.join("snapshots/r1/Qwen3-0.6B-Q8_0.gguf"),
            &gguf_bytes("qwen3"),
        );
        // Several GGUFs, no refs/, split files.
        let llama = hf.join("models--bartowski--Llama-GGUF/snapshots/s1");
        write(&llama.join("x-Q4_K_M.gguf"), &gguf_bytes("llama"));
        write(&llama.join("x-Q8_0.gguf"), &gguf_bytes("llama"));
        write(
            &llama.join("big/x-F16-00001-of-00002.gguf"),
            &gguf_bytes("llama"),
        );
        write(
            &llama.join("big/x-F16-00002-of-00002.gguf"),
            b"second shard",
        );
        // Not models: a dataset and a repo without snapshots.
        std::fs::create_dir_all(hf.join("datasets--a--b/snapshots/x")).unwrap();
        std::fs::create_dir_all(hf.join("models--empty--repo")).unwrap();

        let store = Store::new(root.join("wick"), hf);
        Fixture {
            _dir: dir,
            root,
            store,
        }
    }

    fn resolve(&self, arg: &str) -> Result<wick_hub::ResolvedModel, HubError> {
        self.store.resolve(arg)
    }
}

#[test]
fn exact_store_names_win_case_insensitively() {
    let fx = Fixture::new();
    let model = fx.resolve("MY-LLAMA").unwrap();
    assert_eq!(model.name, "my-llama");
    assert_eq!(model.kind, ModelKind::Gguf);
    assert_eq!(model.path, fx.root.join("wick/models/my-llama/model.gguf"));

    let model = fx.resolve("hf-style").unwrap();
    assert_eq!(model.kind, ModelKind::HfDir);
    assert_eq!(model.path, fx.root.join("wick/models/hf-style"));

    let model = fx.resolve("loose").unwrap();
    assert_eq!(model.path, fx.root.join("wick/models/loose.gguf"));
}

#[test]
fn hf_cache_follows_refs_main_and_symlinks() {
    let fx = Fixture::new();
    let model = fx.resolve("Qwen/Qwen3-0.6B").unwrap();
    assert_eq!(model.kind, ModelKind::HfDir);
    assert_eq!(
        model.path,
        fx.root.join("hf/models--Qwen--Qwen3-0.6B/snapshots/abc")
    );
    // The repo name without its org is an exact name too, so it beats the substring
    // match on "Qwen3-0.6B-GGUF".
    assert_eq!(fx.resolve("qwen3-0.6b").unwrap().name, "Qwen/Qwen3-0.6B");

    let model = fx.resolve("qwen3-0.6b-gguf").unwrap();
    assert_eq!(model.kind, ModelKind::Gguf);
    assert_eq!(model.name, "Qwen/Qwen3-0.6B-GGUF");
    assert!(model.path.ends_with("snapshots/r1/Qwen3-0.6B-Q8_0.gguf"));
    assert!(model.path.is_file());
}

#[test]
fn several_ggufs_in_one_repo_are_told_apart_by_file() {
    let fx = Fixture::new();
    let model = fx.resolve("x-q8_0").unwrap();
    assert_eq!(model.name, "bartowski/Llama-GGUF/x-Q8_0");
    let model = fx.resolve("Q4_K_M").unwrap();
    assert!(model.path.ends_with("x-Q4_K_M.gguf"));
    // Only the first shard of a split model is a candidate.
    let model = fx.resolve("F16").unwrap();
    assert!(model.path.ends_with("big/x-F16-00001-of-00002.gguf"));
    let err = fx.resolve("Llama-GGUF").unwrap_err();
    let HubError::Ambiguous { candidates, .. } = err else {
        panic!("expected ambiguity, got {err}");
    };
    assert_eq!(
        candidates,
        vec![
            "bartowski/Llama-GGUF/x-F16-00001-of-00002",
            "bartowski/Llama-GGUF/x-Q4_K_M",
            "bartowski/Llama-GGUF/x-Q8_0"
        ]
    );
}

#[test]
fn ambiguous_substring_lists_every_candidate() {
    let fx = Fixture::new();
    let err = fx.resolve("llam").unwrap_err();
    assert_eq!(err.kind(), "ambiguous_model");
    let text = err.to_string();
    for name in [
        "my-llama",
        "bartowski/Llama-GGUF/x-Q4_K_M",
        "bartowski/Llama-GGUF/x-Q8_0",
    ] {
        assert!(text.contains(name), "{name} missing from: {text}");
    }

    // Catalog models that are not downloaded are candidates too, marked as such.
    let err = fx.resolve("qwen").unwrap_err();
    let HubError::Ambiguous { candidates, query } = err else {
        panic!("expected ambiguity");
    };
    assert_eq!(query, "qwen");
    assert!(candidates.contains(&"Qwen/Qwen3-0.6B".to_string()));
    assert!(candidates.contains(&"Qwen/Qwen3-0.6B-GGUF".to_string()));
    assert!(candidates.contains(&"qwen2.5-coder-0.5b-instruct (not downloaded)".to_string()));

    // Two files in one store directory.
    let err = fx.resolve("multi").unwrap_err();
    assert_eq!(err.kind(), "ambiguous_model");
    assert_eq!(
        fx.resolve("a.q8").unwrap().path,
        fx.root.join("wick/models/multi/a.Q8.gguf")
    );
}

#[test]
fn unique_substring_resolves() {
    let fx = Fixture::new();
    assert_eq!(fx.resolve("hf-st").unwrap().name, "hf-style");
    assert_eq!(fx.resolve("y-lla").unwrap().name, "my-llama");
}

#[test]
fn catalog_models_not_downloaded_say_how_to_pull() {
    let fx = Fixture::new();
    for query in ["gemma3", "gemma-3-270m", "GEMMA", "default", "smollm2"] {
        let err = fx.resolve(query).unwrap_err();
        let HubError::NotDownloaded { item, query: q } = &err else {
            panic!("{query}: expected NotDownloaded, got {err}");
        };
        assert_eq!(q, query);
        assert!(err
            .to_string()
            .contains(&format!("wick pull {}", item.name)));
    }
    let err = fx.resolve("default").unwrap_err();
    let HubError::NotDownloaded { item, .. } = err else {
        panic!()
    };
    assert_eq!(item.name, wick_hub::catalog::DEFAULT_MODEL);
    // Test assets are not models.
    assert_eq!(
        fx.resolve("test-assets").unwrap_err().kind(),
        "model_not_found"
    );
}

#[test]
fn installed_catalog_models_answer_to_their_aliases() {
    let fx = Fixture::new();
    let item = wick_hub::catalog::item("default").unwrap();
    let target = fx.store.target_path(item);
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    // A sparse file of the pinned size passes the quick check.
    let file = std::fs::File::create(&target).unwrap();
    file.set_len(item.installed_bytes()).unwrap();
    assert_eq!(fx.store.installed(item), Some(target.clone()));
    for query in ["default", "smollm2", "SmolLM2-135M-Instruct", "smollm"] {
        let model = fx.resolve(query).unwrap();
        assert_eq!(model.path, target, "{query}");
        assert_eq!(model.name, "smollm2-135m-instruct");
    }
    // "efaul" is a substring of the alias only.
    assert_eq!(fx.resolve("efaul").unwrap().path, target);
}

#[test]
fn missing_queries_name_where_they_looked() {
    let fx = Fixture::new();
    let err = fx.resolve("nothing-like-this").unwrap_err();
    assert_eq!(err.kind(), "model_not_found");
    let text = err.to_string();
    assert!(
        text.contains("wick/models") && text.contains("hf"),
        "{text}"
    );
    assert_eq!(fx.resolve("").unwrap_err().kind(), "model_not_found");
    assert_eq!(fx.resolve("  ").unwrap_err().kind(), "model_not_found");
    // A directory with no model in it is not a candidate.
    assert_eq!(
        fx.resolve("empty-dir").unwrap_err().kind(),
        "model_not_found"
    );
}

#[test]
fn paths_resolve_directly() {
    let fx = Fixture::new();
    let gguf = fx.root.join("wick/models/loose.gguf");
    let model = fx.resolve(gguf.to_str().unwrap()).unwrap();
    assert_eq!(
        (model.kind, model.name.as_str()),
        (ModelKind::Gguf, "loose")
    );

    let dir = fx.root.join("hf/models--Qwen--Qwen3-0.6B/snapshots/0ld");
    let model = fx.resolve(dir.to_str().unwrap()).unwrap();
    assert_eq!(model.kind, ModelKind::HfDir);
    assert_eq!(model.path, dir);

    let one = fx.root.join("wick/models/my-llama");
    let model = fx.resolve(one.to_str().unwrap()).unwrap();
    assert_eq!(model.kind, ModelKind::Gguf);
    assert_eq!(model.path, one.join("model.gguf"));

    let multi = fx.root.join("wick/models/multi");
    assert_eq!(
        fx.resolve(multi.to_str().unwrap()).unwrap_err().kind(),
        "ambiguous_model"
    );
    let empty = fx.root.join("wick/models/empty-dir");
    assert_eq!(
        fx.resolve(empty.to_str().unwrap()).unwrap_err().kind(),
        "not_a_model"
    );
    let config = fx.root.join("wick/models/hf-style/config.json");
    assert_eq!(
        fx.resolve(config.to_str().unwrap()).unwrap_err().kind(),
        "not_a_model"
    );
    let err = fx.resolve("/nonexistent/model.gguf").unwrap_err();
    assert_eq!(err.kind(), "not_a_model");
    assert!(err.to_string().contains("no such file"));
    assert_eq!(
        fx.resolve("missing.gguf").unwrap_err().kind(),
        "not_a_model"
    );
}

#[test]
fn list_shows_store_then_hf_cache_with_arch_and_size() {
    let fx = Fixture::new();
    let models = fx.store.list();
    let rows: Vec<(&str, ModelKind, ModelOrigin, Option<&str>)> = models
        .iter()
        .map(|m| (m.name.as_str(), m.format, m.origin, m.arch.as_deref()))
        .collect();
    use ModelKind::*;
    use ModelOrigin::*;
    assert_eq!(
        rows,
        vec![
            ("hf-style", HfDir, Store, Some("qwen3")),
            ("loose", Gguf, Store, Some("gemma3")),
            ("multi/a.Q4", Gguf, Store, Some("qwen2")),
            ("multi/a.Q8", Gguf, Store, Some("qwen2")),
            ("my-llama", Gguf, Store, Some("llama")),
            (
                "bartowski/Llama-GGUF/x-F16-00001-of-00002",
                Gguf,
                HfCache,
                Some("llama")
            ),
            (
                "bartowski/Llama-GGUF/x-Q4_K_M",
                Gguf,
                HfCache,
                Some("llama")
            ),
            ("bartowski/Llama-GGUF/x-Q8_0", Gguf, HfCache, Some("llama")),
            ("Qwen/Qwen3-0.6B", HfDir, HfCache, Some("qwen3")),
            ("Qwen/Qwen3-0.6B-GGUF", Gguf, HfCache, Some("qwen3")),
        ]
    );
    let llama = &models[4];
    assert_eq!(llama.size_bytes, gguf_bytes("llama").len() as u64);
    let hf = &models[0];
    let expected: u64 = ["config.json", "model.safetensors"]
        .iter()
        .map(|f| std::fs::metadata(hf.path.join(f)).unwrap().len())
        .sum();
    assert_eq!(hf.size_bytes, expected);
    // Through the symlink, the blob's size.
    assert_eq!(models[9].size_bytes, gguf_bytes("qwen3").len() as u64);
}

#[test]
fn missing_store_and_cache_list_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::new(dir.path().join("none"), dir.path().join("nohf"));
    assert!(store.list().is_empty());
    let err = store.resolve("smollm2").unwrap_err();
    assert_eq!(err.kind(), "model_not_downloaded");
}
