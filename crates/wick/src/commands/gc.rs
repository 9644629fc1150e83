//! `wick gc`: list (by default) or remove (`--yes`) what the Hugging Face cache and the
//! store hold that no model uses: old snapshots, unreferenced blobs, abandoned partial
//! downloads, stale locks, temporaries of interrupted pulls.
use clap::Args;
use wick_hub::Store;

#[derive(Args)]
pub struct GcArgs {
    /// Remove what is listed (without it, nothing is removed).
    #[arg(long, short = 'y')]
    yes: bool,
    /// Only list (the default; wins over --yes).
    #[arg(long)]
    dry_run: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: GcArgs) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let garbage = store.garbage();
    let total: u64 = garbage.iter().map(|g| g.bytes).sum();
    let remove = args.yes && !args.dry_run;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"items": garbage, "bytes": total, "removed": remove})
        );
    } else {
        for g in &garbage {
            println!(
                "{:>10.1}MB  {}  ({})",
                g.bytes as f64 / 1e6,
                g.path.display(),
                g.reason
            );
        }
    }
    if remove {
        let freed = store.collect_garbage(&garbage)?;
        eprintln!(
            "wick: removed {} items, {:.1} MB freed",
            garbage.len(),
            freed as f64 / 1e6
        );
    } else if !garbage.is_empty() {
        eprintln!(
            "wick: {} items, {:.1} MB; nothing removed (dry run): run `wick gc --yes` to remove them",
            garbage.len(),
            total as f64 / 1e6
        );
    } else {
        eprintln!("wick: nothing to collect");
    }
    Ok(())
}
