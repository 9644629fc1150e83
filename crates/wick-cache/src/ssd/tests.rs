//! SSD tier tests on real files in a temporary directory.
use super::*;
use crate::value::testing::FakeKv;
use crate::value::StateSnapshot;

fn cfg(root: &Path) -> SsdConfig {
    SsdConfig {
        root: root.to_path_buf(),
        fingerprint: "fp1".into(),
        model: "test".into(),
        max_bytes: 0,
        verify: false,
    }
}

/// The chunk files of a fingerprint directory.
fn chunk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(guard::chunk_dir(dir))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    out.sort();
    out
}

fn snap(tokens: &[u32]) -> KvSnapshot {
    FakeKv::new(tokens, None).snapshot
}

/// The entry (and temporary) files of every namespace directory.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in fs::read_dir(dir).unwrap().flatten() {
        if sub.path().is_dir() && sub.file_name() != guard::CHUNK_DIR {
            for f in fs::read_dir(sub.path()).unwrap().flatten() {
                out.push(f.path());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn store_find_load_after_reopen() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..300).collect();
    {
        let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
        assert_eq!(report, ScanReport::default());
        let out = ssd.store("", &t[..200], &snap(&t[..200]), None).unwrap();
        assert!(matches!(out, StoreOutcome::Stored { .. }));
        assert_eq!(
            ssd.store("", &t[..150], &snap(&t[..150]), None).unwrap(),
            StoreOutcome::AlreadyDurable
        );
        ssd.store("lora", &t[..100], &snap(&t[..100]), None)
            .unwrap();
    }
    // A new process: the index comes back from the files alone.
    let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(report.entries, 2);
    let m = ssd.find("", &t).unwrap();
    assert_eq!(m.usable, 200);
    let s = ssd.load(&m).unwrap();
    assert_eq!(FakeKv { snapshot: s }.stored_tokens(), t[..200].to_vec());
    // Trimmed to the prompt minus one.
    let m = ssd.find("", &t[..120]).unwrap();
    assert_eq!(m.usable, 119);
    assert_eq!(ssd.load(&m).unwrap().len(), 119);
    assert_eq!(ssd.find("lora", &t).unwrap().usable, 100);
    assert!(ssd.find("other", &t).is_none());
    assert_eq!(ssd.counters().restores, 2);
    assert_eq!(ssd.counters().longest_durable_prefix_tokens, 200);
}

/// Two tiers on one directory (two replicas): each restores what the other wrote, after
/// its start-up scan or a refresh, and sees the other's removals.
#[test]
fn two_tiers_share_one_directory() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..300).collect();
    let (a, _) = SsdTier::open(cfg(root.path())).unwrap();
    a.store("", &t[..100], &snap(&t[..100]), None).unwrap();
    // b starts later: its scan finds a's entry.
    let (b, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(report.entries, 1);
    let m = b.find("", &t).unwrap();
    assert_eq!(m.usable, 100);
    assert_eq!(b.load(&m).unwrap().len(), 100);
    // a writes more: b sees it after a refresh, not before.
    a.store("lora", &t[..50], &snap(&t[..50]), None).unwrap();
    assert!(b.find("lora", &t).is_none());
    let r = b.refresh();
    assert_eq!((r.added, r.dropped), (1, 0));
    assert_eq!(b.find("lora", &t).unwrap().usable, 50);
    assert_eq!(b.refresh(), RefreshReport::default());
    // b writes a longer entry of the same conversation: it supersedes (deletes) a's file.
    b.store("", &t[..200], &snap(&t[..200]), None).unwrap();
    assert_eq!(files(b.dir()).len(), 2);
    // a still has the old entry indexed: its restore is a quiet miss, not a failure.
    let stale = a.find("", &t).unwrap();
    assert_eq!(stale.usable, 100);
    assert!(a.load(&stale).is_err());
    assert_eq!(a.counters().restore_failures, 0);
    // The miss freed the old entry's chunks, so `a` re-read the directory before removing
    // any (finding b's entry, which still needs them) or does so now.
    a.refresh();
    assert_eq!(a.counters().entries, 2);
    let m = a.find("", &t).unwrap();
    assert_eq!(m.usable, 200);
    assert_eq!(a.load(&m).unwrap().len(), 200);
    // Both store the same prefix: one file, both restore it.
    a.store("", &t[..250], &snap(&t[..250]), None).unwrap();
    b.refresh();
    assert_eq!(
        b.store("", &t[..250], &snap(&t[..250]), None).unwrap(),
        StoreOutcome::AlreadyDurable
    );
    assert_eq!(files(a.dir()).len(), 2);
    assert_eq!(a.counters().bytes, b.counters().bytes);
}

/// A file one tier evicts while another reads it: the reader either gets the whole, verified
/// entry or a miss — never damaged data, never a removed file of its own making.
#[test]
fn eviction_is_safe_with_a_concurrent_reader() {
    use std::sync::atomic::AtomicBool;
    let root = tempfile::tempdir().unwrap();
    let one = {
        let (probe, _) = SsdTier::open(cfg(&root.path().join("probe"))).unwrap();
        probe.store("", &[0; 64], &snap(&[0; 64]), None).unwrap();
        probe.counters().bytes
    };
    let capped = SsdConfig {
        max_bytes: one * 3,
        ..cfg(root.path())
    };
    let (writer, _) = SsdTier::open(capped.clone()).unwrap();
    let (reader, _) = SsdTier::open(capped).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let stop = done.clone();
    let reads = std::thread::spawn(move || {
        let (mut ok, mut missed) = (0, 0);
        for i in 0..100_000u32 {
            if stop.load(Ordering::Relaxed) && i > 50 {
                break;
            }
            reader.refresh();
            for e in reader.entries() {
                let mut p = e.tokens.to_vec();
                p.push(7);
                let Some(m) = reader.find("", &p) else {
                    continue;
                };
                match reader.load(&m) {
                    Ok(s) => {
                        assert_eq!(FakeKv { snapshot: s }.stored_tokens(), e.tokens.to_vec());
                        ok += 1;
                    }
                    Err(CacheError::Io { .. }) | Err(CacheError::Value { .. }) => missed += 1,
                    Err(other) => panic!("a concurrent eviction damaged a read: {other}"),
                }
            }
        }
        (ok, missed, reader.counters().restore_failures)
    });
    for round in 0..40u32 {
        let toks = vec![round + 1; 64];
        writer.store("", &toks, &snap(&toks), None).unwrap();
        assert!(writer.counters().bytes <= one * 3);
    }
    done.store(true, Ordering::Relaxed);
    let (ok, _missed, failures) = reads.join().unwrap();
    assert!(ok > 0);
    assert_eq!(failures, 0);
    assert!(files(&root.path().join("fp1")).len() <= 3);
}

