//! A small mutation fuzzer that runs on the stable toolchain, for CI (the cargo-fuzz target in
//! `crates/wick-chat/fuzz` needs nightly). Each target takes seed inputs, mutates them (bit
//! flips, interesting integers, cut/duplicated/spliced chunks, dictionary fragments) and feeds
//! them to the code under test for a time budget. A panic is a finding: the input is saved and
//! the run fails. An abort (a huge allocation) kills the process, which fails the run too; the
//! seed printed at start and the iteration number reproduce it.
//!
//! `cargo run --release -p wick-fuzz -- --secs 30` runs every target for 30 s each;
//! `WICK_FUZZ_SECS` and `WICK_FUZZ_SEED` set the budget and the seed.
pub mod targets;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// xorshift64*: small, deterministic, good enough to pick mutations.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// True with probability 1/`n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
}

/// Integers that tend to break size checks, as little-endian bytes of several widths.
const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    7,
    8,
    31,
    32,
    255,
    256,
    4096,
    65535,
    65536,
    0x7FFF_FFFF,
    0x8000_0000,
    0xFFFF_FFFF,
    0x1_0000_0000,
    0x7FFF_FFFF_FFFF_FFFF,
    u64::MAX,
    u64::MAX - 7,
];

/// One mutation of `input`, using `dict` fragments and `seeds` for splicing.
pub fn mutate(input: &[u8], rng: &mut Rng, dict: &[&[u8]], seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let len = out.len();
        match rng.below(9) {
            0 if len > 0 => {
                let at = rng.below(len);
                out[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                out[at] = rng.next_u64() as u8;
            }
            2 if len > 0 => {
                // An interesting integer over 1, 2, 4 or 8 bytes at a random place.
                let width = [1, 2, 4, 8][rng.below(4)];
                let at = rng.below(len);
                let value = INTERESTING[rng.below(INTERESTING.len())];
                let bytes = value.to_le_bytes();
                for (i, b) in bytes.iter().take(width).enumerate() {
                    if let Some(slot) = out.get_mut(at + i) {
                        *slot = *b;
                    }
                }
            }
            3 if len > 1 => {
                let start = rng.below(len);
                let end = (start + 1 + rng.below(64)).min(len);
                out.drain(start..end);
            }
            4 if len > 0 => {
                let start = rng.below(len);
                let end = (start + 1 + rng.below(64)).min(len);
                let chunk = out[start..end].to_vec();
                let at = rng.below(out.len() + 1);
                out.splice(at..at, chunk);
            }
            5 | 6 if !dict.is_empty() => {
                let frag = dict[rng.below(dict.len())];
                let at = rng.below(out.len() + 1);
                if rng.one_in(2) && at + frag.len() <= out.len() {
                    out[at..at + frag.len()].copy_from_slice(frag);
                } else {
                    out.splice(at..at, frag.iter().copied());
                }
            }
            7 if !seeds.is_empty() => {
                // Splice: our head, another seed's tail.
                let other = &seeds[rng.below(seeds.len())];
                let cut = rng.below(out.len() + 1);
                let from = rng.below(other.len() + 1);
                out.truncate(cut);
                out.extend_from_slice(&other[from..]);
            }
            _ if len > 0 => {
                out.truncate(rng.below(len));
            }
            _ => out.push(rng.next_u64() as u8),
        }
    }
    out
}

/// What one target run did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Target name.
    pub target: &'static str,
    /// Inputs run.
    pub inputs: u64,
    /// Inputs the code under test accepted (the rest were clean errors).
    pub accepted: u64,
    /// Panics found, with where their input was saved.
    pub findings: Vec<(String, PathBuf)>,
}

/// Whether one input was accepted (`Ok(true)`), refused with an error (`Ok(false)`).
pub type Outcome = bool;

/// The code under test of a target: runs one input, returns whether it was accepted.
pub type RunOne = Box<dyn FnMut(&[u8]) -> Outcome>;

/// A fuzz target: seeds, a dictionary, and the code to run on one input.
pub struct Target {
    /// Short name (`gguf`, `ssd` …).
    pub name: &'static str,
    /// Seed inputs (valid files or texts).
    pub seeds: Vec<Vec<u8>>,
    /// Fragments worth inserting.
    pub dict: Vec<Vec<u8>>,
    /// Runs one input; returns whether it was accepted. Panics are findings.
    pub run: RunOne,
}

/// Runs `target` for `budget` (seeds first, unmutated), saving panicking inputs in `out_dir`.
pub fn run_target(mut target: Target, budget: Duration, seed: u64, out_dir: &Path) -> Report {
    let mut report = Report {
        target: target.name,
        ..Report::default()
    };
    let mut rng = Rng::new(seed ^ fnv(target.name));
    let dict: Vec<&[u8]> = target.dict.iter().map(Vec::as_slice).collect();
    let started = Instant::now();
    let mut queue: Vec<Vec<u8>> = target.seeds.clone();
    let mut iteration = 0u64;
    while started.elapsed() < budget || iteration < queue.len() as u64 {
        let input = if (iteration as usize) < target.seeds.len() {
            target.seeds[iteration as usize].clone()
        } else {
            let base = &queue[rng.below(queue.len())];
            mutate(base, &mut rng, &dict, &target.seeds)
        };
        iteration += 1;
        let result = catch_unwind(AssertUnwindSafe(|| (target.run)(&input)));
        report.inputs += 1;
        match result {
            Ok(true) => {
                report.accepted += 1;
                // Accepted inputs are good bases for further mutation (bounded pool).
                if queue.len() < 256 && rng.one_in(8) {
                    queue.push(input);
                }
            }
            Ok(false) => {}
            Err(payload) => {
                let message = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "non-string panic".into());
                let _ = std::fs::create_dir_all(out_dir);
                let path = out_dir.join(format!("{}-{iteration}.bin", target.name));
                let _ = std::fs::write(&path, &input);
                report.findings.push((message, path));
                if report.findings.len() >= 5 {
                    break;
                }
            }
        }
    }
    report
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_are_deterministic_and_vary() {
        let seed = b"hello world, a seed input".to_vec();
        let dict: &[&[u8]] = &[b"<|im_start|>"];
        let run = |s| {
            let mut rng = Rng::new(s);
            (0..50)
                .map(|_| mutate(&seed, &mut rng, dict, std::slice::from_ref(&seed)))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        let outs = run(7);
        assert!(outs.iter().any(|o| o != &seed));
        assert!(outs.iter().collect::<std::collections::HashSet<_>>().len() > 25);
    }

    #[test]
    fn a_panicking_target_is_reported_with_its_input() {
        let dir = tempfile::tempdir().unwrap();
        let target = Target {
            name: "demo",
            seeds: vec![b"ok".to_vec()],
            dict: vec![b"boom".to_vec()],
            run: Box::new(|input: &[u8]| {
                if input.windows(4).any(|w| w == b"boom") {
                    panic!("found boom");
                }
                true
            }),
        };
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let report = run_target(target, Duration::from_millis(500), 1, dir.path());
        std::panic::set_hook(hook);
        assert!(!report.findings.is_empty(), "{report:?}");
        let (message, path) = &report.findings[0];
        assert_eq!(message, "found boom");
        let saved = std::fs::read(path).unwrap();
        assert!(saved.windows(4).any(|w| w == b"boom"));
    }
}
