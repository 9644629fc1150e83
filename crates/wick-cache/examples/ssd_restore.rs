//! Restore time of one SSD entry stored whole (format 2's layout) and in shared chunks
//! (format 3), on the same machine in the same minutes: ABBA rounds, median per layout.
//!
//! ```text
//! cargo run --release -p wick-cache --example ssd_restore -- [TOKENS] [ROUNDS] [DIR]
//! ```
//!
//! The entry has SmolLM2-135M's KV shape (30 layers of 3 KV heads of 64 floats, 45 KiB per
//! token); the files are read from the page cache, as after a quick restart.
use std::time::{Duration, Instant};

use wick_cache::ssd::SsdTier;
use wick_cache::{KvSnapshot, LayerSnapshot, SsdConfig};

const LAYERS: usize = 30;
const HEADS: usize = 3;
const DIM: usize = 64;

fn snapshot(tokens: &[u32]) -> KvSnapshot {
    let n = tokens.len() * HEADS * DIM;
    KvSnapshot {
        layers: (0..LAYERS)
            .map(|l| LayerSnapshot {
                start: 0,
                len: tokens.len(),
                kv_heads: HEADS,
                head_dim: DIM,
                window: None,
                keys: (0..n).map(|i| (i + l) as f32 * 1e-3).collect(),
                values: (0..n).map(|i| -((i + l) as f32) * 1e-3).collect(),
            })
            .collect(),
        recurrent: Vec::new(),
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let tokens: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4096);
    let rounds: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(10);
    let root = match args.get(3) {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .expect("a scratch directory");
    let t: Vec<u32> = (0..tokens as u32).collect();
    let snap = snapshot(&t);
    let open = |name: &str, chunk_tokens: usize| {
        let (tier, _) = SsdTier::open(SsdConfig {
            root: root.path().to_path_buf(),
            fingerprint: name.into(),
            model: "bench".into(),
            max_bytes: 0,
            verify: false,
        })
        .expect("the tier opens");
        if chunk_tokens == 0 {
            tier.set_chunk_tokens(0);
        }
        tier.store("", &t, &snap, None).expect("stored");
        tier
    };
    let whole = open("whole", 0);
    let chunked = open("chunked", 64);
    let mut prompt = t.clone();
    prompt.push(1);
    let restore = |tier: &SsdTier| {
        let m = tier.find("", &prompt).expect("a match");
        let started = Instant::now();
        let s = tier.load(&m).expect("restored");
        let took = started.elapsed();
        assert_eq!(s.len(), tokens);
        took
    };
    // Warm the page cache.
    restore(&whole);
    restore(&chunked);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        if r % 2 == 0 {
            a.push(restore(&whole));
            b.push(restore(&chunked));
        } else {
            b.push(restore(&chunked));
            a.push(restore(&whole));
        }
    }
    let (a, b) = (median(a), median(b));
    let mib = snap.byte_size() as f64 / (1 << 20) as f64;
    println!(
        "{tokens} tokens ({mib:.0} MiB of KV), median of {rounds}: whole {:.1} ms, chunks {:.1} ms ({:.2}x)",
        a.as_secs_f64() * 1e3,
        b.as_secs_f64() * 1e3,
        b.as_secs_f64() / a.as_secs_f64()
    );
}
