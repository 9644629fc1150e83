//! `wick rm NAME`: remove a local model (a store model, or every revision of a Hugging
//! Face cache repository).
use clap::Args;
use wick_hub::Store;

#[derive(Args)]
pub struct RmArgs {
    /// The model's exact name, as `wick ls` shows it.
    name: String,
}

pub fn run(args: RmArgs) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let (path, bytes) = store.remove(&args.name)?;
    eprintln!(
        "wick: removed {} ({:.1} MB)",
        path.display(),
        bytes as f64 / 1e6
    );
    Ok(())
}
