//! `wick ls [QUERY]`: local models.
use std::io::Write;

use clap::Args;
use wick_hub::Store;

#[derive(Args)]
pub struct LsArgs {
    /// Only models whose name contains this (case-insensitive).
    query: Option<String>,
}

pub fn run(args: LsArgs) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let q = args.query.map(|q| q.to_lowercase());
    // Write errors end the listing (a closed pipe exits quietly in `main`); `println!`
    // would panic on them.
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<48} {:>10} {:<8} {:<10} PATH",
        "NAME", "SIZE", "FORMAT", "ARCH"
    )?;
    for m in store.list() {
        if q.as_ref()
            .is_some_and(|q| !m.name.to_lowercase().contains(q))
        {
            continue;
        }
        writeln!(
            out,
            "{:<48} {:>8.1}MB {:<8} {:<10} {}",
            m.name,
            m.size_bytes as f64 / 1e6,
            m.format.to_string(),
            m.arch.clone().unwrap_or_default(),
            m.path.display()
        )?;
    }
    out.flush()?;
    Ok(())
}
