//! SSD tier tests on real files in a temporary directory.
use super::*;
use crate::value::testing::FakeKv;

fn cfg(root: &Path) -> SsdConfig {
    SsdConfig {
        root: root.to_path_buf(),
        fingerprint: "fp1".into(),
        model: "test".into(),
        max_bytes: 0,
        verify: false,
    }
}

fn snap(tokens: &[u32]) -> KvSnapshot {
    FakeKv::new(tokens, None).snapshot
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in fs::read_dir(dir).unwrap().flatten() {
        if sub.path().is_dir() {
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
    let r = a.refresh();
    assert_eq!(r.added, 1);
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
    v2[8] = 3; // a version this build does not know
    let wrong_version = base.join(entry_file_name("", &[4, 5, 6]));
    fs::write(&wrong_version, &v2).unwrap();
    let orphan = base.join("x.wkv.1.1.tmp");
    fs::write(&orphan, b"half a file").unwrap();

    let (ssd, report) = SsdTier::open(cfg(root.path())).unwrap();
    assert_eq!(report.removed_orphans, 1);
    assert_eq!(report.removed_corrupt, 2, "{report:?}");
    assert_eq!(report.removed_unsupported, 1);
    assert_eq!(report.removed_mismatched, 1);
    assert_eq!(report.entries, 2);
    assert!(!orphan.exists() && !truncated.exists() && !header_flip.exists());
    assert!(!planted.exists() && !wrong_version.exists());
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
    // With verify the scan itself catches payload damage.
    let mut bytes = fs::read(&good).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0x01;
    fs::write(&good, &bytes).unwrap();
    let (_ssd, report) = SsdTier::open(SsdConfig {
        verify: true,
        ..cfg(root.path())
    })
    .unwrap();
    assert_eq!(report.removed_corrupt, 1);
    assert_eq!(report.entries, 0);
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
    let ours = ns_dir.join(ssd.owner.tmp_name("a.wkv", 0));
    let theirs = ns_dir.join(other.owner.tmp_name("b.wkv", 0));
    let dead = ns_dir.join(format!("c.{EXTENSION}.deadhost-1-0.1.tmp"));
    let legacy = ns_dir.join(format!("d.{EXTENSION}.12345.1.tmp"));
    for p in [&ours, &theirs, &dead, &legacy] {
        fs::write(p, b"x").unwrap();
    }
    fs::write(
        root.path().join("fp1").join(".owner-deadhost-1-0.lock"),
        b"",
    )
    .unwrap();
    let mut indexed = 0;
    let report = scan(
        &root.path().join("fp1"),
        &cfg(root.path()),
        &ssd.owner,
        |_| indexed += 1,
    )
    .unwrap();
    assert_eq!((indexed, report.removed_orphans), (1, 2), "{report:?}");
    assert_eq!(report.removed_stale_locks, 1);
    assert!(ours.exists() && theirs.exists() && !dead.exists() && !legacy.exists());
    // Once `other` is gone, its leftovers are orphans.
    drop(other);
    let report = scan(
        &root.path().join("fp1"),
        &cfg(root.path()),
        &ssd.owner,
        |_| {},
    )
    .unwrap();
    assert_eq!(report.removed_orphans, 1);
    assert!(ours.exists() && !theirs.exists());
}
