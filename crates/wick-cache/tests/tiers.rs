//! The two tiers and the writer together, on real files: write-behind, busy deferral,
//! spills on eviction, SSD-over-RAM only when strictly better, flush reports, restart.
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{holds, Loader, TestKv};
use wick_cache::{HitSource, PromptCache, PromptCacheConfig, SsdConfig, Timing};

fn fast() -> Timing {
    Timing {
        debounce: Duration::from_millis(30),
        retry: Duration::from_millis(60),
        max_defer: Duration::from_secs(30),
    }
}

fn config(root: &Path, ram_bytes: usize) -> PromptCacheConfig {
    PromptCacheConfig {
        ram_bytes,
        ssd: Some(SsdConfig {
            root: root.to_path_buf(),
            fingerprint: "tiers".into(),
            model: "test".into(),
            max_bytes: 0,
            verify: false,
        }),
        write_behind: true,
        timing: fast(),
        ..PromptCacheConfig::default()
    }
}

fn seq(family: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|j| family * 100_000 + j).collect()
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn write_behind_waits_for_idle_then_survives_a_restart() {
    let root = tempfile::tempdir().unwrap();
    let t = seq(1, 300);
    {
        let cache = PromptCache::new(config(root.path(), 1 << 30)).unwrap();
        cache.set_busy(true);
        cache.put("", &t, TestKv::new(&t));
        std::thread::sleep(Duration::from_millis(300));
        let ssd = cache.stats().ssd.unwrap();
        assert_eq!(
            (ssd.entries, ssd.pending_snapshots),
            (0, 1),
            "written while busy"
        );
        cache.set_busy(false);
        wait_until("write-behind", || cache.stats().ssd.unwrap().entries == 1);
        assert_eq!(cache.stats().ssd.unwrap().pending_snapshots, 0);
    }
    let cache = PromptCache::new(config(root.path(), 1 << 30)).unwrap();
    assert_eq!(
        cache
            .wait_for_scan(Duration::from_secs(20))
            .unwrap()
            .entries,
        1
    );
    let mut prompt = t.clone();
    prompt.push(5);
    let hit = cache.lookup("", &prompt, &Loader);
    assert_eq!((hit.cached, hit.source), (300, Some(HitSource::Ssd)));
    assert!(holds(&hit.value.unwrap().0, &t));
}

#[test]
fn evicted_entries_spill_and_ssd_wins_only_when_strictly_longer() {
    let root = tempfile::tempdir().unwrap();
    let one = TestKv::new(&seq(0, 100)).0.byte_size();
    let mut cfg = config(root.path(), one + one / 2);
    cfg.write_behind = false;
    let cache = PromptCache::new(cfg).unwrap();
    let a = seq(1, 100);
    let b = seq(2, 100);
    cache.put("", &a, TestKv::new(&a));
    cache.put("", &b, TestKv::new(&b)); // evicts `a`, which spills
    let report = cache.flush(Duration::from_secs(10));
    assert!(report.durable, "{report:?}");
    let ssd = cache.stats().ssd.unwrap();
    assert_eq!(ssd.entries, 2, "{ssd:?}");
    assert_eq!(cache.stats().entries, 1);
    let mut pa = a.clone();
    pa.push(1);
    let hit = cache.lookup("", &pa, &Loader);
    assert_eq!((hit.cached, hit.source), (100, Some(HitSource::Ssd)));
    // `b` is in both tiers with the same length: RAM serves it.
    let mut pb = b.clone();
    pb.push(1);
    let hit = cache.lookup("", &pb, &Loader);
    assert_eq!((hit.cached, hit.source), (100, Some(HitSource::Ram)));
    assert!(holds(&hit.value.unwrap().0, &b));
    let stats = cache.stats();
    assert_eq!((stats.ram_hits, stats.ssd_hits, stats.misses), (1, 1, 0));
}