#[test]
fn supersedes_ancestors_unless_untrimmable() {
    let root = tempfile::tempdir().unwrap();
    let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
    let t: Vec<u32> = (0..400).collect();
    ssd.store("", &t[..100], &snap(&t[..100]), None).unwrap();
    let out = ssd.store("", &t[..200], &snap(&t[..200]), None).unwrap();
    assert!(matches!(out, StoreOutcome::Stored { superseded: 1, .. }));
    // A wrapped ring cannot stand in for its ancestor.
    let ring = FakeKv::new(&t, Some(16)).snapshot;
    let out = ssd.store("", &t, &ring, None).unwrap();
    assert!(matches!(out, StoreOutcome::Stored { superseded: 0, .. }));
    assert_eq!(ssd.counters().entries, 2);
    assert_eq!(files(ssd.dir()).len(), 2);
    // A prompt diverging inside the ring's range is served by the 200-token entry.
    let mut p = t[..300].to_vec();
    p.push(9999);
    assert_eq!(ssd.find("", &p).unwrap().usable, 200);
}

#[test]
fn lru_by_mtime_under_the_cap() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..100).collect();
    let one = {
        let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
        ssd.store("probe", &t[..50], &snap(&t[..50]), None).unwrap();
        ssd.counters().bytes
    };
    fs::remove_dir_all(root.path().join("fp1")).unwrap();
    let (ssd, _) = SsdTier::open(SsdConfig {
        max_bytes: one * 2,
        ..cfg(root.path())
    })
    .unwrap();
    let a: Vec<u32> = vec![1; 50];
    let b: Vec<u32> = vec![2; 50];
    let c: Vec<u32> = vec![3; 50];
    ssd.store("", &a, &snap(&a), None).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    ssd.store("", &b, &snap(&b), None).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    // Restoring `a` makes `b` the oldest.
    let mut pa = a.clone();
    pa.push(0);
    let m = ssd.find("", &pa).unwrap();
    ssd.load(&m).unwrap();
    ssd.store("", &c, &snap(&c), None).unwrap();
    let mut left: Vec<u32> = ssd.entries().iter().map(|e| e.tokens[0]).collect();
    left.sort();
    assert_eq!(left, vec![1, 3]);
    assert!(ssd.counters().bytes <= one * 2);
    // Bigger than the whole cap: refused.
    let big: Vec<u32> = vec![5; 400];
    assert!(matches!(
        ssd.store("", &big, &snap(&big), None),
        Err(CacheError::TooLarge { .. })
    ));
    assert_eq!(ssd.counters().store_failures, 1);
}

#[test]
fn scan_removes_bad_files_and_never_touches_other_fingerprints() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..64).collect();
    {
        let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
        ssd.store("", &t, &snap(&t), None).unwrap();
        ssd.store("", &[7; 10], &snap(&[7; 10]), None).unwrap();
        ssd.store("", &[8; 10], &snap(&[8; 10]), None).unwrap();
        ssd.store("", &[9; 10], &snap(&[9; 10]), None).unwrap();
    }
    let ours = files(&root.path().join("fp1"));
    assert_eq!(ours.len(), 4);
    // A foreign fingerprint's directory with a valid file of its own.
    {
        let (other, _) = SsdTier::open(SsdConfig {
            fingerprint: "fp2".into(),
            ..cfg(root.path())
        })
        .unwrap();
        other.store("", &t, &snap(&t), None).unwrap();
    }
    let foreign = files(&root.path().join("fp2"));
    // Damage ours: truncate one, flip a header bit in another, a payload bit in a third
    // (caught on restore, or at scan with verify), plant a foreign-fingerprint file, a
    // wrong-version file and an orphan temp file.
    let base = root.path().join("fp1").join("base");
    let by_first = |x: u32| {
        ours.iter()
            .find(|p| {
                let mut f = File::open(p).unwrap();
                format::read_header(&mut f, p).unwrap().tokens[0] == x
            })
            .unwrap()
            .clone()
    };
    let (truncated, header_flip, payload_flip, good) =
        (by_first(7), by_first(8), by_first(9), by_first(0));
    let bytes = fs::read(&truncated).unwrap();
    fs::write(&truncated, &bytes[..bytes.len() - 3]).unwrap();
    let mut bytes = fs::read(&header_flip).unwrap();
    bytes[40] ^= 1;
    fs::write(&header_flip, &bytes).unwrap();
    let mut bytes = fs::read(&payload_flip).unwrap();
    let n = bytes.len();
    bytes[n - 2] ^= 0x40;
    fs::write(&payload_flip, &bytes).unwrap();
    let planted = base.join(entry_file_name("", &[1, 2, 3]));
    fs::copy(&foreign[0], &planted).unwrap();
    let mut v2 = fs::read(&good).unwrap();
    v2[8] = 9; // a version this build does not know
    let wrong_version = base.join(entry_file_name("", &[4, 5, 6]));
    fs::write(&wrong_version, &v2).unwrap();
    let orphan = base.join(format!("{}.1.1.tmp", entry_file_name("", &[4, 4])));
    fs::write(&orphan, b"half a file").unwrap();
    // Not named as the tier names its files: never taken for one of ours.
    let strays = [base.join("x.wkv.1.1.tmp"), base.join("notes.wkv")];
    for s in &strays {
        fs::write(s, b"someone else's").unwrap();
    }

    let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(report.removed_orphans, 1);
    assert_eq!(report.removed_corrupt, 2, "{report:?}");
    assert_eq!(report.removed_unsupported, 1);
    assert_eq!(report.removed_mismatched, 1);
    assert_eq!(report.entries, 2);
    assert!(!orphan.exists() && !truncated.exists() && !header_flip.exists());
    assert!(!planted.exists() && !wrong_version.exists());
    assert!(strays.iter().all(|s| s.exists()));
    // The foreign directory is untouched.
    assert_eq!(files(&root.path().join("fp2")), foreign);
    // The payload flip is caught on restore: a miss, and the file is gone.
    let mut p = vec![9; 10];
    p.push(1);
    let m = ssd.find("", &p).unwrap();
    assert!(matches!(ssd.load(&m), Err(CacheError::Corrupt { .. })));
    assert!(!payload_flip.exists());
    assert!(ssd.find("", &p).is_none());
    assert_eq!(ssd.counters().restore_failures, 1);
    drop(ssd);
    // With verify the scan itself catches payload damage: here in the chunk the 64-token
    // entry keeps all of its rows in; the chunk and the entry that needs it are removed.
    let chunk = chunk_files(&root.path().join("fp1")).pop().unwrap();
    let mut bytes = fs::read(&chunk).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0x01;
    fs::write(&chunk, &bytes).unwrap();
    let (_ssd, report) = SsdTier::open(SsdConfig {
        verify: true,
        ..cfg(root.path())
    })
    .unwrap();
    assert_eq!(report.removed_corrupt, 2, "{report:?}");
    assert_eq!(report.entries, 0);
    assert!(!chunk.exists() && !good.exists());
}

