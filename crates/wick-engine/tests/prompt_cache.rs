//! The prompt cache with real models: reuse is exact (greedy tokens equal a cold run),
//! conversations reuse a growing prefix, namespaces never mix, the SSD tier survives a
//! restart, damaged files and a full disk never fail a request, and generation
//! checkpoints resume after a cancel or a real `kill -9`.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use wick_engine::scheduler::{Engine, EngineConfig, EngineEvent, EngineHandle};
use wick_engine::{GenerationRequest, LoadOptions, Model};

#[path = "common/serving.rs"]
mod serving;
use serving::{completion, default_model, model_file, run_one};

/// A deterministic prompt of exactly `n` tokens, tokenized line by line (one huge
/// string would cost more tokenizer time than the model work under test).
fn long_prompt(model: &Model, n: usize, salt: usize) -> Vec<u32> {
    let tok = model.tokenizer();
    let mut ids: Vec<u32> = tok.bos_id().filter(|_| tok.add_bos()).into_iter().collect();
    let mut i = 0;
    while ids.len() < n {
        let line = format!(
            "Record {i}: value {} of series {salt}. ",
            (i * 7 + salt) % 13
        );
        ids.extend(tok.encode(&line, false).unwrap());
        i += 1;
    }
    ids.truncate(n);
    ids
}

fn with_ssd(dir: &Path) -> EngineConfig {
    EngineConfig {
        ssd_cache_dir: Some(dir.to_path_buf()),
        ..EngineConfig::default()
    }
}

fn wkv_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(wkv_files(&p));
        } else if p.extension().is_some_and(|x| x == "wkv" || x == "tmp") {
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn conversation_reuses_a_growing_prefix_with_exact_tokens() {
    let model = default_model();
    let engine = Engine::start(model.clone(), EngineConfig::default()).unwrap();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a concise assistant."}),
        json!({"role": "user", "content": "Name a color."}),
    ];
    let followups = [
        "Name another one.",
        "And a fruit?",
        "Thanks. One more animal?",
    ];
    let mut cached = Vec::new();
    let mut prompt_lens = Vec::new();
    for next in followups {
        let text = model
            .render_chat(&messages, None, &Default::default())
            .unwrap();
        let req = GenerationRequest::new(model.tokenize(&text).unwrap()).max_tokens(20);
        let (ids, done) = completion(&engine, req.clone());
        assert_eq!(ids, run_one(&model, &req), "reused KV changed the output");
        cached.push(done.usage.cached_tokens);
        prompt_lens.push(req.prompt.len());
        messages.push(json!({"role": "assistant", "content": done.text}));
        messages.push(json!({"role": "user", "content": next}));
    }
    assert_eq!(cached[0], 0);
    // Each turn reuses at least the whole previous prompt.
    for t in 1..cached.len() {
        assert!(
            cached[t] >= prompt_lens[t - 1],
            "{cached:?} {prompt_lens:?}"
        );
        assert!(cached[t] < prompt_lens[t]);
    }
    let stats = engine.stats().prompt_cache;
    assert_eq!((stats.hits, stats.misses), (2, 1), "{stats:?}");
    assert!(stats.entries >= 1 && stats.bytes > 0);
    // Superseding keeps one entry per conversation.
    assert_eq!(stats.entries, 1, "{stats:?}");
}

