//! The agent workload of issue 43 on the SSD tier: 4 conversations of 20 turns, each turn's
//! prompt the previous turn's entry (prompt and reply) plus a tool output, interleaved as an
//! agent server sees them. Every turn looks its prompt up (a restore from disk), then stores
//! its prompt and reply, as the engine's write-behind does.
//!
//! It counts the bytes the tier writes (the sum of what each store reports, and on Linux the
//! process's `wchar`, every byte passed to `write`) with whole-entry files (format 2's layout,
//! `set_chunk_tokens(0)`) and with shared chunks (the default), for a model of plain attention
//! layers and for a hybrid one whose entries also keep a recurrent state, and checks that
//! chunks write at most 0.3× as much for the same hits and restored tokens:
//!
//! ```text
//! cargo test --release -p wick-cache --test agent_workload -- --nocapture
//! ```
//!
//! Bytes, not time, are measured, so the directory is on a RAM disk where there is one
//! (`/dev/shm`), where fsyncs cost nothing.
mod common;

use std::path::Path;

use common::{holds, snapshot_for};
use wick_cache::ssd::{SsdTier, StoreOutcome};
use wick_cache::{KvSnapshot, SsdConfig, StateSnapshot};

const CONVERSATIONS: u32 = 4;
const TURNS: u32 = 20;
/// The system prompt and tool definitions every conversation starts with.
const SYSTEM: usize = 300;

/// A deterministic pseudo-random number in `lo..hi` for `(conversation, turn, what)`.
fn pick(c: u32, t: u32, what: u32, lo: usize, hi: usize) -> usize {
    let mut x = (c as u64) << 40 ^ (t as u64) << 20 ^ what as u64 ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    lo + (x % (hi - lo) as u64) as usize
}

/// `n` tokens of conversation `c`, turn `t`, part `what`: distinct across all of them.
fn fresh(c: u32, t: u32, what: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|j| 1_000_000 + c * 100_000_000 + t * 1_000_000 + what * 100_000 + j)
        .collect()
}

/// The KV of `tokens`; with `recurrent`, also a recurrent state that depends on every token
/// (a hybrid model such as Qwen 3.5: such entries serve only their exact length).
fn kv(tokens: &[u32], recurrent: bool) -> KvSnapshot {
    let mut s = snapshot_for(tokens);
    if recurrent {
        let sum: f32 = tokens.iter().map(|&t| (t % 1000) as f32).sum();
        s.recurrent = (0..2)
            .map(|l| StateSnapshot {
                conv: vec![sum + l as f32; 3 * 64],
                ssm: vec![-sum - l as f32; 16 * 64],
            })
            .collect();
    }
    s
}

#[derive(Debug, Default, PartialEq)]
struct Outcome {
    /// Sum of the bytes each store reported writing.
    stored_bytes: u64,
    /// The process's `wchar` growth (Linux), every byte passed to `write`.
    wchar: Option<u64>,
    /// Turns whose prompt found a stored prefix.
    hits: u32,
    /// Prompt tokens those hits restored.
    restored_tokens: u64,
    /// Bytes on disk at the end.
    disk_bytes: u64,
}

fn wchar() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("wchar: "))
        .and_then(|v| v.trim().parse().ok())
}

fn disk_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let m = e.metadata().unwrap();
        n += if m.is_dir() {
            disk_bytes(&e.path())
        } else {
            m.len()
        };
    }
    n
}

fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    match shm.is_dir() {
        true => tempfile::tempdir_in(shm).or_else(|_| tempfile::tempdir()),
        false => tempfile::tempdir(),
    }
    .unwrap()
}

/// Runs the workload on a fresh directory; `configure` sets the tier up (its layout).
fn run(recurrent: bool, configure: impl Fn(&SsdTier)) -> Outcome {
    let root = scratch();
    let (tier, _) = SsdTier::open(SsdConfig {
        root: root.path().to_path_buf(),
        fingerprint: "agent".into(),
        model: "test".into(),
        max_bytes: 0,
        verify: false,
    })
    .unwrap();
    configure(&tier);
    let system = fresh(0, 0, 0, SYSTEM);
    let mut history: Vec<Vec<u32>> = (0..CONVERSATIONS)
        .map(|c| {
            let mut p = system.clone();
            p.extend(fresh(c + 1, 0, 1, pick(c, 0, 1, 20, 60)));
            p
        })
        .collect();
    let mut out = Outcome::default();
    let w0 = wchar();
    for t in 1..=TURNS {
        for c in 0..CONVERSATIONS {
            let prompt = history[c as usize].clone();
            if let Some(m) = tier.find("", &prompt) {
                let snap = tier.load(&m).unwrap();
                assert!(holds_prefix(&snap, &prompt, m.usable, recurrent));
                out.hits += 1;
                out.restored_tokens += m.usable as u64;
            }
            // The reply the model generates, stored with the prompt.
            let mut entry = prompt;
            entry.extend(fresh(c + 1, t, 2, pick(c, t, 2, 20, 60)));
            match tier
                .store("", &entry, &kv(&entry, recurrent), None)
                .unwrap()
            {
                StoreOutcome::Stored { bytes, .. } => out.stored_bytes += bytes,
                StoreOutcome::AlreadyDurable => {}
            }
            // The next prompt: this turn's entry and a tool output.
            entry.extend(fresh(c + 1, t, 3, pick(c, t, 3, 30, 150)));
            history[c as usize] = entry;
        }
    }
    out.wchar = w0.zip(wchar()).map(|(a, b)| b - a);
    out.disk_bytes = disk_bytes(tier.dir());
    out
}

fn holds_prefix(snap: &KvSnapshot, prompt: &[u32], usable: usize, recurrent: bool) -> bool {
    let mut plain = snap.clone();
    plain.recurrent.clear();
    holds(&plain, &prompt[..usable]) && (!recurrent || *snap == kv(&prompt[..usable], true))
}

fn report(name: &str, o: &Outcome) {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "{name}: stored {:.1} MiB (wchar {}), {} hits of {} turns, {} tokens restored, {:.1} MiB on disk at the end",
        mib(o.stored_bytes),
        o.wchar
            .map_or("n/a".to_string(), |w| format!("{:.1} MiB", mib(w))),
        o.hits,
        CONVERSATIONS * TURNS,
        o.restored_tokens,
        mib(o.disk_bytes),
    );
}

#[test]
fn an_agent_loop_writes_its_conversation_once() {
    for recurrent in [false, true] {
        let kind = if recurrent { "hybrid" } else { "attention" };
        let whole = run(recurrent, |t| t.set_chunk_tokens(0));
        report(&format!("{kind}, whole entries"), &whole);
        let chunked = run(recurrent, |_| {});
        report(&format!("{kind}, shared chunks"), &chunked);
        let ratio = chunked.stored_bytes as f64 / whole.stored_bytes as f64;
        eprintln!("{kind}: {ratio:.3}x the bytes");
        assert!(ratio <= 0.3, "{kind}: {ratio:.3}x");
        if let (Some(a), Some(b)) = (chunked.wchar, whole.wchar) {
            // Every byte the process wrote, whatever the tier reports.
            assert!(a as f64 <= 0.3 * b as f64, "{kind}: wchar {a} vs {b}");
        }
        assert_eq!(
            (chunked.hits, chunked.restored_tokens),
            (whole.hits, whole.restored_tokens),
            "{kind}: the same hits"
        );
        assert!(chunked.hits >= CONVERSATIONS * (TURNS - 1));
    }
}