#[test]
fn checkpoints_are_isolated_and_replaced() {
    let root = tempfile::tempdir().unwrap();
    let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
    let prompt: Vec<u32> = (0..20).collect();
    let key = CheckpointKey::builder().tokens("prompt", &prompt).finish();
    let save = |generated: &[u32]| {
        let mut kv_tokens = prompt.clone();
        kv_tokens.extend_from_slice(&generated[..generated.len() - 1]);
        let meta = CheckpointMeta {
            key: key.hex(),
            cache_namespace: String::new(),
            prompt_tokens: prompt.len(),
            generated: generated.to_vec(),
        };
        ssd.store(&key.namespace(), &kv_tokens, &snap(&kv_tokens), Some(&meta))
            .unwrap();
    };
    save(&[100, 101, 102]);
    save(&[100, 101, 102, 103, 104]);
    assert_eq!(
        ssd.counters().checkpoints,
        1,
        "the older checkpoint is replaced"
    );
    let (m, meta) = ssd.find_checkpoint(key, "", &prompt).unwrap();
    assert_eq!(meta.generated, vec![100, 101, 102, 103, 104]);
    assert_eq!(ssd.load(&m).unwrap().len(), prompt.len() + 4);
    // Never a prefix match for ordinary lookups, in any namespace.
    let mut p = prompt.clone();
    p.extend([100, 101, 102, 103, 104, 105]);
    assert!(ssd.find("", &p).is_none());
    assert!(ssd.find(&key.namespace(), &p).is_none());
    // Other keys, namespaces or prompts do not resume.
    let other = CheckpointKey::builder().tokens("prompt", &[1]).finish();
    assert!(ssd.find_checkpoint(other, "", &prompt).is_none());
    assert!(ssd.find_checkpoint(key, "lora", &prompt).is_none());
    assert!(ssd.find_checkpoint(key, "", &prompt[..19]).is_none());
    // Survives a restart, then is removed.
    drop(ssd);
    let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(report.entries, 1);
    assert!(ssd.find_checkpoint(key, "", &prompt).is_some());
    assert_eq!(ssd.remove_checkpoints(key), 1);
    assert!(ssd.find_checkpoint(key, "", &prompt).is_none());
    assert_eq!(files(ssd.dir()).len(), 0);
}

#[cfg(unix)]
#[test]
fn special_files_never_block_the_scan_and_are_skipped_quietly() {
    use std::os::unix::ffi::OsStrExt;
    use std::sync::mpsc;
    use std::time::Duration;

    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..40).collect();
    {
        let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
        ssd.store("base", &t, &snap(&t), None).unwrap();
    }
    let real = files(&root.path().join("fp1")).pop().unwrap();
    let ns_dir = real.parent().unwrap().to_path_buf();
    // A FIFO with an entry's name: opening it for reading without O_NONBLOCK waits forever
    // for a writer.
    let fifo = ns_dir.join(format!("{}fifo.{EXTENSION}", "0".repeat(8)));
    let c_path = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
    // The real entry's name taken by a FIFO too (so the name filter cannot save the scan).
    let squatted = real.with_extension("tmpfifo");
    fs::rename(&real, &squatted).unwrap();
    let c_real = std::ffi::CString::new(real.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c_real.as_ptr(), 0o644) }, 0);
    // A directory and a symbolic link named like entries.
    fs::create_dir(ns_dir.join(format!("dir.{EXTENSION}"))).unwrap();
    std::os::unix::fs::symlink(&squatted, ns_dir.join(format!("link.{EXTENSION}"))).unwrap();

    let (tx, rx) = mpsc::channel();
    let root_path = root.path().to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(SsdTier::open(cfg(&root_path)).map(|(_, report)| report));
    });
    let report = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the scan hung on a special file")
        .unwrap();
    assert_eq!(report.entries, 0);
    assert_eq!(report.skipped_not_files, 4, "{report:?}");
    assert_eq!(report.removed_corrupt + report.removed_mismatched, 0);
    // Nothing that is not ours was removed.
    assert!(fifo.exists() && real.exists() && ns_dir.join(format!("dir.{EXTENSION}")).is_dir());
}

#[cfg(unix)]
#[test]
fn open_regular_refuses_what_is_not_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    fs::write(&file, b"x").unwrap();
    assert!(open_regular(&file).is_ok());
    assert!(matches!(
        open_regular(dir.path()),
        Err(CacheError::NotAFile { .. })
    ));
    let link = dir.path().join("l");
    std::os::unix::fs::symlink(&file, &link).unwrap();
    assert!(matches!(
        open_regular(&link),
        Err(CacheError::NotAFile { .. })
    ));
}