#[test]
fn namespaces_never_mix_and_zero_turns_the_cache_off() {
    let model = default_model();
    let engine = Engine::start(model.clone(), EngineConfig::default()).unwrap();
    let prompt = long_prompt(&model, 120, 1);
    let mut a = GenerationRequest::new(prompt.clone()).max_tokens(4);
    a.cache_namespace = "adapter-a".into();
    completion(&engine, a.clone());
    let base = GenerationRequest::new(prompt.clone()).max_tokens(4);
    assert_eq!(completion(&engine, base.clone()).1.usage.cached_tokens, 0);
    assert_eq!(completion(&engine, a).1.usage.cached_tokens, 119);
    let off = Engine::start(
        model.clone(),
        EngineConfig {
            prompt_cache_bytes: 0,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    completion(&off, base.clone());
    assert_eq!(completion(&off, base).1.usage.cached_tokens, 0);
    assert!(!off.stats().prompt_cache.enabled);
}

#[test]
fn concurrent_requests_share_one_prefill() {
    let model = default_model();
    let engine = Engine::start(model.clone(), EngineConfig::default()).unwrap();
    let shared = long_prompt(&model, 400, 2);
    completion(
        &engine,
        GenerationRequest::new(shared.clone()).max_tokens(2),
    );
    let requests: Vec<GenerationRequest> = (0..4)
        .map(|i| {
            let mut p = shared.clone();
            p.extend(
                model
                    .tokenize(&format!(" Question {i}: what is record {i}?"))
                    .unwrap(),
            );
            GenerationRequest::new(p).max_tokens(12)
        })
        .collect();
    let handles: Vec<_> = requests
        .iter()
        .map(|r| {
            let engine = engine.clone();
            let r = r.clone();
            std::thread::spawn(move || completion(&engine, r))
        })
        .collect();
    for (h, r) in handles.into_iter().zip(&requests) {
        let (ids, done) = h.join().unwrap();
        assert!(done.usage.cached_tokens >= 400, "{:?}", done.usage);
        assert_eq!(ids, run_one(&model, r));
    }
    assert_eq!(engine.stats().prompt_cache.hits, 4);
}

#[test]
fn restart_restores_from_ssd_with_identical_tokens() {
    let model = default_model();
    let root = tempfile::tempdir().unwrap();
    let prompt = long_prompt(&model, 300, 3);
    let first = GenerationRequest::new(prompt.clone()).max_tokens(8);
    let fingerprint_dir;
    {
        let engine = Engine::start(model.clone(), with_ssd(root.path())).unwrap();
        completion(&engine, first.clone());
        let report = engine.flush_cache(Duration::from_secs(60));
        assert!(report.enabled && report.durable, "{report:?}");
        assert!(engine.shutdown(Duration::from_secs(5)));
        fingerprint_dir = engine.ssd_cache_path().unwrap();
        assert!(fingerprint_dir.starts_with(root.path()));
        assert_eq!(engine.stats().prompt_cache.ssd.unwrap().entries, 1);
    }
    // A new engine (a restarted server) finds the entry from the files alone.
    let engine = Engine::start(model.clone(), with_ssd(root.path())).unwrap();
    assert_eq!(engine.cache_scan_report().unwrap().entries, 1);
    let mut longer = prompt.clone();
    longer.extend(model.tokenize(" And what comes next?").unwrap());
    let second = GenerationRequest::new(longer).max_tokens(16);
    let (ids, done) = completion(&engine, second.clone());
    assert!(done.usage.cached_tokens >= 300, "{:?}", done.usage);
    assert_eq!(ids, run_one(&model, &second));
    let stats = engine.stats().prompt_cache;
    assert_eq!(stats.ssd_hits, 1, "{stats:?}");
    assert_eq!(stats.ssd.as_ref().unwrap().restores, 1);
    // The same request again now hits RAM (the restored-and-extended entry).
    let (ids, done) = completion(&engine, second.clone());
    assert_eq!(done.usage.cached_tokens, second.prompt.len() - 1);
    assert_eq!(ids, run_one(&model, &second));
    assert_eq!(engine.stats().prompt_cache.ram_hits, 1);
}

#[test]
fn damaged_and_foreign_files_are_removed_or_ignored() {
    let model = default_model();
    let root = tempfile::tempdir().unwrap();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| long_prompt(&model, 80 + 10 * i, 10 + i))
        .collect();
    let dir = {
        let engine = Engine::start(model.clone(), with_ssd(root.path())).unwrap();
        for p in &prompts {
            completion(&engine, GenerationRequest::new(p.clone()).max_tokens(2));
        }
        assert!(engine.flush_cache(Duration::from_secs(60)).durable);
        engine.shutdown(Duration::from_secs(5));
        engine.ssd_cache_path().unwrap()
    };
    let files = wkv_files(&dir);
    assert_eq!(files.len(), 4);
    // Which file holds which prompt: the header's token count.
    let by_len = |n: usize| -> PathBuf {
        files
            .iter()
            .find(|f| {
                let mut fh = std::fs::File::open(f).unwrap();
                wick_cache::ssd::format::read_header(&mut fh, f)
                    .unwrap()
                    .tokens
                    .len()
                    == n
            })
            .unwrap()
            .clone()
    };
    let (f0, f1, f2, f3) = (by_len(81), by_len(91), by_len(101), by_len(111));
    // Truncated.
    let b = std::fs::read(&f0).unwrap();
    std::fs::write(&f0, &b[..b.len() / 2]).unwrap();
    // A flipped payload bit (caught when restored).
    let mut b = std::fs::read(&f1).unwrap();
    let n = b.len();
    b[n - 100] ^= 0x08;
    std::fs::write(&f1, &b).unwrap();
    // Another format version.
    let mut b = std::fs::read(&f2).unwrap();
    b[8] = 99;
    std::fs::write(&f2, &b).unwrap();
    // A file of another model planted in our directory, an orphan temp file, and
    // another model's directory beside ours.
    let foreign_root = tempfile::tempdir().unwrap();
    {
        let (other, _) = wick_cache::ssd::SsdTier::open(wick_cache::SsdConfig {
            root: foreign_root.path().to_path_buf(),
            fingerprint: "other-model".into(),
            model: "other".into(),
            max_bytes: 0,
            verify: false,
        })
        .unwrap();
        let mut kv = model.new_cache();
        model
            .forward(&mut [wick_engine::Step {
                tokens: &prompts[3][..5],
                cache: &mut kv,
                logits: wick_engine::LogitsRequest::None,
            }])
            .unwrap();
        let host = wick_cache::CacheValue::to_host(&kv).unwrap();
        other.store("", &prompts[3][..5], &host, None).unwrap();
    }
    let foreign_file = wkv_files(foreign_root.path()).remove(0);
    let planted = f3.with_file_name(foreign_file.file_name().unwrap());
    std::fs::copy(&foreign_file, &planted).unwrap();
    // An interrupted write (the tier's own temporary name, its owner long gone).
    let orphan = f3.with_file_name(format!(
        "{}.1.2.tmp",
        f3.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&orphan, b"interrupted").unwrap();
    let neighbour = root.path().join("other-model/base");
    std::fs::create_dir_all(&neighbour).unwrap();
    let neighbour_file = neighbour.join(foreign_file.file_name().unwrap());
    std::fs::copy(&foreign_file, &neighbour_file).unwrap();

    let engine = Engine::start(model.clone(), with_ssd(root.path())).unwrap();
    let report = engine.cache_scan_report().unwrap();
    assert_eq!(report.removed_orphans, 1, "{report:?}");
    assert_eq!(report.removed_corrupt, 1, "{report:?}");
    assert_eq!(report.removed_unsupported, 1, "{report:?}");
    assert_eq!(report.removed_mismatched, 1, "{report:?}");
    assert_eq!(report.entries, 2, "{report:?}");
    assert!(!f0.exists() && !f2.exists() && !planted.exists() && !orphan.exists());
    assert!(
        neighbour_file.exists(),
        "another fingerprint's directory was touched"
    );
    // Every request succeeds with exact tokens; the bit-flipped entry is a miss.
    for (i, p) in prompts.iter().enumerate() {
        let mut longer = p.clone();
        longer.extend([30, 31, 32]);
        let req = GenerationRequest::new(longer).max_tokens(6);
        let (ids, done) = completion(&engine, req.clone());
        assert_eq!(ids, run_one(&model, &req), "prompt {i}");
        if i == 3 {
            assert_eq!(done.usage.cached_tokens, p.len(), "prompt {i}");
        } else {
            // Nothing of these prompts survived (a few shared leading tokens at most).
            assert!(
                done.usage.cached_tokens < 10,
                "prompt {i}: {:?}",
                done.usage
            );
        }
    }
    let ssd = engine.stats().prompt_cache.ssd.unwrap();
    assert_eq!((ssd.restores, ssd.restore_failures), (1, 1), "{ssd:?}");
    assert!(!f1.exists());
}

/// Mounts a small tmpfs for the life of the value.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// Panics where this machine cannot mount (not root, or a container without
    /// CAP_SYS_ADMIN): the test that needs it is `#[ignore]`d and run on purpose.
    fn mount(size: &str) -> SmallDisk {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "cannot mount a tmpfs at {} (the full-disk test needs root)",
            dir.path().display()
        );
        SmallDisk { dir }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let unmounted = Command::new("umount")
            .arg(self.dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(self.dir.path())
                .status();
        }
    }
}

