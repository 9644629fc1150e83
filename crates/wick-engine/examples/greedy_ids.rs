//! Debug helper: greedy continuation of a comma-separated id list on a GGUF model.
use wick_engine::backend::candle::CandleBackend;
use wick_engine::config::ModelConfig;
use wick_engine::models::decoder::{BatchItem, Decoder, LogitsRequest};
use wick_engine::weights::GgufWeights;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let file = wick_gguf::GgufFile::open(&args[1])?;
    let ids: Vec<u32> = args[2]
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let n: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(16);
    let cfg = ModelConfig::from_gguf(file.metadata(), &args[1])?;
    let t = std::time::Instant::now();
    let model = Decoder::load(CandleBackend::cpu(), cfg, &GgufWeights::new(&file))?;
    eprintln!("loaded in {:?}", t.elapsed());
    let mut cache = model.new_cache();
    let mut next = ids.clone();
    let mut out = Vec::new();
    let t = std::time::Instant::now();
    for step in 0..n {
        let logits = model.forward(&mut [BatchItem {
            tokens: &next,
            cache: &mut cache,
            logits: LogitsRequest::Last,
        }])?;
        let l = logits[0].as_ref().unwrap();
        let row = l.last();
        if step == 0 {
            let mut top: Vec<(usize, f32)> = row.iter().copied().enumerate().collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            eprintln!("top5 {:?} prefill {:?}", &top[..5], t.elapsed());
        }
        let id = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        out.push(id);
        next = vec![id];
    }
    eprintln!("{} tokens in {:?}", n, t.elapsed());
    println!(
        "{}",
        out.iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    Ok(())
}