/// The serving path never waits for the start-up scan: a directory of many entries and a FIFO
/// opens in the background, lookups during the scan answer (a miss for what is not yet
/// indexed), a store during the scan is kept, and every entry is restorable once it is done.
#[cfg(unix)]
#[test]
fn the_background_scan_indexes_many_entries_while_lookups_and_stores_go_on() {
    use std::os::unix::ffi::OsStrExt;
    use std::sync::mpsc;
    use std::time::Duration;
    const N: u32 = 400;
    let root = tempfile::tempdir().unwrap();
    let prompts: Vec<Vec<u32>> = (0..N).map(|i| vec![i + 1, 7, 8, 9, 10, 11]).collect();
    {
        let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
        for p in &prompts {
            ssd.store("", p, &snap(p), None).unwrap();
        }
    }
    let ns_dir = files(&root.path().join("fp1"))[0]
        .parent()
        .unwrap()
        .to_path_buf();
    let fifo = ns_dir.join(format!("{}.{EXTENSION}", "f".repeat(32)));
    let c_path = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
    // An orphan of a crashed writer: removed by the scan.
    let orphan = ns_dir.join(format!("{}.{EXTENSION}.1.0.tmp", "0".repeat(32)));
    fs::write(&orphan, b"half").unwrap();
    let old = SystemTime::now() - Duration::from_secs(3600);
    File::options()
        .write(true)
        .open(&orphan)
        .unwrap()
        .set_modified(old)
        .unwrap();

    let (tx, rx) = mpsc::channel();
    let root_path = root.path().to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(SsdTier::open_in_background(cfg(&root_path)));
    });
    let ssd = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("opening waited for the scan")
        .unwrap();
    // Lookups and a store while the scan may still run: none of them waits for it.
    let fresh: Vec<u32> = vec![9999, 1, 2, 3];
    let mut lookups = 0;
    while ssd.scan_report().is_none() && lookups < 10_000 {
        let _ = ssd.find("", &prompts[lookups % N as usize]);
        if lookups == 0 {
            let out = ssd.store("", &fresh, &snap(&fresh), None).unwrap();
            assert!(matches!(out, StoreOutcome::Stored { .. }), "{out:?}");
        }
        lookups += 1;
    }
    let report = ssd
        .wait_for_scan(Duration::from_secs(60))
        .expect("the scan never finished");
    if lookups == 0 {
        ssd.store("", &fresh, &snap(&fresh), None).unwrap();
    }
    assert_eq!(report.skipped_not_files, 1, "{report:?}");
    assert_eq!(report.removed_orphans, 1, "{report:?}");
    assert!(!orphan.exists() && fifo.exists());
    assert_eq!(ssd.entries().len(), N as usize + 1, "{report:?}");
    for p in prompts.iter().chain([&fresh]) {
        let mut longer = p.clone();
        longer.push(1);
        let m = ssd.find("", &longer).expect("indexed");
        assert_eq!(m.usable, p.len());
        assert_eq!(ssd.load(&m).unwrap().len(), p.len());
    }
    // The entry stored during the scan is indexed once, not again by the scan.
    assert_eq!(ssd.counters().entries, N as usize + 1);
}

/// A `.tmp` file a live owner (this tier, or another process sharing the directory) is writing
/// is not an orphan; one whose owner died is, and so is the dead owner's lock file.
#[test]
fn the_scan_leaves_live_writers_in_progress_alone() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..20).collect();
    let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
    ssd.store("", &t, &snap(&t), None).unwrap();
    let (other, _) = SsdTier::open(cfg(root.path())).unwrap();
    let ns_dir = files(&root.path().join("fp1"))[0]
        .parent()
        .unwrap()
        .to_path_buf();
    let name = |c: char| format!("{}.{EXTENSION}", c.to_string().repeat(32));
    let ours = ns_dir.join(ssd.owner.tmp_name(&name('a'), 0));
    let theirs = ns_dir.join(other.owner.tmp_name(&name('b'), 0));
    let dead = ns_dir.join(format!("{}.deadhost-1-0.1.tmp", name('c')));
    let legacy = ns_dir.join(format!("{}.12345.1.tmp", name('d')));
    // Named otherwise: not the tier's, whoever wrote it.
    let foreign = ns_dir.join("notes.wkv.deadhost-1-0.1.tmp");
    for p in [&ours, &theirs, &dead, &legacy, &foreign] {
        fs::write(p, b"x").unwrap();
    }
    fs::write(
        root.path().join("fp1").join(".owner-deadhost-1-0.lock"),
        b"",
    )
    .unwrap();
    let report = ssd.scan_dir().unwrap();
    assert_eq!(ssd.entries().len(), 1);
    assert_eq!(report.removed_orphans, 2, "{report:?}");
    assert_eq!(report.removed_stale_locks, 1);
    assert!(ours.exists() && theirs.exists() && !dead.exists() && !legacy.exists());
    assert!(foreign.exists());
    // Once `other` is gone, its leftovers are orphans.
    drop(other);
    let report = ssd.scan_dir().unwrap();
    assert_eq!(report.removed_orphans, 1);
    assert!(ours.exists() && !theirs.exists() && foreign.exists());
}

/// A snapshot of two full-attention layers and one sliding-window layer (window `window`,
/// wrapped like a ring once `tokens` is longer than twice the window), of 2 heads of 32
/// floats whose values encode layer, token and position.
fn mixed(tokens: &[u32], window: usize) -> KvSnapshot {
    let layer = |i: usize, window: Option<usize>| {
        let len = tokens.len();
        let start = match window {
            Some(w) if len > 2 * w => len + 1 - w,
            _ => 0,
        };
        let keys: Vec<f32> = (start..len)
            .flat_map(|p| {
                (0..64).map(move |d| (tokens[p] as f32) + (p * 64 + d) as f32 * 1e-3 + i as f32)
            })
            .collect();
        let values = keys.iter().map(|k| -k).collect();
        LayerSnapshot {
            start,
            len,
            kv_heads: 2,
            head_dim: 32,
            window,
            keys,
            values,
        }
    };
    KvSnapshot {
        layers: vec![layer(0, None), layer(1, Some(window)), layer(2, None)],
        recurrent: Vec::new(),
    }
}