/// Ignored by a plain `cargo test` (it reports as ignored, never as a silent pass): it mounts
/// a tmpfs, which needs root. `scripts/test.sh` runs it with `--ignored` where it is root.
#[test]
#[ignore = "mounts a tmpfs, needs root: cargo test -- --ignored full_disk (scripts/test.sh runs it as root)"]
fn full_disk_never_fails_a_request() {
    let model = default_model();
    // SmolLM2 keeps 45 KiB of KV per token: no 100-token entry fits in 2 MiB.
    let disk = SmallDisk::mount("2M");
    let engine = Engine::start(model.clone(), with_ssd(disk.dir.path())).unwrap();
    let base = long_prompt(&model, 100, 20);
    for turn in 0..3 {
        let mut p = base.clone();
        p.extend(model.tokenize(&format!(" Turn {turn}.")).unwrap());
        let req = GenerationRequest::new(p).max_tokens(6);
        let (ids, done) = completion(&engine, req.clone());
        assert_eq!(ids, run_one(&model, &req));
        if turn > 0 {
            assert!(done.usage.cached_tokens >= 100, "RAM keeps serving");
        }
    }
    let report = engine.flush_cache(Duration::from_secs(60));
    assert!(!report.durable, "{report:?}");
    let ssd = engine.stats().prompt_cache.ssd.unwrap();
    assert!(ssd.failed_spills >= 1 && ssd.entries == 0, "{ssd:?}");
    assert_eq!(
        wkv_files(disk.dir.path()),
        Vec::<PathBuf>::new(),
        "a failed write left files behind"
    );
    assert_eq!(engine.stats().failed, 0);
    // Release the directory (the engine thread holds the cache) before unmounting.
    assert!(engine.shutdown(Duration::from_secs(5)));
    drop(engine);
    drop(disk);
}

