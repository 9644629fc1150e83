//! Debug helper: mean |logit diff| against llama.cpp goldens' first-step top-20, and
//! teacher-forced agreement, for one golden file.
use wick_engine::backend::candle::CandleBackend;
use wick_engine::config::ModelConfig;
use wick_engine::models::decoder::{BatchItem, Decoder, LogitsRequest, Want};
use wick_engine::weights::GgufWeights;

fn main() -> anyhow::Result<()> {
    let golden = std::env::args().nth(1).unwrap();
    let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(format!(
        "crates/wick-engine/tests/goldens/llamacpp/{golden}.json"
    ))?)?;
    let home = std::env::var("HOME")?;
    let file = format!(
        "{home}/.cache/wick/models/{golden}/{}",
        g["file"].as_str().unwrap()
    );
    let gguf = wick_gguf::GgufFile::open(&file)?;
    let cfg = ModelConfig::from_gguf(gguf.metadata(), &file)?;
    let model = Decoder::load(CandleBackend::cpu(), cfg, &GgufWeights::new(&gguf))?;
    let (mut agree, mut total) = (0, 0);
    for c in g["cases"].as_array().unwrap() {
        let ids = |k: &str| {
            c[k].as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect::<Vec<_>>()
        };
        let (p, cont) = (ids("prompt_ids"), ids("continuation_ids"));
        let mut all = p.clone();
        all.extend_from_slice(&cont[..cont.len() - 1]);
        let mut cache = model.new_cache();
        let out = model.forward_logits(&mut [BatchItem::new(
            &all,
            &mut cache,
            Want::logits(LogitsRequest::All),
        )])?;
        let l = out[0].as_ref().unwrap();
        let first = l.row(p.len() - 1);
        let top: Vec<(u32, f32)> = c["first_step_top20"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (x[0].as_u64().unwrap() as u32, x[1].as_f64().unwrap() as f32))
            .collect();
        let diffs: Vec<f32> = top.iter().map(|&(id, v)| first[id as usize] - v).collect();
        let mean = diffs.iter().map(|d| d.abs()).sum::<f32>() / diffs.len() as f32;
        let bias = diffs.iter().sum::<f32>() / diffs.len() as f32;
        let mut miss = Vec::new();
        for (i, &want) in cont.iter().enumerate() {
            let row = l.row(p.len() - 1 + i);
            let am = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32;
            total += 1;
            if am == want {
                agree += 1
            } else {
                miss.push((i, c["continuation_top2_gaps"][i].as_f64().unwrap()))
            }
        }
        println!(
            "{:16} mean|d| {mean:.3} bias {bias:+.3} misses {:?}",
            c["name"].as_str().unwrap(),
            miss
        );
    }
    println!("teacher-forced {agree}/{total}");
    Ok(())
}