/// A conversation that grows turn by turn: each turn writes the chunks its new tokens
/// complete and a small entry file, supersedes the last turn's entry, and every entry
/// restores exactly, before and after a restart, whole or cut back.
#[test]
fn a_growing_conversation_is_stored_once() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..1000).map(|i| i * 7 + 1).collect();
    let lens = [150, 230, 300, 470, 520, 700, 1000];
    // A window the conversation never fills: two groups (full layers, window layer), both
    // chunked from position 0.
    let window = 4000;
    let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
    let mut whole = 0;
    let mut written = 0;
    for &n in &lens {
        let s = mixed(&t[..n], window);
        let StoreOutcome::Stored { bytes, .. } = ssd.store("", &t[..n], &s, None).unwrap() else {
            panic!("not stored")
        };
        whole += s.byte_size() as u64;
        written += bytes;
        let mut p = t[..n].to_vec();
        p.push(5);
        let m = ssd.find("", &p).unwrap();
        assert_eq!(m.usable, n);
        assert_eq!(ssd.load(&m).unwrap(), s);
    }
    assert!(
        written * 2 < whole,
        "{written} bytes written for {whole} bytes of entries"
    );
    // One entry left (each turn superseded the last), every chunk on disk once: 15 chunks
    // of 64 positions up to 960, per group.
    assert_eq!(files(ssd.dir()).len(), 1);
    let chunks = chunk_files(ssd.dir());
    assert_eq!(chunks.len(), 30);
    assert!(chunks.iter().all(|c| ssd.check_chunk_file(c).is_ok()));
    let bytes = ssd.counters().bytes;
    drop(ssd);
    let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!((report.entries, report.chunks), (1, 30), "{report:?}");
    assert_eq!(report.bytes, bytes);
    assert_eq!(report.removed_unreferenced_chunks, 0);
    // A prompt diverging at 600 restores 600 tokens: chunks up to 640, cut back.
    let mut p = t[..600].to_vec();
    p.push(3);
    let m = ssd.find("", &p).unwrap();
    assert_eq!(m.usable, 600);
    assert_eq!(ssd.load(&m).unwrap(), mixed(&t[..600], window));
}

/// Sliding-window layers that wrapped keep only their last positions: they are chunked over
/// what they still hold, the full layers over everything. Entries that cannot be cut back
/// are all kept, sharing the full layers' chunks, and each restores exactly.
#[test]
fn wrapped_windows_share_the_full_layers_chunks() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..900).map(|i| i * 3 + 2).collect();
    let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
    let lens = [400, 650, 900];
    for &n in &lens {
        let s = mixed(&t[..n], 100);
        assert!(s.trim_floor() > 0);
        ssd.store("", &t[..n], &s, None).unwrap();
    }
    assert_eq!(
        ssd.counters().entries,
        3,
        "untrimmable entries are not superseded"
    );
    // The first chunk of the full layers is shared by all three entries.
    let first = chunk_files(ssd.dir())
        .into_iter()
        .map(|p| chunks::parse_file_name(&p.file_name().unwrap().to_string_lossy()).unwrap())
        .max_by_key(|&id| ssd.chunk_refs(id).unwrap())
        .unwrap();
    assert_eq!(ssd.chunk_refs(first), Some(3));
    drop(ssd);
    let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(ssd.chunk_refs(first), Some(3));
    for &n in &lens {
        let mut p = t[..n].to_vec();
        p.push(1);
        let m = ssd.find("", &p).unwrap();
        assert_eq!(m.usable, n);
        assert_eq!(ssd.load(&m).unwrap(), mixed(&t[..n], 100), "{n} tokens");
    }
}

fn id_of(chunk: &Path) -> ChunkId {
    chunks::parse_file_name(&chunk.file_name().unwrap().to_string_lossy()).unwrap()
}

/// Two conversations share a 128-token system prompt. Evicting one keeps the two chunks the
/// other still refers to and removes only its own; after a restart the counts are the same.
#[test]
fn evicting_an_entry_keeps_the_chunks_another_one_shares() {
    let root = tempfile::tempdir().unwrap();
    let system: Vec<u32> = (0..128).map(|i| 90_000 + i).collect();
    let conv = |salt: u32, n: u32| {
        let mut t = system.clone();
        t.extend((0..n).map(|i| salt * 1000 + i));
        t
    };
    let a = conv(1, 100); // 228 tokens: chunks 0..192, three of them
    let b = conv(2, 80); // 208 tokens: chunks 0..192, the first two shared with `a`
    let c = conv(3, 20);
    // What `a` and `b` take together (sharing their first chunks): `c` does not fit too.
    let cap = {
        let probe = tempfile::tempdir().unwrap();
        let (p, _) = SsdTier::open(cfg(probe.path())).unwrap();
        p.store("", &a, &mixed(&a, 4000), None).unwrap();
        p.store("", &b, &mixed(&b, 4000), None).unwrap();
        p.counters().bytes
    };
    let (ssd, _) = SsdTier::open(SsdConfig {
        max_bytes: cap,
        ..cfg(root.path())
    })
    .unwrap();
    ssd.store("", &a, &mixed(&a, 4000), None).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    ssd.store("", &b, &mixed(&b, 4000), None).unwrap();
    let shared: Vec<ChunkId> = chunk_files(ssd.dir())
        .iter()
        .map(|p| id_of(p))
        .filter(|&id| ssd.chunk_refs(id) == Some(2))
        .collect();
    // Two groups (full layers, window layer), two shared chunks each.
    assert_eq!(shared.len(), 4);
    assert_eq!(chunk_files(ssd.dir()).len(), 8);
    std::thread::sleep(std::time::Duration::from_millis(20));
    // `c` evicts the oldest, `a`: its own third chunks go, the shared ones stay for `b`.
    let out = ssd.store("", &c, &mixed(&c, 4000), None).unwrap();
    assert!(
        matches!(out, StoreOutcome::Stored { evicted: 1, .. }),
        "{out:?}"
    );
    let mut pa = a.clone();
    pa.push(0);
    assert_eq!(
        ssd.find("", &pa).map(|m| m.usable),
        Some(128),
        "only `b`'s prefix is left"
    );
    for id in &shared {
        assert_eq!(
            ssd.chunk_refs(*id),
            Some(2),
            "`b` and `c` share the system prompt"
        );
    }
    let on_disk: HashSet<ChunkId> = chunk_files(ssd.dir()).iter().map(|p| id_of(p)).collect();
    // b's three per group (c's two are the shared ones): a's own third ones are gone.
    assert_eq!(on_disk.len(), 2 * 3, "a's own chunks removed");
    assert!(shared.iter().all(|id| on_disk.contains(id)));
    assert!(ssd.counters().bytes <= cap);
    let mut pb = b.clone();
    pb.push(0);
    let m = ssd.find("", &pb).unwrap();
    assert_eq!(ssd.load(&m).unwrap(), mixed(&b, 4000));
    drop(ssd);
    // The counts come back from the files alone.
    let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!((report.entries, report.chunks), (2, 6), "{report:?}");
    assert_eq!(report.removed_unreferenced_chunks, 0);
    for id in &shared {
        assert_eq!(ssd.chunk_refs(*id), Some(2));
    }
    let mut pc = c.clone();
    pc.push(0);
    let m = ssd.find("", &pc).unwrap();
    assert_eq!(ssd.load(&m).unwrap(), mixed(&c, 4000));
}