#[test]
fn prompt_boundary_entry_serves_the_next_turn_when_the_ring_wrapped() {
    let model = Arc::new(
        Model::load(
            &model_file("gemma-3-270m/gemma-3-270m-q4_k_m.gguf", "gemma-3-270m"),
            &LoadOptions::default(),
        )
        .unwrap(),
    );
    let window = model
        .config()
        .layer_windows
        .iter()
        .flatten()
        .copied()
        .min()
        .expect("gemma 3 has sliding-window layers");
    // The prompt stays below the first ring eviction (at 2·window - 1 tokens), the
    // generation crosses it: the prompt+generation entry can no longer be cut back to
    // the prompt.
    let p = 2 * window - 24;
    let prompt = long_prompt(&model, p, 4);
    let mut first = GenerationRequest::new(prompt.clone()).max_tokens(40);
    first.ignore_eos = true;
    let mut next = prompt.clone();
    next.extend(model.tokenize(" A different question.").unwrap());
    let second = GenerationRequest::new(next).max_tokens(8);
    let want = run_one(&model, &second);
    let mut cached = Vec::new();
    for boundary in [true, false] {
        let engine = Engine::start(
            model.clone(),
            EngineConfig {
                prompt_boundary_min_tokens: if boundary { 256 } else { usize::MAX },
                ..EngineConfig::default()
            },
        )
        .unwrap();
        completion(&engine, first.clone());
        let (ids, done) = completion(&engine, second.clone());
        assert_eq!(ids, want);
        cached.push(done.usage.cached_tokens);
    }
    assert_eq!(cached, vec![p, 0]);
}

#[test]
fn cancelled_generation_resumes_from_its_checkpoint() {
    let model = default_model();
    let root = tempfile::tempdir().unwrap();
    let config = EngineConfig {
        generation_checkpoint_tokens: 8,
        ..with_ssd(root.path())
    };
    let mut req = GenerationRequest::new(long_prompt(&model, 60, 5)).max_tokens(48);
    req.ignore_eos = true;
    let want = run_one(&model, &req);
    {
        let engine = Engine::start(model.clone(), config.clone()).unwrap();
        let mut h = engine.submit(req.clone()).unwrap();
        let mut seen = 0;
        while seen < 20 {
            if let Some(EngineEvent::Token(_)) = h.blocking_next() {
                seen += 1;
            }
        }
        drop(h);
        // Let the writer finish the queued checkpoints, then stop.
        engine.flush_cache(Duration::from_secs(60));
        engine.shutdown(Duration::from_secs(5));
        let ssd = engine.stats().prompt_cache.ssd.unwrap();
        assert!(ssd.checkpoints_saved >= 2, "{ssd:?}");
        assert_eq!(ssd.checkpoints, 1, "older checkpoints are replaced");
    }
    let engine = Engine::start(model.clone(), config).unwrap();
    engine.cache_scan_report().unwrap();
    let (ids, done) = completion(&engine, req.clone());
    assert_eq!(
        ids, want,
        "resumed generation differs from an uninterrupted one"
    );
    assert_eq!(done.usage.cached_tokens, req.prompt.len());
    engine.flush_cache(Duration::from_secs(60));
    let ssd = engine.stats().prompt_cache.ssd.unwrap();
    assert_eq!(ssd.checkpoints_resumed, 1);
    assert_eq!(
        ssd.checkpoints, 0,
        "a completed generation removes its checkpoints"
    );
    // Another request with the same prompt but other settings never resumes.
    let other = GenerationRequest::new(req.prompt.clone()).max_tokens(5);
    completion(&engine, other);
    assert_eq!(
        engine.stats().prompt_cache.ssd.unwrap().checkpoints_resumed,
        1
    );
}

