//! `wick pull ITEM`: fetch a catalog model or the test assets.
use clap::Args;
use wick_hub::{catalog, PullOptions, Store};

#[derive(Args)]
pub struct PullArgs {
    /// Catalog items (e.g. `default`, `qwen2.5-coder`, `gemma3`, `test-assets`); `all` for every one.
    #[arg(required = true)]
    items: Vec<String>,
    /// Re-hash installed files instead of trusting their size.
    #[arg(long)]
    verify: bool,
}

pub fn run(args: PullArgs) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let items: Vec<&'static catalog::CatalogItem> = if args.items.iter().any(|i| i == "all") {
        catalog::CATALOG.iter().collect()
    } else {
        args.items
            .iter()
            .map(|i| catalog::require(i))
            .collect::<Result<_, _>>()?
    };
    for item in items {
        let opts = PullOptions {
            verify: args.verify,
            ..PullOptions::default()
        };
        let pulled = store.pull(item, &opts, &mut crate::model_arg::print_progress)?;
        println!("{}\t{}", item.name, pulled.path.display());
    }
    Ok(())
}