#[test]
fn flush_writes_every_dirty_entry_and_reports_what_it_cannot() {
    let root = tempfile::tempdir().unwrap();
    let mut cfg = config(root.path(), 1 << 30);
    cfg.timing.debounce = Duration::from_secs(3600);
    let cache = PromptCache::new(cfg).unwrap();
    for f in 0..3 {
        let t = seq(f, 50 + f as usize);
        cache.put("", &t, TestKv::new(&t));
    }
    let ns_t = seq(9, 40);
    cache.put("adapter", &ns_t, TestKv::new(&ns_t));
    assert_eq!(cache.stats().ssd.unwrap().pending_snapshots, 4);
    let report = cache.flush(Duration::from_secs(10));
    assert!(report.durable && report.enabled, "{report:?}");
    assert_eq!(report.flushed_snapshots, 4);
    assert_eq!(cache.stats().ssd.unwrap().entries, 4);
    // Nothing new: the next flush is immediate and durable.
    let again = cache.flush(Duration::from_secs(10));
    assert!(again.durable && again.flushed_snapshots == 0, "{again:?}");

    // A disk that refuses every entry: not durable, and the entry that left RAM
    // unwritten is reported once as missing.
    let root2 = tempfile::tempdir().unwrap();
    let one = TestKv::new(&seq(0, 100)).0.byte_size();
    let mut cfg = config(root2.path(), one + one / 2);
    cfg.timing.debounce = Duration::from_secs(3600);
    cfg.ssd.as_mut().unwrap().max_bytes = 1024;
    let cache = PromptCache::new(cfg).unwrap();
    let a = seq(1, 100);
    let b = seq(2, 100);
    cache.put("", &a, TestKv::new(&a));
    cache.put("", &b, TestKv::new(&b));
    let report = cache.flush(Duration::from_secs(10));
    assert!(!report.durable, "{report:?}");
    assert_eq!(report.missing_snapshots, 1, "{report:?}");
    assert!(report.failed_spills >= 1, "{report:?}");
    let again = cache.flush(Duration::from_secs(10));
    assert_eq!(
        again.missing_snapshots, 0,
        "missing entries are reported once"
    );
    assert!(!again.durable, "`b` still cannot be written");
}

#[test]
fn without_ssd_flush_has_nothing_to_do_and_ssd_needs_ram() {
    let cache: PromptCache<TestKv> = PromptCache::new(PromptCacheConfig::default()).unwrap();
    let r = cache.flush(Duration::from_secs(1));
    assert!(r.durable && !r.enabled);
    let root = tempfile::tempdir().unwrap();
    assert!(PromptCache::<TestKv>::new(config(root.path(), 0)).is_err());
}

/// Issue 45: an SSD directory that cannot be used costs the tier, never the cache: the cache
/// serves from RAM and says why.
#[test]
fn an_unusable_ssd_directory_leaves_the_ram_cache_serving() {
    let check = |root: &Path, what: &str| {
        let cache = PromptCache::new(config(root, 1 << 30))
            .unwrap_or_else(|e| panic!("{what}: the cache did not start: {e}"));
        assert!(!cache.has_ssd(), "{what}");
        assert!(cache.ssd_unavailable().is_some(), "{what}");
        assert!(cache.stats().ssd.is_none());
        let t = seq(4, 100);
        cache.put("", &t, TestKv::new(&t));
        let mut p = t.clone();
        p.push(1);
        let hit = cache.lookup("", &p, &Loader);
        assert_eq!(
            (hit.cached, hit.source),
            (100, Some(HitSource::Ram)),
            "{what}"
        );
        assert!(cache.flush(Duration::from_secs(1)).durable);
    };
    // A root that cannot be created (below a regular file).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("file"), b"x").unwrap();
    check(&dir.path().join("file/kv"), "uncreatable");
    // A fingerprint directory planted as a link to somewhere else.
    #[cfg(unix)]
    {
        let root = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), root.path().join("tiers")).unwrap();
        check(root.path(), "linked");
        assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
    }
    // A read-only directory: by permissions where this test is not root, else a read-only
    // tmpfs where it may mount one.
    let ro = tempfile::tempdir().unwrap();
    #[cfg(unix)]
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(ro.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
        check(ro.path(), "read-only");
        std::fs::set_permissions(ro.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    } else if mount_read_only(ro.path()) {
        check(ro.path(), "read-only mount");
        let _ = std::process::Command::new("umount").arg(ro.path()).status();
    } else {
        eprintln!("read-only case not run: root without mount rights");
    }
}

#[cfg(unix)]
fn mount_read_only(dir: &Path) -> bool {
    std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "ro,size=1m", "tmpfs"])
        .arg(dir)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
