//! `kill -9` at random points while the SSD tier writes: after every crash the start-up
//! scan rebuilds the index and the chunks' reference counts, removes the interrupted temp
//! files and the chunks no entry refers to, and every entry left on disk restores (with the
//! chunks it shares with its family) to exactly the KV of its tokens. Nothing corrupt is
//! ever restored.
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{holds, snapshot_for};
use wick_cache::ssd::{chunks, format, SsdTier};
use wick_cache::SsdConfig;

const CHILD_DIR: &str = "WICK_CACHE_CRASH_CHILD_DIR";

fn config(root: &Path) -> SsdConfig {
    SsdConfig {
        root: root.to_path_buf(),
        fingerprint: "crash-test".into(),
        model: "test".into(),
        max_bytes: 128 << 20,
        verify: false,
    }
}

/// Entry `i`: 1 to 3000 tokens, the first half shared with its family (one of five),
/// the rest its own, so every store writes a file and families share prefixes (and chunks).
fn tokens(i: u64) -> Vec<u32> {
    let family = (i % 5) as u32;
    let n = 1 + (i.wrapping_mul(7919) % 3000) as usize;
    (0..n as u32)
        .map(|j| {
            if (j as usize) < n / 2 {
                family * 1_000_000 + j
            } else {
                1_000_000_000 + (i as u32) * 4096 + j
            }
        })
        .collect()
}

/// The writer process the test kills: stores entries as fast as it can, forever.
#[test]
#[ignore = "child process of kill_9_during_writes_never_leaves_a_corrupt_entry"]
fn crash_writer_child() {
    let Some(root) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let start: u64 = std::env::var("WICK_CACHE_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (ssd, _) = SsdTier::open(config(Path::new(&root))).unwrap();
    for i in start.. {
        let t = tokens(i);
        let _ = ssd.store("", &t, &snapshot_for(&t), None);
    }
}

fn all_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(all_files(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// A small deterministic generator for kill delays.
fn delay_ms(round: u64) -> u64 {
    let mut x = round.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef;
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 32;
    5 + x % 120
}

#[test]
fn kill_9_during_writes_never_leaves_a_corrupt_entry() {
    let root = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let rounds = 40;
    let mut restored = 0;
    let mut orphans = 0;
    let mut orphan_chunks = 0;
    let mut shared = 0;
    for round in 0..rounds {
        let mut child = Command::new(&exe)
            .args(["crash_writer_child", "--exact", "--ignored", "--nocapture"])
            .env(CHILD_DIR, root.path())
            .env("WICK_CACHE_CRASH_SEED", (round * 1000).to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(20 + delay_ms(round)));
        child.kill().unwrap(); // SIGKILL: no destructor, no flush
        child.wait().unwrap();

        let (ssd, report) = SsdTier::open(config(root.path())).unwrap();
        assert_eq!(
            (
                report.removed_corrupt,
                report.removed_mismatched,
                report.removed_unsupported
            ),
            (0, 0, 0),
            "round {round}: a crash left a damaged final file: {report:?}"
        );
        orphans += report.removed_orphans;
        let files = all_files(ssd.dir());
        assert!(
            files.iter().all(|f| !f.to_string_lossy().ends_with(".tmp")),
            "round {round}: the scan left temp files"
        );
        // Every entry on disk is complete and holds exactly its tokens' KV, chunks included.
        for f in files
            .iter()
            .filter(|f| f.extension().is_some_and(|x| x == "wkv"))
        {
            let mut fh = std::fs::File::open(f).unwrap();
            let h = format::read_header(&mut fh, f).unwrap();
            let snap = ssd.read_entry_file(f).unwrap();
            assert!(
                holds(&snap, &h.tokens),
                "round {round}: {} holds other KV",
                f.display()
            );
        }
        // Every chunk on disk is whole and some entry refers to it (the scan removed the
        // chunks a crash left without their entry).
        for f in files
            .iter()
            .filter(|f| f.extension().is_some_and(|x| x == "wkc"))
        {
            ssd.check_chunk_file(f).unwrap();
            let id = chunks::parse_file_name(&f.file_name().unwrap().to_string_lossy()).unwrap();
            let refs = ssd.chunk_refs(id).unwrap_or(0);
            assert!(
                refs > 0,
                "round {round}: {} is referenced by no entry",
                f.display()
            );
            shared += usize::from(refs > 1);
        }
        orphan_chunks += report.removed_unreferenced_chunks;
        // And lookups restore them through the tier.
        for family in 0..5u32 {
            let mut prompt: Vec<u32> = (0..1500).map(|j| family * 1_000_000 + j).collect();
            prompt.push(u32::MAX);
            if let Some(m) = ssd.find("", &prompt) {
                let snap = ssd.load(&m).unwrap();
                assert!(holds(&snap, &prompt[..m.usable]), "round {round}");
                restored += 1;
            }
        }
        assert_eq!(ssd.counters().restore_failures, 0);
        assert!(ssd.counters().bytes <= 128 << 20);
    }
    assert!(
        restored > rounds as usize,
        "too few entries to check: {restored}"
    );
    assert!(shared > 0, "no chunk was shared between entries");
    eprintln!(
        "{rounds} kills, {orphans} interrupted writes and {orphan_chunks} chunks without an entry cleaned, {restored} restores checked, {shared} shared chunks seen"
    );
}