/// Two processes on one directory: `a` evicts an entry whose chunks `b`'s newer entry reuses
/// (`b` found them on disk and wrote none). `a` has not seen `b`'s entry, yet keeps them: it
/// re-reads the directory under the exclusive chunk lock before removing any.
#[test]
fn a_chunk_another_process_still_needs_is_never_removed() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..200).map(|i| i + 500).collect();
    let mut other = t.clone();
    other.extend([1, 2, 3]);
    let f: Vec<u32> = (0..150).map(|i| i + 77_000).collect();
    // `a` holds one of `t` or `f`, not both.
    let cap = {
        let probe = tempfile::tempdir().unwrap();
        let (p, _) = SsdTier::open(cfg(probe.path())).unwrap();
        p.store("", &t, &mixed(&t, 4000), None).unwrap();
        p.counters().bytes
    };
    let (a, _) = SsdTier::open(SsdConfig {
        max_bytes: cap,
        ..cfg(root.path())
    })
    .unwrap();
    a.store("", &t, &mixed(&t, 4000), None).unwrap();
    let (b, _) = SsdTier::open(cfg(root.path())).unwrap();
    let out = b.store("", &other, &mixed(&other, 4000), None).unwrap();
    let StoreOutcome::Stored { bytes, .. } = out else {
        panic!("{out:?}")
    };
    // Only b's entry file was written: its chunks were on disk already.
    let b_entry = fp_entry(root.path(), "", &other);
    assert_eq!(bytes, fs::metadata(&b_entry).unwrap().len());
    // b's entry superseded `t` (b removed its file); `a`, which has not seen b's entry,
    // drops `t` when it makes room for `f`: t's chunks are unreferenced in a's index, but
    // b's entry on disk refers to them.
    std::thread::sleep(std::time::Duration::from_millis(20));
    a.store("", &f, &mixed(&f, 4000), None).unwrap();
    let mut p = other.clone();
    p.push(9);
    let m = b.find("", &p).unwrap();
    assert_eq!(m.usable, other.len());
    assert_eq!(b.load(&m).unwrap(), mixed(&other, 4000));
    assert_eq!(b.counters().restore_failures, 0);
    // A third process finds every chunk on disk referenced.
    let (c, _) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(c.counters().entries, 2);
    for ch in chunk_files(c.dir()) {
        assert!(c.chunk_refs(id_of(&ch)).unwrap() > 0);
    }
}

/// A write killed half-way (a temporary chunk file), one killed between its chunks and its
/// entry (whole chunks no entry refers to), and a chunk torn in place (a disk that lost the
/// end of a renamed file): none is ever read. The scan removes the first two, and the torn
/// chunk with the entries that need it; a chunk damaged later is caught on restore.
#[test]
fn torn_chunk_writes_are_never_read() {
    let root = tempfile::tempdir().unwrap();
    let fp = root.path().join("fp1");
    let t: Vec<u32> = (0..260).map(|i| i * 11).collect();
    let u: Vec<u32> = (0..200).map(|i| i * 13 + 1).collect();
    {
        let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
        ssd.store("", &t, &mixed(&t, 4000), None).unwrap();
        ssd.store("", &u, &mixed(&u, 4000), None).unwrap();
    }
    let cdir = guard::chunk_dir(&fp);
    let entry_of = |x: &[u32]| fp.join("base").join(entry_file_name("", x));
    // Whole chunks without their entry: a third conversation's, its entry file removed as if
    // the process died before renaming it.
    let v: Vec<u32> = (0..130).map(|i| i * 17 + 5).collect();
    {
        let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
        ssd.store("", &v, &mixed(&v, 4000), None).unwrap();
    }
    fs::remove_file(entry_of(&v)).unwrap();
    // An interrupted chunk write of a process that died (no lock held).
    let half = cdir.join(format!("{}.deadhost-9-0.3.tmp", chunks::file_name(0xdead)));
    fs::write(&half, &fs::read(&chunk_files(&fp)[0]).unwrap()[..100]).unwrap();
    // A chunk of `u` torn in place: the file ends early.
    let u_chunk = {
        let path = entry_of(&u);
        let mut f = File::open(&path).unwrap();
        let h = format::read_header(&mut f, &path).unwrap();
        cdir.join(chunks::file_name(chunks::refs(&h)[1].id))
    };
    let bytes = fs::read(&u_chunk).unwrap();
    fs::write(&u_chunk, &bytes[..bytes.len() - 40]).unwrap();

    let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(report.removed_orphans, 1, "{report:?}");
    // v's four chunks (two per group) and u's five others: none left without its entry.
    assert_eq!(report.removed_unreferenced_chunks, 4 + 5, "{report:?}");
    // The torn chunk and the entry that needs it.
    assert_eq!(report.removed_corrupt, 2, "{report:?}");
    assert!(!half.exists() && !u_chunk.exists() && !entry_of(&u).exists());
    assert_eq!(report.entries, 1);
    let mut pu = u.clone();
    pu.push(0);
    assert!(ssd.find("", &pu).is_none_or(|m| m.usable < 64));
    // Every chunk left is whole and referenced.
    for c in chunk_files(&fp) {
        ssd.check_chunk_file(&c).unwrap();
        assert!(ssd.chunk_refs(id_of(&c)).unwrap() > 0);
    }
    // Damage after the scan: caught by the hashes on restore, a miss, and removed.
    let t_chunk = ssd.chunk_path(ssd.entries()[0].chunks[2]);
    let mut bytes = fs::read(&t_chunk).unwrap();
    let n = bytes.len();
    bytes[n - 7] ^= 0x20;
    fs::write(&t_chunk, &bytes).unwrap();
    let mut pt = t.clone();
    pt.push(0);
    let m = ssd.find("", &pt).unwrap();
    assert!(matches!(ssd.load(&m), Err(CacheError::Corrupt { .. })));
    assert_eq!(ssd.counters().restore_failures, 1);
    assert!(!t_chunk.exists() && !entry_of(&t).exists());
    assert!(ssd.find("", &pt).is_none());
    // Nothing of ours is left behind: the entry's other chunks were collected.
    assert_eq!(ssd.counters().entries, 0);
    assert!(chunk_files(&fp).is_empty());
}

