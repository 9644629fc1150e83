//! `wick fit MODEL`: whether a model and context fit this machine's memory, the largest
//! context that does, and the decode speed memory bandwidth predicts.
use anyhow::Context;
use clap::Args;
use serde_json::json;
use wick_engine::backend::candle::KvDtype;
use wick_hub::fit::{Device, FitModel, FitReport, Machine};
use wick_hub::Store;

#[derive(Args)]
pub struct FitArgs {
    /// Model (a name, ORG/NAME, a .gguf file or a model directory).
    model: String,
    /// Context length in tokens (default: 8192, capped at the model's).
    #[arg(long)]
    ctx: Option<usize>,
    /// KV cache type: f16 or f32 (default: what `wick serve` uses for the format).
    #[arg(long, value_parser = ["f16", "f32"])]
    kv_type: Option<String>,
    /// Memory the model may use, in decimal GB (default: 75 % of RAM, or 90 % of GPU memory
    /// with --backend mlx on a machine with an NVIDIA GPU).
    #[arg(long)]
    memory_budget: Option<f64>,
    /// Where it would run: cpu (RAM) or mlx (the GPU when there is one).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "candle", "mlx", "cuda"])]
    backend: String,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Decimal GB → bytes, refusing what is not a positive finite number.
pub fn budget_bytes(gb: Option<f64>) -> anyhow::Result<Option<u64>> {
    gb.map(|g| {
        anyhow::ensure!(
            g.is_finite() && g > 0.0,
            "--memory-budget must be a positive number of GB, not {g}"
        );
        Ok((g * 1e9) as u64)
    })
    .transpose()
}

/// The device a backend name runs on.
pub fn device(backend: &str) -> Device {
    if backend == "mlx" || backend == "cuda" {
        Device::Gpu
    } else {
        Device::Cpu
    }
}

/// The JSON of one assessment (`wick fit --json`).
pub fn report_json(
    model: &FitModel,
    name: &str,
    machine: &Machine,
    report: &FitReport,
) -> serde_json::Value {
    let mut v = serde_json::to_value(report).unwrap_or_default();
    if let Some(obj) = v.as_object_mut() {
        obj.insert("model".into(), json!(name));
        obj.insert("path".into(), json!(model.path));
        obj.insert("arch".into(), json!(model.arch));
        obj.insert("params".into(), json!(model.params));
        obj.insert("quant".into(), json!(model.quant));
        obj.insert("context_length".into(), json!(model.context_length));
        let kv: KvDtype = report.kv_type.parse().unwrap_or(model.default_kv);
        obj.insert(
            "kv_bytes_per_token".into(),
            json!(model.kv_bytes(16, kv) / 16),
        );
        obj.insert(
            "machine".into(),
            serde_json::to_value(machine).unwrap_or_default(),
        );
    }
    v
}

/// A human-readable report.
pub fn report_text(name: &str, model: &FitModel, machine: &Machine, r: &FitReport) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    let mut s = String::new();
    s += &format!(
        "{name}: {} {} params, {}, context {}\n",
        model.arch,
        human_count(model.params),
        model.quant,
        model.context_length
    );
    s += &format!("  weights    {:>9.3} GB\n", gb(r.weights_bytes));
    s += &format!(
        "  KV         {:>9.3} GB  ({} tokens, {})\n",
        gb(r.kv_bytes),
        r.context_tokens,
        r.kv_type
    );
    s += &format!("  transient  {:>9.3} GB\n", gb(r.transient_bytes));
    s += &format!("  total      {:>9.3} GB\n", gb(r.total_bytes));
    s += &format!(
        "  usable     {:>9.3} GB  ({}{})\n",
        gb(r.usable_bytes),
        machine.chip,
        machine.gpu.as_ref().map(|_| " memory").unwrap_or("")
    );
    s += &format!(
        "  {}; the largest context that fits is {} tokens\n",
        if r.fits { "fits" } else { "does NOT fit" },
        r.max_context
    );
    s += &format!(
        "  predicted decode ≈ {:.1} tok/s ({:.0} GB/s, {})",
        r.predicted_decode_tps, machine.bandwidth_gbs, machine.bandwidth_source
    );
    s
}

/// 135M, 1.5B …
pub fn human_count(n: u64) -> String {
    match n {
        0 => "-".into(),
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.0}M", n as f64 / 1e6),
        n => format!("{:.0}K", n as f64 / 1e3),
    }
}

pub fn run(args: FitArgs) -> anyhow::Result<()> {
    let store = Store::from_env()?;
    let resolved = store
        .resolve(&args.model)
        .with_context(|| format!("cannot find model '{}'", args.model))?;
    let model = FitModel::read(&resolved.path, resolved.kind)?;
    if let Some(c) = args.ctx {
        anyhow::ensure!(c > 0, "--ctx must be positive");
    }
    let kv = crate::model_arg::kv_dtype(args.kv_type.as_deref())?;
    let machine = Machine::detect(device(&args.backend), store.root());
    let report = model.assess(args.ctx, kv, &machine, budget_bytes(args.memory_budget)?);
    if args.json {
        println!("{}", report_json(&model, &resolved.name, &machine, &report));
    } else {
        println!("{}", report_text(&resolved.name, &model, &machine, &report));
    }
    Ok(())
}