const CHILD_DIR: &str = "WICK_CACHE_TEST_CHILD_DIR";

fn crash_request(model: &Model) -> GenerationRequest {
    let mut req = GenerationRequest::new(long_prompt(model, 50, 6)).max_tokens(64);
    req.ignore_eos = true;
    req
}

/// Run by [`kill_9_during_generation_and_writes_then_restart`] in a child process: an
/// engine that checkpoints every 4 tokens and keeps writing cache entries until killed.
#[test]
#[ignore = "child process of kill_9_during_generation_and_writes_then_restart"]
fn crash_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let model = default_model();
    let engine = Engine::start(
        model.clone(),
        EngineConfig {
            generation_checkpoint_tokens: 4,
            ..with_ssd(Path::new(&dir))
        },
    )
    .unwrap();
    // Slow the generation so the parent can kill it mid-way: other requests share the
    // batch and each finished one is flushed to disk.
    let h = engine.submit(crash_request(&model)).unwrap();
    let mut i = 0;
    loop {
        let req = GenerationRequest::new(long_prompt(&model, 40 + i % 30, 100 + i)).max_tokens(3);
        completion(&engine, req);
        engine.flush_cache(Duration::from_secs(60));
        i += 1;
        let _ = &h;
    }
}

#[test]
fn kill_9_during_generation_and_writes_then_restart() {
    let model = default_model();
    let want = run_one(&model, &crash_request(&model));
    let exe = std::env::current_exe().unwrap();
    for round in 0..4u64 {
        let root = tempfile::tempdir().unwrap();
        let mut child = Command::new(&exe)
            .args([
                "crash_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, root.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait for the first checkpoint, then kill at a different moment each round.
        let deadline = Instant::now() + Duration::from_secs(120);
        let has_checkpoint = |root: &Path| {
            wkv_files(root).iter().any(|f| {
                f.extension().is_some_and(|x| x == "wkv")
                    && f.parent()
                        .and_then(|d| d.file_name())
                        .is_some_and(|n| n.to_string_lossy().starts_with("ns-"))
            })
        };
        while !has_checkpoint(root.path()) {
            assert!(
                Instant::now() < deadline,
                "the child never wrote a checkpoint"
            );
            assert!(
                child.try_wait().unwrap().is_none(),
                "the child exited early"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(37 * round + 5));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let engine = Engine::start(
            model.clone(),
            EngineConfig {
                generation_checkpoint_tokens: 4,
                ..with_ssd(root.path())
            },
        )
        .unwrap();
        let report = engine.cache_scan_report().unwrap();
        assert_eq!(
            report.removed_corrupt + report.removed_mismatched,
            0,
            "{report:?}"
        );
        // Every entry left on disk restores and reproduces cold tokens.
        let (ids, done) = completion(&engine, crash_request(&model));
        assert_eq!(
            ids, want,
            "round {round}: resume differs from an uninterrupted run"
        );
        assert_eq!(done.usage.cached_tokens, 50);
        let stats = engine.stats().prompt_cache.ssd.unwrap();
        assert_eq!(stats.checkpoints_resumed, 1, "round {round}");
        for e in engine_entries(&engine) {
            let mut p = e;
            p.push(7);
            let req = GenerationRequest::new(p).max_tokens(3);
            let (ids, done) = completion(&engine, req.clone());
            assert!(done.usage.cached_tokens > 0);
            assert_eq!(ids, run_one(&model, &req), "round {round}");
        }
        assert_eq!(engine.stats().prompt_cache.ssd.unwrap().restore_failures, 0);
        assert_eq!(engine.stats().failed, 0);
    }
}

/// Token lists of the ordinary entries on disk.
fn engine_entries(engine: &EngineHandle) -> Vec<Vec<u32>> {
    let dir = engine.ssd_cache_path().unwrap();
    wkv_files(&dir.join("base"))
        .iter()
        .filter(|f| f.extension().is_some_and(|x| x == "wkv"))
        .map(|f| {
            let mut fh = std::fs::File::open(f).unwrap();
            wick_cache::ssd::format::read_header(&mut fh, f)
                .unwrap()
                .tokens
        })
        .collect()
}