/// A hybrid model's recurrent state summarizes every token, so it stays in each entry; the
/// attention layers' rows are shared. Every turn's entry is kept (it serves only its exact
/// length) and restores exactly, state included.
#[test]
fn recurrent_state_stays_in_each_entry_while_its_kv_is_shared() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..500).map(|i| i * 5 + 3).collect();
    let with_state = |n: usize| {
        let mut s = mixed(&t[..n], 4000);
        s.recurrent = vec![
            StateSnapshot {
                conv: vec![n as f32; 12],
                ssm: (0..96).map(|i| (i * n) as f32).collect(),
            };
            2
        ];
        s
    };
    let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
    let mut written = Vec::new();
    for n in [200, 330, 500] {
        let StoreOutcome::Stored {
            bytes, superseded, ..
        } = ssd.store("", &t[..n], &with_state(n), None).unwrap()
        else {
            panic!()
        };
        assert_eq!(superseded, 0, "an entry with state serves only its length");
        written.push(bytes);
    }
    // The later turns wrote their new rows, not the whole prefix again.
    let full = |n: usize| with_state(n).byte_size() as u64;
    assert!(written[2] < full(500) / 2, "{written:?}");
    assert_eq!(ssd.counters().entries, 3);
    drop(ssd);
    let (ssd, _) = SsdTier::open(SsdConfig {
        verify: true,
        ..cfg(root.path())
    })
    .unwrap();
    for n in [200, 330, 500] {
        let mut p = t[..n].to_vec();
        p.push(0);
        let m = ssd.find("", &p).unwrap();
        assert_eq!(m.usable, n);
        assert_eq!(ssd.load(&m).unwrap(), with_state(n));
        // A prompt diverging inside finds no entry of that length.
        let mut d = t[..n - 1].to_vec();
        d.push(7);
        assert!(ssd.find("", &d).is_none_or(|m| m.usable < n - 1));
    }
}

/// Entries written before chunks (format 1 and 2, every row in the entry file) still restore;
/// the next turn of such a conversation is written with chunks and supersedes it.
#[test]
fn entries_of_earlier_formats_still_restore() {
    let root = tempfile::tempdir().unwrap();
    let t: Vec<u32> = (0..400).map(|i| i + 77).collect();
    // Written whole (as formats 1 and 2 did), then marked with the older version.
    let old = |n: usize, version: u32| {
        let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
        ssd.set_chunk_tokens(0);
        ssd.store("lora", &t[..n], &mixed(&t[..n], 4000), None)
            .unwrap();
        let path = fp_entry(root.path(), "lora", &t[..n]);
        let mut bytes = fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&version.to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        path
    };
    let v1 = old(150, 1);
    // Another conversation, so the two files are not ancestor and descendant.
    let u: Vec<u32> = (0..250).map(|i| i + 9000).collect();
    let v2 = {
        let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
        ssd.set_chunk_tokens(0);
        ssd.store("lora", &u, &mixed(&u, 4000), None).unwrap();
        let path = fp_entry(root.path(), "lora", &u);
        let mut bytes = fs::read(&path).unwrap();
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        path
    };
    assert!(chunk_files(&root.path().join("fp1")).is_empty());
    let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(report.entries, 2, "{report:?}");
    for x in [&t[..150], &u[..]] {
        let mut p = x.to_vec();
        p.push(0);
        let m = ssd.find("lora", &p).unwrap();
        assert_eq!(m.usable, x.len());
        assert_eq!(ssd.load(&m).unwrap(), mixed(x, 4000));
    }
    let out = ssd.store("lora", &t, &mixed(&t, 4000), None).unwrap();
    assert!(
        matches!(out, StoreOutcome::Stored { superseded: 1, .. }),
        "{out:?}"
    );
    assert!(!v1.exists() && v2.exists());
    assert!(!chunk_files(&root.path().join("fp1")).is_empty());
    let mut p = t.clone();
    p.push(0);
    let m = ssd.find("lora", &p).unwrap();
    assert_eq!(ssd.load(&m).unwrap(), mixed(&t, 4000));
}

fn fp_entry(root: &Path, ns: &str, tokens: &[u32]) -> PathBuf {
    root.join("fp1")
        .join(dir_name(ns))
        .join(entry_file_name(ns, tokens))
}

