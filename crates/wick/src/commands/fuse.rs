//! `wick fuse MODEL --adapter DIR [--save-path OUT]`: fold a LoRA adapter into a copy of
//! its base model, which `wick serve OUT` then serves without the adapter.
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

/// `wick fuse` flags (the reference's names).
#[derive(Args, Debug)]
pub struct FuseArgs {
    /// Base model: a catalog name, a local model, a GGUF file or a Hugging Face directory.
    pub model: Option<String>,
    /// The adapter: a PEFT or mlx-lm folder, or a llama.cpp GGUF LoRA file.
    #[arg(long)]
    pub adapter: PathBuf,
    /// The folder to write the fused model into (must not exist yet).
    #[arg(long, default_value = "fused_model")]
    pub save_path: PathBuf,
    /// Refused: a quantized base keeps its quantization layout.
    #[arg(long, hide = true)]
    pub de_quantize: bool,
    /// Refused: wick writes no GGUF from a Hugging Face folder.
    #[arg(long, hide = true)]
    pub export_gguf: bool,
    /// Refused, as --export-gguf.
    #[arg(long, hide = true)]
    pub gguf_path: Option<PathBuf>,
    /// Refused: wick uploads nothing.
    #[arg(long, hide = true)]
    pub upload_repo: Option<String>,
}

/// The reference's flags wick does not do, with what to do instead.
fn refuse_unsupported(args: &FuseArgs) -> Result<()> {
    if args.de_quantize {
        bail!(
            "--de-quantize is not supported: a quantized base keeps its per-module quantization \
             (fuse an unquantized copy of the base to get float weights)"
        );
    }
    if args.export_gguf || args.gguf_path.is_some() {
        bail!(
            "--export-gguf/--gguf-path are not supported: a GGUF base already fuses into a \
             GGUF file; convert a fused folder with llama.cpp's convert_hf_to_gguf.py"
        );
    }
    if args.upload_repo.is_some() {
        bail!(
            "--upload-repo is not supported: upload the fused folder with `hf upload REPO {}`",
            args.save_path.display()
        );
    }
    Ok(())
}

/// Runs `wick fuse`.
pub fn run(args: FuseArgs) -> Result<()> {
    refuse_unsupported(&args)?;
    let resolved = crate::model_arg::resolve_named(args.model.as_deref())?;
    eprintln!(
        "fusing {} into {} ({})",
        args.adapter.display(),
        resolved.name,
        resolved.path.display()
    );
    let report = wick_train::fuse::fuse(&resolved.path, &args.adapter, &args.save_path)
        .with_context(|| format!("fusing {}", args.adapter.display()))?;
    let size: u64 = report.files.iter().map(|f| f.1).sum();
    println!(
        "fused {} projections ({}, {} adapter) into {} ({:.1} MB)",
        report.modules,
        report.dtype,
        report.adapter_format.name(),
        report.out.display(),
        size as f64 / 1e6
    );
    println!("serve it: wick serve {}", report.out.display());
    Ok(())
}
