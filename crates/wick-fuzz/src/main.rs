//! `wick-fuzz [--secs N] [--seed S] [--out DIR] [TARGET...]`: runs the fuzz targets (all when
//! none is named) for N seconds each (default `WICK_FUZZ_SECS`, else 30), prints what each
//! tried, and exits 1 when any input panicked (saved under DIR, default `target/fuzz-findings`).
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use wick_fuzz::targets;

struct Args {
    secs: f64,
    seed: u64,
    out: PathBuf,
    names: Vec<String>,
}

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        secs: env_or("WICK_FUZZ_SECS", 30.0),
        seed: env_or("WICK_FUZZ_SEED", 0x5eed),
        out: PathBuf::from("target/fuzz-findings"),
        names: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().with_context(|| format!("{flag} needs a value"));
        match arg.as_str() {
            "--secs" => args.secs = value("--secs")?.parse().context("--secs")?,
            "--seed" => args.seed = value("--seed")?.parse().context("--seed")?,
            "--out" => args.out = PathBuf::from(value("--out")?),
            "-h" | "--help" => {
                println!(
                    "usage: wick-fuzz [--secs N] [--seed S] [--out DIR] [TARGET...]\ntargets: {}",
                    targets::NAMES.join(", ")
                );
                std::process::exit(0);
            }
            name if targets::NAMES.contains(&name) => args.names.push(name.to_string()),
            other => bail!(
                "unknown argument {other:?} (targets: {})",
                targets::NAMES.join(", ")
            ),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("wick-fuzz: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool> {
    let args = parse_args()?;
    println!(
        "wick-fuzz: seed {} ({}s per target; WICK_FUZZ_SEED/WICK_FUZZ_SECS to change)",
        args.seed, args.secs
    );
    // Panics are findings, reported below; the default hook prints each one (with a
    // backtrace under RUST_BACKTRACE=1) only when WICK_FUZZ_TRACE is set.
    if std::env::var_os("WICK_FUZZ_TRACE").is_none() {
        std::panic::set_hook(Box::new(|_| {}));
    }
    let mut clean = true;
    for target in targets::all()? {
        if !args.names.is_empty() && !args.names.iter().any(|n| n == target.name) {
            continue;
        }
        let name = target.name;
        let started = Instant::now();
        let report = wick_fuzz::run_target(
            target,
            Duration::from_secs_f64(args.secs),
            args.seed,
            &args.out,
        );
        println!(
            "{name:>14}: {} inputs ({} accepted, {} refused with an error) in {:.1}s, {} panics",
            report.inputs,
            report.accepted,
            report.inputs - report.accepted,
            started.elapsed().as_secs_f64(),
            report.findings.len()
        );
        for (message, path) in &report.findings {
            clean = false;
            println!(
                "    PANIC: {message}\n    input saved to {}",
                path.display()
            );
        }
    }
    Ok(clean)
}