/// A generation's checkpoints hold its prompt's KV: they share the prompt's chunks (written
/// once), and removing them keeps the chunks the prompt's entry still needs.
#[test]
fn checkpoints_share_their_prompts_chunks() {
    let root = tempfile::tempdir().unwrap();
    let (ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
    let prompt: Vec<u32> = (0..200).map(|i| i + 3).collect();
    ssd.store("", &prompt, &mixed(&prompt, 4000), None).unwrap();
    let chunks_before = chunk_files(ssd.dir()).len();
    let key = CheckpointKey::builder().tokens("prompt", &prompt).finish();
    let mut written = Vec::new();
    for n in [10u32, 40] {
        let generated: Vec<u32> = (0..n).map(|i| 7000 + i).collect();
        let mut kv_tokens = prompt.clone();
        kv_tokens.extend_from_slice(&generated[..generated.len() - 1]);
        let meta = CheckpointMeta {
            key: key.hex(),
            cache_namespace: String::new(),
            prompt_tokens: prompt.len(),
            generated,
        };
        let out = ssd
            .store(
                &key.namespace(),
                &kv_tokens,
                &mixed(&kv_tokens, 4000),
                Some(&meta),
            )
            .unwrap();
        let StoreOutcome::Stored { bytes, .. } = out else {
            panic!()
        };
        written.push(bytes);
    }
    // 200 + 39 tokens: the prompt's three chunks per group, nothing new up to 192.
    assert_eq!(chunk_files(ssd.dir()).len(), chunks_before);
    assert!(
        written[1] < mixed(&prompt, 4000).byte_size() as u64 / 2,
        "{written:?}"
    );
    let (m, meta) = ssd.find_checkpoint(key, "", &prompt).unwrap();
    assert_eq!(meta.generated.len(), 40);
    let mut kv_tokens = prompt.clone();
    kv_tokens.extend_from_slice(&meta.generated[..39]);
    assert_eq!(ssd.load(&m).unwrap(), mixed(&kv_tokens, 4000));
    assert_eq!(ssd.remove_checkpoints(key), 1);
    assert_eq!(chunk_files(ssd.dir()).len(), chunks_before);
    let mut p = prompt.clone();
    p.push(1);
    let m = ssd.find("", &p).unwrap();
    assert_eq!(ssd.load(&m).unwrap(), mixed(&prompt, 4000));
}

/// Issue 45: `<root>/<fingerprint>` planted as a link to another directory. The tier refuses
/// it and touches nothing there; links planted for the namespace and chunk directories inside
/// a real fingerprint directory are never entered; files in our directories that the tier did
/// not write stay.
#[cfg(unix)]
#[test]
fn links_in_the_cache_root_are_never_followed_and_nothing_outside_is_touched() {
    use std::os::unix::fs::symlink;
    let root = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    // What the scan removes in a directory of its own: temporary files, unparsable entries.
    let bait: Vec<PathBuf> = [
        format!("{}.wkv", "0".repeat(32)),
        format!("{}.wkc", "1".repeat(32)),
        format!("{}.wkv.dead-1-0.1.tmp", "2".repeat(32)),
        "a.tmp".into(),
        "b.wkv".into(),
        "precious.txt".into(),
    ]
    .iter()
    .map(|n| elsewhere.path().join(n))
    .collect();
    let plant = || {
        for b in &bait {
            fs::write(b, b"WICKKV\r\nnot really").unwrap();
        }
    };
    plant();
    for d in ["base", "chunks"] {
        fs::create_dir_all(elsewhere.path().join(d)).unwrap();
        for b in &bait {
            fs::write(
                elsewhere.path().join(d).join(b.file_name().unwrap()),
                b"WICKKV\r\nx",
            )
            .unwrap();
        }
    }
    let snapshot = |dir: &Path| -> Vec<(PathBuf, Vec<u8>)> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).unwrap().flatten() {
                if e.file_type().unwrap().is_dir() {
                    stack.push(e.path());
                } else {
                    out.push((e.path(), fs::read(e.path()).unwrap()));
                }
            }
        }
        out.sort();
        out
    };
    let before = snapshot(elsewhere.path());
    symlink(elsewhere.path(), root.path().join("fp1")).unwrap();
    let refused = SsdTier::open(cfg(root.path()));
    assert!(
        matches!(refused, Err(CacheError::Unsafe { .. })),
        "{:?}",
        refused.map(|_| ())
    );
    assert!(SsdTier::open_in_background(cfg(root.path())).is_err());
    assert_eq!(
        snapshot(elsewhere.path()),
        before,
        "a file outside the tier was touched"
    );

    // A real fingerprint directory whose namespace and chunk directories are links.
    fs::remove_file(root.path().join("fp1")).unwrap();
    fs::create_dir(root.path().join("fp1")).unwrap();
    symlink(elsewhere.path().join("base"), root.path().join("fp1/base")).unwrap();
    symlink(
        elsewhere.path().join("chunks"),
        root.path().join("fp1/chunks"),
    )
    .unwrap();
    let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(report.entries, 0);
    assert_eq!(
        snapshot(elsewhere.path()),
        before,
        "a file outside the tier was touched"
    );
    // Stores refuse to write through them either.
    let t: Vec<u32> = (0..100).collect();
    assert!(matches!(
        ssd.store("", &t, &mixed(&t, 4000), None),
        Err(CacheError::Unsafe { .. })
    ));
    assert_eq!(snapshot(elsewhere.path()), before);
    drop(ssd);

    // Our own directories with files the tier did not write (not its naming, or not its
    // magic): left alone.
    fs::remove_file(root.path().join("fp1/base")).unwrap();
    fs::remove_file(root.path().join("fp1/chunks")).unwrap();
    for d in ["base", "chunks"] {
        fs::create_dir(root.path().join("fp1").join(d)).unwrap();
        for (name, body) in [
            (format!("{}.wkv", "0".repeat(32)), &b"not a cache file"[..]),
            (format!("{}.wkc", "1".repeat(32)), b"not a cache file"),
            ("a.tmp".into(), b"WICKKV\r\n"),
            ("b.wkv".into(), b"WICKKV\r\n"),
            ("c.wkc".into(), b"WICKKC\r\n"),
            ("precious.txt".into(), b"x"),
        ] {
            fs::write(root.path().join("fp1").join(d).join(name), body).unwrap();
        }
    }
    let ours_before = snapshot(&root.path().join("fp1"));
    let (ssd, report) = SsdTier::open(SsdConfig {
        verify: true,
        ..cfg(root.path())
    })
    .unwrap();
    assert_eq!(
        report.removed_corrupt + report.removed_unreferenced_chunks,
        0,
        "{report:?}"
    );
    ssd.store("", &t, &mixed(&t, 4000), None).unwrap();
    drop(ssd);
    let (_ssd, _) = SsdTier::open(cfg(root.path())).unwrap();
    let ours_after = snapshot(&root.path().join("fp1"));
    assert!(
        ours_before.iter().all(|f| ours_after.contains(f)),
        "a file the tier did not write was removed"
    );
    assert_eq!(snapshot(elsewhere.path()), before);
}
